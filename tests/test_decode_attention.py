"""decode_attention: the last 1..16 tokens of each sequence against a KV cache, against the
float64 reference (ragged lengths, GQA, windows, splits, strided caches, every dtype)."""

import pytest
import torch

import tritonformer
from tritonformer import runtime
from tritonformer.ops.attention import attention
from tritonformer.ops.decode_attention import (MAX_SPLITS, decode_attention, decode_attention_reference,
                                               default_splits)
from tritonformer.testing import assert_close

from conftest import gpu_only


def _inputs(device, dtype, B=2, H=4, H_kv=2, S_q=1, S_max=40, D=32, lens=None):
    q = torch.randn(B, H, S_q, D, device=device).to(dtype)
    k = torch.randn(B, H_kv, S_max, D, device=device).to(dtype)
    v = torch.randn(B, H_kv, S_max, D, device=device).to(dtype)
    seq_lens = None if lens is None else torch.tensor(lens, dtype=torch.int32, device=device)
    return q, k, v, seq_lens


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("splits", [1, 3])
def test_ragged_batch_matches_the_reference(device, dtype, splits):
    # 200 keys: several splits also with the GPU's 64-key blocks.
    q, k, v, lens = _inputs(device, dtype, B=3, H=6, H_kv=2, S_q=2, S_max=200, lens=[200, 77, 2])
    out = decode_attention(q, k, v, lens, num_splits=splits)
    assert out.shape == q.shape and out.dtype == dtype
    assert out.transpose(1, 2).is_contiguous()  # laid out (B, S_q, H, D), as HF reshapes it
    # 16-bit P enters the P.V dot rounded, as in attention: a reduction, compared norm-wise.
    assert_close(out, decode_attention_reference(q, k, v, lens), dtype,
                 "elementwise" if dtype == torch.float32 else "norm")


@pytest.mark.parametrize("S_q", [1, 4, 16])
@pytest.mark.parametrize("window", [None, 0, 9])
def test_query_tokens_and_windows(device, S_q, window):
    q, k, v, lens = _inputs(device, torch.float32, B=2, H=4, H_kv=1, S_q=S_q, S_max=150, lens=[150, 30])
    out = decode_attention(q, k, v, lens, window=window, num_splits=2)
    assert_close(out, decode_attention_reference(q, k, v, lens, window=window), torch.float32)


