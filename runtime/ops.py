"""torch.library custom ops for the runtime, and the public functional API.

The ops are opaque to dynamo / AOT / inductor. The process group travels as its name and
the world size p as an argument (fake kernels never read the environment: inductor may
reuse an artifact compiled for one p at another). The rank is read at run time.
"""

from __future__ import annotations

import dataclasses
import math
import os
import weakref
from typing import Optional

import torch
import torch.distributed as dist

from ringcc import _compat

from . import amp, balance, kernels
from . import layout as L
from .comm import group_extremes
from . import graphs, maskfn, workspace
from .merge import merge_sinks, sink_grad
from .ring import RingSetup, key_runs_table, resolve_world, ring_backward, ring_forward

# the ops' autograd kernels complete their arguments in linear time (_compat.linear_fill_defaults)
_compat.linear_fill_defaults()

# ---------------------------------------------------------------------------------------
# helpers


def _resolve_group(group_name: str, world_size: int):
    """The process group an op was built for (None at world size 1)."""
    if world_size == 1:
        return None
    if not dist.is_initialized():
        raise ValueError(
            f"ringcc op was built for world size {world_size} but no process group is "
            "initialised in this process; call torch.distributed.init_process_group first"
        )
    # "" is the default group of the process that runs the op: offline programs
    # (`ringcc rewrite`) are saved with it, since real group names are process-local.
    return dist.group.WORLD if group_name == "" else _compat.resolve_group(group_name)


def _group_from(group_name: str, world_size: int, group=None):
    """(group, this rank in it, its size) for an op built for `group_name` of `world_size` ranks
    (`group`: already resolved)."""
    if world_size == 1:
        return None, 0, 1
    group = _resolve_group(group_name, world_size) if group is None else group
    world = dist.get_world_size(group)
    if world != world_size:
        raise ValueError(
            f"ringcc op was built for world size {world_size} but group {group_name!r} has "
            f"{world} ranks; recompile for this group"
        )
    return group, dist.get_rank(group), world


# The RingSetup of each call signature, made once: the rank, the head-chunk rule and the
# settings it reads took about 100 µs of host per call on the GPU machines, before an idle
# GPU gets its first kernel. Keyed by a weak reference to the group object (a name can come
# back for a new group after destroy_process_group), every input the rule reads, and the
# settings it reads; cleared when it grows past a few hundred signatures. The cache holds no
# group: a strong reference would keep a destroyed group's backend (gloo's worker threads)
# alive into interpreter shutdown (Note [Ending a gloo process] in ringcc/launch.py).
_SETUPS: dict = {}


def _setup(q, k, key_valid, group_name, world_size, layout, is_causal, scale, window=0, *,
           forward: bool) -> RingSetup:
    group = _resolve_group(group_name, world_size)
    key = (None if group is None else weakref.ref(group), world_size, layout, is_causal, scale, window,
           forward, q.shape, q.dtype, k.shape, k.dtype, None if key_valid is None else (key_valid.shape, key_valid.dtype),
           q.device.type, workspace.chunk_rule_settings())
    setup = _SETUPS.get(key)
    if setup is None:
        _, rank, world = _group_from(group_name, world_size, group)
        lay = L.Layout(layout)
        # K/V heads per chunk: the planner's rule (workspace.py), per direction
        kv_chunk = workspace.ring_kv_chunk(q, k, key_valid, world, zigzag_causal=is_causal and lay is L.Layout.ZIGZAG,
                                           forward=forward)
        setup = RingSetup(None, rank, world, lay, is_causal, scale, window=window, kv_chunk=kv_chunk)
        if len(_SETUPS) >= 256:
            _SETUPS.clear()
        _SETUPS[key] = setup
    return setup if group is None else dataclasses.replace(setup, group=group)


# ---------------------------------------------------------------------------------------
# ring attention

# Note [Attention sinks]
# gpt-oss gives each head h a learned logit sink[h] that joins every row's softmax denominator
# and carries no value: P_ij = exp(s_ij - lse'), lse' = log(sum_j exp(s_ij) + exp(sink[h])). It is
# not a mask and not a score modifier: it is one more block of one key with a zero value, merged
# once per row through the LSE after the ring (merge.merge_sinks): lse' = logaddexp(lse, sink[h]),
# out' = out * exp(lse - lse'). The op returns (out', lse').
# Backward: with the sink's column in the softmax, dP_sink = dO . 0 = 0, so
# D = sum_j P_ij dP_ij = rowsum(dO * O') as without a sink, and dS_ij = P_ij (dP_ij - D) is what
# the ring's backward computes from the global (out', lse'): dq, dk, dv need nothing new. The
# sink's own gradient is dS at its column, P_sink (0 - D), summed over the rows:
# dsink[h] = -sum_{b, i} exp(sink[h] - lse'_bhi) * rowsum(dO * O')_bhi (merge.sink_grad). Each
# rank holds its own query rows, so this is its share: the shares are summed over the ranks as
# for any parameter used by sharded ops (passes/sync_param_grads.py in the compiled path).


@torch.library.custom_op("ringcc::key_runs", mutates_args=(), tags=_compat.cudagraph_unsafe_tags())
def key_runs_op(key_valid: torch.Tensor, group_name: str, world_size: int) -> torch.Tensor:
    """The host table of which ranks' valid keys are one run per batch row (Note [Key runs per
    mask] in ring.py): [world_size, batch, 2] int64 on the CPU. One all-gather and host sync
    (so never inside a CUDA graph: tagged cudagraph_unsafe); the ring ops take the table as
    their `key_runs`, so every layer that reads one key mask shares it."""
    group, _, world = _group_from(group_name, world_size)
    if key_valid.dtype != torch.bool or key_valid.dim() != 2:
        raise ValueError(f"key_runs takes a bool [batch, n_local] key mask; got {key_valid.dtype} "
                         f"{tuple(key_valid.shape)}")
    return key_runs_table(key_valid, group, world)


@key_runs_op.register_fake
def _(key_valid, group_name, world_size):
    return torch.empty((world_size, key_valid.shape[0], 2), dtype=torch.int64, device="cpu")


