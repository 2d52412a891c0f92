"""Dense references (O(n^2), for tests): exact attention returning (out, lse).

key_padding_mask: bool [b, n], True = padding key (ignored), as in nn.MultiheadAttention.
Rows with no visible key give out = 0 and lse = -inf.
"""

from __future__ import annotations

import math

import torch


def masked_attention(q, k, v, allowed, *, scale=None, softcap=None, alibi_slopes=None):
    """q [b,h,n,d], k/v [b,g,n_k,d]; allowed: bool broadcastable to [b,h,n,n_k]. Scores modified
    before the mask (Note [Score functions] in runtime/maskfn.py): softcap c -> c * tanh(s / c);
    alibi_slopes [h] -> + slope[h] * (j - i)."""
    h, g = q.shape[1], k.shape[1]
    if g != h:
        k = k.repeat_interleave(h // g, dim=1)
        v = v.repeat_interleave(h // g, dim=1)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if softcap:
        s = torch.tanh(s / softcap) * softcap
    if alibi_slopes is not None:
        i, j = torch.arange(q.shape[2], device=q.device), torch.arange(k.shape[2], device=q.device)
        s = s + alibi_slopes.to(s.dtype)[:, None, None] * (j[None, :] - i[:, None]).to(s.dtype)
    s = s.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    safe = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
    p = torch.exp(s - safe.unsqueeze(-1))
    return torch.matmul(p, v), lse


def attention(q, k, v, *, is_causal=False, scale=None, key_padding_mask=None, window=None, softcap=None,
              alibi_slopes=None):
    """window: key j visible to query i iff |i - j| < window (i - j < window when causal);
    softcap, alibi_slopes: as in masked_attention."""
    n, n_k = q.shape[2], k.shape[2]
    allowed = torch.ones(n, n_k, dtype=torch.bool, device=q.device)
    if is_causal:
        allowed = allowed.tril()
    if window is not None:
        i = torch.arange(n, device=q.device)
        diff = i[:, None] - torch.arange(n_k, device=q.device)[None, :]
        allowed = allowed & (diff.abs() < window)
    allowed = allowed[None, None]
    if key_padding_mask is not None:
        allowed = allowed & ~key_padding_mask[:, None, None, :]
    return masked_attention(q, k, v, allowed, scale=scale, softcap=softcap, alibi_slopes=alibi_slopes)


def dilated_attention(q, k, v, spec, *, is_causal=False, scale=None):
    """LongNet dilated attention, densely: per branch the [h, n, n] mask of the rule, then one
    softmax over the union of the branch key sets (LSE merge). See runtime/dilated.py."""
    from ringcc.runtime.dilated import branch_heads
    from ringcc.runtime.merge import merge

    h, n = q.shape[1], q.shape[2]
    t = torch.arange(n, device=q.device)
    outs, lses = [], []
    for (w, r), pairs in zip(spec.branches, branch_heads(spec, h)):
        w = min(w, n)
        offset = torch.full((h,), -1, dtype=torch.long, device=q.device)  # -1: head not in branch
        for head, off in pairs:
            offset[head] = off
        active = ((t % w) % r)[None, :] == offset[:, None]  # [h, n]
        allowed = active[:, :, None] & active[:, None, :] & ((t // w)[:, None] == (t // w)[None, :])
        if is_causal:
            allowed = allowed & (t[None, :] <= t[:, None])
        o, lse = masked_attention(q, k, v, allowed[None], scale=scale)
        outs.append(o)
        lses.append(lse)
    return merge(outs, lses)
