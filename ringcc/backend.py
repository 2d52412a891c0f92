"""The torch.compile entry point.

`torch.compile(model, backend="ringcc")` finds `ringcc_backend` through the
`torch_dynamo_backends` entry point (no import needed); `backend=ringcc.backend(Config(...))`
or `options={...}` pass settings. The backend rewrites dynamo's torch-level graph with the
pass pipeline, records a report, and hands the result to the inner compiler (inductor by
default, or aot_eager / eager).
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import warnings
import zlib

import sympy
import torch
import torch.distributed as dist

from ringcc import _compat
from ringcc.config import Config, timeout_delta
from ringcc.passes.base import PassContext
from ringcc.passes.discover_sequence import handoff_gathers
from ringcc.passes.pipeline import run_pipeline
from ringcc.releases import check_transformers_release
from ringcc.report import GraphReport, record
from ringcc.runtime.comm import group_extremes, set_timeout
from ringcc.runtime.ops import SAME_BATCH_REMEDY, content_code, schedule_settings
from ringcc.runtime.ring import check_no_launcher
from ringcc.sharded import fsdp_hooks_take_shards, wrap_outputs

_graph_ids = itertools.count()


def sequence_group(config: Config):
    """The process group the sequence is sharded over: Config.group, or the `axis` dimension of
    Config.mesh (None: WORLD)."""
    if config.mesh is None:
        return config.group
    return config.mesh.get_group(config.axis) if config.axis is not None else config.mesh.get_group()


def _world(config: Config) -> tuple[int, str]:
    if config.world_size is not None:
        name = ""
        if dist.is_available() and dist.is_initialized():
            name = _compat.group_name(sequence_group(config))
        return config.world_size, name
    if not config.shard:
        return 1, ""
    if not (dist.is_available() and dist.is_initialized()):
        check_no_launcher("torch.compile(backend='ringcc')",
                          remedy=", or pass Config(world_size=1) (options={'world_size': 1}) to compile for one rank")
        return 1, ""
    group = sequence_group(config)
    group = group if group is not None else dist.group.WORLD
    return dist.get_world_size(group), _compat.group_name(group)


def _outer_reduced(example_inputs, config: Config, world: int) -> frozenset:
    """Graph inputs whose gradients a data-parallel engine averages over the whole sequence group
    (Note [Gradients under data parallelism]); an engine that covers the group but does not
    reduce by the plain mean leaves no way to know the divisor: an error asking for grad_sync."""
    if config.grad_sync == "all_reduce" or world == 1 or not (dist.is_available() and dist.is_initialized()):
        return frozenset()
    group = sequence_group(config)
    mine = set(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))
    found = _compat.data_parallel_means(list(example_inputs))
    covering = set()
    for i, (ranks, mean) in found.items():
        if mine <= set(ranks):
            if not mean and config.grad_sync == "auto":
                raise ValueError(
                    f"a data-parallel engine reduces gradients over ranks {sorted(ranks)}, which include the "
                    f"sequence group's ranks {sorted(mine)}, with a divisor other than its size (FSDP2's "
                    "set_gradient_divide_factor or set_force_sum_reduction_for_comms): ringcc cannot tell which "
                    "share to give it. Set Config.grad_sync='outer' (the engine divides the sum by the whole "
                    "group's size, and ringcc scales each share by p) or 'all_reduce' (ringcc sums over the "
                    "sequence group first)")
            covering.add(i)
        elif config.grad_sync == "outer" and len(mine & set(ranks)) == 1:
            raise ValueError(
                f"Config.grad_sync='outer', but a data-parallel engine reduces graph input {i}'s gradient over "
                f"ranks {sorted(ranks)}, none of them in this rank's sequence group {sorted(mine)} but itself: "
                "nothing would sum the sequence shards' gradients. Use grad_sync='auto' or 'all_reduce'")
    if config.grad_sync == "outer":
        params = {i for i, t in enumerate(example_inputs) if isinstance(t, torch.nn.Parameter)}
        return frozenset(params | covering)
    return frozenset(covering)


def _plan(gm: torch.fx.GraphModule, ctx: PassContext) -> None:
    """Memory plan of the rewritten graph into ctx.report.plan; Config(require_linear_memory=True)
    makes a failed O(n/p) verdict an error. Without that setting a planner failure is a note,
    never a failed compile."""
    from ringcc import planner

    if ctx.config.require_linear_memory:
        planner.plan_for_context(gm, ctx)
        return
    try:
        planner.plan_for_context(gm, ctx)
    except Exception as e:  # the plan is a report; the compile must not depend on it
        ctx.report.notes.append(f"memory planner failed: {type(e).__name__}: {e}")


def _first_rank(config: Config) -> bool:
    """Whether this process is rank 0 of the sequence group (or runs without one): the rank
    that prints the backend's warnings."""
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank(sequence_group(config)) == 0


