"""scaled_matmul's path on sm_100 (Blackwell) for both operands block-scaled (two MX formats, or
nvfp4 twice) from DOT_SCALED_MIN_M rows: tl.dot_scaled issues tcgen05's block-scaled MMA on the
e4m3/e2m1 operands and their scales as stored, the scales converted once a tensor to the 5D layout
copied into tensor memory. No sm_100 here to time it: scripts/blackwell_check.py compiles it for
sm_100 offline; the GPU tests run it on Hopper, where Triton upcasts MX operands to bf16. It does
not run under the interpreter. See docs/scaled_matmul.md."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ... import runtime
from ...quant import QuantizedTensor
from ..gemm import epilogue_store, grouped_tile

# tl.dot_scaled's element formats (the scales' dtype tells nvfp4's e4m3 scales from e8m0 bytes).
DOT_SCALED_FORMATS = {"mxfp8": "e4m3", "mxfp4": "e2m1", "nvfp4": "e2m1"}
# From a full MMA tile of rows on; fewer rows take the split-K kernel that streams the weight.
DOT_SCALED_MIN_M = 128
# Triton's block-scaled tutorial's tiles for sm_100: 128 x 256 outputs, a step of K of 256 fp4
# elements (128 bytes a row) or 128 when an operand is e4m3, 4 stages.
DOT_SCALED_TILE = (128, 256, 4)


@triton.jit
def _dot_scaled_kernel(a_ptr, a_scale_ptr, b_ptr, b_scale_ptr, c_ptr, bias_ptr, tensor_scale_ptr,
                       M, N, K, scale_cols, stride_am, stride_as, stride_bn, stride_bs, stride_cm, stride_cn,
                       A_DOT: tl.constexpr, B_DOT: tl.constexpr, VEC: tl.constexpr, HAS_BIAS: tl.constexpr,
                       TENSOR_SCALE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """One (BLOCK_M, BLOCK_N) tile of C = A @ B.T by tl.dot_scaled (tcgen05's block-scaled MMA on
    sm_100): A (M, K) and B (N, K) hold e4m3 bytes or packed e2m1 pairs (A_DOT, B_DOT), one
    scale a VEC elements of K, e8m0 bytes or (nvfp4) e4m3 by the scale pointers' type. The scales
    are in the 5D layout (quant.to_blocked) viewed as (row blocks of 128, scale_cols): a step of
    K reads whole 512-byte chunks (128 rows x 4 scales), the form that sm_100 copies into tensor
    memory for the MMA (loaded as bytes and bitcast, nvfp4's would go through registers)."""
    pid_m, pid_n = grouped_tile(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    A_PACK: tl.constexpr = 2 if A_DOT == "e2m1" else 1
    B_PACK: tl.constexpr = 2 if B_DOT == "e2m1" else 1
    CHUNKS: tl.constexpr = BLOCK_K // VEC // 4
    rows_a = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rows_b = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cols_a = tl.arange(0, BLOCK_K // A_PACK)
    cols_b = tl.arange(0, BLOCK_K // B_PACK)
    a_ptrs = a_ptr + rows_a.to(tl.int64)[:, None] * stride_am + cols_a[None, :]
    b_ptrs = b_ptr + rows_b.to(tl.int64)[:, None] * stride_bn + cols_b[None, :]
    blocks_a = pid_m * (BLOCK_M // 128) + tl.arange(0, BLOCK_M // 128)
    blocks_b = pid_n * (BLOCK_N // 128) + tl.arange(0, BLOCK_N // 128)
    chunk_bytes = tl.arange(0, CHUNKS * 512)
    a_scale_ptrs = a_scale_ptr + blocks_a[:, None] * stride_as + chunk_bytes[None, :]
    b_scale_ptrs = b_scale_ptr + blocks_b[:, None] * stride_bs + chunk_bytes[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a = tl.load(a_ptrs, mask=(rows_a[:, None] < M) & (cols_a[None, :] < (K - k0) // A_PACK), other=0)
        b = tl.load(b_ptrs, mask=(rows_b[:, None] < N) & (cols_b[None, :] < (K - k0) // B_PACK), other=0)
        chunks_left = chunk_bytes[None, :] < scale_cols - k0 // (4 * VEC) * 512
        a_scale = tl.load(a_scale_ptrs, mask=(blocks_a[:, None] < tl.cdiv(M, 128)) & chunks_left, other=0.0)
        b_scale = tl.load(b_scale_ptrs, mask=(blocks_b[:, None] < tl.cdiv(N, 128)) & chunks_left, other=0.0)
        a_scale = a_scale.reshape(BLOCK_M // 128, CHUNKS, 32, 4, 4).trans(0, 3, 2, 1, 4).reshape(BLOCK_M, BLOCK_K // VEC)
        b_scale = b_scale.reshape(BLOCK_N // 128, CHUNKS, 32, 4, 4).trans(0, 3, 2, 1, 4).reshape(BLOCK_N, BLOCK_K // VEC)
        acc = tl.dot_scaled(a, a_scale, A_DOT, b.T, b_scale, B_DOT, acc)
        a_ptrs += BLOCK_K // A_PACK
        b_ptrs += BLOCK_K // B_PACK
        a_scale_ptrs += CHUNKS * 512
        b_scale_ptrs += CHUNKS * 512
    epilogue_store(acc, rows_a, rows_b, M, N, c_ptr, c_ptr, stride_cm, stride_cn, bias_ptr, tensor_scale_ptr, c_ptr,
                   0.0, HAS_BIAS, 0, TENSOR_SCALE, 0, False)


_launch_dot_scaled = runtime.FastLaunch(_dot_scaled_kernel)


def fits(a_fmt: str, b: QuantizedTensor, M: int) -> bool:
    """Whether this path takes the product: sm_100, whose tensor cores take both operands
    block-scaled, two MX formats or nvfp4 twice (one MMA has one kind of scale)."""
    return (not runtime.INTERPRET and a_fmt != "bf16" and M >= DOT_SCALED_MIN_M
            and (a_fmt == "nvfp4") == (b.fmt == "nvfp4") and runtime.capability(b.data.device.index or 0)[0] == 10)


def run(a: QuantizedTensor, b: QuantizedTensor, c, M, N, K, bias, tensor_scale) -> None:
    """A @ B.T by _dot_scaled_kernel, the scales converted to the 5D layout once a tensor (no
    replay: sm_100's products are large enough for their host time not to count). Hopper
    has no such instruction: Triton upcasts the MX formats to bf16 there (tests run it so) and
    cannot take nvfp4's e4m3 scales."""
    a_scales, b_scales = (t.blocked_scales() for t in (a, b))
    a_scales, b_scales = (s.view(s.shape[0], -1) for s in (a_scales, b_scales))
    a_data, b_data = (t.data.view(torch.uint8) for t in (a, b))
    block_m, block_n, stages = DOT_SCALED_TILE
    block_k = 128 if "mxfp8" in (a.fmt, b.fmt) else 256
    grid = (runtime.cdiv(M, block_m) * runtime.cdiv(N, block_n),)
    _launch_dot_scaled(grid, a_data, a_scales, b_data, b_scales, c, bias if bias is not None else c,
                       tensor_scale if tensor_scale is not None else c, M, N, K, a_scales.shape[1],
                       a_data.stride(0), a_scales.stride(0), b_data.stride(0), b_scales.stride(0), c.stride(0),
                       c.stride(1), A_DOT=DOT_SCALED_FORMATS[a.fmt], B_DOT=DOT_SCALED_FORMATS[b.fmt], VEC=b.block,
                       HAS_BIAS=bias is not None, TENSOR_SCALE=int(tensor_scale is not None), BLOCK_M=block_m,
                       BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=8, num_warps=4, num_stages=stages)
