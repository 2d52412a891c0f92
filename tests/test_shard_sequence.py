"""The sharding passes on tiny graphs, single process (tier 1): the graph is rewritten for
p = 2 or 4 offline (Config(world_size=...)) and inspected; numbers are checked in the
distributed tests."""

import operator

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ringcc
import shard_models
from ringcc.passes.shard_sequence import STATE_META

SHARD = torch.ops.ringcc.shard.default
GATHER = torch.ops.ringcc.gather.default
ALL_REDUCE = torch.ops.ringcc.all_reduce_sum.default
SELECT = torch.ops.ringcc.seq_select.default
SEQ_CUMSUM = torch.ops.ringcc.seq_cumsum.default
from ringcc.runtime.seqops import sync_grads_view as SYNC  # dynamo graphs (Note [Parameter copies])


def rewrite(model, *inputs, world=2, dynamic=False, **options):
    """The rewritten graph and its report (running it needs a process group: not done here)."""
    graphs = []
    inner = ringcc.backend(ringcc.Config(world_size=world, inner="eager", verify=True, **options))

    def backend(gm, example_inputs):
        out = inner(gm, example_inputs)
        graphs.append(gm)
        return out

    ringcc.reset_reports()
    torch._dynamo.reset()
    with pytest.raises(ValueError, match="no process group is initialised"):
        torch.compile(model, backend=backend, dynamic=dynamic)(*inputs)
    return graphs[0], ringcc.reports()[0]


def count(gm, target) -> int:
    return sum(1 for n in gm.graph.nodes if n.target is target)


class Pooled(nn.Module):
    """Non-causal attention, then a mean over tokens, the first token, a cumsum, or a cumprod
    (an op without a sharding rule)."""

    def __init__(self, what):
        super().__init__()
        self.what = what
        self.proj = nn.Linear(16, 48)

    def forward(self, x):
        q, k, v = self.proj(x).view(2, x.shape[1], 3, 2, 8).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2)
        if self.what == "mean":
            return y.mean()
        if self.what == "first":
            return y[:, 0].sum()
        if self.what == "cumsum":
            return y.cumsum(1).sum()
        return y.cumprod(1).sum()


def test_gpt_graph_shards_inputs_and_keeps_the_label_shift():
    gm, rep = rewrite(shard_models.build("gpt"), *shard_models.batch("gpt", 24), world=4)
    assert len(rep.rewritten) == 2
    # ids, positions (arange) and the shifted labels are sliced; nothing else is
    sharded = sorted(n.args[0].name for n in gm.graph.nodes if n.target is SHARD)
    assert len(sharded) == 3, sharded
    # the labels shifted left are padded with ignore_index at the end before slicing
    fills = [n for n in gm.graph.nodes if n.target is torch.full_like]
    assert [n.args[1] for n in fills] == [-100]
    # one all-reduce of (loss sum, target count); the logits leave the graph as shards
    # (Note [Sharded outputs]), gathered inside it only under Config(gather_outputs=True)
    assert count(gm, ALL_REDUCE) == 1
    assert count(gm, GATHER) == 0 and rep.gathers == []
    out = next(n for n in gm.graph.nodes if n.op == "output")
    assert out.args[0][1].meta[STATE_META].sharded
    # every parameter's gradient is synced, in one bucket at this size
    assert count(gm, SYNC) == 1
    # p travels as an op argument, never read in a fake
    assert {n.args[3] for n in gm.graph.nodes if n.target is SHARD} == {4}


def test_gather_outputs_true_gathers_the_logits_in_the_graph():
    gm, rep = rewrite(shard_models.build("gpt"), *shard_models.batch("gpt", 24), gather_outputs=True)
    assert count(gm, GATHER) == 1 and [g.why for g in rep.gathers] == ["graph output (Config(gather_outputs=True))"]


