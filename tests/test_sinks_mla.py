"""Attention sinks (gpt-oss) and a value head dim of its own (MLA: DeepSeek-V3): the ring op
against a dense reference at p = 1..4 (out, lse and every gradient, the sinks' included), and
the compiled backend against eager on the attention forms the models write."""

import pytest
import torch
import torch.nn.functional as F

import ringcc
from ringcc.runtime import layout as L
from shard_models import capturing

TOL = dict(atol=1e-5, rtol=1e-5)


def dense(q, k, v, *, is_causal=False, key_padding_mask=None, sinks=None, scale=None):
    """(out, lse) of softmax attention with every key's mask and, per head, a sink logit in every
    row's denominator (gpt-oss's eager form: the sink column appended, then dropped)."""
    b, h, n, d = q.shape
    k, v = k.repeat_interleave(h // k.shape[1], 1), v.repeat_interleave(h // v.shape[1], 1)
    s = q @ k.transpose(-1, -2) * (d ** -0.5 if scale is None else scale)
    if is_causal:
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    if key_padding_mask is not None:
        s = s.masked_fill(key_padding_mask[:, None, None, :], float("-inf"))
    if sinks is not None:
        s = torch.cat([s, sinks.reshape(1, -1, 1, 1).expand(b, -1, n, -1)], -1)
    lse = s.logsumexp(-1)
    p = torch.softmax(s, -1)[..., :n].nan_to_num(0.0)  # a row with no key and no sink: 0
    return p @ v, lse


def case_ring(rank, world, is_causal, layout, g, dv, padded, with_sinks):
    import torch.distributed as dist

    gen = torch.Generator().manual_seed(7)
    b, h, n, d = 2, 4, 8 * world, 12
    q, k = torch.randn(b, h, n, d, generator=gen), torch.randn(b, g, n, d, generator=gen)
    v, dout = torch.randn(b, g, n, dv, generator=gen), torch.randn(b, h, n, dv, generator=gen)
    sinks = torch.randn(h, generator=gen) if with_sinks else None
    kpm = None
    if padded:
        kpm = torch.rand(b, n, generator=gen) < 0.3
        kpm[0] = True  # batch row 0: every key padded
    leaves = [t.clone().requires_grad_() for t in (q, k, v)] + ([sinks.clone().requires_grad_()] if with_sinks else [])
    ref_out, ref_lse = dense(*leaves[:3], is_causal=is_causal, key_padding_mask=kpm, sinks=leaves[3] if with_sinks else None)
    ref_out.backward(dout)
    lay = L.Layout(layout)
    sh = lambda t: L.shard(t, 2, rank, world, lay)  # noqa: E731
    ql, kl, vl = (sh(t).requires_grad_() for t in (q, k, v))
    sl = sinks.clone().requires_grad_() if with_sinks else None
    out, lse = ringcc.ring_attention(ql, kl, vl, is_causal=is_causal, layout=layout, return_lse=True, sinks=sl,
                                     key_padding_mask=None if kpm is None else L.shard(kpm, 1, rank, world, lay))
    out.backward(sh(dout))
    assert out.shape == (b, h, n // world, dv)
    torch.testing.assert_close(out, sh(ref_out.detach()), **TOL)
    torch.testing.assert_close(lse, sh(ref_lse.detach()), **TOL)
    for got, ref in zip((ql.grad, kl.grad, vl.grad), leaves[:3]):
        torch.testing.assert_close(got, sh(ref.grad), **TOL)
    if with_sinks:  # each rank's share of the sinks' gradient, summed as any parameter's
        dsinks = sl.grad.clone()
        if world > 1:
            dist.all_reduce(dsinks)
        torch.testing.assert_close(dsinks, leaves[3].grad, **TOL)
    return True


@pytest.mark.parametrize("world", [2, *(pytest.param(p, marks=pytest.mark.soak) for p in (1, 3, 4))])
@pytest.mark.parametrize("is_causal,layout", [(True, "zigzag"), pytest.param(False, "contiguous", marks=pytest.mark.soak)])
def test_ring_with_sinks_and_a_narrower_value_head_dim(pools, world, is_causal, layout):
    assert all(pools(world).run(case_ring, is_causal, layout, 2, 8, False, True))


@pytest.mark.soak
@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("is_causal,layout", [(True, "zigzag"), (True, "contiguous"), (False, "contiguous")])
@pytest.mark.parametrize("g,dv", [(4, 8), (1, 16), (2, 12)])
@pytest.mark.parametrize("padded,with_sinks", [(False, False), (True, True), (True, False)])
def test_ring_sinks_and_value_head_dims(pools, world, is_causal, layout, g, dv, padded, with_sinks):
    assert all(pools(world).run(case_ring, is_causal, layout, g, dv, padded, with_sinks))


def test_sinks_of_the_wrong_shape_are_an_error():
    q = torch.randn(1, 4, 8, 8)
    with pytest.raises(ValueError, match=r"sinks must be a float tensor \[heads=4\] on cpu .* got torch.float32 \(2,\)"):
        ringcc.ring_attention(q, q, q, sinks=torch.zeros(2))


# ---------------------------------------------------------------------------------------
# compiled: the forms the models write


class SinkAttention(torch.nn.Module):
    """gpt-oss's eager attention in miniature: GQA by repeat, an additive causal mask, the sinks'
    column appended to the scores, a row shift by the max, softmax, the column dropped."""

    def __init__(self, hidden=32, heads=4, kv_heads=2, head_dim=8):
        super().__init__()
        self.h, self.g, self.d = heads, kv_heads, head_dim
        self.q = torch.nn.Linear(hidden, heads * head_dim)
        self.kv = torch.nn.Linear(hidden, 2 * kv_heads * head_dim)
        self.o = torch.nn.Linear(heads * head_dim, hidden)
        self.sinks = torch.nn.Parameter(torch.randn(heads))
        self.register_buffer("proj", torch.randn(hidden, hidden))

    def mask(self, n: int, dtype):
        return torch.full((n, n), torch.finfo(dtype).min).triu(1)[None, None]

    def forward(self, x):
        b, n, _ = x.shape
        q = self.q(x).view(b, n, self.h, self.d).transpose(1, 2)
        k, v = self.kv(x).view(b, n, 2, self.g, self.d).permute(2, 0, 3, 1, 4)
        k, v = (t.repeat_interleave(self.h // self.g, 1) for t in (k, v))
        w = torch.matmul(q, k.transpose(2, 3)) * self.d ** -0.5 + self.mask(n, x.dtype)
        sinks = self.sinks.reshape(1, -1, 1, 1).expand(b, -1, n, -1)
        combined = torch.cat([w, sinks], dim=-1)
        combined = combined - combined.max(dim=-1, keepdim=True).values
        p = F.softmax(combined, dim=-1, dtype=combined.dtype)[..., :-1]
        out = torch.matmul(p, v).transpose(1, 2).reshape(b, n, -1)
        return (self.o(out) @ self.proj).pow(2).mean()


class MlaAttention(torch.nn.Module):
    """DeepSeek-V3's attention shapes in miniature: a q/k head dim of 12 (8 plain features and 4
    rotary ones shared by the heads, rotated as complex numbers as Llama 4 does, the key states
    written into a new_empty by two copies as DeepSeek-V3's expand_kv does), a value head dim of
    8, SDPA with is_causal."""

    def __init__(self, hidden=32, heads=4, nope=8, rot=4, v_dim=8):
        super().__init__()
        self.h, self.nope, self.rot, self.dv = heads, nope, rot, v_dim
        self.q = torch.nn.Linear(hidden, heads * (nope + rot))
        self.kv = torch.nn.Linear(hidden, heads * (nope + v_dim))
        self.k_rot = torch.nn.Linear(hidden, rot)
        self.o = torch.nn.Linear(heads * v_dim, hidden)
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, rot, 2).float() / rot))
        self.register_buffer("proj", torch.randn(hidden, hidden))

    def rotate(self, x, cis):
        pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
        return torch.view_as_real(pairs * cis).flatten(-2).type_as(x)

    def forward(self, x):
        b, n, _ = x.shape
        freqs = torch.outer(torch.arange(n).float(), self.inv_freq)
        cis = torch.polar(torch.ones_like(freqs), freqs)  # [n, rot / 2]
        q = self.q(x).view(b, n, self.h, self.nope + self.rot).transpose(1, 2)
        q = torch.cat([q[..., :self.nope], self.rotate(q[..., self.nope:], cis)], -1)
        k_nope, v = self.kv(x).view(b, n, self.h, self.nope + self.dv).transpose(1, 2).split([self.nope, self.dv], -1)
        k_rot = self.rotate(self.k_rot(x).view(b, 1, n, self.rot), cis).expand(-1, self.h, -1, -1)
        k = k_nope.new_empty(b, self.h, n, self.nope + self.rot)
        k[..., :self.nope].copy_(k_nope)
        k[..., self.nope:].copy_(k_rot)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=(self.nope + self.rot) ** -0.5)
        return (self.o(out.transpose(1, 2).reshape(b, n, -1)) @ self.proj).pow(2).mean()


