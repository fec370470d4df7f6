"""tritonformer.generate against HF's generate: the same tokens (fp32 greedy, ragged batches,
eos and padding), the same sampling distribution, HF's argmax within bf16 tolerance, and a
patched model's generate taking our path only for the arguments it implements."""

import copy
import math

import pytest
import torch

import tritonformer.nn
from tritonformer import decoding, runtime
from tritonformer.integrations import hf

from conftest import gpu_only
from helpers import fresh_launchers, reference_attention

transformers = pytest.importorskip("transformers")

VOCAB = 128
# Each family's config class and what its tiny model sets beyond the common sizes: Mistral, Mixtral
# and the Gemmas a window shorter than the prompt plus its new tokens (Gemma 2 and 3 on alternate
# layers); the mixtures of experts few small experts (Qwen2-MoE a shared one too); Gemma 2 caps low
# enough to bite on a tiny model's logits.
CONFIGS = {
    "llama": ("LlamaConfig", {}), "mistral": ("MistralConfig", dict(sliding_window=9)),
    "qwen2": ("Qwen2Config", {}), "qwen3": ("Qwen3Config", {}),
    "qwen3_moe": ("Qwen3MoeConfig", dict(moe_intermediate_size=48, num_experts=6, num_experts_per_tok=2,
                                         norm_topk_prob=True)),
    "qwen2_moe": ("Qwen2MoeConfig", dict(moe_intermediate_size=48, shared_expert_intermediate_size=64, num_experts=6,
                                         num_experts_per_tok=2)),
    "mixtral": ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=9)),
    "olmoe": ("OlmoeConfig", dict(num_experts=6, num_experts_per_tok=3)),
    "gemma": ("GemmaConfig", {}),
    "gemma2": ("Gemma2Config", dict(sliding_window=9, attn_logit_softcapping=0.5, final_logit_softcapping=0.3)),
    "gemma3_text": ("Gemma3TextConfig", dict(sliding_window=9, layer_types=["sliding_attention", "full_attention"])),
}


def _model(family="llama", dtype=torch.float32, device="cpu", **overrides):
    # Head dim 32: the smallest decode_attention takes (4 heads of it: OLMoE normalises q and k over
    # the hidden size).
    name, extra = CONFIGS[family]
    sizes = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, head_dim=32, **extra)
    sizes.update(overrides)
    config = getattr(transformers, name)(**sizes)
    return transformers.AutoModelForCausalLM.from_config(config, **reference_attention(family)).to(
        device=device, dtype=dtype).eval()


def _ragged_prompt(device, lengths=(11, 7, 11, 3), pad=0):
    """Left-padded prompts of the given lengths: (input_ids, attention_mask)."""
    P = max(lengths)
    ids = torch.randint(1, VOCAB, (len(lengths), P), device=device)
    mask = torch.ones_like(ids)
    for b, n in enumerate(lengths):
        ids[b, :P - n] = pad
        mask[b, :P - n] = 0
    return ids, mask


def _hf_generate(model, ids, mask, **kwargs):
    return model.generate(ids, attention_mask=mask, do_sample=False, **kwargs)


@pytest.mark.parametrize("family", list(CONFIGS))
def test_greedy_tokens_are_hfs_with_padding_and_eos(family, device):
    """A ragged batch: HF's tokens exactly, and with an eos that some sequences reach (padded after
    it, the output as long as HF's) HF's too; the mixtures of experts run their MLP as the model's
    own module."""
    model = _model(family, device=device)
    ids, mask = _ragged_prompt(device, lengths=(11, 7, 3))
    free = _hf_generate(model, ids, mask, max_new_tokens=8, eos_token_id=None, pad_token_id=0)
    ours = decoding.generate(model, ids, mask, max_new_tokens=8, pad_token_id=0)
    assert torch.equal(ours, free)
    # An eos the first sequence makes at its 4th new token: it stops there, the others may too.
    eos = int(free[0, ids.shape[1] + 3])
    expected = _hf_generate(model, ids, mask, max_new_tokens=8, eos_token_id=eos, pad_token_id=VOCAB - 1)
    ours = decoding.generate(model, ids, mask, max_new_tokens=8, eos_token_id=eos, pad_token_id=VOCAB - 1)
    assert ours.shape == expected.shape and torch.equal(ours, expected)
    assert (ours[0, ids.shape[1] + 4:] == VOCAB - 1).all()


