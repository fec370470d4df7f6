"""tritonformer.quant: the Triton quantize kernel against the PyTorch reference, bit for bit, and
the formats' own properties (round trips, error bounds, special values, the 5D scale layout)."""

import dataclasses
import gc
import math
import weakref

import pytest
import torch

from conftest import ON_GPU
from tritonformer import quant

FORMATS = list(quant.FORMATS)
E2M1 = torch.tensor(quant.E2M1_VALUES)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype != torch.uint8 else t


def _assert_same(q: quant.QuantizedTensor, r: quant.QuantizedTensor):
    assert q.data.dtype == r.data.dtype and q.scales.dtype == r.scales.dtype
    assert torch.equal(_bits(q.scales), _bits(r.scales))
    assert torch.equal(_bits(q.data), _bits(r.data))
    if q.tensor_scale is not None:
        assert torch.equal(q.tensor_scale, r.tensor_scale)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_kernel_equals_reference_bit_for_bit(fmt, dtype, device):
    # Rows over twelve orders of magnitude, odd row count, K of several blocks.
    top = 4 if dtype == torch.float16 else 6  # float16 ends at 65504
    x = torch.randn(7, 96, device=device) * torch.logspace(-top, top, 7, device=device)[:, None]
    x = x.to(dtype)
    q = quant.quantize(x, fmt)
    _assert_same(q, quant.quantize_reference(x, fmt))
    assert q.data.shape == ((7, 96) if fmt == "mxfp8" else (7, 48))
    assert q.scales.shape == (7, 96 // q.block)


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_e2m1_ties_and_neighbours_round_as_the_reference(fmt, device):
    # Blocks whose largest magnitude is 6 (mxfp4's scale is then 1): the other elements sit on
    # e2m1's rounding ties (0.25, 0.75, ..., 5.0, ties to even) or a hair either side, either sign.
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    near = torch.cat([ties, ties * (1 - 2**-12), ties * (1 + 2**-12), E2M1, torch.tensor([5.9, 6.5])])
    picks = near[torch.randint(0, len(near), (64, 31))] * torch.where(torch.rand(64, 31) < 0.5, -1.0, 1.0)
    x = torch.cat([torch.full((64, 1), 6.0), picks], dim=1).to(device)
    _assert_same(quant.quantize(x, fmt), quant.quantize_reference(x, fmt))


@pytest.mark.parametrize("fmt", FORMATS)
def test_other_axis_and_batch_dims(fmt, device):
    x = torch.randn(3, 64, 5, device=device)
    q = quant.quantize(x, fmt, axis=1)
    _assert_same(q, quant.quantize_reference(x, fmt, axis=1))
    out = quant.dequantize(q)
    assert out.shape == x.shape
    expected = quant.dequantize(quant.quantize(x.movedim(1, -1).contiguous(), fmt)).movedim(-1, 1)
    assert torch.equal(out, expected)


def _representable(fmt, M, K, device):
    """Values each format holds exactly, with block scales its quantizer picks back."""
    vec = quant.FORMATS[fmt][0]
    blocks = K // vec
    if fmt == "mxfp8":
        elements = torch.randn(M, K).to(torch.float8_e4m3fn).float()
        elements[:, ::vec] = 448.0  # the block amax fixes the scale: 2^(8 - 8) = 1 times 2^e
    else:
        elements = E2M1[torch.randint(0, 8, (M, K))] * (torch.randint(0, 2, (M, K)) * 2 - 1)
        elements[:, ::vec] = 6.0
    if fmt == "nvfp4":
        # Block scales c (e4m3 values, one of them 448): the tensor amax is 6 * 448, so the
        # tensor scale is 1 and each block's scale is its c again.
        c = torch.rand(M, blocks).mul(448).to(torch.float8_e4m3fn).float().clamp(min=2.0**-6)
        c[0, 0] = 448.0
    else:
        c = torch.exp2(torch.randint(-20, 20, (M, blocks)).float())
    return (elements.reshape(M, blocks, vec) * c[..., None]).reshape(M, K).to(device)


@pytest.mark.parametrize("fmt", FORMATS)
def test_representable_values_round_trip_exactly(fmt, device):
    x = _representable(fmt, 6, 128, device)
    assert torch.equal(quant.dequantize(quant.quantize(x, fmt)), x)


def _spacing(fmt_elem: str, y: torch.Tensor) -> torch.Tensor:
    if fmt_elem == "e4m3":
        exp = torch.floor(torch.log2(y.clamp(min=2.0**-6)))
        return torch.exp2(exp - 3)
    return torch.where(y < 2, 0.5, torch.where(y < 4, 1.0, 2.0))


@pytest.mark.parametrize("fmt", ["mxfp8", "mxfp4"])
def test_mx_error_within_half_a_step_or_the_saturation(fmt, device):
    x = torch.randn(16, 256, device=device).double() * 3
    q = quant.quantize(x.float(), fmt)
    scale = torch.exp2(q.scales.double() - 127).repeat_interleave(32, dim=1)
    y = x.abs() / scale
    top = quant.FORMATS[fmt][1]
    bound = torch.where(y > top, y - top, _spacing("e4m3" if fmt == "mxfp8" else "e2m1", y.clamp(max=top)) / 2)
    err = (quant.dequantize(q).double() - x).abs() / scale
    assert (err <= bound + 1e-9).all()


def test_nvfp4_error_within_half_a_step(device):
    x = torch.randn(16, 256, device=device) * 3
    q = quant.quantize(x, "nvfp4")
    scale = (q.scales.double() * q.tensor_scale.double()).repeat_interleave(16, dim=1)
    y = x.double().abs() / scale
    err = (quant.dequantize(q).double() - x.double()).abs() / scale
    # Block scales round to e4m3 (3 mantissa bits), so amax / scale reaches 6 * (1 + 2^-4).
    bound = torch.where(y > 6, y - 6, _spacing("e2m1", y.clamp(max=6)) / 2)
    assert (err <= bound + 1e-6).all()


@pytest.mark.parametrize("fmt", ["mxfp8", "mxfp4"])
def test_mx_special_blocks(fmt, device):
    x = torch.randn(4, 96, device=device)
    x[0, :32] = 0.0                      # all-zero block
    x[1, 5] = float("nan")               # NaN block
    x[2, 40] = float("inf")              # inf block
    x[3, :32] = 1e-40                    # subnormal block (float32)
    x[3, 64:] = 1e30                     # far beyond the element's max: a large scale
    q = quant.quantize(x, fmt)
    _assert_same(q, quant.quantize_reference(x, fmt))
    out = quant.dequantize(q)
    assert q.scales[0, 0] == 127 + quant.MIN_SCALE_EXP and (out[0, :32] == 0).all()
    assert q.scales[1, 0] == quant.NAN_SCALE and out[1, :32].isnan().all() and not out[1, 32:].isnan().any()
    assert q.scales[2, 1] == quant.NAN_SCALE and out[2, 32:64].isnan().all()
    assert (out[3, :32] == 0).all()  # float32 subnormals flush to zero
    assert torch.allclose(out[3, 64:], x[3, 64:], rtol=0.25)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dequantize_kernel_equals_reference(fmt, dtype, device):
    # Rows over many magnitudes (float16 overflows to inf on the largest, as torch's cast does),
    # special blocks, an odd row count, K not a multiple of the kernel's column block, axis 0.
    x = torch.randn(9, 96 + 32 * 20, device=device) * torch.logspace(-8, 8, 9, device=device)[:, None]
    x[0, :32] = 0.0
    if fmt != "nvfp4":  # nvfp4's recipe has no non-finite inputs
        x[1, 40] = float("nan")
    for q in (quant.quantize(x, fmt), quant.quantize(x.t(), fmt, axis=0)):
        out = quant.dequantize(q, dtype)
        ref = quant.dequantize_reference(q, dtype)
        assert out.shape == ref.shape == q.shape and out.dtype == dtype
        assert torch.equal(out.isnan(), ref.isnan())
        if fmt == "nvfp4" and dtype == torch.bfloat16 and not ON_GPU:
            # nvfp4's tensor scale makes values inexact in bf16, which the interpreter truncates.
            torch.testing.assert_close(out.nan_to_num(), ref.nan_to_num(), rtol=2**-7, atol=0)
        else:
            assert torch.equal(out.nan_to_num(), ref.nan_to_num())
    # Rows 3-6 of the stored (rows, K) layout without the tensor scale: exact in float32.
    rows = quant.dequantize_rows(q, torch.float32, 3, 7, tensor_scale=False)
    unscaled = dataclasses.replace(q, tensor_scale=torch.ones(1, device=device)) if q.tensor_scale is not None else q
    ref = quant.dequantize_reference(unscaled)[:, 3:7].t()
    assert rows.shape == (4, 96 + 32 * 20) and torch.equal(rows.nan_to_num(), ref.nan_to_num())


def test_bf16_subnormals_and_large_values(device):
    x = torch.tensor([[2.0**-133, -(2.0**-130), 2.0**-120] + [0.0] * 29, [3e38] + [1.0] * 31],
                     device=device).to(torch.bfloat16)
    for fmt in ("mxfp8", "mxfp4"):
        q = quant.quantize(x, fmt)
        _assert_same(q, quant.quantize_reference(x, fmt))
        out = quant.dequantize(q)
        assert torch.isfinite(out).all()
        assert out[0, 0] == 0 and out[0, 1] == 0  # subnormals flush to zero
        assert math.isclose(out[1, 0].item(), x[1, 0].float().item(), rel_tol=0.3)


def test_nvfp4_zero_tensor_and_tiny_blocks(device):
    zero = torch.zeros(2, 32, device=device)
    q = quant.quantize(zero, "nvfp4")
    assert q.tensor_scale.item() == 1.0 and (quant.dequantize(q) == 0).all()
    x = torch.randn(2, 32, device=device)
    x[0, :16] *= 1e-9  # the block scale underflows e4m3: zero elements, no NaN
    q = quant.quantize(x, "nvfp4")
    _assert_same(q, quant.quantize_reference(x, "nvfp4"))
    assert torch.isfinite(quant.dequantize(q)).all()


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_subnormals_flush_in_tiny_blocks(fmt, dtype, device):
    # Blocks whose scale is near 2^-126, where a subnormal x / scale would round to a nonzero code
    # if it were not flushed; a whole tensor of subnormals (nvfp4: amax 0, tensor scale 1), and
    # one whose tensor scale is tiny (nvfp4's exact path on the GPU).
    tiny = torch.tensor([2.0**-124, 2.0**-127, -(2.0**-127.5), 2.0**-126, -(2.0**-125), 2.0**-129, 3 * 2.0**-128, 0.0])
    x = tiny[torch.randint(0, len(tiny), (4, 64))]
    x[:, 0] = 2.0**-124
    for t in (x, x * 2.0**-4, x * 2.0**20, x * 2.0**100):
        t = t.to(device=device, dtype=dtype)
        _assert_same(quant.quantize(t, fmt), quant.quantize_reference(t, fmt))
    sub = (torch.rand(2, 32, device=device) * 2.0**-127).to(dtype)
    q = quant.quantize(sub, fmt)
    _assert_same(q, quant.quantize_reference(sub, fmt))
    assert (quant.dequantize(q) == 0).all()


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rows_at_an_odd_element_offset(fmt, dtype, device):
    # A contiguous view one element into its storage: the fp4 kernels read element pairs as words.
    base = torch.randn(1 + 3 * 64, device=device).to(dtype)
    x = base[1:].view(3, 64)
    _assert_same(quant.quantize(x, fmt), quant.quantize_reference(x, fmt))


def test_nvfp4_tensor_amax_anywhere(device):
    # The amax pass strides its programs over tiles of 4096 elements: the largest |x| in the first,
    # a middle or the last tile, negative or positive.
    for where, sign in ((0, 1.0), (2 * 4096 + 17, -1.0), (5 * 4096 - 1, 1.0)):
        x = torch.randn(5, 4096, device=device)
        x.view(-1)[where] = 40.0 * sign
        _assert_same(quant.quantize(x, "nvfp4"), quant.quantize_reference(x, "nvfp4"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_nvfp4_given_tensor_amax(dtype, device):
    # A calibrated amax above, at and below x's own (below: blocks saturate at scale 448 and
    # elements at 6), as a float or a tensor; one element near float16's top (or float32's, where
    # a naive quotient by a small divisor overflows), both signs.
    x = torch.randn(6, 64, device=device) * torch.logspace(-3, 3, 6, device=device)[:, None]
    x[5, 7] = -6e4 if dtype == torch.float16 else -3e38
    x = x.to(dtype)
    own = x.float().abs().amax()
    for amax in (min(own.item() * 4, 3e38), own, own.item() * 1e-3, 1e-20, 0.0):
        q = quant.quantize(x, "nvfp4", tensor_amax=amax)
        ref = quant.quantize_reference(x, "nvfp4", tensor_amax=amax)
        _assert_same(q, ref)
    assert (quant.quantize(x, "nvfp4", tensor_amax=1e-20).data[5, 3] >> 4) == 15  # -6, saturated
    same = quant.quantize(x, "nvfp4", tensor_amax=own)
    _assert_same(same, quant.quantize(x, "nvfp4"))


def test_nvfp4_tensor_amax_tensor_of_a_bad_value_poisons_the_result(device):
    # Not read on the host: a negative, NaN or infinite amax tensor gives a NaN tensor scale (it
    # gave 1, or inf and NaN elements); an integer amax is taken as a float.
    x = torch.randn(4, 64, device=device)
    for bad in (-5.0, float("nan"), float("inf")):
        q = quant.quantize(x, "nvfp4", tensor_amax=torch.tensor([bad], device=device))
        assert q.tensor_scale.isnan().all() and quant.dequantize(q).isnan().all()
        assert quant.quantize_reference(x, "nvfp4", tensor_amax=torch.tensor([bad], device=device)).tensor_scale.isnan().all()
    _assert_same(quant.quantize(x, "nvfp4", tensor_amax=3), quant.quantize_reference(x, "nvfp4", tensor_amax=3.0))


def test_e8m0_byte_zero_is_two_to_the_minus_127(device):
    # quantize never writes it; MX data from elsewhere may. The kernels decoded it as 2^-126.
    for fmt, v in (("mxfp8", 448.0), ("mxfp4", 6.0)):
        q = quant.quantize(torch.full((2, 32), v, device=device), fmt)
        q.scales[0] = 0
        out = quant.dequantize(q)
        assert (out[0] == v * 2.0**-127).all() and torch.equal(out, quant.dequantize_reference(q))


def test_blocked_layout_round_trip_and_index_map(device):
    rows, cols = 300, 10
    scales = torch.randint(0, 255, (rows, cols), dtype=torch.uint8, device=device)
    blocked = quant.to_blocked(scales)
    assert blocked.shape == (3, 3, 32, 4, 4)
    assert torch.equal(quant.from_blocked(blocked, rows, cols), scales)
    r, c = 128 * 1 + 32 * 2 + 5, 4 * 2 + 1
    assert blocked[1, 2, 5, 2, 1] == scales[r, c]
    padded = quant.from_blocked(blocked, 384, 12)
    assert (padded[rows:] == 0).all() and (padded[:, cols:] == 0).all()


@pytest.mark.parametrize("fmt", list(quant.FORMATS))
def test_scales_by_step_index_map_and_cache(fmt, device):
    q = quant.quantize(torch.randn(5, 512, device=device), fmt, axis=1)
    by_step = q.scales_by_step(128)
    per_step = 128 // q.block
    assert by_step.shape == (4, 5, per_step) and by_step.is_contiguous() and by_step.dtype == q.scales.dtype
    raw, scales = by_step.view(torch.uint8), q.scales.view(torch.uint8)
    for step, row, j in ((0, 0, 0), (3, 4, per_step - 1), (2, 1, per_step // 2), (1, 3, 1)):
        assert raw[step, row, j] == scales[row, step * per_step + j]
    assert q.scales_by_step(128) is by_step
    assert torch.equal(q.scales_by_step(256).view(torch.uint8)[1, 2], scales[2, 2 * per_step:4 * per_step])


@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4"])
def test_scales_copies_follow_the_scales(fmt, device):
    # The copies are kept with the scales' memory; an in-place change of the scales, or new
    # scales, must make fresh ones, not hand the kernels the old scales.
    q = quant.quantize(torch.randn(128, 256, device=device), fmt, axis=1)
    by_step, blocked = q.scales_by_step(128), q.blocked_scales()
    assert q.scales_by_step(128) is by_step and q.blocked_scales() is blocked
    q.scales.view(torch.uint8)[3, 5] += 1
    changed = q.scales.view(torch.uint8)[3, 5]
    per_step = 128 // q.block
    assert q.scales_by_step(128).view(torch.uint8)[5 // per_step, 3, 5 % per_step] == changed
    assert torch.equal(quant.from_blocked(q.blocked_scales(), *q.scales.shape).view(torch.uint8),
                       q.scales.view(torch.uint8))
    q.scales = q.scales.clone()
    q.scales.view(torch.uint8)[0, 0] += 1
    assert q.scales_by_step(128).view(torch.uint8)[0, 0, 0] == q.scales.view(torch.uint8)[0, 0]
    # Kept with the scales' memory: another QuantizedTensor over it (a layer's, each call) shares
    # the copy, a byte view too, and the copies go when the memory does.
    twin = dataclasses.replace(q, scales=q.scales.view(torch.uint8).view(q.scales.dtype))
    assert twin.scales_by_step(128) is q.scales_by_step(128)
    assert q.scales.untyped_storage() in quant._SCALE_COPIES
    copy = weakref.ref(q.scales_by_step(128))
    del q, twin
    gc.collect()
    assert copy() is None


@pytest.mark.parametrize("bad,error,match", [
    (lambda d: quant.quantize(torch.randn(4, 40, device=d), "mxfp8"), ValueError, "not a multiple of 32"),
    (lambda d: quant.quantize(torch.randn(4, 24, device=d), "nvfp4"), ValueError, "not a multiple of 16"),
    (lambda d: quant.quantize(torch.randn(4, 32, device=d), "fp4"), ValueError, "fmt must be one of mxfp8"),
    (lambda d: quant.quantize(torch.ones(4, 32, dtype=torch.int32, device=d), "mxfp8"), TypeError, "x"),
    (lambda d: quant.quantize(torch.randn(4, 32, device=d), "mxfp4", tensor_amax=1.0), ValueError, "nvfp4's"),
    (lambda d: quant.quantize(torch.randn(4, 32, device=d), "nvfp4", tensor_amax=float("inf")), ValueError,
     "finite"),
    (lambda d: quant.quantize(torch.randn(4, 32, device=d), "nvfp4", tensor_amax=torch.ones(2, device=d)),
     ValueError, "one-element"),
    (lambda d: quant.quantize(torch.randn(4, 32, device=d), "mxfp8", axis=2), ValueError, "axis 2 is out of range"),
    (lambda d: quant.quantize(torch.randn(4, 32, device=d), "mxfp8", axis=-3), ValueError, "axis -3 is out of range"),
])
def test_bad_input_is_named(bad, error, match, device):
    with pytest.raises(error, match=match):
        bad(device)


def test_repr_shows_layouts_not_values(device):
    q = quant.quantize(torch.randn(256, 512, device=device), "nvfp4")
    text = repr(q)
    assert text.startswith("QuantizedTensor('nvfp4', shape=(256, 512), axis=1, data=uint8[256, 256]")
    assert "tensor_scale=float32" in text and len(text) < 300
