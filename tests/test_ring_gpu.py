"""Ring attention on NCCL in bf16 (tier 4). Skipped without at least 2 CUDA devices.

Tolerance: outputs and gradients within 2e-2 relative (max-norm) of the fp32 dense reference;
bf16 inputs, fp32 accumulation and merge.
"""

import os

import pytest
import torch

import ringcc
from parity import counting_key_runs, lse_err, rel_err
from ringcc import reference
from ringcc.runtime import layout as L

pytestmark = pytest.mark.gpu

N_GPU = torch.cuda.device_count() if torch.cuda.is_available() else 0
WORLDS = [w for w in (2, 4) if w <= N_GPU]
REL = 2e-2


def case_ring_nccl(rank, world, kernel, is_causal, layout, h, g, padded, workspace_mib="512", window=None,
                   device_type="cuda"):
    """padded: True (random keys, batch row 0 all padding), "tail" / "head" (the sequence's last /
    first fifth: every rank's valid keys are one run of its block, so every block runs the fused
    kernels, cut to those keys: ring.clip_calls), "gap" (8 keys at the start of the last fifth: the rank
    holding them keeps its mask, flex_attention), "rows" (each batch row padded at its end to its own
    length: calls per batch row) or False."""
    os.environ["RINGCC_CUDA_KERNEL"] = kernel
    os.environ["RINGCC_RING_WORKSPACE_MIB"] = workspace_mib  # tiny: one K/V head per chunk
    dev = torch.device(device_type, rank) if device_type == "cuda" else torch.device(device_type)
    n_local, b, d = 256, 2, 128
    n = n_local * world
    gen = torch.Generator(device="cpu").manual_seed(7)
    q, k, v, dout = (torch.randn(b, hh, n, d, generator=gen).to(dev) for hh in (h, g, g, h))
    kpm = None
    if padded == "tail":
        kpm = torch.zeros(b, n, dtype=torch.bool, device=dev)
        kpm[:, -n // 5:] = True
    elif padded == "head":
        kpm = torch.zeros(b, n, dtype=torch.bool, device=dev)
        kpm[:, :n // 5] = True
    elif padded == "gap":
        kpm = torch.zeros(b, n, dtype=torch.bool, device=dev)
        kpm[:, n - n // 5:n - n // 5 + 8] = True
    elif padded == "rows":
        kpm = torch.zeros(b, n, dtype=torch.bool, device=dev)
        for i in range(b):
            kpm[i, n - (i + 1) * n // (2 * b + 1):] = True
    elif padded:
        kpm = (torch.rand(b, n, generator=gen) < 0.2).to(dev)
        kpm[0] = True
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    ref, ref_lse = reference.attention(qr, kr, vr, is_causal=is_causal, key_padding_mask=kpm, window=window)
    ref.backward(dout)
    lay = L.Layout(layout)
    sh = lambda t, dim=2: L.shard(t, dim, rank, world, lay)  # noqa: E731
    ql, kl, vl = (sh(t).bfloat16().requires_grad_() for t in (q, k, v))
    out, lse = ringcc.ring_attention(
        ql, kl, vl, is_causal=is_causal, layout=layout, return_lse=True,
        key_padding_mask=None if kpm is None else sh(kpm, 1), window=window,
    )
    out.backward(sh(dout).bfloat16())
    errs = {
        "out": rel_err(out, sh(ref.detach())),
        "lse": lse_err(lse, sh(ref_lse.detach(), 2)),
        "dq": rel_err(ql.grad, sh(qr.grad)),
        "dk": rel_err(kl.grad, sh(kr.grad)),
        "dv": rel_err(vl.grad, sh(vr.grad)),
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
@pytest.mark.parametrize("kernel,layout,padded,window", [
    ("cudnn", "contiguous", "tail", None), ("cudnn", "zigzag", "tail", None), ("flash", "zigzag", "tail", None),
    ("cudnn", "contiguous", "head", None), ("cudnn", "zigzag", "gap", None), ("cudnn", "contiguous", False, 100), ("cudnn", "contiguous", "tail", 100),
    ("cudnn", "contiguous", "gap", 100), ("cudnn", "zigzag", "rows", None), ("flash", "contiguous", "rows", 100)])
def test_ring_nccl_bf16_masked(pools, world, kernel, is_causal, layout, padded, window):
    """Masked rings on NCCL, GQA, against the fp32 dense reference: padding at the end or start,
    or rows padded to different lengths (every block on the fused kernels, cut to its valid keys
    per run of batch rows: ring._key_runs, ring.clip_calls), a
    gap (that rank's blocks keep the mask) and sliding windows, the masked blocks on
    flex_attention (runtime/flex.py)."""
    for rank_errs in pools(world, "nccl").run(case_ring_nccl, kernel, is_causal, layout, 8, 2, padded, "512", window):
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


def case_settings_agree(rank, world, is_causal, layout, g, shapes, setting, values):
    """The ring under each value of one setting (e.g. the transport), for several shapes in turn
    (the copy-engine receive area grows and is reused): outputs bitwise equal, since the
    schedule and kernels are the same and only the transfer differs; gradients within bf16
    rounding (the kernels' backward may accumulate dQ with atomics, in any order)."""
    from ringcc.runtime import comm

    dev = torch.device("cuda", rank)
    os.environ["RINGCC_CUDA_KERNEL"] = "cudnn"
    saved = {k: os.environ.get(k) for k in (setting, "RINGCC_RING_WORKSPACE_MIB")}
    results = {}
    for value in values:
        os.environ[setting] = value
        for i, (h, n_local, budget) in enumerate(shapes):
            os.environ["RINGCC_RING_WORKSPACE_MIB"] = budget
            gen = torch.Generator(device="cpu").manual_seed(n_local + h)
            q, k, v, dout = (torch.randn(1, hh, n_local, 128, generator=gen).to(dev).bfloat16() for hh in (h, g, g, h))
            ql, kl, vl = (t.clone().requires_grad_() for t in (q, k, v))
            out = ringcc.ring_attention(ql, kl, vl, is_causal=is_causal, layout=layout)
            out.backward(dout)
            results[(value, i)] = [t.detach().clone() for t in (out, ql.grad, kl.grad, vl.grad)]
        if setting == "RINGCC_RING_TRANSPORT" and value == "copy-engine":
            assert comm.comm_buffer_bytes(dev) > 0, "the copy-engine ring did not run"
    for key, old in saved.items():
        if old is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = old
    mismatched = []
    for i, (h, n_local, budget) in enumerate(shapes):  # a shape may come twice (a reused area)
        a, b = (results[(value, i)] for value in values)
        if not torch.equal(a[0], b[0]):
            mismatched.append((h, n_local, budget, "out", rel_err(b[0], a[0])))
        mismatched += [(h, n_local, budget, name, rel_err(y, x))
                       for name, x, y in zip(("dq", "dk", "dv"), a[1:], b[1:]) if rel_err(y, x) > 1e-2]
    return mismatched


# Small, large (the area grows), chunked (one K/V head per chunk: many batches), then small
# again (the large area is reused).
SHAPES = [(8, 256, "auto"), (8, 2048, "auto"), (8, 1024, "0.001"), (8, 256, "auto")]


@pytest.mark.skipif(not WORLDS, reason="needs >= 2 CUDA devices")
@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("is_causal,layout", [(True, "zigzag"), (False, "contiguous")])
@pytest.mark.parametrize("g", [8, 2])
def test_copy_engine_ring_matches_nccl(pools, world, is_causal, layout, g):
    for mismatched in pools(world, "nccl").run(case_settings_agree, is_causal, layout, g, SHAPES,
                                               "RINGCC_RING_TRANSPORT", ("nccl", "copy-engine")):
        assert mismatched == []


@pytest.mark.skipif(not WORLDS, reason="needs >= 2 CUDA devices")
@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("is_causal,layout", [(True, "zigzag"), (False, "contiguous")])
@pytest.mark.parametrize("transport", ["copy-engine", "nccl"])
def test_ring_graphs_match_the_ring_without_them(pools, world, is_causal, layout, transport):
    """RINGCC_RING_GRAPHS=on against off on each transport: the same schedule and kernels,
    replayed from a CUDA graph (Note [Ring graphs]); the copy-engine graphs in areas of their own."""
    for mismatched in pools(world, "nccl").run(case_over, transport, case_settings_agree, is_causal, layout, 2,
                                               SHAPES, "RINGCC_RING_GRAPHS", ("off", "on")):
        assert mismatched == []


def case_over(rank, world, transport, case, *args):
    """`case` with the ring's transfers on `transport` (RINGCC_RING_TRANSPORT)."""
    os.environ["RINGCC_RING_TRANSPORT"] = transport
    try:
        return case(rank, world, *args)
    finally:
        os.environ.pop("RINGCC_RING_TRANSPORT", None)


def case_graph_replays(rank, world, is_causal):
    """Three calls of one signature with different inputs, graphs on: one capture per direction,
    replays that read each call's own inputs (errors against the ring without graphs), and
    outputs that do not share storage across calls."""
    from ringcc.runtime import graphs

    dev = torch.device("cuda", rank)
    graphs.clear()
    got, want, outs = [], [], []
    for setting in ("off", "on"):
        os.environ["RINGCC_RING_GRAPHS"] = setting
        for seed in (1, 2, 3):
            gen = torch.Generator(device="cpu").manual_seed(seed * 10 + rank)
            q, k, v, dout = (torch.randn(1, h, 512, 64, generator=gen).to(dev).bfloat16() for h in (8, 2, 2, 8))
            ql, kl, vl = (t.clone().requires_grad_() for t in (q, k, v))
            out = ringcc.ring_attention(ql, kl, vl, is_causal=is_causal, layout="zigzag")
            out.backward(dout)
            (got if setting == "on" else want).append([t.detach().clone() for t in (out, ql.grad, kl.grad, vl.grad)])
            if setting == "on":
                outs.append(out)
    os.environ.pop("RINGCC_RING_GRAPHS", None)
    captured = len(graphs._GRAPHS)
    graphs.clear()
    errs = [max(rel_err(y, x) for x, y in zip(a, b)) for a, b in zip(want, got)]
    distinct = len({o.data_ptr() for o in outs})
    return captured, errs, distinct


@pytest.mark.skipif(not WORLDS, reason="needs >= 2 CUDA devices")
@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("transport", ["copy-engine", "nccl"])
def test_ring_graphs_replay_each_calls_inputs(pools, world, is_causal, transport):
    for captured, errs, distinct in pools(world, "nccl").run(case_over, transport, case_graph_replays, is_causal):
        assert captured == 2 and distinct == 3 and max(errs) < 1e-2, (captured, errs, distinct)


@pytest.mark.skipif(N_GPU < 1, reason="needs a CUDA device")
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("g", [1, 2, 4])
def test_cudnn_native_gqa_matches_expanded_kv(monkeypatch, causal, g):
    """The cuDNN block kernels with K/V at g heads (native GQA) against the same kernels on
    K/V expanded to h heads with the gradients summed back (RINGCC_CUDNN_NATIVE_GQA=0)."""
    from ringcc.runtime import kernels

    monkeypatch.setenv("RINGCC_CUDA_KERNEL", "cudnn")
    gen = torch.Generator(device="cpu").manual_seed(g)
    h, s, d = 8, 512, 128
    q, dout = (torch.randn(2, h, s, d, generator=gen).cuda().bfloat16() for _ in range(2))
    k, v = (torch.randn(2, g, s, d, generator=gen).cuda().bfloat16() for _ in range(2))
    res = {}
    for native in ("1", "0"):
        monkeypatch.setenv("RINGCC_CUDNN_NATIVE_GQA", native)
        out, lse = kernels.block_fwd(q, k, v, scale=d ** -0.5, causal=causal)
        grads = kernels.block_bwd(dout, q, k, v, out, lse, scale=d ** -0.5, causal=causal)
        res[native] = (out, lse, *grads)
    assert kernels._cudnn_gqa_unsupported(q.device) is None
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), res["1"], res["0"]):
        assert a.shape == b.shape, (name, a.shape, b.shape)
        assert rel_err(a, b) < 1e-2, (name, rel_err(a, b))


@pytest.mark.skipif(N_GPU < 1, reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_copy_by_kernel_is_exact(dtype):
    """The ring's same-dtype copies run as kernels (not memcpys on the copy engines): every
    number bit for bit (-0.0 and inf included), into strided views too; a NaN stays a NaN (its
    payload may not: x * 1 gives the GPU's canonical NaN, as seen on H200)."""
    from ringcc.runtime.ring import copy_by_kernel

    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
    src = torch.randn(2, 4, 64, 8, device="cuda").to(dtype)
    src[0, 0, 0, :3] = torch.tensor([-0.0, float("inf"), float("nan")], dtype=dtype)
    dst = torch.empty(2, 8, 64, 8, device="cuda", dtype=dtype)
    copy_by_kernel(dst[:, 2:6], src)
    got = dst[:, 2:6]
    number = ~torch.isnan(src)
    assert bool((got.view(bits) == src.view(bits))[number].all())
    assert bool(torch.isnan(got[~number]).all())


@pytest.mark.skipif(N_GPU < 1, reason="needs a CUDA device")
def test_triton_sums_match_torch():
    """runtime/fused.py's Triton kernels against merge.py (tests/fused_check.py), bf16, fp16 and
    fp32, d = 128 and 80."""
    from ringcc.runtime import fused

    if fused.triton is None:
        pytest.skip("this torch build has no Triton")
    import fused_check

    fused_check.check("cuda", (torch.bfloat16, torch.float16, torch.float32), ds=(128, 80))


@pytest.mark.skipif(N_GPU < 1, reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("is_causal", [False, True])
def test_fp32_and_fp64_run_the_math_path_on_cuda(dtype, is_causal):
    """The CUDA flash and cuDNN kernels take fp16/bf16 only: fp32/fp64 blocks run the exact math
    path (one device, no process group), out and gradients as the reference's."""
    gen = torch.Generator(device="cpu").manual_seed(3)
    q, k, v, dout = (torch.randn(2, 4, 64, 32, generator=gen, dtype=dtype).cuda() for _ in range(4))
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    ref, _ = reference.attention(qr, kr, vr, is_causal=is_causal)
    ref.backward(dout)
    ql, kl, vl = (t.clone().requires_grad_() for t in (q, k, v))
    out = ringcc.ring_attention(ql, kl, vl, is_causal=is_causal)
    out.backward(dout)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(out, ref.detach(), **tol)
    for a, b in ((ql, qr), (kl, kr), (vl, vr)):
        torch.testing.assert_close(a.grad, b.grad, **tol)


@pytest.mark.skipif(N_GPU < 1, reason="needs a CUDA device")
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("padded,window", [(True, None), (False, 40), (True, 40)])
@pytest.mark.parametrize("kernel,rows_per_call", [("flex", None), ("math", None), ("math", 48)])
def test_masked_blocks_on_cuda(monkeypatch, is_causal, padded, window, kernel, rows_per_call):
    """A masked bf16 block on one GPU (kernels.block_fwd/block_bwd, as the ring calls them) on
    flex_attention (Note [Flex blocks]) and on the math path, whole and in chunks of query rows
    cut to the keys they may see (Note [Masked rows]), against the fp32 dense reference: GQA,
    key padding with rows that see no key (out 0, lse -inf, no gradient), sliding windows as
    positions (ring.WindowMask)."""
    from ringcc.runtime import kernels
    from ringcc.runtime.ring import WindowMask

    monkeypatch.setenv("RINGCC_MASKED_KERNEL", kernel)
    b, h, g, n, d = 2, 8, 2, 300, 64
    if rows_per_call:  # a row of fp32 scores per key and head
        monkeypatch.setattr(kernels, "MASKED_CALL_BYTES", 4 * b * h * n * rows_per_call)
    gen = torch.Generator(device="cpu").manual_seed(11)
    q, k, v, dout = (torch.randn(b, hh, n, d, generator=gen).cuda() for hh in (h, g, g, h))
    kpm = None
    if padded:
        kpm = (torch.rand(b, n, generator=gen) < 0.2).cuda()
        kpm[1, :70] = True  # batch row 1: with the causal band its first 70 rows see no key
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    ref, ref_lse = reference.attention(qr, kr, vr, is_causal=is_causal, key_padding_mask=kpm, window=window)
    ref.backward(dout)
    pos = torch.arange(n)
    allowed = None if window is None else WindowMask(pos.cuda().int(), pos.cuda().int(), window, is_causal, pos, pos)
    args = dict(scale=d ** -0.5, causal=is_causal, key_valid_bs=None if kpm is None else ~kpm, allowed_qk=allowed)
    qb, kb, vb = (t.bfloat16() for t in (q, k, v))
    out, lse = kernels.block_fwd(qb, kb, vb, **args)
    dq, dk, dv = kernels.block_bwd(dout.bfloat16(), qb, kb, vb, out, lse, **args)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32 and dk.shape == k.shape
    errs = {"out": rel_err(out, ref.detach()), "lse": lse_err(lse, ref_lse.detach()),
            "dq": rel_err(dq, qr.grad), "dk": rel_err(dk, kr.grad), "dv": rel_err(dv, vr.grad)}
    for name, err in errs.items():
        assert err < (0.05 if name == "lse" else REL), (name, err, errs)
    if padded and is_causal:
        assert bool(torch.isneginf(lse[1, :, :70]).all()) and not bool(out[1, :, :70].any())
        assert not bool(dq[1, :, :70].any())


def case_compiled_masked_model(rank, world, padded, device_type="cuda", checkpoint=False):
    """A 2-layer causal model whose attention mask is `causal & ~pad` (HF style), compiled with
    ringcc (inductor) on NCCL in bf16: loss and every weight gradient against the same model in
    fp32 eager on the full sequence, and the key-runs all-gathers per step (one table per mask:
    Note [Key runs per mask]). checkpoint: every layer under torch.utils.checkpoint, restored
    after the rewrite (Note [Checkpoint regions]): the recompute reuses the step's table."""
    import torch.utils.checkpoint
    import torch.nn as nn
    import torch.nn.functional as F

    dev = torch.device("cuda", rank) if device_type == "cuda" else torch.device(device_type)
    d, h, n = 256, 2, 256 * world

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)

        def forward(self, x, pad):
            b, s, _ = x.shape
            q, k, v = (t.view(b, s, h, d // h).transpose(1, 2) for t in self.qkv(x).split(d, dim=2))
            causal = torch.arange(s, device=x.device)[None, :] <= torch.arange(s, device=x.device)[:, None]
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=causal & ~pad[:, None, None, :])
            return x + self.proj(y.transpose(1, 2).reshape(b, s, d))

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([Layer(), Layer()])

        def forward(self, x, pad):
            for layer in self.layers:
                x = torch.utils.checkpoint.checkpoint(layer, x, pad, use_reentrant=False) if checkpoint else layer(x, pad)
            return x.float().pow(2).mean()

    torch.manual_seed(0)
    ref_model = Model().to(dev)
    model = Model().to(dev, torch.bfloat16)
    model.load_state_dict(ref_model.state_dict())
    x = torch.randn(1, n, d, generator=torch.Generator().manual_seed(1)).to(dev)
    pad = torch.zeros(1, n, dtype=torch.bool, device=dev)
    if padded == "tail":
        pad[:, -n // 5:] = True
    else:  # a gap: the rank holding it keeps its key mask (flex_attention)
        pad[:, n - n // 5:n - n // 5 + 8] = True
    ref_model(x, pad).backward()
    ringcc.reset_reports()
    compiled = torch.compile(model, backend=ringcc.backend(ringcc.Config(inner="inductor")))
    per_step = []
    with counting_key_runs() as calls:
        for _ in range(2):
            model.zero_grad()
            before = calls[0]
            loss = compiled(x.bfloat16(), pad)
            loss.backward()
            per_step.append(calls[0] - before)
    ref_loss = ref_model(x, pad)
    errs = {"loss": rel_err(loss.detach(), ref_loss.detach())}
    ref_params = dict(ref_model.named_parameters())
    for name, p in model.named_parameters():
        errs[name] = rel_err(p.grad, ref_params[name].grad)
    restored = any("2 activation-checkpoint region(s) holding attention rewritten and checkpointed again" in note
                   for r in ringcc.reports() for note in r.notes)
    assert restored == checkpoint, [r.notes for r in ringcc.reports()]
    torch._dynamo.reset()
    return per_step, errs


@pytest.mark.skipif(not WORLDS, reason="needs >= 2 CUDA devices")
@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("padded,checkpoint", [("tail", False), ("gap", False), ("tail", True)])
def test_compiled_masked_model_on_nccl(pools, world, padded, checkpoint):
    for per_step, errs in pools(world, "nccl").run(case_compiled_masked_model, padded, "cuda", checkpoint, timeout=300):
        assert per_step == [1, 1], per_step
        worst = max(errs.items(), key=lambda kv: kv[1])
        assert worst[1] < 5e-2, errs


def case_new_call_after_a_checked_one(rank, world):
    """Under TORCH_DISTRIBUTED_DEBUG=DETAIL, a rank that changes its shard length after a checked
    call gets the length error on every rank (without it, CUDA checks a call signature once, and
    this rank would enter the check alone: a hang until the NCCL timeout, ops._check_same_call)."""
    import torch.distributed as dist

    before = dist.get_debug_level()
    dist.set_debug_level(dist.DebugLevel.DETAIL)
    try:
        dev = torch.device("cuda", rank)
        q = torch.randn(1, 2, 64, 64, device=dev, dtype=torch.bfloat16)
        ringcc.ring_attention(q, q, q)  # the same call on every rank: checked
        s = 128 if rank == 1 else 64
        q = torch.randn(1, 2, s, 64, device=dev, dtype=torch.bfloat16)
        try:
            ringcc.ring_attention(q, q, q)
        except ValueError as e:
            return str(e)
        return "no error"
    finally:
        dist.set_debug_level(before)


@pytest.mark.skipif(not WORLDS, reason="needs >= 2 CUDA devices")
def test_debug_detail_checks_every_call_on_cuda(pools):
    for m in pools(2, "nccl").run(case_new_call_after_a_checked_one, timeout=120):
        assert "needs equal shard lengths on every rank" in m, m


@pytest.mark.skipif(N_GPU < 1, reason="needs a CUDA device")
def test_cuda_graph_replay_follows_the_key_mask():
    """ring_attention compiled with mode="reduce-overhead" (CUDA graphs) over batches padded to
    different lengths: traced, the ring op makes its own key-runs table, and a captured ring op
    keeps every key mask (ring._key_runs) instead of replaying the cuts of the recorded batch.
    (Without the traced op's own table, inductor's CUDA-graph recording fails: a host output
    inside the captured part.)"""
    def f(q, k, v, kpm):
        return ringcc.ring_attention(q, k, v, key_padding_mask=kpm)

    torch._dynamo.reset()
    compiled = torch.compile(f, mode="reduce-overhead")
    gen = torch.Generator().manual_seed(0)
    b, h, n, d = 2, 2, 64, 32
    q, k, v = (torch.randn(b, h, n, d, generator=gen).cuda() for _ in range(3))
    errs = []
    for tail in (8, 8, 8, 8, 40, 0, 20):
        kpm = torch.zeros(b, n, dtype=torch.bool, device="cuda")
        if tail:
            kpm[:, n - tail:] = True
        out = compiled(q, k, v, kpm).clone()
        errs.append(float((out - reference.attention(q, k, v, key_padding_mask=kpm)[0]).abs().max()))
    torch._dynamo.reset()
    assert max(errs) < 1e-3, errs
