"""Ring attention vs the dense reference: real gloo groups, p = 1, 2, 3, 4 (tier 2 + 3)."""

import math
import os

import pytest
import torch

import ringcc
from parity import assert_shard_matches, counting_key_runs, lse_err, rel_err, workspace_mib
from ringcc import reference
from ringcc.runtime import layout as L

WORLDS = [1, 2, 3, 4]
TOL = dict(atol=1e-5, rtol=1e-5)


def _inputs(seed, b, h, g, n, d, padded):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, n, d, generator=gen)
    k = torch.randn(b, g, n, d, generator=gen)
    v = torch.randn(b, g, n, d, generator=gen)
    dout = torch.randn(b, h, n, d, generator=gen)
    kpm = None
    if padded == "tail":  # only the sequence's last fifth is padding: most ranks hold none
        kpm = torch.zeros(b, n, dtype=torch.bool)
        kpm[:, -n // 5:] = True
    elif padded == "head":  # the sequence's first fifth is padding (left padding)
        kpm = torch.zeros(b, n, dtype=torch.bool)
        kpm[:, :n // 5] = True
    elif padded == "gap":  # two keys at the start of the last fifth: no rank's valid keys a prefix there
        kpm = torch.zeros(b, n, dtype=torch.bool)
        kpm[:, n - n // 5:n - n // 5 + 2] = True
    elif padded == "rows":  # each batch row padded at its end, to its own length (right padding)
        kpm = torch.zeros(b, n, dtype=torch.bool)
        for i in range(b):
            kpm[i, n - (i + 1) * n // (2 * b + 1):] = True
    elif padded == "none":  # a mask that hides nothing
        kpm = torch.zeros(b, n, dtype=torch.bool)
    elif padded:
        kpm = torch.rand(b, n, generator=gen) < 0.3
        kpm[0, :] = True  # batch 0: every key padded -> every row fully masked
        kpm[-1, -n // 3:] = True  # a padded tail
    return q, k, v, dout, kpm


def case_ring(rank, world, is_causal, layout, h, g, n_local, padded, window=None):
    n = n_local * world
    q, k, v, dout, kpm = _inputs(1234, 2, h, g, n, 8, padded)
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    ref_out, ref_lse = reference.attention(qr, kr, vr, is_causal=is_causal, key_padding_mask=kpm, window=window)
    ref_out.backward(dout)
    lay = L.Layout(layout)
    sh = lambda t: L.shard(t, 2, rank, world, lay)  # noqa: E731
    ql, kl, vl = (sh(t).requires_grad_() for t in (q, k, v))
    kpm_l = None if kpm is None else L.shard(kpm, 1, rank, world, lay)
    out, lse = ringcc.ring_attention(
        ql, kl, vl, is_causal=is_causal, key_padding_mask=kpm_l, layout=layout, return_lse=True, window=window
    )
    out.backward(sh(dout))
    assert_shard_matches(sh, out, lse, ref_out, ref_lse, ((ql.grad, qr.grad), (kl.grad, kr.grad), (vl.grad, vr.grad)), TOL)
    return float((out - sh(ref_out.detach())).abs().max())


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("h,g", [(8, 8), (8, 2), (8, 1)])
def test_ring_matches_reference(pools, world, is_causal, layout, h, g):
    n_local = 14 if layout == "zigzag" else 13  # not a multiple of 16
    errs = pools(world).run(case_ring, is_causal, layout, h, g, n_local, False)
    assert max(errs) < 1e-5


def case_ring_bf16(rank, world, is_causal, layout, h, g, window, budget, padded=False):
    """bf16 shards against the fp32 reference of the same (bf16-rounded) values: the largest
    relative error of out, dq, dk, dv and the largest LSE error. In bf16 a block's gradient
    may travel in the kernel's dtype (Note [Fewer passes]): sender and receiver must agree."""
    with workspace_mib(budget):
        return _ring_bf16_errors(rank, world, is_causal, layout, h, g, window, padded)


def _ring_bf16_errors(rank, world, is_causal, layout, h, g, window, padded=False):
    n = 16 * world
    q, k, v, dout, kpm = (t if t is None or t.dtype == torch.bool else t.bfloat16().float()
                          for t in _inputs(7, 2, h, g, n, 8, padded))
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    ref_out, ref_lse = reference.attention(qr, kr, vr, is_causal=is_causal, window=window, key_padding_mask=kpm)
    ref_out.backward(dout)
    sh = lambda t: L.shard(t, 2, rank, world, L.Layout(layout))  # noqa: E731
    ql, kl, vl = (sh(t).bfloat16().requires_grad_() for t in (q, k, v))
    kpm_l = None if kpm is None else L.shard(kpm, 1, rank, world, L.Layout(layout))
    out, lse = ringcc.ring_attention(ql, kl, vl, is_causal=is_causal, layout=layout, return_lse=True, window=window,
                                     key_padding_mask=kpm_l)
    out.backward(sh(dout).bfloat16())
    assert all(t.dtype == torch.bfloat16 for t in (out, ql.grad, kl.grad, vl.grad))
    errs = [rel_err(out, sh(ref_out.detach()))] + [rel_err(a.grad, sh(b.grad)) for a, b in ((ql, qr), (kl, kr), (vl, vr))]
    return max(errs), lse_err(lse, sh(ref_lse.detach()))


# p = 3 in the soak tier (p = 4, where a rank may hold a block with no visible key, stays)
@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.soak), 4])
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_ring_bf16_matches_reference(pools, world, is_causal, layout):
    # MHA and GQA, whole heads and one K/V head per chunk, with and without a sliding window
    # spanning ranks. At p >= 3 a rank may hold a block with no visible key while its neighbours
    # hold blocks with one or several calls; the last dK/dV hop goes home in bf16. With padding
    # at the end or start, the padded ranks' own blocks are cut to their valid keys
    # (ring.clip_calls), so every rank's first dK/dV hop travels in fp32.
    for h, g, window, budget, padded in ((4, 4, None, "0", False), (8, 2, None, "0.0001", False),
                                         (4, 4, 21, "0", False), (4, 4, None, "0", "tail"),
                                         (8, 2, None, "0.0001", "head"), (4, 4, 21, "0", "tail"),
                                         (8, 2, None, "0.0001", "rows")):
        for err, lse_diff in pools(world).run(case_ring_bf16, is_causal, layout, h, g, window, budget, padded):
            assert err < 2e-2 and lse_diff < 0.05, (h, g, window, budget, padded, err, lse_diff)


def case_ring_masked_calls(rank, world, is_causal, layout, padded):
    """case_ring, returning how many block calls (forward and backward) got a key mask, and how
    many ran on part of the batch (a call per run of batch rows)."""
    from ringcc.runtime import kernels

    counts = {"masked": 0, "all": 0, "rows": 0}
    originals = kernels.block_fwd, kernels.block_bwd

    def counted(fn):
        def call(*args, **kwargs):
            counts["all"] += 1
            counts["masked"] += kwargs.get("key_valid_bs") is not None
            counts["rows"] += args[0].shape[0] < 2
            return fn(*args, **kwargs)
        return call

    kernels.block_fwd, kernels.block_bwd = (counted(f) for f in originals)
    try:
        case_ring(rank, world, is_causal, layout, 4, 2, 10, padded)
    finally:
        kernels.block_fwd, kernels.block_bwd = originals
    return counts


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("padded", ["tail", "head", "gap", "rows", "none"])
def test_blocks_with_one_run_of_valid_keys_run_unmasked(pools, world, layout, padded):
    """A rank whose valid keys are one run of its block in each batch row (all of it, or
    padding at the sequence's end or start, in either layout; rows padded to different lengths
    too) sends its blocks to the unmasked kernels, cut to those keys per run of batch rows
    (ring._key_runs, ring.clip_calls); only the rank holding a gap keeps the mask. Results as
    the reference's (case_ring checks them)."""
    counts = pools(world).run(case_ring_masked_calls, True, layout, padded)
    masked, total = sum(c["masked"] for c in counts), sum(c["all"] for c in counts)
    assert total > 0
    assert (sum(c["rows"] for c in counts) > 0) == (padded == "rows"), counts
    if padded == "gap":
        assert 0 < masked < total
    else:
        assert masked == 0


def case_key_runs_made_once_per_call(rank, world):
    """Note [Key runs per mask]: `ring_attention` all-gathers the key_runs table once per call,
    and its backward reuses it; the op given a table does not gather; a table from other
    values is followed as given (it is an input). Returns (gathers per layer, gathers by the op
    given a table, the table's rows, the layer's max error, a wrong-shape table's error)."""
    from ringcc.runtime import ops

    b, h, n_local, d = 2, 2, 8, 8
    n = n_local * world
    gen = torch.Generator().manual_seed(3)
    q, k, v, dout = (torch.randn(b, h, n, d, generator=gen) for _ in range(4))
    kpm = torch.zeros(b, n, dtype=torch.bool)
    kpm[:, -3:] = True
    sh = lambda t, dim=2: L.shard(t, dim, rank, world, L.Layout.ZIGZAG)  # noqa: E731
    with counting_key_runs() as calls:
        ref = reference.attention(q, k, v, is_causal=True, key_padding_mask=kpm)[0]
        ql, kl, vl = (sh(t).requires_grad_() for t in (q, k, v))
        out = ringcc.ring_attention(ql, kl, vl, is_causal=True, key_padding_mask=sh(kpm, 1), layout="zigzag")
        out.backward(sh(dout))
        per_layer = calls[0]
        valid = ~sh(kpm, 1)
        table = ops.key_runs_op(valid, "", world)
        given = calls[0]
        args = (True, 1.0, "", world, "zigzag", 0)
        again = ops.ring_attention_op(sh(q), sh(k), sh(v), valid, *args, table)[0]
        given = calls[0] - given
        try:
            ops.ring_attention_op(sh(q), sh(k), sh(v), valid, *args, table[:1])
            wrong = ""
        except ValueError as e:
            wrong = str(e)
    return (per_layer, given, table.tolist(), float((out - sh(ref)).abs().max()),
            float((again - sh(reference.attention(q, k, v, is_causal=True, key_padding_mask=kpm, scale=1.0)[0])).abs().max()),
            wrong)


@pytest.mark.parametrize("world", [2, 3])
def test_key_runs_made_once_per_call(pools, world):
    n_local = 8
    for per_layer, given, table, err, err_given, wrong in pools(world).run(case_key_runs_made_once_per_call):
        assert (per_layer, given) == (1, 0), (per_layer, given)
        assert err < 1e-5 and err_given < 1e-5, (err, err_given)
        assert all(lo >= 0 for rows in table for lo, _ in rows), table
        assert [sum(hi - lo for lo, hi in (rows[i] for rows in table)) for i in range(2)] == [n_local * world - 3] * 2
        assert f"int64 [world={world}, batch=2, 2] table" in wrong, wrong


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("is_causal", [False, True])
def test_clipped_calls_cover_the_visible_pairs_once(layout, is_causal):
    """clip_calls: the calls against a block whose keys [lo, hi) are valid cover every visible
    (query, key) pair exactly once, and no other (a causal call is read as the kernels read it:
    top-left, row i of the call sees its keys 0..i), with and without a window (cut calls take
    slices of the window masks)."""
    from ringcc.runtime.layout import Layout, global_positions
    from ringcc.runtime.ring import RingSetup

    n_local = 12
    for world, window in ((1, 0), (2, 0), (3, 0), (4, 0), (2, 5), (3, 7), (4, 13)):
        for rank in range(world):
            setup = RingSetup(None, rank, world, Layout(layout), is_causal, 1.0, window=window)
            q_pos = global_positions(rank, world, Layout(layout), n_local)
            for src in range(world):
                k_pos = global_positions(src, world, Layout(layout), n_local)
                diff = q_pos[:, None] - k_pos[None, :]
                for lo, hi in ((lo, hi) for lo in range(n_local + 1) for hi in range(lo, n_local + 1)):
                    want = torch.zeros(n_local, n_local, dtype=torch.int64)
                    want[:, lo:hi] = 1
                    if is_causal:
                        want &= (diff >= 0).long()
                    if window:
                        want &= (diff < window if is_causal else diff.abs() < window).long()
                    got = torch.zeros_like(want)
                    for c, mask in setup.masked_calls(n_local, src, torch.device("cpu"), ((lo, hi),)):
                        assert (mask is None or window) and lo <= c.k0 < c.k1 <= hi and c.q0 < c.q1, c
                        assert (c.b0, c.b1) == (0, None), c  # one batch row: calls over the batch
                        block = torch.ones(c.q1 - c.q0, c.k1 - c.k0, dtype=torch.int64)
                        block = block.tril() if c.causal else block
                        if mask is not None:
                            block &= mask.rows(0, c.q1 - c.q0).long()
                        got[c.q0:c.q1, c.k0:c.k1] += block
                    assert torch.equal(got, want), (world, window, rank, src, lo, hi)


def test_batch_rows_with_the_same_keys_share_calls():
    """masked_calls cuts once per run of batch rows with the same valid keys; one run of rows
    keeps calls over the whole batch (b1 None)."""
    from ringcc.runtime.layout import Layout
    from ringcc.runtime.ring import RingSetup

    setup = RingSetup(None, 0, 1, Layout.CONTIGUOUS, False, 1.0)
    cpu = torch.device("cpu")
    assert [(c.b0, c.b1, c.k0, c.k1) for c, _ in setup.masked_calls(8, 0, cpu, ((0, 5),) * 3)] == [(0, None, 0, 5)]
    got = [(c.b0, c.b1, c.k0, c.k1) for c, _ in setup.masked_calls(8, 0, cpu, ((0, 5), (0, 5), (0, 8), (3, 3), (0, 5)))]
    assert got == [(0, 2, 0, 5), (2, 3, 0, 8), (4, 5, 0, 5)]  # row 3 sees no key: no call


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_ring_key_padding_and_fully_masked_rows(pools, world, is_causal, layout):
    errs = pools(world).run(case_ring, is_causal, layout, 4, 2, 10, True)
    assert max(errs) < 1e-5


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("window,padded", [(5, False), (13, True), (13, "rows")])
def test_ring_sliding_window(pools, world, is_causal, layout, window, padded):
    # n_local 10: windows shorter than a chunk (5) and spanning chunks and ranks (13);
    # blocks entirely outside the window are skipped.
    errs = pools(world).run(case_ring, is_causal, layout, 4, 2, 10, padded, window)
    assert max(errs) < 1e-5


# RINGCC_RING_WORKSPACE_MIB -> {(h, g): (forward, backward) K/V heads per chunk at p = 1, 2, 3,
# 4} on these tiny fp32 tensors ([2, h, 10, 8], a key mask): one K/V head per chunk; then a
# budget where the forward takes larger chunks than the backward (0 = all heads).
HEAD_CHUNK_BUDGETS = {"0.0001": {(8, 4): [(1, 1)] * 4, (4, 4): [(1, 1)] * 4},
                      "0.0250": {(8, 4): [(2, 1)] * 4, (4, 4): [(0, 0), (0, 2), (0, 2), (0, 2)]}}


def case_ring_head_chunks(rank, world, is_causal, layout, h, g, padded, window, budget):
    """The same parity with a small workspace budget: the ring runs per chunk of K/V heads."""
    from ringcc.runtime import workspace

    with workspace_mib(budget):
        q, k = torch.empty(2, h, 10, 8), torch.empty(2, g, 10, 8)
        mask = torch.ones(2, 10, dtype=torch.bool)
        assert tuple(workspace.ring_kv_chunk(q, k, mask, world, forward=f) for f in (True, False)) \
            == HEAD_CHUNK_BUDGETS[budget][(h, g)][world - 1]
        return case_ring(rank, world, is_causal, layout, h, g, 10, padded, window)


# p = 3 and 4 in the soak tier (test_ring_matches_reference runs every p in make test)
@pytest.mark.parametrize("world", [1, 2, *(pytest.param(p, marks=pytest.mark.soak) for p in (3, 4))])
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("budget", sorted(HEAD_CHUNK_BUDGETS))
def test_ring_head_chunks_match_reference(pools, world, is_causal, layout, budget):
    # GQA 8/4 with padding and a sliding window, then MHA: every chunk's out/lse and
    # dq/dk/dv land in the right heads, and the last dK/dV hop of each chunk comes home,
    # also where forward and backward run different chunks.
    errs = pools(world).run(case_ring_head_chunks, is_causal, layout, 8, 4, True, 13, budget)
    errs += pools(world).run(case_ring_head_chunks, is_causal, layout, 4, 4, False, None, budget)
    assert max(errs) < 1e-5


def case_setup_cache(rank, world):
    """The ring's setup is made once per call signature, and never answers for another: other
    shapes, directions or schedule settings get their own (the head-chunk rule changes with the
    workspace budget)."""
    from ringcc.runtime import ops

    name = ops._group_args(None, "test")[0]
    q, k = torch.empty(2, 8, 10, 8), torch.empty(2, 4, 10, 8)
    make = lambda q, k, forward=True: ops._setup(q, k, None, name, world, "zigzag", True, 0.5,  # noqa: E731
                                                  forward=forward)
    first = make(q, k)
    made = len(ops._SETUPS)  # setups are cached without their group (held weakly): count the entries
    assert make(q, k) == first and len(ops._SETUPS) == made and (first.rank, first.world) == (rank, world)
    make(q, k, forward=False)
    assert len(ops._SETUPS) == made + 1
    make(torch.empty(2, 8, 12, 8), torch.empty(2, 4, 12, 8))
    assert len(ops._SETUPS) == made + 2
    with workspace_mib("0.0001"):
        small = make(q, k)
    assert len(ops._SETUPS) == made + 3 and (first.kv_chunk, small.kv_chunk) == (0, 1)
    assert make(q, k) == first and len(ops._SETUPS) == made + 3
    return True


@pytest.mark.parametrize("world", [1, 2])
def test_ring_setup_is_cached_per_signature(pools, world):
    assert all(pools(world).run(case_setup_cache))


class _StandInGroup:
    """A process-group stand-in: ringcc's caches hold groups weakly, as they hold real ones."""


def test_transport_info_without_a_copy_engine_ring():
    """On CPU (and before any copy-engine ring ran) the rings use the process group and hold no
    receive area; measurements read this to know what the allocator saw."""
    from ringcc.runtime import comm

    info = comm.transport_info(_StandInGroup(), torch.device("cpu"))
    assert info == {"transport": "process group", "copy_engine_unusable": None, "area_bytes": 0,
                    "area_counted_by_allocator": False}


def test_receive_areas_are_found_for_cuda_without_an_index(monkeypatch):
    """bench_planner_gpu asked about torch.device("cuda") and was told "process group, 0 bytes"
    while its rings ran on copy engines (the areas are keyed by device index): a device without
    an index means the current one."""
    from ringcc.runtime import comm

    group = _StandInGroup()
    box = type("Box", (), {"nbytes": 3 << 20, "outside_allocator": True})()
    monkeypatch.setitem(comm._MAILBOXES, (group, 1), box)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    for dev in (torch.device("cuda"), torch.device("cuda", 1)):
        assert comm.transport_info(group, dev) == {"transport": "copy-engine", "copy_engine_unusable": None,
                                                   "area_bytes": 3 << 20, "area_counted_by_allocator": False}
        assert comm.comm_buffer_bytes(dev) == 3 << 20
    assert comm.comm_buffer_bytes(torch.device("cuda", 0)) == 0
    assert comm.comm_buffer_bytes(torch.device("cpu")) == 0
    assert comm.comm_buffer_bytes() == 3 << 20


def test_head_chunk_rule_follows_the_budget(monkeypatch):
    from ringcc.runtime import workspace

    q, k = torch.empty(1, 16, 4096, 128, dtype=torch.bfloat16), torch.empty(1, 16, 4096, 128, dtype=torch.bfloat16)
    monkeypatch.setenv("RINGCC_RING_WORKSPACE_MIB", "512")
    assert workspace.ring_kv_chunk(q, k, None, 4) == 0  # ~20 MiB: whole heads
    monkeypatch.setenv("RINGCC_RING_WORKSPACE_MIB", "8")
    hk = workspace.ring_kv_chunk(q, k, None, 4)
    assert 1 <= hk < 16 and 16 % hk == 0
    monkeypatch.setenv("RINGCC_RING_WORKSPACE_MIB", "0")
    assert workspace.ring_kv_chunk(q, k, None, 4) == 0  # 0 = never chunk
    # auto (the default): 320 MiB + 3/4 of q, k, v and out; MHA h=16 bf16 at 8K, 16K and 64K
    # tokens per rank -> whole heads, 4 and 2 heads per chunk (the settings measured on GPU)
    monkeypatch.delenv("RINGCC_RING_WORKSPACE_MIB")
    # The forward, sending K/V only, takes the largest chunk whose batch is no larger than the
    # backward's (3x the heads for bf16) and whose workspace fits: whole heads, 8 and 4.
    for n_local, heads, fwd_heads in ((8192, 0, 0), (16384, 4, 8), (65536, 2, 4)):
        big = torch.empty(1, 16, n_local, 128, dtype=torch.bfloat16, device="meta")
        assert workspace.ring_kv_chunk(big, big, None, 4, zigzag_causal=True) == heads
        assert workspace.ring_kv_chunk(big, big, None, 4, zigzag_causal=True, forward=True) == fwd_heads
    monkeypatch.setenv("RINGCC_RING_WORKSPACE_MIB", "lots")
    with pytest.raises(ValueError, match="RINGCC_RING_WORKSPACE_MIB"):
        workspace.ring_kv_chunk(q, k, None, 4)


def test_one_call_at_p1_runs_whole_heads(monkeypatch):
    """At p = 1 a block of one kernel call over all its rows and keys runs whole heads whatever
    the head-chunk budget: its results are the outputs, so there is no accumulator to bound. A
    block of several calls (cut by key runs, split by a mask function) takes the rule's chunks.
    The planner's workspace at p = 1 is the one call's, or where several calls may come, the
    larger of that and the rule's choice."""
    import sympy

    from ringcc.planner import n, p
    from ringcc.runtime import maskfn, ring, workspace
    from ringcc.runtime.workspace import TensorSize

    monkeypatch.setenv("RINGCC_RING_WORKSPACE_MIB", "0.0001")

    def _chunk(*args):  # K/V heads per chunk; a mask function's calls made once for whole heads
        chunk, blocks = ring._kv_chunk(*args)
        assert (blocks is not None) == (chunk == 0 and args[4] is not None and args[0].kv_chunk != 0)
        return chunk

    q, k = torch.empty(2, 8, 10, 8), torch.empty(2, 4, 10, 8)
    for lay, window in ((L.Layout.CONTIGUOUS, 0), (L.Layout.ZIGZAG, 0), (L.Layout.CONTIGUOUS, 3)):
        setup = ring.RingSetup(None, 0, 1, lay, True, 0.5, window=window,
                               kv_chunk=workspace.ring_kv_chunk(q, k, None, 1))
        assert setup.kv_chunk == 1  # the rule: one K/V head per chunk
        assert _chunk(setup, q, None, {}, None, None) == 0  # one call: whole heads
        assert _chunk(setup, q, None, {0: ((0, 10), (0, 10))}, None, None) == 0  # every key valid
        assert _chunk(setup, q, None, {0: ((0, 7), (0, 7))}, None, None) == 1  # cut to keys [0, 7)
        assert _chunk(setup, q, None, {0: ((0, 10), (0, 7))}, None, None) == 1  # a call per row run
    docs = maskfn.parse("maskfn v1 tensors=1\n%0 = load t0 b q\n%1 = load t0 b kv\n%2 = eq %0 %1\nreturn %2")
    setup = ring.RingSetup(None, 0, 1, L.Layout.CONTIGUOUS, True, 0.5, kv_chunk=1)
    for s, ids, chunk in ((10, [0] * 4 + [1] * 6, 0),  # one masked call over the block
                          (1024, [0] * 512 + [1] * 512, 1),  # a call per document
                          (1024, [0] * 1024, 0)):  # one document: one causal call
        q = torch.empty(2, 8, s, 8)
        assert _chunk(setup, q, None, {}, (docs, (torch.tensor([ids] * 2),)), None) == chunk
    ring_p1 = ring.RingSetup(None, 0, 2, L.Layout.CONTIGUOUS, True, 0.5, kv_chunk=1)
    assert _chunk(ring_p1, q, None, {}, None, None) == 1  # p = 2: the rule's

    qs, ks = TensorSize((2, 8, n / p, 8), 4), TensorSize((2, 4, n / p, 8), 4)
    tiles = workspace.cpu_kernel_tiles(qs)
    one = workspace._one_call(qs, ks)
    plain = workspace.ring_attention({"q": qs, "k": ks, "v": ks, "key_valid": None}, p)
    assert [sympy.simplify((w - o - t).subs(p, 1)) for w, o, t in zip((plain.forward, plain.backward), one, tiles)] == [0, 0]
    mask = TensorSize((2, n / p), 1)
    keyed = workspace.ring_attention({"q": qs, "k": ks, "v": ks, "key_valid": mask}, p)
    for w, o in zip((keyed.forward, keyed.backward), one):
        at = {n: 4096, p: 1}
        assert planner_eval(w, at) > planner_eval(o, at)  # the rule's chunks, with their accumulators


def planner_eval(e, at):
    from ringcc import planner

    return planner._evaluate(e, at)


# --------------------------------------------------------------------------------------
# bad input, op registration, failure behaviour
# --------------------------------------------------------------------------------------
# bad input, op registration, failure behaviour


def _qkv(h=4, g=4, s=8, d=8, dtype=torch.float32):
    return torch.randn(1, h, s, d, dtype=dtype), torch.randn(1, g, s, d, dtype=dtype), torch.randn(1, g, s, d, dtype=dtype)


@pytest.mark.parametrize(
    "make,match",
    [
        (lambda: (torch.randn(4, 8, 8), *_qkv()[1:]), r"q of shape \[batch, heads, n_local, head_dim\]; got \(4, 8, 8\)"),
        (lambda: _qkv(h=6, g=4), r"query heads \(6\) must be a multiple of key/value heads \(4\)"),
        (lambda: (_qkv()[0], *_qkv(dtype=torch.float64)[1:]), r"must share a dtype"),
        (lambda: (_qkv()[0], _qkv()[1].to("meta"), _qkv()[2]), r"must be on one device"),
        (lambda: (_qkv()[0], _qkv(s=6)[1], _qkv(s=6)[2]), r"k must be \[batch=1, kv_heads, n_local=8, head_dim=8\] and v \[batch=1, kv_heads, n_local=8, v_head_dim\]"),
        # an empty shard crashed the CPU kernel (SIGFPE); zero K/V heads divided by zero
        (lambda: _qkv(s=0), r"ring_attention needs at least one batch row, head, token and feature in q; got shape \(1, 4, 0, 8\)"),
        (lambda: _qkv(g=0), r"at least one batch row, head, token and feature in k; got shape \(1, 0, 8, 8\)"),
        (lambda: tuple(t.long() for t in _qkv()), r"takes float16, bfloat16, float32 or float64 q/k/v; got torch.int64"),
    ],
)
def test_bad_inputs_are_value_errors(make, match):
    with pytest.raises(ValueError, match=match):
        ringcc.ring_attention(*make())


def test_bad_padding_mask_and_layout():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"key_padding_mask must be a bool tensor \[batch=1, n_local=8\]"):
        ringcc.ring_attention(q, k, v, key_padding_mask=torch.zeros(1, 8))
    with pytest.raises(TypeError, match=r"key_padding_mask must be a bool tensor \[batch=1, n_local=8\] \(True = "
                                        r"padding, ignored\) or None; got list"):
        ringcc.ring_attention(q, k, v, key_padding_mask=[[False] * 8])
    with pytest.raises(ValueError, match=r"layout='diagonal' is not supported; allowed: \['contiguous', 'zigzag'\]"):
        ringcc.ring_attention(q, k, v, layout="diagonal")
    for bad in (0, True):  # True is not a window of 1
        with pytest.raises(ValueError, match=rf"window must be a positive int \(sliding window in tokens\) or None; got {bad}"):
            ringcc.ring_attention(q, k, v, window=bad)
    q7, k7, v7 = _qkv(s=7)
    with pytest.raises(ValueError, match=r"zigzag layout needs an even n_local"):
        ringcc.ring_attention(q7, k7, v7, layout="zigzag")


def test_op_for_several_ranks_without_process_group():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"built for world size 2 but no process group is initialised"):
        torch.ops.ringcc.ring_attention(q, k, v, None, False, 0.3, "", 2, "contiguous")


