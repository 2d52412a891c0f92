"""The backend on real gloo groups: training steps, dynamic lengths, sharded outputs, and the
rank-consistency check (tier 3)."""

import pytest
import torch

import ringcc
import shard_models
from graphs import dynamo_graph, make_ctx
from ringcc.backend import check_rank_consistency
from ringcc.config import Config
from ringcc.passes.pipeline import run_pipeline
from ringcc.runtime import layout as L
from ringcc.sharded import SequenceSharded


def case_optimizer_steps(rank, world, steps):
    torch.manual_seed(0)
    ref, model = shard_models.build("llama"), shard_models.build("llama")
    compiled = torch.compile(model, backend=ringcc.backend(inner="aot_eager"))
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    curves = ([], [])
    inputs = shard_models.batch("llama", 24)
    for _ in range(steps):
        for m, o, curve in ((ref, opt_ref, curves[0]), (compiled, opt, curves[1])):
            o.zero_grad()
            loss = m(*inputs)[0]
            loss.backward()
            o.step()
            curve.append(float(loss.detach()))
    return curves


@pytest.mark.soak  # training tracks eager in make test: test_demo.py
def test_optimizer_steps_track_single_process(pools):
    results = pools(2).run(case_optimizer_steps, 5, timeout=300)
    for ref, got in results:
        assert ref[-1] < ref[0]  # it trains
        assert max(abs(a - b) for a, b in zip(ref, got)) < 1e-4, (ref, got)


@pytest.mark.soak
def test_one_compiled_llama_serves_several_lengths(pools):
    """At most one recompilation after the first dynamic graph: 24 may compile static (or
    dynamic at once when this process compiled the model at another length before), 40 with
    a symbolic n, and 56 reuses that graph. (No length equals a model dim: the static graph's
    checks read sizes equal to n as the sequence. With checkpointed layers, a review ran
    24/40/56 and dynamic=True at p = 2: parity, each region recomputed.)"""
    results = pools(2).run(shard_models.parity, "llama", (24, 40, 56), "aot_eager", None, None, timeout=300)
    for rank, (errors, facts) in enumerate(results):
        for errs in errors:
            assert max(errs.values()) < 1e-5, (rank, errs)
        assert len(facts) <= 2, f"rank {rank}: {len(facts)} compilations for 3 lengths"
        for f in facts:
            assert f["rewritten"] == f["sites"] > 0, rank
            assert f["bad_rows"] == [] and f["nxn"] == [], rank


@pytest.mark.soak
def test_dynamic_true_shards_with_a_symbolic_batch_too(pools):
    """dynamic=True: batch and n are both symbols (logits.view(-1, V) merges them)."""
    errors, facts = pools(2).run(shard_models.parity, "gpt", (24, 32), "aot_eager", None, True, timeout=300)[0]
    assert max(max(e.values()) for e in errors) < 1e-5, errors
    assert len(facts) == 1 and facts[0]["bad_rows"] == [] and facts[0]["gathers"] == []


def case_sharded_outputs(rank, world):
    """Note [Sharded outputs]: the logits come back as this rank's zigzag rows with the global
    shape; reading them gathers (in global order) once, and the loss outside is exact."""
    ref, model = shard_models.build("gpt"), shard_models.build("gpt")
    compiled = torch.compile(model, backend=ringcc.backend(inner="aot_eager"))
    inputs = shard_models.batch("gpt", 24)
    ref_loss, ref_logits = ref(*inputs)
    loss, logits = compiled(*inputs)
    torch.testing.assert_close(loss, ref_loss, atol=1e-5, rtol=1e-5)
    assert isinstance(logits, SequenceSharded) and logits.shape == ref_logits.shape
    mine = L.shard(ref_logits.detach(), 1, rank, world, L.Layout("zigzag"))
    torch.testing.assert_close(logits.local.detach(), mine, atol=1e-5, rtol=1e-5)
    assert torch.equal(logits.positions(), L.global_positions(rank, world, L.Layout("zigzag"), 12))
    assert not logits._full  # nothing read it yet
    torch.testing.assert_close(logits[:, -1], ref_logits[:, -1], atol=1e-5, rtol=1e-5)
    assert logits.full_tensor() is logits.full_tensor()  # gathered once
    extra = torch.randn(ref_logits.shape, generator=torch.Generator().manual_seed(3))
    (loss + (logits * extra).sum()).backward()
    (ref_loss + (ref_logits * extra).sum()).backward()
    ref_grads = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref_grads[name].grad, atol=1e-5, rtol=1e-5)
    return tuple(logits.local.shape)


def test_sharded_outputs_gather_on_use(pools):
    shapes = pools(2).run(case_sharded_outputs, timeout=600)
    assert shapes == [(2, 12, shard_models.VOCAB)] * 2


