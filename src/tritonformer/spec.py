"""The records that a case module (`cases/<op>.py`) fills in and the registry collects: what to test,
what to time; and the short dtype names that cases and the harness both print."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

Thunk = Callable[[], Any]

_SHORT_DTYPE_NAMES = {
    torch.float64: "fp64",
    torch.float32: "fp32",
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.float8_e4m3fn: "fp8e4m3",
    torch.float8_e5m2: "fp8e5m2",
    torch.int64: "i64",
    torch.int32: "i32",
    torch.int8: "i8",
}


def short_dtype(dtype: torch.dtype) -> str:
    return _SHORT_DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch."))


# Under the interpreter a CPU runs a kernel's programs one after another, a row block each: the
# quick grid keeps each case's row length (which picks the kernel and its launch) and few rows.
INTERPRETER_ROWS = 64


def bench_rows(rows: int, interpret: bool) -> int:
    """The rows a benchmark case takes: `rows`, or at most INTERPRETER_ROWS under the interpreter."""
    return min(rows, INTERPRETER_ROWS) if interpret else rows


@dataclass(frozen=True)
class TestCase:
    """One input configuration for the generic registry tests.

    `make(device)` draws fresh random inputs and returns `(args, kwargs)` for both the op and its
    reference; floating tensors among `args` that require grad get their gradients checked.
    """

    id: str
    make: Callable[[str], tuple[tuple, dict]]
    dtype: torch.dtype
    grad: bool = True
    gpu_only: bool = False
    tolerance: object = None  # key into testing's tables when not `dtype` (e.g. "fp8")
    compare: str | None = None  # the op's `compare` unless set
    # Gradients may be off by this many times PyTorch's own error in the same dtype.
    grad_floor: float = 2.0
    out_dtype: torch.dtype | None = None  # the outputs' dtype where it is not `dtype`


@dataclass(frozen=True)
class Bench:
    """What a benchmark case builds on the device: one thunk per provider, each doing the same
    work (forward, backward or both) on the same inputs, and a float64 reference thunk whose
    result the first provider's result is checked against."""

    providers: dict[str, Thunk]
    reference: Thunk | None = None


@dataclass(frozen=True)
class BenchCase:
    op: str
    mode: str  # "fwd", "bwd" or "fwd+bwd"
    dtype: torch.dtype
    shape: str  # label, e.g. "4096x1024"
    x: int  # position on the plot's x axis
    setup: Callable[[], Bench]
    bytes: int = 0  # fewest bytes the work must move (GB/s is reported when > 0)
    flops: int = 0  # floating-point operations (TFLOP/s is reported when > 0)
    plot: str = ""  # plots group cases with the same `plot` name into one panel
    quick: bool = False  # part of the quick grid (CPU runs and smoke tests)
    compare: str | None = None  # the op's `compare` unless set (e.g. "norm" for reduced gradients)
    # Key into testing's tables when not `dtype`: an fp8 case's outputs are bf16 or fp32.
    tolerance: object = None


@dataclass(frozen=True)
class OpSpec:
    name: str
    fn: Callable
    reference: Callable
    test_cases: Callable[[], list[TestCase]]
    bench_cases: Callable[[], list[BenchCase]]
    # "elementwise": every element within atol + rtol*|ref|; "norm": ||out - ref|| / ||ref||
    compare: str = "elementwise"
    notes: dict[str, str] = field(default_factory=dict)
