"""ringcc under PyTorch's own data parallelism on a DeviceMesh (gloo, 4 processes): FSDP2
(`fully_shard` on every block and the root) over the data dimension or over the flattened
data x sequence dimensions, DDP over the data dimension, whole-model and per-block compile,
activation checkpointing. Loss and every gradient (`full_tensor()`) equal single-process eager
on the global batch (Note [Gradients under data parallelism] in passes/sync_param_grads.py)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
N, B = 16, 2  # tokens per sequence, sequences per data-parallel rank


def llama3():
    """benchmarks/llama3.py (the benchmark's model), loaded by path."""
    if "llama3" not in sys.modules:
        spec = importlib.util.spec_from_file_location("llama3", ROOT / "benchmarks" / "llama3.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules["llama3"] = mod
        spec.loader.exec_module(mod)
    return sys.modules["llama3"]


_MESHES: dict = {}


def mesh(shape: tuple[int, ...], names: tuple[str, ...]):
    """One DeviceMesh per layout for the pool's life (each makes process groups)."""
    from torch.distributed.device_mesh import init_device_mesh

    key = (shape, names)
    if key not in _MESHES:
        m = init_device_mesh("cpu", shape, mesh_dim_names=names)
        _MESHES[key] = (m, m["dp", "cp"]._flatten("dp_cp") if set(names) == {"dp", "cp"} else None)
    return _MESHES[key]


def global_batch(dp: int):
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, llama3().TINY.vocab, (dp * B, N), generator=gen)
    labels = torch.randint(0, llama3().TINY.vocab, (dp * B, N), generator=gen)
    return tokens, labels


def case_fsdp(rank, world, shape, names, shard_over, compile_mode, checkpoint, engine="fsdp", grad_sync="auto"):
    """One training step; returns (max loss error, {param: max grad error}, grad scale, sync decisions)."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    import ringcc

    lm = llama3()
    device_mesh, flat = mesh(shape, names)
    dp_mesh = {"dp": device_mesh["dp"], "dp_cp": flat}[shard_over]
    dp, dp_rank = device_mesh["dp"].size(), device_mesh["dp"].get_local_rank()
    tokens, labels = global_batch(dp)
    torch.manual_seed(0)
    ref = lm.Llama()
    ref_loss = ref(tokens, labels)
    ref_loss.backward()
    ref_loss = ref_loss.detach()
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}

    torch.manual_seed(0)
    model = lm.Llama()
    backend = ringcc.backend(ringcc.Config(mesh=device_mesh, axis="cp", inner="aot_eager", grad_sync=grad_sync))
    if checkpoint:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        for i, layer in enumerate(model.layers):
            model.layers[i] = checkpoint_wrapper(layer)
    if compile_mode == "block":
        for layer in model.layers:
            layer.compile(backend=backend)
        model.head.compile(backend=backend)
    if engine == "fsdp":
        for layer in model.layers:
            fully_shard(layer, mesh=dp_mesh)
        fully_shard(model, mesh=dp_mesh)
    else:
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model, process_group=dp_mesh.get_group())
    step = torch.compile(model, backend=backend) if compile_mode == "model" else model
    ringcc.reset_reports()
    mine = slice(dp_rank * B, (dp_rank + 1) * B)
    loss = step(tokens[mine], labels[mine])
    loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total, group=device_mesh.get_group("dp"))
    loss_err = float((total / dp - ref_loss).abs())
    named = model.module.named_parameters() if engine == "ddp" else model.named_parameters()
    grad_errs = {}
    for name, p in named:
        name = name.replace("_checkpoint_wrapped_module.", "")
        g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        r = ref_grads[name]
        grad_errs[name] = float((g - r).abs().max()) / max(float(r.abs().max()), 1e-3)
    decisions = [d for rep in ringcc.reports() for d in rep.notes if d.startswith("parameter gradients")]
    return loss_err, grad_errs, decisions


CASES = {
    # mesh (dp=2, cp=2), FSDP2 over dp, the whole model compiled (FSDP2's hooks break it per block)
    "fsdp_dp-model": ((2, 2), ("dp", "cp"), "dp", "model", False),
    "fsdp_dpcp-block-ac": ((2, 2), ("dp", "cp"), "dp_cp", "block", True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_fsdp_gradients_equal_single_process(pools, case):
    results = pools(4).run(case_fsdp, *CASES[case], timeout=300)
    for rank, (loss_err, grad_errs, _) in enumerate(results):
        assert loss_err < 1e-5, (rank, loss_err)
        bad = {n: e for n, e in grad_errs.items() if not e < 1e-5}
        assert not bad, (rank, bad)
    print(case, results[0][2])
