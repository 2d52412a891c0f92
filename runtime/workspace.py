"""Workspace formulas of the ringcc custom ops (and of the attention ops ringcc replaces),
for the memory planner.

A formula gets the op's arguments by schema name, tensors as `TensorSize` (sympy shape and
item size), and the world-size symbol `p`; it returns a `Workspace`: the bytes the op holds
*besides* its inputs and outputs while it runs, in forward and in its backward. The
formulas follow the schedules they describe (read them next to ring.py / dilated.py):

Forward ring (Note [Ring attention schedule]): K/V (and the key mask) are double buffered:
at most min(2, p - 1) received sets are alive at once (the held block and the one in
flight; none at p = 1). Outputs accumulate in fp32: for fp32 inputs the accumulator *is* the
output, for bf16/fp16 it is an extra fp32 [b, h, s, d] and the output is cast from it after
the last merge. Per step, the larger of the kernel phase (GQA-expanded K/V, the block's out)
and the merge phase (block out, its fp32 cast, the weighted product, a few fp32 rows).

Backward ring: the maximum over the schedule's phases (first kernels, later kernels,
accumulate, send, end; see `_ring_chunk`) of what each holds: the fp32 dQ and dK/dV
accumulators, the dK/dV accumulator arriving from the previous rank and the one sent to the
next (held by the transport until the batch is waited for), the held and next K/V, one block's
gradients with the kernel's own fp32 dQ accumulator, plus dout made contiguous.
Checked against the CUDA allocator (benchmarks/bench_planner_gpu.py, memory_snapshot.py;
results in benchmarks/RESULTS.md). On CPU (gloo), checked against the CPU
allocator's events seen by torch.profiler (tests/test_planner.py), three more terms: gloo's
contiguous copy of a sent accumulator (the CPU kernel returns gradients in its own [b, s, h, d]
layout) may outlive the wait, the kernel copies dout into that layout, and it holds per-thread
tiles (`cpu_kernel_tiles`, a constant outside the head-chunk rule).

Received blocks: through NCCL/gloo they are fresh allocations per step, counted in the
phases above. With the copy-engine transport (the GPU default, runtime/comm.py) they land in
a receive area of a header and two slots of the largest batch, which stays allocated after
the op (outside torch's caching allocator on torch 2.11; comm.py measures which): the
workspace then leaves the received blocks out, and `Workspace.area_*` gives the area, which
the planner counts once per graph as resident. Counting received blocks per phase instead
under-predicted a training step on 4 x H200 by 12-38% once the area was measured. The head-chunk rule decides on the per-phase numbers on every transport, so the
chunks (and the measured schedules) do not depend on the transport.

Other ops with a backward workspace: `pow` (two input-sized temporaries).

Head chunks (Note [Head chunks] in ring.py): when the whole-heads workspace exceeds the
budget (RINGCC_RING_WORKSPACE_MIB, or by default 320 MiB + 3/4 of the bytes of q, k, v and
the output), the ring runs once per chunk of K/V heads,
the largest divisor of the K/V head count whose workspace fits (else one K/V head), and the
buffers above are those of one chunk. The forward, which sends K/V only, may take larger
chunks than that backward choice: the largest whose forward workspace fits and whose batch
(K and V of the chunk) is no larger than the backward's (K, V and their fp32 dK/dV), so it
never needs a larger receive area than the backward (3x the heads for bf16). Fewer, larger
chunks make fewer steps, kernel calls and merges. The formulas are Piecewise over those
choices, the same rule the runtime evaluates (`ring_kv_chunk`), so plan and run agree.
At p = 1 a block of one kernel call has no accumulator and runs whole heads (`_one_call`);
where the block may take several calls (a key mask, a mask function, a balance plan) the plan
takes the larger of that and the rule's choice, since which one runs depends on the data.

Dilated (LongNet, Note [Dilated attention]): fp32 accumulators as above, plus per branch the
compressed q/k/v/out rows (n/p / r rows each; none for a branch that takes every row of every
head, r = 1, which reads its inputs as they are) and, for branches whose segment spans ranks,
the sub-ring receive buffers: at most two compressed blocks, and never more than the rows
the branch communicates (`dilated_comm_rows`: O(w/r), independent of n and p). The largest
branch counts (branches run one after another). An upper bound (the block outputs and the
accumulators they start are both counted). Head chunks as the ring's (Note [Dilated head
chunks]): forward and backward each take the largest chunk of K/V heads whose workspace fits
the budget (by default the ring's, but at least 4 GiB: `default_dilated_budget`), and then hold
one chunk's accumulators and branch tensors.

Un-rewritten SDPA / multi-head attention: counted as the math path's fp32 score matrix
[b, h, Lq, Lk]; that is what makes such a site quadratic in n (fused kernels avoid the
matrix, but the site is still unsharded and needs full-length K/V on every rank).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable

import sympy

from .dilated_spec import DilatedSpec, chunk_pairs, dilated_comm_rows, dilated_kv_slots

FP32 = 4


@dataclass(frozen=True)
class TensorSize:
    """A tensor's symbolic shape and element size. Invariant: dims are sympy expressions
    that are positive for positive symbols; itemsize > 0."""

    shape: tuple
    itemsize: int
    device_type: str = "cpu"  # the LSE merge is one fused kernel on CUDA (runtime/merge.py)

    @property
    def numel(self) -> sympy.Expr:
        return sympy.Mul(*self.shape) if self.shape else sympy.Integer(1)

    @property
    def nbytes(self) -> sympy.Expr:
        return self.numel * self.itemsize

    def with_itemsize(self, itemsize: int) -> "TensorSize":
        return TensorSize(self.shape, itemsize, self.device_type)


@dataclass(frozen=True)
class Workspace:
    """Transient bytes an op holds while it runs (forward) and while its backward runs."""

    forward: sympy.Expr = sympy.Integer(0)
    backward: sympy.Expr = sympy.Integer(0)
    # Bytes the op leaves allocated after it returns, for every later op of its kind to share
    # (the copy-engine receive area, grown to the largest batch), in an inference run and in a
    # training step: the plan counts the largest of a graph's once, as resident.
    area_forward: sympy.Expr = sympy.Integer(0)
    area_training: sympy.Expr = sympy.Integer(0)


def _nbytes(t) -> sympy.Expr:
    return sympy.Integer(0) if t is None else t.nbytes


def _acc_itemsize(itemsize: int) -> int:
    """Bytes per element of the ring's accumulators (dtypes.acc_dtype: fp64 for fp64, else fp32)."""
    return 8 if itemsize == 8 else FP32


