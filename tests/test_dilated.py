"""Dilated attention (LongNet) vs the dense masked reference: single device and real gloo
groups, p = 1, 2, 3, 4; the spec, the index plans, the custom ops and the bytes on the wire."""

import pytest
import sympy
import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

import ringcc
from parity import assert_shard_matches, rel_err, workspace_mib
from ringcc import reference
from ringcc.runtime import dilated as D
from ringcc.runtime import layout as L
from ringcc.runtime import workspace

TOL = dict(atol=1e-5, rtol=1e-5)
N_LOCAL = 8

# Per world size: segments shorter than, equal to and longer than the shard (8 tokens), one
# longer than the sequence (clipped), LongNet's geometric w with r = 1, 2, 4, ...
LONGNET = {
    1: ([2, 4, 8, 16], [1, 2, 4, 8]),
    2: ([4, 8, 16, 32], [1, 2, 4, 8]),
    3: ([4, 8, 24, 48], [1, 2, 4, 8]),
    4: ([4, 8, 16, 32, 64], [1, 2, 4, 4, 8]),
}
HEADS = [(8, 8), (8, 2), (8, 1)]  # MHA, GQA, MQA


def _inputs(seed, b, h, g, n, d, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    shapes = ((b, h, n, d), (b, g, n, d), (b, g, n, d), (b, h, n, d))  # q, k, v, dout
    return tuple(torch.randn(*shape, generator=gen).to(dtype) for shape in shapes)


def _whole(t):
    """p = 1: the whole tensor is the shard."""
    return t


def _check(rank, world, spec, is_causal, h, g, layout="contiguous", n_local=N_LOCAL, seed=0):
    """One case on this rank: forward, LSE and gradients against the dense reference."""
    n = n_local * world
    q, k, v, dout = _inputs(seed, 2, h, g, n, 4)
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    ref_out, ref_lse = reference.dilated_attention(qr, kr, vr, spec, is_causal=is_causal)
    ref_out.backward(dout)
    lay = L.Layout(layout)
    sh = lambda t: L.shard(t, 2, rank, world, lay)  # noqa: E731
    ql, kl, vl = (sh(t).requires_grad_() for t in (q, k, v))
    out, lse = ringcc.dilated_attention(ql, kl, vl, spec, is_causal=is_causal, layout=layout, return_lse=True)
    out.backward(sh(dout))
    assert_shard_matches(sh, out, lse, ref_out, ref_lse, ((ql.grad, qr.grad), (kl.grad, kr.grad), (vl.grad, vr.grad)), TOL)
    return torch.isneginf(lse).any().item()


def case_matrix(rank, world, offsets, budget_mib=None):
    """Every (causal, heads) case of the LongNet schedule for this world size, one pool call;
    with `budget_mib` (RINGCC_RING_WORKSPACE_MIB) the op runs in head chunks, checked here."""
    w, r = LONGNET[world]
    spec = ringcc.DilatedSpec(w, r, offsets=offsets)
    saw_empty_rows = False
    with workspace_mib(budget_mib):
        for is_causal in (False, True):
            for seed, (h, g) in enumerate(HEADS):
                if budget_mib is not None and g > 1:
                    q, k = torch.empty(2, h, N_LOCAL, 4), torch.empty(2, g, N_LOCAL, 4)
                    assert workspace.dilated_kv_chunk(q, k, spec, world, "contiguous") == (1, 1)
                saw_empty_rows |= _check(rank, world, spec, is_causal, h, g, seed=seed)
    return saw_empty_rows


# head groups and per-head offsets at p = 2 in make test; p = 1, 3 and 4 are the soak tier
@pytest.mark.parametrize("offsets,world", [
    *(pytest.param(o, p, marks=[] if p == 2 else pytest.mark.soak) for o in ("head_groups", "per_head")
      for p in (1, 2, 3, 4))], ids=lambda v: str(v))
def test_dilated_matches_reference(pools, world, offsets):
    saw_empty = pools(world).run(case_matrix, offsets)
    if offsets == "head_groups":
        # A head in a branch with r > 1 has rows active in no branch: out 0, lse -inf.
        assert any(saw_empty)


@pytest.mark.parametrize("world", [1, 2, *(pytest.param(p, marks=pytest.mark.soak) for p in (3, 4))])
@pytest.mark.parametrize("offsets", ["per_head", "head_groups"])
def test_dilated_head_chunks_match_reference(pools, world, offsets):
    # One K/V head per chunk (a tiny budget): every chunk's out/lse and dq/dk/dv land in its
    # own heads, sub-ring branches included; head_groups rows no branch reaches give 0 / -inf.
    pools(world).run(case_matrix, offsets, "0.0001")


@pytest.mark.parametrize("spec,offsets,h,g,dtype", [
    (([8, 16, 64], [1, 2, 4]), "per_head", 8, 2, torch.float32),
    (([8, 16, 64], [1, 2, 4]), "per_head", 8, 2, torch.bfloat16),
    # Unequal slot sharing in all heads (one slot per head) but equal inside a chunk: the chunk
    # keeps the whole run's slots, so its GQA sums of dK/dV round the same way.
    (([8, 16], [1, 2]), "head_groups", 12, 3, torch.bfloat16),
    (([8, 16, 32], [1, 1, 2]), "head_groups", 8, 2, torch.bfloat16),
])
def test_head_chunks_are_exact(spec, offsets, h, g, dtype):
    """Head chunks change which heads run together, not any head's arithmetic: the same bits."""
    b, n, d = 2, 64, 4
    spec = ringcc.DilatedSpec(*spec, offsets=offsets)
    q, k, v, dout = _inputs(5, b, h, g, n, d, dtype)
    results = []
    for budget in ("0", "0.0001"):
        with workspace_mib(budget):
            setup = D._setup(q, k, list(spec.segment_lengths), list(spec.dilation_rates), spec.offsets, True, 0.5,
                             ringcc.runtime.ops._group_args(None, "test")[0], 1, "contiguous")
            out, lse = D.dilated_forward(q, k, v, setup)
            results.append((setup, out, lse, *D.dilated_backward(dout, q, k, v, out, lse, setup)))
    (whole, *a), (chunked, *b) = results
    assert whole.forward_chunks == whole.backward_chunks == ()
    assert [c.kv for c in chunked.backward_chunks] == [slice(i, i + 1) for i in range(g)]
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def test_head_chunk_without_a_branch():
    """A head chunk that no branch reaches (empty plans): out 0, lse -inf, zero gradients."""
    q, k, v, dout = _inputs(6, 1, 4, 2, 16, 4)
    spec = ringcc.DilatedSpec([8], [1])
    plans = D.dilated_plan(spec, 16, 4, 2, 0, 1, "contiguous", (0, 1))
    empty = D.HeadChunk(2, 4, 1, 2, ())
    setup = D.DilatedSetup(None, 0, 1, (), False, 0.5, (D.HeadChunk(0, 2, 0, 1, plans), empty),
                           (D.HeadChunk(0, 2, 0, 1, plans), empty))
    out, lse = D.dilated_forward(q, k, v, setup)
    assert torch.equal(out[:, 2:], torch.zeros_like(out[:, 2:])) and torch.isneginf(lse[:, 2:]).all()
    ref_out, ref_lse = reference.dilated_attention(q[:, :2], k[:, :1], v[:, :1], spec)
    torch.testing.assert_close(out[:, :2], ref_out, **TOL)
    dq, dk, dv = D.dilated_backward(dout, q, k, v, out, lse, setup)
    assert all(torch.equal(t[:, sl], torch.zeros_like(t[:, sl])) for t, sl in ((dq, slice(2, 4)), (dk, slice(1, 2)), (dv, slice(1, 2))))
    assert dq[:, :2].abs().sum() > 0


def test_dilated_head_chunk_rule_and_formula():
    """The rule picks the largest head chunk whose workspace fits the budget, the planner's
    formula gives that chunk's workspace, and a 0 budget never chunks. MHA h=16 bf16 at 512K
    tokens per rank (LongNet at 1M, p = 2): about 16 GiB of fp32 dQ/dK/dV accumulators with all
    heads against a 6.31 GiB budget."""
    n, world = 1 << 20, 2
    ws, rs = [2048, 8192, 32768, 131072, 524288, n], [1, 2, 4, 8, 16, 32]
    spec = ringcc.DilatedSpec(ws, rs)
    q = torch.empty(1, 16, n // world, 128, dtype=torch.bfloat16, device="meta")
    fwd, bwd = workspace.dilated_kv_chunk(q, q, spec, world, "contiguous")
    assert (fwd, bwd) == (4, 4)
    a = {"q": workspace.TensorSize(tuple(q.shape), 2, "meta"), "k": workspace.TensorSize(tuple(q.shape), 2, "meta"),
         "segment_lengths": ws, "dilation_rates": rs, "offsets": "per_head", "layout": "contiguous"}
    opts = {o[0]: o for o in workspace._dilated_options(a, sympy.Integer(world))}
    budget = workspace.default_dilated_budget(a["q"], a["k"])
    assert budget == workspace.default_ring_budget(a["q"], a["k"]) > workspace.DILATED_BUDGET_FLOOR
    planned = workspace.dilated_attention(a, sympy.Integer(world))
    assert planned.forward == opts[4][1] <= budget < opts[8][1]
    assert planned.backward == opts[4][2] <= budget < opts[8][2]
    assert opts[0][2] > 2.5 * opts[4][2]  # what the chunks save
    with workspace_mib("0"):
        assert workspace.dilated_kv_chunk(q, q, spec, world, "contiguous") == (0, 0)
        assert workspace.dilated_attention(a, sympy.Integer(world)).backward == opts[0][2]


def test_dilated_budget_floor_keeps_whole_heads_at_short_lengths():
    """Under the 4 GiB floor the dilated op keeps all heads (the ring's own budget would chunk
    them), in the rule and in the planner's formula alike: LongNet at 256K tokens on 4 ranks,
    MHA h=16 and GQA 32/8, bf16, where whole heads need 2.8-3.6 GiB."""
    n, world = 1 << 18, 4
    ws, rs = [2048, 8192, 32768, 131072, n], [1, 2, 4, 8, 16]
    spec = ringcc.DilatedSpec(ws, rs)
    for h, g in ((16, 16), (32, 8)):
        q = torch.empty(1, h, n // world, 128, dtype=torch.bfloat16, device="meta")
        k = torch.empty(1, g, n // world, 128, dtype=torch.bfloat16, device="meta")
        a = {"q": workspace.TensorSize(tuple(q.shape), 2, "meta"), "k": workspace.TensorSize(tuple(k.shape), 2, "meta"),
             "segment_lengths": ws, "dilation_rates": rs, "offsets": "per_head", "layout": "contiguous"}
        whole = workspace._dilated_options(a, sympy.Integer(world))[0]
        assert workspace.default_ring_budget(a["q"], a["k"]) < whole[2] <= workspace.DILATED_BUDGET_FLOOR
        assert workspace.dilated_kv_chunk(q, k, spec, world, "contiguous") == (0, 0)
        planned = workspace.dilated_attention(a, sympy.Integer(world))
        assert (planned.forward, planned.backward) == (whole[1], whole[2])
        with workspace_mib("512"):  # a budget that is set is taken as it is, with no floor
            assert workspace.dilated_kv_chunk(q, k, spec, world, "contiguous") != (0, 0)


def case_bf16(rank, world):
    """bf16 shards (sub-rings included) against the fp32 reference of the same bf16-rounded
    values, causal and not: the largest relative error of out, dq, dk, dv."""
    spec = ringcc.DilatedSpec(*LONGNET[world])
    n = N_LOCAL * world
    errs = []
    for is_causal in (False, True):
        q, k, v, dout = (t.bfloat16().float() for t in _inputs(4, 2, 8, 2, n, 8))
        qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
        ref_out, _ = reference.dilated_attention(qr, kr, vr, spec, is_causal=is_causal)
        ref_out.backward(dout)
        sh = lambda t: L.shard(t, 2, rank, world, L.Layout.CONTIGUOUS)  # noqa: E731
        ql, kl, vl = (sh(t).bfloat16().requires_grad_() for t in (q, k, v))
        out = ringcc.dilated_attention(ql, kl, vl, spec, is_causal=is_causal)
        out.backward(sh(dout).bfloat16())
        for got, want in ((out, ref_out.detach()), (ql.grad, qr.grad), (kl.grad, kr.grad), (vl.grad, vr.grad)):
            errs.append(rel_err(got, sh(want)))
    return max(errs)


@pytest.mark.parametrize("world", [pytest.param(3, marks=pytest.mark.soak), 4])
def test_dilated_bf16_sub_rings(pools, world):
    # Sub-rings of 2 to 4 ranks in bf16: a block's dK/dV may travel in bf16, so every rank
    # must send what its neighbour expects (a size mismatch hung the 4-GPU benchmark).
    assert max(pools(world).run(case_bf16)) < 2e-2


def case_zigzag(rank, world):
    spec = ringcc.DilatedSpec([2, 4], [1, 2])  # fits the zigzag chunk of 4 tokens
    for is_causal in (False, True):
        _check(rank, world, spec, is_causal, 4, 2, layout="zigzag")
    with pytest.raises(ValueError, match="use layout='contiguous'"):
        q = torch.randn(1, 2, N_LOCAL, 4)
        ringcc.dilated_attention(q, q, q, ringcc.DilatedSpec([16], [2]), layout="zigzag")
    return True


@pytest.mark.parametrize("world", [2, 4])
def test_dilated_zigzag(pools, world):
    assert all(pools(world).run(case_zigzag))


def test_single_branch_full_segment_is_dense_attention():
    q, k, v, _ = _inputs(3, 2, 4, 2, 16, 8)
    for is_causal in (False, True):
        out, lse = ringcc.dilated_attention(q, k, v, ringcc.DilatedSpec([16], [1]), is_causal=is_causal, return_lse=True)
        ref_out, ref_lse = reference.attention(q, k, v, is_causal=is_causal)
        torch.testing.assert_close(out, ref_out, **TOL)
        torch.testing.assert_close(lse, ref_lse, **TOL)


def test_strided_inputs_scale_and_zigzag_at_p1():
    # q/k/v as models make them ([b, n, h, d] transposed), a custom scale, and zigzag at p = 1
    # (both chunks in natural order, so every spec is allowed).
    spec = ringcc.DilatedSpec(*LONGNET[1], offsets="head_groups")
    q, k, v, dout = _inputs(9, 2, 4, 2, 8, 4)
    qs, ks, vs = (t.transpose(1, 2).contiguous().transpose(1, 2).requires_grad_() for t in (q, k, v))
    out, lse = ringcc.dilated_attention(qs, ks, vs, spec, is_causal=True, scale=0.3, layout="zigzag", return_lse=True)
    out.backward(dout)
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    ref_out, ref_lse = reference.dilated_attention(qr, kr, vr, spec, is_causal=True, scale=0.3)
    ref_out.backward(dout)
    assert_shard_matches(_whole, out, lse, ref_out, ref_lse, ((qs.grad, qr.grad), (ks.grad, kr.grad), (vs.grad, vr.grad)), TOL)


def _matches_reference_single_device(spec, q, k, v, dout):
    """ringcc's dilated attention (p = 1) against the dense reference, causal and not:
    outputs, lse and the gradients of q, k and v."""
    for is_causal in (False, True):
        ql, kl, vl = (t.clone().requires_grad_() for t in (q, k, v))
        out, lse = ringcc.dilated_attention(ql, kl, vl, spec, is_causal=is_causal, return_lse=True)
        out.backward(dout)
        qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
        ref_out, ref_lse = reference.dilated_attention(qr, kr, vr, spec, is_causal=is_causal)
        ref_out.backward(dout)
        assert_shard_matches(_whole, out, lse, ref_out, ref_lse, ((ql.grad, qr.grad), (kl.grad, kr.grad), (vl.grad, vr.grad)), TOL)


def test_gqa_slots_shared_and_uneven():
    # h=8, h_kv=2, r=2: each kv head serves offsets {0, 1}, two query heads each: 4 slots.
    (even,) = D.dilated_plan(ringcc.DilatedSpec([8], [2]), 8, 8, 2, 0, 1, "contiguous")
    assert even.slot_kv == (0, 1, 0, 1) and even.slot_offsets == (0, 0, 1, 1)  # by offset, then kv head
    assert even.q_heads == (0, 2, 4, 6, 1, 3, 5, 7)  # slot-major
    # one strided view per offset for the queries and for the K/V slots
    assert [len(ps) for ps in D._branch_pieces(even)] == [2, 2]
    # h=6, h_kv=2, r=2: kv head 0 serves offset 0 twice (heads 0, 2) but offset 1 once:
    # unequal sharing, so every query head gets its own slot; the result stays exact.
    spec = ringcc.DilatedSpec([4, 8], [1, 2])
    plans = D.dilated_plan(spec, 8, 6, 2, 0, 1, "contiguous")
    assert plans[1].slot_kv == (0, 0, 1, 0, 1, 1) and plans[1].q_heads == (0, 2, 4, 1, 3, 5)
    q, k, v, dout = _inputs(10, 2, 6, 2, 8, 4)
    _matches_reference_single_device(spec, q, k, v, dout)


def test_branches_mix_as_one_softmax_with_duplicates():
    # Branches (4, 1) and (8, 1): one softmax over the 8 keys plus, again, the 4 of the
    # query's own short segment, i.e. dense attention over [k, k] with that mask.
    q, k, v, _ = _inputs(4, 1, 2, 2, 8, 4)
    out, lse = ringcc.dilated_attention(q, k, v, ringcc.DilatedSpec([4, 8], [1, 1]), return_lse=True)
    both_out, both_lse = reference.masked_attention(q, torch.cat([k, k], 2), torch.cat([v, v], 2), _dup_mask(8))
    torch.testing.assert_close(out, both_out, **TOL)
    torch.testing.assert_close(lse, both_lse, **TOL)


def _dup_mask(n):
    """[n, 2n]: the full segment's keys, then the same keys again restricted to 4-token segments."""
    t = torch.arange(n)
    full = torch.ones(n, n, dtype=torch.bool)
    seg4 = (t // 4)[:, None] == (t // 4)[None, :]
    return torch.cat([seg4, full], 1)


class _Recorder(TorchFunctionMode):
    """Largest tensor any torch call returns, and the shapes the attention kernel sees."""

    def __init__(self):
        super().__init__()
        self.max_numel, self.kernel_calls = 0, []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.max_numel = max(self.max_numel, t.numel())
        if func is torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default:
            self.kernel_calls.append((args[0].shape, args[1].shape))
        return out


@pytest.mark.parametrize("is_causal", [False, True])
def test_memory_linear_and_flops_sparse(is_causal):
    b, h, n, d = 1, 2, 512, 4
    spec = ringcc.DilatedSpec([16, 64, 512], [1, 4, 16])
    q, k, v, dout = _inputs(8, b, h, h, n, d)
    setup = D.DilatedSetup(None, 0, 1, D.dilated_plan(spec, n, h, h, 0, 1, "contiguous"), is_causal, 0.5)
    with _Recorder() as rec:
        out, lse = D.dilated_forward(q, k, v, setup)
        D.dilated_backward(dout, q, k, v, out, lse, setup)
    # Nothing bigger than one activation (an n x n score tensor would be 512 times larger).
    assert rec.max_numel <= b * h * n * d
    # Score entries computed: per branch, n / w segments of (w / r)^2 per head = n w / r^2.
    scores = sum(qs[0] * qs[1] * qs[2] * ks[2] for qs, ks in rec.kernel_calls)
    assert scores == sum(b * h * n * w // r**2 for w, r in spec.branches)


# ---------------------------------------------------------------------------------------
# communication


def _count_sent(fn):
    """Bytes this rank hands to isend while fn runs (measured at the P2P call)."""
    sent = 0
    orig = dist.batch_isend_irecv

    def counting(ops):
        nonlocal sent
        sent += sum(op.tensor.numel() * op.tensor.element_size() for op in ops if op.op is dist.isend)
        return orig(ops)

    dist.batch_isend_irecv = counting
    try:
        fn()
    finally:
        dist.batch_isend_irecv = orig
    return sent


def case_bytes(rank, world, h, g):
    """Per single-branch spec: (w, r, bytes sent in forward, bytes sent in backward)."""
    b, d = 2, 4
    n = N_LOCAL * world
    q, k, v, dout = _inputs(7, b, h, g, n, d)
    sh = lambda t: L.shard(t, 2, rank, world, L.Layout.CONTIGUOUS)  # noqa: E731
    rows = []
    for w, r in zip(*LONGNET[world]):
        spec = ringcc.DilatedSpec([w], [r])
        ql, kl, vl = (sh(t).requires_grad_() for t in (q, k, v))
        holder = {}
        fwd = _count_sent(lambda: holder.setdefault("out", ringcc.dilated_attention(ql, kl, vl, spec, is_causal=True)))
        bwd = _count_sent(lambda: holder["out"].backward(sh(dout)))
        rows.append((w, r, fwd, bwd))
    return rows


# MHA at p = 2 and GQA at p = 4 in make test; the other pairs in the soak tier
@pytest.mark.parametrize("world,h,g", [(2, 4, 4), (4, 8, 2), *(pytest.param(w, h, g, marks=pytest.mark.soak)
                                                               for w, h, g in ((3, 4, 4), (4, 4, 4), (2, 8, 2), (3, 8, 2)))])
def test_dilated_bytes_match_formula(pools, world, h, g):
    b, d, itemsize = 2, 4, 4
    n = N_LOCAL * world
    for per_rank in zip(*pools(world).run(case_bytes, h, g)):
        w, r = per_rank[0][:2]
        spec = ringcc.DilatedSpec([w], [r])
        (rows,) = D.dilated_comm_rows(spec, n, world)
        (slots,) = D.dilated_kv_slots(spec, h, g)
        # Slots: the kv heads (MHA), or per kv head one per distinct offset of its query heads.
        assert slots == g * min(h // g, r)
        # Closed form, independent of n and p beyond the segment: (min(w, n) - n/p) / r rows.
        assert rows == max(0, min(w, n) - N_LOCAL) // r
        fwd = 2 * b * slots * rows * d * itemsize  # K and V rows
        hops = 0 if rows == 0 else rows // (N_LOCAL // r) + 1  # dK/dV accumulators go all the way home
        bwd = fwd + 2 * b * slots * hops * (N_LOCAL // r) * d * 4
        for _, _, got_fwd, got_bwd in per_rank:
            assert got_fwd == fwd
            assert got_bwd == bwd
        if min(w, n) <= N_LOCAL:
            assert fwd == 0 and bwd == 0  # segment fits the shard: no communication at all


def test_comm_rows_formula_is_symbolic_and_independent_of_n():
    spec = ringcc.DilatedSpec([64, 256], [2, 8])
    n, p = sympy.symbols("n p", positive=True, integer=True)
    sym = D.dilated_comm_rows(spec, n, p)
    for nv, pv in ((1024, 4), (4096, 16), (512, 32)):
        assert tuple(int(e.subs({n: nv, p: pv})) for e in sym) == D.dilated_comm_rows(spec, nv, pv)
    # Bounded by w / r whatever n and p are.
    for nv, pv in ((1 << 20, 8), (1 << 24, 1024)):
        assert all(rw <= w // r for rw, (w, r) in zip(D.dilated_comm_rows(spec, nv, pv), spec.branches))


# ---------------------------------------------------------------------------------------
# spec, plans, errors


def test_spec_validation_and_repr():
    s = ringcc.DilatedSpec([4, 8], [1, 2], offsets="head_groups")
    assert s.branches == ((4, 1), (8, 2))
    assert "segment_lengths=[4, 8]" in repr(s) and "head_groups" in repr(s)
    assert s == ringcc.DilatedSpec((4, 8), (1, 2), offsets="head_groups") and hash(s)
    with pytest.raises(ValueError, match="one dilation rate per segment length"):
        ringcc.DilatedSpec([4, 8], [1])
    with pytest.raises(ValueError, match="positive ints"):
        ringcc.DilatedSpec([4, 0], [1, 1])
    with pytest.raises(ValueError, match=r"divisible by its dilation rate; got \(w, r\) pairs \[\(6, 4\)\]"):
        ringcc.DilatedSpec([4, 6], [1, 4])
    with pytest.raises(ValueError, match="strictly increasing"):
        ringcc.DilatedSpec([8, 4], [1, 2])
    with pytest.raises(ValueError, match="non-decreasing"):
        ringcc.DilatedSpec([4, 8], [2, 1])
    with pytest.raises(ValueError, match="offsets='every'.*per_head"):
        ringcc.DilatedSpec([4], [1], offsets="every")


def test_head_groups_split():
    spec = ringcc.DilatedSpec([4, 8, 16], [1, 2, 4], offsets="head_groups")
    groups = D.branch_heads(spec, 8)
    assert [len(gp) for gp in groups] == [3, 3, 2]  # remainder to the first branches
    assert groups[1] == ((3, 0), (4, 1), (5, 0))  # offset = index in the group mod r
    assert sorted(h for gp in groups for h, _ in gp) == list(range(8))


def test_plan_modes_and_cache():
    spec = ringcc.DilatedSpec(*LONGNET[4])
    plans = D.dilated_plan(spec, 8, 8, 2, 2, 4, "contiguous")
    assert [bp.ring for bp in plans] == [False, False, True, True, True]
    assert [bp.members for bp in plans][2:] == [(2, 3), (0, 1, 2, 3), (0, 1, 2, 3)]
    assert plans[2].pos == 0 and plans[3].pos == 2
    assert D.dilated_plan(spec, 8, 8, 2, 2, 4, "contiguous") is plans  # cached


@pytest.mark.parametrize(
    "spec,n_local,world,layout,match",
    [
        (([12], [1]), 8, 3, "contiguous", "shard of 8 tokens does not tile it"),
        (([6], [2]), 8, 2, "contiguous", "does not tile the sequence of length 16"),
        (([16], [4]), 2, 8, "contiguous", "shard % rate"),
        (([32], [8]), 4, 1, "contiguous", "pad the sequence"),
        (([4], [1]), 6, 2, "contiguous", "does not divide the per-rank chunk of 6"),
        (([8], [2]), 8, 2, "zigzag", "use layout='contiguous'"),
    ],
)
def test_plan_rejects_misaligned_segments(spec, n_local, world, layout, match):
    with pytest.raises(ValueError, match=match):
        D.dilated_plan(ringcc.DilatedSpec(*spec), n_local, 2, 2, 0, world, layout)


def test_public_api_errors():
    q = torch.randn(1, 2, 8, 4)
    with pytest.raises(ValueError, match="must be a ringcc.DilatedSpec"):
        ringcc.dilated_attention(q, q, q, ([8], [1]))
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        ringcc.dilated_attention(torch.randn(1, 3, 8, 4), q, q, ringcc.DilatedSpec([8], [1]))


# ---------------------------------------------------------------------------------------
# custom ops


def test_opcheck_forward_and_backward():
    q, k, v, dout = _inputs(5, 1, 4, 2, 16, 4)
    args = ([4, 16], [1, 2], "per_head", True, 0.5, "", 1, "contiguous")
    torch.library.opcheck(D.dilated_attention_op, (q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), *args))
    out, lse = D.dilated_attention_op(q, k, v, *args)
    torch.library.opcheck(D.dilated_attention_backward_op, (dout, q.detach(), k.detach(), v.detach(), out.detach(), lse, *args))


def test_compiles_as_one_opaque_op():
    """Dynamo captures the dilated attention as one call of the ringcc op (fullgraph: no
    break), and the compiled function's output and gradients are eager's."""
    spec = ringcc.DilatedSpec([4, 16], [1, 4])
    q, k, v, dout = _inputs(6, 1, 4, 4, 16, 4)

    def f(q, k, v):
        return ringcc.dilated_attention(q, k, v, spec, is_causal=True) * 2

    graphs = []

    def recording(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(f, backend=recording, fullgraph=True)(q, k, v)
    calls = [n.target for g in graphs for n in g.graph.nodes if n.op == "call_function"]
    assert [t for t in calls if "ringcc" in str(t)] == [torch.ops.ringcc.dilated_attention.default], calls

    qc, kc, vc = (t.clone().requires_grad_() for t in (q, k, v))
    qe, ke, ve = (t.clone().requires_grad_() for t in (q, k, v))
    out_c = torch.compile(f, backend="aot_eager", fullgraph=True)(qc, kc, vc)
    out_e = f(qe, ke, ve)
    torch.testing.assert_close(out_c, out_e, **TOL)
    out_c.backward(dout)
    out_e.backward(dout)
    for a, b in ((qc, qe), (kc, ke), (vc, ve)):
        torch.testing.assert_close(a.grad, b.grad, **TOL)


def test_pieces_are_strided_runs_that_reproduce_the_rows():
    """The compressed rows come from strided views (runs of equally spaced heads with one
    offset); a repeated slot starts a new run, so adding runs in place accumulates it twice."""
    from ringcc.runtime.dilated import compress, expand_, pieces

    assert [(p.c0, p.c1, p.start, p.stop, p.step, p.offset) for p in pieces((0, 2, 4, 1, 3, 5), (0, 0, 0, 1, 1, 1))] == [
        (0, 3, 0, 5, 2, 0), (3, 6, 1, 6, 2, 1)]
    assert len(pieces((0, 0, 1), (0, 0, 0))) == 2  # a repeated head is a new run
    assert len(pieces((3, 1), (0, 0))) == 2  # descending heads are not one view
    heads, offsets, r = (1, 3, 0, 0, 2), (1, 1, 0, 0, 0), 2
    x = torch.randn(2, 4, 8, 3)
    rows = torch.stack([x[:, h, o::r] for h, o in zip(heads, offsets)], dim=1)
    ps = pieces(heads, offsets)
    torch.testing.assert_close(compress(x, ps, r), rows, rtol=0, atol=0)
    acc = torch.zeros_like(x)
    expand_(acc, rows, ps, r, add=True)
    want = torch.zeros_like(x)
    for i, (h, o) in enumerate(zip(heads, offsets)):
        want[:, h, o::r] += rows[:, i]
    torch.testing.assert_close(acc, want, rtol=0, atol=0)
    assert compress(x, pieces((0, 1, 2, 3), (0, 0, 0, 0)), 1) is x  # every row of every head: no copy


def test_partial_heads_merge_in_place_at_batch_one():
    """b = 1, head groups with r = 1, the case where a branch's rows are a contiguous slice of
    the accumulators (which the op merges into in place, with no write-back): the result is
    the reference's."""
    spec = ringcc.DilatedSpec([4, 8], [1, 1], offsets="head_groups")
    q, k, v, dout = _inputs(12, 1, 4, 4, 16, 4)
    _matches_reference_single_device(spec, q, k, v, dout)
