"""Sequence layouts: which global chunks each rank holds.

contiguous: the sequence is cut into p chunks; rank r holds chunk r.
zigzag:     the sequence is cut into 2p chunks; rank r holds chunks r and 2p-1-r, which
            balances causal work (every rank gets one early and one late chunk).

A rank's local sequence is the concatenation of its chunks in the order listed by
`local_chunks`; every chunk has the same length, `n_local / chunks_per_rank`.
"""

from __future__ import annotations

import enum

import torch


class Layout(str, enum.Enum):
    CONTIGUOUS = "contiguous"
    ZIGZAG = "zigzag"


def parse_layout(layout) -> Layout:
    try:
        return Layout(layout)
    except ValueError:
        raise ValueError(
            f"layout={layout!r} is not supported; allowed: {[m.value for m in Layout]}"
        ) from None


def chunks_per_rank(layout: Layout) -> int:
    # compared as strings (Layout is a str enum): dynamo in torch 2.11 cannot trace Layout(...)
    return 2 if layout == Layout.ZIGZAG else 1


def local_chunks(rank: int, world: int, layout: Layout) -> tuple[int, ...]:
    if layout == Layout.ZIGZAG:
        return (rank, 2 * world - 1 - rank)
    return (rank,)


def divisor(world: int, layout: Layout) -> int:
    """The global length must be a multiple of this."""
    return world * chunks_per_rank(layout)


class SequenceLengthError(ValueError):
    """A sequence length the layout does not divide: an error in what the user gave (the CLIs
    report it as one, exit 2), not in ringcc."""


def check_length(n: int, world: int, layout: Layout, what: str = "sequence length",
                 remedy: str = "pad the sequence to a multiple of {div} (masking the padded keys)") -> None:
    """Raises SequenceLengthError unless the layout divides n (p, or 2p for zigzag); `remedy`
    (with {div}) says how to pad where the caller can."""
    div = divisor(world, layout)
    if n % div:
        raise SequenceLengthError(
            f"{what} {n} is not divisible by {div} (world size {world}, layout "
            f"{Layout(layout).value!r}); use a length that is a multiple of {div}, or "
            + remedy.format(div=div)
        )


def shard(x: torch.Tensor, dim: int, rank: int, world: int, layout: Layout) -> torch.Tensor:
    """This rank's shard of a full-length tensor (a copy, contiguous)."""
    n = x.shape[dim]
    check_length(n, world, layout)
    pieces = x.chunk(divisor(world, layout), dim=dim)
    return torch.cat([pieces[c] for c in local_chunks(rank, world, layout)], dim=dim)


def unshard(shards: list[torch.Tensor], dim: int, layout: Layout) -> torch.Tensor:
    """Full-length tensor from every rank's shard (the inverse of `shard`)."""
    world = len(shards)
    per = chunks_per_rank(layout)
    ordered: list[torch.Tensor | None] = [None] * (world * per)
    for rank, s in enumerate(shards):
        for piece, c in zip(s.chunk(per, dim=dim), local_chunks(rank, world, layout)):
            ordered[c] = piece
    return torch.cat(ordered, dim=dim)


def global_positions(rank: int, world: int, layout: Layout, n_local: int, device=None) -> torch.Tensor:
    """Global token positions of this rank's local sequence, shape [n_local]."""
    return chunk_positions(local_chunks(rank, world, layout), n_local // chunks_per_rank(layout), device)


def chunk_positions(chunks, chunk_len: int, device=None) -> torch.Tensor:
    """Global positions of the rows of global chunks `chunks` of `chunk_len` tokens, in that order."""
    return torch.cat([torch.arange(c * chunk_len, (c + 1) * chunk_len, device=device) for c in chunks])