class PaddedSinkAttention(SinkAttention):
    """gpt-oss's eager attention under transformers' eager mask of a left-padded batch:
    where(causal & padding, tensor(0.0), finfo.min). A padded row has every key masked and puts its
    whole weight on its sink (eager's sink outweighs the finite fill), as the ring does: no row is
    without a key, and nothing is filled in after the ring."""

    def mask(self, n: int, dtype):
        i = torch.arange(n)
        allowed = (i[None, :] <= i[:, None]) & (i > n // 2)  # left padding past the first shard
        return torch.where(allowed, torch.tensor(0.0, dtype=dtype), torch.finfo(dtype).min)


MODELS = {"sinks": SinkAttention, "mla": MlaAttention, "padded_sinks": PaddedSinkAttention}


def case_compiled(rank, world, name):
    torch.manual_seed(0)
    ref = MODELS[name]()
    model = MODELS[name]()
    model.load_state_dict(ref.state_dict())
    x = torch.randn(2, 8 * world, 32)
    ringcc.reset_reports()
    backend, graphs = capturing(ringcc.Config(inner="aot_eager", strict=True))
    loss = torch.compile(model, backend=backend)(x)
    ref_loss = ref(x)
    loss.backward()
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss, **TOL)
    ref_grads = dict(ref.named_parameters())
    assert {n for n, p in model.named_parameters() if p.grad is None} == \
        {n for n, p in ref_grads.items() if p.grad is None}
    for pname, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref_grads[pname].grad, **TOL)
    sites = [(s.decision.value, s.mask, s.detail) for r in ringcc.reports() for s in r.sites]
    fills = sum(n.target is torch.ops.ringcc.fill_empty_rows.default for g in graphs for n in g.graph.nodes)
    return sites, [g.why for r in ringcc.reports() for g in r.gathers], fills


