"""ringcc: compile unmodified PyTorch models into sequence-sharded ring attention."""

from ringcc import reference
from ringcc.runtime.ops import gather_sequence, ring_attention, shard_sequence

__all__ = ["ring_attention", "shard_sequence", "gather_sequence", "reference"]
__version__ = "0.1.0"
