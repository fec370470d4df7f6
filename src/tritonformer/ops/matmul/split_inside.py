"""matmul's path for 16-bit products of few output tiles on Hopper (Gluon; not under the
interpreter): a program a 64 x 64 tile, its K in two halves on two warpgroups, each with its own
TMA ring, summed in shared memory, where split-K across programs would write float32 partials to
memory and read them back. matmul's launch_strided takes it where `fits` says. See docs/matmul.md."""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor

from ... import runtime
from ..gemm import epilogue_store, grouped_tile, row_major

# (BLOCK_M, BLOCK_N, BLOCK_K, STAGES a half of K): H100 bf16 128x4096^2 18.7 us against split-K's 21.1, cuBLAS 18.5.
SPLIT_INSIDE_SHAPE = (64, 64, 64, 6)


@gluon.jit
def _k_half(a_desc, b_desc, a_bufs, b_bufs, ready, sums, summed, c_ptr, pre_ptr, bias_ptr, M, N, K, stride_cm,
            negative_slope, HALF: gl.constexpr, A_TRANS: gl.constexpr, B_TRANS: gl.constexpr,
            HAS_BIAS: gl.constexpr, ACTIVATION: gl.constexpr, STORE_PRE: gl.constexpr, BLOCK_M: gl.constexpr,
            BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr):
    """One warpgroup's half of a tile's K (HALF 0 or 1) on its own ring of STAGES TMA slots. Half
    1 leaves its float32 sum in shared memory; half 0 adds it and runs the epilogue."""
    STAGES: gl.constexpr = a_bufs.type.shape[0] // 2
    pid_m, pid_n = grouped_tile(gl.program_id(0), gl.cdiv(M, BLOCK_M), gl.cdiv(N, BLOCK_N), GROUP_M)
    off_m = pid_m * BLOCK_M
    off_n = pid_n * BLOCK_N
    k_tiles = gl.cdiv(K, BLOCK_K)
    per_half = gl.cdiv(k_tiles, 2)
    k_lo = HALF * per_half
    steps = gl.minimum(per_half, k_tiles - k_lo)
    first_slot = HALF * STAGES
    for s in gl.static_range(STAGES - 1):
        if s < steps:
            _k_step_load(a_desc, b_desc, a_bufs, b_bufs, ready, first_slot + s, off_m, off_n, (k_lo + s) * BLOCK_K,
                         A_TRANS, B_TRANS)
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BLOCK_N, 16])
    acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, acc_layout)
    for i in range(steps):
        slot = first_slot + i % STAGES
        mbarrier.wait(ready.index(slot), (i // STAGES) & 1)
        a = a_bufs.index(slot)
        if A_TRANS:
            a = a.permute((1, 0))
        b = b_bufs.index(slot)
        if B_TRANS:
            b = b.permute((1, 0))
        acc = warpgroup_mma(a, b, acc, is_async=True)
        # Step i - 1's wgmma is done: its slot takes step i + STAGES - 1.
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
        ahead = i + STAGES - 1
        if ahead < steps:
            _k_step_load(a_desc, b_desc, a_bufs, b_bufs, ready, first_slot + ahead % STAGES, off_m, off_n,
                         (k_lo + ahead) * BLOCK_K, A_TRANS, B_TRANS)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    if HALF == 1:
        sums.store(acc)
        gl.thread_barrier()
        mbarrier.arrive(summed.index(0), count=1)
    else:
        mbarrier.wait(summed.index(0), 0)
        acc += sums.load(acc_layout)
        rm = off_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, acc_layout))
        rn = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, acc_layout))
        epilogue_store(acc, rm, rn, M, N, c_ptr, pre_ptr, stride_cm, 1, bias_ptr, c_ptr, c_ptr, negative_slope,
                       HAS_BIAS, ACTIVATION, 0, 0, STORE_PRE)


@gluon.jit
def _k_step_load(a_desc, b_desc, a_bufs, b_bufs, ready, slot, off_m, off_n, off_k, A_TRANS: gl.constexpr,
                 B_TRANS: gl.constexpr):
    """TMA loads of one K step's tiles of a and b into a ring slot, counted on its barrier."""
    mbarrier.expect(ready.index(slot), a_desc.block_type.nbytes + b_desc.block_type.nbytes)
    if A_TRANS:
        tma.async_copy_global_to_shared(a_desc, [off_k, off_m], ready.index(slot), a_bufs.index(slot))
    else:
        tma.async_copy_global_to_shared(a_desc, [off_m, off_k], ready.index(slot), a_bufs.index(slot))
    if B_TRANS:
        tma.async_copy_global_to_shared(b_desc, [off_n, off_k], ready.index(slot), b_bufs.index(slot))
    else:
        tma.async_copy_global_to_shared(b_desc, [off_k, off_n], ready.index(slot), b_bufs.index(slot))


