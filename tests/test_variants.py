"""Attention variants: score functions (soft-capping, ALiBi) in the ring against the dense
reference, the lifted specs of the sites that carry them, Falcon's multi-query form, sites the
matcher cannot take reported as skipped, and the lifted specs of Hugging Face models that use
them (the `zoo` tier; their numbers against eager: tests/zoo.py)."""

import pytest
import torch
import torch.nn.functional as F

import ringcc
from graphs import dynamo_graph, run
from parity import assert_shard_matches
from ringcc import reference
from ringcc.config import Config
from ringcc.passes.canonicalize_attention import canonicalize_attention
from ringcc.passes.lift_masks import lift_masks
from ringcc.passes.rewrite_attention import rewrite_attention
from ringcc.runtime import layout as L

ATTENTION_PASSES = [("canonicalize_attention", canonicalize_attention), ("lift_masks", lift_masks),
                    ("rewrite_attention", rewrite_attention)]

TOL = dict(atol=3e-5, rtol=1e-5)  # inputs of a few units (scores up to ~10): fp32 rounding
SLOPES = torch.tensor([0.5, 0.25, 0.125, 0.0625, 2.0**-5, 2.0**-6, 2.0**-7, 2.0**-8])


def case_ring_modified(rank, world, is_causal, layout, h, g, softcap, alibi, padded=False, window=None):
    """A rank's shard of out, lse and every gradient of the ring with score modifiers equals the
    same shard of the dense reference (fp32)."""
    n = (4 if layout == "zigzag" else 5) * world
    gen = torch.Generator().manual_seed(7)
    # scores of a few units: the cap (softcap 2) and the bias (slopes up to 0.5) both matter
    q, k, v = (torch.randn(2, x, n, 8, generator=gen) * 2 for x in (h, g, g))
    dout = torch.randn(2, h, n, 8, generator=gen)
    kpm = None
    if padded:
        kpm = torch.zeros(2, n, dtype=torch.bool)
        kpm[1, n - 3:] = True
    slopes = SLOPES[:h] if alibi else None
    mods = dict(softcap=softcap, alibi_slopes=slopes)
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    ref_out, ref_lse = reference.attention(qr, kr, vr, is_causal=is_causal, key_padding_mask=kpm, window=window,
                                           **mods)
    ref_out.backward(dout)
    lay = L.Layout(layout)
    sh = lambda t: L.shard(t, 2, rank, world, lay)  # noqa: E731
    ql, kl, vl = (sh(t).requires_grad_() for t in (q, k, v))
    kpm_l = None if kpm is None else L.shard(kpm, 1, rank, world, lay)
    out, lse = ringcc.ring_attention(ql, kl, vl, is_causal=is_causal, key_padding_mask=kpm_l, layout=layout,
                                     return_lse=True, window=window, **mods)
    out.backward(sh(dout))
    assert_shard_matches(sh, out, lse, ref_out, ref_lse,
                         ((ql.grad, qr.grad), (kl.grad, kr.grad), (vl.grad, vr.grad)), TOL)
    # the modifier changes the result: the test would see a ring that ignored it
    plain, _ = reference.attention(q, k, v, is_causal=is_causal, key_padding_mask=kpm, window=window)
    return float((plain - ref_out.detach()).abs().max())


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_ring_with_score_modifiers_matches_reference(pools, world):
    cases = [(True, "zigzag", 4, 2, 2.0, False), (False, "contiguous", 4, 1, None, True),
             (True, "contiguous", 4, 4, 3.0, True)]
    for case in cases:
        for effect in pools(world).run(case_ring_modified, *case):
            assert effect > 1e-2


@pytest.mark.parametrize("world", [2, 3])
def test_ring_with_score_modifiers_padding_and_window(pools, world):
    for effect in pools(world).run(case_ring_modified, True, "contiguous", 4, 2, 2.0, True, True, 3):
        assert effect > 1e-2


