"""End-to-end training steps of a Llama-3-style model under FSDP2: ringcc against PyTorch context
parallel, and one GPU.

The model is benchmarks/llama3.py (plain PyTorch: RoPE, RMSNorm, SwiGLU, GQA 32/8, tied 128K
vocabulary; 16 layers of width 2048, about 1.2B parameters), bf16 compute with fp32 master
weights and gradient reduction (FSDP2's MixedPrecisionPolicy; with --amp, fp32 parameters under
torch.autocast(bfloat16) instead, as accelerate's and HF Trainer's mixed precision run), AdamW,
every block under activation checkpointing, the loss over vocabulary chunks (LlamaConfig.vocab_chunks). The mesh
is (dp, cp) over the launched ranks (--dp, default 1: every rank holds a piece of one sequence);
FSDP2 shards every block and the root over the flattened dp x cp mesh, as torchtitan does.
Methods:
  ringcc  each block and the head compiled with ringcc (Config(mesh=..., axis="cp",
          grad_sync="outer"), inductor after its passes); every rank is given the whole sequence
          and ringcc shards it (zigzag ring attention, cuDNN blocks; the head's input is marked
          with ringcc.mark_sequence, so its logits are n/cp rows per rank too).
  cp      torch.distributed.tensor.experimental.context_parallel on the cp dimension: tokens,
          labels and positions sharded by its context manager (head-tail load balance), SDPA on
          cuDNN (K/V repeated to the query heads, as torchtitan's Llama does), blocks and head
          compiled with inductor (--cp-compile), K/V rotated by all-gather (--cp-rotate).
  single  the same model without FSDP on rank 0 alone, at the whole length (dp x cp x
          tokens-per-GPU); "OOM" where it does not fit.
Per method and size: tokens/s (global tokens per step over the median step), each rank's peak
memory (max_memory_allocated over the measured steps), the loss of the last measured step (the
same model and tokens in every method), and one more step, profiled, split into GPU time
in attention kernels, in collectives (NCCL kernels and peer copies) and in other kernels, as
shares of the step (collectives overlap compute, so the shares may add up past 1).

    torchrun --nproc-per-node 4 benchmarks/bench_fsdp.py --tokens-per-gpu 32768 --json fsdp.json
    torchrun --nproc-per-node 2 benchmarks/bench_fsdp.py --smoke          # CPU / gloo, tiny
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import dist_setup  # noqa: E402
import llama3  # noqa: E402

METHODS = ("ringcc", "cp", "single")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens-per-gpu", type=int, nargs="+", default=[32768],
                    help="sizes, each a separate cell per method (one GPU runs tokens-per-GPU x world)")
    ap.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated, of {METHODS}")
    ap.add_argument("--dp", type=int, default=1, help="data-parallel size; cp = world / dp")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--dim", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--ffn", type=int, default=8192)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--vocab-chunks", type=int, default=8)
    ap.add_argument("--no-checkpoint", action="store_true", help="no activation checkpointing of the blocks")
    ap.add_argument("--amp", action="store_true",
                    help="fp32 parameters under torch.autocast(bfloat16) in every method, in place of FSDP2's bf16 "
                         "parameter policy")
    ap.add_argument("--inner", default="inductor", help="ringcc's compiler after its passes")
    ap.add_argument("--cp-compile", choices=("inductor", "none"), default="inductor")
    ap.add_argument("--cp-rotate", choices=("allgather", "alltoall"), default="allgather")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--json", default=None)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes on CPU / gloo, fp32")
    args = ap.parse_args(argv)
    if args.smoke:
        args.layers, args.dim, args.heads, args.kv_heads, args.ffn, args.vocab = 2, 32, 4, 2, 64, 64
        args.vocab_chunks, args.inner = 2, "aot_eager"
        args.tokens_per_gpu = [t if t <= 64 else 24 for t in args.tokens_per_gpu]
        args.warmup, args.reps = 1, 1
    return args


def model_config(args, gqa: str) -> llama3.LlamaConfig:
    return llama3.LlamaConfig(vocab=args.vocab, dim=args.dim, layers=args.layers, heads=args.heads,
                              kv_heads=args.kv_heads, ffn=args.ffn, gqa=gqa, vocab_chunks=args.vocab_chunks,
                              rope_theta=10000.0 if args.smoke else 500000.0)


def build(args, gqa: str, device, checkpoint: bool):
    torch.manual_seed(0)
    with torch.device(device):
        model = llama3.Llama(model_config(args, gqa))
    if checkpoint:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        for i, layer in enumerate(model.layers):
            model.layers[i] = checkpoint_wrapper(layer)
    return model


def shard(model, fsdp_mesh, dtype, amp: bool = False):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=None if amp else dtype, reduce_dtype=torch.float32)
    for layer in model.layers:
        fully_shard(layer, mesh=fsdp_mesh, mp_policy=mp)
    fully_shard(model, mesh=fsdp_mesh, mp_policy=mp)
    return model


def autocast(args, env):
    """--amp: the step's forward under torch.autocast(bfloat16); else a context that does nothing."""
    return torch.autocast(env.device.type, torch.bfloat16, enabled=args.amp)


