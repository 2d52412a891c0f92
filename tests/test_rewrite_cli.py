"""`ringcc rewrite`: exit codes, the files it writes, and the saved program loaded in fresh
processes (p = 2, gloo) against the eager model (loss and gradients) and, for dilation,
against the same rewrite at p = 1."""

from __future__ import annotations

import json
import os
import textwrap

import pytest
import torch

import ringcc
from ringcc import cli
from ringcc import rewrite as rw
from ringcc.planner_cli import load_factory

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PLAN_MODEL = os.path.join(ROOT, "examples", "plan_model.py")
TOL = dict(atol=2e-5, rtol=2e-5)


def case_program(rank, world, path, factory_name, lengths):
    """Load the program in this (fresh) process, run it on the full inputs at each length, and
    compare loss and parameter gradients with the eager model of the same factory."""
    import ringcc  # noqa: F401 - registers the ringcc ops the program calls

    factory = load_factory(f"{PLAN_MODEL}:{factory_name}")
    program = torch.export.load(path).module()
    errs = []
    for n in lengths:
        model, inputs = factory(seq_len=n)[:2]
        program.load_state_dict(model.state_dict())  # sharing the weights makes the gradient check exact
        program.zero_grad()
        ref = model(*inputs)
        ref.backward()
        got = program(*inputs)
        got.backward()
        torch.testing.assert_close(got, ref, **TOL)
        grads = dict(program.named_parameters())
        for name, p in model.named_parameters():
            torch.testing.assert_close(grads[name].grad, p.grad, **TOL, msg=f"grad of {name} at n={n}")
        errs.append(float((got - ref).abs()))
    return errs


def case_outputs(rank, world, path, inputs):
    import ringcc  # noqa: F401

    return torch.export.load(path).module()(*inputs).detach()


def _rewrite(tmp_path, *args) -> tuple[int, str]:
    out = str(tmp_path / "out")
    return cli.main(["rewrite", *args, "-o", out]), out


@pytest.mark.soak  # examples/offline_rewrite.py's parity at p = 2 runs in make test (test_examples.py)
def test_static_program_matches_eager_at_p2(pools, tmp_path, capsys):
    code, out = _rewrite(tmp_path, f"{PLAN_MODEL}:exact_ring", "--seq-len", "40", "--world-size", "2")
    assert code == rw.EXIT_OK
    assert sorted(os.listdir(out)) == ["plan.json", "plan.txt", "program.pt2", "program.py", "report.json", "report.txt"]
    report = json.load(open(os.path.join(out, "report.json")))
    assert report["world_size"] == 2
    assert [s["decision"] for s in report["sites"]] == ["rewritten", "rewritten"]
    assert report["gathers"] == []  # the loss is reduced on shards (all-reduce), not gathered
    code_text = open(os.path.join(out, "program.py")).read()
    assert code_text.count("torch.ops.ringcc.ring_attention.default") == 2
    assert "torch.ops.ringcc.shard.default" in code_text
    # the group travels as "" (WORLD at run time), never a process-local name
    assert "ring_attention.default(" in code_text and ", '', 2, 'zigzag')" in code_text
    assert "peak" in open(os.path.join(out, "plan.txt")).read()
    assert "2/2 attention sites rewritten" in capsys.readouterr().out
    errs = pools(2).run(case_program, os.path.join(out, "program.pt2"), "exact_ring", [40])
    assert max(max(e) for e in errs) < 1e-4


def test_contiguous_view_after_attention_matches_eager_at_p2(pools, tmp_path):
    """`y.transpose(1, 2).contiguous().view(...)` after attention: export leaves the no-op
    `.contiguous()` out, so the ring op's output takes SDPA's memory layout
    (rewrite_attention._same_layout); before, the re-export failed with a view error."""
    code, out = _rewrite(tmp_path, f"{PLAN_MODEL}:contiguous_view", "--seq-len", "24", "--world-size", "2")
    assert code == rw.EXIT_OK
    errs = pools(2).run(case_program, os.path.join(out, "program.pt2"), "contiguous_view", [24])
    assert max(max(e) for e in errs) < 1e-4


