"""decode_linear, decode_swiglu and argmax beyond the registry's cases: bad input named, the
inference-only contract, a weight passed twice, the choice of launch by rows, and fp4 products
chained through PreparedRows against the same products unchained."""

import pytest
import torch

import tritonformer  # noqa: F401  (before triton: picks the interpreter)
from tritonformer import quant
from tritonformer.ops.argmax import argmax
from tritonformer.ops.decode_linear import (MAX_ROWS, PreparedRow, decode_linear, decode_linear_into_norm,
                                            decode_linear_into_norm_reference, decode_linear_reference, decode_swiglu,
                                            prepared_words, unprepared)
from tritonformer.testing import assert_close

from helpers import foreign_device_tensor


def _xw(device, M=2, K=32, N=8, dtype=torch.float32):
    return torch.randn(M, K, device=device).to(dtype), torch.randn(N, K, device=device).to(dtype)


@pytest.mark.parametrize(
    "change,error,match",
    [
        (lambda x, w: (x.double(), [w], None), TypeError, "x has dtype torch.float64"),
        (lambda x, w: (x[0], [w], None), ValueError, r"x must be \(M, K\)"),
        (lambda x, w: (x.new_zeros(MAX_ROWS + 1, 32), [w], None), ValueError, f"1 <= M <= {MAX_ROWS}"),
        (lambda x, w: (x, [], None), ValueError, "weights must hold 1 to 3"),
        (lambda x, w: (x, [w] * 4, None), ValueError, "weights must hold 1 to 3"),
        (lambda x, w: (x, [w.half()], None), TypeError, r"weights\[0\] has dtype torch.float16"),
        (lambda x, w: (x, [w, w[:, :5]], None), ValueError, r"weights\[1\] must be \(N, 32\)"),
        (lambda x, w: (x, [w], [None, None]), ValueError, "biases must be None or one per weight"),
        (lambda x, w: (x, [w], [w[0]]), ValueError, r"biases\[0\] must have shape \(8,\)"),
        (lambda x, w: (x, [foreign_device_tensor()], None), ValueError, "weights\\[0\\] is on meta"),
    ],
)
def test_bad_input_is_named(device, change, error, match):
    x, w = _xw(device)
    with pytest.raises(error, match=match):
        decode_linear(*change(x, w))


def test_inference_only(device):
    x, w = _xw(device)
    with pytest.raises(ValueError, match="inference ops"):
        decode_linear(x, [w.requires_grad_(True)])
    with torch.no_grad():
        (y,) = decode_linear(x, [w])
    assert not y.requires_grad
    with pytest.raises(ValueError, match="w_gate and w_up must have one shape"):
        decode_swiglu(x, w.detach(), w.detach()[:4])


def test_one_weight_in_several_places(device):
    # The q, k and v of a tied model, or one weight passed twice: each output is its own product.
    x, w = _xw(device, M=3)
    a, b = decode_linear(x, [w, w], [None, torch.ones(8, device=device)])
    assert torch.allclose(a, x @ w.t(), atol=1e-5) and torch.allclose(b, x @ w.t() + 1, atol=1e-5)


def test_argmax_bad_input(device):
    with pytest.raises(ValueError, match="empty last dimension"):
        argmax(torch.zeros(3, 0, device=device))
    with pytest.raises(TypeError, match="x has dtype torch.int64"):
        argmax(torch.zeros(3, 4, dtype=torch.long, device=device))
    assert argmax(torch.zeros(0, 5, device=device)).shape == (0,)


def test_bad_norm_is_named(device):
    x, w = _xw(device)
    norm = (torch.ones(32, device=device), 1e-6, 0.0)
    with pytest.raises(ValueError, match="residual is added before the norm"):
        decode_linear(x, [w], residual=x)
    with pytest.raises(ValueError, match=r"norm must be None or \(weight, eps, offset\)"):
        decode_linear(x, [w], norm=norm[:2])
    with pytest.raises(ValueError, match=r"the norm weight must have shape \(32,\)"):
        decode_linear(x, [w], norm=(torch.ones(31, device=device), 1e-6, 0.0))
    with pytest.raises(ValueError, match="eps and offset must be finite"):
        decode_linear(x, [w], norm=(norm[0], float("nan"), 0.0))
    with pytest.raises(TypeError, match="residual has dtype torch.float16"):
        decode_swiglu(x, w, w, norm=norm, residual=x.half())
    with pytest.raises(ValueError, match="residual must have x's shape"):
        decode_swiglu(x, w, w, norm=norm, residual=x[:1])