def case_mismatch(rank, world):
    try:
        check_rank_consistency(["shard l_idx_@1", f"site{rank}: ring zigzag"], graph="graph7")
    except ValueError as e:
        return str(e)
    return None


def test_rank_mismatch_names_the_differing_sites(pools):
    messages = pools(2).run(case_mismatch)
    assert all(m is not None for m in messages)
    assert "site0: ring zigzag" in messages[0] and "site1: ring zigzag" in messages[0]
    assert "graph7" in messages[1]


def case_agree(rank, world):
    check_rank_consistency(["a", "b"])
    return True


def test_rank_agreement_passes(pools):
    assert pools(2).run(case_agree) == [True, True]


def case_fingerprint(rank, world):
    from ringcc.backend import fingerprint

    return fingerprint(["a", "b"]), fingerprint(["b", "a"])


def test_fingerprint_is_stable(pools):
    """The same decisions give the same fingerprint in every process (it is compared across
    ranks, so it may not depend on hash seeds or ids), and another order another one."""
    (ab0, ba0), (ab1, ba1) = pools(2).run(case_fingerprint)
    assert ab0 == ab1 and ba0 == ba1 and ab0 != ba0


@pytest.mark.parametrize("name,n", [("gpt", 26), pytest.param("bert", 25, marks=pytest.mark.soak)])
def test_pad_lengths_the_layout_does_not_divide(pools, name, n):
    """p = 2: 26 tokens pad to 28 (zigzag, causal GPT: shifted labels), 25 to 26 (contiguous,
    BERT: masked keys, a mean over tokens, the pooled first token)."""
    results = pools(2).run(shard_models.parity, name, (n,), "aot_eager", {"pad": True}, timeout=300)
    for rank, (errors, facts) in enumerate(results):
        assert max(errors[0].values()) < 1e-5, (rank, errors)
        assert facts[0]["rewritten"] == facts[0]["sites"] > 0, rank
        assert all(why.startswith("graph output") for _, why in facts[0]["gathers"]), (rank, facts[0]["gathers"])
        assert facts[0]["bad_rows"] == [], rank


def case_ranks_disagree(rank, world):
    model = shard_models.build("gpt")
    layout = "zigzag" if rank == 0 else "contiguous"
    compiled = torch.compile(model, backend=ringcc.backend(inner="aot_eager", layout=layout))
    try:
        compiled(*shard_models.batch("gpt", 24))
    except Exception as e:  # dynamo may wrap it; the message is what matters
        return str(e)
    return None


# the first call's agreement check in make test: test_ranks_with_different_ring_settings_fail_at_the_first_call
# (a compiled model) and test_rank_mismatch_names_the_differing_sites (the message)
@pytest.mark.soak
def test_ranks_compiling_differently_fail_at_the_first_call_instead_of_hanging(pools):
    messages = pools(2).run(case_ranks_disagree, timeout=120)
    for m in messages:
        assert m is not None and "ranks took different rewrite decisions" in m
        assert "ring_attention zigzag" in m and "ring_attention contiguous" in m


def case_settings_disagree(rank, world):
    import os

    os.environ["RINGCC_RING_WORKSPACE_MIB"] = "0" if rank == 0 else "64"
    try:
        torch._dynamo.reset()
        compiled = torch.compile(shard_models.build("gpt"), backend=ringcc.backend(inner="aot_eager"))
        compiled(*shard_models.batch("gpt", 24))
    except Exception as e:  # dynamo may wrap it; the message is what matters
        return str(e)
    finally:
        del os.environ["RINGCC_RING_WORKSPACE_MIB"]
    return None


def test_ranks_with_different_ring_settings_fail_at_the_first_call(pools):
    # Head chunks decided from different budgets would deadlock the ring: the first call's
    # agreement check names the setting instead.
    for m in pools(2).run(case_settings_disagree, timeout=120):
        assert m is not None and "ranks took different rewrite decisions" in m
        assert "RINGCC_RING_WORKSPACE_MIB=0" in m and "RINGCC_RING_WORKSPACE_MIB=64" in m



def _assert_same_loss_and_grads(loss, ref_loss, model, ref):
    loss.backward()
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss, atol=1e-5, rtol=1e-5)
    ref_grads = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref_grads[name].grad, atol=1e-5, rtol=1e-5)


