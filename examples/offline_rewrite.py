"""The offline rewrite, programmatically: export a model, rewrite it for P ranks, save the
program, then load it in P fresh processes and check it against the eager model.

The same as the command line (this file's `make_model` is a factory the CLI can load):
    ringcc rewrite examples/offline_rewrite.py:make_model --world-size 2 --dynamic-seq -o out/rewritten/

The saved program.pt2 is the whole model: every rank loads it (after `import ringcc`, which
registers the ops it calls), calls it with the same full inputs, and gets the full outputs;
it runs on exactly P ranks of the default process group (Note [Offline program contract]
in ringcc/rewrite.py). With --dynamic-seq one program serves every length the layout divides.

CPU, self-spawned gloo processes:
    python examples/offline_rewrite.py --world-size 2 --out out/rewritten/
CPU under torchrun (gloo), after rewriting once (the CLI line above, or --rewrite-only):
    torchrun --nproc-per-node 2 examples/offline_rewrite.py --out out/rewritten/ --load-only
GPUs (NCCL; `run` moves the loaded module and the inputs to the rank's GPU), after rewriting
for 8 ranks once (the program is built for one P):
    python examples/offline_rewrite.py --world-size 8 --out out/rewritten/ --rewrite-only
    torchrun --nproc-per-node 8 examples/offline_rewrite.py --world-size 8 --out out/rewritten/ --load-only
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.nn.functional as F
from torch import nn

import ringcc  # noqa: F401 - registers the ringcc ops that a loaded program calls
from ringcc.launch import launch, reports
from ringcc.rewrite import rewrite, save


class CausalLM(nn.Module):
    """A small GPT-style model with hand-written attention (ringcc recognises the form)."""

    def __init__(self, vocab: int = 1000, dim: int = 48, heads: int = 4, layers: int = 2):
        super().__init__()
        self.heads = heads
        self.embed = nn.Embedding(vocab, dim)
        self.qkv = nn.ModuleList(nn.Linear(dim, 3 * dim) for _ in range(layers))
        self.mlp = nn.ModuleList(nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
                                 for _ in range(layers))
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens, labels):
        x = self.embed(tokens)
        b, n, dim = x.shape
        causal = torch.ones(n, n, dtype=torch.bool, device=x.device).tril()
        for qkv, mlp in zip(self.qkv, self.mlp):
            q, k, v = qkv(x).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
            scores = (q @ k.transpose(-2, -1)) / (q.shape[-1] ** 0.5)
            att = scores.masked_fill(~causal, float("-inf")).softmax(-1) @ v
            x = x + att.transpose(1, 2).reshape(b, n, dim)
            x = x + mlp(x)
        return F.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())


def make_model(seq_len: int = 256):
    """(model, example_inputs): the factory `ringcc rewrite` calls."""
    torch.manual_seed(0)
    tokens = torch.randint(0, 1000, (2, seq_len), generator=torch.Generator().manual_seed(1))
    return CausalLM(), (tokens, torch.roll(tokens, -1, dims=1))


def run(rank: int, world: int, path: str, lengths=(256,)) -> dict:
    """Load the program (the process group, if world > 1, is already initialised) and
    compare its loss with the eager model's at each length."""
    device = torch.device(f"cuda:{torch.cuda.current_device()}") if torch.cuda.is_available() else torch.device("cpu")
    program = torch.export.load(path).module().to(device)
    errs = []
    for n in lengths:
        model, inputs = make_model(n)
        model, inputs = model.to(device), tuple(x.to(device) for x in inputs)
        program.load_state_dict(model.state_dict())  # the weights are the same; this makes it explicit
        with torch.no_grad():
            errs.append(abs(float(program(*inputs)) - float(model(*inputs))))
    return {"rank": rank, "world": world, "lengths": list(lengths), "max_err": max(errs), "ok": max(errs) < 1e-4}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=2, help="ranks P to rewrite for (and to spawn without torchrun)")
    parser.add_argument("--out", default="out/rewritten", help="folder for program.pt2, program.py, report, plan")
    parser.add_argument("--seq-len", type=int, default=256, help="example length for the export")
    parser.add_argument("--load-only", action="store_true", help="load an existing OUT/program.pt2")
    parser.add_argument("--rewrite-only", action="store_true", help="write OUT/program.pt2 and stop")
    args = parser.parse_args(argv)
    if not args.load_only:
        if "RANK" in os.environ:
            parser.error("under torchrun pass --load-only: rewrite once first, without torchrun (every rank would write OUT)")
        model, inputs = make_model(args.seq_len)
        program, report = rewrite(model, inputs, world_size=args.world_size, dynamic=True)
        print(report.format())
        if program is None:
            return 3
        for path in save(program, report, args.out).values():
            print(f"wrote {path}")
        if args.rewrite_only:
            return 0
    lengths = (args.seq_len, args.seq_len + 4 * args.world_size)  # one dynamic program, two lengths
    results = launch(run, args.world_size, os.path.join(args.out, "program.pt2"), lengths)
    ok = all(r["ok"] for r in results)
    if not reports():  # under torchrun, rank 0 prints for every rank
        return 0 if ok else 1
    for r in results:
        print(f"rank {r['rank']}/{r['world']}: lengths {r['lengths']}, max |loss - eager loss| {r['max_err']:.1e}")
    print("parity check:", "passed" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
