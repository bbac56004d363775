"""Benchmark data: token windows in ``.npy`` shards and Parquet shards, self-describing.

Sample ``s`` (global id, numbered shard by shard) is ``SEQ`` int32 tokens whose
token ``j`` is ``s * SEQ + j``. So every delivered row names its own id
(``row[0] // SEQ``) and can be checked in full (`check_rows`) without a lookup
table. Both formats hold the same samples and the same bytes per sample (2 KiB).

* ``tokens/shard-XXX.npy``: 1-D int32, ``samples_per_shard * SEQ`` tokens
  (windows of ``SEQ`` tokens, no label token, so every loader reads 2 KiB/sample).
* ``parquet/shard-XXX.parquet``: one ``list<int32>`` column ``tokens``, row
  groups of ``row_group`` rows, snappy (pyarrow's default).

Each folder gets a detdata manifest (``manifest.json``).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.parquet as pq

import detdata
from benchmarks.timing import Stopwatch

SEQ = 512
BYTES_PER_SAMPLE = SEQ * 4
SPEC_FILE = "spec.json"


@dataclass(frozen=True)
class DataSpec:
    """Size of the generated data (both formats hold the same samples)."""

    samples_per_shard: int
    shards: int
    row_group: int

    @property
    def num_samples(self) -> int:
        return self.samples_per_shard * self.shards

    @property
    def bytes_per_format(self) -> int:
        return self.num_samples * BYTES_PER_SAMPLE


def shard_tokens(spec: DataSpec, shard: int) -> npt.NDArray[np.int32]:
    """The 1-D token array of ``shard``: ``arange`` over that shard's global token range."""
    first = shard * spec.samples_per_shard * SEQ
    return np.arange(first, first + spec.samples_per_shard * SEQ, dtype=np.int32)


def generate(root: Path, spec: DataSpec) -> dict[str, float]:
    """Write both formats and their manifests under ``root`` (reused if ``spec.json`` matches)."""
    if spec.num_samples * SEQ >= 2**31:
        raise ValueError(f"{spec.num_samples} samples x {SEQ} tokens overflow int32 token values")
    spec_path = root / SPEC_FILE
    if spec_path.exists() and json.loads(spec_path.read_text()) == asdict(spec):
        return {"generate_s": 0.0, "reused": 1.0}
    with Stopwatch() as clock:
        root.mkdir(parents=True, exist_ok=True)
        spec_path.unlink(missing_ok=True)
        write_shards(root, spec)
        spec_path.write_text(json.dumps(asdict(spec)))
    return {"generate_s": clock.seconds, "reused": 0.0}


def write_shards(root: Path, spec: DataSpec) -> None:
    """``tokens/`` and ``parquet/`` under ``root``, emptied first, each with its manifest."""
    tok_dir, pq_dir = root / "tokens", root / "parquet"
    for folder in (tok_dir, pq_dir):
        folder.mkdir(exist_ok=True)
        for old in folder.iterdir():
            old.unlink()
    for shard in range(spec.shards):
        tokens = shard_tokens(spec, shard)
        np.save(tok_dir / f"shard-{shard:03d}.npy", tokens)
        offsets = pa.array(np.arange(0, tokens.size + 1, SEQ, dtype=np.int32))
        column = pa.ListArray.from_arrays(offsets, pa.array(tokens))
        table = pa.table({"tokens": column})
        pq.write_table(table, pq_dir / f"shard-{shard:03d}.parquet", row_group_size=spec.row_group)
    for folder in (tok_dir, pq_dir):
        manifest = detdata.build_manifest(str(folder), progress=False)
        manifest.save(str(folder / "manifest.json"))


def data_files(root: Path, kind: str) -> list[Path]:
    """Shard files of ``kind`` ("tokens" or "parquet"), sorted."""
    suffix = ".npy" if kind == "tokens" else ".parquet"
    return sorted(p for p in (root / kind).iterdir() if p.name.endswith(suffix))


def disk_bytes(root: Path) -> int:
    return sum(p.stat().st_size for kind in ("tokens", "parquet") for p in data_files(root, kind))


def check_rows(rows: npt.NDArray[np.integer], num_samples: int) -> npt.NDArray[np.int64]:
    """Ids of ``rows`` (shape ``(B, SEQ)``); raises `AssertionError` unless every token matches."""
    if rows.ndim != 2 or rows.shape[1] != SEQ:
        raise AssertionError(f"batch has shape {rows.shape}, expected (B, {SEQ})")
    first = rows[:, 0].astype(np.int64)
    ids = first // SEQ
    expected = first[:, None] + np.arange(SEQ, dtype=np.int64)
    bad = (first % SEQ != 0) | (ids < 0) | (ids >= num_samples) | (rows != expected).any(axis=1)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise AssertionError(
            f"row {i} of the batch is not a valid sample (first tokens {rows[i, :4].tolist()})"
        )
    return ids


def shuffle_scores(ids: npt.NDArray[np.int64]) -> dict[str, float]:
    """How shuffled a delivery order is: 0 for a uniform shuffle, 1 for sequential order.

    ``spearman``: rank correlation between delivery index and sample id.
    ``adjacent``: fraction of neighbours whose ids are consecutive (``id + 1``).
    """
    n = ids.size
    if n < 3:
        return {"spearman": float("nan"), "adjacent": float("nan")}
    ranks = np.empty(n, dtype=np.float64)
    ranks[np.argsort(ids, kind="stable")] = np.arange(n, dtype=np.float64)
    order = np.arange(n, dtype=np.float64)
    rho = float(np.corrcoef(order, ranks)[0, 1])
    adjacent = float(np.mean(np.diff(ids) == 1))
    return {"spearman": rho, "adjacent": adjacent}


def check_epochs(ids: npt.NDArray[np.int64], first_position: int, num_samples: int) -> None:
    """Within each epoch (positions ``[k n, (k+1) n)``) every id is delivered at most once."""
    epochs = (first_position + np.arange(ids.size, dtype=np.int64)) // num_samples
    for epoch in np.unique(epochs):
        part = ids[epochs == epoch]
        if np.unique(part).size != part.size:
            raise AssertionError(
                f"epoch {int(epoch)}: {part.size - np.unique(part).size} "
                "repeated sample(s) inside one epoch"
            )


def cpu_description() -> str:
    model = ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{os.cpu_count()} cores, {model or 'unknown CPU'}"
