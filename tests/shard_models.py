"""Tiny models and the parity check shared by the sharding tests (imported by the workers).

`parity(rank, world, model_name, ...)` builds the model with a fixed seed, runs
single-process eager as the reference, compiles with ringcc on the group and compares the
loss, the outputs and every parameter gradient; it returns the errors and the report facts
the tests assert on.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

import ringcc

VOCAB = 64


class Block(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.h = h
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (t.view(b, n, self.h, d // self.h).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).contiguous().view(b, n, d))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """GPT-like: learned positions, causal SDPA, tied head, loss on shifted labels."""

    def __init__(self, d=32, h=4, layers=2, max_pos=128):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, d), nn.Embedding(max_pos, d)
        self.blocks = nn.ModuleList([Block(d, h) for _ in range(layers)])
        self.lnf = nn.LayerNorm(d)
        self.head = nn.Linear(d, VOCAB, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, idx, labels):
        b, n = idx.shape
        x = self.wte(idx) + self.wpe(torch.arange(n, device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        logits = self.head(self.lnf(x))
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1), ignore_index=-1)
        return loss, logits


def build(name: str):
    torch.manual_seed(0)
    if name == "gpt":
        return GPT()
    raise ValueError(name)


def batch(name: str, n: int, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, VOCAB, (2, n), generator=gen)
    labels = torch.randint(0, VOCAB, (2, n), generator=gen)
    labels[0, 3] = -1  # an ignored target
    return (idx, labels)


def _loss_and_outputs(out):
    if isinstance(out, tuple):
        return out[0], out[1:]
    return out, ()


def _rel(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def parity(rank, world, name, lengths=(24,), inner="aot_eager", options=None):
    """Per length: max relative error of loss, outputs and every parameter gradient vs eager."""
    ref_model, model = build(name), build(name)
    cfg = ringcc.Config(inner=inner, verify=True, **(options or {}))
    compiled = torch.compile(model, backend=ringcc.backend(cfg), dynamic=False)
    ringcc.reset_reports()
    results = []
    for n in lengths:
        inputs = batch(name, n)
        ref_model.zero_grad()
        ref_loss, ref_outs = _loss_and_outputs(ref_model(*inputs))
        ref_loss.backward()
        model.zero_grad()
        loss, outs = _loss_and_outputs(compiled(*inputs))
        loss.backward()
        errs = {"loss": _rel(loss.detach(), ref_loss.detach())}
        for i, (o, r) in enumerate(zip(outs, ref_outs)):
            errs[f"out{i}"] = _rel(o.detach(), r.detach())
        ref_grads = dict(ref_model.named_parameters())
        for pname, p in model.named_parameters():
            r = ref_grads[pname].grad
            if r is None:
                assert p.grad is None, pname
                continue
            errs[pname] = _rel(p.grad, r)
        results.append(errs)
    reps = ringcc.reports()
    facts = [dict(sites=len(r.sites), rewritten=len(r.rewritten),
                  gathers=[(g.location, g.why) for g in r.gathers]) for r in reps]
    return results, facts
