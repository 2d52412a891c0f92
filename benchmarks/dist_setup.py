"""Process-group start and finish shared by the torchrun benchmarks that compare ranks
(bench_planner_gpu.py, bench_masked.py, bench_model_masked.py, bench_checkpoint.py): NCCL on
CUDA (bf16), gloo on CPU or in smoke mode (fp32); rank 0 writes the JSON record; one timed
step."""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import time

import torch
import torch.distributed as dist


def start(smoke: bool) -> tuple[torch.device, torch.dtype]:
    """Join the process group torchrun set up; (this rank's device, the benchmark's dtype)."""
    use_cuda = torch.cuda.is_available() and not smoke
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off on these machines
    dist.init_process_group("nccl" if use_cuda else "gloo", timeout=datetime.timedelta(minutes=10))
    if not use_cuda:
        return torch.device("cpu"), torch.float32
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", dist.get_rank())))
    return torch.device("cuda", torch.cuda.current_device()), torch.bfloat16


def model_arguments(ap, lengths: list[int], layers: int, reps: int) -> None:
    """The options of the compiled-model benchmarks (bench_model_masked.py, bench_checkpoint.py)."""
    ap.add_argument("--lengths", type=int, nargs="+", default=lengths, help="tokens per GPU")
    ap.add_argument("--layers", type=int, default=layers)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--inner", default="aot_eager", help="the compiler after ringcc's passes")
    ap.add_argument("--reps", type=int, default=reps)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--json", default=None)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes on CPU / gloo")


def timed(step, device: torch.device, barrier: bool = True) -> float:
    """Milliseconds of one call of step(), after a barrier (unless barrier=False): CUDA events on
    GPU, wall time on CPU."""
    if barrier:
        dist.barrier()
    if device.type != "cuda":
        t = time.perf_counter()
        step()
        return (time.perf_counter() - t) * 1e3
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    step()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end)


def finish(info: dict | None, path: str | None) -> None:
    """Rank 0 passes `info` (with "device" and "torch"): written to `path` (None: no record)
    as JSON; then every rank leaves the group. On gloo the process ends here
    (ringcc.launch.exit_worker, Note [Ending a gloo process])."""
    if info is not None and path:
        with open(path, "w") as f:
            json.dump(info, f, indent=2)
        print(f"wrote {path} ({info['device']}, torch {info['torch']})")
    if dist.get_backend() == "gloo":
        from ringcc.launch import exit_worker

        exit_worker()
    dist.barrier()
    dist.destroy_process_group()


@contextlib.contextmanager
def env_var(name: str, value: str):
    """os.environ[name] = value inside the block, restored (or removed) after it."""
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old
