"""Where kernels run, how they are tuned and registered, and the input checks every op shares.

On a machine with a CUDA GPU the kernels compile and autotune. Without one, the same
`@triton.jit` kernels run under Triton's interpreter on CPU tensors. The choice is made once,
at import, before any kernel is defined (the interpreter is picked when `triton.jit` runs).
"""

from __future__ import annotations

import contextvars
import functools
import hashlib
import inspect
import json
import logging
import math
import os
import threading
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Iterable, Sequence

import numpy as np
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402  (after TRITON_INTERPRET is settled)
import triton.language as tl  # noqa: E402
from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: E402
from triton.compiler.errors import CompileTimeAssertionFailure  # noqa: E402
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonTensorDescriptor  # noqa: E402
from triton.runtime.errors import OutOfResources, PTXASError  # noqa: E402

INTERPRET: bool = os.environ.get("TRITON_INTERPRET", "0") == "1"
DEVICE: str = "cpu" if INTERPRET else "cuda"
# For kernels: compiled for the GPU, where inline PTX and the GPU's own rounding instructions
# exist; under the interpreter a kernel takes its portable branch instead.
COMPILED = tl.constexpr(not INTERPRET)

# Tests set TRITONFORMER_POISON=1 so that every output buffer starts as NaN (or the integer
# minimum): an element a kernel forgets to write then fails the comparison.
POISON: bool = os.environ.get("TRITONFORMER_POISON", "0") == "1"

# Autotuning results are kept on disk for later processes, unless TRITONFORMER_KEEP_TUNING=0: the
# tests set it, because their workers share one GPU and time configs against each other (a suite
# run before the benchmark left it a 64x256 tile for bf16 1024^3, 15-18 us against 11).
KEEP_TUNING: bool = os.environ.get("TRITONFORMER_KEEP_TUNING", "1") == "1"

def _install_rounding_conversion() -> None:
    """Triton 3.6's interpreter converts float32 to bfloat16 by truncation (a cast, and so a store
    of a float32 value to a bf16 pointer), where the GPU and torch round to nearest even: one in
    four random sums came out one ulp toward zero. Its converter is replaced, for that pair of
    types and every rounding mode but round-toward-zero, by torch's conversion (docs/runtime.md)."""
    from triton.runtime import interpreter

    truncating = interpreter._convert_float
    toward_zero = interpreter._ir.ROUNDING_MODE.RTZ

    def convert(values, input_dtype, output_dtype, rounding_mode):
        if input_dtype == tl.float32 and output_dtype == tl.bfloat16 and rounding_mode != toward_zero:
            floats = torch.from_numpy(np.ascontiguousarray(values).view(np.float32))
            return floats.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16).reshape(values.shape)
        return truncating(values, input_dtype, output_dtype, rounding_mode)

    interpreter._convert_float = convert


if INTERPRET:
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(triton.language.sum, InterpretedFunction):
        # triton.language's own jit functions were made before TRITON_INTERPRET was set: kernels
        # would fail inside the interpreter with "Cannot call @triton.jit'd outside of the scope".
        raise ImportError(
            "tritonformer: no CUDA GPU, and triton was imported before TRITON_INTERPRET=1 was set (by "
            "another import, e.g. transformers). Import tritonformer first, or set TRITON_INTERPRET=1 "
            "in the environment.")
    _install_rounding_conversion()
    # The interpreter evaluates kernels with numpy, which warns where a kernel means what IEEE
    # arithmetic gives (exp2 of a large argument is inf, a masked lane's 0 / 0 is NaN).
    warnings.filterwarnings("ignore", category=RuntimeWarning, module="triton.runtime.interpreter")
    warnings.warn(
        "tritonformer: no CUDA GPU, kernels run under Triton's CPU interpreter (correct results, not GPU speed)",
        RuntimeWarning,
        stacklevel=2,
    )


def empty(shape: Sequence[int], dtype: torch.dtype, device) -> torch.Tensor:
    """`torch.empty`, poisoned when POISON is set."""
    out = torch.empty(shape, dtype=dtype, device=device)
    return _poisoned(out) if POISON else out


def empty_like(t: torch.Tensor) -> torch.Tensor:
    """`torch.empty_like` (laid out like a dense `t`: a transposed view keeps its memory order),
    poisoned when POISON is set."""
    return _poisoned(torch.empty_like(t))


def _poisoned(out: torch.Tensor) -> torch.Tensor:
    if POISON:
        if out.dtype.is_floating_point:
            out.fill_(float("nan"))
        else:
            out.fill_(torch.iinfo(out.dtype).min)
    return out


@functools.lru_cache(maxsize=None)
def num_sms(device_index: int = 0) -> int:
    """Streaming multiprocessors of a CUDA device (callers pass their tensors' device, so mixed GPU
    models in one process get their own grids); under the interpreter a small number, so that
    persistent kernels still loop over several tiles per program in tests."""
    if INTERPRET:
        return 3
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.lru_cache(maxsize=None)
def capability(device_index: int = 0) -> tuple[int, int]:
    """A CUDA device's compute capability, looked up once: dispatch asks for it every call."""
    return torch.cuda.get_device_capability(device_index)


def autotune(configs: Iterable[triton.Config], **kwargs):
    """`triton.autotune`, as a kernel's list of candidate configs for a TunedLauncher (which times
    them itself, under the key its caller gives); under the interpreter, which cannot time
    configs, the first config alone."""
    configs = list(configs)
    if INTERPRET:
        configs = configs[:1]
        kwargs.pop("prune_configs_by", None)
    return triton.autotune(configs=configs, key=[], **kwargs)


