"""The one log-sum-exp merge every attention path uses, and the fp32 sum of partial gradients.

Legend: out_* are [..., L, d], lse_* are [..., L]; lse is natural-log, in the accumulator
dtype (fp32, or fp64 for fp64 inputs). A row that has seen no unmasked key so far has
lse = -inf and out = 0, and stays NaN-free through any number of merges.

Partial results may stay in the kernels' own dtype (bf16) while they hold one block only
(exact: widening adds nothing); both functions here widen their inputs to the accumulator
dtype themselves, and write wherever the destination says: in place into an fp32
accumulator, a new fp32 accumulator, or the output in the input dtype when the sum is
complete (Note [Fewer passes] in ring.py).
"""

from __future__ import annotations

import warnings

import torch

from . import fused
from .dtypes import acc_dtype


def _merge_to(dst_out, dst_lse, out_a, lse_a, out_b, lse_b) -> None:
    adt = dst_lse.dtype
    lse_new = torch.logaddexp(lse_a, lse_b)
    # Where both are -inf the row is still empty; use 0 as the reference so weights are 0.
    ref = torch.where(torch.isneginf(lse_new), torch.zeros_like(lse_new), lse_new)
    w_a = torch.exp(lse_a - ref).unsqueeze(-1)
    w_b = torch.exp(lse_b - ref).unsqueeze(-1)
    dst_out.copy_(out_a.to(adt) * w_a + out_b.to(adt) * w_b)
    dst_lse.copy_(lse_new)


_compiled_merge = None  # torch.compile(_merge_to) once needed; False once it failed


def _merge_compiled(*args) -> None:
    """_merge_to(*args) as one inductor-generated kernel on CUDA where the Triton kernels
    (fused.py) do not apply, e.g. fp64 (eagerly the merge takes about six passes); eager
    elsewhere, or when compilation fails (warned once)."""
    global _compiled_merge
    if args[0].is_cuda and _compiled_merge is not False:
        if _compiled_merge is None:
            # Static shapes first (dynamic=True doubled the host's cost per call, 188 -> 354 µs,
            # host time per call on 2 x H200); torch makes a graph dynamic when
            # its shapes change.
            _compiled_merge = torch.compile(_merge_to, fullgraph=True)
        try:
            _compiled_merge(*args)
            return
        except Exception as e:  # noqa: BLE001 - compilation failed (e.g. recompile limit): stay eager
            warnings.warn(f"ringcc: fused LSE merge unavailable ({type(e).__name__}: {e}); running it eagerly")
            _compiled_merge = False
    _merge_to(*args)


_triton_ok = True  # False once a Triton kernel failed (warned once)


def _triton(outs, lses=()) -> bool:
    return _triton_ok and outs[0].is_cuda and fused.available(outs, lses)


def _triton_failed(e: Exception) -> None:
    global _triton_ok
    warnings.warn(f"ringcc: Triton kernels for the ring's sums failed ({type(e).__name__}: {e}); using torch's")
    _triton_ok = False


def merge_(out_acc: torch.Tensor, lse_acc: torch.Tensor, out_blk: torch.Tensor, lse_blk: torch.Tensor,
           out_dst: torch.Tensor | None = None, lse_dst: torch.Tensor | None = None) -> None:
    """(out_dst, lse_dst) <- softmax-weighted union of (out_acc, lse_acc) and the block; in
    place (into the accumulators) unless destinations are given. out_dst's dtype may be the
    accumulator's or the input's (the last merge writes the output); out_acc may be the first
    block's own output (input dtype)."""
    out_dst = out_acc if out_dst is None else out_dst
    lse_dst = lse_acc if lse_dst is None else lse_dst
    if _triton((out_dst, out_acc, out_blk), (lse_dst, lse_acc, lse_blk)):
        try:
            fused.merge(out_dst, lse_dst, out_acc, lse_acc, out_blk, lse_blk)
            return
        except Exception as e:  # noqa: BLE001 - a Triton failure: the compiled torch merge instead
            _triton_failed(e)
    _merge_compiled(out_dst, lse_dst, out_acc, lse_acc, out_blk, lse_blk)