def test_p1_without_group_equals_reference():
    q, k, v = _qkv(h=4, g=2)
    out, lse = ringcc.ring_attention(q, k, v, is_causal=True, return_lse=True)
    ref, ref_lse = reference.attention(q, k, v, is_causal=True)
    torch.testing.assert_close(out, ref, **TOL)
    torch.testing.assert_close(lse, ref_lse, **TOL)


@pytest.mark.parametrize("is_causal", [False, True])
def test_opcheck_forward_and_backward(is_causal):
    q, k, v = (t.requires_grad_() for t in _qkv(h=4, g=2))
    kv = torch.rand(1, 8) > 0.2
    torch.library.opcheck(torch.ops.ringcc.ring_attention.default, (q, k, v, kv, is_causal, 0.35, "", 1, "contiguous"))
    out, lse = torch.ops.ringcc.ring_attention(q.detach(), k.detach(), v.detach(), kv, is_causal, 0.35, "", 1, "contiguous")
    torch.library.opcheck(
        torch.ops.ringcc.ring_attention_backward.default,
        (torch.randn_like(out), q.detach(), k.detach(), v.detach(), kv, out, lse, is_causal, 0.35, "", 1, "contiguous"),
    )
    x = torch.randn(2, 8, 3, requires_grad=True)
    torch.library.opcheck(torch.ops.ringcc.shard.default, (x, 1, "", 1, "contiguous"))
    torch.library.opcheck(torch.ops.ringcc.gather.default, (x, 1, "", 1, "zigzag"))


