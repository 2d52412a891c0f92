"""Run a function on every rank: under torchrun in this process, else on self-spawned gloo
processes. For examples and quick experiments (production jobs use torchrun).

`launch(fn, world, *args, **kwargs)` calls fn(rank, world, *args, **kwargs) with a process group initialised
(NCCL on the rank's GPU under torchrun when CUDA is there, gloo otherwise) and returns every
rank's result, in rank order (under torchrun, gathered to every rank). fn must be a module-level
function (spawned processes import it). `reports()`: whether this process prints a summary
(rank 0 under torchrun, the launching process otherwise), so that one summary is printed.
"""

from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def exit_worker(results=None) -> None:
    """End a CPU (gloo) worker whose work is done and whose results are sent (Note [Ending a
    gloo process]): wait for every rank, leave the process group, flush, and exit without
    interpreter finalization. `results`: a multiprocessing.Queue this worker put into
    (flushed first; a SimpleQueue needs nothing)."""
    import sys

    dist.barrier()  # every rank is done: no collective of this group is in flight anywhere
    dist.destroy_process_group()
    if hasattr(results, "join_thread"):
        results.close()
        results.join_thread()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# Note [Ending a gloo process]
# gloo runs collectives on its own worker threads, and a worker drops its reference to a
# finished work (and so to the work's tensors) some time after the caller's wait() returned.
# When that is the last reference to a tensor made in Python, releasing it takes the GIL. If
# the interpreter is finalizing by then, the thread is ended inside C++ and the process
# aborts ("terminate called without an active exception", SIGABRT) after all its work is done.
# destroy_process_group() would join those threads first, but torch keeps the group alive past
# it once torch._dynamo is imported (every torch.compile user), so the threads outlive it (ringcc
# itself holds groups only weakly: runtime/ops.py _SETUPS). A loaded machine delays a worker
# long enough (1 run in 653 of the compiled-model benchmark's test). So a finished gloo worker
# ends in one order: barrier, destroy_process_group, flush, os._exit(0): no finalization runs
# beside the backend's threads.


def thread_lock_for_tqdm() -> None:
    """Give tqdm a thread lock in a spawned worker. Its default is a multiprocessing lock, a
    semaphore that a worker leaving through os._exit (exit_worker) never releases: Python's
    resource tracker then warns about leaked semaphores at shutdown. Libraries create bars
    (transformers' weight loading), so every worker sets this before its work."""
    import threading

    try:
        from tqdm import tqdm
    except ImportError:
        return
    tqdm.set_lock(threading.RLock())


def _spawned(rank: int, world: int, port: int, fn, args: tuple, kwargs: dict, results) -> None:
    thread_lock_for_tqdm()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        out = fn(rank, world, *args, **kwargs)
    except BaseException:
        dist.destroy_process_group()
        raise
    results.put((rank, out))
    exit_worker(results)


def reports() -> bool:
    """Whether this process prints the summary: rank 0 under torchrun, else the launcher."""
    return os.environ.get("RANK", "0") == "0"


def launch(fn, world: int, *args, **kwargs) -> list:
    if "RANK" in os.environ:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend)
        try:
            out = fn(dist.get_rank(), dist.get_world_size(), *args, **kwargs)
            every = [None] * dist.get_world_size()
            dist.all_gather_object(every, out)
            return every
        finally:
            dist.destroy_process_group()
    if world < 1:
        raise ValueError(f"world size must be >= 1; got {world}")
    if world == 1:
        return [fn(0, 1, *args, **kwargs)]
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    mp.start_processes(_spawned, args=(world, _free_port(), fn, args, kwargs, results), nprocs=world, start_method="spawn")
    return [r for _, r in sorted((results.get() for _ in range(world)), key=lambda x: x[0])]
