"""Masks as functions of (b, h, q_idx, kv_idx): the serialisable form and its evaluation.

Note [Mask functions]
A site's mask is `mask_mod(b, h, q_idx, kv_idx) -> bool` (True = the key is attended), the model
flex_attention defines, in global positions. The function may read per-token tensors t0..tk
(document ids, padding, positions: [b, n], [1, n] or [n], whole length, replicated on every
rank) at a batch row, a head and a query or key position; nothing in it is [n, n].

Custom ops take no callables, so the function travels as text: a straight-line program of
torch operations, one value per line,

    maskfn v1 tensors=1
    %0 = load t0 b q            # t0[b, q_idx]
    %1 = load t0 b kv           # t0[b, kv_idx]
    %2 = eq %0 %1
    %3 = le kv q
    %4 = and %2 %3
    return %4

operands: %i (an earlier line), the indices b, h, q, kv, literals (ints, floats, inf, -inf,
true, false). The ring op takes the text as a `str` argument and the tensors as a list, so
the function enters the schema, the rank fingerprint (the report's mask spec holds the text)
and the program `ringcc rewrite` saves. At run time the text is parsed once per distinct text
(`parse`, cached) and evaluated with torch on index tensors of any broadcastable shapes:
[b, 1, rows, 1] x [1, 1, 1, keys] for a block of the ring (`FnMask`), or scalar tensors
under flex_attention's vmap. The runtime splits each ring block by the function (`split`): a
block it empties is skipped (no kernel), a block it fills runs the unmasked kernel (the fused
cuDNN / flash / CPU flash kernels), and a partial block is cut into stripes of rows whose runs of
tiles are empty (no call), full (unmasked calls) or partial (masked calls, the function as their
mask: the exact math path, or the CPU kernel with the mask). The passes extract the function
from the graph (passes/extract_mask.py) or take it from a flex_attention call's mask_mod.

Note [Score functions]
A site's score modifier is `score_mod(score, b, h, q_idx, kv_idx) -> float`, flex_attention's
model, applied to the scaled score q.k * scale before the mask, in global positions. It travels
in the same text form with the header `scorefn v1 tensors=<k>` and one more operand, `score`:

    scorefn v1 tensors=1
    %0 = div score 50.0
    %1 = tanh %0
    %2 = mul %1 50.0              # soft-cap (Gemma2)
    %3 = load t0 h                # ALiBi slopes, one per head
    %4 = sub kv q
    %5 = float %4
    %6 = mul %3 %5
    %7 = add %2 %6
    return %7

Float ops (div, tanh, exp, log, sqrt, sigmoid) join the mask ops. Tensors are read as for
masks: per head (`load t0 h`), per token (`load t1 b kv`), or with both. The ring op takes the
text as `score_fn` and its tensors as `score_t0..score_t3`, so it enters the schema, the rank
fingerprint and saved programs as a mask does. A block that the function modifies runs
flex_attention with the function as its score_mod where masked blocks do (bf16/fp16 on CUDA:
runtime/flex.py, Note [Flex blocks]), else the exact math path (`FnScore`): the scores are
modified in place, and backward multiplies dS by the derivative d score_mod / d score,
evaluated by forward-mode differentiation of the program (`MaskFn.value_and_grad`), so the
gradients of q, k and v are exact. The tensors take no gradient.
"""

from __future__ import annotations

import functools
import math
import operator
from collections import Counter, OrderedDict
from dataclasses import dataclass, replace

import torch

VERSION = "maskfn v1"
SCORE_VERSION = "scorefn v1"
INDICES = ("b", "h", "q", "kv")
SCORE = "score"  # the score operand of a score function (Note [Score functions])


def _where(c, a, b):
    return torch.where(c, a, b) if isinstance(c, torch.Tensor) else (a if c else b)


def _not(x):
    return ~x if isinstance(x, torch.Tensor) else not x


def _min(a, b):
    return _where(a < b, a, b)


def _max(a, b):
    return _where(a < b, b, a)


def _fn(tensor_op, number_op):
    return lambda x: tensor_op(x) if isinstance(x, torch.Tensor) else number_op(x)


def _to(kind):
    def cast(x):
        if not isinstance(x, torch.Tensor):
            return {"bool": bool, "int": int, "float": float}[kind](x)
        if kind == "bool":
            return x if x.dtype == torch.bool else x != 0
        return x.long() if kind == "int" else x.float()
    return cast


# op -> (arity, evaluation)
OPS = {
    "add": (2, operator.add), "sub": (2, operator.sub), "mul": (2, operator.mul),
    "floordiv": (2, operator.floordiv), "remainder": (2, operator.mod), "neg": (1, operator.neg),
    "abs": (1, abs), "minimum": (2, _min), "maximum": (2, _max),
    "eq": (2, operator.eq), "ne": (2, operator.ne), "lt": (2, operator.lt), "le": (2, operator.le),
    "gt": (2, operator.gt), "ge": (2, operator.ge),
    "and": (2, operator.and_), "or": (2, operator.or_), "xor": (2, operator.xor), "not": (1, _not),
    "where": (3, _where), "bool": (1, _to("bool")), "int": (1, _to("int")), "float": (1, _to("float")),
    "div": (2, operator.truediv), "tanh": (1, _fn(torch.tanh, math.tanh)), "exp": (1, _fn(torch.exp, math.exp)),
    "log": (1, _fn(torch.log, math.log)), "sqrt": (1, _fn(torch.sqrt, math.sqrt)),
    "sigmoid": (1, _fn(torch.sigmoid, lambda x: 1.0 / (1.0 + math.exp(-x)))),
}


def _d_unary(op: str, x, y):
    """d op(x) / dx, given y = op(x)."""
    if op == "tanh":
        return 1 - y * y
    if op == "exp":
        return y
    if op == "log":
        return 1 / x
    if op == "sqrt":
        return 0.5 / y
    if op == "sigmoid":
        return y * (1 - y)
    if op == "neg":
        return -1.0
    if op == "abs":
        return _where(x < 0, -1.0, 1.0)
    if op == "float":
        return 1.0
    raise ValueError(f"a score function differentiates {op} of the score, which has no derivative here")


