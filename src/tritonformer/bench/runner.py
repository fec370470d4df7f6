"""Runs the registry's benchmark cases: checks our result once, times every provider, and turns
the timings into rows (one per case and provider) that the report and the CLI consume.

On a GPU the timings come from `triton.testing.do_bench`. Under Triton's interpreter the
kernels run on the CPU, so the harness still exercises every case and check end to end, but its
timings measure the interpreter and say nothing about a GPU.
"""

from __future__ import annotations

import gc
import platform
import re
import statistics
import sys
import time
from typing import Any, Callable

import torch
import triton

from .. import runtime
from ..spec import Bench, BenchCase, OpSpec, short_dtype
from ..testing import check_close

OURS = "tritonformer"
CHECK_OK = "ok"
NO_REFERENCE = "no reference"

GPU_TIMER = "gpu: median of 5 rounds of triton do_bench medians, the rounds alternating the providers"
INTERPRETER_TIMER = "cpu-interpreter: perf_counter median, NOT GPU timings"

COLUMNS = [
    "op", "mode", "dtype", "shape", "x", "plot", "provider",
    "ms", "gbps", "tflops", "bytes", "flops", "peak_gib", "extra_gib",
    "best_peer", "speedup_vs_best_peer", "ours_speedup_vs_this", "frac_ceiling",
    "check", "error", "timer",
]

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)

# The interpreter runs a kernel in seconds: a few calls are enough to see the order of magnitude.
INTERPRETER_MAX_CALLS = 3
INTERPRETER_BUDGET_S = 1.0

COPY_CEILING_BYTES = 1 << 30
# One do_bench per provider, one provider after another, misreads: a case under 0.1 ms moves
# 10-15% between runs (the L2 flush's write-backs, clocks; softmax bf16 4096x4096 read 0.85x Liger
# in one, within 0.4% over five interleaved), and a matmul-bound one draws the GPU to its power
# limit (our bf16 8192^3 + bias read 0.83x cuBLAS + torch's bias in one bench run, 1.01x as the
# median of five alternating rounds, whose single rounds spread 1.47-1.78 ms). So every case is
# timed in this many rounds that alternate the providers, and each provider's median round is kept.
ROUNDS = 5
FP8_CEILING_SIZE = 8192


class UnknownOpError(ValueError):
    pass


def device_slug(device_name: str) -> str:
    """A directory-friendly name for a device: "NVIDIA H100 80GB HBM3" -> "h100"."""
    for chip in ("H100", "H200"):
        if chip in device_name.upper():
            return chip.lower()
    return re.sub(r"[^a-z0-9]+", "-", device_name.lower()).strip("-")


def registered_ops() -> dict[str, OpSpec]:
    # Looked up at call time so that the registry's ops (and tests replacing them) are seen as
    # they are now, and importing the runner does not import every op.
    from .. import registry

    return registry.OPS


# Names that stand for several ops: `bench moe` runs the mixture-of-experts pieces and block.
OP_GROUPS = {"moe": ("moe_route", "grouped_mm", "moe_experts", "gpt_oss_experts")}


def select_ops(names: list[str] | None) -> list[str]:
    """The registered op names to run, in the order asked (all of them when `names` is empty; a
    group of OP_GROUPS stands for its ops)."""
    ops = registered_ops()
    if not names:
        return list(ops)
    names = [op for name in names for op in OP_GROUPS.get(name, (name,))]
    unknown = [name for name in names if name not in ops]
    if unknown:
        raise UnknownOpError(f"unknown op(s): {', '.join(unknown)}; registered ops: {', '.join(sorted(ops))}; "
                             f"groups: {', '.join(sorted(OP_GROUPS))}")
    return list(dict.fromkeys(names))


# ---------------------------------------------------------------------------------------------
# Device description and ceilings


def device_info() -> dict[str, Any]:
    from .. import __version__

    info: dict[str, Any] = {
        "tritonformer": __version__,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "interpreter": runtime.INTERPRET,
        "gpu_timings": not runtime.INTERPRET,
    }
    if runtime.INTERPRET:
        cpu = platform.processor() or platform.machine()
        info.update(device=f"CPU ({cpu}) under Triton's interpreter", device_slug="cpu-interpreter", sm_count=None)
    else:
        props = torch.cuda.get_device_properties(0)
        info.update(
            device=props.name,
            device_slug=device_slug(props.name),
            sm_count=props.multi_processor_count,
            cuda=torch.version.cuda,
        )
    return info


