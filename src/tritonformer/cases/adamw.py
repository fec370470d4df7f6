"""Cases of `adamw_step`, AdamW's update of lists of tensors: odd sizes, empty and strided tensors,
amsgrad, maximize, a learning rate in a tensor and later steps, in every float dtype, for the
tests; the parameters of the bench e2e models for the benchmark, against torch's fused AdamW (and
at the e2e model torch's AdamW step under torch.compile)."""

from __future__ import annotations

import torch

from .. import runtime
from ..ops.adamw import adamw_step, adamw_step_reference
from ..optim import AdamW
from ..spec import Bench, BenchCase, OpSpec, TestCase, short_dtype
from . import peers


def _split(flat: tuple, count: int) -> list[list[torch.Tensor]]:
    """params, grads, exp_avgs, exp_avg_sqs, steps (and max_exp_avg_sqs) from one flat tuple."""
    return [list(flat[i:i + count]) for i in range(0, len(flat), count)]


def _stepped(step, *flat, count, lr, amsgrad=False, **options):
    """The params, exp_avgs, exp_avg_sqs and what each step count went up by (and max_exp_avg_sqs)
    after `step` ran on copies of them (an empty tensor's count too)."""
    lists = _split(tuple(t.detach().clone() for t in flat), count)
    params, grads, exp_avgs, exp_avg_sqs, steps = lists[:5]
    before = [s.clone() for s in steps]
    if isinstance(lr, torch.Tensor):
        lr = lr.to(steps[0].device) if step is adamw_step else float(lr)
    step(params, grads, exp_avgs, exp_avg_sqs, steps, lr=lr, max_exp_avg_sqs=lists[5] if amsgrad else None,
         **options)
    # The increments, 1 each, in the params' dtype as the harness compares outputs: 0 or 2 is far off in any.
    counts = [(s - b).to(params[0].dtype) for s, b in zip(steps, before)]
    return (*params, *exp_avgs, *exp_avg_sqs, *counts, *(lists[5] if amsgrad else ()))


def adamw_outputs(*flat, **options):
    return _stepped(adamw_step, *flat, **options)


def adamw_flat_reference(*flat, **options):
    return _stepped(adamw_step_reference, *flat, **options)


def _state(device, shapes, dtype, step=0, amsgrad=False, strided=False, unaligned=False) -> tuple:
    """A flat tuple of params, grads, exp_avgs, exp_avg_sqs, steps (float32) and, with amsgrad,
    max_exp_avg_sqs of `shapes`; with `strided`, every tensor a transposed view; with `unaligned`,
    each a view one element into a buffer."""
    def tensor(shape, scale=1.0, positive=False):
        t = torch.randn(shape[::-1] if strided else shape, device=device) * scale
        t = (t.abs() if positive else t).to(dtype)
        if unaligned:
            return torch.cat([t.new_zeros(1), t.flatten()])[1:].view(shape)
        return t.t() if strided else t

    first = step == 0  # a first step starts from zero moments
    params = [tensor(s) for s in shapes]
    grads = [tensor(s) for s in shapes]
    exp_avgs = [tensor(s, 0.0 if first else 0.1) for s in shapes]
    exp_avg_sqs = [tensor(s, 0.0 if first else 0.01, positive=True) for s in shapes]
    steps = [torch.full((), float(step), device=device) for _ in shapes]
    max_sqs = [tensor(s, 0.0 if first else 0.02, positive=True) for s in shapes] if amsgrad else []
    return (*params, *grads, *exp_avgs, *exp_avg_sqs, *steps, *max_sqs)


