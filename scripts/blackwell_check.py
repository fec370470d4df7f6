"""Offline compile check of scaled_matmul's sm_100 kernel (tl.dot_scaled): no GPU needed.

    PYTHONPATH=src python3 scripts/blackwell_check.py [--pairs mxfp8:mxfp8,nvfp4:nvfp4,...]

Our GPU is an H100, which has no block-scaled MMA; Triton 3.6 runs tl.dot_scaled there by
upcasting MX operands to bf16 (the GPU tests run the kernel so) and cannot upcast nvfp4's e4m3
scales. What sm_100 makes of the kernel is checked here instead. For each format pair that
scaled_matmul sends to `_dot_scaled_kernel` on sm_100, the launch `_dot_scaled` makes for an
unaligned M x N x K is recorded (operands quantized by the PyTorch reference, on CPU), compiled
for sm_100 with Triton's compiler and ptxas, and checked:
- the PTX issues tcgen05.mma of the pair's block-scaled kind (mxf8f6f4, mxf4 or mxf4nvf4) and
  no wgmma or mma.sync (an upcast to bf16 would);
- the kernel's shared memory fits a block (227 KiB) and it uses no local memory (spills).
Also printed: registers a thread, whether the scales reach tensor memory by tcgen05.cp.
One line a pair; exit status 1 if a check fails.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget

from count_sass import compile_launch  # a script's folder is on sys.path

TARGET = GPUTarget("cuda", 100, 64)
SMEM_LIMIT = 227 * 1024
PAIRS = {"mxfp8:mxfp8": "mxf8f6f4", "mxfp8:mxfp4": "mxf8f6f4", "mxfp4:mxfp8": "mxf8f6f4",
         "mxfp4:mxfp4": "mxf4", "nvfp4:nvfp4": "mxf4nvf4"}
M, N, K = 300, 520, 1056


def record_launch(fmt_a: str, fmt_b: str) -> tuple:
    """(kernel, args, kwargs) of the launch `_dot_scaled` makes for fmt_a x fmt_b on CPU tensors."""
    from tritonformer import quant
    from tritonformer.ops.scaled_matmul import dot_scaled as sm

    a = quant.quantize_reference(torch.randn(M, K), fmt_a)
    b = quant.quantize_reference(torch.randn(N, K), fmt_b, axis=1)
    tensor_scale = a.tensor_scale * b.tensor_scale if fmt_a == "nvfp4" else None
    c = torch.empty(M, N, dtype=torch.bfloat16)
    seen = []
    saved = sm._launch_dot_scaled
    sm._launch_dot_scaled = lambda grid, *args, **kw: seen.append((saved.kernel, list(args), kw))
    try:
        sm.run(a, b, c, M, N, K, torch.randn(N), tensor_scale)
    finally:
        sm._launch_dot_scaled = saved
    return seen[0]


def check(pair: str) -> bool:
    fmt_a, fmt_b = pair.split(":")
    kernel, args, kw = record_launch(fmt_a, fmt_b)
    ck = compile_launch(kernel, args, kw, TARGET)
    ptx = ck.asm["ptx"]
    mmas = sorted(set(re.findall(r"tcgen05\.mma[\w.:]*", ptx)))
    block_scaled = any(f"kind::{PAIRS[pair]}.block_scale" in m for m in mmas)
    upcast = bool(re.search(r"\b(wgmma\.mma_async|mma\.sync)", ptx))
    smem = ck.metadata.shared
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(ck.asm["cubin"])
        f.flush()
        usage = subprocess.run([triton.knobs.nvidia.cuobjdump.path, "-res-usage", f.name], capture_output=True,
                               text=True, check=True).stdout
    regs, local = (int(re.search(rf"{key}:(\d+)", usage).group(1)) for key in ("REG", "LOCAL"))
    ok = block_scaled and not upcast and smem <= SMEM_LIMIT and local == 0
    print(f"{pair:12s} {'ok' if ok else 'FAIL':4s} mma {', '.join(mmas) or 'none'}; upcast {upcast}; "
          f"shared {smem} B; registers {regs}; local (spill) bytes {local}; scales by tcgen05.cp {'tcgen05.cp' in ptx}")
    return ok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", default=",".join(PAIRS), help="A:B format pairs, comma separated")
    pairs = parser.parse_args().pairs.split(",")
    # Compile for the GPU even without one: runtime sets TRITON_INTERPRET=1 only if it is unset.
    os.environ["TRITON_INTERPRET"] = "0"
    results = [check(pair) for pair in pairs]
    sys.exit(0 if all(results) else 1)


if __name__ == "__main__":
    main()
