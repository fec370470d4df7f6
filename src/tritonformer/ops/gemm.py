"""What matmul, scaled_matmul and grouped_mm share: the fused epilogue (scales, bias, activation,
store), the grouped tile order, split-K's in-kernel sum of partials, and the host's stride, TMA
layout and descriptor helpers and replay key of a planned product. See docs/matmul.md."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from .. import runtime

# Codes of epilogue_store's ACTIVATION, by the name matmul takes.
ACTIVATIONS = {None: 0, "relu": 1, "leaky_relu": 2, "gelu": 3, "gelu_tanh": 4, "silu": 5}
# Codes of epilogue_store's SCALE_A / SCALE_B: none, one value, one a row of a / column of b.
SCALE_NONE, SCALE_TENSOR, SCALE_VECTOR = 0, 1, 2


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
    registers with spills (docs/matmul.md)."""
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
def epilogue_store(
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
def load_tile(desc, batch, off_r, off_c, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, TRANS: tl.constexpr):
    """The (BLOCK_R, BLOCK_C) tile at (off_r, off_c) of matrix `batch` of a host_descriptor; one over
    the transposed layout (TRANS) is read as such and permuted in shared memory."""
    if TRANS:
        tile = desc.load([batch, off_c, off_r]).reshape(BLOCK_C, BLOCK_R).T
    else:
        tile = desc.load([batch, off_r, off_c]).reshape(BLOCK_R, BLOCK_C)
    return tile


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


def one_matrix_strides(t: torch.Tensor) -> tuple[int, int, int]:
    """Strides of a 2-D tensor seen as a batch of one; the batch stride is the matrix's span, which
    is 16-byte aligned whenever its row or column stride is (TMA wants every stride aligned)."""
    return (max(st * n for st, n in zip(t.stride(), t.shape)), *t.stride())


def row_major(rows: int, cols: int, stride_r: int, stride_c: int, trans: bool, block_rows: int,
               block_cols: int) -> tuple[list[int], list[int], list[int]]:
    """(shape, strides, box) of a (rows, cols) matrix as TMA reads it: over the transposed (cols,
    rows) layout when `trans` (a column-major matrix: TMA wants the last stride to be 1; the kernel
    permutes the tile in shared memory)."""
    if trans:
        return [cols, rows], [stride_c, stride_r], [block_cols, block_rows]
    return [rows, cols], [stride_r, stride_c], [block_rows, block_cols]


def tma_layout(t: torch.Tensor, shape: tuple[int, int, int], strides: tuple[int, int, int]):
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


def host_descriptor(t: torch.Tensor, shape: tuple[int, int, int], strides: tuple[int, int, int], trans: bool,
                    block_rows: int, block_cols: int) -> TensorDescriptor:
    """A descriptor of (batch, rows, cols) matrices in (1, block_rows, block_cols) boxes (row_major)."""
    matrix, matrix_strides, block = row_major(shape[1], shape[2], strides[1], strides[2], trans, block_rows,
                                              block_cols)
    return TensorDescriptor(t, [shape[0], *matrix], [strides[0], *matrix_strides], [1, *block])


def programs_per_sm(meta: dict, element_size: int) -> int:
    """About how many programs of this config fit one SM's shared memory at once: big problems
    get a persistent grid of that size, small ones one program per tile. The grid function sees
    only kernel parameters, not num_stages: 3 stages are assumed (a larger grid only queues)."""
    stage_bytes = (meta["BLOCK_M"] + meta["BLOCK_N"]) * meta["BLOCK_K"] * element_size
    return max(1, (227 * 1024) // (stage_bytes * 3))