@pytest.mark.soak
def test_dynamic_program_serves_several_lengths(pools, tmp_path):
    code, out = _rewrite(tmp_path, f"{PLAN_MODEL}:exact_ring", "--seq-len", "32", "--dynamic-seq")
    assert code == rw.EXIT_OK
    plan = json.load(open(os.path.join(out, "plan.json")))
    assert "n/p" in plan["peak_formula"] and plan["symbols"] == {next(iter(plan["symbols"])): "n"}
    # export's spellings of the embedding and the loss are sharded too: nothing is O(n) per rank
    assert plan["verdict"] is True, plan["culprits"]
    # zigzag at p = 2 divides lengths by 4: one program for 32, 48 and 72
    errs = pools(2).run(case_program, os.path.join(out, "program.pt2"), "exact_ring", [32, 48, 72])
    assert len(errs[0]) == 3


@pytest.mark.soak
def test_dilated_program_at_p2_matches_p1(pools, tmp_path):
    code, out = _rewrite(tmp_path, f"{PLAN_MODEL}:full_logits", "--seq-len", "64", "--dilation", "16,32:1,2")
    assert code == rw.EXIT_OK
    assert "ringcc.dilated_attention.default" in open(os.path.join(out, "program.py")).read()
    model, inputs = load_factory(f"{PLAN_MODEL}:full_logits")(seq_len=64)[:2]
    spec = ringcc.DilatedSpec((16, 32), (1, 2))
    single, report = rw.rewrite(model, inputs, world_size=1, options={"dilation": spec})
    assert [s.dilation for s in report.sites] == [repr(spec)] * 2
    ref = single.module()(*inputs)
    dense = model(*inputs)
    assert not torch.allclose(ref, dense, atol=1e-3)  # dilation changed the math: the check below means something
    outs = pools(2).run(case_outputs, os.path.join(out, "program.pt2"), inputs)
    for got in outs:
        torch.testing.assert_close(got, ref.detach(), **TOL)


def test_nothing_rewritten_exits_3_with_reasons(tmp_path, capsys):
    src = tmp_path / "cross.py"
    src.write_text(textwrap.dedent("""
        import torch
        import torch.nn.functional as F

        class Cross(torch.nn.Module):
            def forward(self, q, kv):
                return F.scaled_dot_product_attention(q, kv, kv)

        def make():
            return Cross(), (torch.randn(1, 2, 8, 4), torch.randn(1, 2, 12, 4))

        def no_attention():
            return torch.nn.Linear(4, 4), (torch.randn(2, 8, 4),)
    """))
    code, out = _rewrite(tmp_path, f"{src}:make")
    err = capsys.readouterr().err
    assert code == rw.EXIT_NOTHING_REWRITTEN
    assert "cross_attention" in err and "query length 8 != key length 12" in err
    assert sorted(os.listdir(out)) == ["report.json", "report.txt"]
    assert json.load(open(os.path.join(out, "report.json")))["sites"][0]["reason"] == "cross_attention"
    code, _ = _rewrite(tmp_path, f"{src}:no_attention")
    assert code == rw.EXIT_NOTHING_REWRITTEN
    assert "no attention site found" in capsys.readouterr().err


@pytest.mark.parametrize("args,message", [
    (["--dilation", "16,64:1"], "segment_lengths=(16, 64) and dilation_rates=(1,)"),
    (["--dilation", "16;64"], 'is not "w1,w2,...:r1,r2,..."'),
    (["--dilation", "16,64:1,3"], "divisible by its dilation rate"),
    (["--world-size", "0"], "--world-size must be >= 1"),
    # the exact-ring model is causal: zigzag at p = 2 needs a multiple of 4
    (["--seq-len", "42", "--world-size", "2"], "sequence length 42 is not divisible by 4"),
])
def test_bad_arguments_exit_2(tmp_path, capsys, args, message):
    code, out = _rewrite(tmp_path, f"{PLAN_MODEL}:exact_ring", *args)
    assert code == rw.EXIT_BAD_ARGS
    assert message in capsys.readouterr().err
    assert not os.path.exists(out)


