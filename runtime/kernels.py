"""Per-block attention kernels that return (out, lse), and their backward.

Legend: q_bhsd [b, h, Lq, d]; k_bgsd [b, g, Lk, d] and v_bgsd [b, g, Lk, dv] with h % g == 0
(GQA/MQA; dv may differ from d: Note [Value head dim]); key_valid_bs [b, Lk] bool (True = key
may be attended). lse is natural-log, [b, h, Lq], in the accumulator dtype (fp32; fp64 for fp64
inputs). out is [b, h, Lq, dv].

A block is either unmasked, causal on its diagonal (square, top-left aligned: the query and
key chunks are the same global chunk), optionally key-padded, and optionally restricted by a
position mask (sliding windows). Rows with no valid key
give out = 0, lse = -inf. The backward takes the *global* (out, lse) of the row, as
flash-attention's backward expects, which yields this block's exact share of the gradient.

Kernel choice: CPU -> aten's CPU flash op (takes masks). CUDA -> cuDNN (default) or flash
SDPA ops for unmasked / causal blocks (`RINGCC_CUDA_KERNEL=flash|cudnn` overrides the choice);
masked bf16/fp16 blocks -> flex_attention compiled by inductor (flex.py, Note [Flex blocks]);
fp32/fp64 blocks, and masked ones under `RINGCC_MASKED_KERNEL=math`, -> the exact math path
(Note [Masked rows]).

GQA: the cuDNN ops take K/V with their own g heads and return dK/dV with g heads (the group
sum done inside the kernel), so no expanded K/V and no separate reduction there; every other
path expands K/V to h heads and sums the gradients back. A cuDNN build that rejects g != h
(found once per device by a tiny probe) gets the expanded form, with a warning;
RINGCC_CUDNN_NATIVE_GQA=0 forces the expanded form.
"""

from __future__ import annotations

import math
import os
import warnings
from collections import Counter

import torch

from ringcc import _compat

from .dtypes import acc_dtype
from .maskfn import FnScore


