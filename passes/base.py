"""The one pass contract.

A pass is `fn(gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult`. It edits `gm` in
place, keeps the graph invariants (functional graph, node meta current, communication as
visible ops), records its decisions in `ctx.report`, tags every node it creates with
`meta["ringcc_pass"]` (its name) and `meta["ringcc_from"]` (the node it replaces), does no
I/O and makes no process-group calls. Running a pass twice changes nothing the second time.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch.fx

from ringcc.config import Config
from ringcc.report import GraphReport


@dataclass
class PassContext:
    config: Config
    report: GraphReport
    world_size: int  # p the graph is rewritten for
    group_name: str  # "" when p = 1 without a process group
    example_inputs: list = field(default_factory=list)
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
