"""Split-K inside one program, for the small matmuls that leave each SM one tile of dependent
steps (1024^3 on 64 x 128 tiles: 128 programs of 16 steps; docs/perf-notes.md, twenty-third
session). Each of PARTS warpgroups of a program (Gluon warp_specialize) runs its own TMA ring
over its share of K, so that an SM has PARTS chains of loads in flight instead of one; the
workers leave their float32 sums in shared memory and the first warpgroup adds them and stores
the tile. No float32 partials go through global memory (split-K across programs pays for those:
1024^3 at split 2, 12.8 against 7.5 us). GPU time by CUDA graph: cold (after a 256 MiB fill, less
the fill) and warm, medians of five alternating rounds, against cuBLAS and tritonformer.matmul.

    PYTHONPATH=src python3 scripts/probe_split_cta_matmul.py [MxNxK ...]
"""

import sys

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.testing import do_bench_cudagraph

import tritonformer as tf
from tritonformer.ops import matmul as mm


@gluon.jit
def _part(a_desc, b_desc, a_bufs, b_bufs, ready, sums, summed, c_ptr, M, N, K, stride_cm,
          part: gl.constexpr, PARTS: gl.constexpr, GROUP_M: gl.constexpr):
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = b_desc.block_type.shape[1]
    STAGES: gl.constexpr = a_bufs.type.shape[0] // PARTS
    pid_m, pid_n = mm.grouped_tile(gl.program_id(0), gl.cdiv(M, BLOCK_M), gl.cdiv(N, BLOCK_N), GROUP_M)
    off_m = pid_m * BLOCK_M
    off_n = pid_n * BLOCK_N
    k_tiles = gl.cdiv(K, BLOCK_K)
    per_part = gl.cdiv(k_tiles, PARTS)
    k_lo = part * per_part
    steps = gl.maximum(gl.minimum(per_part, k_tiles - k_lo), 0)
    nbytes: gl.constexpr = a_desc.block_type.nbytes + b_desc.block_type.nbytes
    for s in gl.static_range(STAGES - 1):
        if s < steps:
            slot = part * STAGES + s
            mbarrier.expect(ready.index(slot), nbytes)
            tma.async_copy_global_to_shared(a_desc, [off_m, (k_lo + s) * BLOCK_K], ready.index(slot), a_bufs.index(slot))
            tma.async_copy_global_to_shared(b_desc, [(k_lo + s) * BLOCK_K, off_n], ready.index(slot), b_bufs.index(slot))
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BLOCK_N, 16])
    acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, acc_layout)
    for i in range(steps):
        slot = part * STAGES + i % STAGES
        mbarrier.wait(ready.index(slot), (i // STAGES) & 1)
        acc = warpgroup_mma(a_bufs.index(slot), b_bufs.index(slot), acc, is_async=True)
        # The wgmma of step i - 1 is done: its slot takes step i + STAGES - 1.
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
        ahead = i + STAGES - 1
        if ahead < steps:
            refill = part * STAGES + ahead % STAGES
            mbarrier.expect(ready.index(refill), nbytes)
            tma.async_copy_global_to_shared(a_desc, [off_m, (k_lo + ahead) * BLOCK_K], ready.index(refill),
                                            a_bufs.index(refill))
            tma.async_copy_global_to_shared(b_desc, [(k_lo + ahead) * BLOCK_K, off_n], ready.index(refill),
                                            b_bufs.index(refill))
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    if part > 0:
        sums.slice((part - 1) * BLOCK_M, BLOCK_M).store(acc)
        gl.thread_barrier()
        mbarrier.arrive(summed.index(0), count=1)
    else:
        mbarrier.wait(summed.index(0), 0)
        for p in gl.static_range(PARTS - 1):
            acc += sums.slice(p * BLOCK_M, BLOCK_M).load(acc_layout)
        rm = off_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, acc_layout))
        rn = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, acc_layout))
        offs = rm.to(gl.int64)[:, None] * stride_cm + rn[None, :]
        gl.store(c_ptr + offs, acc.to(c_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


@gluon.jit
def _split_cta_kernel(a_desc, b_desc, c_ptr, M, N, K, stride_cm, PARTS: gl.constexpr, STAGES: gl.constexpr,
                      GROUP_M: gl.constexpr, WORKER_REGS: gl.constexpr):
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = b_desc.block_type.shape[1]
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [PARTS * STAGES] + a_desc.block_type.shape, a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [PARTS * STAGES] + b_desc.block_type.shape, b_desc.layout)
    # The workers' sums, in a power of two of rows (PARTS is 2 or 4).
    SUM_ROWS: gl.constexpr = BLOCK_M if PARTS == 2 else 4 * BLOCK_M
    sums = gl.allocate_shared_memory(gl.float32, [SUM_ROWS, BLOCK_N],
                                     gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    ready = gl.allocate_shared_memory(gl.int64, [PARTS * STAGES, 1], mbarrier.MBarrierLayout())
    summed = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(PARTS * STAGES):
        mbarrier.init(ready.index(s), count=1)
    mbarrier.init(summed.index(0), count=PARTS - 1)
    if PARTS == 2:
        gl.warp_specialize([
            (_part, (a_desc, b_desc, a_bufs, b_bufs, ready, sums, summed, c_ptr, M, N, K, stride_cm, 0, PARTS, GROUP_M)),
            (_part, (a_desc, b_desc, a_bufs, b_bufs, ready, sums, summed, c_ptr, M, N, K, stride_cm, 1, PARTS, GROUP_M)),
        ], [4], [WORKER_REGS])
    else:
        gl.warp_specialize([
            (_part, (a_desc, b_desc, a_bufs, b_bufs, ready, sums, summed, c_ptr, M, N, K, stride_cm, 0, PARTS, GROUP_M)),
            (_part, (a_desc, b_desc, a_bufs, b_bufs, ready, sums, summed, c_ptr, M, N, K, stride_cm, 1, PARTS, GROUP_M)),
            (_part, (a_desc, b_desc, a_bufs, b_bufs, ready, sums, summed, c_ptr, M, N, K, stride_cm, 2, PARTS, GROUP_M)),
            (_part, (a_desc, b_desc, a_bufs, b_bufs, ready, sums, summed, c_ptr, M, N, K, stride_cm, 3, PARTS, GROUP_M)),
        ], [4, 4, 4], [WORKER_REGS, WORKER_REGS, WORKER_REGS])


def split_cta_matmul(a, b, BM=64, BN=128, BK=64, STAGES=3, PARTS=2, GROUP_M=8):
    """a (M, K) @ b (K, N), row-major bf16/fp16, PARTS warpgroups a program over K."""
    M, K = a.shape
    N = b.shape[1]
    c = torch.empty(M, N, device=a.device, dtype=a.dtype)
    dt = gl.bfloat16 if a.dtype == torch.bfloat16 else gl.float16
    a_desc = TensorDescriptor.from_tensor(a, [BM, BK], gl.NVMMASharedLayout.get_default_for([BM, BK], dt))
    b_desc = TensorDescriptor.from_tensor(b, [BK, BN], gl.NVMMASharedLayout.get_default_for([BK, BN], dt))
    grid = (triton.cdiv(M, BM) * triton.cdiv(N, BN),)
    _split_cta_kernel[grid](a_desc, b_desc, c, M, N, K, c.stride(0), PARTS=PARTS, STAGES=STAGES, GROUP_M=GROUP_M,
                            WORKER_REGS=168 if BM * BN <= 64 * 128 else 232, num_warps=4)
    return c


# (BLOCK_M, BLOCK_N, BLOCK_K, STAGES a part, PARTS)
CONFIGS = [(64, 128, 64, 3, 2), (64, 128, 64, 4, 2), (128, 64, 64, 3, 2), (64, 64, 64, 4, 2), (64, 64, 64, 6, 2),
           (64, 64, 64, 2, 4), (64, 128, 32, 2, 4), (128, 128, 64, 2, 2)]
FILL = None


def _cold(fn):
    fill = do_bench_cudagraph(FILL.zero_, rep=40)
    return (do_bench_cudagraph(lambda: (FILL.zero_(), fn()), rep=40) - fill) * 1e3


def main():
    global FILL
    FILL = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda")
    for shape in sys.argv[1:] or ["1024x1024x1024", "128x4096x4096", "4096x4096x4096"]:
        M, N, K = map(int, shape.split("x"))
        a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(K, N, device="cuda", dtype=torch.bfloat16)
        expected = a.float() @ b.float()
        fns = {"cuBLAS": lambda: a @ b, "tritonformer": lambda: tf.matmul(a, b)}
        for bm, bn, bk, stages, parts in CONFIGS:
            if triton.cdiv(K, bk) < 2 * parts:
                continue

            def run(bm=bm, bn=bn, bk=bk, stages=stages, parts=parts):
                return split_cta_matmul(a, b, BM=bm, BN=bn, BK=bk, STAGES=stages, PARTS=parts)

            name = f"{bm}x{bn}x{bk} s{stages} parts {parts}"
            try:
                err = ((run().float() - expected).abs().max() / expected.abs().max()).item()
            except Exception as e:  # a shape that does not fit shared memory or registers
                print(f"  {name}: {type(e).__name__}: {str(e)[:120]}")
                continue
            if err < 1e-2:
                fns[name] = run
            else:
                print(f"  {name}: WRONG, relative error {err:.2e}")
        rounds = {name: ([], []) for name in fns}
        for _ in range(5):
            for name, fn in fns.items():
                rounds[name][0].append(_cold(fn))
                rounds[name][1].append(do_bench_cudagraph(fn, rep=40) * 1e3)
        med = {name: (sorted(c)[2], sorted(w)[2]) for name, (c, w) in rounds.items()}
        print(f"{shape} bf16, GPU time us cold / warm, cuBLAS over it (cold):")
        for name, (cold, warm) in med.items():
            print(f"  {name:28s} {cold:7.2f} / {warm:7.2f}  {med['cuBLAS'][0] / cold:.3f}x", flush=True)


if __name__ == "__main__":
    main()
