"""Split-K inside one program (matmul's _split_inside_kernel) at other tiles than the library's,
for the small matmuls: two warpgroups of a program (Gluon warp_specialize) run their own TMA rings
over the two halves of K, so that an SM has two chains of loads in flight instead of one; the
second leaves its float32 sum in shared memory and the first adds it and stores the tile. No
float32 partials go through global memory (split-K across programs pays for those: 1024^3 at
split 2, 12.8 against 7.5 us). The first version of this probe, with a kernel of its own, also
ran four warpgroups on quarters of K (slower; docs/perf-notes.md, twenty-eighth session). GPU
time by CUDA graph: cold (after a 256 MiB fill, less the fill) and warm, medians of five
alternating rounds, against cuBLAS and tritonformer.matmul (which routes 128x4096^2 to the kernel).

    PYTHONPATH=src python3 scripts/probe_split_cta_matmul.py [MxNxK ...]
"""

import sys

import torch
from triton.testing import do_bench_cudagraph

import tritonformer as tf
from tritonformer.ops import matmul as mm


def split_inside_matmul(a, b, shape):
    """a (M, K) @ b (K, N), row-major bf16/fp16: a call of matmul's _split_inside_kernel planned
    at `shape` (BLOCK_M, BLOCK_N, BLOCK_K, STAGES) in place of SPLIT_INSIDE_SHAPE."""
    M, K = a.shape
    N = b.shape[1]
    c = torch.empty(M, N, device=a.device, dtype=a.dtype)
    default, mm.SPLIT_INSIDE_SHAPE = mm.SPLIT_INSIDE_SHAPE, shape
    try:
        replay = mm._launch_split_inside(a, mm._one_matrix_strides(a), False, b, mm._one_matrix_strides(b), False, c,
                                         (M * N, N, 1), None, M, N, K, None, 0, 0.0)
    finally:
        mm.SPLIT_INSIDE_SHAPE = default
    return lambda: replay(a, b, c, None, None, None, None) or c


# (BLOCK_M, BLOCK_N, BLOCK_K, STAGES a half of K)
CONFIGS = [(64, 128, 64, 3), (64, 128, 64, 4), (128, 64, 64, 3), (64, 64, 64, 4), (64, 64, 64, 6), (128, 128, 64, 2)]
FILL = None


def _cold(fn):
    fill = do_bench_cudagraph(FILL.zero_, rep=40)
    return (do_bench_cudagraph(lambda: (FILL.zero_(), fn()), rep=40) - fill) * 1e3


def main():
    global FILL
    FILL = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda")
    for shape in sys.argv[1:] or ["1024x1024x1024", "128x4096x4096", "4096x4096x4096"]:
        M, N, K = map(int, shape.split("x"))
        a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(K, N, device="cuda", dtype=torch.bfloat16)
        expected = a.float() @ b.float()
        fns = {"cuBLAS": lambda: a @ b, "tritonformer": lambda: tf.matmul(a, b)}
        for bm, bn, bk, stages in CONFIGS:
            name = f"{bm}x{bn}x{bk} s{stages}"
            try:
                run = split_inside_matmul(a, b, (bm, bn, bk, stages))
                err = ((run().float() - expected).abs().max() / expected.abs().max()).item()
            except Exception as e:  # a shape that does not fit shared memory or registers
                print(f"  {name}: {type(e).__name__}: {str(e)[:120]}")
                continue
            if err < 1e-2:
                fns[name] = run
            else:
                print(f"  {name}: WRONG, relative error {err:.2e}")
        rounds = {name: ([], []) for name in fns}
        for _ in range(5):
            for name, fn in fns.items():
                rounds[name][0].append(_cold(fn))
                rounds[name][1].append(do_bench_cudagraph(fn, rep=40) * 1e3)
        med = {name: (sorted(c)[2], sorted(w)[2]) for name, (c, w) in rounds.items()}
        print(f"{shape} bf16, GPU time us cold / warm, cuBLAS over it (cold):")
        for name, (cold, warm) in med.items():
            print(f"  {name:28s} {cold:7.2f} / {warm:7.2f}  {med['cuBLAS'][0] / cold:.3f}x", flush=True)


if __name__ == "__main__":
    main()
