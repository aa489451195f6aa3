"""Output-space loss curvature against jax.hessian (float64)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kfac_jax
from kfac_jax import _losses
from kfac_jax.scan import _scanner
from tests import _models

pytestmark = pytest.mark.numerics  # Run again with XLA's optimizations on.


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
  hess = _models.jit_hessian(loss)(z).reshape(12, 12)
  scan = _scanner.scan(lambda p, b: loss(p["z"]), {"z": z}, {}, warn=False)
  v = jnp.asarray(rng.normal(size=(3, 4)))
  hv = jax.jit(lambda z, v: _losses.output_curvature_product(scan.losses[0], (z, *rest), v))(z, v)
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
  """B Bᵀ = ∂²ℓ/∂z² per example (and position): one factor for the Fisher and the GGN modes."""
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
  hess = np.asarray(_models.jit_hessian(nll)(z)).reshape(size, size)
  r0 = jnp.zeros(shape)
  fisher = np.asarray(_models.jit_jacobian(lambda r: _losses.fisher_sqrt_product(spec, z, r))(r0))
  fisher = fisher.reshape(size, size)
  np.testing.assert_allclose(fisher @ fisher.T, hess, rtol=1e-12, atol=1e-14)
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


def _chi2_bound(df: int) -> float:
  """The chi-square quantile at 1 - 1e-6 (Wilson-Hilferty; within a few % for df >= 3)."""
  z = 4.753
  return df * (1 - 2 / (9 * df) + z * np.sqrt(2 / (9 * df))) ** 3


def _chi2(counts, p):
  live = p > 0
  n = counts.sum()
  return float(np.sum((counts[live] - n * p[live]) ** 2 / (n * p[live]))), int(live.sum()) - 1


def test_categorical_samples_follow_the_probabilities(x64):
  """The "gradients" mode's categorical targets: empirical frequencies against p (chi-square,
  fixed seed), never a class without mass. 37 classes in blocks of 8 (the last padded), with
  zeros at both ends and a whole block of zeros; two rows with different distributions."""
  v = 37
  assert _losses.categorical_block_width(v) == 8
  rng = np.random.default_rng(3)
  p = rng.uniform(0.01, 1.0, size=(2, v))
  p[0, [0, 1, 8, 9, 10, 11, 12, 13, 14, 15, 36]] = 0.0  # Block 1 (classes 8-15) empty.
  p[1, [5, 35, 36]] = 0.0
  p[1, 7] = 40.0  # Most of the mass on one class.
  p /= p.sum(-1, keepdims=True)
  z = jnp.log(jnp.asarray(p))  # -inf where p = 0.
  spec = _scanner.LossSpec("categorical", 0.5, False, False, 2, (2, v))
  n = 200_000
  y = np.asarray(jax.jit(lambda z, k: _losses._sample(spec, z, k, n))(z, jax.random.key(0)))
  assert y.shape == (n, 2, v)
  np.testing.assert_array_equal(y.sum(-1), 1.0)
  counts = y.sum(0)
  for row in range(2):
    np.testing.assert_array_equal(counts[row][p[row] == 0], 0)
    stat, df = _chi2(counts[row], p[row])
    assert stat < _chi2_bound(df), (row, stat, df)
  # The test has power: the same counts against a distribution with two classes swapped fail.
  swapped = p[1].copy()
  swapped[[2, 7]] = swapped[[7, 2]]
  assert _chi2(counts[1], swapped)[0] > 100 * _chi2_bound(df)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
def test_categorical_inverse_cdf_edge_cases(dtype, x64):
  """Explicit uniforms: a row with all its mass on one class, zeros at the ends, and `u` at the
  bottom and at (or, by rounding, past) the top of the cumulative sums: the index is clamped to
  a class with mass."""
  v = 300  # Blocks of 32, the last one padded.
  top = np.nextafter(np.asarray(1.0, dtype), 0)  # The largest uniform below 1.
  us = jnp.asarray([[0.0, 0.0], [top, top], [1.0, 1.0], [0.5, top], [top, 0.0]], dtype)[:, None]

  inverse_cdf = jax.jit(_losses.categorical_inverse_cdf)  # One program for every draw.

  def draw(p):
    return np.asarray(inverse_cdf(jnp.asarray(p, dtype), us))[:, 0]

  for c in (0, 31, 32, 150, 299):
    np.testing.assert_array_equal(draw(np.eye(v)[c]), c)
  p = np.zeros(v)
  p[40:260] = np.random.default_rng(4).uniform(size=220)
  got = draw(p)
  assert got[0] == 40 and got[1] == 259 and got[2] == 259, got
  assert np.all(p[got] > 0), got
  # float32 softmax probabilities of spread logits (tiny and rounded-away masses): valid classes.
  z = jnp.asarray(np.random.default_rng(5).normal(scale=8.0, size=(v,)), dtype)
  got = draw(jax.nn.softmax(z))
  assert np.all((got >= 0) & (got < v)) and np.all(np.asarray(jax.nn.softmax(z))[got] > 0), got
