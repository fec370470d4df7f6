"""Cases of `decode_linear` and `decode_swiglu` (a decode step's products; with fp4 weights also
chained through PreparedRows, as decoding runs a layer), of `argmax` (its
greedy pick) and of `record_tokens` (its bookkeeping after the pick): odd sizes, 1 to 16 rows,
biases, strided inputs and every float dtype for the tests; for the benchmark the products of the
e2e model and of Llama-3-8B at 1 and 16 rows, argmax over Llama-3's 128k vocabulary, and the
bookkeeping at batch 1 to 64, against cuBLAS through torch (one launch per weight), torch.compile,
torch.argmax and the torch launches record_tokens replaces."""

from __future__ import annotations

import torch

from .. import quant, runtime
from ..ops.argmax import argmax, argmax_reference
from ..ops.decode_linear import (decode_linear, decode_linear_into_norm, decode_linear_reference, decode_swiglu,
                                 decode_swiglu_reference)
from ..ops.record_tokens import DecodeState, record_tokens, record_tokens_reference
from ..ops.scaled_matmul import scaled_matmul
from ..spec import Bench, BenchCase, OpSpec, TestCase, short_dtype
from . import peers


def _norm(norm_weight, eps, offset):
    return None if norm_weight is None else (norm_weight, eps, offset)


def decode_linear_outputs(x, residual, norm_weight, *weights_then_biases, weights: int, eps=1e-6, offset=0.0):
    """decode_linear with flat arguments (the registry tests cast each tensor argument)."""
    return decode_linear(x, weights_then_biases[:weights], weights_then_biases[weights:],
                         norm=_norm(norm_weight, eps, offset), residual=residual)


def decode_linear_flat_reference(x, residual, norm_weight, *weights_then_biases, weights: int, eps=1e-6,
                                 offset=0.0):
    return decode_linear_reference(x, weights_then_biases[:weights], weights_then_biases[weights:],
                                   norm=_norm(norm_weight, eps, offset), residual=residual)


def decode_swiglu_outputs(x, residual, norm_weight, w_gate, w_up, eps=1e-6, offset=0.0):
    return decode_swiglu(x, w_gate, w_up, norm=_norm(norm_weight, eps, offset), residual=residual)


def decode_swiglu_flat_reference(x, residual, norm_weight, w_gate, w_up, eps=1e-6, offset=0.0):
    return decode_swiglu_reference(x, w_gate, w_up, norm=_norm(norm_weight, eps, offset), residual=residual)


def decode_fp4_chain_outputs(x, residual, post_norm_weight, in_norm_weight, w_o, w_gate, w_up, w_down, *w_qkv,
                             eps=1e-6, offset=0.0):
    """A layer's fp4 products after attention as decoding chains them (decoding._fp4_chain), from
    the attention's output x: o into the post-attention norm, SwiGLU handed on as a PreparedRow,
    down into the next layer's norm, and that layer's q, k and v: (q, k, v, the two sums)."""
    post, mid = decode_linear_into_norm(x, w_o, residual, (post_norm_weight, eps, offset))
    act = decode_swiglu(post, w_gate, w_up, prepared=True)
    normed, out = decode_linear_into_norm(act, w_down, mid, (in_norm_weight, eps, offset))
    return (*decode_linear(normed, w_qkv), mid, out)


def decode_fp4_chain_flat_reference(x, residual, post_norm_weight, in_norm_weight, w_o, w_gate, w_up, w_down,
                                    *w_qkv, eps=1e-6, offset=0.0):
    """The same layer as the unchained products compute it."""
    o, = decode_linear_reference(x, [w_o])
    act, mid = decode_swiglu_reference(o, w_gate, w_up, norm=(post_norm_weight, eps, offset), residual=residual)
    down, = decode_linear_reference(act, [w_down])
    *qkv, out = decode_linear_reference(down, w_qkv, norm=(in_norm_weight, eps, offset), residual=mid)
    return (*qkv, mid, out)


def _chain_inputs(K, intermediate, Ns, fmt, device):
    """decode_fp4_chain_outputs' arguments: a bf16 row of K columns, fp4 weights."""
    x, (w_o,), _ = _inputs(1, K, (K,), torch.bfloat16, device, fmt=fmt)
    w_down = quant.quantize(torch.randn(K, intermediate, device=device) / intermediate**0.5, fmt, axis=1)
    _, (w_gate, w_up, *w_qkv), _ = _inputs(1, K, (intermediate, intermediate, *Ns), torch.bfloat16, device, fmt=fmt)
    residual, post = _norm_inputs(1, K, torch.bfloat16, device, "add")
    _, pre = _norm_inputs(1, K, torch.bfloat16, device, "norm")
    return x, residual, post, pre, w_o, w_gate, w_up, w_down, *w_qkv


