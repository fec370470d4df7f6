import pytest
import torch

import tritonformer as tf
from tritonformer import nn
from tritonformer.cases.rope import random_heads
from tritonformer.ops import rope as rope_op
from tritonformer.testing import assert_close

from conftest import gpu_only
from helpers import compile_fullgraph, foreign_device_tensor, graph_nodes


def _inputs(device, B=2, Hq=3, Hk=1, S=6, D=8, layout="bhsd", dtype=torch.float32):
    shape = (lambda H: (B, H, S, D)) if layout == "bhsd" else (lambda H: (B, S, H, D))
    q = torch.randn(shape(Hq), device=device).to(dtype)
    k = torch.randn(shape(Hk), device=device).to(dtype)
    cos, sin = (torch.rand(S, D, device=device) * 2 - 1 for _ in range(2))
    return q, k, cos, sin


def _reference(q, k, cos, sin, layout="bhsd"):
    return rope_op.apply_rope_reference(q.double(), k.double(), cos.double(), sin.double(), layout)


def _reference_grads(q, k, cos, sin, douts, layout="bhsd"):
    q64, k64 = (t.detach().double().requires_grad_(True) for t in (q, k))
    return torch.autograd.grad(_reference(q64, k64, cos, sin, layout), (q64, k64), tuple(d.double() for d in douts))


def test_backward_is_the_transposed_rotation(device):
    # Halves of cos and sin that differ, as in every registry case: dx1 = dy1 c1 + dy2 s2 and
    # dx2 = dy2 c2 - dy1 s1, against autograd of the reference.
    q, k, cos, sin = _inputs(device, S=9, D=16)
    q.requires_grad_(True)
    k.requires_grad_(True)
    outs = tf.apply_rope(q, k, cos, sin)
    douts = tuple(torch.randn_like(o) for o in outs)
    for g, r in zip(torch.autograd.grad(outs, (q, k), douts), _reference_grads(q, k, cos, sin, douts)):
        assert_close(g, r, torch.float32)


@pytest.fixture
def small_tiles(monkeypatch):
    """Tiles of a few positions and two heads, chunks of four heads: many position blocks, several
    steps a program and partial steps, on shapes the interpreter runs quickly."""
    monkeypatch.setattr(rope_op, "LAUNCH", (256, 2, 4, 4, 2))
    # (B, H, S, D) contiguous would take the flat kernel: keep these on the head-walking one.
    monkeypatch.setattr(rope_op, "FLAT_BHSD", False)
    # The chunking depends on the SM count: fix it so that the GPU runs the same shapes.
    monkeypatch.setattr(rope_op.runtime, "num_sms", lambda *device: 3)
    rope_op._launch_shape.cache_clear()
    yield
    rope_op._launch_shape.cache_clear()


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_many_blocks_steps_and_chunks(dtype, layout, device, small_tiles):
    q, k, cos, sin = _inputs(device, B=2, Hq=7, Hk=5, S=7, D=16, layout=layout, dtype=dtype)
    q.requires_grad_(True)
    k.requires_grad_(True)
    _, _, n_blocks, per_program, q_chunks, n_chunks, _, _, _ = rope_op._launch_shape(
        2, 7, 7, 5, 16, dtype.itemsize, 0)
    assert n_blocks > 1 and (per_program, q_chunks, n_chunks) == (4, 2, 4)
    outs = tf.apply_rope(q, k, cos, sin, layout)
    for out, exp in zip(outs, _reference(q.detach(), k.detach(), cos, sin, layout)):
        assert_close(out, exp, dtype)
    douts = tuple(torch.randn_like(o) for o in outs)
    grads = torch.autograd.grad(outs, (q, k), douts)
    for g, r in zip(grads, _reference_grads(q, k, cos, sin, douts, layout)):
        assert_close(g, r, dtype)


# ---- the flat (B, H, S, D) path ----

@pytest.fixture
def flat_calls(monkeypatch):
    """The flat path's launches, recorded as (Hk, DENSE) and passed through, with tiles of 256
    bytes: a few rows, so that tiles straddle (batch, head) slabs when S is odd."""
    calls = []
    plan = rope_op._flat_launch

    def spy(q, k, q_out, k_out, cos, sin, Hk, backward):
        calls.append((Hk, all(map(rope_op._dense, (q, k, q_out, k_out)))))
        return plan(q, k, q_out, k_out, cos, sin, Hk, backward)

    monkeypatch.setattr(rope_op, "_flat_launch", spy)
    monkeypatch.setattr(rope_op, "FLAT_TILE_BYTES", 256)
    return calls


