"""Extract a site's mask as a function of (b, h, q_idx, kv_idx) from the subgraph that computed it.

Note [Mask extraction]
The SDPA attn_mask is computed in the graph, in whatever form the tracer left: broadcasts of
aranges, index lookups of [b, n] tensors, logical and arithmetic ops, where / masked_fill, an
additive float mask. Each node of that subgraph is evaluated to a symbolic value: an
expression over *axes*, one fresh variable per dim of the node's value (None for a dim of size
1), so that element [i0, i1, ..] of the node equals the expression with each axis replaced by
its index. Every op makes fresh axes for its output and substitutes them into its inputs'
expressions (aligned as broadcasting aligns dims; a slice x[a:] substitutes a + axis, an index
lookup t[i, j] substitutes the index expressions), so a value's axes are its own and an arange
read along two dims (q and kv) gives two variables. Sizes are never read from the node's
arguments: `view(2, 16, ..)`, `expand(b, 1, n, n)` and `arange(16)` only say where the dims go,
so the function holds at every block size and position.

Three forms hold their value outside one node: torch.vmap over a mask function (each
`_add_batch_dim(x, d, level)` hides dim d of x as the level's batch, read as a variable of
the expression until `_remove_batch_dim` turns it back into an axis of the output); writes in
place (`m[..., :k] = v`: the value a reader sees is the node's with the writes made before
that reader applied, each a where() over the written region); and another graph's mask output
(`ringcc::mask_from_fn`, Note [Mask outputs] in ringcc/sharded.py), read as the function it
carries.

The walk stops at per-token values: a node it cannot read (a graph input, cumsum, diff, an
embedding of positions, ..) whose value has at most one dim of the sequence's length becomes
a tensor input t_k of the function, read through its axes (load). A cumsum of a value that is
the same along the summed dim (a mask of ones) is index arithmetic, x * (i + 1), not an input. Such values are whole-length
and replicated in the graph (ids, positions, padding masks), so the ring op takes them as they
are and reads them at global positions. A slice at a start the graph computes from the length
(MPT's bias over max_seq_len, sliced at max(0, max_seq_len - n) under a symbolic length) is one
of them: the function cannot name n, and the slice's value is whole-length at every n. A node
with two sequence dims that the walk cannot read (a stored [n, n] mask) is not extractable: its
values are data.

At the mask the dims are (from the right) kv, q, h, b; substituting the indices for their axes
gives the function. A bool mask is the function; an additive float mask must take the value 0
(attend) or at most -1e4 (masked) only, which the walk proves from its constants (where,
masked_fill, full, torch.tensor of a number, sums of such); otherwise it is a score bias, not a mask. Its
masked values are kept (Extracted.fills) where one is finite, with whether the function is true at
kv = q: a row with every key masked by a finite value is eager's mean of the values (Note [Rows
with no key] in runtime/ops.py). Nothing is evaluated on data: the function holds for every input.

The top-level conjuncts `kv <= q` are the causal flag (the ring's causal schedule and its
zigzag layout read it); the rest stays the function (runtime/maskfn.py, Note [Mask functions]).
"""

from __future__ import annotations

import itertools
import math
import operator
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.fx

from ringcc import _compat
from ringcc.runtime import maskfn
from ringcc.runtime.maskfn import OPS, MaskFn
from ringcc.runtime.ops import mask_from_fn_op

from .attention_form import fake, same_size

aten = torch.ops.aten
VERY_NEGATIVE = -1e4
INDEX_NAMES = ("b", "h", "q", "kv")


class Unextractable(Exception):
    pass


@dataclass(frozen=True)
class Val:
    """A tensor node as an expression over its axes (one per dim; None: a dim of size 1)."""

    expr: tuple
    axes: tuple


@dataclass
class Extracted:
    fn: Optional[MaskFn]  # None: the mask is causal (or nothing) alone
    inputs: list  # the tensor inputs t0.. (graph nodes)
    causal: bool
    fills: tuple = ()  # an additive mask's masked values, when one is finite (attention_form.LiftedMask)
    keeps_diagonal: bool = False  # the function is true at kv = q: every row keeps a key


def _c(v) -> tuple:
    # typed: True, 1 and 1.0 are equal (and hash alike) in Python, but not as the function's operands
    return ("c", v, type(v).__name__)


def _num(e, v) -> bool:
    """e is the number v (not a bool)."""
    return e[0] == "c" and not isinstance(e[1], bool) and e[1] == v


def _is_c(e) -> bool:
    return e[0] == "c"


def _op(name: str, *args) -> tuple:
    """An expression op(args), folded when every operand is a constant."""
    if all(_is_c(a) for a in args) and name in OPS:
        try:
            return _c(OPS[name][1](*(a[1] for a in args)))
        except (ZeroDivisionError, TypeError):
            pass
    if name in ("add", "sub") and _num(args[1], 0) or name in ("mul", "floordiv", "div") and _num(args[1], 1):
        return args[0]
    if name in ("add", "mul") and _num(args[0], 0 if name == "add" else 1):
        return args[1]
    if name == "add" and args[0][0] == "add" and _is_c(args[0][2]) and _is_c(args[1]):  # (x + a) + b
        return _op("add", args[0][1], _c(args[0][2][1] + args[1][1]))
    if name == "where" and _is_c(args[0]):
        return args[1] if args[0][1] else args[2]
    if name == "eq" and args[0][0] == "where" and _is_c(args[1]) and _is_c(args[0][2]) and _is_c(args[0][3]):
        # where(c, a, b) == a with b != a is c: an additive mask's test for 0 keeps its conjuncts
        a, b, x = args[0][2][1], args[0][3][1], args[1][1]
        if a == x != b:
            return args[0][1]
        if b == x != a:
            return _op("not", args[0][1])
    if name in ("and", "or"):  # the unit (True for and, False for or) drops out, the other absorbs
        unit, absorbing = _c(name == "and"), _c(name == "or")
        a, b = args
        for x, y in ((a, b), (b, a)):
            if x == unit:
                return y
            if x == absorbing:
                return absorbing
    return (name,) + tuple(args)


def _subst(expr: tuple, m: dict, memo: Optional[dict] = None) -> tuple:
    """expr with the axes in m replaced by their expressions."""
    if not m:
        return expr
    memo = {} if memo is None else memo
    if expr in memo:
        return memo[expr]
    tag = expr[0]
    if tag == "ax":
        out = m.get(expr[1], expr)
    elif tag in ("c", "i"):
        out = expr
    elif tag == "load":
        out = ("load", expr[1], tuple(_subst(a, m, memo) for a in expr[2]))
    else:
        out = _op(tag, *(_subst(a, m, memo) for a in expr[1:]))
    memo[expr] = out
    return out


def _free_axes(expr: tuple, acc: set) -> set:
    tag = expr[0]
    if tag == "ax":
        acc.add(expr[1])
    elif tag == "load":
        for a in expr[2]:
            _free_axes(a, acc)
    elif tag not in ("c", "i"):
        for a in expr[1:]:
            _free_axes(a, acc)
    return acc


# ---------------------------------------------------------------------------------------
# targets


def _names(*items) -> set:
    return set(items)


