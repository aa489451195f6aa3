"""The README: its Quickstart runs verbatim and trains, it stays short, its results table quotes
`benchmarks/RESULTS.md`, and no page of the repository narrates how the library was made."""

import glob
import os
import re

import jax
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
README = os.path.join(ROOT, "README.md")


def _read(path):
  with open(path, encoding="utf-8") as f:
    return f.read()


def _section(text, title):
  """The text of `## {title}` up to the next `## ` heading."""
  start = text.index(f"\n## {title}\n")
  end = text.find("\n## ", start + 1)
  return text[start : end if end > 0 else None]


def _blocks(section):
  """The ```python blocks of README section `## {section}`."""
  return re.findall(r"```python\n(.*?)```", _section(_read(README), section), re.S)


def test_readme_starts_with_the_two_commands():
  text = _read(README)
  first = re.search(r"```\n(.*?)```", text, re.S).group(1)
  assert [line.split()[:2] for line in first.strip().splitlines()] == [
    ["bash", "scripts/demo.sh"],
    ["bash", "scripts/test.sh"],
  ]
  assert text.index("scripts/demo.sh") < text.index("\n## ")


def test_readme_is_short():
  assert len(_read(README)) <= 10_000


def test_results_page_is_short():
  # One table per workload and a short list of what did not help; not a report.
  assert len(_read(os.path.join(ROOT, "benchmarks", "RESULTS.md"))) <= 20_500


def test_quickstart_runs_verbatim_and_trains():
  (code,) = _blocks("Quickstart")
  scope = {}
  exec(compile(code, "README.md:Quickstart", "exec"), scope)  # noqa: S102
  assert np.isfinite(float(scope["loss"]))
  first = scope["loss_fn"](scope["model"].init(jax.random.key(0), scope["batch"]), scope["batch"])
  assert float(scope["loss"]) < float(first)  # 60 K-FAC steps lowered the loss.


def test_results_table_quotes_the_results_page():
  """Every number in the README's results section is a number recorded in RESULTS.md."""
  section = _section(_read(README), "Results")
  results = _read(os.path.join(ROOT, "benchmarks", "RESULTS.md"))
  numbers = set(re.findall(r"\d+\.\d+x?", section))
  assert len(numbers) >= 20, numbers
  recorded = lambda n: re.search(rf"(?<![\d.]){re.escape(n)}(?!\d)", results)  # noqa: E731
  missing = sorted(n for n in numbers if not recorded(n))
  assert not missing, f"README results not in benchmarks/RESULTS.md: {missing}"


def test_entry_point_table_names_each_front():
  table = _section(_read(README), "Which entry point when")
  for name in ("kfac_jax.kfac", "scale_by_kfac", "Optimizer", "CurvatureEstimator", "TrainState"):
    assert name in table, name


_HISTORY = re.compile(
  r"\b(first|second|third|(?:\w+)th|twenty-\w+) session\b|\bsessions?\b|\bissue \d+|"
  r"\bround \d+ of work\b|\bsince the \w+th\b",
  re.I,
)


def test_no_page_narrates_the_development():
  """README, RESULTS, the benchmarks README and the docs speak of the library, not its making."""
  paths = [README, os.path.join(ROOT, "benchmarks", "RESULTS.md")]
  paths += [os.path.join(ROOT, "benchmarks", "README.md")]
  paths += glob.glob(os.path.join(ROOT, "docs", "*.rst"))
  found = []
  for path in paths:
    for i, line in enumerate(_read(path).splitlines(), 1):
      if _HISTORY.search(line):
        found.append(f"{os.path.relpath(path, ROOT)}:{i}: {line.strip()[:80]}")
  assert not found, "\n".join(found)
