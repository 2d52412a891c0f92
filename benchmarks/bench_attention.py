"""Attention benchmark: single-GPU kernels, PyTorch context parallel and ringcc, side by side.

Everything (one launcher: one torchrun per world size, then the report; see README.md):
    python benchmarks/bench_attention.py --worlds 1,4,2 --out OUT --max-minutes 11
One world size (what the launcher runs; writes a part file):
    torchrun --nproc-per-node 4 benchmarks/bench_attention.py phase --part part_p4.json
One max-length probe (what the launcher runs per probe, with probe_settings' environment):
    torchrun --nproc-per-node 4 benchmarks/bench_attention.py probe --method ring-zigzag --probe-n 786432 \
        --maxlen-cap-gib 8 --part probe.json
Report (table, JSON, plots, RESULTS.md section) from saved results:
    python benchmarks/bench_attention.py report OUT/results.json --out OUT --results-md benchmarks/RESULTS.md
CPU smoke (gloo, fp32, tiny sizes; what CI runs):
    python benchmarks/bench_attention.py --smoke --out OUT
A score-modified attention layer (--score-mod softcap: Gemma2's c * tanh(s / c), c = 50;
alibi: ALiBi slopes 2^(-8 (i + 1) / h)): the ring against the single-GPU kernel of the same
variant, flex_attention with the same score_mod (the baseline of its efficiency column); the
other methods take no modifier and are skipped. 16K and 64K tokens per GPU on 4 GPUs:
    python benchmarks/bench_attention.py --score-mod softcap --worlds 1,4 --lengths 65536,262144 \
        --methods flex,ring-zigzag,ring-contiguous --out OUT_SOFTCAP

Legend: tensors are [b, heads, n_local, d]; n is the total (global) length, p the world size,
n_local = n / p. "mha" is h = h_kv = 16; "gqa" is h = 32, h_kv = 8; d = 128, b = 1, bf16.

Note [Benchmark metrics]
- time: median over the timed iterations, with CUDA events (perf_counter on CPU); an
  iteration's time is the slowest rank's. Warm-up is excluded: the memory run (below) is the
  first warm-up, cheap cells get one more. Two timings per cell:
  - "from idle" (ms, TF/s, eff): each iteration starts after a barrier and a wait for the GPU,
    so it pays the host's latency to its first kernel and the GPU's start from idle (on 1 x
    H200, 11% of a 28 ms single-GPU step): a fixed cost that
    weighs more on short per-GPU steps. About --target-seconds of iterations, at most --reps, at
    least 3 in cells of up to MEDIAN_OF_3_MAX_S seconds.
  - "back to back" (b2b ms, b2b eff): after one barrier and an untimed lead iteration, the
    iterations are issued without waits, as a layer runs inside a model (the host ahead, the
    GPU never idle between them; triton.testing.do_bench times kernels this way). At least 3
    iterations, in cells of at most BACK_TO_BACK_MAX_S seconds per iteration (longer ones lose
    little from idle; their b2b columns stay empty).
  The targets are checked under both timings.
- FLOPs: 4*b*h*n^2*d per forward (h = query heads), halved when causal, x3.5 for forward +
  backward. Dilated attention counts its own: sum_i 4*b*h*n*w_i*d / r_i^2 (halved when causal).
  TFLOP/s per GPU = FLOPs / p / time.
- efficiency: per-GPU TFLOP/s over single-GPU cuDNN SDPA's at the same total length, heads,
  mask and mode (computed in the report, across the per-world runs of one launch).
- peak memory per rank: max_memory_allocated during one iteration (after a reset) minus what
  was allocated before it, plus this rank's input bytes (q, k, v, and dout for fwd+bwd; also
  reported alone). Setup leftovers (context parallel keeps its sharded buffers' full-length
  storage) are not counted, so every method is measured the same way. Largest over ranks.
- bytes communicated per rank per iteration: ringcc measured (RingComm.bytes_sent during the
  memory run); context parallel from its schedule (K/V all-gather or all-to-all ring, dK/dV in
  fp32 around the ring in backward), marked "model".
- largest length (MHA causal fwd+bwd): after the phases, per method of --maxlen-methods, world
  size and --maxlen-allocators setting, one torchrun job per probe (Note [Max-length probes]):
  from the largest measured length, each next length is where a line fitted to the probes'
  allocated peaks reaches the capacity (inside the bracket), else doubling / bisection, to a
  step of 2p * 1024 tokens, until an OOM brackets it. Probes cost O(n^2) time, so a probe whose
  estimated time exceeds --probe-seconds (or the budget) is not run and the result is a lower
  bound; a probe that fails otherwise, times out, or reserves past the cap ends its search. The
  report adds a model estimate from the measured cells' peaks (peak = a + b*n per method).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import functools
import gc
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

import dist_setup

T0 = time.monotonic()
HERE = Path(__file__).resolve().parent
GiB, MiB = 2**30, 2**20
B = 1
BASELINE = "sdpa-cudnn"  # efficiency and ideal memory are relative to it (sdpa-math in smoke mode)
RESULTS_BEGIN = "<!-- bench_attention:begin -->"
RESULTS_END = "<!-- bench_attention:end -->"


# ---------------------------------------------------------------------------------------
# settings


def _ints(text: str) -> list[int]:
    return [int(x) for x in str(text).split(",") if x]


def _names(text: str) -> list[str]:
    return [x for x in str(text).split(",") if x]


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", nargs="?", default="all", choices=["all", "phase", "probe", "report"],
                    help="all: launch one torchrun per world size, the max-length probes, then report "
                         "(default); phase: run under torchrun for its world size; probe: one max-length "
                         "probe under torchrun (--method, --probe-n); report: from saved JSON")
    ap.add_argument("inputs", nargs="*", help="report: results.json or part files")
    ap.add_argument("--smoke", action="store_true", help="CPU/gloo, fp32, tiny sizes (CI)")
    ap.add_argument("--score-mod", default="none", choices=list(SCORE_MODS),
                    help="score modifier of every cell: none, softcap (c = 50) or alibi (see the docstring)")
    ap.add_argument("--worlds", default=None, help="world sizes to launch, in order (default 1,4,2; smoke 1,2)")
    ap.add_argument("--lengths", default=None, help="total lengths of the dense cells (default 65536,262144,1048576)")
    ap.add_argument("--dilated-lengths", default=None, help="total lengths of the dilated cells (default 262144,1048576,4194304)")
    ap.add_argument("--dilated-base", type=int, default=None, help="LongNet first segment (default 2048; smoke 32)")
    ap.add_argument("--attn", default="mha,gqa", help="mha (h=16) and/or gqa (h=32, h_kv=8)")
    ap.add_argument("--causal", default="both", choices=["both", "causal", "noncausal"])
    ap.add_argument("--methods", default="all", help="comma list of method names (see --list)")
    ap.add_argument("--p1-methods", default="all",
                    help="comma list: the only methods of the p = 1 phase (e.g. the single-GPU baselines)")
    ap.add_argument("--modes", default="fwdbwd,fwd", help="fwdbwd and/or fwd")
    ap.add_argument("--list", action="store_true", help="print the methods and exit")
    ap.add_argument("--max-minutes", type=float, default=11.0, help="wall-clock budget (launcher: all phases)")
    ap.add_argument("--reps", type=int, default=None, help="most timed iterations per cell and mode (default 5; smoke 2)")
    ap.add_argument("--target-seconds", type=float, default=2.5, help="timed work per cell and mode")
    ap.add_argument("--max-iter-seconds", type=float, default=8.0,
                    help="a mode whose estimated iteration is longer is not run")
    ap.add_argument("--maxlen-methods", default="sdpa-cudnn,ring-zigzag,cp-cudnn-alltoall",
                    help="launcher: methods whose largest length is searched after the phases (MHA, causal, "
                         "fwd+bwd; one torchrun job per probe); '' for none")
    ap.add_argument("--probe-seconds", type=float, default=15.0, help="longest estimated single probe")
    ap.add_argument("--maxlen-allocators", default="default",
                    help="comma list of allocator settings the max-length search runs under, each for every p: "
                         + ", ".join(f"{k} ({v or 'PyTorch default'})" for k, v in ALLOCATORS.items()))
    ap.add_argument("--maxlen-probes", type=int, default=8, help="most probes per max-length search")
    ap.add_argument("--maxlen-minutes", type=float, default=4.0,
                    help="launcher: part of --max-minutes kept for the max-length probes (after the phases)")
    ap.add_argument("--method", default=None, help="probe: the method")
    ap.add_argument("--probe-n", type=int, default=0, help="probe: the total length")
    ap.add_argument("--maxlen-cap-gib", type=float, default=0.0,
                    help="search the largest length under this per-GPU allocator cap (GiB; 0 = the whole "
                         "device), the same for every p: keeps O(n^2) probes short")
    ap.add_argument("--trace-dir", default=None,
                    help="where profiled cells keep rank 0's chrome trace (gzipped; benchmarks/timeline.py reads it)")
    ap.add_argument("--profile", default="", help="METHOD@N,...: also profile one iteration of those cells "
                    "(top kernels by device time, rank 0, into the log and the JSON)")
    ap.add_argument("--out", default="bench_out", help="report folder (results.json, table.txt, PNGs, RESULTS.md)")
    ap.add_argument("--work-dir", default=None, help="part files of the phases (default: a temp folder)")
    ap.add_argument("--part", default=None, help="phase: where to write this world size's results")
    ap.add_argument("--results-md", default=None, help="also update this RESULTS.md in place (its bench section)")
    ap.add_argument("--nccl-timeout", type=int, default=120, help="seconds before a stuck collective fails")
    return ap


def finish_args(args) -> argparse.Namespace:
    """Fill the defaults that depend on --smoke."""
    smoke = args.smoke
    args.worlds = _ints(args.worlds or ("1,2" if smoke else "1,4,2"))
    args.lengths = _ints(args.lengths or ("256,512" if smoke else "65536,262144,1048576"))
    args.dilated_lengths = _ints(args.dilated_lengths or ("256,512" if smoke else "262144,1048576,4194304"))
    args.dilated_base = args.dilated_base or (32 if smoke else 2048)
    args.reps = args.reps or (2 if smoke else 5)
    args.attn = _names(args.attn)
    args.causals = {"both": [True, False], "causal": [True], "noncausal": [False]}[args.causal]
    args.modes = _names(args.modes)
    args.maxlen_methods = _names(args.maxlen_methods)
    args.maxlen_allocators = _names(args.maxlen_allocators)
    if any(a not in ALLOCATORS for a in args.maxlen_allocators):
        raise SystemExit(f"unknown --maxlen-allocators {args.maxlen_allocators}; available: {', '.join(ALLOCATORS)}")
    args.profile_cells = {(m, int(n)) for m, n in (x.split("@") for x in _names(args.profile))}
    bad = [m for m in args.modes if m not in ("fwdbwd", "fwd")] + [a for a in args.attn if a not in ("mha", "gqa")]
    if bad:
        raise SystemExit(f"unknown mode/attn {bad}; modes: fwdbwd, fwd; attn: mha, gqa")
    if args.command == "probe" and (args.method not in METHODS or args.probe_n <= 0 or not args.part):
        raise SystemExit(f"probe needs --method (one of {', '.join(METHODS)}; got {args.method!r}), "
                         f"--probe-n > 0 (got {args.probe_n}) and --part")
    names = list(METHODS) if args.methods == "all" else _names(args.methods)
    unknown = [m for m in names if m not in METHODS]
    if unknown:
        raise SystemExit(f"unknown methods {unknown}; available: {', '.join(METHODS)}")
    args.method_names = names
    args.p1_method_names = None if args.p1_methods == "all" else _names(args.p1_methods)
    return args


# ---------------------------------------------------------------------------------------
# the process group and device of one phase


class Env:
    def __init__(self, args):
        self.args = args
        self.smoke = args.smoke
        local = int(os.environ.get("LOCAL_RANK", "0"))
        if self.smoke:
            self.device = torch.device("cpu")
            backend = "gloo"
        else:
            if not torch.cuda.is_available():
                raise SystemExit("no CUDA device: run with --smoke on CPU")
            torch.cuda.set_device(local)
            self.device = torch.device("cuda", local)
            backend = "nccl"
        # NVLink multicast stays off on the lent machines (run_gpu.sh sets it; direct runs too).
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        if "RANK" in os.environ and not dist.is_initialized():
            pg_options = None
            if backend == "nccl" and os.environ.get("BENCH_NCCL_HIGH_PRIORITY") == "1":
                # NCCL kernels on a high-priority stream get SMs ahead of queued attention CTAs,
                # so ring transfers are not starved by the compute they should overlap.
                pg_options = dist.ProcessGroupNCCL.Options(is_high_priority_stream=True)
            dist.init_process_group(backend, timeout=datetime.timedelta(seconds=args.nccl_timeout),
                                    pg_options=pg_options)
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.cuda = self.device.type == "cuda"
        self.dtype = torch.float32 if self.smoke else torch.bfloat16
        self.d = 16 if self.smoke else 128
        self.heads = {"mha": (2, 2), "gqa": (4, 2)} if self.smoke else {"mha": (16, 16), "gqa": (32, 8)}
        self.deadline = T0 + 60.0 * args.max_minutes
        self.rates: dict[tuple[str, str], float] = {}  # (method, mode) -> measured FLOP/s per GPU
        self._mesh = None

    # Collectives on small tensors; every rank calls them in the same order.
    def _reduce(self, values: list[float], op) -> list[float]:
        if self.world == 1:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=op)
        return t.tolist()

    def all_max(self, values: list[float]) -> list[float]:
        return self._reduce(values, dist.ReduceOp.MAX)

    def agree(self, flag: bool) -> bool:
        """True only if every rank says True (so all ranks take the same branch)."""
        return bool(self._reduce([1.0 if flag else 0.0], dist.ReduceOp.MIN)[0])

    def barrier(self) -> None:
        self._reduce([0.0], dist.ReduceOp.MAX)
        if self.cuda:
            torch.cuda.synchronize()

    def mesh(self):
        if self._mesh is None:
            from torch.distributed.device_mesh import init_device_mesh

            self._mesh = init_device_mesh(self.device.type, (self.world,))
        return self._mesh

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def log(self, msg: str) -> None:
        if self.rank == 0:
            print(f"[p={self.world} {time.monotonic() - T0:6.1f}s] {msg}", flush=True)

    def meta(self) -> dict:
        m = {
            "world": self.world, "torch": torch.__version__, "python": sys.version.split()[0],
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "smoke": self.smoke, "dtype": str(self.dtype).replace("torch.", ""), "d": self.d, "b": B,
            "heads": self.heads, "argv": sys.argv[1:], "host": socket.gethostname(),
            "score_mod": self.args.score_mod,
            "env": {k: os.environ.get(k) for k in ("NCCL_NVLS_ENABLE", "RINGCC_CUDA_KERNEL", "RINGCC_RING_WORKSPACE_MIB",
                                                   "NCCL_CTA_POLICY", "NCCL_MIN_CTAS", "NCCL_MAX_CTAS")},
        }
        try:
            import ringcc

            m["ringcc"] = ringcc.__version__
        except Exception as e:  # noqa: BLE001 - recorded, the phase still runs its other methods
            m["ringcc"] = f"not importable: {e}"
        m["commit"] = source_commit()
        if self.cuda:
            props = torch.cuda.get_device_properties(self.device)
            m.update(device=torch.cuda.get_device_name(self.device), device_total_memory=props.total_memory,
                     gpus_visible=torch.cuda.device_count(), cuda=torch.version.cuda)
            with contextlib.suppress(Exception):
                m["nccl"] = ".".join(str(x) for x in torch.cuda.nccl.version())
        else:
            m.update(device="cpu", device_total_memory=None)
        return m


# ---------------------------------------------------------------------------------------
# methods: each is a context manager (cell, env) -> Bench; the table METHODS names them


@dataclasses.dataclass(frozen=True)
class Cell:
    method: str
    attn: str
    causal: bool
    n: int
    p: int


@dataclasses.dataclass
class Bench:
    """One method set up for one cell: `attn()` returns this rank's output."""

    attn: Callable
    q: object
    k: object
    v: object
    dout: object
    notes: dict
    comm_model: Callable[[bool], int] | None = None  # bytes per rank per iteration, when not measured

    def step(self, backward: bool) -> None:
        if backward:
            out = self.attn()
            torch.autograd.grad(out, (self.q, self.k, self.v), self.dout)
        else:
            with torch.no_grad():
                self.attn()

    def input_bytes(self, backward: bool) -> int:
        ts = (self.q, self.k, self.v) + ((self.dout,) if backward else ())
        return sum(t.numel() * t.element_size() for t in ts)


