"""Parity of torch.compile(backend="ringcc") against eager at p = 1 (fp32, CPU): forward and
gradients within 1e-5, with the report showing which sites were rewritten."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ringcc
from ringcc.report import Decision, SkipReason

TOL = dict(atol=1e-5, rtol=1e-5)


def compile_ringcc(model, **options):
    torch._dynamo.reset()
    ringcc.reset_reports()
    options.setdefault("inner", "aot_eager")
    options.setdefault("verify", True)
    return torch.compile(model, backend="ringcc", options=options)


def assert_parity(model, inputs, compiled=None, **options):
    """Forward output and every parameter / input gradient of compiled == eager."""
    compiled = compiled or compile_ringcc(model, **options)
    inputs_e = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in inputs]
    inputs_c = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in inputs]
    out_e = model(*inputs_e)
    grads_e = _grads(model, out_e, inputs_e)
    out_c = compiled(*inputs_c)
    grads_c = _grads(model, out_c, inputs_c)
    torch.testing.assert_close(out_c, out_e, **TOL)
    assert grads_e.keys() == grads_c.keys()
    for name in grads_e:
        torch.testing.assert_close(grads_c[name], grads_e[name], **TOL, msg=f"gradient of {name}")
    return ringcc.last_report()


def _grads(model, out, inputs) -> dict:
    params = [p for p in model.parameters() if p.requires_grad]
    leaves = params + [x for x in inputs if x.requires_grad]
    gs = torch.autograd.grad(out.float().square().sum(), leaves, allow_unused=True)
    names = [n for n, p in model.named_parameters() if p.requires_grad] + [f"input{i}" for i, x in enumerate(inputs) if x.requires_grad]
    return {n: g for n, g in zip(names, gs) if g is not None}


def decisions(report):
    return [(s.form, s.decision, s.reason) for s in report.sites]


class SdpaBlock(nn.Module):
    def __init__(self, dim=32, heads=4, kv_heads=4, causal=True, scale=None):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.q = nn.Linear(dim, dim)
        self.kv = nn.Linear(dim, 2 * kv_heads * self.head_dim)
        self.o = nn.Linear(dim, dim)
        self.causal, self.scale = causal, scale

    def forward(self, x):
        b, n, _ = x.shape
        q = self.q(x).view(b, n, self.heads, self.head_dim).transpose(1, 2)
        k, v = self.kv(x).view(b, n, 2, self.kv_heads, self.head_dim).unbind(2)
        k, v = k.transpose(1, 2), v.transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal, scale=self.scale,
                                           enable_gqa=self.kv_heads != self.heads)
        return self.o(y.transpose(1, 2).reshape(b, n, -1))


@pytest.mark.parametrize("causal,scale,kv_heads", [(True, None, 4), (False, 0.3, 4), (True, None, 2)])
def test_sdpa_parity(causal, scale, kv_heads):
    torch.manual_seed(0)
    model = SdpaBlock(causal=causal, scale=scale, kv_heads=kv_heads)
    report = assert_parity(model, [torch.randn(2, 16, 32)])
    assert decisions(report) == [("sdpa", Decision.REWRITTEN, None)]
    assert report.sites[0].mask["causal"] is causal
    assert report.sites[0].location.startswith("test_backend.py:")


@pytest.mark.soak  # inductor under a ring in make test: test_shard_models.py (padding mask)
def test_sdpa_parity_inductor():
    torch.manual_seed(0)
    model = SdpaBlock(causal=True, kv_heads=2)
    report = assert_parity(model, [torch.randn(2, 16, 32)], inner="inductor")
    assert decisions(report) == [("sdpa", Decision.REWRITTEN, None)]


# ---------------------------------------------------------------------------------------
# hand-written attention


class ManualGPT(nn.Module):
    """A tiny GPT whose attention is written out: q @ k^T, scale, causal mask, softmax, @ v."""

    def __init__(self, vocab=64, dim=32, heads=4, layers=2, mask_style="masked_fill", dropout=0.0):
        super().__init__()
        self.heads, self.mask_style = heads, mask_style
        self.emb = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(
            nn.ModuleDict(dict(ln=nn.LayerNorm(dim), qkv=nn.Linear(dim, 3 * dim), proj=nn.Linear(dim, dim),
                               ln2=nn.LayerNorm(dim), mlp=nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))))
            for _ in range(layers))
        self.drop = nn.Dropout(dropout)
        self.head = nn.Linear(dim, vocab)

    def attend(self, x, blk):
        b, n, c = x.shape
        q, k, v = blk["qkv"](x).split(c, dim=2)
        q, k, v = (t.view(b, n, self.heads, c // self.heads).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        i = torch.arange(n, device=x.device)
        if self.mask_style == "masked_fill":
            att = att.masked_fill(i[None, :] > i[:, None], float("-inf"))
        elif self.mask_style == "additive":
            att = att + torch.full((n, n), float("-inf"), device=x.device).triu(1)
        elif self.mask_style == "where":
            att = torch.where(torch.ones(n, n, dtype=torch.bool).tril(), att, torch.finfo(att.dtype).min)
        att = self.drop(F.softmax(att, dim=-1))
        y = (att @ v).transpose(1, 2).reshape(b, n, c)
        return blk["proj"](y)

    def forward(self, ids):
        x = self.emb(ids)
        for blk in self.blocks:
            x = x + self.attend(blk["ln"](x), blk)
            x = x + blk["mlp"](blk["ln2"](x))
        return self.head(x)


@pytest.mark.parametrize("mask_style", ["masked_fill", "additive", "where"])
def test_manual_gpt_parity(mask_style):
    torch.manual_seed(0)
    model = ManualGPT(mask_style=mask_style)
    report = assert_parity(model, [torch.randint(0, 64, (2, 16))])
    assert decisions(report) == [("manual", Decision.REWRITTEN, None)] * 2
    assert all(s.mask["causal"] for s in report.sites)


def test_manual_attention_dropout_in_training_is_skipped_with_reason():
    torch.manual_seed(0)
    model = ManualGPT(dropout=0.1).train()
    compile_ringcc(model)(torch.randint(0, 64, (2, 16)))
    assert decisions(ringcc.last_report()) == [("manual", Decision.SKIPPED, SkipReason.DROPOUT)] * 2
    model.eval()  # eval: dropout is the identity and the sites are rewritten
    report = assert_parity(model, [torch.randint(0, 64, (2, 16))])
    assert decisions(report) == [("manual", Decision.REWRITTEN, None)] * 2


# ---------------------------------------------------------------------------------------
# nn.MultiheadAttention and nn.TransformerEncoder


class MHAModel(nn.Module):
    def __init__(self, dim=32, heads=4, causal=False, batch_first=True):
        super().__init__()
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=batch_first)
        self.causal, self.batch_first = causal, batch_first

    def forward(self, x, key_padding_mask=None):
        n = x.shape[1] if self.batch_first else x.shape[0]
        # bool like the padding mask: mixed mask types make MHA warn, a graph break
        mask = torch.ones(n, n, dtype=torch.bool, device=x.device).triu(1) if self.causal else None
        y, _ = self.attn(x, x, x, key_padding_mask=key_padding_mask, attn_mask=mask, need_weights=False,
                         is_causal=self.causal)
        return y


# the padded, causal, batch-first case in the soak tier: padding and causality each run here
@pytest.mark.parametrize("causal,batch_first,padded", [(False, True, False), (True, True, False),
                                                       (False, False, True),
                                                       pytest.param(True, True, True, marks=pytest.mark.soak)])
def test_multihead_attention_parity(causal, batch_first, padded):
    torch.manual_seed(0)
    model = MHAModel(causal=causal, batch_first=batch_first)
    x = torch.randn(2, 8, 32) if batch_first else torch.randn(8, 2, 32)
    inputs = [x]
    if padded:
        pad = torch.zeros(2, 8, dtype=torch.bool)
        pad[1, 5:] = True
        inputs.append(pad)
    report = assert_parity(model, inputs)
    assert decisions(report) == [("mha", Decision.REWRITTEN, None)]
    assert report.sites[0].mask["causal"] is causal
    assert (report.sites[0].mask["key_padding"] is not None) is padded


def test_multihead_attention_weights_used_is_skipped():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = nn.MultiheadAttention(32, 4, batch_first=True)

        def forward(self, x):
            y, w = self.attn(x, x, x)
            return y + w.sum()

    model = M()
    report = assert_parity(model, [torch.randn(2, 8, 32)])
    assert decisions(report) == [("mha", Decision.SKIPPED, SkipReason.WEIGHTS_USED)]


def _encoder(norm_first=False, activation="relu"):
    layer = nn.TransformerEncoderLayer(32, 4, dim_feedforward=64, dropout=0.0, batch_first=True,
                                       norm_first=norm_first, activation=activation)
    return nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)


class _CausalPaddedEncoder(nn.Module):
    def __init__(self, encoder, n):
        super().__init__()
        self.encoder = encoder
        self.register_buffer("mask", torch.ones(n, n, dtype=torch.bool).triu(1))  # True = not allowed

    def forward(self, x, pad):
        return self.encoder(x, mask=self.mask, src_key_padding_mask=pad, is_causal=True)


# eval mode with a mask in the soak tier: the masked path in make test is (True, True), eval mode
# test_transformer_encoder_fast_path_is_decomposed
@pytest.mark.parametrize("train,masked", [(True, False), (True, True), pytest.param(False, True, marks=pytest.mark.soak)])
def test_transformer_encoder_parity(train, masked):
    torch.manual_seed(0)
    model = _encoder().train(train)
    x = torch.randn(2, 8, 32)
    if masked:
        pad = torch.zeros(2, 8, dtype=torch.bool)
        pad[1, 6:] = True
        report = assert_parity(_CausalPaddedEncoder(model, 8), [x, pad])
    else:
        report = assert_parity(model, [x])
    assert decisions(report) == [("mha", Decision.REWRITTEN, None)] * 2
    assert all(s.mask["causal"] is masked and (s.mask["key_padding"] is not None) is masked for s in report.sites)


def test_transformer_encoder_fast_path_is_decomposed():
    torch.manual_seed(0)
    model = _encoder(activation="gelu").eval()
    x = torch.randn(2, 8, 32)
    compiled = compile_ringcc(model)
    with torch.no_grad():
        out_c, out_e = compiled(x), model(x)
    torch.testing.assert_close(out_c, out_e, **TOL)
    assert decisions(ringcc.last_report()) == [("encoder", Decision.REWRITTEN, None)] * 2


# ---------------------------------------------------------------------------------------
# tiny Hugging Face models from configs (random weights, no downloads)

# transformers is a declared test dependency (pyproject's `test` extra): imported where used, so
# that without it these tests fail and the ones above still run.


def _hf(name, **extra):
    """Tiny model from a config; name "<model>_eager" picks HF's hand-written attention."""
    import transformers

    torch.manual_seed(0)
    name, _, impl = name.partition("_")
    if impl:
        extra["attn_implementation"] = impl
    if name == "llama":
        cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                       use_cache=False, **extra)
        return transformers.LlamaForCausalLM(cfg)
    if name == "mistral":  # a sliding window of 4 tokens
        cfg = transformers.MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, sliding_window=4,
                                         use_cache=False, **extra)
        return transformers.MistralForCausalLM(cfg)
    if name == "gpt2":
        extra = {"attn_pdrop": 0.0, "resid_pdrop": 0.0, "embd_pdrop": 0.0, **extra}
        cfg = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=64, use_cache=False,
                                      **extra)
        return transformers.GPT2LMHeadModel(cfg)
    cfg = transformers.BertConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, max_position_embeddings=64, attention_probs_dropout_prob=0.0,
                                  hidden_dropout_prob=0.0, **extra)
    return transformers.BertModel(cfg)


