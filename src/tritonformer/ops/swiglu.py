"""SwiGLU, the gated activation of Llama's MLP, forward and backward, and the whole MLP.

    h  = silu(g) * u,                     silu(g) = g * sigmoid(g)
    dg = dh * u * s * (1 + g * (1 - s)),  s = sigmoid(g)
    du = dh * silu(g)

`swiglu(gate, up)`: two tensors of one shape and float dtype, their rows strided or not (e.g. the
halves of one projection; other layouts are copied). Elementwise in float32, rounded once to the
storage dtype (torch's eager `F.silu(g) * u` rounds twice). One kernel each way over blocks of
rows (contiguous rows as one long row): the backward reads g, u, dh and writes dg, du, and for
`swiglu_mlp(x, w_gate, w_up, w_down, ...)` also h, which the MLP recomputes instead of storing.
Design: docs/swiglu.md.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .. import runtime

# Programs of 2048 elements, 8 values a thread forward and 4 backward: the H100 sweep's best (forward
# 2.98 TB/s, backward 3.01 at 8192x14336 bf16; docs/swiglu.md).
MAX_BLOCK = 2048
FWD_VALUES_PER_THREAD = 8
BWD_VALUES_PER_THREAD = 4


@triton.jit
def _block_offsets(N, col_blocks, BLOCK: tl.constexpr):
    """Row and column offsets of this program's block: programs walk the column blocks of a row
    (one grid axis, which has no 65535 limit), rows in order."""
    pid = tl.program_id(0)
    row = (pid // col_blocks).to(tl.int64)
    cols = (pid % col_blocks).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    return row, cols, cols < N


@triton.jit
def _swiglu_fwd_kernel(g_ptr, u_ptr, h_ptr, N, col_blocks, stride_g, stride_u, stride_h, BLOCK: tl.constexpr):
    row, cols, ok = _block_offsets(N, col_blocks, BLOCK)
    g = tl.load(g_ptr + row * stride_g + cols, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * stride_u + cols, mask=ok, other=0.0).to(tl.float32)
    h = g / (1.0 + tl.exp(-g)) * u
    tl.store(h_ptr + row * stride_h + cols, h.to(h_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _swiglu_bwd_kernel(
    g_ptr, u_ptr, dh_ptr, dg_ptr, du_ptr, h_ptr, N, col_blocks, stride_g, stride_u, stride_dh, stride_dg, stride_du,
    stride_h, STORE_H: tl.constexpr, BLOCK: tl.constexpr,
):
    row, cols, ok = _block_offsets(N, col_blocks, BLOCK)
    g = tl.load(g_ptr + row * stride_g + cols, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * stride_u + cols, mask=ok, other=0.0).to(tl.float32)
    dh = tl.load(dh_ptr + row * stride_dh + cols, mask=ok, other=0.0).to(tl.float32)
    s = 1.0 / (1.0 + tl.exp(-g))
    silu = g * s
    tl.store(dg_ptr + row * stride_dg + cols, (dh * u * s * (1.0 + g * (1.0 - s))).to(dg_ptr.dtype.element_ty), mask=ok)
    tl.store(du_ptr + row * stride_du + cols, (dh * silu).to(du_ptr.dtype.element_ty), mask=ok)
    if STORE_H:
        tl.store(h_ptr + row * stride_h + cols, (silu * u).to(h_ptr.dtype.element_ty), mask=ok)


_launch_fwd = runtime.FastLaunch(_swiglu_fwd_kernel)
_launch_bwd = runtime.FastLaunch(_swiglu_bwd_kernel)


def _launch_shape(views: list[torch.Tensor]) -> tuple[int, int, int, int]:
    """(rows, N, column blocks, BLOCK) for (rows, N) views with unit column stride. Rows that all
    follow one another in memory are one long row: no block is cut by a row's end (at 11008
    columns and 8192-element blocks, a second block per row a third full cost 6% of the forward)."""
    M, N = views[0].shape
    if M > 1 and all(t.stride(0) == N for t in views):
        M, N = 1, M * N
    block = min(MAX_BLOCK, runtime.next_power_of_2(N))
    return M, N, runtime.cdiv(N, block), block


def _num_warps(block: int, values_per_thread: int) -> int:
    return max(1, min(16, block // (32 * values_per_thread)))


def _fake_swiglu_fwd(gate, up):
    return torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)


@runtime.custom_op("swiglu_fwd", fake=_fake_swiglu_fwd)
@runtime.planned
def swiglu_fwd(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up. Planned (runtime.planned): on the H100 machine's host the row views and
    launch arithmetic cost more than a small SwiGLU's GPU time."""
    h = runtime.empty(gate.shape, gate.dtype, gate.device)
    if gate.numel() == 0:
        return h
    N = gate.shape[-1]
    g, u = runtime.rows_view(gate, N), runtime.rows_view(up, N)
    M, n, col_blocks, block = _launch_shape([g, u])
    grid, scalars = (M * col_blocks,), (n, col_blocks, g.stride(0), u.stride(0), N)
    entry = _launch_fwd(grid, g, u, h, *scalars, BLOCK=block, num_warps=_num_warps(block, FWD_VALUES_PER_THREAD))
    if entry is not None and runtime.starts_as(g, gate, u, up):
        runtime.keep_plan(functools.partial(_replay_fwd, entry, grid, scalars))
    return h


