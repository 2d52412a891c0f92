"""A pool of real gloo (or NCCL) processes that tests send functions to.

Starting a process costs seconds (importing torch, then ringcc, dynamo and transformers on its
first case), so one pool serves every world size for the whole test session:
`pool.run(fn, *args, world=p)` runs fn(rank, world, *args) on ranks 0..p-1 (fn must be importable
at module level) and returns the per-rank results; the pool grows to p processes when it has
fewer. An exception on any rank is re-raised here with that rank's traceback. A case that hangs
fails after `timeout` seconds and the pool is rebuilt.

The gloo processes are forked from a forkserver that has imported what nearly every case imports
(torch, dynamo, inductor's front end, ringcc, transformers' Llama): each process starts with
them instead of importing them again (about 10 s of CPU each). NCCL processes are spawned.

Note [One pool for every world size]
A case runs in the default process group of exactly its p ranks. When p differs from the
previous case's, each of the case's ranks leaves its group and joins a new one of p ranks (a
few tens of ms: the rendezvous goes through one TCPStore that the parent hosts, under a fresh
prefix per group) and resets dynamo, as a process started for p would be: a graph compiled
for one world size is never called at another. Ranks above p sit the case out and regroup at
their next case. os.environ is restored after every case, so that the ranks of a world agree on
the settings read from it whichever earlier cases each has run.
"""

from __future__ import annotations

import datetime
import itertools
import os
import queue
import traceback
from multiprocessing import forkserver

import torch.multiprocessing as mp

_TIMEOUT = datetime.timedelta(seconds=60)
# imported once, by the forkserver (a module that fails to import is left out)
_PRELOAD = ["distpool", "torch", "torch.distributed", "torch._dynamo", "torch._inductor.compile_fx", "ringcc",
            "transformers", "transformers.models.llama.modeling_llama"]


def start_forkserver():
    """The pools' process context. The forkserver starts at the first call and imports _PRELOAD
    in the background; a process forked before it has finished waits for it."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    # the workers' OpenMP reads its thread count when the forkserver loads torch
    omp = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        forkserver.ensure_running()
    finally:
        if omp is None:
            del os.environ["OMP_NUM_THREADS"]
        else:
            os.environ["OMP_NUM_THREADS"] = omp
    return ctx


def _regroup(rank, world, backend, store, prefix):
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
        torch._dynamo.reset()
    dist.init_process_group(backend, store=dist.PrefixStore(prefix, store), rank=rank, world_size=world,
                            timeout=_TIMEOUT)


def _worker(rank, port, backend, jobs, results):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=_TIMEOUT)
    group = None  # the prefix of the group this process is in
    while True:
        job = jobs.get()
        if job is None:
            break
        world, prefix, fn, args = job
        env = dict(os.environ)
        try:
            if prefix != group:
                group = None
                _regroup(rank, world, backend, store, prefix)
                group = prefix
            results.put((rank, True, fn(rank, world, *args)))
        except BaseException:  # noqa: BLE001 - reported to the parent with its traceback
            results.put((rank, False, traceback.format_exc()))
        finally:
            # every case starts in the pool's environment: a setting one case leaves on the
            # ranks of its world would differ from ranks that did not run it
            if os.environ != env:
                os.environ.clear()
                os.environ.update(env)
    if dist.is_initialized():
        dist.destroy_process_group()
    # The parent has read every result; an interpreter shutdown with torch loaded takes seconds
    # per process, and gloo threads may outlive it (Note [Ending a gloo process]). The queues'
    # finalizers still run (multiprocessing's own exit step), so no semaphore is reported leaked.
    from multiprocessing import util

    util._exit_function()
    os._exit(0)


class DistPool:
    def __init__(self, world: int, backend: str = "gloo"):
        import torch.distributed as dist

        self.backend = backend
        self._store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=_TIMEOUT)
        self._groups = itertools.count()
        self._start(world)

    @property
    def world(self) -> int:
        """The processes the pool holds (the largest world size it can run)."""
        return len(self.procs)

    def _start(self, world: int):
        # NCCL workers start from a fresh interpreter: a forkserver that has imported torch may
        # have initialised CUDA, and a process forked from it cannot use CUDA
        self._ctx = start_forkserver() if self.backend == "gloo" else mp.get_context("spawn")
        self._stopping = False
        self._group: tuple[int, str] | None = None  # (world, prefix) of the last case's group
        self.results = self._ctx.Queue()
        self.jobs, self.procs = [], []
        self._grow(world)

    def _grow(self, world: int):
        for rank in range(len(self.procs), world):
            jobs = self._ctx.Queue()
            proc = self._ctx.Process(target=_worker, args=(rank, self._store.port, self.backend, jobs, self.results),
                                     daemon=True)
            proc.start()
            self.jobs.append(jobs)
            self.procs.append(proc)

    def run(self, fn, *args, world: int | None = None, timeout: float = 120.0):
        world = self.world if world is None else world
        if world < 1:
            raise ValueError(f"world must be >= 1; got {world}")
        self._grow(world)
        if self._group is None or self._group[0] != world:  # Note [One pool for every world size]
            self._group = (world, f"group{next(self._groups)}/")
        for q in self.jobs[:world]:
            q.put((world, self._group[1], fn, args))
        out: dict[int, object] = {}
        errors = []
        try:
            for _ in range(world):
                rank, ok, val = self.results.get(timeout=timeout)
                if ok:
                    out[rank] = val
                else:
                    errors.append(f"rank {rank}:\n{val}")
        except queue.Empty:
            self._restart()
            raise TimeoutError(f"distributed case {fn.__name__} did not finish in {timeout}s on {world} ranks")
        if errors:
            # Ranks may be left mid-collective; rebuild the pool so later cases start clean.
            self._restart()
            raise RuntimeError("\n".join(errors))
        return [out[r] for r in range(world)]

    def _restart(self):
        world = self.world
        self.close(force=True)
        self._start(world)

    def stop(self):
        """Ask every rank to leave (they end together after the group's teardown)."""
        if not self._stopping:
            self._stopping = True
            for q in self.jobs:
                q.put(None)

    def close(self, force: bool = False):
        if not force:
            self.stop()
            for p in self.procs:
                p.join(timeout=10)
        for p in self.procs:
            if p.is_alive():
                p.kill()
