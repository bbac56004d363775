"""Tests for `detdata.Mixture` (algorithm ``mixture-v1``).

An independent scalar reference (Python ints, written from the module docstring)
checks the vectorised implementation; golden vectors pin the output forever.
Regenerate the golden file only for a NEW algorithm version:
``python tests/datasets/test_mixture.py --write-golden`` (refuses to overwrite).
"""

from __future__ import annotations

import hashlib
import json
import math
import pickle
import struct
import sys
import time
from collections.abc import Mapping, Sequence
from fractions import Fraction
from pathlib import Path
from typing import Any

import blake3
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from detdata.base.errors import ConfigError, FormatError
from detdata.datasets.base import ArrayDataset, Stream
from detdata.datasets.mixture import Mixture
from detdata.order.feistel import GlobalOrder

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "mixture_v1.json"
MASK = (1 << 64) - 1
HYP = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


class Sized:
    """A dataset known by its size; read returns the ids (so fetch can be checked)."""

    def __init__(self, n: int) -> None:
        self.num_samples = n

    def read(self, ids: np.ndarray) -> dict[str, np.ndarray]:
        return {"id": np.asarray(ids, dtype=np.int64).copy()}

    def identity(self) -> dict[str, Any]:
        return {"type": "sized", "num_samples": self.num_samples}


def sized(**sizes: int) -> dict[str, Sized]:
    return {name: Sized(n) for name, n in sizes.items()}


# --------------------------------------------------------------------- reference
def ref_u64(tag: bytes, *words: int) -> int:
    return int.from_bytes(
        blake3.blake3(tag + b"".join(w.to_bytes(8, "little") for w in words)).digest(8), "little"
    )


def ref_source_seed(seed: int, name: str) -> int:
    digest = blake3.blake3(
        b"detdata:source-seed-v1" + seed.to_bytes(8, "little") + name.encode()
    ).digest(8)
    return int.from_bytes(digest, "little")


