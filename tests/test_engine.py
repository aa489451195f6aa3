"""`kfac_jax._engine`: a front's records, its binding, its check sequence and its step, tested
on the engine directly (the fronts' own behaviour is in test_transform / test_optimizer)."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import kfac_jax
from kfac_jax import _engine, _transform
from tests import _models


def _problem():
  params = _models.jnp_mlp_init(jax.random.key(0), (4, 5, 3))
  batch = _models.classification_batch(jax.random.key(1), n=16, din=4, classes=3)
  return _models.softmax_loss(_models.jnp_mlp_apply), params, batch


def _engine_for(loss_fn, batch, **kw):
  schedule = _engine.Schedule.checked(
    kw.pop("ema_decay", 0.0), kw.pop("inverse_every", 1), kw.pop("curvature_every", 1)
  )
  return _engine.Engine.kfac(
    "scale_by_kfac",
    (loss_fn, batch, None),
    schedule,
    axis_name=kw.pop("axis_name", None),
    config=kw.pop("config", None),
    state_type=_transform.ScaleByKfacState,
    transform=True,
    **kw,
  )


def _grads(loss_fn, params, batch):
  return jax.jit(jax.grad(loss_fn))(params, batch)


# -- records ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
  "args, exc, name",
  [
    ((1.0, 1, 1), ValueError, "ema_decay"),
    ((0.9, 0, 1), ValueError, "inverse_every"),
    ((0.9, 1, 2.5), ValueError, "curvature_every"),
    ((0.9, "5", 1), TypeError, "inverse_every"),
  ],
)
def test_schedule_checks_each_field_by_name(args, exc, name):
  with pytest.raises(exc, match=f"`{name}`"):
    _engine.Schedule.checked(*args)


def test_placement_refuses_an_axis_and_a_mesh_and_sharded_storage_without_either():
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("d",))
  with pytest.raises(ValueError, match="not both"):
    _engine.Placement.checked("d", kfac_jax.Config(mesh=(mesh, "d")))
  with pytest.raises(ValueError, match="inverse_storage='sharded'"):
    _engine.Placement.checked(None, kfac_jax.Config(inverse_storage="sharded"))
  with pytest.raises(TypeError, match="`axis_name`"):
    _engine.Placement.checked(3, kfac_jax.Config())
  assert _engine.Placement.checked("d", kfac_jax.Config()) == _engine.Placement("d", None)


def test_source_builds_once_from_the_first_params_and_holds_later_ones_to_them():
  loss_fn, params, batch = _problem()
  source = _engine.Source(loss_fn, batch, None, "kfac")
  assert source.known is None
  reg = source.for_params(params)
  assert source.for_params(params) is reg and source.known is reg
  assert source.for_params({}) is reg  # optax.tree_map_params' placeholder.
  other = _models.jnp_mlp_init(jax.random.key(0), (4, 6, 3))
  with pytest.raises(ValueError, match=r"`layer0/b` has shape \(6,\)"):
    source.for_params(other)


def test_source_refuses_a_registration_beside_a_loss_function():
  loss_fn, params, batch = _problem()
  reg = kfac_jax.Registration(loss_fn, params, batch)
  with pytest.raises(ValueError, match="not both"):
    _engine.Source(loss_fn, None, reg, "kfac")
  with pytest.raises(TypeError, match="as `registration=`"):
    _engine.Source(reg, None, None, "kfac")
  assert _engine.Source(None, None, reg, "kfac").known is reg


# -- binding -----------------------------------------------------------------------------------


def test_masked_share_and_fill_unfill_round_trip():
  loss_fn, params, batch = _problem()
  share = {
    "layer0": params["layer0"],
    "layer1": jax.tree.map(lambda _: optax.MaskedNode(), params["layer1"]),
  }
  assert _engine.masked_share(params) is None
  kept = _engine.masked_share(share)
  assert kept == (True, True, False, False)
  engine = _engine_for(loss_fn, batch)
  engine.source.for_params(params)
  bound = engine.bind(share)
  assert bound.kept == kept and bound.estimator.names == ("layer0",)
  full = bound.fill(share)
  assert full["layer1"]["w"].shape == (5, 3) and not np.any(full["layer1"]["w"])
  back = bound.unfill(jax.tree.map(lambda x: x + 1, full), share)
  assert isinstance(back["layer1"]["w"], optax.MaskedNode)
  np.testing.assert_array_equal(back["layer0"]["w"], params["layer0"]["w"] + 1)


def test_a_share_splitting_a_layer_is_named():
  loss_fn, params, batch = _problem()
  share = jax.tree.map(lambda x: x, params)
  share["layer1"]["b"] = optax.MaskedNode()
  engine = _engine_for(loss_fn, batch)
  engine.source.for_params(params)
  with pytest.raises(ValueError, match=r"layer `layer1` has `layer1/w` in this transform's share"):
    engine.bind(share)


def test_a_share_before_the_registration_is_known_asks_for_one():
  loss_fn, params, batch = _problem()
  share = jax.tree.map(lambda _: optax.MaskedNode(), params)
  with pytest.raises(ValueError, match="registration=reg"):
    _engine_for(loss_fn, batch).bind(share)


def test_bind_builds_one_estimator_per_registration_and_share():
  loss_fn, params, batch = _problem()
  engine = _engine_for(loss_fn, batch)
  assert engine.bind(params).estimator is engine.bind(params).estimator


# -- checks ------------------------------------------------------------------------------------


def test_check_sequence_cheapest_first():
  """The state's type comes before the statistics' source, which comes before the rng, the axis
  and the state's fit: each case fails on the first problem it has."""
  loss_fn, params, batch = _problem()
  engine = _engine_for(loss_fn, batch)
  bound = engine.bind(params)
  init = jax.jit(
    lambda p: _transform.ScaleByKfacState(
      0, engine.curvature.init(engine.bind(p), engine.placement, p), 0
    )
  )
  state = init(params)
  expected = jax.eval_shape(init, params)
  with pytest.raises(TypeError, match="must be the ScaleByKfacState"):
    engine.check(bound, (), expected)  # Also no statistics source: the type comes first.
  with pytest.raises(ValueError, match="pass `curvature_stats=`"):
    engine.check(bound, state, expected)
  with pytest.raises(ValueError, match="pass `rng`"):
    engine.check(bound, state, expected, batch=batch)
  with pytest.raises(
    TypeError, match=r"`rng` must be a jax.random key, got an array of shape \(3,\)"
  ):
    engine.check(bound, state, expected, batch=batch, rng=jnp.ones(3))
  with pytest.raises(TypeError, match="`batch` is a key: pass the data as `batch=`"):
    engine.check(bound, state, expected, batch=jax.random.key(0), rng=batch)
  engine.check(bound, state, expected, batch=batch, rng=jax.random.key(0))  # Fits.
  engine.check(bound, state, expected, batch=batch, rng=jax.random.PRNGKey(0))  # A raw key.
  with pytest.raises(ValueError, match="is not a state of this model"):
    other = state._replace(curvature=state.curvature._replace(factors={}))
    engine.check(bound, other, expected, batch=batch, rng=jax.random.key(0))
  axis = _engine_for(loss_fn, batch, axis_name="data")
  with pytest.raises(ValueError, match="'data' is not bound here"):
    axis.check(axis.bind(params), state, expected, batch=batch, rng=jax.random.key(0))