def test_custom_op_defaults_are_filled_as_torch_fills_them():
    """The autograd kernels complete arguments with ringcc's linear fill_defaults
    (_compat.linear_fill_defaults): the same (args, kwargs) as torch's own, for every ringcc op
    and every number of arguments given."""
    from torch._library import utils

    from ringcc import _compat

    assert utils.fill_defaults is _compat._fill_defaults_linear
    assert _compat.TORCH_FILL_DEFAULTS is not None
    names = [n for n in dir(torch.ops.ringcc) if isinstance(getattr(torch.ops.ringcc, n), torch._ops.OpOverloadPacket)]
    assert {"ring_attention", "ring_attention_backward", "dilated_attention"} <= set(names)
    for name in names:
        schema = getattr(torch.ops.ringcc, name).default._schema
        positional = [a for a in schema.arguments if not a.kwarg_only]
        for given in range(len(positional) + 1):
            args = tuple(object() for _ in range(given))
            assert _compat._fill_defaults_linear(schema, args, {}) == _compat.TORCH_FILL_DEFAULTS(schema, args, {}), \
                (name, given)


@pytest.mark.parametrize("autocast", [False, True])
def test_eager_calls_match_the_op(monkeypatch, autocast):
    """A plain eager call runs the op's Python through an autograd.Function (Note [Eager ring
    calls]): the same outputs, LSE and gradients (q, k, v and sinks) as the custom op, with key
    padding, a window, soft-cap, ALiBi and sinks, and under autocast the op's casts. Under a
    dispatch mode the custom op runs."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from ringcc.runtime import ops

    gen = torch.Generator().manual_seed(7)
    q, k, v, dout = (torch.randn(2, 4, 12, 8, generator=gen) for _ in range(4))
    k, v = k[:, :2], v[:, :2]
    kpm = torch.rand(2, 12, generator=gen) < 0.2
    sinks, slopes = torch.randn(4, generator=gen), torch.rand(4, generator=gen)
    eager_calls = []
    apply = ops._EagerRing.apply
    monkeypatch.setattr(ops._EagerRing, "apply", lambda *a: eager_calls.append(1) or apply(*a))
    plain = ops._compat.plain_eager

    def run(eager: bool):
        monkeypatch.setattr(ops._compat, "plain_eager", plain if eager else (lambda values: False))
        leaves = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out, lse = ringcc.ring_attention(*leaves[:3], is_causal=True, key_padding_mask=kpm, window=7, softcap=3.0,
                                             alibi_slopes=slopes, sinks=leaves[3], return_lse=True)
        out.float().backward(dout)
        return [out, lse] + [t.grad for t in leaves]

    eager, op = run(True), run(False)
    assert len(eager_calls) == 1
    assert eager[0].dtype == (torch.bfloat16 if autocast else torch.float32)
    for a, b in zip(eager, op):
        assert b is not None and a.dtype == b.dtype
        torch.testing.assert_close(a, b, atol=0, rtol=0)

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.add(str(func))
            return func(*args, **(kwargs or {}))

    monkeypatch.setattr(ops._compat, "plain_eager", plain)
    with Ops() as mode:
        ringcc.ring_attention(q, k, v, is_causal=True)
    assert "ringcc.ring_attention.default" in mode.seen and len(eager_calls) == 1


@pytest.mark.parametrize("fn", ["shard_sequence", "gather_sequence"])
def test_sequence_dim_out_of_range_is_an_error(fn):
    """A dim outside the tensor's dims is an error naming the range, also at p = 1 (no
    wrap-around: dim 9 of a 4-D tensor is not dim 1)."""
    x = torch.randn(1, 2, 8, 4)
    for dim in (9, -5, 1.0):
        with pytest.raises(ValueError, match=r"dim must be an int in \[-4, 3\] for a 4-D tensor of shape \(1, 2, 8, 4\)"):
            getattr(ringcc, fn)(x, dim)
    assert getattr(ringcc, fn)(x, -2).shape == x.shape


def case_shard_gather_roundtrip(rank, world, layout):
    x = torch.arange(2 * 12 * world * 3, dtype=torch.float32).view(2, 12 * world, 3).requires_grad_()
    s = ringcc.shard_sequence(x, 1, layout=layout)
    assert s.shape == (2, 12, 3)
    torch.testing.assert_close(s, L.shard(x.detach(), 1, rank, world, L.Layout(layout)))
    full = ringcc.gather_sequence(s, 1, layout=layout)
    torch.testing.assert_close(full, x.detach())
    (full * torch.arange(12 * world).view(1, -1, 1)).sum().backward()
    # gather's backward slices, shard's backward gathers: the replicated gradient is exact.
    torch.testing.assert_close(x.grad, torch.arange(12 * world, dtype=torch.float32).view(1, -1, 1).expand_as(x))
    return True


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_shard_gather_are_inverses(pools, world, layout):
    assert all(pools(world).run(case_shard_gather_roundtrip, layout))


def case_unequal_lengths(rank, world):
    q, k, v = _qkv(s=8 + 2 * rank)
    try:
        ringcc.ring_attention(q, k, v)
    except ValueError as e:
        return str(e)
    return "no error"


def test_unequal_shard_lengths_raise_on_every_rank(pools):
    msgs = pools(2).run(case_unequal_lengths)
    for m in msgs:
        assert "needs equal shard lengths on every rank" in m and "from 8 to 10" in m


def case_different_settings(rank, world, name, values):
    """Rank r runs with values[r] of one setting: an environment variable, or the debug level
    (TORCH_DISTRIBUTED_DEBUG, set through torch.distributed since torch reads the variable at
    import)."""
    import torch.distributed as dist

    debug = name == "TORCH_DISTRIBUTED_DEBUG"
    if debug:
        dist.set_debug_level(getattr(dist.DebugLevel, values[rank]))
    else:
        os.environ[name] = values[rank]
    try:
        q, k, v = _qkv()
        ringcc.ring_attention(q, k, v)
    except ValueError as e:
        return str(e)
    finally:
        if debug:
            dist.set_debug_level(dist.DebugLevel.OFF)
        else:
            del os.environ[name]
    return "no error"


@pytest.mark.parametrize("name,values", [("RINGCC_RING_WORKSPACE_MIB", ("0", "64")),
                                         ("RINGCC_RING_TRANSPORT", ("auto", "nccl")),
                                         ("TORCH_DISTRIBUTED_DEBUG", ("OFF", "DETAIL"))])
def test_different_schedule_settings_raise_on_every_rank(pools, name, values):
    # Ranks chunking heads differently, or moving blocks by different transports, would wait
    # for each other forever: an error instead. A rank at debug level DETAIL checks every CUDA
    # call and the others once per signature: they would wait for each other at the first
    # repeated call, so the first check of every signature compares the levels too.
    for m in pools(2).run(case_different_settings, name, values):
        assert "different runtime settings" in m and name in m, m


def case_different_arguments(rank, world, what):
    """Rank 1 differs from rank 0 in one argument; same bytes per tensor where it can."""
    q, k, v = _qkv()
    kwargs = {}
    if what == "dtype" and rank == 1:
        q, k, v = (t.double() for t in (q, k, v))
    if what == "causal":
        kwargs["is_causal"] = rank == 0
    if what == "mask" and rank == 0:  # a key mask on one rank only used to leave the other waiting
        kwargs["key_padding_mask"] = torch.zeros(q.shape[0], q.shape[2], dtype=torch.bool)
    if what == "layout":
        kwargs["layout"] = ("contiguous", "zigzag")[rank]
    try:
        ringcc.ring_attention(q, k, v, **kwargs)
    except ValueError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("what", ["dtype", "causal", "mask", "layout"])
def test_different_arguments_raise_on_every_rank(pools, what):
    for m in pools(2).run(case_different_arguments, what):
        assert "ranks call attention with different arguments; this rank: ring_attention(" in m, m


def test_cuda_checks_every_call_only_under_debug_detail(monkeypatch):
    import torch.distributed as dist

    from ringcc.runtime import ops

    assert ops.checks_every_call(cuda=False)
    for level, every in ((dist.DebugLevel.OFF, False), (dist.DebugLevel.INFO, False), (dist.DebugLevel.DETAIL, True)):
        monkeypatch.setattr(dist, "get_debug_level", lambda level=level: level)
        assert ops.checks_every_call(cuda=True) is every
        assert ops.checks_every_call(cuda=False)


def case_dead_peer(rank, world):
    import datetime
    import time

    import torch.distributed as dist

    group = dist.new_group(list(range(world)), timeout=datetime.timedelta(seconds=3), backend="gloo")
    q, k, v = _qkv(s=8)
    ringcc.ring_attention(q, k, v, group=group)  # healthy first call (also checks lengths)
    if rank == 1:
        return "left the ring"
    t0 = time.monotonic()
    try:
        ringcc.ring_attention(q, k, v, group=group)
    except RuntimeError as e:
        return f"error after {time.monotonic() - t0:.1f}s: {type(e).__name__}"
    return "no error"


def test_dead_peer_is_an_error_within_the_group_timeout(pools):
    res = pools(2).run(case_dead_peer, timeout=60)
    assert res[1] == "left the ring"
    assert res[0].startswith("error after"), res[0]
    assert float(res[0].split()[2].rstrip("s:")) < 30


def case_ring_backward_batches(rank, world, budget):
    """Counts the ring backward's batches and bytes: one batch per step (next K/V and the
    previous step's dK/dV accumulator together); the first hop and the hop home in the input
    dtype (Note [Fewer passes])."""
    from ringcc.runtime import workspace
    from ringcc.runtime.comm import RingComm

    os.environ["RINGCC_RING_WORKSPACE_MIB"] = budget
    commits, sent = [], []
    orig_commit, orig_send = RingComm.commit, RingComm.send_recv

    def commit(self):
        commits.append(1)
        return orig_commit(self)

    def send_recv(self, tensors, recv_buffers=None):
        sent.extend((t.dtype, t.numel()) for t in tensors)
        return orig_send(self, tensors, recv_buffers)

    try:
        b, h, g, n_local, d = 1, 4, 2, 8, 16
        q, k, v, dout, _ = _inputs(5, b, h, g, n_local * world, d, False)
        sh = lambda t: L.shard(t, 2, rank, world, L.Layout.CONTIGUOUS).bfloat16()  # noqa: E731
        ql, kl, vl = (sh(t).requires_grad_() for t in (q, k, v))
        chunk = workspace.ring_kv_chunk(ql, kl, None, world) or g
        out = ringcc.ring_attention(ql, kl, vl, is_causal=False)
        RingComm.commit, RingComm.send_recv = commit, send_recv
        out.backward(sh(dout))
    finally:
        RingComm.commit, RingComm.send_recv = orig_commit, orig_send
        del os.environ["RINGCC_RING_WORKSPACE_MIB"]
    n_chunks = g // chunk
    kv_numel = b * chunk * n_local * d
    fp32 = sum(n for dt, n in sent if dt == torch.float32)
    bf16 = sum(n for dt, n in sent if dt == torch.bfloat16)
    return (len(commits), n_chunks, fp32, bf16, kv_numel)


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("budget", ["0", "0.0001"])
def test_ring_backward_one_batch_per_step(pools, world, budget):
    for commits, n_chunks, fp32, bf16, kv_numel in pools(world).run(case_ring_backward_batches, budget):
        # p batches per head chunk, and one more for the last chunk's hop home.
        assert commits == n_chunks * world + 1
        # fp32 on the wire: the hops of dK and dV that carry a sum of two or more blocks (p - 2).
        assert fp32 == n_chunks * (world - 2) * 2 * kv_numel
        # bf16: K and V to p - 1 neighbours, plus dK and dV twice per chunk: the first hop (one
        # block's gradient as the kernel gave it: exact) and the hop home (the complete sum).
        assert bf16 == n_chunks * ((world - 1) * 2 * kv_numel + 2 * 2 * kv_numel)


def case_transport_choice(rank, world):
    """Which ring transport ring_comm picks on CPU, and its errors for bad settings."""
    import torch.distributed as dist

    from ringcc.runtime import comm

    cpu, got = torch.device("cpu"), {}
    for setting in ("auto", "nccl"):
        os.environ["RINGCC_RING_TRANSPORT"] = setting
        got[setting] = type(comm.ring_comm(dist.group.WORLD, None, cpu)).__name__
    errors = {}
    for setting in ("copy-engine", "rdma"):
        os.environ["RINGCC_RING_TRANSPORT"] = setting
        try:
            comm.ring_comm(dist.group.WORLD, None, cpu)
        except ValueError as e:
            errors[setting] = str(e)
    os.environ["RINGCC_RING_TRANSPORT"] = "auto"
    return got, errors, comm.comm_buffer_bytes()


def test_ring_transport_choice_on_cpu(pools):
    # CPU rings always go through the process group (gloo); the copy-engine transport is a CUDA
    # one, asked for on CPU it is an error naming the device, and an unknown value lists the
    # allowed ones. No copy-engine receive area exists on CPU.
    for got, errors, area_bytes in pools(2).run(case_transport_choice):
        assert got == {"auto": "RingComm", "nccl": "RingComm"}
        assert "needs CUDA tensors" in errors["copy-engine"] and "cpu" in errors["copy-engine"]
        assert "auto, nccl, copy-engine" in errors["rdma"] and "'rdma'" in errors["rdma"]
        assert area_bytes == 0


def _blocks(seed, shape, regions, dtype=torch.bfloat16):
    """A block per region (b0, b1, r0, r1): batch rows [b0, b1), rows [r0, r1) of `shape`."""
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(b1 - b0, shape[1], r1 - r0, shape[3], generator=gen).to(dtype), (b0, b1, r0, r1))
            for b0, b1, r0, r1 in regions]


# (r0, r1) over the whole batch of 3, or (b0, b1, r0, r1): calls per run of batch rows
SUM_REGIONS = [
    [(0, 8)], [(0, 8), (0, 8)], [(0, 8), (4, 8), (0, 8)], [(4, 8), (0, 4), (0, 8)], [(0, 4)], [(0, 8), (2, 6)],
    [(0, 1, 0, 8), (1, 3, 2, 6)], [(0, 8), (1, 2, 0, 5), (0, 2, 3, 8)], [(2, 3, 0, 8), (0, 8)],
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_backward_lse_gives_rows_with_no_key_inf_and_keeps_every_other_value(dtype):
    """kernels.bwd_lse: -inf (a row that saw no key) becomes +inf, so its P = 0; +inf, NaN (a row
    with a NaN query) and finite values stay, bit for bit; fp32 (fp64 stays), contiguous."""
    from ringcc.runtime import kernels

    values = torch.tensor([0.0, -math.inf, math.inf, math.nan, 3.0e38, -3.0e38, 2.5, -1.0e-30], dtype=torch.float64)
    lse = values.to(dtype).repeat(3, 2, 1).transpose(0, 1)  # [2, 3, 8], strided
    got = kernels.bwd_lse(lse)
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    want = lse.to(wide).clone()
    want[want == -math.inf] = math.inf
    assert got.dtype == wide and got.is_contiguous() and got.shape == lse.shape
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.nan_to_num(0.0), want.nan_to_num(0.0))
    assert (got == math.inf).sum() == 2 * lse[..., 0].numel()  # the -inf and the +inf column


def _regions(ranges):
    return [(0, 3, *r) if len(r) == 2 else r for r in ranges]


@pytest.mark.parametrize("ranges", SUM_REGIONS)
@pytest.mark.parametrize("final", [False, True])
def test_accumulate_equals_fp32_sum_narrowed_once(ranges, final):
    """ring._accumulate (Note [Fewer passes]: one block kept in its own dtype, widening inside the
    next addition, the last addition writing the input dtype) gives bit for bit what an fp32
    accumulator summed in the same order and narrowed once gives, regions of batch rows too;
    two sums at once (dK with dV) each as alone."""
    from ringcc.runtime.ring import _accumulate

    shape = (3, 2, 8, 4)
    blocks = _blocks(len(ranges), shape, _regions(ranges))
    twins = [(blk * -2, reg) for blk, reg in blocks]  # exact in bf16
    refs = [torch.zeros(shape), torch.zeros(shape)]
    for ref, blks in zip(refs, (blocks, twins)):
        for blk, (b0, b1, r0, r1) in blks:
            ref[b0:b1, :, r0:r1] += blk.float()
    acc, pair = None, [None, None]
    for i, ((blk, reg), (twin, _)) in enumerate(zip(blocks, twins)):
        last = final and i == len(blocks) - 1 and acc is not None
        nan = lambda: torch.full(shape, float("nan"), dtype=torch.bfloat16)  # noqa: E731
        dst, dsts = (nan(), [nan(), nan()]) if last else (None, None)
        (acc,) = _accumulate([acc], [blk], reg, shape, torch.float32, None if dst is None else [dst])
        pair = _accumulate(pair, [blk, twin], reg, shape, torch.float32, dsts)
        if last:
            assert acc is dst and pair[0] is dsts[0] and pair[1] is dsts[1]
    if len(blocks) == 1 and ranges[0] == (0, 8):
        assert acc is blocks[0][0]  # one block covering every row: no pass at all
    for got, ref in ((acc, refs[0]), (pair[0], refs[0]), (pair[1], refs[1])):
        assert torch.equal(got.to(torch.bfloat16), ref.to(torch.bfloat16))
        if got.dtype == torch.float32:
            assert torch.equal(got, ref)


@pytest.mark.parametrize("ranges", [[(0, 8), (0, 8)], [(0, 8), (4, 8)], [(0, 8), (4, 8), (0, 8)], [(4, 8), (0, 8)],
                                    [(0, 2, 0, 8), (2, 3, 1, 7)], [(0, 8), (1, 2, 2, 8), (0, 1, 0, 3)]])
@pytest.mark.parametrize("final", [False, True])
def test_merge_block_equals_fp32_merge_narrowed_once(ranges, final):
    """ring._merge_block: the first block's own out (input dtype) widened inside the next merge,
    the last merge writing the output in the input dtype: bit for bit the fp32 merge of the
    same blocks in the same order, narrowed once; regions of batch rows too."""
    from ringcc.runtime.merge import merge_
    from ringcc.runtime.ring import _merge_block

    shape = (3, 2, 8, 4)
    blocks = _blocks(7, shape, _regions(ranges))
    gen = torch.Generator().manual_seed(3)
    lses = [torch.randn(b1 - b0, 2, r1 - r0, generator=gen) for _, (b0, b1, r0, r1) in blocks]
    ref_o, ref_l = torch.zeros(shape), torch.full(shape[:3], float("-inf"))
    for (o, (b0, b1, r0, r1)), l in zip(blocks, lses):
        merge_(ref_o[b0:b1, :, r0:r1], ref_l[b0:b1, :, r0:r1], o, l)
    acc = None
    for i, ((o, reg), l) in enumerate(zip(blocks, lses)):
        last = final and i == len(blocks) - 1 and acc is not None
        dst = (torch.full(shape, float("nan"), dtype=torch.bfloat16), torch.full(shape[:3], float("nan"))) if last else None
        acc = _merge_block(acc, o, l.clone(), reg, shape, torch.float32, dst)
    assert torch.equal(acc[0].to(torch.bfloat16), ref_o.to(torch.bfloat16))
    assert torch.equal(acc[1], ref_l)


# Query and key positions of a masked block (13 rows, 11 keys): "zigzag" has two ascending runs
# each, as a zigzag rank's block has; "before" puts the rows before the keys.
BLOCK_POSITIONS = {
    "near": (torch.arange(13) + 2, torch.arange(11)),
    "far": (torch.arange(13) + 8, torch.arange(11)),  # rows from 6 on see no key in a window of 3
    "zigzag": (torch.cat([torch.arange(0, 6), torch.arange(20, 27)]), torch.cat([torch.arange(0, 5), torch.arange(21, 27)])),
    "before": (torch.arange(13) - 6, torch.arange(11)),
}


MASKED_BLOCK_CASES = [  # (causal, key mask, window, positions); windows run both ways (window_causal)
    (True, True, None, "near"), (False, False, 5, "near"), (True, False, 3, "near"), (True, True, 4, "near"),
    (False, True, None, "near"), (False, False, None, "near"), (False, True, 3, "far"), (True, False, 3, "far"),
    (False, False, 4, "zigzag"), (True, True, 3, "zigzag"), (False, True, 2, "before"), (True, False, 1, "near")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("causal,key_mask,window,positions,window_causal", [
    (*case, wc) for case in MASKED_BLOCK_CASES for wc in ((False, True) if case[2] else (False,))])
def test_masked_blocks_run_in_row_chunks(monkeypatch, dtype, causal, key_mask, window, positions, window_causal):
    """Note [Masked rows]: the CPU kernel and the exact math path (CUDA's, for masked blocks and
    fp32/fp64; run here on CPU), each in one call and in chunks of query rows (a tiny
    MASKED_CALL_BYTES), against a dense reference built here from the positions: out, lse, dq,
    dk, dv (GQA; rows that see no key: out 0, lse -inf, no gradient). The math path cuts each
    chunk's keys to the range its rows may see (`_key_range`), and its chunks do not span a jump
    in the rows' positions (`WindowMask.row_breaks`). The window may be causal (i - j < w, as in
    a causal ring's blocks, whose own causal flag is set on the diagonal only) or not."""
    from ringcc import reference
    from ringcc.runtime import kernels
    from ringcc.runtime.ring import WindowMask

    torch.manual_seed(0)
    b, h, g, lq, lk, d = 2, 4, 2, 13, 11, 8
    q, dout = torch.randn(b, h, lq, d, dtype=dtype), torch.randn(b, h, lq, d, dtype=dtype)
    k, v = torch.randn(b, g, lk, d, dtype=dtype), torch.randn(b, g, lk, d, dtype=dtype)
    kv = None
    if key_mask:
        kv = torch.rand(b, lk) > 0.3
        kv[1] = False  # batch row 1 sees one key only: with the causal band, its first rows see none
        kv[1, 5] = True
    q_pos, k_pos = BLOCK_POSITIONS[positions]
    allowed = None
    if window is not None:  # rows built on demand from int32 positions, as the ring keeps them
        allowed = WindowMask(q_pos.int(), k_pos.int(), window, window_causal)
        if positions == "far" and not window_causal:  # rows from 6 on (positions >= 14) see no key
            assert allowed.key_range(6, 9) == (11, 11) and allowed.key_range(0, 3) == (6, 11)
        if positions == "zigzag":
            assert allowed.row_breaks == (6,)
    args = dict(scale=0.3, causal=causal, key_valid_bs=kv, allowed_qk=allowed)

    # the reference: every (row, key) pair tested from the positions
    vis = torch.ones(b, 1, lq, lk, dtype=torch.bool)
    if causal:
        vis &= torch.ones(lq, lk, dtype=torch.bool).tril()
    if window is not None:
        diff = q_pos[:, None] - k_pos[None, :]
        vis &= diff < window if window_causal else diff.abs() < window
    if kv is not None:
        vis &= kv[:, None, None, :]
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    ref_out, ref_lse = reference.masked_attention(qr, kr, vr, vis, scale=0.3)
    ref_out.backward(dout)
    want = (ref_out.detach(), ref_lse.detach(), qr.grad, kr.grad, vr.grad)

    def run():
        out, lse = kernels.block_fwd(q, k, v, **args)
        return (out, lse, *kernels.block_bwd(dout, q, k, v, out, lse, **args))

    def check(got, how):
        for name, c, w in zip(("out", "lse", "dq", "dk", "dv"), got, want):
            assert c.dtype == w.dtype and c.shape == w.shape, (how, name)
            torch.testing.assert_close(c, w, rtol=1e-5, atol=1e-5, msg=f"{how}: {name}")

    check(run(), "cpu kernel")
    assert kernels._masked_row_chunks(q, lk, causal, kv, allowed) is None  # one call at the default size
    score_bytes = 8 if dtype == torch.float64 else 4  # scores in the accumulator dtype
    monkeypatch.setattr(kernels, "MASKED_CALL_BYTES", score_bytes * b * h * lk * 3)  # 3 rows per call
    assert kernels._row_chunks(q, lk, allowed) == [(0, 3), (3, 6), (6, 9), (9, 12), (12, 13)]
    monkeypatch.setattr(kernels, "MASKED_CALL_BYTES", score_bytes * b * h * lk * 4)  # 4 rows: none spans row 6
    assert kernels._row_chunks(q, lk, allowed) == ([(0, 4), (4, 6), (6, 10), (10, 13)] if allowed and positions == "zigzag"
                                                   else [(0, 4), (4, 8), (8, 12), (12, 13)])
    monkeypatch.setattr(kernels, "MASKED_CALL_BYTES", score_bytes * b * h * lk * 3)
    check(run(), "cpu kernel in row chunks")
    monkeypatch.setattr(kernels, "_math_path", lambda *_: True)  # every block on the math path (fp32/fp64)
    for rows in (1, 3, 4, lq):
        monkeypatch.setattr(kernels, "MASKED_CALL_BYTES", score_bytes * b * h * lk * rows)
        check(run(), f"math path, {rows} rows per call")


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("is_causal", [False, True])
def test_window_calls_match_the_dense_position_test(layout, is_causal):
    """masked_calls decides skip / whole block / masked from the positions alone (min/max and a
    nearest-key search, no [Lq, Lk] matrix): the same calls and masks as testing every pair."""
    from ringcc.runtime.layout import Layout, global_positions
    from ringcc.runtime.ring import RingSetup

    n_local = 12
    for world in (1, 2, 3, 4):
        for window in (1, 2, 3, 5, 7, 12, 13, 30, 100):
            for rank in range(world):
                setup = RingSetup(None, rank, world, Layout(layout), is_causal, 1.0, window=window)
                for src in range(world):
                    q_pos = global_positions(rank, world, Layout(layout), n_local)
                    k_pos = global_positions(src, world, Layout(layout), n_local)
                    want = []
                    for c in setup.calls(n_local, src):
                        diff = q_pos[c.q0:c.q1, None] - k_pos[None, c.k0:c.k1]
                        ok = diff < window if is_causal else diff.abs() < window
                        if ok.any():
                            want.append((c, None if ok.all() else ok))
                    got = setup.masked_calls(n_local, src, torch.device("cpu"))
                    assert [c for c, _ in got] == [c for c, _ in want], (world, window, rank, src)
                    for (c, m), (_, w) in zip(got, want):
                        assert (m is None) == (w is None), (world, window, rank, src, c)
                        if m is not None:
                            assert torch.equal(m.rows(0, c.q1 - c.q0), w)