# Set in a thread that only readies kernels: launchers start compiles (FastLaunch, TunedLauncher)
# but neither launch nor tune.
_COMPILE_ONLY = contextvars.ContextVar("tritonformer_compile_only", default=False)


def compiling_ahead() -> bool:
    """True in compile-only mode (compile_only, a warm-up), where launches only compile: a launcher
    skips work that launches nothing of its own (e.g. torch matmuls between its kernels). Never
    under torch.compile, which traces the real work (and cannot trace a context variable)."""
    return not torch.compiler.is_compiling() and _COMPILE_ONLY.get()


def _lower_priority() -> None:
    # Compiles (and the ptxas processes they start, which inherit the niceness) yield the CPU to
    # the thread that launches and autotunes: an autotuner timing configs while compiles crowd
    # the host measures their launch delays too (at bench e2e's attention shape it picked a dK/dV
    # config 11% slower than the best).
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
    except (AttributeError, OSError):
        pass


def _warmup(kernel, device, grid, args, kwargs) -> None:
    """Compile `kernel` for these arguments on `device` without launching it (a pool task)."""
    with torch.cuda.device(device):
        kernel.warmup(*args, grid=grid, **kwargs)


@functools.lru_cache(maxsize=None)
def _compile_pool() -> ThreadPoolExecutor:
    # Triton's passes, LLVM and ptxas run mostly outside the GIL: configs compile side by side
    # (measured 3.5 s -> 1.7 s for two attention configs on two cores). Its tasks never wait on
    # other tasks, so it cannot deadlock.
    return ThreadPoolExecutor(max_workers=min(16, os.cpu_count() or 1), thread_name_prefix="tritonformer-compile",
                              initializer=_lower_priority)


@functools.lru_cache(maxsize=None)
def _ahead_pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="tritonformer-ahead")


_compiled_ahead: set = set()
_background_jobs: list[Future] = []
_background_lock = threading.Lock()


def _in_background(pool: ThreadPoolExecutor, fn: Callable, *args) -> Future:
    future = pool.submit(fn, *args)
    with _background_lock:
        _background_jobs[:] = [f for f in _background_jobs if not f.done()]
        _background_jobs.append(future)
    return future


_log = logging.getLogger("tritonformer")
# Warm-ups (compile_ahead's jobs) that raised: one whose call no longer fits its launchers shows
# here (and in the debug log) instead of silently compiling nothing. A config that fails to compile
# is not counted: the autotuner times it as failing.
background_failures = 0


def _counting_failure(fn: Callable, *args):
    global background_failures
    try:
        return fn(*args)
    except Exception:
        with _background_lock:
            background_failures += 1
        _log.debug("tritonformer: a background warm-up failed", exc_info=True)
        raise


def _done_future() -> Future:
    future = Future()
    future.set_result(None)
    return future


def wait_for_background_work() -> None:
    """Return once every compile started in the background (compile_ahead, the compile pool) has
    finished. The benchmark calls it before timing: a compile thread sharing the host slows a
    host-bound call's launches (an attention forward+backward measured 1.15x SDPA flash in one
    run and 1.37-1.44x in others)."""
    while True:
        with _background_lock:
            if not _background_jobs:
                return
            job = _background_jobs.pop()
        job.exception()  # waits; a failed compile is reported by the launch that needs it


def compile_ahead(key, fn: Callable, *args) -> None:
    """Run `fn(*args)` once per key in a background thread in which launches only compile (see
    compile_only): a forward's first call readies its backward's kernels while the forward goes
    on (the first training step's warm-up). Its launches hand their compiles to the compile pool
    and return, and a real launch of the same kernel waits for that compile instead of starting
    its own. A failure is logged at debug level and counted in `background_failures`; the real
    call compiles again and reports it."""
    if INTERPRET or torch.compiler.is_compiling() or key in _compiled_ahead:
        return
    _compiled_ahead.add(key)
    device = torch.cuda.current_device()

    def job():
        with torch.cuda.device(device):
            compile_only(fn, *args)

    _in_background(_ahead_pool(), _counting_failure, job)


def compile_only(fn: Callable, *args, **kwargs):
    """`fn(*args, **kwargs)` with every launch in it only compiling its kernel (on the GPU, in the
    compile pool) and launching nothing, its outputs left unwritten; under the interpreter, which
    compiles nothing, a launch only notes its kernel and arguments. An op's `warm` entry runs in
    this mode: `launched_ahead()` then lists what it readied."""
    token = _COMPILE_ONLY.set(True)
    try:
        return fn(*args, **kwargs)
    finally:
        _COMPILE_ONLY.reset(token)


def warm(op: Callable, *args, **kwargs) -> None:
    """Ready the kernels of `op(*args, **kwargs)` and of its backward without launching any (see
    compile_only), on example tensors laid out as the real call's, those that will need a
    gradient requiring one: every op is its own warm-up entry, through the code a real call
    runs (`apply` takes the backward's place), so a warm-up cannot drift from the launches it
    readies. An HF model's first training step warms its ops this way (integrations.hf)."""
    compile_only(op, *args, **kwargs)


