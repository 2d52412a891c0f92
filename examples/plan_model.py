"""Models to inspect with `ringcc plan`; each factory returns (model, example_inputs[, options]).

    ringcc plan examples/plan_model.py:exact_ring --seq-len 131072 --world-size 8 --budget 80GiB
    ringcc plan examples/plan_model.py:dilated --seq-len 1048576 --world-size 8
    ringcc plan examples/plan_model.py:full_logits --seq-len 131072 --world-size 8 --json out/plan.json

exact_ring: a small causal LM trained on its loss: every activation is sharded and attention
is exact ring attention, so the peak per rank is O(n/p).
dilated: the same LM with LongNet dilated attention (the options' `dilation` spec).
(Vocabularies are not powers of two so that no model dim equals a traced length: the
dilated example is traced with constant shapes, where such a dim would be read as n.)
full_logits: the same LM returning its logits: ringcc gathers outputs to full length, so
every rank holds [b, n, vocab] - the planner names that gather as the culprit.
contiguous_view: the LM with nanoGPT's `y.transpose(1, 2).contiguous().view(b, s, dim)` after
attention (torch.export leaves the `.contiguous()` out when it is a no-op on SDPA's result).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ringcc.runtime.dilated import DilatedSpec


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, contiguous_view: bool = False):
        super().__init__()
        self.heads, self.contiguous_view = heads, contiguous_view
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.norm2 = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim, bias=False)
        self.down = nn.Linear(4 * dim, dim, bias=False)

    def forward(self, x):
        b, s, dim = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, dim // self.heads).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        a = a.transpose(1, 2).contiguous().view(b, s, dim) if self.contiguous_view else a.transpose(1, 2).reshape(b, s, dim)
        x = x + self.proj(a)
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 1000, dim: int = 64, heads: int = 4, layers: int = 2, return_logits: bool = False,
                 contiguous_view: bool = False):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, contiguous_view) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.return_logits = return_logits

    def forward(self, tokens, labels):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))
        if self.return_logits:
            return logits
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def _inputs(seq_len: int, vocab: int, batch: int = 2):
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(vocab, (batch, seq_len), generator=g)
    return tokens, torch.roll(tokens, -1, dims=1)


def exact_ring(seq_len: int = 256):
    torch.manual_seed(0)
    return TinyLM(), _inputs(seq_len, 1000)


def dilated(seq_len: int = 256):
    torch.manual_seed(0)
    spec = DilatedSpec(segment_lengths=(16, 64), dilation_rates=(1, 4))
    return TinyLM(), _inputs(seq_len, 1000), {"dilation": spec}


def full_logits(seq_len: int = 256):
    torch.manual_seed(0)
    return TinyLM(vocab=8000, return_logits=True), _inputs(seq_len, 8000)


def contiguous_view(seq_len: int = 256):
    torch.manual_seed(0)
    return TinyLM(contiguous_view=True), _inputs(seq_len, 1000)
