"""Structural tests of mask lifting: in-graph masks -> LiftedMask spec (or a recorded reason),
and GQA repeats undone."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from graphs import dynamo_graph, lifted_dense, node_values, run, targets

from ringcc.passes.attention_form import MASK_META, SKIP_META, SdpaCall, fake, is_sdpa
from ringcc.passes.canonicalize_attention import canonicalize_attention
from ringcc.passes.lift_masks import lift_masks
from ringcc.report import SkipReason

PASSES = [("canonicalize_attention", canonicalize_attention), ("lift_masks", lift_masks)]
N = 8


def qkv(b=2, h=4, g=4, n=N, d=16):
    return torch.randn(b, h, n, d), torch.randn(b, g, n, d), torch.randn(b, g, n, d)


def lifted(fn, *extra, q=None):
    q, k, v = q or qkv()
    gm = dynamo_graph(fn, q, k, v, *extra)
    run(gm, PASSES)
    (node,) = [n for n in gm.graph.nodes if is_sdpa(n)]
    return gm, node


def spec(fn, *extra):
    _, node = lifted(fn, *extra)
    assert SKIP_META not in node.meta, node.meta.get(SKIP_META)
    return node.meta[MASK_META]


def skip(fn, *extra):
    _, node = lifted(fn, *extra)
    assert MASK_META not in node.meta
    reason, detail = node.meta[SKIP_META]
    assert reason == SkipReason.UNLIFTABLE_MASK
    return detail


def sdpa_mask(mask):
    return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=mask(q))


def ar(q):
    return torch.arange(q.shape[2])


CAUSAL_BUILDERS = {
    "arange_le": lambda q: ar(q)[None, :] <= ar(q)[:, None],
    "arange_ge_swapped": lambda q: ar(q)[:, None] >= ar(q)[None, :],
    "tril_ones": lambda q: torch.ones(N, N, dtype=torch.bool).tril(),
    "not_triu": lambda q: ~torch.ones(N, N, dtype=torch.bool).triu(1),
    "additive_triu": lambda q: torch.full((N, N), float("-inf")).triu(1),
    "where_additive": lambda q: torch.where(ar(q)[None] <= ar(q)[:, None], 0.0, float("-inf")),
    "masked_fill_additive": lambda q: torch.zeros(N, N).masked_fill(ar(q)[None] > ar(q)[:, None], float("-inf")),
    "unsqueezed_4d": lambda q: (ar(q).unsqueeze(0) <= ar(q).unsqueeze(1)).view(1, 1, N, N),
}


@pytest.mark.parametrize("name", sorted(CAUSAL_BUILDERS))
def test_causal_masks_lift(name):
    s = spec(sdpa_mask(CAUSAL_BUILDERS[name]))
    assert (s.causal, s.window, s.key_valid) == (True, None, None)


def test_no_mask_and_is_causal():
    assert spec(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)).causal is True
    assert spec(lambda q, k, v: F.scaled_dot_product_attention(q, k, v)).causal is False


def test_sliding_windows_lift():
    s = spec(sdpa_mask(lambda q: (ar(q)[:, None] - ar(q)[None, :]).abs() < 3))
    assert (s.causal, s.window) == (False, 3)
    i, j = lambda q: ar(q)[:, None], lambda q: ar(q)[None, :]
    s = spec(sdpa_mask(lambda q: (j(q) <= i(q)) & (i(q) - j(q) < 4)))
    assert (s.causal, s.window) == (True, 4)


def test_key_padding_from_bn_tensor():
    def f(q, k, v, pad):  # pad: bool [b, n], True = padding (nn.MultiheadAttention convention)
        causal = torch.arange(N)[None, :] <= torch.arange(N)[:, None]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=causal & ~pad[:, None, None, :])

    pad = torch.zeros(2, N, dtype=torch.bool)
    gm, node = lifted(f, pad)
    s = node.meta[MASK_META]
    assert s.causal is True and s.key_valid is not None
    kv = s.key_valid
    assert tuple(kv.meta["example_value"].shape) == (2, N) and kv.meta["example_value"].dtype == torch.bool
    # key_valid = (pad == 0): True where attending
    assert kv.args[0].op == "placeholder" and kv.meta["ringcc_pass"] == "lift_masks"


def test_padding_row_shared_by_the_batch_is_expanded():
    def f(q, k, v, pad):  # pad [1, n]: one padding row for every batch element
        return F.scaled_dot_product_attention(q, k, v, attn_mask=~pad[:, None, None, :])

    pad = torch.zeros(1, N, dtype=torch.bool)
    s = spec(f, pad)
    assert tuple(s.key_valid.meta["example_value"].shape) == (2, N)


def test_hf_style_int_mask_lookup():
    def f(q, k, v, am):  # HF: 1 = keep, long [b, n]; mask[b_idx, kv_idx] lookup
        m = am.to(dtype=torch.bool)
        b_idx = torch.arange(2)[:, None, None, None]
        q_idx = torch.arange(N)[None, None, :, None]
        kv_idx = torch.arange(N)[None, None, None, :]
        mask = q_idx.new_ones((), dtype=torch.bool) & (kv_idx <= q_idx) & m[b_idx, kv_idx]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.expand(2, -1, N, N))

    s = spec(f, torch.ones(2, N, dtype=torch.long))
    assert s.causal is True and s.key_valid is not None


@pytest.mark.parametrize("name,mask", [
    ("dense input", lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m)),
    ("mask times data", lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=(ar(q)[None] <= ar(q)[:, None]) & (m > 0))),
])
def test_unliftable_masks_record_why(name, mask):
    detail = skip(mask, torch.randn(N, N))
    assert "a stored [query, key] mask tensor" in detail


@pytest.mark.parametrize("name,build", [
    ("upper triangle", lambda q: torch.ones(N, N, dtype=torch.bool).triu()),
    ("diagonal", lambda q: ar(q)[None] == ar(q)[:, None]),
    ("causal or window", lambda q: (ar(q)[None] <= ar(q)[:, None]) | ((ar(q)[None] - ar(q)[:, None]).abs() < 2)),
    ("shifted causal", lambda q: ar(q)[None] <= ar(q)[:, None] + 1),
    ("first row only", lambda q: ar(q)[None, :] <= torch.arange(1)[:, None]),
    ("sliced positions", lambda q: ar(q)[None, :] <= ar(q)[:1, None]),
])
def test_masks_the_structured_spec_does_not_say_are_read_as_functions(name, build):
    """Masks that are not causal / a window / key padding are the site's mask function
    (passes/extract_mask.py), equal to the mask eager code computes."""
    q = qkv()[0]
    gm, example = dynamo_graph(sdpa_mask(build), *qkv(), with_inputs=True)
    run(gm, PASSES)
    (node,) = [n for n in gm.graph.nodes if is_sdpa(n)]
    assert SKIP_META not in node.meta, node.meta.get(SKIP_META)
    assert node.meta[MASK_META].fn is not None
    got = lifted_dense(node.meta[MASK_META], node_values(gm, *example), q.shape[0], N)
    assert torch.equal(got, build(q).expand(q.shape[0], 1, N, N))


def test_a_stored_query_key_mask_says_how_to_build_one():
    """An [n, n] tensor given as the mask (a buffer, an input) is data: the reason names it and
    says what ringcc can read instead."""
    detail = skip(lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m), torch.ones(N, N, dtype=torch.bool))
    assert "a stored [query, key] mask tensor" in detail and "is_causal=True" in detail and "torch.arange(n)" in detail


def test_gqa_repeat_interleave_is_undone():
    def f(q, k, v):
        return F.scaled_dot_product_attention(q, k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1), is_causal=True)

    gm, node = lifted(f, q=qkv(g=2))
    call = SdpaCall.of(node)
    assert call.k.op == "placeholder" and call.v.op == "placeholder" and call.enable_gqa is True
    assert "repeat_interleave" not in targets(gm)


def test_gqa_expand_reshape_is_undone():
    def f(q, k, v):
        b, g, n, d = k.shape
        k2 = k[:, :, None, :, :].expand(b, g, 2, n, d).reshape(b, g * 2, n, d)
        v2 = v[:, :, None, :, :].expand(b, g, 2, n, d).reshape(b, g * 2, n, d)
        return F.scaled_dot_product_attention(q, k2, v2, is_causal=True)

    gm, node = lifted(f, q=qkv(g=2))
    call = SdpaCall.of(node)
    assert call.k.op == "placeholder" and call.enable_gqa is True
    assert "expand" not in targets(gm) and "reshape" not in targets(gm)


def test_head_tiling_repeat_is_not_gqa():
    # k.repeat(1, 2, 1, 1) puts head h on kv head h % g, not h // r: must stay as is
    def f(q, k, v):
        return F.scaled_dot_product_attention(q, k.repeat(1, 2, 1, 1), v.repeat(1, 2, 1, 1))

    gm, node = lifted(f, q=qkv(g=2))
    assert SdpaCall.of(node).enable_gqa is False and "repeat" in targets(gm)


# ---------------------------------------------------------------------------------------
# Hugging Face's mask without a cache: causal AND "same packed sequence", the packed-sequence
# ids computed from the position ids (masking_utils.find_packed_sequence_indices). With plain
# arange positions every id is equal, so the mask is causal; export spells diff's arguments
# positionally and the prepend pos[:, :1] as aten.slice.


class PackedSequenceMask(torch.nn.Module):
    def __init__(self, pos_step: int = 1, batch_in_prepend: bool = False, compare_steps: bool = False):
        super().__init__()
        self.pos_step, self.batch_in_prepend, self.compare_steps = pos_step, batch_in_prepend, compare_steps

    def mask(self, b: int, n: int) -> torch.Tensor:
        pos = (torch.arange(n) * self.pos_step)[None].expand(b, -1)
        first = pos[:, :1] - 1
        if self.batch_in_prepend:
            first = first + torch.arange(b)[:, None]
        step = torch.diff(pos, dim=-1, prepend=first)
        bi = torch.arange(b)[:, None, None, None]
        qi, ki = torch.arange(n)[None, None, :, None], torch.arange(n)[None, None, None, :]
        if self.compare_steps:  # keys whose step is 1
            same = (step == 1)[bi, ki]
        else:
            ids = (step != 1).cumsum(-1)
            same = ids[bi, qi] == ids[bi, ki]
        return (ki <= qi) & same

    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask(q.shape[0], q.shape[2]))


def _export_site(module):
    from graphs import export_graph

    gm = export_graph(module, *qkv())
    run(gm, PASSES)
    (node,) = [n for n in gm.graph.nodes if is_sdpa(n)]
    return gm, node


@pytest.mark.parametrize("capture", ["export", "dynamo"])
def test_packed_sequence_ids_of_plain_positions_lift_as_causal(capture):
    module = PackedSequenceMask()
    if capture == "export":
        gm, node = _export_site(module)
        assert torch.ops.aten.diff.default in targets(gm)
    else:
        gm, node = lifted(module)
    assert SKIP_META not in node.meta, node.meta.get(SKIP_META)
    s = node.meta[MASK_META]
    assert (s.causal, s.window, s.key_valid) == (True, None, None)
    assert torch.equal(module.mask(2, N), torch.ones(N, N, dtype=torch.bool).tril().expand(2, 1, N, N))


@pytest.mark.parametrize("kwargs", [
    dict(pos_step=2),  # positions 0, 2, 4, ...: every token starts a packed sequence (a diagonal mask)
    dict(batch_in_prepend=True, compare_steps=True),  # row 1's first step is 0: its key 0 is masked
])
def test_packed_sequence_masks_that_are_not_causal_are_read_as_functions(kwargs):
    module = PackedSequenceMask(**kwargs)
    assert not torch.equal(module.mask(2, N), torch.ones(N, N, dtype=torch.bool).tril().expand(2, 1, N, N))
    gm, node = _export_site(module)
    assert SKIP_META not in node.meta, node.meta.get(SKIP_META)
    lifted = node.meta[MASK_META]
    assert lifted.fn is not None and lifted.fn_inputs  # read from the per-token steps or ids
    values = node_values(gm, *[torch.randn(fake(p).shape) for p in gm.graph.nodes if p.op == "placeholder"])
    assert torch.equal(lifted_dense(lifted, values, 2, N), module.mask(2, N))


def test_shifted_positions_lift_as_the_positions_they_are():
    # arange(n + 1)[1:] is 1..n: comparing two shifted ranges is still causal; a shifted key
    # range against plain queries (j + 1 <= i) is not, and is refused
    s = spec(sdpa_mask(lambda q: torch.arange(N + 1)[1:][None, :] <= torch.arange(N + 1)[1:][:, None]))
    assert (s.causal, s.window) == (True, None)
    gm, node = lifted(sdpa_mask(lambda q: torch.arange(N + 1)[1:][None, :] <= ar(q)[:, None]))
    assert node.meta[MASK_META].fn is not None  # j + 1 <= i: a function, not the causal spec
