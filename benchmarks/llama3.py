"""A Llama-3-style decoder in plain PyTorch (RoPE, RMSNorm, SwiGLU, GQA, tied embeddings), the
model of bench_fsdp.py and tests/test_fsdp.py.

`Llama(cfg)` returns the mean next-token cross-entropy of (tokens, labels). The blocks and the
head (final norm, output projection and loss) are modules of their own, the units that FSDP2
shards and that per-block compile compiles. `gqa="native"` calls SDPA with enable_gqa=True
(K/V keep their heads); `gqa="repeat"` repeats K/V to the query heads first, as torchtitan's
Llama does (the form PyTorch context parallel runs).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint


@dataclass(frozen=True)
class LlamaConfig:
    vocab: int = 128256
    dim: int = 2048
    layers: int = 16
    heads: int = 32
    kv_heads: int = 8
    ffn: int = 8192
    rope_theta: float = 500000.0
    norm_eps: float = 1e-5
    gqa: str = "native"  # "native" (enable_gqa=True) or "repeat" (K/V repeated to the query heads)
    vocab_chunks: int = 1  # the loss's logits in this many vocabulary chunks, each recomputed in backward


TINY = LlamaConfig(vocab=64, dim=32, layers=2, heads=4, kv_heads=2, ffn=64, rope_theta=10000.0)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


def rope(x_bhsd, cos_sd, sin_sd):
    x1, x2 = x_bhsd.float().chunk(2, dim=-1)
    out = torch.cat((x1 * cos_sd - x2 * sin_sd, x2 * cos_sd + x1 * sin_sd), dim=-1)
    return out.type_as(x_bhsd)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.gqa = cfg.heads, cfg.kv_heads, cfg.dim // cfg.heads, cfg.gqa
        self.wq = nn.Linear(cfg.dim, cfg.heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(cfg.heads * self.head_dim, cfg.dim, bias=False)

    def forward(self, x_bsd, cos_sd, sin_sd):
        b, n, _ = x_bsd.shape
        q = self.wq(x_bsd).view(b, n, self.heads, self.head_dim).transpose(1, 2)
        k = self.wk(x_bsd).view(b, n, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x_bsd).view(b, n, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = rope(q, cos_sd, sin_sd), rope(k, cos_sd, sin_sd)
        if self.gqa == "repeat":
            rep = self.heads // self.kv_heads
            k = k[:, :, None].expand(b, self.kv_heads, rep, n, self.head_dim).reshape(b, self.heads, n, self.head_dim)
            v = v[:, :, None].expand(b, self.kv_heads, rep, n, self.head_dim).reshape(b, self.heads, n, self.head_dim)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.wo(y.transpose(1, 2).reshape(b, n, -1))


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.attention_norm, self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps), RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.w1 = nn.Linear(cfg.dim, cfg.ffn, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn, bias=False)
        self.w2 = nn.Linear(cfg.ffn, cfg.dim, bias=False)

    def forward(self, x_bsd, cos_sd, sin_sd):
        x_bsd = x_bsd + self.attention(self.attention_norm(x_bsd), cos_sd, sin_sd)
        h = self.ffn_norm(x_bsd)
        return x_bsd + self.w2(F.silu(self.w1(h)) * self.w3(h))


def _logsumexp_of_logits(h_bsd, w_vd):
    return torch.logsumexp(F.linear(h_bsd, w_vd).float(), dim=-1)


class Head(nn.Module):
    """Final norm, output projection (tied to the embedding) and the mean cross-entropy. With
    vocab_chunks > 1 the logits are made a vocabulary chunk at a time under
    torch.utils.checkpoint (only each chunk's logsumexp is kept; at 128K tokens and a 128K
    vocabulary the whole logits are 32 GiB in bf16): every op stays token-local."""

    def __init__(self, cfg: LlamaConfig, embedding: nn.Embedding):
        super().__init__()
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.embedding = embedding
        self.vocab_chunks = cfg.vocab_chunks

    def forward(self, x_bsd, labels_bs):
        h_bsd, w_vd = self.norm(x_bsd), self.embedding.weight
        if self.vocab_chunks == 1:
            return F.cross_entropy(F.linear(h_bsd, w_vd).flatten(0, 1).float(), labels_bs.flatten(0, 1))
        lse_bs = None
        for chunk in w_vd.chunk(self.vocab_chunks):
            part = torch.utils.checkpoint.checkpoint(_logsumexp_of_logits, h_bsd, chunk, use_reentrant=False)
            lse_bs = part if lse_bs is None else torch.logaddexp(lse_bs, part)
        target_bs = (F.embedding(labels_bs, w_vd) * h_bsd).float().sum(-1)
        return (lse_bs - target_bs).mean()


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig = TINY):
        super().__init__()
        self.cfg = cfg
        self.embedding = nn.Embedding(cfg.vocab, cfg.dim)
        self.layers = nn.ModuleList([Block(cfg) for _ in range(cfg.layers)])
        self.head = Head(cfg, self.embedding)
        head_dim = cfg.dim // cfg.heads
        inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def rope_tables(self, positions_s):
        freqs = torch.outer(positions_s.float(), self.inv_freq)
        return freqs.cos(), freqs.sin()

    def forward(self, tokens_bs, labels_bs, positions_s=None):
        """positions_s: the tokens' positions (default arange(n); context parallel passes its
        sharded positions)."""
        if positions_s is None:
            positions_s = torch.arange(tokens_bs.shape[1], device=tokens_bs.device)
        cos_sd, sin_sd = self.rope_tables(positions_s)
        x_bsd = self.embedding(tokens_bs)
        for layer in self.layers:
            x_bsd = layer(x_bsd, cos_sd, sin_sd)
        return self.head(x_bsd, labels_bs)
