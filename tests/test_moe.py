"""Mixture-of-experts under ringcc on real gloo groups: the loss and every parameter gradient
equal single-process eager (fp32, 1e-5 relative; gradients near zero against 1e-3 of the
largest), and every attention site is rewritten. The Hugging Face models (tiny random
configs, grouped_mm experts: no fp64) run in the zoo tier (`make test-zoo`)."""

import pytest
import torch

import ringcc
from test_shard_sequence import FlatResidual

TOL = 1e-5


def _errors(ref, model, loss, ref_loss) -> dict[str, float]:
    """Relative error of the loss and of every gradient; a gradient is compared against the
    larger of its own scale and 1e-3 of the largest gradient (fp32 rounding noise otherwise)."""
    ref_grads = dict(ref.named_parameters())
    largest = max(float(p.grad.abs().max()) for p in ref_grads.values() if p.grad is not None)
    errs = {"loss": float((loss - ref_loss).abs() / ref_loss.abs())}
    for name, p in model.named_parameters():
        r = ref_grads[name].grad
        if r is None:
            assert p.grad is None, name
            continue
        errs[name] = float((p.grad - r).abs().max() / max(float(r.abs().max()), 1e-3 * largest))
    return errs


def case_flat_residual(rank, world):
    torch.manual_seed(0)
    ref, model = FlatResidual(), FlatResidual()
    model.load_state_dict(ref.state_dict())
    ids = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(1))
    compiled = torch.compile(model, backend="ringcc", options={"inner": "aot_eager", "verify": True})
    ref_loss = ref(ids)
    ref_loss.backward()
    loss = compiled(ids)
    loss.backward()
    return _errors(ref, model, loss.detach(), ref_loss.detach())


def test_a_gathered_value_added_to_flattened_shards_keeps_gradients_exact(pools):
    for rank, errs in enumerate(pools(2).run(case_flat_residual)):
        worst = max(errs.items(), key=lambda kv: kv[1])
        assert worst[1] < TOL, f"rank {rank}: {worst[0]} differs from eager by {worst[1]:.2e}"


# ---------------------------------------------------------------------------------------
# Hugging Face MoE models


def build(name: str):
    import transformers as T

    torch.manual_seed(0)
    common = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, num_experts_per_tok=2, attn_implementation="sdpa", pad_token_id=0)
    if name == "qwen2_moe":  # the configuration (a shared expert besides the routed ones)
        model = T.Qwen2MoeForCausalLM(T.Qwen2MoeConfig(
            intermediate_size=128, num_experts=4, moe_intermediate_size=32, shared_expert_intermediate_size=64,
            **common))
    elif name == "mixtral":
        model = T.MixtralForCausalLM(T.MixtralConfig(intermediate_size=32, num_local_experts=4, **common))
    elif name == "qwen3_moe":
        model = T.Qwen3MoeForCausalLM(T.Qwen3MoeConfig(
            intermediate_size=128, num_experts=4, moe_intermediate_size=32, head_dim=16, **common))
    elif name == "olmoe":
        model = T.OlmoeForCausalLM(T.OlmoeConfig(intermediate_size=32, num_experts=4, **common))
    else:
        raise ValueError(name)
    return model.train()


def case_model(rank, world, name, aux):
    """(errors against eager, per graph: sites, rewritten sites, gathers as (location, why))."""
    ref, model = build(name), build(name)
    model.load_state_dict(ref.state_dict())
    kwargs = {}
    if aux:  # the load-balancing loss joins the loss (router_aux_loss_coef)
        from transformers.utils.output_capturing import maybe_install_capturing_hooks

        kwargs["output_router_logits"] = True
        # HF installs its output-recording hooks under a threading lock on the first call, which
        # dynamo cannot trace: installed first, the model is one graph (loss and aux loss inside)
        maybe_install_capturing_hooks(model)
    ids = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(1))
    compiled = torch.compile(model, backend="ringcc", options={"inner": "aot_eager"})
    ringcc.reset_reports()
    ref_loss = ref(input_ids=ids, labels=ids, **kwargs).loss
    ref_loss.backward()
    loss = compiled(input_ids=ids, labels=ids, **kwargs).loss
    loss.backward()
    reports = [(len(r.sites), len(r.rewritten), [(g.location, g.why) for g in r.gathers]) for r in ringcc.reports()]
    return _errors(ref, model, loss.detach(), ref_loss.detach()), reports


def _check_model(results, world):
    for rank, (errs, reports) in enumerate(results):
        worst = max(errs.items(), key=lambda kv: kv[1])
        assert worst[1] < TOL, f"p={world} rank {rank}: {worst[0]} differs from eager by {worst[1]:.2e}"
        assert len(reports) == 1, reports  # one graph: the loss is inside
        sites, rewritten, gathers = reports[0]
        assert sites > 0 and rewritten == sites, reports[0]
        unexpected = [g for g in gathers if not g[1].startswith(("graph output",) + LEFT)]
        assert unexpected == [], unexpected


# Gathers these models still make besides the graph outputs (O(n), recorded): the routing
# (top-k), the dispatch (tokens indexed by expert order) and the grouped experts run on all
# tokens; and the K/V cache's cat (HF keeps use_cache=True in train mode).
LEFT = ("no sharding rule for topk", "getitem: advanced indexing", "no sharding rule for grouped_mm",
        "cat: concatenates along the sequence")


@pytest.mark.zoo
@pytest.mark.parametrize("name,world,aux", [
    ("qwen2_moe", 2, False),
    ("qwen2_moe", 4, True),
    ("mixtral", 2, True),
    ("mixtral", 4, False),
    ("qwen3_moe", 2, True),
    ("olmoe", 2, True),
], ids=lambda v: str(v))
def test_moe_model_matches_eager(pools, name, world, aux):
    """Loss (with the load-balancing loss where aux) and every gradient equal eager."""
    _check_model(pools(world).run(case_model, name, aux, timeout=900), world)