def decode_fp4_chain_test_cases() -> list[TestCase]:
    def case(id, K, intermediate, Ns, fmt, offset=0.0, gpu_only=False):
        def make(device):
            return _chain_inputs(K, intermediate, Ns, fmt, device), dict(offset=offset)
        return TestCase(id, make, torch.bfloat16, grad=False, gpu_only=gpu_only)

    # K and N off the interpreter's 128-code steps (the words' and the squares' tails), on them (its
    # unmasked loads, and squares summed over two chunks at K 512), and Gemma's offset.
    return [
        case("nvfp4-96-160-qkv-96/32/32", 96, 160, (96, 32, 32), "nvfp4"),
        case("nvfp4-512-256-qkv-64/32/32", 512, 256, (64, 32, 32), "nvfp4"),
        case("mxfp4-64-96-qkv-24/8/8-offset", 64, 96, (24, 8, 8), "mxfp4", offset=1.0),
        case("nvfp4-4096-14336-llama", 4096, 14336, (4096, 1024, 1024), "nvfp4", gpu_only=True),
    ]


def decode_fp4_chain_bench_cases() -> list[BenchCase]:
    """Llama-3-8B's layer with nvfp4 weights (on a GPU) and a small one (the quick grid's): the chain
    against the same products unchained (the norms and the residual adds inside each product's own
    pass over x)."""
    sizes = [(128, 256, (128, 64, 64))] + ([] if runtime.INTERPRET else [(4096, 14336, (4096, 1024, 1024))])
    return [_fp4_chain_bench_case(*size, quick=size[0] == 128) for size in sizes]


