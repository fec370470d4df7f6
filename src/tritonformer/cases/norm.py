"""Cases of `rms_norm`, `layer_norm` and `add_rms_norm`: odd, strided, empty and looped rows in
every float dtype (and Gemma's offset, LayerNorm's large mean) for the tests; bf16 rows of 2048 to
16384 columns for the benchmark, forward and forward+backward, against torch, torch.compile and
Liger."""

from __future__ import annotations

import torch

from .. import runtime
from ..ops.norm import (FUSED_MAX_N, add_rms_norm, add_rms_norm_reference, layer_norm, layer_norm_reference,
                        rms_norm, rms_norm_reference)
from ..spec import Bench, BenchCase, OpSpec, TestCase, bench_rows, short_dtype
from . import peers


def _norm_test_cases(rms: bool) -> list[TestCase]:
    def case(id, shape, dtype, weight=True, bias=True, offset=0.0, transpose=False, scale=1.0, shift=0.0,
             gpu_only=False, tolerance=None, compare=None, round_before_weight=True, weight_dtype=None):
        def make(device):
            n = shape[-1]
            x = torch.randn(shape[::-1] if transpose else shape, device=device) * scale + shift
            x = (x.mT if transpose else x).to(dtype).requires_grad_(True)
            w = 1 + 0.5 * torch.randn(n, device=device) if weight else None
            w = w.to(weight_dtype or dtype).requires_grad_(True) if weight else None
            if rms:
                return (x, w), {"eps": 1e-6, "offset": offset, "round_before_weight": round_before_weight}
            b = torch.randn(n, device=device).to(dtype).requires_grad_(True) if bias else None
            return (x, w, b), {"eps": 1e-5}
        return TestCase(id, make, dtype, gpu_only=gpu_only, tolerance=tolerance, compare=compare)

    cases = []
    for dt in runtime.FLOAT_DTYPES:
        name = short_dtype(dt)
        cases += [
            # One column is degenerate for RMSNorm's gradient (x-hat = +-1 projects it all away).
            case(f"{name}-1x3", (1, 3), dt),
            case(f"{name}-7x1000", (7, 1000), dt),
            case(f"{name}-2x3x4097", (2, 3, 4097), dt),
            case(f"{name}-300x64", (300, 64), dt),  # more rows than backward programs here
            case(f"{name}-looped-2x{FUSED_MAX_N + 77}", (2, FUSED_MAX_N + 77), dt),
            case(f"{name}-4096x4096", (4096, 4096), dt, gpu_only=True),
            case(f"{name}-64x65536", (64, 65536), dt, gpu_only=True),
        ]
    cases += [
        case("fp32-no-weight", (5, 33), torch.float32, weight=False, bias=False),
        case("fp32-transposed", (40, 17), torch.float32, transpose=True),
        case("fp32-large-values", (4, 999), torch.float32, scale=1e4),
        case("fp32-empty", (0, 9), torch.float32),
    ]
    if rms:
        cases += [case(f"{short_dtype(dt)}-gemma-9x300", (9, 300), dt, offset=1.0) for dt in runtime.FLOAT_DTYPES]
        # GPT-OSS's norm multiplies before rounding; its checkpoints keep the weight in float32.
        cases += [case(f"{short_dtype(dt)}-gpt-oss-9x300", (9, 300), dt, round_before_weight=False)
                  for dt in runtime.FLOAT_DTYPES]
        cases += [case(f"{short_dtype(dt)}-gpt-oss-fp32-weight-5x{FUSED_MAX_N + 3}", (5, FUSED_MAX_N + 3), dt,
                       round_before_weight=False, weight_dtype=torch.float32) for dt in (torch.float16, torch.bfloat16)]
    else:
        cases += [
            case("fp32-weight-only", (6, 40), torch.float32, bias=False),
            # A float32 mean near 1000 is itself off by up to 3e-5 (half its ulp), as torch's is,
            # which no elementwise bound on outputs near zero allows; the variance must not lose
            # more (E[x^2] - mean^2 would be off by about 10%).
            case("fp32-large-mean", (4, 512), torch.float32, shift=1e3, tolerance=torch.float16, compare="norm"),
        ]
    return cases


