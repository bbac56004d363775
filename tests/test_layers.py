"""The package's layers: each folder imports only from the layers below it, and the public
surface is pinned.

Every ``import`` of a detdata module anywhere in a module (top level or inside a
function: a lazy import is still a dependency) is checked against the layer table.
"""

from __future__ import annotations

import ast
import pathlib
import pickle
import re
import types

import detdata

PACKAGE = pathlib.Path(detdata.__file__).resolve().parent

#: layer of each folder; a module may import its own layer and the layers listed for it
LAYERS = ("base", "storage", "identity", "order", "datasets", "loading", "integrations", "cli")
#: pure layers import less than "everything below"
ALLOWED = {
    "base": {"base"},
    "storage": {"base", "storage"},
    "identity": {"base", "storage", "identity"},
    "order": {"base", "order"},  # pure functions: no storage, no identity, no datasets
    "datasets": {"base", "storage", "identity", "order", "datasets"},
    "loading": {"base", "storage", "identity", "order", "datasets", "loading"},
    "integrations": {"base", "storage", "identity", "order", "datasets", "loading", "integrations"},
    "cli": set(LAYERS) | {"detdata"},  # the CLI may use the public surface too
}


def _imports(path: pathlib.Path) -> list[tuple[int, str]]:
    """(line, absolute detdata module) for every import in ``path``."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.lineno, node.module))
        elif isinstance(node, ast.Import):
            out.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level:
            raise AssertionError(
                f"{path}:{node.lineno}: relative import; use absolute detdata.* imports"
            )
    return [(line, mod) for line, mod in out if mod == "detdata" or mod.startswith("detdata.")]


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in LAYERS else "detdata"


def test_every_module_lives_in_a_layer_folder() -> None:
    loose = sorted(
        p.name for p in PACKAGE.glob("*.py") if p.name not in ("__init__.py", "__main__.py")
    )
    assert loose == [], f"modules outside the layer folders: {loose}"
    folders = sorted(p.name for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__")
    assert set(folders) <= set(LAYERS), folders


def test_no_layer_imports_a_layer_above_it() -> None:
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        if len(rel.parts) == 1:
            continue  # detdata/__init__.py: the public surface imports every layer
        layer = rel.parts[0]
        for line, module in _imports(path):
            target = _layer(module)
            if target not in ALLOWED[layer]:
                bad.append(f"detdata/{rel}:{line} ({layer}) imports {module} ({target})")
    assert bad == [], "upward imports:\n" + "\n".join(bad)


def _runtime_imports(tree: ast.Module) -> set[str]:
    """detdata modules imported anywhere in ``tree`` (inside functions too: a lazy import
    is still a dependency), except under ``if TYPE_CHECKING:`` (never run)."""
    skip = {
        id(n)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and ast.unparse(node.test).endswith("TYPE_CHECKING")
        for stmt in node.body
        for n in ast.walk(stmt)
    }
    deps: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.ImportFrom) and node.module:
            deps.add(node.module)
        elif isinstance(node, ast.Import):
            deps |= {a.name for a in node.names}
    return {m for m in deps if m.startswith("detdata.")}


def test_no_import_cycle_between_modules() -> None:
    graph: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE).with_suffix("")
        name = ".".join(("detdata", *rel.parts)).removesuffix(".__init__")
        graph[name] = _runtime_imports(ast.parse(path.read_text(encoding="utf-8")))
    seen: dict[str, int] = {}

    def visit(node: str, stack: list[str]) -> None:
        seen[node] = 1
        for dep in graph.get(node, ()):
            if seen.get(dep) == 1:
                raise AssertionError("import cycle: " + " -> ".join([*stack, node, dep]))
            if dep not in seen:
                visit(dep, [*stack, node])
        seen[node] = 2

    for module in sorted(graph):
        if module not in seen:
            visit(module, [])


def _documented_surface() -> list[str]:
    """The names of docs/api.md's bullets (``- `name`: ...``): the one pinned list."""
    text = (PACKAGE.parent / "docs" / "api.md").read_text(encoding="utf-8")
    return [m.group(1) for m in re.finditer(r"^- `([A-Za-z_][A-Za-z0-9_]*)`:", text, re.M)]


def test_public_surface_is_the_documented_one_sorted_and_importable() -> None:
    documented = _documented_surface()
    assert len(documented) == len(set(documented)), "a name is documented twice"
    assert detdata.__all__ == sorted(detdata.__all__)
    assert set(detdata.__all__) == set(documented), (
        f"exported, not in docs/api.md: {sorted(set(detdata.__all__) - set(documented))}; "
        f"in docs/api.md, not exported: {sorted(set(documented) - set(detdata.__all__))}"
    )
    for name in detdata.__all__:
        assert getattr(detdata, name) is not None


def test_nothing_but_the_surface_and_the_layers_is_public_in_the_namespace() -> None:
    public = {n for n in vars(detdata) if not n.startswith("_")}
    modules = {n for n in public if isinstance(getattr(detdata, n), types.ModuleType)}
    assert modules <= set(LAYERS), modules  # the layer packages, bound by their imports
    assert public - modules <= set(detdata.__all__), public - modules - set(detdata.__all__)


def test_exports_show_as_detdata_and_pickle_by_that_name() -> None:
    for name in detdata.__all__:
        value = getattr(detdata, name)
        if isinstance(value, (type, types.FunctionType)):
            assert value.__module__ == "detdata" and value.__qualname__ == name, name
            assert pickle.loads(pickle.dumps(value)) is value, name
    error = pickle.loads(pickle.dumps(detdata.StateError("x")))
    assert type(error) is detdata.StateError and "detdata.StateError" in repr(type(error))


def test_errors_subclass_the_root_and_a_builtin() -> None:
    for name in (
        "ConfigError",
        "FormatError",
        "ManifestError",
        "RegistryError",
        "StateError",
        "StorageError",
        "VerificationError",
        "RetriesExhausted",
    ):
        cls = getattr(detdata, name)
        assert issubclass(cls, detdata.DetdataError), name
        assert any(issubclass(cls, b) for b in (ValueError, OSError, RuntimeError, TimeoutError)), (
            name
        )


def _torch_imports(path: pathlib.Path) -> tuple[list[int], list[int]]:
    """(lines importing torch at module level, lines importing it inside a function)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    top = {id(n) for n in tree.body}
    outer, inner = [], []
    for node in ast.walk(tree):
        names = (
            [a.name for a in node.names]
            if isinstance(node, ast.Import)
            else [node.module or ""]
            if isinstance(node, ast.ImportFrom)
            else []
        )
        if any(n == "torch" or n.startswith("torch.") for n in names):
            (outer if id(node) in top else inner).append(node.lineno)
    return outer, inner


def test_torch_stays_out_of_the_pure_layers() -> None:
    """base/ and order/ never import torch; storage/, identity/ and datasets/ only lazily
    (the CLI's manifest tools and a dataset built without a loader start without it)."""
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        if len(rel.parts) == 1:
            continue
        outer, inner = _torch_imports(path)
        if rel.parts[0] in ("base", "order") and (outer or inner):
            bad.append(f"detdata/{rel}:{(outer + inner)[0]} imports torch")
        if rel.parts[0] in ("storage", "identity", "datasets") and outer:
            bad.append(f"detdata/{rel}:{outer[0]} imports torch at module level")
    assert bad == [], bad
