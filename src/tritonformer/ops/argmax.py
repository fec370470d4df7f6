"""argmax over the last dimension, for a decode step's greedy pick over a vocabulary.

    argmax(x) -> LongTensor of x.shape[:-1]: the index of each row's largest value, the first one
    where several tie (torch.argmax's rule), NaN counted as the largest (torch's too).

x of any float dtype and strides (rows with a unit column stride are read in place). Two
launches: programs of BLOCK columns of a row find their chunk's maximum and its first index, a
second launch picks each row's first chunk holding the row's maximum. torch.argmax reduces a
row of 128k logits in one block (27.5 us on the H200 in a decode step, against a few us for a
read of its 256 KB). Inference only: no backward. Design: docs/generate.md, "Skinny products".
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import runtime

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Columns a program of the first launch takes; a row's chunk count is limited to MAX_CHUNKS (the
# second launch reads them all at once).
BLOCK = 4096
MAX_CHUNKS = 1024


@triton.jit
def _chunk_max_kernel(x_ptr, val_ptr, idx_ptr, V, stride_x, chunks, BLOCK: tl.constexpr):
    """Chunk c of row r: its first NaN (stored as NaN), else its largest value and the first
    column holding it."""
    pid = tl.program_id(0)
    row = (pid // chunks).to(tl.int64)
    chunk = pid % chunks
    cols = chunk * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * stride_x + cols, mask=cols < V, other=-float("inf")).to(tl.float32)
    nan = x != x
    x = tl.where(nan, -float("inf"), x)
    top = tl.max(x, axis=0)
    first = tl.min(tl.where(x == top, cols, V), axis=0)
    first_nan = tl.min(tl.where(nan, cols, V), axis=0)
    tl.store(val_ptr + pid, tl.where(first_nan < V, float("nan"), top))
    tl.store(idx_ptr + pid, tl.where(first_nan < V, first_nan, first))


@triton.jit
def _first_max_chunk_kernel(val_ptr, idx_ptr, out_ptr, chunks, CHUNKS: tl.constexpr):
    """Row r's answer: the index found by its first chunk holding a NaN, else by its first chunk
    holding the row's largest value."""
    row = tl.program_id(0)
    offs = tl.arange(0, CHUNKS)
    ok = offs < chunks
    vals = tl.load(val_ptr + row * chunks + offs, mask=ok, other=-float("inf"))
    idx = tl.load(idx_ptr + row * chunks + offs, mask=ok, other=0)
    nan = ok & (vals != vals)
    top = tl.max(tl.where(nan, -float("inf"), vals), axis=0)
    any_nan = tl.max(nan.to(tl.int32), axis=0) > 0
    # Chunks are in column order: the smallest index among the chosen chunks is the first.
    chosen = tl.where(any_nan, nan, ok & (vals == top))
    tl.store(out_ptr + row, tl.min(tl.where(chosen, idx, 2**31 - 1), axis=0).to(tl.int64))


_launch_chunks = runtime.FastLaunch(_chunk_max_kernel)
_launch_first = runtime.FastLaunch(_first_max_chunk_kernel)


def argmax(x: torch.Tensor) -> torch.Tensor:
    """The first index of each row's largest value over the last dimension: see the module doc."""
    runtime.check_tensor("x", x, DTYPES, min_dim=1)
    V = x.shape[-1]
    if V == 0:
        raise ValueError("argmax of an empty last dimension: there is no largest value")
    if V >= 2**31:
        raise ValueError(f"x has {V} columns; argmax takes fewer than 2^31")
    return argmax_rows(x)


def _fake_argmax_rows(x):
    return x.new_empty(x.shape[:-1], dtype=torch.int64)


@runtime.custom_op("argmax_rows", fake=_fake_argmax_rows)
def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """argmax's launcher (checked arguments)."""
    V = x.shape[-1]
    rows = runtime.rows_view(x, V)
    R = rows.shape[0]
    out = runtime.empty(x.shape[:-1], torch.int64, x.device)
    if R == 0:
        return out
    block = max(BLOCK, runtime.next_power_of_2(runtime.cdiv(V, MAX_CHUNKS)))
    chunks = runtime.cdiv(V, block)
    vals = runtime.empty((R * chunks,), torch.float32, x.device)
    idx = runtime.empty((R * chunks,), torch.int32, x.device)
    _launch_chunks((R * chunks,), rows, vals, idx, V, rows.stride(0), chunks, BLOCK=block,
                   num_warps=8 if block >= 4096 else 4)
    _launch_first((R,), vals, idx, out, chunks, CHUNKS=runtime.next_power_of_2(chunks), num_warps=4)
    return out


def argmax_reference(x: torch.Tensor) -> torch.Tensor:
    return x.argmax(dim=-1)
