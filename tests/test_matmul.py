import pytest
import torch

import tritonformer as tf
from tritonformer import nn
from tritonformer.ops import matmul as matmul_op
from tritonformer.ops.matmul import split_inside
from tritonformer.testing import assert_close

from helpers import compile_fullgraph, foreign_device_tensor

FP8 = torch.float8_e4m3fn


@pytest.mark.parametrize("activation", [None, "relu", "leaky_relu", "gelu", "gelu_tanh", "silu"])
def test_activation_forward_and_gradients(activation, device):
    a = torch.randn(24, 40, device=device, requires_grad=True)
    b = torch.randn(40, 32, device=device, requires_grad=True)
    bias = torch.randn(32, device=device, requires_grad=True)
    out = tf.matmul(a, b, bias, activation, negative_slope=0.2)
    ref_inputs = [t.detach().double().requires_grad_(True) for t in (a, b, bias)]
    ref = matmul_op.matmul_reference(*ref_inputs, activation, negative_slope=0.2)
    assert_close(out, ref, torch.float32, "norm")
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (a, b, bias), dout)
    ref_grads = torch.autograd.grad(ref, ref_inputs, dout.double())
    for g, r in zip(grads, ref_grads):
        assert_close(g, r, torch.float32, "norm")


@pytest.mark.parametrize("path", ["pointer loads", "padded copies"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_unaligned_operands_both_paths(path, dtype, device, monkeypatch):
    # Rows of 13 or 11 elements are not 16-byte aligned, so TMA cannot read them: small products
    # read them with pointer loads, large ones (here: every product) copy them padded first.
    if path == "padded copies":
        monkeypatch.setattr(matmul_op, "POINTER_LOADS_MAX_WORK", 0)
    a = torch.randn(3, 9, 13, device=device, dtype=dtype, requires_grad=True)
    b = torch.randn(11, 13, device=device, dtype=dtype).mT.requires_grad_(True)  # (13, 11), column-major
    batched_b = torch.randn(13, 5, device=device, dtype=dtype).expand(3, 13, 5)  # stride 0 batch
    bias = torch.randn(11, device=device, dtype=dtype)
    out = tf.matmul(a, b, bias, "gelu")
    ad, bd = (t.detach().double().requires_grad_(True) for t in (a, b))
    ref = torch.nn.functional.gelu(ad @ bd + bias.double())
    assert_close(out, ref, dtype, "norm")
    dout = torch.randn_like(out)
    for g, r in zip(torch.autograd.grad(out, (a, b), dout), torch.autograd.grad(ref, (ad, bd), dout.double())):
        assert_close(g, r, dtype, "norm")
    assert_close(tf.matmul(a.detach(), batched_b), ad.detach() @ batched_b.double(), dtype, "norm")
    assert torch.equal(tf.matmul(a.detach(), batched_b), tf.matmul(a.detach(), batched_b))  # replayed


def test_unaligned_operands_are_padded_not_misread(device):
    # K = 13 float32 rows are 52 bytes: not 16-byte aligned, so TMA needs a padded copy.
    a = torch.randn(9, 13, device=device)
    assert matmul_op.tma_layout(a, (1, 9, 13), (117, 13, 1)) is None
    padded, again = matmul_op._padded_copy(a, (1, 9, 13), (117, 13, 1))
    assert padded.stride()[1] % 4 == 0 and padded.shape == (1, 9, 13) and torch.equal(padded[0], a)
    other = torch.randn(9, 13, device=device)
    assert torch.equal(again(other)[0, :, :13], other)


def test_transposed_operands_are_read_in_place(device):
    weight = torch.randn(48, 32, device=device)
    assert matmul_op.tma_layout(weight, (1, 32, 48), (1536, 1, 32)) == ((1536, 1, 32), True)


@pytest.mark.parametrize("a_shape,b_shape", [((5, 0), (0, 16)), ((5, 8), (8, 0)), ((2, 5, 8), (8, 0)),
                                             ((2, 5, 0), (2, 0, 16))])
def test_zero_size_gradients(a_shape, b_shape, device):
    # K or N of 0 with a 2-D b: the backward's reshape(-1, 0) failed.
    a = torch.randn(a_shape, device=device, requires_grad=True)
    b = torch.randn(b_shape, device=device, requires_grad=True)
    bias = torch.randn(b_shape[-1], device=device, requires_grad=True)
    tf.matmul(a, b, bias).sum().backward()
    assert a.grad.shape == a.shape and b.grad.shape == b.shape
    assert (a.grad == 0).all() and (b.grad == 0).all()
    assert torch.equal(bias.grad, torch.full_like(bias, a.shape[:-1].numel()))


def test_empty_reduction_gives_bias_through_activation(device):
    a, b = torch.randn(3, 0, device=device), torch.randn(0, 5, device=device)
    bias = torch.randn(5, device=device)
    assert_close(tf.matmul(a, b, bias, "relu"), torch.relu(bias.double()).expand(3, 5), torch.float32)


def test_linear_module_matches_torch_linear(device):
    torch_linear = torch.nn.Linear(40, 24).to(device)
    ours = nn.Linear(40, 24).to(device)
    ours.load_state_dict(torch_linear.state_dict())
    assert isinstance(ours, torch.nn.Linear)
    x = torch.randn(2, 7, 40, device=device)
    assert_close(ours(x), torch_linear.double()(x.double()), torch.float32, "norm")
    # One vector, as torch's Linear takes it, gradient included.
    v = torch.randn(40, device=device, requires_grad=True)
    out = ours(v)
    assert out.shape == (24,)
    assert_close(out, torch_linear.double()(v.double()), torch.float32, "norm")
    out.sum().backward()
    assert_close(v.grad, torch_linear.weight.double().sum(0), torch.float32, "norm")


def test_compiles_forward_and_backward_without_graph_break(device):
    a = torch.randn(16, 32, device=device, requires_grad=True)
    b = torch.randn(32, 48, device=device, requires_grad=True)
    out = compile_fullgraph(lambda x, y: tf.matmul(x, y, activation="silu") * 3)(a, b)
    out.sum().backward()
    ad, bd = (t.detach().double().requires_grad_(True) for t in (a, b))
    ref = torch.nn.functional.silu(ad @ bd) * 3
    ref.sum().backward()
    assert_close(out, ref, torch.float32, "norm")
    assert_close(a.grad, ad.grad, torch.float32, "norm")
    assert_close(b.grad, bd.grad, torch.float32, "norm")


def _t(shape, dtype=torch.float32):
    return lambda d: torch.randn(shape, device=d).to(dtype)


@pytest.mark.parametrize(
    "a,b,kwargs,error,match",
    [
        (_t((4, 8)), _t((8, 4), torch.float16), {}, TypeError, "same dtype"),
        (_t((4, 8), torch.float64), _t((8, 4), torch.float64), {}, TypeError, "a has dtype torch.float64"),
        (_t((4, 8)), _t((7, 4)), {}, ValueError, r"a.shape\[-1\] must equal b.shape\[-2\]"),
        (_t((8,)), _t((8, 4)), {}, ValueError, "a must have at least 2"),
        (_t((2, 4, 8)), _t((3, 8, 4)), {}, ValueError, "do not broadcast"),
        (_t((4, 8)), _t((8, 4)), {"bias": _t((5,))}, ValueError, r"bias must have shape \(4,\)"),
        (_t((4, 8)), _t((8, 4)), {"activation": "tanh"}, ValueError, "activation must be one of"),
        (_t((4, 8)), _t((8, 4)), {"scale_a": _t(())}, ValueError, "float8_e4m3fn operands only"),
        (_t((4, 32), FP8), _t((32, 4), FP8), {"scale_a": _t((3,))}, ValueError, "scale_a must hold one value"),
        (_t((4, 32), FP8), _t((2, 32, 4), FP8), {}, ValueError, "float8 matmul takes a 2-D b"),
        (_t((4, 8)), _t((8, 4)), {"out_dtype": torch.int32}, TypeError, "out_dtype"),
        (_t((4, 8)), _t((8, 4)), {"bias": 1.0}, TypeError, "bias must be a torch.Tensor"),
        (_t((4, 32), FP8), _t((32, 4), FP8), {"scale_a": 2.0}, TypeError, "scale_a must be a torch.Tensor"),
    ],
)
def test_bad_input_is_named(a, b, kwargs, error, match, device):
    kwargs = {k: (v(device) if callable(v) else v) for k, v in kwargs.items()}
    with pytest.raises(error, match=match):
        tf.matmul(a(device), b(device), **kwargs)


def test_foreign_device_is_named(device):
    with pytest.raises(ValueError, match="b is on meta"):
        tf.matmul(torch.randn(4, 4, device=device), foreign_device_tensor())


def test_specialization_class_matches_triton():
    """FastLaunch reuses a compiled kernel for arguments of one class: a class must never mix
    arguments Triton specializes apart (else a kernel compiled for aligned data could read unaligned)."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    from tritonformer.runtime import _specialization_key, specialization_class

    from triton.tools.tensor_descriptor import TensorDescriptor

    base = torch.empty(64, dtype=torch.float16)
    descriptors = [TensorDescriptor(t, [4, 16], [16, 1], block) for t, block in
                   ((base, [2, 8]), (base, [4, 8]), (base.float(), [2, 8]), (base[8:], [2, 8]))]
    values = [1, 2, 16, 17, 32, 0, -16, 2**31, 2**31 + 16, True, False, None, 1.5, 2.0,
              base, base[1:], base[8:], base.float(), base.float()[4:], base.float()[1:], *descriptors]
    for x in values:
        for y in values:
            same_class = type(x) is type(y) and specialization_class(x) == specialization_class(y)
            # FastLaunch's key classes a whole argument list at once, the same way.
            assert (_specialization_key((x,)) == _specialization_key((y,))) == same_class, (x, y)
            same_triton = type(x) is type(y) and (
                native_specialize_impl(BaseBackend, x, False, True, True)
                == native_specialize_impl(BaseBackend, y, False, True, True))
            # A finer class only costs a cache entry; a coarser one would launch the wrong kernel.
            assert same_triton or not same_class, (x, y)


@pytest.mark.parametrize("loads", ["pointer loads", "tma"])
@pytest.mark.parametrize("case", ["2d", "3d-a", "batched", "split-k-bias-act", "transposed-b"])
def test_replayed_calls_match_the_reference(case, loads, device, monkeypatch):
    """The second call with a signature replays planned launches: new data, same results; an
    operand whose alignment differs (an offset view) must not reuse the plan. Products this small
    read aligned operands with pointer loads; "tma" sends them through tensor descriptors, as
    larger ones go."""
    if loads == "tma":
        monkeypatch.setattr(matmul_op, "POINTER_LOADS_MAX_M", 0)
    shapes = {"2d": ((24, 32), (32, 40)), "3d-a": ((2, 12, 32), (32, 40)), "batched": ((3, 16, 32), (3, 32, 24)),
              "split-k-bias-act": ((8, 2048), (2048, 16)), "transposed-b": ((24, 32), (40, 32))}
    a_shape, b_shape = shapes[case]
    kwargs = {"activation": "silu"} if case == "split-k-bias-act" else {}
    for call in range(4):
        base = torch.randn(a_shape[:-1] + (a_shape[-1] + 1,), device=device)
        # Calls 0-2 read an aligned view; call 3 an offset view (other alignment, other plan).
        a = base[..., :-1] if call < 3 else base[..., 1:]
        b = torch.randn(b_shape, device=device)
        b = b.mT if case == "transposed-b" else b
        bias = torch.randn(b.shape[-1], device=device) if case == "split-k-bias-act" else None
        out = tf.matmul(a, b, bias, **kwargs)
        ref = matmul_op.matmul_reference(a.double(), b.double(), None if bias is None else bias.double(), **kwargs)
        assert_close(out, ref, torch.float32, "norm")


def test_sizes_in_one_power_of_two_bucket_share_one_tuning(device):
    """Training with padding or packing changes the token count every batch: the rows of a
    product (and K, where the tokens are summed over in a weight gradient) tune once a power-of-two
    bucket, and every size in the bucket runs correctly on that choice."""
    chosen = matmul_op._launch_matmul.chosen
    b = torch.randn(48, 24, device=device)
    before = set(chosen)
    for rows in (65, 100, 128, 129):
        a = torch.randn(rows, 48, device=device)
        assert_close(tf.matmul(a, b), matmul_op.matmul_reference(a.double(), b.double()), torch.float32, "norm")
    assert len(set(chosen) - before) == 2  # 65-128, then 129
    before = set(chosen)
    for tokens in (33, 50, 64):
        x, dy = torch.randn(tokens, 40, device=device), torch.randn(tokens, 24, device=device)
        assert_close(tf.matmul(x.mT, dy), matmul_op.matmul_reference(x.double().mT, dy.double()), torch.float32,
                     "norm")
    assert len(set(chosen) - before) == 1


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                    reason="the split-inside kernel is Gluon, Hopper only")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("layout", ["a b", "a^T b", "a b^T", "a^T b^T"])
def test_split_inside_kernel_takes_few_tiles(layout, dtype, device, monkeypatch):
    """A product of too few 64 x 64 tiles to fill the SMs, which split-K would cover, runs on
    _split_inside_kernel (K in two halves on two warpgroups of a program): each operand row- or
    column-major (read in place: M and K are multiples of 8), an M that is not a multiple of the
    tile, bias, GELU with its pre-activation saved for the gradients, then replayed on new data."""
    planned = []
    launch = split_inside.launch
    monkeypatch.setattr(split_inside, "launch", lambda *args: planned.append(args[9:12]) or launch(*args))
    M, N, K = 120, 4000, 1536
    for call in range(2):
        a = torch.randn(M, K, device=device, dtype=dtype) if layout.startswith("a b") else \
            torch.randn(K, M, device=device, dtype=dtype).mT
        b = torch.randn(K, N, device=device, dtype=dtype) if layout.endswith(" b") else \
            torch.randn(N, K, device=device, dtype=dtype).mT
        a.requires_grad_()
        bias = torch.randn(N, device=device, dtype=dtype, requires_grad=True)
        out = tf.matmul(a, b, bias, "gelu")
        ad, bd, biasd = (t.detach().double().requires_grad_(True) for t in (a, b, bias))
        ref = matmul_op.matmul_reference(ad, bd, biasd, "gelu")
        assert_close(out, ref, dtype, "norm")
        dout = torch.randn_like(out)
        grads = torch.autograd.grad(out, (a, bias), dout)
        for g, r in zip(grads, torch.autograd.grad(ref, (ad, biasd), dout.double())):
            assert_close(g, r, dtype, "norm")
        plain = tf.matmul(a.detach(), b)
        assert_close(plain, ad.detach() @ bd.detach(), dtype, "norm")
    assert planned == [(M, N, K)] * 2  # planned once with the pre-activation, once without; then replayed


@pytest.mark.parametrize("split_k", [2, 5])
def test_split_k_last_arrival_sums_in_order_and_resets_its_counters(split_k, device, monkeypatch):
    """Split-K over several tiles: the last split of each tile adds the partials. The sum runs in
    split order, so two calls agree to the bit; the counters are back at zero after each call."""
    from tritonformer import runtime

    monkeypatch.setattr(matmul_op, "_split_k", lambda *args: split_k)
    a, b = torch.randn(80, 3000, device=device), torch.randn(3000, 200, device=device)
    bias = torch.randn(200, device=device)
    outs = [tf.matmul(a, b, bias, "gelu") for _ in range(3)]
    ref = matmul_op.matmul_reference(a.double(), b.double(), bias.double(), "gelu")
    assert_close(outs[0], ref, torch.float32, "norm")
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[1], outs[2])
    counters = runtime.arrival_counters(a.device, 1)
    assert int(counters.abs().sum()) == 0


def test_replay_in_another_thread(device):
    """A signature planned in one thread may first replay in another (autograd's backward
    thread); Triton keeps some launch state per thread (the device descriptors' allocator)."""
    import threading

    a, b = torch.randn(16, 32, device=device), torch.randn(32, 24, device=device)
    for _ in range(2):  # plan
        tf.matmul(a, b)
    results = []
    worker = threading.Thread(target=lambda: results.append(tf.matmul(a, b)))
    worker.start()
    worker.join()
    assert_close(results[0], a.double() @ b.double(), torch.float32, "norm")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_erf_gelu_epilogue_elementwise_over_its_range(device, dtype):
    # Every element, tails included, within the output dtype's rounding of the exact GELU.
    x = torch.linspace(-9, 9, 64 * 64, device=device).reshape(64, 64).to(dtype)
    eye = torch.eye(64, device=device, dtype=dtype)
    out = tf.matmul(x, eye, activation="gelu")
    assert_close(out, torch.nn.functional.gelu(x.double()), dtype)


def test_float8_matmul_refuses_an_input_that_needs_a_gradient(device):
    a = torch.randn(16, 32, device=device, requires_grad=True)
    b = torch.randn(32, 16, device=device).to(torch.float8_e4m3fn)
    scale = torch.ones((), device=device)
    with pytest.raises(ValueError, match="^a requires grad, but float8 matmul has no backward"):
        tf.matmul(a.to(torch.float8_e4m3fn), b, scale_a=scale, scale_b=scale)
    bias = torch.zeros(16, device=device, requires_grad=True)
    with pytest.raises(ValueError, match="^bias requires grad"):
        tf.matmul(a.detach().to(torch.float8_e4m3fn), b, bias, scale_a=scale, scale_b=scale)
    with torch.no_grad():
        tf.matmul(a.to(torch.float8_e4m3fn), b, scale_a=scale, scale_b=scale)
