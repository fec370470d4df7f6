"""HuggingFace transformers integration: tritonformer's kernels in Llama-family models.

    from tritonformer.integrations import hf
    model = AutoModelForCausalLM.from_config(config)   # or from_pretrained(...)
    hf.patch(model)      # this model: norms, MLPs, rope, attention, loss
    hf.unpatch(model)    # back to HuggingFace's code

    hf.patch_llama()     # before creation: every Llama model made afterwards (also patch_mistral,
                         # patch_qwen2, patch_qwen3, patch_gemma); pass
                         # attn_implementation="tritonformer" when creating it for the attention

What is swapped, per family (FAMILIES):
- RMSNorm: `rms_norm` (HF's rounding exactly; Gemma's (1 + weight) through offset=1);
- the MLP, when its activation is SiLU: `swiglu_mlp` when gate/up/down are plain bias-free
  nn.Linear and autocast is off
  (one fused backward that keeps x, gate(x), up(x)); otherwise the projections run as modules
  (so LoRA adapters on them train, and autocast casts them) with `swiglu` between. Gemma's
  GeGLU MLP is left to HuggingFace;
- rotary embeddings: the modeling module's `apply_rotary_pos_emb` becomes `apply_rope` (a
  module-level function, so it is every model of that family in the process that gets it,
  while the family is patched or a patched model of it is alive and not unpatched);
- attention: `nn.attention_forward`, registered as "tritonformer" in HF's AttentionInterface
  with SDPA's mask builder: plain causal batches (and windows longer than the sequence) get no
  mask and run our kernel, packed batches with cu_seq_lens run its varlen form, and whenever HF
  builds a mask (padding, a sliding window shorter than the sequence, packing told by
  position_ids alone) the call goes through torch's SDPA with that mask;
- in training, the attention module's q, k, v projections and rope run as one op (`qkv_rope`:
  one matmul each way, for plain nn.Linear projections; not Qwen3, whose q/k norms sit between),
  and each residual add is fused into the RMSNorm that follows it (`add_rms_norm`: the
  attention's into post_attention_layernorm; the MLP's into the next layer's input_layernorm,
  or the final norm, which takes the result when called on exactly that sum; not under
  gradient checkpointing). A training forward without position_ids, mask or cache passes one
  positions tensor of its own: HF's packing check skips it (no host synchronisation) and the
  rotary embedding keeps its tables for it. Packing told by position_ids alone is detected
  as HF detects it without a KV cache (HF's own training forward, which makes a cache by
  default, skips that check);
- mixtures of experts (Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE, GPT-OSS): the router runs
  `moe_route` after HF's logits product (GPT-OSS's: softmax over the top k of biased logits), the
  experts module `moe_experts` (GPT-OSS's `gpt_oss_experts`; its RMSNorm, which multiplies
  before rounding, with the residual adds, its rope of half-width tables and its attention with
  sinks are ours too)
  (experts_implementation="tritonformer", registered on import); with router logits asked for,
  HF's load-balancing loss joins the fused loss below;
- the loss: in training, with labels, and with a plain nn.Linear lm_head whose weight is whole
  (not an FSDP2 shard), the ForCausalLM
  forward computes `fused_linear_cross_entropy` from the last hidden states and returns
  logits=None (the (tokens, vocab) logits are never made) and, unless use_cache=True is passed,
  no KV cache (HF's default would copy each layer's K and V into one); otherwise it returns logits as
  HuggingFace does and the loss goes through `cross_entropy`. Both shift labels and normalise
  with `num_items_in_batch` as HF's ForCausalLMLoss does; the fused loss is float32 as HF's
  is, the unfused one (eval, LoRA on lm_head) in the logits' dtype;
- generation: `model.generate(...)` runs `tritonformer.generate` (static KV cache, decode
  attention, the decode step as one CUDA graph) for the families it decodes (all but GPT-OSS)
  when every argument is one it implements (greedy or temperature / top-k / top-p sampling, eos and
  pad ids, max_new_tokens or max_length, an attention mask); any other argument, processor or
  output option goes to HF's own generate (logged at debug level).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
import types
import warnings
import weakref

import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from transformers.modeling_outputs import CausalLMOutputWithPast, MoeCausalLMOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .. import decoding, quant
from .. import runtime
from ..nn import QuantizedLinear, attention_forward
from ..ops import attention as attention_op
from ..ops.cross_entropy import cross_entropy, fused_linear_cross_entropy
from ..ops import moe as moe_op
from ..ops.moe_experts import gpt_oss_experts, moe_experts
from ..ops.norm import add_rms_norm, rms_norm
from ..ops.rope import apply_rope, qkv_rope
from ..ops.swiglu import swiglu, swiglu_mlp

ATTENTION_NAME = "tritonformer"
logger = logging.getLogger("tritonformer")
# The most memory a first step's warm-up may take for one layer's experts' weight gradients (the
# Qwen3-30B-A3B shape's 1.2 GB fit; docs/moe.md, "Warm-up").
WARM_EXPERTS_MAX_BYTES = 2**31
IGNORE_INDEX = -100


class Family:
    """Where one model family's pieces live in transformers."""

    def __init__(self, name: str, prefix: str, norm_eps: str = "variance_epsilon", norm_offset: float = 0.0,
                 swiglu_mlp: bool = True, qkv_rope: bool = True, sliding_window: str | None = None,
                 add_norm: bool = True, moe: bool = False, float32_routing: bool = False, norm: bool = True,
                 rope: bool = True, router_scoring: str = "softmax", qk_norm_after_transpose: bool = False,
                 norm_round_before_weight: bool = True, rope_half_tables: bool = False):
        self.name, self.prefix = name, prefix
        # norm, rope: whether the family's RMSNorm and its apply_rotary_pos_emb run ours.
        self.norm, self.rope = norm, rope
        # norm_round_before_weight: rms_norm's; False for GPT-OSS's norm, which multiplies by the
        # weight before it rounds.
        self.norm_round_before_weight = norm_round_before_weight
        # rope_half_tables: the rotary module makes cos and sin half the head width, each half of
        # q and k rotated by the same table (GPT-OSS's): widened to ours once a positions tensor.
        self.rope_half_tables = rope_half_tables
        # router_scoring: moe_route's scoring of the family's router.
        self.router_scoring = router_scoring
        # moe: the MLP of (some) layers is a mixture of experts whose experts module takes HF's
        # experts_implementation; swiglu_mlp then names the dense MLP class (shared experts,
        # dense layers) where the family has one.
        self.moe = moe
        # float32_routing: the router hands the experts float32 weights (Mixtral).
        self.float32_routing = float32_routing
        self.norm_eps, self.norm_offset, self.swiglu_mlp = norm_eps, norm_offset, swiglu_mlp
        # add_norm: the decoder layer's forward is Llama's pre-norm block (attention, residual
        # add, post_attention_layernorm, MLP, residual add; GPT-OSS's MLP returns the router's
        # scores beside its output, which the layer drops).
        self.add_norm = add_norm
        # qkv_rope: the attention module's forward is Llama's (projections, rope, attention,
        # o_proj); sliding_window: where the attention forward (ours or HF's) reads the window it
        # passes to the attention function ("config", "module" or None: no window).
        self.qkv_rope, self.sliding_window = qkv_rope, sliding_window
        # qk_norm_after_transpose: q and k are normalised as (B, H, S, D) views (Gemma 3), so rope
        # gets them heads-major and contiguous (Qwen3 and OLMoE normalise (B, S, H, D) first).
        self.qk_norm_after_transpose = qk_norm_after_transpose

    @functools.cached_property
    def module(self) -> types.ModuleType:
        return importlib.import_module(f"transformers.models.{self.name}.modeling_{self.name}")

    def cls(self, suffix: str) -> type:
        return getattr(self.module, f"{self.prefix}{suffix}")


