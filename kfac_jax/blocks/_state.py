"""The typed state of every block kind: one `NamedTuple` for its factors, one for its cache.

The estimator keeps, per block name, the block's factors (the EMA statistics) and its cache (what
`update_inverses` derives from them and the damping λ). Both are the pytrees below; their field
names are the names a checkpoint stores them under (`factors/<block>/a`, `cache/<block>/damping`).
Shapes use `in(+1)` for a kernel's input side with the bias row appended, `out` for its output
side, and a leading `(groups,)` axis for grouped convolutions only. A stack of L layers
(`StackedBlock`) keeps its layer's types with a leading axis L on every array; a block over
concatenated leaves (`ConcatBlock`) keeps its logical layer's.

Every cache has `damping: []`, the λ it was built with (0 before the first inverse update).
Entries the configuration does not ask for (Cholesky factors without `compute_cholesky`,
powers under "eigen" damping) are None: they hold no arrays and are not in the pytree's leaves.
Factors are stored in `BlockConfig.stats_dtype`, caches in `BlockConfig.inverse_dtype`.
"""

from __future__ import annotations

from typing import NamedTuple

import jax

Array = jax.Array

# -- Kronecker blocks: dense (K-FAC), conv (KFC), embedding, shared layers ("kron_indep") --------


class KroneckerFactors(NamedTuple):
  """F ≈ A ⊗ G (see `_kronecker`).

  Attributes:
    a: the input factor A, `[(groups,) in(+1), in(+1)]`; its diagonal `[(groups,) in(+1)]` for
      "kron_in_diag" / "kron_both_diag", and `[vocab]` (id counts / rows) for embeddings.
    g: the output factor G, `[(groups,) out, out]`; its diagonal `[(groups,) out]` for
      "kron_out_diag" / "kron_both_diag".

  A side wider than the layer's `block_size` is kept as its diagonal blocks, `[k, b, b]`
  (`_blocked`), and so is every matrix of its `FactorCache` (eigenvalues `[k, b]`).
  """

  a: Array
  g: Array


class FactorCache(NamedTuple):
  """The cache of one Kronecker factor F (A or G), with F_λ its damped form.

  Matrices have F's shape; for a diagonal F (a vector) every entry is elementwise and has F's
  vector shape.

  Attributes:
    powers: `(F_λ)^e` for each e of `BlockConfig.cached_exps`, in that order ("factored"
      damping; () under "eigen").
    chol: the Cholesky factor L of F_λ (`cholesky=True`, "factored"), else None.
    chol_inv: L⁻¹ (`cholesky_inverse=True`, "factored"), else None.
    subst: `(diagonals, panels)`, F_λ's Cholesky factor L in blocks: the inverses of its
      diagonal blocks and the columns below them (`_linalg.substitution_form`), kept instead
      of the power -1 (whose `powers` entry is then None) where `KroneckerBlock.solves` says
      so; else None.
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


# -- EKFAC --------------------------------------------------------------------------------------


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


# -- diagonal and full blocks (any layer kind, n = the layer's parameter count) --------------------


class DiagonalFactors(NamedTuple):
  """Attributes: `diag: [n]`, the diagonal of F over the raveled, concatenated leaves."""

  diag: Array


class DiagonalCache(NamedTuple):
  """Attributes: `damping: []` (every power of a diagonal is elementwise: nothing is cached)."""

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


# -- "kron_series_1" / "kron_series_2" (a dense layer shared over T steps, see `_shared`) --------


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
