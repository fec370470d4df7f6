"""Per-kernel timing of the attention kernels over launch configs, on the GPU.

    PYTHONPATH=src python3 scripts/sweep_attention.py [--shapes B,H,S,D,causal[,H_kv];...] [--kernels fwd,dkdv,dq]
        [--extra fwd=128x128:w8:s3,...;dkdv=32x64:w4:s3:r168,...] [--descriptors 0,1] [--json FILE]

For each shape (bf16, the issue's targets by default) the op's own forward and backward are
called once with their launchers replaced by recorders (scripts/compile_check.py's), which
gives each kernel's real arguments; then every pruned config of the kernel (plus --extra ones)
is launched directly and timed (triton.testing.do_bench, median), once per --descriptors mode
(how streamed tiles are read: 0 pointer loads, 1 TMA descriptors, the latter only where the op
uses them). Printed per row: the kernel's
time and its own TFLOP/s (fwd: 2 matmuls of the band, dkdv: 4, dq: 3), then the end-to-end
forward and forward+backward of tritonformer and of SDPA's flash and cuDNN backends, with the
issue's FLOP count (4.B.H.S^2.D, halved for causal; x3.5 for forward+backward).
"""

from __future__ import annotations

import argparse
import json

import torch
from triton.testing import do_bench

from compile_check import Recorder, parse_configs, recording  # a script's folder is on sys.path

TARGETS = "4,32,4096,128,1;4,32,4096,128,0;8,16,2048,64,1;1,32,16384,128,1"
MATMULS = {"fwd": 2, "dkdv": 4, "dq": 3}


class _GridRecorder(Recorder):
    """compile_check's recorder, the launch's grid added: (kernel, args, kwargs, fitted, grid)."""

    def __call__(self, *a, **kw):
        super().__call__(*a, **kw)
        self.store[self.name] += (a[1] if self.tuned else a[0],)


