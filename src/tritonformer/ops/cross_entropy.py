"""Cross entropy over a vocabulary, alone and fused with the linear layer that makes the logits.

Per row of logits x (V classes) with target t, label smoothing e and z-loss weight z (with
softcap=c the logits are first capped, x = c tanh(x / c) as Gemma 2's final logits, and the
gradient carries tanh's derivative 1 - (x / c)^2):

    lse  = log sum_j exp(x_j)
    loss = (1 - e) (lse - x_t) + e (lse - mean_j x_j) + z lse^2
    dloss/dx_j = softmax(x)_j (1 + 2 z lse) - (1 - e) [j == t] - e / V

Rows whose target is ignore_index have loss 0 and gradient 0; "mean" divides by the count of the
others (NaN when all are ignored, as in PyTorch). A target outside [0, V) raises, as in PyTorch:
a ValueError under the interpreter, a device-side assert on a GPU (checking on the host would wait
for the GPU).

`cross_entropy`, logits (..., V): the forward (one program a row, an online max and sum) keeps each
row's max and log-sum; the backward reads the row again and writes the gradient, into a new tensor
or over the logits. `fused_linear_cross_entropy`, hidden (..., H), weight (V, H): per chunk of
tokens cuBLAS makes the logits, one kernel writes each row's loss and the logits' gradient over
them, and cuBLAS turns that into the inputs' gradients; the (tokens, V) logits never exist.
Design and measurements: docs/cross_entropy.md.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .. import runtime
from .attention import NO_SOFTCAP, check_softcap, kernel_softcap, tanh, tanh_approx

REDUCTIONS = ("mean", "sum", "none")
TARGET_DTYPES = (torch.int64, torch.int32)

# Vocabulary elements per step of a row's loop. At 16 warps a thread keeps 16 running sums, and
# two programs share an SM. With one 16 KiB bf16 chunk in flight per program, HBM would idle while
# both reduce; ROW_STAGES chunks are loaded ahead (cp.async). The interpreter takes small steps so
# that CPU tests cross chunk boundaries.
ROW_CHUNK = 1024 if runtime.INTERPRET else 8192
ROW_WARPS = 16
ROW_STAGES = 2
# Once a row's max and log-sum are known the backward is elementwise: a program per block of a row.
BWD_BLOCK = 1024 if runtime.INTERPRET else 4096
BWD_WARPS = 8
REDUCE_BLOCK = 1024
SCALE_BLOCK = 1024 if runtime.INTERPRET else 4096
# The fused loss's kernel reads each row twice (statistics, then the gradient written over it):
# 4096-wide steps on 8 warps, 293 us a 1024 x 128256 chunk against 311 at 8192 on 16 (H100,
# scripts/sweep_launch.py loss; L2 eviction hints changed nothing).
FLCE_ROW_CHUNK = 1024 if runtime.INTERPRET else 4096
# The one (tokens, V) buffer fused_linear_cross_entropy allocates: a token chunk's logits.
FLCE_CHUNK_BYTES = 2**14 if runtime.INTERPRET else 2**28

# Starting the running max at the largest finite float instead of -inf keeps exp(m_old - m_new)
# defined while a row has shown only -inf (masked vocabulary).
FLT_MAX = tl.constexpr(3.4028234663852886e38)


@triton.jit
def _capped(x, softcap, SOFTCAP: tl.constexpr, TANH_APPROX: tl.constexpr):
    """softcap tanh(x / softcap) with SOFTCAP, else x (fp32)."""
    if SOFTCAP:
        x = softcap * tanh(x / softcap, TANH_APPROX)
    return x


@triton.jit
def _row_stats(x_row, t, V, softcap, CHUNK: tl.constexpr, STAGES: tl.constexpr, HAS_SMOOTHING: tl.constexpr,
               SOFTCAP: tl.constexpr, TANH_APPROX: tl.constexpr):
    """(m, log_s, mean_below_max, x_t) of one row (capped logits with SOFTCAP): lse = m + log_s,
    mean_below_max the mean of x - m (label smoothing's share). x_t is NaN when t is outside [0, V)."""
    cols = tl.arange(0, CHUNK)
    m = tl.full((), -FLT_MAX, tl.float32)
    # Per-lane sums against a shared running max: one exp per element, one max-reduction per chunk.
    s = tl.zeros((CHUNK,), tl.float32)
    below = tl.zeros((CHUNK,), tl.float32)
    inv_v = 1.0 / V
    for start in tl.range(0, V, CHUNK, num_stages=STAGES):
        offs = start + cols
        mask = offs < V
        x = tl.load(x_row + offs, mask=mask, other=-float("inf")).to(tl.float32)
        if SOFTCAP:  # past the row's end -inf, not the cap's -softcap
            x = tl.where(mask, _capped(x, softcap, SOFTCAP, TANH_APPROX), -float("inf"))
        m_new = tl.maximum(m, tl.max(x, axis=0))
        x_below = x - m_new
        s = s * tl.exp(m - m_new) + tl.exp(x_below)
        if HAS_SMOOTHING:
            # The mean of x - m, not of x: near a large max, the mean of x and m cancel (a row
            # of 1e20s gave a loss of 9e11). A lane's sum moves down by (m_new - m) / V for each
            # of its earlier chunks (all full); scaled by 1 / V before summing, as logits near
            # the float maximum would overflow the sum.
            if start > 0:
                below -= (start // CHUNK) * (m_new - m) * inv_v
            below += tl.where(mask, x_below * inv_v, 0.0)
        m = m_new
    log_s = tl.log(tl.sum(s, axis=0))
    in_range = (t >= 0) & (t < V)
    x_t = tl.load(x_row + tl.where(in_range, t, 0)).to(tl.float32)
    x_t = tl.where(in_range, _capped(x_t, softcap, SOFTCAP, TANH_APPROX), float("nan"))
    return m, log_s, tl.sum(below, axis=0), x_t


@triton.jit
def _row_loss(m, log_s, mean_below_max, x_t, label_smoothing, z_loss,
              HAS_SMOOTHING: tl.constexpr, HAS_Z_LOSS: tl.constexpr):
    # (m - x_t) + log_s rather than lse - x_t: exact when x_t is the max, however large lse is.
    loss = (m - x_t) + log_s
    if HAS_SMOOTHING:
        loss = (1 - label_smoothing) * loss + label_smoothing * (log_s - mean_below_max)
    if HAS_Z_LOSS:
        lse = m + log_s
        loss += z_loss * lse * lse
    return loss


@triton.jit
def _grad_block(x, offs, t, m, log_s, g, V, label_smoothing, z_loss, softcap,
                HAS_SMOOTHING: tl.constexpr, HAS_Z_LOSS: tl.constexpr, SOFTCAP: tl.constexpr,
                TANH_APPROX: tl.constexpr):
    """g * dloss/dx for the logits x at columns offs of a row (fp32; uncapped: with SOFTCAP the
    cap and its derivative are applied here)."""
    if SOFTCAP:
        th = tanh(x / softcap, TANH_APPROX)
        x = softcap * th
        g = g * (1.0 - th * th)
    # x - m first: exact for logits near the max, where exp(x - lse) would lose lse's rounding.
    dx = tl.exp((x - m) - log_s)
    if HAS_Z_LOSS:
        dx = dx * (1 + 2 * z_loss * (m + log_s))
    if HAS_SMOOTHING:
        dx = dx - label_smoothing / V - tl.where(offs == t, 1 - label_smoothing, 0.0)
    else:
        dx = dx - tl.where(offs == t, 1.0, 0.0)
    # An out-of-range target poisons its row rather than reading out of bounds.
    return dx * tl.where((t >= 0) & (t < V), g, float("nan"))


# The row kernels assert that a row's target is ignore_index or in [0, V), as torch's CUDA loss
# does (a device-side assert); debug=True compiles the assert in, and the launches turn off the
# integer-overflow checks that debug would add (_row_launch). See docs/cross_entropy.md.
@triton.jit(debug=not runtime.INTERPRET)
def _ce_fwd_kernel(
    x_ptr, target_ptr, loss_ptr, stats_ptr, out_ptr, counter_ptr, V, stride_x, stride_t, ignore_index,
    label_smoothing, z_loss, softcap, CHUNK: tl.constexpr, STAGES: tl.constexpr, HAS_SMOOTHING: tl.constexpr,
    HAS_Z_LOSS: tl.constexpr, SOFTCAP: tl.constexpr, TANH_APPROX: tl.constexpr, REDUCE: tl.constexpr,
    MEAN: tl.constexpr, REDUCE_BLOCK: tl.constexpr,
):
    """A row's loss to loss_ptr[row] and its (max, log-sum) to stats_ptr[2 row:]. REDUCE: the
    program that arrives last (counted at counter_ptr, reset after) also reduces the row losses
    into out_ptr and writes the count of rows not ignored to stats_ptr[2 N] (one launch instead
    of a second for the reduction: host time is what small losses cost)."""
    row = tl.program_id(0).to(tl.int64)
    t = tl.load(target_ptr + row * stride_t)
    loss = tl.zeros((), tl.float32)
    # An ignored row is not read at all.
    if t != ignore_index:
        tl.device_assert((t >= 0) & (t < V), "cross_entropy: a target is neither ignore_index nor in [0, V)")
        m, log_s, mean_below_max, x_t = _row_stats(x_ptr + row * stride_x, t, V, softcap, CHUNK, STAGES,
                                                   HAS_SMOOTHING, SOFTCAP, TANH_APPROX)
        loss = _row_loss(m, log_s, mean_below_max, x_t, label_smoothing, z_loss, HAS_SMOOTHING, HAS_Z_LOSS)
        tl.store(stats_ptr + 2 * row, m)
        tl.store(stats_ptr + 2 * row + 1, log_s)
    tl.store(loss_ptr + row, loss.to(loss_ptr.dtype.element_ty))
    if REDUCE:
        N = tl.num_programs(0)
        # One thread does the atomic: the barrier orders every thread's store before its release.
        tl.debug_barrier()
        if tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu") == N - 1:
            _reduce_rows(loss_ptr, target_ptr, out_ptr, stats_ptr + 2 * N, stats_ptr, N, stride_t, ignore_index,
                         MEAN, False, REDUCE_BLOCK)
            tl.store(counter_ptr, 0)


@triton.jit
def _ce_bwd_kernel(
    x_ptr, target_ptr, stats_ptr, grad_loss_ptr, dx_ptr,
    V, stride_x, stride_dx, stride_t, stride_grad, ignore_index, label_smoothing, z_loss, softcap,
    MEAN: tl.constexpr, HAS_SMOOTHING: tl.constexpr, HAS_Z_LOSS: tl.constexpr, SOFTCAP: tl.constexpr,
    TANH_APPROX: tl.constexpr, BLOCK: tl.constexpr,
):
    """A block of a row's gradient; stats as the forward left them (the count of rows not ignored
    after the rows' pairs)."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < V
    t = tl.load(target_ptr + row * stride_t)
    dx_ptrs = dx_ptr + row * stride_dx + offs
    if t == ignore_index:
        tl.store(dx_ptrs, tl.zeros((BLOCK,), tl.float32).to(dx_ptr.dtype.element_ty), mask=mask)
    else:
        g = tl.load(grad_loss_ptr + row * stride_grad).to(tl.float32)
        if MEAN:
            g = g / tl.load(stats_ptr + 2 * tl.num_programs(0))
        m = tl.load(stats_ptr + 2 * row)
        log_s = tl.load(stats_ptr + 2 * row + 1)
        x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
        dx = _grad_block(x, offs, t, m, log_s, g, V, label_smoothing, z_loss, softcap, HAS_SMOOTHING, HAS_Z_LOSS,
                         SOFTCAP, TANH_APPROX)
        tl.store(dx_ptrs, dx.to(dx_ptr.dtype.element_ty), mask=mask)


@triton.jit(debug=not runtime.INTERPRET)
def _loss_and_grad_kernel(
    x_ptr, target_ptr, loss_ptr, scale_ptr, V, stride_t, stride_scale, ignore_index, label_smoothing, z_loss,
    softcap, CHUNK: tl.constexpr, STAGES: tl.constexpr, HAS_SMOOTHING: tl.constexpr, HAS_Z_LOSS: tl.constexpr,
    SOFTCAP: tl.constexpr, TANH_APPROX: tl.constexpr,
):
    """Loss of a row of the contiguous logits x, then x overwritten by scale[row] * dloss/dx."""
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * V
    cols = tl.arange(0, CHUNK)
    t = tl.load(target_ptr + row * stride_t)
    loss = tl.zeros((), tl.float32)
    if t == ignore_index:
        for start in range(0, V, CHUNK):
            offs = start + cols
            tl.store(x_row + offs, tl.zeros((CHUNK,), tl.float32).to(x_ptr.dtype.element_ty), mask=offs < V)
    else:
        tl.device_assert((t >= 0) & (t < V),
                         "fused_linear_cross_entropy: a target is neither ignore_index nor in [0, V)")
        m, log_s, mean_below_max, x_t = _row_stats(x_row, t, V, softcap, CHUNK, STAGES, HAS_SMOOTHING, SOFTCAP,
                                                   TANH_APPROX)
        loss = _row_loss(m, log_s, mean_below_max, x_t, label_smoothing, z_loss, HAS_SMOOTHING, HAS_Z_LOSS)
        g = tl.load(scale_ptr + row * stride_scale).to(tl.float32)
        # Back from the row's end: the chunks the statistics read last may still be in L2
        # (docs/cross_entropy.md).
        last = tl.cdiv(V, CHUNK) - 1
        for i in tl.range(0, last + 1, num_stages=STAGES):
            offs = (last - i) * CHUNK + cols
            mask = offs < V
            x = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
            dx = _grad_block(x, offs, t, m, log_s, g, V, label_smoothing, z_loss, softcap, HAS_SMOOTHING,
                             HAS_Z_LOSS, SOFTCAP, TANH_APPROX)
            tl.store(x_row + offs, dx.to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(loss_ptr + row, loss.to(loss_ptr.dtype.element_ty))


@triton.jit
def _reduce_rows(loss_ptr, target_ptr, out_ptr, count_ptr, divisor_ptr, N, stride_t, ignore_index,
                 MEAN: tl.constexpr, HAS_DIVISOR: tl.constexpr, BLOCK: tl.constexpr):
    """out = sum of the N row losses (divided by the count of rows not ignored when MEAN, or by
    divisor); count_ptr gets that count. A fixed summation order, no atomics. The loads are .cg:
    other programs of the launch may have written the losses (read at L2, never a stale L1 line)."""
    cols = tl.arange(0, BLOCK)
    total = tl.zeros((BLOCK,), tl.float32)
    count = tl.zeros((BLOCK,), tl.int32)
    for start in range(0, N, BLOCK):
        offs = start + cols
        mask = offs < N
        total += tl.load(loss_ptr + offs, mask=mask, other=0.0, cache_modifier=".cg")
        t = tl.load(target_ptr + offs.to(tl.int64) * stride_t, mask=mask, other=ignore_index)
        count += (t != ignore_index).to(tl.int32)
    out = tl.sum(total, axis=0)
    n = tl.sum(count, axis=0).to(tl.float32)
    if MEAN:
        out = out / n
    if HAS_DIVISOR:
        out = out / tl.load(divisor_ptr).to(tl.float32)
    tl.store(out_ptr, out.to(out_ptr.dtype.element_ty))
    tl.store(count_ptr, n)


@triton.jit
def _reduce_kernel(
    loss_ptr, target_ptr, out_ptr, count_ptr, divisor_ptr, N, stride_t, ignore_index,
    MEAN: tl.constexpr, HAS_DIVISOR: tl.constexpr, BLOCK: tl.constexpr,
):
    """_reduce_rows in one program."""
    _reduce_rows(loss_ptr, target_ptr, out_ptr, count_ptr, divisor_ptr, N, stride_t, ignore_index, MEAN,
                 HAS_DIVISOR, BLOCK)


@triton.jit
def _scale_kernel(x_ptr, factor_ptr, n, BLOCK: tl.constexpr):
    factor = tl.load(factor_ptr).to(tl.float32)
    # A loss's backward is seeded with 1 nearly always: x is then left as it is, without a host
    # synchronisation to find that out (scaling a Llama-3 lm_head's gradient reads and writes
    # 1 GiB, 0.35 ms on the H100).
    if factor != 1.0:
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        x = tl.load(x_ptr + offs, mask=mask).to(tl.float32)
        tl.store(x_ptr + offs, (x * factor).to(x_ptr.dtype.element_ty), mask=mask)


_launch_fwd = runtime.FastLaunch(_ce_fwd_kernel)
_launch_bwd = runtime.FastLaunch(_ce_bwd_kernel)
_launch_loss_and_grad = runtime.FastLaunch(_loss_and_grad_kernel)
_launch_reduce = runtime.FastLaunch(_reduce_kernel)
_launch_scale = runtime.FastLaunch(_scale_kernel)


def _row_launch(V: int, row_chunk: int = ROW_CHUNK) -> dict:
    """Launch settings for a program that loops over a row of V logits."""
    chunk = min(row_chunk, runtime.next_power_of_2(V))
    launch = {"CHUNK": chunk, "STAGES": ROW_STAGES, "num_warps": max(1, min(ROW_WARPS, chunk // 512))}
    return launch if runtime.INTERPRET else {**launch, "sanitize_overflow": False}


def _flags(label_smoothing: float, z_loss: float, softcap: float, dtype: torch.dtype) -> dict:
    return {"HAS_SMOOTHING": label_smoothing != 0.0, "HAS_Z_LOSS": z_loss != 0.0, "SOFTCAP": softcap != NO_SOFTCAP,
            "TANH_APPROX": tanh_approx(dtype)}


def _row_losses(x, target, loss, stats, ignore_index, label_smoothing, z_loss, softcap) -> None:
    """Per-row loss (into `loss`, any float dtype) and (max, log-sum) per row (into `stats`)."""
    N, V = x.shape
    if N == 0:
        return
    # loss and stats stand in for the reduction's pointers, never read without REDUCE.
    _launch_fwd((N,), x, target, loss, stats, loss, stats, V, x.stride(0), target.stride(0), ignore_index,
                label_smoothing, z_loss, kernel_softcap(softcap), **_row_launch(V),
                **_flags(label_smoothing, z_loss, softcap, x.dtype), REDUCE=False,
                MEAN=False, REDUCE_BLOCK=REDUCE_BLOCK)


def _reduce(row_loss, target, out, count, divisor, ignore_index, mean: bool) -> None:
    N = row_loss.shape[0]
    # `count` stands in for a missing divisor (never read): FastLaunch replays take tensors.
    _launch_reduce((1,), row_loss, target, out, count, count if divisor is None else divisor, N,
                   target.stride(0), ignore_index, MEAN=mean, HAS_DIVISOR=divisor is not None,
                   BLOCK=min(REDUCE_BLOCK, max(16, runtime.next_power_of_2(N))), num_warps=4)


def _fake_cross_entropy_fwd(logits, target, ignore_index, label_smoothing, z_loss, reduction, softcap=NO_SOFTCAP):
    N = logits.shape[0]
    loss = logits.new_empty((N,) if reduction == "none" else ())
    return loss, logits.new_empty((2 * N + 1,), dtype=torch.float32)


@runtime.custom_op("cross_entropy_fwd", fake=_fake_cross_entropy_fwd)
@runtime.planned
def cross_entropy_fwd(
    logits: torch.Tensor, target: torch.Tensor, ignore_index: int, label_smoothing: float, z_loss: float,
    reduction: str, softcap: float = NO_SOFTCAP,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, stats) for logits (N, V) with unit column stride: stats holds each row's (max,
    log-sum) in float32, then (reduced losses) the count of rows not ignored. Planned
    (runtime.planned): a small loss's time is its host time."""
    loss, stats, tensors = _fwd_buffers(logits, target, reduction)
    N, reduced = logits.shape[0], reduction != "none"
    if N == 0:
        if reduced:  # 0 / 0 for the mean, 0 for the sum, as torch; the count 0 at stats[0]
            _reduce(stats[:0], target, loss, stats, None, ignore_index, mean=reduction == "mean")
        return loss, stats
    V = logits.shape[1]
    scalars = (V, logits.stride(0), target.stride(0), ignore_index, label_smoothing, z_loss, kernel_softcap(softcap))
    entry = _launch_fwd((N,), *tensors, *scalars, **_row_launch(V),
                        **_flags(label_smoothing, z_loss, softcap, logits.dtype), REDUCE=reduced,
                        MEAN=reduction == "mean", REDUCE_BLOCK=REDUCE_BLOCK)
    if entry is not None:
        runtime.keep_plan(functools.partial(_replay_fwd, entry, scalars))
    return loss, stats


def _fwd_buffers(logits, target, reduction) -> tuple[torch.Tensor, torch.Tensor, tuple]:
    """(loss, stats, the forward kernel's tensor arguments)."""
    N, device = logits.shape[0], logits.device
    stats = runtime.empty((2 * N + 1,), torch.float32, device)
    reduced = reduction != "none"
    loss = runtime.empty((() if reduced else (N,)), logits.dtype, device)
    # The row losses of a reduction live in the stream's workspace: the same launch reads them.
    row_loss = runtime.workspace(device, N) if reduced else loss
    return loss, stats, (logits, target, row_loss, stats, loss, runtime.arrival_counters(device, 1))


def _replay_fwd(entry, scalars, logits, target, ignore_index, label_smoothing, z_loss, reduction, softcap=NO_SOFTCAP):
    loss, stats, tensors = _fwd_buffers(logits, target, reduction)
    _launch_fwd.replay(entry, (logits.shape[0],), *tensors, *scalars)
    return loss, stats


@runtime.planned
def _grad_into(dx, logits, target, stats, grad_loss, ignore_index, label_smoothing, z_loss, reduction,
               softcap) -> None:
    N, V = logits.shape
    if N == 0:
        return
    grid = (N, runtime.cdiv(V, BWD_BLOCK))
    stride_grad = grad_loss.stride(0) if reduction == "none" else 0
    scalars = (V, logits.stride(0), dx.stride(0), target.stride(0), stride_grad, ignore_index, label_smoothing, z_loss,
               kernel_softcap(softcap))
    entry = _launch_bwd(grid, logits, target, stats, grad_loss, dx, *scalars, MEAN=reduction == "mean",
                        **_flags(label_smoothing, z_loss, softcap, logits.dtype), BLOCK=BWD_BLOCK, num_warps=BWD_WARPS)
    if entry is not None:
        runtime.keep_plan(functools.partial(_replay_grad_into, entry, grid, scalars))


def _replay_grad_into(entry, grid, scalars, dx, logits, target, stats, grad_loss, *options) -> None:
    _launch_bwd.replay(entry, grid, logits, target, stats, grad_loss, dx, *scalars)


def _fake_cross_entropy_bwd(logits, target, stats, grad_loss, ignore_index, label_smoothing, z_loss, reduction,
                            softcap=NO_SOFTCAP):
    return logits.new_empty(logits.shape)


@runtime.custom_op("cross_entropy_bwd", fake=_fake_cross_entropy_bwd)
def cross_entropy_bwd(
    logits: torch.Tensor, target: torch.Tensor, stats: torch.Tensor, grad_loss: torch.Tensor,
    ignore_index: int, label_smoothing: float, z_loss: float, reduction: str, softcap: float = NO_SOFTCAP,
) -> torch.Tensor:
    """The gradient of the loss with respect to logits (N, V), in a new contiguous tensor."""
    dx = runtime.empty(logits.shape, logits.dtype, logits.device)
    _grad_into(dx, logits, target, stats, grad_loss, ignore_index, label_smoothing, z_loss, reduction, softcap)
    return dx


def _fake_cross_entropy_bwd_inplace(logits, target, stats, grad_loss, ignore_index, label_smoothing, z_loss,
                                    reduction, softcap=NO_SOFTCAP):
    return None


@runtime.custom_op("cross_entropy_bwd_inplace", fake=_fake_cross_entropy_bwd_inplace, mutates_args=("logits",))
def cross_entropy_bwd_inplace(
    logits: torch.Tensor, target: torch.Tensor, stats: torch.Tensor, grad_loss: torch.Tensor,
    ignore_index: int, label_smoothing: float, z_loss: float, reduction: str, softcap: float = NO_SOFTCAP,
) -> None:
    """cross_entropy_bwd, written over the logits (each program reads its block before writing it)."""
    _grad_into(logits, logits, target, stats, grad_loss, ignore_index, label_smoothing, z_loss, reduction, softcap)


def _refuse_second_backward(ctx, op: str, why: str, instead: str) -> None:
    """A backward that overwrites what it saved runs once a graph: a second one (retain_graph=True)
    raises this, before autograd's own check of the saved tensors' versions speaks of in-place
    operations without saying which."""
    if getattr(ctx, "backward_done", False):
        raise RuntimeError(f"{op}: a second backward through the same graph (retain_graph=True) is not supported: "
                           f"{why}. Run the forward again, or use {instead}.")
    ctx.backward_done = True


class CrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, ignore_index, label_smoothing, z_loss, reduction, softcap, inplace_backward):
        loss, stats = cross_entropy_fwd(logits, target, ignore_index, label_smoothing, z_loss, reduction, softcap)
        # Saved detached when the backward writes into it: the gradient returned is then an alias
        # of the logits, not the logits tensor itself (a leaf would become its own .grad).
        ctx.save_for_backward(logits.detach() if inplace_backward else logits, target, stats)
        ctx.args = (ignore_index, label_smoothing, z_loss, reduction, softcap)
        ctx.inplace_backward = inplace_backward
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        if ctx.inplace_backward:
            _refuse_second_backward(ctx, "cross_entropy(inplace_backward=True)",
                                    "the first backward wrote the gradient over the saved logits",
                                    "inplace_backward=False")
        logits, target, stats = ctx.saved_tensors
        if ctx.inplace_backward:
            cross_entropy_bwd_inplace(logits, target, stats, grad_loss, *ctx.args)
            dlogits = logits
        else:
            dlogits = cross_entropy_bwd(logits, target, stats, grad_loss, *ctx.args)
        return dlogits, None, None, None, None, None, None, None


def _check_loss_args(ignore_index, reduction, label_smoothing, z_loss) -> None:
    if not isinstance(ignore_index, int) or isinstance(ignore_index, bool):
        raise TypeError(f"ignore_index must be an int, got {ignore_index!r}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {', '.join(REDUCTIONS)}, got {reduction!r}")
    if not isinstance(label_smoothing, (int, float)) or not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be a float in [0, 1], got {label_smoothing!r}")
    if not isinstance(z_loss, (int, float)) or not 0.0 <= z_loss < float("inf"):
        raise ValueError(f"z_loss must be a finite float >= 0, got {z_loss!r}")


def _check_target(target, expected_shape: tuple, what: str, classes: int, ignore_index: int) -> None:
    runtime.check_tensor("target", target, TARGET_DTYPES)
    if tuple(target.shape) != tuple(expected_shape):
        raise ValueError(f"target must have shape {tuple(expected_shape)} ({what}), got {tuple(target.shape)}")
    # On the CPU a look at the values is cheap; on a GPU it would wait for the GPU: there the
    # kernels assert instead (see _ce_fwd_kernel).
    if runtime.INTERPRET and not torch.compiler.is_compiling():
        bad = (target != ignore_index) & ((target < 0) | (target >= classes))
        if bad.any():
            raise ValueError(f"target holds {target[bad][0].item()}, neither ignore_index ({ignore_index}) nor a "
                             f"class in [0, {classes})")


def cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    inplace_backward: bool = False,
    softcap: float | None = None,
) -> torch.Tensor:
    """Cross entropy of logits (..., V) against class indices target (...), int64 or int32.

    Same as torch.nn.functional.cross_entropy with the classes on the last dimension (not on
    dimension 1, as torch takes for more than two dimensions), plus `z_loss * logsumexp(row)**2`
    per row that is not ignored, reduced like the loss. Computed in float32; the loss and the
    gradient have the logits' dtype. Logits whose last dimension is strided are copied first.
    softcap=c takes the loss of c tanh(logits / c) (Gemma 2's final-logit softcapping), the
    capped logits never stored.

    inplace_backward=True writes the gradient over the logits instead of allocating one (saves
    their size in memory). Their values are gone after backward; only ask for it when nothing
    else reads the logits afterwards (another loss, a metric, another autograd node that saved
    them), and backward runs once. The returned gradient aliases the logits' storage.

    A target that is neither ignore_index nor in [0, V) raises: a ValueError on the CPU, a
    device-side assert on a GPU (as torch's loss does there).
    """
    runtime.check_tensor("logits", logits, runtime.FLOAT_DTYPES, min_dim=1)
    V = logits.shape[-1]
    if V == 0:
        raise ValueError("logits must have at least one class (last dimension 0)")
    _check_loss_args(ignore_index, reduction, label_smoothing, z_loss)
    runtime.check_same_device(logits=logits, target=target)
    _check_target(target, logits.shape[:-1], "logits.shape[:-1]", V, ignore_index)
    if not isinstance(inplace_backward, bool):
        raise TypeError(f"inplace_backward must be a bool, got {inplace_backward!r}")
    x, t = runtime.rows_view(logits, V), target.reshape(-1)
    args = (int(ignore_index), float(label_smoothing), float(z_loss), reduction, check_softcap(softcap))
    if logits.requires_grad and torch.is_grad_enabled():
        loss = runtime.apply(CrossEntropyFunction, x, t, *args, inplace_backward)
    else:
        loss = cross_entropy_fwd(x, t, *args)[0]
    return loss.view(target.shape) if reduction == "none" else loss


