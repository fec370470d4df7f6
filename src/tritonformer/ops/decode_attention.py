"""Decode attention (flash-decoding): 1 to 16 new query tokens per sequence against a KV cache.

    q (B, H, S_q, D), k_cache and v_cache (B, H_kv, S_max, D) (any strides; H % H_kv == 0),
    seq_lens (B,) int32 on the device: sequence b's keys are k_cache[b, :, :seq_lens[b]] and its
    S_q queries are the last S_q of them (query t at position seq_lens[b] - S_q + t sees the
    keys up to itself, and with window=w none more than w before it: attention's bottom-right
    causal mask). Out (B, H, S_q, D) in q's dtype. Inference only (no backward). Softcapped
    logits and sinks as attention() takes them (Gemma 2, GPT-OSS).

A prefill's kernel (ops/attention.py) has one program per query block and head: at S_q = 1 that
is B x H programs, each reading a whole sequence of keys, too few to stream a long cache at the
memory roofline. Here one program takes the G = H / H_kv query heads of a KV head and all S_q
queries together (G x S_q rows of one tile: each key and value row is read once for all of them)
over one split of the sequence; the splits' partial outputs and log-sum-exps are combined by a
second kernel. The split count comes from S_max (no host look at seq_lens, so a CUDA graph
holds): enough programs to fill the GPU, a split of at least one key block; one split writes the
output directly. Design: docs/attention.md, "Decode".
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from .. import runtime
from .attention import LOG2E, NO_SOFTCAP, add_sink, check_sinks, check_softcap, kernel_softcap, tanh, tanh_approx

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
HEAD_DIMS = (32, 64, 96, 128, 256)
MAX_QUERIES = 16
# Programs a launch aims at per SM: several resident programs hide a program's load latency.
PROGRAMS_PER_SM = 4
# Keys a program takes at least: one key block. A decode step at batch 1 and 4 KV heads then
# spreads a 768-key cache over 48 programs of one block each, not 12 of four (6.1 us a layer
# on the H200 with 256; docs/attention.md, "Decode").
MIN_SPLIT = 64
# A split count's limit: the combine kernel reads all of a row's partial log-sum-exps at once.
MAX_SPLITS = 128
# Splits the combine kernel sums at a time.
COMBINE_SPLITS = 16


@triton.jit
def _decode_split_kernel(
    q_ptr, k_ptr, v_ptr, lens_ptr, o_ptr, part_o_ptr, part_lse_ptr, sinks_ptr,
    stride_l, stride_qb, stride_qh, stride_qs, stride_qd,
    stride_kb, stride_kh, stride_ks, stride_kd,
    stride_vb, stride_vh, stride_vs, stride_vd,
    stride_ob, stride_oh, stride_os,
    H_kv, S_max, split_len, qk_scale, cap_in, cap2, window,
    S_Q: tl.constexpr, GROUP: tl.constexpr, HEAD_D: tl.constexpr, HAS_LENS: tl.constexpr,
    WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, TANH_APPROX: tl.constexpr, HAS_SINKS: tl.constexpr,
    SPLITS: tl.constexpr, UPCAST: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """One (sequence, KV head, split, row block): BLOCK_M of the GROUP x S_Q query rows of the KV
    head (row r is query head hk * GROUP + r // S_Q, query t = r % S_Q) against keys
    [split * split_len, + split_len) of the sequence. With SPLITS == 1 it writes the output (the
    sink joining the denominator); otherwise the normalised partial output (fp32) and its base-2
    log-sum-exp, for the combine kernel (which adds the sink). SOFTCAP: logits
    cap2 tanh(cap_in qk), base 2."""
    bh = tl.program_id(0)
    split = tl.program_id(1)
    row_block = tl.program_id(2)
    b = bh // H_kv
    hk = bh % H_kv
    if HAS_LENS:
        seq_len = tl.minimum(tl.load(lens_ptr + b * stride_l).to(tl.int32), S_max)
    else:
        seq_len = S_max

    offs_m = row_block * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    group = offs_m // S_Q
    t = offs_m % S_Q
    row_ok = offs_m < GROUP * S_Q
    d_ok = offs_d < HEAD_D
    h = hk * GROUP + group
    q_rows = q_ptr + b * stride_qb + h * stride_qh + t * stride_qs
    q = tl.load(q_rows[:, None] + offs_d[None, :] * stride_qd, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    pos = seq_len - S_Q + t  # each row's own position: it sees keys <= pos

    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)
    lo = start
    if WINDOW:
        lo = tl.maximum(start, seq_len - S_Q - window)
    # 64-bit: a batch of long caches passes 2^31 elements (64 x 8 heads x 32k keys x 128).
    b64, hk64 = b.to(tl.int64), hk.to(tl.int64)
    k_base = k_ptr + b64 * stride_kb + hk64 * stride_kh
    v_base = v_ptr + b64 * stride_vb + hk64 * stride_vh

    m_i = tl.full((BLOCK_M,), -float("inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    for start_n in range(lo, end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_ok = offs_n < end
        kv_mask = n_ok[:, None] & d_ok[None, :]
        rows_n = offs_n[:, None].to(tl.int64)  # a sequence-major cache's key stride is B x H_kv x D
        k = tl.load(k_base + rows_n * stride_ks + offs_d[None, :] * stride_kd, mask=kv_mask, other=0.0)
        v = tl.load(v_base + rows_n * stride_vs + offs_d[None, :] * stride_vd, mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        qk = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION)
        ok = n_ok[None, :] & (offs_n[None, :] <= pos[:, None])
        if WINDOW:
            ok = ok & (offs_n[None, :] >= pos[:, None] - window)
        if SOFTCAP:
            s = cap2 * tanh(qk * cap_in, TANH_APPROX)
        else:
            s = qk * qk_scale
        s = tl.where(ok, s, -float("inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # A row that has seen no allowed key yet keeps m = -inf: subtract 0 instead (no nan).
        m_sub = tl.where(m_new == -float("inf"), 0.0, m_new)
        p = tl.exp2(s - m_sub[:, None])
        alpha = tl.exp2(m_i - m_sub)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=INPUT_PRECISION)
        m_i = m_new

    if HAS_SINKS and SPLITS == 1:
        sink2 = tl.load(sinks_ptr + h, mask=row_ok, other=0.0).to(tl.float32) * 1.4426950408889634
        acc, l_i, m_i = add_sink(acc, l_i, m_i, sink2)
    has_key = l_i > 0.0
    l_div = tl.where(has_key, l_i, 1.0)
    o = acc / l_div[:, None]
    if SPLITS == 1:
        out = o_ptr + b * stride_ob + h * stride_oh + t * stride_os
        tl.store(out[:, None] + offs_d[None, :], o.to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    else:
        lse = tl.where(has_key, m_i + tl.log2(l_div), -float("inf"))
        rows = (b * H_kv * GROUP + h) * S_Q + t  # row of the (B, H, S_Q) queries
        part = (rows * SPLITS + split).to(tl.int64)
        tl.store(part_o_ptr + part[:, None] * HEAD_D + offs_d[None, :], o, mask=row_ok[:, None] & d_ok[None, :])
        tl.store(part_lse_ptr + part, lse, mask=row_ok)


@triton.jit
def _decode_combine_kernel(part_o_ptr, part_lse_ptr, o_ptr, sinks_ptr, H, stride_ob, stride_oh, stride_os,
                           S_Q: tl.constexpr, HEAD_D: tl.constexpr, SPLITS: tl.constexpr, HAS_SINKS: tl.constexpr,
                           BLOCK_SPLITS: tl.constexpr, CHUNK: tl.constexpr, BLOCK_D: tl.constexpr):
    """One query row: out = sum_i w_i o_i / sum_i w_i, w_i = 2^(lse_i - max lse) over its splits
    (0 where no split saw a key); with HAS_SINKS the head's sink joins the denominator."""
    row = tl.program_id(0)
    t = row % S_Q
    h = (row // S_Q) % H
    b = row // (S_Q * H)
    offs_s = tl.arange(0, BLOCK_SPLITS)
    lse = tl.load(part_lse_ptr + row * SPLITS + offs_s, mask=offs_s < SPLITS, other=-float("inf"))
    m = tl.max(lse, axis=0)
    if HAS_SINKS:
        sink2 = tl.load(sinks_ptr + h).to(tl.float32) * 1.4426950408889634
        m = tl.maximum(m, sink2)
    m_sub = tl.where(m == -float("inf"), 0.0, m)
    denom = tl.sum(tl.exp2(lse - m_sub), axis=0)
    if HAS_SINKS:
        denom += tl.exp2(sink2 - m_sub)
    offs_d = tl.arange(0, BLOCK_D)
    offs_c = tl.arange(0, CHUNK)
    acc = tl.zeros((BLOCK_D,), tl.float32)
    for first in range(0, SPLITS, CHUNK):
        split = first + offs_c
        ok = split < SPLITS
        w = tl.exp2(tl.load(part_lse_ptr + row * SPLITS + split, mask=ok, other=-float("inf")) - m_sub)
        parts = tl.load(part_o_ptr + (row * SPLITS + split)[:, None].to(tl.int64) * HEAD_D + offs_d[None, :],
                        mask=ok[:, None] & (offs_d[None, :] < HEAD_D), other=0.0)
        acc += tl.sum(w[:, None] * parts, axis=0)
    out = tl.where(denom > 0.0, acc / tl.where(denom > 0.0, denom, 1.0), 0.0)
    tl.store(o_ptr + b * stride_ob + h * stride_oh + t * stride_os + offs_d, out.to(o_ptr.dtype.element_ty),
             mask=offs_d < HEAD_D)


_launch_split = runtime.FastLaunch(_decode_split_kernel)
_launch_combine = runtime.FastLaunch(_decode_combine_kernel)


def _block_m(rows: int, D: int) -> int:
    """Query rows a program: all G x S_q of a KV head up to a register budget (more rows take
    more row blocks, each reading the split's keys again)."""
    return max(16, min(runtime.next_power_of_2(rows), 64 if D <= 128 else 32))


def _block_n(D: int) -> int:
    if runtime.INTERPRET:
        return 16  # the interpreter's cost is per block op: small blocks keep test caches multi-block
    return 64 if D <= 128 else 32


def default_splits(batch: int, kv_heads: int, s_max: int, device_index: int = 0) -> int:
    """The split count for a cache of s_max keys: enough (sequence, KV head, split) programs to
    fill the GPU, each split at least MIN_SPLIT keys, at most MAX_SPLITS."""
    programs = batch * kv_heads
    want = runtime.cdiv(PROGRAMS_PER_SM * runtime.num_sms(device_index), programs)
    return max(1, min(want, runtime.cdiv(s_max, MIN_SPLIT), MAX_SPLITS))


def _output(q: torch.Tensor) -> torch.Tensor:
    """(B, H, S_q, D) laid out (B, S_q, H, D): HF's transpose back to (B, S_q, H * D) is a view."""
    B, H, S_q, D = q.shape
    return runtime.empty((B, S_q, H, D), q.dtype, q.device).transpose(1, 2)


def _buffers(q: torch.Tensor, seq_lens: torch.Tensor | None, splits: int) -> tuple:
    """(out, partial outputs, partial log-sum-exps, lengths) as the split kernel takes them: with
    one split, or without lengths, `out` stands in for the pointers the kernel then never reads."""
    B, H, S_q, D = q.shape
    out = _output(q)
    part_o = part_lse = out
    if splits > 1:
        part_o = runtime.empty((B * H * S_q * splits, D), torch.float32, q.device)
        part_lse = runtime.empty((B * H * S_q * splits,), torch.float32, q.device)
    return out, part_o, part_lse, seq_lens if seq_lens is not None else out


def _fake_decode_attention(q, k_cache, v_cache, seq_lens, scale, window, splits, softcap=NO_SOFTCAP, sinks=None):
    B, H, S_q, D = q.shape
    return q.new_empty((B, S_q, H, D)).transpose(1, 2)


@runtime.custom_op("decode_attention", fake=_fake_decode_attention)
@runtime.planned(key=runtime.tf32_switch)
def decode_attention_fwd(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         seq_lens: torch.Tensor | None, scale: float, window: int, splits: int,
                         softcap: float = NO_SOFTCAP, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """The launches (inputs checked by decode_attention). Planned: a decode step is host-bound."""
    B, H, S_q, D = q.shape
    H_kv, S_max = k_cache.shape[1], k_cache.shape[2]
    group = H // H_kv
    block_m = _block_m(group * S_q, D)
    split_len = runtime.cdiv(runtime.cdiv(S_max, splits), _block_n(D)) * _block_n(D)
    splits = max(1, runtime.cdiv(S_max, split_len))
    out, part_o, part_lse, lens = _buffers(q, seq_lens, splits)
    consts = dict(S_Q=S_q, GROUP=group, HEAD_D=D, HAS_LENS=seq_lens is not None, WINDOW=window >= 0,
                  SOFTCAP=softcap != NO_SOFTCAP, TANH_APPROX=tanh_approx(q.dtype),
                  HAS_SINKS=sinks is not None, SPLITS=splits, UPCAST=runtime.INTERPRET,
                  INPUT_PRECISION=runtime.input_precision(q.dtype),
                  BLOCK_M=block_m, BLOCK_N=_block_n(D), BLOCK_D=runtime.next_power_of_2(D))
    grid = (B * H_kv, splits, runtime.cdiv(group * S_q, block_m))
    scalars = (lens.stride(0) if seq_lens is not None else 0, *q.stride(), *k_cache.stride(), *v_cache.stride(),
               *out.stride()[:3],
               H_kv, S_max, split_len, scale * LOG2E, scale / kernel_softcap(softcap), kernel_softcap(softcap) * LOG2E,
               max(window, 0))
    # Without sinks the kernels never read their pointer: out stands in.
    sinks_arg = out if sinks is None else sinks
    split_entry = _launch_split(grid, q, k_cache, v_cache, lens, out, part_o, part_lse, sinks_arg, *scalars,
                                **consts, num_warps=4)
    combine = None
    if splits > 1:
        combine_consts = dict(S_Q=S_q, HEAD_D=D, SPLITS=splits, HAS_SINKS=sinks is not None,
                              BLOCK_SPLITS=runtime.next_power_of_2(splits), CHUNK=COMBINE_SPLITS,
                              BLOCK_D=runtime.next_power_of_2(D))
        combine = (_launch_combine((B * H * S_q,), part_o, part_lse, out, sinks_arg, H, *out.stride()[:3],
                                   **combine_consts, num_warps=4), (B * H * S_q,), (H, *out.stride()[:3]))
    if split_entry is not None:
        runtime.keep_plan(functools.partial(_replay, split_entry, grid, scalars, splits, combine))
    return out


def _replay(split_entry, grid, scalars, splits, combine, q, k_cache, v_cache, seq_lens, scale, window, _splits,
            softcap=NO_SOFTCAP, sinks=None):
    out, part_o, part_lse, lens = _buffers(q, seq_lens, splits)
    sinks_arg = out if sinks is None else sinks
    _launch_split.replay(split_entry, grid, q, k_cache, v_cache, lens, out, part_o, part_lse, sinks_arg, *scalars)
    if combine is not None:
        entry, combine_grid, combine_scalars = combine
        _launch_combine.replay(entry, combine_grid, part_o, part_lse, out, sinks_arg, *combine_scalars)
    return out


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     seq_lens: torch.Tensor | None = None, scale: float | None = None, window: int | None = None,
                     num_splits: int | None = None, softcap: float | None = None,
                     sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of the last S_q (1..16) tokens of each sequence against its KV cache; see the
    module doc. seq_lens None: every sequence fills the cache (S_max keys); a length past S_max
    counts as S_max, one shorter than S_q leaves the rows before its first key 0. num_splits overrides
    the split count (the tests' knob; default from the cache's shape and the GPU). softcap and
    sinks (H,) as attention() takes them."""
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        runtime.check_tensor(name, t, DTYPES)
        if t.dim() != 4:
            raise ValueError(f"decode_attention: {name} must be 4-D (B, heads, S, D), got shape {tuple(t.shape)}")
    runtime.check_same_device(q=q, k_cache=k_cache, v_cache=v_cache, seq_lens=seq_lens)
    runtime.check_no_grad("decode_attention", q=q, k_cache=k_cache, v_cache=v_cache)
    B, H, S_q, D = q.shape
    if not 1 <= S_q <= MAX_QUERIES:
        raise ValueError(f"decode_attention: q has {S_q} query tokens; it takes 1 to {MAX_QUERIES} (attention() "
                         "takes more)")
    if D not in HEAD_DIMS:
        raise ValueError(f"decode_attention: head dim {D} is not one of {HEAD_DIMS}")
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise TypeError(f"decode_attention: q, k_cache and v_cache must share a dtype, got {q.dtype}, "
                        f"{k_cache.dtype}, {v_cache.dtype}")
    if k_cache.shape != v_cache.shape or k_cache.shape[0] != B or k_cache.shape[3] != D:
        raise ValueError(f"decode_attention: k_cache and v_cache must have shape (B={B}, H_kv, S_max, D={D}), got "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    H_kv = k_cache.shape[1]
    if H_kv == 0 or H % H_kv:
        raise ValueError(f"decode_attention: q's {H} heads are not a multiple of the cache's {H_kv}")
    if seq_lens is not None:
        runtime.check_tensor("seq_lens", seq_lens, (torch.int32,))
        if seq_lens.shape != (B,):
            raise ValueError(f"decode_attention: seq_lens must have shape ({B},), got {tuple(seq_lens.shape)}")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 0):
        raise ValueError(f"decode_attention: window must be None or an int >= 0, got {window!r}")
    if num_splits is not None and (not isinstance(num_splits, int) or not 1 <= num_splits <= MAX_SPLITS):
        raise ValueError(f"decode_attention: num_splits must be an int in [1, {MAX_SPLITS}], got {num_splits!r}")
    softcap = check_softcap(softcap)
    if sinks is not None:
        check_sinks(q, sinks, H)
        sinks = sinks.contiguous()  # the kernels read sinks[h] at sinks_ptr + h
    S_max = k_cache.shape[2]
    if B == 0 or H == 0 or S_max == 0:
        return torch.zeros_like(q, memory_format=torch.contiguous_format)
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"decode_attention: scale must be a positive finite number, got {scale}")
    device_index = (q.device.index or 0) if q.device.type == "cuda" else 0
    splits = num_splits or default_splits(B, H_kv, S_max, device_index)
    return decode_attention_fwd(q, k_cache, v_cache, seq_lens, scale, -1 if window is None else window, splits,
                                softcap, sinks)


def decode_attention_reference(q, k_cache, v_cache, seq_lens=None, scale=None, window=None, softcap=None,
                               sinks=None):
    """decode_attention in float64 from its definition (one sequence at a time)."""
    B, H, S_q, D = q.shape
    H_kv, S_max = k_cache.shape[1], k_cache.shape[2]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    lens = [S_max] * B if seq_lens is None else [min(int(n), S_max) for n in seq_lens.tolist()]
    out = torch.zeros(B, H, S_q, D, dtype=torch.float64, device=q.device)
    for b, n in enumerate(lens):
        k = k_cache[b, :, :n].double().repeat_interleave(H // H_kv, dim=0)
        v = v_cache[b, :, :n].double().repeat_interleave(H // H_kv, dim=0)
        s = q[b].double() @ k.transpose(-1, -2) * scale
        if softcap is not None:
            s = softcap * torch.tanh(s / softcap)
        pos = torch.arange(S_q, device=q.device)[:, None] + n - S_q
        j = torch.arange(n, device=q.device)[None, :]
        allowed = j <= pos
        if window is not None:
            allowed &= j >= pos - window
        s = s.masked_fill(~allowed, float("-inf"))
        if sinks is not None:
            s = torch.cat([s, sinks.double()[:, None, None].expand(H, S_q, 1)], dim=-1)
        p = torch.softmax(s, dim=-1).nan_to_num(0.0)
        out[b] = p[..., :n] @ v
    return out
