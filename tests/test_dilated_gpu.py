"""Dilated attention on NCCL in bf16 (tier 4). Skipped without CUDA.

Tolerance: outputs and gradients within 2e-2 relative (max-norm) of the fp32 dense reference
computed from the same (bf16-representable) inputs; LSE within 0.05 absolute. bf16 inputs,
fp32 accumulation and merge. Segments shorter than, equal to and longer than the shard
(n_local = 256), one clipped to the sequence; LongNet's geometric w with r = 1, 2, 4, ...
"""

import os

import pytest
import torch

import ringcc
from parity import lse_err, rel_err
from ringcc import reference
from ringcc.runtime import layout as L
from ringcc.runtime import workspace

pytestmark = pytest.mark.gpu

N_GPU = torch.cuda.device_count() if torch.cuda.is_available() else 0
WORLDS = [w for w in (1, 2, 4) if w <= N_GPU]
REL = 2e-2
N_LOCAL = 256
LONGNET = {
    1: ([64, 128, 256, 1024], [1, 2, 4, 8]),
    2: ([64, 256, 512, 2048], [1, 2, 4, 8]),
    4: ([64, 256, 512, 1024, 4096], [1, 2, 4, 8, 16]),
}


def case_dilated_nccl(rank, world, kernel, offsets, is_causal, h, g, budget_mib=None):
    os.environ["RINGCC_CUDA_KERNEL"] = kernel
    if budget_mib is None:
        os.environ.pop("RINGCC_RING_WORKSPACE_MIB", None)
    else:  # head chunks (Note [Dilated head chunks])
        os.environ["RINGCC_RING_WORKSPACE_MIB"] = budget_mib
    dev = torch.device("cuda", rank)
    b, d = 2, 64
    n = N_LOCAL * world
    spec = ringcc.DilatedSpec(*LONGNET[world], offsets=offsets)
    gen = torch.Generator(device="cpu").manual_seed(11)
    # Round to bf16 first so that the fp32 reference sees exactly the kernel's inputs.
    q, k, v, dout = (torch.randn(b, hh, n, d, generator=gen).bfloat16().float().to(dev) for hh in (h, g, g, h))
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    ref, ref_lse = reference.dilated_attention(qr, kr, vr, spec, is_causal=is_causal)
    ref.backward(dout)
    sh = lambda t: L.shard(t, 2, rank, world, L.Layout.CONTIGUOUS)  # noqa: E731
    ql, kl, vl = (sh(t).bfloat16().requires_grad_() for t in (q, k, v))
    out, lse = ringcc.dilated_attention(ql, kl, vl, spec, is_causal=is_causal, return_lse=True)
    out.backward(sh(dout).bfloat16())
    if budget_mib is not None:
        assert workspace.dilated_kv_chunk(ql, kl, spec, world, "contiguous") == (1, 1)
    ref_lse_l = sh(ref_lse.detach())
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse_l))
    return {
        "out": rel_err(out, sh(ref.detach())),
        "lse": lse_err(lse, ref_lse_l),
        "dq": rel_err(ql.grad, sh(qr.grad)),
        "dk": rel_err(kl.grad, sh(kr.grad)),
        "dv": rel_err(vl.grad, sh(vr.grad)),
    }


@pytest.mark.skipif(not WORLDS, reason="needs CUDA")
@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("kernel", ["cudnn", "flash"])
@pytest.mark.parametrize("offsets", ["per_head", "head_groups"])
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("h,g", [(8, 8), (8, 2)])
def test_dilated_nccl_bf16(pools, world, kernel, offsets, is_causal, h, g):
    for rank_errs in pools(world, "nccl").run(case_dilated_nccl, kernel, offsets, is_causal, h, g):
        for name, err in rank_errs.items():
            assert err < (0.05 if name == "lse" else REL), (name, err, rank_errs)


@pytest.mark.skipif(not WORLDS, reason="needs CUDA")
@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("offsets", ["per_head", "head_groups"])
@pytest.mark.parametrize("h,g", [(8, 8), (8, 2)])
def test_dilated_head_chunks_nccl_bf16(pools, world, offsets, h, g):
    # One K/V head per chunk (a tiny workspace budget), causal, cuDNN kernels.
    for rank_errs in pools(world, "nccl").run(case_dilated_nccl, "cudnn", offsets, True, h, g, "0.0001"):
        for name, err in rank_errs.items():
            assert err < (0.05 if name == "lse" else REL), (name, err, rank_errs)
