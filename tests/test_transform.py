"""What `scale_by_kfac` / `kfac` compute: statistics schedule, damping, NaN guard, KL clipping,
arguments. The optax contract (jit, one compile, chain, inject_hyperparams, nnx, dtypes,
checkpoints) is in test_contract.py."""

import dataclasses
import functools
import itertools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import kfac_jax
from tests import _models


@functools.cache  # One loss, params and batch per shape: the tests share their compiles.
def _problem(n=32, din=4, hidden=8, classes=3, dtype=jnp.float32):
  params = _models.jnp_mlp_init(jax.random.key(0), (din, hidden, classes))
  params = jax.tree_util.tree_map(lambda p: jax.device_put(np.asarray(p).astype(dtype)), params)
  batch = _models.classification_batch(
    jax.random.key(1), n=n, din=din, classes=classes, dtype=dtype
  )
  return _models.softmax_loss(_models.jnp_mlp_apply), params, batch


def _grad(loss_fn, params, batch):
  """`jax.grad(loss_fn)(params, batch)` in one program (called eagerly, each operation of the
  forward and backward pass would compile on its own)."""
  return jax.jit(jax.grad(loss_fn))(params, batch)


@functools.cache
def _problem_grad(**kw):
  """The gradient of `_problem(**kw)`'s loss at its params and batch, shared by the tests."""
  return _grad(*_problem(**kw))


_norm = jax.jit(optax.tree.norm)  # The checks' norms, in one program per tree.


@functools.cache
def _grads_and_stats(seed, dtype=jnp.float32):
  """`_problem(dtype=dtype)`'s gradient and statistics at `jax.random.key(seed)`, computed in
  one program (called eagerly, each operation would compile on its own)."""
  loss_fn, params, batch = _problem(dtype=dtype)
  _, grads, stats = jax.jit(kfac_jax.value_and_grad(loss_fn))(params, batch, jax.random.key(seed))
  return grads, stats


def test_stats_path_equals_batch_path():
  loss_fn, params, batch = _problem()
  tx = kfac_jax.scale_by_kfac(loss_fn, batch, damping=1e-2)
  stats = _grads_and_stats(7)[1]

  @jax.jit  # One program: eager operations would compile one by one.
  def both_paths(params):
    state, grads = tx.init(params), jax.grad(loss_fn)(params, batch)
    return (
      tx.update(grads, state, params, curvature_stats=stats),
      tx.update(grads, state, params, batch=batch, rng=jax.random.key(7)),
    )

  (u1, s1), (u2, s2) = both_paths(params)
  for a, b in zip(jax.tree_util.tree_leaves((u1, s1)), jax.tree_util.tree_leaves((u2, s2))):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)  # float32 round-off of entries ~60.


@pytest.mark.parametrize("path", ["batch", "curvature_stats"])
def test_curvature_every_folds_statistics_only_on_due_updates(path):
  """curvature_every=3: the EMA takes the statistics of updates 0, 3, 6 only, each at the
  parameters of that update, exactly as an estimator fed just those batches."""
  loss_fn, params, batch = _problem()
  batches = [  # Rolled on the host, as the inputs are drawn.
    jax.tree_util.tree_map(
      lambda x, i=i: jax.device_put(np.roll(np.asarray(x), 5 * i, axis=0)), batch
    )
    for i in range(7)
  ]
  tx = kfac_jax.kfac(
    loss_fn,
    batch,
    learning_rate=0.3,
    damping=1e-2,
    ema_decay=0.7,
    curvature_every=3,
    inverse_every=3,
  )
  est = kfac_jax.CurvatureEstimator(kfac_jax.Registration(loss_fn, params, batch))
  # Jitted: an eager update compiles every op of the forward and backward pass on its own.
  fold = jax.jit(lambda ref, p, b, rng: est.update_curvature(ref, p, b, rng, 0.7))

  @jax.jit
  def step(params, opt_state, b, rng):
    if path == "batch":
      grads = jax.grad(loss_fn)(params, b)
      updates, opt_state = tx.update(grads, opt_state, params, batch=b, rng=rng)
    else:
      _, grads, stats = kfac_jax.value_and_grad(loss_fn)(params, b, rng)
      updates, opt_state = tx.update(grads, opt_state, params, curvature_stats=stats)
    return optax.apply_updates(params, updates), opt_state

  opt_state, ref = jax.jit(lambda p: (tx.init(p), est.init(p)))(params)
  factors = []
  for i, b in enumerate(batches):
    rng = jax.random.key(10 + i)
    if i % 3 == 0:
      ref = fold(ref, params, b, rng)
    params, opt_state = step(params, opt_state, b, rng)
    factors.append(opt_state[0].curvature.factors)
    for got, want in zip(
      jax.tree_util.tree_leaves(factors[-1]), jax.tree_util.tree_leaves(ref.factors)
    ):
      np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7, err_msg=f"update {i}")
  # Non-due updates leave the factors bit-identical.
  for i in (1, 2, 4, 5):
    for a, b in zip(
      jax.tree_util.tree_leaves(factors[i]), jax.tree_util.tree_leaves(factors[i - 1])
    ):
      np.testing.assert_array_equal(a, b)
  assert not np.array_equal(factors[3]["layer0"].a, factors[2]["layer0"].a)
  assert int(opt_state[0].count) == 7


@pytest.mark.parametrize(
  "fraction, rows",
  [
    (0.25, np.arange(0, 32, 4)),  # r = 8 rows: every fourth.
    (0.3, np.arange(0, 30, 3)),  # r = ⌈9.6⌉ = 10, stride ⌊32/10⌋ = 3: rows 0, 3, ..., 27.
    (0.6, np.arange(20)),  # r = 20 > N/2: stride 1, the first 20.
    (1e-6, np.array([0])),
  ],
)
def test_statistics_fraction_takes_evenly_spaced_rows_of_the_batch(fraction, rows):
  """Statistics from ⌈f·N⌉ evenly spaced rows of `batch=`, the gradient from all of it: the
  same updates and state as passing those rows as `batch=` yourself, and not the whole
  batch's."""
  for front in ("scale_by_kfac", "kfac"):
    got = _fraction_updates(front, fraction, None)
    want = _fraction_updates(front, None, tuple(rows))
    whole = _fraction_updates(front, None, None)  # Shared by the parametrizations.
    for a, b in zip(got, want, strict=True):
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)  # float32 round-off.
    assert not np.allclose(got[1], whole[1], rtol=1e-3)  # Both: layer0's kernel update.


@functools.cache
def _fraction_registration():
  loss_fn, params, batch = _problem(n=32)
  # A scalar leaf passes whole: the loss ignores it, the slicing must not trip on it.
  batch = dict(batch, temperature=jnp.float32(1.0))
  return kfac_jax.Registration(loss_fn, params, batch), params, batch, _grad(loss_fn, params, batch)


@functools.cache
def _fraction_updates(front, fraction, rows):
  """Leaves of the updates and state after two `batch=` updates by `front` (with
  `statistics_fraction=fraction`, or the default with None) on the rows `rows` of the batch
  (all rows with None). The second update refreshes no inverse: both paths still agree."""
  reg, params, batch, grads = _fraction_registration()
  if rows is not None:  # Cut on the host, as the inputs are drawn.
    batch = jax.tree_util.tree_map(
      lambda x: jax.device_put(np.asarray(x)[np.array(rows)]) if x.ndim else x, batch
    )
  kw = {} if fraction is None else {"config": kfac_jax.Config(statistics_fraction=fraction)}
  if front == "kfac":
    tx = kfac_jax.kfac(registration=reg, learning_rate=0.3, damping=1e-2, **kw)
  else:
    tx = kfac_jax.scale_by_kfac(registration=reg, damping=1e-2, **kw)
  return _two_updates(tx, params, grads, batch)