@pytest.mark.parametrize("name", ["sinks", "mla", "padded_sinks"])
@pytest.mark.parametrize("world", [2, *(pytest.param(p, marks=pytest.mark.soak) for p in (1, 3, 4))])
def test_compiled_sinks_and_mla_match_eager(pools, name, world):
    for sites, gathers, fills in pools(world).run(case_compiled, name, timeout=600):
        assert [d for d, _, _ in sites] == ["rewritten"], sites
        assert gathers == [], gathers
        if name != "mla":
            assert sites[0][1]["sinks"], sites
        if name == "padded_sinks":  # a finite fill, and no row without its sink: nothing filled in
            assert sites[0][1]["fill"] and "every key masked" not in sites[0][2] and fills == 0, (sites, fills)


def test_opcheck_with_sinks_and_a_value_head_dim():
    gen = torch.Generator().manual_seed(3)
    q, k = torch.randn(1, 4, 8, 12, generator=gen), torch.randn(1, 2, 8, 12, generator=gen)
    v, sinks = torch.randn(1, 2, 8, 8, generator=gen), torch.randn(4, generator=gen)
    q, k, v, sinks = (t.requires_grad_() for t in (q, k, v, sinks))
    torch.library.opcheck(torch.ops.ringcc.ring_attention.default, (q, k, v, None, True, 0.3, "", 1, "contiguous"),
                          {"sinks": sinks})


# ---------------------------------------------------------------------------------------
# nothing silent: every attention-like op is in the report, a dense site warns


