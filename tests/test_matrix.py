"""The exactness matrix (`benchmarks.matrix`): a random sample of its cells in the suite, and
proof that its comparison can fail.

Each sampled cell resumes a run of one layout on another (ranks simulated in process) and
compares every delivered row byte for byte with an uninterrupted run (the reference). The
sample is drawn anew each run (3 cells; 24 under ``DETDATA_SOAK=1``, tests/soak.py); its seed
is in every failure message, and ``DETDATA_MATRIX_SEED`` replays it.

Covers: benchmarks/matrix.py, benchmarks/matrix_data.py, benchmarks/matrix_report.py.
"""

from __future__ import annotations

import dataclasses
import os
import random
from pathlib import Path

import numpy as np
import pytest

from benchmarks import matrix, matrix_report
from benchmarks.matrix_data import FEATURES, Setup, build
from tests import soak
from tests.servers import HttpServer


@pytest.fixture(scope="module")
def setups(tmp_path_factory: pytest.TempPathFactory, http_server: HttpServer) -> dict[str, Setup]:
    return build(tmp_path_factory.mktemp("matrix"), http_server.new_dir())


def test_a_random_sample_of_cells_is_exact(setups: dict[str, Setup]) -> None:
    seed = int(os.environ.get("DETDATA_MATRIX_SEED", random.randrange(2**31)))
    count = soak.rounds(24, 3)
    cells = matrix.run_matrix(matrix.sample_cells(FEATURES, count, seed), setups)
    assert len(cells) == count
    bad = [c.to_json() for c in cells if not c.exact]
    assert not bad, f"DETDATA_MATRIX_SEED={seed}: {bad}"
    for c in cells:  # every position of the run compared, a re-delivered step's rows too
        extra = 16 if c.point == "inside a step" else 0
        assert c.rows_compared >= matrix.TOTAL_POSITIONS + extra - 16, c


def _deliveries(setup: Setup) -> tuple[matrix.Delivery, matrix.Delivery, matrix.Delivery]:
    change = matrix.CHANGES[1]  # DP 8 -> 7
    reference = matrix.deliver(setup, change.before, 0, matrix.TOTAL_POSITIONS)
    first = matrix.deliver(setup, change.before, 0, matrix.STEP_POSITION)
    second = matrix.deliver(
        setup, change.after, matrix.STEP_POSITION, matrix.TOTAL_POSITIONS, state=first.state
    )
    return reference, first, second


def test_the_comparison_flags_a_changed_row_and_a_missing_position(
    setups: dict[str, Setup],
) -> None:
    reference, first, second = _deliveries(setups["tokens"])
    clean = matrix.compare(reference, first, second, matrix.TOTAL_POSITIONS)
    assert clean["mismatched"] == clean["missing"] == 0 and clean["complete"]
    changed = dataclasses.replace(second, rows=dict(second.rows))
    changed.rows[500] = ["0" * 64]
    verdict = matrix.compare(reference, first, changed, matrix.TOTAL_POSITIONS)
    assert verdict["mismatched"] == 1 and verdict["first_bad"] == 500
    changed.rows.pop(400)
    verdict = matrix.compare(reference, first, changed, matrix.TOTAL_POSITIONS)
    assert verdict["missing"] == 1 and verdict["first_bad"] == 400


def _unseeded(sample: dict[str, np.ndarray], rng: np.random.Generator) -> dict[str, np.ndarray]:
    """A transform that ignores its sample's generator: its noise depends on the run."""
    return {"tokens": sample["tokens"] + np.random.default_rng().integers(1, 1000)}


def test_a_transform_that_ignores_its_generator_is_not_exact(setups: dict[str, Setup]) -> None:
    """Its resume is refused before the first batch: the state's attestation (issue 43) sees
    the attested samples come out otherwise while every checked identity field is equal."""
    broken = dataclasses.replace(setups["tokens"], transform=_unseeded)
    cell = matrix.Matrix({"tokens": broken}).run(matrix.CHANGES[1], "tokens", "step boundary")
    assert not cell.exact and cell.error is not None
    assert "identity fields were equal" in cell.error and "position" in cell.error


def test_the_generated_section_replaces_only_the_marked_text(tmp_path: Path) -> None:
    doc = tmp_path / "b.md"
    doc.write_text(f"before\n{matrix_report.BEGIN}\nold\n{matrix_report.END}\nafter\n")
    matrix_report.write_doc(f"{matrix_report.BEGIN}\nnew\n{matrix_report.END}", doc)
    assert doc.read_text() == f"before\n{matrix_report.BEGIN}\nnew\n{matrix_report.END}\nafter\n"