def test_cat_onto_an_empty_past_keeps_the_shard():
    """HF's DynamicCache.update (use_cache=True, also in training) concatenates each layer's keys
    and values onto an empty past: the identity on the shard, not an all-gather."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64, attn_implementation="sdpa")
    model = LlamaForCausalLM(cfg).train()
    ids = torch.randint(0, 64, (2, 24))  # no model dim is 24 (a static plan reads such dims as n)
    gm, rep = rewrite(lambda ids: model(input_ids=ids, labels=ids), ids)
    assert rep.gathers == [] and rep.plan.verdict, (rep.gathers, rep.plan.culprits)
    cats = [n for n in gm.graph.nodes if n.target is torch.cat and "cache_utils" in str(n.meta.get("stack_trace"))]
    assert len(cats) == 2 and all(n.meta[STATE_META].sharded for n in cats)


def test_length_not_divisible_is_a_clear_error():
    with pytest.raises(Exception, match=r"sequence length 26 is not divisible by 8 \(world size 4, layout "
                       r"'zigzag'\); .* or Config\(pad=True\)"):
        rewrite(shard_models.build("gpt"), *shard_models.batch("gpt", 26), world=4)


def test_padding_masks_the_padded_keys_of_non_causal_attention():
    gm, rep = rewrite(Pooled("mean"), torch.randn(2, 7, 16), world=2, pad=True)
    assert "sequence of 7 tokens padded to 8 (a multiple of 2)" in rep.notes
    (site,) = [n for n in gm.graph.nodes if n.target is torch.ops.ringcc.ring_attention.default]
    key_valid = site.args[3]
    assert key_valid.target is SHARD and tuple(key_valid.meta["example_value"].shape) == (2, 4)
    # the mean zeroes the padded row and divides by the 7 real tokens (x 2 x 16 features)
    assert count(gm, ALL_REDUCE) == 1
    assert any(n.target is operator.truediv and n.args[1] == 7 * 2 * 16 for n in gm.graph.nodes)


def test_mean_over_tokens_is_a_local_mean_and_an_all_reduce():
    gm, rep = rewrite(Pooled("mean"), torch.randn(2, 8, 16))
    assert count(gm, ALL_REDUCE) == 1 and count(gm, GATHER) == 0 and rep.gathers == []


def test_selecting_a_token_reads_it_from_its_owner():
    gm, rep = rewrite(Pooled("first"), torch.randn(2, 8, 16))
    assert count(gm, SELECT) == 1 and count(gm, GATHER) == 0


def test_unknown_sequence_op_is_gathered_and_recorded():
    gm, rep = rewrite(Pooled("cumprod"), torch.randn(2, 8, 16))
    assert count(gm, GATHER) == 1
    (g,) = rep.gathers
    assert "cumprod" in g.why and "test_shard_sequence.py" in g.location


def test_cumsum_over_tokens_is_a_local_cumsum_plus_the_chunks_before():
    gm, rep = rewrite(Pooled("cumsum"), torch.randn(2, 8, 16))
    assert count(gm, SEQ_CUMSUM) == 1 and count(gm, GATHER) == 0 and rep.gathers == []


class Positions(nn.Module):
    """Attention whose input gets position features as Hugging Face models make them: OPT's
    positions from a cumsum of a mask of ones, Cohere's RoPE frequencies interleaved with
    repeat_interleave, GPT-J's sin/cos table read at the position ids; then a running mean
    over the tokens (a float cumsum along the sequence)."""

    def __init__(self, d=16):
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.pos = nn.Embedding(64, d)
        self.register_buffer("table", torch.randn(64, d, generator=torch.Generator().manual_seed(0)))
        self.register_buffer("inv_freq", torch.rand(d // 2, generator=torch.Generator().manual_seed(1)))

    def forward(self, x):
        b, n, d = x.shape
        mask = torch.ones(b, n)
        x = x + self.pos((mask.cumsum(1) * mask - 1).long())  # OPT
        freqs = torch.arange(n)[None, :, None].float() * self.inv_freq
        x = x * torch.repeat_interleave(freqs, 2, dim=-1).cos()  # Cohere
        x = x * self.table[torch.arange(n)[None]]  # GPT-J
        q, k, v = self.qkv(x).view(b, n, 3, 2, d // 2).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).flatten(2)
        return y.cumsum(1) / torch.arange(1, n + 1)[:, None]


def test_position_features_are_computed_on_the_shards():
    """No O(n) float on any rank: OPT's mask of ones is made at n/p rows and summed with
    ringcc::seq_cumsum, as is the running sum; Cohere's repeat_interleave of the frequencies
    and GPT-J's table lookup run on this rank's positions. (Numbers: test_shard_seqops.py.)"""
    gm, rep = rewrite(Positions(), torch.randn(2, 8, 16))
    assert rep.gathers == [] and rep.plan.verdict, (rep.gathers, rep.plan.culprits)
    (ones,) = [n for n in gm.graph.nodes if n.target is torch.ones]
    assert tuple(ones.meta["example_value"].shape) == (2, 4) and count(gm, SEQ_CUMSUM) == 2
    (interleaved,) = [n for n in gm.graph.nodes if n.target is torch.repeat_interleave]
    assert interleaved.meta[STATE_META].sharded and interleaved.meta["example_value"].shape[1] == 4
    (lookup,) = [n for n in gm.graph.nodes if n.target is operator.getitem and "table" in n.args[0].name]
    assert lookup.args[1].target is SHARD and lookup.meta["example_value"].shape[1] == 4


class OptPositions(nn.Module):
    """HF OPT without an attention_mask: positions from the cumsum of torch.ones(b, n) floats;
    and positions from 1 to n (an arange to a size computed in the graph, n + 1)."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(16, 48)
        self.pos = nn.Embedding(64, 16)

    def forward(self, x):
        b, n, _ = x.shape
        mask = torch.ones(b, n)
        x = x + self.pos((mask.cumsum(1) * mask - 1).long()) + self.pos(torch.arange(1, n + 1))
        q, k, v = self.qkv(x).view(b, n, 3, 2, 8).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).sum()


