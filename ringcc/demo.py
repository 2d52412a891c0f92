"""`ringcc demo`: the main job on an embedded default, on CPU processes over gloo.

mode "train" (default): a small GPT-style model, written as ordinary PyTorch, trained with
`torch.compile(model, backend=ringcc.backend(...))` on P processes over one long sequence of
real text (Python's own help topics, shipped with Python: byte-level tokens). Every rank
feeds the same full sequence; ringcc shards it inside the graph. Prints the rewrite report,
a parity check against single-process eager at step 0, the memory verdict and per-rank peak,
and writes a PNG (loss curve, per-rank memory vs p).

mode "ring": the functional API alone: ring attention over P processes on a long sequence,
checked against the dense reference, with timing and per-rank memory.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
import time


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mode", choices=["train", "ring"], default="train", help="what to run (default: train)")
    p.add_argument("--world-size", type=int, default=4, help="number of CPU processes (default: 4)")
    p.add_argument("--seq-len", type=int, default=4096, help="tokens in the sequence (default: 4096)")
    p.add_argument("--steps", type=int, default=30, help="training steps (default: 30)")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate (default: 3e-3)")
    p.add_argument("--inner", choices=["aot_eager", "inductor"], default="aot_eager",
                   help="compiler for the rewritten graph (default: aot_eager, quick to start on CPU)")
    p.add_argument("--out", default="out/demo", help="folder for the PNG and JSON (default: out/demo)")


def run(args) -> int:
    if args.world_size < 1:
        raise SystemExit(f"--world-size must be >= 1; got {args.world_size}")
    if args.steps < 1:
        raise SystemExit(f"--steps must be >= 1 (training steps); got {args.steps}")
    if not args.lr > 0:
        raise SystemExit(f"--lr must be > 0 (the AdamW learning rate); got {args.lr}")
    div = 2 * args.world_size
    if not 0 < args.seq_len <= MAX_POSITIONS:
        raise SystemExit(f"--seq-len must be in 1..{MAX_POSITIONS} (the demo model's position table); got {args.seq_len}")
    if args.seq_len % div:
        raise SystemExit(
            f"--seq-len {args.seq_len} must be divisible by 2 x world size = {div} (zigzag layout); "
            f"try --seq-len {args.seq_len // div * div or div}"
        )
    os.makedirs(args.out, exist_ok=True)
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    from ringcc.launch import _free_port

    port = _free_port()
    target = _train_worker if args.mode == "train" else _ring_worker
    print(f"ringcc demo ({args.mode}): {args.world_size} CPU processes over gloo, {args.seq_len} tokens", flush=True)
    procs = [ctx.Process(target=target, args=(r, args.world_size, port, vars(args), results)) for r in range(args.world_size)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    failed = [r for r, p in enumerate(procs) if p.exitcode != 0]
    if failed:
        print(f"demo failed on ranks {failed}", file=sys.stderr)
        return 1
    per_rank = {}
    while not results.empty():
        rank, res = results.get()
        per_rank[rank] = res
    return _summarise(args, per_rank)


# ---------------------------------------------------------------------------------------


def _init(rank, world, port):
    import torch
    import torch.distributed as dist

    from ringcc.launch import thread_lock_for_tqdm

    thread_lock_for_tqdm()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(minutes=5))


def text_tokens(n: int):
    """n + 1 byte-level tokens of real English text that ships with Python (pydoc topics)."""
    import torch
    from pydoc_data.topics import topics

    data = "\n\n".join(topics[k] for k in sorted(topics)).encode("utf-8")
    if len(data) < n + 1:
        raise ValueError(f"the embedded text has {len(data)} bytes; --seq-len {n} needs {n + 1}")
    return torch.tensor(list(data), dtype=torch.long)


def _ring_worker(rank, world, port, args, results):
    import torch
    import torch.distributed as dist

    import ringcc
    from ringcc import _compat, reference
    from ringcc.launch import exit_worker
    from ringcc.runtime import layout as L

    _init(rank, world, port)
    n, h, g, d = args["seq_len"], 8, 2, 64
    gen = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(1, hh, n, d, generator=gen) for hh in (h, g, g, h))
    lay = L.Layout.ZIGZAG
    sh = lambda t: L.shard(t, 2, rank, world, lay)  # noqa: E731
    ql, kl, vl = (sh(t).requires_grad_() for t in (q, k, v))
    dout_l = sh(dout)

    def step():
        out = ringcc.ring_attention(ql, kl, vl, is_causal=True, layout="zigzag")
        out.backward(dout_l)
        return out

    dist.barrier()
    t0 = time.perf_counter()
    out = step()
    dist.barrier()
    dt = time.perf_counter() - t0
    grads = [t.grad for t in (ql, kl, vl)]
    for t in (ql, kl, vl):
        t.grad = None
    peak = _compat.cpu_allocation_peak(step)  # a second step, profiled: the tensors it allocates at its peak
    for t, grad in zip((ql, kl, vl), grads):
        t.grad = grad
    if rank == 0:
        qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
        ref, _ = reference.attention(qr, kr, vr, is_causal=True)
        ref.backward(dout)
    errs = torch.zeros(4)
    # Every rank compares its shard with the reference's shard (rank 0 computed it; broadcast).
    ref_parts = [ref.detach(), qr.grad, kr.grad, vr.grad] if rank == 0 else [torch.empty(1, hh, n, d) for hh in (h, h, g, g)]
    for t in ref_parts:
        dist.broadcast(t, 0)
    for i, (got, want) in enumerate(zip((out, ql.grad, kl.grad, vl.grad), ref_parts)):
        errs[i] = (got.detach() - sh(want)).abs().max()
    dist.all_reduce(errs, op=dist.ReduceOp.MAX)
    results.put((rank, {"seconds": dt, "step_peak_mib": peak / 2**20,
                        "max_abs_err": dict(zip(["out", "dq", "dk", "dv"], errs.tolist()))}))
    exit_worker(results)


def _summarise(args, per_rank) -> int:
    if args.mode == "ring":
        r0 = per_rank[0]
        print(f"ring attention, causal zigzag, n={args.seq_len}, h=8 (GQA h_kv=2), d=64, fp32, forward+backward")
        print(f"{'rank':>4} {'seconds':>8} {'tensors allocated at the peak, MiB':>35}")
        for r in sorted(per_rank):
            print(f"{r:>4} {per_rank[r]['seconds']:>8.2f} {per_rank[r]['step_peak_mib']:>35.1f}")
        errs = r0["max_abs_err"]
        print("max |ring - dense reference|: " + ", ".join(f"{k} {v:.2e}" for k, v in errs.items()))
        ok = max(errs.values()) < 1e-4
        print("parity:", "OK" if ok else "FAILED")
        return 0 if ok else 1
    return _summarise_train(args, per_rank)


# ---------------------------------------------------------------------------------------
# training


MAX_POSITIONS = 16384


def build_model(max_positions: int = MAX_POSITIONS, vocab: int = 256, dim: int = 64, layers: int = 2, heads: int = 4):
    """A small GPT written as ordinary PyTorch (no ringcc in it). Its learned position table
    has a fixed size, as in real models, so that its memory does not grow with the sequence."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
            self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
            self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

        def forward(self, x):
            b, n, _ = x.shape
            q, k, v = self.qkv(self.ln1(x)).split(dim, dim=-1)
            q, k, v = (t.view(b, n, heads, dim // heads).transpose(1, 2) for t in (q, k, v))
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(a.transpose(1, 2).reshape(b, n, dim))
            return x + self.mlp(self.ln2(x))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok, self.pos = nn.Embedding(vocab, dim), nn.Embedding(max_positions, dim)
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.ln, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab)

        def forward(self, ids, labels):
            pos = torch.arange(ids.shape[1], device=ids.device)
            x = self.tok(ids) + self.pos(pos)
            for blk in self.blocks:
                x = blk(x)
            logits = self.head(self.ln(x))
            return F.cross_entropy(logits.view(-1, vocab), labels.view(-1))

    torch.manual_seed(0)
    return GPT()


def _train_worker(rank, world, port, args, results):
    import torch

    import ringcc
    from ringcc.launch import exit_worker

    _init(rank, world, port)
    n, steps = args["seq_len"], args["steps"]
    tokens = text_tokens(max(n * 8, n + 1))
    model = build_model()
    eager = build_model() if rank == 0 else None
    ringcc.reset_reports()
    compiled = torch.compile(model, backend=ringcc.backend(ringcc.Config(inner=args["inner"])))
    opt = torch.optim.AdamW(model.parameters(), lr=args["lr"])
    gen = torch.Generator().manual_seed(1234)  # same batches on every rank
    losses, parity = [], None
    bar = None
    if rank == 0 and sys.stderr.isatty():  # in a log, plain lines below instead of a redrawn bar
        try:
            from tqdm import tqdm

            bar = tqdm(total=steps, desc="training", unit="step")
        except ImportError:
            bar = None
    t0 = time.perf_counter()
    for step in range(steps):
        off = int(torch.randint(0, len(tokens) - n - 1, (1,), generator=gen))
        ids, labels = tokens[off:off + n][None], tokens[off + 1:off + n + 1][None]
        loss = compiled(ids, labels)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if step == 0 and rank == 0:
            ref = eager(ids, labels)
            ref.backward()
            gdiff = max(float((p.grad - e.grad).abs().max() / e.grad.abs().max().clamp_min(1e-12))
                        for p, e in zip(model.parameters(), eager.parameters()))
            parity = {"loss": loss.item(), "eager_loss": ref.item(), "loss_abs_diff": abs(loss.item() - ref.item()),
                      "max_rel_grad_diff": gdiff}
        opt.step()
        losses.append(loss.item())
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{losses[-1]:.3f}")
        elif rank == 0 and (step + 1) % 10 == 0:
            print(f"step {step + 1}/{steps}: loss {losses[-1]:.3f}", flush=True)
    if bar is not None:
        bar.close()
    seconds = time.perf_counter() - t0
    reps = ringcc.reports()
    plan = next((r.plan for r in reps if r.plan is not None), None)
    out = {"losses": losses, "seconds": seconds, "measured_peak_mib": _measured_peak(compiled, model, ids, labels) / 2**20}
    if plan is not None:
        out["planned_peak_mib"] = plan.peak_bytes(seq_len=n, world_size=world) / 2**20
    if rank == 0:
        out["parity"] = parity
        out["report"] = "\n".join(r.format() for r in reps) if reps else "(no report)"
        out["plan"] = None if plan is None else plan.summary()
        out["plan_points"] = _plan_points(plan, n)
        out["resident_mib"] = None if plan is None else plan.to_dict()["static_bytes"] / 2**20
        # what every rank holds however many ranks share the sequence (one token each)
        out["floor_mib"] = None if plan is None else plan.peak_bytes(seq_len=n, world_size=n) / 2**20
    results.put((rank, out))
    exit_worker(results)


def _measured_peak(compiled, model, ids, labels) -> int:
    """Bytes of tensors alive at the peak of one training step (forward and backward), as the
    plan counts them: the inputs, the parameters and their gradients alive before it, plus the
    peak of what the step allocates (the CPU allocator's events, torch.profiler). The AdamW
    state is left out, as in the plan: it lives outside the compiled graph."""
    from ringcc import _compat

    params = list(model.parameters())
    before = sum(t.numel() * t.element_size() for t in [ids, labels, *params, *(q.grad for q in params if q.grad is not None)])
    return before + _compat.cpu_allocation_peak(lambda: compiled(ids, labels).backward())


def _plan_points(plan, n):
    """Planned peak bytes per rank at this n for p = 1, 2, 4, 8 (from the memory plan)."""
    if plan is None:
        return None
    return {p: float(plan.peak_bytes(seq_len=n, world_size=p)) for p in (1, 2, 4, 8)}


def _summarise_train(args, per_rank) -> int:
    r0 = per_rank[0]
    print()
    print(r0["report"])
    par = r0["parity"]
    print()
    print(f"step-0 parity vs single-process eager: loss {par['loss']:.6f} vs {par['eager_loss']:.6f} "
          f"(|diff| {par['loss_abs_diff']:.2e}), max relative gradient diff {par['max_rel_grad_diff']:.2e}")
    ok = par["loss_abs_diff"] < 1e-4 and par["max_rel_grad_diff"] < 1e-3
    print("parity:", "OK" if ok else "FAILED")
    if r0.get("plan"):
        print("memory plan:", r0["plan"])
    print("tensor memory per rank at the peak of a training step (the plan's, and measured with torch.profiler):")
    print(f"{'rank':>4} {'train s':>8} {'planned MiB':>12} {'measured MiB':>13}")
    for r in sorted(per_rank):
        pr = per_rank[r]
        print(f"{r:>4} {pr['seconds']:>8.1f} {pr.get('planned_peak_mib', float('nan')):>12.1f} {pr['measured_peak_mib']:>13.1f}")
    losses = r0["losses"]
    print(f"loss: first {losses[0]:.3f}, last {losses[-1]:.3f} over {len(losses)} steps")
    options = {k: v for k, v in vars(args).items() if not k.startswith("_") and not callable(v)}
    path = os.path.join(args.out, "demo.json")
    with open(path, "w") as f:
        json.dump({"args": options, "per_rank": per_rank}, f, indent=1)
    print("results:", path)
    png = _plot(args, per_rank)
    if png:
        print("plot:", png)
    return 0 if ok else 1


def _plot(args, per_rank):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib not installed: no plot)")
        return None
    r0 = per_rank[0]
    fig, axes = plt.subplots(1, 2, figsize=(12, 5))
    axes[0].plot(range(len(r0["losses"])), r0["losses"], marker=".")
    axes[0].set(xlabel="step", ylabel="loss", title=f"GPT on {args.seq_len} tokens, p = {args.world_size} (gloo)")
    ax = axes[1]
    pts = r0.get("plan_points")
    if pts:
        ps = sorted(pts, key=int)
        ax.plot(ps, [pts[p] / 2**20 for p in ps], marker="o", label="planned peak per rank (memory planner)")
    if r0.get("floor_mib"):
        ax.axhline(r0["floor_mib"], color="C0", linestyle=":",
                   label="planned peak with one token per rank: the gradient all-reduce's")
    if r0.get("resident_mib"):
        ax.axhline(r0["resident_mib"], color="gray", linestyle="--",
                   label="parameters and gradients: replicated on every rank")
    measured = [per_rank[r]["measured_peak_mib"] for r in sorted(per_rank)]
    ax.plot([args.world_size], [max(measured)], linestyle="none", marker="x", markersize=10, color="C3", zorder=3,
            label=f"measured at p = {args.world_size} (largest rank; torch.profiler's tensor allocations)")
    ax.set_xscale("log", base=2)
    ax.set_xticks([1, 2, 4, 8], ["1", "2", "4", "8"])
    ax.set_ylim(bottom=0)
    ax.set(xlabel="p (ranks)", ylabel="MiB per rank",
           title=f"tensor memory at the peak of a training step, n = {args.seq_len}")
    ax.text(0.02, 0.02, "Activations shrink as n/p. Once they are small, the peak is the gradient all-reduce's:\n"
            "parameters, gradients and the all-reduce's buffers, the same on every rank whatever p.\n"
            "(AdamW's state, outside the compiled graph, comes on top, also replicated.)",
            transform=ax.transAxes, fontsize=7.5, va="bottom")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.14), fontsize=8, frameon=False)
    fig.tight_layout()
    path = os.path.join(args.out, "demo.png")
    fig.savefig(path, dpi=110)
    return path


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
