"""tritonformer.integrations.hf on tiny models made from configs (no download)."""

import copy

import pytest
import torch

import tritonformer.nn
from tritonformer import runtime
from tritonformer.integrations import hf
from tritonformer.testing import assert_close, check_close

from conftest import ON_GPU, gpu_only
from helpers import fresh_launchers, graph_nodes, reference_attention

transformers = pytest.importorskip("transformers")

VOCAB = 128


def _config(family: str, **overrides):
    # Head dim 32: the smallest the attention kernels take.
    common = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, head_dim=32)
    common.update(overrides)
    configs = {
        "llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
        "qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config, "gemma": transformers.GemmaConfig,
        # Caps low enough to bite on a tiny model's logits (Gemma 2's own are 50 and 30).
        "gemma2": lambda **kw: transformers.Gemma2Config(**{"attn_logit_softcapping": 0.5,
                                                            "final_logit_softcapping": 0.3, **kw}),
        "gemma3_text": transformers.Gemma3TextConfig,
    }
    if family in MOE_CONFIGS:
        config = MOE_CONFIGS[family]()
        config.update(common)
        return config
    return configs[family](**common)


def _models(family="llama", dtype=torch.float32, **overrides):
    """(patched, unpatched) copies of one freshly initialised model."""
    model = transformers.AutoModelForCausalLM.from_config(_config(family, **overrides),
                                                          **reference_attention(family)).to(dtype)
    reference = copy.deepcopy(model)
    return hf.patch(model), reference


def _ids(device, B=2, S=16):
    return torch.randint(0, VOCAB, (B, S), device=device)


