"""Load balance of the ring under mask functions: which global chunks each rank computes,
chosen at run time from the mask's own counts, and the moves of the rows there and back.

Note [Balanced ring]
The graph's layout (layout.py) is fixed at compile time, and zigzag balances the causal
triangle only. Under a mask function that reads per-token tensors (document ids, positions,
padding) a rank's work, its count of allowed (query, key) pairs, depends on the data: one long
document among short ones gives zigzag's middle ranks most of it. So the ring op takes a
balance plan, an input made at run time by its own op (ops.balance_plan_op; the compiled
backend makes one per mask function and tensors of a graph, which every layer's forward and
backward share: passes/shard_sequence.py):
1. The sequence is cut into C = k * p chunks of equal length (`chunks_per_rank`: k a multiple
   of the layout's chunks per rank, so that each layout chunk is a run of whole plan chunks;
   chunks of at least MIN_CHUNK tokens where n allows, at most MAX_CHUNKS per rank). n is the
   length of a tensor the function reads at a query or key position; a function that reads its
   tensors per batch row or head only keeps the layout.
2. Each rank counts, per chunk, the allowed pairs of its own rows against all n keys (the
   function evaluated in chunks of rows, as maskfn.split evaluates a block, and counted as split
   counts them: O(n^2 / p) per rank, once per step and mask), and one all-reduce of the C counts
   gives every rank every chunk's count.
3. Every rank takes the same decision from the same counts, with no further communication: the
   layout's own chunks when their max over mean is at most the threshold; else the chunks,
   heaviest first, each to the least loaded rank with room for it (k chunks per rank), kept when
   that beats the layout. The plan is a [p, MAX_CHUNKS] int64 host tensor: each rank's chunk
   ids, ascending, then -1. `LAST` keeps each mask function's last decision (the report shows
   it, ringcc/report.py).
In the ring op a plan that differs from the layout moves q, k and v to their owners in one
all-to-all (`Moves`: each rank sends the rows of every chunk it holds to the chunk's owner in
the plan; one byte buffer carries every tensor), runs the ring over the plan's chunks
(RingSetup.chunks: causality per chunk pair as for zigzag, the function at the chunks' global
positions), and moves out and lse back in a second all-to-all. The backward moves dout, q, k,
v, out and lse there and dq, dk, dv back. Memory stays O(n/p): what moves is a rank's own rows.
The result does not depend on the plan (every query still meets every key once); only where
the work runs does. A new step with other documents gets another plan and no recompile.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from . import layout as L
from . import maskfn

MIN_CHUNK = 64  # tokens per plan chunk, where the length allows
MAX_CHUNKS = 8  # plan chunks per rank: the plan's columns; more chunks, more kernel calls per block

# mask function text -> its last plan's numbers (Note [Balanced ring])
LAST: dict[str, dict] = {}


def chunks_per_rank(n: int, world: int, layout) -> int:
    """k of Note [Balanced ring]: the most chunks per rank (a multiple of the layout's, at most
    MAX_CHUNKS) whose chunks divide n into pieces of at least MIN_CHUNK tokens; the layout's own
    count when none does."""
    per = L.chunks_per_rank(L.Layout(layout))
    best = per
    for k in range(per, MAX_CHUNKS + 1, per):
        if n % (world * k) == 0 and n // (world * k) >= MIN_CHUNK:
            best = k
    return best


def layout_table(world: int, layout, k: int) -> tuple[tuple[int, ...], ...]:
    """Each rank's chunks of k per rank under the layout, in local order."""
    lay = L.Layout(layout)
    sub = k // L.chunks_per_rank(lay)
    return tuple(tuple(c * sub + j for c in L.local_chunks(r, world, lay) for j in range(sub)) for r in range(world))


def chunk_pairs(fn, tensors, is_causal: bool, batch: int, heads: int, chunks, chunk_len: int, n: int) -> list[int]:
    """The allowed (query, key) pairs of the rows of each of `chunks` against all n keys (a pair
    allowed in some head counts once per batch row, as maskfn.split counts)."""
    device = tensors[0].device if tensors else torch.device("cpu")
    q_pos = L.chunk_positions(chunks, chunk_len, device)
    mask = maskfn.FnMask(fn, tuple(tensors), q_pos, torch.arange(n, device=device), batch, heads, causal=is_causal)
    step = mask.row_chunk(n)
    rows = []
    for r0 in range(0, len(q_pos), step):
        allowed = mask.rows(r0, r0 + step).any(1)  # [b or 1, rows, keys]
        rows.append(allowed.sum((0, 2)) * (1 if allowed.shape[0] > 1 else batch))
    return torch.cat(rows).view(len(chunks), chunk_len).sum(1).tolist()


def assign(counts: list[int], world: int, k: int) -> tuple[tuple[int, ...], ...]:
    """k chunks per rank: heaviest first, each to the least loaded rank with room (ties: the lower
    chunk id, the lower rank), every rank's ids ascending."""
    loads, owned = [0] * world, [[] for _ in range(world)]
    for c in sorted(range(len(counts)), key=lambda c: (-counts[c], c)):
        r = min((r for r in range(world) if len(owned[r]) < k), key=lambda r: (loads[r], r))
        owned[r].append(c)
        loads[r] += counts[c]
    return tuple(tuple(sorted(o)) for o in owned)


def loads(table, counts: list[int]) -> list[int]:
    return [sum(counts[c] for c in cs) for cs in table]


def ratio(per_rank: list[int]) -> float:
    """max over mean (1.0 when nothing is allowed)."""
    mean = sum(per_rank) / len(per_rank)
    return max(per_rank) / mean if mean else 1.0


