"""Partial manifests: hash disjoint shard lists on different machines, merge into one manifest
(docs/design.md, "Hashing across machines"): the merge of the parts is the `Manifest` a
one-machine `build_manifest` gives, same entries, same id. A part is saved as JSON of kind
``detdata.manifest-part`` (which `Manifest.load` refuses), its root without credentials.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any, Final

from detdata.base.canonical import canonical_json
from detdata.base.checks import check_count, check_positive_int
from detdata.base.errors import ConfigError, ManifestError
from detdata.base.hashing import digest_bytes
from detdata.base.redact import redact_url, strip_credentials
from detdata.identity.build import canonical, hash_entries, shard_names
from detdata.identity.entry import FORMAT_VERSION, ShardEntry
from detdata.identity.formats import Format, parse_format
from detdata.identity.manifest import Manifest, document_fields
from detdata.storage.fs import filesystem, read_file_retrying
from detdata.storage.retry import RetryPolicy, check_policy

PART_KIND: Final = "detdata.manifest-part"
PART_VERSION: Final = 1
_KEYS: Final = frozenset(
    {"kind", "format_version", "manifest_format_version", "shards", "metadata", "root", "part"}
)


@dataclass(frozen=True, kw_only=True, repr=False)
class ManifestPart:
    """Entries of some shards of a corpus, to be merged (`merge_manifests`). ``index`` /
    ``count`` / ``listing``: which slice, of how many, of which listing (None for a part
    over explicit ``paths``)."""

    shards: tuple[ShardEntry, ...]
    metadata: Mapping[str, Any] = field(default_factory=dict)
    root: str | None = None
    index: int | None = None
    count: int | None = None
    listing: str | None = None

    def __post_init__(self) -> None:
        # the same checks as a manifest's (sorted, no duplicate paths, plain metadata)
        check = Manifest(shards=self.shards, metadata=self.metadata)
        object.__setattr__(self, "shards", check.shards)
        object.__setattr__(self, "metadata", dict(check.metadata))
        if (self.index is None) != (self.count is None) or (
            self.index is not None and self.listing is None
        ):
            raise ManifestError("a part has all of index, count and listing, or none of them")
        if self.index is not None and self.count is not None and not 0 <= self.index < self.count:
            raise ManifestError(f"part index {self.index} is not in [0, {self.count})")

    def __repr__(self) -> str:
        where = "" if self.index is None else f", part={self.index}/{self.count}"
        root = None if self.root is None else redact_url(self.root)
        return f"ManifestPart(shards={len(self.shards)}{where}, root={root!r})"

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": PART_KIND,
            "format_version": PART_VERSION,
            "manifest_format_version": FORMAT_VERSION,
            "shards": [s.to_json() for s in self.shards],
            "metadata": dict(self.metadata),
            "root": None if self.root is None else strip_credentials(self.root),
            "part": None
            if self.index is None
            else {"index": self.index, "count": self.count, "listing": self.listing},
        }

    def save(self, path: str, **storage_options: Any) -> None:
        """Write the part as JSON (atomically on local disk)."""
        from detdata.storage.atomic import atomic_write_bytes

        data = json.dumps(self.to_json(), sort_keys=True, indent=1, ensure_ascii=False)
        atomic_write_bytes(path, data.encode() + b"\n", **storage_options)

    @classmethod
    def from_json(cls, doc: object, *, where: str = "manifest part") -> ManifestPart:
        """Parse and validate a part document."""
        if not isinstance(doc, dict) or doc.get("kind") != PART_KIND:
            found = doc.get("kind") if isinstance(doc, dict) else type(doc).__name__
            raise ManifestError(
                f"{where}: not a manifest part (kind {found!r}, expected {PART_KIND!r}); "
                "hint: parts are written by `detdata manifest build --part I/N`"
            )
        if doc.get("format_version") != PART_VERSION or (
            doc.get("manifest_format_version") != FORMAT_VERSION
        ):
            raise ManifestError(
                f"{where}: format_version {doc.get('format_version')!r} / manifest "
                f"format_version {doc.get('manifest_format_version')!r}; this detdata "
                f"merges {PART_VERSION} / {FORMAT_VERSION}; hint: hash every part with "
                "the same detdata version"
            )
        unknown = sorted(set(doc) - _KEYS)
        if unknown:
            raise ManifestError(f"{where}: unknown fields {unknown}")
        shards, metadata, root = document_fields(doc, where)
        part = doc.get("part")
        index = count = listing = None
        if part is not None:
            if not isinstance(part, dict) or set(part) != {"index", "count", "listing"}:
                raise ManifestError(f"{where}: field 'part' must be {{index, count, listing}}")
            index, count, listing = part["index"], part["count"], part["listing"]
            if not all(isinstance(v, int) and not isinstance(v, bool) for v in (index, count)):
                raise ManifestError(f"{where}: part index and count must be integers")
            if not isinstance(listing, str):
                raise ManifestError(f"{where}: part listing must be a digest string")
        return cls(
            shards=shards, metadata=metadata, root=root, index=index, count=count, listing=listing
        )

    @classmethod
    def load(
        cls, path: str, *, retry: RetryPolicy | None = None, **storage_options: Any
    ) -> ManifestPart:
        """Read a part file/URL written by `ManifestPart.save`."""
        shown = redact_url(path)
        try:
            text = read_file_retrying(
                path, policy=check_policy(retry), what="manifest part read", **storage_options
            )
        except FileNotFoundError:
            raise ManifestError(f"manifest part not found: {shown}; hint: check the path") from None
        try:
            doc = json.loads(text)
        except (ValueError, UnicodeDecodeError) as exc:
            raise ManifestError(f"manifest part {shown}: malformed JSON ({exc})") from None
        return cls.from_json(doc, where=f"manifest part {shown}")


def listing_digest(rels: Sequence[str]) -> str:
    """``b3:`` digest of a sorted shard listing (what the parts of one build share)."""
    return digest_bytes(canonical_json(sorted(rels)))


def split_listing(rels: Sequence[str], index: int, count: int) -> list[str]:
    """Part ``index`` of ``count`` of the sorted listing: a contiguous slice, sizes within 1."""
    count = check_positive_int(count, "part count")
    index = check_count(index, "part index", minimum=0, maximum=count - 1)
    ordered = sorted(rels)
    n = len(ordered)
    return ordered[index * n // count : (index + 1) * n // count]


def build_part(
    root: str,
    *,
    part: tuple[int, int] | None = None,
    paths: Sequence[str] | None = None,
    pattern: str | None = None,
    format: str | Format | None = None,
    dtype: str | None = None,
    metadata: Mapping[str, Any] | None = None,
    threads: int = 8,
    progress: bool | None = None,
    retry: RetryPolicy | None = None,
    executor: Executor | None = None,
    **storage_options: Any,
) -> ManifestPart:
    """Hash part ``part=(index, count)`` of the listing under ``root`` (`split_listing`), or
    exactly ``paths``. The other arguments are `build_manifest`'s."""
    fs, rootpath = filesystem(root, **storage_options)
    fmt = parse_format(format) if format is not None else None
    if part is None and paths is None:
        raise ConfigError(
            "build_part needs part=(index, count) or paths=; hint: for one machine use "
            "build_manifest"
        )
    rels = shard_names(fs, root, rootpath, pattern, fmt, paths, progress=progress)
    index = count = listing = None
    if part is not None:
        index, count = part
        listing = listing_digest(rels)
        rels = split_listing(rels, index, count)
    entries = hash_entries(
        root,
        rels,
        format=fmt,
        dtype=dtype,
        threads=threads,
        progress=progress,
        retry=retry,
        executor=executor,
        **storage_options,
    )
    return ManifestPart(
        shards=tuple(entries),
        metadata=dict(metadata or {}),
        root=canonical(root),
        index=index,
        count=count,
        listing=listing,
    )


