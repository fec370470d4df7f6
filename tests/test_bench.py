"""The benchmark harness end to end: runner, report and CLI, on the add op and hand-made cases."""

from __future__ import annotations

import csv
import math

import pytest
import torch

from tritonformer import registry, runtime
from tritonformer.__main__ import main
from tritonformer.bench import runner
from tritonformer.bench.report import summary_table
from tritonformer.cases import add
from tritonformer.spec import Bench, BenchCase, OpSpec


def _fake_spec(name: str, providers: dict, cases: int = 1, dtype: torch.dtype = torch.float32,
               tolerance=None) -> OpSpec:
    """An op whose bench cases add 1 to a small float32 tensor; `providers` maps names to
    functions of that tensor, and the reference is x + 1 in float64. `dtype` labels the cases;
    `tolerance` is their tolerance key."""

    def setup() -> Bench:
        x = torch.arange(64, dtype=torch.float32, device=runtime.DEVICE)
        return Bench(
            providers={provider: (lambda fn=fn: fn(x)) for provider, fn in providers.items()},
            reference=lambda: x.double() + 1,
        )

    bench_cases = [
        BenchCase(name, "fwd", dtype, f"n=64 #{i}", 64 * (i + 1), setup, bytes=2 * 4 * 64, quick=True,
                  tolerance=tolerance)
        for i in range(cases)
    ]
    return OpSpec(name, fn=lambda x: x + 1, reference=lambda x: x + 1, test_cases=lambda: [],
                  bench_cases=lambda: bench_cases)


@pytest.fixture
def only_add(monkeypatch):
    monkeypatch.setattr(registry, "OPS", {"add": add.SPEC})


def _read_csv(path):
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        return reader.fieldnames, list(reader)


def test_bench_add_end_to_end(only_add, tmp_path, capsys):
    assert main(["bench", "add", "--quick", "--out", str(tmp_path)]) == 0

    columns, rows = _read_csv(tmp_path / "results.csv")
    assert columns == runner.COLUMNS
    ours = [r for r in rows if r["provider"] == runner.OURS]
    assert ours and all(r["check"] == "ok" for r in ours)
    assert all(float(r["ms"]) > 0 and float(r["gbps"]) > 0 for r in rows)
    assert {r["provider"] for r in rows} >= {"tritonformer", "torch"}
    assert (tmp_path / "add.png").stat().st_size > 0
    report = (tmp_path / "report.md").read_text()
    assert "](add.png)" in report and "## add" in report

    out = capsys.readouterr().out
    if runtime.INTERPRET:
        assert "interpreter" in out.splitlines()[0]
        assert "NOT GPU" in report
    assert "add" in out and "best peer" in out


def test_a_run_stopped_half_way_keeps_the_cases_it_measured(monkeypatch, tmp_path):
    def interrupted():
        raise KeyboardInterrupt

    spec = _fake_spec("fake", {"tritonformer": lambda x: x + 1}, cases=2)
    cases = spec.bench_cases()
    cases[1] = BenchCase("fake", "fwd", torch.float32, "stopped", 1, lambda: interrupted(), quick=True)
    monkeypatch.setattr(registry, "OPS", {"fake": OpSpec("fake", spec.fn, spec.reference, spec.test_cases,
                                                         lambda: cases)})
    with pytest.raises(KeyboardInterrupt):
        main(["bench", "fake", "--quick", "--out", str(tmp_path)])
    _, rows = _read_csv(tmp_path / "results.csv")
    assert [(r["shape"], r["provider"], r["check"]) for r in rows] == [("n=64 #0", "tritonformer", "ok")]


def test_unknown_op_is_a_clear_error(only_add, capsys):
    assert main(["bench", "no_such_op"]) == 2
    err = capsys.readouterr().err
    assert "no_such_op" in err and "add" in err
    with pytest.raises(runner.UnknownOpError, match="registered ops: add"):
        runner.run(["no_such_op"], quick=True, progress=False)


def test_a_group_name_selects_its_ops():
    assert runner.select_ops(["moe", "grouped_mm", "add"]) == ["moe_route", "grouped_mm", "moe_experts", "gpt_oss_experts", "add"]


