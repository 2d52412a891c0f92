"""Lift each canonical site's mask into a structured spec (LiftedMask in meta).

is_causal=True is causal. (Mask trees built in the graph come below.)
"""

from __future__ import annotations

import torch.fx

from .attention_form import MASK_META, SITE_META, LiftedMask, SdpaCall, is_sdpa
from .base import PassContext, PassResult

PASS = "lift_masks"


def lift_masks(gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
    modified = False
    for node in list(gm.graph.nodes):
        if not is_sdpa(node) or SITE_META not in node.meta:
            continue
        call = SdpaCall.of(node)
        if call.attn_mask is None:
            lifted = LiftedMask(causal=bool(call.is_causal))
            node.meta[MASK_META] = lifted
            node.meta[SITE_META].mask = lifted.spec()
    return PassResult(modified)
