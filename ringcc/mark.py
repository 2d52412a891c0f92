"""`ringcc.mark_sequence(x, dim)`: say which dim of an input is the sequence.

Needed only when discovery is ambiguous (a batch or head dim equal to the sequence length
with constant sizes). Like torch._dynamo.mark_dynamic, it tags the tensor; the backend reads
the tag from the example inputs dynamo hands it.
"""

from __future__ import annotations

import torch

_ATTR = "_ringcc_seq_dim"


def mark_sequence(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Mark `dim` of input `x` as the sequence dim; returns `x`."""
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"mark_sequence expects a tensor; got {type(x).__name__}")
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"mark_sequence: dim {dim} is out of range for a tensor of shape {tuple(x.shape)}")
    from ringcc.sharded import SequenceSharded

    if isinstance(x, SequenceSharded):  # another graph's sharded output knows its sequence dim
        if dim % x.dim() != x.seq_dim:
            raise ValueError(f"mark_sequence: dim {dim} is not the sequence dim {x.seq_dim} of this "
                             "SequenceSharded output (Note [Sharded outputs])")
        return x
    setattr(x, _ATTR, dim % x.dim())
    return x


def marked_dim(x) -> int | None:
    return getattr(x, _ATTR, None) if isinstance(x, torch.Tensor) else None