def _text(lines: tuple, n_tensors: int, kind: str) -> str:
    out = [f"{SCORE_VERSION if kind == 'score' else VERSION} tensors={n_tensors}"]
    for i, (op, args) in enumerate(lines):
        out.append(f"%{i} = {op} " + " ".join(_fmt(a) for a in args))
    out.append(f"return %{len(lines) - 1}")
    return "\n".join(out)


@dataclass(frozen=True)
class MaskFn:
    """A mask function (Note [Mask functions]), or with kind "score" a score function (Note
    [Score functions]), as a straight-line program. `lines`: (op, operands) per value; an
    operand is ("v", i) (line i), ("i", name) (an index, or the score), ("c", literal), or for
    `load` its first operand ("t", k) (tensor k). The last line is the result."""

    lines: tuple
    n_tensors: int
    kind: str = "mask"

    @property
    def text(self) -> str:
        # not a cached_property: its lock stops dynamo, which traces ringcc.ring_attention
        # inside a user's compiled function (a few lines: made at each read)
        return _text(self.lines, self.n_tensors, self.kind)

    @functools.cached_property
    def indices(self) -> frozenset:
        """The indices the function reads ("b", "h", "q", "kv"; "score" for a score function)."""
        return frozenset(a[1] for _, args in self.lines for a in args if a[0] == "i")

    @functools.cached_property
    def roles(self) -> dict:
        """{tensor k: set of the positions it is read at ("q", "kv", or neither)}."""
        out: dict = {}
        for op, args in self.lines:
            if op == "load":
                out.setdefault(args[0][1], set()).update(a[1] for a in args[1:] if a[0] == "i" and a[1] in ("q", "kv"))
        return out

    def __call__(self, b, h, q_idx, kv_idx, tensors=(), score=None):
        return self._run({"b": b, "h": h, "q": q_idx, "kv": kv_idx, SCORE: score}, tensors, False)[0]

    def value_and_grad(self, score, b, h, q_idx, kv_idx, tensors=()):
        """(score_mod(score, ..), d score_mod / d score) of a score function, by forward-mode
        differentiation of its program (Note [Score functions]); the derivative is a number or
        a tensor that broadcasts against the value."""
        return self._run({"b": b, "h": h, "q": q_idx, "kv": kv_idx, SCORE: score}, tensors, True)

    def _run(self, env: dict, tensors, grad: bool):
        vals, ders = [], []

        def get(a):
            kind, x = a
            return vals[x] if kind == "v" else env[x] if kind == "i" else x

        def der(a):
            kind, x = a
            return ders[x] if kind == "v" else (1.0 if x == SCORE else None) if kind == "i" else None

        for op, args in self.lines:
            if op == "load":
                vals.append(_load(tensors[args[0][1]], [get(a) for a in args[1:]]))
                ders.append(None)
                continue
            xs = [get(a) for a in args]
            y = OPS[op][1](*xs)
            vals.append(y)
            if grad:
                ders.append(_derivative(op, xs, [der(a) for a in args], y))
        return vals[-1], (ders[-1] if grad else None)


def _load(t: torch.Tensor, index: list):
    """t[index], its literal (int) indices taken first by select: beside index tensors, a
    literal becomes a tensor constant of the traced function (flex's mask and score graphs),
    which a compiled backward cannot hold ("FunctionalTensor on its own")."""
    for dim in reversed(range(len(index))):
        if isinstance(index[dim], int):
            t = t.select(dim, index.pop(dim))
    return t[tuple(index)] if index else t


def _derivative(op: str, xs: list, ds: list, y):
    """d y / d score of y = op(xs), given d x / d score per operand (None: zero)."""
    if all(d is None for d in ds):
        return None
    if op in ("add", "sub"):
        a, b = ds
        if b is None:
            return a
        b = -b if op == "sub" else b
        return b if a is None else a + b
    if op == "mul":
        a, b = ds
        terms = [t for t in (None if a is None else a * xs[1], None if b is None else xs[0] * b) if t is not None]
        return terms[0] if len(terms) == 1 else terms[0] + terms[1]
    if op == "div":
        a, b = ds
        out = None if a is None else a / xs[1]
        if b is not None:
            t = -xs[0] * b / (xs[1] * xs[1])
            out = t if out is None else out + t
        return out
    if op in ("minimum", "maximum"):
        a, b = (0.0 if d is None else d for d in ds)
        first = xs[0] < xs[1] if op == "minimum" else xs[1] < xs[0]
        return _where(first, a, b)
    if op == "where":
        a, b = (0.0 if d is None else d for d in ds[1:])
        return None if ds[1] is None and ds[2] is None else _where(xs[0], a, b)
    if op == "remainder":
        return ds[0] if ds[1] is None else _undifferentiable(op)
    if op in ("eq", "ne", "lt", "le", "gt", "ge", "and", "or", "xor", "not", "bool", "int", "floordiv"):
        return None  # piecewise constant in the score
    return ds[0] * _d_unary(op, xs[0], y)


def _undifferentiable(op: str):
    raise ValueError(f"a score function differentiates {op} with the score in its divisor, which has no "
                     "derivative here")


def _fmt(a) -> str:
    kind, x = a
    if kind == "v":
        return f"%{x}"
    if kind == "i":
        return x
    if kind == "t":
        return f"t{x}"
    if isinstance(x, bool):
        return "true" if x else "false"
    if isinstance(x, float):
        return "inf" if x == math.inf else "-inf" if x == -math.inf else repr(x)
    return str(int(x))


def _operand(tok: str, n_lines: int, n_tensors: int, line: str, kind: str = "mask"):
    if tok == SCORE and kind == "score":
        return ("i", SCORE)
    if tok.startswith("%"):
        i = int(tok[1:])
        if not 0 <= i < n_lines:
            raise ValueError(f"mask function line {line!r} reads %{i}, which is not an earlier line")
        return ("v", i)
    if tok in INDICES:
        return ("i", tok)
    if tok.startswith("t") and tok[1:].isdigit():
        k = int(tok[1:])
        if not 0 <= k < n_tensors:
            raise ValueError(f"mask function line {line!r} reads t{k}; the function has {n_tensors} tensors")
        return ("t", k)
    if tok in ("true", "false"):
        return ("c", tok == "true")
    if tok in ("inf", "-inf"):
        return ("c", float(tok))
    try:
        return ("c", int(tok))
    except ValueError:
        pass
    try:
        return ("c", float(tok))
    except ValueError:
        raise ValueError(f"mask function line {line!r}: {tok!r} is not an operand (%i, b, h, q, kv, t<k>, or a "
                         "number)") from None


