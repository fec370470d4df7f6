import pytest
import torch

import tritonformer
from tritonformer import nn as tnn
from tritonformer import runtime
from tritonformer.ops import norm
from tritonformer.testing import assert_close, rel_err

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


@pytest.mark.parametrize("fn", ["rms_norm", "layer_norm"])
def test_zero_width_rows(device, fn):
    # A last dimension of 0 gives an empty output and empty gradients, as in torch and HF.
    x = torch.randn(2, 3, 0, device=device, requires_grad=True)
    weight = torch.ones(0, device=device, requires_grad=True)
    args = (weight,) if fn == "rms_norm" else (weight, torch.zeros(0, device=device, requires_grad=True))
    y = getattr(tritonformer, fn)(x, *args)
    assert y.shape == x.shape
    y.sum().backward()
    assert x.grad.shape == x.shape and weight.grad.shape == weight.shape


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
    # GPT-OSS's: a float32 weight on bf16 activations, multiplied before the one rounding, as
    # GptOssRMSNorm computes it (the result in x's dtype).
    gpt_oss = tnn.RMSNorm(32, round_before_weight=False).to(device)
    gpt_oss.load_state_dict({"weight": torch.randn(32)})
    xb = x.bfloat16()
    xf = xb.float()
    expected = (gpt_oss.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6))).bfloat16()
    out = gpt_oss(xb)
    assert out.dtype == torch.bfloat16 and "round_before_weight=False" in repr(gpt_oss)
    assert_close(out, expected, torch.bfloat16)
    with pytest.raises(TypeError, match="round_before_weight"):
        tritonformer.rms_norm(x, rms.weight, 1e-6, 0.0, "no")

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


def test_layer_norm_backward_of_wide_rows(device, monkeypatch):
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
    """h is torch's rounded sum; y is rms_norm of it (the same kernel arithmetic). Three calls on
    fresh data: the first plans, the others replay."""
    for _ in range(3):
        x, res = (torch.randn(6, 300, device=device).to(torch.bfloat16) for _ in range(2))
        w = torch.randn(300, device=device).to(torch.bfloat16)
        y, h = tritonformer.add_rms_norm(x, res, w, 1e-6)
        assert torch.equal(h, x + res)
        assert torch.equal(y, tritonformer.rms_norm(h, w, 1e-6))
    assert len(norm.add_norm_fwd.plans) == 1


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


# The column-split LayerNorm backward at test sizes: several column blocks and row groups, the
# last of each partial (37 rows in groups of 8, 101 columns in blocks of 32).
SMALL_SPLIT = dict(coef_rows=2, coef_chunk=32, coef_warps=4, coef_stages=2, block_m=4, block_n=32, rows=8, warps=4,
                   stages=3, reverse=True)


def _split_backward(monkeypatch, **cfg):
    """Route LayerNorm rows past 64 columns to the split backward with SMALL_SPLIT (updated by
    cfg); returns the list that each launch of its second kernel appends its grid to."""
    monkeypatch.setattr(norm, "LAYER_NORM_BWD_MAX_N", 64)
    monkeypatch.setattr(norm, "FUSED_MAX_N", 64)  # the no-bias threshold
    monkeypatch.setattr(norm, "LAYER_NORM_SPLIT", dict(SMALL_SPLIT, **cfg))
    grids, launch = [], norm._launch_ln_cols

    class Recording:
        def __call__(self, grid, *args, **kwargs):
            grids.append(grid)
            return launch(grid, *args, **kwargs)

        def replay(self, entry, grid, *args):
            grids.append(grid)
            launch.replay(entry, grid, *args)

    monkeypatch.setattr(norm, "_launch_ln_cols", Recording())
    return grids


