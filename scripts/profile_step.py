"""GPU time of one training step of a bench e2e model, by kernel (torch.profiler), for one stack,
and where the GPU sits idle: the step's wall time (synchronised, as bench e2e times it) against
the kernels' busy time, and the longest gaps between kernels with the kernels either side. On the
GPU machine:

    python scripts/profile_step.py [--model e2e|smollm2-135m|qwen2.5-0.5b|qwen3-moe]
        [--stack STACK (bench.e2e.STACKS: tritonformer, tritonformer+cuda_graphs, hf+torch.compile, ...)]
        [--top 30] [--gaps 15]

Under torch.compile it also prints dynamo's graph count and graph breaks (by reason).
"""

import argparse
import collections
import cProfile
import json
import pstats
import tempfile
import time

import torch


def print_matmuls(prof) -> None:
    """Each matmul's count, GPU time and TFLOP/s a step, by input shapes (a profile of two steps)."""
    print("matmuls (per step): count, ms, us each, TFLOP/s, shapes")
    for row in sorted(prof.key_averages(group_by_input_shape=True), key=lambda r: -r.device_time_total):
        if row.key not in ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm") or not row.input_shapes:
            continue
        a, b = [s for s in row.input_shapes if len(s) >= 2][:2]
        flops = 2 * a[-2] * a[-1] * b[-1] * (a[0] if len(a) == 3 else 1)
        each = row.device_time_total / row.count
        print(f"  x{row.count // 2:<3d} {row.device_time_total / 2e3:6.2f} ms {each:7.1f} us "
              f"{flops / each / 1e6:6.0f}  {row.key} {row.input_shapes}")


