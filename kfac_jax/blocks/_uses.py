"""Statistics of a layer applied several times, as independent uses ("kron_indep").

A layer with parameters M used at k places (the steps of a scan, a tied embedding's lookup and
logits, the same dense or conv applied twice) has per-example gradient
`Σ_u Σ_{r ∈ u} x̄_{u,r} g_{u,r}ᵀ`. "kron_indep" (Martens, Ba & Johnson 2018) treats the uses as
independent and homogeneous:

    F ≈ A ⊗ G,   A = (Σ_u Σ_r x̄ x̄ᵀ) / (Σ_u R_u),   G = (1/N) Σ_u Σ_r g gᵀ,

exactly the single-use block for k = 1. A use that does not add the layer's bias (a tangent
channel of a forward-mode derivative, `DenseInfo.adds_bias`) has rows `x̄ = [x, 0]`: this is
the "expand" K-FAC of physics-informed networks (Dangel, Müller & Zeinhofer 2024), every row of
every channel one outer product, A normalised by the number of rows over all channels and G by
the number of examples. When uses see a table in different orientations (a
tied embedding: `onehot(id) M` and `h Mᵀ`), use u contributes `X_u ⊗ Y_u` in M's own layout
(lookup: X = id counts / R, Y = its G; transposed product: X = diag of its G, Y = its A), each
rescaled to equal mean diagonals (X_u c_u, Y_u / c_u), then X = mean_u X_u, Y = Σ_u Y_u; the
vocabulary side stays diagonal. The series blocks (`_shared`) use these A and G too.
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

  def output_factor(g):  # Σ g gᵀ / (S N) per group.
    return _linalg.gram(g.reshape((-1,) + g.shape[2:]), False) / (g.shape[0] * batch_size)

  if not isinstance(spec.info, _specs.EmbeddingInfo):  # Per feature group (grouped convs).
    if isinstance(data, StackedUses):  # T equal uses inside one scan: every step's rows at once.
      layout = layouts[0][0]
      x, g = jax.vmap(lambda xs, gg: layout.rows((xs, gg), dtype), in_axes=(0, 1))(
        data.inputs, data.g
      )  # x: [T, R, groups, in]; g: [T, S, R, groups, out]
      g = jnp.moveaxis(g, 0, 1)
      rows = [(x.reshape((-1,) + x.shape[2:]), g.reshape((g.shape[0], -1) + g.shape[3:]))]
    else:
      rows = [layout.rows(d, dtype) for (layout, _), d in zip(layouts, data)]
    if spec.has_bias and not all(getattr(inf, "adds_bias", True) for inf in spec.use_infos):
      # Tangent channels: the uses without the bias get a homogeneous coordinate of 0.
      a_sum: Any = sum(
        _linalg.gram(x, True, 1.0 if inf.adds_bias else 0.0)
        for (x, _), inf in zip(rows, spec.use_infos)
      )
      a = a_sum / sum(x.shape[0] for x, _ in rows)
      g = sum(output_factor(g) for _, g in rows)
    elif len({(x.shape[1:], g.shape[0], g.shape[2:]) for x, g in rows}) == 1:
      # Rows of every use in one matrix: one product per factor, however many uses (the T
      # steps of a scan), instead of one per use.
      x = jnp.concatenate([x for x, _ in rows])
      a = _linalg.gram(x, spec.has_bias) / x.shape[0]
      g = output_factor(jnp.concatenate([g for _, g in rows], axis=1))
    else:
      a_sum = sum(_linalg.gram(x, spec.has_bias) for x, _ in rows)
      a = a_sum / sum(x.shape[0] for x, _ in rows)
      g = sum(output_factor(g) for _, g in rows)
    if layouts[0][0].groups == 1:  # One group: no group axis.
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


def check_factored_powers(spec, config, note: str = "") -> None:
  """ValueError unless `config` asks a block that sums Kronecker products (a series over uses,
  one product per loss term) for what it defines: factored damping and the powers -1 and 1
  (`note`: why, appended to the message)."""
  if not config.factored:
    raise ValueError(
      f"layer `{spec.name}`: approximation {spec.approx!r} needs a factored damping_mode "
      f"('factored' or 'factored_equal'), got {config.damping_mode!r}."
    )
  if any(e not in (-1, 1) for e in config.exps):
    raise ValueError(
      f"layer `{spec.name}`: approximation {spec.approx!r} defines only the powers -1 and 1"
      f'{note}, got exps={config.exps}. Use exps=(-1,), or approx="kron_indep" for other '
      "powers."
    )
