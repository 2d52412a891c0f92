"""The check of runtime/fused.py's Triton kernels against merge.py's torch code, shared by the GPU
test (tests/test_ring_gpu.py) and the CPU one through Triton's interpreter (tests/test_fused.py).

On the views the ring makes (a head-chunk slice with a row range, a block output, an fp32
accumulator merged in place, the output written in the input dtype), with rows that saw no key
(lse = -inf): the merge within fp32 rounding, the widening add (two blocks, or an fp32
accumulator and a block) a pair of adds in one launch, and the copy (same dtype, widening, narrowing) bit for bit."""

import torch


def check(device: str, dtypes, ds=(24,)) -> None:
    from ringcc.runtime import fused
    from ringcc.runtime.merge import _merge_to

    gen = torch.Generator(device=device).manual_seed(0)
    rnd = lambda *shape: torch.randn(*shape, device=device, generator=gen)  # noqa: E731
    for dt in dtypes:
        for d in ds:
            b, H, L = 2, 6, 37
            full_o, full_l = rnd(b, H, L, d).to(dt), rnd(b, H, L)
            full_l[0, 1, 5:8] = float("-inf")
            oa, la = full_o[:, 1:4, 5:30], full_l[:, 1:4, 5:30]
            ob, lb = rnd(b, 3, 25, d).to(dt), rnd(b, 3, 25)
            lb[0, 0, :2] = float("-inf")  # rows 0, 1 of head 0 saw no key on either side
            for dst_dtype in (dt, torch.float32):
                want_o, want_l = torch.empty(b, 3, 25, d, device=device), torch.empty(b, 3, 25, device=device)
                _merge_to(want_o, want_l, oa, la, ob, lb)
                got_o, got_l = torch.empty(b, 3, 25, d, device=device, dtype=dst_dtype), torch.empty_like(want_l)
                assert fused.available((got_o, oa, ob), (got_l, la, lb))
                fused.merge(got_o, got_l, oa, la, ob, lb)
                tol = 1e-5 if dst_dtype == torch.float32 else 1e-2
                assert torch.allclose(got_o.float(), want_o.to(dst_dtype).float(), atol=tol, rtol=tol)
                assert torch.allclose(got_l, want_l, atol=1e-5, rtol=1e-5)
                assert bool(torch.isneginf(got_l[0, 0, :2]).all()) and bool((got_o[0, 0, :2] == 0).all())
            acc_o, acc_l = full_o.float()[:, 1:4, 5:30], full_l.clone()[:, 1:4, 5:30]  # in place, strided
            want_o, want_l = torch.empty_like(acc_o), torch.empty_like(acc_l)
            _merge_to(want_o, want_l, acc_o, acc_l, ob, lb)
            fused.merge(acc_o, acc_l, acc_o, acc_l, ob, lb)
            assert torch.allclose(acc_o, want_o, atol=1e-5, rtol=1e-5)
            assert torch.allclose(acc_l, want_l, atol=1e-5, rtol=1e-5)
            for dst_dtype in (torch.float32, dt):
                dst_full = torch.zeros(b, H, L, d, device=device, dtype=dst_dtype)
                fused.add(dst_full[:, 1:4, 5:30], oa, ob)
                assert torch.equal(dst_full[:, 1:4, 5:30], (oa.float() + ob.float()).to(dst_dtype))
                assert float(dst_full[:, 0].abs().sum()) == 0 and float(dst_full[:, :, :5].abs().sum()) == 0
                acc = (full_o.float() * 1.7)[:, 1:4, 5:30]  # an fp32 accumulator plus a block, mixed dtypes
                fused.add(dst_full[:, 1:4, 5:30], acc, ob)
                assert torch.equal(dst_full[:, 1:4, 5:30], (acc + ob.float()).to(dst_dtype))
                dst2 = torch.zeros_like(dst_full)  # a pair in one launch: dK with dV
                acc2, ob2 = (full_o.float() * -0.85)[:, 1:4, 5:30], ob * 3
                first, second = (dst_full[:, 1:4, 5:30], acc, ob), (dst2[:, 1:4, 5:30], acc2, ob2)
                assert all(fused._alike(x, y) for x, y in zip(first, second))
                fused.add(dst_full[:, 1:4, 5:30], acc, ob, pair=(dst2[:, 1:4, 5:30], acc2, ob2))
                assert torch.equal(dst_full[:, 1:4, 5:30], (acc + ob.float()).to(dst_dtype))
                assert torch.equal(dst2[:, 1:4, 5:30], (acc2 + ob2.float()).to(dst_dtype))
                assert float(dst2[:, 0].abs().sum()) == 0 and float(dst2[:, :, :5].abs().sum()) == 0
                fused.add(dst2[:, 1:4, 5:30], oa, ob, pair=(dst_full[:, 1:4, 5:30], acc, ob))  # unlike: two launches
                assert torch.equal(dst2[:, 1:4, 5:30], (oa.float() + ob.float()).to(dst_dtype))
                for src in (oa, acc):  # the copy: same dtype, widened or narrowed, into a strided view
                    dst_full.zero_()
                    fused.copy(dst_full[:, 1:4, 5:30], src)
                    want = src.to(dst_dtype)
                    bits = {2: torch.int16, 4: torch.int32}[want.element_size()]
                    assert torch.equal(dst_full[:, 1:4, 5:30].contiguous().view(bits), want.contiguous().view(bits))
                    assert float(dst_full[:, 0].abs().sum()) == 0 and float(dst_full[:, :, :5].abs().sum()) == 0
            # Launched again, a kernel comes from the kept compiled ones (Note [Direct launches]);
            # an operand whose address is not 16-byte aligned takes a kernel of its own.
            flat = rnd(2 * 3 * 25 * d + 8).to(dt)
            for off in (0, 1, 0, 1, 8):
                x = flat[off:off + 2 * 3 * 25 * d].view(2, 3, 25, d)
                y = (x * 0.5).float()
                for dst_dtype in (torch.float32, dt):
                    got = torch.full((2, 3, 25, d), float("nan"), device=device, dtype=dst_dtype)
                    fused.add(got, y, x)
                    assert torch.equal(got, (y + x.float()).to(dst_dtype)), (off, dst_dtype)
                    fused.copy(got, x)
                    assert torch.equal(got, x.to(dst_dtype)), (off, dst_dtype)
                got_o, got_l = torch.empty_like(y), torch.empty(2, 3, 25, device=device)
                la2 = rnd(2, 3, 25)
                fused.merge(got_o, got_l, x, la2, y, la2)  # equal lse: the mean of the two
                assert torch.allclose(got_o, (x.float() + y) / 2, atol=1e-5, rtol=1e-5), off
    if device == "cuda":  # launched directly, several kernels kept: aligned and unaligned operands apart
        assert fused._ADD.direct and len(fused._ADD.kernels) >= 2 and fused._MERGE.direct
    assert not fused.available((torch.empty(2, 3, 4, 8, dtype=torch.float64, device=device),))  # fp64: torch's
