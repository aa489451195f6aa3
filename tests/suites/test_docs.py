"""The docs site: it builds offline without warnings, the API reference lists every public name,
and every page's Python code runs.

The convention for code on a page (`docs/*.rst`): every `.. code-block:: python` runs, in the
order of the page, in one namespace per page, in a temporary working directory. A block that
cannot run in the suite is preceded by a comment `.. not-tested: <reason>` and skipped. The
recipes page is the exception to the one namespace: each recipe is a complete program, and
`tests/suites/test_recipes.py` runs each in a fresh namespace and checks what it claims. The other
pages are run here and checked for what their code leaves behind (`CHECKS`).
"""

import ast
import glob
import importlib.metadata
import json
import os
import re
import subprocess
import sys
import tomllib

import jax
import numpy as np
import pytest
from packaging.requirements import Requirement

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOCS = os.path.join(ROOT, "docs")
PAGES = sorted(os.path.basename(p)[:-4] for p in glob.glob(os.path.join(DOCS, "*.rst")))
# Pages whose code has its own test file (with per-recipe checks).
OWN_TESTS = {
  "recipes": "tests/suites/test_recipes.py",
  "from_kfac_jax": "tests/suites/test_from_kfac_jax.py",
}


def page_blocks(page):
  """[(first line number, code or None if not tested, reason)] of a page's python blocks."""
  with open(os.path.join(DOCS, f"{page}.rst"), encoding="utf-8") as f:
    lines = f.read().splitlines()
  blocks = []
  i = 0
  while i < len(lines):
    if lines[i].strip() != ".. code-block:: python":
      i += 1
      continue
    indent = len(lines[i]) - len(lines[i].lstrip())
    prev = next((lines[j].strip() for j in range(i - 1, -1, -1) if lines[j].strip()), "")
    reason = prev[len(".. not-tested:") :].strip() if prev.startswith(".. not-tested:") else None
    j = i + 1
    while j < len(lines) and lines[j].strip().startswith(":"):  # directive options
      j += 1
    body = []
    while j < len(lines) and (
      not lines[j].strip() or len(lines[j]) - len(lines[j].lstrip()) > indent
    ):
      body.append(lines[j])
      j += 1
    code = "\n".join(body).strip("\n")
    pad = min(len(l) - len(l.lstrip()) for l in body if l.strip())
    code = "\n".join(l[pad:] for l in code.splitlines()) + "\n"
    blocks.append((i + 1, None if reason is not None else code, reason))
    i = j
  return blocks


def run_page(page, tmp_path, monkeypatch):
  """Runs the tested blocks of `docs/{page}.rst` in order in one namespace; returns it."""
  monkeypatch.chdir(tmp_path)
  scope = {"__name__": f"docs_{page}"}
  for line, code, _ in page_blocks(page):
    if code is not None:
      exec(compile(code, f"docs/{page}.rst:{line}", "exec"), scope)  # noqa: S102
  return scope


def test_code_block_convention():
  """Every page with code has tested blocks; an untested block says why."""
  assert {"getting_started", "entry_points", "recipes", "api"} <= set(PAGES)
  for page in PAGES:
    for line, code, reason in page_blocks(page):
      assert code is not None or len(reason) > 10, f"docs/{page}.rst:{line}: give a reason"
    with open(os.path.join(DOCS, f"{page}.rst"), encoding="utf-8") as f:
      text = f.read()
    # Only `.. code-block:: python` runs: a `::` literal or another directive would hide code.
    assert ".. code::" not in text and ".. sourcecode::" not in text, page


def _finite(x):
  return bool(np.all(np.isfinite(np.asarray(x))))


def _equal(a, b):
  same = jax.tree_util.tree_map(lambda x, y: bool(np.array_equal(x, y)), a, b)
  return all(jax.tree_util.tree_leaves(same))


def _check_getting_started(s):
  params0 = s["model"].init(jax.random.key(1), s["x"])
  assert float(s["loss"]) < 0.5 * float(s["loss_fn"](params0, s["batch"]))


def _check_entry_points(s):
  assert _finite(s["info"]["loss"]) and _finite(s["chain_loss"])
  assert float(s["inj_state"].hyperparams["damping"]) == 1.0
  grads, nat = s["grads"], s["nat_grads"]
  assert jax.tree_util.tree_structure(nat) == jax.tree_util.tree_structure(grads)
  assert not _equal(nat, grads)
  n = sum(np.size(g) for g in jax.tree_util.tree_leaves(grads))
  assert s["dense"].shape == (n, n)
  assert all(_finite(u) for u in jax.tree_util.tree_leaves(s["empirical_updates"]))


def _check_hyperparameters(s):
  assert float(s["opt_state"].hyperparams["damping"]) < 1.0  # The schedule moved it.
  assert np.isfinite(float(s["loss"]))
  # A burn-in step of the Config example: statistics folded, the update zero.
  assert not any(np.any(u) for u in jax.tree_util.tree_leaves(s["burn_in_updates"]))
  assert int(s["eigen_state"].preconditioner.skipped) == 0


