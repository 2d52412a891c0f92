"""One rank of the soak test (tests/test_soak.py), started by torchrun: a small causal model
compiled with ringcc trains for --steps steps at lengths that change every step; the rank
writes its memory and thread record to --out/rank<r>.json and ends as gloo workers end
(ringcc.launch.exit_worker)."""

import argparse
import json
import os
import threading

import torch
import torch.distributed as dist
import torch.nn.functional as F

import ringcc
from ringcc.launch import exit_worker


class Model(torch.nn.Module):
    def __init__(self, vocab=64, d=32, heads=2):
        super().__init__()
        self.heads = heads
        self.embed, self.qkv, self.out = torch.nn.Embedding(vocab, d), torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, vocab)

    def forward(self, ids, labels):
        x = self.embed(ids)
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, n, d)
        return F.cross_entropy(self.out(x + y).flatten(0, 1), labels.flatten())


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=40)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = Model()
    compiled = torch.compile(model, backend=ringcc.backend(inner="aot_eager"))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    lengths = (32, 40, 48, 56, 64)  # multiples of 2p = 8 (zigzag)
    record = {"rank": rank}
    for step in range(args.steps):
        n = lengths[step % len(lengths)]
        ids = torch.randint(0, 64, (2, n), generator=gen)
        opt.zero_grad()
        loss = compiled(ids, ids.roll(-1, 1))
        loss.backward()
        opt.step()
        if step == args.warmup - 1:
            record.update(rss_warm=rss_bytes(), threads_warm=sorted(t.name for t in threading.enumerate()),
                          tasks_warm=len(os.listdir("/proc/self/task")))
    record.update(rss_end=rss_bytes(), threads_end=sorted(t.name for t in threading.enumerate()),
                  tasks_end=len(os.listdir("/proc/self/task")), loss=float(loss), steps=args.steps,
                  graphs=len(ringcc.reports()))
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(record, f)
    exit_worker()


if __name__ == "__main__":
    main()
