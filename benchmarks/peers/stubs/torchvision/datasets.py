"""Only the name ``VisionDataset``: using it is an error (see the package docstring)."""

from __future__ import annotations

from typing import Any


class VisionDataset:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise ImportError("torchvision is a stub in the peers' environment")


class CIFAR10(VisionDataset):
    pass
