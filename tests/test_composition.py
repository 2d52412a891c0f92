"""The composition matrix (docs/multinode.md): ringcc under FSDP2 and DDP on a DeviceMesh (gloo,
4 processes), in the user's code shape: a small LM with token and learned position embeddings,
two pre-norm blocks (SDPA causal, MLP) and a linear head with cross-entropy in the root's
forward, embedding, head and loss eager unless the whole model is compiled. Each cell: the loss,
every gradient and the set of parameters with a gradient equal single-process eager on the
global batch, and no gather between blocks (the reports' gathers, and gathers run eagerly: only
the eager head's read of the last block's output, or of the logits when the loss is outside)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from test_fsdp import eager_gathers, mesh

V, D, H, N, B = 64, 32, 4, 16, 2  # vocabulary, width, heads, tokens, sequences per data-parallel rank


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.fc1, self.fc2 = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, n, 3, H, D // H).permute(2, 0, 3, 1, 4).unbind(0)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, n, D)
        x = x + self.proj(a)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class LM(nn.Module):
    def __init__(self, tied: bool, loss_inside: bool):
        super().__init__()
        self.tok, self.pos = nn.Embedding(V, D), nn.Embedding(N, D)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(D, V, bias=not tied)
        if tied:
            self.head.weight = self.tok.weight
        self.loss_inside = loss_inside

    def forward(self, ids, labels=None):
        x = self.tok(ids) + self.pos(torch.arange(ids.shape[1]))
        for block in self.blocks:
            x = block(x)
        logits = self.head(x)
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten()) if self.loss_inside else logits


def _name(name: str) -> str:
    for wrapper in ("_orig_mod.", "_checkpoint_wrapped_module.", "module."):
        name = name.replace(wrapper, "")
    return name


def case_cell(rank, world, engine, route, config, tied, checkpoint, loss_inside, shard_registration=True):
    """One training step of the cell; (loss error, {param: gradient error relative to its largest
    entry, floored at 1e-3}, eager's parameters with a gradient, ours, the gathers).
    shard_registration=False: FSDP2's post-backward identity is applied to the SequenceSharded
    inputs themselves (ringcc's registration on the shards left out)."""
    import sys

    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    import ringcc

    torch.compiler.reset()
    names = ("cp", "dp") if engine == "fsdp_cp_outer" else ("dp", "cp")
    device_mesh, flat = mesh((2, 2), names)
    dp_rank = device_mesh["dp"].get_local_rank()
    gen = torch.Generator().manual_seed(1)
    ids, labels = torch.randint(0, V, (2 * B, N), generator=gen), torch.randint(0, V, (2 * B, N), generator=gen)

    def loss_of(model, ids, labels):
        if loss_inside:
            return model(ids, labels)
        return F.cross_entropy(model(ids).flatten(0, 1), labels.flatten())

    torch.manual_seed(0)
    ref = LM(tied, loss_inside)
    ref_loss = loss_of(ref, ids, labels)
    ref_loss.backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}

    torch.manual_seed(0)
    model = LM(tied, loss_inside)
    # inner="eager": the composition does not depend on the compiler after ringcc's passes
    cfg = (ringcc.Config(mesh=device_mesh, axis="cp", inner="eager") if config == "mesh"
           else ringcc.Config(group=device_mesh.get_group("cp"), inner="eager"))
    backend = ringcc.backend(cfg)
    if checkpoint:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        for i, block in enumerate(model.blocks):
            model.blocks[i] = checkpoint_wrapper(block)
    if route == "blocks_before":  # torchtitan's order
        for block in model.blocks:
            block.compile(backend=backend)
    if engine == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model, process_group=device_mesh.get_group("dp"))
        inner = model.module
    else:
        shard_mesh = flat if engine == "fsdp_dpcp" else device_mesh["dp"]
        for block in model.blocks:
            fully_shard(block, mesh=shard_mesh)
        fully_shard(model, mesh=shard_mesh)
        inner = model
    if route == "blocks_after":
        for block in inner.blocks:
            block.compile(backend=backend)
    if route == "blocks_wrapped":
        for i, block in enumerate(inner.blocks):
            inner.blocks[i] = torch.compile(block, backend=backend)
    if route.startswith("model"):  # model_dynamic: the sizes and the wrappers' ints symbolic
        step = torch.compile(model, backend=backend, dynamic=True if route == "model_dynamic" else None)
    else:
        step = model
    ringcc.reset_reports()
    mine = slice(dp_rank * B, (dp_rank + 1) * B)
    backend_module = sys.modules["ringcc.backend"]
    take_shards = backend_module.fsdp_hooks_take_shards
    if not shard_registration:
        backend_module.fsdp_hooks_take_shards = lambda module: None
    try:
        with eager_gathers() as gathered:
            loss = loss_of(step, ids[mine], labels[mine])
            loss.backward()
    finally:
        backend_module.fsdp_hooks_take_shards = take_shards
    total = loss.detach().clone()
    dist.all_reduce(total, group=device_mesh.get_group("dp"))
    errs, have = {}, set()
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        have.add(_name(name))
        g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        r = ref_grads[_name(name)]
        errs[_name(name)] = float((g - r).abs().max()) / max(float(r.abs().max()), 1e-3)
    want = {n for n, p in ref.named_parameters() if p.grad is not None}
    gathers = gathered + [f"{g.node}: {g.why}" for rep in ringcc.reports() for g in rep.gathers]
    return float((total / 2 - ref_loss).abs()), errs, want, have, gathers


