"""A pool of real gloo (or NCCL) processes that tests send functions to.

Spawning p processes and initialising a process group costs seconds; a pool per world size
lives for the whole test session, so each parametrised case costs only its own work.
`pool.run(fn, *args)` runs fn(rank, world, *args) on every rank (fn must be importable at
module level) and returns the per-rank results; an exception on any rank is re-raised here
with that rank's traceback. A case that hangs fails after `timeout` seconds and the pool is
rebuilt.
"""

from __future__ import annotations

import os
import queue
import socket
import traceback

import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, backend, jobs, results):
    import datetime

    import torch
    import torch.distributed as dist

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(
        backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )
    while True:
        job = jobs.get()
        if job is None:
            break
        fn, args = job
        try:
            results.put((rank, True, fn(rank, world, *args)))
        except BaseException:  # noqa: BLE001 - reported to the parent with its traceback
            results.put((rank, False, traceback.format_exc()))
    dist.destroy_process_group()
    # The parent has read every result; an interpreter shutdown with torch loaded takes seconds
    # per process, and gloo threads may outlive it (Note [Ending a gloo process]). The queues'
    # finalizers still run (multiprocessing's own exit step), so no semaphore is reported leaked.
    from multiprocessing import util

    util._exit_function()
    os._exit(0)


class DistPool:
    def __init__(self, world: int, backend: str = "gloo"):
        self.world, self.backend = world, backend
        self._start()

    def _start(self):
        ctx = mp.get_context("spawn")
        port = _free_port()
        self._stopping = False
        self.jobs = [ctx.Queue() for _ in range(self.world)]
        self.results = ctx.Queue()
        self.procs = [
            ctx.Process(target=_worker, args=(r, self.world, port, self.backend, self.jobs[r], self.results), daemon=True)
            for r in range(self.world)
        ]
        for p in self.procs:
            p.start()

    def run(self, fn, *args, timeout: float = 120.0):
        for q in self.jobs:
            q.put((fn, args))
        out: dict[int, object] = {}
        errors = []
        try:
            for _ in range(self.world):
                rank, ok, val = self.results.get(timeout=timeout)
                if ok:
                    out[rank] = val
                else:
                    errors.append(f"rank {rank}:\n{val}")
        except queue.Empty:
            self.close(force=True)
            self._start()
            raise TimeoutError(f"distributed case {fn.__name__} did not finish in {timeout}s on {self.world} ranks")
        if errors:
            # Ranks may be left mid-collective; rebuild the group so later cases start clean.
            self.close(force=True)
            self._start()
            raise RuntimeError("\n".join(errors))
        return [out[r] for r in range(self.world)]

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
