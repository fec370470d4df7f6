"""RoPE forward in (B, H, S, D) on the GPU: the head-walking kernel, the flat kernel at each of
rope.FLAT_CANDIDATES, and torch.compile of HuggingFace's rotate-half formula, on the same bf16
tensors (cos/sin (1, S, D) as the bench builds them). One table, TB/s over 2 (q + k) + cos + sin
bytes, timed as the bench times (triton.testing.do_bench, warmup 25 ms, rep 100 ms, median; do_bench
clears L2 before each call). Every row goes through apply_rope, as the bench does. Set the winner
in rope.FLAT_LAUNCH.

    PYTHONPATH=src python3 scripts/probe_rope.py      (about 40 s on the H100)
"""
import sys
import time

import torch

from tritonformer import runtime  # before triton
from tritonformer.bench import peers
from tritonformer.ops import rope

import triton  # noqa: E402,I001

SHAPES = [(4, 32, 8, 4096, 128), (1, 32, 8, 8192, 128)]  # B, Hq, Hk, S, D
DTYPE = torch.bfloat16


def median_ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def label(launch: dict) -> str:
    return f"flat tile {launch['tile_bytes']:>5} B, {launch['num_warps']} warps, evict {'on' if launch['evict'] else 'off'}"


def compile_flat_candidates(q, k, cos, sin) -> None:
    """Start every candidate's compile at once on runtime's compile pool (a later launch of the
    same kernel waits for its compile instead of starting another)."""
    q_out, k_out = torch.empty_like(q), torch.empty_like(k)
    token = runtime._COMPILE_ONLY.set(True)
    try:
        for launch in rope.FLAT_CANDIDATES:
            rope._launch_flat(q, k, q_out, k_out, cos, sin, k.shape[1], False, launch)
    finally:
        runtime._COMPILE_ONLY.reset(token)


def probe_shape(B, Hq, Hk, S, D) -> dict[str, tuple[float, str]]:
    """{row label: (ms, check)} for one shape."""
    q = torch.randn(B, Hq, S, D, device="cuda", dtype=DTYPE)
    k = torch.randn(B, Hk, S, D, device="cuda", dtype=DTYPE)
    cos, sin = rope._bench_table(S, D, DTYPE)
    exp_q, exp_k = rope.apply_rope_reference(q.float(), k.float(), cos.float(), sin.float())
    compile_flat_candidates(q, k, cos, sin)

    def check(outs) -> str:
        ok = all(torch.allclose(o.float(), e, atol=1e-2, rtol=1.6e-2) for o, e in zip(outs, (exp_q, exp_k)))
        return "ok" if ok else "MISMATCH"

    rows = {}
    saved = rope.FLAT_BHSD, rope.FLAT_LAUNCH
    try:
        compiled = peers.compiled(rope.apply_rope_reference, q, k, cos, sin, "bhsd")
        rows["torch.compile (HF rotate_half)"] = (median_ms(compiled), check(compiled()))
        rope.FLAT_BHSD = False
        run = lambda: rope.apply_rope(q, k, cos, sin, "bhsd")  # noqa: E731
        rows[f"old: head-walking {rope.LAUNCH[False]}"] = (median_ms(run), check(run()))
        rope.FLAT_BHSD = True
        for launch in rope.FLAT_CANDIDATES:
            rope.FLAT_LAUNCH = launch
            name = label(launch) + (" (current)" if launch == saved[1] else "")
            try:
                rows[name] = (median_ms(run), check(run()))
            except Exception as exc:  # a launch shape Triton cannot lay out: report, go on
                rows[name] = (float("nan"), type(exc).__name__)
    finally:
        rope.FLAT_BHSD, rope.FLAT_LAUNCH = saved
    return rows


def main() -> None:
    if runtime.INTERPRET:
        sys.exit("probe_rope.py needs a CUDA GPU")
    start = time.perf_counter()
    results, nbytes = [], []
    for B, Hq, Hk, S, D in SHAPES:
        results.append(probe_shape(B, Hq, Hk, S, D))
        nbytes.append(2 * B * (Hq + Hk) * S * D * DTYPE.itemsize + 2 * S * D * DTYPE.itemsize)
        torch.cuda.empty_cache()

    width = max(len(name) for r in results for name in r)
    heads = [f"q {B}x{Hq}x{S}x{D} k {B}x{Hk}x{S}x{D} ({n / 1e6:.1f} MB)"
             for (B, Hq, Hk, S, D), n in zip(SHAPES, nbytes)]
    print(f"\nrope forward bhsd bf16 on {torch.cuda.get_device_name()}; ms, TB/s, x torch.compile, check")
    print(f"{'':{width}} | " + " | ".join(f"{h:<36}" for h in heads))
    base = [r["torch.compile (HF rotate_half)"][0] for r in results]
    for name in results[0]:
        cells = []
        for r, n, b in zip(results, nbytes, base):
            ms, ok = r[name]
            cells.append(f"{ms:.4f} ms {n / ms / 1e9:5.2f} TB/s {b / ms:5.3f}x {ok:<8}")
        print(f"{name:{width}} | " + " | ".join(f"{c:<36}" for c in cells))
    print(f"({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
