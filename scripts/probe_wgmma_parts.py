"""Where the Hopper weight-only kernel's (`_wgmma_kernel`) time goes, on the GPU:

1. The kernel as the library launches it, and three variants of its source: without the decode
   (a PTX move in place of the e2m1 decode), without the wgmma (the decoded operands carried out
   of the loop and stored under a predicate false at run time, so that ptxas keeps the decode),
   and without either (what is left: the TMA pipeline of B and x, the scales, the barriers).
2. The floor of the weight's bytes: a kernel that only streams B's rows by TMA into a ring of
   shared-memory boxes, by box width and stages.

GPU time by CUDA graph, us.

    PYTHONPATH=src python3 scripts/probe_wgmma_parts.py
"""

import importlib
import inspect
import sys
import tempfile

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.testing import do_bench_cudagraph

from tritonformer import quant, runtime
from tritonformer.ops import scaled_matmul as sm

_DECODE = 'asm: gl.constexpr = _E2M1_HALVES_PTX if B_FMT == "nvfp4" else _E2M1_HALVES_TIMES_2_126_PTX'
_MOVE = 'asm: gl.constexpr = "mov.b32 {$0, $1}, $8; mov.b32 {$2, $3}, $9; mov.b32 {$4, $5}, $8; mov.b32 {$6, $7}, $9;"'
_KEEP_DECODED = """    if M < 0:
        kept: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [BLOCK_N // 16, 1], [1, 0])
        kept_rows = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, kept))
        kept_cols = gl.arange(0, 128, layout=gl.SliceLayout(0, kept))
        gl.store(ws_ptr + kept_rows[:, None] * 128 + kept_cols[None, :], gl.convert_layout(a_keep, kept).to(gl.float32))
"""


def _replaced(text: str, *pairs) -> str:
    for old, new in pairs:
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    return text


def kernel_variants() -> dict:
    """{name: FastLaunch} of _wgmma_kernel's source, edited, each compiled from a module of its own
    (Gluon reads a kernel's source from its file)."""
    source = inspect.getsource(sm._wgmma_kernel.fn)
    no_mma = _replaced(
        source,
        ("acc = warpgroup_mma(a, x_buffer.permute((1, 0)), acc, is_async=True)", "a_keep = a"),
        ("acc, a = warpgroup_mma_wait(num_outstanding=0, deps=(acc, a))", "pass"),
        ("\n    acc = gl.zeros([BLOCK_N, TOKENS], gl.float32, mma)\n",
         "\n    acc = gl.zeros([BLOCK_N, TOKENS], gl.float32, mma)\n"
         "    a_keep = gl.zeros([BLOCK_N, 128], gl.bfloat16, a_layout)\n"),
        ("        mbarrier.invalidate(ready.index(s))\n", "        mbarrier.invalidate(ready.index(s))\n" + _KEEP_DECODED))
    sources = {"kernel": source, "no decode": _replaced(source, (_DECODE, _MOVE)), "no wgmma": no_mma,
               "neither": _replaced(no_mma, (_DECODE, _MOVE))}
    folder = tempfile.mkdtemp()
    sys.path.insert(0, folder)
    head = ("import tritonformer.ops.scaled_matmul as _sm\n"
            "globals().update({k: v for k, v in vars(_sm).items() if not k.startswith('__')})\n\n")
    launches = {}
    for i, (name, text) in enumerate(sources.items()):
        with open(f"{folder}/wgmma_variant_{i}.py", "w") as f:
            f.write(head + text)
        launches[name] = runtime.FastLaunch(importlib.import_module(f"wgmma_variant_{i}")._wgmma_kernel)
    return launches


@gluon.jit
def _stream_kernel(b_desc, out_ptr, K_WORDS, BN: gl.constexpr, BW: gl.constexpr, STAGES: gl.constexpr):
    """BN rows of B's words a program, walked along K in (BN, BW) TMA boxes, STAGES in flight."""
    n0 = gl.program_id(0) * BN
    smem = gl.allocate_shared_memory(gl.int32, [STAGES, BN, BW], b_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
    steps = K_WORDS // BW
    for s in gl.static_range(STAGES - 1):
        mbarrier.expect(ready.index(s), b_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(b_desc, [n0, s * BW], ready.index(s), smem.index(s))
    layout: gl.constexpr = gl.BlockedLayout([1, 4], [32 // (BW // 4), BW // 4], [gl.num_warps(), 1], [1, 0])
    acc = gl.zeros([BN, BW], gl.int32, layout)
    for i in range(steps):
        stage = i % STAGES
        mbarrier.wait(ready.index(stage), (i // STAGES) & 1)
        acc ^= smem.index(stage).load(layout)
        gl.thread_barrier()
        ahead = i + STAGES - 1
        if ahead < steps:
            mbarrier.expect(ready.index(ahead % STAGES), b_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(b_desc, [n0, ahead * BW], ready.index(ahead % STAGES),
                                            smem.index(ahead % STAGES))
    rows = gl.arange(0, BN, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, BW, layout=gl.SliceLayout(0, layout))
    gl.store(out_ptr + (n0 + rows)[:, None] * BW + cols[None, :], acc)


def main():
    K = 8192
    launches = kernel_variants()
    for fmt in ("nvfp4", "mxfp4"):
        for M, N in ((64, 28672), (16, 28672), (64, 8192)):
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            b = quant.quantize(torch.randn(N, K, device="cuda", dtype=torch.bfloat16), fmt, axis=1)
            row = []
            for name, launch in launches.items():
                sm._launch_wgmma = launch
                sm._wgmma_plans.clear()
                fn = lambda: sm.scaled_matmul(x, b)  # noqa: E731
                fn()
                row.append(f"{name} {do_bench_cudagraph(fn, rep=50) * 1e3:6.1f}")
            print(f"{fmt} M{M} N{N}: " + " | ".join(row), flush=True)

    N = 28672
    words = torch.randint(-2**31, 2**31 - 1, (N, K // 8), dtype=torch.int32, device="cuda")
    out = torch.empty(N, 64, dtype=torch.int32, device="cuda")
    for BN in (64, 128):
        for BW in (16, 32, 64):
            for STAGES in (2, 4, 8):
                if STAGES * BN * BW * 4 > 200 * 1024:
                    continue
                desc = TensorDescriptor(words, list(words.shape), list(words.stride()), [BN, BW],
                                        gl.NVMMASharedLayout.get_default_for([BN, BW], gl.int32))
                fn = lambda: _stream_kernel[(N // BN,)](desc, out, K // 8, BN=BN, BW=BW, STAGES=STAGES)  # noqa: E731
                fn()
                t = do_bench_cudagraph(fn, rep=50) * 1e-3
                print(f"B alone, {BN} rows x {BW * 4} B boxes, {STAGES} stages: {t * 1e6:6.1f} us "
                      f"{words.numel() * 4 / t / 1e12:5.2f} TB/s", flush=True)


if __name__ == "__main__":
    main()
