"""scaled_matmul against dequantize-then-matmul in float32."""

import os
import subprocess
import sys

import pytest
import torch

from conftest import ON_GPU, gpu_only
from helpers import compile_fullgraph
from tritonformer import quant, runtime
from tritonformer.testing import assert_close
from tritonformer.ops.scaled_matmul import activation_grad, dequantize_first, dot_scaled, wgmma
from tritonformer.ops.scaled_matmul import scaled_matmul, scaled_matmul_reference


def _relative_error(out, ref):
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


@pytest.mark.parametrize("fmt", list(quant.FORMATS))
@pytest.mark.parametrize("M", [1, 17])
def test_bf16_activations_times_quantized_weight(fmt, M, device):
    N, K = 45, 128
    weight = torch.randn(N, K, device=device)
    w = quant.quantize(weight, fmt, axis=1)  # nn.Linear's layout: x @ w.T
    x = torch.randn(M, K, device=device).to(torch.bfloat16)
    out = scaled_matmul(x, w)
    assert out.shape == (M, N) and out.dtype == torch.bfloat16
    ref = scaled_matmul_reference(x, w, torch.float32)
    assert _relative_error(out, ref) <= 4e-3  # the bf16 output's rounding
    out32 = scaled_matmul(x, w, out_dtype=torch.float32)
    assert _relative_error(out32, ref) <= 1e-5


@pytest.mark.parametrize("fmt", list(quant.FORMATS))
@pytest.mark.parametrize("M,N,K", [(1, 70, 2048), (1, 70, 2080), (2, 70, 2144), (9, 130, 1024), (16, 256, 1024), (32, 130, 1024),
                                   (40, 70, 1056), (64, 128, 1024)])
