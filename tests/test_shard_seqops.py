"""The sharding passes' custom ops (runtime/seqops.py): opcheck at p = 1, and the owner of
a token in each layout (tier 2)."""

import pytest
import torch

from ringcc.runtime import layout as L
from ringcc.runtime import seqops


def test_opcheck():
    x = torch.randn(2, 6, 4, requires_grad=True)
    g = torch.randn(2, 4)
    torch.library.opcheck(seqops.all_reduce_sum, (x, "", 1))
    torch.library.opcheck(seqops.seq_select, (x, 1, -1, "", 1, "contiguous"))
    torch.library.opcheck(seqops.seq_select_backward, (g, 1, 2, 6, "", 1, "zigzag"))
    ws = [torch.randn(3, 4, requires_grad=True), torch.randn(5, requires_grad=True)]
    torch.library.opcheck(seqops.sync_grads, (ws, "", 1))
    torch.library.opcheck(seqops.all_reduce_bucket, ([w.detach() for w in ws], "", 1))


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_token_owner_matches_the_layout(world, layout):
    n = 24
    tokens = torch.arange(n)
    for index in (0, 5, n - 1, -1, -7):
        owners = []
        for rank in range(world):
            local = L.shard(tokens, 0, rank, world, L.Layout(layout))
            row = seqops._owner(index, n // world, world, rank, layout)
            if row is not None:
                owners.append(rank)
                assert int(local[row]) == index % n
        assert len(owners) == 1


def test_select_backward_puts_the_cotangent_on_its_row():
    g = torch.randn(2, 4)
    out = seqops.seq_select_backward(g, 1, -2, 6, "", 1, "contiguous")
    assert torch.equal(out[:, 4], g) and out[:, :4].abs().sum() == 0 and out[:, 5].abs().sum() == 0
