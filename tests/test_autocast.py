"""Attention under torch.autocast (Note [Attention under autocast] in runtime/amp.py): the ring
takes SDPA's autocast policy in compiled graphs (the trace's state and the graph's autocast
regions), in the functional API, in the ops themselves and in `ringcc rewrite`'s saved program.
Models with fp32 weights under CPU autocast are judged against an fp64 reference: no further from
it than eager under the same autocast (parity.fp64_judge), with the same parameters getting a
gradient."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from parity import fp64_excess, fp64_judge

N, VOCAB = 24, 64


def assert_as_close_as_eager(judged: dict) -> None:
    assert fp64_excess(judged) == []


# ---------------------------------------------------------------------------------------
# the policy, the functional API and the ops (one process)


def test_sdpa_casts_to_the_cpu_autocast_dtype():
    """What the ring copies: SDPA is on CPU autocast's lower-precision list (fp32 and bf16 inputs
    to the autocast dtype, fp64 left alone)."""
    q, v = torch.randn(1, 2, 8, 4), torch.randn(1, 2, 8, 4, dtype=torch.bfloat16)
    for dtype in (torch.bfloat16, torch.float16):
        with torch.autocast("cpu", dtype):
            assert F.scaled_dot_product_attention(q, q, v).dtype == dtype
            assert F.scaled_dot_product_attention(q.double(), q.double(), q.double()).dtype == torch.float64


def _qkv(requires_grad=True):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 16, 8, generator=gen)
    k = torch.randn(2, 2, 16, 8, generator=gen)
    v = torch.randn(2, 2, 16, 8, generator=gen).bfloat16()  # a RoPE model's q/k fp32, v bf16
    return [t.requires_grad_(requires_grad) for t in (q, k, v)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_ring_attention_under_autocast_is_sdpa_under_autocast(dtype):
    import ringcc

    q, k, v = _qkv()
    with torch.autocast("cpu", dtype):
        out = ringcc.ring_attention(q, k, v, is_causal=True)
        op_out, lse = torch.ops.ringcc.ring_attention(q, k, v, None, True, 8 ** -0.5, "", 1, "contiguous")
        ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert out.dtype == op_out.dtype == ref.dtype == dtype and lse.dtype == torch.float32
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(op_out, ref)
    dout = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    got = torch.autograd.grad(out, (q, k, v), dout)
    want = torch.autograd.grad(ref, (q, k, v), dout)
    for g, w, t in zip(got, want, (q, k, v)):
        assert g.dtype == t.dtype  # back through the casts, in the inputs' dtypes
        torch.testing.assert_close(g, w, atol=2e-2, rtol=2e-2)


def test_dilated_attention_under_autocast_runs_in_the_autocast_dtype():
    import ringcc

    q, k, v = _qkv(requires_grad=False)
    spec = ringcc.DilatedSpec([8, 16], [1, 2])
    with torch.autocast("cpu", torch.bfloat16):
        out = ringcc.dilated_attention(q, k, v, spec, is_causal=True)
    want = ringcc.dilated_attention(q.bfloat16(), k.bfloat16(), v, spec, is_causal=True)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, want, atol=0, rtol=0)


# ---------------------------------------------------------------------------------------
# autocast regions inside a compiled function


def _attend(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def _inside_autocast(q, k, v):
    with torch.autocast("cpu", torch.bfloat16):
        return _attend(q, k, v)


def _autocast_off_inside(q, k, v):
    with torch.autocast("cpu", enabled=False):
        return _attend(q.float(), k.float(), v.float())


@pytest.mark.parametrize("fn,ambient,dtype", [
    (_attend, True, torch.bfloat16),  # the trace's state
    (_inside_autocast, False, torch.bfloat16),  # a region entered in the graph
    (_autocast_off_inside, True, torch.float32),  # a region that turns it off again
], ids=["ambient", "region_on", "region_off"])
def test_compiled_site_takes_the_autocast_state_at_the_site(fn, ambient, dtype):
    import ringcc

    torch._dynamo.reset()
    ringcc.reset_reports()
    q, k, v = _qkv()
    compiled = torch.compile(fn, backend=ringcc.backend(ringcc.Config(world_size=1, inner="aot_eager")))
    with torch.autocast("cpu", torch.bfloat16, enabled=ambient):
        out = compiled(q, k, v)
        ref = fn(q, k, v)
    sites = [(s.decision.value, s.detail) for r in ringcc.reports() for s in r.sites]
    detail = f"autocast: q/k/v in {dtype}" if dtype != torch.float32 else ""
    assert sites == [("rewritten", detail)]
    assert out.dtype == ref.dtype == dtype
    torch.testing.assert_close(out, ref)
    got = torch.autograd.grad(out.float().sum(), (q, k, v))
    want = torch.autograd.grad(ref.float().sum(), (q, k, v))
    for g, w, t in zip(got, want, (q, k, v)):
        assert g.dtype == t.dtype
        torch.testing.assert_close(g, w, atol=2e-2, rtol=2e-2)


# ---------------------------------------------------------------------------------------
# a small RoPE model: ringcc rewrite's program, GradScaler


class RopeLM(nn.Module):
    """One causal attention block with rotary embeddings computed in fp32, as HF's decoders do:
    under autocast q and k reach SDPA in fp32 and v in the autocast dtype."""

    def __init__(self, dim=32, heads=4, kv_heads=2):
        super().__init__()
        self.heads, self.kv_heads, self.d = heads, kv_heads, dim // heads
        self.emb = nn.Embedding(VOCAB, dim)
        self.q = nn.Linear(dim, dim)
        self.kv = nn.Linear(dim, 2 * kv_heads * self.d)
        self.o = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, VOCAB)
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, self.d, 2).float() / self.d),
                             persistent=False)

    def _rope(self, x, cos, sin):
        x1, x2 = x[..., : self.d // 2], x[..., self.d // 2:]
        return x * cos + torch.cat((-x2, x1), dim=-1) * sin

    def forward(self, ids, labels):
        b, n = ids.shape
        x = self.emb(ids)
        freqs = torch.arange(n, device=ids.device).float()[:, None] * self.inv_freq.float()
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        q = self._rope(self.q(x).view(b, n, self.heads, self.d).transpose(1, 2), cos, sin)
        k, v = self.kv(x).view(b, n, 2 * self.kv_heads, self.d).transpose(1, 2).chunk(2, dim=1)
        k = self._rope(k, cos, sin)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, n, -1))
        return F.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())


def _batch():
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(1, VOCAB, (2, N), generator=gen)
    labels = torch.randint(0, VOCAB, (2, N), generator=gen)
    labels[0, 3] = -100
    return ids, labels


def test_saved_program_under_autocast_is_eager_under_autocast(tmp_path):
    """`ringcc rewrite`'s program, captured without autocast and run under it: the ring op's
    autocast kernel casts the RoPE q/k (fp32) and v (bf16) as SDPA's autocast would."""
    from ringcc.rewrite import rewrite, save

    torch.manual_seed(0)
    model = RopeLM()
    ids, labels = _batch()
    ep, report = rewrite(model, (ids, labels), world_size=1)
    assert len(report.rewritten) == 1
    path = save(ep, report, str(tmp_path))["program.pt2"]
    program = torch.export.load(path).module()
    ref = copy.deepcopy(model).double()
    for p in ref.parameters():
        p.requires_grad_(True)
    want = ref(ids, labels)
    want.backward()
    with torch.autocast("cpu", torch.bfloat16):
        eager, got = model(ids, labels), program(ids, labels)
    eager_grads = dict(zip((n for n, _ in model.named_parameters()),
                           torch.autograd.grad(eager, list(model.parameters()))))
    got_grads = dict(zip((n for n, _ in program.named_parameters()),
                         torch.autograd.grad(got, list(program.parameters()))))
    assert set(got_grads) == set(eager_grads)
    assert_as_close_as_eager(fp64_judge(
        (got, got_grads), (eager, eager_grads), (want, {n: p.grad for n, p in ref.named_parameters()})))
    assert not torch.equal(got, model(ids, labels))  # the program ran in bf16, not fp32