def make_inputs(env: Env, cell: Cell, n_local: int):
    h, h_kv = env.heads[cell.attn]
    gen = torch.Generator(device=env.device).manual_seed(1234 + env.rank)

    def rand(heads, grad):
        t = torch.randn(B, heads, n_local, env.d, device=env.device, dtype=env.dtype, generator=gen)
        return t.requires_grad_(grad)

    return rand(h, True), rand(h_kv, True), rand(h_kv, True), rand(h, False)


def _sdpa_backend(kernel: str):
    from torch.nn.attention import SDPBackend

    return {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION, "math": SDPBackend.MATH}[kernel]


@functools.lru_cache(maxsize=None)
def _native_gqa(kernel: str, device: str, dtype_name: str) -> bool:
    """Whether SDPA with this backend takes K/V with fewer heads (enable_gqa) on this device."""
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    dtype = getattr(torch, dtype_name)
    q = torch.randn(1, 4, 256, 64 if device == "cpu" else 128, device=device, dtype=dtype)
    k = torch.randn(1, 2, 256, q.shape[-1], device=device, dtype=dtype)
    try:
        with sdpa_kernel(_sdpa_backend(kernel)):
            F.scaled_dot_product_attention(q, k, k, is_causal=True, enable_gqa=True)
        return True
    except RuntimeError:
        return False


GQA_EXPANDED = "K/V expanded to h heads (backend rejects enable_gqa)"


def _sdpa_call(kernel: str, env: Env, h: int, h_kv: int):
    """(fn(q, k, v, causal), note): SDPA with GQA native where the backend takes it, else K/V
    expanded to h heads first (what a user of that backend has to do; it is timed)."""
    import torch.nn.functional as F

    if h == h_kv:
        return (lambda q, k, v, c: F.scaled_dot_product_attention(q, k, v, is_causal=c)), "mha"
    if _native_gqa(kernel, env.device.type, str(env.dtype).replace("torch.", "")):
        return (lambda q, k, v, c: F.scaled_dot_product_attention(q, k, v, is_causal=c, enable_gqa=True)), "native enable_gqa"
    rep = h // h_kv
    return (
        lambda q, k, v, c: F.scaled_dot_product_attention(
            q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), is_causal=c)
    ), GQA_EXPANDED


def sdpa_method(kernel: str):
    @contextlib.contextmanager
    def make(cell: Cell, env: Env):
        from torch.nn.attention import sdpa_kernel

        q, k, v, dout = make_inputs(env, cell, cell.n)
        call, gqa = _sdpa_call(kernel, env, q.shape[1], k.shape[1])
        with sdpa_kernel(_sdpa_backend(kernel)):
            yield Bench(lambda: call(q, k, v, cell.causal), q, k, v, dout, {"kernel": kernel, "gqa": gqa})

    return make


