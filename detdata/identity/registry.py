"""A registry of manifests: content-addressed objects plus named, versioned references.

Layout under the registry root (a local directory or any fsspec URL)::

    manifests/<hex>.json            one manifest per id ``b3:<hex>`` (no root; immutable)
    refs/<name>/<version>.json      the reference ``name@version`` and its history
    tmp/.tmp-*                      (local only) writes in flight, or left by a killed writer
    .lock                           (local only) serialises writers

Contracts:

* Objects are immutable and re-hashed on read. A reference remembers every id (and
  root) it pointed at; re-pointing it needs ``force=True``. A bare ``name`` resolves
  to the version created most recently (ties broken by version string).
* Writes are atomic; local writers are serialised by an ``fcntl`` lock (object
  stores: last writer wins). Stale temp files are swept as docs/design.md ("Registry
  writes are O(1) amortised") says.
* Roots are recorded and shown without credentials; ``storage_options`` are never
  written. Remote reads and writes retry under ``retry`` and listings bypass
  fsspec's cache.
"""

from __future__ import annotations

import contextlib
import difflib
import json
import os
import re
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Final, TypeVar

from detdata.base.canonical import canonical_json
from detdata.base.errors import ConfigError, DetdataError, ManifestError, RegistryError
from detdata.base.hashing import is_digest
from detdata.base.redact import redact_url, scrub_exception, strip_credentials
from detdata.identity.columns import ColumnsFile, ShardTable, columns_path
from detdata.identity.manifest import Manifest
from detdata.storage.atomic import TEMP_PREFIX, atomic_write_bytes
from detdata.storage.fs import call_fs, filesystem, is_url
from detdata.storage.locks import hold, let_go, open_lock_file
from detdata.storage.retry import RetryPolicy, check_policy

T = TypeVar("T")

ENV_VAR: Final = "DETDATA_REGISTRY"
REF_KIND: Final = "detdata.ref"
REF_VERSION: Final = 1
NAME_RE: Final = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")  # names and versions
_LOCK_TIMEOUT_S: Final = 60.0
STALE_TEMP_S: Final = 600.0


def default_root() -> str:
    """``$DETDATA_REGISTRY``, else ``$XDG_CACHE_HOME/detdata/registry`` (``~/.cache`` by
    default)."""
    env = os.environ.get(ENV_VAR)
    if env:
        return env
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "detdata", "registry")


def split_name(name: object) -> tuple[str, str | None]:
    """``"wiki-en@v3"`` -> ``("wiki-en", "v3")``; ``"wiki-en"`` -> ``("wiki-en", None)``;
    `RegistryError` for anything else (`NAME_RE`)."""
    if not isinstance(name, str):
        raise RegistryError(f"registry name must be a string, got {name!r}")
    base, sep, version = name.partition("@")
    if not NAME_RE.fullmatch(base) or (sep and not NAME_RE.fullmatch(version)):
        raise RegistryError(
            f"invalid registry name {name!r}; hint: use 'name@version' such as "
            "'wiki-en@v3' (letters, digits, '.', '_', '-'; starting with a "
            "letter or digit)"
        )
    return base, (version if sep else None)


class BareNameWarning(UserWarning):
    """`Registry.resolve` was given a bare name: it took the latest version (named)."""


def check_id(manifest_id: object) -> str:
    """``manifest_id`` if it looks like ``b3:<64 hex>``, else `RegistryError`."""
    if not is_digest(manifest_id):
        raise RegistryError(f"invalid manifest id {manifest_id!r}; expected 'b3:' + 64 hex digits")
    return manifest_id


@dataclass(frozen=True, kw_only=True)
class RefEvent:
    """One entry of a reference's history: ``name`` pointed at ``id`` (under ``root``)."""

    name: str
    id: str
    root: str | None
    time_ns: int
    forced: bool

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "root": self.root, "time_ns": self.time_ns, "forced": self.forced}


