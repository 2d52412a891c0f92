"""LongNet dilated attention: the single-device and ring algorithms, their custom ops and the
public `dilated_attention` (the spec and its index plans: dilated_spec.py).

Legend: q_bhsd [b, h, s, d] with s = n_local (this rank's shard); k_bgsd / v_bgsd
[b, g, s, d] with h % g == 0 (GQA); "_c" tensors are compressed: only the active rows of
one branch, [b, heads or slots, s / r, d]; lse is natural-log, fp32 (fp64 for fp64 inputs).

Note [Dilated attention]
Branch i has a segment length w_i and a dilation rate r_i. In head h, query t is active iff
(t mod w_i) mod r_i == offset(h, i); it attends to the active keys of its own segment (j <= t
when causal, global positions). All branches are blocks of ONE softmax over the union of
their key sets (a key present in two branches counts twice, LongNet's softmax-denominator
weights): forward LSE-merges the branches' (out_i, lse_i); backward runs each branch's block
backward with the GLOBAL merged (out, lse) and sums, which is the exact gradient of the
merged output, mixing weights included.

Compression. Segments are aligned to the shard (see `_branch_mode` in dilated_spec.py), so in local row index i
the rule reads i mod r == offset: a head's active rows are offset + r * j, in position order,
i.e. the strided view x[:, head, offset::r]. Equally spaced heads with one offset form one
view x[:, h0:h1:step, offset::r] (`pieces`), so a branch's compressed tensor is one strided
copy per run of heads (none when it takes every row of every head, r = 1), and gradients go
back by strided in-place adds: no index tensors, no gather / index_add kernels (on 4 x H200 the
index kernels were 40% of the dilated time at 1M tokens; replacing them made fwd+bwd 1.2-1.4x
faster). Causal masking inside a segment is the causal
diagonal of the compressed block. K/V are gathered per *slot* = (kv head, offset):
GQA query heads that share a kv head and an offset share a slot, so K/V keep their own
(fewer) heads where the offsets allow. Query heads are ordered slot-major, so a slot serves
c consecutive query heads (the kernels' GQA expansion). When slots would serve unequal
numbers of heads, every query head gets its own slot (c = 1).

Modes per branch (decided once per shape and cached with the index plan):
- local: the (clipped) segment fits in a layout chunk: segments fold into the batch dim, one
  dense kernel call, no communication.
- ring (contiguous layout): the segment spans k = w / s consecutive ranks. Those k ranks run
  the exact ring schedule (Note [Ring attention schedule] in ring.py) on the compressed
  tensors, around their own sub-ring only: each rank sends (k - 1) blocks of s / r rows per
  slot, i.e. (w - s) / r rows, independent of n and p. The sub-ring's chunk order is the
  position order, so causal blocks are skipped / full / diagonal as in the dense ring.

Note [Dilated head chunks]
The fp32 accumulators (out in forward; dQ, dK, dV in backward) of all heads at once are 2x
and 6x a bf16 input: at 512K tokens per rank (MHA h=16, d=128) 4 and 12 GiB, the largest part
of the op's memory. Heads never mix, so forward and backward may each run the whole
algorithm once per chunk of K/V heads (with their query heads), writing each chunk's result
into the output, and hold one chunk's accumulators and branch tensors at a time. The same
rule as the ring's head chunks (workspace.dilated_kv_chunk, the budget of
RINGCC_RING_WORKSPACE_MIB or its default, which for this op is never under 4 GiB: a chunk
repeats every branch, and at short lengths the sub-ring branches are latency-bound): the
largest chunk whose workspace fits, else one K/V head. A chunk's plan indexes its heads from its first query head; the offsets stay those
of the global heads (`chunk_pairs`), so the arithmetic of every head is unchanged (the same
bits, tests/test_dilated.py). Every rank takes the same chunks, so the sub-rings' calls match.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from . import amp, kernels
from . import layout as L
from . import workspace
from .dilated_spec import BranchPlan, DilatedSpec, dilated_plan
from .dilated_spec import branch_heads, dilated_comm_rows, dilated_kv_slots  # noqa: F401 (this module's API too)
from .merge import merge_
from .ops import _check_inputs, _check_same_call, _device_of, _group_args, _group_from, call_signature
from .ring import RingSetup, head_chunks, ring_backward, ring_forward


# ---------------------------------------------------------------------------------------
# compressed rows


@dataclass(frozen=True)
class Piece:
    """Compressed heads [c0, c1) are the rows offset::r of the heads start:stop:step."""

    c0: int
    c1: int
    start: int
    stop: int
    step: int
    offset: int


def pieces(heads: tuple[int, ...], offsets: tuple[int, ...]) -> tuple[Piece, ...]:
    """The (head, offset) list of a compressed tensor as runs of equally spaced heads with one
    offset: each run is a strided view of the full tensor (no index tensor, no gather kernel).
    A head never repeats within a run, so adding a run in place never meets itself."""
    out: list[Piece] = []
    i = 0
    while i < len(heads):
        j, step = i + 1, None
        while j < len(heads) and offsets[j] == offsets[i]:
            d = heads[j] - heads[j - 1]
            if d <= 0 or (step is not None and d != step):
                break
            step, j = d, j + 1
        step = step or 1
        out.append(Piece(i, j, heads[i], heads[j - 1] + 1, step, offsets[i]))
        i = j
    return tuple(out)


@functools.lru_cache(maxsize=256)
def _branch_pieces(bp: BranchPlan) -> tuple[tuple[Piece, ...], tuple[Piece, ...]]:
    """(query pieces, K/V slot pieces) of a branch."""
    return pieces(bp.q_heads, bp.q_offsets), pieces(bp.slot_kv, bp.slot_offsets)


def _rows(x, pc: Piece, r: int):
    """The strided view of piece `pc` in x [b, heads, s, ...]: [b, c1 - c0, s / r, ...]."""
    return x[:, pc.start:pc.stop:pc.step, pc.offset::r]


def _is_whole(ps: tuple[Piece, ...], r: int, heads: int) -> bool:
    return r == 1 and len(ps) == 1 and ps[0].start == 0 and ps[0].stop == heads and ps[0].step == 1


def compress(x, ps: tuple[Piece, ...], r: int):
    """The compressed rows of x [b, heads, s, ...] (contiguous; x itself when a branch takes
    every row of every head in order)."""
    if _is_whole(ps, r, x.shape[1]):
        return x.contiguous()
    if len(ps) == 1:
        return _rows(x, ps[0], r).contiguous()
    return torch.cat([_rows(x, pc, r) for pc in ps], dim=1)


def expand_(acc, x_c, ps: tuple[Piece, ...], r: int, add: bool) -> None:
    """acc's compressed rows (strided views, acc [b, heads, s, ...]) += x_c, or = x_c."""
    for pc in ps:
        dst, src = _rows(acc, pc, r), x_c[:, pc.c0:pc.c1]
        dst.add_(src) if add else dst.copy_(src)


