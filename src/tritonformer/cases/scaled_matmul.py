"""Cases of `scaled_matmul`: every format as weights of bf16 rows (one row, a few, split K, bias)
and both operands block-scaled for the tests; the benchmark against torch's bf16 matmul and
dequantize-then-matmul (and torch._scaled_mm for fp8) at decode and 8192^3 sizes, and quantize."""

from __future__ import annotations

import torch

from .. import quant, runtime
from ..ops.scaled_matmul import scaled_matmul, scaled_matmul_reference
from ..quant import FORMATS
from ..spec import Bench, BenchCase, OpSpec, TestCase


def test_cases() -> list[TestCase]:
    def case(id, M, N, K, fmt_b, fmt_a=None, bias=False, gpu_only=False, out_dtype=torch.bfloat16):
        def make(device):
            b = quant.quantize(torch.randn(N, K, device=device), fmt_b, axis=1)
            x = torch.randn(M, K, device=device)
            a = quant.quantize(x, fmt_a) if fmt_a else x.to(torch.bfloat16)
            kwargs = {"out_dtype": out_dtype}
            if bias:
                kwargs["bias"] = torch.randn(N, device=device)
            return (a, b), kwargs
        return TestCase(id, make, out_dtype, grad=False, gpu_only=gpu_only, compare="norm")

    cases = [case(f"bf16-x-{fmt}-{M}x45x96", M, 45, 96, fmt) for fmt in FORMATS for M in (1, 19)]
    # K long enough to be split (the interpreter splits from 2 blocks of K on).
    cases += [case(f"bf16-x-{fmt}-split-k-bias-5x33x256", 5, 33, 256, fmt, bias=True) for fmt in FORMATS]
    cases += [case("mxfp8-x-mxfp8-bias-fp32", 33, 40, 64, "mxfp8", "mxfp8", bias=True, out_dtype=torch.float32),
              case("mxfp4-x-mxfp4", 17, 31, 64, "mxfp4", "mxfp4"),
              case("nvfp4-x-nvfp4", 17, 31, 64, "nvfp4", "nvfp4"),
              case("mxfp8-x-mxfp4-fp16", 9, 70, 128, "mxfp4", "mxfp8", out_dtype=torch.float16)]
    cases += [case(f"gpu-bf16-x-{fmt}-300x1000x4096", 300, 1000, 4096, fmt, gpu_only=True) for fmt in FORMATS]
    cases += [case("gpu-mxfp8-x-mxfp8-1000x777x2048", 1000, 777, 2048, "mxfp8", "mxfp8", gpu_only=True)]
    return cases


def bench_cases() -> list[BenchCase]:
    dev = runtime.DEVICE
    bf16 = torch.bfloat16
    cases = []
    grid = [(1, 64, 256, True)] if runtime.INTERPRET else \
        [(M, N, K, M == 16 and N == 8192) for M in (1, 16, 64, 256) for N, K in ((8192, 8192), (28672, 8192))]
    for fmt in ("nvfp4", "mxfp4", "mxfp8"):
        for M, N, K, quick in grid:
            def setup_weight_only(M=M, N=N, K=K, fmt=fmt):
                weight = torch.randn(N, K, device=dev, dtype=bf16)
                w = quant.quantize(weight, fmt, axis=1)
                w_bf16 = w.dequantize(bf16)
                x = torch.randn(M, K, device=dev, dtype=bf16)
                return Bench({"tritonformer": lambda: scaled_matmul(x, w),
                              "torch bf16": lambda: x @ w_bf16.t(),
                              "dequantize+torch": lambda: x @ w.dequantize(bf16).t()},
                             reference=lambda: scaled_matmul_reference(x, w))
            cases.append(BenchCase("scaled_matmul", "fwd", bf16, f"bf16 x {fmt} {M}x{N}x{K}", M, setup_weight_only,
                                   flops=2 * M * N * K, plot=f"bf16 x {fmt} weights", quick=quick))
    big = 256 if runtime.INTERPRET else 8192
    for fmt_a, fmt_b in (("mxfp8", "mxfp8"), ("mxfp4", "mxfp4"), ("nvfp4", "nvfp4"), ("mxfp8", "mxfp4")):
        def setup_both(fmt_a=fmt_a, fmt_b=fmt_b, n=big):
            x = torch.randn(n, n, device=dev, dtype=bf16)
            weight = torch.randn(n, n, device=dev, dtype=bf16)
            a, b = quant.quantize(x, fmt_a), quant.quantize(weight, fmt_b, axis=1)
            providers = {"tritonformer": lambda: scaled_matmul(a, b), "torch bf16": lambda: x @ weight.t(),
                         "dequantize+torch": lambda: a.dequantize(bf16) @ b.dequantize(bf16).t()}
            if fmt_a == fmt_b == "mxfp8" and not runtime.INTERPRET:
                a8, b8 = x.to(torch.float8_e4m3fn), weight.to(torch.float8_e4m3fn)
                ones_a = torch.ones(n, 1, device=dev)
                ones_b = torch.ones(1, n, device=dev)
                providers["torch._scaled_mm fp8 row-wise"] = lambda: torch._scaled_mm(
                    a8, b8.t(), ones_a, ones_b, out_dtype=bf16)
            small = n <= 2048
            return Bench(providers, reference=(lambda: scaled_matmul_reference(a, b)) if small else None)
        cases.append(BenchCase("scaled_matmul", "fwd", bf16, f"{fmt_a} x {fmt_b} {big}^3", big, setup_both,
                               flops=2 * big**3, plot="both operands block-scaled", quick=runtime.INTERPRET))
    rows, cols = (64, 256) if runtime.INTERPRET else (16384, 8192)
    # nvfp4 also with its tensor amax given (one read of x instead of two).
    for fmt, given in [(fmt, False) for fmt in FORMATS] + [("nvfp4", True)]:
        def setup_quantize(fmt=fmt, given=given):
            x = torch.randn(rows, cols, device=dev, dtype=bf16)
            amax = x.float().abs().amax() if given else None
            return Bench({"tritonformer": lambda: quant.quantize(x, fmt, tensor_amax=amax)})
        label = f"quantize {fmt} {rows}x{cols}" + (" given amax" if given else "")
        cases.append(BenchCase("scaled_matmul", "quantize", bf16, label, rows, setup_quantize,
                               bytes=2 * rows * cols, plot="quantize (bf16 read)", quick=runtime.INTERPRET))
    return cases


SPEC = OpSpec(
    name="scaled_matmul",
    fn=scaled_matmul,
    reference=scaled_matmul_reference,
    test_cases=test_cases,
    bench_cases=bench_cases,
    compare="norm",
)