def test_a_fill_of_symbolic_length_is_made_at_n_over_p_rows():
    """Under a symbolic length (as `ringcc plan` traces) OPT's mask of ones is made at n // p
    rows on each rank, not sliced from n rows, and the arange to n + 1 is replicated index data
    (its bound a size): the plan is O(n/p)."""
    x = torch.randn(2, 8, 16)
    torch._dynamo.mark_dynamic(x, 1)
    gm, rep = rewrite(OptPositions(), x)
    assert rep.gathers == [] and rep.plan.verdict, rep.plan.culprits
    (ones,) = [n for n in gm.graph.nodes if n.target is torch.ones]
    assert [u.target for u in ones.users] == [SEQ_CUMSUM, operator.mul] and count(gm, SEQ_CUMSUM) == 1
    rows = ones.args[0][1]  # n // p, the length being a SymInt input of the graph
    assert rows.target is operator.floordiv and rows.args[0].op == "placeholder" and rows.args[1] == 2


class WriteIntoAShard(nn.Module):
    """An in-place write with no sharding rule into a shard (`h[:, 0] = 0`), then a read of it."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 48)

    def forward(self, x):
        q, k, v = self.proj(x).view(2, x.shape[1], 3, 2, 8).permute(2, 0, 3, 1, 4)
        h = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).flatten(2) * 2
        h[:, 0] = 0
        return h.sum()


def test_a_write_into_a_gathered_shard_is_read_after_it():
    """The write runs on the gathered value (recorded); the sum after it reads that value, not
    the shard the write did not reach."""
    gm, rep = rewrite(WriteIntoAShard(), torch.randn(2, 8, 16))
    (gathered,) = [n for n in gm.graph.nodes if n.target is GATHER]
    (write,) = [n for n in gm.graph.nodes if n.target is operator.setitem]
    assert write.args[0] is gathered and [g.why for g in rep.gathers] == ["no sharding rule for setitem"]
    (total,) = [n for n in gm.graph.nodes if n.op == "call_method" and n.target == "sum"]
    assert total.args[0] is gathered and count(gm, ALL_REDUCE) == 0


class RopeFromPositions(nn.Module):
    """RoPE tables from torch.outer(positions, frequencies), computed inside the graph."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 48)

    def forward(self, x):
        q, k, v = self.proj(x).view(2, x.shape[1], 3, 2, 8).permute(2, 0, 3, 1, 4)
        angles = torch.outer(torch.arange(x.shape[1]).float(), torch.ones(8) / 3)
        q, k = q * angles.cos() + q.neg() * angles.sin(), k * angles.cos() + k.neg() * angles.sin()
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).sum()


