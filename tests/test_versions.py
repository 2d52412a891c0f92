"""The zoo's core under one transformers release: every site rewritten and exact, unpadded and
padded, at p = 2 (marker `versions`). `make test-versions` (tests/versions.py) runs this file once
per tested release, each installed in its own folder; run alone, it tests the installed release.
Each case records its results in out/versions/<release>.json for docs/compatibility.md."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest

import versions
import zoo

# Where a release's own code holds an O(n) value per rank that no rewrite reaches, (first release,
# last release, architecture) -> that op, for the releases from first to last: the case expects the
# plan's verdict to fail, everything else as the zoo expects, and the matrix gives the op as the reason.
_OPT_LAYERDROP = ("OPTDecoder.forward draws torch.rand([]) and branches on it against layerdrop in training "
                  "(modeling_opt.py:{lines}), a graph break inside the layer loop: dynamo runs that frame "
                  "eagerly, so the token embedding (nn.Embedding), the position embedding and their sum are "
                  "whole [b, n, d] activations on every rank, and the first layer's graph takes the sum whole "
                  "(and gives its gradient whole)")
_MOE_EXPERT_LOOP = ("{block}.forward (modeling_{module}.py) loops over the experts hit, expert_hit = "
                    "(...).nonzero(), a data-dependent loop: dynamo runs the block eagerly, so "
                    "the router's one_hot mask, each expert's rows hidden_states[None, top_x] and index_add_ "
                    "read the whole sequence's hidden states (gathered from the attention graph's sharded "
                    "output) on every rank, and each expert's graph holds its rows of all n tokens")
_MOE_GROUPED_MM_BACKWARD = ("the autograd formula of transformers::grouped_mm_fallback (integrations/moe.py, "
                            "_grouped_mm_fallback_backward) reads ctx.offs.tolist() in Python, which AOT autograd "
                            "cannot trace (aten._local_scalar_dense): the backend compile of the model's graph fails, "
                            "dynamo splits the model at every MoE layer, and the layers' hidden states cross those "
                            "graph boundaries as whole [b, n, d] inputs")
RELEASE_O_N = {
    ("4.57.1", "4.57.1", "opt"): _OPT_LAYERDROP.format(lines="644-645"),
    ("5.17.0", "5.17.0", "opt"): _OPT_LAYERDROP.format(lines="374-375"),
    ("4.53.3", "4.57.1", "mixtral"): _MOE_EXPERT_LOOP.format(block="MixtralSparseMoeBlock", module="mixtral"),
    ("4.53.3", "4.57.1", "qwen2_moe"): _MOE_EXPERT_LOOP.format(block="Qwen2MoeSparseMoeBlock", module="qwen2_moe"),
    # 5.24 makes the backward a custom op of its own
    ("5.5.4", "5.22.2", "mixtral"): _MOE_GROUPED_MM_BACKWARD,
    ("5.5.4", "5.22.2", "qwen2_moe"): _MOE_GROUPED_MM_BACKWARD,
}
# rewrites of the two sites summed over the graphs where a release splits the model into more
# graphs than the zoo's (the MoE layers' graph breaks recompile the attention layers' frames)
RELEASE_SITES = {("5.5.4", "5.22.2", "mixtral"): 25, ("5.5.4", "5.22.2", "qwen2_moe"): 25}


def for_release(table: dict, release: str, name: str):
    """table's entry for architecture `name` whose releases hold `release` (None: none)."""
    from ringcc.releases import release_tuple

    at = release_tuple(release)
    return next((v for (first, last, n), v in table.items()
                 if n == name and release_tuple(first) <= at <= release_tuple(last)), None)


CORE = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "gpt2", "opt", "bloom", "bert", "mixtral",
        "qwen2_moe")
PATTERNS = ("loss_inside", "padded")


@pytest.fixture(scope="module")
def release():
    import transformers

    expected = os.environ.get(versions.RELEASE_ENV)
    assert expected in (None, transformers.__version__), (
        f"{versions.RELEASE_ENV}={expected} but transformers {transformers.__version__} is imported "
        f"(from {transformers.__file__})")
    return transformers.__version__


