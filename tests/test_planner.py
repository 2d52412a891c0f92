"""The memory planner: known graphs give hand-computed formulas, views are not counted twice,
quadratic nodes are named, the dilated workspace depends on w/r, saved activations match
what autograd saves, and `ringcc plan` writes parseable JSON."""

from __future__ import annotations

import json
import os

import pytest
import sympy
import torch
import torch.nn.functional as F
from torch import nn

from ringcc import planner
from ringcc.planner import n, p
from ringcc.runtime import workspace
from ringcc.runtime.workspace import TensorSize

from graphs import dynamo_graph

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "examples", "plan_model.py")


def symbolic_graph(fn, *inputs, dim=1):
    """Dynamo's graph of fn with dim `dim` of the first input dynamic (the sequence); the
    graph is never run (its ringcc ops are built for several ranks)."""
    from ringcc.planner_cli import _placeholder_outputs

    torch._dynamo.mark_dynamic(inputs[0], dim)
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return _placeholder_outputs(gm)

    torch._dynamo.reset()
    torch.compile(fn, backend=capture, fullgraph=True)(*inputs)
    return graphs[0]


def seq_symbol(gm):
    (sym,) = planner._graph_symbols(gm)
    return sym


class _Module(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


# ---------------------------------------------------------------------------------------
# known graphs


def _pointwise_view_sum(x):
    y = x * 2  # new storage [2, s, 8]
    z = y.view(2, -1, 4, 2)  # a view of y: no bytes
    w = z.transpose(1, 2)  # a view of a view
    return w.sum(-1)  # [2, 4, s] new


@pytest.mark.parametrize("capture", ["dynamo", "export"])
def test_known_graph_formula_and_views_not_double_counted(capture):
    x = torch.randn(2, 12, 8)
    if capture == "dynamo":
        gm = symbolic_graph(_pointwise_view_sum, x)
    else:  # aten graph, meta["val"]
        seq = torch.export.Dim("seq")
        gm = torch.export.export(_Module(_pointwise_view_sum), (x,), dynamic_shapes=({1: seq},)).graph_module
    plan = planner.plan_graph(gm, symbols={seq_symbol(gm): n}, training=False)
    by_name = {nd.op: nd for nd in plan.nodes}
    # Hand-computed: x = y = 2*n*8*4 bytes, the sum 2*4*n*4 bytes; both views are aliases of y.
    assert by_name["mul"].nbytes == 64 * n
    assert by_name["view"].nbytes == 0 and by_name["view"].alias_of == by_name["mul"].name
    assert by_name["transpose"].alias_of == by_name["mul"].name
    assert by_name["sum"].nbytes == 32 * n
    # At the sum, the input, y (read through its views) and the result are alive.
    assert sympy.simplify(plan.peak - 160 * n) == 0
    assert plan.verdict is False  # nothing divides by p: not sharded
    assert plan.peak_bytes(seq_len=12) == 160 * 12


def _sharded_layer(x, w):
    xs = torch.ops.ringcc.shard(x, 1, "", 4, "contiguous")  # [2, s/4, 16]
    qkv = (xs @ w).view(2, -1, 3, 2, 8).permute(2, 0, 3, 1, 4)
    out, lse = torch.ops.ringcc.ring_attention(qkv[0], qkv[1], qkv[2], None, True, 0.35, "", 4, "contiguous")
    return out.transpose(1, 2).reshape(2, -1, 16)


def test_sharded_graph_sizes_are_n_over_p_and_ring_workspace_counted():
    x, w = torch.randn(2, 32, 16), torch.randn(16, 48)
    gm = symbolic_graph(lambda x, w: _sharded_layer(x, w).sum(), x, w)
    plan = planner.plan_graph(gm, world_size=4, symbols={seq_symbol(gm): n}, training=False)
    nodes = {nd.op: nd for nd in plan.nodes}
    assert sympy.simplify(nodes["ringcc::shard"].nbytes - 2 * 16 * 4 * n / p) == 0
    ring = nodes["ringcc::ring_attention"]
    # out [2, 2, n/p, 8] fp32 + lse [2, 2, n/p] fp32
    assert sympy.simplify(ring.nbytes - (2 * 2 * 8 * 4 + 2 * 2 * 4) * n / p) == 0
    q = TensorSize((2, 2, n / p, 8), 4)
    expected = workspace.ring_attention({"q": q, "k": q, "v": q, "key_valid": None}, p)
    assert sympy.simplify(ring.workspace.forward - expected.forward) == 0
    # K/V receive buffers: one set at p = 2, two sets (double buffering) from p = 3; at p = 1 the
    # one block is one kernel call whose results are the outputs: nothing besides them (MHA, fp32)
    local = expected.forward.subs(n, 64 * p)  # 64 tokens per rank
    kv_set = 2 * (2 * 2 * 64 * 8 * 4)
    assert [int(local.subs(p, k) - local.subs(p, 2)) for k in (3, 8)] == [kv_set, kv_set]
    tiles = workspace.cpu_kernel_tiles(q)[0]  # the CPU kernel's per-thread tiles, a constant
    assert local.subs(p, 1) == tiles and local.subs(p, 2) >= kv_set + tiles
    assert plan.verdict, plan.reasons
    assert not plan.culprits


def _layer_with_positions(x, w):
    # A replicated position vector (O(n) int64, from arange) beside a sharded layer: the
    # execution model keeps such index data replicated, so it is not a culprit.
    pos = torch.arange(x.shape[1]) % 7
    return _sharded_layer(x, w).sum() + (pos == 3).sum()


def test_replicated_index_data_is_left_out_of_the_verdict():
    x, w = torch.randn(2, 32, 16), torch.randn(16, 48)
    gm = symbolic_graph(_layer_with_positions, x, w)
    plan = planner.plan_graph(gm, world_size=4, symbols={seq_symbol(gm): n}, training=False)
    assert plan.verdict, plan.reasons
    assert any("replicated index data" in r for r in plan.reasons)
    # It is still planned (8 bytes per position), just not a culprit.
    arange = [nd for nd in plan.nodes if "arange" in nd.op]
    assert arange and sympy.simplify(arange[0].nbytes - 8 * n) == 0
    assert not plan.culprits


class _TokenTypes(nn.Module):
    """BERT's default token types: an integer buffer gathered at the position ids, themselves a
    slice of a buffer; in the graph `ringcc rewrite` plans, buffers are attributes."""

    def __init__(self):
        super().__init__()
        self.register_buffer("position_ids", torch.arange(128)[None])
        self.register_buffer("token_type_ids", torch.zeros(1, 128, dtype=torch.long))

    def forward(self, x, w):
        types = torch.gather(self.token_type_ids.expand(1, -1), 1, self.position_ids[:, : x.shape[1]])
        return _sharded_layer(x, w).sum() + (types == 1).sum()


def test_integer_buffers_read_at_positions_are_index_data_in_an_export_graph():
    x, w = torch.randn(2, 96, 16), torch.randn(16, 48)  # n/p = 24: no model dim
    gm = torch.export.export(_TokenTypes(), (x, w)).module()  # as `ringcc rewrite` plans it: buffers are get_attr
    plan = planner.plan_graph(gm, world_size=4, seq_len=96, training=False)
    assert plan.verdict and not plan.culprits, (plan.culprits, plan.reasons)
    assert any("replicated index data" in r and "gather" in r for r in plan.reasons)


def test_gathered_output_is_flagged_and_max_sequence_solves_the_formula():
    x, w = torch.randn(2, 32, 16), torch.randn(16, 48)
    gm = symbolic_graph(lambda x, w: torch.ops.ringcc.gather(_sharded_layer(x, w), 1, "", 4, "contiguous"), x, w)
    plan = planner.plan_graph(gm, world_size=4, symbols={seq_symbol(gm): n}, training=False)
    gather = next(nd for nd in plan.nodes if nd.op == "ringcc::gather")
    assert sympy.simplify(gather.nbytes - 2 * 16 * 4 * n) == 0  # full length, whatever p
    assert plan.verdict is False
    assert [c.name for c in plan.culprits] == [gather.name]
    assert plan.culprits[0].growth == "n (not divided by p)"
    budget = 10 * 2**20
    best = plan.max_sequence(budget, 4)
    assert best % 4 == 0 and best > 0
    assert plan.peak_bytes(best, 4) <= budget < plan.peak_bytes(best + 4, 4)


def test_local_shard_symbol_maps_to_n_over_p():
    """A hand-built shard-local graph: its length symbol is n/p; a gather multiplies by p."""
    def f(xs):
        y = torch.relu(xs)
        return torch.ops.ringcc.gather(y, 1, "", 2, "contiguous")

    gm = symbolic_graph(f, torch.randn(3, 10, 4))
    plan = planner.plan_graph(gm, world_size=2, symbols={seq_symbol(gm): n / p}, training=False)
    sizes = {nd.op: nd.nbytes for nd in plan.nodes}
    assert sympy.simplify(sizes["relu"] - 48 * n / p) == 0
    assert sympy.simplify(sizes["ringcc::gather"] - 48 * n) == 0
    assert plan.hints[n] == 20


# ---------------------------------------------------------------------------------------
# quadratic nodes are named, with source lines


class ManualMaskedAttention(nn.Module):
    def forward(self, q, k, v):
        s = q.shape[-2]
        mask = torch.ones(s, s, dtype=torch.bool).tril()  # n x n
        scores = q @ k.transpose(-1, -2)  # b x h x n x n
        scores = scores.masked_fill(~mask, float("-inf"))
        return torch.softmax(scores, -1) @ v


def _dynamic(*xs, dim=2):
    for x in xs:
        torch._dynamo.mark_dynamic(x, dim)
    return xs


def test_n_by_n_mask_and_scores_flagged_by_name():
    q, k, v = _dynamic(*(torch.randn(1, 2, 16, 4) for _ in range(3)))
    gm = dynamo_graph(ManualMaskedAttention(), q, k, v)
    plan = planner.plan_graph(gm, world_size=1, training=False)
    assert plan.verdict is False
    culprits = {c.name: c for c in plan.culprits}
    assert "mask" in culprits and "scores" in culprits
    assert culprits["mask"].growth == "n**2"
    assert "test_planner.py" in culprits["mask"].location
    assert any("grows like n**2" in r for r in plan.reasons)


def test_unrewritten_attention_flagged_by_name():
    def attend(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    q, k, v = _dynamic(*(torch.randn(1, 2, 16, 4) for _ in range(3)))
    gm = dynamo_graph(attend, q, k, v)
    plan = planner.plan_graph(gm, world_size=1, training=False)
    (culprit,) = [c for c in plan.culprits if c.what == "workspace"]
    assert culprit.growth == "n**2" and "attend" in culprit.location
    assert "scaled_dot_product_attention" in [nd.op for nd in plan.nodes if nd.name == culprit.name]


# ---------------------------------------------------------------------------------------
# dilated workspace: O(w/r) communication, not O(n)


def _dilated_args(segments, rates, s=n / p):
    q = TensorSize((1, 4, s, 16), 2)
    return {"q": q, "k": q, "v": q, "segment_lengths": list(segments), "dilation_rates": list(rates),
            "offsets": "per_head", "layout": "contiguous"}


def test_dilated_workspace_depends_on_w_over_r_not_n():
    local, spanning = workspace.dilated_receive_bytes(_dilated_args((64, 4096), (1, 4)), p)
    # Shards of 128 tokens (p = n/128): the 64-token branch is local, the 4096 one spans ranks.
    shard_128 = {p: n / 128}
    assert local.subs(shard_128).subs(n, 10**6) == 0
    received = sympy.simplify(spanning.subs(shard_128).subs(n, 10**6))
    assert received > 0 and not planner.upper_bound(spanning.subs(shard_128)).has(n)  # w/r, not n
    # bounded by the rows the branch communicates, (w - n/p) / r, whatever n
    rows = (4096 - 128) / sympy.Integer(4)
    assert received <= rows * 2 * 4 * 16 * 2
    # a higher rate sends fewer rows
    _, spanning_r8 = workspace.dilated_receive_bytes(_dilated_args((64, 4096), (1, 8)), p)
    assert spanning_r8.subs(shard_128).subs(n, 10**6) < received
    # fixed p, long sequences: every segment fits the shard (n/p >= w), nothing travels
    assert spanning.subs({p: 4, n: 4 * 4096}) == 0 and spanning.subs({p: 4, n: 4 * 2048}) > 0
    ok, how = planner.growth(workspace.dilated_attention(_dilated_args((64, 4096), (1, 4)), p).forward)
    assert ok and how == "n/p"


# ---------------------------------------------------------------------------------------
# saved for backward: planner vs the tensors autograd actually saves (CPU)


class RingLayer(nn.Module):
    def __init__(self, dim=16, heads=2):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        b, s, dim = x.shape
        qkv = self.qkv(x).view(b, s, 3, self.heads, dim // self.heads).permute(2, 0, 3, 1, 4)
        out, lse = torch.ops.ringcc.ring_attention(qkv[0], qkv[1], qkv[2], None, True, 0.35, "", 1, "contiguous")
        h = torch.tanh(self.proj(out.transpose(1, 2).reshape(b, s, dim)))
        return h.sum()


def _saved_bytes_by_autograd(model, x) -> int:
    params = {t.untyped_storage().data_ptr() for t in model.parameters()}
    storages = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params and st.data_ptr() != x.untyped_storage().data_ptr():
            storages[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x)
    return sum(storages.values())


def test_saved_activations_match_autograd():
    torch.manual_seed(0)
    model = RingLayer()
    x = torch.randn(2, 24, 16)
    torch._dynamo.mark_dynamic(x, 1)
    gm = dynamo_graph(model, x)
    plan = planner.plan_graph(gm, world_size=1)
    assert plan.training
    subs = {n: 24, p: 1}
    saved = sum(nd.bytes_at(subs) for nd in plan.nodes if nd.saved and nd.op != "placeholder")
    actual = _saved_bytes_by_autograd(model, torch.randn(2, 24, 16))
    assert saved == actual
    # backward is planned after forward: the peak point lies in backward
    assert plan.peak_point() >= len(plan.nodes)


class GatedMLP(nn.Module):
    """RMSNorm + SwiGLU: no custom op, so every allocation is visible to a dispatch mode."""

    def __init__(self, dim=32, hidden=80):
        super().__init__()
        self.gate = nn.Linear(dim, hidden, bias=False)
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)
        self.weight = nn.Parameter(torch.ones(dim))

    def block(self, x):
        h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight
        return x + self.down(F.silu(self.gate(h)) * self.up(h))

    def forward(self, x):
        return self.block(x).pow(2).mean()


class PackedProjection(nn.Module):
    """A packed projection split by indexing: select's backward materialises base-sized grads."""

    def __init__(self, dim=32):
        super().__init__()
        self.packed = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x):
        a, b, c = self.packed(x).view(*x.shape[:2], 3, -1).permute(2, 0, 1, 3)
        return self.out(torch.tanh(a) * b + c).pow(2).mean()


@pytest.mark.parametrize("model,tolerance", [(GatedMLP, 0.02), (PackedProjection, 0.10)])
def test_training_peak_matches_live_tensor_bytes_on_cpu(model, tolerance):
    """Forward + backward peak of live tensor bytes (torch's MemTracker) vs the plan."""
    from ringcc import _compat

    torch.manual_seed(0)
    m, x = model(), torch.randn(2, 96, 32)
    m(x).backward()  # gradients exist before the measured step, as the plan assumes
    tracker = _compat.mem_tracker()()
    tracker.track_external(m, x)
    with tracker:
        m(x).backward()
    measured = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    x2 = torch.randn(2, 96, 32)
    plan = planner.plan_graph(symbolic_graph(m, x2), world_size=1, compiled=False)  # measured eagerly
    assert abs(plan.peak_bytes(96, 1) / measured - 1) <= tolerance, (plan.peak_bytes(96, 1), measured)


class CheckpointedStack(nn.Module):
    """GatedMLP layers, each under torch.utils.checkpoint (or not): the regions save their
    inputs only and recompute their bodies in backward."""

    def __init__(self, checkpoint: bool, layers: int = 4):
        super().__init__()
        self.checkpoint = checkpoint
        self.layers = nn.ModuleList(GatedMLP() for _ in range(layers))

    def forward(self, x):
        for layer in self.layers:
            x = torch.utils.checkpoint.checkpoint(layer.block, x, use_reentrant=False) if self.checkpoint else layer.block(x)
        return x.pow(2).mean()


def test_checkpoint_regions_plan_their_recompute_within_live_tensor_bytes_on_cpu():
    """A checkpoint region (tag_activation_checkpoint) is planned as an op that saves its inputs,
    with its body's transient bytes as workspace (Note [Memory plan], 4): the plan stays within
    7% above the measured peak, and below the plan without checkpoints."""
    from ringcc import _compat

    peaks = {}
    for checkpoint in (False, True):
        torch.manual_seed(0)
        m, x = CheckpointedStack(checkpoint), torch.randn(2, 96, 32)
        m(x).backward()
        tracker = _compat.mem_tracker()()
        tracker.track_external(m, x)
        with tracker:
            m(x).backward()
        measured = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
        gm = symbolic_graph(m, torch.randn(2, 96, 32))
        regions = [nd for nd in gm.graph.nodes if planner.op_name(nd) == planner.CHECKPOINT_OP]
        assert len(regions) == (4 if checkpoint else 0)
        planned = planner.plan_graph(gm, world_size=1, compiled=False).peak_bytes(96, 1)  # measured eagerly
        assert 1.0 <= planned / measured <= 1.07, (checkpoint, planned, measured)
        peaks[checkpoint] = planned
    assert peaks[True] < 0.6 * peaks[False], peaks


def _step_peak_bytes(step) -> int:
    """Peak of the bytes a call of step() allocates beyond what exists before it."""
    from ringcc import _compat

    return _compat.cpu_allocation_peak(step)


def _planned_and_measured(m: nn.Module, x: torch.Tensor, inner: str) -> tuple[int, int]:
    """(the plan's peak, the measured peak) of one training step of m(x) compiled by the backend:
    measured after two steps (compiled, and the weights' .grad exist, as the plan assumes), as the
    bytes alive before it (x, weights, their .grad) plus what the step allocates at its peak."""
    import ringcc

    ringcc.reset_reports()
    torch._dynamo.reset()
    compiled = torch.compile(m, backend=ringcc.backend(ringcc.Config(inner=inner)))
    for _ in range(2):
        compiled(x).backward()
    before = sum(t.numel() * t.element_size() for t in [x, *m.parameters(), *(q.grad for q in m.parameters())])
    measured = before + _step_peak_bytes(lambda: compiled(x).backward())
    planned = ringcc.last_report().plan.peak_bytes()
    torch._dynamo.reset()
    return planned, measured


# inductor in the soak tier: the plan is the same graph's as under aot_eager (which make test
# checks within 7%), and inductor only allocates less
@pytest.mark.parametrize("inner", ["aot_eager", pytest.param("inductor", marks=pytest.mark.soak), "eager"])
def test_compiled_training_step_stays_within_its_plan_on_cpu(inner):
    """A stack compiled by the backend: the plan (saved activations freed after their last use
    in backward, weights' new gradients returned at the end) bounds the measured peak, within
    7% with aot_eager (the graph's own ops); inductor fuses elementwise ops, so it allocates less
    (plan 1.32x the peak here). With inner="aot_eager" the backward graph used to keep every
    saved activation to its end (functorch's make_boxed_func holds its inputs): the plan was
    0.92x the peak here, 1.04x with _compat.boxed_graph. inner="eager" runs the graph under eager
    autograd, which adds each weight's gradient into .grad as it is made: planned so
    (compiled=False), 1.00x."""
    torch.manual_seed(0)
    planned, measured = _planned_and_measured(CheckpointedStack(checkpoint=False), torch.randn(2, 96, 32), inner)
    assert 1.0 <= planned / measured <= (1.5 if inner == "inductor" else 1.07), (planned, measured)


class ProjectedAttention(nn.Module):
    """One projection to q, k, v and attention: the ring's own workspace dominates the step."""

    def __init__(self, heads: int, head_dim: int, causal: bool):
        super().__init__()
        self.heads, self.head_dim, self.causal = heads, head_dim, causal
        self.proj = nn.Linear(heads * head_dim, 3 * heads * head_dim, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.proj(x).view(b, s, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, is_causal=self.causal).pow(2).mean()


def case_ring_step_within_plan(rank, world, heads, head_dim, n_local, causal):
    """plan / measured peak of one training step of ProjectedAttention, rewritten to the ring."""
    torch.manual_seed(0)
    m, x = ProjectedAttention(heads, head_dim, causal), torch.randn(1, n_local * world, heads * head_dim)
    planned, measured = _planned_and_measured(m, x, "aot_eager")
    return planned / measured


def test_ring_training_step_stays_within_its_plan_on_gloo(pools):
    """The ring's CPU formulas bound its step on gloo: gloo's contiguous copy of a sent dK/dV
    accumulator lives until the batch is waited for and may outlive it, the CPU kernel copies
    dout into its own layout (workspace._ring_chunk) and holds per-thread tiles
    (workspace.cpu_kernel_tiles). Without those terms the plan was 0.78-0.87x the measured peak.
    Non-causal, 8 heads x 1024 rows: 1.097x in every run. Causal zigzag, 16 heads x 512 rows:
    64 MiB planned against 68, 74 or 80 MiB measured (0.80-0.94x, eight runs), because gloo's
    worker threads drop a finished batch's tensors some time after wait() returns, so how many
    of them are still held at the peak varies (at one intra-op thread part of the rest lies
    outside the ring, in the backward's sums of the CPU kernel's gradients: 0.8 MB over the plan).
    The ring drops its own reference to a sent accumulator once the transport has it (2 MiB of
    the non-causal case's peak). With the weights' gradient sync in the step, the causal case's
    peak is the sync's backward (64 MiB measured, 65.2 planned: 1.02x)."""
    steady = pools(2).run(case_ring_step_within_plan, 8, 32, 1024, False)
    assert all(1.0 <= r <= 1.1 for r in steady), steady
    varying = pools(2).run(case_ring_step_within_plan, 16, 64, 512, True)
    assert all(0.79 <= r <= 1.1 for r in varying), varying


class WideAsLong(nn.Module):
    """Attention between two weights whose width (24) is the traced length, as DeepSeek-V3's
    kv_a_proj makes kv_lora_rank + qk_rope_head_dim rows."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(16, 24), nn.Linear(24, 48)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.down(self.up(x)).view(b, s, 3, 2, 8).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def case_weights_as_wide_as_the_sequence(rank, world):
    """The compiled step against eager (the output, every gradient, the parameters that got one)
    and the plan's verdict and culprits."""
    import ringcc

    torch.manual_seed(0)
    m = WideAsLong()
    x, r = torch.randn(2, 24, 16), torch.randn(2, 2, 24, 8)
    out_ref = m(x)
    (out_ref * r).sum().backward()
    ref = {k: q.grad.clone() for k, q in m.named_parameters() if q.grad is not None}
    m.zero_grad(set_to_none=True)
    ringcc.reset_reports()
    torch._dynamo.reset()
    out = torch.compile(m, backend=ringcc.backend(ringcc.Config(inner="aot_eager")))(x)
    (out * r).sum().backward()
    got = {k: q.grad for k, q in m.named_parameters() if q.grad is not None}
    plan = ringcc.last_report().plan
    torch._dynamo.reset()
    return (float((out - out_ref).abs().max()), sorted(got) == sorted(ref),
            max(float((got[k] - ref[k]).abs().max()) for k in ref), plan.verdict, [c.op for c in plan.culprits])


def test_a_weight_as_wide_as_the_sequence_is_a_model_dim(pools):
    """A parameter's dims are never the sequence, whatever their value: its gradient's sync
    (sync_grads_view's bucket) is O(1), and the step is O(n/p) and exact at p = 2."""
    for err, same_params, grad_err, verdict, culprits in pools(2).run(case_weights_as_wide_as_the_sequence):
        assert err < 1e-5 and same_params and grad_err < 1e-5, (err, same_params, grad_err)
        assert verdict and culprits == [], culprits


# ---------------------------------------------------------------------------------------
# the CLI


def _plan_example(tmp_path, factory: str, world: int = 2, *extra) -> dict:
    from ringcc.cli import main

    out = tmp_path / f"{factory}.json"
    rc = main(["plan", f"{EXAMPLES}:{factory}", "--seq-len", "512", "--world-size", str(world),
               "--budget", "1GiB", "--json", str(out), *extra])
    assert rc == 0
    return json.loads(out.read_text())


@pytest.mark.parametrize("target,message", [
    ("examples.plan_model:exact_ring", "or as a file path: examples/plan_model.py:exact_ring"),
    ("examples/plan_model.py:no_such", "has no callable 'no_such'"),
    ("examples/missing.py:exact_ring", "no file 'examples/missing.py'"),
    ("exact_ring", "must be MODULE:FACTORY or path/to/file.py:FACTORY"),
])
def test_cli_bad_target_exits_2_with_the_reason(monkeypatch, capsys, target, message):
    from pathlib import Path

    import sys

    from ringcc.cli import main

    root = Path(__file__).resolve().parents[1]
    monkeypatch.chdir(root)
    # As from the console script: the working directory is not on sys.path.
    monkeypatch.setattr(sys, "path", [x for x in sys.path if x not in ("", ".", str(root))])
    for name in [m for m in sys.modules if m == "examples" or m.startswith("examples.")]:
        monkeypatch.delitem(sys.modules, name)
    assert main(["plan", target, "--seq-len", "512", "--world-size", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ringcc plan: error:") and message in err


def test_cli_exact_ring_example_is_linear_and_json_round_trips(tmp_path, capsys):
    data = _plan_example(tmp_path, "exact_ring", 2, "--plot", str(tmp_path / "peak.png"))
    assert (tmp_path / "peak.png").read_bytes()[:4] == b"\x89PNG"
    for key in ("verdict", "peak_formula", "culprits", "peak_bytes", "max_seq_len"):
        assert key in data
    assert data["verdict"] is True and data["culprits"] == []
    peak = sympy.sympify(data["peak_formula"], locals={"n": n, "p": p})
    assert int(sympy.ceiling(peak.xreplace({n: sympy.Integer(512), p: sympy.Integer(2)}))) == data["peak_bytes"]
    assert data["max_seq_len"] > 512 and data["max_seq_len"] % 4 == 0  # zigzag: a multiple of 2p
    out = capsys.readouterr().out
    assert out.splitlines()[1] == "verdict: peak memory per rank is O(n/p): it falls as ranks are added"
    assert out.splitlines()[2].startswith("peak per rank: ") and "longest sequence within" in out.splitlines()[3]
    assert f"wrote {tmp_path / 'peak.png'}" in out and "the 10 largest of" in out


@pytest.mark.soak
def test_cli_device_cuda_plans_the_gpu_kernels_from_a_cpu_trace(tmp_path, monkeypatch):
    # Traced on CPU, planned as CUDA: CUDA's workspaces (the example is fp32, which the CUDA
    # flash/cuDNN kernels do not take: its blocks run the math path, whose bounded per-call
    # scores the plan counts, `workspace.masked_calls`). On the copy-engine transport (CUDA's
    # default) the received blocks move into the receive area, which the plan counts once as
    # resident.
    cpu = _plan_example(tmp_path, "exact_ring", 2)
    monkeypatch.setenv("RINGCC_RING_TRANSPORT", "nccl")
    nccl = _plan_example(tmp_path, "exact_ring", 2, "--device", "cuda")
    monkeypatch.delenv("RINGCC_RING_TRANSPORT")
    cuda = _plan_example(tmp_path, "exact_ring", 2, "--device", "cuda")
    assert nccl["verdict"] is True and cpu["verdict"] is True
    ws_cpu, ws_nccl, ws_cuda = ([row["workspace"] for row in g["graphs"][0]["nodes"] if row["op"] == "ringcc::ring_attention"]
                                for g in (cpu, nccl, cuda))
    assert ws_cpu and len(ws_cpu) == len(ws_nccl) and all(a != b for a, b in zip(ws_cpu, ws_nccl))
    (g_cpu,), (g_nccl,), (g_cuda,) = cpu["graphs"], nccl["graphs"], cuda["graphs"]
    assert g_cpu["area_bytes"] == g_nccl["area_bytes"] == 0 < g_cuda["area_bytes"]
    assert cuda["verdict"] is True and all(a != b for a, b in zip(ws_nccl, ws_cuda))


def test_cli_full_length_logits_example_names_the_gather(tmp_path, capsys):
    data = _plan_example(tmp_path, "full_logits")
    assert data["verdict"] is False
    (culprit,) = data["culprits"]
    assert culprit["name"] == "gather_default"  # every rank holds the gathered [b, n, vocab] logits
    assert culprit["growth"] == "n (not divided by p)" and "plan_model.py:" in culprit["location"]
    assert capsys.readouterr().out.splitlines()[1].startswith("verdict: peak memory per rank is NOT O(n/p)")
    assert sympy.sympify(culprit["size"], locals={"n": n}) == 2 * 8000 * 4 * n  # [b, n, vocab] fp32


def test_cli_dilated_example_is_linear(tmp_path):
    data = _plan_example(tmp_path, "dilated")
    assert data["verdict"] is True, data["culprits"]
    (graph,) = data["graphs"]
    ops = {row["op"] for row in graph["nodes"]}
    assert "ringcc::dilated_attention" in ops and "ringcc::gather" not in ops


def test_budget_parse_errors():
    import argparse

    from ringcc.planner_cli import parse_bytes

    assert parse_bytes("80GiB") == 80 * 2**30 and parse_bytes("1.5GB") == 1_500_000_000
    with pytest.raises(argparse.ArgumentTypeError, match="is not a size"):  # argparse shows the message
        parse_bytes("eighty gigs")
    with pytest.raises(argparse.ArgumentTypeError, match="must be more than 0 bytes"):
        parse_bytes("0")


def test_require_linear_memory_error_names_culprit():
    from ringcc.config import Config
    from ringcc.passes.base import PassContext
    from ringcc.report import GraphReport

    q, k, v = _dynamic(*(torch.randn(1, 2, 16, 4) for _ in range(3)))
    gm = dynamo_graph(ManualMaskedAttention(), q, k, v)
    ctx = PassContext(config=Config(require_linear_memory=True), report=GraphReport(graph="g"), world_size=1,
                      group_name="")
    with pytest.raises(ValueError, match=r"require_linear_memory=True.*mask at test_planner.py"):
        planner.plan_for_context(gm, ctx)
    assert ctx.report.plan is not None and ctx.report.plan.verdict is False


# ---------------------------------------------------------------------------------------
# the backend stores a plan per graph


class AttentionAndDistances(nn.Module):
    def forward(self, x):
        b, s, dim = x.shape
        q = x.view(b, s, 2, dim // 2).transpose(1, 2)
        a = F.scaled_dot_product_attention(q, q, q, is_causal=True)
        return a.sum() + torch.cdist(x, x).sum()  # cdist: [b, n, n]


def test_backend_stores_plan_and_require_linear_memory_raises():
    import ringcc

    x = torch.randn(1, 24, 8)
    torch._dynamo.reset()
    ringcc.reset_reports()
    torch.compile(AttentionAndDistances(), backend="ringcc", options={"inner": "eager"})(x)
    plan = ringcc.last_report().plan
    assert isinstance(plan, planner.MemoryPlan) and plan.verdict is False
    assert any(c.growth == "n**2" and "test_planner.py" in c.location for c in plan.culprits)
    assert "memory:" in ringcc.last_report().format()
    torch._dynamo.reset()
    with pytest.raises(Exception, match=r"require_linear_memory=True.*not O\(n/p\).*test_planner.py"):
        torch.compile(AttentionAndDistances(), backend="ringcc",
                      options={"inner": "eager", "require_linear_memory": True})(x)
    torch._dynamo.reset()


def test_ring_workspace_counts_eager_merge_temporaries_on_cpu_only(monkeypatch):
    # bf16 q/k/v: the eager (CPU) merge casts the block to fp32 and forms the weighted
    # product (2 fp32 tensors); the fused CUDA merge materialises neither. The CPU kernel's
    # per-thread tiles add a constant (cpu_kernel_tiles).
    monkeypatch.setenv("RINGCC_RING_WORKSPACE_MIB", "0")  # whole heads: one formula, no Piecewise
    monkeypatch.setenv("RINGCC_RING_TRANSPORT", "nccl")  # received blocks counted alike on both

    def ws(device_type):
        q = TensorSize((1, 4, n / p, 64), 2, device_type)
        return workspace.ring_attention({"q": q, "k": q, "v": q, "key_valid": None}, p).forward

    q32 = 1 * 4 * (n / p) * 64 * 4
    tiles = workspace.cpu_kernel_tiles(TensorSize((1, 4, n / p, 64), 2, "cpu"))[0]
    assert tiles > 0 and workspace.cpu_kernel_tiles(TensorSize((1, 4, n / p, 64), 2, "cuda")) == (0, 0)
    for p_val in (2, 3, 8):  # the ring merges from p = 2 on (at p = 1 its one call's results are the outputs)
        assert sympy.simplify((ws("cpu") - ws("cuda") - 2 * q32 - tiles).subs(p, p_val)) == 0


def test_ring_workspace_follows_the_head_chunk_rule(monkeypatch):
    # Over the budget the ring runs per chunk of K/V heads: the formula is a Piecewise over
    # the chunk choices, evaluates to the chunk the runtime picks, stays O(n/p), and at
    # large n is bounded by one K/V head's workspace.
    monkeypatch.setenv("RINGCC_RING_WORKSPACE_MIB", "64")
    qs = TensorSize((1, 16, n / p, 128), 2, "cuda")
    ks = TensorSize((1, 8, n / p, 128), 2, "cuda")
    w = workspace.ring_attention({"q": qs, "k": ks, "v": ks, "key_valid": None}, p)
    assert w.backward.has(sympy.Piecewise)
    assert planner.growth(w.backward)[0] and planner.growth(w.forward)[0]
    opts = workspace._chunk_options(qs, ks, None, p, rule=True)  # what the rule decides on
    mem = workspace._chunk_options(qs, ks, None, p, area=True)  # what is allocated (copy-engine ring on CUDA)
    for n_val, p_val in ((2**12, 2), (2**16, 4), (2**21, 4)):
        at = {n: n_val, p: p_val}
        q_t = torch.empty(1, 16, n_val // p_val, 128, dtype=torch.bfloat16, device="meta")
        k_t = torch.empty(1, 8, n_val // p_val, 128, dtype=torch.bfloat16, device="meta")
        hk = workspace.ring_kv_chunk(q_t, k_t, None, p_val)
        hk_f = workspace.ring_kv_chunk(q_t, k_t, None, p_val, forward=True)
        chosen, chosen_f = (next(o for o in mem if o[0] == c) for c in (hk, hk_f))
        assert planner._evaluate(w.backward, at) == planner._evaluate(chosen[2], at)  # dout's copy included
        assert planner._evaluate(w.forward, at) == planner._evaluate(chosen_f[1], at)
        assert (hk_f or 8) >= (hk or 8)
        whole = planner._evaluate(opts[0][2], at)
        assert (hk == 0) == (whole <= 64 * 2**20)
    assert workspace.ring_kv_chunk(q_t, k_t, None, 4) == 1  # 2M tokens: one K/V head per chunk


@pytest.mark.parametrize("budget", ["auto", "64", "0"])
def test_receive_area_is_the_one_the_copy_engine_ring_allocates(monkeypatch, budget):
    """The copy-engine ring's area (runtime/comm.py: a header and two slots, each the aligned
    tensors of the largest batch) is what the formula gives, at the chunks the runtime picks:
    a forward-only run sizes it by the forward's batch (K, V), a training step by the backward's
    (K, V and fp32 dK, dV of its own, smaller chunk). The received blocks leave the workspace."""
    from ringcc.runtime import comm

    monkeypatch.setenv("RINGCC_RING_WORKSPACE_MIB", budget)
    qs, ks = TensorSize((1, 16, n / p, 128), 2, "cuda"), TensorSize((1, 8, n / p, 128), 2, "cuda")
    a = {"q": qs, "k": ks, "v": ks, "key_valid": None, "layout": "zigzag", "is_causal": True}
    w = workspace.ring_attention(a, p)
    monkeypatch.setenv("RINGCC_RING_TRANSPORT", "nccl")
    w_nccl = workspace.ring_attention(a, p)
    assert w_nccl.area_forward == w_nccl.area_training == 0
    settings = workspace.chunk_rule_settings()
    for n_val, p_val in ((2**14, 2), (2**16, 4), (2**18, 4), (2**21, 4)):
        s_loc = n_val // p_val
        # the runtime's rule for CUDA tensors of these shapes (ring_kv_chunk's cached core)
        hk_f, hk_b = (0, 0) if budget == "0" else workspace._ring_kv_chunks(
            (1, 16, s_loc, 128), (1, 8, s_loc, 128), 2, 2, None, "cuda", p_val, workspace.ring_workspace_budget(), True,
            settings)
        hk_f, hk_b = hk_f or 8, hk_b or 8

        def area(sizes):  # runtime/comm.py's _Mailbox for batches of these tensor sizes
            return comm._Mailbox.HEADER + 2 * sum(comm._align(x) for x in sizes)

        kv_f, kv_b, acc_b = s_loc * 128 * 2 * hk_f, s_loc * 128 * 2 * hk_b, s_loc * 128 * 4 * hk_b
        at = {n: n_val, p: p_val}
        fwd, train = planner._evaluate(w.area_forward, at), planner._evaluate(w.area_training, at)
        assert area([kv_f] * 2) <= fwd <= area([kv_f] * 2) + 2 * 2 * 256
        assert area([kv_b] * 2 + [acc_b] * 2) <= train <= area([kv_b] * 2 + [acc_b] * 2) + 2 * 4 * 256
        # the area replaces the received blocks: the workspace is smaller by at least one K/V block
        assert planner._evaluate(w.backward, at) <= planner._evaluate(w_nccl.backward, at) - kv_b
    assert planner.growth(w.area_training)[0]  # O(n/p)


def test_receive_area_of_fp64_counts_fp64_accumulators(monkeypatch):
    """fp64 inputs accumulate dK/dV in fp64 (kernels.acc_dtype), and the backward's batch carries
    them: the area has room for 8-byte accumulators (a review found it sized for 4)."""
    from ringcc.runtime import comm

    monkeypatch.setenv("RINGCC_RING_WORKSPACE_MIB", "0")  # whole heads
    qs = TensorSize((1, 16, n / p, 64), 8, "cuda")
    w = workspace.ring_attention({"q": qs, "k": qs, "v": qs, "key_valid": None}, p)
    kv = 16 * (2**16 // 4) * 64 * 8  # one of K, V, dK, dV at n = 2^16, p = 4
    want = comm._Mailbox.HEADER + 2 * 4 * comm._align(kv)
    assert want <= planner._evaluate(w.area_training, {n: 2**16, p: 4}) <= want + 2 * 4 * 256


def test_long_peak_formulas_read_as_a_line(monkeypatch):
    """A chunked ring's peak is a Piecewise hundreds of characters long: the summary shows its
    straight line for long sequences at the plan's p (checked against the exact formula), in
    words a user reads (no formula length, no internal names)."""
    from pathlib import Path

    from ringcc.planner_cli import trace_plans

    root = Path(__file__).resolve().parents[1]
    monkeypatch.syspath_prepend(str(root / "benchmarks"))
    import bench_planner_gpu

    m, inputs = bench_planner_gpu.make("attention", 96 * 4, torch.device("cpu"), torch.bfloat16, False)
    plans, _ = trace_plans(m, inputs, world_size=4, trace_len=96 * 4, training=True, dynamic=False, device_type="cuda")
    plan = max(plans, key=lambda pl: len(str(pl.peak)))
    assert len(str(plan.peak)) > 160 and plan.verdict
    text = plan.readable_peak()
    assert text.startswith("~ ") and text.endswith("for long sequences at p = 4")
    slope = float(text[2:].split("*n")[0])
    exact = (plan.peak_bytes(2**31, 4) - plan.peak_bytes(2**30, 4)) / 2**30
    assert slope == pytest.approx(exact, rel=1e-5)
    assert text in plan.summary() and str(plan.peak) not in plan.summary()


def _masked_ws(s, device, itemsize=2, mask=True, causal=True, window=0, g=16):
    q = workspace.TensorSize((1, 16, s, 128), itemsize, device)
    k = workspace.TensorSize((1, g, s, 128), itemsize, device)
    kv = workspace.TensorSize((1, s), 1, device) if mask else None
    return workspace.masked_calls({"q": q, "k": k, "key_valid": kv, "is_causal": causal, "window": window})


def test_masked_flex_calls_are_counted_and_linear(monkeypatch):
    """workspace.masked_calls on flex_attention (the default for masked bf16/fp16 blocks on
    CUDA, Note [Flex blocks]): the BlockMask of CALL_ROWS rows by the block's keys, and in
    backward two fp32 row values; past CALL_ROWS rows a chunk's contiguous q, O and dO rows,
    its outputs (dQ rows, dK, dV) and the fp32 dK/dV sums. Linear in the shard."""
    from ringcc.runtime import flex

    monkeypatch.setenv("RINGCC_MASKED_KERNEL", "flex")
    s = sympy.Symbol("s", positive=True, integer=True)
    assert _masked_ws(s, "cuda", mask=False) == (0, 0)
    short = {s: 4096}  # one call
    fwd, bwd = _masked_ws(s, "cuda", g=4)
    tiles = workspace.FLEX_TILE_BYTES * 33 * 33
    rows = 2 * 16 * 4096 * 128  # 4096 rows of bf16 q
    assert fwd.subs(short) == tiles
    assert bwd.subs(short) == tiles + 2 * 4 * 16 * 4096
    long = {s: 8 * flex.CALL_ROWS}  # eight calls
    r = flex.CALL_ROWS
    tiles = workspace.FLEX_TILE_BYTES * (r // 128 + 1) * (8 * r // 128 + 1)
    rows = 2 * 16 * r * 128
    assert fwd.subs(long) == tiles + rows + 4 * 16 * r
    assert bwd.subs(long) == tiles + 4 * rows + 2 * 4 * 16 * r + 2 * (2 + 4) * 4 * 8 * r * 128
    twice = {s: 16 * flex.CALL_ROWS}
    assert bwd.subs(twice) < 2 * bwd.subs(long)  # linear in s past CALL_ROWS (tiles grow with the keys)
    # a mask or score function's blocks run flex too (Note [Flex blocks]): counted as flex calls
    q, k = (workspace.TensorSize((1, 16, s, 128), 2, "cuda") for _ in range(2))
    for fn in ({"mask_fn": "maskfn v1 tensors=1"}, {"score_fn": "score v1 tensors=0"}):
        assert workspace.masked_calls({"q": q, "k": k, "is_causal": True, **fn}) == workspace._flex_calls({"q": q, "k": k})


def test_masked_ring_calls_are_counted_and_bounded(monkeypatch):
    """workspace.masked_calls: nothing for unmasked fp16/bf16 blocks (the fused kernels);
    masked blocks hold at most MASKED_CALL_BYTES of scores per call (Note [Masked rows]), so
    the term is O(n/p): the CUDA math path's K/V (and dK/dV) in fp32 plus bounded per-call
    scores (1 in forward, 2 in backward; a window's calls see only rows + 2 * window keys),
    masks and rows; the CPU kernel's additive mask where it has rows."""
    from ringcc.runtime.kernels import MASKED_CALL_BYTES

    monkeypatch.setenv("RINGCC_MASKED_KERNEL", "math")
    s = sympy.Symbol("s", positive=True, integer=True)

    def ws(device, itemsize=2, mask=True, causal=True, window=0):
        return _masked_ws(s, device, itemsize, mask, causal, window)

    assert ws("cuda", mask=False) == (0, 0) and ws("cpu", mask=True, causal=False) == (0, 0)
    big = {s: 2**20}
    fwd, bwd = ws("cuda")
    kv32 = 16 * 2**20 * 128 * 4  # K or V expanded, fp32
    rows = MASKED_CALL_BYTES // (4 * 16 * 2**20)  # rows of one call: full-width fp32 scores
    plane, row = rows * 2**20, 4 * 16 * rows * 128  # [rows, keys] elements; one fp32 [b, h, rows, d]
    assert fwd.subs(big) == 2 * kv32 + MASKED_CALL_BYTES + 2 * plane + 2 * row
    assert bwd.subs(big) == 4 * kv32 + 2 * MASKED_CALL_BYTES + 2 * plane + 4 * row
    # a window: each call sees rows + 2 * window keys, so its scores stay small
    wf, wb = ws("cuda", mask=False, window=5)
    wplane = rows * (rows + 10)
    assert wf.subs(big) == 2 * kv32 + 4 * 16 * wplane + 2 * wplane + 2 * row
    assert wb.subs(big) == 4 * kv32 + 2 * 4 * 16 * wplane + 2 * wplane + 4 * row
    # zigzag: a call over s/2 keys takes twice the rows (their rows, and a window's keys, grow)
    zf, _ = workspace.masked_calls({"q": workspace.TensorSize((1, 16, s, 128), 2, "cuda"),
                                    "k": workspace.TensorSize((1, 16, s, 128), 2, "cuda"), "key_valid": None,
                                    "is_causal": True, "window": 5, "layout": "zigzag"})
    zplane = 2 * rows * (2 * rows + 10)
    assert zf.subs(big) == 2 * kv32 + 4 * 16 * zplane + 2 * zplane + 2 * 2 * row
    # short blocks: the whole [s, s] scores in one call (fp32: the fused kernels take fp16/bf16 only)
    small = 4 * 16 * 64 * 64
    assert ws("cuda", mask=False, itemsize=4)[0].subs({s: 64}) == (2 * 16 * 64 * 128 * 4 + small + 2 * 64 * 64
                                                                    + 2 * 16 * 64 * 128 * 4)
    cpu_fwd, _ = ws("cpu", mask=False, window=5)
    assert cpu_fwd.subs(big) == sympy.Rational(MASKED_CALL_BYTES, 16) * sympy.Rational(5, 4)


def test_key_runs_table_takes_no_device_bytes():
    """The ringcc::key_runs table (a host tensor, one per key mask: Note [Key runs per mask]) is
    planned at 0 bytes and replicated, and the masked graph stays O(n/p)."""
    import torch.nn.functional as F

    from ringcc.rewrite import rewrite

    class Masked(torch.nn.Module):
        def forward(self, q, k, v, pad):
            n = q.shape[2]
            causal = torch.arange(n)[None, :] <= torch.arange(n)[:, None]
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=causal & ~pad[:, None, None, :])
            return F.scaled_dot_product_attention(a, k, v, attn_mask=causal & ~pad[:, None, None, :]).sum()

    q, k, v = (torch.randn(1, 2, 16, 8) for _ in range(3))
    pad = torch.zeros(1, 16, dtype=torch.bool)
    pad[:, -3:] = True
    _, report = rewrite(Masked(), (q, k, v, pad), world_size=2)
    rows = [r for r in report.plan.node_rows() if r["op"] == "ringcc::key_runs"]
    assert len(rows) == 1 and rows[0]["bytes"] == 0 and rows[0]["sharding"] == "replicated", rows
    assert report.plan.verdict


def test_cli_node_names_read_as_module_paths():
    from ringcc.planner import readable_name

    assert readable_name("l_self_modules_blocks_modules_0_modules_qkv_parameters_weight_") == "self.blocks.0.qkv.weight"
    assert readable_name("L_x_") == "x" and readable_name("linear_3") == "linear_3"


class _PaddingAtKeyPositions(nn.Module):
    """HF's mask with a cache: the [b, n] padding mask looked up at key positions built from
    the ids' length (arange(ids.shape[1])), not from the mask's own."""

    def __init__(self):
        super().__init__()
        self.embed, self.proj = nn.Embedding(16, 16), nn.Linear(16, 48)

    def forward(self, ids, mask):
        b, length = ids.shape
        q, k, v = self.proj(self.embed(ids)).view(b, length, 3, 2, 8).permute(2, 0, 3, 1, 4)
        kv = torch.arange(length)
        causal = kv[None, None, None, :] <= kv[None, None, :, None]
        keep = mask.bool()[torch.arange(b)[:, None, None, None], kv[None, None, None, :]]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=causal & keep)


def test_sequence_inputs_are_traced_with_one_length():
    """Each marked dynamic alone, the ids and the mask would have lengths of their own, and the
    mask read at the ids' positions covers only part of it: not liftable (dense attention).
    Traced with one length, the mask is lifted and the plan is O(n/p)."""
    from ringcc.planner_cli import trace_plans

    ids = torch.randint(0, 16, (2, 24))
    mask = torch.ones(2, 24, dtype=torch.long)
    mask[1, -5:] = 0
    plans, reports = trace_plans(_PaddingAtKeyPositions(), (ids, mask), world_size=2, trace_len=24, training=False)
    assert [len(r.rewritten) for r in reports] == [1] and all(p.verdict for p in plans), reports[0].format()
    assert reports[0].rewritten[0].mask["key_padding"] is not None


class _FinitePaddingMask(_PaddingAtKeyPositions):
    """The same attention under an additive mask with a finite masked value, as eager attention
    builds it: rows whose keys are all padding get eager's mean of the values
    (ringcc::fill_empty_rows)."""

    def forward(self, ids, mask):
        b, length = ids.shape
        q, k, v = self.proj(self.embed(ids)).view(b, length, 3, 2, 8).permute(2, 0, 3, 1, 4)
        kv = torch.arange(length)
        allowed = (kv[None, None, None, :] <= kv[None, None, :, None]) & mask.bool()[:, None, None, :]
        low = torch.finfo(q.dtype).min
        return F.scaled_dot_product_attention(q, k, v, attn_mask=torch.where(allowed, 0.0, low))


def test_rows_with_no_key_have_their_workspace_planned():
    """ringcc::fill_empty_rows (Note [Rows with no key]) holds O(n/p) temporaries: the plan counts
    them (workspace.fill_empty_rows), linear in the shard, and stays O(n/p)."""
    from ringcc.planner_cli import trace_plans

    ids = torch.randint(0, 16, (2, 24))
    mask = torch.ones(2, 24, dtype=torch.long)
    mask[1, :5] = 0  # left padding: rows 0-4 of batch row 1 see no key
    plans, reports = trace_plans(_FinitePaddingMask(), (ids, mask), world_size=2, trace_len=24, training=True)
    fills = [nd for pl in plans for nd in pl.nodes if nd.op == "ringcc::fill_empty_rows"]
    assert len(fills) == 1 and all(pl.verdict for pl in plans), reports[0].format()
    ws = fills[0].workspace
    assert ws.forward != 0 and ws.backward != 0
    for term in (ws.forward, ws.backward):  # a constant times the shard n/p
        assert sympy.simplify(term * p / n).free_symbols == set(), term
