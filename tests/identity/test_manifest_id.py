"""A manifest's id computed in pieces (detdata.identity.manifest_id, DESIGN.md 8) is the id
the definition gives: blake3 of the whole canonical JSON body, hashed here in one go with
the standard library's own JSON encoder (the independent reference), and the id every
stored manifest file records; the fast form's full check streams it with a bounded peak.
"""

from __future__ import annotations

import json
import tracemalloc
from pathlib import Path

import blake3
import pytest

from detdata import Manifest, ManifestError, ShardEntry
from detdata.identity import columns_tie
from detdata.identity.columns import ColumnsFile, ShardTable, encode_columns
from detdata.identity.columns_tie import verify_columns_id
from detdata.identity.formats import Format
from detdata.identity.manifest_id import PIECE, manifest_id

DATA = Path(__file__).parent / "data"


def _whole_body_id(doc: dict[str, object]) -> str:
    """The definition, hashed whole: canonical JSON (sorted keys, no whitespace, UTF-8)."""
    body = {k: doc[k] for k in ("kind", "format_version", "shards", "metadata")}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return "b3:" + blake3.blake3(text.encode("utf-8")).hexdigest()


def _entries(count: int) -> tuple[ShardEntry, ...]:
    return tuple(
        ShardEntry(
            path=f"dir-{i % 7}/shärd-{i:07d}.npy",  # non-ASCII: UTF-8, not escaped
            bytes=128 + 2 * (100 + i % 13),
            blake3="b3:" + blake3.blake3(str(i).encode()).hexdigest(),
            quick="b3:" + blake3.blake3(str(-i).encode()).hexdigest(),
            num_samples=100 + i % 13,
            format=Format.NPY,
            dtype="uint16",
            data_offset=128,
        )
        for i in range(count)
    )


def test_every_stored_manifest_keeps_its_id() -> None:
    files = sorted(DATA.glob("*.json"))
    assert any(f.name == "pre18-manifest.json" for f in files)
    for source in files:
        doc = json.loads(source.read_text())
        if doc.get("kind") != "detdata.manifest":
            continue
        loaded = Manifest.load(str(source), verify="off")
        assert loaded.id == doc["id"] == _whole_body_id(doc)
        assert manifest_id(loaded.metadata, loaded.shards) == doc["id"]


@pytest.mark.parametrize("count", [0, 1, PIECE - 1, PIECE, 2 * PIECE + 5])
def test_the_streamed_id_is_the_whole_body_hash(count: int) -> None:
    shards = _entries(count)
    metadata = {"tokenizer": "t-ü", "n": count, "nested": {"b": [1, 2], "a": None}}
    manifest = Manifest(shards=shards, metadata=metadata)
    assert manifest.id == _whole_body_id(manifest.body())


@pytest.mark.slow  # a 40,000-shard body (> 8 MiB) under tracemalloc: a scale test
def test_the_fast_form_check_streams_the_id_with_a_bounded_peak(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The verifier's full check holds one piece of entries at a time (and at most 1 MiB
    of checked chunks, `_KEPT`): with pieces of 128 entries its peak stays a fraction of
    the body's JSON alone (the whole-body computation holds the JSON and every entry,
    several times the body)."""
    monkeypatch.setattr(columns_tie, "PIECE", 128)
    shards = _entries(40_000)
    manifest = Manifest(shards=shards, metadata={"corpus": "large"}, root=str(tmp_path))
    path = tmp_path / "manifest.json"
    manifest.save(str(path))
    body_bytes = len(json.dumps(manifest.body(), separators=(",", ":")).encode())
    stored = json.loads(path.read_text())["id"]
    loaded = Manifest.load(str(path), verify="off")
    assert isinstance(loaded.shards, ShardTable)
    del manifest, shards
    tracemalloc.start()
    try:
        found = verify_columns_id(loaded.shards)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert found == stored
    assert body_bytes > 8 << 20
    assert peak < body_bytes // 4, (peak, body_bytes)


def test_the_streamed_check_still_refuses_wrong_totals_and_order(tmp_path: Path) -> None:
    unsorted = _entries(50)  # paths not in canonical order as listed
    manifest = Manifest(shards=unsorted)
    path = tmp_path / "m.json.columns"
    path.write_bytes(encode_columns(unsorted, {}, manifest.id, b"{}"))
    with pytest.raises(ManifestError, match="not in canonical order"):
        verify_columns_id(ShardTable(ColumnsFile(str(path))))
    raw = encode_columns(manifest.shards, {}, manifest.id, b"{}")
    header_at = raw.index(b'"num_samples":') + len(b'"num_samples":')
    path.write_bytes(raw)
    assert verify_columns_id(ShardTable(ColumnsFile(str(path)))) == manifest.id
    # a header claiming other totals (with a valid header digest) is refused
    forged = _reheader(raw, header_at)
    path.write_bytes(forged)
    with pytest.raises(ManifestError, match=r"the entries hold .* samples"):
        verify_columns_id(ShardTable(ColumnsFile(str(path))))


def _reheader(raw: bytes, at: int) -> bytes:
    """``raw`` with the header's num_samples digit at ``at`` changed and the header's digest
    (and nothing else) recomputed."""
    hlen = int.from_bytes(raw[8:16], "little")
    header = bytearray(raw[16 : 16 + hlen])
    i = at - 16
    header[i] = ord("1") if header[i] != ord("1") else ord("2")
    return raw[:16] + bytes(header) + blake3.blake3(bytes(header)).digest() + raw[16 + hlen + 32 :]
