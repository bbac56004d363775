"""The run record: everything outside the data cursor that a resume must match (issue 15).

`RunRecord.capture` is taken at step 0 and saved with every checkpoint; before a resume a fresh
capture is checked against the saved one with `RunRecord.verify`, which refuses every
difference not allowed by name. Plain JSON (``format_version`` `RECORD_VERSION`; format 1 is
read with the format-2 sections empty). Its sections, checked field names and choices:
docs/design.md, "Run record and split".
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Final

from detdata.base.canonical import canonical_json
from detdata.base.errors import ConfigError, DetdataError, StateError
from detdata.base.hashing import digest_bytes
from detdata.base.redact import redact_value
from detdata.loading.record_capture import (
    NUMERICS_ENV,
    code_section,
    container_section,
    data_section,
    determinism_flags,
    env_names,
    env_section,
    execution_section,
    gpus,
    installed_packages,
    layout_section,
    library_versions,
    lock_hashes,
    logger,
    package_list,
    packages_section,
    platform_info,
)
from detdata.loading.record_format import (
    FIELDS,
    GROUPS,
    K_CODE,
    K_CONFIG,
    K_CONTAINER,
    K_DATA,
    K_DETERMINISM,
    K_DIGEST,
    K_DIRTY,
    K_DIRTY_FILES,
    K_ENV,
    K_EXECUTION,
    K_GPU_UUIDS,
    K_GPUS,
    K_KIND,
    K_LAYOUT,
    K_LIST,
    K_LOADER,
    K_LOADER_STATE,
    K_LOCKS,
    K_NOTE,
    K_PACKAGES,
    K_PLATFORM,
    K_REVISION,
    K_SEEDS,
    K_SOURCE,
    K_VERSION,
    K_VERSIONS,
    KIND,
    READABLE_VERSIONS,
    RECORD_VERSION,
    TOP_KEYS,
    V2_SECTIONS,
    VERSION_FIELDS,
    check_shape,
    plain,
)
from detdata.loading.state import K_MANIFESTS

#: The prefixes of the checked fields named per variable or flag (``env.NAME``, ...).
_PREFIXES: Final = (f"{K_ENV}.", f"{K_DETERMINISM}.")


@dataclass(frozen=True, kw_only=True)
class RunRecord:
    """One run's record; build it with `capture` (or `from_json` / `load`), never by hand."""

    #: the numerics-changing environment variables recorded in clear text
    NUMERICS_ENV: ClassVar[tuple[str, ...]] = NUMERICS_ENV

    doc: Mapping[str, Any] = field(repr=False)

    @classmethod
    def capture(
        cls,
        *,
        repo: str | os.PathLike[str] | None = None,
        allow_dirty: bool = False,
        lock_files: Sequence[str | os.PathLike[str]] | None = None,
        layout: Mapping[str, int] | None = None,
        config: Mapping[str, Any] | None = None,
        loader: Any = None,
        manifests: Iterable[Any] = (),
        seeds: Mapping[str, int | None] | None = None,
        extra_env: Iterable[str] = (),
        clear_env: Iterable[str] = (),
        execution: Mapping[str, Any] | None = None,
        image: str | None = None,
        image_digest: str | None = None,
    ) -> RunRecord:
        """Capture the record of this process (call it at step 0 and save it with checkpoints).

        ``repo``: the code's directory (default: the current directory). A dirty tree, or one
        git cannot tell (``code.note`` says why), raises `ConfigError` unless ``allow_dirty``.
        ``lock_files``: paths to hash (relative ones under the repository root; default
        `DEFAULT_LOCK_FILES` found there). ``layout``: ``{"world", "dp", "tp", "pp"}``
        (`layout_section` fills missing keys). ``config``: a JSON-plain mapping, hashed.
        ``loader``: a `DataLoader` or a saved loader state; ``manifests``, ``seeds``: more
        manifests (or ``b3:`` ids) and named seeds. ``extra_env``: more variables, stored as
        blake3 unless also in ``clear_env``. ``execution``: keys of `EXECUTION_KEYS`.
        ``image`` / ``image_digest``: default `IMAGE_ENV` / `IMAGE_DIGEST_ENV`.
        """
        where = Path(repo if repo is not None else os.getcwd())
        code = code_section(where)
        if code[K_DIRTY] is None and not allow_dirty:
            raise ConfigError(
                f"refusing to start: cannot tell whether the code is dirty: {code[K_NOTE]}; the "
                "run record could not name the code that ran; hint: fix the above, or pass "
                "RunRecord.capture(..., allow_dirty=True) (recorded as unknown)"
            )
        if code[K_DIRTY] and not allow_dirty:
            raise ConfigError(
                f"refusing to start from a dirty tree: {code[K_DIRTY_FILES]} tracked file(s) "
                f"modified in {where} (revision {code[K_REVISION]}); the run record could not "
                "name the code that ran; hint: commit the changes, or pass "
                "RunRecord.capture(..., allow_dirty=True) (recorded as dirty)"
            )
        doc: dict[str, Any] = {
            K_KIND: KIND,
            K_VERSION: RECORD_VERSION,
            K_CODE: code,
            K_LOCKS: lock_hashes(where, code.get("toplevel"), lock_files),
            K_PACKAGES: packages_section(installed_packages()),
            K_VERSIONS: library_versions(),
            K_GPUS: gpus(),
            K_ENV: env_section(env_names(extra_env), env_names(clear_env, "clear_env")),
            K_LAYOUT: layout_section(layout),
            K_CONFIG: None if config is None else digest_bytes(canonical_json(dict(config))),
            K_DATA: data_section(loader, manifests, seeds),
            K_DETERMINISM: determinism_flags(),
            K_PLATFORM: platform_info(),
            K_CONTAINER: container_section(image, image_digest),
        }
        doc[K_EXECUTION] = execution_section(doc[K_DATA][K_LOADER_STATE], execution)
        code.pop("toplevel", None)
        return cls(doc=redact_value(plain(doc)))  # the redaction boundary: no secret kept

    def to_json(self) -> dict[str, Any]:
        """The record as a JSON-plain dict (a deep copy)."""
        return dict(json.loads(json.dumps(self.doc)))

    @classmethod
    def from_json(cls, doc: object, *, where: str = "run record") -> RunRecord:
        """Parse a record (a dict or its JSON text); `StateError` if it is not one."""
        if isinstance(doc, (str, bytes)):
            try:
                doc = json.loads(doc)
            except (ValueError, RecursionError) as exc:
                raise StateError(f"{where} is not valid JSON: {exc}") from None
        if not isinstance(doc, Mapping) or doc.get(K_KIND) != KIND:
            found = doc.get(K_KIND) if isinstance(doc, Mapping) else type(doc).__name__
            raise StateError(
                f"{where}: not a run record (kind {found!r}, expected {KIND!r}); hint: pass "
                "what RunRecord.to_json() or RunRecord.save wrote"
            )
        version = doc.get(K_VERSION)
        if version not in READABLE_VERSIONS or isinstance(version, bool):
            raise StateError(
                f"{where}: unknown format_version {doc.get(K_VERSION)!r}; this detdata reads "
                f"versions {list(READABLE_VERSIONS)}; hint: upgrade detdata"
            )
        doc = dict(doc)
        if version == 1:
            doc.update({k: {} for k in V2_SECTIONS if k not in doc})
        missing = [k for k in TOP_KEYS if k not in doc]
        if missing:
            raise StateError(f"{where}: missing fields {missing}")
        try:
            record = cls(doc=plain(doc))
        except ConfigError as exc:
            raise StateError(f"{where}: {exc}") from None
        check_shape(record.doc, where)
        return cls(doc={**record.doc, K_PACKAGES: _normal_packages(record.doc[K_PACKAGES])})

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the record as JSON, atomically (readers see the old file or the whole new one)."""
        from detdata.storage.atomic import atomic_write_bytes

        text = json.dumps(self.doc, sort_keys=True, indent=1, ensure_ascii=False) + "\n"
        atomic_write_bytes(os.fspath(path), text.encode("utf-8"))

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> RunRecord:
        """Read a record `save` wrote."""
        return cls.from_json(Path(path).read_text(encoding="utf-8"), where=f"run record {path}")

    def fields(self) -> dict[str, Any]:
        """The checked fields, flat: name -> value (what `verify` compares)."""
        d = self.doc
        out: dict[str, Any] = {
            K_REVISION: d[K_CODE].get(K_REVISION),
            K_DIRTY: d[K_CODE].get(K_DIRTY),
            K_LOCKS: d[K_LOCKS],
            K_PACKAGES: d[K_PACKAGES][K_DIGEST],
        }
        out.update({k: d[K_VERSIONS].get(k) for k in VERSION_FIELDS})
        out[K_GPUS] = [g.get("name") for g in d[K_GPUS]]
        out[K_GPU_UUIDS] = [g.get("uuid") for g in d[K_GPUS]]
        out[K_LAYOUT] = d[K_LAYOUT]
        out[K_CONFIG] = d[K_CONFIG]
        out[K_MANIFESTS] = d[K_DATA][K_MANIFESTS]
        out[K_SEEDS] = d[K_DATA][K_SEEDS]
        out.update({f"{K_LOADER}.{k}": v for k, v in d[K_DATA][K_LOADER].items()})
        out.update({f"{K_ENV}.{k}": v for k, v in d[K_ENV].items()})
        for section in V2_SECTIONS:
            out.update({f"{section}.{k}": v for k, v in d[section].items() if k != K_SOURCE})
        return out

    def differences(self, saved: RunRecord) -> list[str]:
        """Names of the checked fields whose values differ from ``saved``'s (sorted)."""
        now, then = self.fields(), saved.fields()
        return sorted(k for k in set(now) | set(then) if now.get(k) != then.get(k))

    def verify(self, saved: RunRecord | Mapping[str, Any], *, allow: Iterable[str] = ()) -> None:
        """Refuse every difference from ``saved`` not allowed by name; log the allowed ones.

        ``allow`` takes field names (`FIELDS`, ``env.NAME``) and the groups ``env`` and
        ``loader``. Refused differences raise `StateError` (``.fields``) listing each as
        ``field: saved X, now Y``; each allowed one is logged (WARNING, one line per field).
        """
        old = saved if isinstance(saved, RunRecord) else RunRecord.from_json(saved)
        try:
            diffs = self.differences(old)
        except DetdataError:
            raise
        except (TypeError, KeyError, AttributeError, ValueError) as exc:
            raise StateError(
                f"the saved run record cannot be compared: {type(exc).__name__}: {exc}; it was "
                "edited or corrupted; hint: compare with a record RunRecord.save wrote"
            ) from None
        allowed = self.check_allow(allow, old)
        refused = [k for k in diffs if k not in allowed and k.split(".", 1)[0] not in allowed]
        for k in diffs:
            if k not in refused:
                logger.warning("run record: allowed difference %s", self._describe(k, old))
        if refused:
            lines = "\n".join(f"  {self._describe(k, old)}" for k in refused)
            names = ", ".join(repr(k) for k in refused)
            raise StateError(
                f"the run record differs from the saved one in {len(refused)} field(s):\n{lines}\n"
                f"hint: if these changes are intended, pass allow=({names},) to "
                "RunRecord.verify (each allowed difference is logged)",
                fields=tuple(refused),
            )

    def check_allow(
        self, allow: Iterable[str], saved: RunRecord, *, option: str = "allow="
    ) -> frozenset[str]:
        """The names ``allow`` gives, checked as `verify` checks them, without comparing: a
        name that is no field nor group, or an ``env.NAME`` / ``determinism.NAME`` neither this
        record nor ``saved`` holds, is a `ConfigError` naming it (as ``option``, e.g.
        ``--allow`` on the command line) and listing the valid names. For a caller that acts
        (prints, saves) before `verify`: a misspelt name is refused before anything is done."""
        allowed = _check_allow(allow, option)
        held = {*self.fields(), *saved.fields()}
        unheld = sorted(n for n in allowed if n.startswith(_PREFIXES) and n not in held)
        if unheld:  # a typo there would allow nothing and say nothing
            recorded = sorted(n for n in held if n.startswith(_PREFIXES))
            raise ConfigError(
                f"{option} names {unheld}, which neither run record holds; recorded: {recorded}; "
                "hint: check the spelling, or allow the whole group ('env', 'determinism')"
            )
        return allowed

    def _describe(self, name: str, saved: RunRecord) -> str:
        if name == K_PACKAGES:
            changes = _package_changes(saved.doc[K_PACKAGES][K_LIST], self.doc[K_PACKAGES][K_LIST])
            return f"{name}: {changes}"
        then, now = saved.fields().get(name), self.fields().get(name)
        return f"{name}: saved {_short(then)}, now {_short(now)}"


