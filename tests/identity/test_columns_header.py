"""The fast form's header check (`detdata.identity.columns.parse_header`): the header a
real ``Manifest.save`` writes is accepted as written, and each field a reader relies on,
broken one at a time, is refused before any data is read with an error naming that field."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from detdata.base.errors import ManifestError
from detdata.identity.build import build_manifest
from detdata.identity.columns import parse_header
from tests.conftest import write_token_shards


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    """The header bytes of the fast form ``Manifest.save`` wrote (magic, u64le length, JSON)."""
    root = tmp_path_factory.mktemp("hdr")
    write_token_shards(root / "data", sizes=(300, 40, 77))
    path = root / "m.json"
    build_manifest(str(root / "data"), metadata={"note": "header"}).save(str(path))
    blob = Path(str(path) + ".columns").read_bytes()
    assert blob[:8] == b"DDMCOLS1"
    return blob[16 : 16 + int.from_bytes(blob[8:16], "little")]


def test_the_written_header_is_accepted_as_written(written: bytes) -> None:
    assert parse_header(written, ManifestError) == json.loads(written)


def _set(key: str, value: Any) -> Callable[[dict[str, Any]], None]:
    return lambda h: h.__setitem__(key, value)


def _section(name: str, index: int, delta: int) -> Callable[[dict[str, Any]], None]:
    def edit(h: dict[str, Any]) -> None:
        h["sections"][name][index] += delta

    return edit


BROKEN: dict[str, tuple[Callable[[dict[str, Any]], None], str]] = {
    "kind": (_set("kind", "detdata.manifest"), "not a manifest columns file"),
    "version 3": (_set("version", 3), r"version 3; this detdata reads versions \[1, 2\]"),
    "version True": (_set("version", True), "version True"),
    "chunk": (_set("chunk", 4096), "chunk size 4096, expected 65536"),
    "count": (_set("count", -1), "header field 'count' must be a non-negative integer"),
    "data_bytes": (lambda h: h.pop("data_bytes"), "'data_bytes' must be a non-negative"),
    "a section missing": (lambda h: h["sections"].pop("quick"), "'sections' does not list"),
    "misaligned": (_section("blake3", 0, 8), "section 'blake3' is described as"),
    "past the data": (_section("row_groups", 0, 1 << 30), "section 'row_groups' is described"),
    "wrong length": (_section("num_samples", 1, 8), "section 'num_samples' is described"),
    "wrong dtype": (
        lambda h: h["sections"]["dtype"].__setitem__(2, "<i8"),
        "section 'dtype' is described",
    ),
    "path blocks": (_set("path_block", 1), "'path_block' .* are wrong"),
    "formats": (_set("formats", [1]), "'formats' must be a list of strings"),
    "id": (lambda h: h.pop("id"), "'metadata' \\(object\\), 'id' and 'json_digest' are required"),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_each_broken_field_is_refused_naming_it(written: bytes, case: str) -> None:
    edit, message = BROKEN[case]
    header = copy.deepcopy(json.loads(written))
    edit(header)
    with pytest.raises(ManifestError, match=message):
        parse_header(json.dumps(header).encode(), ManifestError)


def test_a_header_that_is_not_json_is_refused() -> None:
    with pytest.raises(ManifestError, match="malformed header"):
        parse_header(b"{not json", ManifestError)
    with pytest.raises(ManifestError, match="malformed header \\(a JSON list, not an object\\)"):
        parse_header(b"[]", ManifestError)
