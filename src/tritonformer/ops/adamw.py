"""AdamW's update of many tensors in one launch (what `tritonformer.optim.AdamW` runs), as torch's
AdamW computes it:

    step += 1
    p  = p * (1 - lr * weight_decay)
    m  = m + (1 - beta1) * (g - m)
    v  = beta2 * v + (1 - beta2) * g^2            (amsgrad: v_max = max(v_max, v), read below)
    p  = p - lr / (1 - beta1^step) * m / (sqrt(v) / sqrt(1 - beta2^step) + eps)

`adamw_step(params, grads, exp_avgs, exp_avg_sqs, steps, ...)` updates lists of tensors in place
(`steps`: one float32 count a tensor, on its device). Each tensor's elements are addressed as an
offset from the first tensor of its list, so one launch covers every tensor of a dtype: programs
of BLOCK elements find their tensor and block in a work table. The tables live on the device,
keyed by the tensors' addresses (gradients set to None between steps come back at the same
addresses, so a step looks them up); a CUDA graph reads the ones copied while it was captured.
Arithmetic in float32, stored in the tensors' dtype. Design: docs/optim.md.
"""

from __future__ import annotations

import functools
import math
import struct

import torch
import triton
import triton.language as tl

from .. import runtime

# A work row is BLOCK elements of one tensor, which its program updates SUB_BLOCK at a time on
# NUM_WARPS warps (8 elements a thread and stream in 16-bit: one 16-byte load). Tuned on the H200
# (docs/optim.md).
BLOCK = 4096
SUB_BLOCK = 1024
NUM_WARPS = 4
# Columns of a tensor's row in the address table: its element count, then the offsets of its param,
# grad, exp_avg, exp_avg_sq, max_exp_avg_sq and step from those of the first tensor with elements
# (an empty tensor's are 0 but its step's: _plan).
_COLUMNS = 7
# Rows of the coefficient table: step size, sqrt of the second bias correction, weight decay factor.
_COEFFICIENTS = 3
# Tensors whose step a program of the coefficient kernel counts.
_ROWS = 128


@triton.jit
def _inverse_bias_correction(step, log_beta_hi, log_beta_lo):
    """1 / (1 - beta^step), in float64: 1 - 0.999^1 in float32 keeps half its digits. log(beta)
    comes as a float32 pair whose sum is its float64 value."""
    log_beta = tl.cast(log_beta_hi, tl.float64) + tl.cast(log_beta_lo, tl.float64)
    return 1.0 / (1.0 - tl.exp(step.to(tl.float64) * log_beta))


# lr_in_tensor is a runtime flag, not a constexpr: capture_step moves a float lr into a tensor
# between a step's first call and its capture, and a compile must not fall inside a capture. rows
# unspecialized: the warm-up launches with none, and its compile must serve every real count.
@triton.jit(do_not_specialize=["lr_in_tensor", "rows"])
def _coefficients_kernel(table_ptr, coefficients_ptr, step_ptr, lr_ptr, lr, lr_in_tensor, rows, log_beta1_hi,
                         log_beta1_lo, log_beta2_hi, log_beta2_lo, weight_decay, ROWS: tl.constexpr):
    """Counts each tensor's step and writes its coefficients, once a step: the update's programs
    then read three floats instead of each working out float64 powers (docs/optim.md)."""
    row = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    ok = row < rows
    step_at = step_ptr + tl.load(table_ptr + row * 7 + 6, mask=ok, other=0)  # _COLUMNS
    step = tl.load(step_at, mask=ok, other=0.0) + 1.0
    tl.store(step_at, step, mask=ok)
    if lr_in_tensor != 0:
        lr = tl.load(lr_ptr).to(tl.float32)
    step_size = (lr * _inverse_bias_correction(step, log_beta1_hi, log_beta1_lo)).to(tl.float32)
    sqrt_bias_correction2 = tl.sqrt(1.0 / _inverse_bias_correction(step, log_beta2_hi, log_beta2_lo)).to(tl.float32)
    decay = 1.0 - lr * weight_decay
    out = coefficients_ptr + row * 3  # _COEFFICIENTS
    tl.store(out, step_size, mask=ok)
    tl.store(out + 1, sqrt_bias_correction2, mask=ok)
    tl.store(out + 2, tl.full([ROWS], 0, tl.float32) + decay, mask=ok)


