"""Loss functions with auxiliary outputs (`has_aux=True`): BatchNorm statistics round trip."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import kfac_jax


class _BNNet(nn.Module):
  """Dense → BatchNorm → tanh → Dense: the linen `batch_stats` pattern."""

  @nn.compact
  def __call__(self, x):
    x = nn.Dense(6)(x)
    x = nn.BatchNorm(use_running_average=False, momentum=0.8)(x)
    return nn.Dense(3)(jnp.tanh(x))


def _problem(dtype=jnp.float32, n=16):
  model = _BNNet()
  kx, ky = jax.random.split(jax.random.key(1))
  x = jax.random.normal(kx, (n, 4), dtype)
  y = jax.random.randint(ky, (n,), 0, 3)
  # One program: eagerly, each op of the init and each cast compiles its own.
  variables = jax.jit(
    lambda key, x: jax.tree_util.tree_map(lambda v: v.astype(dtype), model.init(key, x))
  )(jax.random.key(0), x)
  calls = []

  def loss_fn(params, batch):
    calls.append(1)  # One call per trace: the aux comes from the scanned forward pass.
    logits, new = model.apply(
      {"params": params, "batch_stats": batch["batch_stats"]}, batch["x"], mutable=["batch_stats"]
    )
    kfac_jax.register_softmax_cross_entropy_loss(logits, batch["y"])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
    return loss, {"batch_stats": new["batch_stats"], "logits": logits}

  batch = {"x": x, "y": y, "batch_stats": variables["batch_stats"]}
  return loss_fn, variables["params"], batch, calls


def _assert_trees_equal(a, b):
  assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
  for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
    np.testing.assert_array_equal(x, y)


def _assert_trees_close(a, b):
  """Equal up to float32 rounding: two differently fused XLA programs may differ by an ulp."""
  assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
  for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
    assert x.dtype == y.dtype
    np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-7)


def test_value_and_grad_has_aux_matches_jax(x64):
  loss_fn, params, batch, _ = _problem(jnp.float64)
  (loss, aux), grads, stats = jax.jit(
    kfac_jax.value_and_grad(
      registration=kfac_jax.Registration(loss_fn, params, batch, has_aux=True)
    )
  )(params, batch, jax.random.key(0))
  (ref_loss, ref_aux), ref_grads = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(params, batch)
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-13)
  for g, r in zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(ref_grads)):
    assert g.dtype == jnp.float64
    np.testing.assert_allclose(g, r, rtol=1e-12, atol=1e-14)
  assert jax.tree_util.tree_structure(aux) == jax.tree_util.tree_structure(ref_aux)
  for a, r in zip(jax.tree_util.tree_leaves(aux), jax.tree_util.tree_leaves(ref_aux)):
    np.testing.assert_allclose(a, r, rtol=1e-13, atol=1e-15)
  # The running statistics moved (the aux is the updated state, not the input one).
  old_mean = batch["batch_stats"]["BatchNorm_0"]["mean"]
  assert not np.allclose(aux["batch_stats"]["BatchNorm_0"]["mean"], old_mean)
  assert isinstance(stats, kfac_jax.CurvatureStats)


def test_transform_round_trips_batch_stats_with_one_forward_pass():
  loss_fn, params, batch, calls = _problem()
  tx = kfac_jax.kfac(
    registration=kfac_jax.Registration(loss_fn, params, batch, has_aux=True),
    learning_rate=0.1,
    damping=1e-2,
  )
  opt_state = jax.jit(tx.init)(params)  # Eagerly, each op compiles its own.

  @jax.jit
  def step(params, opt_state, batch, rng):
    (loss, aux), grads, stats = kfac_jax.value_and_grad(
      registration=kfac_jax.Registration(loss_fn, params, batch, has_aux=True)
    )(params, batch, rng)
    updates, opt_state = tx.update(grads, opt_state, params, curvature_stats=stats)
    return optax.apply_updates(params, updates), opt_state, loss, aux

  n_before = len(calls)
  losses = []
  for i in range(4):
    expected_stats = jax.jit(lambda p, b: loss_fn(p, b)[1]["batch_stats"])(params, batch)
    params, opt_state, loss, aux = step(params, opt_state, batch, jax.random.key(i))
    _assert_trees_close(aux["batch_stats"], expected_stats)
    batch = {**batch, "batch_stats": aux["batch_stats"]}
    losses.append(float(loss))
  # The step traced loss_fn once (the scan) and compiled once; each reference added one call.
  assert len(calls) - n_before == 1 + 4
  assert step._cache_size() == 1
  assert np.all(np.isfinite(losses)) and losses[-1] < losses[0]


def test_transform_batch_path_with_has_aux():
  """`tx.update(..., batch=)` computes the statistics from the loss part (the aux unused)."""
  loss_fn, params, batch, _ = _problem()
  tx = kfac_jax.scale_by_kfac(
    registration=kfac_jax.Registration(loss_fn, params, batch, has_aux=True), damping=1e-2
  )
  vg = kfac_jax.value_and_grad(
    registration=kfac_jax.Registration(loss_fn, params, batch, has_aux=True)
  )

  @jax.jit  # One program: run eagerly, each op compiles its own.
  def run(params, batch, rng):
    state = tx.init(params)
    grads = jax.grad(lambda p: loss_fn(p, batch)[0])(params)
    _, _, stats = vg(params, batch, rng)
    with_stats = tx.update(grads, state, params, curvature_stats=stats)
    return with_stats, tx.update(grads, state, params, batch=batch, rng=rng)

  (u1, s1), (u2, s2) = run(params, batch, jax.random.key(3))
  for a, b in zip(jax.tree_util.tree_leaves((u1, s1)), jax.tree_util.tree_leaves((u2, s2))):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("curvature_every", [1, 2])
def test_optimizer_returns_aux_in_info(curvature_every):
  loss_fn, params, batch, calls = _problem()
  opt = kfac_jax.Optimizer(
    registration=kfac_jax.Registration(loss_fn, params, batch, has_aux=True),
    curvature_every=curvature_every,
  )
  state = jax.jit(opt.init)(params)  # Eagerly, each op compiles its own.
  step = jax.jit(opt.step)
  n_before = len(calls)
  for i in range(3):  # With curvature_every=2, step 1 takes the plain value-and-grad branch.
    expected = jax.jit(lambda p, b: loss_fn(p, b))(params, batch)
    params, state, info = step(params, state, batch, jax.random.key(i))
    assert not bool(info["skipped"])
    np.testing.assert_allclose(info["loss"], expected[0], rtol=1e-6)
    _assert_trees_close(info["aux"], expected[1])
    batch = {**batch, "batch_stats": info["aux"]["batch_stats"]}
  assert step._cache_size() == 1
  # Three references; the step does not trace loss_fn: it reuses the graph `init` scanned.
  assert len(calls) - n_before == 3


def test_optimizer_as_optax_keeps_aux_in_state():
  loss_fn, params, batch, _ = _problem()
  opt = kfac_jax.Optimizer(registration=kfac_jax.Registration(loss_fn, params, batch, has_aux=True))
  tx = opt.as_optax()
  state = jax.jit(tx.init)(params)
  assert jax.tree_util.tree_structure(state.info["aux"]) == jax.tree_util.tree_structure(
    jax.eval_shape(loss_fn, params, batch)[1]
  )
  ref_params, ref_state, ref_info = jax.jit(
    lambda p, b, rng: opt.step(p, opt.init(p), b, rng)  # One program with the init.
  )(params, batch, jax.random.key(0))
  updates, state = jax.jit(lambda s, p, b: tx.update(None, s, p, batch=b, rng=jax.random.key(0)))(
    state, params, batch
  )
  _assert_trees_close(optax.apply_updates(params, updates), ref_params)
  _assert_trees_close(state.info["aux"], ref_info["aux"])


def test_estimator_has_aux_scans_the_loss_part():
  loss_fn, params, batch, _ = _problem()
  plain = lambda p, b: loss_fn(p, b)[0]
  est = kfac_jax.CurvatureEstimator(kfac_jax.Registration(loss_fn, params, batch, has_aux=True))
  ref = kfac_jax.CurvatureEstimator(kfac_jax.Registration(plain, params, batch))

  @jax.jit  # One program: run eagerly, each op compiles its own.
  def fold(params, batch, rng):
    s = est.update_curvature(est.init(params), params, batch, rng, ema_decay=0.9)
    return s, ref.update_curvature(ref.init(params), params, batch, rng, ema_decay=0.9)

  s, r = fold(params, batch, jax.random.key(0))
  assert [l.name for l in est.layers] == [l.name for l in ref.layers]
  _assert_trees_equal(s, r)


def test_mismatched_return_names_has_aux():
  loss_fn, params, batch, _ = _problem()
  with pytest.raises(kfac_jax.RegistrationError, match=r"has_aux=True"):
    kfac_jax.value_and_grad(loss_fn)(params, batch, jax.random.key(0))
  with pytest.raises(kfac_jax.RegistrationError, match=r"has_aux=True"):
    kfac_jax.kfac(loss_fn, batch, learning_rate=0.1).init(params)
  plain = lambda p, b: loss_fn(p, b)[0]
  with pytest.raises(kfac_jax.RegistrationError, match=r"has_aux=True.*single"):
    kfac_jax.value_and_grad(registration=kfac_jax.Registration(plain, params, batch, has_aux=True))(
      params, batch, jax.random.key(0)
    )
  with pytest.raises(kfac_jax.RegistrationError, match=r"has_aux=True"):
    kfac_jax.Optimizer(registration=kfac_jax.Registration(plain, params, batch, has_aux=True)).init(
      params
    )
  with pytest.raises(TypeError, match=r"`has_aux` must be a bool, got 'yes'"):
    kfac_jax.value_and_grad(
      registration=kfac_jax.Registration(loss_fn, params, batch, has_aux="yes")
    )
