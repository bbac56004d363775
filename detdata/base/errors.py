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

from detdata.base.redact import redact_args


class DetdataError(Exception):
    """Root of every error detdata raises on purpose; its text is redacted when it is made
    (`detdata.base.redact`), so no message of any layer can carry a secret."""

    def __init__(self, *args: object) -> None:
        super().__init__(*redact_args(args))


class ConfigError(DetdataError, ValueError):
    """An argument or configuration value is invalid (bad weights, batch sizes, seeds...)."""


class CapabilityError(ConfigError, TypeError):
    """A call needs a capability (`detdata.datasets.capabilities`) that the stream or dataset
    given does not declare: names it (``capability``), the type lacking it (``kind``), a hint."""

    def __init__(self, message: str, *, capability: str = "", kind: str = "") -> None:
        super().__init__(message)
        self.capability = capability
        self.kind = kind


class ManifestError(DetdataError, ValueError):
    """A manifest is malformed, unsafe, of an unknown version, or its id does not match."""


class VerificationError(DetdataError, ValueError):
    """Shard bytes on storage do not match the manifest (size, quick digest or blake3)."""

    def __init__(
        self,
        message: str,
        *,
        shard: str = "",
        field: str = "",
        expected: object = None,
        found: object = None,
    ) -> None:
        super().__init__(message)
        self.shard = shard
        self.field = field
        self.expected = expected
        self.found = found


class FormatError(DetdataError, ValueError):
    """A shard's content does not fit its declared format (dtype, schema, shape)."""


class RegistryError(DetdataError, ValueError):
    """A registry name is unknown, malformed, or would be re-pointed without `force`."""


class StateError(DetdataError, ValueError):
    """A loader state is malformed or does not match the loader it is loaded into."""

    def __init__(self, message: str, *, fields: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.fields = fields


class StorageError(DetdataError, OSError):
    """Reading or writing storage failed after retries (names the shard and URL)."""


class RetriesExhausted(StorageError):
    """A storage read kept failing until its deadline (or a permanent error after retries)."""

    def __init__(
        self,
        message: str,
        *,
        shard: str = "",
        url: str = "",
        attempts: int = 0,
        last_error: BaseException | None = None,
    ) -> None:
        super().__init__(message)
        self.shard = shard
        self.url = url
        self.attempts = attempts
        self.last_error = last_error


class ShortRead(StorageError):
    """A read returned fewer (or more) bytes than asked for: transient, retried."""


class StaleIteratorError(DetdataError, RuntimeError):
    """An iterator of a `DataLoader` was superseded (a second ``iter()``, a
    ``load_state_dict``) and was asked for another batch: it raises instead of ending
    quietly, so a training loop never finishes early and reports success."""


class DependencyError(DetdataError, ImportError):
    """An optional or lazily imported package is missing or cannot load (names it, and the
    ``pip install`` that fixes it)."""
