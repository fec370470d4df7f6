"""SASS instructions an element of `quant.quantize` on an H100 (sm_90), counted offline: no GPU.

    PYTHONPATH=src python3 scripts/count_sass.py [--formats mxfp8,mxfp4,nvfp4] [--elements N]
        [--warps W] [--dtype bf16] [-k 8192] [--dump DIR]

Per format, `quant.quantize` is called on a small CPU tensor whose K (8192) and strides match
the issue's 16384 x 8192 bf16 case (--dtype, -k: other inputs), with its launchers replaced by recorders; the recorded
arguments go through Triton's own binder (the divisibility attributes of a real launch), and
each kernel is compiled for sm_90 with Triton's compiler and ptxas, then disassembled with
cuobjdump. --elements and --warps replace the quantize kernel's launch shape (elements a program).

What is counted, a thread's instructions over the elements it handles (NOPs left out):
- the quantize kernel has no loop: the instructions on the shortest path from its entry to its
  last EXIT (a predicated branch may go either way, a predicated EXIT falls through). That is
  the path every thread runs when no rare case is met (the slow paths of IEEE division, nvfp4's
  exact branch for tensor scales under 2^-80); over the elements of a thread.
- nvfp4's amax pass loops over tiles: its loop body, over the elements of a thread a tile.
Scale: 2.0 TB/s at 16384 x 8192 bf16 (268 MB read in 134 us) leaves 132 SMs x 4 schedulers x
1.755 GHz x 134 us / 2^27 elements = 0.93 warp instructions a warp's element, about 30 a thread's
element at the full issue rate; memory stalls leave about two thirds of that.
Also printed: registers a thread, the kernel's most frequent opcodes.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import create_function_from_signature

TARGET = GPUTarget("cuda", 90, 64)
K = 8192
LAUNCHERS = ("_launch_quantize", "_launch_amax")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_INSTR = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")


def record_launches(fmt: str, dtype: torch.dtype = torch.bfloat16, k: int = K) -> dict:
    """{launcher name: (kernel, positional args, keyword args)} of quantize on a (2, k) tensor."""
    from tritonformer import quant

    seen = {}
    saved = {name: getattr(quant, name) for name in LAUNCHERS}
    try:
        for name, launcher in saved.items():
            setattr(quant, name, lambda grid, *a, _name=name, _k=launcher.kernel, **kw: seen.update(
                {_name: (_k, list(a), dict(kw))}))
        quant.quantize(torch.randn(2, k).to(dtype), fmt)
    finally:
        for name, launcher in saved.items():
            setattr(quant, name, launcher)
    return seen


def compile_launch(fn, args, kw, target: GPUTarget = TARGET):
    """Triton's CompiledKernel of one recorded launch, for `target`."""
    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, spec, opts = binder(*args, **kw)
    options, sig, consts, attrs = fn._pack_args(backend, kw, bound, spec, opts)
    return triton.compile(ASTSource(fn, sig, consts, attrs), target=target, options=options.__dict__)


def compile_sass(fn, args, kw) -> tuple[str, int, str]:
    """(SASS, registers a thread, TTGIR) of one launch compiled for sm_90."""
    ck = compile_launch(fn, args, kw)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(ck.asm["cubin"])
        f.flush()
        out = subprocess.run([triton.knobs.nvidia.cuobjdump.path, "-sass", "-res-usage", f.name],
                             capture_output=True, text=True, check=True).stdout
    return out, int(re.search(r"REG:(\d+)", out).group(1)), ck.asm["ttgir"]


def parse(sass: str) -> list[tuple[int, str, str, str]]:
    """(address, predicate, opcode, operands) of each instruction, NOPs left out."""
    return [(int(m.group(1), 16), (m.group(2) or "").strip(), m.group(3), m.group(4))
            for m in map(_INSTR.match, sass.splitlines()) if m and m.group(3) != "NOP"]


def _target(rest: str) -> int:
    return int(re.search(r"0x([0-9a-f]+)", rest).group(1), 16)


