"""A dense layer shared by two loss terms, as the exact inverse of a sum of two Kronecker products.

A physics-informed network applies each layer to the interior points (and their tangents) and
to the boundary points: its curvature is `F ≈ A₁ ⊗ G₁ + A₂ ⊗ G₂`, each term's factors the
"kron_indep" statistics of its own uses (`_uses`). "kron_terms" inverts that sum exactly (Martens
& Grosse 2015, appendix B): with each term damped by λ/2 in the factored way, let K_A solve
`K_Aᵀ A₁ K_A = I`, `K_Aᵀ A₂ K_A = diag(σ_A)` (likewise K_G); then

    F⁻¹ M = K_A ((K_Aᵀ M K_G) ⊘ (1 + σ_A σ_Gᵀ)) K_Gᵀ      (M the `[in(+1), out]` matrix),

and the factor `C = (A₁ K_A ⊗ G₁ K_G) diag(1 + σ_A ⊗ σ_G)^½` has `C Cᵀ = F` (K⁻ᵀ = A₁ K).
Only the powers −1 and 1, in "factored" damping mode.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from kfac_jax.blocks import _kronecker, _uses
from kfac_jax.blocks._state import KroneckerFactors


class TermsCache(NamedTuple):
  ka: jax.Array  # [n_A, n_A]: generalised eigenvectors
  kg: jax.Array  # [n_G, n_G]
  qa: jax.Array  # A₁ K_A (K⁻ᵀ)
  qg: jax.Array  # G₁ K_G
  d: jax.Array  # [n_A, n_G]: 1 + σ_A σ_Gᵀ
  damping: jax.Array  # []


def _generalised(b: jax.Array, a: jax.Array) -> tuple[jax.Array, jax.Array]:
  """`(K, σ)` with `Kᵀ b K = I` and `Kᵀ a K = diag(σ)`, for b positive definite."""
  chol = jnp.linalg.cholesky(0.5 * (b + b.T))
  eye = jnp.eye(b.shape[0], dtype=b.dtype)
  inv = jax.scipy.linalg.solve_triangular(chol, eye, lower=True)  # L⁻¹
  sigma, u = jnp.linalg.eigh(inv @ (0.5 * (a + a.T)) @ inv.T)
  return inv.T @ u, jnp.maximum(sigma, 0.0)


class KroneckerSumBlock(_kronecker.LayoutBlock):
  """A dense layer whose uses feed two loss tags: `A₁ ⊗ G₁ + A₂ ⊗ G₂`, inverted exactly."""

  serves = frozenset({("dense", "kron_terms")})

  def __init__(self, spec, config):
    self.spec, self.config = spec, config
    _uses.check_factored_powers(spec, config)
    tags = sorted({inf.term for inf in spec.use_infos})
    self.terms = tuple(tags.index(inf.term) for inf in spec.use_infos)  # Each use's term.
    if sorted(set(self.terms)) != [0, 1]:
      raise ValueError(
        f"layer `{spec.name}`: approximation 'kron_terms' needs uses that feed exactly two "
        f"loss tags; its {spec.num_uses} uses feed {len(set(self.terms))}."
      )

  @classmethod
  def factor_shapes_for(cls, spec):
    """Both terms' A and G, stacked: `[2, in(+1), in(+1)]`, `[2, out, out]`."""
    sa, sg = _kronecker.kron_shapes(spec)
    return (2, *sa), (2, *sg)

  def batch_factors(self, data, batch_size, cache=None) -> KroneckerFactors:
    del cache
    parts = []
    for t in (0, 1):
      uses = [i for i, term in enumerate(self.terms) if term == t]
      infos = tuple(self.spec.use_infos[i] for i in uses)
      sub = dataclasses.replace(self.spec, use_infos=infos, num_uses=len(uses), info=infos[0])
      dtype = self.config.accum_dtype
      parts.append(_uses.indep_factors(sub, tuple(data[i] for i in uses), batch_size, dtype))
    return KroneckerFactors(a=jnp.stack([p.a for p in parts]), g=jnp.stack([p.g for p in parts]))

  def init_cache(self) -> TermsCache:
    (sa, sg), dtype = self.factor_shapes, self.config.inverse_dtype
    ea, eg = jnp.eye(sa[-1], dtype=dtype), jnp.eye(sg[-1], dtype=dtype)
    return TermsCache(ea, eg, ea, eg, jnp.ones((sa[-1], sg[-1]), dtype), jnp.zeros((), dtype))

  def _damped(self, factors: KroneckerFactors, damping):
    """Each term's factors damped with λ/2 (factored, its own π or 1)."""
    dtype = self.config.inverse_dtype
    a, g = factors.a.astype(dtype), factors.g.astype(dtype)
    half = 0.5 * jnp.asarray(damping, dtype)
    return [_kronecker.damped_factors(a[t], g[t], half, split=self.config.split) for t in (0, 1)]

  def compute_cache(self, factors: KroneckerFactors, damping) -> TermsCache:
    (a1, g1), (a2, g2) = self._damped(factors, damping)
    ka, sa = _generalised(a1, a2)
    kg, sg = _generalised(g1, g2)
    d = 1.0 + sa[:, None] * sg[None, :]
    return TermsCache(ka, kg, a1 @ ka, g1 @ kg, d, jnp.asarray(damping, self.config.inverse_dtype))

  def multiply_matpower(self, factors, cache: TermsCache, vecs, exp):
    def one(m):
      if exp == 1:
        return sum(a @ m @ g for a, g in self._damped(factors, cache.damping))
      return cache.ka @ ((cache.ka.T @ m @ cache.kg) / cache.d) @ cache.kg.T

    return self.on_matrix(one, vecs)

  def multiply_cholesky(self, factors, cache: TermsCache, vecs, *, transpose, inverse):
    q, p = (cache.qa, cache.qg), (cache.ka, cache.kg)  # C⁻¹ = diag(√d)⁻¹ (K_A ⊗ K_G)ᵀ.
    one = lambda m: _uses.scaled_cholesky(q, p, cache.d, m, transpose, inverse)
    return self.on_matrix(one, vecs)

  def multiply_undamped(self, factors, vecs, cache=None):
    del cache
    dtype = self.config.inverse_dtype
    a, g = factors.a.astype(dtype), factors.g.astype(dtype)
    return self.on_matrix(lambda m: a[0] @ m @ g[0] + a[1] @ m @ g[1], vecs)
