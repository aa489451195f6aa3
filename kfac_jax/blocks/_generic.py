"""Diagonal and full blocks: generic parameters, and the "diagonal"/"full" layer approximations.

Generic layers: statistics come from `h`, the gradient of the sampled per-example losses summed
over the batch (one backward pass, no per-example gradients). For sampled targets and for
curvature propagation the per-example vectors are independent with mean zero, so the cross terms
between examples vanish in expectation and F ≈ h hᵀ / N is unbiased for the Fisher (or GGN) of
the mean loss. For the empirical Fisher and for the exact modes (whose k-th vector is the same
column of the square-root factor for every example, so the cross terms do not vanish) it is exact
only at batch size 1.

Dense, conv and scale-and-shift layers: the per-example gradients are rebuilt exactly from the
layer's recorded inputs and output gradients (see `_layouts.per_example_grads`), so
F = (1/(S N)) Σ_{s,n} J_sn J_snᵀ (or its diagonal) is the exact Fisher block of the mode's
vectors for any batch size.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar

import jax
import jax.numpy as jnp

from kfac_jax.blocks import _layouts, _linalg
from kfac_jax.blocks._base import Block
from kfac_jax.blocks._state import DiagonalCache, DiagonalFactors, FullCache, FullFactors

if TYPE_CHECKING:
  from kfac_jax._specs import Approximation, Kind

Array = jax.Array


def _flat(vecs: Sequence[Array], dtype) -> Array:
  return jnp.concatenate([jnp.ravel(v).astype(dtype) for v in vecs])


def _unflat(flat: Array, like: Sequence[Array]) -> list[Array]:
  out, off = [], 0
  for v in like:
    size = math.prod(v.shape)
    out.append(flat[off : off + size].reshape(v.shape).astype(v.dtype))
    off += size
  return out


def _gradient_rows(spec, data, batch_size: int, dtype) -> tuple[Array, int]:
  """Rows h and a divisor c with F ≈ Σ h hᵀ / c, leaves raveled and concatenated.

  Generic layers: each sample's batch-summed gradient `[samples, n]`, c = samples · N.
  Structured layers (dense, conv, scale-and-shift): per-example gradients `[samples · N, n]`
  rebuilt from the layer's inputs and output gradients, c = samples · N (exact per-example
  Fisher of the sampled or empirical targets); per-row gradients for rows that are not examples
  (`_layouts.gradient_rows`).
  """
  if not _layouts.per_example(spec):  # Generic parameters.
    h = jnp.concatenate([d.reshape(d.shape[0], -1).astype(dtype) for d in data], axis=1)
    return h, h.shape[0] * batch_size
  return _layouts.gradient_rows(spec, data, batch_size, dtype)


class DiagonalBlock(Block):
  """F ≈ diag(E[h²] / N). Any power and Cholesky factor is elementwise."""

  serves: ClassVar[frozenset[tuple[Kind, Approximation]]] = frozenset(
    (k, "diagonal") for k in _layouts.PER_EXAMPLE_KINDS
  )

  @classmethod
  def factor_shapes_for(cls, spec):
    """One vector over the layer's parameters."""
    return ((spec.num_params,),)

  def init_factors(self) -> DiagonalFactors:
    return DiagonalFactors(diag=jnp.zeros(self.factor_shapes[0], self.config.stats_dtype))

  def batch_factors(self, data, batch_size, cache=None) -> DiagonalFactors:
    del cache
    h, c = _gradient_rows(self.spec, data, batch_size, self.config.accum_dtype)
    return DiagonalFactors(diag=jnp.sum(h * h, axis=0) / c)

  def init_cache(self) -> DiagonalCache:
    return DiagonalCache(damping=jnp.zeros((), self.config.inverse_dtype))

  def compute_cache(self, factors, damping) -> DiagonalCache:
    return DiagonalCache(damping=jnp.asarray(damping, self.config.inverse_dtype))

  @staticmethod
  def _damped(factors: DiagonalFactors, cache: DiagonalCache):
    return factors.diag + cache.damping

  def multiply_matpower(self, factors, cache, vecs, exp):
    self.check_exp(exp)
    d = self._damped(factors, cache)
    return _unflat(d**exp * _flat(vecs, d.dtype), vecs)

  def multiply_cholesky(self, factors, cache, vecs, *, transpose, inverse):
    del transpose  # Diagonal: C = Cᵀ.
    d = jnp.sqrt(self._damped(factors, cache))
    v = _flat(vecs, d.dtype)
    return _unflat(v / d if inverse else v * d, vecs)

  def multiply_undamped(self, factors, vecs, cache=None):
    del cache
    return _unflat(factors.diag * _flat(vecs, factors.diag.dtype), vecs)


