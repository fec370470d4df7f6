"""`python -m tritonformer bench e2e [--model NAME ...]`: train a model of a named shape (built
from a config, no download) with each stack and report tokens/s, step time, peak memory, warm-up
time and the loss, plus a prefill and a greedy generation measure.

Models (MODELS): "e2e", the Llama-style model of ../shared/ANCHORS.md; "smollm2-135m" and
"qwen2.5-0.5b", the shapes of the small models most fine-tuned (issue 44; Qwen2 with its q/k/v
biases; both with tied embeddings); "qwen3-moe", a 4-layer Qwen3-MoE with Qwen3-30B-A3B's experts
(issue 46; HF's default experts, torch._grouped_mm, in the HF stacks). Stacks: HF eager (SDPA
attention), HF + Liger-Kernel (when importable), HF + torch.compile, HF + tritonformer
(integrations.hf.patch), the same with the whole step as a CUDA graph (tritonformer.capture_step),
HF + tritonformer + torch.compile, and the captured step with AdamW stepping inside backward
(`step_in_backward=True`: the gradients never all live at once). Each runs in a child process of
its own (Liger and our patch both replace module-level functions of transformers, and peak memory
is per process), on the same
seeded weights and data, with AdamW: torch's fused one (on a GPU) in the HF stacks,
tritonformer.optim.AdamW in ours. Warm-up is the wall time of the first WARMUP_STEPS steps
(compilation and graph capture included, each stack starting from empty Triton and Inductor
caches); the step time is the median of the later steps; tokens/s is batch x seq over it. Prefill
(the median of PREFILL_REPEATS) and generation run the model itself (patched or not), without
torch.compile or graphs, in every stack.
"""

from __future__ import annotations

import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# A prefill is a few milliseconds: its time is the median of several.
PREFILL_REPEATS = 5
# The last: AdamW's step inside backward, gradients freed as they are used (docs/optim.md).
STACKS = ("hf-eager", "hf+liger", "hf+torch.compile", "tritonformer", "tritonformer+cuda_graphs",
          "tritonformer+torch.compile", "tritonformer+step_in_backward+cuda_graphs")
WARMUP_STEPS = 3
RUN = dict(batch=4, seq=2048, steps=50, prompt=512, new_tokens=128)
MODELS = {
    # The model of ../shared/ANCHORS.md (issue 6): 8 layers, hidden 2048, bf16, batch 4 x 2048.
    "e2e": dict(family="llama", layers=8, hidden=2048, intermediate=8192, heads=16, kv_heads=4, vocab=128256,
                tied=False, **RUN),
    "smollm2-135m": dict(family="llama", layers=30, hidden=576, intermediate=1536, heads=9, kv_heads=3, vocab=49152,
                         tied=True, **RUN),
    "qwen2.5-0.5b": dict(family="qwen2", layers=24, hidden=896, intermediate=4864, heads=14, kv_heads=2, vocab=151936,
                         tied=True, **RUN),
    # Issue 46's mixture-of-experts model: Qwen3-30B-A3B's experts (128 of intermediate 768, top 8)
    # and attention (32 / 4 heads of 128) in 4 layers.
    "qwen3-moe": dict(family="qwen3_moe", layers=4, hidden=2048, intermediate=6144, heads=32, kv_heads=4, vocab=151936,
                      tied=False, experts=128, expert_intermediate=768, top_k=8, **RUN),
}
FULL = MODELS["e2e"]
# Under the interpreter: a model small enough to train a few steps in seconds (of each family).
QUICK = dict(family="llama", layers=2, hidden=128, intermediate=256, heads=4, kv_heads=2, vocab=256, tied=False,
             batch=2, seq=32, steps=WARMUP_STEPS + 2, prompt=8, new_tokens=4)


def _sync(device):
    import torch
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_model(sizes: dict, device, dtype):
    """The benchmark's Llama-style model from a config, on the same seeded weights every time
    (transformers imported here: a peer's patch of it must come first)."""
    import torch
    import transformers

    torch.manual_seed(0)
    family = sizes.get("family", "llama")
    configs = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
               "qwen3_moe": transformers.Qwen3MoeConfig}
    # A mixture-of-experts family's experts (at QUICK's size: 4 experts of 64, top 2).
    experts = dict(num_experts=sizes.get("experts", 4), moe_intermediate_size=sizes.get("expert_intermediate", 64),
                   num_experts_per_tok=sizes.get("top_k", 2), head_dim=sizes["hidden"] // sizes["heads"],
                   norm_topk_prob=True) if family == "qwen3_moe" else {}
    config = configs[family](
        vocab_size=sizes["vocab"], hidden_size=sizes["hidden"], intermediate_size=sizes["intermediate"],
        num_hidden_layers=sizes["layers"], num_attention_heads=sizes["heads"], num_key_value_heads=sizes["kv_heads"],
        tie_word_embeddings=sizes.get("tied", False),
        max_position_embeddings=max(sizes["seq"], sizes["prompt"] + sizes["new_tokens"]), **experts)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").to(device, dtype)