def print_gaps(prof, count: int, stacks: bool) -> None:
    """The second profiled step's busy and idle GPU time, its host runtime calls, and its `count`
    longest gaps between GPU activities with the activities either side (and with `stacks`, the
    Python frames of the launch after each). GPU activities: kernels, copies, memsets."""
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        trace = json.load(open(f.name))["traceEvents"]
    gpu = sorted((e["ts"], e["ts"] + e.get("dur", 0), e["name"], e.get("args", {}).get("correlation"))
                 for e in trace if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"))
    gpu = gpu[len(gpu) // 2:]
    runtime_calls = {e.get("args", {}).get("correlation"): e for e in trace if e.get("cat") == "cuda_runtime"}
    host = sorted((e for e in trace if e.get("cat") in ("cpu_op", "python_function") and "dur" in e),
                  key=lambda e: e["ts"])

    def host_frames(t, tid):
        """Names of the host events (ops, Python frames) open at time t on thread tid, outermost first."""
        return [e["name"] for e in host if e["tid"] == tid and e["ts"] <= t < e["ts"] + e["dur"]]

    gaps = [(b[0] - a[1], a, b) for a, b in zip(gpu, gpu[1:])]
    busy = sum(e - s for s, e, *_ in gpu)
    span = gpu[-1][1] - gpu[0][0]
    print(f"second step: {len(gpu)} GPU activities, busy {busy / 1e3:.1f} ms over a span of {span / 1e3:.1f} ms; "
          f"idle {sum(g for g, *_ in gaps if g > 0) / 1e3:.1f} ms "
          f"({sum(1 for g, *_ in gaps if g > 20)} gaps over 20 us, {sum(g for g, *_ in gaps if g > 20) / 1e3:.1f} ms)")
    step_start = gpu[0][0]
    slow = collections.defaultdict(lambda: [0.0, 0, 0.0])
    for e in runtime_calls.values():
        if e["ts"] >= step_start - 20e3 and "dur" in e:
            entry = slow[e["name"]]
            entry[0] += e["dur"]
            entry[1] += 1
            entry[2] = max(entry[2], e["dur"])
    print("host runtime calls in the step (total us, count, longest us):")
    for name, (total_us, n, longest) in sorted(slow.items(), key=lambda kv: -kv[1][0])[:8]:
        print(f"  {total_us:8.0f} {n:5d} {longest:8.0f}  {name}")
    for gap, before, after in sorted(gaps, key=lambda g: -g[0])[:count]:
        print(f"  {gap:8.0f} us  after {before[2][:50]}  before {after[2][:50]}")
        launch = runtime_calls.get(after[3])
        if stacks and launch is not None:
            frames = [f for f in host_frames(launch["ts"], launch["tid"]) if "site-packages/torch/" not in f]
            print("             " + " > ".join(f.split("/")[-1][:60] for f in frames[-8:]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stack", default="tritonformer", help="a bench e2e stack (bench.e2e.STACKS)")
    parser.add_argument("--model", default="e2e", help="a bench e2e model name (bench.e2e.MODELS)")
    parser.add_argument("--top", type=int, default=30, help="kernels listed")
    parser.add_argument("--gaps", type=int, default=15, help="longest idle gaps listed")
    parser.add_argument("--stacks", action="store_true", help="Python frames at each gap's next launch (slower steps)")
    parser.add_argument("--host", action="store_true", help="host time of the forward, and its cProfile")
    parser.add_argument("--use-cache", action="store_true", help="pass use_cache=True (HF fills a KV cache)")
    parser.add_argument("--gemms", action="store_true", help="each matmul's shapes, GPU time and TFLOP/s")
    parser.add_argument("--off", default="", help="comma-separated hf.Family switches to turn off (e.g. qkv_rope)")
    parser.add_argument("--syncs", action="store_true", help="the Python stack of each host synchronisation in a step")
    args = parser.parse_args()

    import tritonformer  # before transformers
    from tritonformer.bench.e2e import MODELS, STACKS, make_model, make_optimizer

    if args.stack not in STACKS:
        parser.error(f"--stack must be one of {', '.join(STACKS)}")
    sizes = MODELS[args.model]
    family = sizes["family"]
    if args.stack == "hf+liger":
        import liger_kernel.transformers
        getattr(liger_kernel.transformers, f"apply_liger_kernel_to_{family}")()

    model = make_model(sizes, "cuda", torch.bfloat16)
    if args.stack.startswith("tritonformer"):
        from tritonformer.integrations import hf
        for feature in filter(None, args.off.split(",")):
            setattr(hf.FAMILIES[family], feature, False)
        hf.patch(model)
    step_model = torch.compile(model) if args.stack.endswith("torch.compile") else model
    opt = make_optimizer(args.stack, model)
    data = torch.randint(0, sizes["vocab"], (sizes["batch"], sizes["seq"]), device="cuda")

    def forward():
        return step_model(input_ids=data, labels=data, use_cache=args.use_cache or None).loss

    def train_step(ids):
        loss = step_model(input_ids=ids, labels=ids, use_cache=args.use_cache or None).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    if args.stack.endswith("cuda_graphs"):
        # The step as one CUDA graph (bench e2e's capture stack): the gaps left are the graph's own.
        train_step = tritonformer.capture_step(train_step)

    def step():
        train_step(data)

    for _ in range(5):
        step()
    torch.cuda.synchronize()
    if args.syncs:
        import traceback
        import warnings

        def show_sync(message, *_):
            frames = [f for f in traceback.extract_stack()[:-1] if "/torch/" not in f.filename]
            print(f"sync: {message}\n" + "".join(f"    {f.filename.split('/')[-1]}:{f.lineno} {f.name}\n"
                                                  for f in frames[-6:]))

        warnings.showwarning = show_sync
        torch.cuda.set_sync_debug_mode("warn")
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            step()
        torch.cuda.set_sync_debug_mode("default")
    walls = []
    for _ in range(10):
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        walls.append(time.perf_counter() - t0)
    wall_ms = sorted(walls)[len(walls) // 2] * 1e3
    if args.host:
        # The forward's host time against its GPU time: the GPU starves wherever the host is slower.
        issue, gpu_fwd = [], []
        for _ in range(5):
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter()
            start.record()
            loss = forward()
            end.record()
            issue.append(time.perf_counter() - t0)
            torch.cuda.synchronize()
            gpu_fwd.append(start.elapsed_time(end) / 1e3)
            loss.backward()
            opt.zero_grad(set_to_none=True)
        print(f"forward: host {sorted(issue)[2] * 1e3:.1f} ms to issue, GPU {sorted(gpu_fwd)[2] * 1e3:.1f} ms "
              "from first to last kernel (median of 5)")
        profile = cProfile.Profile()
        for _ in range(3):
            # One forward at a time, as in a step: otherwise HF's host synchronisation waits on the
            # previous forward's kernels inside the profile.
            torch.cuda.synchronize()
            profile.enable()
            loss = forward()
            profile.disable()
            del loss
        pstats.Stats(profile).sort_stats("tottime").print_stats(25)
        pstats.Stats(profile).sort_stats("cumtime").print_stats(30)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA, torch.profiler.ProfilerActivity.CPU],
                                with_stack=args.stacks, record_shapes=args.gemms) as prof:
        for _ in range(2):
            step()
            torch.cuda.synchronize()
    per_kernel = collections.defaultdict(float)
    count = collections.Counter()
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per_kernel[e.name[:90]] += e.device_time_total / 2 / 1e3
            count[e.name[:90]] += 1
    total = sum(per_kernel.values())
    print(f"{args.stack}: GPU time per step {total:.1f} ms; wall time per step {wall_ms:.1f} ms (median of 10)")
    for name, ms in sorted(per_kernel.items(), key=lambda kv: -kv[1])[: args.top]:
        print(f"  {ms:7.2f} ms  x{count[name] // 2:<4d} {name}")

    if args.gemms:
        print_matmuls(prof)
    print_gaps(prof, args.gaps, args.stacks)
    if args.stack.endswith("torch.compile"):
        from torch._dynamo.utils import counters
        print(f"dynamo: {counters['stats']['unique_graphs']} graphs; graph breaks: {dict(counters['graph_break'])}")
    if args.stack.startswith("tritonformer"):
        from tritonformer import runtime
        for kernel, chosen in runtime.TunedLauncher.chosen_configs().items():
            print(f"autotuned {kernel}: {chosen}")


if __name__ == "__main__":
    main()
