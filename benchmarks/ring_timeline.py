"""Where a ring attention step loses time: a GPU timeline of one fwd+bwd (or fwd) iteration, per setting.

    torchrun --nproc-per-node 2 benchmarks/ring_timeline.py --n-local 16384 --budgets auto,0 --json t.json

For each setting (ring workspace budget x transfers on/off) it times the iteration (CUDA events,
median, slowest rank), then profiles one more and reads the trace of rank 0's GPU:
  span      first kernel start .. last kernel end
  compute   time the compute stream runs a kernel (attention, accumulation, casts)
  nccl only time only communication kernels run
  idle      time no kernel runs at all
and splits the compute stream's gaps (> --gap-us) by cause: "cpu late" when the next kernel was
launched by the host after the gap had begun (the host is the bottleneck there), "waiting" when
it was launched in time but waited for something (a transfer it depends on).
CPU/gloo (--cpu): times only (no kernel timeline). Writes JSON with every gap over the threshold.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist


def _intervals_union(iv: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for s, e in sorted(iv):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total


def _host_during(host_ops: list[dict], start: float, end: float, top: int = 4) -> list[str]:
    """The most specific host ops that cover most of [start, end]: "name (overlap us / op us)"."""
    hits = []
    for e in host_ops:
        ov = min(end, e["ts"] + e["dur"]) - max(start, e["ts"])
        if ov > 0.3 * (end - start):
            hits.append((-ov, e["dur"], e["name"][:50]))
    hits.sort()
    # Of the ops covering the gap, the shortest are the innermost: they name the cause.
    hits = sorted(hits[: 4 * top], key=lambda h: h[1])[:top]
    return [f"{name} ({-ov:.0f}/{dur:.0f} us)" for ov, dur, name in hits]


def analyze_trace(events: list[dict], gap_us: float = 30.0) -> dict:
    """Summary of a chrome trace's GPU kernels (see the module docstring); times in µs."""
    kernels = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
               and "spin_kernel" not in e.get("name", "")]  # the spin that puts the host ahead is not the step
    if not kernels:
        return {"kernels": 0}
    launches = {}
    for e in events:
        if e.get("ph") == "X" and e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {}):
            launches[e["args"]["correlation"]] = e
    is_nccl = lambda e: "nccl" in e["name"].lower()  # noqa: E731
    # Host ops of the launching thread: what the host was doing during a gap it caused.
    tids = [e.get("tid") for e in launches.values()]
    main_tid = max(set(tids), key=tids.count) if tids else None
    host_ops = [e for e in events if e.get("ph") == "X" and e.get("tid") == main_tid
                and e.get("cat") in ("cpu_op", "user_annotation", "cuda_runtime", "python_function")]
    busy_by_stream: dict = {}
    for e in kernels:
        if not is_nccl(e):
            st = e.get("args", {}).get("stream")
            busy_by_stream[st] = busy_by_stream.get(st, 0.0) + e["dur"]
    compute_stream = max(busy_by_stream, key=busy_by_stream.get) if busy_by_stream else None
    t0 = min(e["ts"] for e in kernels)
    t1 = max(e["ts"] + e["dur"] for e in kernels)
    span = t1 - t0
    iv = lambda es: [(e["ts"], e["ts"] + e["dur"]) for e in es]  # noqa: E731
    comp = [e for e in kernels if e.get("args", {}).get("stream") == compute_stream and not is_nccl(e)]
    nccl = [e for e in kernels if is_nccl(e)]
    busy_all = _intervals_union(iv(kernels))
    busy_compute = _intervals_union(iv(comp))
    busy_non_nccl = _intervals_union(iv([e for e in kernels if not is_nccl(e)]))
    gaps, cpu_late, waiting = [], 0.0, 0.0
    comp.sort(key=lambda e: e["ts"])
    end = comp[0]["ts"] + comp[0]["dur"] if comp else 0.0
    prev = comp[0] if comp else None
    for e in comp[1:]:
        gap = e["ts"] - end
        if gap > gap_us:
            launch = launches.get(e.get("args", {}).get("correlation"))
            late = launch is not None and launch["ts"] + launch.get("dur", 0.0) > end + 0.5 * gap
            cpu_late += gap if late else 0.0
            waiting += 0.0 if late else gap
            gaps.append({"us": round(gap, 1), "cause": "cpu late" if late else "waiting", "at_us": round(end - t0, 1),
                         "after": prev["name"][:60], "before": e["name"][:60],
                         "host": _host_during(host_ops, end, e["ts"]) if late else []})
        if e["ts"] + e["dur"] > end:
            end, prev = e["ts"] + e["dur"], e
    copies = _copy_batches(kernels, compute_stream, t0)
    for g in gaps:
        if g["cause"] == "waiting":
            g["own_batch"] = _batch_near(copies, g["at_us"], g["at_us"] + g["us"])
    gaps.sort(key=lambda g: -g["us"])
    # The host's view of the step (record_function "timeline_step" around it): how long the
    # host took to issue it, and how long after the step began the first kernel started.
    marks = [e for e in events if e.get("ph") == "X" and e.get("name") == "timeline_step"]
    host = {"host_issue_us": marks[0]["dur"], "first_kernel_after_us": t0 - marks[0]["ts"]} if marks else {}
    return {"kernels": len(kernels), "span_us": span, **host, "compute_busy_us": busy_compute,
            "non_nccl_busy_us": busy_non_nccl, "nccl_only_us": busy_all - busy_non_nccl,
            "idle_us": span - busy_all, "nccl_kernel_us": sum(e["dur"] for e in nccl),
            "gaps_cpu_late_us": cpu_late, "gaps_waiting_us": waiting, "gaps": gaps,
            "copies": _copy_summary(copies, [(s - t0, e - t0) for s, e in iv(comp)]),
            "families": kernel_families(comp)}


