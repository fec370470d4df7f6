"""Launch shapes of the quantize kernel at the issue's size (16384 x 8192 bf16), per format:
scale blocks per program x warps, GB/s counting the bf16 read (as issue 5's target does).

    python scripts/sweep_quantize.py
"""

import torch
import triton
from triton.testing import do_bench

import tritonformer  # noqa: F401
from tritonformer import quant

M, K = 16384, 8192
x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
for fmt in ("mxfp8", "mxfp4", "nvfp4"):
    vec, emax = quant.FORMATS[fmt][0], quant.FORMATS[fmt][2] or 0
    fp4 = fmt != "mxfp8"
    data = torch.empty((M, K // 2) if fp4 else (M, K), dtype=torch.uint8 if fp4 else torch.float8_e4m3fn, device="cuda")
    scales = torch.empty((M, K // vec), dtype=torch.float8_e4m3fn if fmt == "nvfp4" else torch.uint8, device="cuda")
    tensor_scale = torch.ones(1, device="cuda")
    results = []
    for elements in (1024, 2048, 4096, 8192):
        blocks = elements // vec
        for warps in (2, 4, 8, 16):
            if elements // (32 * warps) < 4:
                continue

            def run():
                quant._quantize_kernel[(M, triton.cdiv(K // vec, blocks))](
                    x, data, scales, tensor_scale, K, K, FMT=fmt, VEC=vec, EMAX=emax, BLOCKS=blocks, num_warps=warps)

            ms = do_bench(run, warmup=10, rep=60)
            results.append((x.nbytes / ms / 1e6, elements, warps))
    results.sort(reverse=True)
    print(f"{fmt}: GB/s (bf16 read), elements a program, warps: "
          + ", ".join(f"{g:.0f} {e} w{w}" for g, e, w in results[:5]) + f"; worst {results[-1][0]:.0f}", flush=True)
