"""Grouped matrix product, the experts' product of a mixture-of-experts layer:

    out[rows of group g] = a[rows of group g] @ b[g]

a (M, K) holds the rows of every group one group after another; b (E, K, N), any strides (HF's
(E, N, K) expert weights go in as w.transpose(1, 2), read in place); offs (E,) int32 or int64,
the groups' cumulative row ends, as torch._grouped_mm takes them: group g is rows
[offs[g - 1], offs[g]) (0 before the first), non-decreasing as a routing's counts make them. Rows
past offs[E - 1] come out zero. The offsets stay on the device (no host synchronisation): ends are
clamped to [0, M], so that decreasing offsets give unspecified rows, never an access out of
bounds.

The forward kernel maps its row-tile axis onto the groups' tiles, group after group, from the
offsets (a prefix sum over the E groups in each program); the grid is sized for the most tiles
any offsets can need (cdiv(M, BLOCK_M) + E), and programs past the last tile exit. Backward:
da = the same kernel on dout and b^T; db[g] = a_g^T @ dout_g, one program per (group, K tile,
N tile) summing its group's rows in order (deterministic, no atomics; a group with no rows gets
zeros). Design: docs/moe.md.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import runtime

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Row indices are int32 in the kernels, a tile past the last row included.
MAX_ROWS = 2**31 - 1024


def _config(bm, bn, bk, stages, warps):
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk}, num_stages=stages, num_warps=warps)


def _fwd_configs():
    if runtime.INTERPRET:
        return [_config(32, 64, 32, 1, 4)]
    return [_config(128, 128, 64, 3, 8), _config(128, 256, 64, 3, 8), _config(64, 128, 64, 4, 4),
            _config(128, 64, 64, 4, 4), _config(64, 64, 64, 4, 4), _config(64, 256, 64, 3, 8)]


def _db_configs():
    """BLOCK_K x BLOCK_N of db a program, its group's rows BLOCK_M at a time."""
    if runtime.INTERPRET:
        return [_config(32, 64, 32, 1, 4)]
    return [_config(64, 128, 128, 3, 8), _config(64, 128, 64, 4, 4), _config(64, 64, 128, 4, 4),
            _config(128, 128, 128, 2, 8), _config(64, 64, 64, 4, 4)]


def _prune(configs, named_args, **kwargs):
    """Tiles that fit 220 KiB of shared memory in the operands' dtype (float32: BLOCK_K <= 32 and
    the smallest ones)."""
    elt = named_args["a_ptr"].element_size()
    kept = [c for c in configs
            if (c.kwargs["BLOCK_M"] + c.kwargs["BLOCK_N"]) * c.kwargs["BLOCK_K"] * elt * c.num_stages <= 220 * 1024
            and (elt < 4 or min(c.kwargs.values()) <= 64)]
    return kept or configs[-1:]


@triton.jit
def _group_bounds(offs_ptr, g, M):
    """(first row, end row) of group g (g < E), from the cumulative ends, clamped to [0, M]."""
    end = tl.minimum(tl.maximum(tl.load(offs_ptr + g).to(tl.int32), 0), M)
    start = 0
    if g > 0:
        start = tl.minimum(tl.maximum(tl.load(offs_ptr + g - 1).to(tl.int32), 0), M)
    return start, tl.maximum(end, start)


@triton.jit
def _row_tile(offs_ptr, pid_m, M, E, BLOCK_E: tl.constexpr, BLOCK_M: tl.constexpr):
    """(group, first row, end row) of the pid_m-th row tile, counting tiles group after group.
    Group E is the rows past the last end (stored as zeros); E + 1 means past every tile."""
    g = tl.arange(0, BLOCK_E)
    end = tl.load(offs_ptr + g, mask=g < E, other=M)
    start = tl.load(offs_ptr + g - 1, mask=(g >= 1) & (g <= E), other=0)
    end = tl.minimum(tl.maximum(end.to(tl.int32), 0), M)
    start = tl.minimum(tl.maximum(start.to(tl.int32), 0), M)
    tiles = tl.where(g <= E, tl.cdiv(tl.maximum(end - start, 0), BLOCK_M), 0)
    last = tl.cumsum(tiles, 0)  # tiles of groups 0..g
    group = tl.sum((last <= pid_m).to(tl.int32), 0)
    before = tl.sum(tl.where(g < group, tiles, 0), 0)
    first_row = tl.sum(tl.where(g == group, start, 0), 0) + (pid_m - before) * BLOCK_M
    return group, first_row, tl.sum(tl.where(g == group, end, 0), 0)