def merge_manifests(
    parts: Sequence[ManifestPart | Manifest], *, root: str | None = None
) -> Manifest:
    """One `Manifest` from parts (and/or manifests) over disjoint shards, equal to the
    one-machine `build_manifest` of the same shards. ``root`` defaults to the parts' common
    root. Overlapping shards, different metadata, roots or listings, a missing or repeated
    part index, or an incomplete listing is a `ManifestError` naming the shard or part.
    """
    items = [
        p
        if isinstance(p, ManifestPart)
        else ManifestPart(shards=tuple(p.shards), metadata=p.metadata, root=p.root)
        for p in parts
    ]
    if not items:
        raise ManifestError("merge_manifests needs at least one part")
    _check_same_metadata(items)
    common_root = root if root is not None else _check_same_root(items)
    _check_part_set(items)
    owner: dict[str, tuple[int, ShardEntry]] = {}
    for i, item in enumerate(items):
        for entry in item.shards:
            seen = owner.get(entry.path)
            if seen is not None:
                _overlap(entry, seen, i, items)
            owner[entry.path] = (i, entry)
    merged = Manifest(
        shards=tuple(e for _, e in owner.values()),
        metadata=items[0].metadata,
        root=common_root,
    )
    listing = items[0].listing
    if listing is not None and listing_digest([s.path for s in merged.shards]) != listing:
        raise ManifestError(
            f"the merged parts do not cover their listing (digest {listing}): every part "
            "index is present but some shards are missing; hint: a part file was edited or "
            "built from another listing: rebuild it"
        )
    return merged


