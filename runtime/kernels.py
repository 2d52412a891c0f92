"""Per-block attention kernels that return (out, lse), and their backward.

Legend: q_bhsd [b, h, Lq, d]; k_bgsd / v_bgsd [b, g, Lk, d] with h % g == 0 (GQA/MQA);
key_valid_bs [b, Lk] bool (True = key may be attended). lse is natural-log, [b, h, Lq],
in the accumulator dtype (fp32; fp64 for fp64 inputs).

A block is either unmasked, causal on its diagonal (square, top-left aligned: the query and
key chunks are the same global chunk), optionally key-padded, and optionally restricted by a
position mask (sliding windows). Rows with no valid key
give out = 0, lse = -inf. The backward takes the *global* (out, lse) of the row, as
flash-attention's backward expects, which yields this block's exact share of the gradient.

Kernel choice: CPU -> aten's CPU flash op (takes masks). CUDA -> cuDNN (default) or flash
SDPA ops for unmasked / causal blocks; masked blocks on CUDA use the exact math path.
`RINGCC_CUDA_KERNEL=flash|cudnn` overrides the CUDA choice.

GQA: the cuDNN ops take K/V with their own g heads and return dK/dV with g heads (the group
sum done inside the kernel), so no expanded K/V and no separate reduction there; every other
path expands K/V to h heads and sums the gradients back. A cuDNN build that rejects g != h
(found once per device by a tiny probe) gets the expanded form, with a warning;
RINGCC_CUDNN_NATIVE_GQA=0 forces the expanded form.
"""

from __future__ import annotations

import os
import warnings

import torch

