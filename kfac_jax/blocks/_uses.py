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

A dense layer read transposed by a reverse-mode derivative (`DenseInfo.transposed`: the
backward pass of `z = a W` computes `δa = δz Wᵀ`) contributes `(∂ℓ/∂δa) δzᵀ` to W's gradient:
its output gradients take the input side and its inputs the output side, A_t = (1/N) Σ ḡ ḡᵀ
(ḡ = [∂ℓ/∂δa, 0]) and G_t = Σ δz δzᵀ / R_t, the "expand" normalisations with the roles
exchanged; exact for one use at one point. The uses that read W as the layer does give
(A_n, G_n) as above, and the two products, on different scales, are pooled as the tied
table's uses are: each rescaled to equal mean diagonals, A averaged, G summed.
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
    a, g = _expand(
      spec,
      [layouts[u] for u in kept],
      [spec.use_infos[u] for u in kept],
      [data[u] for u in kept],
      batch_size,
      dtype,
    )
    parts.append((a[0], g[0]))
  parts.append(_transposed_factors(spec, layouts, flipped, data, batch_size, dtype))
  return _pooled(parts)


def _expand(spec, layouts, infos, data, batch_size: int, dtype):
  """`(A, G)` per feature group of uses that read the parameter matrix as the layer does: A
  over the rows of every use (homogeneous coordinate 0 for a use without the bias), G summed
  over the uses."""

  def output_factor(g):  # Σ g gᵀ / (S N) per group.
    return _linalg.gram(g.reshape((-1,) + g.shape[2:]), False) / (g.shape[0] * batch_size)

  if isinstance(data, StackedUses):  # T equal uses inside one scan: every step's rows at once.
    layout = layouts[0][0]
    x, g = jax.vmap(lambda xs, gg: layout.rows((xs, gg), dtype), in_axes=(0, 1))(
      data.inputs, data.g
    )  # x: [T, R, groups, in]; g: [T, S, R, groups, out]
    g = jnp.moveaxis(g, 0, 1)
    rows = [(x.reshape((-1,) + x.shape[2:]), g.reshape((g.shape[0], -1) + g.shape[3:]))]
  else:
    rows = [layout.rows(d, dtype) for (layout, _), d in zip(layouts, data)]
  if spec.has_bias and not all(getattr(inf, "adds_bias", True) for inf in infos):
    # Tangent channels: the uses without the bias get a homogeneous coordinate of 0.
    a_sum: Any = sum(
      _linalg.gram(x, True, 1.0 if inf.adds_bias else 0.0) for (x, _), inf in zip(rows, infos)
    )
    return a_sum / sum(x.shape[0] for x, _ in rows), sum(output_factor(g) for _, g in rows)
  if len({(x.shape[1:], g.shape[0], g.shape[2:]) for x, g in rows}) == 1:
    # Rows of every use in one matrix: one product per factor, however many uses (the T
    # steps of a scan), instead of one per use.
    x = jnp.concatenate([x for x, _ in rows])
    return (
      _linalg.gram(x, spec.has_bias) / x.shape[0],
      output_factor(jnp.concatenate([g for _, g in rows], axis=1)),
    )
  a_sum = sum(_linalg.gram(x, spec.has_bias) for x, _ in rows)
  return a_sum / sum(x.shape[0] for x, _ in rows), sum(output_factor(g) for _, g in rows)


def _transposed_factors(spec, layouts, flipped, data, batch_size: int, dtype):
  """`(A, G)` of the uses that read the kernel matrix transposed, `δa = δz Wᵀ`: the gradient
  of W is `(∂ℓ/∂δa) δzᵀ`, so the output gradient takes the input's place,
  A = (1/(S N)) Σ ḡ ḡᵀ (ḡ = [∂ℓ/∂δa, 0]: the bias is not used), and the input the output
  gradient's, G = Σ δz δzᵀ / R over the R rows of these uses."""
  a_sum: Any = 0.0
  g_sum: Any = 0.0
  rows = 0
  for (layout, _), d, f in zip(layouts, data, flipped):
    if not f:
      continue
    x, g = layout.rows(d, dtype)  # x: [R, 1, out]; g: [S, R, 1, in]
    a_sum = a_sum + _linalg.gram(g.reshape(-1, 1, g.shape[-1]), spec.has_bias, 0.0)[0] / (
      g.shape[0] * batch_size
    )
    g_sum = g_sum + _linalg.gram(x, False)[0]
    rows += x.shape[0]
  return a_sum, g_sum / rows


def _pooled(parts) -> KroneckerFactors:
  """One Kronecker product for the sum `Σ_k A_k ⊗ G_k` of products on different scales (the
  uses that read a matrix as the layer does, and those that read it transposed): each pair
  rescaled to equal mean diagonals (`A_k c_k`, `G_k / c_k`), then A averaged and G summed, as
  "kron_indep" pools its uses."""
  if len(parts) == 1:
    return KroneckerFactors(a=parts[0][0], g=parts[0][1])
  xs, ys = [], []
  for a, g in parts:
    c = _balance(a, g)
    xs.append(a * c)
    ys.append(g / c)
  return KroneckerFactors(a=sum(xs) / len(xs), g=sum(ys))


def _balance(x, y):
  """c with `x c` and `y / c` of equal mean diagonals (1 when either is 0)."""
  tx, ty = _linalg.mean_diag(x), _linalg.mean_diag(y)
  ok = (tx > 0) & (ty > 0)
  return jnp.where(ok, jnp.sqrt(jnp.where(ok, ty, 1.0) / jnp.where(ok, tx, 1.0)), 1.0)


def _table_factors(layouts, data, batch_size: int, dtype) -> KroneckerFactors:
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
      c = _balance(xs[u], ys[u])
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
