"""Tiny models and the parity check shared by the sharding tests (imported by the workers).

`parity(rank, world, model_name, ...)` builds the model with a fixed seed, runs
single-process eager as the reference, compiles with ringcc on the group and compares the
loss, the outputs and every parameter gradient; it returns the errors and the report facts
the tests assert on.
"""

from __future__ import annotations

import torch
import torch.utils.checkpoint
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

    def __init__(self, d=32, h=4, layers=2, max_pos=128, checkpoint=False):
        super().__init__()
        self.checkpoint = checkpoint  # each block under torch.utils.checkpoint (non-reentrant)
        self.wte, self.wpe = nn.Embedding(VOCAB, d), nn.Embedding(max_pos, d)
        self.blocks = nn.ModuleList([Block(d, h) for _ in range(layers)])
        self.lnf = nn.LayerNorm(d)
        self.head = nn.Linear(d, VOCAB, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, idx, labels):
        b, n = idx.shape
        x = self.wte(idx) + self.wpe(torch.arange(n, device=idx.device))
        for blk in self.blocks:
            x = torch.utils.checkpoint.checkpoint(blk, x, use_reentrant=False) if self.checkpoint else blk(x)
        logits = self.head(self.lnf(x))
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1))
        return loss, logits


def build(name: str):
    torch.manual_seed(0)
    if name == "gpt":
        return GPT()
    if name == "gpt_checkpoint":
        return GPT(checkpoint=True)
    if name == "llama":
        return _hf_llama()
    if name == "llama_checkpoint":  # HF gradient checkpointing (torch.utils.checkpoint per decoder layer)
        model = _hf_llama()
        model.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return model.train()
    if name == "gpt2":
        return _hf_gpt2()
    if name == "bert":
        return Bert()
    if name == "encoder":
        return Encoder()
    if name == "encoder_1layer":
        return Encoder(layers=1)
    if name == "padded_attention":
        return PaddedAttention()
    if name == "vit":
        return ViT()
    raise ValueError(name)


def batch(name: str, n: int, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    if name in ("bert", "encoder", "encoder_1layer", "padded_attention"):
        pad = torch.zeros(2, n, dtype=torch.bool)
        pad[1, n - 5:] = True  # batch 1: a padded tail (keys ignored)
        if name == "bert":
            return (torch.randint(0, VOCAB, (2, n), generator=gen), (~pad).long())
        return (torch.randn(2, n, 32, generator=gen), pad)
    if name == "vit":  # n = 1 + (h / 4) * (w / 4) = 36
        assert n == 36, "the ViT has 35 patches plus the class token"
        return (torch.randn(2, 3, 20, 28, generator=gen), torch.tensor([3, 7]))
    idx = torch.randint(0, VOCAB, (2, n), generator=gen)
    labels = torch.randint(0, VOCAB, (2, n), generator=gen)
    labels[0, 3] = -100  # an ignored target
    return (idx, labels)


def _loss_and_outputs(out):
    if isinstance(out, tuple):
        return out[0], out[1:]
    return out, ()


def _rel(a, b) -> float:
    # relative to the tensor's scale; gradients that are zero in exact math (BERT's key bias:
    # softmax ignores a per-query constant) are compared at a 1e-3 floor
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-3))


def parity(rank, world, name, lengths=(24,), inner="aot_eager", options=None, dynamic=False):
    """Per length: max relative error of loss, outputs and every parameter gradient vs eager;
    then the report facts and the structural checks of every rewritten graph."""
    ref_model, model = build(name), build(name)
    cfg = ringcc.Config(inner=inner, verify=True, **(options or {}))
    backend, graphs = capturing(cfg)
    compiled = torch.compile(model, backend=backend, dynamic=dynamic)
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
    return results, facts(graphs, world)


def capturing(cfg):
    """A ringcc backend that also keeps every rewritten graph module."""
    inner = ringcc.backend(cfg)
    graphs = []

    def backend(gm, example_inputs, **kwargs):
        out = inner(gm, example_inputs, **kwargs)
        graphs.append(gm)  # the passes rewrite gm in place
        return out

    return backend, graphs


def facts(graphs, world) -> list[dict]:
    """What the tests assert per graph: the report, and the shapes of the rewritten graph."""
    from ringcc.passes.inline_checkpoints import inlined

    out = []
    for gm, rep in zip(graphs, ringcc.reports()):
        gm = inlined(gm)  # checkpoint regions' bodies are checked as part of the program
        out.append(dict(
            sites=len(rep.sites), rewritten=len(rep.rewritten),
            gathers=[(g.location, g.why) for g in rep.gathers],
            bad_rows=shard_row_violations(gm, world),
            full_after_attention=full_length_after_attention(gm),
            nxn=square_sequence_values(gm, world),
        ))
    return out


def _states(node):
    from ringcc.passes.shard_sequence import STATE_META

    st = node.meta.get(STATE_META)
    val = node.meta.get("example_value")
    if isinstance(st, tuple):
        return list(zip(st, val))
    return [(st, val)] if st is not None else []


def _expr(size):
    from ringcc.passes.discover_sequence import expr

    return expr(size)


def _same(size, want) -> bool:
    """size == want, reading the fake's floor division n // p as n / p (p divides n)."""
    from torch.utils._sympy.functions import FloorDiv

    got = _expr(size).replace(FloorDiv, lambda a, b: a / b)
    return (got - want).simplify() == 0