def hot_path(instrs) -> int:
    """Instructions on the shortest path from the entry to an unconditional EXIT (a predicated EXIT
    falls through, a predicated branch may go either way). Forward branches only."""
    index = {addr: i for i, (addr, *_) in enumerate(instrs)}
    inf = float("inf")
    dist = [inf] * len(instrs)
    dist[0] = 1
    best = inf
    for i, (addr, pred, op, rest) in enumerate(instrs):
        if dist[i] == inf:
            continue
        if op == "EXIT" and not pred:
            best = min(best, dist[i])
            continue
        if op == "RET" and not pred:
            continue
        succ = [i + 1] if op != "BRA" or pred else []
        if op == "BRA":
            assert _target(rest) > addr, "a loop: use loop_body"
            succ.append(index[_target(rest)])
        for j in succ:
            dist[j] = min(dist[j], dist[i] + 1)
    return int(best)


def loop_body(instrs) -> int:
    """Instructions from the target of the kernel's one backward branch to that branch."""
    loops = [(_target(rest), addr) for addr, _, op, rest in instrs if op == "BRA" and _target(rest) < addr]
    assert len(loops) == 1, f"expected one loop, found {len(loops)}"
    start, end = loops[0]
    return sum(start <= addr <= end for addr, *_ in instrs)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--formats", help="comma separated (default: every format of quant.FORMATS)")
    p.add_argument("--elements", type=int, help="elements a program of the quantize kernel")
    p.add_argument("--warps", type=int, help="warps a program of the quantize kernel")
    p.add_argument("--dtype", default="bf16", choices=DTYPES, help="x's dtype")
    p.add_argument("-k", type=int, default=K, help="the quantized axis' size")
    p.add_argument("--dump", help="write each kernel's SASS and TTGIR to DIR/<kernel>_<fmt>.sass, .ttgir")
    a = p.parse_args()
    # Compile for the GPU even without one: runtime sets TRITON_INTERPRET=1 only if it is unset.
    os.environ["TRITON_INTERPRET"] = "0"
    from tritonformer import quant, runtime

    assert not runtime.INTERPRET, "TRITON_INTERPRET must be 0 here (tritonformer was imported before)"
    runtime._on_kernel_device = lambda t: True  # quantize's input checks: the recorded launches take CPU tensors
    runtime.num_sms = lambda device_index=0: 132  # the H100 SXM's, for the amax grid
    for fmt in (a.formats or ",".join(quant.FORMATS)).split(","):
        for name, (fn, args, kw) in record_launches(fmt, DTYPES[a.dtype], a.k).items():
            if name == "_launch_quantize":
                vec = quant.FORMATS[fmt][0]
                kw["BLOCKS"] = a.elements // vec if a.elements else kw["BLOCKS"]
                kw["num_warps"] = a.warps or kw["num_warps"]
                elements = kw["BLOCKS"] * vec
            else:
                elements = kw["TILE"]
            sass, regs, ttgir = compile_sass(fn, args, kw)
            kernel = name.removeprefix("_launch_")
            if a.dump:
                os.makedirs(a.dump, exist_ok=True)
                for ext, text in (("sass", sass), ("ttgir", ttgir)):
                    with open(os.path.join(a.dump, f"{kernel}_{fmt}.{ext}"), "w") as f:
                        f.write(text)
            instrs = parse(sass)
            per_thread = elements / (kw["num_warps"] * 32)
            looped = kernel == "amax"
            count = loop_body(instrs) if looped else hot_path(instrs)
            mix = ", ".join(f"{op} {n}" for op, n in collections.Counter(op for *_, op, _ in instrs).most_common(8))
            print(f"{fmt} {kernel}: {count / per_thread:5.1f} instructions an element ({count} a thread "
                  f"{'a loop iteration' if looped else 'on the hot path'}, {len(instrs)} in the kernel; "
                  f"{per_thread:g} elements a thread: {elements} a program{' a tile' if looped else ''}, "
                  f"{kw['num_warps']} warps), {regs} registers\n    kernel's mix: {mix}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
