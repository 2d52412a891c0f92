"""Custom ops the sequence-sharding passes insert (besides ringcc::shard / ringcc::gather).

Each op is opaque to dynamo / AOT / inductor and carries the process group as its name and
p as an argument; fakes never read the rank or the world size from the environment.
Backward of every op mirrors its forward (Note [Replicated cotangents]):

- all_reduce_sum: forward sums a partial (a local loss sum, a local count) over the group;
  backward is the identity.
- seq_select: forward picks global token `index` (its owner contributes, the others add 0);
  backward puts the cotangent back at that row on the owner and zeros elsewhere.
- seq_cumsum: a cumulative sum along the sharded sequence (Note [Cumulative sums]); backward
  is the same op summing from the end.
- sync_grads: forward is the identity on a bucket of replicated values (parameters, whole
  activations) that sharded computation consumes; backward all-reduces their cotangents in one
  flat buffer.
- scale_grads_view: the identity whose backward multiplies the cotangents by p instead, for
  parameters whose gradients an engine outside the graph averages over the whole group
  (Note [Gradients under data parallelism] in passes/sync_param_grads.py).

Note [Parameter copies]
A torch.library custom op may not return an alias of its input, so the op ringcc::sync_grads
returns copies: in a training step every synced parameter was copied once, and the copy,
saved for backward by the layer that reads it, lived through the step (one more parameter's
worth of memory per rank: 14 GB for 7B bf16 parameters). In dynamo graphs, where the
parameters are graph inputs and AOTAutograd traces the graph, sync_param_grads inserts
`sync_grads_view` instead: an autograd.Function whose forward returns views and whose
backward is the op's own (`_sync_backward`). The op stays for graphs that must keep it as one
op: `ringcc rewrite` exports its program, and export would keep the views but drop an
autograd.Function's backward.

Note [Replicated cotangents]
Every rank runs the same graph on the same full inputs and seeds backward with the same
cotangent for every replicated output (the loss). A replicated value computed from a sum
over ranks therefore receives the full cotangent on every rank, and each rank's partial gets
exactly that cotangent: the all-reduce's backward is the identity, not another all-reduce
(which would give p times the gradient). Conversely a replicated value consumed by sharded
computation (a weight, or an activation every rank computes whole: a statistic of a gathered
value) receives only its own tokens' share on each rank: its cotangent is all-reduced
(sync_grads).
"""

from __future__ import annotations

import itertools

import torch
import torch.distributed as dist

from ringcc import _compat

from . import layout as L
from .ops import _group_from


def _owner(index: int, n_local: int, world: int, rank: int, layout: str) -> int | None:
    """Local row of global token `index` on `rank`, or None when another rank holds it."""
    lay = L.Layout(layout)
    per = L.chunks_per_rank(lay)
    c_len = n_local // per
    n = n_local * world
    index = index % n
    chunk, offset = divmod(index, c_len)
    for slot, c in enumerate(L.local_chunks(rank, world, lay)):
        if c == chunk:
            return slot * c_len + offset
    return None


# ---------------------------------------------------------------------------------------
# all_reduce_sum


@torch.library.custom_op("ringcc::all_reduce_sum", mutates_args=())
def all_reduce_sum(x: torch.Tensor, group_name: str, world_size: int) -> torch.Tensor:
    group, _, world = _group_from(group_name, world_size)
    out = x.clone(memory_format=torch.contiguous_format)
    if world > 1:
        dist.all_reduce(out, group=group)
    return out


@all_reduce_sum.register_fake
def _(x, group_name, world_size):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _all_reduce_backward(ctx, grad):
    # Note [Replicated cotangents]: identity.
    return grad, None, None


all_reduce_sum.register_autograd(_all_reduce_backward, setup_context=lambda ctx, inputs, output: None)


# ---------------------------------------------------------------------------------------
# seq_select


@torch.library.custom_op("ringcc::seq_select", mutates_args=())
def seq_select(x: torch.Tensor, dim: int, index: int, group_name: str, world_size: int, layout: str) -> torch.Tensor:
    group, rank, world = _group_from(group_name, world_size)
    row = _owner(index, x.shape[dim], world, rank, layout)
    out = x.select(dim, row).clone(memory_format=torch.contiguous_format) if row is not None else \
        x.new_zeros(x.shape[:dim] + x.shape[dim + 1:])
    if world > 1:
        dist.all_reduce(out, group=group)
    return out


@seq_select.register_fake
def _(x, dim, index, group_name, world_size, layout):
    return x.new_empty(x.shape[:dim] + x.shape[dim + 1:])


@torch.library.custom_op("ringcc::seq_select_backward", mutates_args=())
def seq_select_backward(grad: torch.Tensor, dim: int, index: int, n_local: int, group_name: str,
                        world_size: int, layout: str) -> torch.Tensor:
    _, rank, world = _group_from(group_name, world_size)
    shape = list(grad.shape)
    shape.insert(dim, n_local)
    out = grad.new_zeros(shape)
    row = _owner(index, n_local, world, rank, layout)
    if row is not None:
        out.select(dim, row).copy_(grad)
    return out