@pytest.mark.parametrize("mods,dynamic", [({"window": 6}, True), ({"softcap": 5.0, "alibi": True}, None)])
def test_compiles_in_one_graph(mods, dynamic):
    """ring_attention called inside torch.compile(fullgraph=True), with a window (dynamic=True) or
    with score functions (automatic dynamic: under dynamic=True dynamo makes the float soft-cap
    symbolic, and the function's text needs its value): the cross-rank call signature (sizes in a
    string, sorted arguments) and the score function's text stay out of the traced code; output
    and gradients are eager's."""
    slopes = torch.tensor([0.5, 0.25]) if mods.get("alibi") else None

    def f(q, k, v):
        return ringcc.ring_attention(q, k, v, is_causal=True, window=mods.get("window"), softcap=mods.get("softcap"),
                                     alibi_slopes=slopes) * 2

    q, k, v = _qkv(h=2, g=2, s=16)
    torch._dynamo.reset()
    runs = {}
    for name, fn in (("eager", f), ("compiled", torch.compile(f, fullgraph=True, backend="eager", dynamic=dynamic))):
        qq, kk, vv = (t.detach().clone().requires_grad_() for t in (q, k, v))
        out = fn(qq, kk, vv)
        out.square().sum().backward()
        runs[name] = [out, qq.grad, kk.grad, vv.grad]
    for a, b in zip(runs["compiled"], runs["eager"]):
        torch.testing.assert_close(a, b)


