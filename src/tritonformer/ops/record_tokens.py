"""A decode step's bookkeeping after its pick, in one launch (it was ten small torch kernels, about
10 us of a 0.55 ms step at batch 1 on the H200; docs/generate.md, "Where the step goes").

    record_tokens(picked, state, advance)

For each sequence b of a batch of B: its token is picked[b], or the pad id once it has finished;
the token goes to out[b, step]; a sequence whose token is one of the eos ids finishes at this
step (finished_at[b] = step, done[b] = True); tokens[b] takes the token (the next step's input);
step advances by one, and with `advance` so do positions and lengths. `state` is the decoder's
tensors of fixed address (a captured step writes them in place): out (B, capacity) int64,
done (B,) bool, finished_at (B,) int64, tokens (B,) int64, positions (B,) int64, lengths (B,)
int32, step (1,) int64, eos (E,) int64, pad () int64. Inference only: no backward.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .. import runtime


class DecodeState(NamedTuple):
    """The tensors a decode step's bookkeeping reads and writes in place (see the module doc)."""
    out: torch.Tensor
    done: torch.Tensor
    finished_at: torch.Tensor
    tokens: torch.Tensor
    positions: torch.Tensor
    lengths: torch.Tensor
    step: torch.Tensor
    eos: torch.Tensor
    pad: torch.Tensor


@triton.jit
def _record_tokens_kernel(picked_ptr, out_ptr, done_ptr, finished_ptr, tokens_ptr, positions_ptr, lengths_ptr,
                          step_ptr, eos_ptr, pad_ptr, B, n_eos, stride_out, ADVANCE: tl.constexpr,
                          BLOCK_B: tl.constexpr, BLOCK_E: tl.constexpr):
    """One program for the whole batch (B <= BLOCK_B)."""
    b = tl.arange(0, BLOCK_B)
    ok = b < B
    step = tl.load(step_ptr)
    done = tl.load(done_ptr + b, mask=ok, other=1) != 0
    token = tl.where(done, tl.load(pad_ptr), tl.load(picked_ptr + b, mask=ok, other=0))
    tl.store(out_ptr + b.to(tl.int64) * stride_out + step, token, mask=ok)
    e = tl.arange(0, BLOCK_E)
    eos = tl.load(eos_ptr + e, mask=e < n_eos, other=0)
    hits = tl.sum(((token[:, None] == eos[None, :]) & (e < n_eos)[None, :]).to(tl.int32), axis=1)
    newly = (hits > 0) & ~done
    finished = tl.load(finished_ptr + b, mask=ok, other=0)
    tl.store(finished_ptr + b, tl.where(newly, step, finished), mask=ok)
    tl.store(done_ptr + b, (done | newly).to(tl.int1), mask=ok)
    tl.store(tokens_ptr + b, token, mask=ok)
    if ADVANCE:
        tl.store(positions_ptr + b, tl.load(positions_ptr + b, mask=ok, other=0) + 1, mask=ok)
        tl.store(lengths_ptr + b, tl.load(lengths_ptr + b, mask=ok, other=0) + 1, mask=ok)
    tl.store(step_ptr, step + 1)


_launch = runtime.FastLaunch(_record_tokens_kernel)


def _check(picked: torch.Tensor, state: DecodeState) -> None:
    B = picked.shape[0] if picked.dim() == 1 else -1
    shapes = dict(picked=(B,), out=(B, state.out.shape[-1]), done=(B,), finished_at=(B,), tokens=(B,),
                  positions=(B,), lengths=(B,), step=(1,), eos=(state.eos.numel(),), pad=())
    dtypes = dict(done=torch.bool, lengths=torch.int32)
    tensors = dict(state._asdict(), picked=picked)
    for name, t in tensors.items():
        if t.dtype != dtypes.get(name, torch.int64) or tuple(t.shape) != shapes[name] or t.device != picked.device:
            raise ValueError(f"record_tokens: {name} must be a {dtypes.get(name, torch.int64)} tensor of shape "
                             f"{shapes[name]} on {picked.device}, got {t.dtype} {tuple(t.shape)} on {t.device}")
        if name not in ("out", "pad") and t.dim() == 1 and t.shape[0] > 1 and t.stride(0) != 1:
            raise ValueError(f"record_tokens: {name} must be contiguous")
    if state.eos.numel() == 0 or state.out.stride(1) != 1:
        raise ValueError("record_tokens: eos must hold at least one id and out must have unit column stride")


def record_tokens(picked: torch.Tensor, state: DecodeState, advance: bool) -> None:
    """Record a step's picked tokens in `state`, in place: see the module doc."""
    _check(picked, state)
    B = picked.shape[0]
    if B == 0:
        return
    _launch((1,), picked, state.out, state.done, state.finished_at, state.tokens, state.positions, state.lengths,
            state.step, state.eos, state.pad, B, state.eos.numel(), state.out.stride(0), ADVANCE=advance,
            BLOCK_B=runtime.next_power_of_2(B), BLOCK_E=runtime.next_power_of_2(state.eos.numel()),
            num_warps=4)


def record_tokens_reference(picked: torch.Tensor, state: DecodeState, advance: bool) -> None:
    """record_tokens in plain torch (the ten launches it replaces)."""
    picked = torch.where(state.done, state.pad, picked)
    state.out.scatter_(1, state.step.expand(picked.shape[0], 1), picked[:, None])
    newly = torch.isin(picked, state.eos) & ~state.done
    state.finished_at.copy_(torch.where(newly, state.step, state.finished_at))
    state.done.logical_or_(newly)
    state.tokens.copy_(picked)
    state.step.add_(1)
    if advance:
        state.positions.add_(1)
        state.lengths.add_(1)
