"""Masks read as functions (runtime/maskfn.py, passes/extract_mask.py): the text form, extraction
from hand-written mask subgraphs (checked against the mask eager code computes), and ring
attention under those functions at p = 1..4 against eager SDPA (outputs, every gradient, and
which parameters have one)."""

from __future__ import annotations

import contextlib
import math
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from graphs import dynamo_graph, lifted_dense, node_values, run

import ringcc
from ringcc.passes.attention_form import MASK_META, SKIP_META, is_sdpa
from ringcc.passes.canonicalize_attention import canonicalize_attention
from ringcc.passes.lift_masks import lift_masks
from ringcc.passes.rewrite_attention import rewrite_attention
from ringcc.runtime import maskfn

PASSES = [("canonicalize_attention", canonicalize_attention), ("lift_masks", lift_masks)]

DOC_TEXT = """maskfn v1 tensors=1
%0 = load t0 b q
%1 = load t0 b kv
%2 = eq %0 %1
%3 = le kv q
%4 = and %2 %3
return %4"""


# ---------------------------------------------------------------------------------------
# the text form


def test_text_round_trips_and_evaluates_at_any_broadcast_shape():
    fn = maskfn.parse(DOC_TEXT)
    assert fn.text == DOC_TEXT and maskfn.parse(fn.text) is fn  # parsed once per text
    assert fn.indices == {"b", "q", "kv"} and fn.roles == {0: {"q", "kv"}}
    doc = torch.tensor([[0, 0, 1, 1, 1, 2, 2, 2]])
    i = torch.arange(8)
    dense = fn(torch.zeros(1, 1, 1, 1, dtype=torch.long), 0, i[None, None, :, None], i[None, None, None, :], (doc,))
    want = (doc[0, :, None] == doc[0, None, :]) & (i[None, :] <= i[:, None])
    assert torch.equal(dense[0, 0], want)
    # scalar tensors, as flex_attention's vmap hands a mask_mod
    assert bool(fn(torch.tensor(0), torch.tensor(0), torch.tensor(4), torch.tensor(2), (doc,)))
    assert not bool(fn(torch.tensor(0), torch.tensor(0), torch.tensor(5), torch.tensor(4), (doc,)))


@pytest.mark.parametrize("text, match", [
    ("%0 = le kv q\nreturn %0", "starts with 'maskfn v1"),
    ("maskfn v1 tensors=0\n%0 = frob kv q\nreturn %0", "unknown op 'frob'"),
    ("maskfn v1 tensors=0\n%0 = le kv %3\nreturn %0", "not an earlier line"),
    ("maskfn v1 tensors=1\n%0 = load t1 b q\nreturn %0", "the function has 1 tensors"),
    ("maskfn v1 tensors=0\n%0 = le kv\nreturn %0", "le takes 2 operands"),
])
def test_malformed_text_is_an_error_that_says_what_is_wrong(text, match):
    with pytest.raises(ValueError, match=match):
        maskfn.parse(text)


