"""record_tokens, a decode step's bookkeeping in one launch: its bad input (the registry's cases
check every state tensor against the torch launches it replaces)."""

import pytest
import torch

import tritonformer  # noqa: F401  (before triton: picks the interpreter)
from tritonformer.cases.decode_linear import decode_state
from tritonformer.ops.record_tokens import record_tokens


def test_record_tokens_names_bad_input(device):
    state = decode_state(device, 3, capacity=8, step=0, eos=(1,))
    picked = torch.zeros(3, dtype=torch.long, device=device)
    with pytest.raises(ValueError, match="picked must be a torch.int64"):
        record_tokens(picked.int(), state, True)
    with pytest.raises(ValueError, match="lengths must be a torch.int32"):
        record_tokens(picked, state._replace(lengths=state.lengths.long()), True)
    with pytest.raises(ValueError, match="done must be a torch.bool tensor of shape"):
        record_tokens(picked, state._replace(done=state.done[:2]), True)
    with pytest.raises(ValueError, match="eos must hold at least one id"):
        record_tokens(picked, state._replace(eos=state.eos[:0]), True)
