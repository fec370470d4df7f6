"""Cases of `attention`: fp32, bf16 and fp16 with causal masks, windows, GQA/MQA, S_q != S_k,
transposed inputs, packed variable-length batches, softcapped logits and sinks for the tests; bf16 Llama-shaped heads
(causal and full, forward and forward+backward) and a packed batch of 8 causal sequences for the
benchmark, against SDPA's flash and cuDNN backends (the packed batch against SDPA on it padded).
Cases of `decode_attention`: ragged batches, query tokens, windows, every dtype; for the
benchmark one query token of Llama-3-8B-shaped heads against caches of 2k to 32k keys at batch 1
to 64, against SDPA over the same cache."""

from __future__ import annotations

import math
import types

import torch

from .. import runtime
from ..ops.attention import attention, attention_reference
from ..ops.decode_attention import decode_attention, decode_attention_reference
from ..spec import Bench, BenchCase, OpSpec, TestCase
from . import peers


def test_cases() -> list[TestCase]:
    def extras(H, softcap, sinks, device, dtype):
        """attention's softcap and sinks arguments (sinks drawn per head, with a gradient)."""
        return dict(softcap=softcap, sinks=torch.randn(H, device=device).to(dtype).requires_grad_(True) if sinks
                    else None)

    def case(id, dtype, B=1, H=2, H_kv=None, S_q=17, S_k=None, D=32, causal=False, window=None,
             return_lse=False, transposed=False, softcap=None, sinks=False, gpu_only=False, **kw):
        H_kv = H if H_kv is None else H_kv
        S_k = S_q if S_k is None else S_k

        def make(device):
            def draw(heads, seq):
                if transposed:  # (B, S, H, D) memory seen as (B, H, S, D)
                    return torch.randn(B, seq, heads, D, device=device).to(dtype).transpose(1, 2)
                return torch.randn(B, heads, seq, D, device=device).to(dtype)

            q, k, v = draw(H, S_q), draw(H_kv, S_k), draw(H_kv, S_k)
            return (q.requires_grad_(True), k.requires_grad_(True), v.requires_grad_(True)), dict(
                causal=causal, window=window, return_lse=return_lse, **extras(H, softcap, sinks, device, dtype))

        return TestCase(id, make, dtype, gpu_only=gpu_only, **kw)

    def varlen(id, dtype, lens_q, lens_k, H=2, H_kv=None, D=32, causal=False, window=None, return_lse=False,
               softcap=None, sinks=False, gpu_only=False, **kw):
        """A packed batch: q (sum(lens_q), H, D), k and v (sum(lens_k), H_kv, D)."""
        H_kv = H if H_kv is None else H_kv

        def make(device):
            def cu(lens):
                return torch.tensor([0, *lens], device=device).cumsum(0).to(torch.int32)

            q = torch.randn(sum(lens_q), H, D, device=device).to(dtype)
            k, v = (torch.randn(sum(lens_k), H_kv, D, device=device).to(dtype) for _ in range(2))
            return (q.requires_grad_(True), k.requires_grad_(True), v.requires_grad_(True)), dict(
                causal=causal, window=window, return_lse=return_lse, cu_seqlens_q=cu(lens_q),
                cu_seqlens_k=cu(lens_k), max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k),
                **extras(H, softcap, sinks, device, dtype))

        return TestCase(id, make, dtype, gpu_only=gpu_only, **kw)

    bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32
    cases = [
        case("fp32-s1", fp32, S_q=1),
        case("fp32-s17-lse", fp32, return_lse=True),
        case("fp32-s40-causal-lse", fp32, S_q=40, causal=True, return_lse=True),
        case("fp32-sq17-sk40-causal", fp32, S_q=17, S_k=40, causal=True),
        case("fp32-gqa-window", fp32, H=4, H_kv=2, S_q=40, window=9),
        case("fp32-d96-transposed", fp32, S_q=17, S_k=23, D=96, transposed=True),
        case("bf16-s17", bf16),
        case("bf16-s40-causal-d64", bf16, S_q=40, causal=True, D=64),
        case("bf16-gqa-causal-window", bf16, H=4, H_kv=2, S_q=40, causal=True, window=12),
        case("bf16-mqa-sq1-sk40", bf16, H=4, H_kv=1, S_q=1, S_k=40),
        case("fp16-s40-sk17", fp16, S_q=40, S_k=17),
        case("fp16-mqa-causal-d64", fp16, B=2, H=4, H_kv=1, S_q=17, S_k=33, causal=True, D=64),
        # Gemma 2's softcapped logits (caps near the logits' spread, so that the cap bites) and GPT-OSS's sinks.
        case("fp32-softcap-causal-lse", fp32, S_q=40, causal=True, return_lse=True, softcap=2.0),
        case("bf16-softcap-gqa-window", bf16, H=4, H_kv=2, S_q=40, causal=True, window=12, softcap=1.5),
        case("fp32-sinks-gqa-causal-lse", fp32, B=2, H=4, H_kv=2, S_q=21, S_k=6, causal=True, return_lse=True,
             sinks=True),
        case("bf16-sinks-window", bf16, H=4, H_kv=1, S_q=40, causal=True, window=9, sinks=True),
        case("fp16-softcap-sinks-sq17-sk33", fp16, S_q=17, S_k=33, causal=True, D=64, softcap=3.0, sinks=True),
        case("bf16-s1000-causal-d128", bf16, S_q=1000, causal=True, D=128, gpu_only=True),
        case("bf16-s4097-d128", bf16, S_q=4097, D=128, gpu_only=True),
        case("bf16-s4097-causal-d128-gqa", bf16, H=4, H_kv=2, S_q=4097, causal=True, D=128, gpu_only=True),
        case("bf16-s1000-d256-window", bf16, S_q=1000, D=256, causal=True, window=256, gpu_only=True),
        case("fp16-s1000-d96-sk777", fp16, S_q=1000, S_k=777, D=96, causal=True, gpu_only=True),
        # Packed batches: lengths 0 and 1, S_q != S_k per sequence, rows with no key (causal).
        varlen("varlen-fp32-lse", fp32, [5, 1, 0, 23], [9, 1, 4, 30], return_lse=True),
        varlen("varlen-fp32-causal", fp32, [17, 1, 0, 9, 20], [30, 1, 3, 0, 6], causal=True),
        varlen("varlen-bf16-gqa-causal-window", bf16, [33, 1, 0, 12], [40, 1, 5, 12], H=4, H_kv=2, causal=True,
               window=7),
        varlen("varlen-fp16-mqa-window-d64", fp16, [7, 19], [19, 7], H=4, H_kv=1, D=64, window=3),
        varlen("varlen-fp32-softcap-sinks-lse", fp32, [5, 0, 23], [9, 4, 30], causal=True, return_lse=True,
               softcap=2.5, sinks=True),
        case("bf16-s2000-softcap-sinks-d128", bf16, H=4, H_kv=2, S_q=2000, causal=True, D=128, softcap=2.0,
             sinks=True, gpu_only=True),
        case("bf16-s1000-softcap-d256-window", bf16, S_q=1000, D=256, causal=True, window=256, softcap=50.0,
             gpu_only=True),
        varlen("varlen-bf16-causal-d128-gqa", bf16, [1, 700, 64, 1500, 0, 1, 1000, 830],
               [1, 700, 90, 1500, 3, 1, 1000, 900], H=8, H_kv=2, D=128, causal=True, gpu_only=True),
    ]
    return cases


