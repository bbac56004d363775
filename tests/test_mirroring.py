"""Tests mirror the parts (issue 42): every module of the package is named by a test file.

A test file (``tests/**/test_*.py``) names the module ``detdata/<layer>/<name>.py`` when

* its path mirrors it: ``tests/<layer>/test_<name>.py``, or ``test_<layer>_<name>.py`` as
  tests/cli's files are named (``detdata/<layer>/<pkg>/<name>.py``: under
  ``tests/<layer>/<pkg>/`` or as ``tests/<layer>/test_<pkg>_<name>.py``);
* it imports it (``import detdata.x.y``, ``from detdata.x.y import ...``,
  ``from detdata.x import y``);
* or its module docstring says what it covers beyond that, in a paragraph starting
  ``Covers:`` that lists the files (``Covers: detdata/x/y.py, detdata/x/z.py.``), for a test
  that exercises a module through the public surface or the console command.

A package ``__init__.py`` that holds only its docstring has nothing to test. A ``Covers:``
line must name files that exist, so a module renamed or deleted is named again where it went.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "detdata"
TESTS = ROOT / "tests"
COVERS = re.compile(r"^Covers:(.*?)(?:\n\s*\n|\Z)", re.M | re.S)
PATH = re.compile(r"detdata/[\w/]+\.py")


def module_name(path: Path) -> str:
    """``detdata/x/y.py`` -> ``detdata.x.y``; ``detdata/x/__init__.py`` -> ``detdata.x``."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def has_code(path: Path) -> bool:
    """Whether the module holds more than a docstring and ``from __future__`` imports."""
    body = ast.parse(path.read_text(encoding="utf-8")).body
    return any(
        not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))
        and not (isinstance(n, ast.ImportFrom) and n.module == "__future__")
        for n in body
    )


def package_modules() -> dict[str, Path]:
    """Every module of the package that holds code, by dotted name."""
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py")) if has_code(p)}


def mirrored(test: Path) -> set[str]:
    """The modules ``test``'s path mirrors: ``tests/<folders>/test_<stem>.py`` names
    ``detdata.<folders>.<stem>``, and for each cut of ``<stem>`` into ``<head>_<tail>``,
    ``detdata.<folders>.<tail>`` when ``<head>`` is the last folder (test_cli_env under
    tests/cli) and ``detdata.<folders>.<head>.<tail>`` (a subpackage's module)."""
    rel = test.relative_to(TESTS).with_suffix("")
    folders, words = list(rel.parts[:-1]), rel.name.removeprefix("test_").split("_")
    names = {".".join(["detdata", *folders, "_".join(words)])}
    for cut in range(1, len(words)):
        head, tail = "_".join(words[:cut]), "_".join(words[cut:])
        if folders and head == folders[-1]:
            names.add(".".join(["detdata", *folders, tail]))
        names.add(".".join(["detdata", *folders, head, tail]))
    return names


def imported(tree: ast.Module) -> set[str]:
    """Every dotted name ``tree`` imports, and ``module.name`` for each ``from`` import."""
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out.update(f"{node.module}.{alias.name}" for alias in node.names)
    return out


def covered(tree: ast.Module) -> list[str]:
    """The files the docstring's ``Covers:`` paragraphs list."""
    doc = ast.get_docstring(tree) or ""
    return [path for block in COVERS.findall(doc) for path in PATH.findall(block)]


def naming() -> tuple[dict[str, list[str]], list[str]]:
    """Module -> the test files that name it; and ``Covers:`` entries naming no file."""
    modules = package_modules()
    named: dict[str, list[str]] = {name: [] for name in modules}
    stale = []
    for test in sorted(TESTS.rglob("test_*.py")):
        tree = ast.parse(test.read_text(encoding="utf-8"))
        rel = str(test.relative_to(ROOT))
        names = mirrored(test) | imported(tree)
        for path in covered(tree):
            if not (ROOT / path).is_file():
                stale.append(f"{rel}: Covers: {path}")
            names.add(module_name(ROOT / path))
        for name in names & named.keys():
            named[name].append(rel)
    return named, stale


def test_every_module_is_named_by_a_test_file() -> None:
    named, _ = naming()
    unnamed = sorted(
        str(package_modules()[m].relative_to(ROOT)) for m, by in named.items() if not by
    )
    assert unnamed == [], (
        "modules no test file names (add tests/<layer>/test_<name>.py, or a 'Covers:' line in "
        "the docstring of the test file that exercises it):\n" + "\n".join(unnamed)
    )


def test_every_covers_line_names_a_file_of_the_package() -> None:
    _, stale = naming()
    assert stale == [], "Covers: lines naming no file (moved or deleted?):\n" + "\n".join(stale)


def test_the_rules_see_paths_imports_and_covers_lines(tmp_path: Path) -> None:
    """The three ways a test names a module, on examples (and what does not name one)."""
    assert mirrored(TESTS / "cli" / "test_cli_env.py") >= {"detdata.cli.env"}
    assert mirrored(TESTS / "loading" / "test_trace_diff.py") >= {"detdata.loading.trace.diff"}
    assert "detdata.order.rng" in mirrored(TESTS / "order" / "test_rng.py")
    tree = ast.parse(
        '"""Doc.\n\nCovers: detdata/a/b.py,\n  detdata/a/c.py.\n\nNot detdata/a/d.py."""\n'
        "import detdata.x.y\nfrom detdata.p import q\nfrom detdata import Thing\n"
    )
    assert covered(tree) == ["detdata/a/b.py", "detdata/a/c.py"]
    assert {"detdata.x.y", "detdata.p.q", "detdata.Thing"} <= imported(tree)
    empty = tmp_path / "__init__.py"
    empty.write_text('"""Only a docstring."""\n\nfrom __future__ import annotations\n')
    assert not has_code(empty)
    empty.write_text('"""Doc."""\nVERSION = "1"\n')
    assert has_code(empty)