def adamw_test_cases() -> list[TestCase]:
    def case(id, shapes, dtype, step=0, amsgrad=False, strided=False, unaligned=False, lr_tensor=False,
             gpu_only=False, **options):
        def make(device):
            lr = torch.tensor(3e-2, device=device) if lr_tensor else 3e-2
            flat = _state(device, shapes, dtype, step, amsgrad, strided, unaligned)
            return flat, dict(count=len(shapes), lr=lr, amsgrad=amsgrad, **options)
        return TestCase(id, make, dtype, grad=False, gpu_only=gpu_only)

    odd = [(3, 5), (4097,), (1,), (0, 2), (64, 33)]
    cases = []
    for dt in runtime.FLOAT_DTYPES:
        name = short_dtype(dt)
        cases += [
            case(f"{name}-odd-first-step", odd, dt, weight_decay=0.1),
            case(f"{name}-first-and-last-empty", [(0, 2), (5,), (0,)], dt, step=4),
            case(f"{name}-step-7-amsgrad-maximize", odd, dt, step=7, amsgrad=True, maximize=True, beta1=0.8),
            case(f"{name}-strided-lr-tensor", [(5, 7), (33, 64)], dt, step=2, strided=True, lr_tensor=True),
            case(f"{name}-unaligned-amsgrad", [(4100,), (3, 7)], dt, step=3, unaligned=True, amsgrad=True),
            case(f"{name}-llama-layer", [(2048, 2048), (512, 2048), (8192, 2048), (2048,)], dt, step=100,
                 gpu_only=True),
        ]
    cases += [
        case("fp32-beta1-0-no-decay", [(10,), (3, 3)], torch.float32, step=3, beta1=0.0, weight_decay=0.0),
        case("fp32-step-100000", [(100,)], torch.float32, step=100000),
        case("fp32-all-empty", [(0,), (2, 0)], torch.float32, step=1),
    ]
    return cases


def model_shapes(layers: int, hidden: int, intermediate: int, heads: int, kv_heads: int, vocab: int,
                 qkv_bias: bool = False, tied: bool = True) -> list[tuple[int, ...]]:
    """The parameters of a Llama-style decoder (and of its lm_head, unless tied to the embedding)."""
    head_dim = hidden // heads
    q, kv = heads * head_dim, kv_heads * head_dim
    layer = [(q, hidden), (kv, hidden), (kv, hidden), (hidden, q), (intermediate, hidden), (intermediate, hidden),
             (hidden, intermediate), (hidden,), (hidden,)]
    if qkv_bias:
        layer += [(q,), (kv,), (kv,)]
    return [(vocab, hidden)] + layer * layers + [(hidden,)] + ([] if tied else [(vocab, hidden)])


# name: model_shapes arguments (the bench e2e models: SmolLM2-135M, Qwen2.5-0.5B, the e2e model).
BENCH_MODELS = {
    "smollm2-135m": (30, 576, 1536, 9, 3, 49152),
    "qwen2.5-0.5b": (24, 896, 4864, 14, 2, 151936, True),
    "e2e": (8, 2048, 8192, 16, 4, 128256, False, False),
    "tiny": (2, 64, 128, 4, 2, 256),
}


def adamw_bench_cases() -> list[BenchCase]:
    cases = []
    for name, sizes in BENCH_MODELS.items():
        shapes = model_shapes(*sizes)
        count = sum(torch.Size(s).numel() for s in shapes)
        dtype = torch.bfloat16

        def setup(shapes=shapes, dtype=dtype, compiled_peer=name == "e2e"):
            device = runtime.DEVICE
            params = [torch.nn.Parameter(torch.randn(s, device=device, dtype=dtype) * 0.02) for s in shapes]
            for p in params:
                p.grad = torch.randn_like(p) * 1e-3
            start = [p.detach().clone() for p in params]
            ours = AdamW(params, lr=1e-4)
            torch_fused = torch.optim.AdamW(params, lr=1e-4, fused=True) if device == "cuda" else None
            # torch's recipe for a compiled optimizer (the foreach step traced into inductor's
            # kernels), for the e2e model's 75 tensors only: its compile grows with the tensor count.
            torch_compiled = torch.optim.AdamW(params, lr=1e-4) if device == "cuda" and compiled_peer else None

            def step(opt):
                opt.step()
                return params

            def reference():
                leaves = [s.double() for s in start]
                moments = [torch.zeros_like(t) for t in leaves]
                adamw_step_reference(leaves, [p.grad.double() for p in params], moments,
                                     [torch.zeros_like(t) for t in leaves],
                                     [torch.zeros((), dtype=torch.float64) for _ in leaves], lr=1e-4)
                return leaves

            return Bench(peers.available({
                "tritonformer": lambda: step(ours),
                "torch": (lambda: step(torch_fused)) if torch_fused else None,
                "torch.compile": peers.compiled(step, torch_compiled) if torch_compiled else None,
            }), reference=reference)

        # p, g, m, v read; p, m, v written.
        cases.append(BenchCase("adamw", "step", dtype, name, count, setup, bytes=7 * count * dtype.itemsize,
                               plot=f"AdamW step {short_dtype(dtype)}", quick=name == "tiny"))
    return cases


SPEC = OpSpec(name="adamw", fn=adamw_outputs, reference=adamw_flat_reference, test_cases=adamw_test_cases,
              bench_cases=adamw_bench_cases)