def make_optimizer(stack: str, model):
    """The stack's AdamW: ours in our stacks, torch's fused one (on a GPU) in the others (docs/optim.md)."""
    import torch

    import tritonformer

    if stack.startswith("tritonformer"):
        return tritonformer.optim.AdamW(model.parameters(), lr=1e-4,
                                        step_in_backward="step_in_backward" in stack.split("+"))
    return torch.optim.AdamW(model.parameters(), lr=1e-4, fused=next(model.parameters()).is_cuda)


def run_stack(stack: str, sizes: dict) -> dict:
    """One stack's measures (in this process)."""
    import torch

    if sizes["steps"] <= WARMUP_STEPS:
        raise ValueError(f"steps must exceed the {WARMUP_STEPS} warm-up steps, got {sizes['steps']}")

    import tritonformer  # before transformers: picks the interpreter without a GPU
    from tritonformer import runtime

    device = torch.device(runtime.DEVICE)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if stack == "hf+liger":
        import liger_kernel.transformers
        getattr(liger_kernel.transformers, f"apply_liger_kernel_to_{sizes.get('family', 'llama')}")()
    model = make_model(sizes, device, dtype)
    if stack.startswith("tritonformer"):
        from tritonformer.integrations import hf
        hf.patch(model)
    step_model = torch.compile(model) if stack.endswith("torch.compile") else model
    opt = make_optimizer(stack, model)

    def train_step(ids):
        loss = step_model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    if stack.endswith("cuda_graphs"):
        train_step = tritonformer.capture_step(train_step)
    data = torch.randint(0, sizes["vocab"], (sizes["steps"], sizes["batch"], sizes["seq"]),
                         generator=torch.Generator().manual_seed(1)).to(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    model.train()
    losses, times = [], []
    start = time.perf_counter()
    for step in range(sizes["steps"]):
        t0 = time.perf_counter()
        losses.append(train_step(data[step]).detach())
        _sync(device)
        times.append(time.perf_counter() - t0)
        if step == WARMUP_STEPS - 1:
            warmup_s = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
    step_s = statistics.median(times[WARMUP_STEPS:])
    losses = [x.float().item() for x in losses]

    model.eval()
    prompt = data[0][:1, : sizes["prompt"]]
    with torch.no_grad():
        model(input_ids=prompt)  # warm
        prefills = []
        for _ in range(PREFILL_REPEATS):
            _sync(device)
            t0 = time.perf_counter()
            model(input_ids=prompt)
            _sync(device)
            prefills.append(time.perf_counter() - t0)
        prefill_s = statistics.median(prefills)
        model.generate(prompt, max_new_tokens=2, do_sample=False)  # warm
        _sync(device)
        t0 = time.perf_counter()
        model.generate(prompt, max_new_tokens=sizes["new_tokens"], min_new_tokens=sizes["new_tokens"],
                       do_sample=False)
        _sync(device)
        generate_s = time.perf_counter() - t0
    return dict(stack=stack, tokens_per_s=sizes["batch"] * sizes["seq"] / step_s, step_ms=step_s * 1e3,
                warmup_s=warmup_s, peak_gib=peak, final_loss=losses[-1], losses=losses,
                prefill_ms=prefill_s * 1e3, generate_tokens_per_s=sizes["new_tokens"] / generate_s)


def run(out_dir: Path, quick: bool, stacks=STACKS, model: str = "e2e") -> list[dict]:
    """Each stack in a child process, training `model` (a MODELS name; its family at QUICK's
    size when quick); rows (with an `error` for a stack that failed)."""
    if model not in MODELS:
        raise ValueError(f"bench e2e: unknown model {model!r}; known: {', '.join(MODELS)}")
    sizes = dict(QUICK, family=MODELS[model]["family"], tied=MODELS[model]["tied"]) if quick else MODELS[model]
    sizes = dict(sizes, model=model)
    rows = []
    caches = tempfile.TemporaryDirectory(prefix="tritonformer-e2e-")
    for i, stack in enumerate(stacks):
        if stack == "hf+liger" and importlib.util.find_spec("liger_kernel") is None:
            rows.append(dict(stack=stack, error="liger_kernel is not installed"))
            continue
        print(f"[e2e] {stack} ...", flush=True)
        # Empty Triton and Inductor caches: the warm-up is that of a first run, for every stack.
        env = dict(os.environ, TRITON_CACHE_DIR=f"{caches.name}/{i}/triton",
                   TORCHINDUCTOR_CACHE_DIR=f"{caches.name}/{i}/inductor")
        proc = subprocess.run([sys.executable, "-m", "tritonformer.bench.e2e", stack, json.dumps(sizes)],
                              capture_output=True, text=True, env=env)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
        if proc.returncode != 0 or not lines:
            error = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            rows.append(dict(stack=stack, error=error[:300]))
            print(f"[e2e] {stack}: failed: {error[:300]}", flush=True)
            continue
        row = json.loads(lines[-1])
        rows.append(row)
        print(f"[e2e] {stack}: {row['tokens_per_s']:.0f} tokens/s, {row['peak_gib']:.2f} GiB, "
              f"warm-up {row['warmup_s']:.1f} s, loss {row['final_loss']:.4f}", flush=True)
    caches.cleanup()
    write_report(rows, sizes, out_dir)
    return rows


def report_stem(model: str) -> str:
    """The file name (less its suffix) of a model's report: e2e.md for the e2e model."""
    return "e2e" if model == "e2e" else f"e2e-{model}"


def write_report(rows: list[dict], sizes: dict, out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = report_stem(sizes.get("model", "e2e"))
    (out_dir / f"{stem}.json").write_text(json.dumps(dict(sizes=sizes, rows=rows), indent=1))
    eager = next((r for r in rows if r["stack"] == "hf-eager" and "error" not in r), None)
    lines = [
        f"# End-to-end training: {sizes.get('model', 'e2e')} shape ({sizes.get('family', 'llama')} model from a config)",
        "",
        f"{sizes['layers']} layers, hidden {sizes['hidden']}, intermediate {sizes['intermediate']}, "
        f"{sizes['heads']} heads ({sizes['kv_heads']} KV), vocab {sizes['vocab']}"
        + (f", {sizes['experts']} experts of intermediate {sizes['expert_intermediate']} (top {sizes['top_k']}; "
           "the HF stacks run transformers' default experts, grouped_mm)" if "experts" in sizes else "") +
        f"{' (tied embeddings)' if sizes.get('tied') else ''}, batch {sizes['batch']} x "
        f"{sizes['seq']} tokens, {sizes['steps']} steps of AdamW; warm-up = the first {WARMUP_STEPS} steps, "
        "from empty Triton and Inductor caches (a first run); "
        f"prefill of {sizes['prompt']} tokens; greedy generation of {sizes['new_tokens']} tokens.", "",
        "| stack | tokens/s | step ms | peak GiB | warm-up s | loss after the last step | vs HF eager loss | "
        "prefill ms | generation tokens/s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['stack']} | {r['error']} | | | | | | | |")
            continue
        vs = f"{(r['final_loss'] / eager['final_loss'] - 1) * 100:+.2f}%" if eager else ""
        lines.append(f"| {r['stack']} | {r['tokens_per_s']:.0f} | {r['step_ms']:.1f} | {r['peak_gib']:.2f} | "
                     f"{r['warmup_s']:.1f} | {r['final_loss']:.4f} | {vs} | {r['prefill_ms']:.1f} | "
                     f"{r['generate_tokens_per_s']:.1f} |")
    return write_page(out_dir, stem, lines, rows, _plot)


def write_page(out_dir: Path, stem: str, lines: list[str], rows: list[dict], plot) -> Path:
    """<stem>.md from lines with its plot below, and <stem>.png drawn by plot from the rows that
    did not fail (bench e2e's and bench generate's reports)."""
    path = out_dir / f"{stem}.md"
    path.write_text("\n".join(lines + ["", f"![{stem}]({stem}.png)", ""]))
    plot([r for r in rows if "error" not in r], out_dir / f"{stem}.png")
    return path


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not rows:
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    names = [r["stack"] for r in rows]
    for ax, key, title in ((axes[0], "tokens_per_s", "training tokens/s"), (axes[1], "peak_gib", "peak GiB")):
        ax.barh(names, [r[key] for r in rows], color=["C1" if n.startswith("tritonformer") else "C0" for n in names])
        ax.set_title(title)
        ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    print(json.dumps(run_stack(sys.argv[1], json.loads(sys.argv[2]))))
