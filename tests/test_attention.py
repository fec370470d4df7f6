import math

import pytest
import torch

import tritonformer as tf
import tritonformer.nn  # noqa: F401 - tf.nn below
from tritonformer import runtime
from tritonformer.ops import attention as attention_ops
from tritonformer.ops.attention import attention_reference
from tritonformer.testing import assert_close

from helpers import compile_fullgraph, foreign_device_tensor


def _qkv(device, B=1, H=2, H_kv=None, S_q=17, S_k=None, D=32, dtype=torch.float32, grad=True):
    H_kv = H if H_kv is None else H_kv
    S_k = S_q if S_k is None else S_k
    q = torch.randn(B, H, S_q, D, device=device).to(dtype)
    k = torch.randn(B, H_kv, S_k, D, device=device).to(dtype)
    v = torch.randn(B, H_kv, S_k, D, device=device).to(dtype)
    return [t.requires_grad_(grad) for t in (q, k, v)]


def _grads(fn, inputs, do):
    return torch.autograd.grad(fn(*inputs), inputs, do)


def _double_leaves(*ts):
    return [t.detach().double().requires_grad_(True) for t in ts]


@pytest.mark.parametrize("S_q,S_k", [(3, 5), (5, 3), (4, 4)])
def test_causal_mask_is_aligned_bottom_right(S_q, S_k, device):
    # Uniform scores (q = 0) and one-hot values: o[i, j] = 1 / (allowed keys of i) where allowed.
    D = 32
    q = torch.zeros(1, 1, S_q, D, device=device)
    k = torch.randn(1, 1, S_k, D, device=device)
    v = torch.zeros(1, 1, S_k, D, device=device)
    v[0, 0, torch.arange(S_k), torch.arange(S_k)] = 1.0
    o = tf.attention(q, k, v, causal=True)[0, 0, :, :S_k]
    for i in range(S_q):
        allowed = [j for j in range(S_k) if j <= i + S_k - S_q]
        expected = torch.zeros(S_k, dtype=torch.float64, device=device)
        if allowed:
            expected[allowed] = 1.0 / len(allowed)
        assert_close(o[i], expected, torch.float32)


@pytest.mark.parametrize("S_q,S_k,causal,window", [(70, 47, True, 20), (47, 70, True, 7), (70, 70, False, 7),
                                                   (33, 70, True, None), (70, 33, False, 100)])
def test_masked_and_unmasked_key_blocks_forward(S_q, S_k, causal, window, device):
    # Long enough for key blocks cut by the window edge, blocks inside the band and blocks cut by
    # the diagonal in one query block (16-wide blocks under the interpreter).
    q, k, v = _qkv(device, H=1, S_q=S_q, S_k=S_k, grad=False)
    o, lse = tf.attention(q, k, v, causal=causal, window=window, return_lse=True)
    ref_o, ref_lse = attention_reference(q.double(), k.double(), v.double(), causal=causal, window=window,
                                         return_lse=True)
    assert_close(o, ref_o, torch.float32)
    assert_close(lse, ref_lse, torch.float32)


def test_window_zero_with_causal_attends_only_the_diagonal(device):
    q, k, v = _qkv(device, S_q=9, S_k=20, grad=False)
    o = tf.attention(q, k, v, causal=True, window=0)
    assert_close(o, v[:, :, 11:].double(), torch.float32)


@pytest.mark.parametrize("window", [None, 2])
def test_fully_masked_rows_give_zero_and_minus_inf_lse(window, device):
    # S_q > S_k with causal: the first S_q - S_k queries see no key.
    q, k, v = _qkv(device, S_q=21, S_k=6)
    o, lse = tf.attention(q, k, v, causal=True, window=window, return_lse=True)
    ref_o, ref_lse = attention_reference(*_double_leaves(q, k, v), causal=True, window=window, return_lse=True)
    assert (o[:, :, :15] == 0).all() and (lse[:, :, :15] == -math.inf).all()
    assert (ref_o[:, :, :15] == 0).all() and (ref_lse[:, :, :15] == -math.inf).all()
    assert_close(o, ref_o, torch.float32)
    assert_close(lse[:, :, 15:], ref_lse[:, :, 15:], torch.float32)
    do = torch.randn_like(o)
    grads = _grads(lambda *t: tf.attention(*t, causal=True, window=window), (q, k, v), do)
    leaves = _double_leaves(q, k, v)
    ref_grads = _grads(lambda *t: attention_reference(*t, causal=True, window=window), leaves, do.double())
    assert (grads[0][:, :, :15] == 0).all()
    for g, r in zip(grads, ref_grads):
        assert_close(g, r, torch.float32, compare="norm")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_lse_is_logsumexp_of_the_scores(dtype, device):
    q, k, v = _qkv(device, H=4, H_kv=2, S_q=19, S_k=33, dtype=dtype, grad=False)
    _, lse = tf.attention(q, k, v, causal=True, scale=0.3, return_lse=True)
    assert lse.dtype == torch.float32 and lse.shape == (1, 4, 19)
    kd = k.double().repeat_interleave(2, dim=1)
    scores = (q.double() @ kd.transpose(-1, -2)) * 0.3
    i, j = torch.arange(19, device=device)[:, None], torch.arange(33, device=device)[None, :]
    scores = scores.masked_fill(j > i + 33 - 19, -math.inf)
    assert_close(lse, torch.logsumexp(scores, -1), torch.float32)


