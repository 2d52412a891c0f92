"""The runtime's modules import each other one way: every import between them, at module level
or inside a function, is an edge, and the graph has no cycle. Shared pieces live in the lower
module (dtypes.py, dilated_spec.py), never in a module that imports its users."""

from __future__ import annotations

import ast
import pathlib

import networkx as nx

RUNTIME = pathlib.Path(__file__).resolve().parent.parent / "runtime"


def _runtime_imports(path: pathlib.Path, modules: set[str]) -> set[str]:
    """The runtime modules `path` imports anywhere in its body (relative or through ringcc.runtime)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level == 1:
                names = [base] if base else [a.name for a in node.names]
            elif base.startswith("ringcc.runtime"):
                rest = base[len("ringcc.runtime"):].lstrip(".")
                names = [rest] if rest else [a.name for a in node.names]
            else:
                continue
            out.update(n.split(".")[0] for n in names)
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("ringcc.runtime."):
                    out.add(a.name.split(".")[2])
    return out & modules


def import_graph() -> nx.DiGraph:
    files = {p.stem: p for p in RUNTIME.glob("*.py") if p.stem != "__init__"}
    g = nx.DiGraph()
    g.add_nodes_from(files)
    for name, path in files.items():
        g.add_edges_from((name, dep) for dep in _runtime_imports(path, set(files)) if dep != name)
    return g


def test_runtime_imports_have_no_cycle():
    g = import_graph()
    assert g.number_of_edges() > 10  # the parser sees the imports (ops -> ring, ring -> kernels, ...)
    assert g.has_edge("dilated", "ops") and g.has_edge("kernels", "flex")
    cycles = list(nx.simple_cycles(g))
    assert not cycles, f"runtime modules import each other in a cycle: {cycles}"


def test_import_graph_parser_finds_a_cycle(tmp_path):
    """The check itself: a lazy import back up the graph is a cycle."""
    (tmp_path / "low.py").write_text("def f():\n    from . import high\n")
    (tmp_path / "high.py").write_text("from .low import f\nfrom ringcc.runtime import other\n")
    mods = {"low", "high", "other"}
    assert _runtime_imports(tmp_path / "low.py", mods) == {"high"}
    assert _runtime_imports(tmp_path / "high.py", mods) == {"low", "other"}
