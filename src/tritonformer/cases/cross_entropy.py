"""Cases of `cross_entropy` and `fused_linear_cross_entropy`: every reduction, ignored rows, label
smoothing and z-loss, looped, strided and extreme rows in every float dtype for the tests; bf16
vocabularies of 32000 to 262144 for the benchmark (forward+backward, and the loss's forward alone),
against torch, torch.compile and Liger (and the unfused matmul + cross_entropy for the fused op)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import runtime
from ..ops.cross_entropy import (ROW_CHUNK, cross_entropy, cross_entropy_reference, fused_linear_cross_entropy,
                                 fused_linear_cross_entropy_reference)
from ..spec import Bench, BenchCase, OpSpec, TestCase
from . import peers


def random_targets(shape, V, device, ignored=0.0, ignore_index=-100, dtype=torch.int64):
    """Random class indices, a fraction `ignored` of them set to ignore_index."""
    t = torch.randint(0, V, shape, device=device)
    t[torch.rand(shape, device=device) < ignored] = ignore_index
    return t.to(dtype)


def cross_entropy_test_cases() -> list[TestCase]:
    def case(id, shape, dtype, *, scale=1.0, layout="contiguous", ignored=0.0, target_dtype=torch.int64,
             gpu_only=False, **kwargs):
        def make(device):
            if layout == "transposed":
                logits = (torch.randn(shape[::-1], device=device) * scale).to(dtype).t()
            elif layout == "row-strided":
                logits = (torch.randn(*shape[:-1], shape[-1] + 13, device=device) * scale).to(dtype)[..., 5:-8]
            else:
                logits = (torch.randn(shape, device=device) * scale).to(dtype)
            target = random_targets(shape[:-1], shape[-1], device, ignored, kwargs.get("ignore_index", -100),
                                    target_dtype)
            return (logits.requires_grad_(True), target), kwargs
        return TestCase(id, make, dtype, gpu_only=gpu_only)

    def near_float_max(device):
        # Rows whose target is the largest bfloat16 (loss 0, gradient 0 up to its one-hot) and
        # rows where it is elsewhere (loss just below the maximum), with -max in every row.
        logits = torch.randn(8, 300, device=device)
        target = torch.randint(0, 300, (8,), device=device)
        peak = torch.where(torch.arange(8, device=device) % 2 == 0, target, (target + 7) % 300)
        logits[torch.arange(8), peak] = torch.finfo(torch.bfloat16).max
        logits[torch.arange(8), (target + 11) % 300] = -torch.finfo(torch.bfloat16).max
        return (logits.to(torch.bfloat16).requires_grad_(True), target), {"reduction": "none"}

    cases = []
    for dt in runtime.FLOAT_DTYPES:
        name = str(dt).replace("torch.", "")
        cases += [
            case(f"{name}-7x50", (7, 50), dt),
            case(f"{name}-looped-13x{2 * ROW_CHUNK + 300}", (13, 2 * ROW_CHUNK + 300), dt, ignored=0.3),
            case(f"{name}-sum-ignored-17x300", (17, 300), dt, ignored=0.4, reduction="sum"),
            case(f"{name}-none-3x5x130", (3, 5, 130), dt, ignored=0.3, reduction="none"),
            case(f"{name}-smoothing-zloss-9x777", (9, 777), dt, ignored=0.2, label_smoothing=0.1, z_loss=1e-3),
            case(f"{name}-1024x128256", (1024, 128256), dt, ignored=0.1, gpu_only=True),
            case(f"{name}-16x262144-smoothing", (16, 262144), dt, label_smoothing=0.05, gpu_only=True),
        ]
    cases += [
        case("fp32-all-ignored", (6, 40), torch.float32, ignored=1.0),
        case("fp32-empty", (0, 40), torch.float32),
        case("fp32-empty-sum", (0, 40), torch.float32, reduction="sum"),
        case("fp32-ignore-index-3", (20, 6), torch.float32, ignore_index=3, ignored=0.3),
        case("fp32-int32-target", (11, 90), torch.float32, target_dtype=torch.int32, ignored=0.2),
        case("fp32-row-strided", (19, 333), torch.float32, layout="row-strided", ignored=0.2),
        case("bf16-transposed", (21, 64), torch.bfloat16, layout="transposed", reduction="none"),
        case("fp32-logits-1e4", (10, 500), torch.float32, scale=1e4, reduction="none", label_smoothing=0.1),
        case("fp32-logits-1e4-mean-zloss", (10, 500), torch.float32, scale=1e4, z_loss=1e-4),
        case("fp32-unbatched", (77,), torch.float32, reduction="none"),
        TestCase("bf16-float-max", near_float_max, torch.bfloat16),
        # Gemma 2's final-logit softcapping (logits scaled past the cap, over chunk boundaries).
        case(f"fp32-softcap-looped-7x{ROW_CHUNK + 300}", (7, ROW_CHUNK + 300), torch.float32, scale=20.0,
             ignored=0.2, softcap=30.0),
        case("bf16-softcap-none-smoothing-zloss", (9, 333), torch.bfloat16, scale=10.0, reduction="none",
             softcap=5.0, label_smoothing=0.1, z_loss=1e-3),
        case("fp16-softcap-1024x256000", (1024, 256000), torch.float16, scale=20.0, softcap=30.0, gpu_only=True),
    ]
    return cases


def _fwd_bwd(loss_fn, inputs, upstream=None):
    """A thunk returning the loss and its gradients with respect to `inputs` (not accumulated)."""
    if loss_fn is None:
        return None

    def run():
        loss = loss_fn()
        return (loss.detach(), *torch.autograd.grad(loss, inputs, upstream))
    return run


# Float64 checks of a whole (N, V) gradient need several float64 copies of it: bigger cases are
# checked by the GPU tests instead.
BENCH_CHECK_MAX_ELEMENTS = 2**27


def cross_entropy_bench_cases() -> list[BenchCase]:
    dev, dtype = runtime.DEVICE, torch.bfloat16
    cases = []
    for N, V, quick in ((33, 500, True), (4096, 32000, False), (8192, 128256, False), (8192, 262144, False)):
        def setup(N=N, V=V):
            logits = torch.randn(N, V, device=dev, dtype=dtype, requires_grad=True)
            target = random_targets((N,), V, dev)
            # Undoes the mean's 1/N so that gradient entries are of order 1 for the check.
            upstream = torch.full((), float(N), device=dev, dtype=dtype)
            lg = peers.liger()
            # Liger writes its gradient over its input: it gets a copy, made on its first call so
            # that the providers measured before it do not count the copy in their peak memory.
            liger_logits = []

            def liger():
                if not liger_logits:
                    liger_logits.append(logits.detach().clone().requires_grad_(True))
                x = liger_logits[0]
                loss = lg.LigerCrossEntropyFunction.apply(x, target, None, -100, 0.0, 0.0, "mean")[0]
                return (loss.detach(), *torch.autograd.grad(loss, x, upstream))

            def reference():
                x = logits.detach().double().requires_grad_(True)
                loss = cross_entropy_reference(x, target)
                return (loss, *torch.autograd.grad(loss, x, upstream.double()))

            compiled = peers.compiled(F.cross_entropy, logits, target)
            return Bench(
                providers=peers.available({
                    "tritonformer": _fwd_bwd(lambda: cross_entropy(logits, target), logits, upstream),
                    "torch": _fwd_bwd(lambda: F.cross_entropy(logits, target), logits, upstream),
                    "torch.compile": _fwd_bwd(compiled, logits, upstream),
                    "liger": liger if lg else None,
                }),
                reference=reference if N * V <= BENCH_CHECK_MAX_ELEMENTS else None,
            )

        cases.append(BenchCase("cross_entropy", "fwd+bwd", dtype, f"{N}x{V}", V, setup, bytes=3 * N * V * 2,
                               plot="forward+backward bf16", quick=quick))

    for N, V, quick in ((33, 500, True), (8192, 128256, False)):
        def setup_fwd(N=N, V=V):
            logits = torch.randn(N, V, device=dev, dtype=dtype)
            target = random_targets((N,), V, dev)
            lg = peers.liger()
            return Bench(
                providers=peers.available({
                    "tritonformer": lambda: cross_entropy(logits, target),
                    "torch": lambda: F.cross_entropy(logits, target),
                    "torch.compile": peers.compiled(F.cross_entropy, logits, target),
                    "liger": (lambda: lg.LigerCrossEntropyFunction.apply(logits, target, None)[0]) if lg else None,
                }),
                reference=lambda: _chunked_reference_loss(logits, target),
            )

        cases.append(BenchCase("cross_entropy", "fwd", dtype, f"{N}x{V}", V, setup_fwd, bytes=N * V * 2,
                               plot="forward bf16", quick=quick))
    return cases


def _chunked_reference_loss(logits, target, rows=1024):
    """The mean loss in float64, a block of rows at a time."""
    total = sum(cross_entropy_reference(logits[i:i + rows].double(), target[i:i + rows], reduction="sum")
                for i in range(0, logits.shape[0], rows))
    return total / (target != -100).sum()


SPEC = OpSpec(
    name="cross_entropy",
    fn=cross_entropy,
    reference=cross_entropy_reference,
    test_cases=cross_entropy_test_cases,
    bench_cases=cross_entropy_bench_cases,
    compare="elementwise",
)


def fused_linear_cross_entropy_test_cases() -> list[TestCase]:
    def case(id, T, H, V, dtype, *, batch=None, bias=False, ignored=0.0, transposed=False, gpu_only=False,
             **kwargs):
        def make(device):
            lead = batch or (T,)
            hidden = torch.randn(*lead, H, device=device)
            if transposed:
                hidden = hidden.reshape(-1, H).t().contiguous().t()
            weight = torch.randn(V, H, device=device) / H**0.5
            args = [hidden.to(dtype).requires_grad_(True), weight.to(dtype).requires_grad_(True),
                    random_targets(lead, V, device, ignored, kwargs.get("ignore_index", -100))]
            if bias:
                kwargs["bias"] = (torch.randn(V, device=device) * 0.1).to(dtype).requires_grad_(True)
            return tuple(args), dict(kwargs)
        # The gradients are computed in the forward, before the upstream gradient is known, and
        # scaled by it in the backward: one rounding more than the unfused path (2.05 times
        # torch's float16 error on the 1024x512x32000 case on the H100).
        reduced = kwargs.get("reduction", "mean") != "none"
        return TestCase(id, make, dtype, gpu_only=gpu_only, grad_floor=3.0,
                        out_dtype=torch.float32 if reduced else None)

    cases = []
    for dt in runtime.FLOAT_DTYPES:
        name = str(dt).replace("torch.", "")
        cases += [
            case(f"{name}-bias-33x32x500", 33, 32, 500, dt, bias=True, ignored=0.2),
            case(f"{name}-sum-smoothing-zloss-29x48x300", 29, 48, 300, dt, ignored=0.3, reduction="sum",
                 label_smoothing=0.1, z_loss=1e-3),
            case(f"{name}-none-2x9x40x260", 18, 40, 260, dt, batch=(2, 9), bias=True, ignored=0.3, reduction="none"),
            case(f"{name}-1024x512x32000", 1024, 512, 32000, dt, bias=True, ignored=0.1, gpu_only=True),
        ]
    cases += [
        case("fp32-num-items-31x16x200", 31, 16, 200, torch.float32, ignored=0.3, num_items_in_batch=57),
        case("fp32-num-items-sum", 31, 16, 200, torch.float32, ignored=0.3, reduction="sum", num_items_in_batch=40),
        case(f"bf16-looped-17x24x{ROW_CHUNK + 500}", 17, 24, ROW_CHUNK + 500, torch.bfloat16, bias=True),
        case("fp32-hidden-transposed", 23, 20, 150, torch.float32, transposed=True, ignored=0.2),
        case("fp32-ignore-index-0", 23, 20, 150, torch.float32, ignore_index=0, ignored=0.2),
        # Gemma 2's final-logit softcapping: hidden scaled so that the logits pass the cap.
        case("fp32-softcap-31x16x200", 31, 16, 200, torch.float32, ignored=0.3, softcap=1.5),
        case("bf16-softcap-none-bias", 18, 40, 260, torch.bfloat16, bias=True, reduction="none", softcap=2.0),
        case("bf16-softcap-1024x512x32000", 1024, 512, 32000, torch.bfloat16, softcap=2.0, gpu_only=True),
    ]
    return cases


def _torch_linear_cross_entropy(hidden, weight, target):
    return F.cross_entropy(hidden @ weight.t(), target)


def fused_linear_cross_entropy_bench_cases() -> list[BenchCase]:
    dev, dtype = runtime.DEVICE, torch.bfloat16
    cases = []
    for T, H, V, quick in ((33, 32, 500, True), (4096, 2048, 32000, False), (8192, 4096, 128256, False)):
        def setup(T=T, H=H, V=V):
            hidden = torch.randn(T, H, device=dev, dtype=dtype, requires_grad=True)
            weight = (torch.randn(V, H, device=dev) / H**0.5).to(dtype).requires_grad_(True)
            target = random_targets((T,), V, dev)
            inputs = (hidden, weight)
            lg = peers.liger()

            def reference():
                h, w = (t.detach().double().requires_grad_(True) for t in inputs)
                loss = fused_linear_cross_entropy_reference(h, w, target)
                return (loss, *torch.autograd.grad(loss, (h, w)))

            def liger():
                return lg.LigerFusedLinearCrossEntropyFunction.apply(hidden, weight, target)[0]

            compiled = peers.compiled(_torch_linear_cross_entropy, hidden, weight, target)
            return Bench(
                providers=peers.available({
                    "tritonformer": _fwd_bwd(lambda: fused_linear_cross_entropy(hidden, weight, target), inputs),
                    "unfused": _fwd_bwd(lambda: cross_entropy(hidden @ weight.t(), target), inputs),
                    "torch": _fwd_bwd(lambda: _torch_linear_cross_entropy(hidden, weight, target), inputs),
                    "torch.compile": _fwd_bwd(compiled, inputs),
                    "liger": _fwd_bwd(liger if lg else None, inputs),
                }),
                reference=reference if T * V <= BENCH_CHECK_MAX_ELEMENTS else None,
            )

        cases.append(BenchCase("fused_linear_cross_entropy", "fwd+bwd", dtype, f"{T}x{H}x{V}", V, setup,
                               flops=6 * T * H * V, plot="forward+backward bf16", quick=quick))
    return cases


FUSED_LINEAR_SPEC = OpSpec(
    name="fused_linear_cross_entropy",
    fn=fused_linear_cross_entropy,
    reference=fused_linear_cross_entropy_reference,
    test_cases=fused_linear_cross_entropy_test_cases,
    bench_cases=fused_linear_cross_entropy_bench_cases,
    compare="norm",
)
