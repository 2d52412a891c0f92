"""The elementwise kernels of the ring's sums, written in Triton: the LSE merge, the widening add and
the copy (Note [Fewer passes] in ring.py). Each is one pass over its operands, like the kernels
inductor generates for the same code, but launched for a few µs of host time: a compiled torch
function costs the host 190-350 µs per call on CUDA, and at 16K tokens per GPU the forward's
host issues its steps barely ahead of the GPU (host time measured per call site).

Operands are [b, h, L, d] (out, and the add's tensors) or [b, h, L] (lse) views with any strides
on b, h and L and a unit stride on the last dimension: head-chunk slices and row ranges of
contiguous tensors, as the ring makes them. Sums are done in fp32 and stored in the
destination's dtype; `available()` is False where Triton or CUDA is missing and for fp64
(callers then use merge.py's torch versions).
"""

from __future__ import annotations

import functools
import os

import torch

from ringcc import _compat

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU builds of torch come without Triton
    triton = None


_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def available(outs: tuple[torch.Tensor, ...], lses: tuple[torch.Tensor, ...] = ()) -> bool:
    """Whether these operands ([b, h, L, d] `outs`, [b, h, L] `lses`) can take the Triton kernels.
    (Called before every launch: written for the host's time.)"""
    if triton is None:
        return False
    shape = outs[0].shape
    if len(shape) != 4:
        return False
    rows = shape[:3]
    return all(_fits(t, shape, 3) for t in outs) and all(_fits(t, rows, 2) for t in lses)


def _fits(t: torch.Tensor, shape, last: int) -> bool:
    """t has this shape, a dtype the kernels take, a unit stride on its last dimension (or
    size 1 there), and lives on CUDA (or the interpreter runs)."""
    return (t.shape == shape and t.dtype in _DTYPES and (t.is_cuda or _INTERPRET)
            and (t.stride(last) == 1 or shape[last] == 1))


# Triton's CPU interpreter (CPU tensors too; tests), which Triton itself reads when the kernels
# below are defined.
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


if triton is not None:

    @triton.jit
    def _merge_kernel(oa, la, ob, lb, od, ld, H, L, D,
                      oa_b, oa_h, oa_l, ob_b, ob_h, ob_l, od_b, od_h, od_l,
                      la_b, la_h, lb_b, lb_h, ld_b, ld_h,
                      BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr):
        bh = tl.program_id(0).to(tl.int64)  # offsets in int64: a stride times an index passes 2**31
        bi, hi = bh // H, bh % H
        rows = tl.program_id(1).to(tl.int64) * BLOCK_L + tl.arange(0, BLOCK_L)
        cols = tl.arange(0, BLOCK_D)
        rmask = rows < L
        mask = rmask[:, None] & (cols < D)[None, :]
        ninf = float("-inf")
        lsa = tl.load(la + bi * la_b + hi * la_h + rows, mask=rmask, other=ninf).to(tl.float32)
        lsb = tl.load(lb + bi * lb_b + hi * lb_h + rows, mask=rmask, other=ninf).to(tl.float32)
        # logaddexp; a row that has seen no key on either side stays (0, -inf)
        m = tl.maximum(lsa, lsb)
        m = tl.where(m == ninf, 0.0, m)
        ea, eb = tl.exp(lsa - m), tl.exp(lsb - m)
        s = ea + eb
        empty = s == 0.0
        s_safe = tl.where(empty, 1.0, s)
        wa, wb = tl.where(empty, 0.0, ea / s_safe), tl.where(empty, 0.0, eb / s_safe)
        lse = tl.where(empty, ninf, m + tl.log(s_safe))
        xa = tl.load(oa + bi * oa_b + hi * oa_h + rows[:, None] * oa_l + cols[None, :], mask=mask, other=0.0)
        xb = tl.load(ob + bi * ob_b + hi * ob_h + rows[:, None] * ob_l + cols[None, :], mask=mask, other=0.0)
        y = xa.to(tl.float32) * wa[:, None] + xb.to(tl.float32) * wb[:, None]
        tl.store(od + bi * od_b + hi * od_h + rows[:, None] * od_l + cols[None, :],
                 y.to(od.dtype.element_ty), mask=mask)
        tl.store(ld + bi * ld_b + hi * ld_h + rows, lse.to(ld.dtype.element_ty), mask=rmask)

    @triton.jit
    def _add_kernel(a, b, d, a2, b2, d2, BH, H, L, D, a_b, a_h, a_l, b_b, b_h, b_l, d_b, d_h, d_l,
                    BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr, HAS_B: tl.constexpr, PAIR: tl.constexpr):
        bh = tl.program_id(0).to(tl.int64)
        if PAIR:  # programs [BH, 2 BH) sum the second triple (same shapes, dtypes and strides)
            if bh >= BH:
                a, b, d = a2, b2, d2
                bh -= BH
        bi, hi = bh // H, bh % H
        rows = tl.program_id(1).to(tl.int64) * BLOCK_L + tl.arange(0, BLOCK_L)
        cols = tl.arange(0, BLOCK_D)
        mask = (rows < L)[:, None] & (cols < D)[None, :]
        xa = tl.load(a + bi * a_b + hi * a_h + rows[:, None] * a_l + cols[None, :], mask=mask, other=0.0)
        if HAS_B:
            xb = tl.load(b + bi * b_b + hi * b_h + rows[:, None] * b_l + cols[None, :], mask=mask, other=0.0)
            y = xa.to(tl.float32) + xb.to(tl.float32)
        else:  # a copy: every value as it is (converted once, to d's dtype)
            y = xa
        tl.store(d + bi * d_b + hi * d_h + rows[:, None] * d_l + cols[None, :], y.to(d.dtype.element_ty), mask=mask)


