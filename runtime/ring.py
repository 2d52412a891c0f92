"""Exact ring attention: forward and backward schedules.

Note [Ring attention schedule]
Each rank holds q/k/v for its chunks of the global sequence (see layout.py; under a balance
plan, the plan's chunks: Note [Balanced ring] in balance.py). In forward,
K/V (and the key padding mask) travel around the ring: at step i rank r holds the K/V of
rank (r - i) mod p. The transfer for step i+1 is issued before step i's compute, so it
overlaps it (double buffering: the block held and the one arriving; fresh buffers per step
through the process group, two alternating slots with the copy-engine transport, comm.py). Each step's
partial (out, lse) is merged into fp32 accumulators by the one LSE merge (Note [Fewer passes]:
the first block's result is widened inside the next merge, the last merge writes the output).
In backward, K/V travel the same way together with their fp32 dK/dV accumulators, which
trail one step behind: the accumulator of the block a rank held at step i goes to rank+1
(which holds that block at step i+1) in the same batch as the K/V for step i+2, issued
before step i+1's compute; rank+1 waits for the batch only after its own step-(i+1)
kernels, so the transfer overlaps them. One batch per step is one rendezvous of the ranks
per step (each costs a NCCL launch and the slower peer's lag). After p hops every
accumulator is home; the first hop (one block's gradient; fp32 when some rank's own block is
cut to a run of valid keys: `_carry`) and the last (the sum is complete) carry the input
dtype, and the last rides the next head chunk's first batch. dQ stays local. Per block, the
kernel's backward is fed the global (out, lse).
Causality is decided per (query chunk, key chunk) pair in global chunk ids: earlier key
chunk -> full block, same chunk -> causal diagonal, later -> skipped (no compute).
GQA: K/V travel with their own g heads; heads are expanded only inside the block kernel
(not at all by the cuDNN kernels, which take g heads: kernels.py).
Key padding: one all-gather of two ints per rank and batch row (the key_runs table, made by its
own op once per mask: Note [Key runs per mask]) tells every rank which blocks' valid keys are
one run [a, b) of rows in each batch row ([0, s): all valid). Such blocks need no mask: their
calls are cut to those keys (`clip_calls`; once per run of batch rows with the same keys, so
rows padded to different lengths take a call each) and run the fused kernels (padding at the
sequence's end or start leaves one run on every rank, in both layouts). The other blocks keep
their key mask (flex_attention or the math path); when every rank's keys are runs, the mask is
not sent at all.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from . import kernels, maskfn
from .comm import ring_comm
from .layout import Layout, chunk_positions, local_chunks
from .merge import add_into, contiguous, copy_by_kernel, merge_


@dataclass(frozen=True)
class BlockCall:
    """One kernel call: query rows [q0, q1) against key rows [k0, k1) of the held block, in
    batch rows [b0, b1) (b1 None: to the last; only calls cut per batch row name them)."""

    q0: int
    q1: int
    k0: int
    k1: int
    causal: bool
    b0: int = 0
    b1: int | None = None

    def rows(self, b: int) -> tuple[int, int]:
        """The call's batch rows [b0, b1) of a batch of b."""
        return self.b0, b if self.b1 is None else self.b1


def plan_block(q_chunks, k_chunks, chunk_len: int, is_causal: bool) -> list[BlockCall]:
    """Kernel calls for query chunks vs one held K/V block (both in global chunk ids)."""
    n_k = len(k_chunks)
    if not is_causal:
        return [BlockCall(0, len(q_chunks) * chunk_len, 0, n_k * chunk_len, False)]
    if tuple(q_chunks) == tuple(k_chunks) and list(q_chunks) == sorted(q_chunks):
        # The rank's own block: positions rise along the concatenated chunks, so the plain
        # top-left causal mask of the whole block is exact (zigzag: one call, not three).
        return [BlockCall(0, len(q_chunks) * chunk_len, 0, n_k * chunk_len, True)]
    per_q = []
    for qi, qc in enumerate(q_chunks):
        full = [ki for ki, kc in enumerate(k_chunks) if kc < qc]
        diag = [ki for ki, kc in enumerate(k_chunks) if kc == qc]
        per_q.append((qi, full, diag))
    calls: list[BlockCall] = []
    # Every query chunk sees the same contiguous run of full key chunks: one call.
    fulls = {tuple(f) for _, f, d in per_q}
    if len(fulls) == 1 and not any(d for _, _, d in per_q):
        f = next(iter(fulls))
        if f and list(f) == list(range(f[0], f[-1] + 1)):
            return [BlockCall(0, len(q_chunks) * chunk_len, f[0] * chunk_len, (f[-1] + 1) * chunk_len, False)]
    for qi, full, diag in per_q:
        q0, q1 = qi * chunk_len, (qi + 1) * chunk_len
        # Runs of adjacent full key chunks go in one call.
        run: list[int] = []
        for ki in full + [None]:
            if run and (ki is None or ki != run[-1] + 1):
                calls.append(BlockCall(q0, q1, run[0] * chunk_len, (run[-1] + 1) * chunk_len, False))
                run = []
            if ki is not None:
                run.append(ki)
        for ki in diag:
            calls.append(BlockCall(q0, q1, ki * chunk_len, (ki + 1) * chunk_len, True))
    return calls