FAMILIES = {
    "llama": Family("llama", "Llama"),
    "mistral": Family("mistral", "Mistral", sliding_window="config"),
    "qwen2": Family("qwen2", "Qwen2", sliding_window="module"),
    # Qwen3 normalises q and k per head between the projections and rope.
    "qwen3": Family("qwen3", "Qwen3", qkv_rope=False, sliding_window="module"),
    "gemma": Family("gemma", "Gemma", norm_eps="eps", norm_offset=1.0, swiglu_mlp=False),
    # Gemma 2: softcapped attention logits and final logits (attention's and the fused loss's
    # softcap), alternating sliding windows, a norm before and after the attention and the MLP
    # each (no residual add before a norm: HF's decoder layer), a GeGLU MLP (HF's).
    "gemma2": Family("gemma2", "Gemma2", norm_eps="eps", norm_offset=1.0, swiglu_mlp=False,
                     sliding_window="module", add_norm=False),
    # Gemma 3 (text): Gemma 2's layer with q and k norms, local and global rope tables (HF's
    # rotary module makes both), no softcaps by default.
    "gemma3_text": Family("gemma3", "Gemma3", norm_eps="eps", norm_offset=1.0, swiglu_mlp=False, qkv_rope=False,
                          sliding_window="module", add_norm=False, qk_norm_after_transpose=True),
    # Mixtures of experts: the experts run moe_experts (experts_implementation="tritonformer").
    "qwen3_moe": Family("qwen3_moe", "Qwen3Moe", qkv_rope=False, moe=True, sliding_window="module"),
    "qwen2_moe": Family("qwen2_moe", "Qwen2Moe", moe=True),  # windows come as HF's mask
    "mixtral": Family("mixtral", "Mixtral", swiglu_mlp=False, sliding_window="config", moe=True,
                      float32_routing=True),
    # OLMoE normalises the whole q and k projections between them and rope.
    "olmoe": Family("olmoe", "Olmoe", qkv_rope=False, moe=True, sliding_window="config"),
    # GPT-OSS: its router (softmax over the top k of biased logits), experts (gpt_oss_experts),
    # attention (with sinks), norms, rope and loss are ours (docs/moe.md, "GPT-OSS").
    "gpt_oss": Family("gpt_oss", "GptOss", swiglu_mlp=False, qkv_rope=False, moe=True,
                      router_scoring="topk_softmax", sliding_window="module", norm_round_before_weight=False,
                      rope_half_tables=True),
}


def _family_of(model: torch.nn.Module) -> Family:
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in FAMILIES:
        raise ValueError(f"tritonformer.integrations.hf: model_type {model_type!r} is not supported; "
                         f"supported: {', '.join(FAMILIES)}")
    return FAMILIES[model_type]


# ---- the replacements ----

# A decoder layer that ends in a residual add computes the next norm with it (add_rms_norm) and
# leaves (h, norm(h)) on that norm module under FUSED_NORM; the norm, called on exactly h, pops and
# returns it. Layers find their next norm (the next layer's input_layernorm, the model's final
# norm after the last) under NEXT_NORM, a weak reference the causal LM's forward sets up.
FUSED_NORM = "_tritonformer_fused"
NEXT_NORM = "_tritonformer_next_norm"
LINKED = "_tritonformer_linked"


def _norm_forward(family: Family):
    def forward(self, hidden_states):
        if not torch.compiler.is_compiling():
            fused = self.__dict__.pop(FUSED_NORM, None)
            if fused is not None and fused[0] is hidden_states:
                return fused[1]
        return rms_norm(hidden_states, self.weight, getattr(self, family.norm_eps), family.norm_offset,
                        family.norm_round_before_weight)
    return forward


def _link_next_norms(causal_lm: torch.nn.Module, family: Family) -> None:
    """Point each decoder layer of causal_lm at the norm that its output goes to first."""
    inner = getattr(causal_lm, "model", None)
    layers, final_norm = getattr(inner, "layers", None), getattr(inner, "norm", None)
    if layers is None or final_norm is None:
        return
    norm_cls = family.cls("RMSNorm")
    followers = [getattr(layer, "input_layernorm", None) for layer in list(layers)[1:]] + [final_norm]
    for layer, follower in zip(layers, followers):
        if type(follower) is norm_cls:
            layer.__dict__[NEXT_NORM] = weakref.ref(follower)


def _unlink_next_norms(model: torch.nn.Module) -> None:
    for module in model.modules():
        for attr in (NEXT_NORM, FUSED_NORM, LINKED, ROTARY_CACHE):
            module.__dict__.pop(attr, None)


def _is_plain_linear(module) -> bool:
    return type(module) is torch.nn.Linear


def _is_sharded(weight) -> bool:
    """A DTensor weight at forward time: lm_head is an FSDP2 unit of its own, whose weight is
    gathered only by its own forward; the fused loss reads the weight directly, so that case
    takes the logits path. (With lm_head in the root unit, as HF's `keep_full_weight` FSDP plan
    has it, the root gathers it before the model's forward and the fused loss sees it whole.)"""
    return isinstance(weight, DTensor)


def _parameters(hf_forward) -> tuple[list[str], str]:
    """(the names of a module forward's parameters after self and its first input, the name it
    gives the KV cache): wrappers take HF's arguments by name whatever their order, and
    transformers renamed past_key_values to cache in 5.2x."""
    params = [p for p in inspect.signature(hf_forward).parameters.values()
              if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)][2:]
    names = [p.name for p in params]
    return names, "cache" if "cache" in names else "past_key_values"


SILU_NAMES = ("silu", "swish")


def _mlp_forward(hf_forward):
    """The MLP's forward through swiglu when its activation is SiLU (HF's otherwise)."""

    @functools.wraps(hf_forward)
    def forward(self, x):
        if getattr(self.config, "hidden_act", "silu") not in SILU_NAMES:
            return hf_forward(self, x)
        projections = (self.gate_proj, self.up_proj, self.down_proj)
        if (all(_is_plain_linear(p) and p.bias is None for p in projections)
                and not torch.is_autocast_enabled(x.device.type)):
            return swiglu_mlp(x, self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight)
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))

    forward.tritonformer_wraps = hf_forward
    return forward


def _routes_with_moe_route(router: torch.nn.Module) -> bool:
    """Whether moe_route takes this router's experts and top k."""
    return 1 <= router.top_k <= moe_op.MAX_TOP_K and router.num_experts <= moe_op.MAX_EXPERTS


def _route_options(router: torch.nn.Module, family: Family) -> dict:
    """moe_route's normalize and weights_dtype for the router: Mixtral always renormalises and
    keeps float32 weights; the others renormalise as configured and cast to the logits' dtype."""
    if family.float32_routing:
        return dict(normalize=True, weights_dtype=torch.float32)
    if family.router_scoring != "softmax":
        return dict(scoring=family.router_scoring)
    return dict(normalize=router.norm_topk_prob, weights_dtype=None)


def _router_forward(hf_forward, family: Family):
    """The MoE router's forward with softmax, top-k, renormalisation and cast as one moe_route
    launch each way (HF's: five to seven kernels forward, more backward); HF's logits product,
    and HF's (logits, weights, indices) handed back, so its auxiliary loss sees the same logits."""

    @functools.wraps(hf_forward)
    def forward(self, hidden_states):
        if not _routes_with_moe_route(self) or torch.is_autocast_enabled(hidden_states.device.type):
            return hf_forward(self, hidden_states)
        logits = torch.nn.functional.linear(hidden_states.reshape(-1, self.hidden_dim), self.weight,
                                            getattr(self, "bias", None))
        weights, experts = moe_op.moe_route(logits, self.top_k, **_route_options(self, family))
        return logits, weights, experts

    forward.tritonformer_wraps = hf_forward
    return forward