def apply(function: type[torch.autograd.Function], *args):
    """`function.apply(*args)`, the call an op makes where it needs autograd. In compile_only mode
    (an op's warm-up) it runs the function's forward and then its backward, on unwritten
    gradients laid out as the outputs, outside autograd, whose engine would run the backward on
    threads of its own where launches are real."""
    if not compiling_ahead():
        return function.apply(*args)
    ctx = _WarmContext(args)
    outputs = function.forward(ctx, *args)
    outs = outputs if isinstance(outputs, tuple) else (outputs,)
    # A Function that takes None for an unused output's gradient gets one for its first output
    # alone: its others are auxiliary (attention's lse), unused by a training step.
    grads = [torch.empty_like(o) if isinstance(o, torch.Tensor) and o.is_floating_point()
             and (ctx.materialize_grads or i == 0) else None for i, o in enumerate(outs)]
    function.backward(ctx, *grads)
    if any(ctx.needs_input_grad):
        # As autograd's outputs would: an op fed by this one then warms its backward too (not an
        # input handed back, nor an output marked non-differentiable).
        for o in outs:
            if (isinstance(o, torch.Tensor) and o.is_floating_point() and o.grad_fn is None and not o.requires_grad
                    and not any(o is a for a in args) and not any(o is n for n in ctx.non_differentiable)):
                o.requires_grad_(True)
    return outputs


class _WarmContext:
    """What an autograd Function's forward and backward use of their ctx, for `apply`'s warm-up."""

    def __init__(self, args: tuple):
        self.needs_input_grad = tuple(isinstance(a, torch.Tensor) and a.requires_grad for a in args)
        self.saved_tensors: tuple = ()
        self.non_differentiable: tuple = ()
        self.materialize_grads = True

    def save_for_backward(self, *tensors) -> None:
        self.saved_tensors = tensors

    def mark_dirty(self, *tensors) -> None:
        pass

    def mark_non_differentiable(self, *tensors) -> None:
        self.non_differentiable = tensors

    def set_materialize_grads(self, value: bool) -> None:
        self.materialize_grads = value


def launch_keys() -> set[tuple]:
    """(launcher, key) for every kernel specialization launched so far in this process (an
    autotuned kernel's by its tuning key): what a warm-up must have readied."""
    return _keys("chosen", "entries")


def launched_ahead() -> set[tuple]:
    """launch_keys()'s (launcher, key) for the kernels readied ahead and not launched for real
    since (an autotuned kernel's: every tuning key whose candidates compiled, ahead or not)."""
    return _keys("compiling", "compiling")


def _keys(tuned_attr: str, plain_attr: str) -> set[tuple]:
    # An autotuned kernel's FastLaunch holds one entry per chosen config: its TunedLauncher's tuning
    # key stands for them.
    tuned = {id(t.launch) for t in TunedLauncher.instances}
    keys = {(id(t), key) for t in TunedLauncher.instances for key in getattr(t, tuned_attr)}
    return keys | {(id(f), key) for f in FastLaunch.instances if id(f) not in tuned for key in getattr(f, plain_attr)}


def specialization_class(arg):
    """What Triton 3.x specializes a kernel argument on, as a hashable value: a tensor's dtype and
    16-byte alignment; an int's being 1, divisible by 16, and in 32-bit range; bools and None by
    value; floats not at all. Equal classes select the same compiled kernel."""
    if isinstance(arg, torch.Tensor):
        return arg.dtype, arg.data_ptr() % 16 == 0
    if arg is None or isinstance(arg, bool):
        return arg
    if isinstance(arg, int):
        return arg == 1, arg % 16 == 0, -(2**31) <= arg < 2**31
    if isinstance(arg, float):
        return float
    if isinstance(arg, (TensorDescriptor, GluonTensorDescriptor)):
        # Its shape and strides are passed as plain ints, not specialized; Gluon's has a layout.
        return type(arg), arg.base.dtype, tuple(arg.block_shape), arg.padding, getattr(arg, "layout", None)
    return arg


def _specialization_key(args: tuple) -> tuple:
    """tuple(map(specialization_class, args)) at about half the host time: plain tensors and ints,
    most of a launch's arguments, are classed inline (an int as a code of the same three facts,
    8 to 15, which no bool or other class equals)."""
    return tuple([(a.dtype, not a.data_ptr() % 16) if type(a) is torch.Tensor
                  else 8 + (a == 1) + 2 * (not a % 16) + 4 * (-2147483648 <= a < 2147483648) if type(a) is int
                  else specialization_class(a) for a in args])


class PlanTable(dict):
    """A dict that starts over at `limit` entries instead of growing without end (say, a plan for
    every sequence length of a varying batch)."""

    def __init__(self, limit: int = 4096):
        super().__init__()
        self.limit = limit

    def put(self, key, value) -> None:
        if len(self) >= self.limit:
            self.clear()
        self[key] = value


# Arguments that key a call as themselves; a tensor keys by its layout, anything else by its
# layout_key() (QuantizedTensor's).
_KEYED_AS_IS = frozenset({int, float, bool, str, type(None), torch.dtype})


def call_key(args: tuple) -> tuple:
    """The layout key of a call, which `planned` replays by: each tensor's shape, strides, dtype,
    16-byte alignment and device; an object with a layout_key() by it; the rest as themselves
    (hashable: numbers, strings, dtypes, None).
    Flat, built in a loop: 1.9 against 3.7 us a planned call with nested tuples built by a
    comprehension (Python 3.11, docs/runtime.md). A tensor's five entries start with its
    torch.Size, which no other argument is, so the flat tuple stays unambiguous."""
    key = []
    for a in args:
        if type(a) in _KEYED_AS_IS:
            key.append(a)
        elif isinstance(a, torch.Tensor):
            key += (a.shape, a.stride(), a.dtype, a.data_ptr() % 16, a.device)
        else:  # a QuantizedTensor; a number of another type (numpy's float64) as itself
            layout_key = getattr(a, "layout_key", None)
            key.append(a if layout_key is None else layout_key())
    return tuple(key)