def test_empty_key_sequence_gives_zero_output(device):
    q, k, v = _qkv(device, S_q=5, S_k=0)
    o, lse = tf.attention(q, k, v, return_lse=True)
    assert (o == 0).all() and (lse == -math.inf).all()
    q, k, v = _qkv(device, S_q=0, S_k=7)
    assert tf.attention(q, k, v).shape == (1, 2, 0, 32)


def test_gqa_kv_gradients_sum_over_the_group(device):
    q, k, v = _qkv(device, H=6, H_kv=2, S_q=20, S_k=24)
    do = torch.randn(1, 6, 20, 32, device=device)
    grads = _grads(lambda *t: tf.attention(*t, causal=True), (q, k, v), do)
    # The same attention with k, v repeated per query head: its dk, dv summed over each group.
    kr, vr = (t.detach().repeat_interleave(3, dim=1).requires_grad_(True) for t in (k, v))
    _, dkr, dvr = _grads(lambda *t: tf.attention(*t, causal=True), (q, kr, vr), do)
    assert_close(grads[1], dkr.view(1, 2, 3, 24, 32).sum(2).double(), torch.float32)
    assert_close(grads[2], dvr.view(1, 2, 3, 24, 32).sum(2).double(), torch.float32)
    ref = _grads(lambda *t: attention_reference(*t, causal=True), _double_leaves(q, k, v), do.double())
    for g, r in zip(grads, ref):
        assert_close(g, r, torch.float32, compare="norm")


@pytest.mark.parametrize("parts,window", [(1, None), (2, None), (3, None), (7, None), (2, 9), (5, 9)])
def test_gqa_kv_gradients_cut_into_parts_of_the_group(device, monkeypatch, parts, window):
    """7 query heads a kv head, as Qwen2.5-0.5B has, summed in one program or in 2, 3, 5 or 7
    equal shares of the group's query blocks (shares that start and end inside a head's band,
    across its masked and unmasked blocks; a window's band too); a second call replays the
    planned launches with new data."""
    monkeypatch.setattr(attention_ops, "_dkdv_parts", lambda lay, device: parts)
    for _ in range(2):
        q, k, v = _qkv(device, B=2, H=14, H_kv=2, S_q=40, S_k=40)
        do = torch.randn_like(q)
        grads = _grads(lambda *t: tf.attention(*t, causal=True, window=window), (q, k, v), do)
        ref = _grads(lambda *t: attention_reference(*t, causal=True, window=window), _double_leaves(q, k, v),
                     do.double())
        for g, r in zip(grads, ref):
            assert_close(g, r, torch.float32, compare="norm")


@pytest.mark.parametrize("B,S_k", [(0, 8), (1, 0)])
def test_gqa_backward_of_an_empty_batch_or_key_sequence(device, B, S_k):
    q, k, v = _qkv(device, B=B, H=4, H_kv=2, S_q=8, S_k=S_k)
    grads = torch.autograd.grad(tf.attention(q, k, v), (q, k, v), torch.randn(B, 4, 8, 32, device=device))
    assert all(g.shape == t.shape and (g == 0).all() for g, t in zip(grads, (q, k, v)))


def test_gqa_parts_fill_the_gpu_only_when_kv_heads_are_too_few(monkeypatch):
    monkeypatch.setattr(runtime, "num_sms", lambda index=0: 132)

    def parts(B, H, H_kv, S):
        q, k = torch.empty(B, H, S, 64, device="meta"), torch.empty(B, H_kv, S, 64, device="meta")
        return attention_ops._dkdv_parts(attention_ops._Layout(q, k, None, 0, 0), torch.device("meta"))

    assert parts(4, 14, 2, 2048) == 2  # Qwen2.5-0.5B: 256 programs of 64 keys, two shares of 7 heads' blocks
    assert parts(4, 9, 3, 2048) == 1  # SmolLM2-135M: 384 programs
    assert parts(4, 32, 8, 4096) == 1
    assert parts(4, 16, 16, 2048) == 1  # no group to cut
    assert parts(1, 32, 1, 1024) == 16  # MQA: 16 programs, runs of 2 heads


def test_outputs_and_gradients_keep_the_bshd_layout_of_hf_projections(device):
    # q, k, v as HF hands them over: (B, H, S, D) views of (B, S, H * D) projections.
    B, S, H, H_kv, D = 2, 19, 4, 2, 32
    q, k, v = (torch.randn(B, S, n * D, device=device).view(B, S, n, D).transpose(1, 2).requires_grad_(True)
               for n in (H, H_kv, H_kv))
    o = tf.attention(q, k, v, causal=True)
    assert o.transpose(1, 2).is_contiguous()  # HF's reshape to (B, S, H * D) is then a view
    do = torch.randn(B, S, H, D, device=device).transpose(1, 2)
    grads = torch.autograd.grad(o, (q, k, v), do)
    assert all(g.transpose(1, 2).is_contiguous() for g in grads)
    ref = _grads(lambda *t: attention_reference(*t, causal=True), _double_leaves(q, k, v), do.double())
    assert_close(o, attention_reference(*(t.double() for t in (q, k, v)), causal=True), torch.float32)
    for g, r in zip(grads, ref):
        assert_close(g, r, torch.float32, compare="norm")


def test_deterministic(device):
    q, k, v = _qkv(device, H=4, H_kv=1, S_q=33, S_k=40, dtype=torch.bfloat16)
    do = torch.randn(1, 4, 33, 32, device=device).to(torch.bfloat16)
    runs = [_grads(lambda *t: tf.attention(*t, causal=True, window=20), (q, k, v), do) for _ in range(2)]
    for a, b in zip(*runs):
        assert torch.equal(a, b)


