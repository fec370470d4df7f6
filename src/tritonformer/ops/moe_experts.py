"""A mixture-of-experts layer's experts, dropless: every token's top-k rows computed, none dropped.

    tokens, positions, ends, _ = moe_dispatch(experts, E)   # rows sorted by expert, on the device
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
from .grouped_mm import group_bounds, grouped_mm_db, grouped_mm_fwd
from .swiglu import swiglu_bwd_concat, swiglu_fwd

COMBINE_BLOCK_N = 1024


# The combine kernel asserts that each slot's expert is in [0, E) (CHECK_E), as HF's loop does on
# the GPU (one_hot's device-side assert): debug=True compiles the assert in, and the launch turns
# off the integer-overflow checks that debug would add. Checking on the host would wait for the GPU.
@triton.jit(debug=not runtime.INTERPRET)
def _combine_kernel(y_ptr, pos_ptr, w_ptr, e_ptr, b_ptr, out_ptr, N, E, stride_y, stride_pt, stride_pk, stride_wt,
                    stride_wk, stride_et, stride_ek, stride_b, stride_o, TOP_K: tl.constexpr, HAS_W: tl.constexpr,
                    CHECK_E: tl.constexpr, HAS_B: tl.constexpr, BLOCK_N: tl.constexpr):
    """out[t] = sum over j, in order, of w[t, j] * (y[pos[t, j]] + b[e[t, j]]) (w = 1 without
    HAS_W, b = 0 without HAS_B), in float32."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = cols < N
    acc = tl.zeros((BLOCK_N,), tl.float32)
    for j in tl.static_range(TOP_K):
        if CHECK_E or HAS_B:
            e = tl.load(e_ptr + t * stride_et + j * stride_ek)
        if CHECK_E:
            tl.device_assert((e >= 0) & (e < E), "moe_experts: an index in experts is outside [0, num_experts)")
        p = tl.load(pos_ptr + t * stride_pt + j * stride_pk).to(tl.int64)
        y = tl.load(y_ptr + p * stride_y + cols, mask=ok, other=0.0).to(tl.float32)
        if HAS_B:
            y += tl.load(b_ptr + e.to(tl.int64) * stride_b + cols, mask=ok, other=0.0).to(tl.float32)
        if HAS_W:
            y = y * tl.load(w_ptr + t * stride_wt + j * stride_wk).to(tl.float32)
        acc += y
    tl.store(out_ptr + t * stride_o + cols, acc.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _combine_bwd_kernel(dout_ptr, y_ptr, pos_ptr, w_ptr, e_ptr, b_ptr, dy_ptr, dw_ptr, N, stride_do, stride_y,
                        stride_pt, stride_pk, stride_wt, stride_wk, stride_et, stride_ek, stride_b, stride_dy,
                        stride_dwt, stride_dwk, TOP_K: tl.constexpr, HAS_B: tl.constexpr, BLOCK_N: tl.constexpr):
    """For each slot j of token t: dy[pos[t, j]] = w[t, j] * dout[t] (the row's only writer) and
    dw[t, j] = <dout[t], y[pos[t, j]] + b[e[t, j]]> (float32)."""
    t = tl.program_id(0).to(tl.int64)
    for j in tl.static_range(TOP_K):
        p = tl.load(pos_ptr + t * stride_pt + j * stride_pk).to(tl.int64)
        w = tl.load(w_ptr + t * stride_wt + j * stride_wk).to(tl.float32)
        if HAS_B:
            e = tl.load(e_ptr + t * stride_et + j * stride_ek).to(tl.int64)
        dot = tl.zeros((BLOCK_N,), tl.float32)
        for n0 in range(0, N, BLOCK_N):
            cols = n0 + tl.arange(0, BLOCK_N)
            ok = cols < N
            do = tl.load(dout_ptr + t * stride_do + cols, mask=ok, other=0.0).to(tl.float32)
            tl.store(dy_ptr + p * stride_dy + cols, (w * do).to(dy_ptr.dtype.element_ty), mask=ok)
            y = tl.load(y_ptr + p * stride_y + cols, mask=ok, other=0.0).to(tl.float32)
            if HAS_B:
                y += tl.load(b_ptr + e * stride_b + cols, mask=ok, other=0.0).to(tl.float32)
            dot += do * y
        tl.store(dw_ptr + t * stride_dwt + j * stride_dwk, tl.sum(dot, 0).to(dw_ptr.dtype.element_ty))


@triton.jit
def _group_sums_kernel(x_ptr, ends_ptr, out_ptr, M, N, E, stride_x, stride_oe, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr):
    """out[g] = the sum of x's rows of group g (float32, rows in order: deterministic)."""
    g = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    start, end = group_bounds(ends_ptr, g, M, E)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for r0 in range(start, end, BLOCK_M):
        rows = r0 + tl.arange(0, BLOCK_M)
        ok = (rows < end)[:, None] & (cols < N)[None, :]
        acc += tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_x + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + g.to(tl.int64) * stride_oe + cols, tl.sum(acc, 0).to(out_ptr.dtype.element_ty), mask=cols < N)


