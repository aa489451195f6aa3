"""benchmarks/pinn.py's kernel row (`kfac_jax.kernel_ngd` with the grid line search) beside the
`Optimizer`, for two steps. In a subprocess: the script turns on float64 for its process."""

import os
import re
import subprocess
import sys

import pytest

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow
@pytest.mark.parametrize("problem", ["poisson", "poisson-hessian"])
def test_the_kernel_row_runs_beside_the_optimizer(problem, tmp_path):
  """Both rows print finite errors at step 2 (relative L2 and, half of it, the RMS: the
  solution's RMS is 1/2), and the kernel's row (1,020 rows, 257 parameters: ENGD through F)
  has an equal-seconds cell."""
  proc = subprocess.run(
    [
      sys.executable,
      os.path.join(_ROOT, "benchmarks", "pinn.py"),
      "--problem",
      problem,
      "--steps",
      "2",
      "--only",
      "Optimizer,kernel",
    ],
    cwd=str(tmp_path),
    capture_output=True,
    text=True,
    timeout=600,
  )
  output = proc.stdout + proc.stderr
  assert proc.returncode == 0, output
  number = r"([0-9.]+e[-+][0-9]+)"
  rows = {}
  for name in ("Optimizer", "kernel"):  # The Optimizer's row sets the seconds: no cell of its own.
    m = re.search(
      rf"^\| {name} \| {number} \({number}\) \| [0-9.]+ s to step 2 \|(.*)$", output, re.M
    )
    assert m is not None, output
    rows[name] = float(m.group(1)), float(m.group(2)), m.group(3).strip()
  for rel, rms, _ in rows.values():
    assert rms == pytest.approx(rel / 2, rel=0.08), output  # 2 digits printed
  assert rows["Optimizer"][2] == "", output
  equal = rows["kernel"][2]
  assert re.fullmatch(rf"{number} \({number}\) \(\d+ steps\) \|", equal), output
