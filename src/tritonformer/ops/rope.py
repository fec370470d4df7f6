"""Rotary position embedding (RoPE) of queries and keys, HuggingFace's rotate-half form.

q * cos + rotate_half(q) * sin, rotate_half(x) = cat(-x2, x1) for x1, x2 the halves of the head
dimension; per half, with cos = (c1, c2) and sin = (s1, s2):

    y1 = x1 * c1 - x2 * s1                 dx1 = dy1 * c1 + dy2 * s2
    y2 = x2 * c2 + x1 * s2                 dx2 = dy2 * c2 - dy1 * s1

The backward is each 2x2 block's transpose (no table of cat(freqs, freqs) form is assumed); cos and
sin get no gradient. Inputs: q and k in (B, H, S, D) or (B, S, H, D), tables (S, D), (1, S, D) or
(B, S, D). Two kernels, each forward and backward, q and k in one launch, float32 arithmetic:
(B, H, S, D) tensors whose (batch, head) slabs are contiguous take the flat kernel (tiles of whole
rows, one a program); every other layout takes the head-walking kernel (a block of positions, its
cos/sin loaded once, and a chunk of heads a program). `qkv_rope` adds the attention's input
projections as one autograd node. Design and measurements: docs/rope.md.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .. import runtime
from .norm import sum_parts

LAYOUTS = ("bhsd", "bshd")
TABLE_DTYPES = (*runtime.FLOAT_DTYPES, torch.float64)

# The head-walking kernel's (STEP_BYTES, HEADS_PER_STEP, HEADS_PER_PROGRAM, NUM_WARPS, STAGES): a
# step reads BLOCK_S positions x HEADS_PER_STEP heads (STEP_BYTES), STAGES pipelines the steps'
# loads; four heads a step and two stages won the sweep in both layouts (2.75 / 2.88 TB/s on the
# H100, docs/rope.md). A program rotates HEADS_PER_PROGRAM heads, fewer when that leaves under
# MIN_PROGRAMS_PER_SM programs an SM.
LAUNCH = (8192, 4, 8, 8, 2)
MIN_PROGRAMS_PER_SM = 4


@triton.jit
def _rotated(x1, x2, c1, c2, s1, s2, BACKWARD: tl.constexpr):
    """The two halves of a row rotated by the angle (forward) or by minus it (BACKWARD)."""
    if BACKWARD:
        return x1 * c1 + x2 * s2, x2 * c2 - x1 * s1
    return x1 * c1 - x2 * s1, x2 * c2 + x1 * s2


@triton.jit
def _rotate_heads(
    x_ptr, out_ptr, h_start, h_end, x_tile, out_tile, stride_xh, stride_xd, stride_oh, stride_od,
    c1, c2, s1, s2, tile_mask,
    HALF: tl.constexpr, HEADS_PER_STEP: tl.constexpr, BACKWARD: tl.constexpr, INDEX_64: tl.constexpr,
    STAGES: tl.constexpr,
):
    """Heads [h_start, h_end) of one block of positions. x_tile and out_tile are the block's
    (positions, 1, D/2) element offsets inside one head; c1, c2, s1, s2 its cos/sin halves."""
    step = tl.arange(0, HEADS_PER_STEP)
    for h in tl.range(h_start, h_end, HEADS_PER_STEP, num_stages=STAGES):
        heads = h + step
        mask = (heads < h_end)[None, :, None] & tile_mask
        if INDEX_64:
            heads = heads.to(tl.int64)
        x_ptrs = x_ptr + (heads * stride_xh)[None, :, None] + x_tile
        out_ptrs = out_ptr + (heads * stride_oh)[None, :, None] + out_tile
        # Both halves are loaded before either is stored: in place, out_ptr is x_ptr.
        x1 = tl.load(x_ptrs, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
        x2 = tl.load(x_ptrs + HALF * stride_xd, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
        y1, y2 = _rotated(x1, x2, c1, c2, s1, s2, BACKWARD)
        tl.store(out_ptrs, y1.to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(out_ptrs + HALF * stride_od, y2.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kernel(
    q_ptr, k_ptr, q_out_ptr, k_out_ptr, cos_ptr, sin_ptr,
    S, Hq, Hk, n_blocks, q_chunks, n_chunks, heads_per_program,
    stride_qb, stride_qh, stride_qs, stride_qd,
    stride_kb, stride_kh, stride_ks, stride_kd,
    stride_qob, stride_qoh, stride_qos, stride_qod,
    stride_kob, stride_koh, stride_kos, stride_kod,
    stride_cb, stride_cs, stride_cd,
    stride_sb, stride_ss, stride_sd,
    HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_S: tl.constexpr,
    HEADS_PER_STEP: tl.constexpr, BACKWARD: tl.constexpr, INDEX_64: tl.constexpr, STAGES: tl.constexpr,
):
    """Forward (BACKWARD=False) or backward of rotate-half RoPE; strides are given in (batch,
    head, position, dim) order whatever the layout, tables' batch stride 0 when shared."""
    pid = tl.program_id(0)
    chunk = pid % n_chunks
    block = (pid // n_chunks) % n_blocks
    b = pid // (n_chunks * n_blocks)
    rows = block * BLOCK_S + tl.arange(0, BLOCK_S)
    cols = tl.arange(0, BLOCK_HALF)
    if INDEX_64:
        b = b.to(tl.int64)
        rows = rows.to(tl.int64)
    rows = rows[:, None, None]
    cols = cols[None, None, :]
    mask = (rows < S) & (cols < HALF)

    c_ptrs = cos_ptr + b * stride_cb + rows * stride_cs + cols * stride_cd
    s_ptrs = sin_ptr + b * stride_sb + rows * stride_ss + cols * stride_sd
    c1 = tl.load(c_ptrs, mask=mask, other=0.0, eviction_policy="evict_last").to(tl.float32)
    c2 = tl.load(c_ptrs + HALF * stride_cd, mask=mask, other=0.0, eviction_policy="evict_last").to(tl.float32)
    s1 = tl.load(s_ptrs, mask=mask, other=0.0, eviction_policy="evict_last").to(tl.float32)
    s2 = tl.load(s_ptrs + HALF * stride_sd, mask=mask, other=0.0, eviction_policy="evict_last").to(tl.float32)

    if chunk < q_chunks:
        h_start = chunk * heads_per_program
        _rotate_heads(
            q_ptr + b * stride_qb, q_out_ptr + b * stride_qob, h_start, tl.minimum(h_start + heads_per_program, Hq),
            rows * stride_qs + cols * stride_qd,
            rows * stride_qos + cols * stride_qod,
            stride_qh, stride_qd, stride_qoh, stride_qod, c1, c2, s1, s2, mask,
            HALF, HEADS_PER_STEP, BACKWARD, INDEX_64, STAGES,
        )
    else:
        h_start = (chunk - q_chunks) * heads_per_program
        _rotate_heads(
            k_ptr + b * stride_kb, k_out_ptr + b * stride_kob, h_start, tl.minimum(h_start + heads_per_program, Hk),
            rows * stride_ks + cols * stride_kd,
            rows * stride_kos + cols * stride_kod,
            stride_kh, stride_kd, stride_koh, stride_kod, c1, c2, s1, s2, mask,
            HALF, HEADS_PER_STEP, BACKWARD, INDEX_64, STAGES,
        )


# ---- (B, H, S, D) with every (batch, head) slab contiguous: one flat pass over rows ----

# The flat path: q's B * Hq * S rows of D elements then k's, in tiles of whole rows, one tile a
# program, cos/sin rows reloaded per tile (L2 hits), as inductor's elementwise kernel does.
# FLAT_BHSD off sends (B, H, S, D) to the head-walking kernel too. 4 KiB tiles of q or k on 4 warps,
# no eviction hints: 2.86 TB/s at q (4, 32, 4096, 128) bf16 on the H100, against 2.73 for the
# head-walking kernel and 2.84 for torch.compile (docs/rope.md).
FLAT_BHSD = True
FLAT_TILE_BYTES = 4096
FLAT_NUM_WARPS = 4


@triton.jit
def _table_halves(cos_ptr, sin_ptr, c_rows, s_rows, cols, mask, stride_cd, stride_sd, HALF: tl.constexpr):
    """cos's and sin's two halves in float32: rows at element offsets c_rows and s_rows (one a
    row), half-row columns `cols`."""
    c_ptrs = cos_ptr + c_rows[:, None] + cols * stride_cd
    s_ptrs = sin_ptr + s_rows[:, None] + cols * stride_sd
    c1 = tl.load(c_ptrs, mask=mask, other=0.0).to(tl.float32)
    c2 = tl.load(c_ptrs + HALF * stride_cd, mask=mask, other=0.0).to(tl.float32)
    s1 = tl.load(s_ptrs, mask=mask, other=0.0).to(tl.float32)
    s2 = tl.load(s_ptrs + HALF * stride_sd, mask=mask, other=0.0).to(tl.float32)
    return c1, c2, s1, s2


@triton.jit
def _rotate_rows(
    x_ptr, out_ptr, cos_ptr, sin_ptr, tile, R, S, H,
    stride_xb, stride_xh, stride_ob, stride_oh,
    stride_cb, stride_cs, stride_cd, stride_sb, stride_ss, stride_sd,
    HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, ROWS: tl.constexpr, DENSE: tl.constexpr,
    BATCH_TABLE: tl.constexpr, BACKWARD: tl.constexpr, INDEX_64: tl.constexpr,
):
    """Rows [tile * ROWS, tile * ROWS + ROWS) of the R = B * H * S rows of x, row r being position
    r % S of head (r // S) % H of batch row r // (H * S); each row's D = 2 HALF elements contiguous."""
    rows = tile * ROWS + tl.arange(0, ROWS)
    if INDEX_64:
        rows = rows.to(tl.int64)
    cols = tl.arange(0, BLOCK_HALF)[None, :]
    slab = rows // S  # b * H + h
    pos = rows - slab * S
    if DENSE:  # slabs back to back, batch rows too: row r starts at r * D
        x_rows = rows * (2 * HALF)
        out_rows = x_rows
    else:
        b = slab // H
        h = slab - b * H
        x_rows = b * stride_xb + h * stride_xh + pos * (2 * HALF)
        out_rows = b * stride_ob + h * stride_oh + pos * (2 * HALF)
    c_rows = pos * stride_cs
    s_rows = pos * stride_ss
    if BATCH_TABLE:
        b_t = slab // H
        c_rows += b_t * stride_cb
        s_rows += b_t * stride_sb
    mask = (rows < R)[:, None]
    if BLOCK_HALF != HALF:
        mask = mask & (cols < HALF)

    c1, c2, s1, s2 = _table_halves(cos_ptr, sin_ptr, c_rows, s_rows, cols, mask, stride_cd, stride_sd, HALF)

    x_ptrs = x_ptr + x_rows[:, None] + cols
    # Both halves are loaded before either is stored: in place, out_ptr is x_ptr.
    x1 = tl.load(x_ptrs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptrs + HALF, mask=mask, other=0.0).to(tl.float32)
    y1, y2 = _rotated(x1, x2, c1, c2, s1, s2, BACKWARD)
    out_ptrs = out_ptr + out_rows[:, None] + cols
    tl.store(out_ptrs, y1.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(out_ptrs + HALF, y2.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rope_flat_kernel(
    q_ptr, k_ptr, q_out_ptr, k_out_ptr, cos_ptr, sin_ptr,
    S, Hq, Hk, Rq, Rk, q_tiles,
    stride_qb, stride_qh, stride_kb, stride_kh, stride_qob, stride_qoh, stride_kob, stride_koh,
    stride_cb, stride_cs, stride_cd, stride_sb, stride_ss, stride_sd,
    HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, ROWS: tl.constexpr, DENSE: tl.constexpr,
    BATCH_TABLE: tl.constexpr, BACKWARD: tl.constexpr, INDEX_64: tl.constexpr,
):
    """Forward (BACKWARD=False) or backward of rotate-half RoPE in (B, H, S, D) with unit dim
    stride and position stride D: programs [0, q_tiles) take q's tiles, the rest k's."""
    pid = tl.program_id(0)
    if pid < q_tiles:
        _rotate_rows(
            q_ptr, q_out_ptr, cos_ptr, sin_ptr, pid, Rq, S, Hq, stride_qb, stride_qh, stride_qob, stride_qoh,
            stride_cb, stride_cs, stride_cd, stride_sb, stride_ss, stride_sd,
            HALF, BLOCK_HALF, ROWS, DENSE, BATCH_TABLE, BACKWARD, INDEX_64,
        )
    else:
        _rotate_rows(
            k_ptr, k_out_ptr, cos_ptr, sin_ptr, pid - q_tiles, Rk, S, Hk, stride_kb, stride_kh, stride_kob,
            stride_koh, stride_cb, stride_cs, stride_cd, stride_sb, stride_ss, stride_sd,
            HALF, BLOCK_HALF, ROWS, DENSE, BATCH_TABLE, BACKWARD, INDEX_64,
        )


@functools.lru_cache(maxsize=1024)
def _launch_shape(B: int, S: int, Hq: int, Hk: int, D: int, itemsize: int, device_index: int) -> tuple[int, ...]:
    """BLOCK_HALF, BLOCK_S, position blocks, heads per program, q chunks, chunks (q and k), heads
    per step, num_warps, stages."""
    step_bytes, per_step, per_program, num_warps, stages = LAUNCH
    block_half = runtime.next_power_of_2(D // 2)
    block_s = min(runtime.next_power_of_2(S), max(1, step_bytes // (per_step * 2 * block_half * itemsize)))
    n_blocks = runtime.cdiv(S, block_s)
    min_programs = MIN_PROGRAMS_PER_SM * runtime.num_sms(device_index)
    while per_program > per_step and (
            B * n_blocks * (runtime.cdiv(Hq, per_program) + runtime.cdiv(Hk, per_program)) < min_programs):
        per_program //= 2
    q_chunks = runtime.cdiv(Hq, per_program)
    n_chunks = q_chunks + runtime.cdiv(Hk, per_program)
    return block_half, block_s, n_blocks, per_program, q_chunks, n_chunks, per_step, num_warps, stages


def _head_strides(t: torch.Tensor, bshd: bool) -> tuple[int, int, int, int]:
    """Strides in (batch, head, position, dim) order."""
    sb, s1, s2, sd = t.stride()
    return (sb, s2, s1, sd) if bshd else (sb, s1, s2, sd)


def _table_strides(t: torch.Tensor) -> tuple[int, int, int]:
    """Strides in (batch, position, dim) order; batch stride 0 for a table shared by the batch."""
    if t.dim() == 2:
        return (0, *t.stride())
    return (t.stride(0) if t.shape[0] > 1 else 0, t.stride(1), t.stride(2))


_launch_rope = runtime.FastLaunch(_rope_kernel)


def _slabs_contiguous(t: torch.Tensor) -> bool:
    """Whether each (batch, head) slab of a (B, H, S, D) tensor is one contiguous S x D block."""
    return t.stride(3) == 1 and (t.shape[2] == 1 or t.stride(2) == t.shape[3])


def _dense(t: torch.Tensor) -> bool:
    """Whether a (B, H, S, D) tensor with contiguous slabs has them back to back: row r (of B H S)
    at r * D."""
    B, H, S, D = t.shape
    return (H == 1 or t.stride(1) == S * D) and (B == 1 or t.stride(0) == H * S * D)


@functools.lru_cache(maxsize=1024)
def _flat_shape(rows: int, D: int, itemsize: int, tile_bytes: int) -> tuple[int, int]:
    """BLOCK_HALF and rows per tile (a power of two, at most what the rows need)."""
    block_half = runtime.next_power_of_2(D // 2)
    per_tile = max(1, tile_bytes // (2 * block_half * itemsize))
    return block_half, min(per_tile, runtime.next_power_of_2(rows))


_launch_rope_flat = runtime.FastLaunch(_rope_flat_kernel)


def _flat_launch(q, k, q_out, k_out, cos, sin, Hk: int, backward: bool) -> tuple[tuple, tuple, dict]:
    """(grid, scalars, constexprs) of the flat kernel, for (B, H, S, D) tensors whose slabs are
    contiguous (_slabs_contiguous); Hk 0 rotates q alone (k, k_out: any of q's tensors)."""
    B, Hq, S, D = q.shape
    Rq, Rk = B * Hq * S, B * Hk * S
    block_half, rows = _flat_shape(max(Rq, Rk), D, q.element_size(), FLAT_TILE_BYTES)
    q_tiles = runtime.cdiv(Rq, rows)
    cos_strides, sin_strides = _table_strides(cos), _table_strides(sin)
    scalars = (S, Hq, Hk, Rq, Rk, q_tiles, q.stride(0), q.stride(1), k.stride(0), k.stride(1), q_out.stride(0),
               q_out.stride(1), k_out.stride(0), k_out.stride(1), *cos_strides, *sin_strides)
    constexprs = dict(HALF=D // 2, BLOCK_HALF=block_half, ROWS=rows, DENSE=all(map(_dense, (q, k, q_out, k_out))),
                      BATCH_TABLE=cos_strides[0] != 0 or sin_strides[0] != 0, BACKWARD=backward,
                      INDEX_64=runtime.needs_int64(q, k, q_out, k_out, cos, sin), num_warps=FLAT_NUM_WARPS)
    return (q_tiles + runtime.cdiv(Rk, rows),), scalars, constexprs


@runtime.planned
def _launch(q, k, q_out, k_out, cos, sin, bshd: bool, backward: bool) -> None:
    """Rotate q into q_out and k into k_out; k and k_out None rotate q alone. Planned
    (runtime.planned): rope's time at a small model's sizes is its host time."""
    B, D = q.shape[0], q.shape[3]
    S, Hq = (q.shape[1], q.shape[2]) if bshd else (q.shape[2], q.shape[1])
    Hk = 0 if k is None else k.shape[2 if bshd else 1]
    if k is None:
        k = k_out = q
    if B == 0 or S == 0 or D == 0 or Hq + Hk == 0:
        return
    if not bshd and FLAT_BHSD and all(map(_slabs_contiguous, (q, k, q_out, k_out))):
        launch = _launch_rope_flat
        grid, scalars, constexprs = _flat_launch(q, k, q_out, k_out, cos, sin, Hk, backward)
    else:
        launch = _launch_rope
        block_half, block_s, n_blocks, per_program, q_chunks, n_chunks, per_step, num_warps, stages = _launch_shape(
            B, S, Hq, Hk, D, q.element_size(), q.device.index or 0)
        grid = (B * n_blocks * n_chunks,)
        scalars = (S, Hq, Hk, n_blocks, q_chunks, n_chunks, per_program, *_head_strides(q, bshd),
                   *_head_strides(k, bshd), *_head_strides(q_out, bshd), *_head_strides(k_out, bshd),
                   *_table_strides(cos), *_table_strides(sin))
        constexprs = dict(HALF=D // 2, BLOCK_HALF=block_half, BLOCK_S=block_s, HEADS_PER_STEP=per_step,
                          BACKWARD=backward, INDEX_64=runtime.needs_int64(q, k, q_out, k_out, cos, sin), STAGES=stages,
                          num_warps=num_warps)
    entry = launch(grid, q, k, q_out, k_out, cos, sin, *scalars, **constexprs)
    if entry is not None:
        runtime.keep_plan(functools.partial(_replay, launch, entry, grid, scalars))


def _replay(launch, entry, grid, scalars, q, k, q_out, k_out, cos, sin, bshd, backward) -> None:
    if k is None:
        k = k_out = q
    launch.replay(entry, grid, q, k, q_out, k_out, cos, sin, *scalars)


def _fake_rope_fwd(q, k, cos, sin, bshd):
    return torch.empty_like(q), torch.empty_like(k)


@runtime.custom_op("rope_fwd", fake=_fake_rope_fwd)
def rope_fwd(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
             bshd: bool) -> tuple[torch.Tensor, torch.Tensor]:
    q_out, k_out = runtime.empty_like(q), runtime.empty_like(k)
    _launch(q, k, q_out, k_out, cos, sin, bshd, False)
    return q_out, k_out


def _fake_rope_fwd_inplace(q, k, cos, sin, bshd):
    return None


@runtime.custom_op("rope_fwd_inplace", fake=_fake_rope_fwd_inplace, mutates_args=("q", "k"))
def rope_fwd_inplace(q: torch.Tensor, k: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                     bshd: bool) -> None:
    _launch(q, k, q, k, cos, sin, bshd, False)


def _fake_rope_bwd(dq, dk, cos, sin, bshd):
    return [torch.empty_like(d) for d in (dq, dk) if d is not None]


@runtime.custom_op("rope_bwd", fake=_fake_rope_bwd)
def rope_bwd(dq: torch.Tensor, dk: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
             bshd: bool) -> list[torch.Tensor]:
    """[dq_in, dk_in], or [dq_in] when dk is None."""
    dq_in, dk_in = runtime.empty_like(dq), None if dk is None else runtime.empty_like(dk)
    _launch(dq, dk, dq_in, dk_in, cos, sin, bshd, True)
    return [dq_in] if dk is None else [dq_in, dk_in]


# ---- qkv_rope's backward: the projections' joint gradient in one launch ----

# Programs of QKV_GRAD_TILE_ELEMENTS-element tiles (a block of tokens of one head) on
# QKV_GRAD_NUM_WARPS warps, about QKV_GRAD_PROGRAMS_PER_SM programs an SM, each looping over the
# token blocks of its head (scripts/sweep_launch.py qkv_grad).
QKV_GRAD_TILE_ELEMENTS = 4096
QKV_GRAD_PROGRAMS_PER_SM = 8
QKV_GRAD_NUM_WARPS = 4


@triton.jit
def _qkv_grad_head(
    src_ptr, dy_ptr, parts_ptr, part, parts, head, col0, blocks, T, S, N,
    stride_b, stride_h, stride_s, stride_d, cos_ptr, sin_ptr,
    stride_cb, stride_cs, stride_cd, stride_sb, stride_ss, stride_sd,
    HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_T: tl.constexpr, ROTATE: tl.constexpr,
    HAS_SRC: tl.constexpr, SUMS: tl.constexpr, BATCH_TABLE: tl.constexpr, INDEX_64: tl.constexpr,
):
    """Token blocks part, part + parts, ... of one head: its (B, H, S, D) gradient rotated back
    (ROTATE) or copied into columns [col0, col0 + D) of dy (tokens, N), zeros without a source;
    with SUMS the column sums of what was stored go to row `part` of parts (float32)."""
    halves = tl.arange(0, BLOCK_HALF)
    cols = halves[None, :]
    col_ok = cols < HALF
    if INDEX_64:
        head = head.to(tl.int64)
        cols = cols.to(tl.int64)
    sum1 = tl.zeros((BLOCK_HALF,), tl.float32)
    sum2 = tl.zeros((BLOCK_HALF,), tl.float32)
    for blk in range(part, blocks, parts):
        t = blk * BLOCK_T + tl.arange(0, BLOCK_T)
        if INDEX_64:
            t = t.to(tl.int64)
        mask = (t < T)[:, None] & col_ok
        b = t // S
        pos = t - b * S
        if HAS_SRC:
            src = src_ptr + (b * stride_b + head * stride_h + pos * stride_s)[:, None]
            x1 = tl.load(src + cols * stride_d, mask=mask, other=0.0).to(tl.float32)
            x2 = tl.load(src + (cols + HALF) * stride_d, mask=mask, other=0.0).to(tl.float32)
            if ROTATE:
                c_rows = pos * stride_cs
                s_rows = pos * stride_ss
                if BATCH_TABLE:
                    c_rows += b * stride_cb
                    s_rows += b * stride_sb
                c1, c2, s1, s2 = _table_halves(cos_ptr, sin_ptr, c_rows, s_rows, cols, mask, stride_cd,
                                               stride_sd, HALF)
                x1, x2 = _rotated(x1, x2, c1, c2, s1, s2, True)
            y1 = x1.to(dy_ptr.dtype.element_ty)
            y2 = x2.to(dy_ptr.dtype.element_ty)
        else:
            y1 = tl.zeros((BLOCK_T, BLOCK_HALF), dy_ptr.dtype.element_ty)
            y2 = y1
        out = dy_ptr + (t * N + col0)[:, None] + cols
        tl.store(out, y1, mask=mask)
        tl.store(out + HALF, y2, mask=mask)
        if SUMS:
            # The stored (rounded) values: the bias gradient is the column sum of dy as it is.
            sum1 += tl.sum(y1.to(tl.float32), axis=0)
            sum2 += tl.sum(y2.to(tl.float32), axis=0)
    if SUMS:
        row = parts_ptr + part * N + col0 + halves
        tl.store(row, sum1, mask=halves < HALF)
        tl.store(row + HALF, sum2, mask=halves < HALF)


@triton.jit
def _qkv_grad_kernel(
    dq_ptr, dk_ptr, dv_ptr, dy_ptr, parts_ptr, cos_ptr, sin_ptr, T, S, Hq, Hk, N, blocks,
    stride_qb, stride_qh, stride_qs, stride_qd, stride_kb, stride_kh, stride_ks, stride_kd,
    stride_vb, stride_vh, stride_vs, stride_vd,
    stride_cb, stride_cs, stride_cd, stride_sb, stride_ss, stride_sd,
    HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_T: tl.constexpr, HAS_DQ: tl.constexpr,
    HAS_DK: tl.constexpr, HAS_DV: tl.constexpr, SUMS: tl.constexpr, BATCH_TABLE: tl.constexpr,
    INDEX_64: tl.constexpr,
):
    """Program (p, h): head h of dy's Hq + 2 Hk heads (q's, k's, v's), token blocks p, p + P, ...
    of it (P programs along axis 0)."""
    part = tl.program_id(0)
    parts = tl.num_programs(0)
    head = tl.program_id(1)
    col0 = head * (2 * HALF)
    if head < Hq:
        _qkv_grad_head(dq_ptr, dy_ptr, parts_ptr, part, parts, head, col0, blocks, T, S, N,
                       stride_qb, stride_qh, stride_qs, stride_qd, cos_ptr, sin_ptr,
                       stride_cb, stride_cs, stride_cd, stride_sb, stride_ss, stride_sd,
                       HALF, BLOCK_HALF, BLOCK_T, True, HAS_DQ, SUMS, BATCH_TABLE, INDEX_64)
    elif head < Hq + Hk:
        _qkv_grad_head(dk_ptr, dy_ptr, parts_ptr, part, parts, head - Hq, col0, blocks, T, S, N,
                       stride_kb, stride_kh, stride_ks, stride_kd, cos_ptr, sin_ptr,
                       stride_cb, stride_cs, stride_cd, stride_sb, stride_ss, stride_sd,
                       HALF, BLOCK_HALF, BLOCK_T, True, HAS_DK, SUMS, BATCH_TABLE, INDEX_64)
    else:
        _qkv_grad_head(dv_ptr, dy_ptr, parts_ptr, part, parts, head - Hq - Hk, col0, blocks, T, S, N,
                       stride_vb, stride_vh, stride_vs, stride_vd, cos_ptr, sin_ptr,
                       stride_cb, stride_cs, stride_cd, stride_sb, stride_ss, stride_sd,
                       HALF, BLOCK_HALF, BLOCK_T, False, HAS_DV, SUMS, BATCH_TABLE, INDEX_64)


_launch_qkv_grad = runtime.FastLaunch(_qkv_grad_kernel)


def _fake_qkv_rope_grad(dq, dk, dv, x, cos, sin, heads, sums):
    N = sum(heads) * cos.shape[-1]
    dy = x.new_empty((x.shape[0] * x.shape[1], N))
    return [dy, x.new_empty((N,))] if sums else [dy]


@runtime.custom_op("qkv_rope_grad", fake=_fake_qkv_rope_grad)
def qkv_rope_grad(dq: torch.Tensor | None, dk: torch.Tensor | None, dv: torch.Tensor | None, x: torch.Tensor,
                  cos: torch.Tensor, sin: torch.Tensor, heads: list[int], sums: bool) -> list[torch.Tensor]:
    """[dy] or, with `sums`, [dy, db]: the gradient of qkv_rope_fwd's joint product x w^T + b as
    (tokens, (Hq + 2 Hk) D) in x's dtype, from the (B, H, S, D) gradients of q, k and v (None:
    zero), q's and k's rotated back, and its column sums (the biases' gradient). One launch reads
    each gradient once and writes dy once; the sums are per-program partial rows that
    norm.sum_parts adds up (docs/rope.md)."""
    B, S = x.shape[:2]
    D = cos.shape[-1]
    H = sum(heads)
    T, N = B * S, H * D
    dy = runtime.empty((T, N), x.dtype, x.device)
    if T == 0 or N == 0:
        return [dy, torch.zeros((N,), dtype=x.dtype, device=x.device)] if sums else [dy]
    block_half = runtime.next_power_of_2(D // 2)
    block_t = min(runtime.next_power_of_2(T), max(1, QKV_GRAD_TILE_ELEMENTS // (2 * block_half)))
    blocks = runtime.cdiv(T, block_t)
    parts = max(1, min(blocks, runtime.cdiv(QKV_GRAD_PROGRAMS_PER_SM * runtime.num_sms(x.device.index or 0), H)))
    partials = runtime.workspace(x.device, parts * N) if sums else dy
    grads = (dq, dk, dv)
    strides = [s for g in grads for s in ((0, 0, 0, 0) if g is None else g.stride())]
    cos_strides, sin_strides = _table_strides(cos), _table_strides(sin)
    _launch_qkv_grad((parts, H), *(dy if g is None else g for g in grads), dy, partials, cos, sin, T, S,
                     heads[0], heads[1], N, blocks, *strides, *cos_strides, *sin_strides, HALF=D // 2,
                     BLOCK_HALF=block_half, BLOCK_T=block_t, HAS_DQ=dq is not None, HAS_DK=dk is not None,
                     HAS_DV=dv is not None, SUMS=sums, BATCH_TABLE=cos_strides[0] != 0 or sin_strides[0] != 0,
                     INDEX_64=runtime.needs_int64(dy, cos, sin, *(g for g in grads if g is not None)),
                     num_warps=QKV_GRAD_NUM_WARPS)
    return [dy, sum_parts(partials, parts, N, x.dtype)] if sums else [dy]


class RopeFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, cos, sin, bshd):
        ctx.save_for_backward(cos, sin)
        ctx.bshd = bshd
        return rope_fwd(q, k, cos, sin, bshd)

    @staticmethod
    def backward(ctx, dq, dk):
        cos, sin = ctx.saved_tensors
        dq_in, dk_in = rope_bwd(dq, dk, cos, sin, ctx.bshd)
        return dq_in, dk_in, None, None, None


class RopeInplaceFunction(torch.autograd.Function):
    """One tensor rotated in place. Autograd lets a Function that writes into a view (q and k
    usually are views of a projection's output) return one tensor only, so q and k go through
    one launch each."""

    @staticmethod
    def forward(ctx, x, cos, sin, bshd):
        ctx.save_for_backward(cos, sin)
        ctx.bshd = bshd
        rope_fwd_inplace(x, None, cos, sin, bshd)
        ctx.mark_dirty(x)
        return x

    @staticmethod
    def backward(ctx, dx):
        cos, sin = ctx.saved_tensors
        (dx_in,) = rope_bwd(dx, None, cos, sin, ctx.bshd)
        return dx_in, None, None, None


def _check_writable(name: str, t: torch.Tensor) -> None:
    """Refuse, before any write, what autograd would refuse only after the kernel had written."""
    if t.requires_grad and t.is_leaf or t._base is not None and t._base.requires_grad and t._base.is_leaf:
        raise ValueError(f"{name} is a leaf tensor that requires grad, or a view of one: it cannot be written in "
                         f"place; use inplace=False")


def _check_inputs(q, k, cos, sin, layout, inplace) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be 'bhsd' (batch, heads, seq, dim) or 'bshd' (batch, seq, heads, dim), "
                         f"got {layout!r}")
    if not isinstance(inplace, bool):
        raise TypeError(f"inplace must be a bool, got {type(inplace).__name__}")
    for name, t in (("q", q), ("k", k)):
        runtime.check_tensor(name, t)
        if t.dim() != 4:
            raise ValueError(f"{name} must have 4 dimensions ({layout}), got shape {tuple(t.shape)}")
    if k.dtype != q.dtype:
        raise TypeError(f"k has dtype {k.dtype} but q has {q.dtype}; they must match")
    seq = 2 if layout == "bhsd" else 1
    B, S, D = q.shape[0], q.shape[seq], q.shape[3]
    if D % 2:
        raise ValueError(f"the head dimension of q must be even (rotate-half pairs its halves), got q of shape "
                         f"{tuple(q.shape)}")
    if (k.shape[0], k.shape[seq], k.shape[3]) != (B, S, D):
        raise ValueError(f"k has shape {tuple(k.shape)} but q has {tuple(q.shape)}: batch, sequence and head "
                         f"dimensions must match ({layout})")
    _check_tables(cos, sin, B, S, D, f"q of shape {tuple(q.shape)} ({layout})")
    runtime.check_same_device(q=q, k=k, cos=cos, sin=sin)


def _check_tables(cos, sin, B: int, S: int, D: int, what: str) -> None:
    for name, t in (("cos", cos), ("sin", sin)):
        runtime.check_tensor(name, t, TABLE_DTYPES)
        shared = t.dim() == 2 and t.shape == (S, D)
        if not (shared or t.dim() == 3 and t.shape[0] in (1, B) and t.shape[1:] == (S, D)):
            raise ValueError(f"{name} has shape {tuple(t.shape)}; for {what} it must be ({S}, {D}), (1, {S}, {D}) "
                             f"or ({B}, {S}, {D})")
    if torch.is_grad_enabled() and (cos.requires_grad or sin.requires_grad):
        raise ValueError("gradients with respect to cos and sin are not supported: pass them detached "
                         "(cos.detach(), sin.detach()), or call under torch.no_grad()")


def apply_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout: str = "bhsd",
               inplace: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """HuggingFace's `apply_rotary_pos_emb(q, k, cos, sin)`: returns (q * cos + rotate_half(q) * sin,
    the same for k), computed in float32 and stored in q's dtype (float32, float16 or bfloat16).

    layout "bhsd": q is (B, Hq, S, D), k (B, Hk, S, D) (HF's unsqueeze_dim=1); "bshd": (B, S, Hq, D)
    and (B, S, Hk, D) (unsqueeze_dim=2). Hq and Hk may differ. cos and sin are (S, D), (1, S, D) or
    (B, S, D) (HF's rotary embedding per position_ids), of any float dtype; they get no gradient.
    Any strides are read in place; outputs are laid out like q and k.

    inplace=True writes the results into q and k and returns them. It works under autograd as
    torch's own in-place ops do (the backward needs only cos and sin): q and k must not be leaves
    requiring grad (ValueError), and a graph that saved them before raises at its backward. With
    gradients on, q and k take one launch each (see RopeInplaceFunction).
    """
    _check_inputs(q, k, cos, sin, layout, inplace)
    bshd = layout == "bshd"
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad):
        if not inplace:
            return runtime.apply(RopeFunction, q, k, cos, sin, bshd)
        if torch.compiler.is_compiling():
            # AOT autograd refuses a Function that writes into a view; a compiled graph
            # functionalizes the writes anyway, so torch's own copy_ costs nothing more there.
            q_out, k_out = runtime.apply(RopeFunction, q, k, cos, sin, bshd)
            return q.copy_(q_out), k.copy_(k_out)
        _check_writable("q", q)
        _check_writable("k", k)
        return runtime.apply(RopeInplaceFunction, q, cos, sin, bshd), runtime.apply(RopeInplaceFunction, k, cos, sin, bshd)
    if inplace:
        rope_fwd_inplace(q, k, cos, sin, bshd)
        return q, k
    return rope_fwd(q, k, cos, sin, bshd)


# ---- the attention's input projections and the rotation, one autograd node ----

def _heads_of(y: torch.Tensor, heads: tuple[int, int, int], D: int) -> list[torch.Tensor]:
    """q, k and v as (B, S, H, D) views of their projections' joint (B, S, (Hq + 2 Hk) D) output."""
    B, S = y.shape[:2]
    return [t.view(B, S, h, D) for t, h in zip(y.split([h * D for h in heads], dim=-1), heads)]


def qkv_rope_fwd(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                 heads: tuple[int, int, int]) -> list[torch.Tensor]:
    """q, k, v as (B, H, S, D) views of x w^T + b, w the three projections' weights concatenated,
    with q and k rotated in place. In compile_ahead's thread only the rotation's kernel compiles."""
    D = cos.shape[-1]
    if runtime.compiling_ahead():
        y = torch.empty((*x.shape[:2], w.shape[0]), dtype=x.dtype, device=x.device)
    else:
        y = torch.nn.functional.linear(x, w, b)
    q, k, v = _heads_of(y, heads, D)
    rope_fwd_inplace(q, k, cos, sin, True)
    return [t.transpose(1, 2) for t in (q, k, v)]


def qkv_rope_bwd(dq: torch.Tensor | None, dk: torch.Tensor | None, dv: torch.Tensor | None, x: torch.Tensor,
                 w: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: tuple[int, int, int],
                 need_dx: bool, need_dw: bool, need_db: bool):
    """(dx, dw, db) of qkv_rope_fwd, dw and db as (q, k, v) row blocks, from the gradients of its
    (B, H, S, D) outputs (None: zero)."""
    grads = qkv_rope_grad(dq, dk, dv, x, cos, sin, list(heads), need_db)
    if runtime.compiling_ahead():
        return None, None, None
    dy2, x2 = grads[0], x.reshape(-1, x.shape[-1])
    sizes = [h * cos.shape[-1] for h in heads]
    dx = (dy2 @ w).view(x.shape) if need_dx else None
    dw = (dy2.mT @ x2).split(sizes) if need_dw else None
    db = grads[1].split(sizes) if need_db else None
    return dx, dw, db


class QKVRopeFunction(torch.autograd.Function):
    """x's q, k and v projections as one matmul (the weights concatenated), q and k rotated in
    place in its output. Backward writes the rotation's transpose of dq and dk and a copy of dv
    into one gradient buffer (qkv_rope_grad, with the biases' gradient), then one matmul gives dx
    (no adds of three partial dx) and one the three weights' gradients (row blocks of one result,
    laid out as the weights)."""

    @staticmethod
    def forward(ctx, x, w_q, w_k, w_v, b_q, b_k, b_v, cos, sin):
        D = cos.shape[-1]
        heads = (w_q.shape[0] // D, w_k.shape[0] // D, w_v.shape[0] // D)
        w = torch.cat((w_q, w_k, w_v))
        biases = (b_q, b_k, b_v)
        b = None
        if any(t is not None for t in biases):
            b = torch.cat([w.new_zeros(h * D) if t is None else t for t, h in zip(biases, heads)])
        ctx.save_for_backward(x, w, cos, sin)
        ctx.heads, ctx.has_bias = heads, tuple(t is not None for t in biases)
        return tuple(qkv_rope_fwd(x, w, b, cos, sin, heads))

    @staticmethod
    def backward(ctx, dq, dk, dv):
        x, w, cos, sin = ctx.saved_tensors
        needs = ctx.needs_input_grad
        dx, dw, db = qkv_rope_bwd(dq, dk, dv, x, w, cos, sin, ctx.heads, needs[0], any(needs[1:4]),
                                  any(ctx.has_bias))
        dw = [g if need else None for g, need in zip(dw or (None,) * 3, needs[1:4])]
        db = [g if has else None for g, has in zip(db or (None,) * 3, ctx.has_bias)]
        return dx, *dw, *db, None, None


def _projected_heads(x, w_q, w_k, w_v, b_q, b_k, b_v, D: int) -> list[torch.Tensor]:
    """q, k, v = x w^T + b by three projections, as (B, H, S, D) views."""
    B, S = x.shape[:2]
    return [torch.nn.functional.linear(x, w, b).view(B, S, -1, D).transpose(1, 2)
            for w, b in ((w_q, b_q), (w_k, b_k), (w_v, b_v))]


def _qkv_rope_unfused(x, w_q, w_k, w_v, cos, sin, b_q, b_k, b_v):
    """Three projections and apply_rope: what the fused path computes, where it does not apply."""
    q, k, v = _projected_heads(x, w_q, w_k, w_v, b_q, b_k, b_v, cos.shape[-1])
    q, k = apply_rope(q, k, cos, sin, "bhsd", inplace=not torch.is_grad_enabled())
    return q, k, v


def qkv_rope(x: torch.Tensor, w_q: torch.Tensor, w_k: torch.Tensor, w_v: torch.Tensor, cos: torch.Tensor,
             sin: torch.Tensor, b_q: torch.Tensor | None = None, b_k: torch.Tensor | None = None,
             b_v: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """An attention layer's inputs from x (B, S, hidden): q = rope(x w_q^T + b_q), k = rope(x w_k^T
    + b_k), v = x w_v^T + b_v, returned as HuggingFace's attention takes them, (B, H, S, D) views
    (Hq = w_q.shape[0] / D, Hk likewise, D = cos.shape[-1]). Weights are nn.Linear's (out, in), in
    x's dtype; cos and sin as in apply_rope, (S, D), (1, S, D) or (B, S, D).

    With gradients on, one autograd node (QKVRopeFunction): one matmul for the three projections,
    one for dx and one for the weights' gradients, instead of three each and two adds of partial
    dx; it keeps x and the concatenated weights for backward, under torch.compile too. Without
    gradients (or under autocast) the projections run apart: concatenating the weights would cost
    more than it saves for few tokens."""
    runtime.check_tensor("x", x)
    if x.dim() != 3:
        raise ValueError(f"x must be (batch, seq, hidden), got shape {tuple(x.shape)}")
    B, S, hidden = x.shape
    D = cos.shape[-1] if isinstance(cos, torch.Tensor) and cos.dim() >= 1 else 0
    if D == 0 or D % 2:
        raise ValueError(f"cos must end in an even head dimension, got shape "
                         f"{tuple(cos.shape) if isinstance(cos, torch.Tensor) else type(cos).__name__}")
    _check_tables(cos, sin, B, S, D, f"x of shape {tuple(x.shape)}")
    for name, w, b in (("w_q", w_q, b_q), ("w_k", w_k, b_k), ("w_v", w_v, b_v)):
        runtime.check_tensor(name, w, (x.dtype,))
        if w.dim() != 2 or w.shape[1] != hidden or w.shape[0] % D:
            raise ValueError(f"{name} must be (heads * {D}, {hidden}) for x of shape {tuple(x.shape)} and head "
                             f"dimension {D}, got {tuple(w.shape)}")
        if b is not None:
            runtime.check_tensor(f"b{name[1:]}", b, (x.dtype,))
            if tuple(b.shape) != (w.shape[0],):
                raise ValueError(f"b{name[1:]} must have shape ({w.shape[0]},), got {tuple(b.shape)}")
    if w_k.shape != w_v.shape:
        raise ValueError(f"w_k and w_v must have the same shape, got {tuple(w_k.shape)} and {tuple(w_v.shape)}")
    runtime.check_same_device(x=x, w_q=w_q, w_k=w_k, w_v=w_v, b_q=b_q, b_k=b_k, b_v=b_v, cos=cos, sin=sin)
    tensors = (x, w_q, w_k, w_v, b_q, b_k, b_v)
    fused = (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)
             and not torch.is_autocast_enabled(x.device.type))
    if fused:
        return runtime.apply(QKVRopeFunction, *tensors, cos, sin)
    return _qkv_rope_unfused(x, w_q, w_k, w_v, cos, sin, b_q, b_k, b_v)


# ---- a decode step's rope and KV-cache write, one launch ----

@triton.jit
def _rope_into_cache_kernel(
    q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, pos_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr,
    H, S_max, table_rows, stride_p, stride_qb, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh, stride_cb,
    stride_sb, stride_ob, stride_oh, stride_kcb, stride_kch, stride_kcs, stride_vcb, stride_vch, stride_vcs,
    HALF: tl.constexpr, BLOCK: tl.constexpr, BY_POSITION: tl.constexpr,
):
    """Program (b, h): query head h < H rotated into q_out; KV head h - H's key rotated and its
    value copied into the caches at sequence b's position (none written outside [0, S_max)).
    cos and sin rows: b's, or with BY_POSITION the tables' row at b's position (clamped into
    [0, table_rows))."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    cols = tl.arange(0, BLOCK)
    ok = cols < HALF
    if BY_POSITION:
        row = tl.minimum(tl.maximum(tl.load(pos_ptr + b * stride_p), 0), table_rows - 1).to(tl.int64)
    else:
        row = b
    c1 = tl.load(cos_ptr + row * stride_cb + cols, mask=ok, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + row * stride_cb + HALF + cols, mask=ok, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + row * stride_sb + cols, mask=ok, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + row * stride_sb + HALF + cols, mask=ok, other=0.0).to(tl.float32)
    if h < H:
        src = q_ptr + b * stride_qb + h * stride_qh + cols
        dst = q_out_ptr + b * stride_ob + h * stride_oh + cols
        y1, y2 = _rotated(tl.load(src, mask=ok).to(tl.float32), tl.load(src + HALF, mask=ok).to(tl.float32),
                          c1, c2, s1, s2, False)
        tl.store(dst, y1.to(q_out_ptr.dtype.element_ty), mask=ok)
        tl.store(dst + HALF, y2.to(q_out_ptr.dtype.element_ty), mask=ok)
    else:
        hk = h - H
        pos = tl.load(pos_ptr + b * stride_p).to(tl.int64)
        ok = ok & (pos >= 0) & (pos < S_max)
        src = k_ptr + b * stride_kb + hk * stride_kh + cols
        dst = k_cache_ptr + b.to(tl.int64) * stride_kcb + hk * stride_kch + pos * stride_kcs + cols
        y1, y2 = _rotated(tl.load(src, mask=ok).to(tl.float32), tl.load(src + HALF, mask=ok).to(tl.float32),
                          c1, c2, s1, s2, False)
        tl.store(dst, y1.to(k_cache_ptr.dtype.element_ty), mask=ok)
        tl.store(dst + HALF, y2.to(k_cache_ptr.dtype.element_ty), mask=ok)
        src = v_ptr + b * stride_vb + hk * stride_vh + cols
        dst = v_cache_ptr + b.to(tl.int64) * stride_vcb + hk * stride_vch + pos * stride_vcs + cols
        tl.store(dst, tl.load(src, mask=ok), mask=ok)
        tl.store(dst + HALF, tl.load(src + HALF, mask=ok), mask=ok)


_launch_rope_into_cache = runtime.FastLaunch(_rope_into_cache_kernel)


def _fake_rope_into_cache(q, k, v, cos, sin, positions, k_cache, v_cache, by_position=False):
    return torch.empty_like(q)


@runtime.custom_op("rope_into_cache", fake=_fake_rope_into_cache, mutates_args=("k_cache", "v_cache"))
@runtime.planned
def rope_into_cache_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                        positions: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        by_position: bool = False) -> torch.Tensor:
    q_out = runtime.empty(q.shape, q.dtype, q.device)
    B, H, D = q.shape
    grid = (B, H + k.shape[1])
    scalars = (H, k_cache.shape[2], cos.shape[0], positions.stride(0), q.stride(0), q.stride(1), k.stride(0),
               k.stride(1), v.stride(0), v.stride(1), cos.stride(0), sin.stride(0), q_out.stride(0), q_out.stride(1),
               *k_cache.stride()[:3], *v_cache.stride()[:3])
    if B == 0:
        return q_out
    entry = _launch_rope_into_cache(grid, q, k, v, cos, sin, positions, q_out, k_cache, v_cache, *scalars,
                                    HALF=D // 2, BLOCK=runtime.next_power_of_2(D // 2), BY_POSITION=by_position)
    if entry is not None:
        runtime.keep_plan(functools.partial(_replay_rope_into_cache, entry, grid, scalars))
    return q_out


def _replay_rope_into_cache(entry, grid, scalars, q, k, v, cos, sin, positions, k_cache, v_cache, by_position=False):
    q_out = runtime.empty(q.shape, q.dtype, q.device)
    _launch_rope_into_cache.replay(entry, grid, q, k, v, cos, sin, positions, q_out, k_cache, v_cache, *scalars)
    return q_out


def rope_into_cache(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    positions: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    by_position: bool = False) -> torch.Tensor:
    """One new token a sequence, for decoding: returns q rotated, and writes k rotated and v into
    the caches at each sequence's position (k_cache[b, :, positions[b]] = rope(k[b])), in one
    launch instead of apply_rope's and two scatters'. q (B, H, D), k and v (B, H_kv, D); cos and
    sin (B, D) or (B, 1, D) (HF's tables at the positions), or with by_position=True (P, D) tables
    of every position, read at each sequence's own (clamped into [0, P)): a captured decode step
    then computes no tables; positions (B,) int64 on the device (a position outside [0, S_max)
    writes nothing); caches (B, H_kv, S_max, D). Every head dimension has unit stride. The same
    rounding as apply_rope (float32, one rounding). No gradient."""
    for name, t in (("q", q), ("k", k), ("v", v), ("k_cache", k_cache), ("v_cache", v_cache)):
        runtime.check_tensor(name, t)
        if t.dim() != (4 if name.endswith("cache") else 3):
            raise ValueError(f"rope_into_cache: {name} has shape {tuple(t.shape)}; see the doc for its dimensions")
        if t.stride(-1) != 1 and t.shape[-1] > 1:
            raise ValueError(f"rope_into_cache: {name}'s head dimension must have unit stride")
    B, H, D = q.shape
    H_kv = k.shape[1]
    if D % 2 or k.shape != (B, H_kv, D) or v.shape != k.shape or k_cache.shape[:2] != (B, H_kv) \
            or k_cache.shape[3] != D or v_cache.shape != k_cache.shape:
        raise ValueError(f"rope_into_cache: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, caches "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)} do not fit (B, H, D), (B, H_kv, D) "
                         "and (B, H_kv, S_max, D) with D even")
    if len({q.dtype, k.dtype, v.dtype, k_cache.dtype, v_cache.dtype}) != 1:
        raise TypeError("rope_into_cache: q, k, v and the caches must share a dtype")
    if not by_position:
        cos, sin = (t.reshape(t.shape[0], t.shape[-1]) if t.dim() == 3 and t.shape[1] == 1 else t
                    for t in (cos, sin))
    for name, t in (("cos", cos), ("sin", sin)):
        runtime.check_tensor(name, t, TABLE_DTYPES)
        if by_position and (t.dim() != 2 or t.shape[0] < 1 or t.shape[1] != D or t.stride(1) != 1):
            raise ValueError(f"rope_into_cache: with by_position, {name} must be a (P, {D}) table with unit stride, "
                             f"P >= 1, got {tuple(t.shape)}")
        if not by_position and (t.shape != (B, D) or t.stride(1) != 1):
            raise ValueError(f"rope_into_cache: {name} must be ({B}, {D}) or ({B}, 1, {D}) with unit stride, "
                             f"got {tuple(t.shape)}")
    runtime.check_tensor("positions", positions, (torch.int64,))
    if positions.shape != (B,):
        raise ValueError(f"rope_into_cache: positions must have shape ({B},), got {tuple(positions.shape)}")
    runtime.check_same_device(q=q, k=k, v=v, cos=cos, sin=sin, positions=positions, k_cache=k_cache, v_cache=v_cache)
    runtime.check_no_grad("rope_into_cache", q=q, k=k, v=v)
    if by_position and cos.shape != sin.shape:
        raise ValueError(f"rope_into_cache: the cos and sin tables differ in shape: {tuple(cos.shape)} and "
                         f"{tuple(sin.shape)}")
    return rope_into_cache_fwd(q, k, v, cos, sin, positions, k_cache, v_cache, by_position)


def rope_into_cache_reference(q, k, v, cos, sin, positions, k_cache, v_cache, by_position=False):
    """rope_into_cache in plain torch: (q rotated, k_cache, v_cache) with the caches written in
    place at each position inside them, as the kernel writes them."""
    if by_position:
        rows = positions.clamp(0, cos.shape[0] - 1)
        cos, sin = cos[rows], sin[rows]
    cos, sin = (t.reshape(t.shape[0], t.shape[-1])[:, None] for t in (cos, sin))  # (B, 1, D): one position
    q_rot, k_rot = apply_rope_reference(q[:, :, None], k[:, :, None], cos, sin, "bhsd")
    for b, p in enumerate(positions.tolist()):
        if 0 <= p < k_cache.shape[2]:
            k_cache[b, :, p], v_cache[b, :, p] = k_rot[b, :, 0], v[b]
    return q_rot[:, :, 0], k_cache, v_cache


def qkv_rope_reference(x, w_q, w_k, w_v, cos, sin, b_q=None, b_k=None, b_v=None):
    q, k, v = _projected_heads(x, w_q, w_k, w_v, b_q, b_k, b_v, cos.shape[-1])
    q, k = apply_rope_reference(q, k, cos, sin, "bhsd")
    return q, k, v


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope_reference(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         layout: str = "bhsd", inplace: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's apply_rotary_pos_emb in plain torch. `inplace` is accepted for parity with apply_rope:
    the values are the same, and the reference always returns new tensors."""
    head_dim = 1 if layout == "bhsd" else 2
    cos, sin = (t[None] if t.dim() == 2 else t for t in (cos, sin))
    cos, sin = cos.unsqueeze(head_dim), sin.unsqueeze(head_dim)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
