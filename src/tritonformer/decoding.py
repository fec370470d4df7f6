"""`generate`: decoding of HuggingFace Llama-family models (dense and mixtures of experts) with a
static KV cache of ours.

    tokens = tritonformer.generate(model, input_ids, attention_mask, max_new_tokens=128)

The prompt runs through the model itself (patched or not: a prefill is compute-bound) into HF's
dynamic cache, whose keys and values are copied once into a static cache laid out for
`decode_attention` (sequence b's tokens at [0, its length): left padding drops out). Each new
token is then one decode step over the model's weights: our norms, rope with the cache write,
decode attention and SwiGLU, the products through the projection modules (cuBLAS for nn.Linear, scaled_matmul for
the block-scaled weights of hf.patch(model, weights=...)), the token picked on the GPU (greedy, or sampled with
temperature, top-k and top-p as HF's processors), finished sequences padded on the GPU. On a GPU
the step is captured once as a CUDA graph and replayed; the host looks at the finished flags
every HOST_CHECK_EVERY tokens. The result is the LongTensor HF's `generate` returns. Design:
docs/generate.md.
"""

from __future__ import annotations

import itertools
import math
import warnings
import weakref
from dataclasses import dataclass

import torch

from . import runtime
from .capture import CudaGraph
from .nn import QuantizedLinear
from .ops.argmax import argmax
from .ops.decode_attention import HEAD_DIMS, decode_attention
from .ops.decode_linear import FP4_FORMATS, MAX_ROWS, decode_linear, decode_linear_into_norm, decode_swiglu
from .ops.norm import add_rms_norm, rms_norm
from .ops.record_tokens import DecodeState, record_tokens
from .ops.rope import rope_into_cache
from .ops.swiglu import swiglu


@dataclass(frozen=True)
class Family:
    """What a decode step needs to know of a Llama-family decoder layer (pre-norm attention, then
    an MLP): q_norm "head" normalises q and k per head before rope (Qwen3, Gemma 3), "whole" each
    whole projection (OLMoE); moe: the MLP is a mixture of experts, run as the model's own module
    (its router and experts: ours when patched); mlp_module: the dense MLP runs as the model's
    module too (Gemma's GeGLU); config_window: the window is the config's sliding_window (else the
    attention module's, set on its sliding layers only); norm_offset, norm_eps: the RMSNorm's
    (1 + weight) offset and eps attribute (Gemma's); sandwich: norms after the attention and the
    MLP too, before their residual adds (Gemma 2 and 3: post_attention_layernorm, then
    pre_feedforward_layernorm after the add, and post_feedforward_layernorm); rope_per_layer_type:
    the rotary module makes a table per layer type (Gemma 3's local and global); attention_softcap:
    the attention caps its logits at attn_logit_softcapping (Gemma 2's; Gemma 3's config has the
    field, its attention ignores it)."""
    q_norm: str | None = None
    moe: bool = False
    mlp_module: bool = False
    config_window: bool = False
    norm_offset: float = 0.0
    norm_eps: str = "variance_epsilon"
    sandwich: bool = False
    rope_per_layer_type: bool = False
    attention_softcap: bool = False


GEMMA = dict(norm_offset=1.0, norm_eps="eps", mlp_module=True)
FAMILIES = {
    "llama": Family(), "mistral": Family(config_window=True), "qwen2": Family(), "qwen3": Family(q_norm="head"),
    "qwen3_moe": Family(q_norm="head", moe=True), "qwen2_moe": Family(moe=True),
    "mixtral": Family(moe=True, config_window=True), "olmoe": Family(q_norm="whole", moe=True, config_window=True),
    "gemma": Family(**GEMMA), "gemma2": Family(**GEMMA, sandwich=True, attention_softcap=True),
    "gemma3_text": Family(**GEMMA, q_norm="head", sandwich=True, rope_per_layer_type=True),
}
# Rotary tables that depend on the positions alone (others rescale with the sequence length).
STATIC_ROPE_TYPES = ("default", "linear", "llama3")
# Cache lengths round up to this: one captured step serves every length in a block.
CACHE_BLOCK = 256
# Tokens between the host's looks at the finished flags (each look is a synchronisation).
HOST_CHECK_EVERY = 16
# Keys of the decoders' background warm-ups (runtime.compile_ahead runs a key once).
_WARM_UPS = itertools.count()
# Models whose prefill kernels this process readied ahead (once a model: see ready_prefill).
_PREFILLS_READIED: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()


