"""Numerical safety: dead units, rank-deficient batches, huge activations, NaN, bfloat16."""

# `check_loss=False`: the loss audit is tested in tests/test_audit.py and the zoo; here it would
# only compile another program.

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import kfac_jax
from tests import _models, _zoo

# The tests of warnings from compiled steps opt in (a host callback in the step).
WARN = kfac_jax.Config(step_warnings=True)


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
  factors (`skipped_batches` +1). Either way every factor and inverse is unchanged, and the
  gradient is reported with its step and the leaves it is not finite in."""
  params = _models.jnp_mlp_init(jax.random.key(0), (4, 5, 3))
  batch = _models.classification_batch(jax.random.key(1), n=8, din=4, classes=3)
  loss_fn = _models.softmax_loss(_models.jnp_mlp_apply)
  tx = kfac_jax.scale_by_kfac(
    loss_fn,
    batch,
    damping=1e-2,
    inverse_every=2,
    config=kfac_jax.Config(skip_nonfinite=guard, step_warnings=True),
  )
  state = tx.init(params)
  step = jax.jit(lambda p, s, b, k: tx.update(jax.grad(loss_fn)(p, b), s, p, batch=b, rng=k))
  _, state = step(params, state, batch, jax.random.key(0))
  bad = {"x": batch["x"].at[3, 1].set(jnp.nan), "y": batch["y"]}
  with pytest.warns(kfac_jax.NonFiniteWarning) as record:
    _, after = step(params, state, bad, jax.random.key(1))
    jax.effects_barrier()
  (text,) = [str(r.message) for r in record]
  assert text.startswith("scale_by_kfac: the gradient is not finite at step 1 (in `layer0/b`")
  assert ("The step is skipped" if guard else "`Config.skip_nonfinite` is off") in text
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
  tx = kfac_jax.scale_by_kfac(
    loss_fn, batch, damping=1e-2, ema_decay=0.5, **_models.with_config(kwargs)
  )

  @jax.jit  # One program: run eagerly, each op compiles its own.
  def prepare(params, batch):
    _, grads, stats = kfac_jax.value_and_grad(loss_fn)(params, batch, jax.random.key(0))
    return tx.init(params), grads, stats

  state, grads, stats = prepare(params, batch)
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
  tx = kfac_jax.scale_by_kfac(
    loss_fn, batch, damping=1e-2, config=kfac_jax.Config(stats_dtype="float16")
  )
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
    ({"stats_dtype": "int32"}, "`config.stats_dtype` must be one of bfloat16, float16, float32"),
    ({"stats_dtype": "complex64"}, "`config.stats_dtype` must be one of"),
    ({"inverse_dtype": "bfloat16"}, "`config.inverse_dtype` must be one of float32, float64"),
    ({"inverse_dtype": "float8"}, "`config.inverse_dtype` must be one of"),
    ({"inverse_dtype": "float64"}, "`config.inverse_dtype`=float64 needs 64-bit JAX"),
    ({"preconditioner_dtype": "float16"}, "`config.preconditioner_dtype` must be one of bfloat16"),
    ({"preconditioner_dtype": "int8"}, "`config.preconditioner_dtype` must be one of"),
  ],
)
def test_bad_dtype_arguments_name_the_argument(kwargs, match):
  if jax.config.jax_enable_x64:
    pytest.skip("the float64 case needs x64 off")
  with pytest.raises(ValueError, match=match):
    kfac_jax.Config(**kwargs)


def test_optimizer_keeps_statistics_in_the_configured_dtype():
  params = _models.jnp_mlp_init(jax.random.key(0), (6, 8, 3))
  batch = _models.classification_batch(jax.random.key(1), n=16, din=6, classes=3)
  loss_fn = _models.softmax_loss(_models.jnp_mlp_apply)
  opt = kfac_jax.Optimizer(
    loss_fn, batch, config=kfac_jax.Config(stats_dtype="bfloat16"), inverse_every=1
  )
  state = opt.init(params)
  new_params, state, info = jax.jit(opt.step)(params, state, batch, jax.random.key(0))
  assert _leaf_dtypes(state.curvature.factors) == {jnp.dtype(jnp.bfloat16)}
  assert _leaf_dtypes(state.curvature.cache) == {jnp.dtype(jnp.float32)}
  assert not bool(info["skipped"]) and _finite(new_params)


def _to_bf16(x) -> np.ndarray:
  """x rounded to bfloat16, as float64."""
  return np.asarray(jnp.asarray(x).astype(jnp.bfloat16).astype(jnp.float64))


def test_bfloat16_preconditioner_rounds_the_stored_inverses_and_the_products_inputs(x64):
  """`preconditioner_dtype="bfloat16"`: each cached inverse is the float64 one rounded to
  bfloat16, and a Kronecker block's product is r(r(A⁻¹) r(M)) · r(G⁻¹) computed in float64
  from those rounded inputs (r: round to bfloat16; M = [W; b]). A diagonal factor, the
  damping and the factors stay float64."""
  params = _models.jnp_mlp_init(jax.random.key(0), (6, 8, 3), jnp.float64)
  batch = _models.classification_batch(jax.random.key(1), n=32, din=6, classes=3)
  batch = {"x": batch["x"].astype(jnp.float64), "y": batch["y"]}
  loss_fn = _models.softmax_loss(_models.jnp_mlp_apply)
  layers = kfac_jax.LayerConfig(overrides={"layer1/*": "kron_out_diag"})

  reg = kfac_jax.Registration(loss_fn, params, batch, layers=layers, check_loss=False)
  vec = jax.tree_util.tree_map(lambda x: _models.normal(3, x.shape, jnp.float64), params)

  def estimator_state(**kwargs):
    """The estimator's state after one update and its inverses, and its product with `vec`, in
    one program (run eagerly, each op compiles its own)."""
    est = kfac_jax.CurvatureEstimator(reg, config=kfac_jax.Config(**kwargs))

    @jax.jit
    def run(params, batch, vec):
      state = est.init(params)
      state = est.update_curvature(state, params, batch, jax.random.key(2), ema_decay=0.0)
      state = est.update_inverses(state, damping=1e-2)
      return state, est.multiply_inverse(state, vec)

    return run(params, batch, vec)

  ref, exact = estimator_state()
  state, out = estimator_state(preconditioner_dtype="bfloat16")
  a0, g0 = state.cache["layer0"].a.powers[0], state.cache["layer0"].g.powers[0]
  assert a0.dtype == g0.dtype == jnp.bfloat16
  g1 = state.cache["layer1"].g.powers[0]  # kron_out_diag: G⁻¹ is a vector
  assert g1.ndim == 1 and g1.dtype == jnp.float64
  assert state.cache["layer0"].damping.dtype == jnp.float64
  assert _leaf_dtypes(state.factors) == {jnp.dtype(jnp.float64)}
  # The stored inverses are the float64 ones, rounded once.
  ref_a0, ref_g0 = ref.cache["layer0"].a.powers[0], ref.cache["layer0"].g.powers[0]
  np.testing.assert_array_equal(np.asarray(a0, np.float64), _to_bf16(ref_a0))
  np.testing.assert_array_equal(np.asarray(g0, np.float64), _to_bf16(ref_g0))

  assert _leaf_dtypes(out) == {jnp.dtype(jnp.float64)}
  m = np.concatenate([np.asarray(vec["layer0"]["w"]), np.asarray(vec["layer0"]["b"])[None]])
  inner = _to_bf16(_to_bf16(a0) @ _to_bf16(m))
  want = inner @ _to_bf16(g0)
  got = np.concatenate([np.asarray(out["layer0"]["w"]), np.asarray(out["layer0"]["b"])[None]])
  np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12 * np.abs(want).max())
  # Within bfloat16's rounding of the float64 product (the block is well conditioned here).
  for path in (("layer0", "w"), ("layer0", "b"), ("layer1", "w"), ("layer1", "b")):
    u, r = np.asarray(out[path[0]][path[1]]), np.asarray(exact[path[0]][path[1]])
    assert np.linalg.norm(u - r) < 2e-2 * np.linalg.norm(r), path


def test_bfloat16_preconditioner_trains_like_float32_with_half_the_inverse_bytes():
  """`kfac(..., preconditioner_dtype="bfloat16")` on a small conv net: the inverses take half
  the bytes, six steps end within 2% of float32's loss, and a non-finite gradient leaves the
  bfloat16 state bit-identical (the guard's two branches agree on the cache's dtypes)."""
  params = {
    "conv": {"w": _models.normal(0, (3, 3, 1, 8), scale=1 / 3), "b": jnp.zeros((8,))},
    "head": {"w": _models.normal(1, (8 * 25, 4), scale=1 / 14), "b": jnp.zeros((4,))},
  }
  batch = {"x": _models.normal(2, (64, 5, 5, 1)), "y": _models.integers(3, 0, 4, (64,))}

  def apply(p, x):
    h = jax.lax.conv_general_dilated(
      x, p["conv"]["w"], (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
    )
    h = jnp.tanh(h + p["conv"]["b"])
    return h.reshape(h.shape[0], -1) @ p["head"]["w"] + p["head"]["b"]

  loss_fn = _models.softmax_loss(apply)
  value_and_grad = jax.jit(jax.value_and_grad(loss_fn))  # Eagerly, each op compiles its own.
  apply_updates = jax.jit(optax.apply_updates)

  def run(**kwargs):
    tx = kfac_jax.kfac(
      loss_fn,
      batch,
      learning_rate=0.3,
      curvature_every=1,
      inverse_every=2,
      **_models.with_config(kwargs),
    )
    state, p = jax.jit(tx.init)(params), params
    step = jax.jit(lambda g, s, p, k: tx.update(g, s, p, batch=batch, rng=k))
    for t in range(6):
      loss, g = value_and_grad(p, batch)
      u, state = step(g, state, p, jax.random.key(t))
      p = apply_updates(p, u)
    return float(value_and_grad(p, batch)[0]), state, step, p

  ref_loss, ref_state, _, _ = run()
  loss, state, step, p = run(preconditioner_dtype="bfloat16", step_warnings=True)
  cache, ref_cache = state.preconditioner.curvature.cache, ref_state.preconditioner.curvature.cache
  assert _leaf_dtypes(cache) == {jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)}
  nbytes = lambda t: sum(x.nbytes for x in jax.tree_util.tree_leaves(t))  # noqa: E731
  assert nbytes(cache) < 0.51 * nbytes(ref_cache)
  assert abs(loss - ref_loss) < 0.02 * ref_loss, (loss, ref_loss)
  bad = jax.tree_util.tree_map(lambda x: jnp.full_like(x, jnp.nan), p)
  with pytest.warns(kfac_jax.NonFiniteWarning, match="the gradient is not finite"):
    u, after = step(bad, state, p, jax.random.key(99))
    jax.block_until_ready(u)
  assert all(float(jnp.abs(x).max()) == 0.0 for x in jax.tree_util.tree_leaves(u))
  for a, b in zip(
    jax.tree_util.tree_leaves(after.preconditioner.curvature),
    jax.tree_util.tree_leaves(state.preconditioner.curvature),
  ):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_preconditioner_dtype_wider_than_the_inverses_is_refused(x64):
  loss_fn = _models.softmax_loss(_models.jnp_mlp_apply)
  batch = _models.classification_batch(jax.random.key(1), n=4, din=6, classes=3)
  match = "`config.preconditioner_dtype`=float64 is wider than `inverse_dtype`=float32"
  with pytest.raises(ValueError, match=match):
    kfac_jax.kfac(
      loss_fn,
      batch,
      learning_rate=1.0,
      config=kfac_jax.Config(inverse_dtype="float32", preconditioner_dtype="float64"),
    )
  with pytest.raises(ValueError, match=match):
    kfac_jax.Config(inverse_dtype="float32", preconditioner_dtype="float64")


def test_bfloat16_preconditioner_compiles_where_xla_transposes_the_products():
  """The zoo's equinox GRU (kernels stored `[out, in]`, one cell scanned over time): XLA folds
  the layouts' transposes into the bfloat16 products' operands and result, and XLA:CPU has no
  kernel for such a transposed bfloat16 × bfloat16 → float32 dot ("Unsupported element type
  for DotThunk") unless the products' operands and result are kept as they are
  (`_linalg.matmul`'s barriers)."""
  z = _zoo.STRUCTURE_MODELS["equinox_gru"]()
  tx = kfac_jax.kfac(
    z.loss_fn, z.batch, learning_rate=0.3, config=kfac_jax.Config(preconditioner_dtype="bfloat16")
  )
  step = _zoo.train_step(z, tx)
  params, state, batch = z.params, tx.init(z.params), z.batch
  losses = []
  for t in range(6):  # The inverses refresh on the fifth update.
    params, state, batch, loss = step(params, state, batch, _zoo._key(t))
    losses.append(float(loss))
  assert int(optax.tree_utils.tree_get(state, "skipped")) == 0
  assert np.isfinite(losses).all() and losses[-1] < losses[0]


def _schedule_fronts():
  """(name, front, hyperparameter, run) with `run(schedule)` taking three jitted steps of a
  front whose `hyperparameter` follows `schedule`; it returns the params and the skip count."""
  params = _models.jnp_mlp_init(jax.random.key(0), (4, 5, 3))
  batch = _models.classification_batch(jax.random.key(1), n=8, din=4, classes=3)
  loss_fn = _models.softmax_loss(_models.jnp_mlp_apply)

  def transform(make, skipped):
    def run(schedule):
      tx = make(schedule)
      state, p = tx.init(params), params

      @jax.jit
      def step(p, state, rng):
        _, g, stats = kfac_jax.value_and_grad(loss_fn)(p, batch, rng)
        u, state = tx.update(g, state, p, curvature_stats=stats)
        return optax.apply_updates(p, u), state

      for i in range(3):
        p, state = step(p, state, jax.random.key(i))
      return p, int(skipped(state))

    return run

  def optimizer(schedule):
    opt = kfac_jax.Optimizer(
      loss_fn,
      batch,
      learning_rate=schedule,
      momentum=0.0,
      use_adaptive_damping=False,
      config=WARN,
    )
    state, p = opt.init(params), params
    step = jax.jit(opt.step)
    for i in range(3):
      p, state, _ = step(p, state, batch, jax.random.key(i))
    return p, int(state.skipped)

  chain = lambda s: optax.chain(  # noqa: E731
    kfac_jax.scale_by_kfac(loss_fn, batch, damping=s, inverse_every=1, config=WARN),
    optax.scale(-0.1),
  )
  return [
    ("scale_by_kfac", "damping", transform(chain, lambda s: s[0].skipped)),
    (
      "kfac",
      "learning_rate",
      transform(
        lambda s: kfac_jax.kfac(loss_fn, batch, learning_rate=s, config=WARN),
        lambda s: s[0].skipped,
      ),
    ),
    ("Optimizer", "learning_rate", optimizer),
  ]


@pytest.mark.parametrize(
  ("front", "bad"),
  [(0, float("nan")), (0, -0.3), (1, float("inf")), (1, -0.3), (2, float("nan"))],
  ids=["scale_by_kfac-nan", "scale_by_kfac-negative", "kfac-inf", "kfac-negative", "Optimizer"],
)
def test_a_bad_schedule_value_skips_its_step_and_is_reported_once(front, bad):
  """A schedule that gives a non-finite value, or a negative learning rate or damping, at steps
  1 and 2: those steps are skipped (the params stay finite) and one warning names the front,
  the hyperparameter, the value and the first step."""
  who, name, run = _schedule_fronts()[front]
  schedule = lambda c: jnp.where(c >= 1, bad, 0.05)  # noqa: E731
  with pytest.warns(kfac_jax.HyperparameterWarning) as record:
    params, skipped = run(schedule)
    jax.effects_barrier()
  texts = [str(r.message) for r in record if r.category is kfac_jax.HyperparameterWarning]
  assert len(texts) == 1, texts
  assert f"{who}: the schedule of `{name}` gave {np.float32(bad)} at step 1" in texts[0]
  assert skipped == 2
  assert all(np.isfinite(x).all() for x in jax.tree_util.tree_leaves(params))


def _nan_params_fronts():
  """(name, run): `run()` takes four jitted steps of a front, the second of which makes the
  params NaN from outside the library (a schedule chained after `scale_by_kfac`; the
  `Optimizer`'s returned params poisoned by the caller); it returns the curvature after each."""
  params = _models.jnp_mlp_init(jax.random.key(0), (4, 5, 3))
  batch = _models.classification_batch(jax.random.key(1), n=8, din=4, classes=3)
  loss_fn = _models.softmax_loss(_models.jnp_mlp_apply)

  def chain():
    tx = optax.chain(
      kfac_jax.scale_by_kfac(loss_fn, batch, damping=1e-2, inverse_every=1, config=WARN),
      optax.scale_by_schedule(lambda c: jnp.where(c == 1, jnp.nan, -0.1)),
    )
    state, p, out, step = tx.init(params), params, [], _step_fn(loss_fn, tx)
    for i in range(4):
      p, state, _, _ = step(p, state, batch, jax.random.key(i))
      out.append(state[0].curvature)
    return out

  def optimizer():
    opt = kfac_jax.Optimizer(
      loss_fn, batch, learning_rate=0.1, momentum=0.0, inverse_every=1, config=WARN
    )
    state, p, out = opt.init(params), params, []
    step = jax.jit(opt.step)
    for i in range(4):
      p, state, _ = step(p, state, batch, jax.random.key(i))
      p = jax.tree_util.tree_map(lambda x: x * jnp.nan, p) if i == 1 else p
      out.append(state.curvature)
    return out

  return {"scale_by_kfac": chain, "Optimizer": optimizer}


@pytest.mark.parametrize("front", ["scale_by_kfac", "Optimizer"])
def test_nan_params_from_outside_are_reported_once_and_keep_the_curvature(front):
  """Params made NaN after a step (by a NaN schedule chained after `scale_by_kfac`, by the
  caller of `Optimizer.step`): the next step names the params, the step and the leaves, once;
  the curvature (factors and inverses) stays bit-identical and finite on every later step."""
  run = _nan_params_fronts()[front]
  with pytest.warns(kfac_jax.NonFiniteWarning) as record:
    curvatures = run()
    jax.effects_barrier()
  texts = [str(r.message) for r in record if r.category is kfac_jax.NonFiniteWarning]
  assert len(texts) == 1, texts
  assert texts[0].startswith(f"{front}: the params are not finite at step 2 (in `layer0/b`,")
  assert ("kfac_jax.kfac(learning_rate=schedule)" in texts[0]) == (front == "scale_by_kfac")
  kept = curvatures[1]
  assert _finite(kept)
  for later in curvatures[2:]:
    for a, b in zip(jax.tree_util.tree_leaves(later), jax.tree_util.tree_leaves(kept)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