def _attention_forward(hf_forward, family: Family):
    """The attention module's forward with q, k and v from qkv_rope when training with plain
    nn.Linear projections, under torch.compile too (HF's forward otherwise: LoRA-wrapped
    projections, autocast, inference). The rest is HF's code as it is."""

    names, cache = _parameters(hf_forward)

    @functools.wraps(hf_forward)
    def forward(self, hidden_states, *args, **kwargs):
        if args:
            kwargs.update(zip(names, args))
        position_embeddings = kwargs.get("position_embeddings")
        projections = (self.q_proj, self.k_proj, self.v_proj)
        if not (torch.is_grad_enabled() and position_embeddings is not None
                and all(_is_plain_linear(p) for p in projections)
                and not torch.is_autocast_enabled(hidden_states.device.type)):
            return hf_forward(self, hidden_states, **kwargs)
        kwargs.pop("position_embeddings")
        attention_mask = kwargs.pop("attention_mask", None)
        past = kwargs.pop(cache, None)
        cos, sin = position_embeddings
        q, k, v = qkv_rope(hidden_states, *(p.weight for p in projections), cos, sin, *(p.bias for p in projections))
        if past is not None:
            k, v = past.update(k, v, self.layer_idx)
        if family.sliding_window == "config":
            kwargs["sliding_window"] = getattr(self.config, "sliding_window", None)
        elif family.sliding_window == "module":
            kwargs["sliding_window"] = self.sliding_window
        if getattr(self, "attn_logit_softcapping", None) is not None:  # Gemma 2
            kwargs["softcap"] = self.attn_logit_softcapping
        attention_function = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation,
                                                                   family.module.eager_attention_forward)
        out, weights = attention_function(self, q, k, v, attention_mask,
                                          dropout=0.0 if not self.training else self.attention_dropout,
                                          scaling=self.scaling, **kwargs)
        return self.o_proj(out.reshape(*hidden_states.shape[:-1], -1).contiguous()), weights

    forward.tritonformer_wraps = hf_forward
    return forward


def _decoder_layer_forward(hf_forward, family: Family):
    """The decoder layer's forward with the attention's residual add fused into
    post_attention_layernorm (add_rms_norm), when that norm is the family's RMSNorm and the two
    summands share a dtype (not so under autocast with float32 weights); HF's code otherwise."""
    norm_cls = family.cls("RMSNorm")

    names, _ = _parameters(hf_forward)

    @functools.wraps(hf_forward)
    def forward(self, hidden_states, *args, **kwargs):
        if args:
            kwargs.update(zip(names, args))
        norm = self.post_attention_layernorm
        if type(norm) is not norm_cls:
            return hf_forward(self, hidden_states, **kwargs)
        residual = hidden_states
        # HF's layer hands the attention every argument it was given, by name.
        attention_out, _ = self.self_attn(hidden_states=self.input_layernorm(hidden_states), **kwargs)
        if attention_out.dtype == residual.dtype and attention_out.shape == residual.shape:
            hidden_states, residual = add_rms_norm(attention_out, residual, norm.weight, getattr(norm, family.norm_eps),
                                                   family.norm_offset, family.norm_round_before_weight)
        else:
            residual = residual + attention_out
            hidden_states = norm(residual)
        mlp_out = self.mlp(hidden_states)
        if isinstance(mlp_out, tuple):  # GPT-OSS's: (output, router scores)
            mlp_out = mlp_out[0]
        next_norm = self.__dict__.get(NEXT_NORM)
        next_norm = next_norm() if next_norm is not None else None
        # Not under gradient checkpointing: its recomputation runs the layers backwards, so a
        # result left for the next layer's norm would never be taken and would hold memory. Not
        # for a layer that is an FSDP2 unit: the next norm's weight belongs to another unit, whose
        # gathered weight exists only around that unit's own forward and backward.
        if (next_norm is None or mlp_out.dtype != residual.dtype or mlp_out.shape != residual.shape
                or getattr(self, "gradient_checkpointing", False) and self.training
                or isinstance(self, FSDPModule) or torch.compiler.is_compiling()):
            return residual + mlp_out
        normed, out = add_rms_norm(mlp_out, residual, next_norm.weight, getattr(next_norm, family.norm_eps),
                                   family.norm_offset, family.norm_round_before_weight)
        next_norm.__dict__[FUSED_NORM] = (out, normed)
        return out

    forward.tritonformer_wraps = hf_forward
    return forward


# ---- the training step's prelude: positions 0..S-1 as one tensor we own ----
#
# Without position_ids HF makes arange(S) afresh each forward, checks it for packed sequences
# (a host synchronisation) and recomputes the rotary tables from it: work at the start of each
# step, while the GPU waits for the host. The training forward passes this tensor instead; the
# packing check knows it (it is never packed) and the rotary embedding keeps its tables for it.
_DEFAULT_POSITIONS: dict[tuple, torch.Tensor] = {}
# Under torch.compile HF makes the positions inside the graph, where the packing check can neither
# look at them (data-dependent) nor tell ours by address, and a mask would follow (SDPA instead
# of our kernel): the training forward sets this while it traces a forward given no positions,
# mask or cache, and dynamo reads it as a constant. Eager calls never read it.
_TRACING_DEFAULT_POSITIONS = False
ROTARY_CACHE = "_tritonformer_rotary"


def _default_positions(seq: int, device: torch.device) -> torch.Tensor:
    key = (seq, device)
    if key not in _DEFAULT_POSITIONS:
        _DEFAULT_POSITIONS[key] = torch.arange(seq, device=device)[None]
    return _DEFAULT_POSITIONS[key]


def _default_positions_like(position_ids: torch.Tensor) -> torch.Tensor | None:
    """Our positions tensor of position_ids' length and device, if there is one."""
    return _DEFAULT_POSITIONS.get((position_ids.shape[-1], position_ids.device))


def _views_default_positions(position_ids: torch.Tensor) -> bool:
    """Whether position_ids is one of our tensors of positions, or a view of it over all its
    positions (HF's expand to the batch)."""
    if position_ids.dim() != 2:
        return False
    ours = _default_positions_like(position_ids)
    return (ours is not None and position_ids.data_ptr() == ours.data_ptr() and position_ids.dtype == ours.dtype
            and (position_ids.shape[-1] == 1 or position_ids.stride(-1) == 1))


def _wrap_packed_sequence_check() -> None:
    """masking_utils.find_packed_sequence_indices answers None (not packed) for our positions
    without looking at them; other position_ids go to HF's check (idempotent)."""
    from transformers import masking_utils

    hf_check = masking_utils.find_packed_sequence_indices
    if getattr(hf_check, "tritonformer_wraps", None) is not None:
        return

    @functools.wraps(hf_check)
    def find_packed_sequence_indices(position_ids):
        if (_TRACING_DEFAULT_POSITIONS if torch.compiler.is_compiling() else _views_default_positions(position_ids)):
            return None
        return hf_check(position_ids)

    find_packed_sequence_indices.tritonformer_wraps = hf_check
    masking_utils.find_packed_sequence_indices = find_packed_sequence_indices