@pytest.mark.parametrize("target,message", [
    (f"{PLAN_MODEL}:nope", "has no callable 'nope'"),
    ("no/such/file.py:make", "no file 'no/such/file.py'"),
    ("no_such_module_xyz:make", "No module named 'no_such_module_xyz'"),
    ("plan_model_without_colon", "must be MODULE:FACTORY"),
])
def test_factory_not_found_exits_2(tmp_path, capsys, target, message):
    code, _ = _rewrite(tmp_path, target)
    assert code == rw.EXIT_BAD_ARGS
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("command", ["rewrite", "plan"])
@pytest.mark.parametrize("args,message", [
    (["--seq-len", "0"], "argument --seq-len: must be >= 1; got 0"),
    (["--seq-len", "x"], "argument --seq-len: expected a whole number of tokens; got 'x'"),
])
def test_bad_lengths_are_argument_errors(tmp_path, capsys, command, args, message):
    argv = [command, f"{PLAN_MODEL}:exact_ring", *args] + (["-o", str(tmp_path / "o")] if command == "rewrite" else [])
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_plan_length_errors_exit_2_and_pad_plans_them(tmp_path, capsys):
    """A length p does not divide is the user's error (exit 2, no traceback, naming --pad);
    with --pad the plan is made; an output folder that does not exist fails before the work."""
    target = f"{PLAN_MODEL}:exact_ring"
    assert cli.main(["plan", target, "--seq-len", "42", "--world-size", "2"]) == 2
    err = capsys.readouterr().err
    assert "sequence length 42 is not divisible by 4" in err and "--pad" in err and "Traceback" not in err
    assert cli.main(["plan", target, "--seq-len", "42", "--world-size", "2", "--pad"]) == 0
    assert "verdict: peak memory per rank is O(n/p)" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        cli.main(["plan", target, "--seq-len", "40", "--json", str(tmp_path / "missing" / "p.json")])
    assert e.value.code == 2 and "create it first" in capsys.readouterr().err


def test_argparse_errors_exit_2(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["rewrite", f"{PLAN_MODEL}:exact_ring"])  # no -o
    assert e.value.code == 2
    assert "-o/--out" in capsys.readouterr().err


def test_empty_group_name_means_world_at_run_time(pools):
    """Offline programs carry group_name "": the ops resolve it to this process's WORLD."""
    outs = pools(2).run(case_empty_group)
    assert outs[0] == outs[1] == list(range(8))


def case_empty_group(rank, world):
    x = torch.arange(8.0).view(1, 8)
    shard = torch.ops.ringcc.shard(x, 1, "", world, "contiguous")
    assert shard.shape == (1, 8 // world)
    return torch.ops.ringcc.gather(shard, 1, "", world, "contiguous").view(-1).long().tolist()


MISUSED_FACTORIES = textwrap.dedent("""
    import torch
    import torch.nn.functional as F


    class MaskedAttention(torch.nn.Module):
        def __init__(self, vocab=100, dim=16, heads=2):
            super().__init__()
            self.heads = heads
            self.embed = torch.nn.Embedding(vocab, dim)
            self.qkv = torch.nn.Linear(dim, 3 * dim)

        def forward(self, ids, mask):
            x = self.embed(ids)
            b, s, d = x.shape
            q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).unbind(2)
            a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask)
            return a.pow(2).mean()


    def float_mask(seq_len=32):
        mask = torch.zeros(seq_len, seq_len).masked_fill(torch.ones(seq_len, seq_len, dtype=torch.bool).triu(1),
                                                         float("-inf"))
        return MaskedAttention(), (torch.randint(0, 100, (2, seq_len)), mask)


    def lists(seq_len=32):
        return MaskedAttention(), ([[1] * seq_len], [[0.0] * seq_len] * seq_len)


    def no_model(seq_len=32):
        return "model", (torch.zeros(1, seq_len),)
""")


@pytest.fixture
def misused(tmp_path):
    path = tmp_path / "misused.py"
    path.write_text(MISUSED_FACTORIES)
    return str(path)


def test_plan_of_a_float_n_by_n_mask_input_is_the_not_linear_plan(misused, capsys):
    """An [n, n] float mask input: marking the ids' dim 1 alone would specialise n (the mask's
    dims meet it); the plan is made with the mask's dims as n too: verdict False, the site
    skipped for its mask, the n**2 attention named."""
    assert cli.main(["plan", f"{misused}:float_mask", "--seq-len", "64", "--world-size", "2"]) == 0
    out, err = capsys.readouterr()
    assert "ConstraintViolation" not in err and "Traceback" not in err
    assert "skipped a at" in out and "unliftable_mask" in out and "l_mask_" in out
    assert "every dim of length 64 of the sequence inputs traced as n" in out
    assert "grows like n**2" in out and "verdict: peak memory per rank is NOT O(n/p)" in out


@pytest.mark.parametrize("command", ["plan", "rewrite"])
@pytest.mark.parametrize("factory,message", [
    ("lists", "must return example_inputs of tensors (and plain numbers), the arguments of model(*example_inputs); "
              "got 0: list, 1: list in tuple of 2"),
    ("no_model", "returned str as the model"),
    ("MaskedAttention", "is a class, not a factory; give a function that builds the model and its example inputs"),
])
def test_factory_misuse_exits_2_with_the_reason(misused, tmp_path, capsys, command, factory, message):
    argv = [command, f"{misused}:{factory}"] + (["-o", str(tmp_path / "o")] if command == "rewrite" else
                                                ["--seq-len", "32"])
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"ringcc {command}: error:") and message in err and "Traceback" not in err


