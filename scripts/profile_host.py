"""Host time of a planned (replayed) tritonformer.matmul call, by Python function: where the
microseconds of a small matmul's call go when the GPU waits for the host.

    PYTHONPATH=src python3 scripts/profile_host.py [[BATCHx]MxNxK ...]
"""

import cProfile
import pstats
import sys
import time

import torch

import tritonformer as tf

CALLS = 2000
for shape in sys.argv[1:] or ["1024x1024x1024", "128x4096x4096"]:
    dims = list(map(int, shape.split("x")))
    lead, (M, N, K) = dims[:-3], dims[-3:]
    a = torch.randn(*lead, M, K, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(*lead, K, N, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        tf.matmul(a, b)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(CALLS):
        tf.matmul(a, b)
    per_call = (time.perf_counter() - start) / CALLS * 1e6
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(CALLS):
        torch.matmul(a, b)
    torch_call = (time.perf_counter() - start) / CALLS * 1e6
    torch.cuda.synchronize()
    print(f"{shape}: tritonformer.matmul {per_call:.1f} us a call, torch.matmul {torch_call:.1f} us", flush=True)
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(CALLS):
        tf.matmul(a, b)
    profile.disable()
    torch.cuda.synchronize()
    pstats.Stats(profile).sort_stats("tottime").print_stats(14)
