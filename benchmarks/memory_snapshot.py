"""What is alive at the allocator's peak: one training step of a planner-bench model, with
the CUDA allocator's history recorded; prints the live blocks at the peak (largest first)
with the innermost ringcc/benchmark frame of each.

    torchrun --nproc-per-node P benchmarks/memory_snapshot.py --model attention --seq-len 65536
    torchrun --nproc-per-node 2 benchmarks/memory_snapshot.py --model masked --seq-len 16384 --plan

Used to check the memory planner's formulas (runtime/workspace.py, ringcc/planner.py)
against what the allocator really holds; `--plan` also prints the plan (its nodes, their
workspace, its peak point) and its step bytes as bench_planner_gpu.py counts them. CUDA only.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_planner_gpu as B  # noqa: E402

import ringcc  # noqa: E402
from ringcc import _compat  # noqa: E402
from ringcc.config import Config  # noqa: E402

MiB = 2**20


def _ours(frame) -> bool:
    return any(k in frame["filename"] for k in ("ringcc", "runtime/", "passes/", "benchmarks/"))


def frame_of(block_frames) -> str:
    keep = [f for f in block_frames if _ours(f)]
    if not keep:
        keep = [f for f in block_frames if "torch/" in f["filename"] and "autograd" in f["filename"]] or block_frames[:1]
    f = keep[0] if keep else {"filename": "?", "line": 0, "name": "?"}
    return f"{os.path.basename(f['filename'])}:{f['line']} {f['name']}"


def peak_report(snapshot, top: int) -> list[str]:
    trace = snapshot["device_traces"][torch.cuda.current_device()]
    live: dict[int, tuple[int, str]] = {}
    cur = best = 0
    best_live: dict = {}
    best_frames: list = []
    for ev in trace:
        act = ev["action"]
        if act == "alloc":
            live[ev["addr"]] = (ev["size"], frame_of(ev.get("frames", [])))
            cur += ev["size"]
            if cur > best:
                best, best_live, best_frames = cur, dict(live), ev.get("frames", [])
        elif act in ("free_requested",) and ev["addr"] in live:
            cur -= live.pop(ev["addr"])[0]
    rows = sorted(best_live.values(), key=lambda x: -x[0])
    agg: dict[str, list[int]] = {}
    for size, where in rows:
        agg.setdefault(where, []).append(size)
    out = [f"peak of the recorded step (allocs minus requested frees): {best / MiB:.1f} MiB in {len(rows)} blocks"]
    for where, sizes in sorted(agg.items(), key=lambda kv: -sum(kv[1]))[:top]:
        out.append(f"  {sum(sizes) / MiB:9.1f} MiB  x{len(sizes):<3} {where}")
    chain = [f"{os.path.basename(f['filename'])}:{f['line']} {f['name']}" for f in best_frames if _ours(f)]
    out.append("the allocation that reached the peak, innermost first: " + (" <- ".join(chain[:8]) or "?"))
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="attention", choices=["attention", "llama", "masked"])
    ap.add_argument("--seq-len", dest="n", type=int, default=65536)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--plan", action="store_true", help="print the memory plan next to the allocator's peak")
    args = ap.parse_args()
    dist.init_process_group("nccl", timeout=datetime.timedelta(minutes=5))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    m, inputs = B.make(args.model, args.n, torch.device("cuda"), torch.bfloat16, False)
    ringcc.reset_reports()
    compiled = torch.compile(m, backend=ringcc.backend(Config(inner="eager", world_size=world)), dynamic=False)
    compiled(*inputs).backward()
    plans = [r.plan for r in ringcc.reports() if r.plan is not None]
    if args.plan and not plans:  # on every rank, before any collective of the report
        raise RuntimeError("the ringcc backend stored no memory plan: " + "; ".join(
            note for r in ringcc.reports() for note in r.notes))
    m.zero_grad(set_to_none=False)
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    _compat.record_cuda_memory_history(True)
    compiled(*inputs).backward()
    torch.cuda.synchronize()
    snap = _compat.cuda_memory_snapshot()
    _compat.record_cuda_memory_history(False)
    step = torch.cuda.max_memory_allocated() - before
    lines = [f"{args.model} n={args.n} p={world} rank {rank}: max_memory_allocated - before = {step / MiB:.1f} MiB"]
    if args.plan and rank == 0:
        lines += [f"planned step bytes (bench_planner_gpu.step_bytes): {max(B.step_bytes(pl) for pl in plans) / MiB:.1f} MiB"]
        lines += [pl.format() for pl in plans]
    lines += peak_report(snap, args.top)
    reports = [None] * world  # every rank's: ranks hold different blocks (masks, zigzag)
    dist.all_gather_object(reports, lines)
    if rank == 0:
        print("\n\n".join("\n".join(r) for r in reports), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
