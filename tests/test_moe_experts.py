"""moe_experts and its parts beyond the registry's cases: HF's expert loop and HF's experts
module, tritonformer.nn.MoE against HF's Qwen3-MoE block, experts that get no token, routing extremes (every token to one expert, top-k of every
expert, one token), determinism, the no-gradient path, torch.compile, bad input; gpt_oss_experts'
idle experts, determinism, torch.compile and bad input."""

import pytest
import torch

from tritonformer import nn as tnn
from tritonformer.ops.moe_experts import (gpt_oss_experts, gpt_oss_experts_reference, moe_combine, moe_dispatch,
                                          moe_experts, moe_experts_reference, moe_gather)
from tritonformer.testing import assert_close

from conftest import gpu_only
from helpers import compile_fullgraph, foreign_device_tensor


def _layer(device, T=21, H=32, I=24, E=6, k=2, dtype=torch.float32, skip_experts=()):
    x = torch.randn(T, H, device=device).to(dtype).requires_grad_(True)
    gate_up = (torch.randn(E, 2 * I, H, device=device) / H**0.5).to(dtype).requires_grad_(True)
    down = (torch.randn(E, H, I, device=device) / I**0.5).to(dtype).requires_grad_(True)
    logits = torch.randn(T, E, device=device)
    logits[:, list(skip_experts)] = -float("inf")
    weights, experts = torch.softmax(logits, -1).topk(k)
    return x, experts, weights.to(dtype).requires_grad_(True), gate_up, down


def _reference_grads(inputs, dout):
    x, experts, weights, gate_up, down = inputs
    leaves = [t.detach().double().requires_grad_(True) for t in (x, weights, gate_up, down)]
    out = moe_experts_reference(leaves[0], experts, *leaves[1:])
    return out, torch.autograd.grad(out, leaves, dout.double())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", [1, 2, 4])
def test_matches_hf_expert_loop_with_idle_experts(device, dtype, k):
    inputs = _layer(device, k=k, dtype=dtype, skip_experts=(1, 4))
    out = moe_experts(*inputs)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, [inputs[i] for i in (0, 2, 3, 4)], dout)
    ref, ref_grads = _reference_grads(inputs, dout)
    assert out.dtype == dtype
    assert_close(out, ref, dtype, "norm")
    for g, r in zip(grads, ref_grads):
        assert_close(g, r, dtype, "norm")
    assert (grads[2][1] == 0).all() and (grads[3][4] == 0).all()  # idle experts: zero, written


@pytest.mark.parametrize("routing", ["all-to-one-expert", "top-k-is-every-expert", "one-token"])
def test_routing_extremes(device, routing):
    T, E, k = {"all-to-one-expert": (17, 6, 1), "top-k-is-every-expert": (11, 5, 5), "one-token": (1, 6, 2)}[routing]
    x, experts, weights, gate_up, down = _layer(device, T=T, E=E, k=k)
    if routing == "all-to-one-expert":
        experts = torch.full_like(experts, 3)
    inputs = (x, experts, weights, gate_up, down)
    out = moe_experts(*inputs)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, [x, weights, gate_up, down], dout)
    ref, ref_grads = _reference_grads(inputs, dout)
    assert_close(out, ref, torch.float32, "norm")
    for g, r in zip(grads, ref_grads):
        assert_close(g, r, torch.float32, "norm")
    if routing == "all-to-one-expert":
        assert (grads[2][[0, 1, 2, 4, 5]] == 0).all() and (grads[3][[0, 1, 2, 4, 5]] == 0).all()


