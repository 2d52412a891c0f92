"""The model zoo (tests/zoo.py) on gloo ranks: every architecture under its patterns, against
single-process eager. The whole zoo is marked `zoo` (`make test-zoo`); the cheap cases run in
`make test`."""

import pytest

import zoo

CASES = [(arch.name, world) for arch in zoo.ZOO for world in arch.worlds]


@pytest.mark.zoo
@pytest.mark.parametrize("name,world", CASES, ids=[f"{n}-p{w}" for n, w in CASES])
def test_zoo(pools, name, world):
    arch = zoo.BY_NAME[name]
    patterns = arch.patterns if world == 2 else arch.patterns_p4
    results = pools(world).run(zoo.run_arch, name, patterns, timeout=1200)
    for rank, res in enumerate(results):
        assert set(res) == set(patterns)
        assert zoo.check(arch, res) == [], (rank, res)


@pytest.mark.zoo
@pytest.mark.parametrize("name", zoo.AMP)
def test_zoo_under_cpu_bf16_autocast(pools, name):
    """The core architectures with fp32 weights under torch.autocast("cpu", bfloat16), loss
    inside, p = 2: every site rewritten, the loss and the whole gradient no further from an fp64
    reference than eager under the same autocast, the same parameters with a gradient."""
    for rank, res in enumerate(pools(2).run(zoo.run_amp, name, timeout=1200)):
        assert zoo.check_amp(zoo.BY_NAME[name], res) == [], (rank, res)


@pytest.mark.parametrize("name", zoo.CHEAP)
def test_default_config_decoder_is_exact_and_linear(pools, name):
    """A Hugging Face decoder in its default config (use_cache=True in training), loss inside:
    exact, every site rewritten, and the plan O(n/p) (no K/V cache or output gather). The loss
    outside on sharded logits: test_backend_distributed.py and the zoo."""
    results = pools(2).run(zoo.run_arch, name, ("loss_inside",), timeout=600)
    for rank, res in enumerate(results):
        assert zoo.check(zoo.BY_NAME[name], res) == [], (rank, res)
        assert all(r["gathers"] == [] for r in res.values()), (rank, res)


@pytest.mark.zoo
def test_bloom_left_padded(pools):
    """Bloom with a left-padded batch (its ALiBi positions counted from each row's first token, a
    per-token tensor of the score function): both sites rewritten, the loss over the valid tokens
    and every gradient as eager's."""
    results = pools(2).run(zoo.run_arch, "bloom", ("left_padded",), timeout=1200)
    for rank, res in enumerate(results):
        assert zoo.check(zoo.BY_NAME["bloom"], res) == [], (rank, res)


@pytest.mark.parametrize("name", [pytest.param(n, marks=[] if n in zoo.CHEAP else pytest.mark.zoo) for n in zoo.PACKED])
def test_packed_documents(pools, name):
    """Packed documents (position ids restarting per document, use_cache=False, no attention
    mask): HF's document mask read as a function, every site rewritten, O(n/p), no gather, the
    loss and every gradient as eager's (and the same parameters with a gradient)."""
    for rank, res in enumerate(pools(2).run(zoo.run_arch, name, ("packed",), timeout=1200)):
        assert zoo.check(zoo.BY_NAME[name], res) == [], (rank, res)
        assert res["packed"]["gathers"] == [], (rank, res)
