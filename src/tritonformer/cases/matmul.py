"""Cases of `matmul`: dtypes, odd and batched shapes, transposed operands, epilogues, split-K and
float8 scales for the tests; the benchmark against cuBLAS (and cuBLAS then torch, torch.compile for
the fused epilogues, torch._scaled_mm for float8) over model-sized shapes, forward and backward."""

from __future__ import annotations

import math

import torch

from .. import runtime
from ..ops.matmul import ACTIVATIONS, FP8, activation_reference, matmul, matmul_reference
from ..spec import Bench, BenchCase, OpSpec, TestCase, short_dtype
from . import peers

# torch.matmul runs cuBLAS on a GPU; under the interpreter it is torch's CPU matmul.
TORCH_MATMUL = "torch (CPU)" if runtime.INTERPRET else "cuBLAS"


def test_cases() -> list[TestCase]:
    def rand(shape, dtype, device, grad=True):
        return torch.randn(shape, device=device).to(dtype).requires_grad_(grad and dtype != FP8)

    def case(id, a_shape, b_shape, dtype, *, bias=False, activation=None, b_transposed=False, a_transposed=False,
             fp8_scales=None, out_dtype=None, gpu_only=False):
        def make(device):
            a = rand(a_shape[:-2] + a_shape[-2:][::-1], dtype, device).mT if a_transposed else rand(a_shape, dtype, device)
            if b_transposed:
                b = rand(b_shape[:-2] + b_shape[-2:][::-1], dtype, device).mT
            else:
                b = rand(b_shape, dtype, device)
            kwargs = {}
            if bias:  # float8 matmul has no backward: its bf16 bias needs no gradient
                kwargs["bias"] = rand((b_shape[-1],), dtype if dtype != FP8 else torch.bfloat16, device, dtype != FP8)
            if activation:
                kwargs["activation"] = activation
            if fp8_scales == "tensor":
                kwargs["scale_a"] = torch.rand((), device=device) + 0.5
                kwargs["scale_b"] = torch.rand((), device=device) + 0.5
            elif fp8_scales == "row":
                kwargs["scale_a"] = torch.rand(math.prod(a_shape[:-1]), 1, device=device) + 0.5
                kwargs["scale_b"] = torch.rand(1, b_shape[-1], device=device) + 0.5
            if out_dtype is not None:
                kwargs["out_dtype"] = out_dtype
            return (a, b), kwargs

        expected_dtype = out_dtype or (torch.bfloat16 if dtype == FP8 else dtype)
        tolerance = "fp8" if dtype == FP8 and expected_dtype == torch.float32 else None
        return TestCase(id, make, expected_dtype, grad=dtype != FP8, gpu_only=gpu_only, tolerance=tolerance)

    cases = []
    for dt in (torch.float32, torch.float16, torch.bfloat16):
        name = str(dt).replace("torch.", "")
        cases += [
            case(f"{name}-64x64x64", (64, 64), (64, 64), dt),
            case(f"{name}-odd-37x45x53", (37, 53), (53, 45), dt),
            case(f"{name}-bias-gelu", (40, 48), (48, 72), dt, bias=True, activation="gelu"),
            case(f"{name}-bT", (33, 64), (64, 40), dt, b_transposed=True),
            case(f"{name}-aT-bT", (24, 40), (40, 56), dt, a_transposed=True, b_transposed=True),
            case(f"{name}-batched", (3, 20, 32), (3, 32, 24), dt),
            case(f"{name}-splitk-8x16x2048", (8, 2048), (2048, 16), dt, bias=True, activation="silu"),
            case(f"{name}-1024x1024x1024", (1024, 1024), (1024, 1024), dt, gpu_only=True),
            case(f"{name}-4095x4097x4093", (4095, 4093), (4093, 4097), dt, gpu_only=True),
            case(f"{name}-16x4096x4096", (16, 4096), (4096, 4096), dt, bias=True, gpu_only=True),
            case(f"{name}-batched-8x512x512", (8, 512, 512), (8, 512, 512), dt, gpu_only=True),
        ]
    for act in ("relu", "leaky_relu", "gelu_tanh", "silu"):
        cases.append(case(f"bf16-{act}", (24, 32), (32, 40), torch.bfloat16, bias=True, activation=act))
    cases += [
        case("fp32-3d-a-2d-b", (2, 5, 24), (24, 16), torch.float32, bias=True),
        case("fp32-broadcast-batch", (2, 1, 9, 16), (3, 16, 8), torch.float32),
        case("fp32-k1", (5, 1), (1, 7), torch.float32),
        case("fp8-tensor-scales", (40, 64), (64, 48), FP8, b_transposed=True, fp8_scales="tensor"),
        case("fp8-row-scales-bias", (2, 20, 64), (64, 48), FP8, b_transposed=True, fp8_scales="row", bias=True),
        case("fp8-row-major-b-fp32-out", (32, 64), (64, 32), FP8, fp8_scales="tensor", out_dtype=torch.float32),
        case("fp8-4096x4096x4096", (4096, 4096), (4096, 4096), FP8, b_transposed=True, fp8_scales="row",
             gpu_only=True),
    ]
    return cases


