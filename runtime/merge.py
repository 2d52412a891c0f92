"""The one log-sum-exp merge every attention path uses.

Legend: out_* are [..., L, d], lse_* are [..., L]; lse is natural-log, in the accumulator
dtype (fp32, or fp64 for fp64 inputs). A row that has seen no unmasked key so far has
lse = -inf and out = 0, and stays NaN-free through any number of merges.
"""

from __future__ import annotations

import warnings

import torch


def _merge_into(out_acc, lse_acc, out_blk, lse_blk) -> None:
    lse_new = torch.logaddexp(lse_acc, lse_blk)
    # Where both are -inf the row is still empty; use 0 as the reference so weights are 0.
    ref = torch.where(torch.isneginf(lse_new), torch.zeros_like(lse_new), lse_new)
    w_acc = torch.exp(lse_acc - ref).unsqueeze(-1)
    w_blk = torch.exp(lse_blk - ref).unsqueeze(-1)
    out_acc.copy_(out_acc * w_acc + out_blk.to(out_acc.dtype) * w_blk)
    lse_acc.copy_(lse_new)


_fused_merge = None


def merge_(out_acc: torch.Tensor, lse_acc: torch.Tensor, out_blk: torch.Tensor, lse_blk: torch.Tensor) -> None:
    """In place: (out_acc, lse_acc) <- softmax-weighted union of itself and the block.

    On CUDA the merge is one inductor-generated kernel (eager it takes ~6 passes over the
    fp32 accumulator, which shows at 16K tokens per GPU); elsewhere it runs eagerly.
    """
    global _fused_merge
    if out_acc.is_cuda and _fused_merge is not False:
        if _fused_merge is None:
            _fused_merge = torch.compile(_merge_into, fullgraph=True)
        try:
            _fused_merge(out_acc, lse_acc, out_blk, lse_blk)
            return
        except Exception as e:  # noqa: BLE001 - compilation failed (e.g. recompile limit): stay eager
            warnings.warn(f"ringcc: fused LSE merge unavailable ({type(e).__name__}: {e}); using the eager merge")
            _fused_merge = False
    _merge_into(out_acc, lse_acc, out_blk, lse_blk)


def merge(outs: list[torch.Tensor], lses: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Differentiable merge of several partial results (used where gradients flow through
    the mixing weights, e.g. dilated branches)."""
    lse_all = torch.stack(lses)  # [k, ..., L]
    lse = torch.logsumexp(lse_all, dim=0)
    ref = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
    w = torch.exp(lse_all - ref).unsqueeze(-1)
    out = (torch.stack(outs).to(w.dtype) * w).sum(0)
    return out, lse
