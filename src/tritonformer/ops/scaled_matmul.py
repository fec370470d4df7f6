"""Block-scaled matmul: C = A @ B with A bf16 or block-scaled, B block-scaled (tritonformer.quant).

    w = quant.quantize(linear.weight, "nvfp4")       # (N, K), quantized along K
    y = scaled_matmul(x, w)                          # x (M, K) bf16 -> x @ w.T, (M, N) bf16
    y = scaled_matmul(quant.quantize(x, "mxfp8"), w) # both operands block-scaled

B's quantized axis is the reduction axis: B of logical shape (K, N) quantized along axis 0
gives A @ B, and (N, K) quantized along axis 1 (a weight in nn.Linear's layout) gives A @ B.T;
either way it is stored as (N, K) rows. A is (M, K), quantized along K when block-scaled.

Hopper (sm_90) has no block-scaled tensor-core instruction, so the operands become bf16 (e4m3 or
e2m1 times a power of two or an e4m3 scale is exact in bf16) for the bf16 tensor cores with
float32 accumulation, and nvfp4's per-tensor scales multiply the accumulator once at the end:
the result equals dequantize-then-matmul in float32 up to the order of the float32 sums. Four
ways, by M:
- one bf16 row (M == 1, decoding a token): the CUDA cores, float32 products and sums (a tensor-
  core tile would be 15/16 padding); the weight's codes are read as int32 words and decoded in
  registers, x's bf16 pairs likewise, so a thread's loop is loads, integer ops and FMAs only.
- up to 64 bf16 rows times fp4 weights (batched decoding): mma.sync from inline PTX, the weight
  as the A operand (C^T = B X^T), its codes decoded in registers into the A fragments with K
  permuted within each fragment, so that a lane's int32 word of eight codes is four registers
  of bf16 pairs after 15 integer instructions and one (nvfp4) or two (mxfp4) bf16x2 multiplies
  a pair for the block scale. On Hopper the same decode feeds wgmma's register operand instead
  (a Gluon kernel: it does not run under the interpreter, which keeps the mma.sync kernel for
  these shapes, as do other GPUs, K not a multiple of 128 and unaligned weights); mxfp8 weights
  take that kernel too, their e4m3 codes converted by the hardware (e4m3 pairs to float16, then
  bf16) and multiplied by the scale a pair. On Hopper it also takes bf16 activations up to
  WGMMA_MAX_M rows (prefill, large decode batches) in tiles of 128 tokens a program.
- few rows otherwise (M < DEQUANTIZE_FIRST_MIN_M: both operands quantized, bf16 activations
  where the wgmma kernel does not run): one kernel whose programs dequantize their tiles in
  registers. The weights move 1 byte (fp8) or half a byte (fp4) per element plus the scales,
  which is the speed-up where a bf16 matmul is bound by reading the weight; a grid of few output
  tiles splits K so that every SM streams the weight.
- many rows (from 512; bf16 activations on Hopper from 1024): dequantize into bf16 buffers (A
  whole, B in slabs of at most 64 MiB), then tritonformer's bf16 matmul, which runs at cuBLAS's
  rate; the dequantize pass costs about 5% at 8192^3 (mxfp8 x mxfp8 678-693 TFLOP/s against
  torch bf16's 652-672 in the same runs). Decoding in registers there costs each tile of B once
  per tile of M on the CUDA cores (207-262 TFLOP/s at 8192^3), and e4m3 tensor-core products per
  32-wide scale block, the partial sums scaled in float32, measured 134 TFLOP/s (see
  docs/perf-notes.md).
On sm_100 (Blackwell), with both operands block-scaled (two MX formats, or nvfp4 twice) and
from DOT_SCALED_MIN_M rows, tl.dot_scaled issues tcgen05's block-scaled MMA: e4m3/e2m1 operands
and their scales as stored, the scales converted once a tensor to the 5D layout that is copied
into tensor memory. We have no sm_100 to time it on: scripts/blackwell_check.py compiles it for
sm_100 offline (the instruction kind, shared memory, spills; a CPU test runs it), and the GPU
tests run it on the H100, where Triton upcasts MX operands to bf16 instead. tl.dot_scaled does
not run under the interpreter; the other kernels do.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                             warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from .. import quant, runtime
from .matmul import _epilogue_store, _one_matrix_strides, _replay_key, grouped_tile, split_k_total
from .matmul import _launch as _launch_matmul
from ..quant import FORMATS, QuantizedTensor
from ..spec import Bench, BenchCase, OpSpec, TestCase


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
        _epilogue_store(acc, rows_a, cols_c, M, N, c_ptr, c_ptr, stride_cm, stride_cn, bias_ptr, tensor_scale_ptr,
                        c_ptr, 0.0, HAS_BIAS, 0, TENSOR_SCALE, 0, False)


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
        # Splits start at multiples of BLOCK_K (_split_k): with K one too, no word needs K's mask,
        # which costs predicates (sm_90 SASS, nvfp4: 5.36 -> 5.25 instructions an element without).
        in_k = (words < K // PER_WORD) if MASK_K else tl.full(words.shape, True, tl.int1)
        # B is read once: evict_first keeps it from evicting the L2's other lines (the dirty ones
        # written before this kernel would cost their write-back; H100, K 8192, bench time: nvfp4
        # N 8192 27.4 -> 24.8 us, N 28672 65.6 -> 62.9, mxfp8 N 8192 38.2 -> 33.2; the same hint on
        # the block scales was slower).
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
        _epilogue_store(total, row_c, rows, 1, N, c_ptr, c_ptr, N, 1, bias_ptr, tensor_scale_ptr,
                        c_ptr, 0.0, HAS_BIAS, 0, TENSOR_SCALE, 0, False)


# Two m16n8k16 tensor-core products of a warp (mma.sync), accumulated: A's fragments $4-$11 (the
# first four for the first product), B's $12-$15, the accumulator $16-$19 in and $0-$3 out
# (early-clobber: the second product reads A and B after the first has written $0-$3).
_MMA_TWO_STEPS_PTX = tl.constexpr("""
mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {$0,$1,$2,$3}, {$4,$5,$6,$7}, {$12,$13}, {$16,$17,$18,$19};
mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {$0,$1,$2,$3}, {$8,$9,$10,$11}, {$14,$15}, {$0,$1,$2,$3};
""")


@triton.jit
def _lane_columns(t, LANES: tl.constexpr):
    """The four columns of a (LANES, 4) tensor (each thread's registers) as four (LANES,) tensors."""
    even, odd = tl.split(tl.reshape(t, (LANES, 2, 2)))
    c0, c2 = tl.split(even)
    c1, c3 = tl.split(odd)
    return c0, c1, c2, c3


@triton.jit
def _x_pairs(x0, x1, x2, x3):
    """Four int32 words of bf16 pairs holding x[0..7] (x0 = x[0], x[1]) regrouped as the A side's
    code pairs are (quant.e2m1_word_bf16_pairs): (x[p], x[p + 4]) for p = 0..3."""
    return ((x0 & 0xFFFF) | (x2 << 16), ((x0 >> 16) & 0xFFFF) | (x2 & -65536),
            (x1 & 0xFFFF) | (x3 << 16), ((x1 >> 16) & 0xFFFF) | (x3 & -65536))


@triton.jit
def _lane_slots(p0, p1, p2, p3, LANES: tl.constexpr):
    """(LANES, 8) float32: the values of four int32 words of bf16 pairs, a lane's k slots."""
    v0, v1 = quant.bf16_pair_values(p0)
    v2, v3 = quant.bf16_pair_values(p1)
    v4, v5 = quant.bf16_pair_values(p2)
    v6, v7 = quant.bf16_pair_values(p3)
    return tl.reshape(tl.join(tl.join(tl.join(v0, v1), tl.join(v2, v3)), tl.join(tl.join(v4, v5), tl.join(v6, v7))),
                      (LANES, 8))


@triton.jit
def _warp_product(a, b, WARPS: tl.constexpr):
    """The interpreter's mma.sync: (LANES, 8) slots of A's rows (row g = lane % 32 // 4, k slot
    lane % 4 and column) and of B's columns alike; returns the (LANES, 2) products of row g with
    columns 2 (lane % 4) and + 1, as a warp's accumulator fragment holds them."""
    a3 = tl.reshape(a, (WARPS, 8, 32))
    b3 = tl.reshape(b, (WARPS, 8, 32))
    d = tl.sum(a3[:, :, None, :] * b3[:, None, :, :], axis=3)
    return tl.split(tl.reshape(d, (WARPS * 32, 2)))


@triton.jit
def _mma_two_steps(a_lo, a_hi, b, c, WARPS: tl.constexpr):
    """c + two m16n8k16 products: a_lo / a_hi the four code-pair words of rows g / g + 8, b the
    four x-pair words, c the four accumulators of the fragment (rows g, g + 8 by columns 2q, 2q + 1)."""
    if runtime.COMPILED:
        d = tl.inline_asm_elementwise(_MMA_TWO_STEPS_PTX, "=&f,=&f,=&f,=&f,r,r,r,r,r,r,r,r,r,r,r,r,f,f,f,f",
                                      [a_lo[0], a_hi[0], a_lo[1], a_hi[1], a_lo[2], a_hi[2], a_lo[3], a_hi[3],
                                       b[0], b[1], b[2], b[3], c[0], c[1], c[2], c[3]],
                                      dtype=(tl.float32, tl.float32, tl.float32, tl.float32), is_pure=True, pack=1)
    else:
        LANES: tl.constexpr = WARPS * 32
        slots_b = _lane_slots(b[0], b[1], b[2], b[3], LANES)
        d0, d1 = _warp_product(_lane_slots(a_lo[0], a_lo[1], a_lo[2], a_lo[3], LANES), slots_b, WARPS)
        d2, d3 = _warp_product(_lane_slots(a_hi[0], a_hi[1], a_hi[2], a_hi[3], LANES), slots_b, WARPS)
        d = (c[0] + d0, c[1] + d1, c[2] + d2, c[3] + d3)
    return d


@triton.jit
def _lane_scale_pairs(b_scale_ptr, rows, N, block, n_blocks, stride_bs, B_FMT: tl.constexpr, MASK: tl.constexpr):
    """Block scales (one a lane) as the multipliers of quant.e2m1_word_bf16_pairs, bf16 bits in
    both halves of an int32: an e8m0 scale as it is (decoded with the multiply by 2^126), an e4m3
    scale s as s 2^118 (one multiply: the products come out 2^-8 times the scaled values, exact)."""
    at = b_scale_ptr + rows.to(tl.int64) * stride_bs + block
    if MASK:
        raw = tl.load(at, mask=(rows < N) & (block < n_blocks), other=0).to(tl.int32)
    else:
        raw = tl.load(at).to(tl.int32)
    if B_FMT == "nvfp4":
        bits = quant.bf16_bits(raw.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32) * 2.0 ** 118)
    else:
        # e8m0: 2^(byte - 127) has bf16 exponent bits byte; byte 0 is the subnormal 2^-127, 255 NaN.
        bits = tl.where(raw == 0, 0x40, tl.where(raw == 255, 0x7FC0, raw << 7))
    return bits | (bits << 16)