def _slab_views(B, H, S, D, dtype, device, how):
    """(B, H, S, D) tensors whose slabs are contiguous: "dense", "heads" (H of a wider head axis) or
    "batch-major" (memory laid out (H, B, S, D))."""
    if how == "heads":
        return torch.randn(B, H + 2, S, D, device=device).to(dtype)[:, 1:H + 1]
    if how == "batch-major":
        return torch.randn(H, B, S, D, device=device).to(dtype).transpose(0, 1)
    return torch.randn(B, H, S, D, device=device).to(dtype)


def _tables(B, S, D, device, kind):
    if kind == "shared":
        return [torch.rand(S, D, device=device) * 2 - 1 for _ in range(2)]
    if kind == "one":
        return [torch.rand(1, S, D, device=device).to(torch.bfloat16) * 2 - 1 for _ in range(2)]
    if kind == "batch":
        return [torch.rand(B, S, D, device=device).to(torch.float16) * 2 - 1 for _ in range(2)]
    # "mixed": a transposed float32 cos shared by the batch, a float64 sin per batch row
    return [(torch.rand(D, S, device=device) * 2 - 1).mT,
            torch.rand(B, S, D, device=device, dtype=torch.float64) * 2 - 1]


@pytest.mark.parametrize("dtype,B,Hq,Hk,S,D,views,table", [
    (torch.float32, 2, 6, 2, 7, 16, ("dense", "dense"), "shared"),
    (torch.bfloat16, 3, 4, 1, 5, 32, ("dense", "dense"), "batch"),
    (torch.float16, 2, 3, 3, 9, 24, ("heads", "batch-major"), "one"),
    (torch.bfloat16, 2, 5, 2, 3, 8, ("batch-major", "heads"), "mixed"),
    (torch.float32, 1, 1, 1, 1, 2, ("dense", "dense"), "shared"),
])
def test_flat_path_matches_reference(dtype, B, Hq, Hk, S, D, views, table, device, flat_calls):
    # Odd S (tiles straddle slabs), GQA, D/2 not a power of two, per-batch and mixed tables,
    # non-dense slab layouts; forward and backward against the float64 reference.
    q = _slab_views(B, Hq, S, D, dtype, device, views[0]).requires_grad_(True)
    k = _slab_views(B, Hk, S, D, dtype, device, views[1]).requires_grad_(True)
    cos, sin = _tables(B, S, D, device, table)
    outs = tf.apply_rope(q, k, cos, sin)
    assert flat_calls == [(Hk, views == ("dense", "dense"))]
    for out, exp in zip(outs, _reference(q.detach(), k.detach(), cos, sin)):
        assert out.stride(3) == 1
        assert_close(out, exp, dtype)
    douts = tuple(torch.randn_like(o) for o in outs)
    grads = torch.autograd.grad(outs, (q, k), douts)
    assert len(flat_calls) == 2 and flat_calls[1][0] == Hk
    for g, r in zip(grads, _reference_grads(q, k, cos, sin, douts)):
        assert_close(g, r, dtype)


class _Recorded:
    """A launcher that notes its name in `launched` at each launch or replay, then runs it."""

    def __init__(self, launch, name: str, launched: list):
        self.launch, self.name, self.launched = launch, name, launched

    def __call__(self, *args, **kwargs):
        self.launched.append(self.name)
        return self.launch(*args, **kwargs)

    def replay(self, *args):
        self.launched.append(self.name)
        return self.launch.replay(*args)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flat_path_equals_head_walking_path(dtype, device, monkeypatch):
    # Same float32 formula, same roundings: the two kernels agree exactly under the interpreter
    # (on the GPU, to the dtype's tolerance: FMA contraction may differ between kernels).
    q = torch.randn(2, 6, 11, 32, device=device).to(dtype)
    k = torch.randn(2, 2, 11, 32, device=device).to(dtype)
    cos, sin = _tables(2, 11, 32, device, "batch")
    douts = torch.randn_like(q), torch.randn_like(k)
    results, launched = [], []
    for name in ("_launch_rope", "_launch_rope_flat"):
        monkeypatch.setattr(rope_op, name, _Recorded(getattr(rope_op, name), name, launched))
    for flat in (True, False):
        monkeypatch.setattr(rope_op, "FLAT_BHSD", flat)
        rope_op.runtime.clear_plans()  # FLAT_BHSD keys no plan: the second path must plan afresh
        launched.clear()
        results.append([*tf.apply_rope(q, k, cos, sin), *rope_op.rope_bwd(*douts, cos, sin, False)])
        assert set(launched) == {"_launch_rope_flat" if flat else "_launch_rope"}
    for a, b in zip(*results):
        if rope_op.runtime.INTERPRET:
            assert torch.equal(a, b)
        else:
            assert_close(a, b.double(), dtype)