def test_flex_blocks_with_score_modifiers_share_their_programs(monkeypatch):
    """The ring's flex_attention blocks (flex.py, as on CUDA for bf16/fp16) run here on CPU in
    fp32: their traced programs over flex's own dense implementation. Zigzag, causal, GQA, ALiBi
    and soft-cap; then another soft-cap (a literal of the function: programs of its own), then the
    first soft-cap with other slopes: every block's score function takes its tensors, positions
    and offsets as arguments, so other slopes run the same programs. None falls back to the math
    path, and out, lse and gradients equal the dense reference."""
    from ringcc.runtime import flex, kernels

    monkeypatch.setattr(kernels, "flex_blocks", lambda device, dtype: True)
    monkeypatch.setattr(kernels, "_FLEX_FAILED", {})
    flex._program.cache_clear()
    n, h, g = 2 * flex.TILE, 4, 2
    gen = torch.Generator().manual_seed(3)
    programs = []
    for softcap, slopes in ((4.0, SLOPES[:h] * 4), (3.0, SLOPES[:h] * 4), (4.0, SLOPES[:h] * 2)):
        q, k, v = (torch.randn(1, x, n, 8, generator=gen) * 2 for x in (h, g, g))
        dout = torch.randn(1, h, n, 8, generator=gen)
        mods = dict(softcap=softcap, alibi_slopes=slopes)
        qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
        ref_out, ref_lse = reference.attention(qr, kr, vr, is_causal=True, **mods)
        ref_out.backward(dout)
        ql, kl, vl = (t.clone().requires_grad_() for t in (q, k, v))
        out, lse = ringcc.ring_attention(ql, kl, vl, is_causal=True, layout="zigzag", return_lse=True, **mods)
        out.backward(dout)
        assert not kernels._FLEX_FAILED, kernels._FLEX_FAILED  # flex ran every block: no math-path fallback
        assert_shard_matches(lambda t: t, out, lse, ref_out, ref_lse,
                             ((ql.grad, qr.grad), (kl.grad, kr.grad), (vl.grad, vr.grad)), TOL)
        programs.append(flex._program.cache_info().currsize)
    # a forward and a backward program per block shape and function; other slopes make none
    assert programs[0] >= 2 and programs[1] == 2 * programs[0] and programs[2] == programs[1], programs


def _block_indices(shape):
    return (torch.arange(x).view(*[-1 if d == a else 1 for d in range(4)]) for a, x in enumerate(shape))


@pytest.mark.parametrize("heads", [slice(0, 4), slice(2, 3)])
def test_flex_score_mod_is_the_math_paths_function(heads):
    """flex's score_mod of a score function (flex._score_mod: the function's tensors, the block's
    global positions and its batch and head offsets as explicit arguments) gives the math path's
    modified scores (FnScore.apply_) for calls across the zigzag jump, shifted rows and keys,
    and head chunks, and its derivative is autograd's."""
    from ringcc.runtime import flex, maskfn

    fn = maskfn.builtin_score_fn(2.5, True)
    slopes = SLOPES[:4] * 8
    q_pos = torch.cat([torch.arange(16, 21), torch.arange(45, 47)])  # a rank's two zigzag runs
    k_pos = torch.cat([torch.arange(3, 12), torch.arange(39, 41)])
    for r0, c0 in ((0, 0), (3, 7), (6, 2)):
        m = maskfn.FnScore(fn, (slopes,), q_pos, k_pos, 0, heads.start).sub(r0, c0)
        s = torch.randn(2, heads.stop - heads.start, 7 - r0, 11 - c0, generator=torch.Generator().manual_seed(r0))
        want = s.clone()
        der = m.apply_(want, keep_grad=True)
        rel = (k_pos[c0:][None, :] - q_pos[r0:][:, None]).float()
        sr = s.clone().requires_grad_()
        ref = torch.tanh(sr / 2.5) * 2.5 + slopes[heads][:, None, None] * rel
        torch.testing.assert_close(want, ref.detach())
        (grad,) = torch.autograd.grad(ref.sum(), sr)
        torch.testing.assert_close(der.expand_as(grad), grad)
        b, h, i, j = _block_indices(s.shape)
        got = flex._score_mod(m, "cpu").bound()(s, b, h, i, j)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        if r0 == 0 and c0 == 0:  # the first run of rows and keys, from their starts
            run = maskfn.FnScore(fn, (slopes,), q_pos[:5], k_pos[:9], 0, heads.start, (16, 3)).sub(1, 2)
            assert run.starts == (17, 5)
            part = s[:, :, 1:5, 2:9]
            got = flex._score_mod(run, "cpu").bound()(part, *_block_indices(part.shape))
            torch.testing.assert_close(got, want[:, :, 1:5, 2:9], rtol=1e-6, atol=1e-6)


