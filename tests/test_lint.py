"""The repository passes `ruff check` with the rules in pyproject.toml and is laid out as
`ruff format` lays it out (run as part of the suite, so `.ci/run` checks both)."""

import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _ruff():
  exe = os.path.join(os.path.dirname(sys.executable), "ruff")
  return exe if os.path.exists(exe) else shutil.which("ruff")


@pytest.mark.slow
@pytest.mark.parametrize(
  "args",
  [("check", "--output-format", "concise"), ("format", "--check", "--diff")],
  ids=["check", "format"],
)
def test_ruff_passes(args):
  ruff = _ruff()
  if ruff is None:
    pytest.skip("ruff is not installed (it is in the `test` extra: pip install -e '.[test]')")
  out = subprocess.run(
    [ruff, *args, ROOT],
    capture_output=True,
    text=True,
    cwd=ROOT,
    check=False,
  )
  assert out.returncode == 0, out.stdout + out.stderr
