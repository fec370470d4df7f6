"""Cases of `add`: broadcasting, strides and dtypes for the tests; fp32 vectors of 2^12-2^28
elements for the benchmark (3 x 4 bytes an element), against torch and torch.compile."""

from __future__ import annotations

import torch

from .. import runtime
from ..ops.add import DTYPES, add, add_reference
from ..spec import Bench, BenchCase, OpSpec, TestCase
from . import peers


def test_cases() -> list[TestCase]:
    def case(id, xs, ys, dtype, ydtype=None, transpose_x=False, grad=True, gpu_only=False):
        def make(device):
            def draw(shape, dt):
                if dt == torch.int32:
                    return torch.randint(-1000, 1000, shape, dtype=dt, device=device)
                t = torch.randn(shape, device=device).to(dt)
                return t.requires_grad_(grad)
            x = draw(xs[::-1] if transpose_x else xs, dtype)
            x = x.mT if transpose_x else x
            return (x, draw(ys, ydtype or dtype)), {}
        return TestCase(id, make, torch.result_type(torch.empty(0, dtype=dtype), torch.empty(0, dtype=ydtype or dtype)),
                        grad=grad and dtype != torch.int32, gpu_only=gpu_only)

    cases = []
    for dt in DTYPES:
        name = str(dt).replace("torch.", "")
        cases += [
            case(f"{name}-1000", (1000,), (1000,), dt),
            case(f"{name}-rowbcast", (3, 1023), (1023,), dt),
            case(f"{name}-colbcast", (5, 1, 7), (3, 1), dt),
            case(f"{name}-transposed", (33, 17), (33, 17), dt, transpose_x=True),
        ]
    cases += [
        case("empty", (0, 5), (5,), torch.float32),
        case("scalar-tensor", (7, 9), (), torch.float32),
        case("fp16+fp32", (129,), (129,), torch.float16, torch.float32),
        case("bf16-6d", (2, 3, 1, 4, 5, 6), (3, 4, 1, 6), torch.bfloat16),
        case("fp32-2^24", (1 << 24,), (1 << 24,), torch.float32, gpu_only=True),
    ]
    return cases


def bench_cases() -> list[BenchCase]:
    cases = []
    for log_n in (12, 16, 20, 24, 26, 28):
        n = 1 << log_n

        def setup(n=n):
            x = torch.randn(n, device=runtime.DEVICE)
            y = torch.randn(n, device=runtime.DEVICE)
            return Bench(
                providers=peers.available({
                    "tritonformer": lambda: add(x, y),
                    "torch": lambda: x + y,
                    "torch.compile": peers.compiled(torch.add, x, y),
                }),
                reference=lambda: x.double() + y.double(),
            )

        cases.append(BenchCase("add", "fwd", torch.float32, f"n=2^{log_n}", n, setup,
                               bytes=3 * 4 * n, plot="add fp32", quick=log_n <= 16))
    return cases


SPEC = OpSpec(
    name="add",
    fn=add,
    reference=add_reference,
    test_cases=test_cases,
    bench_cases=bench_cases,
    compare="elementwise",
)