@dataclass(frozen=True)
class RingSetup:
    group: object
    rank: int
    world: int
    layout: Layout
    is_causal: bool
    scale: float
    # Group ranks forming the ring, in order (None: the whole group). With members, `rank` and
    # `world` are this rank's position in the ring and the ring's length (dilated sub-rings).
    members: tuple[int, ...] | None = None
    # Sliding window: key j is visible to query i only when |i - j| < window (i - j < window
    # when causal); 0 = no window. Blocks entirely outside the window are skipped.
    window: int = 0
    # K/V heads per head chunk (0: all heads at once). With chunks, the whole ring runs once
    # per chunk, so its transient buffers (received K/V, fp32 accumulators, dK/dV in flight)
    # are those of one chunk (Note [Head chunks]).
    kv_chunk: int = 0
    # Global chunk ids of each ring rank, in local order, all chunks of one length: a balance
    # plan's (Note [Balanced ring] in balance.py); None: the layout's.
    chunks: tuple[tuple[int, ...], ...] | None = None

    def local_chunks(self, rank: int) -> tuple[int, ...]:
        return self.chunks[rank] if self.chunks is not None else local_chunks(rank, self.world, self.layout)

    def positions(self, rank: int, n_local: int, device=None) -> torch.Tensor:
        """Global positions of ring rank `rank`'s local rows (shared: never written)."""
        chunks = self.local_chunks(rank)
        return _positions(tuple(chunks), n_local // len(chunks), None if device is None else torch.device(device))

    def start(self, rank: int, n_local: int, r0: int, r1: int) -> int | None:
        """The global position of rank `rank`'s local row r0 when rows [r0, r1) hold consecutive
        positions (one chunk, or chunks that follow each other), else None."""
        chunks = self.local_chunks(rank)
        length = n_local // len(chunks)
        first, last = r0 // length, (max(r1, r0 + 1) - 1) // length
        if last > first and any(chunks[i + 1] != chunks[i] + 1 for i in range(first, last)):
            return None
        return chunks[first] * length + r0 % length

    def starts(self, src: int, n_local: int, c: "BlockCall") -> tuple:
        """(first row's, first key's) global position of call c against the block of rank `src`,
        each None where its positions jump (`start`; Note [Consecutive positions] in maskfn.py)."""
        return self.start(self.rank, n_local, c.q0, c.q1), self.start(src, n_local, c.k0, c.k1)

    def calls(self, n_local: int, src: int) -> list[BlockCall]:
        mine, theirs = self.local_chunks(self.rank), self.local_chunks(src)
        return list(_block_calls(mine, theirs, n_local // len(mine), self.is_causal))

    def masked_calls(self, n_local: int, src: int, device, keys: tuple[tuple[int, int], ...] | None = None
                     ) -> list[tuple[BlockCall, "WindowMask | None"]]:
        """The kernel calls against the block of rank `src`, each with its window mask (None
        when the whole block is visible), decided on the host from the positions alone: no
        [Lq, Lk] matrix (Note [Masked rows] in kernels.py). `keys`: per batch row (a, b), only
        the block's keys [a, b) are valid in that row (None: all, or a key mask decides), so the
        calls are cut to them (`clip_calls`), once per run of batch rows with the same keys
        (one run: calls over the whole batch). The window decisions are cached per (setup,
        length, src, device): they cost host time, and the positions one copy to the device.
        Cut calls are not cached (runs change with every batch's padding): their window masks
        are slices of the cached ones."""
        if not self.window and keys is None:
            return [(c, None) for c in self.calls(n_local, src)]
        groups = [(0, None, (0, n_local))] if keys is None else _row_groups(keys)
        if not self.window:
            return [(replace(part, b0=b0, b1=b1), None)
                    for b0, b1, (lo, hi) in groups for part in clip_calls(self.calls(n_local, src), lo, hi)]
        calls = self._window_calls(n_local, src, torch.device(device))
        if groups == [(0, None, (0, n_local))]:
            return calls
        return [(replace(part, b0=b0, b1=b1),
                 None if m is None else m.sub(part.q0 - c.q0, part.q1 - c.q0, part.k0 - c.k0, part.k1 - c.k0))
                for b0, b1, (lo, hi) in groups for c, m in calls for part in clip_calls([c], lo, hi)]

    # Cached on the method: setups are frozen, few, and shared by every call. Entries hold O(n)
    # device positions and their flex tiles, so the cache keeps a few lengths' worth (p entries
    # per setup and length): varying lengths (dynamic shapes, buckets) do not pile up GBs
    # outside the plan.
    @functools.lru_cache(maxsize=64)  # noqa: B019
    def _window_calls(self, n_local: int, src: int, device) -> list[tuple[BlockCall, "WindowMask | None"]]:
        calls = self.calls(n_local, src)
        q_pos, k_pos = self.positions(self.rank, n_local), self.positions(src, n_local)
        if not bool((k_pos[1:] > k_pos[:-1]).all()):  # WindowMask.key_range searches them
            raise RuntimeError(f"layout {self.layout} gives rank {src} key positions that do not ascend")
        # int32 where the positions allow: a row chunk's [rows, Lk] difference then takes half the bytes
        pos_dtype = torch.int32 if max(int(q_pos.max()), int(k_pos.max())) < 2**31 else torch.int64
        q_dev, k_dev = q_pos.to(device, pos_dtype), k_pos.to(device, pos_dtype)
        out = []
        for c in calls:
            qs, ks = q_pos[c.q0:c.q1], k_pos[c.k0:c.k1]
            if self.is_causal:  # visible iff i - j < window (the causal part is the call's own)
                some, every = int(qs.min() - ks.max()) < self.window, int(qs.max() - ks.min()) < self.window
            else:  # visible iff |i - j| < window
                some = _nearest_distance(qs, ks) < self.window
                every = max(int(qs.max() - ks.min()), int(ks.max() - qs.min())) < self.window
            if some:
                out.append((c, None if every else WindowMask(q_dev[c.q0:c.q1], k_dev[c.k0:c.k1], self.window,
                                                             self.is_causal, qs, ks)))
        return out


@functools.lru_cache(maxsize=256)
def _positions(chunks: tuple[int, ...], chunk_len: int, device) -> torch.Tensor:
    """chunk_positions, made once per chunks, length and device (the calls of every layer, step
    and head chunk read them), int32 where they fit: the mask and score functions' index
    arithmetic in flex's kernels then runs in 32 bits."""
    pos = chunk_positions(chunks, chunk_len, device)
    return pos.to(torch.int32) if (max(chunks) + 1) * chunk_len < 2**31 else pos


@functools.lru_cache(maxsize=1024)
def _block_calls(q_chunks: tuple[int, ...], k_chunks: tuple[int, ...], chunk_len: int,
                 is_causal: bool) -> tuple[BlockCall, ...]:
    """RingSetup.calls, cached: the same at every step of every call of this length, and decided
    on the host in tens of µs of Python per step. Keyed by plain values, not the setup: a cache
    holding a setup would hold its process group (ops._SETUPS says why it must not)."""
    return tuple(plan_block(q_chunks, k_chunks, chunk_len, is_causal))


def _row_groups(keys: tuple[tuple[int, int], ...]) -> list[tuple[int, int | None, tuple[int, int]]]:
    """Runs of batch rows with the same valid keys: (b0, b1, (a, b)), b1 None for the last run
    when it is the only one (calls over the whole batch)."""
    groups: list[list] = []
    for row, run in enumerate(keys):
        if groups and groups[-1][2] == run:
            groups[-1][1] = row + 1
        else:
            groups.append([row, row + 1, run])
    if len(groups) == 1:
        return [(0, None, groups[0][2])]
    return [(b0, b1, run) for b0, b1, run in groups]


def clip_calls(calls: list[BlockCall], lo: int, hi: int) -> list[BlockCall]:
    """The calls restricted to the block's keys [lo, hi) (the others are padding): key ranges
    shrink to them, calls left with no key are dropped. A causal call is a diagonal (square,
    row i of the call at key i's position, rising), so cut to keys [k0', k1') it keeps the causal
    square of the rows at those keys, then rows below it that see all of them (no mask); the
    rows above see none and drop out. No kernel is asked for a non-square causal mask."""
    out = []
    for c in calls:
        k0, k1 = max(c.k0, lo), min(c.k1, hi)
        if k1 <= k0:
            continue
        if not c.causal or (k0, k1) == (c.k0, c.k1):
            out.append(BlockCall(c.q0, c.q1, k0, k1, c.causal))
            continue
        if c.q1 - c.q0 != c.k1 - c.k0:
            raise AssertionError(f"a causal block call must be square; got {c}")
        r0 = c.q0 + (k0 - c.k0)  # the row at key k0's position
        r1 = r0 + (k1 - k0)
        out.append(BlockCall(r0, r1, k0, k1, True))
        if r1 < c.q1:
            out.append(BlockCall(r1, c.q1, k0, k1, False))
    return out


@dataclass(frozen=True)
class WindowMask:
    """A block call's sliding-window mask as the global positions of its query rows and keys
    (O(Lq + Lk), keys in ascending positions); `rows` builds the bool mask of some rows and keys
    when a kernel call needs it (True = visible: i - j < window when causal, |i - j| < window
    otherwise), `key_range` finds on the host the keys some rows may see. q_host/k_host: the
    positions on the host (None: q_pos/k_pos are)."""

    q_pos: torch.Tensor
    k_pos: torch.Tensor
    window: int
    causal: bool
    q_host: torch.Tensor | None = None
    k_host: torch.Tensor | None = None

    def rows(self, r0: int, r1: int, c0: int = 0, c1: int | None = None) -> torch.Tensor:
        diff = self.q_pos[r0:r1, None] - self.k_pos[None, c0:c1]
        return diff < self.window if self.causal else diff.abs() < self.window

    def _on_host(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(query, key) positions on the host."""
        return (self.q_pos if self.q_host is None else self.q_host), (self.k_pos if self.k_host is None else self.k_host)

    def sub(self, r0: int, r1: int, c0: int, c1: int) -> "WindowMask":
        """The mask of rows [r0, r1) and keys [c0, c1) (a call cut by `clip_calls`)."""
        qs, ks = self._on_host()
        return WindowMask(self.q_pos[r0:r1], self.k_pos[c0:c1], self.window, self.causal, qs[r0:r1], ks[c0:c1])

    @functools.cached_property
    def row_breaks(self) -> tuple[int, ...]:
        """Row indices where the rows' positions jump (zigzag: where the second sequence chunk
        starts): row chunks that do not span one keep `key_range` narrow."""
        qs = self._on_host()[0]
        return tuple(int(i) + 1 for i in torch.nonzero(qs[1:] - qs[:-1] != 1).flatten().tolist())

    def key_range(self, r0: int, r1: int) -> tuple[int, int]:
        """Keys [c0, c1) outside which none is visible to rows [r0, r1) (causal: no bound above,
        the call's own causal flag gives it)."""
        qs, ks = self._on_host()
        qs = qs[r0:r1]
        c0 = int(torch.searchsorted(ks, int(qs.min()) - self.window + 1))
        c1 = len(ks) if self.causal else int(torch.searchsorted(ks, int(qs.max()) + self.window))
        return c0, max(c0, c1)


def _nearest_distance(qs: torch.Tensor, ks: torch.Tensor) -> int:
    """min |i - j| over i in qs, j in ks (int64 vectors, ks ascending), in O(Lq log Lk)."""
    idx = torch.searchsorted(ks, qs)
    right = ks[idx.clamp(max=len(ks) - 1)]
    left = ks[(idx - 1).clamp(min=0)]
    return int(torch.minimum((right - qs).abs(), (qs - left).abs()).min())


def _skip_comm() -> bool:
    # Benchmark switch: run the same schedule with transfers skipped (compute on local K/V),
    # to show how much of the communication is hidden. Never for real results. (=payload and
    # =half-grads: the copy-engine ring's handshake without its copies, or with half of the
    # dK/dV bytes: comm.py.)
    return os.environ.get("RINGCC_SKIP_COMM", "0") == "1"


def head_chunks(h: int, g: int, kv_chunk: int) -> list[tuple[slice, slice]]:
    """(query-head slice, K/V-head slice) per chunk of `kv_chunk` K/V heads (0: one chunk)."""
    kv_chunk = kv_chunk or g
    if g % kv_chunk:
        raise ValueError(f"kv_chunk={kv_chunk} must divide the K/V head count {g}")
    rep = h // g
    return [(slice(c * rep, (c + kv_chunk) * rep), slice(c, c + kv_chunk)) for c in range(0, g, kv_chunk)]


# Note [Head chunks]
# Heads are independent, so the ring may run once per group of K/V heads (with their query
# heads). Each chunk's out/lse (forward) and dq/dk/dv (backward) go straight into the
# full-size outputs, which are allocated once; the ring's own buffers then scale with the
# chunk, not with all heads. In backward the last dK/dV hop of a chunk is waited for only
# after the next chunk's first kernels, so chunk boundaries add no exposed transfer.
# Forward and backward choose their chunks separately (workspace.ring_kv_chunk): the forward
# sends K/V alone, so it may take up to 3x the backward's heads (bf16) in a batch of no more
# bytes than the backward's K/V with fp32 dK/dV, so in training the copy-engine area (sized by
# the largest batch) does not grow (forward-only use sizes it by the forward's batch, which the
# planner's forward formula counts); fewer chunks mean fewer steps, kernel calls and merges.
# At p = 1 a block of one kernel call over all its rows and keys has no accumulator (its results
# are the outputs), so it runs whole heads whatever the rule says (`_kv_chunk`); a block of
# several calls (cut by key runs, split by a mask function) takes the rule's chunks. The
# planner bounds both (workspace._one_call).


# Note [Fewer passes]
# Between the kernel calls the ring runs memory-bound passes over each head chunk (dQ/dK/dV
# sums, merges, casts): they took 1.0-1.15 ms of a 14 ms step at 16K tokens per GPU, p = 2
# (profiled, by kernel family), 0.4-0.46 ms with the rules below and the merge and the
# add of two bf16 operands as Triton kernels (fused.py). Every add and copy of the ring takes
# those kernels on CUDA (merge.add_into, merge.copy_by_kernel): torch's kernels for an fp32 plus
# a bf16 operand, or for a strided row range, are unvectorized. The rules, all exact:
# - A partial result that holds one block only (the first block's out, or its dQ/dK/dV) stays
#   in the kernel's output dtype: widening it would add no information. It is widened inside
#   the pass that adds the next block (merge.add_into / merge_), not by a copy of its own; the
#   first hop of dK/dV therefore carries the input dtype (half the bytes of fp32), unless some
#   rank's own block is cut to a run of valid keys (`_carry`).
# - The last addition to a sum writes the result in the input dtype (the output's slice, or
#   the hop home's buffer) in the same pass, instead of an fp32 add and then a narrowing copy.
# - A sum over one block only is that block's result, with no pass at all.
# The sums themselves are unchanged: every addition is done in the accumulator dtype, in the
# same order, and narrowed once at the end.


# A region of a [b, heads, rows, ...] tensor: (b0, b1, r0, r1), batch rows [b0, b1) and rows
# (dim 2) [r0, r1): where one kernel call's result goes.


def _region(c: BlockCall, b: int, keys: bool = False) -> tuple[int, int, int, int]:
    """The region of call c's query rows (keys: its key rows) in a batch of b."""
    return (*c.rows(b), *((c.k0, c.k1) if keys else (c.q0, c.q1)))


def _at(t, reg):
    b0, b1, r0, r1 = reg
    shape = t.shape
    if b0 == 0 and r0 == 0 and b1 == shape[0] and r1 == shape[2]:
        return t  # the whole tensor: no view to make (a slice costs the host about 5 µs)
    return t[b0:b1, :, r0:r1]


def _covers(reg, shape) -> bool:
    return reg == (0, shape[0], 0, shape[2])


def _outside(reg, shape) -> list[tuple[int, int, int, int]]:
    """The regions of `shape` outside `reg`, as at most four (batch rows, then rows)."""
    b0, b1, r0, r1 = reg
    parts = [(0, b0, 0, shape[2]), (b1, shape[0], 0, shape[2]), (b0, b1, 0, r0), (b0, b1, r1, shape[2])]
    return [p for p in parts if p[0] < p[1] and p[2] < p[3]]


def _copy_outside(dst, src, reg) -> None:
    """dst <- src outside the region."""
    for part in _outside(reg, src.shape):
        copy_by_kernel(_at(dst, part), _at(src, part))


def ring_forward(q, k, v, key_valid, setup: RingSetup, key_runs=None, score=None, fn=None):
    """q [b,h,s,d], k/v [b,g,s,d], key_valid [b,s] bool or None -> (out [b,h,s,d], lse [b,h,s]).
    key_runs: the mask's table (Note [Key runs per mask]; None: made here). score: the score
    function, (MaskFn, tensors) or None (Note [Score functions] in maskfn.py). fn: the mask
    function, (MaskFn, tensors) or None (Note [Mask functions] in maskfn.py)."""
    key_valid, runs = _ring_key_mask(key_valid, setup, key_runs)
    kv_chunk, blocks = _kv_chunk(setup, q, key_valid, runs, fn, score)
    chunks = head_chunks(q.shape[1], k.shape[1], kv_chunk)
    if len(chunks) == 1:
        return _ring_forward_chunk(q, k, v, key_valid, setup, runs=runs, score=score, fn=fn, blocks=blocks)
    out = q.new_empty((*q.shape[:3], v.shape[-1]))
    lse = torch.empty(q.shape[:-1], dtype=kernels.acc_dtype(q.dtype), device=q.device)
    for hq, hk in chunks:
        _ring_forward_chunk(q[:, hq], k[:, hk], v[:, hk], key_valid, setup, out[:, hq], lse[:, hq], runs,
                            score, hq.start, fn)
    return out, lse


def _merge_block(acc, o, l, reg, shape, adt, dst=None):
    """acc (None, the first block's own (out, lse), or fp32 accumulators) merged with the block
    (o, l) at region `reg` (Note [Fewer passes]). With dst = (out, lse), the last merge: the
    result goes there (out in the input dtype) and dst is returned."""
    if acc is None:
        if _covers(reg, shape) and dst is None:
            return o, l  # the first block's own result, as it is
        # out = 0, lse = -inf: rows that have seen no key yet
        acc = (torch.zeros(shape, dtype=adt, device=o.device), torch.full(shape[:3], float("-inf"), dtype=adt, device=o.device))
    out_a, lse_a = acc
    if dst is None and out_a.dtype != adt:  # widened into a new accumulator, in the merge's pass
        dst = (torch.empty(shape, dtype=adt, device=o.device), lse_a)
    if dst is None:
        dst = acc  # in place
    else:
        _copy_outside(dst[0], out_a, reg)
        if dst[1] is not lse_a:
            _copy_outside(dst[1], lse_a, reg)
    merge_(_at(out_a, reg), _at(lse_a, reg), o, l, _at(dst[0], reg), _at(dst[1], reg))
    return dst


# Note [Key runs per mask]
# Which ranks' valid keys form one run per batch row depends only on the mask's values and the
# ring. Each answer costs an all-gather and a host sync (the host loses its lead over the GPU),
# so it is an input of the ring ops, made by its own op (ops.key_runs_op): `ring_attention`
# makes it once per call and autograd keeps it for the backward (traced by torch.compile, the
# ring op makes its own, forward and backward: a table made outside a CUDA graph must not steer
# a captured ring op, which keeps every mask instead); the compiled backend makes it
# once per key mask of a graph (passes/shard_sequence.py), so every layer's forward and backward
# that reads that mask shares one all-gather. No cache: a cached answer would go stale on a
# write the version counter does not see, or on one rank alone (a rank all-gathering alone
# hangs the ring). The table is [world, b, 2] int64 on the host: entry [r, i] = (a, c) when the
# valid keys of rank r's batch row i are its rows [a, c); (-1, -1) when they are not one run.


def row_runs(key_valid):
    """(a, c, one) per row of a bool [b, s] key mask, on its device: `one` is True where the
    row's valid keys are exactly [a, c) (a == c == 0: none), False where they are not one run."""
    s = key_valid.shape[-1]
    idx = torch.arange(s, device=key_valid.device)
    count = key_valid.sum(-1)  # [b]
    first = torch.where(key_valid, idx, s).amin(-1)  # the first valid key (s: none)
    a = torch.where(count > 0, first, 0)
    run = (idx >= a[:, None]) & (idx < (a + count)[:, None])
    return a, a + count, (key_valid == run).all(-1)


def key_runs_table(key_valid, group, world: int) -> torch.Tensor:
    """The [world, b, 2] table of Note [Key runs per mask]: this rank's runs all-gathered (one
    host sync). The no-transfer benchmark schedule computes on the local block alone, so the
    local answer fills every rank's entries. CUDA graph capture (no host sync there) gets a
    table of no runs: every mask kept."""
    b, s = key_valid.shape
    if key_valid.is_cuda and torch.cuda.is_current_stream_capturing():
        return torch.full((world, b, 2), -1, dtype=torch.int64)
    a, c, ok = row_runs(key_valid)
    mine = torch.stack([torch.where(ok, a, -1), torch.where(ok, c, -1)], -1).to(torch.int64)  # [b, 2]
    if world == 1 or _skip_comm():
        return mine.cpu().expand(world, b, 2).clone()
    got = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(got, mine, group=group)
    return torch.stack(got).cpu()


def _kv_chunk(setup: RingSetup, q, key_valid, runs, fn, score) -> tuple[int, "FnBlocks | None"]:
    """(K/V heads per chunk of this call (0: all), the FnBlocks of all heads when it made one).
    The setup's chunk, by the head-chunk rule, except at p = 1 when the one block takes at most
    one kernel call over all its rows and keys. That call's results are then the outputs, with
    no accumulator (Note [Fewer passes]), so head chunks would save no memory and cost time
    (Note [Head chunks]). The calls are decided as `_ring_steps` decides them; a mask function's
    FnBlocks keeps the calls it made, and a ring of whole heads takes it, so they are made once."""
    if setup.kv_chunk == 0 or setup.world != 1:
        return setup.kv_chunk, None
    b, h, s = q.shape[:3]
    calls = setup.masked_calls(s, 0, q.device, runs.get(0))
    blocks = None
    if fn is not None:
        blocks = FnBlocks(fn, setup, s, b, h, 0, q.device, q.dtype, score is not None)
        calls = blocks.calls(calls, 0, keyed=key_valid is not None and 0 not in runs)
    one = [_region(c, b, keys) for c, _ in calls for keys in (False, True)]
    whole = len(calls) <= 1 and all(_covers(reg, (b, h, s)) for reg in one)
    return (0, blocks) if whole else (setup.kv_chunk, None)


def _key_runs(key_valid, setup: RingSetup, table=None) -> dict[int, tuple[tuple[int, int], ...]]:
    """{ring rank: ((a, c) per batch row)} for the ranks whose valid keys are exactly the rows
    [a, c) of each batch row ((0, s): all valid; a == c: none): their blocks need no mask
    (`clip_calls`, per run of batch rows with the same keys). From `table` (Note [Key runs per
    mask]), or all-gathered now when None. Sub-rings (`members`: the group's table would not
    match the ring) keep every mask, and so does a ring op captured in a CUDA graph: the table
    is a host value made outside the graph (inductor leaves host ops out of its CUDA-graph
    parts), so calls cut by it would be replayed for later masks too."""
    if key_valid is None or setup.members is not None:
        return {}
    if key_valid.is_cuda and torch.cuda.is_current_stream_capturing():
        return {}
    if table is None:
        table = key_runs_table(key_valid, setup.group, setup.world)
    want = (setup.world, key_valid.shape[0], 2)
    if tuple(table.shape) != want or table.dtype != torch.int64:
        raise ValueError(f"key_runs must be an int64 [world={want[0]}, batch={want[1]}, 2] table; got "
                         f"{table.dtype} {tuple(table.shape)}")
    return {r: tuple(map(tuple, rows)) for r, rows in enumerate(table.tolist()) if all(lo >= 0 for lo, _ in rows)}


def _ring_key_mask(key_valid, setup: RingSetup, table=None):
    """(key mask to send around, or None when every rank's valid keys are one run, so that no
    block reads it; `_key_runs`)."""
    runs = _key_runs(key_valid, setup, table)
    return (None if len(runs) == setup.world else key_valid), runs


class _Mods:
    """The score function of each block call (Note [Score functions] in maskfn.py): `score`,
    (MaskFn, tensors) or None, at the global positions of the call's rows and keys, its batch
    rows and the site's heads from `head0` on."""

    def __init__(self, setup: RingSetup, score, s: int, head0: int, device):
        self.setup, self.score, self.s, self.head0, self.device = setup, score, s, head0, device
        # the positions of the rows the ring computes: a balance plan's chunks or the layout's
        self.q_pos = None if score is None else setup.positions(setup.rank, s, device)
        self.k_pos: dict = {}

    def of(self, src: int, c: BlockCall):
        if self.score is None:
            return None
        if src not in self.k_pos:
            self.k_pos[src] = self.setup.positions(src, self.s, self.device)
        fn, tensors = self.score
        return maskfn.FnScore(fn, tensors, self.q_pos[c.q0:c.q1], self.k_pos[src][c.k0:c.k1], c.b0, self.head0,
                              self.setup.starts(src, self.s, c))


def _ring_forward_chunk(q, k, v, key_valid, setup: RingSetup, out=None, lse=None, runs=None, score=None,
                        head0: int = 0, fn=None, blocks=None):
    """-> (out in q's dtype, lse) of these heads (the site's from `head0` on), written
    into `out`/`lse` where given. out has v's head dim (Note [Value head dim] in kernels.py)."""
    b, h, s = q.shape[:3]
    d = v.shape[-1]
    mods = _Mods(setup, score, s, head0, q.device)
    adt = kernels.acc_dtype(q.dtype)
    dst = None if out is None else (out, lse)
    acc, done = None, False
    comm = ring_comm(setup.group, setup.members, q.device) if setup.world > 1 and not _skip_comm() else None
    if blocks is None and fn is not None:  # (given: `_kv_chunk`'s, of these heads)
        blocks = FnBlocks(fn, setup, s, b, h, head0, q.device, q.dtype, score is not None)
    for st in _ring_steps(setup, comm, k, v, key_valid, s, q.device, runs=runs, fn=blocks):
        last_step = st.index == setup.world - 1
        for i, (c, allowed) in enumerate(st.calls):
            rows, keys = _region(c, b), _region(c, b, keys=True)
            o, l = kernels.block_fwd(
                _at(q, rows), _at(st.k, keys), _at(st.v, keys), scale=setup.scale, causal=c.causal,
                key_valid_bs=None if st.key_valid is None else st.key_valid[keys[0]:keys[1], keys[2]:keys[3]],
                allowed_qk=allowed, mod=mods.of(st.src, c),
            )
            done = last_step and i == len(st.calls) - 1 and acc is not None  # the last merge writes the output
            if done and dst is None:
                dst = (q.new_empty((b, h, s, d)), torch.empty(b, h, s, dtype=adt, device=q.device))
            acc = _merge_block(acc, o, l, rows, (b, h, s, d), adt, dst if done else None)
            del o, l  # not alive at the end
        del st
    if acc is None:  # no key visible to any row
        acc = (q.new_zeros((b, h, s, d)), torch.full((b, h, s), float("-inf"), dtype=adt, device=q.device))
    if done:
        return acc
    if dst is None:  # the one block's own result (or the sum when the last step had no call)
        return acc[0].to(q.dtype), acc[1]
    copy_by_kernel(dst[0], acc[0])
    copy_by_kernel(dst[1], acc[1])
    return dst


class FnBlocks:
    """The block calls of a ring under a mask function (Note [Mask functions] in maskfn.py): each
    call of the block of rank `src` gets the function at the global positions of its rows and
    keys, and is dropped when the function empties it, kept unmasked when it fills it, and kept
    with the function as its position mask otherwise. `fn`: (MaskFn, tensors); heads [h0, h0 +
    heads) of the site, batch of `batch` rows."""

    def __init__(self, fn, setup: RingSetup, s: int, batch: int, heads: int, h0: int, device, dtype=None,
                 score: bool = False):
        self.fn, self.tensors = fn
        self.setup, self.batch, self.heads, self.h0 = setup, batch, heads, h0
        self.q_pos = setup.positions(setup.rank, s, device)
        self.s, self.device = s, device
        # flex_attention takes a partial call whole, its tiles from the function's bounds, less
        # the dense parts the fused kernels take where they can (no score function: Note [Dense parts])
        self.whole = dtype is not None and kernels.flex_blocks(torch.device(device), dtype)
        self.dense = self.whole and not score
        self._made: dict = {}  # (src, keyed, the calls) -> what `calls` made of them

    def calls(self, calls, src: int, keyed: bool = False):
        """The calls of the block of rank `src` (`keyed`: it holds a key mask, which the fused
        kernels do not take); made once per block and calls."""
        key = (src, keyed, tuple(c for c, _ in calls))
        made = self._made.get(key)
        if made is None:
            made = self._made[key] = self._calls(calls, src, keyed)
        return list(made)

    def _calls(self, calls, src: int, keyed: bool) -> list:
        k_pos = self.setup.positions(src, self.s, self.device)
        out = []
        for c, allowed in calls:
            if allowed is not None:
                raise AssertionError("a window mask with a mask function (the op takes one of them)")
            b0, b1 = c.rows(self.batch)
            # the positions of the call's rows and keys: their chunks (a balance plan's or the
            # layout's), the chunk length and the call's bounds (Note [Built once per mask])
            where = (self.setup.local_chunks(self.setup.rank), self.setup.local_chunks(src), self.s, c.q0, c.q1, c.k0,
                     c.k1, str(self.device))
            m = maskfn.FnMask(self.fn, self.tensors, self.q_pos[c.q0:c.q1], k_pos[c.k0:c.k1], b1 - b0, self.heads,
                              b0, self.h0, c.causal, where, starts=self.setup.starts(src, self.s, c))
            if self.whole:
                state = maskfn.classify(m, maskfn.FLEX_TILE)
                if state == "full":
                    out.append((c, None))
                elif state == "partial":
                    out.extend(self._partial(c, m, keyed))
                continue
            state, parts = maskfn.split(m)
            if state == "full":
                out.append((c, None))
            for r0, r1, k0, k1, masked in parts:  # rows and keys of the call: the diagonal is in the mask
                part = BlockCall(c.q0 + r0, c.q0 + r1, c.k0 + k0, c.k0 + k1, False, c.b0, c.b1)
                out.append((part, m.sub(r0, r1, k0, k1) if masked else None))
        return out


    def _partial(self, c: BlockCall, m: "maskfn.FnMask", keyed: bool) -> list:
        """A partial call on flex_attention: its dense parts on the fused kernels, the rest whole
        (Note [Dense parts] in maskfn.py)."""
        parts, rest = maskfn.dense_parts(m) if self.dense and not keyed else ((), m)
        out = [(BlockCall(c.q0 + r0, c.q0 + r1, c.k0 + k0, c.k0 + k1, low, c.b0, c.b1), None)
               for r0, r1, k0, k1, low in parts]
        if rest is not None:
            out.append((BlockCall(c.q0, c.q1, c.k0, c.k1, False, c.b0, c.b1), rest))
        return out


class RingStep:
    """One step of the ring: the block held now (K, V, key mask, kernel calls against it).

    `carry_out` (set by the caller before it moves on) rides to rank+1 in the next step's
    batch; `wait()` finishes this step's batch (the next block's K/V and what rank-1's caller
    set as its carry) and returns the carry received, or None."""

    def __init__(self, index, k, v, key_valid, calls, comm, carry_in, src=0):
        self.index, self.k, self.v, self.key_valid, self.calls = index, k, v, key_valid, calls
        self.src = src  # the ring rank whose block is held
        self.carry_out = None
        self._comm, self._carry_in = comm, carry_in

    def wait(self):
        if self._comm is not None:
            self._comm.wait()
            self._comm = None
        return self._carry_in


def _ring_steps(setup: RingSetup, comm, k, v, key_valid, s: int, device, carry=None, runs=None, fn=None):
    """The ring's steps, as RingStep objects. Before yielding step i it issues one batch: the
    held K/V (and key mask) to rank+1 for its step i+1, plus `carry` (at step 0 the argument,
    then the previous step's `carry_out`), so the transfers overlap the caller's compute; the
    batch is waited for by `RingStep.wait()` or when the caller comes back for the next step.
    One batch per step is one rendezvous of the ranks per step. A block from a rank in
    `runs` (its valid keys one run, _key_runs) is held with no key mask, its calls cut to
    those keys. With a mask function (`fn`, a FnBlocks) each call is classified by it
    (Note [Mask functions] in maskfn.py)."""
    runs = runs or {}
    held = [k, v] + ([key_valid] if key_valid is not None else [])
    for step in range(setup.world):
        send = (held if step + 1 < setup.world else []) + list(carry or [])
        recv, n_held, carried = [], len(held) if step + 1 < setup.world else 0, bool(carry)
        if comm is not None and send:
            recv = comm.send_recv(send)
            comm.commit()
        # The transport keeps what it sends until the batch is waited for (its contiguous copy
        # of a strided accumulator, say); this frame lets go of the accumulator itself now.
        send = carry = None
        src = (setup.rank - step) % setup.world
        calls = setup.masked_calls(s, src, device, runs.get(src))
        if fn is not None:
            calls = fn.calls(calls, src, keyed=key_valid is not None and src not in runs)
        st = RingStep(step, held[0], held[1], held[2] if key_valid is not None and src not in runs else None,
                      calls, comm if recv else None, recv[n_held:] if carried and recv else None, src)
        yield st
        st.wait()
        carry = st.carry_out
        if n_held and recv:
            held = recv[:n_held]
        del st


def _accumulate(accs, blks, reg, shape, adt, dsts=None) -> list:
    """The running sums acc + blk of each (acc, blk) pair (dQ alone, or dK with dV: their adds in
    one launch, merge.add_into), blk at region `reg` of `shape`. acc: None (nothing yet), one
    block's gradient in its own dtype, or an accumulator in adt (Note [Fewer passes]). Without
    dst a sum's new running value is the block itself when it is the first and covers the whole
    shape, acc updated in place when it is an accumulator, else a new one. With dst (the last
    addition) the sum goes there in dst's dtype, in the same pass. Returns the sums, in order.
    `shape`'s last dim is each block's own (dK and dV may differ there: Note [Value head dim] in
    kernels.py)."""
    full = _covers(reg, shape)
    out, adds = [], []
    for acc, blk, dst in zip(accs, blks, dsts or [None] * len(accs)):
        shape = (*shape[:-1], blk.shape[-1])
        if acc is None:
            if full and dst is None:
                out.append(blk)
                continue
            if dst is None:
                dst = torch.zeros(shape, dtype=adt, device=blk.device)
            else:
                for part in _outside(reg, shape):
                    _at(dst, part).zero_()
            copy_by_kernel(_at(dst, reg), blk)
            out.append(dst)
            continue
        if dst is None:
            dst = acc if acc.dtype == adt else torch.empty(shape, dtype=adt, device=blk.device)
        if dst is not acc:
            _copy_outside(dst, acc, reg)
        adds.append((_at(dst, reg), _at(acc, reg), blk))
        out.append(dst)
    if adds:
        add_into(*adds[0], pair=adds[1] if len(adds) > 1 else None)
        for extra in adds[2:]:
            add_into(*extra)
    return out


def _carry(acc, step: int, adt, wide_first: bool = False):
    """The dK/dV accumulator as it travels to rank+1 after `step`, in a dtype every rank knows
    without being told: a receiver's buffers mirror its own outgoing tensors (RingComm's
    empty_like, the copy-engine ring's slot layout), so sender and receiver must agree.
    At step 0 every rank holds its own block, which `plan_block` always covers with one call
    over all its keys (a window keeps it: the diagonal is visible): every rank's carry is one
    block's gradient in the kernel's dtype, which may travel as it is (exact, half the bytes;
    Note [Fewer passes]), unless some rank cut its own block to runs of valid keys
    (`clip_calls`, per run of batch rows: `wide_first`, the same answer on every rank, from the
    all-gathered runs).
    Later steps differ by rank (a block may get one call, several, or none and be forwarded as
    it came): the accumulator's dtype. Sending what happened to be at hand
    broke bf16 rings of p >= 3 (a size mismatch on gloo and NCCL, misread slots on the
    copy-engine ring)."""
    if (step == 0 and not wide_first) or acc.dtype == adt:
        return acc
    return acc.to(adt, memory_format=torch.contiguous_format)  # sent as it is: no second copy


def ring_backward(dout, q, k, v, key_valid, out, lse, setup: RingSetup, key_runs=None, score=None, fn=None):
    """Gradients (dq, dk, dv) of ring attention, given the global out and lse (and the forward's
    key_runs table: Note [Key runs per mask]).

    Per chunk of heads (Note [Head chunks]); the dK/dV accumulators travel one hop behind
    the K/V they belong to, in the same batch as the next K/V (Note [Ring attention schedule]);
    sums as in Note [Fewer passes]."""
    b, h, s, d = q.shape
    g, dv = k.shape[1], v.shape[-1]
    adt = kernels.acc_dtype(q.dtype)
    key_valid, runs = _ring_key_mask(key_valid, setup, key_runs)
    kv_chunk, whole_blocks = _kv_chunk(setup, q, key_valid, runs, fn, score)
    chunks = head_chunks(h, g, kv_chunk)
    whole = len(chunks) == 1
    world, skip = setup.world, _skip_comm()
    use_comm = world > 1 and not skip
    comm = ring_comm(setup.group, setup.members, q.device) if use_comm else None
    dout, out = contiguous(dout), contiguous(out)
    lse_bwd = kernels.bwd_lse(lse)  # once for every head chunk and block call
    # some rank's own block is cut, or split by batch rows: more than one call (_carry)
    wide_first = any(r != (0, s) for rows in runs.values() for r in rows)
    if comm is not None:  # the largest batch: a chunk's K/V (and key mask) with its fp32 dK/dV accumulators
        g_c = chunks[0][1].stop - chunks[0][1].start
        kv, acc = b * g_c * s * k.element_size(), b * g_c * s * torch.finfo(adt).bits // 8
        comm.reserve([kv * d, kv * dv, acc * d, acc * dv] + ([key_valid.numel() * key_valid.element_size()] if key_valid is not None else []))
    # Chunks write into the full-size outputs; whole heads return their sums as tensors of their
    # own (a single block's gradient as the kernel returned it: no copy).
    full_out = None if whole else [torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v)]
    done = {}

    def out_slice(i, sl, shape, dtype):
        """Where gradient i (0 dq, 1 dk, 2 dv) of the heads `sl` is written when complete."""
        return torch.empty(shape, dtype=dtype, device=q.device) if whole else full_out[i][:, sl]

    def finish(i, sl, total, borrowed=False):
        """Gradient i of heads `sl`, complete (input dtype, or the accumulator's), into the outputs;
        `borrowed`: a view of the transport's receive area, which is reused."""
        if whole:
            got = total.to((q, k, v)[i].dtype)
            if borrowed and got is total:
                got = torch.empty_like(total)
                copy_by_kernel(got, total)
            done[i] = got
        else:
            dst = full_out[i][:, sl]
            if (total.data_ptr(), total.stride(), total.dtype) != (dst.data_ptr(), dst.stride(), dst.dtype):
                copy_by_kernel(dst, total)  # else written there by the last addition

    borrowed = comm is not None and comm.borrows_buffers
    home = None  # (K/V-head slice, [dk, dv]) the last chunk finished: its hop home rides the next batch
    for hq, hk in chunks:
        q_c, do_c, o_c, l_c = (t if whole else t[:, hq] for t in (q, dout, out, lse_bwd))
        k_c, v_c = (t if whole else t[:, hk] for t in (k, v))
        mods = _Mods(setup, score, s, hq.start, q.device)
        if use_comm and not whole:
            k_c, v_c = contiguous(k_c), contiguous(v_c)  # sent as they are
        dq = dk_acc = dv_acc = None
        blocks = whole_blocks or (None if fn is None else FnBlocks(fn, setup, s, b, hq.stop - hq.start, hq.start,
                                                                   q.device, q.dtype, score is not None))
        steps = _ring_steps(setup, comm, k_c, v_c, key_valid, s, q.device, carry=home[1] if home else None,
                            runs=runs, fn=blocks)
        del k_c, v_c
        for st in steps:
            kv_shapes = st.k.shape, st.v.shape
            last_step = st.index == world - 1
            kv_grads = []
            for i, (c, allowed) in enumerate(st.calls):
                rows, keys = _region(c, b), _region(c, b, keys=True)
                dq_b, dk_b, dv_b = kernels.block_bwd(
                    _at(do_c, rows), _at(q_c, rows), _at(st.k, keys), _at(st.v, keys), _at(o_c, rows), _at(l_c, rows),
                    scale=setup.scale, causal=c.causal, lse_prepared=True,
                    key_valid_bs=None if st.key_valid is None else st.key_valid[keys[0]:keys[1], keys[2]:keys[3]],
                    allowed_qk=allowed, mod=mods.of(st.src, c),
                )
                last = last_step and i == len(st.calls) - 1 and dq is not None  # dQ complete: the output
                (dq,) = _accumulate([dq], [dq_b], rows, q_c.shape, adt,
                                    [out_slice(0, hq, q_c.shape, q.dtype)] if last else None)
                kv_grads.append((c, dk_b, dv_b))
                del dq_b, dk_b, dv_b  # no name keeps a block's grads alive past their use
            # Wait for this step's batch only now, so it overlaps this step's kernels. It brings
            # the accumulator of the block held now (at step 0: the last chunk's, coming home).
            incoming = st.wait()
            if incoming is not None:
                if st.index == 0:
                    finish(1, home[0], incoming[0], borrowed)
                    finish(2, home[0], incoming[1], borrowed)
                    home = None
                else:
                    dk_acc, dv_acc = incoming
            del incoming
            while kv_grads:
                c, dk_b, dv_b = kv_grads.pop()
                dk_dst = dv_dst = None
                if last_step and not kv_grads and dk_acc is not None:
                    # The block's sum is complete: in the input dtype, for the hop home (the owner
                    # would narrow it on arrival: same values, half the bytes of the one hop no
                    # later kernel of this chunk hides) or straight into the outputs.
                    if use_comm:
                        dk_dst, dv_dst = (torch.empty(sh, dtype=t.dtype, device=q.device) for sh, t in zip(kv_shapes, (k, v)))
                    else:
                        dk_dst, dv_dst = out_slice(1, hk, kv_shapes[0], k.dtype), out_slice(2, hk, kv_shapes[1], v.dtype)
                keys = _region(c, b, keys=True)
                dk_acc, dv_acc = _accumulate([dk_acc, dv_acc], [dk_b, dv_b], keys, kv_shapes[0], adt,
                                             None if dk_dst is None else [dk_dst, dv_dst])
                del dk_b, dv_b
            if dk_acc is None:  # no kernel call against this block: it still travels (exact zeros)
                dk_acc = torch.zeros(kv_shapes[0], dtype=k.dtype, device=q.device)
                dv_acc = torch.zeros(kv_shapes[1], dtype=v.dtype, device=q.device)
            if use_comm:
                # The accumulator of the block held now goes to rank+1 with the next batch (it
                # holds that block next step; after the last step the hop brings it home).
                if last_step:
                    home = (hk, [dk_acc.to(k.dtype), dv_acc.to(v.dtype)])  # as is when written above
                else:
                    st.carry_out = [_carry(dk_acc, st.index, adt, wide_first), _carry(dv_acc, st.index, adt, wide_first)]
                dk_acc = dv_acc = None
            del st
        if not use_comm:
            finish(1, hk, dk_acc)
            finish(2, hk, dv_acc)
        if dq is None:  # no key visible to any row
            dq = torch.zeros(q_c.shape, dtype=q.dtype, device=q.device)
        finish(0, hq, dq)
        del dq, dk_acc, dv_acc, steps
    if home is not None:  # the last chunk's hop home: nothing left to overlap it with
        arrived = comm.send_recv(home[1])
        comm.commit()
        comm.wait()
        finish(1, home[0], arrived[0], borrowed)
        finish(2, home[0], arrived[1], borrowed)
    return (done[0], done[1], done[2]) if whole else tuple(full_out)


def resolve_world(group, what: str = "ringcc") -> tuple[object, int, int]:
    """(group, rank, world) with p = 1 when no process group is initialised (and the launcher's
    environment does not say otherwise: `check_no_launcher`)."""
    if not dist.is_available() or not dist.is_initialized():
        check_no_launcher(what)
        return None, 0, 1
    group = group if group is not None else dist.group.WORLD
    return group, dist.get_rank(group), dist.get_world_size(group)


def check_no_launcher(what: str, remedy: str = "") -> None:
    """An error when the launcher's environment (torchrun's WORLD_SIZE) says this process is one
    of p > 1 ranks but no process group is initialised: run as p = 1, every rank would compute a
    different and wrong result without a sign."""
    raw = os.environ.get("WORLD_SIZE", "")
    try:
        world = int(raw)
    except ValueError:
        return
    if world <= 1:
        return
    seen = ", ".join(f"{name}={os.environ[name]}" for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK")
                     if name in os.environ)
    raise ValueError(
        f"{what}: the environment says this process is one of {world} ranks ({seen}), but no process "
        "group is initialised, so it would run alone (p = 1) and compute a wrong result. Call "
        "torch.distributed.init_process_group() first (ringcc.launch.launch does it), or unset WORLD_SIZE "
        f"to run on one process{remedy}")
