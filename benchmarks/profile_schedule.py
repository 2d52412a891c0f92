"""Where one rank's ring schedule spends GPU time, on ONE GPU (no transfers).

    python benchmarks/profile_schedule.py --n-local 16384 --world 4 --json prof.json

The ring's compute on rank r of p does not depend on the transfers (RINGCC_SKIP_COMM=1 runs
the same kernel calls on the local K/V), so one GPU can replay a rank of a p-rank ring. For
each (n_local, causal) it measures, in one process:
  ref        the 1-GPU cuDNN kernel on the full length n_local * p (fwd+bwd), and ref / p, the
             time a rank would take at the single kernel's speed (efficiency = (ref / p) / ring);
  ring       one rank's schedule (rank 0 and rank p-1 for zigzag) with the default head
             chunks and with whole heads, median of CUDA-event timings;
  profile    one profiled iteration of the default schedule: kernel time by category
             (attention kernels, fused merge, elementwise/copies, other) and the idle time of
             the stream (the host launching too late);
  blocks     the attention kernels alone, at the schedule's block shapes, against ref / p:
             the floor that smaller kernel calls set before any merge or accumulation.
Prints a table and writes JSON (device named).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
from collections import defaultdict
from pathlib import Path

import torch


def _timed(fn, warmup: int, iters: int) -> list[float]:
    """Per-iteration milliseconds (CUDA events) after `warmup` calls, as the harness times."""
    from bench_attention import time_ms  # benchmarks/ is this script's directory
    from ring_timeline import Ranks

    return time_ms(fn, warmup, iters, Ranks(torch.device("cuda")))


def _category(name: str) -> str:
    n = name.lower()
    if any(s in n for s in ("sdpa", "fmha", "flash", "cudnn", "attention")):
        return "attention"
    if "triton" in n:
        return "fused merge (triton)"
    if any(s in n for s in ("elementwise", "copy", "cast", "fill", "add", "vectorized", "reduce", "memset", "memcpy")):
        return "elementwise/copy"
    return "other"


def _profile(fn) -> dict:
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    from ring_timeline import trace_events

    ks = [e for e in trace_events(prof) if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    by_cat: dict = defaultdict(float)
    count: dict = defaultdict(int)
    top: dict = defaultdict(float)
    for e in ks:
        c = _category(e["name"])
        by_cat[c] += e["dur"]
        count[c] += 1
        top[e["name"][:90]] += e["dur"]
    span = max(e["ts"] + e["dur"] for e in ks) - min(e["ts"] for e in ks)
    busy = sum(by_cat.values())
    return {"span_us": span, "busy_us": busy, "idle_us": span - busy,
            "by_category_us": dict(by_cat), "count": dict(count),
            "top_kernels_us": dict(sorted(top.items(), key=lambda kv: -kv[1])[:12])}


def run_case(args, n_local: int, causal: bool) -> dict:
    from ringcc.runtime import kernels, workspace
    from ringcc.runtime.layout import Layout
    from ringcc.runtime.ring import RingSetup, ring_backward, ring_forward

    dev = torch.device("cuda")
    p, h, d = args.world, args.heads, args.head_dim
    dt = torch.bfloat16
    scale = d ** -0.5
    gen = torch.Generator(device=dev).manual_seed(3)
    rnd = lambda *s: torch.randn(*s, device=dev, dtype=dt, generator=gen)  # noqa: E731
    rec: dict = {"n_local": n_local, "causal": causal, "world": p, "heads": h}

    # reference: the single kernel on the full length
    n = n_local * p
    qf, kf, vf, dof = (rnd(1, h, n, d) for _ in range(4))

    def ref():
        o, l = kernels.block_fwd(qf, kf, vf, scale=scale, causal=causal)
        kernels.block_bwd(dof, qf, kf, vf, o, l, scale=scale, causal=causal)

    rec["ref_ms"] = statistics.median(_timed(ref, 2, args.iters))
    del qf, kf, vf, dof
    torch.cuda.empty_cache()
    ideal = rec["ref_ms"] / p
    rec["ideal_rank_ms"] = ideal

    layout = Layout.ZIGZAG if causal else Layout.CONTIGUOUS
    q, k, v, dout = (rnd(1, h, n_local, d) for _ in range(4))
    os.environ["RINGCC_SKIP_COMM"] = "1"
    ranks = sorted({0, p - 1}) if causal else [0]
    settings = [("auto", "auto"), ("whole", "0")] + [(f"{m}MiB", m) for m in args.budgets]
    ab_name, ab_values = args.ab.split("=") if args.ab else ("", "")
    ab_values = ab_values.split(",") if ab_name else [None]
    rec["ring"] = []
    grads_by_value = {}
    for rank, (label, budget), ab in [(r, st, a) for r in ranks for st in settings for a in ab_values]:
        label_ab = label if ab is None else f"{label}/{ab}"
        if ab is not None:
            os.environ[ab_name] = ab
        os.environ["RINGCC_RING_WORKSPACE_MIB"] = budget
        kv_f, kv_b = (workspace.ring_kv_chunk(q, k, None, p, causal, forward=f) for f in (True, False))
        chunk = f"{kv_f or h}/{kv_b or h}"
        setup = RingSetup(None, rank, p, layout, causal, scale, kv_chunk=kv_b)
        setup_f = dataclasses.replace(setup, kv_chunk=kv_f)  # the forward's own chunks, as ops.py runs them

        def step():
            out, lse = ring_forward(q, k, v, None, setup_f)
            ring_backward(dout, q, k, v, None, out, lse, setup)

        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        ms = statistics.median(_timed(step, 2, args.iters))
        peak = torch.cuda.max_memory_allocated() - base
        r = {"rank": rank, "setting": label_ab, "heads_per_chunk": chunk, "ms": ms, "eff": ideal / ms,
             "peak_extra_mib": peak / 2**20}
        if label == "auto" and rank == ranks[0]:
            r["profile"] = _profile(step)
            # the A/B settings must not change a single bit of the results
            qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
            out, lse = ring_forward(qg, kg, vg, None, setup_f)
            got = [out, lse, *ring_backward(dout, qg, kg, vg, None, out, lse, setup)]
            torch.cuda.synchronize()
            ref_vals = grads_by_value.setdefault((rank, label), got)
            r["max_abs_diff_vs_first_ab"] = max(float((a.detach().float() - b.detach().float()).abs().max()) for a, b in zip(got, ref_vals))
            del qg, kg, vg, out, lse, got
        rec["ring"].append(r)
    grads_by_value.clear()
    os.environ["RINGCC_RING_WORKSPACE_MIB"] = "auto"
    if ab_name:
        os.environ.pop(ab_name, None)

    # the attention kernels alone, at the default schedule's block calls (rank ranks[0])
    # (forward, backward) heads per chunk, as the default schedule runs them
    hf, hb = (workspace.ring_kv_chunk(q, k, None, p, causal, forward=f) or h for f in (True, False))
    setup = RingSetup(None, ranks[0], p, layout, causal, scale, kv_chunk=hb)
    calls = [c for src_step in range(p) for c in setup.calls(n_local, (ranks[0] - src_step) % p)]
    q_f, k_f, v_f = (t[:, :hf].contiguous() for t in (q, k, v))
    qs, ks, vs, ds = (t[:, :hb].contiguous() for t in (q, k, v, dout))
    o_all, l_all = kernels.block_fwd(qs, ks, vs, scale=scale, causal=False)
    l_all = kernels.bwd_lse(l_all)

    def blocks():
        for _ in range(h // hf):
            for c in calls:
                kernels.block_fwd(q_f[:, :, c.q0:c.q1], k_f[:, :, c.k0:c.k1], v_f[:, :, c.k0:c.k1], scale=scale, causal=c.causal)
        for _ in range(h // hb):
            for c in calls:
                kernels.block_bwd(ds[:, :, c.q0:c.q1], qs[:, :, c.q0:c.q1], ks[:, :, c.k0:c.k1], vs[:, :, c.k0:c.k1],
                                  o_all[:, :, c.q0:c.q1], l_all[:, :, c.q0:c.q1], scale=scale, causal=c.causal,
                                  lse_prepared=True)

    rec["blocks_ms"] = statistics.median(_timed(blocks, 2, args.iters))
    rec["blocks_eff"] = ideal / rec["blocks_ms"]
    rec["block_calls"] = [[c.q1 - c.q0, c.k1 - c.k0, c.causal] for c in calls]
    del q, k, v, dout, q_f, k_f, v_f, qs, ks, vs, ds, o_all, l_all
    torch.cuda.empty_cache()
    return rec


def format_table(recs: list[dict]) -> str:
    head = f"{'n/GPU':>7} {'mask':>6} {'rank':>4} {'setting':>8} {'h/chunk f/b':>11} {'ms':>8} {'ideal':>8} {'eff':>6} {'extra MiB':>9}"
    lines = [head, "-" * len(head)]
    for r in recs:
        mask = "causal" if r["causal"] else "full"
        for x in r["ring"]:
            diff = x.get("max_abs_diff_vs_first_ab")
            lines.append(f"{r['n_local']:>7} {mask:>6} {x['rank']:>4} {x['setting']:>8} {x['heads_per_chunk']:>11} "
                         f"{x['ms']:>8.2f} {r['ideal_rank_ms']:>8.2f} {100 * x['eff']:>5.1f}% {x['peak_extra_mib']:>9.0f}"
                         + ("" if diff is None else f"  results vs first A/B value: max |diff| {diff:.3g}"))
        lines.append(f"{r['n_local']:>7} {mask:>6} {'':>4} {'kernels':>8} {'':>11} {r['blocks_ms']:>8.2f} "
                     f"{r['ideal_rank_ms']:>8.2f} {100 * r['blocks_eff']:>5.1f}%   (attention kernels alone)")
        prof = next((x["profile"] for x in r["ring"] if "profile" in x), None)
        if prof:
            parts = ", ".join(f"{k} {v / 1e3:.2f} ms ({prof['count'][k]})" for k, v in
                              sorted(prof["by_category_us"].items(), key=lambda kv: -kv[1]))
            lines.append(f"{'':>7} profile: span {prof['span_us'] / 1e3:.2f} ms, idle {prof['idle_us'] / 1e3:.2f} ms; {parts}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n-local", default="16384,65536", help="tokens per rank, comma-separated")
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--budgets", default="", help="extra RINGCC_RING_WORKSPACE_MIB settings, comma-separated")
    ap.add_argument("--ab", default="", help="A/B an environment setting, e.g. RINGCC_CUDA_KERNEL=cudnn,flash")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    args.budgets = [b for b in args.budgets.split(",") if b]
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    recs = []
    for n_local in (int(x) for x in args.n_local.split(",")):
        for causal in (True, False):
            recs.append(run_case(args, n_local, causal))
            print(format_table(recs[-1:]), flush=True)
    name = torch.cuda.get_device_name()
    print(f"\ndevice: {name}; torch {torch.__version__}; one rank of p={args.world} replayed, transfers skipped; "
          f"h={args.heads} d={args.head_dim} bf16 fwd+bwd")
    print(format_table(recs))
    if args.json:
        Path(args.json).write_text(json.dumps({"device": name, "torch": torch.__version__, "args": vars(args),
                                               "cases": recs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
