"""Small, robust linear algebra for symmetric positive (semi-)definite factors.

XLA compiles a factorisation once per matrix size, so the factorisations run on `diag(M, I)` of
a bucket size (8 per octave, at most (9/8)³ ≈ 1.4x the flops) and slice the answer, exact since
f(diag(M, I)) = diag(f(M), I); the blocks of a blocked factor (one size) use `buckets=False`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.scipy import linalg as jsl

Array = jax.Array


def symmetrize(m: Array) -> Array:
  return 0.5 * (m + m.T)


def eigh_psd(m: Array) -> tuple[Array, Array]:
  """Eigen-decomposition of a PSD matrix, eigenvalues clipped at zero (round-off negatives)."""
  s, u = jnp.linalg.eigh(symmetrize(m), symmetrize_input=False)
  return jnp.maximum(s, 0.0), u


def matmul(x: Array, y: Array) -> Array:
  """x @ y; with operands of two float dtypes, both rounded to the narrower one and the product
  accumulated in the wider one (`optimization_barrier`s keep transposes out of the dot, which
  XLA:CPU runs in mixed precision only with canonically ordered operands)."""
  if x.dtype == y.dtype:
    return x @ y
  lo, hi = (x.dtype, y.dtype) if x.dtype.itemsize < y.dtype.itemsize else (y.dtype, x.dtype)
  x, y = jax.lax.optimization_barrier((x.astype(lo), y.astype(lo)))
  return jax.lax.optimization_barrier(jnp.matmul(x, y, preferred_element_type=hi))


def bucket_size(n: int) -> int:
  """The bucket of an n×n factorisation: the smallest k·2^(⌊log2 n⌋ - 3) ≥ n, moved 8 past a
  power of two above 64 (where LAPACK slows down from cache-set conflicts)."""
  if n <= 8:
    return n
  step = 1 << max(n.bit_length() - 4, 0)
  size = -(-n // step) * step
  if size > 64 and size & (size - 1) == 0:
    size += 8
  return size


def _bucketed(fn, m: Array, buckets: bool = True) -> Array:
  """fn(diag(m, I))[:n, :n] at `bucket_size(n)` (without `buckets`: past powers of two)."""
  n = m.shape[-1]
  b = bucket_size(n) if buckets else n + 8 * (n > 64 and n & (n - 1) == 0)
  if b == n:
    return fn(m)
  pad = jnp.pad(m, ((0, b - n), (0, b - n)))
  pad = pad + jnp.diag(jnp.concatenate([jnp.zeros((n,), m.dtype), jnp.ones((b - n,), m.dtype)]))
  return fn(pad)[:n, :n]


def spd_inverse(m: Array, buckets: bool = True) -> Array:
  """Inverse of a symmetric positive-definite matrix by Cholesky; one that is not numerically
  positive definite gives a non-finite result (the estimator then keeps the previous one)."""

  def inv(x):
    chol = jax.lax.linalg.cholesky(x, symmetrize_input=False)  # Symmetrized below.
    return jsl.cho_solve((chol, True), jnp.eye(x.shape[-1], dtype=x.dtype))

  return _bucketed(inv, symmetrize(m), buckets)


def spd_power(m: Array, p: float, buckets: bool = True) -> Array:
  """`m^p` for a symmetric positive-definite `m` (Cholesky for p=-1, eigh otherwise)."""
  if p == -1:
    return spd_inverse(m, buckets)
  if p == 1:
    return m

  def power(x):
    s, u = jnp.linalg.eigh(x, symmetrize_input=False)  # Symmetrized below.
    floor = jnp.maximum(jnp.max(jnp.abs(s)), 1.0) * jnp.finfo(x.dtype).eps
    return (u * (jnp.maximum(s, floor) ** p)[None, :]) @ u.T

  return _bucketed(power, symmetrize(m), buckets)


def cholesky(m: Array, buckets: bool = True) -> Array:
  chol = lambda x: jax.lax.linalg.cholesky(x, symmetrize_input=False)
  return _bucketed(chol, symmetrize(m), buckets)


def lower_inverse(chol: Array, buckets: bool = True) -> Array:
  inv = lambda x: jsl.solve_triangular(x, jnp.eye(x.shape[-1], dtype=x.dtype), lower=True)
  return _bucketed(inv, chol, buckets)


SUBSTITUTION_BLOCKS = 2


def substitution_bounds(n: int) -> list[int]:
  """The block boundaries `[0, ..., n]`: SUBSTITUTION_BLOCKS blocks of n / SUBSTITUTION_BLOCKS
  rounded up to a multiple of 8 (the last one cut at n)."""
  step = -(-n // (8 * SUBSTITUTION_BLOCKS)) * 8
  return list(range(0, n, step)) + [n]


def substitution_form(m: Array) -> tuple[tuple[Array, ...], tuple[Array, ...]]:
  """`(diagonals, panels)` of an SPD `m` for `substitution_solve`: with L its Cholesky factor and
  blocks at `substitution_bounds`, `diagonals[i]` = L_ii⁻¹ and `panels[i]` = the column of L below
  it, `L[e_i:, s_i:e_i]`. `m⁻¹ x` is then two block substitutions of plain matmuls (~3n²k flops
  for x: [n, k]). A matrix not numerically positive definite gives non-finite blocks."""
  n = m.shape[-1]
  chol = cholesky(m)
  bounds = substitution_bounds(n)
  # One unbatched solve per block (`_base.batched_factorisations`).
  diagonals = tuple(
    jsl.solve_triangular(chol[s:e, s:e], jnp.eye(e - s, dtype=m.dtype), lower=True)
    for s, e in zip(bounds[:-1], bounds[1:])
  )
  panels = tuple(chol[e:, s:e] for s, e in zip(bounds[:-2], bounds[1:-1]))
  return diagonals, panels


def substitution_identity(n: int, dtype) -> tuple[tuple[Array, ...], tuple[Array, ...]]:
  """The substitution form of the n×n identity (its own Cholesky factor)."""
  bounds = substitution_bounds(n)
  diagonals = tuple(jnp.eye(e - s, dtype=dtype) for s, e in zip(bounds[:-1], bounds[1:]))
  panels = tuple(jnp.zeros((n - e, e - s), dtype) for s, e in zip(bounds[:-2], bounds[1:-1]))
  return diagonals, panels


def substitution_solve(form: tuple[tuple[Array, ...], tuple[Array, ...]], x: Array) -> Array:
  """`m⁻¹ x` for `form = substitution_form(m)`: L y = x forward, then Lᵀ z = y backward."""
  diagonals, panels = form
  ys, rest = [], x
  for i, d in enumerate(diagonals):
    size = d.shape[0]
    y = d @ rest[:size]
    ys.append(y)
    rest = rest[size:]
    if i < len(panels):
      rest = rest - panels[i] @ y
  z = diagonals[-1].T @ ys[-1]
  for i in reversed(range(len(panels))):
    zi = diagonals[i].T @ (ys[i] - panels[i].T @ z)
    z = jnp.concatenate([zi, z], axis=0)
  return z


def gram(x: Array, bias: bool, coord: float = 1.0) -> Array:
  """Σ_r x̄_r x̄_rᵀ per group for rows `x: [R, groups, n]`, x̄_r = `[x_r, coord]` with `bias`, built
  around `xᵀx` without copying rows; one group as a plain `xᵀx` (faster on XLA:CPU)."""
  if x.shape[1] == 1:
    x2 = x[:, 0, :]
    m = (x2.T @ x2)[None]
  else:
    m = jnp.einsum("rgi,rgj->gij", x, x)
  if not bias:
    return m
  s = coord * jnp.sum(x, axis=0)[:, :, None]  # [groups, n, 1]
  n = jnp.full((x.shape[1], 1, 1), coord * coord * x.shape[0], m.dtype)
  top = jnp.concatenate([m, s], axis=2)
  bottom = jnp.concatenate([jnp.swapaxes(s, 1, 2), n], axis=2)
  return jnp.concatenate([top, bottom], axis=1)


def ordered_sum(x: Array) -> Array:
  """Σ x over the last axis by a fixed pairwise tree of elementwise adds: bit-identical
  wherever it runs (a `reduce`'s order changes with XLA's fusion, e.g. inside a `lax.switch`)."""
  n = x.shape[-1]
  size = 1 << max(0, (n - 1).bit_length())
  x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, size - n)])
  while x.shape[-1] > 1:
    half = x.shape[-1] // 2
    x = x[..., :half] + x[..., half:]
  return x[..., 0]


def mean_diag(f: Array) -> Array:
  """tr F / dim F for a dense factor, mean(F) for a diagonal one (a vector), in a fixed order."""
  return ordered_sum(diagonal(f)) / f.shape[-1]


def diagonal(f: Array) -> Array:
  """The diagonal of a square matrix as a strided slice (a vector stays as it is)."""
  if f.ndim == 1:
    return f
  if f.ndim != 2 or f.shape[0] != f.shape[1]:
    raise ValueError(f"diagonal: expected a vector or a square matrix, got shape {f.shape}")
  return f.reshape(-1)[:: f.shape[-1] + 1]


def pi_from_traces(ta: Array, tg: Array) -> Array:
  """π = sqrt(ta / tg) for ta = tr A / dim A and tg = tr G / dim G, the factored-Tikhonov split
  (Martens & Grosse); 1 when either is not positive and finite (e.g. before any statistics)."""
  ok = (ta > 0) & (tg > 0) & jnp.isfinite(ta) & jnp.isfinite(tg)
  return jnp.where(ok, jnp.sqrt(jnp.where(ok, ta / jnp.where(ok, tg, 1.0), 1.0)), 1.0)
