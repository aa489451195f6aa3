"""The estimator against exact computations on tiny models (float64 where it matters)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.flatten_util import ravel_pytree

import kfac_jax
from kfac_jax.blocks import _base as _block_base
from tests import _models

pytestmark = pytest.mark.numerics  # Run again with XLA's optimizations on.


def _linen_setup(n=1, dtype=jnp.float64, sizes=(5, 3), din=4):
  model = _models.LinenMLP(sizes)
  batch = _models.classification_batch(jax.random.key(0), n=n, din=din, dtype=dtype)
  init = jax.jit(lambda k, x: _models.to_dtype(model.init(k, x), dtype))  # One program.
  params = init(jax.random.key(1), batch["x"])
  return model, _models.softmax_loss(model.apply), params, batch


def _update(est, params, batch, rng=None, ema_decay=0.0, state=None):
  @jax.jit  # One program, the init included: eager operations would compile one by one.
  def update(state, params, batch, rng):
    state = est.init(params) if state is None else state
    return est.update_curvature(state, params, batch, rng, ema_decay)

  return update(state, params, batch, rng)


def _flat_grad(loss_fn, params, batch):
  """The raveled gradient, computed in one program."""
  return jax.jit(lambda p, b: ravel_pytree(jax.grad(loss_fn)(p, b))[0])(params, batch)


def test_batch_of_one_empirical_equals_gradient_outer_product(x64):
  _, loss_fn, params, batch = _linen_setup()
  # check_loss=False: the audit is tested in tests/test_audit.py; here it only compiles a program.
  est = kfac_jax.CurvatureEstimator(
    kfac_jax.Registration(loss_fn, params, batch, estimation_mode="empirical", check_loss=False)
  )
  dense = est.to_dense(_update(est, params, batch))
  g = _flat_grad(loss_fn, params, batch)
  mask = _models.block_mask(est, params)
  exact = np.outer(g, g)
  rel = np.abs(np.asarray(dense) - exact * mask).max() / np.abs(exact).max()
  assert rel < 1e-10
  assert np.all(np.asarray(dense)[~mask] == 0)  # Off-diagonal blocks are exactly zero.


@pytest.mark.parametrize("loss", ["sigmoid", "squared", "normal_var", "weighted_softmax"])
def test_batch_of_one_empirical_other_losses(x64, loss):
  params = _models.jnp_mlp_init(jax.random.key(0), (3, 4, 2), jnp.float64)
  params["gen"] = jax.device_put(np.linspace(0.5, 1.5, 2))
  x = jax.device_put(np.array([[0.3, -1.2, 0.7]]))
  t = jax.device_put(np.array([[1.0, 0.0]]))
  w, var = 0.3, 2.0

  def loss_fn(p, b):
    z = _models.jnp_mlp_apply(p, b["x"]) * kfac_jax.register_generic(p["gen"], approx="full")
    if loss == "sigmoid":
      kfac_jax.register_sigmoid_cross_entropy_loss(z, b["t"])
      return optax.sigmoid_binary_cross_entropy(z, b["t"]).sum(-1).mean()
    if loss == "squared":
      kfac_jax.register_squared_error_loss(z, b["t"])
      return ((z - b["t"]) ** 2).sum(-1).mean()
    if loss == "normal_var":
      kfac_jax.register_normal_predictive_distribution(z, b["t"], var=var)
      return ((z - b["t"]) ** 2 / (2 * var)).sum(-1).mean()
    labels = jnp.argmax(b["t"], -1)
    kfac_jax.register_softmax_cross_entropy_loss(z, labels, weight=w)
    return w * optax.softmax_cross_entropy_with_integer_labels(z, labels).mean()

  batch = {"x": x, "t": t}
  est = kfac_jax.CurvatureEstimator(
    kfac_jax.Registration(loss_fn, params, batch, estimation_mode="empirical", check_loss=False)
  )
  dense = np.asarray(est.to_dense(_update(est, params, batch)))
  g = np.asarray(_flat_grad(loss_fn, params, batch))
  # The empirical Fisher of a weighted loss w·ℓ is w ∇ℓ ∇ℓᵀ = (∇(wℓ))(∇(wℓ))ᵀ / w.
  exact = np.outer(g, g) / (w if loss == "weighted_softmax" else 1.0)
  mask = _models.block_mask(est, params)
  np.testing.assert_allclose(dense, exact * mask, rtol=1e-10, atol=1e-12 * np.abs(exact).max())


def test_factor_normalisation_on_a_batch(x64):
  """A = mean āāᵀ and G = mean ggᵀ with g the per-example loss gradient at the outputs."""
  params = {"w": _models.normal(0, (3, 4), jnp.float64), "b": jax.device_put(np.zeros(4))}
  batch = _models.classification_batch(jax.random.key(1), n=7, din=3, classes=4, dtype=jnp.float64)
  loss_fn = _models.softmax_loss(lambda p, x: x @ p["w"] + p["b"])
  est = kfac_jax.CurvatureEstimator(
    kfac_jax.Registration(loss_fn, params, batch, estimation_mode="empirical", check_loss=False)
  )
  state = _update(est, params, batch)
  (f,) = state.factors.values()
  x = np.concatenate([np.asarray(batch["x"]), np.ones((7, 1))], axis=1)
  logits = np.asarray(batch["x"] @ params["w"])
  p = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
  g = p - np.eye(4)[np.asarray(batch["y"])]
  np.testing.assert_allclose(f.a, x.T @ x / 7, rtol=1e-12)
  np.testing.assert_allclose(f.g, g.T @ g / 7, rtol=1e-12)


def test_sampled_fisher_converges_to_exact_fisher(x64):
  """Linear softmax, one example: E[A ⊗ G] = Jᵀ (diag p − p pᵀ) J."""
  params = {
    "w": _models.normal(0, (3, 4), jnp.float64, scale=0.7),
    "b": jax.device_put(np.array([0.1, -0.2, 0.3, 0.0])),
  }
  batch = jax.device_put({"x": np.array([[0.5, -1.0, 2.0]]), "y": np.array([1])})
  apply = lambda p, x: x @ p["w"] + p["b"]
  loss_fn = _models.softmax_loss(apply)
  est = kfac_jax.CurvatureEstimator(
    kfac_jax.Registration(loss_fn, params, batch, num_samples=40000, check_loss=False)
  )
  dense = np.asarray(est.to_dense(_update(est, params, batch, jax.random.key(3))))

  @jax.jit  # One program for the exact Fisher.
  def exact_fisher(params, x):
    flat, unravel = ravel_pytree(params)
    jac = jax.jacobian(lambda v: apply(unravel(v), x)[0])(flat)
    p = jax.nn.softmax(apply(params, x)[0])
    return jac.T @ (jnp.diag(p) - jnp.outer(p, p)) @ jac

  exact = np.asarray(exact_fisher(params, batch["x"]))
  rel = np.linalg.norm(dense - exact) / np.linalg.norm(exact)
  assert rel < 0.03, rel
  # A single sample is far off: the test can tell an estimator from the exact matrix.
  est1 = kfac_jax.CurvatureEstimator(
    kfac_jax.Registration(loss_fn, params, batch, num_samples=1, check_loss=False)
  )
  one = np.asarray(est1.to_dense(_update(est1, params, batch, jax.random.key(3))))
  assert np.linalg.norm(one - exact) / np.linalg.norm(exact) > 0.1


def _random_state(est, params, batch, key):
  state = _update(est, params, batch, key)
  return jax.jit(lambda s: est.update_inverses(s, 0.05))(state)


def _basis_matrix(est, state, params, fn):
  """The matrix of `fn(state, ·)`: its columns are the images of the basis vectors (computed
  in one program)."""
  flat, unravel = ravel_pytree(params)
  rows = jax.jit(jax.vmap(lambda e: ravel_pytree(fn(state, unravel(e)))[0]))(np.eye(flat.size))
  return np.asarray(rows).T


@pytest.mark.parametrize(
  "damping_mode, factor_solve", [("factored", "auto"), ("factored", "always"), ("eigen", "auto")]
)
def test_matpower_roundtrip_and_cholesky(x64, damping_mode, factor_solve):
  model, _, params, batch = _linen_setup(n=6, sizes=(4, 3), din=3)
  params["gen"] = jax.device_put(np.linspace(0.5, 1.5, 3))
  params["gen_full"] = jax.device_put(np.linspace(-1.0, 1.0, 3))

  def loss_fn(p, b):
    z = model.apply({"params": p["params"]}, b["x"])
    z = z * kfac_jax.register_generic(p["gen"]) + kfac_jax.register_generic(
      p["gen_full"], approx="full"
    )
    kfac_jax.register_softmax_cross_entropy_loss(z, b["y"])
    return optax.softmax_cross_entropy_with_integer_labels(z, b["y"]).mean()

  est = kfac_jax.CurvatureEstimator(
    kfac_jax.Registration(loss_fn, params, batch, check_loss=False),
    exps=(-1, -0.5, 2),
    compute_cholesky=True,
    compute_cholesky_inverse=True,
    config=kfac_jax.Config(damping_mode=damping_mode, factor_solve=factor_solve),
  )
  state = _random_state(est, params, batch, jax.random.key(5))
  kept = [c.a.subst is not None for c in state.cache.values() if hasattr(c, "a")]
  assert kept and all(kept) == (factor_solve == "always" and damping_mode == "factored")
  v = jax.jit(  # One program for the draws.
    lambda p: jax.tree_util.tree_map(
      lambda x: jax.random.normal(jax.random.key(9), x.shape, x.dtype), p
    )
  )(params)

  @jax.jit  # One program: eager operations would compile one by one.
  def products(state, v):
    power = est.multiply_matpower
    return (
      power(state, power(state, v, 1), -1),
      power(state, power(state, v, -0.5), -0.5),
      est.multiply_inverse(state, v),
      power(state, v, 2),
      est.multiply(state, est.multiply(state, v)),
    )

  back, half, inverse, sq, twice = products(state, v)
  np.testing.assert_allclose(ravel_pytree(back)[0], ravel_pytree(v)[0], rtol=1e-8, atol=1e-10)
  np.testing.assert_allclose(ravel_pytree(half)[0], ravel_pytree(inverse)[0], rtol=1e-8)
  np.testing.assert_allclose(ravel_pytree(sq)[0], ravel_pytree(twice)[0], rtol=1e-8)

  damped = _basis_matrix(est, state, params, est.multiply)
  chol = _basis_matrix(est, state, params, est.multiply_cholesky)
  chol_t = _basis_matrix(
    est, state, params, lambda s, x: est.multiply_cholesky(s, x, transpose=True)
  )
  chol_inv = _basis_matrix(est, state, params, est.multiply_cholesky_inverse)
  chol_inv_t = _basis_matrix(
    est, state, params, lambda s, x: est.multiply_cholesky_inverse(s, x, transpose=True)
  )
  np.testing.assert_allclose(chol @ chol.T, damped, rtol=1e-8, atol=1e-10)
  np.testing.assert_allclose(chol_t, chol.T, atol=1e-10)
  np.testing.assert_allclose(chol_inv @ chol, np.eye(len(damped)), atol=1e-8)
  np.testing.assert_allclose(chol_inv_t, chol_inv.T, atol=1e-10)


def test_damped_block_formulas(x64):
  params = {"w": _models.normal(0, (3, 2), jnp.float64)}
  batch = _models.classification_batch(jax.random.key(1), n=5, din=3, classes=2, dtype=jnp.float64)
  loss_fn = _models.softmax_loss(lambda p, x: x @ p["w"])
  lam = 0.3
  for mode in ("factored", "eigen"):
    est = kfac_jax.CurvatureEstimator(
      kfac_jax.Registration(loss_fn, params, batch, check_loss=False),
      config=kfac_jax.Config(damping_mode=mode),
    )
    state = jax.jit(lambda s: est.update_inverses(s, lam))(
      _update(est, params, batch, jax.random.key(2))
    )
    a, g = (np.asarray(f) for f in state.factors["w"])
    if mode == "factored":
      pi = np.sqrt((np.trace(a) / 3) / (np.trace(g) / 2))
      expected = np.kron(a + pi * np.sqrt(lam) * np.eye(3), g + np.sqrt(lam) / pi * np.eye(2))
    else:
      expected = np.kron(a, g) + lam * np.eye(6)
    np.testing.assert_allclose(
      _basis_matrix(est, state, params, est.multiply), expected, rtol=1e-10
    )
    np.testing.assert_allclose(
      _basis_matrix(est, state, params, est.multiply_inverse), np.linalg.inv(expected), rtol=1e-8
    )


@pytest.mark.parametrize("batched", [True, False])
def test_equal_shape_blocks_are_vmapped_with_identical_results(x64, batched, monkeypatch):
  # On CPU equal-shape blocks get one call each (batched LAPACK can deadlock there); the vmapped
  # path that GPU / TPU take is forced here on small matrices.
  monkeypatch.setattr(_block_base, "batched_factorisations", lambda: batched)
  params = _models.jnp_mlp_init(jax.random.key(0), (4, 4, 4, 3), jnp.float64)
  batch = _models.classification_batch(jax.random.key(1), n=9, dtype=jnp.float64)
  est = kfac_jax.CurvatureEstimator(
    kfac_jax.Registration(
      _models.softmax_loss(_models.jnp_mlp_apply), params, batch, check_loss=False
    )
  )
  state = _update(est, params, batch, jax.random.key(2))
  keys = [b.group_key() for b in est.blocks]
  assert keys[0] == keys[1] != keys[2]
  new, refs = jax.jit(  # One program for the step's inverses and the per-block references.
    lambda s: (
      est.update_inverses(s, 0.1),
      [
        b.compute_cache(s.factors[name], jnp.asarray(0.1)) for name, b in zip(s.factors, est.blocks)
      ],
    )
  )(state)
  jaxpr = jax.make_jaxpr(lambda s: est.update_inverses(s, 0.1))(state)
  ranks = {
    v.aval.ndim
    for e in _models.all_eqns(jaxpr.jaxpr)
    if e.primitive.name == "cholesky"
    for v in e.invars
  }
  assert ranks == ({2, 3} if batched else {2})  # A stack of two blocks' factors, or none.
  for name, ref in zip(state.factors, refs):
    assert type(new.cache[name]) is type(ref)
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-12), new.cache[name], ref)


LAPACK_PRIMITIVES = {"cholesky", "eigh", "triangular_solve", "lu", "qr", "svd", "eig", "schur"}


@pytest.mark.parametrize(
  ("layers", "config"),
  [(None, {}), (None, {"damping_mode": "eigen"}), ({"conv": "ekfac"}, {})],
  ids=["factored", "eigen", "ekfac"],
)
def test_grouped_layouts_factorise_one_matrix_per_call_on_cpu(layers, config):
  # A grouped convolution (2 feature groups) and an unshared one (16 locations) keep one
  # factor per group; a batched LAPACK call over the groups can deadlock the CPU thread pool,
  # so on CPU the step's factorisations all take one matrix.
  from tests import _zoo

  z = _zoo.grouped_local()
  layer_config = None if layers is None else kfac_jax.LayerConfig(defaults=layers)
  reg = kfac_jax.Registration(z.loss_fn, z.params, z.batch, layers=layer_config, check_loss=False)
  grouped = [s for s in reg.layers if s.name in ("Conv_1", "ConvLocal_0")]
  assert sorted(s.factor_shapes[0][0] for s in grouped) == [2, 16]
  tx = kfac_jax.scale_by_kfac(registration=reg, inverse_every=1, **_models.with_config(config))

  def step(params, state, batch, rng):
    _, grads, stats = kfac_jax.value_and_grad(registration=reg)(params, batch, rng)
    return tx.update(grads, state, params, curvature_stats=stats)

  state = tx.init(z.params)
  jaxpr = jax.make_jaxpr(step)(z.params, state, z.batch, jax.random.key(0))
  ranks = {
    (e.primitive.name, v.aval.ndim)
    for e in _models.all_eqns(jaxpr.jaxpr)
    if e.primitive.name in LAPACK_PRIMITIVES
    for v in e.invars
  }
  assert ranks and {r for _, r in ranks} == {2}, ranks


GROUPED_STEPS = """
import jax, numpy as np, optax, kfac_jax
from tests import _zoo
z = _zoo.grouped_local()
tx = optax.chain(kfac_jax.scale_by_kfac(z.loss_fn, z.batch, inverse_every=1), optax.scale(-0.05))
step = _zoo.train_step(z, tx)
params, state, batch = z.params, tx.init(z.params), z.batch
for i in range(3):
  params, state, batch, loss = step(params, state, batch, jax.random.key(i))
  print(float(loss))
