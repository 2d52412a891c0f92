"""Where one profiled step's GPU time goes, from a torch.profiler chrome trace (rank 0's).

    python benchmarks/timeline.py TRACE.json[.gz] [--png TIMELINE.png]

Prints the time the compute (every kernel but NCCL's, on any stream) is busy and idle within the
step, its longest idle gaps, each with the events before and after it (what the attention
kernels wait for), and per stream the busy time by family (attention kernels; the ring's
passes: merges, adds, copies; matmuls; inductor's kernels; peer copies; NCCL; other). With
--png (matplotlib), a picture of the same: one row per stream, colored by family.
bench_attention.py --profile and bench_model_masked.py --trace-dir print this summary for each
profiled cell or step (`profile_step`).
"""

from __future__ import annotations

import argparse
import gzip
import json
from collections import defaultdict
from pathlib import Path

FAMILIES = ("attention", "ring passes", "matmul", "inductor", "local copies", "peer copies", "nccl", "other")
COLORS = {"attention": "tab:blue", "ring passes": "tab:orange", "matmul": "tab:olive", "inductor": "tab:cyan",
          "local copies": "tab:purple", "peer copies": "tab:green", "nccl": "tab:red", "other": "tab:gray"}
_MATMUL = ("gemm", "nvjet", "cutlass", "xmma", "cublas")


def family(ev: dict) -> str:
    name, cat = ev.get("name", ""), ev.get("cat", "")
    low = name.lower()
    if cat == "gpu_memcpy":
        return "peer copies" if "ptop" in low or "peer" in low else "local copies"
    if "nccl" in low:
        return "nccl"
    if "sdpa" in low or "flash" in low or "fmha" in low or "cudnn" in low or "flex_attention" in low:
        return "attention"
    if low.startswith("_merge_kernel") or low.startswith("_add_kernel") or "elementwise" in low or cat == "gpu_memset":
        return "ring passes"
    if any(m in low for m in _MATMUL):
        return "matmul"
    if low.startswith("triton_"):  # inductor's generated kernels (the model's pointwise and reductions)
        return "inductor"
    return "other"


def _events(path: str | Path) -> list[dict]:
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        trace = json.load(f)
    return [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]


_GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def read(path: str | Path) -> tuple[list[dict], float]:
    """From one parse of the trace: its GPU events (kernels, copies, memsets, each with its
    "stream"; ts/dur in µs), and the host time the profiler itself took within their span
    (CUPTI's "Activity Buffer Request"): the GPU may idle behind it, so gaps up to this long can
    be the profiler's, not the step's."""
    evs = _events(path)
    gpu = [e for e in evs if e.get("cat") in _GPU_CATEGORIES]
    for e in gpu:
        e["stream"] = (e.get("args") or {}).get("stream", e.get("tid"))
    if not gpu:
        return gpu, 0.0
    t0, t1 = min(e["ts"] for e in gpu), max(e["ts"] + e["dur"] for e in gpu)
    stalls = sum(max(0.0, min(e["ts"] + e["dur"], t1) - max(e["ts"], t0)) for e in evs
                 if "Activity Buffer Request" in e.get("name", ""))
    return gpu, stalls


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def summarize(evs: list[dict], gaps: int = 6, min_gap_us: float = 10.0) -> dict:
    """{span_us, streams: {stream: {busy_us, by_family}}, compute_busy_us, idle_us, gaps: [(start_us,
    length_us, before, after)], gap_count, gap_total_us}. The compute is every kernel and memset
    but NCCL's and the peer copies, on any stream (a CUDA graph's replay spreads its kernels over
    several); its idle time is the span's time when none of them runs, and its gaps are those
    stretches, each with the event that ended before it and the one that started after it."""
    if not evs:
        return {"span_us": 0.0, "streams": {}, "compute_busy_us": 0.0, "idle_us": 0.0, "gaps": [],
                "gap_count": 0, "gap_total_us": 0.0}
    t0 = min(e["ts"] for e in evs)
    t1 = max(e["ts"] + e["dur"] for e in evs)
    per: dict = defaultdict(lambda: {"by_family": defaultdict(float), "spans": []})
    for e in evs:
        s = per[e["stream"]]
        s["by_family"][family(e)] += e["dur"]
        s["spans"].append((e["ts"], e["ts"] + e["dur"]))
    compute = sorted((e for e in evs if family(e) not in ("peer copies", "nccl") and e["cat"] != "gpu_memcpy"),
                     key=lambda e: e["ts"])
    busy = _union([(e["ts"], e["ts"] + e["dur"]) for e in compute])
    found = []
    for (a0, a1), (b0, _) in zip(busy, busy[1:]):
        if b0 - a1 >= min_gap_us:
            before = max((e for e in compute if e["ts"] + e["dur"] <= a1 + 1e-6), key=lambda e: e["ts"] + e["dur"])
            after = next(e for e in compute if e["ts"] >= b0 - 1e-6)
            found.append((a1 - t0, b0 - a1, before["name"][:48], after["name"][:48]))
    found.sort(key=lambda g: -g[1])
    compute_busy = sum(b - a for a, b in busy)
    return {"span_us": t1 - t0,
            "streams": {k: {"busy_us": sum(b - a for a, b in _union(v["spans"])), "by_family": dict(v["by_family"])}
                        for k, v in per.items()},
            "compute_busy_us": compute_busy, "idle_us": (busy[-1][1] - busy[0][0]) - compute_busy if busy else 0.0,
            "gaps": found[:gaps], "gap_count": len(found), "gap_total_us": sum(g[1] for g in found)}