def test_config_passes_through_inject_hyperparams_unchanged():
  loss_fn, params, batch = _problem()
  tx = optax.inject_hyperparams(kfac_jax.kfac, static_args=("loss_fn", "example_batch"))(
    loss_fn=loss_fn,
    example_batch=batch,
    learning_rate=0.3,
    config=kfac_jax.Config(statistics_fraction=0.5),
  )
  grads = _problem_grad()
  update = jax.jit(lambda g, p, b: tx.update(g, tx.init(p), p, batch=b, rng=jax.random.key(0)))
  _, state = update(grads, params, batch)
  assert int(state.inner_state.preconditioner.count) == 1


def test_statistics_fraction_leaves_given_curvature_stats_whole():
  loss_fn, params, batch = _problem()
  grads, stats = _grads_and_stats(0)
  outs = []
  for f in (0.25, None):
    tx = kfac_jax.kfac(
      loss_fn, batch, learning_rate=0.3, config=kfac_jax.Config(statistics_fraction=f)
    )
    # One program: eager operations would compile one by one.
    update = jax.jit(lambda p, g, s, tx=tx: tx.update(g, tx.init(p), p, curvature_stats=s))
    outs.append(update(params, grads, stats))
  for a, b in zip(*(jax.tree_util.tree_leaves(o) for o in outs)):
    np.testing.assert_array_equal(a, b)


def test_statistics_fraction_needs_one_leading_axis_and_names_the_leaves():
  loss_fn, params, batch = _problem()
  tx = kfac_jax.kfac(
    loss_fn, batch, learning_rate=0.3, config=kfac_jax.Config(statistics_fraction=0.5)
  )
  grads = _problem_grad()
  # Raised while tracing: under jit, as eagerly, but without compiling the guard's checks first.
  update = jax.jit(lambda p, b: tx.update(grads, tx.init(p), p, batch=b, rng=jax.random.key(0)))
  bad = dict(batch, mask=jax.device_put(np.ones((5,), np.float32)))
  with pytest.raises(ValueError, match=r"statistics_fraction=0.5.*\['mask'\]` has 5"):
    update(params, bad)
  with pytest.raises(ValueError, match="no leaf has a leading axis"):
    update(params, {"t": jnp.float32(1)})


def test_statistics_fraction_names_itself_when_a_leaf_is_not_per_example():
  """A per-feature leaf whose length happens to equal the batch's (as BatchNorm statistics
  carried in the batch can) is cut too; the trace error then says why and what to do."""
  loss_fn, params, batch = _problem(n=4, din=4)

  def shifted(p, b):
    return loss_fn(p, dict(b, x=b["x"] + b["shift"]))

  batch = dict(batch, shift=jnp.ones((4,)))
  tx = kfac_jax.kfac(
    shifted, batch, learning_rate=0.3, config=kfac_jax.Config(statistics_fraction=0.5)
  )
  grads = _grad(shifted, params, batch)
  msg = r"statistics_fraction=0.5\. Every leaf .* per-example"
  with pytest.raises((TypeError, ValueError), match=msg):  # Raised while tracing the cut batch.
    jax.jit(lambda p: tx.update(grads, tx.init(p), p, batch=batch, rng=jax.random.key(0)))(params)


def test_statistics_fraction_keeps_jax_errors_whole_and_notes_itself():
  """A loss that fails only on the cut batch with one of JAX's own errors (here a
  concretization error, whose constructor takes a tracer, not a message) reaches the caller
  as that error, with a note naming `statistics_fraction`."""
  loss_fn, params, batch = _problem(n=8)

  def picky(p, b):
    if b["x"].shape[0] < 8:
      int(jnp.sum(b["x"]))  # Concrete values only: fails under tracing.
    return loss_fn(p, b)

  tx = kfac_jax.kfac(
    picky, batch, learning_rate=0.3, config=kfac_jax.Config(statistics_fraction=0.5)
  )
  grads = _grad(picky, params, batch)
  with pytest.raises(jax.errors.ConcretizationTypeError) as info:
    jax.jit(lambda p: tx.update(grads, tx.init(p), p, batch=batch, rng=jax.random.key(0)))(params)
  assert any("statistics_fraction=0.5" in n for n in info.value.__notes__), info.value


def _two_updates(tx, params, grads, batch):
  """Updates and state after two `batch=` updates (the first refreshes the inverses)."""
  rng = jax.random.key(3)
  state = jax.jit(tx.init)(params)  # Eager, each operation would compile on its own.
  update = jax.jit(lambda g, s, p, b: tx.update(g, s, p, batch=b, rng=rng))
  for _ in range(2):
    u, state = update(grads, state, params, batch)
  return jax.tree_util.tree_leaves((u, state))