def _record(release: str, name: str, res) -> None:
    os.makedirs(versions.ROWS, exist_ok=True)
    path = os.path.join(versions.ROWS, f"{release}.json")
    rows = {}
    if os.path.exists(path):
        with open(path) as f:
            rows = json.load(f)
    rows[name] = res
    with open(path, "w") as f:
        json.dump(rows, f, indent=1)


@pytest.mark.versions
@pytest.mark.parametrize("name", CORE)
def test_core_architecture(pools, release, name):
    arch = zoo.BY_NAME[name]
    why = for_release(RELEASE_O_N, release, name)
    if why is not None:
        arch = dataclasses.replace(arch, linear=False, why=why)
    arch = dataclasses.replace(arch, sites=for_release(RELEASE_SITES, release, name) or arch.sites)
    try:
        results = pools(2).run(zoo.run_arch, name, PATTERNS, timeout=900)
    except (RuntimeError, TimeoutError) as e:
        _record(release, name, zoo.failure_line(str(e)))
        raise
    _record(release, name, {p: dict(r, why=why) if why else r for p, r in results[0].items()})
    for rank, res in enumerate(results):
        assert set(res) == set(PATTERNS)
        assert zoo.check(arch, res) == [], (release, rank, res)


def test_core_names_zoo_architectures():
    """Every core name is a zoo architecture, and the release list ends with a 5.x and starts at
    the floor that ringcc checks at compile time (ringcc/releases.py)."""
    from ringcc.releases import TRANSFORMERS_FLOOR, release_tuple

    assert set(CORE) <= set(zoo.BY_NAME)
    assert release_tuple(versions.RELEASES[0])[:2] == TRANSFORMERS_FLOOR
    assert min(release_tuple(r) for r in versions.RELEASES)[:2] == TRANSFORMERS_FLOOR


def test_older_transformers_release_is_an_error_at_compile_time(monkeypatch):
    """An HF model compiled with a transformers release below the floor: a RuntimeError at compile
    time naming the release and the floor. A model without transformers code compiles as usual
    under the same release (transformers stays optional)."""
    import sys

    import torch

    import ringcc

    torch.manual_seed(0)
    hf = zoo.BY_NAME["llama"].factory()
    # the module that the check reads: transformers replaces its entry in sys.modules on first use
    monkeypatch.setattr(sys.modules["transformers"], "__version__", "4.45.2")
    ids = torch.randint(1, zoo.VOCAB, (zoo.BATCH, zoo.N))
    backend = ringcc.backend(ringcc.Config(inner="aot_eager"))
    torch._dynamo.reset()
    with pytest.raises(RuntimeError, match=r"transformers 4\.45\.2 .*older than 4\.57.*install transformers>=4\.57"):
        torch.compile(hf, backend=backend)(input_ids=ids, labels=ids)
    plain = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())
    x = torch.randn(2, 8)
    torch._dynamo.reset()
    torch.testing.assert_close(torch.compile(plain, backend=backend)(x), plain(x))


def test_release_tables_hold_their_ranges():
    """A release's own O(n) op applies from the first release of its range to the last."""
    assert for_release(RELEASE_SITES, "5.17.0", "mixtral") == 25
    assert for_release(RELEASE_SITES, "5.5.4", "qwen2_moe") == for_release(RELEASE_SITES, "5.22.2", "mixtral") == 25
    assert for_release(RELEASE_SITES, "5.24.0", "mixtral") is None and for_release(RELEASE_SITES, "5.0.0", "mixtral") is None
    assert "644-645" in for_release(RELEASE_O_N, "4.57.1", "opt") and for_release(RELEASE_O_N, "5.24.0", "opt") is None


def test_release_tuple_reads_release_strings():
    from ringcc.releases import release_tuple

    assert release_tuple("4.57.1") == (4, 57, 1)
    assert release_tuple("5.0.0.dev0") == (5, 0, 0)
    assert release_tuple("4.57.0rc1") == (4, 57, 0)
    assert release_tuple("5") == (5, 0, 0)
    with pytest.raises(ValueError, match="cannot read a release from transformers' version 'main'"):
        release_tuple("main")


