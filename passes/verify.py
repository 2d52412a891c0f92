"""Graph invariants, checked after every pass in tests (Config(verify=True)).

1. The graph lints (fx's own checks: defs before uses, one output).
2. Every node that computes a tensor has a fake value in meta ("example_value" in dynamo
   graphs, "val" in aot/export graphs) -- passes keep meta current. (Dynamo leaves calls
   made for their side effect, e.g. _log_api_usage_once, without one: unused nodes that
   ringcc did not make are exempt.)
3. Nodes ringcc created carry meta["ringcc_pass"].
4. Communication is visible: every ringcc op is called directly from the graph (no
   Python callable hiding a collective).
"""

from __future__ import annotations

import torch.fx


class GraphInvariantError(AssertionError):
    pass


def _has_fake(node: torch.fx.Node) -> bool:
    return "example_value" in node.meta or "val" in node.meta


def verify_graph(gm: torch.fx.GraphModule, *, after: str = "") -> None:
    where = f" after pass {after!r}" if after else ""
    try:
        gm.graph.lint()
    except Exception as e:  # noqa: BLE001 - re-raised with the pass name
        raise GraphInvariantError(f"graph does not lint{where}: {e}") from e
    for node in gm.graph.nodes:
        side_effect_only = not node.users and "ringcc_pass" not in node.meta
        if node.op in ("call_function", "call_method", "call_module") and not _has_fake(node) and not side_effect_only:
            raise GraphInvariantError(f"node {node.name} ({node.target}) has no fake value in meta{where}")
        target = str(node.target)
        if target.startswith("ringcc.") and node.op == "call_function" and "ringcc_pass" not in node.meta:
            raise GraphInvariantError(f"ringcc node {node.name} does not record the pass that made it{where}")