def _grads(model):
    return {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


@pytest.fixture
def spy_attention(monkeypatch):
    """Counts the calls that reach tritonformer's attention kernel (not the SDPA fallback)."""
    calls = []
    real = tritonformer.nn.attention

    def counting(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(tritonformer.nn, "attention", counting)
    return calls


@pytest.mark.parametrize("family", list(hf.FAMILIES))
def test_patched_model_gives_the_same_logits_loss_and_gradients(family, device, spy_attention):
    model, reference = _models(family)
    model.to(device), reference.to(device)
    ids = _ids(device)
    own = hf.FAMILIES[family]
    with torch.no_grad():
        assert_close(model(ids).logits, reference(ids).logits.double(), torch.float32)
    # One call a layer, plain causal batch: no mask, our kernel (GPT-OSS's with its sinks and, on
    # its sliding layer, a window shorter than the batch).
    assert len(spy_attention) == 2
    model.train(), reference.train()
    out, ref = model(ids, labels=ids), reference(ids, labels=ids)
    assert out.logits is None  # training with labels: fused linear cross-entropy, no logits
    if hf.FAMILIES[family].moe:
        assert out.aux_loss is None and model.config._experts_implementation == "tritonformer"
    assert not any(hf.FUSED_NORM in m.__dict__ for m in model.modules())  # every one taken
    # q, k, v and rope as one node a layer, where the family's attention forward is Llama's.
    nodes = graph_nodes(out.loss)
    assert nodes.count("QKVRopeFunctionBackward") == (2 if hf.FAMILIES[family].qkv_rope else 0)
    # Elsewhere rope is apply_rope, a node a layer (GPT-OSS's half-width tables widened for it).
    assert nodes.count("RopeFunctionBackward") == (0 if hf.FAMILIES[family].qkv_rope else 2)
    # The routers through moe_route, one node a layer.
    assert nodes.count("MoERouteFunctionBackward") == (2 if hf.FAMILIES[family].moe else 0)
    # Both residual adds of each layer: into post_attention_layernorm, and into the next layer's
    # input_layernorm (the last layer's into the model's final norm).
    assert nodes.count("AddRMSNormFunctionBackward") == (4 if own.add_norm else 0)
    # What is left unfused: the first layer's input norm (and Qwen3's and OLMoE's q and k norms);
    # every norm where the layer is HF's (Gemma 2 and 3: four a layer).
    norms = sum(type(m) is own.cls("RMSNorm") for m in model.modules())
    assert nodes.count("NormFunctionBackward") == ((norms - 4 if own.add_norm else norms) if own.norm else 0)
    assert_close(out.loss, ref.loss.double(), torch.float32)
    out.loss.backward(), ref.loss.backward()
    grads, ref_grads = _grads(model), _grads(reference)
    assert grads.keys() == ref_grads.keys()
    for name in grads:
        assert_close(grads[name], ref_grads[name].double(), torch.float32, compare="norm")


def _routes(model, ids) -> list[list[list[int]]]:
    """Each MoE router's chosen experts per token (sorted) in a no-grad forward of ids; [] for a
    dense model."""
    routes, hooks = [], []
    for module in model.modules():
        if type(module).__name__.endswith("TopKRouter"):
            hooks.append(module.register_forward_hook(
                lambda _, __, out: routes.append(out[-1].sort(-1).values.tolist())))
    with torch.no_grad():
        model(ids)
    for hook in hooks:
        hook.remove()
    return routes


def _relative_error(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("family", ["llama"] + [name for name, f in hf.FAMILIES.items() if f.moe])
def test_bf16_model_is_as_close_to_float32_as_hf_in_bf16(device, family):
    """Ours and HF's bf16 runs each differ from the float32 model by bf16 rounding: ours may not
    be further off than twice HF's own distance (or 1% for gradients), over all gradients and
    three times per parameter. The MoE families route and run their experts in bf16 too."""
    model, reference = _models(family, torch.bfloat16)
    exact = copy.deepcopy(reference).float()
    models = (model, reference, exact)
    for m in models:
        m.to(device).train()
    # A token whose top experts nearly tie may be routed elsewhere in bf16 than in float32 (a
    # rounding moves a whole token to another expert): such a batch compares no rounding. Drawn
    # again until the routers of the three runs agree (MoE families).
    for _ in range(5):
        ids = _ids(device)
        routes = [_routes(m, ids) for m in models]
        if routes[0] == routes[2] and routes[1] == routes[2]:
            break
    else:
        pytest.fail("five batches with a routing flip between bf16 and float32")
    losses, grads = [], []
    for m in models:
        loss = m(ids, labels=ids).loss
        loss.backward()
        losses.append(loss)
        grads.append(_grads(m))
    factor = 2
    exact_loss = losses[2].item()
    assert losses[0].dtype == torch.float32  # as HF's
    assert abs(losses[0].item() - exact_loss) <= max(factor * abs(losses[1].item() - exact_loss), 1e-2)
    names = list(grads[2])
    ours, hf_bf16 = (_relative_error(torch.cat([g[n].flatten() for n in names]),
                                     torch.cat([grads[2][n].flatten() for n in names])) for g in grads[:2])
    assert ours <= max(factor * hf_bf16, 1e-2), ("all gradients", ours, hf_bf16)
    # Each parameter's alone, with room for gradients that are sums of cancelling terms (a
    # router's: its per-token terms sum to 0 over the chosen experts), where rounding that is
    # smaller everywhere (our attention's, in GPT-OSS) still adds up differently.
    for name in names:
        ours, hf_bf16 = (_relative_error(g[name], grads[2][name]) for g in grads[:2])
        assert ours <= max(1.5 * factor * hf_bf16, 1e-2), (name, ours, hf_bf16)


def test_eval_with_labels_returns_logits_and_hf_loss(device):
    model, reference = _models()
    model.to(device), reference.to(device)
    model.eval(), reference.eval()
    ids = _ids(device)
    with torch.no_grad():
        out, ref = model(ids, labels=ids), reference(ids, labels=ids)
    assert out.logits is not None
    assert_close(out.logits, ref.logits.double(), torch.float32)
    assert_close(out.loss, ref.loss.double(), torch.float32)


def test_num_items_in_batch_normalises_as_hf_does(device):
    model, reference = _models()
    model.to(device), reference.to(device)
    model.train(), reference.train()
    ids = _ids(device)
    labels = ids.clone()
    labels[0, :5] = -100
    for n in (7, torch.tensor(40, device=device)):
        out = model(ids, labels=labels, num_items_in_batch=n)
        ref = reference(ids, labels=labels, num_items_in_batch=n)
        assert_close(out.loss, ref.loss.double(), torch.float32)


def test_padding_mask_goes_through_sdpa_and_matches(device, spy_attention):
    model, reference = _models()
    model.to(device), reference.to(device)
    ids = _ids(device, S=12)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # left padding
    with torch.no_grad():
        out, ref = model(ids, attention_mask=mask).logits, reference(ids, attention_mask=mask).logits
    assert_close(out[0], ref[0].double(), torch.float32)
    assert_close(out[1, 4:], ref[1, 4:].double(), torch.float32)
    assert not spy_attention  # a padding mask is not ours to apply


def test_plain_causal_batch_takes_our_kernel_while_hf_sees_tracing(device, spy_attention, monkeypatch):
    """While a CUDA graph captures (or dynamo traces) HF's SDPA mask would build a full (S, S)
    mask: the tritonformer mask interface still answers None for a causal batch without padding,
    also when the queries are the last of the keys (a chunk after a cache)."""
    from transformers import masking_utils

    monkeypatch.setattr(masking_utils, "is_tracing", lambda *args: True)
    model, reference = _models()
    model.to(device), reference.to(device)
    ids = _ids(device, S=30)
    with torch.no_grad():
        assert_close(model(ids).logits, reference(ids).logits.double(), torch.float32)
        assert len(spy_attention) == 2
        past = model(ids[:, :5], use_cache=True).past_key_values
        chunk = model(ids[:, 5:], past_key_values=past).logits  # 25 queries: the flash kernel, not decode's
    assert len(spy_attention) == 6
    assert_close(chunk, reference(ids).logits[:, 5:].double(), torch.float32)
    common = dict(batch_size=2, q_length=7, kv_offset=0, mask_function=masking_utils.causal_mask_function,
                  attention_mask=None, device=device)
    assert hf.attention_mask(kv_length=12, q_offset=5, **common) is None
    # A static cache's keys run past the queries: HF's mask, which hides the empty slots.
    assert hf.attention_mask(kv_length=16, q_offset=5, **common).shape == (2, 1, 7, 16)


def test_prefill_into_a_static_cache_hides_its_empty_slots(device):
    """A static cache's keys run past a prefill's queries, which start at 0: SDPA's top-left
    causal mask needs no mask there and HF skips it, our bottom-right one does need it."""
    model, reference = _models()
    model.to(device), reference.to(device)
    ids = _ids(device, S=10)
    with torch.no_grad():
        cache = transformers.StaticCache(config=model.config, max_cache_len=24)
        out = model(ids, past_key_values=cache, use_cache=True).logits
        ref = reference(ids).logits
    assert_close(out, ref.double(), torch.float32)


def test_greedy_generation_matches_with_a_kv_cache(device, spy_attention, monkeypatch):
    decodes = []
    real_decode = tritonformer.nn.decode.decode_attention

    def counting(*args, **kwargs):
        decodes.append(args[0].shape)
        return real_decode(*args, **kwargs)

    monkeypatch.setattr(tritonformer.nn.decode, "decode_attention", counting)
    model, reference = _models()
    model.to(device), reference.to(device)
    model.eval(), reference.eval()
    ids = _ids(device, B=1, S=5)
    with torch.no_grad():
        # HF's own generate over the patched model (the path of arguments tritonformer.generate
        # does not take): our attention for the prefill and each decode step.
        ours = type(model).generate(model, ids, max_new_tokens=6, do_sample=False)
        theirs = reference.generate(ids, max_new_tokens=6, do_sample=False)
    assert torch.equal(ours, theirs)
    assert all(shape[2] == 5 for shape in spy_attention)  # the prefill: the flash kernel
    assert len(decodes) == 2 * 5 and all(shape[2] == 1 for shape in decodes)  # each decode step, each layer
    # The patched model's generate (tritonformer.generate here) gives the same tokens.
    assert torch.equal(model.generate(ids, max_new_tokens=6, do_sample=False), theirs)


def test_gradient_checkpointing(device):
    model, reference = _models()
    model.to(device), reference.to(device)
    for m in (model, reference):
        m.train()
        m.gradient_checkpointing_enable()
    ids = _ids(device)
    model(ids, labels=ids).loss.backward()
    reference(ids, labels=ids).loss.backward()
    for name, grad in _grads(model).items():
        assert_close(grad, _grads(reference)[name].double(), torch.float32, compare="norm")
    # The recomputation runs layers backwards: no norm result may be left behind for a next layer.
    assert not any(hf.FUSED_NORM in m.__dict__ for m in model.modules())


# LoRA on q_proj: that layer's attention runs HF's forward; on o_proj only: qkv_rope runs with
# frozen projections (no weight gradients), its dx feeding the adapters of earlier layers.
@pytest.mark.parametrize("targets", [("q_proj", "gate_proj", "down_proj", "lm_head"), ("o_proj", "up_proj", "lm_head")])
def test_lora_adapters_train_on_patched_modules_and_on_lm_head(device, targets):
    peft = pytest.importorskip("peft")
    model, reference = _models()
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=list(targets), init_lora_weights=False)
    model, reference = peft.get_peft_model(model, lora), peft.get_peft_model(reference, copy.deepcopy(lora))
    reference.load_state_dict(model.state_dict())
    model.to(device), reference.to(device)
    model.train(), reference.train()
    ids = _ids(device)
    out, ref = model(input_ids=ids, labels=ids), reference(input_ids=ids, labels=ids)
    # LoRA wraps lm_head: the fused loss would skip the adapter, so the logits path runs.
    assert out.logits is not None
    assert_close(out.loss, ref.loss.double(), torch.float32)
    out.loss.backward(), ref.loss.backward()
    grads, ref_grads = _grads(model), _grads(reference)
    assert grads and all("lora_" in name for name in grads)
    assert all(any(target in name for name in grads) for target in targets)
    for name in grads:
        assert grads[name].abs().sum() > 0
        assert_close(grads[name], ref_grads[name].double(), torch.float32, compare="norm")


def test_state_dicts_load_both_ways_and_patching_twice_is_harmless(device):
    model, reference = _models()
    assert hf.patch(model) is model
    assert model.state_dict().keys() == reference.state_dict().keys()
    reference.load_state_dict(model.state_dict())
    model.load_state_dict(reference.state_dict())
    model.to(device), reference.to(device)
    ids = _ids(device)
    with torch.no_grad():
        assert_close(model(ids).logits, reference(ids).logits.double(), torch.float32)


def test_unpatch_restores_hf_code(device, spy_attention):
    import gc

    from transformers.models.llama import modeling_llama

    gc.collect()  # patched models of earlier tests keep the shared rope function patched while alive
    original_rope = modeling_llama.apply_rotary_pos_emb
    model, _ = _models()
    assert modeling_llama.apply_rotary_pos_emb is hf._apply_rotary_pos_emb
    hf.unpatch(model)
    assert modeling_llama.apply_rotary_pos_emb is not hf._apply_rotary_pos_emb
    if original_rope is not hf._apply_rotary_pos_emb:
        assert modeling_llama.apply_rotary_pos_emb is original_rope
    assert model.config._attn_implementation != hf.ATTENTION_NAME
    assert all("forward" not in m.__dict__ for m in model.modules())
    with torch.no_grad():
        model.to(device)(_ids(device))
    assert not spy_attention
    hf.unpatch(model)  # twice: harmless


def test_head_dim_the_kernels_do_not_take_keeps_hf_attention(device, spy_attention):
    # head_dim 16: patch() warns and patches everything else (it left a model whose every forward raised).
    model = transformers.AutoModelForCausalLM.from_config(_config("llama", hidden_size=64, head_dim=16)).to(device)
    reference = copy.deepcopy(model)
    with pytest.warns(UserWarning, match="head_dim 16"):
        hf.patch(model)
    assert model.config._attn_implementation == reference.config._attn_implementation
    ids = _ids(device)
    with torch.no_grad():
        assert_close(model(ids).logits, reference(ids).logits, torch.float32)
    assert not spy_attention


def test_patch_before_creation(device, spy_attention):
    from transformers.models.llama import modeling_llama

    original_forward = modeling_llama.LlamaRMSNorm.forward
    hf.patch_llama()
    try:
        model = transformers.AutoModelForCausalLM.from_config(_config("llama"), attn_implementation="tritonformer")
        reference = copy.deepcopy(model)
        hf.unpatch_family("llama")
        assert modeling_llama.LlamaRMSNorm.forward is original_forward
        reference.config._attn_implementation = "sdpa"
        hf.patch_llama()
        model.to(device), reference.to(device)
        ids = _ids(device)
        model.train()
        loss = model(ids, labels=ids).loss
        assert spy_attention
        hf.unpatch_family("llama")
        reference.train()
        assert_close(loss, reference(ids, labels=ids).loss.double(), torch.float32)
    finally:
        hf.unpatch_family("llama")


def test_unsupported_family_is_named():
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=VOCAB))
    with pytest.raises(ValueError, match="model_type 'gpt2' is not supported; supported: llama, mistral"):
        hf.patch(model)