class _Logits(nn.Module):
    """HF output -> one tensor (the parity helper differentiates a tensor)."""

    def __init__(self, model, padded):
        super().__init__()
        self.model, self.padded = model, padded

    def forward(self, ids, attention_mask=None):
        out = self.model(ids, attention_mask=attention_mask)
        return out.logits if hasattr(out, "logits") else out.last_hidden_state


_SOAK = pytest.mark.soak


@pytest.mark.parametrize("name,padded", [pytest.param("llama", False, marks=_SOAK), pytest.param("llama", True, marks=_SOAK),
                                         ("gpt2", False),
                                         ("bert", True),
                                         pytest.param("llama_eager", True, marks=_SOAK),
                                         pytest.param("gpt2_eager", False, marks=_SOAK),
                                         pytest.param("mistral", True, marks=_SOAK)])
def test_hugging_face_parity(name, padded):
    model = _Logits(_hf(name), padded)
    ids = torch.randint(0, 64, (2, 16))
    inputs = [ids]
    if padded:
        am = torch.ones(2, 16, dtype=torch.long)
        am[1, 12:] = 0  # right padding: every query row still sees a key
        inputs.append(am)
    report = assert_parity(model, inputs)
    form = "manual" if name.endswith("_eager") else "sdpa"
    assert [(s.form, s.decision, s.reason) for s in report.sites] == [(form, Decision.REWRITTEN, None)] * 2
    for s in report.sites:
        assert s.mask["causal"] is (not name.startswith("bert"))
        assert s.mask["window"] == (4 if name == "mistral" else None)
        assert (s.mask["key_padding"] is not None) is padded


