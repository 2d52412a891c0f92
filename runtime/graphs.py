"""Ring ops replayed from CUDA graphs: the short-shard path (Note [Ring graphs])."""

from __future__ import annotations

import atexit
import collections
import os

import torch
import torch.distributed as dist

from ringcc import _compat

from . import comm as C
from .merge import copy_by_kernel

# Note [Ring graphs]
# With short shards the ring is bound by the host: every step issues its kernels, merges and
# transfers from Python, and at a few thousand tokens per GPU the GPU finishes each faster than
# the host issues the next. A ring op whose schedule follows from its shapes and arguments
# alone (no key mask, no window: nothing the host reads from the GPU plans it; no score modifier:
# those blocks run compiled flex_attention, whose compilation a capture cannot hold) is captured once
# per call signature into a CUDA graph; each later call copies its inputs into the graph's,
# replays it (one launch) and copies the outputs out, so calls never share output storage.
# - The transfers are the copy-engine ring's (Note [Copy-engine ring] in comm.py) in a receive
#   area of the graph's own (comm.OwnArea): its peer copies and stream flags are graph nodes,
#   its flags are consumed by their waiters, so every replay waits for and writes the batch
#   numbers of the capture, and no other ring writes the area or grows it. Where the copy-engine
#   ring is unusable (or RINGCC_RING_TRANSPORT=nccl), NCCL send/recv, which graphs hold too.
#   The call that captures runs eagerly first, on the same transport: that sizes the area (or
#   warms the communicator; neither can be made under capture) and gives the call its result.
# - Every rank captures at the same call (the signature is the same on every rank: the ring
#   ops' call checks) and the ranks agree that capture succeeded (one all-reduce per signature)
#   before any replays, so a failure on one rank raises on all of them instead of leaving the
#   others to replay into a ring that never turns.
# - Each graph keeps its own memory pool: its inputs, outputs and intermediates (a few shards'
#   worth: the op's transient workspace, held between calls), and its receive area (two slots
#   of its largest batch). At most MAX_GRAPHS signatures are kept; the oldest goes first, at
#   the same call on every rank.
# - A live graph holding NCCL kernels makes destroy_process_group wait forever
#   (pytorch/pytorch#115388): from the first capture on, destroy_process_group releases the
#   graphs first (_compat.release_before_destroy), and so does the interpreter's exit.
#   `ringcc.release_graphs()` releases them at any time, called on every rank (a later call
#   captures again, which is collective).
# RINGCC_RING_GRAPHS: auto (captures calls of at most AUTO_MAX_ROWS rows b * h * n_local, where
# the host bounds the step), on (every call that qualifies), off. On 4 x H200 (16 heads,
# benchmarks/RESULTS.md, "Short chunks") one layer at 4K tokens per GPU runs with graphs at
# 69.6% (causal) and 80-83% (non-causal) of one GPU's rate back to back, and they take a compiled
# 8-layer step from 61 to 45 ms; at 8K per GPU that step is no faster with them (the host is
# ahead there, and graphs add their input and output copies).

SETTING = "RINGCC_RING_GRAPHS"
CHOICES = ("auto", "on", "off")
AUTO_MAX_ROWS = 16 * 4096
MAX_GRAPHS = 8

_GRAPHS: collections.OrderedDict = collections.OrderedDict()
_INSTALLED: list = []


def setting() -> str:
    raw = os.environ.get(SETTING, "auto").strip().lower() or "auto"
    if raw not in CHOICES:
        raise ValueError(f"{SETTING} must be one of {', '.join(CHOICES)}; got {raw!r}")
    return raw


def wanted(q: torch.Tensor, key_valid, key_runs, window: int) -> bool:
    """Whether this ring call (with no mask or score function) runs from a CUDA graph (Note [Ring graphs])."""
    choice = setting()
    if not q.is_cuda or key_valid is not None or key_runs is not None or window:
        return False
    if choice == "off" or torch.cuda.is_current_stream_capturing():
        return False  # (under a capture of the caller's, the ring is captured there)
    if os.environ.get("RINGCC_SKIP_COMM", "0") != "0":
        return False
    return choice == "on" or q.shape[0] * q.shape[1] * q.shape[2] <= AUTO_MAX_ROWS


def _meta(t):
    return None if t is None else (tuple(t.shape), t.stride(), t.dtype, t.device)


class _Replay:
    """One captured ring op: its input and output tensors, the graph between them, and its
    receive area (None: NCCL)."""

    def __init__(self, inputs, graph, outputs, area):
        self.inputs, self.graph, self.outputs, self.area = inputs, graph, outputs, area

    def __call__(self, args):
        # Copies by kernels: a memcpy would take the copy engines, which the ring's peer copies use.
        for static, a in zip(self.inputs, args):
            if static is not None:
                copy_by_kernel(static, a)
        self.graph.replay()
        outs = tuple(torch.empty_like(o) for o in self.outputs)
        for dst, o in zip(outs, self.outputs):
            copy_by_kernel(dst, o)
        return outs


def _capture(fn, args, group):
    """(this call's result, run eagerly on the graph's transport, which sizes or warms it for the
    capture; the _Replay captured after it), once every rank of `group` has captured."""
    area = None if group is None or dist.get_world_size(group) < 2 else C.graph_area(group, args[0].device)
    with C.graph_transport(area):
        first = fn(*args)
        inputs = [None if a is None else a.clone() for a in args]
        graph = torch.cuda.CUDAGraph()
        error = outputs = None
        if area is not None:
            area.before_capture()
        try:
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                outputs = fn(*inputs)
        except Exception as e:  # noqa: BLE001 - every rank hears of it below, then it is raised
            error = e
    if group is not None:
        ok = torch.tensor([0 if error else 1], device=args[0].device)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)
        if error is None and not ok.item():
            raise RuntimeError(f"ringcc: another rank could not capture this ring op in a CUDA graph (see its "
                               f"error); set {SETTING}=off on every rank to run it without graphs")
    if error is not None:
        raise RuntimeError(f"ringcc: capturing the ring op in a CUDA graph failed: {type(error).__name__}: "
                           f"{error}; set {SETTING}=off on every rank to run it without graphs") from error
    return first, _Replay(inputs, graph, outputs, area)


def run(key: tuple, fn, args: tuple, group):
    """fn(*args) (CUDA tensors or None, shapes fixed by `key`), from this signature's graph:
    captured at its first call, replayed after."""
    key = key + tuple(_meta(a) for a in args)
    replay = _GRAPHS.get(key)
    if replay is not None:
        _GRAPHS.move_to_end(key)
        return replay(args)
    if len(_GRAPHS) >= MAX_GRAPHS:
        _, oldest = _GRAPHS.popitem(last=False)
        if oldest.area is not None:
            oldest.area.release()  # (every rank drops the same graph at the same call)
    if not _INSTALLED:
        _compat.release_before_destroy(clear)
        atexit.register(clear)
        _INSTALLED.append(True)
    first, _GRAPHS[key] = _capture(fn, args, group)
    return first


def clear() -> None:
    """Drop every captured ring op and the memory its graph holds, its receive area included
    (after the GPU is done with them). Call it on every rank: the next call captures again,
    collectively."""
    if _GRAPHS:
        torch.cuda.synchronize()
        _GRAPHS.clear()
