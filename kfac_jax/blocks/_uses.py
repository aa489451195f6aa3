"""Statistics of a layer applied several times, as independent uses ("kron_indep").

A layer with parameters M used at k places (k uses u = 1..k: the steps of an unrolled scan, the
input and output use of a tied embedding, the same dense or convolution applied twice) has
per-example gradient `Σ_u Σ_{r ∈ u} x̄_{u,r} g_{u,r}ᵀ`. With rows and uses as in `_kronecker`:

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

Both the Kronecker block ("kron_indep") and the series blocks (`_shared`, whose A and G are
these) read them from here.
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
    if table and isinstance(info, _specs.DenseInfo):
      sub = dataclasses.replace(
        sub, leaf_indices=spec.leaf_indices[:1], param_shapes=spec.param_shapes[:1]
      )
    transposed = False
    if table and isinstance(info, _specs.DenseInfo):
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
  if not isinstance(spec.info, _specs.EmbeddingInfo):  # Per feature group (grouped convs).
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
