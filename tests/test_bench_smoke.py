"""The attention benchmark harness runs end to end in its CPU smoke mode (gloo, fp32, tiny sizes):
the launcher starts torchrun for p = 1 and p = 2, every CPU method measures, and the report
(JSON, table printed last, plots, RESULTS.md section) is consistent with the measurements.
The harnesses' end-to-end runs (torchrun, tens of seconds each) are the soak tier; make test
checks their pure parts (schedules, searches, targets)."""

import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks" / "bench_attention.py"


def _load_bench():
    if str(BENCH.parent) not in sys.path:  # its sibling modules (dist_setup), as a script finds them
        sys.path.insert(0, str(BENCH.parent))
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
           "--dilated-lengths", "256,1024", "--profile", "ring-zigzag@256", "--out", str(tmp / "out"), "--work-dir", str(tmp / "work")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    after = repo_md.read_text() if repo_md.exists() else None
    res = json.loads((tmp / "out" / "results.json").read_text())
    return proc.stdout, res, tmp / "out", before == after


def _ok(res, **kw):
    return [r for r in res["records"] if r["status"] == "ok" and all(r[k] == v for k, v in kw.items())]


@pytest.mark.soak
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
                    # Back to back: at least 3 iterations, every one timed (Note [Benchmark metrics]).
                    assert len(r["ms_b2b_iters"]) >= 3 and r["ms_b2b"] == statistics.median(r["ms_b2b_iters"]) > 0
                    assert r["efficiency_b2b"] == pytest.approx(r["tflops_b2b"] / base["tflops_b2b"])
    cp = [r for r in res["records"] if r["family"] == "cp" and r["p"] == 2]
    assert len(cp) == 4 * 2 * 2 and all(r["status"] == "skipped" and r["reason"] == "CPU" for r in cp)


@pytest.mark.soak
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


@pytest.mark.soak
def test_dilated_cells(smoke):
    _, res, _, _ = smoke
    dil = [r for r in res["records"] if r["family"] == "dilated"]
    assert dil, "the smoke run produced no dilated cells"
    bench = _load_bench()
    for r in dil:
        assert r["status"] == "ok", r
        ws, rs = bench.longnet_schedule(r["n"], 32)
        assert r["notes"]["segment_lengths"] == ws and ws[-1] == r["n"]
        assert r["efficiency"] is None  # dilated is not compared with dense FLOP rates
    # n = 1024 at p = 2: the w = 1024 branch spans both ranks, so K/V rows travel.
    assert all(r["comm_bytes"] > 0 for r in _ok(res, family="dilated", n=1024, p=2))
    assert any("dilated time(4n)" in line for line in res["targets"])


@pytest.mark.soak
def test_report_outputs(smoke):
    stdout, res, out, repo_md_untouched = smoke
    table = (out / "table.txt").read_text()
    # The table is printed last: the launcher's final lines are the table file's.
    assert stdout.rstrip().splitlines()[-5:] == table.rstrip().splitlines()[-5:]
    assert "TF/s/GPU" in table and "ring-zigzag-nocomm" in table
    md = (out / "RESULTS.md").read_text()
    assert md.count("<!-- bench_attention:begin -->") == 1 and "torch" in md
    assert repo_md_untouched  # smoke mode never edits benchmarks/RESULTS.md
    profiled = [r for r in res["records"] if "profile" in r]
    assert profiled and all(r["method"] == "ring-zigzag" and r["n"] == 256 for r in profiled)
    assert all("ringcc::ring_attention" in r["profile"] for r in profiled)
    pytest.importorskip("matplotlib")
    assert (out / "tflops.png").stat().st_size > 0 and (out / "memory.png").stat().st_size > 0


