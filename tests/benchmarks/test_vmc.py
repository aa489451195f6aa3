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


def test_table_ratios_are_over_upstream_when_it_ran_and_a_failure_is_a_row():
  ours = {"name": "optimizer", "energy": -2.9035, "err": 0.0002, "step_ms": 90.0, "update_ms": 30.0}
  up = {"name": "upstream", "energy": -2.9000, "err": 0.0003, "step_ms": 100.0, "update_ms": 60.0}
  lines = bench.table([ours, up], exact=-2.90372).splitlines()
  assert lines[0].endswith("| update / kfac-jax 0.0.8 |"), lines
  assert lines[2] == "| kfac_jax.Optimizer | -2.9035 ± 0.0002 | +0.2 | 90 | 30 | 0.50 |", lines
  assert lines[3].endswith("| 60 | 1.00 |"), lines
  # Without upstream the Optimizer is the reference; a failed upstream run says why.
  failed = {"name": "upstream", "error": "ValueError: no"}
  lines = bench.table([ours, failed], exact=-2.90372).splitlines()
  assert lines[0].endswith("| update / kfac_jax.Optimizer |"), lines
  assert lines[3] == "| kfac-jax 0.0.8 | failed: ValueError: no | | | | |", lines


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