assert np.isfinite(float(loss))
"""


def test_grouped_layouts_step_returns():
  # The step itself, in a child process a timeout can end: a deadlocked LAPACK call in this
  # process would hang the suite instead of failing it.
  import os
  import subprocess
  import sys

  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = dict(os.environ, PYTHONPATH=root, JAX_PLATFORMS="cpu")
  proc = subprocess.run(
    [sys.executable, "-c", GROUPED_STEPS],
    cwd=root,
    env=env,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  losses = [float(x) for x in proc.stdout.split()]
  assert len(losses) == 3 and losses[-1] < losses[0], losses


def test_ema_is_bias_corrected_and_skips_non_finite_batches(x64):
  params = {"w": jnp.ones((2, 2), jnp.float64)}
  loss_fn = _models.softmax_loss(lambda p, x: x @ p["w"])
  b1 = {"x": jnp.array([[1.0, 0.0]]), "y": jnp.array([0])}
  b2 = {"x": jnp.array([[0.0, 2.0]]), "y": jnp.array([1])}
  est = kfac_jax.CurvatureEstimator(
    kfac_jax.Registration(loss_fn, params, b1, estimation_mode="empirical", check_loss=False)
  )
  s1 = _update(est, params, b1, ema_decay=0.9)
  a1 = np.asarray(s1.factors["w"].a)
  np.testing.assert_allclose(a1, [[1, 0], [0, 0]])  # Not shrunk by (1 - decay).
  s2 = _update(est, params, b2, ema_decay=0.9, state=s1)
  np.testing.assert_allclose(s2.factors["w"].a, (0.9 * a1 + [[0, 0], [0, 4]]) / 1.9)
  s0 = _update(est, params, b2, ema_decay=0.0, state=s1)
  np.testing.assert_allclose(s0.factors["w"].a, [[0, 0], [0, 4]])
  bad = {"x": jnp.array([[jnp.nan, 1.0]]), "y": jnp.array([0])}
  s3 = _update(est, params, bad, ema_decay=0.9, state=s2)
  assert int(s3.skipped_batches) == int(s2.skipped_batches) + 1  # The event is counted ...
  s3 = s3._replace(skipped_batches=s2.skipped_batches)  # ... and nothing else changes.
  for u, v in zip(jax.tree_util.tree_leaves(s3), jax.tree_util.tree_leaves(s2)):
    np.testing.assert_array_equal(u, v)


def test_one_forward_pass_flops():
  """value_and_grad costs one forward, one backward and one activation-only backward."""
  sizes = (256, 512, 512, 256, 10)
  params = _models.jnp_mlp_init(jax.random.key(0), sizes)
  batch = _models.classification_batch(jax.random.key(1), n=128, din=256, classes=10)
  loss_fn = _models.softmax_loss(_models.jnp_mlp_apply)
  key = jax.random.key(2)

  def flops(f, *args):
    return jax.jit(f).lower(*args).compile().cost_analysis()["flops"]

  matmul = 2 * 128 * sum(a * b for a, b in zip(sizes[:-1], sizes[1:]))  # One forward pass.
  first = 2 * 128 * sizes[0] * sizes[1]  # No gradient flows into the data.
  kfac = flops(lambda p, b, k: kfac_jax.value_and_grad(loss_fn)(p, b, k), params, batch, key)
  adam_like = flops(jax.value_and_grad(loss_fn), params, batch)
  assert adam_like == pytest.approx(3 * matmul - first, rel=0.02)
  # On top of forward + backward: the sampled loss's activation gradients, i.e. the dx products
  # of every layer but the first (matmul - first), and no dW products. A second forward and
  # backward would add 3 * matmul - first; a vmapped pull-back of both cotangents would add
  # 2 * matmul - first.
  extra = kfac - adam_like
  assert extra < 1.05 * (matmul - first), extra / matmul


def test_estimator_errors_leave_state_untouched():
  _, loss_fn, params, batch = _linen_setup(n=4, dtype=jnp.float32)
  with pytest.raises(ValueError, match="estimation_mode.*choose one of"):
    kfac_jax.CurvatureEstimator(
      kfac_jax.Registration(loss_fn, params, batch, estimation_mode="exactish")
    )
  with pytest.raises(ValueError, match="num_samples"):
    kfac_jax.CurvatureEstimator(kfac_jax.Registration(loss_fn, params, batch, num_samples=0))
  with pytest.raises(ValueError, match="damping_mode"):
    kfac_jax.CurvatureEstimator(
      kfac_jax.Registration(loss_fn, params, batch, check_loss=False),
      config=kfac_jax.Config(damping_mode="tikhonov"),
    )
  est = kfac_jax.CurvatureEstimator(kfac_jax.Registration(loss_fn, params, batch, check_loss=False))
  state = jax.jit(est.init)(params)  # Eager, each operation would compile on its own.
  with pytest.raises(ValueError, match="ema_decay"):
    est.update_curvature(state, params, batch, jax.random.key(0), ema_decay=1.0)
  # Raised while the forward pass is traced: under jit, as one program would be compiled.
  with pytest.raises(ValueError, match="pass `rng`"):
    jax.jit(lambda s: est.update_curvature(s, params, batch, None, ema_decay=0.5))(state)
  with pytest.raises(ValueError, match="damping"):
    est.update_inverses(state, -1.0)
  with pytest.raises(ValueError, match=r"matrix power -0.5 was not prepared"):
    est.multiply_matpower(state, params, -0.5)
  with pytest.raises(ValueError, match="pytree structure differs"):
    est.multiply_matpower(state, {"params": params["params"], "extra": 1.0}, -1)
  with pytest.raises(ValueError, match="params pytree differs"):
    est.init({"params": {**params["params"], "new": jnp.ones(2)}})

  def no_targets(p, b):
    logits = _models.LinenMLP().apply(p, b["x"])
    kfac_jax.register_softmax_cross_entropy_loss(logits)
    return optax.softmax_cross_entropy_with_integer_labels(logits, b["y"]).mean()

  emp = kfac_jax.CurvatureEstimator(
    kfac_jax.Registration(no_targets, params, batch, estimation_mode="empirical", check_loss=False)
  )
  s = jax.jit(emp.init)(params)
  with pytest.raises(ValueError, match="needs the data's targets"):
    jax.jit(lambda s: emp.update_curvature(s, params, batch, None, ema_decay=0.5))(s)


@pytest.mark.parametrize("factor_solve", ["never", "always"])
def test_failed_factorisation_keeps_the_previous_inverse(factor_solve):
  params = {"w": jax.device_put(np.ones((3, 2), np.float32))}
  batch = jax.device_put(  # A has rank 1: singular.
    {"x": np.array([[1.0, 2.0, 3.0]], np.float32), "y": np.array([1], np.int32)}
  )
  est = kfac_jax.CurvatureEstimator(
    kfac_jax.Registration(
      _models.softmax_loss(lambda p, x: x @ p["w"]),
      params,
      batch,
      estimation_mode="empirical",
      check_loss=False,
    ),
    config=kfac_jax.Config(factor_solve=factor_solve),
  )
  state = jax.jit(lambda s: est.update_inverses(s, 0.5))(_update(est, params, batch))
  assert (state.cache["w"].a.subst is None) == (factor_solve == "never")
  again = jax.jit(lambda s: est.update_inverses(s, 0.0))(state)  # Cholesky of a singular A.
  for a, b in zip(jax.tree_util.tree_leaves(again.cache), jax.tree_util.tree_leaves(state.cache)):
    np.testing.assert_array_equal(a, b)
  assert int(again.failed_inverses) == int(state.failed_inverses) + 1
  assert all(bool(np.all(np.isfinite(x))) for x in jax.tree_util.tree_leaves(again))


def _head_setup():
  """x [16, 8] -> dense 300 (tanh) -> dense 4: the first layer's G (300) multiplies 9 columns,
  the head's A (301) 4: both sides `factor_solve="auto"` keeps in substitution form."""
  rng = _models.np_rng(0)  # float64: every caller runs under x64.
  params = jax.device_put(
    {
      "w1": 0.3 * rng.standard_normal((8, 300)),
      "b1": np.zeros(300),
      "w2": 0.1 * rng.standard_normal((300, 4)),
      "b2": np.zeros(4),
    }
  )
  apply = lambda p, x: jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]
  batch = jax.device_put(
    {"x": rng.standard_normal((16, 8)), "y": rng.integers(0, 4, 16).astype(np.int32)}
  )
  return _models.softmax_loss(apply), params, batch


