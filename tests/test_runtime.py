import torch

import tritonformer as tf


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