def test_split_skips_empty_tiles_and_runs_full_tiles_unmasked():
    fn = maskfn.parse("maskfn v1 tensors=1\n%0 = load t0 b q\n%1 = load t0 b kv\n%2 = eq %0 %1\nreturn %2")
    n = 2 * maskfn.SPLIT_ROWS
    doc = torch.zeros(1, 2 * n, dtype=torch.long)
    doc[:, n // 2 + 64:] = 1  # document 0: positions 0 .. n/2 + 63
    pos = torch.arange(2 * n)
    maskfn.reset_stats()
    assert maskfn.split(maskfn.FnMask(fn, (doc,), pos[n:], pos[:n // 2], 1, 1)) == ("empty", [])
    assert maskfn.split(maskfn.FnMask(fn, (doc,), pos[:n // 2], pos[:n // 2], 1, 1, causal=True)) == ("full", [])
    state, calls = maskfn.split(maskfn.FnMask(fn, (doc,), pos[:n], pos[:n], 1, 1))
    t, s = maskfn.TILE, maskfn.SPLIT_ROWS
    # rows 0..511 (document 0): its keys in full tiles up to the tile holding the boundary, which
    # is partial, then none; rows 512..1023 start with 64 rows of document 0: every tile partial
    assert state == "partial"
    assert calls == [(0, s, 0, n // 2, False), (0, s, n // 2, n // 2 + t, True), (s, n, 0, n, True)], calls
    st = maskfn.STATS
    assert (st["empty"], st["full"], st["partial"]) == (1, 1, 1)
    assert (st["calls_unmasked"], st["calls_masked"]) == (1, 2)
    assert st["pairs"] == (n // 2) * (n // 2 + 1) // 2 + (n // 2 + 64) ** 2 + (n // 2 - 64) ** 2


# ---------------------------------------------------------------------------------------
# extraction: the function equals the mask eager code computes, on every input


def _dense_tile_states(m, tile):
    """(any, all) per tile x tile tile of FnMask m's dense mask, over its real pairs."""
    d = m.rows(0, m.q_pos.shape[0])
    lq, lk = d.shape[-2:]
    qt, kt = -(-lq // tile), -(-lk // tile)
    anyt = torch.zeros(*d.shape[:2], qt, kt, dtype=torch.bool)
    allt = torch.zeros_like(anyt)
    for i in range(qt):
        for j in range(kt):
            t = d[:, :, i * tile:(i + 1) * tile, j * tile:(j + 1) * tile].flatten(2)
            anyt[:, :, i, j], allt[:, :, i, j] = t.any(-1), t.all(-1)
    return anyt, allt


BOUND_CASES = {  # mask text, its tensors (b = 2, n = 200)
    "documents": ("maskfn v1 tensors=1\n%0 = load t0 b q\n%1 = load t0 b kv\n%2 = eq %0 %1\n%3 = le kv q\n"
                  "%4 = and %2 %3\nreturn %4", "docs"),
    "chunked": ("maskfn v1 tensors=0\n%0 = floordiv q 60\n%1 = floordiv kv 60\n%2 = eq %0 %1\nreturn %2", None),
    "prefix": ("maskfn v1 tensors=0\n%0 = le kv q\n%1 = lt kv 40\n%2 = or %0 %1\nreturn %2", None),
    "window": ("maskfn v1 tensors=0\n%0 = sub q kv\n%1 = abs %0\n%2 = lt %1 30\nreturn %2", None),
    "padding": ("maskfn v1 tensors=1\n%0 = load t0 b kv\n%1 = not %0\n%2 = where %1 false true\n"
                "%3 = le kv q\n%4 = and %2 %3\nreturn %4", "pad"),
    "heads": ("maskfn v1 tensors=0\n%0 = remainder h 2\n%1 = mul %0 50\n%2 = sub q kv\n%3 = ge %2 %1\n"
              "return %3", None),
}


@pytest.mark.parametrize("name", sorted(BOUND_CASES))
def test_tile_states_from_bounds_are_sound_and_tight_on_runs(name):
    """maskfn.tile_states (Note [Tile bounds]) against the dense mask: never a full tile with a
    hidden pair or an empty tile with an allowed one; with positions in runs that do not jump
    inside a tile, exactly the dense tiles. A causal call across a zigzag jump stays sound."""
    text, kind = BOUND_CASES[name]
    n, tile = 200, 16
    gen = torch.Generator().manual_seed(0)
    tensors = ()
    if kind == "docs":
        tensors = (torch.cumsum(torch.rand(2, n, generator=gen) < 0.03, 1),)
    elif kind == "pad":
        valid = torch.rand(2, n, generator=gen) > 0.3
        valid[0, 48:128] = True
        tensors = (valid,)
    fn = maskfn.parse(text)
    cases = [(torch.arange(n), torch.arange(n), False, True),
             (torch.cat([torch.arange(64), 120 + torch.arange(64)]), torch.arange(16, 144), True, False)]
    for q_pos, k_pos, causal, exact in cases:
        m = maskfn.FnMask(fn, tensors, q_pos, k_pos, 2, 4, causal=causal)
        some, full = maskfn.tile_states(m, tile)
        anyt, allt = _dense_tile_states(m, tile)
        some, full = some.expand_as(anyt), full.expand_as(anyt)
        assert not bool((anyt & ~some).any()), "an allowed pair in a tile called empty"
        assert not bool((full & ~allt).any()), "a hidden pair in a tile called full"
        if exact:
            assert torch.equal(some, anyt) and torch.equal(full, allt)
        assert bool((some & ~full).any()) and bool(anyt.any())


def test_a_call_state_is_built_once_per_mask_and_again_when_the_mask_changes(monkeypatch):
    """maskfn.memo (Note [Built once per mask]): the layers of a step reuse a call's state; an
    in-place write to the mask tensor, a new mask tensor, or positions that are data (no `where`)
    build it again, so a state never outlives the values it was built from."""
    fn, n = maskfn.parse("maskfn v1 tensors=1\n%0 = load t0 b q\n%1 = load t0 b kv\n%2 = eq %0 %1\nreturn %2"), 256
    built = []
    real = maskfn.tile_states
    monkeypatch.setattr(maskfn, "tile_states", lambda m, tile=None: built.append(1) or real(m, tile))
    doc = torch.zeros(1, n, dtype=torch.long)
    pos = torch.arange(n)

    def state(doc, where=("contiguous", 1, n, 0, 0, 0, n, 0, n, "cpu")):
        return maskfn.classify(maskfn.FnMask(fn, (doc,), pos, pos, 1, 2, where=where), 64)

    assert state(doc) == "full" and len(built) == 1
    assert state(doc) == "full" and len(built) == 1  # the next layer: reused
    doc[0, n // 2:] = 1  # a second document, written in place
    assert state(doc) == "partial" and len(built) == 2
    assert state(torch.zeros(1, n, dtype=torch.long)) == "full" and len(built) == 3  # a new batch
    assert state(doc, where=None) == "partial" and len(built) == 4
    assert state(doc, where=None) == "partial" and len(built) == 5  # positions that are data: never kept


def _ar(q):
    return torch.arange(q.shape[2], device=q.device)


def _doc_ids(pos):
    return (torch.diff(pos, prepend=pos[:, :1] - 1) != 1).cumsum(-1)


def documents(q, pos, valid):
    i = _ar(q)
    d = _doc_ids(pos)
    return (d[:, None, :, None] == d[:, None, None, :]) & (i[None, :] <= i[:, None])


def documents_window(q, pos, valid):
    i = _ar(q)
    d = _doc_ids(pos)
    near = (i[:, None] - i[None, :]) < 3
    return (d[:, None, :, None] == d[:, None, None, :]) & (i[None, :] <= i[:, None]) & near


def documents_additive(q, pos, valid):
    d = _doc_ids(pos)
    n = q.shape[2]
    m = torch.full((q.shape[0], 1, n, n), float("-inf"), device=q.device).triu(1)
    return m.masked_fill(d[:, None, :, None] != d[:, None, None, :], float("-inf"))


def chunked(q, pos, valid):
    i = _ar(q)
    return (i[:, None] // 4 == i[None, :] // 4) & (i[None, :] <= i[:, None])


def prefix_lm(q, pos, valid):
    i = _ar(q)
    return (i[None, :] <= i[:, None]) | (i[None, :] < 5)


def left_padding_causal(q, pos, valid):
    i = _ar(q)
    return torch.where((i[None, :] <= i[:, None]) & valid[:, None, None, :].bool(), 0.0, float("-inf"))


def bidirectional_padding(q, pos, valid):
    return valid[:, None, None, :].bool().expand(-1, 1, q.shape[2], -1)


def position_causal(q, pos, valid):
    """Causality read from the position ids themselves (restarting positions: within a document)."""
    d = _doc_ids(pos)
    return (pos[:, None, None, :] <= pos[:, None, :, None]) & (d[:, None, :, None] == d[:, None, None, :])


def inverted_padding(q, pos, valid):
    """An additive padding mask as transformers 4.x's encoders build it: 1 - mask, then the
    finite minimum wherever that is non-zero."""
    inverted = 1.0 - valid[:, None, None, :].expand(-1, 1, q.shape[2], -1).to(q.dtype)
    return inverted.masked_fill(inverted.to(torch.bool), torch.finfo(q.dtype).min)


def written_causal_padding(q, pos, valid):
    """A causal padding mask written in place, as transformers 4.x's decoders build it with a
    cache position (_prepare_4d_causal_attention_mask_with_cache_position): a triangle of the
    finite minimum, multiplied in place, then its padded keys written through a slice."""
    n, low = q.shape[2], torch.finfo(q.dtype).min
    mask = torch.full((n, n), low, dtype=q.dtype, device=q.device).triu(1)
    mask *= _ar(q) > _ar(q).reshape(-1, 1)
    mask = mask[None, None, :, :].expand(q.shape[0], 1, -1, -1).clone()
    padding = (mask[:, :, :, :n] + valid[:, None, None, :]) == 0
    mask[:, :, :, :n] = mask[:, :, :, :n].masked_fill(padding, low)
    return mask


def vmapped_padding_causal(q, pos, valid):
    """A mask function vmapped over (b, h, q, kv), one torch.vmap per index, as transformers
    4.57 builds its SDPA masks (masking_utils._vmap_for_bhqkv)."""
    def allowed(b, h, i, j):
        return (j <= i) & valid.bool()[b, j]

    fn = allowed
    for dims in ((None, None, None, 0), (None, None, 0, None), (None, 0, None, None), (0, None, None, None)):
        fn = torch.vmap(fn, in_dims=dims, out_dims=0)
    i = _ar(q)
    return fn(torch.arange(q.shape[0]), torch.arange(1), i, i)


def tensor_padding_causal(q, pos, valid):
    """An additive mask whose 0 is a 0-d tensor, as transformers 5.17's eager_mask writes it:
    torch.where(allowed, torch.tensor(0.0), min)."""
    i = _ar(q)
    allowed = (i[None, :] <= i[:, None]) & valid[:, None, None, :].bool()
    return torch.where(allowed, torch.tensor(0.0, dtype=q.dtype), torch.finfo(q.dtype).min)


def finite_documents_causal(q, pos, valid):
    """The 5.17 form without padding: every row keeps its own key, so no row is without one."""
    i, d = _ar(q), _doc_ids(pos)
    allowed = (i[None, :] <= i[:, None]) & (d[:, None, :, None] == d[:, None, None, :])
    return torch.where(allowed, torch.tensor(0.0, dtype=q.dtype), torch.finfo(q.dtype).min)


def cumsum_of_ones_causal(q, pos, valid):
    """Causality read from positions that are a running count over a mask of ones, as
    transformers 4.57's Bloom and OPT count positions without a padding mask."""
    count = torch.ones(q.shape[0], q.shape[2], device=q.device).cumsum(-1)
    return count[:, None, None, :] <= count[:, None, :, None]


MASKS = {f.__name__: f for f in (documents, documents_window, documents_additive, chunked, prefix_lm,
                                 left_padding_causal, bidirectional_padding, position_causal, inverted_padding,
                                 written_causal_padding, vmapped_padding_causal, tensor_padding_causal,
                                 finite_documents_causal, cumsum_of_ones_causal)}
N = 16
# finite masked values (finfo.min) where a row may have every key masked (left padding under
# causality, a fully padded sample): eager gives such a row the mean of the values
FILLED_MASKS = {"tensor_padding_causal", "written_causal_padding", "inverted_padding"}


def mask_inputs(b=2, n=N, seed=0):
    g = torch.Generator().manual_seed(seed)
    cuts = [[0, 5, 8, n], [0, 2, 11, n]][:b]
    pos = torch.cat([torch.cat([torch.arange(e - s) for s, e in zip(c, c[1:])])[None] for c in cuts])
    valid = torch.ones(b, n, dtype=torch.long)
    valid[0, :3] = 0  # left padding
    valid[1, n - 4:] = 0  # right padding
    return torch.randn(b, 4, n, 8, generator=g), pos, valid


def _site(gm):
    (node,) = [n for n in gm.graph.nodes if is_sdpa(n)]
    return node


@pytest.mark.parametrize("name", sorted(MASKS))
def test_extracted_function_equals_the_eager_mask(name):
    build = MASKS[name]
    q, pos, valid = mask_inputs()

    def f(q, pos, valid):
        return F.scaled_dot_product_attention(q, q, q, attn_mask=build(q, pos, valid))

    gm, example = dynamo_graph(f, q, pos, valid, with_inputs=True)
    run(gm, PASSES)
    values = node_values(gm, *example)  # the values of the graph's nodes, those the passes added too
    node = _site(gm)
    assert SKIP_META not in node.meta, node.meta.get(SKIP_META)
    want = build(q, pos, valid)
    want = (want if want.dtype == torch.bool else want == 0).expand(q.shape[0], 1, N, N)
    got = lifted_dense(node.meta[MASK_META], values, q.shape[0], N)
    assert torch.equal(got, want)


def test_finite_masked_values_are_recorded_with_whether_every_row_keeps_a_key():
    """The lift records a finite masked value (in the mask's dtype) and whether the mask keeps
    (i, i); the rewrite puts ringcc::fill_empty_rows after the ring op exactly where a row may
    have every key masked by a finite value (Note [Rows with no key] in runtime/ops.py)."""
    q, pos, valid = mask_inputs()
    low = torch.finfo(torch.float32).min
    for name, fills, keeps in (("tensor_padding_causal", (low,), False), ("written_causal_padding", (low,), False),
                               ("inverted_padding", (low,), False), ("finite_documents_causal", (low,), True),
                               ("documents_additive", (), None), ("left_padding_causal", (), False),
                               ("bidirectional_padding", (), False)):
        build = MASKS[name]
        gm = dynamo_graph(lambda q, pos, valid: F.scaled_dot_product_attention(q, q, q, attn_mask=build(q, pos, valid)),
                          q, pos, valid)
        ctx = run(gm, PASSES)
        lifted = _site(gm).meta[MASK_META]
        assert lifted.fills == fills, (name, lifted.fills)
        if keeps is not None:  # (a -inf mask: nothing depends on it)
            assert (lifted.keeps_diagonal or not lifted.rows_may_have_no_key()) is keeps, name
        rewrite_attention(gm, ctx)
        (site,) = ctx.report.sites
        fill_ops = [n for n in gm.graph.nodes if n.target is torch.ops.ringcc.fill_empty_rows.default]
        assert site.decision.value == "rewritten" and tuple(site.mask.get("fill", ())) == fills, (name, site)
        assert len(fill_ops) == (1 if name in FILLED_MASKS else 0), (name, gm.graph)
        assert ("give the mean of the values, as eager" in site.detail) is (name in FILLED_MASKS), (name, site.detail)
    # where(c, 0, min) == 0 folds to c: the causal conjunct stays visible as the causal flag
    gm = dynamo_graph(lambda q, pos, valid: F.scaled_dot_product_attention(
        q, q, q, attn_mask=finite_documents_causal(q, pos, valid)), q, pos, valid)
    assert run(gm, PASSES).report.sites[0].mask["causal"] is True


def test_a_running_count_over_ones_is_index_arithmetic_not_a_tensor_input():
    """A cumsum of a value that is the same along the sum is read as (i + 1) * value: the
    function reads no tensor; a cumsum of per-token values (the documents' ids) stays one."""
    q, pos, valid = mask_inputs()
    for build, inputs in ((cumsum_of_ones_causal, 0), (documents, 1)):
        gm = dynamo_graph(lambda q, pos, valid: F.scaled_dot_product_attention(q, q, q, attn_mask=build(q, pos, valid)),
                          q, pos, valid)
        run(gm, PASSES)
        lifted = _site(gm).meta[MASK_META]
        assert len(lifted.fn_inputs) == inputs, (build.__name__, lifted.fn.text, lifted.fn_inputs)


def test_a_stored_query_by_key_mask_is_not_extracted_and_says_why():
    q, _, _ = mask_inputs()
    table = torch.rand(N, N) > 0.5

    gm = dynamo_graph(lambda q, m: F.scaled_dot_product_attention(q, q, q, attn_mask=m), q, table)
    run(gm, PASSES)
    reason, detail = _site(gm).meta[SKIP_META]
    assert "a stored [query, key] mask tensor" in detail and "a query and a key dim whose values are data" in detail


class RelativeBias(nn.Module):
    """T5's relative position bias: a learned [buckets, heads] table read at a bucket of kv - q,
    added to the scores as SDPA's float mask."""

    def __init__(self, heads=1, buckets=8):
        super().__init__()
        self.table = nn.Embedding(buckets, heads)

    def forward(self, q):
        n = q.shape[-2]
        rel = torch.arange(n)[None, :] - torch.arange(n)[:, None]
        bias = self.table(rel.clamp(-4, 3) + 4).permute(2, 0, 1)[None]
        return F.scaled_dot_product_attention(q, q, q, attn_mask=bias)


def test_a_learned_query_by_key_bias_runs_dense_and_says_why():
    """A learned table read at every (query, key) pair needs a gradient, which the tensors of a score
    function do not take: the site is skipped, and the reason says what the table is."""
    q, _, _ = mask_inputs()
    gm = dynamo_graph(RelativeBias(), q)
    run(gm, PASSES)
    reason, detail = _site(gm).meta[SKIP_META]
    assert "a [query, key] bias that needs a gradient" in detail and "relative position bias" in detail


def test_an_additive_bias_is_a_score_function_not_a_mask():
    """SDPA's float attn_mask with values other than 0 and -inf is a bias: the site's score
    function score + bias, rewritten, equal to eager."""
    q, pos, _ = mask_inputs()

    def f(q, pos):
        i = _ar(q)
        return F.scaled_dot_product_attention(q, q, q, attn_mask=(i[None, :] // 3 == i[:, None] // 3).float() * 0.5)

    gm, inputs = dynamo_graph(f, q, pos, with_inputs=True)
    ctx = run(gm, PASSES + [("rewrite_attention", rewrite_attention)])
    (site,) = ctx.report.sites
    assert site.decision.value == "rewritten" and not site.mask["causal"], site
    assert site.mask["score_function"].startswith("scorefn v1 tensors=0") and "add score" in site.mask["score_function"]
    torch.testing.assert_close(gm(*inputs)[0], f(q, pos), atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------
# ring attention under mask functions, against eager


class MaskedAttention(nn.Module):
    """One attention layer whose mask is `MASKS[name]` (or `SHARDED_INPUT_MASKS[name]`), built in
    the forward from the inputs."""

    def __init__(self, name: str, d: int = 32, h: int = 4, g: int = 2):
        super().__init__()
        self.name, self.h, self.g, self.dh = name, h, g, d // h
        self.q = nn.Linear(d, d)
        self.kv = nn.Linear(d, 2 * g * self.dh)
        self.o = nn.Linear(d, d)

    def forward(self, x, pos, valid):
        b, n, _ = x.shape
        q = self.q(x).view(b, n, self.h, self.dh).transpose(1, 2)
        k, v = self.kv(x).view(b, n, 2, self.g, self.dh).permute(2, 0, 3, 1, 4)
        mask = {**MASKS, **SHARDED_INPUT_MASKS}[self.name](q, pos, valid)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        return self.o(out.transpose(1, 2).reshape(b, n, -1))


def case_ring_parity(rank, world, name, n, layout):
    torch._dynamo.reset()  # the pool's processes outlive a test: no graph compiled for another case
    torch.manual_seed(0)
    ref, model = MaskedAttention(name), MaskedAttention(name)
    model.load_state_dict(ref.state_dict())
    _, pos, valid = mask_inputs(n=n)
    x = torch.randn(2, n, 32)
    want = {**MASKS, **SHARDED_INPUT_MASKS}[name](x.view(2, n, 4, 8).transpose(1, 2), pos, valid)
    # every row is compared, rows whose keys are all masked too: under a finite masked value eager
    # gives them the mean of the values (and its gradients), under -inf or a bool mask 0
    finite = want.dtype != torch.bool and bool(torch.isfinite(want).all())
    want = (want if want.dtype == torch.bool else want == 0).expand(2, 1, n, n)
    proj = torch.randn(2, n, 32)
    compiled = torch.compile(model, backend=ringcc.backend(ringcc.Config(inner="aot_eager", strict=True,
                                                                         layout=layout)))
    ringcc.reset_reports()
    maskfn.reset_stats()
    # tiles of 4 keys, stripes of 8 rows: the blocks of these short shards split into calls
    tile, rows = maskfn.TILE, maskfn.SPLIT_ROWS
    maskfn.TILE, maskfn.SPLIT_ROWS = 4, 8
    try:
        out = compiled(x, pos, valid)
        (out * proj).sum().backward()
    finally:
        maskfn.TILE, maskfn.SPLIT_ROWS = tile, rows
    # eager's softmax over a finite fill is SDPA's math backend (its fused CPU kernel's gradient of
    # a row with every key masked is not that softmax's); -inf rows: 0 as the fused kernel gives
    with sdpa_kernel(SDPBackend.MATH) if finite else contextlib.nullcontext():
        r = ref(x, pos, valid)
    (r * proj).sum().backward()
    rep = ringcc.last_report()
    stats = dict(maskfn.STATS, dense_pairs=int(want.sum()), balance=maskfn.balance())
    errs = {"out": float((out - r).abs().max())}
    grads = {}
    for (pname, p), (_, rp) in zip(model.named_parameters(), ref.named_parameters()):
        grads[pname] = (p.grad is None, rp.grad is None)
        if p.grad is not None and rp.grad is not None:
            errs[pname] = float((p.grad - rp.grad).abs().max() / rp.grad.abs().max().clamp_min(1e-3))
    sites = [(s.decision.value, "function" in (s.mask or {}), s.detail) for s in rep.sites]
    return errs, grads, sites, bool(rep.plan.verdict), [g.why for g in rep.gathers], stats


def _check_parity(results, name, n):
    total: dict = {}
    for errs, grads, sites, verdict, gathers, stats in results:
        assert all(a == b for a, b in grads.values()), grads  # the same parameters have a gradient
        assert max(errs.values()) < 2e-5, errs
        assert [s[0] for s in sites] == ["rewritten"], sites
        # rows with every key masked by a finite value: rewritten, and eager's rows put there
        assert ("give the mean of the values, as eager" in sites[0][2]) is (name in FILLED_MASKS), sites
        assert verdict and not gathers, (verdict, gathers)
        for key, value in stats.items():
            total[key] = total.get(key, 0) + value
    if any(site[1] for site in results[0][2]):
        assert total.get("partial", 0) + total.get("full", 0) > 0, total
        # every allowed pair computed once in forward and once in backward, over the ranks
        assert total["pairs"] == 2 * results[0][5]["dense_pairs"], total
        pairs = [r[5].get("pairs", 0) for r in results]
        assert abs(results[0][5]["balance"] - max(pairs) / (sum(pairs) / len(pairs))) < 1e-9
        if n >= 32 and name in ("documents", "documents_additive"):  # (a window of 3 leaves no full tile)
            # runs of whole tiles take the unmasked kernel, empty tiles none
            assert total.get("calls_unmasked", 0) > 0 and total.get("tiles_empty", 0) > 0, total


def float_count_causal(q, pos, valid):
    """Causality read from a running count over a float padding mask: a float cumsum, which the
    sharder computes on shards, while a mask function reads its inputs whole."""
    count = valid.float().cumsum(-1)
    return count[:, None, None, :] <= count[:, None, :, None]


SHARDED_INPUT_MASKS = {"float_count_causal": float_count_causal}


@pytest.mark.soak
def test_a_mask_function_input_computed_on_shards_runs_the_site_on_full_values(pools):
    """A site whose mask function reads a value the sharder left on shards runs on gathered
    values, as one rank's attention (no ring): exact, every parameter with its gradient, and
    the gathers recorded and counted by the plan."""
    for errs, grads, sites, verdict, gathers, _ in pools(2).run(case_ring_parity, "float_count_causal", 40,
                                                                 "contiguous", timeout=300):
        assert all(a == b for a, b in grads.values()), grads
        assert max(errs.values()) < 2e-5, errs
        assert [s[:2] for s in sites] == [("rewritten", True)], sites
        assert not verdict and any("mask function input" in g and "computed on shards" in g for g in gathers), gathers


# the default tier: a few cases at p = 2; the whole matrix at p = 1..4 under soak
FAST = [("documents", "contiguous"), ("chunked", "zigzag")]


@pytest.mark.parametrize("name, layout", FAST)
def test_ring_attention_under_mask_functions_p2(pools, name, layout):
    _check_parity(pools(2).run(case_ring_parity, name, 40, layout, timeout=300), name, 40)


def test_rows_with_every_key_masked_by_a_finite_value_are_eager_rows_p2(pools):
    """transformers 5.17's eager mask on a left-padded batch: where(causal & padding, tensor(0.0),
    finfo.min). Its padded rows have every key masked, and eager's softmax gives them the mean of
    the values: rewritten, and every row and every gradient equals eager's (p = 1..4: the matrix)."""
    _check_parity(pools(2).run(case_ring_parity, "tensor_padding_causal", 12, "zigzag", timeout=300),
                  "tensor_padding_causal", 12)


@pytest.mark.soak
@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("name", sorted(MASKS))
def test_ring_attention_under_mask_functions_matrix(pools, world, name):
    for layout in ("contiguous", "zigzag"):
        n = 2 * world * 10  # no model dim (32) equals n: the plan reads dims of size n as n
        _check_parity(pools(world).run(case_ring_parity, name, n, layout, timeout=600), name, n)


class ScoredPaddedAttention(nn.Module):
    """Eager attention with a score modifier before transformers' finite causal padding mask:
    ALiBi (Bloom: a per-head linear bias of the distance) or a soft-cap (Gemma2: cap * tanh(s / cap))."""

    def __init__(self, modifier: str, d: int = 32, h: int = 4, g: int = 2):
        super().__init__()
        self.modifier, self.h, self.g, self.dh = modifier, h, g, d // h
        self.q = nn.Linear(d, d)
        self.kv = nn.Linear(d, 2 * g * self.dh)
        self.o = nn.Linear(d, d)
        self.register_buffer("slopes", 2.0 ** -torch.arange(1, h + 1).float())

    def forward(self, x, valid):
        b, n, _ = x.shape
        q = self.q(x).view(b, n, self.h, self.dh).transpose(1, 2)
        k, v = self.kv(x).view(b, n, 2, self.g, self.dh).permute(2, 0, 3, 1, 4)
        k, v = (t.repeat_interleave(self.h // self.g, 1) for t in (k, v))
        w = q @ k.transpose(2, 3) * self.dh ** -0.5
        i = torch.arange(n)
        if self.modifier == "alibi":
            w = w + self.slopes[:, None, None] * (i[None, :] - i[:, None]).float()
        else:
            w = torch.tanh(w / 2.0) * 2.0
        allowed = (i[None, :] <= i[:, None]) & valid[:, None, None, :].bool()
        w = w + torch.where(allowed, torch.tensor(0.0, dtype=x.dtype), torch.finfo(x.dtype).min)
        out = F.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype) @ v
        return self.o(out.transpose(1, 2).reshape(b, n, -1))


def case_scored_padding(rank, world, modifier, n):
    """Every row and every gradient against eager (a soft-capped site: its rows with no key are 0
    and weigh 0 in the loss, eager's outputs elsewhere)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    ref, model = ScoredPaddedAttention(modifier), ScoredPaddedAttention(modifier)
    model.load_state_dict(ref.state_dict())
    x = torch.randn(2, n, 32)
    _, _, valid = mask_inputs(n=n)  # sample 0: its first 3 rows see no key
    keeps = torch.ones(2, n, 1)
    if modifier == "softcap":
        keeps[0, :3] = 0
    proj = torch.randn(2, n, 32) * keeps
    ringcc.reset_reports()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = torch.compile(model, backend=ringcc.backend(inner="aot_eager", strict=True))(x, valid)
    warned = [str(w.message) for w in caught if "differ from eager" in str(w.message)]
    (out * proj).sum().backward()
    r = ref(x, valid)
    (r * proj).sum().backward()
    errs = {"out": float(((out - r) * keeps).abs().max()), "empty_rows": float((out[0, :3] - model.o.bias).abs().max())}
    for (pname, p), (_, rp) in zip(model.named_parameters(), ref.named_parameters()):
        assert (p.grad is None) == (rp.grad is None), pname
        if p.grad is not None:
            errs[pname] = float((p.grad - rp.grad).abs().max() / rp.grad.abs().max().clamp_min(1e-3))
    sites = [(s.decision.value, s.detail, (s.mask or {}).get("score_function", "")) for s in ringcc.last_report().sites]
    return errs, sites, rank, warned


@pytest.mark.parametrize("modifier, world", [("alibi", 2), ("softcap", 2),
                                             *(pytest.param(m, p, marks=pytest.mark.soak) for m in ("alibi", "softcap")
                                               for p in (1, 3, 4))])
def test_a_score_function_before_a_finite_mask(pools, modifier, world):
    """ALiBi adds a bias (d score / d s = 1): rows with every key masked get eager's mean of the
    values and eager's gradients. A soft-cap weighs each pair by its derivative: those rows stay 0,
    the report says so (docs/sharp-edges.md), and every other row and gradient equals eager's."""
    for errs, sites, rank, warned in pools(world).run(case_scored_padding, modifier, 12 * world, timeout=300):
        ((decision, detail, score_fn),) = sites
        assert decision == "rewritten" and ("tanh" in score_fn) is (modifier == "softcap"), sites
        if modifier == "alibi":
            assert "give the mean of the values, as eager" in detail and errs.pop("empty_rows") > 1e-3, (detail, errs)
            assert not warned, warned
        else:
            assert "give 0; eager gives the mean of the values" in detail and errs.pop("empty_rows") == 0, (detail, errs)
            # one warning line, on rank 0 alone
            assert len(warned) == (rank == 0) and all("give 0; eager gives the mean" in w for w in warned), warned
        assert max(errs.values()) < 2e-5, errs


# ---------------------------------------------------------------------------------------
# flex_attention sites: the mask_mod is the function


class FlexDocAttention(nn.Module):
    """Attention through flex_attention with a document mask_mod (user code), or through SDPA with
    the same mask written densely (the reference: flex has no backward on CPU)."""

    def __init__(self, d: int = 32, h: int = 4, g: int = 2):
        super().__init__()
        self.h, self.g, self.dh = h, g, d // h
        self.q = nn.Linear(d, d)
        self.kv = nn.Linear(d, 2 * g * self.dh)
        self.o = nn.Linear(d, d)

    def forward(self, x, block_mask=None, dense=None):
        from torch.nn.attention.flex_attention import flex_attention

        b, n, _ = x.shape
        q = self.q(x).view(b, n, self.h, self.dh).transpose(1, 2)
        k, v = self.kv(x).view(b, n, 2, self.g, self.dh).permute(2, 0, 3, 1, 4)
        if block_mask is not None:
            out = flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=dense, enable_gqa=True)
        return self.o(out.transpose(1, 2).reshape(b, n, -1))


def _flex_documents(n: int):
    """(BlockMask, dense mask) of causal documents over mask_inputs' packed positions (b = 2):
    a user's create_block_mask with a document mask_mod, and the same mask written densely."""
    from torch.nn.attention.flex_attention import create_block_mask

    _, pos, _ = mask_inputs(n=n)
    doc = _doc_ids(pos)

    def document(b, h, q_idx, kv_idx):
        return (doc[b, q_idx] == doc[b, kv_idx]) & (kv_idx <= q_idx)

    i = torch.arange(n)
    dense = (doc[:, None, :, None] == doc[:, None, None, :]) & (i[None, :] <= i[:, None])
    return create_block_mask(document, 2, None, n, n, device="cpu"), dense


def case_flex_user(rank, world, n):
    from ringcc import _compat

    torch._dynamo.reset()
    torch.manual_seed(0)
    ref, model = FlexDocAttention(), FlexDocAttention()
    model.load_state_dict(ref.state_dict())
    block_mask, dense = _flex_documents(n)
    x, proj = torch.randn(2, n, 32), torch.randn(2, n, 32)
    compiled = torch.compile(model, backend=ringcc.backend(ringcc.Config(inner="aot_eager", strict=True)))
    ringcc.reset_reports()
    with _compat.flex_cpu_backward():  # dynamo traces flex's entry, which refuses CPU training
        out = compiled(x, block_mask)
    (out * proj).sum().backward()
    r = ref(x, dense=dense)
    (r * proj).sum().backward()
    rep = ringcc.last_report()
    errs = {"out": float((out - r).abs().max())}
    for (pname, p), (_, rp) in zip(model.named_parameters(), ref.named_parameters()):
        assert (p.grad is None) == (rp.grad is None), pname
        errs[pname] = float((p.grad - rp.grad).abs().max() / rp.grad.abs().max().clamp_min(1e-3))
    return errs, [(s.form, s.decision.value, s.mask) for s in rep.sites], bool(rep.plan.verdict), len(rep.gathers)


def test_flex_attention_site_with_a_document_mask_mod_p2(pools):
    for errs, sites, verdict, gathers in pools(2).run(case_flex_user, 40, timeout=300):
        assert max(errs.values()) < 2e-5, errs
        ((form, decision, mask),) = sites
        assert (form, decision, mask["causal"]) == ("flex", "rewritten", True), sites
        assert "load t0 b q" in mask["function"] and verdict and gathers == 0


class FlexLseAttention(FlexDocAttention):
    """FlexDocAttention whose flex_attention call returns its LSE too, as transformers' flex path
    asks on CUDA: cast and returned beside the output as the attention weights, then dropped by
    the caller, or (`read`) added into the output. The reference: the same attention in eager
    math over the dense mask, its LSE included."""

    def __init__(self, read: bool):
        super().__init__()
        self.read = read

    def attend(self, x, block_mask=None, dense=None):
        from torch.nn.attention.flex_attention import AuxRequest, flex_attention

        b, n, _ = x.shape
        q = self.q(x).view(b, n, self.h, self.dh).transpose(1, 2)
        k, v = self.kv(x).view(b, n, 2, self.g, self.dh).permute(2, 0, 3, 1, 4)
        if block_mask is not None:
            out, aux = flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True,
                                      return_aux=AuxRequest(lse=True))
            lse = aux.lse
        else:
            r = self.h // self.g
            s = (q @ k.repeat_interleave(r, 1).mT / math.sqrt(self.dh)).masked_fill(~dense, float("-inf"))
            out, lse = torch.softmax(s, -1) @ v.repeat_interleave(r, 1), s.logsumexp(-1)
        return self.o(out.transpose(1, 2).reshape(b, n, -1)), lse.to(x.dtype)

    def forward(self, x, block_mask=None, dense=None):
        out, weights = self.attend(x, block_mask, dense)
        return out + 0.1 * weights.transpose(1, 2).sum(-1, keepdim=True) if self.read else out


def _flex_user_model_errors(make, n, config, x_scale=1.0):
    """A flex_attention model of user code (`make()`: two with the same weights) compiled under
    `config` against eager over packed documents of n tokens: the errors of the output and of
    every gradient (inf where only one of them has a gradient), and the last graph's report."""
    from ringcc import _compat

    torch._dynamo.reset()
    torch.manual_seed(0)
    ref, model = make(), make()
    model.load_state_dict(ref.state_dict())
    block_mask, dense = _flex_documents(n)
    x, proj = torch.randn(2, n, 32) * x_scale, torch.randn(2, n, 32)
    compiled = torch.compile(model, backend=ringcc.backend(config))
    ringcc.reset_reports()
    with _compat.flex_cpu_backward(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a site left dense says so
        out = compiled(x, block_mask)
    (out * proj).sum().backward()
    r = ref(x, dense=dense)
    (r * proj).sum().backward()
    errs = {"out": float((out - r).abs().max())}
    for (pname, p), (_, rp) in zip(model.named_parameters(), ref.named_parameters()):
        if (p.grad is None) != (rp.grad is None):
            errs[pname] = float("inf")
        elif p.grad is not None:
            errs[pname] = float((p.grad - rp.grad).abs().max() / rp.grad.abs().max().clamp_min(1e-3))
    return errs, ringcc.last_report()


def case_flex_lse(rank, world, n, read):
    errs, rep = _flex_user_model_errors(lambda: FlexLseAttention(read), n, ringcc.Config(inner="aot_eager"))
    return errs, [(s.form, s.decision.value, s.reason and s.reason.value) for s in rep.sites]


@pytest.mark.parametrize("read", [False, pytest.param(True, marks=pytest.mark.soak)])
def test_flex_attention_site_whose_lse_is_dropped_or_read_p2(pools, read):
    """An LSE that the caller drops after computing on it (a cast) is not a read: the site is
    rewritten. One that reaches the output is: the site is kept, with the reason. Either way the
    output and every gradient equal eager's."""
    for errs, sites in pools(2).run(case_flex_lse, 40, read, timeout=300):
        assert max(errs.values()) < 2e-5, errs
        assert sites == [("flex", "skipped", "weights_used") if read else ("flex", "rewritten", None)], sites


class FlexScoredAttention(FlexDocAttention):
    """flex_attention with a score_mod (Gemma2's soft-cap and ALiBi slopes read per head from a
    buffer) and a document mask_mod; or the same scores written in eager attention (the
    reference)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("slopes", torch.tensor([0.5, 0.25, 0.125, 0.0625]))

    def forward(self, x, block_mask=None, dense=None):
        from torch.nn.attention.flex_attention import flex_attention

        b, n, _ = x.shape
        q = self.q(x).view(b, n, self.h, self.dh).transpose(1, 2)
        k, v = self.kv(x).view(b, n, 2, self.g, self.dh).permute(2, 0, 3, 1, 4)
        slopes = self.slopes

        def score_mod(score, b, h, q_idx, kv_idx):
            return 2.0 * torch.tanh(score / 2.0) + slopes[h] * (kv_idx - q_idx)

        if block_mask is not None:
            out = flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask, enable_gqa=True)
        else:
            i = torch.arange(n)
            s = q @ k.repeat_interleave(self.h // self.g, 1).mT / math.sqrt(self.dh)
            s = 2.0 * torch.tanh(s / 2.0) + slopes[:, None, None] * (i[None, :] - i[:, None])
            p = torch.softmax(s.masked_fill(~dense, float("-inf")), -1)
            out = p @ v.repeat_interleave(self.h // self.g, 1)
        return self.o(out.transpose(1, 2).reshape(b, n, -1))


def case_flex_scored(rank, world, n):
    """A flex_attention site with a score_mod and a mask_mod in user code, compiled for `world`
    ranks, against the same scores in eager attention: the errors of the output and of every
    gradient (inf where only one of them has a gradient) and the site."""
    errs, rep = _flex_user_model_errors(FlexScoredAttention, n, ringcc.Config(inner="aot_eager", strict=True), 3.0)
    return errs, [(s.form, s.decision.value, s.mask) for s in rep.sites]


@pytest.mark.parametrize("world", [1, 2, pytest.param(3, marks=pytest.mark.soak)])
def test_flex_attention_site_with_a_score_mod_and_a_mask_mod(pools, world):
    """The score_mod is the site's score function (the slopes buffer its tensor, read per head),
    the mask_mod its mask function: rewritten, and the output and every gradient equal eager's."""
    for errs, sites in pools(world).run(case_flex_scored, 12 * world, timeout=300):
        assert max(errs.values()) < 2e-5, errs
        ((form, decision, mask),) = sites
        assert (form, decision, mask["causal"]) == ("flex", "rewritten", True), sites
        assert "tanh" in mask["score_function"] and "load t0 h" in mask["score_function"], mask


def case_flex_hf(rank, world, name="llama", packed=True):
    """An HF model (zoo `name`) with attn_implementation="flex_attention" (on packed documents, or
    plain causal) against the same weights under its default attention, eager."""
    import zoo

    from ringcc import _compat

    torch._dynamo.reset()
    torch.manual_seed(0)
    ref = zoo.BY_NAME[name].factory().train()
    model = zoo.BY_NAME[name].factory().train()
    model.load_state_dict(ref.state_dict())
    model.config._attn_implementation = "flex_attention"
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(1, zoo.VOCAB, (zoo.BATCH, zoo.N), generator=gen)
    kw = dict(position_ids=zoo._packed_positions()) if packed else {}
    compiled = torch.compile(model, backend=ringcc.backend(ringcc.Config(inner="aot_eager")))
    ringcc.reset_reports()
    with _compat.flex_cpu_backward():
        loss = compiled(input_ids=ids, use_cache=False, labels=ids, **kw).loss
    loss.backward()
    ref_loss = ref(input_ids=ids, use_cache=False, labels=ids, **kw).loss
    ref_loss.backward()
    errs = zoo._grad_errors(model, ref)
    errs["loss"] = abs(loss.item() - ref_loss.item()) / abs(ref_loss.item())
    sites = [(s.form, s.decision.value) for r in ringcc.reports() for s in r.sites]
    functions = [s.mask.get("score_function") for r in ringcc.reports() for s in r.sites if s.mask]
    return errs, sites, functions


@pytest.mark.soak
def test_hf_flex_attention_path_with_packed_documents_p2(pools):
    for errs, sites, _ in pools(2).run(case_flex_hf, timeout=900):
        assert max(errs.values()) < 1e-5, errs
        assert sites == [("flex", "rewritten")] * 2, sites


# Gemma2 (soft-cap and sliding windows through HF's flex path) in the soak tier
@pytest.mark.parametrize("name", ["llama", pytest.param("gemma2", marks=pytest.mark.soak)])
def test_hf_flex_attention_path_p2(pools, name):
    """HF's flex path: Llama's score_mod returns the score (no score function), Gemma2's soft-caps
    it (cap 50, its default config): every site rewritten, the loss and every gradient as eager's
    under the model's default attention, and the same parameters with a gradient."""
    for errs, sites, functions in pools(2).run(case_flex_hf, name, False, timeout=900):
        assert max(errs.values()) < 1e-5, errs
        assert sites == [("flex", "rewritten")] * 2, sites
        if name == "llama":
            assert functions == [None, None], functions
        else:
            assert all("tanh" in f for f in functions), functions


# ---------------------------------------------------------------------------------------
# dispatch on one GPU (the lead runs it: pytest -m gpu tests/test_mask_functions.py -s)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_mask_function_dispatch_on_one_gpu(monkeypatch):
    """Packed documents in bf16 at 8K tokens on one GPU (p = 1): the block's tiles from the
    function's bounds (empty tiles skipped); the squares of whole tiles inside the documents run
    as causal calls of the fused cuDNN kernel (Note [Dense parts]; parts of 8 tiles a side here,
    so that documents of this length take them), and the rest runs on
    flex_attention with a BlockMask without them, in forward and in its one-kernel backward; the
    output and every gradient within bf16's tolerance of eager SDPA with the dense mask, and the
    report's tile counts printed (run with -s)."""
    from ringcc.runtime import kernels

    monkeypatch.setattr(maskfn, "DENSE_SIDE", 8)
    torch.manual_seed(0)
    dev, n = torch.device("cuda"), 8192
    ref = MaskedAttention("documents", d=256, h=4, g=2).to(dev, torch.bfloat16)
    model = MaskedAttention("documents", d=256, h=4, g=2).to(dev, torch.bfloat16)
    model.load_state_dict(ref.state_dict())
    lengths = [3000, 1100, 2500, 1592]
    pos = torch.cat([torch.arange(m) for m in lengths])[None].expand(2, -1).contiguous().to(dev)
    valid = torch.ones(2, n, dtype=torch.long, device=dev)
    x = torch.randn(2, n, 256, device=dev, dtype=torch.bfloat16)
    proj = torch.randn_like(x)
    compiled = torch.compile(model, backend=ringcc.backend(ringcc.Config(inner="aot_eager", strict=True)))
    maskfn.reset_stats()
    out = compiled(x, pos, valid)
    (out.float() * proj).sum().backward()
    stats = dict(maskfn.STATS)
    r = ref(x, pos, valid)
    (r.float() * proj).sum().backward()
    print(f"\nmask function dispatch at n = {n}, documents {lengths}: {stats}")
    print(ringcc.last_report().format())
    assert float((out - r).abs().max() / r.abs().max()) < 2e-2
    for (pname, p), (_, rp) in zip(model.named_parameters(), ref.named_parameters()):
        assert (p.grad is None) == (rp.grad is None), pname
        assert float((p.grad - rp.grad).abs().max() / rp.grad.abs().max()) < 3e-2, pname
    # forward and backward each take the one block: documents leave whole tiles empty and full
    assert stats["tiles_empty"] > stats["tiles_partial"] and stats["tiles_full"] > stats["tiles_partial"], stats
    assert stats["partial"] == 2 and not kernels._FLEX_FAILED, (stats, kernels._FLEX_FAILED)
    # each document holds a square of at least DENSE_SIDE whole tiles: one causal cuDNN call each,
    # in forward and in backward
    assert stats["calls_dense"] == 2 * len(lengths) and stats["tiles_dense"] > stats["tiles_partial"], stats


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("attn", ["sdpa", "flex_attention"])
def test_hf_packed_documents_train_on_one_gpu(attn):
    """Hugging Face Llama over packed documents as padding-free packing feeds it (one row of
    position ids restarting per document, use_cache=False, no attention mask), bf16 on one GPU,
    compiled with the default inner compiler: the document mask reads the [1, n] position ids at
    a literal batch row, and its blocks run flex_attention's forward and its compiled backward.
    On HF's flex path (attn_implementation="flex_attention") HF asks flex_attention for its LSE
    on CUDA and drops it: the site is still rewritten. Every site rewritten, no fallback, the loss
    and every gradient within bf16's tolerance of eager under SDPA, the same parameters with a
    gradient."""
    import transformers
    import zoo

    from ringcc.runtime import kernels

    torch._dynamo.reset()
    dev, lengths = torch.device("cuda"), [1500, 1000, 1596]
    cfg = transformers.LlamaConfig(vocab_size=zoo.VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                                   attn_implementation="sdpa", use_cache=False)
    torch.manual_seed(0)
    ref = transformers.LlamaForCausalLM(zoo._no_dropout(cfg)).to(dev, torch.bfloat16).train()
    model = transformers.LlamaForCausalLM(zoo._no_dropout(cfg)).to(dev, torch.bfloat16).train()
    model.load_state_dict(ref.state_dict())
    model.config._attn_implementation = attn
    ids = torch.randint(1, zoo.VOCAB, (1, sum(lengths)), device=dev, generator=torch.Generator(dev).manual_seed(1))
    pos = torch.cat([torch.arange(m) for m in lengths])[None].to(dev)
    compiled = torch.compile(model, backend="ringcc")
    ringcc.reset_reports()
    loss = compiled(input_ids=ids, position_ids=pos, labels=ids, use_cache=False).loss
    loss.backward()
    ref_loss = ref(input_ids=ids, position_ids=pos, labels=ids, use_cache=False).loss
    ref_loss.backward()
    sites = [s.decision.value for r in ringcc.reports() for s in r.sites]
    assert sites == ["rewritten"] * 2, ringcc.last_report().format()
    assert not kernels._FLEX_FAILED, kernels._FLEX_FAILED
    assert abs(loss.item() - ref_loss.item()) / abs(ref_loss.item()) < 1e-2
    errs = zoo._grad_errors(model, ref)
    assert max(errs.values()) < 5e-2, sorted(errs.items(), key=lambda kv: -kv[1])[:5]


def case_llama4_chunked(rank, world):
    """Llama 4's chunked attention (attention_chunk_size): the mask q // c == kv // c with causal."""
    import transformers
    import zoo

    def make():
        cfg = transformers.Llama4TextConfig(
            vocab_size=zoo.VOCAB, hidden_size=32, intermediate_size=64, intermediate_size_mlp=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=128,
            attention_chunk_size=8, num_local_experts=2, attn_implementation="sdpa", no_rope_layers=[1, 0])
        return transformers.Llama4ForCausalLM(zoo._no_dropout(cfg)).train()

    torch._dynamo.reset()
    torch.manual_seed(0)
    ref = make()
    model = make()
    model.load_state_dict(ref.state_dict())
    ids = torch.randint(1, zoo.VOCAB, (zoo.BATCH, zoo.N), generator=torch.Generator().manual_seed(1))
    compiled = torch.compile(model, backend=ringcc.backend(ringcc.Config(inner="aot_eager")))
    ringcc.reset_reports()
    loss = compiled(input_ids=ids, labels=ids).loss
    loss.backward()
    ref_loss = ref(input_ids=ids, labels=ids).loss
    ref_loss.backward()
    errs = zoo._grad_errors(model, ref)
    errs["loss"] = abs(loss.item() - ref_loss.item()) / abs(ref_loss.item())
    return errs, [(s.decision.value, (s.mask or {}).get("function", "")) for r in ringcc.reports() for s in r.sites]


@pytest.mark.soak
def test_llama4_chunked_attention_p2(pools):
    for errs, sites in pools(2).run(case_llama4_chunked, timeout=900):
        assert max(errs.values()) < 1e-5, errs
        assert [d for d, _ in sites] == ["rewritten", "rewritten"], sites
        assert any("floordiv kv 8" in f and "floordiv q 8" in f for _, f in sites), sites


# ---------------------------------------------------------------------------------------
# ringcc rewrite: the function travels in the saved program


def doc_factory(seq_len: int = 40):
    """A factory for `ringcc rewrite`: a documents mask computed from restarting positions."""
    torch.manual_seed(0)
    model = MaskedAttention("documents")
    _, pos, valid = mask_inputs(n=seq_len)
    return model, (torch.randn(2, seq_len, 32), pos, valid)


class ScoredAttention(nn.Module):
    """Eager causal attention whose scores are soft-capped and get an ALiBi bias (slopes a buffer,
    positions from an arange): a score function."""

    def __init__(self, d: int = 32, h: int = 4):
        super().__init__()
        self.h, self.dh = h, d // h
        self.qkv = nn.Linear(d, 3 * d)
        self.o = nn.Linear(d, d)
        self.register_buffer("slopes", torch.tensor([0.5, 0.25, 0.125, 0.0625]))

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.h, self.dh).permute(2, 0, 3, 1, 4)
        s = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(self.dh)
        i = torch.arange(n)
        s = torch.tanh(s / 3.0) * 3.0 + self.slopes[:, None, None] * (i[None, :] - i[:, None])
        s = s.masked_fill(i[None, :] > i[:, None], float("-inf"))
        return self.o((torch.softmax(s, -1) @ v).transpose(1, 2).reshape(b, n, -1))


def scored_factory(seq_len: int = 40):
    """A factory for `ringcc rewrite`: attention with a score function (soft-cap and ALiBi)."""
    torch.manual_seed(0)
    return ScoredAttention(), (torch.randn(2, seq_len, 32) * 3,)


def case_doc_program(rank, world, path, factory="doc_factory"):
    program = torch.export.load(path).module()
    model, inputs = globals()[factory]()
    program.load_state_dict(model.state_dict())
    return float((program(*inputs) - model(*inputs)).abs().max())


@pytest.mark.soak
@pytest.mark.parametrize("factory,text", [("doc_factory", "maskfn v1 tensors=1"),
                                          ("scored_factory", "scorefn v1 tensors=1")])
def test_rewrite_saves_the_function_in_the_program(pools, tmp_path, factory, text):
    """The mask function (documents from restarting positions) or the score function (soft-cap
    and ALiBi slopes) travels in the program `ringcc rewrite` saves: the program at p = 2 equals
    eager."""
    import os

    from ringcc import cli

    out = str(tmp_path / "out")
    assert cli.main(["rewrite", f"{os.path.abspath(__file__)}:{factory}", "--world-size", "2", "-o", out]) == 0
    code = open(os.path.join(out, "program.py")).read()
    assert text in code and ("cumsum" in code if factory == "doc_factory" else "tanh" in code)
    for err in pools(2).run(case_doc_program, os.path.join(out, "program.pt2"), factory, timeout=600):
        assert err < 2e-5
