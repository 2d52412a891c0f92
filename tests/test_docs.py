"""docs/notes.md indexes every `Note [...]` the code defines (a line that is only the title, as a
comment or at the start of a docstring line), with the file that defines it."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFINITION = re.compile(r"^\s*(?:#\s*)?(Note \[[^\]]+\])\s*$")
ROW = re.compile(r"^\|\s*(Note \[[^\]]+\])\s*\|\s*(\S+)\s*\|$")


def defined_notes() -> dict[str, str]:
    found = {}
    for folder in ("ringcc", "passes", "runtime", "benchmarks"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for line in path.read_text().splitlines():
                m = DEFINITION.match(line)
                if m:
                    found[m.group(1)] = path.relative_to(ROOT).as_posix()
    return found


def test_notes_index_lists_every_note_where_it_is_defined():
    code = defined_notes()
    assert "Note [Ring attention schedule]" in code  # the scan sees both comment and docstring Notes
    assert "Note [Memory plan]" in code
    index = dict(m.groups() for line in (ROOT / "docs" / "notes.md").read_text().splitlines()
                 if (m := ROW.match(line)))
    assert index == code
