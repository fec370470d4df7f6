"""`python -m tritonformer bench generate [--model NAME ...] [--batch N ...] [--prompt N ...]`:
greedy decoding of a Llama-shaped model (from a config, random weights) with each stack, against
the memory roofline.

Stacks (STACKS), each in a child process of its own: HF's generate with its dynamic cache
("hf-eager"), with its static cache (HF compiles the decode step: "hf-static"), the patched model
through HF's own generate with its dynamic cache (where a patched model's generate goes for the
arguments tritonformer.generate does not take: "tritonformer+hf-eager") and with HF's static cache
("tritonformer+hf-static"), and the patched model's generate with HF's
default arguments, which runs tritonformer.generate ("tritonformer"; "tritonformer+nvfp4" with the
layers' projections nvfp4, hf.patch(model, weights="nvfp4"), lm_head bf16; "tritonformer+nvfp4-lm-head"
with lm_head nvfp4 too, quantize_lm_head=True). Cases: each batch size with each prompt length;
batches above 1 get prompts of mixed lengths (left-padded, from half the prompt to all of it).
A case's first call is its warm-up (compiles and graph capture included); then a call making
NEW_TOKENS tokens is timed REPEATS times and one making 1 (the prefill) PREFILL_REPEATS times,
and the decode time per token is the difference of their medians over NEW_TOKENS - 1 (the
prefill is host-bound: 8.5-17 ms at batch 1 for 1.5 ms of GPU time, and a median of 3 moved the
e2e model's batch-1 figure by 7%). The roofline is the
bytes a decode step must read in bf16 (every weight past the embedding, lm_head included, plus
the KV cache at the mean context) over the copy bandwidth measured in the same run (the nvfp4
stack reads fewer bytes: its % of that roofline can pass 100).
"""

from __future__ import annotations

import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .e2e import write_page

STACKS = ("hf-eager", "hf-static", "tritonformer+hf-eager", "tritonformer+hf-static", "tritonformer", "tritonformer+nvfp4",
          "tritonformer+nvfp4-lm-head")
# Stacks that run tritonformer.generate, and those of them with block-scaled weights.
OURS = ("tritonformer", "tritonformer+nvfp4", "tritonformer+nvfp4-lm-head")
BLOCK_SCALED = ("tritonformer+nvfp4", "tritonformer+nvfp4-lm-head")
MODELS = {
    # The e2e model of ../shared/ANCHORS.md and the Llama-3-8B shape (issue 45).
    "e2e": dict(layers=8, hidden=2048, intermediate=8192, heads=16, kv_heads=4, vocab=128256),
    "llama3-8b": dict(layers=32, hidden=4096, intermediate=14336, heads=32, kv_heads=8, vocab=128256),
}
BATCHES = (1, 16, 64)
PROMPTS = (512,)
NEW_TOKENS = 128
REPEATS = 3
PREFILL_REPEATS = 9
# Under the interpreter: a model and cases small enough for seconds.
QUICK = dict(model=dict(layers=2, hidden=128, intermediate=256, heads=4, kv_heads=2, vocab=256),
             batches=(1, 2), prompts=(8,), new_tokens=4, repeats=1)


def make_model(sizes: dict, max_positions: int, device, dtype):
    """The benchmark's Llama model from a config, made on the device (an 8B model initialised on
    the CPU takes minutes), without eos so that every call makes all its tokens."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=sizes["vocab"], hidden_size=sizes["hidden"], intermediate_size=sizes["intermediate"],
        num_hidden_layers=sizes["layers"], num_attention_heads=sizes["heads"], num_key_value_heads=sizes["kv_heads"],
        max_position_embeddings=max_positions, eos_token_id=None, bos_token_id=None, pad_token_id=0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=dtype)
    return model.eval()


def prompts(batch: int, length: int, vocab: int, device):
    """(input_ids, attention_mask): batch prompts, left-padded; mixed lengths above batch 1."""
    import torch

    gen = torch.Generator().manual_seed(batch * 100003 + length)
    ids = torch.randint(1, vocab, (batch, length), generator=gen)
    mask = torch.ones_like(ids)
    if batch > 1:
        for b, n in enumerate(torch.randint(length // 2, length + 1, (batch,), generator=gen).tolist()):
            ids[b, :length - n] = 0
            mask[b, :length - n] = 0
    return ids.to(device), mask.to(device)


def step_bytes(sizes: dict, batch: int, context: float, itemsize: int) -> float:
    """Bytes a decode step reads at least: the weights past the embedding (lm_head included) and
    each sequence's K and V at `context` tokens."""
    h, i, layers = sizes["hidden"], sizes["intermediate"], sizes["layers"]
    head_dim = h // sizes["heads"]
    kv = sizes["kv_heads"] * head_dim
    per_layer = h * (h + 2 * kv) + h * h + 3 * h * i + 2 * h
    weights = layers * per_layer + h + sizes["vocab"] * h
    cache = batch * context * layers * 2 * kv
    return (weights + cache) * itemsize


