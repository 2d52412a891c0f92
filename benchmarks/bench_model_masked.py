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

`--model hf-llama` runs a Hugging Face LlamaForCausalLM in Llama-3.2-1B's shape (random init,
the loss computed inside from `labels=`; smoke: a tiny one) instead of the L-layer transformer.
`--amp on` keeps the weights in fp32 and runs each step under `torch.autocast(device, bfloat16)`,
as HF Trainer's bf16=True and accelerate's mixed precision do, in place of bf16 weights;
`--amp both` runs every cell both ways. `--plain` adds the same step under plain
`torch.compile` (inductor; aot_eager in smoke mode) on rank 0's device alone at the whole length.
Mixed precision on one GPU: ringcc against plain compile under the same autocast, and against
its bf16-weights time (prints the two targets per length):

    torchrun --nproc-per-node 1 benchmarks/bench_model_masked.py --model hf-llama --inner inductor \
        --lengths 16384 32768 --cases unmasked --amp both --plain --reps 3 --warmup 2 --json amp.json

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


def hf_llama(smoke: bool) -> nn.Module:
    """A Hugging Face LlamaForCausalLM shaped as Llama-3.2-1B (16 layers of width 2048, GQA 32/8,
    tied 128K vocabulary, llama3 RoPE scaling), random init; a tiny one in smoke mode."""
    import transformers

    if smoke:
        shape = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2)
    else:
        shape = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                     num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=True)
    rope = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192}
    cfg = transformers.LlamaConfig(max_position_embeddings=131072, **shape)
    if hasattr(cfg, "rope_parameters"):  # transformers 5.x
        cfg.rope_parameters = dict(rope, rope_theta=500000.0)
    else:
        cfg.rope_theta, cfg.rope_scaling = 500000.0, rope
    return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").train()


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


AMP_DTYPE = torch.bfloat16
PRECISIONS = {"off": (False,), "on": (True,), "both": (False, True)}


def precision(amp: bool, dtype) -> str:
    name = lambda d: str(d).removeprefix("torch.")  # noqa: E731
    return f"float32 weights + {name(AMP_DTYPE)} autocast" if amp else f"{name(dtype)} weights"