def _expand_kv(k_bgsd: torch.Tensor, h: int) -> torch.Tensor:
    g = k_bgsd.shape[1]
    return k_bgsd if g == h else k_bgsd.repeat_interleave(h // g, dim=1)


def _reduce_kv_grad(dk_bhsd: torch.Tensor, g: int) -> torch.Tensor:
    """The g-head K/V gradient of an h-head one (summed over each group); as is when it has g."""
    b, h, s, d = dk_bhsd.shape
    return dk_bhsd if g == h else dk_bhsd.view(b, g, h // g, s, d).sum(2)


def _causal_band(r0: int, r1: int, lk: int, device, c0: int = 0) -> torch.Tensor:
    """Rows [r0, r1), keys [c0, lk) of the top-left causal mask (key j visible to row i iff j <= i)."""
    return torch.arange(c0, lk, device=device)[None, :] <= torch.arange(r0, r1, device=device)[:, None]


# A block's score function (maskfn.FnScore, Note [Score functions] in maskfn.py) modifies its
# scaled scores before the mask. Each block computes its share exactly, and the LSE merge stays
# exact: the block's lse is that of the modified scores. No fused kernel takes a function, so
# such blocks run flex_attention where masked blocks do (bf16/fp16 on CUDA: Note [Flex blocks]
# in flex.py), else the exact math path (Note [Masked rows]), whose backward multiplies
# dS = P * (dP - D), the gradient of the modified score, by the function's derivative.


FUSED_CUDA_DTYPES = (torch.float16, torch.bfloat16)  # what the CUDA flash and cuDNN kernels take


def _math_only(device, dtype) -> bool:
    """Blocks on CUDA in a dtype the fused kernels do not take (fp32, fp64): the math path."""
    return device.type == "cuda" and dtype is not None and dtype not in FUSED_CUDA_DTYPES


def _allowed_rows(allowed_qk, r0: int, r1: int, c0: int = 0, c1: int | None = None) -> torch.Tensor:
    """Rows [r0, r1), keys [c0, c1) of a position mask: a bool [Lq, Lk] tensor, or an object
    that builds its rows on demand (ring.WindowMask)."""
    if isinstance(allowed_qk, torch.Tensor):
        return allowed_qk[..., r0:r1, c0:c1]
    return allowed_qk.rows(r0, r1, c0, c1)


def _mask(key_valid_bs, causal: bool, lq: int, lk: int, device, allowed_qk=None):
    """The CPU kernel's combined bool mask [b or 1, 1, Lq, Lk] (True = attend) of a block, or
    None when it needs none (unmasked, or a plain causal diagonal that the kernel does itself)."""
    if key_valid_bs is None and allowed_qk is None:
        return None
    return _rows_mask(key_valid_bs, causal, allowed_qk, 0, lq, 0, lk, device)


def _additive(mask: torch.Tensor, dtype) -> torch.Tensor:
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


def _cuda_kernel() -> str:
    return os.environ.get("RINGCC_CUDA_KERNEL", "cudnn")


def native_gqa_setting() -> bool:
    """RINGCC_CUDNN_NATIVE_GQA (default on): the cuDNN kernels get K/V at their own heads. The
    head-chunk rule reads this setting (the same on every rank), never the probe below."""
    return os.environ.get("RINGCC_CUDNN_NATIVE_GQA", "1") != "0"


_CUDNN_GQA: dict = {}  # device -> None (cuDNN takes g != h) or why not


def _cudnn_gqa_unsupported(device) -> str | None:
    """Why this process's cuDNN ops reject K/V with fewer heads than q (None: they take them),
    found once per device with a tiny forward and backward; real calls are never retried, so
    their errors (out of memory included) surface as they are."""
    if device not in _CUDNN_GQA:
        q = torch.randn(1, 2, 64, 64, device=device, dtype=torch.bfloat16)
        k = torch.randn(1, 1, 64, 64, device=device, dtype=torch.bfloat16)
        try:
            out, lse = _compat.cuda_cudnn_fwd(q, k, k, None, True, 0.0, False, False)[:2]
            seed = _zero_seed(device)
            grads = _compat.cuda_cudnn_bwd(torch.ones_like(out), q, k, k, out, lse.float().contiguous(),
                                           seed, seed, None, None, None, 64, 64, 0.0, False)
            ok = grads[1].shape[1] in (1, 2)
            _CUDNN_GQA[device] = None if ok else f"dK with {grads[1].shape[1]} heads"
        except torch.OutOfMemoryError:
            raise
        except RuntimeError as e:
            _CUDNN_GQA[device] = str(e).splitlines()[0][:200]
        if _CUDNN_GQA[device] is not None:
            warnings.warn(f"ringcc: this cuDNN rejects GQA K/V at their own heads ({_CUDNN_GQA[device]}); "
                          "expanding K/V to the query heads instead", stacklevel=3)
    return _CUDNN_GQA[device]


def _cudnn_call(op, q, k_bgsd, v_bgsd, *args, **kwargs):
    """op(q, k, v, *args) with K/V at their own g heads where cuDNN takes them, else expanded."""
    h, g = q.shape[1], k_bgsd.shape[1]
    if g != h and (not native_gqa_setting() or _cudnn_gqa_unsupported(q.device) is not None):
        k_bgsd, v_bgsd = _expand_kv(k_bgsd, h), _expand_kv(v_bgsd, h)
    return op(q, k_bgsd, v_bgsd, *args, **kwargs)


def _rows_allowed(causal: bool, allowed_qk, r0: int, r1: int, lk: int, dev, c0: int = 0):
    """The position mask of block rows [r0, r1) and keys [c0, lk): the top-left causal band
    and/or the given [Lq, Lk] mask's part; None when neither."""
    m = None if allowed_qk is None else _allowed_rows(allowed_qk, r0, r1, c0, lk)
    if causal:
        band = _causal_band(r0, r1, lk, dev, c0)
        m = band if m is None else m & band
    return m


def _key_range(causal: bool, allowed_qk, r0: int, r1: int, lk: int) -> tuple[int, int]:
    """Keys [c0, c1) outside which no key is visible to block rows [r0, r1): the causal band
    ends at row r1 - 1, a window (ring.WindowMask.key_range) bounds both sides; c0 == c1: none."""
    c0, c1 = 0, lk
    if causal:
        c1 = min(lk, r1)
    if allowed_qk is not None and hasattr(allowed_qk, "key_range"):
        a0, a1 = allowed_qk.key_range(r0, r1)
        c0, c1 = max(c0, a0), min(c1, a1)
    return c0, max(c0, c1)


# Note [Masked rows]
# A masked block (key padding, a sliding window) on the CPU kernel or on CUDA's math path
# (fp32/fp64, which the fused kernels do not take; masked bf16/fp16 blocks under
# RINGCC_MASKED_KERNEL=math, else they go to flex_attention: Note [Flex blocks]) holds
# [rows, Lk] values per head: the CUDA math path its scores and, in backward, their
# gradient; the CPU kernel an additive mask [b, 1, rows, Lk] where the mask has rows (causal,
# windows). Over the whole block that is O(Lq * Lk), quadratic in the shard (16
# GiB of fp32 scores at 16K rows and 16 heads), so such a call runs over chunks of query rows
# of at most MASKED_CALL_BYTES of scores each, which keeps it O(n/p): rows are independent in
# forward, and dK/dV sum over them in backward. A chunk's keys are cut to the range its rows
# may see (`_key_range`: the causal band's end, a window's two sides), so a window of w keys
# costs O(rows * (rows + w)) per chunk, not O(rows * Lk). The math path works in place on one buffer
# per chunk in forward (scores, then probabilities) and two in backward (P and dS), prepares
# K/V once per block (expanded, in the accumulator dtype) and adds each chunk's dK/dV into the
# block's accumulators without a temporary of their size. The planner counts these bytes
# (workspace.masked_calls; benchmarks/bench_planner_gpu.py --models masked checks them against
# the allocator).

MASKED_CALL_BYTES = 256 * 2**20  # accumulator-dtype [b, h, rows, Lk] of one masked kernel call


def masked_kernel() -> str:
    """RINGCC_MASKED_KERNEL: what runs masked bf16/fp16 blocks on CUDA (the planner reads it too)."""
    kind = os.environ.get("RINGCC_MASKED_KERNEL", "flex")
    if kind not in ("flex", "math"):
        raise ValueError(f"RINGCC_MASKED_KERNEL must be 'flex' (default: flex_attention for masked bf16/fp16 "
                         f"blocks on CUDA) or 'math' (the exact fp32 math path); got {kind!r}")
    return kind


def flex_blocks(device, dtype) -> bool:
    """Whether masked and modified blocks of this device and dtype run flex_attention (flex.py):
    bf16/fp16 on CUDA, unless RINGCC_MASKED_KERNEL=math."""
    return device.type == "cuda" and dtype in FUSED_CUDA_DTYPES and masked_kernel() == "flex"


def _flex_path(device, dtype, key_valid_bs, allowed_qk, mod=None) -> bool:
    """Whether a block runs flex_attention (flex.py): a masked or score-modified block (flex_blocks)
    whose position mask, if any, is a window (ring.WindowMask) or a mask function (FnMask); a
    score function (FnScore) is flex's score_mod."""
    return (flex_blocks(device, dtype) and (key_valid_bs is not None or allowed_qk is not None or mod is not None)
            and not isinstance(allowed_qk, torch.Tensor))


_FLEX_FAILED: dict = {}  # (device, dtype, head dim) -> why flex_attention could not run such blocks
# block calls (forward and backward) that ran the exact math path because flex_attention failed
# for blocks like theirs, per (device, dtype, head dim); the ringcc report prints them
FLEX_FALLBACKS: Counter = Counter()


def fallback_line() -> str | None:
    """The report's line on masked blocks that ran the exact math path after flex_attention
    failed for them (None: none did)."""
    if not FLEX_FALLBACKS:
        return None
    parts = [f"{n} calls of {dt} blocks with head dim {d} on {dev} ({_FLEX_FAILED.get((dev, dt, d), '?')})"
             for (dev, dt, d), n in FLEX_FALLBACKS.items()]
    return "masked blocks on the exact math path (flex_attention failed for them): " + "; ".join(parts)


def _try_flex(call, q_bhsd):
    """call() (a flex.py block call), or None when flex_attention cannot be compiled or launched
    for blocks like q's here (warned once per device, dtype and head dim; every such call counted
    in FLEX_FALLBACKS): the caller then runs the exact math path, slower but correct, instead of
    failing the training step."""
    key = (q_bhsd.device, q_bhsd.dtype, q_bhsd.shape[-1])
    if key in _FLEX_FAILED:
        FLEX_FALLBACKS[key] += 1
        return None
    try:
        return call()
    except _compat.compile_errors() as e:
        why = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}"
        _FLEX_FAILED[key] = why
        FLEX_FALLBACKS[key] += 1
        warnings.warn(f"ringcc: flex_attention could not run masked {q_bhsd.dtype} blocks with head dim "
                      f"{q_bhsd.shape[-1]} on {q_bhsd.device} ({why}); using the exact math path for them "
                      "(slower; RINGCC_MASKED_KERNEL=math selects it without trying flex)", stacklevel=3)
        return None


def _math_path(device, dtype, key_valid_bs, allowed_qk, mod=None) -> bool:
    """Whether a block runs the exact math path: a block with a score function (no fused kernel
    takes one), and on CUDA a masked block (the fused kernels take no masks) or a dtype they
    do not take."""
    if mod is not None:
        return True
    return device.type == "cuda" and (key_valid_bs is not None or allowed_qk is not None or _math_only(device, dtype))


def _row_chunks(q_bhsd, lk: int, allowed_qk=None) -> list[tuple[int, int]]:
    """Query-row chunks of at most MASKED_CALL_BYTES of [b, h, rows, Lk] accumulator-dtype
    values each (at least one row each). With a window (ring.WindowMask) no chunk spans a jump
    in the rows' positions (zigzag: the rank's two sequence chunks), so that a chunk's rows span
    as many positions as they are rows, and its keys (`_key_range`) rows + 2 * window at most."""
    b, h, lq = q_bhsd.shape[0], q_bhsd.shape[1], q_bhsd.shape[2]
    score_bytes = torch.finfo(acc_dtype(q_bhsd.dtype)).bits // 8
    rows = max(1, MASKED_CALL_BYTES // (score_bytes * b * h * lk))
    runs = [0, *getattr(allowed_qk, "row_breaks", ()), lq]
    return [(r, min(end, r + rows)) for start, end in zip(runs, runs[1:]) for r in range(start, end, rows)]


def _rows_mask(key_valid_bs, causal: bool, allowed_qk, r0: int, r1: int, c0: int, c1: int, device):
    """The bool mask [b or 1, 1, r1 - r0, c1 - c0] (True = attend) of block rows [r0, r1) and
    keys [c0, c1), or None when those rows see every one of those keys."""
    m = _rows_allowed(causal, allowed_qk, r0, r1, c1, device, c0)
    # [rows, keys] (positions alone) or [b or 1, h or 1, rows, keys] (a mask function: maskfn.FnMask)
    if m is not None and m.dim() == 2:
        m = m[None, None]
    if key_valid_bs is not None:
        kv = key_valid_bs[:, None, None, c0:c1]
        m = kv if m is None else m & kv
    return m


def _scores_(q_rows, k, scale: float, mask, mod: FnScore | None = None, keep_grad: bool = False):
    """[b, h, rows, Lk] scaled (and modified by the score function `mod`) scores in k's dtype,
    -inf where the mask hides the key; with keep_grad also the function's derivative at them
    (None without a function)."""
    s = torch.matmul(q_rows.to(k.dtype), k.transpose(-1, -2)).mul_(scale)
    der = None if mod is None else mod.apply_(s, keep_grad)
    s = s if mask is None else s.masked_fill_(mask.logical_not(), float("-inf"))
    return (s, der) if keep_grad else s


def _add_matmul_(acc, a, b) -> None:
    """acc += a @ b over the leading [b, h] dims, with no temporary of acc's size."""
    acc.view(-1, *acc.shape[-2:]).baddbmm_(a.reshape(-1, *a.shape[-2:]), b.reshape(-1, *b.shape[-2:]))


def _math_fwd(q_bhsd, k_bgsd, v_bgsd, scale: float, causal: bool, key_valid_bs=None, allowed_qk=None,
              mod: FnScore | None = None):
    """Exact (out, lse) of a block, computed in the accumulator dtype (Note [Masked rows]), its
    scores modified by the score function `mod`. Rows with no visible key: out = 0,
    lse = -inf."""
    dt, h, lk = acc_dtype(q_bhsd.dtype), q_bhsd.shape[1], k_bgsd.shape[2]
    k, v = _expand_kv(k_bgsd, h).to(dt), _expand_kv(v_bgsd, h).to(dt)
    out = q_bhsd.new_empty((*q_bhsd.shape[:3], v.shape[-1]))
    lse = torch.empty(q_bhsd.shape[:3], dtype=dt, device=q_bhsd.device)
    for r0, r1 in _row_chunks(q_bhsd, lk, allowed_qk):
        c0, c1 = _key_range(causal, allowed_qk, r0, r1, lk)
        if c0 == c1:  # no key visible to these rows
            out[:, :, r0:r1] = 0
            lse[:, :, r0:r1] = float("-inf")
            continue
        p = _scores_(q_bhsd[:, :, r0:r1], k[:, :, c0:c1], scale,
                     _rows_mask(key_valid_bs, causal, allowed_qk, r0, r1, c0, c1, k.device),
                     None if mod is None else mod.sub(r0, c0))
        top = p.amax(-1, keepdim=True)
        top.masked_fill_(torch.isneginf(top), 0.0)  # a row with no key: exp(-inf - 0) = 0 everywhere
        total = p.sub_(top).exp_().sum(-1, keepdim=True)
        lse[:, :, r0:r1] = (total.log() + top).squeeze(-1)  # log(0) = -inf for such a row
        out[:, :, r0:r1] = torch.matmul(p.div_(total.clamp_min_(torch.finfo(dt).tiny)), v[:, :, c0:c1])
        del p
    return out, lse


def _math_bwd(dout, q_bhsd, k_bgsd, v_bgsd, out, lse, scale: float, causal: bool, key_valid_bs=None,
              allowed_qk=None, mod: FnScore | None = None):
    """Exact (dq, dk, dv) of a block given its rows' global out and lse (as `bwd_lse` prepares
    it: +inf where a row saw no key); dK/dV summed over the row chunks in the accumulator dtype,
    returned in K/V's dtype with g heads (Note [Masked rows])."""
    dt, h, g, lk = acc_dtype(q_bhsd.dtype), q_bhsd.shape[1], k_bgsd.shape[1], k_bgsd.shape[2]
    k, v = _expand_kv(k_bgsd, h).to(dt), _expand_kv(v_bgsd, h).to(dt)
    dq = torch.empty_like(q_bhsd, memory_format=torch.contiguous_format)
    dk, dv = torch.zeros_like(k, memory_format=torch.contiguous_format), torch.zeros_like(v, memory_format=torch.contiguous_format)
    for r0, r1 in _row_chunks(q_bhsd, lk, allowed_qk):
        c0, c1 = _key_range(causal, allowed_qk, r0, r1, lk)
        if c0 == c1:  # no key visible to these rows: no gradient
            dq[:, :, r0:r1] = 0
            continue
        k_c, v_c = k[:, :, c0:c1], v[:, :, c0:c1]
        q_r, do_r = q_bhsd[:, :, r0:r1].to(dt), dout[:, :, r0:r1].to(dt)
        delta = (do_r * out[:, :, r0:r1].to(dt)).sum(-1, keepdim=True)
        p, der = _scores_(q_r, k_c, scale, _rows_mask(key_valid_bs, causal, allowed_qk, r0, r1, c0, c1, k.device),
                          None if mod is None else mod.sub(r0, c0), keep_grad=True)
        p.sub_(lse[:, :, r0:r1, None].to(dt)).exp_()
        _add_matmul_(dv[:, :, c0:c1], p.transpose(-1, -2), do_r)
        ds = torch.matmul(do_r, v_c.transpose(-1, -2)).sub_(delta).mul_(p)
        del p
        if der is not None:  # through the score function: dS times its derivative
            ds.mul_(der)
            del der
        ds.mul_(scale)
        dq[:, :, r0:r1] = torch.matmul(ds, k_c)
        _add_matmul_(dk[:, :, c0:c1], ds.transpose(-1, -2), q_r)
        del ds
    del k, v
    return dq, _reduce_kv_grad(dk, g).to(k_bgsd.dtype), _reduce_kv_grad(dv, g).to(v_bgsd.dtype)


def _masked_row_chunks(q_bhsd, lk: int, causal: bool, key_valid_bs, allowed_qk) -> list[tuple[int, int]] | None:
    """The CPU kernel's query-row chunks of a masked block (Note [Masked rows]): where its
    additive mask has rows (causal, windows) and one call would exceed MASKED_CALL_BYTES;
    None: one call."""
    if key_valid_bs is None and allowed_qk is None:
        return None  # no mask: the kernel's own causal flag
    if not causal and allowed_qk is None:
        return None  # a key mask alone broadcasts over the rows ([b, 1, 1, Lk])
    chunks = _row_chunks(q_bhsd, lk)  # its keys are not cut: position jumps do not matter
    return None if len(chunks) == 1 else chunks

# Note [Value head dim]
# A value head dim dv that differs from the query/key head dim d (MLA: DeepSeek-V3) changes
# nothing in the algorithm: scores and lse come from q.k, the output and dV have dv features.
# The exact math path takes it as it is. The fused kernels (aten's CPU flash op, the CUDA
# flash and cuDNN ops) and flex blocks get q, k and v padded with zero features to one width
# (the wider head dim, on CUDA rounded up to the multiple of 8 those kernels need), which is
# exact: zero features of q and k add nothing to a score (the scale is passed explicitly),
# and zero features of v, dO and O add nothing to O, to rowsum(dO * O) or to dP; the result is
# sliced back (`_padded_dv`).


def _padded_dv(q_bhsd, k_bgsd, v_bgsd):
    """(q, k, v) with zero features added to one common width: the wider of d (q, k) and dv (v),
    rounded up to a multiple of 8 on CUDA, whose fused kernels take no other head dims (Note
    [Value head dim])."""
    width = max(q_bhsd.shape[-1], v_bgsd.shape[-1])
    if q_bhsd.device.type == "cuda":
        width = -(-width // 8) * 8
    return tuple(_pad_to(t, width) for t in (q_bhsd, k_bgsd, v_bgsd))


def _pad_to(x, width: int):
    return x if x.shape[-1] == width else torch.nn.functional.pad(x, (0, width - x.shape[-1]))


def _fwd_padded(q_bhsd, k_bgsd, v_bgsd, **kw):
    out, lse = block_fwd(*_padded_dv(q_bhsd, k_bgsd, v_bgsd), **kw)
    dv = v_bgsd.shape[-1]
    return (out if out.shape[-1] == dv else out[..., :dv].contiguous()), lse


def _bwd_padded(dout_bhsd, q_bhsd, k_bgsd, v_bgsd, out_bhsd, lse, **kw):
    d, dv = q_bhsd.shape[-1], v_bgsd.shape[-1]
    q_p, k_p, v_p = _padded_dv(q_bhsd, k_bgsd, v_bgsd)
    width = q_p.shape[-1]
    dq, dk, dv_ = block_bwd(_pad_to(dout_bhsd, width), q_p, k_p, v_p, _pad_to(out_bhsd, width), lse,
                            lse_prepared=True, **kw)
    return tuple(g if g.shape[-1] == w else g[..., :w].contiguous() for g, w in ((dq, d), (dk, d), (dv_, dv)))


def block_fwd(q_bhsd, k_bgsd, v_bgsd, *, scale: float, causal: bool, key_valid_bs=None, allowed_qk=None,
              mod: FnScore | None = None):
    """allowed_qk: optional position mask (sliding windows), True = attend: bool [Lq, Lk], or
    an object whose rows(r0, r1) builds some of its rows (ring.WindowMask). mod: the block's
    score function (maskfn.FnScore), or None."""
    h, lq, lk = q_bhsd.shape[1], q_bhsd.shape[2], k_bgsd.shape[2]
    dev = q_bhsd.device
    if q_bhsd.shape[-1] != v_bgsd.shape[-1] and not _math_path(dev, q_bhsd.dtype, key_valid_bs, allowed_qk, mod):
        return _fwd_padded(q_bhsd, k_bgsd, v_bgsd, scale=scale, causal=causal, key_valid_bs=key_valid_bs,
                           allowed_qk=allowed_qk, mod=mod)
    if _flex_path(dev, q_bhsd.dtype, key_valid_bs, allowed_qk, mod):
        from . import flex

        res = _try_flex(lambda: flex.fwd(q_bhsd, k_bgsd, v_bgsd, scale, causal, key_valid_bs, allowed_qk, mod),
                        q_bhsd)
        if res is not None:
            return res
    if _math_path(dev, q_bhsd.dtype, key_valid_bs, allowed_qk, mod):
        return _math_fwd(q_bhsd, k_bgsd, v_bgsd, scale, causal, key_valid_bs, allowed_qk, mod)
    if dev.type == "cuda" and _cuda_kernel() == "cudnn":
        res = _cudnn_call(_compat.cuda_cudnn_fwd, q_bhsd, k_bgsd, v_bgsd, None, True, 0.0, causal, False, scale=scale)
        return res[0], res[1].reshape(res[1].shape[0], res[1].shape[1], -1).to(acc_dtype(q_bhsd.dtype))
    k, v = _expand_kv(k_bgsd, h), _expand_kv(v_bgsd, h)
    if dev.type == "cuda":
        res = _compat.cuda_flash_fwd(q_bhsd, k, v, 0.0, causal, False, scale=scale)
        return res[0], res[1].to(acc_dtype(q_bhsd.dtype))
    chunks = _masked_row_chunks(q_bhsd, lk, causal, key_valid_bs, allowed_qk)
    if chunks is not None:
        parts = [block_fwd(q_bhsd[:, :, r0:r1], k, v, scale=scale, causal=False, key_valid_bs=key_valid_bs,
                           allowed_qk=_rows_allowed(causal, allowed_qk, r0, r1, lk, dev)) for r0, r1 in chunks]
        return torch.cat([o for o, _ in parts], 2), torch.cat([lse for _, lse in parts], 2)
    mask = _mask(key_valid_bs, causal, lq, lk, dev, allowed_qk)
    out, lse = _compat.cpu_flash_fwd(
        q_bhsd, k, v, 0.0, causal and mask is None,
        attn_mask=None if mask is None else _additive(mask, q_bhsd.dtype), scale=scale,
    )
    lse = lse.to(acc_dtype(q_bhsd.dtype))
    # A query row with a NaN has only NaN scores, which the CPU kernel may take for a row with
    # no key (out = 0, lse = 0, depending on the sizes): NaN in, NaN out, as the math gives, and
    # the merge carries it (a row that sees no key keeps out = 0, lse = -inf below).
    nan_rows = q_bhsd.isnan().any(-1)
    if nan_rows.any():
        out = out.masked_fill(nan_rows[..., None], float("nan"))
        lse = lse.masked_fill(nan_rows, float("nan"))
    if mask is not None:
        # Rows with no visible key: the kernel returns lse = 0 there; the contract is -inf.
        valid = mask.any(-1)  # [b or 1, 1, Lq]
        lse = lse.masked_fill(~valid, float("-inf"))
        out = out.masked_fill(~valid[..., None], 0.0)
    return out, lse


def bwd_lse(lse_bhs: torch.Tensor) -> torch.Tensor:
    """The row lse as the backward kernels take it: rows that saw no key anywhere (lse = -inf)
    have no gradient, and +inf makes their P = 0; fp32 (fp64 stays), contiguous. A ring
    prepares it once for all its block calls (`block_bwd(..., lse_prepared=True)`)."""
    lse = lse_bhs if lse_bhs.dtype == torch.float64 else lse_bhs.float()
    # one pass: -inf (and +inf) to +inf, NaN (a row with a NaN query) and finite values kept
    return lse.nan_to_num(nan=math.nan, posinf=math.inf, neginf=math.inf).contiguous()


_ZERO_SEED: dict = {}


def _zero_seed(device) -> torch.Tensor:
    """0-d int64 seed/offset for the CUDA backward ops (unused at dropout 0; read-only, so one
    per device serves every call instead of a fresh tensor and a fill per call)."""
    t = _ZERO_SEED.get(device)
    if t is None:
        t = _ZERO_SEED[device] = torch.zeros((), dtype=torch.long, device=device)
    return t


def block_bwd(dout_bhsd, q_bhsd, k_bgsd, v_bgsd, out_bhsd, lse_bhs, *, scale: float, causal: bool,
              key_valid_bs=None, allowed_qk=None, lse_prepared: bool = False, mod: FnScore | None = None):
    """Gradients of this block given the row's global (out, lse); dk/dv with g heads.
    lse_prepared: lse_bhs is already `bwd_lse(...)` (rows of it). mod: as in block_fwd."""
    h, g, lq, lk = q_bhsd.shape[1], k_bgsd.shape[1], q_bhsd.shape[2], k_bgsd.shape[2]
    lse = lse_bhs if lse_prepared else bwd_lse(lse_bhs)
    dev = q_bhsd.device
    if q_bhsd.shape[-1] != v_bgsd.shape[-1] and not _math_path(dev, q_bhsd.dtype, key_valid_bs, allowed_qk, mod):
        return _bwd_padded(dout_bhsd, q_bhsd, k_bgsd, v_bgsd, out_bhsd, lse, scale=scale, causal=causal,
                           key_valid_bs=key_valid_bs, allowed_qk=allowed_qk, mod=mod)
    if _flex_path(dev, q_bhsd.dtype, key_valid_bs, allowed_qk, mod):
        from . import flex

        res = _try_flex(lambda: flex.bwd(dout_bhsd, q_bhsd, k_bgsd, v_bgsd, out_bhsd, lse, scale, causal,
                                         key_valid_bs, allowed_qk, mod), q_bhsd)
        if res is not None:
            return res
    if _math_path(dev, q_bhsd.dtype, key_valid_bs, allowed_qk, mod):
        return _math_bwd(dout_bhsd, q_bhsd, k_bgsd, v_bgsd, out_bhsd, lse, scale, causal, key_valid_bs, allowed_qk,
                         mod)
    if dev.type == "cuda" and _cuda_kernel() == "cudnn":
        # Undefined (None) bias / cumulative lengths; 0-d seed and offset, unused at dropout 0.
        seed = _zero_seed(dev)
        dq, dk, dv = _cudnn_call(
            lambda q_, k_, v_: _compat.cuda_cudnn_bwd(
                dout_bhsd, q_, k_, v_, out_bhsd, lse.float().unsqueeze(-1).contiguous(),
                seed, seed, None, None, None, lq, lk, 0.0, causal, scale=scale),
            q_bhsd, k_bgsd, v_bgsd)
        return dq, _reduce_kv_grad(dk, g), _reduce_kv_grad(dv, g)  # a no-op when cuDNN took g heads
    k, v = _expand_kv(k_bgsd, h), _expand_kv(v_bgsd, h)
    if dev.type == "cuda":
        seed = _zero_seed(dev)
        dq, dk, dv = _compat.cuda_flash_bwd(
            dout_bhsd, q_bhsd, k, v, out_bhsd, lse.float().contiguous(), None, None, lq, lk, 0.0, causal,
            seed, seed, scale=scale,
        )
        return dq, _reduce_kv_grad(dk, g), _reduce_kv_grad(dv, g)
    chunks = _masked_row_chunks(q_bhsd, lk, causal, key_valid_bs, allowed_qk)
    if chunks is not None:
        dqs, dk, dv = [], None, None
        for r0, r1 in chunks:
            dq_c, dk_c, dv_c = block_bwd(
                dout_bhsd[:, :, r0:r1], q_bhsd[:, :, r0:r1], k, v, out_bhsd[:, :, r0:r1], lse[:, :, r0:r1],
                scale=scale, causal=False, key_valid_bs=key_valid_bs,
                allowed_qk=_rows_allowed(causal, allowed_qk, r0, r1, lk, dev), lse_prepared=True)
            dqs.append(dq_c)
            # dK/dV (h heads here) sum over the row chunks in the accumulator dtype
            dk = dk_c.to(acc_dtype(dk_c.dtype)) if dk is None else dk.add_(dk_c)
            dv = dv_c.to(acc_dtype(dv_c.dtype)) if dv is None else dv.add_(dv_c)
        return torch.cat(dqs, 2), _reduce_kv_grad(dk, g).to(k_bgsd.dtype), _reduce_kv_grad(dv, g).to(v_bgsd.dtype)
    mask = _mask(key_valid_bs, causal, lq, lk, dev, allowed_qk)
    dq, dk, dv = _compat.cpu_flash_bwd(
        dout_bhsd, q_bhsd, k, v, out_bhsd, lse.to(q_bhsd.dtype if q_bhsd.dtype == torch.float64 else torch.float32),
        0.0, causal and mask is None, attn_mask=None if mask is None else _additive(mask, q_bhsd.dtype), scale=scale,
    )
    return dq, _reduce_kv_grad(dk, g), _reduce_kv_grad(dv, g)