def test_factor_solve_keeps_substitution_forms_and_multiplies_by_the_exact_inverse(x64):
  loss_fn, params, batch = _head_setup()
  grads = jax.jit(jax.grad(loss_fn))(params, batch)
  # One registration for the three estimators.
  reg = kfac_jax.Registration(loss_fn, params, batch, check_loss=False)
  kept, nat = {}, {}
  for mode in ("auto", "never", "always"):
    est = kfac_jax.CurvatureEstimator(reg, config=kfac_jax.Config(factor_solve=mode))
    state = _random_state(est, params, batch, jax.random.key(5))
    kept[mode] = {n: (c.a.subst is not None, c.g.subst is not None) for n, c in state.cache.items()}
    for c in state.cache.values():  # A side in substitution form has no explicit inverse.
      assert all((side.subst is None) == (side.powers[0] is not None) for side in (c.a, c.g))
    nat[mode] = jax.jit(est.multiply_inverse)(state, grads)
    if mode == "auto":
      # The block's product against (A_λ ⊗ G_λ)⁻¹ vec(M) = A_λ⁻¹ M G_λ⁻¹ from the factors.
      a, g, m = jax.jit(  # One program for the damped factors and the gradient's matrix.
        lambda f, grads: (
          *kfac_jax.blocks._kronecker.damped_factors(f.a, f.g, jnp.asarray(0.05)),
          jnp.concatenate([grads["w2"], grads["b2"][None]], axis=0),
        )
      )(state.factors["w2"], grads)
      want = np.linalg.solve(np.asarray(a), np.asarray(m)) @ np.linalg.inv(np.asarray(g))
      got = np.concatenate([nat[mode]["w2"], nat[mode]["b2"][None]], axis=0)
      np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-12)
  assert kept["auto"] == {"w1": (False, True), "w2": (True, False)}
  assert kept["never"] == {"w1": (False, False), "w2": (False, False)}
  assert kept["always"] == {"w1": (True, True), "w2": (True, True)}
  for mode in ("auto", "always"):
    for x, y in zip(jax.tree_util.tree_leaves(nat[mode]), jax.tree_util.tree_leaves(nat["never"])):
      np.testing.assert_allclose(x, y, rtol=1e-9, atol=1e-12)