@functools.lru_cache(maxsize=256)
def parse(text: str) -> MaskFn:
    """The MaskFn (a mask or a score function) of its text (cached per text: every layer and step reads the same few)."""
    rows = [r.split("#")[0].strip() for r in text.strip().splitlines()]
    rows = [r for r in rows if r]
    kinds = {VERSION: "mask", SCORE_VERSION: "score"}
    head = rows[0].split(" tensors=")[0] if rows else ""
    if head not in kinds:
        raise ValueError(f"a mask function starts with '{VERSION} tensors=<k>', a score function with "
                         f"'{SCORE_VERSION} tensors=<k>'; got {rows[:1]!r}")
    kind = kinds[head]
    n_tensors = int(rows[0].split("=", 1)[1])
    lines = []
    for r in rows[1:-1]:
        lhs, _, rhs = r.partition("=")
        if lhs.strip() != f"%{len(lines)}":
            raise ValueError(f"mask function line {r!r} should define %{len(lines)}")
        op, *toks = rhs.split()
        args = tuple(_operand(t, len(lines), n_tensors, r, kind) for t in toks)
        if op == "load":
            if not args or args[0][0] != "t":
                raise ValueError(f"mask function line {r!r}: load takes a tensor t<k> first")
        elif op not in OPS:
            raise ValueError(f"mask function line {r!r}: unknown op {op!r}; allowed: load, {', '.join(sorted(OPS))}")
        elif OPS[op][0] != len(args):
            raise ValueError(f"mask function line {r!r}: {op} takes {OPS[op][0]} operands, got {len(args)}")
        if op != "load" and any(a[0] == "t" for a in args):
            raise ValueError(f"mask function line {r!r}: a tensor is read only by load")
        lines.append((op, args))
    if not lines or rows[-1] != f"return %{len(lines) - 1}":
        raise ValueError(f"a mask function ends with 'return %<last line>'; got {rows[-1]!r}")
    return MaskFn(tuple(lines), n_tensors, kind)


# ---------------------------------------------------------------------------------------
# evaluation over ring blocks

# Tile counts of every classified block since the last reset (tests and the report read them):
# blocks "empty" / "full" / "partial", tiles ("tiles_empty", ...) of TILE x TILE pairs, and
# "pairs" (allowed (query, key) pairs this rank computes).
STATS: Counter = Counter()
TILE = 128
FLEX_TILE = 128  # flex_attention's sparse block size: the tiles of runtime/flex.py's BlockMasks
EVAL_ELEMENTS = 1 << 24  # (batch x heads x rows x keys) values per evaluation chunk


def reset_stats() -> None:
    STATS.clear()


def balance(group=None) -> float:
    """The ring's load balance under mask functions since the last `reset_stats`: the largest
    rank's count of allowed (query, key) pairs over the mean of the ranks of `group` (1.0:
    balanced; one all-reduce pair, every rank must call it)."""
    import torch.distributed as dist

    mine = float(STATS["pairs"])
    if not dist.is_available() or not dist.is_initialized():
        return 1.0
    t = torch.tensor([mine, mine], dtype=torch.float64)
    top, total = t[:1].clone(), t[1:].clone()
    dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
    dist.all_reduce(total, group=group)
    mean = float(total) / dist.get_world_size(group)
    return float(top) / mean if mean else 1.0


# Note [Consecutive positions]
# A call's rows (keys) usually hold consecutive global positions: every call of a contiguous
# ring, and each chunk's calls in zigzag. The call then also carries its first row's (key's)
# position, and flex's mask and score functions compute a position as start + index instead of
# loading it from the positions tensor per score (runtime/flex.py). Where the positions jump
# (a call over both zigzag chunks), the start is None and the functions load them.


def _shifted(starts: tuple, r0: int, c0: int) -> tuple:
    """The (row, key) starts of a sub-call from row r0 and key c0."""
    q, k = starts
    return (None if q is None else q + r0, None if k is None else k + c0)


