"""Activation-checkpoint regions that hold attention: inlined for the rewrite, then restored.

Dynamo traces `torch.utils.checkpoint.checkpoint(fn, ...)` as one higher-order op,
`tag_activation_checkpoint(body, *operands)`, whose body is a graph module of its own. The
passes after this one read the top-level graph only, so attention inside such a region would
be neither found nor rewritten: it would run dense on every rank, with the full sequence.

Note [Checkpoint regions]
A region is replaced by a copy of its body, each copied node tagged with its region (meta
REGION), so its attention sites are rewritten and its values sharded like any other (a region
left as it is is opaque: its inputs would be gathered to the full sequence around it).

Config.checkpoints="recompute" (the default) inlines every region, and the last pass,
`restore_checkpoints`, makes each a checkpoint op again, over a new body: the nodes from its
first tagged node to its last,
which takes in what the passes added among them (the ring op, gathers), less what needs nothing
of the region (a shard of an outer value, a key mask's runs table, constants), which is moved
before it and computed once. AOTAutograd then recomputes the region in backward, ring
attention included, as the user asked: per region only its inputs are kept. A region whose
nodes the passes interleaved with other code, or that writes an outer value in place, stays
inlined (a note and a warning name it). The memory plan counts a region's body as its
workspace (Note [Memory plan], 4).
"inline": the regions whose body holds attention that the rewrite can take (an SDPA call
without dropout, nn.MultiheadAttention's functional form, the encoder layer's fused path, or
softmax(...) @ v without dropout) are inlined, with the regions nested in them, and stay
inlined, their activations kept (O(n/p) per rank; a warning says so): more memory, no
recompute. Other regions stay checkpointed there (a softmax that feeds no matmul, such as a
mixture-of-experts gate, is not attention; attention with dropout in training is left as
written by the rewrite, so inlining it would only lose the recompute).
"keep": regions stay as they are, and the report names the
attention they hide (an error under Config(strict=True) or Config(require_linear_memory=True):
it runs dense on every rank).
"""

from __future__ import annotations

import operator
import warnings
from dataclasses import dataclass

import torch
import torch.fx
import torch.nn.functional as F

from .attention_form import SdpaCall, is_sdpa
from .base import PassContext, PassResult, attr_value, location, op_name, writes_any
from .shard_sequence import STATE_META

PASS = "inline_checkpoints"
RESTORE = "restore_checkpoints"
REGION = "ringcc_checkpoint_region"  # node meta: the inlined region a node came from
SCRATCH = "checkpoint_regions"  # ctx.scratch: region id -> _Region
HOP_NAME = "tag_activation_checkpoint"