def case_handoff(rank, world):
    """A second ringcc graph reading the first one's sharded logits (a loss compiled on its
    own, as after a graph break) takes the shard as is, also through Tensor methods (which
    dynamo traces on the wrapper only as Python methods), and the loss and gradients are exact."""
    import torch.nn.functional as F

    ref, model = shard_models.build("gpt"), shard_models.build("gpt")
    backend = ringcc.backend(inner="aot_eager")
    compiled = torch.compile(model, backend=backend)
    loss_fn = torch.compile(lambda logits, labels: F.cross_entropy(logits.float().flatten(0, 1), labels.flatten()),
                            backend=backend)
    idx, labels = shard_models.batch("gpt", 24)
    ringcc.reset_reports()
    _, logits = compiled(idx, labels)
    loss = loss_fn(logits, labels)
    _, ref_logits = ref(idx, labels)
    ref_loss = F.cross_entropy(ref_logits.flatten(0, 1), labels.flatten())
    _assert_same_loss_and_grads(loss, ref_loss, model, ref)
    assert not logits._full  # never gathered outside a graph
    return [(r.plan.verdict, any("handoff" in n for n in r.notes), [g.why for g in r.gathers])
            for r in ringcc.reports()]


def test_sharded_output_feeds_another_graph_as_a_shard(pools):
    for facts in pools(2).run(case_handoff, timeout=600):
        assert facts[0] == (True, False, []), facts  # the model's graph: logits returned as shards
        assert len(facts) == 2 and facts[1][1], facts  # the loss's one graph takes them as its shard


class _MaskedBlock(torch.nn.Module):
    def __init__(self, d: int = 32, heads: int = 4):
        super().__init__()
        self.heads, self.norm = heads, torch.nn.LayerNorm(d)
        self.qkv, self.o = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)

    def forward(self, x, mask):
        b, n, d = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return x + self.o(out.transpose(1, 2).reshape(b, n, d))


def _written_mask(ids, attention_mask):
    """transformers 4.x's additive causal padding mask, written in place (float, finite minimum)."""
    n, low = ids.shape[1], torch.finfo(torch.float32).min
    i = torch.arange(n, device=ids.device)
    mask = torch.full((n, n), low, device=ids.device).triu(1)
    mask *= i > i.reshape(-1, 1)
    mask = mask[None, None, :, :].expand(ids.shape[0], 1, -1, -1).clone()
    padding = (mask[:, :, :, :n] + attention_mask[:, None, None, :]) == 0
    mask[:, :, :, :n] = mask[:, :, :, :n].masked_fill(padding, low)
    return mask


class _BreakAfterMask(torch.nn.Module):
    """A causal padding mask built once, a graph break, then attention with it: the mask is an
    output of one graph and an input of the next (as transformers' MoE layers break a decoder)."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.embed = torch.nn.Embedding(64, 32)
        self.blocks = torch.nn.ModuleList([_MaskedBlock(), _MaskedBlock()])

    def forward(self, ids, attention_mask):
        if self.kind == "written":
            mask = _written_mask(ids, attention_mask)
        else:
            i = torch.arange(ids.shape[1], device=ids.device)
            mask = (i[None, None, :, None] >= i[None, None, None, :]) & attention_mask.bool()[:, None, None, :]
        x = self.blocks[0](self.embed(ids), mask)
        torch._dynamo.graph_break()
        return self.blocks[1](x, mask)


def case_mask_across_graph_break(rank, world, kind, dynamic, lengths):
    """The later graph reads the earlier graph's mask output as its function (Note [Mask
    outputs]): no [b, 1, n, n] input, every site rewritten, and, at each length in turn, the
    forward, every gradient and the set of parameters with one as eager's."""
    from ringcc.sharded import MaskFunctionOutput

    torch._dynamo.reset()
    torch.manual_seed(0)
    ref, model = _BreakAfterMask(kind), _BreakAfterMask(kind)
    model.load_state_dict(ref.state_dict())
    inputs, symbolic, backend = [], [], ringcc.backend(inner="aot_eager", strict=True)

    def recording(gm, example_inputs):
        inputs.append([tuple(x.shape) for x in example_inputs
                       if isinstance(x, torch.Tensor) and not isinstance(x, (torch.nn.Parameter, MaskFunctionOutput))])
        symbolic.append(any(isinstance(x, torch.SymInt) for x in example_inputs))
        return backend(gm, example_inputs)

    ringcc.reset_reports()
    compiled = torch.compile(model, backend=recording, dynamic=dynamic)
    steps = []
    for n in lengths:
        ids = torch.randint(0, 64, (2, n), generator=torch.Generator().manual_seed(n))
        attention_mask = torch.ones(2, n, dtype=torch.long)
        attention_mask[1, -5:] = 0
        proj = torch.randn(2, n, 32, generator=torch.Generator().manual_seed(2))
        model.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
        out = compiled(ids, attention_mask)
        (out * proj).sum().backward()
        want = ref(ids, attention_mask)
        (want * proj).sum().backward()
        grads = {name: (p.grad is None, r.grad is None, 0.0 if p.grad is None or r.grad is None else
                        float((p.grad - r.grad).abs().max() / r.grad.abs().max().clamp_min(1e-3)))
                 for (name, p), (_, r) in zip(model.named_parameters(), ref.named_parameters())}
        steps.append((n, float((out - want).abs().max()), grads))
    sites = [(len(r.rewritten), len(r.skipped)) for r in ringcc.reports()]
    return steps, sites, inputs, symbolic