@dataclass(frozen=True, kw_only=True)
class _Ref:
    name: str
    created_ns: int
    history: tuple[RefEvent, ...]

    @property
    def current(self) -> RefEvent:
        return self.history[-1]

    def to_bytes(self) -> bytes:
        doc = {
            "kind": REF_KIND,
            "format_version": REF_VERSION,
            "name": self.name,
            "created_ns": self.created_ns,
            "id": self.current.id,
            "root": self.current.root,
            "history": [e.to_json() for e in self.history],
        }
        return json.dumps(doc, sort_keys=True, indent=1).encode() + b"\n"

    @classmethod
    def from_bytes(cls, data: bytes, name: str) -> _Ref:
        try:
            doc = json.loads(data)
            if not isinstance(doc, dict):
                raise ValueError(f"expected a JSON object, found {type(doc).__name__}")
            head = (doc["kind"], doc["format_version"], doc["name"])
            if head != (REF_KIND, REF_VERSION, name):
                raise ValueError("kind/format_version/name " + "/".join(map(repr, head)))
            if not isinstance(doc["history"], list):
                raise ValueError("field 'history' must be a list")
            events = tuple(
                RefEvent(name=name, id=check_id(e["id"]), **_event_fields(e))
                for e in doc["history"]
            )
            if not events or events[-1].id != doc["id"]:
                raise ValueError("empty history or 'id' is not the last history entry")
            return cls(name=name, created_ns=_check_ns(doc["created_ns"]), history=events)
        except (ValueError, KeyError, TypeError, IndexError, RecursionError, RegistryError) as exc:
            raise RegistryError(
                f"reference {name!r} is corrupted ({exc}); hint: re-register it with force=True"
            ) from None


def _check_ns(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"a time must be a non-negative integer (ns), found {value!r:.60}")
    return value


def _event_fields(event: dict[str, Any]) -> dict[str, Any]:
    """A history entry's ``root``, ``time_ns`` and ``forced``, checked (`ValueError`)."""
    root = event["root"]
    if root is not None and not isinstance(root, str):
        raise ValueError(f"a history root must be a string or null, found {root!r:.60}")
    time_ns, forced = _check_ns(event["time_ns"]), event["forced"]
    if not isinstance(forced, bool):
        raise ValueError(f"field 'forced' must be true or false, found {forced!r:.60}")
    return {"root": root, "time_ns": time_ns, "forced": forced}


