"""How each layer kind's parameters, inputs and output gradients map to matrices.

A layout turns a layer's leaves into `M: [groups, in(+1), out]` and the curvature pass's data
`(inputs, g)` into rows `x: [R, groups, in]` and `g: [S, R, groups, out]` (S sampled targets),
so that `s_r = x_r M` per group and the per-example gradient is `Σ_{r ∈ n} x̄_r g_rᵀ` (x̄ = [x, 1]
with a bias). Dense: the input as rows. Conv: input patches ((channel, window) row-major), one
row per example and output location. Embedding: the ids (one-hot rows, never built).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from kfac_jax import _specs
from kfac_jax.blocks import _linalg

# The Kronecker approximations every layout supports: A ⊗ G, and either side kept as its diagonal.
KRON: tuple[_specs.Approximation, ...] = ("kron", "kron_in_diag", "kron_out_diag", "kron_both_diag")


class Layout:
  """A layer kind's matrix view (the module docstring); the methods read a kernel per group as
  `[in, out]` (dense layers), other layouts override them."""

  kind: ClassVar[_specs.Kind]
  info_type: ClassVar[type]
  kronecker: ClassVar[tuple[_specs.Approximation, ...]] = KRON
  per_example: ClassVar[bool] = True  # Its rows give per-example gradients ("diagonal", "full").

  def __init__(self, spec):
    self.spec, self.info = spec, spec.info
    self.groups, self.in_dim, self.out_dim = self.dims(spec.info)

  @staticmethod
  def dims(info) -> tuple[int, int, int]:
    """`(groups, in, out)`: the number and the shape of the layer's matrices."""
    return 1, info.in_dim, info.out_dim

  def rows(self, data, dtype) -> tuple[jax.Array, jax.Array]:
    """`(x [R, groups, in], g [S, R, groups, out])` from the curvature pass's `(inputs, g)`,
    whose operands `x_perm` / `out_perm` order as `[rows..., in]` / `[rows..., out]`."""
    (x,), g = data
    x = x.astype(dtype).transpose(self.info.x_perm).reshape(-1, self.groups, self.in_dim)
    g = g.astype(dtype).transpose((0,) + tuple(d + 1 for d in self.info.out_perm))
    return x, g.reshape(g.shape[0], x.shape[0], self.groups, self.out_dim)

  def to_matrix(self, vecs, dtype) -> jax.Array:
    """The leaves as `M: [groups, in(+1), out]` in `dtype`, the bias (if any) its last row."""
    m = self._kernel_matrix(_specs.apply_view(self.info.kernel_view, vecs[0].astype(dtype)))
    if not self.spec.has_bias:
      return m
    return jnp.concatenate([m, vecs[1].astype(dtype).reshape(self.groups, 1, self.out_dim)], axis=1)

  def from_matrix(self, m: jax.Array) -> list[jax.Array]:
    """`to_matrix`'s inverse."""
    chain, shapes = self.info.kernel_view, self.spec.param_shapes
    k = self._kernel_operand(m[:, : self.in_dim], chain[-1].out_shape if chain else shapes[0])
    out = [_specs.undo_view(chain, k).reshape(shapes[0])]
    if self.spec.has_bias:
      out.append(m[:, self.in_dim].reshape(shapes[1]))
    return out

  def _kernel_matrix(self, k: jax.Array) -> jax.Array:
    """The kernel operand as `[groups, in, out]`."""
    return k.transpose(self.info.kernel_perm).reshape(self.groups, self.in_dim, self.out_dim)

  def _kernel_operand(self, k: jax.Array, shape) -> jax.Array:
    """`_kernel_matrix`'s inverse, for an operand of `shape`."""
    perm = self.info.kernel_perm
    return k.reshape(tuple(shape[d] for d in perm)).transpose(np.argsort(perm))


class DenseLayout(Layout):
  """`s = x W (+ b)` with W viewed as [in, out] (see `DenseInfo`); over sequences the positions
  are rows ("expand") or averaged per example ("reduce"); "kron_indep" is "kron" for one use."""

  kind = "dense"
  info_type = _specs.DenseInfo
  kronecker = KRON + ("expand", "reduce", "kron_indep")

  def rows(self, data, dtype):
    info = self.info
    if not info.shared_tap:
      return Layout.rows(self, data, dtype)
    # The same input rows for every example: g is the broadcast's.
    (x,), g = data
    x = x.astype(dtype).transpose(info.x_perm).reshape(-1, 1, info.in_dim)
    tap = np.frombuffer(info.shared_tap, np.int32)
    s, n = g.shape[:2]
    g = g.astype(dtype).reshape(s, n, -1)
    g = jnp.zeros((s, n, info.rows * info.out_dim), dtype).at[:, :, tap].add(g)
    x = jnp.tile(x, (n, 1, 1))  # Rows grouped by example, as the batch's are.
    return x, g.reshape(s, n * info.rows, 1, info.out_dim)


