"""tritonformer: Triton kernels for Transformers, forward and backward."""

from . import runtime  # first: it picks the interpreter before triton is imported
from . import optim, quant
from .capture import capture_step
from .decoding import generate, release
from .ops.add import add
from .ops.adamw import adamw_step
from .ops.argmax import argmax
from .ops.attention import attention
from .ops.cross_entropy import cross_entropy, fused_linear_cross_entropy
from .ops.decode_attention import decode_attention
from .ops.decode_linear import PreparedRow, decode_linear, decode_linear_into_norm, decode_swiglu
from .ops.matmul import matmul
from .ops.grouped_mm import grouped_mm
from .ops.moe import moe_route
from .ops.moe_experts import gpt_oss_experts, moe_experts
from .ops.norm import add_rms_norm, layer_norm, rms_norm
from .ops.rope import apply_rope, qkv_rope
from .ops.scaled_matmul import scaled_matmul
from .ops.softmax import softmax
from .ops.swiglu import swiglu, swiglu_mlp

__version__ = "0.1.0"
__all__ = ["PreparedRow", "adamw_step", "add", "add_rms_norm", "argmax", "attention", "apply_rope", "capture_step", "cross_entropy", "decode_attention", "decode_linear", "decode_linear_into_norm", "decode_swiglu", "fused_linear_cross_entropy", "generate", "gpt_oss_experts", "grouped_mm", "layer_norm", "matmul", "moe_experts", "moe_route", "optim", "qkv_rope", "release", "rms_norm", "scaled_matmul", "softmax", "swiglu", "swiglu_mlp", "quant", "runtime", "__version__"]
