import torch

from conftest import ON_GPU


def compile_fullgraph(fn):
    """torch.compile with no graph breaks allowed; inductor on the GPU, aot_eager under the
    interpreter (inductor's CPU code generation would test the C++ compiler, not our ops)."""
    torch._dynamo.reset()
    return torch.compile(fn, fullgraph=True, backend="inductor" if ON_GPU else "aot_eager")


def foreign_device_tensor():
    """A tensor on a device the kernels do not run on here."""
    return torch.empty(4, 4, device="meta")