@pytest.mark.parametrize("kind, dynamic", [("bool", None), pytest.param("written", None, marks=pytest.mark.soak),
                                           pytest.param("bool", True, marks=pytest.mark.soak)])
def test_mask_crosses_a_graph_break_as_its_function(pools, kind, dynamic):
    """bool: built from aranges and the padding mask; written: transformers 4.x's additive mask
    written in place. Two lengths in a row: under dynamo's automatic dynamic (None) the first
    compiles both graphs with a constant n and the second recompiles them with n a symbol;
    dynamic=True compiles them once, with n a symbol, for both. The mask's shape is evaluated per
    call, and the later graph reads it as its function at every length."""
    lengths = (24, 32)
    for steps, sites, inputs, symbolic in pools(2).run(case_mask_across_graph_break, kind, dynamic, lengths,
                                                       timeout=300):
        assert [n for n, _, _ in steps] == list(lengths)
        for n, err, grads in steps:
            assert err < 1e-5, (n, err)
            assert all(a == b for a, b, _ in grads.values()) and not any(a for a, _, _ in grads.values()), (n, grads)
            assert max(e for _, _, e in grads.values()) < 1e-5, (n, grads)
        assert sites and all(s == (1, 0) for s in sites), sites  # each graph: its one site rewritten
        assert len(inputs) == len(sites) and not any(s[-2:] == (n, n) for shapes in inputs for s in shapes
                                                     for n in lengths), inputs
        if dynamic:
            assert all(symbolic), symbolic
        else:
            assert symbolic == [False, False, True, True], symbolic  # two graphs, compiled twice


class _MergedLogits(torch.nn.Module):
    """The model's logits returned with the batch merged into the sequence dim, [b * n, V] (as
    a mixture-of-experts layer returns its router logits)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, idx, labels):
        return self.model(idx, labels)[1].flatten(0, 1)


def case_merged_output(rank, world):
    """An output that merges the batch into the sequence dim leaves the graph as shards (one
    per batch row, in the graph's layout), and the loss outside on it is exact."""
    import torch.nn.functional as F

    from ringcc import SequenceSharded

    ref, model = shard_models.build("gpt"), shard_models.build("gpt")
    compiled = torch.compile(_MergedLogits(model), backend=ringcc.backend(inner="aot_eager"))
    idx, labels = shard_models.batch("gpt", 24)
    ringcc.reset_reports()
    out = compiled(idx, labels)
    assert isinstance(out, SequenceSharded) and out.outer == 2 and out.shape == (48, out.shape[1])
    assert out.local.shape[0] == 48 // world and out.positions().shape == (48 // world,)
    loss = F.cross_entropy(out, labels.flatten())
    ref_loss = F.cross_entropy(_MergedLogits(ref)(idx, labels), labels.flatten())
    _assert_same_loss_and_grads(loss, ref_loss, model, ref)
    return [[g.why for g in r.gathers] for r in ringcc.reports()]


def test_output_with_the_batch_merged_into_the_sequence_leaves_as_shards(pools):
    for gathers in pools(2).run(case_merged_output, timeout=600):
        assert gathers == [[]], gathers


class _CausalIds(torch.nn.Module):
    """One head (no view of [b, n, ...] that n = 1 would make ambiguous)."""

    def __init__(self):
        super().__init__()
        self.embed, self.k, self.v = torch.nn.Embedding(50, 16), torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)

    def forward(self, ids):
        x = self.embed(ids)
        q, k, v = x.unsqueeze(1), self.k(x).unsqueeze(1), self.v(x).unsqueeze(1)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


def case_pad_one_token(rank, world):
    torch.manual_seed(0)
    model = _CausalIds()
    ids = torch.randint(0, 50, (2, 1))
    compiled = torch.compile(model, backend=ringcc.backend(inner="eager", pad=True), dynamic=False)
    got = compiled(ids)
    notes = list(ringcc.last_report().notes)
    torch._dynamo.reset()
    return float((got - model(ids)).abs().max()), notes


def test_pad_one_token_to_the_zigzag_unit(pools):
    """n = 1 at p = 2 (zigzag): padded to 4, more rows than the value has (the fill is one
    row, expanded)."""
    for err, notes in pools(2).run(case_pad_one_token):
        assert err < 1e-6
        assert "sequence of 1 tokens padded to 4 (a multiple of 4)" in notes


