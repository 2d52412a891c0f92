"""p = 8 on gloo (CPU): the correctness of an 8-GPU ring, runnable without GPUs.

One pool of 8 real processes: exact ring attention (zigzag causal GQA with key padding, and
non-causal contiguous MQA) and dilated attention with segments inside a shard and spanning
2 and 8 ranks, all against the dense references at fp32 1e-5.
"""

import pytest

import ringcc
from test_dilated import _check
from test_ring import case_ring

pytestmark = pytest.mark.soak

WORLD = 8


def case_world8(rank, world):
    errs = [
        case_ring(rank, world, True, "zigzag", 8, 2, 6, True),
        case_ring(rank, world, False, "contiguous", 4, 1, 5, False),
        case_ring(rank, world, True, "zigzag", 4, 2, 6, False, 9),  # sliding window across ranks
    ]
    spec = ringcc.DilatedSpec([4, 8, 16, 64], [1, 2, 4, 8])  # shard = 8 tokens
    for is_causal in (False, True):
        _check(rank, world, spec, is_causal, 8, 2)
    return max(errs)


def test_ring_and_dilated_at_p8(pools):
    errs = pools(WORLD).run(case_world8, timeout=300)
    assert len(errs) == WORLD and max(errs) < 1e-5
