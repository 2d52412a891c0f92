"""Config: one frozen settings object; unknown options list the valid ones; RINGCC_* env
overrides fill in what nobody set explicitly."""

import dataclasses

import pytest

import ringcc
from ringcc.config import Config


def test_unknown_option_lists_the_valid_ones():
    with pytest.raises(ValueError, match=r"unknown ringcc option\(s\) \['layuot'\]; valid options: \[.*'layout'.*\]"):
        Config.from_options({"layuot": "zigzag"})


def test_bad_choice_says_what_is_allowed():
    with pytest.raises(ValueError, match=r"Config.inner='tvm' is not allowed; choose one of \['inductor', 'aot_eager', 'eager'\]"):
        Config(inner="tvm")
    with pytest.raises(ValueError, match=r"world_size must be >= 1 \(the number of ranks to plan for\); got 0"):
        Config(world_size=0)


@pytest.mark.parametrize("field,value,kind", [
    ("strict", "no", "a bool"),  # a non-empty string must not switch the flag on
    ("pad", 1, "a bool"),
    ("world_size", 2.5, "an int or None"),
    ("world_size", True, "an int or None"),
    ("seq_dim", "1", "an int or None"),
    ("bucket_mb", "big", "a number of MB"),
    ("dump_dir", 3, "a folder path"),
    ("group", "notagroup", "a torch.distributed ProcessGroup"),
    ("timeout", "10s", "a number of seconds, a datetime.timedelta or None"),
])
def test_wrong_types_are_rejected_with_what_was_received(field, value, kind):
    with pytest.raises(TypeError, match=rf"Config.{field} must be {kind}.*; got {type(value).__name__} {value!r}"):
        Config(**{field: value})


def test_environment_errors_name_the_variable(monkeypatch):
    monkeypatch.setenv("RINGCC_WORLD_SIZE", "abc")
    with pytest.raises(ValueError, match=r"RINGCC_WORLD_SIZE='abc': expected a number"):
        Config.from_options({})
    monkeypatch.setenv("RINGCC_WORLD_SIZE", "2")
    monkeypatch.setenv("RINGCC_BUCKET_MB", "-1")
    with pytest.raises(ValueError, match=r"RINGCC_BUCKET_MB='-1': Config.bucket_mb must be > 0"):
        Config.from_options({})


def test_frozen_and_keyword_only():
    cfg = Config()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.inner = "eager"
    with pytest.raises(TypeError):
        Config("eager")


def test_environment_fills_in_but_explicit_settings_win(monkeypatch):
    monkeypatch.setenv("RINGCC_INNER", "aot_eager")
    monkeypatch.setenv("RINGCC_STRICT", "1")
    assert Config.from_options({}).inner == "aot_eager"
    assert Config.from_options({}).strict is True
    assert Config.from_options({"inner": "eager"}).inner == "eager"
    base = Config(inner="eager")
    merged = Config.from_options({}, base=base)
    assert merged.inner == "eager" and merged.strict is True  # set explicitly: kept; unset: env
    monkeypatch.setenv("RINGCC_STRICT", "maybe")
    with pytest.raises(ValueError, match=r"RINGCC_STRICT='maybe': expected 1/0/true/false"):
        Config.from_options({})


def test_compile_options_reach_the_backend():
    import torch
    import torch.nn.functional as F

    fn = torch.compile(lambda q: F.scaled_dot_product_attention(q, q, q, is_causal=True),
                       backend="ringcc", options={"inner": "aot_eager", "strict": True})
    q = torch.randn(1, 2, 8, 4)
    torch.testing.assert_close(fn(q), F.scaled_dot_product_attention(q, q, q, is_causal=True))
    assert [s.decision.value for s in ringcc.last_report().sites] == ["rewritten"]
    torch._dynamo.reset()
    bad = torch.compile(lambda q: q + 1, backend="ringcc", options={"nope": 1})
    with pytest.raises(Exception, match=r"unknown ringcc option\(s\) \['nope'\]"):
        bad(q)


def test_group_option_is_checked_before_torch_sees_it():
    """options={"group": "notagroup"}: the ringcc error, not an AttributeError from inside torch."""
    import torch

    fn = torch.compile(lambda q: q * 2, backend="ringcc", options={"group": "notagroup"})
    with pytest.raises(Exception, match=r"Config.group must be a torch.distributed ProcessGroup .* got str 'notagroup'"):
        fn(torch.randn(2))
    torch._dynamo.reset()


def test_timeout_takes_seconds_or_a_timedelta():
    import datetime

    from ringcc.config import timeout_delta

    assert timeout_delta(Config(timeout=2.5).timeout) == datetime.timedelta(seconds=2.5)
    assert timeout_delta(Config(timeout=datetime.timedelta(minutes=1)).timeout) == datetime.timedelta(minutes=1)
    assert Config().timeout is None
    for bad in (0, -1, datetime.timedelta(0)):
        with pytest.raises(ValueError, match=r"Config.timeout must be more than 0 seconds"):
            Config(timeout=bad)


def test_grad_sync_choices_and_environment(monkeypatch):
    with pytest.raises(ValueError, match=r"Config.grad_sync='sum' is not allowed; choose one of \['auto', 'all_reduce', 'outer'\]"):
        Config(grad_sync="sum")
    monkeypatch.setenv("RINGCC_GRAD_SYNC", "outer")
    assert Config.from_options().grad_sync == "outer"
    assert Config.from_options({"grad_sync": "all_reduce"}).grad_sync == "all_reduce"