def case_stalled_rank(rank, world, stall):
    import time

    import torch.distributed as dist

    group = dist.new_group(list(range(world)), backend="gloo")  # the default timeout: 30 minutes
    torch.manual_seed(0)
    compiled = torch.compile(_CausalIds(), backend=ringcc.backend(inner="eager", group=group, timeout=2),
                             dynamic=False)
    ids = torch.randint(0, 50, (2, 8))
    compiled(ids)  # a healthy first step
    if rank == 1:
        time.sleep(stall)  # alive, but not calling
    t0 = time.monotonic()
    try:
        compiled(ids)
        out = "no error"
    except Exception as e:  # noqa: BLE001 - the test reads which error, and when
        out = f"{type(e).__name__} after {time.monotonic() - t0:.1f}s"
    torch._dynamo.reset()
    return out


def test_stalled_rank_ends_every_rank_with_an_error_within_config_timeout(pools):
    """Config(timeout=2): rank 1 stalls 4 s; rank 0's step fails after about 2 s, and rank 1's
    step, once it comes, fails too (its peer has left), instead of both waiting for the group's
    30-minute timeout."""
    out = pools(2).run(case_stalled_rank, 4, timeout=90)
    for rank, res in enumerate(out):
        assert res != "no error", (rank, out)
        assert float(res.split()[-1].rstrip("s")) < 10, (rank, out)


def case_pad_symbolic_length(rank, world):
    compiled = torch.compile(_CausalIds(), backend=ringcc.backend(inner="eager", pad=True), dynamic=True)
    try:
        compiled(torch.randint(0, 50, (2, 7)))
        out = "compiled"
    except Exception as e:  # noqa: BLE001 - the test reads the message
        out = str(e)
    torch._dynamo.reset()
    return out


def test_pad_under_dynamic_shapes_is_an_error_that_names_static_shapes(pools):
    """Config(pad=True) with a symbolic length: an error at compile time on every rank, naming
    dynamic=False, not a SequenceLengthError at run time for each length the layout does not divide."""
    for msg in pools(2).run(case_pad_symbolic_length):
        assert "Config(pad=True) pads lengths known at compile time; this graph was traced with a symbolic " \
               "sequence length" in msg and "torch.compile(..., dynamic=False)" in msg, msg


class CountedAlibiAttention(torch.nn.Module):
    """Bloom's attention with a padding mask, in miniature: q, k, v [b * h, n, d], ALiBi
    positions counted over the mask's valid tokens ((mask.cumsum(-1) - 1) * mask, as Bloom's
    build_alibi_tensor), added by baddbmm; causal and key padding by the same mask."""

    def __init__(self, heads=4, head_dim=8):
        super().__init__()
        self.h, self.d = heads, head_dim
        self.qkv = torch.nn.Linear(heads * head_dim, 3 * heads * head_dim)

    def forward(self, x, mask):
        b, n, _ = x.shape
        fused = self.qkv(x).view(b, n, self.h, 3, self.d)
        q, k, v = (fused[..., i, :].transpose(1, 2).reshape(b * self.h, n, self.d) for i in range(3))
        slopes = torch.pow(torch.full((), 0.25), torch.arange(1, self.h + 1, dtype=torch.int32))
        alibi = (slopes[..., None] * ((mask.cumsum(-1) - 1) * mask)[:, None, :]).reshape(b * self.h, 1, n)
        s = alibi.baddbmm(batch1=q, batch2=k.transpose(-1, -2), beta=1.0, alpha=self.d ** -0.5).view(b, self.h, n, n)
        excluded = torch.ones(n, n, dtype=torch.bool).triu(1) | (mask[:, None, None, :] == 0)
        p = torch.softmax(s.masked_fill(excluded, torch.finfo(s.dtype).min), -1).view(b * self.h, n, n)
        return torch.bmm(p, v).view(b, self.h, n, self.d).transpose(1, 2).reshape(b, n, -1)


def case_counted_alibi_gap(rank, world):
    """The attention's dynamo graph through the passes for `world` ranks (the backend's rewrite,
    without its memory plan), run on a right- and a left-padded batch and on a mask with a gap in
    row 1 (errors on the valid rows), and the error a rank raised, if any."""
    torch.manual_seed(0)
    model = CountedAlibiAttention()
    x, mask = torch.randn(2, 16, 32), torch.ones(2, 16, dtype=torch.long)
    gm, traced = dynamo_graph(model, x, mask, with_inputs=True)
    ctx = make_ctx(Config(gather_outputs=True), world_size=world)
    ctx.example_inputs = traced
    run_pipeline(gm, ctx)
    assert [s.decision.value for s in ctx.report.sites] == ["rewritten"], ctx.report.sites
    errs = []
    for pad in (slice(11, None), slice(None, 5), slice(5, 9)):
        mask = torch.ones(2, 16, dtype=torch.long)
        mask[1, pad] = 0
        args = [mask if t.dtype == torch.long else t for t in traced]  # dynamo's order: first use
        with torch.no_grad():
            try:
                got = gm(*args)[0]
            except ValueError as e:
                return errs, str(e)
            errs.append(float((got - model(x, mask))[mask.bool()].abs().max()))
    return errs, None