@gpu_only
@pytest.mark.gpu_memory
def test_dispatched_rows_past_two_to_the_31_elements():
    """131072 tokens x top 8 x hidden 2048: the gathered rows, the down product's output and their
    gradients hold 2^31 elements; tokens at both ends (and every expert's weights' gradient) must
    be right."""
    T, H, I, E, k = 2**17, 2048, 32, 8, 8
    x, experts, weights, gate_up, down = _layer("cuda", T=T, H=H, I=I, E=E, k=k, dtype=torch.bfloat16)
    out = moe_experts(x, experts, weights, gate_up, down)
    assert T * k * H >= 2**31
    dx, dgate_up = torch.autograd.grad(out, (x, gate_up), torch.ones_like(out))
    for rows in (slice(0, 4), slice(T - 4, T)):
        # A token's output, and its input's gradient under a gradient of ones, are its own alone.
        x_rows = x[rows].detach().double().requires_grad_(True)
        expected = moe_experts_reference(x_rows, experts[rows], weights[rows].double(), gate_up.double(),
                                         down.double())
        (expected_dx,) = torch.autograd.grad(expected.sum(), x_rows)
        assert_close(out[rows], expected, torch.bfloat16, "norm")
        assert_close(dx[rows], expected_dx, torch.bfloat16, "norm")
    assert torch.isfinite(dgate_up).all() and (dgate_up.flatten(1).abs().amax(1) > 0).all()


def test_int32_experts_and_float32_weights_of_bf16_activations(device):
    """Mixtral keeps its routing weights in float32."""
    x, experts, weights, gate_up, down = _layer(device, dtype=torch.bfloat16)
    weights = weights.detach().float().requires_grad_(True)
    out = moe_experts(x, experts.int(), weights, gate_up, down)
    assert out.dtype == torch.bfloat16
    (dw,) = torch.autograd.grad(out, weights, torch.randn_like(out))
    assert dw.dtype == torch.float32


def test_backward_is_deterministic(device):
    inputs = _layer(device, T=40, k=4)
    dout = torch.randn(40, 32, device=device)
    params = [inputs[i] for i in (0, 2, 3, 4)]
    first = torch.autograd.grad(moe_experts(*inputs), params, dout)
    second = torch.autograd.grad(moe_experts(*inputs), params, dout)
    assert all(torch.equal(a, b) for a, b in zip(first, second))


def test_dispatch_sorts_slots_stably_by_expert(device):
    experts = torch.tensor([[2, 0], [0, 3], [2, 1]], device=device)
    tokens, positions, ends, row_experts = moe_dispatch(experts, 5)
    assert tokens.tolist() == [0, 1, 2, 0, 2, 1]  # expert 0: tokens 0, 1; 1: 2; 2: 0, 2; 3: 1
    assert ends.tolist() == [2, 3, 5, 6, 6] and ends.dtype == torch.int32
    assert positions.tolist() == [[3, 0], [1, 5], [4, 2]]
    assert row_experts.tolist() == [0, 0, 1, 2, 2, 3]


def test_gather_and_combine_alone(device):
    x = torch.randn(5, 7, device=device, requires_grad=True)
    experts = torch.randint(0, 3, (5, 2), device=device)
    tokens, positions, _, _ = moe_dispatch(experts, 3)
    rows = moe_gather(x, tokens, positions)
    assert torch.equal(rows, x[tokens])
    w = torch.rand(5, 2, device=device, requires_grad=True)
    out = moe_combine(rows, positions, w)
    assert_close(out, (x * w.sum(1, keepdim=True)).double(), torch.float32)
    dx, dw = torch.autograd.grad(out, (x, w), torch.ones_like(out))
    assert_close(dx, w.sum(1, keepdim=True).expand(5, 7).double(), torch.float32)
    assert_close(dw, x.sum(1, keepdim=True).expand(5, 2).double(), torch.float32)


def test_no_tokens_and_no_grad(device):
    x, experts, weights, gate_up, down = _layer(device, T=0)
    assert moe_experts(x, experts, weights, gate_up, down).shape == (0, 32)
    inputs = _layer(device)
    with torch.no_grad():
        out = moe_experts(*inputs)
    assert out.grad_fn is None
    assert_close(out, moe_experts_reference(*(t.double() if t.is_floating_point() else t for t in inputs)),
                 torch.float32, "norm")


