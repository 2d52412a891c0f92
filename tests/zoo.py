"""The model zoo: Hugging Face architectures as people run them, with tiny random configs.

Each `Arch` names a factory of the task model (causal LM, masked LM, sequence-to-sequence LM
or image classifier, in its default config: a decoder keeps use_cache=True in training), the
patterns it runs, and what the zoo expects: attention sites rewritten and skipped per graph,
and the planner's verdict. `run_arch(rank, world, name)` (a DistPool job) runs every pattern
on `world` gloo ranks against single-process eager and returns what the tests assert on:

- loss_inside: `model(..., labels=labels).loss`;
- ce_outside: `F.cross_entropy` on `out.logits` in the caller's own code (the logits are a
  SequenceSharded output, gathered when read: Note [Sharded outputs]);
- projection: a fixed random projection of the base model's `last_hidden_state`, outside;
- padded: right padding with an attention mask (padded labels ignored), loss inside;
- packed (not in PATTERNS: run by the tests that name it): packed documents (PACKED_DOCS),
  position ids restarting per document, use_cache=False, no attention mask, loss inside;
- left_padded (not in PATTERNS: run by the tests that name it): left padding, cross-entropy
  outside over the valid tokens' logits (in a loss inside, the padded token before a row's
  first would predict it). The padded tokens see no key; their rows are eager's too (0 under
  SDPA's boolean masks, the mean of the values under eager attention's finite ones: Note [Rows
  with no key] in runtime/ops.py).

Gradient errors are max |g - g_eager| over max |g_eager| of that parameter, with a floor of
1e-3 of the largest gradient of the model: gradients that are zero in exact math (attention
key biases: softmax is shift-invariant) are compared against that floor, not against their
own rounding noise (PITFALLS.md).

`python tests/zoo.py --matrix` runs the zoo and writes docs/compatibility.md.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from dataclasses import dataclass, field, replace
from typing import Callable

import torch
import torch.nn.functional as F

VOCAB, N, BATCH, PAD = 64, 24, 2, 5  # no model dim is 24 (a static plan reads dims of size n as n)
PATTERNS = ("loss_inside", "ce_outside", "projection", "padded")
TOL = 1e-5


@dataclass(frozen=True)
class Arch:
    """One architecture of the zoo and what it is expected to give."""

    name: str
    factory: Callable[[], torch.nn.Module]  # the task model, random weights (seeded by the caller)
    kind: str = "decoder"  # "decoder" (causal LM), "encoder" (masked LM), "seq2seq" or "vision" (classifier)
    patterns: tuple[str, ...] = PATTERNS
    sites: int = 2  # attention sites rewritten, summed over the graphs of a pattern (one per layer)
    skipped: int = 0  # attention sites skipped, likewise
    linear: bool = True  # the planner's verdict: O(n/p) holds
    worlds: tuple[int, ...] = (2,)
    patterns_p4: tuple[str, ...] = ("loss_inside", "ce_outside")  # the patterns run at p > 2
    why: str = ""  # where not O(n/p) or not exact: the op and why (the matrix shows it)
    padded_skipped: int | None = None  # sites skipped in the padded pattern, where it differs (then not O(n/p))
    inner: str = "aot_eager"  # the compiler ringcc hands the rewritten graph to
    offline: bool = True  # taken by the offline tier too (`ringcc rewrite` and `ringcc plan`: test_rewrite_zoo.py)


def _no_dropout(cfg):
    for key, value in list(vars(cfg).items()):
        if isinstance(value, float) and ("dropout" in key or "pdrop" in key):
            setattr(cfg, key, 0.0)
    return cfg


def _llama_like(config_cls: str, **extra):
    """A decoder config in Llama's names (hidden_size, intermediate_size, ...)."""
    def make():
        import transformers

        cfg = getattr(transformers, config_cls)(**{
            **dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=128, attn_implementation="sdpa"), **extra})
        return transformers.AutoModelForCausalLM.from_config(_no_dropout(cfg), attn_implementation="sdpa")
    return make


def _hf_default_attention(config_cls: str, auto: str = "AutoModelForCausalLM", **kwargs):
    """A task model with the attention transformers picks for it (eager where the model needs
    it: soft-capping, ALiBi, DeBERTa's disentangled attention)."""
    def make():
        import transformers

        return getattr(transformers, auto).from_config(_no_dropout(getattr(transformers, config_cls)(**kwargs)))
    return make


_MOE = dict(num_experts_per_tok=2)
_GROUPED = dict(n_routed_experts=8, moe_intermediate_size=32, n_group=2, topk_group=1, first_k_dense_replace=1, **_MOE)


def _config(config_cls: str, auto: str, **kwargs):
    def make():
        import transformers

        cfg = getattr(transformers, config_cls)(attn_implementation="sdpa", **kwargs)
        return getattr(transformers, auto).from_config(_no_dropout(cfg), attn_implementation="sdpa")
    return make


