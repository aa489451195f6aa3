"""Output-space loss curvature against jax.hessian (float64)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kfac_jax
from kfac_jax import _losses
from kfac_jax.scan import _scanner


def _tagged_loss(kind, y, w):
  if kind == "softmax":

    def loss(z):
      kfac_jax.register_softmax_cross_entropy_loss(z, y, weight=w)
      nll = -jnp.take_along_axis(jax.nn.log_softmax(z), y[:, None], 1)[:, 0]
      return jnp.mean(w * nll)

    return loss, (y, w)
  if kind == "sigmoid":

    def loss(z):
      kfac_jax.register_sigmoid_cross_entropy_loss(z, y, weight=w[:, None])
      return jnp.mean(jnp.sum(w[:, None] * (jnp.logaddexp(0, z) - y * z), -1))

    return loss, (y, w[:, None])

  def loss(z):
    kfac_jax.register_normal_predictive_distribution(z, y, var=0.3, weight=w[:, None])
    return jnp.mean(jnp.sum(w[:, None] * (z - y) ** 2 / 0.6, -1))

  return loss, (y, w[:, None])


@pytest.mark.parametrize("kind", ["softmax", "sigmoid", "normal"])
def test_output_curvature_product_is_the_loss_hessian(kind, x64):
  rng = np.random.default_rng(0)
  z = jnp.asarray(rng.normal(size=(3, 4)))
  w = jnp.asarray(rng.uniform(size=(3,)))
  y = {
    "softmax": jnp.asarray([0, 2, 1]),
    "sigmoid": jnp.asarray(rng.integers(0, 2, size=(3, 4)), jnp.float64),
    "normal": jnp.asarray(rng.normal(size=(3, 4))),
  }[kind]
  loss, rest = _tagged_loss(kind, y, w)
  hess = jax.hessian(loss)(z).reshape(12, 12)
  scan = _scanner.scan(lambda p, b: loss(p["z"]), {"z": z}, {}, warn=False)
  v = jnp.asarray(rng.normal(size=(3, 4)))
  hv = _losses.output_curvature_product(scan.losses[0], (z, *rest), v)
  np.testing.assert_allclose(hv.ravel(), hess @ v.ravel(), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize(
  "kind, shape",
  [
    ("categorical", (2, 3, 4)),
    ("categorical", (2, 4)),
    ("bernoulli", (2, 3, 4)),
    ("normal", (2, 4)),
  ],
)
def test_square_root_factors_are_the_per_example_hessian(kind, shape, x64):
  """B Bᵀ = C Cᵀ = ∂²ℓ/∂z² per example (and position), and the two factors coincide."""
  rng = np.random.default_rng(1)
  z = jnp.asarray(rng.normal(size=shape))
  spec = _scanner.LossSpec(kind, 0.3, False, False, shape[0], shape)
  y = jnp.asarray(rng.uniform(size=shape))  # The Hessian does not depend on the targets.
  if kind == "categorical":
    y = y / jnp.sum(y, axis=-1, keepdims=True)  # Probabilities (a soft label).

  def nll(zz):  # Σ over the batch and all positions, unweighted.
    if kind == "categorical":
      return -jnp.sum(y * jax.nn.log_softmax(zz))
    if kind == "bernoulli":
      return jnp.sum(jnp.logaddexp(0, zz) - y * zz)
    return jnp.sum((zz - y) ** 2 / 0.6)

  size = z.size
  hess = np.asarray(jax.hessian(nll)(z)).reshape(size, size)
  r0 = jnp.zeros(shape)
  fisher = np.asarray(jax.jacobian(lambda r: _losses.fisher_sqrt_product(spec, z, r))(r0))
  ggn = np.asarray(jax.jacobian(lambda r: _losses.ggn_sqrt_product(spec, z, r))(r0))
  fisher, ggn = fisher.reshape(size, size), ggn.reshape(size, size)
  np.testing.assert_allclose(fisher @ fisher.T, hess, rtol=1e-12, atol=1e-14)
  np.testing.assert_allclose(ggn @ ggn.T, hess, rtol=1e-12, atol=1e-14)
  np.testing.assert_allclose(ggn, fisher, rtol=1e-12, atol=1e-15)
  if kind == "categorical":  # Columns are √p_c (e_c - p), non-zero only at their own position.
    p = np.asarray(jax.nn.softmax(z)).reshape(-1, shape[-1])
    blocks = fisher.reshape(len(p), shape[-1], len(p), shape[-1])
    for i, pi in enumerate(p):
      np.testing.assert_allclose(
        blocks[i, :, i, :],
        (np.eye(len(pi)) - pi[:, None]) * np.sqrt(pi)[None, :],
        rtol=1e-12,
        atol=1e-15,
      )


@pytest.mark.parametrize("kind", ["categorical", "bernoulli", "normal"])
def test_exact_cotangents_average_to_the_weighted_fisher(kind, x64):
  """(1/K) Σ_k v_k v_kᵀ = w F_z per example: the stack is an average (the √K convention)."""
  rng = np.random.default_rng(2)
  shape = (2, 2, 3)
  z = jnp.asarray(rng.normal(size=shape))
  w = jnp.asarray(rng.uniform(0.5, 2.0, size=shape[:-1] if kind == "categorical" else shape))
  spec = _scanner.LossSpec(kind, 0.3, False, True, shape[0], shape)
  for mode in ("exact", "exact_GGN"):
    v = np.asarray(_losses.output_cotangents(spec, (z, w), mode, None, 1))
    assert v.shape == (6,) + shape
    v = v.reshape(6, 2, 6)
    hv = jax.vmap(lambda e: _losses.output_curvature_product(spec, (z, w), e))
    # H_z of the tagged loss is (1/N) w F_z per example: compare with N · H_z.
    basis = jnp.eye(12).reshape(12, *shape)
    h = np.asarray(hv(basis)).reshape(12, 2, 6) * shape[0]
    for n in range(2):
      np.testing.assert_allclose(
        v[:, n].T @ v[:, n] / 6, h[6 * n : 6 * (n + 1), n].T, rtol=1e-12, atol=1e-15
      )