def test_counted_alibi_positions_are_exact_for_any_mask(pools):
    """Bloom-style ALiBi positions counted over a padding mask are a per-token tensor of the
    site's score function, read at the keys' global positions: exact for right and left padding
    and for a mask with a gap in a row (which is no ALiBi, but the same function)."""
    for errs, message in pools(2).run(case_counted_alibi_gap, timeout=300):
        assert message is None and len(errs) == 3 and max(errs) < 1e-5, (errs, message)


def case_gradient_all_reduce_overlaps_the_backward(rank, world, inner):
    """Note [Overlapped gradient all-reduce]: in a compiled training step every gradient bucket's
    all-reduce starts as soon as its gradients exist, and all the waits come after the backward's
    last attention layer; the gradients equal eager's. Returns the backward's ringcc ops in call
    order (bucket_mb small: one bucket per few parameters)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Calls(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.name()
            if name.startswith("ringcc::") and any(s in name for s in ("grad_all_reduce", "ring_attention_backward")):
                self.names.append(name.split("::")[1].split(".")[0])
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    ref, model = shard_models.build("gpt"), shard_models.build("gpt")
    compiled = torch.compile(model, backend=ringcc.backend(inner=inner, bucket_mb=0.004))
    inputs = shard_models.batch("gpt", 24)
    loss = compiled(*inputs)[0]
    with Calls() as calls:
        loss.backward()
    ref(*inputs)[0].backward()
    ref_grads = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref_grads[name].grad, atol=1e-5, rtol=1e-5)
    return calls.names


@pytest.mark.parametrize("inner", ["aot_eager", pytest.param("inductor", marks=pytest.mark.soak)])
def test_gradient_all_reduce_overlaps_the_backward(pools, inner):
    for names in pools(2).run(case_gradient_all_reduce_overlaps_the_backward, inner, timeout=600):
        starts = [i for i, n in enumerate(names) if n == "grad_all_reduce_start"]
        waits = [i for i, n in enumerate(names) if n == "grad_all_reduce_wait"]
        rings = [i for i, n in enumerate(names) if n == "ring_attention_backward"]
        assert len(rings) == 2 and len(starts) == len(waits) > 2, names
        assert starts[0] < rings[0], names  # a bucket travels during the attention backward
        assert min(waits) > max(starts) and min(waits) > max(rings), names


def case_hf_eager_left_padding(rank, world, n, pad):
    """HF Llama under attn_implementation="eager" on a left-padded batch, the loss over every
    position (labels = input_ids, no -100): the padded rows' logits count. Returns the errors of
    the loss, the logits (every row) and every gradient against single-process eager, the
    parameters with a gradient on each side, and the sites' decisions and details."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch._dynamo.reset()
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=shard_models.VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      attn_implementation="eager", use_cache=False)
    ref, model = LlamaForCausalLM(cfg), LlamaForCausalLM(cfg)
    model.load_state_dict(ref.state_dict())
    ids = torch.randint(0, shard_models.VOCAB, (2, n), generator=torch.Generator().manual_seed(1))
    attention_mask = torch.ones(2, n, dtype=torch.long)
    attention_mask[0, :5] = 0  # left padding: rows 0..4 of sample 0 see no key
    attention_mask[1, :1] = 0
    ringcc.reset_reports()
    compiled = torch.compile(model, backend=ringcc.backend(inner="aot_eager", strict=True, verify=True, pad=pad),
                             dynamic=False)
    got = compiled(input_ids=ids, attention_mask=attention_mask, labels=ids)
    got.loss.backward()
    want = ref(input_ids=ids, attention_mask=attention_mask, labels=ids)
    want.loss.backward()
    errs = {"loss": float((got.loss - want.loss).abs()),
            "logits": float((torch.as_tensor(got.logits) - want.logits).abs().max() / want.logits.abs().max())}
    for (name, p), (_, r) in zip(model.named_parameters(), ref.named_parameters()):
        if p.grad is not None and r.grad is not None:
            errs[name] = float((p.grad - r.grad).abs().max() / r.grad.abs().max().clamp_min(1e-3))
    with_grad = ({name for name, p in model.named_parameters() if p.grad is not None},
                 {name for name, p in ref.named_parameters() if p.grad is not None})
    sites = [(s.decision.value, s.detail) for r in ringcc.reports() for s in r.sites]
    return errs, with_grad, sites


