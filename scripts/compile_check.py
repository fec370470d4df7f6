"""Offline compile check of the attention kernels for an H100 (sm_90), no GPU needed.

    PYTHONPATH=src python3 scripts/compile_check.py [-j N] [--dtypes bf16,fp16,fp32] [--dims 32,64,...]
        [--causal 0,1] [--varlen 0,1] [--window 0] [--kernels fwd,dkdv,dq] [--json FILE]

For every kernel of ops/attention.py, every autotune config that survives the op's own pruning
(`early_config_prune`), every head dim, dtype, causal and varlen (and window) switch, the
kernel is compiled to a cubin for sm_90 with Triton's own compiler and ptxas. The launch
arguments are the real ones: the op's entry points (attention_fwd, attention_bwd) are called on
small CPU tensors with their launchers replaced by recorders, and the recorded arguments go
through Triton's own binder, so the signature, constexprs and divisibility attributes are those
of a GPU launch of that shape (S = 1024, D as given). Per (kernel, config, D, dtype, switches)
it prints: ok / FAIL, registers per thread, ptxas spill stores / loads (bytes), shared memory
(bytes, Triton's dynamic allocation plus the cubin's static), and whether that fits an H100
block (227 KiB shared memory, 255 registers, 64 K registers per block), then a summary.

fp32 runs with INPUT_PRECISION as the op picks it by default (ieee unless TF32 is allowed).
Compiles go to Triton's cache (TRITON_CACHE_DIR), so a second run is fast. ~2 s a compile and
CPU core; the full default matrix is a few hundred compiles.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import multiprocessing
import os
import re
import subprocess
import sys
import tempfile
import time

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import create_function_from_signature

TARGET = GPUTarget("cuda", 90, 64)
SMEM_LIMIT = 227 * 1024  # H100: max dynamic shared memory per block
REG_LIMIT = 255
REGS_PER_SM = 64 * 1024
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# Launcher attribute of the module -> short kernel name.
LAUNCHERS = {"_launch_fwd": "fwd", "_launch_dkdv": "dkdv", "_launch_dq": "dq"}


class Recorder:
    """Stands in for a TunedLauncher (key, grid, *args, **kw) or FastLaunch (grid, *args, **kw)."""

    def __init__(self, name, launcher, store):
        self.name, self.store = name, store
        self.tuned = hasattr(launcher, "autotuned")
        self.kernel = launcher.autotuned if self.tuned else launcher.kernel

    def __call__(self, *a, fitted=None, **kw):
        args = a[2:] if self.tuned else a[1:]
        self.store[self.name] = (self.kernel, list(args), dict(kw), fitted)


@contextlib.contextmanager
def recording(attn, store: dict, recorder=Recorder):
    """attention's launchers replaced by recorders into store: its calls launch nothing, and
    plan nothing that a later call would replay."""
    saved = {attr: getattr(attn, attr) for attr in LAUNCHERS}
    try:
        for attr, name in LAUNCHERS.items():
            setattr(attn, attr, recorder(name, saved[attr], store))
        yield
    finally:
        for attr, launcher in saved.items():
            setattr(attn, attr, launcher)


def record_launches(D, dtype, causal, varlen, window):
    """{kernel name: (kernel, args, kwargs, fitted)} of one forward and one backward call."""
    from tritonformer.ops import attention as attn

    H, H_kv, S = 4, 2, 1024
    if varlen:
        lens = [1000, 24]  # total 1024 rows: 16-divisible strides as in a typical batch
        cu = torch.tensor([0, *lens]).cumsum(0).to(torch.int32)
        q = torch.randn(sum(lens), H, D).to(dtype)
        k = torch.randn(sum(lens), H_kv, D).to(dtype)
        extra = (cu, cu, max(lens), max(lens))
        lse = torch.empty(H, sum(lens))
    else:
        q = torch.randn(1, H, S, D).to(dtype)
        k = torch.randn(1, H_kv, S, D).to(dtype)
        extra = (None, None, 0, 0)
        lse = torch.empty(1, H, S)
    v = torch.randn_like(k)
    w = 128 if window else attn.NO_WINDOW
    scale = D ** -0.5
    store = {}
    # Eager calls of the custom ops run their Python bodies, which launch through the
    # module-level launchers that recording patches.
    with recording(attn, store):
        attn.attention_fwd(q, k, v, causal, scale, w, *extra)
        o = torch.empty_like(q)
        attn.attention_bwd(torch.randn_like(q), None, q, k, v, o, lse, causal, scale, w, *extra)
    return store


def parse_configs(text):
    """'BMxBN:wW:sS[:rR],...' -> triton.Configs (to try candidates not in the op's lists; rR caps
    the registers a thread at R, Triton's maxnreg)."""
    out = []
    for item in filter(None, text.split(",")):
        tile, w, st, *regs = item.split(":")
        bm, bn = map(int, tile.split("x"))
        out.append(triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=int(w[1:]), num_stages=int(st[1:]),
                                 maxnreg=int(regs[0][1:]) if regs else None))
    return out