def tf32_switch(*args) -> bool:
    """A `planned` key for launchers whose float32 products follow torch's tf32 switch (read from
    torch._C: torch.backends.cuda.matmul.allow_tf32 is a module __getattr__, 0.7 against 0.13 us)."""
    return torch._C._get_cublas_allow_tf32()


def input_precision(dtype: torch.dtype) -> str:
    """tl.dot's input_precision for operands of `dtype`: float32 products on tf32 tensor cores
    exactly when torch's matmul would use them (16-bit operands ignore it)."""
    return "ieee" if dtype == torch.float32 and not tf32_switch() else "tf32"


_PLANNING = contextvars.ContextVar("tritonformer_planning", default=None)


def planned(fn: Callable | None = None, *, key: Callable | None = None):
    """The host fast path every op shares (docs/runtime.md). A call of the decorated launcher is
    keyed by `call_key` of its positional arguments (and `key(*args)`, for what the layout does
    not show: the tf32 switch, a weight's address). The first call of a key runs the launcher,
    which hands `keep_plan` a replay: a function of the same arguments that allocates the outputs
    and replays the launches planned for them. Later calls of the key run the replay. No plan is
    kept in compile-only mode (launches there only compile) or where the launcher keeps none (a
    copy was made, a path without plan); calls with keyword arguments are not planned."""

    def decorate(fn: Callable) -> Callable:
        plans = PlanTable()
        _PLAN_TABLES.append(plans)
        compile_only = _COMPILE_ONLY.get  # bound once: a global and attribute lookup less a call

        @functools.wraps(fn)
        def call(*args, **kwargs):
            if kwargs or compile_only():
                return _plan(fn, args, kwargs)[0]
            plan_key = call_key(args) if key is None else (call_key(args), key(*args))
            replay = plans.get(plan_key)
            if replay is not None:
                return replay(*args)
            result, replay = _plan(fn, args, kwargs)
            if replay is not None:
                plans.put(plan_key, replay)
            return result

        call.plans = plans
        return call

    return decorate if fn is None else decorate(fn)


def _plan(fn: Callable, args: tuple, kwargs: dict) -> tuple:
    """fn's own path: (its result, the replay it kept or None)."""
    kept = []
    token = _PLANNING.set(kept)
    try:
        result = fn(*args, **kwargs)
    finally:
        _PLANNING.reset(token)
    return result, kept[-1] if kept else None


_PLAN_TABLES: list[PlanTable] = []


def clear_plans() -> None:
    """Forget every planned launch: the next call of each layout plans again (after a change of
    a launch setting that keys no plan, a test's monkeypatched threshold say)."""
    for plans in _PLAN_TABLES:
        plans.clear()


def keep_plan(replay: Callable) -> None:
    """Within a `planned` launcher's first call of a key: later calls of that key run `replay`
    on their arguments instead."""
    kept = _PLANNING.get()
    if kept is None:
        raise RuntimeError("keep_plan outside a planned launcher")
    kept.append(replay)


_thread_state = threading.local()


def _bind_cuda_context(device: int) -> None:
    """Make the CUDA context of `device` (the thread's current device) current on this thread,
    once a thread and device. Host-made tensor descriptors are encoded by the driver before a
    launch and need one, and a thread that has made no CUDA runtime call may have none: the
    autograd engine's own threads, where a backward can replay a planned launch as its first CUDA
    work ("invalid device context"). A thread that moves to another device binds that one too."""
    bound = getattr(_thread_state, "bound_devices", None)
    if bound is None:
        bound = _thread_state.bound_devices = set()
    elif device in bound:
        return
    torch.cuda.current_stream(device).query()  # a runtime call binds the primary context
    bound.add(device)


def _unspecialized_positions(kernel) -> tuple[int, ...]:
    """The positions of a kernel's do_not_specialize arguments: a JITFunction's params say it, the
    interpreter's wrapper keeps the names it was given."""
    if hasattr(kernel, "params"):
        return tuple(i for i, param in enumerate(kernel.params) if param.do_not_specialize)
    names = getattr(kernel, "kwargs", {}).get("do_not_specialize") or ()
    return tuple(name if isinstance(name, int) else kernel.arg_names.index(name) for name in names)


