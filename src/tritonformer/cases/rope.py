"""Cases of `apply_rope` and `qkv_rope`: both layouts, GQA, per-batch, mixed-dtype and strided
tables, non-contiguous q and k in every float dtype for the tests; Llama-shaped q and k (bf16, and
fp32) forward and forward+backward for the benchmark, and the attention's input projections with
the rotation, against torch, torch.compile and Liger. Cases of `rope_into_cache` (a decode step's
rope and cache writes): ragged positions, positions past the cache, strided inputs; Llama-3-8B's
heads at batch 1 to 64 for the benchmark, against torch's rope and index writes, compiled too."""

from __future__ import annotations

import functools

import torch

from .. import runtime
from ..ops.rope import (apply_rope, apply_rope_reference, qkv_rope, qkv_rope_reference, rope_into_cache,
                        rope_into_cache_reference)
from ..spec import Bench, BenchCase, OpSpec, TestCase, short_dtype
from . import peers


def random_heads(shape_bhsd, layout, dtype, device, view=None):
    """A (B, H, S, D) tensor in `layout` order of random values; `view` makes it non-contiguous:
    "transposed" stores it in the other layout's order, "sliced" takes it from a wider last dim,
    "strided" gives the head dimension a stride of 2."""
    B, H, S, D = shape_bhsd
    shape = (B, H, S, D) if layout == "bhsd" else (B, S, H, D)
    if view == "transposed":
        return torch.randn(shape[0], shape[2], shape[1], D, device=device).to(dtype).transpose(1, 2)
    if view == "sliced":
        return torch.randn(*shape[:3], D + 6, device=device).to(dtype)[..., 3:D + 3]
    if view == "strided":
        return torch.randn(*shape[:3], 2 * D, device=device).to(dtype)[..., ::2]
    return torch.randn(shape, device=device).to(dtype)


def _table(shape, dtype, device, transposed=False):
    """Random cos/sin-like values in [-1, 1] whose two halves differ (no cat(freqs, freqs))."""
    if transposed:
        return (torch.rand(shape[::-1], device=device) * 2 - 1).to(dtype).mT
    return (torch.rand(shape, device=device) * 2 - 1).to(dtype)


def rope_test_cases() -> list[TestCase]:
    def case(id, dtype, B, Hq, Hk, S, D, layout="bhsd", table="shared", table_dtype=None,
             q_view=None, k_view=None, gpu_only=False):
        def make(device):
            q = random_heads((B, Hq, S, D), layout, dtype, device, q_view).requires_grad_(True)
            k = random_heads((B, Hk, S, D), layout, dtype, device, k_view).requires_grad_(True)
            tdtype = table_dtype or dtype
            if table == "shared":
                cos, sin = _table((S, D), tdtype, device), _table((S, D), tdtype, device)
            elif table == "one":
                cos, sin = _table((1, S, D), tdtype, device), _table((1, S, D), tdtype, device)
            elif table == "batch":
                cos, sin = _table((B, S, D), tdtype, device), _table((B, S, D), tdtype, device)
            else:  # "mixed": a transposed float32 cos, an expanded bfloat16 sin
                cos = _table((S, D), torch.float32, device, transposed=True)
                sin = _table((1, S, D), torch.bfloat16, device).expand(B, S, D)
            return (q, k, cos, sin), {"layout": layout}
        return TestCase(id, make, dtype, gpu_only=gpu_only)

    cases = []
    for dt in runtime.FLOAT_DTYPES:
        name = short_dtype(dt)
        cases += [
            case(f"{name}-bhsd-gqa", dt, 2, 4, 2, 13, 32),
            case(f"{name}-bshd-batch-table", dt, 2, 3, 1, 9, 16, layout="bshd", table="batch"),
            case(f"{name}-bhsd-2x32/8x1024x128", dt, 2, 32, 8, 1024, 128, table="one", gpu_only=True),
            case(f"{name}-bshd-2x32/8x1024x128", dt, 2, 32, 8, 1024, 128, layout="bshd", table="batch",
                 gpu_only=True),
        ]
    cases += [
        # Several position blocks (the last one partial), two chunks of q heads of two steps
        # each, a k chunk with a masked half step.
        case("fp32-blocks-and-chunks", torch.float32, 2, 12, 2, 20, 64, table="one"),
        case("bf16-views-bhsd", torch.bfloat16, 2, 4, 2, 11, 32, q_view="transposed", k_view="sliced",
             table="mixed"),
        case("fp16-strided-bshd", torch.float16, 2, 3, 2, 7, 16, layout="bshd", q_view="strided",
             k_view="transposed", table="batch", table_dtype=torch.float32),
        # D/2 = 12 is not a power of two; Hq is not a multiple of Hk.
        case("fp16-d24-h5/3", torch.float16, 1, 5, 3, 6, 24),
        case("fp32-d2", torch.float32, 2, 2, 1, 3, 2, layout="bshd"),
        case("fp32-empty-seq", torch.float32, 2, 3, 1, 0, 8),
        case("bf16-bshd-2x28/4x4096x128-views", torch.bfloat16, 2, 28, 4, 4096, 128, layout="bshd",
             q_view="sliced", k_view="transposed", table="mixed", gpu_only=True),
    ]
    return cases


