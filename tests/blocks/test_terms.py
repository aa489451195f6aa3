"""`kfac_jax.blocks._terms`: the exact inverse of a sum of two Kronecker products, tested on the
block with random positive-definite factors (its statistics on a PINN:
suites/test_pinn_curvature.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kfac_jax
from kfac_jax.blocks import _terms
from kfac_jax.blocks._state import KroneckerFactors
from tests import _models

pytestmark = pytest.mark.numerics  # Run again with XLA's optimizations on.


def _spd(seed, n):
  x = _models.np_rng(seed).standard_normal((n, 2 * n))
  return x @ x.T / (2 * n) + 0.1 * np.eye(n)


def test_generalised_eigenvectors_diagonalise_both(x64):
  b, a = _spd(0, 5), _spd(1, 5)
  k, sigma = jax.jit(_terms._generalised)(jnp.asarray(b), jnp.asarray(a))
  k = np.asarray(k)
  np.testing.assert_allclose(k.T @ b @ k, np.eye(5), atol=1e-10)
  np.testing.assert_allclose(k.T @ a @ k, np.diag(sigma), atol=1e-10)
  assert np.all(np.asarray(sigma) >= 0)


def _terms_block(mode):
  """The output layer of a two-term PINN loss (a residual and boundary values), whose uses feed
  two tags: a "kron_terms" block."""
  params = _models.jnp_mlp_init(jax.random.key(0), (2, 4, 1), jnp.float64)
  rng = _models.np_rng(1)
  batch = {"x": jnp.asarray(rng.uniform(size=(6, 2))), "xb": jnp.asarray(rng.uniform(size=(3, 2)))}

  def u(p, x):
    return _models.jnp_mlp_apply(p, x)[:, 0]

  def loss_fn(p, b):
    lap = jax.vmap(lambda x: jnp.trace(jax.jacfwd(jax.jacfwd(lambda y: u(p, y[None])[0]))(x)))
    r = lap(b["x"])[:, None]
    kfac_jax.register_squared_error_loss(r)
    ub = u(p, b["xb"])[:, None]
    kfac_jax.register_squared_error_loss(ub)
    return jnp.mean(r**2) + jnp.mean(ub**2)

  reg = kfac_jax.Registration(loss_fn, params, batch)
  config = kfac_jax.BlockConfig.of(
    damping_mode=mode, inverse_dtype="float64", stats_dtype="float64"
  )
  blocks = [b for b in reg.blocks(config) if isinstance(b, _terms.KroneckerSumBlock)]
  assert blocks, [s.approx for s in reg.layers]
  return blocks[0]


@pytest.mark.filterwarnings("ignore::kfac_jax.UncoveredParametersWarning")
@pytest.mark.parametrize("mode", ["factored", "factored_equal"])
def test_inverse_cholesky_and_product_agree(x64, mode):
  """With each term damped by λ/2, power −1 inverts power 1, and C Cᵀ (the Cholesky product)
  is power 1, C⁻¹ inverting C: the identities the optimizer relies on."""
  block = _terms_block(mode)
  (sa, sg) = block.factor_shapes
  factors = KroneckerFactors(
    a=jnp.stack([_spd(2, sa[-1]), _spd(3, sa[-1])]), g=jnp.stack([_spd(4, sg[-1]), _spd(5, sg[-1])])
  )
  cache = jax.jit(block.compute_cache)(factors, 0.3)
  shapes = [block.spec.param_shapes[i] for i in range(len(block.spec.param_shapes))]
  v = [jnp.asarray(_models.np_rng(6 + i).standard_normal(s)) for i, s in enumerate(shapes)]

  @jax.jit
  def check(v):
    fv = block.multiply_matpower(factors, cache, v, 1)
    back = block.multiply_matpower(factors, cache, fv, -1)
    c = lambda x, **kw: block.multiply_cholesky(factors, cache, x, **kw)  # noqa: E731
    cct = c(c(v, transpose=True, inverse=False), transpose=False, inverse=False)
    round_trip = c(c(v, transpose=False, inverse=False), transpose=False, inverse=True)
    return fv, back, cct, round_trip

  fv, back, cct, round_trip = check(v)
  for a, b, r in zip(v, back, round_trip):
    np.testing.assert_allclose(b, a, rtol=1e-8, atol=1e-10)
    np.testing.assert_allclose(r, a, rtol=1e-8, atol=1e-10)
  for a, b in zip(fv, cct):
    np.testing.assert_allclose(b, a, rtol=1e-8, atol=1e-10)
