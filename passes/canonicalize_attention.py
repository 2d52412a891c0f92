"""Canonicalise every attention form into one SDPA call (see attention_form.py).

Forms: F.scaled_dot_product_attention (dynamo's torch-level call or the aten op), and
more below. Every candidate site gets a report.Site, stored in the canonical node's meta;
sites that cannot be canonicalised are recorded as skipped here, with their reason.
"""

from __future__ import annotations

import torch.fx

from ringcc.report import Site

from .attention_form import FORM_META, SITE_META, SdpaCall, is_aten_graph, is_sdpa
from .base import PassContext, PassResult, location

PASS = "canonicalize_attention"


def canonicalize_attention(gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
    modified = False
    aten = is_aten_graph(gm)
    for node in list(gm.graph.nodes):
        if is_sdpa(node):
            modified |= _normalise_sdpa(node, aten)
    for node in gm.graph.nodes:
        if is_sdpa(node):
            _record_site(ctx, node, node.meta.setdefault(FORM_META, "sdpa"))
    return PassResult(modified)


def _normalise_sdpa(node: torch.fx.Node, aten: bool) -> bool:
    """Spell out every argument so that later passes read one shape of call."""
    args, kwargs = SdpaCall.of(node).args_kwargs(aten)
    if node.args == args and dict(node.kwargs) == kwargs:
        return False
    node.args, node.kwargs = args, kwargs
    return True


def _record_site(ctx: PassContext, node: torch.fx.Node, form: str) -> Site:
    site = Site(node=node.name, location=location(node), form=form)
    ctx.report.sites.append(site)
    node.meta[SITE_META] = site
    return site