@pytest.mark.parametrize("out,message", [
    ("file", "exists and is not a folder"),
    ("file/sub", "is a file; give another -o"),
])
def test_rewrite_output_folder_is_checked_before_the_export(tmp_path, capsys, monkeypatch, out, message):
    (tmp_path / "file").write_text("")
    monkeypatch.setattr(rw, "rewrite", lambda *a, **k: pytest.fail("exported before checking -o"))
    with pytest.raises(SystemExit) as e:
        cli.main(["rewrite", f"{PLAN_MODEL}:exact_ring", "-o", str(tmp_path / out)])
    assert e.value.code == 2 and message in capsys.readouterr().err


class _MultiQueryEagerAttention(torch.nn.Module):
    """Falcon's multi-query K/V (one fused projection, K and V read with a constant list index)
    into HF's eager attention (softmax, a dropout that is the identity in eval mode, P @ V)."""

    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(16, 32)

    def forward(self, x):
        fused = self.qkv(x).view(*x.shape[:2], 4, 8)
        q, k, v = fused[..., :-2, :], fused[..., [-2], :], fused[..., [-1], :]
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        scores = (q @ k.expand(-1, 2, -1, -1).transpose(-1, -2)) * 8 ** -0.5
        causal = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).tril()
        probs = torch.nn.functional.dropout(scores.masked_fill(~causal, float("-inf")).softmax(-1), 0.1, self.training)
        return (probs @ v.expand(-1, 2, -1, -1)).transpose(1, 2).flatten(2)


def test_the_program_gathers_its_output_only():
    """Export spellings the sharding rules must read: the list index is aten.index of a lifted
    tensor constant; the eval-mode dropout an aten.dropout node, and random ops are not dead
    code, so an unused one would keep the site's scores (all n keys) in the program."""
    ep, report = rw.rewrite(_MultiQueryEagerAttention().eval(), (torch.randn(2, 24, 16),), world_size=2)
    assert len(report.rewritten) == 1
    assert [g.why for g in report.gathers] == ["graph output (Config(gather_outputs=True))"], report.format()


class _LongestLength(torch.nn.Module):
    """Attention over at most 16 tokens (as MPT's max_seq_len bounds its ALiBi table)."""

    def forward(self, x):
        torch._check(x.shape[1] <= 16)
        q = x.unflatten(-1, (2, 4)).transpose(1, 2)
        return torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)


def test_dynamic_seq_of_a_model_that_bounds_the_length_says_what_to_do():
    with pytest.raises(rw.BadArguments, match=r"the model constrains it .* rewrite without --dynamic-seq, one program "
                                              r"per length"):
        rw.rewrite(_LongestLength(), (torch.randn(1, 8, 8),), world_size=2, dynamic=True)


class _TinyViT(torch.nn.Module):
    """A ViT's shape of sequence: no input carries it; the patches of an image (a strided conv,
    flattened and transposed) with a learned [CLS] token catted in front, one attention layer,
    the [CLS] row classified. Its 26 channels equal its 26 tokens (25 patches + [CLS])."""

    def __init__(self, dim: int = 26, tokens: int = 26):
        super().__init__()
        self.patches = torch.nn.Conv2d(3, dim, 4, stride=4)
        self.cls = torch.nn.Parameter(torch.randn(1, 1, dim))
        self.pos = torch.nn.Parameter(torch.randn(1, tokens, dim))
        self.norm = torch.nn.LayerNorm(dim)
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.proj = torch.nn.Linear(dim, dim)
        self.head = torch.nn.Linear(dim, 5)

    def forward(self, image):
        x = self.patches(image).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1) + self.pos
        b, n, d = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, n, 3, 2, d // 2).permute(2, 0, 3, 1, 4)
        x = x + self.proj(torch.nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, d))
        return self.head(x[:, 0])