def _copy_batches(kernels: list[dict], compute_stream, t0: float, join_us: float = 20.0) -> list[dict]:
    """This rank's outgoing ring copies (memcpys off the compute stream), grouped into batches:
    copies that start within `join_us` of the previous ones' end are one batch (one commit
    issues its copies back to back). Times in µs from the first kernel."""
    mc = sorted((e for e in kernels if e.get("cat") == "gpu_memcpy" and e.get("args", {}).get("stream") != compute_stream),
                key=lambda e: e["ts"])
    batches: list[dict] = []
    for e in mc:
        s, end, nbytes = e["ts"] - t0, e["ts"] + e["dur"] - t0, int(e.get("args", {}).get("bytes", 0) or 0)
        if batches and s <= batches[-1]["end_us"] + join_us:
            b = batches[-1]
            b["end_us"], b["bytes"], b["copies"] = max(b["end_us"], end), b["bytes"] + nbytes, b["copies"] + 1
        else:
            batches.append({"start_us": s, "end_us": end, "bytes": nbytes, "copies": 1})
    return batches


def _batch_near(batches: list[dict], gap_start: float, gap_end: float) -> dict | None:
    """The outgoing batch that ended last before a gap of the compute stream ended (µs from the
    first kernel, as the batches): its end shortly before the gap's end means the compute
    stream waited for this rank's own sending (the next rank's slot was not free yet, or the
    copy was slow); an end long before it means the wait was for the previous rank's batch."""
    done = [b for b in batches if b["end_us"] <= gap_end + 10.0]
    if not done:
        return None
    b = max(done, key=lambda b: b["end_us"])
    return {"start_rel_gap_us": round(b["start_us"] - gap_start, 1), "end_rel_gap_end_us": round(b["end_us"] - gap_end, 1),
            "dur_us": round(b["end_us"] - b["start_us"], 1), "mbytes": round(b["bytes"] / 2**20, 1)}


def _copy_summary(batches: list[dict], compute: list[tuple[float, float]]) -> dict:
    """Outgoing batches: how many, their bytes, time, rate, and how much of it ran beside the
    compute stream's kernels (`compute`: intervals in the batches' time base)."""
    if not batches:
        return {"batches": 0}
    spans = [(b["start_us"], b["end_us"]) for b in batches]
    busy, total_bytes = _intervals_union(spans), sum(b["bytes"] for b in batches)
    beside = busy + _intervals_union(compute) - _intervals_union(spans + compute)
    durs = sorted(e - s for s, e in spans)
    return {"batches": len(batches), "mbytes": total_bytes / 2**20, "busy_us": busy, "beside_compute_us": beside,
            "gb_per_s": total_bytes / busy / 1e3 if busy else 0.0, "batch_us_median": statistics.median(durs),
            "batch_us_max": durs[-1]}


def _step(q, k, v, dout, causal: bool, layout: str, backward: bool = True):
    import ringcc

    if not backward:  # as the harness's forward-only mode
        with torch.no_grad():
            ringcc.ring_attention(q, k, v, is_causal=causal, layout=layout)
        return
    out = ringcc.ring_attention(q, k, v, is_causal=causal, layout=layout)
    torch.autograd.grad(out, (q, k, v), dout)


