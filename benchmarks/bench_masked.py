"""Masked ring attention: time and memory of key padding and sliding windows next to the
unmasked ring, per rank, at the launched p (causal, b = 1; contiguous layout by default,
`--layout auto` as the backend picks: zigzag for causal cases without a window).

    torchrun --nproc-per-node 4 benchmarks/bench_masked.py --json masked.json
    torchrun --nproc-per-node 2 benchmarks/bench_masked.py --smoke          # CPU / gloo, tiny
    torchrun --nproc-per-node 1 benchmarks/bench_masked.py --vs-flex --json kernels.json

--vs-flex (one GPU): masked and modified attention through ringcc.ring_attention over a group
of one (its block kernels: flex.py, kernels.py) against flex_attention compiled alone with the
same BlockMask and score_mod, forward and backward, b = 1, h = 16, d = 128, bf16: soft-cap,
ALiBi and a 4096 window at 16K and 64K tokens, causal document masks (8 equal documents in 32K,
64 in 128K), and plain causal / non-causal (ringcc on cuDNN). Both run in one process, alternated
per cell, each cell compiled afresh (static shapes, as a run at one length); the table gives
the medians of steps timed one at a time (the GPU idle until the host
issues the step's first kernel), ringcc's speed over flex's, the same speed back to back ("queued":
--reps steps issued with no wait between them, as a training loop issues its layers), and the largest difference of ringcc's output and gradients from flex's (relative to
the largest value).

On CUDA, masked bf16 blocks run flex_attention (runtime/flex.py, Note [Flex blocks]), or with
RINGCC_MASKED_KERNEL=math the exact math path in chunks of query rows over the keys they may see
(runtime/kernels.py, Note [Masked rows]); unmasked blocks run the fused kernels. Each cell:
--warmup iterations (the first compiles flex_attention's kernels), then the
median of --reps forward+backward iterations (CUDA events on GPU), and the step's peak memory
above what was allocated before it (max_memory_allocated; the copy-engine receive area is
outside the allocator, as in bench_planner_gpu.py). The table gives the slowest rank's time
and the largest rank's memory.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

import dist_setup
import ringcc
from ringcc.runtime.layout import Layout, global_positions

# name -> (key padding, window). Padding "tail" / "head": the sequence's last / first eighth (every
# rank's valid keys are one run: fused kernels on cut blocks, ring.clip_calls); "gaps": the last
# eighth of every 512 keys (no rank's valid keys one run: every block masked, on flex_attention or
# the math path). "rows": two batch rows, padded at the end to their own lengths (the last eighth
# and the last quarter: every rank's valid keys one run per row, calls per row), with its unmasked
# twin of two rows.
CASES = {
    "unmasked": (None, None),
    "key padding": ("tail", None),
    "left padding": ("head", None),
    "key gaps": ("gaps", None),
    "window": (None, 2048),
    "window + key padding": ("tail", 2048),
    "unmasked, 2 rows": ("none", None),
    "row padding, 2 rows": ("rows", None),
}


def cell(case: str, n_local: int, heads: int, d: int, device, dtype, reps: int, warmup: int, smoke: bool,
         layout: str = "contiguous") -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    padding, window = CASES[case]
    if layout == "auto":  # the backend's choice (passes/rewrite_attention.py): zigzag balances the causal triangle
        layout = "contiguous" if window else "zigzag"
    if smoke and window:
        window = 24
    gen = torch.Generator().manual_seed(rank)
    b = 2 if padding in ("none", "rows") else 1
    q, k, v, dout = (torch.randn(b, heads, n_local, d, generator=gen).to(device, dtype) for _ in range(4))
    for t in (q, k, v):
        t.requires_grad_()
    pad = None
    pos = global_positions(rank, world, Layout(layout), n_local)
    if padding == "tail":
        pad = (pos >= world * n_local - world * n_local // 8)[None].to(device)
    elif padding == "head":
        pad = (pos < world * n_local // 8)[None].to(device)
    elif padding == "gaps":
        period = 32 if smoke else 512
        pad = (pos % period >= period - period // 8)[None].to(device)
    elif padding == "rows":
        n = world * n_local
        pad = torch.stack([pos >= n - n // 8, pos >= n - n // 4]).to(device)

    def step():
        # a new mask tensor per step, as a training loop's next batch brings (the ring
        # all-gathers its key-runs table once per call: runtime/ring.py, Note [Key runs per mask])
        mask = None if pad is None else pad.clone()
        out = ringcc.ring_attention(q, k, v, is_causal=True, key_padding_mask=mask, window=window, layout=layout)
        out.backward(dout)
        q.grad = k.grad = v.grad = None

    cuda = device.type == "cuda"
    t0 = time.perf_counter()
    for _ in range(warmup):
        step()
    if cuda:
        torch.cuda.synchronize()
    warm_s = time.perf_counter() - t0
    times = []
    if cuda:
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    for _ in range(reps):
        dist.barrier()
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            step()
            times.append((time.perf_counter() - t0) * 1e3)
    peak = torch.cuda.max_memory_allocated() - before if cuda else 0
    return {"case": case, "batch": b, "n_local": n_local, "p": world, "layout": layout, "ms": statistics.median(times),
            "peak_bytes": peak, "warmup_s": warm_s}


# --vs-flex: (case, tokens)
FLEX_CELLS = [("soft-cap", 16384), ("ALiBi", 16384), ("window 4096", 16384), ("8 documents", 32768),
              ("causal", 16384), ("non-causal", 16384), ("soft-cap", 65536), ("ALiBi", 65536), ("window 4096", 65536),
              ("64 documents", 131072), ("causal", 65536), ("non-causal", 65536)]
SOFTCAP, WINDOW = 50.0, 4096
DOCUMENTS = "maskfn v1 tensors=1\n%0 = load t0 b q\n%1 = load t0 b kv\n%2 = eq %0 %1\nreturn %2"


def _flex_mods(case: str, causal: bool, window, doc, slopes, pos_q=None):
    """flex_attention's (mask_mod, score_mod) of a --vs-flex cell; query row i at global position
    pos_q[i] (None: i)."""
    at = (lambda i: i) if pos_q is None else (lambda i: pos_q[i])  # noqa: E731

    def mask_mod(b, hh, i, j):
        pi = at(i)
        m = j <= pi if causal else pi >= 0
        if window:
            m = m & (pi - j < window)
        if doc is not None:
            m = m & (doc[0, pi] == doc[0, j])
        return m

    score_mod = None
    if case == "soft-cap":
        def score_mod(s, b, hh, i, j):
            return torch.tanh(s / SOFTCAP) * SOFTCAP
    elif case == "ALiBi":
        def score_mod(s, b, hh, i, j):
            return s + slopes[hh] * (j - at(i)).to(torch.float32)
    return mask_mod, score_mod


def flex_cell(case: str, n: int, device, reps: int, warmup: int, smoke: bool) -> dict:
    """One --vs-flex cell: ringcc against flex_attention alone (see the module's docstring)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    from ringcc import _compat
    from ringcc.runtime import ops

    h, d = (2, 16) if smoke else (16, 128)
    dtype = torch.float32 if smoke else torch.bfloat16
    gen = torch.Generator().manual_seed(n)
    q, k, v, dout = (torch.randn(1, h, n, d, generator=gen).to(device, dtype) for _ in range(4))
    for t in (q, k, v):
        t.requires_grad_()
    causal = case != "non-causal"
    slopes = (2.0 ** (-8.0 * torch.arange(1, h + 1) / h)).to(device)
    docs = int(case.split()[0]) if "documents" in case else 0
    doc = (torch.arange(n, device=device) // (n // docs))[None] if docs else None
    window = WINDOW if case.startswith("window") else None

    mask_mod, score_mod = _flex_mods(case, causal, window, doc, slopes)
    block = create_block_mask(mask_mod, 1, None, n, n, device=device, _compile=not smoke)
    flex = torch.compile(flex_attention) if not smoke else flex_attention
    group = _compat.group_name(dist.group.WORLD)

    def ring():
        if docs:
            return ops.ring_attention_call(q, k, v, None, True, d ** -0.5, group, 1, "contiguous", 0, None, None,
                                           DOCUMENTS, doc, None, None, None, "", None, None, None, None, None)[0]
        return ringcc.ring_attention(q, k, v, is_causal=causal, window=window,
                                     softcap=SOFTCAP if case == "soft-cap" else None,
                                     alibi_slopes=slopes if case == "ALiBi" else None)

    runs = {"ringcc": ring, "flex": lambda: flex(q, k, v, score_mod=score_mod, block_mask=block)}
    results = {}
    for name, fn in runs.items():  # outputs and gradients, for the comparison
        out = fn()
        out.backward(dout)
        results[name] = [out.detach().float()] + [t.grad.float() for t in (q, k, v)]
        q.grad = k.grad = v.grad = None
    err = max(float((a - b).abs().max() / b.abs().max().clamp_min(1e-6)) for a, b in zip(*results.values()))
    del results

    def step(fn):
        fn().backward(dout)
        q.grad = k.grad = v.grad = None

    times = {name: [] for name in runs}
    for it in range(warmup + reps):
        for name, fn in runs.items():
            ms = dist_setup.timed(lambda: step(fn), device, barrier=False)
            if it >= warmup:
                times[name].append(ms)
    ms = {name: statistics.median(t) for name, t in times.items()}
    # back to back: `reps` steps queued with no wait between them, as a training loop queues its
    # layers (the host's work per call hides behind the GPU's when the GPU is the slower)
    queued = {name: dist_setup.timed(lambda: [step(fn) for _ in range(reps)], device, barrier=False) / reps
              for name, fn in runs.items()}
    return {"case": case, "n": n, "ringcc_ms": ms["ringcc"], "flex_ms": ms["flex"],
            "speed_vs_flex": ms["flex"] / ms["ringcc"], "ringcc_queued_ms": queued["ringcc"],
            "flex_queued_ms": queued["flex"], "queued_speed_vs_flex": queued["flex"] / queued["ringcc"],
            "max_rel_diff": err}


# --schedule P: (case, tokens per GPU)
SCHEDULE_CELLS = [("soft-cap", 16384), ("ALiBi", 16384), ("window 4096", 16384), ("8 documents", 16384),
                  ("soft-cap", 65536), ("ALiBi", 65536), ("window 4096", 65536), ("8 documents", 65536)]


def schedule_cell(case: str, n_local: int, world: int, device, reps: int, warmup: int, smoke: bool) -> dict:
    """One --schedule cell: one rank's block schedule of a ring of `world` ranks, without
    transfers (RINGCC_SKIP_COMM=1: the rank's own K/V stand in for every rank's block, at that
    rank's positions), against flex_attention alone over the same queries and all n = world *
    n_local keys: every rank's block holds the rank's own K/V, so the two compute the same
    attention and their outputs and gradients compare (dK, dV: ringcc's are the sums over the
    blocks). Causal; zigzag rank 0 (the backend's layout), contiguous rank world - 1 with a
    window (the backend keeps a window's ring contiguous: that rank sees the most keys)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    from ringcc.runtime import maskfn
    from ringcc.runtime.ring import RingSetup, ring_backward, ring_forward

    h, d = (2, 16) if smoke else (16, 128)
    dtype = torch.float32 if smoke else torch.bfloat16
    n = world * n_local
    window = WINDOW if case.startswith("window") else 0
    layout = Layout.CONTIGUOUS if window else Layout.ZIGZAG
    rank = world - 1 if window else 0
    setup = RingSetup(dist.group.WORLD, rank, world, layout, True, d ** -0.5, window=window)
    gen = torch.Generator().manual_seed(n_local)
    q, k, v, dout = (torch.randn(1, h, n_local, d, generator=gen).to(device, dtype) for _ in range(4))
    slopes = (2.0 ** (-8.0 * torch.arange(1, h + 1) / h)).to(device)
    docs = int(case.split()[0]) if "documents" in case else 0
    doc = (torch.arange(n, device=device) // (n // docs))[None] if docs else None
    pos_q = setup.positions(rank, n_local, device)
    score = ((maskfn.builtin_score_fn(SOFTCAP, False), ()) if case == "soft-cap" else
             (maskfn.builtin_score_fn(None, True), (slopes.float(),)) if case == "ALiBi" else None)
    fn = (maskfn.parse(DOCUMENTS), (doc,)) if docs else None

    mask_mod, score_mod = _flex_mods(case, True, window, doc, slopes, pos_q)
    # all n keys: every rank's block is this rank's K/V at that rank's positions
    where = torch.cat([setup.positions(r, n_local, device) for r in range(world)]).long()
    k_all, v_all = (torch.empty(1, h, n, d, device=device, dtype=dtype).index_copy_(2, where, t.repeat(1, 1, world, 1))
                    for t in (k, v))
    block = create_block_mask(mask_mod, 1, None, n_local, n, device=device, _compile=not smoke)
    flex = torch.compile(flex_attention) if not smoke else flex_attention

    def ring():
        out, lse = ring_forward(q, k, v, None, setup, None, score, fn)
        return out, ring_backward(dout, q, k, v, None, out, lse, setup, None, score, fn)

    def alone():
        qq, kk, vv = (t.detach().requires_grad_() for t in (q, k_all, v_all))
        out = flex(qq, kk, vv, score_mod=score_mod, block_mask=block)
        out.backward(dout)
        # dK, dV of this rank's K/V: the sums over the blocks that hold it
        return out, (qq.grad, *(g.grad.index_select(2, where).view(1, h, world, n_local, d).sum(2) for g in (kk, vv)))

    runs = {"ringcc": ring, "flex": alone}
    with dist_setup.env_var("RINGCC_SKIP_COMM", "1"):
        results = {}
        for name, fn_ in runs.items():
            out, grads = fn_()
            results[name] = [out.detach().float()] + [g.float() for g in grads]
        err = max(float((a - b).abs().max() / b.abs().max().clamp_min(1e-6)) for a, b in zip(*results.values()))
        del results
        times = {name: [] for name in runs}
        for it in range(warmup + reps):
            for name, fn_ in runs.items():
                ms = dist_setup.timed(fn_, device, barrier=False)
                if it >= warmup:
                    times[name].append(ms)
    ms = {name: statistics.median(t) for name, t in times.items()}
    return {"case": case, "n_local": n_local, "p": world, "rank": rank, "layout": layout.value,
            "ringcc_ms": ms["ringcc"], "flex_ms": ms["flex"], "speed_vs_flex": ms["flex"] / ms["ringcc"],
            "max_rel_diff": err}


def vs_flex(args) -> int:
    device, _ = dist_setup.start(args.smoke)
    if dist.get_world_size() != 1:
        raise SystemExit(f"--vs-flex runs on one process (a group of one); got {dist.get_world_size()}")
    from ringcc.runtime import kernels

    table = SCHEDULE_CELLS if args.schedule else FLEX_CELLS
    cells = [(c, 256 if args.smoke else n) for c, n in table if not args.n_local or n in args.n_local]
    rows = []
    tokens = "per GPU" if args.schedule else "tokens"
    queued = "" if args.schedule else f" {'queued':>8}"
    print(f"{'case':14} {tokens:>7} {'ringcc ms':>10} {'flex ms':>9} {'vs flex':>8}{queued} {'max rel diff':>13}",
          flush=True)
    from ringcc import _compat

    info = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu (smoke, gloo)",
            "torch": torch.__version__, "dtype": "bfloat16" if device.type == "cuda" else "float32", "heads": 16,
            "d": 128, "b": 1, "reps": args.reps, "warmup": args.warmup, "softcap": SOFTCAP, "window": WINDOW,
            "schedule_p": args.schedule, "rows": rows}
    for case, n in cells:
        # each cell compiles afresh, as a run at one length would: dynamo's kernels for an earlier
        # cell's shapes would make this cell's recompile with dynamic shapes (slower kernels)
        torch._dynamo.reset()
        t0 = time.perf_counter()
        with _compat.flex_cpu_backward() if args.smoke else contextlib.nullcontext():  # CPU flex: its dense path
            if args.schedule:
                r = schedule_cell(case, n, args.schedule, device, args.reps, args.warmup, args.smoke)
            else:
                r = flex_cell(case, n, device, args.reps, args.warmup, args.smoke)
        rows.append(r)
        queued = "" if args.schedule else f" {r['queued_speed_vs_flex']:7.2f}x"
        print(f"{case:14} {n:>7} {r['ringcc_ms']:10.2f} {r['flex_ms']:9.2f} {r['speed_vs_flex']:7.2f}x{queued} "
              f"{r['max_rel_diff']:13.2e}   ({time.perf_counter() - t0:.0f} s with compiles)", flush=True)
        info["flex_fallbacks"] = {str(k): v for k, v in kernels._FLEX_FAILED.items()}
        with open(args.json_path, "w") as f:  # each cell as it comes: a long run cut short keeps what it measured
            json.dump(info, f, indent=2)
    dist_setup.finish(info, args.json_path)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on CPU with gloo, fp32")
    ap.add_argument("--n-local", type=int, nargs="*", default=None, help="tokens per rank (default 8192 16384)")
    ap.add_argument("--cases", nargs="*", default=list(CASES), choices=list(CASES))
    ap.add_argument("--reps", type=int, default=3, help="timed iterations per cell (the median is reported)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed iterations per cell first (default 2)")
    ap.add_argument("--layout", choices=["contiguous", "zigzag", "auto"], default="contiguous",
                    help="sequence layout; auto: zigzag for causal cases without a window, as the backend picks")
    ap.add_argument("--json", dest="json_path", default="masked.json")
    ap.add_argument("--schedule", type=int, default=0, metavar="P",
                    help="with --vs-flex: one rank's block schedule of a ring of P ranks without transfers, against "
                    "flex_attention over the same queries and all keys (see schedule_cell)")
    ap.add_argument("--vs-flex", action="store_true", help="one GPU: ringcc's masked and modified blocks against "
                    "flex_attention alone (see the module's docstring)")
    args = ap.parse_args(argv)
    if args.reps < 1 or args.warmup < 1:
        ap.error(f"--reps and --warmup must be >= 1; got {args.reps} and {args.warmup}")
    if args.schedule and (not args.vs_flex or args.schedule < 2):
        ap.error(f"--schedule P takes --vs-flex and P >= 2; got P={args.schedule}")
    if args.vs_flex:
        return vs_flex(args)

    device, dtype = dist_setup.start(args.smoke)
    use_cuda = device.type == "cuda"
    rank = dist.get_rank()
    heads, d = (2, 16) if args.smoke else (16, 128)
    lengths = args.n_local or ([64] if args.smoke else [8192, 16384])
    rows = []
    for n_local in lengths:
        for case in args.cases:
            row = cell(case, n_local, heads, d, device, dtype, args.reps, args.warmup, args.smoke, args.layout)
            gathered = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, row)
            if rank == 0:
                worst = dict(row, ms=max(r["ms"] for r in gathered), peak_bytes=max(r["peak_bytes"] for r in gathered),
                             warmup_s=max(r["warmup_s"] for r in gathered))
                rows.append(worst)
                print(f"{case:22} n_local={n_local:>6} p={worst['p']} {worst['layout']:10} {worst['ms']:9.2f} ms  "
                      f"peak {worst['peak_bytes'] / 2**20:8.1f} MiB  (warm-up {worst['warmup_s']:.1f} s)", flush=True)
    info = None
    if rank == 0:
        info = {"device": torch.cuda.get_device_name() if use_cuda else "cpu (smoke, gloo)",
                "torch": torch.__version__, "dtype": str(dtype), "heads": heads, "d": d, "causal": True,
                "layout": args.layout, "reps": args.reps, "warmup": args.warmup,
                "masked_kernel": os.environ.get("RINGCC_MASKED_KERNEL", "flex") if use_cuda else "cpu",
                "rows": rows}
    dist_setup.finish(info, args.json_path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
