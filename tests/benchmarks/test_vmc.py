"""Tests for benchmarks/vmc.py: its table and, with the upstream venv, kfac-jax 0.0.8 trained by
`benchmarks/upstream/vmc_worker.py` on examples/vmc.py's own wave function and loop (skipped
without the venv: `bash benchmarks/upstream/setup_venv.sh`, or `$KFAC_UPSTREAM_PYTHON`)."""

import math
import os
import sys

import numpy as np
import pytest

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if _ROOT not in sys.path:
  sys.path.insert(0, _ROOT)

from benchmarks import vmc as bench  # noqa: E402
from benchmarks.upstream import compare  # noqa: E402


def test_row_takes_the_last_fifth_and_medians_after_the_compiling_steps():
  energies = [-1.0] * 8 + [-2.0, -3.0]
  times = [9.0] * bench.WARMUP + [0.002, 0.004, 0.003, 0.001, 0.005]
  r = bench.row("kfac", energies, times, np.asarray(times) / 2)
  assert r["energy"] == pytest.approx(-2.5) and r["err"] == pytest.approx(0.5)
  assert r["step_ms"] == pytest.approx(3.0) and r["update_ms"] == pytest.approx(1.5)
  assert r["early"] == pytest.approx(-1.0)  # The first quarter's (two steps) last fifth.
  assert "budget_steps" not in r


def test_row_at_equal_seconds_charges_the_compiling_steps_at_the_median():
  """The budget row ends at the first step whose charged time reaches the budget; the
  compiling steps cost the median (3 ms here), not their 9 s."""
  energies = [-1.0] * 8 + [-2.0, -3.0]
  times = [9.0] * bench.WARMUP + [0.002, 0.004, 0.003, 0.001, 0.005]
  np.testing.assert_allclose(bench.vmc.charged_seconds(times), np.cumsum([0.003] * 5 + times[5:]))
  r = bench.row("spring", energies, times, times, steps=8, budget=0.0175)
  assert r["steps"] == 8 and r["energy"] == pytest.approx(-1.0)  # the first 8 steps
  assert r["budget_steps"] == 7 and r["budget_energy"] == pytest.approx(-1.0)
  # A run that ended before spending the budget has no budget row.
  assert "budget_steps" not in bench.row("adam", energies, times, times, budget=1.0)


def test_table_ratios_are_over_upstream_when_it_ran_and_a_failure_is_a_row():
  ours = {"name": "optimizer", "energy": -2.9035, "err": 0.0002, "step_ms": 90.0, "update_ms": 30.0}
  ours.update(budget_energy=-2.9035, budget_err=0.0002, budget_steps=400)
  up = {"name": "upstream", "energy": -2.9000, "err": 0.0003, "step_ms": 100.0, "update_ms": 60.0}
  lines = bench.table([ours, up], exact=-2.90372).splitlines()
  assert lines[0].endswith("| update / kfac-jax 0.0.8 |"), lines
  assert lines[2] == (
    "| kfac_jax.Optimizer | -2.9035 ± 0.0002 | – | +0.2 ± 0.2 | +0.2 ± 0.2 (400) | 90 | 30 | 0.50 |"
  ), lines
  assert lines[3].endswith("| – | +3.7 ± 0.3 | – | 100 | 60 | 1.00 |"), lines
  # Without upstream the Optimizer is the reference; a failed upstream run says why.
  failed = {"name": "upstream", "error": "ValueError: no"}
  lines = bench.table([ours, failed], exact=-2.90372).splitlines()
  assert lines[0].endswith("| update / kfac_jax.Optimizer |"), lines
  assert lines[3] == "| kfac-jax 0.0.8 | failed: ValueError: no | | | | | | |", lines


def test_the_kernel_rows_train_beside_the_optimizer(monkeypatch, capsys):
  """`benchmarks/vmc.py` runs the Optimizer, then SPRING (centred and not) for a few steps on
  a tiny He network: finite energies at equal steps, and an equal-seconds row for each. Every
  iteration is charged one second, so that the equal-seconds runs do not depend on the
  machine's speed: each spends the Optimizer's six."""
  monkeypatch.setattr(bench.vmc, "charged_seconds", lambda times: np.arange(1.0, len(times) + 1))
  argv = ["--system", "He", "--steps", "6", "--walkers", "16", "--width", "8"]
  rows = bench.main(argv + ["--optimizers", "spring", "optimizer", "spring-raw"])
  assert [r["name"] for r in rows] == ["optimizer", "spring", "spring-raw"]  # The Optimizer first.
  for r in rows:
    assert r["steps"] == 6 and math.isfinite(r["energy"]) and abs(r["energy"]) < 50, r
    assert r["budget_steps"] == 6 and r["budget_energy"] == r["energy"], r
  assert rows[1]["energy"] != rows[2]["energy"]  # The metrics differ.
  out = capsys.readouterr().out
  assert "| SPRING (kernel_ngd) |" in out and "| SPRING, uncentred |" in out, out


def _upstream_python():
  python = os.environ.get("KFAC_UPSTREAM_PYTHON") or compare.DEFAULT_PYTHON
  return python if os.path.isfile(python) else None


@pytest.mark.skipif(
  _upstream_python() is None,
  reason="no upstream venv (bash benchmarks/upstream/setup_venv.sh, or "
  "KFAC_UPSTREAM_PYTHON=/path/to/python)",
)
@pytest.mark.slow
def test_upstream_vmc_worker_trains_the_example_with_kronecker_blocks():
  """kfac-jax 0.0.8 in its venv runs the example's loop on He: finite energies and times per
  step, and its graph matcher puts the dense layers in Kronecker blocks."""
  config = {"system": "He", "width": 8, "layers": 1, "determinants": 1, "steps": 3}
  report = compare.run_vmc_worker(_upstream_python(), {**config, "walkers": 16, "seed": 0})
  assert report["optimizer"] == "kfac-jax 0.0.8" and report["jax"] == "0.9.1", report
  assert len(report["energies"]) == len(report["times"]) == len(report["update_times"]) == 3
  assert all(math.isfinite(e) and abs(e) < 50 for e in report["energies"]), report
  assert all(0 < u <= t for u, t in zip(report["update_times"], report["times"])), report
  dense = [b for b in report["registrations"] if b.startswith("RepeatedDenseKroneckerFactored")]
  assert len(dense) == 3, report["registrations"]  # one stream layer, one orbital layer per spin
