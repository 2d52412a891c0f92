"""The canonical attention form every attention pass agrees on, and fake-value helpers.

Canonical form: one scaled-dot-product-attention call with every argument spelled out:

    sdpa(q, k, v, attn_mask=<node|None>, dropout_p=<float>, is_causal=<bool>,
         scale=<float|None>, enable_gqa=<bool>)

The target is the one the graph already speaks: `F.scaled_dot_product_attention` in
dynamo's torch-level graphs (fake values in meta["example_value"]) and
`aten.scaled_dot_product_attention.default` in aten / export graphs (meta["val"]).
Canonicalisation turns manual attention, MHA and the fused encoder layer into this form,
mask lifting reads its attn_mask, and the rewrite pass turns it into the ringcc op.
meta["ringcc_form"] remembers which user form a canonical node came from.

Legend: q_bhsd [batch, heads, seq, head_dim]; k_bgsd / v_bgsd with g key/value heads.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.fx
import torch.nn.functional as F

from ringcc import _compat

from .base import tag, writes_any

SDPA_TORCH_TARGETS = (F.scaled_dot_product_attention,)  # the same builtin dynamo records
SDPA_ATEN_TARGET = torch.ops.aten.scaled_dot_product_attention.default
SDPA_PARAMS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
SDPA_DEFAULTS = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False}
FORM_META = "ringcc_form"


def is_sdpa(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and (node.target in SDPA_TORCH_TARGETS or node.target == SDPA_ATEN_TARGET)


@dataclass
class SdpaCall:
    """The arguments of an SDPA node, bound by name."""

    q: torch.fx.Node
    k: torch.fx.Node
    v: torch.fx.Node
    attn_mask: Any = None
    dropout_p: Any = 0.0
    is_causal: Any = False
    scale: Any = None
    enable_gqa: Any = False

    @classmethod
    def of(cls, node: torch.fx.Node) -> "SdpaCall":
        bound = dict(SDPA_DEFAULTS)
        bound.update(zip(SDPA_PARAMS, node.args))
        bound.update(node.kwargs)
        return cls(bound["query"], bound["key"], bound["value"], bound["attn_mask"], bound["dropout_p"],
                   bound["is_causal"], bound["scale"], bound["enable_gqa"])

    def args_kwargs(self, aten: bool) -> tuple[tuple, dict]:
        kw = {"attn_mask": self.attn_mask, "dropout_p": self.dropout_p, "is_causal": self.is_causal,
              "scale": self.scale, "enable_gqa": self.enable_gqa}
        if aten:  # scale and enable_gqa are keyword-only in the aten schema
            return ((self.q, self.k, self.v, kw["attn_mask"], kw["dropout_p"], kw["is_causal"]),
                    {"scale": kw["scale"], "enable_gqa": kw["enable_gqa"]})
        return (self.q, self.k, self.v), kw


# ---------------------------------------------------------------------------------------
# fake values


def fake_key(gm: torch.fx.GraphModule) -> str:
    """"val" for aten/export graphs, "example_value" for dynamo graphs."""
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            if "example_value" in node.meta:
                return "example_value"
            if "val" in node.meta:
                return "val"
    return "example_value"


def is_aten_graph(gm: torch.fx.GraphModule) -> bool:
    return fake_key(gm) == "val"


def fake(node: Any) -> Any:
    if isinstance(node, torch.fx.Node):
        return node.meta.get("example_value", node.meta.get("val"))
    return node


def fake_mode_of(gm: torch.fx.GraphModule):
    """The fake mode the placeholders' fake tensors live in (see PITFALLS: mixing fake modes)."""
    for node in gm.graph.nodes:
        val = fake(node)
        mode = getattr(val, "fake_mode", None)
        if mode is not None:
            return mode
    return None


