"""The fused loss's per-chunk kernel (_loss_and_grad_kernel) on one chunk of bench e2e's loss
(1024 rows x 128256 bf16 logits), per warp count and chunk width: the row is read twice
(statistics, then gradient).

    python scripts/sweep_loss_kernel.py
"""

import torch
from triton.testing import do_bench

import tritonformer  # noqa: F401
from tritonformer.ops import cross_entropy as ce

rows, V = 1024, 128256
x0 = torch.randn(rows, V, device="cuda", dtype=torch.bfloat16)
target = torch.randint(0, V, (rows,), device="cuda")
loss = torch.empty(rows, device="cuda")
scale = torch.full((), 1.0 / rows, device="cuda")
floor_ms = 3 * rows * V * 2 / 3.0e12 * 1e3
print(f"floor: 3 passes {floor_ms * 1e3:.0f} us, 2 passes {floor_ms * 2 / 3 * 1e3:.0f} us at 3 TB/s")
for warps in (8, 16, 32):
    for chunk in (4096, 8192):
        x = x0.clone()

        def run():
            ce._loss_and_grad_kernel[(rows,)](x, target, loss, scale, V, 1, 0, -100, 0.0, 0.0, CHUNK=chunk,
                                              STAGES=ce.ROW_STAGES, HAS_SMOOTHING=False, HAS_Z_LOSS=False,
                                              num_warps=warps)

        ms = do_bench(run, warmup=25, rep=200)
        print(f"warps {warps:2d} chunk {chunk}: {ms * 1e3:6.0f} us ({3 * rows * V * 2 / ms / 1e9:5.2f} TB/s as 3 passes)")
