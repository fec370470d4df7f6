"""quant.quantize at the issue's size (16384 x 8192 bf16), per format: GB/s counting the bf16 read
once (as issue 5's target does), and the DRAM rate the bytes it moves imply (nvfp4's amax pass
reads x a second time; it is also timed with its tensor amax given, one read). With --sweep,
every launch shape of the quantize kernel (elements a program x warps) too. Each format is first
checked bit for bit against quantize_reference on 256 rows. On the GPU machine:

    PYTHONPATH=src python3 scripts/sweep_quantize.py [--sweep] [--formats mxfp8,mxfp4,nvfp4]
"""

import argparse

import torch
from triton.testing import do_bench

M, K = 16384, 8192


def moved_bytes(fmt: str) -> int:
    from tritonformer import quant

    vec = quant.FORMATS[fmt][0]
    reads = 2 * M * K * (2 if fmt == "nvfp4" else 1)
    return reads + (M * K if fmt == "mxfp8" else M * K // 2) + M * K // vec


def check(x: torch.Tensor, fmt: str) -> None:
    from tritonformer import quant

    q, r = quant.quantize(x[:256], fmt), quant.quantize_reference(x[:256], fmt)
    for a, b in ((q.data, r.data), (q.scales, r.scales)):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), f"{fmt}: kernel != reference"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sweep", action="store_true", help="also time every launch shape")
    p.add_argument("--formats", help="comma separated (default: every format of quant.FORMATS)")
    a = p.parse_args()
    from tritonformer import quant

    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    for fmt in (a.formats or ",".join(quant.FORMATS)).split(","):
        check(x, fmt)
        default = quant.QUANTIZE_LAUNCH[fmt]
        shapes = [default] + ([(e, w) for e in (1024, 2048, 4096, 8192, 16384) for w in (2, 4, 8, 16)
                               if 4 <= e // (32 * w) <= 128 and (e, w) != default] if a.sweep else [])
        results = []
        for shape in shapes:
            quant.QUANTIZE_LAUNCH[fmt] = shape
            ms = do_bench(lambda: quant.quantize(x, fmt), warmup=25, rep=200)
            results.append((x.nbytes / ms / 1e6, moved_bytes(fmt) / ms / 1e6, shape))
        quant.QUANTIZE_LAUNCH[fmt] = default
        gbps, dram, _ = results[0]
        print(f"{fmt}: {gbps:.0f} GB/s (bf16 read), {dram:.0f} GB/s moved, at {default[0]} elements a program, "
              f"{default[1]} warps", flush=True)
        if fmt == "nvfp4":
            amax = x.float().abs().amax()
            ms = do_bench(lambda: quant.quantize(x, fmt, tensor_amax=amax), warmup=25, rep=200)
            print(f"nvfp4, tensor amax given: {x.nbytes / ms / 1e6:.0f} GB/s (one read)", flush=True)
        if a.sweep:
            results.sort(key=lambda r: -r[0])
            print("    best: " + ", ".join(f"{g:.0f} ({e}, w{w})" for g, _, (e, w) in results[:5])
                  + f"; worst {results[-1][0]:.0f} ({results[-1][2][0]}, w{results[-1][2][1]})", flush=True)


if __name__ == "__main__":
    main()