def _acc_extra(q: TensorSize) -> sympy.Expr:
    """fp32 accumulator that is not the output itself (the output is cast from it)."""
    return sympy.Integer(0) if q.itemsize >= FP32 else q.with_itemsize(FP32).nbytes


def _max(*args) -> sympy.Expr:
    """sympy.Max of these, left unevaluated where any is symbolic: sympy's search for dominated
    arguments was most of a formula's cost (seconds per attention site at compile), and the
    planner bounds an unevaluated maximum as it does any other (planner.upper_bound)."""
    if all(sympy.sympify(a).is_number for a in args):
        return sympy.Max(*args)
    return sympy.Max(*args, evaluate=False)


def _kv_in_flight(p) -> sympy.Expr:
    return sympy.Min(2, p - 1)


def _native_gqa(q: TensorSize) -> bool:
    """Whether the block kernels take K/V at their own heads (CUDA's cuDNN kernels: kernels.py)."""
    from . import kernels

    return q.device_type == "cuda" and kernels._cuda_kernel() == "cudnn" and kernels.native_gqa_setting()


def _expanded_kv(q: TensorSize, k: TensorSize) -> sympy.Expr:
    """GQA: K and V expanded to q's heads inside the block kernel (none for MHA, or where the
    kernel takes K/V at their own heads)."""
    if k.shape[1] == q.shape[1] or _native_gqa(q):
        return sympy.Integer(0)
    return 2 * TensorSize((k.shape[0], q.shape[1]) + tuple(k.shape[2:]), k.itemsize).nbytes


def _ring_chunk(q: TensorSize, k: TensorSize, kv_mask, p, chunked: bool,
                zigzag_causal: bool = False, area: bool = False, rule: bool = False) -> tuple[sympy.Expr, ...]:
    """(forward, backward, forward batch, backward batch): the workspace of the ring over the
    heads of q/k (one head chunk when `chunked`: its accumulators are then always extra, since
    the outputs are allocated once up front; the chunk's K/V slice is made contiguous to be
    sent), and the bytes of one batch it sends per step. With `area` the received blocks land
    in the copy-engine receive area (`receive_area`), so the workspace leaves them out. With
    `rule`, the numbers the head-chunk rule decides on, as they were tuned on GPU (and the CPU
    terms on CPU): every arriving accumulator counted in fp32, none in flight counted (the
    plan's own accounting counts both as they are)."""
    b, h, s, d = q.shape
    acc = _acc_itemsize(q.itemsize)  # the accumulators' dtype (fp64 for fp64 inputs, else fp32)
    rows_f32 = sympy.Integer(acc) * b * h * s  # one [b, h, s] accumulator-dtype tensor
    q32, k32 = q.with_itemsize(acc).nbytes, k.with_itemsize(acc).nbytes
    low = q.itemsize < FP32  # bf16/fp16: accumulators are extra, outputs are cast at the end
    kv, mask = 2 * k.nbytes, _nbytes(kv_mask)  # K and V have one shape
    one = sympy.Min(1, p - 1)  # 0 at p = 1, else 1
    if area:
        # only a chunk's own K/V slice, a contiguous copy while it is sent (step 0)
        received = one * kv if chunked else sympy.Integer(0)
    else:
        # Double buffering: the held block and the one in flight; a chunk's own K/V slice is a
        # contiguous copy while it is sent (step 0), so then also two sets at p = 2.
        received = (sympy.Min(2, 2 * (p - 1)) * kv if chunked else _kv_in_flight(p) * kv) + _kv_in_flight(p) * mask

    # Forward: the kernel phase (expanded K/V, block out/lse), then the merge phase: block out
    # and a few fp32 row vectors; eagerly (CPU) also the block's fp32 cast and the weighted
    # product, which the fused CUDA merge never materialises.
    kernel = _expanded_kv(q, k) + q.nbytes + rows_f32
    merge = q.nbytes + 4 * rows_f32
    if q.device_type != "cuda":
        merge += (q32 if low else 0) + q32
    if chunked:
        forward = received + q32 + rows_f32 + sympy.Max(kernel, merge)
    else:
        # A low-precision output is allocated after the last merge, when the block
        # temporaries are gone: the planner counts it already, so the overlap is taken off.
        forward = received + _acc_extra(q) + sympy.Max(kernel, merge) - (q.nbytes if low else 0)

    # Backward, by phase of the schedule (ring.py, ring_backward); at most one of them is
    # alive at a time, so the workspace is their maximum:
    #   first kernels   fp32 dQ accumulator, the next K/V in flight, the block kernel (its
    #                   q-headed grads, expanded K/V for GQA, its own fp32 dQ accumulator, row
    #                   sums, the GQA-reduced dK/dV); with chunks also the chunk's own K/V
    #                   copy and the previous chunk's last dK/dV hop still arriving;
    #   later kernels   dQ, the dK/dV accumulator arriving, the held and next K/V, and the
    #                   accumulator sent after the step before; zigzag
    #                   causal blocks after the diagonal are half as long on the key side;
    #   accumulate      dQ, the dK/dV accumulator, the block's dK/dV, the held/next K/V;
    #   send            dQ, the accumulator being sent and the one arriving, held/next K/V
    #                   (the last hop, home, is cast to the input dtype first);
    #   end             (without chunks) the outputs cast from the accumulators, while the
    #                   last hop arrives.
    # A sent buffer counts until its Python reference goes: the allocator then books it as
    # free (NCCL's stream keeps it from reuse until the transfer ends).
    # Without chunks the gradient outputs are these accumulators (fp32) or are cast from them
    # at the very end (bf16/fp16), when the block temporaries are gone: the planner counts the
    # outputs already, so their bytes are taken off; with chunks the outputs are allocated up
    # front and the accumulators are per chunk.
    gqa = k.shape[1] != h and not _native_gqa(q)  # q-headed block dK/dV, then their group sums

    def block_bytes(kk: TensorSize) -> sympy.Expr:
        grads = 2 * TensorSize((b, h) + tuple(kk.shape[2:]), kk.itemsize).nbytes if gqa else 2 * kk.nbytes
        return _expanded_kv(q, kk) + grads + q.nbytes + q32 + 2 * rows_f32 + (2 * kk.nbytes if gqa else 0)

    block_first = block_bytes(k)
    block_later = block_bytes(TensorSize((b, k.shape[1], s / 2, d), k.itemsize)) if zigzag_causal else block_first
    dq_acc, dkv_acc = q32, 2 * k32
    # the last hop of an accumulator (home) carries the input dtype: its sum is complete (with
    # the area: its cast copy, alive until the hop is waited for)
    home = one * (2 * k.nbytes if low else dkv_acc)
    cpu = q.device_type == "cpu"
    # One hop of an accumulator: the first carries one block's gradient in the input dtype
    # (ring._carry) unless a key mask cut some rank's own block; from p = 3 on, later hops fp32.
    if kv_mask is None and low:
        hop = one * (2 * k.nbytes + sympy.Min(1, p - 2) * (dkv_acc - 2 * k.nbytes))
    else:
        hop = one * dkv_acc
    # received: the arriving accumulator, the next K/V, the held and next K/V (area: in it)
    pending = 0 if area else (one * dkv_acc if rule else hop)
    next_kv = 0 if area else one * (kv + mask)
    held_next = 0 if area else _kv_in_flight(p) * (kv + mask)
    own = one * kv if chunked else 0
    # The accumulator sent after the step before, during this step's kernels: the copy-engine
    # ring holds its sources and gloo's work its contiguous copy until the batch is waited for,
    # after the kernels (measured on CUDA). NCCL's buffer may be booked free as soon as the ring
    # lets go of it (its stream only keeps it from reuse): a bound there, not measured.
    sent = 0 if rule else hop
    phases = [
        dq_acc + own + next_kv + block_first + (home if chunked else 0),
        dq_acc + pending + held_next + block_later + sent,
        dq_acc + dkv_acc + 2 * k.nbytes + held_next + own,
        dq_acc + dkv_acc + pending + held_next + own,
    ]
    if cpu:
        # CPU (gloo): gloo's worker threads drop the contiguous copy of a sent accumulator (the
        # CPU kernel returns its gradients in its own [b, s, h, d] layout) some time after the
        # batch is waited for, so it may outlive its phase; the kernel also copies dout into
        # that layout. Measured with torch.profiler against the CPU allocator (tests/test_planner.py).
        # (the rule's: the sent accumulator and gloo's copy in every phase, as tuned;
        # the plan's: the copy beside phase 1's `sent`, which it outlives)
        linger = [2 * one * dkv_acc] * 4 if rule else [hop, 0, hop, hop]
        phases = [ph + extra for ph, extra in zip(phases, linger)]
        phases[0] += q.nbytes
        phases[1] += q.nbytes
    if not chunked:
        # the end, outputs cast from the accumulators: dQ's while the last hop arrives
        # (p > 1), or next to the dK/dV accumulators and their casts (p = 1)
        # (fp32: the casts are the accumulators themselves, nothing new)
        cast = 1 if low else 0
        phases.append(dq_acc + cast * q.nbytes + home + held_next + (1 - one) * (dkv_acc + cast * 2 * k.nbytes))
    backward = _max(*phases)
    if not chunked:
        backward = backward - (q.nbytes + 2 * k.nbytes)
    return forward, backward, kv + mask, kv + mask + dkv_acc