@triton.constexpr_function
def _log2(n):
    return n.bit_length() - 1


@triton.constexpr_function
def _bit_reversed(i, bits):
    return int(format(i, f"0{bits}b")[::-1], 2)


@triton.jit
def _fragments_to_tile(accs, WARPS: tl.constexpr, MT: tl.constexpr, NT: tl.constexpr):
    """The accumulator fragments (tuple index ((t * NT + u) * 2 + h) * 2 + e: m-tile t, n-tile u,
    row half h, column e) as the (8 NT, 16 WARPS MT) tile of C (columns of C^T = rows of B)."""
    COUNT: tl.constexpr = MT * NT * 4
    BITS: tl.constexpr = _log2(COUNT)
    # A tree of joins puts list entry i at flat index bitreverse(i): list them bit-reversed.
    level = ()
    for i in tl.static_range(COUNT):
        level = level + (accs[_bit_reversed(i, BITS)],)
    for depth in tl.static_range(BITS):
        joined = ()
        for m in tl.static_range(COUNT >> (depth + 1)):
            joined = joined + (tl.join(level[2 * m], level[2 * m + 1]),)
        level = joined
    regs = tl.reshape(level[0], (WARPS, 8, 4, MT, NT, 2, 2))
    # (warp, g, q, t, u, h, e) -> C's (u, q, e) by C^T's (warp, t, h, g).
    return tl.reshape(tl.permute(regs, (4, 2, 6, 0, 3, 5, 1)), (NT * 8, WARPS * MT * 16))


