"""LongNet dilated attention's spec and index plans: which (head, offset) pairs each branch
takes, the K/V slots they read, whether a branch's segment fits a rank's shard or runs a
sub-ring, and the rows a branch sends. Plain Python (sympy for the planner's symbolic forms),
no tensors: the runtime (dilated.py) and the memory formulas (workspace.py) both build on it.
Semantics in Note [Dilated attention] (dilated.py).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import sympy

from . import layout as L

OFFSET_MODES = ("per_head", "head_groups")


@dataclass(frozen=True)
class DilatedSpec:
    """Segment lengths w_i and dilation rates r_i of the branches (LongNet), and how head
    offsets are chosen: "per_head" (offset h mod r_i, every head in every branch) or
    "head_groups" (heads split evenly among branches, remainder to the first ones; a head
    takes part only in its group's branch, offset = its index in the group mod r_i)."""

    segment_lengths: tuple[int, ...]
    dilation_rates: tuple[int, ...]
    offsets: str = "per_head"

    def __init__(self, segment_lengths, dilation_rates, *, offsets: str = "per_head"):
        w, r = tuple(segment_lengths), tuple(dilation_rates)
        if len(w) != len(r) or not w:
            raise ValueError(
                f"DilatedSpec needs one dilation rate per segment length (at least one branch); "
                f"got segment_lengths={w} and dilation_rates={r}"
            )
        for name, vals in (("segment_lengths", w), ("dilation_rates", r)):
            if not all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in vals):
                raise ValueError(f"DilatedSpec {name} must be positive ints; got {vals}")
        bad = [(a, b) for a, b in zip(w, r) if a % b]
        if bad:
            raise ValueError(
                f"every segment length must be divisible by its dilation rate; got (w, r) pairs {bad}; "
                "change the segment length or the rate"
            )
        if any(a >= b for a, b in zip(w, w[1:])):
            raise ValueError(f"segment_lengths must be strictly increasing; got {w}")
        if any(a > b for a, b in zip(r, r[1:])):
            raise ValueError(f"dilation_rates must be non-decreasing; got {r}")
        if offsets not in OFFSET_MODES:
            raise ValueError(f"offsets={offsets!r} is not supported; allowed: {list(OFFSET_MODES)}")
        object.__setattr__(self, "segment_lengths", w)
        object.__setattr__(self, "dilation_rates", r)
        object.__setattr__(self, "offsets", offsets)

    def __repr__(self) -> str:
        return (
            f"DilatedSpec(segment_lengths={list(self.segment_lengths)}, "
            f"dilation_rates={list(self.dilation_rates)}, offsets={self.offsets!r})"
        )

    @property
    def branches(self) -> tuple[tuple[int, int], ...]:
        return tuple(zip(self.segment_lengths, self.dilation_rates))


def branch_heads(spec: DilatedSpec, num_heads: int) -> tuple[tuple[tuple[int, int], ...], ...]:
    """Per branch: the (query head, offset) pairs taking part (the semantics, in one place)."""
    if spec.offsets == "per_head":
        return tuple(tuple((h, h % r) for h in range(num_heads)) for r in spec.dilation_rates)
    m = len(spec.branches)
    out, start = [], 0
    for i, r in enumerate(spec.dilation_rates):
        size = num_heads // m + (1 if i < num_heads % m else 0)
        out.append(tuple((start + j, j % r) for j in range(size)))
        start += size
    return tuple(out)


# ---------------------------------------------------------------------------------------
# index plans


@dataclass(frozen=True)
class BranchPlan:
    w: int  # segment length, clipped to the sequence
    r: int
    ring: bool  # False: local (segments inside the shard); True: sub-ring of ranks `members`
    q_heads: tuple[int, ...]  # query heads taking part, slot-major
    q_offsets: tuple[int, ...]
    slot_kv: tuple[int, ...]  # kv head of each slot
    slot_offsets: tuple[int, ...]
    members: tuple[int, ...] = ()  # group ranks of the sub-ring (ring mode)
    pos: int = 0  # this rank's position in it


def _branch_mode(w: int, r: int, n: int, world: int, layout: L.Layout) -> tuple[int, bool]:
    """(clipped segment length, needs a ring) or ValueError when the segments do not align."""
    n_local = n // world
    chunk = n_local // L.chunks_per_rank(layout)
    we = min(w, n)  # LongNet's w = N convention for segments longer than the sequence
    if n % we or we % r:
        raise ValueError(
            f"dilated segment length {w}{f' (clipped to {we})' if we != w else ''} with rate {r} does not "
            f"tile the sequence of length {n}: the sequence must be a multiple of the segment length and the segment a "
            f"multiple of the rate; pad the sequence (to a multiple of {math.lcm(we, r)}) or change the spec"
        )
    if we <= chunk:
        if chunk % we:
            raise ValueError(
                f"dilated segment length {we} does not divide the per-rank chunk of {chunk} tokens "
                f"(n={n}, world size {world}, layout {layout.value!r}); use a segment length that divides "
                f"{chunk} or is a multiple of it, or change the sequence length"
            )
        return we, False
    if layout is L.Layout.ZIGZAG:
        raise ValueError(
            f"dilated segment length {we} spans several zigzag chunks of {chunk} tokens; zigzag supports "
            f"only segments that fit in one chunk: use layout='contiguous' for this spec"
        )
    if we % n_local or n_local % r:
        raise ValueError(
            f"dilated segment length {we} with rate {r} spans ranks but the shard of {n_local} tokens "
            f"does not tile it (need segment % shard == 0 and shard % rate == 0); choose n, p and the "
            f"spec so that they divide"
        )
    return we, True


