"""`ringcc plan MODULE:FACTORY --seq-len N --world-size P`: the memory plan of a model.

FACTORY (a function in a module or a .py file) returns (model, example_inputs) or
(model, example_inputs, options) where options are ringcc Config fields (e.g. a dilation
spec); it may take `seq_len=` to build inputs of that length. The model is traced by
torch.compile with the sequence dim marked dynamic (so n is a symbol, not a constant that
a head dim could equal), rewritten by the ringcc pipeline for P ranks, and planned; the
compiled graph is never run (planning needs no process group and no memory for N tokens).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.util
import inspect
import json
import logging
import os
import re
import sys

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str) -> int:
    """A positive size such as 80GiB (argparse shows the message of an ArgumentTypeError)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(
            f"budget {text!r} is not a size; write e.g. 80GiB, 40GB, 512MiB or a number of bytes")
    size = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if size <= 0:
        raise argparse.ArgumentTypeError(f"budget {text!r} must be more than 0 bytes")
    return size


def positive_int(text: str) -> int:
    """An integer >= 1 (sequence lengths)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number of tokens; got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1; got {value}")
    return value


def writable_path(text: str) -> str:
    """An output file whose folder exists (checked before the work, not after it)."""
    folder = os.path.dirname(os.path.abspath(text))
    if not os.path.isdir(folder):
        raise argparse.ArgumentTypeError(f"no folder {folder!r} for {text!r}; create it first")
    return text


def add_pad_argument(parser: argparse.ArgumentParser) -> None:
    """--pad, the command line's Config(pad=True) (plan and rewrite)."""
    parser.add_argument("--pad", action="store_true",
                        help="pad a length the layout does not divide (p, or 2p for zigzag) with masked tokens")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("target", help="MODULE:FACTORY or path/to/file.py:FACTORY returning (model, inputs[, options])")
    parser.add_argument("--seq-len", type=positive_int, required=True, help="global sequence length N to evaluate at")
    parser.add_argument("--world-size", type=int, default=1, help="number of ranks P to plan for (default 1)")
    parser.add_argument("--budget", type=parse_bytes, default=None, help="memory per rank, e.g. 80GiB: report the longest n that fits")
    parser.add_argument("--json", dest="json_path", type=writable_path, default=None, metavar="PATH",
                        help="write the plan as JSON")
    parser.add_argument("--plot", type=writable_path, default=None, metavar="F.png",
                        help="plot peak bytes per rank vs n for p = 1, 2, 4, 8")
    parser.add_argument("--all", dest="all_nodes", action="store_true",
                        help=f"list every node of the plan (default: the {SHOWN_NODES} largest)")
    add_pad_argument(parser)
    parser.add_argument("--trace-len", type=positive_int, default=None,
                        help="sequence length used for tracing (default: N, capped at 2048 rounded to 4P)")
    parser.add_argument("--seq-dim", type=int, default=1, help="sequence dim of the tensor inputs (default 1)")
    parser.add_argument("--inference", action="store_true", help="plan the forward only (no backward)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default=None,
                        help="plan for this device's kernels (default: where the factory's tensors are; "
                             "cuda plans a GPU run from a CPU trace)")
    parser.add_argument("--static", action="store_true",
                        help="trace with constant shapes (sizes equal to N or N/P are taken as the sequence)")


