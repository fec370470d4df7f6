"""Scaled dot-product attention (flash-attention 2 style), forward and backward.

    S = scale * Q K^T,  P = softmax(S) over keys (masked),  O = P V,  lse = logsumexp(S) per query row
    dV = P^T dO,  dP = dO V^T,  dS = P * (dP - delta),  delta = rowsum(dO * O) - dlse
    dQ = scale * dS K,  dK = scale * dS^T Q

q (B, H, S_q, D), k and v (B, H_kv, S_k, D) with H % H_kv == 0 (GQA/MQA, k and v never repeated),
or a packed variable-length batch (total, H, D) with int32 cu_seqlens (flash-attn's varlen
convention, the same kernels with a VARLEN switch). Causal masks are aligned bottom-right (key j
allowed iff j <= i + S_k - S_q), window=left also masks j < i + S_k - S_q - left; a row with no
allowed key outputs 0 with lse = -inf. Forward: one program per (query block, batch * head), an
online softmax over the key blocks of the band. Backward, deterministic (no atomics): a dQ kernel
that also forms delta, then a dK/dV kernel per key block and kv head, looping over its query heads.
Configs are autotuned; launches are planned per call signature and replayed. Design: docs/attention.md.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from .. import runtime

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
HEAD_DIMS = (32, 64, 96, 128, 256)
LOG2E = 1.4426950408889634
NO_WINDOW = -1
NO_SOFTCAP = 0.0
# The dK/dV kernel cuts a kv head's query heads into parts when its grid has fewer than about this
# many programs per SM, counted with 64-key blocks (_dkdv_parts); SUM_PARTS_BLOCK elements a
# program when the parts are added up.
DKDV_PARTS_PROGRAMS_PER_SM = 2
DKDV_PARTS_BLOCK_N = 64
SUM_PARTS_BLOCK = 1024


def _config(bm, bn, warps, stages):
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=warps, num_stages=stages)


def _interpreter_configs():
    # The interpreter's cost is per block op: small blocks keep tiny test shapes multi-block.
    return [_config(16, 16, 4, 1)]


def _fwd_configs():
    """The forward's BLOCK_M query rows x BLOCK_N keys. The lists below keep the configs that won
    or came close at some head dim in scripts/sweep_attention.py on the H100 (bf16), and the
    small tiles that head dim 256 needs."""
    if runtime.INTERPRET:
        return _interpreter_configs()
    return [
        _config(128, 64, 8, 3),     # D 64 and 128 (S 4096)
        _config(128, 64, 8, 4),     # D 128 (S 16384)
        _config(128, 64, 4, 3),
        _config(128, 128, 8, 2),
        _config(64, 64, 4, 4),
        _config(64, 64, 4, 3),      # D 64 causal (S 2048)
        _config(64, 32, 4, 3),
        # Head dim 256: a 64-row fp32 accumulator over 8 warps (64 registers a thread).
        _config(64, 64, 8, 2),
    ]


def _dkdv_configs():
    """The dK/dV kernel keeps BLOCK_N keys resident and streams BLOCK_M query rows."""
    if runtime.INTERPRET:
        return _interpreter_configs()
    return [
        _config(64, 128, 8, 3),    # D 128
        _config(64, 128, 8, 2),
        _config(32, 128, 8, 3),
        _config(32, 128, 8, 2),
        _config(32, 64, 4, 3),     # D 64, and D 128 causal
        # Small tiles for head dim 256, where the larger ones spill or do not fit.
        _config(64, 32, 8, 2),
        _config(32, 32, 8, 2),
        _config(32, 64, 8, 2),
    ]


def _dq_configs():
    """The dQ kernel keeps BLOCK_M query rows resident and streams BLOCK_N keys."""
    if runtime.INTERPRET:
        return _interpreter_configs()
    return [
        _config(128, 64, 8, 3),     # D 128
        _config(128, 64, 8, 2),
        _config(128, 128, 8, 2),
        _config(64, 64, 4, 3),      # D 64
        _config(64, 64, 4, 2),
        _config(128, 32, 4, 3),
        # Small tiles for head dim 256.
        _config(64, 32, 8, 2),
        _config(32, 64, 8, 2),
    ]


# Largest head dim (BLOCK_D) at which a config compiles for sm_90 with at most 512 bytes of
# register spills in 16-bit dtypes (scripts/compile_check.py, Triton 3.6); configs not listed
# stay under that at every head dim that their shared memory allows. The budget is not zero
# because a few hundred bytes cost little: dK/dV's 64x128 tile spills about 300 B at D 128 and
# is still its fastest config there (scripts/sweep_attention.py). (kernel, BLOCK_M, BLOCK_N,
# num_warps, num_stages) -> max BLOCK_D, 0 for configs over budget at every head dim. float32
# (tf32 or ieee dots) gets one config (below): it is the precision path, not the fast one.
_SPILL_FREE_UP_TO = {
    ("dkdv", 32, 128, 8, 2): 128,   # 4.2 KB at D 256
    ("dkdv", 32, 64, 4, 3): 128,    # 4.6 KB at D 256
}


def _smem_fits(configs, named_args, kwargs, tile_rows, kernel):
    """Keep configs whose tiles fit the H100's 227 KiB of shared memory (with some slack);
    `tile_rows(bm, bn, stages)` counts the BLOCK_D-wide rows held, pipelined ones per stage.
    In 16-bit dtypes, also drop the configs that spill too many registers at this head dim
    (_SPILL_FREE_UP_TO), unless that would leave none, and keep the measured winners where the
    sweep has them (_MEASURED_BEST); float32 gets the smallest tiles only."""
    block_d, q = kwargs["BLOCK_D"], named_args["q_ptr"]
    elt = q.element_size()
    kept = [c for c in configs
            if tile_rows(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], max(c.num_stages, 1)) * block_d * elt
            <= 200 * 1024]
    smallest = min(kept or configs, key=lambda c: c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"])
    if elt == 4:
        # float32 is the precision path: one config (the smallest tiles, the fewest spills)
        # rather than compiling and timing a list in which nearly every config spills.
        return [smallest]
    clean = [c for c in kept if block_d <= _SPILL_FREE_UP_TO.get(
        (kernel, c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages), block_d)]
    measured = _MEASURED_BEST.get((kernel, block_d))
    if measured:
        # Compile and time only the sweep's winners: a first training step then compiles a
        # handful of configs, not every one (warm-up time), and the choice is less noisy.
        winners = [c for c in clean if _config_label(c) in measured]
        clean = winners or clean
    return clean or kept or [smallest]


def _config_label(c) -> str:
    """'BMxBN:wW:sS', plus ':rR' where the config caps a thread's registers (maxnreg)."""
    label = f"{c.kwargs['BLOCK_M']}x{c.kwargs['BLOCK_N']}:w{c.num_warps}:s{c.num_stages}"
    return f"{label}:r{c.maxnreg}" if c.maxnreg else label


# The configs within a few percent of the best at some target shape in scripts/sweep_attention.py
# on the H100 (bf16; S 2048-16384, causal and full), per (kernel, head dim). Head dims not listed
# autotune over the whole pruned list.
_MEASURED_BEST = {
    ("fwd", 128): ("128x64:w8:s3", "128x64:w8:s4"),
    ("fwd", 64): ("64x64:w4:s3", "64x64:w4:s4", "128x64:w8:s3"),
    ("dkdv", 128): ("64x128:w8:s3", "64x128:w8:s2", "32x64:w4:s3"),
    ("dkdv", 64): ("32x64:w4:s3", "64x128:w8:s2"),
    ("dq", 128): ("128x64:w8:s3", "64x64:w4:s2", "128x128:w8:s2"),
    ("dq", 64): ("64x64:w4:s3", "128x32:w4:s3", "128x64:w8:s3"),
}


def _prune_fwd(configs, named_args, **kwargs):
    # Q stays resident; K and V blocks are pipelined.
    return _smem_fits(configs, named_args, kwargs, lambda bm, bn, stages: bm + 2 * bn * stages, "fwd")


def _prune_dkdv(configs, named_args, **kwargs):
    # K and V stay resident; Q and dO blocks are pipelined.
    return _smem_fits(configs, named_args, kwargs, lambda bm, bn, stages: 2 * bn + 2 * bm * stages, "dkdv")


def _prune_dq(configs, named_args, **kwargs):
    # Q and dO stay resident; K and V blocks are pipelined.
    return _smem_fits(configs, named_args, kwargs, lambda bm, bn, stages: 2 * bm + 2 * bn * stages, "dq")


@triton.jit
def _allowed(i, j, S_q, S_k, shift, window_left, CAUSAL: tl.constexpr, WINDOW: tl.constexpr):
    """Whether query i may attend key j (broadcast shapes), padding rows and columns excluded."""
    ok = (i < S_q) & (j < S_k)
    if CAUSAL:
        ok = ok & (j <= i + shift)
    if WINDOW:
        ok = ok & (j >= i + shift - window_left)
    return ok


@triton.jit
def _key_range(start_m, S_k, shift, window_left,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr):
    """[lo, hi) over keys, lo a multiple of BLOCK_N, covering every key that a query of the
    block [start_m, start_m + BLOCK_M) may attend."""
    hi = S_k
    if CAUSAL:
        hi = tl.minimum(hi, start_m + BLOCK_M + shift)
    lo = 0
    if WINDOW:
        lo = tl.maximum(start_m + shift - window_left, 0) // BLOCK_N * BLOCK_N
    return lo, hi


