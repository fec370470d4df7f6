"""Where the weight-only scaled_matmul's time goes at small M: triton's do_bench (what the
benchmark reports: GPU time between events, which includes any wait for the host), the same
calls captured in a CUDA graph (GPU time alone), and the host's time per call without syncs.

    PYTHONPATH=src python3 scripts/probe_scaled_matmul.py
"""

import time

import torch
from triton.testing import do_bench, do_bench_cudagraph

from tritonformer import quant
from tritonformer.ops.scaled_matmul import scaled_matmul


def host_us(fn, n=200):
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    host = (time.perf_counter() - t) / n
    torch.cuda.synchronize()
    return host * 1e6


for fmt in ("nvfp4", "mxfp4"):
    for M in (1, 16, 64):
        for N in (8192, 28672):
            K = 8192
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
            q = quant.quantize(w, fmt, axis=1)
            ours = lambda: scaled_matmul(x, q)  # noqa: E731
            peer = lambda: x @ w.t()  # noqa: E731
            t_ours, t_peer = do_bench(ours, warmup=25, rep=100), do_bench(peer, warmup=25, rep=100)
            g_ours, g_peer = do_bench_cudagraph(ours, rep=100), do_bench_cudagraph(peer, rep=100)
            print(f"{fmt} {M}x{N}x{K}: do_bench {t_ours * 1e3:6.1f} us vs torch {t_peer * 1e3:6.1f} ({t_peer / t_ours:4.2f}x)"
                  f" | graph {g_ours * 1e3:6.1f} vs {g_peer * 1e3:6.1f} ({g_peer / g_ours:4.2f}x)"
                  f" | host {host_us(ours):5.1f} us vs {host_us(peer):5.1f}", flush=True)
