"""One tolerance table for tests and benchmark checks, against a float64 reference.

Elementwise bounds are a few units of the dtype's rounding (eps/2 per rounding step); norm-wise
bounds cover fp32-accumulated reductions whose result is rounded once to the output dtype.
"""

from __future__ import annotations

import torch

# (atol, rtol) for ops whose every element is one rounding of an fp32 computation.
ELEMENTWISE = {
    torch.float64: (1e-12, 1e-10),
    torch.float32: (1e-6, 1e-5),
    torch.float16: (1e-5, 2e-3),  # eps 9.8e-4
    torch.bfloat16: (1e-4, 1.6e-2),  # eps 7.8e-3
    torch.int32: (0, 0),
}

# ||out - ref|| / ||ref|| for reductions. tf32 rounds operands to 10 mantissa bits (eps 9.8e-4);
# fp8 outputs are compared against the dequantized operands, so only the output rounding counts.
NORMWISE = {
    torch.float64: 1e-10,
    torch.float32: 2e-5,
    "tf32": 2e-3,
    torch.float16: 2e-3,
    torch.bfloat16: 1.2e-2,
    # Hopper's fp8 tensor cores accumulate each MMA with about 14 mantissa bits (2^-14 = 6e-5),
    # seen as 7e-5 here for K = 64 with float32 output; torch._scaled_mm has the same limit.
    "fp8": 3e-4,
}


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    a, e = actual.double(), expected.double()
    if not torch.isfinite(a).all():
        return float("inf")
    denom = e.norm().item()
    diff = (a - e).norm().item()
    return diff if denom == 0 else diff / denom


def check_close(actual: torch.Tensor, expected: torch.Tensor, dtype, compare: str = "elementwise",
                floor: float = 0.0) -> str | None:
    """None when `actual` matches `expected` (float64 reference) for outputs of `dtype`;
    otherwise a sentence saying how far off it is. `floor` raises the norm-wise bound to what
    the dtype's own rounding of intermediates (such as a stored forward output) allows."""
    if actual.shape != expected.shape:
        return f"shape {tuple(actual.shape)} != reference {tuple(expected.shape)}"
    if actual.numel() == 0:
        return None
    if compare == "norm":
        err, tol = rel_err(actual, expected), max(NORMWISE[dtype], floor)
        return None if err <= tol else f"relative error {err:.3g} > {tol:.3g} ({dtype})"
    atol, rtol = ELEMENTWISE[dtype]
    a, e = actual.double(), expected.double()
    # NaN where the reference has NaN, and the same infinity, match.
    bad = ~(((a - e).abs() <= atol + rtol * e.abs()) | (a == e) | (torch.isnan(a) & torch.isnan(e)))
    if not bad.any():
        return None
    idx = bad.nonzero()[0].tolist()
    return (
        f"{int(bad.sum())} of {a.numel()} elements off (atol {atol}, rtol {rtol}, {dtype}); "
        f"first at {idx}: {a[tuple(idx)].item()} vs {e[tuple(idx)].item()}"
    )


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype, compare: str = "elementwise") -> None:
    msg = check_close(actual, expected, dtype, compare)
    assert msg is None, msg
