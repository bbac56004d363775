"""The exception tree. Every error detdata raises on purpose derives from `DetdataError`::

    DetdataError
    ├── ConfigError (ValueError)              a setting or argument is wrong; names it
    │   └── CapabilityError (TypeError)       a stream lacks what the caller needs
    ├── ManifestError (ValueError)            a manifest (JSON or fast form) is malformed
    ├── VerificationError (ValueError)        stored bytes are not the manifest's
    ├── FormatError (ValueError)              a shard's format contradicts its declaration
    ├── RegistryError (ValueError)            a registry name or entry is wrong
    ├── StateError (ValueError)               a saved state is refused at a resume
    ├── StorageError (OSError)                storage failed (after retries); names shard, URL
    │   ├── RetriesExhausted                  kept failing until its deadline
    │   └── ShortRead                         fewer or more bytes than asked (retried)
    ├── StaleIteratorError (RuntimeError)     an iterator superseded by a newer one
    └── DependencyError (ImportError)         an optional package is missing; names the extra

Each also derives from the built-in that fits (callers catching `ValueError` / `OSError`
keep working). Every class can be made from its message alone (keyword attributes have
defaults) and pickles with its attributes, so it survives where exceptions are re-made from
type and text (torch's DataLoader workers call ``type(message)``, multiprocessing).
"""

from __future__ import annotations

import typing

from detdata.base.redact import redact_args


class DetdataError(Exception):
    """Root of every error detdata raises on purpose; its text is redacted when it is made
    (`detdata.base.redact`), so no message of any layer can carry a secret. Keyword arguments
    set the attributes a subclass declares (with their defaults); any other is a TypeError."""

    def __init__(self, *args: object, **attributes: object) -> None:
        super().__init__(*redact_args(args))
        for name, value in attributes.items():
            if name not in typing.get_type_hints(type(self)):
                raise TypeError(f"{type(self).__name__}() got an unexpected keyword {name!r}")
            setattr(self, name, value)


class ConfigError(DetdataError, ValueError):
    """An argument or configuration value is invalid (bad weights, batch sizes, seeds...)."""


class CapabilityError(ConfigError, TypeError):
    """A call needs a capability (`detdata.datasets.capabilities`) that the stream or dataset
    given does not declare: names it (``capability``), the type lacking it (``kind``), a hint."""

    capability: str = ""
    kind: str = ""


class ManifestError(DetdataError, ValueError):
    """A manifest is malformed, unsafe, of an unknown version, or its id does not match."""


class VerificationError(DetdataError, ValueError):
    """Shard bytes on storage do not match the manifest (size, quick digest or blake3)."""

    shard: str = ""
    field: str = ""
    expected: object = None
    found: object = None


class FormatError(DetdataError, ValueError):
    """A shard's content does not fit its declared format (dtype, schema, shape)."""


class RegistryError(DetdataError, ValueError):
    """A registry name is unknown, malformed, or would be re-pointed without `force`."""


class StateError(DetdataError, ValueError):
    """A loader state is malformed or does not match the loader it is loaded into."""

    fields: tuple[str, ...] = ()


class StorageError(DetdataError, OSError):
    """Reading or writing storage failed after retries (names the shard and URL)."""


class RetriesExhausted(StorageError):
    """A storage read kept failing until its deadline (or a permanent error after retries)."""

    shard: str = ""
    url: str = ""
    attempts: int = 0
    last_error: BaseException | None = None


class ShortRead(StorageError):
    """A read returned fewer (or more) bytes than asked for: transient, retried."""


class StaleIteratorError(DetdataError, RuntimeError):
    """An iterator of a `DataLoader` was superseded (a second ``iter()``, a
    ``load_state_dict``) and was asked for another batch: it raises instead of ending
    quietly, so a training loop never finishes early and reports success."""


class DependencyError(DetdataError, ImportError):
    """An optional or lazily imported package is missing or cannot load (names it, and the
    ``pip install`` that fixes it)."""
