"""The typed state of every block kind: one `NamedTuple` for its factors, one for its cache.

Field names are what a checkpoint stores them under (`factors/<block>/a`). `in(+1)` is a kernel's
input side with the bias row; grouped convolutions add a leading `(groups,)` axis, a stack of L
layers a leading L. `damping` is the λ a cache was built with; entries the configuration does
not ask for are None. Factors are stored in `stats_dtype`, caches in `inverse_dtype`.
"""

from __future__ import annotations

from typing import NamedTuple

import jax


class KroneckerFactors(NamedTuple):
  """F ≈ A ⊗ G; a side wider than `block_size` is kept as its diagonal blocks `[k, b, b]`."""

  a: jax.Array  # [(groups,) in(+1), in(+1)]; a vector for the diagonal variants, [vocab] for tables
  g: jax.Array  # [(groups,) out, out]; a vector `[(groups,) out]` for the diagonal variants


class FactorCache(NamedTuple):
  """The cache of one Kronecker factor F with F_λ damped; elementwise for a vector F."""

  powers: tuple[jax.Array | None, ...] = ()  # F_λ^e per `cached_exps` ("factored"; None: `subst`)
  chol: jax.Array | None = None  # Cholesky factor L of F_λ (`cholesky=True`, "factored")
  chol_inv: jax.Array | None = None  # L⁻¹ (`cholesky_inverse=True`, "factored")
  # `_linalg.substitution_form(F_λ)`, kept instead of the power -1 (`KroneckerBlock.solves`).
  subst: tuple[tuple[jax.Array, ...], tuple[jax.Array, ...]] | None = None
  evals: jax.Array | None = None  # [(groups,) n]: F's eigenvalues clipped at 0 ("eigen")
  evecs: jax.Array | None = None  # F's shape: its eigenvectors as columns ("eigen", a matrix F)


class KroneckerCache(NamedTuple):
  a: FactorCache
  g: FactorCache
  damping: jax.Array  # []


class EKFACFactors(NamedTuple):
  a: jax.Array  # as `KroneckerFactors` (always full matrices)
  g: jax.Array
  s: jax.Array  # [(groups,) in(+1), out]: the scalings in the cache's eigenbasis


class EKFACCache(NamedTuple):
  a_evecs: jax.Array  # [(groups,) in(+1), in(+1)]: A's eigenbasis
  g_evecs: jax.Array  # [(groups,) out, out]: G's eigenbasis
  damping: jax.Array  # []


class DiagonalFactors(NamedTuple):
  diag: jax.Array  # [n]: the diagonal of F over the layer's n raveled parameters


class DiagonalCache(NamedTuple):
  damping: jax.Array  # [] (every power of a diagonal is elementwise)


class FullFactors(NamedTuple):
  f: jax.Array  # [n, n]: F over the raveled, concatenated leaves


class FullCache(NamedTuple):
  powers: tuple[jax.Array, ...]  # [n, n] each: (F + λI)^e per `BlockConfig.cached_exps`
  chol: jax.Array | None  # [n, n]: its Cholesky factor L
  chol_inv: jax.Array | None  # [n, n]: L⁻¹
  damping: jax.Array  # []


class SeriesFactors(NamedTuple):
  a: jax.Array  # [in(+1), in(+1)], as "kron_indep"
  g: jax.Array  # [out, out], as "kron_indep"
  a1: jax.Array  # as `a`: the lag-1 statistics of successive uses
  g1: jax.Array  # as `g`


class SeriesCache(NamedTuple):
  """F_λ = K diag(ζ) Kᵀ with K = Q_A ⊗ Q_G (see `_shared`); K⁻¹ acts through P_Aᵀ, P_G."""

  qa: jax.Array  # [in(+1), in(+1)]: A_λ^{½} V_A
  pa: jax.Array  # A_λ^{-½} V_A
  qg: jax.Array  # [out, out]: G_λ^{½} V_G
  pg: jax.Array  # G_λ^{-½} V_G
  zeta: jax.Array  # [in(+1), out]: ζ(ψ_A ⊗ ψ_G)
  damping: jax.Array  # []