def propagate(gm: torch.fx.GraphModule, node: torch.fx.Node, mode=None) -> Any:
    """Compute and store `node`'s fake value from its inputs' fake values."""
    mode = mode if mode is not None else fake_mode_of(gm)
    args = torch.fx.node.map_arg(node.args, fake)
    kwargs = torch.fx.node.map_arg(node.kwargs, fake)
    with mode:
        if node.op == "call_method":
            val = getattr(args[0], node.target)(*args[1:], **kwargs)
        else:
            val = node.target(*args, **kwargs)
    node.meta[fake_key(gm)] = val
    return val


class Builder:
    """Inserts nodes before an anchor, tags them and computes their fake values."""

    def __init__(self, gm: torch.fx.GraphModule, anchor: torch.fx.Node, pass_name: str):
        self.gm, self.anchor, self.pass_name = gm, anchor, pass_name
        self.mode = fake_mode_of(gm)

    def call(self, target, *args, **kwargs) -> torch.fx.Node:
        with self.gm.graph.inserting_before(self.anchor):
            node = self.gm.graph.call_function(target, tuple(args), kwargs)
        return self._finish(node)

    def method(self, name: str, *args, **kwargs) -> torch.fx.Node:
        with self.gm.graph.inserting_before(self.anchor):
            node = self.gm.graph.call_method(name, tuple(args), kwargs)
        return self._finish(node)

    def getitem(self, node: torch.fx.Node, i: int) -> torch.fx.Node:
        return self.call(operator.getitem, node, i)

    def sdpa(self, call: SdpaCall, form: str) -> torch.fx.Node:
        aten = is_aten_graph(self.gm)
        args, kwargs = call.args_kwargs(aten)
        node = self.call(SDPA_ATEN_TARGET if aten else F.scaled_dot_product_attention, *args, **kwargs)
        node.meta[FORM_META] = form
        return node

    def _finish(self, node: torch.fx.Node) -> torch.fx.Node:
        tag(node, self.pass_name, self.anchor)
        propagate(self.gm, node, self.mode)
        return node


# export graphs check tensor metadata with nodes that use a value without computing from it
ASSERT_TARGETS = (torch.ops.aten._assert_tensor_metadata.default,)


def real_users(node: torch.fx.Node) -> list[torch.fx.Node]:
    """node's users other than export's metadata assertions."""
    return [u for u in node.users if u.target not in ASSERT_TARGETS]


def erase_dead(gm: torch.fx.GraphModule, roots) -> None:
    """Erase `roots` (replaced nodes, unused) and, transitively, their inputs once nothing
    uses them (pure ops only)."""
    stack = [r for r in roots if isinstance(r, torch.fx.Node)]
    root_set = set(stack)
    erased: set[torch.fx.Node] = set()
    while stack:
        node = stack.pop()
        if node in erased:
            continue
        stack.extend(_erase_unread_writes(gm, node))  # a mask built in place (x[..] = v) whose reader is gone
        if real_users(node) or node.op not in ("call_function", "call_method"):
            continue
        if node not in root_set and node.op == "call_function" and _impure(node):
            continue
        inputs = list(node.all_input_nodes)
        for check in list(node.users):
            gm.graph.erase_node(check)
        gm.graph.erase_node(node)
        erased.add(node)
        stack.extend(inputs)


def drop_unread(gm: torch.fx.GraphModule, nodes) -> list[torch.fx.Node]:
    """Erase each of `nodes` whose value nothing reads: it and everything computed from it are
    pure ops (no write in place, no module call) that reach no output. Dynamo keeps such code in
    its graphs: an attention function's second result, cast or scaled, that its caller drops
    (transformers' flex path returns the call's LSE as the attention weights, which the decoder
    layer discards). Returns the nodes kept: those whose value is read."""
    kept, erased = [], set()
    for root in nodes:
        if root in erased:  # read by an earlier root only: erased with it
            continue
        closure, todo = {root}, [root]
        while todo:
            for u in todo.pop().users:
                if u not in closure:
                    closure.add(u)
                    todo.append(u)
        if not all(_pure(n) for n in closure):
            kept.append(root)
            continue
        for n in reversed([n for n in gm.graph.nodes if n in closure]):  # readers before what they read
            gm.graph.erase_node(n)
        erased |= closure
    return kept


