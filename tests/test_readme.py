"""The README's Python code blocks run verbatim (the quickstart and the optimizer section)."""

import os
import re

import jax
import numpy as np

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")


def _blocks(section, subsection=None):
  """The ```python blocks of README section `## {section}` (of its `### {subsection}` only)."""
  with open(README, encoding="utf-8") as f:
    text = f.read()
  start = text.index(f"\n## {section}\n")
  end = text.find("\n## ", start + 1)
  text = text[start:end if end > 0 else None]
  if subsection is not None:
    start = text.index(f"\n### {subsection}\n")
    end = text.find("\n### ", start + 1)
    text = text[start:end if end > 0 else None]
  return re.findall(r"```python\n(.*?)```", text, re.S)


def test_quickstart_runs_verbatim_and_trains():
  (code,) = _blocks("Quickstart")
  scope = {}
  exec(compile(code, "README.md:Quickstart", "exec"), scope)  # noqa: S102
  assert np.isfinite(float(scope["loss"]))
  first = scope["loss_fn"](scope["model"].init(jax.random.key(0), scope["batch"]), scope["batch"])
  assert float(scope["loss"]) < float(first)  # Ten K-FAC steps lowered the loss.


def test_optimizer_section_runs_verbatim_after_the_quickstart():
  scope = {}
  exec(compile(_blocks("Quickstart")[0], "README.md:Quickstart", "exec"), scope)  # noqa: S102
  blocks = _blocks("The full optimizer")
  assert blocks
  for i, code in enumerate(blocks):
    exec(compile(code, f"README.md:The full optimizer:{i}", "exec"), scope)  # noqa: S102
  assert np.isfinite(float(scope["info"]["loss"]))


def test_checkpoint_snippet_runs_verbatim_after_the_quickstart(tmp_path, monkeypatch):
  scope = {}
  exec(compile(_blocks("Quickstart")[0], "README.md:Quickstart", "exec"), scope)  # noqa: S102
  monkeypatch.chdir(tmp_path)  # The snippet saves under ./checkpoints.
  code = _blocks("Checkpoints and numerical safety")[0]
  exec(compile(code, "README.md:Checkpoints", "exec"), scope)  # noqa: S102
  restored, saved = scope["restored"], scope["opt_state"]
  assert os.path.isdir(tmp_path / "checkpoints" / "opt_state")
  same = jax.tree_util.tree_map(lambda a, b: bool(np.array_equal(a, b)), restored, saved)
  assert all(jax.tree_util.tree_leaves(same))