@pytest.mark.soak  # dynamic lengths in make test: test_rewrite_cli.py's dynamic program
@pytest.mark.parametrize("name", ["llama", "llama_eager"])
def test_hugging_face_llama_dynamic_shapes(name):
    """Under dynamic=True HF's scale is a symbolic float and lengths are symbols: still rewritten."""
    model = _Logits(_hf(name), False).eval()
    torch._dynamo.reset()
    ringcc.reset_reports()
    compiled = torch.compile(model, backend="ringcc", options=dict(inner="aot_eager", verify=True), dynamic=True)
    for n in (16, 24):
        ids = torch.randint(0, 64, (2, n))
        torch.testing.assert_close(compiled(ids), model(ids), **TOL)
    assert ringcc.reports() and all(len(r.rewritten) == 2 == len(r.sites) for r in ringcc.reports())


# ---------------------------------------------------------------------------------------
# backend surface: settings, graph breaks, strict, dump, report


def test_graph_break_gives_one_report_per_graph():
    class TwoHalves(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = SdpaBlock(), SdpaBlock(causal=False)

        def forward(self, x):
            x = self.a(x)
            torch._dynamo.graph_break()
            return self.b(x)

    torch.manual_seed(0)
    model = TwoHalves()
    assert_parity(model, [torch.randn(2, 16, 32)])
    reports = [r for r in ringcc.reports() if r.sites]
    assert [[(s.decision, s.mask["causal"]) for s in r.sites] for r in reports] == [
        [(Decision.REWRITTEN, True)], [(Decision.REWRITTEN, False)]]


def test_backend_callable_with_config_and_strict_error():
    torch.manual_seed(0)
    model = ManualGPT(dropout=0.1).train()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=ringcc.backend(ringcc.Config(inner="aot_eager", strict=True)))
    with pytest.raises(Exception, match=r"strict=True.*manual site at test_backend.py:\d+.*dropout"):
        compiled(torch.randint(0, 64, (2, 16)))