def _check_approximations(s):
  approx = {spec.name: spec.approx for spec in s["reg"].layers}
  assert approx == {
    "params/hidden": "kron_out_diag",
    "params/head": "kron",
    "params/LayerNorm_0": "diagonal",
  }, approx
  assert {spec.approx for spec in s["ekfac_reg"].layers if spec.kind == "dense"} == {"ekfac"}
  blocked = {spec.name: spec for spec in s["blocked_layers"]}
  assert blocked["params/hidden"].factor_shapes == ((17, 17), (2, 16, 16))
  assert blocked["params/hidden"].note == "output side 32 in 2 blocks of 16"
  assert blocked["params/head"].factor_shapes == ((33, 33), (10, 10))
  # The exact-mode transform took the exact-mode statistics and made a finite update.
  assert all(_finite(u) for u in jax.tree_util.tree_leaves(s["updates"]))
  assert int(s["exact_state"].preconditioner.skipped) == 0


def _check_layers(s):
  assert [spec.approx for spec in s["layers"] if spec.kind == "dense"] == ["kron", "kron"]
  rel = s["rel_layers"][0]
  assert (rel.kind, rel.approx, rel.param_paths) == ("scale_and_shift", "diagonal", ("rel",))
  assert "gathered at constant positions with repeats" in rel.note
  # The user's block serves w2: its state is the diagonal the page's class keeps.
  assert [spec.block for spec in s["own"].layers] == [None, s["DiagonalFisher"]]
  (state,) = s["own_state"].preconditioner.curvature.factors["w2"]
  assert state.shape == (32 * 3,) and np.all(np.asarray(state) > 0)
  assert np.all(np.isfinite(np.asarray(s["updates"]["w2"])))


def _check_parallel(s):
  assert np.isfinite(float(s["loss"]))
  is_cache = lambda x: isinstance(x, s["kfac_jax"].ShardedCache)  # noqa: E731
  leaves = jax.tree_util.tree_leaves(s["opt_state"], is_leaf=is_cache)
  assert any(is_cache(x) for x in leaves)


def _check_checkpoints(s):
  assert _equal(s["restored"], s["opt_state"]) and _equal(s["from_bytes"], s["opt_state"])
  assert os.path.isdir("checkpoints/opt_state")
  # The run resumes from its newest checkpoint, parameters and state together.
  assert s["start"] == 0 and s["resumed_step"] == 3 == s["manager"].latest_step()
  assert _equal(s["resumed_state"], s["run_state"]) and _equal(s["resumed_params"], s["run_params"])


# What the code of each page leaves behind, beyond running without an error.
def _check_vmc(scope):
  """The hydrogen-like atom reached the exact a = Z and E = -Z^2/2 with K-FAC (`info`) and
  then, from a = 1 again, with SPRING (`params`, `e`), which skipped no update."""
  np.testing.assert_allclose(float(scope["info"]["loss"]), -4.5, atol=1e-3)
  np.testing.assert_allclose(np.asarray(scope["params"]["a"]), [3.0], atol=1e-3)
  np.testing.assert_allclose(float(scope["e"]), -4.5, atol=1e-3)
  assert int(scope["spring_state"].preconditioner.skipped) == 0


def _check_curvatures(scope):
  """Both curvatures from one registration trained the regression; the kernel's exact
  Gauss-Newton steps fitted its 64 points (160 parameters) far below K-FAC's loss."""
  assert float(scope["kernel_loss"]) < 1e-4 < float(scope["kfac_loss"]) < 0.05
  assert int(scope["s_kernel"].preconditioner.skipped) == 0


def _check_pinn(scope):
  """The Optimizer preset cut the Poisson loss a hundredfold, the kfac preset's steps did not
  raise it (the grid line search takes no step that does), the error is small."""
  loss0 = float(scope["loss_fn"](scope["init_params"](scope["k1"], (2, 32, 1)), scope["batch"]))
  assert float(scope["info"]["loss"]) < 0.01 * loss0
  assert float(scope["value"]) <= float(scope["info"]["loss"])
  assert float(scope["rel_l2"]) < 0.5
  # The kernel natural gradient (ENGD) took 40 steps, none skipped, below the Optimizer's loss.
  assert float(scope["kernel_value"]) < float(scope["info"]["loss"])
  assert int(scope["kernel_state"].preconditioner.skipped) == 0


CHECKS = {
  "curvatures": _check_curvatures,
  "pinn": _check_pinn,
  "vmc": _check_vmc,
  "getting_started": _check_getting_started,
  "entry_points": _check_entry_points,
  "hyperparameters": _check_hyperparameters,
  "approximations": _check_approximations,
  "layers": _check_layers,
  "parallel": _check_parallel,
  "checkpoints": _check_checkpoints,
}


@pytest.mark.parametrize("page", [p for p in PAGES if p not in OWN_TESTS])
def test_page_code_runs(page, tmp_path, monkeypatch):
  if not any(code for _, code, _ in page_blocks(page)):
    assert page not in CHECKS, f"docs/{page}.rst has no tested code"
    return
  scope = run_page(page, tmp_path, monkeypatch)  # Raises if a block fails.
  if page in CHECKS:
    CHECKS[page](scope)


