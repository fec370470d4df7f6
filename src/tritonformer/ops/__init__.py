"""One module per op: its kernels, launcher, autograd Function, reference and registry entry."""
