"""Pictures (issue 34): `detdata diff --plot`, the mixture share plot, the batch-schedule plot.

Each picture is drawn from a data series; the series is compared with a brute-force reference
(per-step bytes of two real runs, the sources a real loader delivered, Megatron's ramp-up
formula step by step), and the PNG is checked to be a real, non-trivial image. Without
matplotlib a plot raises `DependencyError` with the install line; ``import detdata`` and the
CLI's parser never import matplotlib.
"""

from __future__ import annotations

import itertools
import json
import struct
import subprocess
import sys
import textwrap
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest

import detdata
from detdata.cli.plots import (
    SAME,
    diff_runs,
    mixture_shares,
    plot_batch_schedule,
    plot_diff,
    plot_mixture_shares,
    schedule_curve,
)
from detdata.loading.trace import compare, read_trace

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def check_png(path: Path) -> None:
    """A real PNG of a sensible size whose pixels are not one flat colour."""
    import matplotlib.image

    raw = path.read_bytes()
    assert raw[:8] == PNG_SIGNATURE, raw[:16]
    width, height = struct.unpack(">II", raw[16:24])  # IHDR
    assert width >= 600 and height >= 300, (width, height)
    assert len(raw) > 10_000, len(raw)
    pixels = matplotlib.image.imread(path)
    colours = np.unique(pixels.reshape(-1, pixels.shape[-1]), axis=0)
    assert len(colours) > 20, len(colours)


# ------------------------------------------------------------------ trace diff
BAD_SAMPLES = (5, 123, 300)


def _dataset(bad: tuple[int, ...]) -> detdata.ArrayDataset:
    x = np.arange(400 * 5, dtype=np.int32).reshape(400, 5)
    for i in bad:
        x[i, 0] += 1
    return detdata.ArrayDataset({"x": x})


def _run(bad: tuple[int, ...], trace: Path, steps: int) -> list[bytes]:
    """A real traced run of ``steps`` global steps (2 micro batches each); each step's bytes."""
    dl = detdata.DataLoader(
        _dataset(bad),
        global_batch_size=8,
        micro_batch_size=4,
        seed=4,
        options=detdata.LoaderOptions(trace=trace),
    )
    micro: list[bytes] = []
    for batch in dl:
        micro.append(batch["x"].numpy().tobytes())
        if len(micro) == 2 * steps:
            break
    dl.close()
    return [micro[2 * s] + micro[2 * s + 1] for s in range(steps)]


def test_diff_plot_marks_exactly_the_steps_whose_bytes_differ(tmp_path: Path) -> None:
    steps = 120  # 400 samples, batch 8: 50 steps an epoch, so the run crosses two epochs
    bytes_a = _run((), tmp_path / "a.jsonl", steps)
    bytes_b = _run(BAD_SAMPLES, tmp_path / "b.jsonl", steps)
    reference = {s for s in range(steps) if bytes_a[s] != bytes_b[s]}
    assert 3 <= len(reference) < steps // 4  # the three changed samples, once an epoch

    comparison = compare(read_trace(tmp_path / "a.jsonl"), read_trace(tmp_path / "b.jsonl"))
    runs = diff_runs(comparison)
    covered = [s for r in runs for s in range(r.start, r.stop)]
    assert covered == list(range(steps))  # every step once, in order
    differing = {s for r in runs if r.status != SAME for s in range(r.start, r.stop)}
    assert differing == reference
    assert {r.status for r in runs} == {SAME, "differs"}
    assert all(a.stop == b.start and a.status != b.status for a, b in itertools.pairwise(runs))

    plot_diff(comparison, tmp_path / "diff.png")
    check_png(tmp_path / "diff.png")


def test_diff_plot_shows_where_a_shorter_run_stops(tmp_path: Path) -> None:
    _run((), tmp_path / "a.jsonl", 30)
    _run((), tmp_path / "b.jsonl", 20)
    runs = diff_runs(compare(read_trace(tmp_path / "a.jsonl"), read_trace(tmp_path / "b.jsonl")))
    assert [(r.start, r.stop, r.status) for r in runs] == [(0, 20, SAME), (20, 30, "missing")]


