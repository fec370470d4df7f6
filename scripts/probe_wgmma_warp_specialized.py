"""_wgmma_kernel (bf16 x times block-scaled B on Hopper) warp-specialized, timed against the
library's kernel (docs/perf-notes.md, twenty-seventh session).

A loader partition (the default one, 4 warps) fills STAGES slots with x's tile and B's words by
TMA, one load for each consumer's 64 rows of B; CONSUMERS warpgroups each decode their rows and
run their wgmmas at their own pace (a slot's "empty" barrier counts every consumer), consumer c
starting once consumer c - 1 has issued its first wgmma (STAGGER), so that one's decode can run
during another's wgmma. No split-K; x permuted by the caller as _wgmma_x_columns says.

Not used by the library: it is correct (every case below against scaled_matmul_reference)
but no faster. H100, K 8192, GPU time by CUDA graph, us: nvfp4 M 128 N 28672 136 against the
library's 148, M 256 260 against 285, M 64 101 against 96; with the stagger or without, the same.
So a program's decode and wgmma not overlapping is not what bounds the library's kernel there.

    PYTHONPATH=src python3 scripts/probe_wgmma_warp_specialized.py [compile]
"""
import os
import sys
if sys.argv[1:] == ["compile"]:
    os.environ["TRITON_INTERPRET"] = "0"
import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from tritonformer import quant
from tritonformer.ops import scaled_matmul as sm

LOADER = gl.constexpr(-1)
C0 = gl.constexpr(0)
C1 = gl.constexpr(1)
C2 = gl.constexpr(2)


