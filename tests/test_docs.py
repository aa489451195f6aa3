"""The API reference builds offline from the docstrings, without warnings, and lists every public
name."""

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_sphinx_api_reference_builds_without_warnings(tmp_path):
  pytest.importorskip("sphinx")
  proc = subprocess.run(
    [
      sys.executable,
      "-m",
      "sphinx",
      "-W",
      "-q",
      "-b",
      "html",
      os.path.join(ROOT, "docs"),
      str(tmp_path),
    ],
    capture_output=True,
    text=True,
    timeout=600,
    cwd=ROOT,
  )
  assert proc.returncode == 0, proc.stdout + proc.stderr
  api = (tmp_path / "api.html").read_text(encoding="utf-8")
  for name in (
    "scale_by_kfac",
    "CurvatureEstimator",
    "Optimizer",
    "register_conv",
    "check_restored_state",
    "check_registration",
    "LayerConfig",
    "KfacState",
    "TrainState",
  ):
    assert name in api


def test_api_reference_lists_every_public_name():
  """docs/api.rst has a directive for every name in `kfac_jax.__all__` and for kfac_jax.flax."""
  import kfac_jax  # pylint: disable=g-import-not-at-top

  with open(os.path.join(ROOT, "docs", "api.rst"), encoding="utf-8") as f:
    text = f.read()
  documented = set(re.findall(r"^\.\. auto\w+:: kfac_jax\.(\w+)\s*$", text, re.M))
  missing = sorted(set(kfac_jax.__all__) - documented)
  assert not missing, f"docs/api.rst does not document {missing}"
  assert ".. autoclass:: kfac_jax.flax.TrainState" in text
