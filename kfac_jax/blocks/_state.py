"""The typed state of every block kind: one `NamedTuple` for its factors, one for its cache.

Field names are what a checkpoint stores them under (`factors/<block>/a`). Shapes use `in(+1)`
for a kernel's input side with the bias row, `out` for its output side, and a leading
`(groups,)` axis for grouped convolutions only; a stack of L layers (`StackedBlock`) adds a
leading axis L. Every cache has `damping: []`, the λ it was built with; entries the
configuration does not ask for are None (no leaves). Factors are stored in
`BlockConfig.stats_dtype`, caches in `BlockConfig.inverse_dtype`.
"""

from __future__ import annotations

from typing import NamedTuple

import jax

Array = jax.Array


class KroneckerFactors(NamedTuple):
  """F ≈ A ⊗ G (see `_kronecker`).

  Attributes:
    a: the input factor A, `[(groups,) in(+1), in(+1)]`; its diagonal `[(groups,) in(+1)]` for
      "kron_in_diag" / "kron_both_diag", and `[vocab]` (id counts / rows) for embeddings.
    g: the output factor G, `[(groups,) out, out]`; its diagonal `[(groups,) out]` for
      "kron_out_diag" / "kron_both_diag".

  A side wider than the layer's `block_size` is kept as its diagonal blocks `[k, b, b]`
  (`_blocked`), and so is its `FactorCache` (eigenvalues `[k, b]`).
  """

  a: Array
  g: Array


class FactorCache(NamedTuple):
  """The cache of one Kronecker factor F (A or G), with F_λ its damped form; F's shape, or
  elementwise for a diagonal F (a vector).

  Attributes:
    powers: `(F_λ)^e` for each e of `BlockConfig.cached_exps`, in that order ("factored"
      damping; () under "eigen").
    chol: the Cholesky factor L of F_λ (`cholesky=True`, "factored"), else None.
    chol_inv: L⁻¹ (`cholesky_inverse=True`, "factored"), else None.
    subst: `_linalg.substitution_form(F_λ)`, kept instead of the power -1 (whose `powers`
      entry is then None) where `KroneckerBlock.solves` says so; else None.
    evals: F's eigenvalues clipped at 0, `[(groups,) n]` ("eigen" damping), else None.
    evecs: F's eigenvectors as columns, F's shape ("eigen" damping, a matrix F), else None.
  """

  powers: tuple[Array | None, ...] = ()
  chol: Array | None = None
  chol_inv: Array | None = None
  subst: tuple[tuple[Array, ...], tuple[Array, ...]] | None = None
  evals: Array | None = None
  evecs: Array | None = None


class KroneckerCache(NamedTuple):
  """Attributes: `a`, `g`: the two factors' caches; `damping: []`."""

  a: FactorCache
  g: FactorCache
  damping: Array


class EKFACFactors(NamedTuple):
  """Attributes: `a`, `g`: as `KroneckerFactors` (always full matrices); `s`: the scalings in the
  cache's eigenbasis, `[(groups,) in(+1), out]`."""

  a: Array
  g: Array
  s: Array


class EKFACCache(NamedTuple):
  """Attributes: `a_evecs: [(groups,) in(+1), in(+1)]`, `g_evecs: [(groups,) out, out]`: the
  eigenbases of A and G; `damping: []`."""

  a_evecs: Array
  g_evecs: Array
  damping: Array


class DiagonalFactors(NamedTuple):
  """Attributes: `diag: [n]`, the diagonal of F over the layer's n raveled parameters."""

  diag: Array


class DiagonalCache(NamedTuple):
  """Attributes: `damping: []` (every power of a diagonal is elementwise)."""

  damping: Array


class FullFactors(NamedTuple):
  """Attributes: `f: [n, n]`, F over the raveled, concatenated leaves."""

  f: Array


class FullCache(NamedTuple):
  """Attributes (each `[n, n]`, None when not asked for): `powers`: `(F + λI)^e` per
  `BlockConfig.cached_exps`; `chol`: its Cholesky factor L; `chol_inv`: L⁻¹; `damping: []`."""

  powers: tuple[Array, ...]
  chol: Array | None
  chol_inv: Array | None
  damping: Array


class SeriesFactors(NamedTuple):
  """Attributes: `a: [in(+1), in(+1)]`, `g: [out, out]` as "kron_indep"; `a1`, `g1` (same
  shapes): the lag-1 statistics of successive uses."""

  a: Array
  g: Array
  a1: Array
  g1: Array


class SeriesCache(NamedTuple):
  """F_λ = K diag(ζ) Kᵀ with K = Q_A ⊗ Q_G (see `_shared`).

  Attributes:
    qa: `[in(+1), in(+1)]`, A_λ^{½} V_A; pa: A_λ^{-½} V_A (so K⁻¹ acts through P_Aᵀ, P_G).
    qg: `[out, out]`, G_λ^{½} V_G; pg: G_λ^{-½} V_G.
    zeta: `[in(+1), out]`, ζ(ψ_A ⊗ ψ_G).
    damping: `[]`.
  """

  qa: Array
  pa: Array
  qg: Array
  pg: Array
  zeta: Array
  damping: Array