def _warn_dense(report: GraphReport, config: Config) -> None:
    """One warning line on rank 0 of the sequence group for a graph with attention sites left
    dense: which sites and why (Config(strict=True) raises in the pipeline instead)."""
    skipped = report.skipped
    if not skipped or not _first_rank(config):
        return
    sites = "; ".join(f"{s.form} at {s.location}: {s.reason.value}" + (f" ({s.detail})" if s.detail else "")
                      for s in skipped)
    warnings.warn(f"ringcc: {len(skipped)} of {len(report.sites)} attention site(s) of {report.graph} left dense, "
                  f"each costing O(n) memory per rank (the whole sequence's keys on every rank): {sites}. "
                  "ringcc.last_report() has the details; Config(strict=True) makes this an error",
                  stacklevel=2)


def _warn_differs(report: GraphReport, config: Config) -> None:
    """One warning line on rank 0 of the sequence group for a graph with rewritten sites whose rows
    with every key masked by a finite value are not eager's (Note [Rows with no key] in
    runtime/ops.py): which sites, and what eager gives."""
    differ = [s for s in report.rewritten if s.differs]
    if not differ or not _first_rank(config):
        return
    sites = "; ".join(f"{s.form} at {s.location}: {s.differs}" for s in differ)
    warnings.warn(f"ringcc: {len(differ)} rewritten attention site(s) of {report.graph} differ from eager on query "
                  f"rows that see no key, and only there (a loss that weighs those rows 0, as labels of -100 on "
                  f"padding do, is eager's): {sites}. docs/sharp-edges.md says why", stacklevel=2)


def _publish(report: GraphReport, config: Config) -> None:
    """The graph's report recorded (ringcc.last_report()) and its warnings shown on rank 0."""
    record(report)
    _warn_dense(report, config)
    _warn_differs(report, config)


def compile_graph(gm: torch.fx.GraphModule, example_inputs, config: Config):
    check_transformers_release(gm)
    world, name = _world(config)
    report = GraphReport(graph=f"graph{next(_graph_ids)}", world_size=world)
    ctx = PassContext(config=config, report=report, world_size=world, group_name=name,
                      example_inputs=list(example_inputs), outer_reduced=_outer_reduced(example_inputs, config, world))
    data = _data_inputs(gm, example_inputs, ctx)  # before the passes take the hand-offs' gathers away
    gm = run_pipeline(gm, ctx)
    _plan(gm, ctx)
    try:
        compiled = _inner(gm, example_inputs, config)
    except _compat.restart_analysis():
        # dynamo traces the frame again (AOT specialises a float input that SDPA's dropout_p or
        # scale reads under dynamic shapes): this graph never runs, so it is neither reported nor
        # warned about; the graph traced again is
        raise
    except Exception:
        _publish(report, config)
        raise
    _publish(report, config)
    if ctx.scratch.get("sharded_outputs"):
        fsdp_hooks_take_shards(_compat._dynamo_frame_module())  # an FSDP2 block's outputs stay shards
    if ctx.scratch.get("sharded_outputs") or ctx.scratch.get("mask_outputs"):
        compiled = _sharded_outputs(compiled, ctx)
    decisions = list(ctx.scratch.get("shard_decisions", ()))
    if world == 1 or not decisions or not (dist.is_available() and dist.is_initialized()):
        return compiled  # nothing to agree on (offline rewrites for Config(world_size=...) too)
    # the runtime settings that shape the ring's schedule, and when inputs are compared (a rank
    # that compares alone would wait in the collective)
    decisions += [*schedule_settings(), f"check_inputs={config.check_inputs}"]
    return _checked_first_call(compiled, decisions, config, report.graph, data)


