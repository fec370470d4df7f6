"""Rotary position embedding (RoPE) of queries and keys, HuggingFace's rotate-half form.

    q_embed = q * cos + rotate_half(q) * sin,    rotate_half(x) = cat(-x2, x1)

with x1, x2 the two halves of the head dimension. Per half, with cos = (c1, c2), sin = (s1, s2):

    y1 = x1 * c1 - x2 * s1                 dx1 = dy1 * c1 + dy2 * s2
    y2 = x2 * c2 + x1 * s2                 dx2 = dy2 * c2 - dy1 * s1

The backward applies the transpose of each 2x2 block; for tables built as cat(freqs, freqs)
(c1 = c2, s1 = s2) that is the rotation by minus the angle. Both halves of cos and sin are read:
nothing assumes a table of that form. cos and sin are constants (no gradient flows to them).

One kernel does the forward and the backward, q and k in one launch. A program takes a block of
positions of one batch row and a chunk of the heads of q or of k: it loads the block's cos and
sin once, in float32, then walks its heads a few at a time, each step a (positions, heads, D/2)
tile per half with D contiguous (16-byte accesses). The chunks of one block are neighbours in
launch order, so their cos/sin reads hit L2. Arithmetic is float32 whatever the storage dtypes.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .. import runtime
from ..bench import peers
from ..bench.runner import short_dtype
from ..spec import Bench, BenchCase, OpSpec, TestCase

LAYOUTS = ("bhsd", "bshd")
TABLE_DTYPES = (*runtime.FLOAT_DTYPES, torch.float64)

# Launch shape per layout, from a sweep on the H100 (scripts/sweep_launch.py; docs/perf-notes.md),
# as (STEP_BYTES, HEADS_PER_STEP, HEADS_PER_PROGRAM, NUM_WARPS). A step reads BLOCK_S positions x
# HEADS_PER_STEP heads of q or k, STEP_BYTES in all. In (B, H, S, D) memory a head's positions are
# contiguous: one head a step, 32 positions (2.71 TB/s at q (4,32,4096,128) bf16). In (B, S, H, D)
# a position's heads are: four heads a step (2.85 TB/s). Each program reads its block's cos and sin
# once and rotates HEADS_PER_PROGRAM heads; fewer when that leaves under MIN_PROGRAMS_PER_SM
# programs per SM.
LAUNCH = {False: (8192, 1, 8, 4), True: (8192, 4, 8, 8)}
MIN_PROGRAMS_PER_SM = 4


@triton.jit
def _rotate_heads(
    x_ptr, out_ptr, h_start, h_end, x_tile, out_tile, stride_xh, stride_xd, stride_oh, stride_od,
    c1, c2, s1, s2, tile_mask,
    HALF: tl.constexpr, HEADS_PER_STEP: tl.constexpr, BACKWARD: tl.constexpr, INDEX_64: tl.constexpr,
):
    """Heads [h_start, h_end) of one block of positions. x_tile and out_tile are the block's
    (positions, 1, D/2) element offsets inside one head; c1, c2, s1, s2 its cos/sin halves."""
    step = tl.arange(0, HEADS_PER_STEP)
    for h in tl.range(h_start, h_end, HEADS_PER_STEP):
        heads = h + step
        mask = (heads < h_end)[None, :, None] & tile_mask
        if INDEX_64:
            heads = heads.to(tl.int64)
        x_ptrs = x_ptr + (heads * stride_xh)[None, :, None] + x_tile
        out_ptrs = out_ptr + (heads * stride_oh)[None, :, None] + out_tile
        # Both halves are loaded before either is stored: in place, out_ptr is x_ptr.
        x1 = tl.load(x_ptrs, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
        x2 = tl.load(x_ptrs + HALF * stride_xd, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
        if BACKWARD:
            y1 = x1 * c1 + x2 * s2
            y2 = x2 * c2 - x1 * s1
        else:
            y1 = x1 * c1 - x2 * s1
            y2 = x2 * c2 + x1 * s2
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
    HEADS_PER_STEP: tl.constexpr, BACKWARD: tl.constexpr, INDEX_64: tl.constexpr,
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
            HALF, HEADS_PER_STEP, BACKWARD, INDEX_64,
        )
    else:
        h_start = (chunk - q_chunks) * heads_per_program
        _rotate_heads(
            k_ptr + b * stride_kb, k_out_ptr + b * stride_kob, h_start, tl.minimum(h_start + heads_per_program, Hk),
            rows * stride_ks + cols * stride_kd,
            rows * stride_kos + cols * stride_kod,
            stride_kh, stride_kd, stride_koh, stride_kod, c1, c2, s1, s2, mask,
            HALF, HEADS_PER_STEP, BACKWARD, INDEX_64,
        )


@functools.lru_cache(maxsize=1024)
def _launch_shape(B: int, S: int, Hq: int, Hk: int, D: int, itemsize: int, bshd: bool,
                  device_index: int) -> tuple[int, ...]:
    """BLOCK_HALF, BLOCK_S, position blocks, heads per program, q chunks, chunks (q and k), heads
    per step, num_warps."""
    step_bytes, per_step, per_program, num_warps = LAUNCH[bshd]
    block_half = triton.next_power_of_2(D // 2)
    block_s = min(triton.next_power_of_2(S), max(1, step_bytes // (per_step * 2 * block_half * itemsize)))
    n_blocks = triton.cdiv(S, block_s)
    min_programs = MIN_PROGRAMS_PER_SM * runtime.num_sms(device_index)
    while per_program > per_step and (
            B * n_blocks * (triton.cdiv(Hq, per_program) + triton.cdiv(Hk, per_program)) < min_programs):
        per_program //= 2
    q_chunks = triton.cdiv(Hq, per_program)
    n_chunks = q_chunks + triton.cdiv(Hk, per_program)
    return block_half, block_s, n_blocks, per_program, q_chunks, n_chunks, per_step, num_warps


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


def _launch(q, k, q_out, k_out, cos, sin, bshd: bool, backward: bool) -> None:
    """Rotate q into q_out and k into k_out; k and k_out None rotate q alone."""
    B, D = q.shape[0], q.shape[3]
    S, Hq = (q.shape[1], q.shape[2]) if bshd else (q.shape[2], q.shape[1])
    Hk = 0 if k is None else k.shape[2 if bshd else 1]
    if k is None:
        k = k_out = q
    if B == 0 or S == 0 or D == 0 or Hq + Hk == 0:
        return
    block_half, block_s, n_blocks, per_program, q_chunks, n_chunks, per_step, num_warps = _launch_shape(
        B, S, Hq, Hk, D, q.element_size(), bshd, q.device.index or 0)
    _launch_rope(
        (B * n_blocks * n_chunks,), q, k, q_out, k_out, cos, sin,
        S, Hq, Hk, n_blocks, q_chunks, n_chunks, per_program,
        *_head_strides(q, bshd), *_head_strides(k, bshd), *_head_strides(q_out, bshd), *_head_strides(k_out, bshd),
        *_table_strides(cos), *_table_strides(sin),
        HALF=D // 2, BLOCK_HALF=block_half, BLOCK_S=block_s, HEADS_PER_STEP=per_step, BACKWARD=backward,
        INDEX_64=runtime.needs_int64(q, k, q_out, k_out, cos, sin), num_warps=num_warps,
    )


def _fake_rope_fwd(q, k, cos, sin, bshd):
    return torch.empty_like(q), torch.empty_like(k)


@runtime.custom_op("rope_fwd", fake=_fake_rope_fwd)
def rope_fwd(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
             bshd: bool) -> tuple[torch.Tensor, torch.Tensor]:
    q_out, k_out = runtime.empty_like(q), runtime.empty_like(k)
    _launch(q, k, q_out, k_out, cos, sin, bshd, backward=False)
    return q_out, k_out


def _fake_rope_fwd_inplace(q, k, cos, sin, bshd):
    return None


@runtime.custom_op("rope_fwd_inplace", fake=_fake_rope_fwd_inplace, mutates_args=("q", "k"))
def rope_fwd_inplace(q: torch.Tensor, k: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                     bshd: bool) -> None:
    _launch(q, k, q, k, cos, sin, bshd, backward=False)
    # The kernel writes behind autograd's back: bump the version counters as torch's own in-place
    # ops do, so that a graph that saved q or k for its backward raises instead of going wrong.
    torch.autograd.graph.increment_version(q if k is None else (q, k))


def _fake_rope_bwd(dq, dk, cos, sin, bshd):
    return [torch.empty_like(d) for d in (dq, dk) if d is not None]


@runtime.custom_op("rope_bwd", fake=_fake_rope_bwd)
def rope_bwd(dq: torch.Tensor, dk: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
             bshd: bool) -> list[torch.Tensor]:
    """[dq_in, dk_in], or [dq_in] when dk is None."""
    dq_in, dk_in = runtime.empty_like(dq), None if dk is None else runtime.empty_like(dk)
    _launch(dq, dk, dq_in, dk_in, cos, sin, bshd, backward=True)
    return [dq_in] if dk is None else [dq_in, dk_in]


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
    for name, t in (("cos", cos), ("sin", sin)):
        runtime.check_tensor(name, t, TABLE_DTYPES)
    runtime.check_same_device(q=q, k=k, cos=cos, sin=sin)
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
    for name, t in (("cos", cos), ("sin", sin)):
        shared = t.dim() == 2 and t.shape == (S, D)
        if not (shared or t.dim() == 3 and t.shape[0] in (1, B) and t.shape[1:] == (S, D)):
            raise ValueError(f"{name} has shape {tuple(t.shape)}; for q of shape {tuple(q.shape)} ({layout}) it "
                             f"must be ({S}, {D}), (1, {S}, {D}) or ({B}, {S}, {D})")
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
            return RopeFunction.apply(q, k, cos, sin, bshd)
        if torch.compiler.is_compiling():
            # AOT autograd refuses a Function that writes into a view; a compiled graph
            # functionalizes the writes anyway, so torch's own copy_ costs nothing more there.
            q_out, k_out = RopeFunction.apply(q, k, cos, sin, bshd)
            return q.copy_(q_out), k.copy_(k_out)
        _check_writable("q", q)
        _check_writable("k", k)
        return RopeInplaceFunction.apply(q, cos, sin, bshd), RopeInplaceFunction.apply(k, cos, sin, bshd)
    if inplace:
        rope_fwd_inplace(q, k, cos, sin, bshd)
        return q, k
    return rope_fwd(q, k, cos, sin, bshd)


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


def _heads(shape_bhsd, layout, dtype, device, view=None):
    """A (B, H, S, D) tensor in `layout` order of random values; `view` makes it non-contiguous:
    "transposed" stores it in the other layout's order, "sliced" takes it from a wider last dim,
    "strided" gives the head dimension a stride of 2."""
    B, H, S, D = shape_bhsd
    shape = (B, H, S, D) if layout == "bhsd" else (B, S, H, D)
    if view == "transposed":
        return torch.randn(shape[0], shape[2], shape[1], D, device=device).to(dtype).transpose(1, 2)
    if view == "sliced":
        return torch.randn(*shape[:3], D + 6, device=device).to(dtype)[..., 3:D + 3]
    if view == "strided":
        return torch.randn(*shape[:3], 2 * D, device=device).to(dtype)[..., ::2]
    return torch.randn(shape, device=device).to(dtype)


def _table(shape, dtype, device, transposed=False):
    """Random cos/sin-like values in [-1, 1] whose two halves differ (no cat(freqs, freqs))."""
    if transposed:
        return (torch.rand(shape[::-1], device=device) * 2 - 1).to(dtype).mT
    return (torch.rand(shape, device=device) * 2 - 1).to(dtype)


def _test_cases() -> list[TestCase]:
    def case(id, dtype, B, Hq, Hk, S, D, layout="bhsd", table="shared", table_dtype=None,
             q_view=None, k_view=None, gpu_only=False):
        def make(device):
            q = _heads((B, Hq, S, D), layout, dtype, device, q_view).requires_grad_(True)
            k = _heads((B, Hk, S, D), layout, dtype, device, k_view).requires_grad_(True)
            tdtype = table_dtype or dtype
            if table == "shared":
                cos, sin = _table((S, D), tdtype, device), _table((S, D), tdtype, device)
            elif table == "one":
                cos, sin = _table((1, S, D), tdtype, device), _table((1, S, D), tdtype, device)
            elif table == "batch":
                cos, sin = _table((B, S, D), tdtype, device), _table((B, S, D), tdtype, device)
            else:  # "mixed": a transposed float32 cos, an expanded bfloat16 sin
                cos = _table((S, D), torch.float32, device, transposed=True)
                sin = _table((1, S, D), torch.bfloat16, device).expand(B, S, D)
            return (q, k, cos, sin), {"layout": layout}
        return TestCase(id, make, dtype, gpu_only=gpu_only)

    cases = []
    for dt in runtime.FLOAT_DTYPES:
        name = short_dtype(dt)
        cases += [
            case(f"{name}-bhsd-gqa", dt, 2, 4, 2, 13, 32),
            case(f"{name}-bshd-batch-table", dt, 2, 3, 1, 9, 16, layout="bshd", table="batch"),
            case(f"{name}-bhsd-2x32/8x1024x128", dt, 2, 32, 8, 1024, 128, table="one", gpu_only=True),
            case(f"{name}-bshd-2x32/8x1024x128", dt, 2, 32, 8, 1024, 128, layout="bshd", table="batch",
                 gpu_only=True),
        ]
    cases += [
        # Several position blocks (the last one partial), two chunks of q heads of two steps
        # each, a k chunk with a masked half step.
        case("fp32-blocks-and-chunks", torch.float32, 2, 12, 2, 20, 64, table="one"),
        case("bf16-views-bhsd", torch.bfloat16, 2, 4, 2, 11, 32, q_view="transposed", k_view="sliced",
             table="mixed"),
        case("fp16-strided-bshd", torch.float16, 2, 3, 2, 7, 16, layout="bshd", q_view="strided",
             k_view="transposed", table="batch", table_dtype=torch.float32),
        # D/2 = 12 is not a power of two; Hq is not a multiple of Hk.
        case("fp16-d24-h5/3", torch.float16, 1, 5, 3, 6, 24),
        case("fp32-d2", torch.float32, 2, 2, 1, 3, 2, layout="bshd"),
        case("fp32-empty-seq", torch.float32, 2, 3, 1, 0, 8),
        case("bf16-bshd-2x28/4x4096x128-views", torch.bfloat16, 2, 28, 4, 4096, 128, layout="bshd",
             q_view="sliced", k_view="transposed", table="mixed", gpu_only=True),
    ]
    return cases


def _bench_table(S, D, dtype):
    """HF's default rotary table for positions 0..S-1: (1, S, D) cos and sin."""
    inv_freq = 1.0 / 10000 ** (torch.arange(0, D, 2, device=runtime.DEVICE, dtype=torch.float32) / D)
    freqs = torch.arange(S, device=runtime.DEVICE, dtype=torch.float32)[:, None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)[None]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _bench_setup(B, Hq, Hk, S, D, layout, dtype, backward):
    q = _heads((B, Hq, S, D), layout, dtype, runtime.DEVICE).requires_grad_(backward)
    k = _heads((B, Hk, S, D), layout, dtype, runtime.DEVICE).requires_grad_(backward)
    cos, sin = _bench_table(S, D, dtype)
    lg = peers.liger()
    # Liger takes (B, H, S, D) views and writes in place when their memory is (B, S, H, D).
    to_liger = (lambda t: t.transpose(1, 2)) if layout == "bshd" else (lambda t: t)
    forwards = {
        "tritonformer": lambda: apply_rope(q, k, cos, sin, layout),
        "torch": lambda: apply_rope_reference(q, k, cos, sin, layout),
        "torch.compile": peers.compiled(apply_rope_reference, q, k, cos, sin, layout),
        "liger": (lambda: lg.LigerRopeFunction.apply(to_liger(q), to_liger(k), cos, sin, None, 1)) if lg else None,
    }
    q64, k64, cos64, sin64 = (t.detach().double().requires_grad_(t.requires_grad) for t in (q, k, cos, sin))
    if not backward:
        return Bench(providers=peers.available(forwards),
                     reference=lambda: apply_rope_reference(q64, k64, cos64, sin64, layout))

    dq, dk = torch.randn_like(q), torch.randn_like(k)

    def fwd_bwd(forward, grads=(dq, dk)):
        return None if forward is None else lambda: torch.autograd.grad(forward(), (q, k), grads)

    providers = {name: fwd_bwd(fn) for name, fn in forwards.items() if name != "liger"}
    providers["liger"] = fwd_bwd(forwards["liger"], (to_liger(dq), to_liger(dk)))
    return Bench(
        providers=peers.available(providers),
        reference=lambda: torch.autograd.grad(apply_rope_reference(q64, k64, cos64, sin64, layout), (q64, k64),
                                              (dq.double(), dk.double())),
    )


