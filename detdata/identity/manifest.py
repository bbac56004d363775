"""Content-addressed shard manifests: the model (docs/design.md section 1: the id, the
canonical order, untrusted documents). Building is `detdata.identity.build`, checking bytes
`detdata.identity.verify`. Roots are shown redacted and saved without credentials
(docs/design.md "Scale: identity and secrets").
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, cast

import numpy as np
import numpy.typing as npt

from detdata.base.canonical import canonical_json
from detdata.base.errors import ConfigError, ManifestError
from detdata.base.redact import redact_text, redact_url, strip_credentials
from detdata.identity.columns import (
    ColumnsFile,
    ShardTable,
    columns_path,
    encode_columns,
    read_json_head,
    string_codes,
)
from detdata.identity.entry import FORMAT_VERSION, KIND, STRENGTH, ShardEntry, Verify, parse_verify
from detdata.identity.formats import Format
from detdata.identity.manifest_id import manifest_id
from detdata.identity.node_copy import NodeSource, local_path, node_source
from detdata.identity.receipts import verify_job
from detdata.storage.fs import is_url, read_file_retrying, url_join
from detdata.storage.retry import RetryPolicy, check_policy

K_KIND: Final = "kind"
K_VERSION: Final = "format_version"
K_SHARDS: Final = "shards"
K_METADATA: Final = "metadata"
K_ID: Final = "id"
K_ROOT: Final = "root"
_VERIFIED: Final = "_detdata_verified"


@dataclass(frozen=True, kw_only=True, repr=False)
class Manifest:
    """An immutable, content-addressed list of shards under a root URL.

    It remembers the strongest verification that passed on it under its root
    (`verified_level`); a new object (`with_root`, `load`) starts unverified.
    ``shards`` is a tuple of entries or a `ShardTable` over the mapped fast form.
    """

    shards: Sequence[ShardEntry]
    metadata: Mapping[str, Any] = field(default_factory=dict)
    root: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.shards, ShardTable):  # written in canonical order, id in its header
            self.__dict__["id"] = self.shards.columns.header["id"]
            object.__setattr__(self, "metadata", _normalise_metadata(self.metadata))
            return
        if not isinstance(self.shards, tuple):
            object.__setattr__(self, "shards", tuple(self.shards))
        paths = [s.path for s in self.shards]
        if paths != sorted(paths):
            object.__setattr__(self, "shards", tuple(sorted(self.shards, key=lambda s: s.path)))
            paths.sort()
        dupes = sorted({p for p, q in itertools.pairwise(paths) if p == q})
        if dupes:
            raise ManifestError(
                f"duplicate shard paths in manifest: {dupes}; hint: each shard may be listed once"
            )
        object.__setattr__(self, "metadata", _normalise_metadata(self.metadata))

    def __getstate__(self) -> dict[str, Any]:
        """Pickled without the derived per-shard arrays (`_column`, `codes`: rebuilt, or
        mapped again, where used)."""
        return {k: v for k, v in self.__dict__.items() if not k.startswith(("_column_", "_codes_"))}

    def __repr__(self) -> str:
        root = None if self.root is None else redact_url(self.root)
        return (
            f"Manifest(id={self.id!r}, shards={len(self.shards)}, "
            f"num_samples={self.num_samples}, root={root!r})"
        )

    # identity -------------------------------------------------------------
    def body(self) -> dict[str, Any]:
        """The JSON object the id is computed over (no root, no id)."""
        return {
            K_KIND: KIND,
            K_VERSION: FORMAT_VERSION,
            K_SHARDS: [s.to_json() for s in self.shards],
            K_METADATA: dict(self.metadata),
        }

    @functools.cached_property
    def id(self) -> str:
        """``b3:<hex>`` of the canonical JSON body (`detdata.identity.manifest_id`)."""
        return manifest_id(self.metadata, self.shards)

    @property
    def num_samples(self) -> int:
        if isinstance(self.shards, ShardTable):
            return int(self.shards.columns.header["num_samples"])
        return int(self.samples_per_shard().sum())

    @property
    def total_bytes(self) -> int:
        if isinstance(self.shards, ShardTable):
            return int(self.shards.columns.header["total_bytes"])
        return int(self.bytes_per_shard().sum())

    def samples_per_shard(self) -> npt.NDArray[np.int64]:
        """``num_samples`` of every shard, in manifest order: a read-only int64 array."""
        return self._column("num_samples")

    def bytes_per_shard(self) -> npt.NDArray[np.int64]:
        """``bytes`` of every shard, in manifest order: a read-only int64 array."""
        return self._column("bytes")

    def data_offsets(self) -> npt.NDArray[np.int64]:
        """``data_offset`` of every shard (-1 where it has none): a read-only int64 array."""
        return self._column("data_offset")

    def row_groups_per_shard(self) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        """``(counts, sizes)``, read-only int64: ``sizes`` is every shard's ``row_groups``
        concatenated, ``counts`` how many of them are each shard's (-1: no ``row_groups``)."""
        found = self.__dict__.get("_column_row_groups")
        if found is None:
            if isinstance(self.shards, ShardTable):
                found = self.shards.row_group_columns()
            else:
                groups = [s.row_groups for s in self.shards]
                counts = np.fromiter(
                    (-1 if g is None else len(g) for g in groups), np.int64, len(groups)
                )
                sizes = np.fromiter((x for g in groups for x in g or ()), np.int64)
                found = (counts, sizes)
            for arr in found:
                arr.flags.writeable = False
            self.__dict__["_column_row_groups"] = found
        return cast(tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]], found)

    def codes(self, field: str) -> tuple[tuple[str, ...], npt.NDArray[np.int64]]:
        """``(values, codes)`` of string field ``field`` (``format``, ``dtype`` or ``schema``):
        the distinct values, sorted, and each shard's index into them (-1: none), a
        read-only integer array of any width (the fast form's mapped column)."""
        key = f"_codes_{field}"
        found = self.__dict__.get(key)
        if found is None:
            if isinstance(self.shards, ShardTable):
                columns = self.shards.columns
                values = tuple(columns.header[f"{field}s"])
                codes = columns.array(field)  # mapped, read-only: no per-rank copy
            else:
                raw = [getattr(s, field) for s in self.shards]
                names = [v.value if isinstance(v, Format) else v for v in raw]
                distinct, codes = string_codes(names, np.int64)
                values = tuple(distinct)
            codes.flags.writeable = False
            found = (values, codes)
            self.__dict__[key] = found
        return cast(tuple[tuple[str, ...], npt.NDArray[np.int64]], found)

    def _column(self, name: str) -> npt.NDArray[np.int64]:
        key = f"_column_{name}"
        arr = self.__dict__.get(key)
        if arr is None:
            if isinstance(self.shards, ShardTable):
                arr = self.shards.columns.array(name)
            else:
                values = (getattr(s, name) for s in self.shards)
                arr = np.fromiter((-1 if v is None else v for v in values), np.int64)
                arr.flags.writeable = False
            self.__dict__[key] = arr
        return cast(npt.NDArray[np.int64], arr)

    def with_root(self, root: str) -> Manifest:
        """The same manifest (same id) pointing at another root."""
        return Manifest(shards=self.shards, metadata=self.metadata, root=root)

    def shard_path(self, index: int) -> str:
        """Shard ``index``'s relative path, without building a fast form's entry."""
        if isinstance(self.shards, ShardTable):
            return self.shards.path(index)
        return self.shards[index].path

    def url(self, shard: ShardEntry) -> str:
        """Full URL/path of a shard under this manifest's root (percent-encoded for HTTP(S))."""
        if self.root is None:
            raise ConfigError(
                "this manifest has no root; pass root= to Manifest.load or use with_root()"
            )
        return url_join(self.root, shard.path)

    # persistence ------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        """The document as saved: body, id and the root without credentials."""
        doc = self.body()
        doc[K_ID] = self.id
        if self.root is not None:
            doc[K_ROOT] = strip_credentials(self.root)
        return doc

    def save(self, path: str, **storage_options: Any) -> str:
        """Write the manifest as JSON and its fast form (atomically on local disk); returns
        its id. The root is stored without credentials, relative to the file when the file
        is inside it. A manifest the loader would refuse is a `ManifestError`, nothing
        written."""
        from detdata.storage.atomic import atomic_write_bytes

        doc = self.to_json()
        if self.root is not None:
            doc[K_ROOT] = _portable_root(strip_credentials(self.root), path)
        self.check_loadable(where=redact_text(f"manifest to save at {path}"))
        data = json.dumps(doc, sort_keys=True, indent=1, ensure_ascii=False).encode() + b"\n"
        atomic_write_bytes(path, data, **storage_options)
        # the fast form after the JSON: a reader in between sees the new JSON's id differ
        # from the old columns' and parses the JSON
        atomic_write_bytes(columns_path(path), self.columns_bytes(data), **storage_options)
        return self.id

    def columns_bytes(self, json_doc: bytes) -> bytes:
        """This manifest's fast form (`detdata.identity.columns`) saved with its JSON
        document ``json_doc``, as `save` writes it."""
        return encode_columns(self.shards, self.metadata, self.id, json_doc)

    def check_loadable(self, *, where: str = "manifest") -> None:
        """`ManifestError` unless the loader accepts this manifest's document (writers call it)."""
        Manifest.from_json(self.to_json(), where=where)

    @classmethod
    def from_json(
        cls, doc: object, *, root: str | None = None, where: str = "manifest"
    ) -> Manifest:
        """Parse and validate a manifest document (no storage access)."""
        if not isinstance(doc, dict):
            raise ManifestError(f"{where}: expected a JSON object, found {type(doc).__name__}")
        if doc.get(K_KIND) != KIND:
            raise ManifestError(
                f"{where}: field 'kind' must be {KIND!r}, found {doc.get(K_KIND)!r}"
            )
        version = doc.get(K_VERSION)
        if version != FORMAT_VERSION:
            raise ManifestError(
                f"{where}: unknown format_version {version!r}; this detdata reads "
                f"version {FORMAT_VERSION}; hint: upgrade detdata"
            )
        unknown = sorted(set(doc) - {K_KIND, K_VERSION, K_SHARDS, K_METADATA, K_ID, K_ROOT})
        if unknown:
            raise ManifestError(f"{where}: unknown top-level fields {unknown}")
        shards, metadata, stored_root = document_fields(doc, where)
        manifest = cls(
            shards=shards, metadata=metadata, root=root if root is not None else stored_root
        )
        if [s.path for s in shards] != [s.path for s in manifest.shards]:
            raise ManifestError(f"{where}: shards are not sorted by path (canonical order)")
        claimed = doc.get(K_ID)
        if K_ID in doc and not isinstance(claimed, str):
            raise ManifestError(
                f"{where}: field 'id' must be a string 'b3:<64 hex>' (or absent), "
                f"found {claimed!r:.80}; the manifest was edited or corrupted"
            )
        if claimed is not None and claimed != manifest.id:
            raise ManifestError(
                f"{where}: id mismatch: the file says {claimed} but its content "
                f"hashes to {manifest.id}; the manifest was edited or corrupted"
            )
        return manifest

    @classmethod
    def loads(
        cls, text: str | bytes, *, root: str | None = None, where: str = "manifest"
    ) -> Manifest:
        try:
            doc = json.loads(text, object_pairs_hook=_unique_keys)
        except KeyError as exc:  # `_unique_keys`
            raise ManifestError(
                f"{where}: malformed JSON: duplicate key {exc.args[0]!r} in an "
                "object; hint: a manifest must be written by detdata"
            ) from None
        except (ValueError, UnicodeDecodeError, RecursionError) as exc:
            raise ManifestError(
                f"{where}: malformed JSON ({exc}); hint: manifests are the JSON "
                "files written by Manifest.save / `detdata manifest build`"
            ) from None
        return cls.from_json(doc, root=root, where=where)

    @classmethod
    def load(
        cls,
        path: str,
        *,
        root: str | None = None,
        verify: str | Verify = Verify.QUICK,
        threads: int = 8,
        retry: RetryPolicy | None = None,
        **storage_options: Any,
    ) -> Manifest:
        """Read a manifest file/URL and verify the shards under its root.

        ``root`` overrides the stored root; a relative stored root is relative to the
        manifest file's directory, as is a missing one. ``verify``: ``"quick"``
        (default), ``"full"`` or ``"off"``. Remote reads retry under ``retry``.
        """
        mode = parse_verify(verify)
        where = f"manifest {redact_url(path)}"
        reader = functools.partial(_read_files, path, check_policy(retry), storage_options)
        copy = node_source(path, reader)  # one read per node (docs/design.md section 8)
        if copy is not None and "json" in copy.data:
            manifest = cls.loads(copy.data["json"], root=root, where=where)
        elif (fast := _load_columns(path, root, copy)) is not None:
            manifest = fast
        else:
            text = _read_text(path, check_policy(retry), storage_options)
            manifest = cls.loads(text, root=root, where=where)
        if root is None:
            manifest = manifest.with_root(_resolve_root(manifest.root, path))
        if mode is not Verify.OFF:
            manifest.verify(mode, threads=threads, retry=retry, **storage_options)
        return manifest

    # verification -----------------------------------------------------------
    def verify(
        self,
        mode: str | Verify = Verify.QUICK,
        *,
        threads: int = 8,
        progress: bool | None = None,
        retry: RetryPolicy | None = None,
        again: bool = False,
        **storage_options: Any,
    ) -> None:
        """Check the bytes under the root; raise `VerificationError` naming the first bad
        shard in path order (`detdata.identity.verify.verify_manifest`), once per job
        (`detdata.identity.receipts.verify_job`). A check this object already passed, at
        ``mode`` or stronger on the same root, is not run again unless ``again=True``,
        which also ignores receipts.
        """
        level = parse_verify(mode)
        if level is Verify.OFF:
            return
        done = self.verified_level
        if not again and done is not None and STRENGTH[done] >= STRENGTH[level]:
            return
        verify_job(
            self,
            level,
            threads=threads,
            progress=progress,
            retry=retry,
            storage_options=storage_options,
            use_receipt=not again,
        )
        self.__dict__[_VERIFIED] = (level, self.root)

    @property
    def verified_level(self) -> Verify | None:
        """The strongest level `verify` passed on this object under its current root (None:
        never); kept by pickling."""
        record = self.__dict__.get(_VERIFIED)
        return None if record is None or record[1] != self.root else cast(Verify, record[0])


