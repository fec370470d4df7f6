"""Host time of a call (us) of tritonformer's ops against their PyTorch peers, on inputs small
enough that the host, not the GPU, decides how fast calls go; with --profile, where a row's host
time goes, by Python function (cProfile, by own time). On the GPU machine:

    python scripts/host_time.py [--matmul [BATCHx]MxNxK,...] [--only TEXT] [--profile TEXT]
                                [--calls 300] [--top 25] [--against OTHER_TREE/src [--rounds 7]]

A row's time is --calls calls queued back to back (after 20 uncounted ones), synchronised only
at both ends. Rows: matmul forward and forward+backward at each --matmul shape; softmax, add,
the norms and swiglu at 256 x 1024; rope and causal attention (forward+backward) at 8 / 2 heads
of 64 over 128 tokens; the losses at 256 tokens of 4096 classes; scaled_matmul of one row by a
1024^2 nvfp4 weight; bf16.

With --against, a second copy of tritonformer (another tree's src: the code before a change) is
loaded beside this one under another name, and each row times the two and torch in turn, --rounds
times: the host's speed swings up to 2x between processes and minutes, so a before/after is only
read within one process, as the median of the rounds' ratios.
"""

import argparse
import cProfile
import importlib
import pstats
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch


def host_us(fn, calls: int) -> float:
    """Microseconds a call of fn, calls queued back to back."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e6


def grad(fn, inputs, dy):
    return lambda: torch.autograd.grad(fn(*inputs), inputs, dy)


def load_renamed(src: str, name: str = "tritonformer_base"):
    """The tritonformer package under src, imported as `name`: its absolute imports and its
    custom ops' namespace renamed, so that it loads beside this tree's copy."""
    copy = Path(tempfile.mkdtemp()) / name
    shutil.copytree(Path(src) / "tritonformer", copy)
    for path in copy.rglob("*.py"):
        text = path.read_text().replace("tritonformer::", f"{name}::")
        path.write_text(text.replace("from tritonformer", f"from {name}").replace("import tritonformer", f"import {name}"))
    sys.path.insert(0, str(copy.parent))
    return importlib.import_module(name)


def rows(matmul_shapes: list[str], tf=None) -> dict:
    """{row name: (tritonformer's call, PyTorch's call)}, tritonformer's through the module tf."""
    if tf is None:
        import tritonformer as tf

    dev, bf16 = "cuda", torch.bfloat16
    out = {}
    for shape in matmul_shapes:
        dims = list(map(int, shape.split("x")))
        lead, (M, N, K) = dims[:-3], dims[-3:]
        a = torch.randn(*lead, M, K, device=dev, dtype=bf16, requires_grad=True)
        b = torch.randn(*lead, K, N, device=dev, dtype=bf16, requires_grad=True)
        dc = torch.randn(*lead, M, N, device=dev, dtype=bf16)
        a0, b0 = a.detach(), b.detach()
        out[f"matmul {shape}"] = (lambda a0=a0, b0=b0: tf.matmul(a0, b0), lambda a0=a0, b0=b0: torch.matmul(a0, b0))
        out[f"matmul fwd+bwd {shape}"] = (grad(tf.matmul, (a, b), dc), grad(torch.matmul, (a, b), dc))
    x = torch.randn(256, 1024, device=dev, dtype=bf16, requires_grad=True)
    w = torch.ones(1024, device=dev, dtype=bf16, requires_grad=True)
    g = torch.randn(256, 1024, device=dev, dtype=bf16, requires_grad=True)
    dy = torch.randn(256, 1024, device=dev, dtype=bf16)
    x0, w0 = x.detach(), w.detach()

    def rms_torch(x, w):
        return w * (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)

    out["softmax 256x1024"] = (lambda: tf.softmax(x0), lambda: torch.softmax(x0, -1))
    out["rms_norm fwd"] = (lambda: tf.rms_norm(x0, w0), lambda: rms_torch(x0, w0))
    out["rms_norm fwd+bwd"] = (grad(tf.rms_norm, (x, w), dy), grad(rms_torch, (x, w), dy))
    out["swiglu fwd+bwd"] = (grad(tf.swiglu, (g, x), dy),
                             grad(lambda g, u: torch.nn.functional.silu(g) * u, (g, x), dy))
    out["add fwd"] = (lambda: tf.add(x0, x0), lambda: x0 + x0)
    out["layer_norm fwd+bwd"] = (grad(tf.layer_norm, (x, w), dy),
                                 grad(lambda x, w: torch.nn.functional.layer_norm(x, (1024,), w), (x, w), dy))
    out["add_rms_norm fwd+bwd"] = (grad(lambda x, r, w: tf.add_rms_norm(x, r, w)[0], (x, g, w), dy),
                                   grad(lambda x, r, w: rms_torch(x + r, w), (x, g, w), dy))
    q = torch.randn(1, 8, 128, 64, device=dev, dtype=bf16, requires_grad=True)
    k = torch.randn(1, 2, 128, 64, device=dev, dtype=bf16, requires_grad=True)
    cos = sin = torch.randn(1, 128, 64, device=dev, dtype=bf16)
    dq = torch.randn(1, 8, 128, 64, device=dev, dtype=bf16)

    def rope_torch(q, k):
        def rotated(t):
            return t * cos[:, None] + torch.cat((-t[..., 32:], t[..., :32]), -1) * sin[:, None]
        return rotated(q), rotated(k)

    out["apply_rope fwd+bwd"] = (lambda: torch.autograd.grad(tf.apply_rope(q, k, cos, sin), (q, k), (dq, k)),
                                 lambda: torch.autograd.grad(rope_torch(q, k), (q, k), (dq, k)))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    out["attention fwd+bwd"] = (
        grad(lambda q, k, v: tf.attention(q, k, v, causal=True), (q, k, k), dq),
        grad(lambda q, k, v: sdpa(q, k, v, is_causal=True, enable_gqa=True), (q, k, k), dq))
    logits = torch.randn(256, 4096, device=dev, dtype=bf16, requires_grad=True)
    target = torch.randint(0, 4096, (256,), device=dev)
    out["cross_entropy fwd+bwd"] = (
        lambda: torch.autograd.grad(tf.cross_entropy(logits, target), logits),
        lambda: torch.autograd.grad(torch.nn.functional.cross_entropy(logits.float(), target), logits))
    head = torch.randn(4096, 1024, device=dev, dtype=bf16, requires_grad=True)
    out["fused_linear_cross_entropy fwd+bwd"] = (
        lambda: torch.autograd.grad(tf.fused_linear_cross_entropy(x, head, target), (x, head)),
        lambda: torch.autograd.grad(torch.nn.functional.cross_entropy((x @ head.T).float(), target), (x, head)))
    weight = torch.randn(1024, 1024, device=dev, dtype=bf16)
    quantized = tf.quant.quantize(weight, "nvfp4")
    row = torch.randn(1, 1024, device=dev, dtype=bf16)
    out["scaled_matmul nvfp4 M1 1024^2"] = (lambda: tf.scaled_matmul(row, quantized), lambda: row @ weight.T)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--matmul", default="1024x1024x1024,128x4096x4096", metavar="SHAPES",
                        help="matmul shapes, comma separated")
    parser.add_argument("--only", default="", metavar="TEXT", help="the rows whose name contains TEXT")
    parser.add_argument("--profile", metavar="TEXT",
                        help="profile the rows whose name contains TEXT (e.g. 'rms_norm fwd+bwd')")
    parser.add_argument("--calls", type=int, default=300, help="calls a row")
    parser.add_argument("--top", type=int, default=25, help="functions a profile prints")
    parser.add_argument("--against", metavar="SRC", help="another tree's src to compare with, in this process")
    parser.add_argument("--rounds", type=int, default=7, help="rounds of a comparison (--against)")
    args = parser.parse_args()

    if args.against:
        compare(args)
        return
    table = {name: fns for name, fns in rows(args.matmul.split(",")).items() if args.only in name}
    for name, (ours, peer) in table.items():
        print(f"host us/call  {name:32s} ours {host_us(ours, args.calls):7.1f}  torch {host_us(peer, args.calls):7.1f}",
              flush=True)
    for name, (ours, _) in table.items():
        if args.profile is None or args.profile not in name:
            continue
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(args.calls):
            ours()
        profile.disable()
        torch.cuda.synchronize()
        print(f"--- {name}: {args.calls} calls")
        pstats.Stats(profile).sort_stats("tottime").print_stats(args.top)


def compare(args) -> None:
    """Per row: this tree's, the other tree's and torch's us a call (medians of the rounds), the
    median of the rounds' this / other ratios and their range."""
    base = load_renamed(args.against)
    shapes = args.matmul.split(",")
    ours, theirs = rows(shapes), rows(shapes, base)
    print(f"{'row':36s} {'this':>7s} {'other':>7s} {'torch':>7s} {'this/other':>10s} {'rounds':>11s}", flush=True)
    for name, (fn, peer) in ours.items():
        if args.only not in name:
            continue
        times = [(host_us(fn, args.calls), host_us(theirs[name][0], args.calls), host_us(peer, args.calls))
                 for _ in range(args.rounds)]
        this, other, torch_us = (statistics.median(t[i] for t in times) for i in range(3))
        ratios = sorted(t[0] / t[1] for t in times)
        print(f"{name:36s} {this:7.1f} {other:7.1f} {torch_us:7.1f} {statistics.median(ratios):10.3f} "
              f"{ratios[0]:5.2f}-{ratios[-1]:4.2f}", flush=True)


if __name__ == "__main__":
    main()