def _pure(node: torch.fx.Node) -> bool:
    """Neither a write (in place or into `out=`: base.writes_any) nor a call whose effects fx counts."""
    if node.op not in ("call_function", "call_method") or writes_any(node):
        return False
    return node.op == "call_method" or not _impure(node)


FRESH = ("clone", "full", "zeros", "ones", "empty", "full_like", "zeros_like", "ones_like", "empty_like")


def _erase_unread_writes(gm: torch.fx.GraphModule, node: torch.fx.Node) -> list[torch.fx.Node]:
    """Erase the in-place writes `node[idx] = v` into a tensor of its own (a clone or a factory,
    no view of another) that nothing after them reads (no node after a write depends on node):
    their effect is never seen. Returns the inputs of the erased writes."""
    name = getattr(node.target, "__name__", node.target)
    if node.op not in ("call_function", "call_method") or not isinstance(name, str) or name not in FRESH:
        return []
    freed: list[torch.fx.Node] = []
    while True:
        writes = [u for u in node.users if u.op == "call_function" and u.target is operator.setitem
                  and u.args[0] is node and not u.users]
        if not writes:
            return freed
        order = {n: i for i, n in enumerate(gm.graph.nodes)}
        last = max(writes, key=order.get)
        seen, todo = set(), [u for u in node.users if u is not last]
        while todo:
            u = todo.pop()
            if u not in seen:
                seen.add(u)
                todo.extend(u.users)
        if any(order[u] > order[last] for u in seen):
            return freed
        freed.extend(x for x in last.all_input_nodes if x is not node)
        gm.graph.erase_node(last)


def _impure(node: torch.fx.Node) -> bool:
    try:
        return node.is_impure()
    except Exception:  # noqa: BLE001 - an unknown target is treated as impure (kept)
        return True


def static_int(x: Any) -> Optional[int]:
    """x as a Python int when it is one (no guard on symbolic sizes), else None."""
    if isinstance(x, bool):
        return None
    if isinstance(x, int):
        return x
    return None


def same_size(a: Any, b: Any) -> bool:
    """a == b for sizes (ints or SymInts) without installing a guard; False when unknown."""
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    ea = a if isinstance(a, int) else _compat.sym_expr(a)
    eb = b if isinstance(b, int) else _compat.sym_expr(b)
    # sizes equal by a guard of the trace that is not a plain replacement: MPT's sliced bias,
    # 64 - Max(0, 64 - n) after a broadcast against n guarded Eq(n, 64 - Max(0, 64 - n))
    return bool(ea == eb) or _compat.statically_known_equal(a, b)


def same_shape(a, b) -> bool:
    return len(a) == len(b) and all(same_size(x, y) for x, y in zip(a, b))


def is_one(x: Any) -> bool:
    return isinstance(x, int) and x == 1


def static_float(x: Any) -> Optional[float]:
    if isinstance(x, bool):
        return None
    if isinstance(x, (int, float)):
        return float(x)
    return None


# ---------------------------------------------------------------------------------------
# autocast


