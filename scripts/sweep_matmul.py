"""Small and skinny matmuls against cuBLAS (torch.matmul), bf16: for each split-K count, the
autotuner picks among the config list plus smaller candidate tiles, and the call is timed four
ways: do_bench (L2 flushed, as the benchmark does), GPU time alone from a cold L2 (a CUDA graph
of the flush and the call, less the flush alone), from a warm L2 (a graph of the call), and the
host time of a call (back to back, no synchronization). On the GPU machine:

    PYTHONPATH=src python3 scripts/sweep_matmul.py [--pointer-loads] [[BATCHx]MxNxK ...]

--pointer-loads: each split also with operands read by pointer loads instead of TMA (matmul's
POINTER_LOADS_MAX_WORK lifted).
"""

import argparse
import time

import torch
import triton
from triton.testing import do_bench, do_bench_cudagraph

SHAPES = ["1024x1024x1024", "16x4096x4096", "128x4096x4096", "32x512x512x512"]
EXTRA = [  # (BLOCK_M, BLOCK_N, BLOCK_K, stages, warps): smaller tiles than the list's
    (64, 64, 64, 4, 4), (64, 128, 64, 6, 4), (128, 64, 64, 4, 4), (128, 64, 64, 4, 8),
    (64, 64, 128, 3, 4), (64, 128, 128, 3, 4), (128, 128, 64, 5, 8), (64, 256, 64, 3, 4),
    # deep pipelines, as cuBLAS's kernel for 128x4096^2 (nvjet 64x64x64, 13 stages) has
    (64, 64, 64, 12, 4), (128, 64, 64, 8, 4), (128, 64, 64, 8, 8), (128, 128, 64, 6, 8),
]


def timings(fn, flush: torch.Tensor) -> tuple[float, ...]:
    """(do_bench, cold GPU, warm GPU, host) microseconds a call."""
    fn()
    bench = do_bench(fn, warmup=25, rep=200)
    flush_ms = do_bench_cudagraph(flush.zero_, rep=100)
    cold = do_bench_cudagraph(lambda: (flush.zero_(), fn()), rep=100) - flush_ms
    warm = do_bench_cudagraph(fn, rep=100)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(200):
        fn()
    host = (time.perf_counter() - start) / 200
    torch.cuda.synchronize()
    return tuple(round(t * 1e3, 1) for t in (bench, cold, warm, host * 1e3))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("shapes", nargs="*", metavar="[BATCHx]MxNxK", help=f"default: {' '.join(SHAPES)}")
    parser.add_argument("--pointer-loads", action="store_true", help="also time pointer loads in place of TMA")
    args = parser.parse_args()

    import tritonformer as tf
    from tritonformer import runtime
    from tritonformer.ops import matmul as mm

    kernel = mm._matmul_kernel
    runtime.KEEP_TUNING = False  # time the extra configs, not a stored choice
    kernel.configs = list(kernel.configs) + [
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8}, num_stages=s, num_warps=w)
        for bm, bn, bk, s, w in EXTRA]
    default_split_k = mm._split_k
    tma_layout = mm.tma_layout
    if args.pointer_loads:
        mm.POINTER_LOADS_MAX_WORK = 2**40
    flush = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda")

    def fresh():
        mm._launch_matmul.chosen.clear()
        runtime.clear_plans()

    for shape in args.shapes or SHAPES:
        dims = list(map(int, shape.split("x")))
        batch, (M, N, K) = (dims[0] if len(dims) == 4 else None), dims[-3:]
        lead = (batch,) if batch else ()
        a = torch.randn(*lead, M, K, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(*lead, K, N, device="cuda", dtype=torch.bfloat16)
        flops = 2 * M * N * K * (batch or 1)
        peer = timings(lambda: a @ b, flush)
        print(f"{shape}: cuBLAS {peer} us (do_bench, cold, warm, host; {flops / peer[0] * 1e-6:.0f} TFLOP/s); "
              f"default split {default_split_k(M, N, K, batch or 1, a.device)}", flush=True)
        splits = [1] if batch else [s for s in (1, 2, 3, 4, 6, 8) if K // s >= 256]
        for split, loads in [(s, loads) for s in splits for loads in ("tma", "pointers")[:1 + args.pointer_loads]]:
            mm._split_k = lambda *_, split=split: split
            mm.tma_layout = tma_layout if loads == "tma" else lambda *_: None
            fresh()
            try:
                tf.matmul(a, b)
                ours = timings(lambda: tf.matmul(a, b), flush)
            except Exception as e:  # noqa: BLE001 - a split that fails is a row
                print(f"  split {split} {loads} failed: {type(e).__name__}: {e}", flush=True)
                continue
            (chosen,) = mm._launch_matmul.chosen.values()
            cfg = "x".join(str(chosen[k]) for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K")) + \
                f":w{chosen['num_warps']}:s{chosen['num_stages']}"
            ratios = " ".join(f"{p / o:.2f}x" for p, o in zip(peer[:3], ours[:3]))
            print(f"  split {split} {loads}: {ours} us  {ratios}  {cfg}", flush=True)
        mm._split_k = default_split_k
        mm.tma_layout = tma_layout
        fresh()


if __name__ == "__main__":
    main()