def test_outer_product_of_positions_keeps_them_sharded():
    gm, rep = rewrite(RopeFromPositions(), torch.randn(2, 12, 16))  # n = 12, 8 frequencies
    assert count(gm, GATHER) == 0 and rep.gathers == []
    assert shard_models.shard_row_violations(gm, 2) == []


class MultiQueryFused(nn.Module):
    """Falcon's multi-query split: the fused heads, K and V picked with a list of one head."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 32)

    def forward(self, x):
        fused = self.proj(x).view(2, x.shape[1], 4, 8)
        q, k, v = fused[..., :-2, :], fused[..., [-2], :], fused[..., [-1], :]
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        return F.scaled_dot_product_attention(q, k.expand(-1, 2, -1, -1), v.expand(-1, 2, -1, -1), is_causal=True).sum()


def test_a_list_index_off_the_sequence_dim_keeps_the_shard():
    gm, rep = rewrite(MultiQueryFused(), torch.randn(2, 12, 16))
    assert count(gm, GATHER) == 0 and rep.gathers == []


class GroupedBroadcast(nn.Module):
    """Falcon's grouped K/V (new_decoder_architecture): per K/V group, r query heads and one K
    and one V head fused; K and V broadcast_to the queries' shape, then the groups flattened."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 32)

    def forward(self, x):
        fused = self.proj(x).view(2, x.shape[1], 2, 4, 4)  # 2 groups of 2 queries, K, V
        q, k, v = fused[:, :, :, :-2], fused[:, :, :, [-2]], fused[:, :, :, [-1]]
        k, v = torch.broadcast_to(k, q.shape), torch.broadcast_to(v, q.shape)
        q, k, v = (t.flatten(2, 3).transpose(1, 2) for t in (q, k, v))
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).sum()


def test_a_broadcast_of_grouped_keys_keeps_the_shard():
    gm, rep = rewrite(GroupedBroadcast(), torch.randn(2, 12, 16))
    assert count(gm, GATHER) == 0 and rep.gathers == []
    assert len(rep.rewritten) == 1


class VmapAfterAttention(nn.Module):
    """torch.vmap over the batch after attention (HF Jamba's associative scan vmaps its combine
    function): dynamo inlines it as calls that enter and leave a functorch level around the
    batched values."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 48)

    def forward(self, x):
        q, k, v = self.proj(x).view(2, x.shape[1], 3, 2, 8).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return torch.vmap(lambda a, b: a * b)(y, y.sigmoid()).sum()


def test_a_vmap_in_the_graph_keeps_its_level_calls():
    from ringcc import _compat

    gm, rep = rewrite(VmapAfterAttention(), torch.randn(2, 12, 16))
    levels = _compat.vmap_level_targets()
    assert [sum(n.target is t for n in gm.graph.nodes) for t in levels] == [1, 1]
    assert len(rep.rewritten) == 1


class WholeSizeViews(nn.Module):
    """HF GPT-2's Conv1D (`x.view(x.size()[:-1] + (nf,))`: under a symbolic length dynamo records
    torch.Size([2, s, 48])) and OPT's MLP (`shape = h.shape`, rows, `.view(shape)`: h.size())."""

    def __init__(self):
        super().__init__()
        self.weight, self.bias = nn.Parameter(torch.randn(16, 48)), nn.Parameter(torch.randn(48))
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        size_out = x.size()[:-1] + (48,)
        qkv = torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight).view(size_out)
        q, k, v = qkv.view(*qkv.shape[:2], 3, 2, 8).permute(2, 0, 3, 1, 4)
        h = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).flatten(2)
        shape = h.shape
        rows = h.reshape(-1, h.size(-1))
        return (rows + self.fc(rows)).view(shape).sum()


