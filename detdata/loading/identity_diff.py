"""Where two stream identities differ: the first differing field, named by its path (for
example ``stream.documents.tokenizer.model_b3``), so a refused resume says what changed.
Values are shown redacted (`detdata.base.redact.redact_value`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from detdata.base.redact import redact_value


def first_difference(saved: Any, current: Any, path: str = "stream") -> str | None:
    """``"PATH: saved X, current Y"`` for the first field where ``saved`` and ``current``
    differ, or None when they are equal. Depth first, the nested fields of a level (the
    inputs: a corpus, a tokenizer) before its plain values (often counts derived from
    them), each group in sorted order."""
    if isinstance(saved, Mapping) and isinstance(current, Mapping):
        keys = sorted(set(saved) | set(current), key=str)
        keys.sort(key=lambda k: not isinstance(saved.get(k), (Mapping, list)))
        for key in keys:
            if key not in saved or key not in current:
                return (
                    f"{path}.{key}: saved {_shown(saved.get(key))}, current "
                    f"{_shown(current.get(key))}"
                )
            found = first_difference(saved[key], current[key], f"{path}.{key}")
            if found is not None:
                return found
        return None
    if isinstance(saved, list) and isinstance(current, list) and len(saved) == len(current):
        for i, (a, b) in enumerate(zip(saved, current, strict=True)):
            found = first_difference(a, b, f"{path}[{i}]")
            if found is not None:
                return found
        return None
    if saved == current:
        return None
    return f"{path}: saved {_shown(saved)}, current {_shown(current)}"


def _shown(value: Any) -> str:
    text = repr(redact_value(value))
    return text if len(text) <= 120 else text[:117] + "..."
