"""The documents cite tests that exist: every ``tests/x.py::name`` in docs/ and README names a real
test."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CITE = re.compile(r"(tests/[\w/]+\.py)::(\w+)")


def test_every_cited_test_exists() -> None:
    cited = sorted(
        {(doc.name, m.group(1), m.group(2)) for doc in DOCS for m in CITE.finditer(doc.read_text())}
    )
    assert len(cited) >= 50  # guarantees.md's promise -> test table alone cites more
    missing = []
    for doc, path, name in cited:
        source = ROOT / path
        if not source.exists() or not re.search(rf"^def {name}\(", source.read_text(), re.M):
            missing.append(f"{doc} cites {path}::{name}")
    assert missing == [], "documents cite tests that do not exist:\n" + "\n".join(missing)
