"""Graph invariants, checked after every pass in tests (Config(verify=True)).

1. The graph lints (fx's own checks: defs before uses, one output).
2. Every node that computes a tensor has a fake value in meta ("example_value" in dynamo
   graphs, "val" in aot/export graphs) -- passes keep meta current. (Dynamo leaves calls
   made for their side effect, e.g. _log_api_usage_once, without one: unused nodes that
   ringcc did not make are exempt.)
3. Nodes ringcc created carry meta["ringcc_pass"].
4. Communication is visible: every ringcc op is called directly from the graph (no
   Python callable hiding a collective).
5. Every ringcc.ring_attention / dilated_attention node keeps the attention contract: 4-D
   q [b, h, n, d] and k / v [b, h_kv, n, d] with h % h_kv == 0, key_valid None or a bool
   [b, n] value, and only getitem users (0: output, 1: LSE).
6. Every value shard_sequence made that requires grad and feeds work on shards carries its
   sequence state (meta["ringcc_seq"]): sync_param_grads reads a stateless value there as a
   replicated weight and all-reduces its cotangent, which for a shard is wrong.
"""

from __future__ import annotations

import operator

import torch
import torch.fx

from .shard_sequence import PASS as SHARD_PASS, STATE_META
from .sync_param_grads import computes_on_shards


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
        if node.meta.get("ringcc_pass") == SHARD_PASS and STATE_META not in node.meta and \
                getattr(_fake(node), "requires_grad", False) and any(computes_on_shards(u) for u in node.users):
            raise GraphInvariantError(f"node {node.name} made by {SHARD_PASS} feeds work on shards without a "
                                      f"sequence state{where}")
        if target.startswith(("ringcc.ring_attention.", "ringcc.dilated_attention.")):
            problem = _attention_contract(node)
            if problem:
                raise GraphInvariantError(f"attention op {node.name}: {problem}{where}")


def _fake(x):
    return x.meta.get("example_value", x.meta.get("val")) if isinstance(x, torch.fx.Node) else None


def _attention_contract(node: torch.fx.Node) -> str:
    q, k, v = (_fake(a) for a in node.args[:3])
    if not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (q, k, v)):
        return "q / k / v are not 4-D tensors"
    h, g = q.shape[1], k.shape[1]
    if isinstance(h, int) and isinstance(g, int) and (h % g or k.shape[1] != v.shape[1]):
        return f"q has {h} heads, k / v {g} / {v.shape[1]}: not a GQA grouping"
    if "ring_attention" in str(node.target) and node.args[3] is not None:
        kv = _fake(node.args[3])
        if not isinstance(kv, torch.Tensor) or kv.dtype != torch.bool or kv.dim() != 2:
            return "key_valid is not a bool [b, n] tensor"
    if any(u.target is not operator.getitem for u in node.users):
        return "used other than through getitem"
    return ""
