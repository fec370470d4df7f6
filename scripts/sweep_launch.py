"""Launch shapes of the memory-bound kernels at their target sizes, timed in one process (GB/s a
config, best first); what it finds goes into the ops' launch heuristics (docs/norm.md,
docs/swiglu.md, docs/rope.md, docs/softmax.md, docs/cross_entropy.md). On the GPU machine:

    PYTHONPATH=src python3 scripts/sweep_launch.py [norm|norm_small|qkv_grad|swiglu|rope|softmax|loss ...]

norm: RMSNorm and LayerNorm forward (warps; LayerNorm's statistics by one shifted reduction or
three) and in-register backward (warps, weight held or reloaded, programs an SM), beside the
op's own choice. norm_small: small models' add_rms_norm both ways (rows, warps, programs an SM,
the partial sums' reduction). qkv_grad: qkv_rope's backward launch (tiles, programs, warps).
swiglu: elements and warps a program. rope: rope.LAUNCH's settings. softmax: rows and warps a
program. loss: the fused loss's per-chunk kernel (cross_entropy's _loss_and_grad_kernel) on one
chunk of bench e2e's loss, 1024 x 128256 bf16 logits, by warps and chunk width (the row is read
twice: statistics, then gradient).
"""

import argparse

import torch
import triton
from triton.testing import do_bench, do_bench_cudagraph

dev, bf16 = "cuda", torch.bfloat16


_flush = None
_flush_ms = None


def gbps(fn, nbytes):
    """GB/s from the GPU time alone with a cold L2, as a captured step runs it: a CUDA graph of an
    L2 flush and the call, less the flush alone, timed once a process (do_bench's time counts the
    host's launch of a short kernel: a custom op's dispatch took most of a 26 us kernel's time)."""
    global _flush, _flush_ms
    if _flush is None:
        _flush = torch.empty(64 << 20, device=dev, dtype=torch.int32)
        _flush_ms = do_bench_cudagraph(_flush.zero_, rep=50, return_mode="median")
    fn()
    cold_ms = do_bench_cudagraph(lambda: (_flush.zero_(), fn()), rep=50, return_mode="median")
    return nbytes / (cold_ms - _flush_ms) / 1e6


def sweep_norm():
    """Forward: LayerNorm's statistics by one shifted reduction (SHIFTED_STATS) or three; backward:
    the weight held in registers or loaded per row (RELOAD_W), programs per SM. The op's own
    choice is marked 'current'."""
    from tritonformer.ops import norm

    for rms in (True, False):
        for M, N in ((16384, 4096), (16384, 8192), (4096, 2048), (4096, 16384)):
            x = torch.randn(M, N, device=dev, dtype=bf16)
            w = torch.randn(N, device=dev, dtype=bf16)
            b = torch.randn(N, device=dev, dtype=bf16)
            dy, dx, y = torch.randn_like(x), torch.empty_like(x), torch.empty_like(x)
            stats = torch.rand(2 * M, device=dev)
            flags = dict(RMS=rms, HAS_W=True, HAS_B=not rms, ROUND_XHAT=rms)
            current = norm._launch_shape(N, rms, True), norm._bwd_launch_shape(N, rms)
            block_n = triton.next_power_of_2(N)
            fwd, bwd = [], []
            for warps in (4, 8, 16, 32):
                if not 4 <= block_n // (32 * warps) <= 64:
                    continue
                for shifted in ((False,) if rms else (False, True)):
                    kw = dict(**flags, HAS_RES=False, BLOCK_M=1, BLOCK_N=block_n, SHIFTED_STATS=shifted,
                              num_warps=warps)
                    f = lambda: norm._norm_fwd_kernel[(M,)](  # noqa: E731
                        x, x, x, w, b, y, stats, M, N, N, N, N, 1e-6, 0.0, **kw)
                    fwd.append((round(gbps(f, 2 * x.nbytes)), warps, f"shifted={shifted}"))
                for reload in (False, True):
                    kw = dict(**flags, HAS_DRES=False, BLOCK_M=1, BLOCK_N=block_n, RELOAD_W=reload,
                              num_warps=warps)
                    for per_sm in (1, 2, 4):
                        programs = min(M, 132 * per_sm)
                        part = torch.empty(2, programs, N, device=dev)  # (dw, db) rows of each program
                        g = lambda: norm._norm_bwd_kernel[(programs,)](  # noqa: E731
                            x, w, dy, dy, dx, stats, part, M, N, N, N, N, N, 0.0, **kw)
                        bwd.append((round(gbps(g, 3 * x.nbytes)), warps, f"reload={reload}", per_sm))
            name = "rms" if rms else "ln"
            print(f"norm {name} {M}x{N} current {current} fwd", sorted(fwd, reverse=True)[:6], flush=True)
            print(f"norm {name} {M}x{N} bwd", sorted(bwd, reverse=True)[:6], flush=True)