@pytest.mark.parametrize("world, n, pad", [pytest.param(1, 16, False, marks=pytest.mark.soak), (2, 16, False),
                                           *(pytest.param(p, 24, False, marks=pytest.mark.soak) for p in (3, 4)),
                                           *(pytest.param(p, n, True, marks=pytest.mark.soak) for p, n in ((2, 13), (3, 22)))])
def test_hf_eager_attention_on_left_padding_equals_eager_on_every_row(pools, world, n, pad):
    """transformers' eager mask adds finfo.min: a left-padded row has every key masked, and eager's
    softmax gives it the mean of the values (Note [Rows with no key] in runtime/ops.py). The sites
    are rewritten, and every row's logits, the loss over every position and every gradient equal
    eager's; Config(pad=True) (13 tokens padded to 16, 22 to 24) counts the sequence's keys only."""
    for errs, (got, want), sites in pools(world).run(case_hf_eager_left_padding, n, pad, timeout=600):
        assert got == want, (got ^ want)
        assert max(errs.values()) < 1e-5, errs
        assert sites and all(d == "rewritten" and "give the mean of the values, as eager" in detail
                             for d, detail in sites), sites


class _DropoutAttribute(torch.nn.Module):
    """Attention whose dropout probability is a float attribute read in training, as Hugging Face
    attention reads `self.attention_dropout` (a symbolic float input under dynamic=True)."""

    def __init__(self):
        super().__init__()
        self.embed, self.qkv = torch.nn.Embedding(50, 16), torch.nn.Linear(16, 48)
        self.head = torch.nn.Linear(16, 50)
        self.attention_dropout = 0.0

    def forward(self, ids, labels):
        b, n = ids.shape
        q, k, v = self.qkv(self.embed(ids)).view(b, n, 3, 2, 8).permute(2, 0, 3, 1, 4).unbind(0)
        dropout = self.attention_dropout if self.training else 0.0
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True)
        logits = self.head(a.transpose(1, 2).reshape(b, n, 16))
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


def case_dynamic_float_dropout(rank, world):
    import warnings

    torch.manual_seed(0)
    ref = _DropoutAttribute()
    model = _DropoutAttribute()
    model.load_state_dict(ref.state_dict())
    compiled = torch.compile(model, backend=ringcc.backend(inner="aot_eager"), dynamic=True)
    ids, labels = torch.randint(0, 50, (2, 12)), torch.randint(0, 50, (2, 12))
    ringcc.reset_reports()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss = compiled(ids, labels)
    _assert_same_loss_and_grads(loss, ref(ids, labels), model, ref)
    with_grad = {n for n, p in model.named_parameters() if p.grad is not None}
    torch._dynamo.reset()
    return ([(len(r.rewritten), len(r.sites)) for r in ringcc.reports()],
            [str(w.message) for w in caught if "ringcc" in str(w.message)], with_grad)


def test_dynamic_float_dropout_reports_only_the_graph_that_runs(pools):
    """dynamic=True makes a float attribute (the dropout probability) a graph input; AOT autograd
    specialises it and dynamo traces again. The graph dropped is neither reported nor warned about
    (its site would read 'left dense'); the one that runs rings its site."""
    for reports, messages, with_grad in pools(2).run(case_dynamic_float_dropout, timeout=300):
        assert reports == [(1, 1)], reports
        assert messages == [], messages
        assert with_grad == {"embed.weight", "qkv.weight", "qkv.bias", "head.weight", "head.bias"}


def _grad_errors(model, ref) -> tuple[float, bool]:
    """(max gradient error relative to each eager gradient, floored at 1e-3; whether the same
    parameters got a gradient)."""
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    got = {n.replace("_orig_mod.", "").replace("module.", ""): p.grad for n, p in model.named_parameters()}
    same = {n for n, g in got.items() if g is not None} == {n for n, g in ref_grads.items() if g is not None}
    errs = [float((g - ref_grads[n]).abs().max() / ref_grads[n].abs().max().clamp_min(1e-3))
            for n, g in got.items() if g is not None and ref_grads.get(n) is not None]
    return max(errs), same