def test_compiles_without_graph_breaks(device):
    inputs = _layer(device)

    def step(x, experts, weights, gate_up, down):
        return moe_experts(x, experts, weights, gate_up, down).square().sum()

    loss = compile_fullgraph(step)(*inputs)
    params = [inputs[i] for i in (0, 2, 3, 4)]
    grads = torch.autograd.grad(loss, params)
    leaves = [t.detach().double().requires_grad_(True) for t in params]
    ref = moe_experts_reference(leaves[0], inputs[1], *leaves[1:]).square().sum()
    for g, r in zip(grads, torch.autograd.grad(ref, leaves)):
        assert_close(g, r, torch.float32, "norm")


def test_moe_module_is_hfs_qwen3_moe_block(device):
    """tritonformer.nn.MoE loads and gives a state_dict of HF's Qwen3MoeSparseMoeBlock, and its
    output and every gradient match that block's."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    config = transformers.Qwen3MoeConfig(hidden_size=32, moe_intermediate_size=24, num_experts=6,
                                         num_experts_per_tok=2, norm_topk_prob=True)
    config._experts_implementation = "eager"  # HF's loop over experts, the reference
    hf_block = Qwen3MoeSparseMoeBlock(config).to(device)
    ours = tnn.MoE(32, 24, num_experts=6, top_k=2, normalize_top_k=True).to(device)
    assert set(ours.state_dict()) == set(hf_block.state_dict())
    ours.load_state_dict({k: v * 0 + torch.randn_like(v) / 4 for k, v in ours.state_dict().items()})
    hf_block.load_state_dict(ours.state_dict())
    x = torch.randn(2, 7, 32, device=device, requires_grad=True)
    out, logits = ours(x, return_router_logits=True)
    dout = torch.randn_like(out)
    names = sorted(dict(ours.named_parameters()))
    grads = torch.autograd.grad(out, [x] + [ours.get_parameter(n) for n in names], dout)
    x_ref = x.detach().double().requires_grad_(True)
    hf_block.double()
    expected = hf_block(x_ref)
    ref_grads = torch.autograd.grad(expected, [x_ref] + [hf_block.get_parameter(n) for n in names], dout.double())
    assert logits.shape == (14, 6)
    assert_close(out, expected, torch.float32, "norm")
    for g, r in zip(grads, ref_grads):
        assert_close(g, r, torch.float32, "norm")
    with pytest.raises(ValueError, match="top_k"):
        tnn.MoE(32, 24, num_experts=4, top_k=5)
    with pytest.raises(ValueError, match="num_experts"):
        tnn.MoE(32, 24, num_experts=2048, top_k=5)
    with pytest.raises(ValueError, match="hidden_size"):
        ours(torch.randn(3, 16, device=device))


@pytest.mark.parametrize("bad", [-1, 6])
def test_an_expert_index_out_of_range_is_named_on_the_cpu(device, bad):
    if device != "cpu":
        pytest.skip("on the GPU it is a device-side assert, which ends the process's CUDA context")
    x, experts, weights, gate_up, down = _layer(device)
    experts = experts.clone()
    experts[3, 1] = bad
    with pytest.raises(ValueError, match=r"experts holds an index outside \[0, 6\)"):
        moe_experts(x, experts, weights, gate_up, down)


@pytest.mark.parametrize("change,error,match", [
    (lambda a: dict(a, x=a["x"][None]), ValueError, "moe_experts takes"),
    (lambda a: dict(a, experts=a["experts"].float()), TypeError, "int32 or int64"),
    (lambda a: dict(a, weights=a["weights"].int()), TypeError, "float"),
    (lambda a: dict(a, down_proj=a["down_proj"][:, :, :-1]), ValueError, "down_proj"),
    (lambda a: dict(a, down_proj=a["down_proj"].double()), TypeError, "x's dtype"),
    (lambda a: dict(a, weights=a["weights"][:, :1]), ValueError, "moe_experts takes"),
    (lambda a: dict(a, gate_up_proj=foreign_device_tensor()[:1, :1].expand(6, 48, 32)), ValueError, "is on"),
])
def test_bad_input_is_named(device, change, error, match):
    x, experts, weights, gate_up, down = _layer(device)
    args = change(dict(x=x, experts=experts, weights=weights, gate_up_proj=gate_up, down_proj=down))
    with pytest.raises(error, match=match):
        moe_experts(**args)


def _gpt_oss_layer(device, T=21, H=32, I=24, E=6, k=2, skip_experts=()):
    """GPT-OSS experts' inputs, products large enough that both clamps act."""
    x = torch.randn(T, H, device=device)
    gate_up = torch.randn(E, H, 2 * I, device=device) * 3 / H**0.5
    gate_up_bias, down_bias = torch.randn(E, 2 * I, device=device) * 2, torch.randn(E, H, device=device)
    down = torch.randn(E, I, H, device=device) / I**0.5
    logits = torch.randn(T, E, device=device)
    logits[:, list(skip_experts)] = -float("inf")
    weights, experts = torch.softmax(logits, -1).topk(k)
    return [t.requires_grad_(True) for t in (x,)] + [experts] + [
        t.requires_grad_(True) for t in (weights, gate_up, gate_up_bias, down, down_bias)]


