"""Output-space loss curvature against jax.hessian (float64)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kfac_jax
from kfac_jax import _losses, _scanner


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
  y = {"softmax": jnp.asarray([0, 2, 1]),
       "sigmoid": jnp.asarray(rng.integers(0, 2, size=(3, 4)), jnp.float64),
       "normal": jnp.asarray(rng.normal(size=(3, 4)))}[kind]
  loss, rest = _tagged_loss(kind, y, w)
  hess = jax.hessian(loss)(z).reshape(12, 12)
  reg = _scanner.scan(lambda p, b: loss(p["z"]), {"z": z}, {}, warn=False)
  v = jnp.asarray(rng.normal(size=(3, 4)))
  hv = _losses.output_curvature_product(reg.losses[0], (z, *rest), v)
  np.testing.assert_allclose(hv.ravel(), hess @ v.ravel(), rtol=1e-12, atol=1e-14)
