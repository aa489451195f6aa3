"""The README's Python code blocks run verbatim (quickstart, optimizer, API, checkpoints)."""

import ast
import dataclasses
import inspect
import os
import re

import jax
import numpy as np

import kfac_jax

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")


def _blocks(section, subsection=None):
  """The ```python blocks of README section `## {section}` (of its `### {subsection}` only)."""
  with open(README, encoding="utf-8") as f:
    text = f.read()
  start = text.index(f"\n## {section}\n")
  end = text.find("\n## ", start + 1)
  text = text[start : end if end > 0 else None]
  if subsection is not None:
    start = text.index(f"\n### {subsection}\n")
    end = text.find("\n### ", start + 1)
    text = text[start : end if end > 0 else None]
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


def _call_keywords(code, name):
  """{keyword: literal value} of the one call to `kfac_jax.{name}(...)` in `code`."""
  calls = [
    n
    for n in ast.walk(ast.parse(code))
    if isinstance(n, ast.Call)
    and isinstance(n.func, ast.Attribute)
    and n.func.attr == name
    and isinstance(n.func.value, ast.Name)
    and n.func.value.id == "kfac_jax"
  ]
  assert len(calls) == 1, f"README API at a glance: expected one kfac_jax.{name}(...) call"
  return {k.arg: ast.literal_eval(k.value) for k in calls[0].keywords}


def test_api_section_runs_and_spells_out_the_transforms_signatures():
  """The API section's calls run after the quickstart, and list every keyword of
  `scale_by_kfac` / `kfac` and every `Config` field with its default (so the README cannot
  fall behind a new argument)."""
  scope = {}
  exec(compile(_blocks("Quickstart")[0], "README.md:Quickstart", "exec"), scope)  # noqa: S102
  blocks = _blocks("API at a glance")
  assert len(blocks) == 2
  for i, code in enumerate(blocks):
    exec(compile(code, f"README.md:API at a glance:{i}", "exec"), scope)  # noqa: S102
  for name in ("scale_by_kfac", "kfac"):
    params = inspect.signature(getattr(kfac_jax, name)).parameters
    expected = {p.name: p.default for p in params.values() if p.kind is p.KEYWORD_ONLY}
    listed = _call_keywords(blocks[0], name)
    listed.pop("learning_rate", None)  # Positional-or-keyword, no default.
    assert listed == expected, name
  fields = {f.name: f.default for f in dataclasses.fields(kfac_jax.Config)}
  assert _call_keywords(blocks[0], "Config") == fields
  state = scope["opt_state"]
  assert float(state.hyperparams["damping"]) == 1.0
  assert np.isfinite(float(scope["loss"]))


def test_api_table_names_every_public_name():
  with open(README, encoding="utf-8") as f:
    text = f.read()
  start = text.index("\n## API at a glance\n")
  section = text[start : text.index("\n## ", start + 1)]
  missing = [n for n in kfac_jax.__all__ if not re.search(rf"`{n}\b", section)]
  assert not missing, f"README API at a glance does not mention {missing}"
  assert "kfac_jax.flax.TrainState" in section