def test_gpt_oss_experts_idle_experts_deterministic_and_compiled(device):
    """Experts 1 and 4 get no token: their weights' and biases' gradients are zero; the backward
    is bitwise repeatable; a compiled step gives the reference's gradients."""
    inputs = _gpt_oss_layer(device, skip_experts=(1, 4))
    params = [t for t in inputs if t.is_floating_point()]
    dout = torch.randn(21, 32, device=device)
    first = torch.autograd.grad(gpt_oss_experts(*inputs), params, dout)
    second = torch.autograd.grad(gpt_oss_experts(*inputs), params, dout)
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    for grad in first[2:]:
        assert (grad[[1, 4]] == 0).all()
    leaves = [t.detach().double().requires_grad_(True) for t in params]
    reference = gpt_oss_experts_reference(leaves[0], inputs[1], *leaves[1:])
    for g, r in zip(first, torch.autograd.grad(reference, leaves, dout.double())):
        assert_close(g, r, torch.float32, "norm")

    def step(*args):
        return gpt_oss_experts(*args).square().sum()

    loss = compile_fullgraph(step)(*inputs)
    compiled = torch.autograd.grad(loss, params)
    reference = gpt_oss_experts_reference(leaves[0], inputs[1], *leaves[1:]).square().sum()
    for g, r in zip(compiled, torch.autograd.grad(reference, leaves)):
        assert_close(g, r, torch.float32, "norm")


def test_gpt_oss_experts_take_strided_biases(device):
    """Biases given as transposed views (strides (1, E)) read as their values, not their memory."""
    x, experts, weights, gate_up, gate_up_bias, down, down_bias = _gpt_oss_layer(device)
    strided = [b.detach().t().contiguous().t() for b in (gate_up_bias, down_bias)]
    assert strided[0].stride(0) == 1
    out = gpt_oss_experts(x, experts, weights, gate_up, strided[0], down, strided[1])
    assert_close(out, gpt_oss_experts_reference(*(t.double() if t.is_floating_point() else t for t in (
        x, experts, weights, gate_up, gate_up_bias, down, down_bias))), torch.float32, "norm")


@pytest.mark.parametrize("name,change,match", [
    ("gate_up_proj", lambda t: t[:, :, :-1], "gpt_oss_experts takes"),
    ("gate_up_bias", lambda t: t[:, :-2], "gate_up_bias"),
    ("down_proj", lambda t: t.transpose(1, 2), "down_proj"),
    ("down_bias", lambda t: t[:1], "down_bias"),
])
def test_gpt_oss_experts_bad_shapes_are_named(device, name, change, match):
    x, experts, weights, *params = _gpt_oss_layer(device)
    args = dict(zip(("gate_up_proj", "gate_up_bias", "down_proj", "down_bias"), params))
    args[name] = change(args[name])
    with pytest.raises(ValueError, match=match):
        gpt_oss_experts(x, experts, weights, **args)
