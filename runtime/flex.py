"""Masked blocks on CUDA through flex_attention (Note [Flex blocks]).

Legend as in kernels.py: q_bhsd [b, h, Lq, d]; k_bgsd / v_bgsd [b, g, Lk, d]; key_valid_bs
[b, Lk] bool (True = key may be attended); window: a ring.WindowMask (global positions of the
block's rows and keys) or None. lse natural-log fp32 [b, h, Lq]; rows with no visible key give
out = 0, lse = -inf.
"""

from __future__ import annotations

import functools

import torch
from torch.nn.attention.flex_attention import AuxRequest, BlockMask, flex_attention

from ringcc import _compat

from .dtypes import acc_dtype

# Note [Flex blocks]
# The fused cuDNN/flash kernels take no masks, so a masked bf16/fp16 block (key padding, a
# sliding window) on CUDA runs flex_attention compiled by inductor, and so does a block whose
# scores are modified (soft-capping, ALiBi: Note [Score modifiers] in kernels.py), with the
# modifier as flex's score_mod. Every mask ringcc lifts is
# "key j visible to row i iff lo <= pos_q[i] - pos_k[j] < hi, and key j is valid in its batch
# row", where pos are the block's positions (global ones for windows; 0.. for the causal
# diagonal, which is top-left aligned) and (lo, hi) come from the call's causal flag and the
# window. So one mask_mod serves every block, and the BlockMask is built from 128 x 128 tile
# bounds of those positions and of the key mask: O(tiles), never the [Lq, Lk] mask (torch's
# create_block_mask evaluates it whole). Full tiles skip the mask_mod; empty tiles are skipped.
#
# Backward: flex_attention's backward recomputes P from its own forward's (out, lse), while a
# ring block needs the gradient under the row's global (O, L) (kernels.block_bwd). With the
# block's own forward (o, l) recomputed, c = exp(l - L) and D = rowsum(dO * O), autograd
# through (o, l) with grad_o = c * dO and grad_l = rowsum(grad_o * o) - c * D gives exactly
# dS = P (dO V^T - D), P = exp(S - L): the block's share of the global gradient. It costs one
# more forward of the block, and holds O(Lq + Lk) bytes per head (no scores).
#
# A BlockMask holds O(query tiles x key tiles) indices, quadratic in the shard, so a block of
# more than CALL_ROWS query rows runs one flex call per chunk of CALL_ROWS rows (backward: dK/dV
# summed over the chunks in fp32): O(CALL_ROWS / TILE x Lk / TILE) per call, linear in the shard.
# The planner counts these bytes (workspace.masked_calls).

TILE = 128  # flex_attention's default sparse block size
CALL_ROWS = 16384  # query rows per flex call (a multiple of TILE)
_FAR = 2**30  # a position difference bound no block reaches (int32-safe)


# Compiled variants of flex_attention per process: forward and the backward's recompute
# (inputs that require grad), with and without a key mask, GQA or not, static then dynamic
# shapes; dynamo's default limit (8) would stop compiling before a training step has them all.
RECOMPILE_LIMIT = 64


@functools.cache
def _flex():
    # automatic dynamic shapes: the ring's few block shapes share compiled kernels
    _compat.raise_recompile_limit(RECOMPILE_LIMIT)
    return torch.compile(flex_attention, fullgraph=True)


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