def test_factor_solve_is_checked_and_stacks_keep_explicit_inverses(x64, monkeypatch):
  loss_fn, params, batch = _head_setup()
  # The state's structure depends on shapes only, not on the backend (checkpoints move).
  reg = kfac_jax.Registration(loss_fn, params, batch, check_loss=False)
  here = jax.tree_util.tree_structure(
    jax.eval_shape(kfac_jax.CurvatureEstimator(reg).init, params)  # Traced, not compiled.
  )
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  there = jax.tree_util.tree_structure(
    jax.eval_shape(kfac_jax.CurvatureEstimator(reg).init, params)
  )
  monkeypatch.undo()
  assert here == there
  with pytest.raises(ValueError, match="unknown config.factor_solve 'cholesky'"):
    kfac_jax.CurvatureEstimator(reg, config=kfac_jax.Config(factor_solve="cholesky"))

  def stacked(p, x):  # Three 300 -> 300 layers in a scan: the stack's blocks are vmapped.
    h = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, p["w"])[0]
    return h[:, :4]

  p = {"w": _models.normal(2, (3, 300, 300), jnp.float64, scale=0.05)}
  b = jax.device_put({"x": np.ones((2, 300)), "y": np.array([0, 1])})
  est = kfac_jax.CurvatureEstimator(
    kfac_jax.Registration(_models.softmax_loss(stacked), p, b, check_loss=False),
    config=kfac_jax.Config(factor_solve="always"),
  )
  jax.eval_shape(est.init, p)  # Traced, not compiled.
  (block,) = est.blocks
  assert isinstance(block, kfac_jax.blocks.StackedBlock) and block.inner.solves == (False, False)
  assert block.cache_shapes().a.subst is None and block.cache_shapes().a.powers[0].shape == (
    3,
    300,
    300,
  )


