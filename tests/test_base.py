"""Helpers shared by the passes (passes/base.py)."""

import operator

import torch
import torch.fx

from ringcc.passes.base import remove_dead


def test_dead_code_keeps_in_place_writes_and_drops_an_unused_logical_and():
    """`a & b` is operator.and_ (the trailing _ avoids a keyword, it writes nothing): unused,
    it goes (Hugging Face builds mask functions with it that no layer reads: an n x n value
    otherwise); `a &= b` (operator.iand) writes `a` and stays."""
    graph = torch.fx.Graph()
    a, b = graph.placeholder("a"), graph.placeholder("b")
    graph.call_function(operator.and_, (a, b))
    graph.call_function(operator.or_, (a, b))
    graph.call_function(operator.iand, (a, b))
    graph.output(a)
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    remove_dead(gm)
    assert [n.target for n in gm.graph.nodes if n.op == "call_function"] == [operator.iand]