AREA_HEADER, AREA_ALIGN = 4096, 256  # runtime/comm.py, _Mailbox


def receive_area(batch, tensors: int, p) -> sympy.Expr:
    """Bytes of the copy-engine receive area (runtime/comm.py) for batches of at most `batch`
    bytes in `tensors` tensors: a header and two slots, each tensor aligned (counted as its
    bytes plus the alignment's most); none at p = 1."""
    return sympy.Min(1, p - 1) * (AREA_HEADER + 2 * (batch + tensors * AREA_ALIGN))


def uses_receive_area(q: TensorSize) -> bool:
    """Whether the ring's received blocks land in the copy-engine receive area: CUDA tensors,
    unless RINGCC_RING_TRANSPORT=nccl (with the default "auto" the runtime falls back to the
    process group, with a warning, only where symmetric memory does not work)."""
    import os

    return q.device_type == "cuda" and os.environ.get("RINGCC_RING_TRANSPORT", "auto").strip().lower() != "nccl"


def _with_heads(t: TensorSize, heads) -> TensorSize:
    return TensorSize((t.shape[0], heads) + tuple(t.shape[2:]), t.itemsize, t.device_type)


def ring_workspace_budget() -> int | None:
    """Bytes the ring may hold besides its inputs and outputs before it runs per head chunk:
    RINGCC_RING_WORKSPACE_MIB when set (0 = never chunk), else None: the default rule,
    `default_ring_budget` of the op's own tensors."""
    import os

    raw = os.environ.get("RINGCC_RING_WORKSPACE_MIB", "auto").strip()
    if raw.lower() in ("", "auto"):
        return None
    try:
        mib = float(raw)
    except ValueError:
        mib = math.nan
    if not math.isfinite(mib):
        raise ValueError(f"RINGCC_RING_WORKSPACE_MIB must be a number of MiB (0 = never chunk heads) or 'auto'; "
                         f"got {raw!r}")
    if mib < 0:
        raise ValueError(f"RINGCC_RING_WORKSPACE_MIB must be >= 0; got {raw!r}")
    return 0 if mib == 0 else max(1, int(mib * 2**20))  # under a byte is still a budget, not 0 (never chunk)


def workspace_budget(q: TensorSize, k: TensorSize, default: Callable | None = None):
    """The head-chunk budget of an op with these q and k: RINGCC_RING_WORKSPACE_MIB as set, else
    `default(q, k)` (`default_ring_budget` unless given: the dilated op passes its own)."""
    budget = ring_workspace_budget()
    return (default or default_ring_budget)(q, k) if budget is None else budget


def smaller_kv_chunks(g: int) -> list[int]:
    """The chunk sizes below all g K/V heads, largest first: the divisors of g under g."""
    return sorted((x for x in range(1, g) if g % x == 0), reverse=True)


RING_BUDGET_FLOOR = 320 * 2**20  # the default budget's constant part (default_ring_budget)


