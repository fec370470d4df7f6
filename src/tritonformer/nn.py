"""nn.Module drop-ins: subclasses of the torch modules they replace, so state_dicts, constructor
arguments and isinstance checks keep working."""

from __future__ import annotations

import torch

from .ops.matmul import matmul
from .ops.softmax import softmax


class Softmax(torch.nn.Softmax):
    """`torch.nn.Softmax` computed by tritonformer's kernel."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return softmax(x, -1 if self.dim is None else self.dim)


class Linear(torch.nn.Linear):
    """`torch.nn.Linear` whose product and bias run in tritonformer's matmul (weight read
    transposed in place, no copy)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return matmul(x, self.weight.t(), self.bias)
