import functools

import pytest

from distpool import DistPool, start_forkserver

_POOLS: dict[str, DistPool] = {}  # one per backend, serving every world size


def get_pool(world: int, backend: str = "gloo"):
    """The session's pool of `backend` processes, running each case on `world` ranks:
    `get_pool(2).run(fn, *args)` (Note [One pool for every world size] in distpool.py)."""
    if backend not in _POOLS:
        _POOLS[backend] = DistPool(world, backend)
    return _World(functools.partial(_POOLS[backend].run, world=world))


class _World:
    def __init__(self, run):
        self.run = run


def pytest_collection_finish(session):
    """Start the pools' forkserver, and its imports, while the first tests run."""
    if any("pools" in getattr(item, "fixturenames", ()) for item in session.items):
        start_forkserver()


@pytest.fixture(scope="session")
def pools():
    yield get_pool
    for pool in _POOLS.values():  # every pool winds down at once
        pool.stop()
    for pool in _POOLS.values():
        pool.close()
    _POOLS.clear()
