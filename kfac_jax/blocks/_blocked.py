"""Block-diagonal Kronecker factors: a wide side kept as the diagonal blocks of its factor.

A factor side of n > B entries (B = `LayerSpec.block_size`) is partitioned into k = ⌈n₀/B⌉
contiguous blocks of b = ⌈n/k⌉ entries, n₀ the side without a bias row (which never adds a
block). F is kept as diag(F_11, ..., F_kk), stored `[k, b, b]` with the last block padded by
k·b − n zero rows and columns (Shampoo's partition, applied to A and G): memory O(n·b), a refresh
O(n·b²). The padding's diagonal is set to one before a factorisation (a block stays definite);
products pad their input and slice the output.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from kfac_jax.blocks import _linalg

Partition = tuple[int, int]  # (k blocks, b entries per block)


def partition(n: int, bias: bool, block_size: int | None) -> Partition | None:
  """`(k, b)` for a side of n entries (a bias row last when `bias`), None when kept whole."""
  core = n - (1 if bias else 0)
  if block_size is None or core <= block_size:
    return None
  k = -(-core // block_size)
  return k, -(-n // k)


def gram(x: jax.Array, part: Partition, bias: bool) -> jax.Array:
  """The diagonal blocks `[k, b, b]` of Σ_r x̄_r x̄_rᵀ for rows x: [R, n₀], in O(R·n·b)."""
  k, b = part
  if bias:
    x = jnp.concatenate([x, jnp.ones((x.shape[0], 1), x.dtype)], axis=1)
  xb = jnp.pad(x, ((0, 0), (0, k * b - x.shape[1]))).reshape(x.shape[0], k, b)
  return jnp.einsum("rki,rkj->kij", xb, xb)


def from_full(f: jax.Array, part: Partition) -> jax.Array:
  """The diagonal blocks `[k, b, b]` of a full [n, n] factor, zero padded."""
  k, b = part
  n = f.shape[-1]
  f = jnp.pad(f, ((0, k * b - n), (0, k * b - n)))
  return jnp.stack([f[i * b : (i + 1) * b, i * b : (i + 1) * b] for i in range(k)])


def diagonal(fb: jax.Array, n: int) -> jax.Array:
  """The diagonal `[n]` of the block-diagonal factor (padding dropped)."""
  k, b = fb.shape[0], fb.shape[-1]
  d = fb.reshape(k, b * b)[:, :: b + 1]
  return d.reshape(k * b)[:n]


def padding_eye(part: Partition, n: int, dtype) -> jax.Array:
  """`[k, b, b]`: ones on the padded diagonal entries, zeros elsewhere (a constant)."""
  k, b = part
  mask = (np.arange(k * b) >= n).astype(np.float64).reshape(k, b)
  return jnp.asarray(np.einsum("ki,ij->kij", mask, np.eye(b)), dtype)


def left(p: jax.Array, m: jax.Array) -> jax.Array:
  """P_bd · m for blocks p: [k, b, b] and m: [n, c]."""
  k, b, n = p.shape[0], p.shape[-1], m.shape[0]
  padded = jnp.pad(m, [(0, k * b - n)] + [(0, 0)] * (m.ndim - 1)).reshape((k, b) + m.shape[1:])
  out = _linalg.matmul(p, padded)  # [k, b, c]
  return out.reshape((k * b,) + out.shape[2:])[:n]


def right(m: jax.Array, p: jax.Array) -> jax.Array:
  """m · P_bd for m: [r, n] and blocks p: [k, b, b]."""
  return left(jnp.swapaxes(p, -1, -2), m.T).T
