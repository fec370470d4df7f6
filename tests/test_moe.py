"""moe_route beyond the registry's cases: the chosen experts themselves, ties, shapes, the
no-gradient path, torch.compile, replays and bad input."""

import pytest
import torch

import tritonformer
from tritonformer import runtime
from tritonformer.ops.moe import moe_route, moe_route_reference
from tritonformer.testing import assert_close


def _distinct_logits(T, E, device, dtype=torch.float32):
    return (torch.rand(T, E, device=device).argsort(-1).float() * (8 / E) - 4).to(dtype)


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid", "topk_softmax"])
@pytest.mark.parametrize("normalize", [False, True])
def test_chosen_experts_are_torch_topks(device, scoring, normalize):
    z = _distinct_logits(29, 60, device)
    bias = torch.randn(60, device=device) * 0.2 if scoring == "sigmoid" else None
    w, idx = moe_route(z, 6, normalize, scoring, bias)
    ref_w, ref_idx = moe_route_reference(z.double(), 6, normalize, scoring, bias)
    assert idx.dtype == torch.int64 and torch.equal(idx, ref_idx)  # int64: what HF's expert modules take
    assert_close(w, ref_w, torch.float32)
    if normalize or scoring == "topk_softmax":
        assert_close(w.sum(-1), torch.ones(29, dtype=torch.float64, device=device), torch.float32)


def test_topk_softmax_is_gpt_oss_router(device):
    """GPT-OSS's router: torch.topk of the raw logits, a softmax over the k in their dtype; the
    gradient reaches the chosen logits only."""
    z = _distinct_logits(23, 32, device, torch.bfloat16).requires_grad_(True)
    w, idx = moe_route(z, 4, scoring="topk_softmax")
    values, hf_idx = torch.topk(z, 4, dim=-1)
    hf_w = torch.softmax(values, dim=1, dtype=values.dtype)
    assert torch.equal(idx, hf_idx) and w.dtype == torch.bfloat16
    assert_close(w, hf_w.double(), torch.bfloat16)
    dw = torch.randn_like(w)
    (dz,) = torch.autograd.grad(w, z, dw)
    (hf_dz,) = torch.autograd.grad(hf_w, z, dw)
    assert_close(dz, hf_dz.double(), torch.bfloat16, compare="norm")
    unchosen = torch.ones_like(z, dtype=torch.bool).scatter(1, idx, False)
    assert (dz[unchosen] == 0).all()


def test_selection_bias_moves_the_choice_not_the_weights(device):
    z = _distinct_logits(4, 8, device)
    bias = torch.zeros(8, device=device)
    bias[7] = 10.0  # expert 7 always chosen, weighted by its own probability
    w, idx = moe_route(z, 2, scoring="sigmoid", selection_bias=bias)
    assert (idx[:, 0] == 7).all()
    assert_close(w[:, 0], torch.sigmoid(z[:, 7].double()), torch.float32)


def test_switched_off_and_nan_scores_never_repeat_an_expert(device):
    """A -inf bias (an expert switched off) still leaves top_k distinct experts; a NaN score
    ranks first, as in torch.topk."""
    z = _distinct_logits(3, 8, device)
    bias = torch.full((8,), float("-inf"), device=device)
    bias[2] = 0.0
    _, idx = moe_route(z, 3, scoring="sigmoid", selection_bias=bias)
    assert (idx[:, 0] == 2).all() and all(len(set(row)) == 3 for row in idx.tolist())
    z[1, 6] = float("nan")
    _, idx = moe_route(z, 3)
    assert idx[1, 0] == 6 and len(set(idx[1].tolist())) == 3 and (idx < 8).all()


def test_mixtral_keeps_float32_weights(device):
    z = _distinct_logits(5, 8, device, torch.bfloat16)
    w, idx = moe_route(z, 2, normalize=True, weights_dtype=torch.float32)
    ref_w, ref_idx = moe_route_reference(z.double(), 2, True)
    assert w.dtype == torch.float32 and torch.equal(idx, ref_idx)
    assert_close(w, ref_w, torch.float32)


def test_ties_pick_the_lower_expert(device):
    z = torch.zeros(3, 8, device=device)
    z[:, 5] = 1.0
    _, idx = moe_route(z, 3)
    assert idx.tolist() == [[5, 0, 1]] * 3