def compile_jobs(kernels, dims, dtypes, causals, varlens, windows, candidates=None):
    """One job per compile: (label dict, jit fn name, signature, constexprs, attrs, options)."""
    backend = make_backend(TARGET)
    jobs = []
    for D in dims:
        for dname in dtypes:
            for causal in causals:
                for varlen in varlens:
                    for window in windows:
                        store = record_launches(D, DTYPES[dname], causal, varlen, window)
                        for name in kernels:
                            if name not in store:
                                continue
                            kernel, args, kw, fitted = store[name]
                            if isinstance(kernel, triton.runtime.Autotuner):
                                fn = kernel.fn
                                named = dict(zip(fn.arg_names, args))
                                configs = candidates or kernel.configs
                                kept = (kernel.early_config_prune(configs, named, **kw)
                                        if kernel.early_config_prune else configs)
                                pruned = [c for c in configs if c not in kept]
                            else:
                                fn, kept, pruned = kernel, [None], []
                            binder = create_function_from_signature(fn.signature, fn.params, backend)
                            base = dict(kernel=name, D=D, dtype=dname, causal=int(causal), varlen=int(varlen),
                                        window=int(window))
                            for c in pruned:
                                jobs.append((dict(base, config=config_str(c, kw), status="pruned"), None))
                            for c in kept:
                                # A config runs with fitted's arguments (descriptors of its tile).
                                c_args, c_kw = fitted(c.all_kwargs()) if fitted else (args, kw)
                                all_kw = dict(c_kw, **(c.all_kwargs() if c is not None else {}))
                                bound, spec, opts = binder(*c_args, **all_kw)
                                options, sig, consts, attrs = fn._pack_args(backend, all_kw, bound, spec, opts)
                                label = dict(base, config=config_str(c, all_kw))
                                jobs.append((label, (fn.__name__, sig, consts, attrs, options.__dict__)))
    return jobs


def config_str(c, kw):
    if c is None:
        return f"BLOCK_M={kw.get('BLOCK_M')} w{kw.get('num_warps', 4)} s{kw.get('num_stages', 3)}"
    bm, bn = c.kwargs.get("BLOCK_M"), c.kwargs.get("BLOCK_N")
    return f"{bm}x{bn} w{c.num_warps} s{c.num_stages}"


_PTXAS_RE = {
    "spill_stores": re.compile(r"(\d+) bytes spill stores"),
    "spill_loads": re.compile(r"(\d+) bytes spill loads"),
    "stack": re.compile(r"(\d+) bytes stack frame"),
    "regs": re.compile(r"Used (\d+) registers"),
}


def ptxas_info(ptx: str) -> dict:
    """ptxas -v on the kernel's PTX (the compile's own log is gone when it came from the cache)."""
    from triton.backends.nvidia.compiler import get_ptxas
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        arch = re.search(r"\.target (sm_\w+)", ptx).group(1)
        res = subprocess.run([get_ptxas(TARGET.arch).path, "-v", f"--gpu-name={arch}", src, "-o",
                              os.path.join(tmp, "k.o")], capture_output=True, text=True)
    return parse_ptxas(res.stderr + res.stdout)


def parse_ptxas(log: str) -> dict:
    out = {}
    for key, rx in _PTXAS_RE.items():
        m = rx.search(log)
        if m:
            out[key] = int(m.group(1))
    return out


def static_smem(cubin: bytes) -> int:
    from triton.backends.nvidia.compiler import knobs
    tool = knobs.nvidia.cuobjdump.path
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        res = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True)
    m = re.search(r"SHARED:(\d+)", res.stdout)
    return int(m.group(1)) if m else 0


def run_job(job):
    label, spec = job
    if spec is None:
        return label
    fn_name, sig, consts, attrs, options = spec
    from tritonformer.ops import attention as attn

    fn = getattr(attn, fn_name)
    if isinstance(fn, triton.runtime.Autotuner):
        fn = fn.fn
    t0 = time.time()
    log = io.StringIO()
    try:
        triton.knobs.nvidia.dump_ptxas_log = True
        with contextlib.redirect_stdout(log):
            ck = triton.compile(ASTSource(fn, sig, consts, attrs), target=TARGET, options=options)
    except Exception as e:  # noqa: BLE001  (a failed compile is a result)
        msg = str(e).strip().splitlines()
        label.update(status="FAIL", error=(msg[0] if msg else type(e).__name__)[:300])
        return label
    info = parse_ptxas(log.getvalue())
    if "regs" not in info:
        info = ptxas_info(ck.asm["ptx"])
    smem = ck.metadata.shared + static_smem(ck.asm["cubin"])
    regs = info.get("regs", -1)
    threads = ck.metadata.num_warps * 32
    fits = smem <= SMEM_LIMIT and 0 <= regs <= REG_LIMIT and regs * threads <= REGS_PER_SM
    label.update(status="ok", regs=regs, spill_stores=info.get("spill_stores", 0),
                 spill_loads=info.get("spill_loads", 0), smem=smem, fits=fits, seconds=round(time.time() - t0, 1))
    return label


