"""Kronecker-factored blocks: dense (K-FAC), convolution (KFC) and embedding layers.

Every such layer is a product `s = x̄ M` per row (`_layouts`; a bias is M's last row), so with
g = ∂(per-example loss)/∂s over R rows and N examples (and sampled targets)

    F ≈ A ⊗ G,   A = (1/R) Σ_r x̄_r x̄_rᵀ,   G = (1/N) Σ_r g_r g_rᵀ,

and (A ⊗ G) vec(M) = vec(A M G) (row-major). Embeddings keep A as its diagonal (id counts / R),
"kron_in_diag", "kron_out_diag" and "kron_both_diag" keep A, G or both as their diagonals, a
side wider than `spec.block_size` its diagonal blocks (`_blocked`). Over sequences "expand" takes
the N·L positions as rows (Eschenhagen et al. 2023), "reduce" averages x and sums g over each
example's positions first. Damping ("factored"): A_λ = A + π√λ I, G_λ = G + (√λ/π) I, with
π = sqrt((tr A/dim A)/(tr G/dim G)) (1 under "factored_equal"), and the block multiplies by
A_λ^p ⊗ G_λ^p; ("eigen"): exact (A ⊗ G + λ I)^p through the factors' eigenbases.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from kfac_jax import _specs
from kfac_jax.blocks import _blocked, _layouts, _linalg, _uses
from kfac_jax.blocks._base import Block, map_factorisations
from kfac_jax.blocks._state import FactorCache, KroneckerCache, KroneckerFactors

Array = jax.Array


def identity(shape, dtype) -> Array:
  """Ones for a vector factor, else an identity per matrix (and group or block) of `shape`."""
  if len(shape) == 1:
    return jnp.ones(shape, dtype)
  return jnp.broadcast_to(jnp.eye(shape[-1], dtype=dtype), shape)


def _add_identity(f: Array, c) -> Array:
  return f + c if f.ndim == 1 else f + c * jnp.eye(f.shape[-1], dtype=f.dtype)


def _left(a: Array, m: Array) -> Array:
  """a · m for a factor acting on the rows of m."""
  if a.ndim == 3:
    return _blocked.left(a, m)
  return a[:, None] * m if a.ndim == 1 else _linalg.matmul(a, m)


def _matrix_fn(fn, f: Array) -> Array:
  """fn on a matrix factor, or on each block of a blocked one (`buckets=False`: `_linalg`)."""
  return map_factorisations(lambda x: fn(x, buckets=False), f) if f.ndim == 3 else fn(f)


def _power(f: Array, e: float) -> Array:
  return f**e if f.ndim == 1 else _matrix_fn(lambda x, **kw: _linalg.spd_power(x, e, **kw), f)


def _chol(f: Array) -> Array:
  return jnp.sqrt(f) if f.ndim == 1 else _matrix_fn(_linalg.cholesky, f)


def _chol_inverse(c: Array) -> Array:
  return 1.0 / c if c.ndim == 1 else _matrix_fn(_linalg.lower_inverse, c)


def _right(m: Array, g: Array) -> Array:
  """m · g for a factor acting on the columns of m."""
  if g.ndim == 3:
    return _blocked.right(m, g)
  return m * g[None, :] if g.ndim == 1 else _linalg.matmul(m, g)


def _t(f: Array) -> Array:
  return f if f.ndim == 1 else jnp.swapaxes(f, -1, -2)


def _mean_diag(f: Array, n: int) -> Array:
  """tr F / n for a factor of side n: a matrix, a vector, or blocks (their padding is zero)."""
  if f.ndim == 3:
    return _linalg.ordered_sum(_blocked.diagonal(f, n)) / n
  return _linalg.mean_diag(f)


def damped_factors(a: Array, g: Array, damping, sizes=None, split="pi") -> tuple[Array, Array]:
  """`(A + π√λ I, G + (√λ/π) I)`, π from the traces of sides `sizes` (or 1: `split="equal"`)."""
  root = jnp.sqrt(damping)
  if split == "equal":
    return _add_identity(a, root), _add_identity(g, root)
  na, ng = sizes or (a.shape[-1], g.shape[-1])
  pi = _linalg.pi_from_traces(_mean_diag(a, na), _mean_diag(g, ng))
  return _add_identity(a, pi * root), _add_identity(g, root / pi)


def kron_shapes(spec) -> tuple[tuple[int, ...], tuple[int, ...]]:
  """The full shapes of A `[(groups,) in(+1), in(+1)]` and G `[(groups,) out, out]`."""
  lay = _layouts.layout_for(spec)
  a = lay.in_dim + (1 if spec.has_bias else 0)
  lead = (lay.groups,) if lay.groups > 1 else ()
  return lead + (a, a), lead + (lay.out_dim, lay.out_dim)


def _diag_sides(spec) -> tuple[bool, bool]:
  """Whether A and G are kept as vectors (an embedding's one-hot rows make its A diagonal)."""
  diag_a = spec.approx in ("kron_in_diag", "kron_both_diag")
  diag_g = spec.approx in ("kron_out_diag", "kron_both_diag")
  return isinstance(spec.info, _specs.EmbeddingInfo) or diag_a, diag_g


def partitions(spec) -> tuple[_blocked.Partition | None, _blocked.Partition | None]:
  """A's and G's blocks (None: kept whole); diagonal and grouped sides stay whole."""
  size = spec.block_size
  sa, sg = kron_shapes(spec)
  if size is None or len(sa) > 2:
    return None, None
  diag_a, diag_g = _diag_sides(spec)
  pa = None if diag_a else _blocked.partition(sa[-1], spec.has_bias, size)
  pg = None if diag_g else _blocked.partition(sg[-1], False, size)
  return pa, pg


def blocked_note(spec) -> str:
  """What `summary` says of the blocked sides, e.g. "output side 4096 in 4 blocks of 1024"."""
  sides = (s[-1] for s in kron_shapes(spec))
  return "; ".join(
    f"{label} side {n} in {p[0]} blocks of {p[1]}"
    for label, n, p in zip(("input", "output"), sides, partitions(spec))
    if p is not None
  )


class LayoutBlock(Block):
  """A block over a layer's `[in(+1), out]` matrix per feature group (`_layouts`)."""

  @functools.cached_property
  def layout(self):
    return _layouts.layout_for(self.spec)

  @property
  def grouped(self) -> bool:
    """Whether the state has a leading feature-group axis (grouped convolutions)."""
    return self.layout.groups > 1

  def map_groups(self, fn, *args, factorises: bool = False):
    """`fn` on one group's arrays, mapped over the groups (`map_factorisations` to factorise)."""
    if not self.grouped:
      return fn(*args)
    return map_factorisations(fn, *args) if factorises else jax.vmap(fn)(*args)

  def to_matrix(self, vecs) -> Array:
    """The leaves as M (`[groups, in(+1), out]` when grouped) in `inverse_dtype`."""
    m = self.layout.to_matrix(vecs, self.config.inverse_dtype)
    return m if self.grouped else m[0]

  def on_matrix(self, fn, vecs, *args) -> list[Array]:
    """`fn(*args, M)` per group for M = `to_matrix(vecs)`, back as leaves like `vecs`."""
    out = self.map_groups(fn, *args, self.to_matrix(vecs))
    leaves = self.layout.from_matrix(out if self.grouped else out[None])
    return [o.astype(v.dtype) for o, v in zip(leaves, vecs)]

  def init_factors(self) -> Any:
    """Zero `KroneckerFactors` of the block's factor shapes."""
    return KroneckerFactors(*(jnp.zeros(s, self.config.stats_dtype) for s in self.factor_shapes))


class KroneckerBlock(LayoutBlock):
  """A ⊗ G block of a dense, conv or embedding layer (kernel/table and optional bias)."""

  serves = frozenset((lay.kind, a) for lay in _layouts.LAYOUTS for a in lay.kronecker)

  @functools.cached_property
  def solves(self) -> tuple[bool, bool]:
    """Whether A's and G's damped inverse is kept in substitution form (`FactorCache.subst`,
    `BlockConfig.factor_solve`): it costs ~7n³/12 flops to build against the inverse's ~7n³/3,
    and ~1.5x the flops per product with the m columns the factor multiplies, so "auto" keeps
    it for n ≥ 256 and m ≤ n/8 (from the shapes only: one state structure on every backend)."""
    config = self.config
    solve = config.factor_solve != "never" and config.factored and -1.0 in config.cached_exps
    if not solve or self.grouped or self.vmapped:
      return False, False
    (na, ng), (da, dg), (pa, pg) = self.sides, _diag_sides(self.spec), partitions(self.spec)

    def side(n: int, partner: int, whole: bool) -> bool:  # Vectors and blocks: inverses.
      return whole and (config.factor_solve == "always" or n >= max(256, 8 * partner))

    return side(na, ng, not da and pa is None), side(ng, na, not dg and pg is None)

  @property
  def sides(self) -> tuple[int, int]:
    """The sides (n_A, n_G) of the full factors (`kron_shapes`)."""
    sa, sg = kron_shapes(self.spec)
    return sa[-1], sg[-1]

  def group_key(self) -> tuple:
    return (type(self).__name__, self.factor_shapes, self.spec.approx, partitions(self.spec))

  @classmethod
  def factor_shapes_for(cls, spec):
    """`kron_shapes(spec)`, a diagonal side a vector, a blocked side `[k, b, b]`."""
    sa, sg = kron_shapes(spec)
    (pa, pg), (diag_a, diag_g) = partitions(spec), _diag_sides(spec)
    a = sa[:-1] if diag_a else (pa[0], pa[1], pa[1]) if pa else sa
    g = sg[:-1] if diag_g else (pg[0], pg[1], pg[1]) if pg else sg
    return a, g

  def accepts_stacked_uses(self) -> bool:
    spec, kinds = self.spec, (_specs.DenseInfo, _specs.ConvInfo)
    equal = all(inf == spec.use_infos[0] for inf in spec.use_infos)
    return spec.num_uses > 1 and isinstance(spec.info, kinds) and equal

  def batch_factors(self, data, batch_size, cache=None) -> KroneckerFactors:
    del cache  # The statistics do not depend on the inverses.
    dtype = self.config.accum_dtype
    (pa, pg), (diag_a, diag_g) = partitions(self.spec), _diag_sides(self.spec)
    if self.spec.num_uses > 1:
      f = _uses.indep_factors(self.spec, data, batch_size, dtype)
      return KroneckerFactors(
        a=f.a if pa is None else _blocked.from_full(f.a, pa),
        g=f.g if pg is None else _blocked.from_full(f.g, pg),
      )
    x, g = self.layout.rows(data, dtype)
    if self.spec.approx == "reduce":  # One row per example: x averaged, g summed over positions.
      x, g = _layouts.by_example(self.spec, x, g, batch_size)
      x, g = x.mean(axis=1), g.sum(axis=2)
    if isinstance(self.layout, _layouts.EmbeddingLayout):
      a = self.layout.id_counts(x, dtype)[None] / x.shape[0]
    elif self.spec.approx == "kron_sua":
      a = self.layout.sua_input_factor(data, dtype, self.spec.has_bias)
      a = a if pa is None else _blocked.from_full(a[0], pa)[None]
    elif diag_a:
      if self.spec.has_bias:
        x = jnp.concatenate([x, jnp.ones(x.shape[:-1] + (1,), dtype)], axis=-1)
      a = jnp.einsum("rgi,rgi->gi", x, x) / x.shape[0]
    elif pa is not None:  # One group: blocks of [x, 1] [x, 1]ᵀ, never the full matrix.
      a = _blocked.gram(x[:, 0], pa, self.spec.has_bias)[None] / x.shape[0]
    else:
      a = _linalg.gram(x, self.spec.has_bias) / x.shape[0]
    n = g.shape[0] * batch_size
    if diag_g:
      gg = jnp.einsum("srgi,srgi->gi", g, g) / n
    elif pg is not None:
      gg = _blocked.gram(g.reshape(-1, g.shape[-1]), pg, False)[None] / n
    else:
      gg = _linalg.gram(g.reshape((-1,) + g.shape[2:]), False) / n
    if not self.grouped:
      a, gg = a[0], gg[0]
    return KroneckerFactors(a=a, g=gg)

  def init_cache(self) -> KroneckerCache:
    config, dtype = self.config, self.config.inverse_dtype

    def side(shape, diag, solve):
      if config.damping_mode == "eigen":  # Eigenvalues ones; a diagonal factor is its own basis.
        evals = jnp.ones(shape if diag else shape[:-1], dtype)
        return FactorCache(evals=evals, evecs=None if diag else identity(shape, dtype))
      eye = jnp.ones(shape, dtype) if diag else identity(shape, dtype)
      power = eye if diag else config.stored_power(eye)
      return FactorCache(
        powers=tuple(None if solve and e == -1 else power for e in config.cached_exps),
        chol=eye if config.cholesky else None,
        chol_inv=eye if config.cholesky_inverse else None,
        subst=_linalg.substitution_identity(shape[-1], dtype) if solve else None,
      )

    a, g = (side(*args) for args in zip(self.factor_shapes, _diag_sides(self.spec), self.solves))
    return KroneckerCache(a=a, g=g, damping=jnp.zeros((), dtype))

  def compute_cache(self, factors: KroneckerFactors, damping) -> KroneckerCache:
    config = self.config
    damping = jnp.asarray(damping, config.inverse_dtype)
    solve_a, solve_g = self.solves
    pads = [
      None if p is None else _blocked.padding_eye(p, n, config.inverse_dtype)
      for p, n in zip(partitions(self.spec), self.sides)
    ]

    def side(m, solve, pad):  # One group's factor, damped ("factored") or not ("eigen").
      if config.damping_mode == "eigen":
        if m.ndim == 1:
          return FactorCache(evals=jnp.maximum(m, 0.0))
        evals, evecs = (
          map_factorisations(_linalg.eigh_psd, m) if m.ndim == 3 else _linalg.eigh_psd(m)
        )
        return FactorCache(evals=evals, evecs=evecs)
      if pad is not None:  # The padding of a blocked factor: ones on the diagonal (`_blocked`).
        m = m + pad
      chol = _chol(m) if config.cholesky or config.cholesky_inverse else None
      return FactorCache(
        powers=tuple(
          None if solve and e == -1 else config.stored_power(_power(m, e))
          for e in config.cached_exps
        ),
        chol=chol if config.cholesky else None,
        chol_inv=_chol_inverse(chol) if chol is not None and config.cholesky_inverse else None,
        subst=_linalg.substitution_form(m) if solve else None,
      )

    def one(a, g):
      if config.factored:
        a, g = damped_factors(a, g, damping, self.sides, config.split)
      return side(a, solve_a, pads[0]), side(g, solve_g, pads[1])

    ca, cg = self.map_groups(one, factors.a, factors.g, factorises=True)
    return KroneckerCache(a=ca, g=cg, damping=damping)

  @staticmethod
  def _eigen_scaled(ca: FactorCache, cg: FactorCache, damping, m, fn):
    """U_a ((U_aᵀ M U_g) ⊙ fn(s_a s_gᵀ + λ)) U_gᵀ for one group (U = I for a diagonal factor)."""
    ua, ug = ca.evecs, cg.evecs
    na, ng = m.shape
    # A blocked side works on its padded coordinates throughout: its eigenbasis mixes them.
    pa, pg = (
      n if u is None or u.ndim < 3 else u.shape[0] * u.shape[-1] for u, n in ((ua, na), (ug, ng))
    )
    m = jnp.pad(m, ((0, pa - na), (0, pg - ng)))
    assert ca.evals is not None and cg.evals is not None  # the eigen damping mode's cache
    sigma = ca.evals.reshape(-1)[:, None] * cg.evals.reshape(-1)[None, :] + damping
    inner = m if ua is None else _left(_t(ua), m)
    inner = inner if ug is None else _right(inner, ug)
    out = inner * fn(sigma)
    out = out if ua is None else _left(ua, out)
    out = out if ug is None else _right(out, _t(ug))
    return out[:na, :ng]

  def multiply_matpower(self, factors, cache, vecs, exp):
    damping, eigen = cache.damping, self.config.damping_mode == "eigen"

    def one(a, g, ca, cg, m):
      if exp == 1:
        if eigen:
          return _right(_left(a, m), g) + damping * m
        a_d, g_d = damped_factors(a, g, damping, self.sides, self.config.split)
        return _right(_left(a_d, m), g_d)
      if eigen:
        return self._eigen_scaled(ca, cg, damping, m, lambda s: s**exp)
      # A_λ^e · m · G_λ^e; a factor in substitution form (power None, `solves`) is solved.
      k = self.config.power_index(exp)
      pa, pg = ca.powers[k], cg.powers[k]
      m = _left(pa, m) if pa is not None else _linalg.substitution_solve(ca.subst, m)
      return _right(m, pg) if pg is not None else _linalg.substitution_solve(cg.subst, m.T).T

    return self.on_matrix(one, vecs, factors.a, factors.g, cache.a, cache.g)

  def multiply_cholesky(self, factors, cache, vecs, *, transpose, inverse):
    if self.config.damping_mode == "eigen":  # The symmetric root C = Cᵀ = (A ⊗ G + λ I)^½.
      fn = (lambda s: s**-0.5) if inverse else jnp.sqrt
      scaled = lambda ca, cg, m: self._eigen_scaled(ca, cg, cache.damping, m, fn)
      return self.on_matrix(scaled, vecs, cache.a, cache.g)
    la, lg = (cache.a.chol_inv, cache.g.chol_inv) if inverse else (cache.a.chol, cache.g.chol)
    self.cholesky_factor(la, inverse)

    def one(la, lg, m):  # C = La ⊗ Lg acts as M ↦ La M Lgᵀ; Cᵀ as M ↦ Laᵀ M Lg.
      return _right(_left(_t(la), m), lg) if transpose else _right(_left(la, m), _t(lg))

    return self.on_matrix(one, vecs, la, lg)

  def multiply_undamped(self, factors, vecs, cache=None):
    del cache
    return self.on_matrix(lambda a, g, m: _right(_left(a, m), g), vecs, factors.a, factors.g)
