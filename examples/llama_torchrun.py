"""Compile a Hugging Face Llama with ringcc: the sequence is sharded across the ranks and
attention becomes exact ring attention. The model code is unmodified; the only ringcc line
is `torch.compile(model, backend="ringcc")`.

Every rank builds the same model (same seed) and calls it with the same full batch, as
single-process code would; ringcc shards the tokens inside the compiled graph, gathers the
outputs, all-reduces the loss and the parameter gradients. The script checks loss and
gradients against the eager model on every rank.

CPU, self-spawned gloo processes (no launcher needed):
    python examples/llama_torchrun.py --world-size 2
CPU under torchrun (gloo):
    torchrun --nproc-per-node 2 examples/llama_torchrun.py
GPUs (NCCL, one process per GPU; bf16 is the usual choice there, fp32 keeps the check tight):
    torchrun --nproc-per-node 8 examples/llama_torchrun.py --seq-len 32768 --hidden 1024 --layers 4
"""

from __future__ import annotations

import argparse
import copy

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import ringcc
from ringcc.launch import launch, reports


def build(hidden: int, layers: int, vocab: int = 1000) -> LlamaForCausalLM:
    """A Llama with random weights from a config (no download); GQA with 2 KV heads."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=1 << 20, attn_implementation="sdpa", use_cache=False)
    return LlamaForCausalLM(config)


def run(rank: int, world: int, seq_len: int = 256, hidden: int = 32, layers: int = 2) -> dict:
    """One training step of the compiled model and of the eager model on this rank (the
    process group, if world > 1, is already initialised). Returns the parity numbers."""
    device = torch.device(f"cuda:{torch.cuda.current_device()}") if torch.cuda.is_available() else torch.device("cpu")
    eager = build(hidden, layers).to(device)
    model = copy.deepcopy(eager)
    # inductor on CPU compiles C++ (minutes on a laptop); aot_eager runs the rewritten graph as is
    inner = "inductor" if device.type == "cuda" else "aot_eager"
    compiled = torch.compile(model, backend="ringcc", options={"inner": inner})

    ids = torch.randint(0, eager.config.vocab_size, (2, seq_len), generator=torch.Generator().manual_seed(1)).to(device)
    ref = eager(input_ids=ids, labels=ids).loss
    ref.backward()
    loss = compiled(input_ids=ids, labels=ids).loss
    loss.backward()
    loss, ref = float(loss.detach()), float(ref.detach())

    ref_grads = dict(eager.named_parameters())
    grad_err = max(float((p.grad - ref_grads[name].grad).abs().max() / ref_grads[name].grad.abs().max().clamp_min(1e-12))
                   for name, p in model.named_parameters())
    report = ringcc.last_report()
    loss_err = abs(loss - ref) / abs(ref)
    return {"rank": rank, "world": world, "loss": loss, "eager_loss": ref, "loss_rel_err": loss_err,
            "grad_rel_err": grad_err, "rewritten": len(report.rewritten), "sites": len(report.sites),
            "report": report.format(), "ok": loss_err < 1e-4 and grad_err < 1e-3 and len(report.rewritten) > 0}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=2, help="processes to spawn without torchrun")
    parser.add_argument("--seq-len", type=int, default=256, help="tokens per sequence (a multiple of 2 x ranks)")
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--layers", type=int, default=2)
    args = parser.parse_args(argv)
    results = launch(run, args.world_size, **dict(seq_len=args.seq_len, hidden=args.hidden, layers=args.layers))
    ok = all(r["ok"] for r in results)
    if not reports():  # under torchrun, rank 0 prints for every rank
        return 0 if ok else 1
    first = results[0]
    print(first["report"])
    for r in results:
        print(f"rank {r['rank']}/{r['world']}: loss {r['loss']:.6f} (eager {r['eager_loss']:.6f}), "
              f"loss rel err {r['loss_rel_err']:.1e}, max grad rel err {r['grad_rel_err']:.1e}")
    print("parity check:", "passed" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