class FullBlock(Block):
  """F ≈ E[h hᵀ] / N as a dense matrix; damped block F + λ I."""

  serves: ClassVar[frozenset[tuple[Kind, Approximation]]] = frozenset(
    (k, "full") for k in _layouts.PER_EXAMPLE_KINDS
  )

  @classmethod
  def factor_shapes_for(cls, spec):
    """One matrix over the layer's parameters."""
    return ((spec.num_params, spec.num_params),)

  def _n(self) -> int:
    return self.spec.num_params

  def init_factors(self) -> FullFactors:
    return FullFactors(f=jnp.zeros(self.factor_shapes[0], self.config.stats_dtype))

  def batch_factors(self, data, batch_size, cache=None) -> FullFactors:
    del cache
    h, c = _gradient_rows(self.spec, data, batch_size, self.config.accum_dtype)
    return FullFactors(f=h.T @ h / c)

  def init_cache(self) -> FullCache:
    config = self.config
    eye = jnp.eye(self._n(), dtype=config.inverse_dtype)
    return FullCache(
      powers=tuple(config.stored_power(eye) for _ in config.cached_exps),
      chol=eye if config.cholesky else None,
      chol_inv=eye if config.cholesky_inverse else None,
      damping=jnp.zeros((), config.inverse_dtype),
    )

  def compute_cache(self, factors: FullFactors, damping) -> FullCache:
    config = self.config
    damping = jnp.asarray(damping, config.inverse_dtype)
    m = factors.f + damping * jnp.eye(self._n(), dtype=config.inverse_dtype)
    chol = _linalg.cholesky(m) if config.cholesky or config.cholesky_inverse else None
    return FullCache(
      powers=tuple(config.stored_power(_linalg.spd_power(m, e)) for e in config.cached_exps),
      chol=chol if config.cholesky else None,
      chol_inv=_linalg.lower_inverse(chol)
      if chol is not None and config.cholesky_inverse
      else None,
      damping=damping,
    )

  def multiply_matpower(self, factors, cache, vecs, exp):
    self.check_exp(exp)
    v = _flat(vecs, self.config.inverse_dtype)
    if exp == 1:
      out = factors.f @ v + cache.damping * v
    else:
      out = _linalg.matmul(cache.powers[self.config.power_index(exp)], v)
    return _unflat(out, vecs)

  def multiply_cholesky(self, factors, cache, vecs, *, transpose, inverse):
    c = cache.chol_inv if inverse else cache.chol
    if c is None:
      raise ValueError(
        f"block `{self.name}`: Cholesky{' inverse' if inverse else ''} products need "
        f"compute_cholesky{'_inverse' if inverse else ''}=True in the estimator."
      )
    # With C = L: Cᵀ = Lᵀ; with C = L⁻¹ as the inverse factor, C⁻ᵀ = L⁻ᵀ.
    return _unflat((c.T if transpose else c) @ _flat(vecs, c.dtype), vecs)

  def multiply_undamped(self, factors, vecs, cache=None):
    del cache
    return _unflat(factors.f @ _flat(vecs, factors.f.dtype), vecs)
