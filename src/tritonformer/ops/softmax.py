"""Softmax along one dimension, forward and backward.

    y  = exp(x - max(x)) / sum(exp(x - max(x)))
    dx = y * (dy - sum(y * dy))

`softmax(x, dim)`: x in float32, float16 or bfloat16, of any shape and strides; arithmetic in
float32. Rows (along `dim`) up to FUSED_MAX_N elements live in registers: the forward reads x
once and writes y once, the backward reads y and dy once and writes dx once (from
BWD_HALVES_MIN_N holding y and half of dy). Longer rows take looped kernels: an online pass for
max and sum (or for sum(y * dy)), then a pass that writes, whose second read of the row mostly
hits L2. Design: docs/softmax.md.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from .. import runtime

# A 32-warp program holds 32768 fp32 values in 32 registers per thread: the largest row kept
# on chip without spilling. The backward's y and dy would fill all 64 registers of a thread at
# 32 warps and spill; from BWD_HALVES_MIN_N it holds y and half of dy (docs/softmax.md).
FUSED_MAX_N = 32768
BWD_HALVES_MIN_N = 32768
LOOP_CHUNK = 4096
# Aim for this many elements per program: enough loads in flight per thread.
ELEMENTS_PER_PROGRAM = 4096


@triton.jit
def _softmax_fwd_kernel(
    x_ptr, y_ptr, M, N, stride_xm, stride_xn, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    rows64 = rows.to(tl.int64)[:, None]
    x = tl.load(x_ptr + rows64 * stride_xm + cols[None, :] * stride_xn, mask=mask, other=-float("inf"))
    x = x.to(tl.float32)
    e = tl.exp(x - tl.max(x, axis=1)[:, None])
    y = e * (1.0 / tl.sum(e, axis=1))[:, None]
    tl.store(y_ptr + rows64 * stride_ym + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _softmax_fwd_looped_kernel(x_ptr, y_ptr, N, stride_xm, stride_xn, stride_ym, CHUNK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_xm
    y_row = y_ptr + row * stride_ym
    cols = tl.arange(0, CHUNK)
    # Per-lane running max and sum; lanes are combined once at the end.
    m = tl.full((CHUNK,), -float("inf"), tl.float32)
    s = tl.zeros((CHUNK,), tl.float32)
    for start in range(0, N, CHUNK):
        offs = start + cols
        x = tl.load(x_row + offs * stride_xn, mask=offs < N, other=-float("inf")).to(tl.float32)
        m_new = tl.maximum(m, x)
        # Lanes that have seen only -inf keep s = 0 (avoid exp(-inf - -inf) = nan).
        s = s * tl.where(m_new == -float("inf"), 0.0, tl.exp(m - m_new)) + tl.where(
            m_new == -float("inf"), 0.0, tl.exp(x - m_new))
        m = m_new
    row_max = tl.max(m, axis=0)
    row_sum = tl.sum(s * tl.where(m == -float("inf"), 0.0, tl.exp(m - row_max)), axis=0)
    inv_sum = 1.0 / row_sum
    for start in range(0, N, CHUNK):
        offs = start + cols
        x = tl.load(x_row + offs * stride_xn, mask=offs < N, other=-float("inf")).to(tl.float32)
        tl.store(y_row + offs, (tl.exp(x - row_max) * inv_sum).to(y_ptr.dtype.element_ty), mask=offs < N)


@triton.jit
def _softmax_bwd_kernel(
    y_ptr, dy_ptr, dx_ptr, M, N, stride_ym, stride_dym, stride_dyn, stride_dxm,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HALVES: tl.constexpr,
):
    """dx = y (dy - rowsum(y dy)), rows held in registers. With HALVES the row is two halves and
    only y stays in registers throughout: dy's first half is read again (from L2) after the
    second half's dx is written, so a thread holds three half rows at most instead of four."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rows64 = rows.to(tl.int64)[:, None]
    if HALVES:
        HALF: tl.constexpr = BLOCK_N // 2
        cols = tl.arange(0, HALF)[None, :]
        mask0 = (rows[:, None] < M) & (cols < N)
        mask1 = (rows[:, None] < M) & (cols + HALF < N)
        y_row, dy_row, dx_row = y_ptr + rows64 * stride_ym, dy_ptr + rows64 * stride_dym, dx_ptr + rows64 * stride_dxm
        y0 = tl.load(y_row + cols, mask=mask0, other=0.0).to(tl.float32)
        y1 = tl.load(y_row + HALF + cols, mask=mask1, other=0.0).to(tl.float32)
        dy0 = tl.load(dy_row + cols * stride_dyn, mask=mask0, other=0.0).to(tl.float32)
        dot = tl.sum(y0 * dy0, axis=1)
        dy1 = tl.load(dy_row + (cols + HALF) * stride_dyn, mask=mask1, other=0.0).to(tl.float32)
        dot = (dot + tl.sum(y1 * dy1, axis=1))[:, None]
        tl.store(dx_row + HALF + cols, (y1 * (dy1 - dot)).to(dx_ptr.dtype.element_ty), mask=mask1)
        dy0 = tl.load(dy_row + cols * stride_dyn, mask=mask0, other=0.0).to(tl.float32)
        tl.store(dx_row + cols, (y0 * (dy0 - dot)).to(dx_ptr.dtype.element_ty), mask=mask0)
    else:
        cols = tl.arange(0, BLOCK_N)
        mask = (rows[:, None] < M) & (cols[None, :] < N)
        y = tl.load(y_ptr + rows64 * stride_ym + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + rows64 * stride_dym + cols[None, :] * stride_dyn, mask=mask, other=0.0).to(tl.float32)
        dot = tl.sum(y * dy, axis=1)
        dx = y * (dy - dot[:, None])
        tl.store(dx_ptr + rows64 * stride_dxm + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _softmax_bwd_looped_kernel(
    y_ptr, dy_ptr, dx_ptr, N, stride_ym, stride_dym, stride_dyn, stride_dxm, CHUNK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, CHUNK)
    acc = tl.zeros((CHUNK,), tl.float32)
    for start in range(0, N, CHUNK):
        offs = start + cols
        y = tl.load(y_ptr + row * stride_ym + offs, mask=offs < N, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + row * stride_dym + offs * stride_dyn, mask=offs < N, other=0.0).to(tl.float32)
        acc += y * dy
    dot = tl.sum(acc, axis=0)
    for start in range(0, N, CHUNK):
        offs = start + cols
        y = tl.load(y_ptr + row * stride_ym + offs, mask=offs < N, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + row * stride_dym + offs * stride_dyn, mask=offs < N, other=0.0).to(tl.float32)
        tl.store(dx_ptr + row * stride_dxm + offs, (y * (dy - dot)).to(dx_ptr.dtype.element_ty), mask=offs < N)


def _as_rows(t: torch.Tensor, dim: int) -> torch.Tensor:
    """A (rows, N) view of `t` with `dim` last; copies only when the other dims cannot be
    flattened into one stride, or when a row's last column lies 2^31 elements or more past its
    first (the kernels' column offsets are int32; their row offsets are int64)."""
    moved = t.movedim(dim, -1)
    rows = moved.reshape(math.prod(moved.shape[:-1]), moved.shape[-1])  # -1 is ambiguous when N is 0
    if (rows.shape[1] - 1) * rows.stride(1) >= 2**31:
        rows = rows.contiguous()
    return rows


def _rows_output(t: torch.Tensor, dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A contiguous (rows, N) buffer and the view of it shaped and ordered like `t`."""
    moved_shape = t.movedim(dim, -1).shape
    flat = runtime.empty((math.prod(moved_shape[:-1]), moved_shape[-1]), dtype, t.device)
    return flat, flat.view(moved_shape).movedim(-1, dim)


# Forward launch shapes (BLOCK_M, num_warps) measured best on the H100 for these row lengths (e.g.
# 2.76 against 2.72 TB/s at 4096 fp32; docs/softmax.md); other lengths take _launch_shape's formula.
FWD_LAUNCH = {1024: (4, 8), 4096: (2, 8), 16384: (1, 16)}


def _fwd_launch_shape(n: int) -> tuple[int, int, int]:
    block_n = runtime.next_power_of_2(n)
    if block_n in FWD_LAUNCH:
        block_m, num_warps = FWD_LAUNCH[block_n]
        return block_m, block_n, num_warps
    return _launch_shape(n)


def _launch_shape(n: int) -> tuple[int, int, int]:
    """BLOCK_M, BLOCK_N, num_warps for a row-in-registers launch over rows of n elements."""
    block_n = runtime.next_power_of_2(n)
    block_m = max(1, ELEMENTS_PER_PROGRAM // block_n)
    num_warps = min(32, max(4, block_m * block_n // 512))
    return block_m, block_n, num_warps


def _fake_like(t: torch.Tensor, dim: int) -> torch.Tensor:
    return torch.empty_like(t.movedim(dim, -1), memory_format=torch.contiguous_format).movedim(-1, dim)


def _fake_softmax_fwd(x: torch.Tensor, dim: int) -> torch.Tensor:
    return _fake_like(x, dim)


_launch_fwd = runtime.FastLaunch(_softmax_fwd_kernel)
_launch_fwd_looped = runtime.FastLaunch(_softmax_fwd_looped_kernel)
_launch_bwd = runtime.FastLaunch(_softmax_bwd_kernel)
_launch_bwd_looped = runtime.FastLaunch(_softmax_bwd_looped_kernel)


@runtime.custom_op("softmax_fwd", fake=_fake_softmax_fwd)
@runtime.planned
def softmax_fwd(x: torch.Tensor, dim: int) -> torch.Tensor:
    """softmax(x) along dim. Planned (runtime.planned): at small sizes host time is the op's time."""
    if dim == x.dim() - 1 and x.is_contiguous():
        # The common case, without views: a few microseconds of host time matter at small sizes.
        y_rows = y = runtime.empty(x.shape, x.dtype, x.device)
        x_rows, N = x, x.shape[-1]
        M, stride_xm, stride_xn = x.numel() // max(N, 1), N, 1
    else:
        y_rows, y = _rows_output(x, dim, x.dtype)
        x_rows = _as_rows(x, dim)
        (M, N), (stride_xm, stride_xn) = x_rows.shape, x_rows.stride()
    if x.numel() == 0:
        return y
    if N <= FUSED_MAX_N:
        block_m, block_n, num_warps = _fwd_launch_shape(N)
        launch, grid, scalars = _launch_fwd, (runtime.cdiv(M, block_m),), (M, N, stride_xm, stride_xn, N)
        entry = launch(grid, x_rows, y_rows, *scalars, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps)
    else:
        launch, grid, scalars = _launch_fwd_looped, (M,), (N, stride_xm, stride_xn, N)
        entry = launch(grid, x_rows, y_rows, *scalars, CHUNK=LOOP_CHUNK, num_warps=8)
    if entry is not None and x_rows.data_ptr() == x.data_ptr():
        runtime.keep_plan(functools.partial(_replay_fwd, launch, entry, grid, scalars, y is y_rows))
    return y


def _replay_fwd(launch, entry, grid, scalars, flat, x, dim):
    y_rows, y = (runtime.empty(x.shape, x.dtype, x.device),) * 2 if flat else _rows_output(x, dim, x.dtype)
    launch.replay(entry, grid, x, y_rows, *scalars)
    return y


def _fake_softmax_bwd(y: torch.Tensor, dy: torch.Tensor, dim: int) -> torch.Tensor:
    return _fake_like(y, dim)


@runtime.custom_op("softmax_bwd", fake=_fake_softmax_bwd)
@runtime.planned
def softmax_bwd(y: torch.Tensor, dy: torch.Tensor, dim: int) -> torch.Tensor:
    """The gradient of softmax's input from its output y and dy. Planned as softmax_fwd."""
    if dim == y.dim() - 1 and y.is_contiguous() and dy.is_contiguous():
        dx_rows = dx = runtime.empty(y.shape, y.dtype, y.device)
        y_rows, dy_rows, N = y, dy, y.shape[-1]
        M, stride_ym, stride_dym, stride_dyn = y.numel() // max(N, 1), N, N, 1
    else:
        dx_rows, dx = _rows_output(y, dim, y.dtype)
        y_rows, dy_rows = _as_rows(y, dim), _as_rows(dy, dim)
        if y_rows.stride(1) != 1:
            y_rows = y_rows.contiguous()
        (M, N), stride_ym, (stride_dym, stride_dyn) = y_rows.shape, y_rows.stride(0), dy_rows.stride()
    if y.numel() == 0:
        return dx
    if N <= FUSED_MAX_N:
        block_m, block_n, num_warps = _launch_shape(N)
        launch, grid, scalars = _launch_bwd, (runtime.cdiv(M, block_m),), (M, N, stride_ym, stride_dym, stride_dyn, N)
        entry = launch(grid, y_rows, dy_rows, dx_rows, *scalars, BLOCK_M=block_m, BLOCK_N=block_n,
                       HALVES=block_n >= BWD_HALVES_MIN_N, num_warps=num_warps)
    else:
        launch, grid, scalars = _launch_bwd_looped, (M,), (N, stride_ym, stride_dym, stride_dyn, N)
        entry = launch(grid, y_rows, dy_rows, dx_rows, *scalars, CHUNK=LOOP_CHUNK, num_warps=8)
    if entry is not None and runtime.starts_as(y_rows, y, dy_rows, dy):
        runtime.keep_plan(functools.partial(_replay_bwd, launch, entry, grid, scalars, dx is dx_rows))
    return dx


def _replay_bwd(launch, entry, grid, scalars, flat, y, dy, dim):
    dx_rows, dx = (runtime.empty(y.shape, y.dtype, y.device),) * 2 if flat else _rows_output(y, dim, y.dtype)
    launch.replay(entry, grid, y, dy, dx_rows, *scalars)
    return dx


class SoftmaxFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim):
        y = softmax_fwd(x, dim)
        ctx.save_for_backward(y)
        ctx.dim = dim
        return y

    @staticmethod
    def backward(ctx, dy):
        (y,) = ctx.saved_tensors
        return softmax_bwd(y, dy, ctx.dim), None


def softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Softmax of `x` along `dim` (float32, float16, bfloat16), computed in float32."""
    runtime.check_tensor("x", x, runtime.FLOAT_DTYPES, min_dim=1)
    if not isinstance(dim, int) or not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim must be an int in [{-x.dim()}, {x.dim()}) for x of shape {tuple(x.shape)}, got {dim!r}")
    if x.requires_grad and torch.is_grad_enabled():
        return runtime.apply(SoftmaxFunction, x, dim % x.dim())
    return softmax_fwd(x, dim % x.dim())


def softmax_reference(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    return torch.softmax(x, dim=dim)


def softmax_bwd_reference(y: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    return y * (dy - (y * dy).sum(-1, keepdim=True))