@pytest.mark.parametrize("D", [64, 128])
def test_tensor_descriptor_loads_equal_pointer_loads(D, device, monkeypatch):
    """Dense batches at head dims 64 and 128 stream their tiles through TMA descriptors (boxes set
    per config while tuning, then the chosen config's). Under the interpreter the bits must be the
    pointer path's; on a GPU each path tunes its own config, so their sums may differ in order."""
    from tritonformer.ops import attention as attn
    q, k, v = _qkv(device, H=4, H_kv=2, S_q=33, S_k=47, D=D, dtype=torch.bfloat16)
    do = torch.randn_like(q)
    lay = attn._Layout(q, k, None, 0, 0)
    assert attn._descriptors_fit(lay, "fwd", k, v) and attn._descriptors_fit(lay, "dq", k, v)
    assert attn._descriptors_fit(lay, "dkdv", q, do) == (D == 128)
    assert not attn._descriptors_fit(lay, "fwd", k[..., 1:], v)  # base not 16-byte aligned
    assert not attn._descriptors_fit(lay, "fwd", k.expand(2, -1, -1, -1), v)  # a zero stride
    # Twice: the first call tunes, the second replays the chosen config.
    with_descriptors = [_grads(lambda *t: tf.attention(*t, causal=True), (q, k, v), do) for _ in range(2)]
    monkeypatch.setattr(attn, "_descriptors_fit", lambda *a: False)
    # Fresh plan tables: the calls above planned descriptor launches for this signature.
    attn.attention_fwd.plans.clear()
    attn.attention_bwd.plans.clear()
    pointers = _grads(lambda *t: tf.attention(*t, causal=True), (q, k, v), do)
    for run in with_descriptors:
        for a, b in zip(run, pointers):
            if device == "cpu":
                assert torch.equal(a, b)
            else:
                assert_close(a, b, torch.bfloat16)


@pytest.mark.parametrize("D,varlen", [(64, False), (128, False), (32, True)])
def test_replayed_launches_see_each_calls_data(D, varlen, device):
    """The first calls of a signature tune and plan, later ones replay the plan with the new
    call's tensors (and descriptors rebased onto them): four calls on fresh data, each checked
    against the reference, outputs and gradients (the lse's too), and the replays were taken."""
    from tritonformer.ops import attention as attn
    for _ in range(4):
        if varlen:
            (q, k, v), kw = _packed(device, [5, 1, 2], [7, 3, 9], D=D, dtype=torch.bfloat16)
            do = torch.randn_like(q)
        else:
            q, k, v = _qkv(device, H=4, H_kv=2, S_q=33, S_k=40, D=D, dtype=torch.bfloat16)
            kw, do = {}, torch.randn_like(q)
        o, lse = tf.attention(q, k, v, causal=True, return_lse=True, **kw)
        dlse = torch.randn_like(lse)
        grads = torch.autograd.grad((o, lse), (q, k, v), (do, dlse))
        leaves = _double_leaves(q, k, v)
        ref_o, ref_lse = attention_reference(*leaves, causal=True, return_lse=True, **kw)
        ref_grads = torch.autograd.grad((ref_o, ref_lse), leaves, (do.double(), dlse.double()))
        assert_close(o, ref_o, torch.bfloat16, "norm")
        assert_close(lse, ref_lse, torch.bfloat16, "norm")
        for got, want in zip(grads, ref_grads):
            assert_close(got, want, torch.bfloat16, "norm")
    assert len(attn.attention_fwd.plans) == 1 and len(attn.attention_bwd.plans) == 1


def test_no_grad_returns_a_tensor_and_lse_on_request(device):
    q, k, v = _qkv(device, grad=False)
    assert isinstance(tf.attention(q, k, v), torch.Tensor)
    o, lse = tf.attention(q, k, v, return_lse=True)
    assert o.shape == q.shape and lse.shape == q.shape[:3]


def test_compiles_forward_and_backward_without_graph_break(device):
    q, k, v = _qkv(device, H=4, H_kv=2, S_q=18, S_k=21)
    fn = compile_fullgraph(lambda q, k, v: tf.attention(q * 2, k, v, causal=True))
    o = fn(q, k, v)
    do = torch.randn_like(o)
    grads = torch.autograd.grad(o, (q, k, v), do)
    leaves = _double_leaves(q, k, v)
    ref = attention_reference(leaves[0] * 2, leaves[1], leaves[2], causal=True)
    ref_grads = torch.autograd.grad(ref, leaves, do.double())
    assert_close(o, ref, torch.float32, compare="norm")
    for g, r in zip(grads, ref_grads):
        assert_close(g, r, torch.float32, compare="norm")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sinks_follow_gpt_oss_eager_attention(dtype, device):
    """GPT-OSS's eager attention, written out (the sink a column of the logits, dropped after the
    softmax): outputs and the gradients of q, k, v and the sinks; causal, with a window and rows
    that see no key (S_q > S_k), whose output is 0 and lse the sink."""
    q, k, v = _qkv(device, B=2, H=4, H_kv=2, S_q=23, S_k=15, dtype=dtype)
    sinks = (torch.randn(4, device=device) * 2).to(dtype).requires_grad_(True)
    o, lse = tf.attention(q, k, v, causal=True, window=6, return_lse=True, sinks=sinks)
    assert (o[:, :, :8] == 0).all()
    assert_close(lse[:, :, :8], sinks.double()[None, :, None].expand(2, 4, 8), torch.float32)

    def gpt_oss(q, k, v, sinks):
        s = q @ k.repeat_interleave(2, 1).transpose(-1, -2) / math.sqrt(q.shape[-1])
        s = s.masked_fill(~attention_ops.attention_mask(23, 15, True, 6, q.device), -math.inf)
        logits = torch.cat([s, sinks[None, :, None, None].expand(2, 4, 23, 1)], dim=-1)
        probs = torch.softmax(logits - logits.max(-1, keepdim=True).values, dim=-1)[..., :-1]
        return probs @ v.repeat_interleave(2, 1)

    leaves = _double_leaves(q, k, v, sinks)
    ref = gpt_oss(*leaves)
    do = torch.randn_like(o)
    grads = torch.autograd.grad(o, (q, k, v, sinks), do)
    ref_grads = torch.autograd.grad(ref, leaves, do.double())
    assert_close(o, ref, dtype, "norm")
    for got, want in zip(grads, ref_grads):
        assert_close(got, want, dtype, "norm")


