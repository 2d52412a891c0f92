"""Ring attention's transient memory, measured vs the planner's workspace formula.

    torchrun --nproc-per-node 4 benchmarks/trace_ring_memory.py --json ring_memory.json

For one ring_attention call (forward, then backward) per configuration, every rank records
torch.cuda.memory_allocated() above the op's inputs at each block kernel and each transfer
wait (by wrapping runtime functions from here, no change to the runtime), and the op's peak
(max_memory_allocated after a reset). Planned = workspace formula + the op's outputs, at the
same shapes (runtime/workspace.py). The table shows the largest rank. CUDA only.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os

import sympy
import torch
import torch.distributed as dist

import ringcc
from ringcc.runtime import comm as comm_mod
from ringcc.runtime import kernels, workspace

MiB = 2**20
EVENTS: list[tuple[str, int]] = []
BASE = [0]


def _mark(name):
    EVENTS.append((name, torch.cuda.memory_allocated() - BASE[0]))


def _wrap(mod, attr, name, before=True):
    fn = getattr(mod, attr)

    def inner(*a, **k):
        if before:
            _mark(name + ":before")
        out = fn(*a, **k)
        _mark(name + ":after")
        return out

    setattr(mod, attr, inner)


def planned(q, k, p) -> tuple[int, int]:
    ts = lambda t: workspace.TensorSize(tuple(t.shape), t.element_size(), "cuda")  # noqa: E731
    w = workspace.ring_attention({"q": ts(q), "k": ts(k), "v": ts(k), "key_valid": None}, sympy.Integer(p))
    out_bytes = q.numel() * q.element_size() + q.shape[0] * q.shape[1] * q.shape[2] * 4  # out + lse
    grads = q.numel() * q.element_size() + 2 * k.numel() * k.element_size()
    return int(sympy.ceiling(w.forward)) + out_bytes, int(sympy.ceiling(w.backward)) + grads


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default="ring_memory.json")
    ap.add_argument("--n-local", type=int, nargs="*", default=[4096, 8192, 16384])
    ap.add_argument("--strided", action="store_true",
                    help="q/k/v/dout as [b, s, h, d] tensors transposed (as a model's projections give them), MHA h=12 only")
    args = ap.parse_args()
    dist.init_process_group("nccl", timeout=datetime.timedelta(minutes=5))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    _wrap(kernels, "block_bwd", "block_bwd")
    _wrap(kernels, "block_fwd", "block_fwd")
    orig_wait = comm_mod.RingComm.wait

    def wait(self):
        _mark("wait:before")
        orig_wait(self)
        _mark("wait:after")

    comm_mod.RingComm.wait = wait
    rows = []
    for n_local in args.n_local:
        for layout, causal in (("zigzag", True), ("contiguous", False)):
            for h, g in ((12, 12),) if args.strided else ((12, 12), (32, 8)):
                def make(heads):
                    if args.strided:
                        t = torch.randn(1, n_local, heads, 128, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
                    else:
                        t = torch.randn(1, heads, n_local, 128, device="cuda", dtype=torch.bfloat16)
                    return t.requires_grad_()
                q, k, v = make(h), make(g), make(g)
                dout = make(h).detach()
                for phase in ("fwd", "bwd"):
                    if phase == "fwd":
                        torch.cuda.synchronize()
                        EVENTS.clear()
                        BASE[0] = torch.cuda.memory_allocated()
                        torch.cuda.reset_peak_memory_stats()
                        out = ringcc.ring_attention(q, k, v, is_causal=causal, layout=layout)
                    else:
                        torch.cuda.synchronize()
                        EVENTS.clear()
                        BASE[0] = torch.cuda.memory_allocated()
                        torch.cuda.reset_peak_memory_stats()
                        out.backward(dout)
                    torch.cuda.synchronize()
                    peak = torch.cuda.max_memory_allocated() - BASE[0]
                    top = sorted(EVENTS, key=lambda e: -e[1])[:3]
                    pf, pb = planned(q, k, world)
                    plan = pf if phase == "fwd" else pb
                    row = dict(p=world, n_local=n_local, layout=layout, causal=causal, h=h, g=g, phase=phase,
                               strided=args.strided,
                               kv_chunk=workspace.ring_kv_chunk(q, k, None, world, forward=phase == "fwd"), measured=peak, planned=plan,
                               top_events=[(nm, b) for nm, b in top])
                    got = [None] * world
                    dist.all_gather_object(got, row)
                    if rank == 0:
                        worst = max(got, key=lambda r: r["measured"])
                        worst["planned_over_measured"] = worst["planned"] / max(worst["measured"], 1)
                        rows.append(worst)
                        print(f"p={world} n_local={n_local:6} {layout:10} h={h}/{g}{' strided' if args.strided else ''} {phase} chunk={worst['kv_chunk']:2} "
                              f"measured {worst['measured'] / MiB:8.1f} MiB planned {worst['planned'] / MiB:8.1f} MiB "
                              f"ratio {worst['planned_over_measured']:.3f}  top {[(a, round(b / MiB)) for a, b in worst['top_events']]}",
                              flush=True)
                del q, k, v, dout, out
                torch.cuda.empty_cache()
    if rank == 0:
        path = args.json
        old = json.load(open(path)) if os.path.exists(path) else {"device": torch.cuda.get_device_name(), "rows": []}
        old["rows"] += rows
        json.dump(old, open(path, "w"), indent=1)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