def _attention_flops(B, H, S, D, causal):
    flops = 4 * B * H * S * S * D
    return flops // 2 if causal else flops


def bench_cases() -> list[BenchCase]:
    grid = [  # B, H, S, D, causal, quick
        (4, 32, 4096, 128, True, False),
        (4, 32, 4096, 128, False, False),
        (8, 16, 2048, 64, True, False),
        (1, 32, 16384, 128, True, False),
        (1, 2, 64, 32, True, True),
    ]
    cases = []
    dtype = torch.bfloat16
    for B, H, S, D, causal, quick in grid:
        for mode in ("fwd", "fwd+bwd"):
            def setup(B=B, H=H, S=S, D=D, causal=causal, mode=mode):
                device = runtime.DEVICE
                grad = mode != "fwd"
                q, k, v = (torch.randn(B, H, S, D, device=device, dtype=dtype, requires_grad=grad) for _ in range(3))
                do = torch.randn(B, H, S, D, device=device, dtype=dtype)
                sdpa = torch.nn.functional.scaled_dot_product_attention

                def backend(name):
                    if runtime.INTERPRET:
                        return None
                    kernel = getattr(torch.nn.attention.SDPBackend, name)

                    def run():
                        with torch.nn.attention.sdpa_kernel(kernel):
                            return sdpa(q, k, v, is_causal=causal)
                    return run

                providers = {"tritonformer": lambda: attention(q, k, v, causal=causal)}
                if quick and runtime.INTERPRET:
                    providers["torch"] = lambda: attention_reference(q, k, v, causal=causal)
                providers["sdpa-flash"] = backend("FLASH_ATTENTION")
                providers["sdpa-cudnn"] = backend("CUDNN_ATTENTION")
                # The float32 reference materializes B*H*S*S scores: moderate sizes only.
                small = B * H * S * S <= 2**28

                def ref_fwd():
                    return attention_reference(q.float(), k.float(), v.float(), causal=causal)

                if mode == "fwd":
                    return Bench(peers.available(providers), reference=ref_fwd if small else None)

                def fwd_bwd(fn):
                    return None if fn is None else lambda: torch.autograd.grad(fn(), (q, k, v), do)

                def ref_bwd():
                    leaves = [t.detach().float().requires_grad_(True) for t in (q, k, v)]
                    return torch.autograd.grad(attention_reference(*leaves, causal=causal), leaves, do.float())

                return Bench(peers.available({n: fwd_bwd(f) for n, f in providers.items()}),
                             reference=ref_bwd if small else None)

            flops = _attention_flops(B, H, S, D, causal)
            flops = flops if mode == "fwd" else int(flops * 3.5)
            title = "forward" if mode == "fwd" else "forward+backward"
            cases.append(BenchCase(
                "attention", mode, dtype, f"B{B}xH{H}xS{S}xD{D}{'-causal' if causal else ''}", S, setup,
                flops=flops, plot=f"{title} {'causal' if causal else 'full'} bf16", quick=quick, compare="norm"))
    return cases + _varlen_bench_cases() + _softcap_sinks_bench_cases()