def _assert_same(got, want):
  for a, b in zip(got, want, strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("n, fraction", [(100, 1), (128, 0.5), (256, 0.25)])
def test_kfac_statistics_fraction_defaults_to_auto(n, fraction):
  """`kfac`'s default takes every fourth row of 256 or more, every second of 128 or more,
  else every row: the same updates as the explicit fraction (`scale_by_kfac` on "auto" too;
  its own default is every row)."""
  assert [kfac_jax._transform.auto_stride(k) for k in (1, 127, 128, 255, 256, 4096)] == [
    1,
    1,
    2,
    2,
    4,
    4,
  ]
  loss_fn, params, batch = _problem(n=n)
  grads = _problem_grad(n=n)
  reg = kfac_jax.Registration(loss_fn, params, batch)  # One audit for every transform.
  got = _two_updates(kfac_jax.kfac(registration=reg, learning_rate=0.3), params, grads, batch)
  want = _two_updates(
    kfac_jax.kfac(
      registration=reg, learning_rate=0.3, config=kfac_jax.Config(statistics_fraction=fraction)
    ),
    params,
    grads,
    batch,
  )
  _assert_same(got, want)
  if n != 256:
    return
  auto = kfac_jax.scale_by_kfac(
    registration=reg, config=kfac_jax.Config(statistics_fraction="auto")
  )
  explicit = kfac_jax.scale_by_kfac(
    registration=reg, config=kfac_jax.Config(statistics_fraction=fraction)
  )
  _assert_same(
    _two_updates(auto, params, grads, batch), _two_updates(explicit, params, grads, batch)
  )
  whole = kfac_jax.kfac(
    registration=reg, learning_rate=0.3, config=kfac_jax.Config(statistics_fraction=None)
  )
  assert not np.allclose(got[0], _two_updates(whole, params, grads, batch)[0], rtol=1e-3)


def _time_major(loss_fn, din):
  """The batch's leading axis is time, not the examples: the loss tags see T·B rows."""

  def loss(p, b):
    return loss_fn(p, {"x": b["x"].reshape(-1, din), "y": b["y"].reshape(-1)})

  return loss


def _shifted(loss_fn):
  """Adds a per-feature leaf of the batch: cut with the rows, it no longer broadcasts."""

  def loss(p, b):
    return loss_fn(p, {"x": b["x"] + b["shift"], "y": b["y"]})

  return loss


def _picky(loss_fn, n, error=None):
  def loss(p, b):
    if b["x"].shape[0] < n:
      if error is not None:
        raise error
      int(jnp.sum(b["x"]))  # Concrete values only: a ConcretizationTypeError under tracing.
    return loss_fn(p, b)

  return loss


class _ShapeError(Exception):
  """Like Flax's parameter-shape errors: neither a TypeError nor a ValueError."""


@pytest.mark.parametrize(
  "case", ["mismatched axes", "not per-example", "jax error", "other error", "time-major"]
)
def test_kfac_statistics_fraction_auto_falls_back_to_every_row(case):
  """Where the cut batch cannot be used, "auto" uses every row without a word: leaves without
  one leading axis, a loss that fails to trace on the cut batch (a per-feature leaf as long
  as the batch, one of JAX's own errors), or a loss whose tags then see other than the cut's
  row count (the leading axis is time). An explicit fraction raises in the first three."""
  loss_fn, params, batch = _problem(n=256, din=4)
  if case == "mismatched axes":
    batch = dict(batch, mask=jax.device_put(np.ones((5,), np.float32)))
  elif case == "not per-example":
    loss_fn, params, batch = _problem(n=256, din=256)
    batch = dict(batch, shift=jax.device_put(np.linspace(0.0, 1.0, 256, dtype=np.float32)))
    loss_fn = _shifted(loss_fn)
  elif case == "jax error":
    loss_fn = _picky(loss_fn, 256)
  elif case == "other error":
    loss_fn = _picky(loss_fn, 256, _ShapeError("statistics_fraction: a shape that follows N"))
  else:
    x, y = np.asarray(batch["x"]), np.asarray(batch["y"])  # Reshaped on the host.
    batch = jax.device_put({"x": x.reshape(128, 2, 4), "y": y.reshape(128, 2)})
    loss_fn = _time_major(loss_fn, 4)
  grads = _grad(loss_fn, params, batch)
  reg = kfac_jax.Registration(loss_fn, params, batch)  # One audit for every transform.
  got = _two_updates(kfac_jax.kfac(registration=reg, learning_rate=0.3), params, grads, batch)
  whole = kfac_jax.kfac(
    registration=reg, learning_rate=0.3, config=kfac_jax.Config(statistics_fraction=None)
  )
  _assert_same(got, _two_updates(whole, params, grads, batch))
  explicit = kfac_jax.kfac(
    registration=reg, learning_rate=0.3, config=kfac_jax.Config(statistics_fraction=0.25)
  )
  if case == "time-major":  # Cut along time: other statistics, no error.
    assert not np.allclose(_two_updates(explicit, params, grads, batch)[0], got[0], rtol=1e-3)
  else:
    with pytest.raises((TypeError, ValueError, _ShapeError), match="statistics_fraction"):
      _two_updates(explicit, params, grads, batch)


@pytest.mark.parametrize("every", [1, 2])
def test_statistics_from_batch_on_every_update_are_formed_outside_the_guard(every):
  """With `curvature_every=1` the statistics the transform computes from `batch=` (sampled
  targets, pull-back) are formed outside the guard's cond and only folded inside it; with a
  period they stay in the branch, so that the other updates skip them."""
  loss_fn, params, batch = _problem()
  tx = kfac_jax.scale_by_kfac(loss_fn, batch, curvature_every=every)
  state = jax.eval_shape(tx.init, params)  # Traced only: the jaxpr needs its shapes.
  grads = _problem_grad()
  jaxpr = jax.make_jaxpr(lambda s: tx.update(grads, s, params, batch=batch, rng=jax.random.key(0)))(
    state
  ).jaxpr
  assert _models.sampling_inside_conds(jaxpr) == (every != 1)


def test_update_is_the_inverse_of_the_estimator():
  loss_fn, params, batch = _problem()
  tx = kfac_jax.scale_by_kfac(loss_fn, batch, damping=0.1, ema_decay=0.0)
  est = kfac_jax.CurvatureEstimator(kfac_jax.Registration(loss_fn, params, batch))
  rng = jax.random.key(3)
  grads = _problem_grad()

  @jax.jit  # One program: eager operations would compile one by one.
  def back(grads, params, batch):
    updates, _ = tx.update(grads, tx.init(params), params, batch=batch, rng=rng)
    es = est.update_inverses(est.update_curvature(est.init(params), params, batch, rng, 0.0), 0.1)
    return est.multiply(es, updates)

  back = back(grads, params, batch)
  for a, b in zip(jax.tree_util.tree_leaves(back), jax.tree_util.tree_leaves(grads)):
    np.testing.assert_allclose(a, b, rtol=2e-3, atol=1e-6)


def test_pmap_statistics_equal_single_device_on_the_whole_batch():
  loss_fn, params, batch = _problem(n=32)
  n = jax.local_device_count()
  tx1 = kfac_jax.scale_by_kfac(
    registration=kfac_jax.Registration(loss_fn, params, batch, estimation_mode="empirical"),
    damping=1e-2,
    ema_decay=0.5,
  )
  sharded = jax.tree_util.tree_map(  # Split on the host, as the inputs are drawn.
    lambda x: jax.device_put(np.asarray(x).reshape((n, -1) + x.shape[1:])), batch
  )
  local_example = jax.tree_util.tree_map(lambda x: jax.device_put(np.asarray(x)[0]), sharded)
  txp = kfac_jax.scale_by_kfac(
    registration=kfac_jax.Registration(loss_fn, params, local_example, estimation_mode="empirical"),
    damping=1e-2,
    ema_decay=0.5,
    axis_name="data",
  )

  def pstep(params, state, b):
    _, grads, stats = kfac_jax.value_and_grad(
      registration=kfac_jax.Registration(loss_fn, params, batch, estimation_mode="empirical")
    )(params, b)
    grads = jax.lax.pmean(grads, "data")
    return txp.update(grads, state, params, curvature_stats=stats)

  def sstep(params, state, b):
    _, grads, stats = kfac_jax.value_and_grad(
      registration=kfac_jax.Registration(loss_fn, params, batch, estimation_mode="empirical")
    )(params, b)
    return tx1.update(grads, state, params, curvature_stats=stats)

  # Each init in one program (eager operations would compile one by one); the replicas' state
  # made by pmap, as its steps return it, so that the step compiles once.
  init = jax.pmap(lambda p, _: txp.init(p), axis_name="data", in_axes=(None, 0))
  pstate = init(params, np.arange(n))
  sstate = jax.jit(tx1.init)(params)
  pfn = jax.pmap(pstep, axis_name="data", in_axes=(None, 0, 0))
  sfn = jax.jit(sstep)
  for _ in range(3):  # Crosses an inverse update (step 0) and EMA averaging.
    pu, pstate = pfn(params, pstate, sharded)
    su, sstate = sfn(params, sstate, batch)
  for a, b in zip(jax.tree_util.tree_leaves((pu, pstate)), jax.tree_util.tree_leaves((su, sstate))):
    np.testing.assert_allclose(np.asarray(a)[0], b, rtol=2e-5, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(a)[0], np.asarray(a)[-1])  # Replicas agree.


# --------------------------------------------------------------------------------------------
# Damping.


def _inject(factory, loss_fn, batch, **kw):
  return optax.inject_hyperparams(factory, static_args=("loss_fn", "example_batch"))(
    loss_fn=loss_fn, example_batch=batch, **kw
  )


def _set(state, name, value):
  """A copy of an injected state with one hyperparameter replaced (same dtype: no recompile)."""
  old = state.hyperparams[name]
  return state._replace(hyperparams={**state.hyperparams, name: jnp.asarray(value, old.dtype)})


def test_injected_damping_takes_effect_without_recompiling(x64):
  """Larger λ: a strictly smaller update; λ → ∞: (F̂ + λ)⁻¹ g → g / λ."""
  loss_fn, params, batch = _problem(dtype=jnp.float64)
  tx = _inject(kfac_jax.scale_by_kfac, loss_fn, batch, damping=1e-3, inverse_every=1)
  state0 = jax.jit(tx.init)(params)
  grads, stats = _grads_and_stats(0, jnp.float64)
  traces = []  # One trace = one compilation (counted directly: `_cache_size()` reads 0 for
  # this function with most XLA optimisations off, as in the suite).

  @jax.jit  # With the check's norms: eager operations would compile one by one.
  def update(s):
    traces.append(1)
    u = tx.update(grads, s, params, curvature_stats=stats)[0]
    # ‖λ u − g‖ = O(‖g‖ ‖F̂‖ / √λ) with factored damping (π√λ and √λ/π added to the factors).
    diff = jax.tree_util.tree_map(lambda a, g: s.hyperparams["damping"] * a - g, u, grads)
    return optax.tree.norm(u), optax.tree.norm(diff), optax.tree.norm(grads)

  norms = []
  for lam in (1e-3, 1e-1, 1.0, 10.0, 1e8):
    norm, diff, grad_norm = update(_set(state0, "damping", lam))
    norms.append(float(norm))
  assert len(traces) == 1
  assert all(a > b for a, b in itertools.pairwise(norms)), norms
  assert float(diff) < 1e-3 * float(grad_norm)  # At λ = 1e8.


# --------------------------------------------------------------------------------------------
# The non-finite guard.


def _leaves_with_paths(tree):
  return {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _assert_same_but(new, old, counters):
  """Every leaf bit-identical, except the named counters, each one more."""
  new, old = _leaves_with_paths(new), _leaves_with_paths(old)
  assert new.keys() == old.keys()
  for k in new:
    if any(k.endswith(c) for c in counters):
      assert int(new[k]) == int(old[k]) + 1, k
    else:
      np.testing.assert_array_equal(np.asarray(new[k]), np.asarray(old[k]), err_msg=k)


@pytest.mark.parametrize("where", ["gradient", "batch", "update"])
@pytest.mark.filterwarnings("ignore::kfac_jax.HyperparameterWarning")  # Reported: test_safety.
@pytest.mark.filterwarnings("ignore::kfac_jax.NonFiniteWarning")  # Reported: test_safety.
def test_kfac_skips_a_nonfinite_update_and_keeps_the_whole_state(where):
  """A NaN gradient, a NaN batch (statistics and gradient) or an infinite learning rate (the
  update): params and every state leaf unchanged, momentum trace included, but the counters;
  training continues finitely."""
  loss_fn, params, batch = _problem()
  tx = _inject(  # Statistics every update: the NaN batch's are folded (and counted).
    kfac_jax.kfac,
    loss_fn,
    batch,
    learning_rate=0.3,
    momentum=0.9,
    damping=1e-2,
    inverse_every=1,
    curvature_every=1,
  )
  state = jax.jit(tx.init)(params)  # Eager, each operation would compile on its own.
  traces = []  # one trace = one compilation

  @jax.jit
  def step(params, state, batch, rng, poison):
    traces.append(1)
    loss, grads, stats = kfac_jax.value_and_grad(loss_fn)(params, batch, rng)
    grads = jax.tree_util.tree_map(lambda g: g * poison, grads)
    updates, state = tx.update(grads, state, params, curvature_stats=stats)
    return optax.apply_updates(params, updates), state, loss

  one = jnp.float32(1.0)
  for i in range(3):  # A non-zero momentum trace and moved factors.
    params, state, _ = step(params, state, batch, jax.random.key(i), one)
  bad_batch, poison, bad_state = batch, one, state
  if where == "gradient":
    poison = jnp.float32(jnp.nan)
  elif where == "batch":
    x = np.array(batch["x"])  # Poisoned on the host, as the inputs are drawn.
    x[2, 1] = np.nan
    bad_batch = {"x": jax.device_put(x), "y": batch["y"]}
  else:
    bad_state = _set(state, "learning_rate", jnp.inf)
  new_params, new_state, _ = step(params, bad_state, bad_batch, jax.random.key(7), poison)
  inner, old = new_state.inner_state, bad_state.inner_state
  # The NaN batch's gradient is NaN too, so its statistics are never folded (nor counted).
  _assert_same_but(inner, old, ["preconditioner.skipped"])
  _assert_same_but(new_params, params, [])
  assert float(_norm(inner.momentum.trace)) > 0
  losses = []
  state = new_state if where != "update" else _set(new_state, "learning_rate", 0.3)
  for i in range(4):
    params, state, loss = step(params, state, batch, jax.random.key(10 + i), one)
    losses.append(float(loss))
  assert np.all(np.isfinite(losses)) and losses[-1] < losses[0], losses
  assert int(state.inner_state.preconditioner.skipped) == 1
  assert int(state.inner_state.preconditioner.count) == 7
  assert len(traces) == 1


@pytest.mark.filterwarnings("ignore::kfac_jax.NonFiniteWarning")  # Reported: test_safety.
def test_scale_by_kfac_guard_and_switching_it_off():
  loss_fn, params, batch = _problem()
  grads = _problem_grad()
  bad = jax.tree_util.tree_map(np.array, grads)  # Poisoned on the host: no eager operation.
  for g in jax.tree_util.tree_leaves(bad):
    g[(0,) * g.ndim] = np.inf
  outs = {}
  for skip in (True, False):
    tx = kfac_jax.scale_by_kfac(
      loss_fn, batch, damping=1e-2, config=kfac_jax.Config(skip_nonfinite=skip)
    )
    state = jax.jit(tx.init)(params)  # Eager, each operation would compile on its own.
    upd = jax.jit(lambda g, s, tx=tx: tx.update(g, s, params, batch=batch, rng=jax.random.key(0)))
    _, state = upd(grads, state)
    outs[skip] = upd(bad, state), state
  (u, new), old = outs[True]
  assert all(bool(np.all(np.asarray(x) == 0)) for x in jax.tree_util.tree_leaves(u))
  _assert_same_but(new, old, ["skipped"])
  (u, new), old = outs[False]
  assert not all(bool(np.all(np.isfinite(x))) for x in jax.tree_util.tree_leaves(u))
  assert int(new.skipped) == 0 and int(new.count) == 2


# --------------------------------------------------------------------------------------------
# KL clipping.


def test_clip_coefficient_against_numpy(x64):
  rng = np.random.default_rng(0)
  v = {"a": rng.normal(size=(3, 4)), "b": rng.normal(size=(5,))}
  g = {"a": rng.normal(size=(3, 4)), "b": rng.normal(size=(5,))}
  vg = abs(np.vdot(v["a"], g["a"]) + np.vdot(v["b"], g["b"]))
  clip_coefficient = jax.jit(kfac_jax._transform.clip_coefficient)  # One program for the calls.
  for r in (1e-3, 10.0, np.sqrt(vg) * 0.99, np.sqrt(vg) * 1.01):
    want = min(1.0, r / np.sqrt(vg))
    got = clip_coefficient(
      jax.tree_util.tree_map(jnp.asarray, v), jax.tree_util.tree_map(jnp.asarray, g), r
    )
    np.testing.assert_allclose(got, want, rtol=1e-12)
  zero = jax.tree_util.tree_map(np.zeros_like, v)
  assert float(clip_coefficient(zero, g, 1e-3)) == 1.0


def _first_kfac_update(reg, params, grads, stats, **kw):
  kw = {"max_norm": None, "momentum": None, **kw}  # Both are on by default.
  tx = kfac_jax.kfac(registration=reg, damping=1e-2, **_models.with_config(kw))
  return jax.jit(lambda p, g, st: tx.update(g, tx.init(p), p, curvature_stats=st)[0])(
    params, grads, stats
  )


def test_max_norm_clips_the_preconditioned_gradient_before_the_learning_rate(x64):
  """The clipped update is `α · c · (−v)` with `c = min(1, r / √|vᵀg|)`, v the preconditioned
  gradient, computed here in numpy: the learning rate scales the step whether or not the
  clipping binds (optax's clip-then-scale order); a loose bound changes nothing."""
  loss_fn, params, batch = _problem(dtype=jnp.float64)
  grads, stats = _grads_and_stats(0, jnp.float64)
  reg = kfac_jax.Registration(loss_fn, params, batch)  # One audit for the four transforms.

  def update(**kw):
    return _first_kfac_update(reg, params, grads, stats, **kw)

  free = update(learning_rate=1.0)
  v = [-np.asarray(u) for u in jax.tree_util.tree_leaves(free)]
  vg = abs(sum(np.vdot(a, np.asarray(b)) for a, b in zip(v, jax.tree_util.tree_leaves(grads))))
  tight = 0.1 * np.sqrt(vg)
  for lr in (0.5, 2.0):  # Binding: the step is α · 0.1 · (−v), for either α.
    clipped = update(learning_rate=lr, max_norm=tight)
    for a, b in zip(jax.tree_util.tree_leaves(clipped), v):
      np.testing.assert_allclose(a, -lr * 0.1 * b, rtol=1e-10, atol=1e-14)
  loose = update(learning_rate=0.5, max_norm=10.0 * np.sqrt(vg))
  for a, b in zip(jax.tree_util.tree_leaves(loose), v):
    np.testing.assert_allclose(a, -0.5 * b, rtol=1e-12, atol=1e-15)


@functools.cache
def _sequence_problem(reduce):
  """A per-position classifier `[N, T, din] -> [N, T, classes]` (D = T = 5 outputs per example),
  its cross-entropy averaged over examples and `reduce`d over the positions."""

  @jax.jit  # One program: eager operations would compile one by one.
  def draw():
    k1, k2, k3 = jax.random.split(jax.random.key(3), 3)
    params = {"w": jax.random.normal(k1, (4, 3)) / 2, "b": jnp.zeros(3)}
    batch = {"x": jax.random.normal(k2, (16, 5, 4)), "y": jax.random.randint(k3, (16, 5), 0, 3)}
    return params, batch

  params, batch = draw()

  def loss_fn(params, batch):
    logits = batch["x"] @ params["w"] + params["b"]
    kfac_jax.register_softmax_cross_entropy_loss(logits, batch["y"])
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
    return reduce(ce, axis=-1).mean()

  return loss_fn, params, batch


def _three_updates(tx, loss_fn, params, batch, init=None):
  state = (init or jax.jit(tx.init))(params)  # Eager, each operation would compile on its own.

  @jax.jit  # One compile for the three steps.
  def step(params, state, rng):
    _, grads, stats = kfac_jax.value_and_grad(loss_fn)(params, batch, rng)
    u, state = tx.update(grads, state, params, curvature_stats=stats)
    return optax.apply_updates(params, u), state, u

  out = []
  for i in range(3):
    params, state, u = step(params, state, jax.random.key(i))
    out.append(u)
  return out


def test_registration_counts_outputs_and_measures_the_loss_factor():
  """D from the tags' shapes (categorical: without the class axis; Bernoulli: every axis after
  the examples'), and the audit's fitted factor c of the returned loss over the tagged one."""
  summed, params, batch = _sequence_problem(jnp.sum)
  averaged = _sequence_problem(jnp.mean)[0]
  reg = kfac_jax.Registration(summed, params, batch)
  assert reg.outputs_per_example == 5
  assert reg.loss_factor == pytest.approx(1.0, rel=1e-6)
  reg = kfac_jax.Registration(averaged, params, batch)
  assert reg.loss_factor == pytest.approx(1 / 5, rel=1e-6)
  assert kfac_jax.Registration(averaged, params, batch, check_loss=False).loss_factor is None
  assert kfac_jax._transform.default_learning_rate(reg) == pytest.approx(0.3 * 5**0.25)

  def bernoulli(params, batch):
    logits = jnp.einsum("nhd,do->nho", batch["x"], params["w"]) + params["b"]
    kfac_jax.register_sigmoid_cross_entropy_loss(logits, batch["x"][..., :3] > 0)
    return optax.sigmoid_binary_cross_entropy(logits, batch["x"][..., :3] > 0).sum((1, 2)).mean()

  assert kfac_jax.Registration(bernoulli, params, batch).outputs_per_example == 15


@pytest.mark.parametrize("max_norm", [0.3, None])
def test_default_learning_rate_steps_alike_for_a_summed_and_an_averaged_loss(max_norm):
  """Without a learning rate, the loss averaged over its D outputs takes the steps of the summed
  one (its gradient divided by c = 1/D, clipped and scaled alike), with α = 0.3 · D^(1/4); with
  an explicit learning rate and no clipping the averaged loss's steps are D times shorter."""
  summed, params, batch = _sequence_problem(jnp.sum)
  averaged = _sequence_problem(jnp.mean)[0]
  got = _three_updates(kfac_jax.kfac(summed, batch, max_norm=max_norm), summed, params, batch)
  mean = _three_updates(kfac_jax.kfac(averaged, batch, max_norm=max_norm), averaged, params, batch)
  lr = 0.3 * 5**0.25
  want = _three_updates(
    kfac_jax.kfac(summed, batch, learning_rate=lr, max_norm=max_norm), summed, params, batch
  )
  for a, b, c in zip(got, mean, want):
    for x, y, z in zip(*map(jax.tree_util.tree_leaves, (a, b, c))):
      np.testing.assert_allclose(x, z, rtol=1e-5, atol=1e-7)
      np.testing.assert_allclose(y, z, rtol=1e-4, atol=1e-7)
  if max_norm is None:
    tx = kfac_jax.kfac(averaged, batch, learning_rate=lr, max_norm=None)
    first = _three_updates(tx, averaged, params, batch)[0]
    for x, z in zip(*map(jax.tree_util.tree_leaves, (first, want[0]))):
      np.testing.assert_allclose(5 * x, z, rtol=1e-4, atol=1e-7)


def test_a_learning_rate_far_from_the_default_is_reported_once():
  """A mean over D = 5 outputs (c = 1/5): the default is 0.3 · 5^(1/4) / c ≈ 2.24. A number
  more than 30 times it, or below 1/1000 of it, warns once: at construction with a
  registration, else at init; a schedule's value at the step it is given for, once. Rates in
  the measured range (1/6 to 3 times the default, and far beyond) say nothing."""
  loss_fn, params, batch = _sequence_problem(jnp.mean)
  reg = kfac_jax.Registration(loss_fn, params, batch)
  default = kfac_jax._transform.default_learning_rate(reg) / reg.loss_factor
  assert default == pytest.approx(0.3 * 5**0.25 * 5, rel=1e-5)
  with pytest.warns(kfac_jax.HyperparameterWarning, match=r"learning_rate=100 is 44\.\d times"):
    kfac_jax.kfac(registration=reg, learning_rate=100.0)
  tx = kfac_jax.kfac(loss_fn, batch, learning_rate=1e-3)  # Not known yet: no word.
  with pytest.warns(kfac_jax.HyperparameterWarning, match=r"= 2\.24 \(D = 5 outputs.*c = 0\.2"):
    jax.eval_shape(tx.init, params)
  for fine in (0.3, 20.0, default / 300):
    kfac_jax.kfac(registration=reg, learning_rate=fine).init(params)  # Warnings are errors.

  def schedule(count):
    return jnp.where(count >= 1, 1e3, 0.3)

  tx = kfac_jax.kfac(
    registration=reg, learning_rate=schedule, config=kfac_jax.Config(step_warnings=True)
  )
  with pytest.warns(kfac_jax.HyperparameterWarning) as record:
    _three_updates(tx, loss_fn, params, batch)
  (message,) = [str(w.message) for w in record]
  assert "learning_rate=1000 (its value at step 1) is 446 times the default" in message, message


def test_init_under_jit_is_the_eager_init():
  """`init` traced by `jax.jit` audits the loss on stand-ins for the traced params: the loss
  factor the default learning rate reads (1/D for a mean over D = 5 outputs) is the eager one,
  and the state and updates are bit-identical."""
  averaged, params, batch = _sequence_problem(jnp.mean)
  tx = kfac_jax.kfac(averaged, batch)
  state = tx.init(params)
  tx_jit = kfac_jax.kfac(averaged, batch)
  state_jit = jax.jit(tx_jit.init)(params)
  for x, y in zip(*map(jax.tree_util.tree_leaves, (state, state_jit))):
    np.testing.assert_array_equal(x, y)
  got = _three_updates(tx_jit, averaged, params, batch, init=jax.jit(tx_jit.init))
  want = _three_updates(tx, averaged, params, batch, init=lambda _: state)  # The eager init's.
  for a, b in zip(got, want):
    for x, z in zip(*map(jax.tree_util.tree_leaves, (a, b))):
      np.testing.assert_array_equal(x, z)


# --------------------------------------------------------------------------------------------
# Arguments: every error names the argument and shows the value, before any state exists.


def _args_problem():
  return _problem()


def _front(front, kw):
  def call():
    args, kwargs = _models.front_args(*_args_problem(), kw)
    return front(*args, **kwargs)

  return call


def _tx(**kw):
  return _front(kfac_jax.scale_by_kfac, kw)


def _kfac(**kw):
  kw.setdefault("learning_rate", 0.1)
  return _front(kfac_jax.kfac, kw)


def _opt(**kw):
  return _front(kfac_jax.Optimizer, kw)


def _est(**kw):
  return lambda: kfac_jax.CurvatureEstimator(kfac_jax.Registration(*_args_problem()), **kw)


def _vg(**kw):
  return lambda: kfac_jax.value_and_grad(registration=kfac_jax.Registration(*_args_problem(), **kw))


_NAN = float("nan")
ARG_CASES = [
  # (call, exception, argument name, bad value)
  (_tx(damping="1e-3"), TypeError, "damping", "1e-3"),
  (_tx(damping=None), TypeError, "damping", None),
  (_tx(damping=-1.0), ValueError, "damping", -1.0),
  (_tx(damping=True), TypeError, "damping", True),
  (_tx(ema_decay=1.0), ValueError, "ema_decay", 1.0),
  (_tx(ema_decay="0.9"), TypeError, "ema_decay", "0.9"),
  (_tx(inverse_every=0), ValueError, "inverse_every", 0),
  (_tx(inverse_every=2.5), ValueError, "inverse_every", 2.5),
  (_tx(inverse_every="5"), TypeError, "inverse_every", "5"),
  (_tx(curvature_every=None), TypeError, "curvature_every", None),
  (_tx(curvature_every=-1), ValueError, "curvature_every", -1),
  (_tx(statistics_fraction=0.0), ValueError, "statistics_fraction", 0.0),
  (_tx(statistics_fraction=1.5), ValueError, "statistics_fraction", 1.5),
  (_tx(statistics_fraction=_NAN), ValueError, "statistics_fraction", _NAN),
  (_kfac(statistics_fraction="0.25"), TypeError, "statistics_fraction", "0.25"),
  (_kfac(statistics_fraction=True), TypeError, "statistics_fraction", True),
  (_tx(estimation_mode="fisher"), ValueError, "estimation_mode", "fisher"),
  (_tx(estimation_mode=None), TypeError, "estimation_mode", None),
  (_tx(num_samples=0), ValueError, "num_samples", 0),
  (_tx(num_samples=2.0), ValueError, "num_samples", 2.0),
  (_tx(damping_mode="tikhonov"), ValueError, "damping_mode", "tikhonov"),
  (_tx(axis_name=3), TypeError, "axis_name", 3),
  (_tx(inverse_storage="kaisa"), ValueError, "inverse_storage", "kaisa"),
  (_tx(strict="yes"), TypeError, "strict", "yes"),
  (_tx(has_aux=1), TypeError, "has_aux", 1),
  (_tx(skip_nonfinite=None), TypeError, "skip_nonfinite", None),
  (_tx(stats_dtype="int8"), ValueError, "stats_dtype", "int8"),
  (_tx(inverse_dtype="bfloat16"), ValueError, "inverse_dtype", "bfloat16"),
  (_tx(layers={"dense": "diagonal"}), TypeError, "layers", "dict"),
  (_kfac(learning_rate="0.1"), TypeError, "learning_rate", "0.1"),
  (_kfac(learning_rate=0.0), ValueError, "learning_rate", 0.0),
  (_kfac(momentum=1.0), ValueError, "momentum", 1.0),
  (_kfac(momentum="0.9"), TypeError, "momentum", "0.9"),
  (_kfac(nesterov=1), TypeError, "nesterov", 1),
  (_kfac(max_norm=-1e-3), ValueError, "max_norm", -0.001),
  (_kfac(max_norm=_NAN), ValueError, "max_norm", _NAN),
  (_kfac(damping="1e-3"), TypeError, "damping", "1e-3"),
  (_opt(learning_rate="0.1"), TypeError, "learning_rate", "0.1"),
  (_opt(momentum=-0.5), ValueError, "momentum", -0.5),
  (_opt(damping="1e-3"), TypeError, "damping", "1e-3"),
  (_opt(l2_reg=None), TypeError, "l2_reg", None),
  (_opt(inverse_every=True), TypeError, "inverse_every", True),
  (_opt(curvature_every=0), ValueError, "curvature_every", 0),
  (_opt(use_adaptive_damping="no"), TypeError, "use_adaptive_damping", "no"),
  (_opt(has_aux=None), TypeError, "has_aux", None),
  (_opt(ema_decay="0.9"), TypeError, "ema_decay", "0.9"),
  (lambda: kfac_jax.Config(min_damping=-1.0), ValueError, "config.min_damping", -1.0),
  (lambda: kfac_jax.Config(burn_in_steps=1.5), ValueError, "config.burn_in_steps", 1.5),
  (_est(exps=(-1, "x")), TypeError, "exps", "x"),
  (_est(exps=-1), TypeError, "exps", -1),
  (_est(compute_cholesky="yes"), TypeError, "compute_cholesky", "yes"),
  (
    lambda: kfac_jax.CurvatureEstimator("loss"),
    TypeError,
    "must be a kfac_jax.Registration",
    "loss",
  ),
  (_vg(estimation_mode="sampled"), ValueError, "estimation_mode", "sampled"),
  (_vg(num_samples=True), TypeError, "num_samples", True),
  (_vg(strict=0), TypeError, "strict", 0),
  (_vg(has_aux="True"), TypeError, "has_aux", "True"),
]


@pytest.mark.parametrize(
  "call, exc, name, value", ARG_CASES, ids=[f"{i}-{c[2]}={c[3]!r}" for i, c in enumerate(ARG_CASES)]
)
def test_argument_errors_name_the_argument_and_show_the_value(call, exc, name, value):
  with pytest.raises(exc) as info:
    call()
  msg = str(info.value)
  assert name in msg, msg
  assert (value if isinstance(value, str) and value == "dict" else repr(value)) in msg, msg


@pytest.mark.parametrize(
  "who, field, value",
  [
    ("scale_by_kfac", "nesterov", True),
    ("scale_by_kfac", "weight_decay", 1e-4),
    ("kfac", "min_damping", 1e-6),
    ("kfac", "damping_adaptation_interval", 3),
    ("Optimizer", "nesterov", True),
    ("Optimizer", "statistics_fraction", 0.5),
    ("CurvatureEstimator", "burn_in_steps", 2),
    ("CurvatureEstimator", "mesh", "x"),
  ],
)
def test_a_config_field_a_front_does_not_read_is_refused_by_name(who, field, value):
  """Each `Config` field declares the fronts that read it; another front refuses a value other
  than the default, naming the field and its readers."""
  loss_fn, params, batch = _args_problem()
  readers = kfac_jax.Config.__dataclass_fields__[field].metadata["read_by"]
  assert who not in readers
  config = kfac_jax.Config(**{field: value}) if field != "mesh" else None
  if config is None:  # A mesh needs a real Mesh; the check does not look inside.
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("d",))
    config = kfac_jax.Config(mesh=(mesh, "d"))
  build = {
    "scale_by_kfac": lambda: kfac_jax.scale_by_kfac(loss_fn, batch, config=config),
    "kfac": lambda: kfac_jax.kfac(loss_fn, batch, config=config),
    "Optimizer": lambda: kfac_jax.Optimizer(loss_fn, batch, config=config),
    "CurvatureEstimator": lambda: kfac_jax.CurvatureEstimator(
      kfac_jax.Registration(loss_fn, params, batch), config=config
    ),
  }[who]
  with pytest.raises(ValueError, match=rf"^{who}: `config\.{field}`=.* is not read by {who}"):
    build()


def test_every_config_field_declares_its_readers():
  fronts = {"scale_by_kfac", "kfac", "Optimizer", "CurvatureEstimator"}
  fronts |= {"scale_by_kernel_ngd", "kernel_ngd"}
  for f in dataclasses.fields(kfac_jax.Config):
    assert f.metadata["read_by"] and set(f.metadata["read_by"]) <= fronts, f.name
  assert not set(_models.REGISTRATION_KNOBS) & set(kfac_jax.Config.__dataclass_fields__)


def test_update_errors_are_named():
  loss_fn, params, batch = _problem()
  tx = kfac_jax.scale_by_kfac(loss_fn, batch)
  state, grads = jax.jit(tx.init)(params), _problem_grad()
  with pytest.raises(ValueError, match="`params` is required"):
    tx.update(grads, state)
  with pytest.raises(ValueError, match="curvature_stats="):
    tx.update(grads, state, params)
  with pytest.raises(ValueError, match="params pytree differs"):
    extra = jax.device_put(np.ones(2, np.float32))
    tx.update(grads, state, {**params, "extra": extra}, batch=batch, rng=jax.random.key(0))
  other = jax.jit(kfac_jax.value_and_grad(_models.softmax_loss(lambda p, x: x @ p["w"])))(
    {"w": jax.device_put(np.ones((4, 3), np.float32))}, batch, jax.random.key(0)
  )[2]
  # Raised while tracing: under jit, as eagerly, but without compiling the guard's checks first.
  with pytest.raises(ValueError, match="curvature_stats were computed for layers"):
    jax.jit(lambda s: tx.update(grads, s, params, curvature_stats=other))(state)
  with pytest.raises(TypeError, match="ScaleByKfacState"):
    tx.update(grads, (state,), params, batch=batch, rng=jax.random.key(0))


def test_profile_names_kfac_statistics_inverses_and_products():
  """The estimator's statistics (the model's sampled pass included), inverses and products
  carry `kfac_*` named scopes in their op names (what a Perfetto / TensorBoard profile of the
  step shows), and the scopes are not nested in one another."""
  loss_fn, params, batch = _problem()
  tx = kfac_jax.scale_by_kfac(loss_fn, batch, damping=1e-2, curvature_every=2)
  state = jax.eval_shape(tx.init, params)  # Lowered only: the program needs its shapes.
  grads = _problem_grad()

  def update(g, s, p):
    return tx.update(g, s, p, batch=batch, rng=jax.random.key(0))

  text = jax.jit(update).lower(grads, state, params).as_text(debug_info=True)
  names = set(re.findall(r'loc\("(jit\(update\)/[^"]*)"', text))
  for scope in ("kfac_statistics", "kfac_inverses", "kfac_multiply_matpower"):
    assert any(f"/{scope}" in n for n in names), (scope, sorted(names)[:20])
  # The statistics' pass through the model is scoped too; the scopes are not nested in
  # each other.
  assert any("kfac_statistics" in n and "jvp(" in n for n in names), sorted(names)[:20]
  assert not any("kfac_inverses" in n and "kfac_multiply" in n for n in names)


@pytest.mark.parametrize("front", ["kfac", "Optimizer"])
@pytest.mark.filterwarnings("ignore::kfac_jax.HyperparameterWarning")  # Reported: test_safety.
def test_a_schedule_that_is_not_finite_at_one_step_skips_it_and_moves_on(front):
  """The schedules get every update seen (`count + skipped`): a NaN at one count skips that
  update only, instead of returning the same NaN forever (and stalling training)."""
  loss_fn, params, batch = _problem()

  def bad_at_2(c):
    return jnp.where(c == 2, jnp.nan, 0.1)

  if front == "kfac":
    tx = kfac_jax.kfac(loss_fn, batch, learning_rate=bad_at_2, inverse_every=1)
    state = jax.jit(tx.init)(params)  # Eager, each operation would compile on its own.
    grad = jax.grad(loss_fn)
    step = jax.jit(lambda p, s, k: tx.update(grad(p, batch), s, p, batch=batch, rng=k))
  else:
    opt = kfac_jax.Optimizer(loss_fn, batch, learning_rate=bad_at_2, momentum=0.5)
    state = jax.jit(opt.init)(params)  # Eager, each operation would compile on its own.

    @jax.jit
    def step(p, s, k):
      new, s, _ = opt.step(p, s, batch, k)
      return jax.tree_util.tree_map(jnp.subtract, new, p), s

  moved, apply_updates = [], jax.jit(optax.apply_updates)
  for t in range(5):
    updates, state = step(params, state, jax.random.key(t))
    moved.append(float(_norm(updates)) > 0)
    params = apply_updates(params, updates)
  assert moved == [True, True, False, True, True]
  count, skipped = (state[0].count, state[0].skipped) if front == "kfac" else state[:2]
  assert int(skipped) == 1 and int(count) == 4


def test_another_models_state_is_named():
  loss_fn, params, batch = _problem()
  deeper = _models.jnp_mlp_init(jax.random.key(0), (4, 8, 8, 3))
  tx = kfac_jax.kfac(loss_fn, batch, learning_rate=0.1)
  other = jax.jit(kfac_jax.kfac(loss_fn, batch, learning_rate=0.1).init)(deeper)
  grads = _problem_grad()
  extra = r"blocks in `state` that this model does not have: \['layer2'\]"
  with pytest.raises(ValueError, match=extra):
    tx.update(grads, other, params, batch=batch, rng=jax.random.key(0))
  opt = kfac_jax.Optimizer(loss_fn, batch)
  with pytest.raises(TypeError, match="OptimizerState from this optimizer's init, got KfacState"):
    opt.step(params, jax.jit(tx.init)(params), batch, jax.random.key(0))


def test_burn_in_folds_statistics_only_then_preconditions():
  """`Config(burn_in_steps=2)` on a transform, as on the Optimizer: two updates of zeros that
  fold the statistics (every one, whatever `curvature_every`) and refresh nothing, then the
  first preconditioned update, from inverses refreshed at the end of burn-in."""
  loss_fn, params, batch = _problem()
  cfg = kfac_jax.Config(burn_in_steps=2)
  tx = kfac_jax.scale_by_kfac(loss_fn, batch, curvature_every=3, inverse_every=4, config=cfg)
  step = jax.jit(lambda g, s, k: tx.update(g, s, params, batch=batch, rng=k))
  grads = _problem_grad()
  state = jax.jit(tx.init)(params)  # Eager, each operation would compile on its own.
  init_cache = state.curvature.cache
  norms, weights = [], []
  for t in range(3):
    updates, state = step(grads, state, jax.random.key(t))
    norms.append(float(_norm(updates)))
    weights.append(float(state.curvature.ema_weight))
    if t == 1:
      for a, b in zip(
        jax.tree_util.tree_leaves(state.curvature.cache), jax.tree_util.tree_leaves(init_cache)
      ):
        np.testing.assert_array_equal(a, b)  # No refresh during burn-in.
  assert norms[0] == norms[1] == 0 and norms[2] > 0
  assert weights[0] > 0 and weights[1] > weights[0] and weights[2] > weights[1]
  assert int(state.count) == 3


@pytest.mark.parametrize("search", ["backtracking", "zoom"])
def test_kfac_takes_the_step_an_optax_line_search_picks(search):
  """`kfac(linesearch=...)` with `curvature_stats=`: the line search reads `value=`, `grad=`,
  `value_fn=` and scales −v (v the preconditioned gradient; no momentum, no clipping) by the
  step it picks and keeps in its state; the loss goes down at every step."""
  loss_fn, params, batch = _problem(n=8)
  ls = (
    optax.scale_by_backtracking_linesearch(max_backtracking_steps=30, decrease_factor=0.5)
    if search == "backtracking"
    else optax.scale_by_zoom_linesearch(max_linesearch_steps=10)
  )
  kw = dict(damping=1e-3, ema_decay=0.0, inverse_every=1, curvature_every=1)
  reg = kfac_jax.Registration(loss_fn, params, batch)
  tx = kfac_jax.kfac(registration=reg, linesearch=ls, momentum=None, max_norm=None, **kw)
  est = kfac_jax.CurvatureEstimator(reg)
  rng = jax.random.key(2)

  @jax.jit
  def step(params, state):
    loss, grads, stats = kfac_jax.value_and_grad(registration=reg)(params, batch, rng)
    value_fn = lambda p: loss_fn(p, batch)
    updates, new = tx.update(
      grads, state, params, curvature_stats=stats, value=loss, grad=grads, value_fn=value_fn
    )
    # The preconditioned gradient v from the refreshed curvature, as `scale_by_kfac` gives it.
    v = est.multiply_matpower(new.preconditioner.curvature, grads, -1)
    return optax.apply_updates(params, updates), new, updates, v, loss

  state = jax.jit(tx.init)(params)  # Eager, each operation would compile on its own.
  losses, etas = [], []
  for _ in range(3):
    params, state, updates, v, loss = step(params, state)
    losses.append(float(loss))
    etas.append(float(state.rest[2].learning_rate))
    # On the host: an eager product would compile one program per leaf shape.
    for u, d in zip(jax.tree.leaves(updates), jax.tree.leaves(jax.device_get(v))):
      np.testing.assert_allclose(u, -etas[-1] * d, rtol=1e-4, atol=1e-7)
  assert all(e > 0 for e in etas), etas
  assert np.all(np.diff(losses) < 0), losses


def test_kfac_linesearch_and_a_learning_rate_are_refused_together():
  loss_fn, _, batch = _problem()
  ls = optax.scale_by_backtracking_linesearch(max_backtracking_steps=5)
  with pytest.raises(ValueError, match=r"learning_rate=0\.1 and a `linesearch`"):
    kfac_jax.kfac(loss_fn, batch, 0.1, linesearch=ls)
  with pytest.raises(TypeError, match="`linesearch` must be an optax line search"):
    kfac_jax.kfac(loss_fn, batch, linesearch=0.5)


@pytest.mark.parametrize(
  "other",
  [optax.adam(1e-3), optax.inject_hyperparams(optax.sgd)(learning_rate=0.1), optax.identity()],
  ids=["adam", "injected sgd", "identity"],
)
def test_kfac_refuses_a_transformation_that_is_not_a_line_search(other):
  """Any optax transformation has init and update; a line search also keeps the step it chose
  as a `learning_rate` field of its state (a hyperparameter named so in a dict does not
  count)."""
  loss_fn, _, batch = _problem()
  with pytest.raises(TypeError, match=r"`linesearch` must be a line search.*scale_by_zoom"):
    kfac_jax.kfac(loss_fn, batch, linesearch=other)
  chained = optax.chain(optax.trace(0.5), optax.scale_by_zoom_linesearch(max_linesearch_steps=3))
  kfac_jax.kfac(loss_fn, batch, linesearch=chained)  # A chain ending in one is one.


def test_kfac_linesearch_value_fn_with_an_aux_is_named():
  """A `value_fn` returning `(loss, aux)` (a `has_aux` loss) is refused where the line search
  traces it, naming `value_fn` and the fix; a tuple `value=` likewise."""
  loss_fn, params, batch = _problem(n=8)
  ls = optax.scale_by_backtracking_linesearch(max_backtracking_steps=3)
  tx = kfac_jax.kfac(loss_fn, batch, linesearch=ls)
  state = jax.jit(tx.init)(params)
  loss, grads, stats = jax.jit(kfac_jax.value_and_grad(loss_fn))(params, batch, jax.random.key(0))

  def update(value, value_fn):
    return tx.update(
      grads, state, params, curvature_stats=stats, value=value, grad=grads, value_fn=value_fn
    )

  with pytest.raises(TypeError, match=r"`value_fn` must return the scalar loss, got a tuple"):
    jax.jit(update, static_argnums=1)(loss, lambda p: (loss_fn(p, batch), {"aux": 1.0}))
  with pytest.raises(TypeError, match=r"`value=` must be the scalar loss"):
    jax.jit(update, static_argnums=1)((loss, 1.0), lambda p: loss_fn(p, batch))