def test_strided_sinks_are_read_per_head(device):
    """A (H,) view with stride 2 (every other entry of a parameter): the right sink per head in
    attention and decode_attention, and the gradient reaches the parameter's entries."""
    from tritonformer.ops.decode_attention import decode_attention, decode_attention_reference
    q, k, v = _qkv(device, B=2, H=4, H_kv=2, S_q=9, S_k=9)
    base = torch.randn(8, device=device).requires_grad_(True)
    o = tf.attention(q, k, v, causal=True, sinks=base[::2])
    leaves = _double_leaves(q, k, v, base)
    ref = attention_reference(*leaves[:3], causal=True, sinks=leaves[3][::2])
    assert_close(o, ref, torch.float32)
    do = torch.randn_like(o)
    (grad,) = torch.autograd.grad(o, base, do)
    (ref_grad,) = torch.autograd.grad(ref, leaves[3], do.double())
    assert_close(grad, ref_grad, torch.float32)
    with torch.no_grad():
        q1 = q.detach()[:, :, -1:]
        assert_close(decode_attention(q1, k.detach(), v.detach(), sinks=base.detach()[::2]),
                     decode_attention_reference(q1, k.detach(), v.detach(), sinks=base.detach()[::2]), torch.float32)


def test_softcap_caps_the_logits_as_gemma2(device):
    """Gemma 2's eager attention (scale, cap with tanh, mask, softmax): outputs and gradients,
    with q scaled so that logits pass the cap; a cap far above every logit is plain attention."""
    q, k, v = _qkv(device, H=4, H_kv=2, S_q=33, S_k=40)
    o = tf.attention(q * 4, k, v, causal=True, softcap=5.0)
    leaves = _double_leaves(q, k, v)
    s = (leaves[0] * 4) @ leaves[1].repeat_interleave(2, 1).transpose(-1, -2) / math.sqrt(32)
    assert s.abs().max() > 10  # the cap bites
    s = (5.0 * torch.tanh(s / 5.0)).masked_fill(~attention_ops.attention_mask(33, 40, True, None, q.device),
                                                -math.inf)
    ref = torch.softmax(s, -1) @ leaves[2].repeat_interleave(2, 1)
    do = torch.randn_like(o)
    grads = torch.autograd.grad(o, (q, k, v), do)
    ref_grads = torch.autograd.grad(ref, leaves, do.double())
    assert_close(o, ref, torch.float32)
    for got, want in zip(grads, ref_grads):
        assert_close(got, want, torch.float32, "norm")
    with torch.no_grad():
        assert_close(tf.attention(q, k, v, causal=True, softcap=1e6), tf.attention(q, k, v, causal=True).double(),
                     torch.float32)


def test_replayed_launches_read_each_calls_sinks(device):
    """Sinks change every training step: a replayed plan reads the new call's sinks (and their
    gradient comes out for each), with softcap on."""
    from tritonformer.ops import attention as attn
    for _ in range(3):
        q, k, v = _qkv(device, H=4, H_kv=2, S_q=20, S_k=20)
        sinks = torch.randn(4, device=device).requires_grad_(True)
        o, lse = tf.attention(q, k, v, causal=True, return_lse=True, softcap=3.0, sinks=sinks)
        do, dlse = torch.randn_like(o), torch.randn_like(lse)
        grads = torch.autograd.grad((o, lse), (q, k, v, sinks), (do, dlse))
        leaves = _double_leaves(q, k, v, sinks)
        ref_o, ref_lse = attention_reference(*leaves[:3], causal=True, return_lse=True, softcap=3.0, sinks=leaves[3])
        ref_grads = torch.autograd.grad((ref_o, ref_lse), leaves, (do.double(), dlse.double()))
        assert_close(o, ref_o, torch.float32)
        assert_close(lse, ref_lse, torch.float32)
        for got, want in zip(grads, ref_grads):
            assert_close(got, want, torch.float32, "norm")
    assert len(attn.attention_fwd.plans) == 1 and len(attn.attention_bwd.plans) == 1