BINARY = {
    "add": _names(operator.add, operator.iadd, torch.add, "add", "__add__", "add_", "__iadd__", aten.add.Tensor,
                  aten.add.Scalar),
    "sub": _names(operator.sub, torch.sub, "sub", "__sub__", aten.sub.Tensor, aten.sub.Scalar),
    "mul": _names(operator.mul, operator.imul, torch.mul, "mul", "__mul__", "mul_", "__imul__", aten.mul.Tensor,
                  aten.mul.Scalar),
    "floordiv": _names(operator.floordiv, torch.floor_divide, "floor_divide", "__floordiv__", aten.floor_divide.default,
                       aten.floor_divide.Scalar),
    "remainder": _names(operator.mod, torch.remainder, "remainder", "__mod__", aten.remainder.Tensor,
                        aten.remainder.Scalar),
    "minimum": _names(torch.minimum, "minimum", aten.minimum.default),
    "maximum": _names(torch.maximum, "maximum", aten.maximum.default),
    "eq": _names(operator.eq, torch.eq, "eq", "__eq__", aten.eq.Tensor, aten.eq.Scalar),
    "ne": _names(operator.ne, torch.ne, "ne", "__ne__", aten.ne.Tensor, aten.ne.Scalar),
    "lt": _names(operator.lt, torch.lt, "lt", "__lt__", aten.lt.Tensor, aten.lt.Scalar),
    "le": _names(operator.le, torch.le, "le", "__le__", aten.le.Tensor, aten.le.Scalar),
    "gt": _names(operator.gt, torch.gt, "gt", "__gt__", aten.gt.Tensor, aten.gt.Scalar),
    "ge": _names(operator.ge, torch.ge, "ge", "__ge__", aten.ge.Tensor, aten.ge.Scalar),
    "and": _names(operator.and_, torch.logical_and, torch.bitwise_and, "logical_and", "bitwise_and", "__and__",
                  aten.logical_and.default, aten.bitwise_and.Tensor, aten.__and__.Tensor),
    "or": _names(operator.or_, torch.logical_or, torch.bitwise_or, "logical_or", "bitwise_or", "__or__",
                 aten.logical_or.default, aten.bitwise_or.Tensor, aten.__or__.Tensor),
    "xor": _names(operator.xor, torch.logical_xor, "logical_xor", "__xor__", aten.logical_xor.default),
}
RSUB = _names("rsub", "__rsub__", torch.rsub, aten.rsub.Scalar)
RADD = _names("__radd__")
RMUL = _names("__rmul__")
UNARY = {
    "neg": _names(operator.neg, torch.neg, "neg", "__neg__", aten.neg.default),
    "abs": _names(operator.abs, torch.abs, "abs", "__abs__", aten.abs.default),
    "not": _names(operator.invert, torch.logical_not, torch.bitwise_not, "logical_not", "bitwise_not", "__invert__",
                  aten.logical_not.default, aten.bitwise_not.default),
}
DIV = _names(torch.div, "div", aten.div.Tensor_mode, aten.div.Scalar_mode)
TRUEDIV = _names(operator.truediv, torch.true_divide, "__truediv__", "true_divide", aten.div.Tensor, aten.div.Scalar)
FLOAT_UNARY = {  # float functions a score function reads (Note [Score functions] in runtime/maskfn.py)
    "tanh": _names(torch.tanh, "tanh", aten.tanh.default),
    "exp": _names(torch.exp, "exp", aten.exp.default),
    "log": _names(torch.log, "log", aten.log.default),
    "sqrt": _names(torch.sqrt, "sqrt", aten.sqrt.default),
    "sigmoid": _names(torch.sigmoid, "sigmoid", aten.sigmoid.default),
}
REPEAT = _names("repeat", aten.repeat.default)
BADDBMM = _names(torch.baddbmm, "baddbmm", aten.baddbmm.default)
CUMSUM = _names(torch.cumsum, "cumsum", aten.cumsum.default)
ARANGE = _names(torch.arange, aten.arange.default, aten.arange.start, aten.arange.start_step)
KEEP = _names("contiguous", "clone", "detach", torch.clone, aten.clone.default, aten.contiguous.default,
              aten.lift_fresh_copy.default, aten.alias.default, aten.detach.default)
CAST = _names("to", "type_as", "bool", "float", "half", "bfloat16", "double", "int", "long", aten._to_copy.default,
              aten.to.dtype, aten.to.device, aten.to.dtype_layout)
EXPAND = _names("expand", "expand_as", "broadcast_to", torch.broadcast_to, aten.expand.default)
RESHAPE = _names("unsqueeze", torch.unsqueeze, aten.unsqueeze.default, "view", "reshape", torch.reshape,
                 aten.view.default, aten.reshape.default, "squeeze", torch.squeeze, aten.squeeze.dim,
                 aten._unsafe_view.default)
FULL_LIKE = {torch.ones: 1, torch.zeros: 0, torch.ones_like: 1, torch.zeros_like: 0, "new_ones": 1, "new_zeros": 0,
             aten.ones.default: 1, aten.zeros.default: 0, aten.new_ones.default: 1, aten.new_zeros.default: 0,
             aten.ones_like.default: 1, aten.zeros_like.default: 0}
FULL = _names(torch.full, "new_full", torch.full_like, aten.full.default, aten.full_like.default, "fill_")
SCALAR_TENSOR = _names(torch.tensor, torch.scalar_tensor, aten.scalar_tensor.default)  # a 0-d tensor of a number
TRIL = _names(torch.tril, "tril", aten.tril.default)
TRIU = _names(torch.triu, "triu", aten.triu.default)
MASKED_FILL = _names(torch.masked_fill, "masked_fill", "masked_fill_", aten.masked_fill.Scalar,
                     aten.masked_fill_.Scalar)
WHERE = _names(torch.where, aten.where.self, aten.where.ScalarOther, aten.where.ScalarSelf, aten.where.Scalar)
INDEX = _names(aten.index, aten.index.Tensor)
SLICE = _names(aten.slice.Tensor)
SELECT = _names(aten.select.int)
SETITEM = _names(operator.setitem)
ADD_BATCH_DIM, REMOVE_BATCH_DIM = _compat.vmap_batch_dim_targets()
MASK_FROM_FN = _names(mask_from_fn_op._opoverload, torch.ops.ringcc.mask_from_fn)


def _target_in(t, group: set) -> bool:
    try:
        return t in group
    except TypeError:
        return False


# ---------------------------------------------------------------------------------------
# the walk