def test_flex_score_mod_runs_in_flex_attention():
    """flex's score_mod of a score function in flex_attention (its forward runs on CPU) gives the
    math path's block (out, lse) under the same function."""
    from torch.nn.attention.flex_attention import AuxRequest, flex_attention

    from ringcc.runtime import flex, kernels, maskfn

    fn = maskfn.builtin_score_fn(3.0, True)
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 4, 16, 8, generator=gen) * 2 for _ in range(3))
    q_pos, k_pos = torch.arange(16, 32), torch.arange(0, 16)
    slopes = SLOPES[:4]
    mod = maskfn.FnScore(fn, (slopes,), q_pos, k_pos)
    out, aux = flex_attention(q, k, v, score_mod=flex._score_mod(mod, "cpu").bound(), scale=0.3,
                              return_aux=AuxRequest(lse=True))
    want_out, want_lse = kernels._math_fwd(q, k, v, 0.3, False, mod=mod)
    torch.testing.assert_close(out, want_out, **TOL)
    torch.testing.assert_close(aux.lse, want_lse, **TOL)


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_ring_positions_of_score_functions_are_the_layouts(layout):
    """The positions a ring's block call gives its score function are the layout's global
    positions of its rows and keys, for every rank and source rank, and for calls that start
    inside a block."""
    from ringcc.runtime import maskfn, ring

    fn = maskfn.builtin_score_fn(None, True)
    for world in (1, 2, 3):
        for rank in range(world):
            setup = ring.RingSetup(None, rank, world, L.Layout(layout), True, 1.0)
            mods = ring._Mods(setup, (fn, (SLOPES[:2],)), 12, 1, "cpu")
            mine = L.global_positions(rank, world, L.Layout(layout), 12)
            for src in range(world):
                want = L.global_positions(src, world, L.Layout(layout), 12)
                for x0 in (0, 5, 6):
                    m = mods.of(src, ring.BlockCall(x0, 12, x0, 12, False))
                    assert torch.equal(m.k_pos, want[x0:]) and torch.equal(m.q_pos, mine[x0:]) and m.h0 == 1


def test_score_modifier_arguments_are_checked():
    q = torch.randn(1, 4, 8, 8)
    with pytest.raises(ValueError, match="softcap must be a positive number"):
        ringcc.ring_attention(q, q, q, softcap=-1.0)
    with pytest.raises(ValueError, match=r"alibi_slopes must be a float tensor \[heads=4\]"):
        ringcc.ring_attention(q, q, q, alibi_slopes=torch.ones(3))
    with pytest.raises(ValueError, match="need no gradient"):
        ringcc.ring_attention(q, q, q, alibi_slopes=torch.ones(4, requires_grad=True))


def test_opcheck_with_score_modifiers():
    from ringcc.runtime import ops

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, 8, 8, generator=gen, requires_grad=True) for _ in range(3))
    from ringcc.runtime import maskfn

    torch.library.opcheck(ops.ring_attention_op, (q, k, v, None, True, 0.35, "", 1, "contiguous", 0, None),
                          dict(score_fn=maskfn.builtin_score_fn(2.0, True).text, score_t0=SLOPES[:4]))


# ---------------------------------------------------------------------------------------
# sites: lifted specs (structural)


def _canonical(fn, *inputs, config=None):
    """The attention passes on fn's dynamo graph: (graph, example inputs, report)."""
    gm, example_inputs = dynamo_graph(fn, *inputs, with_inputs=True)
    ctx = run(gm, ATTENTION_PASSES, config)
    return gm, example_inputs, ctx.report


def _ring_nodes(gm):
    return [n for n in gm.graph.nodes if n.target is torch.ops.ringcc.ring_attention.default]