def test_sinks_and_softcap_compile_without_graph_break(device):
    q, k, v = _qkv(device, H=4, H_kv=2, S_q=18, S_k=21)
    sinks = torch.randn(4, device=device).requires_grad_(True)
    fn = compile_fullgraph(lambda q, k, v, s: tf.attention(q * 2, k, v, causal=True, softcap=2.0, sinks=s))
    o = fn(q, k, v, sinks)
    do = torch.randn_like(o)
    grads = torch.autograd.grad(o, (q, k, v, sinks), do)
    leaves = _double_leaves(q, k, v, sinks)
    ref = attention_reference(leaves[0] * 2, leaves[1], leaves[2], causal=True, softcap=2.0, sinks=leaves[3])
    ref_grads = torch.autograd.grad(ref, leaves, do.double())
    assert_close(o, ref, torch.float32, compare="norm")
    for g, r in zip(grads, ref_grads):
        assert_close(g, r, torch.float32, compare="norm")


def _changed(args: dict, changes: dict) -> dict:
    """args with each named entry replaced: by fn(old) for a callable, else by the value."""
    for name, fn in changes.items():
        args[name] = fn(args[name]) if callable(fn) else fn
    return args


def _bad(**changes):
    """Arguments with `changes`; a new tensor made on the CPU (the sinks) goes to the test's device."""
    def make(device):
        q, k, v = _qkv(device, H=4, H_kv=2, grad=False)
        on_device = {name: value.to(device) if isinstance(value, torch.Tensor) and value.device.type == "cpu"
                     else value for name, value in changes.items()}
        return _changed(dict(q=q, k=k, v=v), on_device)
    return make


@pytest.mark.parametrize(
    "make,error,match",
    [
        (_bad(q=lambda t: t.double()), TypeError, "q has dtype torch.float64"),
        (_bad(k=lambda t: t.half()), TypeError, "k has dtype torch.float16 but q has"),
        (_bad(v=lambda t: t.int()), TypeError, "v has dtype torch.int32"),
        (_bad(q=lambda t: t[0]), ValueError, "q must be 4-D"),
        (_bad(k=lambda t: foreign_device_tensor()), ValueError, "k is on meta"),
        (_bad(v=lambda t: t[:, :, :5]), ValueError, "v must have k's shape"),
        (_bad(k=lambda t: t[:, :1].expand(1, 3, 17, 32), v=lambda t: t[:, :1].expand(1, 3, 17, 32)),
         ValueError, r"H % H_kv"),
        (_bad(k=lambda t: t[..., :16], v=lambda t: t[..., :16]), ValueError, "mismatched head dims"),
        (_bad(q=lambda t: t[..., :16], k=lambda t: t[..., :16], v=lambda t: t[..., :16]), ValueError,
         "q has head_dim 16"),
        (_bad(k=lambda t: t.expand(2, -1, -1, -1), v=lambda t: t.expand(2, -1, -1, -1)), ValueError, "k has batch 2"),
        (_bad(causal=1), TypeError, "causal must be a bool"),
        (_bad(scale=float("nan")), ValueError, "scale must be a positive finite float"),
        (_bad(scale="1"), ValueError, "scale must be a positive finite float"),
        (_bad(scale=-0.5), ValueError, "scale must be a positive finite float"),
        (_bad(window=-1), ValueError, "window must be None or a non-negative int"),
        (_bad(window=(3,)), ValueError, "window must be None or a non-negative int"),
        (_bad(softcap=0.0), ValueError, "softcap must be None or a positive finite float"),
        (_bad(softcap=-30.0), ValueError, "softcap must be None or a positive finite float"),
        (_bad(softcap=float("inf")), ValueError, "softcap must be None or a positive finite float"),
        (_bad(softcap=True), ValueError, "softcap must be None or a positive finite float"),
        (_bad(sinks=torch.zeros(2)), ValueError, r"sinks must have shape \(heads,\) = \(4,\)"),
        (_bad(sinks=torch.zeros(1, 4)), ValueError, r"sinks must have shape \(heads,\) = \(4,\)"),
        (_bad(sinks=torch.zeros(4, dtype=torch.int64)), TypeError, "sinks has dtype torch.int64"),
        (_bad(sinks=foreign_device_tensor()), ValueError, "sinks is on meta"),
    ],
)
def test_bad_input_is_named(make, error, match, device):
    with pytest.raises(error, match=match):
        tf.attention(**make(device))


@pytest.mark.parametrize("dtype,D", [(torch.bfloat16, 64), (torch.float16, 128), (torch.bfloat16, 256),
                                     (torch.float32, 64), (torch.float32, 256)])
