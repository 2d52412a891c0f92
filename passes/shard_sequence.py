"""Shard the sequence: propagate a per-value sequence state with an explicit rule table and
rewrite the graph so that every rank computes only its n/p tokens.

Note [Sequence state]
Every tensor value gets a state: None (no sequence dim: weights, scalars, pooled values) or
Seq(dim, outer, length, start, sharded).
- dim: the tensor dim that carries the sequence; outer: batch elements merged in front of
  the sequence inside that dim (`logits.view(-1, V)` has outer = b), the sequence being the
  inner factor.
- Replicated (sharded=False): every rank holds the full value of `length` tokens (ids,
  labels, positions, masks: cheap). They stay replicated through cheap ops, so that shifts
  and pads across shard boundaries stay right, and are sliced with ringcc::shard where they
  first feed per-token work or meet a shard.
- Sharded: every rank holds its n/p rows (in the graph's layout) of a full-length value;
  the logical value is the window [start, start + length) of the n global tokens
  (`logits[:, :-1]` keeps every row and narrows the window: rows outside it are garbage that
  only window-aware consumers see: cross_entropy pads its targets with ignore_index there,
  outputs are narrowed after the gather).
Sizes are sympy expressions (the sequence length n may be a symbol under dynamic shapes);
sequence dims are followed through the shape flow, never found by "a dim equal to n" inside
the graph (only for values created from no sequence input: factories, buffer slices, cats,
and views that make a new dim of size n; a view keeping a dim its input had, such as a patch
embedding's channels equal to n flattened over the patches, creates none).

Note [Padding]
With Config(pad=True) a length n that the layout does not divide (p, or 2p for zigzag) is
padded to N, the next multiple: shards hold N/p rows and every value's window is [0, n), so
the padded rows are garbage rows as above. Attention masks the padded keys (causal
attention never sees them from a real query; otherwise a key_valid mask is added or
extended with False), reductions zero the rows outside the window, cross_entropy ignores
them, and outputs are narrowed back to n after the gather. A symbolic n (dynamic shapes) is
not padded: Config(pad=True) is an error there that names torch.compile(dynamic=False).

Rules (RULES below) say for each op how states map from inputs to the output and what the
op needs: token-local ops keep a shard; reductions over the sequence become a local
reduction + ringcc::all_reduce_sum (mean = global sum / global count, cross_entropy with
ignore_index); selecting one token becomes ringcc::seq_select; a mixture of experts' routing
and dispatch (sorts, grouped matmuls) run on each rank's own rows (Note [Rank-local rows]);
anything else that mixes tokens gets an all-gather (recorded in the report as O(n)). Sharded
graph outputs leave the graph as shards (Note [Sharded outputs] in ringcc/sharded.py), or
gathered under Config(gather_outputs=True).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, replace
from typing import Any, Callable, Optional

import sympy
import torch
import torch.fx

import ringcc.runtime.seqops  # noqa: F401 - registers ringcc::all_reduce_sum, seq_select, sync_grads
from ringcc import _compat
from ringcc.report import Gather
from ringcc.runtime import layout as L

from .base import (PassContext, PassResult, attr_value, is_view, location, op_name, remove_dead, tag,
                   writes_in_place, written_between, written_through)
from .canonicalize_attention import MATMUL_FUNCS, MATMUL_METHODS
from .discover_sequence import attention_nodes, expr, fake, handoff_gathers

PASS = "shard_sequence"
STATE_META = "ringcc_seq"  # the node's Seq state (tests read it)

SHARD = torch.ops.ringcc.shard.default
KEY_RUNS = torch.ops.ringcc.key_runs.default
BALANCE_PLAN = torch.ops.ringcc.balance_plan.default
GATHER = torch.ops.ringcc.gather.default
ALL_REDUCE = torch.ops.ringcc.all_reduce_sum.default
SELECT = torch.ops.ringcc.seq_select.default
SEQ_CUMSUM = torch.ops.ringcc.seq_cumsum.default
# factories of one value (dynamo's and export's spellings): their shard is a local fill
_FILLS = (torch.ones, torch.zeros, torch.full, torch.ops.aten.ones.default, torch.ops.aten.zeros.default,
          torch.ops.aten.full.default)
PAD_REMEDY = "Config(pad=True) to pad it with masked tokens"


@dataclass(frozen=True)
class Seq:
    """See Note [Sequence state]."""

    dim: int
    length: sympy.Expr
    outer: sympy.Expr = sympy.Integer(1)
    start: sympy.Expr = sympy.Integer(0)
    sharded: bool = False
    # Note [Rank-local rows]: rows per token merged after the sequence inside dim (a token's
    # top-k routing slots), the rank-local sort the rows are ordered by (None: token order),
    # and what an integer value's entries are ((kind, sort); None: data)
    inner: sympy.Expr = sympy.Integer(1)
    order: Optional[torch.fx.Node] = None
    index: Optional[tuple] = None

    def at(self, dim: int) -> "Seq":
        return replace(self, dim=dim)

    @property
    def local_rows(self) -> bool:
        """Rows that only this rank's own computation can read (Note [Rank-local rows])."""
        return not _eq(self.inner, 1) or self.order is not None or self.index is not None


@dataclass(frozen=True)
class Partial:
    """A sum over this rank's tokens only (Note [Rank-local rows]): summed over the ranks
    (ringcc::all_reduce_sum) where it is read as a global value, kept as it is where it
    describes the rank's own rows `rows` (grouped_mm's group offsets)."""

    rows: Seq
    keys: Optional[torch.fx.Node] = None  # the sort whose sorted values it counts
    sharded: bool = True  # rank-local: what computes on it computes on shards


State = Optional[Seq]


class Fallback(Exception):
    """A rule cannot keep its sharded inputs sharded: gather them (O(n), recorded)."""


class _Unclosed(Exception):
    """A value in a rank-local order would need a gather (Note [Rank-local rows]): raised in the
    dry run, after which the walk runs with local sorts off."""


def _local_rows(st) -> bool:
    if isinstance(st, tuple):
        return any(_local_rows(s) for s in st)
    return isinstance(st, Partial) or (isinstance(st, Seq) and st.local_rows)


def _zero(e) -> bool:
    e = sympy.sympify(e)
    return e == 0 if e.is_Number else sympy.expand(e) == 0  # expand: simplify is slow on many sizes


def _eq(a, b) -> bool:
    return _zero(expr(a) - expr(b)) if not isinstance(a, sympy.Expr) or not isinstance(b, sympy.Expr) else _zero(a - b)


def _prod(xs) -> sympy.Expr:
    out = sympy.Integer(1)
    for x in xs:
        out = out * expr(x)
    return out


def _arg(node: torch.fx.Node, i: int, name: str, default=None):
    if len(node.args) > i:
        return node.args[i]
    return node.kwargs.get(name, default)


def _set_arg(node: torch.fx.Node, i: int, name: str, value) -> None:
    if len(node.args) > i:
        args = list(node.args)
        args[i] = value
        node.args = tuple(args)
    else:
        node.kwargs = {**node.kwargs, name: value}


def _is_tensor_node(a) -> bool:
    return isinstance(a, torch.fx.Node) and isinstance(fake(a), torch.Tensor)


# ---------------------------------------------------------------------------------------
# the walk


