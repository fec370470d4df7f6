"""Command line: `python -m tritonformer bench [OP ...|e2e [--model NAME ...]|generate [--model NAME ...] [--batch N ...] [--prompt N ...]] [--quick] [--out DIR]`, `report RUN_DIR ... --out DIR` and `info`."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from . import runtime

INTERPRETER_NOTICE = (
    "tritonformer: no CUDA GPU here: kernels run under Triton's CPU interpreter and the timings "
    "are NOT GPU timings (quick grid only)."
)

EXIT_OK = 0
EXIT_CHECK_FAILED = 1
EXIT_USAGE = 2


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    if args.command != "report" and not runtime.INTERPRET and not torch.cuda.is_available():
        print("tritonformer: TRITON_INTERPRET is set to 0 but torch sees no CUDA GPU; unset it (or set it to 1) to "
              "run the kernels under Triton's CPU interpreter", file=sys.stderr)
        return EXIT_USAGE
    return args.handler(args)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tritonformer", description="Triton kernels for Transformers.")
    commands = parser.add_subparsers(dest="command")

    bench = commands.add_parser("bench", help="check and time the ops against their peers, write a report")
    bench.add_argument("ops", nargs="*", metavar="OP",
                       help="ops to run (default: all registered), or e2e: the end-to-end training benchmark, or "
                            "generate: the decoding benchmark")
    bench.add_argument("--quick", action="store_true", help="the small grid only (implied without a GPU)")
    bench.add_argument("--out", type=Path, help="output directory (default: bench-out/<device>/)")
    bench.add_argument("--model", nargs="+", metavar="NAME",
                       help="bench e2e: the model shapes to train (e2e, smollm2-135m, qwen2.5-0.5b, qwen3-moe); "
                            "bench generate: to decode (e2e, llama3-8b); default: e2e")
    bench.add_argument("--stacks", nargs="+", metavar="STACK",
                       help="bench e2e / generate: the stacks to run (default: all of bench.e2e.STACKS / "
                            "bench.generate.STACKS)")
    bench.add_argument("--batch", nargs="+", type=int, metavar="N",
                       help="bench generate: batch sizes (default: 1 16 64)")
    bench.add_argument("--prompt", nargs="+", type=int, metavar="N",
                       help="bench generate: prompt lengths (default: 512)")
    bench.set_defaults(handler=_bench)

    merge = commands.add_parser("report", help="merge the output directories of several bench runs into one report")
    merge.add_argument("runs", nargs="+", type=Path, metavar="RUN_DIR", help="bench --out directories, in order")
    merge.add_argument("--out", type=Path, required=True, help="output directory")
    merge.set_defaults(handler=_report)

    info = commands.add_parser("info", help="device, versions and measured ceilings")
    info.add_argument("--no-ceilings", action="store_true", help="skip measuring copy and matmul ceilings")
    info.set_defaults(handler=_info)
    return parser


def _report(args: argparse.Namespace) -> int:
    from .bench import report

    missing = [str(run) for run in args.runs if not (run / "results.csv").exists()]
    if missing:
        print(f"tritonformer report: no results.csv in {', '.join(missing)}", file=sys.stderr)
        return EXIT_USAGE
    path = report.merge_runs(args.runs, args.out)
    print(f"wrote {path}")
    return EXIT_OK


def _names_unknown(command: str, *checks: tuple) -> bool:
    """Print the first (asked, known, what) check that asks for an unknown name; whether one did."""
    for asked, known, what in checks:
        unknown = [name for name in asked if name not in known]
        if unknown:
            print(f"tritonformer bench {command}: unknown {what} {', '.join(unknown)}; known: {', '.join(known)}",
                  file=sys.stderr)
            return True
    return False


def _bench(args: argparse.Namespace) -> int:
    from .bench import report, runner

    if runtime.INTERPRET:
        print(INTERPRETER_NOTICE, flush=True)
    quick = args.quick or runtime.INTERPRET
    if "generate" in args.ops:
        if len(args.ops) > 1:
            print("tritonformer bench: generate runs on its own (bench generate)", file=sys.stderr)
            return EXIT_USAGE
        from .bench import generate

        stacks = args.stacks or generate.STACKS
        models = args.model or ["e2e"]
        if _names_unknown("generate", (models, generate.MODELS, "model"), (stacks, generate.STACKS, "stack")):
            return EXIT_USAGE
        out_dir = args.out or Path("bench-out") / "generate"
        ours_failed = False
        for model in models:
            rows = generate.run(out_dir, quick, stacks, model, args.batch or generate.BATCHES,
                                args.prompt or generate.PROMPTS)
            print(f"\nwrote {out_dir / f'generate-{model}.md'}")
            ours_failed |= any("error" in r for r in rows if r["stack"].startswith("tritonformer"))
        return EXIT_CHECK_FAILED if ours_failed else EXIT_OK
    if "e2e" in args.ops:
        if len(args.ops) > 1:
            print("tritonformer bench: e2e runs on its own (bench e2e)", file=sys.stderr)
            return EXIT_USAGE
        from .bench import e2e

        stacks = args.stacks or e2e.STACKS
        args.model = args.model or ["e2e"]
        if _names_unknown("e2e", (args.model, e2e.MODELS, "model"), (stacks, e2e.STACKS, "stack")):
            return EXIT_USAGE
        out_dir = args.out or Path("bench-out") / "e2e"
        ours_failed = False
        for model in args.model:
            rows = e2e.run(out_dir, quick, stacks, model)
            print(f"\nwrote {out_dir / e2e.report_stem(model)}.md")
            ours_failed |= any("error" in r for r in rows if r["stack"].startswith("tritonformer"))
        return EXIT_CHECK_FAILED if ours_failed else EXIT_OK
    try:
        ops = runner.select_ops(args.ops)
    except runner.UnknownOpError as exc:
        print(f"tritonformer bench: {exc}", file=sys.stderr)
        return EXIT_USAGE
    ceilings = runner.measure_ceilings(quick)
    out_dir = args.out or Path("bench-out") / ceilings["device_slug"]
    rows = runner.run(ops, quick, ceilings=ceilings, on_case=report.csv_appender(out_dir / "results.csv"))
    report_path = report.write_report(rows, ceilings, out_dir)
    (out_dir / "configs.json").write_text(json.dumps(runtime.TunedLauncher.chosen_configs(), indent=1, default=str))
    print(report.summary_table(rows))
    print(f"\nwrote {report_path}, {out_dir / 'results.csv'} and one PNG per op")
    failures = [row for row in rows if runner.ours_failed(row)]
    if failures:
        cases = "; ".join(f"{r['op']} {r['mode']} {r['dtype']} {r['shape']}: {r['error'] or r['check']}" for r in failures)
        print(f"tritonformer bench: {len(failures)} tritonformer case(s) wrong or failing: {cases}", file=sys.stderr)
        return EXIT_CHECK_FAILED
    return EXIT_OK


def _info(args: argparse.Namespace) -> int:
    from .bench import report, runner

    ceilings = runner.device_info() if args.no_ceilings else runner.measure_ceilings(quick=False)
    lines = report.ceiling_lines(ceilings)
    width = max(len(label) for label, _ in lines)
    for label, value in lines:
        print(f"{label:<{width}}  {value}")
    if runtime.INTERPRET:
        print(INTERPRETER_NOTICE)
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
