"""Soak tier (make test-soak): hundreds of compiled training steps at changing lengths on
p = 4 gloo processes: memory stays flat after warm-up, no thread is left over, and every
process exits cleanly (exit code 0, no abort at shutdown: Note [Ending a gloo process])."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.soak
def test_training_steps_at_changing_lengths_keep_memory_and_threads_flat(tmp_path):
    steps, world = 300, 4
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world),
           os.path.join(ROOT, "tests", "soak_worker.py"), "--steps", str(steps), "--out", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    output = proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.returncode == 0, output
    assert "terminate called" not in proc.stderr and "Signals.SIGABRT" not in proc.stderr, output
    for rank in range(world):
        rec = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert rec["steps"] == steps and rec["loss"] == rec["loss"]  # ran to the end, loss not NaN
        assert rec["rss_end"] <= 1.05 * rec["rss_warm"], (rank, rec["rss_warm"], rec["rss_end"])
        assert rec["threads_end"] == rec["threads_warm"] and rec["tasks_end"] == rec["tasks_warm"], (rank, rec)
