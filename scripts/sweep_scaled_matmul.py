"""Launch shapes of scaled_matmul on the GPU: times each (BLOCK_M, BLOCK_N, BLOCK_K, warps,
stages) candidate of the in-register kernel, with the op's own split-K, against torch bf16 on
the same shape; with --paths instead, both ways of the op (in registers, dequantize first) over
M, which is where DEQUANTIZE_FIRST_MIN_M comes from; with --gemv, the M = 1 kernel's launch
shapes (GEMV_SHAPE) against the tensor-core kernel and torch bf16, as do_bench times and as GPU
time alone (CUDA graphs); with --mma, the few-rows mma.sync kernel's shapes (MMA_SHAPES)
likewise; with --wgmma, the Hopper few-rows kernel's shapes (WGMMA_SHAPES) against the mma.sync
kernel (the in-register kernel for mxfp8); with --wgmma-tiles, its tiles of x (WGMMA_MAX_TOKENS)
and their shapes from 128 rows on, against the path each M takes without them. On the GPU machine:

    PYTHONPATH=src python3 scripts/sweep_scaled_matmul.py [--paths | --gemv | --mma | --wgmma | --wgmma-tiles] [ONLY]

ONLY: a substring of the case labels, to run those cases alone.
"""

import argparse

import torch
from triton.testing import do_bench, do_bench_cudagraph

