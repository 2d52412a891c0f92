"""Bar charts of bench_masked.py records: fwd+bwd time and peak memory per case, one bar per
record (e.g. the math path and flex_attention, run on one machine), labelled with each record's
masked kernel, device and p. Prints the table it plots.

    python benchmarks/plot_masked.py math.json flex.json -o masked.png
"""

from __future__ import annotations

import argparse
import json
import sys


def load(paths: list[str], labels: list[str] | None = None) -> list[dict]:
    if labels and len(labels) != len(paths):
        raise SystemExit(f"--labels takes one label per record: got {len(labels)} labels for {len(paths)} records")
    records = []
    for i, path in enumerate(paths):
        with open(path) as f:
            rec = json.load(f)
        if not rec.get("rows"):
            raise SystemExit(f"{path}: no rows (is it a bench_masked.py record?)")
        what = labels[i] if labels else rec.get("masked_kernel", "?")
        rec["label"] = f"{what} ({rec['device']}, p={rec['rows'][0]['p']})"
        records.append(rec)
    return records


def table(records: list[dict]) -> str:
    lines = [f"{'record':44} {'case':22} {'n_local':>8} {'ms':>9} {'peak MiB':>9}"]
    for rec in records:
        for r in rec["rows"]:
            lines.append(f"{rec['label'][:44]:44} {r['case']:22} {r['n_local']:>8} {r['ms']:9.2f} "
                         f"{r['peak_bytes'] / 2**20:9.1f}")
    return "\n".join(lines)


def plot(records: list[dict], out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = list(dict.fromkeys(r["case"] for rec in records for r in rec["rows"]))
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.8 / len(records)
    for i, rec in enumerate(records):
        by_case = {r["case"]: r for r in rec["rows"]}
        present = [c for c in range(len(cases)) if cases[c] in by_case]  # a case the record lacks: no bar
        xs = [c + (i - (len(records) - 1) / 2) * width for c in present]
        for ax, key, scale in ((axes[0], "ms", 1.0), (axes[1], "peak_bytes", 2.0**-20)):
            vals = [by_case[cases[c]][key] * scale for c in present]
            bars = ax.bar(xs, vals, width, label=rec["label"])
            ax.bar_label(bars, fmt="%.0f", fontsize=7)
    for ax, title in ((axes[0], "fwd+bwd ms (slowest rank)"), (axes[1], "peak MiB (largest rank)")):
        ax.set_xticks(range(len(cases)), cases, rotation=15)
        ax.set_title(title)
    axes[0].set_yscale("log")
    axes[0].legend(fontsize=8)
    n_local = records[0]["rows"][0]["n_local"]
    fig.suptitle(f"masked ring attention, {n_local} tokens per rank, causal, {records[0]['dtype']}")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    print(f"wrote {out}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("records", nargs="+", help="bench_masked.py JSON records")
    ap.add_argument("-o", "--out", default="masked.png", help="PNG to write")
    ap.add_argument("--labels", nargs="*", help="one label per record (default: each record's masked kernel)")
    args = ap.parse_args(argv)
    records = load(args.records, args.labels)
    print(table(records))
    plot(records, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
