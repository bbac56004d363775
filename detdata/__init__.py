"""detdata: exactly reproducible, resumable data loading for LLM pretraining.

Bytes identity (blake3 manifests), order as a function of (seed, global index),
exact seeded mixtures, and one-integer resume. See DESIGN.md for the contracts.
"""

from typing import TYPE_CHECKING, Any

from detdata._dataset import ArrayDataset, Batch, Dataset, OrderedStream, Stream
from detdata._errors import (
    ConfigError,
    DetdataError,
    FormatError,
    ManifestError,
    RegistryError,
    StateError,
    StorageError,
    VerificationError,
)
from detdata._formats import Format
from detdata._manifest import Manifest, ShardEntry, Verify, build_manifest, hash_files
from detdata._mixture import Mixture
from detdata._order import GlobalOrder
from detdata._registry import RefEvent, Registry
from detdata._state import Stateful
from detdata._tables import TableRows
from detdata._tokens import TokenWindows

__version__ = "0.1.0"

# torch is imported only when the loader is first used (the CLI and manifest tools stay fast).
_LAZY = {"DataLoader": "detdata._loader", "DeterministicBatchSampler": "detdata._sampler"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'detdata' has no attribute {name!r}")


if TYPE_CHECKING:
    from detdata._loader import DataLoader
    from detdata._sampler import DeterministicBatchSampler

__all__ = [
    "ArrayDataset",
    "Batch",
    "ConfigError",
    "DataLoader",
    "Dataset",
    "DetdataError",
    "DeterministicBatchSampler",
    "Format",
    "FormatError",
    "GlobalOrder",
    "Manifest",
    "ManifestError",
    "Mixture",
    "OrderedStream",
    "RefEvent",
    "Registry",
    "RegistryError",
    "ShardEntry",
    "StateError",
    "Stateful",
    "StorageError",
    "Stream",
    "TableRows",
    "TokenWindows",
    "VerificationError",
    "Verify",
    "__version__",
    "build_manifest",
    "hash_files",
]
