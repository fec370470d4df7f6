"""The generic checks every registered op gets: forward and gradients against its float64
reference, on fresh random inputs, with outputs poisoned before the kernels write them."""

import pytest
import torch

from tritonformer.registry import OPS
from tritonformer.testing import check_close, rel_err

from conftest import ON_GPU

CASES = [(spec, case) for spec in OPS.values() for case in spec.test_cases()]


def _leaf_copy(value, dtype=None):
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.detach().to(dtype or value.dtype).requires_grad_(value.requires_grad)
    return value


def _grad_inputs(args):
    return [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]


def _reference_grads(spec, args, kwargs, dout, dtype=None):
    ref_args = [_leaf_copy(a, dtype) for a in args]
    ref_kwargs = {k: _leaf_copy(v, dtype) for k, v in kwargs.items()}
    out = spec.reference(*ref_args, **ref_kwargs)
    return torch.autograd.grad(out, _grad_inputs(ref_args), dout.to(out.dtype))


@pytest.mark.parametrize("spec,case", CASES, ids=[f"{s.name}-{c.id}" for s, c in CASES])
def test_matches_reference(spec, case, device):
    if case.gpu_only and not ON_GPU:
        pytest.skip("large shape: GPU only")
    args, kwargs = case.make(device)
    ref_args = [_leaf_copy(a, torch.float64) for a in args]
    ref_kwargs = {k: _leaf_copy(v, torch.float64) for k, v in kwargs.items()}

    out = spec.fn(*args, **kwargs)
    expected = spec.reference(*ref_args, **ref_kwargs)
    assert out.dtype == case.dtype
    msg = check_close(out, expected, case.tolerance or case.dtype, spec.compare)
    assert msg is None, f"forward: {msg}"

    inputs = _grad_inputs(args)
    if not case.grad or not inputs or out.numel() == 0:
        return
    dout = torch.randn(out.shape, device=device).to(out.dtype)
    grads = torch.autograd.grad(out, inputs, dout)
    ref_grads = torch.autograd.grad(expected, _grad_inputs(ref_args), dout.double())
    # What PyTorch itself gets in this dtype bounds what the dtype allows (stored outputs of
    # tiny magnitude, e.g. fp16 softmax over 2^18 columns, lose bits before backward starts).
    same_dtype_grads = _reference_grads(spec, args, kwargs, dout)
    for i, (g, r, t) in enumerate(zip(grads, ref_grads, same_dtype_grads)):
        msg = check_close(g, r, g.dtype, "norm", floor=2 * rel_err(t, r))
        assert msg is None, f"gradient of input {i}: {msg}"


def test_every_op_has_cases():
    for spec in OPS.values():
        assert spec.test_cases(), spec.name
        assert spec.bench_cases(), spec.name
        assert any(c.quick for c in spec.bench_cases()), f"{spec.name} has no quick bench case"