# ---------------------------------------------------------------------------------------
# the algorithm


@dataclass(frozen=True)
class HeadChunk:
    """Query heads [h0, h1) and K/V heads [g0, g1) of dim 1, and the branch plans of that
    chunk, its heads indexed within it."""

    h0: int
    h1: int
    g0: int
    g1: int
    plans: tuple[BranchPlan, ...]

    @property
    def heads(self) -> slice:
        return slice(self.h0, self.h1)

    @property
    def kv(self) -> slice:
        return slice(self.g0, self.g1)


@dataclass(frozen=True)
class DilatedSetup:
    group: object
    rank: int
    world: int
    plans: tuple[BranchPlan, ...]  # all heads at once
    is_causal: bool
    scale: float
    # Head chunks of the forward and of the backward (Note [Dilated head chunks]); () runs
    # all heads at once on `plans`.
    forward_chunks: tuple[HeadChunk, ...] = ()
    backward_chunks: tuple[HeadChunk, ...] = ()

    def ring(self, bp: BranchPlan) -> RingSetup:
        return RingSetup(
            self.group, bp.pos, len(bp.members), L.Layout.CONTIGUOUS, self.is_causal, self.scale, bp.members
        )


def _to_segments(x, seg_rows: int):
    """[b, h, s/r, ...] -> [b * segments, h, seg_rows, ...] (segments fold into the batch)."""
    b, h, nr = x.shape[:3]
    x = x.reshape(b, h, nr // seg_rows, seg_rows, *x.shape[3:]).transpose(1, 2)
    return x.reshape(-1, h, seg_rows, *x.shape[4:])


def _from_segments(x, b: int):
    bs, h, m = x.shape[:3]
    return x.reshape(b, bs // b, h, m, *x.shape[3:]).transpose(1, 2).reshape(b, h, -1, *x.shape[3:])


def dilated_forward(q, k, v, setup: DilatedSetup):
    """q [b,h,s,d], k/v [b,g,s,d] -> (out [b,h,s,d], lse [b,h,s]) of all branches merged."""
    if not setup.forward_chunks:
        out, lse = _forward_heads(q, k, v, setup.plans, setup)
        return out.to(q.dtype), lse
    b, h, s, _ = q.shape
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = torch.empty(b, h, s, dtype=kernels.acc_dtype(q.dtype), device=q.device)
    for c in setup.forward_chunks:
        o, l = _forward_heads(q[:, c.heads], k[:, c.kv], v[:, c.kv], c.plans, setup)
        out[:, c.heads].copy_(o)
        lse[:, c.heads].copy_(l)
        del o, l  # one chunk's accumulators at a time
    return out, lse


def _forward_heads(q, k, v, plans, setup: DilatedSetup):
    """(out, lse) in the accumulation dtype (fp32; fp64 for fp64) of the heads of q, k, v."""
    b, h, s, d = q.shape
    adt = kernels.acc_dtype(q.dtype)
    out_acc = lse_acc = None
    for bp in plans:
        qp, kvp = _branch_pieces(bp)
        q_c, k_c, v_c = compress(q, qp, bp.r), compress(k, kvp, bp.r), compress(v, kvp, bp.r)
        if bp.ring:
            o, lse = ring_forward(q_c, k_c, v_c, None, setup.ring(bp))
        else:
            m = bp.w // bp.r
            o, lse = kernels.block_fwd(
                _to_segments(q_c, m), _to_segments(k_c, m), _to_segments(v_c, m),
                scale=setup.scale, causal=setup.is_causal,
            )
            o, lse = _from_segments(o, b), _from_segments(lse, b)
        lse = lse.to(adt)
        if out_acc is None and _is_whole(qp, bp.r, h):
            # The first branch covers every row: its result starts the accumulators (no fill, no merge).
            out_acc, lse_acc = o.to(adt, memory_format=torch.contiguous_format), lse.contiguous()
        else:
            if out_acc is None:  # out = 0, lse = -inf: rows no branch has reached yet
                out_acc = torch.zeros(b, h, s, d, dtype=adt, device=q.device)
                lse_acc = torch.full((b, h, s), float("-inf"), dtype=adt, device=q.device)
            acc_o, acc_l = compress(out_acc, qp, bp.r), compress(lse_acc, qp, bp.r)
            merge_(acc_o, acc_l, o, lse)
            # compress() returns a view where the rows are contiguous already (merged in place
            # then); a copy is written back.
            for acc, merged in ((out_acc, acc_o), (lse_acc, acc_l)):
                if merged.untyped_storage().data_ptr() != acc.untyped_storage().data_ptr():
                    expand_(acc, merged, qp, bp.r, add=False)
            del acc_o, acc_l
        # Branches run one after another: none of this branch's rows may stay alive into the
        # next one (the memory planner counts the largest branch only).
        del q_c, k_c, v_c, o, lse
    if out_acc is None:  # no branch has a head
        return (torch.zeros(b, h, s, d, dtype=adt, device=q.device),
                torch.full((b, h, s), float("-inf"), dtype=adt, device=q.device))
    return out_acc, lse_acc


def dilated_backward(dout, q, k, v, out, lse, setup: DilatedSetup):
    """(dq, dk, dv): per branch, the block backward fed the global merged (out, lse), summed."""
    if not setup.backward_chunks:
        grads = _backward_heads(dout, q, k, v, out, lse, setup.plans, setup)
        return tuple(torch.zeros_like(t) if x is None else x.to(t.dtype) for x, t in zip(grads, (q, k, v)))
    cf = torch.contiguous_format
    dq, dk, dv = (torch.empty_like(t, memory_format=cf) for t in (q, k, v))
    for c in setup.backward_chunks:
        h, kv = c.heads, c.kv
        grads = _backward_heads(dout[:, h], q[:, h], k[:, kv], v[:, kv], out[:, h], lse[:, h], c.plans, setup)
        for dst, x in zip((dq[:, h], dk[:, kv], dv[:, kv]), grads):
            dst.zero_() if x is None else dst.copy_(x)
        del grads  # one chunk's accumulators at a time
    return dq, dk, dv


def _backward_heads(dout, q, k, v, out, lse, plans, setup: DilatedSetup):
    """(dq, dk, dv) of the heads of q, k, v in the accumulation dtype, None where no branch
    reaches a tensor."""
    b, h, s, d = q.shape
    g = k.shape[1]
    adt = kernels.acc_dtype(q.dtype)
    grads = {"q": None, "k": None, "v": None}  # fp32 accumulators, made by the first branch

    def accumulate(name, x_c, ps, r, heads, like):
        if grads[name] is None:
            if _is_whole(ps, r, heads):
                grads[name] = x_c.to(adt, memory_format=torch.contiguous_format)
                return
            grads[name] = torch.zeros(like.shape, dtype=adt, device=like.device)
        # Slots may repeat a (kv head, row) pair (one slot per head): pieces add one at a time.
        expand_(grads[name], x_c, ps, r, add=True)

    for bp in plans:
        qp, kvp = _branch_pieces(bp)
        q_c, do_c, o_c, l_c = (compress(t, qp, bp.r) for t in (q, dout, out, lse))
        k_c, v_c = compress(k, kvp, bp.r), compress(v, kvp, bp.r)
        if bp.ring:
            dq_c, dk_c, dv_c = ring_backward(do_c, q_c, k_c, v_c, None, o_c, l_c, setup.ring(bp))
        else:
            m = bp.w // bp.r
            seg = functools.partial(_to_segments, seg_rows=m)
            dq_c, dk_c, dv_c = kernels.block_bwd(
                seg(do_c), seg(q_c), seg(k_c), seg(v_c), seg(o_c), seg(l_c),
                scale=setup.scale, causal=setup.is_causal,
            )
            dq_c, dk_c, dv_c = (_from_segments(t, b) for t in (dq_c, dk_c, dv_c))
        del q_c, do_c, o_c, l_c, k_c, v_c
        accumulate("q", dq_c, qp, bp.r, h, q)
        accumulate("k", dk_c, kvp, bp.r, g, k)
        accumulate("v", dv_c, kvp, bp.r, g, v)
        del dq_c, dk_c, dv_c  # as in forward
    return grads["q"], grads["k"], grads["v"]


# ---------------------------------------------------------------------------------------
# custom ops


def _setup(q, k, segment_lengths, dilation_rates, offsets, is_causal, scale, group_name, world_size, layout):
    group, rank, world = _group_from(group_name, world_size)
    spec = DilatedSpec(segment_lengths, dilation_rates, offsets=offsets)
    s, h, g = q.shape[2], q.shape[1], k.shape[1]
    plans = dilated_plan(spec, s, h, g, rank, world, layout)
    fwd, bwd = workspace.dilated_kv_chunk(q, k, spec, world, layout)

    def chunks(kv_chunk):
        if not kv_chunk:
            return ()
        return tuple(HeadChunk(hs.start, hs.stop, gs.start, gs.stop,
                               dilated_plan(spec, s, h, g, rank, world, layout, (gs.start, gs.stop)))
                     for hs, gs in head_chunks(h, g, kv_chunk))

    return DilatedSetup(group, rank, world, plans, is_causal, scale, chunks(fwd), chunks(bwd))


@torch.library.custom_op("ringcc::dilated_attention", mutates_args=())
def dilated_attention_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    segment_lengths: list[int],
    dilation_rates: list[int],
    offsets: str,
    is_causal: bool,
    scale: float,
    group_name: str,
    world_size: int,
    layout: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    setup = _setup(q, k, segment_lengths, dilation_rates, offsets, is_causal, scale, group_name, world_size, layout)
    out, lse = dilated_forward(q, k, v, setup)
    return out.contiguous(), lse.contiguous()


@dilated_attention_op.register_fake
def _(q, k, v, segment_lengths, dilation_rates, offsets, is_causal, scale, group_name, world_size, layout):
    adt = kernels.acc_dtype(q.dtype)
    return torch.empty_like(q, memory_format=torch.contiguous_format), q.new_empty(q.shape[:-1], dtype=adt)


@torch.library.custom_op("ringcc::dilated_attention_backward", mutates_args=())
def dilated_attention_backward_op(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    segment_lengths: list[int],
    dilation_rates: list[int],
    offsets: str,
    is_causal: bool,
    scale: float,
    group_name: str,
    world_size: int,
    layout: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    setup = _setup(q, k, segment_lengths, dilation_rates, offsets, is_causal, scale, group_name, world_size, layout)
    dq, dk, dv = dilated_backward(dout, q, k, v, out, lse, setup)
    return dq.contiguous(), dk.contiguous(), dv.contiguous()


@dilated_attention_backward_op.register_fake
def _(dout, q, k, v, out, lse, segment_lengths, dilation_rates, offsets, is_causal, scale, group_name, world_size,
      layout):
    cf = torch.contiguous_format
    return tuple(torch.empty_like(t, memory_format=cf) for t in (q, k, v))


def _dilated_setup_context(ctx, inputs, output):
    q, k, v = inputs[:3]
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.args = inputs[3:]
    ctx.mark_non_differentiable(lse)
    ctx.set_materialize_grads(False)  # dlse is never used: no zero-filled gradient for it


def _dilated_backward(ctx, dout, dlse):
    if dout is None:  # nothing flows back through out
        return (None,) * (3 + len(ctx.args))
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = dilated_attention_backward_op(dout, q, k, v, out, lse, *ctx.args)
    return (dq, dk, dv) + (None,) * len(ctx.args)


dilated_attention_op.register_autograd(_dilated_backward, setup_context=_dilated_setup_context)
amp.register_autocast("dilated_attention")  # Note [Attention under autocast] in amp.py


# ---------------------------------------------------------------------------------------
# public API


def dilated_attention(
    q, k, v, spec: DilatedSpec, *, is_causal: bool = False, scale: float | None = None,
    group=None, layout: str = "contiguous", return_lse: bool = False,
):
    """LongNet dilated attention over a sequence sharded across the ranks of `group`.

    Shard convention as `ring_attention`: q [b, h, n_local, d], k/v [b, h_kv, n_local, d],
    this rank's part of n = n_local * p tokens in `layout`; p = 1 is the single-device case.
    Semantics in Note [Dilated attention]. Returns this rank's output shard (and the fp32 LSE
    [b, h, n_local] when return_lse, without gradient as ring_attention's; rows active in no
    branch give 0 and -inf).
    """
    name, world, rank = _group_args(group, "dilated_attention")
    q, k, v = amp.cast_qkv(q, k, v)  # SDPA's autocast policy (Note [Attention under autocast])
    try:  # every rank agrees on the call before any raises (_check_same_call)
        if not isinstance(spec, DilatedSpec):
            raise ValueError(f"spec must be a ringcc.DilatedSpec; got {type(spec).__name__}")
        _check_inputs(q, k, v, None, op="dilated_attention")
        if v.shape[-1] != q.shape[-1]:
            raise ValueError(f"dilated_attention takes v with q's head dim {q.shape[-1]}; got v {tuple(v.shape)} "
                             "(a value head dim of its own runs in ring_attention)")
        lay = L.parse_layout(layout)
        scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    except (TypeError, ValueError) as e:
        _check_same_call(-1, group, "", _device_of(q), error=e)
        raise
    _check_same_call(q.shape[2], group, call_signature(
        "dilated_attention", q, k, spec=(spec.segment_lengths, spec.dilation_rates, spec.offsets),
        is_causal=bool(is_causal), scale=scale, layout=lay.value), q.device)
    # Validate at call (or trace) time; dynamo traces the uncached function (no lru_cache in graphs).
    plan = dilated_plan.__wrapped__ if torch.compiler.is_compiling() else dilated_plan
    plan(spec, q.shape[2], q.shape[1], k.shape[1], rank, world, lay.value)
    out, lse = dilated_attention_op(
        q, k, v, list(spec.segment_lengths), list(spec.dilation_rates), spec.offsets,
        bool(is_causal), scale, name, world, lay.value,
    )
    return (out, lse) if return_lse else out
