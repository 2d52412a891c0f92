"""Misuse and faults: never a silently wrong result, never one rank raising while the others
wait (tier 3 where ranks are involved, on the shared gloo pools)."""

import datetime
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import ringcc
from ringcc import reference


def _qkv(b=1, h=2, g=2, s=8, d=4, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, s, d, generator=gen)
    k, v = (torch.randn(b, g, s, d, generator=gen) for _ in range(2))
    return q, k, v


# -- launched with p > 1 but no process group -------------------------------------------------


@pytest.mark.parametrize("call", [
    lambda q, k, v: ringcc.ring_attention(q, k, v),
    lambda q, k, v: ringcc.dilated_attention(q, k, v, ringcc.DilatedSpec([4], [1])),
    lambda q, k, v: ringcc.shard_sequence(q, 2),
    lambda q, k, v: ringcc.gather_sequence(q, 2),
])
def test_launcher_world_without_process_group_is_an_error(monkeypatch, call):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(ValueError, match=r"one of 2 ranks \(WORLD_SIZE=2, RANK=1\), but no process group is "
                       r"initialised.*init_process_group\(\).*or unset WORLD_SIZE"):
        call(*_qkv())
    monkeypatch.setenv("WORLD_SIZE", "1")  # a one-process launch is p = 1
    call(*_qkv())


def test_launcher_world_without_process_group_fails_the_compile(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    torch._dynamo.reset()
    model = nn.Linear(4, 4)

    def f(x):
        q = model(x).unsqueeze(1)
        return F.scaled_dot_product_attention(q, q, q)

    compiled = torch.compile(f, backend=ringcc.backend(inner="eager"))
    with pytest.raises(Exception, match=r"torch.compile\(backend='ringcc'\): the environment says this process is "
                       r"one of 2 ranks.*Config\(world_size=1\)"):
        compiled(torch.randn(2, 8, 4))
    torch._dynamo.reset()


# -- NaN propagation ----------------------------------------------------------------------------


def case_nan_row(rank, world, is_causal, layout):
    """A NaN in one query row: that row of the output is NaN, as the dense reference (and
    eager SDPA's math path) gives; every other row is exact. (Eager SDPA's fused CPU kernel
    depends on the processor here: on AVX512 machines it returns that row finite.)"""
    q, k, v = _qkv(b=2, h=2, g=1, s=8, d=4)
    q[1, 0, 3, 1] = float("nan")  # (the CPU kernel alone gives this row out = 0, lse = 0)
    ref, ref_lse = reference.attention(q, k, v, is_causal=is_causal)
    with sdpa_kernel(SDPBackend.MATH):
        eager = F.scaled_dot_product_attention(q, k.expand(-1, 2, -1, -1), v.expand(-1, 2, -1, -1),
                                               is_causal=is_causal)
    shard = lambda t: ringcc.shard_sequence(t, 2, layout=layout)  # noqa: E731
    out, lse = ringcc.ring_attention(shard(q), shard(k), shard(v), is_causal=is_causal, layout=layout, return_lse=True)
    out = ringcc.gather_sequence(out, 2, layout=layout)
    lse = ringcc.gather_sequence(lse.unsqueeze(-1), 2, layout=layout)[..., 0]
    return out, lse, ref, ref_lse, eager


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("is_causal,layout", [(False, "contiguous"), (True, "zigzag")])
def test_nan_in_a_query_row_comes_out_as_nan(pools, world, is_causal, layout):
    if world == 1:
        out, lse, ref, ref_lse, eager = case_nan_row(0, 1, is_causal, layout)
    else:
        out, lse, ref, ref_lse, eager = pools(world).run(case_nan_row, is_causal, layout)[0]
    assert eager.isnan().any()
    assert torch.equal(out.isnan(), eager.isnan()) and torch.equal(out.isnan(), ref.isnan())
    assert torch.equal(lse.isnan(), ref_lse.isnan())
    torch.testing.assert_close(out.nan_to_num(), ref.nan_to_num(), atol=1e-5, rtol=1e-5)


# -- an input error on one rank only --------------------------------------------------------------


def case_bad_inputs_on_one_rank(rank, world, op):
    """Rank 1 passes a wrong key mask (or a non-tensor q): every rank raises, in bounded time,
    and the group serves the next call."""
    group = dist.new_group(list(range(world)), timeout=datetime.timedelta(seconds=20), backend="gloo")
    q, k, v = _qkv()
    spec = ringcc.DilatedSpec([16], [1])
    call = {"ring": lambda q, kpm: ringcc.ring_attention(q, k, v, key_padding_mask=kpm, group=group),
            "dilated": lambda q, kpm: ringcc.dilated_attention(q, k, v, spec, group=group)}[op]
    bad_q = q if op == "ring" else q.long()
    bad_kpm = torch.zeros(1, 8) if op == "ring" else None  # a float mask where a bool one belongs
    t0 = time.monotonic()
    try:
        call(bad_q if rank == 1 else q, bad_kpm if rank == 1 else None)
        outcome = "no error"
    except ValueError as e:
        outcome = str(e)
    seconds = time.monotonic() - t0
    out = call(q, None)  # the group still works
    return outcome, seconds, tuple(out.shape)


@pytest.mark.parametrize("op", ["ring", "dilated"])
def test_bad_inputs_on_one_rank_raise_on_every_rank(pools, op):
    (m0, t0, shape0), (m1, t1, shape1) = pools(2).run(case_bad_inputs_on_one_rank, op)
    assert m0.startswith("another rank's inputs to this attention call were rejected"), m0
    assert ("key_padding_mask must be a bool tensor" if op == "ring" else "takes float16, bfloat16") in m1, m1
    assert t0 < 15 and t1 < 15, (t0, t1)  # the group timeout is 20 s
    assert shape0 == shape1 == (1, 2, 8, 4)


# -- a batch (or feature) dim equal to the sequence length ---------------------------------------


class CausalLayer(nn.Module):
    """(embedding +) one causal SDPA layer; no position input that would carry the sequence."""

    def __init__(self, tokens: bool):
        super().__init__()
        self.emb = nn.Embedding(50, 32) if tokens else None
        self.qkv, self.out = nn.Linear(32, 96), nn.Linear(32, 32)

    def forward(self, x):
        h = self.emb(x) if self.emb is not None else x
        b, n, _ = h.shape
        q, k, v = self.qkv(h).view(b, n, 3, 4, 8).permute(2, 0, 3, 1, 4)
        return self.out(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, n, 32))