def _normal_packages(section: Mapping[str, Any]) -> Mapping[str, Any]:
    """A saved ``packages`` section with its versions in normal form (`package_list`) and its
    digest recomputed, when it is what an earlier capture wrote (its digest is its list's);
    a section edited by hand is kept as it is (`verify` compares its digest as saved)."""
    pairs = section[K_LIST]
    if not all(isinstance(x, str) for pair in pairs for x in pair):
        return section
    if packages_section(pairs) != section:
        return section
    return packages_section(package_list((name, version) for name, version in pairs))


def _check_allow(allow: Iterable[str], option: str) -> frozenset[str]:
    if isinstance(allow, (str, bytes)):
        raise ConfigError(f"{option} takes a list of field names, got the string {allow!r}")
    names = frozenset(allow)
    known = {*FIELDS, *GROUPS}
    unknown = sorted(str(n) for n in names if n not in known and not str(n).startswith(_PREFIXES))
    if unknown:
        raise ConfigError(
            f"{option} names unknown run record fields {unknown}; known names are "
            f"{[*FIELDS, *GROUPS]}, env.NAME and determinism.NAME; hint: check the spelling"
        )
    return names


def _short(value: Any) -> str:
    text = json.dumps(value, sort_keys=True)
    return text if len(text) <= 200 else text[:197] + "..."


def _package_changes(saved: list[list[str]], now: list[list[str]]) -> str:
    then_map, now_map = {n: v for n, v in saved}, {n: v for n, v in now}
    parts = []
    for name in sorted(set(then_map) | set(now_map)):
        a, b = then_map.get(name), now_map.get(name)
        if a != b:
            parts.append(
                f"{name} saved {'absent' if a is None else a}, now {'absent' if b is None else b}"
            )
    shown = "; ".join(parts[:20]) + (f"; and {len(parts) - 20} more" if len(parts) > 20 else "")
    return shown or "the package list digest differs"