class _Walk:
    def __init__(self, seq_lengths: tuple, reader: Optional[torch.fx.Node] = None,
                 anchor: Optional[torch.fx.Node] = None):
        self.seq = seq_lengths
        self.anchor = anchor  # the q.k product a score function reads as its `score` (extract_score)
        self.memo: dict = {}
        self.leaves: list = []  # graph nodes read as tensors t0..
        self.counter = itertools.count()
        self.reader = reader  # the node that reads the mask: writes after it do not count
        self.readers: list = []  # the node whose arguments are being read
        self.order: dict = {}

    def from_scores(self) -> set:
        """The graph nodes computed from the anchor (the scores): never a tensor of the function."""
        if not isinstance(self.anchor, torch.fx.Node):
            return set()
        if not hasattr(self, "_from_scores"):
            seen, stack = set(), [self.anchor]
            while stack:
                for u in stack.pop().users:
                    if u not in seen:
                        seen.add(u)
                        stack.append(u)
            self._from_scores = seen
        return self._from_scores

    def fresh(self, size) -> Optional[int]:
        return None if isinstance(size, int) and size == 1 else next(self.counter)

    def axes_of(self, node) -> tuple:
        v = fake(node)
        return tuple(self.fresh(s) for s in v.shape)

    # -- entry

    def eval(self, x: Any) -> Any:
        if isinstance(x, torch.fx.Node):
            return self._seen(x, self.readers[-1] if self.readers else self.reader)
        if isinstance(x, (bool, int, float)):
            return x
        if x is None:
            return None
        raise Unextractable(f"the mask uses a constant of type {type(x).__name__}")

    def _seen(self, x: torch.fx.Node, reader: Optional[torch.fx.Node]) -> Any:
        """x as `reader` sees it: its value with the writes into it (x[idx] = v) made before
        `reader` in the graph applied in order (all of them without a reader)."""
        writes = [u for u in x.users if u.op == "call_function" and _target_in(u.target, SETITEM) and u.args[0] is x]
        if writes:
            if not self.order:
                self.order = {n: i for i, n in enumerate(x.graph.nodes)}
            writes = sorted((w for w in writes if reader is None or self.order[w] < self.order[reader]),
                            key=self.order.get)
        key = (x, writes[-1]) if writes else x
        if key not in self.memo:
            if writes:
                self.memo[key] = self._write(writes[-1], self._seen(x, writes[-1]))
            else:
                self.readers.append(x)
                try:
                    self.memo[key] = self._node(x)
                finally:
                    self.readers.pop()
        return self.memo[key]

    def _write(self, w: torch.fx.Node, old: Any) -> Val:
        """old[idx] = value (a setitem node) over slices of old's dims: where(inside, value, old)."""
        base, idx, value = w.args
        if not isinstance(old, Val):
            raise Unextractable(f"{w.name}: a write into a number")
        idx = idx if isinstance(idx, tuple) else (idx,)
        shape = fake(base).shape
        if any(i is None or not isinstance(i, (slice, type(Ellipsis))) for i in idx):
            raise Unextractable(f"{w.name}: a write into the mask at an index other than slices")
        n_real = sum(1 for i in idx if i is not Ellipsis)
        full: list = []
        for i in idx:
            full.extend([slice(None)] * (len(shape) - n_real) if i is Ellipsis else [i])
        full += [slice(None)] * (len(shape) - len(full))
        inside, region = _c(True), []
        for a, size, i in zip(old.axes, shape, full):
            start, stop = i.start or 0, fake(i.stop) if isinstance(i.stop, torch.fx.Node) else i.stop
            if stop is not None and not isinstance(stop, int) and same_size(stop, size):
                stop = None  # `[:n]` with n the dim's symbolic size: the whole dim
            if i.step not in (None, 1) or not isinstance(start, int) or not (stop is None or isinstance(stop, int)):
                raise Unextractable(f"{w.name}: a write into the mask over a slice that is not constant")
            ax = _c(0) if a is None else ("ax", a)
            if start < 0 or (stop is not None and stop < 0):
                raise Unextractable(f"{w.name}: a write into the mask over a slice from the end")
            if start:
                inside = _op("and", inside, _op("ge", ax, _c(start)))
            if stop is not None and not (isinstance(size, int) and stop >= size):
                inside = _op("and", inside, _op("lt", ax, _c(stop)))
            region.append(_op("sub", ax, _c(start)))
        v = self._seen(value, w) if isinstance(value, torch.fx.Node) else value
        if isinstance(v, Val):
            if len(v.axes) > len(region):
                raise Unextractable(f"{w.name}: a written value with more dims than the region")
            m = {b: region[len(region) - len(v.axes) + d] for d, b in enumerate(v.axes) if b is not None}
            new = _subst(v.expr, m)
        else:
            new = _c(v)
        return Val(_op("where", inside, new, old.expr), old.axes)

    def value(self, x: Any, node: torch.fx.Node) -> Val:
        """x (a Val or a Python number) as a Val aligned to `node`'s output."""
        return x if isinstance(x, Val) else Val(_c(x), ())

    def _leaf(self, node: torch.fx.Node) -> Val:
        v = fake(node)
        if not isinstance(v, torch.Tensor):
            if isinstance(v, (bool, int, float)):
                return v
            raise Unextractable(f"the mask reads {node.name}, which is not a tensor or a number")
        seq_dims = [d for d, s in enumerate(v.shape) if any(same_size(s, n) for n in self.seq) and not
                    (isinstance(s, int) and s == 1)]
        if _compat.is_vmap_batched(v):
            raise Unextractable(f"{node.name}: a value inside torch.vmap that mask extraction does not read "
                                f"({node.op} {getattr(node.target, '__name__', node.target)})")
        if len(seq_dims) > 1 and v.requires_grad:
            raise Unextractable(
                f"a [query, key] bias that needs a gradient ({node.name}, {node.op} "
                f"{getattr(node.target, '__name__', node.target)}, shape {tuple(v.shape)}): a learned table read at "
                "every (query, key) pair, such as a relative position bias; a score function reads its tensors at "
                "b, h, q or kv and takes no gradient for them, so the site runs dense")
        if len(seq_dims) > 1:
            raise Unextractable(
                f"a stored [query, key] mask tensor ({node.name}, {node.op} "
                f"{getattr(node.target, '__name__', node.target)}, shape {tuple(v.shape)}): a tensor with a query "
                "and a key dim whose values are data, not computed from positions and per-token values in the graph; "
                "build the mask from positions and per-token values (e.g. torch.arange(n)[:, None] >= "
                "torch.arange(n)[None, :], doc[:, :, None] == doc[:, None, :]), use flex_attention with a mask_mod, "
                "or pass is_causal=True")
        if self.anchor is not None and v.requires_grad:
            raise Unextractable(f"the score function reads {node.name}, which needs a gradient (a learned bias or "
                                "slope); the tensors of a score function take none")
        if node in self.from_scores():
            name = getattr(node.target, "__name__", node.target)
            raise Unextractable(f"the scores go through {name} ({node.name}), which the walk does not read")
        if node not in self.leaves:
            self.leaves.append(node)
        k = self.leaves.index(node)
        axes = self.axes_of(node)
        return Val(("load", k, tuple(_c(0) if a is None else ("ax", a) for a in axes)), axes)

    def _node(self, node: torch.fx.Node) -> Any:
        if node is self.anchor:
            return self._score(node)
        if node.op in ("placeholder", "get_attr"):
            return self._leaf(node)
        if node.op not in ("call_function", "call_method"):
            raise Unextractable(f"the mask is built by {node.op} {node.target}")
        t, args, kw = node.target, node.args, node.kwargs
        v = fake(node)
        if not isinstance(v, torch.Tensor):
            if isinstance(v, (bool, int, float)):
                return v
            return self._leaf(node)
        for name, group in BINARY.items():
            if _target_in(t, group):
                return self._pointwise(node, name, args[0], args[1] if len(args) > 1 else kw.get("other"))
        if _target_in(t, RSUB):
            return self._pointwise(node, "sub", args[1] if len(args) > 1 else kw.get("other"), args[0])
        if _target_in(t, RADD) or _target_in(t, RMUL):
            return self._pointwise(node, "add" if t in RADD else "mul", args[1], args[0])
        for name, group in UNARY.items():
            if _target_in(t, group):
                return self._pointwise(node, name, args[0])
        for name, group in FLOAT_UNARY.items():
            if _target_in(t, group):
                return self._pointwise(node, name, args[0])
        if _target_in(t, TRUEDIV):
            return self._pointwise(node, "div", args[0], args[1] if len(args) > 1 else kw.get("other"))
        if _target_in(t, DIV):
            mode = kw.get("rounding_mode", args[2] if len(args) > 2 else None)
            if mode == "floor":
                return self._pointwise(node, "floordiv", args[0], args[1])
            if mode is None:
                return self._pointwise(node, "div", args[0], args[1] if len(args) > 1 else kw.get("other"))
            return self._leaf_or_fail(node, f"division with rounding_mode={mode!r}")
        if _target_in(t, MASK_FROM_FN):
            return self._mask_from_fn(node)
        if t is ADD_BATCH_DIM:
            return self._add_batch_dim(node)
        if t is REMOVE_BATCH_DIM:
            return self._remove_batch_dim(node)
        if _target_in(t, REPEAT):
            return self._repeat(node)
        if _target_in(t, ARANGE):
            return self._arange(node)
        if _target_in(t, CUMSUM):
            return self._cumsum(node)
        if _target_in(t, KEEP):
            return self._same(node, self.eval(args[0]))
        if _target_in(t, CAST):
            return self._cast(node, self.eval(args[0]))
        if _target_in(t, EXPAND):
            return self._expand(node, self.eval(args[0]))
        if _target_in(t, RESHAPE):
            return self._reshape(node, args[0])
        if t is operator.getitem:
            return self._getitem(node)
        if _target_in(t, INDEX):
            return self._index(node, args[0], (slice(None),) * 0 + tuple(args[1]))
        if _target_in(t, SLICE):
            return self._aten_slice(node)
        if _target_in(t, SELECT):
            return self._aten_select(node)
        if _target_in(t, FULL_LIKE):
            return self._const(node, FULL_LIKE[t])
        if _target_in(t, FULL):
            value = kw.get("fill_value", args[-1] if t not in ("new_full",) else args[2] if len(args) > 2 else None)
            if not isinstance(value, (int, float, bool)):
                raise Unextractable(f"{node.name}: full() with a value that is not a constant ({value!r})")
            return self._const(node, value)
        if _target_in(t, SCALAR_TENSOR) and args and isinstance(args[0], (int, float, bool)):
            return self._const(node, args[0])
        if _target_in(t, TRIL) or _target_in(t, TRIU):
            return self._band(node, upper=_target_in(t, TRIU))
        if _target_in(t, MASKED_FILL):
            x, m, value = args[0], args[1], args[2] if len(args) > 2 else kw.get("value")
            return self._pointwise(node, "where", m, value, x)
        if _target_in(t, WHERE):
            if len(args) < 3:
                raise Unextractable(f"{node.name}: where() with one argument (nonzero)")
            return self._pointwise(node, "where", args[0], args[1], args[2])
        return self._leaf_or_fail(node, "")

    def _leaf_or_fail(self, node: torch.fx.Node, why: str) -> Val:
        try:
            return self._leaf(node)
        except Unextractable as e:
            name = getattr(node.target, "__name__", node.target)
            raise Unextractable(f"the mask uses {name}{' (' + why + ')' if why else ''} on query x key values, "
                                f"which mask extraction does not read: {e}") from None

    # -- value makers

    def _out(self, node: torch.fx.Node) -> tuple:
        return self.axes_of(node)

    def _align(self, x: Any, out_axes: tuple) -> tuple:
        """x's expression with its axes replaced by the output's (trailing alignment)."""
        if not isinstance(x, Val):
            return _c(x)
        if len(x.axes) > len(out_axes):
            raise Unextractable("an operand has more dims than the result")
        m = {}
        off = len(out_axes) - len(x.axes)
        for d, a in enumerate(x.axes):
            if a is None:
                continue
            o = out_axes[off + d]
            if o is None:
                raise Unextractable("an operand's dim collapses to size 1")
            m[a] = ("ax", o)
        return _subst(x.expr, m)

    def _pointwise(self, node: torch.fx.Node, op: str, *operands) -> Val:
        vals = [self.eval(o) for o in operands]
        if any(v is None for v in vals):
            raise Unextractable(f"{node.name}: a missing operand")
        out = self._out(node)
        exprs = [self._align(v, out) for v in vals]
        return Val(_op(op, *exprs), out)

    def _same(self, node: torch.fx.Node, x: Any) -> Any:
        if not isinstance(x, Val):
            return x
        out = self._out(node)
        return Val(self._align(x, out), out)

    def _cast(self, node: torch.fx.Node, x: Any) -> Any:
        v = fake(node)
        src = fake(node.args[0]) if isinstance(node.args[0], torch.fx.Node) else None
        out = self._out(node)
        e = self._align(x, out)
        if isinstance(src, torch.Tensor) and src.dtype == v.dtype:
            return Val(e, out)
        if v.dtype == torch.bool:
            e = _op("bool", e)
        elif v.dtype.is_floating_point:
            e = _op("float", e)
        else:
            e = _op("int", e)
        return Val(e, out)

    def _const(self, node: torch.fx.Node, value) -> Val:
        v = fake(node)
        value = bool(value) if v.dtype == torch.bool else float(value) if v.dtype.is_floating_point else int(value)
        return Val(_c(value), self._out(node))

    def _cumsum(self, node: torch.fx.Node) -> Val:
        """x.cumsum(d) of an x whose value does not change along d (a mask of ones): x * (i_d + 1).
        Any other cumsum (positions from a padding mask) is a per-token value, a tensor input."""
        x, d = node.args[0], node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
        if not isinstance(x, torch.fx.Node) or not isinstance(d, int) or node.kwargs.get("dtype") is not None:
            return self._leaf(node)
        saved = dict(self.memo), list(self.leaves)
        try:
            val = self.eval(x)
        except Unextractable:
            val = None
        out = self._out(node)
        d = d % len(out)
        if not isinstance(val, Val) or len(self.leaves) != len(saved[1]) or out[d] is None \
                or out[d] in _free_axes(self._align(val, out), set()):
            self.memo, self.leaves = saved  # nothing read on the way is an input of the function
            return self._leaf(node)
        return Val(_op("mul", self._align(val, out), _op("add", ("ax", out[d]), _c(1))), out)

    def _arange(self, node: torch.fx.Node) -> Val:
        args = list(node.args)
        start, step = 0, 1
        if len(args) >= 2:
            start = args[0]
            step = args[2] if len(args) > 2 else node.kwargs.get("step", 1)
        start = node.kwargs.get("start", start)
        if isinstance(start, torch.fx.Node):
            start = fake(start)
        if not isinstance(start, int) or not isinstance(step, int):
            raise Unextractable(f"{node.name}: arange with a start or step that is not a constant")
        out = self._out(node)
        ax = _c(0) if out[0] is None else ("ax", out[0])
        return Val(_op("add", _op("mul", ax, _c(step)), _c(start)), out)

    def _mask_from_fn(self, node: torch.fx.Node) -> Val:
        """Another graph's mask output, read here as the function it carries (Note [Mask outputs]
        in ringcc/sharded.py): its indices are the node's trailing dims b, h, q, kv, and each load
        reads the function's tensor, itself walked, at its operands."""
        fn = maskfn.parse(node.args[0])
        tensors = list(node.args[4:]) + [node.kwargs.get(f"mask_t{i}") for i in range(len(node.args) - 4, 4)]
        out = self._out(node)
        env = {name: _c(0) for name in INDEX_NAMES}
        env.update({name: _c(0) if a is None else ("ax", a) for name, a in zip(INDEX_NAMES[4 - len(out):], out)})
        vals: list = []

        def get(a):
            kind, x = a
            return vals[x] if kind == "v" else env[x] if kind == "i" else a

        for op, args in fn.lines:
            if op != "load":
                vals.append(_op(op, *(get(a) for a in args)))
                continue
            x = self.eval(tensors[args[0][1]])
            idx = [get(a) for a in args[1:]]
            if not isinstance(x, Val) or len(idx) != len(x.axes):
                raise Unextractable(f"{node.name}: a mask function's load of a tensor of another rank")
            vals.append(_subst(x.expr, {a: i for a, i in zip(x.axes, idx) if a is not None}))
        return Val(vals[-1], out)

    def _add_batch_dim(self, node: torch.fx.Node) -> Val:
        """x with dim in_dim hidden as vmap level `level` (Note [Mask extraction]): that dim's
        axis becomes the level's variable, which the matching _remove_batch_dim turns back into
        an axis."""
        base, in_dim, level = node.args
        x = self.eval(base)
        if not isinstance(x, Val) or not isinstance(in_dim, int) or not isinstance(level, int):
            raise Unextractable(f"{node.name}: a vmap batch dim of a number or at a dim that is not a constant")
        in_dim %= len(x.axes)
        out = self._out(node)
        kept = [a for d, a in enumerate(x.axes) if d != in_dim]
        m = {a: ("ax", o) for a, o in zip(kept, out) if a is not None and o is not None}
        if x.axes[in_dim] is not None:
            m[x.axes[in_dim]] = ("ax", ("vmap", level))
        return Val(_subst(x.expr, m), out)

    def _remove_batch_dim(self, node: torch.fx.Node) -> Val:
        """vmap level `level`'s batch back as dim out_dim of the output."""
        base, level, _, out_dim = node.args
        x = self.eval(base)
        out = self._out(node)
        if not isinstance(level, int) or not isinstance(out_dim, int):
            raise Unextractable(f"{node.name}: a vmap output at a level or dim that is not a constant")
        out_dim %= len(out)
        rest = [o for d, o in enumerate(out) if d != out_dim]
        lv = _c(0) if out[out_dim] is None else ("ax", out[out_dim])
        if not isinstance(x, Val):
            return Val(_c(x), out)
        m = {("vmap", level): lv}
        m.update({a: _c(0) if o is None else ("ax", o) for a, o in zip(x.axes, rest) if a is not None})
        return Val(_subst(x.expr, m), out)

    def _expand(self, node: torch.fx.Node, x: Any) -> Any:
        return self._same(node, x)  # new leading dims and widened size-1 dims: trailing alignment

    def _reshape(self, node: torch.fx.Node, base: torch.fx.Node) -> Any:
        """Dims kept in order, size-1 dims inserted or removed, and runs of dims merged into one
        (an index into the merged dim is a mixed-radix number of theirs) or one split into a run
        (the other way round); the merged dims after the first need static sizes."""
        x = self.eval(base)
        if not isinstance(x, Val):
            return x
        src, out = list(fake(base).shape), list(fake(node).shape)
        out_axes = self._out(node)
        real_in = [d for d, s in enumerate(src) if not (isinstance(s, int) and s == 1)]
        real_out = [d for d, s in enumerate(out) if not (isinstance(s, int) and s == 1)]
        m, i, j = {}, 0, 0
        while i < len(real_in) and j < len(real_out):
            si, so = src[real_in[i]], out[real_out[j]]
            if same_size(si, so):
                if x.axes[real_in[i]] is not None:
                    m[x.axes[real_in[i]]] = ("ax", out_axes[real_out[j]])
                i, j = i + 1, j + 1
                continue
            group_in = _run_to(src, real_in, i, so)
            group_out = _run_to(out, real_out, j, si) if group_in is None else None
            if group_in is not None:  # dims real_in[i:i2] merged into out dim real_out[j]
                o = ("ax", out_axes[real_out[j]])
                dims = real_in[i:i + group_in]
                for t, d in enumerate(dims):
                    stride = math.prod(src[e] for e in dims[t + 1:])
                    e = _op("floordiv", o, _c(stride))
                    if t:
                        e = _op("remainder", e, _c(src[d]))
                    if x.axes[d] is not None:
                        m[x.axes[d]] = e
                i, j = i + group_in, j + 1
            elif group_out is not None:  # dim real_in[i] split into out dims real_out[j:j2]
                dims = real_out[j:j + group_out]
                e = _c(0)
                for t, d in enumerate(dims):
                    stride = math.prod(out[f] for f in dims[t + 1:])
                    e = _op("add", e, _op("mul", ("ax", out_axes[d]), _c(stride)))
                if x.axes[real_in[i]] is not None:
                    m[x.axes[real_in[i]]] = e
                i, j = i + 1, j + group_out
            else:
                raise Unextractable(f"{node.name}: a reshape of the mask that regroups dims "
                                    f"({tuple(src)} -> {tuple(out)})")
        if i != len(real_in) or j != len(real_out):
            raise Unextractable(f"{node.name}: a reshape of the mask that regroups dims ({tuple(src)} -> {tuple(out)})")
        return Val(_subst(x.expr, m), out_axes)

    def _repeat(self, node: torch.fx.Node) -> Any:
        """x.repeat(r0, r1, ..): an index into a repeated dim of x's size s is the index mod s."""
        x = self.eval(node.args[0])
        if not isinstance(x, Val):
            return x
        reps = node.args[1] if len(node.args) == 2 and isinstance(node.args[1], (list, tuple)) else node.args[1:]
        src = list(fake(node.args[0]).shape)
        out_axes = self._out(node)
        off = len(out_axes) - len(src)
        m = {}
        for d, a in enumerate(x.axes):
            if a is None:
                continue
            r, o = reps[off + d], out_axes[off + d]
            if not isinstance(r, int) or (r != 1 and not isinstance(src[d], int)):
                raise Unextractable(f"{node.name}: repeat with a count or size that is not a constant")
            m[a] = ("ax", o) if r == 1 else _op("remainder", ("ax", o), _c(src[d]))
        return Val(_subst(x.expr, m), out_axes)

    def _score(self, node: torch.fx.Node) -> Val:
        """The anchor: q.k (a matmul), or baddbmm(bias, q, k^T) = beta * bias + alpha * q.k."""
        out = self._out(node)
        score = ("i", "score")
        if not _target_in(node.target, BADDBMM):
            return Val(score, out)
        args = list(node.args) + [None] * 3
        bias = node.kwargs.get("input", args[0])
        beta, alpha = node.kwargs.get("beta", 1), node.kwargs.get("alpha", 1)
        if not isinstance(beta, (int, float)) or not isinstance(alpha, (int, float)):
            raise Unextractable(f"{node.name}: baddbmm with a beta or alpha that is not a constant")
        b = self._align(self.eval(bias), out)
        return Val(_op("add", _op("mul", b, _c(beta)), _op("mul", score, _c(alpha))), out)

    def _getitem(self, node: torch.fx.Node) -> Any:
        base, idx = node.args
        idx = idx if isinstance(idx, tuple) else (idx,)
        if any(isinstance(i, torch.fx.Node) for i in idx):
            return self._index(node, base, idx)
        if any(isinstance(i, slice) and isinstance(i.start, torch.fx.Node) for i in idx):
            return self._leaf(node)  # a start computed from the length (Note [Mask extraction])
        x = self.eval(base)
        if not isinstance(x, Val):
            raise Unextractable(f"{node.name}: indexing a number")
        src = fake(base).shape
        n_real = sum(1 for i in idx if i is not None and i is not Ellipsis)
        expanded = []
        for i in idx:
            if i is Ellipsis:
                expanded.extend([slice(None)] * (len(src) - n_real))
            else:
                expanded.append(i)
        while sum(1 for i in expanded if i is not None) < len(src):
            expanded.append(slice(None))
        out_axes = self._out(node)
        m, d_in, d_out = {}, 0, 0
        for i in expanded:
            if i is None:
                d_out += 1
                continue
            a = x.axes[d_in]
            if isinstance(i, int):
                if a is not None:
                    m[a] = _c(i if i >= 0 else _concrete(src[d_in], node) + i)
                d_in += 1
                continue
            if not isinstance(i, slice):
                raise Unextractable(f"{node.name}: an index of type {type(i).__name__}")
            start, step = i.start or 0, i.step or 1
            if not isinstance(start, int) or not isinstance(step, int) or step < 1:
                raise Unextractable(f"{node.name}: a slice with a start or step that is not a constant")
            if start < 0:
                start = _concrete(src[d_in], node) + start
            if a is not None:
                o = out_axes[d_out]
                m[a] = _op("add", _op("mul", _c(0) if o is None else ("ax", o), _c(step)), _c(start))
            d_in += 1
            d_out += 1
        return Val(_subst(x.expr, m), out_axes)

    def _aten_slice(self, node: torch.fx.Node) -> Any:
        args = list(node.args) + [0, None, None, 1][len(node.args) - 1:]
        base, dim, start, end, step = args[:5]
        nd = fake(base).dim()
        idx = [slice(None)] * nd
        idx[dim % nd] = slice(start, end, step)
        return self._getitem_of(node, base, tuple(idx))

    def _aten_select(self, node: torch.fx.Node) -> Any:
        base, dim, i = node.args
        nd = fake(base).dim()
        idx = [slice(None)] * nd
        idx[dim % nd] = i
        return self._getitem_of(node, base, tuple(idx))

    def _getitem_of(self, node, base, idx):
        saved = node.args
        node.args = (base, idx)
        try:
            return self._getitem(node)
        finally:
            node.args = saved

    def _index(self, node: torch.fx.Node, base: torch.fx.Node, idx: tuple) -> Val:
        """base[i0, i1, ..] with tensor indices on its leading dims (HF's padding_mask[b, kv])."""
        if any(not isinstance(i, torch.fx.Node) for i in idx):
            raise Unextractable(f"{node.name}: indexing that mixes tensors with slices or None")
        x = self.eval(base)
        if not isinstance(x, Val):
            raise Unextractable(f"{node.name}: indexing a number")
        ivals = [self.eval(i) for i in idx]
        out_axes = self._out(node)
        n_bcast = len(out_axes) - (len(x.axes) - len(idx))
        bcast_axes = out_axes[:n_bcast]
        m = {}
        for d, iv in enumerate(ivals):
            if fake(idx[d]).dtype == torch.bool:
                raise Unextractable(f"{node.name}: boolean-mask indexing")
            a = x.axes[d]
            if a is not None:
                m[a] = self._align(iv, bcast_axes)
        for d in range(len(idx), len(x.axes)):
            a = x.axes[d]
            if a is not None:
                o = out_axes[n_bcast + d - len(idx)]
                m[a] = _c(0) if o is None else ("ax", o)
        return Val(_subst(x.expr, m), out_axes)

    def _band(self, node: torch.fx.Node, upper: bool) -> Val:
        x = self.eval(node.args[0])
        k = node.kwargs.get("diagonal", node.args[1] if len(node.args) > 1 else 0)
        if not isinstance(k, int):
            raise Unextractable(f"{node.name}: tril / triu with a diagonal that is not a constant")
        out = self._out(node)
        e = self._align(x, out)
        row = _c(0) if out[-2] is None else ("ax", out[-2])
        col = _c(0) if out[-1] is None else ("ax", out[-1])
        diff = _op("sub", col, row)
        keep = _op("ge", diff, _c(k)) if upper else _op("le", diff, _c(k))
        zero = _c(False) if fake(node).dtype == torch.bool else _c(0)
        return Val(_op("where", keep, e, zero), out)