def default_ring_budget(q: TensorSize, k: TensorSize):
    """The default head-chunk budget: RING_BUDGET_FLOOR (320 MiB) plus three quarters of the
    bytes of q, k, v and the output, so the ring's scratch stays a fraction of the attention's
    own tensors at long lengths. On 4 x H200 (MHA h=16, bf16) it picks whole heads at 8K tokens
    per GPU, 4 of 16 heads per chunk at 16K and 2 at 64K. At 8K per GPU whole heads ran the causal layer back to
    back 0.4-6.9% faster than 8-head chunks in the same call (three calls), at 84.8-89.5% of the
    1-GPU kernel's rate, for 0.26 GiB more per rank; at 16K per GPU 8-head chunks were at most
    1.4% faster than 4-head ones, for 0.34 GiB more, so the budget stops short of them
    (benchmarks/RESULTS.md)."""
    return RING_BUDGET_FLOOR + sympy.Rational(3, 4) * (2 * q.nbytes + 2 * k.nbytes)


DILATED_BUDGET_FLOOR = 4 * 2**30


def default_dilated_budget(q: TensorSize, k: TensorSize):
    """The dilated op's default head-chunk budget: the ring's, but at least 4 GiB. A chunk
    repeats every branch, and at short lengths the sub-ring branches are latency-bound (small
    kernels, one hop after another), so chunks there cost time and save little memory. On
    4 x H200 at 256K tokens (p = 4, LongNet, bf16) whole heads instead of the ring budget's 4
    chunks made every cell faster, by 1.03-1.44x (MHA causal fwd+bwd 39.6-43.5 -> 32.3-32.5
    ms), for 1.2 GiB (MHA) and 2.2 GiB (GQA) more per rank. From 1M tokens
    on 4 GPUs the ring's budget is about as large or larger, so the floor changes little there."""
    return sympy.Max(default_ring_budget(q, k), DILATED_BUDGET_FLOOR)


def _chunk_options(q: TensorSize, k: TensorSize, kv_mask, p, zigzag_causal: bool = False, area: bool = False,
                   rule: bool = False):
    """[(K/V heads per chunk, forward, backward, forward batch, backward batch)] from the whole
    heads (0) down to one K/V head per chunk (divisors of the K/V head count). The backward
    includes dout made contiguous (the full tensor, whatever the chunks). The head-chunk rule
    decides on its own numbers (`rule`: without `area`, the same choice on every transport, and
    without the accumulator in flight, _ring_chunk)."""
    h, g = q.shape[1], k.shape[1]
    area = area and not rule
    opts = [(0, *_ring_chunk(q, k, kv_mask, p, False, zigzag_causal, area, rule))]
    if isinstance(g, (int, sympy.Integer)) and isinstance(h, (int, sympy.Integer)):
        g, rep = int(g), int(h) // int(g)
        for hk in smaller_kv_chunks(g):
            opts.append((hk, *_ring_chunk(_with_heads(q, hk * rep), _with_heads(k, hk), kv_mask, p, True,
                                          zigzag_causal, area, rule)))
    return [(hk, f, b + q.nbytes, bf, bb) for hk, f, b, bf, bb in opts]


def _fits(forward, backward, budget):
    """The head-chunk rule's test of one option (symbolic in the planner, a bool at run time)."""
    most = _max(forward, backward)
    return most <= budget if most.is_number else sympy.Le(most, budget, evaluate=False)


def _forward_may_take(hk_f: int, hk_b: int, g: int, itemsize: int) -> bool:
    """Whether the forward may run chunks of hk_f K/V heads when the backward runs chunks of
    hk_b (0 = all g): as many heads or more, and a batch (K and V) no larger than the
    backward's (K, V and the fp32/fp64 dK/dV accumulators); the key mask rides both."""
    hk_f, hk_b = hk_f or g, hk_b or g
    acc = _acc_itemsize(itemsize)
    return hk_f >= hk_b and hk_f * itemsize <= hk_b * (itemsize + acc)


def _forward_options(opts, i: int, g: int, itemsize: int) -> list[int]:
    """Indices into `opts` of the forward's candidates, largest first, when the backward takes
    option i (option i itself among them)."""
    return [j for j, o in enumerate(opts) if _forward_may_take(o[0], opts[i][0], g, itemsize)]


FLEX_TILE_BYTES = 50  # per 128 x 128 tile and batch row: bool states, int32 counts and indices, both orders; the
# skipped tiles of dense parts and their negation (Note [Dense parts] in maskfn.py)


def _flex_calls(a: dict) -> tuple[sympy.Expr, sympy.Expr]:
    """masked_calls on flex_attention (flex.py): per call of R = min(s, CALL_ROWS) rows, its
    BlockMask; in backward two fp32 row values (the lse in base 2, and the kernel's rowsum(dO *
    O)); a block of more rows than CALL_ROWS also holds a call's output rows (forward), and in
    backward the contiguous q, O and dO rows of a chunk, its gradients (dQ rows, dK and dV)
    beside the fp32 dK/dV sums."""
    from .flex import CALL_ROWS, TILE

    q, k = a["q"], a["k"]
    b, h, s, d = q.shape
    rows = sympy.Min(s, CALL_ROWS)
    tiles = FLEX_TILE_BYTES * b * (rows / TILE + 1) * (s / TILE + 1)
    q_rows = q.itemsize * b * h * rows * d  # R rows of q
    vec = 4 * b * h * rows  # one fp32 [b, h, R]
    fwd = tiles
    bwd = tiles + 2 * vec
    chunked = sympy.Gt(s, CALL_ROWS)
    return (sympy.Piecewise((fwd + q_rows + vec, chunked), (fwd, True)),
            sympy.Piecewise((bwd + 4 * q_rows + 2 * k.nbytes + 2 * k.with_itemsize(4).nbytes, chunked), (bwd, True)))