def _rotary_forward(hf_forward, family: Family):
    """The rotary embedding's forward, keeping its (cos, sin) for our positions tensor while its
    inverse frequencies stay the same tensor (rope types whose frequencies never change); half-width
    tables (family.rope_half_tables) widened to the head width, as apply_rope takes them."""

    def tables_of(self, x, position_ids, *args, **kwargs):
        cos, sin = hf_forward(self, x, position_ids, *args, **kwargs)
        return _widened(cos, sin) if family.rope_half_tables and family.rope else (cos, sin)

    @functools.wraps(hf_forward)
    def forward(self, x, position_ids, *args, **kwargs):
        # Gemma 3's tables per layer type (a third argument) are HF's to make.
        if (args or kwargs or torch.compiler.is_compiling()
                or getattr(self, "rope_type", None) not in decoding.STATIC_ROPE_TYPES
                or position_ids is not _default_positions_like(position_ids)):
            return tables_of(self, x, position_ids, *args, **kwargs)
        key = (x.dtype, x.device, self.inv_freq._version, self.attention_scaling)
        # One entry per positions tensor (per sequence length), kept while the model lives: a
        # CUDA graph of a step at one length reads its tables at their addresses even after
        # steps at other lengths (capture_step).
        tables = self.__dict__.setdefault(ROTARY_CACHE, {})
        cached = tables.get(id(position_ids))
        if cached is not None and cached[0] is position_ids and cached[1] is self.inv_freq and cached[2] == key:
            return cached[3]
        out = tables_of(self, x, position_ids)
        tables[id(position_ids)] = (position_ids, self.inv_freq, key, out)
        return out

    forward.tritonformer_wraps = hf_forward
    return forward


def _apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    layouts = {1: "bhsd", 2: "bshd"}
    if unsqueeze_dim not in layouts:
        raise ValueError(f"apply_rotary_pos_emb: unsqueeze_dim must be 1 or 2, got {unsqueeze_dim}")
    return apply_rope(q, k, cos, sin, layout=layouts[unsqueeze_dim])


def _apply_rotary_pos_emb_half_tables(q, k, cos, sin, unsqueeze_dim=1):
    """_apply_rotary_pos_emb for a family whose rotary module makes half-width tables: a patched
    model's come widened (_rotary_forward), an unpatched model of the family (its module-level
    function is this one too) hands them as HF made them."""
    if 2 * cos.shape[-1] == q.shape[-1]:
        cos, sin = _widened(cos, sin)
    return _apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim)


def _widened(cos, sin):
    """Half-width rotary tables as apply_rope takes them: each half of the head rotated by the same
    table is Llama's rotation by the table repeated."""
    return torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)


def _shifted_labels(labels, shift_labels, ignore_index):
    """HF's ForCausalLMLoss targets: labels shifted left by one, the last position ignored."""
    if shift_labels is not None:
        return shift_labels
    return torch.nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]


def causal_lm_loss(logits, labels, vocab_size=None, num_items_in_batch=None, ignore_index=IGNORE_INDEX,
                   shift_labels=None, **kwargs):
    """HF's ForCausalLMLoss through tritonformer's cross_entropy (mean over the tokens not ignored,
    or their sum over num_items_in_batch)."""
    target = _shifted_labels(labels, shift_labels, ignore_index).to(logits.device)
    logits = logits.reshape(-1, logits.shape[-1])
    target = target.reshape(-1)
    if num_items_in_batch is None:
        return cross_entropy(logits, target, ignore_index, "mean")
    loss = cross_entropy(logits, target, ignore_index, "sum")
    if isinstance(num_items_in_batch, torch.Tensor):
        num_items_in_batch = num_items_in_batch.to(loss.device)
    return loss / num_items_in_batch


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _warm_step(model: torch.nn.Module, family: Family, batch: int, seq: int) -> None:
    """Ready the Triton kernels of a training step of `model` on (batch, seq) tokens: each op of
    the step's first layer and its loss, called as the patched forward calls it, goes through
    runtime.warm (its launches only compile) on unwritten tensors laid out as the step's own
    activations and parameters. A first step then waits for the slowest of
    these compiles rather than for their sum. A guess that misses (another layout, say) costs a
    compile, never a wrong result: the real launch compiles its own."""
    config = model.config
    dtype, device = model.lm_head.weight.dtype, model.lm_head.weight.device
    hidden_size, heads, kv_heads = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
    head_dim = _head_dim(config)
    layer = model.model.layers[0]

    def activation(*shape):
        return torch.empty(*shape, dtype=dtype, device=device, requires_grad=True)

    # Stand-ins for the parameters, not the parameters: this thread must not read weights that
    # FSDP shards or gathers meanwhile (or start a collective on them).
    def like(p, grad=True):
        return None if p is None else torch.empty(p.shape, dtype=p.dtype, device=device,
                                                  requires_grad=grad and p.requires_grad)

    x = activation(batch, seq, hidden_size)
    norm = layer.input_layernorm
    if family.norm:
        runtime.warm(rms_norm, x, like(norm.weight), getattr(norm, family.norm_eps), family.norm_offset,
                     family.norm_round_before_weight)
    norm = layer.post_attention_layernorm
    if family.add_norm:
        runtime.warm(add_rms_norm, x, activation(batch, seq, hidden_size), like(norm.weight),
                     getattr(norm, family.norm_eps), family.norm_offset, family.norm_round_before_weight)

    # q, k, v as the projections hand them over: (B, S, heads * D) viewed as (B, heads, S, D).
    def heads_view(n):
        return activation(batch, seq, n * head_dim).view(batch, seq, n, head_dim).transpose(1, 2)

    cos = sin = torch.empty(1, seq, head_dim, dtype=dtype, device=device)
    attention = layer.self_attn
    # Qwen3's q and k norms, over the heads of the projections' (B, S, heads, D) views; OLMoE's
    # over the whole projections.
    for name, n in (("q_norm", heads), ("k_norm", kv_heads)):
        norm = getattr(attention, name, None)
        if type(norm) is family.cls("RMSNorm"):
            shape = (batch, seq, n, head_dim) if norm.weight.numel() == head_dim else (batch, seq, n * head_dim)
            runtime.warm(rms_norm, activation(*shape), like(norm.weight), getattr(norm, family.norm_eps),
                         family.norm_offset, family.norm_round_before_weight)
    projections = (attention.q_proj, attention.k_proj, attention.v_proj)
    if family.qkv_rope and all(_is_plain_linear(p) for p in projections):
        runtime.warm(qkv_rope, x, *(like(p.weight) for p in projections), cos, sin, *(like(p.bias) for p in projections))
    elif family.rope and family.qk_norm_after_transpose:
        runtime.warm(apply_rope, activation(batch, heads, seq, head_dim), activation(batch, kv_heads, seq, head_dim),
                     cos, sin)
    elif family.rope:
        runtime.warm(apply_rope, heads_view(heads), heads_view(kv_heads), cos, sin)
    # nn.attention_forward's calls, when it is the model's attention: one per kind of layer
    # (sliding and full ones alternate in Gemma 2 and 3); a window shorter than the sequence goes
    # to HF's mask instead where the attention is not handed the window (attention_mask).
    def sliding_window(module):
        return {"config": getattr(config, "sliding_window", None),
                "module": getattr(module, "sliding_window", None)}.get(family.sliding_window)

    # Every window reaches the kernel: the attention is handed it, and the mask interface leaves
    # HF's sliding mask out (attention_mask).
    slidings = {sliding_window(layer.self_attn) for layer in model.model.layers}
    windows = {None if w is None else w - 1 for w in slidings}
    sinks = getattr(attention, "sinks", None)
    for window in windows if config._attn_implementation == ATTENTION_NAME else ():
        runtime.warm(attention_op.attention, heads_view(heads), heads_view(kv_heads), heads_view(kv_heads), True,
                     attention.scaling, window, softcap=getattr(attention, "attn_logit_softcapping", None),
                     sinks=None if sinks is None else like(sinks))

    # _mlp_forward's calls: the layer's MLP, or an MoE block's shared expert.
    dense = [m for m in layer.mlp.modules() if family.swiglu_mlp and type(m) is family.cls("MLP")]
    for mlp in dense if getattr(config, "hidden_act", "silu") in SILU_NAMES else ():
        if all(_is_plain_linear(p) and p.bias is None for p in (mlp.gate_proj, mlp.up_proj, mlp.down_proj)):
            runtime.warm(swiglu_mlp, x, like(mlp.gate_proj.weight), like(mlp.up_proj.weight), like(mlp.down_proj.weight))
        else:
            width = mlp.gate_proj.out_features
            runtime.warm(swiglu, activation(batch, seq, width), activation(batch, seq, width))
    # _router_forward's call (GPT-OSS names its router "router").
    router = getattr(layer.mlp, "gate", None) or getattr(layer.mlp, "router", None)
    if family.moe and type(router) is family.cls("TopKRouter") and _routes_with_moe_route(router):
        runtime.warm(moe_op.moe_route, activation(batch * seq, router.num_experts), router.top_k,
                     **_route_options(router, family))
    # _experts_forward's call, routed tokens of the batch to expert 0 (the kernels depend on shapes
    # and dtypes only). The experts' weights are too large for stand-ins: the warm-up takes them
    # as they are (compile-only launches read nothing), and only their gradients take memory, so
    # sharded experts, or ones whose gradients pass WARM_EXPERTS_MAX_BYTES, compile on the first step.
    experts = getattr(layer.mlp, "experts", None)
    names = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")
    weights = [getattr(experts, name, None) for name in names]
    warm_experts = (family.moe and experts is not None and not any(_is_sharded(w) for w in weights if w is not None)
                    and sum(w.numel() * w.element_size() for w in weights if w is not None and w.requires_grad)
                    <= WARM_EXPERTS_MAX_BYTES)
    aliases = [None if w is None else w.detach().requires_grad_(w.requires_grad) for w in weights]
    if warm_experts and _runs_moe_experts(experts, dtype):
        k = config.num_experts_per_tok
        routing = torch.float32 if family.float32_routing else dtype
        runtime.warm(moe_experts, activation(batch * seq, hidden_size),
                     torch.zeros(batch * seq, k, dtype=torch.long, device=device),
                     torch.empty(batch * seq, k, dtype=routing, device=device, requires_grad=True),
                     aliases[0], aliases[2])
    elif warm_experts and _runs_gpt_oss_experts(experts, dtype):
        k = config.num_experts_per_tok
        runtime.warm(gpt_oss_experts, activation(batch * seq, hidden_size),
                     torch.zeros(batch * seq, k, dtype=torch.long, device=device),
                     torch.empty(batch * seq, k, dtype=dtype, device=device, requires_grad=True),
                     *aliases, experts.alpha, experts.limit)

    target = torch.zeros(batch * seq, dtype=torch.long, device=device)
    # The weight's gradient is a cuBLAS product (no kernel of ours): its stand-in needs none, and
    # the warm-up allocates no (vocab, hidden) buffer.
    runtime.warm(fused_linear_cross_entropy, activation(batch * seq, hidden_size), like(model.lm_head.weight, False),
                 target, like(model.lm_head.bias, False), IGNORE_INDEX,
                 softcap=getattr(config, "final_logit_softcapping", None))