def autocast_states(gm: torch.fx.GraphModule) -> dict[torch.fx.Node, dict[str, Optional[torch.dtype]]]:
    """The autocast state each node of `gm` runs under, as {device type: dtype, None where
    autocast is off} for the device types that have one (Note [Attention under autocast] in
    runtime/amp.py): the state the trace ran under (dynamo guards on it: a call under another
    state compiles another graph; the backend runs in the traced call), changed by the
    `torch.autocast` regions dynamo records in the graph (`_enter_autocast(device_type, dtype,
    enabled, cache_enabled)` ... `_exit_autocast(ctx)`; a region's dtype None keeps the current
    one, as torch.autocast does)."""
    from ringcc.runtime.amp import AUTOCAST_DEVICES

    enter, exit_ = _compat.autocast_region_targets()
    current = {d: (torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in AUTOCAST_DEVICES}
    before: dict[torch.fx.Node, tuple[str, tuple]] = {}
    states = {}
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is enter:
            device_type, dtype, enabled = (list(node.args) + [None, True])[:3]
            if device_type in current:
                before[node] = (device_type, current[device_type])
                current[device_type] = (bool(enabled), dtype if dtype is not None else current[device_type][1])
        elif node.op == "call_function" and node.target is exit_ and node.args and node.args[0] in before:
            device_type, state = before[node.args[0]]
            current[device_type] = state
        states[node] = {d: (dt if on else None) for d, (on, dt) in current.items()}
    return states


# ---------------------------------------------------------------------------------------
# per-site facts handed from pass to pass (node meta keys)

SITE_META = "ringcc_site"  # report.Site of a canonical node
SKIP_META = "ringcc_skip"  # (SkipReason, detail) decided by an earlier pass
MASK_META = "ringcc_mask"  # LiftedMask: the attn_mask understood as a structured spec
MODS_META = "ringcc_score_mods"  # ScoreMods of a canonical node whose scores are modified
# A site with score modifiers: SDPA cannot say them, so its canonical node is a shadow that
# computes nothing anyone uses, and the user's nodes stay until the rewrite replaces this
# node's output (the user's P @ v) by the ring op's; a skipped site keeps the user's nodes
# and loses the shadow (rewrite_attention).
REPLACES_META = "ringcc_replaces"


@dataclass
class ScoreMods:
    """What a site's softmax does that SDPA cannot say: its score function (runtime/maskfn.py,
    Note [Score functions]; a MaskFn of kind "score", with the graph values it reads,
    `fn_inputs`), and attention sinks: a graph value of one sink logit per query head, [h], in
    every row's softmax denominator (Note [Attention sinks] in runtime/ops.py)."""

    fn: Any = None
    fn_inputs: tuple = ()
    sinks: Optional[torch.fx.Node] = None

    def any(self) -> bool:
        return self.fn is not None or self.sinks is not None

    def spec(self) -> dict:
        out: dict = {"sinks": None if self.sinks is None else self.sinks.name}
        if self.fn is not None:
            out["score_function"] = self.fn.text.replace("\n", "; ")
            out["score_function_inputs"] = [n.name for n in self.fn_inputs]
        return out


@dataclass
class LiftedMask:
    """A mask understood: allowed(b, h, i, j) = causal? (j <= i) and window? (|i - j| < window)
    and key_valid[b, j] and fn(b, h, i, j). `key_valid` is a bool [b, n] node; `fn` a mask
    function (runtime/maskfn.py, Note [Mask functions]) reading the whole-length tensors
    `fn_inputs` (graph nodes), extracted from the graph (passes/extract_mask.py).
    `fills`: the values an additive mask adds where it masks, in its dtype, when one of them is
    finite (transformers' eager masks: finfo(dtype).min), else (); they decide what eager gives a
    row whose keys are all masked (Note [Rows with no key] in runtime/ops.py). `keeps_diagonal`:
    the mask is proved true at j = i, so that no row is without a key."""

    causal: bool = False
    window: Optional[int] = None
    key_valid: Optional[torch.fx.Node] = None
    fn: Any = None
    fn_inputs: tuple = ()
    fills: tuple = ()
    keeps_diagonal: bool = False

    def rows_may_have_no_key(self) -> bool:
        # causal, a window or no mask at all keep (i, i); a key mask or a function may not
        return not self.keeps_diagonal and (self.key_valid is not None or self.fn is not None)

    def spec(self) -> dict:
        out = {"causal": self.causal, "window": self.window,
               "key_padding": None if self.key_valid is None else self.key_valid.name}
        if self.fn is not None:
            out["function"] = self.fn.text.replace("\n", "; ")
            out["function_inputs"] = [n.name for n in self.fn_inputs]
        if self.fills:
            out["fill"] = list(self.fills)
        return out
