"""LayerNorm forward + backward at the bench's wide shapes, every backward variant and launch
choice of ops/norm.py against torch.compile(F.layer_norm), in one table (on the GPU machine):

    PYTHONPATH=src python3 scripts/probe_layer_norm.py [--quick]

Shapes 4096x16384 and 16384x8192, bf16, weight and bias. Each row: triton.testing.do_bench
median of forward + backward (torch.autograd.grad of the output with a fixed dy, L2 flushed
between calls, as the bench times it), GB/s counted as the bench counts them (five passes of
M x N x 2 bytes: x read twice, y written, dy read, dx written), the ratio to torch.compile on
the same tensors, the backward alone (norm_bwd: every launch of the backward), back-to-back
forward + backward without the flush (a call's share of 50 calls: near the do_bench figure when
the GPU decides, above it when the host does), and the largest norm-wise error of dx, dw, db
against float64. Variants: "looped" (the one-kernel backward), "split" (two kernels: row means,
then column blocks of row groups) with the module's launch settings and one setting changed at
a time, and at 8192 columns the in-register kernel (the default there) against split. All
kernels compile side by side first (the compile pool), then torch.compile compiles its peers.
"""

from __future__ import annotations

import argparse
import contextlib
import time

import tritonformer  # noqa: F401  (before triton)
from tritonformer import runtime
from tritonformer.ops import norm
from tritonformer.testing import rel_err

import torch  # noqa: E402
import triton  # noqa: E402

SHAPES = [(4096, 16384), (16384, 8192)]
EPS = 1e-5


def variants(N: int, quick: bool) -> list[tuple[str, dict]]:
    """(label, settings): settings name wide ("looped", "split" or "registers") and split's
    changes to LAYER_NORM_SPLIT."""
    base = [("split (module settings)", dict(wide="split"))]
    if N > norm.LAYER_NORM_BWD_MAX_N:
        base.insert(0, ("looped (one kernel)", dict(wide="looped")))
    else:
        base.insert(0, ("in registers (one kernel)", dict(wide="registers")))
    changes = [
        dict(coef_stages=1), dict(coef_rows=2, coef_chunk=2048), dict(coef_chunk=2048, coef_warps=4),
        dict(coef_chunk=8192, coef_warps=16),
        dict(stages=1), dict(stages=2), dict(block_m=8, block_n=256, warps=4), dict(block_m=16, block_n=128, warps=4),
        dict(block_m=8, block_n=512, warps=8), dict(rows=128), dict(rows=512), dict(reverse=False),
    ]
    if quick or N <= norm.LAYER_NORM_BWD_MAX_N:
        changes = [dict(stages=1), dict(block_m=8, block_n=256, warps=4), dict(reverse=False)]
    label = lambda c: "split " + " ".join(f"{k}={v}" for k, v in c.items())  # noqa: E731
    return base + [(label(c), dict(wide="split", split=c)) for c in changes]


@contextlib.contextmanager
def settings(N: int, wide: str, split: dict | None = None):
    saved = norm.LAYER_NORM_WIDE_BWD, norm.LAYER_NORM_SPLIT, norm.LAYER_NORM_BWD_MAX_N
    try:
        norm.LAYER_NORM_WIDE_BWD = "split" if wide == "registers" else wide
        norm.LAYER_NORM_SPLIT = dict(saved[1], **(split or {}))
        if wide != "registers":  # route rows of N past the in-register backward
            norm.LAYER_NORM_BWD_MAX_N = min(saved[2], N - 1)
        yield
    finally:
        norm.LAYER_NORM_WIDE_BWD, norm.LAYER_NORM_SPLIT, norm.LAYER_NORM_BWD_MAX_N = saved


