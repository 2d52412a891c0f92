"""A compiled model's training step: with and without a key padding mask, the key-runs
all-gathers, and where the gradient all-reduce waits.

An unmodified L-layer causal transformer (SDPA with `causal & ~pad[:, None, None, :]`, the
form HF-style models build) under torch.compile(backend="ringcc"), bf16, at the launched p.
Every layer's attention reads the same padding mask. The ring decides per step which ranks'
valid keys are one run (ringcc::key_runs: an all-gather of two ints per rank and a host sync,
Note [Key runs per mask] in runtime/ring.py). The table counts those all-gathers per step
(every all_gather of a 2-element int64 tensor), so the same script measures trees that
all-gather per layer.

    torchrun --nproc-per-node 4 benchmarks/bench_model_masked.py --json model_masked.json
    torchrun --nproc-per-node 2 benchmarks/bench_model_masked.py --smoke          # CPU / gloo, tiny

Every rank holds the parameters whole, so ringcc all-reduces their gradients over the ranks in
buckets (Config.bucket_mb) during the backward. `--grad-waits last` (ringcc's placement) waits
for each bucket just before the backward's end, so the rest of the backward runs while it
travels; `at-once` waits right after each bucket's start, as a synchronous all-reduce does
(Note [Overlapped gradient all-reduce] in runtime/seqops.py). Both in one run compare the two.

    torchrun --nproc-per-node 2 benchmarks/bench_model_masked.py --inner inductor --layers 8 \
        --lengths 8192 --cases unmasked --grad-waits last at-once

Each cell: --warmup steps (the first compiles), then the median of --reps forward+backward
steps (CUDA events on GPU, after a barrier), slowest rank. `--trace-dir DIR` then profiles one
more step: where its GPU time goes by kernel family, and the compute's idle gaps (timeline.py).
`--one-gpu` then runs each case on rank 0's device alone at the whole length (ringcc over a group
of one rank, as `--nproc-per-node 1` would) while the other ranks wait: the speed-up over one
device from one job on one machine.
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import dist_setup
import ringcc
import timeline

CASES = ("unmasked", "key padding")
GRAD_WAITS = ("last", "at-once")


def _waits_at_once(graph: torch.fx.Graph) -> None:
    """Each gradient all-reduce's wait right after its start: the order a synchronous
    all-reduce keeps, in place of ringcc.backend._grad_waits_last."""
    wait = torch.ops.ringcc.grad_all_reduce_wait.default
    for node in list(graph.nodes):
        if node.target is wait:
            node.args[0].append(node)  # args[0]: the start's token


BACKEND = importlib.import_module("ringcc.backend")  # the module (ringcc.backend is its function)
PLACEMENTS = {"last": BACKEND._grad_waits_last, "at-once": _waits_at_once}


class Layer(nn.Module):
    def __init__(self, d: int, h: int):
        super().__init__()
        self.h = h
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x, mask):
        b, n, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (t.view(b, n, self.h, d // self.h).transpose(1, 2) for t in (q, k, v))
        if mask is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = x + self.proj(y.transpose(1, 2).reshape(b, n, d))
        return x + self.mlp(self.ln2(x))


class Model(nn.Module):
    def __init__(self, d: int, h: int, layers: int):
        super().__init__()
        self.layers = nn.ModuleList([Layer(d, h) for _ in range(layers)])

    def forward(self, x, pad):
        n = x.shape[1]
        mask = None
        if pad is not None:
            causal = torch.arange(n, device=x.device)[None, :] <= torch.arange(n, device=x.device)[:, None]
            mask = causal & ~pad[:, None, None, :]
        for layer in self.layers:
            x = layer(x, mask)
        return x.float().pow(2).mean()


def _count_key_run_gathers():
    """Wraps dist.all_gather; returns the counter of 2-element int64 all-gathers."""
    count = [0]
    original = dist.all_gather

    def counted(tensor_list, tensor, *args, **kwargs):
        if tensor.dtype == torch.int64 and tensor.numel() == 2:
            count[0] += 1
        return original(tensor_list, tensor, *args, **kwargs)

    dist.all_gather = counted
    return count


def training_step(case: str, n: int, args, device, dtype, group=None):
    """One forward+backward of the model at n tokens, compiled with ringcc over `group` (None:
    WORLD), with the case's padding mask."""
    torch.manual_seed(0)
    model = Model(args.heads * args.head_dim, args.heads, args.layers).to(device, dtype)
    compiled = torch.compile(model, backend=ringcc.backend(ringcc.Config(inner=args.inner, group=group)))
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(1, n, args.heads * args.head_dim, generator=gen).to(device, dtype)
    pad = None
    if case == "key padding":
        pad = torch.zeros(1, n, dtype=torch.bool, device=device)
        pad[:, n - n // 8:] = True  # the sequence's last eighth

    def step():
        compiled(x, pad).backward()

    return step


def cell(case: str, n_local: int, waits: str, args, device, dtype, gathers) -> dict:
    world = dist.get_world_size()
    BACKEND._grad_waits_last = PLACEMENTS[waits]
    n = n_local * world
    step = training_step(case, n, args, device, dtype)
    t0 = time.perf_counter()
    for _ in range(args.warmup):
        step()
    warm_s = time.perf_counter() - t0
    times, counts = [], []
    for _ in range(args.reps):
        before = gathers[0]
        times.append(dist_setup.timed(step, device))
        counts.append(gathers[0] - before)
    ms = statistics.median(times)
    timeline_text = None
    if args.trace_dir and device.type == "cuda":
        trace = f"{args.trace_dir}/model_{case.replace(' ', '_')}_{waits}_{n_local}_p{world}.json.gz"
        timeline_text = timeline.profile_step(step, dist.barrier, trace, rank0=dist.get_rank() == 0)
        if dist.get_rank() == 0:
            print(f"profile of one step ({case}, {n_local} tokens per GPU, rank 0):\n{timeline_text}", flush=True)
    every = [None] * world
    dist.all_gather_object(every, (ms, counts))
    torch._dynamo.reset()
    return dict(case=case, grad_waits=waits, n_local=n_local, n=n, p=world, layers=args.layers, ms=max(e[0] for e in every),
                ms_per_rank=[e[0] for e in every], key_run_gathers_per_step=statistics.median(counts),
                warmup_s=warm_s, profile=timeline_text)


def one_device(case: str, n_local: int, args, device, dtype, solo) -> dict | None:
    """Rank 0 alone runs the same model at the whole length (n_local * p tokens) on its device,
    compiled with ringcc over `solo` (a group of rank 0 only: p = 1), as `--nproc-per-node 1`
    would; the other ranks wait. Rank 0 returns the row (median of --reps steps after --warmup),
    the others None."""
    world = dist.get_world_size()
    row = None
    if dist.get_rank() == 0:
        n = n_local * world
        step = training_step(case, n, args, device, dtype, group=solo)
        for _ in range(args.warmup):
            step()
        ms = statistics.median(dist_setup.timed(step, device, barrier=False) for _ in range(args.reps))
        torch._dynamo.reset()
        row = dict(case=case, grad_waits="-", n_local=n, n=n, p=1, layers=args.layers, ms=ms, ms_per_rank=[ms],
                   key_run_gathers_per_step=0, one_device_of=world)
    dist.barrier()
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    dist_setup.model_arguments(ap, lengths=[4096, 16384], layers=4, reps=7)
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES)
    ap.add_argument("--grad-waits", nargs="+", default=["last"], choices=GRAD_WAITS,
                    help="where the gradient all-reduce waits: last (ringcc) and/or at-once (synchronous)")
    ap.add_argument("--label", default="", help="a name for this tree in the JSON")
    ap.add_argument("--one-gpu", action="store_true",
                    help="also run each case on rank 0's device alone at the whole length, in the same job (the "
                         "speed-up over one device, measured in one run)")
    ap.add_argument("--trace-dir", default=None, help="CUDA: after the timed steps profile one more: rank 0 prints "
                    "its top ops and timeline (timeline.py) and keeps the chrome trace here")
    args = ap.parse_args()
    if args.smoke:
        args.lengths, args.layers, args.heads, args.head_dim, args.reps, args.warmup = [16], 2, 2, 8, 2, 1
    device, dtype = dist_setup.start(args.smoke)
    gathers = _count_key_run_gathers()
    solo = dist.new_group([0]) if args.one_gpu else None  # (every rank makes the group)
    rows = []
    for n_local in args.lengths:
        for case in args.cases:
            for waits in args.grad_waits:
                rows.append(cell(case, n_local, waits, args, device, dtype, gathers))
                if dist.get_rank() == 0:
                    r = rows[-1]
                    print(f"{case:12s} waits {waits:8s} n_local={n_local:6d}: {r['ms']:9.2f} ms, "
                          f"{r['key_run_gathers_per_step']} key-run all-gathers per step", flush=True)
            if args.one_gpu:
                row = one_device(case, n_local, args, device, dtype, solo)
                if row is not None:
                    rows.append(row)
                    fastest = min(r["ms"] for r in rows if r["p"] > 1 and r["case"] == case and r["n_local"] == n_local)
                    row["speedup_of_best"] = row["ms"] / fastest
                    print(f"{case:12s} one device, {row['n']:6d} tokens: {row['ms']:9.2f} ms; speed-up "
                          f"{row['speedup_of_best']:.2f}x", flush=True)
    info = None
    if dist.get_rank() == 0:
        name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu (smoke, gloo)"
        info = dict(label=args.label, device=name, torch=torch.__version__, rows=rows)
        print(f"\n{args.label or 'this tree'}: {args.layers}-layer causal transformer, h={args.heads}, "
              f"d={args.head_dim}, p={dist.get_world_size()}, {dtype}, inner={args.inner}, {name}")
        print(f"{'case':12s} {'p':>2s} {'grad waits':>10s} {'tokens/GPU':>10s} {'step ms':>9s} {'gathers/step':>12s}")
        for r in rows:
            print(f"{r['case']:12s} {r['p']:2d} {r['grad_waits']:>10s} {r['n_local']:10d} {r['ms']:9.2f} "
                  f"{r['key_run_gathers_per_step']:12}")
    dist_setup.finish(info, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