def _run_to(sizes: list, dims: list, i: int, total) -> Optional[int]:
    """k >= 2 when the static sizes of dims[i:i + k] multiply to `total` (static), else None."""
    if not isinstance(total, int):
        return None
    prod = 1
    for k in range(i, len(dims)):
        s = sizes[dims[k]]
        if not isinstance(s, int):
            return None
        prod *= s
        if prod == total:
            return k - i + 1 if k > i else None
        if prod > total:
            return None
    return None


def _concrete(size, node) -> int:
    if isinstance(size, int):
        return size
    raise Unextractable(f"{node.name}: a negative index on a dim of symbolic size")


# ---------------------------------------------------------------------------------------
# value sets of additive masks


def _values(e: tuple, depth: int = 0) -> Optional[set]:
    """The finite set of values an expression can take, when its constants say (None: unknown)."""
    tag = e[0]
    if tag == "c":
        return {float(e[1])}
    if tag == "where":
        # where(x != 0, a, x) (masked_fill(x, x.bool(), a)): x is 0 wherever it is kept
        kept = {0.0} if e[1] in (("bool", e[3]), ("ne", e[3], _c(0)), ("ne", e[3], _c(0.0))) else _values(e[3])
        a = _values(e[2])
        return None if a is None or kept is None else a | kept
    if tag in ("float", "int"):
        inner = _values(e[1])
        return {0.0, 1.0} if inner is None and _is_bool(e[1]) else inner
    if tag in ("add", "sub", "mul"):
        a, b = _values(e[1]), _values(e[2])
        if a is None or b is None or len(a) * len(b) > 64:
            return None
        f = {"add": operator.add, "sub": operator.sub, "mul": operator.mul}[tag]
        out = set()
        for x in a:
            for y in b:
                r = f(x, y)
                out.add(-math.inf if r != r else r)  # -inf - -inf style NaN cannot arise from masks; kept finite
        return out
    if tag == "neg":
        a = _values(e[1])
        return None if a is None else {-x for x in a}
    if _is_bool(e):
        return {0.0, 1.0}
    return None