def cross_entropy_reference(logits, target, ignore_index=-100, reduction="mean", label_smoothing=0.0, z_loss=0.0,
                            inplace_backward=False, softcap=None):
    """torch.nn.functional.cross_entropy (classes last) plus the z-loss, in the logits' dtype."""
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    V = logits.shape[-1]
    x, t = logits.reshape(-1, V), target.reshape(-1).long()
    rows = F.cross_entropy(x, t, ignore_index=ignore_index, reduction="none", label_smoothing=label_smoothing)
    valid = t != ignore_index
    if z_loss:
        rows = rows + torch.where(valid, z_loss * torch.logsumexp(x, -1).square(), 0.0)
    if reduction == "none":
        return rows.view(target.shape)
    total = rows.sum()
    return total / valid.sum() if reduction == "mean" else total


def _flce_chunk_rows(T: int, V: int, itemsize: int) -> int:
    rows = max(1, FLCE_CHUNK_BYTES // (V * itemsize))
    if rows >= 256:
        rows -= rows % 256  # whole tiles for cuBLAS
    return min(rows, max(T, 1))


def _row_grad_scale(target, num_items, grad_rows, ignore_index, reduction) -> torch.Tensor:
    """What each row's dloss/dlogits is multiplied by: the upstream gradient of its loss (grad_rows),
    else the normaliser of the reduced loss, a 0-dim tensor computed on the device."""
    if grad_rows is not None:
        return grad_rows
    if num_items is not None:
        return 1.0 / num_items.to(torch.float32)
    if reduction == "mean":
        return 1.0 / (target != ignore_index).sum()
    return torch.ones((), device=target.device)


def _fake_flce_fwd(hidden, weight, target, bias, num_items, grad_rows, ignore_index, label_smoothing, z_loss,
                   softcap, reduction, grad_hidden, grad_weight, grad_bias):
    T = hidden.shape[0]
    loss = hidden.new_empty((T,)) if reduction == "none" else hidden.new_empty((), dtype=torch.float32)
    return (loss, hidden.new_empty(hidden.shape if grad_hidden else 0),
            weight.new_empty(weight.shape if grad_weight else 0),
            bias.new_empty(bias.shape) if grad_bias else hidden.new_empty(0))


@runtime.custom_op("fused_linear_cross_entropy_fwd", fake=_fake_flce_fwd)
def fused_linear_cross_entropy_fwd(
    hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, bias: torch.Tensor | None,
    num_items: torch.Tensor | None, grad_rows: torch.Tensor | None, ignore_index: int, label_smoothing: float,
    z_loss: float, softcap: float, reduction: str, grad_hidden: bool, grad_weight: bool, grad_bias: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, dloss/dhidden, dloss/dweight, dloss/dbias) for hidden (T, H), weight (V, H), bias (V,);
    a gradient not asked for is an empty tensor. The gradients are those of the reduced loss (sum
    divided by num_items when given), or, with grad_rows (T,), of sum(grad_rows * row losses)."""
    (T, H), V, device, dtype = hidden.shape, weight.shape[0], hidden.device, hidden.dtype
    with_grads = grad_hidden or grad_weight or grad_bias
    if reduction == "none":
        loss = row_loss = runtime.empty((T,), dtype, device)
    else:
        loss, row_loss = runtime.empty((), torch.float32, device), runtime.empty((T,), torch.float32, device)
    dh = runtime.empty((T, H), dtype, device) if grad_hidden else hidden.new_empty(0)
    dw = runtime.empty((V, H), weight.dtype, device) if grad_weight else hidden.new_empty(0)
    db32 = torch.zeros(V, dtype=torch.float32, device=device) if grad_bias else None
    scale = _row_grad_scale(target, num_items, grad_rows, ignore_index, reduction) if with_grads else None
    rows = _flce_chunk_rows(T, V, hidden.element_size())
    buffer = runtime.empty((rows, V), dtype, device)
    stats = runtime.empty((rows, 2), torch.float32, device)
    launch = {**_row_launch(V, FLCE_ROW_CHUNK), **_flags(label_smoothing, z_loss, softcap, dtype)}
    # Ahead of a first step (runtime.compile_ahead) only the kernels matter: no matmuls.
    matmuls = not runtime.compiling_ahead()
    for start in range(0, T, rows):
        end = min(start + rows, T)
        h, t, logits, chunk_loss = hidden[start:end], target[start:end], buffer[: end - start], row_loss[start:end]
        if matmuls:
            if bias is None:
                torch.mm(h, weight.t(), out=logits)
            else:
                torch.addmm(bias, h, weight.t(), out=logits)
        if not with_grads:
            _row_losses(logits, t, chunk_loss, stats, ignore_index, label_smoothing, z_loss, softcap)
            continue
        g = scale[start:end] if scale.dim() else scale
        _launch_loss_and_grad((end - start,), logits, t, chunk_loss, g, V, t.stride(0), g.stride(0) if g.dim() else 0,
                              ignore_index, label_smoothing, z_loss, kernel_softcap(softcap), **launch)
        if not matmuls:
            continue
        if grad_hidden:
            torch.mm(logits, weight, out=dh[start:end])
        if grad_weight:
            if start == 0:
                torch.mm(logits.t(), h, out=dw)
            else:
                dw.addmm_(logits.t(), h)
        if grad_bias:
            db32 += logits.sum(0, dtype=torch.float32)
    if grad_weight and T == 0:
        dw.zero_()
    if reduction != "none":
        count = runtime.empty((), torch.float32, device)
        _reduce(row_loss, target, loss, count, num_items, ignore_index, mean=reduction == "mean" and num_items is None)
    db = db32.to(bias.dtype) if grad_bias else hidden.new_empty(0)
    return loss, dh, dw, db


def _fake_scale_(x, factor):
    return None


@runtime.custom_op("scale_", fake=_fake_scale_, mutates_args=("x",))
def scale_(x: torch.Tensor, factor: torch.Tensor) -> None:
    """x *= factor (a one-element tensor), computed in float32, for contiguous x."""
    n = x.numel()
    if n:
        _launch_scale((runtime.cdiv(n, SCALE_BLOCK),), x, factor, n, BLOCK=SCALE_BLOCK, num_warps=8)


class FusedLinearCrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, target, bias, num_items, ignore_index, label_smoothing, z_loss, softcap,
                reduction):
        needs = ctx.needs_input_grad
        flags = (needs[0], needs[1], bias is not None and needs[3])
        args = (ignore_index, label_smoothing, z_loss, softcap)
        ctx.flags, ctx.args = flags, args
        ctx.recompute = reduction == "none"
        if ctx.recompute:
            loss = fused_linear_cross_entropy_fwd(hidden, weight, target, bias, None, None, *args, reduction,
                                                  False, False, False)[0]
            ctx.save_for_backward(hidden, weight, target, bias)
        else:
            loss, dh, dw, db = fused_linear_cross_entropy_fwd(hidden, weight, target, bias, num_items, None, *args,
                                                              reduction, *flags)
            ctx.save_for_backward(dh, dw, db)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        if ctx.recompute:
            hidden, weight, target, bias = ctx.saved_tensors
            _, dh, dw, db = fused_linear_cross_entropy_fwd(hidden, weight, target, bias, None, grad_loss, *ctx.args,
                                                           "none", *ctx.flags)
        else:
            _refuse_second_backward(ctx, "fused_linear_cross_entropy",
                                    "the forward made the gradients and the first backward scaled them in place",
                                    "reduction='none', which recomputes them in its backward")
            dh, dw, db = ctx.saved_tensors
            for grad, needed in zip((dh, dw, db), ctx.flags):
                if needed:
                    scale_(grad, grad_loss)
        dh, dw, db = (g if needed else None for g, needed in zip((dh, dw, db), ctx.flags))
        return dh, dw, None, db, None, None, None, None, None, None


def _num_items_tensor(num_items, reduction: str, device) -> torch.Tensor | None:
    if num_items is None:
        return None
    if reduction == "none":
        raise ValueError('num_items_in_batch applies to reduction "mean" or "sum", not "none"')
    if isinstance(num_items, torch.Tensor):
        if num_items.numel() != 1:
            raise ValueError(f"num_items_in_batch must hold one number, got shape {tuple(num_items.shape)}")
        if num_items.device == device:
            return num_items.reshape(())
        if num_items.device.type != "cpu":
            raise ValueError(f"num_items_in_batch is on {num_items.device} but hidden is on {device}")
        num_items = num_items.item()  # a host value: reading it waits on nothing
    if isinstance(num_items, bool) or not isinstance(num_items, (int, float)) or not num_items > 0:
        raise ValueError(f"num_items_in_batch must be a positive number or a one-element tensor, got {num_items!r}")
    # A fill kernel, where torch.tensor(n, device=...) would copy from the host and wait.
    return torch.full((), float(num_items), dtype=torch.float32, device=device)


def fused_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    num_items_in_batch: int | torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """cross_entropy(hidden @ weight.T + bias, target, ...) without the (tokens, V) logits
    (softcap as cross_entropy takes it).

    hidden (..., H), weight (V, H) and bias (V,) share a float dtype; target (...) holds class
    indices (int64 or int32). Logits and their gradient are formed in that dtype by cuBLAS, a
    chunk of tokens at a time (at most FLCE_CHUNK_BYTES of logits). The weight's gradient adds up
    over the chunks in its own dtype (each chunk's product accumulated in float32 by cuBLAS), the
    bias's in float32.

    The reduced loss ("mean", "sum") is float32, as HuggingFace's causal-LM loss is (a float32
    sum, not rounded to the input dtype); "none" gives per-row losses in hidden's dtype.

    num_items_in_batch (an int or a one-element tensor; HuggingFace's normaliser for gradient
    accumulation) makes the loss the sum over the rows not ignored divided by it, for reduction
    "mean" or "sum" alike.

    The gradients are made in the forward (when any input needs one) and scaled by the upstream
    gradient in the backward, which therefore runs once per forward. The logits' gradient is
    rounded to the input dtype before the upstream gradient is applied: with float16 and a large
    loss scale, entries below float16's range flush to zero where the unfused path keeps them.
    Reduction "none" recomputes the logits in the backward instead.
    """
    runtime.check_tensor("hidden", hidden, runtime.FLOAT_DTYPES, min_dim=1)
    runtime.check_tensor("weight", weight, runtime.FLOAT_DTYPES, min_dim=2)
    if weight.dim() != 2:
        raise ValueError(f"weight must be (V, H), got shape {tuple(weight.shape)}")
    V, H = weight.shape
    if hidden.shape[-1] != H:
        raise ValueError(f"hidden of shape {tuple(hidden.shape)} and weight of shape {tuple(weight.shape)}: "
                         "hidden.shape[-1] must equal weight.shape[1]")
    if V == 0:
        raise ValueError("weight must have at least one row (V = 0 classes)")
    if weight.dtype != hidden.dtype:
        raise TypeError(f"weight has dtype {weight.dtype} but hidden has {hidden.dtype}; they must match")
    if bias is not None:
        runtime.check_tensor("bias", bias, runtime.FLOAT_DTYPES)
        if bias.dtype != hidden.dtype:
            raise TypeError(f"bias has dtype {bias.dtype} but hidden has {hidden.dtype}; they must match")
        if tuple(bias.shape) != (V,):
            raise ValueError(f"bias must have shape ({V},), got {tuple(bias.shape)}")
    _check_loss_args(ignore_index, reduction, label_smoothing, z_loss)
    runtime.check_same_device(hidden=hidden, weight=weight, target=target, bias=bias)
    _check_target(target, hidden.shape[:-1], "hidden.shape[:-1]", V, ignore_index)
    num_items = _num_items_tensor(num_items_in_batch, reduction, hidden.device)
    h, t = hidden.reshape(-1, H), target.reshape(-1)
    args = (int(ignore_index), float(label_smoothing), float(z_loss), check_softcap(softcap))
    needs_grad = hidden.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    if needs_grad and torch.is_grad_enabled():
        loss = runtime.apply(FusedLinearCrossEntropyFunction, h, weight, t, bias, num_items, *args, reduction)
    else:
        loss = fused_linear_cross_entropy_fwd(h, weight, t, bias, num_items, None, *args, reduction,
                                              False, False, False)[0]
    return loss.view(target.shape) if reduction == "none" else loss


def fused_linear_cross_entropy_reference(hidden, weight, target, bias=None, ignore_index=-100, reduction="mean",
                                         label_smoothing=0.0, z_loss=0.0, num_items_in_batch=None, softcap=None):
    """cross_entropy_reference of the full logits."""
    logits = F.linear(hidden, weight, bias)
    if num_items_in_batch is None:
        return cross_entropy_reference(logits, target, ignore_index, reduction, label_smoothing, z_loss,
                                       softcap=softcap)
    return cross_entropy_reference(logits, target, ignore_index, "sum", label_smoothing, z_loss,
                                   softcap=softcap) / num_items_in_batch