def _norm_bench_cases(rms: bool) -> list[BenchCase]:
    op = "rms_norm" if rms else "layer_norm"
    cases = []
    grid = [(16384, 4096), (16384, 8192), (bench_rows(4096, runtime.INTERPRET), 2048), (4096, 16384)]
    for M, N in grid:
        dtype = torch.bfloat16
        quick = N == 2048

        def setup(mode, M=M, N=N, dtype=dtype):
            device = runtime.DEVICE
            x = torch.randn(M, N, device=device, dtype=dtype, requires_grad=mode != "fwd")
            w = (1 + 0.1 * torch.randn(N, device=device)).to(dtype).requires_grad_(mode != "fwd")
            b = torch.randn(N, device=device, dtype=dtype, requires_grad=mode != "fwd")
            dy = torch.randn(M, N, device=device, dtype=dtype)
            lg = peers.liger()
            if rms:
                ours = lambda: rms_norm(x, w, 1e-6)  # noqa: E731
                ref = lambda x, w: rms_norm_reference(x, w, 1e-6)  # noqa: E731
                liger = (lambda: lg.LigerRMSNormFunction.apply(x, w, 1e-6, 0.0, "llama")) if lg else None
                eager = (lambda: ref(x, w))
                inputs, ref_inputs = (x, w), lambda: (x.double(), w.double())
            else:
                ours = lambda: layer_norm(x, w, b, 1e-5)  # noqa: E731
                ref = lambda x, w, b: torch.nn.functional.layer_norm(x, x.shape[-1:], w, b, 1e-5)  # noqa: E731
                liger = (lambda: lg.LigerLayerNormFunction.apply(x, w, b, 1e-5)) if lg else None
                eager = (lambda: ref(x, w, b))
                inputs, ref_inputs = (x, w, b), lambda: (x.double(), w.double(), b.double())
            compiled = peers.compiled(ref, *inputs)
            providers = {"tritonformer": ours, "torch": eager, "torch.compile": compiled, "liger": liger}
            if mode == "fwd":
                return Bench(peers.available(providers), reference=lambda: ref(*ref_inputs()))

            def fwd_bwd(fn):
                return None if fn is None else lambda: torch.autograd.grad(fn(), inputs, dy)

            def reference():
                leaves = [t.detach().requires_grad_(True) for t in ref_inputs()]
                return torch.autograd.grad(ref(*leaves), leaves, dy.double())

            return Bench(peers.available({k: fwd_bwd(v) for k, v in providers.items()}), reference=reference)

        size = M * N * 2
        shape = f"{M}x{N}"
        cases.append(BenchCase(op, "fwd", dtype, shape, N, lambda s=setup: s("fwd"), bytes=2 * size,
                               plot=f"forward {short_dtype(dtype)}", quick=quick))
        # x read twice, y written, dy read, dx written: the five passes the targets count.
        # dw and db sum over every row: held to a norm-wise bound, as in the tests.
        cases.append(BenchCase(op, "fwd+bwd", dtype, shape, N, lambda s=setup: s("fwd+bwd"), bytes=5 * size,
                               plot=f"forward+backward {short_dtype(dtype)}", quick=quick, compare="norm"))
    return cases


def rms_norm_test_cases() -> list[TestCase]:
    return _norm_test_cases(rms=True)


def layer_norm_test_cases() -> list[TestCase]:
    return _norm_test_cases(rms=False)


def rms_norm_bench_cases() -> list[BenchCase]:
    return _norm_bench_cases(rms=True)


def layer_norm_bench_cases() -> list[BenchCase]:
    return _norm_bench_cases(rms=False)


