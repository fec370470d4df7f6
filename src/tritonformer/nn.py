"""nn.Module drop-ins: subclasses of the torch modules they replace, so state_dicts, constructor
arguments and isinstance checks keep working."""

from __future__ import annotations

import math

import torch

from .ops.attention import attention
from .ops.cross_entropy import cross_entropy, fused_linear_cross_entropy
from .ops import decode_attention as decode
from .ops.matmul import matmul
from .ops.moe import MAX_EXPERTS, MAX_TOP_K, moe_route
from .ops.moe_experts import moe_experts
from .ops.norm import layer_norm, rms_norm
from . import quant, runtime
from .ops.rope import LAYOUTS as ROPE_LAYOUTS, apply_rope
from .ops.scaled_matmul import scaled_matmul
from .ops.swiglu import swiglu_mlp
from .ops.softmax import softmax


class Softmax(torch.nn.Softmax):
    """`torch.nn.Softmax` computed by tritonformer's kernel."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return softmax(x, -1 if self.dim is None else self.dim)


class Linear(torch.nn.Linear):
    """`torch.nn.Linear` whose product and bias run in tritonformer's matmul (weight read
    transposed in place, no copy)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(x, torch.Tensor) and x.dim() == 1:  # torch's Linear takes a single vector
            return matmul(x[None], self.weight.t(), self.bias)[0]
        return matmul(x, self.weight.t(), self.bias)


class RMSNorm(torch.nn.Module):
    """HuggingFace's LlamaRMSNorm (same `weight` parameter and `variance_epsilon` attribute, so
    its state_dict loads); `offset=1.0` gives GemmaRMSNorm, whose weight starts at zero;
    `round_before_weight=False` GptOssRMSNorm (the weight multiplied in float32, then rounded)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, offset: float = 0.0, device=None, dtype=None,
                 round_before_weight: bool = True):
        super().__init__()
        init = torch.zeros if offset else torch.ones
        self.weight = torch.nn.Parameter(init(hidden_size, device=device, dtype=dtype))
        self.variance_epsilon = eps
        self.offset = offset
        self.round_before_weight = round_before_weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.variance_epsilon, self.offset, self.round_before_weight)

    def extra_repr(self) -> str:
        return (f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}, offset={self.offset}"
                + ("" if self.round_before_weight else ", round_before_weight=False"))


class SwiGLUMLP(torch.nn.Module):
    """HuggingFace's LlamaMLP (gate_proj, up_proj, down_proj; the same state_dict keys):
    down_proj(silu(gate_proj(x)) * up_proj(x)). Backward stores x, gate_proj(x) and up_proj(x)
    and recomputes the activation."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False, device=None, dtype=None):
        super().__init__()
        kw = dict(bias=bias, device=device, dtype=dtype)
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.gate_proj = torch.nn.Linear(hidden_size, intermediate_size, **kw)
        self.up_proj = torch.nn.Linear(hidden_size, intermediate_size, **kw)
        self.down_proj = torch.nn.Linear(intermediate_size, hidden_size, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g, u, d = self.gate_proj, self.up_proj, self.down_proj
        return swiglu_mlp(x, g.weight, u.weight, d.weight, g.bias, u.bias, d.bias)


class MoEExperts(torch.nn.Module):
    """The experts' weights as HF's Qwen3-MoE / Qwen2-MoE / Mixtral / OLMoE experts hold them:
    gate_up_proj (E, 2I, H), gate rows first, and down_proj (E, H, I)."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, device=None, dtype=None):
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        # Each expert's rows drawn as a Linear of its fan-in would (variance 1 / fan_in).
        self.gate_up_proj = torch.nn.Parameter(
            torch.randn(num_experts, 2 * intermediate_size, hidden_size, **kw) * hidden_size**-0.5)
        self.down_proj = torch.nn.Parameter(
            torch.randn(num_experts, hidden_size, intermediate_size, **kw) * intermediate_size**-0.5)

    def forward(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return moe_experts(x, experts, weights, self.gate_up_proj, self.down_proj)


class MoE(torch.nn.Module):
    """HF's Qwen3-MoE sparse block (the same state_dict keys: gate.weight (E, H),
    experts.gate_up_proj, experts.down_proj) for models outside HF: router logits x @ gate^T,
    softmax in float32 and the top k (renormalised when `normalize_top_k`, as Qwen3-MoE's
    norm_topk_prob) through moe_route, then the dropless SwiGLU experts (moe_experts).
    `forward(x, return_router_logits=True)` also returns the (tokens, E) logits, for an auxiliary
    loss."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int,
                 normalize_top_k: bool = True, device=None, dtype=None):
        super().__init__()
        if not 1 <= num_experts <= MAX_EXPERTS:
            raise ValueError(f"num_experts must be in [1, {MAX_EXPERTS}], got {num_experts}")
        if not 1 <= top_k <= min(num_experts, MAX_TOP_K):
            raise ValueError(f"top_k must be in [1, min(num_experts, {MAX_TOP_K})], got {top_k}")
        self.hidden_size, self.top_k, self.normalize_top_k = hidden_size, top_k, normalize_top_k
        self.gate = torch.nn.Linear(hidden_size, num_experts, bias=False, device=device, dtype=dtype)
        self.experts = MoEExperts(hidden_size, intermediate_size, num_experts, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor, return_router_logits: bool = False):
        if x.shape[-1] != self.hidden_size:
            raise ValueError(f"MoE: x's last dimension must be hidden_size = {self.hidden_size}, got {tuple(x.shape)}")
        tokens = x.reshape(-1, self.hidden_size)
        logits = matmul(tokens, self.gate.weight.t())
        weights, experts = moe_route(logits, self.top_k, normalize=self.normalize_top_k)
        out = self.experts(tokens, experts, weights).view(x.shape)
        return (out, logits) if return_router_logits else out

    def extra_repr(self) -> str:
        return f"top_k={self.top_k}, normalize_top_k={self.normalize_top_k}"


