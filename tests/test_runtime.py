from types import SimpleNamespace

import torch
import triton
import triton.language as tl

import tritonformer as tf
from tritonformer import runtime

from conftest import gpu_only


def test_backward_replays_products_planned_in_the_forward_thread(device):
    # The autograd engine runs backward on threads of its own, where no CUDA context need be
    # current: the backward's two products (dout b^T, a^T dout), planned here by forward calls of
    # the same signatures, replay there, and their host-made tensor descriptors need one.
    a = torch.randn(64, 64, device=device, requires_grad=True)
    b = torch.randn(64, 64, device=device, requires_grad=True)
    dout = torch.randn(64, 64, device=device)
    tf.matmul(dout, b.detach().mT), tf.matmul(a.detach().mT, dout)
    # Blocks of these sizes wait in the caching allocator: the backward's allocations make no
    # CUDA call (one would bind a context as a side effect).
    cached = [torch.empty(64, 64, device=device) for _ in range(8)]
    del cached
    da, db = torch.autograd.grad(tf.matmul(a, b), (a, b), dout)
    torch.testing.assert_close(da, dout @ b.detach().T, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(db, a.detach().T @ dout, rtol=1e-2, atol=1e-2)



@gpu_only
def test_replays_go_to_the_c_launcher_with_each_address_encoded_once():
    """A replayed launch skips Triton's Python layers around the compiled C launcher, and its
    tensor descriptors are encoded once for each address, shape and strides. Operands at one
    address with other row counts or other strides, and new contents there, must each be read
    as they are."""
    from tritonformer.ops import matmul as matmul_op

    big = torch.randn(384, 256, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(256, 128, device="cuda", dtype=torch.bfloat16)
    views = [big[:256], big[:384], big[:256], big[:320], big.view(256, 384)[:, :256], big[:256]]
    for step, a in enumerate(views):
        if step == len(views) - 1:
            big.copy_(torch.randn_like(big))
        torch.testing.assert_close(tf.matmul(a, b), a @ b, rtol=2e-2, atol=2e-2)
    direct = [entry[3] for entry in matmul_op._launch_matmul.launch.entries.values()]
    assert None not in direct and any(len(d[1]) == 2 for d in direct)  # the TMA kernel's two
    keys = [key for key in runtime._encoded_descriptors if key[1] == big.data_ptr()]
    assert {(key[2][1], key[3][1]) for key in keys} == {(256, 256), (320, 256), (384, 256), (256, 384)}


def test_cuda_context_bound_once_a_thread_and_device(monkeypatch):
    # A thread that launches on device 0, then on device 1, needs device 1's context bound too
    # (the binding used to be once a thread, whatever the device).
    import threading

    queried = []

    class Stream:
        def __init__(self, device):
            self.device = device

        def query(self):
            queried.append(self.device)

    monkeypatch.setattr(torch.cuda, "current_stream", Stream)

    def launches():
        for device in (0, 0, 1, 0, 1):
            runtime._bind_cuda_context(device)

    thread = threading.Thread(target=launches)  # a fresh thread: nothing bound yet
    thread.start()
    thread.join()
    assert queried == [0, 1]


@triton.jit
def _tuned_stand_in(x_ptr, BLOCK: tl.constexpr):
    pass


def test_tuning_times_candidates_as_launched_in_rounds_and_keeps_the_choice(monkeypatch, tmp_path):
    """Each candidate is timed with fitted(config)'s arguments; the three fastest of the first
    round are timed twice more, and the median of their rounds decides, not one timing. The
    times are kept on disk for a later process, which then compiles the choice alone, unless
    KEEP_TUNING is off (the test workers')."""
    from triton.runtime.jit import JITFunction

    fn = _tuned_stand_in if isinstance(_tuned_stand_in, JITFunction) else JITFunction(_tuned_stand_in.fn)
    monkeypatch.setattr(runtime, "INTERPRET", False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *args: "a test GPU")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(runtime.TunedLauncher, "instances", [])
    candidates = [triton.Config({"BLOCK": block}) for block in (1, 2, 3, 4)]
    # by BLOCK: the round times; 2 is fastest once and slowest at the median
    rounds = {1: [5.0], 2: [3.0, 9.0, 9.0], 3: [4.0, 4.0, 4.0], 4: [3.5, 3.6, 3.4]}
    fitted_for, timed = [], []

    def fitted(config):
        fitted_for.append(config["BLOCK"])
        return (torch.empty(1),), {"fitted": True}

    def bench(launch):
        block = fitted_for[-1]
        timed.append(block)
        return rounds[block][timed.count(block) - 1]

    monkeypatch.setattr(runtime, "_tuning_bench", bench)

    def call(keep):
        """(BLOCK launched, the BLOCKs compiled) of a fresh process's first call."""
        monkeypatch.setattr(runtime, "KEEP_TUNING", keep)
        launcher = runtime.TunedLauncher(SimpleNamespace(fn=fn, configs=candidates, early_config_prune=None))
        compiled = []
        launcher._compile_candidates = lambda key, grid, configs, *rest: compiled.extend(
            c.kwargs["BLOCK"] for c in configs)
        launcher.launch = lambda grid, *args, **kwargs: (args, kwargs)
        timed.clear()
        (args, kwargs), grid = launcher(("key",), lambda config: (1,), torch.empty(1), fitted=fitted)
        assert kwargs["fitted"] and grid == (1,)
        return kwargs["BLOCK"], compiled

    assert call(keep=True) == (4, [1, 2, 3, 4])
    assert timed == [1, 2, 3, 4, 2, 4, 3, 2, 4, 3]
    assert call(keep=True) == (4, [4]) and timed == []  # read back: not timed, the choice compiled alone
    assert call(keep=False) == (4, [1, 2, 3, 4]) and len(timed) == 10  # timed again