def case_sub_ring_with_one_padded_rank(rank, world):
    """A ring with `members` (the dilated sub-ring form) where only the last rank's keys hold
    padding: every rank keeps the key mask (no group all-gather), so transfers match and the
    padded block stays masked."""
    from ringcc.runtime.ring import RingSetup, _key_runs, ring_forward

    b, h, n, d = 1, 2, 8, 4
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, h, n * world, d, generator=gen) for _ in range(3))
    valid = torch.ones(b, n * world, dtype=torch.bool)
    valid[:, -5:-2] = False
    sh = lambda t, dim=2: L.shard(t, dim, rank, world, L.Layout.CONTIGUOUS)  # noqa: E731
    setup = RingSetup(torch.distributed.group.WORLD, rank, world, L.Layout.CONTIGUOUS, False, d ** -0.5,
                      members=tuple(range(world)))
    assert _key_runs(sh(valid, 1), setup) == {}
    ref, _ = reference.attention(q, k, v, key_padding_mask=~valid)
    out, _ = ring_forward(sh(q), sh(k), sh(v), sh(valid, 1), setup)
    return float((out - sh(ref)).abs().max())


@pytest.mark.parametrize("world", [2, 3])
def test_sub_ring_keeps_key_masks(pools, world):
    assert max(pools(world).run(case_sub_ring_with_one_padded_rank)) < 1e-5