class FastLaunch:
    """`kernel[grid](*args, **kwargs)` at a fraction of the host cost, with the runtime arguments
    passed by position and the constexprs and launch options by keyword.

    JITFunction.run costs about 45 us a launch on the H100 machine's host (its argument binder
    alone 16 us), more than a small kernel's GPU time. The first launch for a specialization
    class of the arguments goes through it (compiling if needed); later ones call the compiled
    kernel's C launcher directly (`_direct_launch`). Under the interpreter, or while a profiler
    has set a launch hook, every launch takes the ordinary path."""

    instances: list["FastLaunch"] = []

    def __init__(self, kernel):
        self.kernel = kernel
        self.entries: dict[tuple, tuple] = {}
        self.compiling: dict[tuple, Future] = {}
        # The ints the kernel does not specialize on, which key by their width alone (Triton's
        # signature: i32 or i64), so that one compile serves every value (a warm-up's too).
        self.unspecialized = _unspecialized_positions(kernel)
        FastLaunch.instances.append(self)

    def __call__(self, grid: tuple, *args, **kwargs) -> tuple:
        """Launch; returns the entry that `replay` takes for later arguments of this class."""
        device = None if INTERPRET else torch.cuda.current_device()
        classes = _specialization_key(args)
        if self.unspecialized:
            classes = tuple(8 + 4 * (-2147483648 <= a < 2147483648) if i in self.unspecialized and type(a) is int else c
                            for i, (a, c) in enumerate(zip(args, classes)))
        key = device, classes, tuple(kwargs.items())
        entry = self.entries.get(key)
        if _COMPILE_ONLY.get():
            if entry is None and key not in self.compiling:
                self.compiling[key] = (_done_future() if INTERPRET else
                                       _in_background(_compile_pool(), _warmup, self.kernel, device, grid, args, kwargs))
            return entry
        if entry is None:
            pending = self.compiling.pop(key, None)
            if pending is not None:
                pending.exception()  # compiled ahead: the launch below finds it in Triton's cache
            if device is not None:
                _bind_cuda_context(device)
            compiled = self.kernel[grid](*args, **kwargs)
            constexprs = tuple(kwargs[name] for name in self.kernel.arg_names[len(args):])
            entry = self.entries[key] = (compiled, constexprs, kwargs, None if INTERPRET else _direct_launch(compiled))
        else:
            self.replay(entry, grid, *args)
        return entry

    def replay(self, entry: tuple, grid: tuple, *args) -> None:
        """Launch the entry's kernel on new arguments of the same class."""
        compiled, constexprs, kwargs, direct = entry
        hook = triton.knobs.runtime.launch_enter_hook
        if INTERPRET or (hook is not None and getattr(hook, "calls", True)):
            self.kernel[grid](*args, **kwargs)
            return
        # A replay follows a launch, which initialized CUDA: torch.cuda.current_device()'s lazy-init
        # checks are three Python calls more a launch.
        device = torch._C._cuda_getDevice()
        _bind_cuda_context(device)
        grid_x, grid_y, grid_z = grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1
        stream = torch._C._cuda_getCurrentRawStream(device)
        if direct is None:
            compiled.run(grid_x, grid_y, grid_z, stream, compiled.function, compiled.packed_metadata,
                         None, None, None, *args, *constexprs)
            return
        launcher, descriptors, cooperative, pdl = direct
        if descriptors:
            args = list(args)
            for position, meta, meta_key in reversed(descriptors):
                args[position:position + 1] = _encoded_descriptor(args[position], meta, meta_key)
        # The C launcher's leading arguments, as Triton's CudaLauncher passes them: no global or
        # profile scratch (_direct_launch took only kernels without), no launch metadata or hooks.
        launcher(grid_x, grid_y, grid_z, stream, compiled.function, cooperative, pdl, None, None,
                 compiled.packed_metadata, None, None, None, *args, *constexprs)


def _direct_launch(compiled) -> tuple | None:
    """(C launcher, tensor-descriptor arguments as (position, metadata, metadata key), cooperative
    grid, PDL) for a launch that skips Triton 3.6's Python layers around the C launcher, or None
    where it cannot: the kernel needs scratch memory, or the launcher is not laid out as in 3.6.
    Those layers cost about 10 us a launch on the H100 machine, and encoding a tensor descriptor
    there about 2 us, which `_encoded_descriptor` does once an address."""
    run = compiled.run
    if (getattr(run, "global_scratch_size", 1) or getattr(run, "profile_scratch_size", 1)
            or not hasattr(run, "launch_pdl")):
        return None
    launch = run.launch
    code = getattr(launch, "__code__", None)
    if code is None:  # the C launcher itself: no descriptor arguments
        return launch, (), run.launch_cooperative_grid, run.launch_pdl
    cells = dict(zip(code.co_freevars, (cell.cell_contents for cell in launch.__closure__ or ())))
    if not {"launcher", "tensordesc_indices", "tensordesc_meta"} <= cells.keys():
        return None
    metas = cells["tensordesc_meta"]
    if not metas or None in metas:  # descriptors Triton decomposes without metadata
        return None
    descriptors = tuple(
        (position, meta, (meta["swizzle"], meta["elem_size"], meta["elem_type"], tuple(meta["block_size"]),
                          meta["fp4_padded"]))
        for position, meta in zip(sorted(cells["tensordesc_indices"]), metas))
    return cells["launcher"], descriptors, run.launch_cooperative_grid, run.launch_pdl


_encoded_descriptors = PlanTable()


def _encoded_descriptor(desc, meta: dict, meta_key: tuple) -> list:
    """The C launcher's arguments for a host tensor descriptor (the encoded CUtensorMap, then the
    shape and strides), encoded once for each address, shape, strides and compiled layout: the
    map is a function of these alone, so a replay over the same tensors (a benchmark's, a
    weight's) reuses it."""
    key = (meta_key, desc.base.data_ptr(), tuple(desc.shape), tuple(desc.strides), desc.padding)
    encoded = _encoded_descriptors.get(key)
    if encoded is None:
        from triton.backends.nvidia.driver import make_tensordesc_arg

        encoded = make_tensordesc_arg(desc, meta)
        _encoded_descriptors.put(key, encoded)
    return encoded


