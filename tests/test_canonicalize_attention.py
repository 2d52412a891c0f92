"""Structural tests of canonicalisation: each attention form -> one canonical SDPA call (same
values), and non-attention that must not match."""

from __future__ import annotations

import math
import operator

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from graphs import dynamo_graph, export_graph, run, targets

from ringcc import rewrite as rw
from ringcc.passes.attention_form import FORM_META, MODS_META, SDPA_ATEN_TARGET, SdpaCall, is_sdpa
from ringcc.passes.canonicalize_attention import canonicalize_attention
from ringcc.passes.lift_masks import lift_masks
from ringcc.passes.rewrite_attention import rewrite_attention
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
    "additive_then_scale": lambda q, k, v: F.softmax((q @ k.mT + torch.full((N, N), -1e9).triu(1)) * 0.5, -1) @ v,
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
    gm, sdpas, report = canonical(lambda q, k, v: F.softmax(torch.erf(q @ k.mT) * 0.5, dim=-1) @ v, *qkv())
    assert sdpas == []
    (site,) = report.sites
    assert (site.form, site.reason) == ("manual", SkipReason.OTHER) and "erf" in site.detail, site.detail


def test_score_transform_is_read_as_a_score_function():
    """tanh(q.k) * 0.5 is a score function of the unscaled score (Note [Score extraction]): a shadow
    site with the function in its meta."""
    gm, sdpas, report = canonical(lambda q, k, v: F.softmax(torch.tanh(q @ k.mT) * 0.5, dim=-1) @ v, *qkv())
    (sdpa,) = sdpas
    mods = sdpa.meta[MODS_META]
    assert mods.fn.text == "scorefn v1 tensors=0\n%0 = tanh score\n%1 = mul %0 0.5\nreturn %1"
    assert SdpaCall.of(sdpa).scale == 1.0


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


def test_multihead_attention_weights_computed_on_and_dropped_are_not_read():
    """Weights that the caller computes on and then drops (code dynamo keeps in its graph) are not
    a read: that code is erased and the call decomposed."""
    mha = nn.MultiheadAttention(32, 4, batch_first=True).eval()
    x = torch.randn(2, N, 32)

    def f(x):
        out, weights = mha(x, x, x)
        weights.to(x.dtype) * 2
        return out

    gm = dynamo_graph(f, x)
    assert F.multi_head_attention_forward in targets(gm) and operator.mul in targets(gm)
    ctx = run(gm, PASSES)
    assert F.multi_head_attention_forward not in targets(gm) and operator.mul not in targets(gm)
    assert [(s.form, s.reason) for s in ctx.report.sites] == [("mha", None)]


def test_multihead_attention_weights_written_into_a_tensor_are_read():
    """Weights added in place into a tensor that outlives the call are read: the call is kept."""
    mha = nn.MultiheadAttention(32, 4, batch_first=True).eval()
    x, total = torch.randn(2, N, 32), torch.zeros(())

    def f(x, total):
        out, weights = mha(x, x, x)
        total.add_(weights.to(x.dtype).sum())
        return out

    gm = dynamo_graph(f, x, total)
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


ALIBI_PASSES = PASSES + [("lift_masks", lift_masks), ("rewrite_attention", rewrite_attention)]


def _bloom_alibi(q, k, v, valid=None, count=None):
    """Bloom's ALiBi: slopes * key positions [h, 1, n] repeated over the batch and added by
    baddbmm to the scores of q, k [b * h, n, d], viewed as [b, h, n, n] around the softmax. With
    `valid` (a [b, n] padding mask of 0 / 1), the keys are padded by it and the positions count
    the valid tokens of `count` (default: valid), as Bloom's build_alibi_tensor does (a per-token
    tensor the score function reads at the key)."""
    n = q.shape[1]
    slopes = torch.pow(torch.full((), 0.25), torch.arange(1, H + 1, dtype=torch.int32))
    excluded = torch.ones(n, n, dtype=torch.bool).triu(1)
    if valid is None:
        alibi = (slopes[:, None, None] * torch.arange(n)).repeat(B, 1, 1)
    else:
        count = valid if count is None else count
        alibi = (slopes[..., None] * ((count.cumsum(-1) - 1) * count)[:, None, :]).reshape(B * H, 1, n).to(q.dtype)
        excluded = excluded | (valid.to(torch.bool)[:, None, None, :] == 0)
    s = alibi.baddbmm(batch1=q, batch2=k.transpose(-1, -2), beta=1.0, alpha=0.25).view(B, H, n, -1)
    s = s.masked_fill(excluded, torch.finfo(q.dtype).min)
    return torch.bmm(F.softmax(s, dim=-1).view(B * H, n, -1), v)