def test_failing_peer_is_recorded_and_the_run_goes_on(monkeypatch):
    def broken_peer(x):
        raise RuntimeError("peer exploded")

    providers = {"tritonformer": lambda x: x + 1, "broken": broken_peer, "torch": lambda x: x + 1}
    spec = _fake_spec("fake", providers, cases=2)
    monkeypatch.setattr(registry, "OPS", {"fake": spec})
    rows = runner.run(["fake"], quick=True, progress=False)

    assert len(rows) == 6  # both cases ran, three providers each
    broken = [r for r in rows if r["provider"] == "broken"]
    assert all("peer exploded" in r["error"] and r["ms"] is None for r in broken)
    ours = [r for r in rows if r["provider"] == runner.OURS]
    assert all(r["check"] == "ok" and r["ms"] > 0 and r["best_peer"] == "torch" for r in ours)
    assert not any(runner.ours_failed(r) for r in rows)
    assert "fake" in summary_table(rows)


def test_timing_waits_for_background_compiles(monkeypatch):
    # A compile the first call started in the background (here a job that takes a while) has
    # finished before the timing starts, for every provider.
    import threading
    from concurrent.futures import ThreadPoolExecutor

    pool, release, timed_after = ThreadPoolExecutor(1), threading.Event(), []

    def ours(x):
        runtime._in_background(pool, release.wait, 5.0)
        return x + 1

    def timing(thunk, first_call_ms):
        timed_after.append(release.is_set())
        return 1.0

    monkeypatch.setattr(runner, "_time_ms", timing)
    monkeypatch.setattr(registry, "OPS", {"fake": _fake_spec("fake", {"tritonformer": ours, "torch": lambda x: x + 1})})
    threading.Timer(0.2, release.set).start()
    runner.run(["fake"], quick=True, progress=False)
    assert timed_after and all(timed_after)


def test_wrong_result_fails_the_check_and_the_bench(monkeypatch, tmp_path, capsys):
    spec = _fake_spec("wrong", {"tritonformer": lambda x: x + 2, "torch": lambda x: x + 1})
    monkeypatch.setattr(registry, "OPS", {"wrong": spec})

    assert main(["bench", "wrong", "--out", str(tmp_path)]) == 1

    _, rows = _read_csv(tmp_path / "results.csv")
    ours = next(r for r in rows if r["provider"] == runner.OURS)
    assert "elements off" in ours["check"]
    assert "FAIL" in (tmp_path / "report.md").read_text()
    assert "wrong" in capsys.readouterr().err


def test_ours_raising_fails_the_bench(monkeypatch, tmp_path):
    def broken_ours(x):
        raise ValueError("kernel exploded")

    spec = _fake_spec("raises", {"tritonformer": broken_ours, "torch": lambda x: x + 1})
    monkeypatch.setattr(registry, "OPS", {"raises": spec})
    assert main(["bench", "raises", "--out", str(tmp_path)]) == 1
    _, rows = _read_csv(tmp_path / "results.csv")
    assert "kernel exploded" in next(r for r in rows if r["provider"] == runner.OURS)["error"]


def test_setup_out_of_memory_is_recorded_and_the_run_goes_on(monkeypatch):
    def out_of_memory():
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 80.00 GiB")

    fits = _fake_spec("fits", {"tritonformer": lambda x: x + 1})
    too_big = BenchCase("fits", "fwd", torch.float32, "huge", 1 << 40, out_of_memory, quick=True)
    spec = OpSpec("fits", fn=fits.fn, reference=fits.reference, test_cases=fits.test_cases,
                  bench_cases=lambda: [too_big, *fits.bench_cases()])
    monkeypatch.setattr(registry, "OPS", {"fits": spec})
    rows = runner.run(["fits"], quick=True, progress=False)

    assert [r["shape"] for r in rows] == ["huge", "n=64 #0"]
    assert "OutOfMemoryError" in rows[0]["error"] and runner.ours_failed(rows[0])
    assert rows[1]["check"] == "ok"