_BERT = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
             max_position_embeddings=128)

# GPT2LMHeadModel's class name matches no loss in transformers' LOSS_MAPPING, so its
# `loss_function` property calls logger.warning_once, which dynamo does not trace: the graph
# breaks there, and the loss runs in later graphs that take the logits as shards (Note
# [Sharded outputs]). Its patterns count sites over those graphs.
_VISION_WHY = ("the sequence starts at the cat of the [CLS] token onto the patch embeddings, which every rank "
               "computes from the whole image: that cat holds all n tokens (floats) until the first per-token op "
               "slices it")

ZOO: list[Arch] = [
    Arch("llama", _llama_like("LlamaConfig"), worlds=(2, 4)),
    Arch("mistral", _llama_like("MistralConfig", sliding_window=None)),
    Arch("qwen2", _llama_like("Qwen2Config")),
    Arch("qwen3", _llama_like("Qwen3Config", head_dim=8)),
    Arch("gemma", _llama_like("GemmaConfig", head_dim=8)),
    Arch("phi", _llama_like("PhiConfig")),
    Arch("phi3", _llama_like("Phi3Config", pad_token_id=0)),
    Arch("gpt_neox", _config("GPTNeoXConfig", "AutoModelForCausalLM", vocab_size=VOCAB, hidden_size=32,
                             intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                             max_position_embeddings=128)),
    Arch("opt", _config("OPTConfig", "AutoModelForCausalLM", vocab_size=VOCAB, hidden_size=32, ffn_dim=64,
                        num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=128,
                        word_embed_proj_dim=32)),
    Arch("gpt2", _config("GPT2Config", "AutoModelForCausalLM", vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4,
                         n_positions=128), worlds=(2, 4)),
    Arch("gptj", _config("GPTJConfig", "AutoModelForCausalLM", vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4,
                         n_positions=128, rotary_dim=4)),
    Arch("stablelm", _llama_like("StableLmConfig")),
    Arch("cohere", _llama_like("CohereConfig")),
    Arch("granite", _llama_like("GraniteConfig")),
    Arch("olmo", _llama_like("OlmoConfig")),
    Arch("olmo2", _llama_like("Olmo2Config")),
    Arch("starcoder2", _llama_like("Starcoder2Config", sliding_window=None)),
    # score modifiers, multi-query K/V, mixtures of experts (Note [Rank-local rows])
    Arch("gemma2", _hf_default_attention("Gemma2Config", vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         head_dim=8, sliding_window=8, max_position_embeddings=128), worlds=(2, 4)),
    Arch("bloom", _hf_default_attention("BloomConfig", vocab_size=VOCAB, hidden_size=32, n_layer=2, n_head=4),
         worlds=(2, 4)),
    Arch("mpt", _hf_default_attention("MptConfig", vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=4,
                                      max_seq_len=64), worlds=(2, 4)),
    Arch("falcon_mq", _config("FalconConfig", "AutoModelForCausalLM", vocab_size=VOCAB, hidden_size=32,
                              num_hidden_layers=2, num_attention_heads=4, multi_query=True,
                              new_decoder_architecture=False, alibi=False), worlds=(2, 4)),
    Arch("mixtral", _llama_like("MixtralConfig", num_local_experts=4, **_MOE)),
    Arch("qwen2_moe", _llama_like("Qwen2MoeConfig", num_experts=4, moe_intermediate_size=32,
                                  shared_expert_intermediate_size=64, **_MOE)),
    Arch("qwen3_moe", _llama_like("Qwen3MoeConfig", num_experts=4, moe_intermediate_size=32, head_dim=8, **_MOE)),
    Arch("olmoe", _llama_like("OlmoeConfig", num_experts=4, **_MOE)),
    # group-limited routing (scatter_, gather, topk(sorted=False)) and a hybrid of gated delta-net
    # and attention layers; torch.compile(backend="aot_eager") of Qwen3-Next fails without ringcc too
    Arch("glm4_moe", _llama_like("Glm4MoeConfig", **_GROUPED)),
    # multi-head latent attention expands the latent into one K/V head per query head: HF's
    # repeat_kv (taken under a padding mask) repeats them again unless num_key_value_heads says so
    Arch("deepseek_v3_grouped", _llama_like("DeepseekV3Config", num_key_value_heads=4, q_lora_rank=16,
                                            kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8,
                                            **_GROUPED)),
    Arch("qwen3_next", _llama_like("Qwen3NextConfig", num_experts=4, moe_intermediate_size=32,
                                   shared_expert_intermediate_size=32, head_dim=8, linear_num_value_heads=4,
                                   linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
                                   layer_types=["linear_attention", "full_attention"], **_MOE),
         sites=1, linear=False, inner="inductor",
         why="the gated delta-net's causal conv1d and chunked recurrence mix the sequence: run on gathered tokens"),
    # 2026's families in their default configurations: attention sinks with sliding-window layers
    # and experts (gpt-oss, eager attention), MLA with a value head dim of its own and experts
    # (DeepSeek-V3), chunked attention layers and complex rotary (Llama 4)
    Arch("gpt_oss", _hf_default_attention("GptOssConfig", vocab_size=VOCAB, hidden_size=32, intermediate_size=32,
                                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                          head_dim=8, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
                                          max_position_embeddings=128), worlds=(2, 4)),
    Arch("deepseek_v3", _hf_default_attention("DeepseekV3Config", vocab_size=VOCAB, hidden_size=32,
                                              intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=2,
                                              num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
                                              num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1,
                                              q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=16,
                                              qk_rope_head_dim=8, v_head_dim=16, max_position_embeddings=128),
         worlds=(2, 4)),
    Arch("llama4", _hf_default_attention("Llama4TextConfig", vocab_size=VOCAB, hidden_size=32, intermediate_size=32,
                                         intermediate_size_mlp=64, num_hidden_layers=4, num_attention_heads=4,
                                         num_key_value_heads=2, head_dim=8, num_local_experts=4,
                                         attention_chunk_size=8, max_position_embeddings=128), sites=4,
         worlds=(2, 4)),
    Arch("bert", _config("BertConfig", "AutoModelForMaskedLM", **_BERT), kind="encoder", worlds=(2, 4)),
    Arch("roberta", _config("RobertaConfig", "AutoModelForMaskedLM", **dict(_BERT, max_position_embeddings=130)),
         kind="encoder"),
    Arch("distilbert", _config("DistilBertConfig", "AutoModelForMaskedLM", vocab_size=VOCAB, dim=32, n_layers=2,
                               n_heads=4, hidden_dim=64, max_position_embeddings=128), kind="encoder"),
    Arch("electra", _config("ElectraConfig", "AutoModelForMaskedLM", embedding_size=32, **_BERT), kind="encoder"),
    Arch("albert", _config("AlbertConfig", "AutoModelForMaskedLM", embedding_size=32, **_BERT), kind="encoder"),
    Arch("vit", _config("ViTConfig", "AutoModelForImageClassification", image_size=(20, 28), patch_size=4,
                        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                        num_labels=10), kind="vision", patterns=("loss_inside", "ce_outside", "projection"),
         linear=False, why=_VISION_WHY),
    # architectures: AutoModelForImageClassification maps DeiT to two classes and reads the
    # config's list to choose (None is a TypeError in transformers 5.x)
    Arch("deit", _config("DeiTConfig", "AutoModelForImageClassification", architectures=["DeiTForImageClassification"],
                         image_size=(20, 24), patch_size=4,
                         hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                         num_labels=10), kind="vision", patterns=("loss_inside", "ce_outside", "projection"),
         linear=False, why=_VISION_WHY),
]
# Packed documents (padding-free packing, as TRL's DataCollatorWithFlattening feeds it): position
# ids restarting at each document, no attention mask, use_cache=False (HF builds the document
# mask only without a cache). The site's mask is a function of the position ids and the
# documents' ids (Note [Mask functions] in runtime/maskfn.py).
ZOO.append(Arch("gemma3", _llama_like("Gemma3TextConfig", head_dim=8, sliding_window=8),
                patterns=("loss_inside", "ce_outside", "projection")))
