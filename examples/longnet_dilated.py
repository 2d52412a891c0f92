"""LongNet dilated attention with the functional API, on a sequence sharded across ranks.

`ringcc.dilated_attention(q, k, v, spec)` takes this rank's shard [b, h, n/p, d] of q/k/v.
Branch i of `DilatedSpec(segment_lengths, dilation_rates)` splits the sequence into
segments of w_i tokens and keeps every r_i-th row of each (per-head offsets); the branches
are mixed by their softmax denominators. A segment longer than a shard spans several ranks:
only its sparse (dilated) K/V rows travel between them. The script checks the output and
the gradients of q/k/v against the dense reference `ringcc.reference.dilated_attention`.

CPU, self-spawned gloo processes:
    python examples/longnet_dilated.py --world-size 4
CPU under torchrun (gloo):
    torchrun --nproc-per-node 4 examples/longnet_dilated.py
GPUs (NCCL, one process per GPU):
    torchrun --nproc-per-node 8 examples/longnet_dilated.py --seq-len 65536 --segments 2048,8192,32768 --rates 1,4,16
(the dense reference is O(n^2): pass --no-check at lengths where it does not fit)
"""

from __future__ import annotations

import argparse

import torch

import ringcc
from ringcc.launch import launch, reports


def run(rank: int, world: int, seq_len: int = 256, segments=(32, 128), rates=(1, 4), heads: int = 4,
        head_dim: int = 16, causal: bool = True, check: bool = True) -> dict:
    """Dilated attention on this rank's shard (the process group, if world > 1, is already
    initialised), gathered back and compared with the dense reference."""
    device = torch.device(f"cuda:{torch.cuda.current_device()}") if torch.cuda.is_available() else torch.device("cpu")
    spec = ringcc.DilatedSpec(segment_lengths=tuple(segments), dilation_rates=tuple(rates))
    gen = torch.Generator().manual_seed(0)  # the same full tensors on every rank
    q, k, v, dout = (torch.randn(2, heads, seq_len, head_dim, generator=gen).to(device).requires_grad_(i < 3)
                     for i in range(4))

    # This rank's shards; shard_sequence / gather_sequence are differentiable mirrors.
    q_l, k_l, v_l = (ringcc.shard_sequence(t, 2) for t in (q, k, v))
    out_l = ringcc.dilated_attention(q_l, k_l, v_l, spec, is_causal=causal)
    out = ringcc.gather_sequence(out_l, 2)
    out.backward(dout)
    result = {"rank": rank, "world": world, "spec": repr(spec), "n_local": q_l.shape[2], "ok": True}
    if not check:
        return result
    grads = [t.grad for t in (q, k, v)]
    qr, kr, vr = (t.detach().clone().requires_grad_() for t in (q, k, v))
    ref, _ = ringcc.reference.dilated_attention(qr, kr, vr, spec, is_causal=causal)
    ref.backward(dout)
    out_err = float((out - ref).detach().abs().max())
    grad_err = max(float((g - r.grad).abs().max()) for g, r in zip(grads, (qr, kr, vr)))
    result.update(out_err=out_err, grad_err=grad_err, ok=out_err < 1e-4 and grad_err < 1e-4)
    return result


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(","))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=2, help="processes to spawn without torchrun")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--segments", type=_ints, default=(32, 128), help="segment lengths, e.g. 32,128")
    parser.add_argument("--rates", type=_ints, default=(1, 4), help="dilation rates, e.g. 1,4")
    parser.add_argument("--no-causal", dest="causal", action="store_false")
    parser.add_argument("--no-check", dest="check", action="store_false", help="skip the dense O(n^2) reference")
    args = parser.parse_args(argv)
    results = launch(run, args.world_size, **dict(seq_len=args.seq_len, segments=args.segments, rates=args.rates,
                                           causal=args.causal, check=args.check))
    ok = all(r["ok"] for r in results)
    if not reports():  # under torchrun, rank 0 prints for every rank
        return 0 if ok else 1
    for r in results:
        errs = f", max |out - ref| {r['out_err']:.1e}, max |grad - ref| {r['grad_err']:.1e}" if "out_err" in r else ""
        print(f"rank {r['rank']}/{r['world']}: {r['spec']} on {r['n_local']} local tokens{errs}")
    print("parity check:", "passed" if ok else "FAILED" if args.check else "skipped")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