@triton.jit
def _load(ptr, ok, MASKED: tl.constexpr):
    if MASKED:
        return tl.load(ptr, mask=ok, other=0.0).to(tl.float32)
    return tl.load(ptr).to(tl.float32)


@triton.jit
def _store(ptr, value, ok, MASKED: tl.constexpr):
    if MASKED:
        tl.store(ptr, value.to(ptr.dtype.element_ty), mask=ok)
    else:
        tl.store(ptr, value.to(ptr.dtype.element_ty))


@triton.jit
def _update(p_ptr, g_ptr, m_ptr, v_ptr, vmax_ptr, idx, ok, step_size, sqrt_bias_correction2, decay, beta1_complement,
            beta2, beta2_complement, eps, MAXIMIZE: tl.constexpr, AMSGRAD: tl.constexpr, MASKED: tl.constexpr):
    """One sub-block's update (the pointers at its tensor's start, idx its elements)."""
    g = _load(g_ptr + idx, ok, MASKED)
    p = _load(p_ptr + idx, ok, MASKED)
    m = _load(m_ptr + idx, ok, MASKED)
    v = _load(v_ptr + idx, ok, MASKED)
    if MAXIMIZE:
        g = -g
    p = p * decay
    m = m + beta1_complement * (g - m)
    v = v * beta2 + beta2_complement * g * g
    _store(m_ptr + idx, m, ok, MASKED)
    _store(v_ptr + idx, v, ok, MASKED)
    if AMSGRAD:
        v = tl.maximum(_load(vmax_ptr + idx, ok, MASKED), v)
        _store(vmax_ptr + idx, v, ok, MASKED)
    # Rounded divisions and square root, as torch's AdamW: float32 params keep its last bits.
    denom = tl.div_rn(tl.sqrt_rn(v), sqrt_bias_correction2) + eps
    _store(p_ptr + idx, p - step_size * tl.div_rn(m, denom), ok, MASKED)


@triton.jit
def _adamw_kernel(
    table_ptr, work_ptr, coefficients_ptr, p_ptr, g_ptr, m_ptr, v_ptr, vmax_ptr, beta1_complement, beta2,
    beta2_complement, eps, MAXIMIZE: tl.constexpr, AMSGRAD: tl.constexpr, VEC: tl.constexpr, BLOCK: tl.constexpr,
    SUB_BLOCK: tl.constexpr,
):
    work = tl.program_id(0).to(tl.int64)
    tensor = tl.load(work_ptr + 2 * work).to(tl.int64)
    block = tl.load(work_ptr + 2 * work + 1).to(tl.int64)
    row = table_ptr + tensor * 7  # _COLUMNS
    n = tl.load(row)
    # Offsets come in units of VEC elements (16 bytes where every tensor starts on 16 bytes): the
    # compiler then knows each block starts aligned and issues 16-byte loads (docs/optim.md).
    p_ptr += tl.load(row + 1) * VEC
    g_ptr += tl.load(row + 2) * VEC
    m_ptr += tl.load(row + 3) * VEC
    v_ptr += tl.load(row + 4) * VEC
    if AMSGRAD:
        vmax_ptr += tl.load(row + 5) * VEC
    coefficients = coefficients_ptr + tensor * 3  # _COEFFICIENTS
    step_size = tl.load(coefficients)
    sqrt_bias_correction2 = tl.load(coefficients + 1)
    decay = tl.load(coefficients + 2)
    for start in tl.range(block * BLOCK, block * BLOCK + BLOCK, SUB_BLOCK):
        idx = start + tl.arange(0, SUB_BLOCK)
        # Whole sub-blocks load without a mask: a mask against an element count of unknown
        # divisibility would split the 16-byte loads into single elements.
        if start + SUB_BLOCK <= n:
            _update(p_ptr, g_ptr, m_ptr, v_ptr, vmax_ptr, idx, None, step_size, sqrt_bias_correction2, decay,
                    beta1_complement, beta2, beta2_complement, eps, MAXIMIZE, AMSGRAD, False)
        elif start < n:
            _update(p_ptr, g_ptr, m_ptr, v_ptr, vmax_ptr, idx, idx < n, step_size, sqrt_bias_correction2, decay,
                    beta1_complement, beta2, beta2_complement, eps, MAXIMIZE, AMSGRAD, True)


