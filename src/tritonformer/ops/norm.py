"""RMSNorm and LayerNorm over the last dimension, forward and backward, sharing one set of kernels.

    rms_norm:   xhat = x * rstd,           rstd = 1 / sqrt(mean(x^2) + eps)
    layer_norm: xhat = (x - mean) * rstd,  rstd = 1 / sqrt(var(x) + eps)
    y = xhat * w (+ b); add_rms_norm normalizes h = x + residual and returns h beside y.
Backward, with g = dy * w (or dy without a weight):
    rms_norm:   dx = rstd * (g - xhat * mean(g * xhat))
    layer_norm: dx = rstd * (g - mean(g) - xhat * mean(g * xhat))
    dw = sum over rows of dy * xhat,  db = sum over rows of dy

x (..., N) in a float dtype, weight and bias (N,) or None; the forward saves rstd (and mean) per
row. Rows up to FUSED_MAX_N (LayerNorm's backward with a bias: LAYER_NORM_BWD_MAX_N) live in
registers, read once and written once each way; the backward's programs keep dw/db partial sums
in registers, which one more kernel adds up. Longer rows take looped kernels that read a row twice
(the second read mostly from L2), but for LayerNorm's backward: a kernel of row means, then one
over column blocks of row groups. Design and measurements: docs/norm.md.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch
import triton
import triton.language as tl

from .. import runtime

# 32768 float32 values fill 32 registers per thread of a 32-warp program (the softmax bound).
FUSED_MAX_N = 32768
LOOP_CHUNK = 4096
# Launch shapes from the H100 sweeps (docs/norm.md): a program of ROWS_ELEMENTS values (one row
# from 2048 columns up; BWD_ROWS_ELEMENTS in RMSNorm's backward, from small models' rows), at most
# MAX_WARPS warps, and in the backward as many programs as make BWD_WARPS_PER_SM warps an SM.
ROWS_ELEMENTS = 2048
BWD_ROWS_ELEMENTS = 4096
MAX_WARPS = 16
BWD_WARPS_PER_SM = 16
# LayerNorm's backward also holds dw and db partial sums a column: from 16384 columns that spills
# (0.27-1.3 TB/s on the H100, RMSNorm's 2.5), so wider rows leave the registers.
LAYER_NORM_BWD_MAX_N = 8192


def _launch_shape(n: int, rms: bool, shifted_stats: bool) -> tuple[int, int, int]:
    """BLOCK_M, BLOCK_N, num_warps of the forward for rows of n elements held in registers.
    LayerNorm's float32 forward reduces a row three times: from 16384 columns 8 warps, whose
    reductions cross fewer warps (2.48 against 1.94 TB/s at 16 on the H100)."""
    block_n = runtime.next_power_of_2(n)
    block_m = max(1, ROWS_ELEMENTS // block_n)
    max_warps = MAX_WARPS if rms or shifted_stats or block_n < 16384 else 8
    return block_m, block_n, min(max_warps, max(4, block_m * block_n // 512))


def _bwd_launch_shape(n: int, rms: bool) -> tuple[int, int, int, int]:
    """BLOCK_M, BLOCK_N, num_warps and programs per SM of the in-register backward: 16 (LayerNorm)
    or 32 (RMSNorm) values a thread."""
    block_n = runtime.next_power_of_2(n)
    block_m = max(1, (BWD_ROWS_ELEMENTS if rms else ROWS_ELEMENTS) // block_n)
    per_thread = 32 if rms else 16
    num_warps = min(MAX_WARPS, max(4, block_m * block_n // (32 * per_thread)))
    return block_m, block_n, num_warps, max(1, BWD_WARPS_PER_SM // num_warps)


# The looped backward (RMSNorm's rows past FUSED_MAX_N): 32 warps, one program an SM (1.24 against
# 0.72 TB/s at 8 warps and two an SM, measured at LayerNorm 4096x16384 on the H100).
LOOPED_BWD_WARPS = 32
# LayerNorm's wide-row backward (_layer_norm_bwd_split): the row-means kernel's coef_* settings, then
# the column kernel's block_m x block_n tiles, rows a program, warps and stages in flight; reverse:
# the last row groups (still in L2) first. 0.250 ms against the looped kernel's 0.335 at 4096x16384
# bf16 (H100).
LAYER_NORM_SPLIT = dict(coef_rows=1, coef_chunk=4096, coef_warps=8, coef_stages=2,
                        block_m=16, block_n=256, rows=256, warps=8, stages=3, reverse=True)


@triton.jit
def _norm_fwd_kernel(
    x_ptr, res_ptr, h_ptr, w_ptr, b_ptr, y_ptr, stats_ptr, M, N, stride_xm, stride_rm, stride_ym, eps, offset,
    RMS: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr, ROUND_XHAT: tl.constexpr,
    HAS_RES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SHIFTED_STATS: tl.constexpr,
):
    """HAS_RES: the normalized rows are h = x + res, rounded to x's dtype as torch's add rounds
    them, and written to h_ptr (rows of N, contiguous)."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    row_ok = rows < M
    mask = row_ok[:, None] & (cols[None, :] < N)
    rows64 = rows.to(tl.int64)[:, None]
    x = tl.load(x_ptr + rows64 * stride_xm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        x += tl.load(res_ptr + rows64 * stride_rm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        x = x.to(h_ptr.dtype.element_ty)
        tl.store(h_ptr + rows64 * N + cols[None, :], x, mask=mask)
        x = x.to(tl.float32)
    if RMS:
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / N + eps)
        xhat = x * rstd[:, None]
    elif SHIFTED_STATS:
        # Sums of the deviations from the row's first element and of their squares, in one
        # reduction: shifted by a value of the row, E[d^2] - E[d]^2 does not cancel as
        # E[x^2] - E[x]^2 does when the mean is large against the spread.
        shift = tl.load(x_ptr + rows64 * stride_xm, mask=row_ok[:, None], other=0.0).to(tl.float32)
        d = tl.where(mask, x - shift, 0.0)
        if runtime.COMPILED:
            sum_d, sum_dd = tl.reduce((d, d * d), 1, _add_pair)
        else:  # the interpreter runs a custom combine element by element in Python (docs/runtime.md)
            sum_d, sum_dd = tl.sum(d, axis=1), tl.sum(d * d, axis=1)
        mean_d = sum_d / N
        mean = tl.reshape(shift, (BLOCK_M,)) + mean_d
        rstd = 1.0 / tl.sqrt(tl.maximum(sum_dd / N - mean_d * mean_d, 0.0) + eps)
        xhat = (d - mean_d[:, None]) * rstd[:, None]
        tl.store(stats_ptr + M + rows, mean, mask=row_ok)
    else:
        # A second pass over the registers corrects the rounding of a large mean's float32 sum.
        mean = tl.sum(x, axis=1) / N
        mean += tl.sum(tl.where(mask, x - mean[:, None], 0.0), axis=1) / N
        xc = tl.where(mask, x - mean[:, None], 0.0)
        rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=1) / N + eps)
        xhat = xc * rstd[:, None]
        tl.store(stats_ptr + M + rows, mean, mask=row_ok)
    tl.store(stats_ptr + rows, rstd, mask=row_ok)
    y = _affine(xhat, w_ptr, b_ptr, cols, N, offset, x_ptr.dtype.element_ty, HAS_W, HAS_B, ROUND_XHAT)
    tl.store(y_ptr + rows64 * stride_ym + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _add_pair(a0, a1, b0, b1):
    return a0 + b0, a1 + b1


@triton.jit
def _affine(xhat, w_ptr, b_ptr, cols, N, offset, x_dtype: tl.constexpr,
            HAS_W: tl.constexpr, HAS_B: tl.constexpr, ROUND_XHAT: tl.constexpr):
    """xhat * (w + offset) + b for a (rows, cols) block; ROUND_XHAT rounds xhat to the input
    dtype first (HuggingFace's LlamaRMSNorm multiplies the weight into the rounded value)."""
    y = xhat
    if ROUND_XHAT:
        y = y.to(x_dtype).to(tl.float32)
    if HAS_W:
        w = tl.load(w_ptr + cols, mask=cols < N, other=0.0).to(tl.float32) + offset
        y = y * w[None, :]
    if HAS_B:
        y = y + tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    return y


@triton.jit
def _bwd_tile(x_ptr, dy_ptr, stats_ptr, rows, row_ok, cols, col_ok, stride_xm, stride_dym):
    """A backward's tile of rows by cols: x and dy in float32 (0 outside), the rows' rstd, the
    tile's mask and the rows' 64-bit offsets (a column vector) for the stores that follow."""
    mask = row_ok[:, None] & col_ok[None, :]
    rows64 = rows.to(tl.int64)[:, None]
    x = tl.load(x_ptr + rows64 * stride_xm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + rows64 * stride_dym + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    rstd = tl.load(stats_ptr + rows, mask=row_ok, other=0.0)
    return x, dy, rstd, mask, rows64


@triton.jit
def _norm_bwd_kernel(
    x_ptr, w_ptr, dy_ptr, dres_ptr, dx_ptr, stats_ptr, part_ptr,
    M, N, stride_xm, stride_dym, stride_drm, stride_dxm, offset,
    RMS: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr, ROUND_XHAT: tl.constexpr,
    HAS_DRES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, RELOAD_W: tl.constexpr,
):
    """Each program's dw and db column sums go to part_ptr as rows of (dw, db) x programs x N
    (those that exist). HAS_DRES: dx also gets dres, the gradient that x's other uses sent back (an add fused:
    one rounding instead of two). RELOAD_W: the weight is loaded again for every row (from L1)
    instead of held in registers, which leaves them to longer rows (RMSNorm 16384x8192 on the
    H100: 2.86 against 2.58 TB/s held)."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_N)
    col_ok = cols < N
    if HAS_W and not RELOAD_W:
        w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32) + offset
    dw = tl.zeros((BLOCK_N,), tl.float32)
    db = tl.zeros((BLOCK_N,), tl.float32)
    for start in range(pid * BLOCK_M, M, programs * BLOCK_M):
        rows = start + tl.arange(0, BLOCK_M)
        row_ok = rows < M
        x, dy, rstd, mask, rows64 = _bwd_tile(x_ptr, dy_ptr, stats_ptr, rows, row_ok, cols, col_ok, stride_xm,
                                              stride_dym)
        if RMS:
            xhat = x * rstd[:, None]
        else:
            mean = tl.load(stats_ptr + M + rows, mask=row_ok, other=0.0)
            xhat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
        if HAS_W:
            if RELOAD_W:
                w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32) + offset
            g = dy * w[None, :]
            xhat_w = xhat.to(x_ptr.dtype.element_ty).to(tl.float32) if ROUND_XHAT else xhat
            dw += tl.sum(dy * xhat_w, axis=0)
        else:
            g = dy
        if HAS_B:
            db += tl.sum(dy, axis=0)
        dx = g - xhat * (tl.sum(g * xhat, axis=1) / N)[:, None]
        if not RMS:
            dx -= (tl.sum(g, axis=1) / N)[:, None]
        dx *= rstd[:, None]
        if HAS_DRES:
            dx += tl.load(dres_ptr + rows64 * stride_drm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        tl.store(dx_ptr + rows64 * stride_dxm + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)
    if HAS_W:
        tl.store(part_ptr + pid * N + cols, dw, mask=col_ok)
    if HAS_B:
        tl.store(part_ptr + (HAS_W * programs + pid) * N + cols, db, mask=col_ok)


@triton.jit
def _sum_parts_kernel(parts_ptr, sums_ptr, P, N, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    """sums[i, cols] = the sum over p of parts[i, p, cols] (float32), stored in sums' dtype: the
    backward's dw/db partial rows reduced and cast in one launch (torch's sum then cast is two,
    and each launch is host time a small backward cannot spare)."""
    param = tl.program_id(1).to(tl.int64)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    parts = parts_ptr + param * P * N
    acc = tl.zeros((BLOCK_P, BLOCK_N), tl.float32)
    for start in range(0, P, BLOCK_P):
        rows = start + tl.arange(0, BLOCK_P)
        acc += tl.load(parts + rows[:, None] * N + cols[None, :], mask=(rows[:, None] < P) & col_ok[None, :],
                       other=0.0)
    tl.store(sums_ptr + param * N + cols, tl.sum(acc, axis=0).to(sums_ptr.dtype.element_ty), mask=col_ok)


@triton.jit
def _norm_fwd_looped_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, stats_ptr, M, N, stride_xm, stride_ym, eps, offset,
    RMS: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr, ROUND_XHAT: tl.constexpr,
    CHUNK: tl.constexpr,
):
    row = tl.program_id(0)
    x_row = x_ptr + row.to(tl.int64) * stride_xm
    y_row = y_ptr + row.to(tl.int64) * stride_ym
    cols = tl.arange(0, CHUNK)
    mean = 0.0
    if not RMS:
        acc = tl.zeros((CHUNK,), tl.float32)
        for start in range(0, N, CHUNK):
            acc += tl.load(x_row + start + cols, mask=start + cols < N, other=0.0).to(tl.float32)
        mean = tl.sum(acc, axis=0) / N
        tl.store(stats_ptr + M + row, mean)
    # Squares of deviations from the mean, not E[x^2] - mean^2, which cancels catastrophically.
    acc = tl.zeros((CHUNK,), tl.float32)
    for start in range(0, N, CHUNK):
        offs = start + cols
        x = tl.load(x_row + offs, mask=offs < N, other=0.0).to(tl.float32)
        xc = tl.where(offs < N, x - mean, 0.0)
        acc += xc * xc
    rstd = 1.0 / tl.sqrt(tl.sum(acc, axis=0) / N + eps)
    tl.store(stats_ptr + row, rstd)
    for start in range(0, N, CHUNK):
        offs = start + cols
        x = tl.load(x_row + offs, mask=offs < N, other=0.0).to(tl.float32)
        y = _affine(((x - mean) * rstd)[None, :], w_ptr, b_ptr, offs, N, offset, x_ptr.dtype.element_ty,
                    HAS_W, HAS_B, ROUND_XHAT)
        tl.store(y_row + offs[None, :], y.to(y_ptr.dtype.element_ty), mask=(offs < N)[None, :])


@triton.jit
def _norm_bwd_looped_kernel(
    x_ptr, w_ptr, dy_ptr, dx_ptr, stats_ptr, dw_part_ptr, db_part_ptr,
    M, N, stride_xm, stride_dym, stride_dxm, offset,
    RMS: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr, ROUND_XHAT: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """Each program owns rows pid, pid + programs, ...; its dw/db partial row lives in global
    memory (too long for registers) and is only ever touched by this program."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    cols = tl.arange(0, CHUNK)
    for row in range(pid, M, programs):
        row64 = tl.cast(row, tl.int64)
        x_row = x_ptr + row64 * stride_xm
        dy_row = dy_ptr + row64 * stride_dym
        rstd = tl.load(stats_ptr + row)
        mean = 0.0
        if not RMS:
            mean = tl.load(stats_ptr + M + row)
        sum_g = tl.zeros((CHUNK,), tl.float32)
        sum_gx = tl.zeros((CHUNK,), tl.float32)
        for start in range(0, N, CHUNK):
            offs = start + cols
            ok = offs < N
            x = tl.load(x_row + offs, mask=ok, other=0.0).to(tl.float32)
            g = tl.load(dy_row + offs, mask=ok, other=0.0).to(tl.float32)
            if HAS_W:
                g *= tl.load(w_ptr + offs, mask=ok, other=0.0).to(tl.float32) + offset
            sum_g += g
            sum_gx += g * tl.where(ok, (x - mean) * rstd, 0.0)
        mean_g = tl.sum(sum_g, axis=0) / N
        mean_gx = tl.sum(sum_gx, axis=0) / N
        for start in range(0, N, CHUNK):
            offs = start + cols
            ok = offs < N
            x = tl.load(x_row + offs, mask=ok, other=0.0).to(tl.float32)
            dy = tl.load(dy_row + offs, mask=ok, other=0.0).to(tl.float32)
            xhat = (x - mean) * rstd
            g = dy
            if HAS_W:
                g = dy * (tl.load(w_ptr + offs, mask=ok, other=0.0).to(tl.float32) + offset)
                xhat_w = xhat.to(x_ptr.dtype.element_ty).to(tl.float32) if ROUND_XHAT else xhat
                part = dw_part_ptr + pid * N + offs
                tl.store(part, tl.load(part, mask=ok, other=0.0) + dy * xhat_w, mask=ok)
            if HAS_B:
                part = db_part_ptr + pid * N + offs
                tl.store(part, tl.load(part, mask=ok, other=0.0) + dy, mask=ok)
            dx = g - xhat * mean_gx
            if not RMS:
                dx -= mean_g
            tl.store(dx_ptr + row64 * stride_dxm + offs, (dx * rstd).to(dx_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _ln_bwd_coef_kernel(
    x_ptr, w_ptr, dy_ptr, stats_ptr, coef_ptr, M, N, stride_xm, stride_dym, offset,
    HAS_W: tl.constexpr, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr, STAGES: tl.constexpr,
):
    """The column-split LayerNorm backward's first kernel: per row, the two means dx needs,
    mean(g * xhat) to coef_ptr[row] and mean(g) to coef_ptr[M + row] (g = dy * w), from one
    streaming read of x and dy. Rows go in program order, so the last rows are the ones still in
    L2 when the second kernel starts."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    rows64 = rows.to(tl.int64)[:, None]
    rstd = tl.load(stats_ptr + rows, mask=row_ok, other=0.0)
    mean = tl.load(stats_ptr + M + rows, mask=row_ok, other=0.0)
    cols = tl.arange(0, CHUNK)
    sum_g = tl.zeros((BLOCK_M, CHUNK), tl.float32)
    sum_gxc = tl.zeros((BLOCK_M, CHUNK), tl.float32)
    for start in tl.range(0, N, CHUNK, num_stages=STAGES):
        offs = start + cols
        col_ok = offs < N
        mask = row_ok[:, None] & col_ok[None, :]
        x = tl.load(x_ptr + rows64 * stride_xm + offs[None, :], mask=mask, other=0.0).to(tl.float32)
        g = tl.load(dy_ptr + rows64 * stride_dym + offs[None, :], mask=mask, other=0.0).to(tl.float32)
        if HAS_W:
            g *= (tl.load(w_ptr + offs, mask=col_ok, other=0.0).to(tl.float32) + offset)[None, :]
        sum_g += g
        # x - mean, not x: sum(g * x) - mean * sum(g) cancels when the mean is large (g is 0 where masked).
        sum_gxc += g * (x - mean[:, None])
    tl.store(coef_ptr + rows, tl.sum(sum_gxc, axis=1) * rstd / N, mask=row_ok)
    tl.store(coef_ptr + M + rows, tl.sum(sum_g, axis=1) / N, mask=row_ok)


@triton.jit
def _ln_bwd_cols_kernel(
    x_ptr, w_ptr, dy_ptr, dx_ptr, stats_ptr, coef_ptr, dw_part_ptr, db_part_ptr, dw_ptr, db_ptr, counter_ptr,
    M, N, rows_per_program, stride_xm, stride_dym, stride_dxm, offset,
    HAS_W: tl.constexpr, HAS_B: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    GROUPED: tl.constexpr, REVERSE: tl.constexpr, STAGES: tl.constexpr,
):
    """The column-split LayerNorm backward's second kernel. Program (j, k) owns columns
    [j * BLOCK_N, (j + 1) * BLOCK_N) of rows [k * rows_per_program, (k + 1) * rows_per_program):
    it reads x and dy there, writes dx with the row means of the first kernel, and sums dy * xhat
    and dy over its rows in registers. GROUPED (more than one row group): each group stores its
    column sums in dw_part/db_part (groups, N) and counts itself in at counter_ptr[j]; the last to
    arrive adds the groups' sums in group order (the same bits whichever arrives last), writes dw
    and db, and resets the counter. REVERSE: the last row group first (the first kernel's last
    rows may still be in L2)."""
    pid_n = tl.program_id(0)
    groups = tl.num_programs(1)
    group = tl.program_id(1)
    if REVERSE:
        group = groups - 1 - group
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    if HAS_W:
        w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32) + offset
    dw = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    db = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    row_start = group * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, M)
    for start in tl.range(row_start, row_end, BLOCK_M, num_stages=STAGES):
        rows = start + tl.arange(0, BLOCK_M)
        row_ok = rows < row_end
        x, dy, rstd, mask, rows64 = _bwd_tile(x_ptr, dy_ptr, stats_ptr, rows, row_ok, cols, col_ok, stride_xm,
                                              stride_dym)
        mean = tl.load(stats_ptr + M + rows, mask=row_ok, other=0.0)
        mean_gx = tl.load(coef_ptr + rows, mask=row_ok, other=0.0)
        mean_g = tl.load(coef_ptr + M + rows, mask=row_ok, other=0.0)
        xhat = (x - mean[:, None]) * rstd[:, None]
        g = dy
        if HAS_W:
            g = dy * w[None, :]
        dx = (g - mean_g[:, None] - xhat * mean_gx[:, None]) * rstd[:, None]
        tl.store(dx_ptr + rows64 * stride_dxm + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)
        if HAS_W:
            dw += dy * xhat  # dy is 0 where masked
        if HAS_B:
            db += dy
    dw_cols = tl.sum(dw, axis=0)
    db_cols = tl.sum(db, axis=0)
    if GROUPED:
        if HAS_W:
            tl.store(dw_part_ptr + group * N + cols, dw_cols, mask=col_ok)
        if HAS_B:
            tl.store(db_part_ptr + group * N + cols, db_cols, mask=col_ok)
        # One thread does the atomic: the barrier orders every thread's stores before its release.
        tl.debug_barrier()
        arrived = tl.atomic_add(counter_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if arrived == groups - 1:
            dw_cols = tl.zeros((BLOCK_N,), tl.float32)
            db_cols = tl.zeros((BLOCK_N,), tl.float32)
            for k in range(0, groups):
                # .cg: at L2, where the other programs' sums are, never a stale L1 line.
                if HAS_W:
                    dw_cols += tl.load(dw_part_ptr + k * N + cols, mask=col_ok, other=0.0, cache_modifier=".cg")
                if HAS_B:
                    db_cols += tl.load(db_part_ptr + k * N + cols, mask=col_ok, other=0.0, cache_modifier=".cg")
            tl.store(counter_ptr + pid_n, 0)
            if HAS_W:
                tl.store(dw_ptr + cols, dw_cols, mask=col_ok)
            if HAS_B:
                tl.store(db_ptr + cols, db_cols, mask=col_ok)
    else:
        if HAS_W:
            tl.store(dw_ptr + cols, dw_cols, mask=col_ok)
        if HAS_B:
            tl.store(db_ptr + cols, db_cols, mask=col_ok)


_launch_fwd = runtime.FastLaunch(_norm_fwd_kernel)
_launch_fwd_looped = runtime.FastLaunch(_norm_fwd_looped_kernel)
_launch_bwd = runtime.FastLaunch(_norm_bwd_kernel)
_launch_bwd_looped = runtime.FastLaunch(_norm_bwd_looped_kernel)
_launch_ln_coef = runtime.FastLaunch(_ln_bwd_coef_kernel)
_launch_ln_cols = runtime.FastLaunch(_ln_bwd_cols_kernel)
_launch_sum_parts = runtime.FastLaunch(_sum_parts_kernel)
# 16 columns a program: twice the programs of 32 read the partial rows faster (docs/norm.md).
SUM_PARTS_BLOCK_P, SUM_PARTS_BLOCK_N = 64, 16


def sum_parts(parts: torch.Tensor, count: int, N: int, dtype: torch.dtype) -> torch.Tensor:
    """The sum of `count` float32 partial rows of N at the start of `parts`, as an (N,) tensor of
    `dtype`: the second pass of column sums taken by row blocks (qkv_rope's bias gradient)."""
    sums = runtime.empty((N,), dtype, parts.device)
    _launch_sum_parts((runtime.cdiv(N, SUM_PARTS_BLOCK_N), 1), parts, sums, count, N,
                      BLOCK_P=SUM_PARTS_BLOCK_P, BLOCK_N=SUM_PARTS_BLOCK_N, num_warps=4)
    return sums


def _flags(rms: bool, weight, bias, round_xhat: bool) -> dict:
    # LlamaRMSNorm rounds the normalized value to the input dtype before the weight multiply;
    # the Gemma (offset 1) and GPT-OSS variants and LayerNorm multiply in float32 and round once.
    return dict(RMS=rms, HAS_W=weight is not None, HAS_B=bias is not None, ROUND_XHAT=round_xhat)


@runtime.planned
def norm_fwd(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float,
             offset: float, rms: bool, round_xhat: bool, out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, stats): stats holds rstd per row, then (layer_norm) the mean per row, in one buffer:
    one allocation less on a host path where each costs microseconds. The in-register launch is
    planned (runtime.planned): at 16384 x 4096 the H100 machine's host otherwise takes longer
    than the GPU."""
    N = x.shape[-1]
    x_rows = runtime.rows_view(x, N)
    M = x_rows.shape[0]
    y = runtime.empty(x.shape, out_dtype, x.device)
    stats = runtime.empty((M if rms else 2 * M,), torch.float32, x.device)
    if x.numel() == 0:
        return y, stats
    flags = _flags(rms, weight, bias, round_xhat)
    w, b = _or(weight, x_rows), _or(bias, x_rows)
    if N <= FUSED_MAX_N:
        entry, grid, scalars = _fwd_in_registers(x_rows, None, None, w, b, y, stats, eps, offset, flags)
        if entry is not None and runtime.starts_as(x_rows, x):
            runtime.keep_plan(functools.partial(_replay_fwd, stats.shape[0], entry, grid, scalars))
    else:
        _launch_fwd_looped((M,), x_rows, w, b, y, stats, M, N, x_rows.stride(0), N, float(eps), float(offset),
                           **flags, CHUNK=LOOP_CHUNK, num_warps=8)
    return y, stats


def _replay_fwd(stats_len, entry, grid, scalars, x, weight, bias, eps, offset, rms, round_xhat, out_dtype):
    """The in-register forward, planned: (y, stats) as norm_fwd returns them."""
    y = runtime.empty(x.shape, out_dtype, x.device)
    stats = runtime.empty((stats_len,), torch.float32, x.device)
    _launch_fwd.replay(entry, grid, x, x, x, _or(weight, x), _or(bias, x), y, stats, *scalars)
    return y, stats


def _fwd_in_registers(x_rows, res_rows, h, w, b, y, stats, eps, offset, flags) -> tuple:
    """Launch the in-register forward; (its FastLaunch entry, grid, scalar arguments)."""
    M, N = x_rows.shape
    shifted = x_rows.dtype != torch.float32
    block_m, block_n, num_warps = _launch_shape(N, flags["RMS"], shifted)
    grid = (runtime.cdiv(M, block_m),)
    scalars = (M, N, x_rows.stride(0), x_rows.stride(0) if res_rows is None else res_rows.stride(0), N, float(eps),
               float(offset))
    entry = _launch_fwd(grid, x_rows, _or(res_rows, x_rows), _or(h, x_rows), w, b, y, stats, *scalars, **flags,
                        HAS_RES=res_rows is not None, SHIFTED_STATS=shifted, BLOCK_M=block_m, BLOCK_N=block_n,
                        num_warps=num_warps)
    return entry, grid, scalars


@runtime.planned
def add_norm_fwd(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None, eps: float, offset: float,
                 round_xhat: bool, out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, h, stats) of RMSNorm over h = x + residual (rows up to FUSED_MAX_N), h contiguous.
    Planned as norm_fwd."""
    N = x.shape[-1]
    x_rows, res_rows = runtime.rows_view(x, N), runtime.rows_view(residual, N)
    y = runtime.empty(x.shape, out_dtype, x.device)
    h = runtime.empty(x.shape, x.dtype, x.device)
    stats = runtime.empty((x_rows.shape[0],), torch.float32, x.device)
    if x.numel():
        entry, grid, scalars = _fwd_in_registers(x_rows, res_rows, h, _or(weight, x_rows), x_rows, y, stats, eps,
                                                 offset, _flags(True, weight, None, round_xhat))
        if entry is not None and runtime.starts_as(x_rows, x, res_rows, residual):
            runtime.keep_plan(functools.partial(_replay_add_norm_fwd, entry, grid, scalars))
    return y, h, stats


def _replay_add_norm_fwd(entry, grid, scalars, x, residual, weight, eps, offset, round_xhat, out_dtype):
    y = runtime.empty(x.shape, out_dtype, x.device)
    h = runtime.empty(x.shape, x.dtype, x.device)
    stats = runtime.empty((scalars[0],), torch.float32, x.device)  # scalars: rows, then the rest
    _launch_fwd.replay(entry, grid, x, residual, h, _or(weight, x), x, y, stats, *scalars)
    return y, h, stats


@runtime.planned
def norm_bwd(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
             stats: torch.Tensor, offset: float, rms: bool, round_xhat: bool, sums_dtype: torch.dtype,
             dres: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, sums): sums holds dw then db (those that exist) as rows of `sums_dtype` (summed in
    float32). dres, when given, is added into dx (rows up to FUSED_MAX_N). Planned as norm_fwd."""
    N = x.shape[-1]
    x_rows, dy_rows = runtime.rows_view(x, N), runtime.rows_view(dy, N)
    dres_rows = None if dres is None else runtime.rows_view(dres, N)
    views = runtime.starts_as(x_rows, x, dy_rows, dy, dres_rows, dres)
    M = x_rows.shape[0]
    n_params = (weight is not None) + (bias is not None)
    dx = runtime.empty(x.shape, x.dtype, x.device)
    if M == 0 or N == 0:
        return dx, torch.zeros((n_params, N), dtype=sums_dtype, device=x.device)
    looped = N > (FUSED_MAX_N if rms or bias is None else LAYER_NORM_BWD_MAX_N)
    if looped and not rms and dres is None:  # dres comes from add_rms_norm alone
        sums, replay = _layer_norm_bwd_split(x_rows, weight, bias, dy_rows, dx, stats, offset)
        if replay is not None and views:
            runtime.keep_plan(replay if sums_dtype == torch.float32 else
                              functools.partial(_replay_cast, replay, sums_dtype))
        return dx, sums.to(sums_dtype)
    block_m, block_n, num_warps, per_sm = _bwd_launch_shape(N, rms)
    programs = max(1, min(M, runtime.num_sms(x.device.index or 0) * (1 if looped else per_sm)))
    flags = _flags(rms, weight, bias, round_xhat)
    if looped:
        # dw and db partial rows in one buffer, zeroed: the looped kernel accumulates into them.
        parts = torch.zeros((n_params, programs, N), dtype=torch.float32, device=x.device)
        dw_part = parts[0] if weight is not None else parts
        db_part = parts[n_params - 1] if bias is not None else parts
        _launch_bwd_looped((programs,), x_rows, _or(weight, x_rows), dy_rows, dx, stats, dw_part, db_part, M, N,
                           x_rows.stride(0), dy_rows.stride(0), N, float(offset), **flags, CHUNK=LOOP_CHUNK,
                           num_warps=LOOPED_BWD_WARPS)
        if dres is not None:
            dx.add_(dres)
        return dx, parts.sum(1).to(sums_dtype)
    # The partial rows live in the stream's workspace: the sum kernel reads them right after.
    parts = runtime.workspace(x.device, n_params * programs * N)
    scalars = (M, N, x_rows.stride(0), dy_rows.stride(0),
               dy_rows.stride(0) if dres_rows is None else dres_rows.stride(0), N, float(offset))
    entry = _launch_bwd((programs,), x_rows, _or(weight, x_rows), dy_rows, _or(dres_rows, dy_rows), dx, stats, parts,
                        *scalars, **flags, HAS_DRES=dres_rows is not None, BLOCK_M=block_m, BLOCK_N=block_n,
                        RELOAD_W=rms, num_warps=num_warps)
    sums = runtime.empty((n_params, N), sums_dtype, x.device)
    if not n_params:
        return dx, sums
    sum_grid = (runtime.cdiv(N, SUM_PARTS_BLOCK_N), n_params)
    sum_entry = _launch_sum_parts(sum_grid, parts, sums, programs, N, BLOCK_P=SUM_PARTS_BLOCK_P,
                                  BLOCK_N=SUM_PARTS_BLOCK_N, num_warps=4)
    if entry is not None and sum_entry is not None and views:
        runtime.keep_plan(functools.partial(_replay_bwd_in_registers, programs, entry, scalars, sum_entry, sum_grid))
    return dx, sums


def _replay_bwd_in_registers(programs, entry, scalars, sum_entry, sum_grid,
                             dy, x, weight, bias, stats, offset, rms, round_xhat, sums_dtype, dres=None):
    """The in-register backward, planned: (dx, sums) as norm_bwd returns them."""
    n_params, N = (weight is not None) + (bias is not None), x.shape[-1]
    dx = runtime.empty(x.shape, x.dtype, x.device)
    parts = runtime.workspace(x.device, n_params * programs * N)
    _launch_bwd.replay(entry, (programs,), x, _or(weight, x), dy, _or(dres, dy), dx, stats, parts, *scalars)
    sums = runtime.empty((n_params, N), sums_dtype, x.device)
    _launch_sum_parts.replay(sum_entry, sum_grid, parts, sums, programs, N)
    return dx, sums


def _replay_cast(replay: Callable, sums_dtype: torch.dtype, *args) -> tuple[torch.Tensor, torch.Tensor]:
    dx, sums = replay(*args)
    return dx, sums.to(sums_dtype)


def _layer_norm_bwd_split(x_rows, weight, bias, dy_rows, dx, stats, offset) -> tuple[torch.Tensor, Callable | None]:
    """LayerNorm's backward of wide rows in two kernels (see LAYER_NORM_SPLIT): writes dx; returns
    the dw and db sums (those that exist) as float32 rows, and the call planned for replay on
    tensors of its signature (None when nothing was launched)."""
    M, N = x_rows.shape
    n_params = (weight is not None) + (bias is not None)
    if M == 0 or N == 0:
        return torch.zeros((n_params, N), dtype=torch.float32, device=x_rows.device), None
    cfg = LAYER_NORM_SPLIT
    block_m, block_n = cfg["block_m"], min(cfg["block_n"], runtime.next_power_of_2(N))
    # Rows a program: a multiple of block_m, and few enough groups for the grid's second axis.
    rows = block_m * runtime.cdiv(max(cfg["rows"], runtime.cdiv(M, 65535)), block_m)
    groups, blocks = runtime.cdiv(M, rows), runtime.cdiv(N, block_n)
    sums, coef, params = _split_buffers(x_rows, M, N, n_params, groups, blocks)
    w = _or(weight, x_rows)
    coef_grid = (runtime.cdiv(M, cfg["coef_rows"]),)
    coef_scalars = (M, N, x_rows.stride(0), dy_rows.stride(0), float(offset))
    coef_entry = _launch_ln_coef(coef_grid, x_rows, w, dy_rows, stats, coef, *coef_scalars, HAS_W=weight is not None,
                                 BLOCK_M=cfg["coef_rows"], CHUNK=min(cfg["coef_chunk"], runtime.next_power_of_2(N)),
                                 STAGES=cfg["coef_stages"], num_warps=cfg["coef_warps"])
    cols_scalars = (M, N, rows, x_rows.stride(0), dy_rows.stride(0), N, float(offset))
    cols_entry = _launch_ln_cols((blocks, groups), x_rows, w, dy_rows, dx, stats, coef, *params, *cols_scalars,
                                 HAS_W=weight is not None, HAS_B=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n,
                                 GROUPED=groups > 1, REVERSE=cfg["reverse"], STAGES=cfg["stages"],
                                 num_warps=cfg["warps"])
    if coef_entry is None or cols_entry is None:
        return sums, None
    return sums, functools.partial(_replay_ln_split, n_params, groups, blocks, coef_entry, coef_grid, coef_scalars,
                                   cols_entry, cols_scalars)


def _split_buffers(like, M, N, n_params, groups, blocks) -> tuple[torch.Tensor, torch.Tensor, tuple]:
    """The split backward's sums (n_params, N), row coefficients (2 M,), and the column kernel's
    dw/db partial rows, dw/db sum rows and arrival counters (placeholders, never touched, for
    parameters that are absent, and for partials and counters with one row group)."""
    sums = runtime.empty((n_params, N), torch.float32, like.device)
    coef = runtime.empty((2 * M,), torch.float32, like.device)
    grouped = groups > 1
    parts = runtime.empty((n_params, groups, N), torch.float32, like.device) if grouped else sums
    counters = runtime.arrival_counters(like.device, blocks) if grouped else coef
    dw_sum, db_sum = (sums[0], sums[n_params - 1]) if n_params else (coef, coef)
    dw_part, db_part = (parts[0], parts[n_params - 1]) if n_params else (coef, coef)
    return sums, coef, (dw_part, db_part, dw_sum, db_sum, counters)


def _replay_ln_split(n_params, groups, blocks, coef_entry, coef_grid, coef_scalars, cols_entry, cols_scalars,
                     dy, x, weight, bias, stats, offset, rms, round_xhat, sums_dtype, dres=None):
    """The split backward, planned: (dx, sums) as norm_bwd returns them (float32 sums)."""
    M, N = coef_scalars[0], coef_scalars[1]
    dx = runtime.empty(x.shape, x.dtype, x.device)
    sums, coef, params = _split_buffers(x, M, N, n_params, groups, blocks)
    w = _or(weight, x)
    _launch_ln_coef.replay(coef_entry, coef_grid, x, w, dy, stats, coef, *coef_scalars)
    _launch_ln_cols.replay(cols_entry, (blocks, groups), x, w, dy, dx, stats, coef, *params, *cols_scalars)
    return dx, sums


def _or(t: torch.Tensor | None, placeholder: torch.Tensor) -> torch.Tensor:
    """A kernel pointer argument for an optional tensor (never read when absent)."""
    return t if t is not None else placeholder


def _fake_norm_fwd(x, weight, bias, eps, offset, rms, round_xhat, out_dtype):
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    return x.new_empty(x.shape, dtype=out_dtype), x.new_empty((rows if rms else 2 * rows,), dtype=torch.float32)


def _fake_add_norm_fwd(x, residual, weight, eps, offset, round_xhat, out_dtype):
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    return (x.new_empty(x.shape, dtype=out_dtype), x.new_empty(x.shape),
            x.new_empty((rows,), dtype=torch.float32))


def _fake_norm_bwd(dy, x, weight, bias, stats, offset, rms, round_xhat, sums_dtype, dres=None):
    n_params = (weight is not None) + (bias is not None)
    return (torch.empty_like(x, memory_format=torch.contiguous_format),
            x.new_empty((n_params, x.shape[-1]), dtype=sums_dtype))


norm_fwd = runtime.custom_op("norm_fwd", fake=_fake_norm_fwd)(norm_fwd)
norm_bwd = runtime.custom_op("norm_bwd", fake=_fake_norm_bwd)(norm_bwd)
add_norm_fwd = runtime.custom_op("add_norm_fwd", fake=_fake_add_norm_fwd)(add_norm_fwd)


class NormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps, offset, rms, round_xhat, out_dtype):
        y, stats = norm_fwd(x, weight, bias, eps, offset, rms, round_xhat, out_dtype)
        ctx.save_for_backward(x, weight, bias, stats)
        ctx.offset, ctx.rms, ctx.round_xhat = offset, rms, round_xhat
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, bias, stats = ctx.saved_tensors
        sums_dtype = _sums_dtype(weight, bias)
        dx, sums = norm_bwd(dy, x, weight, bias, stats, ctx.offset, ctx.rms, ctx.round_xhat, sums_dtype)
        if weight is None and bias is None:
            return dx, None, None, None, None, None, None, None
        rows = sums.unbind(0)
        dw = rows[0].to(weight.dtype) if weight is not None else None
        db = rows[-1].to(bias.dtype) if bias is not None else None
        return dx, dw, db, None, None, None, None, None


def _sums_dtype(weight: torch.Tensor | None, bias: torch.Tensor | None) -> torch.dtype:
    """The dtype the backward sums dw and db into: the parameters' own when they share one (the
    sum kernel casts, saving a launch), else float32 (cast after)."""
    if weight is None:
        return torch.float32 if bias is None else bias.dtype
    return weight.dtype if bias is None or bias.dtype == weight.dtype else torch.float32


class AddRMSNormFunction(torch.autograd.Function):
    """(rms_norm(h), h) for h = x + residual: the residual add of a pre-norm block fused into its
    norm, forward (h written beside y, not read back) and backward (h's gradient from its other
    uses added into the norm's dx, which x and residual both receive)."""

    @staticmethod
    def forward(ctx, x, residual, weight, eps, offset, round_xhat, out_dtype):
        y, h, stats = add_norm_fwd(x, residual, weight, eps, offset, round_xhat, out_dtype)
        ctx.save_for_backward(h, weight, stats)
        ctx.offset, ctx.round_xhat = offset, round_xhat
        return y, h

    @staticmethod
    def backward(ctx, dy, dh):
        h, weight, stats = ctx.saved_tensors
        dx, sums = norm_bwd(dy, h, weight, None, stats, ctx.offset, True, ctx.round_xhat, _sums_dtype(weight, None), dh)
        return dx, dx, sums[0] if weight is not None else None, None, None, None, None


def _normalize(x, weight, bias, eps, offset, rms, round_xhat, out_dtype):
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias)):
        return runtime.apply(NormFunction, x, weight, bias, eps, offset, rms, round_xhat, out_dtype)
    return norm_fwd(x, weight, bias, eps, offset, rms, round_xhat, out_dtype)[0]


def _check_inputs(x, weight, bias, eps):
    runtime.check_tensor("x", x, runtime.FLOAT_DTYPES, min_dim=1)
    n = x.shape[-1]
    for name, param in (("weight", weight), ("bias", bias)):
        if param is None:
            continue
        runtime.check_tensor(name, param, runtime.FLOAT_DTYPES)
        if param.shape != (n,):
            raise ValueError(f"{name} must have shape ({n},) to match x's last dimension, got {tuple(param.shape)}")
        if param.stride(0) != 1 and n > 1:
            raise ValueError(f"{name} must be contiguous")
    runtime.check_same_device(x=x, weight=weight, bias=bias)
    if not isinstance(eps, (int, float)) or eps < 0:
        raise ValueError(f"eps must be a non-negative float, got {eps!r}")


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-6, offset: float = 0.0,
             round_before_weight: bool = True) -> torch.Tensor:
    """RMSNorm over the last dimension with HuggingFace's semantics.

    offset=0 (LlamaRMSNorm): normalize in float32, round to x's dtype, multiply by the weight;
    the result has the promoted dtype of x and the weight. offset=1 (GemmaRMSNorm): multiply
    by (1 + weight) in float32; the result has x's dtype. round_before_weight=False
    (GptOssRMSNorm): multiply by the weight in float32 and round once, to x's dtype.
    """
    out_dtype, round_xhat = _check_rms(x, weight, eps, offset, round_before_weight)
    return _normalize(x, weight, None, eps, offset, True, round_xhat, out_dtype)


def _check_rms(x, weight, eps, offset, round_before_weight: bool) -> tuple[torch.dtype, bool]:
    """Check rms_norm's arguments; the result's dtype (HF's: see rms_norm) and whether the kernels
    round x-hat before the weight multiply."""
    _check_inputs(x, weight, None, eps)
    if not isinstance(offset, (int, float)):
        raise TypeError(f"offset must be a float, got {type(offset).__name__}")
    if not isinstance(round_before_weight, bool):
        raise TypeError(f"round_before_weight must be a bool, got {type(round_before_weight).__name__}")
    round_xhat = round_before_weight and offset == 0.0
    return torch.promote_types(x.dtype, weight.dtype) if weight is not None and round_xhat else x.dtype, round_xhat


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-6,
                 offset: float = 0.0, round_before_weight: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(h, weight, eps, offset, round_before_weight), h) with h = x + residual (rounded to
    their dtype, as torch's add): a pre-norm Transformer block's residual add and the norm after
    it, in one kernel each way. x and residual have the same shape and dtype."""
    out_dtype, round_xhat = _check_rms(x, weight, eps, offset, round_before_weight)
    runtime.check_tensor("residual", residual, (x.dtype,))
    if residual.shape != x.shape:
        raise ValueError(f"residual has shape {tuple(residual.shape)}, x {tuple(x.shape)}: they must match")
    runtime.check_same_device(x=x, residual=residual)
    if x.shape[-1] > FUSED_MAX_N:  # rows past the registers: the looped kernels, unfused
        h = x + residual
        return rms_norm(h, weight, eps, offset, round_before_weight), h
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, residual, weight)):
        return runtime.apply(AddRMSNormFunction, x, residual, weight, eps, offset, round_xhat, out_dtype)
    y, h, _ = add_norm_fwd(x, residual, weight, eps, offset, round_xhat, out_dtype)
    return y, h


def add_rms_norm_reference(x, residual, weight=None, eps=1e-6, offset=0.0, round_before_weight=True):
    h = x + residual
    return rms_norm_reference(h, weight, eps, offset, round_before_weight), h


def layer_norm(x: torch.Tensor, weight: torch.Tensor | None = None, bias: torch.Tensor | None = None,
               eps: float = 1e-5) -> torch.Tensor:
    """`torch.nn.functional.layer_norm` over the last dimension, computed in float32; the result
    has x's dtype."""
    _check_inputs(x, weight, bias, eps)
    return _normalize(x, weight, bias, eps, 0.0, False, False, x.dtype)


def rms_norm_reference(x, weight=None, eps=1e-6, offset=0.0, round_before_weight=True):
    xf = x.to(torch.float32) if x.dtype != torch.float64 else x
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is None:
        return normed.to(x.dtype)
    if offset == 0.0 and round_before_weight:
        return weight * normed.to(x.dtype)
    return (normed * (offset + weight.to(normed.dtype))).to(x.dtype)


def layer_norm_reference(x, weight=None, bias=None, eps=1e-5):
    xf = x.to(torch.float32) if x.dtype != torch.float64 else x
    w = weight.to(xf.dtype) if weight is not None else None
    b = bias.to(xf.dtype) if bias is not None else None
    return torch.nn.functional.layer_norm(xf, xf.shape[-1:], w, b, eps).to(x.dtype)
