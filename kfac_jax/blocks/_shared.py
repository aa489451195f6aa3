"""A dense layer applied at the T steps of a recurrence, with correlated steps.

"kron_series_1" / "kron_series_2" (Martens, Ba & Johnson 2018) model the per-step gradients of
T dense uses as a stationary process with Kronecker-factored lag-1 statistics,
A_1 = mean_t x̄_t x̄_{t+1}ᵀ / R and G_1 = Σ_t (1/N) Σ_r g_t g_{t+1}ᵀ · T/(T−1), A and G being
"kron_indep"'s (`_uses`). With the damped factors A_λ, G_λ, the whitened lag-1 factors
A_λ^{-½} sym(A_1) A_λ^{-½} = V_A diag(ψ_A) V_Aᵀ (and G's), K = A_λ^{½} V_A ⊗ G_λ^{½} V_G and
ψ = ψ_A ⊗ ψ_G (clipped to |ψ| ≤ 0.99):

    F ≈ K diag(ζ(ψ)) Kᵀ,   F⁻¹ = K⁻ᵀ diag(1/ζ(ψ)) K⁻¹,

    series_1 (T → ∞):    ζ(ψ) = (1 + ψ) / (1 − ψ)
    series_2 (finite T): ζ(ψ) = (1 + ψ) / (1 − ψ) − 2ψ(1 − ψ^T) / (T (1 − ψ)²)

(ψ = 0 gives "kron_indep"). K is not orthogonal: only the powers −1 and 1, in "factored" damping
mode; Cholesky factors are C = K diag(√ζ).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kfac_jax.blocks import _kronecker, _uses
from kfac_jax.blocks._state import SeriesCache, SeriesFactors

MAX_PSI = 0.99


def _zeta(psi: jax.Array, approx: str, t: int) -> jax.Array:
  z = (1.0 + psi) / (1.0 - psi)
  if approx == "kron_series_2":
    z = z - 2.0 * psi * (1.0 - psi**t) / (t * (1.0 - psi) ** 2)
  return z


def _whiten(f: jax.Array, f1: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(F^{½} V, F^{-½} V, ψ) with F^{-½} sym(F1) F^{-½} = V diag(ψ) Vᵀ (pseudo-inverse root)."""
  s, u = jnp.linalg.eigh(0.5 * (f + f.T))
  s = jnp.maximum(s, 0.0)
  tiny = jnp.max(s) * f.shape[0] * jnp.finfo(f.dtype).eps
  root = (u * jnp.sqrt(s)) @ u.T
  inv_root = (u * jnp.where(s > tiny, 1.0 / jnp.sqrt(jnp.where(s > tiny, s, 1.0)), 0.0)) @ u.T
  w = inv_root @ (0.5 * (f1 + f1.T)) @ inv_root
  psi, v = jnp.linalg.eigh(0.5 * (w + w.T))
  return root @ v, inv_root @ v, psi


class SeriesKroneckerBlock(_kronecker.LayoutBlock):
  """A dense layer shared over T steps with the "kron_series_1" / "kron_series_2" model."""

  serves = frozenset({("dense", "kron_series_1"), ("dense", "kron_series_2")})

  def __init__(self, spec, config):
    self.spec, self.config = spec, config
    _uses.check_factored_powers(spec, config, " (F = K diag(ζ) Kᵀ with K not orthogonal)")
    self.layouts = _uses.use_layouts(spec)
    self.layout = self.layouts[0][0]  # The first use's, for the products' matrix view.

  @classmethod
  def factor_shapes_for(cls, spec):
    """A and G as "kron" (`_kronecker.kron_shapes`); a1 and g1 have the same shapes."""
    return _kronecker.kron_shapes(spec)

  def init_factors(self) -> SeriesFactors:
    (sa, sg), dtype = self.factor_shapes, self.config.stats_dtype
    return SeriesFactors(*(jnp.zeros(s, dtype) for s in (sa, sg, sa, sg)))

  def batch_factors(self, data, batch_size, cache=None) -> SeriesFactors:
    del cache
    dtype = self.config.accum_dtype
    xs, gs = [], []
    for (layout, _), d, inf in zip(self.layouts, data, self.spec.use_infos):
      x, g = layout.rows(d, dtype)
      if self.spec.has_bias:  # 0 for a tangent channel (`DenseInfo.adds_bias`).
        coord = 1.0 if inf.adds_bias else 0.0
        x = jnp.concatenate([x, jnp.full(x.shape[:-1] + (1,), coord, dtype)], axis=-1)
      xs.append(x[:, 0])
      gs.append(g[:, :, 0])
    x, g = jnp.stack(xs), jnp.stack(gs)  # [T, R, in], [T, S, R, out]
    t, r, s = x.shape[0], x.shape[1], g.shape[1]
    a = jnp.einsum("tri,trj->ij", x, x) / (t * r)
    gg = jnp.einsum("tsri,tsrj->ij", g, g) / (s * batch_size)
    a1 = jnp.einsum("tri,trj->ij", x[:-1], x[1:]) / ((t - 1) * r)
    g1 = jnp.einsum("tsri,tsrj->ij", g[:-1], g[1:]) / (s * batch_size) * t / (t - 1)
    return SeriesFactors(a=a, g=gg, a1=a1, g1=g1)

  def compute_cache(self, factors: SeriesFactors, damping) -> SeriesCache:
    """The cache of the damped factors, or of the undamped ones (damping None, stored as 0)."""
    a, g = factors.a, factors.g
    if damping is not None:
      damping = jnp.asarray(damping, self.config.inverse_dtype)
      a, g = _kronecker.damped_factors(a, g, damping, split=self.config.split)
    qa, pa, psi_a = _whiten(a, factors.a1)
    qg, pg, psi_g = _whiten(g, factors.g1)
    psi = jnp.clip(psi_a[:, None] * psi_g[None, :], -MAX_PSI, MAX_PSI)
    zeta = _zeta(psi, self.spec.approx, self.spec.num_uses)
    return SeriesCache(qa, pa, qg, pg, zeta, jnp.zeros((), a.dtype) if damping is None else damping)

  def init_cache(self) -> SeriesCache:
    (sa, sg), dtype = self.factor_shapes, self.config.inverse_dtype
    ea, eg = jnp.eye(sa[0], dtype=dtype), jnp.eye(sg[0], dtype=dtype)
    return SeriesCache(ea, ea, eg, eg, jnp.ones((sa[0], sg[0]), dtype), jnp.zeros((), dtype))

  @staticmethod
  def _apply(c: SeriesCache, m, exp):
    if exp == 1:  # K diag(ζ) Kᵀ
      return c.qa @ ((c.qa.T @ m @ c.qg) * c.zeta) @ c.qg.T
    return c.pa @ ((c.pa.T @ m @ c.pg) / c.zeta) @ c.pg.T

  def multiply_matpower(self, factors, cache, vecs, exp):
    return self.on_matrix(lambda m: self._apply(cache, m, exp), vecs)

  def multiply_cholesky(self, factors, cache, vecs, *, transpose, inverse):
    q, p = (cache.qa, cache.qg), (cache.pa, cache.pg)  # C = K diag(√ζ); K⁻¹ M = P_Aᵀ M P_G.
    one = lambda m: _uses.scaled_cholesky(q, p, cache.zeta, m, transpose, inverse)
    return self.on_matrix(one, vecs)

  def multiply_undamped(self, factors, vecs, cache=None):
    del cache
    return self.on_matrix(lambda m: self._apply(self.compute_cache(factors, None), m, 1), vecs)
