"""The ring's host time: how long the host takes to issue one ring attention fwd+bwd, against
the GPU's time for it, and where the host's time goes, by function.

At a few thousand tokens per GPU the host, not the GPU, bounds a ring layer that runs without
CUDA graphs (RESULTS.md, "Short chunks"). Per rank this prints:
- GPU ms: one fwd+bwd, back to back (CUDA events over --reps iterations);
- host ms: one fwd+bwd issued while the GPU is kept busy far ahead (a spin kernel on every rank
  first), so the host never waits for the GPU; host ms >= GPU ms means the host bounds the layer;
- the wall time the host spends inside each of the ring's functions (wrapped for the timed
  iterations only), per fwd+bwd, with its calls per fwd+bwd.

    RINGCC_RING_GRAPHS=off torchrun --nproc-per-node 4 benchmarks/bench_ring_host.py --tokens-per-gpu 8192 \
        --json ring_host.json
    torchrun --nproc-per-node 2 benchmarks/bench_ring_host.py --smoke      # CPU / gloo, tiny

One ring_attention call (bf16 on GPU, fp32 on CPU), MHA, d = 128 (16 in smoke mode), b = 1, zigzag
layout; --full for non-causal. On CPU the host waits for every kernel, so host ms is wall time.
"""

from __future__ import annotations

import argparse
import collections
import functools
import os
import time

import torch
import torch.distributed as dist

import dist_setup
from ringcc import _compat
from ringcc.runtime import comm, fused, kernels, ops, ring
from ringcc.runtime.ops import ring_attention

# (module or class, attribute, label): what the breakdown times
WRAPPED = [
    (ops, "ring_forward", "ring forward"),
    (ops, "ring_backward", "ring backward"),
    (ops, "_setup", "ops._setup"),
    (kernels, "block_fwd", "kernels.block_fwd"),
    (kernels, "block_bwd", "kernels.block_bwd"),
    (kernels._compat, "cuda_cudnn_fwd", "cuDNN forward op"),
    (kernels._compat, "cuda_cudnn_bwd", "cuDNN backward op"),
    (kernels, "bwd_lse", "kernels.bwd_lse"),
    (ring, "_merge_block", "ring._merge_block"),
    (ring, "_accumulate", "ring._accumulate"),
    (ring, "ring_comm", "comm.ring_comm"),
    (ring.RingSetup, "masked_calls", "RingSetup.masked_calls"),
    (fused, "add", "fused.add (Triton launch)"),
    (fused, "merge", "fused.merge (Triton launch)"),
    *[(cls, m, f"{cls.__name__}.{m}") for cls in (comm.CopyEngineRing, comm.RingComm)
      for m in ("send_recv", "commit", "wait")],
]


class Breakdown:
    """Wall time per wrapped function while `on`."""

    def __init__(self):
        self.on = False
        self.seconds = collections.defaultdict(float)
        self.calls = collections.Counter()

    def wrap(self, owner, name: str, label: str) -> None:
        f = getattr(owner, name)

        @functools.wraps(f)
        def timed(*args, **kwargs):
            if not self.on:
                return f(*args, **kwargs)
            t = time.perf_counter()
            try:
                return f(*args, **kwargs)
            finally:
                self.seconds[label] += time.perf_counter() - t
                self.calls[label] += 1

        setattr(owner, name, timed)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens-per-gpu", type=int, default=8192)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--full", action="store_true", help="non-causal (default: causal)")
    ap.add_argument("--reps", type=int, default=10, help="iterations of the GPU timing")
    ap.add_argument("--host-reps", type=int, default=3,
                    help="iterations of the host timing (few: the GPU's launch queue must not fill)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes on CPU / gloo")
    args = ap.parse_args()
    device, dtype = dist_setup.start(args.smoke)
    n, h, d = (64, 2, 16) if args.smoke else (args.tokens_per_gpu, args.heads, 128)
    causal = not args.full
    rank, world = dist.get_rank(), dist.get_world_size()
    br = Breakdown()
    for owner, name, label in WRAPPED:
        br.wrap(owner, name, label)
    gen = torch.Generator(device=device).manual_seed(rank)
    q, k, v = (torch.randn(1, h, n, d, device=device, dtype=dtype, generator=gen).requires_grad_() for _ in range(3))
    dout = torch.randn(1, h, n, d, device=device, dtype=dtype, generator=gen)

    def step():
        ring_attention(q, k, v, is_causal=causal, layout="zigzag").backward(dout)

    for _ in range(3):
        step()
    gpu_ms = dist_setup.timed(lambda: [step() for _ in range(args.reps)], device) / args.reps
    dist.barrier()
    if device.type == "cuda":
        torch.cuda.synchronize()
        _compat.cuda_spin(2e9 * 0.3)  # about 0.3 s of GPU work queued first: the host runs ahead
    br.on = True
    t = time.perf_counter()
    for _ in range(args.host_reps):
        step()
    host_ms = (time.perf_counter() - t) / args.host_reps * 1e3
    br.on = False
    if device.type == "cuda":
        torch.cuda.synchronize()
    per = {label: (br.seconds[label] / args.host_reps * 1e3, br.calls[label] / args.host_reps)
           for label in sorted(br.seconds, key=lambda x: -br.seconds[x])}
    mine = {"rank": rank, "gpu_ms": gpu_ms, "host_ms": host_ms, "functions": per}
    got = [None] * world
    dist.all_gather_object(got, mine)
    info = None
    if rank == 0:
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (smoke, gloo)"
        graphs = os.environ.get("RINGCC_RING_GRAPHS", "auto")
        print(f"ring fwd+bwd: {n} tokens per GPU, h={h}, d={d}, {'causal' if causal else 'non-causal'}, "
              f"p={world}, {dtype}, {name}, torch {torch.__version__}, RINGCC_RING_GRAPHS={graphs}")
        for rec in got:
            print(f"rank {rec['rank']}: {'GPU' if device.type == 'cuda' else 'wall'} {rec['gpu_ms']:.2f} ms back "
                  f"to back, host {rec['host_ms']:.2f} ms per fwd+bwd")
            for label, (ms, calls) in rec["functions"].items():
                print(f"  {label:34s} {ms:8.3f} ms {calls:6.1f} calls")
        info = {"device": name, "torch": torch.__version__, "world": world, "tokens_per_gpu": n, "heads": h,
                "head_dim": d, "causal": causal, "dtype": str(dtype), "graphs_setting": graphs, "ranks": got}
    dist_setup.finish(info, args.json)


if __name__ == "__main__":
    main()