def test_search_and_memory_model():
    bench = _load_bench()
    res = bench.search_max_length(lambda n: n <= 5000, start=1000, step=100, max_probes=20)
    assert res["max_fit"] == 5000 and res["first_fail"] == 5100 and res["stopped_by"] == "converged"
    # A model that knows the answer: its guess, then one step past it (the first OOM).
    ran = []
    guided = bench.search_max_length(lambda n: ran.append(n) or n <= 5000, start=3000, step=100, max_probes=20,
                                     guess=lambda: 5049)
    assert (guided["max_fit"], guided["first_fail"], ran) == (5000, 5100, [5000, 5100])
    # A wrong model (below what already fits, or past an OOM) changes the probes, not the answer.
    for wrong in (lambda: 10, lambda: 10**6, lambda: 5400):
        res = bench.search_max_length(lambda n: n <= 5000, start=1000, step=100, max_probes=30, guess=wrong)
        assert (res["max_fit"], res["first_fail"], res["stopped_by"]) == (5000, 5100, "converged")
    capped = bench.search_max_length(lambda n: None if n > 2000 else True, start=1000, step=100, max_probes=20)
    assert capped["max_fit"] == 2000 and capped["first_fail"] is None and capped["stopped_by"] == "not probed"
    # peak = 100 + 3 n: the largest n under 1000 bytes is 300.
    assert bench.model_max_length([(10, 130), (50, 250), (90, 370)], 1000, 1) == 300
    section = bench.RESULTS_BEGIN + "\nnew\n" + bench.RESULTS_END
    generated = "## 2026 — " + bench.GENERATED_HEADING + "\n```\nold table\n```"
    old = "# R\n\nintro\n\n" + bench.RESULTS_BEGIN + "\n" + generated + "\n" + bench.RESULTS_END + "\n\n## later\n"
    assert bench.update_results_md(old, section) == "# R\n\nintro\n\n" + section + "\n\n## later\n"
    # text between the markers that is not the generated section stays: all of it without a
    # generated heading, else what is above the heading and below the table
    notes = "# R\n\n" + bench.RESULTS_BEGIN + "\nnotes\n" + bench.RESULTS_END + "\n"
    assert bench.update_results_md(notes, section) == "# R\n\nnotes\n\n" + section + "\n"
    below = "# R\n\n" + bench.RESULTS_BEGIN + "\n" + generated + "\n\nafter the table\n" + bench.RESULTS_END + "\n"
    assert bench.update_results_md(below, section) == "# R\n\n" + section + "\n\nafter the table\n"
    assert bench.update_results_md("# R\n", section) == "# R\n\n" + section + "\n"
    # hand-written sections between the markers, before the generated one, are kept
    mixed = "# R\n\n" + bench.RESULTS_BEGIN + "\n## hand-written notes\nmeasured\n\n" + generated + "\n" + bench.RESULTS_END + "\n"
    assert bench.update_results_md(mixed, section) == "# R\n\n## hand-written notes\nmeasured\n\n" + section + "\n"
    assert bench.longnet_schedule(65536, 2048) == ([2048, 8192, 32768, 65536], [1, 2, 4, 8])
    # Cells the measured peaks predict not to fit are skipped before a multi-rank OOM can hang.
    rec = dict(status="ok", method="ring-zigzag", attn="mha", causal=True, mode="fwdbwd")
    done = [dict(rec, n=1000, peak_bytes=1100), dict(rec, n=2000, peak_bytes=2100),
            dict(rec, n=2000, peak_bytes=9999, mode="fwd")]
    cell = bench.Cell("ring-zigzag", "mha", True, 8000, 4)
    assert bench.predicted_peak(cell, "fwdbwd", done) == pytest.approx(8100)
    assert bench.predicted_peak(cell, "fwdbwd", done[:1]) == pytest.approx(8800)
    assert bench.predicted_peak(bench.Cell("ring-zigzag", "gqa", True, 8000, 4), "fwdbwd", done) is None


def _rec(method, family, n, p, ms, *, causal=True, attn="mha", mode="fwdbwd", peak=None, comm=0, h=16, h_kv=16,
         b2b=None):
    flops = 4.0 * h * n * n * 128 * (0.5 if causal else 1.0) * (3.5 if mode == "fwdbwd" else 1.0)
    return dict(method=method, family=family, attn=attn, h=h, h_kv=h_kv, d=128, b=1, n=n, p=p, causal=causal,
                mode=mode, status="ok", ms=ms, flops=flops, tflops_per_gpu=flops / p / (ms * 1e-3) / 1e12,
                ms_b2b=b2b, tflops_b2b=None if b2b is None else flops / p / (b2b * 1e-3) / 1e12,
                peak_bytes=peak, comm_bytes=comm)