def _padding(n: int = N, left: bool = False):
    """A [B, n] 0/1 padding mask: row 1 padded by 3 tokens at the end (or the start)."""
    valid = torch.ones(B, n, dtype=torch.long)
    if left:
        valid[1, :3] = 0
    else:
        valid[1, n - 3:] = 0
    return valid


def _valid_rows(out, valid):
    """out [B * H, n, d] (or [B, H, n, d]) at the valid tokens (the padded ones attend to no key
    when left padded)."""
    return out.view(B, H, *out.shape[-2:]).transpose(1, 2)[valid.bool()]


def _alibi_sliced_to_length(q, k, v):
    """MPT's ALiBi: slopes (1 / 2^x, which export spells reciprocal(x) * 1.0) times a bias over
    the longest length, sliced at max(0, size - n) (under a symbolic length, a start computed from
    n, and a size equal to n by the broadcast's guard only)."""
    n = q.shape[-2]
    slopes = 1.0 / torch.pow(2.0, torch.arange(1, H + 1, dtype=torch.float32))
    bias = slopes[:, None, None] * torch.arange(1 - 64, 1, dtype=torch.float32)[None, None, :]
    bias = bias[:, max(0, bias.size(1) - n):, max(0, bias.size(2) - n):]
    s = q @ k.transpose(-1, -2) / math.sqrt(D) + bias
    return torch.softmax(s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf")), dim=-1) @ v


class _Export(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *args):
        return self.fn(*args)


def _offline_graph(fn, *inputs) -> torch.fx.GraphModule:
    """fn's export graph as `ringcc rewrite` hands it to the passes (aten.slice as x[a:b], ...)."""
    gm = export_graph(_Export(fn), *inputs)
    rw._torch_level_spellings(gm)
    return gm


def _symbolic_graph(fn, *inputs, dim: int):
    """fn's dynamo graph with dim `dim` of every input a symbolic length, and a call of it at a
    length of 12 (example inputs of another length than traced, the length's SymInt as an int)."""
    for x in inputs:
        torch._dynamo.mark_dynamic(x, dim)
    gm, example_inputs = dynamo_graph(fn, *inputs, with_inputs=True)
    longer = [torch.cat([x, x.narrow(dim, 0, 12 - N)], dim) for x in inputs]

    def call(graph):  # (graph's outputs, fn's); dynamo orders the graph's inputs by first use
        args = [longer[next(i for i, y in enumerate(inputs) if y is x)] if isinstance(x, torch.Tensor) else 12
                for x in example_inputs]
        got, want = graph(*args), fn(*longer)
        return (got[0], want) if isinstance(want, torch.Tensor) else (tuple(got), want)
    return gm, call


def _assert_alibi_site(site) -> None:
    """Rewritten, causal, with a score function that reads the slopes per head."""
    assert site.decision == Decision.REWRITTEN and site.mask["causal"], site
    assert "load t" in site.mask["score_function"] and " h" in site.mask["score_function"], site


def _bloom_with_and_without_padding(q, k, v, valid):
    return _bloom_alibi(q, k, v), _bloom_alibi(q, k, v, valid)


def test_alibi_in_baddbmm_under_a_symbolic_length():
    """Bloom's ALiBi traced with a symbolic length: arange(n) has a symbolic end (the positions are
    0, 1, ... whatever n is), and the [b * h, n, d] values are viewed per head with -1 for n; with
    a padding mask, its positions are counted over the mask's valid tokens (a per-token tensor of
    the score function): both sites rewritten, with key padding."""
    valid = torch.ones(B, N, dtype=torch.long)
    valid[1, :N // 2] = 0  # left padding, still one run in the longer mask the call makes (valid, valid[:, :4])
    gm, call = _symbolic_graph(_bloom_with_and_without_padding, *qkv(three_d=True), valid, dim=1)
    sites = run(gm, ALIBI_PASSES).report.sites
    for site in sites:
        _assert_alibi_site(site)
    assert [bool(s.mask["key_padding"]) for s in sites] == [False, True]
    (got, want), (got_padded, want_padded) = zip(*call(gm))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)  # the ring op at p = 1 against eager
    valid = torch.cat([valid, valid[:, :12 - N]], 1)
    torch.testing.assert_close(_valid_rows(got_padded, valid), _valid_rows(want_padded, valid), atol=1e-5, rtol=1e-5)


def _counted_alibi_added(q, k, v, valid):
    """ALiBi positions counted over the padding mask, as a [b, h, 1, n] bias added to the scores."""
    slopes = 1.0 / torch.pow(2.0, torch.arange(1, H + 1, dtype=torch.float32))
    bias = slopes[:, None, None] * ((valid.cumsum(-1) - 1) * valid)[:, None, None, :]
    excluded = torch.ones(N, N, dtype=torch.bool).triu(1) | (valid[:, None, None, :] == 0)
    return torch.softmax((q @ k.transpose(-1, -2) / 4.0 + bias).masked_fill(excluded, float("-inf")), dim=-1) @ v


@pytest.mark.parametrize("fn,graph", [(_bloom_alibi, "dynamo"), (_bloom_alibi, "export"), (_counted_alibi_added, "dynamo")],
                         ids=["baddbmm-dynamo", "baddbmm-export", "added-dynamo"])
def test_alibi_positions_counted_over_the_padding_mask(fn, graph):
    """Bloom with a padding mask: positions (cumsum(mask) - 1) * mask times the slopes, in
    dynamo's and export's spelling (and added to 4-D scores), are a score function reading the
    slopes per head and the counted positions per key, with key padding by that mask: the site is
    rewritten and matches eager on the valid rows of a right-padded, a left-padded and a gapped
    batch (the function holds for any mask)."""
    inputs = qkv(three_d=fn is _bloom_alibi) + [_padding()]
    q, k, v = inputs[:3]
    if graph == "dynamo":
        gm, traced = dynamo_graph(fn, *inputs, with_inputs=True)
        order = [next(i for i, y in enumerate(inputs) if y is x) for x in traced]  # dynamo's order: first use
    else:
        gm, order = _offline_graph(fn, *inputs), range(4)
    (site,) = run(gm, ALIBI_PASSES).report.sites
    _assert_alibi_site(site)
    assert site.mask["key_padding"] and " kv" in site.mask["score_function"]

    def call(valid):
        args = [q, k, v, valid]
        return gm(*[args[i] for i in order])[0]

    gap = _padding()
    gap[0, 2] = 0
    for valid in (_padding(), _padding(left=True), gap):
        got = call(valid)
        want = fn(q, k, v, valid)
        torch.testing.assert_close(_valid_rows(got, valid), _valid_rows(want, valid), atol=1e-5, rtol=1e-5)


def test_a_skipped_site_with_a_score_function_runs_as_written():
    """A site with a score function skipped later (the dilated op takes none) runs as written."""
    from ringcc.config import Config
    from ringcc.runtime.dilated import DilatedSpec

    inputs = qkv(three_d=True) + [_padding()]
    gm, traced = dynamo_graph(_bloom_alibi, *inputs, with_inputs=True)
    (site,) = run(gm, ALIBI_PASSES, Config(dilation=DilatedSpec([4], [1]))).report.sites
    assert (site.decision, site.reason) == (Decision.SKIPPED, SkipReason.UNSUPPORTED_MASK), site
    assert torch.ops.ringcc.ring_attention.default not in targets(gm)
    inputs[3][0, 2] = 0
    torch.testing.assert_close(gm(*traced)[0], _bloom_alibi(*inputs))


@pytest.mark.parametrize("form", ["counted over another mask", "mask values"])
def test_biases_read_from_other_per_token_tensors_are_score_functions(form):
    """Positions counted over a tensor other than the key padding mask, or slopes times the mask's
    values: no ALiBi, but score functions of per-token tensors all the same, rewritten and exact."""
    slopes = torch.pow(torch.full((), 0.25), torch.arange(1, H + 1, dtype=torch.int32))

    def bias_of_values(q, k, v, valid):
        alibi = (slopes[..., None] * valid[:, None, :]).reshape(B * H, 1, N)
        s = alibi.baddbmm(batch1=q, batch2=k.transpose(-1, -2), beta=1.0, alpha=0.25).view(B, H, N, -1)
        s = s.masked_fill(torch.ones(N, N, dtype=torch.bool).triu(1) | (valid[:, None, None, :] == 0), -1e9)
        return torch.bmm(F.softmax(s, dim=-1).view(B * H, N, -1), v)

    if form == "mask values":
        fn, inputs = bias_of_values, qkv(three_d=True) + [_padding()]
    else:
        fn, inputs = _bloom_alibi, qkv(three_d=True) + [_padding(), _padding(left=True)]
    gm, traced = dynamo_graph(fn, *inputs, with_inputs=True)
    (site,) = run(gm, ALIBI_PASSES).report.sites
    _assert_alibi_site(site)
    valid = inputs[3]
    torch.testing.assert_close(_valid_rows(gm(*traced)[0], valid), _valid_rows(fn(*inputs), valid), atol=1e-5,
                               rtol=1e-5)


def test_alibi_in_baddbmm_of_an_export_graph():
    """Bloom's ALiBi in an export graph: repeat's sizes are one list (aten.repeat.default)."""
    q, k, v = qkv(three_d=True)
    gm = _offline_graph(_bloom_alibi, q, k, v)
    (site,) = run(gm, ALIBI_PASSES).report.sites
    _assert_alibi_site(site)
    torch.testing.assert_close(gm(q, k, v)[0], _bloom_alibi(q, k, v), atol=1e-5, rtol=1e-5)


def test_alibi_bias_sliced_at_a_symbolic_start():
    """MPT's ALiBi under a symbolic length: the bias is sliced at max(0, 64 - n), a start the score
    function cannot name; the sliced bias, whole-length at every n, is the function's tensor (read
    at the head and the key), and the rewritten site equals eager at another length, forward and
    every input's gradient."""
    q, k, v = (x.requires_grad_() for x in qkv())
    for x in (q, k, v):
        torch._dynamo.mark_dynamic(x, 2)
    gm, example = dynamo_graph(_alibi_sliced_to_length, q, k, v, with_inputs=True)
    (site,) = run(gm, ALIBI_PASSES).report.sites
    _assert_alibi_site(site)
    assert "load t0 h 0 kv" in site.mask["score_function"] and site.mask["score_function_inputs"][0].startswith("bias")
    longer = [torch.randn(B, H, 12, D, requires_grad=True) for _ in range(3)]
    args = [longer[next(i for i, y in enumerate((q, k, v)) if y is x)] if isinstance(x, torch.Tensor) else 12
            for x in example]
    got, want = gm(*args)[0], _alibi_sliced_to_length(*longer)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    r = torch.randn_like(want)
    for g, w in zip(torch.autograd.grad((got * r).sum(), longer), torch.autograd.grad((want * r).sum(), longer)):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)


def test_alibi_slopes_times_a_number_in_an_export_graph():
    q, k, v = qkv()
    gm = _offline_graph(_alibi_sliced_to_length, q, k, v)
    (site,) = run(gm, ALIBI_PASSES).report.sites
    _assert_alibi_site(site)
    torch.testing.assert_close(gm(q, k, v)[0], _alibi_sliced_to_length(q, k, v), atol=1e-5, rtol=1e-5)