def sequence_length(fn, tensors) -> int | None:
    """n: the size of the dim along which the function reads one of its tensors at the query or the
    key position (per-token tensors are whole-length: Note [Mask functions] in maskfn.py); None
    when it reads none so (tensors of one value per batch row or head only)."""
    for op, args in fn.lines:
        if op == "load":
            for d, a in enumerate(args[1:]):
                if a in (("i", "q"), ("i", "kv")):
                    return int(tensors[args[0][1]].shape[d])
    return None


def make_plan(fn, tensors, is_causal: bool, batch: int, heads: int, group, rank: int, world: int, layout,
              threshold: float) -> torch.Tensor:
    """The plan of Note [Balanced ring] for this call's mask: [world, MAX_CHUNKS] int64 on the host."""
    n = sequence_length(fn, tensors)
    out = torch.full((world, MAX_CHUNKS), -1, dtype=torch.int64)
    if n is None:  # values per batch row or head only: no per-token data to balance by
        k = L.chunks_per_rank(L.Layout(layout))
        out[:, :k] = torch.tensor(layout_table(world, layout, k), dtype=torch.int64)
        return out
    k = chunks_per_rank(n, world, layout)
    chunk_len = n // (world * k)
    own = layout_table(world, layout, k)
    device = tensors[0].device
    counts = torch.zeros(world * k, dtype=torch.int64, device=device)
    mine = chunk_pairs(fn, tensors, is_causal, batch, heads, own[rank], chunk_len, n)
    counts[list(own[rank])] = torch.tensor(mine, dtype=torch.int64, device=device)
    if world > 1:
        dist.all_reduce(counts, group=group)
    counts = counts.tolist()
    before = ratio(loads(own, counts))
    table = own
    if before > threshold:
        candidate = assign(counts, world, k)
        if ratio(loads(candidate, counts)) < before:
            table = candidate
    LAST[fn.text] = dict(layout=L.Layout(layout).value, chunks=world * k, before=before,
                         after=ratio(loads(table, counts)), pairs=loads(table, counts), moved=table != own)
    out[:, :k] = torch.tensor(table, dtype=torch.int64)
    return out


def read_plan(plan: torch.Tensor, world: int, layout) -> tuple[tuple[int, ...], ...] | None:
    """The chunk table of a plan tensor, or None when it is the layout's own (no move); a table
    that is not a plan (shape, ids, counts per rank) is a ValueError."""
    if plan.dtype != torch.int64 or tuple(plan.shape) != (world, MAX_CHUNKS):
        raise ValueError(f"a balance plan is an int64 [world={world}, {MAX_CHUNKS}] tensor; got {plan.dtype} "
                         f"{tuple(plan.shape)}")
    rows = [tuple(c for c in row if c >= 0) for row in plan.tolist()]
    k = len(rows[0])
    if (k == 0 or any(len(r) != k or list(r) != sorted(r) for r in rows)
            or sorted(c for r in rows for c in r) != list(range(world * k))):
        raise ValueError(f"a balance plan gives each of the {world} ranks the same number of chunk ids, ascending, "
                         f"and every chunk once; got {rows}")
    table = tuple(rows)
    if k % L.chunks_per_rank(L.Layout(layout)):
        raise ValueError(f"a balance plan for the {L.Layout(layout).value} layout takes a multiple of "
                         f"{L.chunks_per_rank(L.Layout(layout))} chunks per rank; got {k}")
    return None if table == layout_table(world, layout, k) else table


class Moves:
    """The rows of a rank's local tensors (dim 2) between the layout's chunks and the plan's
    (Note [Balanced ring]): `there` moves them to the plan's owners, `back` home, each one
    all-to-all of one byte buffer holding every tensor's rows."""

    def __init__(self, table, world: int, layout, rank: int, n_local: int, group, device):
        self.table, self.group = table, group
        k = len(table[0])
        self.chunk_len = n_local // k
        home = layout_table(world, layout, k)
        self._there = self._schedule(home, table, rank, device)
        self._back = self._schedule(table, home, rank, device)

    def _schedule(self, src, dst, rank: int, device):
        """(rows to send in order, send sizes, rows to reorder the received by, receive sizes)."""
        world, c_len = len(src), self.chunk_len
        where = {c: (r, i) for r, cs in enumerate(src) for i, c in enumerate(cs)}
        send = [[where[c][1] for c in dst[d] if where[c][0] == rank] for d in range(world)]
        arrived = [c for s in range(world) for c in dst[rank] if where[c][0] == s]
        recv = [sum(1 for c in dst[rank] if where[c][0] == s) for s in range(world)]
        order = [arrived.index(c) for c in dst[rank]]

        def rows(ids):
            return L.chunk_positions(ids, c_len, device) if ids else torch.empty(0, dtype=torch.int64, device=device)

        return rows([i for s in send for i in s]), [len(s) * c_len for s in send], rows(order), \
            [m * c_len for m in recv]

    def there(self, *tensors):
        return self._move(tensors, self._there)

    def back(self, *tensors):
        return self._move(tensors, self._back)

    def _move(self, tensors, schedule):
        send_rows, send_sizes, recv_rows, recv_sizes = schedule
        s = tensors[0].shape[2]
        flat = [t.movedim(2, 0).contiguous().view(s, -1) for t in tensors]
        packed = torch.cat([f.view(torch.uint8) for f in flat], 1).index_select(0, send_rows)
        got = packed.new_empty(packed.shape)
        dist.all_to_all_single(got, packed, recv_sizes, send_sizes, group=self.group)
        got = got.index_select(0, recv_rows)
        out, at = [], 0
        for t, f in zip(tensors, flat):
            width = f.shape[1] * f.element_size()
            rows = got[:, at:at + width].contiguous().view(t.dtype).view(s, *t.movedim(2, 0).shape[1:])
            out.append(rows.movedim(0, 2).contiguous())
            at += width
        return out
