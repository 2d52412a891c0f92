"""Planner prediction vs the allocator's measured peak, per rank.

    torchrun --nproc-per-node 4 benchmarks/bench_planner_gpu.py --json planner.json
    torchrun --nproc-per-node 2 benchmarks/bench_planner_gpu.py --smoke      # CPU / gloo check

For an attention layer and a small Llama block (RMSNorm, GQA attention with RoPE, SwiGLU)
at several n and p = 1, 2, 4 (sub-groups of the launched ranks; ranks outside a group wait),
every rank compiles the model with the ringcc backend (inner "eager": the rewritten graph
runs op by op, as the planner models it), takes the plan the backend stored in each graph's
report, runs one training step (forward + backward) and compares:

  measured  = torch.cuda.max_memory_allocated() during the step - memory_allocated() before it
              + the copy-engine ring's receive areas where the allocator does not count them (comm.py)
  planned   = plan peak - resident bytes (parameters, gradients, graph inputs)

Parameters, their gradients and the inputs are allocated before the step in both, so the
comparison is about what the step allocates. The table gives the largest rank's numbers.
`--smoke` runs tiny shapes on CPU with gloo: the plan is printed, nothing is measured.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import dist_setup
import ringcc
from ringcc import planner
from ringcc.config import Config

# ---------------------------------------------------------------------------------------
# models (hidden sizes never equal a shard length: sizes are planned from constant shapes)


class AttentionLayer(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.out = nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        b, s, dim = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, dim // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = self.out(a.transpose(1, 2).reshape(b, s, dim))
        return y.float().pow(2).mean()


class MaskedAttentionLayer(AttentionLayer):
    """The attention layer with a causal sliding window and a key padding mask built in the
    graph: every ring block with a window edge or padded keys runs as a masked call (row chunks,
    runtime/kernels.py Note [Masked rows]), which the plan counts (workspace.masked_calls)."""

    window = 2048

    def forward(self, x, pad):  # pad: bool [b, n], True = padding
        b, s, dim = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, dim // self.heads).permute(2, 0, 3, 1, 4)
        i = torch.arange(s, device=x.device)
        band = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < self.window)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=band & ~pad[:, None, None, :])
        y = self.out(a.transpose(1, 2).reshape(b, s, dim))
        return y.float().pow(2).mean()


class DocumentsLayer(AttentionLayer):
    """The attention layer over packed documents: a causal document mask built in the graph from
    per-token document ids, which ringcc reads as a mask function (runtime/maskfn.py); its blocks
    run on flex_attention on CUDA (Note [Flex blocks]), which the plan counts
    (workspace.masked_calls)."""

    def forward(self, x, doc):  # doc: int [b, n], the document of each token
        b, s, dim = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, dim // self.heads).permute(2, 0, 3, 1, 4)
        i = torch.arange(s, device=x.device)
        mask = (i[None, :] <= i[:, None])[None] & (doc[:, :, None] == doc[:, None, :])
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None])
        y = self.out(a.transpose(1, 2).reshape(b, s, dim))
        return y.float().pow(2).mean()


class SoftcapLayer(AttentionLayer):
    """The attention layer written out with Gemma 2's soft-capped scores and a causal additive
    mask (a score function to ringcc: Note [Score functions] in runtime/maskfn.py)."""

    cap = 50.0

    def forward(self, x):
        b, s, dim = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, dim // self.heads).permute(2, 0, 3, 1, 4)
        scores = torch.tanh(q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5 / self.cap) * self.cap
        i = torch.arange(s, device=x.device)
        scores = scores.masked_fill(i[None, :] > i[:, None], float("-inf"))
        a = torch.softmax(scores, dim=-1, dtype=torch.float32).to(v.dtype) @ v
        y = self.out(a.transpose(1, 2).reshape(b, s, dim))
        return y.float().pow(2).mean()


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def rope(x, positions, base: float = 10000.0):
    d = x.shape[-1]
    inv = 1.0 / base ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d)
    ang = positions[:, None].float() * inv[None, :]
    cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class LlamaBlock(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int, hidden: int):
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, dim // heads
        self.norm1, self.norm2 = RMSNorm(dim), RMSNorm(dim)
        self.q = nn.Linear(dim, dim, bias=False)
        self.k = nn.Linear(dim, kv_heads * self.hd, bias=False)
        self.v = nn.Linear(dim, kv_heads * self.hd, bias=False)
        self.o = nn.Linear(dim, dim, bias=False)
        self.gate = nn.Linear(dim, hidden, bias=False)
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x, positions):
        b, s, dim = x.shape
        h = self.norm1(x)
        q = rope(self.q(h).view(b, s, self.heads, self.hd).transpose(1, 2), positions)
        k = rope(self.k(h).view(b, s, self.kv_heads, self.hd).transpose(1, 2), positions)
        v = self.v(h).view(b, s, self.kv_heads, self.hd).transpose(1, 2)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, s, dim))
        h = self.norm2(x)
        x = x + self.down(F.silu(self.gate(h)) * self.up(h))
        return x.float().pow(2).mean()


def make(model: str, n: int, device, dtype, smoke: bool):
    torch.manual_seed(0)
    if model == "attention":
        dim, heads = (48, 3) if smoke else (1536, 12)
        m = AttentionLayer(dim, heads)
        inputs = (torch.randn(1, n, dim),)
    elif model == "masked":
        dim, heads = (48, 3) if smoke else (1536, 12)
        m = MaskedAttentionLayer(dim, heads)
        if smoke:
            m.window = 24
        pad = torch.zeros(1, n, dtype=torch.bool)
        pad[:, n - n // 8:] = True  # the last eighth of the keys is padding
        inputs = (torch.randn(1, n, dim), pad)
    elif model == "documents":
        dim, heads = (48, 3) if smoke else (1536, 12)
        m = DocumentsLayer(dim, heads)
        inputs = (torch.randn(1, n, dim), (torch.arange(n) // (n // 8))[None])  # 8 equal documents
    elif model == "softcap":
        dim, heads = (48, 3) if smoke else (1536, 12)
        m = SoftcapLayer(dim, heads)
        inputs = (torch.randn(1, n, dim),)
    else:
        dim, heads, kv, hidden = (48, 4, 2, 80) if smoke else (1536, 12, 4, 4480)
        m = LlamaBlock(dim, heads, kv, hidden)
        inputs = (torch.randn(1, n, dim), torch.arange(n))
    m = m.to(device=device, dtype=dtype)
    inputs = tuple(t.to(device=device, dtype=dtype if t.is_floating_point() else t.dtype) for t in inputs)
    return m, inputs


# ---------------------------------------------------------------------------------------
# one measurement


def step_bytes(plan: planner.MemoryPlan, seq_len: int | None = None, world_size: int | None = None) -> int:
    """The plan's peak minus the bytes alive before the step (parameters and their gradients,
    graph inputs, the copy-engine receive area made by the warm-up), at n = seq_len,
    p = world_size (default: the traced values)."""
    at = plan._subs(seq_len, world_size)
    inputs = sum(nd.bytes_at(at) for nd in plan.nodes if nd.op == "placeholder" and not nd.static)
    resident = int(planner._evaluate(plan.static, at)) + int(planner._evaluate(plan.area, at))
    return plan.peak_bytes(seq_len, world_size) - resident - inputs


def measure(model_name: str, n: int, group, device, dtype, smoke: bool) -> dict:
    world = dist.get_world_size(group)
    m, inputs = make(model_name, n, device, dtype, smoke)
    config = Config(group=group, inner="eager", world_size=world)
    torch._dynamo.reset()
    ringcc.reset_reports()
    compiled = torch.compile(m, backend=ringcc.backend(config), dynamic=False)
    compiled(*inputs).backward()  # compile + warm-up; gradients now exist (resident)
    plans = [r.plan for r in ringcc.reports() if r.plan is not None]
    if not plans:
        raise RuntimeError("the ringcc backend stored no memory plan: " + "; ".join(
            note for r in ringcc.reports() for note in r.notes))
    m.zero_grad(set_to_none=False)
    gc.collect()
    row = {"model": model_name, "n": n, "p": world, "graphs": len(plans),
           "verdict": all(pl.verdict for pl in plans),
           "planned_peak_bytes": max(pl.peak_bytes() for pl in plans),
           "planned_step_bytes": max(step_bytes(pl) for pl in plans),
           "peak_formula": str(plans[0].peak) if plans else "",
           "planned_peak_at": [pl.point_name(pl.peak_point()) for pl in plans]}
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        compiled(*inputs).backward()
        torch.cuda.synchronize()
        # The copy-engine ring's receive area (runtime/comm.py) is resident once the warm-up made
        # it, as in the plan (`MemoryPlan.area`): the step's bytes leave it out (where the caching
        # allocator counts it, it is in `before`; where not, max_memory_allocated never sees it),
        # the peak includes it (added where the allocator does not count it).
        from ringcc.runtime.comm import comm_buffer_bytes, transport_info

        row["comm_buffer_bytes"] = comm_buffer_bytes(device)
        row["ring_transport"] = transport_info(group, device)
        row["planned_area_bytes"] = max(int(planner._evaluate(pl.area, pl._subs())) for pl in plans)
        row["measured_step_bytes"] = torch.cuda.max_memory_allocated() - before
        row["measured_peak_bytes"] = torch.cuda.max_memory_allocated() + row["comm_buffer_bytes"]
        row["rel_err"] = row["planned_step_bytes"] / row["measured_step_bytes"] - 1
    else:
        compiled(*inputs).backward()
    del compiled, m, inputs
    torch._dynamo.reset()
    gc.collect()
    return row


# ---------------------------------------------------------------------------------------
# driver


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on CPU with gloo; plan only")
    ap.add_argument("--lengths", type=int, nargs="*", default=None, help="sequence lengths n")
    ap.add_argument("--worlds", type=int, nargs="*", default=[1, 2, 4], help="group sizes p")
    ap.add_argument("--models", nargs="*", default=["attention", "llama"],
                    choices=["attention", "llama", "masked", "documents", "softcap"],
                    help="masked: the attention layer with a sliding window and key padding; documents: "
                         "with a causal document mask; softcap: soft-capped scores (eager attention)")
    ap.add_argument("--json", dest="json_path", default="planner_vs_measured.json")
    args = ap.parse_args(argv)

    device, dtype = dist_setup.start(args.smoke)
    use_cuda = device.type == "cuda"
    rank, size = dist.get_rank(), dist.get_world_size()
    lengths = args.lengths or ([64, 128] if args.smoke else [16384, 32768, 65536])
    worlds = [w for w in args.worlds if w <= size]
    groups = {w: dist.new_group(list(range(w))) for w in worlds}  # every rank creates every group
    from ringcc.runtime.comm import release_comm_buffers

    rows = []
    for model_name in args.models:
        for w in worlds:
            for n in lengths:
                if n % (2 * w):
                    continue
                row = None
                if use_cuda:  # every rank (a collective per area): each cell makes its own area, which only grows
                    release_comm_buffers()
                if rank < w:
                    row = measure(model_name, n, groups[w], device, dtype, args.smoke)
                gathered = [None] * size
                dist.all_gather_object(gathered, row)
                if rank == 0:
                    mine = [r for r in gathered if r is not None]
                    key = "measured_step_bytes" if use_cuda else "planned_step_bytes"
                    worst = max(mine, key=lambda r: r[key])
                    rows.append(worst)
                    _print_row(worst, use_cuda)
    info = None
    if rank == 0:
        info = {
            "device": torch.cuda.get_device_name() if use_cuda else "cpu (smoke, gloo)",
            "torch": torch.__version__, "ranks": size, "dtype": str(dtype),
            "kernel": os.environ.get("RINGCC_CUDA_KERNEL", "cudnn"),
            "rows": rows,
        }
        if use_cuda:
            errs = [abs(r["rel_err"]) for r in rows]
            info["max_abs_rel_err"] = max(errs) if errs else None
            print(f"max |planned/measured - 1| = {info['max_abs_rel_err']:.3f} over {len(rows)} cells")
    dist_setup.finish(info, args.json_path)
    return 0


def _print_row(r: dict, measured: bool) -> None:
    mib = 2**20
    line = (f"{r['model']:9} n={r['n']:>7} p={r['p']}  verdict={str(r['verdict']):5}  "
            f"planned step {r['planned_step_bytes'] / mib:9.1f} MiB (peak {r['planned_peak_bytes'] / mib:9.1f})")
    if measured:
        line += (f"  measured step {r['measured_step_bytes'] / mib:9.1f} MiB "
                 f"(peak {r['measured_peak_bytes'] / mib:9.1f})  err {100 * r['rel_err']:+6.1f}%")
        t = r.get("ring_transport") or {}
        if t:
            line += f"  ring {t['transport']}"
            if t["area_bytes"]:
                line += (f" (area {t['area_bytes'] / mib:.0f} MiB, planned {r.get('planned_area_bytes', 0) / mib:.0f}, "
                         f"{'in' if t['area_counted_by_allocator'] else 'outside'} the allocator)")
            if t["copy_engine_unusable"]:
                line += f" [copy engines unusable: {t['copy_engine_unusable'][:80]}]"
    print(line, flush=True)


if __name__ == "__main__":
    sys.exit(main())
