"""ringcc: compile unmodified PyTorch models into sequence-sharded ring attention."""

from ringcc import reference
from ringcc.backend import backend
from ringcc.config import Config
from ringcc.report import last_report, reports, reset_reports
from ringcc.runtime.graphs import clear as release_graphs
from ringcc.runtime.ops import gather_sequence, ring_attention, shard_sequence
from ringcc.runtime.dilated import DilatedSpec, dilated_attention
from ringcc.mark import mark_sequence
from ringcc.sharded import SequenceSharded

__all__ = [
    "Config", "backend", "last_report", "reports", "reset_reports",
    "ring_attention", "shard_sequence", "gather_sequence", "reference",
    "DilatedSpec", "dilated_attention", "SequenceSharded", "release_graphs",
]
__version__ = "0.1.0"
