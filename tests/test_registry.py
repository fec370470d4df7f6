"""The generic checks every registered op gets: forward and gradients against its float64
reference, on fresh random inputs, with outputs poisoned before the kernels write them.

An op may return one tensor or a tuple of tensors (None entries are skipped); every floating
output gets a random upstream gradient."""

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


def _grad_inputs(args, kwargs):
    return [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor) and a.requires_grad]


def _outputs(out):
    return [o for o in (out if isinstance(out, (tuple, list)) else (out,)) if o is not None]


def _differentiable(outputs):
    return [o for o in outputs if o.requires_grad and o.numel() > 0]


def _grads(outputs, inputs, douts):
    pairs = [(o, d) for o, d in zip(outputs, douts) if o.requires_grad and o.numel() > 0]
    grads = torch.autograd.grad([o for o, _ in pairs], inputs, [d.to(o.dtype) for o, d in pairs],
                                allow_unused=True)
    return [torch.zeros_like(i) if g is None else g for g, i in zip(grads, inputs)]


@pytest.mark.parametrize("spec,case", CASES, ids=[f"{s.name}-{c.id}" for s, c in CASES])
def test_matches_reference(spec, case, device):
    if case.gpu_only and not ON_GPU:
        pytest.skip("large shape: GPU only")
    args, kwargs = case.make(device)
    ref_args = [_leaf_copy(a, torch.float64) for a in args]
    ref_kwargs = {k: _leaf_copy(v, torch.float64) for k, v in kwargs.items()}

    outs = _outputs(spec.fn(*args, **kwargs))
    expected = _outputs(spec.reference(*ref_args, **ref_kwargs))
    assert len(outs) == len(expected), f"{len(outs)} outputs, reference {len(expected)}"
    for i, (out, exp) in enumerate(zip(outs, expected)):
        assert out.dtype == (case.out_dtype or case.dtype), f"output {i} has dtype {out.dtype}"
        msg = check_close(out, exp, case.tolerance or case.dtype, case.compare or spec.compare)
        assert msg is None, f"forward output {i}: {msg}"

    inputs = _grad_inputs(args, kwargs)
    if not case.grad or not inputs or not _differentiable(outs):
        return
    douts = [torch.randn(o.shape, device=device).to(o.dtype) for o in outs]
    grads = _grads(outs, inputs, douts)
    ref_grads = _grads(expected, _grad_inputs(ref_args, ref_kwargs), [d.double() for d in douts])
    # What PyTorch itself gets in this dtype bounds what the dtype allows (stored outputs of
    # tiny magnitude, e.g. fp16 softmax over 2^18 columns, lose bits before backward starts).
    same_args = [_leaf_copy(a) for a in args]
    same_kwargs = {k: _leaf_copy(v) for k, v in kwargs.items()}
    same_dtype = _grads(_outputs(spec.reference(*same_args, **same_kwargs)), _grad_inputs(same_args, same_kwargs), douts)
    for i, (g, r, t) in enumerate(zip(grads, ref_grads, same_dtype)):
        msg = check_close(g, r, g.dtype, "norm", floor=case.grad_floor * rel_err(t, r))
        assert msg is None, f"gradient of input {i}: {msg}"


def test_every_op_has_cases():
    for spec in OPS.values():
        assert spec.test_cases(), spec.name
        assert spec.bench_cases(), spec.name
        assert any(c.quick for c in spec.bench_cases()), f"{spec.name} has no quick bench case"