@functools.lru_cache(maxsize=None)
def _blocks(D: int) -> tuple[int, int]:
    """(rows, columns) of a program's tile: 4096 elements (32 per thread at 4 warps)."""
    block_d = triton.next_power_of_2(D)
    return max(1, 4096 // block_d), block_d


# Note [Direct launches]
# Triton's launch path (`kernel[grid](...)`) binds the arguments, works out their specialization
# (dtypes, 16-byte alignment of pointers, integers equal to 1 or divisible by 16, int32 or
# int64) and looks the compiled kernel up on every call: 31 µs of host time per launch on the
# H200 machines' hosts, against 12 µs for the compiled kernel's own launcher (one process,
# results/2026-11-28_4xH200_launch_probe.txt). The ring launches a dozen of these kernels per
# step, and at 8K tokens per GPU its host is barely ahead of the GPU. So each kernel here is
# launched once through Triton's path, which compiles it, and the compiled kernel is then kept
# under a key at least as fine as Triton's specialization on the CUDA backend: the device,
# every tensor's dtype and whether its address is 16-byte aligned, every integer's type and
# value class (1, divisible by 16, within int32), and the constexprs' values. Later calls with
# the same key launch the kept kernel as Triton's own path would (_compat.triton_launch: same
# launcher, grid, stream, launch hooks and arguments). Triton's compile options (debug,
# instrumentation) are not in the key: they are fixed for a process here. Where Triton's
# launcher differs (the interpreter, another backend, a Triton without `knobs`) every call
# takes Triton's path.


class _Launcher:
    """`kernel[grid](*args)`, args in the kernel's order (constexprs last, `n_constexpr` >= 1 of
    them, positionally), through the kept compiled kernel when there is one (Note [Direct
    launches])."""

    def __init__(self, fn, n_constexpr: int):
        self.fn, self.n_constexpr = fn, n_constexpr
        self.kernels: dict = {}
        self.direct = None  # whether kept kernels are launched: decided at the first call

    def __call__(self, grid, *args) -> None:
        if self.direct is None:
            self.direct = not _INTERPRET and _compat.triton_direct_launch()
        if not self.direct:
            self.fn[grid](*args)
            return
        device, stream = _compat.triton_device_and_stream()
        split = len(args) - self.n_constexpr
        key = (device, args[split:], *(_spec(a) for a in args[:split]))
        k = self.kernels.get(key)
        if k is None:
            self.kernels[key] = self.fn[grid](*args)  # compiled when new, and launched
            return
        _compat.triton_launch(k, grid, stream, args)


def _spec(a):
    """The part of an argument Triton specializes on (a superset of it)."""
    if isinstance(a, torch.Tensor):
        return a.dtype, a.data_ptr() % 16 == 0
    return type(a), a == 1, a % 16 == 0, -2**31 <= a < 2**31


if triton is not None:
    _MERGE, _ADD = _Launcher(_merge_kernel, 2), _Launcher(_add_kernel, 4)


def merge(out_d, lse_d, out_a, lse_a, out_b, lse_b) -> None:
    """(out_d, lse_d) <- LSE merge of (out_a, lse_a) and (out_b, lse_b); out_d may be out_a and
    lse_d lse_a (in place). Shapes [b, h, L, d] and [b, h, L]."""
    b, h, L, D = out_d.shape
    if out_d.numel() == 0:
        return
    block_l, block_d = _blocks(D)
    s4 = [t.stride() for t in (out_a, out_b, out_d)]
    s3 = [t.stride() for t in (lse_a, lse_b, lse_d)]
    with _compat.on_device(out_d.device):
        _MERGE((b * h, triton.cdiv(L, block_l)),
               out_a, lse_a, out_b, lse_b, out_d, lse_d, h, L, D,
               *(x for s in s4 for x in s[:3]), *(x for s in s3 for x in s[:2]), block_l, block_d)


def copy(dst, src) -> None:
    """dst <- src, converted to dst's dtype (same dtype: bit for bit). Shapes [b, h, L, d]."""
    add(dst, src, None)


def _alike(x: torch.Tensor, y: torch.Tensor) -> bool:
    return x.dtype == y.dtype and x.stride() == y.stride() and x.shape == y.shape


def add(dst, a, b, pair=None) -> None:
    """dst <- a + b in fp32, stored in dst's dtype; dst may be a (b None: the copy). Shapes
    [b, h, L, d]; any of the dtypes `available` takes, mixed (an fp32 accumulator plus a bf16
    block, say). `pair`: a second (dst, a, b) summed in the same launch (dK and dV) when its
    shapes, dtypes and strides are those of the first, else in a launch of its own."""
    if pair is not None and not (_alike(dst, pair[0]) and _alike(a, pair[1]) and _alike(b, pair[2])):
        add(dst, a, b)
        add(*pair)
        return
    B, h, L, D = dst.shape
    if dst.numel() == 0:
        return
    has_b = b is not None
    b = a if b is None else b  # (a copy reads a only)
    d2, a2, b2 = (dst, a, b) if pair is None else pair
    block_l, block_d = _blocks(D)
    with _compat.on_device(dst.device):
        _ADD((B * h * (1 if pair is None else 2), triton.cdiv(L, block_l)),
             a, b, dst, a2, b2, d2, B * h, h, L, D, *a.stride()[:3], *b.stride()[:3], *dst.stride()[:3],
             block_l, block_d, has_b, pair is not None)
