import torch

from conftest import ON_GPU
from tritonformer import runtime


def compile_fullgraph(fn):
    """torch.compile with no graph breaks allowed; inductor on the GPU, aot_eager under the
    interpreter (inductor's CPU code generation would test the C++ compiler, not our ops)."""
    torch._dynamo.reset()
    return torch.compile(fn, fullgraph=True, backend="inductor" if ON_GPU else "aot_eager")


def foreign_device_tensor():
    """A tensor on a device the kernels do not run on here."""
    return torch.empty(4, 4, device="meta")


def graph_nodes(t):
    """Names of the autograd nodes behind t."""
    seen, stack, names = set(), [t.grad_fn], []
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.append(type(node).__name__)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return names


def reference_attention(family: str) -> dict:
    """from_config's attention argument for HF's reference model of a family: HF's SDPA path drops
    Gemma 2's attention softcap, so its eager attention is the model as trained."""
    return {"attn_implementation": "eager"} if family == "gemma2" else {}


def fresh_launchers(monkeypatch) -> None:
    """Every launcher starts empty for this test (no compiled entry, chosen config or compile under
    way), so that runtime.launch_keys() and launched_ahead() count only what the test runs."""
    for launcher in runtime.FastLaunch.instances:
        monkeypatch.setattr(launcher, "entries", {})
        monkeypatch.setattr(launcher, "compiling", {})
    for launcher in runtime.TunedLauncher.instances:
        monkeypatch.setattr(launcher, "chosen", {})
        monkeypatch.setattr(launcher, "compiling", {})