def test_targets_on_gpu_shaped_results():
    """The report's target checks on hand-made 1- and 4-GPU records: each verdict follows the
    numbers (the CPU smoke run cannot produce cuDNN, context-parallel or memory figures)."""
    bench = _load_bench()
    K, G = 1024, 2**30
    recs = [
        _rec("sdpa-cudnn", "single", 64 * K, 1, 100.0, peak=4 * G, b2b=96.0),
        _rec("sdpa-cudnn", "single", 256 * K, 1, 1600.0, peak=16 * G),
        # 16K/GPU: 100/4/26 = 96% (>= 95%), back to back 96/4/25.5 = 94.1%; 64K/GPU: 1600/4/415 = 96.4% (< 97%).
        _rec("ring-zigzag", "ring", 64 * K, 4, 26.0, peak=int(1.2 * G), comm=3 * 2**20, b2b=25.5),
        _rec("ring-zigzag", "ring", 256 * K, 4, 415.0, peak=8 * G, comm=12 * 2**20),
        _rec("ring-zigzag-nocomm", "ring-nocomm", 64 * K, 4, 25.0, b2b=24.0),
        _rec("ring-zigzag-nocomm", "ring-nocomm", 256 * K, 4, 414.0),
        _rec("cp-cudnn-alltoall", "cp", 64 * K, 4, 30.0, peak=3 * G, b2b=25.0),
        _rec("cp-cudnn-allgather", "cp", 256 * K, 4, 400.0, peak=12 * G),
        _rec("ring-zigzag", "ring", 64 * K, 4, 30.0, attn="gqa", h=32, h_kv=8, comm=3 * 2**19),
        _rec("dilated", "dilated", 256 * K, 4, 10.0),
        _rec("dilated", "dilated", 1024 * K, 4, 45.0),
        _rec("ring-zigzag", "ring", 1024 * K, 4, 9000.0),
    ]
    res = {"phases": [{"world": 1, "device_total_memory": 80 * G, "smoke": False},
                      {"world": 4, "device_total_memory": 80 * G, "smoke": False}],
           "records": recs,
           "maxlen": [{"method": "sdpa-cudnn", "p": 1, "status": "ok", "max_fit": 2 * K * K, "first_fail": 2304 * K,
                       "stopped_by": "converged"},
                      {"method": "ring-zigzag", "p": 4, "status": "ok", "max_fit": 7 * K * K, "first_fail": None,
                       "stopped_by": "time cap"}]}
    bench.derive(res)
    lines = bench.check_targets(res)
    text = "\n".join(lines)
    assert "PASS  ring-zigzag causal p=4: 96.15% of 1-GPU cuDNN at 16K/GPU, from idle" in text
    assert "MISS  ring-zigzag causal p=4: 94.12% of 1-GPU cuDNN at 16K/GPU, back to back" in text
    assert "MISS  ring-zigzag causal p=4: 96.39% of 1-GPU cuDNN at 64K/GPU, from idle" in text
    assert "n/a   ring-zigzag causal p=4: efficiency at 64K/GPU, back to back (not measured)" in text
    assert "n/a   ring-contiguous non-causal p=4: efficiency at 16K/GPU, from idle (not measured)" in text
    # 26 ms vs 30 ms and 415 vs 400 ms: the ring loses the 256K cell.
    assert any(x.startswith("MISS  ring >= best context-parallel config in every cell, from idle: 1/2") for x in lines)
    # Back to back only the 64K cell has both (25.5 vs 25.0 ms): lost by 2%.
    assert any(x.startswith("MISS  ring >= best context-parallel config in every cell, back to back: 0/1; "
                            "worst 0.980x") for x in lines)
    # ideal = 16 GiB / 4 = 4 GiB: 8 GiB > 1.1 * 4 GiB + 256 MiB.
    assert any(x.startswith("MISS  ring peak <= 1.1 x (1-GPU peak / p) + 256 MiB: 1/2 cells; worst 2.00x") for x in lines)
    assert "info  context parallel peak: 3.00-3.00x ideal" in text
    # Without an OOM bracketing the 4-GPU search, a ratio under 3.8x is a lower bound: n/a, not MISS.
    # (The ratio lies between 4-GPU fit / 1-GPU first OOM and 4-GPU first OOM / 1-GPU fit.)
    assert any(x.startswith("n/a    longest fwd+bwd p=4 / 1 GPU, default allocator: 7340032 / 2097152 = 3.50x, "
                            "3.11x against the first single-GPU OOM") for x in lines)
    # A length that ran on 4 GPUs, 3.8x past the single GPU's, is a PASS even without an OOM ...
    res["maxlen"][1]["max_fit"] = 9 * K * K
    assert any(x.startswith("PASS  longest fwd+bwd p=4 / 1 GPU, default allocator: 9437184 / 2097152 = 4.50x")
               for x in bench.check_targets(res))
    # ... and one bracketed by a 4-GPU OOM below 3.8x is a MISS.
    res["maxlen"][1].update(max_fit=7 * K * K, first_fail=7 * K * K + 8 * K)
    assert any(x.startswith("MISS  longest fwd+bwd p=4 / 1 GPU, default allocator: 7340032 / 2097152 = 3.50x")
               for x in bench.check_targets(res))
    # A single-GPU search stopped before any OOM cannot make a PASS, however long the 4-GPU fit.
    res["maxlen"][0].update(first_fail=None)
    res["maxlen"][1].update(max_fit=9 * K * K, first_fail=None)
    assert any(x.startswith("n/a    longest fwd+bwd p=4 / 1 GPU, default allocator: 9437184 / 2097152 = 4.50x")
               for x in bench.check_targets(res))
    res["maxlen"][0].update(first_fail=2304 * K)
    res["maxlen"][1].update(max_fit=7 * K * K, first_fail=None)
    assert any(x.startswith("PASS  communication hidden") and "from idle: worst 1.040" in x for x in lines)
    assert any(x.startswith("MISS  communication hidden") and "back to back: worst 1.062" in x and "0/1 cells" in x
               for x in lines)
    assert "PASS  dilated time(4n) <= 4.6 x time(n), causal fwdbwd: 256K->1024K 4.50x" in text
    assert "PASS  dilated vs dense ring at 1M, causal fwdbwd: 200.0x faster (target >= 10x)" in text
    # GQA (h=32, h_kv=8) sends half of MHA h=16's bytes = a quarter of MHA at h=32.
    assert "PASS  GQA K/V bytes / MHA's at h=32: 0.2500 (target h_kv/h = 0.2500" in text
    table = bench.format_table(res)
    assert len(table.splitlines()) == 2 + len(recs) + 2 + len(res["maxlen"])  # header, rows, max-length lines
    (ring256,) = [r for r in recs if r["method"] == "ring-zigzag" and r["n"] == 256 * K]
    assert ring256["efficiency"] == pytest.approx(1600 / 4 / 415) and ring256["peak_vs_ideal"] == pytest.approx(2.0)
    assert ring256["efficiency_b2b"] is None
    single = next(m for m in res["maxlen"] if m["p"] == 1)
    assert single["max_model"] == (int(0.95 * 80 * G / (16 * G / (256 * K))) // (2 * 8192)) * 2 * 8192


def test_max_length_search_runs_one_job_per_probe(tmp_path, monkeypatch):
    """The launcher's search (Note [Max-length probes]) on a fake probe job: guided by the
    probes' own peaks, down to the step; OOMs bound it; a probe whose reserved peak passes the
    cap stops it (the cap was not enforced); the ring probes run lean, through the process group."""
    bench = _load_bench()
    G = 2**30
    args = bench.finish_args(bench.build_parser().parse_args(
        ["--maxlen-methods", "sdpa-cudnn,ring-zigzag", "--maxlen-cap-gib", "8", "--maxlen-allocators",
         "default,expandable", "--maxlen-probes", "12"]))
    phases = {"phases": [{"world": 1, "device_total_memory": 80 * G}, {"world": 4, "device_total_memory": 80 * G}],
              "records": [_rec("sdpa-cudnn", "single", 65536, 1, 100.0, peak=int(2.5 * G)),
                          _rec("ring-zigzag", "ring", 262144, 4, 400.0, peak=int(2.7 * G))], "maxlen": []}
    for r in phases["records"]:
        r["causal"] = True
    part = tmp_path / "part.json"
    part.write_text(json.dumps(phases))
    calls = []

    def fake_job(args_, method, p, n, allocator, work, timeout):
        calls.append((method, p, n, allocator))
        limit = {1: 200000, 4: 800000}[p] * (1.1 if allocator == "expandable" else 1.0)
        if n > limit:
            return {"n": n, "outcome": "oom", "detail": "CUDA out of memory"}
        reserved = 9 * G if (allocator, p) == ("expandable", 1) and n > 150000 else 8 * G + 32 * 2**20
        # allocated grows linearly to the 8 GiB cap at the limit: the guided search needs few probes
        return {"n": n, "outcome": "fits", "peak_allocated": int(8 * G * n / limit), "peak_reserved": reserved,
                "seconds": 1.0}

    monkeypatch.setattr(bench, "run_probe_job", fake_job)
    found = bench.run_maxlen(args, [part], tmp_path, deadline=bench.time.monotonic() + 3600)
    by = {(m["method"], m["allocator"]): m for m in found}
    assert by[("sdpa-cudnn", "default")]["max_fit"] == 198656  # multiple of 2 * 1 * 1024, <= 200000
    assert by[("sdpa-cudnn", "default")]["first_fail"] == 200704
    assert by[("sdpa-cudnn", "default")]["stopped_by"] == "converged"
    assert by[("ring-zigzag", "default")]["max_fit"] == 794624 and by[("ring-zigzag", "default")]["first_fail"] == 802816
    assert by[("ring-zigzag", "default")]["setting"] == {"RINGCC_RING_WORKSPACE_MIB": "0.001",
                                                         "RINGCC_RING_TRANSPORT": "nccl"}
    assert by[("ring-zigzag", "expandable")]["setting"]["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert by[("sdpa-cudnn", "expandable")]["status"] == "failed"
    assert by[("sdpa-cudnn", "expandable")]["reason"].startswith("the cap was not enforced (n=219136")
    assert all(n % (2 * p * 1024) == 0 for _, p, n, _ in calls)
    # doubling once from the measured cell, then the model's guess from that probe, then one step past it
    assert [n for m, p, n, a in calls if (m, a) == ("sdpa-cudnn", "default")] == [131072, 198656, 200704]
    text = "\n".join(bench.check_targets({**phases, "maxlen": found}))
    assert "longest fwd+bwd p=4 / 1 GPU under a 8 GiB allocator cap per GPU, default allocator: 794624 / 198656 = 4.00x" in text
    assert bench._is_oom(RuntimeError("CUDA error: out of memory")) and not bench._is_oom(RuntimeError("bad shape"))
    # No time for a single probe: no result, not the measured cell's length passed off as one.
    late = bench.run_maxlen(args, [part], tmp_path, deadline=bench.time.monotonic() + 10)
    assert {m["status"] for m in late} == {"not probed"} and all(m["reason"] == "time budget" for m in late)


def test_max_length_probe_job_timeout_stops_the_job(tmp_path):
    """A probe job past its timeout is stopped (torchrun, then its workers) and reported as such,
    without waiting for the workers' output."""
    bench = _load_bench()
    args = bench.finish_args(bench.build_parser().parse_args(["--smoke", "--maxlen-cap-gib", "0"]))
    t = bench.time.monotonic()
    out = bench.run_probe_job(args, "ring-zigzag", 2, 256, "default", tmp_path, timeout=0.5)
    assert out["outcome"] == "timeout" and "0 s" in out["detail"]
    assert bench.time.monotonic() - t < 60


@pytest.mark.soak
def test_max_length_probe_job_on_gloo(tmp_path):
    """One real probe job (torchrun, p = 2, gloo, the smoke sizes): it fits and reports."""
    bench = _load_bench()
    args = bench.finish_args(bench.build_parser().parse_args(["--smoke", "--maxlen-cap-gib", "0"]))
    out = bench.run_probe_job(args, "ring-zigzag", 2, 256, "default", tmp_path, timeout=240)
    assert out["outcome"] == "fits", out
    assert out["n"] == 256 and out["seconds"] > 0


def test_short_cells_get_more_warm_up():
    """The 16K/GPU cells read 77.6% causal after one warm-up and 86.3% after about 0.25 s of
    them: short iterations warm up longer, long ones not at all; cells of up to 2 s are timed at
    least 3 times."""
    bench = _load_bench()
    args = type("Args", (), {"reps": 20, "target_seconds": 1.0})()
    assert bench.plan_iters(0.035, args) == (7, 20)  # a 35 ms cell: 7 warm-ups, 20 timed
    assert bench.plan_iters(0.001, args) == (10, 20)  # at most 10 warm-ups
    assert bench.plan_iters(0.5, args) == (1, 3)  # at least a median of 3 up to 2 s
    assert bench.plan_iters(1.8, args) == (0, 3)
    assert bench.plan_iters(3.0, args) == (0, 1)  # the memory run is the only warm-up
    args.reps = 2
    assert bench.plan_iters(1.8, args) == (0, 2)  # --reps still caps it


@pytest.mark.soak
def test_masked_benchmark_and_masked_planner_run_on_gloo(tmp_path):
    """bench_masked.py and bench_planner_gpu.py --models masked end to end on CPU (gloo, p = 2,
    smoke sizes): every masked case is timed and written to the JSON record, and the masked
    layer's plan is O(n/p)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    run = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    masked, plan = tmp_path / "masked.json", tmp_path / "plan.json"
    for script, extra, out in (("bench_masked.py", ["--reps", "1", "--layout", "auto"], masked),
                               ("bench_planner_gpu.py", ["--models", "masked", "documents", "softcap", "--worlds", "2"],
                                plan)):
        proc = subprocess.run(run + [str(ROOT / "benchmarks" / script), "--smoke", *extra, "--json", str(out)],
                              capture_output=True, text=True, timeout=240, cwd=ROOT, env=env)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert f"wrote {out}" in proc.stdout
    rec = json.loads(masked.read_text())
    assert rec["device"] == "cpu (smoke, gloo)" and rec["reps"] == 1
    assert [r["case"] for r in rec["rows"]] == ["unmasked", "key padding", "left padding", "key gaps", "window",
                                                "window + key padding", "unmasked, 2 rows", "row padding, 2 rows"]
    assert all(r["p"] == 2 and r["ms"] > 0 for r in rec["rows"])
    assert [r["batch"] for r in rec["rows"]] == [1] * 6 + [2] * 2
    # --layout auto: as the backend, zigzag for the causal cases without a window
    assert [r["layout"] for r in rec["rows"]] == ["zigzag"] * 4 + ["contiguous"] * 2 + ["zigzag"] * 2
    rows = json.loads(plan.read_text())["rows"]
    assert [(r["model"], r["n"], r["p"]) for r in rows] == [(m, n, 2) for m in ("masked", "documents", "softcap")
                                                            for n in (64, 128)]
    assert all(r["verdict"] for r in rows)


@pytest.mark.soak
@pytest.mark.parametrize("schedule", [[], ["--schedule", "2"]])
def test_masked_blocks_against_flex_run_on_cpu(tmp_path, schedule):
    """bench_masked.py --vs-flex (and --schedule 2: one rank's schedule without transfers) on one
    CPU process in fp32, flex's dense implementation on both sides: every cell is timed, and
    ringcc's output and gradients equal flex_attention's."""
    out = tmp_path / "flex.json"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
                           str(ROOT / "benchmarks" / "bench_masked.py"), "--vs-flex", *schedule, "--smoke", "--reps",
                           "1", "--warmup", "1", "--json", str(out)], capture_output=True, text=True, timeout=600,
                          cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rec = json.loads(out.read_text())
    assert rec["device"] == "cpu (smoke, gloo)" and len(rec["rows"]) == (8 if schedule else 12)
    assert all(r["ringcc_ms"] > 0 and r["flex_ms"] > 0 and r["max_rel_diff"] < 1e-5 for r in rec["rows"]), rec["rows"]
    if not schedule:  # the back-to-back timing of each cell
        assert all(r["ringcc_queued_ms"] > 0 and r["flex_queued_ms"] > 0 for r in rec["rows"]), rec["rows"]


def _torchrun_smoke(script: str, tmp_path, *extra: str, timeout: float = 240):
    """benchmarks/<script> --smoke [extra] under torchrun at p = 2 (gloo): (the process, its JSON record)."""
    out = tmp_path / "record.json"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(ROOT / "benchmarks" / script), "--smoke", "--json", str(out), *extra],
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc, json.loads(out.read_text())


@pytest.mark.soak
def test_compiled_model_benchmark_counts_one_key_runs_gather_per_step(tmp_path):
    """bench_model_masked.py end to end on CPU (gloo, p = 2, smoke sizes): the compiled model
    with a padding mask all-gathers its key-runs table once per training step (not per layer:
    Note [Key runs per mask]); unmasked, never. Both placements of the gradient all-reduce's
    waits run, and with --one-gpu each case on rank 0 alone at the whole length."""
    proc, rec = _torchrun_smoke("bench_model_masked.py", tmp_path, "--grad-waits", "last", "at-once", "--one-gpu")
    assert rec["device"] == "cpu (smoke, gloo)"
    assert [(r["case"], r["p"], r["grad_waits"], r["layers"], r["key_run_gathers_per_step"]) for r in rec["rows"]] == [
        ("unmasked", 2, "last", 2, 0), ("unmasked", 2, "at-once", 2, 0), ("unmasked", 1, "-", 2, 0),
        ("key padding", 2, "last", 2, 1), ("key padding", 2, "at-once", 2, 1), ("key padding", 1, "-", 2, 0)]
    assert all(r["ms"] > 0 for r in rec["rows"])
    for one in (r for r in rec["rows"] if r["p"] == 1):
        ring = [r["ms"] for r in rec["rows"] if r["p"] == 2 and r["case"] == one["case"]]
        assert one["n"] == 2 * 16 and one["speedup_of_best"] == pytest.approx(one["ms"] / min(ring))
    assert "speed-up" in proc.stdout


@pytest.mark.soak
def test_compiled_model_benchmark_amp_compares_four_steps(tmp_path):
    """bench_model_masked.py --model hf-llama --amp both --plain (CPU, gloo, p = 2, smoke sizes):
    every case with bf16 (here fp32) weights and with fp32 weights under bf16 autocast, ringcc at
    p = 2 and on one device, plain torch.compile on one device; every ringcc graph rewrites both
    sites, and the mixed-precision targets are computed from the one-device rows."""
    proc, rec = _torchrun_smoke("bench_model_masked.py", tmp_path, "--model", "hf-llama", "--cases", "unmasked",
                                "--amp", "both", "--plain", "--one-gpu", timeout=900)
    assert rec["model"] == "hf-llama"
    assert [(r["p"], r["compiler"], r["amp"]) for r in rec["rows"]] == [
        (2, "ringcc", False), (1, "ringcc", False), (1, "plain", False),
        (2, "ringcc", True), (1, "ringcc", True), (1, "plain", True)]
    assert all(r["sites"] == "2/2" for r in rec["rows"] if r["compiler"] == "ringcc")
    (t,) = rec["amp_targets"]
    one = {(r["compiler"], r["amp"]): r["ms"] for r in rec["rows"] if r["p"] == 1}
    assert t["speedup_over_plain"] == pytest.approx(one["plain", True] / one["ringcc", True])
    assert t["budget_ms"] == pytest.approx(one["ringcc", False] + one["plain", True] - one["plain", False])
    assert "target >= 1.5x" in proc.stdout


@pytest.mark.soak
def test_checkpoint_benchmark_restores_regions_and_plans_less(tmp_path):
    """bench_checkpoint.py end to end on CPU (gloo, p = 2, smoke sizes): in "recompute" mode the
    report says the regions were checkpointed again and the plan holds less than "inline"."""
    proc, rec = _torchrun_smoke("bench_checkpoint.py", tmp_path)
    assert rec["device"] == "cpu (smoke, gloo)"
    rows = {r["mode"]: r for r in rec["rows"]}
    assert rows["recompute"]["regions_restored_note"] and not rows["inline"]["regions_restored_note"]
    assert 0 < rows["recompute"]["planned_peak_bytes"] < rows["inline"]["planned_peak_bytes"]
    assert "plan/peak" in proc.stdout and all(r["ms"] > 0 for r in rec["rows"])


@pytest.mark.soak
@pytest.mark.parametrize("amp", [False, True], ids=["fp32", "amp"])
def test_fsdp_benchmark_trains_the_same_model_as_one_device(tmp_path, amp):
    """bench_fsdp.py end to end on CPU (gloo, p = 2, smoke sizes): FSDP2 + ringcc and the one-device
    run train the same model on the same tokens (equal losses after the same steps; within bf16
    rounding with --amp, fp32 parameters under bf16 autocast); ringcc shards the blocks and the
    head (no gather in the head) and scales every gradient share for FSDP2's mean over both
    ranks; causal context parallel needs CUDA and is recorded as skipped."""
    proc, rec = _torchrun_smoke("bench_fsdp.py", tmp_path, *(["--amp"] if amp else []))
    assert rec["device"] == "cpu (smoke, gloo)" and rec["amp"] == amp
    rows = {r["method"]: r for r in rec["records"]}
    assert rows["cp"]["status"].startswith("skipped")
    ring, one = rows["ringcc"], rows["single"]
    assert ring["status"] == one["status"] == "ok" and ring["tokens_per_s"] > 0 and one["tokens_per_s"] > 0
    assert ring["loss"] == pytest.approx(one["loss"], rel=1e-2 if amp else 1e-5)
    assert one["notes"]["compute"] == str(torch.bfloat16 if amp else torch.float32)
    *blocks, head = ring["notes"]["reports"]  # the first block from plain inputs, the others handed shards
    assert 1 <= len(blocks) <= 2, blocks
    for block in blocks:
        assert "parameter gradients: 0 all-reduced over the sequence group, 9 scaled by p" in " ".join(block["notes"])
    assert "parameter gradients: 0 all-reduced over the sequence group, 4 scaled by p" in " ".join(head["notes"])
    assert head["gathers"] == [] and "ringcc" in proc.stdout


def test_timeline_summary_of_a_trace(tmp_path):
    """benchmarks/timeline.py on a small chrome trace: busy time per stream and family, the
    compute's idle time and its longest gap with the events around it, the profiler's own host
    stalls."""
    import gzip

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import timeline

    ev = lambda name, ts, dur, stream, cat="kernel": {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur,  # noqa: E731
                                                       "args": {"stream": stream}}
    trace = {"traceEvents": [
        ev("cudnn_generated_fort_native_sdpa_sm90_flash_fprop", 0.0, 100.0, 7),
        ev("_merge_kernel", 100.0, 10.0, 7),
        ev("cudnn_generated_fort_native_sdpa_sm90_flash_bprop", 150.0, 200.0, 7),  # a 40 µs gap before it
        ev("Memcpy PtoP (Device -> Device)", 20.0, 60.0, 21, "gpu_memcpy"),
        ev("Memcpy PtoP (Device -> Device)", 60.0, 40.0, 21, "gpu_memcpy"),  # overlaps the first: busy once
        {"ph": "X", "cat": "cpu_op", "name": "aten::add", "ts": 0.0, "dur": 500.0},  # host events are left out
        {"ph": "X", "cat": "overhead", "name": "Activity Buffer Request", "ts": 105.0, "dur": 45.0},
        ev("nvjet_sm90_tst_128x256_64x4_2x1_v_bz_coopB_NNT", 400.0, 30.0, 9),
        ev("triton_poi_fused_gelu_view_3", 430.0, 5.0, 9),
        ev("triton_tem_fused_flex_attention_0", 435.0, 0.0, 9),
        {"ph": "X", "cat": "overhead", "name": "Activity Buffer Request", "ts": 900.0, "dur": 50.0},  # after the step
    ]}
    path = tmp_path / "t.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump(trace, f)
    evs, stalls = timeline.read(path)
    s = timeline.summarize(evs)
    assert s["span_us"] == 435.0 and s["compute_busy_us"] == 345.0 and s["idle_us"] == 90.0
    assert s["streams"][7]["busy_us"] == 310.0
    assert s["streams"][7]["by_family"] == {"attention": 300.0, "ring passes": 10.0}
    assert s["streams"][9]["by_family"] == {"matmul": 30.0, "inductor": 5.0, "attention": 0.0}
    assert s["streams"][21]["busy_us"] == 80.0 and s["streams"][21]["by_family"] == {"peer copies": 100.0}
    assert s["gap_count"] == 2 and s["gaps"][0][:2] == (350.0, 50.0)  # the longest first
    assert s["gaps"][1][:2] == (110.0, 40.0) and s["gaps"][1][2] == "_merge_kernel"
    assert stalls == 45.0
    text = timeline.format_summary(s, stalls)
    assert "idle 0.090 ms" in text and "gap    40.0 µs" in text and "before cudnn_generated" in text
    assert "the profiler's own host stalls (Activity Buffer Request): 0.045 ms" in text


@pytest.mark.soak
def test_short_chunk_launcher_alternates_a_patched_tree(tmp_path):
    """benchmarks/run_gpu.sh short end to end on CPU (SMOKE=1: gloo, p = 2, tiny sizes) with a
    patch: the single-device baseline once, then the ring's cells and the compiled step on the tree
    and on the patched copy, each run importing its own tree, all in the archive."""
    patch = tmp_path / "marker.patch"
    patch.write_text("--- a/runtime/__init__.py\n+++ b/runtime/__init__.py\n@@ -1,2 +1,3 @@\n"
                     + "".join(" " + line + "\n" for line in (ROOT / "runtime" / "__init__.py").read_text().splitlines()[:2])
                     + "+PATCHED = True\n")
    env = dict(os.environ, SMOKE="1", ROUNDS="1", OUT=str(tmp_path / "out"), PATCH=str(patch), OMP_NUM_THREADS="1",
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "run_gpu.sh"), "short"], capture_output=True, text=True,
                          timeout=600, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    trees = [line.split("ringcc from ")[1] for line in proc.stdout.splitlines() if line.startswith("ringcc from ")]
    assert trees[0].startswith(str(ROOT)) and any(t.startswith("/tmp/ringcc_patched") for t in trees), trees
    assert trees[-1].startswith(str(ROOT)), trees  # the tree's own install is back at the end
    assert (tmp_path / "out" / "short.tgz").is_file()
    work = tmp_path / "out" / "short"
    for name in ("tree", "patched"):
        assert " ring-zigzag " in (work / f"report_{name}_1" / "table.txt").read_text()
        rows = json.loads((work / f"step_{name}_1.json").read_text())["rows"]
        assert {r["p"] for r in rows} == ({1, 2} if name == "tree" else {2}), rows