def test_the_sum_is_stored_once_for_every_tile(device):
    # Program 0 stores x + residual; the other programs' tiles must not need it (nor write it).
    x, w = _xw(device, M=3, K=40, N=300)
    r = torch.randn_like(x)
    norm = (torch.rand(40, device=device) + 0.5, 1e-6, 0.0)
    y, total = decode_linear(x, [w], norm=norm, residual=r)
    assert torch.equal(total, x + r)
    h = (x + r) * torch.rsqrt((x + r).pow(2).mean(-1, keepdim=True) + 1e-6) * norm[0]
    assert torch.allclose(y, h @ w.t(), atol=1e-4, rtol=1e-4)


def test_exported_and_compiles_without_graph_breaks(device):
    x, w = _xw(device, M=2, K=32, N=24)
    r, nw = torch.randn_like(x), torch.rand(32, device=device) + 0.5
    assert (tritonformer.decode_linear, tritonformer.decode_swiglu, tritonformer.argmax) == (
        decode_linear, decode_swiglu, argmax)

    def step(x, r):
        q, k, total = decode_linear(x, [w, w[:8]], norm=(nw, 1e-6, 0.0), residual=r)
        h = decode_swiglu(total, w, w, norm=(nw, 1e-6, 1.0))
        return argmax(h + q), k

    with torch.no_grad():
        compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
        expected = step(x, r)
        for got, want in zip(compiled(x, r), expected):
            assert torch.equal(got, want)


@pytest.mark.parametrize("rows", [1, 3])
def test_large_activations_do_not_overflow_fp16(device, rows):
    # x times the norm weight passes fp16's 65504; normalised first (as HF), it does not.
    x = torch.randn(rows, 64, device=device).half()
    x[:, 5] = 3000
    nw = torch.ones(64, device=device).half()
    nw[5] = 30
    w = (torch.randn(16, 64, device=device) / 8).half()
    (y,) = decode_linear(x, [w], norm=(nw, 1e-6, 0.0))
    (expected,) = decode_linear_reference(x.double(), [w.double()], norm=(nw.double(), 1e-6, 0.0))
    assert torch.isfinite(y).all()
    assert_close(y, expected, torch.float16, "norm")


def test_fp4_weights_bad_input_is_named(device):
    x = torch.randn(1, 64, device=device).bfloat16()
    w = torch.randn(16, 64, device=device)
    nv, mx = quant.quantize(w, "nvfp4", axis=1), quant.quantize(w, "mxfp4", axis=1)
    with pytest.raises(TypeError, match="all tensors or all QuantizedTensors of one of nvfp4, mxfp4"):
        decode_linear(x, [nv, mx])
    with pytest.raises(TypeError, match="all tensors or all QuantizedTensors"):
        decode_linear(x, [nv, w.bfloat16()])
    with pytest.raises(TypeError, match="'mxfp8'"):
        decode_linear(x, [quant.quantize(w, "mxfp8", axis=1)])
    with pytest.raises(ValueError, match="one bf16 row, got x torch.bfloat16 of 2 rows"):
        decode_swiglu(x.expand(2, 64), nv, nv)
    with pytest.raises(ValueError, match="one bf16 row, got x torch.float32"):
        decode_linear(x.float(), [nv])
    with pytest.raises(ValueError, match="quantized along K"):
        decode_linear(x[:, :16], [quant.quantize(w.t().contiguous(), "nvfp4", axis=0)])
    with pytest.raises(ValueError, match=r"weights\[0\] must be \(N, 32\)"):
        decode_linear(x[:, :32], [nv])


@pytest.mark.parametrize("magnitude", [1e-30, 1e-6, 1e4, 1e7])
def test_fp4_weights_keep_tiny_and_huge_activations(device, magnitude):
    # The products run in bf16 on x scaled by 2^100: neither underflow nor overflow in bf16's range.
    x = (torch.randn(1, 256, device=device) * magnitude).bfloat16()
    r = (torch.randn(1, 256, device=device) * magnitude).bfloat16()
    nw = (torch.rand(256, device=device) + 0.5).bfloat16()
    w = quant.quantize(torch.randn(40, 256, device=device), "nvfp4", axis=1)
    y, total = decode_linear(x, [w], norm=(nw, 1e-6, 0.0), residual=r)
    (z,) = decode_linear(x, [w])
    expected, _ = decode_linear_reference(x.double(), [w], norm=(nw.double(), 1e-6, 0.0), residual=r.double())
    (plain,) = decode_linear_reference(x.double(), [w])
    assert_close(y, expected, torch.bfloat16, "norm")
    assert_close(z, plain, torch.bfloat16, "norm")