@pytest.mark.parametrize("family,overrides", [("llama", {}), ("mistral", dict(sliding_window=4)),
                                              ("gemma2", dict(sliding_window=4))])
def test_patched_training_step_compiles_without_graph_breaks(family, overrides, device):
    """Llama, and windows shorter than the sequence (Mistral's on every layer, Gemma 2's on every
    other one, with its softcaps): no graph break, our attention kernel and qkv_rope in the graph,
    HF's loss and gradients; packed rows keep HF's mask."""
    model, reference = _models(family, **overrides)
    model.to(device).train(), reference.to(device).train()
    ids = _ids(device)

    def step(ids):
        return model(ids, labels=ids).loss

    explain = torch._dynamo.explain(step)(ids)
    assert explain.graph_break_count == 0, [str(b.reason) for b in explain.break_reasons]
    # No position_ids, mask or cache: HF's traced packing check must not turn the causal mask into
    # a full one, which would send attention to SDPA instead of our kernel.
    calls = [str(node.target) for graph in explain.graphs for module in graph.modules()
             if isinstance(module, torch.fx.GraphModule) for node in module.graph.nodes if node.op == "call_function"]
    assert not [c for c in calls if "scaled_dot_product" in c], calls
    assert [c for c in calls if "tritonformer.attention" in c], calls
    # q, k and v as one product with the rotation in place (qkv_rope), as the eager step has them.
    assert [c for c in calls if "tritonformer.rope_fwd_inplace" in c], calls
    torch._dynamo.reset()
    loss = torch.compile(step, fullgraph=True, backend="aot_eager")(ids)
    loss.backward()
    ref = reference(ids, labels=ids).loss
    ref.backward()
    assert_close(loss, ref.double(), torch.float32)
    for name, grad in _grads(model).items():
        assert_close(grad, _grads(reference)[name].double(), torch.float32, compare="norm")
    # Sequences packed in each row, told by position_ids: the traced check still finds them.
    position_ids = torch.cat([torch.arange(6, device=device), torch.arange(10, device=device)])[None].expand(2, -1)
    packed = torch.compile(lambda ids: model(ids, labels=ids, position_ids=position_ids).loss, fullgraph=True,
                           backend="aot_eager")(ids)
    with torch.no_grad():
        ref = reference(ids, labels=ids, position_ids=position_ids, use_cache=False).loss
    assert_close(packed, ref.double(), torch.float32)


