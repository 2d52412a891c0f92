"""runtime/fused.py's Triton kernels on CPU, through Triton's interpreter (TRITON_INTERPRET=1, set
before the kernels are defined, so in a subprocess). Needs the `triton` package, which CPU builds
of torch do not bring: skipped without it. The same kernels on a GPU, in bf16 too:
tests/test_ring_gpu.py::test_triton_sums_match_torch."""

import os
import subprocess
import sys

import pytest

CHECK = r'''
import torch
from ringcc.runtime import fused
from ringcc.runtime.merge import _merge_to

torch.manual_seed(0)
for dt in (torch.float32, torch.float16):
    b, H, L, D = 2, 6, 37, 24
    full_o, full_l = torch.randn(b, H, L, D).to(dt), torch.randn(b, H, L)
    full_l[0, 1, 5:8] = float("-inf")
    oa, la = full_o[:, 1:4, 5:30], full_l[:, 1:4, 5:30]  # a head-chunk slice and a row range
    ob, lb = torch.randn(b, 3, 25, D).to(dt), torch.randn(b, 3, 25)
    lb[0, 0, :2] = float("-inf")  # rows 0, 1 of head 0 saw no key on either side
    want_o, want_l = torch.empty(b, 3, 25, D), torch.empty(b, 3, 25)
    _merge_to(want_o, want_l, oa, la, ob, lb)
    got_o, got_l = torch.empty(b, 3, 25, D, dtype=dt), torch.empty(b, 3, 25)
    assert fused.available((got_o, oa, ob), (got_l, la, lb))
    fused.merge(got_o, got_l, oa, la, ob, lb)
    tol = 1e-5 if dt == torch.float32 else 1e-2
    assert torch.allclose(got_o.float(), want_o.to(dt).float(), atol=tol, rtol=tol)
    assert torch.allclose(got_l, want_l, atol=1e-5, rtol=1e-5)
    assert bool(torch.isneginf(got_l[0, 0, :2]).all()) and bool((got_o[0, 0, :2] == 0).all())
    acc_o, acc_l = full_o.float()[:, 1:4, 5:30], full_l.clone()[:, 1:4, 5:30]  # in place, strided
    want_o, want_l = torch.empty_like(acc_o), torch.empty_like(acc_l)
    _merge_to(want_o, want_l, acc_o, acc_l, ob, lb)
    fused.merge(acc_o, acc_l, acc_o, acc_l, ob, lb)
    assert torch.allclose(acc_o, want_o, atol=1e-5, rtol=1e-5)
    assert torch.allclose(acc_l, want_l, atol=1e-5, rtol=1e-5)
    dst_full = torch.zeros(b, H, L, D)
    fused.add(dst_full[:, 1:4, 5:30], oa, ob)
    assert torch.equal(dst_full[:, 1:4, 5:30], oa.float() + ob.float())
    assert float(dst_full[:, 0].abs().sum()) == 0 and float(dst_full[:, :, :5].abs().sum()) == 0
    assert not fused.available((torch.empty(2, 3, 4, 8, dtype=torch.float64),))  # fp64: torch's code
print("ok")
'''


def test_triton_sums_in_the_interpreter():
    pytest.importorskip("triton")
    proc = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, TRITON_INTERPRET="1"), cwd="/")
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stdout[-2000:] + proc.stderr[-3000:]
