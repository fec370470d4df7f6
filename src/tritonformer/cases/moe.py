"""Cases of `moe_route`: softmax, sigmoid and top-k-then-softmax scoring, renormalised or not, a selection bias,
odd expert counts, 3-D and strided logits, every float dtype for the tests; the router of a
Qwen3-30B-A3B-shaped layer (8192 tokens, 128 experts, top 8) forward and forward+backward for the
benchmark, against torch and torch.compile.

Cases of `grouped_mm` (GROUPED_MM_SPEC): empty groups, rows past the last group, HF's (E, N, K)
weights read transposed, strided rows, every float dtype; the experts' products of a Qwen3-30B-A3B
layer (16384 tokens x top 8 over 128 experts, hidden 2048, intermediate 768) and of a Mixtral layer
(top 2 of 8, hidden 4096, intermediate 14336) against torch._grouped_mm and, for Mixtral, one dense
cuBLAS product of the same FLOPs.

Cases of `moe_experts` (EXPERTS_SPEC): top 1 to 8, idle experts, every float dtype; the benchmark
runs the experts block at Qwen3-30B-A3B's shape (16384 tokens, top 8 of 128 experts, hidden 2048,
intermediate 768) and Mixtral's (top 2 of 8, hidden 4096, intermediate 14336), forward and
forward+backward, against HF's loop over experts and its grouped_mm experts (eager and under
torch.compile), and Liger-Kernel's fused MoE where it is installed.

Cases of `gpt_oss_experts` (GPT_OSS_EXPERTS_SPEC): GPT-OSS's experts (interleaved gate/up with
biases, the clamped SwiGLU) with both clamps acting, every float dtype; the benchmark runs
GPT-OSS-20b's experts (16384 tokens, top 4 of 32, hidden and intermediate 2880) against HF's loop
and its grouped_mm experts (eager and under torch.compile)."""

from __future__ import annotations

import types

import torch

from .. import runtime
from ..ops.grouped_mm import grouped_mm, grouped_mm_reference
from ..ops.moe import moe_route, moe_route_reference
from ..ops.moe_experts import gpt_oss_experts, gpt_oss_experts_reference, moe_experts, moe_experts_reference
from ..spec import Bench, BenchCase, OpSpec, TestCase, bench_rows
from . import peers


def _work(forward, grad: bool, inputs, dout):
    """A provider's thunk: the forward, or with grad the gradients of `inputs` from `dout`
    through it (None where the provider could not be built)."""
    if forward is None:
        return None
    return (lambda: torch.autograd.grad(forward(), inputs, dout)) if grad else forward


def _plot(mode: str) -> str:
    return f"{'forward' if mode == 'fwd' else 'forward+backward'} bf16"


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
            # GPT-OSS: the top 4 of 32 raw logits, a softmax over them.
            case(f"{name}-topk-softmax", dt, shape=(19, 32), normalize=False, scoring="topk_softmax"),
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
                return _work(forward, grad, z, dw)

            return Bench(peers.available({
                "tritonformer": run(lambda: routed_weights(z, k, True)),
                "torch": run(lambda: routed_weights_reference(z, k, True)),
                "torch.compile": run(peers.compiled(routed_weights_reference, z, k, True)),
            }), reference=(lambda: routed_weights_reference(z.double(), k, True)) if not grad else None)

        size = T * E * dtype.itemsize
        moved = size + T * k * (dtype.itemsize + 4) if mode == "fwd" else 3 * size + 2 * T * k * (dtype.itemsize + 4)
        cases.append(BenchCase("moe_route", mode, dtype, f"{T}x{E}-top{k}", T, setup, bytes=moved,
                               plot=_plot(mode), quick=True))
    return cases


SPEC = OpSpec(
    name="moe_route",
    fn=routed_weights,
    reference=routed_weights_reference,
    test_cases=test_cases,
    bench_cases=bench_cases,
)


def _group_ends(counts: list[int], device) -> torch.Tensor:
    return torch.tensor(counts, device=device).cumsum(0).to(torch.int32)


