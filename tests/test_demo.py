"""`ringcc demo` at a tiny size: both modes run, check parity, and write their outputs."""

import json

import pytest

from ringcc import cli


def test_train_demo_tiny(tmp_path, capsys):
    rc = cli.main(["demo", "--world-size", "2", "--seq-len", "128", "--steps", "3", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "parity: OK" in out
    assert "attention sites rewritten" in out
    data = json.loads((tmp_path / "demo.json").read_text())
    losses = data["per_rank"]["0"]["losses"]
    assert len(losses) == 3 and all(x == x for x in losses)  # no NaN
    # Every rank computed the same (replicated) loss.
    for r in ("1",):
        assert data["per_rank"][r]["losses"] == losses
    assert (tmp_path / "demo.png").stat().st_size > 10_000
    assert all(not k.startswith("_") for k in data["args"]) and data["args"]["seq_len"] == 128
    # like with like: the plan against the tensors a step holds at its peak (not the process's RSS,
    # which counts the compiler and the interpreter too)
    for r in ("0", "1"):
        rank = data["per_rank"][r]
        assert 0.5 < rank["measured_peak_mib"] / rank["planned_peak_mib"] < 1.5, rank


@pytest.mark.soak
def test_ring_demo_tiny(tmp_path, capsys):
    rc = cli.main(["demo", "--mode", "ring", "--world-size", "2", "--seq-len", "256", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "parity: OK" in out


def test_demo_rejects_indivisible_length(tmp_path):
    with pytest.raises(SystemExit, match=r"--seq-len 100 must be divisible by 2 x world size = 8"):
        cli.main(["demo", "--world-size", "4", "--seq-len", "100", "--out", str(tmp_path)])


def test_demo_rejects_bad_steps_and_learning_rate(tmp_path):
    import pytest

    with pytest.raises(SystemExit, match=r"--steps must be >= 1 \(training steps\); got 0"):
        cli.main(["demo", "--steps", "0", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match=r"--lr must be > 0 \(the AdamW learning rate\); got -1.0"):
        cli.main(["demo", "--lr", "-1", "--out", str(tmp_path)])