class TunedLauncher:
    """Launches an autotuned kernel. The first call for a key chooses a config by timing each
    candidate as the chosen one will run (through `fitted`'s arguments: host-made tensor
    descriptors of the config's own tile); later calls launch the chosen config through
    FastLaunch, skipping the autotuner's per-call work (20-45 us of host time measured on the
    H100 machine, more than a small matmul's GPU time). `grid(config)` maps the config's
    meta-parameters to the launch grid. Choices are kept on disk (KEEP_TUNING)."""

    instances: list["TunedLauncher"] = []

    def __init__(self, autotuned, tuning_ms: tuple[float, float] = (10, 40)):
        self.autotuned = autotuned
        self.tuning_ms = tuning_ms  # do_bench's (warmup, rep) a candidate: see _tuning_bench
        self.launch = FastLaunch(autotuned.fn)
        self.chosen: dict[tuple, dict] = {}
        self.timings: dict[tuple, list[tuple[dict, float]]] = {}
        self.compiling: dict[tuple, list[Future]] = {}
        TunedLauncher.instances.append(self)

    @classmethod
    def chosen_configs(cls) -> dict[str, dict[str, dict]]:
        """Every config chosen so far, by kernel name and key (what a benchmark run tuned to), with
        the candidates' tuning times in ms (timed here or read from disk)."""
        return {t.autotuned.fn.__name__: {repr(key): dict(config, tuning_ms=t.timings.get(key))
                                           for key, config in t.chosen.items()}
                for t in cls.instances if t.chosen}

    def __call__(self, key: tuple, grid: Callable[[dict], tuple], *args, fitted: Callable | None = None,
                 **kwargs) -> tuple | None:
        """Launch; returns (FastLaunch entry, grid) for replays (None in compile_ahead's thread).
        `args` and `kwargs` are what the candidates are pruned on; `fitted(config) -> (args,
        kwargs)`, when given, are what a config runs with (host-side tensor descriptors, whose
        type includes the config's tile shape)."""
        config = self.chosen.get(key)
        if config is None:
            candidates = self._candidates(args, kwargs)

            def arguments(config: dict) -> tuple[tuple, dict]:
                return fitted(config) if fitted is not None else (args, kwargs)

            timed = self._timed(candidates)
            record = _TuningRecord(self.autotuned.fn, key, candidates) if KEEP_TUNING and timed else None
            known = record.load() if record else None
            # A choice read from disk compiles alone; otherwise every candidate, side by side.
            self._compile_candidates(key, grid, candidates if known is None else [candidates[_fastest(known)]],
                                     arguments)
            if _COMPILE_ONLY.get():
                return None
            if known is None and timed:
                known = self._time_candidates(grid, candidates, arguments)
                if record:
                    record.save(known)
            if known is not None:
                self.timings[key] = [(c.all_kwargs(), round(t, 5)) for c, t in zip(candidates, known)]
            config = self.chosen[key] = candidates[_fastest(known) if known else 0].all_kwargs()
        elif _COMPILE_ONLY.get():
            return None
        if fitted is not None:
            args, kwargs = fitted(config)
        config_grid = grid(config)
        return self.launch(config_grid, *args, **kwargs, **config), config_grid

    @staticmethod
    def _timed(candidates) -> bool:
        # The interpreter cannot time configs, and a single candidate needs no timing.
        return not INTERPRET and len(candidates) > 1

    def _candidates(self, args, kwargs) -> list[triton.Config]:
        configs, prune = self.autotuned.configs, self.autotuned.early_config_prune
        if prune and len(configs) > 1:
            configs = prune(configs, dict(zip(self.autotuned.fn.arg_names, args)), **kwargs)
        return configs

    def _compile_candidates(self, key, grid, candidates, arguments: Callable) -> None:
        """Compile the candidates side by side and wait for them; in compile_ahead's thread, only
        start them."""
        futures = self.compiling.get(key)
        if INTERPRET:
            if _COMPILE_ONLY.get():
                self.compiling[key] = []  # nothing to compile: the key notes what was readied
            return
        if futures is None:
            device = torch.cuda.current_device()
            futures = self.compiling[key] = []
            for c in candidates:
                config = c.all_kwargs()
                c_args, c_kwargs = arguments(config)
                futures.append(_in_background(_compile_pool(), _warmup, self.autotuned.fn, device, grid(config),
                                              c_args, {**c_kwargs, **config}))
        if _COMPILE_ONLY.get():
            return
        for future in futures:
            future.exception()  # a config that fails to compile is timed as failing

    def _time_candidates(self, grid, candidates, arguments: Callable) -> list[float]:
        def run_time(c: triton.Config) -> float:
            config = c.all_kwargs()
            c_args, c_kwargs = arguments(config)
            c_grid = grid(config)
            try:
                # Through FastLaunch: JITFunction.run with host-made descriptors takes over 100 us
                # of host time a call on the H100 machine, more than do_bench's L2 flush hides,
                # and timed 1024^3 at 35-48 us for every config (GPU time 7-11).
                return _tuning_bench(lambda: self.launch(c_grid, *c_args, **c_kwargs, **config), *self.tuning_ms)
            except (OutOfResources, CompileTimeAssertionFailure, PTXASError):
                return math.inf

        return _round_times(candidates, run_time)


def _fastest(times: list[float]) -> int:
    return min(range(len(times)), key=times.__getitem__)


