"""Cases of `softmax`: odd, strided, empty, along dim 0, and rows past the registers (the looped
kernels) in every float dtype for the tests; fp32 and bf16 rows of 1024 to 262144 columns for the
benchmark, forward and backward, against torch, torch.compile and Liger."""

from __future__ import annotations

import torch

from .. import runtime
from ..ops.softmax import FUSED_MAX_N, softmax, softmax_bwd, softmax_bwd_reference, softmax_reference
from ..spec import Bench, BenchCase, OpSpec, TestCase, bench_rows, short_dtype
from . import peers


def test_cases() -> list[TestCase]:
    def case(id, shape, dtype, dim=-1, transpose=False, scale=1.0, gpu_only=False):
        def make(device):
            x = torch.randn(shape[::-1] if transpose else shape, device=device) * scale
            x = x.to(dtype)
            x = x.mT if transpose else x
            return (x.requires_grad_(True),), {"dim": dim}
        return TestCase(id, make, dtype, gpu_only=gpu_only)

    cases = []
    for dt in runtime.FLOAT_DTYPES:
        name = str(dt).replace("torch.", "")
        cases += [
            case(f"{name}-1x1", (1, 1), dt),
            case(f"{name}-7x123", (7, 123), dt),
            case(f"{name}-3x5x1000", (3, 5, 1000), dt),
            case(f"{name}-dim0", (37, 11), dt, dim=0),
            case(f"{name}-3x{FUSED_MAX_N}", (3, FUSED_MAX_N), dt),
            case(f"{name}-looped-2x{FUSED_MAX_N + 77}", (2, FUSED_MAX_N + 77), dt),
            case(f"{name}-4096x4096", (4096, 4096), dt, gpu_only=True),
            case(f"{name}-8x262144", (8, 262144), dt, gpu_only=True),
        ]
    cases += [
        case("fp32-transposed", (40, 17), torch.float32, transpose=True),
        case("fp32-large-logits", (4, 999), torch.float32, scale=1e4),
        case("fp32-empty", (0, 9), torch.float32),
    ]
    return cases


def bench_cases() -> list[BenchCase]:
    cases = []
    rows = bench_rows(4096, runtime.INTERPRET)
    grid = [(rows, n) for n in (1024, 4096, 16384, 32768)] + [(512, 131072), (256, 262144)]
    for dtype in (torch.float32, torch.bfloat16):
        dname = short_dtype(dtype)
        for M, N in grid:
            quick = N <= 4096

            def setup_fwd(M=M, N=N, dtype=dtype):
                x = torch.randn(M, N, device=runtime.DEVICE, dtype=dtype)
                lg = peers.liger()
                return Bench(
                    providers=peers.available({
                        "tritonformer": lambda: softmax(x),
                        "torch": lambda: torch.softmax(x, -1),
                        "torch.compile": peers.compiled(torch.softmax, x, -1),
                        "liger": (lambda: lg.LigerSoftmaxFunction.apply(x)) if lg else None,
                    }),
                    reference=lambda: torch.softmax(x.double(), -1),
                )

            def setup_bwd(M=M, N=N, dtype=dtype):
                y = torch.softmax(torch.randn(M, N, device=runtime.DEVICE), -1).to(dtype)
                dy = torch.randn(M, N, device=runtime.DEVICE, dtype=dtype)
                return Bench(
                    providers=peers.available({
                        "tritonformer": lambda: softmax_bwd(y, dy, 1),
                        "torch": lambda: torch._softmax_backward_data(dy, y, -1, dtype),
                        "torch.compile": peers.compiled(softmax_bwd_reference, y, dy),
                    }),
                    reference=lambda: softmax_bwd_reference(y.double(), dy.double()),
                )

            size = M * N * dtype.itemsize
            shape = f"{M}x{N}"
            cases.append(BenchCase("softmax", "fwd", dtype, shape, N, setup_fwd, bytes=2 * size,
                                   plot=f"forward {dname}", quick=quick))
            cases.append(BenchCase("softmax", "bwd", dtype, shape, N, setup_bwd, bytes=3 * size,
                                   plot=f"backward {dname}", quick=quick))
    return cases


SPEC = OpSpec(
    name="softmax",
    fn=softmax,
    reference=softmax_reference,
    test_cases=test_cases,
    bench_cases=bench_cases,
    compare="elementwise",
)
