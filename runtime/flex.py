"""Masked blocks on CUDA through flex_attention (Note [Flex blocks]).

Legend as in kernels.py: q_bhsd [b, h, Lq, d]; k_bgsd / v_bgsd [b, g, Lk, d]; key_valid_bs
[b, Lk] bool (True = key may be attended); window: a ring.WindowMask (global positions of the
block's rows and keys) or None. lse natural-log fp32 [b, h, Lq]; rows with no visible key give
out = 0, lse = -inf.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable

import torch
from torch.nn.attention.flex_attention import BlockMask

from ringcc import _compat

from . import maskfn
from .dtypes import acc_dtype

# Note [Flex blocks]
# The fused cuDNN/flash kernels take no masks, so a masked bf16/fp16 block (key padding, a
# sliding window, a mask function) on CUDA runs flex_attention compiled by inductor, and so
# does a block with a score function (soft-capping, ALiBi, any other: Note [Score functions]
# in maskfn.py), the function at the block's global positions as flex's score_mod. A window
# or key padding mask is "key j visible to row i iff lo <= pos_q[i] - pos_k[j] < hi, and key j
# is valid in its batch row", where pos are the block's positions (global ones for windows; 0..
# for the causal diagonal, which is top-left aligned) and (lo, hi) come from the call's causal
# flag and the window; a mask function is itself at the block's global positions. The
# BlockMask is built from 128 x 128 tile bounds (of the positions and the key mask, or of the
# function: Note [Tile bounds] in maskfn.py): O(tiles), never the [Lq, Lk] mask (torch's
# create_block_mask evaluates it whole). Full tiles skip the mask_mod; empty tiles are skipped.
#
# Backward: flex_attention's public backward recomputes P from its own forward's (out, lse),
# while a ring block needs the gradient under the row's global (O, L) (kernels.block_bwd). Its
# backward kernel (the flex_attention_backward higher-order op) takes (out, lse) as inputs, and
# fed the global ones it computes exactly that: P = exp(S - L), D = rowsum(dO * O), dS = P (dP -
# D), the block's share of the global gradient, in one kernel. Dynamo does not trace that op
# from user code, so each direction's higher-order op is traced once per block shape with make_fx
# (the score and mask functions as flex's subgraphs, their tensors as explicit inputs: `Fn`) and
# compiled by inductor (`_program`); on CPU the traced graph runs the op's dense implementation.
# The forward takes the same route rather than torch.compile(flex_attention): a call then runs
# the compiled kernels with no guard evaluation or autograd wrapper in front of them, which is
# host time the GPU waits for before a step's first kernel.
#
# A BlockMask holds O(query tiles x key tiles) indices, quadratic in the shard, so a block of
# more than CALL_ROWS query rows runs one flex call per chunk of CALL_ROWS rows (backward: dK/dV
# summed over the chunks in fp32): O(CALL_ROWS / TILE x Lk / TILE) per call, linear in the shard.
# The planner counts these bytes (workspace.masked_calls). Chunks cost time: each copies its
# rows of q, O and dO and adds its dK/dV into fp32 sums (on one H200, 64 causal documents in
# 128K tokens ran fwd+bwd in 14.3 ms as one call and 22.9 ms as two), while a call's BlockMask
# is small beside the block (at 256K rows by 256K keys about 200 MB, against 1 GB for q at
# h = 16, d = 128), so a call takes up to 256K rows.

TILE = maskfn.FLEX_TILE  # flex_attention's default sparse block size
CALL_ROWS = 262144  # query rows per flex call (a multiple of TILE)
_FAR = 2**30  # a position difference bound no block reaches (int32-safe)


@functools.lru_cache(maxsize=16)  # a few block lengths; varying sequence lengths do not pile up
def _arange(n: int, device) -> torch.Tensor:
    return torch.arange(n, dtype=torch.int32, device=device)


def _bounds(causal: bool, window) -> tuple[int, int]:
    """(lo, hi): key j is visible to row i iff lo <= pos_q[i] - pos_k[j] < hi."""
    lo, hi = -_FAR, _FAR
    if causal:  # the top-left diagonal: pos_q == pos_k for its rows and keys (same chunk)
        lo = 0
    if window is not None:
        hi = window.window  # causal: i - j < w
        if not window.causal:  # |i - j| < w
            lo = max(lo, 1 - window.window)
    return lo, hi


def _ordered(tiles_bhqk: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """BlockMask's (count, indices) of the set tiles of each row of tiles, set ones first."""
    t = tiles_bhqk.to(torch.int32)
    # contiguous: the kernels index them as such, and a transposed input's argsort keeps its strides
    return (t.sum(-1, dtype=torch.int32).contiguous(),
            torch.argsort(t, dim=-1, descending=True, stable=True).to(torch.int32, memory_format=torch.contiguous_format))