KERNEL_FAMILIES = (  # (family, name fragments), first match wins
    ("attention fwd", ("fprop", "flash_fwd", "fmha_fwd", "attention_fwd")),
    ("attention bwd", ("bprop", "dgrad", "flash_bwd", "fmha_bwd", "attention_bwd", "dot_do_o")),
    ("compiled (merge)", ("triton_",)),
    ("ring sums (Triton)", ("_merge_kernel", "_add_kernel")),
    ("memcpy", ("Memcpy",)),
    ("memset", ("Memset",)),
    ("reduce", ("reduce_kernel",)),
    ("elementwise", ("elementwise_kernel", "CatArrayBatched", "fill")),
)


def kernel_families(kernels: list[dict]) -> dict[str, dict]:
    """Time and count of a stream's kernels by family (KERNEL_FAMILIES; "other" for the rest)."""
    out: dict[str, dict] = {}
    for e in kernels:
        fam = next((f for f, keys in KERNEL_FAMILIES if any(k in e["name"] for k in keys)), "other")
        d = out.setdefault(fam, {"us": 0.0, "count": 0})
        d["us"] += e["dur"]
        d["count"] += 1
    return out


def trace_events(prof) -> list[dict]:
    """The chrome-trace events of a finished torch.profiler run."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text())
    return events["traceEvents"] if isinstance(events, dict) else events


class Ranks:
    """What bench_attention.time_ms needs of its Env: the device kind, a barrier, a max over ranks."""

    def __init__(self, device):
        self.device, self.cuda = device, device.type == "cuda"

    def barrier(self) -> None:
        if dist.is_initialized():
            dist.barrier()
        if self.cuda:
            torch.cuda.synchronize()

    def all_max(self, values: list[float]) -> list[float]:
        self.own = list(values)  # this rank's own values of the last call (`rank_medians`)
        if not dist.is_initialized():
            return list(values)
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.tolist()


def rank_medians(env: Ranks) -> list[float]:
    """Every rank's own median of the values of its last `all_max` (rank order): a slow card or
    a late start shows as the rank that sets the slowest-rank time."""
    mine = statistics.median(env.own)
    if not dist.is_initialized():
        return [mine]
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return every


@functools.lru_cache(maxsize=None)
def _spin_cycles_per_ms(device) -> float | None:
    """GPU clock cycles of `_compat.cuda_spin` per millisecond on `device`, measured once; None
    where the ringcc under test predates `cuda_spin` (an A/B against older code)."""
    from ringcc import _compat

    if not hasattr(_compat, "cuda_spin"):
        return None
    _compat.cuda_spin(1_000_000)  # warm
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    _compat.cuda_spin(10_000_000)
    b.record()
    b.synchronize()
    return 10_000_000 / max(a.elapsed_time(b), 1e-3)


def time_behind_spin(step, cycles: float, ms_ahead: float, iters: int, env) -> list[float]:
    """Per-iteration ms (slowest rank) of `step` issued while the GPU still runs a spin of
    `ms_ahead` (`cycles` per ms; 0: from an idle GPU), the ranks lined up after it."""
    from bench_attention import time_ms

    return time_ms(step, 0, iters, env, before=(lambda: aligned_spin(cycles * ms_ahead)) if ms_ahead > 0 else None)


def time_host_ahead(step, args, env, device) -> list[float]:
    """`step` behind a spin of --host-ahead-ms, so the host is ahead of the GPU (its launch cost
    hidden, as inside a model); [] when switched off or unavailable."""
    cycles = _spin_cycles_per_ms(device) if args.host_ahead_ms > 0 else None
    if cycles is None:
        return []
    return time_behind_spin(step, cycles, args.host_ahead_ms, args.iters, env)


_TOKEN: dict = {}


def aligned_spin(cycles: float) -> None:
    """Keep this rank's GPU busy for `cycles` clock cycles, then line the ranks' streams up with
    a one-element all_reduce (queued, the host does not wait): the spin's length in time
    depends on each card's clock, and a ring whose ranks start apart would time that skew
    (up to 0.6 ms behind a 20 ms spin on 2 x H200) as if it were the step's."""
    from ringcc import _compat

    _compat.cuda_spin(cycles)
    if dist.is_initialized():
        dev = torch.cuda.current_device()
        if dev not in _TOKEN:
            _TOKEN[dev] = torch.zeros(1, device=dev)
        dist.all_reduce(_TOKEN[dev])