def _is_bool(e: tuple) -> bool:
    return e[0] in ("eq", "ne", "lt", "le", "gt", "ge", "and", "or", "xor", "not", "bool") or \
        (e[0] == "c" and isinstance(e[1], bool))


# ---------------------------------------------------------------------------------------
# entry


def _expression(mask: torch.fx.Node, seq_lengths: tuple, reader: Optional[torch.fx.Node]) -> tuple[tuple, list]:
    """The mask's value, as `reader` sees it, as an expression over the indices b, h, q, kv, and
    the leaves it reads."""
    walk = _Walk(seq_lengths, reader)
    val = walk.eval(mask)
    if not isinstance(val, Val):
        raise Unextractable("the mask is a number")
    nd = len(val.axes)
    if nd < 2 or nd > 4:
        raise Unextractable(f"a mask of {nd} dims (SDPA takes [.., q, kv])")
    m = {a: ("i", name) for a, name in zip(val.axes, INDEX_NAMES[4 - nd:]) if a is not None}
    expr = _subst(val.expr, m)
    if _free_axes(expr, set()):
        raise Unextractable("the mask's value depends on a dim that broadcasting drops")
    return expr, walk.leaves


def extract(mask: torch.fx.Node, seq_lengths: tuple, is_causal: bool, reader: Optional[torch.fx.Node] = None
            ) -> Extracted:
    """The function of the SDPA mask `mask` (as the site `reader` sees it) ANDed with is_causal
    (Note [Mask extraction])."""
    expr, leaves = _expression(mask, seq_lengths, reader)
    fills: tuple = ()
    if fake(mask).dtype != torch.bool:
        values = _values(expr)
        bad = None if values is None else sorted(v for v in values if v != 0 and v > VERY_NEGATIVE)
        if values is None or bad:
            what = "values the graph does not fix" if values is None else f"the values {bad[:4]}"
            raise Unextractable(f"an additive mask with {what}: a score bias, not a mask of 0 and -inf")
        fills = masked_values([v for v in values if v != 0], fake(mask).dtype)
        expr = _op("eq", expr, _c(0.0))
    got = _finish(expr, leaves, is_causal)
    got.fills = fills
    got.keeps_diagonal = _on_diagonal(_op("and", expr, _op("le", KV, Q)) if is_causal else expr, leaves) == _c(True)
    return got