def _load_columns(path: str, root: str | None, copy: NodeSource | None = None) -> Manifest | None:
    """The manifest at local ``path`` from its fast form where tied to the JSON's head (a
    fast form failing its own checks warns), else None. ``copy``: the node's copy of the
    columns and head (`detdata.identity.node_copy`), used instead of the files."""
    local = local_path(path)
    if local is None:
        return None
    cpath = columns_path(local) if copy is None else copy.path["columns"]
    if not os.path.exists(cpath):
        return None
    try:
        head = read_json_head(local) if copy is None else json.loads(copy.data["head"])
    except (OSError, ValueError):
        return None  # the JSON path reports it
    if not isinstance(head, dict) or head.get(K_KIND) != KIND:
        return None
    stored_root = head.get(K_ROOT)
    if head.get(K_VERSION) != FORMAT_VERSION or not isinstance(stored_root, str | None):
        return None
    try:
        columns = ColumnsFile(cpath)
    except (ManifestError, OSError, ValueError) as exc:
        warnings.warn(redact_text(f"{exc}; reading the manifest JSON {path} instead"), stacklevel=3)
        return None
    header = columns.header
    if (
        head.get(K_ID) != header["id"]
        or head.get(K_METADATA, {}) != header["metadata"]
        or os.path.getsize(local) != header["json_bytes"]
    ):
        columns.close()
        return None  # the JSON was saved again without its fast form: it decides
    return Manifest(
        shards=ShardTable(columns, local),
        metadata=header["metadata"],
        root=root if root is not None else stored_root,
    )


