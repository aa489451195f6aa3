"""EKFAC: K-FAC's Kronecker eigenbasis with per-coordinate scalings re-estimated every step.

George, Laurent, Bouthillier, Ballas & Vincent (2018). With the layer's matrix view
`M: [in(+1), out]` (`_layouts`) and the gradient of example n under sampled target s,
`J_sn = Σ_{r ∈ n} x̄_r g_rᵀ`,

    A = (1/R) Σ_r x̄_r x̄_rᵀ = U_A diag(·) U_Aᵀ,   G = (1/N) Σ_r g_r g_rᵀ = U_G diag(·) U_Gᵀ,
    s = (1/(S N)) Σ_{s,n} (U_Aᵀ J_sn U_G)²          (elementwise square, [in(+1), out]),
    F ≈ (U_A ⊗ U_G) diag(vec s) (U_A ⊗ U_G)ᵀ,

so `(F + λ I)^p M = U_A ((U_Aᵀ M U_G) ⊙ (s + λ)^p) U_Gᵀ`. A and G are "kron"'s factors; the
refresh keeps their eigenbases (the cache), and s is computed from each batch in the current
cache's basis (`needs_cache_for_statistics`) and averaged with the same EMA.
"""

from __future__ import annotations

import jax.numpy as jnp

from kfac_jax.blocks import _kronecker, _layouts, _linalg
from kfac_jax.blocks._state import EKFACCache, EKFACFactors


class EKFACBlock(_kronecker.LayoutBlock):
  """EKFAC block of a dense or conv layer (kernel and optional bias)."""

  serves = frozenset({("dense", "ekfac"), ("conv", "ekfac")})
  needs_cache_for_statistics = True

  @classmethod
  def factor_shapes_for(cls, spec):
    """A and G as full matrices, as "kron" (`_kronecker.kron_shapes`)."""
    return _kronecker.kron_shapes(spec)

  def init_factors(self) -> EKFACFactors:
    (sa, sg), dtype = self.factor_shapes, self.config.stats_dtype
    return EKFACFactors(*(jnp.zeros(s, dtype) for s in (sa, sg, sa[:-1] + sg[-1:])))

  def batch_factors(self, data, batch_size, cache: EKFACCache | None = None) -> EKFACFactors:
    """A, G as the Kronecker block; s in the eigenbasis of `cache` (the identity if None)."""
    dtype = self.config.accum_dtype
    x, g = self.layout.rows(data, dtype)  # x: [R, groups, in]; g: [S, R, groups, out]
    rows, samples = x.shape[0], g.shape[0]
    a = _linalg.gram(x, self.spec.has_bias) / rows
    gg = _linalg.gram(g.reshape((-1,) + g.shape[2:]), False) / (samples * batch_size)
    if self.spec.has_bias:
      x = jnp.concatenate([x, jnp.ones(x.shape[:-1] + (1,), dtype)], axis=-1)
    if cache is not None:  # One group: a plain product, faster on CPU than a batched dot.
      basis = lambda r, u: jnp.einsum("...gi,gij->...gj", r, u) if self.grouped else r @ u
      x, g = basis(x, cache.a_evecs.astype(dtype)), basis(g, cache.g_evecs.astype(dtype))
    if rows == batch_size:  # One row per example: J = x̄ gᵀ, so (Uᵀ J U)² = (x̃²)(g̃²)ᵀ.
      x2, g2 = x * x, jnp.sum(g * g, axis=0)
      s = (x2[:, 0].T @ g2[:, 0])[None] if x.shape[1] == 1 else jnp.einsum("rgi,rgo->gio", x2, g2)
    else:
      x, g = _layouts.by_example(self.spec, x, g, batch_size)
      j = jnp.einsum("nlgi,snlgo->sngio", x, g)
      s = jnp.sum(j * j, axis=(0, 1))
    s = s / (samples * batch_size)
    if not self.grouped:
      a, gg, s = a[0], gg[0], s[0]
    return EKFACFactors(a=a, g=gg, s=s)

  def init_cache(self) -> EKFACCache:
    (sa, sg), dtype = self.factor_shapes, self.config.inverse_dtype
    eye = _kronecker.identity
    return EKFACCache(a_evecs=eye(sa, dtype), g_evecs=eye(sg, dtype), damping=jnp.zeros((), dtype))

  def compute_cache(self, factors: EKFACFactors, damping) -> EKFACCache:
    one = lambda a, g: (_linalg.eigh_psd(a)[1], _linalg.eigh_psd(g)[1])
    ua, ug = self.map_groups(one, factors.a, factors.g, factorises=True)
    return EKFACCache(ua, ug, jnp.asarray(damping, self.config.inverse_dtype))

  def _scaled(self, factors, cache, vecs, fn, damped: bool = True):
    """U_A ((U_Aᵀ M U_G) ⊙ fn(s (+ λ))) U_Gᵀ for the matrix view M of `vecs`."""
    dtype = self.config.inverse_dtype
    lam = cache.damping.astype(dtype) if damped else 0.0

    one = lambda ua, ug, s, m: ua @ ((ua.T @ m @ ug) * fn(s.astype(dtype) + lam)) @ ug.T
    return self.on_matrix(one, vecs, cache.a_evecs, cache.g_evecs, factors.s)

  def multiply_matpower(self, factors, cache, vecs, exp):
    return self._scaled(factors, cache, vecs, lambda d: d if exp == 1 else d**exp)

  def multiply_cholesky(self, factors, cache, vecs, *, transpose, inverse):
    del transpose  # The symmetric square root: C = Cᵀ = F_λ^½.
    return self._scaled(factors, cache, vecs, (lambda d: d**-0.5) if inverse else jnp.sqrt)

  def multiply_undamped(self, factors, vecs, cache=None):
    """F · vecs in the basis of `cache` (required: the factors alone do not define F)."""
    if cache is None:
      raise ValueError(
        f"block `{self.name}` (approx='ekfac'): the undamped estimate depends on the eigenbasis "
        "in the cache; pass `cache=` (the estimator's `to_dense` does)."
      )
    return self._scaled(factors, cache, vecs, lambda d: d, damped=False)
