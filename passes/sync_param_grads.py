"""Make every rank end with the single-device gradients of replicated values (parameters, and
activations every rank computes whole) that sharded computation consumes.

A weight used by a sharded op receives, on each rank, only its own tokens' share of the
gradient (Note [Replicated cotangents] in runtime/seqops.py). Each such use is rewired
through an identity whose backward all-reduces the cotangents of a whole bucket
(Config.bucket_mb) in one flat buffer: `sync_grads_view` (views, no copy) for graph inputs,
the op ringcc::sync_grads (copies) for attributes of an export graph (Note [Parameter copies]). Uses by replicated computation keep
the original value: their gradient is already complete on every rank (a weight sliced by
ringcc::shard, like ViT's position table, gets the all-gathered gradient from the shard's
backward, so it is not synced either).

Note [Gradients under data parallelism]
ringcc's loss is the sequence group's global mean and each rank seeds the same cotangent
(Note [Replicated cotangents]), so a weight's gradient on rank c of the group is its share
g_c, and the single-device gradient of the batch is sum_c g_c. A data-parallel engine outside
the graph (FSDP2's reduce-scatter, DDP's all-reduce) then averages over its own ranks:
- over ranks that hold other batches only (a mesh dimension other than the sequence's): the
  group's sum must be complete before it, so ringcc all-reduces the shares (sync_grads_view);
  the engine's mean over the data dimension makes the global batch's gradient;
- over ranks that include the whole sequence group (FSDP2 or DDP on the flattened
  data x sequence mesh, as torchtitan shards): its mean over the group is (1/p) sum_c of what
  each rank holds, so ringcc multiplies each share by p (scale_grads_view) and communicates
  nothing; every gradient is then reduced once, by the engine. An all-reduce here would also
  be exact (the engine would average p equal copies) but would send every gradient twice.
Config.grad_sync chooses; "auto" takes the second way for the graph inputs the backend found
averaged so (ringcc/backend.py, _compat.data_parallel_means), the first for the rest.
"""

from __future__ import annotations

import operator

import torch
import torch.fx

import ringcc.runtime.seqops  # noqa: F401 - registers ringcc::sync_grads
from ringcc import _compat

from .base import PassContext, PassResult, tag
from .discover_sequence import fake
from .shard_sequence import STATE_META

PASS = "sync_param_grads"
SYNC = torch.ops.ringcc.sync_grads.default
SYNC_VIEW = ringcc.runtime.seqops.sync_grads_view
SCALE_VIEW = ringcc.runtime.seqops.scale_grads_view
_COMM_OPS = ("shard", "gather", "all_reduce_sum", "seq_select", "sync_grads")


def _sharded(state) -> bool:
    if isinstance(state, tuple):
        return any(_sharded(s) for s in state)
    return state is not None and state.sharded


def computes_on_shards(node: torch.fx.Node) -> bool:
    if node.op not in ("call_function", "call_method"):
        return False
    t = node.target
    if isinstance(t, _compat.OpOverload) and t.namespace == "ringcc" and t._opname in _COMM_OPS:
        return False
    return _sharded(node.meta.get(STATE_META)) or any(_sharded(a.meta.get(STATE_META)) for a in node.all_input_nodes)


def _needs_sync(value: torch.fx.Node) -> bool:
    """A replicated value that needs a gradient: a weight, or an activation every rank computes
    whole (a statistic of a gathered value); consumed by sharded computation, each rank's
    cotangent of it is a share."""
    val = fake(value)
    return isinstance(val, torch.Tensor) and val.requires_grad and not _sharded(value.meta.get(STATE_META))


def sync_param_grads(gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
    if not ctx.scratch.get("sharded") or ctx.world_size == 1 or any(n.target in (SYNC, SYNC_VIEW, SCALE_VIEW) for n in gm.graph.nodes):
        return PassResult(False)
    uses: dict[torch.fx.Node, list[torch.fx.Node]] = {}
    for node in gm.graph.nodes:
        if not computes_on_shards(node):
            continue
        for a in node.all_input_nodes:
            if _needs_sync(a):
                uses.setdefault(a, []).append(node)
    if not uses:
        return PassResult(False)
    index = {n: i for i, n in enumerate(n for n in gm.graph.nodes if n.op == "placeholder")}

    def averaged(v):  # a graph input the engine averages, or a value made from one alone (w.chunk(k))
        while v.op != "placeholder" and len(v.all_input_nodes) == 1:
            v = v.all_input_nodes[0]
        return v.op == "placeholder" and index[v] in ctx.outer_reduced

    placeholders = [v for v in uses if v.op == "placeholder" and not averaged(v)]
    others = [v for v in uses if v.op != "placeholder" and not averaged(v)]
    scaled = [v for v in uses if averaged(v)]
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for values, target in ((placeholders, SYNC_VIEW), ([v for v in scaled if v.op == "placeholder"], SCALE_VIEW)):
        for bucket in _buckets(values, ctx.config.bucket_mb):
            # Just before the bucket's first use: in backward its all-reduce then runs as soon as
            # that use's backward has made the last of its cotangents (autograd runs the ready node
            # made last in forward first), not after the whole backward, which would hold every
            # weight's cotangent until then.
            first = min((u for v in bucket for u in uses[v]), key=order.__getitem__)
            _sync(gm, ctx, bucket, uses, first.prev, target)
    for v in others:
        _sync(gm, ctx, [v], uses, v, SYNC)
    for v in scaled:
        if v.op != "placeholder":
            _sync(gm, ctx, [v], uses, v, SCALE_VIEW)
    decision = f"sync {len(placeholders) + len(others)} values in {len(_buckets(placeholders, ctx.config.bucket_mb))} buckets"
    if scaled:
        decision += f", scale {len(scaled)}"
    ctx.scratch.setdefault("shard_decisions", []).append(decision)
    ctx.report.notes.append(
        f"parameter gradients: {len(placeholders) + len(others)} all-reduced over the sequence group, {len(scaled)} "
        "scaled by p for the data-parallel engine's mean (Note [Gradients under data parallelism])")
    return PassResult(True)


def _buckets(values: list[torch.fx.Node], bucket_mb: float) -> list[list[torch.fx.Node]]:
    limit = bucket_mb * 2**20
    out: list[list[torch.fx.Node]] = []
    size = 0.0
    for v in values:
        val = fake(v)
        nbytes = val.numel() * val.element_size()
        if not out or (size + nbytes > limit and out[-1]):
            out.append([])
            size = 0.0
        out[-1].append(v)
        size += nbytes
    return out


def _sync(gm, ctx, bucket, uses, anchor, target) -> torch.fx.Node:
    """One sync (or scale) op for `bucket` after `anchor`; rewires the sharded uses. Returns the
    last node."""
    with gm.graph.inserting_after(anchor):
        op = tag(gm.graph.call_function(target, (list(bucket), ctx.group_name, ctx.world_size)), PASS, bucket[0])
    mode = fake(bucket[0]).fake_mode
    with mode:
        op.meta["example_value"] = target([fake(v) for v in bucket], ctx.group_name, ctx.world_size)
    last = op
    for i, v in enumerate(bucket):
        with gm.graph.inserting_after(last):
            item = tag(gm.graph.call_function(operator.getitem, (op, i)), PASS, v)
        item.meta["example_value"] = op.meta["example_value"][i]
        last = item
        for user in uses[v]:
            user.replace_input_with(v, item)
    return last