def tiny_vit():
    torch.manual_seed(0)
    return _TinyViT(), (torch.randn(2, 3, 20, 20, generator=torch.Generator().manual_seed(1)),)


def tiny_vit_odd():  # 31 tokens: 30 patches + [CLS]
    torch.manual_seed(0)
    return _TinyViT(tokens=31), (torch.randn(2, 3, 20, 24, generator=torch.Generator().manual_seed(1)),)


def case_image_program(rank, world, path, factory: str = "tiny_vit"):
    """The program's logits and gradients against the eager model's (a fixed random projection
    of the logits as the loss)."""
    import ringcc  # noqa: F401 - registers the ringcc ops the program calls

    model, inputs = load_factory(f"{os.path.abspath(__file__)}:{factory}")()
    program = torch.export.load(path).module()
    r = torch.randn(2, 5, generator=torch.Generator().manual_seed(2))
    ref, got = model(*inputs), program(*inputs)
    (ref * r).sum().backward()
    (got * r).sum().backward()
    torch.testing.assert_close(got, ref, **TOL)
    grads = dict(program.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name].grad, p.grad, **TOL, msg=f"grad of {name}")
    return float((got - ref).abs().max())


def test_a_sequence_made_inside_the_model_is_sharded_where_it_is_made(pools, tmp_path):
    """Every rank passes the whole image; the program shards the sequence where the graph makes
    it (the cat of [CLS] onto the patches, sliced by the first per-token op, the add of the
    positions) and reads the [CLS] row with seq_select: nothing is gathered. The conv's channel
    dim, of size n too, is kept whole: as the sequence it would be gathered at the norm."""
    code, out = _rewrite(tmp_path, f"{os.path.abspath(__file__)}:tiny_vit", "--world-size", "2")
    assert code == rw.EXIT_OK
    report = json.load(open(os.path.join(out, "report.json")))
    assert [s["decision"] for s in report["sites"]] == ["rewritten"]
    assert report["gathers"] == []
    assert any(note.startswith("no graph input carries the sequence: the graph makes it, first sliced at cat (")
               for note in report["notes"]), report["notes"]
    program = open(os.path.join(out, "program.py")).read()
    assert "torch.ops.ringcc.shard.default(cat, 1, '', 2, 'contiguous')" in program
    assert "torch.ops.ringcc.seq_select.default(" in program
    errs = pools(2).run(case_image_program, os.path.join(out, "program.pt2"))
    assert max(errs) < 1e-5


def test_dynamic_seq_of_an_image_model_says_what_to_do():
    """--dynamic-seq marks dim 1 of the inputs: an image's channels, which the conv fixes."""
    with pytest.raises(rw.BadArguments, match=r"that dim is not the sequence \(an image's channels.* rewrite without "
                                              r"--dynamic-seq, one program per length \(--seq-len\) or image size"):
        rw.rewrite(*tiny_vit(), world_size=2, dynamic=True)


class _LeftPaddedEager(torch.nn.Module):
    """Eager attention as transformers writes it: an additive causal padding mask of the finite
    minimum, a left-padded batch, a loss that reads every row."""

    def __init__(self, d: int = 32, h: int = 4):
        super().__init__()
        self.h, self.dh = h, d // h
        self.emb = torch.nn.Embedding(64, d)
        self.q, self.kv, self.o = torch.nn.Linear(d, d), torch.nn.Linear(d, 2 * d), torch.nn.Linear(d, d)
        self.register_buffer("proj", torch.randn(d, d, generator=torch.Generator().manual_seed(3)))

    def forward(self, ids, attention_mask):
        b, n = ids.shape
        x = self.emb(ids)
        q = self.q(x).view(b, n, self.h, self.dh).transpose(1, 2)
        k, v = self.kv(x).view(b, n, 2, self.h, self.dh).permute(2, 0, 3, 1, 4)
        i = torch.arange(n, device=ids.device)
        allowed = (i[None, :] <= i[:, None]) & attention_mask[:, None, None, :].bool()
        mask = torch.zeros(b, 1, n, n).masked_fill(~allowed, torch.finfo(torch.float32).min)
        w = torch.softmax(q @ k.transpose(2, 3) * self.dh ** -0.5 + mask, dim=-1)
        y = self.o((w @ v).transpose(1, 2).reshape(b, n, -1))
        return (y @ self.proj).pow(2).mean()


