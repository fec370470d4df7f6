import pytest
import torch

import tritonformer as tf
from tritonformer import nn
from tritonformer.ops import softmax as softmax_op
from tritonformer.testing import assert_close

from helpers import compile_fullgraph, foreign_device_tensor


@pytest.mark.parametrize("dim", [0, 1, 2, -1])
def test_every_dim_of_a_permuted_tensor(dim, device):
    x = torch.randn(6, 5, 7, device=device).permute(2, 0, 1)
    assert_close(tf.softmax(x, dim), torch.softmax(x.double(), dim), torch.float32)


@pytest.mark.parametrize("shape,dim", [((3, 0, 4), 1), ((0, 3), 0), ((2, 3, 0), -1), ((0, 5), 1)])
def test_zero_size(shape, dim, device):
    x = torch.randn(shape, device=device, requires_grad=True)
    y = tf.softmax(x, dim)
    assert y.shape == x.shape
    y.sum().backward()
    assert x.grad.shape == x.shape


def test_looped_kernel_on_rows_longer_than_a_block(device, monkeypatch):
    # Force the online (looped) path on a small row so that the interpreter stays quick.
    monkeypatch.setattr(softmax_op, "FUSED_MAX_N", 64)
    monkeypatch.setattr(softmax_op, "LOOP_CHUNK", 32)
    x = (torch.randn(3, 200, device=device) * 30).requires_grad_(True)
    y = tf.softmax(x)
    assert_close(y, torch.softmax(x.double(), -1), torch.float32)
    dy = torch.randn_like(y)
    (dx,) = torch.autograd.grad(y, x, dy)
    yd = torch.softmax(x.double(), -1)
    assert_close(dx, yd * (dy.double() - (yd * dy.double()).sum(-1, keepdim=True)), torch.float32)


@pytest.mark.parametrize("cols,dim", [(100, -1), (64, -1), (90, 0)])
def test_backward_in_halves(cols, dim, device, monkeypatch):
    # The backward that keeps y and reads dy's first half twice, forced on short rows: a second
    # half partly masked (100 of 128), exactly full (64), and dy read through a stride (dim 0).
    monkeypatch.setattr(softmax_op, "BWD_HALVES_MIN_N", 64)
    shape = (cols, 5) if dim == 0 else (5, cols)
    x = (torch.randn(shape, device=device) * 3).requires_grad_(True)
    y = tf.softmax(x, dim)
    dy = torch.randn_like(y)
    (dx,) = torch.autograd.grad(y, x, dy)
    yd = torch.softmax(x.double(), dim)
    assert_close(dx, yd * (dy.double() - (yd * dy.double()).sum(dim, keepdim=True)), torch.float32)


def test_masked_rows_with_minus_inf(device):
    x = torch.randn(4, 33, device=device)
    x[:, 10:] = float("-inf")
    assert_close(tf.softmax(x), torch.softmax(x.double(), -1), torch.float32)


def test_module_is_a_torch_softmax(device):
    module = nn.Softmax(dim=1)
    assert isinstance(module, torch.nn.Softmax)
    x = torch.randn(3, 9, device=device)
    assert_close(module(x), torch.softmax(x.double(), 1), torch.float32)


def test_compiles_forward_and_backward_without_graph_break(device):
    x = torch.randn(5, 40, device=device, requires_grad=True)
    y = compile_fullgraph(lambda t: tf.softmax(t * 2, -1))(x)
    dy = torch.randn_like(y)
    (dx,) = torch.autograd.grad(y, x, dy)
    xd = x.detach().double().requires_grad_(True)
    yd = torch.softmax(xd * 2, -1)
    (dxd,) = torch.autograd.grad(yd, xd, dy.double())
    assert_close(y, yd, torch.float32)
    assert_close(dx, dxd, torch.float32)


@pytest.mark.parametrize(
    "make,kwargs,error,match",
    [
        (lambda d: torch.randn(3, 4, device=d, dtype=torch.float64), {}, TypeError, "x has dtype torch.float64"),
        (lambda d: torch.ones(3, 4, device=d, dtype=torch.int32), {}, TypeError, "x has dtype torch.int32"),
        (lambda d: torch.tensor(1.0, device=d), {}, ValueError, "at least 1 dimension"),
        (lambda d: torch.randn(3, 4, device=d), {"dim": 2}, ValueError, "dim must be an int in"),
        (lambda d: torch.randn(3, 4, device=d), {"dim": 1.0}, ValueError, "dim must be an int in"),
        (lambda d: foreign_device_tensor(), {}, ValueError, "x is on meta"),
    ],
)
def test_bad_input_is_named(make, kwargs, error, match, device):
    with pytest.raises(error, match=match):
        tf.softmax(make(device), **kwargs)


@pytest.mark.parametrize("dim", [-1, 0])
def test_replayed_launches_see_each_calls_data(dim, device):
    """A layout's first call plans its launches, later ones replay them on their own tensors:
    fresh data each call, output and gradient against float64, one plan each way."""
    for _ in range(3):
        x = torch.randn(37, 70, device=device).to(torch.bfloat16).requires_grad_(True)
        dy = torch.randn(37, 70, device=device).to(torch.bfloat16)
        y = tf.softmax(x, dim)
        x64 = x.detach().double().requires_grad_(True)
        y64 = torch.softmax(x64, dim)
        assert_close(y, y64, torch.bfloat16)
        (dx,), (dx64,) = torch.autograd.grad(y, x, dy), torch.autograd.grad(y64, x64, dy.double())
        assert_close(dx, dx64, torch.bfloat16, "norm")
    assert len(softmax_op.softmax_fwd.plans) == 1 and len(softmax_op.softmax_bwd.plans) == 1