def make_inputs(M: int, N: int):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(M, N, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_(True)
    w = (1 + 0.1 * torch.randn(N, device="cuda", generator=g)).to(torch.bfloat16).requires_grad_(True)
    b = torch.randn(N, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_(True)
    dy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16, generator=g)
    return x, w, b, dy


def reference_grads(x, w, b, dy):
    leaves = [t.detach().double().requires_grad_(True) for t in (x, w, b)]
    out = torch.nn.functional.layer_norm(leaves[0], x.shape[-1:], leaves[1], leaves[2], EPS)
    grads = torch.autograd.grad(out, leaves, dy.double())
    del out, leaves
    return grads


def torch_layer_norm(x, w, b):
    return torch.nn.functional.layer_norm(x, x.shape[-1:], w, b, EPS)


def back_to_back_ms(fn, calls: int = 50) -> float:
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer split settings at 16384 columns")
    args = parser.parse_args()
    assert not runtime.INTERPRET, "needs a CUDA GPU"
    t0 = time.perf_counter()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; "
          f"split module settings {norm.LAYER_NORM_SPLIT}", flush=True)
    cases = [(M, N, make_inputs(M, N), variants(N, args.quick)) for M, N in SHAPES]

    # Every kernel of every variant compiles in the pool, side by side, while torch.compile works.
    token = runtime._COMPILE_ONLY.set(True)
    try:
        for M, N, (x, w, b, dy), vs in cases:
            y, stats = norm.norm_fwd(x, w, b, EPS, 0.0, False, x.dtype)
            for _, s in vs:
                with settings(N, **s):
                    norm.norm_bwd(dy, x, w, b, stats, 0.0, False, torch.float32)
    finally:
        runtime._COMPILE_ONLY.reset(token)
    compiled = torch.compile(torch_layer_norm, dynamic=False)

    rows = []
    for M, N, (x, w, b, dy), vs in cases:
        inputs = (x, w, b)
        nbytes = 5 * M * N * 2
        expected = reference_grads(x, w, b, dy)

        def measure(label, fwd_bwd, bwd_alone=None):
            grads = fwd_bwd()
            err = max(rel_err(g, e) for g, e in zip(grads, expected))
            del grads
            ms = triton.testing.do_bench(fwd_bwd, warmup=25, rep=100, return_mode="median")
            bwd_ms = (triton.testing.do_bench(bwd_alone, warmup=25, rep=100, return_mode="median")
                      if bwd_alone else float("nan"))
            rows.append(dict(shape=f"{M}x{N}", label=label, ms=ms, gbps=nbytes / ms / 1e6, bwd_ms=bwd_ms,
                             b2b_ms=back_to_back_ms(fwd_bwd), err=err))
            r = rows[-1]
            print(f"  {r['shape']:10} {label:44} {ms:7.3f} ms {r['gbps']:6.0f} GB/s  bwd {bwd_ms:6.3f} ms  "
                  f"b2b {r['b2b_ms']:6.3f} ms  err {err:.1e}  ({time.perf_counter() - t0:.0f} s)", flush=True)

        peer = lambda: torch.autograd.grad(compiled(*inputs), inputs, dy)  # noqa: E731
        measure("torch.compile(F.layer_norm)", peer)
        measure("torch F.layer_norm (eager)", lambda: torch.autograd.grad(torch_layer_norm(*inputs), inputs, dy))
        y, stats = norm.norm_fwd(x, w, b, EPS, 0.0, False, x.dtype)
        for label, s in vs:
            with settings(N, **s):
                measure(label, lambda: torch.autograd.grad(tritonformer.layer_norm(x, w, b, EPS), inputs, dy),
                        lambda: norm.norm_bwd(dy, x, w, b, stats, 0.0, False, torch.float32))

    print(f"\nLayerNorm forward + backward, bf16, weight and bias; GB/s = 5 x M x N x 2 bytes / time "
          f"({time.perf_counter() - t0:.0f} s in all)")
    print("| shape | variant | fwd+bwd ms | GB/s | vs torch.compile | bwd alone ms | back-to-back ms | max rel err |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        peer = next(p for p in rows if p["shape"] == r["shape"] and p["label"].startswith("torch.compile"))
        print(f"| {r['shape']} | {r['label']} | {r['ms']:.3f} | {r['gbps']:.0f} | {peer['ms'] / r['ms']:.3f}x | "
              f"{r['bwd_ms']:.3f} | {r['b2b_ms']:.3f} | {r['err']:.1e} |")
    for shape in dict.fromkeys(r["shape"] for r in rows):
        ours = [r for r in rows if r["shape"] == shape and not r["label"].startswith("torch")]
        best = min(ours, key=lambda r: r["ms"])
        peer = next(p for p in rows if p["shape"] == shape and p["label"].startswith("torch.compile"))
        print(f"best at {shape}: {best['label']} {best['gbps']:.0f} GB/s, {peer['ms'] / best['ms']:.3f}x torch.compile "
              f"({peer['gbps']:.0f} GB/s)")


if __name__ == "__main__":
    main()
