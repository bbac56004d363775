"""The package's shape (docs/design.md section 9), measured by `scripts/shape.py`: no module
over 700 lines, no import cycle (lazy and ``TYPE_CHECKING`` imports counted), the central
objects at most 600 lines and 40 methods over their in-package MRO, and no concrete class
inheriting another concrete detdata class."""

from __future__ import annotations

import ast
import importlib.util
import pathlib
import sys
from types import ModuleType

ROOT = pathlib.Path(__file__).resolve().parents[1]

#: A framework's own extension point: HF's ``Trainer`` is extended by subclassing, so the
#: mixin a user puts in their own ``Trainer`` subclass is what `DetdataTrainer` is made of.
ALLOWED = {
    "detdata.integrations.transformers.DetdataTrainer"
    " < detdata.integrations.transformers.DetdataTrainerMixin"
}


def _shape() -> ModuleType:
    spec = importlib.util.spec_from_file_location("shape", ROOT / "scripts" / "shape.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["shape"] = module
    spec.loader.exec_module(module)
    return module


def test_the_package_keeps_its_shape() -> None:
    shape = _shape()
    measured = shape.measure()
    assert {m: n for m, n in measured.modules.items() if n > 700} == {}
    assert shape.cycles(measured) == []
    for name in shape.CENTRAL:
        lines, methods = shape.size_over_mro(measured, name)
        assert lines <= 600 and methods <= 40, (name, lines, methods)
    assert set(shape.concrete_inheritance(measured)) <= ALLOWED


def test_one_name_per_class_and_per_module() -> None:
    """A class name is defined once in the package (the native module's ``.pyi`` stub
    included), and a module basename is reused across layers only by ``cli/``, whose
    modules are named after their command (docs/architecture.md)."""
    classes: dict[str, list[str]] = {}
    bases: dict[str, list[str]] = {}
    for path in sorted(p for p in (ROOT / "detdata").rglob("*.py*") if p.suffix in (".py", ".pyi")):
        rel = path.relative_to(ROOT).as_posix()
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                classes.setdefault(node.name, []).append(rel)
        if path.suffix == ".py" and path.stem != "__init__" and "/cli/" not in rel:
            bases.setdefault(path.stem, []).append(rel)
    assert {n: p for n, p in classes.items() if len(p) > 1} == {}
    assert {n: p for n, p in bases.items() if len(p) > 1} == {}