def test_gpu_configs_are_pruned_to_shared_memory(dtype, D, monkeypatch):
    """Pruned to shared memory, and in 16-bit dtypes to the configs that compile without register
    spills at that head dim (_SPILL_FREE_UP_TO, from scripts/compile_check.py); fp32 to one."""
    from tritonformer import runtime
    from tritonformer.ops import attention as attention_op

    monkeypatch.setattr(runtime, "INTERPRET", False)
    args = {"q_ptr": torch.empty(1, dtype=dtype)}
    block_d = max(16, D)
    limits = attention_op._SPILL_FREE_UP_TO
    for name, configs, prune in (("fwd", attention_op._fwd_configs(), attention_op._prune_fwd),
                                 ("dkdv", attention_op._dkdv_configs(), attention_op._prune_dkdv),
                                 ("dq", attention_op._dq_configs(), attention_op._prune_dq)):
        kept = prune(configs, args, BLOCK_D=block_d)
        assert kept and all(c in configs for c in kept)
        assert all(min(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"]) >= 16 for c in configs)

        def limit(c):
            return limits.get((name, c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages), 1 << 30)

        if dtype != torch.float32:
            assert all(limit(c) >= block_d for c in kept), name
        measured = attention_op._MEASURED_BEST.get((name, block_d))
        if dtype != torch.float32 and measured:
            assert {attention_op._config_label(c) for c in kept} == set(measured), name
        if dtype == torch.float32:
            # One config, the smallest tiles: fp32 is the precision path.
            area = min(c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] for c in configs)
            assert len(kept) == 1 and kept[0].kwargs["BLOCK_M"] * kept[0].kwargs["BLOCK_N"] == area


# ---- packed variable-length batches (cu_seqlens) ----

def _cu(lens, device):
    return torch.tensor([0, *lens], device=device).cumsum(0).to(torch.int32)


def _packed(device, lens_q, lens_k, H=4, H_kv=2, D=32, dtype=torch.float32):
    q = torch.randn(sum(lens_q), H, D, device=device).to(dtype)
    k = torch.randn(sum(lens_k), H_kv, D, device=device).to(dtype)
    v = torch.randn(sum(lens_k), H_kv, D, device=device).to(dtype)
    kw = dict(cu_seqlens_q=_cu(lens_q, device), cu_seqlens_k=_cu(lens_k, device),
              max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k))
    return [t.requires_grad_(True) for t in (q, k, v)], kw


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("causal,window", [(False, None), (True, None), (True, 6)])
def test_varlen_equals_padded_calls_per_sequence(causal, window, dtype, device, monkeypatch):
    # The same kernels on the same blocks (offsets from each sequence's start): bit for bit,
    # output, lse and all three gradients (with a gradient of lse too). The dK/dV kernel's split
    # of a head group into parts depends on the batch: one part in both, the same order of sums.
    monkeypatch.setattr(attention_ops, "_dkdv_parts", lambda lay, device: 1)
    lens_q, lens_k = [18, 1, 0, 5, 33], [20, 1, 3, 0, 17]
    (q, k, v), kw = _packed(device, lens_q, lens_k, dtype=dtype)
    o, lse = tf.attention(q, k, v, causal=causal, window=window, return_lse=True, **kw)
    assert o.shape == q.shape and lse.shape == (4, sum(lens_q)) and lse.dtype == torch.float32
    do, dlse = torch.randn_like(o), torch.randn_like(lse)
    grads = torch.autograd.grad((o, lse), (q, k, v), (do, dlse))
    cq, ck = kw["cu_seqlens_q"].tolist(), kw["cu_seqlens_k"].tolist()
    for b in range(len(lens_q)):
        rq, rk = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
        leaves = [t[r].detach().transpose(0, 1)[None].requires_grad_(True) for t, r in ((q, rq), (k, rk), (v, rk))]
        o_b, lse_b = tf.attention(*leaves, causal=causal, window=window, return_lse=True)
        assert torch.equal(o[rq], o_b[0].transpose(0, 1)) and torch.equal(lse[:, rq], lse_b[0])
        if lens_q[b] and lens_k[b]:
            g_b = torch.autograd.grad((o_b, lse_b), leaves, (do[rq].transpose(0, 1)[None], dlse[:, rq][None]))
            for g, gb, r in zip(grads, g_b, (rq, rk, rk)):
                assert torch.equal(g[r], gb[0].transpose(0, 1))
        else:
            assert (grads[0][rq] == 0).all() and (grads[1][rk] == 0).all() and (grads[2][rk] == 0).all()


def test_varlen_strided_packed_inputs_and_loose_max_seqlen(device):
    # q, k, v as views of one (total, 3, H, D) qkv buffer (flash-attn's packed qkv), and
    # max_seqlen larger than any sequence (extra blocks exit at once).
    lens = [9, 1, 26, 0, 14]
    qkv = torch.randn(sum(lens), 3, 2, 64, device=device, requires_grad=True)
    q, k, v = qkv.unbind(1)
    kw = dict(cu_seqlens_q=_cu(lens, device), cu_seqlens_k=_cu(lens, device), max_seqlen_q=40, max_seqlen_k=50)
    o = tf.attention(q, k, v, causal=True, **kw)
    do = torch.randn_like(o)
    (g,) = torch.autograd.grad(o, qkv, do)
    leaf = qkv.detach().double().requires_grad_(True)
    ref = attention_reference(*leaf.unbind(1), causal=True, **kw)
    (ref_g,) = torch.autograd.grad(ref, leaf, do.double())
    assert_close(o, ref, torch.float32)
    assert_close(g, ref_g, torch.float32, compare="norm")


def test_varlen_empty_batch_and_no_grad(device):
    (q, k, v), kw = _packed(device, [3, 4], [5, 2])
    with torch.no_grad():
        assert tf.attention(q, k, v, **kw).shape == q.shape
    q0, k0 = q[:0].detach(), k[:0].detach()
    cu = torch.zeros(1, dtype=torch.int32, device=device)
    o, lse = tf.attention(q0, k0, k0, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=0, max_seqlen_k=0,
                          return_lse=True)
    assert o.shape == (0, 4, 32) and lse.shape == (4, 0)