def masked_values(values, dtype: torch.dtype) -> tuple:
    """The masked values of an additive mask in its dtype (a sum of two finite minima is -inf
    there), when one of them is finite (Note [Rows with no key] in runtime/ops.py); else ()."""
    got = tuple(sorted(set(torch.tensor(list(values), dtype=torch.float64).to(dtype).double().tolist())))
    return got if any(math.isfinite(v) for v in got) else ()


_REFLEXIVE = {"eq": True, "le": True, "ge": True, "ne": False, "lt": False, "gt": False}


def _on_diagonal(e: tuple, leaves: list, memo: Optional[dict] = None) -> tuple:
    """e at kv = q, folded (x op x of a comparison is constant where x cannot be NaN: it reads no
    floating-point tensor): _c(True) proves that every row keeps its own key."""
    memo = {} if memo is None else memo
    if e in memo:
        return memo[e]
    tag = e[0]
    if tag == "i":
        out = Q if e == KV else e
    elif tag in ("c", "ax"):
        out = e
    elif tag == "load":
        out = ("load", e[1], tuple(_on_diagonal(a, leaves, memo) for a in e[2]))
    else:
        args = tuple(_on_diagonal(a, leaves, memo) for a in e[1:])
        if tag in _REFLEXIVE and args[0] == args[1] and not _reads_float(args[0], leaves):
            out = _c(_REFLEXIVE[tag])
        else:
            out = _op(tag, *args)
    memo[e] = out
    return out


