"""The repository passes `ruff check` with the rules in pyproject.toml, is laid out as
`ruff format` lays it out, and the package passes `mypy` (run as part of the suite, so `.ci/run`
checks all three)."""

import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


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


@pytest.mark.slow
def test_mypy_passes():
  """`mypy` over the package with the `[tool.mypy]` section of pyproject.toml. About 10 s of CPU
  cold, 1 s with its cache (`.mypy_cache/` in the repository root)."""
  try:
    import mypy  # noqa: F401
  except ImportError:
    pytest.skip("mypy is not installed (it is in the `test` extra: pip install -e '.[test]')")
  out = subprocess.run(
    [sys.executable, "-m", "mypy", "--config-file", os.path.join(ROOT, "pyproject.toml")],
    capture_output=True,
    text=True,
    cwd=ROOT,
    check=False,
  )
  assert out.returncode == 0, out.stdout + out.stderr
  assert "Success: no issues found" in out.stdout, out.stdout + out.stderr