def _causal_lm_forward(hf_forward, family: Family):
    """ForCausalLM.forward with the fused linear cross-entropy in training (see the module doc)."""

    names, cache = _parameters(hf_forward)

    @functools.wraps(hf_forward)
    def forward(self, input_ids=None, *args, **kwargs):
        if args:
            kwargs.update(zip(names, args))
        if family.add_norm and LINKED not in self.__dict__:
            _link_next_norms(self, family)
            self.__dict__[LINKED] = True
        labels, logits_to_keep = kwargs.get("labels"), kwargs.get("logits_to_keep", 0)
        # logits_to_keep with labels is HF's to reject (their batch sizes differ).
        fused = (labels is not None and self.training and _is_plain_linear(self.lm_head)
                 and not _is_sharded(self.lm_head.weight) and isinstance(logits_to_keep, int) and logits_to_keep == 0)
        if not fused:
            return hf_forward(self, input_ids, **kwargs)
        for name in ("labels", "logits_to_keep"):
            kwargs.pop(name, None)
        if input_ids is not None and torch.is_grad_enabled() and not torch.is_autocast_enabled(input_ids.device.type):
            runtime.compile_ahead(("hf_step", family.name, tuple(input_ids.shape), self.lm_head.weight.dtype),
                                  _warm_step, self, family, *input_ids.shape)
        # (past_key_values: where transformers renamed it cache, the old name is still taken.)
        default_positions = (kwargs.get("position_ids") is None and kwargs.get("attention_mask") is None
                             and kwargs.get(cache) is None and kwargs.get("past_key_values") is None
                             and not kwargs.get("use_cache") and input_ids is not None)
        compiling = torch.compiler.is_compiling()
        if default_positions and not compiling:
            kwargs["position_ids"] = _default_positions(input_ids.shape[1], input_ids.device)
        num_items_in_batch = kwargs.pop("num_items_in_batch", None)
        shift_labels = kwargs.pop("shift_labels", None)
        ignore_index = kwargs.pop("ignore_index", IGNORE_INDEX)
        return_dict = kwargs.pop("return_dict", None)
        if return_dict is None:
            return_dict = getattr(self.config, "return_dict", True)
        # A loss-only step never reads a KV cache; HF's default (config.use_cache) would copy every
        # layer's K and V into one. An explicit use_cache=True still gets it.
        kwargs["use_cache"] = bool(kwargs.get("use_cache"))
        # An MoE model asked for its router logits adds HF's load-balancing loss to the loss.
        router_logits = kwargs.get("output_router_logits")
        if router_logits is None:  # as HF reads it: None means the config's
            router_logits = getattr(self.config, "output_router_logits", False)
        router_logits = family.moe and bool(router_logits)
        if family.moe:
            kwargs["output_router_logits"] = router_logits
        global _TRACING_DEFAULT_POSITIONS
        _TRACING_DEFAULT_POSITIONS = default_positions and compiling
        try:
            outputs = self.model(input_ids=input_ids, **kwargs)
        finally:
            _TRACING_DEFAULT_POSITIONS = False
        hidden = outputs.last_hidden_state
        target = _shifted_labels(labels, shift_labels, ignore_index).to(hidden.device)
        weight, bias = self.lm_head.weight, self.lm_head.bias
        if torch.is_autocast_enabled(hidden.device.type):
            # What autocast does to an nn.Linear: both operands in its dtype.
            dtype = torch.get_autocast_dtype(hidden.device.type)
            hidden, weight = hidden.to(dtype), weight.to(dtype)
            bias = None if bias is None else bias.to(dtype)
        # Gemma 2's final-logit softcapping, inside the fused loss.
        loss = fused_linear_cross_entropy(hidden.reshape(-1, hidden.shape[-1]), weight, target.reshape(-1), bias,
                                          ignore_index, num_items_in_batch=num_items_in_batch,
                                          softcap=getattr(self.config, "final_logit_softcapping", None))
        extra = dict(aux_loss=None, router_logits=None) if family.moe else {}
        if router_logits:
            extra["router_logits"] = outputs.router_logits
            extra["aux_loss"] = family.module.load_balancing_loss_func(
                outputs.router_logits, self.num_experts, self.num_experts_per_tok, kwargs.get("attention_mask"))
            loss = loss + self.router_aux_loss_coef * extra["aux_loss"].to(loss.device)
        output_cls = MoeCausalLMOutputWithPast if family.moe else CausalLMOutputWithPast
        out = output_cls(loss=loss, logits=None, hidden_states=outputs.hidden_states,
                         attentions=outputs.attentions, **{cache: getattr(outputs, cache)}, **extra)
        return out if return_dict else out.to_tuple()

    forward.tritonformer_wraps = hf_forward
    return forward