def ref_splitmix(z: int) -> int:
    z ^= z >> 30
    z = (z * 0xBF58476D1CE4E5B9) & MASK
    z ^= z >> 27
    z = (z * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


def ref_int_weights(weights: Sequence[Fraction]) -> list[int]:
    scale = math.lcm(*(w.denominator for w in weights))
    ints = [int(w * scale) for w in weights]
    g = math.gcd(*ints)
    return [v // g for v in ints]


def ref_tree(w: Sequence[int], seed: int, phase: int, total: int) -> list[int]:
    out = [0] * len(w)

    def go(node: int, lo: int, hi: int, t: int) -> None:
        if hi - lo == 1:
            out[lo] = t
            return
        mid = lo + (hi - lo + 1) // 2
        a, b = sum(w[lo:mid]), sum(w[lo:hi])
        left = (t * a + ref_u64(b"detdata:mixture-v1:phi", seed, phase, node) % b) // b if b else 0
        go(2 * node, lo, mid, left)
        go(2 * node + 1, mid, hi, t - left)

    go(1, 0, len(w), total)
    return out


def ref_block(w: Sequence[int], seed: int, phase: int, k: int) -> list[int]:
    lo, hi = ref_tree(w, seed, phase, 16 * k), ref_tree(w, seed, phase, 16 * k + 16)
    key = ref_u64(b"detdata:mixture-v1:block", seed, phase)
    h = [ref_splitmix((key + (16 * k + j + 1) * 0x9E3779B97F4A7C15) & MASK) for j in range(16)]
    by_hash = sorted(range(16), key=lambda j: (h[j], j))
    ranked = [s for s in range(len(w)) for _ in range(hi[s] - lo[s])]
    src = [0] * 16
    for rank, j in enumerate(by_hash):
        src[j] = ranked[rank]
    return src


def ref_prefix(w: Sequence[int], seed: int, phase: int, t: int) -> list[int]:
    k, j = divmod(t, 16)
    counts = ref_tree(w, seed, phase, 16 * k)
    for s in ref_block(w, seed, phase, k)[:j]:
        counts[s] += 1
    return counts


class Ref:
    """Scalar reference of mixture-v1 written from the docstring."""

    def __init__(
        self, seed: int, names: Sequence[str], schedule: Sequence[tuple[int, Sequence[Fraction]]]
    ) -> None:
        self.seed, self.starts = seed, [s for s, _ in schedule]
        self.weights = [ref_int_weights(w) for _, w in schedule]
        self.offsets = [[0] * len(names)]
        for i in range(len(schedule) - 1):
            used = ref_prefix(self.weights[i], seed, i, self.starts[i + 1] - self.starts[i])
            self.offsets.append([o + u for o, u in zip(self.offsets[-1], used, strict=True)])

    def locate(self, g: int) -> tuple[int, int]:
        i = max(p for p, s in enumerate(self.starts) if s <= g)
        k, j = divmod(g - self.starts[i], 16)
        block = ref_block(self.weights[i], self.seed, i, k)
        s = block[j]
        return s, self.offsets[i][s] + ref_tree(self.weights[i], self.seed, i, 16 * k)[s] + block[
            :j
        ].count(s)

    def consumed(self, g: int) -> list[int]:
        i = max(p for p, s in enumerate(self.starts) if s <= g)
        used = ref_prefix(self.weights[i], self.seed, i, g - self.starts[i])
        return [o + u for o, u in zip(self.offsets[i], used, strict=True)]


def ref_for(m: Mixture, schedule: Sequence[tuple[int, Mapping[str, Any]]]) -> Ref:
    names = sorted(schedule[0][1])
    fracs = [
        (start, [Fraction(str(w[n])) if not isinstance(w[n], Fraction) else w[n] for n in names])
        for start, w in schedule
    ]
    return Ref(m.seed, names, fracs)


# --------------------------------------------------------------------- strategies
@st.composite
def configs(draw: st.DrawFn, max_sources: int = 6, max_phases: int = 3) -> dict[str, Any]:
    num = draw(st.integers(1, max_sources))
    names = [f"s{i}" for i in range(num)]
    starts = [0, *sorted(draw(st.sets(st.integers(1, 3000), max_size=max_phases - 1)))]
    schedule = []
    for s in starts:
        weights = {n: draw(st.integers(0, 50)) for n in names}
        if not any(weights.values()):
            weights[names[0]] = 1
        schedule.append((s, weights))
    sizes = {n: draw(st.integers(1, 500)) for n in names}
    return {"sources": sized(**sizes), "schedule": schedule, "seed": draw(st.integers(0, MASK))}


def build(cfg: Mapping[str, Any]) -> Mixture:
    return Mixture(cfg["sources"], seed=cfg["seed"], schedule=cfg["schedule"], allow_zero=True)


def sha(*arrays: np.ndarray) -> str:
    h = hashlib.sha256()
    for a in arrays:
        h.update(np.ascontiguousarray(a, dtype=np.int64).tobytes())
    return h.hexdigest()


def max_abs_dev(src: np.ndarray, weights: Sequence[int]) -> list[int]:
    """max over prefixes T of |count_s(T) * W - w_s * T| per source (exact int64)."""
    total = sum(weights)
    t = np.arange(1, src.size + 1, dtype=np.int64)
    return [int(np.abs(np.cumsum(src == s) * total - w * t).max()) for s, w in enumerate(weights)]


def within_bound(dev_times_w: int, w: int, total: int, depth: int) -> bool:
    """|dev| < depth + 16 p (1 - p), with dev_times_w = |count*W - w*T| (exact ints)."""
    return dev_times_w * total < depth * total * total + 16 * w * (total - w)


# --------------------------------------------------------------------- reference & golden
@HYP
@given(cfg=configs(), data=st.data())
def test_matches_independent_reference(cfg: dict[str, Any], data: st.DataObject) -> None:
    m = build(cfg)
    ref = ref_for(m, cfg["schedule"])
    positions = data.draw(
        st.lists(st.integers(0, 6000) | st.integers(0, (1 << 62) - 1), min_size=1, max_size=12)
    )
    src, idx, ids = m.locate(np.array(positions, dtype=np.int64))
    for g, s, i, d in zip(positions, src.tolist(), idx.tolist(), ids.tolist(), strict=True):
        assert (s, i) == ref.locate(g)
        name = m.source_names[s]
        assert d == GlobalOrder(cfg["sources"][name].num_samples, ref_source_seed(m.seed, name))[i]
    p = data.draw(st.integers(0, 1 << 62))
    assert list(m.consumed(p).values()) == ref.consumed(p)


def test_reference_contiguous_with_schedule() -> None:
    schedule = [
        (0, {"a": 1, "b": 2, "c": 5}),
        (37, {"a": 3, "b": 0, "c": 1}),
        (100, {"a": 1, "b": 1, "c": 1}),
    ]
    m = Mixture(sized(a=10, b=20, c=7), seed=99, schedule=schedule, allow_zero=True)
    ref = ref_for(m, schedule)
    src, idx, _ = m.locate(np.arange(300))
    assert list(zip(src.tolist(), idx.tolist(), strict=True)) == [ref.locate(g) for g in range(300)]


def golden_payload() -> dict[str, Any]:
    positions = [*range(0, 40), 1000, 12345, 10**6 + 3, 10**9 + 7, 2**40 + 5, 2**62 - 1]
    prefixes = [0, 1, 15, 16, 17, 1000, 10**9, 2**62]
    cases = {
        "two_equal": dict(sources=sized(a=1000, b=10), weights={"a": 1, "b": 1}, seed=0),
        "five_mixed": dict(
            sources=sized(web=10**9, code=12345, math=7, books=1, wiki=999),
            weights={"web": "0.5", "code": 0.25, "math": Fraction(1, 8), "books": 3, "wiki": "1/3"},
            seed=MASK,
        ),
        "schedule": dict(
            sources=sized(x=50, y=60, z=70),
            seed=42,
            allow_zero=True,
            schedule=[
                (0, {"x": 1, "y": 0, "z": 1}),
                (1000, {"x": 1, "y": 2, "z": 3}),
                (5003, {"x": 0, "y": 1, "z": 0}),
            ],
        ),
        "single": dict(sources=sized(only=17), weights={"only": 2}, seed=7),
        "unicode": dict(
            sources=sized(**{"données": 100, "中文": 200, "Z": 5}),
            weights={"données": 2, "中文": 1, "Z": 1},
            seed=12345,
        ),
    }
    out: dict[str, Any] = {
        "algorithm": "mixture-v1",
        "positions": positions,
        "prefixes": prefixes,
        "cases": {},
    }
    for key, kwargs in cases.items():
        m = Mixture(**kwargs)
        src, idx, ids = m.locate(np.array(positions, dtype=np.int64))
        out["cases"][key] = {
            "identity": m.identity(),
            "fingerprint": m.fingerprint(),
            "source_seeds": m.source_seeds,
            "source": [m.source_names[s] for s in src.tolist()],
            "index_in_source": idx.tolist(),
            "sample_id": ids.tolist(),
            "consumed": [m.consumed(p) for p in prefixes],
            "first_4096_sha256": sha(*m.locate(np.arange(4096))),
        }
    return out


def test_golden_vectors() -> None:
    assert json.loads(GOLDEN.read_text(encoding="utf-8")) == json.loads(
        json.dumps(golden_payload())
    )


def test_golden_agrees_with_reference() -> None:
    golden = json.loads(GOLDEN.read_text(encoding="utf-8"))
    for case in golden["cases"].values():
        ident = case["identity"]
        names = sorted(ident["sources"])
        sched = [(s, [Fraction(w[n]) for n in names]) for s, w in ident["schedule"]]
        ref = Ref(ident["seed"], names, sched)
        for g, name, i in zip(
            golden["positions"], case["source"], case["index_in_source"], strict=True
        ):
            assert ref.locate(g) == (names.index(name), i)
        for n in names:
            assert case["source_seeds"][n] == ref_source_seed(ident["seed"], n)


# --------------------------------------------------------------------- proportions
BOUND_CONFIGS = [
    {"a": 1, "b": 1},
    {"a": 1, "b": 1000},
    {"a": 1, "b": 2, "c": 3},
    {"a": 5, "b": 3, "c": 11, "d": 1, "e": 2, "f": 7, "g": 13},
    {f"s{i:02d}": (i * 7) % 13 + 1 for i in range(40)},
]


@pytest.mark.parametrize("weights", BOUND_CONFIGS, ids=lambda w: f"{len(w)}src")
def test_bound_exhaustive_prefixes(weights: dict[str, int]) -> None:
    m = Mixture(sized(**dict.fromkeys(weights, 100)), weights, seed=2024)
    src, _, _ = m.locate(np.arange(100_000))
    w = list(m.phases[0].weights)
    total, depth = sum(w), math.ceil(math.log2(len(w)))
    devs = max_abs_dev(src, w)
    for s, dev in enumerate(devs):
        assert within_bound(dev, w[s], total, depth), (m.source_names[s], dev / total)
    assert max(devs) > 0  # not a degenerate all-zero check: the mixture does deviate


@HYP
@given(
    weights=st.lists(st.integers(1, 10**6), min_size=1, max_size=9),
    seed=st.integers(0, MASK),
    start=st.integers(0, 2**61),
    prefixes=st.lists(st.integers(0, 2**62), min_size=1, max_size=5),
)
def test_bound_hypothesis(weights: list[int], seed: int, start: int, prefixes: list[int]) -> None:
    names = [f"n{i}" for i in range(len(weights))]
    m = Mixture(
        sized(**dict.fromkeys(names, 1000)), dict(zip(names, weights, strict=True)), seed=seed
    )
    w = list(m.phases[0].weights)
    total, depth = sum(w), math.ceil(math.log2(len(w))) if len(w) > 1 else 0
    for p in prefixes:  # far prefixes through consumed(), exact Python ints
        got = m.consumed(p)
        for s, n in enumerate(m.source_names):
            dev = abs(got[n] * total - w[s] * p)
            assert within_bound(dev, w[s], total, depth) or (len(w) == 1 and dev == 0)
    src, _, _ = m.locate(
        np.arange(start, start + 2048)
    )  # a window far away, relative to consumed(start)
    base = m.consumed(start)
    for s, n in enumerate(m.source_names):
        counts = base[n] + np.cumsum(src == s)
        t = start + np.arange(1, 2049)
        dev = max(
            abs(int(c) * total - w[s] * int(x)) for c, x in zip(counts[::97], t[::97], strict=True)
        )
        assert within_bound(dev, w[s], total, depth) or (len(w) == 1 and dev == 0)


def test_exact_at_block_multiples_of_period() -> None:
    m = Mixture(sized(a=5, b=5, c=5), {"a": 1, "b": 2, "c": 5}, seed=1)
    assert m.consumed(8 * 16 * 1000) == {"a": 16000, "b": 32000, "c": 80000}


# --------------------------------------------------------------------- random access == sequential
@HYP
@given(cfg=configs(), data=st.data())
def test_random_access_equals_sequential(cfg: dict[str, Any], data: st.DataObject) -> None:
    m = build(cfg)
    n = 4000
    seq = m.locate(np.arange(n))
    picks = np.array(
        data.draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=200)), dtype=np.int64
    )
    got = m.locate(picks)
    for a, b in zip(got, seq, strict=True):
        assert np.array_equal(a, b[picks])
    for a, b in zip(
        m.assign(picks.reshape(-1, 1)), got[:2], strict=True
    ):  # any shape; assign == locate[:2]
        assert np.array_equal(a, b.reshape(-1, 1))
    cuts = sorted(data.draw(st.lists(st.integers(1, n - 1), max_size=8)))
    pieces = [m.locate(np.arange(lo, hi)) for lo, hi in zip([0, *cuts], [*cuts, n], strict=True)]
    for k in range(3):
        assert sha(np.concatenate([p[k] for p in pieces])) == sha(seq[k])
    p = data.draw(st.integers(0, n))
    counts = np.bincount(seq[0][:p], minlength=len(m.source_names))
    assert list(m.consumed(p).values()) == counts.tolist()


