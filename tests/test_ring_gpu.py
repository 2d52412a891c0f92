"""Ring attention on NCCL in bf16 (tier 4). Skipped without at least 2 CUDA devices.

Tolerance: outputs and gradients within 2e-2 relative (max-norm) of the fp32 dense reference;
bf16 inputs, fp32 accumulation and merge.
"""

import os

import pytest
import torch

import ringcc
from ringcc import reference
from ringcc.runtime import layout as L

pytestmark = pytest.mark.gpu

N_GPU = torch.cuda.device_count() if torch.cuda.is_available() else 0
WORLDS = [w for w in (2, 4) if w <= N_GPU]
REL = 2e-2


def _rel(a, b):
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-6))


def case_ring_nccl(rank, world, kernel, is_causal, layout, h, g, padded, workspace_mib="512"):
    os.environ["RINGCC_CUDA_KERNEL"] = kernel
    os.environ["RINGCC_RING_WORKSPACE_MIB"] = workspace_mib  # tiny: one K/V head per chunk
    dev = torch.device("cuda", rank)
    n_local, b, d = 256, 2, 128
    n = n_local * world
    gen = torch.Generator(device="cpu").manual_seed(7)
    q, k, v, dout = (torch.randn(b, hh, n, d, generator=gen).to(dev) for hh in (h, g, g, h))
    kpm = None
    if padded:
        kpm = (torch.rand(b, n, generator=gen) < 0.2).to(dev)
        kpm[0] = True
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    ref, ref_lse = reference.attention(qr, kr, vr, is_causal=is_causal, key_padding_mask=kpm)
    ref.backward(dout)
    lay = L.Layout(layout)
    sh = lambda t, dim=2: L.shard(t, dim, rank, world, lay)  # noqa: E731
    ql, kl, vl = (sh(t).bfloat16().requires_grad_() for t in (q, k, v))
    out, lse = ringcc.ring_attention(
        ql, kl, vl, is_causal=is_causal, layout=layout, return_lse=True,
        key_padding_mask=None if kpm is None else sh(kpm, 1),
    )
    out.backward(sh(dout).bfloat16())
    errs = {
        "out": _rel(out, sh(ref.detach())),
        "lse": float((lse - sh(ref_lse.detach(), 2)).abs().nan_to_num(0.0).max()),
        "dq": _rel(ql.grad, sh(qr.grad)),
        "dk": _rel(kl.grad, sh(kr.grad)),
        "dv": _rel(vl.grad, sh(vr.grad)),
    }
    return errs


@pytest.mark.skipif(not WORLDS, reason="needs >= 2 CUDA devices")
@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("kernel", ["cudnn", "flash"])
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("h,g,padded", [(8, 8, False), (8, 2, False), (8, 1, False), (8, 2, True)])
def test_ring_nccl_bf16(pools, world, kernel, is_causal, layout, h, g, padded):
    for rank_errs in pools(world, "nccl").run(case_ring_nccl, kernel, is_causal, layout, h, g, padded):
        for name, err in rank_errs.items():
            assert err < (0.05 if name == "lse" else REL), (name, err, rank_errs)


@pytest.mark.skipif(not WORLDS, reason="needs >= 2 CUDA devices")
@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("h,g,padded", [(8, 8, False), (8, 2, True)])
def test_ring_nccl_bf16_head_chunks(pools, world, is_causal, layout, h, g, padded):
    # The ring once per K/V head (a 1 KiB workspace budget): same tolerance as above.
    for rank_errs in pools(world, "nccl").run(case_ring_nccl, "cudnn", is_causal, layout, h, g, padded, "0.001"):
        for name, err in rank_errs.items():
            assert err < (0.05 if name == "lse" else REL), (name, err, rank_errs)
