"""The module seams of the scanner: static specs in a leaf module, blocks free of the tracer.

Read from the source (import statements only), so the test costs no import and no tracing.
"""

import ast
import pathlib

import pytest

_PKG = pathlib.Path(__file__).resolve().parent.parent / "kfac_jax"
_SCAN = _PKG / "scan"


def _kfac_imports(path: pathlib.Path) -> set[str]:
  """The `kfac_jax` modules a file imports, at any depth: `_specs`, `blocks._base`, `scan` (the
  face), and the tracer's private modules by their bare names (`_scanner`, `_graph`, ...)."""
  found = set()
  for node in ast.walk(ast.parse(path.read_text())):
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


# What the scanner is made of: the tracer, the graph and its index, the matchers.
_TRACER = {
  "_scanner",
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


@pytest.mark.parametrize(
  "path", sorted(_PKG.joinpath("blocks").glob("*.py")) + [_SCAN / "_layer_config.py"], ids=str
)
def test_blocks_and_layer_config_do_not_import_the_scanner(path):
  imported = _kfac_imports(path)
  assert not imported & _TRACER, f"{path.name} imports {sorted(imported & _TRACER)}"


def test_specs_is_a_leaf_module():
  assert _kfac_imports(_PKG / "_specs.py") <= {"_compat"}


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
  allowed = {"_batch_axes", "_compat", "_graph", "_specs", "blocks", *_MATCHER_LAYERS[:level]}
  assert imported <= allowed, f"{name} imports {sorted(imported - allowed)}"


def test_the_shared_matcher_sees_every_family():
  assert {"_matchers", "_matchers_embed"} <= _kfac_imports(_SCAN / "_matchers_shared.py")


def test_layer_config_reads_only_the_specs():
  # The size policy is given the factor shapes the scanner asked of the blocks
  # (`blocks.factor_shapes_for`): it neither imports the blocks nor computes shapes itself.
  assert _kfac_imports(_SCAN / "_layer_config.py") <= {"_specs"}
  assert "blocks" in _kfac_imports(_SCAN / "_scanner.py")


def test_the_tracer_has_one_face():
  # Outside `kfac_jax/scan/`, the library reads the tracer through `kfac_jax.scan` only.
  private = {p.stem for p in _SCAN.glob("_*.py")} - {"__init__"}
  outside = sorted(_PKG.glob("*.py")) + sorted(_PKG.joinpath("blocks").glob("*.py"))
  for path in outside:
    imported = _kfac_imports(path)
    assert not imported & private, f"{path.name} imports {sorted(imported & private)}"