def measure_ceilings(quick: bool) -> dict[str, Any]:
    """Device info plus, on a GPU, what the hardware reaches through vendor libraries: copy
    bandwidth and cuBLAS matmul rates that the report expresses our figures as a fraction of."""
    ceilings = device_info()
    if runtime.INTERPRET:
        return ceilings
    matmul_size = 4096 if quick else 8192
    measurements: dict[str, Callable[[], float]] = {
        "copy_gbps": _copy_gbps,
        "matmul_bf16_tflops": lambda: _bf16_matmul_tflops(matmul_size),
        "matmul_fp8_tflops": lambda: _fp8_matmul_tflops(FP8_CEILING_SIZE),
    }
    ceilings.update(matmul_bf16_size=matmul_size, matmul_fp8_size=FP8_CEILING_SIZE)
    errors = {}
    for key, measure in measurements.items():
        try:
            ceilings[key] = measure()
        except Exception as exc:  # an fp8-less GPU or too little memory: report, don't stop
            ceilings[key] = None
            errors[key] = describe_error(exc)
        free_device_memory()
    if errors:
        ceilings["ceiling_errors"] = errors
    return ceilings


def _gpu_median_ms(thunk: Callable[[], Any]) -> float:
    return triton.testing.do_bench(thunk, warmup=25, rep=100, return_mode="median")


def _copy_gbps() -> float:
    src = torch.empty(COPY_CEILING_BYTES, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = _gpu_median_ms(lambda: dst.copy_(src))
    return 2 * COPY_CEILING_BYTES / ms / 1e6  # one read and one write of every byte


def _bf16_matmul_tflops(size: int) -> float:
    a = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    ms = _gpu_median_ms(lambda: a @ b)
    return 2 * size**3 / ms / 1e9


def _fp8_matmul_tflops(size: int) -> float:
    a = torch.randn(size, size, device="cuda").to(torch.float8_e4m3fn)
    # cuBLAS fp8 wants the second operand column-major.
    b = torch.randn(size, size, device="cuda").to(torch.float8_e4m3fn).t()
    scale_a = torch.tensor(1.0, device="cuda")
    scale_b = torch.tensor(1.0, device="cuda")
    ms = _gpu_median_ms(lambda: torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=torch.bfloat16))
    return 2 * size**3 / ms / 1e9


def free_device_memory() -> None:
    gc.collect()
    if not runtime.INTERPRET:
        torch.cuda.empty_cache()


def describe_error(exc: BaseException) -> str:
    """The exception on one line (Triton compile errors span many), short enough for a cell."""
    text = " ".join(f"{type(exc).__name__}: {exc}".split())
    return text if len(text) <= 500 else text[:497] + "..."


# ---------------------------------------------------------------------------------------------
# Running cases


def run(ops: list[str] | None, quick: bool, progress: bool = True, ceilings: dict[str, Any] | None = None,
        on_case: Callable[[list[dict]], None] | None = None) -> list[dict]:
    """Rows (keys: COLUMNS) for every selected case and provider, ours first in each case and
    always present. `ceilings` (from `measure_ceilings`) fills `frac_ceiling`; without it that
    column stays empty. `on_case` gets each case's rows as soon as they are measured."""
    specs = registered_ops()
    cases = [case for name in select_ops(ops) for case in specs[name].bench_cases() if _selected(case, quick)]
    if not runtime.INTERPRET:
        _let_compiled_peers_see_every_shape()
    rows: list[dict] = []
    for index, case in enumerate(cases, start=1):
        if progress:
            _progress_start(index, len(cases), case)
        case_rows = run_case(case, case.compare or specs[case.op].compare, ceilings or {})
        if progress:
            _progress_end(case_rows)
        if on_case is not None:
            on_case(case_rows)
        rows += case_rows
    return rows


def _selected(case: BenchCase, quick: bool) -> bool:
    # The interpreter takes seconds per kernel launch: only the quick grid is practical there.
    return case.quick or not (quick or runtime.INTERPRET)


def _let_compiled_peers_see_every_shape() -> None:
    # torch.compile falls back to eager, silently, after `recompile_limit` shapes of one function
    # (default 8); the grid passes more shapes than that through a peer's compiled function.
    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, 1024)