def case_ties(rank, world):
    errors = []
    for shape, pad in (((8, 8), False), ((2, 2), True), ((16, 16, 32), False)):
        torch.manual_seed(0)
        model = CausalLayer(tokens=len(shape) == 2)
        x = torch.randint(0, 50, shape) if len(shape) == 2 else torch.randn(shape)
        torch._dynamo.reset()
        ringcc.reset_reports()
        got = torch.compile(model, backend=ringcc.backend(inner="eager", pad=pad))(x)
        notes = ringcc.reports()[0].notes
        errors.append((shape, float((got - model(x)).abs().max()), any("dim 1 is the sequence" in m for m in notes)))
    return errors


@pytest.mark.soak  # make test traces the same model to its sites (test_shard_sequence)
def test_batch_equal_to_length_is_exact(pools):
    for rank_errors in pools(2).run(case_ties, timeout=300):
        for shape, err, traced in rank_errors:
            assert err < 1e-5 and traced, (shape, err)


class SymmetricMix(nn.Module):
    """Mixes an [n, n, d] input with its transpose: no dim of it alone is the sequence."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(32, 96)

    def forward(self, x):
        h = x + x.transpose(0, 1)
        q, k, v = self.qkv(h).view(8, 8, 3, 4, 8).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v)


def test_undecidable_tie_asks_for_a_mark():
    torch._dynamo.reset()
    compiled = torch.compile(SymmetricMix(), backend=ringcc.backend(ringcc.Config(world_size=2, inner="eager")))
    with pytest.raises(Exception, match=r"input l_x_ \(8, 8, 32\) has several dims of size n=8 \(\[0, 1\]\) and feeds "
                       r"the attention sites, and ringcc cannot tell which one is the sequence \(its dim 0 reaches "
                       r".*\). Say which: ringcc.mark_sequence\(x, dim\) .* or Config\(seq_dim=...\)"):
        compiled(torch.randn(8, 8, 32))
    torch._dynamo.reset()


# -- different sequence lengths on different ranks in a compiled model ----------------------------


def case_compiled_lengths(rank, world, first_common):
    torch._dynamo.reset()
    torch.manual_seed(0)
    compiled = torch.compile(CausalLayer(tokens=True), backend=ringcc.backend(inner="eager"), dynamic=False)
    if first_common:
        compiled(torch.randint(0, 50, (3, 8)))  # a common first step
    t0 = time.monotonic()
    try:
        compiled(torch.randint(0, 50, (3, 8 if rank == 0 else 12)))
        outcome = "no error"
    except ValueError as e:
        outcome = str(e)
    seconds = time.monotonic() - t0
    ok = compiled(torch.randint(0, 50, (3, 8), generator=torch.Generator().manual_seed(1))).shape  # go on together
    return outcome, seconds, tuple(ok)


@pytest.mark.parametrize("first_common", [False, True])
def test_different_lengths_on_ranks_raise_on_every_rank(pools, first_common):
    for outcome, seconds, shape in pools(2).run(case_compiled_lengths, first_common, timeout=300):
        assert "ranks called" in outcome and "with inputs of different shapes" in outcome, outcome
        assert seconds < 60 and shape == (3, 8, 32)


# -- ranks of a sequence group fed different batches ----------------------------------------------


def _tiny_llama():
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(cfg).train()


def _grads(model) -> dict:
    return {name: p.grad for name, p in model.named_parameters()}


def case_batches(rank, world, mesh_dims=None, check_inputs="every_call", same_first=True):
    """A tiny HF Llama compiled with ringcc, as a torchrun script runs it. `same_first`: a step
    with the same batch on every rank of the sequence group (under a (dp, cp) mesh: the dp
    rank's batch, a sampler over dp only), compared with eager (the loss, every gradient and
    which parameters have one); then a step where each rank draws its own batch, as a
    DistributedSampler over every rank gives it. (errors, same gradient set, outcome of the
    per-rank step, its seconds)."""
    torch._dynamo.reset()
    ref, model = _tiny_llama(), _tiny_llama()
    if mesh_dims is not None:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", mesh_dims, mesh_dim_names=("dp", "cp"))
        config = ringcc.Config(mesh=mesh, axis="cp", inner="eager", check_inputs=check_inputs)
        stream = mesh["dp"].get_local_rank()
    else:
        config = ringcc.Config(inner="eager", check_inputs=check_inputs)
        stream = 0
    compiled = torch.compile(model, backend=ringcc.backend(config))
    errs, same_set = {}, None
    if same_first:
        ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(100 + stream))
        loss = compiled(input_ids=ids, labels=ids).loss
        loss.backward()
        ref_loss = ref(input_ids=ids, labels=ids).loss
        ref_loss.backward()
        errs["loss"] = float((loss - ref_loss).abs() / ref_loss.abs())
        mine, theirs = _grads(model), _grads(ref)
        largest = max(float(g.abs().max()) for g in theirs.values() if g is not None)
        for name, g in theirs.items():
            if g is not None and mine[name] is not None:
                errs[name] = float((mine[name] - g).abs().max() / max(float(g.abs().max()), 1e-3 * largest))
        same_set = {n for n, g in mine.items() if g is None} == {n for n, g in theirs.items() if g is None}
    if mesh_dims is not None:
        return errs, same_set, None, 0.0
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(200 + rank))
    t0 = time.monotonic()
    try:
        compiled(input_ids=ids, labels=ids)
        outcome = "no error"
    except ValueError as e:
        outcome = str(e)
    return errs, same_set, outcome, time.monotonic() - t0


def _check_batches(results, same_first=True):
    for rank, (errs, same_set, outcome, seconds) in enumerate(results):
        if same_first:
            worst = max(errs.items(), key=lambda kv: kv[1])
            assert worst[1] < 1e-5 and same_set, (rank, worst, same_set)
        if outcome is not None:
            assert "called" in outcome and "with different data" in outcome, (rank, outcome)
            assert "same batch" in outcome and "num_replicas=mesh['dp'].size()" in outcome, outcome
            assert seconds < 120, seconds


def test_same_batch_matches_eager_and_different_batches_raise_on_every_rank(pools):
    """The same batch on both ranks: eager's loss and gradients. Then each rank its own batch (what
    a DistributedSampler, HF Trainer or accelerate gives each rank by default): an error on every
    rank that names the fix, in bounded time (never rank 0's tokens joined to rank 1's)."""
    _check_batches(pools(2).run(case_batches, timeout=300))


@pytest.mark.soak
def test_different_batches_at_the_first_call_raise_under_first_call_checks(pools):
    _check_batches(pools(2).run(case_batches, None, "first_call", False, timeout=300), same_first=False)


@pytest.mark.soak
def test_a_sampler_over_dp_only_matches_eager_on_a_mesh(pools):
    """dp x cp = 2 x 2: the two dp groups hold different batches, each cp pair the same one (the
    check compares within the sequence group only)."""
    _check_batches(pools(4).run(case_batches, (2, 2), timeout=600))


def case_functional_batches(rank, world):
    """ringcc.shard_sequence of a full input drawn per rank: an error on every rank; the same
    input: this rank's rows."""
    same = torch.randn(2, 8, 4, generator=torch.Generator().manual_seed(0))
    mine = torch.randn(2, 8, 4, generator=torch.Generator().manual_seed(rank))
    try:
        ringcc.shard_sequence(mine, 1)
        outcome = "no error"
    except ValueError as e:
        outcome = str(e)
    return outcome, tuple(ringcc.shard_sequence(same, 1).shape)


