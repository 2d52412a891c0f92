"""The sharding passes' custom ops (runtime/seqops.py): opcheck at p = 1, the owner of a
token in each layout (tier 2), and the sequence cumsum on gloo ranks against torch.cumsum."""

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
    torch.library.opcheck(seqops.seq_cumsum, (x, 1, False, "", 1, "zigzag"))
    torch.library.opcheck(seqops.seq_cumsum, (x, 1, True, "", 1, "contiguous"))


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


def case_cumsum(rank, world):
    """ringcc::seq_cumsum on this rank's rows equals this rank's rows of torch.cumsum over all
    n, in both layouts; its gradient too (float), and integer masks sum in int64 as torch's."""
    import torch.distributed as dist

    group = dist.group.WORLD.group_name
    n = 4 * world
    x = torch.randn(2, n, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    g = torch.randn(2, n, 3, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    mask = torch.ones(2, n, dtype=torch.long)
    mask[1, n - 3:] = 0
    for layout in ("contiguous", "zigzag"):
        lay = L.Layout(layout)
        local = L.shard(x, 1, rank, world, lay).requires_grad_()
        out = seqops.seq_cumsum(local, 1, False, group, world, layout)
        torch.testing.assert_close(out, L.shard(x.cumsum(1), 1, rank, world, lay))
        out.backward(L.shard(g, 1, rank, world, lay))
        torch.testing.assert_close(local.grad, L.shard(g.flip(1).cumsum(1).flip(1), 1, rank, world, lay))
        ids = seqops.seq_cumsum(L.shard(mask, 1, rank, world, lay), 1, False, group, world, layout)
        assert ids.dtype == torch.int64 and torch.equal(ids, L.shard(mask.cumsum(1), 1, rank, world, lay))
    return True


@pytest.mark.parametrize("world", [2, 4])
def test_sequence_cumsum_matches_torch(pools, world):
    assert all(pools(world).run(case_cumsum))


def case_positions(rank, world, name="Positions"):
    """A model of test_shard_sequence that needs the rules above (Positions: position features;
    CustomFunction: Bloom's GELU as an autograd.Function), compiled with ringcc: its output and
    every gradient equal eager's, with no gather."""
    import ringcc
    import test_shard_sequence

    torch.manual_seed(0)
    ref, model = getattr(test_shard_sequence, name)(), getattr(test_shard_sequence, name)()
    model.load_state_dict(ref.state_dict())
    x = torch.randn(2, 4 * world, 16, generator=torch.Generator().manual_seed(2))
    r = torch.randn(2, 4 * world, 16, generator=torch.Generator().manual_seed(3))
    torch._dynamo.reset()
    ringcc.reset_reports()
    out = torch.compile(model, backend=ringcc.backend(inner="aot_eager"))(x)
    (out * r).sum().backward()
    (ref(x) * r).sum().backward()
    assert all(rep.gathers == [] for rep in ringcc.reports())
    torch.testing.assert_close(out.full_tensor(), ref(x), atol=1e-5, rtol=1e-5)
    grads = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, atol=1e-5, rtol=1e-5)
    return True


@pytest.mark.parametrize("name", ["Positions", "CustomFunction"])
def test_token_local_models_on_shards_match_eager(pools, name):
    assert all(pools(2).run(case_positions, name, timeout=300))