def grouped_mm_test_cases() -> list[TestCase]:
    def case(id, dtype, counts=(7, 0, 23, 3, 12), tail=5, K=24, N=40, hf_layout=False, strided=False,
             gpu_only=False):
        def make(device):
            M = sum(counts) + tail
            a = torch.randn(M, 2 * K if strided else K, device=device)
            a = (a[:, ::2] if strided else a).to(dtype)
            E = len(counts)
            if hf_layout:  # HF keeps (E, N, K) and multiplies by its transpose
                b = (torch.randn(E, N, K, device=device) / K**0.5).to(dtype).transpose(1, 2)
            else:
                b = (torch.randn(E, K, N, device=device) / K**0.5).to(dtype)
            return (a.requires_grad_(True), b.requires_grad_(True), _group_ends(list(counts), device)), {}

        return TestCase(id, make, dtype, gpu_only=gpu_only, compare="norm")

    cases = []
    for dt in runtime.FLOAT_DTYPES:
        name = str(dt).replace("torch.", "")
        cases += [case(f"{name}-5-groups", dt), case(f"{name}-hf-layout", dt, hf_layout=True)]
    cases += [
        case("fp32-strided-rows", torch.float32, strided=True, tail=0),
        case("fp32-one-group", torch.float32, counts=(37,), tail=0, K=33, N=17),
        case("bf16-128-experts", torch.bfloat16, counts=tuple(range(0, 256, 2)), tail=3, K=256, N=384,
             hf_layout=True, gpu_only=True),
    ]
    return cases


def grouped_mm_bench_cases() -> list[BenchCase]:
    """The gate/up product of the experts (N = 2 x intermediate) forward and forward+backward,
    tokens routed uniformly at random."""
    dtype, cases = torch.bfloat16, []
    shapes = [("qwen3-30b-a3b", 16384, 8, 128, 2048, 1536), ("mixtral", 16384, 2, 8, 4096, 28672)]
    for label, tokens, top_k, E, K, N in shapes:
        if runtime.INTERPRET:
            tokens, E, K, N = 8, 4, 32, 48
        M = tokens * top_k
        for mode in ("fwd", "fwd+bwd"):
            def setup(mode=mode, M=M, E=E, K=K, N=N):
                device, grad = runtime.DEVICE, mode != "fwd"
                counts = torch.bincount(torch.randint(0, E, (M,)), minlength=E).tolist()
                offs = _group_ends(counts, device)
                a = torch.randn(M, K, device=device, dtype=dtype, requires_grad=grad)
                w = (torch.randn(E, N, K, device=device, dtype=dtype) / K**0.5).requires_grad_(grad)
                dc = torch.randn(M, N, device=device, dtype=dtype)
                dense_a, dense_b = torch.randn(M, K, device=device, dtype=dtype), torch.randn(K, N, device=device,
                                                                                              dtype=dtype)

                def run(forward):
                    return _work(forward, grad, (a, w), dc)

                def torch_grouped():
                    return torch._grouped_mm(a, w.transpose(1, 2), offs)

                peers_ = {"tritonformer": run(lambda: grouped_mm(a, w.transpose(1, 2), offs)),
                          "torch._grouped_mm": None if runtime.INTERPRET or not hasattr(torch, "_grouped_mm")
                          else run(torch_grouped)}
                if E <= 8 and not grad:
                    peers_["cublas dense"] = lambda: dense_a @ dense_b
                return Bench(peers.available(peers_),
                             reference=None if grad else lambda: grouped_mm_reference(
                                 a.double(), w.double().transpose(1, 2), offs).to(dtype))

            flops = 2 * M * K * N * (3 if mode == "fwd+bwd" else 1)
            cases.append(BenchCase("grouped_mm", mode, dtype, f"{label} {M}x{K}x{N} E{E}", M, setup, flops=flops,
                                   plot=_plot(mode), quick=True,
                                   compare="norm"))
    return cases


GROUPED_MM_SPEC = OpSpec(
    name="grouped_mm",
    fn=grouped_mm,
    reference=grouped_mm_reference,
    test_cases=grouped_mm_test_cases,
    bench_cases=grouped_mm_bench_cases,
    compare="norm",
)


def _experts_inputs(device, T, H, I, E, k, dtype, grad=True):
    x = torch.randn(T, H, device=device).to(dtype)
    gate_up = (torch.randn(E, 2 * I, H, device=device) / H**0.5).to(dtype)
    down = (torch.randn(E, H, I, device=device) / I**0.5).to(dtype)
    weights, experts = torch.softmax(torch.randn(T, E, device=device), -1).topk(k)
    return [t.requires_grad_(grad) for t in (x,)] + [experts] + [
        t.requires_grad_(grad) for t in (weights.to(dtype), gate_up, down)]