# architectures beyond the core: alternating local / global windows (ModernBERT, Cohere2,
# Exaone 4, Ministral), layers without positional embedding (SmolLM3), partial rotary (GLM-4),
# Falcon's K/V groups broadcast to the queries, GraniteMoE's multipliers and experts,
# encoder-decoders (T5, BART), DeBERTa's disentangled attention, and hybrids of attention and
# Mamba layers (Jamba, Bamba, Falcon-H1)
_SMALL = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              max_position_embeddings=128)
_SLIDING_FULL = dict(sliding_window=8, layer_types=["sliding_attention", "full_attention"])
_SSM_WHY = "the Mamba layers' causal conv1d and selective scan mix the sequence: run on gathered tokens"
_BEYOND = [
    Arch("modernbert", _config("ModernBertConfig", "AutoModelForMaskedLM", local_attention=8,
                               layer_types=["full_attention", "sliding_attention"], pad_token_id=0, eos_token_id=1,
                               bos_token_id=2, cls_token_id=2, sep_token_id=1, **_SMALL), kind="encoder"),
    Arch("cohere2", _llama_like("Cohere2Config", head_dim=8, **_SLIDING_FULL)),
    Arch("exaone4", _llama_like("Exaone4Config", **_SLIDING_FULL)),
    Arch("ministral", _llama_like("MinistralConfig", head_dim=8, sliding_window=8,
                                  layer_types=["sliding_attention", "sliding_attention"])),
    Arch("smollm3", _llama_like("SmolLM3Config", no_rope_layers=[1, 0], pad_token_id=0, bos_token_id=1,
                                eos_token_id=2)),
    Arch("glm4", _llama_like("Glm4Config", head_dim=8, pad_token_id=0, eos_token_id=1)),
    Arch("helium", _llama_like("HeliumConfig", head_dim=8)),
    Arch("seed_oss", _llama_like("SeedOssConfig", head_dim=8)),
    Arch("ernie4_5", _llama_like("Ernie4_5Config", head_dim=8)),
    Arch("granitemoe", _llama_like("GraniteMoeConfig", num_local_experts=4, **_MOE)),
    Arch("falcon", _config("FalconConfig", "AutoModelForCausalLM", vocab_size=VOCAB, hidden_size=32,
                           num_hidden_layers=2, num_attention_heads=4, multi_query=False,
                           new_decoder_architecture=False)),
    Arch("falcon_gqa", _config("FalconConfig", "AutoModelForCausalLM", vocab_size=VOCAB, hidden_size=32,
                               num_hidden_layers=2, num_attention_heads=4, num_kv_heads=2,
                               new_decoder_architecture=True)),
    # encoder-decoders, decoder inputs (the shifted labels) as long as the encoder's: one sequence per
    # graph. T5's self-attention adds a learned relative position bias (a table read at every
    # query-key pair, which needs a gradient: dense); its cross-attention and all of BART's sites are
    # rings. T5 builds no decoder inputs without labels: no loss outside.
    Arch("t5", _config("T5Config", "AutoModelForSeq2SeqLM", vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64,
                       num_layers=2, num_decoder_layers=2, num_heads=4, decoder_start_token_id=0),
         kind="seq2seq", patterns=("loss_inside", "padded"), sites=2, skipped=4, linear=False,
         why="the self-attention sites add T5's learned relative position bias, a [query, key] table that needs a "
             "gradient: they run dense"),
    Arch("bart", _config("BartConfig", "AutoModelForSeq2SeqLM", vocab_size=VOCAB, d_model=32, encoder_layers=2,
                         decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
                         encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=128),
         kind="seq2seq", patterns=("loss_inside", "ce_outside", "padded"), sites=6),
    # DeBERTa-v3's configuration (relative attention, both disentangled terms); eager attention
    Arch("deberta_v2", _hf_default_attention("DebertaV2Config", "AutoModelForMaskedLM", relative_attention=True,
                                             pos_att_type=["p2c", "c2p"], position_buckets=8,
                                             max_relative_positions=-1, position_biased_input=False, **_BERT),
         kind="encoder", sites=0, skipped=2,
         linear=False, why="DeBERTa's disentangled attention adds content-to-position and position-to-content "
                           "scores (a query or key projection read at a relative position bucket): dense"),
    Arch("jamba", _llama_like("JambaConfig", attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
                              expert_layer_offset=1, num_experts=4, mamba_dt_rank=4, **_MOE),
         sites=1, linear=False, why=_SSM_WHY),
    Arch("bamba", _llama_like("BambaConfig", attn_layer_indices=[1], mamba_n_heads=4, mamba_d_head=16,
                              mamba_d_state=8, mamba_chunk_size=8), sites=1, linear=False, why=_SSM_WHY),
    Arch("falcon_h1", _llama_like("FalconH1Config", head_dim=8, mamba_d_ssm=32, mamba_n_heads=4, mamba_d_head=8,
                                  mamba_d_state=8, mamba_chunk_size=8), linear=False, why=_SSM_WHY),
]
# measured compiled (this file); the offline tier does not take them yet
ZOO += [replace(arch, offline=False) for arch in _BEYOND]
PACKED = ("llama", "qwen3", "mistral", "gemma3", "mixtral")
PACKED_DOCS = ((10, 6, 8), (3, 21))  # document lengths per batch row (N tokens each)