def test_float32_weights_under_autocast(device):
    """Mixed precision as HF trains it: float32 weights, bf16 matmuls under autocast."""
    model, reference = _models()
    exact = copy.deepcopy(reference)
    ids = _ids(device)
    losses, grads = [], []
    for m, autocast in ((model, True), (reference, True), (exact, False)):
        m.to(device).train()
        with torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=autocast):
            loss = m(ids, labels=ids).loss
        loss.backward()
        losses.append(loss.item())
        grads.append(_grads(m))
    factor = 3 if device == "cpu" else 2
    assert abs(losses[0] - losses[2]) <= max(factor * abs(losses[1] - losses[2]), 1e-2)
    for name in grads[2]:
        ours, hf_autocast = (_relative_error(g[name], grads[2][name]) for g in grads[:2])
        assert ours <= max(factor * hf_autocast, 1e-2), (name, ours, hf_autocast)


def test_packed_batch_through_hf_kwargs_matches_separate_sequences(device, spy_attention):
    """Training without padding: sequences concatenated in one row, position_ids restarting and
    cu_seq_lens (as DataCollatorWithFlattening gives them) run the varlen kernels."""
    model, _ = _models()
    model.to(device).eval()
    lens = [5, 9, 2]
    seqs = [_ids(device, B=1, S=n) for n in lens]
    packed = torch.cat(seqs, dim=1)
    position_ids = torch.cat([torch.arange(n, device=device) for n in lens])[None]
    cu = torch.tensor([0, *lens], device=device).cumsum(0).to(torch.int32)
    kwargs = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max(lens), max_length_k=max(lens))
    with torch.no_grad():
        out = model(packed, position_ids=position_ids, **kwargs).logits
        separate = torch.cat([model(s).logits for s in seqs], dim=1)
    assert_close(out, separate.double(), torch.float32)
    assert spy_attention[0] == (sum(lens), 4, 32)  # the packed call: q as (total, heads, head_dim)