def _read_text(path: str, policy: RetryPolicy, storage_options: dict[str, Any]) -> bytes:
    """Every byte of the manifest file at ``path``; a `ManifestError` naming it when it
    cannot be read."""
    shown = redact_url(path)
    try:
        return read_file_retrying(path, policy=policy, what="manifest read", **storage_options)
    except FileNotFoundError:
        raise ManifestError(
            f"manifest file not found: {shown}; hint: check the path (or URL) of the manifest JSON"
        ) from None
    except IsADirectoryError:
        raise ManifestError(_folder_given(path)) from None  # redacted as every DetdataError
    except (NotADirectoryError, PermissionError) as exc:
        raise ManifestError(
            f"cannot read manifest {shown}: {type(exc).__name__}: "
            f"{exc.strerror or exc}; hint: pass the manifest JSON file "
            "(e.g. DIR/manifest.json), readable by this user"
        ) from None


def _read_files(
    path: str, policy: RetryPolicy, storage_options: dict[str, Any]
) -> dict[str, bytes]:
    """What a node copy holds of the manifest at ``path``: the columns and JSON head that
    `_load_columns` reads, else the JSON."""
    local = local_path(path)
    if local is not None and os.path.exists(columns_path(local)):
        try:
            head = read_json_head(local)
            with open(columns_path(local), "rb") as fh:
                columns = fh.read()
        except OSError:
            head = None  # the JSON path reports it
        if head is not None:
            return {"head": canonical_json(head), "columns": columns}
    return {"json": _read_text(path, policy, storage_options)}


