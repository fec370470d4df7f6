"""scaled_matmul's backward for a bf16 activation, dA = dC B, with B block-scaled ((N, K) rows
quantized along K) and decoded in registers: no bf16 copy of the weight is written and read back.
A program owns a (BLOCK_M, BLOCK_K) tile of dA and a range of B's rows; few tiles (small M) split
the rows so that every SM streams B, the last split of a tile to arrive summing the partials in
split order (gemm.split_k_total). Past ACTIVATION_GRAD_MAX_M rows the dequantized copy and cuBLAS
win (docs/scaled_matmul.md)."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ... import quant, runtime
from ...quant import QuantizedTensor
from ..gemm import epilogue_store, split_k_total
from .common import split_k

# Rows of dC up to which this kernel beats dequantize + torch: 1.2-3.3x to 64 rows, 0.75x at 256
# (H100, N = K = 4096 and 8192, fp4; docs/scaled_matmul.md).
ACTIVATION_GRAD_MAX_M = 64
# From this many weight elements a program takes 128 columns of dA (fewer, longer programs): 60-64
# against 72-101 us at 8192^2, where 64 columns won at 4096^2 (24-26 against 32-34).
WIDE_TILE_MIN_WEIGHT = 2**26


@triton.jit
def _activation_grad_kernel(dc_ptr, b_ptr, b_scale_ptr, da_ptr, ws_ptr, counter_ptr, tensor_scale_ptr,
                            M, N, K, n_per_split, stride_dcm, stride_dcn, stride_bn, stride_bs, stride_dam,
                            B_FMT: tl.constexpr, B_VEC: tl.constexpr, SPLIT: tl.constexpr,
                            TENSOR_SCALE: tl.constexpr, UPCAST: tl.constexpr,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One (BLOCK_M, BLOCK_K) tile of dA over B's rows [pid_s * n_per_split, + n_per_split), a
    multiple of BLOCK_N, times the scalar at tensor_scale_ptr when TENSOR_SCALE is 1."""
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_s = tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rows64 = rows.to(tl.int64)
    k0 = pid_k * BLOCK_K
    cols = k0 + tl.arange(0, BLOCK_K)
    n_lo = pid_s * n_per_split
    n_hi = tl.minimum(n_lo + n_per_split, N)
    acc = tl.zeros((BLOCK_M, BLOCK_K), tl.float32)
    for n0 in range(n_lo, n_hi, BLOCK_N):
        ns = n0 + tl.arange(0, BLOCK_N)
        dc = tl.load(dc_ptr + rows64[:, None] * stride_dcm + ns[None, :] * stride_dcn,
                     mask=(rows[:, None] < M) & (ns[None, :] < N), other=0.0)
        w = quant.dequantized_tile(b_ptr, b_scale_ptr, ns.to(tl.int64), N, k0, K, stride_bn, stride_bs,
                                   B_FMT, B_VEC, BLOCK_N, BLOCK_K)
        if UPCAST:
            dc = dc.to(tl.float32)
        else:
            w = w.to(tl.bfloat16)
        acc = tl.dot(dc, w, acc)
    finish = True
    if SPLIT > 1:
        tile = pid_m * tl.num_programs(1) + pid_k
        finish, acc = split_k_total(acc, ws_ptr, counter_ptr, tile, pid_s, rows, cols, M, K, SPLIT)
    if finish:
        epilogue_store(acc, rows, cols, M, K, da_ptr, da_ptr, stride_dam, 1, da_ptr, tensor_scale_ptr, da_ptr, 0.0,
                       False, 0, TENSOR_SCALE, 0, False)


_launch = runtime.FastLaunch(_activation_grad_kernel)


def fits(M: int) -> bool:
    """Whether M rows of dC take this kernel."""
    return M <= ACTIVATION_GRAD_MAX_M


def _launch_shape(M: int, weight_elements: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages); BLOCK_N is the reduction's step."""
    if runtime.INTERPRET:
        return 16, 32, 64, 4, 1
    wide = weight_elements >= WIDE_TILE_MIN_WEIGHT
    if M <= 16:
        return (16, 64, 128, 4, 4) if wide else (16, 128, 64, 4, 4)
    return (64, 64, 128, 4, 3) if wide else (64, 64, 64, 4, 3)


@runtime.planned
def run(dc: torch.Tensor, b: QuantizedTensor) -> torch.Tensor:
    """dA = dC B (bf16), dC (M, N) bf16 of any strides, B's stored (N, K) rows. Planned
    (runtime.planned)."""
    M, N = dc.shape
    K = b.shape[b.axis]
    da = runtime.empty((M, K), torch.bfloat16, dc.device)
    if M == 0 or K == 0:
        return da
    if N == 0:
        return da.zero_()
    block_m, block_n, block_k, warps, stages = _launch_shape(M, N * K)
    block_k = max(block_k, b.block)
    grid_mk = (runtime.cdiv(M, block_m), runtime.cdiv(K, block_k))
    split, n_per_split = split_k(grid_mk[0] * grid_mk[1], N, block_n, dc.device)
    plan = ((*grid_mk, split), split, n_per_split)
    entry = _launch(plan[0], *_arguments(plan, dc, b, da), B_FMT=b.fmt, B_VEC=b.block, SPLIT=split,
                    TENSOR_SCALE=int(b.tensor_scale is not None), UPCAST=runtime.INTERPRET, BLOCK_M=block_m,
                    BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=stages)
    if entry is not None:
        runtime.keep_plan(functools.partial(_replay, plan, entry))
    return da


def _arguments(plan, dc, b: QuantizedTensor, da) -> tuple:
    grid, split, n_per_split = plan
    M, N = dc.shape
    K = da.shape[1]
    ws, counters = runtime.split_k_scratch(da, split, split * M * K, grid[0] * grid[1])
    data = b.data.view(torch.uint8) if b.data.dtype == torch.float8_e4m3fn else b.data
    return (dc, data, b.scales.view(torch.uint8), da, ws, counters,
            b.tensor_scale if b.tensor_scale is not None else da, M, N, K, n_per_split, dc.stride(0), dc.stride(1),
            data.stride(0), b.scales.stride(0), da.stride(0))


def _replay(plan, entry, dc, b: QuantizedTensor) -> torch.Tensor:
    da = runtime.empty((dc.shape[0], b.shape[b.axis]), torch.bfloat16, dc.device)
    _launch.replay(entry, plan[0], *_arguments(plan, dc, b, da))
    return da