def _fp4_chain_bench_case(K: int, intermediate: int, Ns: tuple[int, ...], quick: bool) -> BenchCase:
    def setup():
        args = _chain_inputs(K, intermediate, Ns, "nvfp4", runtime.DEVICE)
        x, residual, post, pre, w_o, w_gate, w_up, w_down, *w_qkv = args

        def unchained():
            o, = decode_linear(x, [w_o])
            act, mid = decode_swiglu(o, w_gate, w_up, norm=(post, 1e-6, 0.0), residual=residual)
            down, = decode_linear(act, [w_down])
            return decode_linear(down, w_qkv, norm=(pre, 1e-6, 0.0), residual=mid)

        return Bench({"tritonformer": lambda: decode_fp4_chain_outputs(*args), "unchained": unchained},
                     reference=lambda: decode_fp4_chain_flat_reference(*args))

    codes = K * (K + 2 * intermediate + sum(Ns)) + intermediate * K
    return BenchCase("decode_fp4_chain", "fwd", torch.bfloat16, f"1x{K} layer nvfp4", codes, setup,
                     bytes=codes // 2 + codes // 16, plot="1 row nvfp4", quick=quick)


def _norm_inputs(M, K, dtype, device, norm):
    """(residual, norm weight) for norm None, "norm" (rms_norm of x) or "add" (of x + residual)."""
    residual = torch.randn(M, K, device=device).to(dtype) if norm == "add" else None
    weight = (1 + 0.3 * torch.randn(K, device=device)).to(dtype) if norm else None
    return residual, weight


def _inputs(M, K, Ns, dtype, device, biases=(), strided=False, fmt=None):
    """x (M, K) and weights (N, K) scaled to unit outputs (block-scaled in fmt when given); biases
    for the weights listed; strided: x a column slice of a wider tensor and the first weight with
    a non-unit column stride."""
    x = torch.randn(M, K + 3 if strided else K, device=device).to(dtype)[:, :K]
    ws = [(torch.randn(N, K, device=device) / K**0.5).to(dtype) for N in Ns]
    if strided:
        ws[0] = (torch.randn(K, Ns[0], device=device) / K**0.5).to(dtype).t()
    if fmt:
        ws = [quant.quantize(w, fmt, axis=1) for w in ws]
    bs = [torch.randn(N, device=device).to(dtype) if i in biases else None for i, N in enumerate(Ns)]
    return x, ws, bs


def decode_linear_test_cases() -> list[TestCase]:
    def case(id, dtype, M, K, Ns, biases=(), strided=False, norm=None, offset=0.0, gpu_only=False, fmt=None):
        def make(device):
            x, ws, bs = _inputs(M, K, Ns, dtype, device, biases, strided, fmt)
            return (x, *_norm_inputs(M, K, dtype, device, norm), *ws, *bs), dict(weights=len(ws), offset=offset)
        return TestCase(id, make, dtype, grad=False, gpu_only=gpu_only)

    cases = []
    for dt in runtime.FLOAT_DTYPES:
        name = short_dtype(dt)
        cases += [
            # Weights of several tiles (the interpreter's are 64 rows): 70 and 133 rows.
            case(f"{name}-1x100-qkv-70/16/7", dt, 1, 100, (70, 16, 7), biases=(0, 2)),
            case(f"{name}-5x64-2-weights", dt, 5, 64, (48, 20), biases=(1,)),
            case(f"{name}-16x130-1-weight", dt, 16, 130, (133,)),
            case(f"{name}-1x100-rms-norm-qkv", dt, 1, 100, (37, 16, 7), biases=(1,), norm="norm"),
            case(f"{name}-4x100-add-rms-norm-qkv", dt, 4, 100, (37, 16, 7), norm="add", offset=1.0),
        ]
    cases += [
        case("bf16-strided-3x96", torch.bfloat16, 3, 96, (40, 8), strided=True),
        case("fp32-strided-1x96", torch.float32, 1, 96, (40,), strided=True),
        case("fp32-empty-weight", torch.float32, 2, 32, (0, 5)),
        case("fp32-no-columns", torch.float32, 2, 0, (4, 3), biases=(0,)),
        case("fp32-empty-weight-add-norm", torch.float32, 2, 32, (0,), norm="add"),
        # Program 0 then serves weight 1: it still stores the whole residual sum.
        case("fp32-first-weight-empty-add-norm", torch.float32, 1, 96, (0, 40, 3), norm="add"),
        case("fp16-3-rows-first-weight-empty-add-norm", torch.float16, 3, 96, (0, 40), norm="add"),
        case("bf16-1x2048-e2e-qkv", torch.bfloat16, 1, 2048, (2048, 512, 512), norm="add", gpu_only=True),
        case("bf16-16x4096-llama-qkv", torch.bfloat16, 16, 4096, (4096, 1024, 1024), biases=(0, 1, 2),
             gpu_only=True),
        case("fp16-7x14336-llama-down", torch.float16, 7, 14336, (4096,), gpu_only=True),
    ]
    # fp4 weights (one bf16 row): K off the interpreter's 128-code steps, or two of them.
    bf16 = torch.bfloat16
    cases += [
        case("nvfp4-1x96-qkv-70/16/7-add-norm", bf16, 1, 96, (70, 16, 7), biases=(1,), norm="add", fmt="nvfp4"),
        case("nvfp4-1x256-1-weight", bf16, 1, 256, (33,), fmt="nvfp4"),
        case("mxfp4-1x160-2-weights-norm", bf16, 1, 160, (40, 9), norm="norm", offset=1.0, fmt="mxfp4"),
        case("nvfp4-1x4096-llama-qkv-add-norm", bf16, 1, 4096, (4096, 1024, 1024), norm="add", fmt="nvfp4",
             gpu_only=True),
        case("mxfp4-1x14336-llama-down", bf16, 1, 14336, (4096,), biases=(0,), fmt="mxfp4", gpu_only=True),
    ]
    return cases


def decode_swiglu_test_cases() -> list[TestCase]:
    def case(id, dtype, M, K, N, strided=False, norm=None, gpu_only=False, fmt=None):
        def make(device):
            x, (w_gate, w_up), _ = _inputs(M, K, (N, N), dtype, device, strided=strided, fmt=fmt)
            return (x, *_norm_inputs(M, K, dtype, device, norm), w_gate, w_up), {}
        return TestCase(id, make, dtype, grad=False, gpu_only=gpu_only)

    cases = [case(f"{short_dtype(dt)}-{M}x72-50", dt, M, 72, 50) for dt in runtime.FLOAT_DTYPES for M in (1, 9)]
    cases += [case(f"{short_dtype(dt)}-{M}x72-50-{norm}", dt, M, 72, 50, norm=norm)
              for dt in runtime.FLOAT_DTYPES for M, norm in ((1, "add"), (5, "norm"), (16, "add"))]
    cases += [
        case("bf16-strided-2x96-40", torch.bfloat16, 2, 96, 40, strided=True),
        case("bf16-1x2048-8192-e2e", torch.bfloat16, 1, 2048, 8192, norm="add", gpu_only=True),
        case("bf16-16x4096-14336-llama", torch.bfloat16, 16, 4096, 14336, gpu_only=True),
        case("nvfp4-1x96-50-add-norm", torch.bfloat16, 1, 96, 50, norm="add", fmt="nvfp4"),
        case("mxfp4-1x256-50", torch.bfloat16, 1, 256, 50, fmt="mxfp4"),
        case("nvfp4-1x4096-14336-llama-add-norm", torch.bfloat16, 1, 4096, 14336, norm="add", fmt="nvfp4",
             gpu_only=True),
    ]
    return cases


def argmax_test_cases() -> list[TestCase]:
    def case(id, dtype, shape, ties=False, strided=False, nan=False, gpu_only=False):
        def make(device):
            x = torch.randn(*shape[:-1], shape[-1] * (2 if strided else 1), device=device).to(dtype)
            x = x[..., ::2] if strided else x
            if ties:  # the largest value twice in a row, in different chunks, and a row of -inf
                top = x.max() + 1
                x[0, 1], x[0, -1] = top, top
                x[-1] = -float("inf")
            if nan:  # NaN counts above +inf (torch's rule), in the same chunk or a later one
                x[0, 3], x[0, 5] = float("inf"), float("nan")
                x[1, 7], x[1, -2] = float("inf"), float("nan")
            return (x,), {}
        return TestCase(id, make, dtype, grad=False, gpu_only=gpu_only, out_dtype=torch.int64,
                        tolerance=torch.int32)

    cases = [case(f"{short_dtype(dt)}-3x9000-ties", dt, (3, 9000), ties=True) for dt in runtime.FLOAT_DTYPES]
    cases += [
        case("fp32-2x5x37-strided", torch.float32, (2, 5, 37), strided=True),
        case("bf16-1x1", torch.bfloat16, (1, 1)),
        case("fp32-2x9000-nan-and-inf", torch.float32, (2, 9000), nan=True),
        case("bf16-64x128256-llama3-vocab", torch.bfloat16, (64, 128256), gpu_only=True),
    ]
    return cases


def _products_bench_cases() -> list[BenchCase]:
    cases = []
    shapes = [  # label, K, weights' N, swiglu
        ("e2e qkv", 2048, (2048, 512, 512), False), ("e2e o", 2048, (2048,), False),
        ("e2e gate/up", 2048, (8192, 8192), True), ("e2e down", 8192, (2048,), False),
        ("llama3-8b qkv", 4096, (4096, 1024, 1024), False), ("llama3-8b gate/up", 4096, (14336, 14336), True),
        ("llama3-8b down", 14336, (4096,), False), ("tiny qkv", 64, (64, 32, 32), False),
        ("tiny gate/up", 64, (128, 128), True),
    ]
    for M in (1, 16):
        for label, K, Ns, swiglu in shapes:
            dtype = torch.bfloat16
            quick = label.startswith("tiny")
            if quick and M != 1:
                continue

            def setup(M=M, K=K, Ns=Ns, swiglu=swiglu, dtype=dtype):
                x, ws, _ = _inputs(M, K, Ns, dtype, runtime.DEVICE)
                if swiglu:
                    ours, torch_fn, args = decode_swiglu, decode_swiglu_reference, (x, *ws)
                else:
                    ours, torch_fn, args = decode_linear, decode_linear_reference, (x, ws)
                doubles = [t.double() if isinstance(t, torch.Tensor) else [w.double() for w in t] for t in args]
                return Bench(peers.available({
                    "tritonformer": lambda: ours(*args),
                    "torch": lambda: torch_fn(*args),
                    "torch.compile": peers.compiled(torch_fn, *args),
                }), reference=lambda: torch_fn(*doubles))

            op = "decode_swiglu" if swiglu else "decode_linear"
            weight_bytes = K * sum(Ns) * dtype.itemsize
            cases.append(BenchCase(op, "fwd", dtype, f"{M}x{label} {K}->{'+'.join(map(str, Ns))}", K * sum(Ns),
                                   setup, bytes=weight_bytes, plot=f"{M} row{'s' if M > 1 else ''} bf16",
                                   quick=quick))
    return cases


def _fp4_products_bench_cases() -> list[BenchCase]:
    """One bf16 row times nvfp4 weights of Llama-3-8B's layer against scaled_matmul (a launch a
    weight, its one-row kernel) and torch on the bf16 weights the codes stand for."""
    cases = []
    shapes = [("llama3-8b qkv", 4096, (4096, 1024, 1024), False), ("llama3-8b o", 4096, (4096,), False),
              ("llama3-8b gate/up", 4096, (14336, 14336), True), ("llama3-8b down", 14336, (4096,), False)]
    if runtime.INTERPRET:
        shapes = [("tiny qkv", 128, (64, 32, 32), False)]
    for label, K, Ns, swiglu in shapes:
        def setup(K=K, Ns=Ns, swiglu=swiglu):
            x, ws, _ = _inputs(1, K, Ns, torch.bfloat16, runtime.DEVICE, fmt="nvfp4")
            dense = [w.dequantize(torch.bfloat16) for w in ws]
            if swiglu:
                return Bench({"tritonformer": lambda: decode_swiglu(x, *ws),
                              "scaled_matmul": lambda: torch.nn.functional.silu(scaled_matmul(x, ws[0]))
                              * scaled_matmul(x, ws[1]),
                              "torch bf16": lambda: decode_swiglu_reference(x, *dense)},
                             reference=lambda: decode_swiglu_reference(x.double(), *ws))
            return Bench({"tritonformer": lambda: decode_linear(x, ws),
                          "scaled_matmul": lambda: [scaled_matmul(x, w) for w in ws],
                          "torch bf16": lambda: decode_linear_reference(x, dense)},
                         reference=lambda: decode_linear_reference(x.double(), ws))

        op = "decode_swiglu" if swiglu else "decode_linear"
        codes = K * sum(Ns)
        cases.append(BenchCase(op, "fwd", torch.bfloat16, f"1x{label} nvfp4 {K}->{'+'.join(map(str, Ns))}", codes,
                               setup, bytes=codes // 2 + codes // 16, plot="1 row nvfp4",
                               quick=label.startswith("tiny")))
    return cases


def decode_linear_bench_cases() -> list[BenchCase]:
    return [c for c in _products_bench_cases() + _fp4_products_bench_cases() if c.op == "decode_linear"]


def decode_swiglu_bench_cases() -> list[BenchCase]:
    return [c for c in _products_bench_cases() + _fp4_products_bench_cases() if c.op == "decode_swiglu"]


def argmax_bench_cases() -> list[BenchCase]:
    cases = []
    for B, V in ((1, 128256), (16, 128256), (64, 151936), (2, 1000)):
        dtype = torch.bfloat16

        def setup(B=B, V=V, dtype=dtype):
            x = torch.randn(B, V, device=runtime.DEVICE).to(dtype)
            return Bench(peers.available({
                "tritonformer": lambda: argmax(x),
                "torch": lambda: argmax_reference(x),
                "torch float32": lambda: argmax_reference(x.float()),
            }), reference=lambda: argmax_reference(x.double()))

        cases.append(BenchCase("argmax", "fwd", dtype, f"{B}x{V}", B * V, setup, bytes=B * V * dtype.itemsize,
                               plot="logits bf16", quick=V == 1000))
    return cases


def decode_state(device, B: int, capacity: int, step: int, eos, pad: int = 0, seed: int = 0) -> DecodeState:
    """A decoder's state at `step`: random tokens so far, about a third of the sequences finished
    (at a step before this one), positions and lengths in step."""
    g = torch.Generator().manual_seed(seed * 1000003 + B * 100 + step)
    out = torch.randint(0, 50, (B, capacity), generator=g)
    done = torch.rand(B, generator=g) < 0.3
    finished_at = torch.where(done, torch.randint(0, step + 1, (B,), generator=g), torch.full((B,), capacity))
    tokens = torch.randint(0, 50, (B,), generator=g)
    positions = torch.randint(0, 500, (B,), generator=g)
    lengths = (positions + 1).int()
    return DecodeState(*(t.to(device) for t in (out, done, finished_at, tokens, positions, lengths)),
                       torch.tensor([step], device=device), torch.tensor(list(eos), device=device),
                       torch.tensor(pad, device=device))


def picked_tokens(device, B: int, eos, seed: int = 0) -> torch.Tensor:
    """A step's picks, every third one the first eos id, so that some sequences finish now."""
    picked = torch.randint(0, 10, (B,), generator=torch.Generator().manual_seed(seed * 7919 + B))
    picked[::3] = eos[0]
    return picked.to(device)


def _recorded(record, picked, *state, advance):
    """The state tensors after `record` ran on copies of them, as int64 (the registry compares one dtype)."""
    copies = DecodeState(*(t.clone() for t in state))
    record(picked, copies, advance)
    return tuple(t.long() for t in copies)


def record_tokens_outputs(picked, *state, advance=True):
    return _recorded(record_tokens, picked, *state, advance=advance)


def record_tokens_flat_reference(picked, *state, advance=True):
    return _recorded(record_tokens_reference, picked, *state, advance=advance)


def record_tokens_test_cases() -> list[TestCase]:
    def case(id, B, eos, advance, capacity=12, step=4, pad=2, gpu_only=False):
        def make(device):
            return (picked_tokens(device, B, eos), *decode_state(device, B, capacity, step, eos, pad)), \
                {"advance": advance}
        return TestCase(id, make, torch.int64, grad=False, gpu_only=gpu_only, tolerance=torch.int32)

    return [
        case("B1-one-eos", 1, (7,), True),
        case("B7-two-eos", 7, (3, 5), True),
        case("B33-three-eos-no-advance", 33, (3, 5, 7), False, step=0),
        case("B5-last-step", 5, (0,), True, capacity=6, step=5),
        case("B256-llama3-eos", 256, (128001, 128008, 128009), True, capacity=4096, step=1000, gpu_only=True),
    ]


def record_tokens_bench_cases() -> list[BenchCase]:
    cases = []
    for B in (1, 16, 64, 3):
        eos, capacity = (128001, 128009), 4096

        def setup(B=B):
            state = decode_state(runtime.DEVICE, B, capacity, 0, eos)
            picked = picked_tokens(runtime.DEVICE, B, eos)
            calls = [0]

            def cycling(thunk):
                if thunk is None:
                    return None

                def call():
                    # The step counts up to the capacity: start over before it runs out (the host counts).
                    calls[0] += 1
                    if calls[0] % (capacity - 1) == 0:
                        state.step.zero_()
                    thunk()
                    return state
                return call

            def reference():
                fresh = decode_state(runtime.DEVICE, B, capacity, 0, eos)
                record_tokens_reference(picked, fresh, True)
                return fresh

            return Bench(peers.available({
                "tritonformer": cycling(lambda: record_tokens(picked, state, True)),
                "torch": cycling(lambda: record_tokens_reference(picked, state, True)),
                "torch.compile": cycling(peers.compiled(record_tokens_reference, picked, state, True)),
            }), reference=reference)

        # Per sequence: the pick, done, finished_at, positions and lengths read and written, a token written twice.
        moved = B * (8 + 2 * (1 + 8 + 8 + 4) + 16)
        cases.append(BenchCase("record_tokens", "fwd", torch.int64, f"B{B}", B, setup, bytes=moved,
                               plot="decode step bookkeeping", quick=B == 3, tolerance=torch.int32))
    return cases


LINEAR_SPEC = OpSpec(name="decode_linear", fn=decode_linear_outputs, reference=decode_linear_flat_reference,
                     test_cases=decode_linear_test_cases, bench_cases=decode_linear_bench_cases, compare="norm")
SWIGLU_SPEC = OpSpec(name="decode_swiglu", fn=decode_swiglu_outputs, reference=decode_swiglu_flat_reference,
                     test_cases=decode_swiglu_test_cases, bench_cases=decode_swiglu_bench_cases, compare="norm")
ARGMAX_SPEC = OpSpec(name="argmax", fn=argmax, reference=argmax_reference, test_cases=argmax_test_cases,
                     bench_cases=argmax_bench_cases)
FP4_CHAIN_SPEC = OpSpec(name="decode_fp4_chain", fn=decode_fp4_chain_outputs,
                        reference=decode_fp4_chain_flat_reference, test_cases=decode_fp4_chain_test_cases,
                        bench_cases=decode_fp4_chain_bench_cases, compare="norm")
RECORD_TOKENS_SPEC = OpSpec(name="record_tokens", fn=record_tokens_outputs, reference=record_tokens_flat_reference,
                            test_cases=record_tokens_test_cases, bench_cases=record_tokens_bench_cases)
