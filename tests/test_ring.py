"""Ring attention vs the dense reference: real gloo groups, p = 1, 2, 3, 4 (tier 2 + 3)."""

import pytest
import torch

import ringcc
from ringcc import reference
from ringcc.runtime import layout as L

WORLDS = [1, 2, 3, 4]
TOL = dict(atol=1e-5, rtol=1e-5)


def _inputs(seed, b, h, g, n, d, padded):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, n, d, generator=gen)
    k = torch.randn(b, g, n, d, generator=gen)
    v = torch.randn(b, g, n, d, generator=gen)
    dout = torch.randn(b, h, n, d, generator=gen)
    kpm = None
    if padded:
        kpm = torch.rand(b, n, generator=gen) < 0.3
        kpm[0, :] = True  # batch 0: every key padded -> every row fully masked
        kpm[-1, -n // 3:] = True  # a padded tail
    return q, k, v, dout, kpm


def case_ring(rank, world, is_causal, layout, h, g, n_local, padded):
    n = n_local * world
    q, k, v, dout, kpm = _inputs(1234, 2, h, g, n, 8, padded)
    ref_out, ref_lse = reference.attention(
        *(t.clone().requires_grad_() for t in (q, k, v)), is_causal=is_causal, key_padding_mask=kpm
    )
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    ref_out, ref_lse = reference.attention(qr, kr, vr, is_causal=is_causal, key_padding_mask=kpm)
    ref_out.backward(dout)
    lay = L.Layout(layout)
    sh = lambda t: L.shard(t, 2, rank, world, lay)  # noqa: E731
    ql, kl, vl = (sh(t).requires_grad_() for t in (q, k, v))
    kpm_l = None if kpm is None else L.shard(kpm, 1, rank, world, lay)
    out, lse = ringcc.ring_attention(
        ql, kl, vl, is_causal=is_causal, key_padding_mask=kpm_l, layout=layout, return_lse=True
    )
    out.backward(sh(dout))
    torch.testing.assert_close(out, sh(ref_out.detach()), **TOL)
    torch.testing.assert_close(lse, sh(ref_lse.detach()), **TOL)
    for got, ref in ((ql.grad, qr.grad), (kl.grad, kr.grad), (vl.grad, vr.grad)):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, sh(ref), **TOL)
    return float((out - sh(ref_out.detach())).abs().max())


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("h,g", [(8, 8), (8, 2), (8, 1)])
def test_ring_matches_reference(pools, world, is_causal, layout, h, g):
    n_local = 14 if layout == "zigzag" else 13  # not a multiple of 16
    errs = pools(world).run(case_ring, is_causal, layout, h, g, n_local, False)
    assert max(errs) < 1e-5


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_ring_key_padding_and_fully_masked_rows(pools, world, is_causal, layout):
    errs = pools(world).run(case_ring, is_causal, layout, 4, 2, 10, True)
    assert max(errs) < 1e-5