def masked_calls(a: dict) -> tuple[sympy.Expr, sympy.Expr]:
    """(forward, backward) bytes of the ring's masked kernel calls beyond the fused kernels'
    for blocks of s = n_local keys, a bound:
    - CUDA, masked or score-modified bf16/fp16 blocks (a key mask, a window, a mask or a score
      function) on flex_attention (Note [Flex blocks] in flex.py): the block mask's tiles
      (FLEX_TILE_BYTES per 128 x 128 tile and batch row, with the dense tile states it is built
      from); in backward also two fp32 [b, h, s] row values (the lse in base 2, rowsum(dO * O));
    - CUDA math path (Note [Masked rows] in kernels.py: fp32/fp64, or masked blocks under
      RINGCC_MASKED_KERNEL=math): K and V expanded to q's heads
      in the accumulator dtype, in backward also their dK/dV accumulators; per call of R rows
    (MASKED_CALL_BYTES of full-width scores, at least one row) over the keys they may see
      (all s, or R + 2 * window with a window), its scores (in backward also their gradient),
      its bool mask and negation (2b bytes per [rows, keys] element), what building a window's
      mask takes beyond the scores it precedes (int32 differences, twice when symmetric, and
      a comparison: 9 bytes per element with int32 positions), and a few accumulator-dtype
      [b, h, R, d] rows (2 in forward, 4 in backward); on the zigzag layout a call may be over
      s/2 keys with 2R rows; a window's calls never span a jump in the rows' positions
      (kernels._row_chunks);
    - CPU: the additive fp32 mask [b, 1, rows, Lk] and its bool source, where the mask has
      rows (causal or a window).
    Blocks with a score function (Note [Score functions] in maskfn.py) off flex count as masked
    ones on the math path, with one more scores-sized buffer per call (the function's value, or
    its derivative kept for backward).
    Zero for unmasked half-precision blocks."""
    from .kernels import MASKED_CALL_BYTES, masked_kernel

    q, kv_mask, window = a["q"], a.get("key_valid"), a.get("window") or 0
    b, h, s, d = q.shape
    zero = sympy.Integer(0)
    acc = _acc_itemsize(q.itemsize)
    modified = bool(a.get("score_fn"))
    fn = bool(a.get("mask_fn"))  # a mask function: the math path (CUDA) or the CPU kernel's mask, per row chunk
    if q.device_type == "cuda" or modified:
        if kv_mask is None and not window and not fn and q.itemsize == 2 and not modified:  # the fused kernels
            return zero, zero
        if q.device_type == "cuda" and q.itemsize == 2 and masked_kernel() == "flex":
            return _flex_calls(a)
        rows = sympy.Min(s, sympy.Max(1, sympy.Integer(MASKED_CALL_BYTES) / (acc * b * h * s)))  # over s keys
        # zigzag calls may be over s/2 keys (a chunk of the block), with twice the rows
        most = sympy.Min(s, 2 * rows) if a.get("layout") == "zigzag" else rows
        plane = rows * s  # [rows, keys] elements of one call: at most MASKED_CALL_BYTES of scores
        if window:  # a call's rows span as many positions, its keys rows + 2 * window at most
            plane = sympy.Min(plane, most * (most + 2 * window))
        scores = acc * b * h * plane
        row_bytes = acc * b * h * most * d  # one [b, h, rows, d] in the accumulator dtype
        kv32 = q.with_itemsize(acc).nbytes  # K or V expanded to q's heads, in the accumulator dtype
        masks = 2 * b * plane + (b * h * plane if fn else zero)  # a function's mask may vary by head
        build = lambda held: sympy.Max(0, 9 * plane - held) if window else zero  # noqa: E731
        mod = scores if modified else zero
        return (2 * kv32 + scores + mod + masks + build(scores) + 2 * row_bytes,
                4 * kv32 + 2 * scores + mod + masks + build(2 * scores) + 4 * row_bytes)
    if not (window or fn or (kv_mask is not None and a.get("is_causal"))):
        return zero, zero
    mask = sympy.Min(sympy.Integer(MASKED_CALL_BYTES) / h, acc * b * s * s)  # additive, + its bool (1/acc)
    return mask * (1 + sympy.Rational(1, acc)), mask * (1 + sympy.Rational(1, acc))


# The CPU flash kernels' largest row and key tiles (aten's FlashAttentionKernel.cpp: 256 query
# rows once a call has 768, by 512 keys)
CPU_Q_SPLIT, CPU_KV_SPLIT = 256, 512


def cpu_kernel_tiles(q: TensorSize) -> tuple[sympy.Expr, sympy.Expr]:
    """(forward, backward) bytes of the CPU flash kernels' own per-thread tiles: scores (and in
    backward their gradient) of one row tile by one key tile, row statistics and an output tile,
    in the accumulator dtype, for each of this process's intra-op threads (none off CPU). A
    constant in n: outside the head-chunk rule, like masked_calls."""
    if q.device_type != "cpu":
        return sympy.Integer(0), sympy.Integer(0)
    import torch

    per = CPU_Q_SPLIT * (CPU_KV_SPLIT + 2 + sympy.sympify(q.shape[3]))  # the head dim may be a symbol
    scale = torch.get_num_threads() * _acc_itemsize(q.itemsize)
    return sympy.expand(scale * per), sympy.expand(scale * (per + CPU_Q_SPLIT * CPU_KV_SPLIT))


def ring_attention(a: dict, p) -> Workspace:
    """The ring's workspace under its head-chunk rule (`ring_kv_chunk`): the whole heads
    when that fits the budget, else the largest chunk that does, else one K/V head; the
    forward's chunk as large as its own workspace and the backward's batch allow. On the
    copy-engine transport, the receive area its batches need instead of received blocks.
    Masked blocks add `masked_calls`, the CPU kernels `cpu_kernel_tiles` (outside the
    head-chunk rule, which leaves them out), a balance plan `balance_moves`."""
    ws = _ring_workspace(a, p)
    mf, mb = masked_calls(a)
    tf, tb = cpu_kernel_tiles(a["q"])
    bf, bb = balance_moves(a)
    return Workspace(ws.forward + mf + tf + bf, ws.backward + mb + tb + bb, ws.area_forward, ws.area_training)


