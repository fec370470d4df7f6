"""Where a decode step's time goes: tritonformer.generate's captured step of a bench generate model,
replayed, timed (CUDA events) and profiled (torch.profiler sees the kernels a graph launches): the
step's time against its kernels' busy time, and each kernel's time a step with the bytes it must
read where it is a product (its weight). On the GPU machine:

    python scripts/profile_decode.py [--model e2e|llama3-8b] [--batch 1] [--prompt 512] [--top 25]
"""

import argparse
import collections

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="e2e")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--weights", default=None, help="hf.patch weights= (nvfp4, mxfp4, mxfp8)")
    args = parser.parse_args()

    import tritonformer  # noqa: F401  (before transformers)
    from tritonformer import decoding
    from tritonformer.bench.generate import MODELS, make_model, prompts, step_bytes
    from tritonformer.integrations import hf

    sizes = MODELS[args.model]
    new_tokens, replays = 16, 50
    model = make_model(sizes, args.prompt + new_tokens + 2 * replays, "cuda", torch.bfloat16)
    hf.patch(model, weights=args.weights)
    ids, mask = prompts(args.batch, args.prompt, sizes["vocab"], "cuda")
    model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False)
    decoder = decoding.DECODERS[model][1]
    assert decoder.graph is not None, "the step was not captured"

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(replays):
        decoder.graph.replay()
    end.record()
    torch.cuda.synchronize()
    step_ms = start.elapsed_time(end) / replays
    floor_ms = step_bytes(sizes, args.batch, args.prompt, 2) / 4.25e12 * 1e3

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            decoder.graph.replay()
        torch.cuda.synchronize()
    kernels = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                     key=lambda e: e.time_range.start)
    busy = sum(e.time_range.elapsed_us() for e in kernels) / replays
    per_step = len(kernels) / replays
    gaps = [b.time_range.start - a.time_range.end for a, b in zip(kernels, kernels[1:])]
    print(f"{args.model} batch {args.batch} prompt {args.prompt}: step {step_ms * 1e3:.0f} us (replayed graph), "
          f"kernels busy {busy:.0f} us, {per_step:.0f} kernels a step, median gap "
          f"{sorted(gaps)[len(gaps) // 2]:.1f} us; floor {floor_ms * 1e3:.0f} us at 4.25 TB/s "
          f"({floor_ms / step_ms * 100:.0f}% of it)")
    by_name = collections.defaultdict(lambda: [0.0, 0])
    # A kernel launched c times a layer (the products): its time by call within the layer too.
    by_call = collections.defaultdict(lambda: [0.0, 0])
    seen = collections.Counter()
    for e in kernels:
        by_name[e.name][0] += e.time_range.elapsed_us()
        by_name[e.name][1] += 1
        by_call[e.name, seen[e.name]][0] += e.time_range.elapsed_us()
        seen[e.name] += 1
    layers = len(model.model.layers)
    print(f"{'us/step':>8s} {'calls':>5s} {'us each':>8s}  kernel")
    for name, (total, n) in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:args.top]:
        print(f"{total / replays:8.1f} {n / replays:5.0f} {total / n:8.2f}  {name[:110]}")
        per_layer = n // replays // layers
        if per_layer > 1 and n == replays * layers * per_layer:
            for c in range(per_layer):
                part = sum(by_call[name, i][0] for i in range(c, n, per_layer))
                print(f"{part / replays:8.1f} {layers:5d} {part / (n / per_layer):8.2f}    call {c} of {per_layer} a layer")
    # The products' weights, per kind, and the time they would take at 4.25 TB/s.
    layer = model.model.layers[0]
    print("weights a step (MB, us at 4.25 TB/s):")
    for name, w in [("q", layer.self_attn.q_proj), ("k", layer.self_attn.k_proj), ("o", layer.self_attn.o_proj),
                    ("gate", layer.mlp.gate_proj), ("down", layer.mlp.down_proj), ("lm_head", model.lm_head)]:
        parts = (w.weight.data, w.weight.scales) if hasattr(w.weight, "scales") else (w.weight,)
        nbytes = sum(t.numel() * t.element_size() for t in parts)
        print(f"  {name:8s} {nbytes / 1e6:7.1f} MB {nbytes / 4.25e6:7.1f} us")

if __name__ == "__main__":
    main()
