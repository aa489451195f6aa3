"""Diagonal and full blocks: generic parameters, and the "diagonal"/"full" layer approximations.

Statistics are F = Σ hᵀh / c over the rows of `_layouts.gradient_rows`: for generic parameters
each sample's batch-summed gradient (unbiased for sampled targets, the cross terms between
examples vanishing in expectation), for layers the exact per-example gradients.
"""

from __future__ import annotations

import jax.numpy as jnp

from kfac_jax.blocks import _layouts, _linalg
from kfac_jax.blocks._base import Block, flat, unflat
from kfac_jax.blocks._state import DiagonalCache, DiagonalFactors, FullCache, FullFactors


class DiagonalBlock(Block):
  """F ≈ diag(E[h²] / N). Any power and Cholesky factor is elementwise."""

  serves = frozenset((k, "diagonal") for k in _layouts.PER_EXAMPLE_KINDS)

  @classmethod
  def factor_shapes_for(cls, spec):
    """One vector over the layer's parameters."""
    return ((spec.num_params,),)

  def init_factors(self) -> DiagonalFactors:
    return DiagonalFactors(diag=jnp.zeros(self.factor_shapes[0], self.config.stats_dtype))

  def batch_factors(self, data, batch_size, cache=None) -> DiagonalFactors:
    del cache
    h, c = self.gradient_rows(data, batch_size)
    return DiagonalFactors(diag=jnp.sum(h * h, axis=0) / c)

  def init_cache(self) -> DiagonalCache:
    return DiagonalCache(damping=jnp.zeros((), self.config.inverse_dtype))

  def compute_cache(self, factors, damping) -> DiagonalCache:
    return DiagonalCache(damping=jnp.asarray(damping, self.config.inverse_dtype))

  def multiply_matpower(self, factors, cache, vecs, exp):
    d = factors.diag + cache.damping
    return unflat(d**exp * flat(vecs, d.dtype), vecs)

  def multiply_cholesky(self, factors, cache, vecs, *, transpose, inverse):
    del transpose  # Diagonal: C = Cᵀ.
    d = jnp.sqrt(factors.diag + cache.damping)
    v = flat(vecs, d.dtype)
    return unflat(v / d if inverse else v * d, vecs)

  def multiply_undamped(self, factors, vecs, cache=None):
    del cache
    return unflat(factors.diag * flat(vecs, factors.diag.dtype), vecs)


class FullBlock(Block):
  """F ≈ E[h hᵀ] / N as a dense matrix; damped block F + λ I."""

  serves = frozenset((k, "full") for k in _layouts.PER_EXAMPLE_KINDS)

  @classmethod
  def factor_shapes_for(cls, spec):
    """One matrix over the layer's parameters."""
    return ((spec.num_params, spec.num_params),)

  def init_factors(self) -> FullFactors:
    return FullFactors(f=jnp.zeros(self.factor_shapes[0], self.config.stats_dtype))

  def batch_factors(self, data, batch_size, cache=None) -> FullFactors:
    del cache
    h, c = self.gradient_rows(data, batch_size)
    return FullFactors(f=h.T @ h / c)

  def init_cache(self) -> FullCache:
    config = self.config
    eye = jnp.eye(self.spec.num_params, dtype=config.inverse_dtype)
    powers = tuple(config.stored_power(eye) for _ in config.cached_exps)
    chol, chol_inv = (eye if c else None for c in (config.cholesky, config.cholesky_inverse))
    return FullCache(powers, chol, chol_inv, jnp.zeros((), config.inverse_dtype))

  def compute_cache(self, factors: FullFactors, damping) -> FullCache:
    config = self.config
    damping = jnp.asarray(damping, config.inverse_dtype)
    m = factors.f + damping * jnp.eye(self.spec.num_params, dtype=config.inverse_dtype)
    chol = _linalg.cholesky(m) if config.cholesky or config.cholesky_inverse else None
    inv = _linalg.lower_inverse(chol) if chol is not None and config.cholesky_inverse else None
    powers = tuple(config.stored_power(_linalg.spd_power(m, e)) for e in config.cached_exps)
    return FullCache(powers, chol if config.cholesky else None, inv, damping)

  def multiply_matpower(self, factors, cache, vecs, exp):
    v = flat(vecs, self.config.inverse_dtype)
    if exp == 1:
      out = factors.f @ v + cache.damping * v
    else:
      out = _linalg.matmul(cache.powers[self.config.power_index(exp)], v)
    return unflat(out, vecs)

  def multiply_cholesky(self, factors, cache, vecs, *, transpose, inverse):
    c = self.cholesky_factor(cache.chol_inv if inverse else cache.chol, inverse)
    # With C = L: Cᵀ = Lᵀ; with C = L⁻¹ as the inverse factor, C⁻ᵀ = L⁻ᵀ.
    return unflat((c.T if transpose else c) @ flat(vecs, c.dtype), vecs)

  def multiply_undamped(self, factors, vecs, cache=None):
    del cache
    return unflat(factors.f @ flat(vecs, factors.f.dtype), vecs)
