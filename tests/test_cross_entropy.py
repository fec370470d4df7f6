import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import tritonformer as tf
from tritonformer import nn
from tritonformer.cases.cross_entropy import random_targets
from tritonformer.ops import cross_entropy as ce
from tritonformer.testing import assert_close, rel_err

from conftest import ON_GPU, gpu_only
from helpers import compile_fullgraph, foreign_device_tensor


def _targets(n, V, device, ignored=0.0):
    return random_targets((n,), V, device, ignored)


def _leaves(*tensors, dtype=None):
    return [t.detach().to(dtype or t.dtype).requires_grad_(True) for t in tensors]


def _flce_inputs(T, H, V, device, dtype=torch.float32, ignored=0.25):
    hidden = torch.randn(T, H, device=device).to(dtype).requires_grad_(True)
    weight = (torch.randn(V, H, device=device) / H**0.5).to(dtype).requires_grad_(True)
    bias = (torch.randn(V, device=device) * 0.1).to(dtype).requires_grad_(True)
    return hidden, weight, bias, _targets(T, V, device, ignored)


# ---------------------------------------------------------------------------------------------
# cross_entropy


def test_inplace_backward_writes_into_the_logits_only_when_asked(device):
    x = torch.randn(9, 300, device=device, requires_grad=True)
    t = _targets(9, 300, device, 0.3)
    before = x.detach().clone()
    (grad,) = torch.autograd.grad(tf.cross_entropy(x, t, label_smoothing=0.1), x)
    assert torch.equal(x.detach(), before)
    assert grad.data_ptr() != x.data_ptr()

    (grad_inplace,) = torch.autograd.grad(tf.cross_entropy(x, t, label_smoothing=0.1, inplace_backward=True), x)
    assert grad_inplace.data_ptr() == x.data_ptr()
    assert torch.equal(grad_inplace, grad)
    assert torch.equal(x.detach(), grad)


def test_inplace_backward_through_the_layer_that_made_the_logits(device):
    h = torch.randn(6, 16, device=device, requires_grad=True)
    w = torch.randn(100, 16, device=device, requires_grad=True)
    t = _targets(6, 100, device, 0.2)
    grads = torch.autograd.grad(tf.cross_entropy(h @ w.t(), t, inplace_backward=True), (h, w))
    hd, wd = _leaves(h, w, dtype=torch.float64)
    expected = torch.autograd.grad(ce.cross_entropy_reference(hd @ wd.t(), t), (hd, wd))
    for g, e in zip(grads, expected):
        assert_close(g, e, torch.float32, "norm")


def test_rows_starting_with_a_chunk_of_minus_inf(device):
    # Masked vocabulary: the running max must survive a first chunk that is all -inf.
    V = 2 * ce.ROW_CHUNK + 37
    x = torch.randn(4, V, device=device)
    x[:, : ce.ROW_CHUNK + 5] = float("-inf")
    t = ce.ROW_CHUNK + 5 + torch.randint(0, V - ce.ROW_CHUNK - 5, (4,), device=device)
    x.requires_grad_(True)
    loss = tf.cross_entropy(x, t, reduction="none")
    xd = x.detach().double().requires_grad_(True)
    expected = ce.cross_entropy_reference(xd, t, reduction="none")
    assert_close(loss, expected, torch.float32)
    dy = torch.randn_like(loss)
    assert_close(torch.autograd.grad(loss, x, dy)[0], torch.autograd.grad(expected, xd, dy.double())[0],
                 torch.float32, "norm")


@pytest.mark.parametrize("V", [300, 2 * ce.ROW_CHUNK + 1952])
def test_label_smoothing_on_rows_of_large_logits(V, device):
    # Smoothing's share is the mean of x - lse: taken as m - mean(x), it cancels near a large max
    # (a row of 1e20s gave 9e11 for log V at V = 300 and 4000). One chunk, and rows over several
    # chunks whose max grows from chunk to chunk; uniform rows of +-1e20, logits shifted by 1e4.
    x = torch.randn(5, V, device=device)
    x[0] = 1e20
    x[1] = -1e20
    x[2] += 1e4
    x[3] = x[3] * 3 + torch.linspace(0, 60, V, device=device)
    t = torch.randint(0, V, (5,), device=device)
    loss = tf.cross_entropy(x, t, label_smoothing=0.1, reduction="none")
    expected = ce.cross_entropy_reference(x.double(), t, reduction="none", label_smoothing=0.1)
    assert_close(loss, expected, torch.float32)


