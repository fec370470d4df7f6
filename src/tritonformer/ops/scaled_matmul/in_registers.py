"""scaled_matmul's general path, for the products no other path takes (below dequantize-first's
rows): one Triton kernel whose programs dequantize their tiles of B (and of A when it is
block-scaled) in registers for a bf16 tensor-core product in float32. The weight moves 1 byte
(fp8) or half a byte (fp4) an element plus the scales; a grid of few output tiles splits K so that
every SM streams it. See docs/scaled_matmul.md."""

from __future__ import annotations

from typing import Callable

import torch
import triton
import triton.language as tl

from ... import quant, runtime
from ...quant import FORMATS, QuantizedTensor
from ..gemm import epilogue_store, split_k_total
from .common import launch_with_replay, split_k


@triton.jit
def _scaled_matmul_kernel(a_ptr, a_scale_ptr, b_ptr, b_scale_ptr, c_ptr, ws_ptr, counter_ptr, bias_ptr,
                          tensor_scale_ptr,
                          M, N, K, k_per_split, stride_am, stride_ak, stride_as, stride_bn, stride_bs,
                          stride_cm, stride_cn,
                          A_FMT: tl.constexpr, B_FMT: tl.constexpr, A_VEC: tl.constexpr, B_VEC: tl.constexpr,
                          SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr,
                          TENSOR_SCALE: tl.constexpr, UPCAST: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One (BLOCK_M, BLOCK_N) tile of C over the K range [pid_k * k_per_split, + k_per_split),
    times the scalar at tensor_scale_ptr when TENSOR_SCALE is 1. With SPLIT_K > 1 the last split
    of a tile to finish sums the float32 partials in ws (SPLIT_K, M, N) and stores the tile."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    rows_a = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rows_b = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_a64, rows_b64 = rows_a.to(tl.int64), rows_b.to(tl.int64)
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        if A_FMT == "bf16":
            cols = k0 + tl.arange(0, BLOCK_K)
            a = tl.load(a_ptr + rows_a64[:, None] * stride_am + cols[None, :] * stride_ak,
                        mask=(rows_a[:, None] < M) & (cols[None, :] < K), other=0.0)
            if UPCAST:
                a = a.to(tl.float32)
        else:
            a = quant.dequantized_tile(a_ptr, a_scale_ptr, rows_a64, M, k0, K, stride_am, stride_as,
                                  A_FMT, A_VEC, BLOCK_M, BLOCK_K)
            if not UPCAST:
                a = a.to(tl.bfloat16)
        b = quant.dequantized_tile(b_ptr, b_scale_ptr, rows_b64, N, k0, K, stride_bn, stride_bs,
                              B_FMT, B_VEC, BLOCK_N, BLOCK_K)
        if not UPCAST:
            b = b.to(tl.bfloat16)
        acc = tl.dot(a, tl.trans(b), acc)
    cols_c = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    finish = True
    if SPLIT_K > 1:
        tile = pid_m * tl.num_programs(1) + pid_n
        finish, acc = split_k_total(acc, ws_ptr, counter_ptr, tile, pid_k, rows_a, cols_c, M, N, SPLIT_K)
    if finish:
        epilogue_store(acc, rows_a, cols_c, M, N, c_ptr, c_ptr, stride_cm, stride_cn, bias_ptr, tensor_scale_ptr,
                       c_ptr, 0.0, HAS_BIAS, 0, TENSOR_SCALE, 0, False)


_launch = runtime.FastLaunch(_scaled_matmul_kernel)


def _launch_shape(M: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages): small M streams the weight with
    narrow M tiles (and split-K, see split_k); large M takes square tiles."""
    if runtime.INTERPRET:
        return 16, 32, 64, 4, 1
    # Weight-only fp4 at N = 28672 (scripts/sweep_scaled_matmul.py, H100): M <= 16 111 us against
    # 114-134 for 16 x 64 x 128 on 4 stages; M = 64 166-173 us against 207-220 on 4 stages.
    if M <= 16:
        return 16, 64, 256, 4, 3
    if M <= 64:
        return 64, 64, 128, 4, 2
    # 128 x 256 measured 207 against 184 TFLOP/s for nvfp4 x nvfp4 at 8192^3.
    return 128, 256, 64, 8, 3


def run(a, b: QuantizedTensor, c, M, N, K, bias, tensor_scale) -> Callable | None:
    """One kernel: every program dequantizes its tiles of B (and of A, bf16 or a QuantizedTensor)
    in registers; returns the launch's replay (a replay's host time, 30 us against 77 planned
    afresh on the H100 machine, is more than the GPU time of a decode-sized call)."""
    a_fmt = a.fmt if isinstance(a, QuantizedTensor) else "bf16"
    bm, bn, bk, warps, stages = _launch_shape(M)
    # A bf16 A has no blocks: its A_VEC is unused, B's stands in.
    vec_a = FORMATS[a_fmt][0] if a_fmt != "bf16" else b.block
    bk = max(bk, vec_a, b.block)
    split, k_per_split = split_k(runtime.cdiv(M, bm) * runtime.cdiv(N, bn), K, bk, c.device)
    constexprs = dict(A_FMT=a_fmt, B_FMT=b.fmt, A_VEC=vec_a, B_VEC=b.block, SPLIT_K=split, UPCAST=runtime.INTERPRET,
                      BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages)
    return launch_with_replay(_launch, ((runtime.cdiv(M, bm), runtime.cdiv(N, bn), split), split, k_per_split),
                              _arguments, (a, b, c, M, N, K, bias, tensor_scale), constexprs)


def _arguments(plan, a, b, c, M, N, K, bias, tensor_scale) -> tuple:
    grid, split, k_per_split = plan
    # A bf16 A has no scales: B's stand in for the kernel's unused pointer.
    a_data, a_scales = (a.data, a.scales) if isinstance(a, QuantizedTensor) else (a, b.scales)
    # Quantized data is stored contiguous, so stride(1) is 1 there; e4m3 bytes go in as uint8.
    a_data, b_data = (t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t for t in (a_data, b.data))
    a_scales, b_scales = (t.view(torch.uint8) for t in (a_scales, b.scales))
    ws, counters = runtime.split_k_scratch(c, split, split * M * N, grid[0] * grid[1])
    return (a_data, a_scales, b_data, b_scales, c, ws, counters, bias if bias is not None else c,
            tensor_scale if tensor_scale is not None else c, M, N, K, k_per_split, a_data.stride(0), a_data.stride(1),
            a_scales.stride(0), b_data.stride(0), b_scales.stride(0), c.stride(0), c.stride(1))