def unsupported(model: torch.nn.Module) -> str | None:
    """Why `generate` cannot decode this model (None when it can)."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in FAMILIES:
        return f"model_type {model_type!r} is not one of {', '.join(FAMILIES)}"
    rope = (getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    # Gemma 3's parameters are per layer type: each table's.
    per_type = bool(rope) and all(isinstance(params, dict) for params in rope.values())
    for params in rope.values() if per_type else (rope,):
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type not in STATIC_ROPE_TYPES:
            return f"rope type {rope_type!r} is not one of {', '.join(STATIC_ROPE_TYPES)}"
    if not FAMILIES[model_type].mlp_module and getattr(config, "hidden_act", "silu") not in ("silu", "swish"):
        return f"hidden_act {config.hidden_act!r} is not SiLU"
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if head_dim not in HEAD_DIMS:
        return f"head_dim {head_dim} is not one of decode_attention's {HEAD_DIMS}"
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "layers") or not hasattr(model, "lm_head"):
        return "the model is not a ForCausalLM of a decoder stack"
    for layer in inner.layers:
        attn, mlp = layer.self_attn, layer.mlp
        dense = () if FAMILIES[model_type].moe else (mlp.gate_proj, mlp.up_proj, mlp.down_proj)
        for linear in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, *dense):
            if type(linear) not in (torch.nn.Linear, QuantizedLinear):
                return f"a projection is a {type(linear).__name__}, not a plain nn.Linear or QuantizedLinear"
    if type(model.lm_head) not in (torch.nn.Linear, QuantizedLinear):
        return f"lm_head is a {type(model.lm_head).__name__}, not a plain nn.Linear or QuantizedLinear"
    dtypes = {p.dtype for p in model.parameters()}
    if any(isinstance(m, QuantizedLinear) for m in model.modules()) and dtypes != {torch.bfloat16}:
        return "block-scaled projections take bf16 activations: the model must be bf16"
    if len(dtypes) != 1 or not dtypes <= {torch.float32, torch.float16, torch.bfloat16}:
        return f"parameters of dtypes {sorted(map(str, dtypes))}: one of float32, float16, bfloat16 is needed"
    devices = {p.device for p in model.parameters()}
    if len(devices) != 1:
        return "parameters on several devices"
    return None


@dataclass(frozen=True)
class Sampling:
    """How a token is picked: greedy (do_sample False) or drawn after HF's temperature, top-k and
    top-p processors, in that order."""
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None

    def check(self) -> None:
        if not self.do_sample:
            return
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)
                and self.temperature > 0):
            raise ValueError(f"generate: temperature must be a positive number, got {self.temperature!r}")
        if self.top_k is not None and (isinstance(self.top_k, bool) or not isinstance(self.top_k, int)
                                       or self.top_k < 0):
            raise ValueError(f"generate: top_k must be None or an int >= 0, got {self.top_k!r}")
        if self.top_p is not None and not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise ValueError(f"generate: top_p must be None or in (0, 1], got {self.top_p!r}")

    def pick(self, logits: torch.Tensor) -> torch.Tensor:
        """The next token of each row of logits (B, V), on the device, without a host
        synchronisation (a CUDA graph holds it). Greedy reads the logits in their dtype (their
        float32 copies order alike); sampling works in float32."""
        if not self.do_sample:
            return argmax(logits)
        if runtime.compiling_ahead():
            # A warm-up from another thread must not draw from torch's generator (no kernel of ours follows).
            return logits.argmax(dim=-1)
        logits = logits.float()
        if self.temperature != 1.0:
            logits = logits / self.temperature
        if self.top_k:
            kth = logits.topk(min(self.top_k, logits.shape[-1]), dim=-1).values[:, -1:]
            logits = logits.masked_fill(logits < kth, -math.inf)
        if self.top_p is not None and self.top_p < 1.0:
            ascending, order = logits.sort(dim=-1)
            # HF drops the tokens whose cumulative probability, counted from the least likely, stays
            # within 1 - top_p, and always keeps the most likely.
            drop = ascending.softmax(dim=-1).cumsum(dim=-1) <= 1 - self.top_p
            drop[:, -1] = False
            logits = logits.masked_fill(drop.scatter(1, order, drop), -math.inf)
        # A draw from softmax(logits): argmax of p / E with E ~ Exp(1) (no host look, unlike
        # torch.multinomial's checks).
        probs = logits.softmax(dim=-1)
        return (probs / torch.empty_like(probs).exponential_()).argmax(dim=-1)


class _Decoder:
    """A decode step of one model: the state between tokens lives in tensors of a fixed size and
    address (tokens, positions, caches, output), so that one CUDA graph replays every step."""

    def __init__(self, model: torch.nn.Module, batch: int, capacity: int, sampling: Sampling,
                 eos: tuple[int, ...], pad: int, cuda_graph: bool):
        config, inner = model.config, model.model
        # A weak reference: the model keeps no decoder alive, and a decoder no model (DECODERS).
        self.model = weakref.ref(model)
        self.sampling, self.batch, self.capacity = sampling, batch, capacity
        self.clip = getattr(config, "clip_qkv", None)
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.family = FAMILIES[config.model_type]
        # Gemma 2's final-logit softcapping, before the pick.
        self.logit_softcap = getattr(config, "final_logit_softcapping", None)
        embedding = inner.embed_tokens.weight  # lm_head's may be block-scaled (hf.patch's quantize_lm_head)
        device, dtype = embedding.device, embedding.dtype
        self.windows = [self._window(config, layer.self_attn, self.family) for layer in inner.layers]
        shape = (batch, self.kv_heads, capacity, self.head_dim)
        # Past a sequence's length the cache is never read (poisoned in the tests).
        self.k_caches = [runtime.empty(shape, dtype, device) for _ in inner.layers]
        self.v_caches = [runtime.empty(shape, dtype, device) for _ in inner.layers]
        # The tensors each pick's bookkeeping (record_tokens) writes in place; the step reads tokens,
        # positions and lengths. finished_at is the step a sequence finished at (capacity while it runs).
        self.state = DecodeState(
            out=torch.zeros(batch, capacity, dtype=torch.long, device=device),
            done=torch.zeros(batch, dtype=torch.bool, device=device),
            finished_at=torch.zeros(batch, dtype=torch.long, device=device),
            tokens=torch.zeros(batch, dtype=torch.long, device=device),
            positions=torch.zeros(batch, dtype=torch.long, device=device),
            lengths=torch.zeros(batch, dtype=torch.int32, device=device),
            step=torch.zeros(1, dtype=torch.long, device=device),
            eos=torch.tensor(eos if eos else (-1,), dtype=torch.long, device=device),
            pad=torch.tensor(pad, dtype=torch.long, device=device))
        self.capture = cuda_graph and device.type == "cuda"
        self.graph: CudaGraph | None = None
        self.rope_tables = self._rope_tables(inner, device, dtype)

    def _rope_tables(self, inner: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> dict:
        """The model's cos and sin at every position of the cache, once ({layer type or None: (cos,
        sin)}; `unsupported` admits only tables of the position alone), for rope_into_cache to read
        at each sequence's position: a step computes none (about 14 us of small kernels a step at
        batch 1, docs/generate.md)."""
        positions = torch.arange(self.capacity, device=device)[None]
        x = torch.empty(1, 1, 1, device=device, dtype=dtype)  # rotary_emb takes its dtype and device
        # Gemma 3's rotary module takes a layer type and keeps a table per type; the others one table.
        kinds = set(self.model().config.layer_types) if self.family.rope_per_layer_type else (None,)
        tables = {}
        for kind in kinds:
            cos, sin = inner.rotary_emb(x, positions, *(() if kind is None else (kind,)))
            tables[kind] = (cos[0], sin[0])
        return tables

    @staticmethod
    def _window(config, attn, family: Family) -> int | None:
        """decode_attention's window of a layer: HF's sliding_window w lets a query see itself and
        the w - 1 keys before it."""
        window = getattr(config if family.config_window else attn, "sliding_window", None)
        return None if window is None else window - 1

    def start(self, prompt_keys: list[tuple[torch.Tensor, torch.Tensor]], lengths: torch.Tensor,
              first: torch.Tensor) -> None:
        """Copy the prefill's cache (left-padded to P) into ours and take the first new token."""
        P = prompt_keys[0][0].shape[2]
        # Sequence b's P - lengths[b] pads come first in HF's cache; ours starts at its first token.
        index = (torch.arange(P, device=lengths.device)[None, :] + (P - lengths)[:, None]).clamp_(max=P - 1)
        index = index[:, None, :, None].expand(self.batch, self.kv_heads, P, self.head_dim)
        for (keys, values), k_cache, v_cache in zip(prompt_keys, self.k_caches, self.v_caches):
            k_cache[:, :, :P].copy_(keys.gather(2, index))
            v_cache[:, :, :P].copy_(values.gather(2, index))
        self.state.positions.copy_(lengths)
        self.state.lengths.copy_(lengths + 1)
        self.state.done.zero_()
        self.state.finished_at.fill_(self.capacity)
        self.state.step.zero_()
        record_tokens(first, self.state, advance=False)

    def _norm(self, module: torch.nn.Module) -> tuple[torch.Tensor, float, float]:
        """An HF RMSNorm's (weight, eps, offset), as rms_norm takes them."""
        return module.weight, getattr(module, self.family.norm_eps), self.family.norm_offset

    def compile_ahead(self) -> None:
        """Start compiling the step's kernels in the background (runtime.compile_ahead: its launches
        only compile, every candidate of each product's tuning side by side) while the prefill runs:
        run in order, each product's candidates compiled only once the previous product was tuned
        (docs/generate.md, "First call"). Not for the MoE families: their routing's torch ops
        would index by the unwritten outputs of kernels that a warm-up does not run."""
        if not self.family.moe:
            runtime.compile_ahead(("decode step", next(_WARM_UPS)), self.warm_step)

    @torch.no_grad()  # grad mode is per thread, and the step's ops are inference ops
    def warm_step(self) -> None:
        """The step as compile_ahead runs it (in compile-only mode, launching nothing)."""
        self.step()

    def step(self) -> None:
        """One token a sequence: the model at self.state.tokens, the next token recorded."""
        B, H, Hkv, D = self.batch, self.heads, self.kv_heads, self.head_dim
        family, norm = self.family, self._norm
        model = self.model()
        inner = model.model
        x = inner.embed_tokens(self.state.tokens)
        mlp_out = residual = prepared = None
        layers = list(zip(inner.layers, self.k_caches, self.v_caches, self.windows))
        for i, (layer, k_cache, v_cache, window) in enumerate(layers):
            attn, mlp = layer.self_attn, layer.mlp
            cos, sin = self.rope_tables[attn.layer_type if family.rope_per_layer_type else None]
            if prepared is not None:
                q, k, v = decode_linear(prepared, [attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight],
                                        [attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias])
                prepared = None
            else:
                q, k, v, residual = _normed_products(B, x if residual is None else mlp_out, residual,
                                                     norm(layer.input_layernorm), attn.q_proj, attn.k_proj,
                                                     attn.v_proj)
            if self.clip is not None:  # OLMoE's clip_qkv
                q, k, v = (t.clamp(-self.clip, self.clip) for t in (q, k, v))
            if family.q_norm is not None:
                view = family.q_norm == "head"
                q = rms_norm(q.view(B, H, D) if view else q, *norm(attn.q_norm))
                k = rms_norm(k.view(B, Hkv, D) if view else k, *norm(attn.k_norm))
            q, k = q.view(B, H, D), k.view(B, Hkv, D)
            q = rope_into_cache(q, k, v.view(B, Hkv, D), cos, sin, self.state.positions, k_cache, v_cache,
                                by_position=True)
            o = decode_attention(q[:, :, None], k_cache, v_cache, self.state.lengths, attn.scaling, window,
                                 softcap=attn.attn_logit_softcapping if family.attention_softcap else None)
            o = o.transpose(1, 2).reshape(B, H * D)
            # Looked at each step, as _plain is: a hook added since the last step sends a layer back to its modules.
            if B == 1 and _fp4_chain(layer, family):
                # The sums and norms go through the products' epilogues (docs/generate.md, "Block-scaled weights").
                post, residual = decode_linear_into_norm(o, attn.o_proj.weight, residual,
                                                         norm(layer.post_attention_layernorm), attn.o_proj.bias)
                act = decode_swiglu(post, mlp.gate_proj.weight, mlp.up_proj.weight, prepared=True)
                down = mlp.down_proj
                if i + 1 < len(layers) and _fp4_chain_input(layers[i + 1][0]):
                    prepared, residual = decode_linear_into_norm(act, down.weight, residual,
                                                                 norm(layers[i + 1][0].input_layernorm), down.bias)
                else:
                    mlp_out, = decode_linear(act, [down.weight], [down.bias])
                continue
            o, = _products(B, o, attn.o_proj)
            if family.sandwich:
                o = rms_norm(o, *norm(layer.post_attention_layernorm))
            post = norm(layer.pre_feedforward_layernorm if family.sandwich else layer.post_attention_layernorm)
            if family.moe or family.mlp_module:
                h, residual = add_rms_norm(o, residual, *post)
                mlp_out = mlp(h.view(B, 1, -1)).view(B, -1) if family.moe else mlp(h)
            else:
                act, residual = _normed_gated(B, o, residual, post, mlp.gate_proj, mlp.up_proj)
                mlp_out, = _products(B, act, mlp.down_proj)
            if family.sandwich:
                mlp_out = rms_norm(mlp_out, *norm(layer.post_feedforward_layernorm))
        h, _ = add_rms_norm(mlp_out, residual, *norm(inner.norm))
        # A block-scaled lm_head goes through decode_linear at one row; cuBLAS streams a bf16 one at the roofline.
        logits = _products(B, h, model.lm_head)[0] if type(model.lm_head) is QuantizedLinear else model.lm_head(h)
        if self.logit_softcap is not None:
            logits = self.logit_softcap * torch.tanh(logits.float() / self.logit_softcap)
        record_tokens(self.sampling.pick(logits), self.state, advance=True)

    def run(self, steps: int) -> None:
        """`steps` decode steps (eagerly the first time, then replays of the captured step on a
        GPU), stopping early once every sequence finished."""
        for i in range(steps):
            if self.graph is None and self.capture and i > 0:
                # The first step ran eagerly: Triton compiled and tuned, cuBLAS has its workspace.
                self._capture()
            if self.graph is not None:
                self.graph.replay()
            else:
                self.step()
            if (i + 1) % HOST_CHECK_EVERY == 0 and bool(self.state.done.all()):
                return

    def _capture(self) -> None:
        """Capture the step (recording, not running it), or leave it eager with a warning where a
        piece of the model cannot be captured (a host synchronisation: HF's own experts loop)."""
        device = self.state.tokens.device
        runtime.wait_for_background_work()  # no compile thread may allocate during the capture
        try:
            self.graph = CudaGraph(self.step, (), {}, CudaGraph.new_pool(device), device)
        except Exception as error:
            self.capture = False
            warnings.warn(f"tritonformer.generate: the decode step cannot be captured as a CUDA graph "
                          f"({type(error).__name__}: {error}); it runs eagerly", stacklevel=3)

    def tokens_made(self, steps: int) -> int:
        """How many tokens HF's generate would have returned: up to the step at which the last
        sequence finished, else all of them."""
        if bool(self.state.done.all()):
            return int(self.state.finished_at.max()) + 1
        return steps