def test_flat_path_in_place(device, flat_calls):
    # Without grad: q and k in one launch, non-dense views written where they lie. With grad:
    # one launch each (Hk 0), backward of q alone (dk None) writing a fresh dq.
    B, Hq, Hk, S, D = 2, 3, 1, 7, 16
    q = _slab_views(B, Hq, S, D, torch.bfloat16, device, "heads")
    k = _slab_views(B, Hk, S, D, torch.bfloat16, device, "dense")
    cos, sin = _tables(B, S, D, device, "batch")
    expected = _reference(q, k, cos, sin)
    base = q._base.clone()
    qe, ke = tf.apply_rope(q, k, cos, sin, inplace=True)
    assert qe is q and ke is k and flat_calls == [(Hk, False)]
    assert_close(q, expected[0], torch.bfloat16)
    assert_close(k, expected[1], torch.bfloat16)
    assert torch.equal(q._base[:, 0], base[:, 0]) and torch.equal(q._base[:, Hq + 1:], base[:, Hq + 1:])

    flat_calls.clear()
    x = torch.randn(B, Hq + Hk, S, D, device=device, requires_grad=True)
    y = x * 1.0
    outs = tf.apply_rope(y[:, :Hq], y[:, Hq:], cos, sin, inplace=True)
    assert flat_calls == [(0, False), (0, False)]
    expected = _reference(x.detach()[:, :Hq], x.detach()[:, Hq:], cos, sin)
    for out, exp in zip(outs, expected):
        assert_close(out, exp, torch.float32)
    dq = torch.randn(B, Hq, S, D, device=device)
    (g,) = torch.autograd.grad(outs[0], x, dq)
    assert flat_calls[2] == (0, True)
    x64 = x.detach().double().requires_grad_(True)
    (g_ref,) = torch.autograd.grad(_reference(x64[:, :Hq], x64[:, Hq:], cos, sin)[0], x64, dq.double())
    assert_close(g, g_ref, torch.float32)
    assert not g[:, Hq:].any()


def test_flat_path_64_bit_offsets(device, monkeypatch, flat_calls):
    monkeypatch.setattr(rope_op.runtime, "needs_int64", lambda *tensors: True)
    q = _slab_views(2, 3, 5, 8, torch.float16, device, "heads").requires_grad_(True)
    k = _slab_views(2, 1, 5, 8, torch.float16, device, "dense")
    cos, sin = _tables(2, 5, 8, device, "batch")
    outs = tf.apply_rope(q, k, cos, sin)
    for out, exp in zip(outs, _reference(q.detach(), k, cos, sin)):
        assert_close(out, exp, torch.float16)
    douts = (torch.randn_like(outs[0]), torch.randn_like(outs[1]))
    (g,) = torch.autograd.grad(outs[:1], (q,), douts[:1])
    assert_close(g, _reference_grads(q, k, cos, sin, douts)[0], torch.float16)
    assert len(flat_calls) == 2


@pytest.mark.parametrize("layout,view", [("bhsd", "transposed"), ("bhsd", "sliced"), ("bhsd", "strided"),
                                         ("bshd", None)])
def test_other_layouts_take_the_head_walking_path(layout, view, device, flat_calls):
    q = random_heads((2, 3, 6, 8), layout, torch.float32, device, view)
    k = random_heads((2, 1, 6, 8), layout, torch.float32, device)
    cos, sin = _tables(2, 6, 8, device, "shared")
    outs = tf.apply_rope(q, k, cos, sin, layout)
    assert flat_calls == []
    for out, exp in zip(outs, _reference(q, k, cos, sin, layout)):
        assert_close(out, exp, torch.float32)


def test_per_batch_table_equals_position_ids_gather(device):
    # HF's LlamaRotaryEmbedding returns (B, S, D) tables from position_ids: rows of one table.
    B, Hq, Hk, S, D = 3, 2, 1, 7, 16
    inv_freq = 1.0 / 10000 ** (torch.arange(0, D, 2, device=device, dtype=torch.float32) / D)
    angles = torch.arange(64, device=device, dtype=torch.float32)[:, None] * inv_freq
    emb = torch.cat((angles, angles), -1)
    table_cos, table_sin = emb.cos(), emb.sin()
    position_ids = torch.stack([torch.randperm(64, device=device)[:S] for _ in range(B)])
    q, k, _, _ = _inputs(device, B, Hq, Hk, S, D)
    qe, ke = tf.apply_rope(q, k, table_cos[position_ids], table_sin[position_ids])
    for b in range(B):
        cos_b, sin_b = table_cos[position_ids[b]], table_sin[position_ids[b]]
        qb, kb = tf.apply_rope(q[b:b + 1], k[b:b + 1], cos_b, sin_b)
        assert torch.equal(qe[b:b + 1], qb) and torch.equal(ke[b:b + 1], kb)
        rq, rk = _reference(q[b:b + 1], k[b:b + 1], cos_b, sin_b)
        assert_close(qb, rq, torch.float32)
        assert_close(kb, rk, torch.float32)


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_inplace_without_grad_writes_into_q_and_k(layout, device):
    q, k, cos, sin = _inputs(device, layout=layout, dtype=torch.bfloat16)
    expected = _reference(q, k, cos, sin, layout)
    versions = q._version, k._version
    qe, ke = tf.apply_rope(q, k, cos, sin, layout, inplace=True)
    assert qe is q and ke is k
    assert q._version > versions[0] and k._version > versions[1]
    assert_close(q, expected[0], torch.bfloat16)
    assert_close(k, expected[1], torch.bfloat16)