@triton.jit
def _split_last(t, COUNT: tl.constexpr):
    """The COUNT (2 to 16) entries of t's last dimension as a tuple of tensors, in order."""
    if COUNT == 2:
        a, b = tl.split(t)
        parts = (a, b)
    else:
        even, odd = tl.split(tl.reshape(t, t.shape[:-1] + (COUNT // 2, 2)))
        lo = _split_last(even, COUNT // 2)
        hi = _split_last(odd, COUNT // 2)
        parts = ()
        for i in tl.static_range(COUNT // 2):
            parts = parts + (lo[i], hi[i])
    return parts


@triton.jit
def _x_fragments(x_ptr, k0, M, K, stride_xm, WARPS: tl.constexpr, NT: tl.constexpr, MASK: tl.constexpr):
    """x's words of one step (8 NT rows by 64 words, loaded once a program, coalesced) as each
    lane's B fragments: for n-tile u and code word j, the four x-pair words of (_x_pairs)."""
    LANES: tl.constexpr = WARPS * 32
    tokens = tl.arange(0, NT * 8)
    cols = k0 // 2 + tl.arange(0, 64)
    at = x_ptr + tokens[:, None] * stride_xm + cols[None, :]
    if MASK:
        tile = tl.load(at, mask=(tokens[:, None] < M) & (cols[None, :] < K // 2), other=0)
    else:
        tile = tl.load(at)
    # Regrouped here, where a thread holds four words in a row: once a program, not once a warp.
    x0, x1, x2, x3 = _lane_columns(tl.reshape(tile, (NT * 128, 4)), NT * 128)
    p0, p1, p2, p3 = _x_pairs(x0, x1, x2, x3)
    tile = tl.reshape(tl.join(tl.join(p0, p2), tl.join(p1, p3)), (NT * 8, 64))
    # (u, g, q, j, r) -> (g, q, r, u, j): a lane (g, q) holds word 16 q + 4 j + r of row 8 u + g.
    lanes = tl.permute(tl.reshape(tile, (NT, 8, 4, 4, 4)), (1, 2, 4, 0, 3))
    per_lane = _split_last(tl.reshape(lanes, (32, 4, NT * 4)), NT * 4)
    fragments = ()
    for i in tl.static_range(NT * 4):
        words = tl.reshape(tl.broadcast_to(per_lane[i][None, :, :], (WARPS, 32, 4)), (LANES, 4))
        fragments = fragments + (_lane_columns(words, LANES),)
    return fragments


@triton.jit
def _weight_step(b_ptr, b_scale_ptr, first_row, q, step, N, K, stride_bn, stride_bs, B_FMT: tl.constexpr,
                 MT: tl.constexpr, LANES: tl.constexpr, MASK: tl.constexpr):
    """A lane's share of B for one step of 128 of K: per m-tile t and row half h, its 4 code words
    (LANES, 4) and the scale pairs of words 0-1 and 2-3 (one block for mxfp4, two for nvfp4)."""
    k0 = step * 128
    words = (k0 // 8 + 4 * q)[:, None] + tl.arange(0, 4)[None, :]
    loaded = ()
    for t in tl.static_range(MT):
        for h in tl.static_range(2):
            rows = first_row + t * 16 + h * 8
            codes_at = b_ptr + rows.to(tl.int64)[:, None] * stride_bn + words
            if MASK:
                codes = tl.load(codes_at, mask=(rows[:, None] < N) & (words < K // 8), other=0)
            else:
                codes = tl.load(codes_at)
            if B_FMT == "nvfp4":
                first = (k0 + 32 * q) // 16
                scale_01 = _lane_scale_pairs(b_scale_ptr, rows, N, first, K // 16, stride_bs, B_FMT, MASK)
                scale_23 = _lane_scale_pairs(b_scale_ptr, rows, N, first + 1, K // 16, stride_bs, B_FMT, MASK)
            else:
                scale_01 = _lane_scale_pairs(b_scale_ptr, rows, N, (k0 + 32 * q) // 32, K // 32, stride_bs, B_FMT,
                                             MASK)
                scale_23 = scale_01
            loaded = loaded + (codes, scale_01, scale_23)
    return loaded


@triton.jit
def _mma_kernel(x_ptr, b_ptr, b_scale_ptr, c_ptr, ws_ptr, counter_ptr, bias_ptr, tensor_scale_ptr,
                M, N, K, steps_per_split, stride_xm, stride_bn, stride_bs, stride_cm,
                B_FMT: tl.constexpr, SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr,
                TENSOR_SCALE: tl.constexpr, WARPS: tl.constexpr, MT: tl.constexpr, NT: tl.constexpr,
                MASK_M: tl.constexpr, MASK_N: tl.constexpr, MASK_K: tl.constexpr):
    """A few bf16 rows x ((M, K / 2) int32 words, two bf16 each) times 16 WARPS MT rows of fp4 B
    over one K split, on the tensor cores: C^T = B X^T with B's codes decoded in registers straight
    into mma.sync's A fragments (inline PTX: Triton's own dot sends a decoded tile through shared
    memory). Each warp takes MT tiles of 16 rows of B, each lane its rows g and g + 8 (g = lane %
    32 // 4) and, per step of 128 of K, 32 consecutive codes of each: 4 int32 words at word (k0 +
    32 q) / 8 (q = lane % 4). A word's codes feed two k16 products: K is permuted within the
    fragment (the products sum over K in any order), with x's pairs regrouped to match
    (_x_pairs). x's NT tiles of 8 rows are B's fragments (_x_fragments). A split is
    steps_per_split steps (so the loads know their alignment); MASK_M, _N, _K say whether M <
    8 NT, N is not a multiple of the rows a program takes, K not of 128."""
    LANES: tl.constexpr = WARPS * 32
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    lane = tl.arange(0, LANES)
    g = lane % 32 // 4
    q = lane % 4
    first_row = pid_n * (WARPS * MT * 16) + lane // 32 * (MT * 16) + g
    step_lo = pid_k * steps_per_split
    step_hi = tl.minimum(step_lo + steps_per_split, tl.cdiv(K, 128))
    accs = ()
    for i in tl.static_range(MT * NT * 4):
        accs = accs + (tl.zeros((LANES,), tl.float32),)
    for step in range(step_lo, step_hi):
        weights = _weight_step(b_ptr, b_scale_ptr, first_row, q, step, N, K, stride_bn, stride_bs, B_FMT, MT, LANES,
                               MASK_N or MASK_K)
        k0 = step * 128
        x_pairs = _x_fragments(x_ptr, k0, M, K, stride_xm, WARPS, NT, MASK_M or MASK_K)
        new_accs = ()
        for t in tl.static_range(MT):
            words_lo = _lane_columns(weights[6 * t], LANES)
            words_hi = _lane_columns(weights[6 * t + 3], LANES)
            tile_accs = ()
            for u in tl.static_range(NT):
                tile_accs = tile_accs + ((accs[(t * NT + u) * 4], accs[(t * NT + u) * 4 + 1],
                                          accs[(t * NT + u) * 4 + 2], accs[(t * NT + u) * 4 + 3]),)
            # Each word is decoded right before its products, which keeps few decoded words live.
            for j in tl.static_range(4):
                pairs_lo = quant.e2m1_word_bf16_pairs(words_lo[j], weights[6 * t + 1 + j // 2], B_FMT != "nvfp4")
                pairs_hi = quant.e2m1_word_bf16_pairs(words_hi[j], weights[6 * t + 4 + j // 2], B_FMT != "nvfp4")
                updated = ()
                for u in tl.static_range(NT):
                    updated = updated + (_mma_two_steps(pairs_lo, pairs_hi, x_pairs[u * 4 + j], tile_accs[u], WARPS),)
                tile_accs = updated
            for u in tl.static_range(NT):
                new_accs = new_accs + tile_accs[u]
        accs = new_accs
    total = _fragments_to_tile(accs, WARPS, MT, NT)
    if B_FMT == "nvfp4":
        total = total * 256.0  # the 2^-8 of _lane_scale_pairs' e4m3 multipliers
    tokens = tl.arange(0, NT * 8)
    rows = pid_n * (WARPS * MT * 16) + tl.arange(0, WARPS * MT * 16)
    finish = True
    if SPLIT_K > 1:
        finish, total = split_k_total(total, ws_ptr, counter_ptr, pid_n, pid_k, tokens, rows, M, N, SPLIT_K)
    if finish:
        _epilogue_store(total, tokens, rows, M, N, c_ptr, c_ptr, stride_cm, 1, bias_ptr, tensor_scale_ptr,
                        c_ptr, 0.0, HAS_BIAS, 0, TENSOR_SCALE, 0, False)


# A wgmma step takes 128 of K: 16 int32 words of fp4 codes a row of B, or 32 of e4m3 codes.
WGMMA_STEP_K = 128
_E2M1_HALVES_PTX = gl.constexpr(quant._e2m1_word_times_ptx(False, halves=True))
_E2M1_HALVES_TIMES_2_126_PTX = gl.constexpr(quant._e2m1_word_times_ptx(True, halves=True))
_E4M3_HALVES_PTX = gl.constexpr(quant.E4M3_WORD_TIMES_HALVES_PTX)


@gluon.constexpr_function
def _wgmma_step_words(B_FMT):
    """int32 words of B a row a step of WGMMA_STEP_K: eight e2m1 codes a word, or four e4m3."""
    return 32 if B_FMT == "mxfp8" else 16


@gluon.constexpr_function
def _wgmma_words_per_thread(B_FMT):
    """The consecutive words of a row a thread decodes (WPT): one scale block's."""
    return FORMATS[B_FMT][0] // (4 if B_FMT == "mxfp8" else 8)


@gluon.constexpr_function
def _wgmma_words_layout(BLOCK_N, WPT, WORDS):
    """Where B's (BLOCK_N, WORDS) words of a step live: the wgmma A operand's layout (register A,
    bf16: lanes hold k 2t, 2t + 1 (t = lane % 4) and + 8 of each k16 of rows lane // 4 and + 8,
    warps 16 rows each, a warpgroup per 64 rows) read as words. A thread takes WPT consecutive
    words (one scale block) at word WPT t of each 4 WPT words of a row, so that the codes of a
    word fill whole bf16 pairs of its k16 chunks (eight e2m1 codes four pairs of two chunks, four
    e4m3 codes two pairs of one), K permuted (x is permuted to match, _wgmma_kernel)."""
    regs = [[0, 1 << i] for i in range(WPT.bit_length() - 1)] + [[8, 0]] + [[0, 4 * WPT]] * (4 * WPT < WORDS)
    return gl.DistributedLinearLayout(regs, [[0, WPT], [0, 2 * WPT], [1, 0], [2, 0], [4, 0]], _row_warps(BLOCK_N), [],
                                      [BLOCK_N, WORDS])


@gluon.constexpr_function
def _wgmma_scales_layout(BLOCK_N, BLOCKS):
    """The step's (BLOCK_N, BLOCKS) block scales where _wgmma_words_layout has their words (one
    register a block: joined WPT times, they are the words' multipliers)."""
    regs = [[8, 0]] + [[0, b] for b in (4, 8) if b < BLOCKS]
    return gl.DistributedLinearLayout(regs, [[0, 1], [0, 2], [1, 0], [2, 0], [4, 0]], _row_warps(BLOCK_N), [],
                                      [BLOCK_N, BLOCKS])


@gluon.constexpr_function
def _row_warps(BLOCK_N):
    """Warp bases of BLOCK_N rows: a warp 16 rows, a warpgroup 64, one warpgroup per 64 rows."""
    return [[16 << i, 0] for i in range(BLOCK_N.bit_length() - 5)]


@gluon.jit
def _wgmma_kernel(x, b_desc, b_scale_ptr, c_ptr, ws_ptr, counter_ptr, bias_ptr, tensor_scale_ptr,
                  M, N, K, steps_per_split, stride_xm, stride_bs, stride_bstep, stride_cm,
                  B_FMT: gl.constexpr, SPLIT_K: gl.constexpr, HAS_BIAS: gl.constexpr, TENSOR_SCALE: gl.constexpr,
                  BLOCK_N: gl.constexpr, TOKENS: gl.constexpr, STAGES: gl.constexpr, X_BY_TMA: gl.constexpr):
    """TOKENS bf16 rows of x times BLOCK_N rows of block-scaled B over one K split, Hopper only
    (Gluon: it does not run under the interpreter, where _mma_kernel does the same product):
    C^T = B X^T on wgmma with B's decoded codes as the register A operand and x from shared memory,
    a warpgroup per 64 rows of B (they share x's tile). The grid's first axis takes x's tiles of
    TOKENS rows, so that the programs of one tile of B run together and B comes from DRAM once. B's
    words come by TMA, STAGES steps ahead; a thread reads its words (_wgmma_words_layout), decodes
    them with the block scale's multiply (fp4: the PTX of _mma_kernel's decode, element by element;
    e4m3: the hardware's conversions) and joins the elements into the operand's layout without
    moving data between threads (_wgmma_decoded_step). x's K must be permuted as the decode leaves
    B's (_wgmma_x_columns). X_BY_TMA: x is a TMA descriptor of a copy of x so permuted, and its
    tiles come with B's words. Otherwise x is a pointer to x (K contiguous): its tiles are loaded a
    step ahead into registers and permuted on their way into shared memory (a relabelling of the
    registers: the stores put each element in place). The scales are loaded a step ahead into
    registers, from the step-major copy that quant.QuantizedTensor.scales_by_step makes (a row's
    scales of a step stride_bs bytes after the last row's, a step's stride_bstep after the last
    step's): a warp's bytes of a step are consecutive, whole sectors."""
    WORDS: gl.constexpr = _wgmma_step_words(B_FMT)
    WPT: gl.constexpr = _wgmma_words_per_thread(B_FMT)
    BLOCKS: gl.constexpr = WORDS // WPT
    pid_m = gl.program_id(0)
    pid_n = gl.program_id(1)
    pid_k = gl.program_id(2)
    m0 = pid_m * TOKENS
    n0 = pid_n * BLOCK_N
    step_lo = pid_k * steps_per_split
    steps = gl.minimum(steps_per_split, K // 128 - step_lo)

    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[BLOCK_N // 16, 1],
                                                  instr_shape=[16, TOKENS, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    scales_layout: gl.constexpr = _wgmma_scales_layout(BLOCK_N, BLOCKS)
    if X_BY_TMA:
        x_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, TOKENS, 128], x.layout)
    else:
        # Two buffers: a step's stores never meet the wgmma of the step before, still reading.
        x_smem = gl.allocate_shared_memory(gl.bfloat16, [2, TOKENS, 128],
                                           gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2))
    b_smem = gl.allocate_shared_memory(gl.int32, [STAGES, BLOCK_N, WORDS], b_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
    for s in gl.static_range(STAGES - 1):
        if s < steps:
            _wgmma_load_step(x, x_smem, b_desc, b_smem, ready, s, step_lo + s, m0, n0, X_BY_TMA)

    if not X_BY_TMA:
        x_layout: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [BLOCK_N // 16, 1], [1, 0])
        tokens_x = m0 + gl.arange(0, TOKENS, layout=gl.SliceLayout(1, x_layout))
        x_ptrs = (x + tokens_x.to(gl.int64)[:, None] * stride_xm
                  + (step_lo * 128 + gl.arange(0, 128, layout=gl.SliceLayout(0, x_layout)))[None, :])
        x_mask = (tokens_x < M)[:, None]
        next_x = gl.load(x_ptrs, mask=x_mask, other=0.0)
    rows_s = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, scales_layout))
    blocks = gl.arange(0, BLOCKS, layout=gl.SliceLayout(0, scales_layout))
    scale_ptrs = (b_scale_ptr + rows_s.to(gl.int64)[:, None] * stride_bs
                  + (step_lo.to(gl.int64) * stride_bstep + blocks)[None, :])
    scale_mask = (rows_s < N)[:, None] & (blocks < BLOCKS)[None, :]
    next_scales = gl.load(scale_ptrs, mask=scale_mask, other=0)
    acc = gl.zeros([BLOCK_N, TOKENS], gl.float32, mma)
    for i in range(steps):
        raw = next_scales
        scale_ptrs += stride_bstep
        next_scales = gl.load(scale_ptrs, mask=scale_mask & (i + 1 < steps), other=0)
        stage = i % STAGES
        if X_BY_TMA:
            x_buffer = x_smem.index(stage)
        else:
            x_tile = next_x
            x_ptrs += 128
            next_x = gl.load(x_ptrs, mask=x_mask & (i + 1 < steps), other=0.0)
            if B_FMT == "mxfp8":
                # Column 16 c + 8 p + 2 t + h takes x's 32 t + 4 c + 2 p + h.
                x_tile = gl.permute(gl.reshape(x_tile, [TOKENS, 4, 8, 2, 2]), (0, 2, 3, 1, 4))
            else:
                # Column 32 WPT j + 32 u + 16 p1 + 8 p0 + 2 t + h takes x's 32 WPT j + 8 WPT t + 8 u + 4 h + 2 p1 + p0.
                x_tile = gl.permute(gl.reshape(x_tile, [TOKENS, 128 // (32 * WPT), 4, WPT, 2, 2, 2]),
                                    (0, 1, 3, 5, 6, 2, 4))
            x_buffer = x_smem.index(i % 2)
            x_buffer.store(gl.reshape(x_tile, [TOKENS, 128]))
            fence_async_shared()
            gl.thread_barrier()
        mbarrier.wait(ready.index(stage), (i // STAGES) & 1)
        a = _wgmma_decoded_step(b_smem.index(stage), raw, B_FMT, BLOCK_N, a_layout)
        acc = warpgroup_mma(a, x_buffer.permute((1, 0)), acc, is_async=True)
        # Waiting here keeps a's registers (read by the asynchronous wgmma) alive until it is done.
        acc, a = warpgroup_mma_wait(num_outstanding=0, deps=(acc, a))
        ahead = i + STAGES - 1
        if ahead < steps:
            if X_BY_TMA:
                # Every warp is past its reads of the stage the load refills (step i - 1's); x's
                # barrier of this step did that otherwise.
                gl.thread_barrier()
            _wgmma_load_step(x, x_smem, b_desc, b_smem, ready, ahead % STAGES, step_lo + ahead, m0, n0, X_BY_TMA)
    for s in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(s))

    if B_FMT == "nvfp4":
        acc = acc * 256.0  # the 2^-8 of the e4m3 multipliers
    rows = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, mma))
    tokens = m0 + gl.arange(0, TOKENS, layout=gl.SliceLayout(0, mma))
    mask = (rows < N)[:, None] & (tokens < M)[None, :]
    # The partials have split_k_total's layout (SPLIT_K, M, N).
    offsets = tokens.to(gl.int64)[None, :] * N + rows[:, None]
    finish = True
    if SPLIT_K > 1:
        gl.store(ws_ptr + pid_k.to(gl.int64) * M * N + offsets, acc, mask=mask)
        gl.thread_barrier()
        tile = pid_n * gl.num_programs(0) + pid_m
        arrived = gl.atomic_add(counter_ptr + tile, 1, sem="acq_rel", scope="gpu")
        finish = arrived == SPLIT_K - 1
        if finish:
            acc = gl.zeros([BLOCK_N, TOKENS], gl.float32, mma)
            for split in gl.static_range(SPLIT_K):
                acc += gl.load(ws_ptr + split * M * N + offsets, mask=mask, other=0.0, cache_modifier=".cg")
            gl.store(counter_ptr + tile, 0)
    if finish:
        if TENSOR_SCALE:
            acc = acc * gl.load(tensor_scale_ptr)
        if HAS_BIAS:
            acc = acc + gl.load(bias_ptr + rows, mask=rows < N, other=0.0).to(gl.float32)[:, None]
        gl.store(c_ptr + tokens.to(gl.int64)[None, :] * stride_cm + rows[:, None], acc.to(c_ptr.dtype.element_ty),
                 mask=mask)


@gluon.jit
def _wgmma_decoded_step(words_smem, raw_scales, B_FMT: gl.constexpr, BLOCK_N: gl.constexpr, a_layout: gl.constexpr):
    """A step's (BLOCK_N, 128) bf16 register operand of B: its words from shared memory
    (_wgmma_words_layout), decoded with the block scales' multiply (raw_scales: the step's
    (BLOCK_N, BLOCKS) scale bytes in _wgmma_scales_layout) and joined into a_layout."""
    WORDS: gl.constexpr = _wgmma_step_words(B_FMT)
    WPT: gl.constexpr = _wgmma_words_per_thread(B_FMT)
    words_layout: gl.constexpr = _wgmma_words_layout(BLOCK_N, WPT, WORDS)
    raw = raw_scales.to(gl.int32)
    # Multipliers as _lane_scale_pairs makes them: e4m3 s as s 2^118, e8m0 as it is.
    if B_FMT == "nvfp4":
        bits = raw.to(gl.uint8).to(gl.float8e4nv, bitcast=True).to(gl.float32) * 2.0 ** 118
        bits = (bits.to(gl.int32, bitcast=True) >> 16) & 0xFFFF
    else:
        bits = gl.where(raw == 0, 0x40, gl.where(raw == 255, 0x7FC0, raw << 7))
    multipliers = bits | (bits << 16)
    multipliers = gl.join(multipliers, multipliers)
    if WPT >= 4:
        multipliers = gl.join(multipliers, multipliers)
    if WPT == 8:
        multipliers = gl.join(multipliers, multipliers)
    multipliers = gl.convert_layout(gl.reshape(multipliers, [BLOCK_N, WORDS]), words_layout)
    words = words_smem.load(words_layout)
    if B_FMT == "mxfp8":
        e = gl.inline_asm_elementwise(_E4M3_HALVES_PTX, "=h,=h,=h,=h,r,r", [words, multipliers],
                                      dtype=(gl.bfloat16,) * 4, is_pure=True, pack=1)
        # Element 2 p + h of word (t, c) goes to k 16 c + 8 p + 2 t + h (an outer join's index is last).
        joined = gl.join(gl.join(e[0], e[2]), gl.join(e[1], e[3]))
        joined = gl.permute(gl.reshape(joined, [BLOCK_N, 4, 8, 2, 2]), (0, 2, 3, 1, 4))
    else:
        asm: gl.constexpr = _E2M1_HALVES_PTX if B_FMT == "nvfp4" else _E2M1_HALVES_TIMES_2_126_PTX
        e = gl.inline_asm_elementwise(asm, "=h,=h,=h,=h,=h,=h,=h,=h,r,r", [words, multipliers],
                                      dtype=(gl.bfloat16,) * 8, is_pure=True, pack=1)
        # Element 4 h + 2 p1 + p0 of word (j, t, u) goes to k 32 WPT j + 32 u + 16 p1 + 8 p0 + 2 t + h.
        joined = gl.join(gl.join(gl.join(e[0], e[4]), gl.join(e[1], e[5])),
                         gl.join(gl.join(e[2], e[6]), gl.join(e[3], e[7])))
        joined = gl.permute(gl.reshape(joined, [BLOCK_N, 16 // (4 * WPT), 4, WPT, 2, 2, 2]), (0, 1, 3, 6, 5, 2, 4))
    return gl.convert_layout(gl.reshape(joined, [BLOCK_N, 128]), a_layout)


@gluon.jit
def _wgmma_load_step(x, x_smem, b_desc, b_smem, ready, stage, step, m0, n0, X_BY_TMA: gl.constexpr):
    """TMA loads of a step's words of B (BLOCK_N, WORDS) into a stage, with x's tile (TOKENS, 128
    from row m0; its rows past M arrive as zeros) when X_BY_TMA."""
    if X_BY_TMA:
        mbarrier.expect(ready.index(stage), b_desc.block_type.nbytes + x.block_type.nbytes)
        tma.async_copy_global_to_shared(x, [m0, step * 128], ready.index(stage), x_smem.index(stage))
    else:
        mbarrier.expect(ready.index(stage), b_desc.block_type.nbytes)
    words: gl.constexpr = b_desc.block_shape[1]
    tma.async_copy_global_to_shared(b_desc, [n0, step * words], ready.index(stage), b_smem.index(stage))


@triton.jit
def _dot_scaled_kernel(a_ptr, a_scale_ptr, b_ptr, b_scale_ptr, c_ptr, bias_ptr, tensor_scale_ptr,
                       M, N, K, scale_cols, stride_am, stride_as, stride_bn, stride_bs, stride_cm, stride_cn,
                       A_DOT: tl.constexpr, B_DOT: tl.constexpr, VEC: tl.constexpr, HAS_BIAS: tl.constexpr,
                       TENSOR_SCALE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """One (BLOCK_M, BLOCK_N) tile of C = A @ B.T by tl.dot_scaled (tcgen05's block-scaled MMA on
    sm_100): A (M, K) and B (N, K) hold e4m3 bytes or packed e2m1 pairs (A_DOT, B_DOT), one
    scale a VEC elements of K, e8m0 bytes or (nvfp4) e4m3 by the scale pointers' type. The scales
    are in the 5D layout (quant.to_blocked) viewed as (row blocks of 128, scale_cols): a step of
    K reads whole 512-byte chunks (128 rows x 4 scales), the form that sm_100 copies into tensor
    memory for the MMA (loaded as bytes and bitcast, nvfp4's would go through registers)."""
    pid_m, pid_n = grouped_tile(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    A_PACK: tl.constexpr = 2 if A_DOT == "e2m1" else 1
    B_PACK: tl.constexpr = 2 if B_DOT == "e2m1" else 1
    CHUNKS: tl.constexpr = BLOCK_K // VEC // 4
    rows_a = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rows_b = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cols_a = tl.arange(0, BLOCK_K // A_PACK)
    cols_b = tl.arange(0, BLOCK_K // B_PACK)
    a_ptrs = a_ptr + rows_a.to(tl.int64)[:, None] * stride_am + cols_a[None, :]
    b_ptrs = b_ptr + rows_b.to(tl.int64)[:, None] * stride_bn + cols_b[None, :]
    blocks_a = pid_m * (BLOCK_M // 128) + tl.arange(0, BLOCK_M // 128)
    blocks_b = pid_n * (BLOCK_N // 128) + tl.arange(0, BLOCK_N // 128)
    chunk_bytes = tl.arange(0, CHUNKS * 512)
    a_scale_ptrs = a_scale_ptr + blocks_a[:, None] * stride_as + chunk_bytes[None, :]
    b_scale_ptrs = b_scale_ptr + blocks_b[:, None] * stride_bs + chunk_bytes[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a = tl.load(a_ptrs, mask=(rows_a[:, None] < M) & (cols_a[None, :] < (K - k0) // A_PACK), other=0)
        b = tl.load(b_ptrs, mask=(rows_b[:, None] < N) & (cols_b[None, :] < (K - k0) // B_PACK), other=0)
        chunks_left = chunk_bytes[None, :] < scale_cols - k0 // (4 * VEC) * 512
        a_scale = tl.load(a_scale_ptrs, mask=(blocks_a[:, None] < tl.cdiv(M, 128)) & chunks_left, other=0.0)
        b_scale = tl.load(b_scale_ptrs, mask=(blocks_b[:, None] < tl.cdiv(N, 128)) & chunks_left, other=0.0)
        a_scale = a_scale.reshape(BLOCK_M // 128, CHUNKS, 32, 4, 4).trans(0, 3, 2, 1, 4).reshape(BLOCK_M, BLOCK_K // VEC)
        b_scale = b_scale.reshape(BLOCK_N // 128, CHUNKS, 32, 4, 4).trans(0, 3, 2, 1, 4).reshape(BLOCK_N, BLOCK_K // VEC)
        acc = tl.dot_scaled(a, a_scale, A_DOT, b.T, b_scale, B_DOT, acc)
        a_ptrs += BLOCK_K // A_PACK
        b_ptrs += BLOCK_K // B_PACK
        a_scale_ptrs += CHUNKS * 512
        b_scale_ptrs += CHUNKS * 512
    _epilogue_store(acc, rows_a, rows_b, M, N, c_ptr, c_ptr, stride_cm, stride_cn, bias_ptr, tensor_scale_ptr, c_ptr,
                    0.0, HAS_BIAS, 0, TENSOR_SCALE, 0, False)


_launch = runtime.FastLaunch(_scaled_matmul_kernel)
_launch_dot_scaled = runtime.FastLaunch(_dot_scaled_kernel)
_launch_gemv = runtime.FastLaunch(_gemv_kernel)
_launch_mma = runtime.FastLaunch(_mma_kernel)
_launch_wgmma = runtime.FastLaunch(_wgmma_kernel)
# From this many rows of A on, dequantizing into memory first and running the bf16 matmul beats
# dequantizing in registers (each B tile is decoded once per M tile there).
DEQUANTIZE_FIRST_MIN_M = 512
# Most bf16 bytes of B dequantized at once on that path.
DEQUANTIZE_SLAB_BYTES = 64 * 2**20


def _launch_shape(M: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages): small M streams the weight with
    narrow M tiles (and split-K, see _split_k); large M takes square tiles."""
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


def _split_k(tiles: int, K: int, block_k: int, device, programs_per_sm: int = 4) -> tuple[int, int]:
    """(splits, K a split: a multiple of block_k) so that a grid of few output tiles (small M)
    still has about programs_per_sm programs an SM streaming the weight; each split keeps at
    least 1024 of K."""
    if runtime.INTERPRET:
        split = 2 if K >= 2 * block_k else 1
    else:
        want = runtime.cdiv(programs_per_sm * runtime.num_sms(device.index or 0), tiles)
        split = max(1, min(want, K // 1024, 16))
    k_per_split = runtime.cdiv(runtime.cdiv(K, split), block_k) * block_k
    return runtime.cdiv(K, k_per_split), k_per_split


def _operand(name: str, t) -> None:
    if not isinstance(t, QuantizedTensor):
        raise TypeError(f"{name} must be a tritonformer.quant.QuantizedTensor, got {type(t).__name__}")
    if len(t.shape) != 2:
        raise ValueError(f"{name} must be 2-D, got logical shape {tuple(t.shape)}")


def scaled_matmul(a, b: QuantizedTensor, out_dtype: torch.dtype = torch.bfloat16,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """A @ B (see the module doc for B's orientation); A is a bf16 tensor (M, K) or a
    QuantizedTensor (M, K) quantized along K; B a QuantizedTensor. K must be a multiple of both
    formats' blocks (it is, for anything quantize accepted). Returns (M, N) in out_dtype
    (bfloat16, float16 or float32), plus bias (N,) when given."""
    _operand("b", b)
    K = b.shape[b.axis]
    N = b.shape[1 - b.axis]
    if isinstance(a, QuantizedTensor):
        _operand("a", a)
        if a.axis != 1:
            raise ValueError(f"a must be quantized along K (axis 1), got axis {a.axis}")
        a_fmt, (M, K_a) = a.fmt, a.shape
        a_data, a_scales, a_tensor_scale = a.data, a.scales, a.tensor_scale
    else:
        runtime.check_tensor("a", a, (torch.bfloat16,), min_dim=2)
        if a.dim() != 2:
            raise ValueError(f"a must be 2-D (M, K), got shape {tuple(a.shape)}")
        a_fmt, (M, K_a) = "bf16", a.shape
        a_data, a_scales, a_tensor_scale = a, None, None
    if K_a != K:
        raise ValueError(f"a has K = {K_a} but b has K = {K} (its quantized axis)")
    if out_dtype not in runtime.FLOAT_DTYPES:
        raise TypeError(f"out_dtype must be float32, float16 or bfloat16, got {out_dtype}")
    if bias is not None:
        runtime.check_tensor("bias", bias)
        if bias.shape != (N,):
            raise ValueError(f"bias must be ({N},), got {tuple(bias.shape)}")
    runtime.check_same_device(a=a_data, b=b.data, bias=bias)
    if torch.compiler.is_compiling():
        return scaled_matmul_fwd(a_data, a_scales, a_fmt, a_tensor_scale, M, b.data, b.scales, b.fmt, list(b.shape),
                                 b.axis, b.tensor_scale, out_dtype, bias)
    # Eager: no QuantizedTensors taken apart and rebuilt (host time is most of a decode step's).
    return _product(a, b, out_dtype, bias)


def _fake_scaled_matmul_fwd(a_data, a_scales, a_fmt, a_tensor_scale, M, b_data, b_scales, b_fmt, b_shape, b_axis,
                            b_tensor_scale, out_dtype, bias):
    return b_data.new_empty((M, b_shape[1 - b_axis]), dtype=out_dtype)


@runtime.custom_op("scaled_matmul_fwd", fake=_fake_scaled_matmul_fwd)
def scaled_matmul_fwd(a_data: torch.Tensor, a_scales: torch.Tensor | None, a_fmt: str,
                      a_tensor_scale: torch.Tensor | None, M: int, b_data: torch.Tensor, b_scales: torch.Tensor,
                      b_fmt: str, b_shape: list[int], b_axis: int, b_tensor_scale: torch.Tensor | None,
                      out_dtype: torch.dtype, bias: torch.Tensor | None) -> torch.Tensor:
    """scaled_matmul on checked operands, their QuantizedTensors taken apart (a_fmt "bf16": a_data
    is A itself): what torch.compile traces, as one opaque node."""
    b = QuantizedTensor(b_data, b_scales, b_fmt, torch.Size(b_shape), b_axis, b_tensor_scale)
    a = a_data if a_fmt == "bf16" else QuantizedTensor(a_data, a_scales, a_fmt, torch.Size((M, b.shape[b_axis])), 1,
                                                       a_tensor_scale)
    return _product(a, b, out_dtype, bias)


def _product(a, b: QuantizedTensor, out_dtype: torch.dtype, bias: torch.Tensor | None) -> torch.Tensor:
    """Pick the kernel for the shapes and formats (module doc) and run it; A is bf16 or quantized."""
    M, K, N = a.shape[0], b.shape[b.axis], b.shape[1 - b.axis]
    c = runtime.empty((M, N), out_dtype, b.data.device)
    if M == 0 or N == 0:
        return c
    if K == 0:
        return c.zero_() if bias is None else c.copy_(bias.expand(M, N))
    a_fmt, a_data, a_scales = (a.fmt, a.data, a.scales) if isinstance(a, QuantizedTensor) else ("bf16", a, None)
    tensor_scale = None
    for t in (a, b):
        if isinstance(t, QuantizedTensor) and t.tensor_scale is not None:
            tensor_scale = t.tensor_scale if tensor_scale is None else tensor_scale * t.tensor_scale
    if _native_block_scaled(a_fmt, b, M):
        _dot_scaled(a, b, c, M, N, K, bias, tensor_scale)
    elif a_fmt == "bf16" and M <= GEMV_MAX_M and b.data.data_ptr() % 4 == 0:
        _one_row(a_data, b, c, N, K, bias, tensor_scale)
    elif a_fmt == "bf16" and _wgmma_fits(b, M, K):
        _wgmma_rows(a_data, b, c, M, N, K, bias, tensor_scale)
    elif M >= DEQUANTIZE_FIRST_MIN_M:
        _dequantize_first(a, b, c, M, N, K, bias, tensor_scale)
    elif a_fmt == "bf16" and b.fmt != "mxfp8" and M <= MMA_MAX_M and b.data.data_ptr() % 4 == 0:
        _mma_rows(a_data, b, c, M, N, K, bias, tensor_scale)
    else:
        # A bf16 A has no scales: B's stand in for the kernel's unused pointer.
        _in_registers(a_fmt, a_data, b.scales if a_scales is None else a_scales, b, c, M, N, K, bias, tensor_scale)
    return c


def _in_registers(a_fmt, a_data, a_scales, b: QuantizedTensor, c, M, N, K, bias, tensor_scale) -> None:
    """One kernel: every program dequantizes its tiles of B (and A) in registers. The launches
    are planned once per signature and replayed (host time per call 77 -> about 30 us on the
    H100 machine: more than the GPU time of a decode-sized call, see docs/perf-notes.md)."""
    # Quantized data is stored contiguous, so stride(1) is 1 there; e4m3 bytes go in as uint8.
    a_data, b_data = (t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t for t in (a_data, b.data))
    a_scales, b_scales = (t.view(torch.uint8) for t in (a_scales, b.scales))
    bias_arg = bias if bias is not None else c
    scale_arg = tensor_scale if tensor_scale is not None else c
    key = (M, N, K, a_fmt, b.fmt, c.dtype, c.device, bias is not None and bias.dtype, tensor_scale is not None,
           a_data.stride(), a_scales.stride(0), b_data.stride(0), b_scales.stride(0),
           *(t.data_ptr() % 16 for t in (a_data, a_scales, b_data, b_scales, bias_arg)))
    plan = _register_plans.get(key)
    if plan is None:
        plan = _plan_in_registers(a_fmt, b, M, N, K, c.device)
        _register_plans.put(key, plan)
    grid, split, k_per_split, constexprs, entries = plan
    ws, counters = runtime.split_k_scratch(c, split, split * M * N, grid[0] * grid[1])
    args = (a_data, a_scales, b_data, b_scales, c, ws, counters, bias_arg, scale_arg, M, N, K, k_per_split,
            a_data.stride(0), a_data.stride(1), a_scales.stride(0), b_data.stride(0), b_scales.stride(0),
            c.stride(0), c.stride(1))
    _launch_planned(_launch, grid, args, constexprs, entries, bias, tensor_scale)


def _launch_planned(launch: runtime.FastLaunch, grid, args, constexprs, entries: list, bias, tensor_scale) -> None:
    """Replay a plan's launch, or launch it the first time and keep its entry in the plan."""
    if entries:
        launch.replay(entries[0], grid, *args)
        return
    entries.append(launch(grid, *args, **constexprs, HAS_BIAS=bias is not None,
                          TENSOR_SCALE=int(tensor_scale is not None)))


def _plan_in_registers(a_fmt, b: QuantizedTensor, M, N, K, device) -> list:
    """[grid, split, k_per_split, constexprs, launch entries (filled by the first launch)]."""
    bm, bn, bk, warps, stages = _launch_shape(M)
    # A bf16 A has no blocks: its A_VEC is unused, B's stands in.
    vec_a = FORMATS[a_fmt][0] if a_fmt != "bf16" else b.block
    bk = max(bk, vec_a, b.block)
    split, k_per_split = _split_k(runtime.cdiv(M, bm) * runtime.cdiv(N, bn), K, bk, device)
    constexprs = dict(A_FMT=a_fmt, B_FMT=b.fmt, A_VEC=vec_a, B_VEC=b.block, SPLIT_K=split, UPCAST=runtime.INTERPRET,
                      BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages)
    return [(runtime.cdiv(M, bm), runtime.cdiv(N, bn), split), split, k_per_split, constexprs, []]


_register_plans = runtime.PlanTable()

# Rows of a bf16 A up to which _gemv_kernel runs (it takes one), and its launch shape: (BLOCK_N,
# BLOCK_K, num_warps, programs an SM that split-K aims at).
GEMV_MAX_M = 1
# scripts/sweep_scaled_matmul.py --gemv (H100, K 8192): at N 28672 nvfp4 56 us against 59-83 for
# the other 14 shapes, mxfp4 61 against 61-81; at N 8192 within 1 us of the best (18-19 us).
GEMV_SHAPE = (16, 64, 4, 4) if runtime.INTERPRET else (16, 512, 4, 8)


def _bf16_words(x: torch.Tensor) -> torch.Tensor:
    """bf16 x (M, K) as (M, K / 2) int32 words of pairs, copied first when its rows do not start
    on aligned words (the kernels load x's words)."""
    if x.stride(1) != 1 or x.data_ptr() % 4 or x.stride(0) % 2:
        # clone's default keeps a transposed x transposed; contiguous() keeps a one-row view's odd stride.
        x = x.clone(memory_format=torch.contiguous_format)
    return x.view(torch.int32)


def _one_row(x, b: QuantizedTensor, c, N, K, bias, tensor_scale) -> None:
    """bf16 x (1, K) times B: _gemv_kernel, planned once per signature and replayed."""
    x_words = _bf16_words(x)
    b_data = b.data.view(torch.int32)
    b_scales = b.scales.view(torch.uint8)
    bias_arg = bias if bias is not None else c
    scale_arg = tensor_scale if tensor_scale is not None else c
    key = (N, K, b.fmt, c.dtype, c.device, bias is not None and bias.dtype, tensor_scale is not None,
           b_data.stride(0), b_scales.stride(0),
           *(t.data_ptr() % 16 for t in (x_words, b_data, b_scales, bias_arg)))
    plan = _gemv_plans.get(key)
    if plan is None:
        bn, bk, warps, per_sm = GEMV_SHAPE
        bk = max(bk, b.block)
        tiles = runtime.cdiv(N, bn)
        split, k_per_split = _split_k(tiles, K, bk, c.device, per_sm)
        constexprs = dict(B_FMT=b.fmt, B_VEC=b.block, SPLIT_K=split, BLOCK_N=bn, BLOCK_K=bk, MASK_K=K % bk != 0,
                          num_warps=warps)
        plan = [(tiles, split), split, k_per_split, constexprs, []]
        _gemv_plans.put(key, plan)
    grid, split, k_per_split, constexprs, entries = plan
    ws, counters = runtime.split_k_scratch(c, split, split * N, grid[0])  # one row
    args = (x_words, b_data, b_scales, c, ws, counters, bias_arg, scale_arg, N, K, k_per_split,
            b_data.stride(0), b_scales.stride(0))
    _launch_planned(_launch_gemv, grid, args, constexprs, entries, bias, tensor_scale)


_gemv_plans = runtime.PlanTable()


# Rows of a bf16 A up to which fp4 weights go through _mma_kernel where _wgmma_kernel does not
# take them (off Hopper, K not a multiple of 128, unaligned weights), and its launch shapes by the
# 8-row tiles of x a program takes: (warps, 16-row tiles of B a warp, programs an SM that split-K
# aims at). scripts/sweep_scaled_matmul.py --mma, H100, K 8192, GPU time alone: at M = 64 and N
# = 28672 (2, 2, 8) 164-172 us against 177-270 for 7 other shapes, at M = 32 103 against 108-151.
MMA_MAX_M = 64
MMA_SHAPES = {1: (4, 2, 16), 2: (4, 2, 16), 4: (2, 2, 8), 8: (2, 2, 8)}


def _mma_rows(x, b: QuantizedTensor, c, M, N, K, bias, tensor_scale) -> None:
    """bf16 x (M, K) times fp4 B: _mma_kernel, planned once per signature and replayed."""
    x_words = _bf16_words(x)
    b_data = b.data.view(torch.int32)
    b_scales = b.scales.view(torch.uint8)
    bias_arg = bias if bias is not None else c
    scale_arg = tensor_scale if tensor_scale is not None else c
    key = (M, N, K, b.fmt, c.dtype, c.device, bias is not None and bias.dtype, tensor_scale is not None,
           x_words.stride(0), b_data.stride(0), b_scales.stride(0),
           *(t.data_ptr() % 16 for t in (x_words, b_data, b_scales, bias_arg)))
    plan = _mma_plans.get(key)
    if plan is None:
        n_tiles = runtime.next_power_of_2(runtime.cdiv(M, 8))
        warps, m_tiles, per_sm = MMA_SHAPES[n_tiles]
        tiles = runtime.cdiv(N, 16 * warps * m_tiles)
        split, k_per_split = _split_k(tiles, K, 128, c.device, per_sm)
        constexprs = dict(B_FMT=b.fmt, SPLIT_K=split, WARPS=warps, MT=m_tiles, NT=n_tiles,
                          MASK_M=M < 8 * n_tiles, MASK_N=N % (16 * warps * m_tiles) != 0, MASK_K=K % 128 != 0,
                          num_warps=warps)
        plan = [(tiles, split), split, k_per_split // 128, constexprs, []]
        _mma_plans.put(key, plan)
    grid, split, steps_per_split, constexprs, entries = plan
    ws, counters = runtime.split_k_scratch(c, split, split * M * N, grid[0])
    args = (x_words, b_data, b_scales, c, ws, counters, bias_arg, scale_arg, M, N, K, steps_per_split,
            x_words.stride(0), b_data.stride(0), b_scales.stride(0), c.stride(0))
    _launch_planned(_launch_mma, grid, args, constexprs, entries, bias, tensor_scale)


_mma_plans = runtime.PlanTable()

# Rows of a bf16 A for which weights go through _wgmma_kernel on Hopper, and its launch shapes
# by the tokens of x a program takes: (BLOCK_N, STAGES, programs an SM that split-K aims at; a
# warpgroup per 64 rows of BLOCK_N). scripts/sweep_scaled_matmul.py --wgmma, H100, K 8192, GPU
# time alone: (64, 3, 8) is best or within 5 us of it at M 16 and 32 (M 16 N 28672 70 us against
# _mma_kernel's 85). At 64 tokens x's tile a step is 16 KiB against B's 4: two warpgroups sharing
# it halve x's L2 traffic, and K is not split past one program an SM (a split writes and reads
# back 64 N floats): nvfp4 M 64 N 28672 111 -> 93 us on (128, 4, 1), mxfp4 110 -> 90; N 8192 50
# -> 36 on (64, 4, 1), where 128-row tiles would not fill the SMs. From 2 rows fp4 weights take it
# too: at 2-8 rows, K 8192, bench time N 28672 78-80 us on (64, 3, 8) against _mma_kernel's 88-92,
# N 8192 27-29 against 31-32. A 16-token program under WGMMA_MIN_WEIGHT weight elements aims
# split-K at 4 programs an SM, not 8 (N 8192: 640 programs, one wave at about 5 resident an SM,
# against 1024): bench 28.6-30.6 against 32.5-34.8 us, where _mma_kernel took 33-34 (42 at 12
# rows).
# Past 64 rows x comes in tiles of WGMMA_MAX_TOKENS (--wgmma-tiles, bench time, nvfp4 / mxfp8,
# against the in-register kernel below 512 rows and dequantize-first from 512): M 128 N 28672 141
# / 158 us against 387 / 343, M 256 254 / 282 against 676 / 591, M 512 481 / 540 against 682 /
# 1407; M 1024 1005 / 976 against 939 / 952, where dequantize-first takes over again. fp4 runs
# best on 64 rows of B a program, whose 240 registers and 108 KiB of shared memory leave room for
# two programs an SM: one's decode runs during the other's wgmma, where a program's two or four
# warpgroups decode together and wait together (tiles of 64 tokens times 256 rows of B, a quarter
# of x's L2 traffic, ran 1.5x slower).
WGMMA_MIN_M = 2
WGMMA_MAX_M = 1023
WGMMA_MAX_TOKENS = 128
WGMMA_SHAPES = {16: (64, 3, 8), 32: (64, 2, 8), 64: (128, 4, 1), 128: (64, 3, 1)}
WGMMA_MIN_WEIGHT = 2**27
WGMMA_SMALL_WEIGHT_SHAPE = (64, 3, 4)
# Weights past these elements (by tokens a program) and under WGMMA_MIN_WEIGHT take that shape.
# At 32 tokens, bench time at 17-32 rows: K 8192 N 8192 40-42 against 46-82 us on (64, 2, 8), N
# 14336 K 4096 39-45 against 42-54, N 4096 K 14336 37-49 against 44-49; at 4096^2 (64, 2, 8)
# keeps 25 against 28 us (nvfp4).
WGMMA_SMALL_WEIGHT_FROM = {16: 0, 32: 2**24}
# mxfp8 weights (no mma.sync kernel: the in-register one took them, H100, K 8192, GPU time: N
# 28672 93-108 against 105-166 us, N 8192 28-43 against 37-62) take one shape up to 64 tokens,
# best or within 8% of the best of 12 (64-row tiles at N 8192), and the best of 8 at 128 tokens
# from N 28672 (within 20% at N 8192).
WGMMA_E4M3_SHAPES = {**dict.fromkeys((16, 32, 64), (128, 3, 1)), 128: (128, 2, 1)}
# From this many tokens a program on, x reaches _wgmma_kernel by TMA from a permuted copy (its
# tile a step is 2-4 times B's there; GPU time at N 28672, nvfp4 / mxfp4: M 64 144 -> 111 and
# 137 -> 107 us, M 32 93 -> 79 and 89 -> 78, on (64, 2, 8)). At 16 tokens the copy's launch costs
# more than the in-program permutation (bench time 79 -> 87-91 us: the path is near host-bound).
WGMMA_TMA_X_MIN_TOKENS = 32


def _wgmma_fits(b: QuantizedTensor, M: int, K: int) -> bool:
    return (not runtime.INTERPRET and WGMMA_MIN_M <= M <= WGMMA_MAX_M and K % WGMMA_STEP_K == 0
            and b.data.data_ptr() % 16 == 0 and runtime.capability(b.data.device.index or 0) == (9, 0))


def _wgmma_shape(fmt: str, tokens: int, N: int, K: int) -> tuple[int, int, int]:
    """(BLOCK_N, STAGES, programs an SM that split-K aims at) of _wgmma_kernel."""
    if fmt == "mxfp8":
        return WGMMA_E4M3_SHAPES[tokens]
    if WGMMA_SMALL_WEIGHT_FROM.get(tokens, WGMMA_MIN_WEIGHT) < N * K < WGMMA_MIN_WEIGHT:
        return WGMMA_SMALL_WEIGHT_SHAPE
    return WGMMA_SHAPES[tokens]


def _wgmma_x_columns(K: int, fmt: str, device: torch.device) -> torch.Tensor:
    """The columns of x that _wgmma_kernel's copy of x holds, in order: K permuted in each step
    of 128 as the kernel's decode of B leaves it. fp4, with WPT a scale block's words: column 32
    WPT j + 32 u + 16 p1 + 8 p0 + 2 t + h of a step holds x's 32 WPT j + 8 WPT t + 8 u + 4 h + 2
    p1 + p0; mxfp8: column 16 c + 8 p + 2 t + h holds x's 32 t + 4 c + 2 p + h."""
    steps = torch.arange(K, device=device).view(K // WGMMA_STEP_K, WGMMA_STEP_K)
    if fmt == "mxfp8":
        return steps.view(-1, 4, 8, 2, 2).permute(0, 2, 3, 1, 4).flatten()
    wpt = _wgmma_words_per_thread(fmt)
    return steps.view(-1, WGMMA_STEP_K // (32 * wpt), 4, wpt, 2, 2, 2).permute(0, 1, 3, 5, 6, 2, 4).flatten()


def _wgmma_rows(x, b: QuantizedTensor, c, M, N, K, bias, tensor_scale) -> None:
    """bf16 x (M, K) times block-scaled B on Hopper: _wgmma_kernel, planned once per signature and
    replayed. The plan holds B's TMA descriptor and, from WGMMA_TMA_X_MIN_TOKENS, a buffer for
    the permuted copy of x with its own descriptor: a call writes x there by one index_select
    (this path's time is near its host time; torch's permuted copy cost 30-40 us more of it)."""
    tokens = min(WGMMA_MAX_TOKENS, max(16, runtime.next_power_of_2(M)))
    if x.stride(1) != 1 and tokens < WGMMA_TMA_X_MIN_TOKENS:
        x = x.contiguous()
    b_scales = b.scales_by_step(WGMMA_STEP_K).view(torch.uint8)
    bias_arg = bias if bias is not None else c
    scale_arg = tensor_scale if tensor_scale is not None else c
    key = (M, N, K, b.fmt, c.dtype, c.device, bias is not None and bias.dtype, tensor_scale is not None,
           b.data.data_ptr(), b.data.stride(0), b_scales.stride(0), x.stride(0),
           *(t.data_ptr() % 16 for t in (x, bias_arg)))
    plan = _wgmma_plans.get(key)
    if plan is None:
        block_n, stages, per_sm = _wgmma_shape(b.fmt, tokens, N, K)
        token_tiles = runtime.cdiv(M, tokens)
        while block_n > 64 and runtime.cdiv(N, block_n) * token_tiles < runtime.num_sms(c.device.index or 0):
            block_n //= 2
        tiles = runtime.cdiv(N, block_n)
        split, k_per_split = _split_k(tiles * token_tiles, K, WGMMA_STEP_K, c.device, per_sm)
        words = b.data.view(torch.int32)
        step_words = _wgmma_step_words(b.fmt)
        b_desc = TensorDescriptor(words, list(words.shape), list(words.stride()), [block_n, step_words],
                                  gl.NVMMASharedLayout.get_default_for([block_n, step_words], gl.int32))
        x_by_tma = tokens >= WGMMA_TMA_X_MIN_TOKENS
        x_columns = x_desc = None
        if x_by_tma:
            x_columns = _wgmma_x_columns(K, b.fmt, c.device)
            x_permuted = torch.empty(M, K, dtype=torch.bfloat16, device=c.device)
            x_desc = TensorDescriptor(x_permuted, [M, K], [K, 1], [tokens, WGMMA_STEP_K],
                                      gl.NVMMASharedLayout.get_default_for([tokens, WGMMA_STEP_K], gl.bfloat16))
        constexprs = dict(B_FMT=b.fmt, SPLIT_K=split, BLOCK_N=block_n, TOKENS=tokens, STAGES=stages,
                          X_BY_TMA=x_by_tma, num_warps=block_n // 16)
        plan = [(token_tiles, tiles, split), split, k_per_split // WGMMA_STEP_K, constexprs, [], b_desc, x_columns,
                x_desc]
        _wgmma_plans.put(key, plan)
    grid, split, steps_per_split, constexprs, entries, b_desc, x_columns, x_desc = plan
    if x_desc is not None:
        # detach: torch refuses out= for an input that requires grad (scaled_matmul has no backward).
        torch.index_select(x.detach(), 1, x_columns, out=x_desc.base)
    ws, counters = runtime.split_k_scratch(c, split, split * M * N, grid[0] * grid[1])
    args = (x if x_desc is None else x_desc, b_desc, b_scales, c, ws, counters, bias_arg, scale_arg, M, N, K,
            steps_per_split, x.stride(0), b_scales.stride(1), b_scales.stride(0), c.stride(0))
    _launch_planned(_launch_wgmma, grid, args, constexprs, entries, bias, tensor_scale)


_wgmma_plans = runtime.PlanTable()


# tl.dot_scaled's element formats (the scales' dtype tells nvfp4's e4m3 scales from e8m0 bytes).
DOT_SCALED_FORMATS = {"mxfp8": "e4m3", "mxfp4": "e2m1", "nvfp4": "e2m1"}
# From a full MMA tile of rows on; fewer rows take the split-K kernel that streams the weight.
DOT_SCALED_MIN_M = 128
# Triton's block-scaled tutorial's tiles for sm_100: 128 x 256 outputs, a step of K of 256 fp4
# elements (128 bytes a row) or 128 when an operand is e4m3, 4 stages.
DOT_SCALED_TILE = (128, 256, 4)


def _native_block_scaled(a_fmt: str, b: QuantizedTensor, M: int) -> bool:
    """sm_100's tensor cores take both operands block-scaled: two MX formats, or nvfp4 twice
    (one MMA has one kind of scale)."""
    return (not runtime.INTERPRET and a_fmt != "bf16" and M >= DOT_SCALED_MIN_M
            and (a_fmt == "nvfp4") == (b.fmt == "nvfp4") and runtime.capability(b.data.device.index or 0)[0] == 10)


def _dot_scaled(a: QuantizedTensor, b: QuantizedTensor, c, M, N, K, bias, tensor_scale) -> None:
    """A @ B.T by _dot_scaled_kernel, the scales converted to the 5D layout once a tensor. Hopper
    has no such instruction: Triton upcasts the MX formats to bf16 there (tests run it so) and
    cannot take nvfp4's e4m3 scales."""
    a_scales, b_scales = (t.blocked_scales() for t in (a, b))
    a_scales, b_scales = (s.view(s.shape[0], -1) for s in (a_scales, b_scales))
    a_data, b_data = (t.data.view(torch.uint8) for t in (a, b))
    block_m, block_n, stages = DOT_SCALED_TILE
    block_k = 128 if "mxfp8" in (a.fmt, b.fmt) else 256
    grid = (runtime.cdiv(M, block_m) * runtime.cdiv(N, block_n),)
    _launch_dot_scaled(grid, a_data, a_scales, b_data, b_scales, c, bias if bias is not None else c,
                       tensor_scale if tensor_scale is not None else c, M, N, K, a_scales.shape[1],
                       a_data.stride(0), a_scales.stride(0), b_data.stride(0), b_scales.stride(0), c.stride(0),
                       c.stride(1), A_DOT=DOT_SCALED_FORMATS[a.fmt], B_DOT=DOT_SCALED_FORMATS[b.fmt], VEC=b.block,
                       HAS_BIAS=bias is not None, TENSOR_SCALE=int(tensor_scale is not None), BLOCK_M=block_m,
                       BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=8, num_warps=4, num_stages=stages)


def _dequantize_first(a, b: QuantizedTensor, c, M, N, K, bias, tensor_scale) -> None:
    """Dequantize to bf16 in memory, then tritonformer's bf16 matmul: A whole (when quantized),
    B in slabs of rows (output columns) of at most DEQUANTIZE_SLAB_BYTES, each slab's product
    written into its columns of c, so the workspace stays bounded for a large weight. A slab's
    matmul replays its planned launch when the signature repeats (matmul's host time per call
    is 95 us when planned afresh, 35 us replayed)."""
    a16 = quant.dequantize_rows(a, torch.bfloat16, tensor_scale=False) if isinstance(a, QuantizedTensor) else a
    slab = max(256, DEQUANTIZE_SLAB_BYTES // (2 * K) // 256 * 256)
    for n0 in range(0, N, slab):
        n1 = min(N, n0 + slab)
        b16 = quant.dequantize_rows(b, torch.bfloat16, n0, n1, tensor_scale=False).t()
        c_slab = c[:, n0:n1]
        bias_slab = bias[n0:n1] if bias is not None else None
        key = (_replay_key(a16, b16, bias_slab, tensor_scale, None, 0, 0.0, c.dtype, False), c_slab.stride(),
               c_slab.data_ptr() % 16)
        replay = _slab_replays.get(key)
        if replay is not None:
            replay(a16, b16, c_slab, None, bias_slab, tensor_scale, None)
            continue
        replay = _launch_matmul(a16, _one_matrix_strides(a16), b16, _one_matrix_strides(b16), c_slab,
                                (M * N, *c_slab.stride()), None, 1, M, n1 - n0, K, bias_slab, tensor_scale, None, 0, 0.0)
        if replay is not None:
            _slab_replays.put(key, replay)


_slab_replays = runtime.PlanTable()


def scaled_matmul_reference(a, b: QuantizedTensor, out_dtype: torch.dtype = torch.bfloat16,
                            bias: torch.Tensor | None = None) -> torch.Tensor:
    """Dequantize, then a float32 matmul."""
    a32 = quant.dequantize_reference(a) if isinstance(a, QuantizedTensor) else a.float()
    b32 = quant.dequantize_reference(b)
    if b.axis == 1:
        b32 = b32.t()
    out = a32 @ b32
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


# ---- registry: test and bench cases ----

def _test_cases() -> list[TestCase]:
    def case(id, M, N, K, fmt_b, fmt_a=None, bias=False, gpu_only=False, out_dtype=torch.bfloat16):
        def make(device):
            b = quant.quantize(torch.randn(N, K, device=device), fmt_b, axis=1)
            x = torch.randn(M, K, device=device)
            a = quant.quantize(x, fmt_a) if fmt_a else x.to(torch.bfloat16)
            kwargs = {"out_dtype": out_dtype}
            if bias:
                kwargs["bias"] = torch.randn(N, device=device)
            return (a, b), kwargs
        return TestCase(id, make, out_dtype, grad=False, gpu_only=gpu_only, compare="norm")

    cases = [case(f"bf16-x-{fmt}-{M}x45x96", M, 45, 96, fmt) for fmt in FORMATS for M in (1, 19)]
    # K long enough to be split (the interpreter splits from 2 blocks of K on).
    cases += [case(f"bf16-x-{fmt}-split-k-bias-5x33x256", 5, 33, 256, fmt, bias=True) for fmt in FORMATS]
    cases += [case("mxfp8-x-mxfp8-bias-fp32", 33, 40, 64, "mxfp8", "mxfp8", bias=True, out_dtype=torch.float32),
              case("mxfp4-x-mxfp4", 17, 31, 64, "mxfp4", "mxfp4"),
              case("nvfp4-x-nvfp4", 17, 31, 64, "nvfp4", "nvfp4"),
              case("mxfp8-x-mxfp4-fp16", 9, 70, 128, "mxfp4", "mxfp8", out_dtype=torch.float16)]
    cases += [case(f"gpu-bf16-x-{fmt}-300x1000x4096", 300, 1000, 4096, fmt, gpu_only=True) for fmt in FORMATS]
    cases += [case("gpu-mxfp8-x-mxfp8-1000x777x2048", 1000, 777, 2048, "mxfp8", "mxfp8", gpu_only=True)]
    return cases


def _bench_cases() -> list[BenchCase]:
    dev = runtime.DEVICE
    bf16 = torch.bfloat16
    cases = []
    grid = [(1, 64, 256, True)] if runtime.INTERPRET else \
        [(M, N, K, M == 16 and N == 8192) for M in (1, 16, 64, 256) for N, K in ((8192, 8192), (28672, 8192))]
    for fmt in ("nvfp4", "mxfp4", "mxfp8"):
        for M, N, K, quick in grid:
            def setup_weight_only(M=M, N=N, K=K, fmt=fmt):
                weight = torch.randn(N, K, device=dev, dtype=bf16)
                w = quant.quantize(weight, fmt, axis=1)
                w_bf16 = w.dequantize(bf16)
                x = torch.randn(M, K, device=dev, dtype=bf16)
                return Bench({"tritonformer": lambda: scaled_matmul(x, w),
                              "torch bf16": lambda: x @ w_bf16.t(),
                              "dequantize+torch": lambda: x @ w.dequantize(bf16).t()},
                             reference=lambda: scaled_matmul_reference(x, w))
            cases.append(BenchCase("scaled_matmul", "fwd", bf16, f"bf16 x {fmt} {M}x{N}x{K}", M, setup_weight_only,
                                   flops=2 * M * N * K, plot=f"bf16 x {fmt} weights", quick=quick))
    big = 256 if runtime.INTERPRET else 8192
    for fmt_a, fmt_b in (("mxfp8", "mxfp8"), ("mxfp4", "mxfp4"), ("nvfp4", "nvfp4"), ("mxfp8", "mxfp4")):
        def setup_both(fmt_a=fmt_a, fmt_b=fmt_b, n=big):
            x = torch.randn(n, n, device=dev, dtype=bf16)
            weight = torch.randn(n, n, device=dev, dtype=bf16)
            a, b = quant.quantize(x, fmt_a), quant.quantize(weight, fmt_b, axis=1)
            providers = {"tritonformer": lambda: scaled_matmul(a, b), "torch bf16": lambda: x @ weight.t(),
                         "dequantize+torch": lambda: a.dequantize(bf16) @ b.dequantize(bf16).t()}
            if fmt_a == fmt_b == "mxfp8" and not runtime.INTERPRET:
                a8, b8 = x.to(torch.float8_e4m3fn), weight.to(torch.float8_e4m3fn)
                ones_a = torch.ones(n, 1, device=dev)
                ones_b = torch.ones(1, n, device=dev)
                providers["torch._scaled_mm fp8 row-wise"] = lambda: torch._scaled_mm(
                    a8, b8.t(), ones_a, ones_b, out_dtype=bf16)
            small = n <= 2048
            return Bench(providers, reference=(lambda: scaled_matmul_reference(a, b)) if small else None)
        cases.append(BenchCase("scaled_matmul", "fwd", bf16, f"{fmt_a} x {fmt_b} {big}^3", big, setup_both,
                               flops=2 * big**3, plot="both operands block-scaled", quick=runtime.INTERPRET))
    rows, cols = (64, 256) if runtime.INTERPRET else (16384, 8192)
    # nvfp4 also with its tensor amax given (one read of x instead of two).
    for fmt, given in [(fmt, False) for fmt in FORMATS] + [("nvfp4", True)]:
        def setup_quantize(fmt=fmt, given=given):
            x = torch.randn(rows, cols, device=dev, dtype=bf16)
            amax = x.float().abs().amax() if given else None
            return Bench({"tritonformer": lambda: quant.quantize(x, fmt, tensor_amax=amax)})
        label = f"quantize {fmt} {rows}x{cols}" + (" given amax" if given else "")
        cases.append(BenchCase("scaled_matmul", "quantize", bf16, label, rows, setup_quantize,
                               bytes=2 * rows * cols, plot="quantize (bf16 read)", quick=runtime.INTERPRET))
    return cases


SPEC = OpSpec(
    name="scaled_matmul",
    fn=scaled_matmul,
    reference=scaled_matmul_reference,
    test_cases=_test_cases,
    bench_cases=_bench_cases,
    compare="norm",
)
