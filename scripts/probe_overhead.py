"""Host time per call (us) of each op against its PyTorch peer, on small inputs where the
host path decides, then a profile of the slowest of ours:
python3 scripts/probe_overhead.py (on the GPU machine, PYTHONPATH=src)."""
import cProfile
import pstats
import time

import torch

import tritonformer as tf


def host(fn, n=300):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e6


def grad(fn, inputs, dy):
    return lambda: torch.autograd.grad(fn(*inputs), inputs, dy)


dev, bf16 = "cuda", torch.bfloat16
a = torch.randn(1024, 1024, device=dev, dtype=bf16)
b = torch.randn(1024, 1024, device=dev, dtype=bf16)
x = torch.randn(256, 1024, device=dev, dtype=bf16, requires_grad=True)
w = torch.ones(1024, device=dev, dtype=bf16, requires_grad=True)
g = torch.randn(256, 1024, device=dev, dtype=bf16, requires_grad=True)
dy = torch.randn(256, 1024, device=dev, dtype=bf16)
ag, bg = a.clone().requires_grad_(True), b.clone().requires_grad_(True)
rms_torch = lambda x, w: w * (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)  # noqa
rows = {
    "matmul 1024^3": (lambda: tf.matmul(a, b), lambda: torch.matmul(a, b)),
    "matmul fwd+bwd 1024^3": (grad(tf.matmul, (ag, bg), a), grad(torch.matmul, (ag, bg), a)),
    "softmax 256x1024": (lambda: tf.softmax(x.detach()), lambda: torch.softmax(x.detach(), -1)),
    "rms_norm fwd": (lambda: tf.rms_norm(x.detach(), w.detach()), lambda: rms_torch(x.detach(), w.detach())),
    "rms_norm fwd+bwd": (grad(tf.rms_norm, (x, w), dy), grad(rms_torch, (x, w), dy)),
    "swiglu fwd+bwd": (grad(tf.swiglu, (g, x), dy), grad(lambda g, u: torch.nn.functional.silu(g) * u, (g, x), dy)),
}
results = {name: (host(ours), host(peer)) for name, (ours, peer) in rows.items()}
for name, (ours, peer) in results.items():
    print(f"host us/call  {name:24s} ours {ours:7.1f}  torch {peer:7.1f}")
for name in ("rms_norm fwd+bwd",):
    fn = rows[name][0]
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(200):
        fn()
    profile.disable()
    print(f"--- {name}: 200 calls")
    pstats.Stats(profile).sort_stats("tottime").print_stats(25)
