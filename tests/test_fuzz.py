"""Differential fuzzing: random small programs (tests/fuzz_programs.py) compiled with ringcc on
gloo ranks, against eager on every rank.

A program passes when, on every rank, the returned value, what eager code reads from it and
every gradient (parameters and the input) equal eager's and the same parameters get a
gradient; or when every rank stops with a ringcc ValueError/RuntimeError that names one of
the program's ops. Anything else fails: a wrong value, a missing or extra gradient, an
internal error, ranks that disagree, a hang (the pool's timeout).

make test runs a few programs at p = 2 (fixed examples) and one regression case of each
failure class; the soak tier draws many more programs at p = 1..4 (FUZZ_EXAMPLES sets how
many) and runs the other regression cases. Each failure found becomes a named regression test
below, with its minimal program.
"""

import os

import pytest
from hypothesis import HealthCheck, Phase, assume, given, settings
from hypothesis import strategies as st

import fuzz_programs as fp

TIMEOUT = 240.0  # seconds per program on every rank (compiles on 2 shared cores)


def verdict(prog: dict, results: list[dict]) -> str | None:
    """None if the program passes (see the module docstring), else why it fails."""
    kinds = {r["kind"] for r in results}
    if kinds == {"exact"}:
        return None
    if kinds == {"invalid"}:
        return "invalid"
    if kinds == {"error"}:
        names = fp.names_of(prog)
        bad = [(rank, r) for rank, r in enumerate(results)
               if not (r["ringcc"] and any(name in r["msg"] for name in names))]
        if not bad:
            return None
        rank, r = bad[0]
        return (f"rank {rank} raised {r['type']} that is not a ringcc error naming one of {sorted(names)}: "
                f"{r['msg'][:1500]}\n{r['where']}")
    lines = []
    for rank, r in enumerate(results):
        if r["kind"] == "mismatch":
            lines.append(f"rank {rank}: differs from eager: {r['errors']}; gradients: {r['missing']}; "
                         f"gathers: {r['report']}")
        elif r["kind"] == "error":
            lines.append(f"rank {rank}: {r['type']}: {r['msg'][:1500]}\n{r['where']}")
        else:
            lines.append(f"rank {rank}: {r['kind']}")
    return "\n".join(lines)


def run_program(pools, prog: dict) -> str | None:
    try:
        results = pools(prog["world"]).run(fp.run_case, prog, timeout=TIMEOUT)
    except TimeoutError as e:
        return f"hang: {e}"
    except RuntimeError as e:  # a rank died outside run_case's own handling
        return f"crash: {e}"
    return verdict(prog, results)


def check(pools, prog: dict) -> None:
    why = run_program(pools, prog)
    assert why is None, f"program {prog!r}\n{why}"


def _fuzz(pools, prog):
    why = run_program(pools, prog)
    assume(why != "invalid")
    assert why is None, f"program {prog!r}\n{why}"


def test_verdict_classes():
    """Exact on every rank, or a ringcc error naming an op on every rank, passes; a wrong value, an
    error that names no op of the program or is not ringcc's, and ranks that disagree fail."""
    prog = {"ops": [["scatter", {}]]}
    exact, named = {"kind": "exact"}, {"kind": "error", "type": "ValueError", "ringcc": True, "where": "",
                                       "msg": "ringcc cannot run scatter_ on a sharded tuple"}
    assert verdict(prog, [exact, exact]) is None
    assert verdict(prog, [named, named]) is None
    assert verdict(prog, [{"kind": "invalid"}] * 2) == "invalid"
    assert "differs" in verdict(prog, [{"kind": "mismatch", "errors": {"grad x": 0.3}, "missing": [], "report": []},
                                       exact])
    assert "not a ringcc error" in verdict(prog, [dict(named, msg="view size is not compatible")] * 2)
    assert "not a ringcc error" in verdict(prog, [dict(named, ringcc=False)] * 2)
    assert verdict(prog, [named, exact]) is not None


# -- fast tier: fixed examples at p = 2 -------------------------------------------------------

@settings(max_examples=3, derandomize=True, deadline=None, database=None, phases=[Phase.generate],
          suppress_health_check=list(HealthCheck))
@given(prog=fp.programs(st, worlds=(2,), max_ops=3, pad=False))
def test_fuzz_fast(pools, prog):
    _fuzz(pools, prog)


# -- soak tier: many programs at p = 1..4, shrunk on failure -----------------------------------

@pytest.mark.soak
@settings(max_examples=int(os.environ.get("FUZZ_EXAMPLES", "60")), deadline=None, database=None,
          suppress_health_check=list(HealthCheck))
@given(prog=fp.programs(st, worlds=(1, 2, 3, 4), max_ops=5))
def test_fuzz_soak(pools, prog):
    _fuzz(pools, prog)


# -- regression tests: the minimal programs of the failures the fuzzer found -------------------

def _prog(ops, n=8, d=8, b=2, world=2, out="h", tail="all", x_grad=True, pad=False, seed=10):
    return {"seed": seed, "b": b, "n": n, "d": d, "world": world, "pad": pad, "ops": ops, "out": out, "tail": tail,
            "x_grad": x_grad}


@pytest.mark.parametrize("kind", ["slice", pytest.param("narrow", marks=pytest.mark.soak)])
def test_one_token_of_a_shard_broadcasts_over_the_sequence(pools, kind):
    """h * tanh(h[:, 1:2]) on a shard: the one token is selected, not a window of the shard's
    rows multiplied row by row (Note [One-token windows])."""
    check(pools, _prog([["linear", {}], ["select_token", {"index": 1, "kind": kind}]], n=4, d=12))