def test_none_reduction_with_a_broadcast_upstream_gradient(device):
    # loss.sum().backward() hands the per-row backward an expanded (stride 0) gradient.
    x = torch.randn(8, 70, device=device, requires_grad=True)
    t = _targets(8, 70, device, 0.3)
    (g_none,) = torch.autograd.grad(tf.cross_entropy(x, t, reduction="none").sum(), x)
    (g_sum,) = torch.autograd.grad(tf.cross_entropy(x, t, reduction="sum"), x)
    assert_close(g_none, g_sum.double(), torch.float32)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_compiles_forward_and_backward_without_graph_break(reduction, device):
    x = torch.randn(7, 90, device=device, requires_grad=True)
    t = _targets(7, 90, device, 0.3)
    kwargs = dict(reduction=reduction, label_smoothing=0.1, z_loss=1e-3)
    loss = compile_fullgraph(lambda a, b: tf.cross_entropy(a * 2, b, **kwargs))(x, t)
    dy = torch.randn_like(loss)
    (grad,) = torch.autograd.grad(loss, x, dy)
    (xd,) = _leaves(x, dtype=torch.float64)
    expected = ce.cross_entropy_reference(xd * 2, t, **kwargs)
    assert_close(loss, expected, torch.float32)
    assert_close(grad, torch.autograd.grad(expected, xd, dy.double())[0], torch.float32, "norm")


def test_compiles_with_inplace_backward(device):
    h = torch.randn(5, 8, device=device, requires_grad=True)
    w = torch.randn(60, 8, device=device)
    t = _targets(5, 60, device)
    loss = compile_fullgraph(lambda a: tf.cross_entropy(a @ w.t(), t, inplace_backward=True))(h)
    (grad,) = torch.autograd.grad(loss, h)
    (hd,) = _leaves(h, dtype=torch.float64)
    expected = torch.autograd.grad(ce.cross_entropy_reference(hd @ w.double().t(), t), hd)[0]
    assert_close(grad, expected, torch.float32, "norm")


def _ce_bad(logits=None, target=None, **kwargs):
    def make(device):
        x = logits(device) if logits else torch.randn(4, 10, device=device)
        y = target(device) if target else torch.zeros(4, dtype=torch.int64, device=device)
        return (x, y), kwargs
    return make


@pytest.mark.parametrize(
    "make,error,match",
    [
        (_ce_bad(logits=lambda d: torch.randn(4, 10, device=d, dtype=torch.float64)), TypeError,
         "logits has dtype torch.float64"),
        (_ce_bad(logits=lambda d: torch.ones(4, 10, device=d, dtype=torch.int32)), TypeError, "logits has dtype"),
        (_ce_bad(logits=lambda d: torch.tensor(1.0, device=d)), ValueError, "at least 1 dimension"),
        (_ce_bad(logits=lambda d: torch.randn(4, 0, device=d)), ValueError, "at least one class"),
        (_ce_bad(logits=lambda d: foreign_device_tensor()), ValueError, "logits is on meta"),
        (_ce_bad(target=lambda d: torch.zeros(4, device=d)), TypeError, "target has dtype torch.float32"),
        (_ce_bad(target=lambda d: torch.zeros(4, dtype=torch.int16, device=d)), TypeError, "target has dtype"),
        (_ce_bad(target=lambda d: torch.zeros(5, dtype=torch.int64, device=d)), ValueError,
         r"target must have shape \(4,\)"),
        (_ce_bad(target=lambda d: torch.zeros(4, 1, dtype=torch.int64, device=d)), ValueError,
         "target must have shape"),
        (_ce_bad(target=lambda d: torch.zeros(4, dtype=torch.int64, device="meta")), ValueError, "target is on meta"),
        (_ce_bad(reduction="avg"), ValueError, "reduction must be one of"),
        (_ce_bad(label_smoothing=1.5), ValueError, "label_smoothing must be"),
        (_ce_bad(label_smoothing=-0.1), ValueError, "label_smoothing must be"),
        (_ce_bad(z_loss=-1e-4), ValueError, "z_loss must be"),
        (_ce_bad(z_loss=float("nan")), ValueError, "z_loss must be"),
        (_ce_bad(softcap=0.0), ValueError, "softcap must be None or a positive finite float"),
        (_ce_bad(ignore_index=1.5), TypeError, "ignore_index must be an int"),
        (_ce_bad(inplace_backward="yes"), TypeError, "inplace_backward must be a bool"),
    ],
)
def test_bad_input_is_named(make, error, match, device):
    args, kwargs = make(device)
    with pytest.raises(error, match=match):
        tf.cross_entropy(*args, **kwargs)