def training_step(case: str, n: int, args, device, dtype, group=None, amp: bool = False, plain: bool = False):
    """One forward+backward of the model at n tokens, compiled with ringcc over `group` (None:
    WORLD), or with plain torch.compile when `plain`, with the case's padding mask; with `amp`,
    fp32 weights under torch.autocast(AMP_DTYPE) in place of `dtype` weights."""
    torch.manual_seed(0)
    weights = torch.float32 if amp else dtype
    model = (hf_llama(args.smoke) if args.model == "hf-llama" else
             Model(args.heads * args.head_dim, args.heads, args.layers)).to(device, weights)
    if plain:
        compiled = torch.compile(model, backend="inductor" if device.type == "cuda" else "aot_eager")
    else:
        compiled = torch.compile(model, backend=ringcc.backend(ringcc.Config(inner=args.inner, group=group)))
    gen = torch.Generator().manual_seed(1)
    pad = None
    if case == "key padding":
        pad = torch.zeros(1, n, dtype=torch.bool, device=device)
        pad[:, n - n // 8:] = True  # the sequence's last eighth
    if args.model == "hf-llama":
        ids = torch.randint(0, model.config.vocab_size, (1, n), generator=gen).to(device)
        mask = None if pad is None else (~pad).long()
        loss = lambda: compiled(input_ids=ids, attention_mask=mask, labels=ids).loss  # noqa: E731
    else:
        x = torch.randn(1, n, args.heads * args.head_dim, generator=gen).to(device, weights)
        loss = lambda: compiled(x, pad)  # noqa: E731

    def step():
        with torch.autocast(device.type, AMP_DTYPE, enabled=amp):
            out = loss()
        out.backward()

    return step


def _sites() -> str:
    """Attention sites rewritten / found in the graphs compiled since the last reset."""
    sites = [s for r in ringcc.reports() for s in r.sites]
    return f"{sum(s.decision.value == 'rewritten' for s in sites)}/{len(sites)}"


def _peak_gib(device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def _reset_peak(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)


def cell(case: str, n_local: int, waits: str, args, device, dtype, gathers, amp: bool = False) -> dict:
    world = dist.get_world_size()
    BACKEND._grad_waits_last = PLACEMENTS[waits]
    n = n_local * world
    ringcc.reset_reports()
    step = training_step(case, n, args, device, dtype, amp=amp)
    t0 = time.perf_counter()
    for _ in range(args.warmup):
        step()
    warm_s = time.perf_counter() - t0
    sites = _sites()
    _reset_peak(device)
    times, counts = [], []
    for _ in range(args.reps):
        before = gathers[0]
        times.append(dist_setup.timed(step, device))
        counts.append(gathers[0] - before)
    ms = statistics.median(times)
    peak = _peak_gib(device)
    timeline_text = None
    if args.trace_dir and device.type == "cuda":
        trace = f"{args.trace_dir}/model_{case.replace(' ', '_')}_{waits}_{n_local}_p{world}.json.gz"
        timeline_text = timeline.profile_step(step, dist.barrier, trace, rank0=dist.get_rank() == 0)
        if dist.get_rank() == 0:
            print(f"profile of one step ({case}, {n_local} tokens per GPU, rank 0):\n{timeline_text}", flush=True)
    every = [None] * world
    dist.all_gather_object(every, (ms, counts, peak))
    torch._dynamo.reset()
    peaks = [e[2] for e in every if e[2] is not None]
    return dict(case=case, grad_waits=waits, n_local=n_local, n=n, p=world, layers=args.layers, ms=max(e[0] for e in every),
                ms_per_rank=[e[0] for e in every], key_run_gathers_per_step=statistics.median(counts),
                warmup_s=warm_s, profile=timeline_text, model=args.model, compiler="ringcc",
                amp=amp, precision=precision(amp, dtype), sites=sites, peak_gib=max(peaks) if peaks else None)


def one_device(case: str, n_local: int, args, device, dtype, solo, amp: bool = False, plain: bool = False) -> dict | None:
    """Rank 0 alone runs the same model at the whole length (n_local * p tokens) on its device,
    compiled with ringcc over `solo` (a group of rank 0 only: p = 1), as `--nproc-per-node 1`
    would, or with plain torch.compile when `plain`; the other ranks wait. Rank 0 returns the
    row (median of --reps steps after --warmup), the others None."""
    world = dist.get_world_size()
    row = None
    if dist.get_rank() == 0:
        n = n_local * world
        ringcc.reset_reports()
        step = training_step(case, n, args, device, dtype, group=solo, amp=amp, plain=plain)
        for _ in range(args.warmup):
            step()
        sites = "-" if plain else _sites()
        _reset_peak(device)
        ms = statistics.median(dist_setup.timed(step, device, barrier=False) for _ in range(args.reps))
        torch._dynamo.reset()
        row = dict(case=case, grad_waits="-", n_local=n, n=n, p=1, layers=args.layers, ms=ms, ms_per_rank=[ms],
                   key_run_gathers_per_step=0, one_device_of=world, model=args.model,
                   compiler="plain" if plain else "ringcc", amp=amp, precision=precision(amp, dtype), sites=sites,
                   peak_gib=_peak_gib(device))
    dist.barrier()
    return row


def amp_targets(rows: list[dict]) -> list[dict]:
    """Per case and length where one device ran all four (ringcc and plain compile, bf16 weights
    and fp32 weights under autocast): ringcc's speed-up over plain compile under autocast, and
    ringcc under autocast against its own bf16-weights time plus what plain compile pays for
    autocast over bf16 weights."""
    out = []
    for case, n in sorted({(r["case"], r["n"]) for r in rows if r["p"] == 1}):
        cells = {(r["compiler"], r["amp"]): r["ms"] for r in rows
                 if r["p"] == 1 and r["case"] == case and r["n"] == n}
        if len(cells) < 4:
            continue
        budget = cells["ringcc", False] + cells["plain", True] - cells["plain", False]
        out.append(dict(case=case, n=n, ringcc_amp_ms=cells["ringcc", True], plain_amp_ms=cells["plain", True],
                        ringcc_bf16_ms=cells["ringcc", False], plain_bf16_ms=cells["plain", False],
                        speedup_over_plain=cells["plain", True] / cells["ringcc", True], budget_ms=budget,
                        over_budget=cells["ringcc", True] / budget - 1))
    return out


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
    ap.add_argument("--model", choices=("layers", "hf-llama"), default="layers",
                    help="the L-layer causal transformer, or HF LlamaForCausalLM in Llama-3.2-1B's shape (labels inside)")
    ap.add_argument("--amp", choices=tuple(PRECISIONS), default="off",
                    help=f"on: fp32 weights under torch.autocast({AMP_DTYPE}) in place of bf16 weights; both: each cell "
                         "both ways")
    ap.add_argument("--plain", action="store_true",
                    help="also the same step under plain torch.compile on rank 0's device alone at the whole length")
    args = ap.parse_args()
    if args.smoke:
        args.lengths, args.layers, args.heads, args.head_dim, args.reps, args.warmup = [16], 2, 2, 8, 2, 1
    device, dtype = dist_setup.start(args.smoke)
    gathers = _count_key_run_gathers()
    solo = dist.new_group([0]) if args.one_gpu else None  # (every rank makes the group)
    rows = []
    for n_local in args.lengths:
        for case in args.cases:
            for amp in PRECISIONS[args.amp]:
                for waits in args.grad_waits:
                    rows.append(cell(case, n_local, waits, args, device, dtype, gathers, amp))
                    if dist.get_rank() == 0:
                        r = rows[-1]
                        print(f"{case:12s} {r['precision']:28s} waits {waits:8s} n_local={n_local:6d}: {r['ms']:9.2f} ms, "
                              f"{r['key_run_gathers_per_step']} key-run all-gathers per step, sites {r['sites']}",
                              flush=True)
                if args.one_gpu:
                    row = one_device(case, n_local, args, device, dtype, solo, amp)
                    if row is not None:
                        rows.append(row)
                        fastest = min(r["ms"] for r in rows if r["p"] > 1 and r["case"] == case
                                      and r["n_local"] == n_local and r["precision"] == row["precision"])
                        row["speedup_of_best"] = row["ms"] / fastest
                        print(f"{case:12s} one device, {row['n']:6d} tokens: {row['ms']:9.2f} ms; speed-up "
                              f"{row['speedup_of_best']:.2f}x", flush=True)
                if args.plain:
                    row = one_device(case, n_local, args, device, dtype, None, amp, plain=True)
                    if row is not None:
                        rows.append(row)
                        print(f"{case:12s} {row['precision']:28s} plain torch.compile, {row['n']:6d} tokens: "
                              f"{row['ms']:9.2f} ms", flush=True)
    info = None
    if dist.get_rank() == 0:
        name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu (smoke, gloo)"
        targets = amp_targets(rows)
        info = dict(label=args.label, device=name, torch=torch.__version__, model=args.model, rows=rows,
                    amp_targets=targets)
        what = ("HF LlamaForCausalLM (Llama-3.2-1B shape, labels inside)" if args.model == "hf-llama" else
                f"{args.layers}-layer causal transformer, h={args.heads}, d={args.head_dim}")
        print(f"\n{args.label or 'this tree'}: {what}, p={dist.get_world_size()}, inner={args.inner}, {name}")
        print(f"{'case':12s} {'p':>2s} {'compiler':>8s} {'precision':>28s} {'grad waits':>10s} {'tokens/GPU':>10s} "
              f"{'step ms':>9s} {'peak GiB':>8s} {'sites':>6s} {'gathers/step':>12s}")
        for r in rows:
            peak = "-" if r["peak_gib"] is None else f"{r['peak_gib']:.1f}"
            print(f"{r['case']:12s} {r['p']:2d} {r['compiler']:>8s} {r['precision']:>28s} {r['grad_waits']:>10s} "
                  f"{r['n_local']:10d} {r['ms']:9.2f} {peak:>8s} {r['sites']:>6s} {r['key_run_gathers_per_step']:12}")
        for t in targets:
            print(f"{t['case']} at {t['n']} tokens: ringcc under autocast {t['ringcc_amp_ms']:.1f} ms is "
                  f"{t['speedup_over_plain']:.2f}x plain compile under autocast (target >= 1.5x); its bf16-weights "
                  f"time plus plain compile's autocast cost is {t['budget_ms']:.1f} ms, ringcc under autocast "
                  f"{t['over_budget']:+.1%} of it (target <= +15%)")
    dist_setup.finish(info, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
