"""The planner against the allocator, offline: GPU runs of bench_planner_gpu.py (one training
step, `max_memory_allocated` minus what was allocated before) are re-planned here on CPU, as
CUDA, at the same n and p; the plan must stay within 10% of what the GPU measured. This keeps
formula changes honest between GPU runs.
- benchmarks/results/2026-11-26_4xH200_planner_nccl.json (4 x H200): run with
  RINGCC_RING_WORKSPACE_MIB=512, its rings over NCCL (it predates the copy-engine transport, so
  it is re-planned with that);
- benchmarks/results/2026-11-26_2xH100_planner_copy_engine.json (2 x H100): the
  default budget and the copy-engine transport, whose receive area is resident in the plan and
  in the measurement;
- benchmarks/results/2026-11-27_4xH200_planner_masked_math_p4.json (4 x H200): an
  attention layer with a window and key padding (masked blocks on the math path), at p = 4:
  there the plan is a bound, not an estimate;
- benchmarks/results/2026-11-27_4xH200_planner_p2.json (p = 2 on 4 x H200,
  the runtime that lets go of a sent accumulator): the same layer with masked blocks on
  flex_attention (the default), and the plain attention layer, both on the copy-engine ring;
- benchmarks/results/2026-11-30_1xH200_planner_p1.json (1 x H200, p = 1): the masked
  layer, packed documents (a mask function) and soft-capped scores (a score function), their
  blocks on flex_attention, and the plain attention layer, each block one call over whole heads."""

import json
from pathlib import Path

import pytest
import torch

from ringcc import planner
from ringcc.runtime import workspace
from ringcc.planner_cli import trace_plans

ROOT = Path(__file__).resolve().parents[1]
RECORD = ROOT / "benchmarks" / "results" / "2026-11-26_4xH200_planner_nccl.json"
COPY_ENGINE_RECORD = ROOT / "benchmarks" / "results" / "2026-11-26_2xH100_planner_copy_engine.json"
MASKED_RECORD = ROOT / "benchmarks" / "results" / "2026-11-27_4xH200_planner_masked_math_p4.json"
# p = 2 on a 4 x H200 machine, on the runtime that lets go of a sent accumulator
P2_RECORD = ROOT / "benchmarks" / "results" / "2026-11-27_4xH200_planner_p2.json"
FLEX_P1_RECORD = ROOT / "benchmarks" / "results" / "2026-11-30_1xH200_planner_p1.json"


@pytest.fixture
def floor_of_the_records(monkeypatch):
    """The default head-chunk budget as it was when the recorded runs below were made (a
    256 MiB floor; workspace.RING_BUDGET_FLOOR), so that the plans choose the chunks that ran."""
    monkeypatch.setattr(workspace, "RING_BUDGET_FLOOR", 256 * 2**20)
    workspace._ring_kv_chunks.cache_clear()
    yield
    workspace._ring_kv_chunks.cache_clear()