def test_token_shift_pads_with_one_token(pools):
    """RWKV's token shift, torch.cat([zeros_like(h[:, :1]), h[:, :-1]], 1), on a shard."""
    check(pools, _prog([["mlp", {"norm": False}], ["shift", {"kind": "cat"}]], d=4, b=1, tail="last"))


@pytest.mark.parametrize("kind", ["iadd", *(pytest.param(k, marks=pytest.mark.soak)
                                           for k in ("view_mul_", "narrow_add_", "token_add_"))])
def test_part_of_the_sequence_written_in_place(pools, kind):
    """h[:, 2:5] += 1, h[:, 2:5].mul_(2), h.narrow(1, 2, 3).add_(1), h[:, 2].add_(1) on a shard
    write those tokens of h only (Note [Windows written in place])."""
    check(pools, _prog([["linear", {}], ["set_slice", {"lo": 2, "hi": 5, "kind": kind, "clone": False}]]))


def case_token_shift_lm(rank, world):
    """A user's small LM: token and position embeddings, head and loss in eager code, and blocks
    with RWKV's token shift (each token mixed with the one before it, zeros before the first)
    followed by causal SDPA and an MLP, each block compiled on its own with ringcc. The loss and
    every gradient equal eager's, and the same parameters get one."""
    import copy

    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    import ringcc

    class Block(nn.Module):
        def __init__(self, d, heads):
            super().__init__()
            self.heads = heads
            self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.mix = nn.Parameter(torch.rand(d))
            self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
            self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

        def forward(self, x):
            b, n, d = x.shape
            h = self.ln1(x)
            prev = torch.cat([torch.zeros_like(h[:, :1]), h[:, :-1]], dim=1)
            h = h * self.mix + prev * (1 - self.mix)
            q, k, v = self.qkv(h).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4).unbind(0)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(a.transpose(1, 2).reshape(b, n, d))
            return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))

    class LM(nn.Module):
        def __init__(self, vocab=50, d=32, heads=4, layers=2, max_len=64):
            super().__init__()
            self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(max_len, d)
            self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
            self.ln_f, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

        def forward(self, ids, labels):
            x = self.tok(ids) + self.pos(torch.arange(ids.shape[1]))
            for block in self.blocks:
                x = block(x)
            logits = self.head(self.ln_f(x))
            return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))

    torch.manual_seed(0)
    ref = LM()
    model = copy.deepcopy(ref)
    for block in model.blocks:
        block.compile(backend=ringcc.backend(ringcc.Config(inner="aot_eager")))
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 50, (2, 8 * world), generator=g)
    labels = torch.randint(0, 50, (2, 8 * world), generator=g)
    torch._dynamo.reset()
    loss, want = model(ids, labels), ref(ids, labels)
    loss.backward()
    want.backward()
    torch.testing.assert_close(loss, want, atol=1e-5, rtol=1e-5)
    grads = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        assert (p.grad is None) == (grads[name].grad is None), name
        torch.testing.assert_close(p.grad, grads[name].grad, atol=1e-5, rtol=1e-4, msg=name)
    return True


@pytest.mark.soak  # two blocks compiled at p = 2: about a minute on 2 cores
def test_token_shift_lm_with_blocks_compiled(pools):
    assert all(pools(2).run(case_token_shift_lm, timeout=TIMEOUT))


def test_a_narrowed_window_is_what_later_ops_read(pools):
    """h + h.narrow(1, 1, n - 1).mean(1): the mean is over the window, not over every row of the
    shard (the narrow keeps the rows and its readers read its window)."""
    check(pools, _prog([["linear", {}], ["window", {"kind": "narrow_mean"}]], n=8, d=4))


def test_a_padded_output_read_after_a_graph_break_keeps_its_length(pools):
    """Config(pad=True), n = 3 at p = 2: the graph after a break reads the first one's padded
    output (its gather narrows it to the window) and returns it, still 3 tokens long."""
    check(pools, _prog([["act", {"kind": "gelu"}], ["act", {"kind": "gelu"}], ["graph_break", {}]], n=3, d=4, b=1,
                       x_grad=False, pad=True, seed=0))


@pytest.mark.parametrize("kind", ["full_max", "cumsum_last"])
def test_a_statistic_every_rank_computes_whole_gets_every_ranks_cotangent(pools, kind):
    """h * h.amax(1) (no sharding rule: amax runs on the gathered value), and one token of a
    gathered cumsum, multiplied into the shard: each rank's cotangent of the replicated statistic
    is its own tokens' share, all-reduced before it reaches the gather (n = d, so the statistic's
    feature dim has the sequence's size)."""
    check(pools, _prog([["linear", {}], ["window", {"kind": kind}]], n=8, d=8))


def test_a_shard_made_under_no_grad_is_not_reused_with_grad(pools):
    """A statistic under torch.no_grad() reads the shard of a replicated value first (the
    scatter along the sequence runs whole); the value's later reader with grad needs a shard that
    carries the gradient (p = 1 too: the shard op is there at every p)."""
    for world in (1, 2):
        check(pools, _prog([["scatter", {"dim": "seq", "kind": "scatter", "index": "perm"}],
                            ["detach", {"kind": "no_grad_seq"}]], n=2 * world, d=4, b=1, world=world, seed=0))


def test_feature_dim_equal_to_the_length_meets_a_shard(pools):
    """n = d = p = 4: a statistic over the sequence ([b, d], whose feature dim has n's size)
    broadcast back onto h; an elementwise op slices every operand along the shard's dim."""
    check(pools, _prog([["seq_reduce", {"kind": "std", "keepdim": False}], ["view_flat", {"kind": "view"}]],
                       n=4, d=4, world=4, x_grad=False, seed=233))
