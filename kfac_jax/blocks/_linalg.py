"""Small, robust linear algebra for symmetric positive (semi-)definite factors.

Size buckets. XLA compiles a Cholesky factorisation or triangular solve once per distinct
matrix size, and a model has many factor sizes (the autoencoder has 16, from 30 to 1001), each
a compilation of its own. So the factorisations below
run on the matrix embedded in a slightly larger one of a bucket size, `diag(M, I)`, and slice the
answer: the inverse, any power and the Cholesky factor of `diag(M, I)` are `diag(f(M), I)`
exactly, so the result is unchanged. Buckets are 8 per octave (…, 520, 576, 640, …, 960, 1032,
…), so the padding costs at most (9/8)³ ≈ 1.4x FLOPs on a factorisation, ~1.2x typically.
The blocks of a blocked factor (`_blocked`, k of one size) are factorised with `buckets=False`:
one size needs no bucket, and only a power-of-two size is moved 8 up.
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
  s, u = jnp.linalg.eigh(symmetrize(m))
  return jnp.maximum(s, 0.0), u


def matmul(x: Array, y: Array) -> Array:
  """x @ y; with operands of two float dtypes, both rounded to the narrower one and the product
  accumulated in (and returned as) the wider one: a bfloat16 inverse times a float32 vector
  (`BlockConfig.preconditioner_dtype`) runs as a bfloat16 matmul with float32 accumulation,
  which hardware with native bfloat16 products (e.g. a CPU with AVX512-BF16) runs faster than
  a float32 one.

  The rounded operands and the product pass through `optimization_barrier`s, so that XLA
  cannot fold the transposes around them (layouts, `[out, in]` kernels) into the dot: XLA:CPU
  runs a bfloat16 × bfloat16 → float32 dot only with its operands in canonical order, and
  fails at run time on a transposed one ("Unsupported element type for DotThunk")."""
  if x.dtype == y.dtype:
    return x @ y
  lo, hi = (x.dtype, y.dtype) if x.dtype.itemsize < y.dtype.itemsize else (y.dtype, x.dtype)
  x, y = jax.lax.optimization_barrier((x.astype(lo), y.astype(lo)))
  return jax.lax.optimization_barrier(jnp.matmul(x, y, preferred_element_type=hi))


def power_from_eigh(s: Array, u: Array, p: float) -> Array:
  """`U diag(s^p) Uᵀ`, for eigenvalues `s > 0`."""
  return (u * (s**p)[None, :]) @ u.T


def bucket_size(n: int) -> int:
  """The bucket of an n×n factorisation: eight sizes per octave, never a power of two.

  The smallest k·2^(⌊log2 n⌋ - 3) ≥ n (so at most 12.5% larger), moved 8 past a power of two
  above 64: LAPACK's Cholesky and triangular solves slow down at power-of-two sizes
  (cache-set conflicts of the leading dimension).
  """
  if n <= 8:
    return n
  step = 1 << max(n.bit_length() - 4, 0)
  size = -(-n // step) * step
  if size > 64 and size & (size - 1) == 0:
    size += 8
  return size


def _bucketed(fn, m: Array, buckets: bool = True) -> Array:
  """fn(diag(m, I))[:n, :n], for functions f with f(diag(M, I)) = diag(f(M), f(I)); the size
  is `bucket_size(n)`, or without `buckets` n moved 8 up only if a power of two above 64."""
  n = m.shape[-1]
  b = bucket_size(n) if buckets else n + 8 * (n > 64 and n & (n - 1) == 0)
  if b == n:
    return fn(m)
  pad = jnp.pad(m, ((0, b - n), (0, b - n)))
  pad = pad + jnp.diag(jnp.concatenate([jnp.zeros((n,), m.dtype), jnp.ones((b - n,), m.dtype)]))
  return fn(pad)[:n, :n]


def spd_inverse(m: Array, buckets: bool = True) -> Array:
  """Inverse of a symmetric positive-definite matrix by Cholesky.

  A matrix that is not numerically positive definite gives a non-finite result; the estimator
  then keeps the block's previous inverse (see `CurvatureEstimator.update_inverses`). There is no
  in-graph eigen-decomposition fallback: it would triple compile time for every factor.
  """

  def inv(x):
    chol = jnp.linalg.cholesky(x)
    return jsl.cho_solve((chol, True), jnp.eye(x.shape[-1], dtype=x.dtype))

  return _bucketed(inv, symmetrize(m), buckets)


def spd_power(m: Array, p: float, buckets: bool = True) -> Array:
  """`m^p` for a symmetric positive-definite `m` (Cholesky for p=-1, eigh otherwise)."""
  if p == -1:
    return spd_inverse(m, buckets)
  if p == 1:
    return m

  def power(x):
    s, u = jnp.linalg.eigh(x)
    floor = jnp.maximum(jnp.max(jnp.abs(s)), 1.0) * jnp.finfo(x.dtype).eps
    return power_from_eigh(jnp.maximum(s, floor), u, p)

  return _bucketed(power, symmetrize(m), buckets)


def cholesky(m: Array, buckets: bool = True) -> Array:
  return _bucketed(jnp.linalg.cholesky, symmetrize(m), buckets)


def lower_inverse(chol: Array, buckets: bool = True) -> Array:
  def inv(x):
    return jsl.solve_triangular(x, jnp.eye(x.shape[-1], dtype=x.dtype), lower=True)

  return _bucketed(inv, chol, buckets)


SUBSTITUTION_BLOCKS = 2


def substitution_bounds(n: int) -> list[int]:
  """The block boundaries `[0, ..., n]` of an n×n substitution form: SUBSTITUTION_BLOCKS
  diagonal blocks of n / SUBSTITUTION_BLOCKS rounded up to a multiple of 8 (the last one cut
  at n)."""
  step = -(-n // (8 * SUBSTITUTION_BLOCKS)) * 8
  return list(range(0, n, step)) + [n]


def substitution_form(m: Array) -> tuple[tuple[Array, ...], tuple[Array, ...]]:
  """`(diagonals, panels)` of an SPD `m` for `substitution_solve`: with L its Cholesky factor
  and blocks at `substitution_bounds`, `diagonals[i]` = L_ii⁻¹ and `panels[i]` = the column
  of L below it, `L[e_i:, s_i:e_i]` (one fewer panel than blocks).

  `m⁻¹ x` is then a forward and a backward block substitution of plain matmuls, ~3n²k flops for
  x: [n, k] (a matmul with an explicit inverse: 2n²k), while the refresh skips the explicit
  inverse's two n×n triangular solves: ~7n³/3 flops become the Cholesky's n³/3 and the
  diagonal blocks' inverses, n³/4 for two blocks. No LAPACK call
  happens in the products (on CPU, OpenBLAS threads woken inside the step slowed XLA's own
  work around them), and the blocks are separate arrays, so no product slices (copies) a big
  matrix. A matrix that is not numerically positive definite gives non-finite blocks, as
  `spd_inverse`.
  """
  n = m.shape[-1]
  chol = cholesky(m)
  bounds = substitution_bounds(n)
  # One unbatched triangular solve per block (a batched LAPACK call can deadlock the CPU
  # pool: `_base.batched_factorisations`).
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
  """`m⁻¹ x` for `form = substitution_form(m)` and x: [n, k]: L y = x forward (block i's rows
  from its inverse, then the rows below updated through its panel), then Lᵀ z = y backward
  (block i's rows less its panel's transpose times the rows below, then its inverse)."""
  diagonals, panels = form
  ys = []
  rest = x
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


def gram(x: Array, bias: bool) -> Array:
  """Σ_r x_r x_rᵀ per group for rows `x` [R, groups, n]: [groups, n, n], or [groups, n+1, n+1]
  for the rows `[x_r, 1]` when `bias`.

  One group (every dense layer, every ungrouped conv) is a plain `xᵀx`: XLA's CPU backend runs
  the batched-dot form `einsum("rgi,rgj->gij")` slower, most of all on small factors.
  The bias row and column are the column sums and the row count, assembled around `xᵀx`
  rather than appending a column of ones to x (a copy of all the rows).
  """
  if x.shape[1] == 1:
    x2 = x[:, 0, :]
    m = (x2.T @ x2)[None]
  else:
    m = jnp.einsum("rgi,rgj->gij", x, x)
  if not bias:
    return m
  s = jnp.sum(x, axis=0)[:, :, None]  # [groups, n, 1]
  n = jnp.full((x.shape[1], 1, 1), x.shape[0], m.dtype)
  top = jnp.concatenate([m, s], axis=2)
  bottom = jnp.concatenate([jnp.swapaxes(s, 1, 2), n], axis=2)
  return jnp.concatenate([top, bottom], axis=1)


def ordered_sum(x: Array) -> Array:
  """Σ x over the last axis by a fixed pairwise tree of elementwise adds.

  A `reduce` is free to change its summation order with the layout and fusion XLA picks for
  it, which differs between otherwise identical programs (e.g. one block's inverse computed
  alone vs. inside a `lax.switch` branch on one device of a pmap); the sum of a few hundred
  diagonal entries then differs in the last bit. Elementwise adds are never reassociated, so
  this sum is bit-identical wherever it runs.
  """
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
  """The diagonal of a square matrix (a vector stays as is), as a strided slice of the
  flattened matrix: `jnp.diagonal` lowers to a gather inside a `case` on its offset, which
  XLA:CPU compiles into kernels of their own for every factor size."""
  if f.ndim == 1:
    return f
  if f.ndim != 2 or f.shape[0] != f.shape[1]:
    raise ValueError(f"diagonal: expected a vector or a square matrix, got shape {f.shape}")
  n = f.shape[-1]
  return f.reshape(-1)[:: n + 1]


def pi_adjustment(a: Array, g: Array) -> Array:
  """π = sqrt((tr A / dim A) / (tr G / dim G)), the factored-Tikhonov split (Martens & Grosse).

  Returns 1 when either trace is not positive and finite (e.g. before any statistics).
  """
  return pi_from_traces(mean_diag(a), mean_diag(g))


def pi_from_traces(ta: Array, tg: Array) -> Array:
  """`pi_adjustment` from tr A / dim A and tr G / dim G."""
  ok = (ta > 0) & (tg > 0) & jnp.isfinite(ta) & jnp.isfinite(tg)
  return jnp.where(ok, jnp.sqrt(jnp.where(ok, ta / jnp.where(ok, tg, 1.0), 1.0)), 1.0)
