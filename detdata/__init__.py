"""detdata: exactly reproducible, resumable data loading for LLM pretraining.

Bytes identity (blake3 manifests), order as a function of (seed, global index),
exact seeded mixtures, and one-integer resume. See DESIGN.md for the contracts.
"""

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
from detdata._loader import DataLoader
from detdata._manifest import Manifest, ShardEntry, Verify, build_manifest, hash_files
from detdata._mixture import Mixture
from detdata._order import GlobalOrder
from detdata._registry import Registry
from detdata._sampler import DeterministicBatchSampler
from detdata._state import Stateful
from detdata._tables import TableRows
from detdata._tokens import TokenWindows

__version__ = "0.1.0"

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
