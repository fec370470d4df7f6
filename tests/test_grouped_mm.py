"""grouped_mm beyond the registry's cases: offsets as routing makes them (int64, ends past the
rows, no rows at all), the gradients' layout, torch.compile, HF's expert loop, bad input."""

import pytest
import torch

import tritonformer
from tritonformer.ops.grouped_mm import grouped_mm, grouped_mm_reference
from tritonformer.testing import assert_close

from helpers import compile_fullgraph, foreign_device_tensor


def _operands(device, M=30, K=16, N=24, E=4, dtype=torch.float32):
    a = torch.randn(M, K, device=device, dtype=dtype, requires_grad=True)
    w = torch.randn(E, N, K, device=device, dtype=dtype, requires_grad=True)
    return a, w


def test_int64_ends_clamped_to_the_rows_and_the_rest_zero(device):
    a, w = _operands(device)
    offs = torch.tensor([4, 4, 19, 400], device=device)  # int64; the last end past M = 30
    out = grouped_mm(a, w.transpose(1, 2), offs)
    assert_close(out, grouped_mm_reference(a.double(), w.double().transpose(1, 2), offs), torch.float32)
    short = torch.tensor([4, 4, 19, 22], device=device)
    out = grouped_mm(a, w.transpose(1, 2), short)
    assert (out[22:] == 0).all()
    da, dw = torch.autograd.grad(out, (a, w), torch.randn_like(out))
    assert (da[22:] == 0).all()


def test_rows_past_the_last_end_are_zero_whatever_a_holds(device):
    a, w = _operands(device)
    a = a.detach().clone()
    a[26:, 0] = float("nan")
    a[29, 1] = float("inf")
    out = grouped_mm(a, w.detach().transpose(1, 2), torch.tensor([4, 4, 19, 25], device=device))
    assert (out[25:] == 0).all() and torch.isfinite(out[:25]).all()


def test_column_major_rows_cut_at_any_group_start(device):
    """A column-major a (and dout) cannot be read by TMA from a group's first row: pointer loads."""
    a = torch.randn(24, 40, device=device).t()[:30].requires_grad_(True)  # (30, 24), column-major
    w = torch.randn(3, 20, 24, device=device, requires_grad=True)
    offs = torch.tensor([7, 7, 30], device=device)
    out = grouped_mm(a, w.transpose(1, 2), offs)
    dout = torch.randn(20, 30, device=device).t()  # column-major too
    da, dw = torch.autograd.grad(out, (a, w), dout)
    ad, wd = (t.detach().double().requires_grad_(True) for t in (a, w))
    expected = grouped_mm_reference(ad, wd.transpose(1, 2), offs)
    ra, rw = torch.autograd.grad(expected, (ad, wd), dout.double())
    assert_close(out, expected, torch.float32)
    assert_close(da, ra, torch.float32, "norm")
    assert_close(dw, rw, torch.float32, "norm")


def test_gradients_are_laid_out_as_the_operands(device):
    a, w = _operands(device)
    offs = torch.tensor([10, 10, 25, 30], device=device, dtype=torch.int32)
    out = grouped_mm(a, w.transpose(1, 2), offs)
    do = torch.randn_like(out)
    da, dw = torch.autograd.grad(out, (a, w), do)
    assert dw.stride() == w.stride()  # (E, N, K) weights get an (E, N, K) gradient, no copy
    ad, wd = (t.detach().double().requires_grad_(True) for t in (a, w))
    ra, rw = torch.autograd.grad(grouped_mm_reference(ad, wd.transpose(1, 2), offs), (ad, wd), do.double())
    assert_close(da, ra, torch.float32, "norm")
    assert_close(dw, rw, torch.float32, "norm")
    assert (dw[1] == 0).all()  # an expert with no rows: a zero gradient, written


def test_strided_offsets(device):
    a, w = _operands(device)
    offs = torch.tensor([[4, 9], [11, 9], [20, 9], [30, 9]], device=device)[:, 0]  # stride 2
    assert_close(grouped_mm(a, w.transpose(1, 2), offs),
                 grouped_mm_reference(a.double(), w.double().transpose(1, 2), offs), torch.float32)


def test_no_rows(device):
    a, w = _operands(device, M=0)
    out = grouped_mm(a, w.transpose(1, 2), torch.zeros(4, dtype=torch.int32, device=device))
    assert out.shape == (0, 24)
    (dw,) = torch.autograd.grad(out, w, torch.randn_like(out))
    assert (dw == 0).all()


def test_matches_hf_expert_loop(device):
    """HF's Qwen3-MoE experts loop: the rows of each expert times its gate_up weight."""
    E, K, N, k, T = 6, 32, 20, 2, 13
    gate_up = torch.randn(E, N, K, device=device)
    x = torch.randn(T, K, device=device)
    experts = torch.stack([torch.randperm(E, device=device)[:k] for _ in range(T)])
    order = experts.flatten().argsort(stable=True)
    offs = torch.bincount(experts.flatten(), minlength=E).cumsum(0)
    rows = x[order // k]
    out = grouped_mm(rows, gate_up.transpose(1, 2), offs)
    for slot, position in zip(order.tolist(), range(T * k)):
        expected = torch.nn.functional.linear(x[slot // k].double(), gate_up[experts.flatten()[slot]].double())
        # A sum of 32 products cancels to small values: norm-wise, as every reduction is compared.
        assert_close(out[position], expected, torch.float32, compare="norm")


def test_compiles_without_graph_breaks(device):
    a, w = _operands(device)
    offs = torch.tensor([3, 9, 9, 30], device=device)

    def step(a, w, offs):
        return grouped_mm(a, w.transpose(1, 2), offs).square().sum()

    loss = compile_fullgraph(step)(a, w, offs)
    grads = torch.autograd.grad(loss, (a, w))
    ad, wd = (t.detach().double().requires_grad_(True) for t in (a, w))
    ref = grouped_mm_reference(ad, wd.transpose(1, 2), offs).square().sum()
    ref_grads = torch.autograd.grad(ref, (ad, wd))
    assert_close(loss, ref, torch.float32, "norm")
    for g, r in zip(grads, ref_grads):
        assert_close(g, r, torch.float32, "norm")


def test_is_exported():
    assert tritonformer.grouped_mm is grouped_mm


@pytest.mark.parametrize("make,error,match", [
    (lambda d: (torch.randn(4, 8, device=d), torch.randn(2, 8, 3, device=d)[0], torch.tensor([4], device=d)),
     ValueError, "takes a"),
    (lambda d: (torch.randn(4, 8, device=d), torch.randn(2, 7, 3, device=d), torch.tensor([1, 4], device=d)),
     ValueError, "K"),
    (lambda d: (torch.randn(4, 8, device=d), torch.randn(2, 8, 3, device=d), torch.tensor([4], device=d)),
     ValueError, "offs must be"),
    (lambda d: (torch.randn(4, 8, device=d), torch.randn(2, 8, 3, device=d), torch.tensor([1.0, 4.0], device=d)),
     TypeError, "int32 or int64"),
    (lambda d: (torch.randn(4, 8, device=d), torch.randn(2, 8, 3, device=d, dtype=torch.float64),
                torch.tensor([1, 4], device=d)), TypeError, "dtype"),
    (lambda d: (torch.randn(4, 8, device=d), torch.randn(2, 8, 3, device=d), foreign_device_tensor()[0, :2].long()),
     ValueError, "device"),
])
def test_bad_input_is_named(device, make, error, match):
    with pytest.raises(error, match=match):
        grouped_mm(*make(device))
