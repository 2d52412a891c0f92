"""ringcc under PyTorch's own data parallelism on a DeviceMesh (gloo, 4 processes): FSDP2
(`fully_shard` on every block and the root) over the data dimension or over the flattened
data x sequence dimensions, DDP over the data dimension, whole-model and per-block compile,
activation checkpointing. Loss and every gradient (`full_tensor()`) equal single-process eager
on the global batch (Note [Gradients under data parallelism] in passes/sync_param_grads.py)."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
N, B = 16, 2  # tokens per sequence, sequences per data-parallel rank


def bench():
    """benchmarks/bench_fsdp.py (its model is benchmarks/llama3.py), loaded by path."""
    if "bench_fsdp" not in sys.modules:
        spec = importlib.util.spec_from_file_location("bench_fsdp", ROOT / "benchmarks" / "bench_fsdp.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules["bench_fsdp"] = mod
        spec.loader.exec_module(mod)
    return sys.modules["bench_fsdp"]


def llama3():
    return bench().llama3


_MESHES: dict = {"group": None}  # the default group the meshes are made in, and the meshes


def mesh(shape: tuple[int, ...], names: tuple[str, ...]):
    """(the 2-D mesh, a 1-D mesh over all its ranks), one per layout for the life of the process's
    default group (each makes process groups; the pool changes the default group when the world
    size changes)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if _MESHES["group"] is not dist.group.WORLD:
        _MESHES.clear()
        _MESHES["group"] = dist.group.WORLD
    key = (shape, names)
    if key not in _MESHES:
        _MESHES[key] = (init_device_mesh("cpu", shape, mesh_dim_names=names),
                        init_device_mesh("cpu", (shape[0] * shape[1],), mesh_dim_names=("dp_cp",)))
    return _MESHES[key]


def global_batch(dp: int):
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, llama3().TINY.vocab, (dp * B, N), generator=gen)
    labels = torch.randint(0, llama3().TINY.vocab, (dp * B, N), generator=gen)
    return tokens, labels