# Candidates are timed once each; the fastest TUNING_FINALISTS are timed TUNING_ROUNDS - 1 more
# times, alternating, and their median round decides. One timing each picked differently from
# run to run where configs were within a few percent (16x14336x4096 took 60.0 us cold on one
# run's pick, 49.4 on the next run's).
TUNING_ROUNDS = 3
TUNING_FINALISTS = 3


def _round_times(candidates: list, run_time: Callable) -> list[float]:
    """Each candidate's time: its median round for the finalists, its one round for the rest."""
    rounds = [[run_time(c)] for c in candidates]
    finalists = sorted(range(len(candidates)), key=lambda i: rounds[i][0])[:TUNING_FINALISTS]
    for _ in range(TUNING_ROUNDS - 1):
        for i in finalists:
            rounds[i].append(run_time(candidates[i]))
    return [sorted(r)[len(r) // 2] for r in rounds]


def _tuning_bench(fn, warmup_ms: float, rep_ms: float) -> float:
    # Triton's default times each config for 25 + 100 ms; 10 + 40 ms still gives a kernel of
    # 1 ms forty samples, and a first training step tunes a dozen configs (launchers of kernels
    # of tens of us take less: TunedLauncher's tuning_ms). do_bench clears the L2 before each
    # run, as the benchmark does.
    from triton.testing import do_bench

    return do_bench(fn, warmup=warmup_ms, rep=rep_ms)


class _TuningRecord:
    """The candidates' times for one tuning key, in Triton's cache directory: a later process
    with the same kernel source, Triton, GPU and candidate list reads them instead of timing."""

    def __init__(self, fn, key: tuple, candidates: list):
        from triton.runtime.cache import get_cache_manager

        while not isinstance(fn, triton.runtime.JITFunction):
            fn = fn.fn
        parts = ["tritonformer tuning 1", triton.__version__, torch.cuda.get_device_name(), fn.cache_key,
                 repr(key), *map(str, candidates)]
        self.cache = get_cache_manager(hashlib.sha256("\n".join(parts).encode()).hexdigest())
        self.name = f"{fn.__name__[:150]}.tuning.json"
        self.count = len(candidates)

    def load(self) -> list[float] | None:
        path = self.cache.get_file(self.name)
        if path is None:
            return None
        with open(path) as f:
            times = json.load(f)["times_ms"]
        return [math.inf if t is None else t for t in times] if len(times) == self.count else None

    def save(self, times: list[float]) -> None:
        self.cache.put(json.dumps({"times_ms": [None if math.isinf(t) else t for t in times]}), self.name,
                       binary=False)


def rebased(desc: TensorDescriptor | GluonTensorDescriptor,
            base: torch.Tensor) -> TensorDescriptor | GluonTensorDescriptor:
    """desc over another tensor of the same dtype, shape, strides and alignment (a replay's key
    fixes them all), without running the constructor's checks again (a few us a call)."""
    out = object.__new__(type(desc))  # Triton's descriptor or Gluon's
    out.__dict__.update(desc.__dict__, base=base)
    return out


_stream_buffers: dict[tuple, torch.Tensor] = {}


# Buffers handed out during a CUDA graph capture, kept alive for the graphs that read them.
_captured_buffers: dict[int, torch.Tensor] = {}


def _stream_buffer(kind: str, device: torch.device, count: int, make: Callable[[int], torch.Tensor]) -> torch.Tensor:
    """A buffer of at least `count` elements kept for (kind, device, stream): launches on one
    stream run one after another and can share it, launches on two streams could not."""
    if device.type == "cuda" and device.index is None:  # torch.device("cuda"): the current one
        device = torch.device("cuda", torch.cuda.current_device())
    key = (kind, device, 0 if INTERPRET else torch._C._cuda_getCurrentRawStream(device.index))
    buffer = _stream_buffers.get(key)
    if buffer is None or buffer.numel() < count:
        buffer = _stream_buffers[key] = make(count)
    if not INTERPRET and torch.cuda.is_current_stream_capturing():
        # A CUDA graph keeps this address: a later, larger request must not free it.
        _captured_buffers[buffer.data_ptr()] = buffer
    return buffer


def arrival_counters(device: torch.device, count: int) -> torch.Tensor:
    """At least `count` int32 counters, zero between launches, for kernels whose programs count
    their arrival and whose last arrival resets the counter (split-K's in-kernel reduction): a
    memset launch a call is what this saves."""
    return _stream_buffer("counters", device, count,
                          lambda n: torch.zeros(max(n, 1024), dtype=torch.int32, device=device))


def workspace(device: torch.device, count: int) -> torch.Tensor:
    """At least `count` float32 elements for a kernel that writes and reads them within one
    launch (split-K's partial sums), or for the launch right after it on the same stream
    (attention's dK/dV parts), kept from call to call: an allocation costs about 7 us of
    host time on the H100 machine, as much as a small product's GPU time."""
    return _stream_buffer("workspace", device, count, lambda n: torch.empty(n, dtype=torch.float32, device=device))


def split_k_scratch(c: torch.Tensor, split: int, partials: int, counters: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(float32 workspace of `partials` elements, `counters` arrival counters) for a split-K
    kernel that adds its partial sums in the last split to arrive; c stands in for both when K is
    not split (the kernel then touches neither)."""
    if split == 1:
        return c, c
    return workspace(c.device, partials), arrival_counters(c.device, counters)


# The package's name: a second copy loaded under another name (scripts/host_time.py --against)
# registers its ops apart.
OPS_NAMESPACE = __name__.split(".")[0]
_LIBRARY = torch.library.Library(OPS_NAMESPACE, "FRAGMENT")


def custom_op(name: str, fake: Callable, mutates_args: tuple[str, ...] = ()):
    """Register a launcher as `torch.ops.tritonformer.<name>` so that torch.compile traces it as
    one opaque node. Eager calls skip the dispatcher and run the launcher; they then bump the
    version counters of the tensors it wrote in place, as the dispatcher would, so that autograd
    refuses a graph whose saved tensors were overwritten (a second backward through a retained
    graph) instead of computing with them. The op is defined through torch.library.Library, not
    torch.library.custom_op: a compiled graph calls it about 7 us faster (custom_op's Python
    wrappers for autograd and aliasing checks; runtime.md), and our autograd is the Functions'."""

    def wrap(launcher: Callable) -> Callable:
        _LIBRARY.define(name + torch.library.infer_schema(launcher, mutates_args=mutates_args))
        _LIBRARY.impl(name, launcher, "CompositeExplicitAutograd")
        torch.library.register_fake(f"{OPS_NAMESPACE}::{name}", fake, lib=_LIBRARY)
        op = getattr(getattr(torch.ops, OPS_NAMESPACE), name).default
        params = list(inspect.signature(launcher).parameters)
        mutated = [(params.index(arg), arg) for arg in mutates_args]

        @functools.wraps(launcher)
        def call(*args, **kwargs):
            if torch.compiler.is_compiling():
                return op(*args, **kwargs)
            out = launcher(*args, **kwargs)
            for index, arg in mutated:
                t = args[index] if index < len(args) else kwargs.get(arg)
                if t is not None:
                    torch.autograd.graph.increment_version(t)
            return out

        return call

    return wrap


def cdiv(a: int, b: int) -> int:
    """triton.cdiv for the host: Triton 3.6's is a constexpr function whose call costs about 1.7 us
    of host time (measured on a CPU-only machine), several a launch on paths where each microsecond shows."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """triton.next_power_of_2 for the host (see cdiv); 1 for n <= 1."""
    return 1 << (n - 1).bit_length() if n > 1 else 1


FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _dtype_names(dtypes: Iterable[torch.dtype]) -> str:
    return ", ".join(str(d).replace("torch.", "") for d in dtypes)


def check_tensor(name: str, t, dtypes: Sequence[torch.dtype] | None = FLOAT_DTYPES, min_dim: int = 0) -> None:
    """Raise TypeError/ValueError naming `name` when `t` is not a tensor on the kernel device
    with one of `dtypes` and at least `min_dim` dimensions."""
    # The common case in one expression: every op checks its inputs on each call, and on the
    # H100 machine's host each microsecond of a small op's path shows in its time.
    if (isinstance(t, torch.Tensor) and (dtypes is None or t.dtype in dtypes) and _on_kernel_device(t)
            and t.dim() >= min_dim):
        return
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dtypes is not None and t.dtype not in tuple(dtypes):
        raise TypeError(f"{name} has dtype {t.dtype}; supported: {_dtype_names(dtypes)}")
    if t.device.type != DEVICE:
        where = "a CUDA device" if DEVICE == "cuda" else "the CPU (no GPU here: Triton's interpreter runs the kernels)"
        raise ValueError(f"{name} is on {t.device}; tritonformer kernels need it on {where}")
    raise ValueError(f"{name} must have at least {min_dim} dimension(s), got shape {tuple(t.shape)}")


def _on_kernel_device(t: torch.Tensor) -> bool:
    return t.is_cpu if INTERPRET else t.is_cuda


def check_no_grad(op: str, **tensors: torch.Tensor | None) -> None:
    """Raise ValueError naming the first of `tensors` that requires grad where `op` has no backward
    for it: its output would silently carry no gradient back to it."""
    if not torch.is_grad_enabled():
        return
    for name, t in tensors.items():
        if isinstance(t, torch.Tensor) and t.requires_grad:
            raise ValueError(f"{name} requires grad, but {op} has no backward with respect to it; pass "
                             f"{name}.detach() or call it under torch.no_grad()")


def check_same_device(**tensors: torch.Tensor | None) -> None:
    """All the given tensors (None skipped) on one device; a non-tensor is named as such."""
    first_name = first = None
    for name, t in tensors.items():
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if first is None:
            first_name, first = name, t
        elif t.device != first.device:
            raise ValueError(f"{name} is on {t.device} but {first_name} is on {first.device}")


def rows_view(t: torch.Tensor, n: int) -> torch.Tensor:
    """`t` as (rows, n) with unit column stride: a view where the strides allow one, else a copy.
    `t`'s last dimension is n (reshape cannot infer the rows when n is 0)."""
    rows = t.reshape(math.prod(t.shape[:-1]), n)
    return rows if rows.stride(1) == 1 or n <= 1 else rows.contiguous()


def starts_as(*pairs: torch.Tensor | None) -> bool:
    """Whether each rows_view (first of a pair, None skipped) starts where its tensor (second)
    does, i.e. is a view and not a copy: a planned launch replays on the caller's tensors, so
    only calls whose views did not copy can plan."""
    return all(pairs[i] is None or pairs[i].data_ptr() == pairs[i + 1].data_ptr() for i in range(0, len(pairs), 2))


def needs_int64(*tensors: torch.Tensor) -> bool:
    """Whether an element offset into any of these tensors' storage can pass 2^31 - 1."""
    return any(t.untyped_storage().nbytes() // t.element_size() >= 2**31 for t in tensors)