from ringcc import _compat


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _expand_kv(k_bgsd: torch.Tensor, h: int) -> torch.Tensor:
    g = k_bgsd.shape[1]
    return k_bgsd if g == h else k_bgsd.repeat_interleave(h // g, dim=1)


def _reduce_kv_grad(dk_bhsd: torch.Tensor, g: int) -> torch.Tensor:
    """The g-head K/V gradient of an h-head one (summed over each group); as is when it has g."""
    b, h, s, d = dk_bhsd.shape
    return dk_bhsd if g == h else dk_bhsd.view(b, g, h // g, s, d).sum(2)


def _bool_mask(key_valid_bs: torch.Tensor | None, causal: bool, lq: int, lk: int, device) -> torch.Tensor:
    """[b or 1, 1, Lq, Lk] bool mask, True = attend."""
    m = torch.ones(1, 1, 1, lk, dtype=torch.bool, device=device)
    if key_valid_bs is not None:
        m = key_valid_bs[:, None, None, :]
    if causal:
        m = m & _causal_band(0, lq, lk, device)[None, None]
    return m


def _causal_band(r0: int, r1: int, lk: int, device) -> torch.Tensor:
    """Rows [r0, r1) of the top-left causal mask [Lq, Lk] (key j visible to row i iff j <= i)."""
    return torch.arange(lk, device=device)[None, :] <= torch.arange(r0, r1, device=device)[:, None]


FUSED_CUDA_DTYPES = (torch.float16, torch.bfloat16)  # what the CUDA flash and cuDNN kernels take


def _math_only(device, dtype) -> bool:
    """Blocks on CUDA in a dtype the fused kernels do not take (fp32, fp64): the math path."""
    return device.type == "cuda" and dtype is not None and dtype not in FUSED_CUDA_DTYPES


def _allowed_rows(allowed_qk, r0: int, r1: int) -> torch.Tensor:
    """Rows [r0, r1) of a position mask: a bool [Lq, Lk] tensor, or an object that builds its
    rows on demand (ring.WindowMask)."""
    return allowed_qk[r0:r1] if isinstance(allowed_qk, torch.Tensor) else allowed_qk.rows(r0, r1)


def _mask(key_valid_bs, causal: bool, lq: int, lk: int, device, allowed_qk=None, dtype=None):
    """The block's combined bool mask [b or 1, 1, Lq, Lk] (True = attend), or None when the
    block needs none (unmasked, or a plain causal diagonal that the kernels do themselves).
    On CUDA a dtype the fused kernels do not take (fp32, fp64) always gets one: such blocks
    run the math path (exact, in that dtype; it holds the block's scores)."""
    if key_valid_bs is None and allowed_qk is None and not _math_only(device, dtype):
        return None
    m = _bool_mask(key_valid_bs, causal, lq, lk, device)
    return m if allowed_qk is None else m & _allowed_rows(allowed_qk, 0, lq)[None, None]


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


def _math_fwd(q, k, v, scale, mask):
    s = torch.matmul(q.to(acc_dtype(q.dtype)), k.to(acc_dtype(q.dtype)).transpose(-1, -2)) * scale
    s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    ref = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
    p = torch.exp(s - ref.unsqueeze(-1))
    return torch.matmul(p, v.to(p.dtype)).to(q.dtype), lse


def _math_bwd(dout, q, k, v, out, lse, scale, mask):
    dt = acc_dtype(q.dtype)
    qf, kf, vf, dof = q.to(dt), k.to(dt), v.to(dt), dout.to(dt)
    s = torch.matmul(qf, kf.transpose(-1, -2)) * scale
    s = s.masked_fill(~mask, float("-inf"))
    p = torch.exp(s - lse.unsqueeze(-1))
    dv = torch.matmul(p.transpose(-1, -2), dof)
    dp = torch.matmul(dof, vf.transpose(-1, -2))
    delta = (dof * out.to(dt)).sum(-1, keepdim=True)
    ds = p * (dp - delta) * scale
    # dK/dV in K/V's dtype: q's, or the accumulator's when a row-chunked call passes fp32 K/V
    return torch.matmul(ds, kf).to(q.dtype), torch.matmul(ds.transpose(-1, -2), qf).to(k.dtype), dv.to(v.dtype)


MASKED_CALL_BYTES = 256 * 2**20  # fp32 [b, h, rows, Lk] of one masked kernel call (Note [Masked rows])


def _masked_row_chunks(q_bhsd, lk: int, causal: bool, key_valid_bs, allowed_qk) -> list[tuple[int, int]] | None:
    """Note [Masked rows]: a masked block's kernels hold [rows, Lk] per head: the math path
    (CUDA) its fp32 scores, probabilities and their gradient; the CPU kernel an additive fp32
    mask [b, 1, rows, Lk] (where the mask has rows: causal, windows). Over the whole block that
    is O(Lq * Lk), quadratic in the shard (16 GiB of scores at 16K rows, 16 heads): so a masked
    call runs over chunks of query rows of at most MASKED_CALL_BYTES each, which keeps it
    O(n/p) (rows are independent in forward; dK/dV sum over them in backward); the planner
    counts these calls' bytes (workspace.masked_calls). None: one call."""
    dev = q_bhsd.device
    if key_valid_bs is None and allowed_qk is None and not _math_only(dev, q_bhsd.dtype):
        return None  # no mask: the fused kernels
    if dev.type != "cuda" and not causal and allowed_qk is None:
        return None  # a key mask alone broadcasts over the rows ([b, 1, 1, Lk])
    b, h, lq = q_bhsd.shape[0], q_bhsd.shape[1], q_bhsd.shape[2]
    score_bytes = torch.finfo(acc_dtype(q_bhsd.dtype)).bits // 8
    rows = max(1, MASKED_CALL_BYTES // (score_bytes * b * h * lk))
    return None if rows >= lq else [(r, min(lq, r + rows)) for r in range(0, lq, rows)]


def _chunk_kv(q_bhsd, k_bgsd, v_bgsd):
    """K/V for every row chunk of a block, prepared once: expanded to q's heads (GQA) and, for
    the CUDA math path, in the accumulator dtype, so that no chunk repeats the work and dK/dV
    come back unrounded."""
    h = q_bhsd.shape[1]
    k, v = _expand_kv(k_bgsd, h), _expand_kv(v_bgsd, h)
    if q_bhsd.device.type == "cuda":
        k, v = k.to(acc_dtype(q_bhsd.dtype)), v.to(acc_dtype(q_bhsd.dtype))
    return k, v


def _rows_allowed(causal: bool, allowed_qk, r0: int, r1: int, lk: int, dev):
    """The position mask of block rows [r0, r1): the top-left causal band and/or the given
    [Lq, Lk] mask's rows; None when neither."""
    m = None if allowed_qk is None else _allowed_rows(allowed_qk, r0, r1)
    if causal:
        band = _causal_band(r0, r1, lk, dev)
        m = band if m is None else m & band
    return m


def block_fwd(q_bhsd, k_bgsd, v_bgsd, *, scale: float, causal: bool, key_valid_bs=None, allowed_qk=None):
    """allowed_qk: optional position mask (sliding windows), True = attend: bool [Lq, Lk], or
    an object whose rows(r0, r1) builds some of its rows (ring.WindowMask)."""
    h, lq, lk = q_bhsd.shape[1], q_bhsd.shape[2], k_bgsd.shape[2]
    dev = q_bhsd.device
    chunks = _masked_row_chunks(q_bhsd, lk, causal, key_valid_bs, allowed_qk)
    if chunks is not None:
        k, v = _chunk_kv(q_bhsd, k_bgsd, v_bgsd)
        parts = [block_fwd(q_bhsd[:, :, r0:r1], k, v, scale=scale, causal=False, key_valid_bs=key_valid_bs,
                           allowed_qk=_rows_allowed(causal, allowed_qk, r0, r1, lk, dev)) for r0, r1 in chunks]
        return torch.cat([o for o, _ in parts], 2), torch.cat([lse for _, lse in parts], 2)
    mask = _mask(key_valid_bs, causal, lq, lk, dev, allowed_qk, q_bhsd.dtype)
    if dev.type == "cuda" and mask is None and _cuda_kernel() == "cudnn":
        res = _cudnn_call(_compat.cuda_cudnn_fwd, q_bhsd, k_bgsd, v_bgsd, None, True, 0.0, causal, False, scale=scale)
        return res[0], res[1].reshape(res[1].shape[0], res[1].shape[1], -1).to(acc_dtype(q_bhsd.dtype))
    k, v = _expand_kv(k_bgsd, h), _expand_kv(v_bgsd, h)
    if dev.type == "cpu":
        out, lse = _compat.cpu_flash_fwd(
            q_bhsd, k, v, 0.0, causal and mask is None,
            attn_mask=None if mask is None else _additive(mask, q_bhsd.dtype), scale=scale,
        )
    elif mask is not None:
        out, lse = _math_fwd(q_bhsd, k, v, scale, mask)
    else:
        res = _compat.cuda_flash_fwd(q_bhsd, k, v, 0.0, causal, False, scale=scale)
        out, lse = res[0], res[1]
    lse = lse.to(acc_dtype(q_bhsd.dtype))
    if mask is not None:
        # Rows with no visible key: the kernels return lse = 0 there; the contract is -inf.
        valid = mask.any(-1)  # [b or 1, 1, Lq]
        lse = lse.masked_fill(~valid, float("-inf"))
        out = out.masked_fill(~valid[..., None], 0.0)
    return out, lse


def bwd_lse(lse_bhs: torch.Tensor) -> torch.Tensor:
    """The row lse as the backward kernels take it: rows that saw no key anywhere (lse = -inf)
    have no gradient, and +inf makes their P = 0; fp32 (fp64 stays), contiguous. A ring
    prepares it once for all its block calls (`block_bwd(..., lse_prepared=True)`)."""
    lse = lse_bhs if lse_bhs.dtype == torch.float64 else lse_bhs.float()
    return lse.masked_fill(torch.isneginf(lse), float("inf")).contiguous()


_ZERO_SEED: dict = {}


def _zero_seed(device) -> torch.Tensor:
    """0-d int64 seed/offset for the CUDA backward ops (unused at dropout 0; read-only, so one
    per device serves every call instead of a fresh tensor and a fill per call)."""
    t = _ZERO_SEED.get(device)
    if t is None:
        t = _ZERO_SEED[device] = torch.zeros((), dtype=torch.long, device=device)
    return t


def block_bwd(dout_bhsd, q_bhsd, k_bgsd, v_bgsd, out_bhsd, lse_bhs, *, scale: float, causal: bool,
              key_valid_bs=None, allowed_qk=None, lse_prepared: bool = False):
    """Gradients of this block given the row's global (out, lse); dk/dv with g heads.
    lse_prepared: lse_bhs is already `bwd_lse(...)` (rows of it)."""
    h, g, lq, lk = q_bhsd.shape[1], k_bgsd.shape[1], q_bhsd.shape[2], k_bgsd.shape[2]
    lse = lse_bhs if lse_prepared else bwd_lse(lse_bhs)
    dev = q_bhsd.device
    chunks = _masked_row_chunks(q_bhsd, lk, causal, key_valid_bs, allowed_qk)
    if chunks is not None:
        k, v = _chunk_kv(q_bhsd, k_bgsd, v_bgsd)
        dqs, dk, dv = [], None, None
        for r0, r1 in chunks:
            dq_c, dk_c, dv_c = block_bwd(
                dout_bhsd[:, :, r0:r1], q_bhsd[:, :, r0:r1], k, v, out_bhsd[:, :, r0:r1], lse[:, :, r0:r1],
                scale=scale, causal=False, key_valid_bs=key_valid_bs,
                allowed_qk=_rows_allowed(causal, allowed_qk, r0, r1, lk, dev), lse_prepared=True)
            dqs.append(dq_c)
            # dK/dV sum over the row chunks in the accumulator dtype (fp32 from the math path)
            dk = dk_c.to(acc_dtype(dk_c.dtype)) if dk is None else dk.add_(dk_c)
            dv = dv_c.to(acc_dtype(dv_c.dtype)) if dv is None else dv.add_(dv_c)
        return torch.cat(dqs, 2), _reduce_kv_grad(dk, g).to(k_bgsd.dtype), _reduce_kv_grad(dv, g).to(v_bgsd.dtype)
    mask = _mask(key_valid_bs, causal, lq, lk, dev, allowed_qk, q_bhsd.dtype)
    if dev.type == "cuda" and mask is None and _cuda_kernel() == "cudnn":
        # Undefined (None) bias / cumulative lengths; 0-d seed and offset, unused at dropout 0.
        seed = _zero_seed(dev)
        dq, dk, dv = _cudnn_call(
            lambda q_, k_, v_: _compat.cuda_cudnn_bwd(
                dout_bhsd, q_, k_, v_, out_bhsd, lse.float().unsqueeze(-1).contiguous(),
                seed, seed, None, None, None, lq, lk, 0.0, causal, scale=scale),
            q_bhsd, k_bgsd, v_bgsd)
        return dq, _reduce_kv_grad(dk, g), _reduce_kv_grad(dv, g)  # a no-op when cuDNN took g heads
    k, v = _expand_kv(k_bgsd, h), _expand_kv(v_bgsd, h)
    if dev.type == "cpu":
        dq, dk, dv = _compat.cpu_flash_bwd(
            dout_bhsd, q_bhsd, k, v, out_bhsd, lse.to(q_bhsd.dtype if q_bhsd.dtype == torch.float64 else torch.float32),
            0.0, causal and mask is None, attn_mask=None if mask is None else _additive(mask, q_bhsd.dtype), scale=scale,
        )
    elif mask is not None:
        dq, dk, dv = _math_bwd(dout_bhsd, q_bhsd, k, v, out_bhsd, lse, scale, mask)
    else:
        seed = _zero_seed(dev)
        dq, dk, dv = _compat.cuda_flash_bwd(
            dout_bhsd, q_bhsd, k, v, out_bhsd, lse.float().contiguous(), None, None, lq, lk, 0.0, causal,
            seed, seed, scale=scale,
        )
    return dq, _reduce_kv_grad(dk, g), _reduce_kv_grad(dv, g)