class Registry:
    """Manifests by id and names ``name@version`` -> id (contracts: the module docstring).

    ``root=None`` is `default_root`; an empty or blank ``root`` is a `ConfigError`.
    Storage failures other than "not found" are `RegistryError` naming the path.
    """

    def __init__(
        self,
        root: str | os.PathLike[str] | None = None,
        *,
        retry: RetryPolicy | None = None,
        **storage_options: Any,
    ) -> None:
        if root is None:
            root = default_root()
        if isinstance(root, os.PathLike):
            root = os.fspath(root)
        if not isinstance(root, str):
            raise ConfigError(f"Registry(root=...) must be a path or URL string, got {root!r}")
        if not root.strip():
            raise ConfigError(
                f"Registry(root={root!r}): the registry root is empty; hint: pass a "
                "directory or URL, or root=None for the default "
                f"(${ENV_VAR}, else ~/.cache/detdata/registry)"
            )
        self.root = root.rstrip("/") or "/"
        self._shown = redact_url(self.root)  # the root as messages show it
        self._options = storage_options
        self.retry = check_policy(retry)
        self._fs, self._path = filesystem(self.root, **storage_options)
        self._local = not is_url(self.root) or self.root.startswith("file://")
        self._protocol = self.root.split("://", 1)[0] if is_url(self.root) else "file"

    def __repr__(self) -> str:
        return f"Registry({self._shown!r})"

    # paths -----------------------------------------------------------------
    def _url(self, *parts: str) -> str:
        return "/".join((self.root, *parts))

    def _fspath(self, *parts: str) -> str:
        return "/".join((self._path.rstrip("/"), *parts))

    def _object(self, manifest_id: str) -> str:
        return f"{manifest_id[3:]}.json"

    # remote robustness -------------------------------------------------------
    def _io(self, what: str, path: str, fn: Callable[[float | None], T]) -> T:
        """``fn(timeout)`` once on local roots; retried under ``self.retry`` on remote ones.
        ``FileNotFoundError`` passes through; any other ``OSError`` is a `RegistryError`."""
        try:
            if self._local:
                return fn(None)
            url = f"{self._protocol}://{path}" if "://" not in path else path
            return self.retry.run(fn, what=f"registry {what}", shard="-", url=url)
        except (FileNotFoundError, DetdataError):
            raise
        except OSError as exc:
            raise self._os_error(what, path, exc) from exc

    def _os_error(self, what: str, path: str, exc: OSError) -> RegistryError:
        scrub_exception(exc)
        return RegistryError(
            f"registry {self._shown}: {what} of {path} failed: "
            f"{type(exc).__name__}: {exc.strerror or exc}; hint: registry "
            "files are written only by detdata: remove or repair whatever is "
            "in their place (a directory, a file where a folder belongs) and "
            "check permissions"
        )

    def _cat(self, path: str) -> bytes:
        return bytes(
            self._io("read", path, lambda t: call_fs(self._fs, "cat_file", path, timeout=t))
        )

    def _fresh(self, path: str) -> None:
        """Drop fsspec's cached listing of ``path`` (object stores cache ``ls``)."""
        if not self._local:
            self._fs.invalidate_cache(path)

    def _write(self, url: str, data: bytes) -> None:
        temp_dir = self._fspath("tmp") if self._local else None
        self._io(
            "write",
            url,
            lambda _t: atomic_write_bytes(url, data, temp_dir=temp_dir, **self._options),
        )

    # public API ------------------------------------------------------------
    def register(
        self,
        name: str,
        manifest_or_path: Manifest | str,
        *,
        force: bool = False,
        verify: str = "quick",
    ) -> str:
        """Store the manifest (or load it from a path) and point ``name@version`` at its id;
        return the id. Re-pointing at a different id is a `RegistryError` unless ``force``."""
        base, version = split_name(name)
        if version is None:
            raise RegistryError(
                f"registry name {name!r} has no version; hint: register as "
                f"'{base}@v1' (resolve accepts a bare name for the latest version)"
            )
        manifest = manifest_or_path
        if isinstance(manifest, str):
            manifest = Manifest.load(manifest, verify=verify, retry=self.retry, **self._options)
        elif not isinstance(manifest, Manifest):
            raise RegistryError(
                f"register() takes a Manifest or a manifest path, got {type(manifest).__name__}"
            )
        self._put_object(manifest)
        with self._lock():
            self._sweep_temps(("tmp",))
            return self._point(base, version, manifest, force)

    def resolve(
        self,
        name_or_id: str,
        *,
        verify: str = "quick",
        root: str | None = None,
        storage_options: Mapping[str, Any] | None = None,
        latest: bool = False,
    ) -> Manifest:
        """The manifest for ``b3:<hex>``, ``name@version`` or a bare ``name`` (latest version;
        warns `BareNameWarning` unless ``latest=True``).

        A name's manifest carries its registered root (``root`` overrides it, e.g. to
        add credentials) and is verified with ``verify``; ``storage_options`` default to
        the registry's own on the same protocol. An id alone is returned without root
        and unverified unless ``root`` is given.
        """
        if isinstance(name_or_id, str) and name_or_id.startswith("b3:"):
            manifest, chosen = self.get(name_or_id), root
        else:
            base, version = split_name(name_or_id)
            ref = self._refs_of(base)[-1] if version is None else self._ref(base, version)
            event = ref.current
            if version is None and not latest:
                warnings.warn(
                    f"resolve({name_or_id!r}) took the latest version, {event.name} ({event.id}): "
                    "a bare name follows every new registration, so a script that names it "
                    f"reads other data after the next one; hint: resolve({event.name!r}) pins "
                    "it (latest=True says floating is meant)",
                    BareNameWarning,
                    stacklevel=2,
                )
            manifest = self.get(event.id)
            chosen = root if root is not None else event.root
        if chosen is None:
            return manifest
        manifest = manifest.with_root(chosen)
        if storage_options is None:  # the registry's own where the root is on the same store
            protocol = chosen.split("://", 1)[0] if is_url(chosen) else "file"
            storage_options = self._options if protocol == self._protocol else {}
        try:
            manifest.verify(verify, retry=self.retry, **storage_options)
        except DetdataError as exc:
            exc.add_note(f"(resolving {name_or_id} from registry {self._shown})")
            raise
        return manifest

    def get(self, manifest_id: str) -> Manifest:
        """The stored manifest with this id (no root), checked intact: its fast form
        (`detdata.identity.columns`) where tied to the object, else the object re-hashed."""
        check_id(manifest_id)
        path = self._fspath("manifests", self._object(manifest_id))
        fast = self._get_columns(manifest_id, path)
        if fast is not None:
            return fast
        try:
            data = self._cat(path)
        except FileNotFoundError:
            raise RegistryError(
                f"manifest {manifest_id} is not in registry {self._shown}; hint: "
                "register it first (`detdata register MANIFEST NAME`)"
            ) from None
        try:
            manifest = Manifest.loads(data, where=f"registry object {manifest_id}")
        except ManifestError as exc:
            raise RegistryError(
                f"registry object {manifest_id} in {self._shown} is corrupted: "
                f"{exc}; hint: delete it and register the manifest again"
            ) from None
        if manifest.id != manifest_id:
            raise RegistryError(
                f"registry object {manifest_id} in {self._shown} holds manifest "
                f"{manifest.id}; hint: delete it and register again"
            )
        return manifest

    def history(self, name: str) -> tuple[RefEvent, ...]:
        """Every id ``name@version`` (a bare ``name``: all its versions) pointed at, oldest
        first."""
        base, version = split_name(name)
        if version is not None:
            return self._ref(base, version).history
        refs = self._refs_of(base)
        return tuple(
            sorted((e for r in refs for e in r.history), key=lambda e: (e.time_ns, e.name))
        )

    def names(self) -> list[str]:
        """All ``name@version`` references, sorted."""
        base = self._fspath("refs")
        self._fresh(base)
        try:
            found = self._io("listing", base, lambda _t: self._fs.find(base))
        except FileNotFoundError:
            return []
        out = []
        for path in found:
            rel = path[len(base.rstrip("/")) + 1 :] if path.startswith(base) else path
            parts = rel.split("/")
            if len(parts) == 2 and parts[1].endswith(".json"):
                out.append(f"{parts[0]}@{parts[1][:-5]}")
        return sorted(out)

    def versions(self, name: str) -> list[str]:
        """The versions of bare ``name``, oldest first (the last one is what ``name`` resolves
        to)."""
        base, version = split_name(name)
        if version is not None:
            raise RegistryError(f"versions() takes a bare name, got {name!r}; hint: pass {base!r}")
        return [r.name.partition("@")[2] for r in self._refs_of(base)]

    # internals -------------------------------------------------------------
    def _put_object(self, manifest: Manifest) -> None:
        """Store ``manifest`` (without root) under its id; a no-op when present."""
        url = self._url("manifests", self._object(manifest.id))
        path = self._fspath("manifests", self._object(manifest.id))
        self._fresh(path)
        if self._io("lookup", path, lambda _t: self._fs.exists(path)):
            if self._local and not os.path.exists(columns_path(path)):  # stored before columns
                self._write(columns_path(url), self.get(manifest.id).columns_bytes(self._cat(path)))
            return
        manifest.check_loadable(where=f"manifest {manifest.id} to register")
        doc = manifest.body()
        doc["id"] = manifest.id
        data = canonical_json(doc) + b"\n"
        self._write(url, data)
        if self._local:  # mapped only from a local registry (`_get_columns`)
            self._write(columns_path(url), manifest.columns_bytes(data))

    def _get_columns(self, manifest_id: str, path: str) -> Manifest | None:
        """``manifest_id`` from the fast form of ``path`` where it is tied to it, else None."""
        if not self._local or not os.path.exists(columns_path(path)):
            return None
        try:
            columns = ColumnsFile(columns_path(path))
        except (ManifestError, OSError, ValueError):
            return None  # the object itself is read and checked
        header = columns.header
        if header["id"] != manifest_id or os.path.getsize(path) != header["json_bytes"]:
            columns.close()
            return None
        return Manifest(shards=ShardTable(columns, path), metadata=header["metadata"])

    def _point(self, base: str, version: str, manifest: Manifest, force: bool) -> str:
        name = f"{base}@{version}"
        ref = self._find_ref(base, version)
        now = time.time_ns()
        root = None if manifest.root is None else strip_credentials(manifest.root)
        moved = ref is not None and ref.current.id != manifest.id
        if ref is not None and not moved and (ref.current.root == root or root is None):
            return manifest.id
        if ref is not None and moved and not force:
            raise RegistryError(
                f"{name} already points at {ref.current.id}, not {manifest.id}; "
                "registered names are immutable; hint: register a new version "
                f"(e.g. {base}@<next>) or pass force=True (--force) to re-point "
                "it (the old id stays in its history)"
            )
        event = RefEvent(name=name, id=manifest.id, root=root, time_ns=now, forced=moved)
        if ref is None:
            new = _Ref(name=name, created_ns=now, history=(event,))
        else:
            new = _Ref(name=name, created_ns=ref.created_ns, history=(*ref.history, event))
        self._write(self._url("refs", base, f"{version}.json"), new.to_bytes())
        return manifest.id

    def _find_ref(self, base: str, version: str) -> _Ref | None:
        """The reference ``base@version``, or None when it does not exist."""
        name = f"{base}@{version}"
        try:
            data = self._cat(self._fspath("refs", base, f"{version}.json"))
        except FileNotFoundError:
            return None
        return _Ref.from_bytes(data, name)

    def _ref(self, base: str, version: str) -> _Ref:
        """The reference ``base@version``; `RegistryError` listing known versions if absent."""
        ref = self._find_ref(base, version)
        if ref is not None:
            return ref
        try:
            hint = f"known versions of {base!r}: {self.versions(base)}"
        except RegistryError:
            hint = self._did_you_mean(f"{base}@{version}") or (
                f"register it first (`detdata register MANIFEST {base}@{version}`)"
            )
        raise RegistryError(f"name {base}@{version} is not in registry {self._shown}; hint: {hint}")

    def _did_you_mean(self, wanted: str) -> str:
        """ "did you mean X or Y?" from the registered names close to ``wanted`` ("" if none)."""
        known = self.names()
        candidates = sorted({*known, *(n.partition("@")[0] for n in known)})
        close = difflib.get_close_matches(wanted, candidates, n=3, cutoff=0.6)
        return f"did you mean {' or '.join(close)}?" if close else ""

    def _refs_of(self, base: str) -> list[_Ref]:
        """The references of bare ``base``, oldest created first; `RegistryError` if none."""
        folder = self._fspath("refs", base)
        self._fresh(folder)
        try:
            found = self._io("listing", folder, lambda _t: self._fs.ls(folder, detail=False))
        except FileNotFoundError:
            found = []
        versions = [str(p).rsplit("/", 1)[-1][:-5] for p in found if str(p).endswith(".json")]
        refs = []
        for v in sorted(versions):
            try:
                ref = self._find_ref(base, v)
            except RegistryError as exc:
                others = [f"{base}@{o}" for o in sorted(versions) if o != v]
                detail = str(exc).split("; hint: ", 1)[0]
                raise RegistryError(
                    f"name {base!r}: its versions (and so its latest) cannot be listed in "
                    f"registry {self._shown}: {detail}; hint: resolve an explicit version"
                    f"{' such as ' + others[-1] if others else ''}, or repair {base}@{v} "
                    "(re-register it with force=True)"
                ) from None
            if ref is not None:
                refs.append(ref)
        if not refs:
            raise RegistryError(
                f"name {base!r} is not in registry {self._shown}; hint: "
                + (self._did_you_mean(base) or f"`detdata register MANIFEST {base}@v1`")
            )
        return sorted(refs, key=lambda r: (r.created_ns, r.name))

    def gc(self) -> int:
        """Remove stale temp files in every local registry folder (O(entries)); return how
        many. A no-op on object stores."""
        if not self._local:
            return 0
        folders: list[tuple[str, ...]] = [("tmp",), ("manifests",), ("refs",)]
        with contextlib.suppress(FileNotFoundError, NotADirectoryError):
            folders += [("refs", e.name) for e in os.scandir(self._fspath("refs")) if e.is_dir()]
        with self._lock():
            return self._sweep_temps(*folders)

    def _sweep_temps(self, *folders: tuple[str, ...]) -> int:
        """Remove temp files older than ``STALE_TEMP_S`` (local roots only; the age test
        spares a concurrent ``_put_object``, which writes outside the lock); return how many."""
        removed = 0
        if not self._local:
            return 0
        cutoff = time.time() - STALE_TEMP_S
        for parts in folders:
            folder = self._fspath(*parts)
            try:
                entries = list(os.scandir(folder))
            except (FileNotFoundError, NotADirectoryError):
                continue  # nothing to sweep (a file in the way fails the write, named)
            for entry in entries:
                if not entry.name.startswith(TEMP_PREFIX) or not entry.is_file(
                    follow_symlinks=False
                ):
                    continue
                with contextlib.suppress(FileNotFoundError):
                    if entry.stat(follow_symlinks=False).st_mtime < cutoff:
                        os.unlink(entry.path)
                        removed += 1
        return removed

    @contextlib.contextmanager
    def _lock(self) -> Iterator[None]:
        """Serialise writers of a local registry across processes (no-op on object stores)."""
        if not self._local:
            yield
            return
        lock = os.path.join(self._path, ".lock")

        def stalled(waited: float) -> None:
            if waited > _LOCK_TIMEOUT_S:
                raise RegistryError(
                    f"registry {self._shown} is locked by another writer for "
                    f"over {_LOCK_TIMEOUT_S:.0f}s; hint: retry, or check "
                    "for a hung process"
                )

        try:
            os.makedirs(self._path, exist_ok=True)
            fd = open_lock_file(lock)
        except OSError as exc:  # a planted link or folder (`StorageError`) included
            raise self._os_error("locking", lock, exc) from exc
        hold(fd, stalled)
        try:
            yield
        finally:
            let_go(fd)