def host_profile(step, iters: int, env, rows: int = 30) -> str:
    """cProfile of `iters` steps on this rank (host side; the GPU synchronised once at the
    end): the host functions by their own time."""
    import cProfile
    import io
    import pstats

    env.barrier()
    prof = cProfile.Profile()
    # cProfile sees one thread: the backward runs on this one too, not on autograd's device thread
    with torch.autograd.set_multithreading_enabled(False):
        step()  # unprofiled: the first cuDNN calls on this thread were slow (160 ms over 24 calls, 2 x H200)
        torch.cuda.synchronize()
        prof.enable()
        for _ in range(iters):
            step()
        torch.cuda.synchronize()
        prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(rows)
    pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(rows)
    return buf.getvalue()


# Host functions timed by --host-breakdown, as "module:attribute" where the callers look them up
# (an imported name is patched in the importing module). Times are inclusive: block_fwd
# contains its cuDNN call, commit its driver calls.
HOST_SITES = (
    "ringcc.runtime.ops:_check_inputs", "ringcc.runtime.ops:_check_same_call", "ringcc.runtime.ops:_setup",
    "ringcc.runtime.workspace:ring_kv_chunk", "ringcc.runtime.ring:_ring_forward_chunk", "ringcc.runtime.ops:ring_forward", "ringcc.runtime.ops:ring_backward",
    "ringcc.runtime.ring:ring_comm", "ringcc.runtime.ring:RingSetup.masked_calls",
    "ringcc.runtime.kernels:block_fwd", "ringcc.runtime.kernels:block_bwd",
    "ringcc._compat:cuda_cudnn_fwd", "ringcc._compat:cuda_cudnn_bwd",
    "ringcc.runtime.ring:merge_", "ringcc.runtime.ring:_accumulate", "ringcc.runtime.ring:copy_by_kernel",
    "ringcc.runtime.ring:_merge_block", "ringcc.runtime.ring:add_into", "ringcc.runtime.ring:_copy_rows_outside",
    "ringcc.runtime.merge:_merge_compiled",
    "ringcc.runtime.comm:CopyEngineRing.send_recv", "ringcc.runtime.comm:CopyEngineRing.commit",
    "ringcc.runtime.comm:CopyEngineRing.wait", "ringcc.runtime.comm:RingComm.send_recv",
    "ringcc.runtime.comm:RingComm.commit", "ringcc.runtime.comm:RingComm.wait",
    "ringcc._compat:CudaDriver.write", "ringcc._compat:CudaDriver.wait_geq",
    "ringcc._compat:CudaDriver.copy", "ringcc._compat:CudaDriver.order",
)


def _resolve(site: str):
    """(object holding the attribute, attribute name) of "module:Attr.sub"."""
    import importlib

    mod, attr = site.split(":")
    owner = importlib.import_module(mod)
    *path, name = attr.split(".")
    for part in path:
        owner = getattr(owner, part)
    return owner, name


def host_breakdown(step, steps: int, ahead_cycles: float | None, env, sites=HOST_SITES) -> list[dict]:
    """Host time per call site over `steps` steps (each issued behind a GPU spin of
    `ahead_cycles`, so the host never waits for the GPU), by perf_counter wrappers that work in
    autograd's backward thread too (cProfile sees only the thread that started it). Every
    wrapper is removed afterwards, also when a step fails."""
    import inspect
    import time

    from ringcc import _compat

    sites = tuple(dict.fromkeys(sites))  # a site twice would wrap its own wrapper
    stats = {s: [0, 0.0, 0.0, 0] for s in sites}  # calls, seconds, first-call offsets, steps with a call
    this_step = {"t0": 0.0, "seen": set()}  # when the step began, the sites called in it so far
    patched = []
    total = 0.0
    try:
        for site in sites:
            try:
                owner, name = _resolve(site)
                original = inspect.getattr_static(owner, name)
            except (ImportError, AttributeError):
                continue  # not in the code under test (an A/B against older code)
            # static and class methods: time the function inside, keep the descriptor
            kind = type(original) if isinstance(original, (staticmethod, classmethod)) else None
            func = original.__func__ if kind else original

            def timed(*a, _f=func, _s=stats[site], _site=site, **kw):
                t = time.perf_counter()
                if _site not in this_step["seen"]:  # how long after the step's start the site is first reached
                    this_step["seen"].add(_site)
                    _s[2] += t - this_step["t0"]
                    _s[3] += 1
                try:
                    return _f(*a, **kw)
                finally:
                    _s[0] += 1
                    _s[1] += time.perf_counter() - t

            own = not isinstance(owner, type) or name in owner.__dict__  # else inherited: deleted again after
            setattr(owner, name, kind(timed) if kind else timed)
            patched.append((owner, name, original if own else None))
        for _ in range(steps):
            env.barrier()
            if ahead_cycles:
                _compat.cuda_spin(ahead_cycles)
            t = this_step["t0"] = time.perf_counter()
            this_step["seen"] = set()
            step()
            total += time.perf_counter() - t
    finally:
        for owner, name, original in reversed(patched):
            if original is None:
                delattr(owner, name)
            else:
                setattr(owner, name, original)
    rows = [{"site": "step (the whole fwd+bwd)", "calls_per_step": 1.0, "ms_per_step": 1e3 * total / steps,
             "us_per_call": 1e6 * total / steps, "first_call_us": 0.0}]
    for site, (calls, secs, first, seen) in stats.items():
        if calls:
            rows.append({"site": site.split(":")[1], "calls_per_step": calls / steps, "ms_per_step": 1e3 * secs / steps,
                         "us_per_call": 1e6 * secs / calls, "first_call_us": 1e6 * first / seen})
    return rows