def load_factory(target: str):
    if ":" not in target:
        raise ValueError(f"target {target!r} must be MODULE:FACTORY or path/to/file.py:FACTORY")
    mod_name, fn_name = target.rsplit(":", 1)
    if mod_name.endswith(".py") or os.sep in mod_name:
        if not os.path.exists(mod_name):
            raise ValueError(f"no file {mod_name!r} (target {target!r})")
        spec = importlib.util.spec_from_file_location(os.path.splitext(os.path.basename(mod_name))[0], mod_name)
        module = sys.modules.get(spec.name)
        loaded = getattr(module, "__file__", None)
        if not (loaded and os.path.exists(loaded) and os.path.samefile(loaded, mod_name)):
            # a file not imported yet (one that is keeps its module: its functions stay the
            # ones its importer holds, which pickle finds by name)
            module = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = module
            spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(mod_name)
        except ModuleNotFoundError as e:
            # The console script does not put the working directory on sys.path.
            hint = mod_name.replace(".", os.sep) + ".py"
            also = f" or as a file path: {hint}:{fn_name}" if os.path.exists(hint) else ""
            raise ValueError(f"cannot import {mod_name!r} ({e}); give a module importable from sys.path{also}") from None
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise ValueError(f"{mod_name} has no callable {fn_name!r}")
    if inspect.isclass(fn):
        raise ValueError(f"{target} is a class, not a factory; give a function that builds the model and its "
                         f"example inputs, e.g. `def make(seq_len=1024): return {fn_name}(...), (inputs,)`")
    return fn


def factory_result(made, target: str):
    """(model, inputs, options) from what a factory returned, or a ValueError saying what is wrong."""
    import torch

    expected = "(model, example_inputs) or (model, example_inputs, options)"
    if not isinstance(made, tuple) or len(made) not in (2, 3):
        raise ValueError(f"{target} must return {expected}; got {type(made).__name__}")
    model, inputs = made[0], made[1]
    if not callable(model):
        raise ValueError(f"{target} returned {type(model).__name__} as the model; {expected} starts with an "
                         "nn.Module or a callable")
    inputs = tuple(inputs) if isinstance(inputs, (list, tuple)) else (inputs,)
    wrong = [f"{i}: {type(x).__name__}" for i, x in enumerate(inputs)
             if not isinstance(x, (torch.Tensor, bool, int, float, type(None)))]
    if wrong or not any(isinstance(x, torch.Tensor) for x in inputs):
        raise ValueError(f"{target} must return example_inputs of tensors (and plain numbers), the arguments of "
                         f"model(*example_inputs); got {', '.join(wrong) or 'no tensor'} in "
                         f"{type(made[1]).__name__} of {len(inputs)}")
    options = made[2] if len(made) == 3 else {}
    if not isinstance(options, dict):
        raise ValueError(f"{target} returned {type(options).__name__} as options; expected a dict of ringcc Config fields")
    return model, inputs, dict(options)


def build(factory, seq_len: int, target: str = "the factory"):
    """(model, inputs, options) from a factory, passing seq_len when it takes one."""
    params = inspect.signature(factory).parameters
    return factory_result(factory(seq_len=seq_len) if "seq_len" in params else factory(), target)


def build_options(factory) -> dict:
    """The options a factory returns, without building its inputs at full length."""
    params = inspect.signature(factory).parameters
    made = factory(seq_len=64) if "seq_len" in params else factory()
    return dict(made[2]) if isinstance(made, tuple) and len(made) == 3 else {}