class ConvLayout(Layout):
  """A convolution as a product of input patches with the kernel matrix (see module doc)."""

  kind = "conv"
  info_type = _specs.ConvInfo
  kronecker = KRON + ("kron_sua", "kron_indep")

  @staticmethod
  def dims(info) -> tuple[int, int, int]:
    groups = info.feature_group_count
    patch = info.in_channels // groups * math.prod(info.kernel_spatial)  # (C/groups)·window
    return groups, patch, info.out_channels // groups

  @property
  def _kernel_perm(self) -> tuple[int, ...]:  # operand -> (in, window..., out)
    rhs = self.info.rhs_spec
    return (rhs[1], *rhs[2:], rhs[0])

  def rows(self, data, dtype):
    (x,), g = data
    info = self.info
    p = lax.conv_general_dilated_patches(
      x.astype(dtype).transpose(info.lhs_spec),  # [N, C, *spatial]
      info.kernel_spatial,
      info.window_strides,
      info.padding,
      info.lhs_dilation,
      info.rhs_dilation,
      precision=lax.Precision.HIGHEST,
    )
    p = jnp.moveaxis(p, 1, -1)  # [N, *out_spatial, C·W], (channel, window) row-major.
    x_rows = p.reshape(-1, self.groups, self.in_dim)
    o = info.out_spec
    g = g.astype(dtype).transpose((0, o[0] + 1, *(d + 1 for d in o[2:]), o[1] + 1))
    return x_rows, g.reshape(g.shape[0], -1, self.groups, self.out_dim)

  def sua_input_factor(self, data, dtype, has_bias: bool) -> jax.Array:
    """The input factor under spatially uncorrelated activations (Grosse & Martens 2016, §3):
    with a_t a group's input channels at location t, M = mean_t a_t a_tᵀ and μ = mean_t a_t,
    a patch's second moment is Ω = (M − μμᵀ) ⊗ I_W + μμᵀ ⊗ 1_W 1_Wᵀ (the row [μ ⊗ 1_W, 1]
    appended with a bias); padding and input-dilation zeros are ignored."""
    (x,), _ = data
    info = self.info
    a = jnp.moveaxis(x.astype(dtype).transpose(info.lhs_spec), 1, -1)
    a = a.reshape(-1, self.groups, info.in_channels // self.groups)  # [N·T, G, Cg]
    m2 = _linalg.gram(a, False) / a.shape[0]
    mu = jnp.mean(a, axis=0)
    w = math.prod(info.kernel_spatial)
    ones = jnp.ones((w, w), dtype)

    def one_group(m2, mu):
      mm = jnp.outer(mu, mu)
      om = jnp.kron(m2 - mm, jnp.eye(w, dtype=dtype)) + jnp.kron(mm, ones)
      if has_bias:
        col = jnp.repeat(mu, w)[:, None]
        om = jnp.block([[om, col], [col.T, jnp.ones((1, 1), dtype)]])
      return om

    return jax.vmap(one_group)(m2, mu)

  def _kernel_matrix(self, k: jax.Array) -> jax.Array:
    k = k.transpose(self._kernel_perm).reshape(self.in_dim, self.groups, self.out_dim)
    return k.transpose(1, 0, 2)

  def _kernel_operand(self, k: jax.Array, shape) -> jax.Array:
    permuted = tuple(shape[d] for d in self._kernel_perm)
    return k.transpose(1, 0, 2).reshape(permuted).transpose(np.argsort(self._kernel_perm))


class EmbeddingLayout(Layout):
  """`s = onehot(id) T` with the table T: [vocab, dim]; x holds the ids, not one-hot rows. The
  input side is always diagonal, so "kron" and "kron_in_diag" are one block."""

  kind = "embedding"
  info_type = _specs.EmbeddingInfo
  kronecker = ("kron", "kron_out_diag", "kron_indep")
  per_example = False  # Its rows are ids, not input rows.

  @staticmethod
  def dims(info) -> tuple[int, int, int]:
    return 1, info.vocab_size, info.dim

  def rows(self, data, dtype):
    (ids,), g = data
    return ids.reshape(-1), g.astype(dtype).reshape(g.shape[0], -1, 1, self.out_dim)

  def id_counts(self, ids: jax.Array, dtype) -> jax.Array:
    """`[vocab]`: how many rows hold each id (the diagonal of Σ_r onehot_r onehot_rᵀ); ids
    outside `[0, vocab)` select no row (gathers do not wrap negative ones) and are not counted."""
    ids = jnp.where(ids < 0, self.in_dim, ids)
    return jnp.zeros((self.in_dim,), dtype).at[ids].add(1.0, mode="drop")

  def to_matrix(self, vecs, dtype) -> jax.Array:
    t = _specs.apply_view(self.info.table_view, vecs[0].astype(dtype))
    return t.reshape(1, self.in_dim, self.out_dim)

  def from_matrix(self, m: jax.Array) -> list[jax.Array]:
    return [m[0].reshape(self.spec.param_shapes[0])]


@dataclasses.dataclass(frozen=True)
class GroupedDenseInfo:
  """A dense map per group p of a grid, `out[n, p] = x[n, p] @ K[p] (+ b[p])`, as one batched
  `dot_general` (Flax's `ConvLocal`, a per-atom envelope). `kernel_perm` transposes the kernel
  to `[*grid, in..., out...]`; `x_perm` / `out_perm` order the input / output as
  `[rows..., *grid, in...]` / `[rows..., *grid, out...]`."""

  kernel_view: tuple[_specs.ViewStep, ...]
  kernel_perm: tuple[int, ...]
  grid: tuple[int, ...]
  in_dim: int
  out_dim: int
  x_perm: tuple[int, ...]
  out_perm: tuple[int, ...]
  kernel_and_bias: ClassVar[bool] = True


class GroupedDenseLayout(Layout):
  """One dense layer per group (`M: [P, in(+1), out]`), block-diagonal over the groups."""

  kind = "grouped_dense"
  info_type = GroupedDenseInfo

  @staticmethod
  def dims(info) -> tuple[int, int, int]:
    return math.prod(info.grid), info.in_dim, info.out_dim


LAYOUTS: tuple[type[Layout], ...] = (DenseLayout, ConvLayout, EmbeddingLayout, GroupedDenseLayout)
_BY_INFO: dict[type, type[Layout]] = {lay.info_type: lay for lay in LAYOUTS}


def layout_for(spec) -> Layout:
  """The layout of a layer, from the type of its matching details (`spec.info`)."""
  return _BY_INFO[type(spec.info)](spec)


# The kinds with "diagonal" and "full" blocks (`gradient_rows`).
_WITHOUT_LAYOUT: tuple[_specs.Kind, ...] = ("scale_and_shift", "generic")
PER_EXAMPLE_KINDS = tuple(lay.kind for lay in LAYOUTS if lay.per_example) + _WITHOUT_LAYOUT


def by_example(spec, x: jax.Array, g: jax.Array, batch_size: int) -> tuple[jax.Array, jax.Array]:
  """Rows `x: [R, ...]`, `g: [S, R, ...]` as `[N, R/N, ...]`, `[S, N, R/N, ...]`; a ValueError
  naming the layer unless the R rows split into the batch's N examples."""
  rows = x.shape[0]
  if rows % batch_size:
    raise ValueError(
      f"layer `{spec.name}`: {rows} rows do not split into {batch_size} examples; the "
      f"{spec.approx!r} approximation needs the batch as the leading axis of the input."
    )
  x = x.reshape(batch_size, rows // batch_size, *x.shape[1:])
  return x, g.reshape(g.shape[0], *x.shape[:2], *g.shape[2:])


def per_example_grads(spec, data, batch_size: int, dtype) -> jax.Array:
  """`[S·N, n]`: the gradient of each example's loss for each sampled target, leaves raveled:
  J_n = Σ_{r ∈ n} x̄_r g_rᵀ for layouts, Σ_positions x̂ ⊙ g (scale) and Σ_positions g (shift)
  for scales and shifts, the sum of the uses' for a layer used several times."""
  if spec.num_uses > 1:  # Uses on another loss tag's point set are examples of their own.
    groups: dict[int, Any] = {}
    for info, d in zip(spec.use_infos, data):
      n = batch_size  # The examples its rows hold (fewer for a dense use on fewer points).
      if isinstance(info, _specs.DenseInfo) and info.shared_tap:
        n = d[1].shape[1]
      elif isinstance(info, _specs.DenseInfo) and (d[0][0].size // info.in_dim) % batch_size:
        n = d[0][0].shape[info.x_perm[0]]
      one = dataclasses.replace(spec, info=info, num_uses=1, use_infos=())
      flipped = getattr(info, "transposed", False) and spec.has_bias
      if flipped:  # A use of the transposed kernel (its own layout says so) adds no bias.
        one = dataclasses.replace(
          one, leaf_indices=spec.leaf_indices[:1], param_shapes=spec.param_shapes[:1]
        )
      h = per_example_grads(one, d, n, dtype)
      if flipped:
        h = jnp.pad(h, ((0, 0), (0, math.prod(spec.param_shapes[1]))))
      groups[n] = h if n not in groups else groups[n] + h
    return jnp.concatenate(list(groups.values()), axis=0)
  if isinstance(spec.info, _specs.ScaleShiftInfo):
    return _scale_shift_grads(spec, data, batch_size, dtype)
  layout = layout_for(spec)
  x, g = layout.rows(data, dtype)
  if spec.has_bias:  # The homogeneous coordinate: 0 for a tangent channel (no bias added).
    coord = 1.0 if getattr(spec.info, "adds_bias", True) else 0.0
    x = jnp.concatenate([x, jnp.full(x.shape[:-1] + (1,), coord, dtype)], axis=-1)
  x, g = by_example(spec, x, g, batch_size)
  j = jnp.einsum("nlgi,snlgo->sngio", x, g, precision=lax.Precision.HIGHEST)
  j = j.reshape(-1, *j.shape[2:])
  leaves = jax.vmap(layout.from_matrix)(j)
  return jnp.concatenate([v.reshape(v.shape[0], -1) for v in leaves], axis=1)


def _scale_shift_grads(spec, data, batch_size: int, dtype) -> jax.Array:
  info: _specs.ScaleShiftInfo = spec.info
  inputs, g = data[0], data[1].astype(dtype)
  out_shape = g.shape[1:]  # This batch's output shape (`info.output_shape` is example_batch's).
  nd, nf = len(out_shape), len(info.feature_shape)
  start = nd - nf if info.feature_axis is None else info.feature_axis
  b = info.batch_axis
  rows = out_shape[b]  # The batch's size, or a multiple of it (rows grouped example-major).
  if info.example_rows and rows % batch_size:
    raise ValueError(
      f"layer `{spec.name}`: {rows} rows do not split into {batch_size} examples; the "
      f"{spec.approx!r} approximation needs them grouped by example."
    )
  # Sum over all but the batch and the feature axes (after g's samples), the batch then first.
  axes = tuple(1 + a for a in range(nd) if a != b and not start <= a < start + nf)
  batch_at = 1 + sum(1 for a in range(b) if start <= a < start + nf)
  out = []
  if info.has_scale:
    xhat = jnp.ones(out_shape, dtype)
    for v in inputs:
      xhat = xhat * jnp.broadcast_to(v.astype(dtype), out_shape)
    out.append(jnp.moveaxis(jnp.sum(g * xhat[None], axis=axes), batch_at, 1))
  if info.has_shift:
    out.append(jnp.moveaxis(jnp.sum(g, axis=axes), batch_at, 1))
  size = math.prod(info.feature_shape)
  # `[S, rows, F]` -> `[S·N, F]`, each example's rows summed (else `[S·rows, F]`).
  per = rows // batch_size if info.example_rows else 1
  out = [o.reshape(o.shape[0], rows // per, per, size).sum(2).reshape(-1, size) for o in out]
  entries = info.feature_entries()
  if entries is not None:  # A gathered table: each entry's gradient sums the features it feeds.
    n = math.prod(spec.param_shapes[0])
    out = [jnp.zeros((o.shape[0], n), dtype).at[:, entries].add(o) for o in out]
  return jnp.concatenate(out, axis=1)


def gradient_rows(spec, data, batch_size: int, dtype) -> tuple[jax.Array, int]:
  """`(h, c)`, the rows of a layer's "diagonal" / "full" statistics F = Σ hᵀh / c, c = S·N:
  each sample's batch-summed gradient for generic parameters, else `per_example_grads` (one
  per row for rows that are not examples, `ScaleShiftInfo.example_rows` False)."""
  info = spec.info
  lay = _BY_INFO.get(type(info))
  if not ((lay is not None and lay.per_example) or isinstance(info, _specs.ScaleShiftInfo)):
    h = jnp.concatenate([d.reshape(d.shape[0], -1).astype(dtype) for d in data], axis=1)
    return h, h.shape[0] * batch_size
  h = per_example_grads(spec, data, batch_size, dtype)
  if spec.num_uses == 1 and isinstance(info, _specs.ScaleShiftInfo) and not info.example_rows:
    return h, data[1].shape[0] * batch_size
  if spec.num_uses > 1:  # S·N: uses on smaller point sets add rows (`per_example_grads`).
    return h, data[0][1].shape[0] * batch_size
  return h, h.shape[0]
