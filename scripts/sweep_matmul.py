"""Every matmul config (the autotune list plus candidates) timed alone on given shapes, against
cuBLAS (torch.matmul), to find the tiles small and skinny matmuls want.

    PYTHONPATH=src python3 scripts/sweep_matmul.py [MxNxK ...]   (bf16; default: the small targets)
"""

import sys

import torch
import triton
from triton.testing import do_bench

import tritonformer as tf
from tritonformer.ops import matmul as mm

SHAPES = ["1024x1024x1024", "16x4096x4096", "128x4096x4096", "2048x2048x2048"]
EXTRA = [  # (BLOCK_M, BLOCK_N, BLOCK_K, stages, warps): smaller tiles than the list's
    (64, 64, 64, 4, 4), (64, 64, 64, 6, 4), (64, 128, 64, 6, 4), (128, 64, 64, 4, 4), (128, 64, 64, 4, 8),
    (64, 64, 128, 3, 4), (32, 64, 128, 4, 4), (16, 64, 256, 3, 4), (16, 128, 128, 4, 4), (64, 128, 128, 3, 4),
]

kernel = mm._matmul_kernel
kernel.cache_results = False
base = list(kernel.configs)
extra = [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8}, num_stages=s, num_warps=w)
         for bm, bn, bk, s, w in EXTRA]
for shape in sys.argv[1:] or SHAPES:
    M, N, K = map(int, shape.split("x"))
    a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(K, N, device="cuda", dtype=torch.bfloat16)
    flops = 2 * M * N * K
    peer = do_bench(lambda: a @ b, warmup=25, rep=200)
    rows = []
    for cfg in base + extra:
        kernel.configs = [cfg]
        kernel.cache.clear()
        mm._launch_matmul.chosen.clear()
        mm._replays.clear()
        try:
            ms = do_bench(lambda: tf.matmul(a, b), warmup=25, rep=200)
        except Exception as e:  # noqa: BLE001 - a config that does not fit is a row
            print(f"  {cfg} failed: {type(e).__name__}", flush=True)
            continue
        rows.append((ms, str(cfg)))
    kernel.configs = base
    kernel.cache.clear()
    mm._launch_matmul.chosen.clear()
    mm._replays.clear()
    tuned = do_bench(lambda: tf.matmul(a, b), warmup=25, rep=200)
    print(f"{shape}: cuBLAS {peer * 1e3:.1f} us ({flops / peer * 1e-9:.0f} TFLOP/s); autotuned {tuned * 1e3:.1f} us "
          f"({peer / tuned:.2f}x); split_k {mm._split_k(M, N, K, 1, a.device)}", flush=True)
    for ms, cfg in sorted(rows)[:6]:
        print(f"   {ms * 1e3:7.1f} us {peer / ms:5.2f}x  {cfg}", flush=True)
