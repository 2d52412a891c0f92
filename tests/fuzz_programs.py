"""Random small programs for the differential fuzzer (tests/test_fuzz.py).

A program is plain data (a dict of ints, strings and lists: picklable, printable as a Python
literal, so a failing one pastes into a regression test):

    {"seed": 3, "b": 2, "n": 8, "d": 8, "world": 2, "pad": False,
     "ops": [["linear", {}], ["scatter", {"dim": "seq", "inplace": True}], ...],
     "out": "h", "tail": "last", "x_grad": True}

`build(prog)` makes an nn.Module whose forward applies the ops in turn to x [b, n, d] (each op
maps [b, n, d] to [b, n, d], with its own parameters and constant index buffers, made from the
seed); `out` says what the module returns (the sequence-carrying h, h with a reduction of it,
or a scalar); `tail` is what eager code then reads from the returned value (a
SequenceSharded output under ringcc). `run_case(rank, world, prog)` runs on every rank of a
pool: eager, then torch.compile with ringcc (aot_eager), with the same inputs, and returns a
verdict: the forward and every gradient (parameters and the input) equal eager's and the same
parameters get a gradient, or an error, with what it says and where it was raised.

Each op class names the torch-level ops it calls (`names`): an error that ringcc raises about
a program must name one of them (test_fuzz.verdict). Ops cover what the sharding rules handle
(linear, norms, pointwise, attention, views, reductions, cumsum, custom Functions) and what
they do not (in-place writes, scatter / gather / index ops, topk and sort along the sequence,
cumprod, complex views, convolutions over the sequence).
"""

from __future__ import annotations

import math
import os
import traceback

import torch
import torch.nn as nn
import torch.nn.functional as F

# A relative error (max-norm, over the reference's largest magnitude) below this is exact
# for fp32 (sums over ranks and ring merges reorder additions).
TOL = 2e-5


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _perm(m: int, seed: int) -> torch.Tensor:
    return torch.randperm(m, generator=_gen(seed))


class Op(nn.Module):
    """One step h [b, n, d] -> h [b, n, d]."""

    names: tuple[str, ...] = ()

    def __init__(self, b: int, n: int, d: int, seed: int, **args):
        super().__init__()
        self.b, self.n, self.d, self.seed = b, n, d, seed
        self.args = args

    @staticmethod
    def draw(draw, st, b, n, d) -> dict:
        return {}


# -- token-local ops (the rules keep them on shards) ---------------------------------------


class Linear(Op):
    names = ("linear",)

    def __init__(self, b, n, d, seed, **args):
        super().__init__(b, n, d, seed, **args)
        self.lin = nn.Linear(d, d)

    def forward(self, h):
        return self.lin(h)


class Norm(Op):
    names = ("layer_norm", "rms_norm")

    def __init__(self, b, n, d, seed, kind="layer_norm"):
        super().__init__(b, n, d, seed, kind=kind)
        g = _gen(seed)
        self.weight = nn.Parameter(1 + 0.2 * torch.randn(d, generator=g))
        self.bias = nn.Parameter(0.1 * torch.randn(d, generator=g))

    @staticmethod
    def draw(draw, st, b, n, d):
        return {"kind": draw(st.sampled_from(["layer_norm", "rms_norm"]))}

    def forward(self, h):
        if self.args["kind"] == "layer_norm":
            return F.layer_norm(h, (self.d,), self.weight, self.bias)
        return F.rms_norm(h, (self.d,), self.weight, eps=1e-6)


class Act(Op):
    names = ("gelu", "silu", "tanh", "sigmoid", "relu")

    @staticmethod
    def draw(draw, st, b, n, d):
        return {"kind": draw(st.sampled_from(["gelu", "silu", "tanh", "sigmoid", "relu"]))}

    def forward(self, h):
        return getattr(torch.nn.functional if self.args["kind"] in ("gelu", "silu", "relu") else torch,
                       self.args["kind"])(h)


class Mlp(Op):
    """A residual MLP block (pre-norm optional)."""

    names = ("linear", "gelu", "layer_norm")

    def __init__(self, b, n, d, seed, norm=True):
        super().__init__(b, n, d, seed, norm=norm)
        self.fc1, self.fc2 = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)
        self.ln = nn.LayerNorm(d) if norm else None

    @staticmethod
    def draw(draw, st, b, n, d):
        return {"norm": draw(st.booleans())}

    def forward(self, h):
        u = self.ln(h) if self.ln is not None else h
        return h + self.fc2(F.gelu(self.fc1(u)))