def test_cross_entropy_module_is_a_torch_module_with_classes_on_dim_1(device):
    module = nn.CrossEntropyLoss(ignore_index=2, label_smoothing=0.1)
    assert isinstance(module, torch.nn.CrossEntropyLoss)
    x = torch.randn(3, 7, 5, device=device)  # (N, C, d)
    t = torch.randint(0, 7, (3, 5), device=device)
    expected = F.cross_entropy(x.double(), t, ignore_index=2, label_smoothing=0.1)
    assert_close(module(x, t), expected, torch.float32)
    assert_close(module(x[:, :, 0], t[:, 0]), F.cross_entropy(x[:, :, 0].double(), t[:, 0], ignore_index=2,
                                                              label_smoothing=0.1), torch.float32)
    with pytest.raises(ValueError, match="class weights"):
        nn.CrossEntropyLoss(weight=torch.ones(7))


# ---------------------------------------------------------------------------------------------
# fused_linear_cross_entropy


def test_chunk_size_keeps_a_chunk_of_logits_within_the_budget(monkeypatch):
    monkeypatch.setattr(ce, "FLCE_CHUNK_BYTES", 2**28)
    assert ce._flce_chunk_rows(8192, 128256, 2) == 1024
    assert ce._flce_chunk_rows(8192, 32000, 2) == 4096
    assert ce._flce_chunk_rows(100, 32000, 2) == 100
    assert ce._flce_chunk_rows(8192, 2**28, 4) == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_equals_unfused_cross_entropy(dtype, device, monkeypatch):
    monkeypatch.setattr(ce, "FLCE_CHUNK_BYTES", 7 * 300 * dtype.itemsize)  # 7 rows a chunk: 4 chunks
    hidden, weight, bias, t = _flce_inputs(26, 24, 300, device, dtype)
    kwargs = dict(label_smoothing=0.05, z_loss=1e-3)
    fused = tf.fused_linear_cross_entropy(hidden, weight, t, bias, **kwargs)
    grads = torch.autograd.grad(fused, (hidden, weight, bias))
    h2, w2, b2 = _leaves(hidden, weight, bias)
    unfused = tf.cross_entropy(F.linear(h2, w2, b2), t, **kwargs)
    expected = torch.autograd.grad(unfused, (h2, w2, b2))
    tol = {torch.float32: 2e-6, torch.bfloat16: 1e-2}[dtype]
    assert rel_err(fused, unfused) <= tol
    for g, e in zip(grads, expected):
        assert rel_err(g, e) <= tol


@pytest.mark.parametrize("fused", [True, False])
def test_second_backward_through_a_retained_graph_is_refused(fused, device):
    # The fused loss scales the gradients it saved, cross_entropy(inplace_backward=True) writes
    # into the saved logits: both in place, so a second backward through the graph must raise
    # rather than rescale them (it gave 2x and 1.5x the gradients of hidden and weight).
    hidden, weight, _, target = _flce_inputs(6, 8, 20, device, ignored=0.0)
    if fused:
        loss = tf.fused_linear_cross_entropy(hidden, weight, target) * 2.0
    else:
        loss = tf.cross_entropy(hidden @ weight.t(), target, inplace_backward=True) * 2.0
    grads = torch.autograd.grad(loss, (hidden, weight), retain_graph=True)
    hd, wd = _leaves(hidden, weight, dtype=torch.float64)
    expected = torch.autograd.grad(ce.cross_entropy_reference(hd @ wd.t(), target) * 2.0, (hd, wd))
    for g, e in zip(grads, expected):
        assert_close(g, e, torch.float32, "norm")
    with pytest.raises(RuntimeError, match="a second backward through the same graph"):
        torch.autograd.grad(loss, (hidden, weight))