def _tile_range(pos: torch.Tensor, tiles: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per tile of TILE positions, (min, max) in int64; the last tile's missing entries repeat
    its last position (the kernel masks indices past the length itself)."""
    p = pos.long()
    pad = tiles * TILE - p.shape[0]
    if pad:
        p = torch.cat([p, p[-1:].expand(pad)])
    p = p.view(tiles, TILE)
    return p.amin(1), p.amax(1)


def _ordered(tiles_bhqk: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """BlockMask's (count, indices) of the set tiles of each row of tiles, set ones first."""
    t = tiles_bhqk.to(torch.int32)
    # contiguous: the kernels index them as such, and a transposed input's argsort keeps its strides
    return (t.sum(-1, dtype=torch.int32).contiguous(),
            torch.argsort(t, dim=-1, descending=True, stable=True).to(torch.int32, memory_format=torch.contiguous_format))


@functools.cache
def _bound(lo: int, hi: int, dtype, device) -> torch.Tensor:
    return torch.tensor([lo, hi], dtype=dtype, device=device)


def _positions(lq: int, lk: int, window, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The block's (row, key) positions: a window's global ones, else 0.. (top-left aligned)."""
    if window is not None:
        return window.q_pos, window.k_pos
    return _arange(lq, device), _arange(lk, device)


def _position_tiles(lq: int, lk: int, causal: bool, window, device, rows):
    """(some, full) bool [1, 1, row tiles, key tiles] from the positions alone, with the
    mask_mod's (pos_q of the rows, pos_k, [lo, hi]); see tile_states."""
    r0, r1 = rows
    pos_q, pos_k = _positions(lq, lk, window, device)
    pos_q = pos_q[r0:r1]
    qt, kt = -(-(r1 - r0) // TILE), -(-lk // TILE)
    lo, hi = _bounds(causal, window)
    qmin, qmax = _tile_range(pos_q, qt)
    kmin, kmax = _tile_range(pos_k, kt)
    dmin, dmax = qmin[:, None] - kmax[None, :], qmax[:, None] - kmin[None, :]
    some = ((dmax >= lo) & (dmin < hi))[None, None]
    full = ((dmin >= lo) & (dmax < hi))[None, None]
    return some, full, (pos_q, pos_k, _bound(lo, hi, pos_q.dtype, torch.device(device)))


@functools.lru_cache(maxsize=64)
def _arange_tiles(lq: int, lk: int, causal: bool, device, rows):
    return _position_tiles(lq, lk, causal, None, device, rows)


# A cached BlockMask holds 4 int32 tiles-sized index arrays per direction; beyond this many
# tiles (a 16K-row call over 64K keys) the kernels' time dwarfs the host's build, and the
# cache (outside the planner's count, as long-lived as the window) would grow with the shard.
CACHED_TILES = 1 << 16


def _tiles(rows, lk: int) -> int:
    return -(-(rows[1] - rows[0]) // TILE) * -(-lk // TILE)


def _per_window(window, key, rows, lk: int, build):
    """build(), kept on the window for the next call when the call has at most CACHED_TILES
    tiles. What depends on a window's positions alone is the same at every step, head chunk
    and iteration, and the window masks of a ring's calls live as long as its setup
    (ring.RingSetup._window_calls), so their tiles (and, with no key mask, whole BlockMasks)
    are built once instead of per kernel call (host time: a windowed ring is host-bound).
    Calls cut to a run of valid keys get fresh slices of those masks (ring.WindowMask.sub) and
    build theirs per call."""
    if _tiles(rows, lk) > CACHED_TILES:
        return build()
    cache = window.__dict__.setdefault("_flex_cache", {})  # a frozen dataclass: its __dict__ is writable
    if key not in cache:
        cache[key] = build()
    return cache[key]


def tile_states(lq: int, lk: int, causal: bool, key_valid_bs, window, device, rows=None):
    """(some, full) bool [b or 1, 1, row tiles, key tiles] of block rows `rows` ((r0, r1);
    None: all): tiles with some / every (row, key) pair visible (conservative: a tile is full
    only when every pair is visible, empty only when none is). Also the mask_mod's inputs:
    (pos_q of those rows, pos_k, [lo, hi])."""
    rows = rows or (0, lq)
    if window is None:
        some, full, mod_inputs = _arange_tiles(lq, lk, causal, torch.device(device), rows)
    else:
        some, full, mod_inputs = _per_window(window, ("tiles", causal, rows), rows, lk,
                                             lambda: _position_tiles(lq, lk, causal, window, device, rows))
    if key_valid_bs is not None:
        kt = -(-lk // TILE)
        pad = kt * TILE - lk
        kv = key_valid_bs
        any_ = torch.nn.functional.pad(kv, (0, pad), value=False).view(kv.shape[0], kt, TILE).any(-1)
        all_ = torch.nn.functional.pad(kv, (0, pad), value=True).view(kv.shape[0], kt, TILE).all(-1)
        some = some & any_[:, None, None, :]
        full = full & all_[:, None, None, :]
    return some, full, mod_inputs


def _mask_mod(key_valid_bs, pos_q, pos_k, bound):
    def visible(b, h, i, j):
        d = pos_q[i] - pos_k[j]
        m = (d >= bound[0]) & (d < bound[1])
        return m if key_valid_bs is None else m & key_valid_bs[b, j]

    return visible


def block_mask(lq: int, lk: int, causal: bool, key_valid_bs, window, device, rows=None,
               backward: bool = True) -> BlockMask:
    """The BlockMask of a masked block call over rows `rows` ((r0, r1); None: all) (Note [Flex
    blocks]); the forward kernel reads the tiles of each query tile only, the backward also
    those of each key tile. Both orders come from the tile states directly
    (BlockMask.from_kv_blocks would rebuild the dense tiles). A window's mask without a key
    mask is built once per window (_per_window)."""
    rows = rows or (0, lq)
    build = lambda: _build_block_mask(lq, lk, causal, key_valid_bs, window, device, rows, backward)  # noqa: E731
    if key_valid_bs is None and window is not None:
        return _per_window(window, ("mask", causal, rows, backward), rows, lk, build)
    return build()


def _build_block_mask(lq, lk, causal, key_valid_bs, window, device, rows, backward) -> BlockMask:
    if key_valid_bs is not None:
        key_valid_bs = key_valid_bs.contiguous()
    some, full, (pos_q, pos_k, bound) = tile_states(lq, lk, causal, key_valid_bs, window, device, rows)
    partial = some & ~full
    q_major = (*_ordered(partial.transpose(-2, -1)), *_ordered(full.transpose(-2, -1))) if backward else (None,) * 4
    return BlockMask((rows[1] - rows[0], lk), *_ordered(partial), *_ordered(full), *q_major, BLOCK_SIZE=(TILE, TILE),
                     mask_mod=_mask_mod(key_valid_bs, pos_q, pos_k, bound))


@functools.lru_cache(maxsize=4096)  # a few per block call of a ring (steps x calls x row and head chunks)
def _values(values: tuple, dtype, device) -> torch.Tensor:
    """A score_mod's numbers as a tensor, made (a host-to-device copy) once per value."""
    return torch.tensor(values, dtype=dtype, device=device)


def _score_mod(mod, device):
    """flex_attention's score_mod of a kernels.ScoreMod (Note [Score modifiers]); None when the
    block has none. flex hands it the scaled score; h is the call's query head, i / j its row
    / key. It reads tensors of the same shapes at every call and no Python number (why: Note
    [Score modifiers])."""
    if mod is None:
        return None
    dev = torch.device(device)
    cap = _values((float(mod.softcap),), torch.float32, dev) if mod.softcap else None
    if mod.slopes is None:
        return _capped(cap)
    q, k = mod.q, mod.k
    for v in (q.a, q.cut, q.b, k.a, k.cut, k.b):
        if not -2**31 <= v < 2**31:
            raise ValueError(f"ALiBi positions must fit int32 on flex_attention; got a position offset of {v}")
    offs = _values((q.a, q.cut, q.b, k.a, k.cut, k.b, mod.head0), torch.int32, dev)
    slopes = mod.slopes.contiguous()
    return _alibi(offs, slopes) if cap is None else _capped_alibi(cap, offs, slopes)


def _cap(score, cap):
    return torch.tanh(score / cap[0]) * cap[0]


def _bias(score, h, i, j, offs, slopes):
    """score + slope[head] * (pos_k - pos_q), the positions from the offsets (kernels.Positions)."""
    pos_q = i + torch.where(i < offs[1], offs[0], offs[2])
    pos_k = j + torch.where(j < offs[4], offs[3], offs[5])
    return score + slopes[h + offs[6]] * (pos_k - pos_q).to(torch.float32)


def _capped(cap):
    return lambda score, b, h, i, j: _cap(score, cap)


def _alibi(offs, slopes):
    return lambda score, b, h, i, j: _bias(score, h, i, j, offs, slopes)


def _capped_alibi(cap, offs, slopes):
    return lambda score, b, h, i, j: _bias(_cap(score, cap), h, i, j, offs, slopes)


def _call(q, k, v, mask: BlockMask, scale: float, mod=None):
    # Lengths that are multiples of the tiles need no bounds checks; flex_attention decides it
    # from the shapes only when they are static, and a ring's calls of several shapes are compiled
    # with dynamic ones (_flex), so it is said here (a guard: one kernel each way).
    divisible = q.shape[2] % TILE == 0 and k.shape[2] % TILE == 0
    out, aux = _flex()(q, k, v, score_mod=_score_mod(mod, q.device), block_mask=mask, scale=scale,
                       enable_gqa=k.shape[1] != q.shape[1], return_aux=AuxRequest(lse=True),
                       kernel_options={"IS_DIVISIBLE": divisible})
    return out, aux.lse


def _row_chunks(lq: int) -> list[tuple[int, int]]:
    return [(r, min(lq, r + CALL_ROWS)) for r in range(0, lq, CALL_ROWS)]


def fwd(q_bhsd, k_bgsd, v_bgsd, scale: float, causal: bool, key_valid_bs=None, window=None, mod=None):
    """(out, lse) of a masked (or score-modified: kernels.ScoreMod) block, one flex call per
    CALL_ROWS rows."""
    (b, h, lq, d), lk, dev = q_bhsd.shape, k_bgsd.shape[2], q_bhsd.device
    chunks = _row_chunks(lq)
    out = lse = None
    for r0, r1 in chunks:
        mask = block_mask(lq, lk, causal, key_valid_bs, window, dev, (r0, r1), backward=False)
        o, l_ = _call(q_bhsd[:, :, r0:r1], k_bgsd, v_bgsd, mask, scale, None if mod is None else mod.sub(r0))
        if len(chunks) == 1:
            return o, l_
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
        rows = slice(r0, r1)
        m = None if mod is None else mod.sub(r0)
        grads = grads_under_global_lse(lambda q, k, v, mask=mask, m=m: _call(q, k, v, mask, scale, m), dout[:, :, rows],
                                       q_bhsd[:, :, rows], k_bgsd, v_bgsd, out[:, :, rows], lse[:, :, rows])
        if len(chunks) == 1:
            return grads
        if dq is None:
            dq = torch.empty_like(q_bhsd, memory_format=torch.contiguous_format)
            dk, dv = (t.to(acc_dtype(k_bgsd.dtype)) for t in grads[1:])
        else:
            dk.add_(grads[1])
            dv.add_(grads[2])
        dq[:, :, rows] = grads[0]
        del grads, mask  # not alive during the next chunk (workspace._flex_calls counts one chunk's)
    return dq, dk.to(k_bgsd.dtype), dv.to(v_bgsd.dtype)


def _grad_inputs(dout, out, o_blk, l_blk, lse):
    """(grad_o, grad_l) for autograd through the block's own (o, l) (Note [Flex blocks]). On
    CUDA it runs compiled (one fused pass); eager (CPU tests) it makes fp32 copies of dO's size."""
    acc = acc_dtype(dout.dtype)
    # c = exp(l - L): 0 where the block's row saw no key (l = -inf) or no row key at all (L = +inf)
    c = (l_blk.to(acc) - lse.to(acc)).exp()
    grad_o = (dout.to(acc) * c[..., None]).to(dout.dtype)
    delta = (dout.to(acc) * out.to(acc)).sum(-1)
    grad_l = (grad_o.to(acc) * o_blk.to(acc)).sum(-1) - c * delta
    return grad_o, grad_l.to(l_blk.dtype)


@functools.cache
def _grad_inputs_fused():
    return torch.compile(_grad_inputs, fullgraph=True)  # one pass over dO, O and o instead of ~10


def grads_under_global_lse(block_fwd, dout, q_bhsd, k_bgsd, v_bgsd, out, lse):
    """A block's (dq, dk, dv) under the rows' global (out, lse) (+inf: a row that saw no key),
    by autograd through `block_fwd(q, k, v) -> (o, l)`, the block's own attention (Note [Flex
    blocks]). Runs inside the ring's backward op: _compat.autograd_inside_op."""
    with _compat.autograd_inside_op():
        q, k, v = (t.detach().requires_grad_() for t in (q_bhsd, k_bgsd, v_bgsd))
        o_blk, l_blk = block_fwd(q, k, v)
    prep = _grad_inputs_fused() if dout.is_cuda else _grad_inputs
    grad_o, grad_l = prep(dout, out, o_blk.detach(), l_blk.detach(), lse)
    with _compat.autograd_inside_op():
        return torch.autograd.grad((o_blk, l_blk), (q, k, v), (grad_o, grad_l))
