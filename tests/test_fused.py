"""runtime/fused.py's Triton kernels on CPU, through Triton's interpreter (TRITON_INTERPRET=1, set
before the kernels are defined, so in a subprocess). Needs the `triton` package, which CPU builds
of torch do not bring: skipped without it. The same check on a GPU, in bf16 too:
tests/test_ring_gpu.py::test_triton_sums_match_torch."""

import os
import subprocess
import sys
from pathlib import Path

import pytest


def test_triton_sums_in_the_interpreter():
    pytest.importorskip("triton")
    code = "import torch, fused_check; fused_check.check('cpu', (torch.float32, torch.float16)); print('ok')"
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(Path(__file__).parent))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env, cwd="/")
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stdout[-2000:] + proc.stderr[-3000:]