@pytest.mark.parametrize("family", ["mistral", "gemma2", "gpt_oss"])
def test_sliding_window_shorter_than_the_sequence_runs_our_kernel(family, device, spy_attention):
    """HF's sliding-window mask is left out (the attention gets the window as an argument): every
    layer reaches our kernel, with HF's logits and gradients; with padding, HF's mask (and the
    torch path) gives HF's logits too."""
    model, reference = _models(family, sliding_window=4)
    model.to(device), reference.to(device)
    ids = _ids(device)
    with torch.no_grad():
        assert_close(model(ids).logits, reference(ids).logits.double(), torch.float32)
    assert len(spy_attention) == 2
    model.train(), reference.train()
    out, ref = model(ids, labels=ids), reference(ids, labels=ids)
    assert_close(out.loss, ref.loss.double(), torch.float32)
    out.loss.backward(), ref.loss.backward()
    grads, ref_grads = _grads(model), _grads(reference)
    for name in grads:
        assert_close(grads[name], ref_grads[name].double(), torch.float32, compare="norm")
    model.eval(), reference.eval()
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    with torch.no_grad():
        got, want = model(ids, attention_mask=mask).logits, reference(ids, attention_mask=mask).logits
    assert_close(got[0, 3:], want[0, 3:].double(), torch.float32)
    assert_close(got[1], want[1].double(), torch.float32)
    # A tokenizer's all-ones mask is no padding: our kernel again, on every layer.
    calls = len(spy_attention)
    with torch.no_grad():
        got = model(ids, attention_mask=torch.ones_like(ids)).logits
    assert len(spy_attention) == calls + 2
    assert_close(got, reference(ids).logits.double(), torch.float32)


