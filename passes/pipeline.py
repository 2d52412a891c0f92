"""THE ordered list of passes. Nothing registers itself here by import side effect: the
order below is the pipeline, each entry commented with why it sits where it does."""

from __future__ import annotations

import os
import time

import torch.fx

from .base import Pass, PassContext
from .canonicalize_attention import canonicalize_attention
from .inline_checkpoints import inline_checkpoints, restore_checkpoints
from .lift_masks import lift_masks
from .rewrite_attention import rewrite_attention
from .discover_sequence import discover_sequence
from .shard_sequence import shard_sequence
from .sync_param_grads import sync_param_grads

PIPELINE: list[tuple[str, Pass]] = [
    # Activation-checkpoint regions that hide attention in a body graph are moved into the
    # graph first, so that every later pass sees their attention ...
    ("inline_checkpoints", inline_checkpoints),
    # ... then attention, on the user's graph: every form becomes one canonical SDPA call ...
    ("canonicalize_attention", canonicalize_attention),
    # ... whose mask is read as a structured spec (and GQA repeats undone) ...
    ("lift_masks", lift_masks),
    # ... and each accepted site becomes the ringcc op; sharding passes below rely on it.
    ("rewrite_attention", rewrite_attention),
    # Sequence sharding, once the attention sites are ring ops: n and the token inputs ...
    ("discover_sequence", discover_sequence),
    # ... every value's sequence state, shards / gathers / all-reduces inserted ...
    ("shard_sequence", shard_sequence),
    # ... and weights consumed by sharded ops get their gradients all-reduced (bucketed).
    ("sync_param_grads", sync_param_grads),
    # Last, the inlined checkpoint regions become regions again, over their rewritten bodies.
    ("restore_checkpoints", restore_checkpoints),
]


def run_pipeline(gm: torch.fx.GraphModule, ctx: PassContext, passes: list[tuple[str, Pass]] | None = None) -> torch.fx.GraphModule:
    passes = PIPELINE if passes is None else passes
    for node in gm.graph.nodes:
        # ringcc ops already in the traced program (the gather dynamo records where a graph reads
        # another graph's SequenceSharded output) were made by no pass: say so, for verify_graph
        if node.op == "call_function" and str(node.target).startswith("ringcc."):
            node.meta.setdefault("ringcc_pass", "traced")
    dump = ctx.config.dump_dir
    if dump:
        os.makedirs(dump, exist_ok=True)
        _dump(gm, dump, f"{ctx.report.graph}_00_input")
    for i, (name, fn) in enumerate(passes, start=1):
        t0 = time.perf_counter()
        result = fn(gm, ctx)
        ctx.report.pass_seconds[name] = ctx.report.pass_seconds.get(name, 0.0) + time.perf_counter() - t0
        if result.modified:
            gm.graph.lint()
            gm.recompile()
        if ctx.config.verify:
            from .verify import verify_graph

            verify_graph(gm, after=name)
        if dump:
            _dump(gm, dump, f"{ctx.report.graph}_{i:02d}_{name}")
    return gm


def _dump(gm: torch.fx.GraphModule, folder: str, stem: str) -> None:
    with open(os.path.join(folder, stem + ".txt"), "w") as f:
        f.write(gm.print_readable(print_output=False))