@functools.cache
def _bound(lo: int, hi: int, dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(lo, hi) as 0-d tensors: a function's tensors are read whole, never indexed by a number
    (make_fx would bake the index in as a constant the kernel's subgraph cannot take)."""
    return tuple(torch.tensor(x, dtype=dtype, device=device) for x in (lo, hi))


def _positions(lq: int, lk: int, window, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The block's (row, key) positions: a window's global ones, else 0.. (top-left aligned)."""
    if window is not None:
        return window.q_pos, window.k_pos
    return _arange(lq, device), _arange(lk, device)


def _position_tiles(lq: int, lk: int, causal: bool, window, device, rows):
    """(some, full) bool [1, 1, row tiles, key tiles] from the positions alone, with the
    mask function's tensors (pos_q of the rows, pos_k, lo, hi); see tile_states."""
    r0, r1 = rows
    pos_q, pos_k = _positions(lq, lk, window, device)
    pos_q = pos_q[r0:r1]
    qt, kt = -(-(r1 - r0) // TILE), -(-lk // TILE)
    lo, hi = _bounds(causal, window)
    qmin, qmax = maskfn.tile_minmax(pos_q.long(), qt, TILE)
    kmin, kmax = maskfn.tile_minmax(pos_k.long(), kt, TILE)
    dmin, dmax = qmin[:, None] - kmax[None, :], qmax[:, None] - kmin[None, :]
    some = ((dmax >= lo) & (dmin < hi))[None, None]
    full = ((dmin >= lo) & (dmax < hi))[None, None]
    return some, full, (pos_q, pos_k, *_bound(lo, hi, pos_q.dtype, torch.device(device)))


@functools.lru_cache(maxsize=64)
def _arange_tiles(lq: int, lk: int, causal: bool, device, rows):
    return _position_tiles(lq, lk, causal, None, device, rows)


# A cached BlockMask holds 4 int32 tiles-sized index arrays per direction; beyond this many
# tiles (a 16K-row call over 64K keys) the kernels' time dwarfs the host's build, and the
# cache (outside the planner's count) would grow with the shard. The score functions' masks
# of positions alone (_arange_mask) are kept up to CACHED_TILES in a process-wide cache of 64.
# A window's are kept on the window (_per_window), one set per ring step, up to
# WINDOW_CACHED_TILES (about 12 MB per window): a window's kernels are short (its band), and
# a rebuild per call is host work and a few sorts ahead of each step's kernels.
CACHED_TILES = 1 << 16
WINDOW_CACHED_TILES = 1 << 18  # a 64K-row call over 64K keys


def _tiles(rows, lk: int) -> int:
    return -(-(rows[1] - rows[0]) // TILE) * -(-lk // TILE)


def _per_window(window, key, rows, lk: int, build):
    """build(), kept on the window for the next call when the call has at most
    WINDOW_CACHED_TILES tiles. What depends on a window's positions alone is the same at every
    step, head chunk and iteration, and the window masks of a ring's calls live as long as its setup
    (ring.RingSetup._window_calls), so their tiles (and, with no key mask, whole BlockMasks)
    are built once instead of per kernel call (host time: a windowed ring is host-bound).
    Calls cut to a run of valid keys get fresh slices of those masks (ring.WindowMask.sub) and
    build theirs per call."""
    if _tiles(rows, lk) > WINDOW_CACHED_TILES:
        return build()
    cache = window.__dict__.setdefault("_flex_cache", {})  # a frozen dataclass: its __dict__ is writable
    if key not in cache:
        cache[key] = build()
    return cache[key]


def tile_states(lq: int, lk: int, causal: bool, key_valid_bs, window, device, rows=None):
    """(some, full) bool [b or 1, 1, row tiles, key tiles] of block rows `rows` ((r0, r1);
    None: all): tiles with some / every (row, key) pair visible (conservative: a tile is full
    only when every pair is visible, empty only when none is). Also the mask function's
    tensors: (pos_q of those rows, pos_k, lo, hi)."""
    rows = rows or (0, lq)
    if window is None:
        some, full, mod_inputs = _arange_tiles(lq, lk, causal, torch.device(device), rows)
    else:
        some, full, mod_inputs = _per_window(window, ("tiles", causal, rows), rows, lk,
                                             lambda: _position_tiles(lq, lk, causal, window, device, rows))
    if key_valid_bs is not None:
        some, full = _with_key_tiles(some, full, key_valid_bs, lk)
    return some, full, mod_inputs


def _with_key_tiles(some, full, key_valid_bs, lk: int):
    """(some, full) tile states narrowed by a key mask [b, Lk]."""
    kt = -(-lk // TILE)
    pad = kt * TILE - lk
    kv = key_valid_bs
    any_ = torch.nn.functional.pad(kv, (0, pad), value=False).view(kv.shape[0], kt, TILE).any(-1)
    all_ = torch.nn.functional.pad(kv, (0, pad), value=True).view(kv.shape[0], kt, TILE).all(-1)
    return some & any_[:, None, None, :], full & all_[:, None, None, :]


@dataclass(frozen=True)
class Fn:
    """A flex function (mask_mod or score_mod) whose tensors are explicit arguments:
    fn(*indices, *tensors), indices (b, h, i, j) for a mask and (score, b, h, i, j) for a score.
    The programs' traced ops take fn as its subgraph and the tensors as its other buffers;
    the BlockMask keeps a closure (`bound`) as its mask_mod."""

    fn: Callable
    tensors: tuple = ()
    score: bool = False  # a score function (5 indices), else a mask (4)

    def bound(self):
        """The function of its indices alone (flex_attention reads its parameter count)."""
        fn, t = self.fn, self.tensors
        if self.score:
            return lambda score, b, h, i, j: fn(score, b, h, i, j, *t)
        return lambda b, h, i, j: fn(b, h, i, j, *t)


def _visible(b, h, i, j, pos_q, pos_k, lo, hi):
    d = pos_q[i] - pos_k[j]
    return (d >= lo) & (d < hi)


def _visible_key(b, h, i, j, pos_q, pos_k, lo, hi, key_valid):
    return _visible(b, h, i, j, pos_q, pos_k, lo, hi) & key_valid[b, j]


def _mask_fn(key_valid_bs, mod_tensors) -> Fn:
    if key_valid_bs is None:
        return Fn(_visible, tuple(mod_tensors))
    return Fn(_visible_key, (*mod_tensors, key_valid_bs))


def block_mask(lq: int, lk: int, causal: bool, key_valid_bs, window, device, rows=None,
               backward: bool = True) -> "Masked":
    """The BlockMask (and mask function) of a masked block call over rows `rows` ((r0, r1); None: all) (Note [Flex
    blocks]); the forward kernel reads the tiles of each query tile only, the backward also
    those of each key tile. Both orders come from the tile states directly
    (BlockMask.from_kv_blocks would rebuild the dense tiles). A window's mask without a key
    mask is built once per window (_per_window)."""
    rows = rows or (0, lq)
    if isinstance(window, maskfn.FnMask):
        return maskfn.memo(window, ("flex", rows, backward), lambda: _fn_block_mask(window, key_valid_bs, rows, backward),
                           (key_valid_bs,))
    build = lambda: _build_block_mask(lq, lk, causal, key_valid_bs, window, device, rows, backward)  # noqa: E731
    if key_valid_bs is None and window is not None:
        return _per_window(window, ("mask", causal, rows, backward), rows, lk, build)
    if key_valid_bs is None and _tiles(rows, lk) <= CACHED_TILES:  # the positions' mask alone (a score modifier's)
        return _arange_mask(lq, lk, causal, torch.device(device), rows, backward)
    return build()


@functools.lru_cache(maxsize=64)
def _arange_mask(lq: int, lk: int, causal: bool, device, rows, backward: bool) -> "Masked":
    return _build_block_mask(lq, lk, causal, None, None, device, rows, backward)


@dataclass(frozen=True)
class Masked:
    """A call's BlockMask and its mask function (`Fn`: the BlockMask's mask_mod is its closure)."""

    block: BlockMask
    fn: Fn

    @functools.cached_property
    def inputs(self) -> tuple[tuple, tuple, tuple, tuple]:
        """What a program's traced op takes of this mask (`_call`, `_bwd_call`), made once per mask:
        (the BlockMask's layout with None for its tensors, their slots in it, the mask function's
        tensors then the BlockMask's, their specs)."""
        layout = self.block.as_tuple()
        slots = tuple(i for i, x in enumerate(layout) if isinstance(x, torch.Tensor))
        template = tuple(None if i in slots else x for i, x in enumerate(layout[:-1]))
        tensors = (*self.fn.tensors, *(layout[i] for i in slots))
        return template, slots, tensors, _specs(tensors)


def _specs(tensors) -> tuple:
    """What a compiled program is specialised on, per tensor."""
    return tuple((a.shape, a.stride(), a.dtype, a.device) for a in tensors)


@functools.lru_cache(maxsize=4096)
def _start(x: int, dtype, device, role: str) -> torch.Tensor:
    """A call's first row, key, batch row or head as a 0-d tensor, made once per value and role:
    two roles are never one tensor (flex takes a function's tensors as separate buffers, and one
    passed twice computes wrong results)."""
    return torch.tensor(x, dtype=dtype, device=device)


def _offset_args(q_pos, k_pos, starts, b0: int, h0: int) -> tuple[tuple, tuple]:
    """(tensors, kinds): how a function gets a call's global row and key positions, batch rows
    and heads from flex's indices, in that order. A kind is "pos" (a positions tensor: pos[i]),
    "add" (a 0-d start: start + i), or a dtype (the index itself, cast: a start of 0, the first
    batch row or head). Zero offsets pass no tensor: the kernel then loads nothing for them in
    its inner loop. Positions from their starts: Note [Consecutive positions] in maskfn.py."""
    args, kinds = [], []
    for pos, at, role in zip((q_pos, k_pos), starts, ("q", "kv")):
        if at is None:
            args.append(pos)
            kinds.append("pos")
        elif at:
            args.append(_start(at, pos.dtype, pos.device, role))
            kinds.append("add")
        else:
            kinds.append(pos.dtype)
    for x, role in ((b0, "b"), (h0, "h")):
        if x:
            args.append(_start(x, torch.int32, q_pos.device, role))
            kinds.append("add")
        else:
            kinds.append(torch.int32)
    return tuple(args), tuple(kinds)


def _globals(kinds: tuple, b, h, i, j, tensors: tuple) -> tuple[tuple, tuple]:
    """((b, h, row, key) of the site, the tensors after the offsets'), `_offset_args`' kinds."""
    out, used = {}, 0
    for name, x, kind in zip("ijbh", (i, j, b, h), kinds):
        if isinstance(kind, torch.dtype):
            out[name] = x.to(kind)
        else:
            t = tensors[used]
            used += 1
            out[name] = t[x] if kind == "pos" else x.to(t.dtype) + t
    return (out["b"], out["h"], out["i"], out["j"]), tensors[used:]


@functools.lru_cache(maxsize=256)  # per mask function: the forward's and the backward's programs key on it
def _fn_visible(fn: maskfn.MaskFn, causal: bool, keyed: bool, skipped: bool, kinds: tuple):
    """The mask function of a call under a mask function (Note [Mask functions]): the function at
    the call's global positions, batch rows and heads (`_offset_args`' kinds); its diagonal, if
    causal; not in the skipped tiles, if any (the tensor after the function's: Note [Dense
    parts]); the key mask, if any (the last tensor)."""
    extra = int(keyed) + int(skipped)

    def visible(b, h, i, j, *tensors):
        (gb, gh, qi, kj), tensors = _globals(kinds, b, h, i, j, tensors)
        own = tensors[:len(tensors) - extra]
        m = fn(gb, gh, qi, kj, own)
        if not isinstance(m, torch.Tensor):
            m = (qi == qi) if m else (qi != qi)
        if causal:
            m = m & (kj <= qi)
        if skipped:
            m = m & ~tensors[len(own)][i // TILE, j // TILE]
        return m & tensors[-1][b, j] if keyed else m

    return visible


def _fn_block_mask(mask: maskfn.FnMask, key_valid_bs, rows, backward: bool) -> Masked:
    """The BlockMask of a call under a mask function, rows `rows`, its tiles from the function's
    bounds (Note [Tile bounds] in maskfn.py)."""
    r0, r1 = rows
    lk = mask.k_pos.shape[0]
    sub = mask.sub(r0, r1, 0, lk)
    some, full = maskfn.tile_states(sub, TILE)
    # tiles the fused kernels compute (Note [Dense parts] in maskfn.py): left out of the BlockMask,
    # and out of the function too, so that a dense evaluation of it (flex's CPU implementation)
    # computes what the kernel does
    skip = maskfn.skipped_tiles(sub)
    if skip is not None:
        some, full = some & ~skip, full & ~skip
    if key_valid_bs is not None:
        some, full = _with_key_tiles(some, full, key_valid_bs, lk)
    offsets, kinds = _offset_args(sub.q_pos, sub.k_pos, sub.starts, mask.b0, mask.h0)
    fn = Fn(_fn_visible(mask.fn, mask.causal, key_valid_bs is not None, skip is not None, kinds),
            (*offsets, *mask.tensors, *(() if skip is None else (skip,)),
             *(() if key_valid_bs is None else (key_valid_bs,))))
    return _masked(some, full, fn, r1 - r0, lk, backward)


def _masked(some, full, fn: "Fn", lq: int, lk: int, backward: bool) -> Masked:
    partial = some & ~full
    q_major = (*_ordered(partial.transpose(-2, -1)), *_ordered(full.transpose(-2, -1))) if backward else (None,) * 4
    return Masked(BlockMask((lq, lk), *_ordered(partial), *_ordered(full), *q_major, BLOCK_SIZE=(TILE, TILE),
                            mask_mod=fn.bound()), fn)


def _build_block_mask(lq, lk, causal, key_valid_bs, window, device, rows, backward) -> Masked:
    if key_valid_bs is not None:
        key_valid_bs = key_valid_bs.contiguous()
    some, full, mod_tensors = tile_states(lq, lk, causal, key_valid_bs, window, device, rows)
    return _masked(some, full, _mask_fn(key_valid_bs, mod_tensors), rows[1] - rows[0], lk, backward)


def _score_mod(mod: "maskfn.FnScore | None", device) -> Fn | None:
    """flex_attention's score function of a block's score function (Note [Score functions] in
    maskfn.py), None when the block has none: the function at the call's global positions,
    batch rows from b0 and heads from h0, its tensors whole, every value an argument (no
    Python number: the backward's traced graph takes them as inputs)."""
    if mod is None:
        return None
    offsets, kinds = _offset_args(mod.q_pos, mod.k_pos, mod.starts, mod.b0, mod.h0)
    return Fn(_fn_score(mod.fn, kinds), (*offsets, *mod.tensors), score=True)


@functools.lru_cache(maxsize=256)  # per function: the forward's and the backward's programs key on it
def _fn_score(fn: maskfn.MaskFn, kinds: tuple):
    def score_mod(score, b, h, i, j, *tensors):
        (gb, gh, qi, kj), tensors = _globals(kinds, b, h, i, j, tensors)
        return fn(gb, gh, qi, kj, tensors, score=score)

    return score_mod


def _call(q, k, v, mask: Masked, scale: float, mod=None):
    """(out, lse) of one flex call: flex's forward kernel in a compiled program (`_program`)."""
    score = _score_mod(mod, q.device) or _IDENTITY
    template, slots, mask_inputs, mask_specs = mask.inputs
    args = (q, k, v, *score.tensors)
    # flex's main kernel for every call: its automatic choice sends calls of fewer than 128 rows to
    # the decoding kernel, which has no valid configuration for some (GQA with key padding)
    options = _compat.flex_kernel_options(q, k, v, (("BACKEND", "TRITON"),) if q.is_cuda else ())
    run = _program(_forward, score.fn, len(score.tensors), mask.fn.fn, len(mask.fn.tensors), template, slots,
                   float(scale), options, _specs(args) + mask_specs)
    return run(*args, *mask_inputs)


def _identity(score, b, h, i, j):
    return score


_IDENTITY = Fn(_identity, score=True)


def _bwd_call(dout, q, k, v, out, lse, mask: Masked, scale: float, mod=None):
    """(dq, dk, dv) of one flex call under the rows' global (out, lse) (natural log, +inf where
    a row saw no key): flex's backward kernel fed them (Note [Flex blocks]); dk/dv with g heads."""
    score = _score_mod(mod, q.device) or _IDENTITY
    template, slots, mask_inputs, mask_specs = mask.inputs
    args = (q.contiguous(), k.contiguous(), v.contiguous(), out.contiguous(), lse.contiguous(), dout.contiguous(),
            *score.tensors)
    run = _program(_backward, score.fn, len(score.tensors), mask.fn.fn, len(mask.fn.tensors), template, slots,
                   float(scale), _compat.flex_kernel_options(q, k, v), _specs(args) + mask_specs)
    return run(*args, *mask_inputs)


# Compiled programs kept per process: one per direction, distinct block shape, dtype and function
# (a ring has a few block shapes; the key holds no tensor, so a program never keeps one alive).
PROGRAMS = 128


class _Program:
    """A traced flex call, compiled by inductor on its first call on CUDA (on CPU the traced
    graph runs flex's dense implementation). Traced, compiled and run without autograd: the
    ring's ops make their own gradients."""

    def __init__(self, trace):
        self.trace, self.run = trace, None

    def __call__(self, *args):
        with torch.no_grad():
            if self.run is None:
                gm = self.trace(args)
                self.run = _compat.compile_graph(gm, list(args)) if args[0].is_cuda else gm
            return self.run(*args)


def _block(template: tuple, slots: tuple, tensors, mask_fn) -> tuple:
    """The BlockMask's tuple (BlockMask.as_tuple) from its layout and tensors, `mask_fn` last."""
    block = list(template) + [mask_fn]
    for i, t in zip(slots, tensors):
        block[i] = t
    return tuple(block)


def _forward(score_fn, n_score: int, mask_fn, n_mask: int, template: tuple, slots: tuple, scale: float,
             options: tuple):
    """The program of a flex call's forward: (out, natural-log lse)."""
    hop = _compat.flex_forward_op()

    def forward(q, k, v, *rest):
        score_t, mask_t, block_t = rest[:n_score], rest[n_score:n_score + n_mask], rest[n_score + n_mask:]
        out, lse2 = hop(q, k, v, score_fn, _block(template, slots, block_t, mask_fn), scale, dict(options),
                        tuple(score_t), tuple(mask_t))[:2]
        return out, lse2 * math.log(2)

    return forward


def _backward(score_fn, n_score: int, mask_fn, n_mask: int, template: tuple, slots: tuple, scale: float,
              options: tuple):
    """The program of a flex call's backward under the rows' global (out, natural-log lse)."""
    hop, fw_bw_graphs = _compat.flex_backward_op()

    def backward(q, k, v, out, lse, dout, *rest):
        lse2 = lse * (1 / math.log(2))  # flex's kernels keep the lse in base 2
        score_t, mask_t, block_t = rest[:n_score], rest[n_score:n_score + n_mask], rest[n_score + n_mask:]
        example = (q.new_zeros((), requires_grad=True), *(q.new_zeros((), dtype=torch.int) for _ in range(4)))
        # the score function's joint graph is built by autograd, inside the ring's backward op
        with _compat.autograd_inside_op():
            fw, joint = fw_bw_graphs(score_fn, example, tuple(score_t))
        dq, dk, dv, _ = hop(q, k, v, out, lse2, dout, None, fw, joint, _block(template, slots, block_t, mask_fn),
                            scale, dict(options), tuple(score_t), tuple(mask_t))
        return dq, dk, dv

    return backward


@functools.lru_cache(maxsize=PROGRAMS)
def _program(direction, *key):
    """The program of `direction` (`_forward`, `_backward`) of its arguments key[:-1], for inputs
    of the specs key[-1]."""
    return _Program(lambda args: _compat.trace_fake(direction(*key[:-1]), args))


def _row_chunks(lq: int) -> list[tuple[int, int]]:
    return [(r, min(lq, r + CALL_ROWS)) for r in range(0, lq, CALL_ROWS)]


def fwd(q_bhsd, k_bgsd, v_bgsd, scale: float, causal: bool, key_valid_bs=None, window=None, mod=None):
    """(out, lse) of a masked (or score-modified: maskfn.FnScore) block, one flex call per
    CALL_ROWS rows."""
    (b, h, lq, _), lk, dev = q_bhsd.shape, k_bgsd.shape[2], q_bhsd.device
    chunks = _row_chunks(lq)
    out = lse = None
    for r0, r1 in chunks:
        mask = block_mask(lq, lk, causal, key_valid_bs, window, dev, (r0, r1), backward=False)
        if len(chunks) == 1:
            return _call(q_bhsd, k_bgsd, v_bgsd, mask, scale, mod)
        o, l_ = _call(q_bhsd[:, :, r0:r1], k_bgsd, v_bgsd, mask, scale, None if mod is None else mod.sub(r0))
        if out is None:
            out, lse = o.new_empty(b, h, lq, o.shape[-1]), l_.new_empty(b, h, lq)
        out[:, :, r0:r1], lse[:, :, r0:r1] = o, l_
        del o, l_, mask  # not alive during the next call (workspace._flex_calls counts one)
    return out, lse


def bwd(dout, q_bhsd, k_bgsd, v_bgsd, out, lse, scale: float, causal: bool, key_valid_bs=None, window=None,
        mod=None):
    """(dq, dk, dv) of a masked block under the rows' global (out, lse), lse as kernels.bwd_lse
    prepares it (+inf where a row saw no key anywhere); dk/dv with g heads."""
    lq, lk, dev = q_bhsd.shape[2], k_bgsd.shape[2], q_bhsd.device
    chunks = _row_chunks(lq)
    dq, dk, dv = None, None, None
    for r0, r1 in chunks:
        mask = block_mask(lq, lk, causal, key_valid_bs, window, dev, (r0, r1))
        if len(chunks) == 1:
            return _bwd_call(dout, q_bhsd, k_bgsd, v_bgsd, out, lse, mask, scale, mod)
        rows = slice(r0, r1)
        grads = _bwd_call(dout[:, :, rows], q_bhsd[:, :, rows], k_bgsd, v_bgsd, out[:, :, rows], lse[:, :, rows], mask,
                          scale, None if mod is None else mod.sub(r0))
        if dq is None:
            dq = torch.empty_like(q_bhsd, memory_format=torch.contiguous_format)
            dk, dv = (t.to(acc_dtype(k_bgsd.dtype)) for t in grads[1:])
        else:
            dk.add_(grads[1])
            dv.add_(grads[2])
        dq[:, :, rows] = grads[0]
        del grads, mask  # not alive during the next chunk (workspace._flex_calls counts one chunk's)
    return dq, dk.to(k_bgsd.dtype), dv.to(v_bgsd.dtype)
