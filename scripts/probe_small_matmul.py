"""Where a small matmul's time goes: one tile a program, bf16, against cuBLAS, with operands
read through (1) tensor descriptors made on the device, (2) descriptors made on the host and
passed as kernel arguments, (3) plain pointer loads pipelined by num_stages. Times are CUDA-graph
launches (warm L2) and do_bench calls (L2 flushed). Also the device copy rate at the sizes of
the small memory-bound cases, the ceiling those cases can reach.

    PYTHONPATH=src python3 scripts/probe_small_matmul.py
"""

import torch
import triton
import triton.language as tl
from triton.testing import do_bench, do_bench_cudagraph
from triton.tools.tensor_descriptor import TensorDescriptor

import tritonformer as tf


@triton.jit
def _tile(a_desc, b_desc, c_ptr, M, N, K, pid_m, pid_n, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
          STAGES: tl.constexpr):
    acc = tl.zeros((BM, BN), tl.float32)
    for k in tl.range(0, K, BK, num_stages=STAGES):
        acc = tl.dot(a_desc.load([pid_m * BM, k]), b_desc.load([k, pid_n * BN]), acc)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    tl.store(c_ptr + rm[:, None] * N + rn[None, :], acc.to(tl.bfloat16), mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit
def device_desc_kernel(a_ptr, b_ptr, c_ptr, M, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                       STAGES: tl.constexpr):
    a_desc = tl.make_tensor_descriptor(a_ptr, shape=[M, K], strides=[K, 1], block_shape=[BM, BK])
    b_desc = tl.make_tensor_descriptor(b_ptr, shape=[K, N], strides=[N, 1], block_shape=[BK, BN])
    _tile(a_desc, b_desc, c_ptr, M, N, K, tl.program_id(0), tl.program_id(1), BM, BN, BK, STAGES)


@triton.jit
def host_desc_kernel(a_desc, b_desc, c_ptr, M, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                     STAGES: tl.constexpr):
    _tile(a_desc, b_desc, c_ptr, M, N, K, tl.program_id(0), tl.program_id(1), BM, BN, BK, STAGES)


@triton.jit
def pointer_kernel(a_ptr, b_ptr, c_ptr, M, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                   STAGES: tl.constexpr):
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), tl.float32)
    for k in tl.range(0, K, BK, num_stages=STAGES):
        a = tl.load(a_ptr + rm[:, None] * K + (k + rk)[None, :], mask=rm[:, None] < M, other=0.0)
        b = tl.load(b_ptr + (k + rk)[:, None] * N + rn[None, :])
        acc = tl.dot(a, b, acc)
    tl.store(c_ptr + rm[:, None] * N + rn[None, :], acc.to(tl.bfloat16), mask=(rm[:, None] < M) & (rn[None, :] < N))


def times(fn):
    fn()
    return do_bench_cudagraph(fn, rep=100) * 1e3, do_bench(fn, warmup=25, rep=200) * 1e3


# device-made descriptors need scratch memory for the kernel to write them into
triton.set_allocator(lambda size, alignment, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
print("copy rate (do_bench, L2 flushed): bytes read + written")
for shape, dtype in (((4096, 4096), torch.bfloat16), ((4096, 1024), torch.bfloat16), ((4096, 1024), torch.float32),
                     ((4096, 4096), torch.float32), ((16384, 16384), torch.bfloat16)):
    x = torch.randn(shape, device="cuda", dtype=dtype)
    y = torch.empty_like(x)
    ms = do_bench(lambda: y.copy_(x), warmup=25, rep=200)
    print(f"  {dtype} {shape}: {2 * x.nbytes / ms / 1e6:.0f} GB/s ({ms * 1e3:.1f} us)")

for M, N, K, tiles in ((1024, 1024, 1024, [(64, 128, 64, 4, 4), (128, 128, 64, 4, 8), (128, 64, 64, 4, 4)]),
                       (16, 4096, 4096, [(64, 64, 128, 4, 4), (64, 128, 64, 4, 4), (64, 32, 256, 3, 4)]),
                       (16, 4096, 64, [(64, 64, 64, 1, 4)]),
                       (128, 4096, 4096, [(64, 64, 128, 4, 4), (128, 64, 64, 4, 4), (128, 32, 128, 4, 4)])):
    a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(K, N, device="cuda", dtype=torch.bfloat16)
    c = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
    ref = a.float() @ b.float()
    g, d = times(lambda: torch.matmul(a, b))
    print(f"{M}x{N}x{K}: cuBLAS graph {g:.1f} us, do_bench {d:.1f} us")
    g, d = times(lambda: tf.matmul(a, b))
    print(f"  tritonformer.matmul: graph {g:.1f} us, do_bench {d:.1f} us")
    for bm, bn, bk, stages, warps in tiles:
        grid = (triton.cdiv(M, bm), triton.cdiv(N, bn))
        consts = dict(BM=bm, BN=bn, BK=bk, STAGES=stages, num_warps=warps)
        a_desc, b_desc = TensorDescriptor.from_tensor(a, [bm, bk]), TensorDescriptor.from_tensor(b, [bk, bn])
        variants = {
            "device desc": lambda: device_desc_kernel[grid](a, b, c, M, N, K, **consts),
            "host desc": lambda: host_desc_kernel[grid](a_desc, b_desc, c, M, N, K, **consts),
            "pointers": lambda: pointer_kernel[grid](a, b, c, M, N, K, **consts),
        }
        for name, fn in variants.items():
            try:
                c.fill_(float("nan"))
                fn()
                err = (c.float() - ref).abs().max().item()
                g, d = times(fn)
                print(f"  {bm}x{bn}x{bk}:s{stages}:w{warps} {name:12s} graph {g:6.1f} us  do_bench {d:6.1f} us  "
                      f"err {err:.2g}")
            except Exception as e:  # noqa: BLE001
                print(f"  {bm}x{bn}x{bk} {name} failed: {type(e).__name__}: {str(e)[:100]}")
