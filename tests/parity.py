"""Shared helpers of the distributed attention tests: a rank's shard of (out, lse) and of
every gradient equals the same shard of the dense reference; the relative error of a bf16
result; the head-chunk budget set for a block of code."""

import contextlib
import os

import torch


def assert_shard_matches(sh, out, lse, ref_out, ref_lse, grads, tol):
    """sh: full tensor -> this rank's shard; grads: (got_local, ref_full) pairs."""
    torch.testing.assert_close(out, sh(ref_out.detach()), **tol)
    torch.testing.assert_close(lse, sh(ref_lse.detach()), **tol)
    for got, ref in grads:
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, sh(ref), **tol)


def rel_err(got, want) -> float:
    """Largest absolute error over the reference's largest magnitude (max-norm), in fp32; inf
    where `got` holds a NaN or an infinity, so that neither `max()` over errors (which keeps a
    NaN only when it comes first) nor a `>` test (false for NaN) lets one through."""
    got = got.float()
    if not torch.isfinite(got).all():
        return float("inf")
    return float((got - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-6))


def lse_err(got, want) -> float:
    """Largest |got - want| of two log-sum-exp tensors; rows with no visible key are -inf in
    both and count as equal; a NaN, or -inf on one side only, gives inf."""
    both_empty = torch.isneginf(got) & torch.isneginf(want)
    diff = torch.where(both_empty, torch.zeros_like(got), got - want).abs()
    return float("inf") if not torch.isfinite(diff).all() else float(diff.max())


@contextlib.contextmanager
def workspace_mib(value):
    """RINGCC_RING_WORKSPACE_MIB set to `value` inside (None: left as it is), restored after."""
    if value is None:
        yield
        return
    old = os.environ.get("RINGCC_RING_WORKSPACE_MIB")
    os.environ["RINGCC_RING_WORKSPACE_MIB"] = value
    try:
        yield
    finally:
        if old is None:
            del os.environ["RINGCC_RING_WORKSPACE_MIB"]
        else:
            os.environ["RINGCC_RING_WORKSPACE_MIB"] = old


@contextlib.contextmanager
def counting_key_runs():
    """Counts the key-runs tables made inside the block (by ringcc::key_runs or by a ring op
    making its own: Note [Key runs per mask]); yields a one-element list holding the count."""
    from ringcc.runtime import ops, ring

    calls, table_fn = [0], ring.key_runs_table

    def counted(*args, **kwargs):
        calls[0] += 1
        return table_fn(*args, **kwargs)

    ops.key_runs_table = ring.key_runs_table = counted
    try:
        yield calls
    finally:
        ops.key_runs_table = ring.key_runs_table = table_fn


def fp64_judge(got, eager, ref) -> dict:
    """Relative L2 distances to an fp64 reference of a lower-precision run (`got`) and of eager
    under the same precision (`eager`), per part: each argument a tuple of tensors or
    {name: tensor} dicts (None entries, parameters without a gradient, are left out; a dict
    part is one vector, the whole gradient). Returns {part: (got_err, eager_err)}."""
    def flat(x):
        if isinstance(x, dict):
            return torch.cat([x[k].detach().double().flatten() for k in sorted(x) if x[k] is not None])
        return x.detach().double().flatten()

    out = {}
    for i, (g, e, r) in enumerate(zip(got, eager, ref)):
        g, e, r = flat(g), flat(e), flat(r)
        norm = float(r.norm()) or 1.0
        out[i] = (float((g - r).norm()) / norm, float((e - r).norm()) / norm)
    return out


FP64_SLACK = 1.25  # how much further from fp64 than eager a run may be (its rounding order differs)
# A distance below which any run counts as close (a 16th of bf16's rounding unit 2^-8): a scalar
# such as the loss can land nearer fp64 than bf16 rounding accounts for, by luck, in eager.
FP64_FLOOR = 2.0 ** -12


def fp64_excess(judged: dict, slack: float = FP64_SLACK, floor: float = FP64_FLOOR) -> list[str]:
    """The parts of an fp64_judge result where the run is further from fp64 than `slack` times
    eager's distance and than `floor` (empty: as close as eager)."""
    return [f"part {part}: {got:.3e} from fp64, eager {eager:.3e}" for part, (got, eager) in judged.items()
            if not got <= max(slack * eager, floor)]