def test_num_items_in_batch_splits_a_batch_like_gradient_accumulation(device):
    hidden, weight, bias, t = _flce_inputs(24, 16, 120, device)
    total = int((t != -100).sum())
    full = tf.fused_linear_cross_entropy(hidden, weight, t, bias, reduction="sum") / total
    expected = torch.autograd.grad(full, (hidden, weight, bias))
    halves = 0.0
    for i, num_items in enumerate((total, torch.tensor(total, device=device))):
        rows = slice(12 * i, 12 * i + 12)
        loss = tf.fused_linear_cross_entropy(hidden[rows], weight, t[rows], bias, num_items_in_batch=num_items)
        loss.backward()
        halves = halves + loss
    assert_close(halves, full.double(), torch.float32)
    for param, e in zip((hidden, weight, bias), expected):
        assert_close(param.grad, e.double(), torch.float32)


def test_none_reduction_recomputes_with_a_broadcast_upstream_gradient(device):
    hidden, weight, bias, t = _flce_inputs(20, 16, 90, device)
    loss_none = tf.fused_linear_cross_entropy(hidden, weight, t, bias, reduction="none")
    g_none = torch.autograd.grad(loss_none.sum(), (hidden, weight, bias))
    g_sum = torch.autograd.grad(tf.fused_linear_cross_entropy(hidden, weight, t, bias, reduction="sum"),
                                (hidden, weight, bias))
    for a, b in zip(g_none, g_sum):
        assert_close(a, b.double(), torch.float32)


def test_only_the_gradients_asked_for(device):
    hidden, weight, _, t = _flce_inputs(9, 8, 50, device)
    weight.requires_grad_(False)
    loss = tf.fused_linear_cross_entropy(hidden, weight, t)
    (grad,) = torch.autograd.grad(loss, hidden)
    hd, wd = _leaves(hidden, weight, dtype=torch.float64)
    expected = torch.autograd.grad(ce.fused_linear_cross_entropy_reference(hd, wd, t), hd)[0]
    assert_close(grad, expected, torch.float32)


def test_empty_batch(device):
    hidden, weight, bias, t = _flce_inputs(0, 8, 50, device)
    loss = tf.fused_linear_cross_entropy(hidden, weight, t, bias)
    assert loss.isnan()
    dh, dw, db = torch.autograd.grad(loss, (hidden, weight, bias))
    assert dh.shape == (0, 8) and (dw == 0).all() and (db == 0).all()


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_fused_compiles_forward_and_backward_without_graph_break(reduction, device):
    hidden, weight, bias, t = _flce_inputs(11, 8, 40, device)
    kwargs = dict(reduction=reduction, label_smoothing=0.1)
    fn = compile_fullgraph(lambda h, w, b: tf.fused_linear_cross_entropy(h * 2, w, t, b, **kwargs))
    loss = fn(hidden, weight, bias)
    dy = torch.randn_like(loss)
    grads = torch.autograd.grad(loss, (hidden, weight, bias), dy)
    hd, wd, bd = _leaves(hidden, weight, bias, dtype=torch.float64)
    expected = ce.fused_linear_cross_entropy_reference(hd * 2, wd, t, bd, **kwargs)
    assert_close(loss, expected, torch.float32)
    for g, e in zip(grads, torch.autograd.grad(expected, (hd, wd, bd), dy.double())):
        assert_close(g, e, torch.float32, "norm")


def test_fused_module(device):
    hidden, weight, bias, t = _flce_inputs(10, 8, 40, device)
    module = nn.FusedLinearCrossEntropyLoss(label_smoothing=0.1)
    expected = ce.fused_linear_cross_entropy_reference(hidden.double(), weight.double(), t, bias.double(),
                                                       label_smoothing=0.1)
    assert_close(module(hidden, weight, t, bias), expected, torch.float32)


