"""`kfac_jax.Registration`: one scan shared by every entry point; statistics' fingerprints."""

import dataclasses

import _models
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.flatten_util import ravel_pytree

import kfac_jax

LINKED = kfac_jax.LayerConfig(linked={("layer0/*", "layer1/*"): "full"})


def _problem(n=8, calls=None):
  params = _models.jnp_mlp_init(jax.random.key(0), (4, 5, 3))
  batch = _models.classification_batch(jax.random.key(1), n=n)
  inner = _models.softmax_loss(_models.jnp_mlp_apply)

  def loss_fn(p, b):
    if calls is not None:
      calls.append(1)
    return inner(p, b)

  return loss_fn, params, batch


def _leaves_equal(a, b):
  la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
  assert len(la) == len(lb)
  for x, y in zip(la, lb):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_linked_layers_with_value_and_grad_share_one_registration(x64):
  """The issue's case: `value_and_grad` + a transform with `LayerConfig(linked=...)`.

  One full block over every parameter, empirical Fisher at batch size 1 (the generic block's
  h hᵀ / N is then exact), ema_decay 0: the update is (F + λ I)⁻¹ g with F = ∇ℓ ∇ℓᵀ.
  """
  loss_fn, params, batch = _problem(n=1)
  params = _models.to_dtype(params, jnp.float64)
  batch = {**batch, "x": batch["x"].astype(jnp.float64)}
  # Separately, the two scans disagree: the transform's stats check names both layer sets.
  tx_alone = kfac_jax.scale_by_kfac(
    registration=kfac_jax.Registration(
      loss_fn, params, batch, layers=LINKED, estimation_mode="empirical"
    )
  )
  state = tx_alone.init(params)
  vg_alone = kfac_jax.value_and_grad(
    registration=kfac_jax.Registration(loss_fn, params, batch, estimation_mode="empirical")
  )
  _, grads, stats = jax.eval_shape(vg_alone, params, batch)
  with pytest.raises(ValueError, match=r"computed for layers \['layer0', 'layer1'\], but .*"):
    jax.eval_shape(
      lambda s, g, st: tx_alone.update(g, s, params, curvature_stats=st), state, grads, stats
    )

  reg = kfac_jax.Registration(loss_fn, params, batch, layers=LINKED, estimation_mode="empirical")
  (spec,) = reg.layers
  assert (spec.kind, spec.approx, spec.source) == ("generic", "full", "linked")
  lam = 0.3
  tx = kfac_jax.scale_by_kfac(registration=reg, damping=lam, ema_decay=0.0, inverse_every=1)
  vg = kfac_jax.value_and_grad(registration=reg)

  def step(p, s):
    loss, g, st = vg(p, batch)
    return loss, g, st, tx.update(g, s, p, curvature_stats=st)[0]

  loss, grads, stats, updates = jax.jit(step)(params, tx.init(params))
  assert stats.fingerprint == reg.fingerprint
  g, _ = ravel_pytree(grads)
  expected = np.linalg.solve(np.outer(g, g) + lam * np.eye(g.size), g)
  np.testing.assert_allclose(ravel_pytree(updates)[0], expected, rtol=1e-9, atol=1e-12)
  np.testing.assert_allclose(g, ravel_pytree(jax.grad(loss_fn)(params, batch))[0], rtol=1e-12)
  np.testing.assert_allclose(loss, loss_fn(params, batch), rtol=1e-12)
  # `value_and_grad(layers=...)` without a shared object registers the same layers too.
  vg2 = kfac_jax.value_and_grad(
    registration=kfac_jax.Registration(
      loss_fn, params, batch, estimation_mode="empirical", layers=LINKED
    )
  )
  assert jax.eval_shape(vg2, params, batch)[2].fingerprint == reg.fingerprint


def test_statistics_of_another_mode_samples_or_layer_set_are_refused():
  loss_fn, params, batch = _problem()
  rng = jax.random.key(2)
  tx = kfac_jax.scale_by_kfac(loss_fn, batch)  # "gradients", 1 sample, two dense layers.
  state = tx.init(params)
  grads = jax.tree_util.tree_map(jnp.ones_like, params)

  def update(stats_kw):  # Traced only: the checks are static.
    reg = kfac_jax.Registration(loss_fn, params, batch, **stats_kw)
    stats = jax.eval_shape(kfac_jax.value_and_grad(registration=reg), params, batch, rng)[2]
    return jax.eval_shape(
      lambda s, st: tx.update(grads, s, params, curvature_stats=st), state, stats
    )

  cases = [
    (dict(estimation_mode="exact"), r"estimation_mode='exact'.*built for estimation_mode='gr"),
    (dict(num_samples=2), r"num_samples=2, but .* built for .*num_samples=1"),
    (dict(layers=LINKED), r"computed for layers \['layer0/b'\], but .* has layers \['layer0'"),
  ]
  for kw, pattern in cases:
    with pytest.raises(ValueError, match=pattern) as info:
      update(kw)
    assert "scale_by_kfac transform" in str(info.value)
  # The same contents from a separate but equal registration are accepted.
  update({})
  # The estimator names itself.
  est = kfac_jax.CurvatureEstimator(
    kfac_jax.Registration(loss_fn, params, batch, estimation_mode="exact")
  )
  est_state = est.init(params)
  stats = jax.eval_shape(kfac_jax.value_and_grad(loss_fn), params, batch, rng)[2]
  with pytest.raises(ValueError, match="this estimator was built for estimation_mode='exact'"):
    jax.eval_shape(lambda s, st: est.update_curvature_from_stats(s, st, 0.9), est_state, stats)


