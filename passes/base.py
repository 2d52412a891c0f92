"""The one pass contract.

A pass is `fn(gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult`. It edits `gm` in
place, keeps the graph invariants (functional graph, node meta current, communication as
visible ops), records its decisions in `ctx.report`, tags every node it creates with
`meta["ringcc_pass"]` (its name) and `meta["ringcc_from"]` (the node it replaces), does no
I/O and makes no process-group calls. Running a pass twice changes nothing the second time.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any, Callable

import torch.fx

from ringcc import _compat
from ringcc.config import Config
from ringcc.report import GraphReport


@dataclass
class PassContext:
    config: Config
    report: GraphReport
    world_size: int  # p the graph is rewritten for
    group_name: str  # "" when p = 1 without a process group
    example_inputs: list = field(default_factory=list)
    # Graph inputs (by position) whose gradients a data-parallel engine outside the graph
    # averages over the whole sequence group (Note [Gradients under data parallelism]).
    outer_reduced: frozenset = frozenset()
    scratch: dict[str, Any] = field(default_factory=dict)  # facts passes hand to later passes


@dataclass(frozen=True)
class PassResult:
    modified: bool


Pass = Callable[[torch.fx.GraphModule, PassContext], PassResult]


def tag(node: torch.fx.Node, pass_name: str, origin: torch.fx.Node | None) -> torch.fx.Node:
    """Record which pass made `node` and from which node."""
    node.meta["ringcc_pass"] = pass_name
    if origin is not None:
        node.meta["ringcc_from"] = origin.name
        for key in ("stack_trace", "nn_module_stack", "source_fn_stack"):
            if key in origin.meta and key not in node.meta:
                node.meta[key] = origin.meta[key]
    return node


def location(node: torch.fx.Node) -> str:
    """The user's source line for a node ("file:line in fn"), from its stack trace."""
    trace = node.meta.get("stack_trace") or ""
    lines = [ln.strip() for ln in trace.strip().splitlines() if ln.strip().startswith("File ")]
    if not lines:
        return f"<{node.name}>"
    last = lines[-1]  # 'File "x.py", line 12, in forward'
    try:
        path = last.split('"')[1]
        rest = last.split('"', 2)[2].strip(", ")
        return f"{path.rsplit('/', 1)[-1]}:{rest.replace('line ', '').replace(', in ', ' in ')}"
    except IndexError:
        return last


def op_name(node: torch.fx.Node) -> str:
    """The op a node calls, by name: the method, the function's name, the aten op's name
    ("view", "softmax", ...), or "ringcc::<op>" for ringcc's own."""
    if node.op == "call_method":
        return node.target
    t = node.target
    if isinstance(t, _compat.OpOverload):
        return f"{t.namespace}::{t._opname}" if t.namespace == "ringcc" else t._opname
    return getattr(t, "__name__", str(t))


def attr_value(gm: torch.fx.GraphModule, target: str):
    """The object a get_attr node's (dotted) target names on gm."""
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


# Python's augmented assignments and item assignment: on a tensor they write its first argument.
_WRITING_OPERATORS = {operator.setitem, operator.iadd, operator.isub, operator.imul, operator.itruediv,
                      operator.ifloordiv, operator.imod, operator.ipow, operator.iand, operator.ior, operator.ixor,
                      operator.ilshift, operator.irshift, operator.imatmul}


def writes_in_place(user: torch.fx.Node, node: torch.fx.Node) -> bool:
    """Whether `user` writes `node`'s values in place: `x[...] = y` and `x op= y` (dynamo's
    setitem / iand, ...), an `x.op_()` method, an aten op whose first argument is written, or
    `out=node`."""
    if user.kwargs.get("out") is node:
        return True
    if not user.args or user.args[0] is not node:
        return False
    t = user.target
    if user.op == "call_method":
        return t.endswith("_") and not t.startswith("_") and t not in _NOT_WRITING_METHODS
    if user.op != "call_function":
        return False
    if t in _WRITING_OPERATORS:
        return True
    if getattr(t, "__module__", None) == "_operator":
        return False  # operator.and_ / or_: the trailing _ only avoids a keyword
    schema = getattr(t, "_schema", None)
    if schema is not None:
        first = schema.arguments[0] if schema.arguments else None
        return first is not None and first.alias_info is not None and first.alias_info.is_write
    name = getattr(t, "__name__", "")
    return name.endswith("_") and not name.startswith("_") and name not in _NOT_WRITING_METHODS


# `x.op_()` methods that change no values
_NOT_WRITING_METHODS = {"requires_grad_", "share_memory_", "pin_memory_", "record_stream_"}

# Ops whose result shares its input's storage (a write through it writes the input).
_VIEW_NAMES = {"view", "reshape", "view_as", "getitem", "narrow", "select", "slice", "transpose", "permute", "t",
               "expand", "expand_as", "unsqueeze", "squeeze", "flatten", "unflatten", "movedim", "swapaxes",
               "unbind", "split", "chunk", "as_strided", "detach", "alias", "diagonal", "unfold"}


def _aliases(node: torch.fx.Node) -> list[torch.fx.Node]:
    """`node` and the values that share its storage through view ops, transitively."""
    out, stack = [], [node]
    while stack:
        cur = stack.pop()
        if cur in out:
            continue
        out.append(cur)
        for u in cur.users:
            if u.op in ("call_method", "call_function") and u.args and u.args[0] is cur and op_name(u) in _VIEW_NAMES:
                stack.append(u)
    return out


def writes_any(node: torch.fx.Node) -> bool:
    """Whether `node` writes one of its inputs in place (dead-code elimination must keep it)."""
    if node.kwargs.get("out") is not None:
        return True
    return bool(node.args) and isinstance(node.args[0], torch.fx.Node) and writes_in_place(node, node.args[0])


def remove_dead(gm: torch.fx.GraphModule) -> None:
    """gm.graph.eliminate_dead_code, keeping nodes that write in place (FX counts method calls
    as pure, so an unused `x.masked_fill_(...)` would be removed) and the calls that enter and
    leave a torch.vmap level inlined by dynamo (unused results; without them the batched values
    between them have no level: HF Jamba's associative scan)."""
    levels = _compat.vmap_level_targets()
    gm.graph.eliminate_dead_code(
        is_impure_node=lambda n: n.is_impure() or writes_any(n) or (n.op == "call_function" and n.target in levels))


def is_view(node: torch.fx.Node) -> bool:
    """Whether `node`'s result shares its first argument's storage (a view op)."""
    return node.op in ("call_method", "call_function") and bool(node.args) and op_name(node) in _VIEW_NAMES


def written_through(node: torch.fx.Node) -> bool:
    """Whether some node writes `node`'s values in place, itself or through a view of it."""
    return any(writes_in_place(u, a) for a in _aliases(node) for u in a.users)


def written_between(node: torch.fx.Node, after: torch.fx.Node, before: torch.fx.Node) -> bool:
    """Whether some node strictly between `after` and `before` (graph order) writes `node` in
    place, itself or through a view of it: a value computed from it at `after` is then stale
    at `before`."""
    writers = {u for a in _aliases(node) for u in a.users if writes_in_place(u, a)}
    if not writers:
        return False
    cur = after.next
    while cur is not before and cur.op != "root":
        if cur in writers:
            return True
        cur = cur.next
    return False