@triton.jit
def _unmasked_range(start_m, lo, hi, S_k, shift, window_left,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr):
    """[mid_lo, mid_hi) within [lo, hi), block-aligned unless empty at hi: the key blocks that
    every query of the block may attend entirely (no mask needed)."""
    mid_hi = S_k // BLOCK_N * BLOCK_N
    if CAUSAL:
        # The block's first query sees keys <= start_m + shift.
        mid_hi = tl.minimum(mid_hi, tl.maximum(start_m + shift + 1, 0) // BLOCK_N * BLOCK_N)
    mid_lo = lo
    if WINDOW:
        # The block's last query sees keys >= start_m + BLOCK_M - 1 + shift - left.
        first = tl.maximum(start_m + BLOCK_M - 1 + shift - window_left, 0)
        mid_lo = tl.maximum(mid_lo, (first + BLOCK_N - 1) // BLOCK_N * BLOCK_N)
    mid_lo = tl.minimum(mid_lo, hi)
    mid_hi = tl.minimum(tl.maximum(mid_hi, mid_lo), hi)
    return mid_lo, mid_hi


@triton.jit
def _unmasked_query_range(start_n, lo, hi, len_q, len_k, shift, window_left,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr):
    """[mid_lo, mid_hi) within [lo, hi), multiples of BLOCK_M as lo is, unless empty at hi: the
    query blocks that attend every key of the key block [start_n, start_n + BLOCK_N)."""
    mid_lo = lo
    if CAUSAL:
        # The block's last key is seen by queries >= start_n + BLOCK_N - 1 - shift.
        first = tl.maximum(start_n + BLOCK_N - 1 - shift, 0)
        mid_lo = tl.maximum(mid_lo, (first + BLOCK_M - 1) // BLOCK_M * BLOCK_M)
    mid_hi = len_q // BLOCK_M * BLOCK_M
    if WINDOW:
        # The block's first key is seen by queries <= start_n - shift + left.
        mid_hi = tl.minimum(mid_hi, tl.maximum(start_n - shift + window_left + 1, 0) // BLOCK_M * BLOCK_M)
    if start_n + BLOCK_N > len_k:
        # A key block cut by the end of the keys needs its mask everywhere.
        mid_hi = mid_lo
    mid_lo = tl.minimum(mid_lo, hi)
    mid_hi = tl.minimum(tl.maximum(mid_hi, mid_lo), hi)
    return mid_lo, mid_hi


@triton.jit
def _load_tile(base, offs_r, offs_d, stride_r, stride_d, n_rows, ROWS_MASKED: tl.constexpr,
               UPCAST: tl.constexpr, HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr):
    """A (rows, BLOCK_D) tile, zero past n_rows (when ROWS_MASKED) and past HEAD_D; without a
    mask where neither applies, so that full tiles load unpredicated."""
    ptrs = base + offs_r[:, None] * stride_r + offs_d[None, :] * stride_d
    if ROWS_MASKED:
        x = tl.load(ptrs, mask=(offs_r[:, None] < n_rows) & (offs_d[None, :] < HEAD_D), other=0.0)
    elif BLOCK_D != HEAD_D:
        x = tl.load(ptrs, mask=offs_d[None, :] < HEAD_D, other=0.0)
    else:
        x = tl.load(ptrs)
    if UPCAST:
        x = x.to(tl.float32)
    return x


@triton.jit
def _stream_source(ptr, b, h, row_start, stride_b, stride_h, stride_s, DESCRIPTORS: tl.constexpr):
    """What _stream_tile reads head (b, h) from: the tensor descriptor passed as ptr, or the
    head's first row."""
    if DESCRIPTORS:
        src = ptr
    else:
        src = ptr + b * stride_b + h * stride_h + row_start * stride_s
    return src


@triton.jit
def _stream_tile(src, b, h, start, offs_r, offs_d, stride_r, stride_d, n_rows, ROWS_MASKED: tl.constexpr,
                 UPCAST: tl.constexpr, HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr,
                 DESCRIPTORS: tl.constexpr):
    """The (BLOCK_R, BLOCK_D) tile of rows [start, start + BLOCK_R) of head (b, h): through the
    tensor descriptor `src` (a (B, H, S, HEAD_D) tensor read in (1, 1, BLOCK_R, HEAD_D) boxes,
    zero past S as _load_tile's masked rows) when DESCRIPTORS, else as _load_tile from the head's
    base pointer."""
    if DESCRIPTORS:
        x = src.load([b, h, start, 0]).reshape(BLOCK_R, BLOCK_D)
        if UPCAST:
            x = x.to(tl.float32)
    else:
        x = _load_tile(src, offs_r, offs_d, stride_r, stride_d, n_rows, ROWS_MASKED, UPCAST, HEAD_D, BLOCK_D)
    return x


def tanh_approx(dtype: torch.dtype) -> bool:
    """tanh's APPROX for inputs of `dtype`: MUFU's on a GPU, except for float32, the precision
    path, which gets tanh to float32's precision (and so does the interpreter, which runs no PTX)."""
    return runtime.COMPILED and dtype != torch.float32


@triton.jit
def tanh(x, APPROX: tl.constexpr):
    """tanh(x). APPROX: one MUFU.TANH (tanh.approx.f32, relative error 2^-11, under a 16-bit
    logit's rounding; flash-attn's softcap takes the same). Else to a few float32 ulps (the
    float32 path and the interpreter, which runs no PTX): (1 - e) / (1 + e), e = exp(-2|x|), and
    below |x| = 1/8, where 1 - e cancels (a large cap's small arguments), tanh's series to x^7."""
    if APPROX:
        y = tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [x], dtype=tl.float32,
                                      is_pure=True, pack=1)
    else:
        ax = tl.abs(x)
        e = tl.exp2(ax * -2.8853900817779268)  # exp(-2 |x|)
        big = (1.0 - e) / (1.0 + e)
        x2 = x * x
        small = x * (1.0 + x2 * (-0.3333333333333333 + x2 * (0.13333333333333333 + x2 * -0.05396825396825397)))
        y = tl.where(ax < 0.125, small, tl.where(x < 0, -big, big))
    return y


@triton.jit
def add_sink(acc, l_i, m_i, sink2):
    """(acc, l, m) of an online softmax with the sink's base-2 logit added to the denominator: one
    more term, with no value (docs/attention.md, "Sinks")."""
    m_new = tl.maximum(m_i, sink2)
    alpha = tl.exp2(m_i - m_new)
    return acc * alpha[:, None], l_i * alpha + tl.exp2(sink2 - m_new), m_new


@triton.jit
def _fwd_blocks(acc, l_i, m_i, q, k_src, v_src, b, hk, stride_ks, stride_kd, stride_vs, stride_vd,
                offs_m, offs_d, S_q, S_k, shift, window_left, qk_scale, cap_in, cap2, lo, hi,
                MASK: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
                TANH_APPROX: tl.constexpr, UPCAST: tl.constexpr, INPUT_PRECISION: tl.constexpr,
                BLOCK_N: tl.constexpr, HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, DESCRIPTORS: tl.constexpr):
    """Online-softmax update of (acc, l, m) over the key blocks [lo, hi) (base-2 logits; with
    SOFTCAP, cap2 tanh(cap_in qk): softcap tanh(scale qk / softcap) in base 2)."""
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k = _stream_tile(k_src, b, hk, start_n, offs_n, offs_d, stride_ks, stride_kd, S_k, MASK, UPCAST, HEAD_D,
                         BLOCK_D, BLOCK_N, DESCRIPTORS)
        v = _stream_tile(v_src, b, hk, start_n, offs_n, offs_d, stride_vs, stride_vd, S_k, MASK, UPCAST, HEAD_D,
                         BLOCK_D, BLOCK_N, DESCRIPTORS)
        qk = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION)
        if MASK or SOFTCAP:
            if SOFTCAP:
                s = cap2 * tanh(qk * cap_in, TANH_APPROX)
            else:
                s = qk * qk_scale
            if MASK:
                ok = _allowed(offs_m[:, None], offs_n[None, :], S_q, S_k, shift, window_left, CAUSAL, WINDOW)
                s = tl.where(ok, s, -float("inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            # A row that has seen no allowed key yet keeps m = -inf: subtract 0 instead (no nan).
            m_sub = tl.where(m_new == -float("inf"), 0.0, m_new)
            p = tl.exp2(s - m_sub[:, None])
        else:
            # qk_scale > 0, so the row max scales with it, and the scale folds into one FMA.
            m_new = tl.maximum(m_i, tl.max(qk, axis=1) * qk_scale)
            m_sub = m_new
            p = tl.exp2(qk * qk_scale - m_sub[:, None])
        alpha = tl.exp2(m_i - m_sub)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=INPUT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _dkdv_blocks(dk, dv, k, v, q_src, do_src, b, h, lse_row, delta_row, stride_qs, stride_qd, stride_dos,
                 stride_dod, offs_n, offs_d, len_q, len_k, shift, window_left, qk_scale, cap_in, cap2, lo, hi,
                 MASK: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
                 TANH_APPROX: tl.constexpr, UPCAST: tl.constexpr, INPUT_PRECISION: tl.constexpr,
                 BLOCK_M: tl.constexpr, HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, DESCRIPTORS: tl.constexpr):
    """dK, dV of one key block accumulated over the query blocks [lo, hi) of one query head, on
    transposed scores (keys along rows)."""
    for start_m in range(lo, hi, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        q = _stream_tile(q_src, b, h, start_m, offs_m, offs_d, stride_qs, stride_qd, len_q, MASK, UPCAST, HEAD_D,
                         BLOCK_D, BLOCK_M, DESCRIPTORS)
        do = _stream_tile(do_src, b, h, start_m, offs_m, offs_d, stride_dos, stride_dod, len_q, MASK, UPCAST,
                          HEAD_D, BLOCK_D, BLOCK_M, DESCRIPTORS)
        if MASK:
            lse2 = tl.load(lse_row + offs_m, mask=offs_m < len_q, other=0.0) * 1.4426950408889634
            delta = tl.load(delta_row + offs_m, mask=offs_m < len_q, other=0.0)
        else:
            lse2 = tl.load(lse_row + offs_m) * 1.4426950408889634
            delta = tl.load(delta_row + offs_m)
        qk_t = tl.dot(k, tl.trans(q), input_precision=INPUT_PRECISION)
        if SOFTCAP:
            t = tanh(qk_t * cap_in, TANH_APPROX)
            p_t = tl.exp2(cap2 * t - lse2[None, :])
        else:
            p_t = tl.exp2(qk_t * qk_scale - lse2[None, :])
        if MASK:
            ok = _allowed(offs_m[None, :], offs_n[:, None], len_q, len_k, shift, window_left, CAUSAL, WINDOW)
            # Rows with no allowed key (lse = -inf) are masked everywhere: where() drops their inf.
            p_t = tl.where(ok, p_t, 0.0)
        dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=INPUT_PRECISION)
        dp_t = tl.dot(v, tl.trans(do), input_precision=INPUT_PRECISION)
        ds_t = p_t * (dp_t - delta[None, :])
        if SOFTCAP:
            ds_t = ds_t * (1.0 - t * t)  # d(softcap tanh(x / softcap)) / dx
        dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision=INPUT_PRECISION)
    return dk, dv


@triton.jit
def _dq_blocks(dq, q, do, lse2, delta, k_src, v_src, b, hk, stride_ks, stride_kd, stride_vs, stride_vd,
               offs_m, offs_d, len_q, len_k, shift, window_left, qk_scale, cap_in, cap2, lo, hi,
               MASK: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
               TANH_APPROX: tl.constexpr, UPCAST: tl.constexpr, INPUT_PRECISION: tl.constexpr,
               BLOCK_N: tl.constexpr, HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, DESCRIPTORS: tl.constexpr):
    """dQ of one query block accumulated over the key blocks [lo, hi), as the forward streams them."""
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k = _stream_tile(k_src, b, hk, start_n, offs_n, offs_d, stride_ks, stride_kd, len_k, MASK, UPCAST, HEAD_D,
                         BLOCK_D, BLOCK_N, DESCRIPTORS)
        v = _stream_tile(v_src, b, hk, start_n, offs_n, offs_d, stride_vs, stride_vd, len_k, MASK, UPCAST, HEAD_D,
                         BLOCK_D, BLOCK_N, DESCRIPTORS)
        qk = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION)
        if SOFTCAP:
            t = tanh(qk * cap_in, TANH_APPROX)
            p = tl.exp2(cap2 * t - lse2[:, None])
        else:
            p = tl.exp2(qk * qk_scale - lse2[:, None])
        if MASK:
            ok = _allowed(offs_m[:, None], offs_n[None, :], len_q, len_k, shift, window_left, CAUSAL, WINDOW)
            p = tl.where(ok, p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=INPUT_PRECISION)
        ds = p * (dp - delta[:, None])
        if SOFTCAP:
            ds = ds * (1.0 - t * t)
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=INPUT_PRECISION)
    return dq


@triton.jit
def _sequence(b, cu_q_ptr, cu_k_ptr, S_q, S_k, VARLEN: tl.constexpr):
    """(first query row, query count, first key row, key count) of batch entry b: read from
    cu_seqlens in a packed (varlen) batch, else (0, S_q, 0, S_k)."""
    if VARLEN:
        q_start = tl.load(cu_q_ptr + b).to(tl.int64)
        len_q = tl.load(cu_q_ptr + b + 1) - tl.load(cu_q_ptr + b)
        k_start = tl.load(cu_k_ptr + b).to(tl.int64)
        len_k = tl.load(cu_k_ptr + b + 1) - tl.load(cu_k_ptr + b)
    else:
        q_start = 0
        len_q = S_q
        k_start = 0
        len_k = S_k
    return q_start, len_q, k_start, len_k


@triton.jit
def _grouped_block(n_blocks, GROUP_PROGRAMS: tl.constexpr):
    """(rank, batch * head) of this program of a 1-D grid of n_blocks programs per head. Heads go
    in groups of about GROUP_PROGRAMS programs, so that the blocks running together share their
    heads' K/V (or Q/dO) in L2; within a group all its heads' blocks of one rank run before the
    next rank's, so that a causal grid that maps rank 0 to its longest blocks starts them all
    first and ends on short ones (a tail of one head's long blocks is what a head-major order
    leaves). GROUP_PROGRAMS 0 puts all heads in one group."""
    pid = tl.program_id(0)
    n_heads = tl.num_programs(0) // n_blocks
    if GROUP_PROGRAMS == 0:  # one group: every head's blocks of rank 0 first
        heads_per_group = n_heads
    else:
        heads_per_group = tl.maximum(GROUP_PROGRAMS // n_blocks, 1)
    per_group = heads_per_group * n_blocks
    group = pid // per_group
    first = group * heads_per_group
    in_group = tl.minimum(heads_per_group, n_heads - first)
    within = pid - group * per_group
    return within // in_group, first + within % in_group


@triton.jit
def _query_block(H, H_kv, S_q, S_k, cu_q_ptr, cu_k_ptr, CAUSAL: tl.constexpr, VARLEN: tl.constexpr,
                 BLOCK_M: tl.constexpr, GROUP_PROGRAMS: tl.constexpr):
    """The query block of a program of the grid of (query blocks * batch * heads) programs: (b, h,
    kv head, sequence bounds as _sequence gives them, first query row). Causal grids run the
    longest rows (the last blocks) first."""
    n_blocks = tl.cdiv(S_q, BLOCK_M)
    rank, bh = _grouped_block(n_blocks, GROUP_PROGRAMS)
    if CAUSAL:
        pid_m = n_blocks - 1 - rank
    else:
        pid_m = rank
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    hk = h // (H // H_kv)
    q_start, len_q, k_start, len_k = _sequence(b, cu_q_ptr, cu_k_ptr, S_q, S_k, VARLEN)
    return b, h, hk, q_start, len_q, k_start, len_k, pid_m * BLOCK_M


@runtime.autotune(configs=_fwd_configs(), prune_configs_by={"early_config_prune": _prune_fwd})
@triton.jit
def _attention_fwd_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, cu_q_ptr, cu_k_ptr, sinks_ptr,
    stride_qb, stride_qh, stride_qs, stride_qd,
    stride_kb, stride_kh, stride_ks, stride_kd,
    stride_vb, stride_vh, stride_vs, stride_vd,
    stride_ob, stride_oh, stride_os, stride_lb, stride_lh,
    H, H_kv, S_q, S_k, sm_scale, softcap, window_left,
    HEAD_D: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr, VARLEN: tl.constexpr,
    SOFTCAP: tl.constexpr, TANH_APPROX: tl.constexpr, HAS_SINKS: tl.constexpr,
    UPCAST: tl.constexpr, INPUT_PRECISION: tl.constexpr, DESCRIPTORS: tl.constexpr,
    GROUP_PROGRAMS: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """S_q, S_k are the lengths of every sequence, or with VARLEN the longest ones (the grid's
    extent); a sequence's rows start at row q_start / k_start of the packed tensors. With
    DESCRIPTORS (dense batches only), K and V blocks come through tensor descriptors (TMA). With
    HAS_SINKS, head h's logit sinks_ptr[h] joins every row's softmax denominator (lse includes it)."""
    b, h, hk, q_start, len_q, k_start, len_k, start_m = _query_block(H, H_kv, S_q, S_k, cu_q_ptr, cu_k_ptr,
                                                                     CAUSAL, VARLEN, BLOCK_M, GROUP_PROGRAMS)
    if VARLEN:
        if start_m >= len_q:
            return
    q_base = q_ptr + b * stride_qb + q_start * stride_qs + h * stride_qh
    k_src = _stream_source(k_ptr, b, hk, k_start, stride_kb, stride_kh, stride_ks, DESCRIPTORS)
    v_src = _stream_source(v_ptr, b, hk, k_start, stride_vb, stride_vh, stride_vs, DESCRIPTORS)
    b32, hk32 = b.to(tl.int32), hk.to(tl.int32)

    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    q = _load_tile(q_base, offs_m, offs_d, stride_qs, stride_qd, len_q, True, UPCAST, HEAD_D, BLOCK_D)
    qk_scale = sm_scale * 1.4426950408889634
    cap_in, cap2 = sm_scale / softcap, softcap * 1.4426950408889634
    shift = len_k - len_q

    m_i = tl.full((BLOCK_M,), -float("inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    lo, hi = _key_range(start_m, len_k, shift, window_left, BLOCK_M, BLOCK_N, CAUSAL, WINDOW)
    mid_lo, mid_hi = _unmasked_range(start_m, lo, hi, len_k, shift, window_left, BLOCK_M, BLOCK_N, CAUSAL, WINDOW)
    # Blocks cut by the window's left edge, blocks inside the band (no mask), blocks cut by the
    # diagonal or the end of the keys.
    acc, l_i, m_i = _fwd_blocks(acc, l_i, m_i, q, k_src, v_src, b32, hk32, stride_ks, stride_kd, stride_vs,
                                stride_vd, offs_m, offs_d, len_q, len_k, shift, window_left, qk_scale, cap_in, cap2,
                                lo, mid_lo, True, CAUSAL, WINDOW, SOFTCAP, TANH_APPROX, UPCAST, INPUT_PRECISION,
                                BLOCK_N, HEAD_D, BLOCK_D, DESCRIPTORS)
    acc, l_i, m_i = _fwd_blocks(acc, l_i, m_i, q, k_src, v_src, b32, hk32, stride_ks, stride_kd, stride_vs,
                                stride_vd, offs_m, offs_d, len_q, len_k, shift, window_left, qk_scale, cap_in, cap2,
                                mid_lo, mid_hi, False, CAUSAL, WINDOW, SOFTCAP, TANH_APPROX, UPCAST, INPUT_PRECISION,
                                BLOCK_N, HEAD_D, BLOCK_D, DESCRIPTORS)
    acc, l_i, m_i = _fwd_blocks(acc, l_i, m_i, q, k_src, v_src, b32, hk32, stride_ks, stride_kd, stride_vs,
                                stride_vd, offs_m, offs_d, len_q, len_k, shift, window_left, qk_scale, cap_in, cap2,
                                mid_hi, hi, True, CAUSAL, WINDOW, SOFTCAP, TANH_APPROX, UPCAST, INPUT_PRECISION,
                                BLOCK_N, HEAD_D, BLOCK_D, DESCRIPTORS)

    if HAS_SINKS:
        acc, l_i, m_i = add_sink(acc, l_i, m_i, tl.load(sinks_ptr + h).to(tl.float32) * 1.4426950408889634)
    has_key = l_i > 0.0
    l_div = tl.where(has_key, l_i, 1.0)
    o = acc / l_div[:, None]
    lse = tl.where(has_key, (m_i + tl.log2(l_div)) * 0.6931471805599453, -float("inf"))
    row_ok = offs_m < len_q
    rows = q_start + offs_m
    o_offs = b * stride_ob + h * stride_oh + rows[:, None] * stride_os + offs_d[None, :]
    tl.store(o_ptr + o_offs, o.to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & (offs_d[None, :] < HEAD_D))
    tl.store(lse_ptr + b * stride_lb + h * stride_lh + rows, lse, mask=row_ok)


@runtime.autotune(configs=_dkdv_configs(), prune_configs_by={"early_config_prune": _prune_dkdv})
@triton.jit
def _attention_bwd_dkdv_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr, cu_q_ptr, cu_k_ptr,
    stride_qb, stride_qh, stride_qs, stride_qd,
    stride_kb, stride_kh, stride_ks, stride_kd,
    stride_vb, stride_vh, stride_vs, stride_vd,
    stride_dob, stride_doh, stride_dos, stride_dod,
    stride_dkb, stride_dkh, stride_dks, stride_dkp, stride_lb, stride_lh,
    H, H_kv, S_q, S_k, sm_scale, softcap, window_left, PARTS,
    HEAD_D: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr, VARLEN: tl.constexpr,
    SOFTCAP: tl.constexpr, TANH_APPROX: tl.constexpr, UPCAST: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    DESCRIPTORS: tl.constexpr,
    GROUP_PROGRAMS: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """dK, dV of one key block of one kv head: sums over the group's query heads, in order, and
    the query blocks of the band. Works on transposed scores (keys along rows). dK and dV share
    the strides stride_dk*. With PARTS > 1 the group's (head, query block) sequence is cut into
    PARTS equal runs, one program each (a run may start and end inside a head's band), and a
    run's sums go to its own float32 part (dk_ptr + part * stride_dkp) for _sum_parts_kernel to
    add up. With DESCRIPTORS, Q and dO blocks come through tensor descriptors."""
    # Causal: the first key blocks see the most queries; they start first.
    rank, bhkp = _grouped_block(tl.cdiv(S_k, BLOCK_N), GROUP_PROGRAMS)
    start_n = rank * BLOCK_N
    part = bhkp % PARTS
    bhk = bhkp // PARTS
    b = (bhk // H_kv).to(tl.int64)
    hk = (bhk % H_kv).to(tl.int64)
    group = H // H_kv
    q_start, len_q, k_start, len_k = _sequence(b, cu_q_ptr, cu_k_ptr, S_q, S_k, VARLEN)
    if VARLEN:
        if start_n >= len_k:
            return
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    k_base = k_ptr + b * stride_kb + k_start * stride_ks + hk * stride_kh
    v_base = v_ptr + b * stride_vb + k_start * stride_vs + hk * stride_vh
    k = _load_tile(k_base, offs_n, offs_d, stride_ks, stride_kd, len_k, True, UPCAST, HEAD_D, BLOCK_D)
    v = _load_tile(v_base, offs_n, offs_d, stride_vs, stride_vd, len_k, True, UPCAST, HEAD_D, BLOCK_D)
    qk_scale = sm_scale * 1.4426950408889634
    cap_in, cap2 = sm_scale / softcap, softcap * 1.4426950408889634
    shift = len_k - len_q
    # Queries that can see this key block: i >= j - shift (causal), i <= j - shift + left (window).
    lo = 0
    if CAUSAL:
        lo = tl.maximum(start_n - shift, 0) // BLOCK_M * BLOCK_M
    hi = len_q
    if WINDOW:
        hi = tl.minimum(hi, start_n + BLOCK_N - shift + window_left)
    mid_lo, mid_hi = _unmasked_query_range(start_n, lo, hi, len_q, len_k, shift, window_left,
                                           BLOCK_M, BLOCK_N, CAUSAL, WINDOW)

    # This part's share of the group's query blocks, [first, last) of group x n_blocks in head
    # order: equal shares, so the longest program is the band's work over PARTS (runs of whole
    # heads gave one part 4 of 7 heads: docs/attention.md).
    n_blocks = tl.maximum(tl.cdiv(hi - lo, BLOCK_M), 1)
    first = part * (group * n_blocks) // PARTS
    last = (part + 1) * (group * n_blocks) // PARTS
    dk = tl.zeros((BLOCK_N, BLOCK_D), tl.float32)
    dv = tl.zeros((BLOCK_N, BLOCK_D), tl.float32)
    for g in range(first // n_blocks, tl.cdiv(last, n_blocks)):
        h = hk * group + g
        # The head's query rows in this share, cut at the masked / unmasked boundaries below.
        share_lo = lo + tl.maximum(first - g * n_blocks, 0) * BLOCK_M
        share_hi = tl.minimum(lo + tl.minimum(last - g * n_blocks, n_blocks) * BLOCK_M, hi)
        q_src = _stream_source(q_ptr, b, h, q_start, stride_qb, stride_qh, stride_qs, DESCRIPTORS)
        do_src = _stream_source(do_ptr, b, h, q_start, stride_dob, stride_doh, stride_dos, DESCRIPTORS)
        b32, h32 = b.to(tl.int32), h.to(tl.int32)
        lse_row = lse_ptr + b * stride_lb + h * stride_lh + q_start
        delta_row = delta_ptr + b * stride_lb + h * stride_lh + q_start
        # Query blocks cut by the diagonal, blocks that see the whole key block (no mask), blocks
        # cut by the window or the end of the queries.
        dk, dv = _dkdv_blocks(dk, dv, k, v, q_src, do_src, b32, h32, lse_row, delta_row, stride_qs, stride_qd,
                              stride_dos, stride_dod, offs_n, offs_d, len_q, len_k, shift, window_left, qk_scale,
                              cap_in, cap2, share_lo, tl.minimum(mid_lo, share_hi), True, CAUSAL, WINDOW, SOFTCAP,
                              TANH_APPROX, UPCAST, INPUT_PRECISION, BLOCK_M, HEAD_D, BLOCK_D, DESCRIPTORS)
        dk, dv = _dkdv_blocks(dk, dv, k, v, q_src, do_src, b32, h32, lse_row, delta_row, stride_qs, stride_qd,
                              stride_dos, stride_dod, offs_n, offs_d, len_q, len_k, shift, window_left, qk_scale,
                              cap_in, cap2, tl.maximum(mid_lo, share_lo), tl.minimum(mid_hi, share_hi), False, CAUSAL,
                              WINDOW, SOFTCAP, TANH_APPROX, UPCAST, INPUT_PRECISION, BLOCK_M, HEAD_D, BLOCK_D,
                              DESCRIPTORS)
        dk, dv = _dkdv_blocks(dk, dv, k, v, q_src, do_src, b32, h32, lse_row, delta_row, stride_qs, stride_qd,
                              stride_dos, stride_dod, offs_n, offs_d, len_q, len_k, shift, window_left, qk_scale,
                              cap_in, cap2, tl.maximum(mid_hi, share_lo), share_hi, True, CAUSAL, WINDOW, SOFTCAP,
                              TANH_APPROX, UPCAST, INPUT_PRECISION, BLOCK_M, HEAD_D, BLOCK_D, DESCRIPTORS)

    out_offs = (part.to(tl.int64) * stride_dkp + b * stride_dkb + hk * stride_dkh
                + (k_start + offs_n[:, None]) * stride_dks + offs_d[None, :])
    kv_mask = (offs_n[:, None] < len_k) & (offs_d[None, :] < HEAD_D)
    tl.store(dk_ptr + out_offs, (dk * sm_scale).to(dk_ptr.dtype.element_ty), mask=kv_mask)
    tl.store(dv_ptr + out_offs, dv.to(dv_ptr.dtype.element_ty), mask=kv_mask)


@triton.jit
def _sum_parts_kernel(parts_ptr, dk_ptr, dv_ptr, N, PARTS, BLOCK: tl.constexpr):
    """dK (program_id(1) 0) and dV (1): element i of their storage is the sum over p, in order,
    of the float32 parts[program_id(1), p, i], stored in their dtype."""
    which = tl.program_id(1)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    n = tl.full((), N, tl.int64)
    src = parts_ptr + which.to(tl.int64) * PARTS * n + offs
    acc = tl.load(src, mask=mask, other=0.0)
    for p in range(1, PARTS):
        acc += tl.load(src + p * n, mask=mask, other=0.0)
    if which == 0:
        tl.store(dk_ptr + offs, acc.to(dk_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(dv_ptr + offs, acc.to(dv_ptr.dtype.element_ty), mask=mask)


@runtime.autotune(configs=_dq_configs(), prune_configs_by={"early_config_prune": _prune_dq})
@triton.jit
def _attention_bwd_dq_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, o_ptr, dlse_ptr, lse_ptr, delta_ptr, dq_ptr, cu_q_ptr, cu_k_ptr,
    stride_qb, stride_qh, stride_qs, stride_qd,
    stride_kb, stride_kh, stride_ks, stride_kd,
    stride_vb, stride_vh, stride_vs, stride_vd,
    stride_dob, stride_doh, stride_dos, stride_dod,
    stride_ob, stride_oh, stride_os,
    stride_dqb, stride_dqh, stride_dqs, stride_lb, stride_lh,
    H, H_kv, S_q, S_k, sm_scale, softcap, window_left,
    HEAD_D: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr, VARLEN: tl.constexpr,
    SOFTCAP: tl.constexpr, TANH_APPROX: tl.constexpr,
    UPCAST: tl.constexpr, INPUT_PRECISION: tl.constexpr, DESCRIPTORS: tl.constexpr, HAS_DLSE: tl.constexpr,
    GROUP_PROGRAMS: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """dQ of one query block: streams the key blocks of the band, as the forward does. It also
    computes the block's delta = rowsum(dO * O) - dlse (it holds dO already) and stores it for
    the dK/dV kernel, which runs after it: no separate pass over O and dO. With DESCRIPTORS, K
    and V blocks come through tensor descriptors."""
    b, h, hk, q_start, len_q, k_start, len_k, start_m = _query_block(H, H_kv, S_q, S_k, cu_q_ptr, cu_k_ptr,
                                                                     CAUSAL, VARLEN, BLOCK_M, GROUP_PROGRAMS)
    if VARLEN:
        if start_m >= len_q:
            return
    k_src = _stream_source(k_ptr, b, hk, k_start, stride_kb, stride_kh, stride_ks, DESCRIPTORS)
    v_src = _stream_source(v_ptr, b, hk, k_start, stride_vb, stride_vh, stride_vs, DESCRIPTORS)
    b32, hk32 = b.to(tl.int32), hk.to(tl.int32)

    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    q_base = q_ptr + b * stride_qb + q_start * stride_qs + h * stride_qh
    do_base = do_ptr + b * stride_dob + q_start * stride_dos + h * stride_doh
    q = _load_tile(q_base, offs_m, offs_d, stride_qs, stride_qd, len_q, True, UPCAST, HEAD_D, BLOCK_D)
    do = _load_tile(do_base, offs_m, offs_d, stride_dos, stride_dod, len_q, True, UPCAST, HEAD_D, BLOCK_D)
    o = _load_tile(o_ptr + b * stride_ob + q_start * stride_os + h * stride_oh, offs_m, offs_d, stride_os, 1,
                   len_q, True, UPCAST, HEAD_D, BLOCK_D)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    row_offs = b * stride_lb + h * stride_lh + q_start + offs_m
    if HAS_DLSE:
        delta -= tl.load(dlse_ptr + row_offs, mask=offs_m < len_q, other=0.0)
    tl.store(delta_ptr + row_offs, delta, mask=offs_m < len_q)
    lse2 = tl.load(lse_ptr + row_offs, mask=offs_m < len_q, other=0.0) * 1.4426950408889634
    qk_scale = sm_scale * 1.4426950408889634
    cap_in, cap2 = sm_scale / softcap, softcap * 1.4426950408889634
    shift = len_k - len_q

    dq = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    lo, hi = _key_range(start_m, len_k, shift, window_left, BLOCK_M, BLOCK_N, CAUSAL, WINDOW)
    mid_lo, mid_hi = _unmasked_range(start_m, lo, hi, len_k, shift, window_left, BLOCK_M, BLOCK_N, CAUSAL, WINDOW)
    dq = _dq_blocks(dq, q, do, lse2, delta, k_src, v_src, b32, hk32, stride_ks, stride_kd, stride_vs, stride_vd,
                    offs_m, offs_d, len_q, len_k, shift, window_left, qk_scale, cap_in, cap2, lo, mid_lo,
                    True, CAUSAL, WINDOW, SOFTCAP, TANH_APPROX, UPCAST, INPUT_PRECISION, BLOCK_N, HEAD_D, BLOCK_D,
                    DESCRIPTORS)
    dq = _dq_blocks(dq, q, do, lse2, delta, k_src, v_src, b32, hk32, stride_ks, stride_kd, stride_vs, stride_vd,
                    offs_m, offs_d, len_q, len_k, shift, window_left, qk_scale, cap_in, cap2, mid_lo, mid_hi,
                    False, CAUSAL, WINDOW, SOFTCAP, TANH_APPROX, UPCAST, INPUT_PRECISION, BLOCK_N, HEAD_D, BLOCK_D,
                    DESCRIPTORS)
    dq = _dq_blocks(dq, q, do, lse2, delta, k_src, v_src, b32, hk32, stride_ks, stride_kd, stride_vs, stride_vd,
                    offs_m, offs_d, len_q, len_k, shift, window_left, qk_scale, cap_in, cap2, mid_hi, hi,
                    True, CAUSAL, WINDOW, SOFTCAP, TANH_APPROX, UPCAST, INPUT_PRECISION, BLOCK_N, HEAD_D, BLOCK_D,
                    DESCRIPTORS)

    dq_offs = b * stride_dqb + h * stride_dqh + (q_start + offs_m[:, None]) * stride_dqs + offs_d[None, :]
    q_mask = (offs_m[:, None] < len_q) & (offs_d[None, :] < HEAD_D)
    tl.store(dq_ptr + dq_offs, (dq * sm_scale).to(dq_ptr.dtype.element_ty), mask=q_mask)


def _constexprs(q: torch.Tensor, causal: bool, window: int, varlen: bool, softcap: float) -> dict:
    D = q.shape[-1]
    return dict(HEAD_D=D, CAUSAL=causal, WINDOW=window != NO_WINDOW, VARLEN=varlen, SOFTCAP=softcap != NO_SOFTCAP,
                TANH_APPROX=tanh_approx(q.dtype),
                UPCAST=runtime.INTERPRET and q.dtype == torch.bfloat16,
                # Causal: two programs per SM in a head group (see _grouped_block); otherwise
                # every block costs the same and one head at a time keeps the most in L2.
                GROUP_PROGRAMS=2 * runtime.num_sms(q.device.index or 0) if causal else 1,
                INPUT_PRECISION=runtime.input_precision(q.dtype), BLOCK_D=max(16, runtime.next_power_of_2(D)))


def kernel_softcap(softcap: float) -> float:
    """The kernels' softcap argument: without a cap (SOFTCAP off) 1.0, which they divide by unused."""
    return 1.0 if softcap == NO_SOFTCAP else softcap


def _tune_key(q: torch.Tensor, S_q: int, S_k: int, causal: bool, window: int, varlen: bool, softcap: float,
              sinks: bool = False) -> tuple:
    # Lengths change from call to call (varlen batches, generation): tune once per power-of-two
    # bucket, not once per length. Every constexpr variant has a key of its own: a warm-up of one
    # variant must not find another's entry and skip its compile.
    S_q, S_k = runtime.next_power_of_2(S_q), runtime.next_power_of_2(S_k)
    return (q.dtype, S_q, S_k, q.shape[-1], causal, window != NO_WINDOW, varlen, softcap != NO_SOFTCAP, sinks)


def _descriptors_fit(lay: "_Layout", kernel: str, *tensors: torch.Tensor) -> bool:
    """Whether `kernel` reads its streamed tiles through TMA descriptors: where they pay
    (scripts/sweep_attention.py: 3-9% at head dim 128 in every kernel and in the forward and dQ
    at 64; the dK/dV kernel's 32-row tiles at 64 lose 7%), on a dense batch (a packed one's
    sequences end inside the tensor, where TMA would not zero the rows past them), and tensors
    as TMA wants them: a 16-byte aligned base, a unit last stride, every other stride positive
    and 16-byte aligned."""
    if lay.varlen or lay.D not in ((128,) if kernel == "dkdv" else (64, 128)):
        return False
    for t in tensors:
        align = 16 // t.element_size()
        if t.data_ptr() % 16 or t.stride(-1) != 1 or any(st <= 0 or st % align for st in t.stride()[:-1]):
            return False
    return True


def _descriptors(args: tuple, positions: tuple[int, ...], shapes: tuple[tuple, ...], rows: int) -> tuple:
    """args with the tensors at `positions`, of (B, H, S, D) `shapes`, replaced by descriptors
    read in (1, 1, rows, D) boxes."""
    args = list(args)
    for i, shape in zip(positions, shapes):
        t = args[i]
        args[i] = TensorDescriptor(t, list(shape), [*t.stride()[:3], 1], [1, 1, rows, shape[3]])
    return tuple(args)


def _launch(launcher: runtime.TunedLauncher, key: tuple, grid, args: tuple, consts: dict,
            streamed: tuple[tuple[int, ...], tuple[tuple, ...], str] | None):
    """Launch a kernel; `streamed` = (positions, shapes, block) when the tensors at `positions`
    go in as descriptors whose boxes have config[block] rows (else None: pointer loads); each
    candidate config is timed with its own.

    Returns a replay `(args) -> None` that issues the same launch for new arguments of this
    call's signature (the same scalars; tensors of the same shapes, strides, dtypes and
    alignment), or None in compile_ahead's thread."""
    if streamed is None:
        launched = launcher(key, grid, *args, **consts, DESCRIPTORS=False)
        if launched is None:
            return None
        entry, config_grid = launched
        return lambda new_args: launcher.launch.replay(entry, config_grid, *new_args)
    positions, shapes, block = streamed
    consts = dict(consts, DESCRIPTORS=True)

    fitted_args = []

    def fitted(config):
        fitted_args[:] = _descriptors(args, positions, shapes, config[block])
        return tuple(fitted_args), consts

    launched = launcher(key, grid, *args, **consts, fitted=fitted)
    if launched is None:
        return None
    entry, config_grid = launched
    descriptors = [(i, fitted_args[i]) for i in positions]

    def replay(new_args):
        new_args = list(new_args)
        for i, desc in descriptors:
            new_args[i] = runtime.rebased(desc, new_args[i])
        launcher.launch.replay(entry, config_grid, *new_args)

    return replay


def _bwd_tensors(q, k, v, do, o, dlse, lse, delta, dq, dk, dv, cu_seqlens_q, cu_seqlens_k) -> tuple[tuple, tuple]:
    """The dQ and dK/dV kernels' tensor arguments, in their order; without a gradient of lse, the
    dQ kernel reads the delta buffer in its place (HAS_DLSE off)."""
    return ((q, k, v, do, o, delta if dlse is None else dlse, lse, delta, dq, cu_seqlens_q, cu_seqlens_k),
            (q, k, v, do, lse, delta, dk, dv, cu_seqlens_q, cu_seqlens_k))


class _Layout:
    """Sizes and kernel strides of a padded (B, H, S, D) or packed (total, H, D) batch. A packed
    tensor's batch stride is 0 (sequences are found through cu_seqlens); S_q, S_k are then the
    max_seqlen bounds. Outputs O, dQ, dK, dV have a unit head-dim stride (_empty_as); lse is
    (B, H, S_q) or (H, total_q)."""

    def __init__(self, q, k, cu_seqlens_q, max_seqlen_q, max_seqlen_k):
        self.varlen = cu_seqlens_q is not None
        if self.varlen:
            self.B = cu_seqlens_q.shape[0] - 1
            self.H, self.H_kv, self.D = q.shape[1], k.shape[1], q.shape[2]
            self.S_q, self.S_k = max_seqlen_q, max_seqlen_k
            self.lse_shape = (self.H, q.shape[0])
        else:
            self.B, self.H, self.S_q, self.D = q.shape
            self.H_kv, self.S_k = k.shape[1], k.shape[2]
            self.lse_shape = (self.B, self.H, self.S_q)

    def strides(self, t: torch.Tensor) -> tuple:
        """(batch, head, seq, head_dim) strides of an input or output tensor."""
        if self.varlen:
            return 0, t.stride(1), t.stride(0), t.stride(2)
        return t.stride()

    def lse_strides(self, lse: torch.Tensor) -> tuple:
        return (0, lse.stride(0)) if self.varlen else lse.stride()[:2]


def _empty_as(t: torch.Tensor) -> torch.Tensor:
    """An output laid out like the input t, with the unit head-dim stride the kernels store with.
    HF hands over q, k, v as (B, H, S, D) views of (B, S, H, D) projections: O and dQ, dK, dV
    laid out the same way make the caller's transpose back to (B, S, H * D) a view, not a copy."""
    out = runtime.empty_like(t)
    return out if out.stride(-1) == 1 else runtime.empty(t.shape, t.dtype, t.device)


def _dkdv_parts(lay: "_Layout", device: torch.device) -> int:
    """How many programs share out a kv head's query heads in the dK/dV kernel. Its grid has one
    program per key block and kv head; with few kv heads that is too few programs to balance a
    causal band (docs/attention.md, "GQA backward"). Runs of equal length, at most the group."""
    group = lay.H // lay.H_kv
    programs = runtime.cdiv(lay.S_k, DKDV_PARTS_BLOCK_N) * lay.B * lay.H_kv
    if programs == 0:  # no keys or no sequences: nothing to launch
        return 1
    wanted = min(group, runtime.cdiv(DKDV_PARTS_PROGRAMS_PER_SM * runtime.num_sms(device.index or 0), programs))
    return runtime.cdiv(group, runtime.cdiv(group, wanted))


def _dkdv_outputs(k: torch.Tensor, parts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dk, dv, where the dK/dV kernel writes dk, where it writes dv): the outputs themselves, or
    with several parts two runs of `parts` float32 copies of them in the stream's workspace."""
    dk, dv = _empty_as(k), _empty_as(k)
    if parts == 1:
        return dk, dv, dk, dv
    scratch = runtime.workspace(k.device, 2 * parts * dk.numel())[: 2 * parts * dk.numel()].view(2, -1)
    return dk, dv, scratch[0], scratch[1]


def _sum_parts(dk: torch.Tensor, dv: torch.Tensor, dk_parts: torch.Tensor, parts: int):
    """Launch _sum_parts_kernel (dk and dv dense, as _empty_as makes them); its entry and grid."""
    grid = (runtime.cdiv(dk.numel(), SUM_PARTS_BLOCK), 2)
    return _launch_sum_parts(grid, dk_parts, dk, dv, dk.numel(), parts, BLOCK=SUM_PARTS_BLOCK, num_warps=4), grid


_launch_fwd = runtime.TunedLauncher(_attention_fwd_kernel)
_launch_dkdv = runtime.TunedLauncher(_attention_bwd_dkdv_kernel)
_launch_dq = runtime.TunedLauncher(_attention_bwd_dq_kernel)
_launch_sum_parts = runtime.FastLaunch(_sum_parts_kernel)


def _fake_attention_fwd(q, k, v, causal, scale, window, cu_seqlens_q=None, cu_seqlens_k=None,
                        max_seqlen_q=0, max_seqlen_k=0, softcap=NO_SOFTCAP, sinks=None):
    lse_shape = (q.shape[1], q.shape[0]) if cu_seqlens_q is not None else q.shape[:3]
    return _empty_as(q), q.new_empty(lse_shape, dtype=torch.float32)


@runtime.custom_op("attention_fwd", fake=_fake_attention_fwd)
@runtime.planned(key=runtime.tf32_switch)
def attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
                  window: int, cu_seqlens_q: torch.Tensor | None = None, cu_seqlens_k: torch.Tensor | None = None,
                  max_seqlen_q: int = 0, max_seqlen_k: int = 0, softcap: float = NO_SOFTCAP,
                  sinks: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(O, lse): O laid out like q (_empty_as), lse float32 natural log, (B, H, S_q) or for a
    packed batch (H, total_q). `window` is the left window size, or NO_WINDOW; `softcap` the
    logits' cap, or NO_SOFTCAP; `sinks` (H,) a logit per head that joins the denominators.

    The first calls of a layout tune and plan the launch; later ones replay it (runtime.planned):
    on the H100 machine's host, whose Python runs a forward+backward's wrappers in about as long
    as the GPU runs B8 H16 S2048 D64 causal, that is what keeps such a call bound by the GPU."""
    lay = _Layout(q, k, cu_seqlens_q, max_seqlen_q, max_seqlen_k)
    o = _empty_as(q)
    lse = runtime.empty(lay.lse_shape, torch.float32, q.device)
    if o.numel() == 0 or lay.S_q == 0:
        lse.fill_(-math.inf)
        return o, lse
    scalars = (*lay.strides(q), *lay.strides(k), *lay.strides(v), *lay.strides(o)[:3], *lay.lse_strides(lse),
               lay.H, lay.H_kv, lay.S_q, lay.S_k, scale, kernel_softcap(softcap), window)
    # Without sinks the kernel never reads its pointer: lse stands in.
    args = (q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, lse if sinks is None else sinks, *scalars)
    kv_shape = (lay.B, lay.H_kv, lay.S_k, lay.D)
    replay = _launch(_launch_fwd, _tune_key(q, lay.S_q, lay.S_k, causal, window, lay.varlen, softcap,
                                            sinks is not None),
                     lambda meta: (runtime.cdiv(lay.S_q, meta["BLOCK_M"]) * lay.B * lay.H,), args,
                     dict(_constexprs(q, causal, window, lay.varlen, softcap), HAS_SINKS=sinks is not None),
                     ((1, 2), (kv_shape, kv_shape), "BLOCK_N") if _descriptors_fit(lay, "fwd", k, v) else None)
    if replay is not None:
        runtime.keep_plan(functools.partial(_replay_fwd, lay.lse_shape, scalars, replay))
    return o, lse


def _replay_fwd(lse_shape, scalars, replay, q, k, v, causal, scale, window, cu_seqlens_q=None, cu_seqlens_k=None,
                max_seqlen_q=0, max_seqlen_k=0, softcap=NO_SOFTCAP, sinks=None):
    o, lse = _empty_as(q), runtime.empty(lse_shape, torch.float32, q.device)
    replay((q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, lse if sinks is None else sinks, *scalars))
    return o, lse


def _fake_attention_bwd(do, dlse, q, k, v, o, lse, causal, scale, window, cu_seqlens_q=None,
                        cu_seqlens_k=None, max_seqlen_q=0, max_seqlen_k=0, softcap=NO_SOFTCAP):
    return _empty_as(q), _empty_as(k), _empty_as(k), torch.empty_like(lse)


@runtime.custom_op("attention_bwd", fake=_fake_attention_bwd)
@runtime.planned(key=runtime.tf32_switch)
def attention_bwd(do: torch.Tensor, dlse: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor,
                  v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor, causal: bool, scale: float,
                  window: int, cu_seqlens_q: torch.Tensor | None = None, cu_seqlens_k: torch.Tensor | None = None,
                  max_seqlen_q: int = 0, max_seqlen_k: int = 0,
                  softcap: float = NO_SOFTCAP) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dQ, dK, dV, delta): dQ, dK, dV laid out like q, k and k (dK and dV share strides in the
    kernel), from dO (any strides), the optional gradient of lse and the forward's O (unit head-dim
    stride) and lse; delta = rowsum(dO O) - dlse per row, lse's shape (what sinks' gradient
    needs; the kernels need no other change for sinks, lse including them). Planned and replayed
    as attention_fwd."""
    if dlse is not None and dlse.stride() != lse.stride():
        dlse = dlse.contiguous()
    lay = _Layout(q, k, cu_seqlens_q, max_seqlen_q, max_seqlen_k)
    parts = _dkdv_parts(lay, q.device)
    dq = _empty_as(q)
    dk, dv, dk_out, dv_out = _dkdv_outputs(k, parts)
    if dq.numel() == 0 or dk.numel() == 0 or lay.S_q == 0 or lay.S_k == 0:
        dq.zero_()
        dk.zero_()
        dv.zero_()
        # No key: O is 0, so delta is -dlse.
        return dq, dk, dv, torch.zeros_like(lse) if dlse is None else -dlse
    consts = _constexprs(q, causal, window, lay.varlen, softcap)
    delta = runtime.empty(lse.shape, torch.float32, q.device)
    strides = (*lay.strides(q), *lay.strides(k), *lay.strides(v), *lay.strides(do))
    scalars = (lay.H, lay.H_kv, lay.S_q, lay.S_k, scale, kernel_softcap(softcap), window)
    key = _tune_key(q, lay.S_q, lay.S_k, causal, window, lay.varlen, softcap)
    lse_strides = lay.lse_strides(lse)
    q_shape, kv_shape = (lay.B, lay.H, lay.S_q, lay.D), (lay.B, lay.H_kv, lay.S_k, lay.D)
    dq_tensors, dkdv_tensors = _bwd_tensors(q, k, v, do, o, dlse, lse, delta, dq, dk_out, dv_out, cu_seqlens_q,
                                            cu_seqlens_k)
    # dQ first: it writes the delta that the dK/dV kernel reads.
    dq_scalars = (*strides, *lay.strides(o)[:3], *lay.strides(dq)[:3], *lse_strides, *scalars)
    dq_args = (*dq_tensors, *dq_scalars)
    dq_replay = _launch(_launch_dq, key, lambda meta: (runtime.cdiv(lay.S_q, meta["BLOCK_M"]) * lay.B * lay.H,),
                        dq_args, dict(consts, HAS_DLSE=dlse is not None),
                        ((1, 2), (kv_shape, kv_shape), "BLOCK_N") if _descriptors_fit(lay, "dq", k, v) else None)
    dkdv_scalars = (*strides, *lay.strides(dk)[:3], dk.numel(), *lse_strides, *scalars, parts)
    dkdv_args = (*dkdv_tensors, *dkdv_scalars)
    dkdv_replay = _launch(_launch_dkdv, key,
                          lambda meta: (runtime.cdiv(lay.S_k, meta["BLOCK_N"]) * lay.B * lay.H_kv * parts,),
                          # Few programs (why there are parts): the longest blocks of every head first.
                          dkdv_args, dict(consts, GROUP_PROGRAMS=0) if parts > 1 else consts,
                          ((0, 3), (q_shape, q_shape), "BLOCK_M") if _descriptors_fit(lay, "dkdv", q, do) else None)
    sums = _sum_parts(dk, dv, dk_out, parts) if parts > 1 else None
    if dq_replay is not None and dkdv_replay is not None and (sums is None or sums[0] is not None):
        runtime.keep_plan(functools.partial(_replay_bwd, dq_scalars, dq_replay, dkdv_scalars, dkdv_replay, parts,
                                            sums))
    return dq, dk, dv, delta


def _replay_bwd(dq_scalars, dq_replay, dkdv_scalars, dkdv_replay, parts, sums, do, dlse, q, k, v, o, lse, causal,
                scale, window, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=0, max_seqlen_k=0,
                softcap=NO_SOFTCAP):
    if dlse is not None and dlse.stride() != lse.stride():
        dlse = dlse.contiguous()
    dq = _empty_as(q)
    dk, dv, dk_out, dv_out = _dkdv_outputs(k, parts)
    delta = runtime.empty(lse.shape, torch.float32, q.device)
    dq_tensors, dkdv_tensors = _bwd_tensors(q, k, v, do, o, dlse, lse, delta, dq, dk_out, dv_out, cu_seqlens_q,
                                            cu_seqlens_k)
    dq_replay((*dq_tensors, *dq_scalars))
    dkdv_replay((*dkdv_tensors, *dkdv_scalars))
    if sums is not None:
        entry, grid = sums
        _launch_sum_parts.replay(entry, grid, dk_out, dk, dv, dk.numel(), parts)
    return dq, dk, dv, delta


class AttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, scale, window, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                softcap, sinks):
        o, lse = attention_fwd(q, k, v, causal, scale, window, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                               max_seqlen_k, softcap, sinks)
        # The backward's kernels (several configs each) compile while the forward goes on, with
        # O standing in for dO: a first training step's warm-up.
        runtime.compile_ahead(("attention_bwd", q.dtype, q.shape[-1], causal, window != NO_WINDOW,
                               cu_seqlens_q is None, softcap != NO_SOFTCAP),
                              attention_bwd, o, None, q, k, v, o, lse, causal, scale, window, cu_seqlens_q,
                              cu_seqlens_k, max_seqlen_q, max_seqlen_k, softcap)
        # An unused output's gradient arrives as None, not as zeros to read.
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, sinks)
        ctx.args = (causal, scale, window)
        ctx.max_seqlens = (max_seqlen_q, max_seqlen_k)
        ctx.softcap = softcap
        return o, lse

    @staticmethod
    def backward(ctx, do, dlse):
        q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, sinks = ctx.saved_tensors
        if do is None:
            do = torch.zeros_like(o)
        dq, dk, dv, delta = attention_bwd(do, dlse, q, k, v, o, lse, *ctx.args, cu_seqlens_q, cu_seqlens_k,
                                          *ctx.max_seqlens, ctx.softcap)
        dsinks = _sinks_grad(sinks, lse, delta) if ctx.needs_input_grad[11] else None
        return dq, dk, dv, None, None, None, None, None, None, None, None, dsinks


def _sinks_grad(sinks: torch.Tensor, lse: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """d loss / d sinks[h] = -sum over the head's rows of P(sink) delta, P(sink) = exp(sink - lse)
    (the sink's value is 0, so its dP is 0; docs/attention.md, "Sinks"). lse is (B, H, S_q) or
    (H, total_q): the head is the last-but-one dimension of both, and sinks[:, None] lines up."""
    per_row = torch.exp(sinks.float()[:, None] - lse) * delta
    return -(per_row.sum(1) if lse.dim() == 2 else per_row.sum((0, 2))).to(sinks.dtype)


# Per cu_seqlens tensor: (its version counter, [first, last, shortest, longest length]); read
# once per tensor and in-place version, so that a packed batch's tensor reused by every layer
# costs one host read (one synchronization on a GPU), not one per call.
_CU_SEQLENS_FACTS = torch.utils.weak.WeakIdKeyDictionary()


def _cu_seqlens_facts(cu: torch.Tensor) -> list[int]:
    version = None if cu.is_inference() else cu._version
    cached = _CU_SEQLENS_FACTS.get(cu)
    if cached is not None and version is not None and cached[0] == version:
        return cached[1]
    lengths = cu.diff()
    if lengths.numel():
        facts = torch.stack([cu[0], cu[-1], lengths.min(), lengths.max()]).tolist()
    else:
        facts = [cu[0].item(), cu[0].item(), 0, 0]
    if version is not None:
        _CU_SEQLENS_FACTS[cu] = (version, facts)
    return facts


def _check_varlen(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) -> None:
    """Shapes, dtypes and devices, then the values of cu_seqlens: they must start at 0, not
    decrease, end at q's and k's row counts, and fit max_seqlen_q / max_seqlen_k. The values are
    read once per cu_seqlens tensor (and per in-place change of it); under torch.compile and
    during CUDA graph capture they are trusted, as flash-attn trusts them (the graph cannot
    branch on data)."""
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if cu is None:
            raise ValueError(f"{name} is None: a packed batch needs both cu_seqlens_q and cu_seqlens_k")
        if not isinstance(cu, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(cu).__name__}")
        if cu.dtype != torch.int32:
            raise TypeError(f"{name} must be int32, got {cu.dtype}")
        if cu.dim() != 1 or cu.shape[0] < 1:
            raise ValueError(f"{name} must be 1-D of shape (batch + 1,), got shape {tuple(cu.shape)}")
        if cu.device != q.device:
            raise ValueError(f"{name} is on {cu.device} but q is on {q.device}")
    if cu_seqlens_q.shape[0] != cu_seqlens_k.shape[0]:
        raise ValueError(f"cu_seqlens_q has batch {cu_seqlens_q.shape[0] - 1} but cu_seqlens_k has "
                         f"{cu_seqlens_k.shape[0] - 1} (their batch sizes differ)")
    for name, m in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if isinstance(m, bool) or not isinstance(m, int) or m < 0:
            raise ValueError(f"{name} must be a non-negative int with cu_seqlens, got {m!r}")
    if torch.compiler.is_compiling() or (q.is_cuda and torch.cuda.is_current_stream_capturing()):
        return
    for name, cu, total, m, of in (("cu_seqlens_q", cu_seqlens_q, q.shape[0], max_seqlen_q, "q"),
                                   ("cu_seqlens_k", cu_seqlens_k, k.shape[0], max_seqlen_k, "k")):
        first, last, shortest, longest = _cu_seqlens_facts(cu)
        if first != 0 or shortest < 0:
            raise ValueError(f"{name} must start at 0 and not decrease, got {cu.tolist()}")
        if last != total:
            raise ValueError(f"{name}[-1] is {last} but {of} has {total} rows (shape[0])")
        if longest > m:
            raise ValueError(f"max_seqlen_{of} is {m} but a sequence of cu_seqlens_{of} has {longest} rows")


def _check_inputs(q, k, v, causal, scale, window, varlen=False, softcap=None, sinks=None) -> tuple[float, int, float]:
    dims, layout = (3, "(total, heads, head_dim)") if varlen else (4, "(batch, heads, seq, head_dim)")
    for name, t in (("q", q), ("k", k), ("v", v)):
        runtime.check_tensor(name, t, DTYPES)
        if t.dim() != dims:
            raise ValueError(f"{name} must be {dims}-D {layout}, got shape {tuple(t.shape)}")
    runtime.check_same_device(q=q, k=k, v=v)
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise TypeError(f"{name} has dtype {t.dtype} but q has {q.dtype}")
    if k.shape != v.shape:
        raise ValueError(f"v must have k's shape {tuple(k.shape)}, got {tuple(v.shape)}")
    if varlen:
        B, (_, H, D), H_kv = 1, q.shape, k.shape[1]
    else:
        B, H, _, D = q.shape
        H_kv = k.shape[1]
        if k.shape[0] != B:
            raise ValueError(f"k has batch {k.shape[0]} but q has {B}")
    if k.shape[-1] != D:
        raise ValueError(f"k has head_dim {k.shape[-1]} but q has {D} (mismatched head dims)")
    if D not in HEAD_DIMS:
        raise ValueError(f"q has head_dim {D}; supported: {', '.join(map(str, HEAD_DIMS))}")
    if H_kv == 0 or H % H_kv != 0:
        raise ValueError(f"q's heads ({H}) must be a multiple of k's heads ({H_kv}) (H % H_kv == 0)")
    if B * max(H, 1) > 65535:
        raise ValueError(f"batch * heads of q must be at most 65535 (one grid axis), got {B * H}")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if scale is None:
        scale = 1.0 / math.sqrt(D)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
        # The kernels take a row's max before scaling (the scale folds into the exponent's FMA).
        raise ValueError(f"scale must be a positive finite float or None, got {scale!r}")
    if window is None:
        window = NO_WINDOW
    elif isinstance(window, bool) or not isinstance(window, int) or window < 0:
        raise ValueError(f"window must be None or a non-negative int (keys to the left), got {window!r}")
    if sinks is not None:
        check_sinks(q, sinks, H)
    return float(scale), window, check_softcap(softcap)


def check_softcap(softcap) -> float:
    """softcap as the kernels' launchers take it: a positive finite float, or NO_SOFTCAP for None."""
    if softcap is None:
        return NO_SOFTCAP
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not math.isfinite(softcap) or softcap <= 0:
        raise ValueError(f"softcap must be None or a positive finite float, got {softcap!r}")
    return float(softcap)


def check_sinks(q: torch.Tensor, sinks: torch.Tensor, heads: int) -> None:
    runtime.check_tensor("sinks", sinks, DTYPES)
    runtime.check_same_device(q=q, sinks=sinks)
    if tuple(sinks.shape) != (heads,):
        raise ValueError(f"sinks must have shape (heads,) = ({heads},), one logit per query head, "
                         f"got {tuple(sinks.shape)}")


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False, scale: float | None = None,
              window: int | None = None, return_lse: bool = False, *, cu_seqlens_q: torch.Tensor | None = None,
              cu_seqlens_k: torch.Tensor | None = None, max_seqlen_q: int | None = None,
              max_seqlen_k: int | None = None, softcap: float | None = None, sinks: torch.Tensor | None = None):
    """Softmax attention of q (B, H, S_q, D) over k, v (B, H_kv, S_k, D); H % H_kv == 0.

    scale (positive) defaults to 1/sqrt(D). causal masks keys j > i + S_k - S_q (bottom-right aligned);
    window=left also masks keys j < i + S_k - S_q - left. Rows with no allowed key give 0 and
    lse = -inf. Returns O (B, H, S_q, D), and with return_lse also lse (B, H, S_q) in float32
    (natural log), which is differentiable too.

    softcap=c caps the scaled logits as c tanh(s / c) before the mask (Gemma 2's attention).
    sinks, a (H,) tensor, gives each head one logit that joins every row's softmax denominator
    and attends to nothing (GPT-OSS): O = sum_j exp(s_j) v_j / (sum_j exp(s_j) + exp(sinks[h])),
    lse = log of that denominator (a row with no allowed key gives 0 and lse = sinks[h]); sinks
    get a gradient when they require one.

    Packed variable-length batch (flash-attn's varlen convention): with cu_seqlens_q and
    cu_seqlens_k (int32, (batch + 1,), cumulative from 0, on q's device), q is (total_q, H, D) and
    k, v are (total_k, H_kv, D); sequence b is rows cu_seqlens_q[b]:cu_seqlens_q[b+1] of q
    against rows cu_seqlens_k[b]:cu_seqlens_k[b+1] of k and v, with causal and window aligned per
    sequence (S_q, S_k above being that sequence's lengths; lengths 0 allowed). max_seqlen_q and
    max_seqlen_k (ints, required) bound the lengths. O is (total_q, H, D) and lse (H, total_q),
    flash-attn's varlen layout. The values of cu_seqlens and max_seqlen are checked, reading
    each cu_seqlens tensor once (one synchronization on a GPU, then cached until the tensor
    changes in place); under torch.compile and CUDA graph capture they are trusted, and there a
    max_seqlen below a real length silently leaves that sequence's later rows unwritten."""
    varlen = cu_seqlens_q is not None or cu_seqlens_k is not None
    scale, window, softcap = _check_inputs(q, k, v, causal, scale, window, varlen, softcap, sinks)
    if sinks is not None and sinks.stride(0) != 1:  # the kernels read sinks[h] at sinks_ptr + h
        sinks = sinks.contiguous()
    if varlen:
        _check_varlen(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
        if (cu_seqlens_q.shape[0] - 1) * q.shape[1] > 65535:
            raise ValueError(f"batch * heads must be at most 65535 (one grid axis), got "
                             f"{(cu_seqlens_q.shape[0] - 1) * q.shape[1]}")
        extra = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    else:
        for name, value in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
            if value is not None:
                raise ValueError(f"{name} is given without cu_seqlens_q / cu_seqlens_k")
        extra = (None, None, 0, 0)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad
                                    or (sinks is not None and sinks.requires_grad)):
        o, lse = runtime.apply(AttentionFunction, q, k, v, causal, scale, window, *extra, softcap, sinks)
    else:
        o, lse = attention_fwd(q, k, v, causal, scale, window, *extra, softcap, sinks)
    return (o, lse) if return_lse else o


def attention_mask(S_q: int, S_k: int, causal: bool, window: int | None, device) -> torch.Tensor:
    """(S_q, S_k) bool: which keys each query may attend."""
    i = torch.arange(S_q, device=device)[:, None]
    j = torch.arange(S_k, device=device)[None, :]
    shift = S_k - S_q
    ok = torch.ones(S_q, S_k, dtype=torch.bool, device=device)
    if causal:
        ok &= j <= i + shift
    if window is not None:
        ok &= j >= i + shift - window
    return ok


def attention_reference(q, k, v, causal=False, scale=None, window=None, return_lse=False, *, cu_seqlens_q=None,
                        cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, softcap=None, sinks=None):
    """Plain torch in the inputs' dtype, k and v heads repeated. Rows with no allowed key give
    0 (not the nan of a softmax over all -inf) and lse = -inf (with sinks, the sink), as the
    kernels do. A packed batch (cu_seqlens) is a loop over its sequences, each a padded call of
    batch 1."""
    if cu_seqlens_q is not None:
        outs, lses = [], []
        bounds = zip(cu_seqlens_q.tolist()[:-1], cu_seqlens_q.tolist()[1:],
                     cu_seqlens_k.tolist()[:-1], cu_seqlens_k.tolist()[1:])
        for q0, q1, k0, k1 in bounds:
            o, lse = attention_reference(*(t[a:b].transpose(0, 1)[None] for t, a, b in
                                           ((q, q0, q1), (k, k0, k1), (v, k0, k1))),
                                         causal=causal, scale=scale, window=window, return_lse=True,
                                         softcap=softcap, sinks=sinks)
            outs.append(o[0].transpose(0, 1))
            lses.append(lse[0])
        o = torch.cat(outs) if outs else q.new_empty(q.shape)
        lse = torch.cat(lses, dim=1) if lses else q.new_empty((q.shape[1], 0))
        return (o, lse) if return_lse else o
    D = q.shape[-1]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    s = (q @ k.transpose(-1, -2)) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    ok = attention_mask(q.shape[2], k.shape[2], causal, window, q.device)
    if sinks is not None:
        s = s.masked_fill(~ok, -math.inf)
        sink = sinks.to(s.dtype)[None, :, None, None].expand(*s.shape[:3], 1)
        with_sink = torch.cat([s, sink], dim=-1)
        o = torch.softmax(with_sink, dim=-1)[..., :-1] @ v
        return (o, torch.logsumexp(with_sink, dim=-1)) if return_lse else o
    any_key = ok.any(-1, keepdim=True)
    s = s.masked_fill(~ok, -math.inf).masked_fill(~any_key, 0.0)
    o = torch.softmax(s, dim=-1).masked_fill(~any_key, 0.0) @ v
    if not return_lse:
        return o
    lse = torch.logsumexp(s, dim=-1).masked_fill(~any_key[:, 0], -math.inf)
    return o, lse
