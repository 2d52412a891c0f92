"""Process-group start and finish shared by the torchrun benchmarks that compare ranks
(bench_planner_gpu.py, bench_masked.py, bench_model_masked.py): NCCL on CUDA (bf16), gloo on CPU or in smoke mode
(fp32); rank 0 writes the JSON record."""

from __future__ import annotations

import datetime
import json
import os

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


def finish(info: dict | None, path: str) -> None:
    """Rank 0 passes `info` (with "device" and "torch"): written to `path` as JSON; then every
    rank leaves the group."""
    if info is not None:
        with open(path, "w") as f:
            json.dump(info, f, indent=2)
        print(f"wrote {path} ({info['device']}, torch {info['torch']})")
    dist.barrier()
    dist.destroy_process_group()
