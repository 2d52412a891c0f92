import pytest

from distpool import DistPool

_POOLS: dict[tuple[int, str], DistPool] = {}


def get_pool(world: int, backend: str = "gloo") -> DistPool:
    key = (world, backend)
    if key not in _POOLS:
        _POOLS[key] = DistPool(world, backend)
    return _POOLS[key]


@pytest.fixture(scope="session")
def pools():
    yield get_pool
    for pool in _POOLS.values():  # every pool winds down at once
        pool.stop()
    for pool in _POOLS.values():
        pool.close()
    _POOLS.clear()
