"""The op registry: one line per op. It drives the generic tests and the benchmark grid."""

from __future__ import annotations

from .cases import (adamw, add, attention, cross_entropy, decode_linear, matmul, moe, norm, rope, scaled_matmul,
                    softmax, swiglu)
from .spec import OpSpec

OPS: dict[str, OpSpec] = {spec.name: spec for spec in (
    add.SPEC,
    adamw.SPEC,
    attention.SPEC,
    attention.DECODE_SPEC,
    softmax.SPEC,
    matmul.SPEC,
    norm.RMS_NORM_SPEC,
    norm.ADD_RMS_NORM_SPEC,
    norm.LAYER_NORM_SPEC,
    swiglu.SPEC,
    swiglu.MLP_SPEC,
    rope.SPEC,
    rope.QKV_SPEC,
    rope.INTO_CACHE_SPEC,
    decode_linear.LINEAR_SPEC,
    decode_linear.SWIGLU_SPEC,
    decode_linear.FP4_CHAIN_SPEC,
    decode_linear.ARGMAX_SPEC,
    decode_linear.RECORD_TOKENS_SPEC,
    cross_entropy.SPEC,
    cross_entropy.FUSED_LINEAR_SPEC,
    scaled_matmul.SPEC,
    moe.SPEC,
    moe.GROUPED_MM_SPEC,
    moe.EXPERTS_SPEC,
    moe.GPT_OSS_EXPERTS_SPEC,
)}