def test_release_table_has_a_column_per_release(tmp_path):
    """docs/compatibility.md's release section from per-release rows: one column per release,
    each run's sites, exactness and memory (dense, O(n), O(n/p)), the reasons below (a release's
    own O(n) op in place of the plan's culprits), and the zoo's own matrix
    (zoo.py --matrix) rewritten with the section kept."""
    ok = dict(loss=1e-7, grad=4e-7, worst="w", graphs=1, rewritten=[2], skipped=[0], skip_reasons=[], gathers=[],
              linear=True, culprits=[], seconds=1.0)
    dense = dict(ok, rewritten=[0], skipped=[2], linear=False, skip_reasons=["unliftable_mask: x.py:1: vmap"])
    rows = tmp_path / "rows"
    rows.mkdir()
    held = dict(ok, linear=False, culprits=["inputs_embeds at m.py:2"], why="m.py:1: an O(n) op")
    (rows / "4.57.1.json").write_text(json.dumps({"llama": {"loss_inside": dense, "padded": dense},
                                                   "opt": {"loss_inside": held, "padded": held}}))
    (rows / "5.24.0.json").write_text(json.dumps({"llama": {"loss_inside": ok, "padded": ok},
                                                   "gpt2": "RuntimeError: boom"}))
    out = tmp_path / "compatibility.md"
    out.write_text("# Compatibility matrix\n\n| zoo |\n")
    zoo.write_release_table(str(rows), ("4.57.1", "5.17.0", "5.24.0"), str(out))
    text = out.read_text()
    assert text.startswith("# Compatibility matrix\n\n| zoo |\n\n" + zoo.RELEASES_HEADING)
    assert "| architecture | transformers 4.57.1 | transformers 5.17.0 | transformers 5.24.0 |" in text
    assert ("| llama | loss_inside: 0/2, padded: 0/2; exact; dense | - | "
            "loss_inside: 2/2, padded: 2/2; exact; O(n/p) |") in text
    assert "| gpt2 | - | - | run failed |" in text
    assert "| opt | loss_inside: 2/2, padded: 2/2; exact; O(n) | - | - |" in text
    assert "\n- opt: m.py:1: an O(n) op\n" in text and "inputs_embeds" not in text  # the op, not the culprits
    assert "transformers 4.57.1:\n\n- llama: unliftable_mask: x.py:1: vmap" in text
    assert "transformers 5.24.0:\n\n- gpt2: RuntimeError: boom" in text
    kept = zoo._with_release_section("# Compatibility matrix\n\n| new zoo |\n", str(out))
    assert kept.startswith("# Compatibility matrix\n\n| new zoo |\n\n" + zoo.RELEASES_HEADING)
    assert kept.endswith(text.split(zoo.RELEASES_HEADING, 1)[1])


def test_failure_line_names_the_error():
    """A failed run's row: the last exception a rank's traceback names, with dynamo's explanation,
    not the traceback's closing hint."""
    traceback = """rank 0:
Traceback (most recent call last):
  File "tests/distpool.py", line 47, in _worker
    results.put((rank, True, fn(rank, world, *args)))
torch._dynamo.exc.TorchRuntimeError: RuntimeError when making fake tensor call
  Explanation: Dynamo failed to run FX node with fake tensors: got RuntimeError('Expected inputs of BF16 type')
  Hint: Your code may result in an error when running in eager.

Set TORCHDYNAMO_VERBOSE=1 for the internal stack trace"""
    assert zoo.failure_line(traceback) == (
        "torch._dynamo.exc.TorchRuntimeError: RuntimeError when making fake tensor call (Dynamo failed to run FX "
        "node with fake tensors: got RuntimeError('Expected inputs of BF16 type'))")
    long = zoo.failure_line(traceback, limit=60)
    assert len(long) == 60 and long.startswith("torch._dynamo.exc.") and long.endswith("of BF16 type'))"), long
    assert zoo.failure_line("RuntimeError: ringcc: boom\n") == "RuntimeError: ringcc: boom"
    assert zoo.failure_line("distributed case run_arch did not finish in 900s on 2 ranks") == \
        "distributed case run_arch did not finish in 900s on 2 ranks"
