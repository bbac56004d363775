"""Manifest builds tell Arrow IPC streams from Arrow IPC files by their first bytes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc

import detdata
from detdata.identity.formats import Format
from tests.datasets.doc_corpora import random_documents, write_hf_arrow


def test_a_datasets_save_to_disk_folder_is_arrow_stream_without_format(tmp_path: Path) -> None:
    docs = random_documents(np.random.default_rng(1), 30, vocab=500)
    write_hf_arrow(tmp_path / "hf", docs, shards=2)
    manifest = detdata.build_manifest(str(tmp_path / "hf"))
    assert [s.path for s in manifest.shards] == [
        "data-00000-of-00002.arrow",
        "data-00001-of-00002.arrow",
    ]
    assert {s.format for s in manifest.shards} == {Format.ARROW_STREAM}
    assert sum(s.num_samples for s in manifest.shards) == 30
    assert manifest.id == detdata.build_manifest(str(tmp_path / "hf"), format="arrow_stream").id


def test_arrow_ipc_files_and_streams_side_by_side_keep_their_own_format(tmp_path: Path) -> None:
    table = pa.table({"x": pa.array(range(10), pa.int64())})
    with pa.OSFile(str(tmp_path / "f.arrow"), "wb") as sink, ipc.new_file(sink, table.schema) as w:
        w.write_table(table)
    with (
        pa.OSFile(str(tmp_path / "s.arrow"), "wb") as sink,
        ipc.new_stream(sink, table.schema) as w,
    ):
        w.write_table(table)
    manifest = detdata.build_manifest(str(tmp_path))
    assert {s.path: s.format for s in manifest.shards} == {
        "f.arrow": Format.ARROW,
        "s.arrow": Format.ARROW_STREAM,
    }
