"""`ringcc rewrite MODULE:FACTORY -o OUT_DIR`: the offline rewrite.

FACTORY (a function in a module or a .py file, as for `ringcc plan`) returns
(model, example_inputs) or (model, example_inputs, options), options being ringcc Config
fields. The model is captured with torch.export (the sequence dim dynamic with
--dynamic-seq), rewritten by the backend's pipeline for P ranks, and saved:

    OUT_DIR/program.pt2   the rewritten ExportedProgram (torch.export.save)
    OUT_DIR/program.py    its readable code
    OUT_DIR/report.txt, report.json   the rewrite report (the backend's GraphReport)
    OUT_DIR/plan.txt, plan.json       the memory plan of the rewritten graph

Note [Offline program contract]
The saved program is the whole model, not one rank's part: every rank loads it, calls it
with the same full inputs the eager model takes, and gets the full outputs (sharding,
ring attention, loss all-reduces and output gathers are ops inside the program, as in the
backend). The sequence need not be an input: a vision model makes its tokens inside (the
[CLS] token catted onto an image's patch embeddings), and the program shards them where the
graph makes them, as the backend does (values created from no sequence input, Note
[Sequence state] in passes/shard_sequence.py). It must run on exactly P ranks of the
default process group: the communication ops carry the group name "" (= WORLD of the
process that runs them), since real group names are process-local. P = 1 needs no
process group. Loading needs the ringcc ops registered first:

    import ringcc, torch
    model = torch.export.load("OUT_DIR/program.pt2").module()
    loss = model(*inputs)            # on each of the P ranks, after init_process_group

Capture and retrace. The pipeline runs on `ExportedProgram.module()` (an aten graph,
before run_decompositions(), so SDPA is still one op; parameters are attributes, inputs
are the placeholders). The rewritten module is exported again: that retrace recomputes
every meta["val"] and the graph signature, and turns the torch-level calls some passes
insert into aten ops. Export spells a few ops differently from dynamo (aten.embedding's
argument order, cross_entropy_loss's enum reduction, slices and selects as aten.slice /
aten.select, tensor indexing as aten.index / index_put_); they are respelled first so that the sharding rules read them. What the
command takes and the contract, for users: docs/offline.md.

Exit codes: 0 rewritten, 2 bad arguments, a model torch.export cannot capture, or a model of a
transformers release older than the tested floor (with what to change), 3 no attention site was rewritten (the report's reasons are printed and saved;
no program is written).
"""

from __future__ import annotations

import argparse
import inspect
import json
import operator
import os
import sys

from ringcc.planner_cli import add_pad_argument, length_error, positive_int

EXIT_OK, EXIT_BAD_ARGS, EXIT_NOTHING_REWRITTEN = 0, 2, 3


