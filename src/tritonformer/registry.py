"""The op registry: one line per op. It drives the generic tests and the benchmark grid."""

from __future__ import annotations

from .ops import add, matmul, softmax
from .spec import OpSpec

OPS: dict[str, OpSpec] = {spec.name: spec for spec in (add.SPEC, softmax.SPEC, matmul.SPEC)}