def _softcapped(q, k, v):  # Gemma2's eager attention: scale, cap, mask, softmax, P @ v
    n = q.shape[2]
    mask = torch.zeros(n, n).masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    s = torch.matmul(q, k.transpose(2, 3)) * 0.25
    s = torch.tanh(s / 5.0) * 5.0
    return torch.matmul(F.softmax(s + mask, dim=-1, dtype=torch.float32).to(q.dtype), v)


def _qkv(h=4, g=4, n=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(2, x, n, 16, generator=gen) * 3 for x in (h, g, g)]


def test_softcap_site_is_lifted_and_rewritten():
    q, k, v = _qkv()
    gm, inputs, report = _canonical(_softcapped, q, k, v)
    (site,) = report.sites
    assert site.decision.value == "rewritten" and site.mask["causal"]
    assert site.mask["score_function"] == "scorefn v1 tensors=0; %0 = div score 5.0; %1 = tanh %0; %2 = mul %1 5.0; " \
        "return %2"
    (op,) = _ring_nodes(gm)
    assert op.kwargs["score_fn"] == site.mask["score_function"].replace("; ", "\n") and op.args[5] == 0.25
    assert not [n for n in gm.graph.nodes if n.target in (torch.tanh, F.softmax)]  # the user's nodes are gone
    torch.testing.assert_close(gm(*inputs)[0], _softcapped(q, k, v), atol=1e-5, rtol=1e-5)


def test_mask_inside_the_cap_is_part_of_the_score_function():
    """A mask added inside the cap does not hide the key: its capped score is -5, not -inf. The
    whole program is the score function, and the result is eager's."""
    def capped_after_mask(q, k, v):
        n = q.shape[2]
        mask = torch.zeros(n, n).masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        s = torch.tanh((q @ k.mT + mask) / 5.0) * 5.0
        return F.softmax(s, dim=-1) @ v

    q, k, v = _qkv()
    gm, inputs, report = _canonical(capped_after_mask, q, k, v)
    (site,) = report.sites
    assert site.decision.value == "rewritten" and not site.mask["causal"]
    assert "where" in site.mask["score_function"] and "tanh" in site.mask["score_function"]
    torch.testing.assert_close(gm(*inputs)[0], capped_after_mask(q, k, v), atol=1e-5, rtol=1e-5)


def test_softcap_site_skipped_later_keeps_the_users_nodes():
    """A shadow site the rewrite skips (a dilation it cannot take with a modifier) leaves the
    user's soft-capped attention as written, and its shadow goes."""
    from ringcc.runtime.dilated import DilatedSpec

    q, k, v = _qkv()
    cfg = Config(verify=True, dilation=DilatedSpec(segment_lengths=(4,), dilation_rates=(1,)))
    gm, inputs, report = _canonical(_softcapped, q, k, v, config=cfg)
    (site,) = report.sites
    assert site.decision.value == "skipped" and "score modifiers" in site.detail
    assert not [n for n in gm.graph.nodes if n.target is F.scaled_dot_product_attention]
    torch.testing.assert_close(gm(*inputs)[0], _softcapped(q, k, v))


def test_one_broadcast_kv_head_is_multi_query():
    def mqa(q, k, v):  # Falcon(multi_query=True): one K/V head, broadcast by SDPA itself
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def expanded(q, k, v):
        b, h, n, d = q.shape
        return F.scaled_dot_product_attention(q, k.expand(b, h, n, d), v.expand(b, h, n, d), is_causal=True)

    q, k, v = _qkv(g=1)
    for fn in (mqa, expanded):
        gm, inputs, report = _canonical(fn, q, k, v)
        (site,) = report.sites
        assert site.decision.value == "rewritten", site.detail
        (op,) = _ring_nodes(gm)
        assert op.args[1].meta["example_value"].shape[1] == 1  # K/V travel with their own head
        torch.testing.assert_close(gm(*inputs)[0], fn(q, k, v), atol=1e-5, rtol=1e-5)