@pytest.mark.slow
def test_sphinx_builds_without_warnings(tmp_path):
  pytest.importorskip("sphinx")
  proc = subprocess.run(
    [sys.executable, "-m", "sphinx", "-W", "-q", "-b", "html", DOCS, str(tmp_path)],
    capture_output=True,
    text=True,
    timeout=600,
    cwd=ROOT,
  )
  assert proc.returncode == 0, proc.stdout + proc.stderr
  api = (tmp_path / "api.html").read_text(encoding="utf-8")
  for name in ("scale_by_kfac", "CurvatureEstimator", "Optimizer", "register_conv", "TrainState"):
    assert name in api
  for page in PAGES:
    assert (tmp_path / f"{page}.html").exists(), page
  # Code blocks scroll inside the text column rather than run past it.
  assert "custom.css" in (tmp_path / "recipes.html").read_text(encoding="utf-8")
  assert "overflow-x: auto" in (tmp_path / "_static" / "custom.css").read_text(encoding="utf-8")


def test_api_reference_lists_every_public_name():
  """docs/api.rst has a directive for every name in `kfac_jax.__all__` and for kfac_jax.flax."""
  import kfac_jax  # pylint: disable=g-import-not-at-top

  with open(os.path.join(DOCS, "api.rst"), encoding="utf-8") as f:
    text = f.read()
  documented = set(re.findall(r"^\.\. auto\w+:: kfac_jax\.(\w+)\s*$", text, re.M))
  missing = sorted(set(kfac_jax.__all__) - documented)
  assert not missing, f"docs/api.rst does not document {missing}"
  assert ".. autoclass:: kfac_jax.flax.TrainState" in text


# Run in a fresh interpreter: the modules a docs build imports (conf.py's extensions and theme,
# and every module an autodoc directive names); prints those names and the files of the
# package's modules they loaded.
_IMPORTS = """
import importlib, json, re, runpy, sys
conf = runpy.run_path("docs/conf.py")
named = list(conf["extensions"]) + [conf["html_theme"]]
for page in sys.argv[1:]:
  text = open(page, encoding="utf-8").read()
  for target in re.findall(r"^\\.\\. auto\\w+:: ([\\w.]+)", text, re.M):
    parts = target.split(".")
    for i in range(len(parts), 0, -1):  # The longest prefix that is a module.
      try:
        importlib.import_module(".".join(parts[:i]))
        break
      except ImportError:
        continue
for name in named:
  importlib.import_module(name)
files = [m.__file__ for n, m in list(sys.modules.items()) if n.split(".")[0] == "kfac_jax"]
print(json.dumps({"named": named, "files": files}))
"""


def _closure(names):
  """The installed distributions `names` need, with their dependencies (extras not taken)."""
  seen, todo = set(), [Requirement(n).name for n in names]
  while todo:
    name = todo.pop().lower().replace("_", "-")
    if name in seen:
      continue
    seen.add(name)
    try:
      requires = importlib.metadata.requires(name) or []
    except importlib.metadata.PackageNotFoundError:
      continue
    for line in requires:
      req = Requirement(line)
      if req.marker is None or req.marker.evaluate({"extra": ""}):
        todo.append(req.name)
  return seen


def _imported_by(path):
  """The top-level names of a source file's absolute imports."""
  with open(path, encoding="utf-8") as f:
    tree = ast.parse(f.read())
  out = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      out.update(a.name.split(".")[0] for a in node.names)
    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
      out.add(node.module.split(".")[0])
  return out


def test_the_docs_extra_has_what_the_build_imports():
  """`pip install ".[docs]"` installs what the docs build imports: conf.py's extensions and
  theme, and the third-party modules that the package's modules loaded by the autodoc
  directives import, each come from a runtime dependency, the `docs` extra, or theirs. (The
  real check, a build in a fresh virtualenv with only that extra, needs a package index.)"""
  with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
    project = tomllib.load(f)["project"]
  allowed = _closure(project["dependencies"] + project["optional-dependencies"]["docs"])
  pages = sorted(glob.glob(os.path.join(DOCS, "*.rst")))
  proc = subprocess.run(
    [sys.executable, "-c", _IMPORTS, *pages],
    capture_output=True,
    text=True,
    timeout=300,
    cwd=ROOT,
    env={**os.environ, "JAX_PLATFORMS": "cpu"},
  )
  assert proc.returncode == 0, proc.stderr
  loaded = json.loads(proc.stdout)
  modules = {n.split(".")[0] for n in loaded["named"]}
  for path in loaded["files"]:
    modules |= _imported_by(path)
  modules -= set(sys.stdlib_module_names) | {"kfac_jax"}
  assert {"flax", "sphinx", "jax"} <= modules  # Seen: autodoc imports kfac_jax.flax.
  by_module = importlib.metadata.packages_distributions()
  missing = {
    m: by_module.get(m)
    for m in sorted(modules)
    if not any(d.lower().replace("_", "-") in allowed for d in by_module.get(m, ()))
  }
  assert not missing, f"imported by the docs build, not installed by the docs extra: {missing}"