def record(q, k, v, causal):
    """{kernel: (kernel, args, kwargs, fitted, grid)}; the backward's arguments hold a real O, lse and delta."""
    from tritonformer.ops import attention as attn

    scale = q.shape[-1] ** -0.5
    store = {}
    # The forward is recorded before it runs: a run plans the signature, and a planned call
    # replays its launch without the launcher.
    with recording(attn, store, _GridRecorder):
        attn.attention_fwd(q, k, v, causal, scale, attn.NO_WINDOW)
    o, lse = attn.attention_fwd(q, k, v, causal, scale, attn.NO_WINDOW)
    with recording(attn, store, _GridRecorder):
        attn.attention_bwd(torch.randn_like(q), None, q, k, v, o, lse, causal, scale, attn.NO_WINDOW)
    # The dQ kernel writes the delta that the dK/dV kernel reads: one launch of its first config.
    dq_kernel, args, kw, _, grid = store["dq"]
    config = dq_kernel.early_config_prune(dq_kernel.configs, dict(zip(dq_kernel.fn.arg_names, args)), **kw)[0]
    meta = dict(kw, **config.kwargs, DESCRIPTORS=False)  # the recorded tensors, by pointer loads
    dq_kernel.fn[grid(meta)](*args, **meta, num_warps=config.num_warps, num_stages=config.num_stages)
    return store


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default=TARGETS)
    p.add_argument("--kernels", default="fwd,dkdv,dq")
    p.add_argument("--extra", default="", help="kernel=configs;... in compile_check's config syntax")
    p.add_argument("--descriptors", default="0,1")
    p.add_argument("--json")
    a = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("sweep_attention.py times kernels on a CUDA GPU")
    from tritonformer.ops import attention as attn

    extra = {}
    for item in filter(None, a.extra.split(";")):
        name, text = item.split("=")
        extra[name] = parse_configs(text)
    rows = []
    for spec in a.shapes.split(";"):
        B, H, S, D, causal, *kv = map(int, spec.split(","))
        H_kv = kv[0] if kv else H
        causal = bool(causal)
        q = torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(B, H_kv, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        shape = f"B{B}xH{H}{f'/{H_kv}' if kv else ''}xS{S}xD{D}{'-causal' if causal else ''}"
        flops = 4 * B * H * S * S * D // (2 if causal else 1)
        store = record(q, k, v, causal)
        for name in a.kernels.split(","):
            kernel, args, kw, fitted, grid = store[name]
            fn = kernel.fn
            named = dict(zip(fn.arg_names, args))
            configs = kernel.configs + extra.get(name, [])
            kept = kernel.early_config_prune(configs, named, **kw) + extra.get(name, [])
            seen = set()
            for c in kept:
                tile = attn._config_label(c)
                if tile in seen:
                    continue
                seen.add(tile)
                for mode in map(int, a.descriptors.split(",")):
                    if mode and fitted is None:
                        continue
                    label = f"{tile}:d{mode}"
                    run_args, meta = args, dict(kw, **c.kwargs, DESCRIPTORS=bool(mode))
                    if mode:
                        run_args, with_descriptors = fitted(c.all_kwargs())
                        meta = dict(with_descriptors, **c.kwargs)
                    g = grid(meta) if callable(grid) else grid
                    try:
                        # The config's launch options (warps, stages, a register cap where it sets one).
                        options = {k: v for k, v in c.all_kwargs().items() if k not in c.kwargs}
                        ms = do_bench(lambda: fn[g](*run_args, **meta, **options), warmup=10, rep=60)
                    except Exception as e:  # noqa: BLE001 - a config that fails to compile or launch is a row
                        rows.append(dict(shape=shape, kernel=name, config=label, error=type(e).__name__))
                        print(f"{shape:26s} {name:5s} {label:16s} FAILED {type(e).__name__}: {str(e)[:120]}",
                              flush=True)
                        continue
                    tflops = flops * MATMULS[name] / 2 / ms * 1e-9
                    rows.append(dict(shape=shape, kernel=name, config=label, ms=ms, tflops=tflops))
                    print(f"{shape:26s} {name:5s} {label:16s} {ms:8.3f} ms {tflops:6.0f} TFLOP/s", flush=True)
        do = torch.randn_like(q)
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        sdpa = torch.nn.functional.scaled_dot_product_attention

        def providers():
            yield "tritonformer", lambda *t: attn.attention(*t, causal=causal)
            for backend in ("FLASH_ATTENTION", "CUDNN_ATTENTION"):
                def run(*t, backend=getattr(torch.nn.attention.SDPBackend, backend)):
                    with torch.nn.attention.sdpa_kernel(backend):
                        return sdpa(*t, is_causal=causal, enable_gqa=H_kv != H)
                yield backend.split("_")[0].lower(), run

        for who, f in providers():
            fwd = do_bench(lambda: f(q, k, v), warmup=25, rep=200)
            both = do_bench(lambda: torch.autograd.grad(f(*leaves), leaves, do), warmup=25, rep=200)
            rows.append(dict(shape=shape, kernel="e2e", config=who, fwd_ms=fwd, fwd_bwd_ms=both))
            print(f"{shape:26s} e2e   {who:16s} fwd {fwd:7.3f} ms {flops / fwd * 1e-9:5.0f} TFLOP/s | "
                  f"fwd+bwd {both:7.3f} ms {3.5 * flops / both * 1e-9:5.0f} TFLOP/s", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    print("\nbest config per kernel and shape:")
    for key in sorted({(r["shape"], r["kernel"]) for r in rows if r["kernel"] != "e2e" and "ms" in r}):
        best = min((r for r in rows if (r["shape"], r["kernel"]) == key and "ms" in r), key=lambda r: r["ms"])
        print(f"  {key[0]:26s} {key[1]:5s} {best['config']:16s} {best['ms']:8.3f} ms {best['tflops']:6.0f} TFLOP/s")


if __name__ == "__main__":
    main()