def _plain(B: int, *linears: torch.nn.Module) -> bool:
    """Whether decode_linear takes these projections for a step of B rows: all plain nn.Linear
    for few rows (beyond them cuBLAS streams the weights well), or all fp4 QuantizedLinear of one
    format for one row (more rows go to scaled_matmul), none with hooks (an adapter's)."""
    if any(linear._forward_hooks or linear._forward_pre_hooks for linear in linears):
        return False
    if all(type(linear) is torch.nn.Linear for linear in linears):
        return B <= MAX_ROWS
    fmts = {linear.fmt if type(linear) is QuantizedLinear else None for linear in linears}
    # A QuantizedLinear's bias buffer may be float32; decode_linear's must be x's dtype.
    biases = all(linear.bias is None or linear.bias.dtype == torch.bfloat16 for linear in linears)
    return B == 1 and len(fmts) == 1 and fmts <= set(FP4_FORMATS) and biases


def _fp4_chain_input(layer: torch.nn.Module) -> bool:
    """Whether a layer's q, k and v products take a PreparedRow: all fp4 of one format."""
    attn = layer.self_attn
    return _plain(1, attn.q_proj, attn.k_proj, attn.v_proj) and type(attn.q_proj) is QuantizedLinear


def _fp4_chain(layer: torch.nn.Module, family: Family) -> bool:
    """Whether a layer's products after attention chain PreparedRows at one row: o (into the
    norm), gate/up (SwiGLU) and down all fp4 of one format, a plain pre-norm MLP block."""
    if family.sandwich or family.moe or family.mlp_module:
        return False
    o, mlp = layer.self_attn.o_proj, layer.mlp
    # _plain at one row with one QuantizedLinear: all fp4 of one format; outputs go as PreparedRows (N % 8).
    return (type(o) is QuantizedLinear and _plain(1, o, mlp.gate_proj, mlp.up_proj, mlp.down_proj)
            and mlp.gate_proj.bias is None and mlp.up_proj.bias is None
            and o.weight.shape[0] % 8 == 0 and mlp.gate_proj.weight.shape[0] % 8 == 0)