def _alibi_mpt(q, k, v, query_too=False):
    """MPT's ALiBi: slopes x a [1 - L, 0] table of a longer length L, sliced to the keys; with
    query_too, a bias that also varies along the queries (not ALiBi)."""
    n, h = q.shape[2], q.shape[1]
    table = torch.arange(1 - 16, 1, dtype=torch.int32).view(1, 1, 1, 16)
    slopes = (1.0 / torch.pow(2, torch.arange(1, h + 1).float() * (8 / h))).view(1, h, 1, 1)
    bias = (table * slopes).squeeze(0)[:, 0:, 16 - n:]
    if query_too:
        bias = bias * torch.arange(n)[:, None]
    s = torch.matmul(q, k.transpose(-1, -2)) * 0.25 + bias
    s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    return F.softmax(s.float(), dim=-1) @ v


def test_alibi_site_is_lifted_and_rewritten():
    q, k, v = _qkv()
    gm, inputs, report = _canonical(_alibi_mpt, q, k, v)
    (site,) = report.sites
    assert site.decision.value == "rewritten" and site.mask["causal"]
    assert "load t0 h" in site.mask["score_function"] and "kv" in site.mask["score_function"]
    (op,) = _ring_nodes(gm)
    slopes = op.kwargs["score_t0"].meta["example_value"]
    assert tuple(slopes.shape) == (4,) and op.args[5] == 0.25
    torch.testing.assert_close(gm(*inputs)[0], _alibi_mpt(q, k, v), atol=1e-5, rtol=1e-5)


def test_bias_that_varies_along_queries_is_a_score_function():
    q, k, v = _qkv()
    gm, inputs, report = _canonical(lambda q, k, v: _alibi_mpt(q, k, v, query_too=True), q, k, v)
    (site,) = report.sites
    assert site.decision.value == "rewritten" and " q" in site.mask["score_function"]
    torch.testing.assert_close(gm(*inputs)[0], _alibi_mpt(q, k, v, query_too=True), atol=1e-5, rtol=1e-5)


def test_strict_raises_for_a_score_function_it_cannot_read():
    """Scores through an op the walk does not read (erf), or a learned bias (a parameter that needs
    a gradient): skipped with why, and an error under Config(strict=True)."""
    bias = torch.nn.Parameter(torch.randn(4, 1, 1))

    def erf_scores(q, k, v):
        return F.softmax(torch.erf(q @ k.mT * 0.25), dim=-1) @ v

    def learned(q, k, v):
        return F.softmax(q @ k.mT * 0.25 + bias * torch.arange(q.shape[2]), dim=-1) @ v

    q, k, v = _qkv()
    for fn, why in ((erf_scores, "erf"), (learned, "needs a gradient")):
        gm, _, report = _canonical(fn, q, k, v)
        (site,) = report.sites
        assert site.decision.value == "skipped" and why in site.detail, site.detail
        torch._dynamo.reset()
        with pytest.raises(Exception, match=r"Config\(strict=True\) but 1 attention site\(s\) were not rewritten"):
            torch.compile(fn, backend=ringcc.backend(inner="eager", strict=True))(q, k, v)


UNREAD_FORMS = {
    # a bias we do not lift (T5 / DeBERTa-like relative terms: data, not a slope times positions)
    "learned_bias": lambda q, k, v, bias: F.softmax(q @ k.mT * 0.25 + bias, dim=-1) @ v,
    # heads merged into the batch, a view between the scores and the softmax (Bloom's layout)
    "bmm_with_views": lambda q, k, v, bias: torch.bmm(
        F.softmax(torch.bmm(q.flatten(0, 1), k.flatten(0, 1).mT).view(q.shape[0], q.shape[1], q.shape[2], -1)
                  + bias, dim=-1).flatten(0, 1), v.flatten(0, 1)),
    "einsum": lambda q, k, v, bias: torch.einsum("bhqk,bhkd->bhqd", F.softmax(
        torch.einsum("bhqd,bhkd->bhqk", q, k) + bias, dim=-1), v),
}


@pytest.mark.parametrize("name", sorted(UNREAD_FORMS))
def test_attention_the_matcher_cannot_take_is_a_skipped_site(name):
    q, k, v = _qkv()
    bias = torch.randn(1, 4, 8, 8)
    gm, _, report = _canonical(UNREAD_FORMS[name], q, k, v, bias)
    (site,) = report.sites
    assert site.decision.value == "skipped" and site.form == "manual" and site.detail
    assert not _ring_nodes(gm)