_launch = runtime.FastLaunch(_adamw_kernel)
_launch_coefficients = runtime.FastLaunch(_coefficients_kernel)


class _Plan:
    """One launch's address and work tables on the device (`table`, `work`), the coefficient table
    its step writes (`coefficients`), the host buffer the tables were copied from (`host`: a CUDA
    graph that copied them replays that copy), whether a capture used it (`kept`: then it is never
    dropped), `first`, the index of the first tensor that has elements (the tables' bases), and
    `vec`, the elements an offset counts (16 bytes' worth, or 1)."""

    __slots__ = ("table", "work", "coefficients", "host", "kept", "first", "vec")

    def __init__(self, table, work, coefficients, host, kept, first, vec):
        self.table, self.work, self.coefficients, self.host = table, work, coefficients, host
        self.kept, self.first, self.vec = kept, first, vec

    @property
    def rows(self) -> int:
        return self.table.numel() // _COLUMNS


# Plans built outside a capture, by key, oldest first; at most _MAX_UNKEPT not used by a capture.
_PLANS: dict[tuple, _Plan] = {}
# A step inside backward (optim.AdamW's step_in_backward) launches once a parameter: a model's
# worth of plans and spare buffers must stay (a few hundred; 8 bytes a 4096-element block each).
_MAX_UNKEPT = 4096
# Plans built inside a capture: their tables are written when the graph replays, so they are kept
# alive for it but never looked up (a failed capture's would hold unwritten tables).
_CAPTURED: list[_Plan] = []
# A pinned buffer for each launch (device, size, first param's and step's addresses, which a
# capture keeps; at most _MAX_UNKEPT, the oldest dropped first), allocated outside any capture: a
# capturing stream allows no pinned allocation, and a captured step's gradients sit at new
# addresses, so its plan is built inside the capture.
_SPARE_HOST: dict[tuple, torch.Tensor] = {}


def _host_buffer(spare_key: tuple, size: int, device: torch.device, capturing: bool) -> torch.Tensor:
    if device.type != "cuda":
        return torch.empty(size, dtype=torch.int64)
    if capturing:
        spare = _SPARE_HOST.pop(spare_key, None)
        if spare is None:
            raise RuntimeError("adamw_step: no step of these tensors ran before the CUDA graph capture began; "
                               "run one outside the capture first (tritonformer.capture_step does)")
        return spare
    return torch.empty(size, dtype=torch.int64, pin_memory=True)


def _address_words(tensors: int) -> int:
    """int64 words of the address table, _COLUMNS a tensor, made even: the work table after it then
    starts on 16 bytes, as a warm-up's example table does (the kernel is compiled for that)."""
    return (tensors * _COLUMNS + 1) // 2 * 2


def _table_size(numels: list[int]) -> int:
    """int64 words of a launch's tables: the address table's, then one a block (two int32)."""
    return _address_words(len(numels)) + sum(runtime.cdiv(n, BLOCK) for n in numels)