def test_views_to_sizes_read_whole_keep_the_shard():
    gm, rep = rewrite(WholeSizeViews(), torch.randn(2, 12, 16), dynamic=True)
    assert len(rep.rewritten) == 1 and count(gm, GATHER) == 0 and rep.gathers == []
    assert shard_models.shard_row_violations(gm, 2) == []


def test_sharded_values_have_n_over_p_rows():
    gm, _ = rewrite(shard_models.build("gpt"), *shard_models.batch("gpt", 24), world=4)
    assert shard_models.shard_row_violations(gm, 4) == []
    states = [n.meta[STATE_META] for n in gm.graph.nodes if STATE_META in n.meta]
    assert sum(1 for s in states if not isinstance(s, tuple) and s.sharded) > 20


def test_batch_equal_to_length_is_traced_to_the_attention_sites():
    """With batch == n the ids' sequence dim is the one that becomes attention's sequence dim
    (Note [Ambiguous inputs]): the ids are sliced before the embedding. The labels feed no
    attention site: a note, and they are sliced where they meet the logits' shard. Marking
    the dims gives the same graph."""
    model = shard_models.build("gpt")
    idx, labels = (torch.randint(0, shard_models.VOCAB, (8, 8)) for _ in range(2))
    gm, rep = rewrite(model, idx, labels)
    assert any("dim 1 is the sequence" in note and "l_idx_" in note for note in rep.notes), rep.notes
    assert any("several dims of size n=8 and does not feed the attention sites" in note for note in rep.notes)
    first_shard = next(n for n in gm.graph.nodes if n.target is SHARD)
    assert first_shard.args[0].op == "placeholder" and first_shard.args[1] == 1
    ringcc.mark_sequence(idx, 1)
    ringcc.mark_sequence(labels, 1)
    gm, rep = rewrite(model, idx, labels)
    first_shard = next(n for n in gm.graph.nodes if n.target is SHARD)
    assert first_shard.args[0].op == "placeholder" and first_shard.args[1] == 1
    assert rep.gathers == []


def test_mark_sequence_rejects_bad_dims():
    with pytest.raises(ValueError, match="out of range"):
        ringcc.mark_sequence(torch.zeros(2, 3), 2)


def test_parameter_gradients_sync_in_buckets():
    """Weights used by sharded ops go through sync_grads_view, bucket_mb at a time, each bucket
    just before its first use; the all-reduce happens once per bucket in backward, not once
    per parameter."""
    model = shard_models.build("gpt")
    n_params = len(list(model.parameters()))  # the tied head counts once
    gm, _ = rewrite(model, *shard_models.batch("gpt", 24), bucket_mb=0.02)
    syncs = [n for n in gm.graph.nodes if n.target is SYNC]
    assert 1 < len(syncs) < n_params
    assert sum(len(n.args[0]) for n in syncs) == n_params
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for n in syncs:
        sizes = [a.meta["example_value"].numel() * 4 for a in n.args[0]]
        assert len(sizes) == 1 or sum(sizes) <= 0.02 * 2**20
        # each bucket is synced just before its first use, after its getitems only: in backward
        # its all-reduce runs when that use's backward is done, not at the end of the backward
        first = min(order[u] for item in n.users for u in item.users)
        assert all(order[m] < first for m in n.users) and order[n] == first - len(n.users) - 1