def test_fp4_weights_without_tensor_scale_or_columns(device):
    # nvfp4 without a tensor scale has a scale of 1 (as quant.dequantize); K = 0 gives the bias.
    x = torch.randn(1, 64, device=device).bfloat16()
    w = quant.quantize(torch.randn(24, 64, device=device), "nvfp4", axis=1)
    unscaled = quant.QuantizedTensor(w.data, w.scales, w.fmt, w.shape, w.axis)
    (y,) = decode_linear(x, [unscaled])
    (expected,) = decode_linear_reference(x.double(), [unscaled])
    assert_close(y, expected, torch.bfloat16, "norm")
    empty = quant.quantize(torch.randn(8, 0, device=device), "nvfp4", axis=1)
    bias = torch.randn(8, device=device).bfloat16()
    (y,) = decode_linear(x[:, :0], [empty], [bias])
    assert torch.equal(y, bias[None])


def _fp4_layer(device, K=48, I=80, fmt="nvfp4"):
    """A bf16 row, residual and norm weight of K columns and fp4 o, gate, up and down weights."""
    def weight(n, k):
        return quant.quantize(torch.randn(n, k, device=device) / k**0.5, fmt, axis=1)
    x, r = (torch.randn(1, K, device=device).bfloat16() for _ in range(2))
    nw = (torch.rand(K, device=device) + 0.5).bfloat16()
    return x, r, (nw, 1e-6, 0.0), weight(K, K), weight(I, K), weight(I, K), weight(K, I)


def test_prepared_rows_give_the_unchained_products(device):
    # K off the tiles (the words' and the squares' tails): each chained result equals the one
    # each product computes with the norm and the residual inside (the squares' order aside).
    x, r, norm, w_o, w_gate, w_up, w_down = _fp4_layer(device)
    post, mid = decode_linear_into_norm(x, w_o, r, norm)
    (o,) = decode_linear(x, [w_o])
    act, mid_unchained = decode_swiglu(o, w_gate, w_up, norm=norm, residual=r)
    assert torch.equal(mid, mid_unchained)
    act_prepared = decode_swiglu(post, w_gate, w_up, prepared=True)
    assert_close(unprepared(act_prepared), act.float(), torch.bfloat16, "norm")
    normed, out = decode_linear_into_norm(act_prepared, w_down, mid, norm)
    (down,) = decode_linear(act, [w_down])
    assert torch.equal(decode_linear(act_prepared, [w_down])[0], down)
    q, k, total = decode_linear(down, [w_o, w_gate], norm=norm, residual=mid)
    assert torch.equal(out, total)
    for chained, unchained in zip(decode_linear(normed, [w_o, w_gate]), (q, k)):
        assert_close(chained, unchained, torch.bfloat16, "norm")
    expected, expected_sum = decode_linear_into_norm_reference(x, w_o, r, norm)
    assert_close(unprepared(post), unprepared(expected), torch.bfloat16, "norm")
    assert_close(mid, expected_sum, torch.bfloat16, "norm")
    assert_close(post.squares, expected.squares, torch.bfloat16, "norm")


def test_prepared_words_are_the_row_in_pair_order(device):
    x = torch.randn(3, 24, device=device).bfloat16()
    words = prepared_words(x)
    assert torch.equal(words[:, :8].float() * 2.0**-100, x[:, [0, 4, 1, 5, 2, 6, 3, 7]].float())
    assert torch.equal(unprepared(PreparedRow(words)), x.float())
    assert prepared_words(x[:, :0]).shape == (3, 0) and unprepared(PreparedRow(words[:, :0])).shape == (3, 0)