def shard_row_violations(gm, world) -> list[str]:
    """Sharded values whose sequence dim does not hold n/p rows (times merged batch)."""
    if "ringcc_seq_len" not in gm.meta:
        return []
    n = gm.meta["ringcc_seq_len"]
    bad = []
    for node in gm.graph.nodes:
        for st, val in _states(node):
            if st is not None and st.sharded and not _same(val.shape[st.dim], st.outer * n / world):
                bad.append(f"{node.name} {tuple(val.shape)} dim {st.dim}")
    return bad


def full_length_after_attention(gm) -> list[str]:
    """Float values downstream of an attention site that carry the full sequence with
    features (replicated activations), except the recorded gathers and what they feed."""
    from ringcc.passes.discover_sequence import attention_nodes

    seen, stack = set(), list(attention_nodes(gm))
    while stack:
        node = stack.pop()
        for user in node.users:
            if user not in seen:
                seen.add(user)
                stack.append(user)
    bad = []
    for node in seen:
        if node.target is torch.ops.ringcc.gather.default or node.meta.get("ringcc_pass") == "shard_sequence" \
                and any(a.target is torch.ops.ringcc.gather.default for a in node.all_input_nodes):
            continue
        if any(a.target is torch.ops.ringcc.gather.default for a in _ancestors(node)):
            continue
        for st, val in _states(node):
            if st is not None and not st.sharded and val.is_floating_point() and val.dim() > st.dim + 1:
                bad.append(f"{node.name} {tuple(val.shape)}")
    return bad


def _ancestors(node):
    seen, stack = set(), [node]
    while stack:
        for a in stack.pop().all_input_nodes:
            if a not in seen:
                seen.add(a)
                stack.append(a)
    return seen


def square_sequence_values(gm, world) -> list[str]:
    """Tensors with the full sequence length in one dim and n or n/p in another (an n x n
    or (n/p) x n mask): none may be left."""
    if "ringcc_seq_len" not in gm.meta:
        return []
    n = gm.meta["ringcc_seq_len"]
    bad = []
    for node in gm.graph.nodes:
        val = node.meta.get("example_value")
        if not isinstance(val, torch.Tensor):
            continue
        sizes = list(val.shape)
        full = sum(1 for s in sizes if _same(s, n))
        seqish = sum(1 for s in sizes if _same(s, n) or _same(s, n / world))
        if full >= 1 and seqish >= 2:
            bad.append(f"{node.name} {tuple(val.shape)}")
    return bad


def _hf_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      attn_implementation="sdpa", use_cache=False)
    return HFCausal(LlamaForCausalLM(cfg))


def _hf_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=128,
                     attn_implementation="sdpa", use_cache=False, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return HFCausal(GPT2LMHeadModel(cfg))


class HFCausal(nn.Module):
    """Labels passed in, so the loss is computed inside the Hugging Face model."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, idx, labels):
        out = self.model(input_ids=idx, labels=labels, use_cache=False)
        return out.loss, out.logits


class Bert(nn.Module):
    """BertModel with a padding mask; a loss over every token and the pooled first token."""

    def __init__(self):
        super().__init__()
        from transformers import BertConfig, BertModel

        cfg = BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                         intermediate_size=64, max_position_embeddings=128, hidden_dropout_prob=0.0,
                         attention_probs_dropout_prob=0.0, attn_implementation="sdpa")
        self.bert = BertModel(cfg)

    def forward(self, idx, attention_mask):
        out = self.bert(input_ids=idx, attention_mask=attention_mask)
        loss = out.last_hidden_state.pow(2).mean() + out.pooler_output.sum()
        return loss, out.last_hidden_state, out.pooler_output


class Encoder(nn.Module):
    """nn.TransformerEncoder (batch_first, key padding mask), trained (no fused fast path)."""

    def __init__(self, d=32, layers=2):
        super().__init__()
        layer = nn.TransformerEncoderLayer(d, 4, 64, dropout=0.0, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, 1)  # normalised outputs alone make a loss with ~1e-7 gradients

    def forward(self, x, pad):
        y = self.enc(x, src_key_padding_mask=pad)
        return self.head(y).pow(2).mean(), y


class PaddedAttention(nn.Module):
    """One attention under a key padding mask between two projections: the fewest kernels
    around a ring that reads a key mask."""

    def __init__(self, d=32, h=4):
        super().__init__()
        self.h = h
        self.qkv, self.head = nn.Linear(d, 3 * d), nn.Linear(d, 1)

    def forward(self, x, pad):
        b, n, d = x.shape
        q, k, v = (t.view(b, n, self.h, d // self.h).transpose(1, 2) for t in self.qkv(x).split(d, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=~pad[:, None, None, :]).transpose(1, 2).reshape(b, n, d)
        return self.head(y).pow(2).mean(), y


class ViT(nn.Module):
    """ViT-style: conv patches, class token, learned [1, n, d] positions, non-causal SDPA."""

    def __init__(self, d=32, h=4, layers=2, patches=35, classes=10):
        super().__init__()
        self.h = h
        self.patch = nn.Conv2d(3, d, 4, stride=4)
        self.cls = nn.Parameter(torch.randn(1, 1, d) * 0.02)
        self.pos = nn.Parameter(torch.randn(1, patches + 1, d) * 0.02)
        self.blocks = nn.ModuleList([EncoderBlock(d, h) for _ in range(layers)])
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, classes)

    def forward(self, img, target):
        x = self.patch(img).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1) + self.pos
        for blk in self.blocks:
            x = blk(x)
        logits = self.head(self.ln(x)[:, 0])
        return F.cross_entropy(logits, target), logits


class EncoderBlock(Block):
    def forward(self, x):
        b, n, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (t.view(b, n, self.h, d // self.h).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v)
        x = x + self.proj(y.transpose(1, 2).reshape(b, n, d))
        return x + self.mlp(self.ln2(x))