# One family for each thing around the fused products: Qwen2's biases, Qwen3's per-head q/k norms,
# Gemma 2's (1 + weight) norms and sandwich, OLMoE's clip and whole-projection norms (and MoE).
@pytest.mark.parametrize("family", ["qwen2", "qwen3", "gemma2", "olmoe"])
def test_greedy_tokens_at_batch_1_are_hfs(family, device):
    """Batch 1 takes the norms and residual adds inside decode_linear's launches: HF's tokens."""
    model = _model(family, device=device)
    ids = torch.randint(1, VOCAB, (1, 7), device=device)
    expected = _hf_generate(model, ids, None, max_new_tokens=6, eos_token_id=None)
    assert torch.equal(decoding.generate(model, ids, max_new_tokens=6), expected)


def test_greedy_64_tokens_at_batch_1(device):
    model = _model("llama", device=device)
    ids = torch.randint(0, VOCAB, (1, 9), device=device)
    expected = _hf_generate(model, ids, None, max_new_tokens=64, eos_token_id=None)
    assert torch.equal(decoding.generate(model, ids, max_new_tokens=64), expected)


def test_all_sequences_ending_stops_early(device):
    """Every sequence reaches the eos: the output ends at the step the last one did, as HF's."""
    model = _model("qwen2", device=device)
    ids, mask = _ragged_prompt(device, lengths=(5, 8))
    free = _hf_generate(model, ids, mask, max_new_tokens=40, eos_token_id=None, pad_token_id=0)
    new = free[:, ids.shape[1]:]
    # Each sequence's token at a step of its own (one might make the other's earlier: either way
    # both stop before 40 tokens).
    eos = [int(new[0, 9]), int(new[1, 14])]
    expected = _hf_generate(model, ids, mask, max_new_tokens=40, eos_token_id=eos, pad_token_id=0)
    ours = decoding.generate(model, ids, mask, max_new_tokens=40, eos_token_id=eos, pad_token_id=0)
    assert expected.shape[1] < free.shape[1]
    assert torch.equal(ours, expected)


@gpu_only
def test_cuda_graph_replays_give_the_eager_steps_tokens(device):
    model = _model("qwen3", device=device, dtype=torch.bfloat16)
    ids, mask = _ragged_prompt(device)
    graphed = decoding.generate(model, ids, mask, max_new_tokens=40)
    assert decoding.DECODERS[model][1].graph is not None
    eager = decoding.generate(model, ids, mask, max_new_tokens=40, cuda_graph=False)
    assert torch.equal(graphed, eager)
    # A second call replays the kept graph on the new prompt.
    ids2, mask2 = _ragged_prompt(device, lengths=(2, 11, 9, 6))
    assert torch.equal(decoding.generate(model, ids2, mask2, max_new_tokens=40),
                       decoding.generate(model, ids2, mask2, max_new_tokens=40, cuda_graph=False))


@pytest.mark.parametrize("lengths", [(10, 6), (10,)])
def test_bf16_tokens_are_hfs_argmax_within_tolerance(device, lengths):
    """bf16: at every new position, our token's logit in HF's teacher-forced forward of the same
    sequence is within bf16 rounding of HF's largest (batch 1: the norms inside the products)."""
    model = _model("llama", dtype=torch.bfloat16, device=device)
    ids, mask = _ragged_prompt(device, lengths=lengths)
    _assert_hfs_argmax_within_tolerance(model, ids, mask, decoding.generate(model, ids, mask, max_new_tokens=24))


def _record_launches(monkeypatch, *names):
    """Patch decoding's product functions `names` to record (name, x's type) at each call of the
    step itself (the warm-up thread's compile-only step runs the same calls): the list."""
    launches = []
    for name in names:
        def launch(x, *args, _name=name, _original=getattr(decoding, name), **kwargs):
            if not runtime.compiling_ahead():
                launches.append((_name, type(x).__name__))
            return _original(x, *args, **kwargs)
        monkeypatch.setattr(decoding, name, launch)
    return launches