def trace_plans(model, inputs, *, world_size: int, trace_len: int, seq_dim: int = 1, options=None,
                training: bool | None = None, dynamic: bool = True, device_type: str | None = None):
    """Trace `model(*inputs)` (sequence dim dynamic), rewrite it for `world_size` ranks and
    plan every graph dynamo produces. Returns (plans, reports)."""
    import torch

    from ringcc import planner
    from ringcc.config import Config
    from ringcc.passes.base import PassContext
    from ringcc.passes.pipeline import run_pipeline
    from ringcc.report import GraphReport

    config = Config.from_options(dict(options or {}, world_size=world_size, inner="eager"))
    seq_inputs = [x for x in inputs if isinstance(x, torch.Tensor) and x.dim() > seq_dim and x.shape[seq_dim] == trace_len]
    if not seq_inputs:
        raise ValueError(f"no tensor input has length {trace_len} at dim {seq_dim}; pass --seq-dim or check the factory's seq_len")
    if not dynamic:
        return _trace(model, inputs, config, world_size, trace_len, training, device_type, note=None)
    # An input whose other dims are the sequence too (an [n, n] mask) specialises n when only
    # dim seq_dim is marked: then every dim of length trace_len of those inputs is marked, and
    # when that specialises too (a feature dim of that length), the trace is static.
    every = {id(x): [d for d in range(x.dim()) if x.shape[d] == trace_len] for x in seq_inputs}
    attempts = [(lambda x: [seq_dim], None)]  # (dims to mark of a sequence input, note)
    if any(len(dims) > 1 for dims in every.values()):
        attempts.append((lambda x: every[id(x)], f"every dim of length {trace_len} of the sequence inputs traced "
                                                 f"as n (dim {seq_dim} alone was specialised by the model)"))
    attempts.append((lambda x: [], f"traced with static shapes (n = {trace_len}): the model specialised a dynamic n"))
    first = next(i for i, x in enumerate(inputs) if id(x) in every)
    traced = _one_length(model, inputs, [i for i, x in enumerate(inputs) if id(x) in every], seq_dim)
    for i, (dims, note) in enumerate(attempts):
        marked = []
        for j, x in enumerate(inputs):  # a new view per attempt: marks stay off the factory's tensors
            if id(x) in every:
                view = x.view(x.shape)
                for d in dims(x):
                    # the first sequence input holds n; the others' lengths are n through
                    # _one_length, which a mark_dynamic would report as a specialisation
                    (torch._dynamo.mark_dynamic if j == first else torch._dynamo.maybe_mark_dynamic)(view, d)
                x = view
            marked.append(x)
        last = i == len(attempts) - 1
        # dynamo logs a failed guard as an error before raising it: quiet while a retry follows
        quiet = logging.getLogger("torch._guards")
        level = quiet.level
        quiet.setLevel(level if last else logging.CRITICAL)
        try:
            return _trace(traced, marked, config, world_size, trace_len, training, device_type, note=note)
        except Exception as e:  # noqa: BLE001 - only a specialised dynamic dim is retried
            if last or not _specialised(e):
                raise
        finally:
            quiet.setLevel(level)


def _one_length(model, inputs, positions: list[int], seq_dim: int):
    """`model` called with its sequence inputs (at `positions`) checked to be of one length: the
    trace then has one symbol n for all of them. Marked dynamic one by one, each input would
    have its own length symbol, and a value read from one input at the positions of another
    (HF's padding mask looked up at the cache's key positions) would cover only part of it.
    The wrapper takes the forward's own argument names and calls the model `self`, so that
    dynamo names the graph's inputs and parameters as for the model itself."""
    import keyword

    import torch

    if len(positions) < 2:
        return model
    try:
        params = list(inspect.signature(getattr(model, "forward", model)).parameters.values())[:len(inputs)]
    except (TypeError, ValueError):
        params = []
    names = [q.name for q in params if q.kind in (q.POSITIONAL_ONLY, q.POSITIONAL_OR_KEYWORD)]
    if len(names) != len(inputs) or {"self", "torch"} & set(names) or any(keyword.iskeyword(x) for x in names):
        names = [f"input_{i}" for i in range(len(inputs))]
    args = ", ".join(names)
    checks = "".join(f"    torch._check({names[i]}.size({seq_dim}) == {names[positions[0]]}.size({seq_dim}))\n"
                     for i in positions[1:])
    scope: dict = {"torch": torch}
    exec(f"def make(self):\n  def one_length({args}):\n{checks}    return self({args})\n  return one_length\n".replace(
        "\n    ", "\n      "), scope)
    return scope["make"](model)


MADE_INSIDE = "no input dim of length"
TRACE_NOTES = ("every dim of length", "traced with static shapes", MADE_INSIDE)  # how trace_plans traced n


def _specialised(e: BaseException) -> bool:
    """Whether `e` (or what it wraps) is dynamo's error for a dim marked dynamic that the model specialised."""
    from torch.fx.experimental.symbolic_shapes import ConstraintViolationError

    return _cause_of_type(e, ConstraintViolationError) is not None


