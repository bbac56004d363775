"""Only the name ``to_tensor``: calling it is an error (see the package docstring)."""

from __future__ import annotations

from typing import Any


def to_tensor(*args: Any, **kwargs: Any) -> Any:
    raise ImportError("torchvision is a stub in the peers' environment")
