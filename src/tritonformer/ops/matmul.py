"""Matrix product with a fused epilogue: out = act((a * scale_a) @ (b * scale_b) + bias).

a is (..., M, K); b is (K, N) or batched (..., K, N) with batch dims broadcasting against a's.
Operands are float32, float16, bfloat16 or float8_e4m3fn (then with per-tensor or per-row/column
float32 scales); accumulation is float32. A float32 product uses tf32 tensor cores exactly when
torch does (`torch.backends.cuda.matmul.allow_tf32`), and exact fp32 otherwise.

One persistent kernel does all shapes but the few-tile ones below: tiles in grouped order
(GROUP_M rows of tiles share the columns of b in L2), operands read through tensor descriptors
(TMA on Hopper), transposed operands read in place. Split-K takes over when the output has too
few tiles to fill the GPU (small M): partial sums go to a float32 workspace, and the last split
to finish a tile adds them up and applies the epilogue (no second launch). On Hopper, 16-bit
products of that kind whose 64 x 64 tiles fill half the SMs or more split K inside a program
instead (_split_inside_kernel, in Gluon: two warpgroups on the two halves of K, each with its
own TMA ring, summed in shared memory). TMA needs 16-byte aligned rows; an operand whose rows
are not gets copied once into a padded buffer (cheaper than unvectorized loads, see
docs/perf-notes.md), except in small products (POINTER_LOADS_MAX_WORK), where the copies'
launches would cost more than the product: there the kernel reads both operands with masked
pointer loads, as it does in every small product of few rows (POINTER_LOADS_MAX_M), whose time
is mostly the host's.

Backward (float operands): dpre = dout * act'(pre), da = dpre @ b^T, db = a^T @ dpre,
dbias = sum of dpre over rows; both products run on the same kernel, transposes read in place.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor
from triton.tools.tensor_descriptor import TensorDescriptor

from .. import runtime
from ..bench import peers
from ..bench.runner import short_dtype
from ..spec import Bench, BenchCase, OpSpec, TestCase

FP8 = torch.float8_e4m3fn
OPERAND_DTYPES = (torch.float32, torch.float16, torch.bfloat16, FP8)
ACTIVATIONS = {None: 0, "relu": 1, "leaky_relu": 2, "gelu": 3, "gelu_tanh": 4, "silu": 5}
SCALE_NONE, SCALE_TENSOR, SCALE_VECTOR = 0, 1, 2
# Split K only when fewer output tiles than this fraction of the SMs would run.
SPLIT_K_MAX = 8
SPLIT_K_MIN_K_PER_SPLIT = 512
# Up to this many multiply-adds (batch M N K) an operand that TMA cannot read is read with pointer
# loads instead of being copied into a padded buffer first.
POINTER_LOADS_MAX_WORK = 2**28
# So are both operands of a product that small with at most this many rows: its launch without
# descriptors costs 12-28 us less host time, and the GPU time is no worse (16x4096^2 at split 4:
# 17.7 against 18.7 us from a cold L2). At 128 rows pointer loads lose: 128x8192x4096 59 against 38 us.
POINTER_LOADS_MAX_M = 64


def _configs():
    def cfg(bm, bn, bk, stages, warps, group=8):
        return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": group},
                             num_stages=stages, num_warps=warps)

    if runtime.INTERPRET:
        return [cfg(32, 32, 32, 1, 4, group=2)]
    return [
        cfg(128, 256, 64, 3, 8),
        cfg(128, 256, 64, 4, 8),
        cfg(256, 128, 64, 3, 8),
        cfg(128, 128, 64, 4, 8),
        cfg(128, 128, 128, 3, 8),
        cfg(128, 256, 128, 2, 8),
        cfg(64, 128, 64, 4, 4),
        cfg(64, 256, 64, 4, 4),
        cfg(64, 64, 128, 4, 4),
        # cuBLAS's tile for 128x4096^2 (nvjet 64x64x64): at split 2 two programs an SM, each
        # with 6 stages in flight
        cfg(64, 64, 64, 6, 4),
        cfg(128, 128, 32, 4, 8),
        cfg(64, 128, 32, 4, 4),
    ]


def _prune_configs(configs, named_args, **kwargs):
    """Drop tiles that cannot fit the dtype in shared memory or are much taller than M."""
    M, elt = named_args["M"], named_args["a_ptr"].element_size()
    kept = []
    for c in configs:
        kw = c.kwargs
        smem = (kw["BLOCK_M"] + kw["BLOCK_N"]) * kw["BLOCK_K"] * elt * c.num_stages
        if smem > 220 * 1024:
            continue
        if kw["BLOCK_M"] > 64 and M <= 64:
            continue
        if elt == 4 and kw["BLOCK_K"] > 32:
            continue
        if elt == 1 and kw["BLOCK_K"] < 64:
            continue
        kept.append(c)
    return kept or configs[-1:]


@triton.jit
def _exp2(x):
    """2^x as one MUFU.EX2 (ex2.approx.ftz: 2 ulp, results under 2^-126 flush to zero);
    tl.math.exp2 rescales around it to keep subnormal results, three more instructions. The
    interpreter, which runs no PTX, takes tl.math.exp2."""
    if runtime.COMPILED:
        y = tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=tl.float32,
                                      is_pure=True, pack=1)
    else:
        y = tl.math.exp2(x)
    return y


@triton.jit
def _reciprocal(x):
    """1 / x as one MUFU.RCP (rcp.approx.ftz: 1 ulp, results under 2^-126 flush to zero); a
    division adds four instructions of range checks."""
    if runtime.COMPILED:
        y = tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=tl.float32,
                                      is_pure=True, pack=1)
    else:
        y = 1.0 / x
    return y


@triton.jit
def _gelu_erf(x, SHORT: tl.constexpr):
    """x * Phi(x) with Phi(-|x|) = erfc(z) / 2 = t exp(P(t) - z^2) / 2, z = |x| / sqrt(2),
    t = 1 / (1 + z / 2): Numerical Recipes' degree-9 P (erfc's relative error under 1.2e-7), or
    with SHORT, for 16-bit outputs, our own degree-5 fit (2e-5, a tenth of fp16's rounding). The
    coefficients are P's times log2(e), less 1 in the constant (the halving), so that the exp is
    one exp2. Through erfc the negative tail keeps its relative accuracy, which 1 + erf loses.
    Then x Phi(x) = max(x, 0) - |x| Phi(-|x|) on both sides of 0, one FMA and no select. The
    kernel works with -t (P in -t: its odd coefficients negated; every intermediate is the same
    number, or its negation, as with t), so that the FMA needs no negation: -x costs an
    instruction (0 - x) where a constant's sign is free. libdevice's erf, two polynomials selected
    per element, took about 60 instructions an element in a 128x256 epilogue and pushed it to 255
    registers with spills (docs/perf-notes.md)."""
    minus_t = _reciprocal(-1.0 - 0.35355339059327373 * tl.abs(x))
    if SHORT:
        p = -0.340877662
        p = -1.05519223 + minus_t * p
        p = -0.720648823 + minus_t * p
        p = 0.347956302 + minus_t * p
        p = -1.47339992 + minus_t * p
        p = -2.82766191 + minus_t * p
    else:
        p = -0.246517298
        p = -1.18611495 + minus_t * p
        p = -2.14747446 + minus_t * p
        p = -1.63775315 + minus_t * p
        p = -0.402321582 + minus_t * p
        p = -0.26875686 + minus_t * p
        p = -0.139630057 + minus_t * p
        p = 0.539700616 + minus_t * p
        p = -1.4427292 + minus_t * p
        p = -2.82574822 + minus_t * p
    # -Phi(-|x|); z^2 log2(e) = x^2 log2(e) / 2
    minus_phi_tail = minus_t * _exp2(p - x * (0.7213475204444817 * x))
    return tl.fma(tl.abs(x), minus_phi_tail, tl.maximum(x, 0.0))


@triton.jit
def _activate(x, ACTIVATION: tl.constexpr, negative_slope, OUT_16BIT: tl.constexpr):
    if ACTIVATION == 1:
        x = tl.maximum(x, 0.0)
    elif ACTIVATION == 2:
        x = tl.where(x >= 0, x, x * negative_slope)
    elif ACTIVATION == 3:
        x = _gelu_erf(x, OUT_16BIT)
    elif ACTIVATION == 4:
        # x 0.5 (1 + tanh(z)) == x sigmoid(2z) == x / (1 + 2^(-2z log2(e))), z = sqrt(2 / pi) (x + 0.044715 x^3)
        x = x * _reciprocal(1.0 + _exp2(x * (-2.302208198144325 - 0.1029432395800235 * (x * x))))
    elif ACTIVATION == 5:
        x = x * _reciprocal(1.0 + _exp2(x * -1.4426950408889634))  # x sigmoid(x)
    return x


@triton.jit
def _epilogue_store(
    acc, rm, rn, M, N, c_ptr, pre_ptr, stride_cm, stride_cn, bias_ptr, scale_a_ptr, scale_b_ptr, negative_slope,
    HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, SCALE_A: tl.constexpr, SCALE_B: tl.constexpr,
    STORE_PRE: tl.constexpr,
):
    """Scale, add bias, activate and store one float32 tile (c and pre share strides)."""
    if SCALE_A == 1:
        acc = acc * tl.load(scale_a_ptr)
    elif SCALE_A == 2:
        acc = acc * tl.load(scale_a_ptr + rm, mask=rm < M, other=0.0)[:, None]
    if SCALE_B == 1:
        acc = acc * tl.load(scale_b_ptr)
    elif SCALE_B == 2:
        acc = acc * tl.load(scale_b_ptr + rn, mask=rn < N, other=0.0)[None, :]
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    offs = rm.to(tl.int64)[:, None] * stride_cm + rn[None, :] * stride_cn
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    if STORE_PRE:
        tl.store(pre_ptr + offs, acc.to(pre_ptr.dtype.element_ty), mask=mask)
    acc = _activate(acc, ACTIVATION, negative_slope, c_ptr.dtype.element_ty.primitive_bitwidth == 16)
    tl.store(c_ptr + offs, acc.to(c_ptr.dtype.element_ty), mask=mask)


@triton.jit
def grouped_tile(t, tiles_m, tiles_n, GROUP_M: tl.constexpr):
    """(row, column) of output tile t in grouped order: GROUP_M rows of tiles are walked column by
    column, so that the tiles running at once share their rows of A and columns of B in L2."""
    tiles_per_group = GROUP_M * tiles_n
    first_m = t // tiles_per_group * GROUP_M
    group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
    return first_m + t % tiles_per_group % group_rows, t % tiles_per_group // group_rows


@triton.jit
def split_k_total(acc, ws_ptr, counter_ptr, tile_id, split, rm, rn, M, N, SPLIT_K: tl.constexpr):
    """Split-K without a second launch. Each split stores its float32 partial tile in ws
    (SPLIT_K, M, N) and counts itself in at counter_ptr[tile_id]; the split that arrives last
    sums all partials in split order (bit-identical whichever arrives last), resets the counter
    for the next launch and returns (True, sum). The others return (False, acc)."""
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    tile_offs = rm.to(tl.int64)[:, None] * N + rn[None, :]
    tl.store(ws_ptr + split.to(tl.int64) * M * N + tile_offs, acc, mask=mask)
    # One thread does the atomic: the barrier orders every thread's partial before its release.
    tl.debug_barrier()
    arrived = tl.atomic_add(counter_ptr + tile_id, 1, sem="acq_rel", scope="gpu")
    last = arrived == SPLIT_K - 1
    total = acc
    if last:
        total = tl.zeros_like(acc)
        partial_ptrs = ws_ptr + tile_offs
        for _ in tl.static_range(SPLIT_K):
            # .cg: read at L2, where the other programs' partials are, never a stale L1 line.
            total += tl.load(partial_ptrs, mask=mask, other=0.0, cache_modifier=".cg")
            partial_ptrs += M * N
        tl.store(counter_ptr + tile_id, 0)
    return last, total


@runtime.autotune(
    configs=_configs(),
    prune_configs_by={"early_config_prune": _prune_configs},
)
@triton.jit
def _matmul_kernel(
    a_ptr, b_ptr, c_ptr, pre_ptr, ws_ptr, counter_ptr, bias_ptr, scale_a_ptr, scale_b_ptr,
    BATCH, M, N, K,
    stride_ab, stride_am, stride_ak, stride_bb, stride_bk, stride_bn, stride_cb, stride_cm, stride_cn,
    negative_slope,
    A_TRANS: tl.constexpr, B_TRANS: tl.constexpr, SPLIT_K: tl.constexpr,
    HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, SCALE_A: tl.constexpr, SCALE_B: tl.constexpr,
    STORE_PRE: tl.constexpr, UPCAST: tl.constexpr, INPUT_PRECISION: tl.constexpr, POINTER_LOADS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    # a_ptr and b_ptr are tensor descriptors made on the host (_host_descriptor), or with
    # POINTER_LOADS plain pointers read through their strides, masked.
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    tiles_per_matrix = tiles_m * tiles_n
    k_tiles = tl.cdiv(K, BLOCK_K)
    k_tiles_per_split = tl.cdiv(k_tiles, SPLIT_K)
    num_tiles = BATCH * SPLIT_K * tiles_per_matrix

    # Without a split, the tile loop flattens into the K loop so that loads for the next tile
    # start while this one finishes (no pipeline drain between tiles).
    for tile in tl.range(tl.program_id(0), num_tiles, tl.num_programs(0), flatten=SPLIT_K == 1):
        matrix = tile // tiles_per_matrix
        batch = matrix // SPLIT_K
        split = matrix % SPLIT_K
        t = tile % tiles_per_matrix
        pid_m, pid_n = grouped_tile(t, tiles_m, tiles_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        if SPLIT_K == 1:
            k_begin = 0
            k_end = k_tiles
        else:
            k_begin = split * k_tiles_per_split
            k_end = tl.minimum(k_begin + k_tiles_per_split, k_tiles)

        rm = off_m + tl.arange(0, BLOCK_M)
        rn = off_n + tl.arange(0, BLOCK_N)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kt in range(k_begin, k_end):
            off_k = kt * BLOCK_K
            if POINTER_LOADS:
                rk = off_k + tl.arange(0, BLOCK_K)
                # Every offset in int64: a transposed operand's column stride can be a whole row.
                a = tl.load(a_ptr + batch.to(tl.int64) * stride_ab + rm.to(tl.int64)[:, None] * stride_am
                            + rk.to(tl.int64)[None, :] * stride_ak, mask=(rm < M)[:, None] & (rk < K)[None, :],
                            other=0.0)
                b = tl.load(b_ptr + batch.to(tl.int64) * stride_bb + rk.to(tl.int64)[:, None] * stride_bk
                            + rn.to(tl.int64)[None, :] * stride_bn, mask=(rk < K)[:, None] & (rn < N)[None, :],
                            other=0.0)
            else:
                if A_TRANS:
                    a = a_ptr.load([batch, off_k, off_m]).reshape(BLOCK_K, BLOCK_M).T
                else:
                    a = a_ptr.load([batch, off_m, off_k]).reshape(BLOCK_M, BLOCK_K)
                if B_TRANS:
                    b = b_ptr.load([batch, off_n, off_k]).reshape(BLOCK_N, BLOCK_K).T
                else:
                    b = b_ptr.load([batch, off_k, off_n]).reshape(BLOCK_K, BLOCK_N)
            if UPCAST:
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)

        finish = True
        if SPLIT_K > 1:
            # Split-K runs only on a batch of one (_split_k), so t names the tile.
            finish, acc = split_k_total(acc, ws_ptr, counter_ptr, t, split, rm, rn, M, N, SPLIT_K)
        if finish:
            _epilogue_store(
                acc, rm, rn, M, N, c_ptr + batch.to(tl.int64) * stride_cb, pre_ptr + batch.to(tl.int64) * stride_cb,
                stride_cm, stride_cn, bias_ptr, scale_a_ptr, scale_b_ptr, negative_slope,
                HAS_BIAS, ACTIVATION, SCALE_A, SCALE_B, STORE_PRE,
            )


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
        _epilogue_store(acc, rm, rn, M, N, c_ptr, pre_ptr, stride_cm, 1, bias_ptr, c_ptr, c_ptr, negative_slope,
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


def _tma_layout(t: torch.Tensor, shape: tuple[int, int, int], strides: tuple[int, int, int]):
    """(strides, transposed) for reading the (batch, rows, cols) matrix `shape` with `strides` from
    `t` in place through TMA: row-major (transposed=False) or column-major (True) with a 16-byte
    aligned base and strides; None when it is neither."""
    align = 16 // t.element_size()
    sb, sr, sc = strides
    aligned_base = t.data_ptr() % 16 == 0
    # A broadcast batch (stride 0) is not either: TMA wants every stride positive.
    if aligned_base and (sc == 1 or shape[2] == 1) and sr % align == 0 and sr > 0 and sb % align == 0 and sb > 0:
        return (sb, sr, 1), False
    if aligned_base and sr == 1 and sc % align == 0 and sc > 0 and sb % align == 0 and sb > 0:
        return strides, True
    return None


@triton.jit
def _padded_copy_kernel(src_ptr, dst_ptr, ROWS, COLS, stride_sb, stride_sr, stride_sc, stride_db, stride_dr,
                        BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """One (BLOCK_R, BLOCK_C) tile of dst[b] = src[b], matrices of (ROWS, COLS); dst row-major."""
    tiles_c = tl.cdiv(COLS, BLOCK_C)
    tiles = tl.cdiv(ROWS, BLOCK_R) * tiles_c
    batch = (tl.program_id(0) // tiles).to(tl.int64)
    tile = tl.program_id(0) % tiles
    r = (tile // tiles_c) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = (tile % tiles_c) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (r < ROWS)[:, None] & (c < COLS)[None, :]
    r64 = r.to(tl.int64)[:, None]
    # c in int64 too: a transposed source's column stride can be a whole row.
    x = tl.load(src_ptr + batch * stride_sb + r64 * stride_sr + c.to(tl.int64)[None, :] * stride_sc, mask=mask)
    tl.store(dst_ptr + batch * stride_db + r64 * stride_dr + c[None, :], x, mask=mask)


_launch_padded_copy = runtime.FastLaunch(_padded_copy_kernel)
PADDED_COPY_TILE = (32, 128)


def _padded_copy(t: torch.Tensor, shape: tuple[int, int, int], strides: tuple[int, int, int]):
    """(copy, again): the (batch, rows, cols) matrix `shape` read with `strides` from `t`, copied
    row-major with its rows padded to 16 bytes (what TMA reads), and `again(t)`, which makes the
    same copy of another tensor of the same layout by replaying the launch: torch's copy_ and the
    views around it cost several times that host time, which decides a mid-size product's time."""
    align = 16 // t.element_size()
    batch, rows, cols = shape
    padded_shape = (batch, rows, -(-cols // align) * align)
    block_r, block_c = PADDED_COPY_TILE
    grid = (batch * runtime.cdiv(rows, block_r) * runtime.cdiv(cols, block_c),)
    scalars = (rows, cols, *strides, rows * padded_shape[2], padded_shape[2])
    buf = runtime.empty(padded_shape, t.dtype, t.device)
    entry = _launch_padded_copy(grid, t, buf, *scalars, BLOCK_R=block_r, BLOCK_C=block_c, num_warps=4)

    def again(t: torch.Tensor) -> torch.Tensor:
        buf = runtime.empty(padded_shape, t.dtype, t.device)
        _launch_padded_copy.replay(entry, grid, t, buf, *scalars)
        return buf

    return buf[..., :cols], again


def _programs_per_sm(meta: dict, element_size: int) -> int:
    """About how many programs of this config fit one SM's shared memory at once: big problems
    get a persistent grid of that size, small ones one program per tile. The grid function sees
    only kernel parameters, not num_stages: 3 stages are assumed (a larger grid only queues)."""
    stage_bytes = (meta["BLOCK_M"] + meta["BLOCK_N"]) * meta["BLOCK_K"] * element_size
    return max(1, (227 * 1024) // (stage_bytes * 3))


def _split_k(M: int, N: int, K: int, batch: int, device: torch.device) -> int:
    tiles = batch * math.ceil(M / 64) * math.ceil(N / 128)
    sms = runtime.num_sms(device.index or 0)
    if batch > 1 or tiles * 2 > sms:
        return 1
    split = min(SPLIT_K_MAX, sms // tiles, K // SPLIT_K_MIN_K_PER_SPLIT)
    return max(split, 1)


def _scale_mode(scale: torch.Tensor | None) -> int:
    if scale is None:
        return SCALE_NONE
    return SCALE_TENSOR if scale.numel() == 1 else SCALE_VECTOR


def _input_precision(dtype: torch.dtype) -> str:
    if dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32:
        return "ieee"
    return "tf32"


_launch_matmul = runtime.TunedLauncher(_matmul_kernel)


def _one_matrix_strides(t: torch.Tensor) -> tuple[int, int, int]:
    """Strides of a 2-D tensor seen as a batch of one; the batch stride is the matrix's span, which
    is 16-byte aligned whenever its row or column stride is (TMA wants every stride aligned)."""
    return (max(st * n for st, n in zip(t.stride(), t.shape)), *t.stride())


def _launch(a, a_strides, b, b_strides, c, c_strides, pre, batch: int, M: int, N: int, K: int,
            bias, scale_a, scale_b, activation: int, negative_slope: float):
    """c[i] = epilogue(a[i] @ b[i]) for i < batch over (batch, M, K) x (batch, K, N) matrices given
    by base tensors and strides; pre, when given, shares c's strides.

    Returns a replay `(a, b, c, pre, bias, scale_a, scale_b) -> None` that issues the same
    launches (and padded copies) for new tensors of the same shapes, strides, dtypes and
    alignment, or None in compile_ahead's thread."""
    a_layout, b_layout = _tma_layout(a, (batch, M, K), a_strides), _tma_layout(b, (batch, K, N), b_strides)
    pointer_loads = ((a_layout is None or b_layout is None or M <= POINTER_LOADS_MAX_M)
                     and batch * M * N * K <= POINTER_LOADS_MAX_WORK)
    # Operands that TMA cannot read in place are copied padded, anew each call (copy_a(a)).
    copy_a = copy_b = None
    a_trans = b_trans = False
    if not pointer_loads:
        if a_layout is None:
            a, copy_a = _padded_copy(a, (batch, M, K), a_strides)
            a_strides = a.stride()
        else:
            a_strides, a_trans = a_layout
        if b_layout is None:
            b, copy_b = _padded_copy(b, (batch, K, N), b_strides)
            b_strides = b.stride()
        else:
            b_strides, b_trans = b_layout
    split_k = _split_k(M, N, K, batch, a.device)
    if not pointer_loads and copy_a is None and copy_b is None and _split_inside_fits(
            a, batch, M, N, K, split_k, scale_a is not None or scale_b is not None):
        return _launch_split_inside(a, a_strides, a_trans, b, b_strides, b_trans, c, c_strides, pre, M, N, K, bias,
                                    activation, negative_slope)
    # Split-K's arrival counters, one a tile: 16 x 16 tiles bound every config's tile count.
    counters_needed = runtime.cdiv(M, 16) * runtime.cdiv(N, 16) if split_k > 1 else 0

    scale_a_mode, scale_b_mode = _scale_mode(scale_a), _scale_mode(scale_b)
    element_size = a.element_size()

    def grid(meta):
        tiles = batch * split_k * runtime.cdiv(M, meta["BLOCK_M"]) * runtime.cdiv(N, meta["BLOCK_N"])
        return (min(tiles, runtime.num_sms(a.device.index or 0) * _programs_per_sm(meta, element_size)),)

    scalars = (batch, M, N, K, *a_strides, *b_strides, *c_strides, negative_slope)

    def main_args(a, b, c, pre, bias, scale_a, scale_b):
        # Absent tensors are passed as c: the kernel never reads them (their flags are off).
        scratch = runtime.split_k_scratch(c, split_k, split_k * M * N, counters_needed)
        return (a, b, c, c if pre is None else pre, *scratch, c if bias is None else bias,
                c if scale_a is None else scale_a, c if scale_b is None else scale_b, *scalars)

    def descriptors(a, b, config):
        return (_host_descriptor(a, (batch, M, K), a_strides, a_trans, config["BLOCK_M"], config["BLOCK_K"]),
                _host_descriptor(b, (batch, K, N), b_strides, b_trans, config["BLOCK_K"], config["BLOCK_N"]))

    # The tuning key. Sizes go in by power-of-two bucket: the token count (M, or K in a weight
    # gradient) changes from batch to batch in training with padding or packing, and tuning takes
    # about a second of timing a size. The epilogue is in it: an erf-GELU on a 128x256 float32
    # tile needs other tiles than none.
    key = (*map(runtime.next_power_of_2, (batch, M, N, K)), split_k, a_trans, b_trans, a.dtype, bias is not None,
           activation, pre is not None, pointer_loads)
    constexprs = dict(
        A_TRANS=a_trans, B_TRANS=b_trans, SPLIT_K=split_k, HAS_BIAS=bias is not None, ACTIVATION=activation,
        SCALE_A=scale_a_mode, SCALE_B=scale_b_mode, STORE_PRE=pre is not None,
        UPCAST=runtime.INTERPRET and a.dtype == torch.bfloat16, INPUT_PRECISION=_input_precision(a.dtype),
        POINTER_LOADS=pointer_loads,
    )
    main = _launch_matmul(
        key, grid, *main_args(a, b, c, pre, bias, scale_a, scale_b), **constexprs,
        fitted=None if pointer_loads else lambda config: (
            main_args(*descriptors(a, b, config), c, pre, bias, scale_a, scale_b), constexprs))
    if main is None:
        return None
    main_entry, main_grid = main
    if pointer_loads:
        def replay(a, b, c, pre, bias, scale_a, scale_b):
            _launch_matmul.launch.replay(main_entry, main_grid, *main_args(a, b, c, pre, bias, scale_a, scale_b))

        return replay
    a_desc, b_desc = descriptors(a, b, _launch_matmul.chosen[key])

    def replay(a, b, c, pre, bias, scale_a, scale_b):
        a = a if copy_a is None else copy_a(a)
        b = b if copy_b is None else copy_b(b)
        _launch_matmul.launch.replay(main_entry, main_grid, *main_args(
            runtime.rebased(a_desc, a), runtime.rebased(b_desc, b), c, pre, bias, scale_a, scale_b))

    return replay


# Products of few output tiles that split-K would cover, 16-bit, on Hopper: _split_inside_kernel,
# (BLOCK_M, BLOCK_N, BLOCK_K, STAGES a half of K). scripts/probe_split_cta_matmul.py (H100, bf16,
# GPU time from a cold L2): 128x4096^2 18.7 us against the Triton kernel's 21.1 (64 x 64 at split
# 2) and cuBLAS's 18.5; 1024^3, one 64 x 128 tile an SM unsplit, loses every way (9.2-14 against 8.1).
SPLIT_INSIDE_SHAPE = (64, 64, 64, 6)


def _split_inside_fits(a: torch.Tensor, batch: int, M: int, N: int, K: int, split_k: int, scaled: bool) -> bool:
    """Hopper, 16-bit operands, one matrix that _split_k splits, its tiles between half the SMs
    and all of them (one program an SM: 2 x 6 stages take 213 KiB of shared memory), and each
    half of K at least a ring of steps."""
    if runtime.INTERPRET or batch != 1 or split_k == 1 or scaled or a.dtype not in (torch.float16, torch.bfloat16):
        return False
    bm, bn, bk, stages = SPLIT_INSIDE_SHAPE
    sms = runtime.num_sms(a.device.index or 0)
    tiles = runtime.cdiv(M, bm) * runtime.cdiv(N, bn)
    return runtime.capability(a.device.index or 0) == (9, 0) and sms // 2 < tiles <= sms and K >= 2 * stages * bk


_launch_split_inside_kernel = runtime.FastLaunch(_split_inside_kernel)


def _launch_split_inside(a, a_strides, a_trans, b, b_strides, b_trans, c, c_strides, pre, M, N, K, bias,
                         activation, negative_slope):
    """_launch for _split_inside_kernel: operands given as _launch gets them (strides of a batch of
    one, transposed flags from _tma_layout). Returns the replay, or None in compile_ahead's thread."""
    bm, bn, bk, stages = SPLIT_INSIDE_SHAPE
    element = gl.bfloat16 if a.dtype == torch.bfloat16 else gl.float16

    def descriptor(t, rows, cols, strides, trans, block_rows, block_cols):
        shape, row_major_strides, block = _row_major(rows, cols, strides[1], strides[2], trans, block_rows, block_cols)
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


def _host_descriptor(t: torch.Tensor, shape: tuple[int, int, int], strides: tuple[int, int, int], trans: bool,
                     block_rows: int, block_cols: int) -> TensorDescriptor:
    """A descriptor of (batch, rows, cols) matrices in (1, block_rows, block_cols) boxes (_row_major)."""
    matrix, matrix_strides, block = _row_major(shape[1], shape[2], strides[1], strides[2], trans, block_rows,
                                               block_cols)
    return TensorDescriptor(t, [shape[0], *matrix], [strides[0], *matrix_strides], [1, *block])


def _row_major(rows: int, cols: int, stride_r: int, stride_c: int, trans: bool, block_rows: int,
               block_cols: int) -> tuple[list[int], list[int], list[int]]:
    """(shape, strides, box) of a (rows, cols) matrix as TMA reads it: over the transposed (cols,
    rows) layout when `trans` (a column-major matrix: TMA wants the last stride to be 1; the kernel
    permutes the tile in shared memory)."""
    if trans:
        return [cols, rows], [stride_c, stride_r], [block_cols, block_rows]
    return [rows, cols], [stride_r, stride_c], [block_rows, block_cols]


def _output_shape(a: torch.Tensor, b: torch.Tensor) -> tuple[int, ...]:
    # torch.broadcast_shapes costs ~15 us a call; 2-D b and equal batch dims need none of it.
    if b.dim() == 2 or a.shape[:-2] == b.shape[:-2]:
        batch = a.shape[:-2]
    else:
        batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    return (*batch, a.shape[-2], b.shape[-1])


def _out_dtype(a: torch.Tensor, out_dtype: torch.dtype | None) -> torch.dtype:
    if out_dtype is not None:
        return out_dtype
    return torch.bfloat16 if a.dtype == FP8 else a.dtype


def _fake_matmul_fwd(a, b, bias, scale_a, scale_b, activation, negative_slope, out_dtype, store_pre):
    out = a.new_empty(_output_shape(a, b), dtype=_out_dtype(a, out_dtype))
    return out, (torch.empty_like(out) if store_pre else out.new_empty(0))


@runtime.custom_op("matmul_fwd", fake=_fake_matmul_fwd)
def matmul_fwd(
    a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, scale_a: torch.Tensor | None,
    scale_b: torch.Tensor | None, activation: int, negative_slope: float, out_dtype: torch.dtype | None,
    store_pre: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, pre-activation or an empty tensor). `activation` is a code from ACTIVATIONS.

    The first call with a given signature (shapes, strides, dtypes, alignment, epilogue) plans
    the launches; later ones replay them, which cuts the host time of a call from about 95 to
    about 35 us on the H100 machine (docs/perf-notes.md)."""
    key = _replay_key(a, b, bias, scale_a, scale_b, activation, negative_slope, out_dtype, store_pre)
    planned = _replays.replayable(key)
    if planned is not None:
        shape, dtype, replay = planned
        out = runtime.empty(shape, dtype, a.device)
        pre = runtime.empty(shape, dtype, a.device) if store_pre else out.new_empty(0)
        replay(a, b, out, pre if store_pre else None, bias, scale_a, scale_b)
        return out, pre
    shape = _output_shape(a, b)
    dtype = _out_dtype(a, out_dtype)
    out = runtime.empty(shape, dtype, a.device)
    pre = runtime.empty(shape, dtype, a.device) if store_pre else out.new_empty(0)
    M, K, N = a.shape[-2], a.shape[-1], b.shape[-1]
    if out.numel() == 0:
        return out, pre
    if K == 0:
        _empty_k_epilogue(out, pre if store_pre else None, bias, activation, negative_slope)
        return out, pre
    epilogue = (bias, scale_a, scale_b, activation, negative_slope)
    pre_or_none = pre if store_pre else None
    if b.dim() == 2:
        # Every row of a meets the same b: one (rows, K) x (K, N) product.
        a_op, b_op = (a if a.dim() == 2 else a.reshape(-1, K)), b
        rows = a_op.shape[0]
        replay = _launch(a_op, _one_matrix_strides(a_op), b_op, _one_matrix_strides(b_op), out, (rows * N, N, 1),
                         pre_or_none, 1, rows, N, K, *epilogue)
    else:
        batch = shape[:-2]
        a_op = a.reshape(-1, M, K) if a.shape[:-2] == batch else a.expand(*batch, M, K).reshape(-1, M, K)
        b_op = b.reshape(-1, K, N) if b.shape[:-2] == batch else b.expand(*batch, K, N).reshape(-1, K, N)
        replay = _launch(a_op, a_op.stride(), b_op, b_op.stride(), out, (M * N, N, 1), pre_or_none,
                         a_op.shape[0], M, N, K, *epilogue)
    # A replay passes the caller's tensors: only valid where the operands were views of them.
    if replay is not None and a_op.data_ptr() == a.data_ptr() and b_op.data_ptr() == b.data_ptr():
        _replays.put(key, (shape, dtype, replay))
    return out, pre


_replays = runtime.PlanTable()


def _replay_key(a, b, bias, scale_a, scale_b, activation, negative_slope, out_dtype, store_pre) -> tuple:
    """Everything a planned launch depends on besides the data: shapes, strides, dtypes, device,
    alignment (TMA and Triton's specialization), scale modes, epilogue, the tf32 switch."""
    return (
        a.shape, a.stride(), b.shape, b.stride(), a.dtype, a.device, a.data_ptr() % 16, b.data_ptr() % 16,
        None if bias is None else (bias.dtype, bias.data_ptr() % 16),
        None if scale_a is None else (scale_a.numel(), scale_a.data_ptr() % 16),
        None if scale_b is None else (scale_b.numel(), scale_b.data_ptr() % 16),
        activation, negative_slope, out_dtype, store_pre, torch.backends.cuda.matmul.allow_tf32,
    )


def _empty_k_epilogue(out, pre, bias, activation, negative_slope):
    """A product over K = 0 is all zeros, then the epilogue."""
    acc = torch.zeros(out.shape, dtype=torch.float32, device=out.device)
    if bias is not None:
        acc = acc + bias.float()
    if pre is not None:
        pre.copy_(acc)
    out.copy_(_activation_reference(acc, activation, negative_slope))


def activation_grad(pre: torch.Tensor, dout: torch.Tensor, activation: int, negative_slope: float) -> torch.Tensor:
    """dout * act'(pre), computed in float32 (the derivatives torch's own backward uses)."""
    x, g = pre.float(), dout.float()
    if activation == 1:
        d = (x > 0).float()
    elif activation == 2:
        d = torch.where(x > 0, 1.0, negative_slope)
    elif activation == 3:
        d = 0.5 * (1 + torch.erf(x * 0.7071067811865476)) + x * torch.exp(-0.5 * x * x) * 0.3989422804014327
    elif activation == 4:
        k = 0.7978845608028654
        t = torch.tanh(k * (x + 0.044715 * x**3))
        d = 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * k * (1 + 3 * 0.044715 * x * x)
    elif activation == 5:
        sig = torch.sigmoid(x)
        d = sig * (1 + x * (1 - sig))
    else:
        return dout
    return (g * d).to(dout.dtype)


def _activation_reference(x: torch.Tensor, activation: int, negative_slope: float) -> torch.Tensor:
    F = torch.nn.functional
    if activation == 1:
        return F.relu(x)
    if activation == 2:
        return F.leaky_relu(x, negative_slope)
    if activation == 3:
        return F.gelu(x)
    if activation == 4:
        return F.gelu(x, approximate="tanh")
    if activation == 5:
        return F.silu(x)
    return x


class MatmulFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, bias, scale_a, scale_b, activation, negative_slope, out_dtype):
        needs_grad = any(ctx.needs_input_grad[:3])
        out, pre = matmul_fwd(a, b, bias, scale_a, scale_b, activation, negative_slope, out_dtype,
                              needs_grad and activation != 0)
        ctx.save_for_backward(a, b, pre if activation != 0 else None)
        ctx.activation, ctx.negative_slope, ctx.has_bias = activation, negative_slope, bias is not None
        ctx.bias_dtype = bias.dtype if bias is not None else None
        return out

    @staticmethod
    def backward(ctx, dout):
        a, b, pre = ctx.saved_tensors
        if a.dtype == FP8:
            raise NotImplementedError("matmul has no backward for float8 operands")
        dpre = activation_grad(pre, dout, ctx.activation, ctx.negative_slope) if ctx.activation else dout
        dpre = dpre.to(a.dtype)
        da = db = dbias = None
        if ctx.needs_input_grad[0]:
            da = matmul(dpre, b.mT).sum_to_size(a.shape) if b.dim() > 2 else matmul(dpre, b.mT)
        if ctx.needs_input_grad[1]:
            if b.dim() == 2:
                db = matmul(a.flatten(0, -2).mT, dpre.flatten(0, -2))
            else:
                db = matmul(a.mT, dpre).sum_to_size(b.shape)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            dbias = dpre.flatten(0, -2).sum(0, dtype=torch.float32).to(ctx.bias_dtype)
        return da, db, dbias, None, None, None, None, None


def _check_scale(name: str, scale, length: int, what: str) -> None:
    if scale is None:
        return
    runtime.check_tensor(name, scale, (torch.float32,))
    one_value = scale.numel() == 1
    one_per = scale.numel() == length and sum(d != 1 for d in scale.shape) == 1
    if not (one_value or one_per):
        raise ValueError(f"{name} must hold one value or one per {what} ({length}), got shape {tuple(scale.shape)}")


def matmul(
    a: torch.Tensor,
    b: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
    *,
    negative_slope: float = 0.01,
    scale_a: torch.Tensor | None = None,
    scale_b: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """act((a * scale_a) @ (b * scale_b) + bias).

    a: (..., M, K); b: (K, N) or (..., K, N), same dtype as a (float32, float16, bfloat16 or
    float8_e4m3fn). bias: (N,). activation: None, "relu", "leaky_relu" (negative_slope), "gelu"
    (erf), "gelu_tanh" or "silu". scale_a / scale_b (float32, float8 operands): one value, or one
    per row of a (M) / per column of b (N). out_dtype defaults to a's dtype, bfloat16 for float8.
    """
    runtime.check_tensor("a", a, OPERAND_DTYPES, min_dim=2)
    runtime.check_tensor("b", b, OPERAND_DTYPES, min_dim=2)
    runtime.check_same_device(a=a, b=b, bias=bias, scale_a=scale_a, scale_b=scale_b)
    if a.dtype != b.dtype:
        raise TypeError(f"a and b must have the same dtype, got {a.dtype} and {b.dtype}")
    if a.shape[-1] != b.shape[-2]:
        raise ValueError(f"a of shape {tuple(a.shape)} and b of shape {tuple(b.shape)}: a.shape[-1] must equal b.shape[-2]")
    if b.dim() > 2 and a.shape[:-2] != b.shape[:-2]:
        try:
            torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
        except RuntimeError:
            raise ValueError(f"batch dims of a {tuple(a.shape[:-2])} and b {tuple(b.shape[:-2])} do not broadcast") from None
    N = b.shape[-1]
    if bias is not None:
        runtime.check_tensor("bias", bias, runtime.FLOAT_DTYPES)
        if bias.shape != (N,):
            raise ValueError(f"bias must have shape ({N},), got {tuple(bias.shape)}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {list(ACTIVATIONS)}, got {activation!r}")
    if a.dtype == FP8:
        if b.dim() > 2:
            raise ValueError("float8 matmul takes a 2-D b (K, N); batch the rows of a instead")
        _check_scale("scale_a", scale_a, math.prod(a.shape[:-1]), "row of a")
        _check_scale("scale_b", scale_b, N, "column of b")
        scale_a = scale_a.reshape(-1).contiguous() if scale_a is not None else None
        scale_b = scale_b.reshape(-1).contiguous() if scale_b is not None else None
    elif scale_a is not None or scale_b is not None:
        raise ValueError("scale_a and scale_b apply to float8_e4m3fn operands only")
    if out_dtype is not None and out_dtype not in runtime.FLOAT_DTYPES:
        raise TypeError(f"out_dtype must be one of float32, float16, bfloat16, got {out_dtype}")
    if bias is not None and not bias.is_contiguous():
        bias = bias.contiguous()
    code, slope = ACTIVATIONS[activation], float(negative_slope)
    if torch.is_grad_enabled() and (a.requires_grad or b.requires_grad or bias is not None and bias.requires_grad):
        return MatmulFunction.apply(a, b, bias, scale_a, scale_b, code, slope, out_dtype)
    return matmul_fwd(a, b, bias, scale_a, scale_b, code, slope, out_dtype, False)[0]


def matmul_reference(a, b, bias=None, activation=None, *, negative_slope=0.01, scale_a=None, scale_b=None,
                     out_dtype=None):
    """The same function in PyTorch, computed in a's dtype promoted to at least float32."""
    compute = torch.float64 if a.dtype == torch.float64 else torch.float32
    a, b = a.to(compute), b.to(compute)
    if scale_a is not None:
        a = a * scale_a.to(compute).reshape(*a.shape[:-1], 1) if scale_a.numel() > 1 else a * scale_a.to(compute)
    if scale_b is not None:
        b = b * scale_b.to(compute).reshape(1, -1) if scale_b.numel() > 1 else b * scale_b.to(compute)
    out = a @ b
    if bias is not None:
        out = out + bias.to(compute)
    return _activation_reference(out, ACTIVATIONS[activation], negative_slope)


def _test_cases() -> list[TestCase]:
    def rand(shape, dtype, device, grad=True):
        return torch.randn(shape, device=device).to(dtype).requires_grad_(grad and dtype != FP8)

    def case(id, a_shape, b_shape, dtype, *, bias=False, activation=None, b_transposed=False, a_transposed=False,
             fp8_scales=None, out_dtype=None, gpu_only=False):
        def make(device):
            a = rand(a_shape[:-2] + a_shape[-2:][::-1], dtype, device).mT if a_transposed else rand(a_shape, dtype, device)
            if b_transposed:
                b = rand(b_shape[:-2] + b_shape[-2:][::-1], dtype, device).mT
            else:
                b = rand(b_shape, dtype, device)
            kwargs = {}
            if bias:
                kwargs["bias"] = rand((b_shape[-1],), dtype if dtype != FP8 else torch.bfloat16, device)
            if activation:
                kwargs["activation"] = activation
            if fp8_scales == "tensor":
                kwargs["scale_a"] = torch.rand((), device=device) + 0.5
                kwargs["scale_b"] = torch.rand((), device=device) + 0.5
            elif fp8_scales == "row":
                kwargs["scale_a"] = torch.rand(math.prod(a_shape[:-1]), 1, device=device) + 0.5
                kwargs["scale_b"] = torch.rand(1, b_shape[-1], device=device) + 0.5
            if out_dtype is not None:
                kwargs["out_dtype"] = out_dtype
            return (a, b), kwargs

        expected_dtype = out_dtype or (torch.bfloat16 if dtype == FP8 else dtype)
        tolerance = "fp8" if dtype == FP8 and expected_dtype == torch.float32 else None
        return TestCase(id, make, expected_dtype, grad=dtype != FP8, gpu_only=gpu_only, tolerance=tolerance)

    cases = []
    for dt in (torch.float32, torch.float16, torch.bfloat16):
        name = str(dt).replace("torch.", "")
        cases += [
            case(f"{name}-64x64x64", (64, 64), (64, 64), dt),
            case(f"{name}-odd-37x45x53", (37, 53), (53, 45), dt),
            case(f"{name}-bias-gelu", (40, 48), (48, 72), dt, bias=True, activation="gelu"),
            case(f"{name}-bT", (33, 64), (64, 40), dt, b_transposed=True),
            case(f"{name}-aT-bT", (24, 40), (40, 56), dt, a_transposed=True, b_transposed=True),
            case(f"{name}-batched", (3, 20, 32), (3, 32, 24), dt),
            case(f"{name}-splitk-8x16x2048", (8, 2048), (2048, 16), dt, bias=True, activation="silu"),
            case(f"{name}-1024x1024x1024", (1024, 1024), (1024, 1024), dt, gpu_only=True),
            case(f"{name}-4095x4097x4093", (4095, 4093), (4093, 4097), dt, gpu_only=True),
            case(f"{name}-16x4096x4096", (16, 4096), (4096, 4096), dt, bias=True, gpu_only=True),
            case(f"{name}-batched-8x512x512", (8, 512, 512), (8, 512, 512), dt, gpu_only=True),
        ]
    for act in ("relu", "leaky_relu", "gelu_tanh", "silu"):
        cases.append(case(f"bf16-{act}", (24, 32), (32, 40), torch.bfloat16, bias=True, activation=act))
    cases += [
        case("fp32-3d-a-2d-b", (2, 5, 24), (24, 16), torch.float32, bias=True),
        case("fp32-broadcast-batch", (2, 1, 9, 16), (3, 16, 8), torch.float32),
        case("fp32-k1", (5, 1), (1, 7), torch.float32),
        case("fp8-tensor-scales", (40, 64), (64, 48), FP8, b_transposed=True, fp8_scales="tensor"),
        case("fp8-row-scales-bias", (2, 20, 64), (64, 48), FP8, b_transposed=True, fp8_scales="row", bias=True),
        case("fp8-row-major-b-fp32-out", (32, 64), (64, 32), FP8, fp8_scales="tensor", out_dtype=torch.float32),
        case("fp8-4096x4096x4096", (4096, 4096), (4096, 4096), FP8, b_transposed=True, fp8_scales="row",
             gpu_only=True),
    ]
    return cases


MATMUL_SHAPES = [  # (batch, M, N, K)
    (1, 1024, 1024, 1024), (1, 4096, 4096, 4096), (1, 8192, 8192, 8192), (1, 8192, 12288, 4096),
    (1, 8192, 4096, 11008), (1, 16, 4096, 4096), (1, 128, 4096, 4096), (1, 4095, 4097, 4093), (32, 512, 512, 512),
]
QUICK_SHAPES = [(1, 64, 64, 64), (1, 37, 45, 53), (2, 32, 32, 32)]


def _shape_label(batch, M, N, K):
    return f"{batch}x{M}x{N}x{K}" if batch > 1 else f"{M}x{N}x{K}"


def _bench_cases() -> list[BenchCase]:
    cases = []
    dev = runtime.DEVICE
    for dtype in (torch.bfloat16, torch.float16):
        dname = short_dtype(dtype)
        for quick, shapes in ((True, QUICK_SHAPES), (False, MATMUL_SHAPES)):
            for i, (batch, M, N, K) in enumerate(shapes):
                def setup(batch=batch, M=M, N=N, K=K, dtype=dtype):
                    lead = (batch,) if batch > 1 else ()
                    a = torch.randn(*lead, M, K, device=dev, dtype=dtype)
                    b = torch.randn(*lead, K, N, device=dev, dtype=dtype)
                    return Bench(
                        providers={"tritonformer": lambda: matmul(a, b), "cuBLAS": lambda: torch.matmul(a, b)},
                        reference=lambda: torch.matmul(a.float(), b.float()),
                    )

                cases.append(BenchCase("matmul", "fwd", dtype, _shape_label(batch, M, N, K), i, setup,
                                       flops=2 * batch * M * N * K, plot=f"{dname} (x: shape index)", quick=quick))

    for act in ("relu", "gelu", "gelu_tanh", "silu", None):
        for M, N, K in ((64, 64, 64), (4096, 4096, 4096), (8192, 8192, 8192)):
            quick = M == 64

            def setup_act(M=M, N=N, K=K, act=act):
                a = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
                b = torch.randn(K, N, device=dev, dtype=torch.bfloat16)
                bias = torch.randn(N, device=dev, dtype=torch.bfloat16)
                code = ACTIVATIONS[act]

                def cublas_then_torch():
                    return _activation_reference(torch.addmm(bias, a, b), code, 0.01)

                def fused_reference():
                    return matmul_reference(a, b, bias, act)

                return Bench(
                    providers=peers.available({
                        "tritonformer": lambda: matmul(a, b, bias, act),
                        "cuBLAS+torch": cublas_then_torch,
                        "torch.compile": peers.compiled(fused_reference),
                    }),
                    reference=fused_reference,
                )

            cases.append(BenchCase("matmul", "fwd", torch.bfloat16, f"{M}x{N}x{K} bias+{act or 'none'}", M, setup_act,
                                   flops=2 * M * N * K, plot=f"bf16 bias+{act or 'none'}", quick=quick))

    for M, N, K in ((64, 64, 64), (4096, 4096, 4096), (8192, 8192, 8192)):
        def setup_fp8(M=M, N=N, K=K):
            a = torch.randn(M, K, device=dev).to(FP8)
            b = torch.randn(N, K, device=dev).to(FP8).t()
            scale_a = torch.rand(M, 1, device=dev) + 0.5
            scale_b = torch.rand(1, N, device=dev) + 0.5
            providers = {"tritonformer": lambda: matmul(a, b, scale_a=scale_a, scale_b=scale_b)}
            if not runtime.INTERPRET:
                providers["torch._scaled_mm"] = lambda: torch._scaled_mm(a, b, scale_a, scale_b, out_dtype=torch.bfloat16)
            return Bench(providers=providers,
                         reference=lambda: matmul_reference(a, b, scale_a=scale_a, scale_b=scale_b))

        # The bf16 output, rounded once, is what the check holds to a tolerance.
        cases.append(BenchCase("matmul", "fwd", FP8, f"{M}x{N}x{K} rowwise", M, setup_fp8, flops=2 * M * N * K,
                               plot="fp8 e4m3 row-wise scales", quick=M == 64, tolerance=torch.bfloat16))

    for M, N, K in ((64, 64, 64), (4096, 4096, 4096)):
        def setup_bwd(M=M, N=N, K=K):
            a = torch.randn(M, K, device=dev, dtype=torch.bfloat16, requires_grad=True)
            b = torch.randn(K, N, device=dev, dtype=torch.bfloat16, requires_grad=True)
            dout = torch.randn(M, N, device=dev, dtype=torch.bfloat16)

            def run(fn):
                return lambda: torch.autograd.grad(fn(a, b), (a, b), dout)

            return Bench(providers={"tritonformer": run(matmul), "cuBLAS": run(torch.matmul)},
                         reference=lambda: (dout.double() @ b.double().T, a.double().T @ dout.double()))

        cases.append(BenchCase("matmul", "fwd+bwd", torch.bfloat16, f"{M}x{N}x{K}", M, setup_bwd,
                               flops=3 * 2 * M * N * K, plot="bf16 forward+backward", quick=M == 64))
    return cases


SPEC = OpSpec(
    name="matmul",
    fn=matmul,
    reference=matmul_reference,
    test_cases=_test_cases,
    bench_cases=_bench_cases,
    compare="norm",
)