def _trace(model, inputs, config, world_size: int, trace_len: int, training, device_type, note: str | None):
    import torch

    from ringcc import planner
    from ringcc.passes.base import PassContext
    from ringcc.passes.pipeline import run_pipeline
    from ringcc.report import GraphReport

    plans, reports = [], []

    def capture(gm, example_inputs):
        report = GraphReport(graph=f"graph{len(plans)}", world_size=world_size)
        if note:
            report.notes.append(note)
        ctx = PassContext(config=config, report=report, world_size=world_size, group_name="",
                          example_inputs=list(example_inputs))
        gm = run_pipeline(gm, ctx)
        seq_len = trace_len
        made = ctx.scratch.get("seq")
        if made is not None and made.n.is_Integer and int(made.n) != trace_len:
            # the attention sites attend over a length no input has (a ViT's [CLS] token and
            # patches, made from an image of fixed size): that length is the static n
            seq_len = int(made.n)
            report.notes[:] = [f"{MADE_INSIDE} {trace_len} carries the sequence: the model makes its n = {seq_len} "
                               "tokens inside (an image's patches), traced at that one length"] + \
                [text for text in report.notes if text != note]  # how the inputs were traced does not apply
        plan = planner.plan_graph(gm, world_size=world_size, seq_len=seq_len, training=training,
                                  graph_name=report.graph, device_type=device_type)
        report.plan = plan
        plans.append(plan)
        reports.append(report)
        return _placeholder_outputs(gm)

    torch._dynamo.reset()
    try:
        torch.compile(model, backend=capture, dynamic=False)(*inputs)
    finally:
        torch._dynamo.reset()
    return plans, reports


def _placeholder_outputs(gm):
    """A stand-in for the compiled graph: zeros of the output shapes (never runs the ops)."""
    import torch

    from ringcc import _compat

    out_node = next(nd for nd in gm.graph.nodes if nd.op == "output")

    def make(a):
        if isinstance(a, torch.fx.Node):
            val = a.meta.get("example_value", a.meta.get("val"))
            if isinstance(val, torch.Tensor):
                shape = [_compat.size_hint(d) for d in val.shape]
                return torch.zeros(shape, dtype=val.dtype, device=val.device, requires_grad=val.requires_grad)
            if isinstance(val, torch.SymInt):
                return _compat.size_hint(val)
            return val
        if isinstance(a, (list, tuple)):
            return type(a)(make(x) for x in a)
        return a

    def run(*args):
        return make(out_node.args[0])

    return run


def combined(plans, seq_len: int, world_size: int, budget: int | None) -> dict:
    """One JSON object for every graph of the model (the largest peak leads)."""
    from ringcc import planner

    at = [plan.peak_bytes(seq_len, world_size) for plan in plans]
    lead = plans[at.index(max(at))]
    data = {
        "verdict": all(pl.verdict for pl in plans),
        "peak_formula": str(lead.peak),
        "peak_bytes": max(at),
        "seq_len": seq_len,
        "world_size": world_size,
        "culprits": [{"name": c.name, "location": c.location, "size": c.size, "growth": c.growth,
                      "what": c.what, "graph": pl.graph} for pl in plans for c in pl.culprits],
        "reasons": [r for pl in plans for r in pl.reasons],
        "graphs": [],
    }
    for pl in plans:
        d = dataclasses.replace(pl, hints={**pl.hints, planner.n: seq_len, planner.p: world_size}).to_dict()
        data["graphs"].append(d)
    if budget is not None:
        data["budget_bytes"] = budget
        data["max_seq_len"] = min(pl.max_sequence(budget, world_size) for pl in plans)
    return data


