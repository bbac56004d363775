"""Pretraining on a Megatron ``.bin``/``.idx`` corpus with packing and intra-document masks.

The corpus is read in place (no conversion): `detdata.build_manifest` hashes both files
of each pair into one manifest (the ``.idx`` is part of the identity), `Documents` reads
the document boundaries from the ``.idx``, and `PackedWindows` packs shuffled documents
into ``seq_len`` windows with ``doc_index`` / ``position_ids`` / ``cu_seqlens`` for
attention that never crosses a document. The model here is a tiny causal attention
layer on CPU, masked from ``doc_index``; on a GPU, pass ``cu_seqlens`` to a varlen
kernel instead (see `_varlen_cu_seqlens`). The loader state is saved with the
checkpoint; a rerun resumes exactly where the last one stopped.

    python examples/pretrain_megatron_packed.py --workdir /tmp/mp --steps 12
"""

from __future__ import annotations

import argparse
import itertools
import json
import struct
from pathlib import Path

import blake3
import numpy as np
import torch
from torch import nn

import detdata
from detdata.datasets.documents import Documents
from detdata.datasets.packed import PackedWindows

VOCAB, EOS = 512, 1


def write_megatron_corpus(root: Path, *, pairs: int = 2, documents: int = 300) -> Path:
    """Tiny Megatron indexed datasets (``.bin`` + ``.idx``), written from the published
    layout (megatron/core/datasets/indexed_dataset.py): one sequence per document."""
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for p in range(pairs):
        lengths = rng.integers(3, 120, size=documents).astype(np.int64)
        rng.integers(2, VOCAB, size=int(lengths.sum()), dtype=np.uint16).tofile(
            root / f"corpus-{p}_text_document.bin"
        )
        pointers = np.concatenate([[0], np.cumsum(lengths)[:-1]]) * 2  # uint16: 2 bytes
        with open(root / f"corpus-{p}_text_document.idx", "wb") as fh:
            fh.write(b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, 8, documents, documents + 1))
            fh.write(lengths.astype("<i4").tobytes())
            fh.write(pointers.astype("<i8").tobytes())
            fh.write(np.arange(documents + 1, dtype="<i8").tobytes())
    return root


class TinyLM(nn.Module):
    """Embedding, one causal self-attention layer restricted to each document, a head."""

    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.pos = nn.Embedding(256, dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.head = nn.Linear(dim, VOCAB)

    def forward(
        self, tokens: torch.Tensor, positions: torch.Tensor, doc: torch.Tensor
    ) -> torch.Tensor:
        x = self.embed(tokens) + self.pos(positions)  # positions restart at every document
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        n = tokens.shape[1]
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        same_doc = doc[:, :, None] == doc[:, None, :]  # the block-diagonal mask of cu_seqlens
        out = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=same_doc & causal)
        return self.head(x + out)


def _varlen_cu_seqlens(batch: dict[str, torch.Tensor], seq_len: int) -> torch.Tensor:
    """The batch's cu_seqlens for flash-attention's varlen kernels (rows concatenated)."""
    parts = [torch.zeros(1, dtype=torch.int32)]
    for b in range(batch["cu_seqlens"].shape[0]):
        n = int(batch["num_segments"][b])
        parts.append(batch["cu_seqlens"][b, 1 : n + 1] + b * seq_len)
    return torch.cat(parts)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workdir", default="/tmp/detdata-pretrain-megatron")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--record", help="append the rows of every trained step to this JSONL file")
    args = ap.parse_args()
    work = Path(args.workdir)
    if not (work / "manifest.json").exists():
        corpus = write_megatron_corpus(work / "corpus")
        detdata.build_manifest(str(corpus)).save(str(work / "manifest.json"))

    torch.manual_seed(0)
    model = TinyLM()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)

    # --- detdata: documents from the .idx, packed windows, a resumable loader -------------
    documents = Documents(str(work / "manifest.json"), index_dir=work / "index")  # verified
    packed = PackedWindows(documents, args.seq_len, seed=17, eos=EOS)
    loader = detdata.DataLoader(packed, global_batch_size=8, micro_batch_size=4, seed=1234)
    ckpt = work / "ckpt.pt"
    if ckpt.exists():
        saved = torch.load(ckpt, weights_only=True)
        model.load_state_dict(saved["model"])
        optim.load_state_dict(saved["optim"])
        loader.load_state_dict(json.loads((work / "loader.json").read_text()))
    # -------------------------------------------------------------------------------------

    per_step = loader.global_batch_size // loader.layout.samples_per_micro_step
    remaining = max(0, args.steps - loader.step) * per_step
    for batch in itertools.islice(loader, remaining):
        if args.record:
            delivered_at = loader.samples_consumed - loader.layout.samples_per_micro_step
            record(args.record, delivered_at // loader.global_batch_size, batch)
        tokens = batch["tokens"].long()
        doc = batch["doc_index"][:, :-1]
        cu = _varlen_cu_seqlens(batch, args.seq_len)
        assert int(cu[-1]) == tokens.shape[0] * args.seq_len  # what a varlen kernel would take
        logits = model(tokens[:, :-1], batch["position_ids"][:, :-1].long(), doc)
        # a target in another document than its input is not learned from
        keep = (batch["doc_index"][:, 1:] == doc).flatten()
        loss = nn.functional.cross_entropy(
            logits.flatten(0, 1)[keep], tokens[:, 1:].flatten()[keep]
        )
        optim.zero_grad()
        loss.backward()
        optim.step()
    torch.save({"model": model.state_dict(), "optim": optim.state_dict()}, ckpt)
    (work / "loader.json").write_text(json.dumps(loader.state_dict()))
    weights = blake3.blake3(b"".join(p.detach().numpy().tobytes() for p in model.parameters()))
    print(
        f"documents {documents.num_documents} windows {packed.num_samples} "
        f"step {loader.step} samples_consumed {loader.samples_consumed} "
        f"weights {weights.hexdigest()[:16]}"
    )


def record(path: str, step: int, batch: dict[str, torch.Tensor]) -> None:
    """Append the step and a digest of every row this step trained on (for the resume test)."""
    rows = [blake3.blake3(r.numpy().tobytes()).hexdigest()[:16] for r in batch["tokens"]]
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(json.dumps({"step": step, "rows": rows}) + "\n")


if __name__ == "__main__":
    main()
