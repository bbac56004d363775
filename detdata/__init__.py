"""detdata: exactly reproducible, resumable data loading for LLM pretraining.

Contracts: docs/design.md; this surface: docs/api.md (tests/test_layers.py checks the two
agree). Exported classes and functions show as ``detdata.<name>`` (in ``repr``, tracebacks
and pickles); their code lives in the layer folders (docs/architecture.md).
"""

import types as _types
import typing as _typing

from detdata.base.errors import (
    CapabilityError,
    ConfigError,
    DetdataError,
    FormatError,
    ManifestError,
    RegistryError,
    RetriesExhausted,
    StaleIteratorError,
    StateError,
    StorageError,
    VerificationError,
)
from detdata.base.types import Batch
from detdata.base.version import VERSION as _VERSION
from detdata.datasets.base import ArrayDataset, Dataset, Stream
from detdata.datasets.documents import Documents
from detdata.datasets.exclusions import Excluded, ExclusionList
from detdata.datasets.handles import set_max_open_shards
from detdata.datasets.mixture import Mixture
from detdata.datasets.packed import PackedWindows
from detdata.datasets.shard_storage import Storage
from detdata.datasets.split import Split, SplitKey
from detdata.datasets.streams import OrderedStream
from detdata.datasets.tables import TableRows
from detdata.datasets.text import TextDocuments, text_metadata
from detdata.datasets.tokens import TokenWindows
from detdata.identity.build import build_manifest, hash_files
from detdata.identity.entry import ShardEntry, Verify
from detdata.identity.formats import Format
from detdata.identity.manifest import Manifest
from detdata.identity.registry import RefEvent, Registry
from detdata.identity.tokenizer import TextTokenizer
from detdata.integrations.watch import WATCHER as _imported_frameworks
from detdata.loading.arguments import WorkerMode
from detdata.loading.frameworks import add_watcher as _add_watcher
from detdata.loading.options import DeviceFeed, LoaderOptions, ReadOptions, ResumePolicy
from detdata.loading.record import RunRecord
from detdata.loading.state import Stateful
from detdata.loading.steps import MidStep
from detdata.order.batches import BatchSchedule
from detdata.order.choice import LocalityOrder, Order
from detdata.order.feistel import GlobalOrder
from detdata.order.locality import WindowedOrder
from detdata.storage.reads import NATIVE as NATIVE_READS
from detdata.storage.retry import RetryPolicy

__version__ = _VERSION

# framework watches (accelerate's load_state): started now for the frameworks imported before
# detdata, and when a loader or sampler is built for those imported by then; importing detdata
# imports no framework
_add_watcher(_imported_frameworks)
_imported_frameworks.built()

# torch is imported only when the loader is first used (the CLI and manifest tools stay fast).
_LAZY = {
    "DataLoader": "detdata.loading.loader",
    "DeterministicBatchSampler": "detdata.loading.sampler",
    "MixtureController": "detdata.loading.reweighting",
    "report_model_step": "detdata.loading.model_digest",
}


def _public(value: object, name: str) -> object:
    """``value`` shown (and pickled by reference) as ``detdata.<name>`` (not aliases)."""
    if isinstance(value, (type, _types.FunctionType)) and value.__name__ == name:
        value.__module__ = __name__
    return value


def __getattr__(name: str) -> _typing.Any:
    if name in _LAZY:
        import importlib

        value = _public(getattr(importlib.import_module(_LAZY[name]), name), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'detdata' has no attribute {name!r}")


if _typing.TYPE_CHECKING:
    from detdata.loading.loader import DataLoader
    from detdata.loading.model_digest import report_model_step
    from detdata.loading.reweighting import MixtureController
    from detdata.loading.sampler import DeterministicBatchSampler

#: the public names (docs/api.md documents each; tests/test_layers.py checks the two agree)
__all__ = [
    "ArrayDataset",
    "Batch",
    "BatchSchedule",
    "CapabilityError",
    "ConfigError",
    "DataLoader",
    "Dataset",
    "DetdataError",
    "DeterministicBatchSampler",
    "DeviceFeed",
    "Documents",
    "Excluded",
    "ExclusionList",
    "Format",
    "FormatError",
    "GlobalOrder",
    "LoaderOptions",
    "LocalityOrder",
    "Manifest",
    "ManifestError",
    "MidStep",
    "Mixture",
    "MixtureController",
    "NATIVE_READS",
    "Order",
    "OrderedStream",
    "PackedWindows",
    "ReadOptions",
    "RefEvent",
    "Registry",
    "RegistryError",
    "ResumePolicy",
    "RetriesExhausted",
    "RetryPolicy",
    "RunRecord",
    "ShardEntry",
    "Split",
    "SplitKey",
    "StaleIteratorError",
    "StateError",
    "Stateful",
    "Storage",
    "StorageError",
    "Stream",
    "TableRows",
    "TextDocuments",
    "TextTokenizer",
    "TokenWindows",
    "VerificationError",
    "Verify",
    "WindowedOrder",
    "WorkerMode",
    "__version__",
    "build_manifest",
    "hash_files",
    "report_model_step",
    "set_max_open_shards",
    "text_metadata",
]
for _name in __all__:
    if _name in globals():  # the lazy ones: when first loaded (`__getattr__`)
        _public(globals()[_name], _name)
del _name