def test_few_rows_every_code_byte_and_split_k(fmt, M, N, K, device):
    # M = 1 takes the CUDA-core kernel, up to 64 rows of fp4 weights the mma.sync kernel, on
    # Hopper the wgmma kernel (any format) when K is a multiple of 128 (on the GPU their codes
    # decode in PTX, with K permuted within the tensor cores' operands): every code byte in every
    # row, scales over the formats' range, x a strided view, K split, bias; M, N and K below and
    # at multiples of the kernels' tiles (their masked and unmasked loads). The replays (one
    # mechanism for every path) are checked at each path's first shape under the interpreter,
    # where a call of the larger shapes takes a minute.
    _check_every_code_byte(fmt, M, N, K, device, replays=ON_GPU or M <= 2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the wgmma kernel is Gluon, Hopper only")
# mxfp8 has one launch shape for every weight.
@pytest.mark.parametrize("fmt,large_weight_shape", [("nvfp4", False), ("nvfp4", True), ("mxfp4", False),
                                                    ("mxfp4", True), ("mxfp8", False)])
@pytest.mark.parametrize("M,N,K", [(3, 130, 1024), (9, 130, 1024), (16, 256, 1024), (12, 70, 2048)])
def test_wgmma_kernel_up_to_16_rows(fmt, large_weight_shape, M, N, K, device, monkeypatch):
    # 16 tokens a program, on the small weights' launch shape and on the large ones' (more splits of K).
    if large_weight_shape:
        monkeypatch.setattr(wgmma, "WGMMA_MIN_WEIGHT", 0)
    _check_every_code_byte(fmt, M, N, K, device)


def test_wgmma_shape_takes_the_small_weights_shape_only_up_to_32_tokens():
    # Which launch shape each token count takes on fp4 weights around the size thresholds.
    small = wgmma.WGMMA_SMALL_WEIGHT_SHAPE
    for fmt in ("nvfp4", "mxfp4"):
        assert wgmma._wgmma_shape(fmt, 16, 4096, 4096) == small
        assert wgmma._wgmma_shape(fmt, 32, 4096, 4096) == wgmma.WGMMA_SHAPES[32]
        assert wgmma._wgmma_shape(fmt, 32, 8192, 8192) == small
        for tokens in (64, 128):
            assert wgmma._wgmma_shape(fmt, tokens, 8192, 8192) == wgmma.WGMMA_SHAPES[tokens]
        for tokens in (16, 32, 64, 128):
            assert wgmma._wgmma_shape(fmt, tokens, 28672, 8192) == wgmma.WGMMA_SHAPES[tokens]
    assert wgmma._wgmma_shape("mxfp8", 32, 8192, 8192) == wgmma.WGMMA_E4M3_SHAPES[32]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the wgmma kernel is Gluon, Hopper only")
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("M,N,K", [(17, 130, 1024), (32, 256, 2048)])
def test_wgmma_kernel_small_weights_at_32_tokens(fmt, M, N, K, device, monkeypatch):
    # 32 tokens a program (x by TMA) on the small weights' launch shape, which weights past
    # WGMMA_SMALL_WEIGHT_FROM[32] elements take; here every weight does.
    monkeypatch.setitem(wgmma.WGMMA_SMALL_WEIGHT_FROM, 32, 0)
    _check_every_code_byte(fmt, M, N, K, device)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the wgmma kernel is Gluon, Hopper only")
@pytest.mark.parametrize("fmt", list(quant.FORMATS))
@pytest.mark.parametrize("M,N,K", [(12, 130, 2048), (17, 200, 2048), (64, 256, 1024), (40, 70, 1152)])
def test_wgmma_kernel_two_warpgroups(fmt, M, N, K, device, monkeypatch):
    # 128 rows of B a program on two warpgroups sharing x's tile: the library takes it when the
    # tiles fill the SMs (N past 16384 on an H100), from 64 tokens for fp4 weights; here every
    # token count and small N are sent there, with K split at 2048.
    monkeypatch.setattr(wgmma, "WGMMA_MIN_WEIGHT", 0)
    monkeypatch.setattr(wgmma, "WGMMA_SHAPES", dict.fromkeys(wgmma.WGMMA_SHAPES, (128, 3, 8)))
    monkeypatch.setattr(wgmma, "WGMMA_E4M3_SHAPES", dict.fromkeys(wgmma.WGMMA_E4M3_SHAPES, (128, 3, 8)))
    monkeypatch.setattr(runtime, "num_sms", lambda device_index=0: 1)
    _check_every_code_byte(fmt, M, N, K, device)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the wgmma kernel is Gluon, Hopper only")
@pytest.mark.parametrize("fmt", list(quant.FORMATS))
@pytest.mark.parametrize("M,N,K,split", [(65, 130, 1024, False), (128, 256, 1024, True), (200, 70, 2048, True),
                                         (300, 130, 1152, False), (600, 64, 2048, True)])
def test_wgmma_kernel_token_tiles(fmt, M, N, K, split, device, monkeypatch):
    # Past WGMMA_MAX_TOKENS rows x comes in tiles, one a program along the grid's first axis;
    # here with K split at 1024 (and B's rows at 64 a program) and without, and past WGMMA_MAX_M.
    monkeypatch.setattr(wgmma, "WGMMA_MAX_M", 1 << 30)
    if not split:
        monkeypatch.setattr(runtime, "num_sms", lambda device_index=0: 1)
    _check_every_code_byte(fmt, M, N, K, device)


@pytest.mark.parametrize("M", [1, 17, 64, 100, 520])
def test_activations_that_require_grad(M, device):
    # A QLoRA-style caller's activations carry autograd history; scaled_matmul has no backward
    # and must give the same product on every path (the wgmma kernel's copy of x is written
    # with out=, which torch refuses for a tensor that requires grad).
    N, K = 64, 256
    w = quant.quantize(torch.randn(N, K, device=device), "nvfp4", axis=1)
    x = torch.randn(M, K, device=device).to(torch.bfloat16).requires_grad_()
    out = scaled_matmul(x * 1, w)
    torch.testing.assert_close(out, scaled_matmul(x.detach(), w), rtol=0, atol=0)


@pytest.mark.parametrize("fmt", list(quant.FORMATS))
def test_wgmma_x_columns_follow_the_decoded_order_of_b(fmt):
    # The wgmma kernel's copy of x: each step of 128 columns in the order in which a thread's
    # decoded words of B meet the tensor cores. fp4: words of a scale block (WPT) a thread, eight
    # codes a word; e4m3: eight words a thread, four codes a word, a word's codes in one k16 chunk.
    columns = wgmma._wgmma_x_columns(256, fmt, "cpu").tolist()
    if fmt == "mxfp8":
        expected = [128 * step + 32 * t + 4 * c + 2 * p + h
                    for step in range(2) for c in range(8) for p in range(2) for t in range(4) for h in range(2)]
    else:
        wpt = quant.FORMATS[fmt][0] // 8
        expected = [128 * step + 32 * wpt * j + 8 * wpt * t + 8 * u + 4 * h + 2 * p1 + p0
                    for step in range(2) for j in range(128 // (32 * wpt)) for u in range(wpt) for p1 in range(2)
                    for p0 in range(2) for t in range(4) for h in range(2)]
    assert columns == expected


@pytest.mark.parametrize("fmt", list(quant.FORMATS))
@pytest.mark.parametrize("M", [1, 3, 17])
def test_activations_stored_column_major(fmt, M, device):
    # A transposed x, or one row whose row stride is odd: the fp4 paths read x as int32 words of
    # bf16 pairs and must copy such an x into rows first (a clone kept it transposed).
    N, K = 17, 64
    w = quant.quantize(torch.randn(N, K, device=device), fmt, axis=1)
    x = torch.randn(K, M, device=device).to(torch.bfloat16).t()
    out = scaled_matmul(x, w, out_dtype=torch.float32)
    assert _relative_error(out, scaled_matmul_reference(x, w, torch.float32)) <= 1e-5


def _check_every_code_byte(fmt, M, N, K, device, replays=True):
    width = K if fmt == "mxfp8" else K // 2
    gen = torch.Generator().manual_seed(3)
    rows = torch.stack([torch.randperm(256, generator=gen) for _ in range(N)]).repeat(1, -(-width // 256))
    block = quant.FORMATS[fmt][0]
    if fmt == "nvfp4":  # e4m3 scales over their finite range, subnormals included
        codes = torch.randint(1, 127, (N, K // block), generator=gen, dtype=torch.uint8)
        scales = codes.view(torch.float8_e4m3fn)
    else:  # e8m0 exponents 2^-40 .. 2^40
        scales = torch.randint(87, 168, (N, K // block), generator=gen, dtype=torch.uint8)
    data = rows[:, :width].to(torch.uint8)
    if fmt == "mxfp8":  # finite e4m3 codes only: 0x7f and 0xff are NaN
        data = torch.where((data & 0x7F) == 0x7F, data - 1, data).view(torch.float8_e4m3fn)
    tensor_scale = torch.tensor(0.37, device=device) if fmt == "nvfp4" else None
    w = quant.QuantizedTensor(data.to(device), scales.to(device), fmt, torch.Size((N, K)), 1, tensor_scale)
    x = torch.randn(M, 2 * K, device=device).to(torch.bfloat16)[:, ::2]
    bias = torch.randn(N, device=device)
    out = scaled_matmul(x, w, out_dtype=torch.float32, bias=bias)
    ref = scaled_matmul_reference(x, w, torch.float32, bias=bias)
    assert _relative_error(out, ref) <= 1e-5
    if not replays:
        return
    assert torch.equal(scaled_matmul(x, w, out_dtype=torch.float32, bias=bias), out)  # replayed launch
    x = torch.randn(M, 2 * K, device=device).to(torch.bfloat16)[:, ::2]  # a replay sees the new x
    out = scaled_matmul(x, w, out_dtype=torch.float32, bias=bias)
    assert _relative_error(out, scaled_matmul_reference(x, w, torch.float32, bias=bias)) <= 1e-5


@pytest.mark.parametrize("fmt_a,fmt_b", [("mxfp8", "mxfp8"), ("mxfp4", "mxfp4"), ("nvfp4", "nvfp4"),
                                         ("mxfp8", "mxfp4")])
def test_both_operands_block_scaled(fmt_a, fmt_b, device):
    M, N, K = 33, 50, 96
    a = quant.quantize(torch.randn(M, K, device=device), fmt_a)
    b = quant.quantize(torch.randn(K, N, device=device) * 3, fmt_b, axis=0)  # (K, N): a @ b
    bias = torch.randn(N, device=device)
    out = scaled_matmul(a, b, out_dtype=torch.float32, bias=bias)
    ref = scaled_matmul_reference(a, b, torch.float32, bias=bias)
    assert out.shape == (M, N)
    assert _relative_error(out, ref) <= 1e-5


def test_sm100_takes_block_scaled_mma_for_both_operands_quantized(monkeypatch):
    monkeypatch.setattr(runtime, "INTERPRET", False)
    monkeypatch.setattr(runtime, "capability", lambda device_index=0: (10, 0))
    q = {fmt: quant.quantize_reference(torch.randn(4, 64), fmt, axis=1) for fmt in quant.FORMATS}
    M = dot_scaled.DOT_SCALED_MIN_M
    for a_fmt, b_fmt in [("mxfp8", "mxfp8"), ("mxfp4", "mxfp4"), ("mxfp8", "mxfp4"), ("mxfp4", "mxfp8"),
                         ("nvfp4", "nvfp4")]:
        assert dot_scaled.fits(a_fmt, q[b_fmt], M), (a_fmt, b_fmt)
        assert not dot_scaled.fits(a_fmt, q[b_fmt], M - 1), (a_fmt, b_fmt)
    # One MMA has one kind of scale; bf16 activations have none.
    for a_fmt, b_fmt in [("nvfp4", "mxfp4"), ("mxfp8", "nvfp4"), ("bf16", "mxfp4"), ("bf16", "nvfp4")]:
        assert not dot_scaled.fits(a_fmt, q[b_fmt], M), (a_fmt, b_fmt)
    monkeypatch.setattr(runtime, "capability", lambda device_index=0: (9, 0))
    assert not dot_scaled.fits("mxfp8", q["mxfp8"], M)


def test_sm100_kernel_compiles_to_block_scaled_mma():
    # Triton's compiler and ptxas target sm_100 without one (or any GPU): every pair's kernel must
    # issue tcgen05.mma of its block-scaled kind, fit shared memory and not spill.
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": os.path.join(root, "src")}
    result = subprocess.run([sys.executable, os.path.join(root, "scripts", "blackwell_check.py")], env=env,
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count(" ok ") == 5, result.stdout


@gpu_only
@pytest.mark.parametrize("fmt_a,fmt_b", [("mxfp8", "mxfp8"), ("mxfp4", "mxfp4"), ("mxfp8", "mxfp4"),
                                         ("mxfp4", "mxfp8")])
@pytest.mark.parametrize("M,N,K,out_dtype", [(300, 520, 1056, torch.float32), (129, 17, 96, torch.float32),
                                             (256, 256, 512, torch.bfloat16)])
def test_sm100_kernel_on_this_gpu(fmt_a, fmt_b, M, N, K, out_dtype, device, monkeypatch):
    # sm_100's kernel runs here because Triton emulates tl.dot_scaled on Hopper, the MX operands
    # upcast to bf16 in shared memory (two stages fit there). It cannot upcast nvfp4's e4m3
    # scales: test_sm100_kernel_compiles_to_block_scaled_mma covers that pair. Shapes: a tail of K
    # (and of the scales' 4-column chunks), M and N past and under a tile.
    monkeypatch.setattr(dot_scaled, "DOT_SCALED_TILE", (128, 256, 2))
    a = quant.quantize(torch.randn(M, K, device=device), fmt_a)
    b = quant.quantize(torch.randn(N, K, device=device) * 3, fmt_b, axis=1)
    bias = torch.randn(N, device=device)
    c = torch.full((M, N), float("nan"), device=device, dtype=out_dtype)
    dot_scaled.run(a, b, c, M, N, K, bias, None)
    ref = scaled_matmul_reference(a, b, torch.float32, bias=bias)
    assert _relative_error(c, ref) <= (1e-5 if out_dtype == torch.float32 else 4e-3)


@pytest.mark.parametrize("fmt_a,fmt_b", [(None, "nvfp4"), (None, "mxfp8"), ("mxfp8", "mxfp8"), ("nvfp4", "nvfp4"),
                                         ("mxfp8", "mxfp4")])
def test_dequantize_first_path_in_slabs(fmt_a, fmt_b, device, monkeypatch):
    # Every M takes the dequantize-then-matmul path, with B in slabs of 256 rows (the last one
    # partial), bias and nvfp4's tensor scales applied in the matmul's epilogue.
    monkeypatch.setattr(dequantize_first, "DEQUANTIZE_FIRST_MIN_M", 1)
    monkeypatch.setattr(wgmma, "WGMMA_MIN_M", 1 << 30)  # which takes bf16 activations before it on Hopper
    monkeypatch.setattr(dequantize_first, "DEQUANTIZE_SLAB_BYTES", 1)
    M, N, K = 19, 600, 64
    x = torch.randn(M, K, device=device)
    a = quant.quantize(x, fmt_a) if fmt_a else x.to(torch.bfloat16)
    b = quant.quantize(torch.randn(N, K, device=device), fmt_b, axis=1)
    bias = torch.randn(N, device=device)
    out = scaled_matmul(a, b, out_dtype=torch.float32, bias=bias)
    ref = scaled_matmul_reference(a, b, torch.float32, bias=bias)
    assert _relative_error(out, ref) <= 1e-5
    out16 = scaled_matmul(a, b, bias=bias)
    assert out16.dtype == torch.bfloat16 and _relative_error(out16, ref) <= 4e-3
    assert torch.equal(scaled_matmul(a, b, out_dtype=torch.float32, bias=bias), out)  # replayed launches


def test_bad_input_is_named(device):
    w = quant.quantize(torch.randn(8, 64, device=device), "mxfp8", axis=1)
    with pytest.raises(ValueError, match="a has K = 32 but b has K = 64"):
        scaled_matmul(torch.randn(4, 32, device=device).to(torch.bfloat16), w)
    with pytest.raises(TypeError, match="a"):
        scaled_matmul(torch.randn(4, 64, device=device), w)
    with pytest.raises(TypeError, match="b must be a tritonformer.quant.QuantizedTensor"):
        scaled_matmul(torch.randn(4, 64, device=device).to(torch.bfloat16), torch.randn(8, 64, device=device))
    with pytest.raises(ValueError, match="bias must be"):
        scaled_matmul(torch.randn(4, 64, device=device).to(torch.bfloat16), w, bias=torch.randn(3, device=device))


@pytest.mark.parametrize("fmt", list(quant.FORMATS))
def test_quantized_linear_from_linear(fmt, device):
    import tritonformer.nn as tnn

    linear = torch.nn.Linear(64, 24).to(device)
    layer = tnn.QuantizedLinear.from_linear(linear, fmt)
    x = torch.randn(2, 3, 64, device=device).to(torch.bfloat16)
    out = layer(x)
    assert out.shape == (2, 3, 24) and out.dtype == torch.bfloat16
    ref = scaled_matmul_reference(x.reshape(-1, 64), layer.weight, torch.float32, bias=linear.bias.detach())
    assert _relative_error(out.reshape(-1, 24), ref) <= 4e-3
    # The quantized weight is close to the float one, and the state_dict reloads.
    assert _relative_error(layer.weight.dequantize(), linear.weight.detach()) < 0.2
    fresh = tnn.QuantizedLinear(64, 24, fmt, device=device)
    fresh.load_state_dict(layer.state_dict())
    assert torch.equal(fresh(x), out)


def test_quantized_linear_names_its_input_when_the_dtype_is_wrong(device):
    import tritonformer.nn as tnn

    layer = tnn.QuantizedLinear(64, 24, "mxfp4", device=device)
    with pytest.raises(TypeError, match="^x has dtype torch.float32; supported: bfloat16"):
        layer(torch.randn(3, 64, device=device))


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_quantized_linear_runs_the_weight_loaded_into_it(fmt, device):
    # The copies of the scales that kernels make are kept with the layer's buffer across calls; a
    # load_state_dict into a layer already used, which copies into the same buffers in place,
    # must not run the old weight.
    import tritonformer.nn as tnn

    layer, other = (tnn.QuantizedLinear.from_linear(torch.nn.Linear(256, 40).to(device), fmt) for _ in range(2))
    x = torch.randn(6, 256, device=device).to(torch.bfloat16)
    assert layer.weight.scales_by_step(128) is layer.weight.scales_by_step(128)
    layer(x)
    layer.load_state_dict(other.state_dict())
    assert torch.equal(layer(x), other(x))


@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4"])
def test_scaled_matmul_under_torch_compile(fmt, device):
    # One opaque node for torch.compile (no graph break), bf16 or quantized activations, with the
    # layer's scales copy still made once: it lives with the buffer, not the QuantizedTensor.
    import tritonformer.nn as tnn

    layer = tnn.QuantizedLinear.from_linear(torch.nn.Linear(256, 40).to(device), fmt)
    x = torch.randn(2, 3, 256, device=device).to(torch.bfloat16)
    assert torch.equal(compile_fullgraph(layer)(x), layer(x))
    if wgmma.fits(layer.weight, 6, 256):
        assert layer.weight_scales.untyped_storage() in quant._SCALE_COPIES
    a = quant.quantize(torch.randn(5, 256, device=device), fmt, axis=1)
    w = layer.weight
    product = compile_fullgraph(lambda a, w: scaled_matmul(a, w, out_dtype=torch.float32))
    assert torch.equal(product(a, w), scaled_matmul(a, w, out_dtype=torch.float32))


@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4"])
def test_quantized_linear_survives_a_dtype_cast(fmt, device):
    import tritonformer.nn as tnn

    layer = tnn.QuantizedLinear.from_linear(torch.nn.Linear(64, 24).to(device), fmt)
    x = torch.randn(5, 64, device=device).to(torch.bfloat16)
    before = layer(x)
    layer.to(torch.bfloat16)
    assert layer.weight_data.dtype == torch.uint8 and layer.weight_scales.dtype == torch.uint8
    assert torch.equal(layer.weight.dequantize(), layer.to(torch.float16).weight.dequantize())
    assert _relative_error(layer(x), before) < 1e-2  # only the bias was rounded to bf16


@pytest.mark.parametrize("fmt", list(quant.FORMATS))
@pytest.mark.parametrize("M", [1, 17, 300])
def test_the_activation_and_bias_get_their_gradients(fmt, M, device):
    # QLoRA: the frozen block-scaled weight passes gradients back to the layers before it.
    import tritonformer.nn as tnn

    N, K = 48, 128
    w = quant.quantize(torch.randn(N, K, device=device), fmt, axis=1)
    x = torch.randn(M, K, device=device).to(torch.bfloat16).requires_grad_()
    bias = torch.randn(N, device=device).to(torch.bfloat16).requires_grad_()
    dy = torch.randn(M, N, device=device).to(torch.bfloat16)
    dx, dbias = torch.autograd.grad(scaled_matmul(x, w, bias=bias), (x, bias), dy)
    w64 = quant.dequantize_reference(w).double()
    assert (dx.double() - dy.double() @ w64).norm() / (dy.double() @ w64).norm() < 1e-2
    assert (dbias.double() - dy.double().sum(0)).norm() / dy.double().sum(0).norm() < 1e-2
    # B quantized along axis 0, (K, N): A @ B, so dA = dC B^T.
    w0 = quant.quantize(torch.randn(K, N, device=device), fmt, axis=0)
    (dx0,) = torch.autograd.grad(scaled_matmul(x, w0), x, dy)
    expected = dy.double() @ quant.dequantize_reference(w0).double().t()
    assert (dx0.double() - expected).norm() / expected.norm() < 1e-2
    # A layer after a trainable one: the gradient reaches it, eager and compiled alike.
    layer = tnn.QuantizedLinear.from_linear(torch.nn.Linear(K, N).to(device), fmt)
    trainable = torch.nn.Linear(K, K).to(device).to(torch.bfloat16)
    h = torch.randn(M, K, device=device).to(torch.bfloat16)
    layer(trainable(h)).float().sum().backward()
    eager = trainable.weight.grad.clone()
    trainable.weight.grad = None
    compile_fullgraph(lambda t: layer(trainable(t)).float().sum())(h).backward()
    assert (trainable.weight.grad.double() - eager.double()).norm() / eager.double().norm() < 1e-2


@pytest.mark.parametrize("wide", [False, pytest.param(True, marks=gpu_only)])
@pytest.mark.parametrize("fmt", list(quant.FORMATS))
@pytest.mark.parametrize("M,N,K,axis", [(1, 48, 128, 1), (17, 130, 192, 1), (5, 70, 64, 0)])
def test_the_activation_gradient_decodes_the_weight_in_registers(fmt, M, N, K, axis, wide, device, monkeypatch):
    """dA = dC B by activation_grad's kernel (B's rows split across programs where N is past two
    of its steps; `wide`: the large weights' tiles) against float64: fresh data each call, the
    second call of a layout replayed, a transposed dC; and the autograd backward of a few rows
    takes this kernel."""
    if wide:
        monkeypatch.setattr(activation_grad, "WIDE_TILE_MIN_WEIGHT", 0)
    shape = (N, K) if axis == 1 else (K, N)
    w = quant.quantize(torch.randn(*shape, device=device), fmt, axis=axis)
    w64 = quant.dequantize_reference(w).double()
    w64 = w64 if axis == 1 else w64.t()
    for transposed in (False, False, True):
        dc = torch.randn(N, M, device=device).t() if transposed else torch.randn(M, N, device=device)
        dc = dc.to(torch.bfloat16)
        assert_close(activation_grad.run(dc, w), dc.double() @ w64, torch.bfloat16, "norm")
    assert len(activation_grad.run.plans) == 2  # the second call of the first layout replayed
    calls = []
    run = activation_grad.run
    monkeypatch.setattr(activation_grad, "run", lambda *args: calls.append(args) or run(*args))
    x = torch.randn(M, K, device=device).to(torch.bfloat16).requires_grad_()
    (dx,) = torch.autograd.grad(scaled_matmul(x, w), x, dc)
    assert len(calls) == 1 and torch.equal(dx, run(dc, w))


@pytest.mark.parametrize("M", [1, 17, 520])
def test_a_warm_up_leaves_the_plans_working(M, device):
    # A warm-up's launches only compile: the plans it makes must not keep its (absent) entries.
    w = quant.quantize(torch.randn(40, 256, device=device), "nvfp4", axis=1)
    x = torch.randn(M, 256, device=device).to(torch.bfloat16)
    runtime.warm(scaled_matmul, x.clone().requires_grad_(), w)
    torch.testing.assert_close(scaled_matmul(x, w), scaled_matmul_reference(x, w), rtol=2e-2, atol=2e-2)
    bias = torch.randn(40, device=device).requires_grad_()
    with pytest.raises(ValueError, match="^bias requires grad, but scaled_matmul with a block-scaled a"):
        scaled_matmul(quant.quantize(x.float(), "mxfp8"), quant.quantize(torch.randn(40, 256, device=device),
                                                                         "mxfp8", axis=1), bias=bias)