def fmt_row(r):
    head = (f"{r['kernel']:5} {r['config']:16} D={r['D']:<3} {r['dtype']:4} c{r['causal']} v{r['varlen']}"
            f"{' w1' if r['window'] else ''}")
    if r["status"] == "pruned":
        return f"{head}  pruned by the op (smem estimate or spill table)"
    if r["status"] == "FAIL":
        return f"{head}  FAIL  {r['error']}"
    spill = f"spill {r['spill_stores']}/{r['spill_loads']} B" if r["spill_stores"] or r["spill_loads"] else "no spill"
    return (f"{head}  ok    regs {r['regs']:3}  {spill:18} smem {r['smem']:6} B "
            f"({r['smem'] / 1024:5.1f} KiB)  {'fits' if r['fits'] else 'DOES NOT FIT H100'}")


def summarize(rows):
    """Per (kernel, config, D): the worst over dtypes and switches."""
    groups = {}
    for r in rows:
        groups.setdefault((r["kernel"], r["config"], r["D"]), []).append(r)
    print("\nSummary per (kernel, config, D), worst case over dtypes / switches:")
    bad = 0
    for (kernel, config, D), rs in groups.items():
        if all(r["status"] == "pruned" for r in rs):
            continue
        fails = [r for r in rs if r["status"] == "FAIL"]
        ok = [r for r in rs if r["status"] == "ok"]
        if fails:
            bad += 1
            print(f"  {kernel:5} {config:16} D={D:<3} FAIL ({len(fails)}/{len(rs)}): {fails[0]['error'][:120]}")
            continue
        if not ok:
            continue
        spill = max(r["spill_stores"] for r in ok)
        smem = max(r["smem"] for r in ok)
        regs = max(r["regs"] for r in ok)
        nofit = [r for r in ok if not r["fits"]]
        flag = ("DOES NOT FIT" if nofit else "") + (f" SPILLS {spill} B" if spill else "")
        bad += bool(flag)
        print(f"  {kernel:5} {config:16} D={D:<3} regs<={regs:3} smem<={smem / 1024:5.1f} KiB"
              f" spill<={spill:5} B  {flag.strip() or 'clean'}")
    return bad


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-j", "--jobs", type=int, default=os.cpu_count())
    p.add_argument("--kernels", default="fwd,dkdv,dq")
    p.add_argument("--dims", help="head dims, comma separated (default: attention's HEAD_DIMS)")
    p.add_argument("--dtypes", default="bf16,fp16", help="bf16,fp16,fp32 (fp32 is only run for D <= 128)")
    p.add_argument("--causal", default="0,1")
    p.add_argument("--varlen", default="0,1")
    p.add_argument("--window", default="0")
    p.add_argument("--configs", help="try these configs instead of the op's lists, e.g. 64x32:w8:s2,32x32:w4:s3 "
                   "(still pruned by the op's early_config_prune)")
    p.add_argument("--json", help="write every row to this file")
    a = p.parse_args()
    # Compile for the GPU even without one: runtime sets TRITON_INTERPRET=1 only if it is unset.
    os.environ["TRITON_INTERPRET"] = "0"
    from tritonformer import runtime
    from tritonformer.ops import attention as attn

    assert not runtime.INTERPRET, "TRITON_INTERPRET must be 0 here (tritonformer was imported before)"
    # Causal grids read the SM count (attention's GROUP_PROGRAMS): the H100 SXM's, without a GPU.
    runtime.num_sms = lambda device_index=0: 132
    ints = lambda s: [int(x) for x in s.split(",") if x != ""]  # noqa: E731
    dims = ints(a.dims) if a.dims else list(attn.HEAD_DIMS)
    dtypes = [d for d in a.dtypes.split(",") if d]
    jobs = []
    for dname in dtypes:
        jobs += compile_jobs(a.kernels.split(","), [D for D in dims if dname != "fp32" or D <= 128], [dname],
                             [bool(x) for x in ints(a.causal)], [bool(x) for x in ints(a.varlen)],
                             [bool(x) for x in ints(a.window)], parse_configs(a.configs or ""))
    n = sum(spec is not None for _, spec in jobs)
    print(f"{n} compiles for sm_90 ({len(jobs) - n} configs pruned by the op), {a.jobs} processes", flush=True)
    rows = []
    with multiprocessing.get_context("fork").Pool(a.jobs) as pool:
        for r in pool.imap(run_job, jobs):
            rows.append(r)
            print(fmt_row(r), flush=True)
    bad = summarize(rows)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    print(f"\n{bad} (kernel, config, D) groups fail, do not fit or spill")
    return 1 if any(r["status"] == "FAIL" or (r["status"] == "ok" and not r["fits"]) for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