def add_rms_norm_test_cases() -> list[TestCase]:
    def case(id, shape, dtype, weight=True, offset=0.0, transposed_residual=False, gpu_only=False,
             round_before_weight=True, weight_dtype=None):
        def make(device):
            n = shape[-1]
            x = torch.randn(shape, device=device).to(dtype).requires_grad_(True)
            res = torch.randn(shape[::-1], device=device).mT if transposed_residual else torch.randn(shape, device=device)
            res = res.to(dtype).requires_grad_(True)
            w = 1 + 0.5 * torch.randn(n, device=device) if weight else None
            w = w.to(weight_dtype or dtype).requires_grad_(True) if weight else None
            return (x, res, w), {"eps": 1e-6, "offset": offset, "round_before_weight": round_before_weight}
        return TestCase(id, make, dtype, gpu_only=gpu_only)

    cases = []
    for dt in runtime.FLOAT_DTYPES:
        name = short_dtype(dt)
        cases += [
            case(f"{name}-2x3x1000", (2, 3, 1000), dt),
            case(f"{name}-300x64", (300, 64), dt),
            case(f"{name}-gemma-9x300", (9, 300), dt, offset=1.0),
            case(f"{name}-gpt-oss-9x300", (9, 300), dt, round_before_weight=False),
            case(f"{name}-8192x2048", (8192, 2048), dt, gpu_only=True),
        ]
    cases += [
        case("fp32-no-weight-transposed-residual", (40, 17), torch.float32, weight=False, transposed_residual=True),
        case("bf16-gpt-oss-fp32-weight-6x200", (6, 200), torch.bfloat16, round_before_weight=False,
             weight_dtype=torch.float32),
        case(f"fp32-looped-2x{FUSED_MAX_N + 5}", (2, FUSED_MAX_N + 5), torch.float32),
        case("fp32-empty", (0, 9), torch.float32),
    ]
    return cases


def add_rms_norm_bench_cases() -> list[BenchCase]:
    cases = []
    for M, N in [(8192, 2048), (16384, 4096), (256, 512)]:
        dtype = torch.bfloat16

        def setup(M=M, N=N, dtype=dtype):
            device = runtime.DEVICE
            x, res = (torch.randn(M, N, device=device, dtype=dtype, requires_grad=True) for _ in range(2))
            w = (1 + 0.1 * torch.randn(N, device=device)).to(dtype).requires_grad_(True)
            dy, dh = torch.randn(M, N, device=device, dtype=dtype), torch.randn(M, N, device=device, dtype=dtype)
            lg = peers.liger()
            inputs = (x, res, w)

            def liger():
                h = x + res
                return lg.LigerRMSNormFunction.apply(h, w, 1e-6, 0.0, "llama"), h

            def fwd_bwd(fn):
                return None if fn is None else lambda: torch.autograd.grad(fn(), inputs, (dy, dh))

            def reference():
                leaves = [t.detach().double().requires_grad_(True) for t in inputs]
                return torch.autograd.grad(add_rms_norm_reference(*leaves), leaves, (dy.double(), dh.double()))

            return Bench(peers.available({
                "tritonformer": fwd_bwd(lambda: add_rms_norm(x, res, w)),
                "torch": fwd_bwd(lambda: add_rms_norm_reference(x, res, w)),
                "torch.compile": fwd_bwd(peers.compiled(add_rms_norm_reference, x, res, w)),
                "liger": fwd_bwd(liger if lg else None),
            }), reference=reference)

        size = M * N * 2
        # Forward: x, residual read, y, h written; backward: dy, dh, h read, dx written.
        cases.append(BenchCase("add_rms_norm", "fwd+bwd", dtype, f"{M}x{N}", N, setup, bytes=8 * size,
                               plot=f"forward+backward {short_dtype(dtype)}", quick=M == 256, compare="norm"))
    return cases


# Norm-wise: y is the norm of h rounded to the input dtype (as HF's add then norm compute it),
# against a float64 reference that never rounds h.
ADD_RMS_NORM_SPEC = OpSpec(name="add_rms_norm", fn=add_rms_norm, reference=add_rms_norm_reference,
                           test_cases=add_rms_norm_test_cases, bench_cases=add_rms_norm_bench_cases, compare="norm")

RMS_NORM_SPEC = OpSpec(
    name="rms_norm",
    fn=rms_norm,
    reference=rms_norm_reference,
    test_cases=rms_norm_test_cases,
    bench_cases=rms_norm_bench_cases,
)

LAYER_NORM_SPEC = OpSpec(
    name="layer_norm",
    fn=layer_norm,
    reference=layer_norm_reference,
    test_cases=layer_norm_test_cases,
    bench_cases=layer_norm_bench_cases,
)
