"""Find the sequence: its length n (from the attention sites) and the graph inputs carrying it.

n is q's length (dim 2) at the ring attention sites; every site must agree. A graph without
attention (a model's head compiled on its own) is sharded when inputs are marked with
`ringcc.mark_sequence(x, dim)`: their marked dim's size is n. Under dynamic
shapes n is a symbol and a dim carries the sequence iff its size *is* that expression; with
constant sizes an input dim of size n is taken when it is the input's one such dim. An input
with several (a batch, head or feature dim equal to n) is ambiguous: `ringcc.mark_sequence(x,
dim)` or `Config(seq_dim=...)` says which, else shard_sequence traces which of them becomes
attention's sequence dim (Note [Ambiguous inputs] there) and stops with an error when it cannot
tell. Parameters and buffers are never sources here; buffers sliced to n (BERT's position ids)
and factories (arange) become sources during propagation, where the shape flow decides, and
anything the walk misses is picked up where it meets a shard (see shard_sequence.py).

Writes ctx.scratch["seq"]: SeqInfo(n, sources={placeholder name: dim}, ambiguous={placeholder
name: candidate dims}).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import sympy
import torch
import torch.fx

from ringcc import _compat
from ringcc.mark import marked_dim

from .base import PassContext, PassResult

PASS = "discover_sequence"
ATTENTION_OPS = ("ring_attention", "dilated_attention")


@dataclass
class SeqInfo:
    n: sympy.Expr  # global sequence length (an integer or a symbol expression)
    sources: dict[str, int] = field(default_factory=dict)  # placeholder name -> sequence dim
    ambiguous: dict[str, list[int]] = field(default_factory=dict)  # placeholder name -> dims of size n


def fake(node):
    if isinstance(node, torch.fx.Node):
        return node.meta.get("example_value", node.meta.get("val"))
    return node


def expr(size) -> sympy.Expr:
    """A size (int or SymInt) as a sympy expression, without installing guards."""
    if isinstance(size, sympy.Basic):
        return size
    if isinstance(size, torch.SymInt):
        return sympy.sympify(size.node.expr)
    return sympy.Integer(int(size))


def same(a, b) -> bool:
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    return sympy.expand(expr(a) - expr(b)) == 0


def attention_nodes(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function"
            and isinstance(n.target, _compat.OpOverload) and n.target.namespace == "ringcc"
            and n.target._opname in ATTENTION_OPS]


def discover_sequence(gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
    sites = attention_nodes(gm)
    placeholders = [p for p in gm.graph.nodes if p.op == "placeholder"]
    inputs = list(ctx.example_inputs) if len(ctx.example_inputs) == len(placeholders) else [None] * len(placeholders)
    if sites:
        lengths = {expr(fake(s.args[0]).shape[2]) for s in sites}
        if len(lengths) != 1:
            raise ValueError(
                f"attention sites in one graph attend over different lengths {sorted(map(str, lengths))}; "
                "ringcc shards one sequence per graph: compile the parts separately or set Config(shard=False)")
    else:
        # No attention (a model's head compiled on its own): the inputs marked with
        # ringcc.mark_sequence say the sequence and its length.
        lengths = {expr(fake(node).shape[marked_dim(real)]) for node, real in zip(placeholders, inputs)
                   if marked_dim(real) is not None and isinstance(fake(node), torch.Tensor)}
        if len(lengths) > 1:
            raise ValueError(f"inputs marked with ringcc.mark_sequence have different lengths {sorted(map(str, lengths))} "
                             "at their marked dims; ringcc shards one sequence per graph")
        if not lengths:
            ctx.scratch.pop("seq", None)
            return PassResult(False)
    n = lengths.pop()
    info = SeqInfo(n=n)
    for node, real in zip(placeholders, inputs):
        val = fake(node)
        if not isinstance(val, torch.Tensor) or isinstance(real, torch.nn.Parameter) or "_buffers_" in node.name:
            continue
        dim = _input_dim(node, val, real, n, ctx)
        if isinstance(dim, list):
            info.ambiguous[node.name] = dim
        elif dim is not None:
            info.sources[node.name] = dim
    ctx.scratch["seq"] = info
    return PassResult(False)


def _input_dim(node, val, real, n, ctx) -> int | list[int] | None:
    """The input's sequence dim; None: it has none; a list: several candidates."""
    dim = marked_dim(real) if real is not None else None
    if dim is None and ctx.config.seq_dim is not None:
        dim = ctx.config.seq_dim
        if val.dim() <= (dim if dim >= 0 else -dim - 1) or not same(val.shape[dim], n):
            return None  # Config.seq_dim names the token inputs' dim; other inputs do not carry n
    if dim is not None:
        dim %= val.dim()
        if not same(val.shape[dim], n):
            raise ValueError(
                f"input {node.name} is marked with sequence dim {dim}, whose size is {val.shape[dim]}, "
                f"but the attention sites attend over n={n}; mark the dim of length {n}")
        return dim
    dims = [d for d in range(val.dim()) if same(val.shape[d], n)]
    if not dims:
        return None
    return dims[0] if len(dims) == 1 else dims