class CastFirst(nn.Module):
    """An RMSNorm-style block on bf16 activations: its first op is x.float()."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 48, dtype=torch.bfloat16)

    def forward(self, x):
        xf = x.float()
        h = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)
        q, k, v = self.proj(h).view(2, x.shape[1], 3, 2, 8).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return y.float().pow(2).mean()


def test_a_dtype_cast_of_a_float_input_is_sliced_before_the_cast():
    # x.float() of the full-length bf16 input would be a new O(n) fp32 tensor on every rank:
    # the shard comes first, and the planner's verdict holds.
    gm, rep = rewrite(CastFirst(), torch.randn(2, 24, 16, dtype=torch.bfloat16), world=2)
    shard = next(n for n in gm.graph.nodes if n.target is SHARD)
    assert shard.args[0].op == "placeholder"
    casts = [n for n in gm.graph.nodes if n.op == "call_method" and n.target == "float"]
    assert casts and all(shard in c.all_input_nodes for c in casts[:1])
    assert rep.plan is not None and rep.plan.verdict, rep.plan.reasons
    # the re-derived fake values keep requires_grad (the planner counts gradients by it)
    ring = next(n for n in gm.graph.nodes if n.target is torch.ops.ringcc.ring_attention.default)
    assert all(t.requires_grad for t in ring.meta["example_value"][:1])
    assert ring.args[0].meta["example_value"].requires_grad


@pytest.mark.parametrize("world,dynamic,expected", [
    (1, False, "sequence of 8 tokens sharded over 1 rank "),
    (2, True, "sequence of a dynamic length sharded over 2 ranks "),
])
def test_sharding_note_reads_as_words(world, dynamic, expected):
    """The report's sharding note names a symbolic length as such, not by its symbol (s27)."""
    if world == 1:  # p = 1 runs without a process group
        ringcc.reset_reports()
        torch._dynamo.reset()
        torch.compile(Pooled("mean"), backend=ringcc.backend(ringcc.Config(world_size=1, inner="eager")))(
            torch.randn(2, 8, 16))
        rep = ringcc.reports()[0]
    else:
        _, rep = rewrite(Pooled("mean"), torch.randn(2, 8, 16), world=world, dynamic=dynamic)
    (note,) = [n for n in rep.notes if n.startswith("sequence of")]
    assert note.startswith(expected), note


class FlatResidual(nn.Module):
    """Attention, then the tokens flattened to [b * n, d] (as MoE blocks do) and an op without a
    sharding rule (cumprod over the tokens: gathered) added back to the sharded tokens."""

    def __init__(self, d=16):
        super().__init__()
        self.emb = nn.Embedding(32, d)
        self.qkv = nn.Linear(d, 3 * d)
        self.w = nn.Linear(d, d)
        self.register_buffer("proj", torch.randn(d, generator=torch.Generator().manual_seed(0)))

    def forward(self, ids):
        b, n = ids.shape
        q, k, v = self.qkv(self.emb(ids)).view(b, n, 3, 2, -1).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, n, -1)
        h = y.view(-1, y.shape[-1])
        out = self.w(h).cumprod(0) + h
        return (out.view(b, n, -1) * self.proj).sum()  # a fixed projection: no gradient is ~0