def case_group_released(rank, world):
    import gc
    import weakref

    import torch.distributed as dist

    sub = dist.new_group(list(range(world)), backend="gloo")
    q, k, v = _qkv(s=8)
    ringcc.ring_attention(q, k, v, is_causal=True, key_padding_mask=torch.zeros(1, 8, dtype=torch.bool), group=sub)
    ref = weakref.ref(sub)
    dist.destroy_process_group(sub)
    del sub
    gc.collect()
    return ref() is None


def test_destroyed_group_is_not_kept_alive_by_ringcc(pools):
    """ringcc's caches hold groups weakly: after destroy_process_group the group (and gloo's
    worker threads) end there, not at interpreter shutdown (see ops._SETUPS)."""
    assert pools(2).run(case_group_released) == [True, True]


def test_ring_setup_start_is_the_first_position_of_consecutive_rows():
    """RingSetup.start (Note [Consecutive positions] in maskfn.py): for every rank, layout, balance
    plan chunks and row range, the first row's global position where the rows' positions follow
    each other, else None; checked against the positions themselves."""
    from ringcc.runtime.ring import RingSetup

    n_local = 12
    for world in (1, 2, 3, 4):
        for lay in (L.Layout.CONTIGUOUS, L.Layout.ZIGZAG):
            setups = [RingSetup(None, 0, world, lay, True, 1.0)]
            if world == 2:  # a balance plan's chunks: 4 per rank, some consecutive
                setups.append(RingSetup(None, 0, world, lay, True, 1.0, chunks=((0, 1, 6, 7), (2, 5, 3, 4))))
            for setup in setups:
                for rank in range(world):
                    pos = setup.positions(rank, n_local).tolist()
                    for r0 in range(n_local):
                        for r1 in range(r0 + 1, n_local + 1):
                            want = pos[r0] if pos[r0:r1] == list(range(pos[r0], pos[r0] + r1 - r0)) else None
                            assert setup.start(rank, n_local, r0, r1) == want, (world, lay, setup.chunks, rank, r0, r1)


