"""Block-scaled matmul: C = A @ B (+ bias), A bf16 or block-scaled, B block-scaled (tritonformer.quant).

    w = quant.quantize(linear.weight, "nvfp4")  # (N, K), quantized along K
    y = scaled_matmul(x, w)                     # x (M, K) bf16 -> x @ w.T, (M, N) bf16

B is stored as (N, K) rows quantized along K: B of logical shape (K, N) quantized along axis 0 gives
A @ B, (N, K) quantized along axis 1 (nn.Linear's weight) A @ B.T. A is (M, K), quantized along K
when block-scaled; a bf16 A and the bias get gradients (ScaledMatmulFunction), B none. Hopper has
no block-scaled MMA: codes times scales are exact in bf16, so the kernels decode them for bf16
tensor cores (or CUDA cores) with float32 sums. The path
(_product), in order: dot_scaled.py (sm_100, both operands block-scaled, from DOT_SCALED_MIN_M
rows); gemv.py (one bf16 row); wgmma.py (Hopper, bf16 rows WGMMA_MIN_M to WGMMA_MAX_M);
dequantize_first.py (from DEQUANTIZE_FIRST_MIN_M rows); mma.py (up to MMA_MAX_M bf16 rows times
fp4); in_registers.py (the rest). Design and measurements: docs/scaled_matmul.md.
"""

from __future__ import annotations

import functools

import torch

from ... import quant, runtime
from ...quant import QuantizedTensor
from . import activation_grad, dequantize_first, dot_scaled, gemv, in_registers, mma, wgmma


def _operand(name: str, t) -> None:
    if not isinstance(t, QuantizedTensor):
        raise TypeError(f"{name} must be a tritonformer.quant.QuantizedTensor, got {type(t).__name__}")
    if len(t.shape) != 2:
        raise ValueError(f"{name} must be 2-D, got logical shape {tuple(t.shape)}")


