"""The factorisations run on size buckets; the answers must equal the unpadded ones."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kfac_jax.blocks import _linalg


def test_bucket_sizes_are_eight_per_octave_never_smaller_and_not_powers_of_two():
  sizes = list(range(1, 4200))
  buckets = [_linalg.bucket_size(n) for n in sizes]
  assert all(n <= b <= 1.125 * n + 8 for n, b in zip(sizes, buckets))
  assert not any(b > 64 and b & (b - 1) == 0 for b in buckets)
  # 784 and 785 share a bucket; so do 1000 and 1001 (the autoencoder's factors).
  assert _linalg.bucket_size(784) == _linalg.bucket_size(785) == 832
  assert _linalg.bucket_size(1000) == _linalg.bucket_size(1001) == 1032
  assert len({_linalg.bucket_size(n) for n in range(1025, 2049)}) == 8


def _spd(n, seed):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(n, n + 3))
  return jax.device_put(x @ x.T / n + 0.1 * np.eye(n))


@pytest.mark.parametrize("n", [5, 17, 33, 100])
def test_bucketed_functions_equal_direct_ones(n, x64):
  m = _spd(n, n)
  assert _linalg.bucket_size(n) != n or n <= 8
  ref_inv = np.linalg.inv(np.asarray(m))

  @jax.jit  # One program: eager ops would each compile on their own.
  def factorisations(m):
    chol = _linalg.cholesky(m)
    return _linalg.spd_inverse(m), _linalg.spd_power(m, -0.5), chol, _linalg.lower_inverse(chol)

  inv, inv_sqrt, chol, chol_inv = factorisations(m)
  np.testing.assert_allclose(inv, ref_inv, rtol=1e-9, atol=1e-11)
  s, u = np.linalg.eigh(np.asarray(m))
  np.testing.assert_allclose(inv_sqrt, (u * s**-0.5) @ u.T, rtol=1e-9, atol=1e-11)
  np.testing.assert_allclose(chol, np.linalg.cholesky(np.asarray(m)), rtol=1e-9, atol=1e-11)
  np.testing.assert_allclose(chol_inv @ chol, np.eye(n), atol=1e-10)
  assert chol.shape == (n, n)


def test_failed_factorisation_is_not_finite():
  m = -jnp.eye(20)
  assert not np.isfinite(np.asarray(_linalg.spd_inverse(m))).all()
  assert not all(np.isfinite(np.asarray(b)).all() for b in _linalg.substitution_form(m)[0])


@pytest.mark.parametrize("n", [1, 5, 9, 33, 100, 301])
def test_substitution_form_solves_like_the_inverse(n, x64):
  """Blocks of the Cholesky factor L: inverted diagonal blocks and the columns below them; the
  block substitution equals m⁻¹ x, also when the blocks do not split n evenly."""
  m = _spd(n, n)
  chol = np.linalg.cholesky(np.asarray(m))
  x = np.random.default_rng(0).normal(size=(n, 3))
  eye = _linalg.substitution_identity(n, jnp.float64)

  @jax.jit  # One program: eager ops would each compile on their own.
  def solves(m, x, eye):
    form = _linalg.substitution_form(m)
    return form, _linalg.substitution_solve(form, x), _linalg.substitution_solve(eye, x)

  (diagonals, panels), got, identity = solves(m, jax.device_put(x), eye)
  bounds = _linalg.substitution_bounds(n)
  assert len(diagonals) == len(bounds) - 1 == len(panels) + 1
  assert len(diagonals) == min(_linalg.SUBSTITUTION_BLOCKS, -(-n // 8))
  for i, (s, e) in enumerate(zip(bounds[:-1], bounds[1:])):
    np.testing.assert_allclose(diagonals[i] @ chol[s:e, s:e], np.eye(e - s), atol=1e-10)
    if i < len(panels):
      np.testing.assert_allclose(panels[i], chol[e:, s:e], atol=1e-12)
  np.testing.assert_allclose(got, np.linalg.solve(np.asarray(m), x), rtol=1e-9, atol=1e-11)
  np.testing.assert_array_equal(identity, x)


@pytest.mark.parametrize("n", [1, 2, 7, 8, 11, 1001])
def test_ordered_sum_and_mean_diag_are_sums_in_a_fixed_order(n):
  rng = np.random.default_rng(n)
  x = rng.normal(size=(3, n)).astype(np.float32)
  got = np.asarray(_linalg.ordered_sum(jax.device_put(x)))
  np.testing.assert_allclose(got, x.astype(np.float64).sum(-1), rtol=1e-5, atol=1e-5)
  # The pairwise tree, written out in numpy float32: the same adds in the same order, so the
  # same bits, whatever fusion or layout XLA chooses around it.
  tree = np.pad(x, [(0, 0), (0, (1 << max(0, (n - 1).bit_length())) - n)])
  while tree.shape[-1] > 1:
    tree = tree[:, : tree.shape[-1] // 2] + tree[:, tree.shape[-1] // 2 :]
  np.testing.assert_array_equal(got, tree[:, 0])
  m = rng.normal(size=(n, n)).astype(np.float32)
  np.testing.assert_array_equal(_linalg.diagonal(jax.device_put(m)), np.diagonal(m))
  np.testing.assert_array_equal(jax.jit(_linalg.diagonal)(jax.device_put(m)), np.diagonal(m))
  with pytest.raises(ValueError, match=re.escape(f"square matrix, got shape (2, {n}, {n})")):
    _linalg.diagonal(jnp.zeros((2, n, n)))
  np.testing.assert_allclose(
    _linalg.mean_diag(jax.device_put(m)), np.trace(m) / n, rtol=1e-5, atol=1e-6
  )
  np.testing.assert_allclose(
    _linalg.mean_diag(jax.device_put(x[0])), x[0].mean(), rtol=1e-5, atol=1e-6
  )


@pytest.mark.parametrize("groups", [1, 3])
@pytest.mark.parametrize("bias", [False, True])
def test_gram_equals_the_rows_outer_products_with_a_ones_column(groups, bias, x64):
  x = np.random.default_rng(groups).normal(size=(7, groups, 4))
  rows = np.concatenate([x, np.ones((7, groups, 1))], -1) if bias else x
  want = np.einsum("rgi,rgj->gij", rows, rows)
  got = _linalg.gram(jax.device_put(x), bias)
  assert got.shape == (groups, 5 if bias else 4, 5 if bias else 4)
  np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