def test_simple_calls_equal_the_shared_registration_calls():
  calls = []
  loss_fn, params, batch = _problem(calls=calls)
  rng = jax.random.key(3)
  reg = kfac_jax.Registration(loss_fn, params, batch)
  assert len(calls) == 1
  tx1 = kfac_jax.scale_by_kfac(loss_fn, batch)
  tx2 = kfac_jax.scale_by_kfac(registration=reg)
  vg1 = kfac_jax.value_and_grad(loss_fn)
  vg2 = kfac_jax.value_and_grad(registration=reg)

  def step(tx, vg, p, s, b, r):
    loss, g, st = vg(p, b, r)
    return loss, g, st, tx.update(g, s, p, curvature_stats=st)

  def both(p, s1, s2, b, r):
    return step(tx1, vg1, p, s1, b, r), step(tx2, vg2, p, s2, b, r)

  s1 = tx1.init(params)
  n = len(calls)
  s2 = tx2.init(params)
  out1, out2 = jax.jit(both)(params, s1, s2, batch, rng)
  _leaves_equal(out1, out2)
  assert out1[2].fingerprint == out2[2].fingerprint == reg.fingerprint
  # No scan per trace: the shared init and (new) traces of the shared step reuse the
  # registration's graph; the simple path's value_and_grad scanned once, in its first trace.
  assert len(calls) == n + 1
  jax.jit(lambda *a: step(tx2, vg2, *a)).lower(params, s2, batch, rng)
  assert len(calls) == n + 1
  # A batch of another size is traced (scanned) once, then reused.
  small = jax.tree_util.tree_map(lambda x: x[:4], batch)
  jax.eval_shape(vg2, params, small, rng)
  jax.eval_shape(vg2, params, small, rng)
  assert len(calls) == n + 2

  opt1 = kfac_jax.Optimizer(loss_fn, batch)
  opt2 = kfac_jax.Optimizer(registration=reg)
  o1, o2 = opt1.init(params), opt2.init(params)
  _leaves_equal(o1, o2)
  assert opt1.estimator.layers == opt2.estimator.layers
  assert [type(b) for b in opt1.estimator.blocks] == [type(b) for b in opt2.estimator.blocks]
  n = len(calls)
  jax.eval_shape(opt2.step, params, o2, batch, rng)
  assert len(calls) == n
  assert reg.layers == kfac_jax.Registration(loss_fn, params, batch).layers
  assert kfac_jax.summary(registration=reg) == kfac_jax.summary(loss_fn, params, batch)
  assert kfac_jax.check_registration(registration=reg) == reg.layers
  est = kfac_jax.CurvatureEstimator(registration=reg)
  assert est.layers == reg.layers  # Known before `init`.


def test_params_signature_mismatch_names_the_path():
  loss_fn, params, batch = _problem()
  reg = kfac_jax.Registration(loss_fn, params, batch)
  tx = kfac_jax.scale_by_kfac(registration=reg)
  wide = {**params, "layer1": {**params["layer1"], "w": jnp.zeros((5, 4))}}
  with pytest.raises(ValueError, match=r"params pytree differs.*`layer1/w` has shape \(5, 4\)"):
    tx.init(wide)
  extra = {**params, "layer2": {"b": jnp.zeros(3)}}
  with pytest.raises(ValueError, match="`layer2/b` is not in the registered params"):
    kfac_jax.Optimizer(registration=reg).init(extra)
  half = _models.to_dtype(params, jnp.float16)
  with pytest.raises(ValueError, match="`layer0/b` has shape .* dtype float16"):
    kfac_jax.value_and_grad(registration=reg)(half, batch, jax.random.key(0))
  state = tx.init(params)
  with pytest.raises(ValueError, match="`layer0/w` is missing"):
    tx.update(params, state, {"layer0": {"b": params["layer0"]["b"]}}, batch=batch)


def test_registration_arguments_and_immutability():
  loss_fn, params, batch = _problem()
  reg = kfac_jax.Registration(loss_fn, params, batch, estimation_mode="exact")
  with pytest.raises(ValueError, match="not both"):
    kfac_jax.scale_by_kfac(loss_fn, registration=reg)
  with pytest.raises(TypeError, match="as `registration=`"):
    kfac_jax.value_and_grad(reg)
  with pytest.raises(TypeError, match="`registration` must be a kfac_jax.Registration"):
    kfac_jax.kfac(registration="reg", learning_rate=0.1)
  est = kfac_jax.CurvatureEstimator(registration=reg)
  assert est.registration.estimation_mode == "exact"
  with pytest.raises(dataclasses.FrozenInstanceError):
    reg.strict = True
  assert "estimation_mode='exact'" in repr(reg) and reg.fingerprint.digest in repr(reg)
  # With optax.inject_hyperparams the registration is passed through as a static argument.
  tx = optax.inject_hyperparams(kfac_jax.kfac, static_args=("registration",))(
    registration=reg, learning_rate=0.1
  )
  state = tx.init(params)
  _, grads, stats = jax.eval_shape(kfac_jax.value_and_grad(registration=reg), params, batch)
  jax.eval_shape(lambda s, g, st: tx.update(g, s, params, curvature_stats=st), state, grads, stats)