@gluon.jit
def _ws_partition(x_desc, b_desc, b_scale_ptr, c_ptr, tensor_scale_ptr, M, N, K, stride_bs, stride_cm,
                  x_smem, b_smem, ready, empty, go, role: gl.constexpr, FMT_CODE: gl.constexpr,
                  TOKENS: gl.constexpr, STAGES: gl.constexpr, CONSUMERS: gl.constexpr,
                  TENSOR_SCALE: gl.constexpr, STAGGER: gl.constexpr):
    B_FMT: gl.constexpr = "nvfp4" if FMT_CODE == 0 else ("mxfp4" if FMT_CODE == 1 else "mxfp8")
    WORDS: gl.constexpr = sm._wgmma_step_words(B_FMT)
    BLOCKS: gl.constexpr = WORDS // sm._wgmma_words_per_thread(B_FMT)
    pid_m = gl.program_id(0)
    pid_n = gl.program_id(1)
    m0 = pid_m * TOKENS
    n0 = pid_n * (64 * CONSUMERS)
    steps = K // 128
    if role == LOADER:
        for i in range(steps):
            s = i % STAGES
            mbarrier.wait(empty.index(s), ((i // STAGES) & 1) ^ 1)
            mbarrier.expect(ready.index(s), CONSUMERS * b_desc.block_type.nbytes + x_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(x_desc, [m0, i * 128], ready.index(s), x_smem.index(s))
            for c in gl.static_range(CONSUMERS):
                tma.async_copy_global_to_shared(b_desc, [n0 + 64 * c, i * WORDS], ready.index(s),
                                                b_smem.index(s * CONSUMERS + c))
    else:
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, TOKENS, 16])
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
        scales_layout: gl.constexpr = sm._wgmma_scales_layout(64, BLOCKS)
        r0 = n0 + 64 * role
        rows_s = r0 + gl.arange(0, 64, layout=gl.SliceLayout(1, scales_layout))
        blocks = gl.arange(0, BLOCKS, layout=gl.SliceLayout(0, scales_layout))
        scale_ptrs = b_scale_ptr + rows_s.to(gl.int64)[:, None] * stride_bs + blocks[None, :]
        scale_mask = (rows_s < N)[:, None] & (blocks < BLOCKS)[None, :]
        next_scales = gl.load(scale_ptrs, mask=scale_mask, other=0)
        acc = gl.zeros([64, TOKENS], gl.float32, mma)
        if STAGGER:
            if role > 0:
                mbarrier.wait(go.index(role - 1), 0)
        for i in range(steps):
            raw = next_scales
            scale_ptrs += BLOCKS
            next_scales = gl.load(scale_ptrs, mask=scale_mask & (i + 1 < steps), other=0)
            s = i % STAGES
            mbarrier.wait(ready.index(s), (i // STAGES) & 1)
            a = sm._wgmma_decoded_step(b_smem.index(s * CONSUMERS + role), raw, B_FMT, 64, a_layout)
            acc = warpgroup_mma(a, x_smem.index(s).permute((1, 0)), acc, is_async=True)
            if STAGGER:
                if role < CONSUMERS - 1:
                    mbarrier.arrive(go.index(role), pred=i == 0)
            acc, a = warpgroup_mma_wait(num_outstanding=0, deps=(acc, a))
            mbarrier.arrive(empty.index(s))
        if B_FMT == "nvfp4":
            acc = acc * 256.0
        if TENSOR_SCALE:
            acc = acc * gl.load(tensor_scale_ptr)
        rows = r0 + gl.arange(0, 64, layout=gl.SliceLayout(1, mma))
        tokens = m0 + gl.arange(0, TOKENS, layout=gl.SliceLayout(0, mma))
        mask = (rows < N)[:, None] & (tokens < M)[None, :]
        gl.store(c_ptr + tokens.to(gl.int64)[None, :] * stride_cm + rows[:, None], acc.to(c_ptr.dtype.element_ty),
                 mask=mask)


@gluon.jit
def _ws_kernel(x_desc, b_desc, b_scale_ptr, c_ptr, tensor_scale_ptr, M, N, K, stride_bs, stride_cm,
               B_FMT: gl.constexpr, TOKENS: gl.constexpr, STAGES: gl.constexpr, CONSUMERS: gl.constexpr,
               TENSOR_SCALE: gl.constexpr, STAGGER: gl.constexpr, CONSUMER_REGS: gl.constexpr):
    x_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, TOKENS, 128], x_desc.layout)
    b_smem = gl.allocate_shared_memory(gl.int32, [STAGES * CONSUMERS] + b_desc.block_type.shape, b_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    go = gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=CONSUMERS)
    for c in gl.static_range(4):
        mbarrier.init(go.index(c), count=1)
    FMT_CODE: gl.constexpr = 0 if B_FMT == "nvfp4" else (1 if B_FMT == "mxfp4" else 2)
    if CONSUMERS == 1:
        gl.warp_specialize([(_ws_partition, (x_desc, b_desc, b_scale_ptr, c_ptr, tensor_scale_ptr, M, N, K, stride_bs, stride_cm, x_smem, b_smem, ready, empty, go, LOADER, FMT_CODE, TOKENS, STAGES, CONSUMERS, TENSOR_SCALE, STAGGER)),
                            (_ws_partition, (x_desc, b_desc, b_scale_ptr, c_ptr, tensor_scale_ptr, M, N, K, stride_bs, stride_cm, x_smem, b_smem, ready, empty, go, C0, FMT_CODE, TOKENS, STAGES, CONSUMERS, TENSOR_SCALE, STAGGER))],
                           [4], [CONSUMER_REGS] * 1)
    elif CONSUMERS == 2:
        gl.warp_specialize([(_ws_partition, (x_desc, b_desc, b_scale_ptr, c_ptr, tensor_scale_ptr, M, N, K, stride_bs, stride_cm, x_smem, b_smem, ready, empty, go, LOADER, FMT_CODE, TOKENS, STAGES, CONSUMERS, TENSOR_SCALE, STAGGER)),
                            (_ws_partition, (x_desc, b_desc, b_scale_ptr, c_ptr, tensor_scale_ptr, M, N, K, stride_bs, stride_cm, x_smem, b_smem, ready, empty, go, C0, FMT_CODE, TOKENS, STAGES, CONSUMERS, TENSOR_SCALE, STAGGER)),
                            (_ws_partition, (x_desc, b_desc, b_scale_ptr, c_ptr, tensor_scale_ptr, M, N, K, stride_bs, stride_cm, x_smem, b_smem, ready, empty, go, C1, FMT_CODE, TOKENS, STAGES, CONSUMERS, TENSOR_SCALE, STAGGER))],
                           [4, 4], [CONSUMER_REGS] * 2)
    else:
        gl.warp_specialize([(_ws_partition, (x_desc, b_desc, b_scale_ptr, c_ptr, tensor_scale_ptr, M, N, K, stride_bs, stride_cm, x_smem, b_smem, ready, empty, go, LOADER, FMT_CODE, TOKENS, STAGES, CONSUMERS, TENSOR_SCALE, STAGGER)),
                            (_ws_partition, (x_desc, b_desc, b_scale_ptr, c_ptr, tensor_scale_ptr, M, N, K, stride_bs, stride_cm, x_smem, b_smem, ready, empty, go, C0, FMT_CODE, TOKENS, STAGES, CONSUMERS, TENSOR_SCALE, STAGGER)),
                            (_ws_partition, (x_desc, b_desc, b_scale_ptr, c_ptr, tensor_scale_ptr, M, N, K, stride_bs, stride_cm, x_smem, b_smem, ready, empty, go, C1, FMT_CODE, TOKENS, STAGES, CONSUMERS, TENSOR_SCALE, STAGGER)),
                            (_ws_partition, (x_desc, b_desc, b_scale_ptr, c_ptr, tensor_scale_ptr, M, N, K, stride_bs, stride_cm, x_smem, b_smem, ready, empty, go, C2, FMT_CODE, TOKENS, STAGES, CONSUMERS, TENSOR_SCALE, STAGGER))],
                           [4, 4, 4], [CONSUMER_REGS] * 3)


def ws_matmul(x, b, tokens, stages, consumers, stagger=True, regs=None, maxnreg=None):
    M, K = x.shape
    N = b.shape[0]
    words = b.data.view(torch.int32)
    step_words = words.shape[1] * 128 // K
    b_desc = TensorDescriptor(words, list(words.shape), list(words.stride()), [64, step_words],
                              gl.NVMMASharedLayout.get_default_for([64, step_words], gl.int32))
    xp = x[:, sm._wgmma_x_columns(K, b.fmt, x.device)].contiguous()
    x_desc = TensorDescriptor(xp, [M, K], [K, 1], [tokens, 128],
                              gl.NVMMASharedLayout.get_default_for([tokens, 128], gl.bfloat16))
    c = torch.empty(M, N, device=x.device, dtype=torch.bfloat16)
    ts = b.tensor_scale if b.tensor_scale is not None else c
    grid = (triton.cdiv(M, tokens), triton.cdiv(N, 64 * consumers))
    kw = dict(num_warps=4)
    if maxnreg:
        kw["maxnreg"] = maxnreg
    k = _ws_kernel[grid](x_desc, b_desc, b.scales.view(torch.uint8), c, ts, M, N, K, b.scales.stride(0), c.stride(0),
                         B_FMT=b.fmt, TOKENS=tokens, STAGES=stages, CONSUMERS=consumers,
                         TENSOR_SCALE=b.tensor_scale is not None, STAGGER=stagger,
                         CONSUMER_REGS=regs or (232 if tokens == 128 else 152), **kw)
    return c, k


def main():
    from triton.testing import do_bench, do_bench_cudagraph
    torch.manual_seed(0)
    cases = [(64, 28672), (64, 8192), (128, 28672), (256, 28672), (256, 8192), (512, 28672)]
    configs = [(64, 4, 2, True), (64, 4, 2, False), (64, 3, 2, True), (64, 6, 2, True), (128, 3, 2, True),
               (128, 2, 2, True), (64, 4, 3, True), (64, 4, 1, True)]
    for fmt in ("nvfp4", "mxfp4", "mxfp8"):
        for M, N in cases:
            K = 8192
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
            b = quant.quantize(w, fmt, axis=1)
            ref = sm.scaled_matmul_reference(x, b, torch.float32)
            lib = lambda: sm.scaled_matmul(x, b)
            t_lib = (do_bench(lib, warmup=10, rep=50) * 1e3, do_bench_cudagraph(lib, rep=50) * 1e3)
            t_torch = do_bench_cudagraph(lambda: x @ w.t(), rep=50) * 1e3
            row = []
            for tokens, stages, consumers, stagger in configs:
                if fmt == "mxfp8" and tokens == 128 and stages > 2:
                    continue
                try:
                    out, _ = ws_matmul(x, b, tokens, stages, consumers, stagger)
                    err = ((out.float() - ref).norm() / ref.norm()).item()
                    t = do_bench_cudagraph(lambda: ws_matmul(x, b, tokens, stages, consumers, stagger)[0], rep=50) * 1e3
                    row.append(f"({tokens},{stages},{consumers},{int(stagger)}) {t:.1f}{'' if err < 5e-3 else f' ERR {err:.1e}'}")
                except Exception as e:  # noqa
                    row.append(f"({tokens},{stages},{consumers},{int(stagger)}) FAIL {type(e).__name__} {str(e)[:80]}")
            print(f"{fmt} M{M} N{N}: torch {t_torch:.1f} lib {t_lib[0]:.1f}/{t_lib[1]:.1f} | " + " | ".join(row),
                  flush=True)


if __name__ == "__main__":
    if sys.argv[1:] == ["compile"]:
        import re, subprocess, tempfile
        from triton.backends.compiler import GPUTarget
        from triton.experimental.gluon._runtime import GluonASTSource
        for fmt, tokens, stages, consumers, regs in (("nvfp4", 64, 4, 2, 152), ("mxfp8", 64, 4, 2, 152),
                                                     ("nvfp4", 128, 3, 2, 232), ("mxfp8", 128, 2, 2, 232)):
            words = sm._wgmma_step_words(fmt)
            lb = gl.NVMMASharedLayout.get_default_for([64, words], gl.int32)
            lx = gl.NVMMASharedLayout.get_default_for([tokens, 128], gl.bfloat16)
            sig = {"x_desc": f"tensordesc<bf16[{tokens}, 128],{lx!r}>", "b_desc": f"tensordesc<i32[64, {words}],{lb!r}>",
                   "b_scale_ptr": "*u8", "c_ptr": "*bf16", "tensor_scale_ptr": "*fp32",
                   **{n: "i32" for n in ("M", "N", "K", "stride_bs", "stride_cm")},
                   **{n: "constexpr" for n in ("B_FMT", "TOKENS", "STAGES", "CONSUMERS", "TENSOR_SCALE", "STAGGER",
                                               "CONSUMER_REGS")}}
            consts = dict(B_FMT=fmt, TOKENS=tokens, STAGES=stages, CONSUMERS=consumers, TENSOR_SCALE=False,
                          STAGGER=True, CONSUMER_REGS=regs)
            k = triton.compile(GluonASTSource(_ws_kernel, sig, consts, {}), target=GPUTarget("cuda", 90, 64),
                               options={"num_warps": 4})
            with tempfile.TemporaryDirectory() as d:
                open(f"{d}/k.cubin", "wb").write(k.asm["cubin"])
                sass = subprocess.run([triton.knobs.nvidia.cuobjdump.path, "-sass", "-res-usage", f"{d}/k.cubin"],
                                      capture_output=True, text=True).stdout
            print(fmt, tokens, stages, consumers, "regs", re.search(r"REG:(\d+)", sass).group(1), "LDL",
                  sass.count("LDL"), "STL", sass.count("STL"), "shared", k.metadata.shared)
    else:
        main()
