"""The one settings object. Frozen, keyword-only, every field documented.

`Config.from_options(options)` builds it from `torch.compile(..., options={...})`; unknown
keys are an error that lists the valid ones. Environment overrides use the prefix
`RINGCC_` + the upper-case field name (e.g. RINGCC_INNER=aot_eager, RINGCC_DUMP_DIR=/tmp/g)
and are read here only; explicit options win over the environment.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
from dataclasses import dataclass
from typing import Any, Optional, Union

ENV_PREFIX = "RINGCC_"

INNER_COMPILERS = ("inductor", "aot_eager", "eager")
LAYOUTS = ("auto", "contiguous", "zigzag")
DROPOUT_MODES = ("skip",)
CHECKPOINT_MODES = ("recompute", "inline", "keep")
GRAD_SYNC_MODES = ("auto", "all_reduce", "outer")
CHECK_INPUTS_MODES = ("every_call", "first_call")


@dataclass(frozen=True, kw_only=True)
class Config:
    group: Any = None
    """Process group to shard over (None = WORLD; p = 1 when no group is initialised)."""
    mesh: Any = None
    """A DeviceMesh whose dimension `axis` the sequence is sharded over (instead of `group`); the
    other dimensions are left to data parallelism (FSDP2, DDP). See docs/multinode.md."""
    axis: Optional[str] = None
    """The name of the `mesh` dimension that shards the sequence (may be left out for a 1-D mesh)."""
    grad_sync: str = "auto"
    """How parameter gradients become the single-device gradients over the sequence group:
    "all_reduce" sums each rank's share over the group (alone, or under FSDP2 / DDP on another
    mesh dimension); "outer" leaves the reduction to an engine that averages gradients over
    ranks including the whole sequence group (FSDP2 or DDP over the flattened data x sequence
    mesh): ringcc multiplies each rank's share by p instead, so that the engine's mean is the sum
    (no communication). "auto": "outer" for the parameters such an engine is found to average
    over the whole sequence group (an FSDP2 module compiled, or a DDP forward running), else
    "all_reduce". See Note [Gradients under data parallelism] in passes/sync_param_grads.py."""
    world_size: Optional[int] = None
    """Plan/rewrite for this many ranks instead of the group's size (offline tools)."""
    inner: str = "inductor"
    """Compiler for the rewritten graph: "inductor", "aot_eager" or "eager"."""
    dilation: Any = None
    """None (exact attention), a DilatedSpec applied to every site, or a callable
    site -> DilatedSpec | None choosing per site. Changes the model's math: opt-in only."""
    layout: str = "auto"
    """Sequence layout: "contiguous", "zigzag", or "auto" (zigzag when every site is causal)."""
    balance: float = 1.1
    """Sites whose mask is a function of per-token tensors (documents, positions, padding) balance
    their ring at run time, every step: when the layout gives a rank more than `balance` times the
    mean count of allowed (query, key) pairs, the ring runs on chunks reassigned by their counts
    (Note [Balanced ring] in runtime/balance.py; the report says which sites balance, and after a
    step the shares before and after). 0 turns it off; otherwise at least 1.0."""
    gather_outputs: bool = False
    """Sequence-carrying graph outputs (logits, hidden states, a returned K/V cache): False
    returns each as a SequenceSharded tensor holding this rank's rows, gathered to the full
    value (with autograd) by the first op that reads it, so that outputs nobody reads cost
    n/p rows per rank (Note [Sharded outputs], ringcc/sharded.py); True gathers them inside
    the graph (every rank holds all n rows of every output, counted O(n) by the planner)."""
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
    checkpoints: str = "recompute"
    """Activation-checkpoint regions (torch.utils.checkpoint) holding attention: "recompute" moves
    their bodies into the graph so their attention is rewritten and sharded, then checkpoints
    them again (recomputed in backward, ring attention included); "inline" leaves them inlined
    (their activations kept, O(n/p) per rank: more memory, no recompute); "keep" leaves them
    checkpointed, their attention dense on every rank (named in the report; an error under strict)."""
    dropout: str = "skip"
    """Attention dropout in training (dropout_p > 0): "skip" leaves such sites un-rewritten with
    reason `dropout`. Per-block dropout in the ring runtime is not implemented yet."""
    dump_dir: Optional[str] = None
    """Write the graph before and after every pass into this folder."""
    bucket_mb: float = 25.0
    """Bucket size for the parameter-gradient all-reduce."""
    check_inputs: str = "every_call"
    """When the ranks of the sequence group compare the data they were called with (a checksum of
    each graph input that is not a parameter, a buffer or another graph's shards, and every
    input's shape, in one all-reduce; Note [Input checksum] in runtime/ops.py): "every_call",
    or "first_call" (with the rewrite decisions only; no host sync on later calls). Ranks fed
    different batches are an error on every rank either way at the first call that differs
    and is checked; the check costs one small all-reduce and one host sync per call of a
    compiled graph."""
    verify: bool = False
    """Run the graph verifier after every pass (tests turn it on)."""
    timeout: Union[float, datetime.timedelta, None] = None
    """Seconds (or a datetime.timedelta) after which a collective or ring transfer of the group
    that waits for another rank fails with an error instead of waiting; None keeps the group's
    own timeout (init_process_group's `timeout=`: 30 minutes for gloo, 10 for NCCL by default).
    Set at a compiled graph's first call, once every rank has compiled it (compiles take
    different times on different ranks): it becomes the process group's timeout for every
    later operation on it (torch's `_set_pg_timeout`), so a rank that stalls ends the others
    with an error in that time (gloo raises it; NCCL's watchdog ends the process). Same value
    on every rank. The functional API (ringcc.ring_attention) uses the group's timeout:
    init_process_group(timeout=...) or new_group(timeout=...)."""

    def __post_init__(self):
        for f in dataclasses.fields(self):
            _validate(f.name, getattr(self, f.name))
        _check_mesh(self)

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