def _packed_positions() -> torch.Tensor:
    return torch.tensor([[i for length in row for i in range(length)] for row in PACKED_DOCS])


BY_NAME = {a.name: a for a in ZOO}
CHEAP = ("llama",)  # run in `make test` too (loss inside and outside)
# the core architectures under CPU bf16 autocast with fp32 weights (`run_amp`; no MoE: grouped
# matmul takes no fp64 reference)
AMP = ("llama", "mistral", "qwen2", "qwen3", "gemma", "phi3", "gpt_neox", "olmo2", "gpt2", "opt", "bert", "roberta")


# ---------------------------------------------------------------------------------------
# one pattern


def _inputs(arch: Arch):
    gen = torch.Generator().manual_seed(1)
    if arch.kind == "vision":
        return dict(pixel_values=torch.randn(BATCH, 3, *_image_size(arch), generator=gen),
                    labels=torch.tensor([3, 7]))
    ids = torch.randint(1, VOCAB, (BATCH, N), generator=gen)
    labels = torch.randint(0, VOCAB, (BATCH, N), generator=gen)
    labels[0, 3] = -100
    return dict(input_ids=ids, labels=labels)


def _image_size(arch: Arch):
    return (20, 28) if arch.name == "vit" else (20, 24)  # 35 patches + [CLS] / 30 + [CLS] + distillation


