import pytest
import torch

import tritonformer
from tritonformer import nn as tnn
from tritonformer.ops import norm
from tritonformer.testing import assert_close

from conftest import ON_GPU
from helpers import compile_fullgraph, foreign_device_tensor


def _llama_rms_norm(x, weight, eps):
    # HuggingFace's LlamaRMSNorm.forward, verbatim in meaning.
    hidden = x.to(torch.float32)
    hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + eps)
    return weight * hidden.to(x.dtype)


@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float32])
def test_rms_norm_matches_hf_rounding_and_promotion(device, weight_dtype):
    x = torch.randn(6, 257, device=device).to(torch.bfloat16)
    w = torch.randn(257, device=device).to(weight_dtype)
    out = tritonformer.rms_norm(x, w, 1e-6)
    expected = _llama_rms_norm(x, w, 1e-6)
    assert out.dtype == expected.dtype
    diff = (out.double() - expected.double()).abs()
    if ON_GPU:
        # The same roundings in the same order: equal, but where float32 rsqrt implementations
        # differ in the last bit just before a rounding.
        assert (diff <= 2**-7 * expected.double().abs()).all()
        assert (diff == 0).float().mean() > 0.95
    else:
        # The interpreter truncates float32 -> bfloat16 instead of rounding: two steps apart.
        assert (diff <= 2**-6 * expected.double().abs()).all()


@pytest.mark.parametrize("fn", [tritonformer.rms_norm, tritonformer.layer_norm])
def test_bad_input(device, fn):
    x = torch.randn(4, 8, device=device)
    with pytest.raises(TypeError, match="x"):
        fn(x.to(torch.int32))
    with pytest.raises(ValueError, match="weight"):
        fn(x, torch.ones(7, device=device))
    with pytest.raises(TypeError, match="weight"):
        fn(x, torch.ones(8, device=device, dtype=torch.int64))
    with pytest.raises(ValueError, match="x"):
        fn(foreign_device_tensor())
    with pytest.raises(ValueError, match="x"):
        fn(torch.tensor(1.0, device=device))
    with pytest.raises(ValueError, match="eps"):
        fn(x, None, eps=-1.0) if fn is tritonformer.rms_norm else fn(x, None, None, -1.0)


def test_layer_norm_bias_shape_error(device):
    x = torch.randn(4, 8, device=device)
    with pytest.raises(ValueError, match="bias"):
        tritonformer.layer_norm(x, torch.ones(8, device=device), torch.ones(4, device=device))


def test_looped_backward_with_more_rows_than_programs(device, monkeypatch):
    monkeypatch.setattr(norm, "FUSED_MAX_N", 64)
    monkeypatch.setattr(norm, "LOOP_CHUNK", 32)
    x = torch.randn(40, 100, device=device, requires_grad=True)
    w = torch.randn(100, device=device, requires_grad=True)
    b = torch.randn(100, device=device, requires_grad=True)
    dy = torch.randn(40, 100, device=device)
    for fn, args, ref in (
        (tritonformer.layer_norm, (x, w, b), lambda x, w, b: torch.nn.functional.layer_norm(x, (100,), w, b)),
        (tritonformer.rms_norm, (x, w), lambda x, w: norm.rms_norm_reference(x, w)),
    ):
        out = fn(*args)
        grads = torch.autograd.grad(out, args, dy)
        leaves = [a.detach().double().requires_grad_(True) for a in args]
        expected = ref(*leaves)
        ref_grads = torch.autograd.grad(expected, leaves, dy.double())
        assert_close(out, expected, torch.float32)
        for g, r in zip(grads, ref_grads):
            assert_close(g, r, torch.float32, "norm")


def test_no_grad_input_builds_no_graph(device):
    x = torch.randn(3, 16, device=device)
    assert tritonformer.rms_norm(x, torch.ones(16, device=device)).grad_fn is None


