"""Ring transports side by side: one hop to rank+1, alone and beside an attention kernel.

    torchrun --nproc-per-node 4 benchmarks/bench_transport.py --out results/

For each transport (RINGCC_RING_TRANSPORT: copy-engine, nccl) and message size: the result is
checked (rank r receives rank r-1's values), then timed (CUDA events, median, slowest rank):
  hop ms          one batch alone (send_recv, commit, wait);
  kernel ms       one cuDNN attention forward (b=1, h=16, 16K x 16K, d=128, bf16) alone;
  both ms         the batch committed, then the kernel, then wait: the time the pair takes;
  hidden          (hop + kernel - both) / hop: the share of the hop the kernel hides (1 = all).
Prints a table, writes bench_transport.json (device named) to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist


def _time(fn, iters: int, device) -> float:
    """Median milliseconds (slowest rank per iteration), after 3 warm-ups."""
    from bench_attention import time_ms  # benchmarks/ is this script's directory
    from ring_timeline import Ranks

    return statistics.median(time_ms(fn, 3, iters, Ranks(device)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes-mib", default="16,64,256")
    ap.add_argument("--transports", default="copy-engine,nccl")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--out", default=".")
    args = ap.parse_args(argv)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", device_id=dev)
    from ringcc import _compat
    from ringcc.runtime import comm as ring_comm_mod

    rank, world = dist.get_rank(), dist.get_world_size()
    q = torch.randn(1, 16, 16384, 128, device=dev, dtype=torch.bfloat16)

    def kernel():
        _compat.cuda_cudnn_fwd(q, q, q, None, True, 0.0, False, False)

    kernel_ms = _time(kernel, args.iters, dev)
    rows = []
    for transport in args.transports.split(","):
        os.environ["RINGCC_RING_TRANSPORT"] = transport
        comm = ring_comm_mod.ring_comm(dist.group.WORLD, None, dev)
        for mib in (int(x) for x in args.sizes_mib.split(",")):
            x = torch.full((mib << 19,), float(rank), device=dev, dtype=torch.bfloat16)
            got = comm.send_recv([x])
            comm.commit()
            comm.wait()
            ok = bool((got[0] == float((rank - 1) % world)).all())
            del got

            def hop():
                comm.send_recv([x])
                comm.commit()
                comm.wait()

            def both():
                comm.send_recv([x])
                comm.commit()
                kernel()
                comm.wait()

            hop_ms, both_ms = _time(hop, args.iters, dev), _time(both, args.iters, dev)
            flag = torch.tensor([int(ok)], device=dev)
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)
            rows.append({"transport": transport, "class": type(comm).__name__, "mib": mib, "correct": bool(flag.item()),
                         "hop_ms": hop_ms, "gib_per_s": mib / 1024 / (hop_ms / 1e3), "kernel_ms": kernel_ms,
                         "both_ms": both_ms, "hidden": (hop_ms + kernel_ms - both_ms) / hop_ms})
        ring_comm_mod.release_comm_buffers()
    if rank == 0:
        name = torch.cuda.get_device_name(dev)
        print(f"device: {name} x{world}; torch {torch.__version__}; one hop to rank+1, beside one cuDNN attention "
              f"forward (1 x 16 x 16K x 16K x 128 bf16, {kernel_ms:.3f} ms)")
        head = f"{'transport':>12} {'class':>15} {'MiB':>5} {'ok':>3} {'hop ms':>8} {'GiB/s':>7} {'both ms':>8} {'hidden':>7}"
        print(head + "\n" + "-" * len(head))
        for r in rows:
            print(f"{r['transport']:>12} {r['class']:>15} {r['mib']:>5} {'yes' if r['correct'] else 'NO':>3} "
                  f"{r['hop_ms']:>8.3f} {r['gib_per_s']:>7.1f} {r['both_ms']:>8.3f} {r['hidden']:>7.2f}")
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "bench_transport.json").write_text(json.dumps(
            {"device": name, "world": world, "torch": torch.__version__, "kernel_ms": kernel_ms, "rows": rows}, indent=1))
    dist.destroy_process_group()
    return 0 if all(r["correct"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
