"""A decode step's products: a few rows (1 to MAX_ROWS tokens) times weights that are read once.

    decode_linear(x, (w_0, w_1, ...), biases) -> (x w_0^T + b_0, x w_1^T + b_1, ...)
    decode_swiglu(x, w_gate, w_up)           -> silu(x w_gate^T) * (x w_up^T)

x (M, K), M <= MAX_ROWS, weights (N_i, K) (copied where their columns are strided), one to
MAX_WEIGHTS of them (attention's q, k and v projections), biases None or one per weight (each
None or (N_i,)). Outputs (M, N_i) in x's dtype, accumulated in float32 and rounded once
(decode_swiglu's gate and up products are not rounded before the activation). Both take
norm=(weight, eps, offset) to multiply rms_norm(x) instead of x (offset: Gemma's 1 + weight),
and with it residual= for rms_norm(x + residual), the sum returned last (add_rms_norm's). All
in the dtype of x. Inference only: no backward. The weights may also be fp4 QuantizedTensors
(nvfp4 or mxfp4 along K, all of one format) for one bf16 row (docs/generate.md, "Block-scaled
weights"); then x may be a PreparedRow, the operand as the product before prepared it
(decode_linear_into_norm: a layer's o or down projection, the residual add and the next norm's
work in its epilogue; decode_swiglu(prepared=True)), so that no program works on x.

At M = 1 a product is a weight read: its floor is the weight's bytes at copy bandwidth. cuBLAS
reaches about a third of that on a 2-8 MB weight (a layer's q, k, v and o) and one launch per
weight; here one launch covers all the weights given, programs of BLOCK_N rows of one weight
each, so that the q, k and v projections (or the gate and up projections with the activation)
are one stream of weight rows. One row (M = 1) is an elementwise product and a row sum in
registers; more rows take tl.dot over a 16-row tile. The norm folds into the same pass over x:
a row's 1/rms scales all its products, applied at the end. Design: docs/generate.md, "Skinny
products".
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import torch
import triton
import triton.language as tl

from .. import quant, runtime
from ..quant import QuantizedTensor

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_ROWS = 16
MAX_WEIGHTS = 3
# Block-scaled weights that decode_linear and decode_swiglu take (one bf16 row).
FP4_FORMATS = ("nvfp4", "mxfp4")
# tl.dot's smallest tile: more than one row pads to 16.
DOT_ROWS = 16


def _config(block_n, block_k, warps, stages):
    # LOOP_STAGES pipelines the weight loads of the one-row path too (num_stages alone pipelines
    # only loads that feed a tl.dot).
    return triton.Config({"BLOCK_N": block_n, "BLOCK_K": block_k, "LOOP_STAGES": stages}, num_warps=warps,
                         num_stages=stages)


# The candidates (BLOCK_N, BLOCK_K, warps, stages): a first generate call compiles and times each
# for every product, so only those that won or came within 5% at one or 16 rows of the e2e model
# and Llama-3-8B on the H200 (docs/generate.md, "First call"). One row streams narrow tiles: a
# long-K weight of few rows (the e2e model's down projection, 2048 x 8192) must still make several
# programs an SM; more rows take tl.dot over tiles of at least 16 rows.
ONE_ROW_TILES = ((4, 1024, 4, 3), (8, 512, 4, 3), (16, 512, 4, 3))
DOT_TILES = ((16, 256, 4, 4), (32, 256, 8, 3), (64, 128, 4, 3), (16, 512, 4, 3))
# fp4 weights (one row; BLOCK_K counts codes, eight an int32 word): one tile a product, no timing
# (a timing of kernels this short picked tiles up to 40% off the sweep's best): gate/up, K of at
# least FP4_LONG_K with a PreparedRow's x (pipelined), and the others; 8-16 words a thread an
# iteration keep enough of the weight in flight (docs/generate.md, "Block-scaled weights").
FP4_TILES = {"gated": (8, 1024, 4, 1), "long": (8, 2048, 4, 3), "other": (8, 2048, 4, 1)}
FP4_LONG_K = 8192


def _configs():
    """All lists' tiles (_prune keeps a launch's own); the interpreter takes the first."""
    if runtime.INTERPRET:
        # The interpreter's cost is per program and op: wide tiles (a generate test 59 -> 20 s).
        return [_config(64, 128, 4, 1)]
    return [_config(*tile) for tile in dict.fromkeys(ONE_ROW_TILES + DOT_TILES + tuple(FP4_TILES.values()))]


def _prune(configs, named_args, **kwargs):
    if kwargs["W_FMT"]:
        tiles = (FP4_TILES["gated" if kwargs["SWIGLU"] else
                           "long" if kwargs["X_WORDS"] and named_args["K"] >= FP4_LONG_K else "other"],)
    else:
        tiles = ONE_ROW_TILES if kwargs["ONE_ROW"] else DOT_TILES
    return [c for c in configs if (c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"], c.num_warps, c.num_stages) in tiles]


@triton.jit
def _rows_times_weights(x_ptr, stride_xm, r_ptr, stride_rm, s_ptr, stride_sm, nw_ptr, norm_offset, eps, store_sum,
                        M, K,
                        w_ptr, stride_wn, u_ptr, stride_un, offs_n, n_ok,
                        NORM: tl.constexpr, RESIDUAL: tl.constexpr, GATED: tl.constexpr, ONE_ROW: tl.constexpr,
                        EVEN_K: tl.constexpr, UPCAST: tl.constexpr, INPUT_PRECISION: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        LOOP_STAGES: tl.constexpr):
    """(x' w^T, x' u^T (GATED, else 0), a (BLOCK_M, 1) factor of both), float32, (BLOCK_M, BLOCK_N)
    for weight rows offs_n. x' is x, or with RESIDUAL x + r rounded to x's dtype (stored to s
    where store_sum), normalised with NORM. One row: x' (norm_offset + nw) in float32, its sum of
    squares on the way, and the row's 1/rms is the factor (one pass over x; docs/generate.md).
    More rows: the dot's operand is in x's dtype, so 1/rms comes first from a pass over x (from
    L2) and x' is rms_norm's rounded output (x' nw alone could overflow fp16); the factor is 1."""
    offs_k = tl.arange(0, BLOCK_K)
    offs_m = tl.arange(0, BLOCK_M)
    m_ok = offs_m[:, None] < M
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn
    u_rows = u_ptr + offs_n[:, None].to(tl.int64) * stride_un
    x_rows = x_ptr + offs_m[:, None] * stride_xm
    acc_w = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    row_w = tl.zeros((BLOCK_N,), tl.float32)
    row_u = tl.zeros((BLOCK_N,), tl.float32)
    squares = tl.zeros((BLOCK_M,), tl.float32)
    if NORM and not ONE_ROW:
        for k0 in tl.range(0, K, BLOCK_K):
            k = k0 + offs_k
            x_mask = m_ok & (k[None, :] < K)
            x = tl.load(x_rows + k[None, :], mask=x_mask, other=0.0)
            if RESIDUAL:
                r = tl.load(r_ptr + offs_m[:, None] * stride_rm + k[None, :], mask=x_mask, other=0.0)
                x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
            xf = x.to(tl.float32)
            squares += tl.sum(xf * xf, axis=1)
    inv_rms = tl.rsqrt(squares / K + eps)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=LOOP_STAGES):
        k = k0 + offs_k
        if EVEN_K:
            w_mask = n_ok[:, None]
            x_mask = m_ok
        else:
            w_mask = n_ok[:, None] & (k[None, :] < K)
            x_mask = m_ok & (k[None, :] < K)
        w = tl.load(w_rows + k[None, :], mask=w_mask, other=0.0, eviction_policy="evict_first")
        if GATED:
            u = tl.load(u_rows + k[None, :], mask=w_mask, other=0.0, eviction_policy="evict_first")
        x = tl.load(x_rows + k[None, :], mask=x_mask, other=0.0)
        if RESIDUAL:
            r = tl.load(r_ptr + offs_m[:, None] * stride_rm + k[None, :], mask=x_mask, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
            tl.store(s_ptr + offs_m[:, None] * stride_sm + k[None, :], x, mask=x_mask & store_sum)
        xf = x.to(tl.float32)
        if NORM:
            nw = tl.load(nw_ptr + k, mask=k < K, other=0.0).to(tl.float32)
            if ONE_ROW:
                squares += tl.sum(xf * xf, axis=1)
                xf = xf * (norm_offset + nw)[None, :]
            else:
                x = (xf * inv_rms[:, None] * (norm_offset + nw)[None, :]).to(x_ptr.dtype.element_ty)
        if ONE_ROW:
            row_w += tl.sum(w.to(tl.float32) * xf, axis=1)
            if GATED:
                row_u += tl.sum(u.to(tl.float32) * xf, axis=1)
        else:
            if UPCAST:
                w = w.to(tl.float32)
                x = x.to(tl.float32)
            acc_w = tl.dot(x, tl.trans(w), acc_w, input_precision=INPUT_PRECISION)
            if GATED:
                if UPCAST:
                    u = u.to(tl.float32)
                acc_u = tl.dot(x, tl.trans(u), acc_u, input_precision=INPUT_PRECISION)
    factor = squares[:, None] * 0.0 + 1.0
    if ONE_ROW:
        acc_w = row_w[None, :]
        acc_u = row_u[None, :]
        if NORM:
            factor = tl.rsqrt(squares / K + eps)[:, None]
    return acc_w, acc_u, factor


@triton.jit
def _row_pair(x_ptr, r_ptr, s_ptr, nw_ptr, norm_offset, store_sum, pairs, ok, NORM: tl.constexpr,
              RESIDUAL: tl.constexpr):
    """Columns 2p and 2p + 1 of one bf16 row given as int32 words (pairs p): x' (x + r rounded to
    bf16 with RESIDUAL, stored to s where store_sum) in float32, the sum of their squares, and with
    NORM x' (norm_offset + nw)."""
    lo, hi = quant.bf16_pair_values(tl.load(x_ptr + pairs, mask=ok, other=0))
    if RESIDUAL:
        r_lo, r_hi = quant.bf16_pair_values(tl.load(r_ptr + pairs, mask=ok, other=0))
        lo = (lo + r_lo).to(tl.bfloat16).to(tl.float32)
        hi = (hi + r_hi).to(tl.bfloat16).to(tl.float32)
        tl.store(s_ptr + pairs, quant.bf16_pair_bits(lo, hi), mask=ok & store_sum)
    squares = lo * lo + hi * hi
    if NORM:
        n_lo, n_hi = quant.bf16_pair_values(tl.load(nw_ptr + pairs, mask=ok, other=0))
        lo = lo * (norm_offset + n_lo)
        hi = hi * (norm_offset + n_hi)
    return lo, hi, squares


@triton.jit
def _fp4_tile(w_ptr, stride_wn, ws_ptr, stride_ws, rows, n_ok, k0, K, EVEN_K: tl.constexpr, W_FMT: tl.constexpr,
              W_VEC: tl.constexpr, BLOCK_K: tl.constexpr):
    """(codes, scales) of fp4 weight rows at columns k0..k0 + BLOCK_K: (rows, BLOCK_K // 8) int32
    words and (rows, BLOCK_K // W_VEC) float32 block scales, zeros past K."""
    words = k0 // 8 + tl.arange(0, BLOCK_K // 8)
    mask = n_ok[:, None] if EVEN_K else n_ok[:, None] & (words < K // 8)[None, :]
    codes = tl.load(w_ptr + rows[:, None] * stride_wn + words[None, :], mask=mask, other=0,
                    eviction_policy="evict_first")
    blocks = k0 // W_VEC + tl.arange(0, BLOCK_K // W_VEC)
    # The rows' mask alone where K is whole tiles: a mask constant along the row vectorizes the loads.
    mask = n_ok[:, None] if EVEN_K else n_ok[:, None] & (blocks < K // W_VEC)[None, :]
    raw = tl.load(ws_ptr + rows[:, None] * stride_ws + blocks[None, :], mask=mask, other=0,
                  eviction_policy="evict_first")
    return codes, quant.block_scale_values(raw, W_FMT)


@triton.jit
def _fp4_products(codes, scales, x_pairs0, x_pairs1, x_pairs2, x_pairs3, W_VEC: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr):
    """(BLOCK_N, BLOCK_K // W_VEC) scaled block sums of a _fp4_tile times x's columns, in units of
    2^-126 (quant.e2m1_word_dot; x_pairs<p>: the columns 8 words + p and + p + 4)."""
    shape: tl.constexpr = (BLOCK_N, BLOCK_K // 8)
    sums = quant.e2m1_word_dot(codes, tl.broadcast_to(x_pairs0[None, :], shape),
                               tl.broadcast_to(x_pairs1[None, :], shape), tl.broadcast_to(x_pairs2[None, :], shape),
                               tl.broadcast_to(x_pairs3[None, :], shape))
    sums = tl.reshape(sums, (BLOCK_N, BLOCK_K // W_VEC, W_VEC // 8))
    return tl.sum(sums, axis=2) * scales


@triton.jit
def _scaled_x_pairs(lo, hi):
    """int32 words of bf16 pairs (lo, hi) of float32 x' times 2^100, rounded: the operand of the
    products (see _row_times_fp4_weights)."""
    return quant.bf16_pair_bits(quant.round_to_bf16(lo * 2.0 ** 100), quant.round_to_bf16(hi * 2.0 ** 100))


@triton.jit
def _row_times_fp4_weights(x_ptr, r_ptr, s_ptr, nw_ptr, q_ptr, norm_offset, eps, store_sum, K,
                           w_ptr, stride_wn, ws_ptr, stride_ws, wt_ptr, u_ptr, stride_un, us_ptr, stride_us, ut_ptr,
                           offs_n, n_ok, NORM: tl.constexpr, RESIDUAL: tl.constexpr, GATED: tl.constexpr,
                           EVEN_K: tl.constexpr, W_FMT: tl.constexpr, W_VEC: tl.constexpr,
                           TENSOR_SCALE: tl.constexpr, X_WORDS: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_K: tl.constexpr, LOOP_STAGES: tl.constexpr):
    """_rows_times_weights for one bf16 row and fp4 weights (nvfp4 or mxfp4 codes as int32 words,
    (N, K / 8), eight codes each, with their block scales and nvfp4's tensor scale): x, r, s and nw
    come as int32 words of bf16 pairs, and a word of codes meets x's columns 8i..8i + 7 as four
    strided vectors of bf16 pairs. x' (x + r, times the norm weight; 1/rms comes at the end) is
    worked on in float32 once a thread, then rounded to bf16 times 2^100 for the products, which
    run in bf16x2 within a word (quant.e2m1_word_dot) and in float32 beyond it: x' of 2^-100 to
    2^27 keeps them in bf16's normal range (docs/generate.md, "Block-scaled weights"). With
    X_WORDS, x comes as a PreparedRow's words (x' already scaled and in pair order) and NORM's
    sum of squares from its squares (q)."""
    WORDS: tl.constexpr = BLOCK_K // 8
    rows = offs_n.to(tl.int64)
    acc_w = tl.zeros((BLOCK_N, BLOCK_K // W_VEC), tl.float32)
    acc_u = tl.zeros((BLOCK_N, BLOCK_K // W_VEC), tl.float32)
    squares = tl.zeros((WORDS,), tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=LOOP_STAGES):
        # Issued before the work on x, so that the weight is in flight during it.
        w_codes, w_scales = _fp4_tile(w_ptr, stride_wn, ws_ptr, stride_ws, rows, n_ok, k0, K, EVEN_K, W_FMT, W_VEC,
                                      BLOCK_K)
        if GATED:
            u_codes, u_scales = _fp4_tile(u_ptr, stride_un, us_ptr, stride_us, rows, n_ok, k0, K, EVEN_K, W_FMT,
                                          W_VEC, BLOCK_K)
        words = k0 // 8 + tl.arange(0, WORDS)
        ok = tl.full((WORDS,), True, tl.int1) if EVEN_K else words < K // 8
        if X_WORDS:
            p0 = tl.load(x_ptr + words * 4, mask=ok, other=0)
            p1 = tl.load(x_ptr + words * 4 + 1, mask=ok, other=0)
            p2 = tl.load(x_ptr + words * 4 + 2, mask=ok, other=0)
            p3 = tl.load(x_ptr + words * 4 + 3, mask=ok, other=0)
        else:
            p0, p1, p2, p3, sq = _row_words(x_ptr, r_ptr, s_ptr, nw_ptr, norm_offset, store_sum, words, ok, NORM,
                                            RESIDUAL)
            squares += sq
        acc_w += _fp4_products(w_codes, w_scales, p0, p1, p2, p3, W_VEC, BLOCK_N, BLOCK_K)
        if GATED:
            acc_u += _fp4_products(u_codes, u_scales, p0, p1, p2, p3, W_VEC, BLOCK_N, BLOCK_K)
    # The sums are 2^-126 of the codes' values times 2^100 of x'.
    row_w = tl.sum(acc_w, axis=1) * 2.0 ** 26
    row_u = tl.sum(acc_u, axis=1) * 2.0 ** 26
    if TENSOR_SCALE:
        row_w = row_w * tl.load(wt_ptr)
        if GATED:
            row_u = row_u * tl.load(ut_ptr)
    factor = 1.0
    if NORM:
        total = tl.sum(squares)
        if X_WORDS:
            for q0 in tl.range(0, K // 4, 4 * WORDS):
                quads = q0 + tl.arange(0, 4 * WORDS)
                total += tl.sum(tl.load(q_ptr + quads, mask=quads < K // 4, other=0.0))
        factor = tl.rsqrt(total / K + eps)
    return row_w[None, :], row_u[None, :], factor


@triton.jit
def _row_words(x_ptr, r_ptr, s_ptr, nw_ptr, norm_offset, store_sum, words, ok, NORM: tl.constexpr,
               RESIDUAL: tl.constexpr):
    """The product operand of x's columns 8 words .. 8 words + 7 (_row_pair, then _scaled_x_pairs):
    four int32 words of bf16 pairs each, columns (0, 4), (1, 5), (2, 6), (3, 7), and the sum of
    their squares."""
    x0, x1, sq01 = _row_pair(x_ptr, r_ptr, s_ptr, nw_ptr, norm_offset, store_sum, words * 4, ok, NORM, RESIDUAL)
    x2, x3, sq23 = _row_pair(x_ptr, r_ptr, s_ptr, nw_ptr, norm_offset, store_sum, words * 4 + 1, ok, NORM, RESIDUAL)
    x4, x5, sq45 = _row_pair(x_ptr, r_ptr, s_ptr, nw_ptr, norm_offset, store_sum, words * 4 + 2, ok, NORM, RESIDUAL)
    x6, x7, sq67 = _row_pair(x_ptr, r_ptr, s_ptr, nw_ptr, norm_offset, store_sum, words * 4 + 3, ok, NORM, RESIDUAL)
    return (_scaled_x_pairs(x0, x4), _scaled_x_pairs(x1, x5), _scaled_x_pairs(x2, x6), _scaled_x_pairs(x3, x7),
            sq01 + sq23 + sq45 + sq67)


@triton.jit
def _store_words(p_ptr, values, offs_n, n_ok):
    """values of columns offs_n times 2^100, rounded to bf16, at their places in a PreparedRow's
    words (bf16 p): columns 8i..8i + 7 in the order 0, 4, 1, 5, 2, 6, 3, 7."""
    places = offs_n // 8 * 8 + offs_n % 4 * 2 + offs_n % 8 // 4
    tl.store(p_ptr + places, quant.round_to_bf16(values * 2.0 ** 100).to(tl.bfloat16), mask=n_ok)


@triton.jit
def _tile_products(x_ptr, stride_xm, r_ptr, stride_rm, s_ptr, stride_sm, nw_ptr, q_ptr, norm_offset, eps, store_sum,
                   M, K, N, w_ptr, stride_wn, ws_ptr, stride_ws, wt_ptr, u_ptr, stride_un, us_ptr, stride_us, ut_ptr,
                   offs_n, n_ok, NORM: tl.constexpr, RESIDUAL: tl.constexpr, GATED: tl.constexpr,
                   ONE_ROW: tl.constexpr, EVEN_K: tl.constexpr, UPCAST: tl.constexpr, INPUT_PRECISION: tl.constexpr,
                   W_FMT: tl.constexpr, W_VEC: tl.constexpr, TENSOR_SCALE: tl.constexpr, X_WORDS: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, LOOP_STAGES: tl.constexpr):
    """(x' w^T, x' u^T, factor) for weight rows offs_n: _row_times_fp4_weights for fp4 weights
    (W_FMT), else _rows_times_weights."""
    if W_FMT != "":
        acc_w, acc_u, factor = _row_times_fp4_weights(
            x_ptr, r_ptr, s_ptr, nw_ptr, q_ptr, norm_offset, eps, store_sum, K, w_ptr, stride_wn, ws_ptr,
            stride_ws, wt_ptr, u_ptr, stride_un, us_ptr, stride_us, ut_ptr, offs_n, n_ok, NORM, RESIDUAL, GATED,
            EVEN_K, W_FMT, W_VEC, TENSOR_SCALE, X_WORDS, BLOCK_N, BLOCK_K, LOOP_STAGES)
    else:
        acc_w, acc_u, factor = _rows_times_weights(
            x_ptr, stride_xm, r_ptr, stride_rm, s_ptr, stride_sm, nw_ptr, norm_offset, eps, store_sum, M, K, w_ptr,
            stride_wn, u_ptr, stride_un, offs_n, n_ok, NORM, RESIDUAL, GATED, ONE_ROW, EVEN_K, UPCAST, INPUT_PRECISION,
            BLOCK_M, BLOCK_N, BLOCK_K, LOOP_STAGES)
    return acc_w, acc_u, factor


@triton.jit
def _linear_tile(x_ptr, stride_xm, r_ptr, stride_rm, s_ptr, stride_sm, nw_ptr, q_ptr, p_ptr, norm_offset, eps,
                 store_sum, M, K, w_ptr, stride_wn, ws_ptr, stride_ws, wt_ptr, b_ptr, y_ptr, stride_ym, N, tile,
                 HAS_BIAS: tl.constexpr, NORM: tl.constexpr, RESIDUAL: tl.constexpr, ONE_ROW: tl.constexpr,
                 EVEN_K: tl.constexpr, UPCAST: tl.constexpr, INPUT_PRECISION: tl.constexpr, W_FMT: tl.constexpr,
                 W_VEC: tl.constexpr, TENSOR_SCALE: tl.constexpr, X_WORDS: tl.constexpr, WORDS_OUT: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, LOOP_STAGES: tl.constexpr):
    """Columns [tile * BLOCK_N, + BLOCK_N) of y = x' w^T (+ b), x' as _rows_times_weights has it
    and normalised. With WORDS_OUT (one row), y is y + r rounded as two bf16 adds round it, and
    the next norm's input is prepared from it: the words of y (norm_offset + nw) to p, the sums
    of y^2 over four columns to q (a PreparedRow; NORM and RESIDUAL are off)."""
    offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    acc, _, factor = _tile_products(x_ptr, stride_xm, r_ptr, stride_rm, s_ptr, stride_sm, nw_ptr, q_ptr, norm_offset,
                                    eps, store_sum, M, K, N, w_ptr, stride_wn, ws_ptr, stride_ws, wt_ptr, w_ptr,
                                    stride_wn, ws_ptr, stride_ws, wt_ptr, offs_n, n_ok, NORM, RESIDUAL, False, ONE_ROW,
                                    EVEN_K, UPCAST, INPUT_PRECISION, W_FMT, W_VEC, TENSOR_SCALE, X_WORDS, BLOCK_M,
                                    BLOCK_N, BLOCK_K, LOOP_STAGES)
    acc = acc * factor
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    if WORDS_OUT:
        row = tl.sum(acc, axis=0).to(tl.bfloat16).to(tl.float32)
        row = (row + tl.load(r_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)).to(tl.bfloat16).to(tl.float32)
        _store_words(p_ptr, row * (norm_offset + tl.load(nw_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)),
                     offs_n, n_ok)
        quads = tile * (BLOCK_N // 4) + tl.arange(0, BLOCK_N // 4)
        tl.store(q_ptr + quads, tl.sum(tl.reshape(row * row, (BLOCK_N // 4, 4)), axis=1), mask=quads < N // 4)
        acc = row[None, :]
    offs_m = tl.arange(0, BLOCK_M)
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(offs_m[:, None] < M) & n_ok[None, :])


@runtime.autotune(configs=_configs(), prune_configs_by={"early_config_prune": _prune})
@triton.jit
def _decode_linear_kernel(
    x_ptr, r_ptr, s_ptr, nw_ptr, q_ptr, p_ptr, w0_ptr, w1_ptr, w2_ptr, ws0_ptr, ws1_ptr, ws2_ptr, wt0_ptr, wt1_ptr,
    wt2_ptr, b0_ptr, b1_ptr, b2_ptr, y0_ptr, y1_ptr, y2_ptr,
    stride_xm, stride_rm, stride_sm, stride_w0, stride_w1, stride_w2, stride_ws0, stride_ws1, stride_ws2,
    stride_y0, stride_y1, stride_y2, M, K, N0, N1, N2, eps, norm_offset,
    WEIGHTS: tl.constexpr, HAS_BIAS0: tl.constexpr, HAS_BIAS1: tl.constexpr, HAS_BIAS2: tl.constexpr,
    NORM: tl.constexpr, RESIDUAL: tl.constexpr, SWIGLU: tl.constexpr, ONE_ROW: tl.constexpr, EVEN_K: tl.constexpr,
    UPCAST: tl.constexpr, INPUT_PRECISION: tl.constexpr, W_FMT: tl.constexpr, W_VEC: tl.constexpr,
    TENSOR_SCALE: tl.constexpr, X_WORDS: tl.constexpr, WORDS_OUT: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, LOOP_STAGES: tl.constexpr,
):
    """Programs take BLOCK_N rows of one weight: weight 0's tiles first, then 1's, then 2's. With
    SWIGLU, a program takes the same rows of w0 (gate) and w1 (up) and stores silu(g) * u to y0.
    With RESIDUAL, program 0 stores x + r to s (every program reads the whole of x). With W_FMT
    (fp4 weights, one row), ws_i are the weights' block scales and wt_i nvfp4's tensor scales;
    X_WORDS: x is a PreparedRow's words, q its squares; WORDS_OUT: the output is a PreparedRow,
    SwiGLU's words to y0, or one weight's y + r to y0 with words to p and squares to q."""
    pid = tl.program_id(0)
    store_sum = pid == 0
    if SWIGLU:
        offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N0
        g, u, factor = _tile_products(x_ptr, stride_xm, r_ptr, stride_rm, s_ptr, stride_sm, nw_ptr, q_ptr,
                                      norm_offset, eps, store_sum, M, K, N0, w0_ptr, stride_w0, ws0_ptr, stride_ws0,
                                      wt0_ptr, w1_ptr, stride_w1, ws1_ptr, stride_ws1, wt1_ptr, offs_n, n_ok, NORM,
                                      RESIDUAL, True, ONE_ROW, EVEN_K, UPCAST, INPUT_PRECISION, W_FMT, W_VEC,
                                      TENSOR_SCALE, X_WORDS, BLOCK_M, BLOCK_N, BLOCK_K, LOOP_STAGES)
        g = g * factor
        h = g / (1.0 + tl.exp(-g)) * (u * factor)
        if WORDS_OUT:
            # Rounded to bf16 first, as the plain output is before the next product scales it.
            _store_words(y0_ptr, tl.sum(h, axis=0).to(tl.bfloat16).to(tl.float32), offs_n, n_ok)
        else:
            offs_m = tl.arange(0, BLOCK_M)
            tl.store(y0_ptr + offs_m[:, None] * stride_y0 + offs_n[None, :], h.to(y0_ptr.dtype.element_ty),
                     mask=(offs_m[:, None] < M) & n_ok[None, :])
    else:
        tiles0 = tl.cdiv(N0, BLOCK_N)
        tiles1 = tl.cdiv(N1, BLOCK_N)
        if pid < tiles0:
            _linear_tile(x_ptr, stride_xm, r_ptr, stride_rm, s_ptr, stride_sm, nw_ptr, q_ptr, p_ptr, norm_offset, eps,
                         store_sum, M, K, w0_ptr, stride_w0, ws0_ptr, stride_ws0, wt0_ptr, b0_ptr, y0_ptr, stride_y0,
                         N0, pid, HAS_BIAS0, NORM, RESIDUAL, ONE_ROW, EVEN_K, UPCAST, INPUT_PRECISION, W_FMT, W_VEC,
                         TENSOR_SCALE, X_WORDS, WORDS_OUT, BLOCK_M, BLOCK_N, BLOCK_K, LOOP_STAGES)
        elif WEIGHTS == 2 or pid < tiles0 + tiles1:
            _linear_tile(x_ptr, stride_xm, r_ptr, stride_rm, s_ptr, stride_sm, nw_ptr, q_ptr, p_ptr, norm_offset, eps,
                         store_sum, M, K, w1_ptr, stride_w1, ws1_ptr, stride_ws1, wt1_ptr, b1_ptr, y1_ptr, stride_y1,
                         N1, pid - tiles0, HAS_BIAS1, NORM, RESIDUAL, ONE_ROW, EVEN_K, UPCAST, INPUT_PRECISION, W_FMT,
                         W_VEC, TENSOR_SCALE, X_WORDS, WORDS_OUT, BLOCK_M, BLOCK_N, BLOCK_K, LOOP_STAGES)
        else:
            _linear_tile(x_ptr, stride_xm, r_ptr, stride_rm, s_ptr, stride_sm, nw_ptr, q_ptr, p_ptr, norm_offset, eps,
                         store_sum, M, K, w2_ptr, stride_w2, ws2_ptr, stride_ws2, wt2_ptr, b2_ptr, y2_ptr, stride_y2,
                         N2, pid - tiles0 - tiles1, HAS_BIAS2, NORM, RESIDUAL, ONE_ROW, EVEN_K, UPCAST, INPUT_PRECISION,
                         W_FMT, W_VEC, TENSOR_SCALE, X_WORDS, WORDS_OUT, BLOCK_M, BLOCK_N, BLOCK_K, LOOP_STAGES)


# Its kernels take 5-70 us: 2 + 10 ms of do_bench a candidate still gives each about 70 samples.
_launch = runtime.TunedLauncher(_decode_linear_kernel, tuning_ms=(2, 10))


def _check_fp4(x: torch.Tensor, weights: Sequence[QuantizedTensor]) -> None:
    """Block-scaled weights: all of one fp4 format, quantized along K, times one bf16 row."""
    fmts = {w.fmt if isinstance(w, QuantizedTensor) else None for w in weights}
    if len(fmts) != 1 or not fmts <= set(FP4_FORMATS):
        raise TypeError(f"weights must be all tensors or all QuantizedTensors of one of {', '.join(FP4_FORMATS)}, "
                        f"got {sorted(map(str, fmts))}")
    if x.dtype != torch.bfloat16 or x.shape[0] != 1:
        raise ValueError(f"block-scaled weights take one bf16 row, got x {x.dtype} of {x.shape[0]} rows")
    for i, w in enumerate(weights):
        if w.axis != 1:
            raise ValueError(f"weights[{i}] must be quantized along K (axis 1), got axis {w.axis}")
        parts = {"": w.data, " scales": w.scales, " tensor scale": w.tensor_scale}
        runtime.check_same_device(x=x, **{f"weights[{i}]{part}": t for part, t in parts.items() if t is not None})


def _check_prepared(x: "PreparedRow", weights: Sequence, biases, norm, residual) -> None:
    """A PreparedRow as x: fp4 weights, bf16 words (1, K) with K a multiple of 8, its own norm."""
    if norm is not None or residual is not None:
        raise ValueError("a PreparedRow carries its norm: give no norm or residual with it")
    words, squares = x.words, x.squares
    runtime.check_tensor("x.words", words, (torch.bfloat16,))
    if words.dim() != 2 or words.shape[0] != 1 or words.shape[1] % 8:
        raise ValueError(f"x.words must be (1, K) with K a multiple of 8, got shape {tuple(words.shape)}")
    if not all(isinstance(w, QuantizedTensor) for w in weights):
        raise TypeError("a PreparedRow is the operand of fp4 weights (QuantizedTensor)")
    if squares is not None:
        runtime.check_tensor("x.squares", squares, (torch.float32,))
        runtime.check_same_device(words=words, squares=squares)
        if tuple(squares.shape) != (words.shape[1] // 4,):
            raise ValueError(f"x.squares must have shape ({words.shape[1] // 4},), got {tuple(squares.shape)}")
        if not (math.isfinite(x.eps) and x.eps >= 0):
            raise ValueError(f"x.eps must be a finite number >= 0, got {x.eps!r}")
    _check(words, weights, biases, None, None)


def _check_words_out(x: torch.Tensor, weight, bias, residual, norm, linear: bool) -> None:
    """An output as a PreparedRow: fp4 weights, N a multiple of 8, and for a linear its residual
    (1, N) and the next norm."""
    if not isinstance(weight, QuantizedTensor):
        raise TypeError("a PreparedRow output needs fp4 weights (QuantizedTensor)")
    N = weight.shape[0]
    if N % 8:
        raise ValueError(f"a PreparedRow output needs N a multiple of 8, got {N}")
    named = {"bias": bias} if bias is not None else {}
    if linear:
        if residual is None or norm is None:
            raise ValueError("decode_linear_into_norm needs the residual and the next norm (weight, eps, offset)")
        _check_norm(norm)
        named.update({"residual": residual, "norm weight": norm[0]})
    for name, t in named.items():
        runtime.check_tensor(name, t, (torch.bfloat16,))
        runtime.check_same_device(x=x, **{name: t})
        shape = (1, N) if name == "residual" else (N,)
        if tuple(t.shape) != shape:
            raise ValueError(f"{name} must have shape {shape}, got {tuple(t.shape)}")
    _check_no_grad(named.values())


def _check_norm(norm) -> None:
    if not (isinstance(norm, (tuple, list)) and len(norm) == 3):
        raise ValueError("norm must be None or (weight, eps, offset)")
    if not all(isinstance(v, (int, float)) and math.isfinite(v) for v in norm[1:]) or norm[1] < 0:
        raise ValueError(f"norm's eps and offset must be finite numbers, eps >= 0, got {norm[1]!r}, {norm[2]!r}")


def _check_no_grad(tensors) -> None:
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        raise ValueError("decode_linear and decode_swiglu are inference ops (no backward): call them under "
                         "torch.no_grad() or on tensors that do not require grad")


def _check(x: torch.Tensor, weights: Sequence, biases, norm, residual) -> None:
    runtime.check_tensor("x", x, DTYPES)
    if x.dim() != 2 or not 1 <= x.shape[0] <= MAX_ROWS:
        raise ValueError(f"x must be (M, K) with 1 <= M <= {MAX_ROWS} rows, got shape {tuple(x.shape)}")
    if not 1 <= len(weights) <= MAX_WEIGHTS:
        raise ValueError(f"weights must hold 1 to {MAX_WEIGHTS} tensors, got {len(weights)}")
    if biases is not None and len(biases) != len(weights):
        raise ValueError(f"biases must be None or one per weight ({len(weights)}), got {len(biases)}")
    M, K = x.shape
    quantized = any(isinstance(w, QuantizedTensor) for w in weights)
    if quantized:
        _check_fp4(x, weights)
    named = {} if quantized else {f"weights[{i}]": w for i, w in enumerate(weights)}
    named.update({f"biases[{i}]": b for i, b in enumerate(biases or ()) if b is not None})
    if norm is not None:
        _check_norm(norm)
        named["norm weight"] = norm[0]
    if residual is not None:
        if norm is None:
            raise ValueError("residual is added before the norm: give norm with it")
        named["residual"] = residual
    for name, t in named.items():
        runtime.check_tensor(name, t, (x.dtype,))
        runtime.check_same_device(x=x, **{name: t})
    for i, w in enumerate(weights):
        if len(w.shape) != 2 or w.shape[1] != K:
            raise ValueError(f"weights[{i}] must be (N, {K}) for x of {K} columns, got shape {tuple(w.shape)}")
        b = None if biases is None else biases[i]
        if b is not None and tuple(b.shape) != (w.shape[0],):
            raise ValueError(f"biases[{i}] must have shape ({w.shape[0]},), got {tuple(b.shape)}")
    if norm is not None and tuple(norm[0].shape) != (K,):
        raise ValueError(f"the norm weight must have shape ({K},), got {tuple(norm[0].shape)}")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"residual must have x's shape {tuple(x.shape)}, got {tuple(residual.shape)}")
    _check_no_grad((x, *named.values()))


def _unit_columns(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 or t.shape[-1] <= 1 else t.contiguous()


def _fake_decode_products(x, weights, fmt, weight_scales, tensor_scales, biases, norm_weight, eps, norm_offset,
                          residual, swiglu, x_squares=None, x_words=False, words_out=False):
    if words_out and not swiglu:
        N = weights[0].shape[0]
        return [x.new_empty((1, N)), x.new_empty((1, N)), x.new_empty((N // 4,), dtype=torch.float32)]
    outs = [x.new_empty((x.shape[0], w.shape[0])) for w in (weights[:1] if swiglu else weights)]
    return outs + ([x.new_empty(x.shape)] if residual is not None else [])


@runtime.custom_op("decode_products", fake=_fake_decode_products)
def decode_products(x: torch.Tensor, weights: list[torch.Tensor], fmt: str, weight_scales: list[torch.Tensor],
                    tensor_scales: list[torch.Tensor | None], biases: list[torch.Tensor | None],
                    norm_weight: torch.Tensor | None, eps: float, norm_offset: float, residual: torch.Tensor | None,
                    swiglu: bool, x_squares: torch.Tensor | None = None, x_words: bool = False,
                    words_out: bool = False) -> list[torch.Tensor]:
    """The launcher of decode_linear and decode_swiglu (checked arguments): the outputs, and with a
    residual x + residual last. fmt "" (weight_scales and tensor_scales empty), or "nvfp4" or
    "mxfp4": the weights are fp4 codes, (N, K / 2) bytes, with their block scales (and nvfp4's
    tensor scales). fp4 weights only: x_words, x is a PreparedRow's words (and x_squares its
    squares, with norm_weight None and eps its norm's); words_out, the output is a PreparedRow:
    SwiGLU's [words] (then x + residual with a residual), or one weight's [y + residual, words
    of it times (norm_offset + norm_weight), squares] (the residual and the norm apply to the
    output)."""
    x = _unit_columns(x)
    weights = [_unit_columns(w) for w in weights]
    biases = [None if b is None else b.contiguous() for b in biases]
    M, K = x.shape
    n_weights = 1 if swiglu else len(weights)
    Ns = [w.shape[0] for w in weights]
    # With words_out a linear's residual and norm are the output's; the input's norm otherwise.
    output_norm = words_out and not swiglu
    normed = not output_norm and (norm_weight is not None or x_squares is not None)
    total = None if residual is None or output_norm else runtime.empty((M, K), x.dtype, x.device)
    outs = [runtime.empty((M, n), x.dtype, x.device) for n in Ns[:n_weights]]
    words, quads = ((runtime.empty((1, Ns[0]), x.dtype, x.device),
                     runtime.empty((Ns[0] // 4,), torch.float32, x.device)) if output_norm else (x, x))
    if K == 0 or all(n == 0 for n in Ns[:n_weights]):
        return _no_products(x, outs, biases, residual, total, norm_weight, norm_offset, words_out, swiglu, words,
                            quads)
    residual = x if residual is None else _unit_columns(residual)
    norm_weight = x if norm_weight is None else norm_weight.contiguous()
    s = x if total is None else total
    one_row = M == 1
    key = (x.dtype, one_row, K, tuple(Ns), swiglu, normed, total is not None, fmt, x_words, words_out, x.device.index)
    consts = dict(WEIGHTS=len(weights), HAS_BIAS0=biases[0] is not None,
                  HAS_BIAS1=len(biases) > 1 and biases[1] is not None,
                  HAS_BIAS2=len(biases) > 2 and biases[2] is not None, NORM=normed,
                  RESIDUAL=total is not None, SWIGLU=swiglu, ONE_ROW=one_row, UPCAST=runtime.INTERPRET,
                  INPUT_PRECISION=runtime.input_precision(x.dtype), W_FMT=fmt,
                  W_VEC=quant.FORMATS[fmt][0] if fmt else 1, TENSOR_SCALE=fmt == "nvfp4", X_WORDS=x_words,
                  WORDS_OUT=words_out, BLOCK_M=1 if one_row else DOT_ROWS)
    if fmt:
        # One bf16 row and fp4 codes, all as int32 words (_row_times_fp4_weights).
        x, s = quant.int32_words(x), quant.int32_words(s)
        if not output_norm:  # else the epilogue reads them a column at a time
            residual, norm_weight = quant.int32_words(residual), quant.int32_words(norm_weight)
        weights = [quant.int32_words(w) for w in weights]
        weight_scales = [_unit_columns(t).view(torch.uint8) for t in weight_scales]
        # An nvfp4 tensor without a tensor scale has a scale of 1 (quant.dequantize).
        tensor_scales = [x if fmt == "mxfp4" else t if t is not None else torch.ones((), device=x.device)
                         for t in tensor_scales]
    else:
        weight_scales = tensor_scales = weights
    pad = MAX_WEIGHTS - len(weights)
    ws, scales, ts = (list(t) + [t[0]] * pad for t in (weights, weight_scales, tensor_scales))
    bs = [b if b is not None else ws[0] for b in biases] + [ws[0]] * pad
    ys = outs + [outs[0]] * (MAX_WEIGHTS - len(outs))
    Ns += [Ns[0]] * pad

    def grid(config):
        return (sum(runtime.cdiv(n, config["BLOCK_N"]) for n in Ns[:n_weights]),)

    def even_k(config):
        return K % config["BLOCK_K"] == 0

    q = x_squares.contiguous() if x_squares is not None else quads
    args = (x, residual, s, norm_weight, q, words, *ws, *scales, *ts, *bs, *ys, x.stride(0), residual.stride(0),
            s.stride(0), *(w.stride(0) for w in ws), *(t.stride(0) for t in scales), *(y.stride(0) for y in ys), M, K,
            *Ns, float(eps), float(norm_offset))
    _launch(key, grid, *args, **consts, fitted=lambda config: (args, dict(consts, EVEN_K=even_k(config))))
    if output_norm:
        return [outs[0], words, quads]
    return outs + ([total] if total is not None else [])


def _no_products(x, outs, biases, residual, total, norm_weight, norm_offset, words_out, swiglu, words, quads):
    """decode_products' outputs where there is nothing to stream (K or N 0): empty sums are the
    bias (silu(0) * 0 for SwiGLU), and no program stores the sum."""
    for o, b in zip(outs, biases):
        o.copy_(b.expand_as(o)) if b is not None else o.zero_()
    if total is not None:
        torch.add(x, residual, out=total)
    if not words_out:
        return outs + ([total] if total is not None else [])
    if swiglu:
        return [prepared_words(outs[0])] + ([total] if total is not None else [])
    # An empty product is 0: the output is the residual (two bf16 adds) and is prepared from it.
    outs[0].copy_(outs[0] + residual)
    for out, prepared in zip((words, quads), _norm_input_words(outs[0], norm_weight, norm_offset)):
        out.copy_(prepared)
    return [outs[0], words, quads]


def _bias_list(biases, n: int) -> list[torch.Tensor | None]:
    return [None] * n if biases is None else list(biases)


def _norm_args(norm) -> tuple[torch.Tensor | None, float, float]:
    return (None, 0.0, 0.0) if norm is None else (norm[0], float(norm[1]), float(norm[2]))


def _weight_args(weights: Sequence) -> tuple[list[torch.Tensor], str, list[torch.Tensor], list[torch.Tensor | None]]:
    """decode_products' (weights, fmt, weight_scales, tensor_scales) for tensors or fp4 QuantizedTensors."""
    if not isinstance(weights[0], QuantizedTensor):
        return list(weights), "", [], []
    # (N, K / 2) bytes of codes: a view, which also gives N rows where K is 0.
    codes = [w.data.view(torch.uint8).reshape(w.shape[0], w.shape[1] // 2) for w in weights]
    return codes, weights[0].fmt, [w.scales for w in weights], [w.tensor_scale for w in weights]


@dataclasses.dataclass(frozen=True)
class PreparedRow:
    """One bf16 row x as fp4 products read it, written by the product before them
    (decode_linear_into_norm, decode_swiglu(prepared=True)) so that no program of the next works
    on x (docs/generate.md, "Block-scaled weights"): `words` (1, K) bf16, prepared_words(x'),
    x' = x (offset + norm weight) with a norm, else x; with a norm, `squares` (K / 4,) float32,
    the sums of x^2 over each four columns, and its `eps`."""
    words: torch.Tensor
    squares: torch.Tensor | None = None
    eps: float = 0.0


def prepared_words(x: torch.Tensor) -> torch.Tensor:
    """x (rows, K), K a multiple of 8, times 2^100 rounded to bf16, each 8 columns in the order
    0, 4, 1, 5, 2, 6, 3, 7: int32 words of these are the bf16 pairs quant.e2m1_word_dot takes."""
    scaled = (x.float() * 2.0 ** 100).to(torch.bfloat16)
    return scaled.reshape(*x.shape[:-1], x.shape[-1] // 8, 2, 4).transpose(-1, -2).reshape(x.shape)


def decode_linear(x: torch.Tensor | PreparedRow, weights: Sequence[torch.Tensor | QuantizedTensor],
                  biases: Sequence[torch.Tensor | None] | None = None,
                  norm: tuple[torch.Tensor, float, float] | None = None,
                  residual: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """x w_i^T + b_i for each of 1 to MAX_WEIGHTS weights, in one launch: see the module doc.
    norm = (weight, eps, offset): the products of rms_norm(x) instead (rms_norm's arguments);
    residual: of rms_norm(x + residual), the sum (rounded to x's dtype) returned after the outputs.
    x may be a PreparedRow (fp4 weights; its norm, if any, is applied, so no norm or residual)."""
    if isinstance(x, PreparedRow):
        _check_prepared(x, weights, biases, norm, residual)
        return tuple(decode_products(x.words, *_weight_args(weights), _bias_list(biases, len(weights)), None, x.eps,
                                     0.0, None, False, x.squares, True))
    _check(x, weights, biases, norm, residual)
    return tuple(decode_products(x, *_weight_args(weights), _bias_list(biases, len(weights)), *_norm_args(norm),
                                 residual, False))


def decode_linear_into_norm(x: torch.Tensor | PreparedRow, weight: QuantizedTensor, residual: torch.Tensor,
                            norm: tuple[torch.Tensor, float, float],
                            bias: torch.Tensor | None = None) -> tuple[PreparedRow, torch.Tensor]:
    """(rms_norm(y) prepared for the next fp4 products, y) for y = (x w^T + b) + residual, each add
    rounded to bf16 as two adds in bf16 round it: one fp4 weight, one bf16 row, its N a multiple
    of 8 (a layer's o or down projection, whose sum the next layer's norm takes)."""
    x_words = isinstance(x, PreparedRow)
    if x_words:
        _check_prepared(x, (weight,), None if bias is None else [bias], None, None)
        if x.squares is not None:
            raise ValueError("decode_linear_into_norm takes a PreparedRow without a norm (an activation's)")
        x = x.words
    else:
        _check(x, (weight,), None, None, None)
    _check_words_out(x, weight, bias, residual, norm, linear=True)
    y, words, squares = decode_products(x, *_weight_args((weight,)), [bias], norm[0], 0.0, float(norm[2]),
                                        residual, False, None, x_words, True)
    return PreparedRow(words, squares, float(norm[1])), y


def decode_swiglu(x: torch.Tensor | PreparedRow, w_gate: torch.Tensor | QuantizedTensor,
                  w_up: torch.Tensor | QuantizedTensor, norm: tuple[torch.Tensor, float, float] | None = None,
                  residual: torch.Tensor | None = None, prepared: bool = False):
    """silu(x w_gate^T) * (x w_up^T) in one launch: see the module doc. norm and residual as
    decode_linear takes them; with a residual, (the activation, x + residual). x may be a
    PreparedRow; prepared=True (fp4 weights) returns the activation as one (no norm)."""
    if isinstance(x, PreparedRow):
        _check_prepared(x, (w_gate, w_up), None, norm, residual)
        words, x_squares, eps = x.words, x.squares, x.eps
        norm_args = (None, eps, 0.0)
    else:
        _check(x, (w_gate, w_up), None, norm, residual)
        words, x_squares = x, None
        norm_args = _norm_args(norm)
    if w_gate.shape != w_up.shape:
        raise ValueError(f"w_gate and w_up must have one shape, got {tuple(w_gate.shape)} and {tuple(w_up.shape)}")
    if prepared:
        _check_words_out(words, w_gate, None, None, None, linear=False)
    out = decode_products(words, *_weight_args((w_gate, w_up)), [None, None], *norm_args, residual, True,
                          x_squares, isinstance(x, PreparedRow), prepared)
    act = PreparedRow(out[0]) if prepared else out[0]
    return act if residual is None else (act, out[1])


def _normed_reference(x, norm, residual):
    """(rms_norm(x + residual) or x as the products take it, x + residual or None)."""
    total = None if residual is None else x + residual
    if total is not None:
        x = total
    if norm is not None:
        weight, eps, offset = norm
        xf = x.double() if x.dtype == torch.float64 else x.float()
        x = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * (offset + weight.to(xf.dtype))).to(x.dtype)
    return x, total


def _dense(w, dtype: torch.dtype) -> torch.Tensor:
    """A weight as a tensor of dtype (a QuantizedTensor dequantized in float32 first)."""
    return w.dequantize(torch.float32).to(dtype) if isinstance(w, QuantizedTensor) else w


def _norm_input_words(row: torch.Tensor, norm_weight: torch.Tensor, offset: float) -> tuple[torch.Tensor, torch.Tensor]:
    """A PreparedRow's (words, squares) of a bf16 row that a norm of (offset + norm_weight) takes."""
    row = row.float()
    return prepared_words(row * (offset + norm_weight.float())), row.pow(2).reshape(-1, 4).sum(1)


def _reference_row(x):
    """x, or the bf16 row a PreparedRow's products take."""
    return unprepared(x).to(x.words.dtype) if isinstance(x, PreparedRow) else x


def unprepared(x: PreparedRow) -> torch.Tensor:
    """The float32 row a PreparedRow's products take: rms_norm's output with a norm, else x."""
    words = x.words.float()
    row = words.reshape(*words.shape[:-1], words.shape[-1] // 8, 4, 2).transpose(-1, -2).reshape(words.shape)
    row = row * 2.0 ** -100
    K = words.shape[-1]
    return row if x.squares is None else row * torch.rsqrt(x.squares.double().sum() / K + x.eps).float()


def decode_linear_reference(x, weights, biases=None, norm=None, residual=None):
    h, total = _normed_reference(_reference_row(x), norm, residual)
    biases = biases or [None] * len(weights)
    outs = tuple(torch.nn.functional.linear(h, _dense(w, h.dtype), b) for w, b in zip(weights, biases))
    return outs if total is None else (*outs, total)


def decode_swiglu_reference(x, w_gate, w_up, norm=None, residual=None, prepared=False):
    h, total = _normed_reference(_reference_row(x), norm, residual)
    gate, up = (torch.nn.functional.linear(h, _dense(w, h.dtype)) for w in (w_gate, w_up))
    act = torch.nn.functional.silu(gate) * up
    if prepared:
        act = PreparedRow(prepared_words(act.to(torch.bfloat16)))
    return act if total is None else (act, total)


def decode_linear_into_norm_reference(x, weight, residual, norm, bias=None):
    """decode_linear_into_norm's (PreparedRow, sum), the sum rounded as the op rounds it."""
    y, = decode_linear_reference(x, [weight], [bias])
    y = (y.to(residual.dtype).float() + residual.float()).to(residual.dtype)
    nw, eps, offset = norm
    return PreparedRow(*_norm_input_words(y, nw, offset), float(eps)), y