def _flce_bad(hidden=None, weight=None, target=None, **kwargs):
    """Valid inputs but those given; a callable argument is called with the device."""
    def make(device):
        h = hidden(device) if hidden else torch.randn(4, 8, device=device)
        w = weight(device) if weight else torch.randn(10, 8, device=device)
        y = target(device) if target else torch.zeros(4, dtype=torch.int64, device=device)
        return (h, w, y), {k: v(device) if callable(v) else v for k, v in kwargs.items()}
    return make


@pytest.mark.parametrize(
    "make,error,match",
    [
        (_flce_bad(weight=lambda d: torch.randn(10, 8, device=d, dtype=torch.bfloat16)), TypeError,
         "weight has dtype torch.bfloat16 but hidden has torch.float32"),
        (_flce_bad(weight=lambda d: torch.randn(10, 7, device=d)), ValueError, "hidden.shape"),
        (_flce_bad(weight=lambda d: torch.randn(2, 10, 8, device=d)), ValueError, r"weight must be \(V, H\)"),
        (_flce_bad(weight=lambda d: torch.randn(0, 8, device=d)), ValueError, "at least one row"),
        (_flce_bad(hidden=lambda d: torch.randn(4, 8, device=d, dtype=torch.float64)), TypeError, "hidden has dtype"),
        (_flce_bad(target=lambda d: torch.zeros(3, dtype=torch.int64, device=d)), ValueError, "target must have shape"),
        (_flce_bad(bias=lambda d: torch.zeros(9, device=d)), ValueError, r"bias must have shape \(10,\)"),
        (_flce_bad(bias=lambda d: torch.zeros(10, dtype=torch.float16, device=d)), TypeError, "bias has dtype"),
        (_flce_bad(reduction="none", num_items_in_batch=3), ValueError, "num_items_in_batch applies to"),
        (_flce_bad(num_items_in_batch=-2), ValueError, "num_items_in_batch must be a positive number"),
        (_flce_bad(num_items_in_batch=True), ValueError, "num_items_in_batch must be a positive number"),
        (_flce_bad(num_items_in_batch=torch.ones(2)), ValueError, "num_items_in_batch must hold one number"),
        (_flce_bad(label_smoothing=2.0), ValueError, "label_smoothing must be"),
        (_flce_bad(softcap=-30.0), ValueError, "softcap must be None or a positive finite float"),
    ],
)
def test_fused_bad_input_is_named(make, error, match, device):
    args, kwargs = make(device)
    with pytest.raises(error, match=match):
        tf.fused_linear_cross_entropy(*args, **kwargs)


# ---------------------------------------------------------------------------------------------
# GPU only: no host sync, 64-bit offsets, memory


@gpu_only
def test_no_host_sync_in_forward_or_backward():
    hidden, weight, bias, t = _flce_inputs(64, 32, 1000, "cuda", torch.bfloat16)
    logits = (hidden @ weight.t()).detach().requires_grad_(True)

    def run():
        torch.autograd.grad(tf.cross_entropy(logits, t, label_smoothing=0.1), logits)
        for reduction in ("mean", "none"):
            loss = tf.fused_linear_cross_entropy(hidden, weight, t, bias, reduction=reduction)
            torch.autograd.grad(loss.sum(), (hidden, weight, bias))
        loss = tf.fused_linear_cross_entropy(hidden, weight, t, num_items_in_batch=17)
        torch.autograd.grad(loss, hidden)

    run()  # compiles the kernels
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        run()
    finally:
        torch.cuda.set_sync_debug_mode("default")