def _shares_slots(pairs, rep: int) -> bool:
    """Whether the query heads of `pairs` that read one kv head with one offset can share a
    slot: only when every such group has the same size (the kernels' uniform GQA expansion)."""
    sizes: dict[tuple[int, int], int] = {}
    for h, off in pairs:
        sizes[(off, h // rep)] = sizes.get((off, h // rep), 0) + 1
    return len(set(sizes.values())) <= 1


def _slots(pairs, rep: int, shared: bool | None = None):
    """Slot-major query heads and the (kv head, offset) slots they read. Slots are ordered by
    offset, then kv head (then query head), so that the heads of one offset are equally spaced
    runs: one strided view per offset rather than one per head (`pieces`). `shared` (default:
    decided on `pairs`) whether heads share slots; a head chunk takes the decision of all heads,
    so that its GQA sums are those of the whole run (Note [Dilated head chunks])."""
    groups: dict[tuple[int, ...], list[tuple[int, int]]] = {}
    for h, off in pairs:
        groups.setdefault((off, h // rep), []).append((h, off))
    if not (_shares_slots(pairs, rep) if shared is None else shared):
        # Unequal sharing cannot use the kernels' uniform GQA expansion: one slot per head.
        groups = {(off, h // rep, h): [(h, off)] for h, off in pairs}
    order = sorted(groups)
    q_pairs = [p for key in order for p in sorted(groups[key])]
    slots = [(key[1], key[0]) for key in order]
    return (
        tuple(h for h, _ in q_pairs), tuple(o for _, o in q_pairs),
        tuple(kv for kv, _ in slots), tuple(o for _, o in slots),
    )


def chunk_pairs(spec: DilatedSpec, num_heads: int, kv_heads: int, kv_range: tuple[int, int] | None):
    """Per branch: the (query head, offset) pairs of the query heads that read K/V heads
    [g0, g1), with heads counted from g0's first query head (the head chunk's own tensors)."""
    pairs = branch_heads(spec, num_heads)
    if kv_range is None:
        return pairs
    rep = num_heads // kv_heads
    h0, h1 = kv_range[0] * rep, kv_range[1] * rep
    return tuple(tuple((h - h0, off) for h, off in branch if h0 <= h < h1) for branch in pairs)


@functools.lru_cache(maxsize=256)
def dilated_plan(
    spec: DilatedSpec, n_local: int, num_heads: int, kv_heads: int, rank: int, world: int, layout: str,
    kv_range: tuple[int, int] | None = None,
) -> tuple[BranchPlan, ...]:
    """Index plan of every branch (validated; cached per shape, spec, layout, rank, world), for
    all heads, or with `kv_range` = (g0, g1) for the head chunk of K/V heads [g0, g1) and their
    query heads, indexed within the chunk (Note [Dilated head chunks])."""
    lay = L.Layout(layout) if world > 1 else L.Layout.CONTIGUOUS  # p = 1: both layouts are natural order
    n = n_local * world
    if n_local % L.chunks_per_rank(lay):
        raise ValueError(f"zigzag layout needs an even n_local (two chunks per rank); got n_local={n_local}")
    plans = []
    rep = num_heads // kv_heads
    every = branch_heads(spec, num_heads)
    for (w, r), pairs, whole in zip(spec.branches, chunk_pairs(spec, num_heads, kv_heads, kv_range), every):
        if not pairs:
            continue
        we, ring = _branch_mode(w, r, n, world, lay)
        q_heads, q_offsets, slot_kv, slot_offsets = _slots(pairs, rep, _shares_slots(whole, rep))
        members, pos = (), 0
        if ring:
            k = we // n_local
            members, pos = tuple(range(rank - rank % k, rank - rank % k + k)), rank % k
        plans.append(BranchPlan(we, r, ring, q_heads, q_offsets, slot_kv, slot_offsets, members, pos))
    return tuple(plans)


# ---------------------------------------------------------------------------------------
# communication formula (for the planner and the tests)


def dilated_comm_rows(spec: DilatedSpec, n, p, layout: str = "contiguous") -> tuple:
    """Per branch: K rows (and as many V rows) each rank sends per K/V slot in one forward
    call, max(0, min(w, n) - n/p) / r: zero when the segment fits the shard, O(w/r) else.
    Backward sends the same K/V rows plus fp32 dK/dV accumulators of k = min(w, n) p / n hops.
    n and p may be sympy expressions (then the result is symbolic)."""
    if L.Layout(layout) is L.Layout.ZIGZAG and all(isinstance(x, int) for x in (n, p)) and p > 1:
        for w, r in spec.branches:
            _branch_mode(w, r, n, p, L.Layout.ZIGZAG)  # raises for segments that would need a ring
    if all(isinstance(x, int) for x in (n, p)):
        return tuple(max(0, min(w, n) - n // p) // r for w, r in spec.branches)
    return tuple(sympy.Max(0, sympy.Min(w, n) - n / p) / r for w, r in spec.branches)


def dilated_kv_slots(spec: DilatedSpec, num_heads: int, kv_heads: int,
                     kv_range: tuple[int, int] | None = None) -> tuple[int, ...]:
    """Per branch: how many K/V head slots travel (kv_heads for MHA with per_head offsets), for
    all heads or for the head chunk of K/V heads kv_range = (g0, g1)."""
    rep = num_heads // kv_heads
    return tuple(len(_slots(pairs, rep, _shares_slots(whole, rep))[2]) if pairs else 0
                 for pairs, whole in zip(chunk_pairs(spec, num_heads, kv_heads, kv_range),
                                         branch_heads(spec, num_heads)))
