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