def _bench_table(S, D, dtype):
    """HF's default rotary table for positions 0..S-1: (1, S, D) cos and sin."""
    inv_freq = 1.0 / 10000 ** (torch.arange(0, D, 2, device=runtime.DEVICE, dtype=torch.float32) / D)
    freqs = torch.arange(S, device=runtime.DEVICE, dtype=torch.float32)[:, None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)[None]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _bench_setup(B, Hq, Hk, S, D, layout, dtype, backward):
    q = random_heads((B, Hq, S, D), layout, dtype, runtime.DEVICE).requires_grad_(backward)
    k = random_heads((B, Hk, S, D), layout, dtype, runtime.DEVICE).requires_grad_(backward)
    cos, sin = _bench_table(S, D, dtype)
    lg = peers.liger()
    # Liger takes (B, H, S, D) views and writes in place when their memory is (B, S, H, D).
    to_liger = (lambda t: t.transpose(1, 2)) if layout == "bshd" else (lambda t: t)
    forwards = {
        "tritonformer": lambda: apply_rope(q, k, cos, sin, layout),
        "torch": lambda: apply_rope_reference(q, k, cos, sin, layout),
        "torch.compile": peers.compiled(apply_rope_reference, q, k, cos, sin, layout),
        "liger": (lambda: lg.LigerRopeFunction.apply(to_liger(q), to_liger(k), cos, sin, None, 1)) if lg else None,
    }
    q64, k64, cos64, sin64 = (t.detach().double().requires_grad_(t.requires_grad) for t in (q, k, cos, sin))
    if not backward:
        return Bench(providers=peers.available(forwards),
                     reference=lambda: apply_rope_reference(q64, k64, cos64, sin64, layout))

    dq, dk = torch.randn_like(q), torch.randn_like(k)

    def fwd_bwd(forward, grads=(dq, dk)):
        return None if forward is None else lambda: torch.autograd.grad(forward(), (q, k), grads)

    providers = {name: fwd_bwd(fn) for name, fn in forwards.items() if name != "liger"}
    providers["liger"] = fwd_bwd(forwards["liger"], (to_liger(dq), to_liger(dk)))
    return Bench(
        providers=peers.available(providers),
        reference=lambda: torch.autograd.grad(apply_rope_reference(q64, k64, cos64, sin64, layout), (q64, k64),
                                              (dq.double(), dk.double())),
    )


def rope_bench_cases() -> list[BenchCase]:
    cases = []
    grid = [  # B, Hq, Hk, S, D, layout, dtype
        (1, 4, 2, 64, 32, "bhsd", torch.bfloat16),
        (4, 32, 8, 4096, 128, "bhsd", torch.bfloat16),
        (1, 32, 8, 8192, 128, "bhsd", torch.bfloat16),
        (4, 32, 8, 4096, 128, "bshd", torch.bfloat16),
        (4, 32, 8, 4096, 128, "bhsd", torch.float32),
    ]
    for B, Hq, Hk, S, D, layout, dtype in grid:
        size = B * (Hq + Hk) * S * D * dtype.itemsize
        table = 2 * S * D * dtype.itemsize
        for mode, passes, title in (("fwd", 1, "forward"), ("fwd+bwd", 2, "forward+backward")):
            setup = functools.partial(_bench_setup, B, Hq, Hk, S, D, layout, dtype, mode == "fwd+bwd")
            cases.append(BenchCase("rope", mode, dtype, f"{B}x{Hq}/{Hk}x{S}x{D} {layout}", B * S, setup,
                                   bytes=passes * (2 * size + table), plot=f"{title} {short_dtype(dtype)} {layout}",
                                   quick=S == 64))
    return cases