def _layer_norm_grads_vs_float64(x, w, b, dy, dtype):
    params = [t for t in (x, w, b) if t is not None]
    grads = torch.autograd.grad(tritonformer.layer_norm(x, w, b), params, dy)
    leaves = [t.detach().double().requires_grad_(True) for t in params]
    lw = leaves[1] if w is not None else None
    lb = leaves[-1] if b is not None else None
    expected = torch.autograd.grad(torch.nn.functional.layer_norm(leaves[0], x.shape[-1:], lw, lb), leaves,
                                   dy.double())
    for g, e in zip(grads, expected):
        assert g.dtype == dtype
        assert_close(g, e, dtype, "norm")
    return grads


@pytest.mark.parametrize("rms,params,split", [(True, "weight", False), (True, "none", False),
                                               (False, "weight+bias", False), (False, "weight", False),
                                               (False, "bias", False), (False, "none", False),
                                               (False, "weight+bias", True), (False, "bias", True)])
def test_replayed_launches_see_each_calls_data(device, monkeypatch, rms, params, split):
    """A signature's first call plans the in-register kernels' launches (or LayerNorm's split
    backward), later calls replay them with their own tensors: three calls on fresh data against
    float64, the replays taken; a transposed x (its rows copied) plans nothing and is still right."""
    M, N, dtype = 37, 101, torch.bfloat16
    if split:
        monkeypatch.setattr(norm, "LAYER_NORM_BWD_MAX_N", 64)
    for transposed in (False, False, False, True):
        x = (torch.randn(N, M, device=device).t() if transposed else torch.randn(M, N, device=device))
        x = (x * 2 + 3).to(dtype).requires_grad_(True)
        w = (1 + 0.5 * torch.randn(N, device=device)).to(dtype).requires_grad_(True) if "weight" in params else None
        b = torch.randn(N, device=device).to(dtype).requires_grad_(True) if "bias" in params and not rms else None
        dy = torch.randn(M, N, device=device).to(dtype)
        if rms:
            y = tritonformer.rms_norm(x, w)
            leaves = [t.detach().double().requires_grad_(True) for t in (x, w) if t is not None]
            expected_y = norm.rms_norm_reference(*leaves)
        else:
            y = tritonformer.layer_norm(x, w, b)
            leaves = [t.detach().double().requires_grad_(True) for t in (x, w, b) if t is not None]
            lw = leaves[1] if w is not None else None
            lb = leaves[-1] if b is not None else None
            expected_y = torch.nn.functional.layer_norm(leaves[0], (N,), lw, lb)
        params_ = [t for t in (x, w, b) if t is not None]
        grads = torch.autograd.grad(y, params_, dy)
        expected = torch.autograd.grad(expected_y, leaves, dy.double())
        assert_close(y, expected_y, dtype, "norm")
        for g, e in zip(grads, expected):
            assert_close(g, e, dtype, "norm")
    # The in-register backward of no parameters has no partial rows to plan.
    assert len(norm.norm_fwd.plans) == 1 and len(norm.norm_bwd.plans) == (1 if params != "none" or split else 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("params", ["weight+bias", "weight", "bias", "none"])
def test_layer_norm_split_backward(device, monkeypatch, dtype, params):
    grids = _split_backward(monkeypatch)
    M, N = 37, 101
    x = (torch.randn(M, N, device=device) * 2 + 3).to(dtype).requires_grad_(True)
    w = (1 + 0.5 * torch.randn(N, device=device)).to(dtype).requires_grad_(True) if "weight" in params else None
    b = torch.randn(N, device=device).to(dtype).requires_grad_(True) if "bias" in params else None
    dy = torch.randn(M, N, device=device).to(dtype)
    _layer_norm_grads_vs_float64(x, w, b, dy, dtype)
    assert grids == [(4, 5)]


@pytest.mark.parametrize("cfg", [
    dict(), dict(reverse=False, stages=1, coef_stages=1), dict(coef_rows=1, coef_chunk=128, block_n=128),
    dict(rows=64),  # one row group: dw and db stored directly
])
def test_layer_norm_split_backward_non_contiguous(device, monkeypatch, cfg):
    grids = _split_backward(monkeypatch, **cfg)
    N = 101
    wide = torch.randn(2, 19, N + 30, device=device)
    x = wide[..., 7:7 + N].requires_grad_(True)  # rows 131 elements apart
    assert not x.is_contiguous()
    w = torch.randn(N, device=device, requires_grad=True)
    b = torch.randn(N, device=device, requires_grad=True)
    dy = torch.randn(N, 19, 2, device=device).permute(2, 1, 0)  # column-major rows: copied
    _layer_norm_grads_vs_float64(x, w, b, dy, torch.float32)
    assert len(grids) == 1 and grids[0][1] == (1 if cfg.get("rows") == 64 else 5)


def test_layer_norm_split_backward_is_deterministic_and_resets_its_counters(device, monkeypatch):
    grids = _split_backward(monkeypatch)
    x = torch.randn(37, 101, device=device, requires_grad=True)
    w = torch.randn(101, device=device, requires_grad=True)
    b = torch.randn(101, device=device, requires_grad=True)
    dy = torch.randn(37, 101, device=device)
    first = torch.autograd.grad(tritonformer.layer_norm(x, w, b), (x, w, b), dy)
    second = torch.autograd.grad(tritonformer.layer_norm(x, w, b), (x, w, b), dy)
    for a, c in zip(first, second):
        assert torch.equal(a, c)
    assert len(grids) == 2
    assert runtime.arrival_counters(x.device, 1024).count_nonzero() == 0


def test_layer_norm_split_backward_of_a_large_mean(device, monkeypatch):
    """mean(g * xhat) from x - mean, not from sum(g * x) - mean * sum(g), which cancels: no
    further from float64 than the in-register backward (both start from the forward's float32
    mean, itself off by up to half an ulp of 1000, which is why fp32's norm-wise bound is missed)."""
    grids = _split_backward(monkeypatch)
    x = (torch.randn(37, 101, device=device) + 1e3).requires_grad_(True)
    w = torch.randn(101, device=device, requires_grad=True)
    b = torch.randn(101, device=device, requires_grad=True)
    dy = torch.randn(37, 101, device=device)
    leaves = [t.detach().double().requires_grad_(True) for t in (x, w, b)]
    expected = torch.autograd.grad(torch.nn.functional.layer_norm(leaves[0], (101,), leaves[1], leaves[2]), leaves,
                                   dy.double())
    errors = {}
    for path, max_n in (("split", 64), ("registers", 128)):
        monkeypatch.setattr(norm, "LAYER_NORM_BWD_MAX_N", max_n)
        norm.norm_bwd.plans.clear()  # one signature: the second path must not replay the first's plan
        grads = torch.autograd.grad(tritonformer.layer_norm(x, w, b), (x, w, b), dy)
        errors[path] = [rel_err(g, e) for g, e in zip(grads, expected)]
    assert len(grids) == 1  # the split backward ran once
    assert errors["split"][0] <= 2e-5  # dx
    for split, registers in zip(errors["split"], errors["registers"]):
        assert split <= 1.5 * registers + 1e-7, errors


@pytest.mark.skipif(not ON_GPU or torch.cuda.device_count() < 2, reason="needs two GPUs in one process")
def test_plans_are_per_device():
    """The same layout on a second GPU plans its own launches: replaying the first GPU's compiled
    kernel there fails with an invalid resource handle."""
    N = 256
    for index in (0, 1, 0, 1):
        with torch.cuda.device(index):
            x = torch.randn(64, N, device=f"cuda:{index}", dtype=torch.bfloat16, requires_grad=True)
            w = (1 + 0.5 * torch.randn(N, device=x.device)).to(torch.bfloat16).requires_grad_(True)
            b = torch.randn(N, device=x.device, dtype=torch.bfloat16, requires_grad=True)
            dy = torch.randn(64, N, device=x.device, dtype=torch.bfloat16)
            _layer_norm_grads_vs_float64(x, w, b, dy, torch.bfloat16)