@seq_select_backward.register_fake
def _(grad, dim, index, n_local, group_name, world_size, layout):
    shape = list(grad.shape)
    shape.insert(dim, n_local)
    return grad.new_empty(shape)


def _select_setup(ctx, inputs, output):
    x, dim, index, group_name, world_size, layout = inputs
    ctx.args = (dim, index, x.shape[dim], group_name, world_size, layout)


def _select_backward(ctx, grad):
    return seq_select_backward(grad.contiguous(), *ctx.args), None, None, None, None, None


seq_select.register_autograd(_select_backward, setup_context=_select_setup)


# ---------------------------------------------------------------------------------------
# sync_grads (one bucket)


@torch.library.custom_op("ringcc::sync_grads", mutates_args=())
def sync_grads(xs: list[torch.Tensor], group_name: str, world_size: int) -> list[torch.Tensor]:
    return [x.clone(memory_format=torch.contiguous_format) for x in xs]


@sync_grads.register_fake
def _(xs, group_name, world_size):
    return [torch.empty_like(x, memory_format=torch.contiguous_format) for x in xs]


# Note [Overlapped gradient all-reduce]
# A bucket's all-reduce is two ops: grad_all_reduce_start copies the bucket into one flat buffer
# per dtype, launches its all-reduce (async_op) and returns a token; grad_all_reduce_wait(token)
# waits for it and returns the summed buffer. Traced into a compiled backward they are two
# nodes with only the token between them, and the backend moves every wait, with what is made
# from its result, to the end of the backward graph (ringcc/backend.py, _grad_waits_last: an
# inductor post-grad pass, or aot_eager's backward compiler), so the backward's later kernels
# are issued between them: the bucket travels while the rest of the backward computes. One
# synchronous all-reduce would make the compute stream wait for the transfer before the next
# backward kernel. The ops are opaque to inductor (it does not see collectives in them, so it
# neither reorders nor serialises them), and every rank runs them in the graph's order: the
# same collectives in the same order on every rank. Run eagerly the wait follows the start at
# once.
_PENDING: dict[int, tuple] = {}
_TOKENS = itertools.count(1)


@torch.library.custom_op("ringcc::grad_all_reduce_start", mutates_args=(), tags=_compat.cudagraph_unsafe_tags())
def grad_all_reduce_start(grads: list[torch.Tensor], group_name: str, world_size: int) -> torch.Tensor:
    group, _, _ = _group_from(group_name, world_size)
    flat = torch.cat([g.reshape(-1) for g in grads])
    work = dist.all_reduce(flat, group=group, async_op=True) if group is not None else None
    token = next(_TOKENS)
    _PENDING[token] = (work, flat)
    return torch.tensor(token, dtype=torch.int64)


@grad_all_reduce_start.register_fake
def _(grads, group_name, world_size):
    return torch.empty((), dtype=torch.int64)


