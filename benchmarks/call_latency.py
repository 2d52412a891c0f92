"""Where the host's time goes between a ring_attention call and its first attention kernel:
the host µs from the call to the first call of each runtime site, median over calls issued
behind a GPU spin (so the host never waits for the GPU), every rank at once.

    torchrun --nproc-per-node 2 benchmarks/call_latency.py --json latency.json

Forward only (no grad), causal zigzag, [1, heads, n_local, head_dim] bf16 per rank; the
transfers follow RINGCC_RING_TRANSPORT / RINGCC_SKIP_COMM. Rank 0 prints a table (one column
per rank) and writes JSON with the device named. The wrappers add about a µs per site.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

# (module, attribute) of the sites, in the order a call reaches them; an attribute a tree
# lacks (older code) is skipped. Imported names are patched where the caller looks them up.
SITES = (("ringcc.runtime.ops", "_check_inputs"), ("ringcc.runtime.ops", "_group_args"),
         ("ringcc.runtime.ops", "_check_same_call"), ("ringcc.runtime.ops", "ring_attention_op"),
         ("ringcc.runtime.ops", "_setup"), ("ringcc.runtime.ops", "_group_from"),
         ("ringcc.runtime.workspace", "ring_kv_chunk"), ("ringcc.runtime.ops", "ring_forward"),
         ("ringcc.runtime.ring", "head_chunks"), ("ringcc.runtime.ring", "_ring_forward_chunk"),
         ("ringcc.runtime.ring", "ring_comm"), ("ringcc.runtime.ring", "_ring_steps"),
         ("ringcc.runtime.comm", "CopyEngineRing.send_recv"), ("ringcc.runtime.comm", "_mailbox"),
         ("ringcc.runtime.comm", "CopyEngineRing.commit"), ("ringcc.runtime.ring", "RingSetup.masked_calls"),
         ("ringcc.runtime.kernels", "block_fwd"), ("ringcc._compat", "cuda_cudnn_fwd"))


def patch_sites(first: dict) -> None:
    """Wrap every site so that its first call in a step writes perf_counter into `first`."""
    import importlib

    for mod, attr in SITES:
        owner = importlib.import_module(mod)
        *path, name = attr.split(".")
        for part in path:
            owner = getattr(owner, part)
        func = owner.__dict__.get(name)
        if func is None:
            continue

        def timed(*a, _f=func, _name=attr, **kw):
            first.setdefault(_name, time.perf_counter())
            return _f(*a, **kw)

        setattr(owner, name, timed)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n-local", type=int, default=16384)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--calls", type=int, default=60)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available() or "LOCAL_RANK" not in os.environ:
        raise SystemExit("needs CUDA and torchrun (one process per GPU)")
    rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    import ringcc
    from ringcc import _compat

    shape = (1, args.heads, args.n_local, args.head_dim)
    q, k, v = (torch.randn(shape, device="cuda").bfloat16() for _ in range(3))
    first: dict = {}
    patch_sites(first)
    samples = collections.defaultdict(list)
    with torch.no_grad():
        for _ in range(5):  # warm-up: transport, kernels' plans, caches
            ringcc.ring_attention(q, k, v, is_causal=True, layout="zigzag")
        torch.cuda.synchronize()
        for _ in range(args.calls):
            dist.barrier()
            torch.cuda.synchronize()
            _compat.cuda_spin(int(2e7))  # about 10 ms of GPU work ahead of the call
            first.clear()
            t0 = time.perf_counter()
            ringcc.ring_attention(q, k, v, is_causal=True, layout="zigzag")
            t1 = time.perf_counter()
            for name, t in first.items():
                samples[name].append(1e6 * (t - t0))
            samples["(the call returns)"].append(1e6 * (t1 - t0))
            torch.cuda.synchronize()
    mine = {name: statistics.median(x) for name, x in samples.items()}
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    if rank == 0:
        dev = torch.cuda.get_device_name()
        print(f"device: {dev} x{len(every)}; torch {torch.__version__}; {list(shape)} bf16 causal zigzag forward; "
              f"RINGCC_SKIP_COMM={os.environ.get('RINGCC_SKIP_COMM', '0')}; host µs from the call to each site's "
              f"first call, median of {args.calls}")
        print(f"  {'site':<28}" + "".join(f" {'rank ' + str(r):>8}" for r in range(len(every))))
        for name in sorted(mine, key=mine.get):
            print(f"  {name:<28}" + "".join(f" {e.get(name, float('nan')):>8.1f}" for e in every))
        if args.json:
            Path(args.json).write_text(json.dumps({"device": dev, "torch": torch.__version__, "shape": list(shape),
                                                   "skip_comm": os.environ.get("RINGCC_SKIP_COMM", "0"),
                                                   "us_per_rank": every}, indent=1))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