def case_grad_scaler(rank, world):
    """Steps of fp16 autocast with a GradScaler, ringcc against eager: the first step's scale
    (2^40) overflows the fp16 backward and is skipped, the second is taken, a third whose loss is
    NaN is skipped; the scales and the parameters follow eager's."""
    import ringcc

    torch.manual_seed(0)
    eager = RopeLM()
    model = copy.deepcopy(eager)
    compiled = torch.compile(model, backend=ringcc.backend(ringcc.Config(inner="aot_eager")))
    ids, labels = _batch()
    runs = {}
    for name, module, fn in (("eager", eager, eager), ("ringcc", model, compiled)):
        opt = torch.optim.SGD(module.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 40, backoff_factor=2.0 ** -30)
        scales, taken = [], []
        for poison in (1.0, 1.0, math.nan):
            before = [p.detach().clone() for p in module.parameters()]
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cpu", torch.float16):
                loss = fn(ids, labels) * poison
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            scales.append(scaler.get_scale())
            taken.append(any(not torch.equal(b, p) for b, p in zip(before, module.parameters())))
        runs[name] = dict(scales=scales, taken=taken, params=[p.detach().clone() for p in module.parameters()])
    return runs


@pytest.mark.soak
def test_fp16_grad_scaler_skips_the_steps_eager_skips(pools):
    for runs in pools(2).run(case_grad_scaler, timeout=600):
        assert runs["eager"]["taken"] == [False, True, False]
        assert runs["ringcc"]["scales"] == runs["eager"]["scales"]
        assert runs["ringcc"]["taken"] == runs["eager"]["taken"]
        for got, want in zip(runs["ringcc"]["params"], runs["eager"]["params"]):
            torch.testing.assert_close(got, want, atol=5e-3, rtol=5e-3)


