"""Markdown table and PNG plot of a `benchmarks.throughput` result document."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _f(value: float | None, fmt: str, scale: float = 1.0) -> str:
    return "n/a" if value is None else format(value * scale, fmt)


def markdown(doc: dict[str, Any]) -> str:
    s, m, c = doc["settings"], doc["machine"], doc["ceilings"]
    lines = [
        "# Throughput and resume: detdata vs the vanilla DataLoader",
        "",
        f"Machine: {m['cpu']}, {m['memory_gib']} GiB RAM, {m['platform']}; "
        f"Python {m['python']}, torch {m['torch']}, numpy {m['numpy']}, "
        f"pyarrow {m['pyarrow']}, torchdata {m['torchdata']}. "
        f"Load average before/after: {_load(doc['load_before'])} / {_load(doc['load_after'])}.",
        "",
        f"Data: {s['num_samples']:,} samples of {s['bytes_per_sample']} B (512 int32 tokens) per "
        f"format ({s['bytes_per_format'] / 1e6:.0f} MB each; {s['disk_bytes'] / 1e6:.0f} MB on "
        f"disk): `.npy` token shards ({s['data']['shards']} shards), Parquet `list<int32>` "
        f"({s['data']['shards']} shards, row groups of {s['data']['row_group']}, snappy). "
        f"Batch {s['batch']}, shuffled; {s['repeats']} interleaved round(s), each run in its own "
        f"process; medians. Throughput = steady state over {s['budget_s']} s after the first batch "
        f"and {s['warmup']} warm-up batches, wall time with no check time subtracted (the timed "
        f"loop copies each row's first token, which identifies and checks the sample; warm-up "
        f"and 64 later batches are checked token by token, untimed).",
        "",
        f"Ceilings (same run): memcpy {_f(c.get('memcpy_gbs'), '.2f')} GB/s, page-cache read "
        f"{_f(c.get('page_cache_read_gbs'), '.2f')} GB/s, random 2 KiB-row gather from a warm "
        f"memmap {_f(c.get('random_row_gather_gbs'), '.2f')} GB/s.",
        "",
        "| data | loader | workers | samples/s | MB/s | x vanilla | % page cache "
        "| first batch (fresh) "
        f"| first {s['warmup'] + 1} batches "
        f"| first batch, resume @{s['resume_at']:,} | resume @1e9 | peak RSS main / workers (MB) "
        "| shuffle rho / adjacent | validated |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in doc["summary"]:
        how = {
            "vanilla": " (skip)",
            "vanilla-batched": " (skip)",
            "stateful": " (state)",
            "detdata": " (state)",
        }.get(r["contender"], "")
        resume = _f(r["ttfb_resume_s"], ".1f", 1e3) + " ms" + how if r["ttfb_resume_s"] else "n/a"
        far = (
            _f(r["ttfb_far_s"], ".1f", 1e3) + f" ms ({_f(r['far_over_fresh'], '.2f')}x fresh)"
            if r["ttfb_far_s"]
            else "n/a"
        )
        valid = "yes" if r["validated"] else "NO: " + "; ".join(r["errors"])[:80]
        if r["exact_order"]:
            valid += " (exact order)"
        lines.append(
            f"| {r['data']} | {r['label']} | {r['workers']} | {_f(r['samples_per_s'], ',.0f')} "
            f"| {_f(r['mb_per_s'], ',.0f')} | {_f(r['x_vanilla'], '.2f')} "
            f"| {_f(r['frac_page_cache'], '.1f', 100)}% | {_f(r['ttfb_fresh_s'], '.1f', 1e3)} ms "
            f"| {_f(r['warmup_s'], '.0f', 1e3)} ms "
            f"| {resume} | {far} | {_f(r['peak_rss_main_mb'], '.0f')} / "
            f"{_f(r['peak_rss_worker_mb'], '.0f')} | {_f(r['spearman'], '.3f')} / "
            f"{_f(r['adjacent'], '.4f')} | {valid} |"
        )
    lines += [
        "",
        "Not run: " + "; ".join(f"{k}: {v}" for k, v in doc["skipped"].items()) + ".",
        "",
        "Notes: vanilla loaders resume by replaying and discarding batches; a resume at 1e9 "
        "would replay 1e9 samples, so it is not run for them (nor for StatefulDataLoader, "
        "which fast-forwards its sampler index by index). Peak RSS includes file pages "
        "mapped from the page cache (memmaps) and, for Parquet, the decoded tables/row "
        "groups; 'workers' is the largest worker process. 'rho' is the rank correlation "
        "of delivery order with sample id, 'adjacent' the fraction of consecutive-id "
        "neighbours (both ~0 when shuffled, 1 when sequential).",
        "",
    ]
    return "\n".join(lines)


def _load(load: Any) -> str:
    return "/".join(f"{x:.1f}" for x in load)


def plot(doc: dict[str, Any], path: Path) -> None:
    """Throughput bars per data kind (with the ceilings) and time-to-first-batch bars, as PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = doc["summary"]
    kinds = list(dict.fromkeys(r["data"] for r in rows))
    fig, axes = plt.subplots(1, len(kinds) + 1, figsize=(6 * (len(kinds) + 1), 5))
    for ax, kind in zip(axes, kinds, strict=False):
        _throughput_axes(ax, doc, kind)
    _ttfb_axes(axes[-1], doc)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _throughput_axes(ax: Any, doc: dict[str, Any], kind: str) -> None:
    rows = doc["summary"]
    names = list(dict.fromkeys(r["contender"] for r in rows))
    workers = sorted({r["workers"] for r in rows})
    width = 0.8 / max(1, len(workers))
    for j, nw in enumerate(workers):
        vals = []
        for name in names:
            row = next(
                (
                    r
                    for r in rows
                    if r["data"] == kind and r["contender"] == name and r["workers"] == nw
                ),
                None,
            )
            vals.append((row["samples_per_s"] or 0) if row else 0)
        xs = [i + j * width for i in range(len(names))]
        ax.bar(xs, vals, width, label=f"num_workers={nw}")
    per_sample = doc["settings"]["bytes_per_sample"]
    for key, style, text in (
        ("page_cache_read_gbs", "--", "page-cache read"),
        ("random_row_gather_gbs", ":", "random 2 KiB-row gather"),
    ):
        gbs = doc["ceilings"].get(key)
        if gbs:
            ax.axhline(
                gbs * 1e9 / per_sample, color="gray", linestyle=style, label=f"ceiling: {text}"
            )
    ax.set_xticks([i + width * (len(workers) - 1) / 2 for i in range(len(names))])
    ax.set_xticklabels(names, rotation=25, ha="right")
    ax.set_yscale("log")
    ax.set_ylabel("samples/s (log)")
    ax.set_title(f"{kind}: throughput (batch {doc['settings']['batch']})")
    ax.legend(fontsize=8)


def _ttfb_axes(ax: Any, doc: dict[str, Any]) -> None:
    rows = doc["summary"]
    first_workers = min(r["workers"] for r in rows)
    labels, fresh, resume, far = [], [], [], []
    for r in rows:
        if r["workers"] != first_workers or r["ttfb_resume_s"] is None:
            continue
        labels.append(f"{r['data']}\n{r['contender']}")
        fresh.append((r["ttfb_fresh_s"] or 0) * 1e3)
        resume.append((r["ttfb_resume_s"] or 0) * 1e3)
        far.append((r["ttfb_far_s"] or 0) * 1e3)
    xs = list(range(len(labels)))
    ax.bar([x - 0.27 for x in xs], fresh, 0.27, label="fresh start")
    ax.bar(xs, resume, 0.27, label=f"resume @{doc['settings']['resume_at']:,}")
    ax.bar([x + 0.27 for x in xs], far, 0.27, label="resume @1e9 (detdata)")
    ax.set_xticks(xs)
    ax.set_xticklabels(labels, rotation=30, ha="right", fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("time to first batch, ms (log)")
    ax.set_title(f"time to first batch, num_workers={first_workers}")
    ax.legend(fontsize=8)
