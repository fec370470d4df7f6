import pytest
import torch

import tritonformer as tf
from tritonformer.ops.add import collapse_dims
from tritonformer.testing import assert_close

from helpers import compile_fullgraph, foreign_device_tensor


def test_python_scalar_follows_torch_promotion(device):
    x = torch.randn(17, device=device).to(torch.bfloat16)
    out = tf.add(x, 2.5)
    assert out.dtype == torch.bfloat16
    assert_close(out, x.double() + 2.5, torch.bfloat16)
    assert tf.add(torch.arange(5, dtype=torch.int32, device=device), 3).tolist() == [3, 4, 5, 6, 7]
    # An int past int32's range wraps, as in torch; a float with an int tensor gives float32.
    assert tf.add(torch.tensor([5], dtype=torch.int32, device=device), 2**31).tolist() == [-2**31 + 5]
    halves = tf.add(torch.arange(3, dtype=torch.int32, device=device), 0.5)
    assert halves.dtype == torch.float32 and halves.tolist() == [0.5, 1.5, 2.5]


def test_broadcast_gradient_is_reduced(device):
    x = torch.randn(4, 1, 6, device=device, requires_grad=True)
    y = torch.randn(5, 1, device=device, requires_grad=True)
    tf.add(x, y).sum().backward()
    assert torch.equal(x.grad, torch.full_like(x, 5.0))
    assert torch.equal(y.grad, torch.full_like(y, 24.0))


def test_collapse_dims_merges_contiguous_runs():
    assert collapse_dims((2, 3, 4), (12, 4, 1), (0, 4, 1)) == ([2, 12], [[12, 1], [0, 1]])
    assert collapse_dims((1, 5, 1), (5, 1, 1)) == ([5], [[1]])


def test_compiles_without_graph_break(device):
    x, y = torch.randn(8, 3, device=device), torch.randn(3, device=device)
    assert_close(compile_fullgraph(lambda a, b: tf.add(a, b) * 2)(x, y), (x.double() + y.double()) * 2, torch.float32)
    # A Python number too (torch.result_type, which add called for it, does not trace).
    assert_close(compile_fullgraph(lambda a: tf.add(a, 2.5))(x), x.double() + 2.5, torch.float32)


@pytest.mark.parametrize(
    "x,y,error,match",
    [
        (torch.randn(3, dtype=torch.float64), torch.randn(3), TypeError, "x has dtype torch.float64"),
        (torch.randn(3), torch.randint(0, 3, (3,), dtype=torch.int64), TypeError, "y has dtype torch.int64"),
        (torch.randn(3), torch.randn(4), ValueError, "do not broadcast"),
        (torch.randn(3), "2", TypeError, "y must be a torch.Tensor"),
        ([1.0], torch.randn(3), TypeError, "x must be a torch.Tensor"),
    ],
)
def test_bad_input_is_named(x, y, error, match, device):
    move = lambda t: t.to(device) if isinstance(t, torch.Tensor) else t
    with pytest.raises(error, match=match):
        tf.add(move(x), move(y))


def test_foreign_device_is_named():
    with pytest.raises(ValueError, match="x is on meta"):
        tf.add(foreign_device_tensor(), foreign_device_tensor())


@pytest.mark.parametrize(
    "x,y",
    [
        (torch.ones(3, dtype=torch.float16), torch.tensor(2.0)),
        (torch.ones(3, dtype=torch.int32), torch.tensor(2.0, dtype=torch.bfloat16)),
        (torch.tensor(1, dtype=torch.int32), torch.ones(3, dtype=torch.float16)),
        (torch.ones(3, dtype=torch.float16), torch.ones(3, dtype=torch.bfloat16)),
    ],
)
def test_result_dtype_follows_torch(x, y):
    from tritonformer.ops.add import result_dtype

    assert result_dtype(x, y) == torch.result_type(x, y)


@pytest.mark.parametrize("layout", ["same", "broadcast", "transposed"])
def test_replayed_launches_see_each_calls_data(layout, device):
    """A layout's first call plans its launch, later ones replay it on their own tensors: fresh
    data each call, each sum checked, one plan kept."""
    from tritonformer.ops import add as add_op

    for _ in range(3):
        x = torch.randn(33, 65, device=device).to(torch.bfloat16)
        y = {"same": lambda: torch.randn(33, 65, device=device), "broadcast": lambda: torch.randn(65, device=device),
             "transposed": lambda: torch.randn(65, 33, device=device).t()}[layout]().to(torch.bfloat16)
        assert_close(tf.add(x, y), x.double() + y.double(), torch.bfloat16)
    assert len(add_op.add_fwd.plans) == 1