# ---------------------------------------------------------------------------------------
# HF Llama, default config, fp32 weights under CPU bf16 autocast


def _llama(layers: int):
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").train()


def _step(model, ids, labels, amp: bool):
    """(loss, logits, {name: grad}) of one training step, labels inside, under CPU bf16
    autocast when amp."""
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", torch.bfloat16, enabled=amp):
        out = model(input_ids=ids, labels=labels)
    out.loss.backward()
    logits = out.logits[:]  # a SequenceSharded output gathers when read (docs/outputs.md)
    return out.loss.detach(), logits.detach(), {k: p.grad for k, p in model.named_parameters()}


def case_llama(rank, world, layers):
    import ringcc

    torch.manual_seed(0)
    eager = _llama(layers)
    ref, model = copy.deepcopy(eager).double(), copy.deepcopy(eager)
    compiled = torch.compile(model, backend=ringcc.backend(ringcc.Config(inner="aot_eager")))
    ids, labels = _batch()
    torch._dynamo.reset()
    ringcc.reset_reports()
    want = _step(ref, ids, labels, amp=False)
    base = _step(eager, ids, labels, amp=True)
    got = _step(compiled, ids, labels, amp=True)
    return dict(sites=[(s.decision.value, s.detail) for r in ringcc.reports() for s in r.sites],
                judged=fp64_judge(got, base, want), dtypes=(got[1].dtype, base[1].dtype),
                no_grad=[{k for k, g in run[2].items() if g is None} for run in (got, base)])


# one decoder layer at p = 2 (every layer's site is the same code); two layers at p = 4 in the zoo tier
@pytest.mark.parametrize("world,layers", [(2, 1), pytest.param(4, 2, marks=pytest.mark.zoo)])
def test_llama_under_cpu_bf16_autocast(pools, world, layers):
    for res in pools(world).run(case_llama, layers, timeout=900):
        assert res["sites"] == [("rewritten", "autocast: q/k/v in torch.bfloat16")] * layers, res["sites"]
        assert res["dtypes"] == (torch.bfloat16, torch.bfloat16)
        assert res["no_grad"][0] == res["no_grad"][1]
        assert_as_close_as_eager(res["judged"])
