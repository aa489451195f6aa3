"""Curvature of layers applied several times: tied weights, weight sharing, recurrences.

A layer with parameters M used at k places (k uses u = 1..k: the steps of an unrolled scan, the
input and output use of a tied embedding, the same dense or convolution applied twice) has
per-example gradient
`Σ_u Σ_{r ∈ u} x̄_{u,r} g_{u,r}ᵀ`. With rows and uses as in `_kronecker`:

"kron_indep" (Martens, Ba & Johnson 2018, uses treated as independent and homogeneous):

    F ≈ A ⊗ G,   A = (Σ_u Σ_r x̄ x̄ᵀ) / (Σ_u R_u),   G = (1/N) Σ_u Σ_r g gᵀ

(averaged over sampled targets), i.e. A the mean over uses and rows, G the sum over uses of the
single-use output factor. For k = 1 this is exactly the single-use Kronecker block. A shared
convolution takes its rows (input patches) from every use, which may differ in strides, padding
and input size; a grouped one keeps one (A, G) pair per group. When the uses
see the table in different orientations (a tied embedding: lookups `onehot(id) M` and logits
`h Mᵀ`), use u contributes `X_u ⊗ Y_u` in M's own layout (rows of M ⊗ columns of M: for the
lookup X = id counts / R, Y = its G; for the transposed product X = diag of its G, Y = its A);
each term is first rescaled to equal mean diagonals, X_u ← c_u X_u, Y_u ← Y_u / c_u with
c_u = sqrt(mean diag Y_u / mean diag X_u) (which leaves X_u ⊗ Y_u unchanged), then
X = mean_u X_u, Y = Σ_u Y_u. The vocabulary-side factor stays diagonal: memory O(vocab + dim²).

"kron_series_1" / "kron_series_2" (the same paper's temporally correlated options, for T = k
dense uses with equal rows, the steps of a recurrence): the per-step gradient terms are modelled
as a stationary process whose lag-1 statistics are Kronecker factored, A_1 = mean_t of the rows'
x̄_t x̄_{t+1}ᵀ / R and G_1 = Σ_t (1/N) Σ_r g_t g_{t+1}ᵀ · T/(T−1) (scaled like G). With the damped
factors A_λ, G_λ (π-adjusted factored damping, exactly as "kron_indep") and the symmetrised
whitened lag-1 factors A_λ^{-½} sym(A_1) A_λ^{-½} = V_A diag(ψ_A) V_Aᵀ (and the same for G),
K = A_λ^{½} V_A ⊗ G_λ^{½} V_G and ψ = ψ_A ⊗ ψ_G (clipped to |ψ| ≤ 0.99):

    F ≈ K diag(ζ(ψ)) Kᵀ,   F⁻¹ = K⁻ᵀ diag(1/ζ(ψ)) K⁻¹,

    series_1 (T → ∞):    ζ(ψ) = (1 + ψ) / (1 − ψ)
    series_2 (finite T): ζ(ψ) = (1 + ψ) / (1 − ψ) − 2ψ(1 − ψ^T) / (T (1 − ψ)²)

(ζ = (1/T) Σ_{|d|<T} (T − |d|) ψ^{|d|}). With uncorrelated successive uses (A_1 = 0 or G_1 = 0)
ψ = 0, ζ = 1 and both equal "kron_indep". K is not orthogonal, so only the powers −1 and 1 are
defined (other `exps` are refused), and only in "factored" damping mode; Cholesky factors are
C = K diag(√ζ).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kfac_jax import _specs
from kfac_jax.blocks import _kronecker, _layouts, _linalg
from kfac_jax.blocks._base import Block, StackedUses
from kfac_jax.blocks._state import KroneckerFactors, SeriesCache, SeriesFactors

Array = jax.Array
MAX_PSI = 0.99


def use_layouts(spec) -> list[tuple[_layouts.Layout, bool]]:
  """For each use: its layout and whether it sees the parameter matrix transposed."""
  out = []
  for info in spec.use_infos:
    kind = (
      "embedding"
      if isinstance(info, _specs.EmbeddingInfo)
      else "conv"
      if isinstance(info, _specs.ConvInfo)
      else "dense"
    )
    sub = dataclasses.replace(spec, kind=kind, info=info, num_uses=1, use_infos=())
    if kind == "dense" and spec.kind == "embedding":
      sub = dataclasses.replace(
        sub, leaf_indices=spec.leaf_indices[:1], param_shapes=spec.param_shapes[:1]
      )
    transposed = False
    if spec.kind == "embedding" and isinstance(info, _specs.DenseInfo):
      m = _specs.kernel_index_matrix(info, spec.param_shapes[0])
      transposed = not np.array_equal(m, np.arange(m.size).reshape(spec.param_shapes[0]))
    out.append((_layouts.layout_for(sub), transposed))
  return out


def indep_factors(spec, data, batch_size: int, dtype) -> KroneckerFactors:
  """The "kron_indep" statistics of one batch (see the module docstring)."""
  layouts = use_layouts(spec)
  grouped = layouts[0][0].groups > 1
  if isinstance(data, StackedUses):  # T equal uses inside one scan: rows of every step at once.
    layout = layouts[0][0]
    x, g = jax.vmap(lambda xs, gg: layout.rows((xs, gg), dtype), in_axes=(0, 1))(
      data.inputs, data.g
    )  # x: [T, R, groups, in]; g: [T, S, R, groups, out]
    x = x.reshape((-1,) + x.shape[2:])
    g = jnp.moveaxis(g, 0, 1)
    g = g.reshape((g.shape[0], -1) + g.shape[3:])
    a = _linalg.gram(x, spec.has_bias) / x.shape[0]
    g = _linalg.gram(g.reshape((-1,) + g.shape[2:]), False) / (g.shape[0] * batch_size)
    if not grouped:
      a, g = a[0], g[0]
    return KroneckerFactors(a=a, g=g)
  if spec.kind in ("dense", "conv"):  # Per feature group for grouped convolutions.
    rows = [layout.rows(d, dtype) for (layout, _), d in zip(layouts, data)]
    if len({(x.shape[1:], g.shape[0], g.shape[2:]) for x, g in rows}) == 1:
      # Rows of every use in one matrix: one product per factor, however many uses (the T
      # steps of a scan), instead of one per use.
      x = jnp.concatenate([x for x, _ in rows])
      g = jnp.concatenate([g for _, g in rows], axis=1)
      a = _linalg.gram(x, spec.has_bias) / x.shape[0]
      g = _linalg.gram(g.reshape((-1,) + g.shape[2:]), False) / (g.shape[0] * batch_size)
    else:
      a_sum: Any  # 0.0, then Arrays
      g_sum: Any
      a_sum, n_rows, g_sum = 0.0, 0, 0.0
      for x, g in rows:
        a_sum = a_sum + _linalg.gram(x, spec.has_bias)
        n_rows += x.shape[0]
        g_sum = g_sum + _linalg.gram(g.reshape((-1,) + g.shape[2:]), False) / (
          g.shape[0] * batch_size
        )
      a, g = a_sum / n_rows, g_sum
    if not grouped:  # One group: no group axis.
      a, g = a[0], g[0]
    return KroneckerFactors(a=a, g=g)
  # Embedding table [vocab, dim], possibly tied with products by the (transposed) table.
  xs, ys = [], []
  for (layout, transposed), d in zip(layouts, data):
    x, g = layout.rows(d, dtype)
    gg = jnp.einsum("srgi,srgj->ij", g, g) / (g.shape[0] * batch_size)
    if isinstance(layout, _layouts.EmbeddingLayout):
      xs.append(layout.id_counts(x, dtype) / x.shape[0])
      ys.append(gg)
    elif transposed:  # logits = h Mᵀ: rows of M are its outputs.
      xs.append(_linalg.diagonal(gg))
      ys.append(jnp.einsum("rgi,rgj->ij", x, x) / x.shape[0])
    else:  # one-hot-like rows times M.
      xs.append(jnp.einsum("rgi,rgi->i", x, x) / x.shape[0])
      ys.append(gg)
  if any(t for _, t in layouts):
    for u in range(len(xs)):
      tx, ty = _linalg.mean_diag(xs[u]), _linalg.mean_diag(ys[u])
      ok = (tx > 0) & (ty > 0)
      c = jnp.where(ok, jnp.sqrt(jnp.where(ok, ty, 1.0) / jnp.where(ok, tx, 1.0)), 1.0)
      xs[u], ys[u] = xs[u] * c, ys[u] / c
  return KroneckerFactors(a=sum(xs) / len(xs), g=sum(ys))


def _zeta(psi: Array, approx: str, t: int) -> Array:
  z = (1.0 + psi) / (1.0 - psi)
  if approx == "kron_series_2":
    z = z - 2.0 * psi * (1.0 - psi**t) / (t * (1.0 - psi) ** 2)
  return z


def _whiten(f: Array, f1: Array) -> tuple[Array, Array, Array]:
  """(F^{½} V, F^{-½} V, ψ) with F^{-½} sym(F1) F^{-½} = V diag(ψ) Vᵀ (pseudo-inverse root)."""
  s, u = jnp.linalg.eigh(0.5 * (f + f.T))
  s = jnp.maximum(s, 0.0)
  tiny = jnp.max(s) * f.shape[0] * jnp.finfo(f.dtype).eps
  root = (u * jnp.sqrt(s)) @ u.T
  inv_root = (u * jnp.where(s > tiny, 1.0 / jnp.sqrt(jnp.where(s > tiny, s, 1.0)), 0.0)) @ u.T
  w = inv_root @ (0.5 * (f1 + f1.T)) @ inv_root
  psi, v = jnp.linalg.eigh(0.5 * (w + w.T))
  return root @ v, inv_root @ v, psi


class SeriesKroneckerBlock(Block):
  """A dense layer shared over T steps with the "kron_series_1" / "kron_series_2" model."""

  def __init__(self, spec, config):
    self.spec = spec
    self.config = config
    if config.damping_mode != "factored":
      raise ValueError(
        f"layer `{spec.name}`: approximation {spec.approx!r} needs damping_mode='factored', "
        f"got {config.damping_mode!r}."
      )
    bad = [e for e in config.exps if e not in (-1, 1)]
    if bad:
      raise ValueError(
        f"layer `{spec.name}`: approximation {spec.approx!r} defines only the powers -1 and 1 "
        f"(F = K diag(ζ) Kᵀ with K not orthogonal), got exps={config.exps}. Use exps=(-1,), "
        'or approx="kron_indep" for other powers.'
      )
    self.layouts = use_layouts(spec)
    self.layout = self.layouts[0][0]

  @classmethod
  def factor_shapes_for(cls, spec):
    """A and G as "kron" (`_kronecker.kron_shapes`); a1 and g1 have the same shapes."""
    return _kronecker.kron_shapes(spec)

  def init_factors(self) -> SeriesFactors:
    sa, sg = self.factor_shapes
    z = self.config.stats_dtype
    return SeriesFactors(
      a=jnp.zeros(sa, z), g=jnp.zeros(sg, z), a1=jnp.zeros(sa, z), g1=jnp.zeros(sg, z)
    )

  def batch_factors(self, data, batch_size, cache=None) -> SeriesFactors:
    del cache
    dtype = self.config.accum_dtype
    xs, gs = [], []
    for (layout, _), d in zip(self.layouts, data):
      x, g = layout.rows(d, dtype)
      if self.spec.has_bias:
        x = jnp.concatenate([x, jnp.ones(x.shape[:-1] + (1,), dtype)], axis=-1)
      xs.append(x[:, 0])
      gs.append(g[:, :, 0])
    x, g = jnp.stack(xs), jnp.stack(gs)  # [T, R, in], [T, S, R, out]
    t, r, s = x.shape[0], x.shape[1], g.shape[1]
    a = jnp.einsum("tri,trj->ij", x, x) / (t * r)
    gg = jnp.einsum("tsri,tsrj->ij", g, g) / (s * batch_size)
    a1 = jnp.einsum("tri,trj->ij", x[:-1], x[1:]) / ((t - 1) * r)
    g1 = jnp.einsum("tsri,tsrj->ij", g[:-1], g[1:]) / (s * batch_size) * t / (t - 1)
    return SeriesFactors(a=a, g=gg, a1=a1, g1=g1)

  def _parts(self, factors: SeriesFactors, damping) -> SeriesCache:
    """The cache for the damped factors, or (damping None) for the undamped ones, whose
    `damping` field is then 0."""
    if damping is None:
      a, g = factors.a, factors.g
    else:
      a, g = _kronecker.damped_factors(factors.a, factors.g, damping)
    qa, pa, psi_a = _whiten(a, factors.a1)
    qg, pg, psi_g = _whiten(g, factors.g1)
    psi = jnp.clip(psi_a[:, None] * psi_g[None, :], -MAX_PSI, MAX_PSI)
    return SeriesCache(
      qa=qa,
      pa=pa,
      qg=qg,
      pg=pg,
      zeta=_zeta(psi, self.spec.approx, self.spec.num_uses),
      damping=jnp.zeros((), a.dtype) if damping is None else damping,
    )

  def init_cache(self) -> SeriesCache:
    sa, sg = self.factor_shapes
    dtype = self.config.inverse_dtype
    eye_a, eye_g = jnp.eye(sa[0], dtype=dtype), jnp.eye(sg[0], dtype=dtype)
    return SeriesCache(
      qa=eye_a,
      pa=eye_a,
      qg=eye_g,
      pg=eye_g,
      zeta=jnp.ones((sa[0], sg[0]), dtype),
      damping=jnp.zeros((), dtype),
    )

  def compute_cache(self, factors, damping) -> SeriesCache:
    return self._parts(factors, jnp.asarray(damping, self.config.inverse_dtype))

  def _matrix(self, vecs):
    return self.layout.to_matrix(vecs, self.config.inverse_dtype)[0]

  def _back(self, m, vecs):
    out = self.layout.from_matrix(m[None])
    return [o.astype(v.dtype) for o, v in zip(out, vecs)]

  @staticmethod
  def _apply(c: SeriesCache, m, exp):
    if exp == 1:  # K diag(ζ) Kᵀ
      return c.qa @ ((c.qa.T @ m @ c.qg) * c.zeta) @ c.qg.T
    return c.pa @ ((c.pa.T @ m @ c.pg) / c.zeta) @ c.pg.T

  def multiply_matpower(self, factors, cache, vecs, exp):
    self.check_exp(exp)
    return self._back(self._apply(cache, self._matrix(vecs), exp), vecs)

  def multiply_cholesky(self, factors, cache, vecs, *, transpose, inverse):
    m, c = self._matrix(vecs), cache
    root = jnp.sqrt(c.zeta)
    if not inverse:  # C = K diag(√ζ)
      out = (c.qa.T @ m @ c.qg) * root if transpose else c.qa @ (m * root) @ c.qg.T
    else:  # C⁻¹ = diag(1/√ζ) K⁻¹, K⁻¹ M = P_Aᵀ M P_G.
      out = c.pa @ (m / root) @ c.pg.T if transpose else (c.pa.T @ m @ c.pg) / root
    return self._back(out, vecs)

  def multiply_undamped(self, factors, vecs, cache=None):
    del cache
    return self._back(self._apply(self._parts(factors, None), self._matrix(vecs), 1), vecs)