def balance_moves(a: dict) -> tuple[sympy.Expr, sympy.Expr]:
    """(forward, backward) bytes of the moves to a balance plan's chunks and back (Note [Balanced
    ring] in balance.py), a bound: each moved tensor as its packed rows, the received rows and
    its copy in the plan's order (forward: q, k, v, then out and lse; backward: dout, q, k, v,
    out, lse, then dq, dk, dv). Zero without a plan."""
    if a.get("balance_plan") is None:
        return sympy.Integer(0), sympy.Integer(0)
    q, k, v = a["q"], a["k"], a["v"]
    b, h, s, _ = q.shape
    out = TensorSize((b, h, s, v.shape[3]), q.itemsize, q.device_type)
    lse = TensorSize((b, h, s), _acc_itemsize(q.itemsize), q.device_type)
    qkv = q.nbytes + k.nbytes + v.nbytes
    return 3 * (qkv + out.nbytes + lse.nbytes), 3 * (qkv + 2 * out.nbytes + lse.nbytes) + qkv


def _ring_workspace(a: dict, p) -> Workspace:
    q, k, kv_mask = a["q"], a["k"], a.get("key_valid")
    zz = a.get("layout") == "zigzag" and bool(a.get("is_causal"))
    # at p = 1 the one block may take several calls: cut by key runs, split by a mask function or
    # by a balance plan's chunks (ring._kv_chunk)
    several = kv_mask is not None or bool(a.get("mask_fn")) or a.get("balance_plan") is not None
    return _ring_workspace_of(q, k, kv_mask, zz, p, chunk_rule_settings(), uses_receive_area(q), several)


def _one_call(q: TensorSize, k: TensorSize) -> tuple[sympy.Expr, sympy.Expr]:
    """(forward, backward) of the ring at p = 1 over whole heads when its one block takes one
    kernel call over all its rows and keys (ring._kv_chunk): the call's results are the outputs,
    with no accumulator, merge or cast (Note [Fewer passes]). Left: the kernel's own (K/V expanded
    to q's heads for GQA, its fp32 dQ accumulator and two row sums, q-headed dK/dV before their
    group sums) and dout made contiguous (on CPU also its copy in the kernel's layout)."""
    b, h, s, _ = q.shape
    acc = _acc_itemsize(q.itemsize)
    rows = sympy.Integer(acc) * b * h * s
    gqa = k.shape[1] != h and not _native_gqa(q)
    grads = 2 * _with_heads(k, h).nbytes if gqa else sympy.Integer(0)
    dout = q.nbytes * (2 if q.device_type == "cpu" else 1)
    kv = _expanded_kv(q, k)
    return kv, kv + grads + q.with_itemsize(acc).nbytes + 2 * rows + dout


# A model's layers repeat a few attention shapes, and each formula is sympy work of a large
# part of a second: one per shape and the settings the rule reads.
@functools.lru_cache(maxsize=256)
def _ring_workspace_of(q: TensorSize, k: TensorSize, kv_mask, zz: bool, p, settings: tuple, area: bool,
                       several: bool) -> Workspace:
    """The ring's workspace: at p = 1 that of one call (`_one_call`), or where the block may take
    several calls (`several`) the larger of that and the rule's choice; else the rule's."""
    ws = _ring_rule_workspace(q, k, kv_mask, zz, p, area)
    one_f, one_b = _one_call(q, k)
    if several:
        one_f, one_b = _max(one_f, ws.forward), _max(one_b, ws.backward)
    alone = sympy.Eq(p, 1)
    return Workspace(sympy.Piecewise((one_f, alone), (ws.forward, True)),
                     sympy.Piecewise((one_b, alone), (ws.backward, True)), ws.area_forward, ws.area_training)


def _ring_rule_workspace(q: TensorSize, k: TensorSize, kv_mask, zz: bool, p, area: bool) -> Workspace:
    budget = workspace_budget(q, k)
    opts = _chunk_options(q, k, kv_mask, p, zz, rule=True)  # what the rule decides on
    mem = _chunk_options(q, k, kv_mask, p, zz, area=area)  # what is allocated
    n_t = 2 + (kv_mask is not None)  # tensors per forward batch (K, V, mask); the backward adds dK, dV

    def area_forward(batch_f, batch_b):
        return receive_area(batch_f, n_t, p)

    def area_training(batch_f, batch_b):  # sized by the larger batch (the backward's, by the rule)
        return receive_area(sympy.Max(batch_f, batch_b), n_t + 2, p)

    if budget == 0 or len(opts) == 1:
        _, fwd, bwd, batch_f, batch_b = mem[0]
        if not area:
            return Workspace(fwd, bwd)
        return Workspace(fwd, bwd, area_forward(batch_f, batch_b), area_training(batch_f, batch_b))
    conds = [_fits(o[1], o[2], budget) for o in opts[:-1]] + [True]
    g = int(k.shape[1])

    def by_choice(pick) -> sympy.Expr:
        """Piecewise over the backward's choice i, and inside it the forward's (decided on the
        rule's numbers), of pick(option j of the forward, option i of the backward)."""
        pieces = []
        for i, cond in enumerate(conds):
            # the largest candidate whose forward fits, else the backward's own choice (which
            # fits wherever the budget chose it, and is the answer for the one-head fallback)
            larger = [j for j in _forward_options(opts, i, g, k.itemsize) if opts[j][0] != opts[i][0]]
            inner = [(pick(mem[j], mem[i]), opts[j][1] <= budget) for j in larger]
            pieces.append((sympy.Piecewise(*inner, (pick(mem[i], mem[i]), True)) if inner else pick(mem[i], mem[i]), cond))
        return sympy.Piecewise(*pieces)

    forward = by_choice(lambda f, b: f[1])
    backward = sympy.Piecewise(*[(o[2], c) for o, c in zip(mem, conds)])
    if not area:
        return Workspace(forward, backward)
    return Workspace(forward, backward, by_choice(lambda f, b: area_forward(f[3], b[4])),
                     by_choice(lambda f, b: area_training(f[3], b[4])))


def chunk_rule_settings() -> tuple:
    """The settings the head-chunk rule reads (the workspace budget as set, its floor, the CUDA
    kernel, the native-GQA switch), so that a cache of its answers never answers for other
    settings."""
    import os

    from . import kernels

    return (os.environ.get("RINGCC_RING_WORKSPACE_MIB"), RING_BUDGET_FLOOR, kernels._cuda_kernel(),
            kernels.native_gqa_setting())