def _replan(monkeypatch, record: Path, model: str, p: int, trace_len: int | None = None):
    """(the record's rows of `model` at p, a step_bytes(plan, n) function over the CPU-traced plans)."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import bench_planner_gpu

    rows = [r for r in json.loads(record.read_text())["rows"] if r["model"] == model and r["p"] == p]
    assert rows, f"no recorded {model} rows at p={p}"
    trace_len = trace_len or 96 * p  # equals no model dim (1536, 512, 128, 12, 4480)
    m, inputs = bench_planner_gpu.make(model, trace_len, torch.device("cpu"), torch.bfloat16, False)
    plans, _ = trace_plans(m, inputs, world_size=p, trace_len=trace_len, training=True, dynamic=False,
                           device_type="cuda")
    return rows, plans, lambda n_: max(bench_planner_gpu.step_bytes(pl, n_, p) for pl in plans)


def _ratios(rows, step_bytes) -> dict:
    """n -> planned / measured step bytes of each recorded row."""
    return {r["n"]: step_bytes(r["n"]) / r["measured_step_bytes"] for r in rows}


def _check_steps(rows, step_bytes, model, p):
    for r in rows:
        planned = step_bytes(r["n"])
        err = planned / r["measured_step_bytes"] - 1
        assert abs(err) <= 0.10, (model, r["n"], p, planned, r["measured_step_bytes"], err)


# the attention layer at p = 1 in the soak tier: the same record's attention rows at p = 2 stay
@pytest.mark.parametrize("model,p", [pytest.param("attention", 1, marks=pytest.mark.soak), ("attention", 2),
                                     pytest.param("llama", 4, marks=pytest.mark.soak)])
def test_plan_matches_the_recorded_gpu_measurement(monkeypatch, model, p):
    monkeypatch.setenv("RINGCC_RING_WORKSPACE_MIB", "512")
    monkeypatch.setenv("RINGCC_RING_TRANSPORT", "nccl")
    rows, _, step_bytes = _replan(monkeypatch, RECORD, model, p)
    _check_steps(rows, step_bytes, model, p)


# the attention layer in the soak tier: its copy-engine step bytes at p = 2 in make test are
# test_copy_engine_plan_matches_the_allocator_at_p2's, the receive area the llama case's
@pytest.mark.parametrize("model", [pytest.param("attention", marks=pytest.mark.soak), "llama"])
def test_plan_matches_a_copy_engine_run(monkeypatch, floor_of_the_records, model):
    """The planned receive area is the one the run allocated (up to the alignment the formula
    adds as a bound: 256 bytes per tensor and slot)."""
    monkeypatch.delenv("RINGCC_RING_WORKSPACE_MIB", raising=False)
    monkeypatch.delenv("RINGCC_RING_TRANSPORT", raising=False)
    p = 2
    rows, plans, step_bytes = _replan(monkeypatch, COPY_ENGINE_RECORD, model, p)
    assert len(rows) == 3 and all(r["ring_transport"]["transport"] == "copy-engine" for r in rows)
    _check_steps(rows, step_bytes, model, p)
    for r in rows:
        area = max(planner._evaluate(pl.area, pl._subs(r["n"], p)) for pl in plans)
        got = r["ring_transport"]["area_bytes"]
        assert got <= area <= got + 2 * 4 * 256, (model, r["n"], area, r["ring_transport"])


def test_masked_plan_bounds_the_recorded_gpu_measurement(monkeypatch, floor_of_the_records):
    """Masked blocks on CUDA (a window of 2048 and key padding: the math path in row chunks cut
    to their keys) at p = 4: the plan is at least what the GPU allocated, and at most 1.6x. It
    is traced at 16384 tokens, so that the window is shorter than a shard (traced shorter, the
    lifted mask would be causal alone)."""
    monkeypatch.delenv("RINGCC_RING_WORKSPACE_MIB", raising=False)
    monkeypatch.delenv("RINGCC_RING_TRANSPORT", raising=False)
    monkeypatch.setenv("RINGCC_MASKED_KERNEL", "math")  # what ran then
    rows, plans, step_bytes = _replan(monkeypatch, MASKED_RECORD, "masked", 4, trace_len=16384)
    assert [r["n"] for r in rows] == [16384, 32768, 65536]
    ratios = _ratios(rows, step_bytes)
    assert all(1.0 <= x <= 1.6 for x in ratios.values()), ratios


@pytest.mark.xfail(strict=True, reason="the p = 2 record was measured with a flex backward of two kernels per block "
                   "(a recompute of the block's forward), which held more than the one-kernel backward the plan "
                   "counts; re-record it on 2 GPUs (bench_planner_gpu.py --models masked)")
def test_flex_masked_plan_bounds_the_recorded_gpu_measurement(monkeypatch, floor_of_the_records):
    """Masked blocks on flex_attention (Note [Flex blocks]) at p = 2: the plan bounds what the GPU
    allocated, by at most 1.3x. At 16K, rank 1's peak
    (memory_snapshot.py) holds the dK/dV accumulator it had sent
    after step 0 (the copy-engine ring keeps its sources until the batch is waited for) during
    step 1's flex kernels (workspace._ring_chunk, "later kernels")."""
    monkeypatch.delenv("RINGCC_RING_WORKSPACE_MIB", raising=False)
    monkeypatch.delenv("RINGCC_RING_TRANSPORT", raising=False)
    monkeypatch.setenv("RINGCC_MASKED_KERNEL", "flex")
    rows, plans, step_bytes = _replan(monkeypatch, P2_RECORD, "masked", 2, trace_len=16384)
    assert [r["n"] for r in rows] == [16384, 32768, 65536]
    ratios = _ratios(rows, step_bytes)
    assert all(1.0 <= x <= 1.3 for x in ratios.values()), ratios


def test_copy_engine_plan_matches_the_allocator_at_p2(monkeypatch, floor_of_the_records):
    """The attention layer at p = 2 on the copy-engine ring, measured on the runtime that lets go
    of a sent accumulator once the transport holds it: the plan equals the
    allocator's step bytes at 16K, 32K and 64K tokens to within a few hundred bytes (the
    accumulator in flight during the next step's kernels counted, workspace._ring_chunk)."""
    monkeypatch.delenv("RINGCC_RING_WORKSPACE_MIB", raising=False)
    monkeypatch.delenv("RINGCC_RING_TRANSPORT", raising=False)
    rows, _, step_bytes = _replan(monkeypatch, P2_RECORD, "attention", 2)
    assert [r["n"] for r in rows] == [16384, 32768, 65536]
    ratios = _ratios(rows, step_bytes)
    assert all(0.9999 <= x <= 1.02 for x in ratios.values()), ratios


@pytest.mark.parametrize("model", ["documents", pytest.param("softcap", marks=pytest.mark.soak),
                                   pytest.param("masked", marks=pytest.mark.soak)])
def test_flex_function_plans_match_the_recorded_gpu_measurement(monkeypatch, model):
    """Blocks under a mask function (packed documents), a score function (soft-cap) or a window
    with key padding, on flex_attention at p = 1 (Note [Flex blocks]; workspace.masked_calls):
    the plan within 10% of the step the GPU measured, at 16K and 64K tokens. Traced at 8192
    tokens: a window of 2048 and eight documents stay shorter than the sequence."""
    monkeypatch.delenv("RINGCC_RING_WORKSPACE_MIB", raising=False)
    monkeypatch.delenv("RINGCC_RING_TRANSPORT", raising=False)
    monkeypatch.setenv("RINGCC_MASKED_KERNEL", "flex")
    rows, _, step_bytes = _replan(monkeypatch, FLEX_P1_RECORD, model, 1, trace_len=8192)
    assert [r["n"] for r in rows] == [16384, 65536]
    _check_steps(rows, step_bytes, model, 1)
