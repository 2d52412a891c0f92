"""Activation-checkpoint regions that hold attention are moved into the graph.

Dynamo traces `torch.utils.checkpoint.checkpoint(fn, ...)` as one higher-order op,
`tag_activation_checkpoint(body, *operands)`, whose body is a graph module of its own. The
passes after this one read the top-level graph only, so attention inside such a region would
be neither found nor rewritten: it would run dense on every rank, with the full sequence.

Note [Checkpoint regions]
With Config.checkpoints="inline" (the default) every region whose body holds attention that the
rewrite can take (an SDPA call without dropout, nn.MultiheadAttention's functional form, the
encoder layer's fused path, or softmax(...) @ v without dropout: manual attention) is replaced by
a copy of its body, so its attention sites are rewritten and its values sharded like any other.
The region's activations are then kept for the backward instead of recomputed: O(n/p) per rank,
which the memory plan counts. Other regions stay checkpointed (a softmax that feeds no matmul,
such as a mixture-of-experts gate, is not attention; attention with dropout in training is left
as written by the rewrite, so inlining it would only lose the recompute). With "keep", regions
stay as they are, and the report names the attention they hide (an error under
Config(strict=True) or Config(require_linear_memory=True): it runs dense on every rank).
"""

from __future__ import annotations

import operator
import warnings

import torch
import torch.fx
import torch.nn.functional as F

from .attention_form import SdpaCall, is_sdpa
from .base import PassContext, PassResult, attr_value, location, op_name

PASS = "inline_checkpoints"
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


def _regions(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """The checkpoint regions of gm whose body holds attention."""
    return [n for n in gm.graph.nodes if _is_checkpoint(n)
            and isinstance(n.args[0], torch.fx.Node) and n.args[0].op == "get_attr"
            and _holds_attention(attr_value(gm, n.args[0].target))]


def _fresh_name(gm: torch.fx.GraphModule, base: str) -> str:
    i = 0
    while hasattr(gm, f"{base}_{i}"):
        i += 1
    return f"{base}_{i}"


def _inline(gm: torch.fx.GraphModule, node: torch.fx.Node, body: torch.fx.GraphModule) -> None:
    """Replace the region `node` by a copy of `body` (its placeholders bound to the operands);
    the region's getitem users read the copied outputs."""
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
                continue
            new = graph.node_copy(bn, lambda a: env[a])
            new.meta.setdefault("ringcc_pass", PASS)
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
    regions = _regions(gm)
    if not regions:
        return PassResult(False)
    where = ", ".join(location(n) for n in regions)
    if ctx.config.checkpoints == "keep":
        msg = (f"{len(regions)} activation-checkpoint region(s) hold attention that is not rewritten (dense on every "
               f"rank, full sequence, O(n) memory): {where}. Config(checkpoints='inline') rewrites it, keeping those "
               f"regions' activations instead of recomputing them")
        if ctx.config.strict or (ctx.config.require_linear_memory and ctx.world_size > 1):
            setting = "strict=True" if ctx.config.strict else "require_linear_memory=True"
            raise ValueError(f"Config({setting}) but {msg}")
        ctx.report.notes.append(msg)
        return PassResult(False)
    count = len(regions)
    while regions:  # nested regions come back as regions of the new graph (not counted again)
        for node in regions:
            _inline(gm, node, attr_value(gm, node.args[0].target))
        regions = _regions(gm)
    note = (f"{count} activation-checkpoint region(s) holding attention inlined (Config.checkpoints='inline') "
            f"so that their attention is rewritten: {where}. Their activations are kept (O(n/p) per rank) "
            "instead of recomputed")
    ctx.report.notes.append(note)
    warnings.warn(f"ringcc: {note}; Config(checkpoints='keep') keeps them checkpointed, with dense attention",
                  stacklevel=2)
    return PassResult(True)