def _eager_finite_fill(q, k, v, allowed, scale):
    """Eager attention under an additive mask of finfo.min: a row with every key masked is a
    softmax of equal values, the mean of the values, and autograd differentiates that softmax."""
    r = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(r, 1), v.repeat_interleave(r, 1)
    low = torch.tensor(torch.finfo(q.dtype).min, dtype=q.dtype)
    s = q @ k.transpose(-1, -2) * scale + torch.where(allowed, torch.tensor(0.0, dtype=q.dtype), low)
    return torch.softmax(s, -1) @ v


@pytest.mark.parametrize("length", [12, 9])
def test_fill_empty_rows_gives_eager_rows_and_gradients(length):
    """ringcc::fill_empty_rows after the ring op (Note [Rows with no key]): GQA, a value head dim of
    its own, a fully padded sample and left padding; with `length` < n the keys past it are not the
    sequence's (Config(pad=True)), and the result equals eager on the first `length` tokens."""
    gen = torch.Generator().manual_seed(0)
    b, h, g, n, d, dv, scale = 3, 4, 2, 12, 8, 6, 0.3
    q, k = torch.randn(b, h, n, d, generator=gen, dtype=torch.float64), torch.randn(b, g, n, d, generator=gen,
                                                                                     dtype=torch.float64)
    v = torch.randn(b, g, n, dv, generator=gen, dtype=torch.float64)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    valid = torch.ones(b, n, dtype=torch.bool)
    valid[0, :4] = False  # left padding
    valid[1] = False  # a fully padded sample
    valid[:, length:] = False  # the padding Config(pad=True) adds
    out, lse = torch.ops.ringcc.ring_attention(q, k, v, valid, True, scale, "", 1, "contiguous")
    got = torch.ops.ringcc.fill_empty_rows(out, lse, q, k, v, scale, "", 1, "contiguous", length)
    i, m = torch.arange(length), slice(0, length)
    allowed = (i[None, :] <= i[:, None])[None, None] & valid[:, None, None, m]
    want = _eager_finite_fill(q[:, :, m], k[:, :, m], v[:, :, m], allowed, scale)
    dout = torch.randn(b, h, n, dv, generator=gen, dtype=torch.float64)
    dout[:, :, length:] = 0  # the padded rows are never read
    grads = torch.autograd.grad((got * dout).sum(), (q, k, v))
    wants = torch.autograd.grad((want * dout[:, :, m]).sum(), (q, k, v))
    assert int((lse[:, :, m] == -math.inf).sum()) == 4 * h + length * h  # the rows with no key
    torch.testing.assert_close(got[:, :, m], want, atol=1e-12, rtol=1e-12)
    for a, w in zip(grads, wants):
        torch.testing.assert_close(a, w, atol=1e-12, rtol=1e-12)
    torch.library.opcheck(torch.ops.ringcc.fill_empty_rows.default,
                          (out.detach(), lse, q.detach(), k.detach(), v.detach(), scale, "", 1, "contiguous", length))
