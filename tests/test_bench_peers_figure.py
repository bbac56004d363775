"""The README's benchmark figure (issue 34): drawn from the committed peers result, with the peers.

`benchmarks.peers.figure` draws what ``benchmarks/results/peers.json`` holds; the series it
draws are checked row by row against the JSON (the benchmark's own output), and the PNG is a
real, non-trivial image.
"""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.peers import figure
from tests.cli.test_plots import check_png

RESULT = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "peers.json"


def test_figure_draws_every_loader_of_the_peers_result(tmp_path: Path) -> None:
    report = json.loads(RESULT.read_text())
    for table, _, _ in figure.TABLES:
        rows = [r for r in report["rows"] if r["table"] == table and not r.get("na")]
        drawn = figure.bars(report, table)
        assert [label for label, _, _ in drawn] == [r["label"].replace("`", "") for r in rows]
        for (_, w0, w2), r in zip(drawn, rows, strict=True):
            for value, key in ((w0, "w0"), (w2, "w2")):
                run = r["results"].get(key)
                assert value == (run["whole_sps"] if run and run["ok"] else None)
    peers = {r["contender"] for r in report["rows"] if r["table"] == "tokens"}
    assert {"litdata", "grain-numpy", "wds", "mds", "stateful", "torch", "detdata"} <= peers
    resumed = figure.resumes(report)
    detdata_row = next(r for r in resumed if r[0].startswith("detdata"))
    assert detdata_row[2] is not None  # only detdata resumes at 1e9 without running there
    assert all(r[2] is None for r in resumed if not r[0].startswith("detdata"))
    figure.plot(report, tmp_path / "peers.png")
    check_png(tmp_path / "peers.png")


def test_figure_reads_in_greyscale_and_names_its_units(tmp_path: Path) -> None:
    """Issue 46: the resume axis names its unit, every axis says what it counts, and the two
    series of each panel differ by hatch, not by colour alone."""
    from matplotlib.figure import Figure

    report = json.loads(RESULT.read_text())
    fig = Figure()
    ax = fig.subplots()
    figure._barh(
        ax, figure.resumes(report), ("resume at 40k", "resume at 1e9"), log=True, seconds=True
    )
    assert "seconds" in ax.get_xlabel()
    hatches = {p.get_hatch() or "" for c in ax.containers for p in c.patches}
    assert len(hatches) == 2, hatches
    shades = {
        tuple(round(x, 3) for x in p.get_facecolor()[:3]) for c in ax.containers for p in c.patches
    }
    greys = {round(0.299 * r + 0.587 * g + 0.114 * b, 2) for r, g, b in shades}
    assert len(greys) == 2, greys  # the two shades differ in luminance too
    fig2 = Figure()
    ax2 = fig2.subplots()
    figure._barh(ax2, figure.bars(report, "tokens"), ("0 workers", "2 workers"), log=False)
    assert "samples" in ax2.get_xlabel()