@gluon.jit
def _split_inside_kernel(a_desc, b_desc, c_ptr, pre_ptr, bias_ptr, M, N, K, stride_cm, negative_slope,
                         A_TRANS: gl.constexpr, B_TRANS: gl.constexpr, HAS_BIAS: gl.constexpr,
                         ACTIVATION: gl.constexpr, STORE_PRE: gl.constexpr, BLOCK_M: gl.constexpr,
                         BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr):
    """A 16-bit product of few output tiles on Hopper (Gluon; not under the interpreter): a
    program a BLOCK_M x BLOCK_N tile, its K in two halves on two warpgroups (warp_specialize),
    each with its own TMA ring, so that an SM streams two chains of K steps with no float32
    partials in global memory (split-K across programs writes and reads them back). Operands are
    2-D descriptors, over the transposed matrix where A_TRANS / B_TRANS (read in place, permuted in
    shared memory for the wgmma)."""
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [2 * STAGES] + a_desc.block_type.shape, a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [2 * STAGES] + b_desc.block_type.shape, b_desc.layout)
    sums = gl.allocate_shared_memory(gl.float32, [BLOCK_M, BLOCK_N], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    ready = gl.allocate_shared_memory(gl.int64, [2 * STAGES, 1], mbarrier.MBarrierLayout())
    summed = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(2 * STAGES):
        mbarrier.init(ready.index(s), count=1)
    mbarrier.init(summed.index(0), count=1)
    gl.warp_specialize([
        (_k_half, (a_desc, b_desc, a_bufs, b_bufs, ready, sums, summed, c_ptr, pre_ptr, bias_ptr, M, N, K,
                   stride_cm, negative_slope, 0, A_TRANS, B_TRANS, HAS_BIAS, ACTIVATION, STORE_PRE, BLOCK_M, BLOCK_N,
                   BLOCK_K, GROUP_M)),
        (_k_half, (a_desc, b_desc, a_bufs, b_bufs, ready, sums, summed, c_ptr, pre_ptr, bias_ptr, M, N, K,
                   stride_cm, negative_slope, 1, A_TRANS, B_TRANS, HAS_BIAS, ACTIVATION, STORE_PRE, BLOCK_M, BLOCK_N,
                   BLOCK_K, GROUP_M)),
    ], [4], [168])


def fits(a: torch.Tensor, batch: int, M: int, N: int, K: int, split_k: int, scaled: bool) -> bool:
    """Hopper, 16-bit operands, one matrix that matmul's _split_k splits, its tiles between half
    the SMs and all of them (one program an SM: 2 x 6 stages take 213 KiB of shared memory), and
    each half of K at least a ring of steps."""
    if runtime.INTERPRET or batch != 1 or split_k == 1 or scaled or a.dtype not in (torch.float16, torch.bfloat16):
        return False
    bm, bn, bk, stages = SPLIT_INSIDE_SHAPE
    sms = runtime.num_sms(a.device.index or 0)
    tiles = runtime.cdiv(M, bm) * runtime.cdiv(N, bn)
    return runtime.capability(a.device.index or 0) == (9, 0) and sms // 2 < tiles <= sms and K >= 2 * stages * bk


_launch_split_inside_kernel = runtime.FastLaunch(_split_inside_kernel)


def launch(a, a_strides, a_trans, b, b_strides, b_trans, c, c_strides, pre, M, N, K, bias, activation,
           negative_slope):
    """matmul's launch_strided for _split_inside_kernel: operands given as it gets them (strides of
    a batch of one, transposed flags from gemm.tma_layout). Returns the replay, or None in
    compile_ahead's thread."""
    bm, bn, bk, stages = SPLIT_INSIDE_SHAPE
    element = gl.bfloat16 if a.dtype == torch.bfloat16 else gl.float16

    def descriptor(t, rows, cols, strides, trans, block_rows, block_cols):
        shape, row_major_strides, block = row_major(rows, cols, strides[1], strides[2], trans, block_rows, block_cols)
        return GluonDescriptor(t, shape, row_major_strides, block, gl.NVMMASharedLayout.get_default_for(block, element))

    a_desc = descriptor(a, M, K, a_strides, a_trans, bm, bk)
    b_desc = descriptor(b, K, N, b_strides, b_trans, bk, bn)
    grid = (runtime.cdiv(M, bm) * runtime.cdiv(N, bn),)

    def args(a_desc, b_desc, c, pre, bias):
        return (a_desc, b_desc, c, c if pre is None else pre, c if bias is None else bias, M, N, K, c_strides[1],
                negative_slope)

    entry = _launch_split_inside_kernel(
        grid, *args(a_desc, b_desc, c, pre, bias), A_TRANS=a_trans, B_TRANS=b_trans, HAS_BIAS=bias is not None,
        ACTIVATION=activation, STORE_PRE=pre is not None, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, STAGES=stages,
        GROUP_M=8, num_warps=4)
    if entry is None:
        return None

    def replay(a, b, c, pre, bias, scale_a, scale_b):
        _launch_split_inside_kernel.replay(
            entry, grid, *args(runtime.rebased(a_desc, a), runtime.rebased(b_desc, b), c, pre, bias))

    return replay