def test_dump_dir_writes_graph_before_and_after_each_pass(tmp_path, monkeypatch):
    monkeypatch.setenv("RINGCC_DUMP_DIR", str(tmp_path))
    torch.manual_seed(0)
    compile_ringcc(SdpaBlock())(torch.randn(2, 16, 32))
    names = sorted(p.name for p in tmp_path.iterdir())
    graph = ringcc.last_report().graph
    assert f"{graph}_00_input.txt" in names and f"{graph}_04_rewrite_attention.txt" in names
    assert "scaled_dot_product_attention" in (tmp_path / f"{graph}_00_input.txt").read_text()
    assert "ringcc.ring_attention" in (tmp_path / f"{graph}_04_rewrite_attention.txt").read_text()


def test_report_lists_pass_times_and_formats():
    torch.manual_seed(0)
    compile_ringcc(SdpaBlock())(torch.randn(2, 16, 32))
    report = ringcc.last_report()
    assert {"canonicalize_attention", "lift_masks", "rewrite_attention"} <= set(report.pass_seconds)
    d = report.to_dict()
    assert d["sites"][0]["decision"] == "rewritten" and d["sites"][0]["form"] == "sdpa"
    assert "1/1 attention sites rewritten" in report.format()


def test_entry_point_needs_no_import(tmp_path):
    import subprocess
    import sys

    script = tmp_path / "m.py"
    script.write_text(
        "import torch, torch.nn.functional as F\n"
        "f = lambda q: F.scaled_dot_product_attention(q, q, q, is_causal=True)\n"
        "q = torch.randn(1, 2, 8, 4)\n"
        "out = torch.compile(f, backend='ringcc', options={'inner': 'eager'})(q)\n"
        "torch.testing.assert_close(out, f(q), atol=1e-5, rtol=1e-5)\n"
        "import sys, ringcc\n"
        "print(ringcc.last_report().rewritten[0].form)\n")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().endswith("sdpa")


