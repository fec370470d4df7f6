import torch
import triton

import tritonformer as tf
from tritonformer import runtime


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


def test_tuning_kept_on_disk_except_by_the_tests(monkeypatch):
    # The suite's workers time configs against each other on one GPU: conftest keeps their
    # choices from later processes; everywhere else a second process reuses the first's.
    assert not runtime.KEEP_TUNING
    seen = {}
    monkeypatch.setattr(triton, "autotune", lambda **kwargs: seen.update(kwargs))
    monkeypatch.setattr(runtime, "INTERPRET", False)
    for keep in (True, False):
        monkeypatch.setattr(runtime, "KEEP_TUNING", keep)
        runtime.autotune([triton.Config({})], key=[])
        assert seen["cache_results"] is keep