CASES = [  # (label, M, N, K, fmt_a or None for bf16 activations, fmt_b, candidate launch shapes)
    *[(f"bf16 x {f} M{M}", M, N, 8192, None, f,
       [(16, 64, 128, 4, 4), (16, 32, 128, 4, 4), (16, 64, 256, 4, 3), (16, 128, 128, 4, 4), (16, 64, 128, 2, 4),
        (16, 64, 128, 4, 2), (16, 128, 256, 8, 3)]
       if M <= 16 else [(64, 64, 128, 4, 4), (64, 128, 64, 4, 4), (32, 64, 128, 4, 4), (64, 64, 64, 4, 5),
                        (64, 32, 128, 4, 3), (64, 64, 128, 4, 2), (64, 64, 128, 8, 3), (64, 128, 128, 8, 3)])
      for f in ("nvfp4", "mxfp4", "mxfp8") for M in (1, 16, 64) for N in (8192, 28672)],
    *[(f"{fa} x {fb} 8192^3", 8192, 8192, 8192, fa, fb,
       [(128, 256, 64, 8, 3), (128, 128, 64, 8, 3), (128, 128, 32, 8, 4)])
      for fa, fb in (("mxfp8", "mxfp8"), ("mxfp4", "mxfp4"), ("mxfp8", "mxfp4"))],
    ("nvfp4 x nvfp4 8192^3", 8192, 8192, 8192, "nvfp4", "nvfp4",
     [(128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (128, 128, 32, 8, 4), (128, 128, 64, 4, 3)]),
]

PATH_MS = (16, 64, 128, 256, 512, 1024, 2048, 8192)


def sweep_paths(only):
    from tritonformer import quant
    from tritonformer.ops import scaled_matmul as sm
    from tritonformer.ops.scaled_matmul import dequantize_first, wgmma

    saved_threshold, saved_wgmma_min_m = dequantize_first.DEQUANTIZE_FIRST_MIN_M, wgmma.WGMMA_MIN_M
    for fa, fb in ((None, "nvfp4"), (None, "mxfp4"), (None, "mxfp8"), ("mxfp8", "mxfp8"), ("nvfp4", "nvfp4")):
        for M in PATH_MS:
            label = f"{fa or 'bf16'} x {fb} M{M}"
            if only not in label:
                continue
            N = K = 8192
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
            a = quant.quantize(x, fa) if fa else x
            b = quant.quantize(w, fb, axis=1)
            peer = do_bench(lambda: x @ w.t(), warmup=10, rep=50)
            times = {}
            wgmma.WGMMA_MIN_M = 1 << 30  # bf16 activations: sweep_wgmma_tiles compares the wgmma kernel
            for path, threshold in (("registers", 1 << 30), ("dequantize first", 0)):
                dequantize_first.DEQUANTIZE_FIRST_MIN_M = threshold
                times[path] = do_bench(lambda: sm.scaled_matmul(a, b), warmup=10, rep=50)
            dequantize_first.DEQUANTIZE_FIRST_MIN_M, wgmma.WGMMA_MIN_M = saved_threshold, saved_wgmma_min_m
            flops = 2 * M * N * K
            row = " | ".join(f"{p} {t * 1e3:8.1f} us {flops / t * 1e-9:5.0f} TFLOP/s {peer / t:5.2f}x"
                             for p, t in times.items())
            print(f"{label:24s} torch bf16 {peer * 1e3:8.1f} us | {row}", flush=True)


GEMV_SHAPES = [(64, 256, 4, 4), (64, 256, 4, 8), (32, 256, 4, 4), (32, 256, 4, 6), (32, 256, 4, 8),
               (128, 256, 8, 4), (64, 512, 4, 4), (64, 128, 4, 4), (64, 128, 4, 8), (32, 512, 4, 4),
               (64, 256, 8, 4), (16, 256, 4, 8), (32, 128, 4, 8), (16, 512, 4, 8), (128, 128, 8, 8)]


def sweep_gemv(only):
    from tritonformer.ops.scaled_matmul import gemv

    for fmt in ("nvfp4", "mxfp4", "mxfp8"):
        for N in (8192, 28672):
            _sweep_kernel_shapes(f"bf16 x {fmt} M1 N{N}", only, fmt, 1, N, gemv, "GEMV_MAX_M", "GEMV_SHAPE",
                                 GEMV_SHAPES, lambda shape: shape)


def _sweep_kernel_shapes(label, only, fmt, M, N, path, max_m_name, shapes_name, candidates, as_setting, off=0):
    """bf16 x (M, 8192) times fmt weights (N, 8192): torch bf16, the kernel that takes the case when
    the swept one is off (path.<max_m_name> set to off, path the kernel's module: gemv, mma or
    wgmma) and the swept kernel with each candidate shape (path.<shapes_name> =
    as_setting(candidate)); prints the best candidate and every time."""
    if only not in label:
        return
    from tritonformer import quant
    from tritonformer.ops import scaled_matmul as sm

    K = 8192
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
    b = quant.quantize(w, fmt, axis=1)
    ref = sm.scaled_matmul_reference(x, b, torch.float32)
    peer = _timed(lambda: x @ w.t(), ref)
    original_max_m, original_shapes = getattr(path, max_m_name), getattr(path, shapes_name)
    setattr(path, max_m_name, off)
    tensor_cores = _timed(lambda: sm.scaled_matmul(x, b), ref)
    setattr(path, max_m_name, original_max_m)
    rows = []
    for shape in candidates:
        setattr(path, shapes_name, as_setting(shape))
        rows.append((*_timed(lambda: sm.scaled_matmul(x, b), ref), shape))
    setattr(path, shapes_name, original_shapes)
    _print_rows(label, peer, tensor_cores, rows, path.__name__.rpartition(".")[2], by_graph=True)


def _print_rows(label, peer, baseline, rows, kernel, by_graph):
    """One line for the best of rows (do_bench us, CUDA-graph us, error, shape) against torch and
    the baseline (the path taken without the swept kernel), then every row."""
    best = min(rows, key=lambda r: r[1] if by_graph else r[0])
    print(f"{label:26s} torch bf16 {peer[0]:6.1f}/{peer[1]:6.1f} us | without it {baseline[0]:6.1f}/"
          f"{baseline[1]:6.1f} | best {kernel} {best[3]} {best[0]:6.1f}/{best[1]:6.1f} us = {peer[0] / best[0]:4.2f}x/"
          f"{peer[1] / best[1]:4.2f}x torch, {baseline[0] / best[0]:4.2f}x without it (bench/graph), "
          f"err {max(r[2] for r in rows):.1e}", flush=True)
    print("    " + " ".join(f"{s}:{t:.1f}/{g:.1f}" for t, g, _, s in rows), flush=True)


def _timed(fn, ref):
    """(do_bench us, CUDA-graph us, relative error against ref) of fn, planned afresh."""
    from tritonformer import runtime

    runtime.clear_plans()
    out = fn()
    err = ((out.float() - ref).norm() / ref.norm()).item()
    return do_bench(fn, warmup=10, rep=50) * 1e3, do_bench_cudagraph(fn, rep=50) * 1e3, err


MMA_SHAPES = [(4, 2, 8), (4, 2, 16), (4, 1, 8), (4, 1, 16), (4, 1, 32), (8, 2, 8), (8, 1, 16), (2, 2, 16),
              (2, 2, 32), (2, 1, 16), (2, 1, 32)]
# From 4 tiles of x on (130-186 registers at two tiles of B a warp), fewer shapes.
MMA_SHAPES_WIDE = [(4, 1, 8), (4, 1, 16), (4, 2, 4), (4, 2, 8), (4, 2, 16), (8, 1, 8), (2, 2, 8), (2, 2, 16)]


def sweep_mma(only):
    from tritonformer.ops.scaled_matmul import mma, wgmma

    wgmma.WGMMA_MIN_M = 1 << 30
    for fmt in ("nvfp4", "mxfp4"):
        for M in (64, 32, 16, 8, 2):
            for N in (8192, 28672):
                # Every tile count of x takes the candidate: MMA_SHAPES is keyed by it.
                _sweep_kernel_shapes(f"bf16 x {fmt} M{M} N{N}", only, fmt, M, N, mma, "MMA_MAX_M", "MMA_SHAPES",
                                     MMA_SHAPES if M <= 16 else MMA_SHAPES_WIDE,
                                     lambda shape: dict.fromkeys(mma.MMA_SHAPES, shape))


# (BLOCK_N, STAGES, programs an SM for split-K); a warpgroup per 64 rows of BLOCK_N.
WGMMA_CANDIDATES = [(64, 2, 8), (64, 3, 8), (64, 4, 8), (64, 6, 8), (64, 3, 4), (64, 3, 1), (64, 4, 1), (128, 3, 1),
                    (128, 4, 1), (128, 3, 2), (128, 4, 2), (128, 4, 4), (256, 4, 1)]


def sweep_wgmma(only):
    from tritonformer.ops.scaled_matmul import wgmma

    # Every weight takes the candidate: small ones would otherwise keep WGMMA_SMALL_WEIGHT_SHAPE at 16 tokens.
    wgmma.WGMMA_MIN_WEIGHT = 0
    for fmt in ("nvfp4", "mxfp4"):
        for M in (64, 32, 16):
            for N in (8192, 28672):
                # Every token count takes the candidate; the baseline (WGMMA_MIN_M past MMA_MAX_M) is the mma kernel.
                _sweep_kernel_shapes(f"bf16 x {fmt} M{M} N{N}", only, fmt, M, N, wgmma, "WGMMA_MIN_M", "WGMMA_SHAPES",
                                     WGMMA_CANDIDATES, lambda shape: dict.fromkeys(wgmma.WGMMA_SHAPES, shape),
                                     off=1 << 30)
    # mxfp8 has one shape for every token count; its baseline is the in-register kernel.
    for M in (64, 32, 16, 8, 4, 2):
        for N in (8192, 28672):
            _sweep_kernel_shapes(f"bf16 x mxfp8 M{M} N{N}", only, "mxfp8", M, N, wgmma, "WGMMA_MIN_M",
                                 "WGMMA_E4M3_SHAPES", WGMMA_CANDIDATES,
                                 lambda shape: dict.fromkeys(wgmma.WGMMA_E4M3_SHAPES, shape), off=1 << 30)


# (tokens a program: WGMMA_MAX_TOKENS, then its shape) from 128 rows on, against the path each M takes without them.
# 64 tokens times 256 rows of B (four warpgroups) ran 1.5x slower than the best at N 28672.
WGMMA_TILE_CANDIDATES = [(128, (64, 3, 1)), (128, (64, 2, 1)), (128, (128, 2, 1)), (128, (128, 3, 1)),
                         (64, (128, 3, 1)), (64, (128, 4, 1))]


def sweep_wgmma_tiles(only):
    from tritonformer import quant
    from tritonformer.ops import scaled_matmul as sm
    from tritonformer.ops.scaled_matmul import wgmma

    saved_rows = wgmma.WGMMA_MIN_M, wgmma.WGMMA_MAX_M
    saved_tiles = wgmma.WGMMA_MAX_TOKENS, dict(wgmma.WGMMA_SHAPES), dict(wgmma.WGMMA_E4M3_SHAPES)
    K = 8192
    for fmt in ("nvfp4", "mxfp4", "mxfp8"):
        for M in (128, 256, 512, 768, 1024):
            for N in (8192, 28672):
                label = f"bf16 x {fmt} M{M} N{N}"
                if only not in label:
                    continue
                x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
                w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
                b = quant.quantize(w, fmt, axis=1)
                ref = sm.scaled_matmul_reference(x, b, torch.float32)
                peer = _timed(lambda: x @ w.t(), ref)
                wgmma.WGMMA_MIN_M = 1 << 30
                routed = _timed(lambda: sm.scaled_matmul(x, b), ref)
                wgmma.WGMMA_MIN_M, wgmma.WGMMA_MAX_M = saved_rows[0], 1 << 30
                rows = []
                for tokens, shape in WGMMA_TILE_CANDIDATES:
                    wgmma.WGMMA_MAX_TOKENS = tokens
                    wgmma.WGMMA_SHAPES = {**saved_tiles[1], tokens: shape}
                    wgmma.WGMMA_E4M3_SHAPES = {**saved_tiles[2], tokens: shape}
                    rows.append((*_timed(lambda: sm.scaled_matmul(x, b), ref), (tokens, *shape)))
                wgmma.WGMMA_MAX_TOKENS, wgmma.WGMMA_SHAPES, wgmma.WGMMA_E4M3_SHAPES = saved_tiles
                wgmma.WGMMA_MIN_M, wgmma.WGMMA_MAX_M = saved_rows
                _print_rows(label, peer, routed, rows, "tiles", by_graph=False)


def sweep_shapes(only):
    """Each of CASES' launch shapes of the in-register kernel, with the op's own split-K."""
    from tritonformer import quant
    from tritonformer.ops import scaled_matmul as sm
    from tritonformer.ops.scaled_matmul import in_registers

    saved = in_registers._launch_shape
    for label, M, N, K, fa, fb, shapes in CASES:
        if only not in label:
            continue
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
        a = quant.quantize(x, fa) if fa else x
        b = quant.quantize(w, fb, axis=1)
        peer = do_bench(lambda: x @ w.t(), warmup=10, rep=50)
        flops = 2 * M * N * K
        results = []
        for shape in shapes:
            in_registers._launch_shape = lambda m, shape=shape: shape
            try:
                ms = do_bench(lambda: sm.scaled_matmul(a, b), warmup=10, rep=50)
            except Exception as e:  # noqa: BLE001 - a shape that fails to compile is a row
                print(f"{label:28s} {shape} FAILED {type(e).__name__}: {str(e)[:100]}", flush=True)
                continue
            results.append((ms, shape))
        in_registers._launch_shape = saved
        ms, shape = min(results)
        row = " ".join(f"{s}:{t * 1e3:.0f}us" for t, s in results)
        print(f"{label:28s} best {shape} {ms * 1e3:7.1f} us {flops / ms * 1e-9:6.0f} TFLOP/s | torch bf16 "
              f"{peer * 1e3:7.1f} us -> {peer / ms:5.2f}x | {row}", flush=True)


SWEEPS = {  # --flag: (sweep, what it times)
    "paths": (sweep_paths, "in registers against dequantize first, over M"),
    "gemv": (sweep_gemv, "the M = 1 kernel's shapes (GEMV_SHAPE)"),
    "mma": (sweep_mma, "the few-rows mma.sync kernel's shapes (MMA_SHAPES)"),
    "wgmma": (sweep_wgmma, "the Hopper few-rows kernel's shapes (WGMMA_SHAPES, WGMMA_E4M3_SHAPES)"),
    "wgmma-tiles": (sweep_wgmma_tiles, "the Hopper kernel's tiles of x from 128 rows on (WGMMA_MAX_TOKENS)"),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    which = parser.add_mutually_exclusive_group()
    for name, (sweep, what) in SWEEPS.items():
        which.add_argument(f"--{name}", dest="sweep", action="store_const", const=sweep, default=sweep_shapes,
                           help=what)
    parser.add_argument("only", nargs="?", default="", metavar="ONLY", help="a substring of the case labels to run")
    args = parser.parse_args()
    args.sweep(args.only)


if __name__ == "__main__":
    main()
