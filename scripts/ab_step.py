"""Wall time of bench e2e's training step (tritonformer stack) with one feature of the HF patch
on and off, in one process: blocks of steps alternate between the two, so that clock and thermal
drift hit both alike; prints each side's median step and their ratio. On the GPU machine:

    python scripts/ab_step.py --feature qkv_rope [--blocks 6] [--steps 8]

--feature names a boolean attribute of integrations.hf.Family (a per-family switch of the patch).
"""

import argparse
import statistics
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--feature", required=True, help="a boolean attribute of integrations.hf.Family")
    parser.add_argument("--blocks", type=int, default=6, help="blocks of steps a side")
    parser.add_argument("--steps", type=int, default=8, help="timed steps a block")
    args = parser.parse_args()

    import tritonformer  # noqa: F401  (before transformers)
    from tritonformer.bench.e2e import FULL, make_model, make_optimizer
    from tritonformer.integrations import hf

    family = hf.FAMILIES["llama"]
    if not isinstance(getattr(family, args.feature, None), bool):
        raise SystemExit(f"--feature must be a boolean attribute of hf.Family, got {args.feature!r}")
    model = make_model(FULL, "cuda", torch.bfloat16)
    opt = make_optimizer("tritonformer", model)
    data = torch.randint(0, FULL["vocab"], (FULL["batch"], FULL["seq"]), device="cuda")

    def use(on: bool) -> None:
        hf.unpatch(model)
        setattr(family, args.feature, on)
        hf.patch(model)

    def step() -> tuple[float, float]:
        """Wall seconds of one synchronised step, and the GPU's seconds from its first to its last work."""
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        start.record()
        model(input_ids=data, labels=data).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        end.record()
        torch.cuda.synchronize()
        return time.perf_counter() - t0, start.elapsed_time(end) / 1e3

    times = {True: [], False: []}
    for on in (True, False):  # compile and autotune both sides first
        use(on)
        for _ in range(3):
            step()
    for block in range(args.blocks):
        for on in (True, False) if block % 2 == 0 else (False, True):
            use(on)
            step()
            times[on] += [step() for _ in range(args.steps)]
    for what, i in (("wall", 0), ("GPU span", 1)):
        on_ms, off_ms = (statistics.median(t[i] for t in times[v]) * 1e3 for v in (True, False))
        print(f"{args.feature} {what}: on {on_ms:.2f} ms, off {off_ms:.2f} ms a step (medians of {len(times[True])}); "
              f"off/on {off_ms / on_ms:.4f}")


if __name__ == "__main__":
    main()
