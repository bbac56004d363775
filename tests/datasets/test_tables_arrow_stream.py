"""`TableRows` refuses Arrow IPC *stream* shards by name (no bare pyarrow error)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import detdata
from detdata.base.errors import FormatError
from detdata.datasets.documents import Documents
from tests.datasets.doc_corpora import random_documents, write_arrow_stream, write_hf_arrow


@pytest.mark.parametrize("writer", ["hf_save_to_disk", "pyarrow_new_stream"])
def test_table_rows_refuses_arrow_stream_shards_naming_the_shard_and_the_way_out(
    tmp_path: Path, writer: str
) -> None:
    docs = random_documents(np.random.default_rng(3), 20, vocab=1000)
    if writer == "hf_save_to_disk":
        write_hf_arrow(tmp_path, docs, shards=2)
    else:
        write_arrow_stream(tmp_path / "s.arrow", docs, batch=6)
    manifest = detdata.build_manifest(str(tmp_path), format="arrow_stream")
    shard = manifest.shards[0].path
    with pytest.raises(FormatError) as info:
        detdata.TableRows(manifest)
    message = str(info.value)
    assert f"shard {shard}:" in message and "'arrow_stream'" in message
    assert "Documents(manifest, column=" in message and "pyarrow.ipc.new_file" in message
    assert "Not an Arrow file" not in message
    # the documented way out reads every token the writer wrote
    documents = Documents(manifest, column="input_ids")
    flat = documents.gather(np.arange(documents.num_tokens, dtype=np.int64))
    assert flat.tolist() == np.concatenate(docs).tolist()
