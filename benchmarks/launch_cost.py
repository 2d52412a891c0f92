"""Host time per call of the ring's elementwise operations (one GPU): what it costs the host to
issue each, with the GPU kept busy by a spin so no call waits for it.

    python benchmarks/launch_cost.py --json launch.json

Rows: a plain torch op (the reference), the ring's copy, the Triton merge and add (fused.py,
with and without the availability check), the compiled torch merge (merge.py's fallback), the
cuDNN block kernel of one head chunk, and whole calls: ringcc.ring_attention forward (and its
custom op, setup and ring_forward alone) and forward+backward against SDPA's (cuDNN). Prints a
table, writes JSON, names the device. Where a call's host time goes before its first kernel:
call_latency.py.

Under torchrun (`--dist`) every rank runs the rows at once on its own GPU with an NCCL process
group, and the whole ring calls run at the group's p: the host cost per call in a ring
process, next to the lone process's. Rank 0 prints; the JSON has every rank's rows.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch


def host_us(fn, calls: int, repeats: int = 5) -> float:
    """Median over `repeats` of the host µs per call of `fn`, issued behind a GPU spin."""
    from ringcc import _compat

    fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(repeats):
        _compat.cuda_spin(int(2e8))  # about 0.1 s of GPU work ahead of the calls
        t = time.perf_counter()
        for _ in range(calls):  # few enough that the launch queue never fills
            fn()
        out.append(1e6 * (time.perf_counter() - t) / calls)
        torch.cuda.synchronize()
    return statistics.median(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--rows", type=int, default=16384)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--json", default=None)
    ap.add_argument("--dist", action="store_true", help="under torchrun: every rank at once, NCCL")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    import torch.distributed as dist
    import torch.nn.functional as F

    import ringcc
    from ringcc.runtime import fused, kernels, merge
    from ringcc.runtime.ring import copy_by_kernel

    rank, world = 0, 1
    if args.dist:
        import os

        rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
        world = dist.get_world_size()
    dev = torch.device("cuda", rank)
    shape = (1, args.heads, args.rows, args.head_dim)
    bf = lambda: torch.randn(shape, device=dev).bfloat16()  # noqa: E731
    oa, ob, o16 = bf(), bf(), torch.empty(shape, device=dev, dtype=torch.bfloat16)
    acc = torch.randn(shape, device=dev)
    la, lb, ld = (torch.randn(shape[:3], device=dev) for _ in range(3))
    q, k, v = bf(), bf(), bf()
    rows = []

    def row(name, fn, calls=args.calls):
        rows.append({"call": name, "host_us": host_us(fn, calls)})

    row("torch.add(fp32, bf16, out=bf16)", lambda: torch.add(acc, ob, out=o16))
    row("copy_by_kernel (bf16)", lambda: copy_by_kernel(o16, oa))
    if fused.triton is not None:
        row("fused.available (6 tensors)", lambda: fused.available((o16, oa, ob), (ld, la, lb)))
        row("fused.merge (Triton launch)", lambda: fused.merge(o16, ld, oa, la, ob, lb))
        row("fused.add (Triton launch)", lambda: fused.add(acc, oa, ob))
        row("merge.merge_ (check + Triton)", lambda: merge.merge_(oa, la, ob, lb, o16, ld))
    fn = merge._merge_to
    compiled = torch.compile(fn, fullgraph=True)
    row("compiled torch merge", lambda: compiled(o16, ld, oa, la, ob, lb))
    row("kernels.block_fwd (cuDNN)", lambda: kernels.block_fwd(q, k, v, scale=args.head_dim ** -0.5, causal=False))

    # Whole calls, [1, 2 * heads, rows, d] per rank: the ring at this process's p, SDPA alone.
    qg, kg, vg = (torch.randn((1, 2 * args.heads, args.rows, args.head_dim), device=dev).bfloat16().requires_grad_()
                  for _ in range(3))
    dout = torch.randn_like(qg)
    ring_f = lambda: ringcc.ring_attention(qg, kg, vg, is_causal=True, layout="zigzag")  # noqa: E731
    sdpa_f = lambda: F.scaled_dot_product_attention(qg, kg, vg, is_causal=True)  # noqa: E731
    from ringcc.runtime import ops
    from ringcc.runtime.ring import ring_forward

    name_, _, _ = ops._group_args(None)
    op_args = (None, True, args.head_dim ** -0.5, name_, world, "zigzag", 0)
    setup = ops._setup(qg, kg, None, name_, world, "zigzag", True, args.head_dim ** -0.5, forward=True)
    with torch.no_grad():
        row(f"ring_attention fwd, no grad (p={world})", ring_f, calls=5)
        row("  its custom op alone", lambda: ops.ring_attention_op(qg, kg, vg, *op_args), calls=5)
        row("  its _setup", lambda: ops._setup(qg, kg, None, name_, world, "zigzag", True, args.head_dim ** -0.5,
                                               forward=True), calls=5)
        row("  ring_forward alone", lambda: ring_forward(qg, kg, vg, None, setup), calls=5)
        row("SDPA fwd, no grad", sdpa_f, calls=5)
    row(f"ring_attention fwd+bwd (p={world})", lambda: ring_f().backward(dout), calls=5)
    row("SDPA fwd+bwd", lambda: sdpa_f().backward(dout), calls=5)
    name = torch.cuda.get_device_name(dev)
    gathered = [rows]
    if args.dist:
        gathered = [None] * world
        dist.all_gather_object(gathered, rows)
    if rank == 0:
        print(f"device: {name} x{world if args.dist else 1}; torch {torch.__version__}; triton "
              f"{getattr(fused.triton, '__version__', 'none')}; tensors {list(shape)} bf16; host µs per call"
              + (f"; {world} ranks at once (torchrun, NCCL)" if args.dist else ""))
        print(f"  {'call':<40}" + "".join(f" {'rank ' + str(r):>8}" for r in range(len(gathered))))
        for i, r in enumerate(rows):
            print(f"  {r['call']:<40}" + "".join(f" {g[i]['host_us']:>8.1f}" for g in gathered))
        if args.json:
            Path(args.json).write_text(json.dumps({"device": name, "torch": torch.__version__, "ranks": len(gathered),
                                                   "triton": getattr(fused.triton, "__version__", None),
                                                   "shape": list(shape), "rows": gathered[0], "rows_per_rank": gathered},
                                                  indent=1))
    if args.dist:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