def test_factor_solve_reaches_the_transform_and_the_optimizer(x64):
  loss_fn, params, batch = _head_setup()
  grads = jax.jit(jax.grad(loss_fn))(params, batch)
  out = {}
  for mode in ("never", "auto"):
    tx = kfac_jax.kfac(
      loss_fn,
      batch,
      learning_rate=0.3,
      curvature_every=1,
      config=kfac_jax.Config(factor_solve=mode),
    )
    # One program, the init included: eager operations would compile one by one.
    update = jax.jit(
      lambda g, p, tx=tx: tx.update(g, tx.init(p), p, batch=batch, rng=jax.random.key(1))
    )
    updates, state = update(grads, params)
    cache = state.preconditioner.curvature.cache
    assert (cache["w2"].a.subst is not None) == (mode == "auto")
    out[mode] = updates
  for x, y in zip(jax.tree_util.tree_leaves(out["auto"]), jax.tree_util.tree_leaves(out["never"])):
    np.testing.assert_allclose(x, y, rtol=1e-9, atol=1e-12)
  opt = kfac_jax.Optimizer(
    loss_fn,
    batch,
    learning_rate=0.1,
    momentum=0.0,
    config=kfac_jax.Config(factor_solve="never"),
  )
  opt_state = jax.eval_shape(opt.init, params)  # Traced, not compiled: its layout suffices.
  assert opt.estimator.config.factor_solve == "never"
  assert opt_state.curvature.cache["w2"].a.subst is None
  with pytest.raises(ValueError, match="unknown config.factor_solve 'fast'"):
    kfac_jax.Config(factor_solve="fast")


