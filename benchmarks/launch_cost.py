"""Host time per call of the ring's elementwise operations (one GPU): what it costs the host to
issue each, with the GPU kept busy by a spin so no call waits for it.

    python benchmarks/launch_cost.py --json launch.json

Rows: a plain torch op (the reference), the ring's copy, the Triton merge and add (fused.py,
with and without the availability check), the compiled torch merge (merge.py's fallback), and
the cuDNN block kernel of one head chunk. Prints a table, writes JSON, names the device.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch


def host_us(fn, calls: int, repeats: int = 5) -> float:
    """Median over `repeats` of the host µs per call of `fn`, issued behind a GPU spin."""
    from ringcc import _compat

    fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(repeats):
        _compat.cuda_spin(int(2e8))  # about 0.1 s of GPU work ahead of the calls
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        out.append(1e6 * (time.perf_counter() - t) / calls)
        torch.cuda.synchronize()
    return statistics.median(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--rows", type=int, default=16384)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    from ringcc.runtime import fused, kernels, merge
    from ringcc.runtime.ring import copy_by_kernel

    dev = torch.device("cuda", 0)
    shape = (1, args.heads, args.rows, args.head_dim)
    bf = lambda: torch.randn(shape, device=dev).bfloat16()  # noqa: E731
    oa, ob, o16 = bf(), bf(), torch.empty(shape, device=dev, dtype=torch.bfloat16)
    acc = torch.randn(shape, device=dev)
    la, lb, ld = (torch.randn(shape[:3], device=dev) for _ in range(3))
    q, k, v = bf(), bf(), bf()
    rows = []

    def row(name, fn):
        rows.append({"call": name, "host_us": host_us(fn, args.calls)})

    row("torch.add(fp32, bf16, out=bf16)", lambda: torch.add(acc, ob, out=o16))
    row("copy_by_kernel (bf16)", lambda: copy_by_kernel(o16, oa))
    if fused.triton is not None:
        row("fused.available (6 tensors)", lambda: fused.available((o16, oa, ob), (ld, la, lb)))
        row("fused.merge (Triton launch)", lambda: fused.merge(o16, ld, oa, la, ob, lb))
        row("fused.add (Triton launch)", lambda: fused.add(acc, oa, ob))
        row("merge.merge_ (check + Triton)", lambda: merge.merge_(oa, la, ob, lb, o16, ld))
    fn = merge._merge_to
    compiled = torch.compile(fn, fullgraph=True)
    row("compiled torch merge", lambda: compiled(o16, ld, oa, la, ob, lb))
    row("kernels.block_fwd (cuDNN)", lambda: kernels.block_fwd(q, k, v, scale=args.head_dim ** -0.5, causal=False))
    name = torch.cuda.get_device_name(dev)
    print(f"device: {name}; torch {torch.__version__}; triton "
          f"{getattr(fused.triton, '__version__', 'none')}; tensors {list(shape)} bf16; host µs per call")
    for r in rows:
        print(f"  {r['call']:<36} {r['host_us']:>8.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"device": name, "torch": torch.__version__,
                                               "triton": getattr(fused.triton, "__version__", None),
                                               "shape": list(shape), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
