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
  return all(
    bool(jnp.all(jnp.isfinite(x.astype(jnp.float32)))) for x in jax.tree_util.tree_leaves(tree)
  )


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


@pytest.mark.parametrize("guard", [True, False])
def test_nan_in_the_batch_leaves_the_curvature_state_unchanged(guard):
  """With the guard, the NaN gradient skips the update before any statistics are computed
  (`skipped` +1); without it, the statistics are computed, found non-finite and kept out of the
  factors (`skipped_batches` +1). Either way every factor and inverse is unchanged."""
  params = _models.jnp_mlp_init(jax.random.key(0), (4, 5, 3))
  batch = _models.classification_batch(jax.random.key(1), n=8, din=4, classes=3)
  loss_fn = _models.softmax_loss(_models.jnp_mlp_apply)
  tx = kfac_jax.scale_by_kfac(loss_fn, batch, damping=1e-2, inverse_every=2, skip_nonfinite=guard)
  state = tx.init(params)
  step = jax.jit(lambda p, s, b, k: tx.update(jax.grad(loss_fn)(p, b), s, p, batch=b, rng=k))
  _, state = step(params, state, batch, jax.random.key(0))
  bad = {"x": batch["x"].at[3, 1].set(jnp.nan), "y": batch["y"]}
  _, after = step(params, state, bad, jax.random.key(1))
  assert int(after.curvature.skipped_batches) == (0 if guard else 1)
  assert int(after.skipped) == (1 if guard else 0)
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
    tx = kfac_jax.kfac(
      loss_fn, batch, learning_rate=0.3, momentum=0.5, damping=1e-2, inverse_every=2
    )
    state = tx.init(params)
    step = _step_fn(loss_fn, tx)
    curve = []
    for i in range(30):
      params, state, loss, updates = step(params, state, batch, jax.random.key(i))
      curve.append(float(loss))
    assert {x.dtype for x in jax.tree_util.tree_leaves(params)} == {jnp.dtype(dtype)}
    assert {x.dtype for x in jax.tree_util.tree_leaves(state[0].curvature.factors)} == {
      jnp.dtype(jnp.float32)
    }  # Statistics and inverses stay float32.
    losses[dtype] = np.asarray(curve)
  f32, bf16 = losses[jnp.float32], losses[jnp.bfloat16]
  assert f32[-1] < 0.5 * f32[0]
  assert np.all(np.isfinite(bf16))
  assert abs(bf16[-1] - f32[-1]) < 0.05 + 0.1 * f32[-1], (f32[-1], bf16[-1])


def _leaf_dtypes(tree):
  return {x.dtype for x in jax.tree_util.tree_leaves(tree)}


def _one_update(loss_fn, params, batch, **kwargs):
  tx = kfac_jax.scale_by_kfac(loss_fn, batch, damping=1e-2, ema_decay=0.5, **kwargs)
  state = tx.init(params)
  _, grads, stats = kfac_jax.value_and_grad(loss_fn)(params, batch, jax.random.key(0))
  step = jax.jit(lambda g, s, p, st: tx.update(g, s, p, curvature_stats=st))
  for _ in range(2):  # The second update uses the inverses of the first's statistics.
    updates, state = step(grads, state, params, stats)
  return updates, state


def test_bfloat16_statistics_store_half_the_bytes_and_track_float32():
  params = _models.to_dtype(_models.jnp_mlp_init(jax.random.key(0), (8, 16, 4)), jnp.bfloat16)
  data = _models.classification_batch(jax.random.key(1), n=64, din=8, classes=4)
  batch = {"x": data["x"].astype(jnp.bfloat16), "y": data["y"]}
  loss_fn = _models.softmax_loss(_models.jnp_mlp_apply)
  ref_updates, ref = _one_update(loss_fn, params, batch)
  updates, state = _one_update(loss_fn, params, batch, stats_dtype="bfloat16")
  curv = state.curvature
  assert _leaf_dtypes(curv.factors) == {jnp.dtype(jnp.bfloat16)}
  assert _leaf_dtypes(curv.cache) == {jnp.dtype(jnp.float32)}
  assert curv.ema_weight.dtype == jnp.float32  # The average's weight stays exact.
  assert _leaf_dtypes(updates) == {jnp.dtype(jnp.bfloat16)}
  nbytes = lambda t: sum(x.nbytes for x in jax.tree_util.tree_leaves(t))  # noqa: E731
  assert nbytes(curv.factors) * 2 == nbytes(ref.curvature.factors)
  for a, b in zip(
    jax.tree_util.tree_leaves(curv.factors), jax.tree_util.tree_leaves(ref.curvature.factors)
  ):
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b), rtol=1e-2, atol=1e-3)
  for u, r in zip(jax.tree_util.tree_leaves(updates), jax.tree_util.tree_leaves(ref_updates)):
    u, r = np.asarray(u, np.float32), np.asarray(r, np.float32)
    assert np.linalg.norm(u - r) < 0.05 * np.linalg.norm(r)


