"""Shared assertion for the distributed attention tests: a rank's shard of (out, lse) and of
every gradient equals the same shard of the dense reference."""

import torch


def assert_shard_matches(sh, out, lse, ref_out, ref_lse, grads, tol):
    """sh: full tensor -> this rank's shard; grads: (got_local, ref_full) pairs."""
    torch.testing.assert_close(out, sh(ref_out.detach()), **tol)
    torch.testing.assert_close(lse, sh(ref_lse.detach()), **tol)
    for got, ref in grads:
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, sh(ref), **tol)