class DropoutAttention(torch.nn.Module):
    """SDPA with attention dropout in training: a site the ring cannot take (kept dense)."""

    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, dropout_p=0.5, is_causal=True).sum()


def test_a_dense_site_warns_once_and_strict_raises():
    q = torch.randn(1, 2, 16, 8)
    ringcc.reset_reports()
    torch._dynamo.reset()
    with pytest.warns(UserWarning) as got:
        torch.compile(DropoutAttention(), backend=ringcc.backend(inner="eager"))(q, q, q)
    lines = [str(w.message) for w in got if str(w.message).startswith("ringcc:")]
    assert len(lines) == 1 and "\n" not in lines[0], lines
    assert "1 of 1 attention site(s)" in lines[0] and "left dense" in lines[0] and "O(n) memory per rank" in lines[0]
    assert "sdpa at test_sinks_mla.py:" in lines[0] and "dropout" in lines[0], lines[0]
    torch._dynamo.reset()
    with pytest.raises(Exception, match=r"Config\(strict=True\) but 1 attention site\(s\) were not rewritten"):
        torch.compile(DropoutAttention(), backend=ringcc.backend(inner="eager", strict=True))(q, q, q)


def test_flex_attention_calls_and_unread_softmax_attention_are_reported():
    from graphs import dynamo_graph, make_ctx
    from ringcc.passes.canonicalize_attention import canonicalize_attention
    from ringcc.passes.lift_masks import lift_masks
    from torch.nn.attention.flex_attention import flex_attention

    def f(q, k, v):
        flex = flex_attention(q, k, v, score_mod=lambda s, b, h, i, j: torch.sin(s) + (i - j))
        s = (q @ k.transpose(-1, -2)).sin()  # scores through an op the matcher does not read
        return flex.sum() + (torch.softmax(s, -1) @ v).sum()

    q = torch.randn(1, 2, 16, 8)
    gm = dynamo_graph(f, q, q, q)
    ctx = make_ctx()
    canonicalize_attention(gm, ctx)
    lift_masks(gm, ctx)  # flex_attention calls are its sites (a score_mod it does not read: skipped)
    got = sorted((s.form, s.decision.value, s.reason.value) for s in ctx.report.sites)
    assert got == [("flex", "skipped", "unsupported_mask"), ("manual", "skipped", "other")], ctx.report.sites
    (flex,) = [s for s in ctx.report.sites if s.form == "flex"]
    assert "score_mod" in flex.detail and "sin" in flex.detail, flex.detail


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kernel", ["cudnn", "flash"])
@pytest.mark.parametrize("dv,padded", [(8, False), (16, False), (8, True)])
def test_cuda_kernels_with_sinks_and_a_value_head_dim(monkeypatch, kernel, dv, padded):
    """One CUDA device, bf16: the fused kernels (zero-padded features), and flex for masked
    blocks, against the fp32 dense reference; sinks' gradient included."""
    monkeypatch.setenv("RINGCC_CUDA_KERNEL", kernel)
    gen = torch.Generator().manual_seed(5)
    b, h, g, n, d = 2, 4, 2, 256, 12
    q, k = torch.randn(b, h, n, d, generator=gen), torch.randn(b, g, n, d, generator=gen)
    v, dout, sinks = torch.randn(b, g, n, dv, generator=gen), torch.randn(b, h, n, dv, generator=gen), torch.randn(h, generator=gen)
    kpm = (torch.rand(b, n, generator=gen) < 0.2) if padded else None
    ref = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
    ref_out, _ = dense(*ref[:3], is_causal=True, key_padding_mask=kpm, sinks=ref[3])
    ref_out.backward(dout)
    got = [t.cuda().bfloat16().requires_grad_() if i < 3 else t.cuda().requires_grad_() for i, t in enumerate((q, k, v, sinks))]
    out = ringcc.ring_attention(*got[:3], is_causal=True, sinks=got[3],
                                key_padding_mask=None if kpm is None else kpm.cuda())
    out.backward(dout.cuda().bfloat16())
    for x, want in [(out, ref_out)] + [(a.grad, r.grad) for a, r in zip(got, ref)]:
        err = float((x.float().cpu() - want).abs().max() / want.abs().max())
        assert err < 2e-2, err