def test_modules_load_state_dicts_and_match(device):
    rms = tnn.RMSNorm(32, eps=1e-5).to(device)
    rms.load_state_dict({"weight": torch.randn(32)})
    x = torch.randn(2, 5, 32, device=device)
    assert_close(rms(x), norm.rms_norm_reference(x.double(), rms.weight.double(), 1e-5), torch.float32)
    gemma = tnn.RMSNorm(32, offset=1.0).to(device)
    assert_close(gemma(x), norm.rms_norm_reference(x.double(), gemma.weight.double(), 1e-6, 1.0), torch.float32)

    ln = tnn.LayerNorm(32).to(device)
    torch_ln = torch.nn.LayerNorm(32).to(device)
    torch.nn.init.normal_(torch_ln.weight)
    torch.nn.init.normal_(torch_ln.bias)
    ln.load_state_dict(torch_ln.state_dict())
    expected = torch.nn.functional.layer_norm(x.double(), (32,), torch_ln.weight.double(), torch_ln.bias.double())
    assert_close(ln(x), expected, torch.float32)
    with pytest.raises(ValueError, match="last dimension"):
        tnn.LayerNorm((4, 32))


@pytest.mark.parametrize("fn", [tritonformer.rms_norm, tritonformer.layer_norm])
def test_compiles_without_graph_breaks(device, fn):
    x = torch.randn(8, 48, device=device, requires_grad=True)
    w = torch.randn(48, device=device, requires_grad=True)

    def loss(x, w):
        return fn(x, w).square().sum()

    expected = torch.autograd.grad(loss(x, w), (x, w))
    got = torch.autograd.grad(compile_fullgraph(loss)(x, w), (x, w))
    for g, e in zip(got, expected):
        assert_close(g, e.double(), torch.float32, "norm")


def test_layer_norm_backward_of_wide_rows_takes_the_looped_kernel(device, monkeypatch):
    monkeypatch.setattr(norm, "LAYER_NORM_BWD_MAX_N", 64)
    x = torch.randn(9, 100, device=device, requires_grad=True)
    w = torch.randn(100, device=device, requires_grad=True)
    b = torch.randn(100, device=device, requires_grad=True)
    dy = torch.randn(9, 100, device=device)
    grads = torch.autograd.grad(tritonformer.layer_norm(x, w, b), (x, w, b), dy)
    leaves = [t.detach().double().requires_grad_(True) for t in (x, w, b)]
    expected = torch.autograd.grad(torch.nn.functional.layer_norm(leaves[0], (100,), leaves[1], leaves[2]), leaves,
                                   dy.double())
    for g, e in zip(grads, expected):
        assert_close(g, e, torch.float32, "norm")


def test_add_rms_norm_is_the_unfused_add_then_norm(device):
    """h is torch's rounded sum; y is rms_norm of it (the same kernel arithmetic)."""
    x, res = (torch.randn(6, 300, device=device).to(torch.bfloat16) for _ in range(2))
    w = torch.randn(300, device=device).to(torch.bfloat16)
    y, h = tritonformer.add_rms_norm(x, res, w, 1e-6)
    assert torch.equal(y, tritonformer.rms_norm(h, w, 1e-6))
    if ON_GPU:
        assert torch.equal(h, x + res)
    else:  # the interpreter truncates float32 -> bfloat16 where torch rounds: one step apart at most
        expected = (x.double() + res.double()).to(torch.bfloat16).double()
        assert ((h.double() - expected).abs() <= 2**-7 * expected.abs()).all()


def test_add_rms_norm_bad_input(device):
    x = torch.randn(4, 8, device=device)
    with pytest.raises(ValueError, match="residual"):
        tritonformer.add_rms_norm(x, torch.randn(4, 7, device=device))
    with pytest.raises(TypeError, match="residual"):
        tritonformer.add_rms_norm(x, x.double())
    with pytest.raises(ValueError, match="weight"):
        tritonformer.add_rms_norm(x, x, torch.ones(7, device=device))


def test_add_rms_norm_compiles_without_graph_breaks(device):
    x, res = (torch.randn(8, 48, device=device, requires_grad=True) for _ in range(2))
    w = torch.randn(48, device=device, requires_grad=True)

    def loss(x, res, w):
        y, h = tritonformer.add_rms_norm(x, res, w)
        return y.square().sum() + h.sum()

    expected = torch.autograd.grad(loss(x, res, w), (x, res, w))
    got = torch.autograd.grad(compile_fullgraph(loss)(x, res, w), (x, res, w))
    for g, e in zip(got, expected):
        assert_close(g, e.double(), torch.float32, "norm")
