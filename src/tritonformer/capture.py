"""`capture_step`: a whole training step (forward, backward, optimizer step) replayed as one CUDA
graph, so that a model of many thin layers runs at its GPU time instead of its Python time
(docs/training.md, "CUDA graphs").

    @tritonformer.capture_step
    def train_step(input_ids):
        loss = model(input_ids=input_ids, labels=input_ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    for batch in batches:
        loss = train_step(batch)

Each call is exactly one step. The first call of a layout (every tensor argument's shape, dtype,
device and requires_grad, and every other argument's value) runs eagerly: Triton compiles and
tunes, optimizers create their state. The second call of that layout captures the step and
replays it; later calls copy their tensor arguments into the graph's inputs and replay. A new
layout captures a graph of its own (all of them share one memory pool), up to `max_graphs`.

What a graph holds, and so what the step must respect:
- Whatever changes between steps comes in as an argument; a tensor the step reads from
  elsewhere (a closure, a global) is read at its address at capture time, its value at replay.
- The step ends with its parameters' gradients None (`zero_grad(set_to_none=True)`): the graph
  owns the gradient buffers it writes.
- No host synchronisation inside (`.item()`, printing a tensor, a CPU tensor copied over, a data
  dependent shape): capture raises CaptureError, and so does every later call of that layout.
  A 0-dim CPU tensor argument reaches kernels as a number: it is keyed by its value.
- Optimizers: those the step calls are made capturable after the first call (`capturable=True`
  where the optimizer has that option; a float learning rate of those becomes a 0-dim tensor on
  the parameters' device, which torch's LR schedulers fill in place). Any other Python number of
  a parameter group (a float lr of an optimizer without `capturable`, weight decay, betas) is
  fixed at capture: a call after it changed raises. An optimizer that keeps state on the host
  for parameters on the device and has no `capturable` (Adagrad's step count) is refused.
The outputs come back detached, as new tensors (never the graph's own buffers, which the next
replay overwrites). Tensors on the CPU, a call inside another capture and torch.compile's tracing
run the step as it is.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import numbers
import warnings
from typing import Callable

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils import _pytree as pytree

from . import runtime


class CaptureError(RuntimeError):
    """A step that a CUDA graph cannot hold, or a call that would replay one wrongly."""


class CudaGraph:
    """One captured step on a CUDA device (the backend that tests replace on the CPU)."""

    @staticmethod
    def supports(device: torch.device) -> bool:
        return device.type == "cuda"

    @staticmethod
    @contextlib.contextmanager
    def warm_up_stream(device: torch.device):
        # torch's rule for what is captured later: the eager warm-up runs on a side stream.
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            yield
        torch.cuda.current_stream(device).wait_stream(stream)

    @staticmethod
    def new_pool(device: torch.device):
        return torch.cuda.graph_pool_handle()

    def __init__(self, fn: Callable, args: tuple, kwargs: dict, pool, device: torch.device):
        # torch.cuda.graph's steps, save that a failed capture leaves the device as it was:
        # torch's context manager stays on the capture stream when capture_end raises, and the
        # device's random generator stays in capture mode (every later random op fails).
        with torch.cuda.device(device):
            torch.cuda.synchronize()
            gc.collect()
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.stream(torch.cuda.Stream()):
                try:
                    self.graph.capture_begin(pool=pool)
                    self.outputs = fn(*args, **kwargs)
                    self.graph.capture_end()
                except BaseException:
                    _abandon_capture(self.graph, pool)
                    raise

    def replay(self):
        self.graph.replay()
        return self.outputs


def _abandon_capture(graph: torch.cuda.CUDAGraph, pool) -> None:
    """Leave the device as a failed capture found it: the capture ended (capture_end raises at
    the stream's end of capture before it lets the allocator go), the allocator out of the
    graph's pool, the random generator out of capture mode."""
    if torch.cuda.is_current_stream_capturing():
        with contextlib.suppress(Exception):
            graph.capture_end()
    with contextlib.suppress(Exception):  # raises where capture_end got that far itself
        torch._C._cuda_endAllocateToPool(torch.cuda.current_device(), pool)
    try:
        _end_generator_capture()
    except Exception as error:  # the capture's own error is the one to report
        warnings.warn(f"capture_step: the random generator may still be in capture mode: {error}", stacklevel=3)


def _end_generator_capture() -> None:
    """Take the current device's random generator out of the capture mode that a failed capture
    left it in: a capture that succeeds ends it (the generator's state object stays the one that
    earlier graphs hold, so their replays and manual_seed keep working)."""
    reset = torch.cuda.CUDAGraph()
    with torch.cuda.stream(torch.cuda.Stream()):
        reset.capture_begin()
        torch.zeros(1, device=torch.cuda.current_device()).add_(1)
        reset.capture_end()


def _detached_copy(value):
    return value.detach().clone() if isinstance(value, torch.Tensor) else value


def _hyperparameters(opt: torch.optim.Optimizer) -> list[tuple]:
    """Every Python number of `opt`'s parameter groups (what a capture fixes)."""
    return [(j, name, value) for j, group in enumerate(opt.param_groups) for name, value in group.items()
            if isinstance(value, (numbers.Number, tuple)) and not isinstance(value, bool)]


class CapturedStep:
    """`fn` replayed as a CUDA graph per argument layout; see the module doc."""

    backend = CudaGraph

    def __init__(self, fn: Callable, max_graphs: int = 16):
        if not callable(fn):
            raise TypeError(f"capture_step: expected a callable, got {type(fn).__name__}")
        if max_graphs < 1:
            raise ValueError(f"capture_step: max_graphs must be at least 1, got {max_graphs}")
        functools.update_wrapper(self, fn)
        self.fn = fn
        self.max_graphs = max_graphs
        self.graphs: dict[tuple, tuple] = {}  # layout -> (graph, its static input tensors)
        self._warmed: set[tuple] = set()
        self._optimizers: list[torch.optim.Optimizer] = []
        self._fixed: dict[int, list[tuple]] = {}  # index in _optimizers -> its numbers at capture
        self._failed: dict[tuple, str] = {}  # layout -> why its capture failed (a message: no frames kept)
        self._pool = None

    def __call__(self, *args, **kwargs):
        leaves, spec = pytree.tree_flatten((args, kwargs))
        tensors = [x for x in leaves if isinstance(x, torch.Tensor) and not _is_host_scalar(x)]
        device = tensors[0].device if tensors else None
        if (device is None or not self.backend.supports(device) or torch.compiler.is_compiling()
                or (device.type == "cuda" and torch.cuda.is_current_stream_capturing())):
            return pytree.tree_map(_detached_copy, self.fn(*args, **kwargs))
        self._check_hyperparameters()
        if any(t.device != device for t in tensors):
            raise CaptureError("capture_step: tensor arguments on another device than the first (a CPU tensor of more "
                               "than one element is read at capture, never again): move them to "
                               f"{device} or pass numbers")
        key = self._layout(spec, leaves)
        if key in self._failed:
            raise CaptureError(self._failed[key])
        entry = self.graphs.get(key)
        if entry is None:
            if key not in self._warmed:
                return self._warm_up(key, device, args, kwargs)
            entry = self._capture(key, device, leaves, spec)
        graph, static = entry
        for mine, given in zip(static, tensors):
            mine.copy_(given)
        return pytree.tree_map(_detached_copy, graph.replay())

    @staticmethod
    def _layout(spec, leaves) -> tuple:
        # A 0-dim CPU tensor reaches kernels as a number: the graph holds its value, so it is keyed by it.
        layout = [("host scalar", x.item(), x.dtype) if _is_host_scalar(x)
                  else (tuple(x.shape), x.dtype, x.device, x.requires_grad) if isinstance(x, torch.Tensor) else x
                  for x in leaves]
        key = (spec, tuple(layout))
        try:
            hash(key)
        except TypeError:
            raise CaptureError("capture_step: every argument that is not a tensor is part of the graph's key and "
                               "must be hashable") from None
        return key

    def _warm_up(self, key, device, args, kwargs):
        stepped: list[torch.optim.Optimizer] = []
        hook = register_optimizer_step_pre_hook(lambda opt, *_: stepped.append(opt))
        try:
            with self.backend.warm_up_stream(device):
                outputs = self.fn(*args, **kwargs)
        finally:
            hook.remove()
        outputs = pytree.tree_map(_detached_copy, outputs)
        runtime.wait_for_background_work()  # a background compile must not run into the capture
        for opt in stepped:
            _check_capturable(opt)
        for opt in stepped:
            if all(opt is not known for known in self._optimizers):
                self._optimizers.append(opt)
                _make_capturable(opt)
        self._warmed.add(key)
        return outputs

    def _capture(self, key, device, leaves, spec):
        if len(self.graphs) >= self.max_graphs:
            raise CaptureError(
                f"capture_step: {len(self.graphs) + 1} argument layouts, more than max_graphs={self.max_graphs}; "
                "pad batches to a few shapes (or raise max_graphs: each layout holds a graph)")
        static = [x.detach().clone().requires_grad_(x.requires_grad) if isinstance(x, torch.Tensor) else x
                  for x in leaves]
        args, kwargs = pytree.tree_unflatten(static, spec)
        if self._pool is None:
            self._pool = self.backend.new_pool(device)
        runtime.wait_for_background_work()  # no compile thread may allocate during the capture
        params = [p for opt in self._optimizers for group in opt.param_groups for p in group["params"]]
        try:
            graph = self.backend(self.fn, args, kwargs, self._pool, device)
        except Exception as error:
            for p in params:  # gradients the failed capture assigned were never written
                p.grad = None
            self._failed[key] = (
                "capture_step: the step cannot be captured as a CUDA graph (a host synchronisation such as "
                ".item() or printing a tensor, a CPU tensor copied to the GPU, a shape that depends on data, "
                f"or an optimizer that cannot be captured): {type(error).__name__}: {error}")
            raise CaptureError(self._failed[key]) from error
        for i, opt in enumerate(self._optimizers):
            self._fixed.setdefault(i, _hyperparameters(opt))
        entry = (graph, [x for x in static if isinstance(x, torch.Tensor) and not _is_host_scalar(x)])
        self.graphs[key] = entry
        return entry

    def _check_hyperparameters(self) -> None:
        for i, fixed in self._fixed.items():
            opt = self._optimizers[i]
            changed = [(j, name, value, opt.param_groups[j].get(name)) for j, name, value in fixed
                       if opt.param_groups[j].get(name) != value]
            if changed:
                j, name, was, now = changed[0]
                raise CaptureError(
                    f"capture_step: {type(opt).__name__}'s parameter group {j} {name!r} changed after capture "
                    f"({was} -> {now}); the graph holds the value it was captured with (a learning rate that changes "
                    "must be a tensor: see the capture_step doc)")


def _is_host_scalar(x) -> bool:
    return isinstance(x, torch.Tensor) and x.device.type == "cpu" and x.dim() == 0


def _check_capturable(opt: torch.optim.Optimizer) -> None:
    """Refuse what a graph of `opt`'s step cannot hold: gradients left after the step, and state
    on the host for parameters on the device (a step count a capture would advance once)."""
    for group in opt.param_groups:
        for p in group["params"]:
            if p.grad is not None:
                raise CaptureError(
                    "capture_step: the step left gradients on its parameters; end it with "
                    "optimizer.zero_grad(set_to_none=True), so that the graph owns the gradients it writes")
            state = opt.state.get(p, {})
            host = [name for name, value in state.items() if isinstance(value, torch.Tensor)
                    and value.device.type == "cpu" and p.device.type != "cpu" and "capturable" not in group]
            if host:
                raise CaptureError(
                    f"capture_step: {type(opt).__name__} keeps {', '.join(host)} on the CPU for parameters on "
                    f"{p.device}; a graph would hold its first value (use an optimizer with capturable=True)")


def _make_capturable(opt: torch.optim.Optimizer) -> None:
    """capturable=True where `opt` has the option, its state (step counts) on the parameters'
    device and its learning rates 0-dim tensors there (filled in place by LR schedulers)."""
    for group in opt.param_groups:
        if "capturable" not in group or not group["params"] or group["params"][0].device.type != "cuda":
            continue
        device = group["params"][0].device
        group["capturable"] = True
        lr = group["lr"]
        if not isinstance(lr, torch.Tensor) or lr.device != device:
            group["lr"] = torch.as_tensor(lr, dtype=torch.float32).to(device)
        for p in group["params"]:
            state = opt.state.get(p, {})
            for name, value in state.items():  # step, and NAdam's mu_product
                if isinstance(value, torch.Tensor) and value.device != p.device:
                    state[name] = value.to(p.device)


def capture_step(fn: Callable | None = None, *, max_graphs: int = 16):
    """`fn`, one training step, replayed as a CUDA graph (a decorator, with or without
    arguments); see the module doc for what the step must respect."""
    if fn is None:
        return functools.partial(capture_step, max_graphs=max_graphs)
    return CapturedStep(fn, max_graphs)