@torch.library.custom_op("ringcc::balance_plan", mutates_args=(), tags=_compat.cudagraph_unsafe_tags())
def balance_plan_op(mask_fn: str, is_causal: bool, batch: int, heads: int, group_name: str, world_size: int,
                    layout: str, threshold: float, mask_t0: Optional[torch.Tensor] = None,
                    mask_t1: Optional[torch.Tensor] = None, mask_t2: Optional[torch.Tensor] = None,
                    mask_t3: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Which global chunks each rank's ring computes under the mask function `mask_fn` (with
    `is_causal`, over `batch` rows and `heads` query heads), as the ring ops take it
    (`balance_plan`): the layout's own chunks unless their largest share of the allowed pairs
    over the mean exceeds `threshold`, else chunks reassigned by their counts (Note [Balanced
    ring] in balance.py). [world_size, balance.MAX_CHUNKS] int64 on the host. One all-reduce of
    the chunk counts and a host sync (never inside a CUDA graph: tagged cudagraph_unsafe)."""
    group, rank, world = _group_from(group_name, world_size)
    tensors = tuple(t for t in (mask_t0, mask_t1, mask_t2, mask_t3) if t is not None)
    fn = maskfn.parse(mask_fn)
    if not tensors or len(tensors) != fn.n_tensors:
        raise ValueError(f"balance_plan balances a mask function over its per-token tensors; the function reads "
                         f"{fn.n_tensors}, the op got {len(tensors)}")
    return balance.make_plan(fn, tensors, is_causal, batch, heads, group, rank, world, layout, threshold)


@balance_plan_op.register_fake
def _(mask_fn, is_causal, batch, heads, group_name, world_size, layout, threshold, mask_t0=None, mask_t1=None,
      mask_t2=None, mask_t3=None):
    return torch.empty((world_size, balance.MAX_CHUNKS), dtype=torch.int64, device="cpu")


def _ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_valid: Optional[torch.Tensor],
    is_causal: bool,
    scale: float,
    group_name: str,
    world_size: int,
    layout: str,
    window: int = 0,
    key_runs: Optional[torch.Tensor] = None,
    sinks: Optional[torch.Tensor] = None,
    mask_fn: str = "",
    mask_t0: Optional[torch.Tensor] = None,
    mask_t1: Optional[torch.Tensor] = None,
    mask_t2: Optional[torch.Tensor] = None,
    mask_t3: Optional[torch.Tensor] = None,
    score_fn: str = "",
    score_t0: Optional[torch.Tensor] = None,
    score_t1: Optional[torch.Tensor] = None,
    score_t2: Optional[torch.Tensor] = None,
    score_t3: Optional[torch.Tensor] = None,
    balance_plan: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    setup = _setup(q, k, key_valid, group_name, world_size, layout, is_causal, scale, window, forward=True)
    _check_sinks(sinks, q)
    fn = _mask_fn(mask_fn, (mask_t0, mask_t1, mask_t2, mask_t3), q, window)
    score = _score_fn(score_fn, (score_t0, score_t1, score_t2, score_t3), q)
    moves = _moves(balance_plan, setup, q, fn, key_valid)
    if moves is not None:  # Note [Balanced ring] in balance.py
        q, k, v = moves.there(q, k, v)
        setup = dataclasses.replace(setup, chunks=moves.table)
    if fn is None and score is None and graphs.wanted(q, key_valid, key_runs, window):  # Note [Ring graphs]
        def forward(q, k, v):
            out, lse = ring_forward(q, k, v, None, setup, None)
            return out.contiguous(), lse.contiguous()

        out, lse = graphs.run(("ring_attention", group_name, world_size, layout, is_causal, scale,
                               workspace.chunk_rule_settings(), schedule_settings()), forward, (q, k, v),
                              setup.group)
    else:
        out, lse = ring_forward(q, k, v, key_valid, setup, key_runs, score, fn)
    if moves is not None:
        out, lse = moves.back(out, lse)
    if sinks is not None:  # Note [Attention sinks]
        out, lse = merge_sinks(out, lse, sinks)
    return out.contiguous(), lse.contiguous()


ring_attention_op = torch.library.custom_op("ringcc::ring_attention", _ring_attention, mutates_args=())


def _check_sinks(sinks, q):
    if sinks is not None and (sinks.shape != (q.shape[1],) or not sinks.is_floating_point()):
        raise ValueError(f"sinks must be a float [heads={q.shape[1]}] tensor (one sink logit per query head); got "
                         f"{sinks.dtype} {tuple(sinks.shape)}")


# The tensors a mask function reads travel as the op's mask_t0..mask_t3 (a list of tensors
# cannot be an optional argument of a custom op's schema).
MASK_TENSORS = 4


def _mask_fn(text: str, slots, q, window: int):
    """(MaskFn, its tensors) of the op's mask function (Note [Mask functions] in maskfn.py), or None."""
    inputs = tuple(t for t in slots if t is not None)
    if not text:
        if inputs:
            raise ValueError(f"ring_attention got {len(inputs)} mask tensors (mask_t0..) but no mask_fn")
        return None
    fn = maskfn.parse(text)
    if len(inputs) != fn.n_tensors or any(t is None for t in slots[:fn.n_tensors]):
        raise ValueError(f"the mask function reads {fn.n_tensors} tensors, as mask_t0..mask_t{fn.n_tensors - 1}; "
                         f"ring_attention got {[t is not None for t in slots]}")
    if window:
        raise ValueError(f"ring_attention takes a window or a mask function, not both (window={window}); write the "
                         "window into the function (q - kv < window)")
    for i, t in enumerate(inputs):
        if t.device != q.device:
            raise ValueError(f"mask_inputs[{i}] is on {t.device}, q on {q.device}")
    return fn, inputs


def _moves(plan, setup: RingSetup, q, fn, key_valid):
    """The moves of this call's rows to the balance plan's chunks and back (Note [Balanced ring] in
    balance.py), or None: no plan, or the layout's own chunks."""
    if plan is None:
        return None
    if fn is None or key_valid is not None:
        got = "no mask function" if fn is None else "a key padding mask"
        raise ValueError(f"ring_attention takes a balance plan with a mask function and no key padding mask (its runs "
                         f"follow the layout); got {got}: drop balance_plan")
    table = balance.read_plan(plan, setup.world, setup.layout)
    if table is None:
        return None
    return balance.Moves(table, setup.world, setup.layout, setup.rank, q.shape[2], setup.group, q.device)


