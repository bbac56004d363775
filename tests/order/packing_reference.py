"""An independent brute-force packer: the whole corpus packed sequentially in plain Python.

Written from the ``packing-v1`` spec (detdata/order/packing.py docstring), sharing no code
with it: the document order comes from the pure-Python ``feistel-v1`` reference of
tests/order/test_order.py keyed by blake3 directly, the stream is a Python list, and every
column is computed by walking the tokens one by one.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any

import blake3

from tests.order.test_order import ref_id


def ref_document_seed(seed: int) -> int:
    return int.from_bytes(
        blake3.blake3(b"detdata:packing-v1" + struct.pack("<Q", seed)).digest(length=8), "little"
    )


def ref_order(n: int, seed: int, shuffle: bool) -> list[int]:
    if not shuffle:
        return list(range(n))
    key = ref_document_seed(seed)
    return [ref_id(n, key, k) for k in range(n)]


def brute_windows(
    docs: Sequence[Sequence[int]],
    *,
    seed: int,
    shuffle: bool,
    seq_len: int,
    labels: bool,
    bos: int | None,
    eos: int | None,
    tail: str,
    pad_id: int | None,
) -> list[dict[str, Any]]:
    """Every window of the corpus, each a dict of plain lists (and ``num_segments``)."""
    stream: list[int] = []
    owner: list[int | None] = []
    for k, d in enumerate(ref_order(len(docs), seed, shuffle)):
        eff = (
            ([bos] if bos is not None else []) + list(docs[d]) + ([eos] if eos is not None else [])
        )
        stream += eff
        owner += [k] * len(eff)
    total, width = len(stream), seq_len + int(labels)
    count = (total - int(labels)) // seq_len if tail == "drop" else -(-total // seq_len)
    out = []
    for w in range(max(0, count)):
        a = w * seq_len
        toks, own = stream[a : a + width], owner[a : a + width]
        missing = width - len(toks)
        toks += [pad_id] * missing  # type: ignore[list-item]
        own += [None] * missing
        doc_index, positions = [], []
        segment, previous, p = -1, object(), 0
        for o in own:
            if o is None:
                doc_index.append(-1)
                positions.append(0)
                continue
            if o != previous:
                segment, previous, p = segment + 1, o, 0
            doc_index.append(segment)
            positions.append(p)
            p += 1
        cu = [0] + [t for t in range(1, seq_len) if own[t] != own[t - 1]] + [seq_len]
        out.append(
            {
                "tokens": toks,
                "doc_index": doc_index,
                "position_ids": positions,
                "cu": cu,
                "num_segments": len(cu) - 1,
            }
        )
    return out
