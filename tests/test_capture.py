"""tritonformer.capture_step: its bookkeeping on the CPU (a stand-in graph that replays the step
as a CUDA graph would: the step's Python does not run again, its outputs are the same buffers
each replay), and real CUDA graphs of a patched HF model's training step on the GPU."""

import contextlib
import subprocess
import sys

import pytest
import torch

import tritonformer
from tritonformer import capture
from tritonformer.capture import CaptureError, capture_step

from conftest import gpu_only


class _StandInGraph:
    """What a CUDA graph does with a step, on the CPU: capture records the step without running
    it; each replay runs it on the recorded inputs and writes its results into the same output
    buffers."""
    captures = 0

    @staticmethod
    def supports(device):
        return True

    @staticmethod
    def warm_up_stream(device):
        return contextlib.nullcontext()

    @staticmethod
    def new_pool(device):
        return object()

    def __init__(self, fn, args, kwargs, pool, device):
        type(self).captures += 1
        self.fn, self.args, self.kwargs, self.outputs = fn, args, kwargs, None

    def replay(self):
        out = self.fn(*self.args, **self.kwargs)
        if self.outputs is None:
            self.outputs = out.detach().clone()
        else:
            self.outputs.copy_(out)
        return self.outputs


@pytest.fixture
def stand_in(monkeypatch):
    monkeypatch.setattr(capture.CapturedStep, "backend", _StandInGraph)
    _StandInGraph.captures = 0
    return _StandInGraph


def _model_and_step(lr=0.1):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)

    def step(x, y):
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return model, opt, step


def _batches(n, rows=4):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(rows, 8, generator=g), torch.randn(rows, 1, generator=g)) for _ in range(n)]


def test_each_call_is_one_step_on_its_own_inputs(stand_in):
    model, _, step = _model_and_step()
    reference, _, reference_step = _model_and_step()
    captured = capture_step(step)
    batches = _batches(6)
    losses = [captured(x, y) for x, y in batches]
    expected = [reference_step(x, y).detach() for x, y in batches]
    assert stand_in.captures == 1  # the first call warms up, the second captures, the rest replay
    # Every loss is its own step's (the graph's output buffer is copied out, never handed over).
    assert all(torch.equal(a, b) for a, b in zip(losses, expected))
    assert len({float(x) for x in losses}) == len(losses)
    assert all(not x.requires_grad for x in losses)
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p, q)


def test_a_new_layout_captures_its_own_graph_up_to_max_graphs(stand_in):
    _, _, step = _model_and_step()
    captured = capture_step(max_graphs=2)(step)
    for rows in (4, 4, 4, 6, 6, 6):
        captured(*_batches(1, rows)[0])
    assert stand_in.captures == 2 and len(captured.graphs) == 2
    captured(*_batches(1, 3)[0])  # a third layout's warm-up is eager
    with pytest.raises(CaptureError, match="max_graphs=2"):
        captured(*_batches(1, 3)[0])


def test_a_non_tensor_argument_is_part_of_the_layout(stand_in):
    model = torch.nn.Linear(8, 1)

    def scaled(x, scale):
        return model(x).sum() * scale

    captured = capture_step(scaled)
    x = torch.randn(2, 8)
    results = [captured(x, s) for s in (1.0, 1.0, 1.0, 2.0, 2.0, 2.0)]
    assert stand_in.captures == 2
    assert torch.allclose(results[-1], 2 * results[0])
    with pytest.raises(CaptureError, match="hashable"):
        captured(x, {1.0})  # a set: a leaf that cannot be hashed


def test_a_step_that_leaves_gradients_is_refused(stand_in):
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(x):
        model(x).sum().backward()
        opt.step()
        return x

    with pytest.raises(CaptureError, match="zero_grad"):
        capture_step(step)(torch.randn(2, 8))


