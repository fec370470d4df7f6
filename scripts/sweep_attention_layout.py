"""Attention's forward and backward at bench e2e's shape (B4, H16/4, S2048, D128, causal, bf16)
per memory layout of q, k, v and dO: (B, H, S, D) contiguous, or (B, H, S, D) views of
(B, S, H, D) memory as HuggingFace's projections hand them over.

    python scripts/sweep_attention_layout.py
"""

import torch
from triton.testing import do_bench

import tritonformer  # noqa: F401
from tritonformer.ops import attention as attn

B, H, H_kv, S, D = 4, 16, 4, 2048, 128
scale = D**-0.5


def make(heads, bshd):
    if bshd:
        return torch.randn(B, S, heads, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    return torch.randn(B, heads, S, D, device="cuda", dtype=torch.bfloat16)


flops_fwd = 4 * B * H * S * S * D / 2
for name, (q_bshd, k_bshd, v_bshd, do_bshd) in {
    "all (B, H, S, D)": (False, False, False, False),
    "all (B, S, H, D) views": (True, True, True, True),
    "q, k (B, H, S, D); v, dO views": (False, False, True, True),
    "q, k, v (B, H, S, D); dO view": (False, False, False, True),
}.items():
    q, k, v, do = make(H, q_bshd), make(H_kv, k_bshd), make(H_kv, v_bshd), make(H, do_bshd)
    o, lse = attn.attention_fwd(q, k, v, True, scale, attn.NO_WINDOW)
    attn.attention_bwd(do, None, q, k, v, o, lse, True, scale, attn.NO_WINDOW)
    fwd = do_bench(lambda: attn.attention_fwd(q, k, v, True, scale, attn.NO_WINDOW), warmup=25, rep=200)
    bwd = do_bench(lambda: attn.attention_bwd(do, None, q, k, v, o, lse, True, scale, attn.NO_WINDOW),
                   warmup=25, rep=200)
    print(f"{name:34s} fwd {fwd * 1e3:5.0f} us ({flops_fwd / fwd / 1e9:4.0f} TFLOP/s)  "
          f"bwd {bwd * 1e3:5.0f} us ({2.5 * flops_fwd / bwd / 1e9:4.0f} TFLOP/s)", flush=True)