def test_a_gathered_value_meets_flattened_shards_as_a_shard_not_a_weight():
    """The gathered cumprod comes back to the flattened [b * n/p, d] shards through
    unflatten / shard / flatten; each of those nodes carries its sequence state, so the shard
    is not taken for a replicated weight whose cotangent sync_param_grads all-reduces (which
    gave wrong gradients for every parameter before the add)."""
    gm, rep = rewrite(FlatResidual(), torch.randint(0, 32, (2, 8)), world=2)
    assert [g.why for g in rep.gathers] == ["no sharding rule for cumprod"]
    shard = next(n for n in gm.graph.nodes if n.target is SHARD and n.args[0].target == "unflatten")
    (flat,) = shard.users
    assert flat.target == "flatten" and flat.meta[STATE_META].sharded and flat.meta[STATE_META].outer == 2
    assert shard.meta[STATE_META].sharded and shard.args[0].meta[STATE_META] is not None
    synced = {a for n in gm.graph.nodes if n.target in (SYNC, torch.ops.ringcc.sync_grads.default)
              for a in n.args[0]}
    assert all(a.op == "placeholder" for a in synced), synced


class _Gelu(torch.autograd.Function):
    """Bloom's training GELU: a custom autograd.Function with an elementwise forward and backward."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * 0.5 * (1.0 + torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x)))

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        t = torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x))
        return g * (0.5 * x * ((1 - t * t) * (0.79788456 + 0.1070322243 * x * x)) + 0.5 * (1 + t))


class _RunningSum(torch.autograd.Function):
    """Not token-local: a running sum over the tokens."""

    @staticmethod
    def forward(ctx, x):
        return x.cumsum(1)

    @staticmethod
    def backward(ctx, g):
        return g.flip(1).cumsum(1).flip(1)


class CustomFunction(nn.Module):
    def __init__(self, fn=_Gelu):
        super().__init__()
        self.fn = fn
        self.proj = nn.Linear(16, 48)

    def forward(self, x):
        q, k, v = self.proj(x).view(2, x.shape[1], 3, 2, 8).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).flatten(2)
        return self.fn.apply(y)


def test_elementwise_autograd_function_runs_on_the_shard():
    """Under a symbolic length (test_shard_seqops runs it at a fixed one, against eager)."""
    gm, rep = rewrite(CustomFunction(_Gelu), torch.randn(2, 8, 16), dynamic=True)
    assert count(gm, GATHER) == 0 and rep.gathers == [] and rep.plan.verdict, rep.gathers
    (apply,) = [n for n in gm.graph.nodes if n.name.startswith("autograd_function_apply")]
    assert apply.meta[STATE_META][0].sharded


def test_autograd_function_that_mixes_tokens_is_gathered_with_its_reason():
    gm, rep = rewrite(CustomFunction(_RunningSum), torch.randn(2, 8, 16))
    (g,) = rep.gathers
    assert "autograd_function_apply: its fwd_body_0 calls cumsum, which is not elementwise" in g.why


@pytest.mark.parametrize("op", [torch.ops.aten.size.default, torch.ops.aten.sym_size.int])
def test_refreshed_sizes_stay_symbolic(op):
    """A graph's aten.size under a symbolic length: refresh_fakes reads the fake tensor's sizes
    (the fake dispatch of aten.size takes int() of each, which would specialise the length and
    recompile the model at every new one)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

    from ringcc.passes.shard_sequence import refresh_fakes

    mode = FakeTensorMode(shape_env=ShapeEnv())
    x = mode.from_tensor(torch.randn(2, 40), symbolic_context=StatelessSymbolicContext(
        dynamic_sizes=[DimDynamic.STATIC, DimDynamic.DYNAMIC]))
    graph = torch.fx.Graph()
    p = graph.placeholder("x")
    p.meta["example_value"] = x
    size = graph.call_function(op, (p,) if op is torch.ops.aten.size.default else (p, 1))
    graph.output(size)
    refresh_fakes(torch.fx.GraphModule(torch.nn.Module(), graph))
    n = size.meta["example_value"]
    n = n[1] if op is torch.ops.aten.size.default else n
    assert isinstance(n, torch.SymInt) and mode.shape_env.guards == [], (n, mode.shape_env.guards)