@triton.jit
def _biased_gate_up(gu_ptr, b_ptr, e_ptr, rows, cols, ok, R, E, stride_gu, stride_b):
    """(gate, up) of GPT-OSS's interleaved product (gate at even columns, up at odd) plus the
    row's expert's bias, rounded to the product's dtype as HF's addition is, in float32. An expert
    outside [0, E) reads no bias (the combine kernel's assert names it)."""
    e = tl.load(e_ptr + rows, mask=rows < R, other=0).to(tl.int64)
    at = gu_ptr + rows[:, None].to(tl.int64) * stride_gu + 2 * cols[None, :]
    bias_at = b_ptr + e[:, None] * stride_b + 2 * cols[None, :]
    has_bias = ok & ((e >= 0) & (e < E))[:, None]
    g = tl.load(at, mask=ok, other=0.0).to(tl.float32) + tl.load(bias_at, mask=has_bias, other=0.0).to(tl.float32)
    u = (tl.load(at + 1, mask=ok, other=0.0).to(tl.float32)
         + tl.load(bias_at + 1, mask=has_bias, other=0.0).to(tl.float32))
    dtype = gu_ptr.dtype.element_ty
    return g.to(dtype).to(tl.float32), u.to(dtype).to(tl.float32)


@triton.jit
def _clamped(g, u, limit):
    """(min(g, limit), clamp(u, -limit, limit)), a NaN staying NaN as in torch.clamp (Triton's
    default minimum returns the other operand on the GPU)."""
    return (tl.minimum(g, limit, propagate_nan=tl.PropagateNan.ALL),
            tl.minimum(tl.maximum(u, -limit, propagate_nan=tl.PropagateNan.ALL), limit,
                       propagate_nan=tl.PropagateNan.ALL))


