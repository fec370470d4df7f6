"""scaled_matmul's path for up to MMA_MAX_M bf16 rows times fp4 weights where the wgmma kernel does
not run (off Hopper, under the interpreter, K not a multiple of 128, unaligned weights): mma.sync
from inline PTX, C^T = B X^T, the weight's codes decoded in registers straight into the A
fragments (K permuted within each fragment, x's pairs regrouped to match), so that no decoded tile
goes through shared memory. Under the interpreter a portable emulation of the warp's product
stands in for the PTX. See docs/scaled_matmul.md."""

from __future__ import annotations

from typing import Callable

import torch
import triton
import triton.language as tl

from ... import quant, runtime
from ...quant import QuantizedTensor
from ..gemm import epilogue_store, split_k_total
from .common import launch_with_replay, split_k

# Rows of a bf16 A up to which fp4 weights take _mma_kernel.
MMA_MAX_M = 64
# (warps, 16-row tiles of B a warp, programs an SM that split-K aims at) by the 8-row tiles of x a program
# takes: at M 64, N 28672 (2, 2, 8) 164-172 us against 177-270 for 7 other shapes (H100, K 8192).
MMA_SHAPES = {1: (4, 2, 16), 2: (4, 2, 16), 4: (2, 2, 8), 8: (2, 2, 8)}


def fits(b: QuantizedTensor, M: int) -> bool:
    """Whether _mma_kernel takes M bf16 rows times b: fp4, its words aligned."""
    return b.fmt != "mxfp8" and M <= MMA_MAX_M and b.data.data_ptr() % 4 == 0


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
        epilogue_store(total, tokens, rows, M, N, c_ptr, c_ptr, stride_cm, 1, bias_ptr, tensor_scale_ptr,
                       c_ptr, 0.0, HAS_BIAS, 0, TENSOR_SCALE, 0, False)


_launch_mma = runtime.FastLaunch(_mma_kernel)


def run(x, b: QuantizedTensor, c, M, N, K, bias, tensor_scale) -> Callable | None:
    """bf16 x (M, K) times fp4 B: _mma_kernel; returns the launch's replay."""
    n_tiles = runtime.next_power_of_2(runtime.cdiv(M, 8))
    warps, m_tiles, per_sm = MMA_SHAPES[n_tiles]
    tiles = runtime.cdiv(N, 16 * warps * m_tiles)
    split, k_per_split = split_k(tiles, K, 128, c.device, per_sm)
    constexprs = dict(B_FMT=b.fmt, SPLIT_K=split, WARPS=warps, MT=m_tiles, NT=n_tiles,
                      MASK_M=M < 8 * n_tiles, MASK_N=N % (16 * warps * m_tiles) != 0, MASK_K=K % 128 != 0,
                      num_warps=warps)
    return launch_with_replay(_launch_mma, ((tiles, split), split, k_per_split // 128), _arguments,
                              (x, b, c, M, N, K, bias, tensor_scale), constexprs)


def _arguments(plan, x, b, c, M, N, K, bias, tensor_scale) -> tuple:
    grid, split, steps_per_split = plan
    x_words = quant.int32_words(x)
    b_data = b.data.view(torch.int32)
    ws, counters = runtime.split_k_scratch(c, split, split * M * N, grid[0])
    return (x_words, b_data, b.scales.view(torch.uint8), c, ws, counters, bias if bias is not None else c,
            tensor_scale if tensor_scale is not None else c, M, N, K, steps_per_split, x_words.stride(0),
            b_data.stride(0), b.scales.stride(0), c.stride(0))
