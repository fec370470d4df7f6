"""nn.Module drop-ins: subclasses of the torch modules they replace, so state_dicts, constructor
arguments and isinstance checks keep working."""

from __future__ import annotations

import torch

from .ops.cross_entropy import cross_entropy, fused_linear_cross_entropy
from .ops.matmul import matmul
from .ops.norm import layer_norm, rms_norm
from .ops.rope import LAYOUTS as ROPE_LAYOUTS, apply_rope
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
        return matmul(x, self.weight.t(), self.bias)


class RMSNorm(torch.nn.Module):
    """HuggingFace's LlamaRMSNorm (same `weight` parameter and `variance_epsilon` attribute, so
    its state_dict loads); `offset=1.0` gives GemmaRMSNorm, whose weight starts at zero."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, offset: float = 0.0, device=None, dtype=None):
        super().__init__()
        init = torch.zeros if offset else torch.ones
        self.weight = torch.nn.Parameter(init(hidden_size, device=device, dtype=dtype))
        self.variance_epsilon = eps
        self.offset = offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.variance_epsilon, self.offset)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}, offset={self.offset}"


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