def test_varlen_compiles_forward_and_backward_without_graph_break(device):
    (q, k, v), kw = _packed(device, [7, 1, 0, 19], [12, 1, 2, 19])
    fn = compile_fullgraph(lambda q, k, v, cq, ck: tf.attention(
        q * 2, k, v, causal=True, window=5, return_lse=True, cu_seqlens_q=cq, cu_seqlens_k=ck,
        max_seqlen_q=kw["max_seqlen_q"], max_seqlen_k=kw["max_seqlen_k"]))
    o, lse = fn(q, k, v, kw["cu_seqlens_q"], kw["cu_seqlens_k"])
    do = torch.randn_like(o)
    grads = torch.autograd.grad(o, (q, k, v), do)
    leaves = _double_leaves(q, k, v)
    ref, ref_lse = attention_reference(leaves[0] * 2, leaves[1], leaves[2], causal=True, window=5,
                                       return_lse=True, **kw)
    ref_grads = torch.autograd.grad(ref, leaves, do.double())
    assert_close(o, ref, torch.float32, compare="norm")
    assert torch.equal(lse.isinf(), ref_lse.isinf())
    for g, r in zip(grads, ref_grads):
        assert_close(g, r, torch.float32, compare="norm")


def test_varlen_values_are_checked_again_after_an_in_place_change(device):
    (q, k, v), kw = _packed(device, [3, 5], [4, 6])
    tf.attention(q, k, v, **kw)
    kw["cu_seqlens_q"][-1] += 1
    with pytest.raises(ValueError, match=r"cu_seqlens_q\[-1\] is 9 but q has 8 rows"):
        tf.attention(q, k, v, **kw)


def _bad_varlen(**changes):
    def make(device):
        (q, k, v), kw = _packed(device, [3, 5], [4, 6])
        return _changed(dict(q=q.detach(), k=k.detach(), v=v.detach(), **kw), changes)
    return make


@pytest.mark.parametrize(
    "make,error,match",
    [
        (_bad_varlen(cu_seqlens_q=lambda t: t.long()), TypeError, "cu_seqlens_q must be int32"),
        (_bad_varlen(cu_seqlens_k=lambda t: t[None]), ValueError, r"cu_seqlens_k must be 1-D"),
        (_bad_varlen(cu_seqlens_k=None), ValueError, "cu_seqlens_k is None"),
        (_bad_varlen(cu_seqlens_q=[0, 3, 8]), TypeError, "cu_seqlens_q must be a torch.Tensor"),
        (_bad_varlen(cu_seqlens_q=lambda t: t.to("meta")), ValueError, "cu_seqlens_q is on meta"),
        (_bad_varlen(cu_seqlens_k=lambda t: t[:2]), ValueError, "batch sizes differ"),
        (_bad_varlen(cu_seqlens_q=lambda t: t + torch.tensor([0, 0, 1], dtype=torch.int32, device=t.device)), ValueError,
         r"cu_seqlens_q\[-1\] is 9 but q has 8 rows"),
        (_bad_varlen(cu_seqlens_k=lambda t: torch.tensor([0, 7, 10], dtype=torch.int32, device=t.device)), ValueError,
         r"cu_seqlens_k\[-1\] is 10 but k has 10 rows|max_seqlen_k is 6"),
        (_bad_varlen(cu_seqlens_k=lambda t: torch.tensor([1, 4, 10], dtype=torch.int32, device=t.device)), ValueError,
         "cu_seqlens_k must start at 0 and not decrease"),
        (_bad_varlen(cu_seqlens_q=lambda t: torch.tensor([0, 9, 8], dtype=torch.int32, device=t.device)), ValueError,
         "cu_seqlens_q must start at 0 and not decrease"),
        (_bad_varlen(max_seqlen_q=4), ValueError, "max_seqlen_q is 4 but a sequence of cu_seqlens_q has 5 rows"),
        (_bad_varlen(max_seqlen_k=None), ValueError, "max_seqlen_k must be a non-negative int"),
        (_bad_varlen(max_seqlen_q=-1), ValueError, "max_seqlen_q must be a non-negative int"),
        (_bad_varlen(q=lambda t: t[None]), ValueError, r"q must be 3-D \(total, heads, head_dim\)"),
    ],
)
def test_varlen_bad_input_is_named(make, error, match, device):
    with pytest.raises(error, match=match):
        tf.attention(**make(device))


def test_max_seqlen_without_cu_seqlens_is_an_error(device):
    q, k, v = _qkv(device, grad=False)
    with pytest.raises(ValueError, match="max_seqlen_q is given without cu_seqlens"):
        tf.attention(q, k, v, max_seqlen_q=17)


# ---- HuggingFace's attention interface (tritonformer.nn.attention_forward) ----

class _HFAttentionModule(torch.nn.Module):
    def __init__(self, is_causal=True):
        super().__init__()
        self.is_causal = is_causal


@pytest.mark.parametrize("is_causal,kwargs", [(True, {}), (False, {}), (True, {"is_causal": False})])
def test_hf_interface_returns_batch_seq_heads_dim(is_causal, kwargs, device):
    q, k, v = _qkv(device, B=2, H=4, H_kv=2, S_q=9, S_k=13, grad=False)
    out, weights = tf.nn.attention_forward(_HFAttentionModule(is_causal), q, k, v, None, scaling=0.2, **kwargs)
    causal = kwargs.get("is_causal", is_causal)
    expected = attention_reference(q.double(), k.double(), v.double(), causal=causal, scale=0.2)
    assert weights is None and out.shape == (2, 9, 4, 32)
    assert_close(out, expected.transpose(1, 2), torch.float32)


def test_hf_interface_sliding_window_counts_the_query_itself(device):
    q, k, v = _qkv(device, S_q=20, grad=False)
    out, _ = tf.nn.attention_forward(_HFAttentionModule(), q, k, v, None, sliding_window=4)
    expected = attention_reference(q.double(), k.double(), v.double(), causal=True, window=3)
    assert_close(out, expected.transpose(1, 2), torch.float32)


