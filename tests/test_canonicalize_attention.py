"""Structural tests of canonicalisation: each attention form -> one canonical SDPA call (same
values), and non-attention that must not match."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from graphs import dynamo_graph, export_graph, run, targets

from ringcc.passes.attention_form import FORM_META, SDPA_ATEN_TARGET, SdpaCall, is_sdpa
from ringcc.passes.canonicalize_attention import canonicalize_attention
from ringcc.report import Decision, SkipReason

PASSES = [("canonicalize_attention", canonicalize_attention)]
B, H, N, D = 2, 4, 8, 16


def qkv(three_d=False):
    shape = (B * H, N, D) if three_d else (B, H, N, D)
    return [torch.randn(shape) for _ in range(3)]


def canonical(fn, *inputs):
    """Run the pass on fn's graph; return (gm, sdpa nodes, report) after checking the
    canonicalised graph computes what fn computes."""
    gm, example_inputs = dynamo_graph(fn, *inputs, with_inputs=True)
    before = gm(*example_inputs)
    ctx = run(gm, PASSES)
    torch.testing.assert_close(gm(*example_inputs), before, atol=1e-5, rtol=1e-5)
    return gm, [n for n in gm.graph.nodes if is_sdpa(n)], ctx.report


def causal(n=N):
    return torch.ones(n, n, dtype=torch.bool).tril()


MANUAL_FORMS = {
    "matmul_mul_softmax": lambda q, k, v: torch.softmax(torch.matmul(q, k.transpose(-2, -1)) * 0.25, dim=-1) @ v,
    "div_method_softmax": lambda q, k, v: ((q @ k.transpose(2, 3)) / math.sqrt(D)).softmax(-1) @ v,
    "scale_on_q": lambda q, k, v: F.softmax((q * D ** -0.5) @ k.transpose(-1, -2), dim=-1) @ v,
    "scale_on_q_and_k": lambda q, k, v: F.softmax((q * D ** -0.25) @ (k * D ** -0.25).transpose(-1, -2), -1) @ v,
    "permute_k": lambda q, k, v: F.softmax(q @ k.permute(0, 1, 3, 2) * 0.3, dim=-1) @ v,
    "masked_fill": lambda q, k, v: F.softmax((q @ k.mT * 0.25).masked_fill(~causal(), float("-inf")), -1) @ v,
    "where_finfo_min": lambda q, k, v: F.softmax(torch.where(causal(), q @ k.mT, torch.finfo(q.dtype).min), -1) @ v,
    "additive_then_scale": lambda q, k, v: F.softmax((q @ k.mT + torch.full((N, N), -3.0).triu(1)) * 0.5, -1) @ v,
    "upcast_softmax": lambda q, k, v: F.softmax((q @ k.mT).float(), dim=-1, dtype=torch.float32).to(q.dtype) @ v,
    "eval_dropout": lambda q, k, v: F.dropout(F.softmax(q @ k.mT, -1), 0.1, training=False) @ v,
}


@pytest.mark.parametrize("name", sorted(MANUAL_FORMS))
def test_manual_forms_become_one_sdpa(name):
    gm, sdpas, report = canonical(MANUAL_FORMS[name], *qkv())
    assert len(sdpas) == 1 and sdpas[0].meta[FORM_META] == "manual"
    assert not any(t in ("softmax", F.softmax, torch.softmax) for t in targets(gm))
    assert [s.form for s in report.sites] == ["manual"]
    call = SdpaCall.of(sdpas[0])
    assert call.q.op == "placeholder" and call.v.op == "placeholder" and isinstance(call.scale, float)


def test_bmm_and_baddbmm_forms():
    def bmm(q, k, v):
        return torch.bmm(F.softmax(torch.bmm(q, k.transpose(1, 2)) * 0.25, dim=-1), v)

    def baddbmm(q, k, v):
        empty = torch.empty(B * H, N, N)
        return torch.bmm(F.softmax(torch.baddbmm(empty, q, k.transpose(1, 2), beta=0, alpha=0.25), dim=-1), v)

    def baddbmm_mask(q, k, v):
        bias = torch.full((B * H, N, N), -5.0).triu(1)
        return torch.bmm(F.softmax(torch.baddbmm(bias, q, k.transpose(1, 2), alpha=0.25) * 2.0, dim=-1), v)

    for fn in (bmm, baddbmm, baddbmm_mask):
        gm, sdpas, _ = canonical(fn, *qkv(three_d=True))
        assert len(sdpas) == 1 and "bmm" not in [getattr(t, "__name__", t) for t in targets(gm)]
        assert SdpaCall.of(sdpas[0]).q.meta["example_value"].dim() == 4


NOT_ATTENTION = {
    "softmax_over_dim_2": lambda q, k, v: F.softmax(q @ k.mT, dim=-2) @ v,
    "softmax_of_a_linear": lambda q, k, v: F.softmax(q.sum(-1, keepdim=True) * k, dim=-1) @ v.mT,
    "probabilities_as_right_operand": lambda q, k, v: v.mT @ F.softmax(q @ k.mT, dim=-1),
    "softmax_then_sum": lambda q, k, v: F.softmax(q @ k.mT, dim=-1).sum(-1),
    "log_softmax": lambda q, k, v: F.log_softmax(q @ k.mT, dim=-1) @ v,
}


@pytest.mark.parametrize("name", sorted(NOT_ATTENTION))
def test_non_attention_does_not_match(name):
    gm, sdpas, report = canonical(NOT_ATTENTION[name], *qkv())
    assert sdpas == [] and report.sites == []


def test_attention_with_unread_score_transform_is_recorded():
    gm, sdpas, report = canonical(lambda q, k, v: F.softmax(torch.tanh(q @ k.mT) * 0.5, dim=-1) @ v, *qkv())
    assert sdpas == []
    (site,) = report.sites
    assert (site.form, site.reason) == ("manual", SkipReason.OTHER) and "tanh" in site.detail


def test_reused_probabilities_are_recorded_not_rewritten():
    def f(q, k, v):
        p = F.softmax(q @ k.mT * 0.25, dim=-1)
        return p @ v + p.sum()

    gm, sdpas, report = canonical(f, *qkv())
    assert sdpas == []
    (site,) = report.sites
    assert (site.form, site.decision, site.reason) == ("manual", Decision.SKIPPED, SkipReason.WEIGHTS_USED)


def test_training_dropout_is_left_as_written():
    gm = dynamo_graph(lambda q, k, v: F.dropout(F.softmax(q @ k.mT, -1), 0.1, training=True) @ v, *qkv())
    ctx = run(gm, PASSES)
    assert not any(is_sdpa(n) for n in gm.graph.nodes)
    assert [(s.form, s.reason) for s in ctx.report.sites] == [("manual", SkipReason.DROPOUT)]


def test_sdpa_arguments_are_spelled_out_and_pass_is_idempotent():
    gm = dynamo_graph(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, None, 0.0, True), *qkv())
    run(gm, PASSES)
    (node,) = [n for n in gm.graph.nodes if is_sdpa(n)]
    assert node.args == tuple(node.args[:3]) and set(node.kwargs) == {"attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa"}
    assert node.kwargs["is_causal"] is True
    code = gm.code
    ctx = run(gm, PASSES)
    assert gm.code == code and len(ctx.report.sites) == 1


def test_export_graph_sdpa_is_canonical():
    class M(nn.Module):
        def forward(self, q, k, v):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.2)

    gm = export_graph(M(), *qkv())
    ctx = run(gm, PASSES)
    (node,) = [n for n in gm.graph.nodes if is_sdpa(n)]
    assert node.target == SDPA_ATEN_TARGET and SdpaCall.of(node).scale == 0.2
    assert [s.form for s in ctx.report.sites] == ["sdpa"]


def test_multihead_attention_is_decomposed():
    mha = nn.MultiheadAttention(32, 4, batch_first=True).eval()
    x = torch.randn(2, N, 32)

    def f(x):
        return mha(x, x, x, need_weights=False)[0]

    gm, sdpas, report = canonical(f, x)
    assert len(sdpas) == 1 and sdpas[0].meta[FORM_META] == "mha"
    assert F.multi_head_attention_forward not in targets(gm)
    assert [(s.form, s.decision) for s in report.sites] == [("mha", Decision.SKIPPED)]  # decided by the rewrite


def test_multihead_attention_weights_used_is_kept():
    mha = nn.MultiheadAttention(32, 4, batch_first=True).eval()
    x = torch.randn(2, N, 32)
    gm = dynamo_graph(lambda x: mha(x, x, x)[1], x)
    ctx = run(gm, PASSES)
    assert F.multi_head_attention_forward in targets(gm)
    assert [(s.form, s.reason) for s in ctx.report.sites] == [("mha", SkipReason.WEIGHTS_USED)]


def test_encoder_fast_path_with_mask_is_recorded():
    layer = nn.TransformerEncoderLayer(32, 4, dim_feedforward=64, batch_first=True).eval()
    x = torch.randn(2, N, 32)
    pad = torch.zeros(2, N, dtype=torch.bool)
    pad[1, -2:] = True
    with torch.no_grad():
        gm = dynamo_graph(lambda x, pad: layer(x, src_key_padding_mask=pad), x, pad)
    ctx = run(gm, PASSES)
    fast = [n for n in gm.graph.nodes if "encoder_layer_fwd" in str(n.target)]
    if fast:  # the fused path was traced: it is kept, with the reason
        assert [(s.form, s.reason) for s in ctx.report.sites] == [("encoder", SkipReason.ENCODER_FASTPATH)]
    else:
        assert [s.form for s in ctx.report.sites] == ["mha"]


def _alibi_sliced_to_length(q, k, v):
    """MPT's ALiBi: a bias over the longest length, sliced at max(0, size - n) (a start
    computed from the symbolic length)."""
    n = q.shape[-2]
    slopes = 1.0 / torch.pow(2.0, torch.arange(1, H + 1, dtype=torch.float32))
    bias = slopes[:, None, None] * torch.arange(1 - 64, 1, dtype=torch.float32)[None, None, :]
    bias = bias[:, max(0, bias.size(1) - n):, max(0, bias.size(2) - n):]
    return torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(D) + bias, dim=-1) @ v


def test_alibi_bias_sliced_at_a_symbolic_start_is_recorded():
    """A slice start computed from the symbolic length (not an int) is read as an unknown shift:
    the site is recorded and the graph computes what it did (no TypeError from comparing it)."""
    q, k, v = qkv()
    for x in (q, k, v):
        torch._dynamo.mark_dynamic(x, 2)
    _, _, report = canonical(_alibi_sliced_to_length, q, k, v)
    assert [s.form for s in report.sites] == ["manual"], report.format()