def test_non_silu_mlp_keeps_hf_activation(device):
    model, reference = _models(hidden_act="gelu")
    model.to(device), reference.to(device)
    ids = _ids(device)
    with torch.no_grad():
        assert_close(model(ids).logits, reference(ids).logits.double(), torch.float32)


def test_return_dict_false_and_ignore_index_in_training(device):
    model, reference = _models()
    model.to(device).train(), reference.to(device).train()
    ids = _ids(device)
    labels = ids.clone()
    labels[:, ::3] = 7
    out = model(ids, labels=labels, ignore_index=7, return_dict=False)
    ref = reference(ids, labels=labels, ignore_index=7, return_dict=False)
    assert isinstance(out, tuple) and isinstance(ref, tuple)
    assert_close(out[0], ref[0].double(), torch.float32)
    model.eval(), reference.eval()
    with torch.no_grad():
        assert_close(model(ids, labels=labels, ignore_index=7).loss,
                     reference(ids, labels=labels, ignore_index=7).loss.double(), torch.float32)


def test_unpatch_restores_a_custom_loss_function():
    model, _ = _models()
    hf.unpatch(model)

    def my_loss(**kwargs):
        return torch.zeros(())

    model.loss_function = my_loss
    hf.patch(model)
    assert model.loss_function is hf.causal_lm_loss
    hf.unpatch(model)
    assert model.loss_function is my_loss


@pytest.mark.parametrize("family", list(hf.FAMILIES))
def test_the_warm_up_readies_every_kernel_a_first_step_launches(family, device, monkeypatch):
    # Launchers that start empty (and no plans: the fixture clears them), so that no launch
    # replays what an earlier test made: every kernel the step launches is counted. A sequence
    # length of each family's own besides.
    fresh_launchers(monkeypatch)
    heads = 3
    # (Experts' widths kept small: the interpreter runs each expert's product tile by tile.)
    width = 8 * heads if hf.FAMILIES[family].moe else 64 * heads + 32
    model, _ = _models(family, torch.bfloat16, hidden_size=32 * heads, num_attention_heads=heads, num_key_value_heads=1,
                       intermediate_size=width)
    model.to(device).train()
    B, S = 2, 40 + list(hf.FAMILIES).index(family)
    failures = runtime.background_failures
    runtime.compile_only(hf._warm_step, model, hf.FAMILIES[family], B, S)
    runtime.wait_for_background_work()
    assert runtime.background_failures == failures
    ahead = runtime.launched_ahead()
    ids = _ids(device, B, S)
    model(input_ids=ids, labels=ids).loss.backward()
    launched = runtime.launch_keys()
    assert len(launched) >= 10  # norm, rope, attention (4), swiglu, loss (3), each way
    assert launched <= ahead, sorted(map(str, launched - ahead))


def test_a_failed_background_compile_is_counted_and_logged(caplog):
    failures = runtime.background_failures

    def broken():
        raise TypeError("a warm-up that no longer fits its launcher")

    with caplog.at_level("DEBUG", logger="tritonformer"):
        runtime._in_background(runtime._ahead_pool(), runtime._counting_failure, broken)
        runtime.wait_for_background_work()
    assert runtime.background_failures == failures + 1
    assert "no longer fits" in caplog.text