# -- the step ----------------------------------------------------------------------------------


def _run(engine, params, batch, grads, hyper, steps, count0=0):
  bound = engine.bind(params)
  stats_fn = jax.jit(lambda p, b, r: bound.estimator.curvature_stats(p, b, r))

  @jax.jit
  def one(count, skipped, curv, grads, rng):
    stats = stats_fn(params, batch, rng)
    inputs = _engine.Inputs(grads, lambda: stats, {"gradient": grads, "params": params}, hyper)
    return engine.step(bound, count, skipped, curv, inputs)

  curv = jax.jit(lambda: engine.curvature.init(bound, engine.placement, params))()
  out = []
  for t in range(steps):
    s = one(jnp.int32(count0 + t), jnp.int32(0), curv, grads, jax.random.key(t))
    curv = s.curvature
    out.append(s)
  return out


def test_step_equals_the_estimator_run_by_hand(x64):
  """Fold, refresh with the damping plus `damping_shift`, then precondition: the same as the
  estimator's own public methods in that order."""
  loss_fn, params, batch = _problem()
  params = _models.to_dtype(params, jnp.float64)
  batch = {"x": batch["x"].astype(jnp.float64), "y": batch["y"]}
  grads = _grads(loss_fn, params, batch)
  engine = _engine_for(loss_fn, batch, ema_decay=0.5, damping_shift=0.25)
  (s,) = _run(engine, params, batch, grads, {"damping": (0.5, 0.0)}, 1)
  est = engine.bind(params).estimator

  @jax.jit
  def by_hand(rng):
    stats = est.curvature_stats(params, batch, rng)
    state = est.update_curvature_from_stats(est.init(), stats, 0.5)
    state = est.update_inverses(state, 0.75)
    return est.multiply_matpower(state, grads, -1)

  want = by_hand(jax.random.key(0))
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-10), s.vector, want)
  assert bool(s.ok) and int(s.clock) == 0 and s.values["damping"] == 0.5