class Attention(Op):
    """Self-attention over the sequence: SDPA, or written by hand (softmax of scores)."""

    names = ("scaled_dot_product_attention", "softmax", "matmul", "ring_attention")

    def __init__(self, b, n, d, seed, causal=True, kind="sdpa", heads=2, residual=True):
        super().__init__(b, n, d, seed, causal=causal, kind=kind, heads=heads, residual=residual)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)

    @staticmethod
    def draw(draw, st, b, n, d):
        return {"causal": draw(st.booleans()), "kind": draw(st.sampled_from(["sdpa", "manual"])),
                "heads": draw(st.sampled_from([h for h in (1, 2, 4) if d % h == 0])), "residual": draw(st.booleans())}

    def forward(self, h):
        b, n, d = h.shape
        heads = self.args["heads"]
        q, k, v = self.qkv(h).view(b, n, 3, heads, d // heads).permute(2, 0, 3, 1, 4).unbind(0)
        if self.args["kind"] == "sdpa":
            o = F.scaled_dot_product_attention(q, k, v, is_causal=self.args["causal"])
        else:
            s = q @ k.transpose(-2, -1) / math.sqrt(d // heads)
            if self.args["causal"]:
                mask = torch.ones(n, n, dtype=torch.bool, device=h.device).tril()
                s = s.masked_fill(~mask, float("-inf"))
            o = s.softmax(-1) @ v
        o = self.proj(o.transpose(1, 2).reshape(b, n, d))
        return h + o if self.args["residual"] else o


class ViewFlat(Op):
    """Views of the flattened [b*n, d] tensor: a linear over the rows, back to [b, n, d]."""

    names = ("view", "reshape", "flatten", "unflatten", "linear")

    def __init__(self, b, n, d, seed, kind="view"):
        super().__init__(b, n, d, seed, kind=kind)
        self.lin = nn.Linear(d, d)

    @staticmethod
    def draw(draw, st, b, n, d):
        return {"kind": draw(st.sampled_from(["view", "reshape", "flatten", "view_t"]))}

    def forward(self, h):
        b, n, d = h.shape
        kind = self.args["kind"]
        if kind == "view":
            return self.lin(h.view(-1, d)).view(b, n, d)
        if kind == "reshape":
            return self.lin(h.reshape(b * n, d)).reshape(b, n, -1)
        if kind == "flatten":
            return self.lin(h.flatten(0, 1)).unflatten(0, (b, n))
        # through a transposed layout: [d, b*n] and back
        return self.lin(h.reshape(-1, d).t().contiguous().t()).view(b, n, d)


class FnElementwise(Op):
    """A custom autograd.Function whose forward and backward are elementwise (x * sigmoid(x))."""

    names = ("autograd_function_apply", "SiLUFn")

    def forward(self, h):
        return SiLUFn.apply(h)


class SiLUFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * torch.sigmoid(x)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        s = torch.sigmoid(x)
        return g * (s + x * s * (1 - s))


class Rotary(Op):
    """Rotary position embedding through complex views (Llama 4's form): pairs of features as
    complex numbers times torch.polar(1, position * frequency)."""

    names = ("view_as_complex", "view_as_real", "polar", "arange", "outer")

    @staticmethod
    def draw(draw, st, b, n, d):
        return {"kind": draw(st.sampled_from(["polar", "cos_sin"]))}

    def forward(self, h):
        b, n, d = h.shape
        pos = torch.arange(n, device=h.device, dtype=torch.float32)
        inv = 1.0 / (100.0 ** (torch.arange(0, d, 2, device=h.device, dtype=torch.float32) / d))
        ang = torch.outer(pos, inv)
        if self.args["kind"] == "cos_sin":
            x1, x2 = h[..., 0::2], h[..., 1::2]
            c, s = ang.cos(), ang.sin()
            return torch.stack([x1 * c - x2 * s, x1 * s + x2 * c], -1).flatten(-2)
        z = torch.view_as_complex(h.float().reshape(b, n, d // 2, 2))
        rot = torch.polar(torch.ones_like(ang), ang)
        return torch.view_as_real(z * rot).flatten(-2)


class PosEmbed(Op):
    """A learned position embedding read at the first n rows of a longer table."""

    names = ("getitem", "add", "embedding")

    def __init__(self, b, n, d, seed, kind="slice"):
        super().__init__(b, n, d, seed, kind=kind)
        self.table = nn.Parameter(0.1 * torch.randn(n + 3, d, generator=_gen(seed)))

    @staticmethod
    def draw(draw, st, b, n, d):
        return {"kind": draw(st.sampled_from(["slice", "embedding"]))}

    def forward(self, h):
        n = h.shape[1]
        if self.args["kind"] == "slice":
            return h + self.table[:n]
        return h + F.embedding(torch.arange(n, device=h.device), self.table)


# -- sequence reductions and scans ---------------------------------------------------------


class SeqReduce(Op):
    names = ("sum", "mean", "amax", "max", "logsumexp", "min", "std", "var", "norm")

    @staticmethod
    def draw(draw, st, b, n, d):
        return {"kind": draw(st.sampled_from(["sum", "mean", "amax", "max", "logsumexp", "min", "std", "norm"])),
                "keepdim": draw(st.booleans())}

    def forward(self, h):
        kind, keep = self.args["kind"], self.args["keepdim"]
        if kind == "max":
            r = h.max(dim=1, keepdim=keep).values
        elif kind == "min":
            r = torch.min(h, 1, keepdim=keep)[0]
        elif kind == "norm":
            r = h.norm(dim=1, keepdim=keep)
        else:
            r = getattr(h, kind)(1, keepdim=keep)
        return h + 0.5 * (r if keep else r.unsqueeze(1))


class Cum(Op):
    names = ("cumsum", "cumprod", "logcumsumexp", "cummax")

    @staticmethod
    def draw(draw, st, b, n, d):
        return {"kind": draw(st.sampled_from(["cumsum", "cumprod", "logcumsumexp", "cummax"])),
                "dim": draw(st.sampled_from(["seq", "feat"]))}

    def forward(self, h):
        dim = 1 if self.args["dim"] == "seq" else -1
        kind = self.args["kind"]
        if kind == "cumsum":
            return h.cumsum(dim) / h.shape[dim]
        if kind == "cumprod":
            return (1 + 0.1 * torch.tanh(h)).cumprod(dim)
        if kind == "cummax":
            return h.cummax(dim).values
        return torch.logcumsumexp(h, dim)


class FnSequence(Op):
    """A custom autograd.Function that is not elementwise: a scan over the sequence, a
    flip of it, or a centring over features."""

    names = ("autograd_function_apply", "CumsumFn", "FlipFn", "CenterFn")

    @staticmethod
    def draw(draw, st, b, n, d):
        return {"kind": draw(st.sampled_from(["cumsum", "flip", "center"]))}

    def forward(self, h):
        return {"cumsum": CumsumFn, "flip": FlipFn, "center": CenterFn}[self.args["kind"]].apply(h)


class CumsumFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.cumsum(1)

    @staticmethod
    def backward(ctx, g):
        return g.flip(1).cumsum(1).flip(1)


class FlipFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.flip(1)

    @staticmethod
    def backward(ctx, g):
        return g.flip(1)


class CenterFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x - x.mean(-1, keepdim=True)

    @staticmethod
    def backward(ctx, g):
        return g - g.mean(-1, keepdim=True)


# -- ops that move tokens: shifts, permutations, convolutions --------------------------------


class Shift(Op):
    names = ("cat", "pad", "roll", "flip", "chunk", "getitem")

    @staticmethod
    def draw(draw, st, b, n, d):
        return {"kind": draw(st.sampled_from(["cat", "pad", "roll", "flip", "swap_halves"]))}

    def forward(self, h):
        kind = self.args["kind"]
        if kind == "cat":  # token shift (RWKV): each token reads the one before it
            return h + torch.cat([torch.zeros_like(h[:, :1]), h[:, :-1]], dim=1)
        if kind == "pad":
            return h + F.pad(h[:, :-1], (0, 0, 1, 0))
        if kind == "roll":
            return torch.roll(h, 1, dims=1)
        if kind == "flip":
            return h.flip(1)
        first, second = h.chunk(2, dim=1)
        return torch.cat([second, first], dim=1)


class Conv(Op):
    """A causal depthwise convolution over the sequence (Mamba's, gated delta-net's)."""

    names = ("conv1d", "transpose", "getitem")

    def __init__(self, b, n, d, seed, k=3):
        super().__init__(b, n, d, seed, k=k)
        self.weight = nn.Parameter(0.3 * torch.randn(d, 1, k, generator=_gen(seed)))

    @staticmethod
    def draw(draw, st, b, n, d):
        return {"k": draw(st.integers(2, 4))}

    def forward(self, h):
        n = h.shape[1]
        y = F.conv1d(h.transpose(1, 2), self.weight, padding=self.args["k"] - 1, groups=self.d)
        return y[..., :n].transpose(1, 2)


class SelectToken(Op):
    """One token read and broadcast to every token (a [CLS] or last-token summary)."""

    names = ("getitem", "select", "seq_select", "narrow")

    @staticmethod
    def draw(draw, st, b, n, d):
        return {"index": draw(st.integers(-n, n - 1)), "kind": draw(st.sampled_from(["int", "slice", "narrow"]))}

    def forward(self, h):
        i, n = self.args["index"], h.shape[1]
        if self.args["kind"] == "int":
            r = h[:, i].unsqueeze(1)
        elif self.args["kind"] == "slice":
            r = h[:, i % n:i % n + 1]
        else:
            r = h.narrow(1, i % n, 1)
        return h * torch.tanh(r)


# -- in-place writes -----------------------------------------------------------------------


class SetSlice(Op):
    """x[:, lo:hi] = ... on the sequence (or on features), on a fresh copy."""

    names = ("setitem", "copy_", "fill_", "clone", "mul_", "add_", "narrow", "getitem")

    @staticmethod
    def draw(draw, st, b, n, d):
        lo = draw(st.integers(0, n - 1))
        hi = draw(st.integers(lo + 1, n))
        return {"lo": lo, "hi": hi, "kind": draw(st.sampled_from(["scale", "zero", "feature", "token", "iadd", "view_mul_",
                                                               "narrow_add_", "token_add_"])),
                "clone": draw(st.booleans())}

    def forward(self, h):
        lo, hi, kind = self.args["lo"], self.args["hi"], self.args["kind"]
        h = h.clone() if self.args["clone"] else h * 1.0
        if kind == "scale":
            h[:, lo:hi] = h[:, lo:hi] * 2
        elif kind == "zero":
            h[:, lo:hi] = 0.0
        elif kind == "feature":
            h[..., : max(1, self.d // 2)] = torch.tanh(h[..., : max(1, self.d // 2)])
        elif kind == "token":
            h[:, lo] = h[:, hi - 1] * 0.5
        elif kind == "iadd":
            h[:, lo:hi] += 1.0
        elif kind == "view_mul_":
            h[:, lo:hi].mul_(2.0)
        elif kind == "narrow_add_":
            h.narrow(1, lo, hi - lo).add_(1.0)
        else:
            h[:, lo].add_(1.0)
        return h


class InplaceArith(Op):
    """add_ / mul_ / masked_fill_ on the activation itself."""

    names = ("add_", "mul_", "masked_fill_", "masked_fill", "gt", "arange", "lt", "clone")

    def __init__(self, b, n, d, seed, kind="add_", mask="values", k=1):
        super().__init__(b, n, d, seed, kind=kind, mask=mask, k=k)
        self.scale = nn.Parameter(1 + 0.2 * torch.randn(d, generator=_gen(seed)))

    @staticmethod
    def draw(draw, st, b, n, d):
        return {"kind": draw(st.sampled_from(["add_", "mul_", "masked_fill_", "masked_fill", "where"])),
                "mask": draw(st.sampled_from(["values", "positions", "causal_first"])),
                "k": draw(st.integers(1, n))}

    def _mask(self, h):
        n = h.shape[1]
        if self.args["mask"] == "values":
            return h > 0.5
        pos = torch.arange(n, device=h.device)
        if self.args["mask"] == "positions":
            return (pos < self.args["k"]).view(1, n, 1)
        return (pos % 3 == 0)[None, :, None] & (torch.arange(self.d, device=h.device) < self.d // 2)

    def forward(self, h):
        kind = self.args["kind"]
        h = h.clone()
        if kind == "add_":
            h.add_(torch.tanh(h))
            return h
        if kind == "mul_":
            h.mul_(self.scale)
            return h
        if kind == "masked_fill_":
            h.masked_fill_(self._mask(h), -0.5)
            return h
        if kind == "masked_fill":
            return h.masked_fill(self._mask(h), 0.25)
        return torch.where(self._mask(h), h * 2, h)


# -- scatter / gather / index ops ----------------------------------------------------------


class Scatter(Op):
    """scatter / scatter_ / scatter_add along the sequence or the features, with a constant
    permutation or indices from the data (a router's top-k mask: group_mask.scatter_(1, idx, 1))."""

    names = ("scatter", "scatter_", "scatter_add", "scatter_add_", "topk", "expand", "zeros_like")

    def __init__(self, b, n, d, seed, dim="seq", kind="scatter", index="perm"):
        super().__init__(b, n, d, seed, dim=dim, kind=kind, index=index)
        self.register_buffer("perm", _perm(n if dim == "seq" else d, seed))

    @staticmethod
    def draw(draw, st, b, n, d):
        return {"dim": draw(st.sampled_from(["seq", "feat"])),
                "kind": draw(st.sampled_from(["scatter", "scatter_", "scatter_add", "scatter_add_"])),
                "index": draw(st.sampled_from(["perm", "topk_mask"]))}

    def forward(self, h):
        b, n, d = h.shape
        dim = 1 if self.args["dim"] == "seq" else 2
        kind = self.args["kind"]
        if self.args["index"] == "topk_mask":
            k = 2
            idx = h.topk(k, dim=dim).indices  # [b, k, d] or [b, n, k]
            ones = torch.ones_like(idx, dtype=h.dtype)
            mask = torch.zeros_like(h)
            if kind.endswith("_"):
                getattr(mask, kind)(dim, idx, ones)
            else:
                mask = getattr(torch, kind)(mask, dim, idx, ones)
            return h * (1 + mask)
        shape = [1, 1, 1]
        shape[dim] = -1
        idx = self.perm.view(shape).expand(b, n, d)
        base = torch.zeros_like(h)
        if kind.endswith("_"):
            getattr(base, kind)(dim, idx, h)
            return base
        return getattr(torch, kind)(base, dim, idx, h)


class Gather(Op):
    """torch.gather along the sequence (a constant permutation, or tokens sorted by a score) or
    along the features (a router's scores at its top-k experts)."""

    names = ("gather", "topk", "argsort", "expand")

    def __init__(self, b, n, d, seed, dim="seq", index="perm"):
        super().__init__(b, n, d, seed, dim=dim, index=index)
        self.register_buffer("perm", _perm(n if dim == "seq" else d, seed))
        self.lin = nn.Linear(2, d) if (dim, index) == ("feat", "data") else None

    @staticmethod
    def draw(draw, st, b, n, d):
        return {"dim": draw(st.sampled_from(["seq", "feat"])), "index": draw(st.sampled_from(["perm", "data"]))}

    def forward(self, h):
        b, n, d = h.shape
        dim = self.args["dim"]
        if self.args["index"] == "perm":
            idx = self.perm.view(1, -1, 1).expand(b, n, d) if dim == "seq" else self.perm.view(1, 1, -1).expand(b, n, d)
            return torch.gather(h, 1 if dim == "seq" else 2, idx)
        if dim == "seq":
            order = h[..., 0].argsort(dim=1)
            return h.gather(1, order.unsqueeze(-1).expand(b, n, d))
        idx = h.topk(2, dim=-1, sorted=False).indices
        return h + self.lin(h.gather(-1, idx))


class IndexOps(Op):
    """index_select, index_add, index_copy and advanced indexing with a constant permutation, along the
    sequence or the features, and rows of the flattened [b*n, d] value picked by index."""

    names = ("index_select", "index_add", "index_add_", "index_copy", "getitem", "index", "view", "flatten")

    def __init__(self, b, n, d, seed, kind="index_select", dim="seq"):
        super().__init__(b, n, d, seed, kind=kind, dim=dim)
        size = {"seq": n, "feat": d, "rows": b * n}[dim]
        self.register_buffer("perm", _perm(size, seed))

    @staticmethod
    def draw(draw, st, b, n, d):
        return {"kind": draw(st.sampled_from(["index_select", "index_add", "index_add_", "index_copy", "getitem",
                                              "getitem_arange"])),
                "dim": draw(st.sampled_from(["seq", "feat", "rows"]))}

    def forward(self, h):
        b, n, d = h.shape
        kind, dim = self.args["kind"], self.args["dim"]
        x, axis = (h.reshape(b * n, d), 0) if dim == "rows" else (h, 1 if dim == "seq" else 2)
        if kind == "index_select":
            y = x.index_select(axis, self.perm)
        elif kind == "index_add":
            y = torch.zeros_like(x).index_add(axis, self.perm, x, alpha=2.0)
        elif kind == "index_add_":
            y = x * 0.5
            y.index_add_(axis, self.perm, x)
        elif kind == "index_copy":
            y = torch.zeros_like(x).index_copy(axis, self.perm, x)
        else:
            perm = self.perm if kind == "getitem" else torch.arange(x.shape[axis], device=h.device).flip(0)
            y = x[perm] if axis == 0 else (x[:, perm] if axis == 1 else x[..., perm])
        return y.view(b, n, d) if dim == "rows" else y


class TopkSort(Op):
    """topk and sort (sorted or not) along the features or the sequence."""

    names = ("topk", "sort", "argsort", "gather", "mean", "linear")

    def __init__(self, b, n, d, seed, kind="topk", dim="feat", sorted=True):
        super().__init__(b, n, d, seed, kind=kind, dim=dim, sorted=sorted)
        self.lin = nn.Linear(2, d) if (kind, dim) == ("topk", "feat") else None

    @staticmethod
    def draw(draw, st, b, n, d):
        return {"kind": draw(st.sampled_from(["topk", "sort", "topk_values_mean"])),
                "dim": draw(st.sampled_from(["feat", "seq"])), "sorted": draw(st.booleans())}

    def forward(self, h):
        kind, dim = self.args["kind"], 1 if self.args["dim"] == "seq" else -1
        if kind == "sort":
            return h.sort(dim=dim, descending=not self.args["sorted"]).values
        if kind == "topk" and dim == -1:
            return h + self.lin(h.topk(2, dim=-1, sorted=self.args["sorted"]).values)
        v = h.topk(2, dim=dim, sorted=self.args["sorted"]).values
        return h + v.mean(dim, keepdim=True)


# -- more layouts, sequence-mixing norms and windows, graph breaks ------------------------------


class Squeeze(Op):
    """squeeze/unsqueeze round trips: a shard of one row per rank (n = p) has a local dim of size
    1 that the global value does not."""

    names = ("squeeze", "unsqueeze", "reshape", "view")

    @staticmethod
    def draw(draw, st, b, n, d):
        return {"kind": draw(st.sampled_from(["all", "dim", "view1"]))}

    def forward(self, h):
        b, n, d = h.shape
        kind = self.args["kind"]
        if kind == "all":
            return torch.tanh(h.unsqueeze(2).squeeze()).reshape(b, n, d)
        if kind == "dim":
            return h.unsqueeze(-2).squeeze(-2) * 2
        return h.view(b, n, 1, d).squeeze(2) + 1


class Einsum(Op):
    """einsum over features (token-local) or over the sequence (a product of all tokens)."""

    names = ("einsum", "matmul", "transpose", "softmax", "bmm")

    def __init__(self, b, n, d, seed, kind="feat"):
        super().__init__(b, n, d, seed, kind=kind)
        self.w = nn.Parameter(torch.randn(d, d, generator=_gen(seed)) / math.sqrt(d))

    @staticmethod
    def draw(draw, st, b, n, d):
        return {"kind": draw(st.sampled_from(["feat", "gram", "scores", "outer_seq"]))}

    def forward(self, h):
        kind, n = self.args["kind"], h.shape[1]
        if kind == "feat":
            return torch.einsum("bnd,de->bne", h, self.w)
        if kind == "gram":  # [b, d, d]: contracts over the sequence
            return h + h @ (h.transpose(1, 2) @ h) / (n * h.shape[2])
        if kind == "scores":
            return torch.einsum("bnd,bmd->bnm", h, h).softmax(-1) @ h
        return h + torch.bmm(h.transpose(1, 2), h).diagonal(dim1=1, dim2=2).unsqueeze(1) / n


class SeqNorm(Norm):  # Norm's weight and bias
    """Normalisations whose statistics run over the sequence (batch / instance / group norm on
    [b, d, n], F.normalize and softmax along it) or not (F.normalize over features)."""

    names = ("batch_norm", "instance_norm", "group_norm", "normalize", "softmax", "transpose", "norm")

    def __init__(self, b, n, d, seed, kind="batch_norm"):
        super().__init__(b, n, d, seed, kind=kind)

    @staticmethod
    def draw(draw, st, b, n, d):
        return {"kind": draw(st.sampled_from(["batch_norm", "instance_norm", "group_norm", "normalize_seq",
                                              "normalize_feat", "softmax_seq"]))}

    def forward(self, h):
        kind = self.args["kind"]
        t = h.transpose(1, 2)
        if kind == "batch_norm":
            y = F.batch_norm(t, None, None, self.weight, self.bias, training=True)
        elif kind == "instance_norm":
            y = F.instance_norm(t, weight=self.weight, bias=self.bias)
        elif kind == "group_norm":
            y = F.group_norm(t, 2, self.weight, self.bias)
        elif kind == "normalize_seq":
            return F.normalize(h, dim=1) * self.weight
        elif kind == "normalize_feat":
            return F.normalize(h, dim=-1) * self.weight
        else:
            return h.softmax(dim=1) * self.weight
        return y.transpose(1, 2)


class Window(Op):
    """Local windows over the sequence: unfold, diff, pooling."""

    names = ("unfold", "diff", "max_pool1d", "avg_pool1d", "transpose", "mean", "narrow", "getitem", "amax", "cumsum")

    @staticmethod
    def draw(draw, st, b, n, d):
        return {"kind": draw(st.sampled_from(["unfold", "diff", "max_pool", "avg_pool", "narrow_mean", "slice_max",
                                              "full_max", "cumsum_last"]))}

    def forward(self, h):
        kind = self.args["kind"]
        if kind == "narrow_mean":  # a statistic over a window of the sequence, read by every token
            return h + h.narrow(1, 1, h.shape[1] - 1).mean(1, keepdim=True)
        if kind == "slice_max":  # no sharding rule: every rank computes it on the gathered window
            return h * h[:, :-1].amax(1, keepdim=True)
        if kind == "full_max":
            return h * h.amax(1, keepdim=True)
        if kind == "cumsum_last":  # one token of a gathered value
            return h * h[:, :-1].cumsum(1)[:, -1:]
        if kind == "unfold":  # [b, n-1, d, 2]: pairs of neighbours, padded back to n
            u = h.unfold(1, 2, 1).mean(-1)
            return torch.cat([u, h[:, -1:]], dim=1)
        if kind == "diff":
            return torch.diff(h, dim=1, prepend=torch.zeros_like(h[:, :1]))
        t = h.transpose(1, 2)
        pool = F.max_pool1d if kind == "max_pool" else F.avg_pool1d
        return pool(t, 3, 1, 1).transpose(1, 2)


class GraphBreak(Op):
    """A graph break: the next graph reads this one's sharded output (Note [Sharded outputs])."""

    names = ("gather",)

    def forward(self, h):
        torch._dynamo.graph_break()
        return h


class Detach(Op):
    """Values that carry no gradient: detach, and a statistic under no_grad."""

    names = ("detach", "mean", "mul")

    @staticmethod
    def draw(draw, st, b, n, d):
        return {"kind": draw(st.sampled_from(["detach", "no_grad_seq", "no_grad_feat"]))}

    def forward(self, h):
        kind = self.args["kind"]
        if kind == "detach":
            return h + 0.5 * torch.tanh(h.detach())
        with torch.no_grad():
            s = h.abs().mean(1, keepdim=True) if kind == "no_grad_seq" else h.abs().mean(-1, keepdim=True)
        return h / (1 + s)


class Embed(Op):
    """Token ids [b, n] -> [b, n, d] (the program's first op when its input is ids)."""

    names = ("embedding",)

    def __init__(self, b, n, d, seed, vocab=11):
        super().__init__(b, n, d, seed, vocab=vocab)
        self.table = nn.Embedding(vocab, d)

    def forward(self, ids):
        return self.table(ids)


OPS: dict[str, type[Op]] = {
    "linear": Linear, "norm": Norm, "act": Act, "mlp": Mlp, "attention": Attention, "view_flat": ViewFlat,
    "fn_elementwise": FnElementwise, "rotary": Rotary, "pos_embed": PosEmbed, "seq_reduce": SeqReduce,
    "cum": Cum, "fn_sequence": FnSequence, "shift": Shift, "conv": Conv, "select_token": SelectToken,
    "set_slice": SetSlice, "inplace": InplaceArith, "scatter": Scatter, "gather": Gather, "index": IndexOps,
    "topk_sort": TopkSort, "squeeze": Squeeze, "einsum": Einsum, "seq_norm": SeqNorm, "window": Window,
    "graph_break": GraphBreak, "detach": Detach,
}

# What the compiled module returns
OUTS = ("h", "pair", "scalar", "dict")
# What eager code reads from the returned value (the first one when a pair)
TAILS = ("all", "sum_seq", "last", "slice", "stride", "index", "mean", "ce", "amax", "shift_ce")


class Program(nn.Module):
    def __init__(self, prog: dict):
        super().__init__()
        b, n, d, seed = prog["b"], prog["n"], prog["d"], prog["seed"]
        self.out = prog["out"]
        torch.manual_seed(seed)
        self.ops = nn.ModuleList(OPS[name](b, n, d, seed * 1000 + i, **args) for i, (name, args) in enumerate(prog["ops"]))
        self.embed = Embed(b, n, d, seed) if prog.get("input") == "ids" else None
        self.head = nn.Parameter(torch.randn(d, generator=_gen(seed + 7)) / math.sqrt(d))

    def forward(self, x):
        h = self.embed(x) if self.embed is not None else x
        for op in self.ops:
            h = op(h)
        if self.out == "pair":
            return h, (h * self.head).sum(-1).mean(1)
        if self.out == "scalar":
            return (torch.tanh(h) * self.head).sum() / h.shape[1]
        if self.out == "dict":
            return {"h": h, "m": h.mean(1)}
        return h


def names_of(prog: dict) -> set[str]:
    """The torch-level op names an error about this program may name."""
    out = set(Embed.names) if prog.get("input") == "ids" else set()
    for name, _ in prog["ops"]:
        out |= set(OPS[name].names)
    return out


def build(prog: dict) -> Program:
    return Program(prog)


def inputs(prog: dict):
    g = _gen(prog["seed"] + 1)
    b, n, d = prog["b"], prog["n"], prog["d"]
    x = torch.randn(b, n, d, generator=g) if prog.get("input") != "ids" else torch.randint(0, 11, (b, n), generator=g)
    labels = torch.randint(0, d, (b, n), generator=g)
    labels[0, 0] = -100
    return x, labels


def tail(prog: dict, out, labels):
    """What eager code reads from the compiled module's output (a SequenceSharded value under
    ringcc; reading it gathers)."""
    if prog["out"] == "scalar":
        return out
    if prog["out"] == "dict":
        out = (out["h"], out["m"])
    h, extra = (out if prog["out"] in ("pair", "dict") else (out, None))
    kind = prog["tail"]
    n = prog["n"]
    if kind == "all":
        r = h * 1.0
    elif kind == "sum_seq":
        r = h.sum(1)
    elif kind == "last":
        r = h[:, -1]
    elif kind == "slice":
        r = h[:, 1:]
    elif kind == "stride":
        r = h[:, ::2]
    elif kind == "index":
        r = h[:, torch.arange(n).flip(0)]
    elif kind == "mean":
        r = h.mean()
    elif kind == "amax":
        r = h.amax(1)
    elif kind == "shift_ce":
        r = F.cross_entropy(h[:, :-1].reshape(-1, h.shape[-1]), labels[:, 1:].reshape(-1))
    else:
        r = F.cross_entropy(h.reshape(-1, h.shape[-1]), labels.reshape(-1))
    return (r, extra) if extra is not None else r


def _backward(value, seed: int) -> None:
    """Backward of a fixed random projection of every output (never a constant of the inputs);
    nothing to do where no output needs a gradient (no parameters, x without grad)."""
    parts = value if isinstance(value, tuple) else (value,)
    total = 0.0
    for i, v in enumerate(parts):
        r = torch.randn(v.shape, generator=_gen(seed + 100 + i))
        total = total + (v * r).sum()
    if total.requires_grad:
        total.backward()


def _plain(t):
    from ringcc import SequenceSharded

    return t.full_tensor() if isinstance(t, SequenceSharded) else t


def rel_err(got, want, floor: float = 1e-3) -> float:
    """Largest error over the reference's largest magnitude, or over `floor` where that is
    smaller (a gradient that is structurally zero, such as a bias before a norm over the
    sequence, is rounding noise: PITFALLS)."""
    got, want = got.detach().float(), want.detach().float()
    if got.shape != want.shape:
        return float("inf")
    if not torch.isfinite(got).all():
        return float("inf")
    return float((got - want).abs().max() / want.abs().max().clamp_min(floor)) if want.numel() else 0.0


def _first(out):
    """The sequence-carrying output, if the module returns one."""
    if isinstance(out, dict):
        return out["h"]
    return out[0] if isinstance(out, tuple) else (out if out.dim() == 3 else None)


def _eager(prog):
    model = build(prog)
    x, labels = inputs(prog)
    x = x.requires_grad_(prog["x_grad"] and x.is_floating_point())
    out = model(x)
    value = tail(prog, out, labels)
    _backward(value, prog["seed"])
    full = _first(out)
    return model, x, value, (full.detach() if full is not None else None)


def _root(e: BaseException) -> BaseException:
    seen = set()
    while id(e) not in seen:
        seen.add(id(e))
        inner = getattr(e, "inner_exception", None) or e.__cause__
        if inner is None:
            break
        e = inner
    return e


_RINGCC_DIRS = tuple(os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep + p + os.sep
                     for p in ("ringcc", "passes", "runtime"))


def _raised_in_ringcc(e: BaseException) -> bool:
    tb = traceback.extract_tb(e.__traceback__)
    if not tb:
        return False
    here = os.path.abspath(tb[-1].filename)
    import ringcc

    roots = _RINGCC_DIRS + (os.path.dirname(os.path.abspath(ringcc.__file__)) + os.sep,)
    return here.startswith(roots) or "/ringcc/" in here


def run_case(rank: int, world: int, prog: dict) -> dict:
    """Eager, then ringcc on this rank; the verdict (see the module docstring)."""
    import ringcc

    torch._dynamo.reset()
    ringcc.reset_reports()
    try:
        ref, xr, want, want_full = _eager(prog)
    except Exception as e:  # noqa: BLE001 - a program eager cannot run is not a case
        return {"kind": "invalid", "why": f"eager: {type(e).__name__}: {e}"}
    wants = want if isinstance(want, tuple) else (want,)
    if not all(torch.isfinite(w).all() for w in wants):
        return {"kind": "invalid", "why": "eager result is not finite"}
    model = build(prog)
    model.load_state_dict(ref.state_dict())
    x, labels = inputs(prog)
    x = x.requires_grad_(prog["x_grad"] and x.is_floating_point())
    ringcc.mark_sequence(x, 1)
    dump = os.environ.get("FUZZ_DUMP_DIR")  # the graphs before and after each pass, per rank
    config = ringcc.Config(inner="aot_eager", pad=prog["pad"], dump_dir=f"{dump}/rank{rank}" if dump else None)
    try:
        compiled = torch.compile(model, backend=ringcc.backend(config), fullgraph=False)
        out = compiled(x)
        got = tail(prog, out, labels)
        _backward(got, prog["seed"])
        gots = got if isinstance(got, tuple) else (got,)
        with torch.no_grad():  # the whole sequence-carrying output too (a gather, on every rank)
            gots = tuple(_plain(g) for g in gots)
            got_full = _plain(_first(out)) if want_full is not None else None
    except Exception as e:  # noqa: BLE001 - classified by the caller
        root = _root(e)
        return {"kind": "error", "type": type(root).__name__, "msg": str(root)[:2000],
                "ringcc": _raised_in_ringcc(root) and isinstance(root, (ValueError, RuntimeError)),
                "where": "".join(traceback.format_exception(root)[-6:])[-3000:]}
    errs = {}
    for i, (g, w) in enumerate(zip(gots, wants)):
        errs[f"output {i}"] = rel_err(g, w)
    if want_full is not None:
        errs["returned h"] = rel_err(got_full, want_full)
    ref_grads = dict(ref.named_parameters())
    floor = 1e-3 * max([float(p.grad.abs().max()) for p in ref_grads.values() if p.grad is not None and p.grad.numel()]
                       + [float(xr.grad.abs().max()) if xr.grad is not None else 0.0, 1e-3])
    missing = []
    for name, p in model.named_parameters():
        r = ref_grads[name].grad
        if (p.grad is None) != (r is None):
            missing.append(f"{name}: grad {'None' if p.grad is None else 'set'}, eager {'None' if r is None else 'set'}")
        elif r is not None:
            errs[f"grad {name}"] = rel_err(p.grad, r, floor)
    if x.requires_grad:
        if (x.grad is None) != (xr.grad is None):
            missing.append(f"x: grad {'None' if x.grad is None else 'set'}, eager {'None' if xr.grad is None else 'set'}")
        elif xr.grad is not None:
            errs["grad x"] = rel_err(x.grad, xr.grad, floor)
    bad = {k: v for k, v in errs.items() if not v <= TOL}
    report = [{"gathers": [(g.node, g.why) for g in rep.gathers]} for rep in ringcc.reports()]
    if bad or missing:
        return {"kind": "mismatch", "errors": bad, "missing": missing, "report": report}
    return {"kind": "exact", "report": report}


# -- hypothesis strategies ------------------------------------------------------------------


def programs(st, worlds=(1, 2, 3, 4), max_ops: int = 4, ops: tuple[str, ...] | None = None, pad: bool = True):
    """A hypothesis strategy of programs: st is hypothesis.strategies."""
    names = sorted(ops or OPS)

    @st.composite
    def program(draw):
        world = draw(st.sampled_from(list(worlds)))
        padded = pad and world > 1 and draw(st.booleans()) and draw(st.booleans())  # a quarter of the programs
        if padded:
            n = draw(st.integers(max(2, world), 6 * world).filter(lambda v: v % world != 0))
        else:
            n = world * draw(st.integers(1, 6))  # (n = p: one row per rank)
        n = max(n, 2)
        b = draw(st.sampled_from([1, 2]))
        d = draw(st.sampled_from([4, 8, 12]))
        k = draw(st.integers(1, max_ops))
        chosen = [draw(st.sampled_from(names)) for _ in range(k)]
        ops_list = [[name, OPS[name].draw(draw, st, b, n, d)] for name in chosen]
        if any(name == "attention" and args["causal"] for name, args in ops_list) and n % (2 * world):
            padded = True  # causal attention's zigzag layout needs 2p | n
        return {"seed": draw(st.integers(0, 10_000)), "b": b, "n": n, "d": d, "world": world, "pad": padded,
                "ops": ops_list, "out": draw(st.sampled_from(OUTS)), "tail": draw(st.sampled_from(TAILS)),
                "x_grad": draw(st.booleans()), "input": draw(st.sampled_from(["x", "x", "ids"]))}

    return program()