# ---- registration ----

def attention_mask(**kwargs) -> torch.Tensor | None:
    """The mask interface of attn_implementation="tritonformer". None (our kernel's causal mask,
    aligned bottom-right) for a causal mask without padding whose queries end at the last key,
    whatever HF's tracing state: HF's SDPA mask builds the full (S, S) mask while a CUDA graph
    captures or torch.compile traces; also for HF's sliding-window causal mask without padding,
    in the families whose attention gets the window as an argument (Family.sliding_window set;
    Qwen2-MoE's windows come as HF's mask alone). HF's SDPA mask otherwise, made explicit where HF
    skipped it because SDPA aligns a causal mask top-left: queries that start at 0 of a longer
    cache (a static cache's prefill) need the keys after them hidden (docs/training.md)."""
    from transformers.masking_utils import causal_mask_function, sdpa_mask

    q_offset, q_length, kv_length = kwargs.get("q_offset", 0), kwargs.get("q_length"), kwargs.get("kv_length")
    queries_end_at_last_key = (isinstance(q_offset, int) and kwargs.get("kv_offset", 0) == 0
                               and q_offset + q_length == kv_length)
    window, padding = kwargs.get("local_size"), kwargs.get("attention_mask")
    if window is None:
        ours = kwargs.get("mask_function") is causal_mask_function and kwargs.get("allow_is_causal_skip", True)
        no_padding = padding is None
    else:
        # HF's sliding-window causal mask: HF turns allow_is_causal_skip off (or passes it False)
        # whenever it adds to the mask (packed sequences, blockwise or custom functions,
        # bidirectional windows), and the window is the config's (no chunked attention here).
        config = kwargs.get("config")
        family = FAMILIES.get(getattr(config, "model_type", None))
        ours = (family is not None and family.sliding_window is not None
                and kwargs.get("allow_is_causal_skip") is True and window == getattr(config, "sliding_window", None))
        # A tokenizer's all-ones mask is no padding (HF skips it the same way for causal masks);
        # looked at only where looking does not break a trace or a capture.
        tracing = torch.compiler.is_compiling() or (padding is not None and padding.is_cuda
                                                    and torch.cuda.is_current_stream_capturing())
        no_padding = padding is None or (not tracing and bool(padding.all()))
    if queries_end_at_last_key and ours and no_padding:
        return None
    mask = sdpa_mask(**kwargs)
    if mask is None and q_length != kv_length and not queries_end_at_last_key:
        mask = sdpa_mask(**dict(kwargs, allow_is_causal_skip=False))
    return mask


