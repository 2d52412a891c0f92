"""Attention under torch.autocast (Note [Attention under autocast] in runtime/amp.py): the ring
takes SDPA's autocast policy in compiled graphs, in the functional API, in the ops themselves and
in `ringcc rewrite`'s saved program; an fp32-weight HF Llama under CPU bf16 autocast is judged
against an fp64 reference, as no further from it than eager under the same autocast."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from parity import fp64_judge

N, VOCAB = 24, 64


def _llama():
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").train()


def _batch():
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(1, VOCAB, (2, N), generator=gen)
    labels = torch.randint(0, VOCAB, (2, N), generator=gen)
    labels[0, 3] = -100
    return ids, labels


def _step(model, ids, labels, amp: bool):
    """(loss, logits, {name: grad}) of one training step, under CPU bf16 autocast when amp."""
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", torch.bfloat16, enabled=amp):
        out = model(input_ids=ids, labels=labels)
    out.loss.backward()
    logits = out.logits
    logits = logits.full_tensor() if hasattr(logits, "full_tensor") else logits
    return out.loss.detach(), logits.detach(), {k: p.grad for k, p in model.named_parameters()}


def case_llama(rank, world, inner):
    import ringcc

    torch.manual_seed(0)
    eager = _llama()
    ref = copy.deepcopy(eager).double()
    model = copy.deepcopy(eager)
    compiled = torch.compile(model, backend=ringcc.backend(ringcc.Config(inner=inner)))
    ids, labels = _batch()
    torch._dynamo.reset()
    ringcc.reset_reports()
    want = _step(ref, ids, labels, amp=False)
    base = _step(eager, ids, labels, amp=True)
    got = _step(compiled, ids, labels, amp=True)
    sites = [(s.decision.value, s.detail) for r in ringcc.reports() for s in r.sites]
    return dict(sites=sites, judge=fp64_judge(got, base, want),
                dtypes=(got[1].dtype, base[1].dtype),
                grads=({k for k, g in got[2].items() if g is None}, {k for k, g in base[2].items() if g is None}))


@pytest.mark.parametrize("world", [2, 4])
def test_llama_under_cpu_bf16_autocast(pools, world):
    for res in pools(world).run(case_llama, "aot_eager", timeout=600):
        print(res["judge"])
        assert res["sites"] == [("rewritten", "autocast: q/k/v in torch.bfloat16")] * 2, res["sites"]
        assert res["dtypes"] == (torch.bfloat16, torch.bfloat16)
        assert res["grads"][0] == res["grads"][1]
