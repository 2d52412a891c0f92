import pytest
from test_rewrite_zoo import _zoo_case

@pytest.mark.parametrize("world", [2])
def test_bloom_padded_program(pools, tmp_path, world):
    _zoo_case(pools, tmp_path, ["zoo_bloom_padded", "zoo_bloom", "zoo_mpt_padded"], world)