def case_fsdp(rank, world, shape, names, shard_over, compile_mode, checkpoint, engine, grad_sync):
    """One training step; returns (loss error, {param: max gradient error relative to the largest
    entry, floored at 1e-3}, the reports' notes on parameter gradients, the gathers, the parameters
    with a gradient, eager's)."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    import ringcc

    lm = llama3()
    torch.compiler.reset()  # each case compiles afresh (the pool's processes outlive cases)
    device_mesh, flat = mesh(shape, names)
    dp_mesh = {"dp": device_mesh["dp"], "dp_cp": flat}[shard_over]
    dp, dp_rank = device_mesh["dp"].size(), device_mesh["dp"].get_local_rank()
    tokens, labels = global_batch(dp)
    # per-block compile also compiles the head, its loss over vocabulary chunks (the benchmark's)
    cfg = dataclasses.replace(lm.TINY, vocab_chunks=2 if compile_mode == "block" else 1)
    torch.manual_seed(0)
    ref = lm.Llama(cfg)
    ref_loss = ref(tokens, labels)
    ref_loss.backward()
    ref_loss = ref_loss.detach()
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}

    torch.manual_seed(0)
    model = lm.Llama(cfg)
    backend = ringcc.backend(ringcc.Config(mesh=device_mesh, axis="cp", inner="eager", grad_sync=grad_sync))
    if checkpoint:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        for i, layer in enumerate(model.layers):
            model.layers[i] = checkpoint_wrapper(layer)
    if compile_mode == "block":
        for layer in model.layers:
            layer.compile(backend=backend)
        bench().compile_head(model.head, backend)
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
    with eager_gathers() as gathered:
        loss = step(tokens[mine], labels[mine])
        loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total, group=device_mesh.get_group("dp"))
    loss_err = float((total / dp - ref_loss).abs())
    named = model.module.named_parameters() if engine == "ddp" else model.named_parameters()
    grad_errs, have = {}, set()
    for name, p in named:
        if p.grad is None:
            continue
        name = name.replace("_checkpoint_wrapped_module.", "")
        have.add(name)
        g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        r = ref_grads[name]
        grad_errs[name] = float((g - r).abs().max()) / max(float(r.abs().max()), 1e-3)
    decisions = [d for rep in ringcc.reports() for d in rep.notes if d.startswith("parameter gradients")]
    gathers = gathered + [f"{g.node}: {g.why}" for rep in ringcc.reports() for g in rep.gathers]
    want = {n for n, g in ref_grads.items() if g is not None}
    return loss_err, grad_errs, decisions, gathers, have, want


@contextlib.contextmanager
def eager_gathers():
    """The shapes of SequenceSharded values gathered outside any graph while it is open."""
    import ringcc.sharded

    shapes, gather = [], ringcc.sharded.gather_op

    def counted(x, *args):
        if not torch.compiler.is_compiling():
            shapes.append(f"eager gather of {tuple(x.shape)}")
        return gather(x, *args)

    ringcc.sharded.gather_op = counted
    try:
        yield shapes
    finally:
        ringcc.sharded.gather_op = gather


# name: (mesh shape, mesh dim names, what the engine averages over, compile, checkpoint, engine, grad_sync)
SOAK_CASES = {
    # FSDP2 over dp, the whole model compiled (FSDP2's hooks break it per block): ringcc all-reduces
    # over cp, FSDP2 averages over dp
    "fsdp_dp-model": ((2, 2), ("dp", "cp"), "dp", "model", False, "fsdp", "auto"),
    # cp on the outer mesh dim (sequence groups {0, 2} and {1, 3}); FSDP2 over all ranks (torchtitan's
    # dp x cp), each block under checkpoint_wrapper and compiled, the head compiled with its input
    # marked (the benchmark's setup): ringcc scales the shares, FSDP2's mean over cp sums them
    "fsdp_dpcp-block-ac-cp_outer": ((2, 2), ("cp", "dp"), "dp_cp", "block", True, "fsdp", "outer"),
    "fsdp_dp-model-cp_outer": ((2, 2), ("cp", "dp"), "dp", "model", False, "fsdp", "auto"),
    "fsdp_dpcp-block-ac": ((2, 2), ("dp", "cp"), "dp_cp", "block", True, "fsdp", "outer"),
    "fsdp_dp-block-ac": ((2, 2), ("dp", "cp"), "dp", "block", True, "fsdp", "auto"),
    "fsdp_dpcp-block-ac-auto": ((2, 2), ("dp", "cp"), "dp_cp", "block", True, "fsdp", "auto"),
    "fsdp_dpcp-model": ((2, 2), ("dp", "cp"), "dp_cp", "model", False, "fsdp", "auto"),
    "fsdp_dpcp-block-cp_outer": ((2, 2), ("cp", "dp"), "dp_cp", "block", False, "fsdp", "auto"),
    "fsdp_dpcp-block-all_reduce": ((2, 2), ("dp", "cp"), "dp_cp", "block", False, "fsdp", "all_reduce"),
    "fsdp_cp4-model": ((1, 4), ("dp", "cp"), "dp", "model", False, "fsdp", "auto"),
    "fsdp_cp4-block-ac": ((1, 4), ("dp", "cp"), "dp_cp", "block", True, "fsdp", "auto"),
    "ddp_dp-model": ((2, 2), ("dp", "cp"), "dp", "model", False, "ddp", "auto"),
    "ddp_dpcp-model": ((2, 2), ("dp", "cp"), "dp_cp", "model", False, "ddp", "auto"),
}


def _check(results, case):
    """Loss and gradients; and each parameter's gradient reduced once over cp: all-reduced by
    ringcc, or scaled for an engine that averages over the whole mesh."""
    shape, names, shard_over, compile_mode, checkpoint, engine, grad_sync = case
    covers = shard_over == "dp_cp"
    # the blocks' graphs: FSDP2's units, found by grad_sync="auto". Block 0 reads the embedding's
    # output and block 1 the SequenceSharded output of block 0, so FSDP2's blocks make two graphs
    # of one code. DDP breaks no graph, so its whole model is one graph of all 20 parameters.
    k = 20 if engine == "ddp" else 9
    blocks = [(0, k) if covers and grad_sync != "all_reduce" else (k, 0)] * (1 if engine == "ddp" else 2)
    # per-block compile also shards the head (its input marked): the norm's and the embedding's
    # weights and the embedding's two vocabulary chunks; its module is no FSDP2 unit, so only
    # grad_sync="outer" scales them
    head = (0, 4) if grad_sync == "outer" else (4, 0)
    # whole-model compile under FSDP2: the root's graph after the last block reads its shards too
    # (the final norm's weight and the tied output projection); ringcc all-reduces them over cp,
    # which is exact under either FSDP2 mesh (its mean over dp x cp counts each sum p times over
    # p ranks)
    root = (2, 0)
    expected = blocks + [head] if compile_mode == "block" else blocks + ([root] if engine == "fsdp" else [])
    for rank, (loss_err, grad_errs, notes, gathers, have, want) in enumerate(results):
        assert have == want, (rank, sorted(want - have), sorted(have - want))
        assert loss_err < 1e-5, (rank, loss_err)
        assert gathers == [], (rank, gathers)  # activations cross every block boundary as shards
        bad = {n: e for n, e in grad_errs.items() if not e < 1e-5}
        assert not bad, (rank, bad)
        got = [n[:n.index(" scaled")] for n in notes]
        assert got == [f"parameter gradients: {a} all-reduced over the sequence group, {b}" for a, b in expected], notes


@pytest.mark.soak
@pytest.mark.parametrize("case", list(SOAK_CASES))
def test_gradients_equal_single_process_soak(pools, case):
    _check(pools(4).run(case_fsdp, *SOAK_CASES[case], timeout=600), SOAK_CASES[case])


def case_config_errors(rank, world):
    import torch.distributed as dist

    from ringcc import Config
    from ringcc.backend import sequence_group


    device_mesh, _ = mesh((2, 2), ("dp", "cp"))
    errors = []
    for kwargs in ({"mesh": device_mesh, "axis": "sp"}, {"mesh": device_mesh}, {"axis": "cp"},
                   {"mesh": device_mesh, "axis": "cp", "group": device_mesh.get_group("cp")},
                   {"mesh": device_mesh.get_group("cp"), "axis": "cp"}):
        try:
            Config(**kwargs)
            errors.append(None)
        except (TypeError, ValueError) as e:
            errors.append(f"{type(e).__name__}: {e}")
    cp = dist.get_process_group_ranks(sequence_group(Config(mesh=device_mesh, axis="cp")))
    cp_outer = dist.get_process_group_ranks(sequence_group(Config(mesh=mesh((2, 2), ("cp", "dp"))[0], axis="cp")))
    return errors, cp, cp_outer


def test_mesh_options_and_their_errors(pools):
    results = pools(4).run(case_config_errors)
    for rank, (errors, cp, cp_outer) in enumerate(results):
        assert errors == [
            "ValueError: Config.axis='sp' is not a dimension of Config.mesh; its dimensions are ['dp', 'cp']",
            "ValueError: Config.mesh has 2 dimensions ['dp', 'cp']; set Config.axis to the one that shards the sequence",
            "ValueError: Config.axis='cp' needs Config.mesh (the DeviceMesh it names a dimension of)",
            "ValueError: Config.mesh and Config.group both name the sequence group; pass one of them "
            "(mesh=..., axis=... or group=mesh.get_group(axis))",
            "TypeError: Config.mesh must be a torch.distributed.device_mesh.DeviceMesh; got ProcessGroup",
        ], errors
        assert cp == [rank - rank % 2, rank - rank % 2 + 1]  # the inner dim: {0, 1}, {2, 3}
        assert cp_outer == [rank % 2, rank % 2 + 2]  # the outer dim: {0, 2}, {1, 3}


def case_outer_without_covering_engine(rank, world):
    try:
        case_fsdp(rank, world, (2, 2), ("dp", "cp"), "dp", "block", False, "fsdp", "outer")
    except Exception as e:  # noqa: BLE001 - dynamo wraps the backend's error
        return str(e)
    return None


@pytest.mark.soak
def test_outer_grad_sync_is_refused_when_the_engine_does_not_cover_the_sequence_group(pools):
    for msg in pools(4).run(case_outer_without_covering_engine, timeout=600):
        assert msg is not None and "Config.grad_sync='outer', but a data-parallel engine reduces graph input" in msg, msg
        assert "Use grad_sync='auto' or 'all_reduce'" in msg
