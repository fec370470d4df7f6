"""Matrix product with a fused epilogue: out = act((a * scale_a) @ (b * scale_b) + bias).

a (..., M, K); b (K, N) or (..., K, N), batch dims broadcasting. Operands float32, float16, bfloat16
or float8_e4m3fn (with per-tensor or per-row/column float32 scales); float32 accumulation, tf32
exactly when torch allows it. Backward (float operands): dpre = dout * act'(pre), da = dpre @ b^T,
db = a^T @ dpre, dbias = sum of dpre over rows, on the same kernel, transposes read in place.

One persistent Triton kernel takes every shape (_matmul_kernel): tiles in grouped order, operands
read in place through tensor descriptors (TMA), an operand TMA cannot read copied padded first,
except in small products (POINTER_LOADS_MAX_WORK, POINTER_LOADS_MAX_M), read by masked pointer
loads. Too few output tiles to fill the GPU split K, the last split adding the partials up; on
Hopper, 16-bit products of that kind split K inside a program instead (split_inside.py, Gluon).
Design and measurements: docs/matmul.md.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from ... import runtime
from ..gemm import (ACTIVATIONS, SCALE_NONE, SCALE_TENSOR, SCALE_VECTOR, epilogue_store, grouped_tile,
                    host_descriptor, load_tile, one_matrix_strides, programs_per_sm, split_k_total,
                    tma_layout)
from . import split_inside

FP8 = torch.float8_e4m3fn
OPERAND_DTYPES = (torch.float32, torch.float16, torch.bfloat16, FP8)
# Split K only when fewer output tiles than this fraction of the SMs would run.
SPLIT_K_MAX = 8
SPLIT_K_MIN_K_PER_SPLIT = 512
# Up to this many multiply-adds (batch M N K) an operand that TMA cannot read is read with pointer
# loads instead of being copied into a padded buffer first.
POINTER_LOADS_MAX_WORK = 2**28
# So are both operands of a product that small with at most this many rows: 12-28 us less host
# time at no GPU cost (16x4096^2: 17.7 against 18.7 us); at 128 rows pointer loads lose (59 against 38).
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
    # a_ptr and b_ptr are tensor descriptors made on the host (host_descriptor), or with
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
                a = load_tile(a_ptr, batch, off_m, off_k, BLOCK_M, BLOCK_K, A_TRANS)
                b = load_tile(b_ptr, batch, off_k, off_n, BLOCK_K, BLOCK_N, B_TRANS)
            if UPCAST:
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)

        finish = True
        if SPLIT_K > 1:
            # Split-K runs only on a batch of one (_split_k), so t names the tile.
            finish, acc = split_k_total(acc, ws_ptr, counter_ptr, t, split, rm, rn, M, N, SPLIT_K)
        if finish:
            epilogue_store(
                acc, rm, rn, M, N, c_ptr + batch.to(tl.int64) * stride_cb, pre_ptr + batch.to(tl.int64) * stride_cb,
                stride_cm, stride_cn, bias_ptr, scale_a_ptr, scale_b_ptr, negative_slope,
                HAS_BIAS, ACTIVATION, SCALE_A, SCALE_B, STORE_PRE,
            )


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


_launch_matmul = runtime.TunedLauncher(_matmul_kernel)


def launch_strided(a, a_strides, b, b_strides, c, c_strides, pre, batch: int, M: int, N: int, K: int,
                   bias, scale_a, scale_b, activation: int, negative_slope: float):
    """c[i] = epilogue(a[i] @ b[i]) for i < batch over (batch, M, K) x (batch, K, N) matrices given
    by base tensors and strides; pre, when given, shares c's strides. Picks the path (pointer loads
    or TMA, padded copies, split-K, split_inside) and launches it; scaled_matmul's dequantize-first
    path calls it too.

    Returns a replay `(a, b, c, pre, bias, scale_a, scale_b) -> None` that issues the same
    launches (and padded copies) for new tensors of the same shapes, strides, dtypes and
    alignment, or None in compile_ahead's thread."""
    a_layout, b_layout = tma_layout(a, (batch, M, K), a_strides), tma_layout(b, (batch, K, N), b_strides)
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
    if not pointer_loads and copy_a is None and copy_b is None and split_inside.fits(
            a, batch, M, N, K, split_k, scale_a is not None or scale_b is not None):
        return split_inside.launch(a, a_strides, a_trans, b, b_strides, b_trans, c, c_strides, pre, M, N, K, bias,
                                   activation, negative_slope)
    # Split-K's arrival counters, one a tile: 16 x 16 tiles bound every config's tile count.
    counters_needed = runtime.cdiv(M, 16) * runtime.cdiv(N, 16) if split_k > 1 else 0

    scale_a_mode, scale_b_mode = _scale_mode(scale_a), _scale_mode(scale_b)
    element_size = a.element_size()

    def grid(meta):
        tiles = batch * split_k * runtime.cdiv(M, meta["BLOCK_M"]) * runtime.cdiv(N, meta["BLOCK_N"])
        return (min(tiles, runtime.num_sms(a.device.index or 0) * programs_per_sm(meta, element_size)),)

    scalars = (batch, M, N, K, *a_strides, *b_strides, *c_strides, negative_slope)

    def main_args(a, b, c, pre, bias, scale_a, scale_b):
        # Absent tensors are passed as c: the kernel never reads them (their flags are off).
        scratch = runtime.split_k_scratch(c, split_k, split_k * M * N, counters_needed)
        return (a, b, c, c if pre is None else pre, *scratch, c if bias is None else bias,
                c if scale_a is None else scale_a, c if scale_b is None else scale_b, *scalars)

    def descriptors(a, b, config):
        return (host_descriptor(a, (batch, M, K), a_strides, a_trans, config["BLOCK_M"], config["BLOCK_K"]),
                host_descriptor(b, (batch, K, N), b_strides, b_trans, config["BLOCK_K"], config["BLOCK_N"]))

    # The tuning key. Sizes go in by power-of-two bucket: the token count (M, or K in a weight
    # gradient) changes from batch to batch in training with padding or packing, and tuning takes
    # about a second of timing a size. The epilogue is in it: an erf-GELU on a 128x256 float32
    # tile needs other tiles than none.
    key = (*map(runtime.next_power_of_2, (batch, M, N, K)), split_k, a_trans, b_trans, a.dtype, bias is not None,
           activation, pre is not None, pointer_loads)
    constexprs = dict(
        A_TRANS=a_trans, B_TRANS=b_trans, SPLIT_K=split_k, HAS_BIAS=bias is not None, ACTIVATION=activation,
        SCALE_A=scale_a_mode, SCALE_B=scale_b_mode, STORE_PRE=pre is not None,
        UPCAST=runtime.INTERPRET and a.dtype == torch.bfloat16, INPUT_PRECISION=runtime.input_precision(a.dtype),
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
@runtime.planned(key=runtime.tf32_switch)
def matmul_fwd(
    a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, scale_a: torch.Tensor | None,
    scale_b: torch.Tensor | None, activation: int, negative_slope: float, out_dtype: torch.dtype | None,
    store_pre: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, pre-activation or an empty tensor). `activation` is a code from ACTIVATIONS.

    Planned (runtime.planned): a replay cuts the host time of a call from about 95 to about 35 us
    on the H100 machine (docs/matmul.md)."""
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
        replay = launch_strided(a_op, one_matrix_strides(a_op), b_op, one_matrix_strides(b_op), out,
                                (rows * N, N, 1), pre_or_none, 1, rows, N, K, *epilogue)
    else:
        batch = shape[:-2]
        a_op = a.reshape(-1, M, K) if a.shape[:-2] == batch else a.expand(*batch, M, K).reshape(-1, M, K)
        b_op = b.reshape(-1, K, N) if b.shape[:-2] == batch else b.expand(*batch, K, N).reshape(-1, K, N)
        replay = launch_strided(a_op, a_op.stride(), b_op, b_op.stride(), out, (M * N, N, 1), pre_or_none,
                                a_op.shape[0], M, N, K, *epilogue)
    # A replay passes the caller's tensors: only valid where the operands were views of them.
    if replay is not None and a_op.data_ptr() == a.data_ptr() and b_op.data_ptr() == b.data_ptr():
        runtime.keep_plan(functools.partial(_replay_fwd, shape, dtype, replay))
    return out, pre


def _replay_fwd(shape, dtype, replay, a, b, bias, scale_a, scale_b, activation, negative_slope, out_dtype, store_pre):
    out = runtime.empty(shape, dtype, a.device)
    pre = runtime.empty(shape, dtype, a.device) if store_pre else out.new_empty(0)
    replay(a, b, out, pre if store_pre else None, bias, scale_a, scale_b)
    return out, pre


def _empty_k_epilogue(out, pre, bias, activation, negative_slope):
    """A product over K = 0 is all zeros, then the epilogue."""
    acc = torch.zeros(out.shape, dtype=torch.float32, device=out.device)
    if bias is not None:
        acc = acc + bias.float()
    if pre is not None:
        pre.copy_(acc)
    out.copy_(activation_reference(acc, activation, negative_slope))


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


def activation_reference(x: torch.Tensor, activation: int, negative_slope: float) -> torch.Tensor:
    """act(x) in PyTorch for a code of ACTIVATIONS: what the epilogue computes."""
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
        a, b, pre = ctx.saved_tensors  # never float8: matmul refuses float8 inputs that need a gradient
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
        runtime.check_no_grad("float8 matmul", a=a, b=b, scale_a=scale_a, scale_b=scale_b, bias=bias)
    elif scale_a is not None or scale_b is not None:
        raise ValueError("scale_a and scale_b apply to float8_e4m3fn operands only")
    if out_dtype is not None and out_dtype not in runtime.FLOAT_DTYPES:
        raise TypeError(f"out_dtype must be one of float32, float16, bfloat16, got {out_dtype}")
    if bias is not None and not bias.is_contiguous():
        bias = bias.contiguous()
    code, slope = ACTIVATIONS[activation], float(negative_slope)
    if torch.is_grad_enabled() and (a.requires_grad or b.requires_grad or bias is not None and bias.requires_grad):
        return runtime.apply(MatmulFunction, a, b, bias, scale_a, scale_b, code, slope, out_dtype)
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
    return activation_reference(out, ACTIVATIONS[activation], negative_slope)
