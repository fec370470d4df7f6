"""GPU time by kernel of one registry benchmark case, per provider (torch.profiler), to see where
a case's time goes beside its matmuls; beside it the case's time as the benchmark takes it
(do_bench, L2 flushed before each call) and back to back (host and GPU overlapped), which tell a
host-bound case from a GPU-bound one. With --host, also the host time of a call (the calls
queued without waiting for the GPU) and the Python functions it goes to (cProfile, by own time).

    python scripts/profile_case.py OP [--case N | --match TEXT] [--providers tritonformer,torch.compile]
                                      [--top 15] [--host]

N indexes the op's bench cases in registry order (default 0); TEXT picks the first case whose
"mode shape" contains it (the GPU grid differs from the interpreter's). On the GPU machine.
"""

import argparse
import collections
import cProfile
import pstats
import time

import torch
from triton.testing import do_bench


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("op", help="an op of tritonformer.registry.OPS")
    parser.add_argument("--case", type=int, default=0)
    parser.add_argument("--match")
    parser.add_argument("--providers", default="tritonformer,torch.compile")
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--repeats", type=int, default=5, help="calls a profile")
    parser.add_argument("--host", action="store_true", help="also the host time of a call, and its cProfile")
    args = parser.parse_args()

    from tritonformer.registry import OPS

    cases = OPS[args.op].bench_cases()
    case = next(c for c in cases if args.match in f"{c.mode} {c.shape}") if args.match else cases[args.case]
    bench = case.setup()
    print(f"{case.op} {case.mode} {case.shape}")
    for name in args.providers.split(","):
        fn = bench.providers.get(name)
        if fn is None:
            print(f"{name}: not available")
            continue
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(args.repeats):
                fn()
            torch.cuda.synchronize()
        per_kernel, count = collections.defaultdict(float), collections.Counter()
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                per_kernel[e.name[:100]] += e.device_time_total / args.repeats
                count[e.name[:100]] += 1
        start = time.perf_counter()
        for _ in range(100):
            fn()
        torch.cuda.synchronize()
        back_to_back = (time.perf_counter() - start) * 1e4
        timed = do_bench(fn, return_mode="median") * 1e3
        print(f"{name}: {sum(per_kernel.values()):.0f} us of GPU time a call; do_bench {timed:.0f} us, "
              f"back to back {back_to_back:.0f} us a call")
        for kernel, us in sorted(per_kernel.items(), key=lambda kv: -kv[1])[: args.top]:
            print(f"  {us:8.1f} us  x{count[kernel] // args.repeats:<3d} {kernel}")
        if args.host:
            torch.cuda.synchronize()
            calls = 20
            profile = cProfile.Profile()
            start = time.perf_counter()
            profile.enable()
            for _ in range(calls):
                fn()
            profile.disable()
            host = (time.perf_counter() - start) / calls * 1e6
            torch.cuda.synchronize()
            print(f"  host: {host:.0f} us a call (profiled)")
            pstats.Stats(profile).sort_stats("tottime").print_stats(args.top)


if __name__ == "__main__":
    main()
