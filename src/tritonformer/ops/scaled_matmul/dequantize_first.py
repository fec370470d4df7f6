"""scaled_matmul's path for many rows: dequantize into bf16 buffers (A whole when quantized, B in
slabs of rows), then tritonformer's bf16 matmul, which runs at cuBLAS's rate; the dequantize
pass costs about 5% at 8192^3, where decoding in registers would decode each tile of B once per
tile of M on the CUDA cores. See docs/scaled_matmul.md."""

from __future__ import annotations

import torch

from ... import quant, runtime
from ...quant import QuantizedTensor
from ..gemm import one_matrix_strides
from ..matmul import launch_strided

# From this many rows of A on, dequantizing into memory first and running the bf16 matmul beats
# dequantizing in registers (each B tile is decoded once per M tile there).
DEQUANTIZE_FIRST_MIN_M = 512
# Most bf16 bytes of B dequantized at once on that path.
DEQUANTIZE_SLAB_BYTES = 64 * 2**20


def fits(M: int) -> bool:
    """Whether M rows of A take this path."""
    return M >= DEQUANTIZE_FIRST_MIN_M


def run(a, b: QuantizedTensor, c, M, N, K, bias, tensor_scale) -> None:
    """Dequantize to bf16 in memory, then tritonformer's bf16 matmul: A whole (when quantized),
    B in slabs of rows (output columns) of at most DEQUANTIZE_SLAB_BYTES, each slab's product
    written into its columns of c, so the workspace stays bounded for a large weight."""
    a16 = quant.dequantize_rows(a, torch.bfloat16, tensor_scale=False) if isinstance(a, QuantizedTensor) else a
    slab = max(256, DEQUANTIZE_SLAB_BYTES // (2 * K) // 256 * 256)
    for n0 in range(0, N, slab):
        n1 = min(N, n0 + slab)
        b16 = quant.dequantize_rows(b, torch.bfloat16, n0, n1, tensor_scale=False).t()
        c_slab = c[:, n0:n1]
        bias_slab = bias[n0:n1] if bias is not None else None
        _slab_product(a16, b16, c_slab, bias_slab, tensor_scale)


@runtime.planned
def _slab_product(a16, b16, c_slab, bias_slab, tensor_scale) -> None:
    """c_slab = a16 @ b16 (+ bias_slab, times tensor_scale): tritonformer's matmul, planned (a
    replay's host time is 35 us against 95 planned afresh)."""
    M, K, N = a16.shape[0], a16.shape[1], b16.shape[1]
    replay = launch_strided(a16, one_matrix_strides(a16), b16, one_matrix_strides(b16), c_slab,
                            (M * N, *c_slab.stride()), None, 1, M, N, K, bias_slab, tensor_scale, None, 0, 0.0)
    if replay is not None:
        runtime.keep_plan(lambda a16, b16, c_slab, bias_slab, tensor_scale:
                          replay(a16, b16, c_slab, None, bias_slab, tensor_scale, None))