@HYP
@given(cfg=configs())
def test_each_source_consumes_a_prefix(cfg: dict[str, Any]) -> None:
    """Across phase changes no sample index is repeated or skipped: a prefix of each stream."""
    m = build(cfg)
    src, idx, ids = m.locate(np.arange(4000))
    for s, name in enumerate(m.source_names):
        mine = idx[src == s]
        assert np.array_equal(mine, np.arange(mine.size))
        assert np.array_equal(ids[src == s], m.orders[name].ids(mine))


def test_resume_inside_phase_continues_exactly() -> None:
    schedule = [(0, {"a": 1, "b": 1}), (1001, {"a": 1, "b": 9}), (5000, {"a": 4, "b": 1})]
    m = Mixture(sized(a=300, b=400), seed=5, schedule=schedule)
    full = m.locate(np.arange(8000))
    for resume in (999, 1001, 1003, 4999, 5000, 6017):
        again = Mixture(
            sized(a=300, b=400), seed=5, schedule=schedule
        )  # a fresh process would do this
        tail = again.locate(np.arange(resume, 8000))
        assert sha(*tail) == sha(*(a[resume:] for a in full))


# --------------------------------------------------------------------- seeds & periodicity
def sources_seq(m: Mixture, n: int = 8192) -> np.ndarray:
    return m.locate(np.arange(n))[0]