def test_inplace_under_inference_mode(device):
    with torch.inference_mode():
        q, k, cos, sin = _inputs(device)
        expected = _reference(q, k, cos, sin)
        tf.apply_rope(q, k, cos, sin, inplace=True)
    assert_close(q, expected[0], torch.float32)
    assert_close(k, expected[1], torch.float32)


def test_inplace_with_grad_on_views_of_a_fused_projection(device):
    # HF-style: q and k are views of one projection's output, rotated in place; the gradient
    # reaching the projection equals the out-of-place one, and the untouched slice gets zero.
    B, S, Hq, Hk, D = 2, 5, 3, 1, 8
    x = torch.randn(B, S, Hq + 2 * Hk, D, device=device, requires_grad=True)
    _, _, cos, sin = _inputs(device, S=S, D=D)

    def grad_of_x(inplace):
        y = x * 1.0
        outs = tf.apply_rope(y[:, :, :Hq], y[:, :, Hq:Hq + Hk], cos, sin, "bshd", inplace=inplace)
        (g,) = torch.autograd.grad(outs, x, (dq, dk))
        return outs, g

    dq, dk = torch.randn(B, S, Hq, D, device=device), torch.randn(B, S, Hk, D, device=device)
    (qe, ke), g = grad_of_x(inplace=True)
    (qe_ref, ke_ref), g_ref = grad_of_x(inplace=False)
    assert torch.equal(qe, qe_ref) and torch.equal(ke, ke_ref)
    assert torch.equal(g, g_ref)
    assert not g[:, :, Hq + Hk:].any()


def test_inplace_refuses_leaves_requiring_grad_before_writing(device):
    q, k, cos, sin = _inputs(device)
    q.requires_grad_(True)
    before = q.detach().clone()
    with pytest.raises(ValueError, match="q is a leaf tensor that requires grad"):
        tf.apply_rope(q, k, cos, sin, inplace=True)
    with pytest.raises(ValueError, match="q is a leaf tensor that requires grad, or a view of one"):
        tf.apply_rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin, "bshd", inplace=True)
    assert torch.equal(q.detach(), before)