def document_fields(
    doc: dict[str, Any], where: str
) -> tuple[tuple[ShardEntry, ...], dict[str, Any], str | None]:
    """``(shards, metadata, root)`` of a manifest (or part) document, each checked."""
    shards_doc, metadata, root = doc.get(K_SHARDS), doc.get(K_METADATA, {}), doc.get(K_ROOT)
    if not isinstance(shards_doc, list):
        raise ManifestError(f"{where}: field 'shards' must be a list")
    if not isinstance(metadata, dict):
        raise ManifestError(f"{where}: field 'metadata' must be an object")
    if root is not None and not isinstance(root, str):
        raise ManifestError(f"{where}: field 'root' must be a string or null")
    shards = tuple(ShardEntry.from_json(s, f"{where} shard #{i}") for i, s in enumerate(shards_doc))
    return shards, metadata, root


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``json`` object hook refusing duplicate keys (the last one would silently win): a
    `KeyError` naming the key."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise KeyError(key)
        out[key] = value
    return out


def _normalise_metadata(metadata: object) -> dict[str, Any]:
    """A detached plain-JSON copy of ``metadata`` (string keys), or `ManifestError`."""
    if not isinstance(metadata, Mapping):
        raise ManifestError(f"manifest metadata must be a mapping, found {type(metadata).__name__}")
    bad = [k for k in metadata if not isinstance(k, str)]
    if bad:
        raise ManifestError(f"manifest metadata keys must be strings, found {bad!r}")
    try:
        return cast(dict[str, Any], json.loads(canonical_json(dict(metadata))))
    except (TypeError, ValueError) as exc:
        raise ManifestError(
            f"manifest metadata must be plain JSON (str, int, float, bool, None, "
            f"lists, objects): {exc}"
        ) from None