def test_float16_statistics_that_overflow_skip_the_batch():
  params = _models.jnp_mlp_init(jax.random.key(0), (6, 8, 3))
  batch = _models.classification_batch(jax.random.key(1), n=16, din=6, classes=3)
  loss_fn = _models.softmax_loss(_relu_mlp)
  tx = kfac_jax.scale_by_kfac(loss_fn, batch, damping=1e-2, stats_dtype="float16")
  state = tx.init(params)
  step = jax.jit(lambda p, s, b, k: tx.update(jax.grad(loss_fn)(p, b), s, p, batch=b, rng=k))
  _, state = step(params, state, batch, jax.random.key(0))
  assert int(state.curvature.skipped_batches) == 0
  # Inputs at 1e3 give second moments ~1e6, beyond float16's largest value (65504).
  _, after = step(params, state, {"x": 1e3 * batch["x"], "y": batch["y"]}, jax.random.key(1))
  assert int(after.curvature.skipped_batches) == 1
  for a, b in zip(
    jax.tree_util.tree_leaves(after.curvature.factors),
    jax.tree_util.tree_leaves(state.curvature.factors),
  ):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_float64_inverses_of_float32_statistics(x64):
  params = _models.jnp_mlp_init(jax.random.key(0), (6, 8, 3))  # float32 under x64 too.
  params = _models.to_dtype(params, jnp.float32)
  data = _models.classification_batch(jax.random.key(1), n=16, din=6, classes=3)
  batch = {"x": data["x"].astype(jnp.float32), "y": data["y"]}
  loss_fn = _models.softmax_loss(_models.jnp_mlp_apply)
  updates, state = _one_update(
    loss_fn, params, batch, stats_dtype="float32", inverse_dtype="float64"
  )
  assert _leaf_dtypes(state.curvature.factors) == {jnp.dtype(jnp.float32)}
  assert _leaf_dtypes(state.curvature.cache) == {jnp.dtype(jnp.float64)}
  assert _leaf_dtypes(updates) == {jnp.dtype(jnp.float32)}
  ref_updates, _ = _one_update(loss_fn, params, batch)  # float64 everything under x64.
  for u, r in zip(jax.tree_util.tree_leaves(updates), jax.tree_util.tree_leaves(ref_updates)):
    np.testing.assert_allclose(np.asarray(u), np.asarray(r, np.float32), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize(
  "kwargs, match",
  [
    ({"stats_dtype": "int32"}, "`stats_dtype` must be one of bfloat16, float16, float32"),
    ({"stats_dtype": "complex64"}, "`stats_dtype` must be one of"),
    ({"inverse_dtype": "bfloat16"}, "`inverse_dtype` must be one of float32, float64"),
    ({"inverse_dtype": "float8"}, "`inverse_dtype` must be one of"),
    ({"inverse_dtype": "float64"}, "`inverse_dtype`=float64 needs 64-bit JAX"),
  ],
)
def test_bad_dtype_arguments_name_the_argument(kwargs, match):
  if jax.config.jax_enable_x64:
    pytest.skip("the float64 case needs x64 off")
  loss_fn = _models.softmax_loss(_models.jnp_mlp_apply)
  batch = _models.classification_batch(jax.random.key(1), n=4, din=6, classes=3)
  with pytest.raises(ValueError, match=match):
    kfac_jax.scale_by_kfac(loss_fn, batch, **kwargs)
  with pytest.raises(ValueError, match=match.replace("`", "`config.", 1)):
    kfac_jax.OptimizerConfig(**kwargs)


def test_optimizer_keeps_statistics_in_the_configured_dtype():
  params = _models.jnp_mlp_init(jax.random.key(0), (6, 8, 3))
  batch = _models.classification_batch(jax.random.key(1), n=16, din=6, classes=3)
  loss_fn = _models.softmax_loss(_models.jnp_mlp_apply)
  opt = kfac_jax.Optimizer(
    loss_fn, batch, config=kfac_jax.OptimizerConfig(stats_dtype="bfloat16"), inverse_every=1
  )
  state = opt.init(params)
  new_params, state, info = jax.jit(opt.step)(params, state, batch, jax.random.key(0))
  assert _leaf_dtypes(state.curvature.factors) == {jnp.dtype(jnp.bfloat16)}
  assert _leaf_dtypes(state.curvature.cache) == {jnp.dtype(jnp.float32)}
  assert not bool(info["skipped"]) and _finite(new_params)
