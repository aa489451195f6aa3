"""The six estimation modes against exact Fisher / GGN references on tiny models (float64)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.flatten_util import ravel_pytree

import kfac_jax
from tests import _models

pytestmark = pytest.mark.numerics  # Run again with XLA's optimizations on.

KINDS = ["categorical", "bernoulli", "normal"]
VAR = 0.3
ALL_MODES = ("gradients", "empirical", "curvature_prop", "curvature_prop_GGN", "exact", "exact_GGN")


def _tagged(kind, z, b):
  """Registers a weighted loss tag on `z` and returns the matching loss (a mean over the batch)."""
  w = b["w"]
  if kind == "categorical":
    kfac_jax.register_softmax_cross_entropy_loss(z, b["y"], weight=w)
    return jnp.mean(w * optax.softmax_cross_entropy_with_integer_labels(z, b["y"]))
  if kind == "bernoulli":
    kfac_jax.register_sigmoid_cross_entropy_loss(z, b["t"], weight=w)
    return jnp.mean(jnp.sum(w * optax.sigmoid_binary_cross_entropy(z, b["t"]), -1))
  kfac_jax.register_normal_predictive_distribution(z, b["t"], var=VAR, weight=w)
  return jnp.mean(jnp.sum(w * (z - b["t"]) ** 2 / (2 * VAR), -1))


@functools.cache  # One loss, params and batch per case, shared by the tests.
def _setup(kind, model, n=1):
  din, dout = 3, 4
  rng = _models.np_rng(0)  # Drawn on the host, float64 (every caller runs under x64).
  # Per-example weights for the categorical, per-coordinate weights for the others.
  wshape = (n,) if kind == "categorical" else (n, dout)
  batch = {
    "x": rng.standard_normal((n, din)),
    "y": np.arange(n) % dout,
    "t": (rng.random((n, dout)) > 0.5).astype(np.float64),
    "w": rng.uniform(0.3, 2.0, wshape),
  }
  if kind == "normal":
    batch["t"] = rng.standard_normal((n, dout))
  batch = jax.device_put(batch)
  sizes = (din, dout) if model == "linear" else (din, 5, dout)
  params = _models.jnp_mlp_init(1, sizes, jnp.float64)
  params = jax.device_put(
    jax.tree_util.tree_map(
      lambda p: np.asarray(p) + 0.3 * np.cos(np.arange(p.size)).reshape(p.shape), params
    )
  )  # Non-zero biases.

  def loss_fn(p, b):
    return _tagged(kind, _models.jnp_mlp_apply(p, b["x"]), b)

  return loss_fn, params, batch


def _dense(loss_fn, params, batch, mode, rng=None, num_samples=1):
  # check_loss=False: the audit is tested in tests/test_audit.py; here it only compiles a program.
  est = kfac_jax.CurvatureEstimator(
    kfac_jax.Registration(
      loss_fn, params, batch, estimation_mode=mode, num_samples=num_samples, check_loss=False
    )
  )
  state = jax.jit(  # One program, the init included: eager operations would compile one by one.
    lambda r: est.update_curvature(est.init(params), params, batch, r, ema_decay=0.0)
  )(rng)
  return est, np.asarray(est.to_dense(state))


@functools.cache
def _setup_dense(kind, model, mode):
  """`_dense` of `_setup(kind, model)` (one example), shared by the tests that read it."""
  return _dense(*_setup(kind, model), mode)


@pytest.mark.parametrize("model", ["linear", "mlp"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mode", ["exact", "exact_GGN", "empirical"])
def test_batch_of_one_matches_jacobian_reference(x64, model, kind, mode):
  """One example: each block is exactly Jᵀ H_z J (or Jᵀ u uᵀ J for "empirical") restricted to it.

  For one example a dense layer's Jacobian is ā ⊗ ∂z/∂s, so its block (ā āᵀ) ⊗ (…) is exactly
  Kronecker: the K-FAC block must equal the reference to rounding.
  """
  loss_fn, params, batch = _setup(kind, model)
  flat, unravel = ravel_pytree(params)
  z = jax.jit(_models.jnp_mlp_apply)(params, batch["x"])  # Eager ops compile one by one.
  jac = _models.jit_jacobian(lambda v: _models.jnp_mlp_apply(unravel(v), batch["x"]))(flat)
  jac = np.asarray(jac).reshape(z.size, -1)
  loss_in_z = lambda zz: _tagged(kind, zz, batch)
  if mode == "empirical":
    # The per-example vector is √w ∇_z ℓ = ∇_z(w ℓ) / √w (N = 1, weights per coordinate).
    w = np.broadcast_to(
      np.asarray(batch["w"])[..., None] if kind == "categorical" else np.asarray(batch["w"]),
      z.shape,
    )
    u = np.asarray(jax.jit(jax.grad(loss_in_z))(z)).ravel() / np.sqrt(w.ravel())
    out = np.outer(u, u)
  else:
    out = np.asarray(_models.jit_hessian(loss_in_z)(z)).reshape(z.size, z.size)
  reference = jac.T @ out @ jac
  est, dense = _setup_dense(kind, model, mode)
  mask = _models.block_mask(est, params)
  assert len(est.blocks) == (1 if model == "linear" else 2)
  assert [b.spec.kind for b in est.blocks] == ["dense"] * len(est.blocks)
  expected = reference * mask
  rel = np.linalg.norm(dense - expected) / np.linalg.norm(expected)
  assert rel < 1e-10, rel
  assert np.all(dense[~mask] == 0)


def test_exact_and_exact_ggn_agree_on_a_batch(x64):
  """On a batch, exact and exact_GGN give the same factors (canonical links), and G is the
  batch mean of the per-example output curvature pulled back to the last layer."""
  loss_fn, params, batch = _setup("categorical", "linear", n=5)
  _, fisher = _dense(loss_fn, params, batch, "exact")
  _, ggn = _dense(loss_fn, params, batch, "exact_GGN")
  np.testing.assert_allclose(fisher, ggn, rtol=1e-12, atol=1e-14)
  est = kfac_jax.CurvatureEstimator(
    kfac_jax.Registration(loss_fn, params, batch, estimation_mode="exact", check_loss=False)
  )
  state = jax.jit(lambda p, b: est.update_curvature(est.init(p), p, b, None, ema_decay=0.0))(
    params, batch
  )
  z = jax.jit(_models.jnp_mlp_apply)(params, batch["x"])
  hess = _models.jit_hessian(lambda zz: _tagged("categorical", zz, batch))(z)  # [N, C, N, C]
  g_ref = sum(np.asarray(hess[n, :, n, :]) for n in range(5))  # (1/N) Σₙ wₙ F(zₙ)
  (factors,) = state.factors.values()
  np.testing.assert_allclose(factors.g, g_ref, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mode", ["gradients", "curvature_prop", "curvature_prop_GGN"])
def test_random_modes_converge_to_exact(x64, kind, mode):
  """The error against the exact mode shrinks like 1/√S."""
  loss_fn, params, batch = _setup(kind, "mlp")
  _, exact = _setup_dense(kind, "mlp", "exact")  # Shared with the other modes' tests.
  errs = {}
  for s in (10, 10000):
    _, est = _dense(loss_fn, params, batch, mode, rng=jax.random.key(7), num_samples=s)
    errs[s] = np.linalg.norm(est - exact) / np.linalg.norm(exact)
  assert errs[10000] < 0.05, errs
  assert errs[10000] < errs[10] / 5, errs  # Expected ratio √1000 ≈ 32.
  assert errs[10] > 1e-2, errs  # Random: not the exact matrix by accident.


def test_sequence_prediction_exact_matches_reference(x64):
  """`[N, T, C]` logits from per-position weights: the exact mode is the full Fisher block."""
  n, d, t, c = 1, 3, 2, 3
  rng = _models.np_rng(1)
  params = jax.device_put({"w": rng.standard_normal((d, t, c))})
  batch = jax.device_put(
    {
      "x": rng.standard_normal((n, d)),
      "y": rng.integers(0, c, (n, t)).astype(np.int32),
      "w": rng.uniform(0.5, 1.5, (n, t)),
    }
  )
  apply = lambda p, x: jnp.einsum("nd,dtc->ntc", x, p["w"])

  def loss_in_z(z, b):
    kfac_jax.register_softmax_cross_entropy_loss(z, b["y"], weight=b["w"])
    nll = optax.softmax_cross_entropy_with_integer_labels(z, b["y"])
    return jnp.mean(jnp.sum(b["w"] * nll, -1))

  loss_fn = lambda p, b: loss_in_z(apply(p, b["x"]), b)
  z = apply(params, batch["x"])
  flat, unravel = ravel_pytree(params)
  jac = np.asarray(_models.jit_jacobian(lambda v: apply(unravel(v), batch["x"]))(flat)).reshape(
    z.size, -1
  )
  hess = np.asarray(_models.jit_hessian(lambda zz: loss_in_z(zz, batch))(z)).reshape(z.size, z.size)
  for mode in ("exact", "exact_GGN"):
    est, dense = _dense(loss_fn, params, batch, mode)
    assert [b.spec.kind for b in est.blocks] == ["dense"]
    reference = jac.T @ hess @ jac
    assert np.linalg.norm(dense - reference) / np.linalg.norm(reference) < 1e-10


def test_sequence_prediction_shared_kernel_factors(x64):
  """`[N, T, C]` logits from a kernel shared over positions: column (t, c) of the exact stack is
  non-zero only at position t, so G = (1/N) Σ_{n,t} w_{nt} F(z_{nt}) and A = mean ā āᵀ."""
  n, t, d, c = 2, 3, 4, 3
  rng = _models.np_rng(2)
  params = jax.device_put({"w": rng.standard_normal((d, c)), "b": rng.standard_normal(c)})
  batch = jax.device_put(
    {
      "x": rng.standard_normal((n, t, d)),
      "y": rng.integers(0, c, (n, t)).astype(np.int32),
      "w": rng.uniform(0.5, 1.5, (n, t)),
    }
  )
  apply = lambda p, x: x @ p["w"] + p["b"]

  def loss_in_z(z, b):
    kfac_jax.register_softmax_cross_entropy_loss(z, b["y"], weight=b["w"])
    nll = optax.softmax_cross_entropy_with_integer_labels(z, b["y"])
    return jnp.mean(jnp.sum(b["w"] * nll, -1))

  loss_fn = lambda p, b: loss_in_z(apply(p, b["x"]), b)
  est = kfac_jax.CurvatureEstimator(
    kfac_jax.Registration(loss_fn, params, batch, estimation_mode="exact", check_loss=False)
  )
  state = jax.jit(lambda s: est.update_curvature(s, params, batch, None, 0.0))(est.init(params))
  (factors,) = state.factors.values()
  z = apply(params, batch["x"])
  hess = np.asarray(_models.jit_hessian(lambda zz: loss_in_z(zz, batch))(z))  # [N, T, C, N, T, C]
  g_ref = sum(hess[i, j, :, i, j, :] for i in range(n) for j in range(t))
  xa = np.concatenate([np.asarray(batch["x"]).reshape(n * t, d), np.ones((n * t, 1))], 1)
  np.testing.assert_allclose(factors.g, g_ref, rtol=1e-12, atol=1e-15)
  np.testing.assert_allclose(factors.a, xa.T @ xa / (n * t), rtol=1e-12)


def test_exact_with_two_loss_tags(x64):
  """Two tags on two heads: the joint exact stack has no cross terms between the tags."""
  params = _models.jnp_mlp_init(3, (3, 5, 6), jnp.float64)
  rng = _models.np_rng(4)
  batch = jax.device_put(
    {"x": rng.standard_normal((1, 3)), "y": np.array([2]), "t": rng.standard_normal((1, 2))}
  )

  def heads(z, b):
    logits, mean = z[:, :4], z[:, 4:]
    kfac_jax.register_softmax_cross_entropy_loss(logits, b["y"])
    kfac_jax.register_normal_predictive_distribution(mean, b["t"], var=VAR)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, b["y"]).mean()
    return ce + jnp.mean(jnp.sum((mean - b["t"]) ** 2 / (2 * VAR), -1))

  loss_fn = lambda p, b: heads(_models.jnp_mlp_apply(p, b["x"]), b)
  z = _models.jnp_mlp_apply(params, batch["x"])
  flat, unravel = ravel_pytree(params)
  jac = np.asarray(
    _models.jit_jacobian(lambda v: _models.jnp_mlp_apply(unravel(v), batch["x"]))(flat)
  )
  jac = jac.reshape(z.size, -1)
  hess = np.asarray(_models.jit_hessian(lambda zz: heads(zz, batch))(z)).reshape(z.size, z.size)
  est, dense = _dense(loss_fn, params, batch, "exact")
  expected = jac.T @ hess @ jac * _models.block_mask(est, params)
  assert np.linalg.norm(dense - expected) / np.linalg.norm(expected) < 1e-10


def test_mode_errors(x64):
  loss_fn, params, batch = _setup("categorical", "linear")
  with pytest.raises(ValueError, match="estimation_mode") as info:
    kfac_jax.CurvatureEstimator(
      kfac_jax.Registration(loss_fn, params, batch, estimation_mode="curvature-prop")
    )
  for mode in ALL_MODES:
    assert repr(mode) in str(info.value)
  with pytest.raises(ValueError, match="choose one of"):
    kfac_jax.value_and_grad(
      registration=kfac_jax.Registration(loss_fn, params, batch, estimation_mode="Exact")
    )
  for mode in ("exact", "exact_GGN"):
    with pytest.raises(ValueError, match="num_samples does not apply; got num_samples=4"):
      kfac_jax.CurvatureEstimator(
        kfac_jax.Registration(loss_fn, params, batch, estimation_mode=mode, num_samples=4)
      )
    with pytest.raises(ValueError, match="num_samples does not apply"):
      kfac_jax.value_and_grad(
        registration=kfac_jax.Registration(
          loss_fn, params, batch, estimation_mode=mode, num_samples=2
        )
      )
    with pytest.raises(ValueError, match="num_samples does not apply"):
      kfac_jax.scale_by_kfac(
        registration=kfac_jax.Registration(
          loss_fn, params, batch, estimation_mode=mode, num_samples=3
        )
      )
  for mode in ("gradients", "curvature_prop", "curvature_prop_GGN"):
    reg = kfac_jax.Registration(loss_fn, params, batch, estimation_mode=mode, check_loss=False)
    est = kfac_jax.CurvatureEstimator(reg)
    state = jax.jit(est.init)(params)  # Jitted: eager ops compile one by one.
    # Raised while the forward pass is traced: under jit, as one program would be compiled.
    with pytest.raises(ValueError, match=f"estimation_mode='{mode}'.*pass `rng`"):
      jax.jit(lambda s: est.update_curvature(s, params, batch, None, ema_decay=0.5))(state)
    with pytest.raises(ValueError, match="pass `rng`"):
      jax.jit(kfac_jax.value_and_grad(registration=reg))(params, batch)
  # The exact modes and "empirical" need no rng; Config's num_samples=1 suits every mode.
  for mode in ("exact", "exact_GGN", "empirical"):
    loss, _, _ = jax.jit(  # One program: eager operations would compile one by one.
      kfac_jax.value_and_grad(
        registration=kfac_jax.Registration(
          loss_fn, params, batch, estimation_mode=mode, check_loss=False
        )
      )
    )(params, batch)
    assert np.isfinite(float(loss))
    tx = kfac_jax.scale_by_kfac(
      registration=kfac_jax.Registration(
        loss_fn, params, batch, estimation_mode=mode, check_loss=False
      )
    )
    updates, _ = jax.jit(  # One program: eager operations would compile one by one.
      lambda p, tx=tx: tx.update(jax.grad(loss_fn)(p, batch), tx.init(p), p, batch=batch)
    )(params)
    assert all(bool(np.all(np.isfinite(u))) for u in jax.tree_util.tree_leaves(updates))


def test_exact_stack_size_is_the_output_size(x64):
  """The exact stack has K = prod(non-batch prediction shape) vectors, whatever the batch."""
  loss_fn, params, batch = _setup("bernoulli", "linear", n=3)
  _, _, stats = jax.eval_shape(  # Shapes suffice: traced, not compiled.
    kfac_jax.value_and_grad(
      registration=kfac_jax.Registration(
        loss_fn, params, batch, estimation_mode="exact", check_loss=False
      )
    ),
    params,
    batch,
  )
  (((x,), g),) = stats.data  # Raw layer input and output gradients (see blocks/_layouts.py).
  assert x.shape == (3, 3) and g.shape == (4, 3, 4)
  _, _, stats = jax.eval_shape(
    kfac_jax.value_and_grad(
      registration=kfac_jax.Registration(
        loss_fn, params, batch, estimation_mode="curvature_prop", num_samples=5, check_loss=False
      )
    ),
    params,
    batch,
    jax.random.key(0),
  )
  assert stats.data[0][1].shape == (5, 3, 4)


@pytest.mark.parametrize("kind", KINDS)
def test_exact_generic_full_block_batch_of_one(x64, kind):
  """A generic full block next to a dense one, exact mode, one example: both blocks are exact.

  (On a batch the generic block sees the batch-summed gradient of each column and keeps cross
  terms between examples, as documented in blocks/_generic.py.)
  """
  _, params, batch = _setup(kind, "linear")
  params = dict(params, gen=jnp.linspace(0.5, 1.5, 4))  # A copy: `_setup`'s is shared.
  apply = lambda p, x: (
    _models.jnp_mlp_apply({"layer0": p["layer0"]}, x)
    * kfac_jax.register_generic(p["gen"], approx="full")
  )
  loss_fn = lambda p, b: _tagged(kind, apply(p, b["x"]), b)
  flat, unravel = ravel_pytree(params)
  z = jax.jit(apply)(params, batch["x"])
  jac = np.asarray(_models.jit_jacobian(lambda v: apply(unravel(v), batch["x"]))(flat)).reshape(
    z.size, -1
  )
  hess = np.asarray(_models.jit_hessian(lambda zz: _tagged(kind, zz, batch))(z)).reshape(z.size, -1)
  est, dense = _dense(loss_fn, params, batch, "exact")
  assert sorted(blk.spec.kind for blk in est.blocks) == ["dense", "generic"]
  expected = jac.T @ hess @ jac * _models.block_mask(est, params)
  assert np.linalg.norm(dense - expected) / np.linalg.norm(expected) < 1e-10


def test_params_stats_are_the_first_order_statistics(x64):
  """Empirical mode: the loss gradient; sampled modes: mean-zero, S=many averages to ~0."""
  loss_fn, params, batch = _setup("categorical", "mlp", n=5)
  batch = dict(batch, w=jax.device_put(np.ones(batch["w"].shape)))  # Unit weights: √w ∇ℓ = w ∇ℓ.
  _, grads, stats = jax.jit(  # One program: eager operations would compile one by one.
    kfac_jax.value_and_grad(
      registration=kfac_jax.Registration(
        loss_fn, params, batch, estimation_mode="empirical", check_loss=False
      ),
      compute_params_stats=True,
    )
  )(params, batch)
  for a, b in zip(jax.tree_util.tree_leaves(stats.params_stats), jax.tree_util.tree_leaves(grads)):
    np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-14)
  _, _, sampled = jax.jit(
    kfac_jax.value_and_grad(
      registration=kfac_jax.Registration(
        loss_fn, params, batch, estimation_mode="gradients", num_samples=4000, check_loss=False
      ),
      compute_params_stats=True,
    )
  )(params, batch, jax.random.key(0))
  scale = max(float(np.max(np.abs(g))) for g in jax.tree_util.tree_leaves(grads))
  for a in jax.tree_util.tree_leaves(sampled.params_stats):
    assert float(np.max(np.abs(a))) < 0.1 * scale  # E_y[∇ log p(y|x)] = 0.
  _, _, plain = jax.eval_shape(  # Shapes suffice: traced, not compiled.
    kfac_jax.value_and_grad(
      registration=kfac_jax.Registration(
        loss_fn, params, batch, estimation_mode="empirical", check_loss=False
      )
    ),
    params,
    batch,
  )
  assert plain.params_stats is None


def test_estimator_offers_params_stats(x64):
  loss_fn, params, batch = _setup("normal", "linear", n=3)
  est = kfac_jax.CurvatureEstimator(
    kfac_jax.Registration(loss_fn, params, batch, estimation_mode="empirical", check_loss=False),
    compute_params_stats=True,
  )
  jax.eval_shape(est.init, params)  # Shapes suffice: traced, not compiled.
  stats = jax.eval_shape(lambda p, b: est.curvature_stats(p, b, None), params, batch)
  assert jax.tree_util.tree_structure(stats.params_stats) == jax.tree_util.tree_structure(params)