def ring_kv_chunk(q, k, key_valid, world: int, zigzag_causal: bool = False, forward: bool = False) -> int:
    """K/V heads per chunk for these concrete tensors (0: all heads at once) in the backward,
    or with `forward` in the forward, by the same rule as `ring_attention`: evaluated once
    per shape."""
    budget = ring_workspace_budget()  # None: the default rule, evaluated in the cached function
    if budget == 0 or k.shape[1] == 1:
        return 0
    mask = None if key_valid is None else (tuple(key_valid.shape), key_valid.element_size())
    fwd, bwd = _ring_kv_chunks(tuple(q.shape), tuple(k.shape), q.element_size(), k.element_size(), mask,
                               q.device.type, world, budget, bool(zigzag_causal), chunk_rule_settings())
    return fwd if forward else bwd


@functools.lru_cache(maxsize=256)
def _ring_kv_chunks(q_shape, k_shape, q_item, k_item, mask, device_type, world, budget, zigzag_causal,
                    settings) -> tuple[int, int]:
    """(forward, backward) K/V heads per chunk (`settings`: chunk_rule_settings(), the cache's key)."""
    qs, ks = TensorSize(q_shape, q_item, device_type), TensorSize(k_shape, k_item, device_type)
    if budget is None:
        budget = int(default_ring_budget(qs, ks))
    ms = None if mask is None else TensorSize(mask[0], mask[1], device_type)
    opts = _chunk_options(qs, ks, ms, sympy.Integer(world), zigzag_causal, rule=True)
    i = next((j for j, o in enumerate(opts) if _fits(o[1], o[2], budget)), len(opts) - 1)
    fwd = next((opts[j][0] for j in _forward_options(opts, i, k_shape[1], k_item) if opts[j][1] <= budget), opts[i][0])
    return fwd, opts[i][0]


def _dilated_spec(a: dict):
    return DilatedSpec(a["segment_lengths"], a["dilation_rates"], offsets=a["offsets"])


def _dilated_branches(a: dict, p, kv_range: tuple[int, int] | None = None):
    """Per branch taking part (in the head chunk of K/V heads kv_range, else in all heads):
    (w, r, rows sent per slot, K/V slots, query heads)."""
    q, k = a["q"], a["k"]
    h, g = int(q.shape[1]), int(k.shape[1])
    spec = _dilated_spec(a)
    comm_rows = dilated_comm_rows(spec, q.shape[2] * p, p, a.get("layout", "contiguous"))
    slots = dilated_kv_slots(spec, h, g, kv_range)
    heads = [len(pairs) for pairs in chunk_pairs(spec, h, g, kv_range)]
    return [(w, r, rows, ns, hq) for (w, r), rows, ns, hq in zip(spec.branches, comm_rows, slots, heads) if hq]


def dilated_receive_bytes(a: dict, p, kv_range: tuple[int, int] | None = None) -> tuple:
    """Per branch: K/V bytes received at once by a rank, at most two compressed blocks of
    n/p / r rows and never more than the rows the branch sends (`dilated_comm_rows`, O(w/r)):
    zero when the segment fits the shard."""
    q, k = a["q"], a["k"]
    b, s, d = q.shape[0], q.shape[2], q.shape[3]
    return tuple(sympy.Min(2 * s / r, rows) * 2 * b * ns * d * k.itemsize
                 for w, r, rows, ns, hq in _dilated_branches(a, p, kv_range))


def _dilated_chunk(a: dict, p, kv_range: tuple[int, int] | None) -> tuple[sympy.Expr, sympy.Expr]:
    """(forward, backward) workspace of one head chunk (kv_range None: all heads at once)."""
    q, k = a["q"], a["k"]
    b, h, s, d = q.shape
    g = int(k.shape[1])
    kv = g if kv_range is None else kv_range[1] - kv_range[0]
    hc = int(h) // g * kv
    acc_item = _acc_itemsize(q.itemsize)
    branches = _dilated_branches(a, p, kv_range)
    fwd_branches, bwd_branches = [], []
    for (w, r, rows, ns, hq), recv in zip(branches, dilated_receive_bytes(a, p, kv_range)):
        q_c = b * hq * d * (s / r) * q.itemsize  # compressed q (and out, dout) rows
        kv_c = 2 * b * ns * d * (s / r) * k.itemsize  # compressed K and V
        acc = b * hq * (s / r) * (d + 1) * acc_item  # the branch's fp32 (fp64) out/lse rows being merged
        # A branch that takes every row of every head (r = 1) reads its inputs as they are
        # (a head chunk of them is a view without a copy only at b = 1).
        copies = 0 if (r == 1 and hq == hc and ns == kv and (kv_range is None or b == 1)) else 1
        fwd_branches.append(q_c * (1 + copies) + kv_c * copies + 2 * acc + recv)
        # Backward: compressed dout/out/lse and q, block grads, fp32 (fp64) dK/dV hops in flight.
        dkv_hops = recv * acc_item / k.itemsize
        bwd_branches.append(q_c * (1 + 3 * copies) + kv_c * (1 + copies) + recv + dkv_hops + acc)
    # Branches run one after another: the largest counts.
    fwd = sympy.Max(*fwd_branches) if fwd_branches else sympy.Integer(0)
    bwd = sympy.Max(*bwd_branches) if bwd_branches else sympy.Integer(0)
    qc, kc = _with_heads(q, hc).with_itemsize(acc_item), _with_heads(k, kv).with_itemsize(acc_item)
    # All heads: the output is cast from the accumulator (none extra for fp32); in chunks each
    # chunk's accumulator is copied into the output.
    acc_out = _acc_extra(q) if kv_range is None else qc.nbytes
    return acc_out + fwd, qc.nbytes + 2 * kc.nbytes + bwd


def _dilated_options(a: dict, p) -> list[tuple[int, sympy.Expr, sympy.Expr]]:
    """[(K/V heads per chunk, forward, backward)] from all heads (0) down to one K/V head per
    chunk; a chunked option's workspace is its largest chunk's."""
    g = int(a["k"].shape[1])
    opts = [(0, *_dilated_chunk(a, p, None))]
    for hk in smaller_kv_chunks(g):
        per = [_dilated_chunk(a, p, (c, c + hk)) for c in range(0, g, hk)]
        opts.append((hk, sympy.Max(*(f for f, _ in per)), sympy.Max(*(b for _, b in per))))
    return opts


