"""Canonicalise every attention form into one SDPA call (the form in attention_form.py).

Forms, each recorded as a report.Site (its `form`) on the canonical node:
- "sdpa": F.scaled_dot_product_attention (dynamo's torch-level call) or the aten op
  (export graphs); its arguments are spelled out.
- "manual": softmax(scale * q @ k^T [+ mask]) [dropout] @ v, anchored at the softmax (see
  Note [Manual attention match]).
- "mha": F.multi_head_attention_forward (nn.MultiheadAttention), decomposed into the
  in-projection, head split, SDPA and out-projection when its weights output is unused.
- "encoder": torch._transformer_encoder_layer_fwd (nn.TransformerEncoderLayer's fused
  inference path), decomposed into the layer's math around an SDPA.
- "flex": a flex_attention call, recorded as a skipped site (kept as written).
A candidate that cannot be canonicalised is recorded here as skipped, with its reason.

Note [Manual attention match]
Start at a softmax over the last dim. Forward, its result (through casts and an eval /
p = 0 dropout) must feed exactly one matmul as the left operand: P @ v. Backward from the
softmax input, through casts, positive constant scales and at most one mask (add of a float
mask, masked_fill / where with -inf or a very negative value), we must reach a matmul
A @ B with A = q (optionally scaled) and B = k^T (optionally scaled). k is B's transpose
source when B transposes the last two dims, else a new transpose of B. Every intermediate
must have no other user: a probability or score tensor used elsewhere is not replaced
(WEIGHTS_USED). Training dropout is left as the user wrote it (reason DROPOUT) so that the
random stream does not change. 3-D (bmm) attention gets a leading batch dim of 1, unless the
scores are viewed as [b, h, n, n] around the softmax and the probabilities back as [b * h, n, n]
(Bloom): then q / k / v are viewed as [b, h, n, d] the same way.
What the scores go through between q.k and the mask that is not a constant scale or a cast is
read as the site's score function (Note [Score extraction] in extract_mask.py: soft-caps, ALiBi,
any elementwise program of the score, positions and per-head or per-token tensors) and kept in
the site's ScoreMods (attention_form); so are attention sinks (Note [Sink column]). An add whose
other operand is read as a bias rather than a mask (`_score_bias`) is part of the function. Such
a site's canonical node is a shadow of the user's nodes (attention_form.REPLACES_META).
A softmax that weights values with q.k scores in a form not read here is still recorded, as a
skipped site with where the scores came from (`_scores_of_q_k`): no attention goes unreported.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import torch
import torch.fx
import torch.nn.attention.flex_attention
import torch.nn.functional as F

from ringcc import _compat
from ringcc.report import Decision, Site, SkipReason
from ringcc.runtime.ops import MASK_TENSORS

from .attention_form import (FORM_META, MODS_META, REPLACES_META, SITE_META, Builder, ScoreMods,
                             SdpaCall, drop_unread, erase_dead, fake, is_aten_graph, is_one, is_sdpa, real_users,
                             same_shape, same_size, static_float, static_int)
from . import extract_mask
from .base import PassContext, PassResult, location

PASS = "canonicalize_attention"
aten = torch.ops.aten

# A masked_fill / where value at or below this acts as -inf: exp(-1e4 + max score) is 0 in
# every float dtype, so the softmax is the same (rows with no visible key aside).
VERY_NEGATIVE = -1e4


def canonicalize_attention(gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
    modified = False
    aten_graph = is_aten_graph(gm)
    for node in list(gm.graph.nodes):
        if node.graph is not gm.graph or node.op not in ("call_function", "call_method"):
            continue
        if is_sdpa(node):
            modified |= _normalise_sdpa(node, aten_graph)
        elif _is_softmax(node):
            modified |= _canonicalise_manual(gm, node, ctx)
        elif node.op == "call_function" and node.target is F.multi_head_attention_forward:
            modified |= _canonicalise_mha(gm, node, ctx)
        elif node.op == "call_function" and node.target in ENCODER_TARGETS:
            modified |= _canonicalise_encoder(gm, node, ctx)
        elif node.op == "call_function" and node.target in FLEX_TARGETS:
            _skip_site(ctx, node, "flex", SkipReason.OTHER,
                       "a flex_attention call; ringcc does not rewrite flex_attention sites: kept as dense attention")
    for node in gm.graph.nodes:
        if is_sdpa(node):
            _record_site(ctx, node, node.meta.setdefault(FORM_META, "sdpa"))
    return PassResult(modified)


def _normalise_sdpa(node: torch.fx.Node, aten_graph: bool) -> bool:
    """Spell out every argument so that later passes read one shape of call."""
    args, kwargs = SdpaCall.of(node).args_kwargs(aten_graph)
    if node.args == args and dict(node.kwargs) == kwargs:
        return False
    node.args, node.kwargs = args, kwargs
    return True


def _record_site(ctx: PassContext, node: torch.fx.Node, form: str) -> Site:
    site = Site(node=node.name, location=location(node), form=form)
    ctx.report.sites.append(site)
    node.meta[SITE_META] = site
    return site


def _skip_site(ctx: PassContext, node: torch.fx.Node, form: str, reason: SkipReason, detail: str) -> None:
    ctx.report.sites.append(Site(node=node.name, location=location(node), form=form,
                                 decision=Decision.SKIPPED, reason=reason, detail=detail))


# ---------------------------------------------------------------------------------------
# op vocabulary (torch-level calls and methods of dynamo graphs, aten ops of export graphs)

SOFTMAX_FUNCS = (F.softmax, torch.softmax, torch.Tensor.softmax, aten.softmax.int, aten._softmax.default)
MATMUL_FUNCS = (operator.matmul, torch.matmul, torch.bmm, aten.matmul.default, aten.bmm.default)
MATMUL_METHODS = ("matmul", "bmm", "__matmul__")
MUL_FUNCS = (operator.mul, torch.mul, aten.mul.Tensor, aten.mul.Scalar)
DIV_FUNCS = (operator.truediv, torch.div, torch.true_divide, aten.div.Tensor, aten.div.Scalar)
ADD_FUNCS = (operator.add, torch.add, aten.add.Tensor)
SUB_FUNCS = (operator.sub, torch.sub, aten.sub.Tensor)
MASKED_FILL_FUNCS = (torch.masked_fill, aten.masked_fill.Scalar, aten.masked_fill.Tensor)
WHERE_FUNCS = (torch.where, aten.where.self, aten.where.ScalarOther, aten.where.ScalarSelf)
DROPOUT_FUNCS = (F.dropout, torch.dropout, aten.dropout.default)
EINSUM_FUNCS = (torch.einsum, aten.einsum.default)
LINEAR_FUNCS = (F.linear, aten.linear.default, aten.addmm.default, aten.mm.default)  # contract the last dim
CAST_METHODS = ("to", "float", "type_as", "type", "half", "bfloat16", "double", "contiguous")
CAST_FUNCS = (aten._to_copy.default, aten.to.dtype, aten.clone.default, aten.contiguous.default)
BADDBMM_FUNCS = (torch.baddbmm, aten.baddbmm.default)
# flex_attention calls left as the Python function (dynamo's higher-order op is a site of
# lift_masks, which reads its mask_mod as the site's mask function)
FLEX_TARGETS = (torch.nn.attention.flex_attention.flex_attention,)
ENCODER_TARGETS = tuple(t for t in (_compat.transformer_encoder_layer_fwd(),
                                    aten._transformer_encoder_layer_fwd.default) if t is not None)


def _is(node: Any, funcs=(), methods=()) -> bool:
    if not isinstance(node, torch.fx.Node):
        return False
    if node.op == "call_function":
        return node.target in funcs
    return node.op == "call_method" and node.target in methods


def _is_softmax(node: torch.fx.Node) -> bool:
    return _is(node, SOFTMAX_FUNCS, ("softmax",))


def _softmax_parts(node: torch.fx.Node) -> tuple[torch.fx.Node, Any, Any]:
    """(input, dim, dtype) of a softmax node."""
    args = list(node.args)
    if node.target is aten._softmax.default:
        return args[0], args[1], None
    x = args[0]
    dim = node.kwargs.get("dim", args[1] if len(args) > 1 else None)
    dtype = node.kwargs.get("dtype", args[2] if len(args) > 2 and not isinstance(args[2], int) else None)
    return x, dim, dtype


def _is_cast(node: Any) -> bool:
    """A dtype / device / layout change. Scores upcast for the softmax and probabilities cast
    back (HF's eager attention) are what SDPA does inside, in the model's dtype."""
    return _is(node, CAST_FUNCS, CAST_METHODS)


def _const(x: Any) -> Optional[float]:
    """A Python number, or the value of a 0-d tensor node built from a number."""
    v = static_float(x)
    if v is not None:
        return v
    if isinstance(x, torch.fx.Node) and x.op == "call_function":
        if x.target in (torch.full, aten.full.default) and len(x.args) >= 2 and not fake(x).shape:
            return static_float(x.args[1])
        if x.target in (torch.tensor, torch.scalar_tensor, torch.as_tensor) and x.args:
            return static_float(x.args[0])
    return None


def _single_user(node: torch.fx.Node) -> bool:
    return len(real_users(node)) == 1


def _transposed_last_two(node: Any) -> Optional[torch.fx.Node]:
    """x when node is x with its last two dims swapped (transpose / permute / mT), else None."""
    if not isinstance(node, torch.fx.Node) or node.op not in ("call_method", "call_function"):
        return None
    x = node.args[0] if node.args else None
    val = fake(x)
    if not isinstance(val, torch.Tensor):
        return None
    nd = val.dim()
    if _is(node, (torch.transpose, aten.transpose.int), ("transpose",)) and len(node.args) == 3:
        dims = sorted(d % nd for d in node.args[1:3])
        return x if dims == [nd - 2, nd - 1] else None
    if _is(node, (torch.permute, aten.permute.default), ("permute",)):
        perm = node.args[1] if len(node.args) == 2 and isinstance(node.args[1], (list, tuple)) else node.args[1:]
        want = list(range(nd - 2)) + [nd - 1, nd - 2]
        return x if [p % nd for p in perm] == want else None
    if node.op == "call_function" and node.target is getattr and node.args[1:] == ("mT",):
        return x
    return None


@dataclass(frozen=True)
class _Scale:
    """const * prod(symbolic factors): a module float such as HF's `self.scaling` is a
    symbolic Python float under dynamic=True, a graph value rather than a number."""

    const: float = 1.0
    syms: tuple = ()  # ((node, inverse), ...)

    def __mul__(self, other: "_Scale") -> "_Scale":
        return _Scale(self.const * other.const, self.syms + other.syms)

    @property
    def is_one(self) -> bool:
        return self.const == 1.0 and not self.syms

    def build(self, b: Builder):
        """The scale as SDPA's argument: a float, or a node computing the symbolic float."""
        value: Any = self.const
        for node, inverse in self.syms:
            value = b.call(operator.truediv if inverse else operator.mul, value, node)
        return value


ONE = _Scale()


def _symbolic_scalar(x: Any) -> bool:
    return isinstance(x, torch.fx.Node) and isinstance(fake(x), (torch.SymFloat, torch.SymInt))


def _scaled(node: Any) -> tuple[Any, _Scale]:
    """(x, c) when node = x * c or x / c with a positive constant (or a symbolic scalar) c;
    else (node, 1)."""
    if not isinstance(node, torch.fx.Node) or not _single_user(node):
        return node, ONE
    if _is(node, MUL_FUNCS, ("mul", "__mul__")) and len(node.args) == 2:
        a, b = node.args
        for x, c in ((a, b), (b, a)):
            cv = static_float(c)
            if cv is not None and cv > 0 and isinstance(x, torch.fx.Node):
                return x, _Scale(cv)
            if _symbolic_scalar(c) and isinstance(x, torch.fx.Node) and isinstance(fake(x), torch.Tensor):
                return x, _Scale(1.0, ((c, False),))
    if _is(node, DIV_FUNCS, ("div", "__truediv__")) and len(node.args) == 2 and not node.kwargs:
        x, c = node.args
        cv = static_float(c)
        if cv is not None and cv > 0 and isinstance(x, torch.fx.Node):
            return x, _Scale(1.0 / cv)
        if _symbolic_scalar(c) and isinstance(x, torch.fx.Node):
            return x, _Scale(1.0, ((c, True),))
    return node, ONE


@dataclass
class _Manual:
    """A matched manual attention site."""

    out: torch.fx.Node  # the P @ v matmul, replaced by the canonical call
    q: torch.fx.Node
    k: Optional[torch.fx.Node]  # None: make k = transpose(kt)
    kt: torch.fx.Node
    v: torch.fx.Node
    scale: _Scale
    mask: Any = None  # node, or ("not", node) for masks that mark excluded positions
    mask_scale: _Scale = ONE  # scales applied after an additive mask (they scale it too)
    dropout: Optional[tuple[float, bool]] = None
    reused: list[str] = field(default_factory=list)
    dead: list[torch.fx.Node] = field(default_factory=list)
    mods: ScoreMods = field(default_factory=ScoreMods)
    # (b, h) when q / k / v / P @ v are [b * h, n, d] and the scores are viewed as [b, h, n, n]
    # around the softmax (Bloom): the site is canonicalised in 4-D
    split: Optional[tuple[int, int]] = None


def _canonicalise_manual(gm: torch.fx.GraphModule, softmax: torch.fx.Node, ctx: PassContext) -> bool:
    m = _match_manual(softmax)
    if m is None:
        why = _scores_of_q_k(softmax)
        if why:  # attention in a form the matcher does not read: found, and kept as written
            _skip_site(ctx, softmax, "manual", SkipReason.OTHER, why)
        return False
    if isinstance(m, str):
        _skip_site(ctx, softmax, "manual", SkipReason.OTHER, m)
        return False
    if m.reused:
        _skip_site(ctx, m.out, "manual", SkipReason.WEIGHTS_USED,
                   "attention " + " and ".join(m.reused) + " used elsewhere; the site is kept")
        return False
    if m.dropout is not None and m.dropout[1] and m.dropout[0] > 0:
        _skip_site(ctx, m.out, "manual", SkipReason.DROPOUT,
                   f"attention dropout p={m.dropout[0]} in training; kept as written so the random stream is the user's")
        return False
    b = Builder(gm, m.out, PASS)
    try:
        q, k, v, mask = m.q, m.k, m.v, m.mask
        if k is None:
            k = b.call(torch.transpose, m.kt, -2, -1) if not is_aten_graph(gm) else b.call(aten.transpose.int, m.kt, -2, -1)
        if isinstance(mask, tuple):
            mask = b.call(torch.logical_not if not is_aten_graph(gm) else aten.logical_not.default, mask[1])
        elif mask is not None and fake(mask).dtype != torch.bool and not m.mask_scale.is_one:
            if m.mask_scale.syms:
                raise ValueError("an additive mask under a symbolic scale")
            mask = b.call(operator.mul if not is_aten_graph(gm) else aten.mul.Tensor, mask, m.mask_scale.const)
        if m.split is not None:  # [b * h, n, d] -> [b, h, n, d], as the scores' view splits them
            bsz, heads = m.split
            four = (lambda x: b.call(torch.reshape, x, tuple(_sizes([bsz, heads] + list(fake(x).shape[1:]))))) \
                if not is_aten_graph(gm) else (lambda x: b.call(aten.reshape.default, x, _sizes([bsz, heads] + list(fake(x).shape[1:]))))
            q, k, v = four(q), four(k), four(v)
        three_d = fake(q).dim() == 3
        if three_d:
            unsq = (lambda x: b.call(torch.unsqueeze, x, 0)) if not is_aten_graph(gm) else (lambda x: b.call(aten.unsqueeze.default, x, 0))
            q, k, v = unsq(q), unsq(k), unsq(v)
            if mask is not None:
                mask = unsq(mask)
        call = SdpaCall(q, k, v, attn_mask=mask, dropout_p=0.0, is_causal=False, scale=m.scale.build(b),
                        enable_gqa=False)
        out = b.sdpa(call, "manual")
        if three_d:
            out = b.call(torch.squeeze if not is_aten_graph(gm) else aten.squeeze.dim, out, 0)
        if m.split is not None:  # back to the user's [b * h, n, d]
            out = b.call(torch.reshape if not is_aten_graph(gm) else aten.reshape.default, out,
                         tuple(_sizes(fake(m.out).shape)) if not is_aten_graph(gm) else _sizes(fake(m.out).shape))
        if not same_shape(fake(out).shape, fake(m.out).shape) or fake(out).dtype != fake(m.out).dtype:
            raise ValueError("canonical attention does not reproduce the site's output")
    except Exception as e:  # noqa: BLE001 - what SDPA does not take stays the user's code, recorded
        _erase_new(gm, PASS, m.out)
        _skip_site(ctx, m.out, "manual", SkipReason.SHAPE, f"not expressible as one SDPA call: {e}"[:300])
        return False
    sdpa = out if not (three_d or m.split) else out.args[0]
    if isinstance(m.mods.sinks, _SinksPlan):
        bb = Builder(gm, sdpa, PASS)
        m.mods.sinks = bb.call(torch.reshape if not is_aten_graph(gm) else aten.reshape.default, m.mods.sinks.node, [-1])
    if m.mods.any():
        # the shadow of the user's nodes (attention_form.REPLACES_META): they stay for now
        sdpa.meta[MODS_META] = m.mods
        sdpa.meta[REPLACES_META] = (m.out, out)
        return True
    m.out.replace_all_uses_with(out)
    erase_dead(gm, [m.out])
    return True


def _sizes(shape) -> list[int]:
    """A view's size list for `shape`: -1 for its one symbolic size (the sequence length under a
    symbolic trace), so that no SymInt of the trace is baked into the graph."""
    sizes = [static_int(x) for x in shape]
    if sizes.count(None) > 1:
        raise ValueError(f"more than one symbolic size in {tuple(shape)}")
    return [-1 if x is None else x for x in sizes]


def _erase_new(gm: torch.fx.GraphModule, pass_name: str, anchor: torch.fx.Node) -> None:
    for node in reversed(list(gm.graph.nodes)):
        if node.meta.get("ringcc_pass") == pass_name and node.meta.get("ringcc_from") == anchor.name and not node.users:
            gm.graph.erase_node(node)


def _upstream_matmul(node: torch.fx.Node, depth: int = 4) -> bool:
    frontier = [node]
    for _ in range(depth):
        frontier = [i for n in frontier for i in n.all_input_nodes]
        if any(_is(n, MATMUL_FUNCS + BADDBMM_FUNCS, MATMUL_METHODS) for n in frontier):
            return True
    return False


def _match_manual(softmax: torch.fx.Node) -> Union[_Manual, str, None]:
    x, dim, _ = _softmax_parts(softmax)
    xv = fake(x)
    if not isinstance(xv, torch.Tensor) or xv.dim() not in (3, 4) or not isinstance(dim, int) or dim % xv.dim() != xv.dim() - 1:
        return None
    reused: list[str] = []
    sink = _sink_of(x)  # Note [Sink column]
    # forward: softmax -> casts / dropout (/ a view merging batch and heads) (/ the sink column's
    # slice) -> P @ v
    p, dropout, merged, split, sliced = softmax, None, False, None, sink is None
    while True:
        users = real_users(p)
        nxt = [u for u in users if _is_cast(u) or _is(u, DROPOUT_FUNCS, ("dropout",))
               or (sliced and _is(u, MATMUL_FUNCS, MATMUL_METHODS) and u.args[0] is p)
               or (not merged and _merges_heads(p, u)) or (not sliced and _drops_last_column(p, u))]
        if len(nxt) != 1:
            return None
        if len(users) > 1:
            reused.append("probabilities")
        u = nxt[0]
        if _is(u, DROPOUT_FUNCS, ("dropout",)):
            prob, train = _dropout_args(u)
            if prob is None:
                return None
            dropout = (prob, train)
        elif _is(u, MATMUL_FUNCS, MATMUL_METHODS):
            out, v = u, u.args[1]
            break
        elif _merges_heads(p, u):
            merged = True
        elif _drops_last_column(p, u):
            sliced = True
        p = u
    # backward: scores -> casts / scales / one mask -> A @ B, or a score function of A @ B
    s, scale, mask, mask_scale = x, ONE, None, ONE
    mods, region, shift_of = ScoreMods(), None, None
    if sink is not None:
        s, mods.sinks = sink
        x = s
    while True:
        if not isinstance(s, torch.fx.Node):
            return None
        if s is not x and s is not shift_of and not _single_user(s):
            reused.append("scores")
        if _is_cast(s):
            s = s.args[0]
            continue
        inner, c = _scaled(s)
        if inner is not s:
            s, scale = inner, scale * c
            continue
        shifted = _row_shifted(s)
        if shifted is not None:  # s - max(s) per row: a shift the softmax ignores
            s = shift_of = shifted
            continue
        if mask is None:
            found = _mask_of(s)
            if found is not None and not _score_bias(found[1], found[0]):
                (s, mask), mask_scale = found, scale  # scales seen so far apply to the mask too
                continue
        if _is(s, MATMUL_FUNCS, MATMUL_METHODS) and len(s.args) == 2:
            a, bt = s.args
            break
        if split is None and merged and _merges_heads(s, None) and _plain_product(s.args[0], mask):
            split = tuple(fake(s).shape[:2])
            s = s.args[0]
            continue
        if _is(s, BADDBMM_FUNCS, ("baddbmm",)):
            found = _baddbmm(s, mask)
            if found is not None:
                if found[3] is not mask:
                    mask_scale = scale
                a, bt, alpha, mask = found
                scale = scale * _Scale(alpha)
                break
        # a score function of the q.k product (Note [Score extraction] in extract_mask.py)
        anchor = _score_anchor(s)
        op = s.args[0] if merged and _merges_heads(s, None) and isinstance(s.args[0], torch.fx.Node) else s
        what = op.target if isinstance(op.target, str) else getattr(op.target, "__name__", str(op.target))
        if anchor is None:
            if _upstream_matmul(s):  # softmax(f(q @ k^T)) @ v with an f we do not read: a candidate
                return f"attention scores go through {what}, which is not a constant scale, a mask or a cast"
            return None
        if split is None and merged and _merges_heads(s, None):  # heads merged into the batch (Bloom)
            split = tuple(fake(s).shape[:2])
        if scale.syms:
            return f"attention scores go through {what} under a symbolic scale; kept as written"
        region = (s, anchor, scale.const, what)
        if _is(anchor, BADDBMM_FUNCS, ("baddbmm",)):
            args = list(anchor.args) + [None] * 3
            a, bt = anchor.kwargs.get("batch1", args[1]), anchor.kwargs.get("batch2", args[2])
        else:
            a, bt = anchor.args
        break
    q, cq = _scaled(a)
    kt, ck = _scaled(bt)
    k = _transposed_last_two(kt)
    if k is not None:
        k_inner, ck2 = _scaled(k)
        k, ck = k_inner, ck * ck2
    if region is not None:
        top, anchor, outer, what = region
        av = fake(anchor)
        if (cq * ck).syms:
            return f"attention scores go through {what} with q or k under a symbolic scale; kept as written"
        try:
            got = extract_mask.extract_score(top, anchor, (av.shape[-2], av.shape[-1]), outer, (cq * ck).const)
        except extract_mask.Unextractable as e:
            return f"attention scores go through {what}, whose score function is not read: {e}"[:400]
        if len(got.inputs) > MASK_TENSORS:
            return (f"attention scores go through {what}, a score function of {len(got.inputs)} tensors; the ring op "
                    f"takes at most {MASK_TENSORS}")
        mods.fn, mods.fn_inputs = got.fn, tuple(got.inputs)
        scale, cq, ck = _Scale(got.scale), ONE, ONE
    qv, ktv, vv = fake(q), fake(kt), fake(v)
    if merged != (split is not None):
        return "a view merging batch and heads on one side of the softmax only"
    want = 3 if split is not None else xv.dim()
    if not all(isinstance(t, torch.Tensor) for t in (qv, ktv, vv)) or not (qv.dim() == ktv.dim() == vv.dim() == want):
        return None
    if not same_size(qv.shape[-1], ktv.shape[-2]) or not same_size(ktv.shape[-1], vv.shape[-2]):
        return None
    return _Manual(out=out, q=q, k=k, kt=kt, v=v, scale=scale * cq * ck, mask=mask, mask_scale=mask_scale,
                   dropout=dropout, reused=reused, mods=mods, split=split)


def _merges_heads(x: torch.fx.Node, u: Optional[torch.fx.Node]) -> bool:
    """u (or x itself, when u is None: x = view(its input)) views a [b, h, n, m] value as
    [b * h, n, m] (u is None: a [b * h, n, m] one as [b, h, n, m]) with static b and h."""
    if u is None:
        u, x = x, x.args[0] if x.args else None
        big, small = fake(u), fake(x)
    else:
        big, small = fake(x), fake(u)
    if not _is(u, VIEW_FUNCS, ("view", "reshape")) or not isinstance(big, torch.Tensor) \
            or not isinstance(small, torch.Tensor) or big.dim() != 4 or small.dim() != 3:
        return False
    b, h = static_int(big.shape[0]), static_int(big.shape[1])
    return (b is not None and h is not None and static_int(small.shape[0]) == b * h
            and same_shape(big.shape[2:], small.shape[1:]))


# Note [Sink column]
# Attention sinks (gpt-oss's eager attention) append one logit per head to every row of the
# scores before the softmax and drop its column after it:
#     combined = cat([scores, sinks.reshape(1, h, 1, 1).expand(b, h, n, 1)], -1)
#     combined = combined - combined.max(-1, keepdim=True).values    (optional: a row shift)
#     P = softmax(combined, -1)[..., :-1]
# `_sink_of` reads the cat (through the shift, which the softmax ignores) and the appended column:
# a broadcast (expands, views, casts) of a graph value of h numbers, one per head, in head
# order; the forward walk then takes the slice that drops the column. The site's ScoreMods.sinks
# are that value reshaped to [h] (Note [Attention sinks] in runtime/ops.py), and its canonical
# node is a shadow of the user's nodes.


def _sink_of(x: Any) -> Optional[tuple[torch.fx.Node, "_SinksPlan"]]:
    """(scores, sinks) when the softmax input x is the scores with a sink column appended
    (Note [Sink column])."""
    if not isinstance(x, torch.fx.Node):
        return None
    shifted = _row_shifted(x)
    if shifted is not None:
        x = shifted
    xv = fake(x)
    if not _is(x, (torch.cat, torch.concat, aten.cat.default), ("cat",)) or not isinstance(xv, torch.Tensor) \
            or xv.dim() != 4:
        return None
    parts = x.kwargs.get("tensors", x.args[0] if x.args else None)
    dim = x.kwargs.get("dim", x.args[1] if len(x.args) > 1 else 0)
    if not isinstance(parts, (list, tuple)) or len(parts) != 2 or not isinstance(dim, int) or dim % 4 != 3:
        return None
    scores, col = parts
    sv, cv = fake(scores), fake(col)
    if not (isinstance(scores, torch.fx.Node) and isinstance(col, torch.fx.Node) and isinstance(sv, torch.Tensor)
            and isinstance(cv, torch.Tensor) and cv.dim() == 4 and is_one(cv.shape[3])):
        return None
    heads = static_int(sv.shape[1])
    if heads is None or not _reaches_matmul_or_mask(scores):
        return None
    node = col
    while _is(node, (torch.Tensor.expand, aten.expand.default), ("expand", "expand_as")) or _is_cast(node):
        node = node.args[0]
    shape = fake(node).shape if isinstance(fake(node), torch.Tensor) else None
    # what the expands broadcast: h values along the head dim (-3), ones elsewhere
    if shape is None or len(shape) < 3 or static_int(shape[-3]) != heads or \
            any(not is_one(d) for i, d in enumerate(shape) if i != len(shape) - 3):
        return None
    src = node
    while _is(src, VIEW_FUNCS, VIEW_METHODS) or _is_cast(src):  # views keep the h values in order
        src = src.args[0]
    if not isinstance(src, torch.fx.Node) or not isinstance(fake(src), torch.Tensor) or fake(src).numel() != heads:
        src = node
    return scores, _SinksPlan(src)


@dataclass(frozen=True)
class _SinksPlan:
    """The lifted sinks: reshape(node, [-1]), built by the canonicalisation."""

    node: torch.fx.Node

    @property
    def name(self) -> str:
        return self.node.name


def _reaches_matmul_or_mask(node: torch.fx.Node) -> bool:
    """The scores of a sink cat: q.k scores, possibly masked."""
    found = _mask_of(node)
    return _reaches_matmul(found[0] if found is not None else node)


def _row_shifted(x: torch.fx.Node) -> Optional[torch.fx.Node]:
    """y when x = y - max(y, -1, keepdim=True) (a shift per row, which a softmax ignores)."""
    if not _is(x, SUB_FUNCS, ("sub", "__sub__")) or len(x.args) != 2 or x.kwargs:
        return None
    y, m = x.args
    if not isinstance(m, torch.fx.Node):
        return None
    if m.op == "call_function" and ((m.target is operator.getitem and m.args[1:] == (0,))
                                    or (m.target is getattr and m.args[1:] == ("values",))):
        m = m.args[0]
    elif not _is(m, (torch.amax, aten.amax.default), ("amax",)):
        return None
    if not _is(m, (torch.max, torch.amax, aten.max.dim, aten.amax.default), ("max", "amax")) or not m.args \
            or m.args[0] is not y:
        return None
    dim = m.kwargs.get("dim", m.args[1] if len(m.args) > 1 else None)
    keep = m.kwargs.get("keepdim", m.args[2] if len(m.args) > 2 else False)
    yv = fake(y)
    if isinstance(dim, (list, tuple)) and len(dim) == 1:
        dim = dim[0]
    if not isinstance(yv, torch.Tensor) or not isinstance(dim, int) or dim % yv.dim() != yv.dim() - 1 or keep is not True:
        return None
    return y


def _drops_last_column(p: torch.fx.Node, u: torch.fx.Node) -> bool:
    """u = p[..., :-1]: p without its last column along the last dim."""
    pv, uv = fake(p), fake(u)
    if not isinstance(pv, torch.Tensor) or not isinstance(uv, torch.Tensor) or pv.dim() != uv.dim() \
            or not same_shape(pv.shape[:-1], uv.shape[:-1]):
        return False
    if u.op == "call_function" and u.target is operator.getitem and u.args[0] is p:
        idx = u.args[1]
        idx = idx if isinstance(idx, tuple) else (idx,)
        if not idx or not isinstance(idx[-1], slice):
            return False
        lead = idx[:-1]
        if not (all(i is Ellipsis or i == slice(None) for i in lead)
                and (Ellipsis in lead or len(idx) == pv.dim())):
            return False
        last = idx[-1]
        return last.start in (None, 0) and last.step in (None, 1) and \
            (last.stop == -1 or (static_int(last.stop) is not None and same_size(last.stop + 1, pv.shape[-1])))
    if u.target is aten.slice.Tensor and u.args[0] is p:
        args = list(u.args) + [None] * 4
        dim, start, end, step = args[1], args[2], args[3], args[4] if args[4] is not None else 1
        return isinstance(dim, int) and dim % pv.dim() == pv.dim() - 1 and start in (None, 0) and step == 1 and \
            (end == -1 or (static_int(end) is not None and same_size(end + 1, pv.shape[-1])))
    return False


VIEW_METHODS = ("view", "reshape", "unsqueeze", "squeeze")
VIEW_FUNCS = (torch.reshape, torch.unsqueeze, torch.squeeze, aten.view.default, aten.reshape.default,
              aten.unsqueeze.default, aten.squeeze.dim)


def _score_anchor(s: torch.fx.Node, depth: int = 24) -> Optional[torch.fx.Node]:
    """The one q.k product (a matmul of two operands, or a baddbmm) that the scores `s` are
    computed from, through any ops (Note [Score extraction] in extract_mask.py); None when there
    is none or more than one."""
    found, seen, stack = set(), set(), [(s, 0)]
    while stack:
        x, d = stack.pop()
        if x in seen or not isinstance(x, torch.fx.Node) or d > depth:
            continue
        seen.add(x)
        if (_is(x, MATMUL_FUNCS, MATMUL_METHODS) and len(x.args) == 2) or _is(x, BADDBMM_FUNCS, ("baddbmm",)):
            found.add(x)
            continue
        stack.extend((i, d + 1) for i in x.all_input_nodes)
    return found.pop() if len(found) == 1 else None


def _score_bias(m: Any, scores: torch.fx.Node) -> bool:
    """s + m adds a score bias (ALiBi, a relative-position term read from positions), not a mask:
    m is read as a function (extract_mask.py) whose values are not only 0 and very negative
    ones, or are not fixed by the graph and never very negative (a mask sets masked scores to
    -inf or a very negative number; a bias does not)."""
    sv, mv = fake(scores), fake(m) if isinstance(m, torch.fx.Node) else None
    if not isinstance(mv, torch.Tensor) or not mv.is_floating_point() or not isinstance(sv, torch.Tensor) \
            or sv.dim() < 2:
        return False  # a bool mask (masked_fill, where) is a mask
    walk = extract_mask._Walk((sv.shape[-2], sv.shape[-1]))
    try:
        val = walk.eval(m)
    except extract_mask.Unextractable:
        return False
    if not isinstance(val, extract_mask.Val):
        return False
    values = extract_mask._values(val.expr)
    if values is not None:
        return any(v != 0 and v > VERY_NEGATIVE for v in values)
    return not _has_very_negative(val.expr)


def _has_very_negative(e: tuple) -> bool:
    if e[0] == "c":
        return isinstance(e[1], (int, float)) and not isinstance(e[1], bool) and e[1] <= VERY_NEGATIVE
    if e[0] in ("i", "ax"):
        return False
    if e[0] == "load":
        return any(_has_very_negative(a) for a in e[2])
    return any(_has_very_negative(a) for a in e[1:])


def _scores_of_q_k(softmax: torch.fx.Node, depth: int = 12) -> str:
    """Why `softmax` is attention the matcher could not take, or "" when it is no attention:
    a softmax over the last dim whose input comes, through ops that keep that dim's size, from
    a product of two graph values (matmul, bmm, baddbmm, einsum) whose last dim it is: scores
    q.k however modified (soft-caps, biases, views). A softmax over a linear layer's output
    (a router's) or over anything else is not one."""
    x, dim, _ = _softmax_parts(softmax)
    xv = fake(x)
    if not isinstance(xv, torch.Tensor) or xv.dim() < 2 or not isinstance(dim, int) or dim % xv.dim() != xv.dim() - 1:
        return ""
    if not _weights_values(softmax):
        return ""
    width = xv.shape[-1]
    seen, frontier, path = set(), [x], []
    for _ in range(depth):
        nxt = []
        for node in frontier:
            if not isinstance(node, torch.fx.Node) or node in seen:
                continue
            seen.add(node)
            val = fake(node)
            if not isinstance(val, torch.Tensor) or val.dim() < 2 or not same_size(val.shape[-1], width):
                continue
            if _is(node, MATMUL_FUNCS + BADDBMM_FUNCS + EINSUM_FUNCS, MATMUL_METHODS + ("baddbmm",)):
                operands = [a for a in node.all_input_nodes if isinstance(fake(a), torch.Tensor) and fake(a).dim() >= 2]
                if len(operands) >= 2:
                    steps = " -> ".join(dict.fromkeys(path)) or "nothing"
                    return (f"softmax over q.k scores (from {node.name}) in a form the matcher does not read "
                            f"(the scores go through {steps}); kept as dense attention")
                continue
            if node.op in ("call_function", "call_method") and not _is(node, LINEAR_FUNCS):
                path.append(_op_label(node))
                nxt.extend(node.all_input_nodes)
        frontier = nxt
    return ""


def _weights_values(p: torch.fx.Node, depth: int = 8) -> bool:
    """The probabilities (through casts, dropout, views: ops of one tensor input) weight values:
    they are the left operand of a product (P @ v, bmm(P, v)) or an einsum's operand."""
    frontier = [p]
    for _ in range(depth):
        nxt = []
        for node in frontier:
            for u in real_users(node):
                if _is(u, EINSUM_FUNCS):
                    return True
                if _is(u, MATMUL_FUNCS, MATMUL_METHODS):
                    if u.args and u.args[0] is node:
                        return True
                    continue
                if u.op in ("call_function", "call_method") and len(u.all_input_nodes) == 1:
                    nxt.append(u)
        frontier = nxt
    return False


def _op_label(node: torch.fx.Node) -> str:
    return node.target if isinstance(node.target, str) else getattr(node.target, "__name__", str(node.target))


def _baddbmm(node: torch.fx.Node, mask: Any):
    """(a, b, alpha, mask) of baddbmm(input, a, b, beta=, alpha=) = beta * input + alpha * a @ b:
    beta = 0 ignores input (HF's empty-buffer idiom); beta = 1 adds it as a float mask."""
    args = list(node.args) + [None] * 2
    inp, a, bt = args[0], args[1], args[2]
    beta = static_float(node.kwargs.get("beta", 1.0))
    alpha = static_float(node.kwargs.get("alpha", 1.0))
    if beta is None or alpha is None or alpha <= 0 or not isinstance(a, torch.fx.Node) or not isinstance(bt, torch.fx.Node):
        return None
    if beta == 0:
        return a, bt, alpha, mask
    if beta == 1 and mask is None and isinstance(inp, torch.fx.Node) and fake(inp).dtype == fake(node).dtype:
        # softmax(alpha * (a @ b) + input) = SDPA with scale alpha and additive mask input
        return a, bt, alpha, inp
    return None


def _dropout_args(node: torch.fx.Node) -> tuple[Optional[float], bool]:
    """(p, training) of a dropout call; a training flag that is not a constant counts as True."""
    args = list(node.args) + [None] * 3
    if node.target in (torch.dropout, aten.dropout.default):
        prob, train = node.kwargs.get("p", args[1]), node.kwargs.get("train", args[2])
    else:  # F.dropout(input, p=0.5, training=True, inplace=False) / Tensor.dropout
        prob = node.kwargs.get("p", 0.5 if args[1] is None else args[1])
        train = node.kwargs.get("training", True if args[2] is None else args[2])
    return static_float(prob), train if isinstance(train, bool) else True


def _mask_of(s: torch.fx.Node):
    """(scores, mask) when s applies a mask to scores: s + m, masked_fill(scores, m, -inf),
    where(m, scores, -inf). The mask is a node (bool: True = attend, or additive float) or
    ("not", node) for a bool mask of excluded positions."""
    sv = fake(s)
    if _is(s, ADD_FUNCS, ("add", "__add__")) and len(s.args) == 2 and not s.kwargs:
        a, b = s.args
        for scores, m in ((a, b), (b, a)):
            mv = fake(m)
            if (isinstance(m, torch.fx.Node) and _reaches_matmul(scores) and isinstance(mv, torch.Tensor)
                    and mv.dtype == sv.dtype):
                return scores, m
        return None
    if _is(s, MASKED_FILL_FUNCS, ("masked_fill",)) and len(s.args) == 3:
        scores, m, value = s.args
        if _is_very_negative(value) and isinstance(m, torch.fx.Node):
            return scores, ("not", m)
        return None
    if _is(s, WHERE_FUNCS, ()) and len(s.args) == 3:
        m, a, b = s.args
        if _is_very_negative(b) and isinstance(m, torch.fx.Node):
            return a, m
        if _is_very_negative(a) and isinstance(m, torch.fx.Node):
            return b, ("not", m)
    return None


def _is_very_negative(value: Any) -> bool:
    v = _const(value)
    return v is not None and v <= VERY_NEGATIVE


def _reaches_matmul(node: Any, depth: int = 12) -> bool:
    """node is computed from one q.k product: tells the scores apart from the mask in s + m."""
    return isinstance(node, torch.fx.Node) and _score_anchor(node, depth) is not None


def _plain_product(x: Any, mask: Any) -> bool:
    """x is q.k as the canonical form takes it: a matmul, or a baddbmm that `_baddbmm` reads."""
    return isinstance(x, torch.fx.Node) and ((_is(x, MATMUL_FUNCS, MATMUL_METHODS) and len(x.args) == 2)
                                             or (_is(x, BADDBMM_FUNCS, ("baddbmm",)) and _baddbmm(x, mask) is not None))


# ---------------------------------------------------------------------------------------
# nn.MultiheadAttention: F.multi_head_attention_forward

MHA_PARAMS = ("query", "key", "value", "embed_dim_to_check", "num_heads", "in_proj_weight", "in_proj_bias",
              "bias_k", "bias_v", "add_zero_attn", "dropout_p", "out_proj_weight", "out_proj_bias", "training",
              "key_padding_mask", "need_weights", "attn_mask", "use_separate_proj_weight", "q_proj_weight",
              "k_proj_weight", "v_proj_weight", "static_k", "static_v", "average_attn_weights", "is_causal")
MHA_DEFAULTS = {"training": True, "key_padding_mask": None, "need_weights": True, "attn_mask": None,
                "use_separate_proj_weight": False, "q_proj_weight": None, "k_proj_weight": None,
                "v_proj_weight": None, "static_k": None, "static_v": None, "average_attn_weights": True,
                "is_causal": False}


def _canonicalise_mha(gm: torch.fx.GraphModule, node: torch.fx.Node, ctx: PassContext) -> bool:
    a = dict(MHA_DEFAULTS)
    a.update(zip(MHA_PARAMS, node.args))
    a.update(node.kwargs)
    out_users = [u for u in node.users if u.target is operator.getitem and u.args[1] == 0]
    weight_users = drop_unread(gm, [u for u in node.users if u not in out_users])
    if weight_users:
        _skip_site(ctx, node, "mha", SkipReason.WEIGHTS_USED,
                   f"nn.MultiheadAttention's attention weights are used (need_weights={a['need_weights']})")
        return False
    why = _mha_unsupported(a)
    if why:
        _skip_site(ctx, node, "mha", SkipReason.OTHER, why)
        return False
    dropout_p = static_float(a["dropout_p"]) or 0.0
    if a["training"] and dropout_p > 0:
        _skip_site(ctx, node, "mha", SkipReason.DROPOUT,
                   f"nn.MultiheadAttention dropout={dropout_p} in training; per-block dropout is not in the runtime yet")
        return False
    b = Builder(gm, node, PASS)
    query, key, value = a["query"], a["key"], a["value"]
    E = fake(query).shape[-1]
    H = int(a["num_heads"])
    D = E // H
    if a["use_separate_proj_weight"]:
        wq, wk, wv = a["q_proj_weight"], a["k_proj_weight"], a["v_proj_weight"]
    else:
        w = b.call(torch.chunk, a["in_proj_weight"], 3)
        wq, wk, wv = (b.getitem(w, i) for i in range(3))
    if a["in_proj_bias"] is not None:
        bias = b.call(torch.chunk, a["in_proj_bias"], 3)
        bq, bk, bv = (b.getitem(bias, i) for i in range(3))
    else:
        bq = bk = bv = None

    # sizes other than H and D may be symbolic: unflatten / flatten keep them out of the graph
    def heads(x, wt, bs):  # [len, N, E] -> [N, H, len, D]
        y = b.call(F.linear, x, wt, bs)
        y = b.method("unflatten", y, -1, (H, D))
        return b.method("permute", y, 1, 2, 0, 3)

    q, k, v = heads(query, wq, bq), heads(key, wk, bk), heads(value, wv, bv)
    mask, is_causal = _mha_mask(b, a)
    call = SdpaCall(q, k, v, attn_mask=mask, dropout_p=0.0, is_causal=is_causal, scale=None, enable_gqa=False)
    y = b.sdpa(call, "mha")  # [N, H, L, D]
    y = b.method("permute", y, 2, 0, 1, 3)
    y = b.method("flatten", y, -2)
    y = b.call(F.linear, y, a["out_proj_weight"], a["out_proj_bias"])
    for u in out_users:
        u.replace_all_uses_with(y)
        gm.graph.erase_node(u)
    for u in weight_users:
        gm.graph.erase_node(u)
    erase_dead(gm, [node])
    return True


def _mha_unsupported(a: dict) -> str:
    if any(a[n] is not None for n in ("bias_k", "bias_v", "static_k", "static_v")):
        return "nn.MultiheadAttention with bias_k/bias_v or static_k/static_v is not canonicalised"
    if a["add_zero_attn"]:
        return "nn.MultiheadAttention with add_zero_attn is not canonicalised"
    qv = fake(a["query"])
    if not isinstance(qv, torch.Tensor) or qv.dim() != 3 or not isinstance(a["num_heads"], int):
        return "unbatched nn.MultiheadAttention input"
    E = qv.shape[-1]
    if not isinstance(E, int) or E % a["num_heads"] or fake(a["key"]).shape[-1] != E or fake(a["value"]).shape[-1] != E:
        return "nn.MultiheadAttention with kdim/vdim != embed_dim"
    for m in (a["attn_mask"], a["key_padding_mask"]):
        if m is not None and not isinstance(m, torch.fx.Node):
            return "mask that is not a graph value"
    am = fake(a["attn_mask"]) if a["attn_mask"] is not None else None
    if am is not None and am.dim() != 2:
        return "3-D per-head attn_mask of nn.MultiheadAttention"
    if a["is_causal"] and a["attn_mask"] is None:
        return "is_causal without attn_mask"
    return ""


def _mha_mask(b: Builder, a: dict):
    """The SDPA mask of F.multi_head_attention_forward (same merge: additive float masks;
    a bool mask marks excluded positions, as in nn.MultiheadAttention)."""
    attn_mask, kpm = a["attn_mask"], a["key_padding_mask"]
    if a["is_causal"]:
        # is_causal is nn.MultiheadAttention's promise that attn_mask is the causal mask
        # (F.multi_head_attention_forward drops the mask on its strength when there is no
        # padding); keep the promise as positions, so that mask lifting can read it.
        if kpm is None:
            return None, True
        device = fake(a["query"]).device
        i = b.call(torch.arange, b.method("size", a["query"], 0), device=device)
        j = b.call(torch.arange, b.method("size", a["key"], 0), device=device)
        attn_mask = b.call(operator.gt, b.getitem(j, (None, slice(None))), b.getitem(i, (slice(None), None)))
    parts = []
    if attn_mask is not None:
        parts.append(b.getitem(_additive(b, attn_mask), (None, None)))  # [L, S] -> [1, 1, L, S]
    if kpm is not None:
        parts.append(b.getitem(_additive(b, kpm), (slice(None), None, None)))  # [N, S] -> [N, 1, 1, S]
    if not parts:
        return None, False
    mask = parts[0]
    for p in parts[1:]:
        mask = b.call(operator.add, mask, p)
    return mask, False


def _additive(b: Builder, m: torch.fx.Node) -> torch.fx.Node:
    if fake(m).dtype != torch.bool:
        return m
    zeros = b.call(torch.zeros_like, m, dtype=fake(b.anchor.args[0]).dtype)
    return b.method("masked_fill", zeros, m, float("-inf"))


# ---------------------------------------------------------------------------------------
# nn.TransformerEncoderLayer fast path: torch._transformer_encoder_layer_fwd

ENCODER_PARAMS = ("src", "embed_dim", "num_heads", "qkv_weight", "qkv_bias", "proj_weight", "proj_bias", "use_gelu",
                  "norm_first", "eps", "norm_weight_1", "norm_bias_1", "norm_weight_2", "norm_bias_2",
                  "ffn_weight_1", "ffn_bias_1", "ffn_weight_2", "ffn_bias_2", "mask", "mask_type")


def _canonicalise_encoder(gm: torch.fx.GraphModule, node: torch.fx.Node, ctx: PassContext) -> bool:
    """Decompose the fused layer (batch-first src [N, L, E]; the fast path runs in inference
    only, so there is no dropout) into its math with the attention as SDPA."""
    a = dict(zip(ENCODER_PARAMS, node.args))
    a.update(node.kwargs)
    src = fake(a["src"])
    if not isinstance(src, torch.Tensor) or src.dim() != 3 or getattr(src, "is_nested", False):
        _skip_site(ctx, node, "encoder", SkipReason.ENCODER_FASTPATH, "fused encoder layer on a non-3-D / nested input")
        return False
    if a.get("mask") is not None:
        _skip_site(ctx, node, "encoder", SkipReason.ENCODER_FASTPATH,
                   "fused encoder layer with a merged mask (use torch.backends.mha.set_fastpath_enabled(False))")
        return False
    b = Builder(gm, node, PASS)
    E = src.shape[-1]
    H = int(a["num_heads"])
    D = E // H
    x = a["src"]

    def norm(y, w, bias):
        return b.call(F.layer_norm, y, (E,), w, bias, a["eps"])

    def attention(y):
        qkv = b.call(F.linear, y, a["qkv_weight"], a["qkv_bias"])
        qkv = b.method("unflatten", qkv, -1, (3, H, D))
        qkv = b.method("permute", qkv, 2, 0, 3, 1, 4)
        q, k, v = (b.getitem(qkv, i) for i in range(3))
        o = b.sdpa(SdpaCall(q, k, v), "encoder")
        o = b.method("flatten", b.method("transpose", o, 1, 2), -2)
        return b.call(F.linear, o, a["proj_weight"], a["proj_bias"])

    def ffn(y):
        h = b.call(F.linear, y, a["ffn_weight_1"], a["ffn_bias_1"])
        h = b.call(F.gelu if a["use_gelu"] else F.relu, h)
        return b.call(F.linear, h, a["ffn_weight_2"], a["ffn_bias_2"])

    if a["norm_first"]:
        x = b.call(operator.add, x, attention(norm(x, a["norm_weight_1"], a["norm_bias_1"])))
        x = b.call(operator.add, x, ffn(norm(x, a["norm_weight_2"], a["norm_bias_2"])))
    else:
        x = norm(b.call(operator.add, x, attention(x)), a["norm_weight_1"], a["norm_bias_1"])
        x = norm(b.call(operator.add, x, ffn(x)), a["norm_weight_2"], a["norm_bias_2"])
    node.replace_all_uses_with(x)
    erase_dead(gm, [node])
    return True

