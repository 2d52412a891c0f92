"""Where one profiled step's GPU time goes, from a torch.profiler chrome trace (rank 0's).

    python benchmarks/timeline.py TRACE.json[.gz] [--png TIMELINE.png]

Prints, per stream, the time its kernels and copies are busy within the step's span (from the
first GPU event to the last), the busy time by family (attention kernels; the ring's passes:
merges, adds, copies; peer copies; NCCL; other), and the longest idle gaps of the busiest
stream, each with the events before and after it: what the attention kernels wait for. With
--png (matplotlib), a picture of the same: one row per stream, colored by family.
bench_attention.py --profile prints this summary for each profiled cell.
"""

from __future__ import annotations

import argparse
import gzip
import json
from collections import defaultdict
from pathlib import Path

FAMILIES = ("attention", "ring passes", "graph copies", "peer copies", "nccl", "other")
COLORS = {"attention": "tab:blue", "ring passes": "tab:orange", "graph copies": "tab:purple",
          "peer copies": "tab:green", "nccl": "tab:red", "other": "tab:gray"}


def family(ev: dict) -> str:
    name, cat = ev.get("name", ""), ev.get("cat", "")
    low = name.lower()
    if cat == "gpu_memcpy":
        return "peer copies" if "ptop" in low or "peer" in low else "graph copies"
    if "nccl" in low:
        return "nccl"
    if "sdpa" in low or "flash" in low or "fmha" in low or "cudnn" in low:
        return "attention"
    if low.startswith("_merge_kernel") or low.startswith("_add_kernel") or "elementwise" in low or cat == "gpu_memset":
        return "ring passes"
    return "other"


def load(path: str | Path) -> list[dict]:
    """The trace's GPU events (kernels, copies, memsets) with ts/dur in µs."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        trace = json.load(f)
    evs = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"
           and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e]
    for e in evs:
        e["stream"] = (e.get("args") or {}).get("stream", e.get("tid"))
    return evs


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def summarize(evs: list[dict], gaps: int = 6, min_gap_us: float = 10.0) -> dict:
    """{span_us, streams: {stream: {busy_us, by_family}}, main, gaps: [(start_us, length_us, before, after)]}."""
    if not evs:
        return {"span_us": 0.0, "streams": {}, "main": None, "gaps": []}
    t0 = min(e["ts"] for e in evs)
    t1 = max(e["ts"] + e["dur"] for e in evs)
    per: dict = defaultdict(lambda: {"busy_us": 0.0, "by_family": defaultdict(float), "events": []})
    for e in evs:
        s = per[e["stream"]]
        s["by_family"][family(e)] += e["dur"]
        s["events"].append(e)
    for s in per.values():
        s["busy_us"] = sum(b - a for a, b in _union([(e["ts"], e["ts"] + e["dur"]) for e in s["events"]]))
    main = max(per, key=lambda k: per[k]["by_family"].get("attention", 0.0) + 1e-3 * per[k]["busy_us"])
    order = sorted(per[main]["events"], key=lambda e: e["ts"])
    found = []
    for prev, nxt in zip(order, order[1:]):
        gap = nxt["ts"] - (prev["ts"] + prev["dur"])
        if gap >= min_gap_us:
            found.append((prev["ts"] + prev["dur"] - t0, gap, prev["name"][:48], nxt["name"][:48]))
    found.sort(key=lambda g: -g[1])
    return {"span_us": t1 - t0, "streams": {k: {"busy_us": v["busy_us"], "by_family": dict(v["by_family"])}
                                            for k, v in per.items()},
            "main": main, "gaps": found[:gaps], "idle_us": (t1 - t0) - per[main]["busy_us"],
            "gap_count": len(found), "gap_total_us": sum(g[1] for g in found)}


def format_summary(s: dict) -> str:
    if not s["streams"]:
        return "timeline: no GPU events"
    lines = [f"timeline (rank 0): span {s['span_us'] / 1e3:.3f} ms; the attention stream ({s['main']}) idle "
             f"{s['idle_us'] / 1e3:.3f} ms, {s['gap_count']} gaps of >= 10 µs ({s['gap_total_us'] / 1e3:.3f} ms)"]
    for k, v in sorted(s["streams"].items(), key=lambda kv: -kv[1]["busy_us"]):
        fams = ", ".join(f"{f} {v['by_family'][f] / 1e3:.3f}" for f in FAMILIES if v["by_family"].get(f))
        lines.append(f"  stream {k}: busy {v['busy_us'] / 1e3:.3f} ms ({fams} ms)")
    for start, gap, before, after in s["gaps"]:
        lines.append(f"  gap {gap:7.1f} µs at {start / 1e3:7.3f} ms: after {before} / before {after}")
    return "\n".join(lines)


def plot(evs: list[dict], png: str | Path, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = min(e["ts"] for e in evs)
    streams = sorted({e["stream"] for e in evs}, key=str)
    fig, ax = plt.subplots(figsize=(14, 0.6 * len(streams) + 1.5))
    for row, st in enumerate(streams):
        for fam in FAMILIES:
            bars = [((e["ts"] - t0) / 1e3, e["dur"] / 1e3) for e in evs if e["stream"] == st and family(e) == fam]
            if bars:
                ax.broken_barh(bars, (row - 0.4, 0.8), color=COLORS[fam], label=fam if row == 0 or True else None)
    handles, labels = ax.get_legend_handles_labels()
    seen = dict(zip(labels, handles))
    ax.legend(seen.values(), seen.keys(), loc="upper right", ncol=len(seen), fontsize=8)
    ax.set_yticks(range(len(streams)), [f"stream {s}" for s in streams])
    ax.set_xlabel("ms from the step's first GPU event")
    ax.set_title(title or "one profiled step, rank 0")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace")
    ap.add_argument("--png", default=None)
    ap.add_argument("--title", default="")
    args = ap.parse_args(argv)
    evs = load(args.trace)
    print(format_summary(summarize(evs)))
    if args.png:
        plot(evs, args.png, args.title)
        print(f"wrote {args.png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