@gpu_only
def test_logits_past_two_to_the_31_elements():
    N, V = 16500, 131072  # 2.16e9 elements, 4.3 GB of bfloat16
    logits = torch.empty(N, V, device="cuda", dtype=torch.bfloat16)
    for i in range(0, N, 2048):
        logits[i:i + 2048].normal_()
    logits.requires_grad_(True)
    t = _targets(N, V, "cuda", 0.1)
    loss = tf.cross_entropy(logits, t, reduction="none")
    (grad,) = torch.autograd.grad(loss, logits, torch.ones_like(loss))
    # The last rows start past element 2^31.
    rows = slice(N - 200, N)
    x = logits[rows].detach().double().requires_grad_(True)
    expected = ce.cross_entropy_reference(x, t[rows], reduction="none")
    assert_close(loss[rows], expected, torch.bfloat16)
    (expected_grad,) = torch.autograd.grad(expected.sum(), x)
    assert_close(grad[rows], expected_grad, torch.bfloat16, "norm")


@gpu_only
def test_fused_peak_memory_is_far_below_the_logits():
    T, H, V = 16384, 1024, 65536  # the logits alone would be 2 GiB of bfloat16
    hidden, weight, bias, t = _flce_inputs(T, H, V, "cuda", torch.bfloat16)
    torch.autograd.grad(tf.fused_linear_cross_entropy(hidden, weight, t, bias), (hidden, weight, bias))  # warm up
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    grads = torch.autograd.grad(tf.fused_linear_cross_entropy(hidden, weight, t, bias), (hidden, weight, bias))
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before - sum(g.numel() * g.element_size() for g in grads)
    logits_bytes = T * V * 2
    assert extra < logits_bytes / 4, f"{extra / 2**20:.0f} MiB beyond inputs and gradients"


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_replayed_launches_see_each_calls_data(device, reduction):
    """A signature's first call plans the forward (its reduction fused: the last row program sums
    the rows) and the backward; later calls replay them on their own logits and targets, some
    rows ignored: loss and gradient against float64 every call, the replays taken."""
    N, V, dtype = 37, 101, torch.bfloat16
    for _ in range(3):
        logits = (torch.randn(N, V, device=device) * 4).to(dtype).requires_grad_(True)
        target = torch.randint(0, V, (N,), device=device)
        target[torch.rand(N, device=device) < 0.3] = -100
        loss = tf.cross_entropy(logits, target, reduction=reduction)
        ref_logits = logits.detach().double().requires_grad_(True)
        expected = F.cross_entropy(ref_logits, target, reduction=reduction)
        upstream = torch.randn_like(expected)
        assert_close(loss, expected, dtype, "norm")
        (grad,) = torch.autograd.grad(loss, logits, upstream.to(dtype))
        (want,) = torch.autograd.grad(expected, ref_logits, upstream)
        assert_close(grad, want, dtype, "norm")
    assert len(ce.cross_entropy_fwd.plans) == 1 and len(ce._grad_into.plans) == 1


@pytest.mark.skipif(ON_GPU, reason="the CPU's check; the GPU asserts on the device (test below)")
@pytest.mark.parametrize("bad", [8, -1, 2**32 + 3])
def test_a_target_out_of_range_raises(bad, device):
    logits, hidden, weight = torch.randn(4, 8), torch.randn(4, 16), torch.randn(8, 16)
    target = torch.tensor([0, bad, 1, -100])
    with pytest.raises(ValueError, match=rf"target holds {bad}, neither ignore_index \(-100\) nor a class in \[0, 8\)"):
        tf.cross_entropy(logits, target)
    with pytest.raises(ValueError, match="nor a class in"):
        tf.fused_linear_cross_entropy(hidden, weight, target)
    assert torch.isfinite(tf.cross_entropy(logits, torch.tensor([0, 7, 1, -100])))


@gpu_only
@pytest.mark.parametrize("fused", [False, True])
def test_a_target_out_of_range_is_a_device_side_assert(fused):
    # An assert leaves the process's CUDA context unusable, as torch's own loss does: a child runs it.
    call = ("tf.fused_linear_cross_entropy(torch.randn(4, 16, device='cuda'), torch.randn(8, 16, device='cuda'), t)"
            if fused else "tf.cross_entropy(torch.randn(4, 8, device='cuda'), t)")
    code = f"import torch, tritonformer as tf; t = torch.tensor([0, 8, 1, 2], device='cuda'); {call}; " \
           "torch.cuda.synchronize()"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1] / "src")}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    assert "neither ignore_index nor in [0, V)" in done.stderr or "device-side assert" in done.stderr, done.stderr
