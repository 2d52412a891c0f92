"""discover_sequence on graphs dynamo traces from a SequenceSharded input (one process: the
graphs are captured, not run)."""

import pytest
import torch

from ringcc.config import Config
from ringcc.passes.base import PassContext
from ringcc.passes.discover_sequence import discover_sequence, fake, handoff_gathers, same
from ringcc.report import GraphReport
from ringcc.sharded import SequenceSharded


class Captured(Exception):
    pass


def captured_graph(fn, *args, **compile_kwargs):
    """dynamo's graph of fn(*args) and its example inputs, as the backend receives them."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append((gm, list(example_inputs)))
        raise Captured

    torch._dynamo.reset()
    with pytest.raises(Exception) as info:  # dynamo wraps the backend's exception
        torch.compile(fn, backend=backend, **compile_kwargs)(*args)
    assert graphs, info.value
    return graphs[0]


@pytest.mark.parametrize("dynamic", [False, True])
def test_a_handoff_whose_dim_dynamo_traces_as_a_node_is_read_as_its_int(dynamic):
    """The head after the last block (whole-model compile under FSDP2) reads the block's
    SequenceSharded output; under dynamic shapes dynamo traces the wrapper's dim as a SymInt
    node. The hand-off is found, its length read, and the gather's dim is an int again."""
    local = torch.randn(2, 3, 4, 5)
    x = SequenceSharded(local, 2, "0", 2, "contiguous")  # [2, 3, 8, 5]: the sequence in dim 2

    gm, inputs = captured_graph(lambda x: (x * 2).sum(-1), x, dynamic=dynamic)
    gathers = [n for n in gm.graph.nodes if n.target is torch.ops.ringcc.gather.default]
    assert len(gathers) == 1
    assert isinstance(gathers[0].args[1], torch.fx.Node) == dynamic  # the case that needs reading
    ctx = PassContext(config=Config(), report=GraphReport(graph="g", world_size=2), world_size=2,
                      group_name="0", example_inputs=inputs)
    result = discover_sequence(gm, ctx)
    assert result.modified == dynamic
    assert handoff_gathers(gm, ctx) == gathers and gathers[0].args[1] == 2 and gathers[0].args[3] == 2
    n = ctx.scratch["seq"].n  # the global length: 2 x the shard's rows
    local_rows = fake(gathers[0].args[0]).shape[2]
    assert same(n, 2 * local_rows) and (n == 8) == (not dynamic)