def _causal_mod(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


# --score-mod: what ringcc.ring_attention takes, and flex_attention's score_mod of the same
# modifier (a score function: Note [Score functions] in runtime/maskfn.py).
SOFTCAP = 50.0  # Gemma2's attention-logit cap
SCORE_MODS = ("none", "softcap", "alibi")


def alibi_slopes(h: int, device) -> torch.Tensor:
    """ALiBi's slopes for h heads (a power of two): 2^(-8 (i + 1) / h)."""
    return torch.tensor([2.0 ** (-8.0 * (i + 1) / h) for i in range(h)], device=device)


def ring_mod_args(env: Env, h: int) -> dict:
    kind = env.args.score_mod
    if kind == "softcap":
        return {"softcap": SOFTCAP}
    if kind == "alibi":
        return {"alibi_slopes": alibi_slopes(h, env.device)}
    return {}


def flex_score_mod(env: Env, h: int):
    kind = env.args.score_mod
    if kind == "softcap":
        return lambda s, b, hh, i, j: torch.tanh(s / SOFTCAP) * SOFTCAP
    if kind == "alibi":
        slopes = alibi_slopes(h, env.device)
        return lambda s, b, hh, i, j: s + slopes[hh] * (j - i).to(torch.float32)
    return None


@functools.lru_cache(maxsize=None)
def _compiled_flex():
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    from ringcc import _compat

    _compat.raise_recompile_limit(64)  # one variant per shape and mask
    # create_block_mask uncompiled materialises an n x n mask: compile it too.
    return torch.compile(flex_attention, dynamic=False), torch.compile(create_block_mask, dynamic=False)


@contextlib.contextmanager
def flex_method(cell: Cell, env: Env):
    flex, block_mask_fn = _compiled_flex()
    q, k, v, dout = make_inputs(env, cell, cell.n)
    mask = block_mask_fn(_causal_mod, None, None, cell.n, cell.n, device=env.device) if cell.causal else None
    gqa = q.shape[1] != k.shape[1]
    mod = flex_score_mod(env, q.shape[1])
    yield Bench(lambda: flex(q, k, v, score_mod=mod, block_mask=mask, enable_gqa=gqa), q, k, v, dout,
                {"kernel": "flex_attention (torch.compile)", "gqa": "native enable_gqa" if gqa else "mha",
                 "score_mod": env.args.score_mod})


def cp_comm_bytes(cell: Cell, h_kv: int, d: int, elt: int, backward: bool) -> int:
    """Bytes one rank sends per iteration in torch context parallel's schedule: K/V reach the
    p - 1 other ranks (all-gather or all-to-all ring alike); backward sends K/V again and rotates
    dK/dV in fp32 p times (convert_to_f32)."""
    shard = B * h_kv * (cell.n // cell.p) * d
    fwd = (cell.p - 1) * 2 * shard * elt
    return fwd if not backward else 2 * fwd + cell.p * 2 * shard * 4


def cp_method(kernel: str, rotate: str):
    @contextlib.contextmanager
    def make(cell: Cell, env: Env):
        from torch.nn.attention import sdpa_kernel

        from ringcc import _compat

        context_parallel, set_rotate_method, cp_options = _compat.context_parallel_api()
        h, h_kv = env.heads[cell.attn]
        call, gqa = _sdpa_call(kernel, env, h, h_kv)  # probe outside the patched SDPA
        old_rotate = getattr(cp_options, "rotate_method", None)
        lb_field = "enable_load_balance" if hasattr(cp_options, "enable_load_balance") else None
        old_lb = getattr(cp_options, lb_field) if lb_field else None
        set_rotate_method(rotate)
        if lb_field:
            # Its head-tail balancer rejects non-causal attention: off there, on for causal.
            setattr(cp_options, lb_field, cell.causal)
        # context_parallel shards the buffers it is given and sizes its load balancer from the
        # first one; a position buffer of length n does both without full-length q/k/v copies.
        # Local q/k/v are then made at n/p directly (values do not matter for timing).
        positions = torch.arange(cell.n, device=env.device)
        try:
            with context_parallel(env.mesh(), buffers=[positions], buffer_seq_dims=[0],
                                  no_restore_buffers={positions}), sdpa_kernel(_sdpa_backend(kernel)):
                notes = {"kernel": kernel, "rotate": rotate, "gqa": gqa,
                         "load_balance": getattr(cp_options, lb_field) if lb_field else "no enable_load_balance option"}
                q, k, v, dout = make_inputs(env, cell, cell.n // cell.p)
                h_kv_sent = h if gqa == GQA_EXPANDED else h_kv
                yield Bench(lambda: call(q, k, v, cell.causal), q, k, v, dout, notes,
                            comm_model=lambda bwd: cp_comm_bytes(cell, h_kv_sent, env.d, q.element_size(), bwd))
        finally:
            if old_rotate is not None:
                cp_options.rotate_method = old_rotate
            if lb_field:
                setattr(cp_options, lb_field, old_lb)

    return make


def ring_method(layout: str, skip_comm: bool, whole_heads: bool = False, transport: str | None = None,
                graphs: str | None = None):
    @contextlib.contextmanager
    def make(cell: Cell, env: Env):
        import ringcc
        from ringcc.runtime import workspace

        # Read by ringcc.runtime at each call: same schedule with transfers skipped; the
        # head-chunk budget (0 = all heads in one ring, the pre-chunking schedule); the transport.
        budget = "0" if whole_heads else os.environ.get("RINGCC_RING_WORKSPACE_MIB", "auto")
        transport_ = transport or os.environ.get("RINGCC_RING_TRANSPORT", "auto")
        graphs_ = graphs or os.environ.get("RINGCC_RING_GRAPHS", "auto")
        with dist_setup.env_var("RINGCC_SKIP_COMM", "1" if skip_comm else "0"), dist_setup.env_var("RINGCC_RING_WORKSPACE_MIB", budget), \
                dist_setup.env_var("RINGCC_RING_TRANSPORT", transport_), dist_setup.env_var("RINGCC_RING_GRAPHS", graphs_):
            q, k, v, dout = make_inputs(env, cell, cell.n // cell.p)
            zz = cell.causal and layout == "zigzag"
            notes = {"layout": layout, "kernel": os.environ.get("RINGCC_CUDA_KERNEL", "cudnn") if env.cuda else "cpu flash",
                     "workspace_mib": budget, "transport": transport_, "graphs": graphs_,
                     "kv_heads_per_chunk": workspace.ring_kv_chunk(q, k, None, cell.p, zz) or k.shape[1],
                     "kv_heads_per_chunk_fwd": workspace.ring_kv_chunk(q, k, None, cell.p, zz, forward=True) or k.shape[1],
                     "score_mod": env.args.score_mod}
            mods = ring_mod_args(env, q.shape[1])
            yield Bench(lambda: ringcc.ring_attention(q, k, v, is_causal=cell.causal, layout=layout, **mods), q, k, v,
                        dout, notes)

    return make


def longnet_schedule(n: int, base: int) -> tuple[list[int], list[int]]:
    """LongNet: w_i = base * 4^i, r_i = 2^i; the last segment is clipped to n (w = n covers the
    whole sequence, sparsely)."""
    ws, rs = [], []
    w, r = base, 1
    while True:
        ws.append(min(w, n))
        rs.append(r)
        if w >= n:
            return ws, rs
        w, r = 4 * w, 2 * r


def dilated_available() -> str | None:
    """None when ringcc.dilated_attention is importable, else why not."""
    try:
        import ringcc

        ringcc.DilatedSpec, ringcc.dilated_attention  # noqa: B018
        return None
    except (ImportError, AttributeError) as e:
        return f"ringcc.dilated_attention not importable ({e})"


@contextlib.contextmanager
def dilated_method(cell: Cell, env: Env):
    import ringcc

    ws, rs = longnet_schedule(cell.n, env.args.dilated_base)
    spec = ringcc.DilatedSpec(ws, rs)
    q, k, v, dout = make_inputs(env, cell, cell.n // cell.p)
    notes = {"layout": "contiguous", "segment_lengths": ws, "dilation_rates": rs}
    yield Bench(lambda: ringcc.dilated_attention(q, k, v, spec, is_causal=cell.causal, layout="contiguous"),
                q, k, v, dout, notes)


@dataclasses.dataclass(frozen=True)
class Method:
    make: Callable
    family: str  # single | cp | ring | ring-nocomm | dilated
    worlds: str  # "1": single device only; "multi": p >= 2; "any"
    cpu: bool  # runs in the CPU smoke mode
    gpu: bool = True
    setup_s: float = 0.0  # budgeted per cell on top of the iterations (compilation)


METHODS: dict[str, Method] = {
    "sdpa-cudnn": Method(sdpa_method("cudnn"), "single", "1", cpu=False),
    "sdpa-flash": Method(sdpa_method("flash"), "single", "1", cpu=False),
    "flex": Method(flex_method, "single", "1", cpu=False, setup_s=40.0),
    "sdpa-math": Method(sdpa_method("math"), "single", "1", cpu=True, gpu=False),
    "cp-cudnn-allgather": Method(cp_method("cudnn", "allgather"), "cp", "multi", cpu=False),
    "cp-cudnn-alltoall": Method(cp_method("cudnn", "alltoall"), "cp", "multi", cpu=False),
    "cp-flash-allgather": Method(cp_method("flash", "allgather"), "cp", "multi", cpu=False),
    "cp-flash-alltoall": Method(cp_method("flash", "alltoall"), "cp", "multi", cpu=False),
    "ring-zigzag": Method(ring_method("zigzag", False), "ring", "any", cpu=True),
    "ring-contiguous": Method(ring_method("contiguous", False), "ring", "any", cpu=True),
    "ring-zigzag-whole": Method(ring_method("zigzag", False, True), "ring", "multi", cpu=True),
    "ring-contiguous-whole": Method(ring_method("contiguous", False, True), "ring", "multi", cpu=True),
    # The same ring with its transfers through NCCL send/recv (the default on GPU is the
    # copy-engine ring where symmetric memory works: runtime/comm.py).
    "ring-zigzag-nccl": Method(ring_method("zigzag", False, transport="nccl"), "ring", "multi", cpu=True),
    "ring-contiguous-nccl": Method(ring_method("contiguous", False, transport="nccl"), "ring", "multi", cpu=True),
    # The same ring never replayed from CUDA graphs (the default captures short shards:
    # Note [Ring graphs] in runtime/graphs.py).
    "ring-zigzag-nographs": Method(ring_method("zigzag", False, graphs="off"), "ring", "multi", cpu=True),
    # Every call replayed from CUDA graphs: on the copy-engine ring, and on NCCL send/recv.
    "ring-zigzag-graphs": Method(ring_method("zigzag", False, graphs="on"), "ring", "multi", cpu=True),
    "ring-zigzag-graphs-nccl": Method(ring_method("zigzag", False, transport="nccl", graphs="on"), "ring", "multi",
                                      cpu=True),
    "ring-zigzag-nocomm": Method(ring_method("zigzag", True), "ring-nocomm", "multi", cpu=True),
    "ring-contiguous-nocomm": Method(ring_method("contiguous", True), "ring-nocomm", "multi", cpu=True),
    "dilated": Method(dilated_method, "dilated", "any", cpu=True),
}
FAMILY_ORDER = ["single", "cp", "ring", "ring-nocomm", "dilated"]


def headline_ring(causal: bool) -> str:
    """ringcc's method for the targets: zigzag balances causal work; contiguous otherwise."""
    return "ring-zigzag" if causal else "ring-contiguous"


def skip_reason(cell: Cell, env: Env) -> str | None:
    m = METHODS[cell.method]
    if m.worlds == "1" and cell.p != 1:
        return "single-device method"
    if m.worlds == "multi" and cell.p == 1:
        return "needs p >= 2"
    if env.smoke and not m.cpu:
        return "CPU" if m.family == "cp" else "GPU only"
    if not env.smoke and not m.gpu:
        return "CPU smoke only"
    if cell.n % (2 * cell.p):
        return f"n={cell.n} not divisible by 2p={2 * cell.p}"
    if env.args.score_mod != "none" and m.family not in ("ring", "ring-nocomm") and cell.method != "flex":
        return f"takes no score modifier (--score-mod {env.args.score_mod})"
    if m.family == "dilated":
        return dilated_available()
    return None


# ---------------------------------------------------------------------------------------
# FLOPs, bytes, timing, memory


def cell_flops(cell: Cell, env: Env, backward: bool) -> float:
    h = env.heads[cell.attn][0]
    if METHODS[cell.method].family == "dilated":
        ws, rs = longnet_schedule(cell.n, env.args.dilated_base)
        f = sum(4.0 * B * h * cell.n * w * env.d / r**2 for w, r in zip(ws, rs))
    else:
        f = 4.0 * B * h * cell.n**2 * env.d
    f *= 0.5 if cell.causal else 1.0
    return f * (3.5 if backward else 1.0)


@contextlib.contextmanager
def count_ring_bytes():
    """Bytes this rank queues through the ring transports (their own bytes_sent counters)
    while inside."""
    from ringcc.runtime.comm import CopyEngineRing, RingComm

    counter = {"bytes": 0}
    originals = {cls: cls.send_recv for cls in (RingComm, CopyEngineRing)}

    def counting(original):
        def send_recv(self, tensors, recv_buffers=None):
            before = self.bytes_sent
            out = original(self, tensors, recv_buffers)
            counter["bytes"] += self.bytes_sent - before
            return out
        return send_recv

    for cls, original in originals.items():
        cls.send_recv = counting(original)
    try:
        yield counter
    finally:
        for cls, original in originals.items():
            cls.send_recv = original


def time_ms(step: Callable[[], None], warmup: int, iters: int, env: Env,
            before: Callable[[], None] | None = None, host: list[float] | None = None) -> list[float]:
    """Per-iteration milliseconds (slowest rank), warm-up excluded, each iteration from an idle
    GPU (Note [Benchmark metrics]). `before` (CUDA) runs after each barrier, before the start
    event: GPU work there is not timed. `host` (CUDA), when given, gets this rank's host
    milliseconds to issue each step."""
    for _ in range(warmup):
        step()
    times = []
    for _ in range(iters):
        env.barrier()
        if env.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            if before is not None:
                before()
            start.record()
            t = time.perf_counter()
            step()
            if host is not None:
                host.append(1e3 * (time.perf_counter() - t))
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t = time.perf_counter()
            step()
            times.append(1e3 * (time.perf_counter() - t))
    return env.all_max(times)


def time_back_to_back(step: Callable[[], None], iters: int, env: Env) -> list[float]:
    """Iterations issued one after another with no wait between them, as layers run inside a
    model: the host runs ahead and the GPU never idles between iterations. On CUDA an untimed
    lead iteration runs first; each timed one is measured between the events recorded after it
    and after the one before (on CPU: perf_counter at the same points, no lead)."""
    env.barrier()
    if not env.cuda:
        marks = [time.perf_counter()]
        for _ in range(iters):
            step()
            marks.append(time.perf_counter())
        return env.all_max([1e3 * (b - a) for a, b in zip(marks, marks[1:])])
    torch.cuda.synchronize()
    events = [torch.cuda.Event(enable_timing=True) for _ in range(iters + 1)]
    step()  # untimed lead: the GPU is busy with it while the host issues the first timed one
    events[0].record()
    for i in range(iters):
        step()
        events[i + 1].record()
    events[-1].synchronize()
    return env.all_max([a.elapsed_time(b) for a, b in zip(events, events[1:])])


def peak_memory(step: Callable[[], None], env: Env) -> int | None:
    """Bytes allocated at the peak of one `step` above what was allocated before it (None on CPU)."""
    if not env.cuda:
        step()
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


DEFAULT_RATE = {"cpu": 2e9, "single": 2.5e14, "cp": 2.0e14, "ring": 2.5e14, "ring-nocomm": 2.5e14, "dilated": 5e13}


def est_seconds(cell: Cell, env: Env, mode: str) -> float:
    """Estimated seconds of one iteration: measured FLOP/s of this method (any length), else a default."""
    rate = env.rates.get((cell.method, mode))
    if rate is None:
        rate = DEFAULT_RATE["cpu"] if not env.cuda else DEFAULT_RATE[METHODS[cell.method].family]
    return cell_flops(cell, env, mode == "fwdbwd") / cell.p / rate


BACK_TO_BACK_MAX_S = 4.0  # covers the 1-GPU baselines of the 64K tokens per GPU cells at p = 4


MEDIAN_OF_3_MAX_S = 2.0  # covers the p = 4 cells at 64K tokens per GPU, MHA and GQA


def plan_iters(t_iter: float, args) -> tuple[int, int]:
    """(extra warm-up, timed iterations): the memory run is the first warm-up; short iterations
    get more (about 0.25 s of them, at most 10), since a ring's first calls also set up its
    transport and the allocator's pool. Timed: about --target-seconds of iterations, at most
    --reps, and at least 3 (a median) for cells of up to MEDIAN_OF_3_MAX_S: one iteration of a
    1 s cell differed from the back-to-back median by more than the methods compared differ
    (912.09 vs 924.44 ms, where context parallel took 916.41)."""
    warm = 0 if t_iter >= 1.0 else min(10, max(1, int(0.25 / max(t_iter, 1e-9))))
    iters = int(args.target_seconds / max(t_iter, 1e-9))
    if t_iter <= MEDIAN_OF_3_MAX_S:
        iters = max(3, iters)
    return warm, max(1, min(args.reps, iters))


def back_to_back_iters(t_iter: float, iters: int) -> int:
    """Timed back-to-back iterations for a cell of about t_iter seconds: at least 3 (the
    median of a few steady iterations), none past BACK_TO_BACK_MAX_S, where one iteration is
    long enough that starting it from an idle GPU changes little."""
    return 0 if t_iter > BACK_TO_BACK_MAX_S else max(3, iters)


def measure(bench: Bench, cell: Cell, mode: str, env: Env) -> dict:
    backward = mode == "fwdbwd"
    step = functools.partial(bench.step, backward)
    warm, iters = plan_iters(est_seconds(cell, env, mode), env.args)
    comm_buffers = None
    if env.cuda and env.world > 1:
        from ringcc.runtime import comm as ring_comm

        ring_comm.release_comm_buffers()  # collective: every rank measures the same cell
    with count_ring_bytes() as sent:
        extra = peak_memory(step, env)
    if env.cuda and env.world > 1:
        # The copy-engine ring's receive areas, where the caching allocator does not count them.
        comm_buffers = ring_comm.comm_buffer_bytes(torch.device("cuda", torch.cuda.current_device()))
        extra += comm_buffers
    times = time_ms(step, warm, iters, env)
    ms = statistics.median(times)
    flops = cell_flops(cell, env, backward)
    per_gpu_tflops = lambda t_ms: flops / cell.p / (t_ms * 1e-3) / 1e12  # noqa: E731
    tflops = per_gpu_tflops(ms)
    b2b_iters = back_to_back_iters(ms / 1e3, iters)  # on the time just measured (the budget used the estimate)
    times_b2b = time_back_to_back(step, b2b_iters, env) if b2b_iters else None
    ms_b2b = statistics.median(times_b2b) if times_b2b else None
    env.rates[(cell.method, mode)] = tflops * 1e12
    inputs = bench.input_bytes(backward)
    peak = None if extra is None else int(env.all_max([extra + inputs])[0])
    if bench.comm_model is not None:
        comm, source = bench.comm_model(backward), "model"
    else:
        comm, source = int(env.all_max([sent["bytes"]])[0]), "measured (ring transport bytes_sent)"
    rec = dict(status="ok", ms=ms, ms_iters=times, warmup=1 + warm, iters=iters, flops=flops,
               tflops_per_gpu=tflops, ms_b2b=ms_b2b, ms_b2b_iters=times_b2b,
               tflops_b2b=None if ms_b2b is None else per_gpu_tflops(ms_b2b), peak_bytes=peak, input_bytes=inputs,
               comm_bytes=comm,
               comm_buffer_bytes=comm_buffers,
               comm_source=source, notes=bench.notes)
    if (cell.method, cell.n) in env.args.profile_cells:
        try:
            name = f"{cell.method}_{cell.attn}_{'causal' if cell.causal else 'full'}_n{cell.n}_{mode}"
            rec["profile"] = profile_table(step, env, name)
        except Exception as e:  # noqa: BLE001 - a profiler problem must not void the measurement
            rec["profile"] = f"profiler failed: {type(e).__name__}: {e}"
        env.log(f"profile of {cell.method} n={cell.n} {mode} (rank 0):\n{rec['profile']}")
    return rec


def profile_table(step: Callable[[], None], env: Env, name: str, rows: int = 20) -> str:
    """Top ops of one iteration by self device time (CPU time on CPU): where the time goes, and
    whether communication kernels run beside the attention kernels or add to them. On CUDA also
    the step's timeline (benchmarks/timeline.py: busy time per stream and family, the attention
    stream's longest gaps); rank 0's chrome trace is kept in --trace-dir."""
    if not env.cuda:
        from torch.profiler import ProfilerActivity, profile

        env.barrier()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            step()
            env.barrier()
        return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)
    here = str(Path(__file__).parent)
    if here not in sys.path:  # (loaded by path, as the tests do, the folder is not on it)
        sys.path.insert(0, here)
    import timeline

    trace = Path(env.args.trace_dir) / f"{name}.json.gz" if env.args.trace_dir else None
    return timeline.profile_step(step, env.barrier, trace, rank0=env.rank == 0, rows=rows)


# ---------------------------------------------------------------------------------------
# one phase: every cell for this world size, in priority order, within the time budget


def plan_cells(env: Env) -> list[Cell]:
    args, p = env.args, env.world
    cells = []
    for name in args.method_names:
        if p == 1 and args.p1_method_names is not None and name not in args.p1_method_names:
            continue
        lengths = args.dilated_lengths if METHODS[name].family == "dilated" else args.lengths
        for attn in args.attn:
            for causal in args.causals:
                cells += [Cell(name, attn, causal, n, p) for n in lengths]
    order = list(METHODS)
    small = min(args.lengths)

    def priority(c: Cell):
        # Headline first (MHA at the target lengths), then GQA at the smallest length, then the
        # dilated series with the dense 1M ring it is compared with; the rest by size. Cells
        # that do not fit the budget are skipped from the end.
        fam = METHODS[c.method].family
        if fam == "ring" and c.p == 1:
            tier = 3  # ringcc's overhead at p = 1: useful, not a target
        elif c.method == "flex":
            tier = 1  # a reference; each shape compiles (tens of seconds)
        elif c.attn == "mha" and c.n <= 262144 and fam != "dilated":
            tier = 0
        elif c.attn == "gqa" and c.n == small:
            tier = 1
        elif c.attn == "mha" and (fam == "dilated" or (fam == "ring" and c.method == headline_ring(c.causal))):
            tier = 2
        else:
            tier = 3
        return (tier, c.n, not c.causal, order.index(c.method))

    return sorted(cells, key=priority)


def base_record(cell: Cell, env: Env, mode: str | None) -> dict:
    h, h_kv = env.heads[cell.attn]
    return dict(method=cell.method, family=METHODS[cell.method].family, attn=cell.attn, h=h, h_kv=h_kv,
                d=env.d, b=B, n=cell.n, p=cell.p, causal=cell.causal, mode=mode)


# A multi-rank cell runs only where the peaks measured at shorter lengths predict at most this
# share of the device: the allocated peak leaves out the CUDA context, NCCL's buffers and the
# allocator's fragmentation. At 92% a GQA dilated cell predicted at 89% (125 of 140 GiB, 4 x
# H200) ran out of memory on some ranks, and the others waited in NCCL until its
# timeout ended the phase.
MULTI_RANK_PEAK_LIMIT = 0.80


def predicted_peak(cell: Cell, mode: str, done: list[dict]) -> float | None:
    """Peak bytes per rank at cell.n from this method's measured peaks at smaller n (a + b*n)."""
    pts = [(r["n"], r["peak_bytes"]) for r in done if r["status"] == "ok" and r.get("peak_bytes")
           and r["n"] < cell.n and all(r[k] == v for k, v in (("method", cell.method), ("attn", cell.attn),
                                                               ("causal", cell.causal), ("mode", mode)))]
    if not pts:
        return None
    a, b = fit_line(pts)
    return a + b * cell.n


def run_cell(cell: Cell, env: Env, done: list[dict]) -> list[dict]:
    reason = skip_reason(cell, env)
    if reason:
        return [dict(base_record(cell, env, None), status="skipped", reason=reason)]
    records, modes = [], []
    capacity = torch.cuda.get_device_properties(env.device).total_memory if env.cuda else None
    for mode in env.args.modes:
        t = est_seconds(cell, env, mode)
        peak = predicted_peak(cell, mode, done) if capacity and cell.p > 1 else None
        if t > env.args.max_iter_seconds:
            reason = f"estimated iteration {t:.1f} s > --max-iter-seconds"
        elif peak is not None and not env.agree(peak <= MULTI_RANK_PEAK_LIMIT * capacity):
            # An OOM on one rank in the middle of a ring leaves its peers waiting in NCCL.
            reason = (f"measured peaks predict {peak / GiB:.0f} GiB per rank "
                      f"(> {MULTI_RANK_PEAK_LIMIT:.0%} of the device)")
        else:
            modes.append(mode)
            continue
        records.append(dict(base_record(cell, env, mode), status="skipped", reason=reason))
        env.log(describe(records[-1]))
    cost = METHODS[cell.method].setup_s if env.cuda else 0.0
    for mode in modes:
        t = est_seconds(cell, env, mode)
        warm, iters = plan_iters(t, env.args)
        b2b = back_to_back_iters(t, iters)
        cost += t * (1 + warm + iters + (b2b + 1 if b2b else 0))
    if modes and not env.agree(cost <= env.left()):
        reason = f"time budget (estimated {cost:.0f} s, {max(env.left(), 0):.0f} s left)"
        records += [dict(base_record(cell, env, m), status="skipped", reason=reason) for m in modes]
        env.log(describe(records[-1]))
        return records
    for mode in modes:
        rec = base_record(cell, env, mode)
        try:
            with METHODS[cell.method].make(cell, env) as bench:
                rec.update(measure(bench, cell, mode, env))
        except Exception as e:  # noqa: BLE001 - a failing configuration is a result, not a crash
            oom = env.cuda and isinstance(e, torch.cuda.OutOfMemoryError)
            rec.update(status="oom" if oom else "failed", reason=f"{type(e).__name__}: {str(e)[:400]}")
        ok = env.agree(rec["status"] == "ok")
        if not ok and rec["status"] == "ok":
            rec.update(status="failed", reason="failed on another rank")
        records.append(rec)
        if env.cuda:  # give the next cell (and the largest-length probes) an unfragmented pool
            gc.collect()
            torch.cuda.empty_cache()
        env.log(describe(rec))
    return records


def describe(rec: dict) -> str:
    head = f"{rec['method']:<22} {rec['attn']} {'causal' if rec['causal'] else 'full  '} n={rec['n']:<8} {rec['mode'] or '-':<6}"
    if rec["status"] != "ok":
        return f"{head} {rec['status']}: {rec.get('reason', '')}"
    peak = "" if rec["peak_bytes"] is None else f" peak {rec['peak_bytes'] / GiB:.2f} GiB"
    return f"{head} {rec['ms']:9.2f} ms {rec['tflops_per_gpu']:7.1f} TF/s/GPU{peak} comm {rec['comm_bytes'] / MiB:.1f} MiB"


def search_max_length(fits: Callable[[int], bool | None], start: int, step: int, max_probes: int,
                      guess: Callable[[], int | None] | None = None) -> dict:
    """Largest n (a multiple of `step`) with fits(n) True: doubling from `start` (known to fit),
    then bisection. fits returns None when a probe is not run (too long, out of budget, or it
    failed other than by running out of memory): the search stops there and the answer is a
    lower bound. `first_fail` is the shortest length that ran out of memory (None if none did).
    `guess()`, when given, predicts the largest fitting length from what was measured so far:
    a prediction inside the open bracket (doubling at most) is probed instead of the midpoint
    (one past the last fit when it predicts that fit; ignored below it), so a good model ends
    the search in a few probes and a bad one costs probes, never correctness."""
    lo, hi, probes, stopped = start, None, [], "probe limit"
    crawled = False  # the last probe was a guess one step past a fit, and fit too: the model is low
    while len(probes) < max_probes:
        n = 2 * lo if hi is None else (lo + hi) // 2 // step * step
        if hi is not None and n <= lo:
            break
        g = guess() if guess and not crawled else None
        if g is not None and g >= lo:  # (a model that says lo does not fit is wrong: bisect)
            g = max(g // step * step, lo + step)  # it says lo is the answer: try the next length
            if g < (hi if hi is not None else 2 * lo + step):
                n = g
        ok = fits(n)
        probes.append([n, ok])
        if ok is None:
            stopped = "not probed"
            break
        crawled = bool(ok) and n == lo + step and n != 2 * lo
        if ok:
            lo = n
        else:
            hi = n
    if hi is not None and hi - lo <= step:
        stopped = "converged"
    return {"max_fit": lo, "first_fail": hi, "stopped_by": stopped, "probes": probes}


def maxlen_capacity(cap_gib: float, total: int) -> tuple[float, bool]:
    """(bytes a probe may use, whether that is a cap below the device's `total`): a
    --maxlen-cap-gib of 0, or one past the device, means the whole device."""
    cap = cap_gib * GiB
    return (cap, True) if 0 < cap < total else (float(total), False)


def _maxlen_capacity(env: Env) -> float | None:
    """Bytes a probe may use: the --maxlen-cap-gib allocator cap (set here), else the device."""
    if not env.cuda:
        return None
    total = torch.cuda.get_device_properties(env.device).total_memory
    cap, capped = maxlen_capacity(env.args.maxlen_cap_gib, total)
    if capped:
        torch.cuda.set_per_process_memory_fraction(cap / total, env.device)
    return cap


# Note [Max-length probes]
# Each probe is its own torchrun job: one MHA causal fwd+bwd at one length. A rank that runs out
# of memory writes a marker and exits at once; torchrun then stops its peers, which may be
# waiting in NCCL for it (in one process that wait is a hang). So every
# length is really run, at p > 1 too, and the answer is the largest that ran. Subprocesses also
# let each probe start with the allocator configuration under test (PYTORCH_CUDA_ALLOC_CONF is
# read once, at the first CUDA allocation). ringcc's ring probes run at its leanest setting (one
# K/V head per head chunk) through the process group (NCCL), whose receive buffers come from the
# capped caching allocator; the copy-engine ring's areas would be outside the cap on torch 2.11.

PROBE_OOM_EXIT = 3
CAP_SLACK = 64 * MiB  # reserved bytes past the cap that still count as under it
PROBE_START_S = 25.0  # budgeted per probe for the job's start (torchrun, CUDA, NCCL)
ALLOCATORS = {"default": None, "expandable": "expandable_segments:True"}


def maxlen_step(p: int) -> int:
    """Resolution of the largest-length search at p ranks: zigzag needs 2p chunks of equal length."""
    return 2 * p * 1024


def probe_settings(method: str, allocator: str) -> dict[str, str]:
    """Environment of a max-length probe of `method` under `allocator` (a key of ALLOCATORS)."""
    env = {}
    if METHODS[method].family == "ring":
        env.update(RINGCC_RING_WORKSPACE_MIB="0.001", RINGCC_RING_TRANSPORT="nccl")
    if ALLOCATORS[allocator]:
        env["PYTORCH_CUDA_ALLOC_CONF"] = ALLOCATORS[allocator]
    return env


def _is_oom(e: BaseException) -> bool:
    text = str(e).lower()
    return isinstance(e, torch.cuda.OutOfMemoryError) or "out of memory" in text or "alloc_failed" in text


def run_probe(args) -> None:
    """One probe under torchrun (Note [Max-length probes]): --part gets the peaks when it fits."""
    env = Env(args)
    capacity = _maxlen_capacity(env)
    part = Path(args.part)
    cell = Cell(args.method, "mha", True, args.probe_n, env.world)
    why = skip_reason(cell, env)
    if why:
        raise SystemExit(f"probe {args.method} n={args.probe_n} p={env.world}: {why}")
    t = time.monotonic()
    try:
        with METHODS[args.method].make(cell, env) as bench:
            if env.cuda:
                torch.cuda.reset_peak_memory_stats()
            bench.step(True)
            if env.cuda:
                torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 - an OOM ends this rank now; anything else is raised
        if not _is_oom(e):
            raise
        part.with_name(f"{part.name}.oom{env.rank}").write_text(f"{type(e).__name__}: {e}"[:4000])
        print(f"[rank {env.rank}] probe n={args.probe_n}: out of memory", flush=True)
        os._exit(PROBE_OOM_EXIT)  # no NCCL teardown: peers may be waiting for this rank
    seconds = time.monotonic() - t
    alloc, reserved, secs = env.all_max([torch.cuda.max_memory_allocated() if env.cuda else 0,
                                         torch.cuda.max_memory_reserved() if env.cuda else 0, seconds])
    if env.rank == 0:
        part.write_text(json.dumps({"n": args.probe_n, "p": env.world, "method": args.method, "fits": True,
                                    "peak_allocated": int(alloc), "peak_reserved": int(reserved),
                                    "capacity_bytes": capacity, "seconds": secs,
                                    "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF")}))
    leave_group(not env.cuda)


def leave_group(cpu: bool) -> None:
    """End a torchrun worker's part: a barrier (rank 0 has written what it writes), then leave
    the process group; on CPU the process ends there (ringcc.launch.exit_worker)."""
    if not dist.is_initialized():
        return
    if cpu:
        from ringcc.launch import exit_worker

        exit_worker()
    dist.barrier()
    dist.destroy_process_group()


def _stop_job(proc: subprocess.Popen, grace: float = 30.0) -> None:
    """Stop a torchrun job started in its own session: SIGTERM (torchrun then stops its workers),
    SIGKILL after `grace` seconds."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, None)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def run_probe_job(args, method: str, p: int, n: int, allocator: str, work: Path, timeout: float) -> dict:
    """Launch one probe job; -> {"outcome": "fits" | "oom" | "timeout" | "error", ...peaks}."""
    part = work / f"probe_{method}_p{p}_{allocator}_{n}.json"
    for old in [part, *work.glob(part.name + ".oom*")]:
        old.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={p}",
           str(Path(__file__).resolve()), "probe", "--method", method, "--probe-n", str(n), "--part", str(part),
           "--maxlen-cap-gib", str(args.maxlen_cap_gib), "--nccl-timeout", str(args.nccl_timeout)]
    cmd += ["--smoke"] if args.smoke else []
    env = {**os.environ, **probe_settings(method, allocator)}
    t = time.monotonic()
    log_path = part.with_suffix(".log")
    # The job writes to a file, not a pipe: torchrun's workers run in their own sessions, and a
    # worker left behind would hold a pipe open. On timeout torchrun gets SIGTERM, on which it
    # stops its workers, then SIGKILL.
    with open(log_path, "w") as log_file:
        proc = subprocess.Popen(cmd, env=env, start_new_session=True, stdout=log_file, stderr=subprocess.STDOUT)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            rc = None
            _stop_job(proc)
    log = log_path.read_text(errors="replace")
    out = {"n": n, "job_seconds": round(time.monotonic() - t, 1)}
    ooms = sorted(work.glob(part.name + ".oom*"))
    if ooms:
        out.update(outcome="oom", detail=ooms[0].read_text()[:300])
    elif rc is None:
        out.update(outcome="timeout", detail=f"no result after {timeout:.0f} s")
    elif rc == 0 and part.exists():
        out.update(outcome="fits", **{k: v for k, v in json.loads(part.read_text()).items()
                                      if k in ("peak_allocated", "peak_reserved", "seconds")})
    else:
        out.update(outcome="error", detail=f"exit {rc}: " + "\n".join(log.splitlines()[-15:]))
    return out


def run_maxlen(args, parts: list[Path], work: Path, deadline: float) -> list[dict]:
    """Largest MHA causal fwd+bwd length per method of --maxlen-methods and world size that ran
    in the phases, once per --maxlen-allocators setting; one job per probe (Note [Max-length
    probes]). Starts from the longest measured cell under 80% of the capacity; probe times are
    extrapolated from it (O(n^2))."""
    res = load_results(parts)
    ok = [r for r in res["records"] if r["status"] == "ok"]
    results = []
    for allocator in args.maxlen_allocators:
        for phase in res["phases"]:
            p, total = phase["world"], phase.get("device_total_memory")
            for name in args.maxlen_methods:
                if name not in METHODS or (p == 1) != (METHODS[name].family == "single"):
                    continue
                head = {"method": name, "p": p, "attn": "mha", "causal": True, "allocator": allocator}
                if not total:
                    results.append({**head, "status": "skipped", "reason": "CPU (no device memory to fill)"})
                    continue
                capacity, capped = maxlen_capacity(args.maxlen_cap_gib, total)
                done = [r for r in ok if r["method"] == name and r["p"] == p and r["attn"] == "mha" and r["causal"]
                        and r["mode"] == "fwdbwd" and r.get("peak_bytes") and r["peak_bytes"] <= 0.8 * capacity]
                if not done:
                    results.append({**head, "status": "skipped", "reason": "no measured fwd+bwd cell fits under the capacity"})
                    continue
                base = max(done, key=lambda r: r["n"])
                probes, why = [], {}
                cells = [(r["n"], r["peak_bytes"]) for r in done]

                def guess(probes=probes, cells=cells, capacity=capacity) -> int | None:
                    # peak = a + b*n from the probes that fit (their own setting), else the cells
                    pts = [(x["n"], x["peak_allocated"]) for x in probes if x["outcome"] == "fits"] or cells
                    a, b = fit_line(pts)
                    return int((capacity - a) / b) if b > 0 else None

                def fits(n: int, base=base, name=name, p=p, allocator=allocator, capacity=capacity) -> bool | None:
                    secs = base["ms"] / 1000 * (n / base["n"]) ** 2
                    if secs > args.probe_seconds:
                        why["stop"] = f"time cap (n={n} estimated {secs:.0f} s > --probe-seconds)"
                        return None
                    if time.monotonic() + PROBE_START_S + 4 * secs > deadline:
                        why["stop"] = "time budget"
                        return None
                    timeout = min(4 * PROBE_START_S + 10 * secs, deadline - time.monotonic())
                    probe = run_probe_job(args, name, p, n, allocator, work, timeout=timeout)
                    probes.append(probe)
                    print(f"max-length probe {name} p={p} {allocator} n={n}: {probe['outcome']}"
                          + (f" (reserved {probe['peak_reserved'] / GiB:.2f} GiB)" if "peak_reserved" in probe else "")
                          + (f" ({probe['detail']})" if probe["outcome"] in ("error", "timeout") else ""), flush=True)
                    # expandable segments map 2 MiB pages: a few MiB past the cap is the cap (the
                    # 4-GPU run saw +10 MiB at 8 GiB)
                    if probe["outcome"] == "fits" and probe["peak_reserved"] > capacity + CAP_SLACK:
                        why["stop"] = why["invalid"] = (f"the cap was not enforced (n={n} reserved "
                                                        f"{probe['peak_reserved']} bytes > {capacity:.0f})")
                        return None
                    if probe["outcome"] in ("error", "timeout"):
                        why["stop"] = f"probe {probe['outcome']} at n={n}"
                        return None
                    return probe["outcome"] == "fits"

                found = search_max_length(fits, base["n"], maxlen_step(p), max_probes=args.maxlen_probes, guess=guess)
                found["stopped_by"] = why.get("stop", found["stopped_by"])
                found["probes"] = probes
                if "invalid" in why:
                    found.update(status="failed", reason=why["invalid"])
                elif not probes:
                    found.update(status="not probed", reason=why.get("stop", "no probe ran"))
                results.append({**head, "status": "ok", **found,
                                "transport": "nccl" if METHODS[name].family == "ring" else None,
                                "setting": probe_settings(name, allocator) or None, "capacity_bytes": capacity,
                                "capped": capped})
                print(f"max length {name} p={p} {allocator}: >= {found['max_fit']} ({found['stopped_by']})", flush=True)
    return results


def run_phase(args) -> None:
    env = Env(args)
    part_path = Path(args.part or f"part_p{env.world}.json")
    part = {"phases": [env.meta()], "records": [], "maxlen": []}

    def save():
        if env.rank == 0:
            tmp = part_path.with_suffix(".tmp")
            tmp.write_text(json.dumps(part, indent=1))
            tmp.replace(part_path)

    env.log(f"{part['phases'][0].get('device')} torch {torch.__version__}; budget {args.max_minutes:.1f} min")
    for cell in plan_cells(env):
        part["records"] += run_cell(cell, env, part["records"])
        save()
    env.log(f"phase done in {time.monotonic() - T0:.0f} s")
    leave_group(not env.cuda)


# ---------------------------------------------------------------------------------------
# report: derived metrics, targets, table, plots, RESULTS.md


def load_results(paths: list[Path]) -> dict:
    res = {"phases": [], "records": [], "maxlen": []}
    for path in paths:
        data = json.loads(Path(path).read_text())
        for key in res:
            res[key] += data.get(key, [])
    return res


def baseline_method(res: dict) -> str:
    """The single-device method efficiencies are relative to: cuDNN SDPA (the CPU smoke: math
    SDPA); with a score modifier, the single-GPU kernel of the same variant, flex_attention
    with the same score_mod (the CPU smoke: the ring at p = 1), since SDPA takes none."""
    smoke = any(ph.get("smoke") for ph in res["phases"])
    if any(ph.get("score_mod", "none") != "none" for ph in res["phases"]):
        return "ring-contiguous" if smoke else "flex"
    return "sdpa-math" if smoke else BASELINE


def derive(res: dict) -> None:
    """Efficiency and memory vs the single-GPU baseline, and model max lengths, in place."""
    baseline = baseline_method(res)
    ok = [r for r in res["records"] if r["status"] == "ok"]
    base = {(r["attn"], r["causal"], r["n"], r["mode"]): r for r in ok if r["method"] == baseline and r["p"] == 1}
    for r in ok:
        b = base.get((r["attn"], r["causal"], r["n"], r["mode"]))
        dense = r["family"] != "dilated"
        for _, _, tf, eff in TIMINGS:
            r[eff] = r[tf] / b[tf] if b and dense and r.get(tf) and b.get(tf) else None
        ideal = b["peak_bytes"] / r["p"] if b and b.get("peak_bytes") else None
        r["ideal_peak_bytes"] = ideal
        r["peak_vs_ideal"] = r["peak_bytes"] / ideal if ideal and r.get("peak_bytes") else None
    capacity = {ph["world"]: ph.get("device_total_memory") for ph in res["phases"]}
    for m in res["maxlen"]:
        pts = [(r["n"], r["peak_bytes"]) for r in ok if r["method"] == m["method"] and r["p"] == m["p"]
               and r["attn"] == "mha" and r["causal"] and r["mode"] == "fwdbwd" and r.get("peak_bytes")]
        cap = m.get("capacity_bytes") or capacity.get(m["p"])
        m["max_model"] = model_max_length(pts, 0.95 * cap, maxlen_step(m["p"])) if cap and pts else None


def fit_line(points: list[tuple[int, float]]) -> tuple[float, float]:
    """(a, b) of y = a + b*n by least squares; through the origin for a single length."""
    ns = {n for n, _ in points}
    if len(ns) == 1:
        n0 = next(iter(ns))
        return 0.0, max(y for _, y in points) / n0
    mn = sum(n for n, _ in points) / len(points)
    my = sum(y for _, y in points) / len(points)
    b = sum((n - mn) * (y - my) for n, y in points) / sum((n - mn) ** 2 for n, _ in points)
    return my - b * mn, b


def model_max_length(points: list[tuple[int, int]], capacity: float, step: int) -> int | None:
    """Largest n (multiple of step) with a + b*n <= capacity, a, b fitted to the measured peaks."""
    a, b = fit_line(points)
    if b <= 0:
        return None
    return int((capacity - a) / b) // step * step


def _find(res, **kw) -> dict | None:
    for r in res["records"]:
        if r["status"] == "ok" and all(r.get(k) == v for k, v in kw.items()):
            return r
    return None


# The two timings of Note [Benchmark metrics]: how a line names it, and its record fields.
TIMINGS = (("from idle", "ms", "tflops_per_gpu", "efficiency"),
           ("back to back", "ms_b2b", "tflops_b2b", "efficiency_b2b"))


def check_targets(res: dict) -> list[str]:
    """One line per target: PASS / MISS / n/a with the measured numbers (MHA unless said)."""
    lines = []
    ps = sorted({r["p"] for r in res["records"] if r["p"] > 1})
    if not ps:
        return ["n/a: no multi-rank results"]
    p = ps[-1]

    def verdict(ok):
        return "PASS" if ok else "MISS"

    for causal in (True, False):
        ring = headline_ring(causal)
        tag = f"{ring} {'causal' if causal else 'non-causal'} p={p}"
        for per_gpu, goal in ((16384, 0.95), (65536, 0.97)):
            r = _find(res, method=ring, attn="mha", causal=causal, n=per_gpu * p, p=p, mode="fwdbwd")
            for timing, _, _, eff_key in TIMINGS:
                eff = None if r is None else r.get(eff_key)
                if eff is None:
                    lines.append(f"n/a   {tag}: efficiency at {per_gpu // 1024}K/GPU, {timing} (not measured)")
                else:
                    lines.append(f"{verdict(eff >= goal)}  {tag}: {eff:.2%} of 1-GPU cuDNN at "
                                 f"{per_gpu // 1024}K/GPU, {timing} (target >= {goal:.0%})")
    for timing, _, tf, _ in TIMINGS:
        beat, worst = [], None
        for r in res["records"]:
            if r["status"] != "ok" or r["family"] != "ring" or r["method"] != headline_ring(r["causal"]) \
                    or r["p"] < 2 or not r.get(tf):
                continue
            peers = [c for c in res["records"] if c["status"] == "ok" and c["family"] == "cp" and c.get(tf) and
                     all(c[k] == r[k] for k in ("attn", "causal", "n", "p", "mode"))]
            if peers:
                best = max(peers, key=lambda c: c[tf])
                ratio = r[tf] / best[tf]
                beat.append(ratio >= 1.0)
                if worst is None or ratio < worst[0]:
                    worst = (ratio, r, best)
        if worst:
            ratio, r, best = worst
            lines.append(f"{verdict(all(beat))}  ring >= best context-parallel config in every cell, {timing}: "
                         f"{sum(beat)}/{len(beat)}; worst {ratio:.3f}x ({r['attn']} {'causal' if r['causal'] else 'full'} "
                         f"n={r['n']} p={r['p']} {r['mode']} vs {best['method']})")
        else:
            lines.append(f"n/a   ring vs context parallel, {timing}: no cell with both")
    mem = []
    for r in res["records"]:
        if r["status"] == "ok" and r["method"] == headline_ring(r["causal"]) and r["p"] == p and r["mode"] == "fwdbwd" \
                and r.get("ideal_peak_bytes"):
            mem.append((r["peak_bytes"] <= 1.1 * r["ideal_peak_bytes"] + 256 * MiB, r))
    if mem:
        worst = max(mem, key=lambda x: x[1]["peak_vs_ideal"])[1]
        lines.append(f"{verdict(all(ok for ok, _ in mem))}  ring peak <= 1.1 x (1-GPU peak / p) + 256 MiB: "
                     f"{sum(ok for ok, _ in mem)}/{len(mem)} cells; worst {worst['peak_vs_ideal']:.2f}x ideal "
                     f"({worst['attn']} n={worst['n']})")
        cps = [c for c in res["records"] if c["status"] == "ok" and c["family"] == "cp" and c.get("peak_vs_ideal")]
        if cps:
            lines.append(f"info  context parallel peak: {min(c['peak_vs_ideal'] for c in cps):.2f}-"
                         f"{max(c['peak_vs_ideal'] for c in cps):.2f}x ideal")
    searched = False
    for allocator in dict.fromkeys(m.get("allocator", "default") for m in res["maxlen"]):
        found = [m for m in res["maxlen"] if m.get("allocator", "default") == allocator and m["status"] == "ok"]
        single = next((m for m in found if m["method"] == BASELINE and m["p"] == 1), None)
        multi = next((m for m in found if m["method"] == headline_ring(True) and m["p"] == p), None)
        if not (single and multi):
            continue
        searched = True
        v = multi["max_fit"] / single["max_fit"]
        model = ""
        if single.get("max_model") and multi.get("max_model"):
            model = f"; model from measured peaks {multi['max_model'] / single['max_model']:.2f}x " \
                    f"({multi['max_model']} vs {single['max_model']})"
        cap = ""
        if single.get("capped") or multi.get("capped"):
            cap = f" under a {single.get('capacity_bytes', 0) / GiB:.0f} GiB allocator cap per GPU"
        # Both searches ran every length they report (Note [Max-length probes]). The ratio lies
        # between multi fit / single first OOM and multi first OOM / single fit: PASS when the
        # lower end clears 3.8x, MISS when the upper end does not, else n/a (so a single-GPU
        # search stopped before an OOM never makes a PASS).
        lower = multi["max_fit"] / single["first_fail"] if single["first_fail"] else None
        upper = multi["first_fail"] / single["max_fit"] if multi["first_fail"] else None
        state = "PASS" if lower and lower >= 3.8 else "MISS" if upper and upper < 3.8 else "n/a  "
        bound = f", {lower:.2f}x against the first single-GPU OOM ({single['first_fail']})" if lower else ""
        lines.append(f"{state}  longest fwd+bwd p={p} / 1 GPU{cap}, {allocator} allocator: {multi['max_fit']} / "
                     f"{single['max_fit']} = {v:.2f}x{bound} (searches: {multi['stopped_by']} / "
                     f"{single['stopped_by']}){model} (target >= 3.8x)")
    if not searched:
        lines.append("n/a   longest sequence: no max-length search for both")
    for timing, ms_key, _, _ in TIMINGS:
        hidden = []
        for r in res["records"]:
            if r["status"] == "ok" and r["family"] == "ring" and r["p"] > 1 and r.get(ms_key):
                nc = _find(res, method=r["method"] + "-nocomm", attn=r["attn"], causal=r["causal"], n=r["n"],
                           p=r["p"], mode=r["mode"])
                if nc and nc.get(ms_key):
                    hidden.append((r[ms_key] / nc[ms_key], r))
        if hidden:
            worst = max(hidden, key=lambda x: x[0])
            lines.append(f"{verdict(worst[0] <= 1.05)}  communication hidden (ring / same schedule without transfers "
                         f"<= 1.05), {timing}: worst {worst[0]:.3f} ({worst[1]['method']} {worst[1]['attn']} "
                         f"n={worst[1]['n']} p={worst[1]['p']} {worst[1]['mode']}); "
                         f"{sum(x <= 1.05 for x, _ in hidden)}/{len(hidden)} cells")
    for causal in (True, False):
        for mode in ("fwdbwd", "fwd"):
            ds = sorted((r for r in res["records"] if r["status"] == "ok" and r["family"] == "dilated" and r["p"] == p
                         and r["attn"] == "mha" and r["causal"] == causal and r["mode"] == mode), key=lambda r: r["n"])
            pairs = [(a, b) for a, b in zip(ds, ds[1:]) if b["n"] == 4 * a["n"]]
            if pairs:
                txt = ", ".join(f"{a['n'] // 1024}K->{b['n'] // 1024}K {b['ms'] / a['ms']:.2f}x" for a, b in pairs)
                lines.append(f"{verdict(all(b['ms'] <= 4.6 * a['ms'] for a, b in pairs))}  dilated time(4n) <= 4.6 x "
                             f"time(n), {'causal' if causal else 'full'} {mode}: {txt}")
            d1 = next((r for r in ds if r["n"] == 1048576), None)
            dense = _find(res, method=headline_ring(causal), attn="mha", causal=causal, n=1048576, p=p, mode=mode)
            if d1 and dense:
                sp = dense["ms"] / d1["ms"]
                lines.append(f"{verdict(sp >= 10)}  dilated vs dense ring at 1M, {'causal' if causal else 'full'} "
                             f"{mode}: {sp:.1f}x faster (target >= 10x)")
    for r in res["records"]:
        if r["status"] == "ok" and r["family"] == "ring" and r["attn"] == "gqa" and r["p"] > 1 and r["mode"] == "fwdbwd":
            m = _find(res, method=r["method"], attn="mha", causal=r["causal"], n=r["n"], p=r["p"], mode="fwdbwd")
            if m and m["comm_bytes"]:
                # MHA with the GQA model's h query heads would send h/h_mha times the MHA bytes.
                ratio = r["comm_bytes"] / (m["comm_bytes"] * r["h"] / m["h"])
                goal = r["h_kv"] / r["h"]
                lines.append(f"{verdict(abs(ratio - goal) < 1e-6)}  GQA K/V bytes / MHA's at h={r['h']}: {ratio:.4f} "
                             f"(target h_kv/h = {goal:.4f}; {r['method']} n={r['n']} p={r['p']}, measured)")
                break
    return lines


def _fmt(v, spec, missing="-"):
    return missing if v is None else format(v, spec)


TABLE_COLUMNS = [
    ("attn", 4, lambda r: r["attn"]), ("mask", 6, lambda r: "causal" if r["causal"] else "full"),
    ("n", 8, lambda r: str(r["n"])), ("p", 2, lambda r: str(r["p"])), ("method", 22, lambda r: r["method"]),
    ("mode", 6, lambda r: r["mode"] or "-"), ("ms", 10, lambda r: _fmt(r.get("ms"), ".2f")),
    ("TF/s/GPU", 8, lambda r: _fmt(r.get("tflops_per_gpu"), ".1f")),
    ("eff", 6, lambda r: _fmt(r.get("efficiency"), ".1%")),
    ("b2b ms", 10, lambda r: _fmt(r.get("ms_b2b"), ".2f")),
    ("b2b eff", 7, lambda r: _fmt(r.get("efficiency_b2b"), ".1%")),
    ("peak GiB", 8, lambda r: _fmt(None if r.get("peak_bytes") is None else r["peak_bytes"] / GiB, ".2f")),
    ("x ideal", 7, lambda r: _fmt(r.get("peak_vs_ideal"), ".2f")),
    ("comm MiB", 9, lambda r: _fmt(None if r.get("comm_bytes") is None else r["comm_bytes"] / MiB, ".1f")),
    ("status", 0, lambda r: r["status"] if r["status"] == "ok" else f"{r['status']}: {r.get('reason', '')[:70]}"),
]


def format_table(res: dict) -> str:
    fam = {f: i for i, f in enumerate(FAMILY_ORDER)}
    order = list(METHODS)
    rows = sorted(res["records"], key=lambda r: (r["attn"], not r["causal"], r["n"], r["p"], fam[r["family"]],
                                                 order.index(r["method"]), r["mode"] or ""))
    # Static skips (wrong world size for the method) are noise in the table; JSON keeps them.
    rows = [r for r in rows if not (r["status"] == "skipped" and r["reason"] in ("single-device method", "needs p >= 2"))]
    line = lambda vals: " ".join(v.rjust(w) if w and i not in (0, 1, 4, 5) else v.ljust(w)  # noqa: E731
                                 for i, (v, (_, w, _)) in enumerate(zip(vals, TABLE_COLUMNS))).rstrip()
    out = [line([c[0] for c in TABLE_COLUMNS]), "-" * 140]
    out += [line([c[2](r) for c in TABLE_COLUMNS]) for r in rows]
    if res["maxlen"]:
        out += ["", "largest length (MHA, causal, fwd+bwd): verified by probes; model = fit of measured peaks"]
        for m in res["maxlen"]:
            if m["status"] == "ok":
                cap = f" (cap {m['capacity_bytes'] / GiB:.0f} GiB)" if m.get("capped") else ""
                peak = next((x for x in reversed(m.get("probes", [])) if x.get("n") == m["max_fit"]
                             and "peak_reserved" in x), None)
                out.append(f"  {m['method']:<22} p={m['p']}{cap} {m.get('allocator', 'default')} allocator: fits "
                           f"{m['max_fit']}" + (f" (peak {peak['peak_allocated'] / GiB:.2f} GiB allocated, "
                                                f"{peak['peak_reserved'] / GiB:.2f} reserved)" if peak else "")
                           + f", first OOM {m['first_fail'] or '-'}, stopped by {m['stopped_by']}; model "
                           f"{m.get('max_model') or '-'}"
                           + (f"; {m['transport']} transfers" if m.get("transport") else "")
                           + ("; one K/V head per chunk" if (m.get("setting") or {}).get("RINGCC_RING_WORKSPACE_MIB") else ""))
            else:
                out.append(f"  {m['method']:<22} p={m['p']} {m.get('allocator', 'default')} allocator: {m['status']} "
                           f"({m.get('reason', '')})")
    return "\n".join(out)


def source_commit() -> str | None:
    """The checkout's commit (with "+dirty" when files differ from it), or None outside git."""
    try:
        git = ["git", "-C", str(HERE)]
        sha = subprocess.run(git + ["rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(git + ["status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if sha.returncode:
        return None
    return sha.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def header(res: dict) -> str:
    ph = res["phases"]
    if not ph:
        return "no phases"
    dev = {(x.get("device"), x.get("gpus_visible")) for x in ph}
    return (f"device: {', '.join(f'{d} (x{g} visible)' if g else str(d) for d, g in dev)}; torch {ph[0]['torch']}; "
            f"ringcc {ph[0].get('ringcc')}, commit {ph[0].get('commit') or '?'}; {ph[0]['dtype']}, b={ph[0]['b']}, d={ph[0]['d']}, heads {ph[0]['heads']}; "
            f"date {max(x['date'] for x in ph)}; worlds {sorted(x['world'] for x in ph)}; "
            f"NCCL_NVLS_ENABLE={ph[0]['env'].get('NCCL_NVLS_ENABLE')}; score modifier {ph[0].get('score_mod', 'none')}"
            + _runs_note(ph))


def _runs_note(ph: list[dict]) -> str:
    """Where a report merges several runs (a world size twice, or phases on different hosts):
    which phase ran where and when, since timings compare only within one run on one machine."""
    hosts = {x.get("host") for x in ph}
    if len(hosts) < 2 and len({x["world"] for x in ph}) == len(ph):
        return ""
    return "; merged runs (compare timings only within one): " + ", ".join(
        f"p={x['world']} at {x['date'][:19]}" + (f" on {x['host']}" if x.get("host") else "") for x in ph)


def plot(res: dict, out: Path) -> list[str]:
    """TFLOP/s and peak memory vs n, one panel per (mask, p), MHA, fwd+bwd. Returns messages."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return ["matplotlib not available: no plots"]
    ok = [r for r in res["records"] if r["status"] == "ok" and r["attn"] == "mha" and r["mode"] == "fwdbwd"]
    ps = sorted({r["p"] for r in ok}) or [1]
    baseline = baseline_method(res)
    for key, ylabel, fname in (("tflops_per_gpu", "TFLOP/s per GPU", "tflops.png"),
                               ("peak_bytes", "peak GiB per rank", "memory.png")):
        fig, axes = plt.subplots(2, len(ps), figsize=(5 * len(ps), 8), squeeze=False)
        for row, causal in enumerate((True, False)):
            for col, p in enumerate(ps):
                ax = axes[row][col]
                cell = [r for r in ok if r["p"] == p and r["causal"] == causal and r.get(key) is not None]
                for name in METHODS:
                    pts = sorted((r["n"], r[key] / (GiB if key == "peak_bytes" else 1)) for r in cell if r["method"] == name)
                    if pts:
                        ax.plot(*zip(*pts), marker="o", label=name)
                base = sorted((r["n"], r[key] / GiB / p if key == "peak_bytes" else r[key]) for r in ok
                              if r["method"] == baseline and r["p"] == 1 and r["causal"] == causal and r.get(key))
                if base and p > 1:
                    # The single-GPU kernel per GPU: its rate, or its peak divided by p (the ideal).
                    label = f"1-GPU {baseline}" if key == "tflops_per_gpu" else f"1-GPU {baseline} peak / p"
                    ax.plot(*zip(*base), "kx--", label=label)
                ax.set_xscale("log", base=2)
                ax.set_title(f"{'causal' if causal else 'non-causal'}, p={p}")
                ax.set_xlabel("total n")
                ax.set_ylabel(ylabel)
                ax.grid(alpha=0.3)
                if cell:
                    ax.legend(fontsize=7)
        fig.suptitle(f"MHA fwd+bwd — {header(res)[:110]}", fontsize=8)
        fig.tight_layout()
        fig.savefig(out / fname, dpi=90)
        plt.close(fig)
    return [f"plots: {out / 'tflops.png'}, {out / 'memory.png'}"]


def results_section(res: dict, table: str, targets: list[str]) -> str:
    cmd = " ".join(res["phases"][0].get("argv", [])) if res["phases"] else ""
    return "\n".join([
        RESULTS_BEGIN,
        f"## {max((p['date'] for p in res['phases']), default='?')[:10]} — attention benchmark "
        "(benchmarks/bench_attention.py)",
        header(res) + ".",
        f"Phase arguments: `{cmd}`. Metric definitions: Note [Benchmark metrics] in bench_attention.py.",
        "", "Targets:", "```", *targets, "```", "", "```", table, "```", RESULTS_END,
    ])


GENERATED_HEADING = "attention benchmark (benchmarks/bench_attention.py)"


def update_results_md(text: str, section: str) -> str:
    """`text` with its generated section replaced by `section` (appended when it has none).
    Only the generated part between the markers is replaced: from its heading to its last code
    fence. Hand-written text that ended up between the markers (above the heading, below the
    table, or all of it when there is no generated heading) is kept around the new section."""
    if RESULTS_BEGIN in text and RESULTS_END in text:
        before, rest = text.split(RESULTS_BEGIN, 1)
        old, after = rest.split(RESULTS_END, 1)
        lines = old.split("\n")
        at = next((i for i, line in enumerate(lines) if line.startswith("## ") and GENERATED_HEADING in line), None)
        if at is None:  # nothing generated here: keep it all
            head, tail = lines, []
        else:
            fences = [i for i in range(at, len(lines)) if lines[i].strip() == "```"]
            head, tail = lines[:at], lines[fences[-1] + 1:] if fences else []
        head, tail = "\n".join(head).strip("\n"), "\n".join(tail).strip("\n")
        return before + (head + "\n\n" if head else "") + section + ("\n\n" + tail if tail else "") + after
    return text.rstrip("\n") + "\n\n" + section + "\n"


def report(paths: list[Path], out: Path, results_md: str | None) -> str:
    res = load_results(paths)
    derive(res)
    res["targets"] = check_targets(res)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(res, indent=1))
    table = format_table(res)
    text = "\n".join([header(res), "", "targets:", *res["targets"], "", table])
    (out / "table.txt").write_text(text + "\n")
    msgs = plot(res, out)
    section = results_section(res, table, res["targets"])
    repo_md = HERE / "RESULTS.md"
    src = Path(results_md) if results_md else repo_md
    (out / "RESULTS.md").write_text(update_results_md(src.read_text() if src.exists() else "# Measured results\n", section))
    if results_md:
        Path(results_md).write_text((out / "RESULTS.md").read_text())
        msgs.append(f"updated {results_md}")
    return "\n".join(msgs + ["", text])


# ---------------------------------------------------------------------------------------
# launcher: one torchrun per world size, budget shared, report after each


PHASE_FLAGS = ["score_mod", "lengths", "dilated_lengths", "dilated_base", "causal", "methods", "p1_methods", "reps", "target_seconds",
               "max_iter_seconds", "nccl_timeout", "profile", "trace_dir"]
PHASE_WEIGHT = {1: 0.32, 2: 0.18, 4: 0.5}  # share of the remaining budget, by world size


def phase_argv(args) -> list[str]:
    argv = ["--attn", ",".join(args.attn), "--modes", ",".join(args.modes)]
    for name in PHASE_FLAGS:
        v = getattr(args, name)
        if v is None:
            continue
        argv += [f"--{name.replace('_', '-')}", ",".join(map(str, v)) if isinstance(v, list) else str(v)]
    return argv + (["--smoke"] if args.smoke else [])


def launch_all(args) -> int:
    import tempfile

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # inherited by every phase
    out = Path(args.out)
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="ringcc_bench_"))
    work.mkdir(parents=True, exist_ok=True)
    deadline = T0 + 60.0 * args.max_minutes
    probing = bool(args.maxlen_methods) and not args.smoke
    reserve = 20.0 + (60.0 * args.maxlen_minutes if probing else 0.0)  # the report, the max-length probes
    if deadline - time.monotonic() - reserve < 30:
        raise SystemExit(f"--max-minutes {args.max_minutes} leaves the phases nothing after the report (20 s)"
                         + (f" and --maxlen-minutes {args.maxlen_minutes}" if probing else "")
                         + ": raise --max-minutes or lower --maxlen-minutes")
    gpus = None
    if not args.smoke:
        gpus = torch.cuda.device_count()
    parts, worlds = [], list(args.worlds)
    for i, p in enumerate(worlds):
        if gpus is not None and p > gpus:
            print(f"skip p={p}: {gpus} GPUs visible", flush=True)
            continue
        rest = worlds[i:]
        share = (deadline - time.monotonic() - reserve) * PHASE_WEIGHT.get(p, 0.3) / sum(PHASE_WEIGHT.get(w, 0.3) for w in rest)
        if share < 30:
            print(f"skip p={p}: {share:.0f} s of budget left", flush=True)
            continue
        part = work / f"part_p{p}.json"
        part.unlink(missing_ok=True)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={p}",
               str(Path(__file__).resolve()), "phase", "--part", str(part), "--max-minutes", f"{share / 60:.3f}",
               *phase_argv(args)]
        print(f"=== p={p}: budget {share:.0f} s: {' '.join(cmd[3:])}", flush=True)
        proc = subprocess.Popen(cmd, start_new_session=True)
        try:
            rc = proc.wait(timeout=share + 90)
        except subprocess.TimeoutExpired:
            print(f"p={p}: past its budget + 90 s; stopping it (its finished cells are kept)", flush=True)
            _stop_job(proc, grace=15)
            rc = proc.returncode
        if rc:
            print(f"p={p}: exit code {rc}", flush=True)
        if part.exists():
            parts.append(part)
            if i + 1 < len(worlds) and not args.smoke:
                report(parts, out, None)  # so that a run cut short still leaves results
    if not parts:
        print("no phase produced results", flush=True)
        return 1
    if probing:
        print(f"=== max-length probes: {deadline - 20.0 - time.monotonic():.0f} s", flush=True)
        part = work / "part_maxlen.json"
        part.write_text(json.dumps({"phases": [], "records": [], "maxlen": run_maxlen(args, parts, work, deadline - 20.0)}))
        parts.append(part)
    print(report(parts, out, args.results_md), flush=True)
    return 0


def main(argv=None) -> int:
    args = finish_args(build_parser().parse_args(argv))
    if args.list:
        for name, m in METHODS.items():
            print(f"{name:<24} family={m.family:<12} worlds={m.worlds:<6} cpu={m.cpu} gpu={m.gpu}")
        return 0
    if args.command == "phase":
        run_phase(args)
        return 0
    if args.command == "probe":
        run_probe(args)
        return 0
    if args.command == "report":
        if not args.inputs:
            raise SystemExit("report needs results.json or part files")
        print(report([Path(p) for p in args.inputs], Path(args.out), args.results_md))
        return 0
    return launch_all(args)


if __name__ == "__main__":
    sys.exit(main())