def check(results, route, loss_inside, between_blocks=0, known=""):
    # the head's input, or the logits; and between_blocks gathers of a block's input
    eager_reads = (0 if route.startswith("model") and loss_inside else 1) + between_blocks
    for rank, (loss_err, errs, want, have, gathers) in enumerate(results):
        gathers = [g for g in gathers if not (known and known in g)]
        assert have == want, (rank, sorted(want - have), sorted(have - want))
        assert loss_err < 1e-5, (rank, loss_err)
        bad = {n: e for n, e in errs.items() if not e < 1e-5}
        assert not bad, (rank, bad)
        assert len(gathers) == eager_reads and all(g.startswith("eager gather") for g in gathers), (rank, gathers)


# name: (engine, compile route, Config, tied embeddings, activation checkpointing, loss inside)
CELLS = {
    # FSDP2 over dp, blocks compiled in torchtitan's order, eager root, head and loss
    "fsdp_dp-blocks_before-mesh": ("fsdp_dp", "blocks_before", "mesh", False, False, True),
    # FSDP2 over the flattened dp x cp mesh, the whole model compiled, Config(group)
    "fsdp_dpcp-model-group": ("fsdp_dpcp", "model", "group", False, False, True),
    # cp on the outer mesh dim, blocks wrapped in torch.compile after fully_shard
    "fsdp_cp_outer-blocks_wrapped-mesh": ("fsdp_cp_outer", "blocks_wrapped", "mesh", False, False, True),
    # DDP, blocks compiled after the engine wraps the model
    "ddp-blocks_after-mesh": ("ddp", "blocks_after", "mesh", False, False, True),
}
SOAK_CELLS = {
    "fsdp_dp-blocks_before-group": ("fsdp_dp", "blocks_before", "group", False, False, True),
    "fsdp_dp-blocks_after-mesh": ("fsdp_dp", "blocks_after", "mesh", False, False, True),
    "fsdp_dp-blocks_wrapped-group": ("fsdp_dp", "blocks_wrapped", "group", False, False, True),
    "fsdp_dp-model-mesh": ("fsdp_dp", "model", "mesh", False, False, True),
    # the head's graph reads the last block's wrapper, whose dim dynamo traces as a SymInt
    "fsdp_dp-model_dynamic-mesh": ("fsdp_dp", "model_dynamic", "mesh", False, False, True),
    "fsdp_dp-model-tied": ("fsdp_dp", "model", "mesh", True, False, True),
    "fsdp_dp-blocks_before-tied-ac": ("fsdp_dp", "blocks_before", "mesh", True, True, True),
    "fsdp_dp-model-loss_outside": ("fsdp_dp", "model", "mesh", False, False, False),
    "fsdp_dp-blocks_before-loss_outside": ("fsdp_dp", "blocks_before", "mesh", False, False, False),
    "fsdp_dpcp-blocks_before-ac": ("fsdp_dpcp", "blocks_before", "mesh", False, True, True),
    "fsdp_dpcp-blocks_after-tied": ("fsdp_dpcp", "blocks_after", "group", True, False, True),
    "fsdp_cp_outer-model-mesh": ("fsdp_cp_outer", "model", "mesh", False, False, True),
    "fsdp_cp_outer-blocks_before-ac": ("fsdp_cp_outer", "blocks_before", "group", False, True, True),
    "ddp-model-mesh": ("ddp", "model", "mesh", False, False, True),
    "ddp-blocks_before-tied-loss_outside": ("ddp", "blocks_before", "group", True, False, False),
    "ddp-model-ac": ("ddp", "model", "mesh", False, True, True),
}

# gathers a cell records that are not between blocks, with the reason shard_sequence gives: under
# dynamic=True the loss's flattened logits [b * n, V] have a symbolic b, and a graph output with
# symbolic batch rows merged into its sequence dim is gathered (O(n) logits, exact)
KNOWN_GATHERS = {"fsdp_dp-model_dynamic-mesh": "batch rows merged into its sequence dim"}


@pytest.mark.parametrize("cell", list(CELLS))
def test_composition(pools, cell):
    engine, route, config, tied, checkpoint, loss_inside = CELLS[cell]
    check(pools(4).run(case_cell, *CELLS[cell], timeout=600), route, loss_inside)


@pytest.mark.soak
@pytest.mark.parametrize("cell", list(SOAK_CELLS))
def test_composition_soak(pools, cell):
    engine, route, config, tied, checkpoint, loss_inside = SOAK_CELLS[cell]
    check(pools(4).run(case_cell, *SOAK_CELLS[cell], timeout=600), route, loss_inside, known=KNOWN_GATHERS.get(cell, ""))


def test_a_gradient_that_reaches_a_block_input_wrapper_reaches_its_shards(pools):
    """FSDP2's post-backward identity function applied to the wrapper itself (an autograd.Function
    records its inputs as they are) gathers block 1's input and hands its gradient to block 0's
    shards (Note [Sharded outputs and autograd]): every parameter gets its gradient."""
    cell = ("fsdp_dp", "blocks_before", "mesh", False, False, True)
    check(pools(4).run(case_cell, *cell, False, timeout=600), "blocks_before", True, between_blocks=1)
