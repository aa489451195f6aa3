"""Numerical safety: dead units, rank-deficient batches, huge activations, NaN, bfloat16."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import kfac_jax
from tests import _models


def _step_fn(loss_fn, tx):
  @jax.jit
  def step(params, state, batch, rng):
    loss, grads, stats = kfac_jax.value_and_grad(loss_fn)(params, batch, rng)
    updates, state = tx.update(grads, state, params, curvature_stats=stats)
    return optax.apply_updates(params, updates), state, loss, updates
  return step


def _finite(tree):
  return all(bool(jnp.all(jnp.isfinite(x.astype(jnp.float32))))
             for x in jax.tree_util.tree_leaves(tree))


def _relu_mlp(params, x):
  h = jax.nn.relu(x @ params["layer0"]["w"] + params["layer0"]["b"])
  return h @ params["layer1"]["w"] + params["layer1"]["b"]


@pytest.mark.parametrize("case", ["dead_units", "rank_deficient", "huge_activations"])
def test_degenerate_statistics_give_finite_updates(case):
  params = _models.jnp_mlp_init(jax.random.key(0), (6, 8, 3))
  batch = _models.classification_batch(jax.random.key(1), n=16, din=6, classes=3)
  if case == "dead_units":
    # Half the hidden units never fire: their rows/columns of A are exactly zero.
    params["layer0"]["b"] = params["layer0"]["b"].at[:4].set(-1e3)
  elif case == "rank_deficient":
    # Two examples repeated: A and G have rank <= 3 against dimensions 7, 9 and 8, 3.
    batch = {"x": jnp.tile(batch["x"][:2], (8, 1)), "y": jnp.tile(batch["y"][:2], 8)}
  else:
    batch = {"x": 1e4 * batch["x"], "y": batch["y"]}
  loss_fn = _models.softmax_loss(_relu_mlp)
  tx = kfac_jax.kfac(loss_fn, batch, learning_rate=0.1, damping=1e-3, inverse_every=1)
  state = tx.init(params)
  step = _step_fn(loss_fn, tx)
  for i in range(3):
    params, state, loss, updates = step(params, state, batch, jax.random.key(i))
    assert _finite(updates), case
    assert _finite(params) and _finite(state), case
  assert int(state[0].curvature.failed_inverses) == 0, case
  assert int(state[0].curvature.skipped_batches) == 0, case


def test_nan_in_the_batch_leaves_the_curvature_state_unchanged():
  params = _models.jnp_mlp_init(jax.random.key(0), (4, 5, 3))
  batch = _models.classification_batch(jax.random.key(1), n=8, din=4, classes=3)
  loss_fn = _models.softmax_loss(_models.jnp_mlp_apply)
  tx = kfac_jax.scale_by_kfac(loss_fn, batch, damping=1e-2, inverse_every=2)
  state = tx.init(params)
  step = jax.jit(lambda p, s, b, k: tx.update(jax.grad(loss_fn)(p, b), s, p, batch=b, rng=k))
  _, state = step(params, state, batch, jax.random.key(0))
  bad = {"x": batch["x"].at[3, 1].set(jnp.nan), "y": batch["y"]}
  _, after = step(params, state, bad, jax.random.key(1))
  assert int(after.curvature.skipped_batches) == 1
  same = after.curvature._replace(skipped_batches=state.curvature.skipped_batches)
  for a, b in zip(jax.tree_util.tree_leaves(same), jax.tree_util.tree_leaves(state.curvature)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_bfloat16_training_tracks_the_float32_run():
  params32 = _models.jnp_mlp_init(jax.random.key(0), (8, 16, 4))
  data = _models.classification_batch(jax.random.key(1), n=64, din=8, classes=4)
  loss_fn = _models.softmax_loss(_models.jnp_mlp_apply)
  losses = {}
  for dtype in (jnp.float32, jnp.bfloat16):
    params = _models.to_dtype(params32, dtype)
    batch = {"x": data["x"].astype(dtype), "y": data["y"]}
    tx = kfac_jax.kfac(loss_fn, batch, learning_rate=0.3, momentum=0.5, damping=1e-2,
                       inverse_every=2)
    state = tx.init(params)
    step = _step_fn(loss_fn, tx)
    curve = []
    for i in range(30):
      params, state, loss, updates = step(params, state, batch, jax.random.key(i))
      curve.append(float(loss))
    assert {x.dtype for x in jax.tree_util.tree_leaves(params)} == {jnp.dtype(dtype)}
    assert {x.dtype for x in jax.tree_util.tree_leaves(state[0].curvature.factors)} == {
        jnp.dtype(jnp.float32)}  # Statistics and inverses stay float32.
    losses[dtype] = np.asarray(curve)
  f32, bf16 = losses[jnp.float32], losses[jnp.bfloat16]
  assert f32[-1] < 0.5 * f32[0]
  assert np.all(np.isfinite(bf16))
  assert abs(bf16[-1] - f32[-1]) < 0.05 + 0.1 * f32[-1], (f32[-1], bf16[-1])