def test_a_learning_rate_changed_after_capture_raises(stand_in):
    _, opt, step = _model_and_step()
    captured = capture_step(step)
    x, y = _batches(1)[0]
    captured(x, y)
    opt.param_groups[0]["lr"] = 0.05  # before the capture: taken
    captured(x, y), captured(x, y)
    opt.param_groups[0]["max_lr"] = 0.1  # a key added after capture (a scheduler's) holds nothing
    captured(x, y)
    opt.param_groups[0]["lr"] = 0.01  # after it: the graph would keep 0.05
    with pytest.raises(CaptureError, match=r"'lr' changed after capture \(0.05 -> 0.01\)"):
        captured(x, y)


def test_a_step_that_cannot_be_captured_says_why_once_and_leaves_no_gradients(stand_in, monkeypatch):
    model, _, step = _model_and_step()
    attempts = []

    def failing(self, fn, args, kwargs, pool, device):
        # As far as a capture gets: the backward assigned gradients, then a host synchronisation.
        attempts.append(1)
        torch.nn.functional.mse_loss(model(args[0]), args[1]).backward()
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(stand_in, "__init__", failing)
    captured = capture_step(step)
    x, y = _batches(1)[0]
    captured(x, y)
    for _ in range(2):
        with pytest.raises(CaptureError, match="host synchronisation.*not permitted when stream is capturing"):
            captured(x, y)
    assert len(attempts) == 1  # the layout's failure is remembered, not retried
    assert all(p.grad is None for p in model.parameters())


def test_a_cpu_tensor_beside_device_tensors_is_refused(stand_in, monkeypatch):
    monkeypatch.setattr(stand_in, "supports", staticmethod(lambda device: device.type == "meta"))
    captured = capture_step(lambda x, table: x)
    with pytest.raises(CaptureError, match="another device"):
        captured(torch.empty(2, device="meta"), torch.ones(3))
    captured(torch.empty(2, device="meta"), torch.tensor(1.0))  # a 0-dim one is a number: keyed by value


def test_a_host_scalar_argument_is_keyed_by_its_value(stand_in):
    model = torch.nn.Linear(8, 1)
    captured = capture_step(lambda x, scale: model(x).sum() * scale)
    x = torch.randn(2, 8)
    results = [captured(x, torch.tensor(s)) for s in (1.0, 1.0, 1.0, 3.0, 3.0, 3.0)]
    assert stand_in.captures == 2
    assert torch.allclose(results[-1], 3 * results[0])


def test_cpu_tensors_run_the_step_as_it_is():
    calls = []

    def step(x):
        calls.append(1)
        return x + 1

    captured = capture_step(step)
    outs = [captured(torch.full((2,), float(i))) for i in range(4)]
    assert len(calls) == 4 and not captured.graphs
    assert [float(o[0]) for o in outs] == [1.0, 2.0, 3.0, 4.0]


def test_bad_arguments():
    with pytest.raises(TypeError, match="callable"):
        capture_step(3)
    with pytest.raises(ValueError, match="max_graphs"):
        capture_step(lambda x: x, max_graphs=0)


# ---- real CUDA graphs ----

def _scribble():
    """Fill the allocator's free blocks with NaN: a graph that reads memory freed since its
    capture reads NaN."""
    junk = [torch.full((n,), float("nan"), device="cuda") for n in (256, 512, 1024, 2048, 4096) for _ in range(16)]
    del junk


def _hf_training(steps_shapes, captured: bool, scheduler: bool = True, optimizer=torch.optim.AdamW):
    """Losses and final parameters of a patched tiny Llama trained with fused AdamW, torch's or
    ours (and a linear warm-up of its learning rate), on batches of the given (batch, seq) shapes."""
    transformers = pytest.importorskip("transformers")
    from tritonformer.integrations import hf

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                      max_position_embeddings=64)
    model = hf.patch(transformers.AutoModelForCausalLM.from_config(config).cuda().to(torch.bfloat16))
    # Learning rates exact in float32: the captured step reads a float32 tensor, eager a double.
    opt = optimizer(model.parameters(), lr=2**-10, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: min(1.0, (i + 1) / 4)) if scheduler else None

    def step(ids):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    run = capture_step(step) if captured else step
    g = torch.Generator().manual_seed(1)
    losses = []
    for shape in steps_shapes:
        losses.append(run(torch.randint(0, 128, shape, generator=g).cuda()).detach())
        _scribble()
        if sched is not None:
            sched.step()
    return torch.stack(losses).float(), [p.detach().clone() for p in model.parameters()], run


