"""Compare runs of one bench_attention.py phase under different settings (NCCL CTA policy, ring
workspace budget, ...), each against the same single-GPU baseline phase of the same machine.

    python benchmarks/compare_variants.py --baseline part_p1.json default=part_default.json \\
        cta-efficiency=part_cta1.json --json variants.json

Prints one row per (variant, method, mask, n, mode): median ms, per-GPU TFLOP/s, efficiency vs
the baseline's cuDNN kernel, peak per rank as a multiple of the ideal (1-GPU peak / p), and the
ratio to the same cell of the first variant (below 1 = faster). The environment each phase ran
under is printed from its own metadata, so a row says what it measured.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _bench():
    spec = importlib.util.spec_from_file_location("bench_attention", HERE / "bench_attention.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up while the class is built
    spec.loader.exec_module(mod)
    return mod


def compare(baseline: dict, variants: list[tuple[str, dict]]) -> list[dict]:
    bench = _bench()
    rows, first = [], {}
    for i, (label, part) in enumerate(variants):
        res = {"phases": baseline["phases"] + part["phases"], "records": baseline["records"] + part["records"],
               "maxlen": []}
        bench.derive(res)
        for r in part["records"]:
            if r["status"] != "ok":
                continue
            key = (r["method"], r["attn"], r["causal"], r["n"], r["mode"])
            if i == 0:
                first[key] = r["ms"]
            rows.append(dict(variant=label, method=r["method"], attn=r["attn"], causal=r["causal"], n=r["n"],
                             p=r["p"], mode=r["mode"], ms=r["ms"], tflops_per_gpu=r["tflops_per_gpu"],
                             efficiency=r.get("efficiency"), peak_vs_ideal=r.get("peak_vs_ideal"),
                             vs_first=r["ms"] / first[key] if key in first else None))
    return rows


def format_rows(rows: list[dict]) -> str:
    head = f"{'variant':<16} {'method':<22} {'mask':<6} {'n':>8} {'p':>2} {'mode':<6} {'ms':>9} {'TF/s':>7} " \
           f"{'eff':>7} {'x ideal':>7} {'vs 1st':>7}"
    out = [head, "-" * len(head)]
    for r in sorted(rows, key=lambda r: (r["attn"], not r["causal"], r["n"], r["mode"], r["method"])):
        f = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
        out.append(f"{r['variant']:<16} {r['method']:<22} {'causal' if r['causal'] else 'full':<6} {r['n']:>8} "
                   f"{r['p']:>2} {r['mode']:<6} {r['ms']:>9.2f} {r['tflops_per_gpu']:>7.1f} {f(r['efficiency'], '.1%'):>7} "
                   f"{f(r['peak_vs_ideal'], '.2f'):>7} {f(r['vs_first'], '.3f'):>7}")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", required=True, help="part file of the p = 1 phase (sdpa-cudnn)")
    ap.add_argument("variants", nargs="+", help="LABEL=part.json, the first is the reference")
    ap.add_argument("--json", default=None, help="write the rows and each phase's metadata here")
    args = ap.parse_args(argv)
    baseline = json.loads(Path(args.baseline).read_text())
    variants = []
    for spec in args.variants:
        label, sep, path = spec.partition("=")
        if not sep:
            raise SystemExit(f"variant {spec!r}: expected LABEL=part.json")
        if not Path(path).exists():
            print(f"{label}: {path} missing (phase failed or skipped)")
            continue
        variants.append((label, json.loads(Path(path).read_text())))
    if not variants:
        raise SystemExit("no variant part file found")
    meta = baseline["phases"][0]
    print(f"device: {meta.get('device')} (x{meta.get('gpus_visible')}); torch {meta.get('torch')}; nccl {meta.get('nccl')}")
    for label, part in variants:
        env = {k: v for k, v in part["phases"][0].get("env", {}).items() if v is not None}
        print(f"  {label}: {env}")
    rows = compare(baseline, variants)
    print(format_rows(rows))
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": meta, "variants": {l: p["phases"] for l, p in variants},
                                               "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
