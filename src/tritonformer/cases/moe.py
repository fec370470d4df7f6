"""Cases of `moe_route`: softmax and sigmoid scoring, renormalised or not, a selection bias,
odd expert counts, 3-D and strided logits, every float dtype for the tests; the router of a
Qwen3-30B-A3B-shaped layer (8192 tokens, 128 experts, top 8) forward and forward+backward for the
benchmark, against torch and torch.compile."""

from __future__ import annotations

import torch

from .. import runtime
from ..ops.moe import moe_route, moe_route_reference
from ..spec import Bench, BenchCase, OpSpec, TestCase, bench_rows
from . import peers


def routed_weights(router_logits, top_k, normalize=False, scoring="softmax", selection_bias=None):
    """moe_route's weights (its indices pick them: a wrong choice shows as wrong weights)."""
    return moe_route(router_logits, top_k, normalize, scoring, selection_bias)[0]


def routed_weights_reference(router_logits, top_k, normalize=False, scoring="softmax", selection_bias=None):
    return moe_route_reference(router_logits, top_k, normalize, scoring, selection_bias)[0]


def test_cases() -> list[TestCase]:
    def case(id, dtype, shape=(37, 60), top_k=4, normalize=True, scoring="softmax", bias=False, strided=False,
             gpu_only=False):
        def make(device):
            # Distinct logits in every dtype (a random order of evenly spaced values in [-4, 4)):
            # tied scores may pick either expert, here and in torch.topk alike.
            width = 2 * shape[-1] if strided else shape[-1]
            z = torch.rand(*shape[:-1], width, device=device).argsort(-1).float() * (8 / width) - 4
            z = (z[..., ::2] if strided else z).to(dtype)
            b = torch.randn(shape[-1], device=device) * 0.1 if bias else None
            return (z.requires_grad_(True), top_k), dict(normalize=normalize, scoring=scoring, selection_bias=b)

        return TestCase(id, make, dtype, gpu_only=gpu_only)

    cases = []
    for dt in runtime.FLOAT_DTYPES:
        name = str(dt).replace("torch.", "")
        cases += [
            case(f"{name}-60x4-norm", dt),
            case(f"{name}-8x2", dt, shape=(2, 9, 8), top_k=2, normalize=False),
            case(f"{name}-sigmoid-bias", dt, shape=(21, 32), top_k=3, scoring="sigmoid", bias=True),
            case(f"{name}-sigmoid", dt, shape=(11, 16), top_k=2, normalize=False, scoring="sigmoid"),
        ]
    cases += [
        case("fp32-strided", torch.float32, strided=True),
        case("fp32-top1", torch.float32, shape=(5, 3), top_k=1, normalize=False),
        case("bf16-8192x128-top8", torch.bfloat16, shape=(8192, 128), top_k=8, gpu_only=True),
    ]
    return cases


def bench_cases() -> list[BenchCase]:
    cases = []
    T, E, k, dtype = bench_rows(8192, runtime.INTERPRET), 128, 8, torch.bfloat16
    for mode in ("fwd", "fwd+bwd"):
        def setup(mode=mode):
            grad = mode != "fwd"
            z = torch.randn(T, E, device=runtime.DEVICE, dtype=dtype, requires_grad=grad)
            dw = torch.randn(T, k, device=runtime.DEVICE, dtype=dtype)

            def run(forward):
                if forward is None:
                    return None
                return (lambda: torch.autograd.grad(forward(), z, dw)) if grad else forward

            return Bench(peers.available({
                "tritonformer": run(lambda: routed_weights(z, k, True)),
                "torch": run(lambda: routed_weights_reference(z, k, True)),
                "torch.compile": run(peers.compiled(routed_weights_reference, z, k, True)),
            }), reference=(lambda: routed_weights_reference(z.double(), k, True)) if not grad else None)

        size = T * E * dtype.itemsize
        moved = size + T * k * (dtype.itemsize + 4) if mode == "fwd" else 3 * size + 2 * T * k * (dtype.itemsize + 4)
        cases.append(BenchCase("moe_route", mode, dtype, f"{T}x{E}-top{k}", T, setup, bytes=moved,
                               plot=f"{'forward' if mode == 'fwd' else 'forward+backward'} bf16", quick=True))
    return cases


SPEC = OpSpec(
    name="moe_route",
    fn=routed_weights,
    reference=routed_weights_reference,
    test_cases=test_cases,
    bench_cases=bench_cases,
)