@runtime.autotune(configs=_fwd_configs(), prune_configs_by={"early_config_prune": _prune})
@triton.jit
def _grouped_mm_kernel(
    a_ptr, b_ptr, c_ptr, offs_ptr, M, N, K, E,
    stride_am, stride_ak, stride_be, stride_bk, stride_bn, stride_cm, stride_cn,
    UPCAST: tl.constexpr, INPUT_PRECISION: tl.constexpr, BLOCK_E: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    group, first_row, end_row = _row_tile(offs_ptr, tl.program_id(0), M, E, BLOCK_E, BLOCK_M)
    if group <= E:
        rm = first_row + tl.arange(0, BLOCK_M)
        rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rm < end_row
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        if group < E:
            a_rows = a_ptr + rm.to(tl.int64)[:, None] * stride_am
            b_cols = b_ptr + group.to(tl.int64) * stride_be + rn.to(tl.int64)[None, :] * stride_bn
            for k0 in range(0, K, BLOCK_K):
                rk = k0 + tl.arange(0, BLOCK_K)
                a = tl.load(a_rows + rk.to(tl.int64)[None, :] * stride_ak, mask=row_ok[:, None] & (rk < K)[None, :],
                            other=0.0)
                b = tl.load(b_cols + rk.to(tl.int64)[:, None] * stride_bk, mask=(rk < K)[:, None] & (rn < N)[None, :],
                            other=0.0)
                if UPCAST:
                    a, b = a.to(tl.float32), b.to(tl.float32)
                acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
        c = c_ptr + rm.to(tl.int64)[:, None] * stride_cm + rn[None, :] * stride_cn
        tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & (rn < N)[None, :])


@runtime.autotune(configs=_db_configs(), prune_configs_by={"early_config_prune": _prune})
@triton.jit
def _grouped_mm_db_kernel(
    a_ptr, dc_ptr, db_ptr, offs_ptr, M, N, K,
    stride_am, stride_ak, stride_dcm, stride_dcn, stride_dbe, stride_dbk, stride_dbn,
    UPCAST: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """db[g][k tile, n tile] = the sum over group g's rows, BLOCK_M at a time in order, of
    a_rows^T @ dc_rows."""
    g = tl.program_id(1)
    tiles_n = tl.cdiv(N, BLOCK_N)
    rk = (tl.program_id(0) // tiles_n) * BLOCK_K + tl.arange(0, BLOCK_K)
    rn = (tl.program_id(0) % tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    start, end = _group_bounds(offs_ptr, g, M)
    acc = tl.zeros((BLOCK_K, BLOCK_N), tl.float32)
    for r0 in range(start, end, BLOCK_M):
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


_launch_fwd = runtime.TunedLauncher(_grouped_mm_kernel)
_launch_db = runtime.TunedLauncher(_grouped_mm_db_kernel)


def _consts(dtype: torch.dtype) -> dict:
    return dict(UPCAST=runtime.INTERPRET and dtype == torch.bfloat16, INPUT_PRECISION=runtime.input_precision(dtype))


def _tune_key(kind: str, dtype: torch.dtype, M: int, N: int, K: int, E: int) -> tuple:
    # Token counts change from batch to batch: tuned once per power-of-two bucket of M.
    return (kind, dtype, runtime.next_power_of_2(max(M, 1)), N, K, E)


def _fake_fwd(a, b, offs):
    return a.new_empty((a.shape[0], b.shape[2]))


@runtime.custom_op("grouped_mm_fwd", fake=_fake_fwd)
def grouped_mm_fwd(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """The (M, N) product (inputs checked by grouped_mm)."""
    (M, K), (E, _, N) = a.shape, b.shape
    c = runtime.empty((M, N), a.dtype, a.device)
    if M == 0 or N == 0:
        return c
    grid = lambda meta: (runtime.cdiv(M, meta["BLOCK_M"]) + E, runtime.cdiv(N, meta["BLOCK_N"]))
    _launch_fwd(_tune_key("fwd", a.dtype, M, N, K, E), grid, a, b, c, offs, M, N, K, E, *a.stride(), *b.stride(),
                *c.stride(), **_consts(a.dtype), BLOCK_E=runtime.next_power_of_2(E + 1))
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
    # Tiles on axis 0 (up to 2^31 - 1 programs; axis 1 takes 65535): a large expert has many.
    grid = lambda meta: (runtime.cdiv(K, meta["BLOCK_K"]) * runtime.cdiv(N, meta["BLOCK_N"]), E)
    _launch_db(_tune_key("db", a.dtype, M, N, K, E), grid, a, dc, db, offs, M, N, K, *a.stride(), *dc.stride(),
               *db.stride(), **_consts(a.dtype))
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
