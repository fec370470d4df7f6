"""A mixture-of-experts layer's experts, dropless: every token's top-k rows computed, none dropped.

    tokens, positions, ends = moe_dispatch(experts, E)   # rows sorted by expert, on the device
    rows = moe_gather(x, tokens, positions)              # (T * k, H): row i is x[tokens[i]]
    h = grouped_mm(rows, gate_up_proj^T, ends)           # HF's (E, 2I, H) weights read in place
    y = grouped_mm(silu(h[:, :I]) * h[:, I:], down_proj^T, ends)   # one autograd node with the above
    out[t] = sum over j of weights[t, j] * y[positions[t, j]]   (moe_combine)

as HF's Qwen3-MoE / Qwen2-MoE / OLMoE / Mixtral experts compute it (their loop over experts),
with float32 sums. Nothing goes to the host: the sort and the group ends stay on the GPU.
moe_combine's backward writes each row's gradient once (a row is one slot) and the weights'
gradient as a dot product a slot; moe_gather's backward sums a token's k row gradients in slot
order through the same kernel: no atomics, deterministic. Design: docs/moe.md.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import runtime
from .grouped_mm import grouped_mm_db, grouped_mm_fwd
from .swiglu import swiglu_bwd_concat, swiglu_fwd

COMBINE_BLOCK_N = 1024


# The combine kernel asserts that each slot's expert is in [0, E) (CHECK_E), as HF's loop does on
# the GPU (one_hot's device-side assert): debug=True compiles the assert in, and the launch turns
# off the integer-overflow checks that debug would add. Checking on the host would wait for the GPU.
@triton.jit(debug=not runtime.INTERPRET)
def _combine_kernel(y_ptr, pos_ptr, w_ptr, e_ptr, out_ptr, N, E, stride_y, stride_pt, stride_pk, stride_wt,
                    stride_wk, stride_et, stride_ek, stride_o, TOP_K: tl.constexpr, HAS_W: tl.constexpr,
                    CHECK_E: tl.constexpr, BLOCK_N: tl.constexpr):
    """out[t] = sum over j, in order, of w[t, j] * y[pos[t, j]] (w = 1 without HAS_W), in float32."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = cols < N
    acc = tl.zeros((BLOCK_N,), tl.float32)
    for j in tl.static_range(TOP_K):
        if CHECK_E:
            e = tl.load(e_ptr + t * stride_et + j * stride_ek)
            tl.device_assert((e >= 0) & (e < E), "moe_experts: an index in experts is outside [0, num_experts)")
        p = tl.load(pos_ptr + t * stride_pt + j * stride_pk).to(tl.int64)
        y = tl.load(y_ptr + p * stride_y + cols, mask=ok, other=0.0).to(tl.float32)
        if HAS_W:
            y = y * tl.load(w_ptr + t * stride_wt + j * stride_wk).to(tl.float32)
        acc += y
    tl.store(out_ptr + t * stride_o + cols, acc.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _combine_bwd_kernel(dout_ptr, y_ptr, pos_ptr, w_ptr, dy_ptr, dw_ptr, N, stride_do, stride_y, stride_pt,
                        stride_pk, stride_wt, stride_wk, stride_dy, stride_dwt, stride_dwk,
                        TOP_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """For each slot j of token t: dy[pos[t, j]] = w[t, j] * dout[t] (the row's only writer) and
    dw[t, j] = <dout[t], y[pos[t, j]]> (float32)."""
    t = tl.program_id(0).to(tl.int64)
    for j in tl.static_range(TOP_K):
        p = tl.load(pos_ptr + t * stride_pt + j * stride_pk).to(tl.int64)
        w = tl.load(w_ptr + t * stride_wt + j * stride_wk).to(tl.float32)
        dot = tl.zeros((BLOCK_N,), tl.float32)
        for n0 in range(0, N, BLOCK_N):
            cols = n0 + tl.arange(0, BLOCK_N)
            ok = cols < N
            do = tl.load(dout_ptr + t * stride_do + cols, mask=ok, other=0.0).to(tl.float32)
            tl.store(dy_ptr + p * stride_dy + cols, (w * do).to(dy_ptr.dtype.element_ty), mask=ok)
            dot += do * tl.load(y_ptr + p * stride_y + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(dw_ptr + t * stride_dwt + j * stride_dwk, tl.sum(dot, 0).to(dw_ptr.dtype.element_ty))


_launch_combine = runtime.FastLaunch(_combine_kernel)
_launch_combine_bwd = runtime.FastLaunch(_combine_bwd_kernel)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t with a unit last stride (the kernels index columns densely)."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _fake_combine(y, positions, weights, experts=None, num_experts=0):
    return y.new_empty((positions.shape[0], y.shape[1]))


@runtime.custom_op("moe_combine_fwd", fake=_fake_combine)
def moe_combine_fwd(y: torch.Tensor, positions: torch.Tensor, weights: torch.Tensor | None,
                    experts: torch.Tensor | None = None, num_experts: int = 0) -> torch.Tensor:
    """(T, N): each token's rows of y weighted (or summed, without weights); with experts (T, k),
    a device-side assert that each is in [0, num_experts)."""
    y = _rows(y)
    (T, k), N = positions.shape, y.shape[1]
    out = runtime.empty((T, N), y.dtype, y.device)
    if out.numel() == 0:
        return out.zero_()
    w = weights if weights is not None else positions
    e = experts if experts is not None else positions
    block = min(COMBINE_BLOCK_N, runtime.next_power_of_2(N))
    launch = {} if runtime.INTERPRET else {"sanitize_overflow": False}
    _launch_combine((T, runtime.cdiv(N, block)), y, positions, w, e, out, N, num_experts, y.stride(0),
                    *positions.stride(), *w.stride(), *e.stride(), out.stride(0), TOP_K=k, HAS_W=weights is not None,
                    CHECK_E=experts is not None, BLOCK_N=block, num_warps=4, **launch)
    return out


def _fake_combine_bwd(dout, y, positions, weights):
    return y.new_empty(y.shape), weights.new_empty(weights.shape)


@runtime.custom_op("moe_combine_bwd", fake=_fake_combine_bwd)
def moe_combine_bwd(dout: torch.Tensor, y: torch.Tensor, positions: torch.Tensor,
                    weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(dy, dweights) of moe_combine_fwd with weights."""
    dout, y = _rows(dout), _rows(y)
    (T, k), N = positions.shape, y.shape[1]
    dy = runtime.empty(y.shape, y.dtype, y.device)
    dw = runtime.empty(weights.shape, weights.dtype, weights.device)
    if T == 0:
        return dy, dw
    block = min(COMBINE_BLOCK_N, runtime.next_power_of_2(max(N, 1)))
    _launch_combine_bwd((T,), dout, y, positions, weights, dy, dw, N, dout.stride(0), y.stride(0),
                        *positions.stride(), *weights.stride(), dy.stride(0), *dw.stride(), TOP_K=k, BLOCK_N=block,
                        num_warps=4)
    return dy, dw


class MoECombineFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, positions, weights, experts, num_experts):
        ctx.save_for_backward(y, positions, weights)
        return moe_combine_fwd(y, positions, weights, experts, num_experts)

    @staticmethod
    def backward(ctx, dout):
        y, positions, weights = ctx.saved_tensors
        dy, dw = moe_combine_bwd(dout, y, positions, weights)
        return dy, None, dw, None, None


class MoEGatherFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tokens, positions):
        ctx.save_for_backward(positions)
        return x.index_select(0, tokens)

    @staticmethod
    def backward(ctx, drows):
        (positions,) = ctx.saved_tensors
        return moe_combine_fwd(drows, positions, None), None, None


def _experts_mlp(rows, gate_up_proj, down_proj, ends) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, [gate | up]): the experts' SwiGLU MLP on their sorted rows."""
    gate_up = grouped_mm_fwd(rows, gate_up_proj.transpose(1, 2), ends)
    inter = gate_up_proj.shape[1] // 2
    return grouped_mm_fwd(swiglu_fwd(gate_up[:, :inter], gate_up[:, inter:]), down_proj.transpose(1, 2), ends), gate_up


class ExpertsMLPFunction(torch.autograd.Function):
    """y = grouped_mm(swiglu(gate, up), down_proj^T) with [gate | up] = grouped_mm(rows,
    gate_up_proj^T): one node, saving rows and [gate | up]; the backward writes [dgate | dup] into
    one buffer and recomputes the activation for down_proj's gradient instead of saving it."""

    @staticmethod
    def forward(ctx, rows, gate_up_proj, down_proj, ends):
        y, gate_up = _experts_mlp(rows, gate_up_proj, down_proj, ends)
        ctx.save_for_backward(rows, gate_up, gate_up_proj, down_proj, ends)
        return y

    @staticmethod
    def backward(ctx, dy):
        rows, gate_up, gate_up_proj, down_proj, ends = ctx.saved_tensors
        inter = gate_up_proj.shape[1] // 2
        dh = grouped_mm_fwd(dy, down_proj, ends)
        dgate_up, h = swiglu_bwd_concat(gate_up[:, :inter], gate_up[:, inter:], dh)
        del dh  # each intermediate freed once used: the peak stays that of the products' own outputs
        d_down_proj = (grouped_mm_db(h, dy, ends, down_proj.transpose(1, 2)).transpose(1, 2)
                       if ctx.needs_input_grad[2] else None)
        del h, dy
        drows = grouped_mm_fwd(dgate_up, gate_up_proj, ends) if ctx.needs_input_grad[0] else None
        d_gate_up_proj = (grouped_mm_db(rows, dgate_up, ends, gate_up_proj.transpose(1, 2)).transpose(1, 2)
                          if ctx.needs_input_grad[1] else None)
        return drows, d_gate_up_proj, d_down_proj, None


def moe_dispatch(experts: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tokens, positions, ends) of the top-k choices experts (T, k) in [0, num_experts): the
    T * k slots sorted by expert (stably: a token's slots in token order), tokens (T * k,) the
    token of each sorted row, positions (T, k) the sorted row of each slot, ends (E,) int32 the
    groups' cumulative row ends (grouped_mm's offs). On the device, without a host sync; an expert
    index outside the range gives unspecified groups."""
    T, k = experts.shape
    flat = experts.reshape(-1)
    sorted_experts, order = torch.sort(flat, stable=True)
    positions = torch.empty_like(order).scatter_(0, order, torch.arange(flat.numel(), device=flat.device))
    ends = torch.searchsorted(sorted_experts, torch.arange(num_experts, device=flat.device, dtype=flat.dtype),
                              right=True).to(torch.int32)
    return order // k, positions.view(T, k), ends


def moe_gather(x: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """x's rows in dispatch order (T * k, H); its backward sums a token's rows in slot order."""
    if torch.is_grad_enabled() and x.requires_grad:
        return runtime.apply(MoEGatherFunction, x, tokens, positions)
    return x.index_select(0, tokens)


def moe_combine(y: torch.Tensor, positions: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor | None = None,
                num_experts: int = 0) -> torch.Tensor:
    """out (T, N) in y's dtype: out[t] = sum over j of weights[t, j] * y[positions[t, j]]; given
    the routing's experts (T, k), a device-side assert that each is in [0, num_experts)."""
    if torch.is_grad_enabled() and (y.requires_grad or weights.requires_grad):
        return runtime.apply(MoECombineFunction, y, positions, weights, experts, num_experts)
    return moe_combine_fwd(y, positions, weights, experts, num_experts)


def moe_experts(x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, gate_up_proj: torch.Tensor,
                down_proj: torch.Tensor) -> torch.Tensor:
    """The experts' output (T, H) of tokens x (T, H) routed to experts (T, k) (int32 or int64)
    with weights (T, k) (any float dtype), through SwiGLU experts in HF's layout: gate_up_proj
    (E, 2I, H) (gate rows first, then up), down_proj (E, H, I). Differentiable in x, weights and
    both projections."""
    runtime.check_tensor("x", x, runtime.FLOAT_DTYPES, min_dim=2)
    if x.dim() != 2 or experts.dim() != 2 or weights.shape != experts.shape or experts.shape[0] != x.shape[0]:
        raise ValueError(f"moe_experts takes x (T, H), experts and weights (T, k), got {tuple(x.shape)}, "
                         f"{tuple(experts.shape)} and {tuple(weights.shape)}")
    if experts.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"experts must be int32 or int64, got {experts.dtype}")
    if not weights.is_floating_point():
        raise TypeError(f"weights must be a float tensor, got {weights.dtype}")
    if gate_up_proj.dtype != x.dtype or down_proj.dtype != x.dtype:
        raise TypeError(f"gate_up_proj and down_proj must have x's dtype ({x.dtype}), got {gate_up_proj.dtype} "
                        f"and {down_proj.dtype}")
    if gate_up_proj.dim() != 3:
        raise ValueError(f"gate_up_proj must be (E, 2I, H), got {tuple(gate_up_proj.shape)}")
    E, two_i, H = gate_up_proj.shape
    if two_i % 2 or H != x.shape[1] or down_proj.shape != (E, H, two_i // 2):
        raise ValueError(f"gate_up_proj must be (E, 2I, H) and down_proj (E, H, I) with H = {x.shape[1]}, got "
                         f"{tuple(gate_up_proj.shape)} and {tuple(down_proj.shape)}")
    runtime.check_same_device(x=x, experts=experts, weights=weights, gate_up_proj=gate_up_proj, down_proj=down_proj)
    # On the GPU the combine kernel asserts this on the device (a host look would wait for it).
    if (runtime.INTERPRET and not torch.compiler.is_compiling() and experts.numel()
            and not bool(((experts >= 0) & (experts < E)).all())):
        raise ValueError(f"experts holds an index outside [0, {E}) (gate_up_proj has {E} experts)")
    tokens, positions, ends = moe_dispatch(experts, E)
    rows = moe_gather(x, tokens, positions)
    if torch.is_grad_enabled() and (rows.requires_grad or gate_up_proj.requires_grad or down_proj.requires_grad):
        y = runtime.apply(ExpertsMLPFunction, rows, gate_up_proj, down_proj, ends)
    else:
        y, _ = _experts_mlp(rows, gate_up_proj, down_proj, ends)
    return moe_combine(y, positions, weights, experts, E)


def moe_experts_reference(x, experts, weights, gate_up_proj, down_proj):
    """HF's loop over experts (Qwen3MoeExperts.forward), in the inputs' dtype, summing in float64
    when given float64."""
    out = torch.zeros_like(x)
    for e in range(gate_up_proj.shape[0]):
        token, slot = torch.where(experts == e)
        if token.numel() == 0:
            continue
        gate, up = torch.nn.functional.linear(x[token], gate_up_proj[e]).chunk(2, dim=-1)
        h = torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, down_proj[e])
        out = out.index_add(0, token, h * weights[token, slot, None].to(h.dtype))
    return out