def batch(args, n: int, rows: int, device):
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, args.vocab, (rows, n), generator=gen).to(device)
    return tokens, torch.roll(tokens, -1, dims=1)


# ---------------------------------------------------------------------------------------
# methods: each yields step() -> loss, running one full training step


@contextlib.contextmanager
def ringcc_method(args, env, n: int):
    import ringcc

    model = build(args, "native", env.device, not args.no_checkpoint)
    # FSDP2 averages every gradient over all ranks, the sequence group included: ringcc scales
    # the shares instead of all-reducing them (Note [Gradients under data parallelism]). Each
    # block hands its output to the next as this rank's rows (Note [Sharded outputs under FSDP2]).
    backend = ringcc.backend(ringcc.Config(mesh=env.mesh, axis="cp", inner=args.inner, grad_sync="outer"))
    for layer in model.layers:
        layer.compile(backend=backend)
    compile_head(model.head, backend)
    model = shard(model, env.flat, env.dtype, args.amp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    tokens, labels = batch(args, n * env.cp, env.dp, env.device)
    mine = slice(env.dp_rank, env.dp_rank + 1)
    ringcc.reset_reports()

    def step():
        with autocast(args, env):
            loss = model(tokens[mine], labels[mine])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    yield step, {"reports": lambda: [{"notes": r.notes, "gathers": [f"{g.node} at {g.location}: {g.why}" for g in r.gathers]}
                                     for r in ringcc.reports()]}


@contextlib.contextmanager
def cp_method(args, env, n: int):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from ringcc import _compat

    context_parallel, set_rotate_method, cp_options = _compat.context_parallel_api()
    set_rotate_method(args.cp_rotate)
    if hasattr(cp_options, "enable_load_balance"):
        cp_options.enable_load_balance = True
    model = build(args, "repeat", env.device, not args.no_checkpoint)
    if args.cp_compile != "none":
        for layer in model.layers:
            layer.compile(backend=args.cp_compile)
        model.head.compile(backend=args.cp_compile)
    model = shard(model, env.flat, env.dtype, args.amp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    tokens, labels = batch(args, n * env.cp, env.dp, env.device)
    mine = slice(env.dp_rank, env.dp_rank + 1)
    kernel = SDPBackend.CUDNN_ATTENTION if env.device.type == "cuda" else SDPBackend.MATH

    def step():
        # context_parallel shards its buffers in place (and restores those not listed as
        # no_restore): fresh copies each step, as a data loader would hand them.
        tok, lab = tokens[mine].clone(), labels[mine].clone()
        pos = torch.arange(tok.shape[1], device=env.device)
        with context_parallel(env.mesh["cp"], buffers=[tok, lab, pos], buffer_seq_dims=[1, 1, 0],
                              no_restore_buffers={tok, lab, pos}), sdpa_kernel(kernel), autocast(args, env):
            loss = model(tok, lab, pos)
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    yield step, {"rotate": args.cp_rotate, "compile": args.cp_compile}


@contextlib.contextmanager
def single_method(args, env, n: int):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    model = build(args, "native", env.device, not args.no_checkpoint)
    compiler = "inductor" if env.device.type == "cuda" else "aot_eager"
    for layer in model.layers:
        layer.compile(backend=compiler)
    model.head.compile(backend=compiler)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    tokens, labels = batch(args, n * env.cp, env.dp, env.device)
    kernel = SDPBackend.CUDNN_ATTENTION if env.device.type == "cuda" else SDPBackend.MATH
    # fp32 weights and optimizer state, bf16 compute: what FSDP2's policy (or --amp) does on the others
    mixed = env.device.type == "cuda" or args.amp
    amp = torch.autocast(env.device.type, torch.bfloat16, enabled=mixed)

    def step():
        with sdpa_kernel(kernel), amp:
            loss = model(tokens, labels)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    yield step, {"compute": str(torch.bfloat16 if mixed else env.dtype), "weights": "float32"}


def compile_head(head, backend) -> None:
    """The head's forward compiled with ringcc; it has no attention, so a pre-hook (run eagerly,
    before the compiled forward) marks its input's sequence dim (ringcc.mark_sequence)."""
    import ringcc

    head.register_forward_pre_hook(lambda module, args: (ringcc.mark_sequence(args[0], 1), *args[1:]))
    head.forward = torch.compile(head.forward, backend=backend)


FACTORIES = {"ringcc": ringcc_method, "cp": cp_method, "single": single_method}


# ---------------------------------------------------------------------------------------
# measurement


@dataclasses.dataclass
class Env:
    device: torch.device
    dtype: torch.dtype
    world: int
    dp: int
    cp: int
    dp_rank: int
    mesh: object  # DeviceMesh (dp, cp)
    flat: object  # DeviceMesh over all ranks (FSDP2's)


def make_env(args) -> Env:
    from torch.distributed.device_mesh import init_device_mesh

    device, dtype = dist_setup.start(args.smoke)
    world = dist.get_world_size()
    if world % args.dp:
        raise ValueError(f"--dp {args.dp} does not divide the {world} launched ranks")
    mesh = init_device_mesh(device.type, (args.dp, world // args.dp), mesh_dim_names=("dp", "cp"))
    flat = init_device_mesh(device.type, (world,), mesh_dim_names=("dp_cp",))
    return Env(device, dtype, world, args.dp, world // args.dp, mesh["dp"].get_local_rank(), mesh, flat)


def classify(name: str) -> str:
    n = name.lower()
    if any(s in n for s in ("nccl", "memcpy ptop", "memcpy peer", "all_gather", "allgather", "reduce_scatter",
                            "allreduce", "sendrecv")):
        return "collectives"
    if any(s in n for s in ("sdpa", "fmha", "flash", "cudnn", "attention")):
        return "attention"
    return "other"


def profile_step(step, device) -> dict:
    """GPU time of one step by kind (ms), from torch.profiler's kernel and copy events."""
    if device.type != "cuda":
        return {}
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    out = {"attention": 0.0, "collectives": 0.0, "other": 0.0}
    for e in prof.key_averages():  # kernels and copies, by name (only CUDA activity is recorded)
        us = getattr(e, "self_device_time_total", None)
        us = getattr(e, "self_cuda_time_total", 0) if us is None else us
        out[classify(e.key)] += us / 1e3
    return out


def run_cell(method: str, args, env: Env, n: int) -> dict:
    """One method at n tokens per GPU: warm-up, timed steps, peak memory, one profiled step."""
    rank = dist.get_rank()
    active = method != "single" or rank == 0
    rec: dict = {"method": method, "tokens_per_gpu": n, "status": "ok"}
    rec["tokens_per_step"] = n * env.world  # dp sequences of n * cp tokens (one GPU: the same batch)
    result = None
    if active:
        torch.compiler.reset()  # every cell compiles afresh, at its own static shapes
        try:
            with FACTORIES[method](args, env, n) as (step, notes):
                for _ in range(args.warmup):
                    step()
                if env.device.type == "cuda":
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                losses = []

                def logged():
                    losses.append(step())

                ms = [dist_setup.timed(logged, env.device, barrier=method != "single") for _ in range(args.reps)]
                peak = torch.cuda.max_memory_allocated() if env.device.type == "cuda" else None
                loss = float(losses[-1].detach())
                kinds = {} if args.no_profile else profile_step(step, env.device)
                result = {"ms_steps": ms, "peak_bytes": peak, "loss": loss, "kinds_ms": kinds,
                          "notes": {k: (v() if callable(v) else v) for k, v in notes.items()}}
        except torch.OutOfMemoryError as e:
            result = {"status": "OOM", "error": str(e).splitlines()[0]}
        finally:
            gc.collect()
            if env.device.type == "cuda":
                torch.cuda.empty_cache()
    results: list = [None] * env.world
    dist.all_gather_object(results, result)
    results = [r for r in results if r is not None]
    if any(r.get("status") == "OOM" for r in results):
        rec.update(status="OOM", error=next(r["error"] for r in results if r.get("status") == "OOM"))
        return rec
    slowest = [max(r["ms_steps"][i] for r in results) for i in range(args.reps)]
    ms = statistics.median(slowest)
    rec.update(ms=ms, ms_steps=slowest, tokens_per_s=rec["tokens_per_step"] / (ms * 1e-3),
               peak_bytes_per_rank=[r["peak_bytes"] for r in results], loss=results[0]["loss"],
               notes=results[0]["notes"])
    kinds = results[0]["kinds_ms"]
    if kinds:
        rec["kinds_ms"] = kinds
        rec["shares"] = {k: v / ms for k, v in kinds.items()}
    return rec


def table(records: list[dict]) -> str:
    head = f"{'method':8} {'tok/GPU':>8} {'tokens/s':>11} {'ms/step':>9} {'peak GiB (max rank)':>20} " \
           f"{'attn':>6} {'coll':>6} {'other':>6}  {'vs cp':>6} {'vs 1 GPU':>8}"
    lines = [head, "-" * len(head)]
    cp = {r["tokens_per_gpu"]: r for r in records if r["method"] == "cp" and r["status"] == "ok"}
    one = {r["tokens_per_gpu"]: r for r in records if r["method"] == "single" and r["status"] == "ok"}
    for r in records:
        if r["status"] != "ok":
            lines.append(f"{r['method']:8} {r['tokens_per_gpu']:>8} {r['status']:>11}")
            continue
        peaks = [p for p in r["peak_bytes_per_rank"] if p is not None]
        peak = f"{max(peaks) / 2**30:.2f}" if peaks else "-"
        sh = r.get("shares", {})
        shares = " ".join(f"{sh[k]:6.2f}" if k in sh else f"{'-':>6}" for k in ("attention", "collectives", "other"))
        vs = [f"{r['tokens_per_s'] / base[r['tokens_per_gpu']]['tokens_per_s']:.2f}x"
              if r["tokens_per_gpu"] in base else "-" for base in (cp, one)]
        lines.append(f"{r['method']:8} {r['tokens_per_gpu']:>8} {r['tokens_per_s']:>11.0f} {r['ms']:>9.1f} "
                     f"{peak:>20} {shares}  {vs[0]:>6} {vs[1]:>8}")
    return "\n".join(lines)


def main(argv=None) -> None:
    from ringcc import _compat

    args = parse_args(argv)
    _compat.raise_recompile_limit(4 * args.layers)  # never an eager fallback for some of the blocks
    methods = [m for m in args.methods.split(",") if m]
    unknown = sorted(set(methods) - set(METHODS))
    if unknown:
        raise ValueError(f"--methods {unknown} unknown; choose from {list(METHODS)}")
    env = make_env(args)
    records = []
    for n in args.tokens_per_gpu:
        for method in methods:
            if method == "cp" and env.device.type != "cuda":
                records.append({"method": "cp", "tokens_per_gpu": n, "status": "skipped (causal context parallel needs CUDA)"})
                continue
            records.append(run_cell(method, args, env, n))
    info = None
    if dist.get_rank() == 0:
        print(table(records))
        device = f"{env.world} x {torch.cuda.get_device_name()}" if env.device.type == "cuda" else "cpu (smoke, gloo)"
        info = {"device": device, "torch": torch.__version__, "world": env.world, "dp": env.dp,
                "model": dataclasses.asdict(model_config(args, "native")), "checkpoint": not args.no_checkpoint,
                "amp": args.amp,
                "warmup": args.warmup, "reps": args.reps, "records": records}
    dist_setup.finish(info, args.json)


if __name__ == "__main__":
    main()
