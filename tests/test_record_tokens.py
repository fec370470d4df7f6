"""record_tokens, a decode step's bookkeeping in one launch, against the torch it replaces."""

import pytest
import torch

import tritonformer  # noqa: F401  (before triton: picks the interpreter)
from tritonformer.ops.record_tokens import DecodeState, record_tokens, record_tokens_reference


def _state(device, B, capacity, step, eos, pad=0):
    g = torch.Generator().manual_seed(B * 100 + step)
    out = torch.randint(0, 50, (B, capacity), generator=g)
    done = torch.rand(B, generator=g) < 0.3
    finished_at = torch.where(done, torch.randint(0, step + 1, (B,), generator=g), torch.full((B,), capacity))
    tokens = torch.randint(0, 50, (B,), generator=g)
    positions = torch.randint(0, 500, (B,), generator=g)
    lengths = (positions + 1).int()
    return DecodeState(*(t.to(device) for t in (out, done, finished_at, tokens, positions, lengths)),
                       torch.tensor([step], device=device), torch.tensor(eos, device=device),
                       torch.tensor(pad, device=device))


@pytest.mark.parametrize("B,eos,advance", [(1, (-1,), True), (7, (3, 5), True), (33, (3, 5, 7), False)])
def test_record_tokens_matches_torch(device, B, eos, advance):
    """Every state tensor as the ten torch launches leave it: pads after a sequence finished,
    finishing on any eos id (not again once done), the step and positions advanced."""
    state = _state(device, B, capacity=12, step=4, eos=eos, pad=2)
    # Every third token an eos id (where there is one), so that some sequences finish now.
    picked = torch.randint(0, 10, (B,), generator=torch.Generator().manual_seed(B)).to(device)
    picked[::3] = eos[0] if eos[0] >= 0 else 0
    expected = DecodeState(*(t.clone() for t in state))
    record_tokens_reference(picked, expected, advance)
    record_tokens(picked, state, advance)
    for name, got, want in zip(DecodeState._fields, state, expected):
        assert torch.equal(got, want), name


def test_record_tokens_names_bad_input(device):
    state = _state(device, 3, capacity=8, step=0, eos=(1,))
    picked = torch.zeros(3, dtype=torch.long, device=device)
    with pytest.raises(ValueError, match="picked must be a torch.int64"):
        record_tokens(picked.int(), state, True)
    with pytest.raises(ValueError, match="lengths must be a torch.int32"):
        record_tokens(picked, state._replace(lengths=state.lengths.long()), True)
    with pytest.raises(ValueError, match="done must be a torch.bool tensor of shape"):
        record_tokens(picked, state._replace(done=state.done[:2]), True)
    with pytest.raises(ValueError, match="eos must hold at least one id"):
        record_tokens(picked, state._replace(eos=state.eos[:0]), True)
