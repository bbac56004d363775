"""The README's benchmark figure from a peers result: ``python -m benchmarks.peers.figure``.

Reads ``benchmarks/results/peers.json`` (written by ``python -m benchmarks.peers``, which also
calls `plot` after a run) and writes ``benchmarks/results/peers.png``: whole-run samples/s of
detdata and each peer loader with 0 and 2 workers (tokens; a GIL-holding transform; Parquet),
and the time to the first batch after resuming at sample 40,000 and 1e9. Nothing is re-run:
the picture is the JSON's numbers (`bars`, `resumes`), drawn.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parents[1] / "results"
TABLES = (  # (table, title, log scale)
    ("tokens", "2 KiB token samples", True),
    ("gil", "with a GIL-holding transform", False),
    ("parquet", "Parquet rows", False),
)
#: Series told apart by fill and hatch as well as shade, so the picture reads in greyscale.
SHADES = ("#4c4c4c", "#bdbdbd")
HATCHES = ("", "//")
RESUMES = (("resume_40000", "resume at 40k"), ("resume_1000000000", "resume at 1e9"))


def _plain(label: str) -> str:
    return label.replace("`", "")


def bars(report: dict[str, Any], table: str) -> list[tuple[str, float | None, float | None]]:
    """``(loader, samples/s with 0 workers, with 2 workers)`` of ``table``'s rows (whole run:
    constructing the loader to the last batch); None where the run is absent or failed."""

    def sps(result: dict[str, Any] | None) -> float | None:
        return float(result["whole_sps"]) if result and result.get("ok") else None

    return [
        (_plain(r["label"]), sps(r["results"].get("w0")), sps(r["results"].get("w2")))
        for r in report["rows"]
        if r["table"] == table and not r.get("na")
    ]


def resumes(report: dict[str, Any]) -> list[tuple[str, float | None, float | None]]:
    """``(loader, seconds to the first batch resumed at 40k, at 1e9)`` of the token loaders
    that were resumed; None where not possible (n/a in the table)."""

    def seconds(result: dict[str, Any] | None) -> float | None:
        return float(result["resume_s"]) if result and result.get("ok") else None

    return [
        (_plain(r["label"]), *(seconds(r["results"].get(key)) for key, _ in RESUMES))
        for r in report["rows"]
        if r["table"] == "tokens" and "resume_40000" in r["results"]
    ]


def _text(value: float, seconds: bool) -> str:
    return f"{value * 1e3:,.0f} ms" if seconds else f"{value / 1e3:,.0f}k"


def _barh(
    ax: Any,
    rows: list[tuple[str, float | None, float | None]],
    names: tuple[str, ...],
    *,
    log: bool,
    seconds: bool = False,
) -> None:
    height = 0.4
    for j, name in enumerate(names):
        ys = [i + (j - 0.5) * height for i in range(len(rows))]
        values = [row[1 + j] for row in rows]
        ax.barh(
            ys,
            [v or 0 for v in values],
            height,
            label=name,
            color=SHADES[j % len(SHADES)],
            edgecolor="black",
            hatch=HATCHES[j % len(HATCHES)],
        )
        for y, v in zip(ys, values, strict=True):
            if v:
                ax.text(v, y, " " + _text(v, seconds), va="center", fontsize=7)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([row[0] for row in rows], fontsize=8)
    for tick, row in zip(ax.get_yticklabels(), rows, strict=True):
        if row[0].startswith("detdata"):
            tick.set_fontweight("bold")
    ax.invert_yaxis()
    if log:
        from matplotlib.ticker import NullFormatter

        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(NullFormatter())
    ax.margins(x=0.12)
    ax.set_xlabel(
        "seconds to the first batch (log)" if seconds else "samples per second", fontsize=8
    )
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))


def plot(report: dict[str, Any], path: Path) -> None:
    """Draw `bars` per table and `resumes` into the PNG ``path``."""
    from matplotlib.figure import Figure

    heights = [len(bars(report, t)) for t, _, _ in TABLES] + [len(resumes(report))]
    fig = Figure(figsize=(11, 2.2 + 0.36 * sum(heights)), layout="constrained")
    axes = fig.subplots(len(heights), 1, gridspec_kw={"height_ratios": heights})
    for ax, (table, title, log) in zip(axes, TABLES, strict=False):
        _barh(ax, bars(report, table), ("0 workers", "2 workers"), log=log)
        scale = " (log)" if log else ""
        ax.set_title(f"{title}: samples/s, whole run{scale}", loc="left", fontsize=10)
    _barh(axes[-1], resumes(report), tuple(t for _, t in RESUMES), log=True, seconds=True)
    axes[-1].set_title(
        "time to the first batch after a resume, seconds (log; no bar: not possible)",
        loc="left",
        fontsize=10,
    )
    m = report["machine"]
    fig.suptitle(
        f"detdata and peer loaders on the same bytes (batch {report['batch']}, shuffled; "
        f"{m['cpu']}, load {m['load_average_before'][0]:.1f}; medians)",
        fontsize=10,
    )
    fig.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> int:
    import json

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--json", type=Path, default=RESULTS / "peers.json")
    p.add_argument("--out", type=Path, default=RESULTS / "peers.png")
    args = p.parse_args(argv)
    plot(json.loads(args.json.read_text()), args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