def _reads_float(e: tuple, leaves: list) -> bool:
    if e[0] == "load":
        return fake(leaves[e[1]]).is_floating_point() or any(_reads_float(a, leaves) for a in e[2])
    if e[0] in ("c", "i", "ax"):
        return e[0] == "c" and isinstance(e[1], float) and e[1] != e[1]
    return any(_reads_float(a, leaves) for a in e[1:])


def describe(mask: torch.fx.Node, seq_lengths: tuple, reader: Optional[torch.fx.Node] = None
             ) -> tuple[MaskFn, list]:
    """The function that gives a mask's values (a bool mask, or an additive one of 0 and at
    most -1e4; its causal part included), as `reader` sees it, and the leaves it reads in the
    order of its tensors: how a mask leaves a graph (Note [Mask outputs] in ringcc/sharded.py)."""
    expr, leaves = _expression(mask, seq_lengths, reader)
    if fake(mask).dtype != torch.bool:
        values = _values(expr)
        if values is None or any(v != 0 and v > VERY_NEGATIVE for v in values):
            raise Unextractable("a float value that is not an additive mask of 0 and at most -1e4")
    _check_loads(expr, leaves)
    fn, used = _emit(expr)
    return fn, [leaves[k] for k in used]


def _finish(expr: tuple, leaves: list, is_causal: bool) -> Extracted:
    """The causal flag split off (Note [Mask extraction]) and the rest as a MaskFn."""
    _check_loads(expr, leaves)
    conj = _conjuncts(expr)
    causal = is_causal or any(_is_causal(c) for c in conj)
    rest = [c for c in conj if not _is_causal(c)]
    if any(c == _c(False) for c in rest):
        raise Unextractable("the mask is always false")
    rest = [c for c in rest if c != _c(True)]
    if not rest:
        return Extracted(None, [], causal)
    body = rest[0]
    for c in rest[1:]:
        body = _op("and", body, c)
    fn, used = _emit(body)
    return Extracted(fn, [leaves[k] for k in used], causal)


def extract_mask_mod(mask_mod: torch.fx.GraphModule, buffers: tuple, seq_lengths: tuple) -> Extracted:
    """The function of a flex_attention site's mask_mod subgraph (dynamo's HOP carries it as a
    graph of 0-d ops over its placeholders b, h, q_idx, kv_idx and the mask_mod's other buffers,
    which are the site's `buffers` in the outer graph)."""
    walk = _Walk(seq_lengths)
    holders = [n for n in mask_mod.graph.nodes if n.op == "placeholder"]
    if len(holders) != 4 + len(buffers):
        raise Unextractable(f"a mask_mod with {len(holders)} inputs for 4 indices and {len(buffers)} buffers")
    for node, name in zip(holders, INDEX_NAMES):
        walk.memo[node] = Val(("i", name), ())
    outer = dict(zip(holders[4:], buffers))
    (ret,) = [n for n in mask_mod.graph.nodes if n.op == "output"]
    res = ret.args[0]
    res = res[0] if isinstance(res, (tuple, list)) and len(res) == 1 else res
    val = walk.eval(res)
    _only_buffers(walk.leaves, outer, "mask_mod")
    if not isinstance(val, Val):
        return Extracted(None, [], False) if bool(val) else _always_false()
    if val.axes:
        raise Unextractable("a mask_mod whose value is not a scalar")
    return _finish(val.expr, [outer.get(n, n) for n in walk.leaves], False)


def _only_buffers(leaves: list, outer: dict, what: str) -> None:
    """The tensors a flex subgraph's function reads are its buffers (an op the walk does not read
    inside the subgraph is no tensor of the outer graph)."""
    for n in leaves:
        if n not in outer:
            name = getattr(n.target, "__name__", n.target)
            raise Unextractable(f"the {what} uses {name} ({n.name}), which the walk does not read")


def _always_false():
    raise Unextractable("the mask is always false")



def _check_loads(expr: tuple, leaves: list, seen: Optional[set] = None) -> None:
    """Every tensor read reads it at most at one position index per load (a stored [q, kv] table
    is data, not a function of per-token values)."""
    seen = set() if seen is None else seen
    if expr in seen:
        return
    seen.add(expr)
    if expr[0] == "load":
        pos = [a for a in expr[2] if _mentions(a, {"q", "kv"})]
        if any(_mentions(a, {"q"}) for a in pos) and any(_mentions(a, {"kv"}) for a in pos):
            raise Unextractable(f"the mask reads {leaves[expr[1]].name} at a query and a key position: a stored "
                                "[q, kv] table, whose values are data")
        for a in expr[2]:
            _check_loads(a, leaves, seen)
    elif expr[0] not in ("c", "i", "ax"):
        for a in expr[1:]:
            _check_loads(a, leaves, seen)


def _mentions(expr: tuple, names: set) -> bool:
    if expr[0] == "i":
        return expr[1] in names
    if expr[0] in ("c", "ax"):
        return False
    if expr[0] == "load":
        return any(_mentions(a, names) for a in expr[2])
    return any(_mentions(a, names) for a in expr[1:])


def _conjuncts(e: tuple) -> list:
    if e[0] == "and":
        return _conjuncts(e[1]) + _conjuncts(e[2])
    return [e]


KV, Q = ("i", "kv"), ("i", "q")


def _is_causal(e: tuple) -> bool:
    """kv <= q in one of its spellings."""
    if e in (("le", KV, Q), ("ge", Q, KV)):
        return True
    if e[0] == "not" and e[1] in (("gt", KV, Q), ("lt", Q, KV)):
        return True
    return e in (("lt", KV, _op("add", Q, _c(1))), ("gt", _op("add", Q, _c(1)), KV))


def _emit(body: tuple, kind: str = "mask") -> tuple[MaskFn, list]:
    """The program of an expression (shared subexpressions once), and the leaves it reads in
    the order of their tensor numbers."""
    lines: list = []
    index: dict = {}
    leaf_ids: dict = {}

    def operand(e):
        if e[0] == "c":
            return ("c", e[1])
        if e[0] == "i":
            return e
        return ("v", emit(e))

    def emit(e) -> int:
        if e in index:
            return index[e]
        if e[0] == "load":
            k = leaf_ids.setdefault(e[1], len(leaf_ids))
            line = ("load", (("t", k),) + tuple(operand(a) for a in e[2]))
        elif e[0] in ("c", "i"):
            line = ("bool" if isinstance(e[1], bool) else "int", (("c", e[1]),)) if e[0] == "c" else ("add", (e, ("c", 0)))
        else:
            line = (e[0], tuple(operand(a) for a in e[1:]))
        lines.append(line)
        index[e] = len(lines) - 1
        return index[e]

    emit(body)
    order = sorted(leaf_ids, key=leaf_ids.get)
    return MaskFn(tuple(lines), len(order), kind), order