def sweep_norm_small():
    """Small models' RMSNorm (8192 tokens of a 576-2048 hidden size, add_rms_norm's fused add
    both ways): forward rows and warps a program; backward rows, warps and programs an SM, timed
    with the partial sums' reduction after it (its columns a program and parts a step), since
    the programs an SM set how many partial rows it reads. The op's own choice is marked."""
    from tritonformer.ops import norm

    for M, N in ((8192, 896), (8192, 576), (8192, 2048)):
        x, res, dy, dres = (torch.randn(M, N, device=dev, dtype=bf16) for _ in range(4))
        w = torch.randn(N, device=dev, dtype=bf16)
        h, y, dx = torch.empty_like(x), torch.empty_like(x), torch.empty_like(x)
        stats = torch.rand(M, device=dev) + 0.5
        flags = dict(RMS=True, HAS_W=True, HAS_B=False, ROUND_XHAT=True)
        block_n = triton.next_power_of_2(N)
        fwd, bwd = [], []
        for block_m in (1, 2, 4, 8):
            for warps in (1, 2, 4, 8, 16):
                if not 2 <= block_m * block_n // (32 * warps) <= 64:
                    continue
                f = lambda: norm._norm_fwd_kernel[(triton.cdiv(M, block_m),)](  # noqa: E731
                    x, res, h, w, w, y, stats, M, N, N, N, N, 1e-6, 0.0, **flags, HAS_RES=True,
                    BLOCK_M=block_m, BLOCK_N=block_n, SHIFTED_STATS=False, num_warps=warps)
                fwd.append((round(gbps(f, 4 * x.nbytes)), block_m, warps))
                for per_sm in (1, 2, 4, 8, 16):
                    if per_sm * warps > 64:
                        continue
                    programs = min(M // block_m, 132 * per_sm)
                    part = torch.empty(programs, N, device=dev)
                    sums = torch.empty(1, N, device=dev, dtype=bf16)
                    for sum_n, sum_p in ((32, 64), (16, 64), (64, 32), (128, 16)):
                        def g():
                            norm._norm_bwd_kernel[(programs,)](
                                x, w, dy, dres, dx, stats, part, M, N, N, N, N, N, 0.0, **flags, HAS_DRES=True,
                                BLOCK_M=block_m, BLOCK_N=block_n, RELOAD_W=True, num_warps=warps)
                            norm._sum_parts_kernel[(triton.cdiv(N, sum_n), 1)](
                                part, sums, programs, N, BLOCK_P=sum_p, BLOCK_N=sum_n, num_warps=4)
                        bwd.append((round(gbps(g, 4 * x.nbytes)), block_m, warps, per_sm, sum_n, sum_p))
        fwd_now = norm._launch_shape(N, True, False)
        bwd_now = norm._bwd_launch_shape(N, True)
        print(f"norm small {M}x{N} fwd GB/s, rows, warps; current {fwd_now}", sorted(fwd, reverse=True)[:5],
              "current:", [r for r in fwd if r[1:] == (fwd_now[0], fwd_now[2])], flush=True)
        print(f"norm small {M}x{N} bwd+sum GB/s, rows, warps, per SM, sum cols, sum parts; current {bwd_now}",
              sorted(bwd, reverse=True)[:6], "current:",
              [r for r in bwd if r[1:4] == (bwd_now[0], bwd_now[2], bwd_now[3]) and r[4:] == (32, 64)], flush=True)


def sweep_qkv_grad():
    """qkv_rope's backward launch (rope.qkv_rope_grad: q's and k's gradients rotated back, v's
    copied, token-major, with the bias gradient's partial sums or without) by tile elements,
    programs an SM and warps, GB/s counting its reads and writes; the op's own choice is marked.
    Beside it the path before it: the rotation's kernel, torch's copy of dv and, with biases,
    torch's dy.sum(0) (the column-sums op between the two, 1.4x torch's sum, is gone)."""
    from tritonformer.ops import rope

    for B, S, Hq, Hk, D, bias in ((4, 2048, 14, 2, 64, True), (4, 2048, 32, 8, 128, False)):
        x = torch.empty(B, S, 1, device=dev, dtype=bf16)
        dq, dk, dv = (torch.randn(B, h, S, D, device=dev, dtype=bf16) for h in (Hq, Hk, Hk))
        cos, sin = (torch.randn(S, D, device=dev, dtype=bf16) for _ in range(2))
        nbytes = 2 * (dq.nbytes + dk.nbytes + dv.nbytes)
        current = (rope.QKV_GRAD_TILE_ELEMENTS, rope.QKV_GRAD_PROGRAMS_PER_SM, rope.QKV_GRAD_NUM_WARPS)
        results = []
        for config in [(t, p, w) for t in (2048, 4096, 8192) for p in (4, 8, 16) for w in (4, 8)]:
            rope.QKV_GRAD_TILE_ELEMENTS, rope.QKV_GRAD_PROGRAMS_PER_SM, rope.QKV_GRAD_NUM_WARPS = config
            f = lambda: rope.qkv_rope_grad(dq, dk, dv, x, cos, sin, [Hq, Hk, Hk], bias)  # noqa: E731
            results.append((round(gbps(f, nbytes)), *config))
        rope.QKV_GRAD_TILE_ELEMENTS, rope.QKV_GRAD_PROGRAMS_PER_SM, rope.QKV_GRAD_NUM_WARPS = current
        dy = torch.empty(B, S, (Hq + 2 * Hk) * D, device=dev, dtype=bf16)
        heads = dy.view(B, S, -1, D).split([Hq, Hk, Hk], dim=2)

        def before():  # the rotation's kernel into dy's q and k heads, torch's copy of dv and sum
            rope._launch(dq.transpose(1, 2), dk.transpose(1, 2), heads[0], heads[1], cos, sin, True, True)
            heads[2].copy_(dv.transpose(1, 2))
            return dy.view(B * S, -1).sum(0) if bias else dy
        print(f"qkv_grad B{B} S{S} {Hq}/{Hk}x{D} bias={bias} GB/s, tile elements, programs an SM, warps",
              sorted(results, reverse=True)[:5], "current:", [r for r in results if r[1:] == current],
              "older path with torch's sum:", round(gbps(before, nbytes)), flush=True)


def sweep_swiglu():
    from tritonformer.ops import swiglu

    # The last: Qwen2.5-0.5B's MLP (8192 tokens of 4864), where the backward reads 3.5 TB/s in the step.
    for M, N in ((8192, 14336), (4096, 11008), (16384, 4096), (8192, 4864)):
        g, u, dh = (torch.randn(M, N, device=dev, dtype=bf16) for _ in range(3))
        h, dg, du = torch.empty_like(g), torch.empty_like(g), torch.empty_like(g)
        fwd, bwd = [], []
        for block in (1024, 2048, 4096, 8192):
            for warps in (4, 8, 16):
                blocks = triton.cdiv(M * N, block)  # contiguous rows: one long row
                f = lambda: swiglu._swiglu_fwd_kernel[(blocks,)](  # noqa: E731
                    g, u, h, M * N, blocks, N, N, N, BLOCK=block, num_warps=warps)
                b = lambda: swiglu._swiglu_bwd_kernel[(blocks,)](  # noqa: E731
                    g, u, dh, dg, du, du, M * N, blocks, N, N, N, N, N, N, STORE_H=False, BLOCK=block,
                    num_warps=warps)
                fwd.append((gbps(f, 3 * g.nbytes), block, warps))
                bwd.append((gbps(b, 5 * g.nbytes), block, warps))
        print(f"swiglu {M}x{N} fwd best", sorted(fwd, reverse=True)[:4], flush=True)
        print(f"swiglu {M}x{N} bwd best", sorted(bwd, reverse=True)[:4], flush=True)


def sweep_rope():
    from tritonformer.ops import rope

    for B, Hq, Hk, S, D, layout in ((4, 32, 8, 4096, 128, "bhsd"), (4, 32, 8, 4096, 128, "bshd")):
        shape = lambda h: (B, h, S, D) if layout == "bhsd" else (B, S, h, D)  # noqa: E731
        q, k = torch.randn(shape(Hq), device=dev, dtype=bf16), torch.randn(shape(Hk), device=dev, dtype=bf16)
        cos, sin = torch.randn(1, S, D, device=dev, dtype=bf16), torch.randn(1, S, D, device=dev, dtype=bf16)
        nbytes = 2 * (q.nbytes + k.nbytes) + cos.nbytes + sin.nbytes
        results = []
        for step_bytes in (8192, 16384):
            for per_step in (1, 4):
                for per_program in (4, 8, 16):
                    for warps in (4, 8):
                        for stages in (1, 2, 3):
                            if per_program < per_step or (stages > 1 and per_program == per_step):
                                continue
                            rope.LAUNCH = {layout == "bshd": (step_bytes, per_step, per_program, warps, stages)}
                            rope._launch_shape.cache_clear()
                            config = (step_bytes, per_step, per_program, warps, stages)
                            try:
                                f = lambda: rope.apply_rope(q, k, cos, sin, layout)  # noqa: E731
                                results.append((round(gbps(f, nbytes)), *config))
                            except Exception as exc:  # a shape Triton cannot lay out
                                print("rope config failed", config, type(exc).__name__)
        print(f"rope {layout} best", sorted(results, reverse=True)[:6], flush=True)
        print(f"rope {layout} worst", sorted(results)[:2], flush=True)


def sweep_softmax():
    from tritonformer.ops import softmax

    for dtype in (bf16, torch.float32):
        for M, N in ((4096, 4096), (4096, 1024), (4096, 16384)):
            x = torch.randn(M, N, device=dev, dtype=dtype)
            y = torch.empty_like(x)
            results = []
            for block_m in (1, 2, 4, 8):
                for warps in (2, 4, 8, 16):
                    if block_m * N > 32768 or block_m * N // (32 * warps) < 4:
                        continue
                    f = lambda: softmax._softmax_fwd_kernel[(triton.cdiv(M, block_m),)](  # noqa: E731
                        x, y, M, N, N, 1, N, BLOCK_M=block_m, BLOCK_N=N, num_warps=warps)
                    results.append((gbps(f, 2 * x.nbytes), block_m, warps))
            print(f"softmax {dtype} {M}x{N} fwd best", sorted(results, reverse=True)[:4],
                  "current", softmax._fwd_launch_shape(N), flush=True)


def sweep_loss():
    from tritonformer.ops import cross_entropy as ce

    rows, V = 1024, 128256
    x0 = torch.randn(rows, V, device=dev, dtype=bf16)
    target = torch.randint(0, V, (rows,), device=dev)
    loss = torch.empty(rows, device=dev)
    scale = torch.full((), 1.0 / rows, device=dev)
    floor_ms = 3 * rows * V * 2 / 3.0e12 * 1e3
    print(f"loss floor: 3 passes {floor_ms * 1e3:.0f} us, 2 passes {floor_ms * 2 / 3 * 1e3:.0f} us at 3 TB/s")
    for warps in (8, 16, 32):
        for chunk in (4096, 8192):
            x = x0.clone()  # the kernel overwrites the logits with their gradient
            f = lambda: ce._loss_and_grad_kernel[(rows,)](  # noqa: E731
                x, target, loss, scale, V, 1, 0, -100, 0.0, 0.0, 1.0, CHUNK=chunk, STAGES=ce.ROW_STAGES,
                HAS_SMOOTHING=False, HAS_Z_LOSS=False, SOFTCAP=False, TANH_APPROX=False, num_warps=warps)
            ms = do_bench(f, warmup=25, rep=200)
            print(f"loss warps {warps:2d} chunk {chunk}: {ms * 1e3:6.0f} us "
                  f"({3 * rows * V * 2 / ms / 1e9:5.2f} TB/s as 3 passes)", flush=True)


SWEEPS = {"norm": sweep_norm, "norm_small": sweep_norm_small, "qkv_grad": sweep_qkv_grad, "swiglu": sweep_swiglu,
          "rope": sweep_rope, "softmax": sweep_softmax, "loss": sweep_loss}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("sweeps", nargs="*", metavar="SWEEP", help=f"any of {', '.join(SWEEPS)} (default: all)")
    sweeps = parser.parse_args().sweeps or list(SWEEPS)
    if unknown := [name for name in sweeps if name not in SWEEPS]:
        parser.error(f"unknown sweep {', '.join(unknown)}: choose from {', '.join(SWEEPS)}")
    for name in sweeps:
        SWEEPS[name]()


if __name__ == "__main__":
    main()