def test_inplace_on_a_tensor_saved_for_backward_raises_at_backward(device):
    q, k, cos, sin = _inputs(device)
    w = torch.randn(q.shape[-1], device=device, requires_grad=True)
    y = q * w  # saves q for the gradient of w
    tf.apply_rope(q, k, cos, sin, inplace=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_compiles_forward_and_backward_without_graph_break(layout, device):
    q, k, cos, sin = _inputs(device, layout=layout)
    q.requires_grad_(True)
    k.requires_grad_(True)
    qe, ke = compile_fullgraph(lambda a, b, c, s: tf.apply_rope(a * 2, b, c, s, layout))(q, k, cos, sin)
    douts = (torch.randn_like(qe), torch.randn_like(ke))
    grads = torch.autograd.grad((qe, ke), (q, k), douts)
    q64, k64 = (t.detach().double().requires_grad_(True) for t in (q, k))
    expected = _reference(q64 * 2, k64, cos, sin, layout)
    expected_grads = torch.autograd.grad(expected, (q64, k64), tuple(d.double() for d in douts))
    for out, exp in zip((qe, ke, *grads), (*expected, *expected_grads)):
        assert_close(out, exp, torch.float32)


def test_compiles_inplace_with_and_without_grad(device):
    q, k, cos, sin = _inputs(device, layout="bshd")
    expected = _reference(q, k, cos, sin, "bshd")
    compiled = compile_fullgraph(lambda a, b, c, s: tf.apply_rope(a, b, c, s, "bshd", inplace=True))
    compiled(q, k, cos, sin)
    assert_close(q, expected[0], torch.float32)
    assert_close(k, expected[1], torch.float32)

    x = torch.randn(2, 6, 4, 8, device=device, requires_grad=True)

    def rotate_projection(x, c, s):
        y = x * 1.0
        return tf.apply_rope(y[:, :, :3], y[:, :, 3:], c, s, "bshd", inplace=True)

    outs = compile_fullgraph(rotate_projection)(x, cos, sin)
    douts = tuple(torch.randn_like(o) for o in outs)
    (g,) = torch.autograd.grad(outs, (x,), douts)
    x64 = x.detach().double().requires_grad_(True)
    expected = _reference(x64[:, :, :3], x64[:, :, 3:], cos, sin, "bshd")
    (g_ref,) = torch.autograd.grad(expected, (x64,), tuple(d.double() for d in douts))
    for out, exp in zip((*outs, g), (*expected, g_ref)):
        assert_close(out, exp, torch.float32)


def test_cos_sin_requiring_grad_is_refused(device):
    q, k, cos, sin = _inputs(device)
    with pytest.raises(ValueError, match="gradients with respect to cos and sin are not supported"):
        tf.apply_rope(q, k, cos.requires_grad_(True), sin)
    with torch.no_grad():
        qe, _ = tf.apply_rope(q, k, cos, sin)
    assert_close(qe, _reference(q, k, cos.detach(), sin)[0], torch.float32)


def test_64_bit_offsets_path(device, monkeypatch):
    # The interpreter cannot afford a 2^31-element tensor: force the 64-bit offsets path on a
    # small one (the GPU test below crosses 2^31 for real).
    monkeypatch.setattr(rope_op.runtime, "needs_int64", lambda *tensors: True)
    q, k, cos, sin = _inputs(device, layout="bshd", dtype=torch.float16)
    q.requires_grad_(True)
    outs = tf.apply_rope(q, k, cos, sin, "bshd")
    for out, exp in zip(outs, _reference(q.detach(), k, cos, sin, "bshd")):
        assert_close(out, exp, torch.float16)
    douts = (torch.randn_like(outs[0]), torch.randn_like(outs[1]))
    (g,) = torch.autograd.grad(outs[:1], (q,), douts[:1])
    assert_close(g, _reference_grads(q, k, cos, sin, douts, "bshd")[0], torch.float16)


@gpu_only
def test_offsets_past_2_to_the_31(device):
    # Batch row 1 of q starts 2^31 elements into its storage; only the two rows are touched.
    B, H, S, D = 2, 2, 16, 64
    storage = torch.empty(2**31 + H * S * D, device=device, dtype=torch.bfloat16)
    q = storage.as_strided((B, H, S, D), (2**31, S * D, D, 1))
    q[0].normal_()
    q[1].normal_()
    _, k, cos, sin = _inputs(device, B, H, 1, S, D, dtype=torch.bfloat16)
    qe, ke = tf.apply_rope(q, k, cos, sin)
    expected = _reference(q, k, cos, sin)
    assert_close(qe, expected[0], torch.bfloat16)
    assert_close(ke, expected[1], torch.bfloat16)


def test_module_applies_rope_in_its_layout(device):
    module = nn.ApplyRope(layout="bshd")
    q, k, cos, sin = _inputs(device, layout="bshd")
    for out, exp in zip(module(q, k, cos, sin), _reference(q, k, cos, sin, "bshd")):
        assert_close(out, exp, torch.float32)
    assert "bshd" in repr(module)
    with pytest.raises(ValueError, match="layout must be one of"):
        nn.ApplyRope(layout="sbhd")


def _bad(**changes):
    """Arguments for apply_rope on fresh small inputs, with some replaced."""
    def make(device):
        q, k, cos, sin = _inputs(device, B=2, Hq=3, Hk=1, S=5, D=8)
        args = {"q": q, "k": k, "cos": cos, "sin": sin}
        args.update({name: change(device) for name, change in changes.items() if callable(change)})
        args.update({name: v for name, v in changes.items() if not callable(v)})
        return args
    return make


@pytest.mark.parametrize(
    "make,error,match",
    [
        (_bad(q=lambda d: torch.randn(2, 3, 5, 8, device=d, dtype=torch.float64)), TypeError,
         "q has dtype torch.float64"),
        (_bad(k=lambda d: torch.ones(2, 1, 5, 8, device=d, dtype=torch.int32)), TypeError, "k has dtype torch.int32"),
        (_bad(k=lambda d: torch.randn(2, 1, 5, 8, device=d, dtype=torch.float16)), TypeError,
         "k has dtype torch.float16 but q"),
        (_bad(cos=lambda d: torch.ones(5, 8, device=d, dtype=torch.int64)), TypeError, "cos has dtype torch.int64"),
        (_bad(sin=[[0.0] * 8] * 5), TypeError, "sin must be a torch.Tensor"),
        (_bad(q=lambda d: foreign_device_tensor()), ValueError, "q is on meta"),
        (_bad(q=lambda d: torch.randn(2, 3, 5, device=d)), ValueError, "q must have 4 dimensions"),
        (_bad(k=lambda d: torch.randn(1, 2, 1, 5, 8, device=d)), ValueError, "k must have 4 dimensions"),
        (_bad(q=lambda d: torch.randn(2, 3, 5, 7, device=d), k=lambda d: torch.randn(2, 1, 5, 7, device=d)),
         ValueError, "must be even"),
        (_bad(k=lambda d: torch.randn(3, 1, 5, 8, device=d)), ValueError, "k has shape \\(3, 1, 5, 8\\)"),
        (_bad(k=lambda d: torch.randn(2, 1, 6, 8, device=d)), ValueError, "k has shape \\(2, 1, 6, 8\\)"),
        (_bad(k=lambda d: torch.randn(2, 1, 5, 4, device=d)), ValueError, "k has shape \\(2, 1, 5, 4\\)"),
        (_bad(cos=lambda d: torch.randn(6, 8, device=d)), ValueError, "cos has shape \\(6, 8\\)"),
        (_bad(cos=lambda d: torch.randn(5, 4, device=d)), ValueError, "cos has shape \\(5, 4\\)"),
        (_bad(sin=lambda d: torch.randn(3, 5, 8, device=d)), ValueError, "sin has shape \\(3, 5, 8\\)"),
        (_bad(sin=lambda d: torch.randn(2, 1, 5, 8, device=d)), ValueError, "sin has shape \\(2, 1, 5, 8\\)"),
        (_bad(layout="sbhd"), ValueError, "layout must be 'bhsd'"),
        (_bad(inplace=1), TypeError, "inplace must be a bool"),
    ],
)
def test_bad_input_is_named(make, error, match, device):
    with pytest.raises(error, match=match):
        tf.apply_rope(**make(device))


def test_bshd_shapes_are_checked_in_their_order(device):
    q, k, cos, sin = _inputs(device, layout="bshd")  # q (2, 6, 3, 8)
    with pytest.raises(ValueError, match="k has shape"):
        tf.apply_rope(q, k.transpose(1, 2), cos, sin, "bshd")
    with pytest.raises(ValueError, match="cos has shape"):
        tf.apply_rope(q, k, cos[:3], sin, "bshd")


def test_qkv_rope_bad_input(device):
    x = torch.randn(2, 5, 16, device=device)
    w_q, w_kv = torch.randn(16, 16, device=device), torch.randn(8, 16, device=device)
    cos = sin = torch.randn(5, 8, device=device)
    with pytest.raises(ValueError, match="x"):
        tf.qkv_rope(x[0], w_q, w_kv, w_kv, cos, sin)
    with pytest.raises(ValueError, match="w_q"):
        tf.qkv_rope(x, w_q[:, :15], w_kv, w_kv, cos, sin)
    with pytest.raises(ValueError, match="w_k"):
        tf.qkv_rope(x, w_q, w_kv[:4], w_kv, cos, sin)
    with pytest.raises(TypeError, match="w_v"):
        tf.qkv_rope(x, w_q, w_kv, w_kv.double(), cos, sin)
    with pytest.raises(ValueError, match="b_k"):
        tf.qkv_rope(x, w_q, w_kv, w_kv, cos, sin, b_k=torch.randn(7, device=device))
    with pytest.raises(ValueError, match="cos"):
        tf.qkv_rope(x, w_q, w_kv, w_kv, cos[:4], sin)


def test_qkv_rope_is_one_node_and_compiles(device):
    """Eager training: one autograd node; under torch.compile, no graph break, the fused path's
    in-place rotation and its backward into the one gradient buffer, and the same gradients."""
    x = torch.randn(2, 5, 16, device=device, requires_grad=True)
    ws = [torch.randn(n, 16, device=device, requires_grad=True) for n in (16, 8, 8)]
    cos, sin = torch.randn(5, 8, device=device), torch.randn(5, 8, device=device)

    def loss(x, *ws):
        q, k, v = tf.qkv_rope(x, *ws, cos, sin)
        return (q.square().sum() + k.sum() + (v * v.detach()).sum())

    eager = loss(x, *ws)
    assert graph_nodes(eager).count("QKVRopeFunctionBackward") == 1
    expected = torch.autograd.grad(eager, (x, *ws))
    got = torch.autograd.grad(compile_fullgraph(loss)(x, *ws), (x, *ws))
    explain = torch._dynamo.explain(loss)(x, *ws)
    calls = {str(node.target) for graph in explain.graphs for module in graph.modules()
             if isinstance(module, torch.fx.GraphModule) for node in module.graph.nodes}
    assert {"tritonformer.rope_fwd_inplace.default", "tritonformer.qkv_rope_grad.default"} <= calls, calls
    for g, e in zip(got, expected):
        assert_close(g, e.double(), torch.float32, "norm")


def _qkv_grad_reference(grads, x, cos, sin, heads):
    """qkv_rope_grad's dy in float64: q's and k's gradients through the rotation's transpose, v's
    as they are, zeros for a missing one, token-major in (q, k, v) head order."""
    B, S = x.shape[:2]
    D = cos.shape[-1]
    dq, dk, dv = (torch.zeros(B, h, S, D, dtype=torch.float64, device=x.device) if g is None else g.double()
                  for g, h in zip(grads, heads))
    dq, dk = _reference_grads(dq, dk, cos, sin, (dq, dk))  # the transpose (its inputs do not matter)
    return torch.cat([t.transpose(1, 2).reshape(B * S, -1) for t in (dq, dk, dv)], dim=1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("missing", [None, "dq", "dv"])
@pytest.mark.parametrize("grads_layout,table,D", [("bshd", "batch", 12), ("bhsd", "shared", 80)])
def test_qkv_rope_grad_is_the_rotated_back_gradients_and_their_column_sums(device, monkeypatch, dtype, missing,
                                                                           grads_layout, table, D):
    """qkv_rope's backward launch: dy holds q's and k's gradients rotated back and v's copied,
    token-major in (q, k, v) head order, zeros for a missing gradient; db is dy's column sums.
    Small tiles over 3 x 7 tokens and more blocks than programs (each loops); (B, H, S, D)
    gradients read through a transposed view of (B, S, H, D) memory or contiguous; a per-batch or
    shared table; D 12 (halves of 6 in blocks of 8) or 80."""
    monkeypatch.setattr(rope_op, "QKV_GRAD_TILE_ELEMENTS", 32 if D == 12 else 256)
    B, S, Hq, Hk = 3, 7, 3, 1
    x = torch.randn(B, S, 5, device=device).to(dtype)

    def grad(h):
        if grads_layout == "bshd":
            return torch.randn(B, S, h, D, device=device).to(dtype).transpose(1, 2)
        return torch.randn(B, h, S, D, device=device).to(dtype)
    grads = {name: grad(h) for name, h in (("dq", Hq), ("dk", Hk), ("dv", Hk))}
    grads[missing] = None
    cos, sin = (torch.rand((B, S, D) if table == "batch" else (S, D), device=device) * 2 - 1 for _ in range(2))
    ordered = [grads[name] for name in ("dq", "dk", "dv")]
    dy, db = rope_op.qkv_rope_grad(*ordered, x, cos, sin, [Hq, Hk, Hk], True)
    assert dy.shape == (B * S, (Hq + 2 * Hk) * D) and dy.dtype == dtype and db.dtype == dtype
    assert_close(dy, _qkv_grad_reference(ordered, x, cos, sin, (Hq, Hk, Hk)), dtype, "elementwise")
    assert_close(db, dy.double().sum(0), dtype, "norm")
    if missing:
        column = {"dq": slice(0, Hq * D), "dv": slice((Hq + Hk) * D, None)}[missing]
        assert (dy[:, column] == 0).all() and (db[column] == 0).all()


@gpu_only
def test_qkv_rope_grad_head_offsets_past_2_to_the_31(device):
    # dq's third head starts past 2^31 elements into its storage (a head stride of 3 * 2^29):
    # the head's offset must be computed in 64 bits. Only the three heads are touched.
    B, Hq, Hk, S, D = 1, 3, 1, 4, 8
    storage = torch.empty(2**30 + (Hq - 1) * 3 * 2**29 + S * D, device=device, dtype=torch.bfloat16)
    dq = storage.as_strided((B, Hq, S, D), (storage.numel(), 3 * 2**29, D, 1), 2**30)
    for h in range(Hq):
        dq[:, h].normal_()
    dk, dv = (torch.randn(B, Hk, S, D, device=device, dtype=torch.bfloat16) for _ in range(2))
    x = torch.empty(B, S, 4, device=device, dtype=torch.bfloat16)
    cos, sin = (torch.rand(S, D, device=device) * 2 - 1 for _ in range(2))
    (dy,) = rope_op.qkv_rope_grad(dq, dk, dv, x, cos, sin, [Hq, Hk, Hk], False)
    assert_close(dy, _qkv_grad_reference((dq, dk, dv), x, cos, sin, (Hq, Hk, Hk)), torch.bfloat16, "elementwise")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("D", [32, 80])
def test_rope_into_cache_is_apply_rope_and_the_cache_writes(device, dtype, D):
    """rope_into_cache: q rotated as apply_rope rotates it (bit for bit), k rotated and v copied
    into each sequence's row of the caches, nothing else of the caches touched; a position
    outside the cache writes nothing."""
    B, H, H_kv, S_max = 3, 6, 2, 9
    q, k, v = (torch.randn(B, 1, n, D, device=device, dtype=dtype) for n in (H, H_kv, H_kv))
    cos, sin = torch.randn(2, B, 1, D, device=device, dtype=dtype)
    # The last past the cache's end; a strided view (every other element) as the positions.
    positions = torch.tensor([4, -1, 0, -1, S_max, -1], device=device)[::2]
    k_cache, v_cache = (torch.randn(B, H_kv, S_max, D, device=device, dtype=dtype) for _ in range(2))
    k_before, v_before = k_cache.clone(), v_cache.clone()
    q_out = rope_op.rope_into_cache(q[:, 0], k[:, 0], v[:, 0], cos, sin, positions, k_cache, v_cache)
    q_ref, k_ref = tf.apply_rope(q, k, cos, sin, layout="bshd")
    assert torch.equal(q_out, q_ref[:, 0])
    for b, p in enumerate(positions.tolist()):
        if p < S_max:
            assert torch.equal(k_cache[b, :, p], k_ref[b, 0]) and torch.equal(v_cache[b, :, p], v[b, 0])
            k_before[b, :, p], v_before[b, :, p] = k_cache[b, :, p], v_cache[b, :, p]
    assert torch.equal(k_cache, k_before) and torch.equal(v_cache, v_before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_into_cache_by_position_reads_the_tables_at_each_position(device, dtype):
    """Tables of every position (by_position) rotate as the rows gathered at the positions do, bit
    for bit; a position past the table takes its last row, and writes nothing past the cache."""
    B, H, H_kv, S_max, D, P = 4, 4, 2, 7, 32, 8
    q, k, v = (torch.randn(B, n, D, device=device, dtype=dtype) for n in (H, H_kv, H_kv))
    cos, sin = torch.randn(2, P, D, device=device, dtype=dtype)
    positions = torch.tensor([6, 0, 9, 3], device=device)
    caches = [torch.randn(B, H_kv, S_max, D, device=device, dtype=dtype) for _ in range(2)]
    gathered = [c.clone() for c in caches]
    q_out = rope_op.rope_into_cache(q, k, v, cos, sin, positions, *caches, by_position=True)
    rows = positions.clamp(max=P - 1)
    q_rows = rope_op.rope_into_cache(q, k, v, cos[rows], sin[rows], positions, *gathered)
    assert torch.equal(q_out, q_rows)
    assert all(torch.equal(c, g) for c, g in zip(caches, gathered))


def test_rope_into_cache_names_bad_input(device):
    q, k = torch.randn(2, 4, 32, device=device), torch.randn(2, 2, 32, device=device)
    cos = sin = torch.randn(2, 32, device=device)
    cache = torch.zeros(2, 2, 8, 32, device=device)
    positions = torch.zeros(2, dtype=torch.long, device=device)
    call = rope_op.rope_into_cache
    with pytest.raises(ValueError, match="do not fit"):
        call(q, k, k, cos, sin, positions, torch.zeros(2, 3, 8, 32, device=device), torch.zeros(2, 3, 8, 32, device=device))
    with pytest.raises(TypeError, match="share a dtype"):
        call(q, k.half(), k.half(), cos, sin, positions, cache, cache.clone())
    with pytest.raises(TypeError, match="positions"):
        call(q, k, k, cos, sin, positions.int(), cache, cache.clone())
    with pytest.raises(ValueError, match="cos must be"):
        call(q, k, k, cos[:, :16], sin, positions, cache, cache.clone())
    with pytest.raises(ValueError, match="with by_position, cos must be a"):
        call(q, k, k, cos[:, :16], sin, positions, cache, cache.clone(), by_position=True)
    with pytest.raises(ValueError, match="differ in shape"):
        call(q, k, k, torch.randn(5, 32, device=device), sin, positions, cache, cache.clone(), by_position=True)
    with pytest.raises(ValueError, match="unit stride"):
        call(torch.randn(2, 32, 4, device=device).transpose(1, 2), k, k, cos, sin, positions, cache, cache.clone())
    with pytest.raises(ValueError, match="requires grad"):
        call(q.requires_grad_(), k, k, cos, sin, positions, cache, cache.clone())