def _call(arch: Arch, model, pattern: str, inputs: dict, projection: dict):
    """The pattern's loss computed from `model` (compiled or eager)."""
    data = "pixel_values" if arch.kind == "vision" else "input_ids"
    x, labels = inputs[data], inputs["labels"]
    if pattern == "loss_inside":
        return model(**{data: x}, labels=labels).loss
    if pattern == "ce_outside":
        logits = model(**{data: x}).logits
        if arch.kind == "vision":
            return F.cross_entropy(logits, labels)
        if arch.kind == "decoder":
            logits, labels = logits[:, :-1], labels[:, 1:]
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())
    if pattern == "projection":
        h = _base_model(model)(**{data: x}).last_hidden_state
        if "r" not in projection:
            projection["r"] = torch.randn(h.shape, generator=torch.Generator().manual_seed(2))
        return (h * projection["r"]).sum()
    if pattern == "padded":
        mask = torch.ones_like(x)
        mask[1, -PAD:] = 0
        labels = labels.masked_fill(mask == 0, -100)
        return model(**{data: x}, attention_mask=mask, labels=labels).loss
    if pattern == "packed":
        return model(**{data: x}, position_ids=_packed_positions(), use_cache=False, labels=labels).loss
    if pattern == "left_padded":
        mask = torch.ones_like(x)
        mask[1, :PAD] = 0
        valid = mask.bool()
        return F.cross_entropy(model(**{data: x}, attention_mask=mask).logits[valid], labels[valid])
    raise ValueError(f"unknown pattern {pattern!r}; choose one of {PATTERNS}")


def _grad_errors(model, ref) -> dict[str, float]:
    ref_grads = {k: p.grad for k, p in ref.named_parameters()}
    floor = 1e-3 * max(float(g.abs().max()) for g in ref_grads.values() if g is not None)
    errs = {}
    for name, p in model.named_parameters():
        r = ref_grads[name]
        if r is None or p.grad is None:
            errs[name] = 0.0 if (r is None) == (p.grad is None) else float("inf")
            continue
        errs[name] = float((p.grad - r).abs().max()) / max(float(r.abs().max()), floor)
    return errs


def run_arch(rank: int, world: int, name: str, patterns=None, inner: str | None = None) -> dict:
    """Every pattern of `name` on this rank: errors against eager and the report facts."""
    import ringcc

    arch = BY_NAME[name]
    inner = inner or arch.inner
    torch.manual_seed(0)
    ref = arch.factory().train()
    torch.manual_seed(0)
    model = arch.factory().train()
    compiled = torch.compile(model, backend=ringcc.backend(ringcc.Config(inner=inner)))
    results = {}
    for pattern in patterns or arch.patterns:
        torch._dynamo.reset()
        ringcc.reset_reports()
        inputs, projection = _inputs(arch), {}
        ref.zero_grad(set_to_none=True)
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        ref_loss = _call(arch, ref, pattern, inputs, projection)
        ref_loss.backward()
        target = compiled if pattern != "projection" else _CompiledBase(model, ringcc.Config(inner=inner))
        loss = _call(arch, target, pattern, inputs, projection)
        loss.backward()
        reports = ringcc.reports()
        errs = _grad_errors(model, ref)
        worst = max(errs, key=errs.get)
        plans = [r.plan for r in reports if r.plan is not None]
        results[pattern] = dict(
            loss=abs(loss.item() - ref_loss.item()) / max(abs(ref_loss.item()), 1e-6),
            grad=errs[worst], worst=worst,
            graphs=len(reports),
            rewritten=[len(r.rewritten) for r in reports], skipped=[len(r.skipped) for r in reports],
            skip_reasons=sorted({f"{s.reason.value}: {s.location}: {s.detail}" for r in reports for s in r.skipped}),
            gathers=sorted({f"{g.location}: {g.why}" for r in reports for g in r.gathers}),
            linear=bool(plans) and all(p.verdict for p in plans),
            culprits=sorted({f"{c.name} at {c.location}" for p in plans for c in p.culprits}),
            seconds=time.perf_counter() - t0,
        )
    return results