def format_breakdown(rows: list[dict]) -> str:
    """One line per site; "first at": µs from the step's start to the site's first call in it
    (the forward's first kernel call bounds when an idle GPU can start)."""
    out = [f"      {'host site':<32} {'calls/step':>10} {'ms/step':>8} {'us/call':>8} {'first at':>9}"]
    for r in rows:
        out.append(f"      {r['site']:<32} {r['calls_per_step']:>10.1f} {r['ms_per_step']:>8.2f} {r['us_per_call']:>8.1f}"
                   f" {r.get('first_call_us', 0.0):>9.0f}")
    return "\n".join(out)


def run_setting(args, device, budget: str, skip_comm: bool, transport: str = "auto", variant: str = "") -> dict:
    """One setting; `variant` "payload": the copy-engine ring's handshake without its copies,
    "half-grads": with half of each dK/dV accumulator's bytes (RINGCC_SKIP_COMM, comm.py)."""
    os.environ["RINGCC_RING_WORKSPACE_MIB"] = budget
    os.environ["RINGCC_SKIP_COMM"] = "1" if skip_comm else (variant or "0")
    os.environ["RINGCC_RING_TRANSPORT"] = transport
    from ringcc.runtime import workspace

    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    gen = torch.Generator(device=device).manual_seed(7 + (dist.get_rank() if dist.is_initialized() else 0))
    shape = (1, args.heads, args.n_local, args.head_dim)
    kv_shape = (1, args.kv_heads or args.heads, args.n_local, args.head_dim)
    q = torch.randn(shape, device=device, dtype=dtype, generator=gen).requires_grad_()
    k, v = (torch.randn(kv_shape, device=device, dtype=dtype, generator=gen).requires_grad_() for _ in range(2))
    dout = torch.randn(shape, device=device, dtype=dtype, generator=gen)
    world = dist.get_world_size() if dist.is_initialized() else 1
    zz = args.causal and args.layout == "zigzag"
    chunk = workspace.ring_kv_chunk(q, k, None, world, zz) or kv_shape[1]
    try:
        chunk_fwd = workspace.ring_kv_chunk(q, k, None, world, zz, forward=True) or kv_shape[1]
    except TypeError:  # code under test from before the forward had its own chunks (A/B)
        chunk_fwd = chunk
    step = functools.partial(_step, q, k, v, dout, args.causal, args.layout, not args.forward_only)
    from bench_attention import time_ms  # benchmarks/ is this script's directory

    env = Ranks(device)
    host: list[float] = []
    times = time_ms(step, args.warmup, args.iters, env, host=host if cuda else None)
    per_rank = rank_medians(env)
    import ringcc

    with torch.no_grad():  # a fingerprint of the forward output, to compare runs of other code (A/B)
        out = ringcc.ring_attention(q, k, v, is_causal=args.causal, layout=args.layout).double()
        checksum = [float(out.sum()), float(out.abs().sum())]
        del out
    label = "-" if skip_comm else {"": transport, "payload": "handshake"}.get(variant, variant)
    rec = {"budget": budget, "skip_comm": skip_comm, "transport": label, "kv_heads_per_chunk": chunk,
           "kv_heads_per_chunk_fwd": chunk_fwd, "ms": statistics.median(times),
           "ms_iters": times, "ms_per_rank": per_rank, "out_checksum_rank0": checksum}
    if args.host_breakdown:
        cycles = _spin_cycles_per_ms(device) if cuda else None
        rec["host_breakdown"] = host_breakdown(step, args.host_breakdown, cycles and cycles * 40, env)
    if cuda:
        # The same step issued while the GPU is still busy (the host ahead, as in a model's
        # middle), and the host's own issue time: what of `ms` is the host's launch cost.
        ahead = time_host_ahead(step, args, env, device)
        if ahead:
            rec["ms_host_ahead_per_rank"] = rank_medians(env)
        rec.update(host_issue_ms=statistics.median(host),
                   ms_host_ahead=statistics.median(ahead) if ahead else None, ms_host_ahead_iters=ahead)
        cycles = _spin_cycles_per_ms(device) if args.ahead_sweep else None
        if cycles is not None:
            # The step behind spins of several lengths: how far ahead the host must start for the
            # GPU never to wait for it (the step's time stops falling there).
            rec["ahead_sweep"] = {ms_ahead: statistics.median(time_behind_spin(step, cycles, ms_ahead, args.iters, env))
                                  for ms_ahead in (float(x) for x in args.ahead_sweep.split(","))}
        if args.cprofile:
            rec["cprofile"] = host_profile(step, args.cprofile, env)
        from torch.autograd.profiler import record_function
        from torch.profiler import ProfilerActivity, profile

        env.barrier()
        spin = _spin_cycles_per_ms(device) if args.profile_ahead_ms > 0 else None
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            if spin:  # the host (slowed by the profiler) ahead of the GPU: gaps are then waits, not launches
                aligned_spin(spin * args.profile_ahead_ms)
            with record_function("timeline_step"):
                step()
            torch.cuda.synchronize()
        tl = analyze_trace(trace_events(prof), args.gap_us)
        every = [None] * world
        if dist.is_initialized():
            dist.all_gather_object(every, tl)
        else:
            every = [tl]
        rec["timeline"], rec["timeline_ranks"] = every[0], every
    del q, k, v, dout, step
    if cuda:
        torch.cuda.empty_cache()
    return rec


