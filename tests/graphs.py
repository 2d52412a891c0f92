"""Capture dynamo / export graphs for structural pass tests, and run passes on them."""

from __future__ import annotations

import torch

from ringcc.config import Config
from ringcc.passes.base import PassContext
from ringcc.passes.pipeline import run_pipeline
from ringcc.report import GraphReport


def dynamo_graph(fn, *inputs, with_inputs: bool = False):
    """The (single) torch-level graph dynamo hands a backend for fn(*inputs) (and the
    example inputs it was given, in placeholder order, when with_inputs)."""
    graphs = []

    def capture(gm, example_inputs):
        graphs.append((gm, list(example_inputs)))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=capture, fullgraph=True)(*inputs)
    assert len(graphs) == 1
    return graphs[0] if with_inputs else graphs[0][0]


def export_graph(module, *inputs) -> torch.fx.GraphModule:
    return torch.export.export(module, inputs).graph_module


def make_ctx(config: Config | None = None, world_size: int = 1) -> PassContext:
    config = config or Config(verify=True)
    return PassContext(config=config, report=GraphReport(graph="test", world_size=world_size),
                       world_size=world_size, group_name="0" if world_size > 1 else "")


def run(gm, passes, config: Config | None = None, world_size: int = 1) -> PassContext:
    ctx = make_ctx(config, world_size)
    run_pipeline(gm, ctx, passes)
    return ctx


def targets(gm) -> list:
    return [n.target for n in gm.graph.nodes if n.op in ("call_function", "call_method")]


def node_values(gm, *inputs) -> dict:
    """Every node's value when gm runs on `inputs` (real tensors)."""
    values = {}

    class Record(torch.fx.Interpreter):
        def run_node(self, n):
            values[n] = super().run_node(n)
            return values[n]

    Record(gm).run(*inputs)
    return values


def lifted_dense(lifted, values: dict, batch: int, n: int) -> torch.Tensor:
    """The bool [batch, 1, n, n] mask a LiftedMask says (its function read at every position,
    its inputs' values from `values`)."""
    i = torch.arange(n)
    got = torch.ones(batch, 1, n, n, dtype=torch.bool)
    if lifted.fn is not None:
        got = got & lifted.fn(torch.arange(batch)[:, None, None, None], torch.zeros(1, 1, 1, 1, dtype=torch.long),
                              i[None, None, :, None], i[None, None, None, :],
                              tuple(values[t] for t in lifted.fn_inputs))
    if lifted.causal:
        got = got & (i[None, :] <= i[:, None])
    if lifted.window is not None:
        d = i[:, None] - i[None, :]
        got = got & ((d < lifted.window) if lifted.causal else (d.abs() < lifted.window))
    if lifted.key_valid is not None:
        got = got & values[lifted.key_valid][:, None, None, :]
    return got
