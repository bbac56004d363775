"""The package's shape, measured: module sizes, import cycles, the size of each class over
its in-package MRO, and concrete classes that inherit other concrete detdata classes.

    python scripts/shape.py            # a report
    python scripts/shape.py --json     # the same, as JSON

`tests/test_shape.py` holds the package to the limits in `docs/architecture.md` with these
same functions. A class's size is the sum, over every detdata class in its MRO (itself
included), of that class body's lines and of the functions it defines; Protocols,
exceptions, enums and abstract bases are counted where they are inherited but are not
themselves "concrete".
"""

from __future__ import annotations

import ast
import json
import pathlib
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "detdata"


@dataclass
class ClassInfo:
    """One class statement of the package."""

    module: str
    name: str
    lines: int
    methods: int
    bases: list[str]  # as written, resolved to "module.Name" where the name is imported
    kind: str  # "concrete", "protocol", "exception", "enum", "abstract", "typing"


@dataclass
class Shape:
    modules: dict[str, int] = field(default_factory=dict)  # module -> lines
    classes: dict[str, ClassInfo] = field(default_factory=dict)  # "module.Name" -> info
    imports: dict[str, set[str]] = field(default_factory=dict)  # module -> detdata modules


def module_name(path: pathlib.Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _resolve(name: str, module: str, aliases: dict[str, str]) -> str:
    head, _, rest = name.partition(".")
    if head in aliases:
        return aliases[head] + ("." + rest if rest else "")
    return f"{module}.{name}"


def _dotted(node: ast.expr) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    if isinstance(node, ast.Subscript):
        return _dotted(node.value)
    return "?"


def _kind(node: ast.ClassDef, bases: list[str]) -> str:
    joined = " ".join(bases)
    if "Protocol" in joined:
        return "protocol"
    if "Error" in node.name or "Exception" in joined or "Error" in joined or "Warning" in joined:
        return "exception"
    if "Enum" in joined:
        return "enum"
    if "NamedTuple" in joined or "TypedDict" in joined:
        return "typing"
    if "ABC" in joined or any(
        _dotted(d).endswith("abstractmethod")
        for f in node.body
        if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
        for d in f.decorator_list
    ):
        return "abstract"
    return "concrete"


def _walk_imports(tree: ast.Module) -> Iterator[tuple[str, str | None]]:
    """(module, imported name or None) for every detdata import, TYPE_CHECKING ones too."""
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("detdata"):
            for alias in node.names:
                yield node.module, alias.name
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("detdata"):
                    yield alias.name, None


def measure() -> Shape:
    shape = Shape()
    paths = sorted(PACKAGE.rglob("*.py"))
    modules = {module_name(p) for p in paths}
    for path in paths:
        module = module_name(path)
        source = path.read_text(encoding="utf-8")
        shape.modules[module] = source.count("\n")
        tree = ast.parse(source)
        aliases: dict[str, str] = {}
        deps: set[str] = set()
        for target, name in _walk_imports(tree):
            if name is not None and f"{target}.{name}" in modules:
                deps.add(f"{target}.{name}")  # a submodule imported by name
                aliases[name] = f"{target}.{name}"
            else:
                deps.add(target)
                if name is not None:
                    aliases[name] = f"{target}.{name}"
        shape.imports[module] = {d for d in deps if d in modules and d != module}
        for node in ast.walk(tree):
            if not isinstance(node, ast.ClassDef):
                continue
            bases = [_resolve(_dotted(b), module, aliases) for b in node.bases]
            end = node.end_lineno or node.lineno
            methods = sum(isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)) for f in node.body)
            shape.classes[f"{module}.{node.name}"] = ClassInfo(
                module, node.name, end - node.lineno + 1, methods, bases, _kind(node, bases)
            )
    return shape


def _exported(shape: Shape, qualified: str) -> str:
    """The defining class of a name imported through a package's ``__init__``."""
    if qualified in shape.classes:
        return qualified
    module, _, name = qualified.rpartition(".")
    for dep in shape.imports.get(module, ()):
        if f"{dep}.{name}" in shape.classes:
            return f"{dep}.{name}"
    return qualified


def mro(shape: Shape, qualified: str) -> list[str]:
    """The in-package classes ``qualified`` inherits (itself first), depth first."""
    seen: list[str] = []
    todo = [qualified]
    while todo:
        name = _exported(shape, todo.pop(0))
        if name in shape.classes and name not in seen:
            seen.append(name)
            todo.extend(shape.classes[name].bases)
    return seen


def size_over_mro(shape: Shape, qualified: str) -> tuple[int, int]:
    """(lines, methods) of ``qualified`` summed over its in-package MRO."""
    names = mro(shape, qualified)
    return (
        sum(shape.classes[n].lines for n in names),
        sum(shape.classes[n].methods for n in names),
    )


def concrete_inheritance(shape: Shape) -> list[str]:
    """``"Child < Parent"`` for each concrete class with a concrete in-package base."""
    found = []
    for name, info in sorted(shape.classes.items()):
        if info.kind != "concrete":
            continue
        for base in info.bases:
            base = _exported(shape, base)
            if base in shape.classes and shape.classes[base].kind == "concrete":
                found.append(f"{name} < {base}")
    return found


def cycles(shape: Shape) -> list[list[str]]:
    """Strongly connected groups of modules (more than one module) in the import graph,
    counting every import (lazy and ``TYPE_CHECKING`` ones too)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(shape.imports.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    sys.setrecursionlimit(10_000)
    for v in sorted(shape.imports):
        if v not in index:
            visit(v)
    return out


CENTRAL = (
    "detdata.loading.loader.DataLoader",
    "detdata.datasets.tokens.TokenWindows",
    "detdata.datasets.tables.TableRows",
    "detdata.datasets.documents.Documents",
)


def report(shape: Shape) -> dict[str, object]:
    largest = sorted(shape.modules.items(), key=lambda kv: -kv[1])[:5]
    central = {}
    for name in CENTRAL:
        if name in shape.classes:
            lines, methods = size_over_mro(shape, name)
            central[name] = {"mro": mro(shape, name), "lines": lines, "methods": methods}
    return {
        "package_lines": sum(shape.modules.values()),
        "modules": len(shape.modules),
        "largest_modules": largest,
        "central": central,
        "import_cycles": cycles(shape),
        "concrete_inheritance": concrete_inheritance(shape),
    }


def main() -> None:
    found = report(measure())
    if "--json" in sys.argv:
        print(json.dumps(found, indent=1))
        return
    print(f"package: {found['package_lines']} lines in {found['modules']} modules")
    print("largest modules:", ", ".join(f"{m} {n}" for m, n in found["largest_modules"]))  # type: ignore[attr-defined]
    for name, info in found["central"].items():  # type: ignore[attr-defined]
        print(f"{name}: {info['lines']} lines, {info['methods']} methods over {info['mro']}")
    print("import cycles:", found["import_cycles"])
    print("concrete < concrete:")
    for row in found["concrete_inheritance"]:  # type: ignore[attr-defined]
        print("  ", row)


if __name__ == "__main__":
    main()