def run_baseline(args, device, world: int) -> dict:
    """The single-GPU cuDNN kernel on the whole length (n_local * p tokens), on rank 0 while
    the other ranks wait, timed the same two ways as the ring settings."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from bench_attention import time_ms

    env, rank = Ranks(device), dist.get_rank() if dist.is_initialized() else 0
    if rank != 0:
        def step():  # the other ranks only take part in the barriers
            return None
    else:
        gen = torch.Generator(device=device).manual_seed(11)
        n = args.n_local * world
        q = torch.randn(1, args.heads, n, args.head_dim, device=device, dtype=torch.bfloat16, generator=gen)
        kv = [torch.randn(1, args.kv_heads or args.heads, n, args.head_dim, device=device, dtype=torch.bfloat16,
                          generator=gen) for _ in range(2)]
        q, k, v = (t.requires_grad_() for t in (q, *kv))
        dout = torch.randn_like(q)

        def step():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION), torch.set_grad_enabled(not args.forward_only):
                out = F.scaled_dot_product_attention(q, k, v, is_causal=args.causal, enable_gqa=k.shape[1] != q.shape[1])
            if not args.forward_only:
                torch.autograd.grad(out, (q, k, v), dout)
    times = time_ms(step, args.warmup, args.iters, env)
    ahead = time_host_ahead(step, args, env, device)
    return {"n": args.n_local * world, "ms": statistics.median(times),
            "ms_host_ahead": statistics.median(ahead) if ahead else None}


def format_rows(recs: list[dict]) -> str:
    """One row per setting: times (slowest rank), and rank 0's profiled iteration."""
    head = (f"{'budget':>7} {'comm':>5} {'transport':>11} {'heads/chunk f/b':>15} {'ms':>8} {'ahead ms':>8} {'host ms':>8} "
            f"{'span ms':>8} {'compute':>8} {'nccl only':>9} {'idle':>7} {'gaps: cpu late':>14} {'waiting':>8} "
            f"{'1st kernel':>10}")
    out = [head, "-" * len(head)]
    for r in recs:
        t = r.get("timeline") or {}
        ms = lambda key: "-" if key not in t else f"{t[key] / 1e3:.2f}"  # noqa: E731
        opt = lambda key: "-" if r.get(key) is None else f"{r[key]:.2f}"  # noqa: E731
        out.append(f"{r['budget']:>7} {'off' if r['skip_comm'] else 'on':>5} {r.get('transport', 'nccl'):>11} "
                   f"{str(r.get('kv_heads_per_chunk_fwd', '-')) + '/' + str(r['kv_heads_per_chunk']):>15} "
                   f"{r['ms']:>8.2f} {opt('ms_host_ahead'):>8} {opt('host_issue_ms'):>8} "
                   f"{ms('span_us'):>8} {ms('compute_busy_us'):>8} {ms('nccl_only_us'):>9} "
                   f"{ms('idle_us'):>7} {ms('gaps_cpu_late_us'):>14} {ms('gaps_waiting_us'):>8} "
                   f"{ms('first_kernel_after_us'):>10}")
    return "\n".join(out)