def _replay_fwd(entry, grid, scalars, gate, up):
    h = runtime.empty(gate.shape, gate.dtype, gate.device)
    _launch_fwd.replay(entry, grid, gate, up, h, *scalars)
    return h


def _fake_swiglu_bwd(gate, up, dh, store_h, dg_into_dh):
    shape = gate.shape
    return (torch.empty(shape, dtype=gate.dtype, device=gate.device), torch.empty(shape, dtype=gate.dtype, device=gate.device),
            torch.empty(shape if store_h else (0,), dtype=gate.dtype, device=gate.device))


@runtime.planned
def swiglu_bwd(gate: torch.Tensor, up: torch.Tensor, dh: torch.Tensor, store_h: bool,
               dg_into_dh: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(dg, du, h); h is None unless `store_h`. With `dg_into_dh` (the caller owns dh and has no
    other use for it) dg is written over dh, saving one buffer; a custom op's output may not
    alias its input, so callers ask for that only in eager mode. Planned as swiglu_fwd."""
    N = gate.shape[-1]
    g, u, d = runtime.rows_view(gate, N), runtime.rows_view(up, N), runtime.rows_view(dh, N)
    in_place = dg_into_dh and d.is_contiguous() and d.data_ptr() == dh.data_ptr() and dh.dtype == gate.dtype
    dg, du, h = _bwd_buffers(gate, dh, store_h, in_place)
    if gate.numel() == 0:
        return dg, du, h
    M, n, col_blocks, block = _launch_shape([g, u, d])
    grid, scalars = (M * col_blocks,), (n, col_blocks, g.stride(0), u.stride(0), d.stride(0), N, N, N)
    entry = _launch_bwd(grid, g, u, d, dg, du, h if store_h else du, *scalars, STORE_H=store_h, BLOCK=block,
                        num_warps=_num_warps(block, BWD_VALUES_PER_THREAD))
    if entry is not None and runtime.starts_as(g, gate, u, up, d, dh):
        runtime.keep_plan(functools.partial(_replay_bwd, entry, grid, scalars, in_place))
    return dg, du, h


def _replay_bwd(entry, grid, scalars, in_place, gate, up, dh, store_h, dg_into_dh):
    dg, du, h = _bwd_buffers(gate, dh, store_h, in_place)
    _launch_bwd.replay(entry, grid, gate, up, dh, dg, du, h if store_h else du, *scalars)
    return dg, du, h


def _bwd_buffers(gate, dh, store_h: bool, in_place: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    dg = dh if in_place else runtime.empty(gate.shape, gate.dtype, gate.device)
    du = runtime.empty(gate.shape, gate.dtype, gate.device)
    return dg, du, runtime.empty(gate.shape, gate.dtype, gate.device) if store_h else None


@runtime.custom_op("swiglu_bwd", fake=_fake_swiglu_bwd)
def swiglu_bwd_op(gate: torch.Tensor, up: torch.Tensor, dh: torch.Tensor, store_h: bool,
                  dg_into_dh: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """swiglu_bwd as an op for torch.compile, whose outputs are tensors: h is empty unless `store_h`."""
    dg, du, h = swiglu_bwd(gate, up, dh, store_h, dg_into_dh)
    return dg, du, h if h is not None else runtime.empty((0,), gate.dtype, gate.device)


def _fake_swiglu_bwd_concat(gate, up, dh):
    rows, n = gate.shape
    return gate.new_empty((rows, 2 * n)), gate.new_empty((rows, n))


@runtime.custom_op("swiglu_bwd_concat", fake=_fake_swiglu_bwd_concat)
def swiglu_bwd_concat(gate: torch.Tensor, up: torch.Tensor, dh: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """([dg | du] (rows, 2N), h (rows, N)) of (rows, N) gate, up and dh with unit column stride:
    the gradient of a projection whose output holds gate and up side by side, in one buffer
    (no concatenation after), and h recomputed for the next product's weight gradient."""
    rows, n = gate.shape
    dgu = runtime.empty((rows, 2 * n), gate.dtype, gate.device)
    h = runtime.empty((rows, n), gate.dtype, gate.device)
    if gate.numel() == 0:
        return dgu, h
    block = min(MAX_BLOCK, runtime.next_power_of_2(n))
    col_blocks = runtime.cdiv(n, block)
    _launch_bwd((rows * col_blocks,), gate, up, dh, dgu, dgu[:, n:], h, n, col_blocks, gate.stride(0), up.stride(0),
                dh.stride(0), dgu.stride(0), dgu.stride(0), h.stride(0), STORE_H=True, BLOCK=block,
                num_warps=_num_warps(block, BWD_VALUES_PER_THREAD))
    return dgu, h


class SwiGLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return swiglu_fwd(gate, up)

    @staticmethod
    def backward(ctx, dh):
        gate, up = ctx.saved_tensors
        dg, du, _ = (swiglu_bwd_op if torch.compiler.is_compiling() else swiglu_bwd)(gate, up, dh, False, False)
        return dg, du


def _check(gate, up):
    runtime.check_tensor("gate", gate, runtime.FLOAT_DTYPES, min_dim=1)
    runtime.check_tensor("up", up, runtime.FLOAT_DTYPES, min_dim=1)
    if up.shape != gate.shape:
        raise ValueError(f"up has shape {tuple(up.shape)}, gate {tuple(gate.shape)}: they must match")
    if up.dtype != gate.dtype:
        raise TypeError(f"up has dtype {up.dtype}, gate {gate.dtype}: they must match")
    runtime.check_same_device(gate=gate, up=up)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, computed in float32 and rounded once."""
    _check(gate, up)
    if torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad):
        return runtime.apply(SwiGLUFunction, gate, up)
    return swiglu_fwd(gate, up)


def swiglu_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.silu(gate) * up


def _mlp_forward(x, w_gate, w_up, w_down, b_gate, b_up, b_down):
    """(down(swiglu(g, u)), g, u) with g = gate(x), u = up(x). In compile-only mode (a warm-up)
    the products, which launch no kernel of ours, are skipped: g, u and the result unwritten."""
    if runtime.compiling_ahead():
        g, u = (runtime.empty((*x.shape[:-1], w.shape[0]), x.dtype, x.device) for w in (w_gate, w_up))
        swiglu_fwd(g, u)
        return runtime.empty((*x.shape[:-1], w_down.shape[0]), x.dtype, x.device), g, u
    g = torch.nn.functional.linear(x, w_gate, b_gate)
    u = torch.nn.functional.linear(x, w_up, b_up)
    return torch.nn.functional.linear(swiglu_fwd(g, u), w_down, b_down), g, u


class SwiGLUMLPFunction(torch.autograd.Function):
    """down(swiglu(gate(x), up(x))), saving x, gate(x) and up(x) for backward; the activation h
    is recomputed there by the backward kernel instead of being stored."""

    @staticmethod
    def forward(ctx, x, w_gate, w_up, w_down, b_gate, b_up, b_down):
        y, g, u = _mlp_forward(x, w_gate, w_up, w_down, b_gate, b_up, b_down)
        ctx.save_for_backward(x, g, u, w_gate, w_up, w_down)
        ctx.has_bias = (b_gate is not None, b_up is not None, b_down is not None)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, g, u, w_gate, w_up, w_down = ctx.saved_tensors
        if runtime.compiling_ahead():  # a warm-up: the activation's kernel alone (see _mlp_forward)
            swiglu_bwd_op(g, u, torch.empty_like(g), True, True)
            return (None,) * 7
        dh = dy @ w_down
        dg, du, h = swiglu_bwd_op(g, u, dh, True, not torch.compiler.is_compiling())
        x2, dy2, dg2, du2, h2 = (t.reshape(-1, t.shape[-1]) for t in (x, dy, dg, du, h))
        dx = (dg2 @ w_gate).addmm_(du2, w_up).view(x.shape)
        dw_gate, dw_up, dw_down = dg2.mT @ x2, du2.mT @ x2, dy2.mT @ h2
        db = [t.sum(0) if has else None for t, has in zip((dg2, du2, dy2), ctx.has_bias)]
        return dx, dw_gate, dw_up, dw_down, *db


def swiglu_mlp(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
               b_gate: torch.Tensor | None = None, b_up: torch.Tensor | None = None,
               b_down: torch.Tensor | None = None) -> torch.Tensor:
    """Llama's MLP, down(silu(gate(x)) * up(x)), with weights in nn.Linear's (out, in) layout.
    Backward keeps x, gate(x) and up(x): two intermediate-sized activations a token, where eager
    PyTorch keeps four."""
    runtime.check_tensor("x", x, runtime.FLOAT_DTYPES, min_dim=1)
    hidden = x.shape[-1]
    for name, w in (("w_gate", w_gate), ("w_up", w_up), ("w_down", w_down)):
        runtime.check_tensor(name, w, (x.dtype,), min_dim=2)
    inter = w_gate.shape[0]
    for name, w, shape in (("w_gate", w_gate, (inter, hidden)), ("w_up", w_up, (inter, hidden)),
                           ("w_down", w_down, (hidden, inter))):
        if tuple(w.shape) != shape:
            raise ValueError(f"{name} must have shape {shape} for x with {hidden} features, got {tuple(w.shape)}")
    runtime.check_same_device(x=x, w_gate=w_gate, w_up=w_up, w_down=w_down, b_gate=b_gate, b_up=b_up, b_down=b_down)
    tensors = (x, w_gate, w_up, w_down, b_gate, b_up, b_down)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        return runtime.apply(SwiGLUMLPFunction, *tensors)
    return _mlp_forward(*tensors)[0]


def swiglu_mlp_reference(x, w_gate, w_up, w_down, b_gate=None, b_up=None, b_down=None):
    linear = torch.nn.functional.linear
    return linear(swiglu_reference(linear(x, w_gate, b_gate), linear(x, w_up, b_up)), w_down, b_down)
