"""Rewrite each accepted canonical site into the ringcc custom op.

An accepted site becomes

    op = torch.ops.ringcc.ring_attention.default(q, k, v, key_valid, is_causal, scale,
                                                 group_name, world_size, layout[, window])
    out = op[0]            # op[1] is the LSE

(window, a lifted sliding window |i - j| < window, is passed only when there is one; so are a
mask function, mask_fn= with its tensors mask_t0.., a score function, score_fn= with its tensors
score_t0.. (Notes [Mask functions] and [Score functions] in runtime/maskfn.py), and attention
sinks, sinks=, Note [Attention sinks] in runtime/ops.py).

Where an additive mask's masked value is finite and erases the scores (transformers' eager
masks) and a row may have every key masked, eager gives that row the mean of the values; the
op's output then goes through `ringcc.fill_empty_rows(op[0], op[1], q, k, v, ...)`, which puts
those rows there with eager's gradients (Note [Rows with no key] in runtime/ops.py). Where that
does not hold exactly (a fill that does not erase the scores, several masked values, a
non-linear score function), such rows stay 0 and the site's report detail says what eager gives.

with k/v carrying their own (GQA) heads. Under autocast q, k and v reach the op through the
casts SDPA's autocast policy gives them at that site (`q.to(torch.bfloat16)`, ...: Note
[Attention under autocast] in runtime/amp.py), so the op returns what SDPA returned. The layout is resolved once per graph from
Config.layout ("auto": zigzag when p > 1 and every rewritten site is causal) and stored in
ctx.scratch["layout"]; the op nodes go to ctx.scratch["attention_nodes"]. Every site gets
its decision in the report; Config(strict=True) turns a skip into an error.
"""

from __future__ import annotations

import contextlib
import math
import operator

import torch
import torch.fx

from ringcc import _compat
from ringcc.report import Decision, SkipReason
from ringcc.runtime import ops as _ring_ops  # noqa: F401 - registers torch.ops.ringcc
from ringcc.runtime.amp import AUTOCAST_DEVICES, cast_dtype
from ringcc.runtime.dilated import DilatedSpec, dilated_plan

from .attention_form import (MASK_META, MODS_META, REPLACES_META, SITE_META, SKIP_META, Builder, SdpaCall,
                             autocast_states, erase_dead, fake, is_aten_graph, is_sdpa, same_shape, same_size, static_float,
                             static_int)
from .base import PassContext, PassResult

PASS = "rewrite_attention"
RING_OP = torch.ops.ringcc.ring_attention.default
FILL_OP = torch.ops.ringcc.fill_empty_rows.default
# A finite masked value erases the scores added to it when half the spacing of floats there
# exceeds this (attention scores are far smaller): transformers' finfo(dtype).min in fp32, bf16 or
# fp64 does, fp16's -65504 (spacing 32) or -1e4 does not.
ERASED_SCORES = 1e6
DILATED_OP = torch.ops.ringcc.dilated_attention.default
DILATION_META = "ringcc_dilation"
AUTOCAST_META = "ringcc_autocast"  # the dtype autocast casts the site's q/k/v to (absent: autocast off)


