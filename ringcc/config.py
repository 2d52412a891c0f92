"""The one settings object. Frozen, keyword-only, every field documented.

`Config.from_options(options)` builds it from `torch.compile(..., options={...})`; unknown
keys are an error that lists the valid ones. Environment overrides use the prefix
`RINGCC_` + the upper-case field name (e.g. RINGCC_INNER=aot_eager, RINGCC_DUMP_DIR=/tmp/g)
and are read here only; explicit options win over the environment.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any, Optional

ENV_PREFIX = "RINGCC_"

INNER_COMPILERS = ("inductor", "aot_eager", "eager")
LAYOUTS = ("auto", "contiguous", "zigzag")
DROPOUT_MODES = ("skip",)


@dataclass(frozen=True, kw_only=True)
class Config:
    group: Any = None
    """Process group to shard over (None = WORLD; p = 1 when no group is initialised)."""
    world_size: Optional[int] = None
    """Plan/rewrite for this many ranks instead of the group's size (offline tools)."""
    inner: str = "inductor"
    """Compiler for the rewritten graph: "inductor", "aot_eager" or "eager"."""
    dilation: Any = None
    """None (exact attention), a DilatedSpec applied to every site, or a callable
    site -> DilatedSpec | None choosing per site. Changes the model's math: opt-in only."""
    layout: str = "auto"
    """Sequence layout: "contiguous", "zigzag", or "auto" (zigzag when every site is causal)."""
    gather_outputs: bool = True
    """Gather graph outputs to full length (results equal eager); False returns shards."""
    pad: bool = False
    """Pad lengths not divisible by p (2p for zigzag) with masked keys; False raises."""
    seq_dim: Optional[int] = None
    """Sequence dim of the graph inputs when discovery is ambiguous."""
    shard: bool = True
    """Shard the sequence across ranks (False: rewrite attention sites only, p = 1 math)."""
    strict: bool = False
    """Any skipped attention site is an error naming the site and the reason."""
    require_linear_memory: bool = False
    """A memory plan whose verdict is not O(n/p) is an error."""
    dropout: str = "skip"
    """Attention dropout in training (dropout_p > 0): "skip" leaves such sites un-rewritten with
    reason `dropout`. Per-block dropout in the ring runtime is not implemented yet."""
    dump_dir: Optional[str] = None
    """Write the graph before and after every pass into this folder."""
    bucket_mb: float = 25.0
    """Bucket size for the parameter-gradient all-reduce."""
    verify: bool = False
    """Run the graph verifier after every pass (tests turn it on)."""

    def __post_init__(self):
        _check_choice("inner", self.inner, INNER_COMPILERS)
        _check_choice("layout", self.layout, LAYOUTS)
        _check_choice("dropout", self.dropout, DROPOUT_MODES)
        if self.world_size is not None and self.world_size < 1:
            raise ValueError(f"world_size must be >= 1; got {self.world_size}")
        if self.bucket_mb <= 0:
            raise ValueError(f"bucket_mb must be > 0; got {self.bucket_mb}")

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def from_options(cls, options: dict | None = None, base: "Config | None" = None) -> "Config":
        """Config from torch.compile options, the environment, and an optional base."""
        options = dict(options or {})
        valid = cls.field_names()
        unknown = sorted(set(options) - set(valid))
        if unknown:
            raise ValueError(f"unknown ringcc option(s) {unknown}; valid options: {valid}")
        defaults = {f.name: f.default for f in dataclasses.fields(cls)}
        values = {} if base is None else {n: getattr(base, n) for n in valid}
        # The environment fills in what nobody set: a field the base Config set explicitly
        # (away from its default) and every option passed here win over it.
        values.update({k: v for k, v in _from_env(cls).items() if values.get(k, defaults[k]) == defaults[k]})
        values.update(options)
        return cls(**values)


def _check_choice(name: str, value, allowed) -> None:
    if value not in allowed:
        raise ValueError(f"Config.{name}={value!r} is not allowed; choose one of {list(allowed)}")


def _parse_env(f: dataclasses.Field, raw: str):
    kind = str(f.type)
    if "bool" in kind:
        if raw.lower() in ("1", "true", "yes", "on"):
            return True
        if raw.lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"{ENV_PREFIX}{f.name.upper()}={raw!r}: expected 1/0/true/false")
    if "int" in kind:
        return int(raw)
    if "float" in kind:
        return float(raw)
    return raw


_ENV_FIELDS = ("inner", "layout", "gather_outputs", "pad", "strict", "require_linear_memory",
               "dropout", "dump_dir", "bucket_mb", "verify", "shard", "world_size")


def _from_env(cls) -> dict:
    out = {}
    for f in dataclasses.fields(cls):
        if f.name not in _ENV_FIELDS:
            continue
        raw = os.environ.get(ENV_PREFIX + f.name.upper())
        if raw is not None and raw != "":
            out[f.name] = _parse_env(f, raw)
    return out
