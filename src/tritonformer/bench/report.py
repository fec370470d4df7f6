"""Writes a benchmark run to disk: results.csv, one PNG per op and report.md that embeds them.

matplotlib is imported inside the plotting function: it belongs to the `bench` extra, and
`import tritonformer` must not need it.
"""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path
from typing import Any, Callable

from .runner import COLUMNS, OURS, format_figure, format_speedup, headline, ours_failed

INTERPRETER_WARNING = (
    "**These timings were taken under Triton's CPU interpreter. They are NOT GPU figures:** "
    "they show that every case runs and that our results match the reference, nothing about speed."
)

# Ticks named by the case's shape label stay readable up to about this many per panel.
MAX_NAMED_TICKS = 12
PANELS_PER_ROW = 3
# Beyond this spread a linear axis flattens the slower lines (e.g. the interpreter against torch).
LOG_Y_SPREAD = 100


def write_report(rows: list[dict], ceilings: dict[str, Any], out_dir: Path) -> Path:
    """results.csv, ceilings.json, <op>.png for each op and report.md in `out_dir`; returns
    report.md's path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    write_csv(rows, out_dir / "results.csv")
    (out_dir / "ceilings.json").write_text(json.dumps(ceilings, indent=1, default=str))
    images = {}
    for op, op_rows in rows_by_op(rows).items():
        image = out_dir / f"{_file_stem(op)}.png"
        plot_op(op, op_rows, image, interpreter=bool(ceilings.get("interpreter")))
        images[op] = image.name
    report = out_dir / "report.md"
    report.write_text(markdown_report(rows, ceilings, images))
    return report


# Columns read back as numbers; the others stay text (empty cells become None).
_NUMERIC = {"x", "ms", "gbps", "tflops", "bytes", "flops", "peak_gib", "extra_gib", "speedup_vs_best_peer",
            "ours_speedup_vs_this", "frac_ceiling"}


def read_run(run_dir: Path) -> tuple[list[dict], dict[str, Any]]:
    """The rows and ceilings a `write_report` left in `run_dir`."""
    with (run_dir / "results.csv").open(newline="") as f:
        rows = [{k: _parse(k, v) for k, v in row.items()} for row in csv.DictReader(f)]
    ceilings_path = run_dir / "ceilings.json"
    return rows, json.loads(ceilings_path.read_text()) if ceilings_path.exists() else {}


def _parse(column: str, value: str) -> Any:
    if value == "":
        return None
    if column in _NUMERIC:
        number = float(value)
        return int(number) if column in ("x", "bytes", "flops") else number
    return value


def merge_runs(run_dirs: list[Path], out_dir: Path) -> Path:
    """One report from runs of the grid taken in parts (one device call each): the rows of every
    run, later runs replacing earlier ones' cases; the first run's ceilings."""
    rows_by_key: dict[tuple, dict] = {}
    ceilings: dict[str, Any] = {}
    for run_dir in run_dirs:
        rows, run_ceilings = read_run(run_dir)
        ceilings = ceilings or run_ceilings
        replaced = {_case_key(r) for r in rows}
        rows_by_key = {k: r for k, r in rows_by_key.items() if _case_key(r) not in replaced}
        rows_by_key.update({(*_case_key(r), r["provider"]): r for r in rows})
    return write_report(list(rows_by_key.values()), ceilings, out_dir)


def _case_key(row: dict) -> tuple:
    return row["op"], row["mode"], row["dtype"], row["shape"], row["plot"]


def write_csv(rows: list[dict], path: Path) -> None:
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)


def csv_appender(path: Path) -> Callable[[list[dict]], None]:
    """A function that appends rows to a new results.csv at `path` and flushes them to disk: a
    run killed half way keeps what it measured."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_csv([], path)

    def append(rows: list[dict]) -> None:
        with path.open("a", newline="") as f:
            csv.DictWriter(f, fieldnames=COLUMNS).writerows(rows)

    return append


def rows_by_op(rows: list[dict]) -> dict[str, list[dict]]:
    grouped: dict[str, list[dict]] = {}
    for row in rows:
        grouped.setdefault(row["op"], []).append(row)
    return grouped


def _file_stem(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name)


# ---------------------------------------------------------------------------------------------
# Plots