def plot(plans, path: str, seq_len: int, budget: int | None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    ns = np.unique(np.geomspace(max(64, seq_len // 64), seq_len * 64, 40).astype(np.int64) // 64 * 64)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    peaks = [pl.peak_function() for pl in plans]
    for world in (1, 2, 4, 8):
        ys = [max(f(int(k), world) for f in peaks) / 2**30 for k in ns]
        ax.loglog(ns, ys, label=f"p = {world}")
    if budget is not None:
        ax.axhline(budget / 2**30, color="k", linestyle="--", label="budget")
    ax.axvline(seq_len, color="gray", linestyle=":")
    ax.set_xlabel("sequence length n")
    ax.set_ylabel("peak memory per rank (GiB)")
    ax.set_title("ringcc plan: " + ("O(n/p)" if all(pl.verdict for pl in plans) else "not O(n/p)"))
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def default_trace_len(seq_len: int, world_size: int) -> int:
    unit = 4 * world_size  # divisible by p, and by 2p for zigzag
    if seq_len <= 2048:
        return seq_len
    return max(unit, 2048 // unit * unit)


def run(args) -> int:
    try:
        static, model, inputs, options, trace_len = _load_target(args)
    except ValueError as e:  # what the user gave: target, factory, sizes
        print(f"ringcc plan: error: {e}", file=sys.stderr)
        return 2
    if args.pad:
        options = {**options, "pad": True}
    try:
        return _plan(args, static, model, inputs, options, trace_len)
    except Exception as e:  # noqa: BLE001 - only a length error is the user's; the rest re-raised
        bad = length_error(e)
        if bad is None:
            raise
        print(f"ringcc plan: error: {bad} (on the command line: --pad)", file=sys.stderr)
        return 2


def length_error(e: BaseException):
    """The SequenceLengthError behind `e` (torch.compile wraps a backend's errors), or None."""
    from ringcc.runtime.layout import SequenceLengthError

    return _cause_of_type(e, SequenceLengthError)


def _cause_of_type(e: BaseException, kind: type):
    """The first exception of type `kind` in `e`'s chain of causes and contexts, or None."""
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, kind):
            return e
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return None


def _load_target(args):
    if args.world_size < 1:
        raise ValueError(f"--world-size must be >= 1; got {args.world_size}")
    # Static shapes are read at the traced length: trace at N itself so that the concrete
    # sizes are exact (a dim equal to N/P is taken as the sequence there).
    factory = load_factory(args.target)
    static = args.static
    if not static and "dilation" in build_options(factory):
        static = True  # the dilated rewrite plans its segments from a static length
    trace_len = args.trace_len or (args.seq_len if static else default_trace_len(args.seq_len, args.world_size))
    model, inputs, options = build(factory, trace_len, args.target)
    if "seq_len" not in inspect.signature(factory).parameters:
        # The factory fixes its own length: trace at that one (evaluate at --seq-len).
        lengths = [x.shape[args.seq_dim] for x in inputs if hasattr(x, "dim") and x.dim() > args.seq_dim]
        if not lengths:
            raise ValueError(f"{args.target} returned no tensor input with a dim {args.seq_dim}; pass --seq-dim")
        trace_len = lengths[0]
    return static, model, inputs, options, trace_len


def _plan(args, static, model, inputs, options, trace_len) -> int:
    from ringcc import planner

    plans, reports = trace_plans(model, inputs, world_size=args.world_size, trace_len=trace_len,
                                 seq_dim=args.seq_dim, options=options,
                                 training=False if args.inference else None, dynamic=not static,
                                 device_type=args.device)
    if not plans:
        raise ValueError(f"{args.target}: dynamo produced no graph to plan")
    if not args.pad:
        from ringcc.passes.shard_sequence import PAD_REMEDY
        from ringcc.runtime.layout import check_length

        for report in reports:  # a symbolic trace plans any n: say when N cannot run as it is
            if report.layout is not None:
                check_length(args.seq_len, args.world_size, report.layout, remedy=PAD_REMEDY)
    at = [dataclasses.replace(plan, hints={**plan.hints, planner.n: args.seq_len, planner.p: args.world_size})
          for plan in plans]
    data = combined(plans, args.seq_len, args.world_size, args.budget)
    print(format_plan(args, at, reports, data))
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(data, f, indent=2)
        print(f"wrote {args.json_path}: the whole plan, with the exact peak formula (peak_formula)")
    if args.plot:
        plot(plans, args.plot, args.seq_len, args.budget)
        print(f"wrote {args.plot}: peak memory per rank against n for p = 1, 2, 4, 8")
    return 0


SHOWN_NODES = 10  # nodes listed by default, the largest at N


def _ranks(p: int) -> str:
    return "1 rank" if p == 1 else f"{p} ranks"


def format_plan(args, plans, reports, data: dict) -> str:
    """The answer first (verdict, peak at N, longest length for the budget), then what breaks
    the verdict, then the largest nodes of the graph with the largest peak."""
    from ringcc.planner import _fmt_bytes, readable_name

    n_, p_ = args.seq_len, args.world_size
    lead = max(range(len(plans)), key=lambda i: plans[i].peak_bytes())
    plan = plans[lead]
    culprits = data["culprits"]
    verdict = ("peak memory per rank is O(n/p): it falls as ranks are added" if data["verdict"] else
               "peak memory per rank is NOT O(n/p) (why: below)")
    sites = sum(len(r.sites) for r in reports)
    lines = [f"ringcc plan {args.target}: n = {n_} tokens on {_ranks(p_)}, "
             f"{'inference' if args.inference else 'training'}",
             f"verdict: {verdict}",
             f"peak per rank: {_fmt_bytes(data['peak_bytes'])} at n = {n_} ({plan.readable_peak()})"]
    if args.budget is not None:
        lines.append(f"longest sequence within {_fmt_bytes(args.budget)} per rank on {_ranks(p_)}: "
                     f"n = {data['max_seq_len']}")
    lines.append(f"attention: {sum(len(r.rewritten) for r in reports)}/{sites} sites rewritten; "
                 f"{sum(len(r.gathers) for r in reports)} sequence gathers; {len(plans)} graph(s)")
    lines += [f"  skipped {s.node} at {s.location}: {s.reason.value} ({s.detail})" for r in reports for s in r.skipped]
    lines += [f"  note: {note}" for note in reports[0].notes if note.startswith(TRACE_NOTES)]
    if culprits or data["reasons"]:
        lines += ["", "why not O(n/p):"]
        lines += [f"  - {readable_name(c['name'])} at {c['location']}: {c['what']} {c['size']} grows like {c['growth']}"
                  for c in culprits]
        lines += [f"  - {reason}" for reason in data["reasons"]]
    rows = plan.node_rows()
    listed = rows if args.all_nodes else sorted(rows, key=lambda r: -r["bytes"])[:SHOWN_NODES]
    if listed:
        title = ("every node" if args.all_nodes or len(rows) <= SHOWN_NODES else
                 f"the {len(listed)} largest of {len(rows)} nodes (--all lists every node)")
        lines += ["", f"{title} of {plan.graph} at n = {n_}, p = {p_}:"]
        name_w = min(40, max(len(readable_name(r["name"])) for r in listed))
        op_w = min(28, max(len(r["op"]) for r in listed))
        lines.append(f"  {'node':{name_w}}  {'op':{op_w}}  {'bytes':>10}  {'live':>9}  source")
        for r in listed:
            name = readable_name(r["name"])
            name = name if len(name) <= name_w else "..." + name[-(name_w - 3):]
            lines.append(f"  {name:{name_w}}  {r['op'][:op_w]:{op_w}}  {_fmt_bytes(r['bytes']):>10}  "
                         f"{r['live'][0]:>4}-{r['live'][1]:<4}  {'' if r['location'].startswith('<') else r['location']}")
    graph = data["graphs"][lead]
    lines.append(f"  resident: parameters{' and gradients' if plan.training else ''} {_fmt_bytes(graph['static_bytes'])}"
                 + (f", copy-engine receive area {_fmt_bytes(graph['area_bytes'])}" if graph["area_bytes"] else ""))
    return "\n".join(lines)
