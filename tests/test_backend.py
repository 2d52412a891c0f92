"""Parity of torch.compile(backend="ringcc") against eager at p = 1 (fp32, CPU): forward and
gradients within 1e-5, with the report showing which sites were rewritten."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ringcc
from ringcc.report import Decision

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


def test_sdpa_parity_inductor():
    torch.manual_seed(0)
    model = SdpaBlock(causal=True, kv_heads=2)
    report = assert_parity(model, [torch.randn(2, 16, 32)], inner="inductor")
    assert decisions(report) == [("sdpa", Decision.REWRITTEN, None)]