def format_summary(s: dict, stalls_us: float = 0.0) -> str:
    """The summary as text; `stalls_us`: the profiler's own host time in the step
    (`read`), named when there is any."""
    if not s["streams"]:
        return "timeline: no GPU events"
    lines = [f"timeline (rank 0): span {s['span_us'] / 1e3:.3f} ms; compute busy {s['compute_busy_us'] / 1e3:.3f} ms, "
             f"idle {s['idle_us'] / 1e3:.3f} ms between its first and last kernel, in {s['gap_count']} gaps of "
             f">= 10 µs ({s['gap_total_us'] / 1e3:.3f} ms)"]
    if stalls_us:
        lines.append(f"  the profiler's own host stalls (Activity Buffer Request): {stalls_us / 1e3:.3f} ms; gaps "
                     "behind them are the profiler's")
    for k, v in sorted(s["streams"].items(), key=lambda kv: -kv[1]["busy_us"]):
        fams = ", ".join(f"{f} {v['by_family'][f] / 1e3:.3f}" for f in FAMILIES if v["by_family"].get(f))
        lines.append(f"  stream {k}: busy {v['busy_us'] / 1e3:.3f} ms ({fams} ms)")
    for start, gap, before, after in s["gaps"]:
        lines.append(f"  gap {gap:7.1f} µs at {start / 1e3:7.3f} ms: after {before} / before {after}")
    return "\n".join(lines)


def profile_step(step, barrier, trace: str | Path | None = None, rank0: bool = True, rows: int = 20) -> str:
    """Profile one call of step() between two calls of barrier(): the top ops by self device
    time and, on rank 0 (`rank0`), this module's summary of the step's timeline; the chrome
    trace is kept gzipped at `trace` when given (rank 0)."""
    import shutil
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    barrier()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        barrier()
    table = prof.key_averages().table(sort_by="self_device_time_total", row_limit=rows)
    if not rank0:
        return table
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(raw))
        evs, stalls = read(raw)
        summary = format_summary(summarize(evs), stalls)
        if trace:
            Path(trace).parent.mkdir(parents=True, exist_ok=True)
            with open(raw, "rb") as src, gzip.open(trace, "wb") as dst:
                shutil.copyfileobj(src, dst)
    return f"{table}\n{summary}"


def plot(evs: list[dict], png: str | Path, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = min(e["ts"] for e in evs)
    streams = sorted({e["stream"] for e in evs}, key=str)
    fig, ax = plt.subplots(figsize=(14, 0.6 * len(streams) + 2.0))
    for row, st in enumerate(streams):
        for fam in FAMILIES:
            bars = [((e["ts"] - t0) / 1e3, e["dur"] / 1e3) for e in evs if e["stream"] == st and family(e) == fam]
            if bars:
                ax.broken_barh(bars, (row - 0.4, 0.8), color=COLORS[fam], label=fam)
    handles, labels = ax.get_legend_handles_labels()
    seen = dict(zip(labels, handles))
    fig.legend(seen.values(), seen.keys(), loc="lower center", ncol=len(seen), fontsize=8)
    ax.set_yticks(range(len(streams)), [f"stream {s}" for s in streams])
    ax.set_xlabel("ms from the step's first GPU event")
    ax.set_title(title or "one profiled step, rank 0")
    fig.tight_layout(rect=(0, 0.4 / fig.get_figheight(), 1, 1))  # the legend's row below the axes
    fig.savefig(png, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace")
    ap.add_argument("--png", default=None)
    ap.add_argument("--title", default="")
    args = ap.parse_args(argv)
    evs, stalls = read(args.trace)
    print(format_summary(summarize(evs), stalls))
    if args.png:
        plot(evs, args.png, args.title)
        print(f"wrote {args.png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
