"""What scaled_matmul's kernel paths share: split-K for grids of few output tiles, the launch of
a path with its replay. See docs/scaled_matmul.md."""

from __future__ import annotations

import functools
from typing import Callable

from ... import runtime


def split_k(tiles: int, K: int, block_k: int, device, programs_per_sm: int = 4) -> tuple[int, int]:
    """(splits, K a split: a multiple of block_k) so that a grid of few output tiles (small M)
    still has about programs_per_sm programs an SM streaming the weight; each split keeps at
    least 1024 of K."""
    if runtime.INTERPRET:
        split = 2 if K >= 2 * block_k else 1
    else:
        want = runtime.cdiv(programs_per_sm * runtime.num_sms(device.index or 0), tiles)
        split = max(1, min(want, K // 1024, 16))
    k_per_split = runtime.cdiv(runtime.cdiv(K, split), block_k) * block_k
    return runtime.cdiv(K, k_per_split), k_per_split


def launch_with_replay(launch: runtime.FastLaunch, plan: tuple, arguments: Callable, call: tuple,
                       constexprs: dict) -> Callable | None:
    """Launch a path's kernel on `arguments(plan, *call)` over the grid plan[0], `call` being the
    arguments of the path's `run` (bias and tensor_scale last); the replay of that launch on
    later arguments of the same layout (the product keeps it: runtime.planned), or None."""
    bias, tensor_scale = call[-2], call[-1]
    entry = launch(plan[0], *arguments(plan, *call), **constexprs, HAS_BIAS=bias is not None,
                   TENSOR_SCALE=int(tensor_scale is not None))
    return None if entry is None else functools.partial(_replay, launch, plan, arguments, entry)


def _replay(launch: runtime.FastLaunch, plan: tuple, arguments: Callable, entry: tuple, *call) -> None:
    launch.replay(entry, plan[0], *arguments(plan, *call))
