"""GPU time of decode_linear / decode_swiglu over launch configs, timed in a CUDA graph (no host
time): a decode step's products of the e2e model (or Llama-3-8B) with their norms as the decode
step runs them. On the GPU machine:

    PYTHONPATH=src python3 scripts/sweep_decode_linear.py [--model e2e|llama3-8b] [--rows 1]
        [--configs BNxBK:wW:sS,...] [--shapes qkv,o,gate_up,down] [--fmt nvfp4|mxfp4]
        (with --fmt also the chained products: qkv_chained, o_chained, gate_up_chained, down_chained)

Prints each config's time and weight bytes a second, and the best per shape; with --fmt (one row,
fp4 weights) also scaled_matmul's one-row kernel, a launch a weight, norm and activation apart. Each timed call
cycles through copies of the weights that together exceed L2 (a decode step reads each weight
once, never from L2).
"""

import argparse
import dataclasses

import torch
import triton
from triton.testing import do_bench_cudagraph

# More than the H200's 50 MB L2.
L2_FLUSH_BYTES = 256 << 20
DEFAULT_CONFIGS = ",".join(f"{bn}x{bk}:w{w}:s{s}" for bn in (4, 8, 16, 32) for bk in (512, 1024)
                           for w, s in ((4, 3), (8, 3), (4, 5)))