def _plan(columns: tuple[list[torch.Tensor], ...], steps: list[torch.Tensor], spare_key: tuple,
          capturing: bool) -> _Plan:
    """Row j of the address table: tensor j's element count, then the offsets of its param, grad,
    exp_avg, exp_avg_sq, max_exp_avg_sq and step from those of the first tensor with elements (two
    tensors of one dtype lie whole elements apart), the first five in units of 16 bytes where
    every tensor starts on 16 bytes (an empty tensor's are 0: only its step counts). Row w of the
    work table: (tensor, block)."""
    first = next(j for j, p in enumerate(columns[0]) if p.numel())
    lists = [*columns, steps]
    bases = [column[first].data_ptr() for column in lists]
    sizes = [column[first].element_size() for column in lists]
    rows = [(n, *((column[j].data_ptr() - base) // size if n else 0
                  for column, base, size in zip(columns, bases, sizes)), (steps[j].data_ptr() - bases[5]) // sizes[5])
            for j, n in enumerate(map(torch.Tensor.numel, columns[0]))]
    vec = 16 // sizes[0]
    if all(base % 16 == 0 for base in bases[:5]) and all(off % vec == 0 for row in rows for off in row[1:6]):
        rows = [(row[0], *(off // vec for off in row[1:6]), row[6]) for row in rows]
    else:
        vec = 1
    counts = torch.tensor([runtime.cdiv(row[0], BLOCK) for row in rows])
    total = int(counts.sum())
    device = steps[0].device
    words = _address_words(len(rows))
    host = _host_buffer(spare_key, words + total, device, capturing)
    table, work = host[:len(rows) * _COLUMNS], host[words:].view(torch.int32)
    table.copy_(torch.tensor(rows).flatten())
    first_blocks = torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
    work.view(total, 2).copy_(torch.stack([torch.repeat_interleave(torch.arange(len(rows)), counts),
                                           torch.arange(total) - first_blocks], 1))
    if device.type == "cuda":
        table, work = table.to(device, non_blocking=True), work.to(device, non_blocking=True)
    coefficients = torch.empty(len(rows) * _COEFFICIENTS, dtype=torch.float32, device=device)
    return _Plan(table, work, coefficients, host, capturing, first, vec)


def _remember(key: tuple, plan: _Plan) -> None:
    if sum(not p.kept for p in _PLANS.values()) >= _MAX_UNKEPT:
        oldest = next(k for k, p in _PLANS.items() if not p.kept)
        del _PLANS[oldest]
    _PLANS[key] = plan


@functools.lru_cache(maxsize=64)
def _kernel_betas(beta1: float, beta2: float) -> tuple[float, ...]:
    """1 - beta1, beta2, 1 - beta2 (each rounded once to float32 from its float64 value), and
    log(beta1), log(beta2) as float32 pairs of hi + lo (log 0: -inf, 0)."""
    def pair(x: float) -> tuple[float, float]:
        if x == 0:
            return -math.inf, 0.0
        hi = struct.unpack("f", struct.pack("f", math.log(x)))[0]
        return hi, math.log(x) - hi

    return (1.0 - beta1, beta2, 1.0 - beta2, *pair(beta1), *pair(beta2))


def _check(params, grads, exp_avgs, exp_avg_sqs, steps, max_exp_avg_sqs, lr_tensor) -> None:
    lists = dict(grads=grads, exp_avgs=exp_avgs, exp_avg_sqs=exp_avg_sqs, steps=steps)
    if max_exp_avg_sqs:
        lists["max_exp_avg_sqs"] = max_exp_avg_sqs
    for name, items in lists.items():
        if len(items) != len(params):
            raise ValueError(f"{name} has {len(items)} tensors, params {len(params)}: one for each param")
    if lr_tensor is not None:
        runtime.check_tensor("lr", lr_tensor, (torch.float32, torch.float64))
        if lr_tensor.numel() != 1:
            raise ValueError(f"lr must hold one value, got shape {tuple(lr_tensor.shape)}")
    if not params:
        return
    dtype, device = params[0].dtype, params[0].device
    for i, p in enumerate(params):
        runtime.check_tensor(f"params[{i}]", p, runtime.FLOAT_DTYPES)
        if p.dtype != dtype or p.device != device:
            raise ValueError(f"params[{i}] is {p.dtype} on {p.device}, params[0] {dtype} on {device}: one launch "
                             "takes one dtype and device (tritonformer.optim.AdamW groups them)")
        for name, items in lists.items():
            t = items[i]
            if name == "steps":
                runtime.check_tensor(f"steps[{i}]", t, (torch.float32,))
                if t.numel() != 1 or t.device != device:
                    raise ValueError(f"steps[{i}] must be one float32 count on {device}, got shape "
                                     f"{tuple(t.shape)} on {t.device}")
            elif not isinstance(t, torch.Tensor) or t.shape != p.shape or t.dtype != dtype or t.device != device:
                what = (f"{t.dtype} of shape {tuple(t.shape)} on {t.device}" if isinstance(t, torch.Tensor)
                        else type(t).__name__)
                raise ValueError(f"{name}[{i}] is {what}; params[{i}] is {dtype} of shape {tuple(p.shape)} on "
                                 f"{device}: they must match")
            elif t.layout != torch.strided:
                raise ValueError(f"{name}[{i}] has layout {t.layout}: AdamW takes dense tensors")
    if len({t.data_ptr() for t in steps}) < len(steps):
        raise ValueError("steps holds one tensor twice: each param counts its own step")


def _fake_adamw_step(params, grads, exp_avgs, exp_avg_sqs, steps, max_exp_avg_sqs, lr, lr_tensor, beta1, beta2,
                     eps, weight_decay, maximize):
    return None


@runtime.custom_op("adamw_step", fake=_fake_adamw_step,
                   mutates_args=("params", "exp_avgs", "exp_avg_sqs", "steps", "max_exp_avg_sqs"))
def adamw_launch(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
                 exp_avg_sqs: list[torch.Tensor], steps: list[torch.Tensor], max_exp_avg_sqs: list[torch.Tensor],
                 lr: float, lr_tensor: torch.Tensor | None, beta1: float, beta2: float, eps: float,
                 weight_decay: float, maximize: bool) -> None:
    """adamw_step's launch, registered for torch.compile (the lr a float or a one-value tensor)."""
    if lr_tensor is None and not math.isfinite(lr):
        raise ValueError(f"lr must be finite, got {lr}")
    if not params:
        return
    amsgrad = bool(max_exp_avg_sqs)
    columns = (params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs if amsgrad else exp_avg_sqs)
    address, numel, contiguous = torch.Tensor.data_ptr, torch.Tensor.numel, torch.Tensor.is_contiguous
    if runtime.compiling_ahead():  # a warm-up (in a background thread): compile, and no CUDA work
        _launch_plan(_placeholder_plan(params), columns, steps, lr, lr_tensor, beta1, beta2, eps, weight_decay,
                     maximize, amsgrad)
        return
    # The plan of these tensors (their addresses, sizes and whether they are contiguous): checks,
    # copies and tables on a new key only.
    try:
        key = (params[0].dtype, amsgrad, None if lr_tensor is None else address(lr_tensor),
               all(all(map(contiguous, column)) for column in columns[:4 + amsgrad]),
               *(a for column in columns[:4 + amsgrad] for a in map(address, column)), *map(address, steps),
               *map(numel, params))
    except (TypeError, AttributeError):
        key = None
    device = params[0].device
    capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    plan = _PLANS.get(key)
    if plan is None:
        _check(params, grads, exp_avgs, exp_avg_sqs, steps, max_exp_avg_sqs, lr_tensor)
        if not all(t.is_contiguous() for column in columns for t in column):
            _step_on_contiguous_copies(columns, steps, lr, lr_tensor, beta1, beta2, eps, weight_decay, maximize)
            return
        if not any(map(numel, params)):
            torch._foreach_add_(steps, 1.0)
            return
    size = _table_size(list(map(numel, params))) if plan is None else plan.host.numel()
    spare_key = (device, size, params[0].data_ptr(), steps[0].data_ptr())
    if device.type == "cuda" and not capturing and spare_key not in _SPARE_HOST:
        if len(_SPARE_HOST) >= _MAX_UNKEPT:  # strided tensors' copies are new launches each call: the oldest goes
            del _SPARE_HOST[next(iter(_SPARE_HOST))]
        _SPARE_HOST[spare_key] = torch.empty(size, dtype=torch.int64, pin_memory=True)  # for a later capture
    if plan is None:
        plan = _plan(columns, steps, spare_key, capturing)
        if capturing:
            _CAPTURED.append(plan)
        else:
            _remember(key, plan)
    elif capturing:
        plan.kept = True
    _launch_plan(plan, columns, steps, lr, lr_tensor, beta1, beta2, eps, weight_decay, maximize, amsgrad)


def _placeholder_plan(params: list[torch.Tensor]) -> _Plan:
    """Empty tables laid out as a plan's (a warm-up's launch only compiles: it reads nothing)."""
    device = params[0].device
    return _Plan(torch.empty(0, dtype=torch.int64, device=device), torch.empty(0, dtype=torch.int32, device=device),
                 torch.empty(0, dtype=torch.float32, device=device), None, False, 0, 16 // params[0].element_size())


def _launch_plan(plan, columns, steps, lr, lr_tensor, beta1, beta2, eps, weight_decay, maximize, amsgrad) -> None:
    first = plan.first
    beta1_complement, beta2, beta2_complement, *log_betas = _kernel_betas(beta1, beta2)
    _launch_coefficients((max(1, runtime.cdiv(plan.rows, _ROWS)),), plan.table, plan.coefficients, steps[first],
                         steps[first] if lr_tensor is None else lr_tensor, lr, int(lr_tensor is not None), plan.rows,
                         *log_betas, weight_decay, ROWS=_ROWS, num_warps=4)
    _launch((max(1, plan.work.numel() // 2),), plan.table, plan.work, plan.coefficients,
            *(column[first] for column in columns), beta1_complement, beta2, beta2_complement, eps,
            MAXIMIZE=maximize, AMSGRAD=amsgrad, VEC=plan.vec, BLOCK=BLOCK, SUB_BLOCK=SUB_BLOCK, num_warps=NUM_WARPS)


def _step_on_contiguous_copies(columns, steps, lr, lr_tensor, beta1, beta2, eps, weight_decay, maximize) -> None:
    """The step of tensors some of which are strided: on contiguous copies, then copied back (the
    kernel walks each tensor's memory in order; the copies' plans, new each call, are the oldest
    dropped)."""
    amsgrad = columns[4] is not columns[3]
    copies = [[t.contiguous() for t in column] for column in columns[:4 + amsgrad]]
    adamw_launch(*copies[:4], steps, copies[4] if amsgrad else [], lr, lr_tensor, beta1, beta2, eps, weight_decay,
                 maximize)
    for column, copied in zip(columns[:1] + columns[2:], copies[:1] + copies[2:]):
        for t, c in zip(column, copied):
            if c is not t:
                t.copy_(c)


def adamw_step(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
               exp_avg_sqs: list[torch.Tensor], steps: list[torch.Tensor], *, lr: float | torch.Tensor,
               beta1: float = 0.9, beta2: float = 0.999, eps: float = 1e-8, weight_decay: float = 1e-2,
               maximize: bool = False, max_exp_avg_sqs: list[torch.Tensor] | None = None) -> None:
    """One AdamW step over lists of tensors of one dtype and device, in place: params, exp_avgs,
    exp_avg_sqs (and max_exp_avg_sqs: amsgrad) updated, each of `steps` (float32, one value each,
    on the params' device) counted up by one first. `lr` a float or a one-value tensor (read on the
    device: a CUDA graph replays with its value at the time)."""
    max_exp_avg_sqs = list(max_exp_avg_sqs or [])
    lr_tensor = lr if isinstance(lr, torch.Tensor) else None
    lr_value = 0.0 if lr_tensor is not None else lr
    adamw_launch(list(params), list(grads), list(exp_avgs), list(exp_avg_sqs), list(steps), max_exp_avg_sqs,
                 float(lr_value), lr_tensor, float(beta1), float(beta2), float(eps), float(weight_decay),
                 bool(maximize))


def adamw_step_reference(params, grads, exp_avgs, exp_avg_sqs, steps, *, lr, beta1=0.9, beta2=0.999, eps=1e-8,
                         weight_decay=1e-2, maximize=False, max_exp_avg_sqs=None) -> None:
    """The same step in torch, one tensor at a time, in the tensors' own dtype (float64 in the tests)."""
    lr = float(lr)
    for i, (p, g, m, v, step) in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs, steps)):
        step += 1
        g = -g if maximize else g
        p.mul_(1 - lr * weight_decay)
        m.lerp_(g, 1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        if max_exp_avg_sqs:
            torch.maximum(max_exp_avg_sqs[i], v, out=max_exp_avg_sqs[i])
            v = max_exp_avg_sqs[i]
        t = float(step)
        denom = v.sqrt() / math.sqrt(1 - beta2**t) + eps
        p.addcdiv_(m, denom, value=-lr / (1 - beta1**t))