# ---------------------------------------------------------------------------------------
# score functions

# Note [Score extraction]
# A site's scores between the q.k product and the softmax (past the mask the site's SDPA call
# takes) are evaluated by the same walk, with the product (the `anchor`: a matmul, or a baddbmm
# whose bias joins the function) read as the operand `score`: whatever elementwise program of
# the score, the indices and per-head or per-token tensors the tracer left (a soft-cap's div,
# tanh and mul, an ALiBi bias of slopes times aranges or times positions counted over a padding
# mask, views that merge heads into the batch and back) becomes one score function
# (runtime/maskfn.py, Note [Score functions]). Nothing is matched by its form. Then the scale:
# when every read of the score is score * c for one constant c, c becomes the site's scale and
# the function reads the scaled score; a function that is the scaled score alone is no function.
# Its tensors are whole-length and replicated, as a mask function's are, and take no gradient.


@dataclass
class ExtractedScore:
    fn: Optional[MaskFn]  # None: the scores are only scaled
    inputs: list  # the tensor inputs t0.. (graph nodes)
    scale: float


SCORE = ("i", "score")


def extract_score(top: torch.fx.Node, anchor: torch.fx.Node, seq_lengths: tuple, outer: float = 1.0,
                  inner: float = 1.0) -> ExtractedScore:
    """The score function of the scores `top` computes from the q.k product `anchor` (Note
    [Score extraction]), times `outer`; `inner`: constants q and k were scaled by before the
    product (the score is q.k * inner)."""
    walk = _Walk(seq_lengths, anchor=anchor)
    val = walk.eval(top)
    if not isinstance(val, Val):
        raise Unextractable("the scores are a number")
    nd = len(val.axes)
    if nd < 3 or nd > 4:
        raise Unextractable(f"scores of {nd} dims")
    names = ("b", "h", "q", "kv")[4 - nd:]
    expr = _subst(val.expr, {a: ("i", name) for a, name in zip(val.axes, names) if a is not None})
    if _free_axes(expr, set()):
        raise Unextractable("the scores depend on a dim that broadcasting drops")
    if outer != 1.0:
        expr = _op("mul", expr, _c(outer))
    if inner != 1.0:
        expr = _subst_score(expr, _op("mul", SCORE, _c(inner)), {})
    _check_loads(expr, walk.leaves)
    if not _mentions(expr, {"score"}):
        raise Unextractable("the softmax does not read the q.k scores")
    scales = _score_scales(expr, set())
    scale = scales.pop() if len(scales) == 1 and 1.0 not in scales else 1.0
    if scale != 1.0:
        expr = _subst_score(expr, SCORE, {}, scale)
    if expr == SCORE:
        return ExtractedScore(None, [], scale)
    fn, used = _emit(expr, "score")
    return ExtractedScore(fn, [walk.leaves[k] for k in used], scale)


def extract_bias(mask: torch.fx.Node, seq_lengths: tuple) -> ExtractedScore:
    """The score function score + m of an SDPA float attn_mask m that is a score bias (values other
    than 0 and -inf: ALiBi or relative-position terms computed from positions and per-token or
    per-head tensors), read by the mask walk."""
    walk = _Walk(seq_lengths)
    walk.anchor = object()  # a score function: its tensors take no gradient
    val = walk.eval(mask)
    if not isinstance(val, Val) or not 2 <= len(val.axes) <= 4:
        raise Unextractable("a float mask that is a number or not [.., q, kv]")
    names = ("b", "h", "q", "kv")[4 - len(val.axes):]
    expr = _subst(val.expr, {a: ("i", name) for a, name in zip(val.axes, names) if a is not None})
    if _free_axes(expr, set()):
        raise Unextractable("the bias depends on a dim that broadcasting drops")
    _check_loads(expr, walk.leaves)
    fn, used = _emit(_op("add", SCORE, expr), "score")
    return ExtractedScore(fn, [walk.leaves[k] for k in used], 1.0)


def _score_scales(e: tuple, acc: set) -> set:
    """The constants c of every read score * c of e (1.0 for a bare read)."""
    if e == SCORE:
        acc.add(1.0)
    elif e[0] == "mul" and SCORE in e[1:] and any(_is_c(a) for a in e[1:]):
        acc.add(float(next(a for a in e[1:] if _is_c(a))[1]))
    elif e[0] == "load":
        for a in e[2]:
            _score_scales(a, acc)
    elif e[0] not in ("c", "i", "ax"):
        for a in e[1:]:
            _score_scales(a, acc)
    return acc


def _subst_score(e: tuple, by: tuple, memo: dict, scaled: Optional[float] = None) -> tuple:
    """e with each read of the score (with `scaled`: each score * scaled) replaced by `by`."""
    if e in memo:
        return memo[e]
    if scaled is None and e == SCORE:
        out = by
    elif scaled is not None and e[0] == "mul" and SCORE in e[1:] and any(_is_c(a) and a[1] == scaled for a in e[1:]):
        out = by
    elif e[0] in ("c", "i", "ax"):
        out = e
    elif e[0] == "load":
        out = ("load", e[1], tuple(_subst_score(a, by, memo, scaled) for a in e[2]))
    else:
        out = _op(e[0], *(_subst_score(a, by, memo, scaled) for a in e[1:]))
    memo[e] = out
    return out


def extract_score_mod(score_mod: torch.fx.GraphModule, buffers: tuple, seq_lengths: tuple) -> ExtractedScore:
    """The score function of a flex_attention site's score_mod subgraph (dynamo's HOP carries it
    as a graph of 0-d ops over its placeholders score, b, h, q_idx, kv_idx and the score_mod's
    other buffers, which are the site's `buffers` in the outer graph)."""
    walk = _Walk(seq_lengths)
    walk.anchor = object()  # a score function: its tensors take no gradient
    holders = [n for n in score_mod.graph.nodes if n.op == "placeholder"]
    if len(holders) != 5 + len(buffers):
        raise Unextractable(f"a score_mod with {len(holders)} inputs for the score, 4 indices and {len(buffers)} "
                            "buffers")
    walk.memo[holders[0]] = Val(SCORE, ())
    for node, name in zip(holders[1:5], INDEX_NAMES):
        walk.memo[node] = Val(("i", name), ())
    outer = dict(zip(holders[5:], buffers))
    (ret,) = [n for n in score_mod.graph.nodes if n.op == "output"]
    res = ret.args[0]
    res = res[0] if isinstance(res, (tuple, list)) and len(res) == 1 else res
    val = walk.eval(res)
    _only_buffers(walk.leaves, outer, "score_mod")
    if not isinstance(val, Val) or val.axes:
        raise Unextractable("a score_mod whose value is not a scalar function of the score")
    leaves = [outer.get(n, n) for n in walk.leaves]
    for n in leaves:
        if isinstance(fake(n), torch.Tensor) and fake(n).requires_grad:
            raise Unextractable(f"the score_mod reads {n.name}, which needs a gradient (a learned bias or slope); "
                                "the tensors of a score function take none")
    _check_loads(val.expr, leaves)
    if val.expr == SCORE:
        return ExtractedScore(None, [], 1.0)
    fn, used = _emit(val.expr, "score")
    return ExtractedScore(fn, [leaves[k] for k in used], 1.0)
