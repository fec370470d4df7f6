"""The peers a benchmark case measures ours against (torch.compile, Liger-Kernel), built only where
they can run."""

from __future__ import annotations

import functools
import importlib.util
from typing import Any, Callable

import torch

from .. import runtime

Thunk = Callable[[], Any]


def available(providers: dict[str, Thunk | None]) -> dict[str, Thunk]:
    """Drop the providers that could not be built here (None)."""
    return {name: fn for name, fn in providers.items() if fn is not None}


@functools.lru_cache(maxsize=None)
def _compile(fn: Callable) -> Callable:
    return torch.compile(fn, dynamic=False)


def compiled(fn: Callable, *args, **kwargs) -> Thunk | None:
    """A thunk running `torch.compile(fn)` on these arguments; None under the interpreter,
    where inductor would time CPU code, not a GPU peer."""
    if runtime.INTERPRET:
        return None
    compiled_fn = _compile(fn)
    return lambda: compiled_fn(*args, **kwargs)


@functools.lru_cache(maxsize=None)
def liger() -> Any | None:
    """The liger_kernel.ops package when it is installed and a GPU is here, else None."""
    if runtime.INTERPRET or importlib.util.find_spec("liger_kernel") is None:
        return None
    import liger_kernel.ops

    return liger_kernel.ops


def hf_eager_attention(family: str) -> Callable | None:
    """transformers' eager attention function of a model family (Gemma 2's softcap, GPT-OSS's
    sinks), the path HF runs for what SDPA does not take; None without transformers."""
    if importlib.util.find_spec("transformers") is None:
        return None
    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    return module.eager_attention_forward