def _score_fn(text: str, slots, q):
    """(MaskFn, its tensors) of the op's score function (Note [Score functions] in maskfn.py), or None."""
    inputs = tuple(t for t in slots if t is not None)
    if not text:
        if inputs:
            raise ValueError(f"ring_attention got {len(inputs)} score tensors (score_t0..) but no score_fn")
        return None
    fn = maskfn.parse(text)
    if fn.kind != "score":
        raise ValueError(f"score_fn must be a score function ('{maskfn.SCORE_VERSION} tensors=<k>'); got a mask "
                         "function")
    if len(inputs) != fn.n_tensors or any(t is None for t in slots[:fn.n_tensors]):
        raise ValueError(f"the score function reads {fn.n_tensors} tensors, as score_t0..score_t{fn.n_tensors - 1}; "
                         f"ring_attention got {[t is not None for t in slots]}")
    for i, t in enumerate(inputs):
        if t.device != q.device:
            raise ValueError(f"score_t{i} is on {t.device}, q on {q.device}")
    return fn, inputs


@ring_attention_op.register_fake
def _(q, k, v, key_valid, is_causal, scale, group_name, world_size, layout, window=0, key_runs=None, sinks=None,
      mask_fn="", mask_t0=None, mask_t1=None, mask_t2=None, mask_t3=None, score_fn="", score_t0=None, score_t1=None,
      score_t2=None, score_t3=None, balance_plan=None):
    adt = kernels.acc_dtype(q.dtype)
    out = q.new_empty((*q.shape[:3], v.shape[-1]))
    lse = q.new_empty(q.shape[:-1], dtype=adt)
    return out, lse


