"""The module seams of the tracer: static specs in a leaf module, blocks free of the tracer.

Read from the source (import statements run at import time; those under `if TYPE_CHECKING:`,
which only name types, are left out), so the test costs no import and no tracing.
"""

import ast
import pathlib

import pytest

_PKG = pathlib.Path(__file__).resolve().parents[2] / "kfac_jax"
_SCAN = _PKG / "scan"


def _kfac_imports(path: pathlib.Path) -> set[str]:
  """The `kfac_jax` modules a file imports, at any depth: `_specs`, `blocks._base`, `scan` (the
  face), and the tracer's private modules by their bare names (`_scanner`, `_graph`, ...)."""
  found = set()
  tree = ast.parse(path.read_text())
  typing_only = {
    id(n)
    for block in ast.walk(tree)
    if isinstance(block, ast.If) and ast.unparse(block.test) == "TYPE_CHECKING"
    for stmt in block.body
    for n in ast.walk(stmt)
  }
  for node in ast.walk(tree):
    if id(node) in typing_only:
      continue
    if isinstance(node, ast.Import):
      for a in node.names:
        if a.name.startswith("kfac_jax."):
          found.add(a.name.removeprefix("kfac_jax.").removeprefix("scan."))
    elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("kfac_jax"):
      module = node.module.removeprefix("kfac_jax").removeprefix(".")
      if module == "scan":  # `from kfac_jax.scan import _x` (inside the tracer) or a face name.
        found.update(a.name for a in node.names if a.name.startswith("_"))
        if not all(a.name.startswith("_") for a in node.names):
          found.add("scan")
      elif module.startswith("scan."):
        found.add(module.removeprefix("scan."))
      elif module:
        found.add(module)
      else:  # `from kfac_jax import _x, _y`
        found.update(a.name for a in node.names)
  return found


# What the scanner is made of: the tracer, the graph and its index, the matchers, the kinds.
_TRACER = {
  "_scanner",
  "_kinds",
  "_batch_axes",
  "_matchers",
  "_matchers_embed",
  "_matchers_shared",
  "_graph",
  "_index",
  "_stacked",
  "_tags",
  "scan",
}


@pytest.mark.parametrize("path", sorted(_PKG.joinpath("blocks").glob("*.py")), ids=str)
def test_blocks_do_not_import_the_tracer(path):
  imported = _kfac_imports(path)
  assert not imported & _TRACER, f"{path.name} imports {sorted(imported & _TRACER)}"


def test_the_checker_leaves_out_typing_only_imports():
  # The blocks name the vocabulary's types (`Kind`, `Approximation`) for the type checker only.
  assert "_kinds" not in _kfac_imports(_PKG / "blocks" / "_base.py")
  assert "_kinds" in _kfac_imports(_SCAN / "_layer_config.py")


def test_specs_is_a_leaf_module():
  assert _kfac_imports(_PKG / "_specs.py") <= {"_compat", "_errors"}


def test_import_checker_sees_imports():
  # The checker itself: the scanner does import the matchers and the specs.
  assert {"_matchers", "_specs", "_stacked"} <= _kfac_imports(_SCAN / "_scanner.py")


# The matcher modules, bottom up: each imports only the ones before it and modules below the
# tracer (never `_scanner`), so the embedding matchers never loop back into the dense ones.
_MATCHER_LAYERS = ("_matchers", "_stacked", "_matchers_embed", "_matchers_shared")


def test_batch_axes_reads_only_the_graph():
  # Below the matchers (they take its size rule): it must not import them or the index.
  assert _kfac_imports(_SCAN / "_batch_axes.py") <= {"_graph"}


@pytest.mark.parametrize("level", range(len(_MATCHER_LAYERS)), ids=_MATCHER_LAYERS)
def test_matcher_modules_are_layered(level):
  name = _MATCHER_LAYERS[level]
  imported = _kfac_imports(_SCAN / f"{name}.py")
  below = {"_batch_axes", "_compat", "_errors", "_graph", "_specs", "blocks"}
  allowed = below | set(_MATCHER_LAYERS[:level])
  assert imported <= allowed, f"{name} imports {sorted(imported - allowed)}"


def test_the_shared_matcher_sees_every_family():
  assert {"_matchers", "_matchers_embed"} <= _kfac_imports(_SCAN / "_matchers_shared.py")


def test_layer_config_reads_only_the_kinds():
  # The size policy is given the factor shapes the scanner asked of the blocks
  # (`blocks.factor_shapes_for`): it neither imports the blocks nor computes shapes itself.
  assert _kfac_imports(_SCAN / "_layer_config.py") <= {"_kinds"}


def test_the_kinds_sit_above_every_matcher_module():
  # One record per kind names its matchers, so `_kinds` imports them and none imports it.
  for name in (*_MATCHER_LAYERS, "_batch_axes", "_graph", "_index"):
    assert "_kinds" not in _kfac_imports(_SCAN / f"{name}.py"), name
  assert "blocks" in _kfac_imports(_SCAN / "_scanner.py")


def test_the_tracer_has_one_face():
  # Outside `kfac_jax/scan/`, the library reads the tracer through `kfac_jax.scan` only.
  private = {p.stem for p in _SCAN.glob("_*.py")} - {"__init__"}
  outside = sorted(_PKG.glob("*.py")) + sorted(_PKG.joinpath("blocks").glob("*.py"))
  for path in outside:
    imported = _kfac_imports(path)
    assert not imported & private, f"{path.name} imports {sorted(imported & private)}"


def _block_imports(path: pathlib.Path) -> set[str]:
  """The sibling modules a block module imports (`_kronecker`, `_layouts`, ...)."""
  names = {m.removeprefix("blocks.") for m in _kfac_imports(path) if m.startswith("blocks.")}
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.ImportFrom) and node.module == "kfac_jax.blocks":
      names.update(a.name for a in node.names)
  return names


def test_block_modules_form_no_cycle():
  graph = {p.stem: _block_imports(p) for p in _PKG.joinpath("blocks").glob("_*.py")}

  def reaches(a: str, b: str, seen: frozenset = frozenset()) -> bool:
    return any(n == b or (n not in seen and reaches(n, b, seen | {n})) for n in graph.get(a, ()))

  assert "_uses" in graph["_kronecker"]  # The checker sees `from kfac_jax.blocks import ...`.
  for name in graph:
    assert not reaches(name, name), f"blocks/{name}.py reaches itself through {graph[name]}"