FP4_CONFIGS = ",".join(f"{bn}x{bk}:w{w}:s{s}" for bn in (4, 8, 16, 32) for bk in (256, 512, 1024)
                       for w, s in ((4, 1), (4, 2), (8, 1)) if bn * bk <= 16384)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="e2e")
    p.add_argument("--rows", type=int, default=1)
    p.add_argument("--configs", default=DEFAULT_CONFIGS)
    p.add_argument("--shapes", default="qkv,o,gate_up,down")
    p.add_argument("--fmt", default=None, choices=("nvfp4", "mxfp4"), help="fp4 weights: one row (--rows ignored)")
    a = p.parse_args()
    if a.fmt and a.configs == DEFAULT_CONFIGS:
        a.configs = FP4_CONFIGS
    if not torch.cuda.is_available():
        raise SystemExit("sweep_decode_linear.py times kernels on a CUDA GPU")
    from tritonformer.bench.generate import MODELS
    from tritonformer import quant
    from tritonformer.ops import decode_linear as dl
    from tritonformer.ops.norm import add_rms_norm
    from tritonformer.ops.scaled_matmul import scaled_matmul
    from tritonformer.ops.swiglu import swiglu

    m = MODELS[a.model]
    h, i, kv = m["hidden"], m["intermediate"], m["kv_heads"] * m["hidden"] // m["heads"]
    dev, dt = "cuda", torch.bfloat16

    def weights(*shapes):
        ws = [torch.randn(n, k, device=dev, dtype=dt) / k**0.5 for n, k in shapes]
        return [quant.quantize(w, a.fmt, axis=1) for w in ws] if a.fmt else ws

    def parts(w):
        return (w.data, w.scales) if a.fmt else (w,)

    def clone(w):
        return dataclasses.replace(w, data=w.data.clone(), scales=w.scales.clone()) if a.fmt else w.clone()

    x, r, x_i = (torch.randn(a.rows, n, device=dev, dtype=dt) for n in (h, h, i))
    norm = (torch.ones(h, device=dev, dtype=dt), 1e-6, 0.0)
    x, r, x_i = (t[:1] for t in (x, r, x_i)) if a.fmt else (x, r, x_i)
    cases = {
        "qkv": (lambda w: dl.decode_linear(x, w, norm=norm, residual=r), weights((h, h), (kv, h), (kv, h))),
        "o": (lambda w: dl.decode_linear(x, w), weights((h, h))),
        "gate_up": (lambda w: dl.decode_swiglu(x, *w, norm=norm, residual=r), weights((i, h), (i, h))),
        "down": (lambda w: dl.decode_linear(x_i, w), weights((h, i))),
    }
    if a.fmt:
        # The step's chain (decoding._fp4_chain): each product hands the next its operand prepared.
        normed = dl.PreparedRow(dl.prepared_words(x), torch.rand(h // 4, device=dev), 1e-6)
        act = dl.PreparedRow(dl.prepared_words(x_i))
        cases.update({
            "qkv_chained": (lambda w: dl.decode_linear(normed, w), cases["qkv"][1]),
            "o_chained": (lambda w: dl.decode_linear_into_norm(x, w[0], r, norm), cases["o"][1]),
            "gate_up_chained": (lambda w: dl.decode_swiglu(normed, *w, prepared=True), cases["gate_up"][1]),
            "down_chained": (lambda w: dl.decode_linear_into_norm(act, w[0], r, norm), cases["down"][1]),
        })
    launcher = dl._launch
    configs = []
    for item in a.configs.split(","):
        tile, w, s = item.split(":")
        bn, bk = map(int, tile.split("x"))
        configs.append(triton.Config({"BLOCK_N": bn, "BLOCK_K": bk, "LOOP_STAGES": int(s[1:])},
                                     num_warps=int(w[1:]), num_stages=int(s[1:])))
    original = launcher.autotuned.configs
    for name in a.shapes.split(","):
        run, ws = cases[name]
        nbytes = sum(t.numel() * t.element_size() for w in ws for t in parts(w))
        copies = [ws] + [[clone(w) for w in ws] for _ in range(-(-L2_FLUSH_BYTES // nbytes))]
        gemv = None
        if a.fmt:
            gemv = {"qkv": lambda w: [scaled_matmul(add_rms_norm(x, r, *norm)[0], v) for v in w],
                    "o": lambda w: scaled_matmul(x, w[0]),
                    "gate_up": lambda w: swiglu(*(scaled_matmul(add_rms_norm(x, r, *norm)[0], v) for v in w)),
                    "down": lambda w: scaled_matmul(x_i, w[0])}.get(name)
        if gemv is not None:
            gemv(ws)
            us = do_bench_cudagraph(lambda: [gemv(c_ws) for c_ws in copies], rep=20) * 1e3 / len(copies)
            print(f"{name:8s} {'scaled_matmul, a launch a weight':60s} {us:7.2f} us {nbytes / us / 1e6:6.2f} TB/s",
                  flush=True)

        def run_all():
            for c_ws in copies:
                run(c_ws)
        launcher.autotuned.configs = original
        launcher.chosen.clear()
        run(ws)
        tuned = next(iter(launcher.chosen.values()))
        rows = []
        for c in [None] + configs:
            if c is not None:
                launcher.autotuned.configs = [c]
                launcher.chosen.clear()
            try:
                run(ws)
                us = do_bench_cudagraph(run_all, rep=20) * 1e3 / len(copies)
            except Exception as e:  # noqa: BLE001 - a config that fails is a row
                print(f"{name:8s} {c} FAILED {type(e).__name__}", flush=True)
                continue
            label = "tuned " + str({k: v for k, v in tuned.items() if k in ("BLOCK_N", "BLOCK_K", "num_warps",
                                                                             "num_stages")}) if c is None else \
                f"{c.kwargs['BLOCK_N']}x{c.kwargs['BLOCK_K']}:w{c.num_warps}:s{c.num_stages}"
            rows.append((us, label))
            print(f"{name:8s} {label:60s} {us:7.2f} us {nbytes / us / 1e6:6.2f} TB/s", flush=True)
        best = min(rows)
        print(f"best {name:8s} {best[1]:40s} {best[0]:7.2f} us {nbytes / best[0] / 1e6:6.2f} TB/s "
              f"({nbytes / 4.25e6:.1f} us at 4.25 TB/s)", flush=True)


if __name__ == "__main__":
    main()
