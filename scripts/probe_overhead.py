"""Host time per call (us) of each op against its PyTorch peer, on small inputs where the
host path decides: python3 scripts/probe_overhead.py (on the GPU machine, PYTHONPATH=src)."""
import time, torch
import tritonformer as tf

def host(fn, n=1000):
    for _ in range(20): fn()
    torch.cuda.synchronize(); t = time.perf_counter()
    for _ in range(n): fn()
    torch.cuda.synchronize(); return (time.perf_counter() - t) / n * 1e6

a = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16); b = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16)
x = torch.randn(4096, 1024, device="cuda"); v = torch.randn(4096, device="cuda")
ag, bg = a.clone().requires_grad_(True), b.clone().requires_grad_(True)
rows = {
    "matmul 1024^3": (host(lambda: tf.matmul(a, b)), host(lambda: torch.matmul(a, b))),
    "matmul fwd+bwd 1024^3": (host(lambda: torch.autograd.grad(tf.matmul(ag, bg), (ag, bg), a)),
                              host(lambda: torch.autograd.grad(torch.matmul(ag, bg), (ag, bg), a))),
    "softmax 4096x1024": (host(lambda: tf.softmax(x)), host(lambda: torch.softmax(x, -1))),
    "add 4096": (host(lambda: tf.add(v, v)), host(lambda: v + v)),
}
for name, (ours, peer) in rows.items():
    print(f"host us/call  {name:24s} ours {ours:7.1f}  torch {peer:7.1f}")