def format_ranks(recs: list[dict], top: int = 3) -> str:
    """Per setting and rank: the profiled iteration's span, gaps by cause, and its longest gaps."""
    out = []
    for r in recs:
        for key, what in (("ms_per_rank", "ms"), ("ms_host_ahead_per_rank", "ahead ms")):
            if r.get(key):
                out.append(f"  budget {r['budget']} transport {r['transport']}: {what} per rank (own medians) "
                           + " / ".join(f"{x:.2f}" for x in r[key]))
        for i, t in enumerate(r.get("timeline_ranks") or []):
            if not t or "span_us" not in t:
                continue
            out.append(f"  budget {r['budget']} transport {r['transport']} rank {i}: span {t['span_us'] / 1e3:.2f} ms, "
                       f"compute {t['compute_busy_us'] / 1e3:.2f}, cpu late {t['gaps_cpu_late_us'] / 1e3:.2f}, "
                       f"waiting {t['gaps_waiting_us'] / 1e3:.2f}, host issue {t.get('host_issue_us', 0) / 1e3:.2f}")
            fams = t.get("families") or {}
            if fams:
                out.append("      compute stream by kernel family: " + ", ".join(
                    f"{f} {d['us'] / 1e3:.2f} ms ({d['count']})" for f, d in sorted(fams.items(), key=lambda x: -x[1]["us"])))
            c = t.get("copies") or {}
            if c.get("batches"):
                out.append(f"      outgoing copies: {c['batches']} batches, {c['mbytes']:.0f} MiB, busy {c['busy_us'] / 1e3:.2f} ms "
                           f"({c['gb_per_s']:.0f} GB/s while copying), beside kernels {c['beside_compute_us'] / 1e3:.2f} ms; "
                           f"batch median {c['batch_us_median']:.0f} us, max {c['batch_us_max']:.0f} us")
            for g in t.get("gaps", [])[:top]:
                out.append(f"      gap {g['us']} us ({g['cause']}) at {g.get('at_us', 0) / 1e3:.2f} ms "
                           f"after {g['after']} before {g['before']}")
                b = g.get("own_batch")
                if b:
                    out.append(f"          own last batch: {b['mbytes']} MiB in {b['dur_us']} us, started {b['start_rel_gap_us']} us "
                               f"from the gap's start, ended {b['end_rel_gap_end_us']} us from its end")
                for h in g.get("host", []):
                    out.append(f"          host: {h}")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n-local", type=int, default=16384, help="tokens per rank")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=0, help="K/V heads (GQA); 0 = --heads")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--host-ahead-ms", type=float, default=5.0,
                    help="also time each step issued while the GPU still runs a spin of this length (0: not)")
    ap.add_argument("--baseline", action="store_true",
                    help="also time the 1-GPU cuDNN kernel on the whole length (rank 0), both ways")
    ap.add_argument("--profile-ahead-ms", type=float, default=0.0,
                    help="issue the profiled step behind a GPU spin of this length (the profiler slows the host; "
                         "with the host ahead the timeline's gaps are waits)")
    ap.add_argument("--ahead-sweep", default="",
                    help="also time each step behind GPU spins of these ms, e.g. 0,0.5,1,2,4")
    ap.add_argument("--cprofile", type=int, default=0, help="also cProfile the host over this many steps (rank 0 prints)")
    ap.add_argument("--host-breakdown", type=int, default=0,
                    help="also time the host per call site over this many steps, each behind a 40 ms GPU spin")
    ap.add_argument("--forward-only", action="store_true", help="time the forward alone (no_grad), as the harness's fwd mode")
    ap.add_argument("--causal", type=int, default=1, choices=[0, 1])
    ap.add_argument("--layout", default="zigzag", choices=["zigzag", "contiguous"])
    ap.add_argument("--budgets", default="auto,0", help="RINGCC_RING_WORKSPACE_MIB values (0 = whole heads)")
    ap.add_argument("--no-comm", action="store_true", help="also run each budget with transfers skipped")
    ap.add_argument("--handshake", action="store_true",
                    help="also run each budget on the copy-engine ring with its flags but no copies")
    ap.add_argument("--half-grads", action="store_true",
                    help="also run each budget on the copy-engine ring sending half of each dK/dV accumulator")
    ap.add_argument("--transports", default="auto",
                    help="RINGCC_RING_TRANSPORT values, e.g. copy-engine,nccl (auto: copy engines where usable; "
                         "none: only the settings --handshake / --no-comm add)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--gap-us", type=float, default=30.0)
    ap.add_argument("--cpu", action="store_true", help="gloo on CPU (times only)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    args.causal = bool(args.causal)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    if args.cpu:
        device = torch.device("cpu")
    else:
        if not torch.cuda.is_available():
            raise SystemExit("no CUDA device; use --cpu")
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    if "RANK" in os.environ:
        dist.init_process_group("gloo" if args.cpu else "nccl")
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    recs = []
    for budget in args.budgets.split(","):
        for transport in args.transports.split(","):
            if transport != "none":
                recs.append(run_setting(args, device, budget, False, transport))
        if args.handshake and device.type == "cuda":
            recs.append(run_setting(args, device, budget, False, "copy-engine", variant="payload"))
        if args.half_grads and device.type == "cuda":
            recs.append(run_setting(args, device, budget, False, "copy-engine", variant="half-grads"))
        if args.no_comm:
            recs.append(run_setting(args, device, budget, True))
    base = run_baseline(args, device, world) if args.baseline and device.type == "cuda" else None
    if rank == 0:
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        print(f"device: {name} x{world}; torch {torch.__version__}; n_local {args.n_local}, h {args.heads}, "
              f"d {args.head_dim}, {'causal' if args.causal else 'full'} {args.layout}, {'fwd' if args.forward_only else 'fwd+bwd'}")
        print(format_rows(recs))
        if base:
            print(f"  1-GPU cuDNN SDPA on the whole {base['n']} tokens (rank 0): {base['ms']:.2f} ms, host ahead "
                  f"{base['ms_host_ahead'] or float('nan'):.2f} ms; per GPU at p = {world}: "
                  f"{base['ms'] / world:.2f} / {(base['ms_host_ahead'] or float('nan')) / world:.2f} ms")
            for r in recs:
                eff = lambda a, b: "-" if not a or not b else f"{100 * a / world / b:.1f}%"  # noqa: E731
                print(f"  budget {r['budget']} transport {r['transport']}: efficiency {eff(base['ms'], r['ms'])}, "
                      f"host ahead {eff(base['ms_host_ahead'], r.get('ms_host_ahead'))}")
        for r in recs:
            print(f"  budget {r['budget']} transport {r['transport']}: forward output checksum "
                  f"(rank 0) sum {r['out_checksum_rank0'][0]:.6e} abs {r['out_checksum_rank0'][1]:.6e}")
        print(format_ranks(recs))
        for r in recs:
            if r.get("host_breakdown"):
                print(f"--- host time by call site, budget {r['budget']} transport {r['transport']} (rank 0)\n"
                      f"{format_breakdown(r['host_breakdown'])}")
        for r in recs:
            if r.get("ahead_sweep"):
                print(f"  budget {r['budget']} transport {r['transport']}: ms behind a spin of (ms) "
                      + ", ".join(f"{a:g}: {t:.2f}" for a, t in r["ahead_sweep"].items()))
        for r in recs:
            if r.get("cprofile"):
                print(f"--- host profile, budget {r['budget']} transport {r['transport']} (rank 0)\n{r['cprofile']}")
        if args.json:
            Path(args.json).write_text(json.dumps({"device": name, "world": world, "torch": torch.__version__,
                                                   "args": vars(args), "settings": recs, "baseline": base}, indent=1))
    from bench_attention import leave_group

    leave_group(args.cpu)  # after rank 0 has printed and written the JSON
    return 0


if __name__ == "__main__":
    sys.exit(main())