def scaled_matmul(a, b: QuantizedTensor, out_dtype: torch.dtype = torch.bfloat16,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """A @ B (see the module doc for B's orientation); A is a bf16 tensor (M, K) or a
    QuantizedTensor (M, K) quantized along K; B a QuantizedTensor. K must be a multiple of both
    formats' blocks (it is, for anything quantize accepted). Returns (M, N) in out_dtype
    (bfloat16, float16 or float32), plus bias (N,) when given."""
    _operand("b", b)
    K = b.shape[b.axis]
    N = b.shape[1 - b.axis]
    if isinstance(a, QuantizedTensor):
        _operand("a", a)
        if a.axis != 1:
            raise ValueError(f"a must be quantized along K (axis 1), got axis {a.axis}")
        a_fmt, (M, K_a) = a.fmt, a.shape
        a_data, a_scales, a_tensor_scale = a.data, a.scales, a.tensor_scale
    else:
        runtime.check_tensor("a", a, (torch.bfloat16,), min_dim=2)
        if a.dim() != 2:
            raise ValueError(f"a must be 2-D (M, K), got shape {tuple(a.shape)}")
        a_fmt, (M, K_a) = "bf16", a.shape
        a_data, a_scales, a_tensor_scale = a, None, None
    if K_a != K:
        raise ValueError(f"a has K = {K_a} but b has K = {K} (its quantized axis)")
    if out_dtype not in runtime.FLOAT_DTYPES:
        raise TypeError(f"out_dtype must be float32, float16 or bfloat16, got {out_dtype}")
    if bias is not None:
        runtime.check_tensor("bias", bias)
        if bias.shape != (N,):
            raise ValueError(f"bias must be ({N},), got {tuple(bias.shape)}")
    runtime.check_same_device(a=a_data, b=b.data, bias=bias)
    if a_fmt != "bf16":
        runtime.check_no_grad("scaled_matmul with a block-scaled a", bias=bias)
    elif torch.is_grad_enabled() and (a.requires_grad or bias is not None and bias.requires_grad):
        return runtime.apply(ScaledMatmulFunction, a, bias, b.data, b.scales, b.tensor_scale, b.fmt, tuple(b.shape),
                             b.axis, out_dtype)
    return _forward(a, b, out_dtype, bias)


def _forward(a, b: QuantizedTensor, out_dtype: torch.dtype, bias: torch.Tensor | None) -> torch.Tensor:
    if torch.compiler.is_compiling():
        a_data, a_scales, a_fmt, a_tensor_scale = ((a.data, a.scales, a.fmt, a.tensor_scale)
                                                   if isinstance(a, QuantizedTensor) else (a, None, "bf16", None))
        return scaled_matmul_fwd(a_data, a_scales, a_fmt, a_tensor_scale, a.shape[0], b.data, b.scales, b.fmt,
                                 list(b.shape), b.axis, b.tensor_scale, out_dtype, bias)
    # Eager: no QuantizedTensors taken apart and rebuilt (host time is most of a decode step's).
    return _product(a, b, out_dtype, bias)


class ScaledMatmulFunction(torch.autograd.Function):
    """scaled_matmul of a bf16 A with gradients for A and the bias; the block-scaled B is frozen
    (QLoRA's base weight). dA = dC B: B decoded in registers up to ACTIVATION_GRAD_MAX_M rows
    (activation_grad.py), else through B dequantized to bf16 and cuBLAS (docs/scaled_matmul.md);
    under torch.compile the dequantize is plain PyTorch, which inductor fuses into the product's
    input."""

    @staticmethod
    def forward(ctx, a, bias, b_data, b_scales, b_tensor_scale, b_fmt, b_shape, b_axis, out_dtype):
        b = QuantizedTensor(b_data, b_scales, b_fmt, torch.Size(b_shape), b_axis, b_tensor_scale)
        ctx.save_for_backward(b_data, b_scales, b_tensor_scale)
        ctx.b_format = b_fmt, b_shape, b_axis
        ctx.a_dtype = a.dtype
        return _forward(a, b, out_dtype, bias)

    @staticmethod
    def backward(ctx, dc):
        b_data, b_scales, b_tensor_scale = ctx.saved_tensors
        fmt, shape, axis = ctx.b_format
        b = QuantizedTensor(b_data, b_scales, fmt, torch.Size(shape), axis, b_tensor_scale)
        da = dbias = None
        if ctx.needs_input_grad[0]:
            if not torch.compiler.is_compiling() and activation_grad.fits(dc.shape[0]):
                da = activation_grad.run(dc.to(ctx.a_dtype), b)
            else:
                w = (quant.dequantize_reference(b, ctx.a_dtype) if torch.compiler.is_compiling()
                     else quant.dequantize(b, ctx.a_dtype))
                da = dc.to(ctx.a_dtype) @ (w if axis == 1 else w.t())
        if ctx.needs_input_grad[1]:
            dbias = dc.float().sum(0)
        return da, dbias, None, None, None, None, None, None, None


def _fake_scaled_matmul_fwd(a_data, a_scales, a_fmt, a_tensor_scale, M, b_data, b_scales, b_fmt, b_shape, b_axis,
                            b_tensor_scale, out_dtype, bias):
    return b_data.new_empty((M, b_shape[1 - b_axis]), dtype=out_dtype)


@runtime.custom_op("scaled_matmul_fwd", fake=_fake_scaled_matmul_fwd)
def scaled_matmul_fwd(a_data: torch.Tensor, a_scales: torch.Tensor | None, a_fmt: str,
                      a_tensor_scale: torch.Tensor | None, M: int, b_data: torch.Tensor, b_scales: torch.Tensor,
                      b_fmt: str, b_shape: list[int], b_axis: int, b_tensor_scale: torch.Tensor | None,
                      out_dtype: torch.dtype, bias: torch.Tensor | None) -> torch.Tensor:
    """scaled_matmul on checked operands, their QuantizedTensors taken apart (a_fmt "bf16": a_data
    is A itself): what torch.compile traces, as one opaque node."""
    b = QuantizedTensor(b_data, b_scales, b_fmt, torch.Size(b_shape), b_axis, b_tensor_scale)
    a = a_data if a_fmt == "bf16" else QuantizedTensor(a_data, a_scales, a_fmt, torch.Size((M, b.shape[b_axis])), 1,
                                                       a_tensor_scale)
    return _product(a, b, out_dtype, bias)


def _weight_address(a, b: QuantizedTensor, *rest) -> int:
    return b.data.data_ptr()


@runtime.planned(key=_weight_address)
def _product(a, b: QuantizedTensor, out_dtype: torch.dtype, bias: torch.Tensor | None) -> torch.Tensor:
    """Pick the path for the shapes and formats (module doc) and run it; A is bf16 or quantized.
    Planned (runtime.planned): a replay allocates the output and replays the path's launch. The
    weight's address keys the plan too: the wgmma path's replay holds the weight's descriptor."""
    M, K, N = a.shape[0], b.shape[b.axis], b.shape[1 - b.axis]
    c = runtime.empty((M, N), out_dtype, b.data.device)
    if M == 0 or N == 0:
        return c
    if K == 0:
        return c.zero_() if bias is None else c.copy_(bias.expand(M, N))
    a_fmt = a.fmt if isinstance(a, QuantizedTensor) else "bf16"
    call = (a, b, c, M, N, K, bias, _tensor_scale(a, b))
    bf16 = a_fmt == "bf16"
    if dot_scaled.fits(a_fmt, b, M):
        dot_scaled.run(*call)
        return c
    if bf16 and gemv.fits(b, M):
        path = gemv
    elif bf16 and wgmma.fits(b, M, K):
        path = wgmma
    elif dequantize_first.fits(M):
        dequantize_first.run(*call)  # its slab products plan themselves
        return c
    elif bf16 and mma.fits(b, M):
        path = mma
    else:
        path = in_registers
    replay = path.run(*call)
    if replay is not None:
        runtime.keep_plan(functools.partial(_replay_product, replay))
    return c


def _replay_product(replay, a, b: QuantizedTensor, out_dtype: torch.dtype, bias: torch.Tensor | None) -> torch.Tensor:
    M, K, N = a.shape[0], b.shape[b.axis], b.shape[1 - b.axis]
    c = runtime.empty((M, N), out_dtype, b.data.device)
    replay(a, b, c, M, N, K, bias, _tensor_scale(a, b))
    return c


def _tensor_scale(a, b: QuantizedTensor) -> torch.Tensor | None:
    """The product of the operands' nvfp4 tensor scales, or None."""
    a_scale = a.tensor_scale if isinstance(a, QuantizedTensor) else None
    if a_scale is None or b.tensor_scale is None:
        return b.tensor_scale if a_scale is None else a_scale
    return a_scale * b.tensor_scale


def scaled_matmul_reference(a, b: QuantizedTensor, out_dtype: torch.dtype = torch.bfloat16,
                            bias: torch.Tensor | None = None) -> torch.Tensor:
    """Dequantize, then a float32 matmul."""
    a32 = quant.dequantize_reference(a) if isinstance(a, QuantizedTensor) else a.float()
    b32 = quant.dequantize_reference(b)
    if b.axis == 1:
        b32 = b32.t()
    out = a32 @ b32
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)