def case_training_setups(rank, world, setup):
    """HF Llama in its default config (use_cache=True in training) against eager: two micro-batches
    accumulated (loss / 2), under DDP wrapped around the compiled model or compiled around DDP, the
    first micro-batch in no_sync(); model.compile(); an AdamW step and a second step; then eval
    under inference_mode. Returns (loss errors, gradient errors, same parameters with a gradient,
    eval logits error)."""
    import contextlib

    from torch.nn.parallel import DistributedDataParallel

    from zoo import _llama_like

    torch.manual_seed(0)
    ref = _llama_like("LlamaConfig")()
    torch.manual_seed(0)
    model = _llama_like("LlamaConfig")()
    backend = ringcc.backend(inner="aot_eager")
    if setup == "ddp_outside":
        step = DistributedDataParallel(torch.compile(model, backend=backend))
    elif setup == "ddp_inside":
        step = torch.compile(DistributedDataParallel(model), backend=backend)
    else:
        model.compile(backend=backend)
        step = model
    opt, ref_opt = torch.optim.AdamW(model.parameters(), lr=1e-2), torch.optim.AdamW(ref.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, 64, (2, 24), generator=gen), torch.randint(0, 64, (2, 24), generator=gen))
               for _ in range(3)]
    loss_errs, grad_errs, same = [], [], []
    for micro in ([batches[0], batches[1]], [batches[2]]):  # step 1 accumulates two micro-batches
        opt.zero_grad()
        ref_opt.zero_grad()
        for i, (ids, labels) in enumerate(micro):
            sync = step.no_sync() if setup != "module" and i < len(micro) - 1 else contextlib.nullcontext()
            with sync:
                loss = step(input_ids=ids, labels=labels).loss / len(micro)
                loss.backward()
            ref_loss = ref(input_ids=ids, labels=labels).loss / len(micro)
            ref_loss.backward()
            loss_errs.append(float((loss - ref_loss).abs()))
        err, ok = _grad_errors(model, ref)
        grad_errs.append(err)
        same.append(ok)
        opt.step()
        ref_opt.step()
    model.eval()
    ref.eval()
    with torch.inference_mode():
        logits_err = float((step(input_ids=batches[0][0]).logits - ref(input_ids=batches[0][0]).logits).abs().max())
    rewritten = [(len(r.rewritten), len(r.sites)) for r in ringcc.reports()]
    torch._dynamo.reset()
    return loss_errs, grad_errs, same, logits_err, rewritten


@pytest.mark.soak
@pytest.mark.parametrize("setup", ["ddp_outside", "ddp_inside", "module"])
def test_training_setups_match_eager(pools, setup):
    ringcc.reset_reports()
    for loss_errs, grad_errs, same, logits_err, rewritten in pools(2).run(case_training_setups, setup, timeout=600):
        assert max(loss_errs) < 1e-5, loss_errs
        # the second step follows AdamW's first update (which scales each entry's rounding by 1 / sqrt(v))
        assert grad_errs[0] < 1e-5 and grad_errs[1] < 5e-4, grad_errs
        assert all(same)
        assert logits_err < 1e-5
        assert rewritten and all(r == s > 0 for r, s in rewritten), rewritten


def case_generate(rank, world):
    """A training step, then `generate(max_new_tokens=4)` with the default KV cache from the same
    model.compile()d HF Llama: the prefill is rewritten, every decoding graph says it runs dense."""
    from zoo import _llama_like

    torch.manual_seed(0)
    ref = _llama_like("LlamaConfig")()
    torch.manual_seed(0)
    model = _llama_like("LlamaConfig")()
    model.compile(backend=ringcc.backend(inner="aot_eager"))
    gen = torch.Generator().manual_seed(1)
    ids, labels = torch.randint(0, 64, (2, 24), generator=gen), torch.randint(0, 64, (2, 24), generator=gen)
    ringcc.reset_reports()
    loss, ref_loss = model(input_ids=ids, labels=labels).loss, ref(input_ids=ids, labels=labels).loss
    loss.backward()
    ref_loss.backward()
    grad_err, same = _grad_errors(model, ref)
    model.eval()
    ref.eval()
    prompt = torch.randint(0, 64, (2, 24), generator=gen)
    with torch.no_grad():
        tokens = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=4, do_sample=False)
        ref_tokens = ref.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=4, do_sample=False)
    sites = [(s.decision.value, s.detail) for r in ringcc.reports() for s in r.sites]
    torch._dynamo.reset()
    return float((loss - ref_loss).abs()), grad_err, same, torch.equal(tokens, ref_tokens), sites


@pytest.mark.soak
def test_generate_with_a_cache_after_training(pools):
    for loss_err, grad_err, same, equal, sites in pools(2).run(case_generate, timeout=600):
        assert loss_err < 1e-5 and grad_err < 1e-5 and same
        assert equal
        rewritten = [d for d, _ in sites if d == "rewritten"]
        dense = [detail for d, detail in sites if d != "rewritten"]
        assert len(rewritten) >= 4  # training and the prompt's prefill, two layers each
        assert dense and all("decoding runs dense on every rank" in detail for detail in dense), dense
