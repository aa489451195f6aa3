"""kfac_jax.flax: the linen TrainState loop gives the plain tx.update loop's numbers, bitwise."""

import os
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state as flax_train_state

import kfac_jax
import kfac_jax.flax
from tests import _models

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class _MLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.tanh(nn.Dense(8)(x))
    return nn.Dense(3)(x)


def _problem():
  model = _MLP()
  x = _models.normal(
    0, (16, 4)
  )  # Drawn on the host; the init jitted (eager ops compile one by one).
  batch = {"x": x, "y": _models.integers(1, 0, 3, (16,))}
  params = jax.jit(model.init)(jax.random.key(2), x)["params"]

  def loss_fn(params, batch):
    logits = model.apply({"params": params}, batch["x"])
    kfac_jax.register_softmax_cross_entropy_loss(logits, batch["y"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

  tx = kfac_jax.kfac(loss_fn, batch, learning_rate=0.3, damping=1e-2, momentum=0.9, inverse_every=2)
  return model, loss_fn, params, batch, tx


def _create(cls, model, params, tx, **fields):
  """`cls.create(...)`, whose `tx.init` runs in one program (eager ops compile one by one)."""
  return jax.jit(lambda p, f: cls.create(apply_fn=model.apply, params=p, tx=tx, **f))(
    params, fields
  )


def _plain_loop(loss_fn, params, batch, tx, steps):
  @jax.jit
  def step(params, opt_state, rng):
    _, grads, stats = kfac_jax.value_and_grad(loss_fn)(params, batch, rng)
    updates, opt_state = tx.update(grads, opt_state, params, curvature_stats=stats)
    return optax.apply_updates(params, updates), opt_state

  opt_state = jax.jit(tx.init)(params)
  for i in range(steps):
    params, opt_state = step(params, opt_state, jax.random.key(10 + i))
  return params, opt_state


def _assert_trees_equal(a, b):
  la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
  assert len(la) == len(lb)
  for x, y in zip(la, lb):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("path", ["curvature_stats", "batch"])
def test_train_state_equals_plain_loop_bit_for_bit(path):
  model, loss_fn, params, batch, tx = _problem()
  want_params, want_opt = _plain_loop(loss_fn, params, batch, tx, 5)

  @jax.jit
  def train_step(state, rng):
    if path == "curvature_stats":
      _, grads, stats = kfac_jax.value_and_grad(loss_fn)(state.params, batch, rng)
      return state.apply_gradients(grads=grads, curvature_stats=stats)
    grads = jax.grad(loss_fn)(state.params, batch)
    return state.apply_gradients(grads=grads, batch=batch, rng=rng)

  state = _create(kfac_jax.flax.TrainState, model, params, tx)
  for i in range(5):
    state = train_step(state, jax.random.key(10 + i))
  assert int(state.step) == 5
  if path == "curvature_stats":
    _assert_trees_equal(state.params, want_params)
    _assert_trees_equal(state.opt_state, want_opt)
  else:  # The statistics are computed inside tx.update: the same numbers up to rounding.
    for a, b in zip(
      jax.tree_util.tree_leaves(state.params), jax.tree_util.tree_leaves(want_params)
    ):
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  assert not np.allclose(state.params["Dense_0"]["kernel"], params["Dense_0"]["kernel"])


def test_extra_fields_are_replaced_and_other_transforms_get_no_extra_args():
  class State(kfac_jax.flax.TrainState):
    note: jax.Array

  model, loss_fn, params, batch, _ = _problem()
  state = _create(State, model, params, optax.sgd(0.1), note=jnp.zeros(()))

  @jax.jit  # One program: eager operations would compile one by one.
  def apply(state, params):
    grads = jax.grad(loss_fn)(params, batch)
    new = state.apply_gradients(grads=grads, note=jnp.ones(()))  # plain optax: no extra args
    return new, optax.apply_updates(params, jax.tree_util.tree_map(lambda g: -0.1 * g, grads))

  new, want = apply(state, params)
  assert float(new.note) == 1.0
  _assert_trees_equal(new.params, want)


def test_plain_flax_train_state_misuse_is_a_clear_error():
  """Flax's own apply_gradients does not pass the statistics on: the transform says what is
  missing instead of silently training without curvature."""
  model, loss_fn, params, batch, tx = _problem()
  state = _create(flax_train_state.TrainState, model, params, tx)
  vg = jax.jit(kfac_jax.value_and_grad(loss_fn))  # One program: eager ops compile one by one.
  _, grads, stats = vg(params, batch, jax.random.key(0))
  with pytest.raises(ValueError, match="curvature_stats="):
    state.apply_gradients(grads=grads, curvature_stats=stats)


def test_overwrite_with_gradient_collection_is_refused():
  model, _, params, batch, tx = _problem()
  state = _create(kfac_jax.flax.TrainState, model, params, tx)
  grads = {"params": params, flax_train_state.OVERWRITE_WITH_GRADIENT: {}}
  with pytest.raises(ValueError, match="_overwrite_with_gradient"):
    state.apply_gradients(grads=grads, batch=batch, rng=jax.random.key(0))


def test_import_kfac_jax_does_not_import_flax():
  code = "import sys, kfac_jax; assert 'flax' not in sys.modules, 'flax imported'"
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
  out = subprocess.run(
    [sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=ROOT, check=False
  )
  assert out.returncode == 0, out.stderr