def test_equals_attention_on_a_full_cache(device):
    """Without seq_lens every sequence fills the cache: attention()'s bottom-right causal mask."""
    q, k, v, _ = _inputs(device, torch.float32, B=2, H=8, H_kv=2, S_q=3, S_max=37, D=64)
    out = decode_attention(q, k, v, num_splits=4)
    assert_close(out, attention(q, k, v, causal=True).double(), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("splits", [1, 3])
def test_softcap_and_sinks_equal_attentions(device, dtype, splits):
    """Gemma 2's softcap and GPT-OSS's sinks: against the float64 reference on a ragged batch
    (a sequence shorter than its queries: its first rows see only the sink and give 0), and on
    a full cache equal to attention() with the same arguments; sinks added once over splits."""
    q, k, v, lens = _inputs(device, dtype, B=3, H=6, H_kv=2, S_q=3, S_max=120, lens=[120, 50, 2])
    q = q * 3  # logits past the cap
    sinks = (torch.randn(6, device=device) * 2).to(dtype)
    compare = "elementwise" if dtype == torch.float32 else "norm"
    for softcap, sink in ((2.0, None), (None, sinks), (3.0, sinks)):
        out = decode_attention(q, k, v, lens, window=40, num_splits=splits, softcap=softcap, sinks=sink)
        assert_close(out, decode_attention_reference(q, k, v, lens, window=40, softcap=softcap, sinks=sink), dtype,
                     compare)
        full = decode_attention(q, k, v, num_splits=splits, softcap=softcap, sinks=sink)
        # Two float32 kernels, each off the float64 reference by its own sums: compared norm-wise.
        assert_close(full, attention(q, k, v, causal=True, softcap=softcap, sinks=sink).double(), dtype, "norm")
    assert torch.equal(out[2, :, 0], torch.zeros_like(out[2, :, 0]))


def test_short_sequences_and_empty_rows(device):
    """A sequence shorter than its queries: rows before its first key see nothing and give 0."""
    q, k, v, lens = _inputs(device, torch.float32, B=3, S_q=4, S_max=20, lens=[2, 0, 25])
    out = decode_attention(q, k, v, lens, num_splits=2)
    ref = decode_attention_reference(q, k, v, lens)
    assert_close(out, ref, torch.float32)
    assert torch.equal(out[1], torch.zeros_like(out[1])) and torch.equal(out[0, :, :2], torch.zeros_like(out[0, :, :2]))


def test_strided_cache_and_query(device):
    """A cache slot of a larger buffer (B, H_kv, S_max, D) viewed from (S_max, B, H_kv, D), a
    query transposed from (B, S_q, H, D): strides go to the kernel."""
    B, H, H_kv, S_q, S_max, D = 2, 4, 2, 2, 33, 32
    k = torch.randn(S_max, B, H_kv, D, device=device).permute(1, 2, 0, 3)
    v = torch.randn(B, H_kv, S_max, 2 * D, device=device)[..., ::2]
    q = torch.randn(B, S_q, H, D, device=device).transpose(1, 2)
    lens = torch.tensor([33, 21], dtype=torch.int32, device=device)
    out = decode_attention(q, k, v, lens, num_splits=3)
    assert_close(out, decode_attention_reference(q, k, v, lens), torch.float32)


def test_many_query_heads_a_kv_head_take_several_row_blocks(device):
    """48 query heads on one KV head, 16 queries each: 768 rows, more than one program's tile."""
    q, k, v, lens = _inputs(device, torch.float32, B=1, H=48, H_kv=1, S_q=16, S_max=40, lens=[37])
    assert_close(decode_attention(q, k, v, lens, num_splits=2), decode_attention_reference(q, k, v, lens),
                 torch.float32)


def test_strided_lengths(device):
    q, k, v, _ = _inputs(device, torch.float32, B=3, S_max=40)
    lens = torch.tensor([[40, 1], [5, 2], [23, 3]], dtype=torch.int32, device=device)[:, 0]
    assert lens.stride(0) == 2
    assert_close(decode_attention(q, k, v, lens), decode_attention_reference(q, k, v, lens), torch.float32)


def test_replayed_launches_see_each_calls_data(device):
    runtime.clear_plans()
    for _ in range(3):
        q, k, v, lens = _inputs(device, torch.float32, lens=[40, 11])
        assert_close(decode_attention(q, k, v, lens, num_splits=2), decode_attention_reference(q, k, v, lens),
                     torch.float32)
    q, k, v, lens = _inputs(device, torch.float32, lens=[40, 11])
    lens.copy_(torch.tensor([7, 40], dtype=torch.int32))  # new lengths in the same tensor: read on the device
    assert_close(decode_attention(q, k, v, lens, num_splits=2), decode_attention_reference(q, k, v, lens),
                 torch.float32)


def test_split_count_fills_the_gpu_within_bounds():
    from tritonformer.ops.decode_attention import MIN_SPLIT, PROGRAMS_PER_SM

    target = PROGRAMS_PER_SM * runtime.num_sms(0)
    assert default_splits(64, 8, MIN_SPLIT) == 1  # a cache of one split's keys: one launch
    assert default_splits(4 * target, 1, 1 << 20) == 1  # the batch alone fills the GPU
    for B, H_kv, S in ((1, 8, 4096), (1, 1, 1 << 20), (2, 4, 1000), (1, 2, 300)):
        splits = default_splits(B, H_kv, S)
        assert 1 <= splits <= min(MAX_SPLITS, runtime.cdiv(S, MIN_SPLIT))
        # Enough programs, unless the splits would get shorter than MIN_SPLIT keys or too many.
        assert B * H_kv * splits >= target or splits in (runtime.cdiv(S, MIN_SPLIT), MAX_SPLITS)


def test_is_exported_and_compiles_without_graph_breaks(device):
    q, k, v, lens = _inputs(device, torch.float32, lens=[40, 5])
    assert tritonformer.decode_attention is decode_attention
    compiled = torch.compile(lambda *a: decode_attention(*a, num_splits=2), fullgraph=True, backend="aot_eager")
    assert_close(compiled(q, k, v, lens), decode_attention_reference(q, k, v, lens), torch.float32)


@pytest.mark.parametrize("make, error, match", [
    (lambda d: _inputs(d, torch.float32, S_q=17), ValueError, "1 to 16"),
    (lambda d: _inputs(d, torch.float32, D=48), ValueError, "head dim 48"),
    (lambda d: _inputs(d, torch.float32, H=3, H_kv=2), ValueError, "multiple"),
    (lambda d: (*_inputs(d, torch.float32)[:3], torch.tensor([3, 4], device=d)), TypeError, "seq_lens has dtype"),
    (lambda d: (*_inputs(d, torch.float32)[:3], torch.tensor([3], dtype=torch.int32, device=d)), ValueError,
     r"seq_lens must have shape \(2,\)"),
    (lambda d: (*_inputs(d, torch.float32)[:2], _inputs(d, torch.bfloat16)[2], None), TypeError, "share a dtype"),
    (lambda d: (_inputs(d, torch.float32)[0], *_inputs(d, torch.float32, S_max=8)[1:2], _inputs(d, torch.float32)[2],
                None), ValueError, "must have shape"),
    (lambda d: (_inputs(d, torch.float32)[0].requires_grad_(), *_inputs(d, torch.float32)[1:]), ValueError,
     "q requires grad"),
])
def test_bad_input_is_named(device, make, error, match):
    with pytest.raises(error, match=match):
        decode_attention(*make(device))


def test_bad_options_are_named(device):
    q, k, v, lens = _inputs(device, torch.float32)
    with pytest.raises(ValueError, match="window"):
        decode_attention(q, k, v, lens, window=-1)
    with pytest.raises(ValueError, match="window"):
        decode_attention(q, k, v, lens, window=True)
    with pytest.raises(ValueError, match="num_splits"):
        decode_attention(q, k, v, lens, num_splits=MAX_SPLITS + 1)
    with pytest.raises(ValueError, match="scale"):
        decode_attention(q, k, v, lens, scale=float("nan"))
    with pytest.raises(ValueError, match="softcap"):
        decode_attention(q, k, v, lens, softcap=0.0)
    with pytest.raises(ValueError, match=r"sinks must have shape \(heads,\) = \(4,\)"):
        decode_attention(q, k, v, lens, sinks=torch.zeros(2, device=device))


@gpu_only
@pytest.mark.parametrize("D", [64, 128, 256])
def test_long_cache_in_bf16_on_the_gpu(D):
    q, k, v, lens = _inputs("cuda", torch.bfloat16, B=4, H=32, H_kv=8, S_q=1, S_max=8192, D=D,
                            lens=[8192, 5000, 1, 777])
    out = decode_attention(q, k, v, lens)
    assert_close(out, decode_attention_reference(q, k, v, lens), torch.bfloat16, "norm")
    sinks = torch.randn(32, device="cuda")
    out = decode_attention(q, k, v, lens, softcap=2.0, sinks=sinks)
    assert_close(out, decode_attention_reference(q, k, v, lens, softcap=2.0, sinks=sinks), torch.bfloat16, "norm")


@gpu_only
def test_a_cache_past_2_to_the_31_elements():
    """The last sequence of this cache starts past 2^31 elements: its offsets need 64 bits."""
    B, S_max, D = 5, 1 << 21, 256
    k = torch.randn(B, 1, S_max, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(B, 1, S_max, D, device="cuda", dtype=torch.bfloat16)
    q = torch.randn(B, 2, 1, D, device="cuda", dtype=torch.bfloat16)
    lens = torch.tensor([1, 3, 1, 2, 100], dtype=torch.int32, device="cuda")
    assert k[B - 1].storage_offset() >= 2**31
    out = decode_attention(q, k, v, lens)
    assert_close(out, decode_attention_reference(q, k, v, lens), torch.bfloat16, "norm")
