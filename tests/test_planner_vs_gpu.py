"""The planner against the allocator, offline: the GPU run recorded in
benchmarks/results/2026-11-26_4xH200_planner_vs_measured_final.json (4 x H200, one training
step, `max_memory_allocated` minus what was allocated before) is re-planned here on CPU, as
CUDA, at the same n and p; the plan must stay within 10% of what the GPU measured. This keeps
formula changes honest between GPU sessions (the run used RINGCC_RING_WORKSPACE_MIB=512, and its
rings ran over NCCL: it predates the copy-engine transport, so it is re-planned with that)."""

import json
from pathlib import Path

import pytest
import torch

from ringcc.planner_cli import trace_plans

ROOT = Path(__file__).resolve().parents[1]
RECORD = ROOT / "benchmarks" / "results" / "2026-11-26_4xH200_planner_vs_measured_final.json"


@pytest.mark.parametrize("model,p", [("attention", 1), ("attention", 2), ("llama", 4)])
def test_plan_matches_the_recorded_gpu_measurement(monkeypatch, model, p):
    monkeypatch.setenv("RINGCC_RING_WORKSPACE_MIB", "512")
    monkeypatch.setenv("RINGCC_RING_TRANSPORT", "nccl")
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import bench_planner_gpu

    rows = [r for r in json.loads(RECORD.read_text())["rows"] if r["model"] == model and r["p"] == p]
    assert rows, f"no recorded {model} rows at p={p}"
    trace_len = 96 * p  # equals no model dim (1536, 512, 128, 12, 4480)
    m, inputs = bench_planner_gpu.make(model, trace_len, torch.device("cpu"), torch.bfloat16, False)
    plans, _ = trace_plans(m, inputs, world_size=p, trace_len=trace_len, training=True, dynamic=False,
                           device_type="cuda")
    for r in rows:
        planned = max(bench_planner_gpu.step_bytes(pl, r["n"], p) for pl in plans)
        err = planned / r["measured_step_bytes"] - 1
        assert abs(err) <= 0.10, (model, r["n"], p, planned, r["measured_step_bytes"], err)


COPY_ENGINE_RECORD = ROOT / "benchmarks" / "results" / "2026-11-26_2xH100_s9_planner_vs_measured.json"


@pytest.mark.parametrize("model", ["attention", "llama"])
def test_plan_matches_a_copy_engine_run(monkeypatch, model):
    """A later run (2 x H100, session 9, default head-chunk budget) whose rings used the
    copy-engine transport: its receive area is resident in the plan and in the measurement, and
    the planned area is the one the run allocated (up to the alignment the formula adds as a
    bound: 256 bytes per tensor and slot)."""
    monkeypatch.delenv("RINGCC_RING_WORKSPACE_MIB", raising=False)
    monkeypatch.delenv("RINGCC_RING_TRANSPORT", raising=False)
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import bench_planner_gpu

    from ringcc import planner

    p = 2
    rows = [r for r in json.loads(COPY_ENGINE_RECORD.read_text())["rows"] if r["model"] == model and r["p"] == p]
    assert len(rows) == 3 and all(r["ring_transport"]["transport"] == "copy-engine" for r in rows)
    trace_len = 96 * p
    m, inputs = bench_planner_gpu.make(model, trace_len, torch.device("cpu"), torch.bfloat16, False)
    plans, _ = trace_plans(m, inputs, world_size=p, trace_len=trace_len, training=True, dynamic=False,
                           device_type="cuda")
    for r in rows:
        planned = max(bench_planner_gpu.step_bytes(pl, r["n"], p) for pl in plans)
        err = planned / r["measured_step_bytes"] - 1
        assert abs(err) <= 0.10, (model, r["n"], p, planned, r["measured_step_bytes"], err)
        area = max(planner._evaluate(pl.area, pl._subs(r["n"], p)) for pl in plans)
        got = r["ring_transport"]["area_bytes"]
        assert got <= area <= got + 2 * 4 * 256, (model, r["n"], area, r["ring_transport"])