def qkv_rope_test_cases() -> list[TestCase]:
    def case(id, dtype, B, S, hidden, Hq, Hk, D, bias=False, table=(1,), x_view=False, gpu_only=False):
        def make(device):
            x = torch.randn(B, S, hidden, device=device)
            if x_view:  # (B, S, hidden) read through a transposed view of (S, B, hidden) memory
                x = torch.randn(S, B, hidden, device=device).transpose(0, 1)
            x = x.to(dtype).requires_grad_(True)
            ws = [(torch.randn(h * D, hidden, device=device) / hidden**0.5).to(dtype).requires_grad_(True)
                  for h in (Hq, Hk, Hk)]
            bs = [torch.randn(h * D, device=device).to(dtype).requires_grad_(True) if bias else None
                  for h in (Hq, Hk, Hk)]
            cos, sin = (_table((*table, S, D) if table else (S, D), dtype, device) for _ in range(2))
            return (x, *ws, cos, sin, *bs), {}
        return TestCase(id, make, dtype, gpu_only=gpu_only)

    cases = [case(f"{short_dtype(dt)}-2x7x40-4/2x8", dt, 2, 7, 40, 4, 2, 8) for dt in runtime.FLOAT_DTYPES]
    cases += [
        case("fp32-bias-batch-table-x-view", torch.float32, 3, 5, 24, 3, 1, 16, bias=True, table=(3,), x_view=True),
        case("bf16-shared-table-mha", torch.bfloat16, 1, 9, 32, 2, 2, 16, table=()),
        # bf16 with biases: their gradient is the column sums of the rounded joint gradient.
        case("bf16-bias-2x70x48-3/1x16", torch.bfloat16, 2, 70, 48, 3, 1, 16, bias=True),
        case("bf16-bias-4x2048x896-14/2x64", torch.bfloat16, 4, 2048, 896, 14, 2, 64, bias=True, gpu_only=True),
        case("bf16-2x1024x2048-16/4x128", torch.bfloat16, 2, 1024, 2048, 16, 4, 128, gpu_only=True),
    ]
    return cases


def qkv_rope_bench_cases() -> list[BenchCase]:
    cases = []
    for B, S, hidden, Hq, Hk, D in [(4, 2048, 2048, 16, 4, 128), (2, 4096, 4096, 32, 8, 128), (1, 64, 256, 4, 2, 32)]:
        dtype = torch.bfloat16

        def setup(B=B, S=S, hidden=hidden, Hq=Hq, Hk=Hk, D=D, dtype=dtype):
            device = runtime.DEVICE
            x = torch.randn(B, S, hidden, device=device, dtype=dtype, requires_grad=True)
            ws = [(torch.randn(h * D, hidden, device=device) / hidden**0.5).to(dtype).requires_grad_(True)
                  for h in (Hq, Hk, Hk)]
            cos, sin = _bench_table(S, D, dtype)
            douts = [torch.randn(B, h, S, D, device=device, dtype=dtype) for h in (Hq, Hk, Hk)]
            inputs = (x, *ws)
            lg = peers.liger()

            def liger_qkv():
                q, k, v = (torch.nn.functional.linear(x, w).view(B, S, -1, D).transpose(1, 2) for w in ws)
                return (*lg.LigerRopeFunction.apply(q, k, cos, sin, None, 1), v)

            def fwd_bwd(fn):
                return None if fn is None else lambda: torch.autograd.grad(fn(), inputs, douts)

            def reference():
                leaves = [t.detach().float().requires_grad_(True) for t in inputs]
                out = qkv_rope_reference(*leaves, cos.float(), sin.float())
                return torch.autograd.grad(out, leaves, [d.float() for d in douts])

            return Bench(peers.available({
                "tritonformer": fwd_bwd(lambda: qkv_rope(*inputs, cos, sin)),
                "torch": fwd_bwd(lambda: qkv_rope_reference(*inputs, cos, sin)),
                "torch.compile": fwd_bwd(peers.compiled(qkv_rope_reference, *inputs, cos, sin)),
                "liger": fwd_bwd(liger_qkv if lg else None),
            }), reference=reference)

        tokens = B * S
        cases.append(BenchCase("qkv_rope", "fwd+bwd", dtype, f"{B}x{S}x{hidden} {Hq}/{Hk}x{D}", tokens, setup,
                               flops=3 * 2 * tokens * hidden * (Hq + 2 * Hk) * D,
                               plot=f"forward+backward {short_dtype(dtype)}", quick=S == 64))
    return cases


def rope_into_cache_outputs(q, k, v, cos, sin, positions, k_cache, v_cache, by_position=False):
    """rope_into_cache's three results, for the registry: q rotated and the two caches it wrote."""
    return rope_into_cache(q, k, v, cos, sin, positions, k_cache, v_cache, by_position), k_cache, v_cache