def test_training_steps_share_positions_and_rotary_tables(device, monkeypatch):
    """A training forward without position_ids passes one positions tensor that HF's packing
    check skips (no host synchronisation) and whose rotary tables are computed once; packing told
    by position_ids alone is still found, and its loss matches the unpatched model's."""
    from transformers import masking_utils

    model, reference = _models()
    model.to(device).train(), reference.to(device).train()
    rotary = model.model.rotary_emb
    tables = []
    real_forward = rotary.forward

    def spy(x, position_ids):
        out = real_forward(x, position_ids)
        tables.append(out)
        return out

    monkeypatch.setattr(rotary, "forward", spy)
    ids = _ids(device)
    for _ in range(2):
        model(ids, labels=ids).loss.backward()
    assert tables[0][0] is tables[1][0]  # the same cos tensor: computed once
    # A step at another length keeps the first length's tables (a CUDA graph of it reads them).
    model(ids[:, :8], labels=ids[:, :8]).loss.backward()
    model(ids, labels=ids).loss.backward()
    assert tables[3][0] is tables[0][0] and tables[2][0].shape[-2] == 8

    # Two sequences packed in each row, told by position_ids only: HF's check finds them and
    # the loss is the unpatched model's (without a KV cache: with one, which HF's training
    # forward makes by default, HF skips the packing check and attends across the sequences).
    position_ids = torch.cat([torch.arange(6, device=device), torch.arange(10, device=device)])[None].expand(2, -1)
    out = model(ids, labels=ids, position_ids=position_ids).loss
    ref = reference(ids, labels=ids, position_ids=position_ids, use_cache=False).loss
    assert_close(out, ref.double(), torch.float32)
    assert masking_utils.find_packed_sequence_indices(position_ids) is not None
    positions = hf._default_positions(16, torch.device(device))
    assert masking_utils.find_packed_sequence_indices(positions.expand(2, -1)) is None


def test_fsdp2_unit_layers_keep_the_mlp_add_to_themselves(device, monkeypatch):
    """A layer that is an FSDP2 unit must not read the next unit's norm weight (gathered only
    around that unit's own passes): its MLP residual add stays a plain add."""
    model, reference = _models()
    model.to(device).train(), reference.to(device).train()
    monkeypatch.setattr(hf, "FSDPModule", type(model.model.layers[0]))
    ids = _ids(device)
    out, ref = model(ids, labels=ids), reference(ids, labels=ids)
    assert graph_nodes(out.loss).count("AddRMSNormFunctionBackward") == 2  # post-attention norms only
    assert not any(hf.FUSED_NORM in m.__dict__ for m in model.modules())
    assert_close(out.loss, ref.loss.double(), torch.float32)


@pytest.mark.skipif(ON_GPU, reason="the CPU's check; a GPU asserts on the device (test_cross_entropy)")
def test_a_label_past_the_vocabulary_raises_as_in_hf(device):
    model, _ = _models("llama")
    model.train()
    ids = _ids(device)
    labels = ids.clone()
    labels[0, 5] = VOCAB
    with pytest.raises(ValueError, match=f"target holds {VOCAB}"):
        model(input_ids=ids, labels=labels)


MOE_CONFIGS = {
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(moe_intermediate_size=48, num_experts=6, num_experts_per_tok=2,
                                                     norm_topk_prob=True),
    "qwen2_moe": lambda: transformers.Qwen2MoeConfig(moe_intermediate_size=48, shared_expert_intermediate_size=64,
                                                     num_experts=6, num_experts_per_tok=2),
    "mixtral": lambda: transformers.MixtralConfig(num_local_experts=4, num_experts_per_tok=2),
    "olmoe": lambda: transformers.OlmoeConfig(num_experts=6, num_experts_per_tok=3),
    "gpt_oss": lambda: transformers.GptOssConfig(num_local_experts=4, num_experts_per_tok=2, sliding_window=8),
}


@pytest.mark.parametrize("family", sorted(set(MOE_CONFIGS) - {"gpt_oss"}))  # GPT-OSS's: the test after
def test_experts_implementation_matches_hf_experts(family, device, monkeypatch):
    """experts_implementation="tritonformer" (registered on import) against HF's expert loop: the
    same logits, loss and gradients, and our experts do run."""
    calls = []
    run = hf.moe_experts
    monkeypatch.setattr(hf, "moe_experts", lambda *args: calls.append(1) or run(*args))
    config = MOE_CONFIGS[family]()
    for name, value in dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16).items():
        setattr(config, name, value)
    _assert_our_experts_give_hfs(config, device, calls)