def run_case(case: BenchCase, compare: str, ceilings: dict[str, Any]) -> list[dict]:
    bench, setup_error = _set_up(case)
    if bench is None:
        free_device_memory()
        return [_row(case, OURS, error=f"setup failed: {setup_error}")]
    timings, errors, check, memory = _time_providers(bench, case.tolerance or case.dtype, compare)
    # The providers' closures hold the case's inputs: they go with `bench`.
    del bench
    free_device_memory()
    return _case_rows(case, timings, errors, check, ceilings, memory)


def _set_up(case: BenchCase) -> tuple[Bench | None, str | None]:
    try:
        return case.setup(), None
    except Exception as exc:  # torch.cuda.OutOfMemoryError among others: the grid goes on
        return None, describe_error(exc)


def _time_providers(bench: Bench, tolerance: object, compare: str) -> tuple[dict[str, float], dict[str, str], str | None, dict[str, tuple]]:
    """Median ms per provider that ran, the error of each that raised, our check, and each
    provider's memory (peak, extra) in GiB."""
    timings: dict[str, float] = {}
    errors: dict[str, str] = {}
    memory: dict[str, tuple] = {}
    check = None
    for provider, thunk in bench.providers.items():
        try:
            start = time.perf_counter()
            result = thunk()  # also compiles and autotunes before timing starts
            first_call_ms = (time.perf_counter() - start) * 1e3
            if provider == OURS:
                check = _check(result, bench.reference, tolerance, compare)
            del result
            runtime.wait_for_background_work()
            timings[provider] = _time_ms(thunk, first_call_ms)
            memory[provider] = _memory_gib(thunk)
        except Exception as exc:
            errors[provider] = describe_error(exc)
        if provider in errors:
            free_device_memory()  # out here, where the traceback no longer holds the tensors
    if not runtime.INTERPRET and timings:
        rounds = {provider: [ms] for provider, ms in timings.items()}
        for _ in range(ROUNDS - 1):
            for provider, samples in rounds.items():
                samples.append(_gpu_median_ms(bench.providers[provider]))
        timings = {provider: statistics.median(samples) for provider, samples in rounds.items()}
    return timings, errors, check, memory


def _memory_gib(thunk: Callable[[], Any]) -> tuple[float | None, float | None]:
    """The most memory allocated during one call (inputs included), and how much of it the call
    added to what was allocated before it; (None, None) under the interpreter."""
    if runtime.INTERPRET:
        return None, None
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    result = thunk()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    del result
    return peak / 2**30, (peak - before) / 2**30


def _time_ms(thunk: Callable[[], Any], first_call_ms: float) -> float:
    if not runtime.INTERPRET:
        return _gpu_median_ms(thunk)
    # The interpreter compiles nothing, so a first call that already took the whole budget is a
    # fair sample, and repeating a call of many seconds would double the run for nothing.
    if first_call_ms >= INTERPRETER_BUDGET_S * 1e3:
        return first_call_ms
    samples: list[float] = []
    deadline = time.perf_counter() + INTERPRETER_BUDGET_S
    while len(samples) < INTERPRETER_MAX_CALLS and (not samples or time.perf_counter() < deadline):
        start = time.perf_counter()
        thunk()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def _check(result: Any, reference: Callable[[], Any] | None, tolerance: object, compare: str) -> str:
    if reference is None:
        return NO_REFERENCE
    try:
        mismatch = _mismatch(result, reference(), tolerance, compare)
    except Exception as exc:  # a check that cannot run is a failed check, not a crash
        return f"check raised {describe_error(exc)}"
    return CHECK_OK if mismatch is None else mismatch


def _mismatch(actual: Any, expected: Any, tolerance: object, compare: str) -> str | None:
    if not isinstance(expected, (tuple, list)):
        if isinstance(actual, (tuple, list)):
            return f"returned {len(actual)} outputs, the reference one tensor"
        return check_close(actual, expected, tolerance, compare)
    if not isinstance(actual, (tuple, list)) or len(actual) != len(expected):
        count = len(actual) if isinstance(actual, (tuple, list)) else 1
        return f"returned {count} output(s), the reference {len(expected)}"
    for index, (a, e) in enumerate(zip(actual, expected)):
        if a is None and e is None:
            continue
        if a is None or e is None:
            return f"output {index}: {'missing' if a is None else 'unexpected'} (reference: {type(e).__name__})"
        mismatch = check_close(a, e, tolerance, compare)
        if mismatch is not None:
            return f"output {index}: {mismatch}"
    return None