def _randomize_norms(model):
    """RMSNorm weights off their initial ones, so that a norm applied where another belongs shows."""
    for name, parameter in model.named_parameters():
        if name.endswith("norm.weight"):
            parameter.data.uniform_(0.5, 1.5)


def _assert_hfs_argmax_within_tolerance(model, ids, mask, ours):
    """At every new position of ours, our token's logit in the model's teacher-forced forward is
    within bf16 rounding of the largest."""
    full_mask = torch.cat([mask, torch.ones_like(ours[:, ids.shape[1]:])], dim=1)
    positions = (full_mask.cumsum(1) - 1).clamp_(min=0)
    logits = model(input_ids=ours, attention_mask=full_mask, position_ids=positions).logits.float()
    P = ids.shape[1]
    picked = logits[:, P - 1:-1].gather(2, ours[:, P:, None])[..., 0]
    best = logits[:, P - 1:-1].max(dim=2).values
    scale = logits.abs().amax()
    assert (best - picked <= 0.02 * scale).all(), (best - picked).max()


def _hf_probabilities(logits, temperature, top_k, top_p):
    from transformers.generation.logits_process import (LogitsProcessorList, TemperatureLogitsWarper,
                                                        TopKLogitsWarper, TopPLogitsWarper)
    warpers = LogitsProcessorList([TemperatureLogitsWarper(temperature)])
    if top_k:
        warpers.append(TopKLogitsWarper(top_k))
    if top_p is not None:
        warpers.append(TopPLogitsWarper(top_p))
    return warpers(None, logits.clone()).softmax(dim=-1)


