import pytest
import torch

import tritonformer
from tritonformer import nn as tnn
from tritonformer.ops import swiglu as swiglu_op
from tritonformer.testing import assert_close

from helpers import compile_fullgraph, foreign_device_tensor


def test_bad_input(device):
    g = torch.randn(4, 8, device=device)
    with pytest.raises(ValueError, match="up"):
        tritonformer.swiglu(g, torch.randn(4, 9, device=device))
    with pytest.raises(TypeError, match="up"):
        tritonformer.swiglu(g, g.half())
    with pytest.raises(TypeError, match="gate"):
        tritonformer.swiglu(g.int(), g.int())
    with pytest.raises(ValueError, match="gate"):
        tritonformer.swiglu(foreign_device_tensor(), g)


def test_mlp_bad_input(device):
    x = torch.randn(3, 16, device=device)
    w = torch.randn(32, 16, device=device)
    with pytest.raises(ValueError, match="w_down"):
        tritonformer.swiglu_mlp(x, w, w, w)
    with pytest.raises(TypeError, match="w_up"):
        tritonformer.swiglu_mlp(x, w, w.half(), w.t())


def test_compiles_without_graph_breaks(device):
    g = torch.randn(6, 40, device=device, requires_grad=True)
    u = torch.randn(6, 40, device=device, requires_grad=True)

    def loss(g, u):
        return tritonformer.swiglu(g, u).square().sum()

    expected = torch.autograd.grad(loss(g, u), (g, u))
    got = torch.autograd.grad(compile_fullgraph(loss)(g, u), (g, u))
    for a, e in zip(got, expected):
        assert_close(a, e.double(), torch.float32, "norm")


def test_mlp_module_is_a_llama_mlp(device):
    mlp = tnn.SwiGLUMLP(24, 56).to(device)
    assert set(mlp.state_dict()) == {"gate_proj.weight", "up_proj.weight", "down_proj.weight"}
    x = torch.randn(2, 3, 24, device=device, requires_grad=True)
    out = mlp(x)
    params = [x, *mlp.parameters()]
    grads = torch.autograd.grad(out.square().sum(), params)
    leaves = [p.detach().double().requires_grad_(True) for p in params]
    expected = swiglu_op.swiglu_mlp_reference(leaves[0], *leaves[1:])
    ref_grads = torch.autograd.grad(expected.square().sum(), leaves)
    assert_close(out, expected, torch.float32, "norm")
    for g, r in zip(grads, ref_grads):
        assert_close(g, r, torch.float32, "norm")


def test_mlp_saves_only_x_gate_and_up(device):
    tokens, hidden, inter = 64, 16, 48
    mlp = tnn.SwiGLUMLP(hidden, inter).to(device)
    x = torch.randn(tokens, hidden, device=device, requires_grad=True)
    weights = {p.data_ptr() for p in mlp.parameters()}
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        mlp(x)
    activations = [t for t in saved if t.data_ptr() not in weights]
    assert sum(t.numel() for t in activations) == tokens * (hidden + 2 * inter)


def test_mlp_backward_is_right_in_eager_and_compiled(device):
    x = torch.randn(5, 16, device=device, requires_grad=True)
    ws = [torch.randn(o, i, device=device, requires_grad=True) for o, i in ((40, 16), (40, 16), (16, 40))]

    def loss(x, *ws):
        return tritonformer.swiglu_mlp(x, *ws).square().sum()

    expected = torch.autograd.grad(loss(x, *ws), (x, *ws))
    got = torch.autograd.grad(compile_fullgraph(loss)(x, *ws), (x, *ws))
    for a, e in zip(got, expected):
        assert_close(a, e.double(), torch.float32, "norm")


def test_replayed_launches_see_each_calls_data(device):
    """A signature's first call plans its launches and later calls replay them on their own
    tensors: fresh data each call, forward and gradients against float64, the replays taken; a
    transposed gate (its rows copied) plans nothing and is still right."""
    M, N, dtype = 37, 101, torch.bfloat16
    for transposed in (False, False, False, True):
        g = (torch.randn(N, M, device=device).t() if transposed else torch.randn(M, N, device=device)) * 3
        g = g.to(dtype).requires_grad_(True)
        u = torch.randn(M, N, device=device).to(dtype).requires_grad_(True)
        dh = torch.randn(M, N, device=device).to(dtype)
        h = tritonformer.swiglu(g, u)
        leaves = [t.detach().double().requires_grad_(True) for t in (g, u)]
        expected = swiglu_op.swiglu_reference(*leaves)
        assert_close(h, expected, dtype, "norm")
        for got, want in zip(torch.autograd.grad(h, (g, u), dh), torch.autograd.grad(expected, leaves, dh.double())):
            assert_close(got, want, dtype, "norm")
    assert len(swiglu_op.swiglu_fwd.plans) == 1 and len(swiglu_op.swiglu_bwd.plans) == 1