def test_prepared_rows_without_columns_or_rows(device):
    # K = 0: the sums are the bias, the output the residual (prepared from it); N = 0: empty rows.
    x, r, norm, *_ = _fp4_layer(device, K=16)
    empty = quant.quantize(torch.randn(16, 0, device=device), "nvfp4", axis=1)
    bias = torch.randn(16, device=device).bfloat16()
    post, total = decode_linear_into_norm(x[:, :0], empty, r, norm, bias)
    assert torch.equal(total, (bias + r).bfloat16())
    expected, _ = decode_linear_into_norm_reference(x[:, :0], empty, r, norm, bias)
    assert torch.equal(post.words, expected.words) and torch.equal(post.squares, expected.squares)
    act, x_r = decode_swiglu(x[:, :0], empty, empty, norm=(norm[0][:0], 1e-6, 0.0), residual=x[:, :0], prepared=True)
    assert torch.equal(act.words, torch.zeros_like(act.words)) and x_r.shape == (1, 0)
    none = quant.quantize(torch.randn(0, 16, device=device), "nvfp4", axis=1)
    post, total = decode_linear_into_norm(x, none, r[:, :0], (norm[0][:0], 1e-6, 0.0))
    assert post.words.shape == (1, 0) and post.squares.shape == (0,) and total.shape == (1, 0)
    assert decode_swiglu(x, none, none, prepared=True).words.shape == (1, 0)


def test_prepared_rows_take_strided_squares_and_biases(device):
    x, r, norm, w_o, *_ = _fp4_layer(device)
    post, _ = decode_linear_into_norm(x, w_o, r, norm)
    strided = PreparedRow(post.words, torch.stack([post.squares, post.squares], 1)[:, 0], post.eps)
    bias = torch.randn(48, device=device).bfloat16()
    assert torch.equal(decode_linear(strided, [w_o], [bias])[0], decode_linear(post, [w_o], [bias])[0])
    with pytest.raises(ValueError, match=r"biases\[0\] must have shape \(48,\)"):
        decode_linear(post, [w_o], [bias[:8]])


def test_prepared_rows_are_exported_and_compile_without_graph_breaks(device):
    x, r, norm, w_o, w_gate, w_up, w_down = _fp4_layer(device)
    assert (tritonformer.PreparedRow, tritonformer.decode_linear_into_norm) == (PreparedRow, decode_linear_into_norm)

    def layer(x, r):
        post, mid = decode_linear_into_norm(x, w_o, r, norm)
        act = decode_swiglu(post, w_gate, w_up, prepared=True)
        normed, out = decode_linear_into_norm(act, w_down, mid, norm)
        return decode_linear(normed, [w_o])[0], out

    with torch.no_grad():
        compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
        for got, want in zip(compiled(x, r), layer(x, r)):
            assert torch.equal(got, want)


def test_prepared_rows_bad_input_is_named(device):
    x, r, norm, w_o, w_gate, w_up, w_down = _fp4_layer(device)
    post, _ = decode_linear_into_norm(x, w_o, r, norm)
    with pytest.raises(ValueError, match="carries its norm"):
        decode_linear(post, [w_o], norm=norm)
    with pytest.raises(TypeError, match="operand of fp4 weights"):
        decode_linear(post, [w_o.dequantize(torch.bfloat16)])
    with pytest.raises(ValueError, match=r"x.words must be \(1, K\) with K a multiple of 8"):
        decode_linear(PreparedRow(post.words[:, :36]), [w_o])
    with pytest.raises(ValueError, match=r"x.squares must have shape \(12,\)"):
        decode_linear(PreparedRow(post.words, post.squares[:4], 1e-6), [w_o])
    with pytest.raises(ValueError, match="without a norm"):
        decode_linear_into_norm(post, w_o, r, norm)
    w_50 = quant.quantize(torch.randn(50, 48, device=device), "nvfp4", axis=1)
    with pytest.raises(ValueError, match="N a multiple of 8, got 50"):
        decode_swiglu(post, w_50, w_50, prepared=True)
    with pytest.raises(ValueError, match=r"residual must have shape \(1, 48\)"):
        decode_linear_into_norm(x, w_o, r[:, :8], norm)
    with pytest.raises(TypeError, match="residual has dtype torch.float32"):
        decode_linear_into_norm(x, w_o, r.float(), norm)
    with pytest.raises(ValueError, match="needs the residual and the next norm"):
        decode_linear_into_norm(x, w_o, r, None)
    with pytest.raises(ValueError, match="inference ops"):
        decode_linear_into_norm(x, w_o, r.clone().requires_grad_(True), norm)