def test_dilated_parity_against_dilated_reference():
    from ringcc.runtime.dilated import DilatedSpec, dilated_attention

    spec = DilatedSpec([4, 16], [1, 2])

    class Dense(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(16, 16)

        def forward(self, q, k, v):
            return self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True))

    class Dilated(Dense):
        def forward(self, q, k, v):
            return self.proj(dilated_attention(q, k, v, spec, is_causal=True))

    torch.manual_seed(0)
    dense, dilated = Dense(), Dilated()
    dilated.load_state_dict(dense.state_dict())
    inputs = [torch.randn(2, 4, 16, 16) for _ in range(3)]
    compiled = compile_ringcc(dense, dilation=spec)
    # the compiled dense model computes what the explicitly dilated model computes
    out_c, out_e = compiled(*inputs), dilated(*inputs)
    torch.testing.assert_close(out_c, out_e, **TOL)
    (site,) = ringcc.last_report().sites
    assert site.decision == Decision.REWRITTEN and site.dilation == repr(spec)


def test_dilated_site_specializes_on_its_length_under_dynamic_shapes():
    """A dilated schedule is planned per length: under dynamic=True the site guards on its
    length (one graph per length) and is rewritten at every length, never run as dense
    attention (which would change the model's math from one length to the next)."""
    from ringcc.runtime.dilated import DilatedSpec, dilated_attention

    spec = DilatedSpec([4, 16], [1, 2])

    class Attn(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv, self.proj = nn.Linear(16, 48), nn.Linear(16, 16)

        def heads(self, x):
            b, n, _ = x.shape
            return self.qkv(x).view(b, n, 3, 2, 8).permute(2, 0, 3, 1, 4)

        def forward(self, x):
            q, k, v = self.heads(x)
            return self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).flatten(2))

        def dilated(self, x):
            q, k, v = self.heads(x)
            return self.proj(dilated_attention(q, k, v, spec, is_causal=True).transpose(1, 2).flatten(2))

    torch.manual_seed(0)
    m = Attn()
    torch._dynamo.reset()
    ringcc.reset_reports()
    compiled = torch.compile(m, backend="ringcc", dynamic=True, options={"inner": "aot_eager", "dilation": spec})
    for n in (16, 32, 48):
        x = torch.randn(2, n, 16)
        torch.testing.assert_close(compiled(x), m.dilated(x), **TOL)
        (site,) = ringcc.last_report().sites
        assert site.decision == Decision.REWRITTEN and site.dilation == repr(spec), (n, site)


def test_gpt2_default_attention_dropout_in_training_is_skipped():
    model = _Logits(_hf("gpt2", attn_pdrop=0.1), False).train()
    compile_ringcc(model)(torch.randint(0, 64, (2, 16)))
    sites = ringcc.last_report().sites
    assert [(s.decision, s.reason) for s in sites] == [(Decision.SKIPPED, SkipReason.DROPOUT)] * 2
    assert "dropout_p=0.1 in training" in sites[0].detail and "use eval mode" in sites[0].detail


def test_unimplemented_dropout_mode_is_an_error():
    with pytest.raises(ValueError, match=r"Config.dropout='per_block' is not allowed; choose one of \['skip'\]"):
        ringcc.Config(dropout="per_block")



_PROBED: list = []  # (weakref to a graph input, whether it was dead when probed)


def _probe(t):
    _PROBED[-1][1] = _PROBED[-1][0]() is None
    return t


def test_boxed_graph_frees_each_input_after_its_last_use():
    """The aot_eager inner compiler's graphs (_compat.boxed_graph) take their inputs in a list
    they clear, so a backward frees each saved activation once used, not when it returns (and
    keep nothing once they return)."""
    import weakref

    from ringcc import _compat

    graph = torch.fx.Graph()
    a, b = graph.placeholder("a"), graph.placeholder("b")
    c = graph.call_function(torch.sin, (a,))  # a's last use
    graph.output(graph.call_function(torch.add, (graph.call_function(_probe, (b,)), c)))
    run = _compat.boxed_graph(torch.fx.GraphModule(torch.nn.Module(), graph))
    x, y = torch.randn(4), torch.randn(4)
    expected = y + x.sin()
    _PROBED.append([weakref.ref(x), None])
    args = [x, y]
    del x
    out = run(args)
    assert getattr(run, "_boxed_call", False) and args == []
    assert _PROBED[-1][1] is True, "the first input was alive after its last use"
    torch.testing.assert_close(out, expected)
    kept = weakref.ref(out)
    del out
    assert kept() is None, "the graph keeps its output after returning"
