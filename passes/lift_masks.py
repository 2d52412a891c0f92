"""Lift each canonical site's mask into a structured spec, and undo GQA repeats of K/V.

A site's mask is read by a small abstract interpreter (Note [Mask lifting]) into

    allowed(b, i, j) = [j <= i] and [|i - j| < window] and key_valid[b, j]

stored as attention_form.LiftedMask in the SDPA node's meta and as a dict in the report.
A mask that is not of that form is read as a function of (b, h, q_idx, kv_idx) instead
(extract_mask.py, Note [Mask extraction]), and a flex_attention call becomes a site whose mask
is its mask_mod (`_flex_site`). The graph keeps the dense mask until the rewrite pass drops it,
so a site that is skipped later still runs as written. A mask this pass cannot read is
UNLIFTABLE_MASK, with why.

K/V repeated for GQA before the call (repeat_interleave(x, r, dim=1), or HF's
x[:, :, None].expand(b, g, r, n, d).reshape(b, g * r, n, d); both put head h on kv head
h // r, which is SDPA's enable_gqa rule) are replaced by x with enable_gqa=True, so K/V
travel with their own heads.

Note [Mask lifting]
Each node of the mask's expression tree is evaluated to an abstract value:
- Lin: an integer tensor sum_d coef_d * index_d + const, from arange (index_d: position
  along trailing dim d; after broadcasting, dim -2 is the query i and dim -1 the key j);
- Ind(pred, on, off): a tensor equal to `on` where the boolean formula pred holds and `off`
  elsewhere (a bool mask is Ind(pred, True, False); an additive one Ind(pred, 0, -inf));
  atoms of pred are comparisons of Lin values and Key = f(node)[b, j] is truthy (or falsy),
  node a [b, n] graph value, f elementwise ops on it, its b / n on trailing dims (-4, -1);
- Data: f(node) for a [b, n] non-constant graph value (a padding mask), not yet a predicate.
A slice x[..., a:] of a Lin is a Lin again (const + coef * a); of anything else it is
unliftable. Hugging Face without a KV cache ANDs "same packed sequence" into its mask, with
sequence ids (diff(pos, prepend=pos[:, :1] - 1) != 1).cumsum(-1) of the position ids: for
positions c + a * k, diff is the constant a only when the prepend is c - a on every row, so
that is checked; the ids are then constant, and comparing two of them is a constant.
The SDPA mask must end as Ind(pred, True, False) or Ind(pred, 0, <= -1e4) whose pred,
negations pushed to the atoms, is a conjunction of: bounds on j - i, trivially true bounds
on i or j alone, and Key atoms. Anything else is unliftable. Sizes are read from fake
values; nothing is evaluated on real data, so the spec holds for every input.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch
import torch.fx

from ringcc import _compat
from ringcc.report import SkipReason
from ringcc.runtime import ops as _ring_ops  # noqa: F401 - registers torch.ops.ringcc

from .attention_form import (MASK_META, MODS_META, REPLACES_META, SITE_META, SKIP_META, Builder, ScoreMods,
                             LiftedMask, SdpaCall, drop_unread, erase_dead, fake, is_aten_graph, is_one, is_sdpa,
                             propagate, same_shape, same_size, static_float, static_int)
from . import extract_mask
from .base import PassContext, PassResult, written_between

PASS = "lift_masks"
aten = torch.ops.aten
VERY_NEGATIVE = -1e4


def lift_masks(gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
    modified = False
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is FLEX_HOP:
            modified |= _flex_site(gm, node, ctx)
    key_nodes: dict = {}  # one key_valid node per padding mask, shared by every layer
    for node in list(gm.graph.nodes):
        if not is_sdpa(node) or SITE_META not in node.meta:
            continue
        if FLEX_META in node.meta:  # its mask is the flex site's own (_flex_site)
            continue
        modified |= _undo_gqa_repeat(gm, node)
        call = SdpaCall.of(node)
        site = node.meta[SITE_META]
        if not isinstance(call.is_causal, bool):
            node.meta[SKIP_META] = (SkipReason.UNLIFTABLE_MASK, f"is_causal is not a constant ({call.is_causal!r})")
            continue
        if call.attn_mask is None:
            lifted: Union[LiftedMask, str] = LiftedMask(causal=call.is_causal)
        else:
            lifted = _lift(gm, node, call, key_nodes)
            if isinstance(lifted, str):
                lifted = _extract(node, call, lifted)
            if isinstance(lifted, str) and "a score bias" in lifted and MODS_META not in node.meta:
                lifted = _bias(node, call, lifted)
        if isinstance(lifted, str):
            node.meta[SKIP_META] = (SkipReason.UNLIFTABLE_MASK, lifted)
            continue
        node.meta[MASK_META] = lifted
        site.mask = lifted.spec()
        if MODS_META in node.meta:
            site.mask.update(node.meta[MODS_META].spec())
    if not ctx.config.gather_outputs:
        modified |= _mask_outputs(gm, ctx)
    return PassResult(modified)


def _mask_outputs(gm: torch.fx.GraphModule, ctx: PassContext) -> bool:
    """[.., n, n] graph outputs that are mask functions leave the graph as their functions
    (Note [Mask outputs] in ringcc/sharded.py): the output's place gets an empty tensor, the
    function's tensors follow the graph's own outputs, and ctx.scratch["mask_outputs"] =
    (own output count, {index: (text, shape, dtype, positions of its tensors)}, input sizes)
    tells the backend. Under dynamic shapes a shape holds sympy expressions in the symbols that
    the graph's input sizes bind (input_sizes: symbol -> (input position, dim)), which the backend
    evaluates at each call."""
    out = gm.graph.output_node()
    flat = out.args[0] if len(out.args) == 1 else None
    if not isinstance(flat, (tuple, list)):
        return False
    outputs, extra, functions, sizes = list(flat), [], {}, input_sizes(gm)
    for i, a in enumerate(flat):
        v = fake(a) if isinstance(a, torch.fx.Node) else None
        if not (isinstance(v, torch.Tensor) and (v.dtype == torch.bool or v.is_floating_point()) and 2 <= v.dim() <= 4
                and (not isinstance(v.shape[-1], int) or v.shape[-1] > 1) and same_size(v.shape[-2], v.shape[-1])):
            continue
        shape = tuple(s if isinstance(s, int) else _compat.sym_expr(s) for s in v.shape)
        unbound = {str(x) for s in shape if not isinstance(s, int) for x in s.free_symbols if x not in sizes}
        if unbound:
            ctx.report.notes.append(f"output {i} ({a.name}, {tuple(v.shape)}) leaves the graph as a dense mask: its "
                                    f"size symbols {sorted(unbound)} are no size of the graph's inputs")
            continue
        try:
            fn, leaves = extract_mask.describe(a, (v.shape[-1],), out)
        except extract_mask.Unextractable:
            continue
        for leaf in leaves:
            if leaf not in extra:
                extra.append(leaf)
        with gm.graph.inserting_before(out):
            outputs[i] = gm.graph.call_function(torch.empty, ((0,),), {"dtype": torch.bool, "device": v.device})
        propagate(gm, outputs[i])
        functions[i] = (fn.text, shape, v.dtype, tuple(len(flat) + extra.index(leaf) for leaf in leaves))
        ctx.report.notes.append(f"output {i} ({a.name}, {tuple(v.shape)}) leaves the graph as its mask function "
                                f"over {len(leaves)} per-token tensor(s)")
    if not functions:
        return False
    out.args = (type(flat)(outputs + extra),)
    erase_dead(gm, [flat[i] for i in functions])  # the dense masks, unless the graph's sites still read them
    ctx.scratch["mask_outputs"] = (len(flat), functions, sizes)
    return True


def input_sizes(gm: torch.fx.GraphModule) -> dict:
    """Where the graph's inputs bind each size symbol: symbol -> (input position, dim), dim None
    for a SymInt input."""
    where: dict = {}
    for i, node in enumerate(p for p in gm.graph.nodes if p.op == "placeholder"):
        v = fake(node)
        dims = ([(None, v)] if isinstance(v, torch.SymInt) else
                list(enumerate(v.shape)) if isinstance(v, torch.Tensor) else [])
        for d, s in dims:
            if isinstance(s, torch.SymInt) and (e := _compat.sym_expr(s)).is_Symbol:
                where.setdefault(e, (i, d))
    return where


# ---------------------------------------------------------------------------------------
# flex_attention sites

FLEX_HOP = torch.ops.higher_order.flex_attention
FLEX_META = "ringcc_flex"


def _flex_site(gm: torch.fx.GraphModule, node: torch.fx.Node, ctx: PassContext) -> bool:
    """A flex_attention call (dynamo's higher-order op) is a site whose mask is its mask_mod, a
    subgraph (Note [Mask extraction] in extract_mask.py). It gets a canonical SDPA node that is a
    shadow of the call (attention_form.REPLACES_META): the rewrite replaces the call's output by
    the ring op's; a skipped site keeps the call. Only the output is read (not the LSE; an LSE
    that nothing reads, computed on and dropped, is erased: attention_form.drop_unread). Its
    score_mod, a subgraph too, is read as the site's score function (Note [Score extraction] in
    extract_mask.py)."""
    from ringcc.report import Decision, Site

    from .base import location

    q, k, v, score_mod, block_mask, scale = node.args[:6]
    score_buffers = tuple(node.args[7]) if len(node.args) > 7 else ()
    mask_buffers = tuple(node.args[8]) if len(node.args) > 8 else ()
    drop_unread(gm, [u for u in node.users if u.target is not operator.getitem or u.args[1] != 0])
    outs = [u for u in node.users]
    site = Site(node=node.name, location=location(node), form="flex")
    ctx.report.sites.append(site)

    def skip(reason, detail):
        site.decision, site.reason, site.detail = Decision.SKIPPED, reason, detail
        return False

    if any(u.target is not operator.getitem or u.args[1] != 0 for u in outs) or len(outs) != 1:
        return skip(SkipReason.WEIGHTS_USED, "the flex_attention call's LSE (or max scores) is read")
    qv, kv = fake(q), fake(k)
    try:
        scored = extract_mask.extract_score_mod(getattr(gm, score_mod.target), score_buffers,
                                                (qv.shape[-2], kv.shape[-2]))
    except extract_mask.Unextractable as e:
        return skip(SkipReason.UNSUPPORTED_MASK, f"flex_attention score_mod: {e}")
    try:
        got = extract_mask.extract_mask_mod(getattr(gm, block_mask[-1].target), mask_buffers,
                                            (qv.shape[-2], kv.shape[-2]))
    except extract_mask.Unextractable as e:
        return skip(SkipReason.UNLIFTABLE_MASK, f"flex_attention mask_mod: {e}")
    for what, inputs in (("mask_mod", got.inputs), ("score_mod", scored.inputs)):
        if len(inputs) > _ring_ops.MASK_TENSORS:
            return skip(SkipReason.UNLIFTABLE_MASK, f"the {what} reads {len(inputs)} tensors; the ring op takes "
                        f"at most {_ring_ops.MASK_TENSORS}")
    out = outs[0]
    b = Builder(gm, out, PASS)
    call = SdpaCall(q, k, v, None, 0.0, got.causal, scale, enable_gqa=not same_size(qv.shape[1], kv.shape[1]))
    sdpa = b.sdpa(call, "flex")
    ctx.report.sites.remove(site)
    site.node = sdpa.name
    sdpa.meta[SITE_META] = site
    ctx.report.sites.append(site)
    sdpa.meta[FLEX_META] = True
    sdpa.meta[REPLACES_META] = (out, sdpa)
    lifted = LiftedMask(causal=got.causal, fn=got.fn, fn_inputs=tuple(got.inputs))
    sdpa.meta[MASK_META] = lifted
    site.mask = lifted.spec()
    if scored.fn is not None:
        sdpa.meta[MODS_META] = ScoreMods(fn=scored.fn, fn_inputs=tuple(scored.inputs))
        site.mask.update(sdpa.meta[MODS_META].spec())
    return True


# ---------------------------------------------------------------------------------------
# GQA


def _undo_gqa_repeat(gm: torch.fx.GraphModule, node: torch.fx.Node) -> bool:
    call = SdpaCall.of(node)
    if _broadcast_heads(call):
        # K/V with one head broadcast to the query heads by SDPA itself (Falcon's multi-query
        # form): the same attention as enable_gqa=True, every query head on kv head 0.
        call.enable_gqa = True
        node.args, node.kwargs = call.args_kwargs(is_aten_graph(gm))
        return True
    ks, vs = _repeat_source(call.k), _repeat_source(call.v)
    if ks is None or vs is None or ks[1] != vs[1]:
        return False
    call.k, call.v, call.enable_gqa = ks[0], vs[0], True
    old = [n for n in (SdpaCall.of(node).k, SdpaCall.of(node).v)]
    node.args, node.kwargs = call.args_kwargs(is_aten_graph(gm))
    erase_dead(gm, old)
    return True


def _broadcast_heads(call: SdpaCall) -> bool:
    """q with h > 1 heads, k and v with one head each and enable_gqa off: SDPA broadcasts them."""
    qv, kv, vv = fake(call.q), fake(call.k), fake(call.v)
    if call.enable_gqa is not False or not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (qv, kv, vv)):
        return False
    return is_one(kv.shape[1]) and is_one(vv.shape[1]) and isinstance(qv.shape[1], int) and qv.shape[1] > 1


def _repeat_source(x: Any) -> Optional[tuple[torch.fx.Node, int]]:
    """(source [b, g, n, d], r) when x repeats each of its g heads r times consecutively
    (repeat_interleave, HF's expand + reshape, or one head expanded: multi-query)."""
    if not isinstance(x, torch.fx.Node) or x.op not in ("call_function", "call_method"):
        return None
    xv = fake(x)
    if not isinstance(xv, torch.Tensor) or xv.dim() != 4:
        return None
    if x.target in ("expand", aten.expand.default):
        src = x.args[0]
        sv = fake(src)
        if (isinstance(src, torch.fx.Node) and isinstance(sv, torch.Tensor) and sv.dim() == 4 and is_one(sv.shape[1])
                and isinstance(xv.shape[1], int) and same_shape(sv.shape[2:], xv.shape[2:])
                and same_size(sv.shape[0], xv.shape[0])):
            return src, xv.shape[1]
        return None
    if x.target in (torch.repeat_interleave, "repeat_interleave", aten.repeat_interleave.self_int):
        src = x.args[0]
        r = x.kwargs.get("repeats", x.args[1] if len(x.args) > 1 else None)
        dim = x.kwargs.get("dim", x.args[2] if len(x.args) > 2 else None)
        sv = fake(src)
        if isinstance(r, int) and isinstance(dim, int) and dim % 4 == 1 and isinstance(sv, torch.Tensor) and sv.dim() == 4:
            return src, r
        return None
    if x.target in ("reshape", "view", torch.reshape, aten.reshape.default, aten.view.default):
        e = x.args[0]
        ev = fake(e)
        if not isinstance(ev, torch.Tensor) or ev.dim() != 5 or not isinstance(e, torch.fx.Node):
            return None
        if e.target not in ("expand", aten.expand.default):
            return None
        u = e.args[0]
        uv = fake(u)
        if not isinstance(uv, torch.Tensor) or uv.dim() != 5 or uv.shape[2] != 1:
            return None
        src = _unsqueeze2_source(u)
        if src is None:
            return None
        b, g, r, n, d = ev.shape
        if not isinstance(g, int) or not isinstance(r, int) or not same_shape(xv.shape, (b, g * r, n, d)):
            return None
        return src, r
    return None


def _unsqueeze2_source(u: torch.fx.Node) -> Optional[torch.fx.Node]:
    """x when u = x[:, :, None] / x.unsqueeze(2) for a 4-D x."""
    if u.target in ("unsqueeze", torch.unsqueeze, aten.unsqueeze.default) and u.args[1] in (2, -3):
        return u.args[0]
    if u.target is operator.getitem and isinstance(u.args[1], tuple):
        idx = u.args[1]
        full = slice(None, None, None)
        if idx in ((full, full, None), (full, full, None, full, full), (full, full, None, Ellipsis)):
            return u.args[0]
    return None


# ---------------------------------------------------------------------------------------
# abstract values


@dataclass(frozen=True)
class Lin:
    """sum(coef * index along trailing dim) + const (an arange-derived integer tensor)."""

    coefs: tuple[tuple[int, int], ...]  # ((trailing dim, coef), ...), sorted
    const: int
    ndim: int
    lengths: tuple[tuple[int, Any], ...]  # ((trailing dim, arange length), ...)

    def shift(self, dim_map: dict[int, int], ndim: int) -> "Lin":
        return Lin(tuple(sorted((dim_map[d], c) for d, c in self.coefs)), self.const, ndim,
                   tuple(sorted((dim_map[d], n) for d, n in self.lengths)))


@dataclass(frozen=True)
class Rel:
    """lin <= 0 (integers; other comparisons are rewritten to this)."""

    lin: Lin


@dataclass(frozen=True)
class Key:
    """f(node)[b, j] is truthy (truth) / falsy (not truth): node is a [b, n] graph value, f
    the elementwise `ops` applied to it since, `dims` the trailing dims of its b and n."""

    node: torch.fx.Node
    truth: bool
    dims: tuple[int, int]
    ops: tuple


@dataclass(frozen=True)
class And:
    parts: tuple


@dataclass(frozen=True)
class Or:
    parts: tuple


@dataclass(frozen=True)
class Not:
    x: Any


TRUE = And(())


@dataclass(frozen=True)
class Ind:
    pred: Any
    on: Any  # Python bool / float
    off: Any
    ndim: int = 0


@dataclass(frozen=True)
class Data:
    """A [b, n] non-constant tensor `node` (e.g. a padding mask input) after the elementwise
    `ops` (replayed to build key_valid); `dims`: the trailing dims its b and n sit on."""

    node: torch.fx.Node
    dims: tuple[int, int] = (-2, -1)
    ops: tuple = ()


class Unliftable(Exception):
    pass


def _lift(gm: torch.fx.GraphModule, sdpa: torch.fx.Node, call: SdpaCall, key_nodes: dict) -> Union[LiftedMask, str]:
    """The site's mask as a LiftedMask, or why not (unliftable)."""
    qv, kv = fake(call.q), fake(call.k)
    if qv.dim() != 4 or kv.dim() != 4:
        return "mask lifting needs 4-D q / k"
    n_q, n_k = qv.shape[-2], kv.shape[-2]
    try:
        val = _Interp(n_q, n_k).eval(call.attn_mask)
        if isinstance(val, Data) and fake(call.attn_mask).dtype == torch.bool:  # a padding mask alone
            val = Ind(Key(val.node, True, val.dims, val.ops), True, False, fake(call.attn_mask).dim())
        if isinstance(val, Data):
            raise Unliftable(f"mask is a tensor computed from data ({call.attn_mask.name}), not from positions")
        if not isinstance(val, Ind):
            raise Unliftable(f"mask evaluates to {type(val).__name__}")
        if val.on is True and val.off is False:
            pred, masked = val.pred, None
        elif val.on is False and val.off is True:
            pred, masked = Not(val.pred), None
        elif val.on == 0 and not isinstance(val.on, bool) and _neg(val.off):
            pred, masked = val.pred, val.off
        elif val.off == 0 and not isinstance(val.off, bool) and _neg(val.on):
            pred, masked = Not(val.pred), val.on
        else:
            raise Unliftable(f"mask takes values {val.on!r} / {val.off!r}, not attend / -inf")
        atoms = _conjunction(_push_not(pred, False))
        lifted = _spec(atoms, n_q, n_k, bool(call.is_causal))
        if masked is not None:
            lifted.fills = extract_mask.masked_values([masked], fake(call.attn_mask).dtype)
    except Unliftable as e:
        return str(e)
    if lifted.key_valid is not None:
        key = lifted.key_valid
        kb, kn = fake(key.node).shape
        if not same_size(kn, n_k) or not (same_size(kb, qv.shape[0]) or is_one(kb) and isinstance(qv.shape[0], int)):
            return f"padding mask of shape {tuple(fake(key.node).shape)} for keys [{qv.shape[0]}, {n_k}]"
        ident = (key.node, key.truth, key.ops)
        if ident not in key_nodes or written_between(key.node, key_nodes[ident], sdpa):
            # (again after an in-place write)
            key_nodes[ident] = _key_valid_node(gm, sdpa, key)
        lifted.key_valid = key_nodes[ident]
    return lifted


def _extract(sdpa: torch.fx.Node, call: SdpaCall, why_not_lifted: str) -> Union[LiftedMask, str]:
    """The site's mask as a function (Note [Mask extraction] in extract_mask.py), for a mask
    the structured spec does not say; or why not."""
    qv, kv = fake(call.q), fake(call.k)
    if qv.dim() != 4 or kv.dim() != 4:
        return why_not_lifted
    try:
        got = extract_mask.extract(call.attn_mask, (qv.shape[-2], kv.shape[-2]), bool(call.is_causal), sdpa)
    except extract_mask.Unextractable as e:
        return str(e)
    if len(got.inputs) > _ring_ops.MASK_TENSORS:
        return (f"the mask function reads {len(got.inputs)} per-token tensors "
                f"({', '.join(n.name for n in got.inputs)}); the ring op takes at most {_ring_ops.MASK_TENSORS}")
    return LiftedMask(causal=got.causal, fn=got.fn, fn_inputs=tuple(got.inputs), fills=got.fills,
                      keeps_diagonal=got.keeps_diagonal)


def _neg(v: Any) -> bool:
    return isinstance(v, float) and v <= VERY_NEGATIVE


def _push_not(p, neg: bool):
    if isinstance(p, Not):
        return _push_not(p.x, not neg)
    if isinstance(p, (And, Or)):
        parts = tuple(_push_not(x, neg) for x in p.parts)
        return (Or if isinstance(p, And) else And)(parts) if neg else type(p)(parts)
    if isinstance(p, Key):
        return Key(p.node, p.truth != neg, p.dims, p.ops)
    if isinstance(p, Rel) and neg:  # not (lin <= 0)  <=>  -lin + 1 <= 0
        return Rel(_lin_scale(p.lin, -1, 1))
    return p


def _conjunction(p) -> list:
    if isinstance(p, And):
        return [a for x in p.parts for a in _conjunction(x)]
    if isinstance(p, Or):
        raise Unliftable("mask is a disjunction of conditions (e.g. causal OR something)")
    return [p]


def _spec(atoms: list, n_q: Any, n_k: Any, is_causal: bool) -> LiftedMask:
    """Bounds lo <= j - i <= hi (None: unbounded) and key atoms -> LiftedMask. n_q / n_k
    may be symbolic: bounds that need the length to decide are then unliftable."""
    hi: Optional[int] = None
    lo: Optional[int] = None
    keys = []
    for a in atoms:
        if isinstance(a, Key):
            if a.dims == (-2, -1):
                raise Unliftable(
                    f"a stored [query, key] mask tensor ({a.node.name}): its values are data, not read at "
                    f"trace time; build the mask from positions (e.g. torch.arange(n)[:, None] >= "
                    f"torch.arange(n)[None, :], or torch.ones(n, n).tril()), or pass is_causal=True")
            if a.dims != (-4, -1):
                raise Unliftable("a [b, n] mask that does not sit on the batch and key dims")
            keys.append(a)
            continue
        coefs, c = dict(a.lin.coefs), a.lin.const
        if set(coefs) - {-1, -2}:
            raise Unliftable("mask compares positions along a dim that is not query / key")
        ci, cj = coefs.get(-2, 0), coefs.get(-1, 0)
        for d, size in a.lin.lengths:
            if not same_size(size, n_q if d == -2 else n_k):
                raise Unliftable(f"positions along dim {d} span {size}, the attention {n_q} x {n_k}")
        if ci == 0 and cj == 0:
            if c <= 0:
                continue
            raise Unliftable("mask is always false")
        if ci == -cj:  # cj * (j - i) + c <= 0
            if cj > 0:
                hi = (-c) // cj if hi is None else min(hi, (-c) // cj)
            else:
                bound = -((-c) // (-cj))
                lo = bound if lo is None else max(lo, bound)
            continue
        if ci == 0 or cj == 0:  # coef * idx + c <= 0 must hold for every idx in [0, n)
            coef, n = (cj, n_k) if ci == 0 else (ci, n_q)
            if coef < 0 and c <= 0:
                continue
            if coef > 0 and isinstance(n, int) and coef * (n - 1) + c <= 0:
                continue
        raise Unliftable("mask condition is not a function of j - i (e.g. a document or block mask)")
    # bounds the sequence itself already imposes say nothing
    if hi is not None and isinstance(n_k, int) and hi >= n_k - 1:
        hi = None
    if lo is not None and isinstance(n_q, int) and lo <= -(n_q - 1):
        lo = None
    lifted = LiftedMask(causal=is_causal)
    if hi == 0 and same_size(n_q, n_k):
        lifted.causal = True
        if lo is not None:
            lifted.window = 1 - lo
    elif hi is None and lo is None:
        pass
    elif hi is not None and lo == -hi and hi > 0 and not is_causal and same_size(n_q, n_k):
        lifted.window = hi + 1
    else:
        raise Unliftable(f"mask allows {lo} <= j - i <= {hi}: neither causal nor a (causal or symmetric) window")
    if len({(k.node, k.truth, k.ops) for k in keys}) > 1:
        raise Unliftable("more than one key padding tensor")
    if keys:
        lifted.key_valid = keys[0]
    return lifted


def _bias(sdpa: torch.fx.Node, call: SdpaCall, why_not: str) -> Union[LiftedMask, str]:
    """An additive float attn_mask that is a score bias, as the site's score function score + m
    (Note [Score functions] in runtime/maskfn.py) with is_causal as its mask; or why not."""
    qv, kv = fake(call.q), fake(call.k)
    try:
        got = extract_mask.extract_bias(call.attn_mask, (qv.shape[-2], kv.shape[-2]))
    except extract_mask.Unextractable as e:
        return f"{why_not}; as a score function: {e}"
    if len(got.inputs) > _ring_ops.MASK_TENSORS:
        return f"{why_not}; as a score function it reads {len(got.inputs)} tensors, the ring op at most " \
            f"{_ring_ops.MASK_TENSORS}"
    sdpa.meta[MODS_META] = ScoreMods(fn=got.fn, fn_inputs=tuple(got.inputs))
    return LiftedMask(causal=bool(call.is_causal))


def _key_valid_node(gm: torch.fx.GraphModule, sdpa: torch.fx.Node, key: Key) -> torch.fx.Node:
    """A bool [b, n] node, True = attend: the key tensor with its ops replayed."""
    if key.truth and not key.ops and fake(key.node).dtype == torch.bool:
        return key.node
    b = Builder(gm, sdpa, PASS)
    at = is_aten_graph(gm)
    x = key.node
    for op in key.ops:
        if op[0] == "cmp":
            x = b.call(getattr(aten, op[1]).Scalar if at else getattr(operator, op[1]), x, op[2])
        elif op[0] == "not":
            x = b.call(aten.logical_not.default if at else torch.logical_not, x)
        elif op[0] == "cast":
            x = b.call(aten._to_copy.default, x, dtype=op[1]) if at else b.method("to", x, op[1])
    if fake(x).dtype != torch.bool or not key.truth:
        x = b.call((aten.ne.Scalar if key.truth else aten.eq.Scalar) if at else (operator.ne if key.truth else operator.eq), x, 0)
    batch = fake(SdpaCall.of(sdpa).q).shape[0]
    if not same_size(fake(x).shape[0], batch):  # one padding row shared by the batch
        x = b.call(aten.expand.default, x, [batch, -1]) if at else b.method("expand", x, batch, -1)
    return x


def _lin_scale(lin: Lin, k: int, add: int = 0) -> Lin:
    return Lin(tuple((d, c * k) for d, c in lin.coefs), lin.const * k + add, lin.ndim, lin.lengths)


def _lin_add(a: Lin, b: Lin, sign: int = 1) -> Lin:
    coefs = dict(a.coefs)
    for d, c in b.coefs:
        coefs[d] = coefs.get(d, 0) + sign * c
    lengths = dict(a.lengths)
    for d, n in b.lengths:
        if d in lengths and not same_size(lengths[d], n):
            raise Unliftable("aranges of different lengths on one dim")
        lengths[d] = n
    return Lin(tuple(sorted((d, c) for d, c in coefs.items() if c)), a.const + sign * b.const,
               max(a.ndim, b.ndim), tuple(sorted(lengths.items())))


# ---------------------------------------------------------------------------------------
# the interpreter

CMP = {operator.le: "le", operator.lt: "lt", operator.ge: "ge", operator.gt: "gt",
       torch.le: "le", torch.lt: "lt", torch.ge: "ge", torch.gt: "gt",
       aten.le.Tensor: "le", aten.lt.Tensor: "lt", aten.ge.Tensor: "ge", aten.gt.Tensor: "gt",
       aten.le.Scalar: "le", aten.lt.Scalar: "lt", aten.ge.Scalar: "ge", aten.gt.Scalar: "gt",
       "le": "le", "lt": "lt", "ge": "ge", "gt": "gt", "__le__": "le", "__lt__": "lt", "__ge__": "ge", "__gt__": "gt",
       operator.eq: "eq", operator.ne: "ne", torch.eq: "eq", torch.ne: "ne", "eq": "eq", "ne": "ne",
       "__eq__": "eq", "__ne__": "ne", aten.eq.Scalar: "eq", aten.ne.Scalar: "ne", aten.eq.Tensor: "eq",
       aten.ne.Tensor: "ne"}
AND = {operator.and_, torch.logical_and, torch.bitwise_and, "logical_and", "bitwise_and", "__and__",
       aten.logical_and.default, aten.bitwise_and.Tensor, aten.__and__.Tensor}
OR = {operator.or_, torch.logical_or, torch.bitwise_or, "logical_or", "bitwise_or", "__or__",
      aten.logical_or.default, aten.bitwise_or.Tensor, aten.__or__.Tensor}
NOT = {operator.invert, torch.logical_not, torch.bitwise_not, "logical_not", "bitwise_not", "__invert__",
       aten.logical_not.default, aten.bitwise_not.default}
ADD = {operator.add, torch.add, "add", "__add__", aten.add.Tensor, aten.add.Scalar}
SUB = {operator.sub, torch.sub, "sub", "__sub__", aten.sub.Tensor, aten.sub.Scalar}
RSUB = {"rsub", "__rsub__", torch.rsub, aten.rsub.Scalar}
MUL = {operator.mul, torch.mul, "mul", "__mul__", aten.mul.Tensor, aten.mul.Scalar}
NEG = {operator.neg, torch.neg, "neg", aten.neg.default}
ABS = {torch.abs, "abs", operator.abs, aten.abs.default}
FACTORY_FULL = {torch.ones: 1.0, torch.zeros: 0.0, torch.ones_like: 1.0, torch.zeros_like: 0.0,
                "new_ones": 1.0, "new_zeros": 0.0, aten.ones.default: 1.0, aten.zeros.default: 0.0,
                aten.new_ones.default: 1.0, aten.new_zeros.default: 0.0,
                aten.ones_like.default: 1.0, aten.zeros_like.default: 0.0}
FULL = {torch.full, "new_full", torch.full_like, aten.full.default, aten.full_like.default}
TRIL = {torch.tril, "tril", aten.tril.default}
TRIU = {torch.triu, "triu", aten.triu.default}
MASKED_FILL = {torch.masked_fill, "masked_fill", "masked_fill_", aten.masked_fill.Scalar, aten.masked_fill_.Scalar}
WHERE = {torch.where, aten.where.self, aten.where.ScalarOther, aten.where.ScalarSelf}
KEEP = {"to", "contiguous", "clone", "type_as", "detach", torch.clone, aten.clone.default, aten._to_copy.default,
        aten.to.dtype, aten.to.device, aten.to.dtype_layout, aten.contiguous.default, aten.lift_fresh_copy.default,
        aten.alias.default, aten.detach.default}
CAST_BOOL = {"bool"}
CAST_FLOAT = {"float", "half", "bfloat16", "double"}
CAST_INT = {"int", "long"}
EXPAND = {"expand", "expand_as", aten.expand.default, "broadcast_to", torch.broadcast_to}
DIFF = {torch.diff, "diff", aten.diff.default}
CUMSUM = {torch.cumsum, "cumsum", aten.cumsum.default}
ARANGE = {torch.arange, aten.arange.default, aten.arange.start, aten.arange.start_step}


class _Interp:
    def __init__(self, n_q: int, n_k: int):
        self.n_q, self.n_k = n_q, n_k
        self.memo: dict[torch.fx.Node, Any] = {}

    def eval(self, x: Any) -> Any:
        if isinstance(x, torch.fx.Node):
            if x not in self.memo:
                val = self._node(x)
                self.memo[x] = self._fit(val, x) if isinstance(val, Lin) else val
            return self.memo[x]
        if isinstance(x, (bool, int, float)):
            return x
        raise Unliftable(f"mask uses a constant of type {type(x).__name__}")

    def _fit(self, lin: Lin, node: torch.fx.Node) -> Lin:
        """Positions read off the tensor's actual sizes: along a dim of size 1 an index is
        always 0 (arange(1), x[:1], before an expand), so its term drops out."""
        v = fake(node)
        if not isinstance(v, torch.Tensor):
            return lin
        nd = v.dim()
        coefs, lengths = [], []
        for d, c in lin.coefs:
            if -d > nd:
                raise Unliftable("positions on a dim the tensor does not have")
            size = v.shape[d]
            if is_one(size):
                continue
            coefs.append((d, c))
            lengths.append((d, size))
        return Lin(tuple(coefs), lin.const, nd, tuple(lengths))

    def _data(self, node: torch.fx.Node) -> Data:
        v = fake(node)
        if not isinstance(v, torch.Tensor) or v.dim() != 2:
            shape = tuple(v.shape) if isinstance(v, torch.Tensor) else None
            raise Unliftable(f"mask is read from a tensor input ({node.name}, shape {shape}), not built from positions")
        return Data(node)

    def _data_op(self, x: Data, op: tuple, node: torch.fx.Node) -> Data:
        """x after an elementwise op. While x is still its own [b, n] tensor, the op's node is
        that tensor (no need to replay anything); once placed, the op is recorded."""
        if x.dims == (-2, -1) and not x.ops and fake(node).dim() == 2:
            return Data(node)
        return Data(x.node, x.dims, x.ops + (op,))

    def _ndim(self, node: torch.fx.Node) -> int:
        v = fake(node)
        return v.dim() if isinstance(v, torch.Tensor) else 0

    def _node(self, node: torch.fx.Node) -> Any:
        t = node.target
        if node.op == "placeholder" or node.op == "get_attr":
            return self._data(node)
        if node.op not in ("call_function", "call_method"):
            raise Unliftable(f"mask built by {node.op}")
        args, kw = node.args, node.kwargs
        nd = self._ndim(node)
        if t in ARANGE:
            return self._arange(node)
        if t in FACTORY_FULL:
            return Ind(TRUE, self._cast_const(FACTORY_FULL[t], node), self._cast_const(FACTORY_FULL[t], node), nd)
        if t in FULL:
            value = args[-1] if t not in ("new_full",) else args[2] if len(args) > 2 else kw.get("fill_value")
            value = kw.get("fill_value", value)
            c = static_float(value)
            if c is None:
                raise Unliftable("full() with a non-constant value")
            c = self._cast_const(c, node)
            return Ind(TRUE, c, c, nd)
        if t in KEEP or (t == "to" and node.op == "call_method"):
            x = self.eval(args[0])
            return self._cast(x, node)
        if t in CAST_BOOL or t in CAST_FLOAT or t in CAST_INT:
            return self._cast(self.eval(args[0]), node)
        if t in EXPAND:
            return self._broadcast(self.eval(args[0]), node)
        if t is operator.getitem:
            return self._getitem(node)
        if t is aten.index.Tensor:  # export's spelling of x[i, j] with tensor indices
            return self._advanced_index(self.eval(args[0]), args[0], tuple(args[1]), node)
        if t is aten.slice.Tensor:
            return self._slice(node)
        if t in ("unsqueeze", torch.unsqueeze, aten.unsqueeze.default, "view", "reshape", torch.reshape,
                 aten.view.default, aten.reshape.default, "squeeze", aten.squeeze.dim):
            return self._reshape(node)
        if t in CMP:
            return self._compare(CMP[t], self.eval(args[0]), self.eval(args[1]), node)
        if t in AND:
            return self._logic(And, args, node)
        if t in OR:
            return self._logic(Or, args, node)
        if t in NOT:
            x = self.eval(args[0])
            if isinstance(x, Ind) and isinstance(x.on, bool):
                return Ind(x.pred, not x.on, not x.off, x.ndim)
            if isinstance(x, Data) and fake(node).dtype == torch.bool:
                return self._data_op(x, ("not",), node)
            raise Unliftable("logical not of a non-bool mask")
        if t in ADD or t in SUB or t in RSUB:
            a, b = self.eval(args[0]), self.eval(args[1] if len(args) > 1 else kw.get("other"))
            sign = -1 if t in SUB else 1
            if t in RSUB:
                a, b, sign = b, a, -1
            return self._add(a, b, sign, node)
        if t in MUL:
            return self._mul(self.eval(args[0]), self.eval(args[1]), node)
        if t in NEG:
            return self._mul(self.eval(args[0]), -1, node)
        if t in ABS:
            x = self.eval(args[0])
            if isinstance(x, Lin):
                return ("abs", x)
            raise Unliftable("abs of a non-position value")
        if t in DIFF:
            return self._diff(node)
        if t in CUMSUM:
            x = self.eval(args[0])
            if isinstance(x, Ind) and x.on == x.off and not x.on:
                return Ind(TRUE, 0.0, 0.0, x.ndim)  # a running sum of zeros
            raise Unliftable("cumsum of a non-zero mask value (e.g. packed-sequence ids from data)")
        if t in TRIL or t in TRIU:
            return self._band(node, upper=t in TRIU)
        if t in MASKED_FILL:
            return self._masked_fill(node)
        if t in WHERE:
            return self._where(node)
        raise Unliftable(f"mask uses {getattr(t, '__name__', t)!s}, which mask lifting does not read")

    # -- constructors

    def _arange(self, node: torch.fx.Node) -> Lin:
        args = [a for a in node.args]
        if len(args) == 1:
            start, end, step = 0, args[0], 1
        else:
            start, end = args[0], args[1]
            step = args[2] if len(args) > 2 else node.kwargs.get("step", 1)
        start = node.kwargs.get("start", start)
        if static_int(start) is None or step != 1:
            raise Unliftable("arange with a non-constant start or a step != 1")
        length = fake(node).shape[0]
        return Lin(((-1, 1),), int(start), 1, ((-1, length),))

    def _cast_const(self, c: float, node: torch.fx.Node):
        v = fake(node)
        dt = v.dtype if isinstance(v, torch.Tensor) else None
        if dt == torch.bool:
            return bool(c)
        return float(c)

    def _cast(self, x: Any, node: torch.fx.Node) -> Any:
        v = fake(node)
        if not isinstance(v, torch.Tensor):
            return x
        if isinstance(x, Ind):
            return Ind(x.pred, self._cast_const(x.on, node), self._cast_const(x.off, node), x.ndim)
        if isinstance(x, Data):
            src = fake(node.args[0]) if node.args and isinstance(node.args[0], torch.fx.Node) else None
            if isinstance(src, torch.Tensor) and src.dtype == v.dtype:
                return x  # .to(device) / .contiguous(): same values
            return self._data_op(x, ("cast", v.dtype), node)
        if isinstance(x, Lin) and v.dtype in (torch.bool,):
            raise Unliftable("position cast to bool")
        return x

    # -- shape

    def _dim_map(self, node: torch.fx.Node, in_nd: int, mapping: list[Optional[int]]) -> dict[int, int]:
        """mapping[k] = output position of input dim k (forward index): trailing dims map."""
        out_nd = self._ndim(node)
        return {k - in_nd: m - out_nd for k, m in enumerate(mapping) if m is not None}

    def _apply_map(self, x: Any, dmap: dict[int, int], node: torch.fx.Node) -> Any:
        nd = self._ndim(node)
        if isinstance(x, Lin):
            if set(d for d, _ in x.coefs) - set(dmap):
                raise Unliftable("a view drops a position dim")
            return x.shift(dmap, nd)
        if isinstance(x, Ind):
            return Ind(self._map_pred(x.pred, dmap, nd), x.on, x.off, nd)
        if isinstance(x, Data):
            if set(x.dims) - set(dmap):
                raise Unliftable("a view drops a dim of a [b, n] mask")
            return Data(x.node, (dmap[x.dims[0]], dmap[x.dims[1]]), x.ops)
        if isinstance(x, (int, float, bool)):
            return x
        raise Unliftable("reshape of an unknown value")

    def _map_pred(self, p, dmap, nd):
        if isinstance(p, (And, Or)):
            return type(p)(tuple(self._map_pred(x, dmap, nd) for x in p.parts))
        if isinstance(p, Not):
            return Not(self._map_pred(p.x, dmap, nd))
        if isinstance(p, Rel):
            if set(d for d, _ in p.lin.coefs) - set(dmap):
                raise Unliftable("a view drops a position dim")
            return Rel(p.lin.shift(dmap, nd))
        if isinstance(p, Key):
            if set(p.dims) - set(dmap):
                raise Unliftable("a view drops a dim of a [b, n] mask")
            return Key(p.node, p.truth, (dmap[p.dims[0]], dmap[p.dims[1]]), p.ops)
        return p

    def _broadcast(self, x: Any, node: torch.fx.Node) -> Any:
        # expand only prepends dims or widens size-1 dims: trailing positions are kept
        if isinstance(x, Lin):
            return Lin(x.coefs, x.const, self._ndim(node), x.lengths)
        if isinstance(x, Ind):
            return Ind(x.pred, x.on, x.off, self._ndim(node))
        return x

    def _getitem(self, node: torch.fx.Node) -> Any:
        base, idx = node.args
        x = self.eval(base)
        idx = idx if isinstance(idx, tuple) else (idx,)
        if any(isinstance(i, torch.fx.Node) for i in idx):
            return self._advanced_index(x, base, idx, node)
        in_nd = self._ndim(base)
        n_real = sum(1 for i in idx if i is not None and i is not Ellipsis)
        mapping: list[Optional[int]] = []
        out_pos = 0
        for i in idx:
            if i is Ellipsis:
                for _ in range(in_nd - n_real):
                    mapping.append(out_pos)
                    out_pos += 1
            elif i is None:
                out_pos += 1
            elif isinstance(i, slice):
                if i.step not in (None, 1):
                    raise Unliftable("a slice that strides positions")
                if i.start not in (None, 0):
                    x = self._shift(x, len(mapping) - in_nd, i.start)
                mapping.append(out_pos)
                out_pos += 1
            else:
                raise Unliftable("integer indexing of a mask")
        while len(mapping) < in_nd:
            mapping.append(out_pos)
            out_pos += 1
        return self._apply_map(x, self._dim_map(node, in_nd, mapping), node)

    def _shift(self, x: Any, dim: int, start: Any) -> Lin:
        """x[..., start:] along trailing dim `dim`: element k is x's element start + k, which
        only positions can say (c + a * k becomes c + a * start + a * k); the memo's _fit reads
        the new length off the result."""
        start = static_int(start)
        if not isinstance(x, Lin) or start is None or start < 0:
            raise Unliftable("a slice that drops or shifts mask positions")
        return Lin(x.coefs, x.const + dict(x.coefs).get(dim, 0) * start, x.ndim, x.lengths)

    def _slice(self, node: torch.fx.Node) -> Any:
        """aten.slice(x, dim, start, end, step): one that keeps every element (export's
        x[:, :n]) is x; of positions, x[..., start:end] is x shifted (_shift). Any other slice
        of a mask is unliftable."""
        args = list(node.args) + [0, 0, None, None, 1][len(node.args):]
        x, dim, start, end, step = args[:5]
        size = fake(x).shape[dim]
        if start in (None, 0) and step == 1 and (end is None or same_size(fake(node).shape[dim], size)):
            return self.eval(x)
        if step != 1:
            raise Unliftable("a slice that strides positions")
        return self._shift(self.eval(x), dim - fake(x).dim() if dim >= 0 else dim, start or 0)

    def _advanced_index(self, x: Any, base: torch.fx.Node, idx: tuple, node: torch.fx.Node) -> Any:
        """HF: t2d[batch_arange[:, None, None, None], kv_arange[None, None, None, :]] for a
        [b, n] padding mask, a position table or a constant."""
        if len(idx) != 2 or fake(base).dim() != 2:
            raise Unliftable("advanced indexing that is not a [b, n] lookup")
        bi, ki = self.eval(idx[0]), self.eval(idx[1])
        if not (isinstance(bi, Lin) and isinstance(ki, Lin)):
            raise Unliftable("lookup with non-arange indices")
        nd = self._ndim(node)
        if isinstance(x, Ind) and x.on == x.off:
            return Ind(TRUE, x.on, x.off, nd)
        if isinstance(x, Lin):  # positions that depend on the column only: pos[b, k] = c + a * k
            coefs = dict(x.coefs)
            if set(coefs) - {-1}:
                raise Unliftable("position table that varies along the batch")
            return _lin_add(_const_lin(x.const), _lin_scale(ki, coefs.get(-1, 0)))
        if not isinstance(x, Data):
            raise Unliftable("advanced indexing that is not a [b, n] padding lookup")
        bsz, n = fake(base).shape
        if bi.coefs != ((-4, 1),) or bi.const != 0 or ki.coefs != ((-1, 1),) or ki.const != 0:
            raise Unliftable("padding lookup that is not mask[b, j]")
        if not (same_size(dict(bi.lengths)[-4], bsz) and same_size(dict(ki.lengths)[-1], n)):
            raise Unliftable("padding lookup over part of the mask")
        if fake(node).dim() != 4 or x.dims != (-2, -1):
            raise Unliftable("padding lookup that is not 4-D")
        return Data(x.node, (-4, -1), x.ops)

    def _reshape(self, node: torch.fx.Node) -> Any:
        base = node.args[0]
        x = self.eval(base)
        src, out = fake(base), fake(node)
        s_in, s_out = list(src.shape), list(out.shape)
        # only inserting / removing size-1 dims: match the other dims in order
        mapping: list[Optional[int]] = []
        j = 0
        for k, size in enumerate(s_in):
            while j < len(s_out) and is_one(s_out[j]) and not is_one(size):
                j += 1
            if is_one(size) and (j >= len(s_out) or not is_one(s_out[j])):
                mapping.append(None)
                continue
            if j >= len(s_out) or not same_size(s_out[j], size):
                raise Unliftable("a reshape that merges or splits mask dims")
            mapping.append(j)
            j += 1
        return self._apply_map(x, self._dim_map(node, len(s_in), mapping), node)

    # -- values

    def _compare(self, op: str, a: Any, b: Any, node: torch.fx.Node) -> Any:
        nd = self._ndim(node)
        if isinstance(a, Data) or isinstance(b, Data):
            data, other = (a, b) if isinstance(a, Data) else (b, a)
            c = static_float(other)
            if c is None or isinstance(a, Data) and isinstance(b, Data):
                raise Unliftable("comparison of data with a non-constant")
            if data is b:
                op = {"lt": "gt", "le": "ge", "gt": "lt", "ge": "le"}.get(op, op)
            return self._data_op(data, ("cmp", op, other), node)
        if isinstance(a, tuple) or isinstance(b, tuple):  # abs(lin) < c
            (tag_, lin), c, flip = (a, b, False) if isinstance(a, tuple) else (b, a, True)
            c = static_int(c)
            if c is None:
                raise Unliftable("abs compared with a non-constant")
            if flip:
                op = {"lt": "gt", "le": "ge", "gt": "lt", "ge": "le"}.get(op, op)
            if op in ("lt", "le"):
                bound = c - 1 if op == "lt" else c  # |x| <= bound
                return Ind(And((Rel(_lin_add(lin, _const_lin(bound), -1)), Rel(_lin_scale(lin, -1, -bound)))), True, False, nd)
            if op in ("gt", "ge"):
                bound = c if op == "gt" else c - 1  # |x| > bound
                return Ind(Or((Rel(_lin_scale(lin, -1, bound + 1)), Rel(_lin_add(lin, _const_lin(-bound - 1), -1)))), True, False, nd)
            raise Unliftable("abs with == / !=")
        if isinstance(a, Ind) and isinstance(b, Ind) and a.on == a.off and b.on == b.off:
            ops = {"eq": operator.eq, "ne": operator.ne, "le": operator.le, "lt": operator.lt,
                   "ge": operator.ge, "gt": operator.gt}
            r = bool(ops[op](a.on, b.on))
            return Ind(TRUE, r, r, nd)
        la, lb = _as_lin(a), _as_lin(b)
        if la is None or lb is None:
            if isinstance(a, Ind) and isinstance(b, (int, float, bool)) and op in ("eq", "ne"):
                on, off = (a.on == b), (a.off == b)
                if op == "ne":
                    on, off = not on, not off
                return Ind(a.pred, bool(on), bool(off), nd)
            raise Unliftable(f"comparison {op} of non-position values")
        diff = _lin_add(la, lb, -1)  # a - b
        if op == "le":
            return Ind(Rel(diff), True, False, nd)
        if op == "lt":
            return Ind(Rel(_lin_scale(diff, 1, 1)), True, False, nd)
        if op == "ge":
            return Ind(Rel(_lin_scale(diff, -1)), True, False, nd)
        if op == "gt":
            return Ind(Rel(_lin_scale(diff, -1, 1)), True, False, nd)
        raise Unliftable("== / != between positions (a diagonal or document mask)")

    def _logic(self, kind, args, node: torch.fx.Node) -> Any:
        vals = [self._as_pred(self.eval(a)) for a in args[:2]]
        return Ind(kind(tuple(vals)), True, False, self._ndim(node))

    def _as_pred(self, x: Any):
        if isinstance(x, Ind):
            if x.on is True and x.off is False:
                return x.pred
            if x.on is False and x.off is True:
                return Not(x.pred)
            if x.on == x.off:
                return TRUE if bool(x.on) else Not(TRUE)
        if isinstance(x, Data):
            return Key(x.node, True, x.dims, x.ops)
        if isinstance(x, bool):
            return TRUE if x else Not(TRUE)
        raise Unliftable("logic on a non-bool mask")

    def _add(self, a: Any, b: Any, sign: int, node: torch.fx.Node) -> Any:
        la, lb = _as_lin(a), _as_lin(b)
        if la is not None and lb is not None:
            return _lin_add(la, lb, sign)
        if isinstance(a, Ind) and isinstance(b, Ind) and sign == 1:
            for x, y in ((a, b), (b, a)):
                if x.on == 0 and _neg(x.off) and y.on == 0 and _neg(y.off):
                    return Ind(And((x.pred, y.pred)), 0.0, min(x.off, y.off), self._ndim(node))
        if isinstance(a, Ind) and static_float(b) is not None:
            c = sign * static_float(b)
            return Ind(a.pred, a.on + c, a.off + c, a.ndim)
        if isinstance(b, Ind) and static_float(a) is not None:
            c = static_float(a)
            return Ind(b.pred, c + sign * b.on, c + sign * b.off, b.ndim)
        raise Unliftable("sum of masks that are not additive 0 / -inf masks")

    def _mul(self, a: Any, b: Any, node: torch.fx.Node) -> Any:
        for x, y in ((a, b), (b, a)):
            c = static_float(y)
            if c is None:
                continue
            if isinstance(x, Lin) and float(c).is_integer():
                return _lin_scale(x, int(c))
            if isinstance(x, Ind) and not isinstance(x.on, bool):
                return Ind(x.pred, x.on * c, x.off * c, x.ndim)
        if isinstance(a, Ind) and isinstance(b, Ind) and isinstance(a.on, bool) and isinstance(b.on, bool):
            return Ind(And((self._as_pred(a), self._as_pred(b))), True, False, self._ndim(node))
        raise Unliftable("product of mask values that is not a scale or an and")

    def _band(self, node: torch.fx.Node, upper: bool) -> Any:
        x = self.eval(node.args[0])
        k = node.kwargs.get("diagonal", node.args[1] if len(node.args) > 1 else 0)
        if not isinstance(x, Ind) or not isinstance(k, int):
            raise Unliftable("tril / triu of a non-constant tensor")
        d = Lin(((-2, -1), (-1, 1)), 0, 2, ())  # j - i
        keep = Rel(_lin_add(d, _const_lin(k), -1)) if not upper else Rel(_lin_scale(_lin_add(d, _const_lin(k), -1), -1))
        zero = False if isinstance(x.on, bool) else 0.0
        if x.on == x.off:
            return Ind(keep, x.on, zero, x.ndim)
        if x.off != zero:
            raise Unliftable("tril / triu of a mask that is not zero outside its condition")
        return Ind(And((x.pred, keep)), x.on, zero, x.ndim)

    def _diff(self, node: torch.fx.Node) -> Any:
        """diff(pos, dim=-1, prepend=pos[..., :1] - a) of positions c + a * k: a everywhere
        (HF's packed-sequence detection on position ids that are a plain arange). The first
        element is pos[0] - (pos[0] - a) only when the prepend is that very value: a constant
        along every dim (no batch term) equal to the first position minus the step."""
        x = self.eval(node.args[0])
        bound = dict(zip(("n", "dim", "prepend", "append"), node.args[1:]), **node.kwargs)
        dim, prepend = bound.get("dim", -1), bound.get("prepend")
        if bound.get("n", 1) != 1 or bound.get("append") is not None:
            raise Unliftable("diff with n / append")
        if not isinstance(x, Lin) or dim % self._ndim(node) != self._ndim(node) - 1 or prepend is None:
            raise Unliftable("diff of something other than positions")
        coefs = dict(x.coefs)
        if set(coefs) - {-1}:
            raise Unliftable("diff of positions that vary along the batch")
        a = coefs.get(-1, 0)
        p = self.eval(prepend)
        pv = fake(prepend)
        if not isinstance(p, Lin) or p.coefs or not is_one(pv.shape[-1]) or p.const != x.const - a:
            raise Unliftable("diff with a prepend that is not the first position minus the step")
        return Ind(TRUE, float(a), float(a), self._ndim(node))

    def _masked_fill(self, node: torch.fx.Node) -> Any:
        x, m, value = node.args[0], node.args[1], node.args[2]
        xv, mv = self.eval(x), self._as_pred(self.eval(m))
        c = static_float(value)
        if c is None:
            raise Unliftable("masked_fill with a non-constant value")
        if not isinstance(xv, Ind):
            raise Unliftable("masked_fill of a data tensor")
        c = self._cast_const(c, node)
        if xv.on == xv.off:
            return Ind(Not(mv), xv.on, c, self._ndim(node))
        if xv.off == c:
            return Ind(And((xv.pred, Not(mv))), xv.on, c, self._ndim(node))
        raise Unliftable("masked_fill with a value the mask does not already use")

    def _where(self, node: torch.fx.Node) -> Any:
        cond, a, b = node.args[:3]
        p = self._as_pred(self.eval(cond))
        av, bv = self.eval(a), self.eval(b)
        ca = av.on if isinstance(av, Ind) and av.on == av.off else static_float(av) if not isinstance(av, Ind) else None
        cb = bv.on if isinstance(bv, Ind) and bv.on == bv.off else static_float(bv) if not isinstance(bv, Ind) else None
        if ca is not None and cb is not None:
            return Ind(p, self._cast_const(ca, node), self._cast_const(cb, node), self._ndim(node))
        if isinstance(av, Ind) and cb is not None and av.off == cb:
            return Ind(And((p, av.pred)), av.on, av.off, self._ndim(node))
        raise Unliftable("where() with non-constant branches")


def _const_lin(c: int) -> Lin:
    return Lin((), int(c), 0, ())


def _as_lin(x: Any) -> Optional[Lin]:
    if isinstance(x, Lin):
        return x
    if isinstance(x, int) and not isinstance(x, bool):
        return _const_lin(x)
    if isinstance(x, float) and x.is_integer():
        return _const_lin(int(x))
    return None
