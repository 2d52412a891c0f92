"""Find the sequence: its length n (from the attention sites) and the graph inputs carrying it.

n is q's length (dim 2) at the ring attention sites; every site must agree. A graph without
attention (a model's head compiled on its own) is sharded when inputs are marked with
`ringcc.mark_sequence(x, dim)` (their marked dim's size is n), or when it reads the sharded
outputs of another ringcc graph (their length: Note [Sharded outputs]). Under dynamic
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


def handoff_gathers(gm: torch.fx.GraphModule, ctx: PassContext) -> list[torch.fx.Node]:
    """`ringcc::gather` of a graph input for this graph's group: what dynamo traces when a
    SequenceSharded output of another ringcc graph is read here (Note [Sharded outputs]). Its
    int arguments are the wrapper's attributes, which dynamo may trace as nodes (symbolic under
    dynamic shapes; `constant_ints` makes them ints)."""
    return [n for n in gm.graph.nodes if n.target is torch.ops.ringcc.gather.default
            and n.args[0].op == "placeholder" and n.args[2] == ctx.group_name
            and constant_int(n.args[3]) == ctx.world_size and ctx.world_size > 1]


def constant_int(arg) -> int | None:
    """The int that a graph argument stands for: an int, or a node whose value is an int or a
    SymInt (specialized to its value: a guard, so the graph is reused only where it holds);
    None for anything else."""
    val = fake(arg) if isinstance(arg, torch.fx.Node) else arg
    if isinstance(val, torch.SymInt):
        return int(val)
    return val if isinstance(val, int) and not isinstance(val, bool) else None


def constant_ints(gm: torch.fx.GraphModule) -> bool:
    """Replace the int arguments (dim, world size) of the graph's `ringcc::gather` nodes that
    dynamo traced as nodes by their ints; whether any changed."""
    changed = False
    for node in gm.graph.nodes:
        if node.target is not torch.ops.ringcc.gather.default:
            continue
        for i in (1, 3):
            arg = node.args[i]
            if isinstance(arg, torch.fx.Node):
                value = constant_int(arg)
                if value is None:
                    raise ValueError(f"ringcc: {node.format_node()} takes argument {i} from {arg.format_node()}, "
                                     f"whose value {fake(arg)!r} is no int; a SequenceSharded value's dim and world "
                                     "size are ints")
                node.update_arg(i, value)
                changed = True
    return changed


def discover_sequence(gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
    modified = constant_ints(gm)
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
        lengths |= {expr(fake(g).shape[g.args[1]]) for g in handoff_gathers(gm, ctx)}
        if len(lengths) > 1:
            raise ValueError(f"inputs marked with ringcc.mark_sequence have different lengths {sorted(map(str, lengths))} "
                             "at their marked dims; ringcc shards one sequence per graph")
        if not lengths:
            ctx.scratch.pop("seq", None)
            return PassResult(modified)
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
    return PassResult(modified)


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