@dataclass(frozen=True)
class FnMask:
    """The mask of one block call: the function at the global positions of the call's rows
    (q_pos) and keys (k_pos), batch rows [b0, b1). `rows` evaluates some of them, as a bool
    [b or 1, h or 1, rows, keys] (kernels take it as a position mask)."""

    fn: MaskFn
    tensors: tuple
    q_pos: torch.Tensor
    k_pos: torch.Tensor
    batch: int
    heads: int
    b0: int = 0
    h0: int = 0
    causal: bool = False  # also key position <= query position (a causal diagonal's sub-call)
    # what determines q_pos and k_pos (the ring's layout, ranks and call bounds), or None: the
    # positions are data. With it, what is built from the call is reused (`memo`).
    where: tuple | None = None
    # tiles other calls compute (Note [Dense parts]): (r0, r1, c0, c1, lower) in tiles of the
    # call, a rectangle (lower: its lower triangle, the diagonal in) the call leaves out
    skip: tuple = ()
    # the global positions of the first row and key where the rows' (keys') positions follow
    # each other, else None (Note [Consecutive positions])
    starts: tuple = (None, None)

    def rows(self, r0: int, r1: int, c0: int = 0, c1: int | None = None) -> torch.Tensor:
        dev = self.q_pos.device
        ind = self.fn.indices
        b = torch.arange(self.b0, self.b0 + self.batch, device=dev)[:, None, None, None] if "b" in ind else 0
        h = torch.arange(self.h0, self.h0 + self.heads, device=dev)[None, :, None, None] if "h" in ind else 0
        q = self.q_pos[r0:r1][None, None, :, None]
        k = self.k_pos[c0:c1][None, None, None, :]
        m = self.fn(b, h, q, k, self.tensors)
        if not isinstance(m, torch.Tensor):
            m = torch.tensor(bool(m), device=dev)
        if self.causal:
            m = m & (k <= q)
        if self.skip:  # pairs other calls compute (Note [Dense parts])
            m = m & ~self.skipped()[r0:r1, c0:c1][None, None]
        shape = (self.batch if "b" in ind else 1, self.heads if "h" in ind else 1, q.shape[2], k.shape[3])
        return m.to(torch.bool).expand(shape)

    def skipped(self) -> torch.Tensor:
        """bool [rows, keys]: the pairs in the tiles of `skip`."""
        lq, lk = self.q_pos.shape[0], self.k_pos.shape[0]
        return skipped_tiles(self).repeat_interleave(FLEX_TILE, 0)[:lq].repeat_interleave(FLEX_TILE, 1)[:, :lk]

    def sub(self, r0: int, r1: int, c0: int, c1: int, b0: int = 0, b1: int | None = None) -> "FnMask":
        b1 = self.batch if b1 is None else b1
        where = None if self.where is None else (*self.where, (r0, r1, c0, c1))
        skip = ()
        if self.skip:  # tiles of the sub-call: its bounds on tile bounds
            if r0 % FLEX_TILE or c0 % FLEX_TILE:
                raise AssertionError(f"a mask with skipped tiles cut off the tiles ({r0}, {c0})")
            t0, u0 = r0 // FLEX_TILE, c0 // FLEX_TILE
            skip = tuple((a - t0, b - t0, c - u0, d - u0, low) for a, b, c, d, low in self.skip)
        return FnMask(self.fn, self.tensors, self.q_pos[r0:r1], self.k_pos[c0:c1], b1 - b0, self.heads, self.b0 + b0,
                      self.h0, self.causal, where, skip, _shifted(self.starts, r0, c0))

    def row_chunk(self, keys: int) -> int:
        ind = self.fn.indices
        per_row = (self.batch if "b" in ind else 1) * (self.heads if "h" in ind else 1) * max(1, keys)
        return max(1, EVAL_ELEMENTS // per_row)


SPLIT_ROWS = 512  # query rows per stripe of a partial block's calls (a multiple of TILE)


def split(mask: FnMask) -> tuple[str, list]:
    """The block call of `mask` (the function at its rows and keys, its causal flag folded in as
    key position <= query position) by what the function allows: ("empty", []), ("full", []) when
    it allows every pair (with `mask.causal`: every pair of the causal diagonal), or
    ("partial", calls): per stripe of SPLIT_ROWS rows, the runs of TILE-key tiles that are all
    allowed (unmasked calls), partly allowed (masked calls: the function as their mask) and none
    (no call); stripes with the same runs share their calls. A call is (r0, r1, c0, c1, masked).
    Evaluated in chunks of rows (never the [rows, keys] mask of a whole large block); every
    block and tile is counted in STATS."""
    lq, lk = mask.q_pos.shape[0], mask.k_pos.shape[0]
    kt = -(-lk // TILE)
    step = max(SPLIT_ROWS, mask.row_chunk(lk) // SPLIT_ROWS * SPLIT_ROWS)
    somes, everys = [], []
    cover, pairs = True, 0
    pad = torch.nn.functional.pad
    for r0 in range(0, lq, step):
        r1 = min(lq, r0 + step)
        m = mask.rows(r0, r1)  # [b or 1, h or 1, rows, keys], the diagonal folded in
        if mask.causal:  # the function alone on the diagonal's pairs: does it leave any out?
            plain = FnMask(mask.fn, mask.tensors, mask.q_pos, mask.k_pos, mask.batch, mask.heads, mask.b0, mask.h0)
            band = mask.k_pos[None, :] <= mask.q_pos[r0:r1, None]
            cover = cover and bool((plain.rows(r0, r1) | ~band).all())
        else:
            cover = cover and bool(m.all())
        per_row = m.any(1)  # a pair allowed in some head
        pairs += int(per_row.sum()) * (1 if per_row.shape[0] > 1 else mask.batch)
        flat = m.reshape(-1, r1 - r0, lk).any(0) if m.shape[0] * m.shape[1] > 1 else m[0, 0]
        full = m.reshape(-1, r1 - r0, lk).all(0) if m.shape[0] * m.shape[1] > 1 else m[0, 0]
        rows_pad = -(-(r1 - r0) // SPLIT_ROWS) * SPLIT_ROWS - (r1 - r0)
        s_ = pad(flat, (0, kt * TILE - lk, 0, rows_pad), value=False).view(-1, SPLIT_ROWS, kt, TILE)
        e_ = pad(full, (0, kt * TILE - lk), value=True)
        e_ = pad(e_, (0, 0, 0, rows_pad), value=True).view(-1, SPLIT_ROWS, kt, TILE)
        somes.append(s_.any(3).any(1))
        everys.append(e_.all(3).all(1))
        _count_tiles(m.reshape(-1, r1 - r0, lk))
    some, every = torch.cat(somes).cpu(), torch.cat(everys).cpu()
    STATS["pairs"] += pairs
    if not bool(some.any()):
        STATS["empty"] += 1
        return "empty", []
    if cover:
        STATS["full"] += 1
        return "full", []
    STATS["partial"] += 1
    calls, last = [], None
    for si in range(some.shape[0]):
        runs, state, start = [], None, 0
        for t in range(kt + 1):
            st = None if t == kt else ("full" if every[si, t] else "partial" if some[si, t] else "empty")
            if st != state:
                if state in ("full", "partial"):
                    runs.append((start * TILE, min(lk, t * TILE), state == "partial"))
                state, start = st, t
        r0, r1 = si * SPLIT_ROWS, min(lq, (si + 1) * SPLIT_ROWS)
        if last is not None and last[1] == runs:
            last[0][1] = r1
            continue
        last = ([r0, r1], runs)
        calls.append(last)
    out = [(r0, r1, c0, c1, masked) for (r0, r1), runs in calls for c0, c1, masked in runs]
    STATS["calls_masked"] += sum(1 for c in out if c[4])
    STATS["calls_unmasked"] += sum(1 for c in out if not c[4])
    return "partial", out


def _count_tiles(flat: torch.Tensor) -> None:
    """Count the TILE x TILE tiles of a [bh, rows, keys] chunk by state (a tile is full or empty
    only when it is so in every batch row and head)."""
    bh, rows, keys = flat.shape
    rt, kt = -(-rows // TILE), -(-keys // TILE)
    pad = torch.nn.functional.pad
    t = pad(flat, (0, kt * TILE - keys, 0, rt * TILE - rows)).view(bh, rt, TILE, kt, TILE)
    some = t.any(4).any(2).any(0)
    valid = pad(torch.ones(rows, keys, dtype=torch.bool, device=flat.device),
                (0, kt * TILE - keys, 0, rt * TILE - rows)).view(rt, TILE, kt, TILE)
    every = (t | ~valid).all(4).all(2).all(0)
    STATS["tiles_empty"] += int((~some).sum())
    STATS["tiles_full"] += int(every.sum())
    STATS["tiles_partial"] += int((some & ~every).sum())


# ---------------------------------------------------------------------------------------
# tile states from bounds

# Note [Tile bounds]
# A kernel that skips empty tiles and runs full ones unmasked (flex_attention's BlockMask) needs
# each TILE x TILE tile's state, not the [rows, keys] mask. `tile_states` finds them by running
# the function once over intervals instead of values: q and kv are the [min, max] of the
# positions in each query / key tile, b and h are exact, a load of a per-token tensor at q (or
# kv) is the [min, max] of its values in the tile, and every op maps intervals to an interval
# that holds all its results (a comparison to "true for every pair" / "true for some pair").
# O(tiles) work, whatever the function. The states are conservative: a tile is full only when
# the function is true on every pair, empty only when it is false on every pair; anything the
# bounds cannot decide (a load at a computed index, division by a non-constant) is partial,
# and a partial tile evaluates the function per pair, so the result is exact either way.

_UNKNOWN = (-math.inf, math.inf)


def _ival_mul(a, b):
    ps = [x * y for x in a for y in b]
    lo, hi = ps[0], ps[0]
    for p in ps[1:]:
        lo, hi = torch.minimum(torch.as_tensor(lo), torch.as_tensor(p)), torch.maximum(torch.as_tensor(hi), torch.as_tensor(p))
    return lo, hi


def _const(x) -> bool:
    return not isinstance(x, torch.Tensor)


def _ival_floordiv(a, b):
    lo_b, hi_b = b
    if _const(lo_b) and lo_b == hi_b and lo_b > 0:
        return a[0] // lo_b, a[1] // lo_b
    return _UNKNOWN


def _ival_remainder(a, b):
    c = b[0]
    if _const(c) and c == b[1] and isinstance(c, int) and c > 0:
        same = (a[0] // c) == (a[1] // c)
        return (torch.where(torch.as_tensor(same), a[0] % c, 0), torch.where(torch.as_tensor(same), a[1] % c, c - 1))
    return _UNKNOWN


def _ival_abs(a):
    lo, hi = torch.as_tensor(a[0]), torch.as_tensor(a[1])
    return (torch.where(lo >= 0, lo, torch.where(hi <= 0, -hi, torch.zeros_like(lo))),
            torch.maximum(lo.abs(), hi.abs()))


# Bool values are (must, may): true for every pair / for some pair.
def _cmp(op):
    def f(a, b):
        (al, ah), (bl, bh) = a, b
        if op == "lt":
            return ah < bl, al < bh
        if op == "le":
            return ah <= bl, al <= bh
        if op == "gt":
            return al > bh, ah > bl
        if op == "ge":
            return al >= bh, ah >= bl
        exact = (al == ah) & (bl == bh) & (al == bl)
        overlap = (al <= bh) & (bl <= ah)
        return (exact, overlap) if op == "eq" else (~torch.as_tensor(overlap), ~torch.as_tensor(exact))
    return f


def _band(a, b):
    return a[0] & b[0], a[1] & b[1]


def _bor(a, b):
    return a[0] | b[0], a[1] | b[1]


def _bnot(a):
    return ~torch.as_tensor(a[1]), ~torch.as_tensor(a[0])


def _bxor(a, b):
    (am, ay), (bm, by) = a, b
    return (am & ~torch.as_tensor(by)) | (~torch.as_tensor(ay) & bm), ~((am & bm) | (~torch.as_tensor(ay) & ~torch.as_tensor(by)))


def _bwhere(c, a, b, kinds):
    must, may = c
    if kinds == "bool":  # (must, may) pairs
        return (must & a[0]) | (~torch.as_tensor(may) & b[0]) | (a[0] & b[0]), (may & a[1]) | (~torch.as_tensor(must) & b[1])
    lo = torch.where(torch.as_tensor(must), torch.as_tensor(a[0]), torch.where(torch.as_tensor(may), torch.minimum(torch.as_tensor(a[0]), torch.as_tensor(b[0])), torch.as_tensor(b[0])))
    hi = torch.where(torch.as_tensor(must), torch.as_tensor(a[1]), torch.where(torch.as_tensor(may), torch.maximum(torch.as_tensor(a[1]), torch.as_tensor(b[1])), torch.as_tensor(b[1])))
    return lo, hi


_BOOL_OPS = {"and": _band, "or": _bor, "xor": _bxor}
_CMP_OPS = {op: _cmp(op) for op in ("lt", "le", "gt", "ge", "eq", "ne")}


def _as_num(g):
    """A bound as numbers: a bool one's (must, may) as the interval [must, may] of 0 / 1."""
    (a, b), kind = g
    if kind == "bool":
        return (torch.as_tensor(a).long(), torch.as_tensor(b).long()), "num"
    return (a, b), kind


def _as_bool(g):
    """A bound as (must, may): a number is true where it is not 0."""
    (lo, hi), kind = g
    if kind == "bool":
        return (lo, hi), kind
    lo, hi = torch.as_tensor(lo), torch.as_tensor(hi)
    return ((lo > 0) | (hi < 0), ~((lo == 0) & (hi == 0))), "bool"


def tile_minmax(x: torch.Tensor, tiles: int, tile: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(min, max) over each `tile` of the last dim (the last tile's missing entries repeat its last)."""
    pad = tiles * tile - x.shape[-1]
    if pad:
        x = torch.cat([x, x[..., -1:].expand(*x.shape[:-1], pad)], -1)
    x = x.reshape(*x.shape[:-1], tiles, tile)
    return x.amin(-1), x.amax(-1)


def tile_states(mask: FnMask, tile: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(some, full) bool [b or 1, h or 1, row tiles, key tiles] of `mask`'s call, tiles of `tile`
    (default TILE) pairs a side: where the function (and the causal flag) holds for some / for
    every pair (Note [Tile bounds])."""
    fn, dev = mask.fn, mask.q_pos.device
    tile = tile or TILE
    lq, lk = mask.q_pos.shape[0], mask.k_pos.shape[0]
    qt, kt = -(-lq // tile), -(-lk // tile)
    ind = fn.indices
    b = torch.arange(mask.b0, mask.b0 + mask.batch, device=dev)[:, None, None, None] if "b" in ind else 0
    h = torch.arange(mask.h0, mask.h0 + mask.heads, device=dev)[None, :, None, None] if "h" in ind else 0
    qlo, qhi = (t[None, None, :, None] for t in tile_minmax(mask.q_pos.long(), qt, tile))
    klo, khi = (t[None, None, None, :] for t in tile_minmax(mask.k_pos.long(), kt, tile))
    env = {"b": (b, b), "h": (h, h), "q": (qlo, qhi), "kv": (klo, khi)}
    vals, kinds = [], []

    def get(a):
        kind, x = a
        if kind == "v":
            return vals[x], kinds[x]
        if kind == "i":
            return env[x], "num"
        if isinstance(x, bool):
            return (x, x), "bool"
        return (x, x), "num"

    for op, args in fn.lines:
        if op == "load":
            vals.append(_load_bounds(mask, args, qt, kt, tile))
            kinds.append("num")
            continue
        got = [get(a) for a in args if a[0] != "t"]
        if op not in ("and", "or", "xor", "not", "where", "bool", "int", "float"):
            got = [_as_num(g) for g in got]
        xs = [g[0] for g in got]
        if op in _CMP_OPS:
            vals.append(_CMP_OPS[op](*xs)), kinds.append("bool")
        elif op in _BOOL_OPS:
            vals.append(_BOOL_OPS[op](*(_as_bool(g)[0] for g in got))), kinds.append("bool")
        elif op == "not":
            vals.append(_bnot(_as_bool(got[0])[0])), kinds.append("bool")
        elif op == "where":
            kind = "bool" if got[1][1] == "bool" and got[2][1] == "bool" else "num"
            a, c = (g[0] if kind == "bool" else _as_num(g)[0] for g in got[1:])
            vals.append(_bwhere(_as_bool(got[0])[0], a, c, kind)), kinds.append(kind)
        elif op == "bool":
            vals.append(_as_bool(got[0])[0]), kinds.append("bool")
        elif op in ("int", "float"):
            vals.append(_as_num(got[0])[0]), kinds.append("num")
        elif op in ("add", "sub", "mul", "minimum", "maximum"):
            a, c = xs
            vals.append({"add": lambda: (a[0] + c[0], a[1] + c[1]), "sub": lambda: (a[0] - c[1], a[1] - c[0]),
                         "mul": lambda: _ival_mul(a, c),
                         "minimum": lambda: (_min(a[0], c[0]), _min(a[1], c[1])),
                         "maximum": lambda: (_max(a[0], c[0]), _max(a[1], c[1]))}[op]())
            kinds.append("num")
        elif op == "neg":
            vals.append((-xs[0][1], -xs[0][0])), kinds.append("num")
        elif op == "abs":
            vals.append(_ival_abs(xs[0])), kinds.append("num")
        elif op == "floordiv":
            vals.append(_ival_floordiv(*xs)), kinds.append("num")
        elif op == "remainder":
            vals.append(_ival_remainder(*xs)), kinds.append("num")
        else:
            raise AssertionError(f"no bounds for mask function op {op!r}")
    (must, may), _ = _as_bool((vals[-1], kinds[-1]))
    if mask.causal:  # key position <= query position
        must, may = _band((must, may), _CMP_OPS["le"](env["kv"][0:2], env["q"][0:2]))
    shape = (mask.batch if "b" in ind else 1, mask.heads if "h" in ind else 1, qt, kt)
    as_mask = (lambda x: torch.as_tensor(x, device=dev).to(torch.bool).expand(shape))
    return as_mask(may), as_mask(must)


# Note [Built once per mask]
# Every layer of a step calls attention with the same mask tensors (one graph input feeds
# them all), forward and backward, so what a call builds from its mask (its state, its
# BlockMask) is the same for each of them: `memo` keeps the last MEMO_ENTRIES, keyed by the
# function, the call's positions as the ring derives them (FnMask.where), its batch rows and
# heads, and the identity and version counter of each tensor it reads. A kept entry holds
# those tensors, so an identity is never reused while its entry lives, and an in-place write
# bumps the version: a stale entry is never returned. Positions that are data (where = None)
# are never kept.

MEMO_ENTRIES = 64
_MEMO: "OrderedDict[tuple, object]" = OrderedDict()


def memo(mask: FnMask, what: tuple, build, tensors: tuple = ()):
    """build(), or what it returned for the same call and tensors (Note [Built once per mask])."""
    if mask.where is None:
        return build()
    reads = (*mask.tensors, *(t for t in tensors if t is not None))
    key = (what, mask.fn, mask.where, mask.batch, mask.heads, mask.b0, mask.h0, mask.causal, mask.skip,
           tuple((id(t), t._version) for t in reads))
    hit = _MEMO.get(key)
    if hit is not None:
        _MEMO.move_to_end(key)
        return hit[1]
    value = build()
    _MEMO[key] = (reads, value)
    while len(_MEMO) > MEMO_ENTRIES:
        _MEMO.popitem(last=False)
    return value


def classify(mask: FnMask, tile: int | None = None) -> str:
    """"empty", "full" or "partial": the state of `mask`'s whole call from its tile states (Note
    [Tile bounds]; one host read), counted in STATS with its tiles. A call on flex_attention
    is classified here; `split` (exact, per pair) serves the other kernels."""
    state, tiles = memo(mask, ("state", tile), lambda: _state(mask, tile))
    STATS[state] += 1
    for name, count in zip(("tiles_empty", "tiles_full", "tiles_partial"), tiles):
        STATS[name] += count
    return state


def _state(mask: FnMask, tile: int | None) -> tuple[str, tuple[int, int, int]]:
    some, full = tile_states(mask, tile)
    counts = [some.sum(), full.sum()]
    if mask.causal:  # a causal diagonal the function alone fills runs as the causal kernel
        counts.append(tile_states(FnMask(mask.fn, mask.tensors, mask.q_pos, mask.k_pos, mask.batch, mask.heads,
                                         mask.b0, mask.h0), tile)[1].all())
    n_some, n_full, *cover = (int(x) for x in torch.stack(counts).cpu())
    n = some.numel()
    state = "empty" if n_some == 0 else "full" if n_full == n or (cover and cover[0]) else "partial"
    return state, (n - n_some, n_full, n_some - n_full)


# Note [Dense parts]
# flex_attention runs a partial call's full tiles without the mask, but the fused cuDNN kernel
# is faster on them (64K causal on an H200, bf16, 16 heads of 128: 109 ms against flex's 153
# ms, about 0.34 us less per 128 x 128 tile). On CUDA a partial call under a mask function (and
# no key mask or score function, which the fused kernels do not take) hands its large dense
# regions to the fused kernels, from its tile states (Note [Tile bounds]):
# - on a causal diagonal (rows and keys at the same positions), squares whose lower triangle
#   the function alone fills run as causal calls: each long document of a packed sequence;
# - elsewhere, rectangles of tiles the function fills run as unmasked calls.
# The tiles the parts leave run as one flex call whose BlockMask and function skip the parts'
# tiles (FnMask.skip), or none when nothing is left. The parts and the rest cover disjoint
# tiles of the call, and the ring merges them through the LSE as it merges any calls of a
# block. Each part is a call of its own in forward and backward, with its merges: eight causal
# documents of 4K tokens as parts took 13.3 ms on the H200 against 6.4 ms with the block whole
# on flex, about 0.85 ms per part, so a part pays for itself from about 2500 tiles (a causal
# square of about 70 tiles a side). A part is at least DENSE_SIDE tiles a side (16K tokens),
# at most DENSE_PARTS per call (the largest). Counted in STATS: calls_dense, tiles_dense.

DENSE_SIDE = 128
DENSE_PARTS = 32


def dense_parts(mask: FnMask) -> tuple[tuple, FnMask | None]:
    """(parts, rest) of a partial call (Note [Dense parts]): parts (r0, r1, c0, c1, causal) in rows
    and keys of the call, and the masked call of the tiles they leave (`mask` with the parts'
    tiles in `skip`), or None when they leave none."""
    if min(mask.q_pos.shape[0], mask.k_pos.shape[0]) < DENSE_SIDE * FLEX_TILE:  # no part fits: no host read
        return (), mask
    parts, tiles, rest, n = memo(mask, ("dense",), lambda: _dense_parts(mask, FLEX_TILE))
    STATS["calls_dense"] += len(parts)
    STATS["tiles_dense"] += n
    return parts, (replace(mask, skip=tiles) if rest else None)


def _dense_parts(mask: FnMask, tile: int) -> tuple[tuple, tuple, bool, int]:
    """(parts in rows and keys, the same in tiles, whether tiles are left, the tiles covered)."""
    lq, lk = mask.q_pos.shape[0], mask.k_pos.shape[0]
    plain = FnMask(mask.fn, mask.tensors, mask.q_pos, mask.k_pos, mask.batch, mask.heads, mask.b0, mask.h0)
    some, full = tile_states(plain, tile)
    some, full = some.flatten(0, 1).any(0), full.flatten(0, 1).all(0)  # every batch row and head
    # a causal diagonal: the kernel's causal mask is the positions' only when they are the same
    same = (mask.q_pos == mask.k_pos).all() if lq == lk and mask.causal else torch.tensor(False)
    states = torch.cat([some.flatten(), full.flatten(), same.to(some.device).view(1)]).cpu()  # one host read
    qt, kt = full.shape
    some, full, aligned = states[:qt * kt].view(qt, kt), states[qt * kt:-1].view(qt, kt), bool(states[-1])
    if aligned:
        some = some & (torch.arange(kt)[None, :] <= torch.arange(qt)[:, None])  # tiles with some pair kv <= q
    parts = _squares(full) if aligned else _rectangles(full) if not mask.causal else []
    parts = tuple(sorted(parts, key=lambda p: -(p[1] - p[0]) * (p[3] - p[2]))[:DENSE_PARTS])
    covered = _covered(parts, qt, kt)
    rows = tuple((r0 * tile, min(lq, r1 * tile), c0 * tile, min(lk, c1 * tile), low) for r0, r1, c0, c1, low in parts)
    return rows, parts, bool((some & ~covered).any()), int(covered.sum())


def _squares(full: torch.Tensor) -> list:
    """Squares [t0, t1) of tiles on the diagonal whose lower triangle (diagonal in) is full."""
    out, i, qt = [], 0, full.shape[0]
    while i < qt:
        if not bool(full[i, i]):
            i += 1
            continue
        j = i + 1
        while j < min(qt, full.shape[1]) and bool(full[j, i:j + 1].all()):
            j += 1
        if j - i >= DENSE_SIDE:
            out.append((i, j, i, j, True))
        i = j
    return out


def _rectangles(full: torch.Tensor) -> list:
    """Rectangles of full tiles: runs of full tiles per tile row, stripes of rows with the same runs."""
    out, open_ = [], {}
    rows = [tuple(_runs(full[r])) for r in range(full.shape[0])] + [()]
    for r, runs in enumerate(rows):
        for run in list(open_):
            if run not in runs:
                r0 = open_.pop(run)
                if r - r0 >= DENSE_SIDE and run[1] - run[0] >= DENSE_SIDE:
                    out.append((r0, r, run[0], run[1], False))
        for run in runs:
            open_.setdefault(run, r)
    return out


def _runs(row: torch.Tensor) -> list:
    idx = torch.nonzero(torch.diff(torch.cat([torch.zeros(1, dtype=torch.int8), row.to(torch.int8),
                                              torch.zeros(1, dtype=torch.int8)]))).flatten().tolist()
    return list(zip(idx[::2], idx[1::2]))


def _covered(parts, qt: int, kt: int) -> torch.Tensor:
    """bool [qt, kt]: the tiles of `parts` (in tiles; a lower part's diagonal runs through its
    corner (r0, c0)), clipped to the grid: a sub-call's parts may reach past its rows."""
    cov = torch.zeros(qt, kt, dtype=torch.bool)
    for r0, r1, c0, c1, low in parts:
        a, b, c, d = max(r0, 0), min(r1, qt), max(c0, 0), min(c1, kt)
        if a < b and c < d:
            block = torch.ones(b - a, d - c, dtype=torch.bool)
            cov[a:b, c:d] |= block.tril((a - r0) - (c - c0)) if low else block
    return cov


def skipped_tiles(mask: FnMask) -> torch.Tensor | None:
    """bool [row tiles, key tiles] of FLEX_TILE: the tiles of `mask.skip` (Note [Dense parts]), or None."""
    if not mask.skip:
        return None
    lq, lk = mask.q_pos.shape[0], mask.k_pos.shape[0]
    return _covered(mask.skip, -(-lq // FLEX_TILE), -(-lk // FLEX_TILE)).to(mask.q_pos.device)


def _load_bounds(mask: FnMask, args, qt: int, kt: int, tile: int):
    """Bounds of `load t<k> idx..`: a per-token tensor read at b / h / constants and at q or kv
    itself gives each tile's [min, max]; any other read is unbounded (Note [Tile bounds])."""
    t = mask.tensors[args[0][1]]
    idx = args[1:]
    pos = [i for i, a in enumerate(idx) if a == ("i", "q") or a == ("i", "kv")]
    others_ok = all(a[0] == "c" or a in (("i", "b"), ("i", "h"), ("i", "q"), ("i", "kv")) for a in idx)
    if len(pos) != 1 or pos[0] != len(idx) - 1 or not others_ok or len(idx) != t.dim():
        return _UNKNOWN
    which = idx[-1][1]
    at = (mask.q_pos if which == "q" else mask.k_pos).long()
    lead = []
    for d, a in enumerate(idx[:-1]):
        if a[0] == "c":
            lead.append(slice(int(a[1]), int(a[1]) + 1))
        elif a[1] == "b":
            lead.append(slice(mask.b0, mask.b0 + mask.batch) if t.shape[d] > 1 else slice(None))
        else:
            lead.append(slice(mask.h0, mask.h0 + mask.heads) if t.shape[d] > 1 else slice(None))
    vals = t[tuple(lead)].index_select(-1, at) if lead else t.index_select(0, at)
    lo, hi = tile_minmax(vals, qt if which == "q" else kt, tile)
    # leading dims: b -> dim 0, h -> dim 1 of [b, h, q tiles, k tiles]
    names = [a[1] if a[0] == "i" else None for a in idx[:-1]]
    sizes = list(lo.shape)
    shape = [1, 1, 1, 1]
    for n, s in zip(names, sizes[:-1]):
        if n == "b":
            shape[0] = s
        elif n == "h":
            shape[1] = s
    shape[2 if which == "q" else 3] = sizes[-1]
    return lo.reshape(shape), hi.reshape(shape)


# ---------------------------------------------------------------------------------------
# score functions (Note [Score functions])


@dataclass(frozen=True)
class FnScore:
    """The score function of one block call: `fn` at the global positions of the call's rows
    (q_pos) and keys (k_pos, from their first on: a call over some of them slices them), batch
    rows from b0 and heads from h0 of the site."""

    fn: MaskFn
    tensors: tuple
    q_pos: torch.Tensor
    k_pos: torch.Tensor
    b0: int = 0
    h0: int = 0
    # the global positions of the first row and key where the rows' (keys') positions follow
    # each other, else None (Note [Consecutive positions])
    starts: tuple = (None, None)

    def sub(self, r0: int, c0: int = 0) -> "FnScore":
        """The function of the call's rows from r0 and keys from c0."""
        return FnScore(self.fn, self.tensors, self.q_pos[r0:], self.k_pos[c0:], self.b0, self.h0,
                       _shifted(self.starts, r0, c0))

    def _indices(self, s: torch.Tensor):
        dev, ind = s.device, self.fn.indices
        b = torch.arange(self.b0, self.b0 + s.shape[0], device=dev)[:, None, None, None] if "b" in ind else 0
        h = torch.arange(self.h0, self.h0 + s.shape[1], device=dev)[None, :, None, None] if "h" in ind else 0
        return b, h, self.q_pos[:s.shape[2]][None, None, :, None], self.k_pos[:s.shape[3]][None, None, None, :]

    def apply_(self, s: torch.Tensor, keep_grad: bool = False):
        """s [b, h, rows, keys] (scaled scores) replaced by score_mod(s, ..) in place; with
        keep_grad returns d score_mod / d score at s (a tensor that broadcasts against s, or
        a number) for the backward."""
        b, h, q, kv = self._indices(s)
        if keep_grad:
            val, der = self.fn.value_and_grad(s, b, h, q, kv, self.tensors)
        else:
            val, der = self.fn(b, h, q, kv, self.tensors, score=s), None
        s.copy_(val)
        if not keep_grad:
            return None
        return 0.0 if der is None else der


def builtin_score_fn(softcap: float | None, alibi: bool) -> MaskFn | None:
    """The score function of soft-capping c * tanh(s / c) (c = softcap) and an ALiBi bias
    slope[h] * (kv - q) with the slopes as tensor t0, for ringcc.ring_attention's softcap= and
    alibi_slopes=; None when there is neither."""
    lines: list = []
    top = ("i", SCORE)
    if softcap:
        lines += [("div", (top, ("c", float(softcap)))), ("tanh", (("v", 0),)), ("mul", (("v", 1), ("c", float(softcap))))]
        top = ("v", 2)
    if alibi:
        n = len(lines)
        lines += [("load", (("t", 0), ("i", "h"))), ("sub", (("i", "kv"), ("i", "q"))), ("float", (("v", n + 1),)),
                  ("mul", (("v", n), ("v", n + 2))), ("add", (top, ("v", n + 3)))]
    return MaskFn(tuple(lines), 1 if alibi else 0, "score") if lines else None