def _overlap(entry: ShardEntry, seen: tuple[int, ShardEntry], i: int, items: list[Any]) -> None:
    first, other = seen
    a, b = _label(items, first), _label(items, i)
    if other == entry:
        raise ManifestError(
            f"shard {entry.path} is in two parts ({a} and {b}); hint: hash disjoint shard "
            "lists (`detdata manifest build --part I/N` splits one listing)"
        )
    x, y = other.to_json(), entry.to_json()
    diff = [k for k in sorted(set(x) | set(y)) if x.get(k) != y.get(k)]
    raise ManifestError(
        f"conflicting entries for shard {entry.path} in {a} and {b}: "
        + ", ".join(f"{k}: {x.get(k)!r} vs {y.get(k)!r}" for k in diff)
        + "; hint: the shard changed between the two hashing runs: rebuild both parts"
    )


def _label(items: list[ManifestPart], i: int) -> str:
    """A part's name in messages: its index of a split, else its place among the inputs."""
    part = items[i]
    return f"part {part.index}/{part.count}" if part.index is not None else f"input #{i + 1}"


def _check_same_metadata(items: list[ManifestPart]) -> None:
    first = dict(items[0].metadata)
    for i, item in enumerate(items):
        if dict(item.metadata) != first:
            where = _label(items, i)
            keys = sorted(
                k for k in set(first) | set(item.metadata) if first.get(k) != item.metadata.get(k)
            )
            raise ManifestError(
                f"{_label(items, 0)} and {where} have different metadata (keys {keys}: "
                f"{[first.get(k) for k in keys]!r} vs {[item.metadata.get(k) for k in keys]!r}); "
                "hint: metadata is part of the id: pass the same --meta to every part"
            )


def _check_same_root(items: list[ManifestPart]) -> str | None:
    roots = {strip_credentials(p.root) for p in items if p.root is not None}
    if len(roots) > 1:
        shown = sorted(redact_url(r) for r in roots)
        raise ManifestError(
            f"the parts were hashed under different roots {shown}; hint: hash every part "
            "from the same root (or pass root= to merge parts of copies of one corpus)"
        )
    return next((p.root for p in items if p.root is not None), None)


def _check_part_set(items: list[ManifestPart]) -> None:
    indexed = [p for p in items if p.index is not None]
    if not indexed:
        return
    if len(indexed) != len(items):
        raise ManifestError(
            "cannot merge parts of a listing (--part I/N) with parts over explicit paths or "
            "whole manifests; hint: merge the parts of one `--part` run"
        )
    counts = {p.count for p in indexed}
    listings = {p.listing for p in indexed}
    if len(counts) > 1 or len(listings) > 1:
        raise ManifestError(
            f"the parts come from different splits (counts {sorted(c or 0 for c in counts)}, "
            f"{len(listings)} listings); hint: every part of one build lists the same root "
            "with the same --pattern and the same N"
        )
    count = indexed[0].count or 0
    seen = sorted(p.index or 0 for p in indexed)
    missing = sorted(set(range(count)) - set(seen))
    repeated = sorted({i for i in seen if seen.count(i) > 1})
    if missing or repeated:
        raise ManifestError(
            f"parts of a {count}-part build: missing {missing}, given twice {repeated}; "
            "hint: merge each part 0..N-1 exactly once"
        )
