"""Block-scaled low-precision formats: mxfp8, mxfp4 (OCP Microscaling v1.0) and nvfp4.

    q = quantize(x, "mxfp8")        # blocks of 32 along the last axis (axis=... picks another)
    x2 = dequantize(q)              # float32 by default (a Triton kernel; dequantize_reference in PyTorch)

| format | element | block | block scale | tensor scale |
|---|---|---|---|---|
| mxfp8 | fp8 e4m3 (max 448), one a byte | 32 | e8m0: 2^(byte - 127), byte 255 = NaN | - |
| mxfp4 | fp4 e2m1 (0, 0.5, 1, 1.5, 2, 3, 4, 6), two a byte | 32 | e8m0 | - |
| nvfp4 | fp4 e2m1, two a byte | 16 | fp8 e4m3 | float32 |

Rounding and saturation:
- MX (OCP MX v1.0, section 6.3): the block's scale is 2^(floor(log2(amax)) - emax), emax being
  the element format's largest exponent (8 for e4m3, 2 for e2m1), the exponent clamped to
  [-126, 127] (the spec's e8m0 also has 2^-127; blocks whose amax is under 2^-118 get 2^-126
  instead, which changes no element). Elements are x / scale rounded to nearest, ties to even,
  and saturated to the element's largest magnitude (amax / scale reaches 2^(emax+1), above it).
  A block holding a NaN or an infinity gets the NaN scale (byte 255) and zero elements: it
  dequantizes to NaN. An all-zero block gets 2^-126 and zero elements. Inputs below float32's
  smallest normal (2^-126) are flushed to +0 first, in every format, and an element that
  rounds to zero is stored as +0.
- nvfp4 (NVIDIA's recipe): tensor scale s = amax(x) / (448 * 6) (1 for an all-zero tensor);
  block scale = e4m3(amax(block) / 6 / s), rounded to nearest even (it cannot exceed 448);
  elements = e2m1(x * r) with r = min(1 / (block scale * s), float32's max), correctly rounded
  once a block: a multiply an element, as NVIDIA's TransformerEngine quantizes (a division would
  differ only within an ulp of a rounding tie, and for products under 2^-128); rounded to
  nearest even and saturated at 6; a block whose scale rounds to 0 has zero elements.
  Non-finite inputs are not supported by the recipe (its tensor scale is then meaningless).
  Dequantized: element times block scale (exact in float32), times the tensor scale (one
  rounding).

Storage: `data` is (rows, K) float8_e4m3fn for mxfp8, or (rows, K / 2) uint8 for the fp4
formats, the element of even index in the low nibble (sign in bit 3, then 2 exponent bits, 1
mantissa bit); `scales` is (rows, K / block), uint8 e8m0 bytes or float8_e4m3fn. Rows are every
index of the other axes, in order (the quantized axis moved last). `to_blocked` /
`from_blocked` convert scales to and from the 5D layout block-scaled tensor cores read,
(rows / 128, cols / 4, 32, 4, 4), rows padded to 128 and scale columns to 4 with zeros.

The quantize kernel rounds to e2m1 with one float32 addition of a magic number (see
`_e2m1_code`), to e4m3 on the GPU with its conversion instruction (cvt.rn.satfinite, nearest even);
Triton 3.6's interpreter rounds fp8 conversions half up, so there it rounds to e4m3 with float32
arithmetic and converts only exact values. nvfp4 reads x twice: a first kernel takes the tensor's
amax, which every block scale needs; given `tensor_amax` (calibrated, or a step behind), it
reads x once, and a block scale that would pass 448 saturates there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import runtime  # first: it picks the interpreter before triton is imported

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

FORMATS = {
    # name: (block size, element max, MX emax of the element or None for nvfp4's e4m3 scale)
    "mxfp8": (32, 448.0, 8),
    "mxfp4": (32, 6.0, 2),
    "nvfp4": (16, 6.0, None),
}
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
MIN_SCALE_EXP = -126
NAN_SCALE = 255
NVFP4_TENSOR_DIV = 448.0 * 6.0
# The storage of scales (held weakly) -> {(layout, view): (version, copy)}: see _scales_copy
_SCALE_COPIES = torch.utils.weak.WeakIdKeyDictionary()


def _layout(t: torch.Tensor) -> str:
    return f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)} on {t.device}"


@dataclass(repr=False)
class QuantizedTensor:
    """A block-scaled tensor: see the module doc for the layout of `data` and `scales`."""

    data: torch.Tensor
    scales: torch.Tensor
    fmt: str
    shape: torch.Size  # the logical (unquantized) shape
    axis: int  # the quantized axis of `shape`, non-negative
    tensor_scale: torch.Tensor | None = None  # nvfp4's float32 scalar

    def __repr__(self) -> str:
        # The tensors' layouts, not their values: a weight's repr would print megabytes.
        parts = [f"{self.fmt!r}", f"shape={tuple(self.shape)}", f"axis={self.axis}",
                 f"data={_layout(self.data)}", f"scales={_layout(self.scales)}"]
        if self.tensor_scale is not None:
            parts.append(f"tensor_scale={_layout(self.tensor_scale)}")
        return f"QuantizedTensor({', '.join(parts)})"

    def _scales_copy(self, layout, make) -> torch.Tensor:
        """The copy of `scales` that `make(scales)` returns, kept for the next call while `scales`
        views the same memory, unmodified. The copies live with that memory (its storage, which
        dtype views share: they have no view base), not with this object: a QuantizedLinear, or
        a compiled graph, makes a new QuantizedTensor over its buffers in every call and still
        pays for the copy once, and an in-place change of the scales (a load_state_dict into the
        buffer) makes a fresh one. Inference tensors carry no version counter; they cannot change
        outside inference mode."""
        scales = self.scales
        copies = _SCALE_COPIES.setdefault(scales.untyped_storage(), {})
        key = layout, scales.data_ptr(), scales.shape, scales.stride(), scales.dtype
        version = None if scales.is_inference() else scales._version
        kept = copies.get(key)
        if kept is None or kept[0] != version:
            kept = copies[key] = version, make(scales)
        return kept[1]

    def blocked_scales(self) -> torch.Tensor:
        """`scales` in the 5D layout (to_blocked) that sm_100's block-scaled MMA reads (kept: see
        _scales_copy)."""
        return self._scales_copy("blocked", to_blocked)

    def scales_by_step(self, step: int) -> torch.Tensor:
        """`scales` (rows, K // block) regrouped by steps of `step` elements of K (a multiple of the
        block that divides K): (K // step, rows, step // block), contiguous, so that the scales of
        one step of consecutive rows are consecutive bytes (Hopper's weight-only wgmma kernel reads
        them so). Kept: see _scales_copy."""
        def by_step(scales):
            rows, blocks = scales.shape
            per_step = step // self.block
            return scales.reshape(rows, blocks // per_step, per_step).transpose(0, 1).contiguous()
        return self._scales_copy(("by_step", step), by_step)

    @property
    def block(self) -> int:
        return FORMATS[self.fmt][0]

    def layout_key(self) -> tuple:
        """What a launch planned for this tensor depends on (runtime.call_key): the format, the
        logical shape and axis (which give data's and scales' shapes and dtypes), their strides,
        16-byte alignments and device, and the tensor scale's presence and alignment."""
        data, scales, tensor_scale = self.data, self.scales, self.tensor_scale
        return (self.fmt, tuple(self.shape), self.axis, data.stride(), scales.stride(), data.data_ptr() % 16,
                scales.data_ptr() % 16, data.device, None if tensor_scale is None else tensor_scale.data_ptr() % 16)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize(self, dtype)


def _check_format(fmt: str) -> None:
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {', '.join(FORMATS)}, got {fmt!r}")


def _axis(axis: int, x: torch.Tensor) -> int:
    """axis in [0, x.dim()), or a ValueError naming it (x % dim would quantize another axis)."""
    if not -x.dim() <= axis < x.dim():
        raise ValueError(f"axis {axis} is out of range for x of {x.dim()} dimensions")
    return axis % x.dim()


def _rows_view(x: torch.Tensor, axis: int) -> torch.Tensor:
    """x with `axis` moved last, as (rows, K) contiguous."""
    K = x.shape[axis]
    return x.movedim(axis, -1).reshape(x.numel() // K if K else 0, K).contiguous()


# ---- the kernel ----

# The GPU rounds with its own instructions: e4m3 by cvt.rn.satfinite (nearest even, saturating at
# 448), nvfp4's block-scale quotients by a multiply and two FMAs. Triton 3.6's interpreter rounds
# fp8 conversions half up and evaluates tl.fma with two roundings: there (runtime.COMPILED off)
# the kernel rounds to e4m3 with float32 arithmetic and divides with div_rn.

_FLOAT32_MAX = tl.constexpr(3.4028234663852886e38)
_FLOAT32_MIN_NORMAL = tl.constexpr(1.1754943508222875e-38)
# nvfp4 takes its block scales' quotients from reciprocals, and flushes no subnormal, from this
# tensor scale up: see _nvfp4_fast.
_NVFP4_FAST_SCALE = tl.constexpr(2.0**-80)
_NVFP4_TENSOR_DIV = tl.constexpr(NVFP4_TENSOR_DIV)


@triton.jit
def _pow2(e):
    """2^e as float32 for integer e in [-126, 127], from its bits (exact)."""
    return ((tl.cast(e, tl.int32) + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _max_keeping_nan(a, b):
    """tl.max's combine skips NaN; a block holding one must have a NaN amax."""
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _row_amax(a):
    """Each row's maximum of a (rows, cols) block of magnitudes, NaN where the row holds one."""
    if runtime.COMPILED:
        return tl.reduce(a, 1, _max_keeping_nan)
    # The interpreter runs a custom combine element by element in Python (docs/runtime.md):
    # a row's sum is NaN exactly where the row holds a NaN.
    total = tl.sum(a, axis=1)
    return tl.where(total != total, float("nan"), tl.max(a, axis=1))


@triton.jit
def _load_pairs(x_ptr, offsets, mask):
    """The elements 2 i and 2 i + 1 of x (i = offsets) as float32, each pair read as one word: the
    fp4 formats store the two codes of a pair in one byte, and this way no reshape of the tile
    stands between the load and the store, which then share one layout (no shuffle through shared
    memory). x's address must be a multiple of the word."""
    if x_ptr.dtype.element_ty == tl.float32:
        w = tl.load(x_ptr.to(tl.pointer_type(tl.int64), bitcast=True) + offsets, mask=mask, other=0)
        lo = w.to(tl.int32).to(tl.float32, bitcast=True)
        hi = (w >> 32).to(tl.int32).to(tl.float32, bitcast=True)
    else:
        w = tl.load(x_ptr.to(tl.pointer_type(tl.int32), bitcast=True) + offsets, mask=mask, other=0)
        if x_ptr.dtype.element_ty == tl.bfloat16:
            lo = (w << 16).to(tl.float32, bitcast=True)
            hi = (w & -65536).to(tl.float32, bitcast=True)
        else:
            lo = w.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
            hi = (w >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return lo, hi


@triton.jit
def _mx_scale(amax, EMAX: tl.constexpr, HALF_STEP: tl.constexpr):
    """A block's e8m0 scale byte, its exponent, and `low`: the elements kept are those with
    |x| > low, the normal ones (subnormals flush to +0) whose x / scale does not round to zero, that
    is exceeds half the element's smallest step, 2^-HALF_STEP; none in a non-finite block (low NaN).
    The others become +0, so a kept element's sign is its code's."""
    finite = amax <= _FLOAT32_MAX
    # At most 127 - EMAX <= 125 for a finite amax: the spec's clamp at 127 never acts, and 125 keeps
    # 6 * 2^exp finite in a non-finite block (where no element is kept).
    exp = tl.minimum(tl.maximum((amax.to(tl.int32, bitcast=True) >> 23) - 127 - EMAX, -126), 125)
    low = tl.maximum((exp - HALF_STEP + 127) << 23, 0x007FFFFF).to(tl.float32, bitcast=True)
    return tl.where(finite, exp + 127, 255).to(tl.uint8), exp, tl.where(finite, low, float("nan"))


@triton.jit
def _mx_kept(x, low):
    """x where it is kept (see _mx_scale), else +0."""
    return tl.where(tl.abs(x) > low[:, None], x, 0.0)


@triton.jit
def _to_e4m3(v):
    """float32 v (finite) to e4m3, nearest with ties to even, saturating at 448. Interpreter: adding
    and subtracting 2^(exponent + 20) leaves 3 mantissa bits (normals), and below 2^-6 the spacing
    of e4m3's subnormals, 2^-9; the exact result converts."""
    if runtime.COMPILED:
        q = v.to(tl.float8e4nv)
    else:
        a = tl.minimum(tl.abs(v), 448.0)
        exp_bits = tl.maximum(a.to(tl.int32, bitcast=True) & 0x7F800000, (127 - 6) << 23)
        magic = (exp_bits + (20 << 23)).to(tl.float32, bitcast=True)
        r = (a + magic) - magic
        q = tl.where(v < 0, -r, r).to(tl.float8e4nv)
    return q


@triton.jit
def _e2m1_code(a, exp):
    """a / 2^exp (a float32 from 0 to 6 * 2^exp, exp an integer in [-126, 125]) to the e2m1
    magnitude code 0-7 (values 0, .5, 1, 1.5, 2, 3, 4, 6), nearest with ties to even, in bits 0-2
    of the result (bits 3-22 are 0, the ones above are not). y + M, M of exponent 22 + e,
    e = max(the exponent of y = a / 2^exp, 0), rounds y once to e2m1's spacing there, 2^(e - 1),
    and adds v = that rounded y / 2^(e - 1) to M's mantissa (0-4 for e = 0, 2-4 above); the code is
    v + 2e, so M's mantissa is 2e (even: ties still go to the even code). With t = 127 + e + exp
    from a's bits, M's bits are (t - exp) (2^23 + 2) + 22 * 2^23 - 254: one multiply-add; y + M is
    one FMA (a / 2^exp is exact, so the interpreter's two roundings give the same sum)."""
    t = tl.maximum(a.to(tl.int32, bitcast=True), (exp + 127) << 23) >> 23
    magic = t * ((1 << 23) + 2) + ((22 << 23) - 2 * 127 - exp * ((1 << 23) + 2))
    return tl.fma(a, _pow2(-exp), magic.to(tl.float32, bitcast=True)).to(tl.int32, bitcast=True)


@triton.jit
def _mxfp4_code(x, exp):
    """x's code (+0 or kept: see _mx_scale) in a block of scale exponent exp, the sign in bit 3."""
    a = tl.minimum(tl.abs(x), 6.0 * _pow2(exp)[:, None])
    return _e2m1_code(a, exp[:, None]) | ((x.to(tl.int32, bitcast=True) >> 28) & 8)


@triton.jit
def _nvfp4_code(q):
    """The code of q = x r (the element times its block's reciprocal; sign in bit 3), saturated at
    6; +0 where |q| rounds to 0."""
    code = _e2m1_code(tl.minimum(tl.abs(q), 6.0), 0)
    # Bits 3-22 of code are 0, so bit 3 of code + 7 is set exactly when its bits 0-2 are not.
    return code | ((q.to(tl.int32, bitcast=True) >> 28) & (code + 7) & 8)


@triton.jit
def _div_by_reciprocal(x, d, r):
    """x / d correctly rounded from r, 1 / d correctly rounded (Markstein: with no underflow, the
    residual x - q d of q = x r is exact, and q + residual * r rounds to the quotient)."""
    q = x * r
    return tl.fma(tl.fma(q, -d, x), r, q)


@triton.jit
def _nvfp4_block_reciprocal(scale, s):
    """The elements' factor r = 1 / (block scale * s) correctly rounded, at most float32's max (the
    product can be under 2^-128 when s is tiny), 0 where the product is 0."""
    d = scale.to(tl.float32) * s
    return tl.where(d > 0, tl.minimum(tl.math.div_rn(1.0, tl.where(d > 0, d, 1.0)), _FLOAT32_MAX), 0.0)[:, None]


@triton.jit
def _nvfp4_exact(lo, hi, amax, s):
    """Block scales (e4m3) from block amaxes and tensor scale s with IEEE divisions, and the
    elements (subnormals flushed) times their block's reciprocal."""
    scale = _to_e4m3(tl.math.div_rn(tl.math.div_rn(amax, 6.0), s))
    r = _nvfp4_block_reciprocal(scale, s)
    lo = tl.where(tl.abs(lo) < _FLOAT32_MIN_NORMAL, 0.0, lo)
    hi = tl.where(tl.abs(hi) < _FLOAT32_MIN_NORMAL, 0.0, hi)
    return scale, lo * r, hi * r


@triton.jit
def _nvfp4_fast(lo, hi, amax, s):
    """_nvfp4_exact with the block scales' divisions by reciprocals (correctly rounded: 1 / 6 and
    1 / s once), for s >= _NVFP4_FAST_SCALE, and no flush. Then the product d of a block scale
    (at least 2^-9) and s is at least 2^-89 or 0: a subnormal element times 1 / d is under 2^-37,
    code 0 flushed or not; and no residual underflows where it matters (amax / 6 and / s decide a
    scale only from a quotient of 2^-11 up). amax is clamped where the scale saturates anyway (at
    4096 s), so that no product overflows when a given tensor amax is below the blocks'."""
    amax = tl.minimum(amax, 4096.0 * s)
    scale = _to_e4m3(_div_by_reciprocal(_div_by_reciprocal(amax, 6.0, 1.0 / 6.0), s, tl.math.div_rn(1.0, s)))
    r = _nvfp4_block_reciprocal(scale, s)
    return scale, lo * r, hi * r


@triton.jit
def _nvfp4_quantize(lo, hi, amax, s):
    """(block scales, codes of lo, codes of hi); the GPU takes _nvfp4_fast where it is exact."""
    if runtime.COMPILED:
        if s >= _NVFP4_FAST_SCALE:
            scale, q_lo, q_hi = _nvfp4_fast(lo, hi, amax, s)
        else:
            scale, q_lo, q_hi = _nvfp4_exact(lo, hi, amax, s)
    else:
        scale, q_lo, q_hi = _nvfp4_exact(lo, hi, amax, s)
    return scale, _nvfp4_code(q_lo), _nvfp4_code(q_hi)


@triton.jit
def _quantize_kernel(x_ptr, data_ptr, scale_ptr, amax_ptr, tensor_scale_ptr, n_blocks, FMT: tl.constexpr,
                     VEC: tl.constexpr, EMAX: tl.constexpr, BLOCKS: tl.constexpr):
    """BLOCKS scale blocks of VEC elements per program, of the n_blocks that x (rows of a multiple
    of VEC elements), data and scales hold back to back: any row length gives full tiles. nvfp4:
    the tensor's amax at amax_ptr in, its scale at tensor_scale_ptr out (from the first program)."""
    pid = tl.program_id(0)
    if FMT == "nvfp4":
        # Last blocks first: _amax_kernel read them last, so they may still be in L2.
        pid = tl.num_programs(0) - 1 - pid
    first = pid.to(tl.int64) * BLOCKS
    x_ptr += first * VEC
    data_ptr += first * (VEC if FMT == "mxfp8" else VEC // 2)
    scale_ptr += first
    blk = tl.arange(0, BLOCKS)
    ok = blk < n_blocks - first
    if FMT == "mxfp8":
        cols = blk[:, None] * VEC + tl.arange(0, VEC)[None, :]
        x = tl.load(x_ptr + cols, mask=ok[:, None], other=0.0).to(tl.float32)
        amax = _row_amax(tl.abs(x))
    else:
        pairs = blk[:, None] * (VEC // 2) + tl.arange(0, VEC // 2)[None, :]
        lo, hi = _load_pairs(x_ptr, pairs, ok[:, None])
        amax = _row_amax(tl.maximum(tl.abs(lo), tl.abs(hi), propagate_nan=tl.PropagateNan.ALL))
    if FMT == "nvfp4":
        tensor_amax = tl.load(amax_ptr)
        s = tl.where(tensor_amax >= _FLOAT32_MIN_NORMAL, tl.math.div_rn(tensor_amax, _NVFP4_TENSOR_DIV), 1.0)
        # A given amax tensor is not read on the host (that would wait for the GPU): a negative,
        # NaN or infinite one makes the tensor scale NaN, so that everything made from it is NaN.
        s = tl.where((tensor_amax >= 0) & (tensor_amax <= _FLOAT32_MAX), s, float("nan"))
        tl.store(tensor_scale_ptr, s, mask=tl.program_id(0) == 0)
        amax = tl.where(amax < _FLOAT32_MIN_NORMAL, 0.0, amax)  # subnormals flush to zero
        scale, code_lo, code_hi = _nvfp4_quantize(lo, hi, amax, s)
    else:
        scale, exp, low = _mx_scale(amax, EMAX, 10 if FMT == "mxfp8" else 2)
        if FMT == "mxfp8":
            y = _mx_kept(x, low) * _pow2(-exp)[:, None]
            tl.store(data_ptr + cols, _to_e4m3(y), mask=ok[:, None])
        else:
            code_lo = _mxfp4_code(_mx_kept(lo, low), exp)
            code_hi = _mxfp4_code(_mx_kept(hi, low), exp)
    tl.store(scale_ptr + blk, scale, mask=ok)
    if FMT != "mxfp8":
        tl.store(data_ptr + pairs, ((code_lo & 15) | (code_hi << 4)).to(tl.uint8), mask=ok[:, None])


_launch_quantize = runtime.FastLaunch(_quantize_kernel)


@triton.jit
def _amax_kernel(x_ptr, amax_ptr, n, TILE: tl.constexpr):
    """amax_ptr[0] = max(amax_ptr[0], |x|) over x's n elements (finite: NaN is not ordered here, as
    nvfp4 takes no non-finite input). The programs stride over the tiles together, so the tiles
    read last are the tensor's last, which the nvfp4 quantize kernel reads first."""
    acc = tl.zeros([TILE], tl.float32)
    for start in range(tl.program_id(0) * TILE, n, tl.num_programs(0) * TILE):
        offs = start + tl.arange(0, TILE)
        acc = tl.maximum(acc, tl.abs(tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)))
    tl.atomic_max(amax_ptr, tl.max(acc, 0))


_launch_amax = runtime.FastLaunch(_amax_kernel)


# ---- decoding (the dequantize kernel and scaled_matmul's tiles) ----

@triton.jit
def _block_scales(scale_ptr, rows, n_rows, k0, K, stride_scale, FMT: tl.constexpr, VEC: tl.constexpr,
                  BLOCK_K: tl.constexpr):
    """(rows, BLOCK_K // VEC) float32 block scales from their bytes; rows past n_rows read 0."""
    blocks = k0 // VEC + tl.arange(0, BLOCK_K // VEC)
    ok = (rows[:, None] < n_rows) & (blocks[None, :] < K // VEC)
    return block_scale_values(tl.load(scale_ptr + rows[:, None] * stride_scale + blocks[None, :], mask=ok, other=0),
                              FMT)


@triton.jit
def block_scale_values(raw, FMT: tl.constexpr):
    """float32 block scales of FMT from their bytes (uint8)."""
    if FMT == "nvfp4":
        # e4m3 scales arrive as their bytes (a masked fp8 load's zero fill fails in the interpreter).
        return raw.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    exp = raw.to(tl.int32)
    # e8m0: 2^(byte - 127) from its bits; byte 255 is NaN, byte 0 float32's subnormal 2^-127 (quantize
    # does not produce it, MX data from elsewhere may hold it).
    return tl.where(exp == 255, float("nan"), tl.where(exp == 0, 1 << 22, exp << 23).to(tl.float32, bitcast=True))


@triton.jit
def _packed_bytes(data_ptr, rows, n_rows, k0, K, stride_data, BLOCK_K: tl.constexpr):
    """(rows, BLOCK_K // 2) bytes of an fp4 operand, two e2m1 codes each; out of range reads 0."""
    half = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    ok = (rows[:, None] < n_rows) & (half[None, :] < K // 2)
    return tl.load(data_ptr + rows[:, None] * stride_data + half[None, :], mask=ok, other=0)


@triton.jit
def _element_bytes(data_ptr, rows, n_rows, k0, K, stride_data, FMT: tl.constexpr, ROWS: tl.constexpr,
                   BLOCK_K: tl.constexpr):
    """(rows, BLOCK_K) of a block-scaled operand stored as (rows, K) elements, one code per
    element: e4m3 bytes for mxfp8; for e2m1 (packed two per byte, low nibble first) float16 bits
    worth 2^-14 times the value: the sign and the 3 magnitude bits moved to float16's places, where
    e2m1's subnormal (0.5) lands on float16's subnormal, so no arithmetic decodes them."""
    # One return statement: with an early return in the mxfp8 branch the sm_90 compile failed.
    if FMT == "mxfp8":
        cols = k0 + tl.arange(0, BLOCK_K)
        ok = (rows[:, None] < n_rows) & (cols[None, :] < K)
        codes = tl.load(data_ptr + rows[:, None] * stride_data + cols[None, :], mask=ok, other=0)
    else:
        lo, hi = _e2m1_f16_bits(_packed_bytes(data_ptr, rows, n_rows, k0, K, stride_data, BLOCK_K).to(tl.int32))
        codes = tl.reshape(tl.join(lo, hi), (ROWS, BLOCK_K)).to(tl.int16)
    return codes


@triton.jit
def _e2m1_f16_bits(packed):
    """(low nibbles, high nibbles) of int32 code bytes as float16 bits (int32) worth 2^-14 times
    their e2m1 values: sign to bit 15, the exponent and mantissa bits to 11..9."""
    lo = ((packed & 0x8) << 12) | ((packed & 0x7) << 9)
    hi = ((packed & 0x80) << 8) | ((packed & 0x70) << 5)
    return lo, hi


# e2m1 to bf16 on the GPU, four elements (two code bytes, each given twice) per instance: the
# magnitude codes pick the high and the low bytes of their bf16 values out of two 8-byte tables
# with byte permutes (prmt), the sign bits are permuted into place, then one bf16x2 multiply by
# the block scales (exact: 2 significant bits times 4). About 4 instructions an element where
# the arithmetic decode takes 10 (sm_90 SASS of the scaled_matmul loop); the interpreter cannot
# run PTX and takes the arithmetic decode.
_E2M1_TO_BF16_PTX = tl.constexpr("""
{
.reg .b32 s, s4, m, h, l, t;
prmt.b32 s, $2, 0, 0x4420;
and.b32 m, s, 0x7777;
prmt.b32 h, 0x3F3F3F00, 0x40404040, m;
prmt.b32 l, 0xC0800000, 0xC0804000, m;
shl.b32 s4, s, 4;
prmt.b32 t, s4, s, 0x4303;
and.b32 t, t, 0x80008000;
prmt.b32 $0, l, h, 0x5140;
or.b32 $0, $0, t;
mul.rn.bf16x2 $0, $0, $3;
prmt.b32 t, s4, s, 0x5313;
and.b32 t, t, 0x80008000;
prmt.b32 $1, l, h, 0x7362;
or.b32 $1, $1, t;
mul.rn.bf16x2 $1, $1, $4;
}
""")

# The eight e2m1 codes of an int32 word of packed codes (nibble i is element i) to float32 worth
# 2^-14 times their values: shifts and masks place two codes at once, those of bytes 0 and 2 (or
# 1 and 3), in the two float16 halves of a word (the bits as _e2m1_f16_bits), then a conversion a
# value makes it float32. 15 integer instructions for 8 values (the high nibbles of bytes 1 and
# 3 have their sign bits in place already), where the arithmetic on one int32 a value takes about 5.
_E2M1_WORD_TO_F32_PTX = tl.constexpr("""
{
.reg .b32 a, b, h0, h1, h2, h3;
.reg .b16 l0, l1, l2, l3, l4, l5, l6, l7;
shl.b32 a, $8, 9;
shl.b32 b, $8, 12;
and.b32 a, a, 0x0E000E00;
lop3.b32 h0, b, 0x80008000, a, 0xEA;
shl.b32 a, $8, 5;
shl.b32 b, $8, 8;
and.b32 a, a, 0x0E000E00;
lop3.b32 h1, b, 0x80008000, a, 0xEA;
shl.b32 a, $8, 1;
shl.b32 b, $8, 4;
and.b32 a, a, 0x0E000E00;
lop3.b32 h2, b, 0x80008000, a, 0xEA;
shr.b32 a, $8, 3;
and.b32 a, a, 0x0E000E00;
lop3.b32 h3, $8, 0x80008000, a, 0xEA;
mov.b32 {l0, l4}, h0;
mov.b32 {l1, l5}, h1;
mov.b32 {l2, l6}, h2;
mov.b32 {l3, l7}, h3;
cvt.f32.f16 $0, l0;
cvt.f32.f16 $1, l1;
cvt.f32.f16 $2, l2;
cvt.f32.f16 $3, l3;
cvt.f32.f16 $4, l4;
cvt.f32.f16 $5, l5;
cvt.f32.f16 $6, l6;
cvt.f32.f16 $7, l7;
}
""")


@triton.jit
def _nibble_value(words, SHIFT: tl.constexpr):
    """float32 2^-14 times the e2m1 value of the nibble at bit SHIFT of int32 words."""
    lo, _ = _e2m1_f16_bits(words >> SHIFT)
    return lo.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def e2m1_word_values(words):
    """The eight elements of int32 words of packed fp4 codes (element i in nibble i, bits 4i..4i+3),
    as float32 2^-14 times their e2m1 values (exact; float16's subnormal is e2m1's 0.5)."""
    if runtime.COMPILED:
        values = tl.inline_asm_elementwise(_E2M1_WORD_TO_F32_PTX, "=r,=r,=r,=r,=r,=r,=r,=r,r", [words],
                                           dtype=(tl.float32, tl.float32, tl.float32, tl.float32, tl.float32, tl.float32,
                                                  tl.float32, tl.float32), is_pure=True, pack=1)
    else:
        values = (_nibble_value(words, 0), _nibble_value(words, 4), _nibble_value(words, 8),
                  _nibble_value(words, 12), _nibble_value(words, 16), _nibble_value(words, 20),
                  _nibble_value(words, 24), _nibble_value(words, 28))
    return values


# Four e4m3 bytes of an int32 word (byte i is element i) to float32: two conversions of a pair to
# float16 (exact), then one a value to float32.
_E4M3_WORD_TO_F32_PTX = tl.constexpr("""
{
.reg .b16 p0, p1, l0, l1, l2, l3;
.reg .b32 h0, h1;
mov.b32 {p0, p1}, $4;
cvt.rn.f16x2.e4m3x2 h0, p0;
cvt.rn.f16x2.e4m3x2 h1, p1;
mov.b32 {l0, l1}, h0;
mov.b32 {l2, l3}, h1;
cvt.f32.f16 $0, l0;
cvt.f32.f16 $1, l1;
cvt.f32.f16 $2, l2;
cvt.f32.f16 $3, l3;
}
""")


# Register p holds nibble p (low half) and nibble p + 4 (high half) of a word, so one shift places
# both. The sign goes to bit 15 and the 3 magnitude bits to 8..6, which makes each half bf16 worth
# 2^-126 of its value (e2m1's 0.5 is bf16's subnormal 2^-127): 15 integer instructions for 8 codes.
def _e2m1_pair_ptx(word: str, p: int) -> list[str]:
    """PTX lines that leave in register h the bf16 pair of nibbles p and p + 4 of `word`, 2^-126
    of their values (registers a, b and h declared by the caller)."""
    # (left shift of the magnitude bits, of the sign bit) for pairs 0..3; negative: right.
    magnitude, sign = ((6, 12), (2, 8), (-2, 4), (-6, 0))[p]
    lines = [f"shl.b32 a, {word}, {magnitude};" if magnitude > 0 else f"shr.b32 a, {word}, {-magnitude};",
             "and.b32 a, a, 0x01C001C0;"]
    if sign:
        return lines + [f"shl.b32 b, {word}, {sign};", "lop3.b32 h, b, 0x80008000, a, 0xEA;"]
    return lines + [f"lop3.b32 h, {word}, 0x80008000, a, 0xEA;"]


# The eight e2m1 codes of an int32 word as four bf16x2 registers (_e2m1_pair_ptx) times a
# multiplier, for the tensor cores (scaled_matmul's mma kernel): one bf16x2 multiply by $5 (both
# halves the multiplier m), so the registers hold value * m * 2^-126.
def _e2m1_word_times_ptx(times_2_126: bool, halves: bool = False) -> str:
    """With halves, the eight bf16 come out as b16 registers $0..$7 (element i in $i) and the
    inputs are $8 and $9: the layout of Gluon's wgmma operand is built from single elements."""
    word, multiplier = ("$8", "$9") if halves else ("$4", "$5")
    lines = ["{", ".reg .b32 a, b, h, k;", "mov.b32 k, 0x7E807E80;"]  # k: 2^126 in both halves
    for p in range(4):
        lines += _e2m1_pair_ptx(word, p)
        if times_2_126:
            lines.append("mul.rn.bf16x2 h, h, k;")
        if halves:
            lines += [f"mul.rn.bf16x2 h, h, {multiplier};", f"mov.b32 {{${p}, ${p + 4}}}, h;"]
        else:
            lines.append(f"mul.rn.bf16x2 ${p}, h, {multiplier};")
    return "\n".join(lines + ["}"])


# The four e4m3 elements of an int32 word as bf16 times a multiplier, element i in the b16
# register $i (inputs $4, the word, and $5, the multiplier m in both halves), for the wgmma
# operand: a pair to float16 (exact, NaN kept), each half to float32, the two to bf16 (exact:
# e4m3's values are bf16's), then one bf16x2 multiply: value * m, exact inside bf16's range.
E4M3_WORD_TIMES_HALVES_PTX = """
{
.reg .b16 p0, p1, l0, l1;
.reg .b32 h, b;
.reg .f32 f0, f1;
mov.b32 {p0, p1}, $4;
""" + "".join(f"""cvt.rn.f16x2.e4m3x2 h, p{i};
mov.b32 {{l0, l1}}, h;
cvt.f32.f16 f0, l0;
cvt.f32.f16 f1, l1;
cvt.rn.bf16x2.f32 b, f1, f0;
mul.rn.bf16x2 b, b, $5;
mov.b32 {{${2 * i}, ${2 * i + 1}}}, b;
""" for i in range(2)) + "}"

_E2M1_WORD_TIMES_BF16X2_PTX = tl.constexpr(_e2m1_word_times_ptx(False))
# With a first multiply by 2^126 the registers hold value * m, for multipliers m that 2^126 m
# would overflow (e8m0 scales over 2^1).
_E2M1_WORD_TIMES_SCALE_BF16X2_PTX = tl.constexpr(_e2m1_word_times_ptx(True))


# The dot product of a word's eight e2m1 codes with eight bf16 (four pairs: $2 + p holds elements
# p and p + 4), in bf16x2 arithmetic: the codes as 2^-126 of their values (_e2m1_pair_ptx), a
# multiply and three FMAs, the two halves' sums added in float32: 22 instructions for 8 codes
# against 31 through float32 (docs/generate.md, "Block-scaled weights").
_E2M1_WORD_DOT_PTX = tl.constexpr("\n".join(
    ["{", ".reg .b32 a, b, h, s, lo, hi;"]
    + [line for p in range(4) for line in _e2m1_pair_ptx("$1", p)
       + [f"mul.rn.bf16x2 s, h, ${p + 2};" if p == 0 else f"fma.rn.bf16x2 s, h, ${p + 2}, s;"]]
    + ["shl.b32 lo, s, 16;", "and.b32 hi, s, 0xFFFF0000;", "add.f32 $0, lo, hi;", "}"]))


@triton.jit
def e2m1_word_dot(words, x_pairs0, x_pairs1, x_pairs2, x_pairs3):
    """float32 sums over each int32 word of fp4 codes (element i in nibble i) of its codes' e2m1
    values times 2^-126 times eight bf16 x: x_pairs<p> are int32 words holding x_p (low half) and
    x_(p + 4) (high half). The products and the partial sums are rounded to bf16 (x must keep
    them inside bf16's normal range: scale it by a power of two)."""
    if runtime.COMPILED:
        total = tl.inline_asm_elementwise(_E2M1_WORD_DOT_PTX, "=r,r,r,r,r,r",
                                          [words, x_pairs0, x_pairs1, x_pairs2, x_pairs3], dtype=tl.float32,
                                          is_pure=True, pack=1)
    else:
        # The same arithmetic: each half's products and sums rounded to bf16, 2^-126 of the values
        # (e2m1_word_values gives 2^-14: float32's subnormals hold the rest exactly).
        w = e2m1_word_values(words)
        x_lo0, x_hi0 = bf16_pair_values(x_pairs0)
        x_lo1, x_hi1 = bf16_pair_values(x_pairs1)
        x_lo2, x_hi2 = bf16_pair_values(x_pairs2)
        x_lo3, x_hi3 = bf16_pair_values(x_pairs3)
        lo = round_to_bf16(w[0] * 2.0 ** -112 * x_lo0)
        hi = round_to_bf16(w[4] * 2.0 ** -112 * x_hi0)
        lo = round_to_bf16(w[1] * 2.0 ** -112 * x_lo1 + lo)
        hi = round_to_bf16(w[5] * 2.0 ** -112 * x_hi1 + hi)
        lo = round_to_bf16(w[2] * 2.0 ** -112 * x_lo2 + lo)
        hi = round_to_bf16(w[6] * 2.0 ** -112 * x_hi2 + hi)
        lo = round_to_bf16(w[3] * 2.0 ** -112 * x_lo3 + lo)
        hi = round_to_bf16(w[7] * 2.0 ** -112 * x_hi3 + hi)
        total = lo + hi
    return total


@triton.jit
def round_to_bf16(values):
    """float32 values rounded to bf16 (to nearest even; past bf16's largest, infinity), as float32:
    the GPU's conversion; under the interpreter, whose bf16 casts truncate, by the bits."""
    if runtime.COMPILED:
        rounded = values.to(tl.bfloat16).to(tl.float32)
    else:
        bits = values.to(tl.int32, bitcast=True)
        rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)
    return rounded


def int32_words(t: torch.Tensor) -> torch.Tensor:
    """A tensor with unit column stride (bf16 rows, fp4 code bytes) as int32 words of its last
    dimension, copied first where its rows do not start on aligned words (kernels load words)."""
    if t.shape[-1] > 1 and t.stride(-1) != 1 or t.data_ptr() % 4 or any(
            st * t.element_size() % 4 for st in t.stride()[:-1]):
        # clone's default keeps a transposed tensor transposed; contiguous() keeps a one-row view's odd stride.
        t = t.clone(memory_format=torch.contiguous_format)
    return t.view(torch.int32)


@triton.jit
def bf16_bits(values):
    """int32 holding in its low half the bf16 bits of float32 values that bf16 holds exactly."""
    return (values.to(tl.int32, bitcast=True) >> 16) & 0xFFFF


@triton.jit
def bf16_pair_values(pairs):
    """(low, high) float32 values of int32 words holding two bf16 each."""
    return (pairs << 16).to(tl.float32, bitcast=True), (pairs & -65536).to(tl.float32, bitcast=True)


@triton.jit
def bf16_pair_bits(lo, hi):
    """int32 words holding the bf16 bits of float32 lo (low half) and hi (high half), values that
    bf16 holds exactly: bf16_pair_values' inverse."""
    return bf16_bits(lo) | (bf16_bits(hi) << 16)


@triton.jit
def _scaled_nibble_pair(words, SHIFT: tl.constexpr, scale):
    """bf16 pair of the nibbles at bits SHIFT (low half) and SHIFT + 16 (high half) times scale."""
    lo = _nibble_value(words, SHIFT) * 16384.0 * scale
    hi = _nibble_value(words, SHIFT + 16) * 16384.0 * scale
    return bf16_pair_bits(lo, hi)


@triton.jit
def e2m1_word_bf16_pairs(words, multiplier_pairs, TIMES_2_126: tl.constexpr):
    """The eight e2m1 codes of int32 words (element i in nibble i) times a multiplier m, as four
    int32 words of bf16 pairs: word p holds elements p (low half) and p + 4 (high half).
    multiplier_pairs holds m's bf16 bits in both halves. The elements come out as value * m *
    2^-126, or with TIMES_2_126 as value * m (a multiply more); the products must be exact in
    bf16 (an e2m1 value times a power of two or an e4m3 value is, inside bf16's range)."""
    if runtime.COMPILED:
        asm: tl.constexpr = _E2M1_WORD_TIMES_SCALE_BF16X2_PTX if TIMES_2_126 else _E2M1_WORD_TIMES_BF16X2_PTX
        pairs = tl.inline_asm_elementwise(asm, "=r,=r,=r,=r,r,r", [words, multiplier_pairs],
                                          dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True, pack=1)
    else:
        scale = (multiplier_pairs << 16).to(tl.float32, bitcast=True)
        if not TIMES_2_126:
            scale = scale * 2.0 ** -126
        pairs = (_scaled_nibble_pair(words, 0, scale), _scaled_nibble_pair(words, 4, scale),
                 _scaled_nibble_pair(words, 8, scale), _scaled_nibble_pair(words, 12, scale))
    return pairs


@triton.jit
def _byte_value(words, SHIFT: tl.constexpr):
    """float32 value of the e4m3 byte at bit SHIFT of int32 words."""
    return ((words >> SHIFT) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)


@triton.jit
def e4m3_word_values(words):
    """The four e4m3 elements of int32 words (element i in byte i) as float32."""
    if runtime.COMPILED:
        values = tl.inline_asm_elementwise(_E4M3_WORD_TO_F32_PTX, "=r,=r,=r,=r,r", [words],
                                           dtype=(tl.float32, tl.float32, tl.float32, tl.float32), is_pure=True,
                                           pack=1)
    else:
        values = (_byte_value(words, 0), _byte_value(words, 8), _byte_value(words, 16), _byte_value(words, 24))
    return values


@triton.jit
def dequantized_tile(data_ptr, scale_ptr, rows, n_rows, k0, K, stride_data, stride_scale,
                     FMT: tl.constexpr, VEC: tl.constexpr, ROWS: tl.constexpr, BLOCK_K: tl.constexpr):
    """(rows, BLOCK_K) values (nvfp4's tensor scale not applied), out of range reads 0: bf16 for
    the fp4 formats on the GPU, else float32 (either way exact)."""
    scale = _block_scales(scale_ptr, rows, n_rows, k0, K, stride_scale, FMT, VEC, BLOCK_K)
    if FMT != "mxfp8" and runtime.COMPILED:
        packed = _packed_bytes(data_ptr, rows, n_rows, k0, K, stride_data, BLOCK_K)
        codes = tl.reshape(tl.join(packed, packed), (ROWS, BLOCK_K))
        scale16 = tl.broadcast_to(scale.to(tl.bfloat16)[:, :, None], (ROWS, BLOCK_K // VEC, VEC))
        values = tl.inline_asm_elementwise(_E2M1_TO_BF16_PTX, "=r,=r,r,r,r",
                                           [codes, tl.reshape(scale16, (ROWS, BLOCK_K))],
                                           dtype=tl.bfloat16, is_pure=True, pack=4)
    else:
        codes = _element_bytes(data_ptr, rows, n_rows, k0, K, stride_data, FMT, ROWS, BLOCK_K)
        if FMT == "mxfp8":
            values = codes.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        else:
            values = codes.to(tl.float16, bitcast=True).to(tl.float32) * 16384.0
        values = tl.reshape(tl.reshape(values, (ROWS, BLOCK_K // VEC, VEC)) * scale[:, :, None], (ROWS, BLOCK_K))
    return values


@triton.jit
def _dequantize_kernel(data_ptr, scale_ptr, tensor_scale_ptr, out_ptr, n_rows, K, stride_data, stride_scale,
                       stride_out, FMT: tl.constexpr, VEC: tl.constexpr, TENSOR_SCALE: tl.constexpr,
                       ROWS: tl.constexpr, BLOCK_K: tl.constexpr):
    """ROWS rows by BLOCK_K columns of the (n_rows, K) values, times the tensor scale when
    TENSOR_SCALE (after the block scale: element times block scale is exact, so the value is
    rounded once)."""
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    k0 = tl.program_id(1) * BLOCK_K
    values = dequantized_tile(data_ptr, scale_ptr, rows, n_rows, k0, K, stride_data, stride_scale,
                              FMT, VEC, ROWS, BLOCK_K)
    if TENSOR_SCALE:
        values = values * tl.load(tensor_scale_ptr)
    cols = k0 + tl.arange(0, BLOCK_K)
    tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], values.to(out_ptr.dtype.element_ty),
             mask=(rows[:, None] < n_rows) & (cols[None, :] < K))


_launch_dequantize = runtime.FastLaunch(_dequantize_kernel)


def dequantize_rows(q: QuantizedTensor, dtype: torch.dtype, start: int = 0, stop: int | None = None,
                    tensor_scale: bool = True) -> torch.Tensor:
    """Rows [start, stop) of q in its stored (rows, K) layout (the quantized axis last), in
    `dtype`; nvfp4's tensor scale is left out when tensor_scale is False."""
    K = q.shape[q.axis]
    data, scales = q.data[start:stop], q.scales[start:stop]
    n = data.shape[0]
    out = runtime.empty((n, K), dtype, data.device)
    if n and K:
        block_k = min(512, runtime.next_power_of_2(K))
        rows = max(1, 2048 // block_k)
        apply_scale = tensor_scale and q.tensor_scale is not None
        # e4m3 bytes go in as uint8 (the kernel bitcasts them).
        data, scales = (t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t for t in (data, scales))
        _launch_dequantize((runtime.cdiv(n, rows), runtime.cdiv(K, block_k)), data, scales,
                           q.tensor_scale if apply_scale else scales, out, n, K, data.stride(0), scales.stride(0),
                           out.stride(0), FMT=q.fmt, VEC=q.block, TENSOR_SCALE=apply_scale, ROWS=rows,
                           BLOCK_K=block_k, num_warps=4)
    return out


def dequantize(q: QuantizedTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The tensor q stands for, in `dtype` (float32, float16 or bfloat16), in its logical shape
    (a view with the quantized axis moved back in place)."""
    if dtype not in runtime.FLOAT_DTYPES:
        raise TypeError(f"dtype must be float32, float16 or bfloat16, got {dtype}")
    moved = list(q.shape)
    moved.append(moved.pop(q.axis))
    return dequantize_rows(q, dtype).reshape(moved).movedim(-1, q.axis)


# Elements a program and warps of the quantize kernel, per format: 32 elements a thread, where
# sm_90's instructions an element (scripts/count_sass.py) are near their lowest; at 64 LLVM packs
# the 64 compares of mxfp8's kept elements into integer bitmasks. scripts/sweep_quantize.py --sweep
# times the other shapes on a GPU.
QUANTIZE_LAUNCH = {"mxfp8": (4096, 4), "mxfp4": (4096, 4), "nvfp4": (4096, 4)}
_AMAX_TILE = 4096
_AMAX_PROGRAMS_PER_SM = 8  # 64 KiB of loads in flight an SM


def quantize(x: torch.Tensor, fmt: str, axis: int = -1,
             tensor_amax: float | torch.Tensor | None = None) -> QuantizedTensor:
    """Block-scale x (float32, float16 or bfloat16) along `axis`, whose size must be a multiple
    of the format's block (32, or 16 for nvfp4).

    nvfp4 only: `tensor_amax` (a float, or a one-element tensor on x's device) is the amax its
    tensor scale is made from: a calibrated one, or an earlier step's (delayed scaling). Then x is
    read once instead of twice; blocks above it saturate. None takes x's own amax. A float must
    be finite and >= 0; a tensor's value is not checked on the host (that would wait for the GPU):
    a negative, NaN or infinite one gives a NaN tensor scale, so the result dequantizes to NaN."""
    _check_format(fmt)
    if tensor_amax is not None:
        if fmt != "nvfp4":
            raise ValueError(f"tensor_amax is nvfp4's; {fmt} has no tensor scale")
        if isinstance(tensor_amax, torch.Tensor):
            if tensor_amax.numel() != 1 or tensor_amax.device != x.device or not tensor_amax.is_floating_point():
                raise ValueError("tensor_amax must be a float or a one-element floating tensor on x's device, "
                                 f"got {tuple(tensor_amax.shape)} {tensor_amax.dtype} on {tensor_amax.device}")
        elif not 0 <= tensor_amax <= torch.finfo(torch.float32).max:
            raise ValueError(f"tensor_amax must be a finite float32 >= 0, got {tensor_amax}")
    runtime.check_tensor("x", x, runtime.FLOAT_DTYPES, min_dim=1)
    axis = _axis(axis, x)
    vec = FORMATS[fmt][0]
    K = x.shape[axis]
    if K % vec:
        raise ValueError(f"{fmt} quantizes blocks of {vec} along axis {axis}, whose size {K} is not a multiple of {vec}")
    rows = _rows_view(x, axis)
    M = rows.shape[0]
    device = x.device
    fp4 = fmt != "mxfp8"
    if fp4 and rows.data_ptr() % (2 * rows.element_size()):
        rows = rows.clone()  # the kernel reads element pairs as single words
    data = runtime.empty((M, K // 2) if fp4 else (M, K), torch.uint8 if fp4 else torch.float8_e4m3fn, device)
    scales = runtime.empty((M, K // vec), torch.float8_e4m3fn if fmt == "nvfp4" else torch.uint8, device)
    tensor_scale = amax = None
    if fmt == "nvfp4":
        if M and K:
            # The quantize kernel computes the tensor scale from the amax.
            tensor_scale = runtime.empty((1,), torch.float32, device)
            if tensor_amax is None:
                amax = torch.zeros(1, device=device)
                programs = min(runtime.cdiv(M * K, _AMAX_TILE), _AMAX_PROGRAMS_PER_SM * runtime.num_sms(device.index or 0))
                _launch_amax((programs,), rows, amax, M * K, TILE=_AMAX_TILE, num_warps=4)
            elif isinstance(tensor_amax, torch.Tensor):
                amax = tensor_amax.reshape(1).float()
            else:
                amax = torch.full((1,), float(tensor_amax), dtype=torch.float32, device=device)
        else:
            tensor_scale = torch.ones(1, device=device)
    if M and K:
        elements, warps = QUANTIZE_LAUNCH[fmt]
        blocks = elements // vec
        _launch_quantize((runtime.cdiv(M * K // vec, blocks),), rows, data, scales,
                         scales if amax is None else amax, scales if amax is None else tensor_scale, M * K // vec,
                         FMT=fmt, VEC=vec, EMAX=FORMATS[fmt][2] or 0, BLOCKS=blocks, num_warps=warps)
    return QuantizedTensor(data, scales, fmt, x.shape, axis, tensor_scale)


# ---- references (PyTorch) ----

def _e2m1_decode(packed: torch.Tensor) -> torch.Tensor:
    """(rows, K / 2) uint8 -> (rows, K) float32."""
    table = torch.tensor(E2M1_VALUES, device=packed.device)
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(packed.shape[0], 2 * packed.shape[1]).long()
    values = table[codes & 7]
    return torch.where(codes >= 8, -values, values)


def _e8m0_decode(scales: torch.Tensor) -> torch.Tensor:
    # From the bits, as the kernels do: CUDA's exp2f is not exact for the subnormal 2^-127 (byte 0).
    bits = scales.to(torch.int32)
    value = torch.where(bits == 0, 1 << 22, bits << 23).view(torch.float32)
    return torch.where(scales == NAN_SCALE, torch.full_like(value, float("nan")), value)


def dequantize_reference(q: QuantizedTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """dequantize in plain PyTorch."""
    vec = q.block
    if q.fmt == "mxfp8":
        values = q.data.float()
    else:
        values = _e2m1_decode(q.data)
    scale = q.scales.float() if q.fmt == "nvfp4" else _e8m0_decode(q.scales)
    rows = values.reshape(values.shape[0], q.shape[q.axis] // vec, vec) * scale[..., None]
    if q.fmt == "nvfp4":
        rows = rows * q.tensor_scale.float()
    moved = list(q.shape)
    moved.append(moved.pop(q.axis))
    return rows.reshape(moved).movedim(-1, q.axis).to(dtype)


def _e2m1_code_reference(y: torch.Tensor) -> torch.Tensor:
    """|y| (float64) to the code (0-7) of the nearest e2m1 magnitude, ties to the even code,
    saturating at 6."""
    table = torch.tensor(E2M1_VALUES, dtype=torch.float64, device=y.device)
    dist = (y[..., None] - table).abs()
    code = dist.argmin(-1)  # the lower of two equally near codes
    upper = (code + 1).clamp(max=7)
    tie = dist.gather(-1, upper[..., None])[..., 0] == dist.gather(-1, code[..., None])[..., 0]
    return torch.where(tie & (code % 2 == 1), upper, code)


def quantize_reference(x: torch.Tensor, fmt: str, axis: int = -1,
                       tensor_amax: float | torch.Tensor | None = None) -> QuantizedTensor:
    """quantize in plain PyTorch (float64 arithmetic, torch's own e4m3 rounding)."""
    _check_format(fmt)
    axis = _axis(axis, x)
    vec, elem_max, emax = FORMATS[fmt]
    rows = _rows_view(x, axis).double()
    rows = torch.where(rows.abs() < 2.0**-126, 0.0, rows)  # subnormals flush to +0
    M, K = rows.shape
    blocks = rows.reshape(M, K // vec, vec)
    amax = blocks.abs().amax(-1)
    tensor_scale = None
    if fmt == "nvfp4":
        if tensor_amax is not None:
            t_amax = torch.as_tensor(tensor_amax, dtype=torch.float64, device=x.device).reshape(())
        elif rows.numel():
            t_amax = rows.abs().amax()
        else:
            t_amax = torch.zeros((), dtype=torch.float64, device=x.device)
        # Divisors as tensors: CUDA torch divides by a Python number as a multiply by its
        # reciprocal, which is not the correctly rounded quotient the recipe asks for.
        div, six = (torch.tensor(v, device=x.device) for v in (NVFP4_TENSOR_DIV, 6.0))
        s = torch.where(t_amax >= 2.0**-126, t_amax.float() / div, torch.ones((), device=x.device))
        s = torch.where((t_amax >= 0) & (t_amax <= torch.finfo(torch.float32).max), s, float("nan"))
        tensor_scale = s.reshape(1)
        # Saturated: a given tensor_amax may be below a block's amax.
        scales = (amax.float() / six / s).clamp(max=448.0).to(torch.float8_e4m3fn)
        # The recipe's arithmetic is float32: x times 1 / (block scale * tensor scale), the
        # reciprocal correctly rounded once a block.
        denom = scales.float() * s
        one = torch.ones((), device=x.device)
        recip = (one / torch.where(denom > 0, denom, 1.0)).clamp(max=torch.finfo(torch.float32).max)
        recip = torch.where(denom > 0, recip, 0.0)
        scaled = (blocks.float() * recip[..., None]).double()
    else:
        finite = torch.isfinite(amax) & ~blocks.isnan().any(-1)
        safe = torch.where(finite & (amax > 0), amax, torch.ones_like(amax))
        exp = torch.floor(torch.log2(safe.float())).long() - emax
        exp = torch.where(amax > 0, exp, torch.full_like(exp, MIN_SCALE_EXP)).clamp(MIN_SCALE_EXP, 127)
        scales = torch.where(finite, exp + 127, torch.full_like(exp, NAN_SCALE)).to(torch.uint8)
        inv = torch.where(finite, torch.exp2(-exp.double()), torch.zeros_like(amax))
        scaled = torch.where(inv[..., None] > 0, blocks * inv[..., None], 0.0)
    if fmt == "mxfp8":
        magnitude = scaled.abs().clamp(max=elem_max).float().to(torch.float8_e4m3fn).float()
        data = torch.where((blocks < 0) & (magnitude > 0), -magnitude, magnitude).to(torch.float8_e4m3fn).reshape(M, K)
    else:
        codes = _e2m1_code_reference(scaled.abs().nan_to_num(0.0).clamp(max=elem_max))
        codes = (codes | torch.where((blocks < 0) & (codes > 0), 8, 0)).reshape(M, K // 2, 2)
        data = (codes[..., 0] | (codes[..., 1] << 4)).to(torch.uint8)
    return QuantizedTensor(data, scales, fmt, x.shape, axis, tensor_scale)


# ---- the 5D scale layout ----

def to_blocked(scales: torch.Tensor) -> torch.Tensor:
    """(rows, cols) scales -> (ceil(rows / 128), ceil(cols / 4), 32, 4, 4), zero padded: row
    r = 128 i + 32 b + a and column c = 4 j + k land at [i, j, a, b, k]."""
    rows, cols = scales.shape
    R, C = runtime.cdiv(rows, 128), runtime.cdiv(cols, 4)
    padded = scales.new_zeros((R * 128, C * 4))
    padded[:rows, :cols] = scales
    return padded.reshape(R, 4, 32, C, 4).permute(0, 3, 2, 1, 4).contiguous()


def from_blocked(blocked: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Inverse of to_blocked: the (rows, cols) scales."""
    R, C = blocked.shape[:2]
    return blocked.permute(0, 3, 2, 1, 4).reshape(R * 128, C * 4)[:rows, :cols].contiguous()
