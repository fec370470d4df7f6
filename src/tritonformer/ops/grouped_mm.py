"""Grouped matrix product, the experts' product of a mixture-of-experts layer:

    out[rows of group g] = a[rows of group g] @ b[g]

a (M, K) holds the rows of every group one group after another; b (E, K, N), any strides (HF's
(E, N, K) expert weights go in as w.transpose(1, 2), read in place); offs (E,) int32 or int64,
the groups' cumulative row ends, as torch._grouped_mm takes them: group g is rows
[offs[g - 1], offs[g]) (0 before the first), non-decreasing as a routing's counts make them. Rows
past offs[E - 1] come out zero. The offsets stay on the device (no host synchronisation): ends are
clamped to [0, M], so that decreasing offsets give unspecified rows, never an access out of
bounds.

The forward kernel is persistent: each program walks the output tiles of every group, group
after group (a prefix sum of the E groups' tile counts, taken once a program, names a tile's
group), in grouped order within a group, operands through TMA (tensor descriptors) where their
layout allows, masked pointer loads otherwise. Backward: da = the same kernel on dout and b^T;
db[g] = a_g^T @ dout_g, one program per (group, K tile, N tile) summing its group's rows in order
(deterministic, no atomics; a group with no rows gets zeros). Design: docs/moe.md.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import runtime
from .gemm import grouped_tile, host_descriptor, load_tile, one_matrix_strides, programs_per_sm, tma_layout

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Row indices are int32 in the kernels, a tile past the last row included.
MAX_ROWS = 2**31 - 1024


def _configs(*tiles: tuple[int, int, int, int, int]) -> list[triton.Config]:
    """Configs of (BLOCK_M, BLOCK_N, BLOCK_K, stages, warps); the interpreter runs one small tile
    (fewer programs)."""
    if runtime.INTERPRET:
        tiles = ((32, 64, 32, 1, 4),)
    return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk}, num_stages=stages, num_warps=warps)
            for bm, bn, bk, stages, warps in tiles]


FWD_CONFIGS = _configs((128, 256, 64, 3, 8), (128, 256, 64, 4, 8), (256, 128, 64, 3, 8), (128, 128, 64, 4, 8),
                       (128, 128, 128, 3, 8), (64, 256, 64, 4, 4), (64, 128, 64, 4, 4))
# dB: BLOCK_K x BLOCK_N of db a program, its group's rows BLOCK_M at a time. Short row loops (a
# thousand rows a group): the candidates include tiles of which two fit an SM, one's first loads
# and last stores under the other's products; at the Qwen3-30B-A3B shape the tuner still chose
# 64 rows x (128 x 256), one an SM (docs/moe.md).
DB_CONFIGS = _configs((64, 128, 128, 3, 8), (64, 128, 128, 2, 8), (32, 128, 128, 4, 8), (64, 128, 128, 4, 8),
                      (128, 128, 128, 2, 8), (64, 256, 128, 3, 8), (64, 128, 64, 4, 4))


def _prune(configs, named_args, **kwargs):
    """Tiles whose stages fit 220 KiB of shared memory in the operands' dtype (float32: the
    smallest tiles); a stage holds BLOCK_K x (BLOCK_M + BLOCK_N) forward, BLOCK_M x (BLOCK_K +
    BLOCK_N) in the weights' gradient."""
    elt = named_args["a_ptr"].element_size()
    db = "dc_ptr" in named_args

    def stage(kw):
        return kw["BLOCK_M"] * (kw["BLOCK_K"] + kw["BLOCK_N"]) if db else kw["BLOCK_K"] * (kw["BLOCK_M"] + kw["BLOCK_N"])

    kept = [c for c in configs if stage(c.kwargs) * elt * c.num_stages <= 220 * 1024
            and (elt < 4 or min(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"]) <= 64)]
    return kept or configs[-1:]


@triton.jit
def _clamped(row, M):
    """An offset read from offs as an int32 row in [0, M]."""
    return tl.minimum(tl.maximum(row.to(tl.int32), 0), M)


@triton.jit
def group_bounds(offs_ptr, g, M, E):
    """(first row, end row) of group g <= E (group E: the rows past the last end), clamped to [0, M]."""
    end = M
    if g < E:
        end = _clamped(tl.load(offs_ptr + g), M)
    start = 0
    if g > 0:
        start = _clamped(tl.load(offs_ptr + g - 1), M)
    return start, tl.maximum(end, start)


@runtime.autotune(configs=FWD_CONFIGS, prune_configs_by={"early_config_prune": _prune})
@triton.jit
def _grouped_mm_kernel(
    a_ptr, b_ptr, c_ptr, offs_ptr, M, N, K, E,
    stride_am, stride_ak, stride_be, stride_bk, stride_bn, stride_cm, stride_cn,
    B_TRANS: tl.constexpr, POINTER_LOADS: tl.constexpr, UPCAST: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, BLOCK_E: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    # a_ptr and b_ptr are host_descriptors over (1, M, K), row-major, and (E, K, N), or with
    # POINTER_LOADS plain pointers read through their strides, masked.
    # Output tiles of each group, group after group; group E (the rows past the last end) is
    # stored as zeros, so that an output never holds stale memory.
    g = tl.arange(0, BLOCK_E)
    ends = _clamped(tl.load(offs_ptr + g, mask=g < E, other=M), M)
    starts = _clamped(tl.load(offs_ptr + g - 1, mask=(g >= 1) & (g <= E), other=0), M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    tiles = tl.where(g <= E, tl.cdiv(tl.maximum(ends - starts, 0), BLOCK_M), 0) * tiles_n
    tiles_through = tl.cumsum(tiles, 0)  # tiles of groups 0..g
    num_tiles = tl.sum(tiles, 0)
    # Persistent: the tile loop flattens into the K loop, so the next tile's loads start while this
    # one finishes (docs/matmul.md).
    for tile in tl.range(tl.program_id(0), num_tiles, tl.num_programs(0), flatten=True):
        group = tl.sum((tiles_through <= tile).to(tl.int32), 0)
        tiles_before = tl.sum(tl.where(g < group, tiles, 0), 0)
        row_start, row_end = group_bounds(offs_ptr, group, M, E)
        pid_m, pid_n = grouped_tile(tile - tiles_before, tl.cdiv(row_end - row_start, BLOCK_M), tiles_n, GROUP_M)
        off_m = row_start + pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        rm = off_m + tl.arange(0, BLOCK_M)
        rn = off_n + tl.arange(0, BLOCK_N)
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for kt in range(0, tl.cdiv(K, BLOCK_K)):
            off_k = kt * BLOCK_K
            if POINTER_LOADS:
                rk = off_k + tl.arange(0, BLOCK_K)
                a = tl.load(a_ptr + rm.to(tl.int64)[:, None] * stride_am + rk.to(tl.int64)[None, :] * stride_ak,
                            mask=(rm < row_end)[:, None] & (rk < K)[None, :], other=0.0)
                b = tl.load(b_ptr + group.to(tl.int64) * stride_be + rk.to(tl.int64)[:, None] * stride_bk
                            + rn.to(tl.int64)[None, :] * stride_bn,
                            mask=(group < E) & (rk < K)[:, None] & (rn < N)[None, :], other=0.0)
            else:
                # Rows past the group's end are read (the next group's) but never stored; group E
                # reads b past its last matrix, which TMA fills with zeros.
                a = load_tile(a_ptr, 0, off_m, off_k, BLOCK_M, BLOCK_K, False)
                b = load_tile(b_ptr, group, off_k, off_n, BLOCK_K, BLOCK_N, B_TRANS)
            if UPCAST:
                a, b = a.to(tl.float32), b.to(tl.float32)
            acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
        # Group E's rows are zeros whatever a holds there (0 x inf in the products is NaN).
        acc = tl.where(group < E, acc, 0.0)
        c = c_ptr + rm.to(tl.int64)[:, None] * stride_cm + rn[None, :] * stride_cn
        tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=(rm < row_end)[:, None] & (rn < N)[None, :])


@runtime.autotune(configs=DB_CONFIGS, prune_configs_by={"early_config_prune": _prune})
@triton.jit
def _grouped_mm_db_kernel(
    a_desc, dc_desc, a_ptr, dc_ptr, db_ptr, offs_ptr, M, N, K, E,
    stride_am, stride_ak, stride_dcm, stride_dcn, stride_dbe, stride_dbk, stride_dbn,
    POINTER_LOADS: tl.constexpr, UPCAST: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """db[g][k tile, n tile] = the sum over group g's rows, BLOCK_M at a time in order, of
    a_rows^T @ dc_rows. The group's whole blocks of rows come through TMA (a_desc and dc_desc:
    host_descriptors over row-major (1, M, K) and (1, M, N)); the last, partial block (every block with
    POINTER_LOADS) through masked pointer loads, since TMA would read the next group's rows."""
    g = tl.program_id(1)
    tiles_n = tl.cdiv(N, BLOCK_N)
    off_k = (tl.program_id(0) // tiles_n) * BLOCK_K
    off_n = (tl.program_id(0) % tiles_n) * BLOCK_N
    rk = off_k + tl.arange(0, BLOCK_K)
    rn = off_n + tl.arange(0, BLOCK_N)
    start, end = group_bounds(offs_ptr, g, M, E)
    whole_end = start
    acc = tl.zeros((BLOCK_K, BLOCK_N), tl.float32)
    if not POINTER_LOADS:
        whole_end = start + (end - start) // BLOCK_M * BLOCK_M
        for r0 in range(start, whole_end, BLOCK_M):
            a = load_tile(a_desc, 0, r0, off_k, BLOCK_M, BLOCK_K, False)
            dc = load_tile(dc_desc, 0, r0, off_n, BLOCK_M, BLOCK_N, False)
            if UPCAST:
                a, dc = a.to(tl.float32), dc.to(tl.float32)
            acc = tl.dot(tl.trans(a), dc, acc, input_precision=INPUT_PRECISION)
    for r0 in range(whole_end, end, BLOCK_M):
        rm = r0 + tl.arange(0, BLOCK_M)
        row_ok = rm < end
        a = tl.load(a_ptr + rm.to(tl.int64)[:, None] * stride_am + rk.to(tl.int64)[None, :] * stride_ak,
                    mask=row_ok[:, None] & (rk < K)[None, :], other=0.0)
        dc = tl.load(dc_ptr + rm.to(tl.int64)[:, None] * stride_dcm + rn.to(tl.int64)[None, :] * stride_dcn,
                     mask=row_ok[:, None] & (rn < N)[None, :], other=0.0)
        if UPCAST:
            a, dc = a.to(tl.float32), dc.to(tl.float32)
        acc = tl.dot(tl.trans(a), dc, acc, input_precision=INPUT_PRECISION)
    db = (db_ptr + g.to(tl.int64) * stride_dbe + rk.to(tl.int64)[:, None] * stride_dbk
          + rn.to(tl.int64)[None, :] * stride_dbn)
    tl.store(db, acc.to(db_ptr.dtype.element_ty), mask=(rk < K)[:, None] & (rn < N)[None, :])


# Kernels of 0.4-1 ms: 5 + 20 ms of timing a candidate still takes 20-50 samples, and a first MoE
# step's six keys tuned in 5 s at 10 + 40 (docs/moe.md, "Warm-up").
_launch_fwd = runtime.TunedLauncher(_grouped_mm_kernel, tuning_ms=(5, 20))
_launch_db = runtime.TunedLauncher(_grouped_mm_db_kernel, tuning_ms=(5, 20))


# Output tiles in grouped order within a group: GROUP_M rows of tiles share b's columns in L2.
GROUP_M = 8


def _consts(dtype: torch.dtype) -> dict:
    return dict(UPCAST=runtime.INTERPRET and dtype == torch.bfloat16, INPUT_PRECISION=runtime.input_precision(dtype))


def _tune_key(kind: str, dtype: torch.dtype, M: int, N: int, K: int, E: int, consts: dict) -> tuple:
    # Token counts change from batch to batch: tuned once per power-of-two bucket of M.
    return (kind, dtype, runtime.next_power_of_2(max(M, 1)), N, K, E, consts.get("B_TRANS"), consts["POINTER_LOADS"])


def _layouts(row_sliced: tuple, others: tuple = ()):
    """(strides, transposed) of each (tensor, (batch, rows, cols), strides) as TMA reads it in
    place, or None when one of them cannot be (the kernels then use masked pointer loads). The
    row_sliced operands, read from any row where a group starts, must be row-major: a box of a
    column-major one would start at an unaligned address."""
    layouts = []
    for i, (t, shape, strides) in enumerate(row_sliced + others):
        layout = tma_layout(t, shape, strides) if t.numel() else None
        if layout is None or (i < len(row_sliced) and layout[1]):
            return None
        layouts.append(layout)
    return layouts


def _fake_fwd(a, b, offs):
    return a.new_empty((a.shape[0], b.shape[2]))


@runtime.custom_op("grouped_mm_fwd", fake=_fake_fwd)
def grouped_mm_fwd(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """The (M, N) product (inputs checked by grouped_mm)."""
    (M, K), (E, _, N) = a.shape, b.shape
    c = runtime.empty((M, N), a.dtype, a.device)
    if M == 0 or N == 0:
        return c
    a_strides = one_matrix_strides(a)
    layouts = _layouts(((a, (1, M, K), a_strides),), ((b, (E, K, N), b.stride()),))
    element_size = a.element_size()

    def grid(meta):
        tiles = (runtime.cdiv(M, meta["BLOCK_M"]) + E) * runtime.cdiv(N, meta["BLOCK_N"])
        return (min(tiles, runtime.num_sms(a.device.index or 0) * programs_per_sm(meta, element_size)),)

    scalars = (M, N, K, E, *a.stride(), *b.stride(), *c.stride())
    consts = dict(**_consts(a.dtype), B_TRANS=bool(layouts and layouts[1][1]), POINTER_LOADS=layouts is None,
                  BLOCK_E=runtime.next_power_of_2(E + 1), GROUP_M=GROUP_M)

    def fitted(config):
        (a_st, _), (b_st, b_trans) = layouts
        descriptors = (host_descriptor(a, (1, M, K), a_st, False, config["BLOCK_M"], config["BLOCK_K"]),
                       host_descriptor(b, (E, K, N), b_st, b_trans, config["BLOCK_K"], config["BLOCK_N"]))
        return (*descriptors, c, offs, *scalars), consts

    _launch_fwd(_tune_key("fwd", a.dtype, M, N, K, E, consts), grid, a, b, c, offs, *scalars, **consts,
                fitted=None if layouts is None else fitted)
    return c


def _fake_db(a, dc, offs, b):
    return torch.empty_like(b)


@runtime.custom_op("grouped_mm_db", fake=_fake_db)
def grouped_mm_db(a: torch.Tensor, dc: torch.Tensor, offs: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """db (E, K, N), laid out as b: group g's a rows transposed times its dc rows."""
    (M, K), (E, _, N) = a.shape, b.shape
    db = runtime.empty_like(b)  # laid out as a dense b: HF's (E, N, K) weights keep their memory order
    if db.numel() == 0:
        return db
    layouts = _layouts(((a, (1, M, K), one_matrix_strides(a)), (dc, (1, M, N), one_matrix_strides(dc))))
    # Tiles on axis 0 (up to 2^31 - 1 programs; axis 1 takes 65535): a large expert has many.
    grid = lambda meta: (runtime.cdiv(K, meta["BLOCK_K"]) * runtime.cdiv(N, meta["BLOCK_N"]), E)
    scalars = (M, N, K, E, *a.stride(), *dc.stride(), *db.stride())
    consts = dict(**_consts(a.dtype), POINTER_LOADS=layouts is None)

    def fitted(config):
        (a_st, _), (dc_st, _) = layouts
        descriptors = (host_descriptor(a, (1, M, K), a_st, False, config["BLOCK_M"], config["BLOCK_K"]),
                       host_descriptor(dc, (1, M, N), dc_st, False, config["BLOCK_M"], config["BLOCK_N"]))
        return (*descriptors, a, dc, db, offs, *scalars), consts

    _launch_db(_tune_key("db", a.dtype, M, N, K, E, consts), grid, a, dc, a, dc, db, offs, *scalars,
               **consts, fitted=None if layouts is None else fitted)
    return db


class GroupedMMFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, offs):
        ctx.save_for_backward(a, b, offs)
        return grouped_mm_fwd(a, b, offs)

    @staticmethod
    def backward(ctx, dc):
        a, b, offs = ctx.saved_tensors
        da = grouped_mm_fwd(dc, b.transpose(1, 2), offs) if ctx.needs_input_grad[0] else None
        db = grouped_mm_db(a, dc, offs, b) if ctx.needs_input_grad[1] else None
        return da, db, None


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """out (M, N): the rows of group g of a (M, K) times b[g] (b (E, K, N)), group g being rows
    [offs[g - 1], offs[g]) of the non-decreasing cumulative ends offs (E,) (int32 or int64, on a's
    device, read there); rows past offs[E - 1] are zero. a and b share a float dtype; any strides.
    Differentiable in a and b."""
    if a.dim() != 2 or b.dim() != 3:
        raise ValueError(f"grouped_mm takes a (M, K) and b (E, K, N), got a {tuple(a.shape)} and b {tuple(b.shape)}")
    if a.shape[1] != b.shape[1]:
        raise ValueError(f"a's K ({a.shape[1]}) differs from b's ({b.shape[1]})")
    if offs.dim() != 1 or offs.shape[0] != b.shape[0]:
        raise ValueError(f"offs must be (E,) = ({b.shape[0]},), one end a group, got {tuple(offs.shape)}")
    if offs.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"offs must be int32 or int64, got {offs.dtype}")
    if a.dtype not in DTYPES or b.dtype != a.dtype:
        raise TypeError(f"a and b must share a dtype among {DTYPES}, got {a.dtype} and {b.dtype}")
    if b.device != a.device or offs.device != a.device:
        raise ValueError(f"a, b and offs must be on one device, got {a.device}, {b.device}, {offs.device}")
    if a.shape[0] > MAX_ROWS:
        raise ValueError(f"grouped_mm takes at most {MAX_ROWS} rows, got {a.shape[0]}")
    offs = offs.contiguous()  # the kernels read offs densely
    if torch.is_grad_enabled() and (a.requires_grad or b.requires_grad):
        return runtime.apply(GroupedMMFunction, a, b, offs)
    return grouped_mm_fwd(a, b, offs)


def grouped_mm_reference(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """The product group by group in a's dtype (float64 in gives the tests' reference)."""
    out = a.new_zeros((a.shape[0], b.shape[2]))
    start = 0
    for g, end in enumerate(offs.tolist()):
        end = min(max(end, 0), a.shape[0])
        if end > start:
            out[start:end] = a[start:end] @ b[g]
        start = max(end, start)
    return out
