"""One data model for every decision ringcc takes on a graph; the backend and the CLI both
print it. `last_report()` is the last compiled graph's; `reports()` every graph's since
`reset_reports()`."""

from __future__ import annotations

import enum
import json
from dataclasses import asdict, dataclass, field
from typing import Any, Optional


class SkipReason(str, enum.Enum):
    """Why a candidate attention site was not rewritten."""

    UNLIFTABLE_MASK = "unliftable_mask"  # a mask that is not causal / padding / window
    UNSUPPORTED_MASK = "unsupported_mask"  # lifted, but the runtime cannot run it yet
    WEIGHTS_USED = "weights_used"  # the attention probabilities are used elsewhere
    DROPOUT = "dropout"  # dropout_p > 0 and Config(dropout="skip")
    NOT_SEQUENCE = "not_sequence"  # attends over a dim that is not the sequence
    SHAPE = "shape"  # shapes the runtime does not take (e.g. q/k lengths differ)
    ENCODER_FASTPATH = "encoder_fastpath"  # opaque fused encoder layer kept as is
    CROSS_ATTENTION = "cross_attention"  # keys from another sequence
    OTHER = "other"


class Decision(str, enum.Enum):
    REWRITTEN = "rewritten"
    SKIPPED = "skipped"


@dataclass
class Site:
    """One candidate attention site."""

    node: str  # node name in the graph it was found in
    location: str  # user source line, from the node's stack trace
    form: str  # "sdpa", "manual", "mha", "encoder", "flex"
    decision: Decision = Decision.SKIPPED
    reason: Optional[SkipReason] = None  # None when rewritten
    mask: Optional[dict] = None  # the lifted mask spec (causal, padding, window, ...)
    dilation: Optional[str] = None
    detail: str = ""  # free text: why, in words
    # a rewritten site's rows whose result is not eager's, in words (rows with every key masked by a
    # finite value that the ring cannot give as eager does: Note [Rows with no key] in runtime/ops.py)
    differs: str = ""
    # the rank's share of allowed pairs over the mean above which the ring rebalances at run time
    # (Note [Balanced ring] in runtime/balance.py); None: the site keeps the layout
    balance: Optional[float] = None


@dataclass
class Gather:
    """A sequence all-gather the sharding inserted (counted O(n) by the planner)."""

    node: str
    location: str
    why: str


@dataclass
class GraphReport:
    graph: str = ""
    world_size: int = 1
    sites: list[Site] = field(default_factory=list)
    gathers: list[Gather] = field(default_factory=list)
    pass_seconds: dict[str, float] = field(default_factory=dict)
    plan: Any = None  # planner.MemoryPlan when the planner ran
    notes: list[str] = field(default_factory=list)
    layout: Optional[str] = None  # the sequence layout, when the sequence was sharded

    @property
    def rewritten(self) -> list[Site]:
        return [s for s in self.sites if s.decision == Decision.REWRITTEN]

    @property
    def skipped(self) -> list[Site]:
        return [s for s in self.sites if s.decision == Decision.SKIPPED]

    def to_dict(self) -> dict:
        d = asdict(self)
        d["plan"] = None if self.plan is None else getattr(self.plan, "to_dict", lambda: str(self.plan))()
        return json.loads(json.dumps(d, default=lambda o: o.value if isinstance(o, enum.Enum) else str(o)))

    def format(self) -> str:
        lines = [f"ringcc report for {self.graph or 'graph'} (world size {self.world_size}): "
                 f"{len(self.rewritten)}/{len(self.sites)} attention sites rewritten"]
        for s in self.sites:
            what = s.decision.value if s.reason is None else f"skipped ({s.reason.value})"
            mask = "" if not s.mask else " mask=" + ",".join(f"{k}={v}" for k, v in s.mask.items() if v not in (None, False))
            dil = f" dilation={s.dilation}" if s.dilation else ""
            det = f" - {s.detail}" if s.detail else ""
            lines.append(f"  [{s.form:7}] {what:24} {s.location}{mask}{dil}{det}")
            if s.balance is not None:
                lines.append(f"            {balance_line(s)}")
        for g in self.gathers:
            lines.append(f"  gather (O(n)) at {g.location}: {g.why}")
        if self.pass_seconds:
            total = sum(self.pass_seconds.values())
            lines.append(f"  passes: {total * 1e3:.1f} ms (" + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in self.pass_seconds.items()) + ")")
        if self.plan is not None:
            lines.append(f"  memory: {getattr(self.plan, 'summary', lambda: str(self.plan))()}")
        lines.extend(f"  note: {n}" for n in self.notes)
        if any(s.mask and s.mask.get("function") for s in self.sites):
            lines.append(f"  {tiles_line()}")
        from ringcc.runtime.kernels import fallback_line

        fallback = fallback_line()
        if fallback and self.rewritten:
            lines.append(f"  {fallback}")
        return "\n".join(lines)


def tiles_line() -> str:
    """How this process's calls under mask functions ran since ringcc.runtime.maskfn.reset_stats
    (Note [Tile bounds], Note [Dense parts] in runtime/maskfn.py)."""
    from ringcc.runtime.maskfn import STATS as st

    if not any(st.values()):
        return "mask functions at run time: no call yet"
    return (f"mask functions at run time: calls {st['empty']} empty (skipped), {st['full']} full (fused kernel), "
            f"{st['partial']} partial; tiles {st['tiles_empty']} empty, {st['tiles_full']} full, "
            f"{st['tiles_partial']} partial; dense parts on the fused kernel: {st['calls_dense']} calls over "
            f"{st['tiles_dense']} tiles")


def balance_line(site: Site) -> str:
    """What a balancing site did at its last run (Note [Balanced ring] in runtime/balance.py): each
    rank's share of the allowed (query, key) pairs, max over mean, in the layout and as run."""
    from ringcc.runtime import balance

    last = balance.LAST.get((site.mask or {}).get("function", "").replace("; ", "\n"))  # the spec's text, one line
    head = f"balance: rebalanced at run time when max/mean > {site.balance:g}"
    if last is None:
        return head + " (not run yet)"
    how = f"{last['chunks']} chunks, moved" if last["moved"] else "kept"
    return (f"{head}; last run: max/mean {last['before']:.3f} in the {last['layout']} layout, {last['after']:.3f} "
            f"as run ({how}; allowed pairs per rank {last['pairs']})")


_REPORTS: list[GraphReport] = []


def record(report: GraphReport) -> None:
    _REPORTS.append(report)


def last_report() -> GraphReport | None:
    """The report of the last graph compiled by the ringcc backend (None if none yet)."""
    return _REPORTS[-1] if _REPORTS else None


def reports() -> list[GraphReport]:
    """Every graph's report since the last reset_reports()."""
    return list(_REPORTS)


def reset_reports() -> None:
    _REPORTS.clear()