def experts_test_cases() -> list[TestCase]:
    def case(id, dtype, T=19, H=32, I=24, E=6, k=2, gpu_only=False):
        return TestCase(id, lambda device: (tuple(_experts_inputs(device, T, H, I, E, k, dtype)), {}), dtype,
                        gpu_only=gpu_only, compare="norm")

    cases = []
    for dt in runtime.FLOAT_DTYPES:
        name = str(dt).replace("torch.", "")
        cases += [case(f"{name}-6-experts-top2", dt), case(f"{name}-top1", dt, k=1, T=9)]
    cases += [case("fp32-top4-odd-sizes", torch.float32, T=13, H=20, I=12, E=5, k=4),
              case("bf16-qwen3-moe-small", torch.bfloat16, T=256, H=256, I=96, E=64, k=8, gpu_only=True)]
    return cases


def _hf_grouped_mm_experts():
    """transformers' grouped_mm experts forward on a stand-in module (None where it is missing)."""
    try:
        from transformers.integrations.moe import _default_apply_gate, grouped_mm_experts_forward
    except ImportError:
        return None

    def forward(x, experts, weights, gate_up, down):
        module = types.SimpleNamespace(num_experts=gate_up.shape[0], has_gate=True, has_bias=False,
                                       is_transposed=False, gate_up_proj=gate_up, down_proj=down,
                                       act_fn=torch.nn.functional.silu)
        module._apply_gate = lambda h: _default_apply_gate(module, h)
        return grouped_mm_experts_forward(module, x, experts, weights)

    return forward


def _liger_experts():
    """Liger-Kernel's fused MoE experts (HF's layout, indices as int32) where it is installed."""
    if peers.liger() is None:
        return None
    try:
        from liger_kernel.ops.fused_moe import LigerFusedMoEFunction
    except ImportError:
        return None

    def forward(x, experts, weights, gate_up, down):
        return LigerFusedMoEFunction.apply(x, gate_up, down, experts.to(torch.int32), weights)

    return forward


# The experts block at the two shapes: (name, tokens, hidden, intermediate, experts, top k).
EXPERTS_BENCH_SHAPES = (("qwen3-30b-a3b", 16384, 2048, 768, 128, 8), ("mixtral", 16384, 4096, 14336, 8, 2))


def _experts_bench_cases(op: str, shapes, make_inputs, ours, reference, hf, liger=None,
                         quick=lambda name: True) -> list[BenchCase]:
    """An experts block's cases, forward and forward+backward at each (name, tokens, hidden,
    intermediate, experts, top k) of shapes (a tiny one under the interpreter): ours against HF's
    loop over experts (reference, in the inputs' dtype), HF's grouped_mm path (hf(), eager and
    under torch.compile) and liger() where those can be built."""
    dtype = torch.bfloat16
    cases = []
    for name, T, H, I, E, k in (("tiny", 8, 32, 16, 4, 2),) if runtime.INTERPRET else shapes:
        for mode in ("fwd", "fwd+bwd"):
            def setup(mode=mode, T=T, H=H, I=I, E=E, k=k):
                grad = mode != "fwd"
                inputs = make_inputs(runtime.DEVICE, T, H, I, E, k, dtype, grad)
                dout = torch.randn(T, H, device=runtime.DEVICE, dtype=dtype)
                params = [t for t in inputs if t.is_floating_point()]

                def run(forward):
                    return _work(forward, grad, params, dout)

                hf_forward = None if runtime.INTERPRET else hf()
                liger_forward = None if liger is None else liger()
                return Bench(peers.available({
                    "tritonformer": run(lambda: ours(*inputs)),
                    "hf eager": None if runtime.INTERPRET else run(lambda: reference(*inputs)),
                    "hf grouped_mm": None if hf_forward is None else run(lambda: hf_forward(*inputs)),
                    "hf grouped_mm + torch.compile": None if hf_forward is None else run(
                        peers.compiled(hf_forward, *inputs)),
                    "liger fused moe": None if liger_forward is None else run(lambda: liger_forward(*inputs)),
                }), reference=None if grad else lambda: reference(
                    *(t.double() if t.is_floating_point() else t for t in inputs)).to(dtype))

            flops = 2 * T * k * H * 3 * I * (3 if mode == "fwd+bwd" else 1)
            cases.append(BenchCase(op, mode, dtype, f"{name} T{T} E{E} top{k} H{H} I{I}", T, setup,
                                   flops=flops, plot=_plot(mode), quick=quick(name), compare="norm"))
    return cases


