"""Activation checkpointing under ringcc: peak memory and step time per Config.checkpoints mode.

An unmodified L-layer causal transformer whose every layer runs under
torch.utils.checkpoint.checkpoint(..., use_reentrant=False), bf16, compiled with
torch.compile(backend="ringcc") at the launched p. Modes (Note [Checkpoint regions] in
passes/inline_checkpoints.py):
  recompute  the regions are rewritten, then checkpointed again: the backward recomputes each
             layer, ring attention included (the default);
  inline     the regions are rewritten and stay inlined: every layer's activations are kept.
Per cell: the training step's median time (slowest rank), the peak memory per rank
(max_memory_allocated over the timed steps, after a reset; GPU only) and the memory plan's
peak for the compiled graph (ringcc's report; parameters and their gradients included).

    torchrun --nproc-per-node 4 benchmarks/bench_checkpoint.py --json checkpoint.json
    torchrun --nproc-per-node 2 benchmarks/bench_checkpoint.py --smoke          # CPU / gloo, tiny
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.utils.checkpoint

import dist_setup
import ringcc
from bench_model_masked import Layer

MODES = ("recompute", "inline")


class Model(nn.Module):
    def __init__(self, d: int, h: int, layers: int):
        super().__init__()
        self.layers = nn.ModuleList([Layer(d, h) for _ in range(layers)])

    def forward(self, x):
        for layer in self.layers:  # causal attention (no mask) and an MLP
            x = torch.utils.checkpoint.checkpoint(layer, x, None, use_reentrant=False)
        return x.float().pow(2).mean()


def cell(mode: str, n_local: int, args, device, dtype) -> dict:
    world = dist.get_world_size()
    n = n_local * world
    torch.manual_seed(0)
    model = Model(args.heads * args.head_dim, args.heads, args.layers).to(device, dtype)
    ringcc.reset_reports()
    compiled = torch.compile(model, backend=ringcc.backend(ringcc.Config(inner=args.inner, checkpoints=mode)))
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(1, n, args.heads * args.head_dim, generator=gen).to(device, dtype).requires_grad_()

    def step():
        compiled(x).backward()

    t0 = time.perf_counter()
    for _ in range(args.warmup):
        step()
    warm_s = time.perf_counter() - t0
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times = [dist_setup.timed(step, device) for _ in range(args.reps)]
    peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else None
    report = ringcc.last_report()
    plan = report.plan if report is not None else None
    planned = plan.peak_bytes() if plan is not None else None
    regions = sum(1 for note in (report.notes if report else ()) if "checkpointed again" in note)
    every = [None] * world
    dist.all_gather_object(every, (statistics.median(times), peak))
    torch._dynamo.reset()
    peaks = [e[1] for e in every]
    return dict(mode=mode, n_local=n_local, n=n, p=world, layers=args.layers, ms=max(e[0] for e in every),
                ms_per_rank=[e[0] for e in every], peak_bytes=max(peaks) if peaks[0] is not None else None,
                peak_bytes_per_rank=peaks, planned_peak_bytes=planned, regions_restored_note=bool(regions),
                warmup_s=warm_s)


def _gib(b) -> str:
    return "-" if b is None else f"{b / 2**30:.2f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    dist_setup.model_arguments(ap, lengths=[8192, 32768], layers=8, reps=5)
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    args = ap.parse_args()
    if args.smoke:
        args.lengths, args.layers, args.heads, args.head_dim, args.reps, args.warmup = [64], 2, 2, 8, 2, 1
    device, dtype = dist_setup.start(args.smoke)
    rows = []
    for n_local in args.lengths:
        for mode in args.modes:
            rows.append(cell(mode, n_local, args, device, dtype))
            if dist.get_rank() == 0:
                r = rows[-1]
                print(f"{mode:10s} n_local={n_local:6d}: {r['ms']:9.2f} ms, peak {_gib(r['peak_bytes'])} GiB, "
                      f"planned {_gib(r['planned_peak_bytes'])} GiB", flush=True)
    info = None
    if dist.get_rank() == 0:
        name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu (smoke, gloo)"
        info = dict(device=name, torch=torch.__version__, inner=args.inner, rows=rows)
        print(f"\n{args.layers}-layer causal transformer, every layer under torch.utils.checkpoint, h={args.heads}, "
              f"d={args.head_dim}, p={dist.get_world_size()}, {dtype}, inner={args.inner}, {name}")
        print(f"{'mode':10s} {'tokens/GPU':>10s} {'step ms':>9s} {'peak GiB':>9s} {'plan GiB':>9s} {'plan/peak':>9s}")
        for r in rows:
            ratio = (f"{r['planned_peak_bytes'] / r['peak_bytes']:9.3f}"
                     if r["peak_bytes"] and r["planned_peak_bytes"] else f"{'-':>9s}")
            print(f"{r['mode']:10s} {r['n_local']:10d} {r['ms']:9.2f} {_gib(r['peak_bytes']):>9s} "
                  f"{_gib(r['planned_peak_bytes']):>9s} {ratio}")
    dist_setup.finish(info, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