def plot_op(op: str, rows: list[dict], path: Path, interpreter: bool = False) -> None:
    """One panel per `plot` group of the op, one line per provider, like triton's perf_report."""
    from matplotlib.figure import Figure  # Figure alone: no pyplot state, no display backend

    groups: dict[str, list[dict]] = {}
    for row in rows:
        groups.setdefault(row["plot"], []).append(row)
    columns = min(len(groups), PANELS_PER_ROW)
    grid_rows = -(-len(groups) // columns)
    fig = Figure(figsize=(5.5 * columns, 4.2 * grid_rows + 0.4), layout="constrained")
    axes = fig.subplots(grid_rows, columns, squeeze=False).flatten()
    for ax, (group, group_rows) in zip(axes, groups.items()):
        _plot_group(ax, group, group_rows)
    for unused in axes[len(groups):]:
        unused.set_visible(False)
    title = op + (" (CPU interpreter timings, not GPU figures)" if interpreter else "")
    fig.suptitle(title)
    fig.savefig(path, dpi=110)


def _plot_group(ax, group: str, rows: list[dict]) -> None:
    unit = headline(rows[0])[1]
    # A panel mixing modes or dtypes gets one line per provider and mode/dtype, not one zigzag.
    mixed = len({(r["mode"], r["dtype"]) for r in rows}) > 1
    lines: dict[str, list[tuple[int, float]]] = {}
    for row in rows:
        value = headline(row)[0]
        if value is None:
            continue
        label = row["provider"] + (f" {row['mode']} {row['dtype']}" if mixed else "")
        lines.setdefault(label, []).append((row["x"], value))
    for label, points in lines.items():
        xs, ys = zip(*sorted(points))
        ax.plot(xs, ys, marker="o", label=label, linewidth=2 if label.startswith(OURS) else 1.2)
    _set_x_axis(ax, rows)
    values = [y for points in lines.values() for _, y in points if y > 0]
    if values and max(values) / min(values) > LOG_Y_SPREAD:
        ax.set_yscale("log")
    ax.set_title(group)
    ax.set_ylabel(unit + (" (lower is better)" if unit == "ms" else ""))
    ax.grid(True, alpha=0.3)
    if lines:
        ax.legend(fontsize="small")


def _set_x_axis(ax, rows: list[dict]) -> None:
    shape_at_x = {}
    for row in rows:
        shape_at_x.setdefault(row["x"], row["shape"])
    xs = sorted(shape_at_x)
    if xs and xs[0] > 0 and xs[-1] / xs[0] > 8:
        ax.set_xscale("log", base=2)
    if len(xs) <= MAX_NAMED_TICKS:
        ax.minorticks_off()
        ax.set_xticks(xs, [shape_at_x[x] for x in xs], rotation=30, ha="right", fontsize="small")
    ax.set_xlabel("shape")


# ---------------------------------------------------------------------------------------------
# Markdown


def ceiling_lines(ceilings: dict[str, Any]) -> list[tuple[str, str]]:
    """(label, value) pairs describing the machine and its measured ceilings."""
    lines = [
        ("device", str(ceilings.get("device"))),
        ("tritonformer", str(ceilings.get("tritonformer"))),
        ("torch", str(ceilings.get("torch"))),
        ("triton", str(ceilings.get("triton"))),
    ]
    if ceilings.get("cuda"):
        lines.append(("CUDA", str(ceilings["cuda"])))
    lines.append(("SMs", "-" if ceilings.get("sm_count") is None else str(ceilings["sm_count"])))
    lines.append(("kernels run", "under Triton's CPU interpreter" if ceilings.get("interpreter") else "on the GPU"))
    if ceilings.get("interpreter"):
        lines.append(("ceilings", "not measured (no GPU)"))
        return lines
    errors = ceilings.get("ceiling_errors", {})
    measured = [
        ("copy bandwidth (1 GiB copy, read+write)", "copy_gbps", "GB/s", None),
        ("cuBLAS bf16 matmul", "matmul_bf16_tflops", "TFLOP/s", "matmul_bf16_size"),
        ("cuBLAS fp8 e4m3 matmul (torch._scaled_mm)", "matmul_fp8_tflops", "TFLOP/s", "matmul_fp8_size"),
    ]
    for label, key, unit, size_key in measured:
        if key not in ceilings:
            continue
        value = format_figure(ceilings[key], unit) if ceilings[key] is not None else f"failed: {errors.get(key)}"
        if size_key and ceilings.get(size_key):
            label += f", {ceilings[size_key]}^3"
        lines.append((label, value))
    return lines


def markdown_report(rows: list[dict], ceilings: dict[str, Any], images: dict[str, str]) -> str:
    parts = ["# tritonformer benchmarks", ""]
    if ceilings.get("interpreter"):
        parts += [f"> {INTERPRETER_WARNING}", ""]
    parts += ["| | |", "|---|---|"]
    parts += [f"| {label} | {_cell(value)} |" for label, value in ceiling_lines(ceilings)]
    timers: dict[str, list[str]] = {}
    for row in rows:
        ops = timers.setdefault(row["timer"], [])
        if row["op"] not in ops:
            ops.append(row["op"])
    if len(timers) == 1:
        parts += ["", f"Timer: {next(iter(timers))}."]
    elif timers:  # a merged report: runs of different harness versions
        parts += ["", "Timers:"] + [f"- {timer}: {', '.join(ops)}" for timer, ops in timers.items()]
    parts += [
        "",
        "Figures are GB/s for cases that move a known number of bytes, otherwise TFLOP/s. "
        "*speedup* is the best peer's time over ours (above 1: ours is faster); "
        "*% of ceiling* compares ours with the copy bandwidth or the cuBLAS matmul rate above. "
        "*peak GiB* is the most memory allocated during one call, inputs included, and in brackets "
        "what the call added to what was allocated before it.",
    ]
    for op, op_rows in rows_by_op(rows).items():
        parts += ["", f"## {op}", ""]
        if op in images:
            parts += [f"![{op}]({images[op]})", ""]
        parts += _op_table(op_rows)
    return "\n".join(parts) + "\n"


def _op_table(rows: list[dict]) -> list[str]:
    peers = list(dict.fromkeys(r["provider"] for r in rows if r["provider"] != OURS))
    with_memory = any(r["peak_gib"] is not None for r in rows)
    header = ["case", "unit", OURS, *peers, "ours ms", "speedup vs best peer", "% of ceiling", "check"]
    if with_memory:
        header += [f"peak GiB: {p}" for p in [OURS, *peers]]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    errors = []
    for case_rows in _rows_by_case(rows).values():
        by_provider = {r["provider"]: r for r in case_rows}
        first = case_rows[0]
        unit = headline(first)[1]
        ours = by_provider[OURS]
        cells = [f"{first['mode']} {first['dtype']} {first['shape']}", unit]
        cells += [_figure_cell(by_provider.get(p)) for p in [OURS, *peers]]
        cells += _ours_cells(ours)
        if with_memory:
            cells += [_memory_cell(by_provider.get(p)) for p in [OURS, *peers]]
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
        errors += [f"- {cells[0]}, {r['provider']}: {r['error']}" for r in case_rows if r["error"]]
    if errors:
        lines += ["", "Errors:", ""] + [_cell(e) for e in errors]
    return lines


def _rows_by_case(rows: list[dict]) -> dict[tuple, list[dict]]:
    cases: dict[tuple, list[dict]] = {}
    for row in rows:
        cases.setdefault((row["plot"], row["mode"], row["dtype"], row["shape"], row["x"]), []).append(row)
    return cases


def _figure_cell(row: dict | None) -> str:
    if row is None:
        return ""
    if row["error"]:
        return "error"
    return _number(headline(row)[0])


def _memory_cell(row: dict | None) -> str:
    if row is None or row["peak_gib"] is None:
        return ""
    return f"{row['peak_gib']:.2f} (+{row['extra_gib']:.2f})"


def _number(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.0f}" if abs(value) >= 1000 else f"{value:.3g}"


def _ours_cells(ours: dict) -> list[str]:
    ms = _number(ours["ms"])
    speedup = format_speedup(ours["speedup_vs_best_peer"])
    if ours["best_peer"] is not None:
        speedup += f" ({ours['best_peer']})"
    ceiling = _percent(ours["frac_ceiling"])
    check = ours["check"] if ours["check"] is not None else "error"
    return [ms, speedup, ceiling, check if not ours_failed(ours) else f"**FAIL** {check}"]


def _percent(fraction: float | None) -> str:
    if fraction is None:
        return "-"
    percent = 100 * fraction
    return f"{percent:.0f}%" if percent >= 10 else f"{percent:.2g}%"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


# ---------------------------------------------------------------------------------------------
# Plain-text summary


def summary_table(rows: list[dict]) -> str:
    """One line per case: ours, the best peer and the ratio, for the end of a CLI run."""
    header = ("op", "mode", "dtype", "shape", "ours", "best peer", "speedup", "check")
    lines = [header]
    for case_rows in _rows_by_op_and_case(rows):
        ours = case_rows[0]  # the runner puts ours first in every case
        peer = next((r for r in case_rows if r["provider"] == ours["best_peer"]), None)
        lines.append((
            ours["op"], ours["mode"], ours["dtype"], ours["shape"],
            format_figure(*headline(ours)),
            f"{peer['provider']} {format_figure(*headline(peer))}" if peer else "-",
            format_speedup(ours["speedup_vs_best_peer"]),
            _check_status(ours),
        ))
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip() for line in lines)


def _check_status(ours: dict) -> str:
    if ours["error"] is not None:
        return "ERROR"
    return "FAIL" if ours_failed(ours) else ours["check"]


def _rows_by_op_and_case(rows: list[dict]) -> list[list[dict]]:
    return [case_rows for op_rows in rows_by_op(rows).values() for case_rows in _rows_by_case(op_rows).values()]