def test_hf_interface_packed_batch_runs_varlen(device):
    lens = [5, 1, 11]
    (q, k, v), kw = _packed(device, lens, lens)
    hf_kwargs = dict(cu_seq_lens_q=kw["cu_seqlens_q"], cu_seq_lens_k=kw["cu_seqlens_k"],
                     max_length_q=kw["max_seqlen_q"], max_length_k=kw["max_seqlen_k"])
    as_hf = [t.detach().transpose(0, 1)[None] for t in (q, k, v)]  # (1, H, total, D)
    out, _ = tf.nn.attention_forward(_HFAttentionModule(), *as_hf, None, **hf_kwargs)
    expected = tf.attention(q.detach(), k.detach(), v.detach(), causal=True, **kw)
    assert out.shape == (1, sum(lens), 4, 32)
    assert torch.equal(out[0], expected)


def test_hf_interface_padding_mask_goes_through_sdpa(device):
    q, k, v = _qkv(device, B=2, H=2, S_q=6, grad=False)
    keep = torch.ones(2, 6, dtype=torch.bool, device=device)
    keep[1, :2] = False  # left padding of the second sequence
    mask = torch.ones(6, 6, dtype=torch.bool, device=device).tril()[None, None] & keep[:, None, None, :]
    mask[1, :, :2] = True  # padded queries attend something, as HF's masks arrange
    out, _ = tf.nn.attention_forward(_HFAttentionModule(), q, k, v, mask)
    expected = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask)
    assert_close(out, expected.transpose(1, 2), torch.float32)


@pytest.mark.parametrize("S_q,masked", [(12, False), (12, True), (2, False)])
def test_hf_interface_takes_softcap_and_sinks(S_q, masked, device):
    """Gemma 2's softcap= and GPT-OSS's s_aux= reach the kernels: a plain batch (attention), one
    under a padding mask (the torch path, as SDPA takes neither) and decode-shaped queries
    (decode_attention), each against attention_reference."""
    q, k, v = _qkv(device, B=2, H=4, H_kv=2, S_q=S_q, S_k=12, grad=False)
    q = q * 3
    sinks = torch.randn(4, device=device)
    mask, keep = None, torch.ones(2, 12, dtype=torch.bool, device=device)
    if masked:
        keep[1, :3] = False
        mask = torch.ones(12, 12, dtype=torch.bool, device=device).tril()[None, None] & keep[:, None, None, :]
    out, _ = tf.nn.attention_forward(_HFAttentionModule(), q, k, v, mask, softcap=2.0, s_aux=sinks)
    if masked:  # the padded sequence as attention() sees it without its padding; padded queries see nothing
        for b, first in ((0, 0), (1, 3)):
            expected = attention_reference(q[b:b + 1, :, first:].double(), k[b:b + 1, :, first:].double(),
                                           v[b:b + 1, :, first:].double(), causal=True, softcap=2.0, sinks=sinks)
            assert_close(out[b:b + 1, first:], expected.transpose(1, 2), torch.float32)
        assert torch.equal(out[1, :3], torch.zeros_like(out[1, :3]))
        return
    expected = attention_reference(q.double(), k.double(), v.double(), causal=True, softcap=2.0, sinks=sinks)
    assert_close(out, expected.transpose(1, 2), torch.float32)


def test_hf_interface_rejects_dropout(device):
    q, k, v = _qkv(device, grad=False)
    with pytest.raises(ValueError, match="dropout=0.1 is not supported"):
        tf.nn.attention_forward(_HFAttentionModule(), q, k, v, None, dropout=0.1)


class _AlwaysChosen(dict):
    """A TunedLauncher's `chosen` table that answers one config for every key."""

    def __init__(self, config):
        super().__init__()
        self.config = config

    def get(self, key, default=None):
        return self.config


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("kernel", ["fwd", "dkdv", "dq"])
def test_every_gpu_config_matches_the_reference(kernel, D, device):
    """Autotuning checks only the winner at the test shapes: force each pruned config in turn."""
    if device == "cpu":
        pytest.skip("the interpreter has a single config")
    from tritonformer.ops import attention as attention_op

    launcher, configs, prune = {
        "fwd": (attention_op._launch_fwd, attention_op._fwd_configs(), attention_op._prune_fwd),
        "dkdv": (attention_op._launch_dkdv, attention_op._dkdv_configs(), attention_op._prune_dkdv),
        "dq": (attention_op._launch_dq, attention_op._dq_configs(), attention_op._prune_dq),
    }[kernel]
    q, k, v = _qkv(device, B=2, H=4, H_kv=2, S_q=300, S_k=333, D=D, dtype=torch.bfloat16)
    do = torch.randn_like(q)
    leaves = _double_leaves(q, k, v)
    ref = attention_reference(*leaves, causal=True, window=200)
    ref_grads = torch.autograd.grad(ref, leaves, do.double())
    kept = prune(configs, {"q_ptr": q}, BLOCK_D=D)
    assert kept
    saved = launcher.chosen
    try:
        for config in kept:
            launcher.chosen = _AlwaysChosen(config.all_kwargs())
            # A call of a signature seen before replays its planned launches, of another config.
            attention_op.attention_fwd.plans.clear()
            attention_op.attention_bwd.plans.clear()
            o = tf.attention(q, k, v, causal=True, window=200)
            grads = torch.autograd.grad(o, (q, k, v), do)
            for got, want in zip((o, *grads), (ref, *ref_grads)):
                assert_close(got, want, torch.bfloat16, compare="norm")
    finally:
        launcher.chosen = saved