def test_burn_in_folds_without_refreshing_or_preconditioning():
  loss_fn, params, batch = _problem()
  grads = _grads(loss_fn, params, batch)
  engine = _engine_for(loss_fn, batch, ema_decay=0.5, config=kfac_jax.Config(burn_in_steps=2))
  steps = _run(engine, params, batch, grads, {"damping": (0.1, 0.0)}, 3)
  for s in steps[:2]:
    assert all(not np.any(x) for x in jax.tree.leaves(s.vector))
    assert int(s.curvature.failed_inverses) == 0
  assert float(steps[1].curvature.ema_weight) > float(steps[0].curvature.ema_weight) > 0
  assert any(np.any(x) for x in jax.tree.leaves(steps[2].vector))


def test_periods_fold_and_refresh_on_due_counts_only():
  loss_fn, params, batch = _problem()
  grads = _grads(loss_fn, params, batch)
  engine = _engine_for(loss_fn, batch, ema_decay=0.5, curvature_every=2, inverse_every=3)
  steps = _run(engine, params, batch, grads, {"damping": (0.1, 0.0)}, 4)
  weights = [float(s.curvature.ema_weight) for s in steps]
  assert weights == [1.0, 1.0, 1.5, 1.5]  # Folds at counts 0 and 2.
  caches = [jax.tree.leaves(s.curvature.cache) for s in steps]
  same = lambda a, b: all(np.array_equal(x, y) for x, y in zip(a, b))  # noqa: E731
  assert same(caches[0], caches[1]) and same(caches[1], caches[2])  # Refresh at counts 0, 3.
  assert not same(caches[2], caches[3])


def test_a_bad_input_or_schedule_value_gives_a_false_verdict_and_keeps_the_curvature():
  loss_fn, params, batch = _problem()
  grads = _grads(loss_fn, params, batch)
  engine = _engine_for(loss_fn, batch, config=kfac_jax.Config(step_warnings=True))
  bad = jax.tree.map(lambda g: g.at[(0,) * g.ndim].set(jnp.nan), grads)
  with pytest.warns(kfac_jax.NonFiniteWarning, match=r"the gradient is not finite at step 0"):
    (s,) = _run(engine, params, batch, bad, {"damping": (0.1, 0.0)}, 1)
    jax.effects_barrier()
  assert not bool(s.ok) and float(s.curvature.ema_weight) == 0.0
  schedule = lambda count: jnp.where(count == 0, -1.0, 0.1)  # noqa: E731
  with pytest.warns(kfac_jax.HyperparameterWarning, match=r"`damping` gave -1.0 at step 0"):
    (s,) = _run(engine, params, batch, grads, {"damping": (schedule, 0.0)}, 1)
    jax.effects_barrier()
  assert not bool(s.ok) and float(s.curvature.ema_weight) == 0.0
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    (s,) = _run(engine, params, batch, grads, {"damping": (schedule, 0.0)}, 1, count0=1)
  assert bool(s.ok)


def test_without_the_guard_there_is_no_verdict():
  loss_fn, params, batch = _problem()
  grads = _grads(loss_fn, params, batch)
  engine = _engine_for(loss_fn, batch, config=kfac_jax.Config(skip_nonfinite=False))
  (s,) = _run(engine, params, batch, grads, {"damping": (0.1, 0.0)}, 1)
  assert s.ok is None
