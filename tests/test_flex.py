"""The flex_attention block masks of masked blocks (runtime/flex.py, Note [Flex blocks]), on CPU:
tile states against the dense mask, and the BlockMask's mask_mod and tiles against the
positions. The kernels themselves run on CUDA only (tests/test_ring_gpu.py)."""

import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.nn.attention.flex_attention import AuxRequest, BlockMask, create_mask, flex_attention

import ringcc
from ringcc import reference
from ringcc.runtime import flex
from ringcc.runtime.ring import WindowMask


def _visible(lq, lk, causal, key_valid, window, wcausal, q_pos, k_pos):
    """Dense [b or 1, lq, lk] bool: what the block's rows may see, from the definitions."""
    d = q_pos[:, None].long() - k_pos[None, :].long()
    m = torch.ones(lq, lk, dtype=torch.bool)
    if causal:
        m &= d >= 0
    if window is not None:
        m &= (d < window) if wcausal else (d.abs() < window)
    m = m[None]
    return m if key_valid is None else m & key_valid[:, None, :]


def _tiles(m, lq, lk):
    """(any, all) per TILE x TILE tile of a dense [b, lq, lk] mask, over its real entries."""
    T = flex.TILE
    qt, kt = -(-lq // T), -(-lk // T)
    anyt = torch.zeros(m.shape[0], qt, kt, dtype=torch.bool)
    allt = torch.zeros_like(anyt)
    for i in range(qt):
        for j in range(kt):
            tile = m[:, i * T:(i + 1) * T, j * T:(j + 1) * T]
            anyt[:, i, j] = tile.flatten(1).any(1)
            allt[:, i, j] = tile.flatten(1).all(1)
    return anyt, allt


CASES = [
    # lq, lk, causal (the call's diagonal), window, window causal, key padding, zigzag rows
    (300, 300, False, None, False, True, False),
    (300, 300, True, None, False, True, False),
    (256, 384, False, 100, False, False, False),
    (300, 300, True, 130, True, True, False),
    (384, 200, False, 150, True, True, False),  # a causal ring's full block with a window
    (400, 260, False, 90, False, True, True),  # zigzag rows: two runs of positions
]


@pytest.mark.parametrize("lq,lk,causal,window,wcausal,padded,zigzag", CASES)
def test_tile_states_and_mask_mod_match_the_dense_mask(lq, lk, causal, window, wcausal, padded, zigzag):
    gen = torch.Generator().manual_seed(lq + lk + (window or 0))
    b = 2
    if window is None:
        q_pos, k_pos = torch.arange(lq, dtype=torch.int32), torch.arange(lk, dtype=torch.int32)
        wm = None
    else:
        if zigzag:  # rows from two distant chunks; keys in between
            q_pos = torch.cat([torch.arange(lq // 2), 1000 + torch.arange(lq - lq // 2)]).int()
            k_pos = (600 + torch.arange(lk)).int()
        else:
            off = 0 if causal else (lq + 20 if wcausal else 50)  # a causal ring's full block: rows after keys
            q_pos = (off + torch.arange(lq)).int()
            k_pos = torch.arange(lk).int()
        wm = WindowMask(q_pos, k_pos, window, wcausal, q_pos.long(), k_pos.long())
    key_valid = None
    if padded:
        key_valid = torch.rand(b, lk, generator=gen) > 0.3
        key_valid[0, : min(lk, 2 * flex.TILE)] = True  # some full key tiles
        key_valid[1, flex.TILE: 2 * flex.TILE] = False  # an empty key tile
    dense = _visible(lq, lk, causal, key_valid, window, wcausal, q_pos, k_pos)
    anyt, allt = _tiles(dense, lq, lk)

    some, full, _ = flex.tile_states(lq, lk, causal, key_valid, wm, "cpu")
    some, full = some[:, 0].expand_as(anyt), full[:, 0].expand_as(anyt)
    assert not bool((anyt & ~some).any()), "a tile with a visible pair is marked empty"
    assert not bool((full & ~allt).any()), "a tile with a hidden pair is marked full"
    if not zigzag:  # positions without jumps: the tile bounds are exact
        assert torch.equal(some, anyt) and torch.equal(full, allt)

    bm = flex.block_mask(lq, lk, causal, key_valid, wm, "cpu").block
    got = create_mask(bm.mask_mod, b, 1, lq, lk, device="cpu")[:, 0]
    assert torch.equal(got, dense.expand(b, lq, lk))
    tiles = bm.to_dense()[:, 0].bool()  # partial and full tiles: those the kernel visits
    assert torch.equal(tiles, some.expand_as(tiles))
    # the backward's key-major order, as torch derives it from the query-major one
    ref = BlockMask.from_kv_blocks(bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks, bm.full_kv_indices,
                                   BLOCK_SIZE=flex.TILE, seq_lengths=(lq, lk))
    for name in ("q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices"):
        assert torch.equal(getattr(bm, name), getattr(ref, name)), name
    for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices", "q_num_blocks", "q_indices",
                 "full_q_num_blocks", "full_q_indices"):
        assert getattr(bm, name).is_contiguous(), f"{name}: the kernels read it as contiguous"
    assert flex.block_mask(lq, lk, causal, key_valid, wm, "cpu", backward=False).block.q_indices is None


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_block_mask_forward_matches_the_reference_on_cpu():
    """Eager flex_attention (its CPU reference path) with ringcc's BlockMask gives the dense
    masked reference's out and lse, rows with no visible key included."""
    b, h, g, n, d = 2, 4, 2, 300, 32
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(b, hh, n, d, generator=gen) for hh in (h, g, g))
    kpm = torch.rand(b, n, generator=gen) < 0.2
    kpm[1, :70] = True
    pos = torch.arange(n).int()
    wm = WindowMask(pos, pos, 60, True, pos.long(), pos.long())
    ref, ref_lse = reference.attention(q, k, v, is_causal=True, key_padding_mask=kpm, window=60)
    bm = flex.block_mask(n, n, True, ~kpm, wm, "cpu").block
    out, aux = flex_attention(q, k, v, block_mask=bm, scale=d ** -0.5, enable_gqa=True,
                              return_aux=AuxRequest(lse=True))
    rows = ~torch.isneginf(ref_lse)
    torch.testing.assert_close(out[rows], ref[rows], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(aux.lse[rows], ref_lse[rows], rtol=1e-4, atol=1e-4)
    assert bool(torch.isneginf(ref_lse[1, :, :70]).all())


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_block_grads_under_the_global_lse_sum_to_the_dense_gradient(dtype):
    """The backward of Note [Flex blocks]: flex's backward op fed the rows' global (out, lse)
    gives each key block's share of the global gradient, and the shares add up to the dense
    gradient (GQA, key padding, a window, rows with no key). On CPU the traced op runs its
    dense implementation; on CUDA the same graph is compiled (tests/test_ring_gpu.py)."""
    from ringcc.runtime import kernels

    b, h, g, n, d = 2, 4, 2, 300, 16
    gen = torch.Generator().manual_seed(5)
    q, k, v, dout = (torch.randn(b, hh, n, d, generator=gen, dtype=torch.float64) for hh in (h, g, g, h))
    kpm = torch.rand(b, n, generator=gen) < 0.3
    kpm[1, :140] = True  # batch row 1: its first rows see no key
    pos = torch.arange(n)
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    ref, ref_lse = reference.attention(qr, kr, vr, is_causal=True, key_padding_mask=kpm, window=90, scale=0.25)
    ref.backward(dout)
    out, lse = ref.detach(), kernels.bwd_lse(ref_lse.detach())
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    tol = dict(rtol=1e-9, atol=1e-9) if dtype == torch.float64 else dict(rtol=0.05, atol=0.05)
    cast = (lambda t: t.to(dtype))
    for c0, c1 in ((0, 128), (128, 200), (200, n)):
        wm = WindowMask(pos.int(), pos[c0:c1].int(), 90, True, pos, pos[c0:c1])
        gq, gk, gv = flex.bwd(cast(dout), cast(q), cast(k[:, :, c0:c1]), cast(v[:, :, c0:c1]), cast(out), lse, 0.25,
                              True, ~kpm[:, c0:c1], wm)
        assert gk.shape == (b, g, c1 - c0, d) and gq.dtype == dtype
        dq += gq.double()
        dk[:, :, c0:c1] += gk.double()
        dv[:, :, c0:c1] += gv.double()
    for got, want in ((dq, qr.grad), (dk, kr.grad), (dv, vr.grad)):
        torch.testing.assert_close(got, want, **tol)
    assert not bool(dq[1, :, :140].any())


def test_a_literal_index_leaves_no_constant_in_the_backward_program(monkeypatch):
    """A mask function that loads a tensor at a literal batch row (`load t0 0 q`: a [1, n] tensor
    of a compiled model's graph) traces into flex's mask graph with no tensor constant, which the
    backward program compiled by inductor on CUDA cannot hold; its gradients are the dense ones."""
    from ringcc.runtime import kernels, maskfn

    text = "maskfn v1 tensors=1\n%0 = load t0 0 q\n%1 = load t0 0 kv\n%2 = eq %0 %1\nreturn %2"
    n, d = 200, 8
    doc, pos = _doc_ids([70, 130]), torch.arange(n)
    m = maskfn.FnMask(maskfn.parse(text), (doc,), pos, pos, 1, 2, 0, 0, True, ("literal", n), starts=(0, 0))
    gen = torch.Generator().manual_seed(3)
    q, k, v, dout = (torch.randn(1, 2, n, d, generator=gen, dtype=torch.float64) for _ in range(4))
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    allowed = (pos[None, :] <= pos[:, None]) & (doc[0][:, None] == doc[0][None, :])
    ref, ref_lse = reference.masked_attention(qr, kr, vr, allowed[None, None], scale=0.5)
    ref.backward(dout)
    traced = []
    run = flex._Program.__call__
    monkeypatch.setattr(flex._Program, "__call__", lambda self, *a: (run(self, *a), traced.append(self.run))[0])
    flex._program.cache_clear()
    grads = flex.bwd(dout, q, k, v, ref.detach(), kernels.bwd_lse(ref_lse), 0.5, True, None, m)
    for got, want in zip(grads, (qr.grad, kr.grad, vr.grad)):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
    graphs = [mod for gm in traced for mod in gm.modules() if isinstance(mod, torch.fx.GraphModule)]
    assert len(graphs) > 1  # the program and its function graphs
    assert not [name for gm in graphs for name, _ in gm.named_buffers()] + \
        [nd.target for gm in graphs for nd in gm.graph.nodes if "lift_fresh" in str(nd.target)]


@torch.library.custom_op("ringcc_test::block_grads", mutates_args=())
def _block_grads_op(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                    lse: torch.Tensor) -> list[torch.Tensor]:
    return list(flex.bwd(dout, q, k, v, out, lse, 0.5, True))


def test_block_grads_run_inside_a_custom_op():
    """The ring's backward is a custom op: the block backward traces and runs flex's backward
    op inside one's kernel, with the results of a direct call."""
    from ringcc.runtime import kernels

    b, h, n, d = 1, 2, 140, 8
    gen = torch.Generator().manual_seed(7)
    q, k, v, dout = (torch.randn(b, h, n, d, generator=gen, dtype=torch.float64) for _ in range(4))
    out, lse = reference.attention(q, k, v, is_causal=True, scale=0.5)
    args = (dout, q, k, v, out, kernels.bwd_lse(lse))
    direct = flex.bwd(*args, 0.5, True)
    inside = _block_grads_op(*args)
    for a, b_ in zip(inside, direct):
        torch.testing.assert_close(a, b_, rtol=0, atol=0)
    assert bool(inside[1].abs().sum() > 0)


def _dense_call(q, k, v, mask, scale, mod=None):
    """flex._call's contract, densely: the BlockMask's mask_mod over the call's rows and keys
    (and the score modifier, as the reference applies it: the tests here pass none)."""
    assert mod is None
    allowed = create_mask(mask.block.mask_mod, q.shape[0], 1, q.shape[2], k.shape[2], device=q.device)
    return reference.masked_attention(q, k, v, allowed, scale=scale)


@pytest.mark.parametrize("causal,window,padded", [(True, None, True), (False, 70, True), (True, 90, False)])
def test_row_chunked_block_matches_the_reference(monkeypatch, causal, window, padded):
    """flex.fwd/bwd over chunks of CALL_ROWS rows (each with its own BlockMask; dK/dV summed
    over the chunks), the kernel call replaced by a dense one over the same BlockMask: out,
    lse and gradients of the dense reference, GQA, rows with no key."""
    from ringcc.runtime import kernels

    monkeypatch.setattr(flex, "CALL_ROWS", flex.TILE)
    monkeypatch.setattr(flex, "_call", _dense_call)
    b, h, g, n, d = 2, 4, 2, 300, 16
    gen = torch.Generator().manual_seed(9)
    q, k, v, dout = (torch.randn(b, hh, n, d, generator=gen, dtype=torch.float64) for hh in (h, g, g, h))
    kpm = None
    if padded:
        kpm = torch.rand(b, n, generator=gen) < 0.2
        kpm[1, :50] = True
    pos = torch.arange(n)
    wm = None if window is None else WindowMask(pos.int(), pos.int(), window, causal, pos, pos)
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    ref, ref_lse = reference.attention(qr, kr, vr, is_causal=causal, key_padding_mask=kpm, window=window, scale=0.3)
    ref.backward(dout)
    kv = None if kpm is None else ~kpm
    assert len(flex._row_chunks(n)) == 3
    out, lse = flex.fwd(q, k, v, 0.3, causal, kv, wm)
    torch.testing.assert_close(out, ref.detach())
    torch.testing.assert_close(lse, ref_lse.detach())
    dq, dk, dv = flex.bwd(dout, q, k, v, out, kernels.bwd_lse(lse), 0.3, causal, kv, wm)
    for got, want in ((dq, qr.grad), (dk, kr.grad), (dv, vr.grad)):
        torch.testing.assert_close(got, want)


def test_window_masks_are_built_once_per_window():
    """A window's BlockMask without a key mask depends on its positions only: built once per
    (window, causal, rows, direction) and reused by every step, head chunk and iteration; with
    a key mask only the position tiles are reused."""
    pos = torch.arange(300).int()
    wm = WindowMask(pos, pos, 50, True, pos.long(), pos.long())
    a = flex.block_mask(300, 300, True, None, wm, "cpu")
    assert flex.block_mask(300, 300, True, None, wm, "cpu") is a
    assert flex.block_mask(300, 300, True, None, wm, "cpu", backward=False) is not a
    kv = torch.ones(1, 300, dtype=torch.bool)
    kv[0, 200:] = False
    b1, b2 = flex.block_mask(300, 300, True, kv, wm, "cpu").block, flex.block_mask(300, 300, True, ~kv, wm, "cpu").block
    assert b1 is not b2 and not torch.equal(b1.kv_num_blocks, b2.kv_num_blocks)
    other = WindowMask(pos, pos, 20, True, pos.long(), pos.long())
    dense = [create_mask(m.block.mask_mod, 1, 1, 300, 300, device="cpu")
             for m in (a, flex.block_mask(300, 300, True, None, other, "cpu"))]
    assert int(dense[0].sum()) > int(dense[1].sum()) > 0
    # kept up to a 64K-row call over 64K keys (flex.WINDOW_CACHED_TILES), built per call beyond
    for n, kept in ((512 * flex.TILE, True), (513 * flex.TILE, False)):
        big = torch.arange(4 * n).int()[:n]
        wb = WindowMask(big, big, 4096, True, big.long(), big.long())
        assert (flex.block_mask(n, n, True, None, wb, "cpu") is flex.block_mask(n, n, True, None, wb, "cpu")) == kept


def test_a_flex_compile_failure_falls_back_to_the_exact_path(monkeypatch):
    """When flex_attention cannot be compiled or launched for some blocks (say, a head dim
    Triton has no configuration for), kernels.block_fwd/block_bwd warn once and run the exact
    path for blocks like them, instead of failing the step, and count every such call for the
    report; other errors still surface."""
    import torch._dynamo.exc as dynamo_exc

    from ringcc.runtime import kernels

    calls = []

    def failing(*args, **kwargs):
        calls.append(1)
        raise dynamo_exc.TorchDynamoException("No valid triton configs. OutOfMemoryError: out of resource")

    monkeypatch.setattr(kernels, "_flex_path", lambda *a: True)
    monkeypatch.setattr(flex, "fwd", failing)
    monkeypatch.setattr(flex, "bwd", failing)
    monkeypatch.setattr(kernels, "_FLEX_FAILED", {})
    monkeypatch.setattr(kernels, "FLEX_FALLBACKS", kernels.Counter())
    assert kernels.fallback_line() is None
    b, h, n, d = 1, 2, 40, 8
    gen = torch.Generator().manual_seed(1)
    q, k, v, dout = (torch.randn(b, h, n, d, generator=gen) for _ in range(4))
    kv = torch.rand(b, n, generator=gen) > 0.2
    args = dict(scale=d ** -0.5, causal=True, key_valid_bs=kv)
    with pytest.warns(UserWarning, match="flex_attention could not run masked torch.float32 blocks with head dim 8"):
        out, lse = kernels.block_fwd(q, k, v, **args)
    ref, ref_lse = reference.attention(q, k, v, is_causal=True, key_padding_mask=~kv)
    torch.testing.assert_close(out, ref)
    grads = kernels.block_bwd(dout, q, k, v, out, lse, **args)  # no second attempt, no second warning
    assert len(calls) == 1 and grads[0].shape == q.shape
    assert kernels.FLEX_FALLBACKS == {(q.device, q.dtype, d): 2}
    line = kernels.fallback_line()
    assert "2 calls of torch.float32 blocks with head dim 8 on cpu" in line and "No valid triton configs" in line

    monkeypatch.setattr(kernels, "_FLEX_FAILED", {})
    monkeypatch.setattr(flex, "fwd", lambda *a, **k: (_ for _ in ()).throw(ValueError("a real bug")))
    with pytest.raises(ValueError, match="a real bug"):
        kernels.block_fwd(q, k, v, **args)


# ---------------------------------------------------------------------------------------
# dense parts of partial calls (Note [Dense parts] in runtime/maskfn.py)

DOCS = "maskfn v1 tensors=1\n%0 = load t0 b q\n%1 = load t0 b kv\n%2 = eq %0 %1\nreturn %2"


def _doc_ids(lengths):
    return torch.cat([torch.full((m,), i) for i, m in enumerate(lengths)])[None]


@pytest.mark.parametrize("lengths, causal, rest", [
    ([40, 24, 64], True, False),  # documents on tile bounds: one causal square each, nothing left
    ([36, 28, 64], True, True),  # a boundary inside a tile: its tiles stay masked
    ([40, 24, 64], False, False),  # bidirectional: a rectangle (here a square) of whole tiles each
    ([36, 28, 64], False, True),
])
def test_dense_parts_cover_only_allowed_pairs_and_leave_the_rest(monkeypatch, lengths, causal, rest):
    """The parts a partial call hands to the fused kernels hold only pairs the mask allows
    (a causal part: its lower triangle), cover disjoint pairs, and every allowed pair outside
    them is in a tile the masked call keeps."""
    from ringcc.runtime import maskfn

    monkeypatch.setattr(maskfn, "DENSE_SIDE", 2)
    tile, n = 8, sum(lengths)
    doc, pos = _doc_ids(lengths), torch.arange(n)
    m = maskfn.FnMask(maskfn.parse(DOCS), (doc,), pos, pos, 1, 1, causal=causal)
    allowed = m.rows(0, n)[0, 0]
    parts, skip, left, _ = maskfn._dense_parts(m, tile)
    assert parts and left == rest, (parts, left)
    cover = torch.zeros(n, n, dtype=torch.int)
    for r0, r1, c0, c1, low in parts:
        block = torch.ones(r1 - r0, c1 - c0, dtype=torch.int)
        cover[r0:r1, c0:c1] += block.tril() if low else block
        assert low == causal and (r0, r1) == (c0, c1) if low else True
    assert int(cover.max()) == 1 and bool(allowed[cover.bool()].all())
    # the tiles the masked call keeps hold every allowed pair the parts do not
    kept = ~maskfn._covered(skip, n // tile, n // tile).repeat_interleave(tile, 0).repeat_interleave(tile, 1)
    assert bool((allowed & ~cover.bool() <= kept).all())
    assert bool((allowed & kept).any()) == rest


def case_dense_parts(rank, world, lengths, layout):
    """Ring attention under a document mask with flex blocks (as on CUDA; here flex's dense
    implementation in fp32) and dense parts of 2 tiles: forward, LSE and gradients against dense
    SDPA, and the calls and tiles the fused kernels took."""
    import torch.distributed as dist

    from ringcc import _compat
    from ringcc.runtime import kernels, maskfn, ops

    saved = kernels.flex_blocks, maskfn.DENSE_SIDE
    kernels.flex_blocks, maskfn.DENSE_SIDE = (lambda device, dtype: True), 2
    kernels._FLEX_FAILED.clear()
    try:
        n, h, d = sum(lengths), 2, 16
        gen = torch.Generator().manual_seed(0)
        q, k, v, dout = (torch.randn(1, h, n, d, generator=gen, dtype=torch.float64) for _ in range(4))
        doc = _doc_ids(lengths)
        pos = torch.arange(n)
        allowed = (doc[0, :, None] == doc[0, None, :]) & (pos[None, :] <= pos[:, None])
        qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
        ref = torch.nn.functional.scaled_dot_product_attention(qr, kr, vr, attn_mask=allowed)
        ref.backward(dout)
        shard = lambda t: ringcc.shard_sequence(t, 2, layout=layout)  # noqa: E731
        ql, kl, vl = (shard(t.float()).detach().requires_grad_() for t in (q, k, v))
        maskfn.reset_stats()
        out, _ = ops.ring_attention_op(ql, kl, vl, None, True, d ** -0.5, _compat.group_name(dist.group.WORLD),
                                       world, layout, mask_fn=DOCS, mask_t0=doc)
        out.backward(shard(dout.float()))
        stats = dict(maskfn.STATS)
        errs = [float((a - shard(b.float())).abs().max() / b.abs().max())
                for a, b in ((out, ref), (ql.grad, qr.grad), (kl.grad, kr.grad), (vl.grad, vr.grad))]
        return errs, stats, dict(kernels._FLEX_FAILED)
    finally:
        kernels.flex_blocks, maskfn.DENSE_SIDE = saved


@pytest.mark.soak  # the default tier runs documents through dense parts in test_fixed_masks_through_dense_parts_are_exact
@pytest.mark.parametrize("world, layout", [(1, "contiguous"), (2, "zigzag")])
def test_ring_under_documents_runs_dense_parts_on_the_fused_kernels(pools, world, layout):
    """Packed causal documents, some on tile bounds (their squares go to the fused kernel), one
    short one and one across a tile bound (left to flex), at p = 1 and 2: exact, with dense
    parts taken and nothing falling back to the math path."""
    lengths = [256, 384, 128, 200, 312, 768]  # 2048 tokens
    for errs, stats, failed in pools(world).run(case_dense_parts, lengths, layout):
        assert max(errs) < 1e-5, errs
        assert stats["calls_dense"] >= 2 and stats["tiles_dense"] > 0 and not failed, (stats, failed)


def test_skipped_tiles_of_a_row_chunk_are_the_chunks_rows():
    """A call's row chunk (flex.CALL_ROWS) keeps the skipped tiles of its rows, a lower part cut
    across its diagonal included."""
    from dataclasses import replace

    from ringcc.runtime import maskfn

    t, n = maskfn.FLEX_TILE, 6 * maskfn.FLEX_TILE
    pos = torch.arange(n)
    m = replace(maskfn.FnMask(maskfn.parse(DOCS), (_doc_ids([n]),), pos, pos, 1, 1, causal=True),
                skip=((1, 5, 1, 5, True), (5, 6, 0, 2, False)))
    whole = m.skipped()
    assert int(whole.sum()) == t * t * (10 + 2)
    for r0 in (0, 2 * t, 3 * t):
        assert torch.equal(m.sub(r0, n, 0, n).skipped(), whole[r0:])
        assert torch.equal(m.sub(r0, n, 0, n).rows(0, n - r0), m.rows(r0, n))


# ---------------------------------------------------------------------------------------
# random mask functions through the flex path with dense parts (soak: many; default: two fixed)


def _fn_text(spec) -> str:
    """The mask function of `spec`: documents, and a window |q - kv| < w, a bidirectional
    prefix (kv <= q or kv < prefix) or chunks (q // c == kv // c) when set. The document ids
    are read at batch row b, or for odd seeds at the literal row 0, as a compiled model's
    [1, n] position ids are."""
    row = "0" if spec["seed"] % 2 else "b"
    lines = [f"%0 = load t0 {row} q", f"%1 = load t0 {row} kv", "%2 = eq %0 %1"]

    def add(line):
        lines.append(f"%{len(lines)} = {line}")
        return len(lines) - 1

    top = 2
    w, pre, c = spec["window"], spec["prefix"], spec["chunk"]
    if w:
        a = add(f"abs %{add('sub q kv')}")
        top = add(f"and %{top} %{add(f'lt %{a} {w}')}")
    if pre:
        a, b = add("le kv q"), add(f"lt kv {pre}")
        top = add(f"and %{top} %{add(f'or %{a} %{b}')}")
    if c:
        a, b = add(f"floordiv q {c}"), add(f"floordiv kv {c}")
        top = add(f"and %{top} %{add(f'eq %{a} %{b}')}")
    return "\n".join(["maskfn v1 tensors=1", *lines, f"return %{top}"])


def _dense_mask(spec, n):
    """The same mask as a dense [n, n] bool, written directly."""
    doc, i = _doc_ids(spec["lengths"])[0], torch.arange(n)
    q, k = i[:, None], i[None, :]
    m = doc[:, None] == doc[None, :]
    if spec["window"]:
        m &= (q - k).abs() < spec["window"]
    if spec["prefix"]:
        m &= (k <= q) | (k < spec["prefix"])
    if spec["chunk"]:
        m &= q // spec["chunk"] == k // spec["chunk"]
    return m & (k <= q) if spec["causal"] else m


def case_random_masks(rank, world, specs):
    """Each spec through ring attention with flex blocks (flex's dense implementation here) and
    dense parts of spec["side"] tiles, flex calls of spec["rows"] rows: the largest error of
    output and gradients against dense SDPA in float64, the dense calls taken, and the tensor
    constants of the programs traced for it (inductor cannot compile a program that
    holds one)."""
    import torch.distributed as dist

    from ringcc import _compat
    from ringcc.runtime import kernels, maskfn, ops

    saved = kernels.flex_blocks, maskfn.DENSE_SIDE, flex.CALL_ROWS, _compat.trace_fake
    out = []
    traced = []

    def trace(fn, args):
        traced.append(saved[-1](fn, args))
        return traced[-1]

    _compat.trace_fake = trace
    try:
        for spec in specs:
            kernels.flex_blocks = lambda device, dtype: True
            maskfn.DENSE_SIDE, flex.CALL_ROWS = spec["side"], spec["rows"]
            kernels._FLEX_FAILED.clear()
            n, h, d = sum(spec["lengths"]), 2, 8
            gen = torch.Generator().manual_seed(spec["seed"])
            q, k, v, dout = (torch.randn(1, h, n, d, generator=gen, dtype=torch.float64) for _ in range(4))
            qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
            allowed = _dense_mask(spec, n)
            ref = torch.nn.functional.scaled_dot_product_attention(qr, kr, vr, attn_mask=allowed)
            ref = torch.where(allowed.any(-1)[:, None], ref, 0.0)  # rows that see no key: 0, as ringcc
            ref.backward(dout)
            shard = lambda t: ringcc.shard_sequence(t, 2, layout=spec["layout"])  # noqa: E731
            ql, kl, vl = (shard(t.float()).detach().requires_grad_() for t in (q, k, v))
            maskfn.reset_stats()
            o, _ = ops.ring_attention_op(ql, kl, vl, None, spec["causal"], d ** -0.5,
                                         _compat.group_name(dist.group.WORLD), world, spec["layout"],
                                         mask_fn=_fn_text(spec), mask_t0=_doc_ids(spec["lengths"]))
            o.backward(shard(dout.float()))
            err = max(float((a - shard(b.float())).abs().max() / b.abs().max().clamp_min(1e-9))
                      for a, b in ((o.detach(), ref.detach()), (ql.grad, qr.grad), (kl.grad, kr.grad),
                                   (vl.grad, vr.grad)))
            constants = [name for gm in traced for mod in gm.modules() if isinstance(mod, torch.fx.GraphModule)
                         for name, _ in mod.named_buffers()]
            traced.clear()
            out.append((spec, err, maskfn.STATS["calls_dense"], dict(kernels._FLEX_FAILED), constants))
    finally:
        kernels.flex_blocks, maskfn.DENSE_SIDE, flex.CALL_ROWS, _compat.trace_fake = saved
    return out


def _check_random_masks(pools, world, specs):
    for results in pools(world).run(case_random_masks, specs, timeout=900):
        for spec, err, dense, failed, constants in results:
            assert err < 1e-5 and not failed and not constants, (spec, err, failed, constants)
    return [dense for _, _, dense, _, _ in results]


FIXED_SPECS = [
    dict(lengths=[640, 300, 84], window=0, prefix=0, chunk=0, causal=True, side=1, rows=256, layout="contiguous",
         seed=1),
    dict(lengths=[512, 512], window=300, prefix=200, chunk=0, causal=False, side=1, rows=384, layout="contiguous",
         seed=2),
]


def test_fixed_masks_through_dense_parts_are_exact(pools):
    """Documents (row chunks of 256 cutting a causal square across its diagonal), and a
    bidirectional window with a prefix (rectangles off the diagonal), at p = 1: exact, with dense
    parts taken."""
    assert all(_check_random_masks(pools, 1, FIXED_SPECS))


@st.composite
def _mask_specs(draw):
    t = flex.TILE
    lengths = draw(st.lists(st.integers(1, 800), min_size=1, max_size=5))
    n = sum(lengths)
    world = draw(st.sampled_from([1, 2]))
    layout = draw(st.sampled_from(["contiguous", "zigzag"]))
    lengths[-1] += (-n) % (2 * world * 8)  # divisible by 2p (zigzag), in whole 8-row units
    return world, dict(lengths=lengths, window=draw(st.sampled_from([0, 100, 300])),
                       prefix=draw(st.sampled_from([0, 200])), chunk=draw(st.sampled_from([0, 256, 384])),
                       causal=draw(st.booleans()), side=draw(st.integers(1, 3)),
                       rows=draw(st.sampled_from([t, 2 * t, 1 << 16])), layout=layout, seed=draw(st.integers(0, 99)))


@pytest.mark.soak
@settings(max_examples=int(os.environ.get("FUZZ_EXAMPLES", "12")), deadline=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
@given(_mask_specs())
def test_random_masks_through_dense_parts_are_exact(pools, case):
    """Random documents, windows, prefixes and chunks, causal or not, at p = 1 and 2 in both
    layouts, with dense parts of 1 to 3 tiles and flex calls of 128 rows to all: exact."""
    world, spec = case
    _check_random_masks(pools, world, [spec])