def _detdata(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from detdata.cli.main import main; sys.exit(main())",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.mark.multiproc
def test_cli_diff_plot_writes_the_png_and_keeps_the_verdict(tmp_path: Path) -> None:
    _run((), tmp_path / "a.jsonl", 60)
    _run(BAD_SAMPLES, tmp_path / "b.jsonl", 60)
    out = tmp_path / "diff.png"
    done = _detdata(
        "diff", str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl"), "--plot", str(out)
    )
    assert done.returncode == 1, done.stderr  # "different" stays exit 1 with --plot
    assert "first difference at step" in done.stdout and f"plot: {out}" in done.stdout
    check_png(out)
    same = _detdata(
        "diff", str(tmp_path / "a.jsonl"), str(tmp_path / "a.jsonl"), "--plot", str(out)
    )
    assert same.returncode == 0 and same.stdout.startswith("identical: 60 steps"), same.stdout
    refused = _detdata("diff", "--state", "x.json", "y.json", "--plot", str(out))
    assert refused.returncode == 2 and "--plot applies to traces" in refused.stderr


# ------------------------------------------------------------------ mixture shares
SCHEDULE: list[tuple[int, dict[str, int]]] = [
    (0, {"code": 3, "math": 1, "web": 6}),
    (1000, {"code": 1, "math": 1, "web": 2}),
]


def _mixture() -> detdata.Mixture:
    sources = {
        name: detdata.ArrayDataset({"src": np.full(n, k, dtype=np.int64)})
        for k, (name, n) in enumerate((("code", 700), ("math", 90), ("web", 5000)))
    }
    return detdata.Mixture(sources, seed=7, schedule=SCHEDULE)


def _delivered_sources(mixture: detdata.Mixture, count: int) -> np.ndarray:
    """The source of every sample a real loader delivered, in order (from the samples' bytes)."""
    dl = detdata.DataLoader(mixture, global_batch_size=64, seed=7)
    parts = []
    for batch in dl:
        parts.append(batch["src"].numpy())
        if sum(map(len, parts)) >= count:
            break
    dl.close()
    return np.concatenate(parts)[:count]


def _target(name: str, start: int, length: int) -> Fraction:
    """Sum of the configured proportion of ``name`` position by position (brute force)."""
    total = Fraction(0)
    for g in range(start, start + length):
        weights = [w for s, w in SCHEDULE if s <= g][-1]
        total += Fraction(weights[name], sum(weights.values()))
    return total


@pytest.mark.parametrize("start", [0, 640])
def test_mixture_shares_are_what_a_loader_delivers(tmp_path: Path, start: int) -> None:
    mixture = _mixture()
    count = 2560
    delivered = _delivered_sources(mixture, start + count)[start:]
    shares = mixture_shares(mixture, start=start, count=count, points=60)
    assert shares.names == ("code", "math", "web")
    assert shares.lengths[0] == 1 and shares.lengths[-1] == count and len(shares.lengths) > 40
    for k, name in enumerate(shares.names):
        seen = np.cumsum(delivered == k)
        assert list(shares.counts[k]) == [int(seen[n - 1]) for n in shares.lengths], name
        assert list(shares.targets[k]) == [_target(name, start, n) for n in shares.lengths]
    plot_mixture_shares(shares, tmp_path / "shares.png")
    check_png(tmp_path / "shares.png")


@pytest.mark.multiproc
def test_cli_mix_plot_writes_the_png_and_the_final_shares(tmp_path: Path) -> None:
    config = {
        "seed": 7,
        "sources": {
            "code": {"num_samples": 700},
            "math": {"num_samples": 90},
            "web": {"num_samples": 5000},
        },
        "schedule": [[s, w] for s, w in SCHEDULE],
    }
    (tmp_path / "mix.json").write_text(json.dumps(config), encoding="utf-8")
    out = tmp_path / "shares.png"
    done = _detdata(
        "mix", "--config", str(tmp_path / "mix.json"), "--count", "2560", "--plot", str(out)
    )
    assert done.returncode == 0, done.stderr
    delivered = _delivered_sources(_mixture(), 2560)
    lines = done.stdout.splitlines()
    for k, name in enumerate(("code", "math", "web")):
        n = int((delivered == k).sum())
        target = float(_target(name, 0, 2560)) / 2560
        assert f"{name}\t{n}\t{n / 2560:.6f}\t{target:.6f}" in lines, done.stdout
    check_png(out)


# ------------------------------------------------------------------ batch schedule
def _megatron_batches(start: int, inc: int, ramp: int, gbs: int, steps: int) -> list[int]:
    """Megatron-LM's RampupBatchsizeNumMicroBatchesCalculator, step by step."""
    per = ramp / ((gbs - start) / inc)
    out, consumed = [], 0
    for _ in range(steps):
        batch = gbs if consumed > ramp else start + int(consumed / per) * inc
        out.append(batch)
        consumed += batch
    return out


def _per_step(curve_steps: tuple[int, ...], values: tuple[int, ...], steps: int) -> list[int]:
    return [values[int(np.searchsorted(curve_steps, s, side="right")) - 1] for s in range(steps)]


def test_batch_schedule_plot_follows_megatron_rampup(tmp_path: Path) -> None:
    steps = 900
    schedule = detdata.BatchSchedule.rampup(32, 32, 100_000, global_batch_size=512)
    reference = _megatron_batches(32, 32, 100_000, 512, steps)
    curve = schedule_curve(schedule, steps=steps)
    assert curve.step_starts[-1] == steps and curve.positions[-1] == sum(reference)
    assert _per_step(curve.step_starts, curve.batches, steps) == reference
    consumed = np.concatenate([[0], np.cumsum(reference)])
    assert [int(consumed[s]) for s in curve.step_starts] == list(curve.positions)
    assert len(curve.step_starts) == 16 + 1  # 16 batch sizes 32..512, then the end
    plot_batch_schedule(schedule, tmp_path / "schedule.png", steps=steps)
    check_png(tmp_path / "schedule.png")


def test_batch_schedule_curve_by_steps_counts_samples() -> None:
    schedule = detdata.BatchSchedule.by_steps([(0, 8), (10, 16), (25, 4)])
    curve = schedule_curve(schedule, steps=30)
    reference = [8] * 10 + [16] * 15 + [4] * 5
    assert _per_step(curve.step_starts, curve.batches, 30) == reference
    assert curve.positions == (0, 80, 320, 340)


# ------------------------------------------------------------------ matplotlib optional
def _python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.mark.multiproc
def test_without_matplotlib_a_plot_names_the_install_line(tmp_path: Path) -> None:
    done = _python(
        f"""
        import sys
        sys.modules["matplotlib"] = None  # as if matplotlib were not installed
        import detdata
        from detdata.base.errors import DependencyError
        from detdata.cli.plots import plot_batch_schedule
        try:
            schedule = detdata.BatchSchedule.constant(8)
            plot_batch_schedule(schedule, {str(tmp_path / "x.png")!r}, steps=5)
        except DependencyError as exc:
            print(type(exc).__name__, isinstance(exc, ImportError), exc)
        """
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("DependencyError True matplotlib.figure cannot be imported")
    assert "pip install 'detdata[plots]'" in done.stdout
    assert not (tmp_path / "x.png").exists()
    config = tmp_path / "mix.json"
    config.write_text(
        json.dumps({"seed": 1, "sources": {"a": {"num_samples": 5}}, "weights": {"a": 1}})
    )
    cli = _python(
        f"""
        import sys
        sys.modules["matplotlib"] = None
        from detdata.cli.main import main
        sys.exit(main(["mix", "--config", {str(config)!r}, "--plot", {str(tmp_path / "x.png")!r}]))
        """
    )
    assert cli.returncode == 2, cli.stderr
    assert "detdata: error: matplotlib.figure cannot be imported" in cli.stderr
    assert "pip install 'detdata[plots]'" in cli.stderr and not (tmp_path / "x.png").exists()


@pytest.mark.multiproc
def test_import_detdata_and_the_cli_parser_never_import_matplotlib() -> None:
    done = _python(
        """
        import sys
        import detdata
        from detdata.cli.main import build_parser
        build_parser().format_help()
        import detdata.cli.plots
        print(sorted(m for m in sys.modules if m.split(".")[0] == "matplotlib"))
        """
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


# ------------------------------------------------------------------ figures (issue 46)
def _figures(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """The matplotlib figures the ``plot_*`` functions draw (their PNG is not written)."""
    import detdata.cli.plots as plots

    drawn: list[object] = []
    monkeypatch.setattr(plots, "_save", lambda fig, path: drawn.append(fig))
    return drawn


def _outside(legend: object, ax: object) -> bool:
    """Whether ``legend``'s drawn box and ``ax``'s plotting area do not overlap."""
    box, area = legend.get_window_extent(), ax.get_window_extent()  # type: ignore[attr-defined]
    return bool(box.x0 >= area.x1 or box.x1 <= area.x0 or box.y0 >= area.y1 or box.y1 <= area.y0)


def test_diff_figure_reads_in_greyscale_labels_its_axes_and_keeps_the_legend_off_the_data(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 46: the diff picture told steps apart by red vs green only, its legend covered
    the band, and the band had no x label."""
    _run((), tmp_path / "a.jsonl", 60)
    _run(BAD_SAMPLES, tmp_path / "b.jsonl", 60)
    comparison = compare(read_trace(tmp_path / "a.jsonl"), read_trace(tmp_path / "b.jsonl"))
    drawn = _figures(monkeypatch)
    plot_diff(comparison, tmp_path / "diff.png")
    (fig,) = drawn
    band, count = fig.axes  # type: ignore[attr-defined]
    fig.draw_without_rendering()  # type: ignore[attr-defined]
    hatches = {c.get_label(): c.get_hatch() or "" for c in band.collections}
    assert set(hatches) == {SAME, "differs"}
    assert hatches[SAME] != hatches["differs"]  # a pattern, not only a colour, tells them apart
    marker = [ln for ln in band.lines if ln.get_label() == "first difference"]
    assert len(marker) == 1 and marker[0].get_linestyle() == "--"
    assert marker[0].get_xdata()[0] == comparison.first.step  # type: ignore[union-attr]
    assert band.get_xlabel() == "global step" and count.get_xlabel() == "global step"
    legend = band.get_legend()
    labels = [t.get_text() for t in legend.get_texts()]
    assert sorted(labels) == sorted([SAME, "differs", "first difference"])
    assert _outside(legend, band)


def test_mixture_figure_draws_every_phase_target_and_tells_sources_apart_without_colour(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 46: the mixture picture showed only the cumulative target, so a schedule's
    second phase had no target line; each phase's proportions (the SCHEDULE written above)
    are now drawn over that phase's positions."""
    shares = mixture_shares(_mixture(), start=0, count=2560, points=60)
    drawn = _figures(monkeypatch)
    plot_mixture_shares(shares, tmp_path / "shares.png")
    (fig,) = drawn
    share_ax = fig.axes[0]  # type: ignore[attr-defined]
    fig.draw_without_rendering()  # type: ignore[attr-defined]
    solid = [ln for ln in share_ax.lines if ln.get_linestyle() == "-"]
    assert len(solid) == 3 and len({ln.get_marker() for ln in solid}) == 3
    for line, name in zip(solid, ("code", "math", "web"), strict=True):
        dotted = [
            ln
            for ln in share_ax.lines
            if ln.get_linestyle() == ":" and ln.get_color() == line.get_color()
        ]
        drawn_phases = sorted(
            (float(ln.get_xdata()[-1]), float(ln.get_ydata()[0])) for ln in dotted
        )
        want = [
            (float(stop), weights[name] / sum(weights.values()))
            for (first, weights), stop in zip(SCHEDULE, [1000, 2560], strict=True)
        ]
        assert [x for pair in drawn_phases for x in pair] == pytest.approx(
            [x for pair in want for x in pair]
        ), name
    assert _outside(share_ax.get_legend(), share_ax)
    assert fig.axes[1].get_xlabel() == "global position"  # type: ignore[attr-defined]
