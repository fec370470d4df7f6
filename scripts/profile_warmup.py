"""Where the patched model's warm-up goes: each Triton compile (or disk-cache load) and each
tuning (runtime.TunedLauncher's timing of its candidates, Triton's autotuner), timed, for the
first training steps of a bench e2e model, stepped by tritonformer.optim.AdamW as bench e2e's
tritonformer stack does. On the GPU machine:

    python scripts/profile_warmup.py [--model e2e|smollm2-135m|qwen2.5-0.5b|qwen3-moe] [--steps 3]
        [--cold] [--layers N]

--cold: a fresh, empty TRITON_CACHE_DIR, so that every kernel compiles.
"""

import argparse
import collections
import os
import sys
import tempfile
import threading
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3, help="training steps timed")
    parser.add_argument("--cold", action="store_true", help="start from an empty Triton cache")
    parser.add_argument("--model", default="e2e", help="a bench e2e model name (bench.e2e.MODELS)")
    parser.add_argument("--layers", type=int, help="decoder layers (default: the model's)")
    args = parser.parse_args()
    if args.cold:
        os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="triton-cold-")

    import torch

    import tritonformer  # noqa: F401  (before triton and transformers)
    from triton import knobs
    from triton.runtime import autotuner

    from tritonformer import runtime
    from tritonformer.bench.e2e import MODELS, make_model, make_optimizer

    compile_s = collections.defaultdict(float)
    compile_n = collections.Counter()
    started = {}
    timeline = []  # (start, end, kernel, thread)

    def on_start(*, key, repr, fn, compile, is_manual_warmup, already_compiled):
        started[(fn.name, str(key))] = time.perf_counter()
        return False

    def on_end(*, key, repr, fn, compile, is_manual_warmup, already_compiled):
        t0 = started.pop((fn.name, str(key)), None)
        if t0 is not None:
            t1 = time.perf_counter()
            compile_s[fn.name] += t1 - t0
            compile_n[fn.name] += 1
            timeline.append((t0, t1, fn.name, threading.current_thread().name))

    knobs.runtime.jit_cache_hook = on_start
    knobs.runtime.jit_post_compile_hook = on_end

    tune_s = collections.defaultdict(float)
    original_run = autotuner.Autotuner.run

    def timed_run(self, *a, **kw):
        before = len(self.cache)
        t0 = time.perf_counter()
        out = original_run(self, *a, **kw)
        if len(self.cache) > before:
            tune_s[self.base_fn.__name__] += time.perf_counter() - t0
        return out

    autotuner.Autotuner.run = timed_run
    original_time = runtime.TunedLauncher._time_candidates

    def timed_candidates(self, *a, **kw):
        t0 = time.perf_counter()
        out = original_time(self, *a, **kw)
        tune_s[self.autotuned.fn.__name__] += time.perf_counter() - t0
        return out

    runtime.TunedLauncher._time_candidates = timed_candidates

    from tritonformer.integrations import hf

    sizes = dict(MODELS[args.model])
    if args.layers:
        sizes["layers"] = args.layers
    model = make_model(sizes, torch.device("cuda"), torch.bfloat16)
    hf.patch(model)
    opt = make_optimizer("tritonformer", model)
    data = torch.randint(0, sizes["vocab"], (args.steps, sizes["batch"], sizes["seq"]), device="cuda")
    t_all = time.perf_counter()
    for step in range(args.steps):
        t0 = time.perf_counter()
        loss = model(input_ids=data[step], labels=data[step]).loss
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        loss.backward()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        print(f"step {step}: forward {t1 - t0:.2f} s, backward {t2 - t1:.2f} s, "
              f"optimizer {time.perf_counter() - t2:.2f} s")
    print(f"first {args.steps} steps: {time.perf_counter() - t_all:.2f} s "
          f"({'cold' if args.cold else 'warm'} Triton cache)")
    print("compile (or cache load) per kernel, s:")
    for name, s in sorted(compile_s.items(), key=lambda kv: -kv[1]):
        print(f"  {name:40s} {s:6.2f}  x{compile_n[name]}")
    print(f"  total {sum(compile_s.values()):.2f}")
    print("compiles in time order, s from the first step's start (thread):")
    for t0, t1, name, thread in sorted(timeline):
        print(f"  {t0 - t_all:6.2f} .. {t1 - t_all:6.2f}  {name:36s} {thread}")
    print("tuning per kernel (Triton's autotuner: compiles included; TunedLauncher: timing alone), s:")
    for name, s in sorted(tune_s.items(), key=lambda kv: -kv[1]):
        print(f"  {name:40s} {s:6.2f}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