class BadArguments(ValueError):
    """User input the command cannot take (exit code 2)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("target", help="MODULE:FACTORY or path/to/file.py:FACTORY returning (model, inputs[, options])")
    parser.add_argument("-o", "--out", required=True, type=creatable_folder, metavar="OUT_DIR",
                        help="folder for program.pt2, program.py, report, plan")
    parser.add_argument("--world-size", type=int, default=2, help="number of ranks P the program runs on (default 2)")
    parser.add_argument("--dilation", default=None, metavar="W1,W2:R1,R2",
                        help='LongNet dilated attention at every site: segment lengths and dilation rates, e.g. "16,64:1,4"')
    parser.add_argument("--dynamic-seq", action="store_true",
                        help="export with a symbolic sequence length (one program for every length the layout divides)")
    parser.add_argument("--seq-dim", type=int, default=1, help="sequence dim of the tensor inputs (default 1)")
    parser.add_argument("--seq-len", type=positive_int, default=None, help="pass seq_len=N to a factory that takes it")
    add_pad_argument(parser)


def creatable_folder(text: str) -> str:
    """An output folder that exists or can be made (checked before the export, not after it)."""
    path = os.path.abspath(text)
    if os.path.exists(path):
        if not os.path.isdir(path):
            raise argparse.ArgumentTypeError(f"{text!r} exists and is not a folder; give a folder for the outputs")
        if not os.access(path, os.W_OK | os.X_OK):
            raise argparse.ArgumentTypeError(f"folder {text!r} is not writable; give another -o")
        return text
    parent = os.path.dirname(path)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise argparse.ArgumentTypeError(f"cannot create folder {text!r}: {parent!r} is a file; give another -o")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"cannot create folder {text!r}: {parent!r} is not writable; give another -o")
    return text


def parse_dilation(text: str):
    """A DilatedSpec from "w1,w2:r1,r2"."""
    from ringcc.runtime.dilated import DilatedSpec

    parts = text.split(":")
    try:
        if len(parts) != 2:
            raise ValueError("expected one ':'")
        w, r = ([int(x) for x in part.split(",")] for part in parts)
    except ValueError:
        raise BadArguments(f'--dilation {text!r} is not "w1,w2,...:r1,r2,..." (segment lengths, then as many '
                           'dilation rates, all integers); e.g. --dilation "16,64:1,4"') from None
    try:
        return DilatedSpec(w, r)
    except ValueError as e:
        raise BadArguments(f"--dilation {text!r}: {e}") from None


def load(target: str, seq_len: int | None):
    """(model, inputs, options) from MODULE:FACTORY."""
    from ringcc.planner_cli import factory_result, load_factory

    try:
        factory = load_factory(target)
    except (ValueError, ImportError) as e:
        raise BadArguments(f"cannot load {target!r}: {e}") from None
    takes_len = "seq_len" in inspect.signature(factory).parameters
    if seq_len is not None and not takes_len:
        raise BadArguments(f"--seq-len {seq_len} given but {target} takes no seq_len argument; drop --seq-len")
    made = factory(seq_len=seq_len) if seq_len is not None else factory()
    try:
        return factory_result(made, target)
    except ValueError as e:
        raise BadArguments(str(e)) from None


def dynamic_shapes(inputs, seq_dim: int, unit: int = 1):
    """The sequence dim of every tensor input that has the first such input's length, as
    `unit * Dim("seq_chunks")` (the sharded program runs on lengths its layout divides)."""
    import torch
    from torch.export import Dim

    lengths = [x.shape[seq_dim] for x in inputs if isinstance(x, torch.Tensor) and x.dim() > seq_dim]
    if not lengths:
        raise BadArguments(f"--dynamic-seq: no tensor input has a dim {seq_dim}; pass --seq-dim")
    if lengths[0] % unit or lengths[0] // unit < 2:
        raise BadArguments(f"--dynamic-seq: the example length {lengths[0]} must be a multiple of {unit} "
                           f"(the layout's unit for this world size), at least {2 * unit}; change the factory's inputs")
    # min=2: export specialises a length of one chunk per rank
    seq = Dim("seq", min=2) if unit == 1 else unit * Dim("seq_chunks", min=2)
    return tuple({seq_dim: seq} if isinstance(x, torch.Tensor) and x.dim() > seq_dim and x.shape[seq_dim] == lengths[0]
                 else None for x in inputs)


def rewrite(model, inputs, *, world_size: int, options: dict | None = None, dynamic: bool = False,
            seq_dim: int = 1, graph_name: str = "program"):
    """Export `model(*inputs)`, rewrite it for `world_size` ranks and export the result.

    Returns (exported_program, report); exported_program is None when no attention site was
    rewritten. The report carries the memory plan (or a note saying why there is none).
    See Note [Offline program contract] for what the program expects.
    """
    import torch

    from ringcc import planner
    from ringcc.config import Config
    from ringcc.passes.base import PassContext
    from ringcc.passes.pipeline import run_pipeline
    from ringcc.releases import check_transformers_release
    from ringcc.report import GraphReport

    options = dict(options or {})
    if options.get("gather_outputs", True) is not True:
        raise ValueError(f"ringcc rewrite: gather_outputs={options['gather_outputs']!r} is not allowed; the saved "
                         "program returns full outputs (Note [Offline program contract]): drop the option")
    # no wrapper can hand a saved program's shards out as SequenceSharded tensors (ringcc/sharded.py)
    config = Config.from_options(dict(options, gather_outputs=True, world_size=world_size, inner="eager"))
    try:
        gm = torch.export.export(model, inputs, dynamic_shapes=dynamic_shapes(inputs, seq_dim) if dynamic else None).module()
    except Exception as e:  # noqa: BLE001 - any capture failure is the model's: say so and how to see all of it
        first = next((line for line in str(e).splitlines() if line.strip()), "")
        if dynamic and "Constraints violated" in str(e):
            hint = (f"With --dynamic-seq dim {seq_dim} of the inputs is exported as one symbol from 2 up, and "
                    "the model constrains it (a largest length such as MPT's max_seq_len, or a branch on the "
                    "length), or that dim is not the sequence (an image's channels: a vision model makes its "
                    "tokens from the image's patches, as many as its size gives): rewrite without --dynamic-seq, "
                    "one program per length (--seq-len) or image size.")
        else:
            hint = ("The model must run under torch.export.export(model, example_inputs) and return tensors or "
                    "containers of them; a Hugging Face model with use_cache=True returns a DynamicCache: return "
                    "`.logits` from a wrapper, or pass use_cache=False.")
        raise BadArguments(
            f"torch.export cannot capture {graph_name}: {type(e).__name__}: {first[:300]}\n{hint} "
            "Run torch.export.export yourself for the whole error") from e
    try:
        check_transformers_release(gm)  # as the backend does at compile time (ringcc/releases.py)
    except RuntimeError as e:
        raise BadArguments(str(e)) from None
    report = GraphReport(graph=graph_name, world_size=world_size)
    ctx = PassContext(config=config, report=report, world_size=world_size, group_name="",
                      example_inputs=list(inputs))
    _torch_level_spellings(gm)
    gm = run_pipeline(gm, ctx)
    if not report.rewritten:
        return None, report
    # The passes keep meta["example_value"] current (dynamo's key); "val" (export's key, which
    # the planner reads first) still holds the pre-rewrite shapes: align it before planning.
    for node in gm.graph.nodes:
        if "example_value" in node.meta:
            node.meta["val"] = node.meta["example_value"]
    try:
        planner.plan_for_context(gm, ctx)
    except Exception as e:  # the plan is a report; the rewrite must not depend on it
        report.notes.append(f"memory planner failed: {type(e).__name__}: {e}")
    shapes = None
    if dynamic:
        # Config(pad=True) pads any length to the layout's multiple inside the program
        divides = ctx.scratch.get("sharded") and world_size > 1 and not config.pad
        unit = world_size * (2 if ctx.scratch.get("layout") == "zigzag" else 1) if divides else 1
        shapes = dynamic_shapes(inputs, seq_dim, unit)
    return torch.export.export(gm, inputs, dynamic_shapes=shapes), report


def _torch_level_spellings(gm) -> None:
    """Respell the aten ops whose export form the sharding rules do not read as the torch
    calls dynamo records (the re-export lowers them back to the same aten ops):
    aten.embedding takes (weight, indices), F.embedding (indices, weight); aten's
    cross_entropy_loss takes the reduction as an enum int; aten.slice and aten.select are
    x[..., a:b] and x[..., i]; aten.index with one lifted constant list is x[..., [i, j]]
    (Falcon's K/V head); aten.index with one integer tensor is x[rows] (GPT-J's table read at
    the positions), aten.index_put_ with one 1-D integer tensor x[rows] = v, aten.floor_divide
    by an int x // k (a mixture of experts' dispatch, Note [Rank-local rows] in
    passes/shard_sequence.py). Without this they still run
    correctly, but on full-length values (the memory plan names them). Export's
    `_assert_tensor_metadata` checks (a dtype / device per `.to()`) are dropped: they have
    no sharding rule, so each would gather its sequence-carrying input, and the re-export
    records them again on the rewritten values. A dropout that is the identity (train=False
    or p = 0) is dropped too."""
    import torch
    import torch.nn.functional as F

    aten = torch.ops.aten
    reductions = {0: "none", 1: "mean", 2: "sum"}
    for node in list(gm.graph.nodes):
        if node.target is aten._assert_tensor_metadata.default:
            gm.graph.erase_node(node)
            continue
        if node.target is aten.dropout.default and len(node.args) == 3 and (node.args[2] is False or node.args[1] == 0):
            # the identity (eval mode, or p = 0); as a random op it would stay in the graph when
            # unused and keep what it reads alive (a site's probabilities, the scores before them)
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)
            continue
        if node.target is aten.slice.Tensor and not node.kwargs:  # x[..., start:end:step]; end INT64_MAX: open
            x, dim, start, end, step = (list(node.args) + [0, None, None, 1][len(node.args) - 1:])[:5]
            end = None if end == sys.maxsize else end
            cut = slice(start, end, None if step == 1 else step)
            index = (slice(None),) * dim + (cut,) if dim >= 0 else (Ellipsis, cut) + (slice(None),) * (-dim - 1)
            new = (operator.getitem, (x, index), {})
        elif node.target is aten.select.int and not node.kwargs:  # x[..., i]
            x, dim, i = node.args
            index = (slice(None),) * dim + (i,) if dim >= 0 else (Ellipsis, i) + (slice(None),) * (-dim - 1)
            new = (operator.getitem, (x, index), {})
        elif node.target is aten.index.Tensor and len(node.args) == 2 and not node.kwargs \
                and sum(i is not None for i in node.args[1]) == 1 \
                and all(i is None or _constant_list(gm, i) is not None for i in node.args[1]):
            # x[..., [i, j], ...] with a constant list: export lifts the list into a tensor constant
            x, idx = node.args
            new = (operator.getitem, (x, tuple(slice(None) if i is None else _constant_list(gm, i) for i in idx)), {})
        elif node.target is aten.index.Tensor and len(node.args) == 2 and not node.kwargs \
                and _row_index(node.args[1], any_dim=True) is not None:
            # x[rows] with one integer tensor (an MoE's tokens read in its sort's order, GPT-J's
            # sin/cos table read at the position ids)
            new = (operator.getitem, (node.args[0], node.args[1][0]), {})
        elif node.target is aten.index_put_.default and len(node.args) == 3 and not node.kwargs \
                and _row_index(node.args[1]) is not None:
            # x[rows] = v (an MoE's inverse permutation); the in-place op's result is x itself
            x, idx, value = node.args
            with gm.graph.inserting_before(node):
                repl = gm.graph.call_function(operator.setitem, (x, idx[0], value))
            repl.meta.update({k: v for k, v in node.meta.items() if k not in ("val", "example_value")})
            repl.meta["ringcc_pass"] = "rewrite (export spelling)"
            repl.meta["ringcc_from"] = node.name
            node.replace_all_uses_with(x)
            gm.graph.erase_node(node)
            continue
        elif node.target is aten.floor_divide.default and not node.kwargs and isinstance(node.args[1], int):
            new = (operator.floordiv, tuple(node.args), {})  # x // k
        elif node.target is aten.embedding.default:
            names = ("weight", "indices", "padding_idx", "scale_grad_by_freq", "sparse")
            bound = dict(zip(names, node.args), **node.kwargs)
            padding_idx = bound.get("padding_idx", -1)  # HF's word embeddings have one: no gradient for that row
            new = (F.embedding, (bound["indices"], bound["weight"]),
                   dict(padding_idx=None if padding_idx == -1 else padding_idx,
                        scale_grad_by_freq=bound.get("scale_grad_by_freq", False), sparse=bound.get("sparse", False)))
        elif node.target is aten.cross_entropy_loss.default:
            names = ("input", "target", "weight", "reduction", "ignore_index", "label_smoothing")
            bound = dict(zip(names, node.args), **node.kwargs)
            reduction = reductions[bound.get("reduction", 1)]
            new = (F.cross_entropy, (bound["input"], bound["target"]),
                   dict(weight=bound.get("weight"), ignore_index=bound.get("ignore_index", -100),
                        reduction=reduction, label_smoothing=bound.get("label_smoothing", 0.0)))
        else:
            continue
        with gm.graph.inserting_before(node):
            repl = gm.graph.call_function(*new)
        repl.meta.update(node.meta)
        repl.meta["ringcc_pass"] = "rewrite (export spelling)"
        repl.meta["ringcc_from"] = node.name
        node.replace_all_uses_with(repl)
        gm.graph.erase_node(node)
    gm.recompile()


def _row_index(indices, any_dim: bool = False):
    """The index of x[rows] in aten.index / index_put_'s index list: one integer tensor, 1-D
    unless `any_dim` (export's spelling of a dynamo getitem / setitem with one tensor index),
    else None."""
    import torch

    from ringcc.passes.discover_sequence import fake

    if not (isinstance(indices, (list, tuple)) and len(indices) == 1 and isinstance(indices[0], torch.fx.Node)):
        return None
    val = fake(indices[0])
    if not (isinstance(val, torch.Tensor) and (val.dim() == 1 or any_dim) and val.dtype in (torch.int64, torch.int32)):
        return None
    return indices[0]


def _constant_list(gm, node, longest: int = 16):
    """The values of a short 1-D integer tensor constant (export's lifted `[i, j]` index, read
    through lift_fresh_copy) as a list of ints, or None."""
    import torch

    from ringcc.passes.base import attr_value

    if isinstance(node, torch.fx.Node) and node.target is torch.ops.aten.lift_fresh_copy.default:
        node = node.args[0]
    if not (isinstance(node, torch.fx.Node) and node.op == "get_attr"):
        return None
    value = attr_value(gm, node.target)
    if not (isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() <= longest
            and value.dtype in (torch.int64, torch.int32)):
        return None
    return [int(v) for v in value.tolist()]


def save(ep, report, out_dir: str) -> dict[str, str]:
    """Write the program, its code, the report and the plan into out_dir; returns kind -> path."""
    import torch

    os.makedirs(out_dir, exist_ok=True)
    paths = {}

    def write(name: str, text: str) -> None:
        paths[name] = os.path.join(out_dir, name)
        with open(paths[name], "w") as f:
            f.write(text)

    write("report.txt", report.format() + "\n")
    write("report.json", json.dumps(report.to_dict(), indent=2) + "\n")
    if report.plan is not None:
        write("plan.txt", report.plan.format() + "\n")
        write("plan.json", json.dumps(report.plan.to_dict(), indent=2) + "\n")
    if ep is not None:
        paths["program.pt2"] = os.path.join(out_dir, "program.pt2")
        torch.export.save(ep, paths["program.pt2"])
        header = (f'"""ringcc rewrite of {report.graph} for {report.world_size} rank(s); readable code of program.pt2.\n\n'
                  "Load with `import ringcc; torch.export.load(path).module()` and call it on every rank with the\n"
                  "full inputs (see Note [Offline program contract] in ringcc/rewrite.py).\n"
                  '"""\n\nimport torch\n\n\n')
        write("program.py", header + ep.graph_module.print_readable(print_output=False) + "\n")
    return paths