@pytest.mark.parametrize("target", [operator.matmul, "matmul"])
def test_refreshed_batched_matmul_stays_symbolic(target):
    """HF's rotary frequencies times positions, [b, d/2, 1] @ [b, 1, n]: refresh_fakes makes the
    [b, d/2, n] result without running matmul (torch 2.11's reads its sizes as ints: a guard on
    the length, a recompilation at every new one)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

    from ringcc.passes.shard_sequence import refresh_fakes

    mode = FakeTensorMode(shape_env=ShapeEnv())
    freqs = mode.from_tensor(torch.randn(2, 4, 1), static_shapes=True)
    pos = mode.from_tensor(torch.randn(2, 1, 40), symbolic_context=StatelessSymbolicContext(
        dynamic_sizes=[DimDynamic.STATIC, DimDynamic.STATIC, DimDynamic.DYNAMIC]))
    graph = torch.fx.Graph()
    a, b = graph.placeholder("freqs"), graph.placeholder("pos")
    a.meta["example_value"], b.meta["example_value"] = freqs, pos
    mm = graph.call_method(target, (a, b)) if isinstance(target, str) else graph.call_function(target, (a, b))
    graph.output(mm)
    refresh_fakes(torch.fx.GraphModule(torch.nn.Module(), graph))
    out = mm.meta["example_value"]
    assert out.shape[:2] == (2, 4) and isinstance(out.shape[2], torch.SymInt) and str(out.shape[2]) == str(pos.shape[2])
    assert out.is_contiguous()
    assert mode.shape_env.guards == [], mode.shape_env.guards


def test_a_refreshed_linear_that_needs_grad_may_be_updated_in_place():
    """refresh_fakes makes a linear's result directly; where it needs grad it is, as the real
    op's result, not a leaf, so a graph that updates it in place (Falcon's fused query/key/value
    projection) refreshes without autograd's leaf error."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from ringcc.passes.shard_sequence import refresh_fakes

    mode = FakeTensorMode()
    x = mode.from_tensor(torch.randn(2, 8, 4))
    w = mode.from_tensor(torch.nn.Parameter(torch.randn(6, 4)))
    graph = torch.fx.Graph()
    a, b = graph.placeholder("x"), graph.placeholder("w")
    a.meta["example_value"], b.meta["example_value"] = x, w
    y = graph.call_function(torch.nn.functional.linear, (a, b))
    z = graph.call_method("mul_", (y, 2))
    graph.output(z)
    refresh_fakes(torch.fx.GraphModule(torch.nn.Module(), graph))
    out = y.meta["example_value"]
    assert out.shape == (2, 8, 6) and out.requires_grad and not out.is_leaf
    assert z.meta["example_value"].requires_grad


class NarrowedTanh(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x):
        h = self.lin(x)
        return torch.tanh(h.narrow(1, 0, h.shape[1] - 1)) * 2


@pytest.mark.parametrize("dynamic", [False, True])
def test_narrow_keeps_the_shard_and_narrows_the_window(dynamic):
    """h.narrow(1, 0, n - 1) on a shard: a view of all the shard's rows (n / p of them, from the
    length's symbol under dynamic shapes) whose state is the window [0, n - 1), which its readers
    and the output carry; nothing is gathered."""
    x = torch.randn(2, 8, 16)
    ringcc.mark_sequence(x, 1)
    gm, rep = rewrite(NarrowedTanh(), x, dynamic=dynamic)
    assert rep.gathers == []
    narrow = next(n for n in gm.graph.nodes if n.target == "narrow")
    st = narrow.meta[STATE_META]
    n = next(iter(st.length.free_symbols)) if dynamic else 8  # the length's symbol under dynamic shapes
    assert st.sharded and int(st.start) == 0 and st.length - n == -1, st
    assert isinstance(narrow.args[3], torch.fx.Node) if dynamic else narrow.args[3] == 4
    out = next(n for n in gm.graph.nodes if n.op == "output")
    assert out.args[0][0].meta[STATE_META].length == st.length