@torch.library.custom_op("ringcc::grad_all_reduce_wait", mutates_args=(), tags=_compat.cudagraph_unsafe_tags())
def grad_all_reduce_wait(token: torch.Tensor, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    work, flat = _PENDING.pop(int(token))
    if work is not None:
        work.wait()
    return flat


@grad_all_reduce_wait.register_fake
def _(token, numel, dtype, device):
    return torch.empty(numel, dtype=dtype, device=device)


def all_reduce_bucket(grads: list[torch.Tensor], group_name: str, world_size: int) -> list[torch.Tensor]:
    """Sums a bucket of gradients over the group, one flat buffer per dtype; returns views of it
    (Note [Overlapped gradient all-reduce])."""
    out: list[torch.Tensor] = [torch.Tensor()] * len(grads)
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, g in enumerate(grads):
        by_dtype.setdefault(g.dtype, []).append(i)
    for dtype, idx in by_dtype.items():
        sizes = [grads[i].numel() for i in idx]
        token = grad_all_reduce_start([grads[i] for i in idx], group_name, world_size)
        flat = grad_all_reduce_wait(token, sum(sizes), dtype, grads[idx[0]].device)
        for i, part in zip(idx, flat.split(sizes)):
            out[i] = part.view(grads[i].shape)
    return out


def _sync_setup(ctx, inputs, output):
    xs, group_name, world_size = inputs
    ctx.args = (group_name, world_size)
    ctx.shapes = [(x.shape, x.dtype, x.device) for x in xs]


def _sync_backward(ctx, grads):
    # Unused outputs arrive as None; every rank has the same graph, so the same ones are None
    # everywhere and zeros keep the collective's layout identical on all ranks.
    full = [g if g is not None else torch.zeros(s, dtype=dt, device=dev)
            for g, (s, dt, dev) in zip(grads, ctx.shapes)]
    return all_reduce_bucket([g.contiguous() for g in full], *ctx.args), None, None


sync_grads.register_autograd(_sync_backward, setup_context=_sync_setup)


class _SyncGradsView(torch.autograd.Function):
    """sync_grads without the copies: views of the bucket's values, whose backward all-reduces
    their cotangents the same way (Note [Parameter copies])."""

    @staticmethod
    def forward(group_name, world_size, *xs):
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def setup_context(ctx, inputs, output):
        group_name, world_size, *xs = inputs
        _sync_setup(ctx, (xs, group_name, world_size), output)

    @staticmethod
    def backward(ctx, *grads):
        return None, None, *_sync_backward(ctx, list(grads))[0]


def sync_grads_view(xs: list[torch.Tensor], group_name: str, world_size: int) -> tuple[torch.Tensor, ...]:
    """The identity on a bucket of parameters, as views (no copy), whose backward all-reduces
    their cotangents in one flat buffer: what sync_param_grads inserts in dynamo graphs."""
    return _SyncGradsView.apply(group_name, world_size, *xs)


class _ScaleGradsView(torch.autograd.Function):
    """Views of a bucket of parameters whose backward multiplies their cotangents by p: an outer
    data-parallel engine's mean over the sequence group then sums the ranks' shares."""

    @staticmethod
    def forward(world_size, *xs):
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.world_size = inputs[0]

    @staticmethod
    def backward(ctx, *grads):
        return None, *(None if g is None else g * ctx.world_size for g in grads)


def scale_grads_view(xs: list[torch.Tensor], group_name: str, world_size: int) -> tuple[torch.Tensor, ...]:
    """The identity on a bucket of parameters, as views, whose backward scales their cotangents
    by world_size (no communication; `group_name` keeps sync_grads_view's signature)."""
    return _ScaleGradsView.apply(world_size, *xs)


# ---------------------------------------------------------------------------------------
# seq_cumsum

# Note [Cumulative sums]
# cumsum along a sharded sequence dim (OPT's position ids: a cumsum of the attention mask). A
# rank holds chunks of the global order (contiguous: chunk r of p; zigzag: chunks r and
# 2p-1-r of 2p, runtime/layout.py), so each chunk's prefix sum is its own cumsum plus the sum
# of every chunk before it in global order. Every rank takes the cumsum of each of its chunks,
# all-gathers the chunks' totals (one row per chunk: 2p rows in all, whatever n), and adds the
# totals of the chunks before each of its own. reverse=True sums from the end instead (the
# chunks after), which is the gradient: d(cumsum x)/dx applied to g is the suffix sum of g.


def _cumsum_dtype(dtype: torch.dtype) -> torch.dtype:
    """torch.cumsum's result dtype: integral and bool inputs sum in int64."""
    return dtype if dtype.is_floating_point or dtype.is_complex else torch.int64


@torch.library.custom_op("ringcc::seq_cumsum", mutates_args=())
def seq_cumsum(x: torch.Tensor, dim: int, reverse: bool, group_name: str, world_size: int,
               layout: str) -> torch.Tensor:
    group, rank, world = _group_from(group_name, world_size)
    lay = L.Layout(layout)
    per = L.chunks_per_rank(lay)
    pieces = [c.flip(dim).cumsum(dim).flip(dim) if reverse else c.cumsum(dim) for c in x.chunk(per, dim)]
    # each chunk's total: its first row summing from the end, its last from the start
    totals = torch.cat([c.narrow(dim, 0 if reverse else c.shape[dim] - 1, 1) for c in pieces], dim).contiguous()
    parts = [torch.empty_like(totals) for _ in range(world)]
    if world > 1:
        dist.all_gather(parts, totals, group=group)
    else:
        parts = [totals]
    by_chunk = {}  # global chunk -> its total
    for r, part in enumerate(parts):
        for slot, c in enumerate(L.local_chunks(r, world, lay)):
            by_chunk[c] = part.narrow(dim, slot, 1)
    out = []
    for slot, c in enumerate(L.local_chunks(rank, world, lay)):
        others = [by_chunk[k] for k in sorted(by_chunk) if (k > c if reverse else k < c)]
        out.append(pieces[slot] + sum(others[1:], others[0]) if others else pieces[slot])
    return torch.cat(out, dim).contiguous()


@seq_cumsum.register_fake
def _(x, dim, reverse, group_name, world_size, layout):
    return x.new_empty(x.shape, dtype=_cumsum_dtype(x.dtype))


def _cumsum_setup(ctx, inputs, output):
    x, dim, reverse, group_name, world_size, layout = inputs
    ctx.args = (dim, not reverse, group_name, world_size, layout)


def _cumsum_backward(ctx, grad):
    return seq_cumsum(grad.contiguous(), *ctx.args), None, None, None, None, None


seq_cumsum.register_autograd(_cumsum_backward, setup_context=_cumsum_setup)