def run_stack(stack: str, sizes: dict, cases: list, new_tokens: int, repeats: int) -> list[dict]:
    """One stack's rows (in this process)."""
    import torch

    import tritonformer  # before transformers: picks the interpreter without a GPU
    from tritonformer import decoding
    from tritonformer import runtime

    device = torch.device(runtime.DEVICE)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    longest = max(prompt for _, prompt in cases) + new_tokens
    model = make_model(sizes, longest, device, dtype)
    if stack.startswith("tritonformer"):
        from tritonformer.integrations import hf
        hf.patch(model, weights="nvfp4" if stack in BLOCK_SCALED else None,
                 quantize_lm_head=stack == "tritonformer+nvfp4-lm-head")
    options = dict(do_sample=False, cache_implementation="static") if stack.endswith("hf-static") else \
        dict(do_sample=False)
    # The patched model's own generate takes tritonformer.generate; HF's generate is its class's.
    generate = functools.partial(type(model).generate, model) if stack == "tritonformer+hf-eager" else model.generate

    def timed(ids, mask, n):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = generate(ids, attention_mask=mask, max_new_tokens=n, **options)
        if device.type == "cuda":
            torch.cuda.synchronize()
        assert out.shape[1] == ids.shape[1] + n, f"{stack} made {out.shape[1] - ids.shape[1]} tokens, not {n}"
        return time.perf_counter() - start

    rows = []
    for batch, prompt in cases:
        ids, mask = prompts(batch, prompt, sizes["vocab"], device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        warmup = timed(ids, mask, new_tokens)
        # The patched model's generate must have taken tritonformer.generate, not HF's.
        ours = stack in OURS
        assert ours == (model in decoding.DECODERS), f"{stack}: the wrong generate ran"
        full = statistics.median(timed(ids, mask, new_tokens) for _ in range(repeats))
        prefill = statistics.median(timed(ids, mask, 1) for _ in range(PREFILL_REPEATS if repeats > 1 else 1))
        # A difference under the timer's noise (a tiny model on a busy CPU) is no figure: NaN, never a negative rate.
        ms_per_token = (full - prefill) / (new_tokens - 1) * 1e3 if full > prefill else float("nan")
        peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
        rows.append(dict(stack=stack, batch=batch, prompt=prompt, context=float(mask.sum(1).float().mean()) + new_tokens / 2,
                         warmup_s=warmup, prefill_ms=prefill * 1e3, ms_per_token=ms_per_token,
                         tokens_per_s=batch / ms_per_token * 1e3, peak_gib=peak))
    return rows


def run(out_dir: Path, quick: bool, stacks=STACKS, model: str = "e2e", batches=BATCHES, prompts_=PROMPTS) -> list[dict]:
    """Each stack in a child process; rows (an `error` for a stack that failed) and the report."""
    from . import runner

    if model not in MODELS:
        raise ValueError(f"bench generate: unknown model {model!r}; known: {', '.join(MODELS)}")
    sizes = QUICK["model"] if quick else MODELS[model]
    cases = [(b, p) for p in (QUICK["prompts"] if quick else prompts_) for b in (QUICK["batches"] if quick else batches)]
    new_tokens = QUICK["new_tokens"] if quick else NEW_TOKENS
    repeats = QUICK["repeats"] if quick else REPEATS
    if quick and set(stacks) & set(BLOCK_SCALED):
        # Their bf16 model's block-scaled products take minutes under the interpreter (the tests
        # check that path's tokens against HF's on a GPU, and mxfp8's on a CPU).
        print("[generate] the nvfp4 stacks: left out under the interpreter", flush=True)
        stacks = [stack for stack in stacks if stack not in BLOCK_SCALED]
    ceilings = runner.measure_ceilings(quick=True)
    runner.free_device_memory()
    rows = []
    caches = tempfile.TemporaryDirectory(prefix="tritonformer-generate-")
    for i, stack in enumerate(stacks):
        print(f"[generate] {stack} ...", flush=True)
        env = dict(os.environ, TRITON_CACHE_DIR=f"{caches.name}/{i}/triton",
                   TORCHINDUCTOR_CACHE_DIR=f"{caches.name}/{i}/inductor")
        job = dict(stack=stack, sizes=sizes, cases=cases, new_tokens=new_tokens, repeats=repeats)
        proc = subprocess.run([sys.executable, "-m", "tritonformer.bench.generate", json.dumps(job)],
                              capture_output=True, text=True, env=env)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("[{")]
        if proc.returncode != 0 or not lines:
            error = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            rows.append(dict(stack=stack, error=error[:300]))
            print(f"[generate] {stack}: failed: {error[:300]}", flush=True)
            continue
        for row in json.loads(lines[-1]):
            bytes_ = step_bytes(sizes, row["batch"], row["context"], 2 if not quick else 4)
            gbps = ceilings.get("copy_gbps")
            row["roofline_ms"] = bytes_ / (gbps * 1e9) * 1e3 if gbps else None
            rows.append(row)
            print(f"[generate] {stack} batch {row['batch']} prompt {row['prompt']}: {row['tokens_per_s']:.0f} tokens/s, "
                  f"{row['ms_per_token']:.2f} ms/token, warm-up {row['warmup_s']:.1f} s", flush=True)
    caches.cleanup()
    write_report(rows, dict(sizes, model=model, new_tokens=new_tokens), ceilings, out_dir)
    return rows