def _portable_root(root: str, manifest_path: str) -> str:
    """``root`` as stored in a file at ``manifest_path`` (relative when the file is inside it)."""
    local_root, local_file = local_path(root), local_path(manifest_path)
    if local_root is None or local_file is None:
        return root
    rel = os.path.relpath(os.path.abspath(local_root), os.path.dirname(os.path.abspath(local_file)))
    if all(part in (".", "..") for part in rel.split(os.sep)):
        return rel.replace(os.sep, "/")
    return root


def _resolve_root(stored: str | None, manifest_path: str) -> str:
    """The root to read shards from: stored absolute/URL as is, else relative to the file."""
    local_file = local_path(manifest_path)
    if local_file is not None:
        base = os.path.dirname(os.path.abspath(local_file))
        if stored is None:
            return base
        if is_url(stored) or os.path.isabs(stored):
            return stored
        return os.path.normpath(os.path.join(base, stored))
    base = manifest_path.rsplit("/", 1)[0]
    if stored is None or stored == ".":
        return base
    if is_url(stored) or stored.startswith("/"):
        return stored
    return base + "/" + stored


def _folder_given(path: str) -> str:
    """The error text for a folder passed where a manifest file is expected."""
    inside = os.path.join(path, "manifest.json")
    if os.path.isfile(inside):
        step = f"did you mean {inside!r}? pass that file"
    else:
        step = (
            f"make one first with `detdata manifest build {path} -o {inside}` (or "
            "detdata.build_manifest(...).save(...) in Python), then pass that file"
        )
    return f"cannot read manifest {path}: a folder, not a manifest file; hint: {step}"