@gpu_only
@pytest.mark.parametrize("optimizer", [torch.optim.AdamW, tritonformer.optim.AdamW], ids=["torch", "tritonformer"])
def test_hf_training_under_cuda_graphs_matches_eager_bitwise(optimizer):
    shapes = [(2, 32)] * 20
    losses, params, run = _hf_training(shapes, captured=True, optimizer=optimizer)
    ref_losses, ref_params, _ = _hf_training(shapes, captured=False, optimizer=optimizer)
    assert len(run.graphs) == 1
    assert torch.equal(losses, ref_losses)
    assert all(torch.equal(p, q) for p, q in zip(params, ref_params))


@gpu_only
@pytest.mark.parametrize("optimizer", [torch.optim.AdamW, tritonformer.optim.AdamW], ids=["torch", "tritonformer"])
def test_hf_training_under_cuda_graphs_recaptures_a_new_batch_shape(optimizer):
    shapes = [(2, 32)] * 4 + [(4, 16)] * 4 + [(2, 32)] * 2
    losses, params, run = _hf_training(shapes, captured=True, scheduler=False, optimizer=optimizer)
    ref_losses, ref_params, _ = _hf_training(shapes, captured=False, scheduler=False, optimizer=optimizer)
    assert len(run.graphs) == 2
    assert torch.equal(losses, ref_losses)
    assert all(torch.equal(p, q) for p, q in zip(params, ref_params))


# In a child process: a capture that fails must leave the device usable, and if it ever did
# not, only this test would fail (torch's own context manager left every later random op failing).
_FAILED_CAPTURE = """
import pytest, torch
from tritonformer.capture import CaptureError, capture_step

model = torch.nn.Linear(16, 16).cuda()
dropout = torch.nn.Dropout(0.5)  # a captured graph that draws random numbers
sampled = capture_step(lambda x: dropout(model(x)))
x = torch.randn(4, 16, device="cuda")
sampled(x), sampled(x)

def step(x):
    y = model(x)
    return y[y.sum() > 0]  # a shape that depends on data

captured = capture_step(step)
captured(torch.randn(4, 16, device="cuda"))
with pytest.raises(CaptureError, match="cannot be captured"):
    captured(torch.randn(4, 16, device="cuda"))
assert torch.cuda.current_stream() == torch.cuda.default_stream()
assert not torch.cuda.is_current_stream_capturing()
assert torch.randn(4, device="cuda").isfinite().all()
assert torch.equal(model.weight @ torch.eye(16, device="cuda"), model.weight)
# The allocator left the failed graph's pool: freed memory goes back to the device.
big = torch.empty(1 << 28, device="cuda")
reserved = torch.cuda.memory_reserved()
del big
torch.cuda.empty_cache()
assert torch.cuda.memory_reserved() <= reserved - (1 << 30)
# The graph captured before the failure replays, and manual_seed still reaches it.
torch.manual_seed(0)
first = sampled(x)
torch.manual_seed(0)
assert torch.equal(sampled(x), first) and not torch.equal(sampled(x), first)
print("device usable")
"""


@gpu_only
def test_a_host_synchronisation_in_the_step_raises_a_capture_error():
    proc = subprocess.run([sys.executable, "-c", _FAILED_CAPTURE], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().endswith("device usable")


@gpu_only
def test_an_optimizer_with_its_step_count_on_the_host_is_refused():
    model = torch.nn.Linear(16, 16).cuda()
    opt = torch.optim.Adagrad(model.parameters(), lr=0.1)

    def step(x):
        model(x).sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    with pytest.raises(CaptureError, match="Adagrad keeps step on the CPU"):
        capture_step(step)(torch.randn(4, 16, device="cuda"))
