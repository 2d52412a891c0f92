"""Structural tests of the rewrite pass: canonical sites -> torch.ops.ringcc.ring_attention."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.nn.functional as F
from graphs import dynamo_graph, export_graph, run, targets

from ringcc.config import Config
from ringcc.passes.attention_form import SDPA_ATEN_TARGET, SDPA_TORCH_TARGETS
from ringcc.passes.canonicalize_attention import canonicalize_attention
from ringcc.passes.lift_masks import lift_masks
from ringcc.passes.rewrite_attention import RING_OP, rewrite_attention
from ringcc.report import Decision, SkipReason

ATTN_PASSES = [("canonicalize_attention", canonicalize_attention), ("lift_masks", lift_masks),
               ("rewrite_attention", rewrite_attention)]


def qkv(b=2, h=4, g=4, n=8, d=16):
    return torch.randn(b, h, n, d), torch.randn(b, g, n, d), torch.randn(b, g, n, d)


def ring_nodes(gm):
    return [n for n in gm.graph.nodes if n.target == RING_OP]


def test_sdpa_becomes_ring_op_with_contract_args():
    def f(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True) * 2

    gm = dynamo_graph(f, *qkv(g=2))
    ctx = run(gm, ATTN_PASSES, world_size=2)
    assert not any(t in SDPA_TORCH_TARGETS for t in targets(gm))
    (op,) = ring_nodes(gm)
    q, k, v, key_valid, is_causal, scale, group, world, layout = op.args
    assert [q.op, k.op, v.op] == ["placeholder"] * 3
    assert key_valid is None and is_causal is True and scale == pytest.approx(0.25)
    assert (group, world, layout) == ("0", 2, "zigzag")
    assert ctx.scratch["layout"] == "zigzag" and ctx.scratch["attention_nodes"] == [op]
    (use,) = op.users
    assert use.target is operator.getitem and use.args[1] == 0
    assert tuple(use.meta["example_value"].shape) == (2, 4, 8, 16)
    assert op.meta["ringcc_pass"] == "rewrite_attention" and op.meta["ringcc_from"]
    assert ctx.report.sites[0].decision == Decision.REWRITTEN


def test_layout_is_contiguous_unless_every_site_is_causal():
    def f(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True) + F.scaled_dot_product_attention(q, k, v)

    gm = dynamo_graph(f, *qkv())
    ctx = run(gm, ATTN_PASSES, world_size=2)
    assert ctx.scratch["layout"] == "contiguous"
    assert [n.args[8] for n in ring_nodes(gm)] == ["contiguous", "contiguous"]
    gm1 = dynamo_graph(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), *qkv())
    assert run(gm1, ATTN_PASSES, world_size=1).scratch["layout"] == "contiguous"
    gm2 = dynamo_graph(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), *qkv())
    assert run(gm2, ATTN_PASSES, Config(layout="contiguous"), world_size=2).scratch["layout"] == "contiguous"


def test_rewrite_is_idempotent():
    gm = dynamo_graph(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, scale=0.5), *qkv())
    run(gm, ATTN_PASSES)
    before = gm.code
    ctx = make_ctx_and_run_twice(gm)
    assert gm.code == before and ctx.report.sites == []


def make_ctx_and_run_twice(gm):
    from graphs import make_ctx

    ctx = make_ctx()
    for _, fn in ATTN_PASSES:
        assert fn(gm, ctx).modified is False
    return ctx


def test_export_graph_aten_sdpa_is_rewritten():
    class M(torch.nn.Module):
        def forward(self, q, k, v):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    gm = export_graph(M(), *qkv())
    assert SDPA_ATEN_TARGET in targets(gm)
    ctx = run(gm, ATTN_PASSES)
    assert SDPA_ATEN_TARGET not in targets(gm)
    (op,) = ring_nodes(gm)
    assert "val" in op.meta and ctx.report.sites[0].form == "sdpa"


@pytest.mark.parametrize("kwargs,reason", [
    ({"dropout_p": 0.1}, SkipReason.DROPOUT),
    ({"attn_mask": "dense"}, SkipReason.UNLIFTABLE_MASK),
])
def test_skipped_sites_keep_sdpa_and_record_reason(kwargs, reason):
    def f(q, k, v, m):
        kw = dict(kwargs)
        if kw.get("attn_mask") == "dense":
            kw["attn_mask"] = m
        return F.scaled_dot_product_attention(q, k, v, **kw)

    gm = dynamo_graph(f, *qkv(), torch.randn(8, 8))
    ctx = run(gm, ATTN_PASSES)
    assert not ring_nodes(gm) and any(t in SDPA_TORCH_TARGETS for t in targets(gm))
    (site,) = ctx.report.sites
    assert (site.decision, site.reason) == (Decision.SKIPPED, reason) and site.detail


def test_cross_attention_is_skipped():
    q, k, v = qkv()
    gm = dynamo_graph(lambda q, k, v: F.scaled_dot_product_attention(q, k, v), q, k[:, :, :4], v[:, :, :4])
    ctx = run(gm, ATTN_PASSES)
    assert ctx.report.sites[0].reason == SkipReason.CROSS_ATTENTION


def test_strict_names_the_site_and_reason():
    gm = dynamo_graph(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, dropout_p=0.2), *qkv())
    with pytest.raises(ValueError, match=r"strict=True.*sdpa site at .*dropout"):
        run(gm, ATTN_PASSES, Config(strict=True))


def test_dilation_rewrites_to_dilated_op_per_site():
    from ringcc.passes.rewrite_attention import DILATED_OP
    from ringcc.runtime.dilated import DilatedSpec

    spec = DilatedSpec([4, 8], [1, 2])

    def f(q, k, v):
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return F.scaled_dot_product_attention(a, k, v)

    def choose(site):  # first site only: the callable sees each report.Site
        return spec if site.node == "a" else None

    gm = dynamo_graph(f, *qkv())
    ctx = run(gm, ATTN_PASSES, Config(dilation=choose, verify=True))
    dil = [n for n in gm.graph.nodes if n.target == DILATED_OP]
    assert len(dil) == 1 and len(ring_nodes(gm)) == 1
    q, k, v, seg, rates, offsets, is_causal, scale, group, world, layout = dil[0].args
    assert (seg, rates, offsets, is_causal, layout) == ([4, 8], [1, 2], "per_head", True, "contiguous")
    assert [s.dilation for s in ctx.report.sites] == [repr(spec), None]


def test_dilation_that_does_not_fit_is_skipped():
    from ringcc.runtime.dilated import DilatedSpec

    gm = dynamo_graph(lambda q, k, v: F.scaled_dot_product_attention(q, k, v), *qkv(n=12))
    ctx = run(gm, ATTN_PASSES, Config(dilation=DilatedSpec([8], [2])))
    (site,) = ctx.report.sites
    assert site.reason == SkipReason.SHAPE and "does not fit" in site.detail


def test_sliding_window_becomes_the_window_argument():
    def f(q, k, v):
        i = torch.arange(8)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=(i[None] <= i[:, None]) & (i[:, None] - i[None] < 3))

    gm = dynamo_graph(f, *qkv())
    ctx = run(gm, ATTN_PASSES, world_size=2)
    (site,) = ctx.report.sites
    assert (site.decision, site.mask["window"], site.mask["causal"]) == (Decision.REWRITTEN, 3, True)
    (op,) = ring_nodes(gm)
    assert op.args[4] is True and op.args[9] == 3 and op.args[8] == "contiguous"  # no zigzag for a band
    # the same graph at p = 1 computes what the masked SDPA computed
    gm1, example_inputs = dynamo_graph(f, *qkv(), with_inputs=True)
    before = gm1(*example_inputs)
    run(gm1, ATTN_PASSES)
    torch.testing.assert_close(gm1(*example_inputs), before, atol=1e-5, rtol=1e-5)


def test_window_with_dilation_is_skipped():
    from ringcc.runtime.dilated import DilatedSpec

    def f(q, k, v):
        i = torch.arange(8)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=(i[:, None] - i[None, :]).abs() < 2)

    gm = dynamo_graph(f, *qkv())
    ctx = run(gm, ATTN_PASSES, Config(dilation=DilatedSpec([4], [1])))
    assert ctx.report.sites[0].reason == SkipReason.UNSUPPORTED_MASK


def test_lifted_mask_is_dropped_from_the_graph():
    def f(q, k, v, pad):
        i = torch.arange(8)
        m = (i[None, :] <= i[:, None]) & ~pad[:, None, None, :]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=m)

    pad = torch.zeros(2, 8, dtype=torch.bool)
    pad[0, 6:] = pad[1, 3] = True  # padded keys (every query still sees key 0)
    gm, example_inputs = dynamo_graph(f, *qkv(), pad, with_inputs=True)
    want = gm(*example_inputs)
    run(gm, ATTN_PASSES)
    (op,) = ring_nodes(gm)
    assert op.args[4] is True and op.args[3] is not None
    assert "arange" not in [getattr(t, "__name__", t) for t in targets(gm)]
    # the lifted key mask keeps its polarity: padded keys stay hidden (p = 1 runs the graph)
    torch.testing.assert_close(gm(*example_inputs), want, atol=1e-5, rtol=1e-5)


def test_manual_and_masked_sites_are_idempotent_through_all_passes():
    def f(q, k, v, pad):
        i = torch.arange(8)
        s = (q @ k.transpose(-2, -1) * 0.25).masked_fill((i[None] > i[:, None]) | pad[:, None, None, :], float("-inf"))
        return torch.softmax(s, dim=-1) @ v

    gm = dynamo_graph(f, *qkv(), torch.zeros(2, 8, dtype=torch.bool))
    ctx = run(gm, ATTN_PASSES)
    assert len(ring_nodes(gm)) == 1 and ctx.report.sites[0].decision == Decision.REWRITTEN
    code = gm.code
    make_ctx_and_run_twice(gm)
    assert gm.code == code


def test_verifier_rejects_a_broken_attention_contract():
    from ringcc.passes.verify import GraphInvariantError, verify_graph

    gm = dynamo_graph(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), *qkv())
    run(gm, ATTN_PASSES)
    (op,) = ring_nodes(gm)
    q = op.args[0]
    op.args = (q, q, q, q) + op.args[4:]  # key_valid must be a bool [b, n] tensor
    with pytest.raises(GraphInvariantError, match="key_valid"):
        verify_graph(gm, after="test")


def test_exported_hf_llama_with_padding_is_rewritten_and_runs():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, use_cache=False,
                                   attn_implementation="eager")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 64, (2, 16))
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[1, 12:] = 0
    ep = torch.export.export(model, (ids,), {"attention_mask": mask})
    ctx = run(ep.graph_module, ATTN_PASSES)
    assert [(s.form, s.decision) for s in ctx.report.sites] == [("manual", Decision.REWRITTEN)] * 2
    assert all(s.mask["causal"] and s.mask["key_padding"] for s in ctx.report.sites)
    ops = ring_nodes(ep.graph_module)
    assert all("val" in op.meta and op.args[1].meta["val"].shape[1] == 2 for op in ops)  # K/V keep 2 heads
    torch.testing.assert_close(ep.module()(ids, attention_mask=mask).logits,
                               model(ids, attention_mask=mask).logits, atol=1e-5, rtol=1e-5)
