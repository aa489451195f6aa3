"""The recipes page (`docs/recipes.rst`) runs as written, one recipe at a time.

Each test executes the one Python block of a section of the page in a fresh namespace (each
recipe is a complete program and imports what it uses) and checks what the recipe claims:
training lowers the loss, and the model state comes back updated from the same forward pass.
"""

import os
import re

import jax
import numpy as np

from tests.suites.test_docs import DOCS, page_blocks

RECIPES = {
  "TrainState": "Flax linen ``TrainState``",
  "batch_stats": "Flax linen ``batch_stats`` (BatchNorm)",
  "haiku": "Haiku ``transform_with_state``",
  "nnx": "Flax nnx: split / merge with BatchNorm and Dropout",
  "equinox": "equinox",
  "share": "K-FAC on a share of the parameters: ``optax.multi_transform``",
  "accumulation": "Gradient accumulation over micro-batches",
}


def _sections():
  """{section title: (first line, last line)} of docs/recipes.rst."""
  with open(os.path.join(DOCS, "recipes.rst"), encoding="utf-8") as f:
    lines = f.read().splitlines()
  starts = [
    (i + 1, lines[i]) for i in range(len(lines) - 1) if re.fullmatch(r"-{3,}", lines[i + 1])
  ]
  return {t: (a, b) for (a, t), (b, _) in zip(starts, [*starts[1:], (len(lines) + 1, "")])}


def _run(title):
  """Executes the one Python block of section `title`; returns its namespace."""
  first, last = _sections()[title]
  blocks = [(line, code) for line, code, _ in page_blocks("recipes") if first < line < last]
  assert len(blocks) == 1 and blocks[0][1], f"docs/recipes.rst / {title}: one tested block"
  line, code = blocks[0]
  scope = {}
  exec(compile(code, f"docs/recipes.rst:{line}", "exec"), scope)  # noqa: S102
  return scope


def _changed(a, b):
  return any(
    not np.array_equal(x, y)
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b))
  )


def test_every_recipe_is_tested():
  assert list(_sections()) == list(RECIPES.values())
  assert len(page_blocks("recipes")) == len(RECIPES)


def test_flax_train_state_recipe():
  s = _run(RECIPES["TrainState"])
  state, batch = s["state"], s["batch"]
  assert int(state.step) == 10
  params0 = jax.jit(s["model"].init)(jax.random.key(1), s["x"])["params"]
  assert float(s["loss"]) < 0.5 * float(jax.jit(s["loss_fn"])(params0, batch))


def test_linen_batch_stats_recipe():
  s = _run(RECIPES["batch_stats"])
  state, variables, batch = s["state"], s["variables"], s["batch"]
  # The running statistics moved: they came back as aux from the training forward pass.
  assert _changed(state.batch_stats, variables["batch_stats"])
  mean = state.batch_stats["BatchNorm_0"]["mean"]
  assert np.all(np.isfinite(mean)) and float(np.abs(mean).max()) > 0
  loss0, _ = jax.jit(s["loss_fn"])(
    variables["params"], {**batch, "batch_stats": variables["batch_stats"]}
  )
  assert float(s["loss"]) < 0.5 * float(loss0)


def test_haiku_transform_with_state_recipe():
  s = _run(RECIPES["haiku"])
  params0, state0 = jax.jit(s["net"].init, static_argnames="is_training")(
    jax.random.key(1), s["x"], is_training=True
  )
  assert _changed(s["net_state"], state0)
  loss0, _ = jax.jit(s["loss_fn"])(params0, {**s["batch"], "net_state": state0})
  assert float(s["loss"]) < 0.5 * float(loss0)


def test_nnx_split_merge_recipe():
  s = _run(RECIPES["nnx"])
  rest = s["rest"]
  # Ten training calls: the dropout stream's counter advanced ten times (one mask per step),
  # and the BatchNorm statistics moved away from their initial zeros and ones.
  counts = [
    int(v)
    for p, v in jax.tree_util.tree_leaves_with_path(rest)
    if "['drop']" in jax.tree_util.keystr(p) and "count" in jax.tree_util.keystr(p)
  ]
  assert counts == [10], jax.tree_util.tree_map(np.shape, rest)
  assert float(np.abs(np.asarray(s["model"].bn.mean[...])).max()) > 0
  assert float(s["loss"]) < 1.0
  assert s["model"].bn.use_running_average  # model.eval() after nnx.update


def test_equinox_recipe():
  s = _run(RECIPES["equinox"])
  eqx = s["eqx"]
  params0 = eqx.filter_jit(lambda k: eqx.partition(s["MLP"](k), eqx.is_inexact_array)[0])(
    jax.random.key(1)
  )
  assert float(s["loss"]) < 0.5 * float(jax.jit(s["loss_fn"])(params0, s["batch"]))
  assert float(s["accuracy"]) > 0.8


def test_share_of_the_parameters_recipe():
  s = _run(RECIPES["share"])
  state = s["opt_state"].inner_states["kfac"].inner_state
  # Only the share's layers have K-FAC state; the embedding (Adam's) has none.
  assert sorted(state.preconditioner.curvature.factors) == ["params/head", "params/hidden"]
  params0 = jax.jit(s["model"].init)(jax.random.key(1), s["tokens"])
  assert float(s["loss"]) < 0.1 * float(jax.jit(s["loss_fn"])(params0, s["batch"]))
  # Adam moved the embedding too.
  assert _changed(s["params"]["params"]["embed"], params0["params"]["embed"])


def test_gradient_accumulation_recipe():
  s = _run(RECIPES["accumulation"])
  # 20 updates of accumulated gradients: the whole batch's loss is well below its start.
  loss0 = float(jax.jit(s["loss_fn"])(s["params"], s["batch"]))
  assert float(s["loss"]) < 0.5 * np.log(3.0)
  assert loss0 < 0.5 * np.log(3.0)
  assert int(s["opt_state"].preconditioner.count) == 20