def run_amp(rank: int, world: int, name: str, inner: str = "aot_eager") -> dict:
    """`name`'s loss inside under torch.autocast("cpu", bfloat16), fp32 weights, on this rank:
    ringcc and eager under the same autocast judged against an fp64 reference, no autocast
    (parity.fp64_judge: the loss and the whole gradient); the sites and which parameters got a
    gradient."""
    import copy

    import ringcc
    from parity import fp64_judge

    arch = BY_NAME[name]
    torch.manual_seed(0)
    eager = arch.factory().train()
    ref, model = copy.deepcopy(eager).double(), copy.deepcopy(eager)
    compiled = torch.compile(model, backend=ringcc.backend(ringcc.Config(inner=inner)))
    torch._dynamo.reset()
    ringcc.reset_reports()
    runs = []
    for m, fn, amp in ((ref, ref, False), (eager, eager, True), (model, compiled, True)):
        with torch.autocast("cpu", torch.bfloat16, enabled=amp):
            loss = _call(arch, fn, "loss_inside", _inputs(arch), {})
        loss.backward()
        runs.append((loss.detach(), {k: p.grad for k, p in m.named_parameters()}))
    reports = ringcc.reports()
    return dict(judged=fp64_judge(runs[2], runs[1], runs[0]),
                rewritten=sum(len(r.rewritten) for r in reports), skipped=sum(len(r.skipped) for r in reports),
                skip_reasons=sorted({f"{s.reason.value}: {s.detail}" for r in reports for s in r.skipped}),
                no_grad=[sorted(k for k, g in run[1].items() if g is None) for run in runs[1:]])


def check_amp(arch: Arch, res: dict) -> list[str]:
    """What differs from the zoo's expectations under autocast (empty: as expected)."""
    from parity import fp64_excess

    bad = fp64_excess(res["judged"])
    if (res["rewritten"], res["skipped"]) != (arch.sites, arch.skipped):
        bad.append(f"sites rewritten {res['rewritten']}, skipped {res['skipped']} (expected {arch.sites}, "
                   f"{arch.skipped}) {res['skip_reasons']}")
    if res["no_grad"][0] != res["no_grad"][1]:
        bad.append(f"parameters without a gradient: eager {res['no_grad'][0]}, ringcc {res['no_grad'][1]}")
    return bad


def _base_model(model):
    """The task model's base model. Llama 4's causal LM names `language_model` as its base
    (base_model_prefix) but holds the text model as `model`: its `base_model` is itself."""
    base = model.base_model
    return model.model if base is model else base


class _CompiledBase:
    """The base model compiled on its own (the projection pattern reads its hidden states)."""

    def __init__(self, model, cfg):
        import ringcc

        self.base_model = torch.compile(_base_model(model), backend=ringcc.backend(cfg))


def _linear(arch: Arch, pattern: str) -> bool:
    """The planner's expected verdict: a site skipped in the padded pattern runs dense."""
    return arch.linear and not (pattern == "padded" and arch.padded_skipped)


def check(arch: Arch, results: dict) -> list[str]:
    """What differs from the zoo's expectations (empty: as expected)."""
    bad = []
    for pattern, r in results.items():
        if not (r["loss"] < TOL and r["grad"] < TOL):
            bad.append(f"{pattern}: loss error {r['loss']:.2e}, gradient error {r['grad']:.2e} ({r['worst']})")
        sites, skipped = arch.sites, arch.skipped
        if pattern == "padded" and arch.padded_skipped is not None:
            sites, skipped = sites - arch.padded_skipped, arch.padded_skipped
        if sum(r["rewritten"]) != sites or sum(r["skipped"]) != skipped:
            bad.append(f"{pattern}: sites rewritten {r['rewritten']}, skipped {r['skipped']} per graph "
                       f"(expected {sites}, {skipped} in all) {r['skip_reasons']}")
        if r["linear"] != _linear(arch, pattern):
            bad.append(f"{pattern}: O(n/p) {'holds' if r['linear'] else 'fails'} (expected the opposite): "
                       f"{r['culprits']} {r['gathers']}")
    return bad


# ---------------------------------------------------------------------------------------
# the compatibility matrix