def _products(B: int, x: torch.Tensor, *linears: torch.nn.Module) -> tuple[torch.Tensor, ...]:
    """x through each projection: in one decode_linear launch where it takes them (a layer's q, k
    and v are one stream of weight rows; docs/generate.md), else through each module."""
    if _plain(B, *linears):
        return decode_linear(x, [linear.weight for linear in linears], [linear.bias for linear in linears])
    return tuple(linear(x) for linear in linears)


def _normed_products(B: int, x: torch.Tensor, residual: torch.Tensor | None, norm: tuple,
                     *linears: torch.nn.Module) -> tuple[torch.Tensor, ...]:
    """(each projection of h, the new residual) for h = rms_norm(x + residual) (rms_norm(x), the
    residual then x, when residual is None): the norm and the residual add inside decode_linear's
    launch at one row (at 16 rows the step was slower with them inside: docs/generate.md), else
    add_rms_norm and _products."""
    if B == 1 and _plain(B, *linears):
        weights, biases = [linear.weight for linear in linears], [linear.bias for linear in linears]
        if residual is None:
            return (*decode_linear(x, weights, biases, norm=norm), x)
        return decode_linear(x, weights, biases, norm=norm, residual=residual)
    h, residual = (rms_norm(x, *norm), x) if residual is None else add_rms_norm(x, residual, *norm)
    return (*_products(B, h, *linears), residual)