def add_into(dst: torch.Tensor, a: torch.Tensor, b: torch.Tensor, pair=None) -> None:
    """dst <- a + b, summed in the accumulator dtype (fp32; fp64 for fp64) whatever the dtypes of
    a, b (the kernels' bf16 or the accumulator's) and dst (the accumulator's, or the input's
    for the last addition); dst may be a. `pair`: a second (dst, a, b), summed alike (dK with
    dV: on CUDA in the same launch). One pass: on CUDA the Triton kernel (fused.py), which
    widens each operand as it loads it (torch's add of an fp32 and a bf16 operand runs its
    unvectorized mixed-dtype kernel, about twice as long on H200; a compiled torch function
    would cost the host 100-200 µs per call); elsewhere torch.add widens the other operand
    inside its kernel when one is in the accumulator dtype, and two operands in the input dtype
    take two passes, the first widening a."""
    if _triton((dst, a, b)) and (pair is None or _triton(pair)):
        try:
            fused.add(dst, a, b, pair)
            return
        except Exception as e:  # noqa: BLE001 - a Triton failure: torch's ops instead
            _triton_failed(e)
    for dst, a, b in [(dst, a, b)] + ([] if pair is None else [pair]):
        adt = acc_dtype(torch.promote_types(a.dtype, b.dtype))
        if a.dtype == adt or b.dtype == adt:
            x, y = (a, b) if a.dtype == adt else (b, a)  # fp addition commutes exactly
            torch.add(x, y, out=dst)  # computed in adt (the common dtype), stored in dst's
        elif dst.dtype == adt:
            copy_by_kernel(dst, a)
            dst.add_(b)
        else:
            torch.add(a.to(adt), b, out=dst)


def copy_by_kernel(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst.copy_(src), as an elementwise kernel on CUDA. A same-dtype copy would be a memcpy,
    done by the copy engines that also carry the ring's peer copies (Note [Copy-engine ring]
    in comm.py), so it may wait behind them. A/B on one 4 x H200 machine (copy-engine ring,
    default chunks): 16K tokens per GPU causal 32.45 -> 31.58 ms, 64K per GPU non-causal
    924.93 -> 920.61 ms. Contiguous tensors of one dtype take x * 1 (torch's vectorized kernel,
    the cheapest launch for the host; exact for every number, -0.0 included, a NaN stays a
    NaN); strided views and widening or narrowing copies of [b, h, L, d] and [b, h, L] take
    the Triton copy (a load and a store; torch's kernels for them are unvectorized)."""
    if not (dst.is_cuda and dst.dtype.is_floating_point):
        dst.copy_(src)
        return
    same = dst.dtype == src.dtype
    if same and dst.is_contiguous() and src.is_contiguous():
        torch.mul(src, 1, out=dst)
        return
    if dst.shape == src.shape and dst.dim() in (3, 4):
        d4, s4 = (dst, src) if dst.dim() == 4 else (dst.unsqueeze(-1), src.unsqueeze(-1))
        if _triton((d4, s4)):
            try:
                fused.copy(d4, s4)
                return
            except Exception as e:  # noqa: BLE001 - a Triton failure: torch's ops instead
                _triton_failed(e)
    if same:
        torch.mul(src, 1, out=dst)
    else:
        dst.copy_(src)


def contiguous(t: torch.Tensor) -> torch.Tensor:
    """t when it is contiguous, else a contiguous copy made by `copy_by_kernel`: a [b, h, L, d]
    view of a [b, L, h, d] projection (the ring's K/V and dout as models hand them over) takes
    the Triton copy, where Tensor.contiguous() runs torch's unvectorized strided copy (in a
    compiled 8-layer step at 8K tokens per GPU on 4 x H200 the ring's passes went from 6.4-7.0
    to 5.3 ms: benchmarks/RESULTS.md)."""
    if t.is_contiguous():
        return t
    out = torch.empty(t.shape, dtype=t.dtype, device=t.device)
    copy_by_kernel(out, t)
    return out


def merge(outs: list[torch.Tensor], lses: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Differentiable merge of several partial results (used where gradients flow through
    the mixing weights, e.g. dilated branches)."""
    lse_all = torch.stack(lses)  # [k, ..., L]
    lse = torch.logsumexp(lse_all, dim=0)
    ref = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
    w = torch.exp(lse_all - ref).unsqueeze(-1)
    out = (torch.stack(outs).to(w.dtype) * w).sum(0)
    return out, lse


def merge_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) [b, h, L, dv] / [b, h, L] with each head's sink logit `sinks` [h] merged into every
    row once, as one more block whose value is zero (Note [Attention sinks] in ops.py):
    lse' = logaddexp(lse, sink[h]), out' = out * exp(lse - lse'), out' in out's dtype."""
    adt = lse.dtype
    lse_new = torch.logaddexp(lse, sinks.to(adt)[None, :, None])
    ref = torch.where(torch.isneginf(lse_new), torch.zeros_like(lse_new), lse_new)
    out_new = (out.to(adt) * torch.exp(lse - ref).unsqueeze(-1)).to(out.dtype)
    return out_new, lse_new


def sink_grad(dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """The gradient of this rank's rows with respect to the sink logits [h], given the rows'
    final (out, lse) (sinks merged in): -sum over rows of exp(sink[h] - lse) * rowsum(dO * O)
    (Note [Attention sinks] in ops.py), in the sinks' dtype."""
    adt = lse.dtype
    delta = (dout.to(adt) * out.to(adt)).sum(-1)  # [b, h, L]
    prob = torch.exp(sinks.to(adt)[None, :, None] - lse)  # the sink's probability in each row
    return (-(prob * delta).sum((0, 2))).to(sinks.dtype)