def experts_bench_cases() -> list[BenchCase]:
    return _experts_bench_cases("moe_experts", EXPERTS_BENCH_SHAPES, _experts_inputs, moe_experts,
                                moe_experts_reference, _hf_grouped_mm_experts, _liger_experts,
                                quick=lambda name: name != "mixtral")


EXPERTS_SPEC = OpSpec(
    name="moe_experts",
    fn=moe_experts,
    reference=moe_experts_reference,
    test_cases=experts_test_cases,
    bench_cases=experts_bench_cases,
    compare="norm",
)


def _gpt_oss_inputs(device, T, H, I, E, k, dtype, grad=True):
    """GPT-OSS's experts' inputs, products large enough that both clamps act on some values."""
    x = torch.randn(T, H, device=device).to(dtype)
    gate_up = (torch.randn(E, H, 2 * I, device=device) * 3 / H**0.5).to(dtype)
    gate_up_bias = (torch.randn(E, 2 * I, device=device) * 2).to(dtype)
    down = (torch.randn(E, I, H, device=device) / I**0.5).to(dtype)
    down_bias = torch.randn(E, H, device=device).to(dtype)
    weights, experts = torch.softmax(torch.randn(T, E, device=device), -1).topk(k)
    x, weights = x.requires_grad_(grad), weights.to(dtype).requires_grad_(grad)
    return [x, experts, weights] + [t.requires_grad_(grad) for t in (gate_up, gate_up_bias, down, down_bias)]


def gpt_oss_test_cases() -> list[TestCase]:
    def case(id, dtype, T=19, H=32, I=24, E=6, k=2, gpu_only=False):
        return TestCase(id, lambda device: (tuple(_gpt_oss_inputs(device, T, H, I, E, k, dtype)), {}), dtype,
                        gpu_only=gpu_only, compare="norm")

    cases = [case(f"{str(dt).replace('torch.', '')}-6-experts-top2", dt) for dt in runtime.FLOAT_DTYPES]
    return cases + [case("fp32-top4-odd-sizes", torch.float32, T=13, H=20, I=12, E=5, k=4),
                    case("bf16-gpt-oss-small", torch.bfloat16, T=256, H=192, I=192, E=32, k=4, gpu_only=True)]


def _hf_grouped_mm_gpt_oss():
    """transformers' grouped_mm experts forward with GPT-OSS's gate (None where either is missing)."""
    try:
        from transformers.integrations.moe import grouped_mm_experts_forward
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts
    except ImportError:
        return None

    def forward(x, experts, weights, gate_up, gate_up_bias, down, down_bias):
        module = types.SimpleNamespace(num_experts=gate_up.shape[0], has_gate=True, has_bias=True, is_transposed=True,
                                       gate_up_proj=gate_up, gate_up_proj_bias=gate_up_bias, down_proj=down,
                                       down_proj_bias=down_bias, alpha=1.702, limit=7.0)
        module._apply_gate = lambda h: GptOssExperts._apply_gate(module, h)
        return grouped_mm_experts_forward(module, x, experts, weights)

    return forward


# GPT-OSS-20b's experts (32 of hidden and intermediate 2880, top 4) on 16384 tokens.
GPT_OSS_BENCH_SHAPES = (("gpt-oss-20b", 16384, 2880, 2880, 32, 4),)


def gpt_oss_bench_cases() -> list[BenchCase]:
    return _experts_bench_cases("gpt_oss_experts", GPT_OSS_BENCH_SHAPES, _gpt_oss_inputs, gpt_oss_experts,
                                gpt_oss_experts_reference, _hf_grouped_mm_gpt_oss)


GPT_OSS_EXPERTS_SPEC = OpSpec(
    name="gpt_oss_experts",
    fn=gpt_oss_experts,
    reference=gpt_oss_experts_reference,
    test_cases=gpt_oss_test_cases,
    bench_cases=gpt_oss_bench_cases,
    compare="norm",
)