def test_leading_dims_flatten_and_gradients_reach_a_transposed_input(device):
    base = _distinct_logits(2 * 7, 16, device).reshape(7, 2, 16).requires_grad_()
    w, idx = moe_route(base.transpose(0, 1), 4, normalize=True)
    assert w.shape == (14, 4) and idx.shape == (14, 4)
    g = torch.randn_like(w)
    (w * g).sum().backward()
    ref = base.detach().double().requires_grad_()
    ref_w, _ = moe_route_reference(ref.transpose(0, 1), 4, normalize=True)
    (ref_w * g.double()).sum().backward()
    assert_close(base.grad, ref.grad, torch.float32)
    assert idx.requires_grad is False


def test_without_gradient_and_empty(device):
    z = _distinct_logits(5, 10, device)
    with torch.no_grad():
        w, idx = moe_route(z.requires_grad_(), 2)
    assert not w.requires_grad
    w, idx = moe_route(torch.empty(0, 10, device=device, requires_grad=True), 2, index_dtype=torch.int32)
    assert w.shape == (0, 2) and idx.shape == (0, 2) and idx.dtype == torch.int32 and w.requires_grad


def _grad_of_logits(route, z, dw, **kwargs):
    z = z.detach().requires_grad_()
    w, _ = route(z, dw.shape[1], **kwargs)
    (w * dw).sum().backward()
    return z.grad


def test_replayed_launches_see_each_calls_data(device):
    runtime.clear_plans()
    for _ in range(3):
        z = _distinct_logits(9, 12, device)
        dw = torch.randn(9, 3, device=device)
        w, idx = moe_route(z, 3, True)
        ref_w, ref_idx = moe_route_reference(z.double(), 3, True)
        assert torch.equal(idx, ref_idx)
        assert_close(w, ref_w, torch.float32)
        assert_close(_grad_of_logits(moe_route, z, dw, normalize=True),
                     _grad_of_logits(moe_route_reference, z.double(), dw.double(), normalize=True), torch.float32)


def test_is_exported_and_compiles_without_graph_breaks(device):
    assert tritonformer.moe_route is moe_route
    z = _distinct_logits(9, 12, device).requires_grad_()
    compiled = torch.compile(lambda x: moe_route(x, 3, True), fullgraph=True, backend="aot_eager")
    w, idx = compiled(z)
    ref_w, ref_idx = moe_route_reference(z.detach().double(), 3, True)
    assert torch.equal(idx, ref_idx)
    assert_close(w, ref_w, torch.float32)
    dw = torch.randn(9, 3, device=device)
    (w * dw).sum().backward()
    assert_close(z.grad, _grad_of_logits(moe_route_reference, z.detach().double(), dw.double(), normalize=True),
                 torch.float32)


@pytest.mark.parametrize("call, error, match", [
    (lambda d: moe_route(torch.randn(4, 8, device=d), 9), ValueError, "top_k must be"),
    (lambda d: moe_route(torch.randn(4, 8, device=d), 0), ValueError, "top_k must be"),
    (lambda d: moe_route(torch.randn(4, 8, device=d), True), ValueError, "top_k must be"),
    (lambda d: moe_route(torch.randn(4, 8, device=d), 2, index_dtype=torch.int16), TypeError, "index_dtype"),
    (lambda d: moe_route(torch.randn(4, 8, device=d), 2, weights_dtype=torch.int32), TypeError, "weights_dtype"),
    (lambda d: moe_route(torch.randn(4, 8, device=d), 2, scoring="relu"), ValueError, "scoring"),
    (lambda d: moe_route(torch.randn(4, 8, device=d).double(), 2), TypeError, "router_logits has dtype"),
    (lambda d: moe_route(torch.randn(4, 2000, device=d), 2), ValueError, "2000 experts"),
    (lambda d: moe_route(torch.randn(4, 8, device=d), 2, selection_bias=torch.zeros(7, device=d)), ValueError,
     r"selection_bias must have shape \(8,\)"),
])
def test_bad_input_is_named(device, call, error, match):
    with pytest.raises(error, match=match):
        call(device)