class LayerNorm(torch.nn.LayerNorm):
    """`torch.nn.LayerNorm` over the last dimension, computed by tritonformer's kernel."""

    def __init__(self, normalized_shape, *args, **kwargs):
        super().__init__(normalized_shape, *args, **kwargs)
        if len(self.normalized_shape) != 1:
            raise ValueError(f"LayerNorm normalizes over the last dimension only; got normalized_shape "
                             f"{self.normalized_shape}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return layer_norm(x, self.weight, self.bias, self.eps)


class ApplyRope(torch.nn.Module):
    """HuggingFace's `apply_rotary_pos_emb(q, k, cos, sin)` as a module: layout "bhsd" is its
    unsqueeze_dim=1, "bshd" unsqueeze_dim=2. See `tritonformer.apply_rope`."""

    def __init__(self, layout: str = "bhsd", inplace: bool = False):
        super().__init__()
        if layout not in ROPE_LAYOUTS:
            raise ValueError(f"layout must be one of {ROPE_LAYOUTS}, got {layout!r}")
        self.layout = layout
        self.inplace = inplace

    def forward(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return apply_rope(q, k, cos, sin, self.layout, self.inplace)

    def extra_repr(self) -> str:
        return f"layout={self.layout!r}, inplace={self.inplace}"


class CrossEntropyLoss(torch.nn.CrossEntropyLoss):
    """`torch.nn.CrossEntropyLoss` computed by tritonformer's kernels, for class-index targets.
    As in torch, an input (N, C, d1, ...) has its classes on dimension 1. Class weights are not
    supported."""

    def __init__(self, weight=None, size_average=None, ignore_index: int = -100, reduce=None,
                 reduction: str = "mean", label_smoothing: float = 0.0):
        if weight is not None:
            raise ValueError("CrossEntropyLoss: class weights (weight=...) are not supported by tritonformer; "
                             "use torch.nn.CrossEntropyLoss for them")
        super().__init__(None, size_average, ignore_index, reduce, reduction, label_smoothing)

    def forward(self, input: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if input.dim() > 2:
            input = input.movedim(1, -1)
        return cross_entropy(input, target, self.ignore_index, self.reduction, self.label_smoothing)


class FusedLinearCrossEntropyLoss(torch.nn.Module):
    """Cross entropy of `hidden @ lm_head_weight.T + bias` without materializing the logits
    (see `fused_linear_cross_entropy`)."""

    def __init__(self, ignore_index: int = -100, reduction: str = "mean", label_smoothing: float = 0.0,
                 z_loss: float = 0.0):
        super().__init__()
        self.ignore_index, self.reduction = ignore_index, reduction
        self.label_smoothing, self.z_loss = label_smoothing, z_loss

    def forward(self, hidden: torch.Tensor, lm_head_weight: torch.Tensor, target: torch.Tensor,
                bias: torch.Tensor | None = None, num_items_in_batch=None) -> torch.Tensor:
        return fused_linear_cross_entropy(hidden, lm_head_weight, target, bias, self.ignore_index, self.reduction,
                                          self.label_smoothing, self.z_loss, num_items_in_batch)

    def extra_repr(self) -> str:
        return (f"ignore_index={self.ignore_index}, reduction={self.reduction!r}, "
                f"label_smoothing={self.label_smoothing}, z_loss={self.z_loss}")


class QuantizedLinear(torch.nn.Module):
    """An inference nn.Linear whose weight is block-scaled (mxfp8, mxfp4 or nvfp4, blocks along
    in_features): `QuantizedLinear.from_linear(linear, "nvfp4")`. Inputs are bf16 (..., in);
    the product runs in `scaled_matmul`. The weight's data, scales and tensor scale are integer
    buffers (their bytes, viewed back when used), so `.to(device)` and state_dict carry them and
    a dtype cast of the model (`.to(torch.bfloat16)`, `.half()`) leaves them alone; the bias is
    an ordinary float buffer."""

    def __init__(self, in_features: int, out_features: int, fmt: str, bias: bool = True, device=None):
        super().__init__()
        self.in_features, self.out_features, self.fmt = in_features, out_features, fmt
        self._store(quant.quantize(torch.zeros(out_features, in_features, device=device), fmt, axis=1))
        self.register_buffer("bias", torch.zeros(out_features, device=device) if bias else None)

    def _store(self, q: quant.QuantizedTensor) -> None:
        self.register_buffer("weight_data", q.data.view(torch.uint8))
        self.register_buffer("weight_scales", q.scales.view(torch.uint8))
        self.register_buffer("weight_tensor_scale",
                             None if q.tensor_scale is None else q.tensor_scale.view(torch.int32))
        self._data_dtype, self._scale_dtype = q.data.dtype, q.scales.dtype

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, fmt: str) -> "QuantizedLinear":
        module = cls(linear.in_features, linear.out_features, fmt, linear.bias is not None, linear.weight.device)
        module._store(quant.quantize(linear.weight.detach(), fmt, axis=1))
        if linear.bias is not None:
            module.bias = linear.bias.detach().clone()
        return module

    @property
    def weight(self) -> quant.QuantizedTensor:
        """The weight as a QuantizedTensor over the buffers. The copies of the scales that kernels
        make from it live with the buffer's memory (QuantizedTensor._scales_copy), so they are made
        once and an in-place change of the buffer (load_state_dict) is seen. Eager calls keep the
        QuantizedTensor while the buffers are the same tensors: its views cost host time that a
        decoding step feels."""
        buffers = (self.weight_data, self.weight_scales, self.weight_tensor_scale)
        compiling = torch.compiler.is_compiling()
        kept = None if compiling else self.__dict__.get("_weight")
        if kept is not None and all(old is new for old, new in zip(kept[0], buffers)):
            return kept[1]
        tensor_scale = None if self.weight_tensor_scale is None else self.weight_tensor_scale.view(torch.float32)
        weight = quant.QuantizedTensor(self.weight_data.view(self._data_dtype), self.weight_scales.view(self._scale_dtype),
                                       self.fmt, torch.Size((self.out_features, self.in_features)), 1, tensor_scale)
        if not compiling:
            self.__dict__["_weight"] = buffers, weight
        return weight

    def _apply(self, fn, recurse=True):
        # A move or cast makes new buffers: let the old ones go now, not at the next forward.
        self.__dict__.pop("_weight", None)
        return super()._apply(fn, recurse)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        runtime.check_tensor("x", x, (torch.bfloat16,), min_dim=1)
        out = scaled_matmul(x.reshape(-1, self.in_features), self.weight, out_dtype=x.dtype, bias=self.bias)
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fmt={self.fmt!r}"


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                      sliding_window: int | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """HuggingFace's attention interface, for `AttentionInterface.register("tritonformer",
    attention_forward)` and `attn_implementation="tritonformer"`.

    query (B, H, S_q, D), key and value (B, H_kv, S_k, D) as the model hands them over (grouped
    heads not repeated). Returns the output as (B, S_q, H, D) and no attention weights, as HF's
    SDPA path does. Causal unless `is_causal=False` comes in kwargs or module.is_causal is False;
    the mask is aligned bottom-right, so decoding against a KV cache (S_q < S_k) is right; up to
    16 queries against more keys, without a gradient, run decode_attention.
    `sliding_window=w` lets a query see itself and the w - 1 keys before it (HF's convention).
    A packed batch (batch 1 with cu_seq_lens_q, cu_seq_lens_k, max_length_q, max_length_k, as
    HF's flattening collator gives) runs the variable-length kernels. An attention_mask (padding)
    is honoured through torch's SDPA with that mask (with softcap or sinks, through the plain
    torch product they need): correct, but not our kernel; pack the batch instead for speed.
    `softcap` (Gemma 2) and `s_aux` (GPT-OSS's sinks) go to the kernels as attention() takes
    them. Dropout is not supported."""
    if dropout:
        raise ValueError(f"attention_forward: dropout={dropout} is not supported (only 0.0)")
    causal = kwargs.get("is_causal")
    if causal is None:
        causal = getattr(module, "is_causal", True)
    window = None if sliding_window is None else sliding_window - 1
    extras = dict(softcap=kwargs.get("softcap"), sinks=kwargs.get("s_aux"))
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is not None:
        if query.shape[0] != 1:
            raise ValueError(f"attention_forward: a packed batch (cu_seq_lens_q) must have batch 1, got {query.shape[0]}")
        max_q, max_k = (int(kwargs[name]) for name in ("max_length_q", "max_length_k"))
        out = attention(query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1), causal,
                        scaling, window, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q, max_seqlen_k=max_k,
                        **extras)
        return out[None], None
    if attention_mask is not None:
        mask = attention_mask[:, :, :, :key.shape[-2]]
        if extras["softcap"] is None and extras["sinks"] is None:
            out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling,
                                                                   enable_gqa=key.shape[1] != query.shape[1])
        else:
            out = _masked_attention(query, key, value, mask, scaling, **extras)
    elif (causal and 1 <= query.shape[2] <= decode.MAX_QUERIES and query.shape[2] < key.shape[-2]
          and not (torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad
                                                or (extras["sinks"] is not None and extras["sinks"].requires_grad)))):
        # A decode step against a KV cache: the G query heads of a KV head read its keys once,
        # over splits of the cache (ops/decode_attention.py).
        out = decode.decode_attention(query, key, value, None, scaling, window, **extras)
    else:
        out = attention(query, key, value, causal, scaling, window, **extras)
    return out.transpose(1, 2), None


def _masked_attention(query, key, value, mask, scaling, softcap, sinks):
    """Attention under an explicit mask (bool, or additive float) with a softcap or sinks, which
    SDPA does not take: the product in torch, softmax in float32 (as HF's eager paths)."""
    group = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(group, 1), value.repeat_interleave(group, 1)
    scores = (query @ key.transpose(-1, -2)).float() * (query.shape[-1] ** -0.5 if scaling is None else scaling)
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~mask, -math.inf) if mask.dtype == torch.bool else scores + mask
    if sinks is not None:
        scores = torch.cat([scores, sinks.float()[None, :, None, None].expand(*scores.shape[:3], 1)], dim=-1)
    # A row with every key masked (padding) gives 0, not the nan of a softmax over -inf alone.
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)[..., :key.shape[-2]]
    return probs.to(value.dtype) @ value