def _bench_cases() -> list[BenchCase]:
    cases = []
    grid = [  # B, Hq, Hk, S, D, layout, dtype
        (1, 4, 2, 64, 32, "bhsd", torch.bfloat16),
        (4, 32, 8, 4096, 128, "bhsd", torch.bfloat16),
        (1, 32, 8, 8192, 128, "bhsd", torch.bfloat16),
        (4, 32, 8, 4096, 128, "bshd", torch.bfloat16),
        (4, 32, 8, 4096, 128, "bhsd", torch.float32),
    ]
    for B, Hq, Hk, S, D, layout, dtype in grid:
        size = B * (Hq + Hk) * S * D * dtype.itemsize
        table = 2 * S * D * dtype.itemsize
        for mode, passes, title in (("fwd", 1, "forward"), ("fwd+bwd", 2, "forward+backward")):
            setup = functools.partial(_bench_setup, B, Hq, Hk, S, D, layout, dtype, mode == "fwd+bwd")
            cases.append(BenchCase("rope", mode, dtype, f"{B}x{Hq}/{Hk}x{S}x{D} {layout}", B * S, setup,
                                   bytes=passes * (2 * size + table), plot=f"{title} {short_dtype(dtype)} {layout}",
                                   quick=S == 64))
    return cases


SPEC = OpSpec(
    name="rope",
    fn=apply_rope,
    reference=apply_rope_reference,
    test_cases=_test_cases,
    bench_cases=_bench_cases,
    compare="elementwise",
)