def _is_checkpoint(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and getattr(node.target, "__name__", str(node.target)) == HOP_NAME


def _zero(p) -> bool:
    return isinstance(p, (int, float)) and not isinstance(p, bool) and p == 0


def _no_dropout(node: torch.fx.Node) -> bool:
    """A dropout node that drops nothing (p = 0, or not training)."""
    p = node.kwargs.get("p", node.args[1] if len(node.args) > 1 else 0.5)
    training = node.kwargs.get("training", node.args[2] if len(node.args) > 2 else True)
    return _zero(p) or training is False


_PASS_THROUGH = {"to", "type_as", "float", "half", "bfloat16", "contiguous", "_to_copy"}
_MATMULS = {"matmul", "bmm", "einsum", "baddbmm"}


def _feeds_matmul(softmax: torch.fx.Node) -> bool:
    """softmax(...) reaching a matmul through casts and dropouts that drop nothing."""
    stack = [softmax]
    while stack:
        node = stack.pop()
        for u in node.users:
            name = op_name(u)
            if name in _MATMULS:
                return True
            if name in _PASS_THROUGH or (name == "dropout" and _no_dropout(u)):
                stack.append(u)
    return False


def _holds_attention(gm: torch.fx.GraphModule) -> bool:
    """Whether the graph (or a graph module it calls) holds attention the rewrite can take."""
    for node in gm.graph.nodes:
        if node.op in ("call_function", "call_method"):
            name = op_name(node)
            if is_sdpa(node):
                if _zero(SdpaCall.of(node).dropout_p):
                    return True
            elif node.target is F.multi_head_attention_forward or "transformer_encoder_layer" in name:
                return True
            elif "softmax" in name and _feeds_matmul(node):
                return True
        if node.op == "get_attr":
            sub = attr_value(gm, node.target)
            if isinstance(sub, torch.fx.GraphModule) and _holds_attention(sub):
                return True
    return False


def _regions(gm: torch.fx.GraphModule, every: bool = False) -> list[torch.fx.Node]:
    """The checkpoint regions of gm whose body holds attention (every: all of them), and those
    nested in a region inlined before (REGION), which sharding could not see into either."""
    return [n for n in gm.graph.nodes if _is_checkpoint(n)
            and isinstance(n.args[0], torch.fx.Node) and n.args[0].op == "get_attr"
            and (every or REGION in n.meta or _holds_attention(attr_value(gm, n.args[0].target)))]


def _fresh_name(gm: torch.fx.GraphModule, base: str) -> str:
    i = 0
    while hasattr(gm, f"{base}_{i}"):
        i += 1
    return f"{base}_{i}"


def _inline(gm: torch.fx.GraphModule, node: torch.fx.Node, body: torch.fx.GraphModule, region: int) -> None:
    """Replace the region `node` by a copy of `body` (its placeholders bound to the operands),
    every copied node tagged with `region`; the region's getitem users read the copied outputs."""
    graph = gm.graph
    operands = list(node.args[1:])
    placeholders = [n for n in body.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(operands):
        raise ValueError(f"checkpoint region {node.name}: {len(operands)} operands for {len(placeholders)} inputs")
    env: dict[torch.fx.Node, object] = dict(zip(placeholders, operands))
    outputs = None
    with graph.inserting_before(node):
        for bn in body.graph.nodes:
            if bn.op == "placeholder":
                continue
            if bn.op == "output":
                outputs = torch.fx.node.map_arg(bn.args[0], lambda a: env[a])
                continue
            if bn.op == "get_attr":  # a nested region's body, or a constant: copied onto gm
                name = _fresh_name(gm, bn.target.replace(".", "_"))
                setattr(gm, name, attr_value(body, bn.target))
                env[bn] = graph.get_attr(name)
                env[bn].meta.update(bn.meta)
                env[bn].meta[REGION] = region
                continue
            new = graph.node_copy(bn, lambda a: env[a])
            new.meta.setdefault("ringcc_pass", PASS)
            new.meta[REGION] = region
            env[bn] = new
    outs = outputs if isinstance(outputs, (tuple, list)) else (outputs,)
    for user in list(node.users):
        if user.op == "call_function" and user.target is operator.getitem and isinstance(user.args[1], int):
            user.replace_all_uses_with(outs[user.args[1]])
            graph.erase_node(user)
        else:
            raise ValueError(f"checkpoint region {node.name} is used by {user.format_node()}, not by getitem")
    body_attr = node.args[0]
    graph.erase_node(node)
    if isinstance(body_attr, torch.fx.Node) and not body_attr.users:
        graph.erase_node(body_attr)


def inline_checkpoints(gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
    mode = ctx.config.checkpoints
    regions = _regions(gm)  # those holding attention
    where = ", ".join(location(n) for n in regions)
    if mode == "keep":
        if not regions:
            return PassResult(False)
        msg = (f"{len(regions)} activation-checkpoint region(s) hold attention that is not rewritten (dense on every "
               f"rank, full sequence, O(n) memory): {where}. Config(checkpoints='recompute') rewrites it and keeps "
               f"the regions checkpointed")
        if ctx.config.strict or (ctx.config.require_linear_memory and ctx.world_size > 1):
            setting = "strict=True" if ctx.config.strict else "require_linear_memory=True"
            raise ValueError(f"Config({setting}) but {msg}")
        ctx.report.notes.append(msg)
        return PassResult(False)
    count = len(regions)
    every = mode == "recompute"  # all regions come back: inlining one costs no recompute then
    regions = _regions(gm, every)
    if not regions:
        return PassResult(False)
    found: dict[int, _Region] = ctx.scratch.setdefault(SCRATCH, {})
    while regions:  # nested regions come back as regions of the new graph, inside their outer one
        for node in regions:
            region = node.meta.get(REGION)
            if region is None:
                region = len(found)
                body = attr_value(gm, node.args[0].target)
                found[region] = _Region(node.target, dict(node.kwargs), dict(body.meta), location(node),
                                        _holds_attention(body))
            _inline(gm, node, attr_value(gm, node.args[0].target), region)
        regions = _regions(gm, every)
    if mode == "inline":
        note = (f"{count} activation-checkpoint region(s) holding attention inlined (Config.checkpoints='inline') "
                f"so that their attention is rewritten: {where}. Their activations are kept (O(n/p) per rank) "
                "instead of recomputed")
        ctx.report.notes.append(note)
        warnings.warn(f"ringcc: {note}; Config(checkpoints='recompute') checkpoints them again after the rewrite",
                      stacklevel=2)
    return PassResult(True)


@dataclass(frozen=True)
class _Region:
    target: object  # the higher-order op, as dynamo traced it
    kwargs: dict  # its options (use_reentrant, ...)
    body_meta: dict  # its body's meta (a selective-checkpoint policy: _checkpoint_context_fn)
    where: str
    attention: bool  # its body holds attention the rewrite takes (else: inlined so that its values shard)


def restore_checkpoints(gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
    """Checkpoint again the regions inline_checkpoints inlined (Config.checkpoints='recompute'),
    now that their attention is rewritten and their values sharded (Note [Checkpoint regions])."""
    found: dict[int, _Region] = ctx.scratch.get(SCRATCH) or {}
    if ctx.config.checkpoints != "recompute" or not found:
        return PassResult(False)
    kept, restored, others = [], [], []
    for region, info in found.items():
        why = _outline(gm, region, info)
        if why:
            kept.append(f"{info.where} ({why})")
        else:
            (restored if info.attention else others).append(info.where)
    if restored:
        ctx.report.notes.append(
            f"{len(restored)} activation-checkpoint region(s) holding attention rewritten and checkpointed again "
            f"(Config.checkpoints='recompute': recomputed in backward, ring attention included): {', '.join(restored)}")
    if others:
        ctx.report.notes.append(
            f"{len(others)} other activation-checkpoint region(s) (no attention) sharded and checkpointed again: "
            f"{', '.join(others)}")
    if kept:
        note = (f"{len(kept)} of {len(found)} activation-checkpoint region(s) stay inlined, their "
                f"activations kept (O(n/p) per rank) instead of recomputed: {', '.join(kept)}")
        ctx.report.notes.append(note)
        warnings.warn(f"ringcc: {note}", stacklevel=2)
    return PassResult(bool(restored or others))


def _hoist(first: torch.fx.Node, span: list[torch.fx.Node], region: int) -> list[torch.fx.Node]:
    """Move the nodes of `span` that later passes added (untagged) and that need nothing of
    the region (a shard of an outer value, a mask's key-runs table, a pass's constant) before `first`,
    so that the region recomputes only its own work; the rest of the span, in order."""
    inside: set[torch.fx.Node] = set()
    rest = []
    for node in span:
        # (the region's own attributes, a nested region's body among them, stay: _body copies them)
        movable = (node.meta.get(REGION) != region and not writes_any(node)
                   and not any(a in inside for a in node.all_input_nodes))
        if movable and node is not first:
            first.prepend(node)
        else:
            inside.add(node)
            rest.append(node)
    return rest


def _outline(gm: torch.fx.GraphModule, region: int, info: _Region) -> str | None:
    """Replace the nodes of `region` (and what passes added among them) by one checkpoint op
    over a new body; None, or why the region stays inlined."""
    graph = gm.graph
    nodes = list(graph.nodes)
    tagged = [i for i, n in enumerate(nodes) if n.meta.get(REGION) == region]
    if not tagged:
        return None  # nothing of it is left (dead code)
    first = nodes[tagged[0]]
    span = _hoist(first, nodes[tagged[0]:tagged[-1] + 1], region)
    members = set(span)
    for node in span:
        other = node.meta.get(REGION)
        if node.op in ("placeholder", "output") or (other is not None and other != region):
            return f"{node.name} of the region is interleaved with other code"
        if writes_any(node) and not all(a in members for a in node.all_input_nodes[:1]):
            return f"{node.name} writes a value from outside the region in place"
    inputs: list[torch.fx.Node] = []
    for node in span:
        for a in node.all_input_nodes:
            if a not in members and a not in inputs:
                inputs.append(a)
    outputs = [n for n in span if any(u not in members for u in n.users)]
    body = _body(gm, span, inputs, outputs, info)
    name = _fresh_name(gm, "ringcc_checkpoint_body")
    gm.add_submodule(name, body)
    with graph.inserting_before(span[0]):
        hop = graph.call_function(info.target, (graph.get_attr(name), *inputs), dict(info.kwargs))
        hop.meta.update({k: v for k, v in first.meta.items() if k in ("stack_trace", "nn_module_stack")})
        hop.meta["ringcc_pass"] = RESTORE
        for key in ("example_value", "val", STATE_META):
            if any(key in o.meta for o in outputs):
                hop.meta[key] = tuple(o.meta.get(key) for o in outputs)
        for i, out in enumerate(outputs):
            item = graph.call_function(operator.getitem, (hop, i))
            item.meta.update(out.meta)
            item.meta.pop(REGION, None)
            out.replace_all_uses_with(item, delete_user_cb=lambda u: u not in members)
    for node in reversed(span):
        graph.erase_node(node)
    return None


def _body(gm, span, inputs, outputs, info: _Region) -> torch.fx.GraphModule:
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for a in inputs:
        env[a] = graph.placeholder(a.name)
        env[a].meta.update(a.meta)
    for node in span:
        env[node] = graph.node_copy(node, lambda a: env[a])
    graph.output(tuple(env[o] for o in outputs))
    body = torch.fx.GraphModule(gm, graph)
    body.meta.update(info.body_meta)
    return body


def inlined(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of gm with every checkpoint region inlined (gm is left as it is): the whole
    program in one graph, for analyses that read a single graph (the tests' structural checks)."""
    graph = torch.fx.Graph()
    out = graph.graph_copy(gm.graph, {})
    graph.output(out)
    flat = torch.fx.GraphModule(gm, graph)
    regions = _regions(flat, every=True)
    while regions:
        for node in regions:
            _inline(flat, node, attr_value(flat, node.args[0].target), node.meta.get(REGION, -1))
        regions = _regions(flat, every=True)
    flat.meta.update(gm.meta)
    return flat
