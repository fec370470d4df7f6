"""Launch shapes of scaled_matmul on the GPU: times each (BLOCK_M, BLOCK_N, BLOCK_K, warps,
stages) candidate, with the op's own split-K, against torch bf16 on the same shape.

    PYTHONPATH=src python3 scripts/sweep_scaled_matmul.py [substring of the case labels to run]
"""

import sys

import torch
from triton.testing import do_bench

from tritonformer import quant
from tritonformer.ops import scaled_matmul as sm

CASES = [  # (label, M, N, K, fmt_a or None for bf16 activations, fmt_b, candidate launch shapes)
    *[(f"bf16 x {f} M{M}", M, N, 8192, None, f,
       [(16, 64, 128, 4, 4), (16, 32, 128, 4, 4), (16, 64, 256, 4, 3), (16, 128, 128, 4, 4), (16, 64, 128, 2, 4)]
       if M <= 16 else [(64, 64, 128, 4, 4), (64, 128, 64, 4, 4), (32, 64, 128, 4, 4), (64, 64, 64, 4, 5)])
      for f in ("nvfp4", "mxfp4", "mxfp8") for M in (1, 16, 64) for N in (8192, 28672)],
    *[(f"{fa} x {fb} 8192^3", 8192, 8192, 8192, fa, fb,
       [(128, 256, 64, 8, 3), (128, 128, 64, 8, 3), (128, 128, 32, 8, 4)])
      for fa, fb in (("mxfp8", "mxfp8"), ("mxfp4", "mxfp4"), ("mxfp8", "mxfp4"))],
    ("nvfp4 x nvfp4 8192^3", 8192, 8192, 8192, "nvfp4", "nvfp4",
     [(128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (128, 128, 32, 8, 4), (128, 128, 64, 4, 3)]),
]

original = sm._launch_shape
only = sys.argv[1] if len(sys.argv) > 1 else ""
for label, M, N, K, fa, fb, shapes in CASES:
    if only not in label:
        continue
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
    a = quant.quantize(x, fa) if fa else x
    b = quant.quantize(w, fb, axis=1)
    peer = do_bench(lambda: x @ w.t(), warmup=10, rep=50)
    flops = 2 * M * N * K
    results = []
    for shape in shapes:
        sm._launch_shape = lambda m, shape=shape: shape
        try:
            ms = do_bench(lambda: sm.scaled_matmul(a, b), warmup=10, rep=50)
        except Exception as e:  # noqa: BLE001 - a shape that fails to compile is a row
            print(f"{label:28s} {shape} FAILED {type(e).__name__}: {str(e)[:100]}", flush=True)
            continue
        results.append((ms, shape))
    sm._launch_shape = original
    ms, shape = min(results)
    row = " ".join(f"{s}:{t * 1e3:.0f}us" for t, s in results)
    print(f"{label:28s} best {shape} {ms * 1e3:7.1f} us {flops / ms * 1e-9:6.0f} TFLOP/s | torch bf16 "
          f"{peer * 1e3:7.1f} us -> {peer / ms:5.2f}x | {row}", flush=True)
