"""The oldest transformers release ringcc is tested with, checked when a graph of it is compiled.

transformers stays optional: nothing here imports it. A graph whose code comes from
transformers (a module of its package on the graph's module stack, or one of its files in a
node's stack trace) can only have been traced with transformers imported, so the check reads
the release of the imported package. Older releases build their masks and attention in forms
that the zoo does not cover (`make test-versions` runs the tested releases): compiling with one
is an error that names the release and the floor, on every rank (each compiles the same graph).
"""

from __future__ import annotations

import re
import sys

import torch

TRANSFORMERS_FLOOR = (4, 57)  # pyproject.toml's `transformers>=4.57`; tests/versions.py's oldest release
_HF_FILE = re.compile(r"[\\/]transformers[\\/]")


def release_tuple(version: str) -> tuple[int, ...]:
    """(major, minor, patch) of a version string such as "4.57.1", "5.0.0.dev0" or "4.57.0rc1"."""
    m = re.match(r"(\d+)(?:\.(\d+))?(?:\.(\d+))?", version)
    if m is None:
        raise ValueError(f"ringcc: cannot read a release from transformers' version {version!r}")
    return tuple(int(x or 0) for x in m.groups())


def _traces_transformers(gm: torch.fx.GraphModule) -> bool:
    for node in gm.graph.nodes:
        for _, cls in (node.meta.get("nn_module_stack") or {}).values():
            name = cls if isinstance(cls, str) else f"{getattr(cls, '__module__', '')}.{getattr(cls, '__name__', '')}"
            if name.startswith("transformers."):
                return True
        if _HF_FILE.search(node.meta.get("stack_trace") or ""):
            return True
    return False


def check_transformers_release(gm: torch.fx.GraphModule) -> None:
    """Raise if `gm` was traced from transformers code of a release older than the floor."""
    hf = sys.modules.get("transformers")
    if hf is None or not _traces_transformers(gm):
        return
    version = getattr(hf, "__version__", "unknown")
    floor = ".".join(map(str, TRANSFORMERS_FLOOR))
    if version == "unknown" or release_tuple(version)[:2] < TRANSFORMERS_FLOOR:
        raise RuntimeError(
            f"ringcc: this model's code comes from transformers {version} (imported from "
            f"{getattr(hf, '__file__', '?')}), older than {floor}, the oldest release ringcc is tested with; "
            f"install transformers>={floor} (pip install -U 'transformers>={floor}')")