def _data_inputs(gm: torch.fx.GraphModule, example_inputs, ctx: PassContext) -> tuple[int, ...]:
    """Positions of the graph inputs that every rank of the sequence group must hold the same
    values of (Note [Input checksum] in runtime/ops.py): tensors that are not parameters, buffers
    (the same on every rank by construction, and large) or another ringcc graph's shards."""
    placeholders = [p for p in gm.graph.nodes if p.op == "placeholder"]
    if len(placeholders) != len(example_inputs):
        return ()
    shards = {g.args[0] for g in handoff_gathers(gm, ctx)}
    return tuple(i for i, (node, x) in enumerate(zip(placeholders, example_inputs))
                 if isinstance(x, torch.Tensor) and not isinstance(x, torch.nn.Parameter)
                 and "_buffers_" not in node.name and node not in shards)


def _sharded_outputs(compiled, ctx: PassContext):
    """The compiled graph, its sequence-sharded outputs handed out as SequenceSharded tensors
    (Note [Sharded outputs], ringcc/sharded.py) and its mask outputs as MaskFunctionOutput
    (Note [Mask outputs] there), their shapes evaluated from the call's input sizes."""
    specs, masks = ctx.scratch.get("sharded_outputs") or {}, ctx.scratch.get("mask_outputs")
    comm = (ctx.group_name, ctx.world_size, ctx.scratch.get("layout", "contiguous"))

    # mask shapes in the input sizes' symbols (dynamic shapes) are evaluated per call, static ones never
    symbolic = masks is not None and any(not isinstance(d, int) for _, shape, *_ in masks[1].values() for d in shape)
    static = None if masks is None else masks[:2]

    @functools.wraps(compiled)
    def run(*args):
        if not symbolic:
            return wrap_outputs(compiled(*args), specs, *comm, static)
        own, functions, sizes = masks
        inputs = args[0] if len(args) == 1 and isinstance(args[0], list) else args
        # read before the call: a boxed call clears its list
        values = {e: sympy.Integer(inputs[i] if d is None else inputs[i].shape[d]) for e, (i, d) in sizes.items()}
        functions = {i: (text, tuple(s if isinstance(s, int) else int(s.xreplace(values)) for s in shape), *rest)
                     for i, (text, shape, *rest) in functions.items()}
        return wrap_outputs(compiled(*args), specs, *comm, (own, functions))

    if getattr(compiled, "_boxed_call", False):
        run._boxed_call = True
    return run


def fingerprint(decisions: list[str]) -> str:
    """A hash of a graph's rewrite decisions (identical on every rank, or the ring hangs)."""
    return hashlib.sha256("\n".join(decisions).encode()).hexdigest()[:16]


def _checked_first_call(compiled, decisions: list[str], config: Config, graph: str, data: tuple[int, ...]):
    """Compare the rewrite decisions across ranks once, at the first call (passes make no
    process-group calls; a mismatch must be an error, not a hang in the first collective).
    Before that, on every call (at the first only under Config(check_inputs="first_call")), the
    ranks compare their inputs' shapes and data (`check_same_inputs`): a rank called with another
    sequence length runs another graph, or this one with other sizes, and its first collective
    would not match the others'; ranks called with other data compute parts of different
    sequences."""
    done = False
    group = sequence_group(config)

    @functools.wraps(compiled)
    def run(*args):
        nonlocal done
        # a boxed call passes one list (graph inputs are never lists); dynamo may also call unboxed
        boxed = len(args) == 1 and isinstance(args[0], list)
        if not done or config.check_inputs == "every_call":
            check_same_inputs(args[0] if boxed else args, group, graph, data)
        if not done:
            check_rank_consistency(decisions, group, graph)
            if config.timeout is not None:  # from here on: every rank has compiled (compiles differ in time)
                set_timeout(group, timeout_delta(config.timeout))
            done = True
        return compiled(*args)

    # aot_autograd's boxed calling convention (a list that it clears) must pass through as is
    if getattr(compiled, "_boxed_call", False):
        run._boxed_call = True
    return run