def test_checkpoint_from_another_factor_solve_is_refused_by_name(x64):
  loss_fn, params, batch = _head_setup()
  auto = jax.jit(  # Jitted: eager, each operation would compile on its own.
    kfac_jax.CurvatureEstimator(
      kfac_jax.Registration(loss_fn, params, batch, check_loss=False)
    ).init
  )(params)
  never = jax.jit(
    kfac_jax.CurvatureEstimator(
      kfac_jax.Registration(loss_fn, params, batch, check_loss=False),
      config=kfac_jax.Config(factor_solve="never"),
    ).init
  )(params)
  with pytest.raises(ValueError, match=r"(?s)block `w2`: `cache/a/subst/0/0` in the checkpoint"):
    kfac_jax.check_restored_state(never, auto)


def test_a_loss_function_and_batch_name_the_registration():
  """The estimator is built complete from a registration: a loss function raises, showing the
  call that builds one."""
  _, loss_fn, _, _ = _linen_setup(dtype=jnp.float32)
  fix = "kfac_jax.CurvatureEstimator(kfac_jax.Registration(loss_fn, params, batch))"
  with pytest.raises(TypeError) as e:
    kfac_jax.CurvatureEstimator(loss_fn)
  assert fix in str(e.value)


@pytest.mark.parametrize(
  "field, value",
  [
    ("statistics_fraction", 0.5),
    ("burn_in_steps", 3),
    ("skip_nonfinite", False),
    ("nesterov", True),
    ("min_damping", 1e-4),
    ("weight_decay", 1e-4),
  ],
)
def test_a_config_field_the_estimator_does_not_read_is_refused(field, value):
  _, loss_fn, params, batch = _linen_setup(dtype=jnp.float32)
  config = kfac_jax.Config(**{field: value})
  with pytest.raises(ValueError, match=f"CurvatureEstimator: `config.{field}`={value!r} is not"):
    kfac_jax.CurvatureEstimator(
      kfac_jax.Registration(loss_fn, params, batch, check_loss=False), config=config
    )
  with pytest.raises(TypeError, match="`config` must be a kfac_jax.Config, got dict"):
    kfac_jax.CurvatureEstimator(
      kfac_jax.Registration(loss_fn, params, batch, check_loss=False), config={field: value}
    )


def test_the_config_fields_reach_the_estimator(x64):
  _, loss_fn, params, batch = _linen_setup()
  config = kfac_jax.Config(damping_mode="eigen", stats_dtype="float32", inverse_dtype="float64")
  est = kfac_jax.CurvatureEstimator(
    kfac_jax.Registration(loss_fn, params, batch, estimation_mode="exact", check_loss=False),
    exps=(-1, 1),
    config=config,
  )
  assert est.numerics.damping_mode == "eigen"
  assert est.numerics.stats_dtype == np.float32 and est.numerics.inverse_dtype == np.float64
  state = _update(est, params, batch)
  assert est.registration.estimation_mode == "exact"
  # Exact-mode statistics stored in float32 agree with float64 ones to float32 rounding.
  exact = kfac_jax.CurvatureEstimator(
    kfac_jax.Registration(loss_fn, params, batch, estimation_mode="exact", check_loss=False)
  )
  np.testing.assert_allclose(
    est.to_dense(state), exact.to_dense(_update(exact, params, batch)), rtol=1e-6, atol=1e-7
  )
