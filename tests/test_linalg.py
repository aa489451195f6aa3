"""The factorisations run on size buckets; the answers must equal the unpadded ones."""

import jax.numpy as jnp
import numpy as np
import pytest

from kfac_jax.blocks import _linalg


def test_bucket_size_is_four_per_octave_and_never_smaller():
  sizes = list(range(1, 2100))
  buckets = [_linalg.bucket_size(n) for n in sizes]
  assert all(b >= n for n, b in zip(sizes, buckets))
  assert all(b / n <= 1.25 + 1e-12 for n, b in zip(sizes, buckets) if n > 8)
  # 784 and 785 share a bucket; so do 1000 and 1001 (the autoencoder's factors).
  assert _linalg.bucket_size(784) == _linalg.bucket_size(785) == 896
  assert _linalg.bucket_size(1000) == _linalg.bucket_size(1001) == 1024
  assert len({_linalg.bucket_size(n) for n in range(513, 1025)}) == 4


def _spd(n, seed):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(n, n + 3))
  return jnp.asarray(x @ x.T / n + 0.1 * np.eye(n))


@pytest.mark.parametrize("n", [5, 9, 30, 100])
def test_bucketed_functions_equal_direct_ones(n, x64):
  m = _spd(n, n)
  assert _linalg.bucket_size(n) != n or n <= 8
  ref_inv = np.linalg.inv(np.asarray(m))
  np.testing.assert_allclose(_linalg.spd_inverse(m), ref_inv, rtol=1e-9, atol=1e-11)
  s, u = np.linalg.eigh(np.asarray(m))
  np.testing.assert_allclose(_linalg.spd_power(m, -0.5), (u * s ** -0.5) @ u.T,
                             rtol=1e-9, atol=1e-11)
  chol = _linalg.cholesky(m)
  np.testing.assert_allclose(chol, np.linalg.cholesky(np.asarray(m)), rtol=1e-9, atol=1e-11)
  np.testing.assert_allclose(_linalg.lower_inverse(chol) @ chol, np.eye(n), atol=1e-10)
  assert chol.shape == (n, n)


def test_failed_factorisation_is_not_finite():
  m = -jnp.eye(20)
  assert not np.isfinite(np.asarray(_linalg.spd_inverse(m))).all()