def _chi_square_bound(df: int, z: float = 4.26) -> float:
    """Wilson-Hilferty's chi-square quantile for df degrees of freedom at z standard deviations
    (4.26: a false failure in 1e5)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


@pytest.mark.parametrize("temperature, top_k, top_p", [(0.7, 6, 0.9), (1.0, None, 0.6), (1.4, 3, None), (1.0, None, None)])
def test_sampling_draws_hfs_distribution(device, temperature, top_k, top_p):
    logits = torch.randn(1, 12, device=device, dtype=torch.float32) * 2
    draws = 40000
    sampling = decoding.Sampling(True, temperature, top_k, top_p)
    tokens = sampling.pick(logits.expand(draws, -1).contiguous())
    counts = torch.bincount(tokens, minlength=12).double().cpu()
    probs = _hf_probabilities(logits, temperature, top_k, top_p)[0].double().cpu()
    assert counts[probs == 0].sum() == 0, "a token HF's processors remove was drawn"
    kept = probs > 0
    if kept.sum() == 1:
        assert counts[kept].item() == draws
        return
    expected = probs[kept] * draws
    chi2 = ((counts[kept] - expected) ** 2 / expected).sum().item()
    assert chi2 < _chi_square_bound(int(kept.sum()) - 1), chi2


def test_sampling_reproducible_from_the_seed(device):
    model = _model("qwen3", device=device)
    ids, mask = _ragged_prompt(device, lengths=(4, 7))
    outputs = []
    for _ in range(2):
        torch.manual_seed(123)
        outputs.append(decoding.generate(model, ids, mask, max_new_tokens=12, do_sample=True, temperature=0.9,
                                         top_k=20, top_p=0.95))
    assert torch.equal(*outputs)


def test_patched_generate_takes_our_path_only_for_what_it_implements(device, monkeypatch):
    model = _model("llama", device=device, eos_token_id=3, pad_token_id=0)
    reference = copy.deepcopy(model)
    hf.patch(model)
    calls = []
    real = decoding.generate
    monkeypatch.setattr(decoding, "generate", lambda *a, **k: calls.append(k) or real(*a, **k))
    ids, mask = _ragged_prompt(device, lengths=(6, 9))
    assert torch.equal(model.generate(ids, attention_mask=mask, max_new_tokens=10),
                       reference.generate(ids, attention_mask=mask, max_new_tokens=10))
    assert len(calls) == 1 and calls[0]["eos_token_id"] == [3] and calls[0]["max_new_tokens"] == 10
    # No mask given, pads in the prompt: HF reads the mask off them, and so does the request.
    assert torch.equal(model.generate(ids, max_length=15), reference.generate(ids, max_length=15))
    assert len(calls) == 2 and torch.equal(calls[1]["attention_mask"], mask)
    # A processor the decoder lacks, or an output option: HF's generate, HF's tokens.
    for kwargs in (dict(repetition_penalty=1.3), dict(num_beams=2), dict(return_dict_in_generate=True,
                                                                         output_scores=True)):
        ours = model.generate(ids, attention_mask=mask, max_new_tokens=6, **kwargs)
        theirs = reference.generate(ids, attention_mask=mask, max_new_tokens=6, **kwargs)
        assert len(calls) == 2
        assert torch.equal(ours if isinstance(ours, torch.Tensor) else ours.sequences,
                           theirs if isinstance(theirs, torch.Tensor) else theirs.sequences)
    # Sampling arguments go through, with HF's default top_k of 50.
    torch.manual_seed(0)
    model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=True, top_p=0.8)
    assert calls[-1]["top_k"] == 50 and calls[-1]["top_p"] == 0.8 and calls[-1]["do_sample"]
    hf.unpatch(model)
    assert "generate" not in model.__dict__ and model not in decoding.DECODERS


def test_the_decoder_is_kept_per_batch_and_released(device):
    model = _model("llama", device=device)
    ids = torch.randint(0, VOCAB, (2, 5), device=device)
    decoding.generate(model, ids, max_new_tokens=3)
    kept = decoding.DECODERS[model][1]
    decoding.generate(model, ids[:, :4], max_new_tokens=5)
    assert decoding.DECODERS[model][1] is kept
    decoding.generate(model, ids[:1], max_new_tokens=3)
    assert decoding.DECODERS[model][1] is not kept
    decoding.release(model)
    assert model not in decoding.DECODERS


@pytest.mark.parametrize("family, batch, do_sample", [("llama", 1, False), ("qwen3", 3, True), ("gemma2", 1, True),
                                                     ("gemma3_text", 2, False)])
def test_the_warm_up_readies_every_kernel_a_decode_step_launches(family, batch, do_sample, device, monkeypatch):
    """What the decoder compiles while the prefill runs (its step in compile-only mode) covers every
    kernel its first step launches, and a sampling decoder's warm-up draws nothing from torch's
    generator (it runs on another thread)."""
    fresh_launchers(monkeypatch)
    model = _model(family, torch.bfloat16, device)
    sampling = decoding.Sampling(do_sample, 0.8, 5 if do_sample else None, None)
    decoder = decoding._decoder(model, batch, 40, sampling, (3,), 0, cuda_graph=False)
    runtime.wait_for_background_work()  # on a GPU the decoder started its own warm-up
    generator = (torch.cuda.get_rng_state() if device == "cuda" else torch.get_rng_state()).clone()
    runtime.compile_only(decoder.warm_step)
    runtime.wait_for_background_work()
    assert torch.equal(torch.cuda.get_rng_state() if device == "cuda" else torch.get_rng_state(), generator)
    ahead = runtime.launched_ahead()
    with torch.no_grad():
        decoder.step()
    launched = runtime.launch_keys()
    assert len(launched) >= 6  # products, rope into the cache, attention (2), the final norm, record_tokens
    assert launched <= ahead, sorted(map(str, launched - ahead))
    decoding.release(model)


# What each family's patched prefill launches at least: Llama's norms, rope, attention and SwiGLU;
# Gemma 2's patch takes fewer of its modules.
@pytest.mark.parametrize("family, kernels", [("llama", 4), ("gemma2", 2)])
def test_ready_prefill_readies_every_kernel_the_prefill_launches(family, kernels, device, monkeypatch):
    """generate's first call hands the prefill's kernels to the compile pool up front: its forward
    in compile-only mode covers every kernel the real prefill launches."""
    fresh_launchers(monkeypatch)
    model = _model(family, torch.bfloat16, device)
    hf.patch(model)
    ids, mask = _ragged_prompt(device, (9, 5))
    prefill = dict(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp_(min=0), use_cache=True,
                   logits_to_keep=1)
    with torch.no_grad():
        decoding.ready_prefill(model, **prefill)
        runtime.wait_for_background_work()
        ahead = runtime.launched_ahead()
        model(**prefill, past_key_values=transformers.DynamicCache())
    launched = runtime.launch_keys()
    assert len(launched) >= kernels
    assert launched <= ahead, sorted(map(str, launched - ahead))


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(max_new_tokens=125), ValueError, "max_position_embeddings"),
    (dict(max_new_tokens=0), ValueError, "max_new_tokens"),
    (dict(do_sample=True, temperature=0.0), ValueError, "temperature"),
    (dict(do_sample=True, top_p=1.5), ValueError, "top_p"),
    (dict(eos_token_id="2"), TypeError, "eos_token_id"),
])
def test_bad_arguments_are_named_before_any_work(device, kwargs, error, match, monkeypatch):
    model = _model("llama", device=device)
    monkeypatch.setattr(model, "forward", lambda *a, **k: pytest.fail("the model ran"))
    with pytest.raises(error, match=match):
        decoding.generate(model, torch.randint(0, VOCAB, (1, 4), device=device), **kwargs)


def test_unsupported_models_and_inputs_are_refused(device):
    phi3 = transformers.AutoModelForCausalLM.from_config(transformers.Phi3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, pad_token_id=0))
    ids = torch.randint(0, VOCAB, (1, 4))
    with pytest.raises(ValueError, match="model_type 'phi3'"):
        decoding.generate(phi3, ids)
    model = _model("llama", device=device)
    with pytest.raises(TypeError, match="LongTensor"):
        decoding.generate(model, ids.float().to(device))
    with pytest.raises(ValueError, match="attention_mask"):
        decoding.generate(model, ids.to(device), torch.ones(1, 5, dtype=torch.long, device=device))
    model.model.layers[0].mlp.up_proj = torch.nn.Sequential(model.model.layers[0].mlp.up_proj)
    assert "nn.Linear" in decoding.unsupported(model)


# nvfp4's products take minutes under the interpreter; mxfp8 runs the same path on a CPU.
@pytest.mark.parametrize("fmt", [pytest.param("nvfp4", marks=gpu_only), "mxfp8"])
def test_quantized_weights_decode_as_hfs_generate_of_the_same_model(device, fmt):
    """hf.patch(model, weights=fmt): the layers' projections become block-scaled, lm_head and the
    embedding stay bf16, and our decoding of it gives HF's generate's tokens on the same model.
    (The interpreter emulates the block-scaled products slowly: one layer and 3 tokens on a CPU.)"""
    on_gpu = device != "cpu"
    model = _model("qwen2", dtype=torch.bfloat16, device=device, num_hidden_layers=2 if on_gpu else 1,
                   eos_token_id=None, pad_token_id=0)
    hf.patch(model, weights=fmt)
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert all(type(m) is tritonformer.nn.QuantizedLinear and m.fmt == fmt
               for m in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj))
    assert type(model.lm_head) is torch.nn.Linear and model.lm_head.weight.dtype == torch.bfloat16
    ids = torch.randint(1, VOCAB, (2, 5), device=device)
    new = 16 if on_gpu else 3
    ours = model.generate(ids, max_new_tokens=new)
    assert model in decoding.DECODERS, "the patched generate did not decode"
    assert torch.equal(ours, type(model).generate(model, ids, max_new_tokens=new))


def test_fp4_layers_chained_decode_as_the_same_products_unchained(device, monkeypatch):
    """At one row a layer's fp4 products hand each other PreparedRows (decoding._fp4_chain): the
    tokens are those of the same products with the norms and residual adds inside each (on the
    CPU; on a GPU the squares' summing order may move a near tie, and the GPU test below checks
    the tokens against HF's)."""
    # Weights large enough that each layer's products move the tokens (at 0.02 the embedding decides).
    model = _model("llama", dtype=torch.bfloat16, device=device, eos_token_id=None, pad_token_id=0, hidden_size=64,
                   intermediate_size=64, num_attention_heads=2, num_key_value_heads=1, initializer_range=0.3)
    _randomize_norms(model)
    hf.patch(model, weights="mxfp4")
    # The prefill is not under test, and its scaled_matmul takes 20 s under the interpreter: dense products.
    monkeypatch.setattr(tritonformer.nn.QuantizedLinear, "forward", lambda self, x: torch.nn.functional.linear(
        x, self.weight.dequantize(torch.float32).to(x.dtype), self.bias))
    chained_launches = _record_launches(monkeypatch, "decode_linear_into_norm")
    ids = torch.randint(1, VOCAB, (1, 3), device=device)
    chained = decoding.generate(model, ids, max_new_tokens=3, cuda_graph=False)
    # Two steps of two layers: o, down into the second layer's norm, o.
    assert len(chained_launches) == 6
    decoding.release(model)
    monkeypatch.setattr(decoding, "_fp4_chain", lambda *args: False)
    unchained = decoding.generate(model, ids, max_new_tokens=3, cuda_graph=False)
    assert len(chained_launches) == 6
    if device == "cpu":
        assert torch.equal(chained, unchained)


def test_a_quantized_lm_head_decodes_through_decode_linear(device, monkeypatch):
    """quantize_lm_head=True: lm_head becomes block-scaled too (the embedding stays bf16), the
    decode step reads it in decode_linear at one row, and the tokens are the patched model's own
    teacher-forced argmax within bf16 tolerance."""
    model = _model("llama", dtype=torch.bfloat16, device=device, eos_token_id=None, pad_token_id=0, hidden_size=64,
                   intermediate_size=64, num_attention_heads=2, num_key_value_heads=1, initializer_range=0.3,
                   tie_word_embeddings=True)
    with pytest.raises(ValueError, match="quantize_lm_head=True takes weights="):
        hf.patch(model, quantize_lm_head=True)
    hf.patch(model, weights="mxfp4", quantize_lm_head=True)
    assert type(model.lm_head) is tritonformer.nn.QuantizedLinear and model.lm_head.fmt == "mxfp4"
    assert model.get_input_embeddings().weight.dtype == torch.bfloat16 and not model.config.tie_word_embeddings
    if device == "cpu":  # the prefill's and the reference's scaled_matmul take minutes under the interpreter
        monkeypatch.setattr(tritonformer.nn.QuantizedLinear, "forward", lambda self, x: torch.nn.functional.linear(
            x, self.weight.dequantize(torch.float32).to(x.dtype), self.bias))
    heads = []
    original = decoding.decode_linear

    def decode_linear(x, weights, *args, **kwargs):
        if not runtime.compiling_ahead() and weights[0] is model.lm_head.weight:
            heads.append(type(x).__name__)
        return original(x, weights, *args, **kwargs)

    monkeypatch.setattr(decoding, "decode_linear", decode_linear)
    ids = torch.randint(1, VOCAB, (1, 3), device=device)
    ours = decoding.generate(model, ids, max_new_tokens=4, cuda_graph=False)
    assert heads == ["Tensor"] * 3  # the three decode steps (the prefill picks the first token)
    _assert_hfs_argmax_within_tolerance(model, ids, torch.ones_like(ids), ours)


@gpu_only
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_fp4_weights_of_one_sequence_decode_through_decode_linear(device, fmt, monkeypatch):
    """Batch 1 with fp4 weights: the layer products are decode_linear's (q, k and v in one launch,
    the norms and SwiGLU inside; after the first layer's q, k and v each product hands the next
    its operand as a PreparedRow) and the tokens are the model's teacher-forced argmax within bf16
    tolerance."""
    model = _model("llama", dtype=torch.bfloat16, device=device, eos_token_id=None, pad_token_id=0)
    _randomize_norms(model)
    hf.patch(model, weights=fmt)
    launches = _record_launches(monkeypatch, "decode_linear", "decode_swiglu", "decode_linear_into_norm")
    ids = torch.randint(1, VOCAB, (1, 7), device=device)
    ours = decoding.generate(model, ids, max_new_tokens=24, cuda_graph=False)
    # Two layers a step: q, k, v from the embedding's row, then o, gate/up, down, q, k, v, o, gate/up, down.
    step = [("decode_linear", "Tensor"), ("decode_linear_into_norm", "Tensor"), ("decode_swiglu", "PreparedRow"),
            ("decode_linear_into_norm", "PreparedRow"), ("decode_linear", "PreparedRow"),
            ("decode_linear_into_norm", "Tensor"), ("decode_swiglu", "PreparedRow"), ("decode_linear", "PreparedRow")]
    assert launches == step * (len(launches) // len(step)) and launches
    _assert_hfs_argmax_within_tolerance(model, ids, torch.ones_like(ids), ours)


def test_the_weights_option_names_what_it_cannot_take(device):
    with pytest.raises(ValueError, match="weights must be one of"):
        hf.patch(_model("llama", dtype=torch.bfloat16, device=device), weights="int4")
    with pytest.raises(ValueError, match="bfloat16 model"):
        hf.patch(_model("llama", device=device), weights="nvfp4")


def test_patched_generate_keeps_hfs_lengths_masks_and_token_ids(device, monkeypatch):
    """Review cases: no length given means HF's 20 new tokens; a mask that is not left padding
    (right padding) goes to HF's generate (and tritonformer.generate names it); eos as a tensor
    and temperature None are taken as HF takes them."""
    model = _model("llama", device=device, eos_token_id=None, pad_token_id=0)
    reference = copy.deepcopy(model)
    hf.patch(model)
    calls = []
    real = decoding.generate
    monkeypatch.setattr(decoding, "generate", lambda *a, **k: calls.append(k) or real(*a, **k))
    ids = torch.randint(1, VOCAB, (2, 5), device=device)
    assert torch.equal(model.generate(ids), reference.generate(ids)) and len(calls) == 1
    assert calls[0]["max_new_tokens"] == 20
    right = torch.ones_like(ids)
    right[1, 3:] = 0
    assert torch.equal(model.generate(ids, attention_mask=right, max_new_tokens=4),
                       reference.generate(ids, attention_mask=right, max_new_tokens=4)) and len(calls) == 1
    with pytest.raises(ValueError, match="left padding"):
        real(model, ids, right, max_new_tokens=4)
    eos = torch.tensor(int(reference.generate(ids, max_new_tokens=3)[0, -1]), device=device)
    assert torch.equal(model.generate(ids, max_new_tokens=6, eos_token_id=eos),
                       reference.generate(ids, max_new_tokens=6, eos_token_id=eos)) and len(calls) == 2
    model.generate(ids, max_new_tokens=2, do_sample=True, temperature=None)
    assert len(calls) == 3 and calls[-1]["temperature"] == 1.0


def test_new_weights_get_a_new_decoder(device):
    """The kept decoder (and its captured step) belongs to the weights it read: weights replaced
    (another address) decode with the new ones."""
    model = _model("qwen3", device=device)
    ids = torch.randint(1, VOCAB, (1, 6), device=device)
    decoding.generate(model, ids, max_new_tokens=3)
    kept = decoding.DECODERS[model][1]
    with torch.no_grad():
        for p in model.model.layers[1].mlp.parameters():
            p.data = p.data * 3
    assert torch.equal(decoding.generate(model, ids, max_new_tokens=3),
                       _hf_generate(model, ids, None, max_new_tokens=3, eos_token_id=None))
    assert decoding.DECODERS[model][1] is not kept


def test_olmoe_clips_q_k_and_v(device):
    model = _model("olmoe", device=device, clip_qkv=0.02)
    ids, mask = _ragged_prompt(device, lengths=(6, 4))
    assert torch.equal(decoding.generate(model, ids, mask, max_new_tokens=6, pad_token_id=0),
                       _hf_generate(model, ids, mask, max_new_tokens=6, eos_token_id=None, pad_token_id=0))


def test_a_quantized_projection_with_a_float32_bias_stays_with_its_module(device):
    # decode_linear takes biases in x's dtype; a QuantizedLinear may keep a float32 one.
    linear = tritonformer.nn.QuantizedLinear(64, 16, "nvfp4", bias=True, device=device)
    assert linear.bias.dtype == torch.float32 and not decoding._plain(1, linear)
    assert decoding._plain(1, tritonformer.nn.QuantizedLinear(64, 16, "nvfp4", bias=False, device=device))