def write_report(rows: list[dict], sizes: dict, ceilings: dict, out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"generate-{sizes['model']}"
    (out_dir / f"{stem}.json").write_text(json.dumps(dict(sizes=sizes, ceilings=ceilings, rows=rows), indent=1))
    gbps = ceilings.get("copy_gbps")
    bases = {stack: {(r["batch"], r["prompt"]): r for r in rows if r.get("stack") == stack and "error" not in r}
             for stack in ("hf-static", "hf-eager")}
    lines = [
        f"# Generation: {sizes['model']} shape (Llama model from a config, random weights)", "",
        f"{sizes['layers']} layers, hidden {sizes['hidden']}, intermediate {sizes['intermediate']}, "
        f"{sizes['heads']} heads ({sizes['kv_heads']} KV), vocab {sizes['vocab']}; greedy, {sizes['new_tokens']} new "
        f"tokens; device {ceilings.get('device')}, copy bandwidth "
        + (f"{gbps:.0f} GB/s" if gbps else "not measured") + ". Roofline: weights past the embedding plus the KV "
        "cache at the mean context, read once a step at that bandwidth.", "",
        "| stack | batch | prompt | tokens/s | ms/token | roofline ms | % of roofline | vs hf-static | vs hf-eager | "
        "prefill ms | warm-up s | peak GiB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['stack']} | {r['error']} | | | | | | | | | | |")
            continue
        roof = r.get("roofline_ms")
        ratios = []
        for stack in ("hf-static", "hf-eager"):
            base = bases[stack].get((r["batch"], r["prompt"]))
            ratios.append(f"{base['ms_per_token'] / r['ms_per_token']:.2f}x | " if base else "- | ")
        lines.append(
            f"| {r['stack']} | {r['batch']} | {r['prompt']} | {r['tokens_per_s']:.0f} | {r['ms_per_token']:.2f} | "
            + (f"{roof:.2f} | {roof / r['ms_per_token'] * 100:.0f}% | " if roof else "- | - | ")
            + "".join(ratios)
            + f"{r['prefill_ms']:.1f} | {r['warmup_s']:.1f} | {r['peak_gib']:.2f} |")
    return write_page(out_dir, stem, lines, rows, _plot)


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not rows:
        return
    prompt_lengths = sorted({r["prompt"] for r in rows})
    fig, axes = plt.subplots(1, len(prompt_lengths), figsize=(5.5 * len(prompt_lengths), 3.8), squeeze=False)
    for ax, prompt in zip(axes[0], prompt_lengths):
        for i, stack in enumerate(dict.fromkeys(r["stack"] for r in rows)):
            mine = sorted((r for r in rows if r["stack"] == stack and r["prompt"] == prompt), key=lambda r: r["batch"])
            ax.plot([r["batch"] for r in mine], [r["tokens_per_s"] for r in mine], marker="o", label=stack,
                    color=f"C{i}")
        roof = sorted((r for r in rows if r["prompt"] == prompt and r.get("roofline_ms")), key=lambda r: r["batch"])
        if roof:
            ax.plot([r["batch"] for r in roof], [r["batch"] / r["roofline_ms"] * 1e3 for r in roof], "k--",
                    label="roofline")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("batch")
        ax.set_ylabel("tokens/s")
        ax.set_title(f"prompt {prompt}")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    job = json.loads(sys.argv[1])
    print(json.dumps(run_stack(job["stack"], job["sizes"], [tuple(c) for c in job["cases"]], job["new_tokens"],
                               job["repeats"])))