@triton.jit
def _clamped_glu_fwd_kernel(gu_ptr, b_ptr, e_ptr, h_ptr, R, I, E, stride_gu, stride_b, stride_h, alpha, limit,
                            BLOCK_R: tl.constexpr, BLOCK_I: tl.constexpr):
    """h = (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = min(gate, limit)."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    ok = (rows < R)[:, None] & (cols < I)[None, :]
    g, u = _biased_gate_up(gu_ptr, b_ptr, e_ptr, rows, cols, ok, R, E, stride_gu, stride_b)
    g, u = _clamped(g, u, limit)
    h = (u + 1.0) * g * tl.sigmoid(alpha * g)
    tl.store(h_ptr + rows[:, None].to(tl.int64) * stride_h + cols[None, :], h.to(h_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _clamped_glu_bwd_kernel(gu_ptr, b_ptr, e_ptr, dh_ptr, dgu_ptr, h_ptr, R, I, E, stride_gu, stride_b, stride_dh,
                            stride_dgu, stride_h, alpha, limit, BLOCK_R: tl.constexpr, BLOCK_I: tl.constexpr):
    """d[gate | up] interleaved, from dh (no gradient where a clamp held the value, as torch.clamp),
    and h recomputed (the down product's weight gradient reads it)."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    ok = (rows < R)[:, None] & (cols < I)[None, :]
    g, u = _biased_gate_up(gu_ptr, b_ptr, e_ptr, rows, cols, ok, R, E, stride_gu, stride_b)
    dh = tl.load(dh_ptr + rows[:, None].to(tl.int64) * stride_dh + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    gc, uc = _clamped(g, u, limit)
    s = tl.sigmoid(alpha * gc)
    glu = gc * s
    du = tl.where((u >= -limit) & (u <= limit), dh * glu, 0.0)
    dg = tl.where(g <= limit, dh * (uc + 1.0) * (s + alpha * glu * (1.0 - s)), 0.0)
    at = dgu_ptr + rows[:, None].to(tl.int64) * stride_dgu + 2 * cols[None, :]
    tl.store(at, dg.to(dgu_ptr.dtype.element_ty), mask=ok)
    tl.store(at + 1, du.to(dgu_ptr.dtype.element_ty), mask=ok)
    tl.store(h_ptr + rows[:, None].to(tl.int64) * stride_h + cols[None, :], ((uc + 1.0) * glu).to(h_ptr.dtype.element_ty),
             mask=ok)


_launch_combine = runtime.FastLaunch(_combine_kernel)
_launch_combine_bwd = runtime.FastLaunch(_combine_bwd_kernel)
_launch_group_sums = runtime.FastLaunch(_group_sums_kernel)
_launch_glu_fwd = runtime.FastLaunch(_clamped_glu_fwd_kernel)
_launch_glu_bwd = runtime.FastLaunch(_clamped_glu_bwd_kernel)
GLU_BLOCKS = dict(BLOCK_R=16, BLOCK_I=64)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t with a unit last stride (the kernels index columns densely)."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _fake_combine(y, positions, weights, experts=None, num_experts=0, bias=None):
    return y.new_empty((positions.shape[0], y.shape[1]))


@runtime.custom_op("moe_combine_fwd", fake=_fake_combine)
def moe_combine_fwd(y: torch.Tensor, positions: torch.Tensor, weights: torch.Tensor | None,
                    experts: torch.Tensor | None = None, num_experts: int = 0,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
    """(T, N): each token's rows of y weighted (or summed, without weights); with experts (T, k),
    a device-side assert that each is in [0, num_experts), and each row plus its expert's bias
    (E, N) where one is given."""
    y = _rows(y)
    (T, k), N = positions.shape, y.shape[1]
    out = runtime.empty((T, N), y.dtype, y.device)
    if out.numel() == 0:
        return out.zero_()
    w = weights if weights is not None else positions
    e = experts if experts is not None else positions
    b = _rows(bias) if bias is not None else y
    block = min(COMBINE_BLOCK_N, runtime.next_power_of_2(N))
    launch = {} if runtime.INTERPRET else {"sanitize_overflow": False}
    _launch_combine((T, runtime.cdiv(N, block)), y, positions, w, e, b, out, N, num_experts, y.stride(0),
                    *positions.stride(), *w.stride(), *e.stride(), b.stride(0), out.stride(0), TOP_K=k,
                    HAS_W=weights is not None, CHECK_E=experts is not None, HAS_B=bias is not None, BLOCK_N=block,
                    num_warps=4, **launch)
    return out


def _fake_combine_bwd(dout, y, positions, weights, experts=None, bias=None):
    return y.new_empty(y.shape), weights.new_empty(weights.shape)


@runtime.custom_op("moe_combine_bwd", fake=_fake_combine_bwd)
def moe_combine_bwd(dout: torch.Tensor, y: torch.Tensor, positions: torch.Tensor, weights: torch.Tensor,
                    experts: torch.Tensor | None = None,
                    bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(dy, dweights) of moe_combine_fwd with weights (and experts with a bias)."""
    dout, y = _rows(dout), _rows(y)
    (T, k), N = positions.shape, y.shape[1]
    dy = runtime.empty(y.shape, y.dtype, y.device)
    dw = runtime.empty(weights.shape, weights.dtype, weights.device)
    if T == 0:
        return dy, dw
    e = experts if experts is not None else positions
    b = _rows(bias) if bias is not None else y
    block = min(COMBINE_BLOCK_N, runtime.next_power_of_2(max(N, 1)))
    _launch_combine_bwd((T,), dout, y, positions, weights, e, b, dy, dw, N, dout.stride(0), y.stride(0),
                        *positions.stride(), *weights.stride(), *e.stride(), b.stride(0), dy.stride(0), *dw.stride(),
                        TOP_K=k, HAS_B=bias is not None, BLOCK_N=block, num_warps=4)
    return dy, dw


def _fake_group_sums(x, ends):
    return x.new_empty((ends.shape[0], x.shape[1]))


@runtime.custom_op("moe_group_sums", fake=_fake_group_sums)
def group_sums(x: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """(E, N) in x's dtype: the sums of x's row groups (grouped_mm's ends), a bias's gradient."""
    x = _rows(x)
    (M, N), E = x.shape, ends.shape[0]
    out = runtime.empty((E, N), x.dtype, x.device)
    if out.numel() == 0:
        return out
    block_n = min(128, runtime.next_power_of_2(N))
    _launch_group_sums((E, runtime.cdiv(N, block_n)), x, ends, out, M, N, E, x.stride(0), out.stride(0),
                       BLOCK_M=32, BLOCK_N=block_n, num_warps=4)
    return out


class MoECombineFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, positions, weights, experts, num_experts, bias, ends):
        ctx.save_for_backward(y, positions, weights, experts if bias is not None else None, bias, ends)
        return moe_combine_fwd(y, positions, weights, experts, num_experts, bias)

    @staticmethod
    def backward(ctx, dout):
        y, positions, weights, experts, bias, ends = ctx.saved_tensors
        dy, dw = moe_combine_bwd(dout, y, positions, weights, experts, bias)
        d_bias = group_sums(dy, ends) if ctx.needs_input_grad[5] else None
        return dy, None, dw, None, None, d_bias, None


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


def moe_dispatch(experts: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                   torch.Tensor]:
    """(tokens, positions, ends, row_experts) of the top-k choices experts (T, k) in
    [0, num_experts): the T * k slots sorted by expert (stably: a token's slots in token order),
    tokens (T * k,) the token of each sorted row, positions (T, k) the sorted row of each slot,
    ends (E,) int32 the groups' cumulative row ends (grouped_mm's offs), row_experts (T * k,) each
    sorted row's expert. On the device, without a host sync; an expert index outside the range
    gives unspecified groups."""
    T, k = experts.shape
    flat = experts.reshape(-1)
    sorted_experts, order = torch.sort(flat, stable=True)
    positions = torch.empty_like(order).scatter_(0, order, torch.arange(flat.numel(), device=flat.device))
    ends = torch.searchsorted(sorted_experts, torch.arange(num_experts, device=flat.device, dtype=flat.dtype),
                              right=True).to(torch.int32)
    return order // k, positions.view(T, k), ends, sorted_experts


def moe_gather(x: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """x's rows in dispatch order (T * k, H); its backward sums a token's rows in slot order."""
    if torch.is_grad_enabled() and x.requires_grad:
        return runtime.apply(MoEGatherFunction, x, tokens, positions)
    return x.index_select(0, tokens)


def moe_combine(y: torch.Tensor, positions: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor | None = None,
                num_experts: int = 0, bias: torch.Tensor | None = None, ends: torch.Tensor | None = None) -> torch.Tensor:
    """out (T, N) in y's dtype: out[t] = sum over j of weights[t, j] * (y[positions[t, j]] +
    bias[experts[t, j]]) (bias (E, N), optional; its gradient needs the groups' ends); given the
    routing's experts (T, k), a device-side assert that each is in [0, num_experts)."""
    if bias is not None and (experts is None or (torch.is_grad_enabled() and bias.requires_grad and ends is None)):
        raise ValueError("moe_combine: a bias needs the routing's experts, and its gradient the groups' ends")
    if torch.is_grad_enabled() and (y.requires_grad or weights.requires_grad
                                    or (bias is not None and bias.requires_grad)):
        return runtime.apply(MoECombineFunction, y, positions, weights, experts, num_experts, bias, ends)
    return moe_combine_fwd(y, positions, weights, experts, num_experts, bias)


def _check_routing(op: str, x, experts, weights, **params) -> None:
    """The checks every experts op makes: x (T, H), experts (T, k) int, weights (T, k) float, the
    weights (params) in x's dtype, all on one device."""
    runtime.check_tensor("x", x, runtime.FLOAT_DTYPES, min_dim=2)
    if x.dim() != 2 or experts.dim() != 2 or weights.shape != experts.shape or experts.shape[0] != x.shape[0]:
        raise ValueError(f"{op} takes x (T, H), experts and weights (T, k), got {tuple(x.shape)}, "
                         f"{tuple(experts.shape)} and {tuple(weights.shape)}")
    if experts.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"experts must be int32 or int64, got {experts.dtype}")
    if not weights.is_floating_point():
        raise TypeError(f"weights must be a float tensor, got {weights.dtype}")
    for name, t in params.items():
        if t.dtype != x.dtype:
            raise TypeError(f"{name} must have x's dtype ({x.dtype}), got {t.dtype}")
    runtime.check_same_device(x=x, experts=experts, weights=weights, **params)


def _check_indices(experts: torch.Tensor, E: int) -> None:
    # On the GPU the combine kernel asserts this on the device (a host look would wait for it).
    if (runtime.INTERPRET and not torch.compiler.is_compiling() and experts.numel()
            and not bool(((experts >= 0) & (experts < E)).all())):
        raise ValueError(f"experts holds an index outside [0, {E}) (the weights have {E} experts)")


def moe_experts(x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, gate_up_proj: torch.Tensor,
                down_proj: torch.Tensor) -> torch.Tensor:
    """The experts' output (T, H) of tokens x (T, H) routed to experts (T, k) (int32 or int64)
    with weights (T, k) (any float dtype), through SwiGLU experts in HF's layout: gate_up_proj
    (E, 2I, H) (gate rows first, then up), down_proj (E, H, I). Differentiable in x, weights and
    both projections."""
    _check_routing("moe_experts", x, experts, weights, gate_up_proj=gate_up_proj, down_proj=down_proj)
    if gate_up_proj.dim() != 3:
        raise ValueError(f"gate_up_proj must be (E, 2I, H), got {tuple(gate_up_proj.shape)}")
    E, two_i, H = gate_up_proj.shape
    if two_i % 2 or H != x.shape[1] or down_proj.shape != (E, H, two_i // 2):
        raise ValueError(f"gate_up_proj must be (E, 2I, H) and down_proj (E, H, I) with H = {x.shape[1]}, got "
                         f"{tuple(gate_up_proj.shape)} and {tuple(down_proj.shape)}")
    _check_indices(experts, E)
    tokens, positions, ends, _ = moe_dispatch(experts, E)
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


# ---- GPT-OSS's experts: interleaved gate/up with biases, a clamped SwiGLU, transposed weights ----

GPT_OSS_ALPHA, GPT_OSS_LIMIT = 1.702, 7.0


def _fake_glu_fwd(gate_up, bias, row_experts, alpha, limit):
    return gate_up.new_empty((gate_up.shape[0], gate_up.shape[1] // 2))


@runtime.custom_op("clamped_glu_fwd", fake=_fake_glu_fwd)
def clamped_glu_fwd(gate_up: torch.Tensor, bias: torch.Tensor, row_experts: torch.Tensor, alpha: float,
                    limit: float) -> torch.Tensor:
    """GPT-OSS's activation (R, I) of the interleaved product (R, 2I) plus each row's expert's bias."""
    R, I = gate_up.shape[0], gate_up.shape[1] // 2
    h = runtime.empty((R, I), gate_up.dtype, gate_up.device)
    bias = _rows(bias)
    if h.numel():
        grid = (runtime.cdiv(R, GLU_BLOCKS["BLOCK_R"]), runtime.cdiv(I, GLU_BLOCKS["BLOCK_I"]))
        _launch_glu_fwd(grid, gate_up, bias, row_experts, h, R, I, bias.shape[0], gate_up.stride(0), bias.stride(0),
                        h.stride(0), alpha, limit, **GLU_BLOCKS, num_warps=4)
    return h


def _fake_glu_bwd(gate_up, bias, row_experts, dh, alpha, limit):
    return gate_up.new_empty(gate_up.shape), gate_up.new_empty(dh.shape)


@runtime.custom_op("clamped_glu_bwd", fake=_fake_glu_bwd)
def clamped_glu_bwd(gate_up: torch.Tensor, bias: torch.Tensor, row_experts: torch.Tensor, dh: torch.Tensor,
                    alpha: float, limit: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(d gate_up interleaved (R, 2I), the activation recomputed (R, I)) from dh (R, I)."""
    dh, bias = _rows(dh), _rows(bias)
    R, I = dh.shape
    dgu = runtime.empty(gate_up.shape, gate_up.dtype, gate_up.device)
    h = runtime.empty((R, I), gate_up.dtype, gate_up.device)
    if h.numel():
        grid = (runtime.cdiv(R, GLU_BLOCKS["BLOCK_R"]), runtime.cdiv(I, GLU_BLOCKS["BLOCK_I"]))
        _launch_glu_bwd(grid, gate_up, bias, row_experts, dh, dgu, h, R, I, bias.shape[0], gate_up.stride(0),
                        bias.stride(0), dh.stride(0), dgu.stride(0), h.stride(0), alpha, limit, **GLU_BLOCKS,
                        num_warps=4)
    return dgu, h


def _gpt_oss_mlp(rows, row_experts, gate_up_proj, gate_up_bias, down_proj, ends, alpha, limit):
    """(y without down's bias, the interleaved product): (E, H, 2I) and (E, I, H) are grouped_mm's
    (E, K, N) as they are."""
    gate_up = grouped_mm_fwd(rows, gate_up_proj, ends)
    return grouped_mm_fwd(clamped_glu_fwd(gate_up, gate_up_bias, row_experts, alpha, limit), down_proj, ends), gate_up


class GptOssMLPFunction(torch.autograd.Function):
    """y = grouped_mm(glu(grouped_mm(rows, gate_up_proj) + gate_up_bias), down_proj): one node, as
    ExpertsMLPFunction (rows and the product saved, the activation recomputed); the gate/up bias's
    gradient is the groups' sums of d[gate | up]."""

    @staticmethod
    def forward(ctx, rows, row_experts, gate_up_proj, gate_up_bias, down_proj, ends, alpha, limit):
        y, gate_up = _gpt_oss_mlp(rows, row_experts, gate_up_proj, gate_up_bias, down_proj, ends, alpha, limit)
        ctx.save_for_backward(rows, row_experts, gate_up, gate_up_proj, gate_up_bias, down_proj, ends)
        ctx.alpha, ctx.limit = alpha, limit
        return y

    @staticmethod
    def backward(ctx, dy):
        rows, row_experts, gate_up, gate_up_proj, gate_up_bias, down_proj, ends = ctx.saved_tensors
        dh = grouped_mm_fwd(dy, down_proj.transpose(1, 2), ends)
        dgate_up, h = clamped_glu_bwd(gate_up, gate_up_bias, row_experts, dh, ctx.alpha, ctx.limit)
        del dh, gate_up
        d_down_proj = grouped_mm_db(h, dy, ends, down_proj) if ctx.needs_input_grad[4] else None
        del h, dy
        d_bias = group_sums(dgate_up, ends) if ctx.needs_input_grad[3] else None
        drows = grouped_mm_fwd(dgate_up, gate_up_proj.transpose(1, 2), ends) if ctx.needs_input_grad[0] else None
        d_gate_up_proj = grouped_mm_db(rows, dgate_up, ends, gate_up_proj) if ctx.needs_input_grad[2] else None
        return drows, None, d_gate_up_proj, d_bias, d_down_proj, None, None, None


def gpt_oss_experts(x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, gate_up_proj: torch.Tensor,
                    gate_up_bias: torch.Tensor, down_proj: torch.Tensor, down_bias: torch.Tensor,
                    alpha: float = GPT_OSS_ALPHA, limit: float = GPT_OSS_LIMIT) -> torch.Tensor:
    """GPT-OSS's experts (GptOssExperts) on tokens x (T, H) routed to experts (T, k) with weights
    (T, k): gate_up_proj (E, H, 2I) with gate at even columns and up at odd, gate_up_bias (E, 2I),
    down_proj (E, I, H), down_bias (E, H); the activation (clamp(up, -limit, limit) + 1) * g *
    sigmoid(alpha * g) with g = min(gate, limit). Dispatch, gather, the two grouped products and
    the combine are moe_experts'; the down bias is added in the combine. Differentiable in x,
    weights, both projections and both biases."""
    _check_routing("gpt_oss_experts", x, experts, weights, gate_up_proj=gate_up_proj, gate_up_bias=gate_up_bias,
                   down_proj=down_proj, down_bias=down_bias)
    if gate_up_proj.dim() != 3:
        raise ValueError(f"gate_up_proj must be (E, H, 2I), got {tuple(gate_up_proj.shape)}")
    E, H, two_i = gate_up_proj.shape
    shapes = dict(gate_up_bias=(E, two_i), down_proj=(E, two_i // 2, H), down_bias=(E, H))
    given = dict(gate_up_bias=gate_up_bias, down_proj=down_proj, down_bias=down_bias)
    if two_i % 2 or H != x.shape[1] or any(tuple(given[n].shape) != shape for n, shape in shapes.items()):
        raise ValueError(f"gpt_oss_experts takes gate_up_proj (E, H, 2I) with H = {x.shape[1]}, gate_up_bias "
                         f"(E, 2I), down_proj (E, I, H), down_bias (E, H); got "
                         + ", ".join(f"{n} {tuple(t.shape)}" for n, t in dict(gate_up_proj=gate_up_proj, **given).items()))
    _check_indices(experts, E)
    tokens, positions, ends, row_experts = moe_dispatch(experts, E)
    rows = moe_gather(x, tokens, positions)
    alpha, limit = float(alpha), float(limit)
    args = (rows, row_experts, gate_up_proj, gate_up_bias, down_proj, ends, alpha, limit)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (rows, gate_up_proj, gate_up_bias, down_proj)):
        y = runtime.apply(GptOssMLPFunction, *args)
    else:
        y, _ = _gpt_oss_mlp(*args)
    return moe_combine(y, positions, weights, experts, E, down_bias, ends)


def gpt_oss_experts_reference(x, experts, weights, gate_up_proj, gate_up_bias, down_proj, down_bias,
                              alpha=GPT_OSS_ALPHA, limit=GPT_OSS_LIMIT):
    """HF's GptOssExperts loop over experts, in the inputs' dtype."""
    out = torch.zeros_like(x)
    for e in range(gate_up_proj.shape[0]):
        token, slot = torch.where(experts == e)
        if token.numel() == 0:
            continue
        gate_up = x[token] @ gate_up_proj[e] + gate_up_bias[e]
        gate = gate_up[..., ::2].clamp(max=limit)
        up = gate_up[..., 1::2].clamp(min=-limit, max=limit)
        h = ((up + 1) * gate * torch.sigmoid(gate * alpha)) @ down_proj[e] + down_bias[e]
        out = out.index_add(0, token, h * weights[token, slot, None].to(h.dtype))
    return out