def dilated_attention(a: dict, p) -> Workspace:
    """The dilated op's workspace under its head-chunk rule (`dilated_kv_chunk`): forward and
    backward each take the largest head chunk whose own workspace fits the budget (by default
    `default_dilated_budget`), else one K/V head per chunk (Note [Dilated head chunks] in
    dilated.py)."""
    budget = workspace_budget(a["q"], a["k"], default_dilated_budget)
    opts = _dilated_options(a, p)
    tf, tb = cpu_kernel_tiles(a["q"])

    def rule(i):  # the first option (the largest chunk) whose workspace fits
        if budget == 0 or len(opts) == 1:
            return opts[0][i]
        return sympy.Piecewise(*[(o[i], o[i] <= budget) for o in opts[:-1]], (opts[-1][i], True))

    return Workspace(rule(1) + tf, rule(2) + tb)


def dilated_kv_chunk(q, k, spec, world: int, layout: str) -> tuple[int, int]:
    """(forward, backward) K/V heads per chunk of the dilated op for these concrete tensors (0:
    all heads at once), by the rule of `dilated_attention`: evaluated once per shape."""
    budget = ring_workspace_budget()
    if budget == 0 or k.shape[1] == 1:
        return 0, 0
    return _dilated_kv_chunks(tuple(q.shape), tuple(k.shape), q.element_size(), k.element_size(), q.device.type,
                              spec, world, layout, budget, chunk_rule_settings())


@functools.lru_cache(maxsize=256)
def _dilated_kv_chunks(q_shape, k_shape, q_item, k_item, device_type, spec, world, layout, budget,
                       settings) -> tuple[int, int]:
    a = {"q": TensorSize(q_shape, q_item, device_type), "k": TensorSize(k_shape, k_item, device_type),
         "segment_lengths": spec.segment_lengths, "dilation_rates": spec.dilation_rates,
         "offsets": spec.offsets, "layout": layout}
    if budget is None:
        budget = int(default_dilated_budget(a["q"], a["k"]))
    opts = _dilated_options(a, sympy.Integer(world))
    fwd = next((o[0] for o in opts if o[1] <= budget), opts[-1][0])
    bwd = next((o[0] for o in opts if o[2] <= budget), opts[-1][0])
    return fwd, bwd


def dense_attention(a: dict, p) -> Workspace:
    """Un-rewritten attention: the math path's fp32 scores (and their gradient)."""
    q, k = a["query"], a["key"]
    lq, lk = q.shape[-2], k.shape[-2]
    heads = q.shape[-3] if len(q.shape) >= 3 else sympy.Integer(1)
    batch = sympy.Mul(*q.shape[:-3]) if len(q.shape) > 3 else sympy.Integer(1)
    scores = batch * heads * lq * lk * FP32
    return Workspace(scores, 2 * scores)


def multi_head_attention(a: dict, p) -> Workspace:
    """nn.MultiheadAttention's functional form: [L, b, E] inputs (batch_first is undone)."""
    q, k, heads = a["query"], a["key"], a["num_heads"]
    lq, lk = q.shape[0], k.shape[0]
    batch = q.shape[1] if len(q.shape) == 3 else sympy.Integer(1)
    scores = batch * heads * lq * lk * FP32
    return Workspace(scores, 2 * scores)


def pow_(a: dict, p) -> Workspace:
    """x ** e (a number e): its backward forms x ** (e - 1) and e * that before the product
    with the incoming gradient, two temporaries of x's size at once."""
    args = list(a.values())
    x, e = (args + [None, None])[:2]
    if not isinstance(x, TensorSize) or isinstance(e, TensorSize):
        return Workspace()
    return Workspace(sympy.Integer(0), 2 * x.nbytes)


def sync_grads(a: dict, p) -> Workspace:
    """A bucket's gradient sync (runtime/seqops.py): beside the bucket's incoming cotangents
    (values of the backward, which the plan already holds), its backward holds their flat
    concatenation that is all-reduced and the per-value copies out of it, at once: twice the
    bucket. Counting the cotangents here too put a 16 x 512 causal step on gloo 12 MiB (one
    bucket) over its profiled peak."""
    xs = a.get("xs", next(iter(a.values()), None))
    xs = [xs] if isinstance(xs, TensorSize) else list(xs or ())
    if not all(isinstance(x, TensorSize) for x in xs):
        return Workspace()
    return Workspace(sympy.Integer(0), 2 * sum((x.nbytes for x in xs), sympy.Integer(0)))


def fill_empty_rows(a: dict, p) -> Workspace:
    """ringcc::fill_empty_rows (Note [Rows with no key] in ops.py), a bound: forward, V in the
    accumulator dtype (and its copy weighed by the keys of the sequence); backward, q and dO of
    the empty rows and dQ in the accumulator dtype (with the casts they are made from: four
    q-sized), and K, V, the weighed K, V - mean(V) and dK in the accumulator dtype (five
    k-sized); the sums themselves are O(b h d^2)."""
    q, k = a.get("q"), a.get("k")
    if not isinstance(q, TensorSize) or not isinstance(k, TensorSize):
        return Workspace()
    acc = _acc_itemsize(q.itemsize)
    q32, k32 = q.with_itemsize(acc).nbytes, k.with_itemsize(acc).nbytes
    return Workspace(2 * k32, 4 * q32 + 5 * k32)


def scale_grads(a: dict, p) -> Workspace:
    """A bucket's gradient scaling (runtime/seqops.py): its backward makes the scaled copies of
    the bucket's cotangents at once: one bucket."""
    xs = a.get("xs", next(iter(a.values()), None))
    xs = [xs] if isinstance(xs, TensorSize) else list(xs or ())
    if not all(isinstance(x, TensorSize) for x in xs):
        return Workspace()
    return Workspace(sympy.Integer(0), sum((x.nbytes for x in xs), sympy.Integer(0)))


# Op name (as the planner normalises it) -> formula.
FORMULAS: dict[str, Callable[[dict, sympy.Expr], Workspace]] = {
    "ringcc::ring_attention": ring_attention,
    "ringcc::dilated_attention": dilated_attention,
    "scaled_dot_product_attention": dense_attention,
    "multi_head_attention_forward": multi_head_attention,
    "pow": pow_,
    "ringcc::fill_empty_rows": fill_empty_rows,
    "ringcc::sync_grads": sync_grads,
    "sync_grads_view": sync_grads,
    "scale_grads_view": scale_grads,
}