def _normed_gated(B: int, x: torch.Tensor, residual: torch.Tensor, norm: tuple, gate: torch.nn.Module,
                  up: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """(silu(gate(h)) * up(h), the new residual) for h = rms_norm(x + residual): one decode_swiglu
    launch for plain bias-free projections, the norm inside at one row (as _normed_products)."""
    plain = _plain(B, gate, up) and gate.bias is None and up.bias is None
    if plain and B == 1:
        return decode_swiglu(x, gate.weight, up.weight, norm=norm, residual=residual)
    h, residual = add_rms_norm(x, residual, *norm)
    return (decode_swiglu(h, gate.weight, up.weight) if plain else swiglu(gate(h), up(h))), residual


# The decoder of each model's latest call, while the model lives: its caches are the model's KV
# memory until a call of another batch size, cache block, sampling or set of weights replaces it,
# or release(model). Not in the model's own attributes: a copy or pickle of the model would take
# a CUDA graph along.
DECODERS: "weakref.WeakKeyDictionary[torch.nn.Module, tuple[tuple, _Decoder]]" = weakref.WeakKeyDictionary()


def _decoder(model, batch: int, needed: int, sampling: Sampling, eos: tuple[int, ...], pad: int,
             cuda_graph: bool) -> _Decoder:
    capacity = -(-needed // CACHE_BLOCK) * CACHE_BLOCK
    # The weights' addresses: a captured step reads them there (a cast, a move, load_state_dict
    # with assign, a quantized projection all make new ones).
    weights = tuple((t.data_ptr(), t.dtype) for t in (*model.parameters(), *model.buffers()))
    key = (batch, capacity, sampling, eos, pad, cuda_graph, weights)
    kept = DECODERS.get(model)
    if kept is not None and kept[0] == key:
        return kept[1]
    release(model)
    decoder = _Decoder(model, batch, capacity, sampling, eos, pad, cuda_graph)
    DECODERS[model] = (key, decoder)
    decoder.compile_ahead()  # while the prefill runs
    return decoder


def ready_prefill(model: torch.nn.Module, **inputs) -> None:
    """Hand every kernel the prefill launches to the compile pool at once: the model's forward in
    compile-only mode (runtime.compile_only: our launches only compile; torch's ops run, on
    unwritten values, into a cache thrown away). Run for real, the prefill compiles each kernel as
    it reaches it, one after the other (docs/generate.md, "First call"). generate runs it on a
    model's first call in a process (the duplicate prefill's torch work is paid once). Not for the
    MoE families (their routing's torch ops would index by unwritten values)."""
    if FAMILIES[model.config.model_type].moe:
        return
    from transformers import DynamicCache

    runtime.compile_only(model, **inputs, past_key_values=DynamicCache())


def release(model: torch.nn.Module) -> None:
    """Free the KV cache and CUDA graph that `generate` keeps for the model's next call
    (`tritonformer.release`)."""
    DECODERS.pop(model, None)


def left_padded(attention_mask: torch.Tensor) -> bool:
    """Whether every row of a (B, P) mask is zeros then ones, with a one (a host look)."""
    mask = attention_mask.bool()
    return bool((mask[:, 1:] >= mask[:, :-1]).all() and mask[:, -1].all())


def _eos_ids(eos_token_id) -> tuple[int, ...]:
    if eos_token_id is None:
        return ()
    if isinstance(eos_token_id, torch.Tensor):
        eos_token_id = eos_token_id.tolist()
    ids = (eos_token_id,) if isinstance(eos_token_id, int) else tuple(eos_token_id)
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise TypeError(f"generate: eos_token_id must be an int or a list of ints, got {eos_token_id!r}")
    return ids


@torch.no_grad()
def generate(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
             max_new_tokens: int = 20, do_sample: bool = False, temperature: float = 1.0, top_k: int | None = None,
             top_p: float | None = None, eos_token_id: int | list[int] | None = None,
             pad_token_id: int | None = None, cuda_graph: bool = True) -> torch.Tensor:
    """Greedy or sampled decoding of a Llama, Mistral, Qwen2, Qwen3, Qwen3-MoE, Qwen2-MoE, Mixtral
    or OLMoE causal LM (HF's, patched or not; the experts run as the model's own modules): the prompt (B, P) with its new tokens, (B, P + n), as HF's `generate` returns it with
    the same arguments. Left-padded batches take their attention_mask. A sequence that produced
    an eos token gets pad_token_id (default: the first eos) after it; decoding stops when all
    have, or after max_new_tokens. Sampling follows temperature, then top_k, then top_p (None:
    not applied; HF's generate defaults top_k to 50) and draws from torch's default generator.
    On a GPU the decode step is captured as a CUDA graph (cuda_graph=False runs it eagerly); the
    cache and graph are kept for the model's next call of the same batch size (release(model)).
    Sampled tokens are HF's in distribution; the generator advances by up to HOST_CHECK_EVERY
    steps more than HF's (the steps run before the host sees every sequence finished).
    """
    reason = unsupported(model)
    if reason is not None:
        raise ValueError(f"tritonformer.generate: this model is not supported: {reason}")
    if not isinstance(input_ids, torch.Tensor) or input_ids.dtype != torch.long or input_ids.dim() != 2:
        raise TypeError("tritonformer.generate: input_ids must be a 2-D LongTensor (batch, prompt)")
    device = model.get_input_embeddings().weight.device
    if input_ids.device != device:
        raise ValueError(f"tritonformer.generate: input_ids are on {input_ids.device}, the model on {device}")
    B, P = input_ids.shape
    if B == 0 or P == 0:
        raise ValueError(f"tritonformer.generate: input_ids of shape {tuple(input_ids.shape)}: a prompt needs a token")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"tritonformer.generate: max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit is not None and P + max_new_tokens > limit:
        raise ValueError(f"tritonformer.generate: prompt {P} + max_new_tokens {max_new_tokens} passes the "
                         f"model's max_position_embeddings {limit}")
    if attention_mask is not None and (attention_mask.shape != input_ids.shape or attention_mask.device != device):
        raise ValueError(f"tritonformer.generate: attention_mask must have input_ids' shape {tuple(input_ids.shape)} "
                         f"and device, got {tuple(attention_mask.shape)} on {attention_mask.device}")
    if attention_mask is not None and not left_padded(attention_mask):
        raise ValueError("tritonformer.generate: attention_mask must be left padding (each row zeros, then at least "
                         "one token); HF's generate takes other masks")
    sampling = Sampling(bool(do_sample), float(temperature), top_k, top_p)
    sampling.check()
    eos = _eos_ids(eos_token_id)
    if pad_token_id is None:
        pad_token_id = eos[0] if eos else 0

    # The prefill, positions counted from each sequence's first token as HF's generate does.
    from transformers import DynamicCache  # a soft dependency: only models from transformers get here

    if attention_mask is None:
        lengths = torch.full((B,), P, dtype=torch.long, device=device)
        positions = torch.arange(P, device=device).expand(B, P)
    else:
        attention_mask = attention_mask.long()
        lengths = attention_mask.sum(dim=1)
        positions = (attention_mask.cumsum(dim=1) - 1).masked_fill_(attention_mask == 0, 1)
    prefill = dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions, use_cache=True,
                   logits_to_keep=1)
    if not runtime.INTERPRET and model not in _PREFILLS_READIED:
        _PREFILLS_READIED.add(model)
        ready_prefill(model, **prefill)
    decoder = _decoder(model, B, P + max_new_tokens, sampling, eos, int(pad_token_id), cuda_graph)
    cache = DynamicCache()
    logits = model(**prefill, past_key_values=cache).logits[:, -1].float()
    decoder.start([(layer.keys, layer.values) for layer in cache.layers], lengths, sampling.pick(logits))
    del cache
    decoder.run(max_new_tokens - 1)
    made = decoder.tokens_made(max_new_tokens)
    return torch.cat([input_ids, decoder.state.out[:, :made]], dim=1)