# ---------------------------------------------------------------------------------------
# Hugging Face models (zoo tier): loss and every gradient against eager


def _hf_model(name):
    import transformers as T

    torch.manual_seed(0)
    if name == "gemma2":  # soft-capped eager attention, alternating sliding-window layers
        cfg = T.Gemma2Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8,
                             attn_logit_softcapping=0.5, attn_implementation="eager", pad_token_id=0)
        return T.Gemma2ForCausalLM(cfg)
    if name == "falcon_mq":
        cfg = T.FalconConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                             multi_query=True, new_decoder_architecture=False, alibi=False, pad_token_id=0)
        return T.FalconForCausalLM(cfg)
    if name == "mpt":  # ALiBi from a max_seq_len table, sliced to the keys
        cfg = T.MptConfig(vocab_size=128, d_model=64, n_layers=2, n_heads=4, max_seq_len=64, pad_token_id=0)
        return T.MptForCausalLM(cfg)
    if name == "bloom":  # ALiBi repeated over the batch, heads merged into it around baddbmm / bmm
        cfg = T.BloomConfig(vocab_size=128, hidden_size=64, n_layer=2, n_head=4, pad_token_id=0)
        return T.BloomForCausalLM(cfg)
    raise ValueError(name)


def _lifted_sites(model, ids, world=2):
    """The report's sites of `model` compiled for `world` ranks in this one process (the sites
    are decided before anything runs; running needs a process group, and raises without one)."""
    ringcc.reset_reports()
    torch._dynamo.reset()
    with pytest.raises(ValueError, match="no process group is initialised"):
        torch.compile(model, backend=ringcc.backend(ringcc.Config(world_size=world, inner="eager")))(
            input_ids=ids, labels=ids, use_cache=False)
    return [s for r in ringcc.reports() for s in r.sites]


@pytest.mark.zoo
@pytest.mark.parametrize("name", ["gemma2", "falcon_mq", "mpt", "bloom"])
def test_hf_model_sites_carry_their_modifiers(name):
    """Every site of these models is rewritten with its modifier in the lifted spec: Gemma2's
    cap on every layer and its window on the sliding ones, MPT's and Bloom's ALiBi slopes.
    Their loss and every gradient against eager at p = 2 and 4: the zoo (tests/zoo.py)."""
    ids = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(1))
    sites = _lifted_sites(_hf_model(name).train(), ids)
    assert sites and all(s.decision.value == "rewritten" for s in sites), sites
    if name == "gemma2":
        assert all("tanh" in s.mask["score_function"] for s in sites)
        assert sorted(s.mask["window"] or 0 for s in sites) == [0, 8]
    if name in ("mpt", "bloom"):
        assert all("load t0" in s.mask["score_function"] for s in sites)


@pytest.mark.zoo
def test_deberta_relative_position_attention_is_found_and_skipped():
    """DeBERTa-v2 adds disentangled relative-position terms (content-to-position and back, data
    gathered from a relative-position table) to its scores: every site is found and reported
    skipped with the reason, and the plan does not claim O(n/p) while they run dense."""
    import transformers as T

    torch.manual_seed(0)
    cfg = T.DebertaV2Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, max_position_embeddings=64, relative_attention=True,
                            pos_att_type=["p2c", "c2p"], position_buckets=16, pad_token_id=0)
    model = T.DebertaV2ForMaskedLM(cfg).train()
    ids = torch.randint(1, 128, (2, 32), generator=torch.Generator().manual_seed(1))
    ringcc.reset_reports()
    torch._dynamo.reset()
    torch.compile(model, backend=ringcc.backend(ringcc.Config(world_size=2, inner="eager")))(input_ids=ids, labels=ids)
    (report,) = ringcc.reports()
    assert len(report.sites) == 2 and report.rewritten == []
    assert all("attention scores go through add" in s.detail for s in report.skipped), report.skipped
    assert report.plan is not None and not report.plan.verdict


# ---------------------------------------------------------------------------------------
# GPU (NCCL): score functions on flex_attention (bf16) and the math path (fp32)

N_GPU = torch.cuda.device_count() if torch.cuda.is_available() else 0
GPU_WORLDS = [w for w in (1, 2, 4) if w <= N_GPU]


