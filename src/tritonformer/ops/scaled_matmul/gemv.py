"""scaled_matmul's path for one bf16 row (decoding a token): a CUDA-core kernel, float32 products
and sums, the weight's codes read as int32 words and decoded in registers (a tensor-core tile
would be 15/16 padding), K split so that every SM streams the weight. See docs/scaled_matmul.md."""

from __future__ import annotations

from typing import Callable

import torch
import triton
import triton.language as tl

from ... import quant, runtime
from ...quant import QuantizedTensor
from ..gemm import epilogue_store, split_k_total
from .common import launch_with_replay, split_k

# Rows of a bf16 A that _gemv_kernel takes: one.
GEMV_MAX_M = 1
# (BLOCK_N, BLOCK_K, num_warps, programs an SM that split-K aims at): best of 15 at N 28672 (nvfp4 56 us against
# 59-83; H100, K 8192), within 1 us of the best at N 8192.
GEMV_SHAPE = (16, 64, 4, 4) if runtime.INTERPRET else (16, 512, 4, 8)


def fits(b: QuantizedTensor, M: int) -> bool:
    """Whether _gemv_kernel takes M bf16 rows times b (its words aligned)."""
    return M <= GEMV_MAX_M and b.data.data_ptr() % 4 == 0


@triton.jit
def _gemv_kernel(x_ptr, b_ptr, b_scale_ptr, c_ptr, ws_ptr, counter_ptr, bias_ptr, tensor_scale_ptr,
                 N, K, k_per_split, stride_bn, stride_bs,
                 B_FMT: tl.constexpr, B_VEC: tl.constexpr, SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr,
                 TENSOR_SCALE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, MASK_K: tl.constexpr):
    """One bf16 row x (K / 2 contiguous int32 words, two bf16 each) times BLOCK_N rows of B over
    one K split, on the CUDA cores, into c (1, N) contiguous; B comes as int32 words of codes
    (eight fp4 or four e4m3 each), (N, K / 8) or (N, K / 4). A tensor-core tile would pad the
    row to 16 and send every decoded tile of B through shared memory; here each thread decodes
    its words in registers, multiplies them by x in float32 a word at a time (a multiply, then
    an FMA a code), sums a scale block's words and applies the block's scale once. fp4 codes
    decode to float32 worth 2^-14 of their values (quant.e2m1_word_values); x's bf16 become
    float32 by a shift or a mask. MASK_K: K is not a multiple of BLOCK_K."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows64 = rows.to(tl.int64)
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    acc = tl.zeros((BLOCK_N, BLOCK_K // B_VEC), tl.float32)
    # Elements a word of B.
    PER_WORD: tl.constexpr = 4 if B_FMT == "mxfp8" else 8
    for k0 in range(k_lo, k_hi, BLOCK_K):
        words = k0 // PER_WORD + tl.arange(0, BLOCK_K // PER_WORD)
        # Splits start at multiples of BLOCK_K (split_k): with K one too, no word needs K's mask,
        # which costs predicates (sm_90 SASS, nvfp4: 5.36 -> 5.25 instructions an element without).
        in_k = (words < K // PER_WORD) if MASK_K else tl.full(words.shape, True, tl.int1)
        # B is read once: evict_first spares the L2's other lines, and the dirty ones their write-back
        # (H100, K 8192: nvfp4 N 8192 27.4 -> 24.8 us, mxfp8 38.2 -> 33.2).
        codes = tl.load(b_ptr + rows64[:, None] * stride_bn + words[None, :],
                        mask=(rows[:, None] < N) & in_k[None, :], other=0, eviction_policy="evict_first")
        # x's words that hold the same columns, two bf16 each.
        x_words = x_ptr + words * (PER_WORD // 2)
        x0, x1 = quant.bf16_pair_values(tl.load(x_words, mask=in_k, other=0))
        x2, x3 = quant.bf16_pair_values(tl.load(x_words + 1, mask=in_k, other=0))
        # In this order each word's sum is one multiply and then FMAs.
        if B_FMT == "mxfp8":
            w0, w1, w2, w3 = quant.e4m3_word_values(codes)
            products = w0 * x0[None, :] + w1 * x1[None, :] + w2 * x2[None, :] + w3 * x3[None, :]
        else:
            w0, w1, w2, w3, w4, w5, w6, w7 = quant.e2m1_word_values(codes)
            x4, x5 = quant.bf16_pair_values(tl.load(x_words + 2, mask=in_k, other=0))
            x6, x7 = quant.bf16_pair_values(tl.load(x_words + 3, mask=in_k, other=0))
            products = w0 * x0[None, :] + w1 * x1[None, :] + w2 * x2[None, :] + w3 * x3[None, :] \
                + w4 * x4[None, :] + w5 * x5[None, :] + w6 * x6[None, :] + w7 * x7[None, :]
        products = tl.reshape(products, (BLOCK_N, BLOCK_K // B_VEC, B_VEC // PER_WORD))
        scale = quant._block_scales(b_scale_ptr, rows64, N, k0, K, stride_bs, B_FMT, B_VEC, BLOCK_K)
        acc += tl.sum(products, axis=2) * scale
    total = tl.sum(acc, axis=1)[None, :]
    if B_FMT != "mxfp8":
        total = total * 16384.0
    row_c = tl.arange(0, 1)
    finish = True
    if SPLIT_K > 1:
        finish, total = split_k_total(total, ws_ptr, counter_ptr, pid_n, pid_k, row_c, rows, 1, N, SPLIT_K)
    if finish:
        epilogue_store(total, row_c, rows, 1, N, c_ptr, c_ptr, N, 1, bias_ptr, tensor_scale_ptr,
                       c_ptr, 0.0, HAS_BIAS, 0, TENSOR_SCALE, 0, False)


_launch_gemv = runtime.FastLaunch(_gemv_kernel)


def run(x, b: QuantizedTensor, c, M, N, K, bias, tensor_scale) -> Callable | None:
    """bf16 x (1, K) times B: _gemv_kernel; returns the launch's replay (common.launch_with_replay)."""
    bn, bk, warps, per_sm = GEMV_SHAPE
    bk = max(bk, b.block)
    tiles = runtime.cdiv(N, bn)
    split, k_per_split = split_k(tiles, K, bk, c.device, per_sm)
    constexprs = dict(B_FMT=b.fmt, B_VEC=b.block, SPLIT_K=split, BLOCK_N=bn, BLOCK_K=bk, MASK_K=K % bk != 0,
                      num_warps=warps)
    return launch_with_replay(_launch_gemv, ((tiles, split), split, k_per_split), _arguments,
                              (x, b, c, M, N, K, bias, tensor_scale), constexprs)


def _arguments(plan, x, b, c, M, N, K, bias, tensor_scale) -> tuple:
    grid, split, k_per_split = plan
    b_data = b.data.view(torch.int32)
    ws, counters = runtime.split_k_scratch(c, split, split * N, grid[0])  # one row
    return (quant.int32_words(x), b_data, b.scales.view(torch.uint8), c, ws, counters, bias if bias is not None else c,
            tensor_scale if tensor_scale is not None else c, N, K, k_per_split, b_data.stride(0), b.scales.stride(0))