def test_a_case_is_checked_at_its_tolerance_not_its_label(monkeypatch):
    # fp8 cases name their operands' dtype; their bf16 output is held to bf16's tolerance.
    spec = _fake_spec("fp8", {"tritonformer": lambda x: ((x + 1) * 1.004).bfloat16()}, dtype=torch.float8_e4m3fn,
                      tolerance=torch.bfloat16)
    strict = _fake_spec("strict", {"tritonformer": lambda x: ((x + 1) * 1.004).bfloat16()}, tolerance=torch.float32)
    monkeypatch.setattr(registry, "OPS", {"fp8": spec, "strict": strict})
    ok, failed = runner.run(["fp8", "strict"], quick=True, progress=False)
    assert ok["check"] == "ok" and ok["dtype"] == "fp8e4m3"
    assert runner.ours_failed(failed) and "float32" in failed["check"]


@pytest.mark.parametrize("name, slug", [
    ("NVIDIA H100 80GB HBM3", "h100"),
    ("NVIDIA H200", "h200"),
    ("NVIDIA A100-SXM4-80GB", "nvidia-a100-sxm4-80gb"),
])
def test_device_slug(name, slug):
    assert runner.device_slug(name) == slug


def test_report_merges_runs_taken_in_parts(monkeypatch, tmp_path):
    one = _fake_spec("one", {"tritonformer": lambda x: x + 1, "torch": lambda x: x + 1})
    two = _fake_spec("two", {"tritonformer": lambda x: x + 1, "torch": lambda x: x + 1})
    monkeypatch.setattr(registry, "OPS", {"one": one, "two": two})
    assert main(["bench", "one", "--out", str(tmp_path / "a")]) == 0
    assert main(["bench", "two", "--out", str(tmp_path / "b")]) == 0
    assert main(["bench", "one", "--out", str(tmp_path / "c")]) == 0  # a rerun replaces its cases
    assert main(["report", str(tmp_path / "a"), str(tmp_path / "b"), str(tmp_path / "c"),
                 "--out", str(tmp_path / "merged")]) == 0
    columns, rows = _read_csv(tmp_path / "merged" / "results.csv")
    assert columns == runner.COLUMNS
    assert sorted((r["op"], r["provider"]) for r in rows) == [
        ("one", "torch"), ("one", "tritonformer"), ("two", "torch"), ("two", "tritonformer")]
    _, rerun = _read_csv(tmp_path / "c" / "results.csv")
    assert {r["ms"] for r in rows if r["op"] == "one"} == {r["ms"] for r in rerun}
    report = (tmp_path / "merged" / "report.md").read_text()
    assert "## one" in report and "## two" in report and "Timer: " in report
    # Runs timed by different harness versions: the report says which ops each timer covers.
    path = tmp_path / "b" / "results.csv"
    columns, rows = _read_csv(path)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows({**r, "timer": "an older timer"} for r in rows)
    assert main(["report", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path / "mixed")]) == 0
    mixed = (tmp_path / "mixed" / "report.md").read_text()
    assert "Timers:" in mixed and "- an older timer: two" in mixed
    assert main(["report", str(tmp_path / "nothing"), "--out", str(tmp_path / "x")]) == 2


def test_e2e_stacks_train_to_the_same_loss(tmp_path):
    pytest.importorskip("transformers")
    from tritonformer.bench import e2e

    sizes = dict(e2e.QUICK, steps=e2e.WARMUP_STEPS + 1, new_tokens=2)
    stacks = ("hf-eager", "tritonformer", "tritonformer+cuda_graphs", "tritonformer+step_in_backward+cuda_graphs")
    rows = [e2e.run_stack(stack, sizes) for stack in stacks]
    for row in rows:
        assert len(row["losses"]) == sizes["steps"] and row["tokens_per_s"] > 0 and row["generate_tokens_per_s"] > 0
    for row in rows[1:]:
        assert row["losses"] == pytest.approx(rows[0]["losses"], rel=1e-4)
    assert rows[3]["losses"] == rows[1]["losses"]  # the step inside backward: the same arithmetic
    report = e2e.write_report(rows + [dict(stack="hf+liger", error="liger_kernel is not installed")], sizes, tmp_path)
    text = report.read_text()
    assert "| tritonformer |" in text and "+0.00%" in text and (tmp_path / "e2e.png").exists()


