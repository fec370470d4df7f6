"""Elementwise add with broadcasting: out = x + y.

Backward: dx = sum of dout over x's broadcast dimensions, likewise dy.
Inputs of any strides are read in place when their broadcast view collapses to at most
four dimensions; beyond that they are copied to contiguous first.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .. import runtime

DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.int32)
MAX_STRIDED_DIMS = 4


@triton.jit
def _add_fwd_kernel(
    x_ptr, y_ptr, out_ptr, n,
    size1, size2, size3,
    x_stride0, x_stride1, x_stride2, x_stride3,
    y_stride0, y_stride1, y_stride2, y_stride3,
    CONTIGUOUS: tl.constexpr, INDEX_64: tl.constexpr, IS_FLOAT: tl.constexpr, BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    if INDEX_64:
        pid = pid.to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    if CONTIGUOUS:
        x_offs = offs
        y_offs = offs
    else:
        i3 = offs % size3
        rest = offs // size3
        i2 = rest % size2
        rest = rest // size2
        i1 = rest % size1
        i0 = rest // size1
        x_offs = i0 * x_stride0 + i1 * x_stride1 + i2 * x_stride2 + i3 * x_stride3
        y_offs = i0 * y_stride0 + i1 * y_stride1 + i2 * y_stride2 + i3 * y_stride3
    x = tl.load(x_ptr + x_offs, mask=mask)
    y = tl.load(y_ptr + y_offs, mask=mask)
    if IS_FLOAT:
        out = x.to(tl.float32) + y.to(tl.float32)
    else:
        out = x.to(tl.int32) + y.to(tl.int32)
    tl.store(out_ptr + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def collapse_dims(shape: tuple[int, ...], *strides: tuple[int, ...]) -> tuple[list[int], list[list[int]]]:
    """Merge neighbouring dimensions that every stride tuple walks as one, and drop size-1 ones.
    Returns the smallest equivalent (shape, strides) description of the same elements."""
    dims = [i for i, s in enumerate(shape) if s != 1]
    out_shape: list[int] = []
    out_strides: list[list[int]] = [[] for _ in strides]
    for i in dims:
        if out_shape and all(st[-1] == s[i] * shape[i] for st, s in zip(out_strides, strides)):
            out_shape[-1] *= shape[i]
            for st, s in zip(out_strides, strides):
                st[-1] = s[i]
        else:
            out_shape.append(shape[i])
            for st, s in zip(out_strides, strides):
                st.append(s[i])
    return out_shape, out_strides


def result_dtype(x: torch.Tensor, y: torch.Tensor) -> torch.dtype:
    """torch.result_type for two tensors, in a form torch.compile traces: a 0-dim tensor takes part
    in the promotion only when it is of a higher category (float over integer) than the other."""
    if (x.dim() == 0) != (y.dim() == 0):
        full, zero_dim = (y, x) if x.dim() == 0 else (x, y)
        if zero_dim.is_floating_point() and not full.is_floating_point():
            return zero_dim.dtype
        return full.dtype
    return torch.promote_types(x.dtype, y.dtype)


def _fake_add_fwd(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return x.new_empty(torch.broadcast_shapes(x.shape, y.shape), dtype=result_dtype(x, y))


_launch_add = runtime.FastLaunch(_add_fwd_kernel)
BLOCK = 4096


@runtime.custom_op("add_fwd", fake=_fake_add_fwd)
@runtime.planned
def add_fwd(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """x + y, broadcast. Planned (runtime.planned): at small sizes host time is the op's time."""
    out_shape = x.shape if x.shape == y.shape else torch.broadcast_shapes(x.shape, y.shape)
    out = runtime.empty(out_shape, result_dtype(x, y), x.device)
    n = out.numel()
    if n == 0:
        return out
    xe, ye = x.expand(out_shape), y.expand(out_shape)
    sizes, (xs, ys) = collapse_dims(tuple(out_shape), xe.stride(), ye.stride())
    contiguous = xe.is_contiguous() and ye.is_contiguous()
    copied = not contiguous and len(sizes) > MAX_STRIDED_DIMS
    if copied:
        xe, ye = xe.contiguous(), ye.contiguous()
        contiguous = True
    if contiguous:
        sizes, xs, ys = [n], [1], [1]
    pad = MAX_STRIDED_DIMS - len(sizes)
    sizes, xs, ys = [1] * pad + sizes, [0] * pad + xs, [0] * pad + ys
    grid, scalars = (runtime.cdiv(n, BLOCK),), (n, sizes[1], sizes[2], sizes[3], *xs, *ys)
    entry = _launch_add(grid, xe, ye, out, *scalars, CONTIGUOUS=contiguous, INDEX_64=runtime.needs_int64(out, xe, ye),
                        IS_FLOAT=out.dtype.is_floating_point, BLOCK=BLOCK, num_warps=8)
    if entry is not None and not copied:
        runtime.keep_plan(functools.partial(_replay, out_shape, out.dtype, entry, grid, scalars))
    return out


def _replay(out_shape, dtype, entry, grid, scalars, x, y):
    out = runtime.empty(out_shape, dtype, x.device)
    _launch_add.replay(entry, grid, x, y, out, *scalars)
    return out


class AddFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, y):
        ctx.shapes = (x.shape, y.shape)
        ctx.dtypes = (x.dtype, y.dtype)
        return add_fwd(x, y)

    @staticmethod
    def backward(ctx, dout):
        grads = []
        for shape, dtype, needed in zip(ctx.shapes, ctx.dtypes, ctx.needs_input_grad):
            grads.append(dout.sum_to_size(shape).to(dtype) if needed else None)
        return tuple(grads)


def add(x: torch.Tensor, y: torch.Tensor | float | int) -> torch.Tensor:
    """x + y with broadcasting, for float32, float16, bfloat16 and int32 (torch's type promotion)."""
    runtime.check_tensor("x", x, DTYPES)
    if not isinstance(y, torch.Tensor):
        if not isinstance(y, (int, float)) or isinstance(y, bool):
            raise TypeError(f"y must be a torch.Tensor or a Python number, got {type(y).__name__}")
        # torch's promotion of a Python number (torch.result_type does not trace under torch.compile);
        # an int out of int32's range wraps, as torch's add does.
        dtype = torch.get_default_dtype() if isinstance(y, float) and not x.is_floating_point() else x.dtype
        if dtype == torch.int32 and isinstance(y, int):
            y = (y + 2**31) % 2**32 - 2**31
        y = torch.tensor(y, dtype=dtype, device=x.device)
    runtime.check_tensor("y", y, DTYPES)
    runtime.check_same_device(x=x, y=y)
    if x.shape != y.shape:
        try:
            torch.broadcast_shapes(x.shape, y.shape)
        except RuntimeError:
            raise ValueError(f"x of shape {tuple(x.shape)} and y of shape {tuple(y.shape)} do not broadcast") from None
    if result_dtype(x, y) not in DTYPES:
        raise TypeError(f"x + y would have dtype {result_dtype(x, y)}, which add does not support")
    if torch.is_grad_enabled() and (x.requires_grad or y.requires_grad):
        return runtime.apply(AddFunction, x, y)
    return add_fwd(x, y)


def add_reference(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return x + y