def rewrite_attention(gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
    accepted = []
    autocast = autocast_states(gm)
    for node in list(gm.graph.nodes):
        if not is_sdpa(node) or SITE_META not in node.meta:
            continue
        site = node.meta[SITE_META]
        skip = node.meta.get(SKIP_META) or _check(node, ctx, autocast[node])
        if skip is not None:
            site.decision, (site.reason, site.detail) = Decision.SKIPPED, skip
            if REPLACES_META in node.meta:  # the user's nodes stay; their shadow goes
                _, canonical_out = node.meta[REPLACES_META]
                site.node = node.meta[REPLACES_META][0].name
                # with its key mask when nothing else reads it
                lifted = node.meta.get(MASK_META)
                mods = node.meta.get(MODS_META)
                erase_dead(gm, [canonical_out, mods and mods.sinks, lifted and lifted.key_valid])
        else:
            accepted.append(node)
    layout = ctx.scratch.setdefault("layout", _resolve_layout(ctx, accepted))
    ops = ctx.scratch.setdefault("attention_nodes", [])
    for node in accepted:
        ops.append(_rewrite(gm, node, ctx, layout))
    _enforce_strict(ctx)
    return PassResult(bool(accepted))


def _check(node: torch.fx.Node, ctx: PassContext, autocast: dict):
    """(reason, detail) when the site cannot become the ring op, else None. `autocast`: the
    autocast state at the site (attention_form.autocast_states)."""
    call = SdpaCall.of(node)
    lifted = node.meta.get(MASK_META)
    if lifted is None:
        return SkipReason.UNLIFTABLE_MASK, "mask not understood"
    dropout_p = static_float(call.dropout_p)
    if dropout_p is None:
        return SkipReason.DROPOUT, f"dropout_p is not a constant ({call.dropout_p!r})"
    if dropout_p > 0:
        # The ring runtime has no per-block dropout yet: the site stays as written (exact, O(n^2)).
        return SkipReason.DROPOUT, (f"dropout_p={dropout_p} in training; the ring runtime has no attention "
                                    "dropout yet: use eval mode or dropout 0 for this site to be rewritten")
    q, k, v = fake(call.q), fake(call.k), fake(call.v)
    if any(not isinstance(t, torch.Tensor) or t.dim() != 4 for t in (q, k, v)):
        shapes = [tuple(t.shape) if isinstance(t, torch.Tensor) else None for t in (q, k, v)]
        return SkipReason.SHAPE, f"q/k/v must be 4-D [b, h, n, d]; got {shapes}"
    if not same_size(q.shape[2], k.shape[2]):
        return SkipReason.CROSS_ATTENTION, (f"query length {q.shape[2]} != key length {k.shape[2]}: keys from "
                                            "another sequence, or a decoding step's new queries against a KV "
                                            "cache (decoding runs dense on every rank)")
    if not same_shape(k.shape[:3], v.shape[:3]) or not same_size(q.shape[0], k.shape[0]) \
            or not same_size(q.shape[3], k.shape[3]):
        return SkipReason.SHAPE, (f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not fit "
                                  "[b,h,n,d]/[b,g,n,d]/[b,g,n,dv]")
    h, g = static_int(q.shape[1]), static_int(k.shape[1])
    if h is None or g is None or h % g or (h != g and not call.enable_gqa):
        return SkipReason.SHAPE, f"heads q={q.shape[1]} kv={k.shape[1]} (enable_gqa={call.enable_gqa})"
    dtypes_skip = _check_dtypes(node, q, k, v, autocast.get(q.device.type))
    if dtypes_skip is not None:
        return dtypes_skip
    if call.scale is None and static_int(q.shape[3]) is None:
        return SkipReason.SHAPE, "symbolic head dim with default scale"
    if call.scale is not None and static_float(call.scale) is None and not _symbolic_float(call.scale):
        return SkipReason.SHAPE, f"scale is not a constant ({call.scale!r})"
    return _choose_dilation(node, ctx, lifted, q, k)


def _check_dtypes(node: torch.fx.Node, q, k, v, to):
    """The site's q/k/v after SDPA's autocast casts (to `to`; None: autocast off) must share one
    dtype, the one the traced attention returned. Stores `to` in meta for the rewrite."""
    after = [cast_dtype(t.dtype, to) for t in (q, k, v)]
    under = f"under autocast to {to}" if to is not None else "without autocast"
    if len(set(after)) > 1:
        return SkipReason.SHAPE, f"q/k/v dtypes differ {under}: {', '.join(str(d) for d in after)}"
    out = fake(node)
    if isinstance(out, torch.Tensor) and out.dtype != after[0]:
        return SkipReason.SHAPE, (f"the traced attention returns {out.dtype}, but SDPA's autocast policy gives "
                                  f"{after[0]} for q/k/v of {q.dtype}, {k.dtype}, {v.dtype} {under}")
    if to is not None:
        node.meta[AUTOCAST_META] = to
    return None


def _choose_dilation(node, ctx: PassContext, lifted, q, k):
    """Store the site's DilatedSpec (if any) in meta; a spec the site cannot run is a skip."""
    choice = ctx.config.dilation
    spec = choice(node.meta[SITE_META]) if callable(choice) and not isinstance(choice, DilatedSpec) else choice
    if spec is None:
        return None
    if not isinstance(spec, DilatedSpec):
        raise ValueError(f"Config.dilation must be a DilatedSpec, or a callable returning one or None; got {spec!r}")
    if MODS_META in node.meta:
        return SkipReason.UNSUPPORTED_MASK, ("score modifiers (a score function) or sinks with dilation: the dilated op "
                                             "takes none")
    if not same_size(q.shape[3], fake(SdpaCall.of(node).v).shape[3]):
        return SkipReason.SHAPE, "a value head dim of its own with dilation: the dilated op takes v with q's head dim"
    if lifted.key_valid is not None or lifted.window is not None or lifted.fn is not None:
        what = "key padding" if lifted.key_valid is not None else "a sliding window" if lifted.window is not None \
            else "a mask function"
        return SkipReason.UNSUPPORTED_MASK, f"{what} with dilation: the dilated op takes no such mask"
    n, world = static_int(q.shape[2]), ctx.world_size
    if n is None:
        # The dilated schedule (segments, rates, sub-rings) is planned per length: under dynamic
        # shapes the site specializes on its length (a guard: one graph per length) rather than
        # run dense attention, which would change the model's semantics.
        n = _compat.specialize_int(q.shape[2])
    if n is None or n % world:
        return SkipReason.SHAPE, f"dilation needs a static length divisible by p={world}; got {q.shape[2]}"
    layout = ctx.config.layout if ctx.config.layout != "auto" else "contiguous"
    try:
        dilated_plan(spec, n // world, int(q.shape[1]), int(k.shape[1]), 0, world, layout)
    except ValueError as e:
        return SkipReason.SHAPE, f"{spec!r} does not fit this site: {e}"
    node.meta[DILATION_META] = spec
    node.meta[SITE_META].dilation = repr(spec)
    return None


def _symbolic_float(x) -> bool:
    """A graph value holding a Python float (dynamo makes module floats such as HF's
    `self.scaling` symbolic under dynamic=True): the op takes it as its float argument."""
    return isinstance(x, torch.fx.Node) and isinstance(fake(x), torch.SymFloat)


def _resolve_layout(ctx: PassContext, accepted: list[torch.fx.Node]) -> str:
    if ctx.config.layout != "auto":
        return ctx.config.layout
    # Zigzag balances the causal triangle of the dense ring; a sliding window's band is
    # already balanced in contiguous order, and dilated segments are planned contiguous.
    all_causal = bool(accepted) and all(
        n.meta[MASK_META].causal and n.meta[MASK_META].window is None and DILATION_META not in n.meta
        for n in accepted)
    return "zigzag" if ctx.world_size > 1 and all_causal else "contiguous"


def _rewrite(gm: torch.fx.GraphModule, node: torch.fx.Node, ctx: PassContext, layout: str) -> torch.fx.Node:
    call, lifted = SdpaCall.of(node), node.meta[MASK_META]
    scale = (1.0 / math.sqrt(fake(call.q).shape[-1])) if call.scale is None else \
        call.scale if _symbolic_float(call.scale) else float(call.scale)
    b = Builder(gm, node, PASS)
    q, k, v = (_autocast_cast(b, x, node.meta.get(AUTOCAST_META)) for x in (call.q, call.k, call.v))
    spec = node.meta.get(DILATION_META)
    # the inputs carry the autocast casts already: the op's fake value must not cast again (its
    # autocast kernel would, wherever the trace's state is on outside an autocast-off region)
    below = _compat.below_autocast(fake(q).device.type) if fake(q).device.type in AUTOCAST_DEVICES \
        else contextlib.nullcontext()
    if spec is None:
        window = () if lifted.window is None else (lifted.window,)  # the op's 10th argument, default 0
        mods = node.meta.get(MODS_META)
        extra = {} if mods is None or mods.sinks is None else {"sinks": mods.sinks}
        if lifted.fn is not None:  # Note [Mask functions] in runtime/maskfn.py
            extra.update(mask_fn=lifted.fn.text, **{f"mask_t{i}": t for i, t in enumerate(lifted.fn_inputs)})
        if mods is not None and mods.fn is not None:  # Note [Score functions] in runtime/maskfn.py
            extra.update(score_fn=mods.fn.text, **{f"score_t{i}": t for i, t in enumerate(mods.fn_inputs)})
        with below:
            op = b.call(RING_OP, q, k, v, lifted.key_valid, lifted.causal, scale,
                        ctx.group_name, ctx.world_size, layout, *window, **extra)
        out = b.call(operator.getitem, op, 0)
        fill, no_key = _rows_with_no_key(lifted, mods, fake(q).dtype)
        if fill:  # Note [Rows with no key] in runtime/ops.py
            out = b.call(FILL_OP, out, b.call(operator.getitem, op, 1), q, k, v, scale, ctx.group_name,
                         ctx.world_size, layout)
    else:
        with below:
            op = b.call(DILATED_OP, q, k, v, list(spec.segment_lengths), list(spec.dilation_rates),
                        spec.offsets, lifted.causal, scale, ctx.group_name, ctx.world_size, layout)
        out, fill, no_key = b.call(operator.getitem, op, 0), False, ""
    out = _same_layout(b, out, fake(node), is_aten_graph(gm))
    node.replace_all_uses_with(out)
    site = node.meta[SITE_META]
    to = node.meta.get(AUTOCAST_META)
    site.decision, site.reason = Decision.REWRITTEN, None
    site.detail = "; ".join(filter(None, ["" if to is None else f"autocast: q/k/v in {to}", no_key]))
    site.differs = "" if fill else no_key
    site.node = op.name
    erase_dead(gm, [node])
    if REPLACES_META in node.meta:  # a shadow site: the user's P @ v takes the ring's output
        user_out, canonical_out = node.meta[REPLACES_META]
        user_out.replace_all_uses_with(out if canonical_out is node else canonical_out)
        call = user_out.args[0] if user_out.target is operator.getitem else None
        erase_dead(gm, [user_out])
        if (call is not None and call.target is torch.ops.higher_order.flex_attention and not call.users
                and call in set(gm.graph.nodes)):
            gm.graph.erase_node(call)  # a flex_attention site's call (passes/lift_masks.py: _flex_site)
    return op


def _rows_with_no_key(lifted, mods, dtype: torch.dtype) -> tuple[bool, str]:
    """(whether the site's output takes ringcc::fill_empty_rows, what the report says) for rows
    whose keys are all masked by a finite masked value (Note [Rows with no key] in runtime/ops.py)."""
    if not lifted.fills or not lifted.rows_may_have_no_key() or (mods is not None and mods.sinks is not None):
        return False, ""  # no such row, or a row's weight goes to its sink in eager and in the ring
    values = ", ".join(f"{f:g}" for f in lifted.fills)
    if len(lifted.fills) > 1:
        return False, (f"rows with every key masked give 0; eager's masked values {values} differ, and its softmax "
                       "weighs the keys of the largest one")
    if not _erases(lifted.fills[0], dtype):
        return False, (f"rows with every key masked give 0; eager adds the masked value {values} without erasing the "
                       f"scores in {dtype}: a softmax over every key")
    if mods is not None and mods.fn is not None and not _adds_to_score(mods.fn):
        return False, (f"rows with every key masked (by the finite value {values}) give 0; eager gives the mean of "
                       "the values, and its gradients weigh each key by the score function's derivative")
    return True, f"rows with every key masked (by the finite value {values}) give the mean of the values, as eager"


def _erases(fill: float, dtype: torch.dtype) -> bool:
    """fill + s == fill in `dtype` for every score |s| < ERASED_SCORES."""
    if not math.isfinite(fill) or not dtype.is_floating_point:
        return False
    _, e = math.frexp(abs(fill))
    return math.ldexp(torch.finfo(dtype).eps, e - 1) / 2 > ERASED_SCORES


def _adds_to_score(fn) -> bool:
    """The score function is score + (a value that does not read the score): d/d score is 1."""
    kinds = []  # per line: "one" (score plus a constant of the score), "none" (reads no score), "other"

    def kind(a):
        return kinds[a[1]] if a[0] == "v" else "one" if a == ("i", "score") else "none"

    for op, args in fn.lines:
        ks = [kind(a) for a in args]
        if all(k == "none" for k in ks):
            kinds.append("none")
        elif op == "add" and sorted(ks) == ["none", "one"] or op == "sub" and ks == ["one", "none"]:
            kinds.append("one")
        else:
            kinds.append("other")
    return kinds[-1] == "one"


def _autocast_cast(b: Builder, x: torch.fx.Node, to) -> torch.fx.Node:
    """`x` as SDPA's autocast cast to `to` (None: autocast off) gives it: `x.to(to)` where that
    changes its dtype."""
    dtype = fake(x).dtype
    return x if cast_dtype(dtype, to) == dtype else b.method("to", x, to)


def _same_layout(b: Builder, out: torch.fx.Node, like, aten: bool) -> torch.fx.Node:
    """`out` (contiguous) in the memory layout of the SDPA result it replaces, in export graphs.
    Export leaves out a `.contiguous()` that was a no-op on SDPA's result (the CPU kernels
    return [b, n, h, d] memory): a later view of the transposed output then needs that layout.
    Dynamo graphs keep every call the user wrote, so they need none."""
    if not aten or not isinstance(like, torch.Tensor) or like.dim() != 4 or like.is_contiguous():
        return out
    strides = [static_int(st) for st in like.stride()]
    if None in strides:
        return out
    order = sorted(range(4), key=lambda i: -strides[i])  # outermost dim first
    inverse = [order.index(i) for i in range(4)]
    x = b.call(torch.ops.aten.permute.default, out, order)
    x = b.call(torch.ops.aten.clone.default, x, memory_format=torch.contiguous_format)
    return b.call(torch.ops.aten.permute.default, x, inverse)


def _enforce_strict(ctx: PassContext) -> None:
    if not ctx.config.strict:
        return
    skipped = [s for s in ctx.report.sites if s.decision == Decision.SKIPPED]
    if skipped:
        lines = "; ".join(f"{s.form} site at {s.location}: {s.reason.value} ({s.detail})" for s in skipped)
        raise ValueError(f"Config(strict=True) but {len(skipped)} attention site(s) were not rewritten: {lines}. "
                         "Change the model or set strict=False to keep them as dense attention.")