def test_e2e_trains_each_named_model_family(tmp_path):
    """The small-model shapes of bench e2e --model: Qwen2 (q/k/v biases, tied embeddings) at
    the interpreter's size, patched and not, to the same losses."""
    pytest.importorskip("transformers")
    from tritonformer.bench import e2e

    sizes = dict(e2e.QUICK, family="qwen2", tied=True, model="qwen2.5-0.5b", steps=e2e.WARMUP_STEPS + 1,
                 new_tokens=2)
    model = e2e.make_model(sizes, torch.device("cpu"), torch.float32)
    assert type(model).__name__ == "Qwen2ForCausalLM" and model.lm_head.weight is model.model.embed_tokens.weight
    rows = [e2e.run_stack(stack, sizes) for stack in ("hf-eager", "tritonformer")]
    assert rows[1]["losses"] == pytest.approx(rows[0]["losses"], rel=1e-4)
    report = e2e.write_report(rows, sizes, tmp_path)
    assert report.name == "e2e-qwen2.5-0.5b.md" and "(tied embeddings)" in report.read_text()
    assert main(["bench", "e2e", "--model", "gpt-9", "--out", str(tmp_path)]) == 2
    assert main(["bench", "e2e", "--stacks", "hf+jax", "--out", str(tmp_path)]) == 2


def test_e2e_trains_the_mixture_of_experts_model(tmp_path):
    """bench e2e --model qwen3-moe at the interpreter's size: a Qwen3-MoE, patched (our experts)
    and not (HF's), to the same losses; the report names the experts."""
    pytest.importorskip("transformers")
    from tritonformer.bench import e2e

    sizes = dict(e2e.QUICK, family="qwen3_moe", model="qwen3-moe", steps=e2e.WARMUP_STEPS + 1, new_tokens=2,
                 experts=4, expert_intermediate=32, top_k=2)
    assert type(e2e.make_model(sizes, torch.device("cpu"), torch.float32)).__name__ == "Qwen3MoeForCausalLM"
    rows = [e2e.run_stack(stack, sizes) for stack in ("hf-eager", "tritonformer")]
    assert rows[1]["losses"] == pytest.approx(rows[0]["losses"], rel=1e-4)
    report = e2e.write_report(rows, sizes, tmp_path)
    assert report.name == "e2e-qwen3-moe.md" and "4 experts of intermediate 32 (top 2;" in report.read_text()


@pytest.mark.skipif(not runtime.INTERPRET, reason="names of the CPU's peers")
def test_the_cpu_grid_names_torchs_cpu_matmul_as_such():
    providers = {p for c in registry.OPS["matmul"].bench_cases() if c.quick for p in c.setup().providers}
    assert "torch (CPU)" in providers and not any("cuBLAS" in p for p in providers)


def test_generate_bench_decodes_with_each_stack(tmp_path):
    """bench generate at the interpreter's size: HF's dynamic cache and the patched model's own
    generate (tritonformer.generate, checked inside run_stack) each make every token of a ragged
    batch; the report and plot come out, bad names are refused."""
    pytest.importorskip("transformers")
    from tritonformer.bench import generate

    rows = [r for stack in ("hf-eager", "tritonformer")
            for r in generate.run_stack(stack, generate.QUICK["model"], [(1, 6), (3, 6)], 3, 1)]
    assert [(r["stack"], r["batch"]) for r in rows] == [("hf-eager", 1), ("hf-eager", 3), ("tritonformer", 1),
                                                        ("tritonformer", 3)]
    # Steps of this tiny model can sit under the timer's noise (then NaN): HF's on a busy CPU, ours on a GPU; the
    # interpreter's kernels never do.
    assert all(r["ms_per_token"] > 0 or math.isnan(r["ms_per_token"]) for r in rows)
    if runtime.INTERPRET:
        assert all(r["ms_per_token"] > 0 for r in rows if r["stack"] == "tritonformer")
    sizes = dict(generate.QUICK["model"], model="e2e", new_tokens=3)
    report = generate.write_report(rows, sizes, {"device": "CPU", "copy_gbps": None}, tmp_path)
    assert "| tritonformer | 3 | 6 |" in report.read_text() and (tmp_path / "generate-e2e.png").exists()
    assert main(["bench", "generate", "--model", "gpt-9", "--out", str(tmp_path)]) == 2
    assert main(["bench", "generate", "--stacks", "vllm", "--out", str(tmp_path)]) == 2
    assert main(["bench", "generate", "matmul", "--out", str(tmp_path)]) == 2