def test_functional_shard_of_different_inputs_raises_on_every_rank(pools):
    for rank, (outcome, shape) in enumerate(pools(2).run(case_functional_batches, timeout=120)):
        assert "shard_sequence full inputs of different values" in outcome and "same batch" in outcome, outcome
        assert shape == (2, 4, 4), rank


def case_check_cost(rank, world):
    """Per call of a compiled graph on CUDA: the time of the input check (the data's checksum,
    the shapes' code, one all-reduce and host sync), alone and as the slowdown of a GPU-bound
    loop that runs it between steps (the sync drains the queue, then the host launches anew).
    Inputs as a 32K-token step sees them: ids and labels [1, 32768] int64, and a block's
    [1, 32768, 4096] bf16 hidden states (an eager embedding's output, per-block compile)."""
    from ringcc.backend import check_same_inputs

    dev = torch.device("cuda", rank)
    torch.cuda.set_device(dev)
    ids = torch.randint(0, 32000, (1, 32768), device=dev)
    hidden = torch.randn(1, 32768, 4096, device=dev, dtype=torch.bfloat16)
    a = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)
    out = {}
    for name, inputs in (("ids", [ids, ids.clone()]), ("ids+hidden", [ids, ids.clone(), hidden])):
        data = tuple(range(len(inputs)))
        for _ in range(5):
            check_same_inputs(inputs, None, "graph", data)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(50):
            check_same_inputs(inputs, None, "graph", data)
        out[f"{name}: check alone (us)"] = (time.perf_counter() - t0) / 50 * 1e6

        def loop(check: bool, steps=30) -> float:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(steps):
                if check:
                    check_same_inputs(inputs, None, "graph", data)
                x = hidden[0, :4096]
                for _ in range(20):  # ~ a few ms of queued GPU work per step
                    x = (x @ a).tanh()
            torch.cuda.synchronize()
            return (time.perf_counter() - t0) / steps * 1e6

        loop(True, 3)
        base, checked = min(loop(False) for _ in range(3)), min(loop(True) for _ in range(3))
        out[f"{name}: step without check (us)"] = base
        out[f"{name}: added per step (us)"] = checked - base
    return out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_input_check_cost_on_one_gpu(pools):
    """The measured cost of Config(check_inputs="every_call") on CUDA (printed; run with -s)."""
    (out,) = pools(1, "nccl").run(case_check_cost, timeout=600)
    for key, value in out.items():
        print(f"{key}: {value:.1f}")
    assert out["ids: check alone (us)"] < 2000 and out["ids+hidden: check alone (us)"] < 5000, out