def case_ring_modified_cuda(rank, world, dtype_name, is_causal, layout, softcap, alibi, padded, window):
    """Errors (max-norm relative; LSE absolute) of a rank's shard of out, lse and gradients
    against the fp32 dense reference, 256 tokens per rank, GQA 8 / 2, d = 128."""
    from parity import lse_err, rel_err

    dev, dtype = torch.device("cuda", rank), getattr(torch, dtype_name)
    n, b, h, g, d = 256 * world, 2, 8, 2, 128
    gen = torch.Generator().manual_seed(7)
    q, k, v, dout = (torch.randn(b, x, n, d, generator=gen).to(dev) for x in (h, g, g, h))
    kpm = None
    if padded:
        kpm = torch.zeros(b, n, dtype=torch.bool, device=dev)
        kpm[1, n - n // 5:] = True
    mods = dict(softcap=softcap, alibi_slopes=SLOPES[:h].to(dev) if alibi else None)
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    ref, ref_lse = reference.attention(qr, kr, vr, is_causal=is_causal, key_padding_mask=kpm, window=window, **mods)
    ref.backward(dout)
    lay = L.Layout(layout)
    sh = lambda t, dim=2: L.shard(t, dim, rank, world, lay)  # noqa: E731
    ql, kl, vl = (sh(t).to(dtype).requires_grad_() for t in (q, k, v))
    out, lse = ringcc.ring_attention(ql, kl, vl, is_causal=is_causal, layout=layout, return_lse=True, window=window,
                                     key_padding_mask=None if kpm is None else sh(kpm, 1), **mods)
    out.backward(sh(dout).to(dtype))
    from ringcc.runtime import kernels

    # bf16 blocks with a score function run flex_attention (fp32 ones the math path), none
    # after flex failed for them
    assert not kernels._FLEX_FAILED and not kernels.FLEX_FALLBACKS, (kernels._FLEX_FAILED, kernels.FLEX_FALLBACKS)
    return {"out": rel_err(out, sh(ref.detach())), "lse": lse_err(lse, sh(ref_lse.detach())),
            "dq": rel_err(ql.grad, sh(qr.grad)), "dk": rel_err(kl.grad, sh(kr.grad)), "dv": rel_err(vl.grad, sh(vr.grad))}


@pytest.mark.gpu
@pytest.mark.skipif(not GPU_WORLDS, reason="needs a CUDA device")
@pytest.mark.parametrize("world", GPU_WORLDS)
@pytest.mark.parametrize("dtype_name,tol", [("bfloat16", 2e-2), ("float32", 1e-4)])
@pytest.mark.parametrize("is_causal,layout,softcap,alibi,padded,window", [
    (True, "zigzag", 2.0, False, False, None), (False, "contiguous", None, True, False, None),
    (True, "contiguous", 2.0, True, True, 100)])
def test_ring_with_score_modifiers_on_cuda(pools, world, dtype_name, tol, is_causal, layout, softcap, alibi, padded,
                                           window):
    for errs in pools(world, "nccl").run(case_ring_modified_cuda, dtype_name, is_causal, layout, softcap, alibi,
                                         padded, window):
        for name, err in errs.items():
            assert err < (0.05 if name == "lse" and dtype_name == "bfloat16" else tol), (name, err, errs)


# ---------------------------------------------------------------------------------------
# Hugging Face score functions at p = 2 (default tier): loss and every gradient against eager


# Bloom (ALiBi) in the soak tier; ALiBi's score function is checked at the ring in make test
@pytest.mark.parametrize("name", ["gemma2", pytest.param("bloom", marks=pytest.mark.soak)])
def test_hf_score_functions_match_eager_p2(pools, name):
    """Gemma2 in its default config (soft-capped eager attention, cap 50) and Bloom (ALiBi in
    baddbmm): every site rewritten with its score function; the loss, every gradient and the set
    of parameters with a gradient equal eager's (zoo.check)."""
    import zoo

    for rank, res in enumerate(pools(2).run(zoo.run_arch, name, ("loss_inside",), timeout=600)):
        assert zoo.check(zoo.BY_NAME[name], res) == [], (rank, res)