def _row(case: BenchCase, provider: str, **fields: Any) -> dict:
    row = dict.fromkeys(COLUMNS)
    row.update(
        op=case.op, mode=case.mode, dtype=short_dtype(case.dtype), shape=case.shape, x=case.x,
        plot=case.plot or case.op, provider=provider, bytes=case.bytes, flops=case.flops,
        timer=INTERPRETER_TIMER if runtime.INTERPRET else GPU_TIMER,
    )
    row.update(fields)
    return row


def _case_rows(case: BenchCase, timings: dict[str, float], errors: dict[str, str], check: str | None,
               ceilings: dict[str, Any], memory: dict[str, tuple]) -> list[dict]:
    if OURS not in timings and OURS not in errors:  # a malformed case fails loudly, like a wrong one
        errors = {OURS: "the case has no tritonformer provider", **errors}
    providers = list(timings) + [p for p in errors if p not in timings]
    ours_ms = timings.get(OURS)
    peer_ms = {p: ms for p, ms in timings.items() if p != OURS}
    best_peer = min(peer_ms, key=peer_ms.get) if peer_ms else None
    rows = []
    for provider in sorted(providers, key=lambda p: p != OURS):  # ours first, peers in given order
        ms = timings.get(provider)
        peak, extra = memory.get(provider, (None, None))
        row = _row(case, provider, ms=ms, error=errors.get(provider), peak_gib=peak, extra_gib=extra)
        if ms is not None:
            row.update(_rates(case, ms, ceilings))
        if provider == OURS:
            row["check"] = check
            if ours_ms is not None and best_peer is not None:
                row.update(best_peer=best_peer, speedup_vs_best_peer=peer_ms[best_peer] / ours_ms)
        elif ours_ms is not None and ms is not None:
            row["ours_speedup_vs_this"] = ms / ours_ms
        rows.append(row)
    return rows


def _rates(case: BenchCase, ms: float, ceilings: dict[str, Any]) -> dict[str, float | None]:
    gbps = case.bytes / ms / 1e6 if case.bytes else None
    tflops = case.flops / ms / 1e9 if case.flops else None
    # The headline figure (GB/s when the case moves known bytes, else TFLOP/s) against the
    # matching ceiling; fp8 cases against the fp8 matmul rate.
    if gbps is not None:
        ceiling = ceilings.get("copy_gbps")
        achieved = gbps
    else:
        ceiling = ceilings.get("matmul_fp8_tflops" if case.dtype in FP8_DTYPES else "matmul_bf16_tflops")
        achieved = tflops
    frac = achieved / ceiling if achieved is not None and ceiling else None
    return {"gbps": gbps, "tflops": tflops, "frac_ceiling": frac}


def ours_failed(row: dict) -> bool:
    """Whether this is our row and its result was wrong, or it did not run."""
    return row["provider"] == OURS and (row["error"] is not None or row["check"] not in (CHECK_OK, NO_REFERENCE))


# ---------------------------------------------------------------------------------------------
# Progress and figures


def headline(row: dict) -> tuple[float | None, str]:
    """The figure a row is plotted and tabled by, with its unit."""
    if row["bytes"]:
        return row["gbps"], "GB/s"
    if row["flops"]:
        return row["tflops"], "TFLOP/s"
    return row["ms"], "ms"


def format_figure(value: float | None, unit: str) -> str:
    if value is None:
        return "-"
    if unit == "GB/s" and value >= 1000:
        return f"{value / 1000:.2f} TB/s"
    return f"{value:.3g} {unit}"


def format_speedup(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.3g}x"


def _progress_start(index: int, total: int, case: BenchCase) -> None:
    width = len(str(total))
    label = f"{case.op} {case.mode} {short_dtype(case.dtype)} {case.shape}"
    sys.stderr.write(f"[{index:>{width}}/{total}] {label} ... ")
    sys.stderr.flush()


def _progress_end(case_rows: list[dict]) -> None:
    ours = case_rows[0]
    if ours["ms"] is None:
        message = f"ERROR {ours['error']}"
    else:
        message = f"{ours['ms']:.3g} ms {format_figure(*headline(ours))}"
        if ours["best_peer"] is not None:
            message += f" | {format_speedup(ours['speedup_vs_best_peer'])} vs {ours['best_peer']}"
        if ours_failed(ours):
            message += f" | CHECK FAILED: {ours['check']}"
    peer_errors = [r["provider"] for r in case_rows if r["provider"] != OURS and r["error"]]
    if peer_errors:
        message += f" | peer error: {', '.join(peer_errors)}"
    sys.stderr.write(message + "\n")
    sys.stderr.flush()
