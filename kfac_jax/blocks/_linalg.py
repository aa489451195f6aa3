"""Small, robust linear algebra for symmetric positive (semi-)definite factors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.scipy import linalg as jsl

Array = jax.Array


def symmetrize(m: Array) -> Array:
  return 0.5 * (m + m.T)


def eigh_psd(m: Array) -> tuple[Array, Array]:
  """Eigen-decomposition of a PSD matrix, eigenvalues clipped at zero (round-off negatives)."""
  s, u = jnp.linalg.eigh(symmetrize(m))
  return jnp.maximum(s, 0.0), u


def power_from_eigh(s: Array, u: Array, p: float) -> Array:
  """`U diag(s^p) Uᵀ`, for eigenvalues `s > 0`."""
  return (u * (s ** p)[None, :]) @ u.T


def spd_inverse(m: Array) -> Array:
  """Inverse of a symmetric positive-definite matrix by Cholesky.

  A matrix that is not numerically positive definite gives a non-finite result; the estimator
  then keeps the block's previous inverse (see `CurvatureEstimator.update_inverses`). There is no
  in-graph eigen-decomposition fallback: it would triple compile time for every factor.
  """
  m = symmetrize(m)
  chol = jnp.linalg.cholesky(m)
  return jsl.cho_solve((chol, True), jnp.eye(m.shape[-1], dtype=m.dtype))


def spd_power(m: Array, p: float) -> Array:
  """`m^p` for a symmetric positive-definite `m` (Cholesky for p=-1, eigh otherwise)."""
  if p == -1:
    return spd_inverse(m)
  if p == 1:
    return m
  s, u = jnp.linalg.eigh(symmetrize(m))
  floor = jnp.maximum(jnp.max(jnp.abs(s)), 1.0) * jnp.finfo(m.dtype).eps
  return power_from_eigh(jnp.maximum(s, floor), u, p)


def cholesky(m: Array) -> Array:
  return jnp.linalg.cholesky(symmetrize(m))


def lower_inverse(chol: Array) -> Array:
  eye = jnp.eye(chol.shape[-1], dtype=chol.dtype)
  return jsl.solve_triangular(chol, eye, lower=True)


def pi_adjustment(a: Array, g: Array) -> Array:
  """π = sqrt((tr A / dim A) / (tr G / dim G)), the factored-Tikhonov split (Martens & Grosse).

  Returns 1 when either trace is not positive and finite (e.g. before any statistics).
  """
  ta = jnp.trace(a) / a.shape[-1]
  tg = jnp.trace(g) / g.shape[-1]
  ok = (ta > 0) & (tg > 0) & jnp.isfinite(ta) & jnp.isfinite(tg)
  return jnp.where(ok, jnp.sqrt(jnp.where(ok, ta / jnp.where(ok, tg, 1.0), 1.0)), 1.0)
