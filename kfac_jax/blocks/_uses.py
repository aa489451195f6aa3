"""Statistics of a layer applied several times, as independent uses ("kron_indep").

A layer with parameters M used at k places (the steps of a scan, a tied embedding's lookup and
logits, the same dense or conv applied twice) has per-example gradient
`Σ_u Σ_{r ∈ u} x̄_{u,r} g_{u,r}ᵀ`. "kron_indep" (Martens, Ba & Johnson 2018) treats the uses as
independent and homogeneous:

    F ≈ A ⊗ G,   A = (Σ_u Σ_r x̄ x̄ᵀ) / (Σ_u R_u),   G = (1/N) Σ_u Σ_r g gᵀ,

the single-use block for k = 1. A use that does not add the bias (a forward-mode tangent
channel, `DenseInfo.adds_bias`) has rows `x̄ = [x, 0]`: the "expand" K-FAC of physics-informed
networks (Dangel, Müller & Zeinhofer 2024). Uses that see a matrix in other orientations (a tied
embedding's `onehot(id) M` and `h Mᵀ`; a dense layer read transposed by a reverse-mode
derivative, `DenseInfo.transposed`, whose output gradients take the input side) each give a
product `X_u ⊗ Y_u` in M's own layout; the products are rescaled to equal mean diagonals
(X_u c_u, Y_u / c_u), then X averaged and Y summed. The series blocks (`_shared`) use these too.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kfac_jax import _specs
from kfac_jax.blocks import _layouts, _linalg
from kfac_jax.blocks._base import StackedUses
from kfac_jax.blocks._state import KroneckerFactors


def use_layouts(spec) -> list[tuple[_layouts.Layout, bool]]:
  """For each use: its layout and whether it sees the parameter matrix transposed."""
  out = []
  table = isinstance(spec.info, _specs.EmbeddingInfo)  # A tied table: products use no bias.
  for info in spec.use_infos:
    sub = dataclasses.replace(spec, info=info, num_uses=1, use_infos=())
    transposed = False
    if table and isinstance(info, _specs.DenseInfo):
      sub = dataclasses.replace(
        sub, leaf_indices=spec.leaf_indices[:1], param_shapes=spec.param_shapes[:1]
      )
      m = _specs.kernel_index_matrix(info, spec.param_shapes[0])
      transposed = not np.array_equal(m, np.arange(m.size).reshape(spec.param_shapes[0]))
    out.append((_layouts.layout_for(sub), transposed))
  return out


def indep_factors(spec, data, batch_size: int, dtype) -> KroneckerFactors:
  """The "kron_indep" statistics of one batch (see the module docstring)."""
  layouts = use_layouts(spec)
  if isinstance(spec.info, _specs.EmbeddingInfo):
    return _table_factors(layouts, data, batch_size, dtype)
  flipped = [getattr(inf, "transposed", False) for inf in spec.use_infos]
  if isinstance(data, StackedUses) or not any(flipped):
    a, g = _expand(spec, layouts, spec.use_infos, data, batch_size, dtype)
    if layouts[0][0].groups == 1:  # One group: no group axis.
      a, g = a[0], g[0]
    return KroneckerFactors(a=a, g=g)
  # A reverse-mode derivative's uses read the kernel transposed (dense layers: one group).
  parts = []
  kept = [u for u, f in enumerate(flipped) if not f]
  if kept:
    pick = lambda xs: [xs[u] for u in kept]
    a, g = _expand(spec, pick(layouts), pick(spec.use_infos), pick(data), batch_size, dtype)
    parts.append((a[0], g[0]))
  parts.append(_transposed_factors(spec, layouts, flipped, data, batch_size, dtype))
  return _pooled(parts)


def _expand(spec, layouts, infos, data, batch_size: int, dtype):
  """`(A, G)` per group of uses that read the parameter matrix as the layer does."""

  def output_factor(g):  # Σ g gᵀ / (S N) per group.
    return _linalg.gram(g.reshape((-1,) + g.shape[2:]), False) / (g.shape[0] * batch_size)

  if isinstance(data, StackedUses):  # T equal uses inside one scan: every step's rows at once.
    rows_of = lambda xs, gg: layouts[0][0].rows((xs, gg), dtype)
    # x: [T, R, groups, in]; g: [S, T, R, groups, out]
    x, g = jax.vmap(rows_of, in_axes=(0, 1), out_axes=(0, 1))(data.inputs, data.g)
    rows = [(x.reshape((-1,) + x.shape[2:]), g.reshape((g.shape[0], -1) + g.shape[3:]))]
  else:
    rows = [layout.rows(d, dtype) for (layout, _), d in zip(layouts, data)]
  # Tangent channels (uses without the bias) get a homogeneous coordinate of 0.
  coords = [1.0 if getattr(inf, "adds_bias", True) else 0.0 for inf in infos]
  tangents = spec.has_bias and 0.0 in coords
  if not tangents and len({(x.shape[1:], g.shape[0], g.shape[2:]) for x, g in rows}) == 1:
    # Rows of every use in one matrix: one product per factor, however many uses.
    x = jnp.concatenate([x for x, _ in rows])
    g = jnp.concatenate([g for _, g in rows], axis=1)
    return _linalg.gram(x, spec.has_bias) / x.shape[0], output_factor(g)
  a_sum: Any = sum(_linalg.gram(x, spec.has_bias, c) for (x, _), c in zip(rows, coords))
  return a_sum / sum(x.shape[0] for x, _ in rows), sum(output_factor(g) for _, g in rows)


def _transposed_factors(spec, layouts, flipped, data, batch_size: int, dtype):
  """`(A, G)` of the uses that read the kernel transposed, `δa = δz Wᵀ`: W's gradient is
  `(∂ℓ/∂δa) δzᵀ`, so A = (1/(S N)) Σ ḡ ḡᵀ (ḡ = [∂ℓ/∂δa, 0]) and G = Σ δz δzᵀ / R."""
  # x: [R, 1, out]; g: [S, R, 1, in]
  used = [lay.rows(d, dtype) for (lay, _), d, f in zip(layouts, data, flipped) if f]
  gram = lambda g: _linalg.gram(g.reshape(-1, 1, g.shape[-1]), spec.has_bias, 0.0)[0]
  a: Any = sum(gram(g) / (g.shape[0] * batch_size) for _, g in used)
  g_sum: Any = sum(_linalg.gram(x, False)[0] for x, _ in used)
  return a, g_sum / sum(x.shape[0] for x, _ in used)


def _pooled(parts, balance: bool = True) -> KroneckerFactors:
  """One Kronecker product for `Σ_k A_k ⊗ G_k`: each pair rescaled to equal mean diagonals
  (`A_k c_k`, `G_k / c_k`, with `balance`), then A averaged and G summed."""
  if len(parts) == 1:
    return KroneckerFactors(*parts[0])
  if balance:  # c = sqrt(tr G / tr A), as π of the factored damping.
    mean = _linalg.mean_diag
    parts = [(a * c, g / c) for a, g in parts for c in [_linalg.pi_from_traces(mean(g), mean(a))]]
  return KroneckerFactors(a=sum(a for a, _ in parts) / len(parts), g=sum(g for _, g in parts))


def _table_factors(layouts, data, batch_size: int, dtype) -> KroneckerFactors:
  """An embedding table [vocab, dim], possibly tied with products by the (transposed) table."""
  parts = []
  for (layout, transposed), d in zip(layouts, data):
    x, g = layout.rows(d, dtype)
    gg = jnp.einsum("srgi,srgj->ij", g, g) / (g.shape[0] * batch_size)
    if isinstance(layout, _layouts.EmbeddingLayout):
      parts.append((layout.id_counts(x, dtype) / x.shape[0], gg))
    elif transposed:  # logits = h Mᵀ: rows of M are its outputs.
      parts.append((_linalg.diagonal(gg), jnp.einsum("rgi,rgj->ij", x, x) / x.shape[0]))
    else:  # one-hot-like rows times M.
      parts.append((jnp.einsum("rgi,rgi->i", x, x) / x.shape[0], gg))
  return _pooled(parts, balance=any(t for _, t in layouts))


def scaled_cholesky(q, p, scale, m, transpose: bool, inverse: bool):
  """C·M, Cᵀ·M, C⁻¹·M or C⁻ᵀ·M for C = (Q_A ⊗ Q_G) diag(√scale) with C⁻¹ = diag(1/√scale)
  (P_A ⊗ P_G)ᵀ, `q = (Q_A, Q_G)` and `p = (P_A, P_G)` (the series and two-term blocks)."""
  (qa, qg), (pa, pg), root = q, p, jnp.sqrt(scale)
  if inverse:
    return pa @ (m / root) @ pg.T if transpose else (pa.T @ m @ pg) / root
  return (qa.T @ m @ qg) * root if transpose else qa @ (m * root) @ qg.T


def check_factored_powers(spec, config, note: str = "") -> None:
  """ValueError unless `config` has factored damping and only the powers -1 and 1."""
  if not config.factored:
    raise ValueError(
      f"layer `{spec.name}`: approximation {spec.approx!r} needs a factored damping_mode "
      f"('factored' or 'factored_equal'), got {config.damping_mode!r}."
    )
  if any(e not in (-1, 1) for e in config.exps):
    raise ValueError(
      f"layer `{spec.name}`: approximation {spec.approx!r} defines only the powers -1 and 1"
      f'{note}, got exps={config.exps}; use exps=(-1,), or approx="kron_indep".'
    )