@pytest.mark.parametrize("weights", [{"a": 1, "b": 1}, {"a": 1, "b": 3}, {"a": 2, "b": 3, "c": 5}])
def test_not_periodic(weights: dict[str, int]) -> None:
    seq = sources_seq(Mixture(sized(**dict.fromkeys(weights, 9)), weights, seed=11))
    for period in range(1, seq.size // 2):
        assert not np.array_equal(seq[period:], seq[:-period]), period
    blocks = seq[: 16 * 256].reshape(256, 16)
    assert len({b.tobytes() for b in blocks}) > 200  # blocks are individually shuffled


def test_seeds_give_different_interleavings() -> None:
    seqs = [
        sources_seq(Mixture(sized(a=9, b=9), {"a": 1, "b": 1}, seed=s))
        for s in (0, 1, 2, 2**63, MASK)
    ]
    for i in range(len(seqs)):
        for j in range(i + 1, len(seqs)):
            assert (seqs[i] != seqs[j]).mean() > 0.3


def test_deterministic_across_instances() -> None:
    def digest() -> str:
        m = Mixture(
            sized(a=77, b=1000, c=3), {"a": 0.2, "b": "0.5", "c": Fraction(3, 10)}, seed=31337
        )
        return sha(*m.locate(np.arange(50_000))) + m.fingerprint()

    assert digest() == digest()


# --------------------------------------------------------------------- source orders
def test_adding_a_source_keeps_other_orders() -> None:
    small = Mixture(sized(a=100, b=50), {"a": 1, "b": 1}, seed=8)
    big = Mixture(sized(a=100, b=50, c=70), {"a": 1, "b": 1, "c": 5}, seed=8)
    for name in ("a", "b"):
        assert small.source_seeds[name] == big.source_seeds[name] == ref_source_seed(8, name)
        for m in (small, big):
            src, idx, ids = m.locate(np.arange(3000))
            s = m.source_names.index(name)
            assert np.array_equal(
                ids[src == s],
                GlobalOrder(m.sources[name].num_samples, ref_source_seed(8, name)).ids(
                    idx[src == s]
                ),
            )
        n = min(
            int((small.locate(np.arange(3000))[0] == small.source_names.index(name)).sum()),
            int((big.locate(np.arange(3000))[0] == big.source_names.index(name)).sum()),
        )
        seq_small = small.sample_ids(np.arange(3000))[
            small.locate(np.arange(3000))[0] == small.source_names.index(name)
        ]
        seq_big = big.sample_ids(np.arange(3000))[
            big.locate(np.arange(3000))[0] == big.source_names.index(name)
        ]
        assert np.array_equal(seq_small[:n], seq_big[:n])


def test_source_seed_is_hashed_not_arithmetic() -> None:
    assert ref_source_seed(1, "a") != ref_source_seed(0, "a") + 1
    m0, m1 = Mixture(sized(a=5), {"a": 1}, seed=0), Mixture(sized(a=5), {"a": 1}, seed=1)
    assert m0.source_seeds["a"] != m1.source_seeds["a"]
    digest = blake3.blake3(b"detdata:source-seed-v1" + struct.pack("<Q", 1) + b"a").digest(8)
    assert m1.source_seeds["a"] == struct.unpack("<Q", digest)[0]


def test_source_epochs_continue() -> None:
    m = Mixture(sized(tiny=3, big=1000), {"tiny": 1, "big": 1}, seed=4)
    src, idx, ids = m.locate(np.arange(400))
    tiny = m.source_names.index("tiny")
    t_idx, t_ids = idx[src == tiny], ids[src == tiny]
    assert t_idx.size > 30
    for e in range(t_idx.size // 3):  # each epoch of the tiny source is a permutation of its ids
        assert sorted(t_ids[3 * e : 3 * e + 3].tolist()) == [0, 1, 2]
        assert np.array_equal(
            t_ids[3 * e : 3 * e + 3],
            GlobalOrder(3, m.source_seeds["tiny"]).ids(np.arange(3 * e, 3 * e + 3)),
        )
    assert m.epochs_completed(400)["tiny"] == t_idx.size // 3


# --------------------------------------------------------------------- weights & validation
def test_equivalent_weights_same_identity() -> None:
    forms = [
        {"a": 1, "b": 3},
        {"a": 0.25, "b": 0.75},
        {"a": "1/4", "b": "3/4"},
        {"a": "0.5", "b": "1.5"},
        {"a": Fraction(2, 7), "b": Fraction(6, 7)},
        {"a": np.int64(10), "b": np.float64(30.0)},
    ]
    prints = {Mixture(sized(a=3, b=4), w, seed=1).fingerprint() for w in forms}
    assert len(prints) == 1
    m = Mixture(sized(a=3, b=4), {"a": 0.1, "b": 0.2}, seed=1)
    assert m.schedule_json() == [[0, {"a": "1/3", "b": "2/3"}]]
    assert m.phases[0].weights == (1, 2)


def test_identity_is_plain_json() -> None:
    data = {
        "a": ArrayDataset({"x": np.arange(10)}, name="a"),
        "b": ArrayDataset({"x": np.arange(5)}, name="b"),
    }
    m = Mixture(data, {"a": 2, "b": 1}, seed=3)
    ident = m.identity()
    assert json.loads(json.dumps(ident)) == ident
    assert ident["type"] == "mixture" and ident["algorithm"] == "mixture-v1"
    assert ident["source_order_algorithm"] == "feistel-v1"
    assert ident["sources"] == {"a": data["a"].identity(), "b": data["b"].identity()}
    assert ident["schedule"] == [[0, {"a": "2/3", "b": "1/3"}]]
    canon = json.dumps(ident, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    assert m.fingerprint() == "b3:" + blake3.blake3(canon).hexdigest()
    assert Mixture(data, {"a": 2, "b": 1}, seed=4).fingerprint() != m.fingerprint()
    assert Mixture(data, {"a": 3, "b": 1}, seed=3).fingerprint() != m.fingerprint()


@pytest.mark.parametrize(
    ("weights", "needle"),
    [
        ({"a": -1, "b": 1}, "negative"),
        ({"a": 0, "b": 1}, "allow_zero"),
        ({"a": float("nan"), "b": 1}, "not finite"),
        ({"a": float("inf"), "b": 1}, "not finite"),
        ({"a": True, "b": 1}, "bool"),
        ({"a": 1, "b": 1, "c": 1}, "unknown source"),
        ({"a": 1}, "no weight for source(s) ['b']"),
        ({"a": "abc", "b": 1}, "'a'"),
        ({"a": [1], "b": 1}, "unsupported type"),
        ({"a": 0.1, "b": 1 / 3}, "2**31"),
        ({"a": 2**31, "b": 1}, "round the weights"),
    ],
)
def test_bad_weights(weights: dict[str, Any], needle: str) -> None:
    with pytest.raises(ConfigError, match=None) as info:
        Mixture(sized(a=3, b=3), weights, seed=0)
    assert needle in str(info.value)


def test_bad_sources_and_schedule() -> None:
    with pytest.raises(ConfigError, match="non-empty"):
        Mixture({}, {}, seed=0)
    with pytest.raises(ConfigError, match="'e' is empty"):
        Mixture(sized(a=3, e=0), {"a": 1, "e": 1}, seed=0)
    with pytest.raises(ConfigError, match="expected a Dataset"):
        Mixture({"a": [1, 2]}, {"a": 1}, seed=0)  # type: ignore[dict-item]
    with pytest.raises(ConfigError, match="exactly one of"):
        Mixture(sized(a=3), {"a": 1}, seed=0, schedule=[(0, {"a": 1})])
    with pytest.raises(ConfigError, match="start at position 0"):
        Mixture(sized(a=3), seed=0, schedule=[(5, {"a": 1})])
    with pytest.raises(ConfigError, match="strictly increase"):
        Mixture(sized(a=3), seed=0, schedule=[(0, {"a": 1}), (10, {"a": 2}), (10, {"a": 1})])
    with pytest.raises(ConfigError, match=r"schedule\[1\] weights"):
        Mixture(sized(a=3, b=3), seed=0, schedule=[(0, {"a": 1, "b": 1}), (10, {"a": 2})])
    with pytest.raises(ConfigError, match="every weight is 0"):
        Mixture(sized(a=3, b=3), {"a": 0, "b": 0}, seed=0, allow_zero=True)
    with pytest.raises(ConfigError, match="seed"):
        Mixture(sized(a=3), {"a": 1}, seed=-1)
    m = Mixture(sized(a=3), {"a": 1}, seed=0)
    for bad in (np.array([-1]), np.array([2**62]), np.array([0.5])):
        with pytest.raises(ConfigError, match="positions"):
            m.locate(bad)


def test_allow_zero_source_never_appears() -> None:
    m = Mixture(sized(a=3, b=3, c=3), {"a": 1, "b": 0, "c": 2}, seed=0, allow_zero=True)
    src = m.locate(np.arange(20_000))[0]
    assert m.source_names.index("b") not in set(src.tolist())
    assert m.consumed(10**15)["b"] == 0


# --------------------------------------------------------------------- stream / fetch
def test_fetch_rows_in_position_order() -> None:
    data = {
        "a": ArrayDataset({"x": np.arange(100) + 1000, "y": np.ones((100, 3))}, name="a"),
        "b": ArrayDataset({"x": np.arange(7) + 5000, "y": np.zeros((7, 3))}, name="b"),
    }
    m = Mixture(data, {"a": 3, "b": 1}, seed=9)
    assert isinstance(m, Stream)
    positions = np.array([5, 900, 3, 3, 17, 123456], dtype=np.int64)
    batch = m.fetch(positions)
    src, _, ids = m.locate(positions)
    for row, (s, i) in enumerate(zip(src.tolist(), ids.tolist(), strict=True)):
        expect = data[m.source_names[s]].read(np.array([i]))
        assert batch["x"][row] == expect["x"][0]
        assert np.array_equal(batch["y"][row], expect["y"][0])
    assert np.array_equal(m.sample_ids(positions), ids)
    assert m.fetch(np.empty(0, dtype=np.int64))["x"].shape == (0,)


def test_pickle_round_trip_for_worker_processes() -> None:
    m = Mixture(sized(a=10, b=20), seed=3, schedule=[(0, {"a": 1, "b": 2}), (50, {"a": 5, "b": 1})])
    clone = pickle.loads(pickle.dumps(m))
    positions = np.arange(0, 500, 7)
    assert sha(*clone.locate(positions)) == sha(*m.locate(positions))
    assert clone.fingerprint() == m.fingerprint()


def test_fetch_mismatched_columns() -> None:
    data = {
        "a": ArrayDataset({"x": np.arange(10)}, name="a"),
        "b": ArrayDataset({"z": np.arange(10)}, name="b"),
    }
    with pytest.raises(FormatError, match="different columns"):
        Mixture(data, {"a": 1, "b": 1}, seed=0).fetch(np.arange(32))
    data = {
        "a": ArrayDataset({"x": np.arange(10)}, name="a"),
        "b": ArrayDataset({"x": np.arange(10, dtype=np.int16)}, name="b"),
    }
    with pytest.raises(FormatError, match="same dtype"):
        Mixture(data, {"a": 1, "b": 1}, seed=0).fetch(np.arange(32))


# --------------------------------------------------------------------- continue_from
def test_continue_from_changes_weights_without_repeat_or_gap() -> None:
    sources = sized(a=500, b=600, c=700)
    old = Mixture(sources, {"a": 1, "b": 1, "c": 1}, seed=77)
    for position in (0, 1, 1000, 1013):
        saved = json.loads(json.dumps(old.identity()))  # as stored in a JSON loader state
        new = Mixture(sources, {"a": 1, "b": 0, "c": 5}, seed=77, allow_zero=True).continue_from(
            saved, position
        )
        before, after = old.locate(np.arange(position)), new.locate(np.arange(6000))
        for a, b in zip(before, after, strict=True):
            assert np.array_equal(a, b[:position])
        src, idx, _ = after
        for s in range(3):
            mine = idx[src == s]
            assert np.array_equal(mine, np.arange(mine.size))  # no repeat, no gap
        assert m_weights(new, position) == {
            "a": Fraction(1, 6),
            "b": Fraction(0),
            "c": Fraction(5, 6),
        }
        tail = src[position:]
        assert (tail == new.source_names.index("b")).sum() == 0
        assert new.consumed(position) == old.consumed(position)


def m_weights(m: Mixture, position: int) -> dict[str, Fraction]:
    return m.weights_at(position)


def test_continue_from_same_weights_is_identity() -> None:
    schedule = [(0, {"a": 1, "b": 1}), (500, {"a": 1, "b": 4})]
    old = Mixture(sized(a=5, b=6), seed=1, schedule=schedule)
    for position in (0, 10, 500, 777):
        again = Mixture(sized(a=5, b=6), seed=1, schedule=schedule).continue_from(
            old.identity(), position
        )
        assert again.fingerprint() == old.fingerprint()


def test_continue_from_keeps_history_and_chains() -> None:
    src = sized(a=50, b=60)
    m1 = Mixture(src, {"a": 1, "b": 1}, seed=2)
    m2 = Mixture(src, {"a": 3, "b": 1}, seed=2).continue_from(m1.identity(), 100)
    m3 = Mixture(src, {"a": 1, "b": 7}, seed=2).continue_from(m2.identity(), 250)
    assert [p for p, _ in m3.schedule_json()] == [0, 100, 250]
    full = m3.locate(np.arange(1000))
    assert sha(*(a[:250] for a in full)) == sha(*m2.locate(np.arange(250)))
    for s in range(2):
        mine = full[1][full[0] == s]
        assert np.array_equal(mine, np.arange(mine.size))


def test_continue_from_refuses_other_mixtures() -> None:
    m = Mixture(sized(a=5, b=6), {"a": 1, "b": 1}, seed=1)
    saved = m.identity()
    with pytest.raises(ConfigError, match="seed: saved 1, now 2"):
        Mixture(sized(a=5, b=6), {"a": 1, "b": 2}, seed=2).continue_from(saved, 10)
    with pytest.raises(ConfigError, match=r"sources added: \['c'\]"):
        Mixture(sized(a=5, b=6, c=1), {"a": 1, "b": 2, "c": 1}, seed=1).continue_from(saved, 10)
    with pytest.raises(ConfigError, match="source 'b' identity differs"):
        Mixture(sized(a=5, b=7), {"a": 1, "b": 2}, seed=1).continue_from(saved, 10)
    with pytest.raises(ConfigError, match="not a mixture"):
        m.continue_from({"type": "ordered"}, 10)
    with pytest.raises(ConfigError, match="algorithm"):
        m.continue_from({**saved, "algorithm": "mixture-v0"}, 10)
    with pytest.raises(ConfigError, match="position"):
        m.continue_from(saved, -1)


# --------------------------------------------------------------------- golden writer
def _write_golden() -> None:
    if GOLDEN.exists():
        raise SystemExit(
            f"{GOLDEN} exists: golden vectors are generated once; a new algorithm gets a new file"
        )
    GOLDEN.parent.mkdir(parents=True, exist_ok=True)
    GOLDEN.write_text(
        json.dumps(golden_payload(), indent=1, ensure_ascii=False, sort_keys=True) + "\n",
        encoding="utf-8",
    )


if __name__ == "__main__" and "--write-golden" in sys.argv:
    _write_golden()


def test_position_memo_under_reader_threads() -> None:
    """Reader threads (worker_mode="thread") share a Mixture and its position memo
    (`ChunkMemo`). A cache hit raced with another thread's eviction and raised KeyError:
    here the other thread is made to run exactly between the lookup and the LRU update."""
    import threading
    from collections import OrderedDict

    from detdata.order.memo import ChunkMemo

    memo = ChunkMemo(lambda p: (p * 3 + 1,), chunk=16, slots=1)

    class SwitchAfterHit(OrderedDict[int, Any]):
        armed = False

        def get(self, key: int, default: Any = None) -> Any:
            value = super().get(key, default)
            if value is not None and self.armed:
                self.armed = False
                rival = threading.Thread(target=memo, args=(np.arange(40, 43),))  # evicts chunk 0
                rival.start()
                rival.join(timeout=0.5)  # a lock held across lookup + update makes it wait
            return value

    memo._cache._values = SwitchAfterHit()
    p = np.arange(3, 6, dtype=np.int64)
    memo(p)
    memo._cache._values.armed = True
    assert np.array_equal(memo(p)[0], p * 3 + 1)
    time.sleep(0.1)
    assert np.array_equal(memo(np.arange(40, 43))[0], np.arange(40, 43) * 3 + 1)
    errors: list[str] = []

    def hammer(seed: int) -> None:  # and the plain stress version of the same race
        rng = np.random.default_rng(seed)
        try:
            for _ in range(5000):
                start = int(rng.integers(0, 48))
                q = np.arange(start, start + 3, dtype=np.int64)
                if not np.array_equal(memo(q)[0], q * 3 + 1):
                    errors.append("wrong values")
        except Exception as exc:
            errors.append(repr(exc))

    memo._cache._values = OrderedDict()
    threads = [threading.Thread(target=hammer, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    m = Mixture(sized(a=1000, b=300), {"a": 2, "b": 1}, seed=12)
    q = np.arange(5000, 5100, dtype=np.int64)
    assert np.array_equal(pickle.loads(pickle.dumps(m)).fetch(q)["id"], m.locate(q)[2])