def _softcap_sinks_bench_cases() -> list[BenchCase]:
    """Gemma-2-9B's attention (16/8 heads of 256, softcap 50) and GPT-OSS-20b's (64/8 heads of 64,
    sinks), causal at 4096: ours with the option, ours without it (the option's cost), and HF's
    eager function of the family (what HF runs for it; SDPA takes neither), given HF's additive
    causal mask and a module with the attributes it reads."""
    dtype, cases = torch.bfloat16, []
    grid = [  # family, B, H, H_kv, S, D, quick
        ("gemma2", 2, 16, 8, 4096, 256, False), ("gpt_oss", 4, 64, 8, 4096, 64, False),
        ("gemma2", 1, 2, 1, 64, 32, True), ("gpt_oss", 1, 4, 2, 64, 32, True)]
    for family, B, H, H_kv, S, D, quick in grid:
        for mode in ("fwd", "fwd+bwd"):
            def setup(family=family, B=B, H=H, H_kv=H_kv, S=S, D=D, mode=mode):
                device, grad = runtime.DEVICE, mode != "fwd"
                q = torch.randn(B, H, S, D, device=device, dtype=dtype, requires_grad=grad)
                k, v = (torch.randn(B, H_kv, S, D, device=device, dtype=dtype, requires_grad=grad) for _ in range(2))
                sinks = torch.randn(H, device=device, dtype=dtype, requires_grad=grad) if family == "gpt_oss" else None
                option = dict(softcap=50.0) if family == "gemma2" else dict(sinks=sinks)
                leaves = (q, k, v) if sinks is None else (q, k, v, sinks)
                eager = peers.hf_eager_attention(family)
                module = types.SimpleNamespace(num_key_value_groups=H // H_kv, head_dim=D, training=False, sinks=sinks)
                mask = torch.full((S, S), -math.inf, device=device, dtype=dtype).triu(1)[None, None]
                providers = {
                    "tritonformer": lambda: attention(q, k, v, causal=True, **option),
                    "tritonformer-plain": lambda: attention(q, k, v, causal=True),
                    "hf-eager": None if eager is None else lambda: eager(module, q, k, v, mask, scaling=D**-0.5,
                                                                           **option if family == "gemma2" else {})[0]
                    .transpose(1, 2),
                }
                small = B * H * S * S <= 2**28
                doubled = [t.detach().double().requires_grad_(grad) for t in leaves]
                ref_option = dict(softcap=50.0) if family == "gemma2" else dict(sinks=doubled[3])

                def reference():
                    out = attention_reference(*doubled[:3], causal=True, **ref_option)
                    return torch.autograd.grad(out, doubled, do.double()) if grad else out

                if not grad:
                    return Bench(peers.available(providers), reference=reference if small else None)
                do = torch.randn_like(q)
                # The plain kernel gives no sinks gradient: each provider differentiates what it has.
                fwd_bwd = {name: None if fn is None else
                           (lambda fn=fn, ins=(q, k, v) if name == "tritonformer-plain" else leaves:
                            torch.autograd.grad(fn(), ins, do)) for name, fn in providers.items()}
                return Bench(peers.available(fwd_bwd), reference=reference if small else None)

            flops = _attention_flops(B, H, S, D, True)
            flops = flops if mode == "fwd" else int(flops * 3.5)
            title = "forward" if mode == "fwd" else "forward+backward"
            label = "softcap 50" if family == "gemma2" else "sinks"
            cases.append(BenchCase("attention", mode, dtype, f"B{B}xH{H}/{H_kv}xS{S}xD{D}-causal-{label}", S, setup,
                                   flops=flops, plot=f"{title} causal bf16, {label}", quick=quick, compare="norm"))
    return cases


def _varlen_bench_cases() -> list[BenchCase]:
    """A packed batch of 8 causal sequences (16384 tokens) against SDPA on the same batch padded
    to its longest sequence (what a caller without varlen does). FLOPs count the packed work."""
    lens, H, D, dtype = [4096, 512, 3000, 1, 2048, 1500, 4000, 1227], 32, 128, torch.bfloat16
    cases = []
    for mode in ("fwd", "fwd+bwd"):
        def setup(mode=mode):
            device, grad, total, longest = runtime.DEVICE, mode != "fwd", sum(lens), max(lens)
            cu = torch.tensor([0, *lens], device=device).cumsum(0).to(torch.int32)
            q, k, v = (torch.randn(total, H, D, device=device, dtype=dtype, requires_grad=grad) for _ in range(3))
            do = torch.randn(total, H, D, device=device, dtype=dtype)
            kw = dict(causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=longest, max_seqlen_k=longest)
            padded = [torch.randn(len(lens), H, longest, D, device=device, dtype=dtype, requires_grad=grad)
                      for _ in range(3)]
            do_padded = torch.randn(len(lens), H, longest, D, device=device, dtype=dtype)
            sdpa = torch.nn.functional.scaled_dot_product_attention
            providers = {"tritonformer": lambda: attention(q, k, v, **kw)}
            if not runtime.INTERPRET:
                def run_sdpa():
                    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
                        return sdpa(*padded, is_causal=True)
                providers["sdpa-flash-padded"] = run_sdpa
            if mode == "fwd":
                def ref():
                    return attention_reference(q.float(), k.float(), v.float(), **kw)
                return Bench(providers, reference=ref)
            return Bench({"tritonformer": lambda: torch.autograd.grad(providers["tritonformer"](), (q, k, v), do),
                          **({} if runtime.INTERPRET else {"sdpa-flash-padded": lambda: torch.autograd.grad(
                              providers["sdpa-flash-padded"](), padded, do_padded)})})

        flops = sum(_attention_flops(1, H, n, D, True) for n in lens)
        flops = flops if mode == "fwd" else int(flops * 3.5)
        title = "forward" if mode == "fwd" else "forward+backward"
        cases.append(BenchCase("attention", mode, dtype, f"varlen8x{sum(lens)}xH{H}xD{D}-causal", sum(lens), setup,
                               flops=flops, plot=f"{title} varlen causal bf16", compare="norm"))
    return cases


SPEC = OpSpec(
    name="attention",
    fn=attention,
    reference=attention_reference,
    test_cases=test_cases,
    bench_cases=bench_cases,
    compare="norm",
)


def decode_test_cases() -> list[TestCase]:
    def case(id, dtype, B=2, H=4, H_kv=2, S_q=1, S_max=40, D=32, lens=None, window=None, splits=2, gpu_only=False):
        def make(device):
            q = torch.randn(B, H, S_q, D, device=device).to(dtype)
            k, v = (torch.randn(B, H_kv, S_max, D, device=device).to(dtype) for _ in range(2))
            seq_lens = None if lens is None else torch.tensor(lens, dtype=torch.int32, device=device)
            return (q, k, v, seq_lens), dict(window=window, **({} if splits is None else {"num_splits": splits}))

        return TestCase(id, make, dtype, grad=False, gpu_only=gpu_only)

    bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32
    return [
        case("fp32-ragged", fp32, lens=[40, 9]),
        case("fp32-sq4-window", fp32, S_q=4, H=8, H_kv=2, lens=[33, 40], window=7),
        case("fp32-one-split", fp32, splits=1),
        case("bf16-ragged-d64", bf16, D=64, lens=[3, 40]),
        case("fp16-sq16-mqa", fp16, S_q=16, H=4, H_kv=1, lens=[40, 20]),
        case("bf16-8k-d128", bf16, B=4, H=32, H_kv=8, S_max=8192, D=128, lens=[8192, 4000, 1, 100], splits=None,
             gpu_only=True),
    ]


def _decode_reference(q, k, v, seq_lens=None, window=None, num_splits=None):
    return decode_attention_reference(q, k, v, seq_lens, window=window)


def decode_bench_cases() -> list[BenchCase]:
    """One new token a sequence against a full cache (Llama-3-8B's 32/8 heads of 128, bf16):
    the bytes are the cache's K and V, read once."""
    H, H_kv, D, dtype = 32, 8, 128, torch.bfloat16
    grid = [(1, 2048), (1, 8192), (1, 32768), (16, 4096), (64, 2048)]
    cases = []
    for B, S in ([(1, 256)] if runtime.INTERPRET else grid):
        heads, kv_heads = (8, 2) if runtime.INTERPRET else (H, H_kv)

        def setup(B=B, S=S, heads=heads, kv_heads=kv_heads):
            device = runtime.DEVICE
            q = torch.randn(B, heads, 1, D, device=device, dtype=dtype)
            k, v = (torch.randn(B, kv_heads, S, D, device=device, dtype=dtype) for _ in range(2))
            sdpa = torch.nn.functional.scaled_dot_product_attention
            return Bench({"tritonformer": lambda: decode_attention(q, k, v),
                          "sdpa": lambda: sdpa(q, k, v, enable_gqa=True)},
                         reference=lambda: decode_attention_reference(q, k, v).to(dtype))

        cache_bytes = 2 * B * kv_heads * S * D * dtype.itemsize
        cases.append(BenchCase("decode_attention", "fwd", dtype, f"B{B}xS{S}xH{heads}/{kv_heads}xD{D}", B * S, setup,
                               bytes=cache_bytes + 2 * B * heads * D * dtype.itemsize, plot="decode bf16",
                               quick=runtime.INTERPRET or (B, S) == grid[0]))
    return cases


DECODE_SPEC = OpSpec(
    name="decode_attention",
    fn=decode_attention,
    reference=_decode_reference,
    test_cases=decode_test_cases,
    bench_cases=decode_bench_cases,
    compare="norm",
)