def _assert_our_experts_give_hfs(config, device, calls, prepare=lambda model: None, **from_config):
    """A model of config with experts_implementation="tritonformer" against the same weights with
    HF's eager experts (prepare(reference) may change them first): our experts ran (calls), and
    the logits, loss and every parameter's gradient are HF's."""
    torch.manual_seed(0)
    # from_config records the implementation on the config it is given: one config each.
    reference = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), experts_implementation="eager",
                                                              **from_config)
    prepare(reference)
    ours = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), experts_implementation="tritonformer",
                                                         **from_config)
    ours.load_state_dict(reference.state_dict())
    reference, ours = reference.to(device), ours.to(device)
    ids = _ids(device, S=12)
    expected, got = reference(input_ids=ids, labels=ids), ours(input_ids=ids, labels=ids)
    assert calls, "the tritonformer experts did not run"
    assert_close(got.logits, expected.logits.double(), torch.float32, "norm")
    assert_close(got.loss, expected.loss.double(), torch.float32)
    expected.loss.backward()
    got.loss.backward()
    for (name, p), q in zip(reference.named_parameters(), ours.parameters()):
        msg = check_close(q.grad, p.grad.double(), torch.float32, "norm")
        assert msg is None, f"{name}: {msg}"


def test_gpt_oss_experts_implementation_matches_hf_experts(device, monkeypatch):
    """GPT-OSS's experts (interleaved gate/up with biases, its clamped SwiGLU) run gpt_oss_experts
    under experts_implementation="tritonformer": HF's logits, loss and every gradient."""
    calls = []
    run = hf.gpt_oss_experts
    monkeypatch.setattr(hf, "gpt_oss_experts", lambda *args: calls.append(1) or run(*args))
    config = transformers.GptOssConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=48, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                                       num_experts_per_tok=2, sliding_window=8, max_position_embeddings=64)

    @torch.no_grad()
    def large_experts(model):  # biases and weights large enough that both clamps act somewhere
        for name, p in model.named_parameters():
            if ".experts." in name:
                p.normal_(0.0, 2.0 if "bias" in name else 0.5)

    _assert_our_experts_give_hfs(config, device, calls, large_experts, attn_implementation="eager")


def test_experts_with_their_own_gate_function_keep_hf_path(device, monkeypatch):
    """A family's own _apply_gate (GLM's clamped SwiGLU, say) is not what moe_experts computes."""
    calls = []
    monkeypatch.setattr(hf, "moe_experts", lambda *args: calls.append(1))
    config = MOE_CONFIGS["qwen3_moe"]()
    config.update(dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16))
    model = transformers.AutoModelForCausalLM.from_config(config, experts_implementation="tritonformer").to(device)
    experts_cls = type(model.model.layers[0].mlp.experts)
    monkeypatch.setattr(experts_cls, "_apply_gate", lambda self, h: h.chunk(2, dim=-1)[1].clamp(-1, 1), raising=False)
    model(input_ids=_ids(device, S=8))
    assert not calls


def test_moe_router_logits_add_hfs_auxiliary_loss_to_the_fused_loss(device):
    model, reference = _models("qwen3_moe")
    model.to(device).train(), reference.to(device).train()
    ids = _ids(device)
    out = model(ids, labels=ids, output_router_logits=True)
    ref = reference(ids, labels=ids, output_router_logits=True)
    assert out.aux_loss is not None and out.logits is None  # the fused loss, HF's auxiliary loss added
    assert_close(out.loss, ref.loss.double(), torch.float32)
    assert_close(out.aux_loss, ref.aux_loss.double(), torch.float32)
    assert len(out.router_logits) == len(ref.router_logits)
    params = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(out.loss, params)
    ref_grads = torch.autograd.grad(ref.loss, [p for p in reference.parameters() if p.requires_grad])
    for g, r in zip(grads, ref_grads):
        assert_close(g, r.double(), torch.float32, "norm")
    # None means the config's choice, as in HF.
    model.config.output_router_logits = reference.config.output_router_logits = True
    out = model(ids, labels=ids, output_router_logits=None)
    assert out.aux_loss is not None
    assert_close(out.loss, reference(ids, labels=ids, output_router_logits=None).loss.double(), torch.float32)
    hf.unpatch(model)
    assert model.config._experts_implementation == reference.config._experts_implementation
