"""The optax transform contract: jit, one compile, chain, inject_hyperparams, nnx, pmap."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import kfac_jax
from tests import _models


def _problem(n=32, din=4, hidden=8, classes=3, dtype=jnp.float32):
  params = _models.to_dtype(_models.jnp_mlp_init(jax.random.key(0), (din, hidden, classes)), dtype)
  batch = _models.classification_batch(jax.random.key(1), n=n, din=din, classes=classes,
                                       dtype=dtype)
  return _models.softmax_loss(_models.jnp_mlp_apply), params, batch


def _make_step(loss_fn, tx):
  def step(params, opt_state, batch, rng):
    loss, grads, stats = kfac_jax.value_and_grad(loss_fn)(params, batch, rng)
    updates, opt_state = tx.update(grads, opt_state, params, curvature_stats=stats)
    return optax.apply_updates(params, updates), opt_state, loss
  return jax.jit(step)


def test_jit_init_update_compiles_once_and_converges():
  loss_fn, params, batch = _problem()
  tx = kfac_jax.kfac(loss_fn, batch, learning_rate=0.5, damping=1e-2, inverse_every=3)
  opt_state = jax.jit(tx.init)(params)
  step = _make_step(loss_fn, tx)
  losses = []
  for i in range(25):
    params, opt_state, loss = step(params, opt_state, batch, jax.random.key(i))
    losses.append(float(loss))
  assert step._cache_size() == 1  # Steps 2..25, across inverse updates, reuse one program.
  assert losses[-1] < 0.2 * losses[0], losses
  assert int(opt_state[0].count) == 25


def test_stats_path_equals_batch_path():
  loss_fn, params, batch = _problem()
  tx = kfac_jax.scale_by_kfac(loss_fn, batch, damping=1e-2)
  state = tx.init(params)
  rng = jax.random.key(7)
  grads = jax.grad(loss_fn)(params, batch)
  _, _, stats = kfac_jax.value_and_grad(loss_fn)(params, batch, rng)
  u1, s1 = jax.jit(lambda g, s, p: tx.update(g, s, p, curvature_stats=stats))(grads, state, params)
  u2, s2 = jax.jit(lambda g, s, p: tx.update(g, s, p, batch=batch, rng=rng))(grads, state, params)
  for a, b in zip(jax.tree_util.tree_leaves((u1, s1)), jax.tree_util.tree_leaves((u2, s2))):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("path", ["batch", "curvature_stats"])
def test_curvature_every_folds_statistics_only_on_due_updates(path):
  """curvature_every=3: the EMA takes the statistics of updates 0, 3, 6 only, each at the
  parameters of that update, exactly as an estimator fed just those batches."""
  loss_fn, params, batch = _problem()
  batches = [jax.tree_util.tree_map(lambda x, i=i: jnp.roll(x, 5 * i, axis=0), batch)
             for i in range(7)]
  tx = kfac_jax.kfac(loss_fn, batch, learning_rate=0.3, damping=1e-2, ema_decay=0.7,
                     curvature_every=3, inverse_every=3)
  est = kfac_jax.CurvatureEstimator(loss_fn, batch)

  @jax.jit
  def step(params, opt_state, b, rng):
    if path == "batch":
      grads = jax.grad(loss_fn)(params, b)
      updates, opt_state = tx.update(grads, opt_state, params, batch=b, rng=rng)
    else:
      _, grads, stats = kfac_jax.value_and_grad(loss_fn)(params, b, rng)
      updates, opt_state = tx.update(grads, opt_state, params, curvature_stats=stats)
    return optax.apply_updates(params, updates), opt_state

  opt_state, ref = tx.init(params), est.init(params)
  factors = []
  for i, b in enumerate(batches):
    rng = jax.random.key(10 + i)
    if i % 3 == 0:
      ref = est.update_curvature(ref, params, b, rng, 0.7)
    params, opt_state = step(params, opt_state, b, rng)
    factors.append(opt_state[0].curvature.factors)
    for got, want in zip(jax.tree_util.tree_leaves(factors[-1]),
                         jax.tree_util.tree_leaves(ref.factors)):
      np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7, err_msg=f"update {i}")
  # Non-due updates leave the factors bit-identical.
  for i in (1, 2, 4, 5):
    for a, b in zip(jax.tree_util.tree_leaves(factors[i]),
                    jax.tree_util.tree_leaves(factors[i - 1])):
      np.testing.assert_array_equal(a, b)
  assert not np.array_equal(factors[3]["layer0"]["a"], factors[2]["layer0"]["a"])
  assert int(opt_state[0].count) == 7


def test_update_is_the_inverse_of_the_estimator():
  loss_fn, params, batch = _problem()
  tx = kfac_jax.scale_by_kfac(loss_fn, batch, damping=0.1, ema_decay=0.0)
  est = kfac_jax.CurvatureEstimator(loss_fn, batch)
  rng = jax.random.key(3)
  grads = jax.grad(loss_fn)(params, batch)
  updates, state = tx.update(grads, tx.init(params), params, batch=batch, rng=rng)
  es = est.update_inverses(est.update_curvature(est.init(params), params, batch, rng, 0.0), 0.1)
  back = est.multiply(es, updates)
  for a, b in zip(jax.tree_util.tree_leaves(back), jax.tree_util.tree_leaves(grads)):
    np.testing.assert_allclose(a, b, rtol=2e-3, atol=1e-6)


def test_chain_inject_hyperparams_and_schedules():
  loss_fn, params, batch = _problem()
  tx = optax.chain(
      optax.clip_by_global_norm(10.0),
      # optax treats every callable argument as a schedule: loss_fn must be declared static.
      optax.inject_hyperparams(kfac_jax.scale_by_kfac, static_args=("loss_fn", "example_batch"))(
          loss_fn=loss_fn, example_batch=batch, damping=1e-2, ema_decay=0.9),
      optax.scale_by_learning_rate(optax.linear_schedule(0.5, 0.1, 10)))
  opt_state = tx.init(params)
  step = _make_step(loss_fn, tx)
  for i in range(4):
    params, opt_state, _ = step(params, opt_state, batch, jax.random.key(i))
  assert step._cache_size() == 1
  inject_state = opt_state[1]
  assert float(inject_state.hyperparams["damping"]) == pytest.approx(1e-2)
  # Changing the injected damping takes effect without recompiling.
  inject_state.hyperparams["damping"] = jnp.asarray(0.5, jnp.float32)
  params, opt_state, _ = step(params, opt_state, batch, jax.random.key(9))
  assert step._cache_size() == 1
  sched = kfac_jax.kfac(loss_fn, batch, learning_rate=0.1, momentum=0.9,
                        damping=optax.exponential_decay(1.0, 5, 0.5))
  s = sched.init(params)
  _make_step(loss_fn, sched)(params, s, batch, jax.random.key(0))


def test_nnx_optimizer_forwards_curvature_stats():
  model = _models.NnxMLP(4, 8, 3, nnx.Rngs(0))
  graphdef, _ = nnx.split(model)
  batch = _models.classification_batch(jax.random.key(1), n=32)

  def loss_fn(params, batch):
    m = nnx.merge(graphdef, params)
    logits = m(batch["x"])
    kfac_jax.register_softmax_cross_entropy_loss(logits, batch["y"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

  tx = kfac_jax.kfac(loss_fn, batch, learning_rate=0.5, damping=1e-2)
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

  @nnx.jit
  def step(model, optimizer, batch, rng):
    params = nnx.state(model, nnx.Param)
    loss, grads, stats = kfac_jax.value_and_grad(loss_fn)(params, batch, rng)
    optimizer.update(model, grads, curvature_stats=stats)
    return loss

  losses = [float(step(model, optimizer, batch, jax.random.key(i))) for i in range(15)]
  assert losses[-1] < 0.5 * losses[0], losses


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_dtypes_preserved(dtype):
  loss_fn, params, batch = _problem(dtype=dtype)
  tx = kfac_jax.scale_by_kfac(loss_fn, batch)
  state = tx.init(params)
  _, grads, stats = kfac_jax.value_and_grad(loss_fn)(params, batch, jax.random.key(0))
  updates, state = jax.jit(lambda g, s, p, st: tx.update(g, s, p, curvature_stats=st))(
      grads, state, params, stats)
  assert [u.dtype for u in jax.tree_util.tree_leaves(updates)] == [dtype] * 4
  factors = jax.tree_util.tree_leaves((state.curvature.factors, state.curvature.cache,
                                       state.curvature.ema_weight))
  assert {f.dtype for f in factors} == {jnp.dtype(jnp.float32)}  # Statistics stay float32.
  assert all(bool(jnp.all(jnp.isfinite(u.astype(jnp.float32))))
             for u in jax.tree_util.tree_leaves(updates))


def test_pmap_statistics_equal_single_device_on_the_whole_batch():
  loss_fn, params, batch = _problem(n=32)
  n = jax.local_device_count()
  tx1 = kfac_jax.scale_by_kfac(loss_fn, batch, damping=1e-2, ema_decay=0.5,
                               estimation_mode="empirical")
  sharded = jax.tree_util.tree_map(lambda x: x.reshape((n, -1) + x.shape[1:]), batch)
  local_example = jax.tree_util.tree_map(lambda x: x[0], sharded)
  txp = kfac_jax.scale_by_kfac(loss_fn, local_example, damping=1e-2, ema_decay=0.5,
                               estimation_mode="empirical", axis_name="data")

  def pstep(params, state, b):
    _, grads, stats = kfac_jax.value_and_grad(loss_fn, estimation_mode="empirical")(params, b)
    grads = jax.lax.pmean(grads, "data")
    return txp.update(grads, state, params, curvature_stats=stats)

  def sstep(params, state, b):
    _, grads, stats = kfac_jax.value_and_grad(loss_fn, estimation_mode="empirical")(params, b)
    return tx1.update(grads, state, params, curvature_stats=stats)

  pstate = jax.tree_util.tree_map(lambda x: jnp.broadcast_to(x, (n,) + x.shape), txp.init(params))
  sstate = tx1.init(params)
  pfn = jax.pmap(pstep, axis_name="data", in_axes=(None, 0, 0))
  sfn = jax.jit(sstep)
  for _ in range(3):  # Crosses an inverse update (step 0) and EMA averaging.
    pu, pstate = pfn(params, pstate, sharded)
    su, sstate = sfn(params, sstate, batch)
  for a, b in zip(jax.tree_util.tree_leaves((pu, pstate)), jax.tree_util.tree_leaves((su, sstate))):
    np.testing.assert_allclose(np.asarray(a)[0], b, rtol=2e-5, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(a)[0], np.asarray(a)[-1])  # Replicas agree.


def test_bad_arguments_raise_before_any_state_changes():
  loss_fn, params, batch = _problem()
  with pytest.raises(ValueError, match="`damping` must be a finite number >= 0"):
    kfac_jax.scale_by_kfac(loss_fn, batch, damping=-1.0)
  with pytest.raises(ValueError, match="`ema_decay` must be a number in \\[0, 1\\)"):
    kfac_jax.scale_by_kfac(loss_fn, batch, ema_decay=1.0)
  with pytest.raises(ValueError, match="`ema_decay`"):
    kfac_jax.scale_by_kfac(loss_fn, batch, ema_decay=-0.1)
  with pytest.raises(ValueError, match="`inverse_every` must be a positive integer"):
    kfac_jax.scale_by_kfac(loss_fn, batch, inverse_every=0)
  with pytest.raises(ValueError, match="estimation_mode"):
    kfac_jax.scale_by_kfac(loss_fn, batch, estimation_mode="fisher")
  with pytest.raises(ValueError, match="`curvature_every` must be a positive integer"):
    kfac_jax.scale_by_kfac(loss_fn, batch, curvature_every=0)
  with pytest.raises(ValueError, match="`curvature_every` must be a positive integer"):
    kfac_jax.kfac(loss_fn, batch, learning_rate=0.1, curvature_every=2.5)
  tx = kfac_jax.scale_by_kfac(loss_fn, batch)
  state = tx.init(params)
  grads = jax.grad(loss_fn)(params, batch)
  with pytest.raises(ValueError, match="`params` is required"):
    tx.update(grads, state)
  with pytest.raises(ValueError, match="curvature_stats="):
    tx.update(grads, state, params)
  with pytest.raises(ValueError, match="params pytree differs"):
    tx.update(grads, state, {**params, "extra": jnp.ones(2)}, batch=batch, rng=jax.random.key(0))
  with pytest.raises(ValueError, match="params pytree differs"):
    tx.update(grads, state, _models.to_dtype(params, jnp.float16), batch=batch,
              rng=jax.random.key(0))
  other = kfac_jax.value_and_grad(
      _models.softmax_loss(lambda p, x: x @ p["w"]))({"w": jnp.ones((4, 3))}, batch,
                                                        jax.random.key(0))[2]
  with pytest.raises(ValueError, match="curvature_stats were computed for layers"):
    tx.update(grads, state, params, curvature_stats=other)