MATMUL_SHAPES = [  # (batch, M, N, K)
    (1, 1024, 1024, 1024), (1, 4096, 4096, 4096), (1, 8192, 8192, 8192), (1, 8192, 12288, 4096),
    (1, 8192, 4096, 11008), (1, 16, 4096, 4096), (1, 128, 4096, 4096), (1, 4095, 4097, 4093), (32, 512, 512, 512),
]
QUICK_SHAPES = [(1, 64, 64, 64), (1, 37, 45, 53), (2, 32, 32, 32)]


def _shape_label(batch, M, N, K):
    return f"{batch}x{M}x{N}x{K}" if batch > 1 else f"{M}x{N}x{K}"


def bench_cases() -> list[BenchCase]:
    cases = []
    dev = runtime.DEVICE
    for dtype in (torch.bfloat16, torch.float16):
        dname = short_dtype(dtype)
        for quick, shapes in ((True, QUICK_SHAPES), (False, MATMUL_SHAPES)):
            for i, (batch, M, N, K) in enumerate(shapes):
                def setup(batch=batch, M=M, N=N, K=K, dtype=dtype):
                    lead = (batch,) if batch > 1 else ()
                    a = torch.randn(*lead, M, K, device=dev, dtype=dtype)
                    b = torch.randn(*lead, K, N, device=dev, dtype=dtype)
                    return Bench(
                        providers={"tritonformer": lambda: matmul(a, b), TORCH_MATMUL: lambda: torch.matmul(a, b)},
                        reference=lambda: torch.matmul(a.float(), b.float()),
                    )

                cases.append(BenchCase("matmul", "fwd", dtype, _shape_label(batch, M, N, K), i, setup,
                                       flops=2 * batch * M * N * K, plot=f"{dname} (x: shape index)", quick=quick))

    for act in ("relu", "gelu", "gelu_tanh", "silu", None):
        for M, N, K in ((64, 64, 64), (4096, 4096, 4096), (8192, 8192, 8192)):
            quick = M == 64

            def setup_act(M=M, N=N, K=K, act=act):
                a = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
                b = torch.randn(K, N, device=dev, dtype=torch.bfloat16)
                bias = torch.randn(N, device=dev, dtype=torch.bfloat16)
                code = ACTIVATIONS[act]

                def cublas_then_torch():
                    return activation_reference(torch.addmm(bias, a, b), code, 0.01)

                def fused_reference():
                    return matmul_reference(a, b, bias, act)

                return Bench(
                    providers=peers.available({
                        "tritonformer": lambda: matmul(a, b, bias, act),
                        f"{TORCH_MATMUL}+torch": cublas_then_torch,
                        "torch.compile": peers.compiled(fused_reference),
                    }),
                    reference=fused_reference,
                )

            cases.append(BenchCase("matmul", "fwd", torch.bfloat16, f"{M}x{N}x{K} bias+{act or 'none'}", M, setup_act,
                                   flops=2 * M * N * K, plot=f"bf16 bias+{act or 'none'}", quick=quick))

    for M, N, K in ((64, 64, 64), (4096, 4096, 4096), (8192, 8192, 8192)):
        def setup_fp8(M=M, N=N, K=K):
            a = torch.randn(M, K, device=dev).to(FP8)
            b = torch.randn(N, K, device=dev).to(FP8).t()
            scale_a = torch.rand(M, 1, device=dev) + 0.5
            scale_b = torch.rand(1, N, device=dev) + 0.5
            providers = {"tritonformer": lambda: matmul(a, b, scale_a=scale_a, scale_b=scale_b)}
            if not runtime.INTERPRET:
                providers["torch._scaled_mm"] = lambda: torch._scaled_mm(a, b, scale_a, scale_b, out_dtype=torch.bfloat16)
            return Bench(providers=providers,
                         reference=lambda: matmul_reference(a, b, scale_a=scale_a, scale_b=scale_b))

        # The bf16 output, rounded once, is what the check holds to a tolerance.
        cases.append(BenchCase("matmul", "fwd", FP8, f"{M}x{N}x{K} rowwise", M, setup_fp8, flops=2 * M * N * K,
                               plot="fp8 e4m3 row-wise scales", quick=M == 64, tolerance=torch.bfloat16))

    for M, N, K in ((64, 64, 64), (4096, 4096, 4096)):
        def setup_bwd(M=M, N=N, K=K):
            a = torch.randn(M, K, device=dev, dtype=torch.bfloat16, requires_grad=True)
            b = torch.randn(K, N, device=dev, dtype=torch.bfloat16, requires_grad=True)
            dout = torch.randn(M, N, device=dev, dtype=torch.bfloat16)

            def run(fn):
                return lambda: torch.autograd.grad(fn(a, b), (a, b), dout)

            return Bench(providers={"tritonformer": run(matmul), TORCH_MATMUL: run(torch.matmul)},
                         reference=lambda: (dout.double() @ b.double().T, a.double().T @ dout.double()))

        cases.append(BenchCase("matmul", "fwd+bwd", torch.bfloat16, f"{M}x{N}x{K}", M, setup_bwd,
                               flops=3 * 2 * M * N * K, plot="bf16 forward+backward", quick=M == 64))
    return cases


SPEC = OpSpec(
    name="matmul",
    fn=matmul,
    reference=matmul_reference,
    test_cases=test_cases,
    bench_cases=bench_cases,
    compare="norm",
)