HEADER = """# Compatibility matrix

Generated by `make zoo-matrix` (`python tests/zoo.py --matrix`) from a run of the model zoo
(tests/zoo.py): each Hugging Face architecture with a tiny random config, in its default
config (decoders keep `use_cache=True` in training), compiled with `backend="ringcc"`
(inner compiler aot_eager) on {world} gloo ranks (CPU) and compared with single-process eager.
Patterns: loss inside (`labels=`), cross-entropy outside on `out.logits`, a random projection
of `last_hidden_state` outside, right padding with an attention mask (vision models: the
first three; sequence-to-sequence models, whose decoder reads the shifted labels as long as the
input: loss inside, padded, and the loss outside where the model builds its decoder inputs
without labels). Outputs are returned sharded (docs/outputs.md). Packed documents (the decoders
named in the column): position ids restarting per document, `use_cache=False`, no attention
mask, loss inside; sites rewritten / found, the planner's verdict, and the loss and every
gradient against eager (their errors are in the max gradient error column).

- sites: attention sites rewritten / found (over the graphs of a pattern);
- O(n/p): the memory planner's verdict for every graph of every pattern;
- exact: every parameter's gradient and the loss within {tol:g} of eager (relative to the
  parameter's largest gradient, floored at 1e-3 of the model's largest);
- not O(n/p) because: the zoo's note on the cause, then the ops the planner names and the
  gathers the report records.

"""


def matrix(rows: dict[str, dict], world: int) -> str:
    lines = [HEADER.format(world=world, tol=TOL),
             "| architecture | kind | sites | O(n/p) | exact | max gradient error | packed documents | "
             "not O(n/p) because |",
             "|---|---|---|---|---|---|---|---|"]
    for arch in ZOO:
        res = rows.get(arch.name)
        if res is None:
            lines.append(f"| {arch.name} | {arch.kind} | - | - | - | - | - | not run in this generation |")
            continue
        if isinstance(res, str):
            lines.append(f"| {arch.name} | {arch.kind} | - | no | no | - | - | run failed: {res} |")
            continue
        packed = res.get("packed")
        packed = "-" if packed is None else (
            f"{sum(packed['rewritten'])}/{sum(packed['rewritten']) + sum(packed['skipped'])}, "
            f"{'O(n/p)' if packed['linear'] else 'not O(n/p)'}, "
            f"{'exact' if packed['loss'] < TOL and packed['grad'] < TOL else 'not exact'}")
        sites = sorted({f"{sum(r['rewritten'])}/{sum(r['rewritten']) + sum(r['skipped'])}" for r in res.values()})
        linear = all(r["linear"] for r in res.values())
        verdict = "yes" if linear else "no"
        if not linear and all(r["linear"] for pattern, r in res.items() if pattern != "padded"):
            verdict = "yes; padded: no"
        exact = all(r["loss"] < TOL and r["grad"] < TOL for r in res.values())
        why = ([arch.why] if arch.why and not linear else []) + \
            sorted({c for r in res.values() for c in r["culprits"] + r["gathers"]})
        worst = max(r["grad"] for r in res.values())
        lines.append(f"| {arch.name} | {arch.kind} | {', '.join(sites)} | {verdict} | "
                     f"{'yes' if exact else 'no'} | {worst:.1e} | {packed} | {'; '.join(why) or '-'} |")
    return "\n".join(lines) + "\n"


RELEASES_HEADING = "## Across transformers releases"
RELEASES_TEXT = """
Generated by `make test-versions` (tests/versions.py): the zoo's core at p = 2 with each tested
transformers release installed on its own (tests/test_versions.py), unpadded (loss inside) and
right-padded. The tested releases run every core architecture; a column of another release is a
run of some of them (`python tests/versions.py --releases R --pytest-args -k ...`). Each cell:
sites rewritten / found in each pattern; exact as above; dense where a site runs dense attention
(skipped), O(n) where every site is rewritten but the plan is not O(n/p); run failed: the error
that a rank raised; -: not run. The reasons follow the table: the op of that release's own code
that holds O(n) per rank, or what the report names (skip reasons, gathers, the plan's culprits),
or the error.

"""


_ERROR_LINE = re.compile(r"^[\w.]*(Error|Exception|Unsupported)\w*: ")