def _ring_attention_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_valid: Optional[torch.Tensor],
    out: torch.Tensor,
    lse: torch.Tensor,
    is_causal: bool,
    scale: float,
    group_name: str,
    world_size: int,
    layout: str,
    window: int = 0,
    key_runs: Optional[torch.Tensor] = None,
    mask_fn: str = "",
    mask_t0: Optional[torch.Tensor] = None,
    mask_t1: Optional[torch.Tensor] = None,
    mask_t2: Optional[torch.Tensor] = None,
    mask_t3: Optional[torch.Tensor] = None,
    score_fn: str = "",
    score_t0: Optional[torch.Tensor] = None,
    score_t1: Optional[torch.Tensor] = None,
    score_t2: Optional[torch.Tensor] = None,
    score_t3: Optional[torch.Tensor] = None,
    balance_plan: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of ring attention given its (out, lse) (with sinks: the merged ones, which is
    all the ring's backward needs: Note [Attention sinks])."""
    setup = _setup(q, k, key_valid, group_name, world_size, layout, is_causal, scale, window, forward=False)
    fn = _mask_fn(mask_fn, (mask_t0, mask_t1, mask_t2, mask_t3), q, window)
    score = _score_fn(score_fn, (score_t0, score_t1, score_t2, score_t3), q)
    moves = _moves(balance_plan, setup, q, fn, key_valid)
    if moves is not None:  # Note [Balanced ring] in balance.py
        dout, q, k, v, out, lse = moves.there(dout, q, k, v, out, lse)
        setup = dataclasses.replace(setup, chunks=moves.table)
    if fn is None and score is None and graphs.wanted(q, key_valid, key_runs, window):  # Note [Ring graphs]
        def backward(dout, q, k, v, out, lse):
            return tuple(t.contiguous() for t in ring_backward(dout, q, k, v, None, out, lse, setup, None))

        return graphs.run(("ring_attention_backward", group_name, world_size, layout, is_causal, scale,
                           workspace.chunk_rule_settings(), schedule_settings()), backward,
                          (dout, q, k, v, out, lse), setup.group)
    dq, dk, dv = ring_backward(dout, q, k, v, key_valid, out, lse, setup, key_runs, score, fn)
    if moves is not None:
        dq, dk, dv = moves.back(dq, dk, dv)
    return dq.contiguous(), dk.contiguous(), dv.contiguous()


ring_attention_backward_op = torch.library.custom_op("ringcc::ring_attention_backward", _ring_attention_backward,
                                                     mutates_args=())


@ring_attention_backward_op.register_fake
def _(dout, q, k, v, key_valid, out, lse, is_causal, scale, group_name, world_size, layout, window=0,
      key_runs=None, mask_fn="", mask_t0=None, mask_t1=None, mask_t2=None, mask_t3=None, score_fn="", score_t0=None,
      score_t1=None, score_t2=None, score_t3=None, balance_plan=None):
    cf = torch.contiguous_format
    return (
        torch.empty_like(q, memory_format=cf),
        torch.empty_like(k, memory_format=cf),
        torch.empty_like(v, memory_format=cf),
    )


def _ring_setup_context(ctx, inputs, output):
    (q, k, v, key_valid, is_causal, scale, group_name, world_size, layout, window, key_runs, sinks,
     mask_fn, *rest) = inputs
    mask_inputs, score_fn = rest[:MASK_TENSORS], rest[MASK_TENSORS]
    score_inputs, plan = rest[MASK_TENSORS + 1:-1], rest[-1]
    if any(t is not None and t.requires_grad for t in score_inputs):
        raise ValueError("ring_attention takes score function tensors that need no gradient (constants, as ALiBi "
                         "slopes are); got a score_t<k> with requires_grad=True: detach it, or run this attention "
                         "without ringcc")
    out, lse = output
    ctx.save_for_backward(q, k, v, key_valid, out, lse, key_runs, sinks, plan, *mask_inputs, *score_inputs)
    ctx.args = (is_causal, scale, group_name, world_size, layout, window)
    ctx.mask_fn, ctx.score_fn = mask_fn, score_fn
    ctx.mark_non_differentiable(lse)
    # dlse is never used: no zero-filled [b, h, s] gradient per backward call.
    ctx.set_materialize_grads(False)


def _ring_backward(ctx, dout, dlse, backward=ring_attention_backward_op):
    if dout is None:  # nothing flows back through out
        return (None,) * 23
    q, k, v, key_valid, out, lse, key_runs, sinks, plan, *rest = ctx.saved_tensors
    mask_inputs, score_inputs = rest[:MASK_TENSORS], rest[MASK_TENSORS:]
    dq, dk, dv = backward(dout, q, k, v, key_valid, out, lse, *ctx.args, key_runs, ctx.mask_fn, *mask_inputs,
                          ctx.score_fn, *score_inputs, plan)
    dsinks = None if sinks is None or not ctx.needs_input_grad[11] else sink_grad(dout, out, lse, sinks)
    return (dq, dk, dv) + (None,) * 8 + (dsinks,) + (None,) * 11


ring_attention_op.register_autograd(_ring_backward, setup_context=_ring_setup_context)
amp.register_autocast("ring_attention")  # Note [Attention under autocast] in amp.py


class _EagerRing(torch.autograd.Function):
    """ring_attention_op's autograd with nothing between it and the op's Python (Note [Eager
    ring calls]): the same setup_context and backward."""

    @staticmethod
    def forward(ctx, *inputs):
        output = _ring_attention(*inputs)
        _ring_setup_context(ctx, inputs, output)
        return output

    @staticmethod
    def backward(ctx, dout, dlse):
        return _ring_backward(ctx, dout, dlse, _ring_attention_backward)


def ring_attention_call(*inputs):
    """ring_attention_op(*inputs), all 23 arguments given, through `_EagerRing` where nothing
    stands between the caller and the op's kernels.

    Note [Eager ring calls]
    An eager call of a custom op passes torch's layers before the op's Python runs: the
    dispatcher, the autocast kernel, the autograd kernel that torch.library builds (argument
    defaults, alias checks, a redispatch below autograd), and on the way back the same for the
    backward op. At p = 1 on a GPU that is host time the GPU waits for between a step's kernels.
    Where the call is plain eager (no compile trace, no dispatch or function mode, no functorch
    transform, no tensor subclass: `_compat.plain_eager`), an autograd.Function runs the same
    Python with the same setup_context and backward; under autocast it casts q, k and v and
    runs below autocast, as the op's autocast kernel does. Every other call (a compiled graph,
    fake tensors, DTensor, FlopCounterMode, torch.func) takes the op."""
    if not _compat.plain_eager(inputs):
        return ring_attention_op(*inputs)
    device_type = inputs[0].device.type
    if amp.autocast_dtype(device_type) is None:
        return _EagerRing.apply(*inputs)
    with _compat.below_autocast(device_type):
        return _EagerRing.apply(*amp.cast_qkv(*inputs[:3]), *inputs[3:])


# ---------------------------------------------------------------------------------------
# rows with no key under a finite additive mask

# Note [Rows with no key]
# An additive mask whose masked value is finite (transformers' eager masks add finfo(dtype).min)
# and erases the score it is added to (s + fill == fill in the site's dtype) leaves a query row
# whose keys are all masked with n equal scores: eager's softmax gives it P_ij = 1/n over the n
# keys of the whole sequence, out_i = vbar = mean_j v_j, and its autograd differentiates that
# softmax as if the scores were there. With D_i = dO_i . out_i = dO_i . vbar, per batch row and kv
# head (the query heads of its group summed), over the empty rows E of every rank:
#   dq_i  = (scale / n) (M dO_i - D_i ksum),     M = sum_j k_j v_j^T, ksum = sum_j k_j
#   dk_j += (scale / n) A (v_j - vbar),          A = sum_{i in E} q_i dO_i^T  (A vbar = sum_i D_i q_i)
#   dv_j += (1 / n) sum_{i in E} dO_i
# The ring gives such a row no key (out 0, lse -inf; with attention sinks a row always has its
# sink, as in eager, where the sink outweighs a finite fill): ringcc::fill_empty_rows, after the
# ring op, puts eager's row there. Every term is a sum over keys or rows, O(b h d^2): local sums and
# one all-reduce over the group per direction, issued by every rank whatever rows it holds. Sums
# are order-free, so the layout (zigzag, balance plans) does not matter; where Config(pad=True)
# padded the sequence, the keys at global positions >= `length` are not keys of the sequence.
# A score function that adds a bias (ALiBi) keeps d score / d s = 1, so the formulas hold; a
# non-linear one (soft-cap) weighs each pair by its derivative, and the rewrite leaves such rows at
# 0 and says so in the report (passes/rewrite_attention.py).


def _keys_of_sequence(k, rank: int, world: int, layout: str, length: int) -> tuple[Optional[torch.Tensor], int]:
    """(which local key rows are keys of the sequence, [n_local] bool, or None for all; n)."""
    n_local = k.shape[2]
    total = n_local * world
    if not length or length == total:
        return None, total
    if not 0 < length < total:
        raise ValueError(f"fill_empty_rows: length {length} must be in (0, {total}] (the padded length)")
    pos = L.global_positions(rank, world, L.Layout(layout), n_local, k.device)
    return pos < length, length


def _all_reduce_sum(x: torch.Tensor, group) -> torch.Tensor:
    if group is not None:
        dist.all_reduce(x, group=group)
    return x


def _key_sums(v, keys, adt) -> torch.Tensor:
    """sum over the local keys of the sequence of v [b, g, n, d]: [b, g, d] in `adt`."""
    v = v.to(adt)
    return (v if keys is None else v * keys[:, None]).sum(2)


@torch.library.custom_op("ringcc::fill_empty_rows", mutates_args=())
def fill_empty_rows_op(out: torch.Tensor, lse: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       scale: float, group_name: str, world_size: int, layout: str, length: int = 0) -> torch.Tensor:
    """`out` of a ring op with eager's rows where its `lse` is -inf: the mean of every value of
    the sequence (Note [Rows with no key]). q [b, h, n, d], k [b, g, n, d], v [b, g, n, dv]:
    the ring op's inputs; `length`: the keys of the sequence (0: every key of every rank)."""
    group, rank, world = _group_from(group_name, world_size)
    keys, n = _keys_of_sequence(k, rank, world, layout, length)
    with torch.autocast(q.device.type, enabled=False):
        vbar = _all_reduce_sum(_key_sums(v, keys, kernels.acc_dtype(q.dtype)), group) / n
        rows = vbar.repeat_interleave(q.shape[1] // k.shape[1], 1)[:, :, None].to(out.dtype)
        return torch.where((lse == -math.inf)[..., None], rows, out).contiguous()


@fill_empty_rows_op.register_fake
def _(out, lse, q, k, v, scale, group_name, world_size, layout, length=0):
    return torch.empty_like(out, memory_format=torch.contiguous_format)


@torch.library.custom_op("ringcc::fill_empty_rows_backward", mutates_args=())
def fill_empty_rows_backward_op(dout: torch.Tensor, lse: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                                v: torch.Tensor, scale: float, group_name: str, world_size: int, layout: str,
                                length: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(d out, dq, dk, dv) of ringcc::fill_empty_rows (Note [Rows with no key])."""
    group, rank, world = _group_from(group_name, world_size)
    keys, n = _keys_of_sequence(k, rank, world, layout, length)
    b, h, _, d = q.shape
    g, dv_ = k.shape[1], v.shape[-1]
    adt = kernels.acc_dtype(q.dtype)
    with torch.autocast(q.device.type, enabled=False):
        empty = lse == -math.inf
        e = empty[..., None].to(adt)
        kf, vf = k.to(adt), v.to(adt)
        kk = kf if keys is None else kf * keys[:, None]
        do_e = (dout.to(adt) * e).unflatten(1, (g, h // g))  # [b, g, r, n, dv], the empty rows only
        q_e = (q.to(adt) * e).unflatten(1, (g, h // g))
        parts = [_key_sums(vf, keys, adt), torch.einsum("bgnd,bgne->bgde", kk, vf), kk.sum(2),
                 torch.einsum("bgrnd,bgrne->bgde", q_e, do_e), do_e.sum((2, 3))]
        sizes = [p.numel() for p in parts]
        flat = _all_reduce_sum(torch.cat([p.reshape(-1) for p in parts]), group)
        vsum, m, ksum, a, dsum = (x.view_as(p) for x, p in zip(flat.split(sizes), parts))
        vbar = vsum / n
        dq = (torch.einsum("bgde,bgrne->bgrnd", m, do_e)
              - torch.einsum("bgrne,bge->bgrn", do_e, vbar)[..., None] * ksum[:, :, None, None]) * (scale / n)
        dk = torch.einsum("bgde,bgne->bgnd", a, vf - vbar[:, :, None]) * (scale / n)
        dvv = (dsum / n)[:, :, None].expand(b, g, k.shape[2], dv_)
        if keys is not None:
            dk, dvv = dk * keys[:, None], dvv * keys[:, None]
        dout_ring = dout * ~empty[..., None]
    return (dout_ring.contiguous(), dq.flatten(1, 2).to(q.dtype).contiguous(), dk.to(k.dtype).contiguous(),
            dvv.to(v.dtype).contiguous())


@fill_empty_rows_backward_op.register_fake
def _(dout, lse, q, k, v, scale, group_name, world_size, layout, length=0):
    cf = torch.contiguous_format
    return (torch.empty_like(dout, memory_format=cf), torch.empty_like(q, memory_format=cf),
            torch.empty_like(k, memory_format=cf), torch.empty_like(v, memory_format=cf))


def _fill_setup_context(ctx, inputs, output):
    _, lse, q, k, v, *args = inputs
    ctx.save_for_backward(lse, q, k, v)
    ctx.args = tuple(args)


def _fill_backward(ctx, dout):
    lse, q, k, v = ctx.saved_tensors
    dout_ring, dq, dk, dv = fill_empty_rows_backward_op(dout, lse, q, k, v, *ctx.args)
    return (dout_ring, None, dq, dk, dv) + (None,) * 5


fill_empty_rows_op.register_autograd(_fill_backward, setup_context=_fill_setup_context)


# ---------------------------------------------------------------------------------------
# sequence shard / gather (mirrors of each other in backward)


@torch.library.custom_op("ringcc::shard", mutates_args=())
def shard_op(x: torch.Tensor, dim: int, group_name: str, world_size: int, layout: str) -> torch.Tensor:
    _, rank, world = _group_from(group_name, world_size)
    return L.shard(x, dim, rank, world, L.Layout(layout)).clone(memory_format=torch.contiguous_format)


@shard_op.register_fake
def _(x, dim, group_name, world_size, layout):
    shape = list(x.shape)
    shape[dim] = shape[dim] // world_size
    return x.new_empty(shape)


@torch.library.custom_op("ringcc::gather", mutates_args=())
def gather_op(x: torch.Tensor, dim: int, group_name: str, world_size: int, layout: str) -> torch.Tensor:
    group, _, world = _group_from(group_name, world_size)
    if world == 1:
        return x.clone(memory_format=torch.contiguous_format)
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x, group=group)
    return L.unshard(parts, dim, L.Layout(layout)).contiguous()


@gather_op.register_fake
def _(x, dim, group_name, world_size, layout):
    shape = list(x.shape)
    shape[dim] = shape[dim] * world_size
    return x.new_empty(shape)


def _seq_setup_context(ctx, inputs, output):
    ctx.args = inputs[1:]


def _shard_backward(ctx, grad):
    # Every rank holds the same full input; its gradient is every rank's shard gradient.
    return gather_op(grad, *ctx.args), None, None, None, None


def _gather_backward(ctx, grad):
    # Every rank computes the same replicated downstream; its own slice is its gradient.
    return shard_op(grad, *ctx.args), None, None, None, None


shard_op.register_autograd(_shard_backward, setup_context=_seq_setup_context)
gather_op.register_autograd(_gather_backward, setup_context=_seq_setup_context)


@torch.library.custom_op("ringcc::mask_from_fn", mutates_args=())
def mask_from_fn_op(mask_fn: str, shape: list[int], dtype: torch.dtype, device: torch.device,
                    mask_t0: Optional[torch.Tensor] = None, mask_t1: Optional[torch.Tensor] = None,
                    mask_t2: Optional[torch.Tensor] = None, mask_t3: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The dense mask [.., q, kv] of `shape` and `dtype` (bool, or an additive float mask) whose
    values a mask function gives (Note [Mask functions] in maskfn.py; the indices are the
    trailing dims b, h, q, kv): what a graph reads
    when it uses another graph's mask output (Note [Mask outputs] in ringcc/sharded.py) as a
    tensor. The passes read the node as its function instead (passes/extract_mask.py)."""
    fn = maskfn.parse(mask_fn)
    tensors = tuple(t for t in (mask_t0, mask_t1, mask_t2, mask_t3) if t is not None)
    if len(tensors) != fn.n_tensors or not 2 <= len(shape) <= 4:
        raise ValueError(f"mask_from_fn: the function reads {fn.n_tensors} tensors and takes a [.., q, kv] shape "
                         f"of 2 to 4 dims; got {len(tensors)} tensors and shape {list(shape)}")
    full = [1] * (4 - len(shape)) + list(shape)
    idx = [torch.arange(s, device=device).view([-1 if d == i else 1 for d in range(4)]) for i, s in enumerate(full)]
    m = torch.as_tensor(fn(*idx, tensors), device=device).to(dtype)
    return m.expand(full).reshape(shape).clone(memory_format=torch.contiguous_format)


@mask_from_fn_op.register_fake
def _(mask_fn, shape, dtype, device, mask_t0=None, mask_t1=None, mask_t2=None, mask_t3=None):
    return torch.empty(shape, dtype=dtype, device=device)


# ---------------------------------------------------------------------------------------
# public functional API


def _group_args(group, what: str) -> tuple[str, int, int]:
    group, rank, world = resolve_world(group, what)
    return ("" if group is None else _compat.group_name(group)), world, rank


FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _check_inputs(q, k, v, key_padding_mask, n_local_expected=None, op: str = "ring_attention"):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{op} expects {name} of shape [batch, heads, n_local, head_dim]; got {got}")
        if 0 in t.shape:
            raise ValueError(f"{op} needs at least one batch row, head, token and feature in {name}; "
                             f"got shape {tuple(t.shape)}")
    if q.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{op} takes float16, bfloat16, float32 or float64 q/k/v; got {q.dtype}")
    b, h, s, d = q.shape
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(f"k and v must have the same batch, heads and length (v's head dim may differ); got k "
                         f"{tuple(k.shape)} and v {tuple(v.shape)}")
    if k.shape[0] != b or k.shape[2] != s or k.shape[3] != d:
        raise ValueError(
            f"k must be [batch={b}, kv_heads, n_local={s}, head_dim={d}] and v [batch={b}, kv_heads, "
            f"n_local={s}, v_head_dim] to match q {tuple(q.shape)}; got k {tuple(k.shape)}"
        )
    if h % k.shape[1]:
        raise ValueError(
            f"query heads ({h}) must be a multiple of key/value heads ({k.shape[1]}) for GQA/MQA"
        )
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share a dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device; got {q.device}, {k.device}, {v.device}")
    if key_padding_mask is not None:
        if not isinstance(key_padding_mask, torch.Tensor):
            raise TypeError(f"key_padding_mask must be a bool tensor [batch={b}, n_local={s}] (True = padding, "
                            f"ignored) or None; got {type(key_padding_mask).__name__}; pass torch.tensor(...)")
        if key_padding_mask.shape != (b, s) or key_padding_mask.dtype != torch.bool:
            raise ValueError(
                f"key_padding_mask must be a bool tensor [batch={b}, n_local={s}] (True = padding, "
                f"ignored); got {key_padding_mask.dtype} {tuple(key_padding_mask.shape)}"
            )
        if key_padding_mask.device != q.device:
            raise ValueError(f"key_padding_mask is on {key_padding_mask.device}, q on {q.device}")


_CHECKED_LENGTHS: set[tuple[str, int, str]] = set()

# Runtime settings that shape the ring's schedule (head chunks, whether and how transfers
# happen; the kernel choice enters the head-chunk rule through its GQA workspace), and when
# inputs are compared across ranks: ranks that disagree on them would wait for each other forever.
SCHEDULE_SETTINGS = ("RINGCC_RING_WORKSPACE_MIB", "RINGCC_SKIP_COMM", "RINGCC_RING_TRANSPORT",
                     "RINGCC_CUDA_KERNEL", "RINGCC_CUDNN_NATIVE_GQA", "RINGCC_RING_GRAPHS", "RINGCC_CHECK_INPUTS")


def schedule_settings() -> tuple[str, ...]:
    """This process's values of SCHEDULE_SETTINGS, as "NAME=value" strings, and whether its CUDA
    calls are all checked (`checks_every_call`: ranks that differ would check alone)."""
    return tuple(f"{name}={os.environ.get(name, '')}" for name in SCHEDULE_SETTINGS) + \
        (f"every CUDA call checked (TORCH_DISTRIBUTED_DEBUG=DETAIL)={checks_every_call(True)}",)


def _settings_code() -> int:
    return _crc("\n".join(schedule_settings()))


def call_signature(op: str, q, k, **args) -> str:
    """What every rank's call must agree on besides the length: shapes (but n_local), dtype and
    the arguments that shape the schedule. Empty while dynamo traces (a string built from
    sizes would specialise the graph on them; the compiled backend checks its own graphs'
    decisions across ranks, ringcc/backend.py)."""
    if torch.compiler.is_compiling():
        return ""
    b, h, _, d = q.shape
    dv = args.pop("v_head_dim", d)
    return f"{op}(q [{b}, {h}, n_local, {d}] {q.dtype}, {k.shape[1]} K/V heads, v head dim {dv}, " + \
        ", ".join(f"{name}={args[name]!r}" for name in sorted(args)) + ")"


def _crc(text: str) -> int:
    import zlib

    return zlib.crc32(text.encode()) & 0x7FFFFFFF


# Note [Input checksum]
# Every rank of a sequence group must be called with the same data: each computes its own
# tokens of one sequence, and ranks fed different batches return rank 0's first part joined
# to rank 1's second part, with no error. The check is a checksum of each data input,
# computed on its device and compared in the collective that compares the shapes, so it adds
# no host sync. Each element's bits (as an integer of its width) are summed in int64 with an
# odd weight from their position (2i + 1), wrapping: one differing element always changes the
# sum, and so does swapping two tokens. Tensors of more than _CHECKSUM_ROW_ELEMENTS elements
# are summed per row of their last dim first (their features), then weighted per row, so no
# temporary of their size is made (rows swapped still change the sum; features swapped within
# a row do not). The code is kept to 62 bits, so that its negation (group_extremes) does not
# overflow.
_CHECKSUM_ROW_ELEMENTS = 1 << 22
_INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def content_code(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """A 62-bit checksum of `tensors`' values as a 0-d int64 tensor on their device, with no host
    sync (Note [Input checksum]); None for no tensors."""
    code = None
    for t in tensors:
        if t.is_complex():
            t = torch.view_as_real(t)
        bits = t.view(_INT_OF_WIDTH[t.element_size()])
        width = t.shape[-1] if t.numel() > _CHECKSUM_ROW_ELEMENTS and t.dim() > 1 else 1
        rows = bits.reshape(-1, width).sum(-1, dtype=torch.int64) if width > 1 else bits.reshape(-1).to(torch.int64)
        weights = torch.arange(1, 2 * rows.numel(), 2, dtype=torch.int64, device=rows.device)
        one = (rows * weights).sum()
        code = one if code is None else code * 1000003 + one
    return None if code is None else code & ((1 << 62) - 1)


def checks_every_call(cuda: bool) -> bool:
    """Whether `_check_same_call` runs on every call: always on CPU; on CUDA only at debug level
    DETAIL (TORCH_DISTRIBUTED_DEBUG=DETAIL when torch.distributed is imported, or
    dist.set_debug_level), and not while dynamo traces (it cannot trace the level's read; a
    compiled call keeps the once-per-signature check)."""
    if not cuda:
        return True
    return not torch.compiler.is_compiling() and dist.get_debug_level() == dist.DebugLevel.DETAIL


def _check_same_call(n_local: int, group, call: str = "", device=None, error: Exception | None = None) -> None:
    """Every rank must hold a shard of the same length, make the same call (`call_signature`:
    shapes, dtype, mask, layout, ...) and run with the same schedule settings; else the ring
    would hang, or compute with what another rank sent in another format. Callers run it
    before any check of their own that could fail on one rank alone (which would leave the
    others waiting in this collective).

    The check is a collective plus a host sync. On CPU tensors it runs on every call (cheap
    next to CPU attention). On CUDA it runs once per (group, length, call), since a host sync
    per call stalls the GPU pipeline: a rank that later makes a new call while the others
    repeat a checked one enters this collective alone, and the ranks hang until the NCCL
    watchdog's timeout (as a ring of mismatched calls would). Under PyTorch's own switch for
    such hangs, TORCH_DISTRIBUTED_DEBUG=DETAIL, it runs on every call there too
    (`checks_every_call`): the hang becomes this error, at a host sync per call.

    `error`: this rank's inputs were rejected (the caller's own checks). The rank still takes
    part, with a flag in the same collective, and every rank raises: the others must not wait
    for a rank that left (a notebook or a retry loop keeps its process alive).
    """
    group, _, world = resolve_world(group)
    if world == 1:
        if error is not None:
            raise error
        return
    key = (_compat.group_name(group), n_local, call)
    cuda = device is not None and torch.device(device).type == "cuda"
    if error is None and not checks_every_call(cuda) and key in _CHECKED_LENGTHS:
        return
    code, call_code = _settings_code(), _crc(call)
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    (n_lo, n_hi), codes, calls, (_, rejected) = group_extremes(
        [n_local, code, call_code, int(error is not None)], group, device)
    if error is not None:
        raise error
    if rejected:
        raise ValueError(
            f"another rank's inputs to this attention call were rejected (its error says why); this rank's "
            f"call was {call or 'the same op'} with n_local={n_local}. Every rank raises instead of waiting for it")
    if n_lo != n_local or n_hi != n_local:
        raise ValueError(
            f"ring_attention needs equal shard lengths on every rank; this rank has {n_local}, "
            f"the group has lengths from {n_lo} to {n_hi}"
        )
    if codes != (code, code):
        raise ValueError(
            f"ranks run ring attention with different runtime settings (this rank: "
            f"{', '.join(schedule_settings())}); set {', '.join(SCHEDULE_SETTINGS)} and the debug level "
            f"(TORCH_DISTRIBUTED_DEBUG) the same on every rank"
        )
    if calls != (call_code, call_code):
        raise ValueError(
            f"ranks call attention with different arguments; this rank: {call}. Every rank must pass "
            f"the same shapes (but n_local), dtype, masks and options")
    if len(_CHECKED_LENGTHS) >= 4096:  # every rank clears at the same call (they made the same ones)
        _CHECKED_LENGTHS.clear()
    _CHECKED_LENGTHS.add(key)


def ring_attention(
    q, k, v, *, is_causal: bool = False, scale: float | None = None, key_padding_mask=None,
    group=None, layout: str = "contiguous", return_lse: bool = False, window: int | None = None,
    softcap: float | None = None, alibi_slopes=None, sinks=None,
):
    """Exact attention over a sequence sharded across the ranks of `group`.

    q: [b, h, n_local, d]; k, v: [b, h_kv, n_local, d] with h % h_kv == 0. The shards are
    this rank's part of a global sequence of n = n_local * p tokens in `layout`
    ("contiguous", or "zigzag": rank r holds chunks r and 2p-1-r). key_padding_mask:
    optional bool [b, n_local], True marks a padding key (ignored), as in
    nn.MultiheadAttention. window: optional sliding window in global positions (key j is
    visible to query i iff |i - j| < window; i - j < window when causal). Causality is in
    global positions. Returns this rank's shard of the output (and the fp32 natural-log
    LSE [b, h, n_local] when return_lse; the LSE carries no gradient: it is marked
    non-differentiable, so a loss that uses it gets no gradient through it).
    Score modifiers, applied to the scaled scores s before the mask as one score function (Note
    [Score functions] in maskfn.py): softcap c > 0 gives c * tanh(s / c) (Gemma2); alibi_slopes, a
    [h] tensor that needs no gradient, adds slope[head] * (j - i) in global positions (ALiBi:
    Bloom, MPT).
    v may have its own head dim dv (MLA): out is [b, h, n_local, dv]. sinks: optional float [h],
    one logit per query head added to every row's softmax denominator with no value (gpt-oss;
    Note [Attention sinks]); its gradient is this rank's share, to be summed over the ranks as
    the gradients of the weights that made q, k and v are.
    """
    name, world, _ = _group_args(group, "ring_attention")
    q, k, v = amp.cast_qkv(q, k, v)  # SDPA's autocast policy (Note [Attention under autocast])
    try:  # every rank agrees on the call before any raises (_check_same_call)
        _check_inputs(q, k, v, key_padding_mask)
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
            raise ValueError(f"window must be a positive int (sliding window in tokens) or None; got {window!r}")
        if softcap is not None and (isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not softcap > 0):
            raise ValueError(f"softcap must be a positive number (the soft-cap c of c * tanh(s / c)) or None; got {softcap!r}")
        if alibi_slopes is not None and (not isinstance(alibi_slopes, torch.Tensor) or alibi_slopes.shape != (q.shape[1],)
                                         or not alibi_slopes.is_floating_point()):
            got = tuple(alibi_slopes.shape) if isinstance(alibi_slopes, torch.Tensor) else type(alibi_slopes).__name__
            raise ValueError(f"alibi_slopes must be a float tensor [heads={q.shape[1]}] (one slope per query head) or "
                             f"None; got {got}")
        if sinks is not None and (not isinstance(sinks, torch.Tensor) or sinks.shape != (q.shape[1],)
                                  or not sinks.is_floating_point() or sinks.device != q.device):
            got = (f"{sinks.dtype} {tuple(sinks.shape)} on {sinks.device}" if isinstance(sinks, torch.Tensor)
                   else type(sinks).__name__)
            raise ValueError(f"sinks must be a float tensor [heads={q.shape[1]}] on {q.device} (one sink logit per "
                             f"query head) or None; got {got}")
        lay = L.parse_layout(layout)
        scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
        score_fn = maskfn.builtin_score_fn(softcap, alibi_slopes is not None)
    except (TypeError, ValueError) as e:
        _check_same_call(-1, group, "", _device_of(q), error=e)
        raise
    s = q.shape[2]
    score_text = "" if score_fn is None else score_fn.text
    if world > 1:  # (a group of one has no other rank to agree with: _check_same_call)
        _check_same_call(s, group, call_signature(
            "ring_attention", q, k, is_causal=bool(is_causal), scale=scale,
            key_padding_mask=key_padding_mask is not None, layout=lay.value, window=window or 0, score_fn=score_text,
            sinks=sinks is not None, v_head_dim=v.shape[-1]), q.device)
    if lay is L.Layout.ZIGZAG and s % 2:
        raise ValueError(f"zigzag layout needs an even n_local (two chunks per rank); got n_local={s}")
    key_valid = None if key_padding_mask is None else ~key_padding_mask
    # made once here: the op's backward reuses it (Note [Key runs per mask]). Traced by
    # torch.compile, the op makes its own instead: a host table made outside a CUDA graph
    # (mode="reduce-overhead") is not one the captured op may follow (ring._key_runs).
    runs = None if key_valid is None or torch.compiler.is_compiling() else key_runs_op(key_valid, name, world)
    slopes = None if alibi_slopes is None else alibi_slopes.to(q.device, torch.float32)
    out, lse = ring_attention_call(q, k, v, key_valid, bool(is_causal), scale, name, world, lay.value, window or 0,
                                   runs, sinks, "", None, None, None, None, score_text, slopes, None, None, None, None)
    return (out, lse) if return_lse else out


def _device_of(x):
    return x.device if isinstance(x, torch.Tensor) else None


def _seq_dim(x, dim: int) -> int:
    """`dim` of x, negative counted from the end; out of range is an error, not a wrap-around."""
    if isinstance(dim, bool) or not isinstance(dim, int) or not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim must be an int in [{-x.dim()}, {x.dim() - 1}] for a {x.dim()}-D tensor of shape "
                         f"{tuple(x.shape)}; got {dim!r}")
    return dim % x.dim()


def shard_sequence(x, dim: int, *, group=None, layout: str = "contiguous"):
    """This rank's shard of the full-length `x` along `dim` (differentiable). Every rank of the
    group must pass the same `x`: the ranks compare its shape and checksum first (Note [Input
    checksum]; at every call, or once per shape under RINGCC_CHECK_INPUTS=first_call; not while
    dynamo traces, where the compiled graph's own check runs)."""
    lay = L.parse_layout(layout)
    name, world, _ = _group_args(group, "shard_sequence")
    dim = _seq_dim(x, dim)
    L.check_length(x.shape[dim], world, lay)
    if world > 1 and not torch.compiler.is_compiling():
        _check_same_data(x, group, name)
    return shard_op(x, dim, name, world, lay.value)


SAME_BATCH_REMEDY = (
    "Every rank of a sequence group computes its own part of one sequence, so every rank of the group "
    "must be fed the same batch (as eager code on one device would be). A DistributedSampler, HF Trainer "
    "or accelerate gives each rank its own batch by default. With data parallelism, build a DeviceMesh "
    "(dp x cp), shard the sequence over cp (Config(mesh=mesh, axis='cp'), or group=mesh.get_group('cp')) "
    "and the data over dp only: DistributedSampler(dataset, num_replicas=mesh['dp'].size(), "
    "rank=mesh['dp'].get_local_rank()); docs/sharp-edges.md shows it for a plain loop and for HF Trainer / "
    "accelerate")
_CHECKED_DATA: set[tuple[str, tuple]] = set()


def _check_same_data(x: torch.Tensor, group, group_name: str) -> None:
    """The full input of shard_sequence is the same on every rank of the group (shape and
    checksum, one all-reduce)."""
    from ringcc.config import Config

    key = (group_name, tuple(x.shape))
    if Config.from_options().check_inputs == "first_call" and key in _CHECKED_DATA:
        return
    shape = _crc(str(tuple(x.shape)) + str(x.dtype))
    device = torch.device("cuda", torch.cuda.current_device()) if x.is_cuda else torch.device("cpu")
    (lo, hi), (content_lo, content_hi) = group_extremes([shape, content_code([x.detach()]).to(device)],
                                                        group, device)
    if lo != hi or content_lo != content_hi:
        what = "shapes or dtypes" if lo != hi else "values"
        raise ValueError(f"ranks passed shard_sequence full inputs of different {what} (this rank: "
                         f"{tuple(x.shape)} {x.dtype}). {SAME_BATCH_REMEDY}")
    if len(_CHECKED_DATA) >= 4096:  # every rank clears at the same call (they made the same ones)
        _CHECKED_DATA.clear()
    _CHECKED_DATA.add(key)


def gather_sequence(x, dim: int, *, group=None, layout: str = "contiguous"):
    """Full-length tensor from every rank's shard along `dim` (the inverse of shard_sequence)."""
    lay = L.parse_layout(layout)
    name, world, _ = _group_args(group, "gather_sequence")
    dim = _seq_dim(x, dim)
    if lay is L.Layout.ZIGZAG and x.shape[dim] % 2:
        raise ValueError(f"zigzag layout needs an even shard length; got {x.shape[dim]} along dim {dim}")
    return gather_op(x, dim, name, world, lay.value)