def register_attention() -> None:
    """Make attn_implementation="tritonformer" available (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTENTION_NAME, attention_forward)
    AttentionMaskInterface.register(ATTENTION_NAME, attention_mask)
    _wrap_packed_sequence_check()


def _experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """experts_implementation="tritonformer": SwiGLU experts in HF's default layout (gate rows then
    up rows of gate_up_proj (E, 2I, H), down_proj (E, H, I), no biases, HF's own gate function)
    run `moe_experts`; GPT-OSS's experts run `gpt_oss_experts`; any other layout runs HF's
    grouped_mm path."""
    from transformers.integrations.moe import grouped_mm_experts_forward

    if not torch.is_autocast_enabled(hidden_states.device.type):
        if _runs_moe_experts(self, hidden_states.dtype):
            return moe_experts(hidden_states, top_k_index, top_k_weights, self.gate_up_proj, self.down_proj)
        if _runs_gpt_oss_experts(self, hidden_states.dtype):
            return gpt_oss_experts(hidden_states, top_k_index, top_k_weights, self.gate_up_proj,
                                   self.gate_up_proj_bias, self.down_proj, self.down_proj_bias, self.alpha, self.limit)
    return grouped_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights)


def _runs_gpt_oss_experts(experts: torch.nn.Module, dtype: torch.dtype) -> bool:
    """Whether an HF experts module is GPT-OSS's (its own gate function, transposed interleaved
    weights with biases), every weight in the activations' dtype."""
    try:
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts
    except ImportError:
        return False
    return (getattr(type(experts), "_apply_gate", None) is GptOssExperts._apply_gate
            and getattr(experts, "has_bias", False) and getattr(experts, "is_transposed", False)
            and all(getattr(experts, name, None) is not None and getattr(experts, name).dtype == dtype
                    for name in ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")))


def _experts_are_the_familys(model: torch.nn.Module, family: Family) -> bool:
    """Whether every experts module of the model is the family's own class (a quantized one,
    FP8's say, dispatches through a table of its own that has no "tritonformer")."""
    own = family.cls("Experts")
    experts = [m for m in model.modules() if type(m).__name__.endswith("Experts")]
    return bool(experts) and all(type(m) is own for m in experts)


def _runs_moe_experts(experts: torch.nn.Module, dtype: torch.dtype) -> bool:
    """Whether an HF experts module computes what moe_experts does: SiLU, HF's own gate function
    (a family's own, a clamped or scaled SwiGLU, is not), gate rows then up rows, no biases,
    weights of the activations' dtype."""
    from transformers.integrations.moe import _default_apply_gate

    return (getattr(getattr(experts, "config", None), "hidden_act", None) in SILU_NAMES
            and getattr(type(experts), "_apply_gate", None) is _default_apply_gate
            and getattr(experts, "has_gate", True) and not getattr(experts, "has_bias", False)
            and not getattr(experts, "is_transposed", False) and getattr(experts, "is_concatenated", True)
            and getattr(experts, "gate_up_proj", None) is not None and experts.gate_up_proj.dtype == dtype)


def register_experts() -> None:
    """Make experts_implementation="tritonformer" available for HF's MoE models (idempotent)."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    ALL_EXPERTS_FUNCTIONS.register(ATTENTION_NAME, _experts_forward)


# Class-level patches: (owner, attribute) -> original value. The rope function is module-level,
# shared by every model of a family: it stays patched while the family is patched by class or
# any model of it patched by patch() is alive and not unpatched (_ROPE_USERS, weakly held).
_CLASS_PATCHES: dict[tuple, object] = {}
_ROPE_USERS: dict[str, weakref.WeakSet] = {}


def _hf_forward(cls: type):
    """cls's HuggingFace forward, also when patch_<family>() has wrapped it."""
    return getattr(cls.forward, "tritonformer_wraps", cls.forward)


def _set(owner, attr: str, value) -> None:
    key = (owner, attr)
    if key not in _CLASS_PATCHES:
        _CLASS_PATCHES[key] = owner.__dict__.get(attr)
    setattr(owner, attr, value)


def _restore(owner, attr: str) -> None:
    original = _CLASS_PATCHES.pop((owner, attr), None)
    if original is not None:
        setattr(owner, attr, original)


def _patch_rope(family: Family, model: torch.nn.Module | None = None) -> None:
    if not family.rope:
        return
    if model is not None:
        _ROPE_USERS.setdefault(family.name, weakref.WeakSet()).add(model)
    _set(family.module, "apply_rotary_pos_emb",
         _apply_rotary_pos_emb_half_tables if family.rope_half_tables else _apply_rotary_pos_emb)


def _unpatch_rope(family: Family, model: torch.nn.Module | None = None) -> None:
    users = _ROPE_USERS.get(family.name, weakref.WeakSet())
    if model is not None:
        users.discard(model)
    class_patched = (family.cls("RMSNorm"), "forward") in _CLASS_PATCHES
    if not users and not class_patched:
        _restore(family.module, "apply_rotary_pos_emb")


def _replacements(family: Family) -> dict[type, object]:
    """The family's classes that get a forward of ours, each with that forward (built around
    HF's own, also when a class patch already wraps it)."""
    cls = family.cls
    forwards = {cls("RMSNorm"): _norm_forward(family)} if family.norm else {}
    if family.swiglu_mlp:
        forwards[cls("MLP")] = _mlp_forward(_hf_forward(cls("MLP")))
    if family.qkv_rope:
        forwards[cls("Attention")] = _attention_forward(_hf_forward(cls("Attention")), family)
    if family.add_norm:
        forwards[cls("DecoderLayer")] = _decoder_layer_forward(_hf_forward(cls("DecoderLayer")), family)
    if family.moe:
        forwards[cls("TopKRouter")] = _router_forward(_hf_forward(cls("TopKRouter")), family)
    forwards[cls("RotaryEmbedding")] = _rotary_forward(_hf_forward(cls("RotaryEmbedding")), family)
    forwards[cls("ForCausalLM")] = _causal_lm_forward(_hf_forward(cls("ForCausalLM")), family)
    return forwards


def _patch_family(name: str) -> None:
    family = FAMILIES[name]
    register_attention()
    for owner, forward in _replacements(family).items():
        _set(owner, "forward", forward)
    _patch_rope(family)


def _unpatch_family(name: str) -> None:
    family = FAMILIES[name]
    for cls_suffix in ("RMSNorm", "MLP", "Attention", "DecoderLayer", "TopKRouter", "RotaryEmbedding", "ForCausalLM"):
        owner = getattr(family.module, family.prefix + cls_suffix, None)  # Mixtral has no dense MLP
        if owner is not None:
            _restore(owner, "forward")
    _unpatch_rope(family)


def patch_llama() -> None:
    """Patch the Llama classes: every LlamaForCausalLM created afterwards runs tritonformer's
    norms, MLP, rope and loss; create it with attn_implementation="tritonformer" for attention."""
    _patch_family("llama")


def patch_mistral() -> None:
    """patch_llama for Mistral."""
    _patch_family("mistral")


def patch_qwen2() -> None:
    """patch_llama for Qwen2."""
    _patch_family("qwen2")


def patch_qwen3() -> None:
    """patch_llama for Qwen3 (its per-head q/k norms are RMSNorms too)."""
    _patch_family("qwen3")


def patch_gemma() -> None:
    """patch_llama for Gemma, without the MLP (GeGLU, not SwiGLU)."""
    _patch_family("gemma")


def patch_gemma2() -> None:
    """patch_gemma for Gemma 2 (softcapped attention and loss, HF's decoder layer)."""
    _patch_family("gemma2")


def patch_gemma3() -> None:
    """patch_gemma for Gemma 3's text model (q and k norms, HF's attention forward)."""
    _patch_family("gemma3_text")


def unpatch_family(name: str) -> None:
    """Undo patch_<name>()."""
    if name not in FAMILIES:
        raise ValueError(f"unknown family {name!r}; supported: {', '.join(FAMILIES)}")
    _unpatch_family(name)


# ---- one model ----

# The decoder layers' projections that weights= quantizes (attention and dense MLP; not routers,
# experts or lm_head).
QUANTIZED_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _quantize_projections(base: torch.nn.Module, fmt: str, lm_head: bool) -> None:
    if fmt not in quant.FORMATS:
        raise ValueError(f"tritonformer.integrations.hf.patch: weights must be one of {', '.join(quant.FORMATS)}, "
                         f"got {fmt!r}")
    layers = base.model.layers
    dtypes = {p.dtype for layer in layers for p in layer.parameters()}
    if dtypes != {torch.bfloat16}:
        raise ValueError(f"tritonformer.integrations.hf.patch: weights={fmt!r} takes a bfloat16 model (its "
                         f"activations stay bf16), got parameters of {sorted(map(str, dtypes))}")
    decoding.release(base)  # its captured step reads the bf16 weights
    for layer in layers:
        for owner in (layer.self_attn, layer.mlp):
            for name in QUANTIZED_PROJECTIONS:
                linear = getattr(owner, name, None)
                if type(linear) is torch.nn.Linear:
                    setattr(owner, name, QuantizedLinear.from_linear(linear, fmt))
    if lm_head and type(base.lm_head) is not QuantizedLinear:
        if type(base.lm_head) is not torch.nn.Linear:
            raise ValueError(f"tritonformer.integrations.hf.patch: quantize_lm_head=True takes a plain nn.Linear "
                             f"lm_head, got a {type(base.lm_head).__name__}")
        base.lm_head = QuantizedLinear.from_linear(base.lm_head, fmt)
        # Untied from the embedding for good: HF's tie_weights would set a bf16 weight on it.
        base.config.tie_word_embeddings = False


def patch(model: torch.nn.Module, attention: bool = True, weights: str | None = None,
          quantize_lm_head: bool = False) -> torch.nn.Module:
    """Patch one model (a transformers Llama, Mistral, Qwen2, Qwen3, Gemma, Gemma 2, Gemma 3 (text),
    Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE or GPT-OSS model, also inside a PEFT wrapper) in place and return it; patching
    twice is harmless. attention=False keeps the model's attention implementation, and so does a
    head dim the attention kernels do not take (with a warning). MoE models' experts run
    moe_experts (GPT-OSS's gpt_oss_experts; its attention, sinks included, its norms with the
    residual adds and its rope are ours).

    weights="nvfp4" | "mxfp4" | "mxfp8" (a bf16 model): the decoder layers' attention and dense MLP
    projections become block-scaled `nn.QuantizedLinear` modules, weight-only (activations bf16,
    the products in scaled_matmul: decoding reads 3.6-1.9x fewer weight bytes); the embedding and
    lm_head stay bf16 (the logits' precision; a tied lm_head is the embedding), unless
    quantize_lm_head=True: then lm_head gets a block-scaled copy of its weight (untied from the
    embedding, which stays bf16), read at a fraction of the bytes, and the logits carry its
    rounding (greedy tokens can differ from the bf16 lm_head's where two logits are close). The
    weights are frozen (their inputs still get gradients, as for adapters) and unpatch leaves them
    quantized: the conversion cannot be undone."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    family = _family_of(base)
    if quantize_lm_head and weights is None:
        raise ValueError("tritonformer.integrations.hf.patch: quantize_lm_head=True takes weights= (its format)")
    if weights is not None:
        _quantize_projections(base, weights, quantize_lm_head)
    state = getattr(base, "_tritonformer", None)
    if state is not None:
        return model
    config = base.config
    head_dim = _head_dim(config)
    if attention and head_dim not in attention_op.HEAD_DIMS:
        warnings.warn(f"tritonformer: head_dim {head_dim} is not one of the attention kernels' "
                      f"({', '.join(map(str, attention_op.HEAD_DIMS))}): the model keeps its attention "
                      f"({config._attn_implementation}); the other ops are patched", stacklevel=2)
        attention = False
    # First: it is the step that can refuse (transformers' own checks), before anything changed.
    previous_experts = None
    if family.moe and _experts_are_the_familys(base, family):
        previous_experts = base.config._experts_implementation
        base.set_experts_implementation(ATTENTION_NAME)
    forwards = _replacements(family)
    causal_lm = family.cls("ForCausalLM")
    previous_loss = {}
    patched = []
    for module in base.modules():
        forward = forwards.get(type(module))
        if forward is None:
            continue
        module.forward = types.MethodType(forward, module)
        if type(module) is causal_lm:
            previous_loss[module] = module.__dict__.get("_loss_function")
            module.loss_function = causal_lm_loss
        patched.append(module)
    _patch_rope(family, base)
    # Restores HF's rope once no patched model of the family is left, unpatched or not.
    weakref.finalize(base, _unpatch_rope, family)
    previous_attention = base.config._attn_implementation
    if attention:
        register_attention()
        base.set_attn_implementation(ATTENTION_NAME)
    base.generate = types.MethodType(_generate, base)
    base._tritonformer = (family, patched, previous_attention if attention else None, previous_loss,
                          previous_experts)
    return model


# What HF's generate applies beyond what tritonformer.generate implements, as (its generation
# config's attribute, the value that applies nothing; None, unset, too); a config with any other value, or an
# argument of generate other than the prompt, its mask and generation options, goes to HF's.
HF_ONLY_GENERATION = (
    ("num_beams", 1), ("num_return_sequences", 1), ("penalty_alpha", None), ("dola_layers", None),
    ("repetition_penalty", 1.0), ("encoder_repetition_penalty", 1.0), ("no_repeat_ngram_size", 0),
    ("encoder_no_repeat_ngram_size", 0), ("bad_words_ids", None), ("force_words_ids", None), ("min_new_tokens", None),
    ("typical_p", 1.0), ("epsilon_cutoff", 0.0), ("eta_cutoff", 0.0), ("min_p", None), ("top_h", None),
    ("forced_bos_token_id", None), ("forced_eos_token_id", None), ("suppress_tokens", None),
    ("begin_suppress_tokens", None), ("sequence_bias", None), ("guidance_scale", None),
    ("exponential_decay_length_penalty", None), ("renormalize_logits", False), ("remove_invalid_values", False),
    ("watermarking_config", None), ("output_scores", False), ("output_logits", False), ("output_attentions", False),
    ("output_hidden_states", False), ("return_dict_in_generate", False), ("cache_implementation", None),
    ("use_cache", True), ("stop_strings", None), ("max_time", None), ("prompt_lookup_num_tokens", None),
    ("assistant_early_exit", None), ("token_healing", False), ("low_memory", None), ("use_mtp", False),
    ("constraints", None), ("is_assistant", False),
)


def _token_ids(value) -> list[int] | None:
    """An eos or pad argument as HF takes it (an int, a list, a tensor) as ints; None if absent."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        value = value.tolist()
    values = value if isinstance(value, (list, tuple)) else [value]
    return [int(v.item()) if isinstance(v, torch.Tensor) else int(v) for v in values]


def _runs_synced(model) -> bool:
    """Whether HF's generate would step this model's ranks in lockstep (synced_gpus): ZeRO-3 or
    FSDP across processes."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()
            and torch.distributed.get_world_size() > 1):
        return False
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled
    return is_deepspeed_zero3_enabled() or any(isinstance(m, FSDPModule) for m in model.modules())


def _decoding_request(model, args: tuple, kwargs: dict) -> dict | None:
    """generate's arguments for a call of HF's generate that it decodes the same (None: HF's)."""
    if len(args) > 1 or decoding.unsupported(model) is not None or _runs_synced(model):
        return None
    kwargs = dict(kwargs)
    input_ids = kwargs.pop("inputs", None) if not args else args[0]
    input_ids = kwargs.pop("input_ids", input_ids)
    attention_mask = kwargs.pop("attention_mask", None)
    generation_config = kwargs.pop("generation_config", None)
    if not (isinstance(input_ids, torch.Tensor) and input_ids.dim() == 2 and input_ids.dtype == torch.long):
        return None
    # HF's rule: no max_length anywhere means 20 new tokens (capped by the model's positions).
    default_length = (kwargs.get("max_length") is None
                      and (generation_config is None or generation_config.max_length is None)
                      and model.generation_config.max_length is None)
    try:
        config, model_kwargs = model._prepare_generation_config(generation_config, **kwargs)
    except (AttributeError, TypeError, ValueError):
        return None
    # Anything left is a model input or an argument of generate itself (processors, streamer,
    # assistant model, ...), none of which the decoder takes.
    if model_kwargs or any(getattr(config, name, None) not in (value, None) for name, value in HF_ONLY_GENERATION):
        return None
    P = input_ids.shape[1]
    positions = getattr(model.config, "max_position_embeddings", None)
    if config.min_length is not None and config.min_length > P:
        return None
    if config.max_new_tokens is not None:
        max_new_tokens = config.max_new_tokens
    elif default_length:
        max_new_tokens = config.max_length if positions is None else min(config.max_length + P, positions) - P
    else:
        max_new_tokens = config.max_length - P
    # Past the model's positions HF only warns; tritonformer.generate refuses.
    if max_new_tokens < 1 or positions is not None and P + max_new_tokens > positions:
        return None
    eos_ids, pad = _token_ids(config.eos_token_id), _token_ids(config.pad_token_id)
    pad = pad[0] if pad else eos_ids[0] if eos_ids else None
    # HF's generate reads a mask off the prompt's pad tokens when the pad is not an eos.
    if attention_mask is None and pad is not None and pad not in (eos_ids or []) and bool((input_ids == pad).any()):
        attention_mask = input_ids.ne(pad).long()
    # The decoder's cache holds each prompt from its first token on: left padding only.
    if attention_mask is not None and not decoding.left_padded(attention_mask):
        return None
    request = dict(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=max_new_tokens,
                   do_sample=bool(config.do_sample), eos_token_id=eos_ids, pad_token_id=pad)
    if config.do_sample:
        temperature, top_k, top_p = config.temperature, config.top_k, config.top_p
        if temperature is not None and not temperature > 0 or top_p is not None and not 0 < top_p <= 1:
            return None  # HF's own errors or edge cases
        request.update(temperature=1.0 if temperature is None else temperature, top_k=top_k or None,
                       top_p=top_p if top_p is not None and top_p < 1.0 else None)
    return request


def _generate(self, *args, **kwargs):
    """A patched model's generate: tritonformer.generate where it decodes the call the same,
    HF's generate otherwise."""
    request = _decoding_request(self, args, kwargs)
    if request is None:
        logger.debug("tritonformer: generate goes to HF's generate (an argument or model the decoder does not take)")
        return type(self).generate(self, *args, **kwargs)
    return decoding.generate(self, **request)


def unpatch(model: torch.nn.Module) -> torch.nn.Module:
    """Undo patch(model)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    state = getattr(base, "_tritonformer", None)
    if state is None:
        return model
    family, patched, previous_attention, previous_loss, previous_experts = state
    for module in patched:
        del module.forward
        if module in previous_loss:
            if previous_loss[module] is None:
                del module._loss_function
            else:
                module._loss_function = previous_loss[module]
    _unpatch_rope(family, base)
    if previous_attention is not None:
        base.set_attn_implementation(previous_attention)
    if previous_experts is not None:
        base.set_experts_implementation(previous_experts)
    _unlink_next_norms(base)
    del base.generate
    decoding.release(base)
    del base._tritonformer
    return model


register_experts()