def failure_line(text: str, limit: int = 400) -> str:
    """The error of a failed run in one line: the last line of `text` (a rank's traceback) that
    names an exception, with the explanation that dynamo gives on the line after it; the middle
    cut where it is longer than `limit` (the end says what was received)."""
    lines = [x.strip() for x in text.strip().splitlines()]
    at = max((i for i, x in enumerate(lines) if _ERROR_LINE.match(x)), default=len(lines) - 1)
    line = lines[at] if lines else ""
    if at + 1 < len(lines) and lines[at + 1].startswith("Explanation: "):
        line += " (" + lines[at + 1][len("Explanation: "):] + ")"
    return line if len(line) <= limit else line[:limit // 3] + " ... " + line[-(limit - limit // 3 - 5):]


def release_cell(res) -> str:
    """One architecture under one release: sites per pattern, exact, O(n/p)."""
    if res is None:
        return "-"
    if isinstance(res, str):
        return "run failed"
    sites = ", ".join(f"{p}: {sum(r['rewritten'])}/{sum(r['rewritten']) + sum(r['skipped'])}" for p, r in res.items())
    exact = all(r["loss"] < TOL and r["grad"] < TOL for r in res.values())
    memory = ("dense" if any(sum(r["skipped"]) for r in res.values()) else
              "O(n/p)" if all(r["linear"] for r in res.values()) else "O(n)")
    return f"{sites}; {'exact' if exact else 'not exact'}; {memory}"


def release_table(rows: dict[str, dict[str, dict]], releases) -> str:
    """The release section of docs/compatibility.md: rows[release][architecture] = run_arch's results
    (or the error of a failed run)."""
    names = [a.name for a in ZOO if any(a.name in rows.get(r, {}) for r in releases)]
    lines = [RELEASES_HEADING, "", RELEASES_TEXT.strip("\n"), "",
             "| architecture | " + " | ".join(f"transformers {r}" for r in releases) + " |",
             "|---|" + "---|" * len(releases)]
    lines += [f"| {n} | " + " | ".join(release_cell(rows.get(r, {}).get(n)) for r in releases) + " |" for n in names]
    for r in releases:
        why = {}
        for n in names:
            res = rows.get(r, {}).get(n)
            if isinstance(res, str):
                why[n] = [res]
            elif res:
                # a release's own O(n) op (tests/test_versions.py: RELEASE_O_N) says why in place of the culprits
                why[n] = sorted({c for x in res.values() for c in x["skip_reasons"] + x["gathers"] +
                                 ([x["why"]] if x.get("why") else x["culprits"])})
        if any(why.values()):
            lines += ["", f"transformers {r}:", ""]
            lines += [f"- {n}: {'; '.join(w)}" for n, w in why.items() if w]
    return "\n".join(lines) + "\n"


def write_release_table(rows_dir: str, releases, out: str | None = None) -> None:
    """Replace the release section of docs/compatibility.md with the rows in rows_dir (one
    <release>.json per release, written by tests/test_versions.py)."""
    out = out or os.path.join(os.path.dirname(__file__), "..", "docs", "compatibility.md")
    rows = {}
    for r in releases:
        path = os.path.join(rows_dir, f"{r}.json")
        if os.path.exists(path):
            with open(path) as f:
                rows[r] = json.load(f)
    with open(out) as f:
        text = f.read()
    head = text.split(RELEASES_HEADING)[0].rstrip("\n")
    with open(out, "w") as f:
        f.write(head + "\n\n" + release_table(rows, releases))


def _with_release_section(text: str, out: str) -> str:
    """`text` (the zoo's matrix) followed by the release section that `out` already has."""
    if os.path.exists(out):
        with open(out) as f:
            old = f.read()
        if RELEASES_HEADING in old:
            return text + "\n" + RELEASES_HEADING + old.split(RELEASES_HEADING, 1)[1]
    return text


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--matrix", action="store_true", help="run the zoo and write docs/compatibility.md")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--only", nargs="*", default=None, help="architectures to run (default: all)")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "docs", "compatibility.md"))
    parser.add_argument("--rows", default=os.path.join(os.path.dirname(__file__), "..", "out", "zoo_rows.json"),
                        help="each architecture's results, kept between runs: a run with --only rewrites the "
                             "matrix with the other rows of the last runs (same world size)")
    args = parser.parse_args(argv)
    sys.path.insert(0, os.path.dirname(__file__))
    from distpool import DistPool

    rows: dict[str, dict] = {}
    if args.only and os.path.exists(args.rows):
        with open(args.rows) as f:
            kept = json.load(f)
        rows = kept["rows"] if kept.get("world_size") == args.world_size else {}
    pool = DistPool(args.world_size)
    start = time.perf_counter()
    try:
        for arch in ZOO:
            if args.only and arch.name not in args.only:
                continue
            t0 = time.perf_counter()
            try:
                patterns = arch.patterns + (("packed",) if arch.name in PACKED else ())
                rows[arch.name] = pool.run(run_arch, arch.name, patterns, timeout=900)[0]
            except Exception as e:  # noqa: BLE001 - a failing architecture is a row of the matrix
                rows[arch.name] = failure_line(str(e), 200)
            print(f"{arch.name}: {time.perf_counter() - t0:.0f} s "
                  f"{check(arch, rows[arch.name]) if isinstance(rows[arch.name], dict) else rows[arch.name]}",
                  flush=True)
            os.makedirs(os.path.dirname(os.path.abspath(args.rows)), exist_ok=True)
            with open(args.rows, "w") as f:
                json.dump({"world_size": args.world_size, "rows": rows}, f)
            if args.matrix:  # after every architecture: an interrupted run keeps what it measured
                text = _with_release_section(matrix(rows, args.world_size), args.out)
                with open(args.out, "w") as f:
                    f.write(text)
    finally:
        pool.close()
    print(f"zoo: {time.perf_counter() - start:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