def run(args) -> int:
    try:
        if args.world_size < 1:
            raise BadArguments(f"--world-size must be >= 1; got {args.world_size}")
        model, inputs, options = load(args.target, args.seq_len)
        if args.dilation is not None:
            options["dilation"] = parse_dilation(args.dilation)
        if args.pad:
            options["pad"] = True
        from ringcc.config import Config

        try:
            Config.from_options(options)
        except ValueError as e:
            raise BadArguments(f"{args.target} returned options ringcc does not take: {e}") from None
        try:
            ep, report = rewrite(model, inputs, world_size=args.world_size, options=options,
                                 dynamic=args.dynamic_seq, seq_dim=args.seq_dim,
                                 graph_name=args.target.rsplit(":", 1)[1])
        except Exception as e:  # noqa: BLE001 - only a length error is the user's; the rest re-raised
            bad = length_error(e)
            if bad is None:
                raise
            raise BadArguments(f"{bad} (on the command line: --pad)") from None
    except BadArguments as e:
        print(f"ringcc rewrite: error: {e}", file=sys.stderr)
        return EXIT_BAD_ARGS
    paths = save(ep, report, args.out)
    print(report.format())
    if ep is None:
        reasons = [f"{s.location}: {s.reason.value} ({s.detail})" for s in report.skipped] or \
                  ["no attention site found in the exported graph (SDPA, manual softmax attention, MHA)"]
        print("nothing rewritten:\n  " + "\n  ".join(reasons), file=sys.stderr)
        print(f"report written to {paths['report.txt']}", file=sys.stderr)
        return EXIT_NOTHING_REWRITTEN
    for path in paths.values():
        print(f"wrote {path}")
    return EXIT_OK
