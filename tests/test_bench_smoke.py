"""The attention benchmark harness runs end to end in its CPU smoke mode (gloo, fp32, tiny sizes):
the launcher starts torchrun for p = 1 and p = 2, every CPU method measures, and the report
(JSON, table printed last, plots, RESULTS.md section) is consistent with the measurements."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks" / "bench_attention.py"


def _load_bench():
    spec = importlib.util.spec_from_file_location("bench_attention", BENCH)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bench")
    repo_md = ROOT / "benchmarks" / "RESULTS.md"
    before = repo_md.read_text() if repo_md.exists() else None
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, str(BENCH), "--smoke", "--worlds", "1,2", "--lengths", "256",
           "--dilated-lengths", "256,1024", "--out", str(tmp / "out"), "--work-dir", str(tmp / "work")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    after = repo_md.read_text() if repo_md.exists() else None
    res = json.loads((tmp / "out" / "results.json").read_text())
    return proc.stdout, res, tmp / "out", before == after


def _ok(res, **kw):
    return [r for r in res["records"] if r["status"] == "ok" and all(r[k] == v for k, v in kw.items())]


def test_every_cpu_method_measures(smoke):
    _, res, _, _ = smoke
    assert sorted(ph["world"] for ph in res["phases"]) == [1, 2]
    methods = ["ring-zigzag", "ring-contiguous", "ring-zigzag-nocomm", "ring-contiguous-nocomm"]
    for attn in ("mha", "gqa"):
        for causal in (True, False):
            for mode in ("fwdbwd", "fwd"):
                (base,) = _ok(res, method="sdpa-math", attn=attn, causal=causal, mode=mode, p=1, n=256)
                assert base["efficiency"] == pytest.approx(1.0)
                for m in methods:
                    (r,) = _ok(res, method=m, attn=attn, causal=causal, mode=mode, p=2, n=256)
                    assert r["ms"] > 0 and len(r["ms_iters"]) == r["iters"] >= 1
                    assert r["tflops_per_gpu"] == pytest.approx(r["flops"] / 2 / (r["ms"] * 1e-3) / 1e12)
                    assert r["efficiency"] == pytest.approx(r["tflops_per_gpu"] / base["tflops_per_gpu"])
    cp = [r for r in res["records"] if r["family"] == "cp" and r["p"] == 2]
    assert len(cp) == 4 * 2 * 2 and all(r["status"] == "skipped" and r["reason"] == "CPU" for r in cp)


def test_ring_bytes_match_the_schedule(smoke):
    """Measured RingComm bytes per rank equal the ring schedule: K/V to p - 1 ranks in forward,
    again in backward plus dK/dV (fp32 accumulators) over p hops; none without transfers."""
    _, res, _, _ = smoke
    p, n_local, d, elt = 2, 128, 16, 4
    for r in _ok(res, p=2, family="ring"):
        shard = r["h_kv"] * n_local * d
        fwd = (p - 1) * 2 * shard * elt
        want = fwd if r["mode"] == "fwd" else 2 * fwd + p * 2 * shard * 4
        assert r["comm_bytes"] == want, r
        assert r["comm_source"].startswith("measured")
    assert all(r["comm_bytes"] == 0 for r in _ok(res, family="ring-nocomm"))
    assert any(line.startswith("PASS  GQA K/V bytes") for line in res["targets"])


def test_dilated_cells(smoke):
    _, res, _, _ = smoke
    dil = [r for r in res["records"] if r["family"] == "dilated"]
    if all(r["status"] == "skipped" and "not importable" in r["reason"] for r in dil):
        pytest.skip("ringcc.dilated_attention not available yet")
    bench = _load_bench()
    for r in dil:
        assert r["status"] == "ok", r
        ws, rs = bench.longnet_schedule(r["n"], 32)
        assert r["notes"]["segment_lengths"] == ws and ws[-1] == r["n"]
        assert r["efficiency"] is None  # dilated is not compared with dense FLOP rates
    # n = 1024 at p = 2: the w = 1024 branch spans both ranks, so K/V rows travel.
    assert all(r["comm_bytes"] > 0 for r in _ok(res, family="dilated", n=1024, p=2))
    assert any("dilated time(4n)" in line for line in res["targets"])


def test_report_outputs(smoke):
    stdout, res, out, repo_md_untouched = smoke
    table = (out / "table.txt").read_text()
    # The table is printed last: the launcher's final lines are the table file's.
    assert stdout.rstrip().splitlines()[-5:] == table.rstrip().splitlines()[-5:]
    assert "TF/s/GPU" in table and "ring-zigzag-nocomm" in table
    md = (out / "RESULTS.md").read_text()
    assert md.count("<!-- bench_attention:begin -->") == 1 and "torch" in md
    assert repo_md_untouched  # smoke mode never edits benchmarks/RESULTS.md
    pytest.importorskip("matplotlib")
    assert (out / "tflops.png").stat().st_size > 0 and (out / "memory.png").stat().st_size > 0


def test_search_and_memory_model():
    bench = _load_bench()
    res = bench.search_max_length(lambda n: n <= 5000, start=1000, step=100, max_probes=20)
    assert res["max_fit"] == 5000 and res["first_fail"] == 5100 and res["stopped_by"] == "converged"
    capped = bench.search_max_length(lambda n: None if n > 2000 else True, start=1000, step=100, max_probes=20)
    assert capped["max_fit"] == 2000 and capped["first_fail"] is None and capped["stopped_by"] == "not probed"
    # peak = 100 + 3 n: the largest n under 1000 bytes is 300.
    assert bench.model_max_length([(10, 130), (50, 250), (90, 370)], 1000, 1) == 300
    section = bench.RESULTS_BEGIN + "\nnew\n" + bench.RESULTS_END
    old = "# R\n\nintro\n\n" + bench.RESULTS_BEGIN + "\nold\n" + bench.RESULTS_END + "\n\n## later\n"
    assert bench.update_results_md(old, section) == "# R\n\nintro\n\n" + section + "\n\n## later\n"
    assert bench.update_results_md("# R\n", section) == "# R\n\n" + section + "\n"
    assert bench.longnet_schedule(65536, 2048) == ([2048, 8192, 32768, 65536], [1, 2, 4, 8])
    # Cells the measured peaks predict not to fit are skipped before a multi-rank OOM can hang.
    rec = dict(status="ok", method="ring-zigzag", attn="mha", causal=True, mode="fwdbwd")
    done = [dict(rec, n=1000, peak_bytes=1100), dict(rec, n=2000, peak_bytes=2100),
            dict(rec, n=2000, peak_bytes=9999, mode="fwd")]
    cell = bench.Cell("ring-zigzag", "mha", True, 8000, 4)
    assert bench.predicted_peak(cell, "fwdbwd", done) == pytest.approx(8100)
    assert bench.predicted_peak(cell, "fwdbwd", done[:1]) == pytest.approx(8800)
    assert bench.predicted_peak(bench.Cell("ring-zigzag", "gqa", True, 8000, 4), "fwdbwd", done) is None