BOOL_FIELDS = ("gather_outputs", "pad", "shard", "strict", "require_linear_memory", "verify")
CHOICES = {"inner": INNER_COMPILERS, "layout": LAYOUTS, "dropout": DROPOUT_MODES, "checkpoints": CHECKPOINT_MODES,
           "grad_sync": GRAD_SYNC_MODES, "check_inputs": CHECK_INPUTS_MODES}


def _received(value) -> str:
    return f"{type(value).__name__} {value!r}"


def _validate(name: str, value) -> None:
    """One field's type and range; the error says what was received and what is allowed (a
    string such as "no" must not switch a flag on by being non-empty)."""
    if name in CHOICES:
        _check_choice(name, value, CHOICES[name])
    elif name in BOOL_FIELDS:
        if not isinstance(value, bool):
            raise TypeError(f"Config.{name} must be a bool (True or False); got {_received(value)}")
    elif name in ("world_size", "seq_dim"):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise TypeError(f"Config.{name} must be an int or None; got {_received(value)}")
        if name == "world_size" and value is not None and value < 1:
            raise ValueError(f"Config.world_size must be >= 1 (the number of ranks to plan for); got {value}")
    elif name == "balance":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"Config.balance must be a number (max over mean, e.g. 1.1; 0: off); got {_received(value)}")
        if value != 0 and not value >= 1.0:
            raise ValueError(f"Config.balance must be 0 (off) or at least 1.0 (a rank's share over the mean); got {value}")
    elif name == "bucket_mb":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"Config.bucket_mb must be a number of MB; got {_received(value)}")
        if not value > 0:
            raise ValueError(f"Config.bucket_mb must be > 0; got {value}")
    elif name == "group":
        _check_group(value)
    elif name == "timeout":
        if value is None:
            return
        if isinstance(value, bool) or not isinstance(value, (int, float, datetime.timedelta)):
            raise TypeError(f"Config.timeout must be a number of seconds, a datetime.timedelta or None; "
                            f"got {_received(value)}")
        seconds = value.total_seconds() if isinstance(value, datetime.timedelta) else value
        if not seconds > 0:
            raise ValueError(f"Config.timeout must be more than 0 seconds; got {value!r}")
    elif name == "dump_dir":
        if value is not None and not isinstance(value, (str, os.PathLike)):
            raise TypeError(f"Config.dump_dir must be a folder path (str or os.PathLike) or None; got {_received(value)}")


def _check_group(value) -> None:
    """None (WORLD) or a torch.distributed ProcessGroup (a group name or rank list is not one)."""
    if value is None:
        return
    import torch.distributed as dist

    if not (dist.is_available() and isinstance(value, dist.ProcessGroup)):
        raise TypeError(f"Config.group must be a torch.distributed ProcessGroup (e.g. dist.new_group(ranks)) or "
                        f"None for the default group; got {_received(value)}")


def timeout_delta(value) -> "datetime.timedelta | None":
    """Config.timeout as a timedelta (None stays None)."""
    if value is None or isinstance(value, datetime.timedelta):
        return value
    return datetime.timedelta(seconds=float(value))


def _check_mesh(config: Config) -> None:
    """`mesh` and `axis` name one dimension of a DeviceMesh; `group` is the other way to say it."""
    mesh, axis = config.mesh, config.axis
    if mesh is None:
        if axis is not None:
            raise ValueError(f"Config.axis={axis!r} needs Config.mesh (the DeviceMesh it names a dimension of)")
        return
    from torch.distributed.device_mesh import DeviceMesh

    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"Config.mesh must be a torch.distributed.device_mesh.DeviceMesh; got {type(mesh).__name__}")
    if config.group is not None:
        raise ValueError("Config.mesh and Config.group both name the sequence group; pass one of them "
                         "(mesh=..., axis=... or group=mesh.get_group(axis))")
    names = list(mesh.mesh_dim_names or ())
    if axis is None:
        if mesh.ndim != 1:
            raise ValueError(f"Config.mesh has {mesh.ndim} dimensions {names}; set Config.axis to the one "
                             "that shards the sequence")
        return
    if axis not in names:
        raise ValueError(f"Config.axis={axis!r} is not a dimension of Config.mesh; its dimensions are {names}")


def _parse_env(f: dataclasses.Field, raw: str):
    kind = str(f.type)
    if "bool" in kind:
        if raw.lower() in ("1", "true", "yes", "on"):
            return True
        if raw.lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"{ENV_PREFIX}{f.name.upper()}={raw!r}: expected 1/0/true/false")
    try:
        if "int" in kind:
            return int(raw)
        if "float" in kind:
            return float(raw)
    except ValueError:
        raise ValueError(f"{ENV_PREFIX}{f.name.upper()}={raw!r}: expected a number") from None
    return raw


_ENV_FIELDS = ("inner", "layout", "gather_outputs", "pad", "strict", "require_linear_memory",
               "dropout", "checkpoints", "dump_dir", "bucket_mb", "verify", "shard", "world_size", "grad_sync",
               "timeout", "check_inputs", "balance")


def _from_env(cls) -> dict:
    out = {}
    for f in dataclasses.fields(cls):
        if f.name not in _ENV_FIELDS:
            continue
        raw = os.environ.get(ENV_PREFIX + f.name.upper())
        if raw is not None and raw != "":
            value = _parse_env(f, raw)
            try:
                _validate(f.name, value)
            except (TypeError, ValueError) as e:
                raise ValueError(f"{ENV_PREFIX}{f.name.upper()}={raw!r}: {e}") from None
            out[f.name] = value
    return out
