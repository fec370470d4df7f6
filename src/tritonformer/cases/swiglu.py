"""Cases of `swiglu` and `swiglu_mlp`: odd, sliced (halves of one projection) and empty inputs in
every float dtype for the tests; bf16 Llama-sized activations and MLPs for the benchmark, against
torch, torch.compile and Liger."""

from __future__ import annotations

import torch

from .. import runtime
from ..ops.swiglu import swiglu, swiglu_mlp, swiglu_mlp_reference, swiglu_reference
from ..spec import Bench, BenchCase, OpSpec, TestCase, short_dtype
from . import peers


def swiglu_test_cases() -> list[TestCase]:
    def case(id, shape, dtype, sliced=False, scale=1.0, gpu_only=False):
        def make(device):
            if sliced:  # gate and up as halves of one fused projection's output
                gu = (torch.randn(*shape[:-1], 2 * shape[-1], device=device) * scale).to(dtype).requires_grad_(True)
                return gu.chunk(2, dim=-1), {}
            gate = (torch.randn(shape, device=device) * scale).to(dtype).requires_grad_(True)
            up = torch.randn(shape, device=device).to(dtype).requires_grad_(True)
            return (gate, up), {}
        return TestCase(id, make, dtype, gpu_only=gpu_only)

    cases = []
    for dt in runtime.FLOAT_DTYPES:
        name = short_dtype(dt)
        cases += [
            case(f"{name}-1x1", (1, 1), dt),
            case(f"{name}-3x5x1000", (3, 5, 1000), dt),
            case(f"{name}-sliced-7x300", (7, 300), dt, sliced=True),
            case(f"{name}-2048x14336", (2048, 14336), dt, gpu_only=True),
        ]
    cases += [
        case("fp32-large-gate", (4, 999), torch.float32, scale=100.0),
        case("fp32-empty", (0, 9), torch.float32),
    ]
    return cases


def swiglu_mlp_test_cases() -> list[TestCase]:
    def case(id, tokens, hidden, inter, dtype, bias=False, gpu_only=False):
        def make(device):
            x = torch.randn(*tokens, hidden, device=device).to(dtype).requires_grad_(True)
            ws = [(torch.randn(o, i, device=device) / i**0.5).to(dtype).requires_grad_(True)
                  for o, i in ((inter, hidden), (inter, hidden), (hidden, inter))]
            bs = [torch.randn(n, device=device).to(dtype).requires_grad_(True) if bias else None
                  for n in (inter, inter, hidden)]
            return (x, *ws, *bs), {}
        return TestCase(id, make, dtype, gpu_only=gpu_only)

    cases = [case(f"{short_dtype(dt)}-2x5x48-128", (2, 5), 48, 128, dt) for dt in runtime.FLOAT_DTYPES]
    cases += [
        case("fp32-bias-7x33-70", (7,), 33, 70, torch.float32, bias=True),
        case("bf16-4x512x1024-2816", (4, 512), 1024, 2816, torch.bfloat16, gpu_only=True),
    ]
    return cases


def swiglu_bench_cases() -> list[BenchCase]:
    cases = []
    for M, N in [(8192, 14336), (4096, 11008), (16384, 4096), (256, 1024)]:
        dtype = torch.bfloat16
        quick = M == 256

        def setup(mode, M=M, N=N, dtype=dtype):
            device = runtime.DEVICE
            g = torch.randn(M, N, device=device, dtype=dtype, requires_grad=mode != "fwd")
            u = torch.randn(M, N, device=device, dtype=dtype, requires_grad=mode != "fwd")
            dh = torch.randn(M, N, device=device, dtype=dtype)
            lg = peers.liger()
            providers = {
                "tritonformer": lambda: swiglu(g, u),
                "torch": lambda: swiglu_reference(g, u),
                "torch.compile": peers.compiled(swiglu_reference, g, u),
                "liger": (lambda: lg.LigerSiLUMulFunction.apply(g, u)) if lg else None,
            }
            if mode == "fwd":
                return Bench(peers.available(providers), reference=lambda: swiglu_reference(g.double(), u.double()))

            def fwd_bwd(fn):
                return None if fn is None else lambda: torch.autograd.grad(fn(), (g, u), dh)

            def reference():
                leaves = [g.detach().double().requires_grad_(True), u.detach().double().requires_grad_(True)]
                return torch.autograd.grad(swiglu_reference(*leaves), leaves, dh.double())

            return Bench(peers.available({k: fwd_bwd(v) for k, v in providers.items()}), reference=reference)

        size = M * N * dtype.itemsize
        shape = f"{M}x{N}"
        cases.append(BenchCase("swiglu", "fwd", dtype, shape, M * N, lambda s=setup: s("fwd"), bytes=3 * size,
                               plot=f"forward {short_dtype(dtype)}", quick=quick))
        # forward: g, u read, h written; backward: g, u, dh read, dg, du written.
        cases.append(BenchCase("swiglu", "fwd+bwd", dtype, shape, M * N, lambda s=setup: s("fwd+bwd"),
                               bytes=8 * size, plot=f"forward+backward {short_dtype(dtype)}", quick=quick))
    return cases


def swiglu_mlp_bench_cases() -> list[BenchCase]:
    cases = []
    for tokens, hidden, inter in [(8192, 4096, 14336), (8192, 2048, 8192), (64, 256, 512)]:
        dtype = torch.bfloat16

        def setup(tokens=tokens, hidden=hidden, inter=inter, dtype=dtype):
            device = runtime.DEVICE
            x = torch.randn(tokens, hidden, device=device, dtype=dtype, requires_grad=True)
            ws = [(torch.randn(o, i, device=device) / i**0.5).to(dtype).requires_grad_(True)
                  for o, i in ((inter, hidden), (inter, hidden), (hidden, inter))]
            dy = torch.randn(tokens, hidden, device=device, dtype=dtype)
            inputs = (x, *ws)
            lg = peers.liger()

            def liger_mlp():
                g = torch.nn.functional.linear(x, ws[0])
                u = torch.nn.functional.linear(x, ws[1])
                return torch.nn.functional.linear(lg.LigerSiLUMulFunction.apply(g, u), ws[2])

            def fwd_bwd(fn):
                return None if fn is None else lambda: torch.autograd.grad(fn(), inputs, dy)

            def reference():
                leaves = [t.detach().float().requires_grad_(True) for t in inputs]
                return torch.autograd.grad(swiglu_mlp_reference(*leaves), leaves, dy.float())

            return Bench(peers.available({
                "tritonformer": fwd_bwd(lambda: swiglu_mlp(*inputs)),
                "torch": fwd_bwd(lambda: swiglu_mlp_reference(*inputs)),
                "torch.compile": fwd_bwd(peers.compiled(swiglu_mlp_reference, *inputs)),
                "liger": fwd_bwd(liger_mlp if lg else None),
            }), reference=reference)

        cases.append(BenchCase("swiglu_mlp", "fwd+bwd", dtype, f"{tokens}x{hidden}x{inter}", tokens * inter, setup,
                               flops=3 * 2 * 3 * tokens * hidden * inter, plot=f"forward+backward {short_dtype(dtype)}",
                               quick=tokens == 64))
    return cases


SPEC = OpSpec(name="swiglu", fn=swiglu, reference=swiglu_reference, test_cases=swiglu_test_cases,
              bench_cases=swiglu_bench_cases)

MLP_SPEC = OpSpec(name="swiglu_mlp", fn=swiglu_mlp, reference=swiglu_mlp_reference, test_cases=swiglu_mlp_test_cases,
                  bench_cases=swiglu_mlp_bench_cases, compare="norm")