def left_padded_eager():
    torch.manual_seed(0)
    attention_mask = torch.ones(2, 16, dtype=torch.long)
    attention_mask[0, :5] = 0
    return _LeftPaddedEager(), (torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1)),
                                attention_mask)


def case_left_padded_program(rank, world, path):
    import ringcc  # noqa: F401 - registers the ringcc ops the program calls

    model, inputs = left_padded_eager()
    program = torch.export.load(path).module()
    program.load_state_dict(model.state_dict())
    ref, got = model(*inputs), program(*inputs)
    ref.backward()
    got.backward()
    torch.testing.assert_close(got, ref, **TOL)
    grads = dict(program.named_parameters())
    assert {n for n, p in grads.items() if p.grad is not None} == {n for n, p in model.named_parameters()
                                                                   if p.grad is not None}
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name].grad, p.grad, **TOL, msg=f"grad of {name}")
    return float((got - ref).abs())


def test_rows_with_no_key_under_a_finite_mask_round_trip_in_the_program(pools, tmp_path):
    """The saved program carries ringcc::fill_empty_rows (Note [Rows with no key]): loaded in fresh
    processes at p = 2, the left-padded rows get eager's mean of the values, and the loss and every
    gradient equal eager's."""
    code, out = _rewrite(tmp_path, f"{os.path.abspath(__file__)}:left_padded_eager", "--world-size", "2")
    assert code == rw.EXIT_OK
    report = json.load(open(os.path.join(out, "report.json")))
    assert [s["decision"] for s in report["sites"]] == ["rewritten"]
    assert "give the mean of the values, as eager" in report["sites"][0]["detail"]
    program = open(os.path.join(out, "program.py")).read()
    assert program.count("torch.ops.ringcc.fill_empty_rows.default(") == 1 and ", '', 2, 'zigzag')" in program
    errs = pools(2).run(case_left_padded_program, os.path.join(out, "program.pt2"))
    assert max(errs) < 1e-5


@pytest.mark.soak
def test_a_token_count_the_ranks_do_not_divide_is_padded_inside_the_program(pools, tmp_path, capsys):
    """30 patches + [CLS] on 2 ranks: without --pad the user's error (exit 2) names --pad; with it
    the program pads the 31 tokens it makes to 32 and matches eager."""
    target = f"{os.path.abspath(__file__)}:tiny_vit_odd"
    assert _rewrite(tmp_path, target, "--world-size", "2")[0] == rw.EXIT_BAD_ARGS
    assert "sequence length 31 is not divisible by 2" in capsys.readouterr().err
    code, out = _rewrite(tmp_path, target, "--world-size", "2", "--pad")
    assert code == rw.EXIT_OK
    assert "sequence of 31 tokens padded to 32" in open(os.path.join(out, "report.txt")).read()
    errs = pools(2).run(case_image_program, os.path.join(out, "program.pt2"), "tiny_vit_odd")
    assert max(errs) < 1e-5


HF_FACTORY = """
import torch
import transformers


class Logits(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids):
        return self.model(input_ids=ids, use_cache=False).logits


def llama(seq_len=24):
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa")
    return Logits(transformers.AutoModelForCausalLM.from_config(cfg)), (torch.randint(0, 64, (2, seq_len)),)
"""


def test_a_model_of_a_transformers_release_below_the_floor_exits_2(tmp_path, capsys, monkeypatch):
    """`ringcc rewrite` checks the release of the model's transformers code as the backend does
    (ringcc/releases.py): below the floor it exits 2 naming the release and the floor."""
    import sys

    (tmp_path / "hf_factory.py").write_text(HF_FACTORY)
    target = f"{tmp_path / 'hf_factory.py'}:llama"
    load_factory(target)()  # transformers replaces its entry in sys.modules while it first builds a model
    monkeypatch.setattr(sys.modules["transformers"], "__version__", "4.45.2")
    code, out = _rewrite(tmp_path, target)
    err = capsys.readouterr().err
    assert code == 2 and not os.path.exists(os.path.join(out, "program.pt2"))
    assert err.startswith("ringcc rewrite: error: ringcc: this model's code comes from transformers 4.45.2"), err
    assert "install transformers>=4.57" in err and "Traceback" not in err