class Sharder:
    def __init__(self, gm: torch.fx.GraphModule, ctx: PassContext, local_order: bool = False):
        info = ctx.scratch["seq"]
        # sorts of a rank's own rows stay local (Note [Rank-local rows]); off, they gather
        self.local_order = local_order
        self._partials: dict[torch.fx.Node, torch.fx.Node] = {}
        self.gm, self.ctx, self.graph = gm, ctx, gm.graph
        self.n: sympy.Expr = info.n  # the sequence length
        self.sources = info.sources
        self.p = ctx.world_size
        self.handoffs = {g: g.args[0] for g in handoff_gathers(gm, ctx)}
        self._taken: list[torch.fx.Node] = []  # handoff gathers whose shard is taken as is
        sites = attention_nodes(gm)
        self.layout = (ctx.scratch.get("layout") if sites else None) or _resolve_layout(ctx, sites, self.handoffs)
        self.N: sympy.Expr = self._padded_length(ctx)  # rows held by all ranks together
        ctx.scratch["layout"] = self.layout
        self.comm = (ctx.group_name, ctx.world_size, self.layout)
        self.state: dict[torch.fx.Node, Any] = {}
        self.cur: torch.fx.Node | None = None
        # Shards and gathers are made where first read and reused by later readers, within one
        # grad mode: one made under torch.no_grad() carries no gradient to a reader outside it
        self._grad_mode: bool | None = None  # the last _set_grad_enabled's (None: the caller's)
        self._shards: dict[tuple, torch.fx.Node] = {}
        self._gathers: dict[tuple, torch.fx.Node] = {}
        self._key_runs: dict[torch.fx.Node, torch.fx.Node] = {}
        self._plans: dict[tuple, torch.fx.Node] = {}
        self.decisions: list[str] = []
        # dynamo passes every symbol as a SymInt input: sizes rebuilt in the graph use them
        self._symbols = {expr(fake(p)): p for p in gm.graph.nodes
                         if p.op == "placeholder" and isinstance(fake(p), torch.SymInt)}

    # -- helpers used by rules ------------------------------------------------------

    def _padded_length(self, ctx: PassContext) -> sympy.Expr:
        """n, or n rounded up to the layout's divisor under Config(pad=True) (Note [Padding])."""
        div = L.divisor(self.p, L.Layout(self.layout))
        if not self.n.is_Integer:
            if not ctx.config.pad or div == 1 or ctx.config.world_size is not None:
                return self.n  # checked at run time by ringcc::shard (offline tools: when run)
            # Padded to div * FloorDiv(n + div - 1, div), every size after the shard is an
            # expression that aot_autograd's tracing of a small GPT did not finish in minutes.
            raise ValueError(
                f"Config(pad=True) pads lengths known at compile time; this graph was traced with a symbolic "
                f"sequence length {self.n} (torch.compile(dynamic=True), or automatic dynamic shapes after a "
                f"second length). Compile with torch.compile(..., dynamic=False) so that each length is padded "
                f"to a multiple of {div}, or pass lengths that are multiples of {div} and drop pad=True")
        if int(self.n) % div == 0:
            return self.n
        if not ctx.config.pad:
            L.check_length(int(self.n), self.p, self.layout, remedy=PAD_REMEDY)
        padded = -(-int(self.n) // div) * div
        ctx.report.notes.append(f"sequence of {int(self.n)} tokens padded to {padded} (a multiple of {div})")
        return sympy.Integer(padded)

    def full(self, st: Seq) -> bool:
        """Every row of the shard is a token of the value (no garbage rows)."""
        return _zero(st.start) and _eq(st.length, self.N)

    def size(self, e) -> "int | torch.fx.Node":
        """A size for a graph argument: an int, or nodes computing it from the SymInt inputs."""
        e = expr(e)
        if e.is_Integer:
            return int(e)
        if e in self._symbols:
            return self._symbols[e]
        ops = {sympy.Mul: operator.mul, sympy.Add: operator.add}
        if type(e) in ops:
            args = [self.size(a) for a in e.args]
            out = args[0]
            for a in args[1:]:
                out = self.new(ops[type(e)], out, a)
            return out
        if type(e).__name__ == "FloorDiv":
            return self.new(operator.floordiv, self.size(e.args[0]), self.size(e.args[1]))
        raise Fallback(f"no graph input gives the size {e}")

    def local_rows(self) -> "int | torch.fx.Node":
        """The rows of a shard along its sequence dim, N / p, as a graph argument."""
        return int(self.N) // self.p if self.N.is_Integer else self.new(operator.floordiv, self.size(self.N), self.p)

    def new(self, target, *args, method: bool = False, **kwargs) -> torch.fx.Node:
        with self.graph.inserting_before(self.cur):
            node = (self.graph.call_method(target, args, kwargs) if method
                    else self.graph.call_function(target, args, kwargs))
        return tag(node, PASS, self.cur)

    def shard(self, src: torch.fx.Node, st: Seq, window: Seq | None = None, pad_value=0) -> torch.fx.Node:
        """This rank's rows of replicated `src`, aligned with a sharded `window`."""
        start = window.start if window is not None else sympy.Integer(0)
        if window is not None and not _eq(window.length, st.length):
            raise Fallback(f"lengths {st.length} and {window.length} do not match")
        front, back = start, self.N - start - st.length
        if not (front.is_Integer and back.is_Integer) or front < 0 or back < 0:
            raise Fallback(f"a replicated value of length {st.length} cannot be aligned with the shards")
        key = (src, st.dim, int(front), int(back), pad_value, self._grad_mode)
        if key in self._shards and not written_between(src, self._shards[key], self.cur):
            return self._shards[key]  # (a write to src in between needs a new shard)
        # Every node made here gets its state: a shard without one would read as a replicated
        # value consumed by sharded work, whose cotangent sync_param_grads all-reduces.
        local = self._local_fill(src, st) if not (front or back) else None
        if local is not None:
            self._shards[key] = local
            return local
        x, d = src, st.dim
        if not _eq(st.outer, 1):
            x, d = self.new("unflatten", x, d, (self.size(st.outer), -1), method=True), d + 1
            self.state[x] = Seq(d, st.length)
        if front or back:
            # cat with filled blocks, not F.pad: F.pad's fake guards on the (symbolic) length
            pieces = ([self._fill(x, d, int(front), pad_value)] if front else []) + [x] + \
                ([self._fill(x, d, int(back), pad_value)] if back else [])
            x = self.new(torch.cat, pieces, d)
            self.state[x] = Seq(d, self.N)
        x = self.new(SHARD, x, d, *self.comm)
        self.state[x] = Seq(d, st.length, start=front, sharded=True)
        if not _eq(st.outer, 1):
            x = self.new("flatten", x, d - 1, d, method=True)
            self.state[x] = Seq(st.dim, st.length, st.outer, start=front, sharded=True)
        self._shards[key] = x
        self.decisions.append(f"shard {src.name}@{st.dim}+{int(front)}-{int(back)}")
        return x

    def _local_fill(self, src: torch.fx.Node, st: Seq) -> torch.fx.Node | None:
        """The shard of a constant fill (torch.ones(b, n): OPT's default mask) is the same fill
        at this rank's size, made here instead of sliced from n rows (None: not such a fill).
        Under a symbolic length the rank's size is n // p (ringcc::shard checks at run time
        that the layout divides n), the other sizes as the fill has them (ints or SymInts)."""
        if src.op != "call_function" or src.target not in _FILLS or not _eq(st.outer, 1):
            return None
        args = list(src.args)
        sized = len(args) >= 1 and isinstance(args[0], (tuple, list, torch.Size))
        sizes = list(args[0]) if sized else (args if src.target is not torch.full else [])
        rest = args[1:] if sized else []
        if len(sizes) != fake(src).dim() or \
                not all(isinstance(v, int) or (isinstance(v, torch.fx.Node) and isinstance(fake(v), torch.SymInt))
                        for v in sizes) or \
                any(isinstance(v, torch.fx.Node) for v in list(rest) + list(src.kwargs.values())):
            return None
        try:
            sizes[st.dim] = self.local_rows()
        except Fallback:
            return None
        x = self.new(src.target, tuple(sizes), *rest, **src.kwargs)
        self.state[x] = Seq(st.dim, st.length, sharded=True)
        self.decisions.append(f"fill {src.name}@{st.dim} locally")
        return x

    def _fill(self, x: torch.fx.Node, d: int, k: int, value) -> torch.fx.Node:
        """k rows of `value` shaped like x's rows along d; x may have fewer than k rows (n = 1
        padded to 2p: one filled row, repeated)."""
        row = self.new(torch.full_like, self.new("narrow", x, d, 0, 1, method=True), value)
        return self.new(torch.repeat_interleave, row, k, dim=d)

    def gather(self, src: torch.fx.Node, st: Seq, why: str) -> torch.fx.Node:
        """The full value of sharded `src` on every rank (O(n): recorded)."""
        key = (src, self._grad_mode)
        if key in self._gathers:
            return self._gathers[key]
        if st.order is not None:
            raise _Unclosed(f"{src.name} is in a rank-local order ({why})")
        x, d = src, st.dim
        if not _eq(st.outer, 1):
            x, d = self.new("unflatten", x, d, (self.size(st.outer), -1), method=True), d + 1
            self.state[x] = Seq(d, st.length, start=st.start, sharded=True)
        x = self.new(GATHER, x, d, *self.comm)
        self.state[x] = Seq(d, self.N)
        if not self.full(st):
            x = self.new("narrow", x, d, self.size(st.start), self.size(st.length), method=True)
            self.state[x] = Seq(d, st.length)
        if not _eq(st.outer, 1):
            x = self.new("flatten", x, d - 1, d, method=True)
        self._gathers[key] = x
        self.state[x] = replace(st, sharded=False, start=sympy.Integer(0))
        where = location(self.cur if self.cur.op != "output" else src)
        self.ctx.report.gathers.append(Gather(node=x.name, location=where, why=why))
        self.decisions.append(f"gather {src.name}@{st.dim}: {why}")
        return x

    def localize(self, node: torch.fx.Node, arg: torch.fx.Node, st: Seq, window: Seq | None, pad_value=0):
        """Replace replicated input `arg` of `node` by its shard. A node that writes `arg` in
        place runs on the replicated value instead: a write into the shard, a copy, would not
        reach `arg` and the values that share its storage."""
        if writes_in_place(node, arg):
            raise Fallback("writes a replicated value in place")
        node.replace_input_with(arg, self.shard(arg, st, window, pad_value))

    def seq_of_size(self, val: torch.Tensor, along: int | None = None) -> State:
        """A replicated sequence state for a value created from no sequence input: its one
        dim whose size is n; of several, the dim `along` which a cat makes it (a [CLS] token
        catted onto patch embeddings whose width is n too); else None."""
        dims = [d for d in range(val.dim()) if _eq(val.shape[d], self.n)]
        if len(dims) > 1 and along in dims:
            dims = [along]
        if len(dims) == 1 and not _eq(self.n, 1):
            return Seq(dims[0], self.n)
        return None

    def _keeps_long_dims(self, node: torch.fx.Node) -> bool:
        """A view or expand whose input already has as many dims of size n as its output: it
        makes no dim of that size, it keeps one its input had without a sequence state (a
        patch embedding's channels equal to n, flattened over the patches; a learned token
        expanded over the batch): no sequence is created there."""
        x = node.args[0]
        if not _is_tensor_node(x):
            return False
        count = lambda val: sum(_eq(s, self.n) for s in val.shape)  # noqa: E731
        return count(fake(node)) <= count(fake(x))

    # -- the walk --------------------------------------------------------------------

    def run(self) -> None:
        for node in list(self.graph.nodes):
            self.cur = node
            if node.op == "placeholder":
                dim = self.sources.get(node.name)
                self.state[node] = None if dim is None else Seq(dim, expr(fake(node).shape[dim]))
            elif node in self.handoffs:
                self.state[node] = self._handoff(node)
            elif node.op == "output":
                self._outputs(node)
            elif node.op in ("call_function", "call_method"):
                if op_name(node) in _GRAD_MODE and isinstance(node.args[0], bool):
                    self._grad_mode = node.args[0]
                self.state[node] = self._visit(node)
            else:
                self.state[node] = None
        for node in self._taken:
            node.replace_all_uses_with(node.args[0])
            self.state[node.args[0]] = self.state.pop(node)
        for node, st in self.state.items():
            if isinstance(st, (Seq, tuple, Partial)) and node.graph is self.graph:
                node.meta[STATE_META] = st

    def _handoff(self, node: torch.fx.Node) -> State:
        """A gather of another ringcc graph's sharded output (Note [Sharded outputs]): its
        shard is this graph's shard when the layouts and lengths agree, and the gather goes."""
        local, dim = node.args[0], node.args[1]
        if node.args[4] != self.layout or not _eq(fake(node).shape[dim], self.N):
            why = (f"input {local.name} is sharded in the {node.args[4]} layout and this graph's is "
                   f"{self.layout}" if node.args[4] != self.layout else f"input {local.name} has another length")
            self.ctx.report.gathers.append(Gather(node=node.name, location=location(node), why=why))
            self.decisions.append(f"gather {node.name}: {why}")
            return self.seq_of_size(fake(node))
        # the rules read the gather's (global) fake; its uses move to the shard after the walk
        self._taken.append(node)
        self.decisions.append(f"handoff {local.name}@{dim}")
        return Seq(dim, self.N, sharded=True)

    def _visit(self, node: torch.fx.Node):
        name = op_name(node)
        for a in node.all_input_nodes:
            if isinstance(self.state.get(a), Partial) and name not in _PARTIAL_OPS:
                node.replace_input_with(a, self.materialize(a))
        ins = [a for a in node.all_input_nodes if isinstance(self.state.get(a), (Seq, tuple, Partial))]
        rule = RULES.get(name)
        if any(_local_rows(self.state.get(a)) for a in ins):
            rule = ROWS_RULES.get(name)
            if rule is None:
                return self._fallback(node, f"no rule for {name} on rows in a rank-local order")
        if not ins and name not in _ATTENTION_ARGS:  # attention shards its q/k/v whatever their state
            if rule is not None and rule.creates and isinstance(fake(node), torch.Tensor) \
                    and not (rule.unary and self._keeps_long_dims(node)):
                along = _norm_dim(_arg(node, 1, "dim", 0), fake(node).dim()) if name in ("cat", "concat") else None
                return self.seq_of_size(fake(node), along)
            return None
        if rule is None:
            return self._fallback(node, f"no sharding rule for {name}")
        if rule.unary and self.state.get(node.args[0]) is None:
            return self._fallback(node, f"{name}: sequence in a size argument")
        try:
            st = rule.fn(self, node)
        except Fallback as e:
            return self._fallback(node, f"{name}: {e}")
        if isinstance(st, Seq) and st.sharded:
            self.decisions.append(f"{node.name}:S{st.dim}")
        return st

    def materialize(self, src: torch.fx.Node) -> torch.fx.Node:
        """The global value of a Partial (Note [Rank-local rows]): its sum over the ranks."""
        if src not in self._partials:
            with self.graph.inserting_after(src):
                red = tag(self.graph.call_function(ALL_REDUCE, (src, *self.comm[:2])), PASS, src)
            self.state[red] = None
            self._partials[src] = red
            self.decisions.append(f"{src.name}: all_reduce rank-local sum")
        return self._partials[src]

    def _fallback(self, node: torch.fx.Node, why: str):
        """Run `node` on full values: gather its sharded inputs. A node that writes a gathered
        input in place (`x[i] = v`), itself or through a view it makes of it (`x[:, i] += v`),
        writes the gathered copy: the later readers of the shard read that copy instead."""
        gathered = [(a, self.state[a]) for a in node.all_input_nodes
                    if isinstance(self.state.get(a), Seq) and not self.state[a].sharded]
        if op_name(node) in _COMM_ARGS:  # attention over full values on every rank: one rank's ring
            _set_comm(node, [self.comm[0], 1, "contiguous"])
        for a in list(node.all_input_nodes):
            st = self.state.get(a)
            if isinstance(st, Partial):
                node.replace_input_with(a, self.materialize(a))
            elif isinstance(st, Seq) and st.sharded:
                gathered.append((a, st))
                full = self.gather(a, st, why)
                node.replace_input_with(a, full)
                if writes_in_place(node, full) or (is_view(node) and node.args[0] is full and written_through(node)):
                    full.meta.setdefault("example_value", fake(a))  # the rules read global shapes
                    later, cur = set(), node.next
                    while cur.op != "root":
                        later.add(cur)
                        cur = cur.next
                    for u in list(a.users):
                        if u in later:
                            u.replace_input_with(a, full)
            elif isinstance(st, tuple) and any(s is not None and s.sharded for s in st):
                if any(s is not None and s.order is not None for s in st):
                    raise _Unclosed(f"{a.name} is in a rank-local order ({why})")
                raise ValueError(f"ringcc cannot run {node.format_node()} on a sharded tuple ({why})")
        val = fake(node)
        if isinstance(val, (tuple, list)):  # (values, indices) of cummax, sort, ...
            return tuple(self._gathered_state(v, gathered) if isinstance(v, torch.Tensor) else None for v in val)
        return self._gathered_state(val, gathered) if isinstance(val, torch.Tensor) else None

    def _gathered_state(self, val: torch.Tensor, gathered: list[tuple[torch.fx.Node, Seq]]) -> State:
        """The replicated state of an op run on full inputs: the sequence dim of a full
        (gathered or replicated) input that the output keeps at the same place and size (an op
        over [b*n, E] rows that keeps the b*n rows), else the output's one dim of size n. A
        full-length value left without a state would read as a table without a sequence (a
        weight), whose rows a shard's own indices would then pick from all n tokens."""
        for a, st in gathered:
            if st.dim < val.dim() and _eq(val.shape[st.dim], fake(a).shape[st.dim]) and \
                    sum(_eq(size, val.shape[st.dim]) for size in val.shape) == 1:  # another dim of that size: a tie
                return replace(st, sharded=False, start=sympy.Integer(0), index=None)
        return self.seq_of_size(val)

    def _outputs(self, node: torch.fx.Node) -> None:
        """Sharded outputs leave the graph as shards, each with its window in
        ctx.scratch["sharded_outputs"] (output index -> (dim, rows before, rows after, batch rows
        merged in front)) for the backend to wrap (Note [Sharded outputs], ringcc/sharded.py);
        gathered to full length under Config(gather_outputs=True)."""
        specs: dict[int, tuple[int, int, int, int]] = {}
        flat = node.args[0] if len(node.args) == 1 and isinstance(node.args[0], (tuple, list)) else None

        def visit(a, index=None):
            if not isinstance(a, torch.fx.Node):
                return a
            st = self.state.get(a)
            if isinstance(st, Partial):
                return self.materialize(a)
            if not (isinstance(st, Seq) and st.sharded):
                return a
            if st.local_rows:
                return self.gather(a, st, "graph output with several rows per token")
            if self.ctx.config.gather_outputs:
                return self.gather(a, st, "graph output (Config(gather_outputs=True))")
            front, back = st.start, self.N - st.start - st.length
            if index is None:
                return self.gather(a, st, "graph output nested in a container")
            if not sympy.sympify(st.outer).is_Integer:
                return self.gather(a, st, f"graph output with {st.outer} batch rows merged into its sequence dim")
            if not (sympy.sympify(front).is_Integer and sympy.sympify(back).is_Integer):
                return self.gather(a, st, f"graph output with a window of symbolic offset ({front}, {back})")
            specs[index] = (st.dim, int(front), int(back), int(st.outer))
            self.decisions.append(f"output {index} {a.name}@{st.dim}+{int(front)}-{int(back)}")
            return a

        if flat is not None:
            node.args = (type(flat)(visit(a, i) for i, a in enumerate(flat)),)
        else:
            node.args = torch.fx.node.map_aggregate(node.args, visit)
        self.ctx.scratch["sharded_outputs"] = specs


def _resolve_layout(ctx: PassContext, sites, handoffs) -> str:
    if ctx.config.layout != "auto":
        return ctx.config.layout
    layouts = {g.args[4] for g in handoffs}
    if len(layouts) == 1 and not sites:
        return layouts.pop()  # a graph reading another's shards only (a loss after a graph break)
    causal = bool(sites) and all(s.args[_ATTENTION_ARGS[op_name(s)]["causal"]] is True for s in sites)
    return "zigzag" if ctx.world_size > 1 and causal else "contiguous"


# ---------------------------------------------------------------------------------------
# rule helpers


def _broadcast_dim(st: Seq, in_nd: int, out_nd: int) -> int:
    return st.dim + out_nd - in_nd


_GRAD_MODE = ("_set_grad_enabled",)


def autograd_function_rule(w: Sharder, node):
    """A custom autograd.Function (dynamo's autograd_function_apply) whose forward and
    backward bodies are elementwise code over same-shape tensors (Bloom's GELU): token-local,
    so its outputs keep the input's shard and its backward runs on the shard too."""
    for body in node.args[:2]:
        for n in attr_value(w.gm, body.target).graph.nodes:
            if n.op in ("placeholder", "output") or op_name(n) in _GRAD_MODE:
                continue
            if n.op not in ("call_function", "call_method") or op_name(n) not in _PW + _PW_CHEAP:
                raise Fallback(f"its {body.target} calls {op_name(n)}, which is not elementwise")
    tensors = [a for a in node.args[2:] if _is_tensor_node(a)]
    outs = [v for v in fake(node) if isinstance(v, torch.Tensor)]
    shapes = {tuple(map(expr, fake(a).shape)) for a in tensors} | {tuple(map(expr, v.shape)) for v in outs}
    if len(shapes) != 1:
        raise Fallback(f"its tensors have different shapes {sorted(shapes)}")
    st = _elementwise(w, node, tensors, cheap=False, out_nd=len(shapes.pop()))
    return tuple(st if isinstance(v, torch.Tensor) else None for v in fake(node))


def _elementwise(w: Sharder, node: torch.fx.Node, tensors: list[torch.fx.Node], cheap: bool,
                 pad_value=0, out_nd: int | None = None) -> State:
    """Broadcasting token-local op over `tensors`; cheap ops keep replicated values replicated."""
    out = fake(node)
    out_nd = out.dim() if out_nd is None else out_nd
    seqs = {a: w.state.get(a) for a in tensors if isinstance(w.state.get(a), Seq)}
    dims = {}
    for a, st in seqs.items():
        in_nd = fake(a).dim()
        if expr(fake(a).shape[st.dim]) == 1:
            continue  # broadcast along the sequence: no token index
        dims[a] = _broadcast_dim(st, in_nd, out_nd)
    sharded = [a for a in dims if seqs[a].sharded]
    if not sharded:
        if not dims:
            return None
        if cheap:
            d = _agree({dims[a] for a in dims})
            a0 = next(iter(dims))
            return Seq(d, expr(out.shape[d]) / seqs[a0].outer, seqs[a0].outer)
        # per-token work on replicated values: this is where they get sliced
        window = None
    else:
        window = seqs[sharded[0]]
        for a in sharded[1:]:
            s = seqs[a]
            if (dims[a], s.start, s.length, s.outer) != (dims[sharded[0]], window.start, window.length, window.outer):
                raise Fallback("shards with different windows meet")
    d = dims[sharded[0]] if sharded else _agree({dims[a] for a in dims})
    ref = seqs[sharded[0]] if sharded else seqs[next(iter(dims))]
    win = window if window is not None else Seq(d, ref.length, ref.outer, sharded=True)
    for a in tensors:
        st = seqs.get(a)
        if st is not None and a in dims and not st.sharded and dims[a] == d:
            w.localize(node, a, st, win if window is not None else None, pad_value)
        elif st is None or (a in dims and not st.sharded):
            # no sequence state, or a replicated one at another dim (a guess from sizes: a
            # feature dim equal to n): what lines up with the shard's dim is sliced like it
            _meet(w, node, a, d, out_nd, win, pad_value)
    return Seq(d, win.length, win.outer, win.start, sharded=True)


def _meet(w: Sharder, node, a, d: int, out_nd: int, win: Seq, pad_value=0) -> None:
    """A value with no known sequence dim meets a shard: if its dim aligned with the shard's
    sequence dim has full (global) size, it is indexed by token after all (say, labels the
    discovery could not tell apart): slice it too."""
    val = fake(a)
    if not isinstance(val, torch.Tensor):
        return
    ad = d - (out_nd - val.dim())
    if ad < 0 or expr(val.shape[ad]) == 1:
        return
    st = Seq(ad, expr(val.shape[ad]) / win.outer, win.outer)
    w.localize(node, a, st, win if not w.full(win) else None, pad_value)


def _agree(dims: set[int]) -> int:
    if len(dims) != 1:
        raise Fallback(f"sequence dims {sorted(dims)} disagree")
    return dims.pop()


def _norm_dim(d: int, nd: int) -> int:
    return d % nd if nd else 0


# ---------------------------------------------------------------------------------------
# rules


@dataclass(frozen=True)
class Rule:
    fn: Callable[[Sharder, torch.fx.Node], Any]
    creates: bool = False  # may create a sequence dim from no sequence input (factories, slices)
    unary: bool = False  # the sequence can only come through the first argument


def pointwise(cheap: bool):
    def fn(w: Sharder, node):
        tensors = [a for a in node.all_input_nodes if _is_tensor_node(a)]
        # Integer/bool results stay cheap (label shifts, masks). A copy or cast stays cheap
        # only while its result is too: a replicated value cast to floating point (RoPE's
        # positions.float()) is where per-token work starts, so it is sliced there instead of
        # costing 4n bytes on every rank.
        # Likewise a floating-point value changing dtype (x.float() on bf16 activations) or
        # cloned: a new full-length tensor on every rank, so it is sliced first.
        is_cheap = not _is_float(fake(node)) or (
            cheap and not _newly_float(node, tensors) and not _float_copy(node, tensors))
        return _elementwise(w, node, tensors, is_cheap)
    return fn


def _is_float(t) -> bool:
    """Floating point or complex (Llama 4's rotary): per-token values, never cheap."""
    return t.is_floating_point() or t.is_complex()


def new_factory_rule(w: Sharder, node):
    """x.new_empty(sizes) (new_zeros, new_ones, new_full) with x's sequence length at x's
    sequence dim (DeepSeek-V3's key states, filled by copies into slices): the same factory at
    the rank's rows."""
    x, out = node.args[0], fake(node)
    st = w.state[x]
    if not st.sharded:
        return w.seq_of_size(out)
    if not (w.full(st) and _eq(st.outer, 1) and st.order is None and out.dim() > st.dim
            and _eq(expr(out.shape[st.dim]), expr(fake(x).shape[st.dim]))):
        raise Fallback("a new tensor whose sequence dim is not its source's")
    args = list(node.args)
    sized = len(args) == 2 and isinstance(args[1], (tuple, list, torch.Size))
    sizes = list(args[1]) if sized else args[1:1 + out.dim()]
    if len(sizes) != out.dim():
        raise Fallback("unexpected size list")
    sizes[st.dim] = w.local_rows()
    node.args = (x, tuple(sizes), *args[2:]) if sized else (x, *sizes, *args[1 + out.dim():])
    return Seq(st.dim, st.length, sharded=True)


def copy_rule(w: Sharder, node):
    """dst.copy_(src): elementwise into dst, which must be a shard (a write into a slice of a
    replicated value would land in a copy)."""
    st = w.state.get(node.args[0])
    if not (isinstance(st, Seq) and st.sharded):
        raise Fallback("copies a shard into a value that is not one")
    return _elementwise(w, node, [a for a in node.all_input_nodes if _is_tensor_node(a)], False)


def complex_view_rule(w: Sharder, node):
    """view_as_complex / view_as_real: the trailing pair of reals <-> one complex number; the
    sequence dim, never that pair, keeps its index."""
    st = w.state[node.args[0]]
    if st.dim >= fake(node).dim():
        raise Fallback("the sequence dim is the real/imaginary pair")
    return st


def _float_copy(node: torch.fx.Node, tensors: list[torch.fx.Node]) -> bool:
    """A copy or cast whose floating-point result is new memory (dtype change, clone)."""
    if not tensors or not isinstance(fake(tensors[0]), torch.Tensor):
        return False
    src = fake(tensors[0])
    return src.is_floating_point() and (fake(node).dtype != src.dtype or op_name(node) == "clone")


def _newly_float(node: torch.fx.Node, tensors: list[torch.fx.Node]) -> bool:
    """The op turns integer/bool inputs into a floating-point result (a cast)."""
    return fake(node).is_floating_point() and not any(
        isinstance(fake(a), torch.Tensor) and fake(a).is_floating_point() for a in tensors)


def feature_local(feature_dims: Callable[[torch.fx.Node, int], set[int]]):
    """Ops that mix only features (linear, norms, softmax over a feature dim)."""
    def fn(w: Sharder, node):
        x = node.args[0]
        st = w.state.get(x)
        if not isinstance(st, Seq):
            raise Fallback("sequence arrives through a weight")
        nd = fake(x).dim()
        if st.dim in feature_dims(node, nd):
            raise Fallback("mixes along the sequence dim")
        others = [a for a in node.all_input_nodes if a is not x and isinstance(w.state.get(a), Seq)]
        if others:
            raise Fallback("sequence-carrying weights")
        if not st.sharded:
            w.localize(node, x, st, None)
            st = Seq(st.dim, st.length, st.outer, sharded=True)
        return st
    return fn


def _softmax_dims(node, nd):
    return {_norm_dim(_arg(node, 1, "dim", -1), nd)}


def _norm_dims(node, nd):
    shape = _arg(node, 1, "normalized_shape")
    k = len(shape) if isinstance(shape, (tuple, list)) else 1
    return set(range(nd - k, nd))


def _last_dim(node, nd):
    return {nd - 1}


def embedding_rule(w: Sharder, node):
    idx, weight = node.args[0], node.args[1]
    st = w.state.get(idx)
    if not isinstance(st, Seq) or isinstance(w.state.get(weight), Seq):
        raise Fallback("sequence in the embedding table")
    if not st.sharded:
        w.localize(node, idx, st, None)
        st = Seq(st.dim, st.length, st.outer, sharded=True)
    return st


def matmul_rule(w: Sharder, node):
    a, b = node.args[0], node.args[1]
    fa, fb, out = fake(a), fake(b), fake(node)
    sa, sb = w.state.get(a), w.state.get(b)
    if fa.dim() < 2 or fb.dim() < 2:
        raise Fallback("matrix-vector products over the sequence")
    mapped = {}
    for x, st, fx, row_or_col in ((a, sa, fa, fa.dim() - 2), (b, sb, fb, fb.dim() - 1)):
        if not isinstance(st, Seq):
            continue
        if st.dim == row_or_col:
            mapped[x] = out.dim() - 2 if x is a else out.dim() - 1
        elif st.dim < fx.dim() - 2:
            mapped[x] = _broadcast_dim(st, fx.dim(), out.dim())
        else:
            raise Fallback("contracts over the sequence")
    d = _agree(set(mapped.values()))
    sts = {x: w.state[x] for x in mapped}
    sharded = [x for x in mapped if sts[x].sharded]
    if len(mapped) == 2 and a is not b and mapped[a] == mapped[b] and (d == out.dim() - 2 or d == out.dim() - 1):
        raise Fallback("sequence on both sides of a product")
    win = sts[sharded[0]] if sharded else None
    for x in mapped:
        if not sts[x].sharded:
            w.localize(node, x, sts[x], win)
    ref = win or next(iter(sts.values()))
    return Seq(d, ref.length, ref.outer, ref.start, sharded=True)


def outer_rule(w: Sharder, node):
    """outer(a, b) of two vectors (RoPE's positions x frequencies): a's entries index the rows,
    b's the columns."""
    mapped = [(x, d) for x, d in zip(node.args[:2], (0, 1)) if isinstance(w.state.get(x), Seq)]
    if len(mapped) != 1:
        raise Fallback("sequence on both sides of an outer product")
    ((x, d),) = mapped
    st = w.state[x]
    if not st.sharded:
        w.localize(node, x, st, None)
    return Seq(d, st.length, st.outer, st.start, sharded=True)


def addmm_rule(w: Sharder, node):
    """addmm(bias, x, weight) (HF GPT-2's Conv1D): rows of x are tokens."""
    bias, x, weight = node.args[:3]
    st = w.state.get(x)
    if not isinstance(st, Seq) or st.dim != 0 or any(isinstance(w.state.get(a), Seq) for a in (bias, weight)):
        raise Fallback("sequence outside the rows of mat1")
    if not st.sharded:
        w.localize(node, x, st, None)
        st = replace(st, sharded=True)
    return st


def linear_rule(w: Sharder, node):
    return feature_local(_last_dim)(w, node)


# -- layout ops: map the dim, rebuild sizes with -1 at the sequence dim when sharded ------


def _sizes_arg(node) -> tuple[list, Callable[[list], None]]:
    """The size list of view/reshape/expand/broadcast_to and a setter for it (sizes given as
    varargs or a sequence; torch.reshape(x, shape) too)."""
    rest = list(node.args[1:])
    if "size" in node.kwargs or "shape" in node.kwargs:
        key = "size" if "size" in node.kwargs else "shape"
        sizes = list(node.kwargs[key])
        return sizes, lambda s: setattr(node, "kwargs", {**node.kwargs, key: tuple(s)})
    if len(rest) == 1 and isinstance(rest[0], (tuple, list, torch.Size)):
        return list(rest[0]), lambda s: setattr(node, "args", (node.args[0], tuple(s)))
    if len(rest) == 1 and isinstance(rest[0], torch.fx.Node) and rest[0].target is torch.Size \
            and len(rest[0].args) == 1 and isinstance(rest[0].args[0], (tuple, list)):
        # x.view(torch.Size([b, s, d])): dynamo's record of a size built from x.size() under a
        # symbolic length (HF Conv1D's `x.size()[:-1] + (nf,)`); the view takes its elements
        return list(rest[0].args[0]), lambda s: setattr(node, "args", (node.args[0], tuple(s)))
    return rest, lambda s: setattr(node, "args", (node.args[0], *s))


def view_rule(w: Sharder, node):
    x = node.args[0]
    st = w.state[x]
    in_shape, out_shape = fake(x).shape, fake(node).shape
    j, outer = _view_map(in_shape, st, out_shape)
    new = Seq(j, st.length, outer, st.start, st.sharded)
    if st.sharded:
        sizes, set_sizes = _sizes_arg(node)
        if len(sizes) != len(out_shape):
            raise Fallback("unexpected size list")
        fixed = []
        for i, s in enumerate(sizes):
            if i == j:
                fixed.append(-1)
            elif isinstance(s, int) and s == -1:
                fixed.append(w.size(out_shape[i]))
            else:
                fixed.append(s)
        set_sizes(fixed)
    else:
        new = replace(new, length=expr(out_shape[j]) / outer)
    return new


def _view_map(in_shape, st: Seq, out_shape) -> tuple[int, sympy.Expr]:
    """Output dim holding the sequence of a view (and the batch merged in front of it)."""
    before = _prod(in_shape[: st.dim]) * st.outer
    after = _prod(in_shape[st.dim + 1:])
    length = expr(in_shape[st.dim]) / st.outer
    for j in range(len(out_shape)):
        if not _zero(_prod(out_shape[j + 1:]) - after):
            continue
        outer = sympy.cancel(expr(out_shape[j]) / length)
        if not (outer.is_integer and outer.is_positive):  # a count of batch elements (dynamo's
            continue                                         # size symbols are positive integers)
        if _zero(_prod(out_shape[:j]) * outer - before):
            return j, outer
    raise Fallback(f"a view splits the sequence ({tuple(in_shape)} -> {tuple(out_shape)})")


def flatten_rule(w: Sharder, node):
    """A view without sizes: the shape flow alone says where the sequence goes."""
    x = node.args[0]
    st = w.state[x]
    j, outer = _view_map(fake(x).shape, st, fake(node).shape)
    new = Seq(j, st.length, outer, st.start, st.sharded)
    return new if st.sharded else replace(new, length=expr(fake(node).shape[j]) / outer)


def unflatten_rule(w: Sharder, node):
    x = node.args[0]
    st = w.state[x]
    nd = fake(x).dim()
    d = _norm_dim(_arg(node, 1, "dim"), nd)
    sizes = list(_arg(node, 2, "sizes"))
    j, outer = _view_map(fake(x).shape, st, fake(node).shape)
    if st.sharded and d <= j < d + len(sizes):
        sizes = [(-1 if i == j - d else (s if not (isinstance(s, int) and s == -1) else w.size(fake(node).shape[d + i])))
                 for i, s in enumerate(sizes)]
        _set_arg(node, 2, "sizes", tuple(sizes))
    new = Seq(j, st.length, outer, st.start, st.sharded)
    return new if st.sharded else replace(new, length=expr(fake(node).shape[j]) / outer)


def expand_rule(w: Sharder, node):
    x = node.args[0]
    st = w.state[x]
    in_nd, out_nd = fake(x).dim(), fake(node).dim()
    d = _broadcast_dim(st, in_nd, out_nd)
    if st.sharded:
        sizes, set_sizes = _sizes_arg(node)
        sizes[d] = -1
        set_sizes(sizes)
    return st.at(d)


def repeat_rule(w: Sharder, node):
    x = node.args[0]
    st = w.state[x]
    sizes, _ = _sizes_arg(node)
    d = st.dim + len(sizes) - fake(x).dim()
    r = sizes[d]
    if isinstance(r, int) and r > 1 and st.order is None and (not st.sharded or w.full(st)):
        # r tiles of the whole sequence, (tile, outer, token) along d: one more batch-like dim in
        # front of the tokens (Llama 4's experts each read every token)
        return replace(st.at(d), outer=st.outer * r)
    if not (isinstance(r, int) and r == 1):
        raise Fallback("repeats along the sequence")
    return st.at(d)


def repeat_interleave_rule(w: Sharder, node):
    """repeat_interleave along a dim other than the sequence repeats features within each
    token (Cohere's and GPT-J's RoPE interleave their frequencies): token-local."""
    x = node.args[0]
    st = w.state[x]
    dim, repeats = _arg(node, 2, "dim"), _arg(node, 1, "repeats")
    if dim is None:
        raise Fallback("repeats the flattened value")
    if isinstance(repeats, torch.fx.Node) and isinstance(w.state.get(repeats), Seq):
        raise Fallback("sequence in the repeats")
    if _norm_dim(dim, fake(x).dim()) == st.dim:
        raise Fallback("repeats along the sequence")
    if not st.sharded and fake(node).is_floating_point():  # per-token work: sliced here
        w.localize(node, x, st, None)
        st = replace(st, sharded=True)
    return st


def cumsum_rule(w: Sharder, node):
    """cumsum along a feature dim is token-local; along the sequence of a shard it is
    ringcc::seq_cumsum (Note [Cumulative sums] in runtime/seqops.py). A replicated integer
    value stays replicated (positions from a padding mask); a replicated float one is sliced
    first (OPT's positions from a mask of ones)."""
    x = node.args[0]
    st = w.state[x]
    d = _norm_dim(_arg(node, 1, "dim"), fake(x).dim())
    if d != st.dim:
        return pointwise(cheap=False)(w, node)
    if _arg(node, 2, "dtype") is not None:
        raise Fallback("cumsum with a dtype")
    if not st.sharded and not fake(node).is_floating_point():
        return st
    if not _eq(st.outer, 1):
        raise Fallback("cumsum over merged batch and sequence")
    if not st.sharded:
        w.localize(node, x, st, None)
        st = replace(st, sharded=True)
    elif not w.full(st):
        raise Fallback("cumsum over a narrowed or padded shard")
    out = w.new(SEQ_CUMSUM, _arg(node, 0, "input"), d, False, *w.comm)
    out.meta["example_value"] = fake(node)  # the rules downstream read global shapes
    w.state[out] = st
    node.replace_all_uses_with(out)
    w.decisions.append(f"{node.name}: seq_cumsum")
    return st


def transpose_rule(w: Sharder, node):
    x = node.args[0]
    st = w.state[x]
    nd = fake(x).dim()
    a, b = (_norm_dim(d, nd) for d in (_arg(node, 1, "dim0"), _arg(node, 2, "dim1")))
    d = b if st.dim == a else a if st.dim == b else st.dim
    return st.at(d)


def t_rule(w: Sharder, node):
    st = w.state[node.args[0]]
    nd = fake(node.args[0]).dim()
    return st.at(nd - 1 - st.dim) if nd == 2 else st


def permute_rule(w: Sharder, node):
    x = node.args[0]
    st = w.state[x]
    nd = fake(x).dim()
    dims = node.args[1:] if not (len(node.args) == 2 and isinstance(node.args[1], (tuple, list))) else node.args[1]
    if "dims" in node.kwargs:
        dims = node.kwargs["dims"]
    dims = [_norm_dim(d, nd) for d in dims]
    return st.at(dims.index(st.dim))


def unsqueeze_rule(w: Sharder, node):
    x = node.args[0]
    st = w.state[x]
    d = _norm_dim(_arg(node, 1, "dim"), fake(node).dim())
    return st.at(st.dim + 1 if d <= st.dim else st.dim)


def squeeze_rule(w: Sharder, node):
    x = node.args[0]
    st = w.state[x]
    in_shape = fake(x).shape
    dims = _arg(node, 1, "dim")
    if dims is None:
        dims = [i for i in range(len(in_shape)) if expr(in_shape[i]) == 1]
    elif isinstance(dims, int):
        dims = [dims]
    dims = [_norm_dim(d, len(in_shape)) for d in dims if expr(in_shape[_norm_dim(d, len(in_shape))]) == 1]
    return st.at(st.dim - sum(1 for d in dims if d < st.dim))


def movedim_rule(w: Sharder, node):
    x = node.args[0]
    st = w.state[x]
    nd = fake(x).dim()
    src, dst = _arg(node, 1, "source"), _arg(node, 2, "destination")
    src = [src] if isinstance(src, int) else list(src)
    dst = [dst] if isinstance(dst, int) else list(dst)
    order = [None] * nd
    for s, t in zip(src, dst):
        order[_norm_dim(t, nd)] = _norm_dim(s, nd)
    rest = iter(d for d in range(nd) if d not in {_norm_dim(s, nd) for s in src})
    order = [o if o is not None else next(rest) for o in order]
    return st.at(order.index(st.dim))


def getitem_rule(w: Sharder, node):
    x, index = node.args[0], node.args[1]
    st = w.state[x]
    if isinstance(st, tuple):
        return st[index]
    if st is None:
        return _lookup(w, node, index)
    items = list(index) if isinstance(index, tuple) else [index]
    lists = [i for i in items if isinstance(i, list)]
    # one constant list of positions keeps its dim where it is (Falcon's K/V head, [-2]); tensor
    # indices and several lists move or merge dims
    if any(isinstance(i, (torch.fx.Node, torch.Tensor)) for i in items) or len(lists) > 1 or \
            (lists and not all(isinstance(v, int) for v in lists[0])):
        raise Fallback("advanced indexing")
    nd = fake(x).dim()
    n_consumed = sum(1 for i in items if i is not None and i is not Ellipsis and not isinstance(i, bool))
    expanded = []
    for i in items:
        if i is Ellipsis:
            expanded.extend([slice(None)] * (nd - n_consumed))
        else:
            expanded.append(i)
    expanded.extend([slice(None)] * (nd - sum(1 for i in expanded if i is not None)))
    in_d = out_d = 0
    for pos, i in enumerate(expanded):
        if i is None:
            out_d += 1
            continue
        if in_d == st.dim:
            return _index_seq(w, node, st, i, pos, out_d, expanded)
        in_d += 1
        if not isinstance(i, int):
            out_d += 1
    raise AssertionError("sequence dim not reached by the index")


def _lookup(w: Sharder, node, index):
    """table[index]: rows of a value without a sequence (a buffer) picked by an integer index
    that carries one (GPT-J's sin/cos table read at the position ids). Each output row depends
    on its own index row only, as in an embedding: the index is sliced and the rows stay
    sharded."""
    st = w.state.get(index) if isinstance(index, torch.fx.Node) else None
    val = fake(index)
    if not isinstance(st, Seq) or not isinstance(val, torch.Tensor) or val.is_floating_point() or \
            val.dtype == torch.bool:
        raise Fallback("advanced indexing")
    if not st.sharded:
        w.localize(node, index, st, None)
        st = replace(st, sharded=True)
    return st  # the output's leading dims are the index's


# Note [Windows written in place]
# A slice of a shard keeps every row of the shard and narrows the window (Note [Sequence
# state]); the rows outside the window are rows of other tokens of the same storage. A write
# through that view (`h[:, a:b] += 1`, `h.narrow(1, a, k).mul_(2)`) would write them too, and a
# selected token (ringcc::seq_select) is a copy that a write would not reach `h` through. So a
# view of part of the sequence that is written in place is taken from the gathered value, and
# the later readers of the shard read the gathered value, written (Sharder._fallback).


def _index_seq(w: Sharder, node, st: Seq, i, pos: int, out_d: int, expanded: list):
    x = node.args[0]
    if not _eq(st.outer, 1):
        if i == slice(None):  # the whole dim (routing's top_i[:, 0]): its rows stay
            return st.at(out_d)
        raise Fallback("indexes a dim that merges batch and sequence")
    if st.sharded and (isinstance(i, int) or (isinstance(i, slice) and i != slice(None))) and written_through(node):
        # Note [Windows written in place]
        raise Fallback("a view of part of the sequence written in place")
    if isinstance(i, int):
        if not st.sharded:
            return None
        if not st.length.is_Integer and (i < 0 or not _zero(st.start)):
            raise Fallback("selects a token counted from the end of a symbolic length")
        # pick the token first (one row, replicated), then apply the rest of the index to it
        sel = _select_token(w, x, st, i % st.length if st.length.is_Integer else i, keepdim=False)
        node.args = (sel, tuple(r for k, r in enumerate(expanded) if k != pos))
        w.decisions.append(f"{node.name}: select token {i}")
        return None
    if not isinstance(i, slice):
        raise Fallback(f"index {i!r} on the sequence")
    if not st.sharded:
        return Seq(out_d, expr(fake(node).shape[out_d]))
    if i.step not in (None, 1):
        raise Fallback("strided slice of the sequence")
    lo, hi = _slice_bounds(i, st.length)
    if lo is None:
        raise Fallback("symbolic slice bounds on the sequence")
    new_index = list(expanded)
    new_index[pos] = slice(None)
    if _eq(hi - lo, 1):  # Note [One-token windows]
        node.args = (_select_token(w, x, st, lo, keepdim=True), tuple(new_index))
        w.decisions.append(f"{node.name}: select token {lo}")
        return None
    node.args = (x, tuple(new_index))
    return Seq(out_d, hi - lo, st.outer, st.start + lo, sharded=True)


# Note [One-token windows]
# A slice or narrow of a shard that keeps one token (`h[:, k:k + 1]`, `h.narrow(1, k, 1)`) has
# global size 1 along the sequence, which every rule reads as a broadcast, while a window of
# the shard would still hold n/p rows: `h * h[:, k:k + 1]` would multiply row by row. The token
# is selected instead (ringcc::seq_select, replicated) with its dim kept: an ordinary value of
# size 1 there, which broadcasts as in eager.


def _select_token(w: Sharder, x: torch.fx.Node, st: Seq, i, keepdim: bool) -> torch.fx.Node:
    """Token i of the window of sharded x, replicated on every rank (its dim kept or dropped)."""
    token = sympy.sympify(st.start + i)  # a global row
    if not token.is_Integer:
        raise Fallback("selects a token at a symbolic position")
    sel = w.new(SELECT, x, st.dim, int(token), *w.comm)
    w.state[sel] = None
    if keepdim:
        sel = w.new("unsqueeze", sel, st.dim, method=True)
        w.state[sel] = None
    return sel


def _slice_bounds(s: slice, length: sympy.Expr):
    def norm(v, default):
        if v is None:
            return default
        if not isinstance(v, int):
            return None
        e = sympy.Integer(v)
        return length + e if v < 0 else e
    lo, hi = norm(s.start, sympy.Integer(0)), norm(s.stop, length)
    if lo is None or hi is None:
        return None, None
    if length.is_Integer:
        lo, hi = sympy.Integer(max(0, min(int(lo), int(length)))), sympy.Integer(max(0, min(int(hi), int(length))))
    return lo, hi


def narrow_rule(w: Sharder, node):
    """x.narrow(dim, start, length): along the sequence of a shard, a window (the rows stay)."""
    x = node.args[0]
    st = w.state[x]
    d = _norm_dim(_arg(node, 1, "dim"), fake(x).dim())
    if d != st.dim:
        return st
    if not st.sharded:
        return Seq(d, expr(fake(node).shape[d]))
    start, length = _arg(node, 2, "start"), _arg(node, 3, "length")
    if not (isinstance(start, int) and _eq(st.outer, 1)):
        raise Fallback("narrows the sequence at a symbolic start")
    if written_through(node):  # Note [Windows written in place]
        raise Fallback("a view of part of the sequence written in place")
    if isinstance(length, int) and length == 1:  # Note [One-token windows]
        node.replace_all_uses_with(_select_token(w, x, st, start % st.length if start < 0 else start, keepdim=True))
        w.decisions.append(f"{node.name}: select token {start}")
        return None
    # every row of the shard stays (a view of all of them) and the node's state is the window, as
    # for a slice: its readers see the window, not x's
    node.args, node.kwargs = (x, d, 0, w.local_rows()), {}
    return Seq(d, expr(length) if not isinstance(length, torch.fx.Node) else expr(fake(length)), st.outer,
               st.start + start, sharded=True)


def split_rule(w: Sharder, node):
    x = node.args[0]
    st = w.state[x]
    nd = fake(x).dim()
    name = op_name(node)
    default = 0
    d = _norm_dim(_arg(node, 2 if name in ("split", "chunk", "tensor_split") else 1, "dim", default), nd)
    if name == "unbind":
        if d == st.dim:
            raise Fallback("unbinds the sequence")
        return tuple(st.at(st.dim - (1 if d < st.dim else 0)) for _ in fake(node))
    if d == st.dim:
        raise Fallback("splits the sequence")
    return tuple(st for _ in fake(node))


def cat_rule(w: Sharder, node):
    tensors = list(_arg(node, 0, "tensors"))
    out = fake(node)
    d = _norm_dim(_arg(node, 1, "dim", 0), out.dim())
    sts = [w.state.get(t) for t in tensors]
    name = op_name(node)
    if name != "stack":
        # A cat onto empty operands is the identity on the rest (HF's DynamicCache.update
        # appends each layer's keys and values to an empty past, in training too): the
        # one operand with elements keeps its state, its shard included.
        kept = [s for t, s in zip(tensors, sts) if not _empty_along(fake(t), d)]
        if len(kept) == 1 and len(tensors) > 1:
            return kept[0]
    seq_dims = {s.dim + (1 if name == "stack" and s.dim >= d else 0) for s in sts if isinstance(s, Seq)}
    if name == "cat" and d in seq_dims:
        if any(s is not None and s.sharded for s in sts):
            raise Fallback("concatenates along the sequence")
        return Seq(d, expr(out.shape[d]))
    sharded = [t for t, s in zip(tensors, sts) if s is not None and s.sharded]
    od = _agree(seq_dims)
    if not sharded:
        ref = next(s for s in sts if s is not None)
        return Seq(od, expr(out.shape[od]) / ref.outer, ref.outer)
    win = w.state[sharded[0]]
    new_list = []
    for t, s in zip(tensors, sts):
        if s is not None and not s.sharded:
            t = w.shard(t, s, win if not w.full(win) else None)
        new_list.append(t)
    _set_arg(node, 0, "tensors", type(_arg(node, 0, "tensors"))(new_list))
    return Seq(od, win.length, win.outer, win.start, sharded=True)


def _empty_along(val, d: int) -> bool:
    """A cat operand that adds no rows: zero length along the cat dim, or the 1-D empty
    tensor (`torch.tensor([])`) that torch.cat skips whatever the other operands' shapes."""
    if not isinstance(val, torch.Tensor):
        return False
    if val.dim() == 1 and expr(val.shape[0]) == 0:
        return True
    return val.dim() > d and expr(val.shape[d]) == 0


def pad_rule(w: Sharder, node):
    x, pads = node.args[0], _arg(node, 1, "pad")
    st = w.state[x]
    nd = fake(x).dim()
    padded = {nd - 1 - k // 2 for k, v in enumerate(pads) if not (isinstance(v, int) and v == 0)}
    if st.dim in padded:
        if st.sharded:
            raise Fallback("pads the sequence of a shard")
        return Seq(st.dim, expr(fake(node).shape[st.dim]) / st.outer, st.outer)
    return st  # padding features is token-local; on replicated values it stays cheap


def size_rule(w: Sharder, node):
    """x.size(d) of a shard along the sequence is the global length: n_local * p."""
    x = node.args[0]
    st = w.state[x]
    d = _arg(node, 1, "dim")
    if d is None:
        if not st.sharded:
            return None
        if not (w.full(st) and _eq(st.outer, 1)):
            raise Fallback("the whole size of a narrowed shard")
        # x.size() whole (HF OPT's `shape = h.shape ... .view(shape)`): the global size,
        # torch.Size([x.size(0), ..., x.size(d) * p, ...]), which view_rule reads element-wise
        made = []
        with w.graph.inserting_before(node.next):
            for i in range(fake(x).dim()):
                made.append(tag(w.graph.call_function(operator.getitem, (node, i)), PASS, node))
                if i == st.dim:
                    made.append(tag(w.graph.call_function(operator.mul, (made[-1], w.p)), PASS, node))
            sizes = [m for m in made if not (m.target is operator.getitem and m.args[1] == st.dim)]
            whole = tag(w.graph.call_function(torch.Size, (sizes,)), PASS, node)
        node.replace_all_uses_with(whole, delete_user_cb=lambda u: u not in made)
        for m in made + [whole]:
            w.state[m] = None
        return None
    if not st.sharded or _norm_dim(d, fake(x).dim()) != st.dim:
        return None
    if not (w.full(st) and _eq(st.outer, 1)):
        raise Fallback("the length of a narrowed shard")
    with w.graph.inserting_after(node):
        scaled = tag(w.graph.call_function(operator.mul, (node, w.p)), PASS, node)
    node.replace_all_uses_with(scaled, delete_user_cb=lambda u: u is not scaled)
    w.state[scaled] = None
    return None


def reduce_rule(w: Sharder, node):
    x = node.args[0]
    st = w.state[x]
    nd = fake(x).dim()
    name = op_name(node)
    dims = _arg(node, 1, "dim")
    keepdim = bool(_arg(node, 2, "keepdim", False))
    if dims is None:
        dims = list(range(nd))
    elif isinstance(dims, int):
        dims = [dims]
    dims = {_norm_dim(d, nd) for d in dims}
    if st.dim not in dims:
        return st.at(st.dim if keepdim else st.dim - sum(1 for d in dims if d < st.dim))
    if not st.sharded:
        return None
    if name not in ("sum", "mean") or (_arg(node, 3, "dtype") is not None and name == "mean"):
        raise Fallback(f"{name} over the sequence")
    if w.full(st):
        # Every rank holds the same number of tokens: the global mean is the mean of local means.
        divisor = w.p
    else:
        # rows outside the window are garbage: zero them, and divide by the logical count
        count = _prod(fake(x).shape[d] for d in dims)
        if not count.is_Integer:
            raise Fallback("a mean over a narrowed shard of symbolic length")
        if not _eq(st.outer, 1):
            raise Fallback("a masked reduction over merged batch and sequence")
        rows = w.new(torch.ones, (w.size(st.length),), dtype=fake(x).dtype)
        rows = w.shard(rows, Seq(0, st.length), st)  # 1 on the window's rows, 0 elsewhere
        shape = [-1 if d == st.dim else 1 for d in range(nd)]
        rows = w.new("view", rows, *shape, method=True)
        masked = w.new(operator.mul, x, rows)
        w.state[rows], w.state[masked] = Seq(st.dim, st.length, start=st.start, sharded=True), st
        node.replace_input_with(x, masked)
        if name == "mean":
            node.target = "sum" if node.op == "call_method" else torch.sum
        divisor = int(count)
    with w.graph.inserting_after(node):
        red = tag(w.graph.call_function(ALL_REDUCE, (node, *w.comm[:2])), PASS, node)
    with w.graph.inserting_after(red):
        out = tag(w.graph.call_function(operator.truediv, (red, divisor)), PASS, node) if name == "mean" else red
    node.replace_all_uses_with(out, delete_user_cb=lambda u: u is not red)
    w.state[red] = w.state[out] = None
    w.decisions.append(f"{node.name}: all_reduce {name}")
    return None


def cross_entropy_rule(w: Sharder, node):
    logits, target = node.args[0], _arg(node, 1, "target")
    sl = w.state.get(logits)
    if not isinstance(sl, Seq):
        raise Fallback("sequence only in the targets")
    weight = _arg(node, 2, "weight")
    ignore_index = _arg(node, 4, "ignore_index", -100)
    reduction = _arg(node, 6, "reduction", "mean")
    smoothing = _arg(node, 7, "label_smoothing", 0.0)
    if _arg(node, 3, "size_average") is not None or _arg(node, 5, "reduce") is not None:
        raise Fallback("legacy size_average/reduce arguments")
    nd = fake(logits).dim()
    class_dim = 1 if nd > 1 else 0
    if sl.dim == class_dim:
        raise Fallback("sequence in the class dim")
    # target dims are the input dims without the class dim
    td = sl.dim - (1 if sl.dim > class_dim else 0)
    if not sl.sharded:
        w.localize(node, logits, sl, None)
        sl = replace(sl, sharded=True)
    win = Seq(td, sl.length, sl.outer, sl.start, sharded=True)
    st = w.state.get(target)
    if isinstance(st, Seq) and st.sharded:
        if (st.start, st.length) != (sl.start, sl.length):
            raise Fallback("targets and logits shards differ")
    elif isinstance(st, Seq):
        w.localize(node, target, st.at(td), win if not w.full(sl) else None, pad_value=ignore_index)
    else:
        _meet(w, node, target, td, fake(target).dim(), win, pad_value=ignore_index)
        if _arg(node, 1, "target") is target:
            raise Fallback("targets without a sequence dim")
    if reduction == "none":
        return Seq(td, sl.length, sl.outer, sl.start, sharded=True)
    if weight is not None or smoothing not in (0, 0.0):
        raise Fallback("weighted or label-smoothed mean")
    # local sum and local count of counted targets, summed over ranks in one all-reduce
    _set_arg(node, 6, "reduction", "sum")
    local_target = _arg(node, 1, "target")
    with w.graph.inserting_after(node):
        parts = [node]
        if reduction == "mean":
            ne = tag(w.graph.call_method("ne", (local_target, ignore_index)), PASS, node)
            with w.graph.inserting_after(ne):
                cnt = tag(w.graph.call_method("sum", (ne,)), PASS, node)
            with w.graph.inserting_after(cnt):
                cntf = tag(w.graph.call_method("to", (cnt, fake(node).dtype)), PASS, node)
            parts = [node, cntf]
            anchor = cntf
        else:
            anchor = node
    with w.graph.inserting_after(anchor):
        stacked = tag(w.graph.call_function(torch.stack, (parts,)), PASS, node)
    with w.graph.inserting_after(stacked):
        red = tag(w.graph.call_function(ALL_REDUCE, (stacked, *w.comm[:2])), PASS, node)
    with w.graph.inserting_after(red):
        total = tag(w.graph.call_function(operator.getitem, (red, 0)), PASS, node)
    out = total
    if reduction == "mean":
        with w.graph.inserting_after(total):
            count = tag(w.graph.call_function(operator.getitem, (red, 1)), PASS, node)
        with w.graph.inserting_after(count):
            out = tag(w.graph.call_function(operator.truediv, (total, count)), PASS, node)
    internal = {stacked}
    node.replace_all_uses_with(out, delete_user_cb=lambda u: u not in internal)
    w.decisions.append(f"{node.name}: all_reduce cross_entropy {reduction}")
    return None


# where the key mask and the causal flag sit in each attention op's schema
_ATTENTION_ARGS = {
    "ringcc::ring_attention": dict(key_valid=3, causal=4, key_runs=10),
    "ringcc::dilated_attention": dict(key_valid=None, causal=6),
}
# where the communication arguments (group_name, world_size, layout) sit in the schema of each op
# that communicates over the sequence group inside: the sharder gives them its group, or one rank
# (world size 1) where the op runs on full values
_COMM_ARGS = {
    "ringcc::ring_attention": slice(6, 9),
    "ringcc::dilated_attention": slice(8, 11),
    "ringcc::fill_empty_rows": slice(6, 9),
}


def _set_comm(node: torch.fx.Node, comm: list) -> None:
    """The op's (group_name, world_size, layout) arguments set to `comm`."""
    args = list(node.args)
    args[_COMM_ARGS[op_name(node)]] = comm
    node.args = tuple(args)


def attention_rule(w: Sharder, node):
    spec = _ATTENTION_ARGS[op_name(node)]
    q, k, v = node.args[:3]
    for kind in ("mask", "score"):
        for t in (node.kwargs.get(f"{kind}_t{i}") for i in range(4)):
            # Notes [Mask functions] and [Score functions] in runtime/maskfn.py: read whole at
            # global positions, replicated
            st = w.state.get(t) if t is not None else None
            if isinstance(st, Seq) and st.sharded:
                raise Fallback(f"{kind} function input {t.name} computed on shards")
    for i, a in enumerate((q, k, v)):
        st = w.state.get(a)
        if st is None:
            st = Seq(2, expr(fake(a).shape[2])) if _eq(fake(a).shape[2], w.n) else None
        if st is None or st.dim != 2 or not _eq(st.outer, 1):
            raise ValueError(
                f"attention site {node.name} at {location(node)}: {'qkv'[i]} has no sequence dim 2 "
                f"(state {st}); ringcc cannot shard it")
        if not st.sharded:
            w.localize(node, a, st, None)
        elif not (w.full(st) or (_zero(st.start) and _eq(st.length, w.n))):
            raise Fallback("attention over a narrowed shard")
    padded = not _eq(w.n, w.N)
    causal = node.args[spec["causal"]] is True
    key_valid = node.args[spec["key_valid"]] if spec["key_valid"] is not None else None
    if padded and key_valid is None and not causal:
        if spec["key_valid"] is None:
            raise ValueError(f"attention site {node.name} at {location(node)}: Config(pad=True) needs a key "
                             f"mask, which {op_name(node)} does not take; use a length divisible by the layout")
        # Note [Padding]: the padded keys must not be attended to
        key_valid = w.new(torch.ones, (w.size(fake(q).shape[0]), w.size(w.n)), dtype=torch.bool)
        w.state[key_valid] = Seq(1, w.n)
        _set_arg(node, spec["key_valid"], "key_valid", key_valid)
    for kind in ("mask", "score"):
        for t in (node.kwargs.get(f"{kind}_t{i}") for i in range(4)):
            if t is None:
                continue
            st = w.state.get(t)
            per_token = isinstance(st, Seq) or any(_eq(d, w.n) or _eq(d, w.N) for d in fake(t).shape)
            if padded and (kind == "mask" or per_token):
                raise ValueError(f"attention site {node.name} at {location(node)}: its {kind} is a function of "
                                 "per-token values, which Config(pad=True) does not pad; use a length divisible by "
                                 "the layout")
    if key_valid is not None:
        st = w.state.get(key_valid) or Seq(1, expr(fake(key_valid).shape[1]))
        if st.sharded:
            raise Fallback("key padding mask computed on shards")
        w.localize(node, key_valid, st, None, pad_value=False)
        _share_key_runs(w, node, spec["key_runs"])
    if op_name(node) == "ringcc::ring_attention":
        _share_balance_plan(w, node, key_valid)
    _set_comm(node, list(w.comm))
    w.decisions.append(f"{node.name}: {op_name(node)} {w.layout}")
    seq = Seq(2, w.n, sharded=True)
    return (seq, seq)


def fill_empty_rows_rule(w: Sharder, node):
    """ringcc::fill_empty_rows (Note [Rows with no key] in runtime/ops.py) after a sharded ring op:
    out, lse, q, k and v are shards of the whole sequence; the op sums over the keys of every rank,
    which are the first n positions where Config(pad=True) padded the sequence."""
    for a in node.args[:5]:
        st = w.state.get(a)
        if not (isinstance(st, Seq) and st.dim == 2 and _eq(st.outer, 1)):
            raise Fallback(f"{a.name} has no sequence dim 2 (state {st})")
        if not st.sharded:
            w.localize(node, a, st, None)
        elif not (w.full(st) or (_zero(st.start) and _eq(st.length, w.n))):
            raise Fallback(f"{a.name} is a narrowed shard")
    _set_comm(node, list(w.comm))
    if not _eq(w.n, w.N):  # Note [Padding]
        _set_arg(node, 9, "length", int(w.n))
    return Seq(2, w.n, sharded=True)


def index_along_rule(w: Sharder, node):
    """gather / scatter / scatter_add along a dim other than the sequence, with the index (and
    a source tensor) holding the same tokens as the input at the same dim: each token's row
    reads or writes its own row only (a router's `scores.gather(1, topk_idx)`,
    `mask.scatter_(1, group_idx, 1)`): token-local. A write in place into a replicated value
    with a sharded index is run on full values: a shard of it would take the write away from
    its later readers."""
    x, index = node.args[0], _arg(node, 2, "index")
    src = _arg(node, 3, "src")
    tensors = [a for a in (x, index, src) if _is_tensor_node(a)]
    nd = fake(x).dim()
    dim = _norm_dim(_arg(node, 1, "dim"), nd)
    seqs = [w.state.get(a) for a in tensors]
    dims = {st.dim for st in seqs if isinstance(st, Seq)}
    if len(dims) != 1 or any(fake(a).dim() != nd for a in tensors):
        raise Fallback("sequence dims of the input and its index disagree")
    d = dims.pop()
    if d == dim:
        raise Fallback("indexes along the sequence")
    if any(not _eq(fake(a).shape[d], fake(x).shape[d]) for a in tensors):
        raise Fallback("the index holds other tokens than the input")
    st_x = w.state.get(x)
    in_place = writes_in_place(node, x)
    if in_place and not (isinstance(st_x, Seq) and st_x.sharded) and \
            any(isinstance(st, Seq) and st.sharded for st in seqs):
        raise Fallback("writes a replicated value in place at sharded indices")
    return _elementwise(w, node, tensors, cheap=in_place or not fake(node).is_floating_point())


def _share_key_runs(w: Sharder, node, index: int) -> None:
    """Gives the ring op at `node` the key_runs table of its (sharded) key mask, made by one
    ringcc::key_runs node per mask, so every layer that reads the mask shares one all-gather
    and host sync per step, forward and backward (Note [Key runs per mask], runtime/ring.py)."""
    local = node.args[3]
    runs = w._key_runs.get(local)
    if runs is None:
        runs = w.new(KEY_RUNS, local, *w.comm[:2])
        w.state[runs] = None
        w._key_runs[local] = runs
    _set_arg(node, index, "key_runs", runs)


def _share_balance_plan(w: Sharder, node, key_valid) -> None:
    """Gives a ring site whose mask function reads per-token tensors the balance plan of Note
    [Balanced ring] (runtime/balance.py), made at run time by one ringcc::balance_plan node per
    function, causal flag, batch, heads and tensors, so every layer that reads that mask shares
    one count and all-reduce per step, forward and backward. The site's report entry says so, or
    why it does not balance."""
    tensors = [node.kwargs.get(f"mask_t{i}") for i in range(4)]
    threshold = w.ctx.config.balance
    if not threshold or w.p == 1 or not node.kwargs.get("mask_fn") or tensors[0] is None:
        return
    site = next((s for s in w.ctx.report.sites if s.node == node.name), None)
    if key_valid is not None or node.kwargs.get("alibi_slopes") is not None:
        if site is not None:
            why = "a key padding mask" if key_valid is not None else "ALiBi"
            site.detail = "; ".join(filter(None, [site.detail, f"not balanced: {why} follows the layout"]))
        return
    q = fake(node.args[0])
    causal = node.args[4] is True
    key = (node.kwargs["mask_fn"], causal, expr(q.shape[0]), expr(q.shape[1]), tuple(tensors))
    plan = w._plans.get(key)
    if plan is None:
        plan = w.new(BALANCE_PLAN, node.kwargs["mask_fn"], causal, w.size(q.shape[0]), w.size(q.shape[1]), *w.comm,
                     float(threshold), **{f"mask_t{i}": t for i, t in enumerate(tensors) if t is not None})
        w.state[plan] = None
        w._plans[key] = plan
    node.kwargs = {**node.kwargs, "balance_plan": plan}
    w.decisions.append(f"{node.name}: balance plan {plan.name} above max/mean {float(threshold):g}")
    if site is not None:
        site.balance = float(threshold)


# Token-local ops, by how they treat replicated inputs. Copies and casts stay cheap (ids,
# positions, masks pass through them replicated); the others are per-token work, where a
# replicated value gets sliced (integer/bool results stay cheap too: label shifts, masks).
_PW_CHEAP = ("contiguous", "clone", "detach", "to", "type", "type_as", "float", "half", "bfloat16",
             "double", "long", "int", "bool", "alias", "zeros_like", "ones_like", "empty_like", "full_like")
_PW = ("add", "sub", "mul", "truediv", "div", "floordiv", "mod", "remainder", "pow", "neg", "abs", "exp", "log",
       "sqrt", "rsqrt", "sin", "cos", "tanh", "sigmoid", "relu", "gelu", "silu", "softplus", "mish",
       "leaky_relu", "elu", "clamp", "clamp_min", "clamp_max", "clamp_", "clamp_min_", "clamp_max_", "where", "masked_fill", "eq", "ne",
       "lt", "le", "gt", "ge", "and_", "or_", "xor", "invert", "logical_not", "logical_and",
       "logical_or", "dropout", "erf", "square", "reciprocal", "maximum", "minimum", "lerp", "sign",
       "iadd", "isub", "imul", "itruediv", "add_", "mul_", "sub_", "div_", "radd", "rsub", "rmul",
       "tanh_", "exp2", "expm1", "log1p", "hardtanh", "relu6", "hardswish", "hardsigmoid",
       "fill_", "masked_fill_", "__and__", "__or__", "__add__", "__radd__", "__sub__", "__rsub__", "__mul__",
       "__rmul__", "__truediv__", "logaddexp", "floor", "ceil", "round", "trunc")

# The rule table, keyed by op_name(node) (functions and methods alike). An op missing here
# that meets a shard is run on gathered inputs (recorded as an O(n) gather). DTensor's
# propagation rules are keyed by aten overloads and know nothing of windows or of replicated
# values that stay cheap, so they do not fit dynamo's torch-level graph.
RULES: dict[str, Rule] = {
    # token-local, broadcasting
    **{name: Rule(pointwise(cheap=True)) for name in _PW_CHEAP},
    **{name: Rule(pointwise(cheap=False)) for name in _PW},
    # token-local, mixing features only
    "linear": Rule(linear_rule),
    "addmm": Rule(addmm_rule),
    "layer_norm": Rule(feature_local(_norm_dims)),
    "rms_norm": Rule(feature_local(_norm_dims)),
    "softmax": Rule(feature_local(_softmax_dims)),
    "log_softmax": Rule(feature_local(_softmax_dims)),
    "embedding": Rule(embedding_rule),
    "autograd_function_apply": Rule(autograd_function_rule),
    "matmul": Rule(matmul_rule),
    "bmm": Rule(matmul_rule),
    "outer": Rule(outer_rule),
    # layout: the sequence dim moves with the shape flow
    "view": Rule(view_rule, creates=True, unary=True),
    "reshape": Rule(view_rule, creates=True, unary=True),
    "flatten": Rule(flatten_rule, creates=True, unary=True),
    "expand": Rule(expand_rule, creates=True, unary=True),
    "broadcast_to": Rule(expand_rule, creates=True, unary=True),
    "unflatten": Rule(unflatten_rule, unary=True),
    "repeat": Rule(repeat_rule, unary=True),
    "repeat_interleave": Rule(repeat_interleave_rule, unary=True),
    "cumsum": Rule(cumsum_rule, unary=True),
    "copy_": Rule(copy_rule),
    **{name: Rule(new_factory_rule, creates=True) for name in ("new_empty", "new_zeros", "new_ones", "new_full")},
    # complex rotary (Llama 4): views between reals and complex numbers, polar coordinates
    "view_as_complex": Rule(complex_view_rule, unary=True),
    "view_as_real": Rule(complex_view_rule, unary=True),
    "polar": Rule(pointwise(cheap=False)),
    "transpose": Rule(transpose_rule, unary=True),
    "swapaxes": Rule(transpose_rule, unary=True),
    "t": Rule(t_rule, unary=True),
    "permute": Rule(permute_rule, unary=True),
    "unsqueeze": Rule(unsqueeze_rule, unary=True),
    "squeeze": Rule(squeeze_rule, unary=True),
    "movedim": Rule(movedim_rule, unary=True),
    "getitem": Rule(getitem_rule, creates=True),  # unary but for a table read at sequence indices
    "narrow": Rule(narrow_rule, unary=True),
    "split": Rule(split_rule, unary=True),
    "chunk": Rule(split_rule, unary=True),
    "unbind": Rule(split_rule, unary=True),
    "cat": Rule(cat_rule, creates=True),
    "concat": Rule(cat_rule, creates=True),
    "stack": Rule(cat_rule),
    "pad": Rule(pad_rule, unary=True),
    "size": Rule(size_rule, unary=True),
    "sym_size": Rule(size_rule, unary=True),
    # reductions over the sequence: local reduction + all-reduce
    "sum": Rule(reduce_rule, unary=True),
    "mean": Rule(reduce_rule, unary=True),
    "logsumexp": Rule(reduce_rule, unary=True),  # token-local over a feature dim (a chunked loss)
    "cross_entropy": Rule(cross_entropy_rule),
    # per-token indexing along a feature dim (routers)
    **{name: Rule(index_along_rule) for name in ("gather", "scatter", "scatter_", "scatter_add", "scatter_add_")},
    # attention: q/k/v sharded, ring communication inside the op
    "ringcc::ring_attention": Rule(attention_rule),
    "ringcc::dilated_attention": Rule(attention_rule),
    "ringcc::fill_empty_rows": Rule(fill_empty_rows_rule),
    # factories: a dim of length n makes a replicated sequence value
    "arange": Rule(lambda w, node: None, creates=True),
    "ones": Rule(lambda w, node: None, creates=True),
    "zeros": Rule(lambda w, node: None, creates=True),
    "full": Rule(lambda w, node: None, creates=True),
}


# ---------------------------------------------------------------------------------------
# rows in a rank-local order (mixture-of-experts routing and dispatch)

# Note [Rank-local rows]
# A mixture-of-experts layer is token-local as a function (token t's output reads token t's
# hidden state only), but its dispatch is not written token by token: the [T, k] routing
# slots of the T = b*n tokens are flattened to T*k rows (Seq.inner = k), sorted by expert,
# the tokens gathered in that order, the experts run as grouped matmuls over runs of equal
# expert (offsets from a histogram of the sorted ids), and the rows put back by the inverse
# permutation. On a shard each step is done on the rank's own rows: the sort is the rank's
# own (Seq.order = the sort node), indices index the rank's own rows (Seq.index says which:
# ("pairs", None) slot rows in token order, ("tokens", None) token rows, ("positions", P)
# rows in P's order; ("keys", P) marks P's sorted values), the histogram of the sorted keys
# counts the rank's rows per group (a Partial), and grouped_mm reads those local offsets.
# Other forms of the same steps: index_select reads token rows as indexing does, index_add_
# adds rows in a sort's order back into the rank's own token rows, and repeat_interleave of a
# 1-D token value gives one row per slot (a padding mask per slot). torch.export's spellings
# (aten.index, aten.index_put_ and aten.floor_divide, respelled by ringcc rewrite as dynamo's
# getitem, setitem and floordiv; aten.arange, aten.zeros) take the same rules.
# A value in a rank-local order has no global counterpart, so only rules that know these
# states (ROWS_RULES) take one, and they keep the order until the inverse permutation brings
# the rows back to token order and a view splits the slots off again. Where a rule cannot
# follow, gathering such a value would be wrong: the walk is first run dry on a copy of the
# graph (`_local_order_closes`), and if some value in a local order would need a gather,
# sorts of shards gather instead (O(n), recorded).
# A Partial (a sum over the rank's rows: histc, scatter_add_ into fresh zeros) is summed over
# the ranks where it is read as a global value (the load-balancing loss's counts); cumsum and
# casts keep it partial, and grouped_mm's offsets read it as it is: the counts of the rows
# the rank holds. Every Partial is made from a shard with no garbage rows (full window):
# padded rows would be counted.


def _row_key(st: Seq) -> tuple:
    """What two row-aligned values share: the window, the rows per token and the order."""
    return (st.length, st.outer, st.start, st.inner, st.order)


def _full_rows(w: Sharder, st: Seq) -> None:
    if not (st.sharded and w.full(st)):
        raise Fallback("rows of a shard with garbage rows (a narrowed or padded window)")


def topk_rule(w: Sharder, node):
    """Top-k along a feature dim (routing: the experts of each token)."""
    x = node.args[0]
    st = w.state[x]
    d = _norm_dim(_arg(node, 2, "dim", -1), fake(x).dim())
    if d == st.dim:
        raise Fallback("top-k over the sequence")
    return (replace(st, index=None),) * 2


def sort_rule(w: Sharder, node):
    """A sort along a feature dim is per token; along the rows of a rank (1-D), the rank's own
    order (Note [Rank-local rows]): the values in that order, the indices their rows."""
    x = node.args[0]
    st = w.state[x]
    val = fake(x)
    d = _norm_dim(_arg(node, 1, "dim", -1), val.dim())
    ranked = replace(st, index=None)
    if d != st.dim:
        return ranked if op_name(node) == "argsort" else (ranked, ranked)
    if not w.local_order:
        raise Fallback("sorts the sequence")
    if val.dim() != 1 or st.order is not None:
        raise Fallback("sorts rows of several dims, or rows already in a rank-local order")
    _full_rows(w, st)
    values = replace(st, order=node, index=("keys", node))
    indices = replace(values, index=("pairs", None))
    return indices if op_name(node) == "argsort" else (values, indices)


def one_hot_rule(w: Sharder, node):
    """one_hot appends a class dim: per token."""
    return replace(w.state[node.args[0]], index=None)


def histc_rule(w: Sharder, node):
    """A histogram of shard rows counts the rank's rows: a Partial (Note [Rank-local rows])."""
    x = node.args[0]
    st = w.state[x]
    if not st.sharded:
        return None  # the same global histogram on every rank
    lo, hi = _arg(node, 2, "min", 0), _arg(node, 3, "max", 0)
    if not (isinstance(lo, (int, float)) and isinstance(hi, (int, float)) and lo < hi):
        raise Fallback("a histogram over the data's own range")
    _full_rows(w, st)
    keys = st.index[1] if st.index is not None and st.index[0] == "keys" else None
    return Partial(replace(st, dim=0, index=None), keys)


def rows_pointwise(w: Sharder, node):
    """Elementwise on rows of one window and order; values without rows must not vary
    along them. A Partial passes casts unchanged (integer counts)."""
    tensors = [a for a in node.all_input_nodes if _is_tensor_node(a)]
    partial = [a for a in tensors if isinstance(w.state.get(a), Partial)]
    if partial:
        if len(tensors) != 1:
            raise Fallback("a rank-local sum meets another value")
        return w.state[partial[0]]
    out_nd = fake(node).dim()
    first, d = None, None
    for a in tensors:
        st = w.state.get(a)
        if not isinstance(st, Seq):
            continue
        if not st.sharded:
            raise Fallback("rows of a rank meet a replicated sequence value")
        ad = _broadcast_dim(st, fake(a).dim(), out_nd)
        if first is None:
            first, d = st, ad
        elif (ad, *_row_key(st)) != (d, *_row_key(first)):
            raise Fallback("rows of different windows or orders meet")
    for a in tensors:
        if not isinstance(w.state.get(a), Seq):
            ad = d - (out_nd - fake(a).dim())
            if ad >= 0 and expr(fake(a).shape[ad]) != 1:
                raise Fallback("a value without rows varies along rows of a rank")
    index = None
    name = op_name(node)
    if len(tensors) == 1 and first.index is not None and first.index[0] == "keys" and name in _CASTS:
        index = first.index  # the sorted keys, cast for histc
    elif len(tensors) == 1 and first.index is not None and not fake(node).is_floating_point():
        k = node.args[1] if len(node.args) > 1 else None
        if name in _CASTS:
            index = first.index
        elif name == "floordiv" and first.index == ("pairs", None) and node.args[0] is tensors[0] and \
                isinstance(k, int) and _eq(first.inner, k):
            index = ("tokens", None)  # slot row // k: the slot's token
    return replace(first, dim=d, index=index)


_CASTS = ("contiguous", "clone", "detach", "to", "long", "int", "float", "double", "alias")


def rows_view(w: Sharder, node):
    """A view that keeps the rows dim whole, merges the dims after it into the rows (the
    slots of a token, Seq.inner), or, in token order, splits the slots off again."""
    x = node.args[0]
    st = w.state[x]
    if not (isinstance(st, Seq) and st.sharded):
        raise Fallback("a view of a replicated value with several rows per token")
    new = _rows_view_map(st, fake(x).shape, fake(node).shape)
    if new is None:
        raise Fallback(f"a view splits rows of a rank ({tuple(fake(x).shape)} -> {tuple(fake(node).shape)})")
    if op_name(node) in ("view", "reshape"):
        sizes, set_sizes = _sizes_arg(node)
        if len(sizes) != fake(node).dim():
            raise Fallback("unexpected size list")
        set_sizes([-1 if i == new.dim else (w.size(fake(node).shape[i]) if isinstance(s, int) and s == -1 else s)
                   for i, s in enumerate(sizes)])
    return new


def _rows_view_map(st: Seq, in_shape, out_shape) -> Optional[Seq]:
    d = st.dim
    before, rows = _prod(in_shape[:d]), expr(in_shape[d])
    for j in range(len(out_shape)):
        if not _zero(_prod(out_shape[:j]) - before):
            continue
        for e in range(d, len(in_shape)):  # out dim j = rows x in dims d+1..e
            merged = _prod(in_shape[d + 1:e + 1])
            if _zero(expr(out_shape[j]) - rows * merged) and _zero(_prod(out_shape[j + 1:]) - _prod(in_shape[e + 1:])):
                if _eq(merged, 1):
                    return st.at(j)
                if st.order is None:
                    return replace(st, dim=j, inner=st.inner * merged, index=None)
        if st.order is None and not _eq(st.inner, 1):  # out dims j, j+1..e = tokens, slots
            for e in range(j + 1, len(out_shape)):
                if _zero(_prod(out_shape[j + 1:e + 1]) - st.inner) and _zero(expr(out_shape[j]) * st.inner - rows) \
                        and _zero(_prod(out_shape[e + 1:]) - _prod(in_shape[d + 1:])):
                    return replace(st, dim=j, inner=sympy.Integer(1), index=None)
    return None


def merge_rows(rule):
    """A view of a shard that merges the dims after the sequence into it (a token's top-k
    slots flattened): rows per token (Note [Rank-local rows]); any other view: `rule`."""
    def fn(w: Sharder, node):
        try:
            return rule(w, node)
        except Fallback:
            st = w.state[node.args[0]]
            if not (st.sharded and w.full(st)):
                raise
            new = _rows_view_map(st, fake(node.args[0]).shape, fake(node).shape)
            if new is None or _eq(new.inner, st.inner):
                raise
            return rows_view(w, node)
    return fn


def rows_getitem(w: Sharder, node):
    """x[index] with one integer tensor index over x's rows (Note [Rank-local rows])."""
    x, index = node.args[0], node.args[1]
    if isinstance(w.state.get(x), tuple):
        return w.state[x][index]
    if isinstance(index, tuple) and len(index) == 1:
        index = index[0]
    st = w.state.get(x)
    items = index if isinstance(index, tuple) else (index,)
    if isinstance(st, Seq) and all(i is Ellipsis or isinstance(i, slice) for i in items):
        # features sliced, rows untouched (gpt-oss's gate_up[..., ::2]): the rows keep their state
        nd, cut = fake(x).dim(), items.index(Ellipsis) if Ellipsis in items else len(items)
        tail = len(items) - cut - 1  # items after the Ellipsis index the last dims
        at_rows = items[st.dim] if st.dim < cut else \
            items[st.dim - nd] if Ellipsis in items and st.dim >= nd - tail else slice(None)
        if at_rows == slice(None):
            return st
    return _take_rows(w, x, index)


def rows_index_select(w: Sharder, node):
    x, dim, index = node.args[0], _arg(node, 1, "dim"), _arg(node, 2, "index")
    if _norm_dim(dim, fake(x).dim()) != 0:
        raise Fallback("index_select along a dim other than the rows")
    return _take_rows(w, x, index)


def _take_rows(w: Sharder, x: torch.fx.Node, index) -> State:
    """The rows of x that `index` names: a table without rows read per row; token rows read in
    a sort's order by ("tokens") indices; slot rows by ("pairs") indices; rows in a sort's
    order put back by ("positions") indices."""
    sx = w.state.get(x)
    si = w.state.get(index) if isinstance(index, torch.fx.Node) else None
    if not (isinstance(si, Seq) and si.sharded and fake(index).dim() == 1 and si.index is not None):
        raise Fallback("indexes rows of a rank other than by one tensor of row indices")
    rows = replace(si, index=None)
    if sx is None:
        return rows if si.dim == 0 else None  # a weight table: one row per index
    if not (isinstance(sx, Seq) and sx.sharded and sx.dim == 0 and (sx.length, sx.outer, sx.start) ==
            (si.length, si.outer, si.start)):
        raise Fallback("advanced indexing of rows of another window")
    kind, of = si.index
    if kind == "tokens" and _eq(sx.inner, 1) and sx.order is None and sx.index is None:
        return rows
    if kind == "pairs" and _eq(sx.inner, si.inner) and sx.order is None:
        # the argsorted value read in its own order: the sorted keys
        return replace(rows, index=("keys", si.order)) if x is si.order.args[0] else rows
    if kind == "positions" and sx.order is of and _eq(sx.inner, si.inner):
        return rows
    raise Fallback(f"advanced indexing by {kind} indices of rows in another order")


def rows_index_add(w: Sharder, node):
    """out.index_add_(0, tokens, rows): rows in a sort's order added to the token rows that
    ("tokens") indices name, all of them the rank's own (the experts' outputs combined)."""
    x, dim, index, src = node.args[0], _arg(node, 1, "dim"), _arg(node, 2, "index"), _arg(node, 3, "source")
    sx, si = w.state.get(x), w.state.get(index) if isinstance(index, torch.fx.Node) else None
    ss = w.state.get(src) if isinstance(src, torch.fx.Node) else None
    if not (isinstance(sx, Seq) and sx.sharded and sx.dim == 0 and _norm_dim(dim, fake(x).dim()) == 0
            and not sx.local_rows and isinstance(si, Seq) and si.index == ("tokens", None) and si.sharded
            and (sx.length, sx.outer, sx.start) == (si.length, si.outer, si.start)
            and isinstance(ss, Seq) and ss.sharded and ss.dim == 0 and _row_key(ss) == _row_key(si)):
        raise Fallback("index_add other than rows of a rank into its own token rows")
    return sx


def repeat_rows(rule):
    """x.repeat_interleave(k) of a 1-D shard along its tokens (a padding mask per routing slot):
    each token's k slot rows, in token order (Seq.inner); other cases: `rule`."""
    def fn(w: Sharder, node):
        x, repeats = node.args[0], _arg(node, 1, "repeats")
        st = w.state[x]
        dim = _arg(node, 2, "dim")
        along = fake(x).dim() == 1 and (dim is None or _norm_dim(dim, 1) == st.dim)
        if not (along and isinstance(repeats, int) and _arg(node, 3, "output_size") is None and w.full(st)):
            return rule(w, node)
        if not st.sharded:
            w.localize(node, x, st, None)
            st = replace(st, sharded=True)
        return replace(st, inner=st.inner * repeats, index=None)
    return fn


_ZEROS = (torch.zeros, torch.zeros_like, torch.ops.aten.zeros.default, torch.ops.aten.zeros_like.default)


def rows_scatter_add(w: Sharder, node):
    """torch.zeros(E).scatter_add_(0, ids, src) with ids and src rows of a rank: the rank's
    share of a sum over all rows (a Partial: the load-balancing loss's masked counts)."""
    x, dim, index, src = node.args[0], _arg(node, 1, "dim"), _arg(node, 2, "index"), _arg(node, 3, "src")
    si = w.state.get(index) if isinstance(index, torch.fx.Node) else None
    ss = w.state.get(src) if isinstance(src, torch.fx.Node) else None
    fresh = x.op == "call_function" and x.target in _ZEROS and len(x.users) == 1
    if not (fresh and w.state.get(x) is None and _norm_dim(dim, fake(x).dim()) == 0 and fake(index).dim() == 1
            and isinstance(si, Seq) and si.sharded and isinstance(ss, Seq) and ss.sharded
            and _row_key(si) == _row_key(ss) and si.dim == ss.dim == 0):
        raise Fallback("scatter_add other than rows of a rank into fresh zeros")
    _full_rows(w, si)
    w.state[x] = Partial(replace(si, index=None))
    return w.state[x]


_ARANGES = (torch.arange, torch.ops.aten.arange.default)  # dynamo's and export's arange(end)


def rows_setitem(w: Sharder, node):
    """inv[perm] = arange(len(perm)), inv = empty_like(perm): the inverse of the rank's sort
    (Note [Rank-local rows]); the arange counts the rank's rows."""
    inv, index, src = node.args[:3]
    si, sv = w.state.get(index), w.state.get(inv)
    if not (isinstance(si, Seq) and si.index == ("pairs", None) and si.order is not None and isinstance(sv, Seq)
            and _row_key(sv) == _row_key(si) and isinstance(src, torch.fx.Node) and src.target in _ARANGES
            and len(src.args) == 1 and not (set(src.kwargs) - {"device", "dtype", "layout", "pin_memory"})
            and src.kwargs.get("layout") in (None, torch.strided) and not src.kwargs.get("pin_memory")
            and _eq(fake(src.args[0]) if isinstance(src.args[0], torch.fx.Node) else src.args[0], fake(inv).shape[0])):
        raise Fallback("a write into rows of a rank other than a sort's inverse")
    kwargs = {k: v for k, v in src.kwargs.items() if k in ("device", "dtype")}
    local = w.new(torch.arange, w.new("size", index, 0, method=True), **kwargs)
    w.state[local] = None
    node.replace_input_with(src, local)
    w.state[inv] = replace(si, order=None, index=("positions", si.order))
    return None


def rows_reduce(w: Sharder, node):
    """Sums and means: over a feature dim per row; over the rows, as over tokens (every rank
    holds as many rows: the order does not matter to a sum)."""
    _full_rows(w, w.state[node.args[0]])
    return reduce_rule(w, node)


def rows_cumsum(w: Sharder, node):
    x = node.args[0]
    st = w.state[x]
    if isinstance(st, Partial):
        return st  # a cumsum of counts is the cumsum of each rank's counts, summed
    if _norm_dim(_arg(node, 1, "dim"), fake(x).dim()) == st.dim:
        raise Fallback("cumsum along rows of a rank")
    return replace(st, index=None)


def grouped_mm_rule(w: Sharder, node):
    """Grouped matmul of rows sorted by group (experts) with the offsets of those rows: the
    rank's own rows with its own offsets (Note [Rank-local rows])."""
    x, weight = node.args[:2]
    offs = _arg(node, 2, "offs")
    sx, so = w.state.get(x), w.state.get(offs) if isinstance(offs, torch.fx.Node) else None
    if not (isinstance(sx, Seq) and sx.sharded and sx.dim == 0 and fake(x).dim() == 2 and w.state.get(weight) is None
            and isinstance(so, Partial) and _row_key(so.rows) == _row_key(sx) and so.keys is sx.order):
        raise Fallback("grouped matmul without offsets counted from the sorted keys of the rank's rows")
    return replace(sx, index=None)


# Ops with a Partial input that keep it partial (the rest read the sum over the ranks).
_PARTIAL_OPS = ("cumsum", "to", "int", "long", "float", "double", "type", "contiguous", "clone", "detach",
                "grouped_mm_fallback", "_grouped_mm", "grouped_mm")

# The rules for rows of a rank (Seq.local_rows, Partial); any other op with such an input runs
# on gathered values, which for rows in a rank-local order turns local sorts off (Note [Rank-local rows]).
ROWS_RULES: dict[str, Rule] = {
    **{name: Rule(rows_pointwise) for name in _PW_CHEAP + _PW},
    **{name: Rule(rows_view, unary=True) for name in ("view", "reshape", "flatten")},
    **{name: Rule(rule, unary=True) for name, rule in (
        ("transpose", transpose_rule), ("t", t_rule), ("permute", permute_rule), ("unsqueeze", unsqueeze_rule),
        ("squeeze", squeeze_rule), ("movedim", movedim_rule), ("expand", expand_rule), ("broadcast_to", expand_rule),
        ("split", split_rule), ("chunk", split_rule), ("unbind", split_rule))},
    "getitem": Rule(rows_getitem),
    "index_select": Rule(rows_index_select),
    "index_add": Rule(rows_index_add),
    "index_add_": Rule(rows_index_add),
    "scatter_add": Rule(rows_scatter_add),
    "scatter_add_": Rule(rows_scatter_add),
    "setitem": Rule(rows_setitem),
    "sum": Rule(rows_reduce, unary=True),
    "mean": Rule(rows_reduce, unary=True),
    "cumsum": Rule(rows_cumsum, unary=True),
    "topk": Rule(topk_rule, unary=True),
    "sort": Rule(sort_rule, unary=True),
    "argsort": Rule(sort_rule, unary=True),
    "one_hot": Rule(one_hot_rule, unary=True),
    "histc": Rule(histc_rule, unary=True),
    **{name: Rule(grouped_mm_rule) for name in ("grouped_mm_fallback", "_grouped_mm", "grouped_mm")},
}
RULES.update({
    **{name: Rule(merge_rows(RULES[name].fn), creates=RULES[name].creates, unary=True)
       for name in ("view", "reshape", "flatten")},
    "repeat_interleave": Rule(repeat_rows(RULES["repeat_interleave"].fn), unary=True),
    "topk": Rule(topk_rule, unary=True),
    "sort": Rule(sort_rule, unary=True),
    "argsort": Rule(sort_rule, unary=True),
    "one_hot": Rule(one_hot_rule, unary=True),
    "histc": Rule(histc_rule, unary=True),
})


def _local_order_closes(gm: torch.fx.GraphModule, ctx: PassContext) -> bool:
    """Whether the walk with rank-local sorts never needs to gather a value in a rank-local
    order (Note [Rank-local rows]): a dry run on a copy of the graph."""
    from dataclasses import replace as copy_with

    from ringcc.report import GraphReport

    if not any(op_name(n) in ("sort", "argsort") for n in gm.graph.nodes):
        return False
    graph = torch.fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    dry_ctx = copy_with(ctx, report=GraphReport(graph=ctx.report.graph, world_size=ctx.world_size),
                        scratch=dict(ctx.scratch))
    try:
        Sharder(torch.fx.GraphModule(gm, graph), dry_ctx, local_order=True).run()
    except _Unclosed:
        return False
    return True


# ---------------------------------------------------------------------------------------
# the pass


def shard_sequence(gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
    if "seq" not in ctx.scratch or not ctx.config.shard or _already_sharded(gm):
        return PassResult(False)
    w = Sharder(gm, ctx)
    _resolve_ambiguous(gm, ctx, w.layout)
    w.local_order = _local_order_closes(gm, ctx)
    w.run()
    gm.meta["ringcc_seq_len"] = w.N  # rows of all shards together (n, or n padded)
    ctx.report.layout = w.layout
    ctx.scratch["sharded"] = True
    ctx.scratch["shard_decisions"] = w.decisions
    remove_dead(gm)
    # a gather made for a value that turned out dead (a region body's own x.size() under
    # dynamic shapes) is gone with it: the report lists what the graph does
    alive = {node.name for node in gm.graph.nodes}
    ctx.report.gathers[:] = [g for g in ctx.report.gathers if g.node in alive]
    length = f"{w.n} tokens" if str(w.n).isdigit() else "a dynamic length"
    ranks = "1 rank" if w.p == 1 else f"{w.p} ranks"
    ctx.report.notes.append(f"sequence of {length} sharded over {ranks} ({w.layout} layout): "
                            f"{sum(1 for d in w.decisions if d.startswith('shard '))} inputs sliced, "
                            f"{len(ctx.report.gathers)} gathered")
    made = next((d.split()[1].split("@")[0] for d in w.decisions if d.startswith("shard ")), None)
    nodes = {node.name: node for node in gm.graph.nodes}
    if not w.sources and not w.handoffs and made in nodes:
        ctx.report.notes.append(f"no graph input carries the sequence: the graph makes it, first sliced at "
                                f"{made} ({location(nodes[made])})")
    taken = [d.split()[1] for d in w.decisions if d.startswith("handoff ")]
    if taken:
        ctx.report.notes.append(f"handoff: {', '.join(taken)} taken as shards (sharded outputs of another graph)")
    refresh_fakes(gm)
    return PassResult(True)


# Note [Ambiguous inputs]
# An input with several dims of length n (token ids [8, 8]; a feature dim equal to n) cannot be
# read by size. Which of its dims carries the sequence is decided by the shape flow, as the walk
# follows it: for each candidate dim, a dry run of the walk on a copy of the graph, with that
# input as the only source and no state made from sizes (`_Probe`), records the dims at which
# it reaches attention's q, k and v. A candidate that reaches them, and only at their sequence
# dim (2), is confirmed. One confirmed dim is the input's sequence dim. An input that feeds q/k/v
# with none or several confirmed is an error that asks for ringcc.mark_sequence /
# Config(seq_dim=...): a guess could shard the batch. An input that does not feed q/k/v (labels,
# a mask) stays a replicated value; the walk still slices it where it meets a shard (`_meet`).


class _Probe(Sharder):
    """The walk as a dry run (Note [Ambiguous inputs]): `arrivals` are the (dim, outer) states of
    q/k/v at the attention sites."""

    def __init__(self, gm: torch.fx.GraphModule, ctx: PassContext):
        super().__init__(gm, ctx)
        self.arrivals: set[tuple[int, bool]] = set()

    def seq_of_size(self, val: torch.Tensor, along: int | None = None) -> State:
        return None

    def _visit(self, node: torch.fx.Node):
        if op_name(node) not in _ATTENTION_ARGS:
            return super()._visit(node)
        states = [self.state.get(a) for a in node.args[:3]]
        here = {(st.dim, _eq(st.outer, 1)) for st in states if isinstance(st, Seq)}
        self.arrivals |= here
        if here != {(2, True)}:
            return None
        seq = Seq(2, self.n, sharded=True)
        return (seq, seq)


def _feeds_attention(gm: torch.fx.GraphModule) -> set[str]:
    """Names of the placeholders that q, k or v of some attention site is computed from (through
    an earlier site's q/k/v only, not its mask)."""
    sites = set(attention_nodes(gm))
    seen: set[torch.fx.Node] = set()
    stack = [a for s in sites for a in s.args[:3]]
    while stack:
        node = stack.pop()
        if not isinstance(node, torch.fx.Node) or node in seen:
            continue
        seen.add(node)
        stack.extend(node.args[:3] if node in sites else node.all_input_nodes)
    return {node.name for node in seen if node.op == "placeholder"}


def _probe(gm: torch.fx.GraphModule, ctx: PassContext, layout: str, name: str, dim: int) -> set[tuple[int, bool]] | None:
    """The arrivals of input `name`'s `dim` at the attention sites (None: the walk stopped)."""
    from dataclasses import replace as copy_with

    from ringcc.report import GraphReport

    graph = torch.fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    info = ctx.scratch["seq"]
    scratch = {"seq": type(info)(n=info.n, sources={name: dim}), "layout": layout}
    probe_ctx = copy_with(ctx, report=GraphReport(graph=ctx.report.graph, world_size=ctx.world_size), scratch=scratch)
    probe = _Probe(torch.fx.GraphModule(gm, graph), probe_ctx)
    try:
        probe.run()
    except (Fallback, ValueError, TypeError, AssertionError):  # the walk cannot follow this dim
        return None
    return probe.arrivals


def _arrivals_text(got: set[tuple[int, bool]] | None) -> str:
    if got is None:
        return "a value the walk cannot follow"
    if not got:
        return "no attention input"
    return ", ".join(f"q/k/v dim {d}" + ("" if whole else " merged with another dim") for d, whole in sorted(got))


def _resolve_ambiguous(gm: torch.fx.GraphModule, ctx: PassContext, layout: str) -> None:
    """Decides the sequence dim of each ambiguous input (Note [Ambiguous inputs])."""
    info = ctx.scratch["seq"]
    if not info.ambiguous:
        return
    feeding = _feeds_attention(gm)
    shapes = {p.name: tuple(fake(p).shape) for p in gm.graph.nodes if p.op == "placeholder" and p.name in info.ambiguous}
    for name, dims in info.ambiguous.items():
        if name not in feeding:
            ctx.report.notes.append(
                f"input {name} {shapes[name]} has several dims of size n={info.n} and does not feed the attention "
                "sites; it is not taken as a sequence input (ringcc.mark_sequence(x, dim) or Config(seq_dim=...) "
                "says which)")
            continue
        arrivals = {d: _probe(gm, ctx, layout, name, d) for d in dims}
        confirmed = [d for d, got in arrivals.items() if got == {(2, True)}]
        if len(confirmed) != 1:
            reached = "; ".join(f"its dim {d} reaches " + _arrivals_text(got) for d, got in arrivals.items())
            raise ValueError(
                f"input {name} {shapes[name]} has several dims of size n={info.n} ({dims}) and feeds the attention "
                f"sites, and ringcc cannot tell which one is the sequence ({reached}; attention's sequence is dim 2 "
                f"of q/k/v). Say which: ringcc.mark_sequence(x, dim) on the input before the call, or "
                f"Config(seq_dim=...)")
        info.sources[name] = confirmed[0]
        ctx.report.notes.append(f"input {name} {shapes[name]}: dim {confirmed[0]} is the sequence (of its dims of "
                                f"size n={info.n}, {dims}, the one that becomes attention's sequence dim)")


def _already_sharded(gm: torch.fx.GraphModule) -> bool:
    return any(node.meta.get("ringcc_pass") == PASS for node in gm.graph.nodes)


_SIZE_OPS = (torch.ops.aten.size.default, torch.ops.aten.size.int, torch.ops.aten.sym_size.default,
             torch.ops.aten.sym_size.int)


def refresh_fakes(gm: torch.fx.GraphModule) -> None:
    """Recompute every node's fake value from the placeholders' (one fake mode, see PITFALLS)."""
    mode = None
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            mode = mode or getattr(fake(node), "fake_mode", None)
    env: dict[torch.fx.Node, Any] = {}
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            env[node] = fake(node)
            continue
        if node.op == "output":
            continue
        args = torch.fx.node.map_arg(node.args, lambda a: env[a])
        kwargs = torch.fx.node.map_arg(node.kwargs, lambda a: env[a])
        with mode:
            if node.op == "call_function" and node.target is torch.nn.functional.linear and _plain_linear(args, kwargs):
                # A linear's result is a fresh contiguous [..., out_features] tensor: made
                # directly, without tracing matmul's reshapes through symbolic sizes (the
                # larger part of this pass's time under dynamic shapes).
                val = _fresh(tuple(args[0].shape[:-1]) + (args[1].shape[0],), args, kwargs)
            elif _is_matmul(node) and (shape := _matmul_shape(args, kwargs)) is not None:
                # likewise a batched matmul's (HF's rotary frequencies times positions): torch
                # 2.11's matmul reads its sizes as ints, a guard that specialises the length
                val = _fresh(shape, args, kwargs)
            elif node.op == "call_method":
                val = getattr(args[0], node.target)(*args[1:], **kwargs)
            elif node.op == "call_function" and node.target in _SIZE_OPS:
                # read from the fake tensor: torch 2.11's fake dispatch of aten.size takes int()
                # of every size, specialising a symbolic length (a recompilation per length)
                val = args[0].size(*args[1:])
            elif node.op == "call_function":
                val = node.target(*args, **kwargs)
            elif node.op == "get_attr":
                val = attr_value(gm, node.target)
                # static: a shape env (export's) would otherwise give parameters symbolic sizes
                val = mode.from_tensor(val, static_shapes=True) if isinstance(val, torch.Tensor) else val
            else:
                val = fake(node)
        env[node] = val
        node.meta["example_value"] = val


def _fresh(shape, args, kwargs) -> torch.Tensor:
    """A fresh contiguous fake tensor of `shape` with the dtype and device of args[0], needing
    grad where an input does: then, as the op's own result, not a leaf (the graph may update it
    in place, which autograd refuses on a leaf that requires grad)."""
    x = args[0]
    grad = torch.is_grad_enabled() and any(
        a.requires_grad for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor))
    val = torch.empty(tuple(shape), dtype=x.dtype, device=x.device, requires_grad=grad)
    return val.clone() if grad else val


def _is_matmul(node: torch.fx.Node) -> bool:
    return ((node.op == "call_function" and node.target in MATMUL_FUNCS)
            or (node.op == "call_method" and node.target in MATMUL_METHODS))


def _matmul_shape(args, kwargs):
    """The result shape of matmul(a, b) for same-dtype, same-device tensors of at least 2 dims
    whose batch dims are provably equal (or absent from one); None otherwise."""
    if kwargs or len(args) != 2 or not all(isinstance(a, torch.Tensor) and a.dim() >= 2 for a in args):
        return None
    a, b = args
    if a.dtype != b.dtype or a.device != b.device:
        return None
    ba, bb = tuple(a.shape[:-2]), tuple(b.shape[:-2])
    if ba and bb and (len(ba) != len(bb) or not all(_compat.statically_known_equal(x, y) for x, y in zip(ba, bb))):
        return None
    return (ba or bb) + (a.shape[-2], b.shape[-1])


def _plain_linear(args, kwargs) -> bool:
    """linear(x, w[, b]) on same-dtype fake tensors, w 2-D: the common case whose output
    metadata is known without running it."""
    tensors = [a for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor)]
    return (len(args) >= 2 and isinstance(args[0], torch.Tensor) and isinstance(args[1], torch.Tensor)
            and args[1].dim() == 2 and args[0].dim() >= 1 and len({t.dtype for t in tensors}) == 1
            and len({t.device for t in tensors}) == 1)