def _decode_step_inputs(B, H, H_kv, S_max, D, dtype, device, positions, strided=False, table_rows=None):
    """(q, k, v, cos, sin, positions, k_cache, v_cache) of one decode step; strided: q, k and v
    as views of one (B, H + 2 H_kv, D) projection, as a fused qkv product hands them over;
    table_rows: cos and sin as (table_rows, D) tables of every position (by_position)."""
    if strided:
        qkv = torch.randn(B, H + 2 * H_kv, D, device=device).to(dtype)
        q, k, v = qkv.split([H, H_kv, H_kv], dim=1)
    else:
        q, k, v = (torch.randn(B, n, D, device=device).to(dtype) for n in (H, H_kv, H_kv))
    cos, sin = (_table((B, 1, D) if table_rows is None else (table_rows, D), dtype, device) for _ in range(2))
    caches = [torch.randn(B, H_kv, S_max, D, device=device).to(dtype) for _ in range(2)]
    return q, k, v, cos, sin, torch.tensor(positions, device=device), *caches


def rope_into_cache_test_cases() -> list[TestCase]:
    def case(id, dtype, B, H, H_kv, S_max, D, positions, strided=False, gpu_only=False, table_rows=None):
        return TestCase(id, lambda device: (_decode_step_inputs(B, H, H_kv, S_max, D, dtype, device, positions,
                                                                strided, table_rows),
                                            {} if table_rows is None else {"by_position": True}),
                        dtype, gpu_only=gpu_only)

    return [
        case("fp32-ragged", torch.float32, 3, 4, 2, 9, 32, [0, 8, 3]),
        case("bf16-past-the-cache", torch.bfloat16, 3, 6, 2, 7, 64, [7, -1, 2]),
        case("fp16-fused-qkv-view", torch.float16, 2, 8, 1, 5, 80, [4, 0], strided=True),
        # Tables of every position: one past the table (clamped to its last row, not in the cache), one outside.
        case("bf16-tables-by-position", torch.bfloat16, 4, 4, 2, 11, 64, [10, 3, 12, -2], table_rows=12),
        case("fp32-tables-by-position-view", torch.float32, 2, 6, 3, 6, 32, [5, 0], strided=True, table_rows=6),
        case("bf16-64x32/8x4096x128", torch.bfloat16, 64, 32, 8, 4096, 128, list(range(0, 4096, 64)),
             gpu_only=True),
    ]


def rope_into_cache_bench_cases() -> list[BenchCase]:
    cases = []
    for B, S_max in ((1, 64), (1, 4096), (16, 4096), (64, 4096)):
        H, H_kv, D, dtype = (4, 2, 32, torch.bfloat16) if S_max == 64 else (32, 8, 128, torch.bfloat16)

        def setup(B=B, H=H, H_kv=H_kv, S_max=S_max, D=D, dtype=dtype):
            args = _decode_step_inputs(B, H, H_kv, S_max, D, dtype, runtime.DEVICE,
                                       [(b * 37) % S_max for b in range(B)])
            leaves = [t.double() if t.is_floating_point() else t for t in args]
            return Bench(peers.available({
                "tritonformer": lambda: rope_into_cache(*args),
                "torch": lambda: rope_into_cache_reference(*args),
                "torch.compile": peers.compiled(rope_into_cache_reference, *args),
            }), reference=lambda: rope_into_cache_reference(*leaves)[0])

        # q read and written, k and v read, their cache rows written, the tables read.
        moved = (2 * B * H * D + 4 * B * H_kv * D + 2 * B * D) * dtype.itemsize
        cases.append(BenchCase("rope_into_cache", "fwd", dtype, f"B{B} {H}/{H_kv}x{D} cache {S_max}", B, setup,
                               bytes=moved, plot=f"decode step {short_dtype(dtype)}", quick=S_max == 64))
    return cases


SPEC = OpSpec(
    name="rope",
    fn=apply_rope,
    reference=apply_rope_reference,
    test_cases=rope_test_cases,
    bench_cases=rope_bench_cases,
    compare="elementwise",
)

QKV_SPEC = OpSpec(name="qkv_rope", fn=qkv_rope, reference=qkv_rope_reference, test_cases=qkv_rope_test_cases,
                  bench_cases=qkv_rope_bench_cases, compare="norm")

INTO_CACHE_SPEC = OpSpec(name="rope_into_cache", fn=rope_into_cache_outputs, reference=rope_into_cache_reference,
                         test_cases=rope_into_cache_test_cases, bench_cases=rope_into_cache_bench_cases)
