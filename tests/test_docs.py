"""The API reference builds offline from the docstrings, without warnings."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_sphinx_api_reference_builds_without_warnings(tmp_path):
  pytest.importorskip("sphinx")
  proc = subprocess.run(
      [sys.executable, "-m", "sphinx", "-W", "-q", "-b", "html", os.path.join(ROOT, "docs"),
       str(tmp_path)], capture_output=True, text=True, timeout=600, cwd=ROOT)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  api = (tmp_path / "api.html").read_text(encoding="utf-8")
  for name in ("scale_by_kfac", "CurvatureEstimator", "Optimizer", "register_conv",
               "check_restored_state"):
    assert name in api