def check_same_inputs(inputs, group, graph: str = "graph", data: tuple[int, ...] = ()) -> None:
    """Every rank of the sequence group must call a compiled graph with inputs of the same shapes
    and, at positions `data`, the same values (the full inputs, as eager code would): the shapes'
    code and the data's checksum (Note [Input checksum] in runtime/ops.py), computed on the
    inputs' device, in one all-reduce and one host sync."""
    tensors = [x for x in inputs if isinstance(x, torch.Tensor)]
    cuda = any(t.is_cuda for t in tensors)
    shapes = ";".join(str(tuple(x.shape)) if isinstance(x, torch.Tensor) else repr(x)
                      for x in inputs if isinstance(x, (torch.Tensor, int, torch.SymInt)))
    code = zlib.crc32(shapes.encode()) & 0x7FFFFFFF
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    content = content_code([inputs[i] for i in data])
    (lo, hi), (content_lo, content_hi) = group_extremes(
        [code, 0 if content is None else content.to(device)], group, device)
    rank = dist.get_rank(group)
    if lo != code or hi != code:
        mine = [tuple(t.shape) for t in tensors if t.dim() > 0 and not isinstance(t, torch.nn.Parameter)][:4]
        raise ValueError(
            f"ringcc ranks called {graph} with inputs of different shapes (this rank {rank}: {mine}...); every "
            f"rank must pass the same full inputs (the same batch and sequence length). {SAME_BATCH_REMEDY}")
    if content_lo != content_hi:
        mine = [tuple(inputs[i].shape) for i in data][:4]
        raise ValueError(
            f"ringcc ranks of the sequence group called {graph} with different data: the checksums of its "
            f"data inputs (shapes {mine}) differ between ranks (this rank {rank} of the group). {SAME_BATCH_REMEDY}")


def check_rank_consistency(decisions: list[str], group=None, graph: str = "graph") -> None:
    mine = (fingerprint(decisions), decisions)
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    if all(fp == mine[0] for fp, _ in everyone):
        return
    lines = []
    for rank, (fp, theirs) in enumerate(everyone):
        if fp == mine[0]:
            continue
        only_mine = [d for d in decisions if d not in theirs][:5]
        only_theirs = [d for d in theirs if d not in decisions][:5]
        lines.append(f"rank {rank} (fingerprint {fp}) differs at: this rank only {only_mine}, "
                     f"rank {rank} only {only_theirs}")
    raise ValueError(
        f"ringcc ranks took different rewrite decisions for {graph} (this rank {dist.get_rank(group)}, "
        f"fingerprint {mine[0]}): " + "; ".join(lines) + ". Every rank must compile the same model with "
        "the same inputs' shapes and options.")


def _grad_waits_last(graph: torch.fx.Graph) -> None:
    """Moves each gradient all-reduce's wait, and everything made from its result, to the end
    of a backward graph, just before its output (Note [Overlapped gradient all-reduce] in
    runtime/seqops.py)."""
    wait = torch.ops.ringcc.grad_all_reduce_wait.default
    after = set()
    for node in graph.nodes:
        if node.target is wait or any(a in after for a in node.all_input_nodes):
            after.add(node)
    out = graph.output_node()
    after.discard(out)
    for node in [n for n in graph.nodes if n in after]:
        out.prepend(node)


def _inner(gm, example_inputs, config: Config):
    if config.inner == "eager":
        return gm.forward
    if config.inner == "aot_eager":
        def backward(bw, inputs):
            _grad_waits_last(bw.graph)
            bw.recompile()
            return _compat.boxed_graph(bw, inputs)

        # boxed: the backward frees each saved activation after its last use, as inductor's does
        # (the memory plan assumes it: Note [Memory plan], 3)
        return _compat.aot_autograd(fw_compiler=_compat.boxed_graph, bw_compiler=backward)(gm, example_inputs)
    # inductor's cache keys the compiled code by these files too: the graph calls ringcc's ops by
    # name, so code compiled against another release's op schemas is never reused
    from ringcc.runtime import ops

    return _compat.compile_with_inductor(gm, example_inputs, _grad_waits_last, (__file__, ops.__file__))


def ringcc_backend(gm: torch.fx.GraphModule, example_inputs, **kwargs):
    """The registered backend; options arrive as torch.compile(..., options={...})."""
    options = kwargs.pop("options", None) or {}
    if kwargs:
        raise ValueError(f"unexpected backend arguments {sorted(kwargs)}; pass settings as options={{...}}")
    return compile_graph(gm, example_inputs, Config.from_options(options))


def backend(config: Config | None = None, **options):
    """A backend callable with fixed settings: torch.compile(m, backend=ringcc.backend(cfg))."""
    cfg = Config.from_options(options, base=config or Config())

    def _backend(gm, example_inputs, **kwargs):
        extra = kwargs.pop("options", None) or {}
        return compile_graph(gm, example_inputs, Config.from_options(extra, base=cfg) if extra else cfg)

    return _backend
