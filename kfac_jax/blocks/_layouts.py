"""How each layer kind's parameters, inputs and output gradients map to matrices.

A layout turns a layer's parameter leaves into a stack of matrices `M: [groups, in(+1), out]`
(one per feature group; one group except for grouped convolutions) and the curvature pass's raw
data `(inputs, g)` into rows: `x: [R, groups, in]` (inputs of the product, one row per example
and position) and `g: [S, R, groups, out]` (output gradients, `S` sampled targets). With these, a
layer's output is `s_r = x_r M` per group, and the gradient of the per-example loss of example n
with respect to M is `Σ_{r ∈ n} x̄_r g_rᵀ`, x̄ = [x, 1] with a bias. The blocks build their
statistics from these rows only.

  dense      x = the input reshaped to [rows, in] (`DenseInfo` perms); M = the kernel as [in, out].
  conv       x = input patches (`lax.conv_general_dilated_patches`), flattened (in channel, window
             position) in row-major order, one row per example and output location; M = the kernel
             transposed to (in channel, window..., out) and reshaped the same way, so a patch row
             times M is exactly the convolution at that location.
  embedding  x = the ids (a one-hot row per id, never materialised); M = the table [vocab, dim].
  conv_local x = the input patches, one row per example, one group per output location; M = the
             location's kernel `[in, out]` (an unshared convolution is a dense layer per location).

Each layout declares the layer kind it lays out (`kind`, read from the layer's matching details,
`LayerSpec.info`) and the Kronecker-factored approximations it supports (`kronecker`); the
Kronecker, diagonal and full blocks serve those pairs (`Block.serves`), so a new kind whose
layers are products by a parameter matrix needs only its layout here.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from kfac_jax import _specs
from kfac_jax.blocks import _linalg

if TYPE_CHECKING:
  from kfac_jax._specs import Approximation, Kind

Array = jax.Array


def _operand_shape(chain, param_shape) -> tuple[int, ...]:
  return tuple(chain[-1].out_shape) if chain else tuple(param_shape)


# The Kronecker approximations every layout supports: A ⊗ G, and either side kept as its diagonal.
_KRON: tuple[Approximation, ...] = ("kron", "kron_in_diag", "kron_out_diag", "kron_both_diag")


class DenseLayout:
  """`s = x W (+ b)` with W viewed as [in, out] (see `DenseInfo`)."""

  kind: ClassVar[Kind] = "dense"
  info_type: ClassVar[type] = _specs.DenseInfo
  # Also over sequences: positions as rows ("expand") or averaged per example ("reduce"); and
  # "kron_indep", which equals "kron" for one use.
  kronecker: ClassVar[tuple[Approximation, ...]] = _KRON + ("expand", "reduce", "kron_indep")
  per_example: ClassVar[bool] = True  # `per_example_grads` applies ("diagonal", "full").

  def __init__(self, spec):
    self.spec = spec
    self.info: _specs.DenseInfo = spec.info
    self.groups = 1
    self.in_dim, self.out_dim = self.info.in_dim, self.info.out_dim

  def rows(self, data, dtype):
    # The row count comes from the arrays, not `info.rows`: statistics of a batch of another
    # size than `example_batch` (a partial last batch) have other row counts.
    (x,), g = data
    info = self.info
    x = x.astype(dtype).transpose(info.x_perm).reshape(-1, 1, info.in_dim)
    if info.shared_tap:  # The same input rows for every example: g is the broadcast's.
      tap = np.frombuffer(info.shared_tap, np.int32)
      s, n = g.shape[:2]
      g = g.astype(dtype).reshape(s, n, -1)
      g = jnp.zeros((s, n, info.rows * info.out_dim), dtype).at[:, :, tap].add(g)
      x = jnp.tile(x, (n, 1, 1))  # Rows grouped by example, as the batch's are.
      return x, g.reshape(s, n * info.rows, 1, info.out_dim)
    g = g.astype(dtype).transpose((0,) + tuple(d + 1 for d in info.out_perm))
    return x, g.reshape(g.shape[0], x.shape[0], 1, info.out_dim)

  def to_matrix(self, vecs, dtype) -> Array:
    info = self.info
    k = _specs.apply_view(info.kernel_view, vecs[0].astype(dtype))
    m = k.transpose(info.kernel_perm).reshape(1, info.in_dim, info.out_dim)
    if self.spec.has_bias:
      m = jnp.concatenate([m, vecs[1].astype(dtype).reshape(1, 1, info.out_dim)], axis=1)
    return m

  def from_matrix(self, m: Array) -> list[Array]:
    info = self.info
    op_shape = _operand_shape(info.kernel_view, self.spec.param_shapes[0])
    permuted = tuple(op_shape[d] for d in info.kernel_perm)
    k = m[0, : info.in_dim].reshape(permuted).transpose(np.argsort(info.kernel_perm))
    out = [_specs.undo_view(info.kernel_view, k).reshape(self.spec.param_shapes[0])]
    if self.spec.has_bias:
      out.append(m[0, info.in_dim].reshape(self.spec.param_shapes[1]))
    return out


class ConvLayout:
  """A convolution as a product of input patches with the kernel matrix (see module doc)."""

  kind: ClassVar[Kind] = "conv"
  info_type: ClassVar[type] = _specs.ConvInfo
  kronecker: ClassVar[tuple[Approximation, ...]] = _KRON + ("kron_sua", "kron_indep")
  per_example: ClassVar[bool] = True

  def __init__(self, spec):
    self.spec = spec
    self.info: _specs.ConvInfo = spec.info
    self.groups = self.info.groups
    self.in_dim, self.out_dim = self.info.patch_dim, self.info.out_per_group
    rhs = self.info.rhs_spec
    self._kernel_perm = (rhs[1], *rhs[2:], rhs[0])  # operand -> (in, window..., out)

  def _input_nc(self, x):
    """The input as [N, C, *spatial]."""
    return x.transpose(self.info.lhs_spec)

  def rows(self, data, dtype):
    (x,), g = data
    info = self.info
    p = lax.conv_general_dilated_patches(
      self._input_nc(x.astype(dtype)),
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

  def sua_input_factor(self, data, dtype, has_bias: bool) -> Array:
    """The input factor under spatially uncorrelated activations (Grosse & Martens 2016, §3).

    With a_t the input channels (of one group) at spatial location t, M = mean_t a_t a_tᵀ and
    μ = mean_t a_t over all examples and input locations, and activations assumed uncorrelated
    across distinct locations (and homogeneous in space), the second moment of a patch, indexed
    by (channel c, window offset δ), is

        Ω[(c, δ), (c', δ')] = M[c, c'] if δ = δ' else μ_c μ_c',

    i.e. Ω = (M − μμᵀ) ⊗ I_W + μμᵀ ⊗ 1_W 1_Wᵀ, with the homogeneous row [μ ⊗ 1_W, 1] when
    there is a bias. Boundary (padding) and input-dilation zeros are ignored.
    """
    (x,), _ = data
    info = self.info
    a = jnp.moveaxis(self._input_nc(x.astype(dtype)), 1, -1)
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

  def to_matrix(self, vecs, dtype) -> Array:
    k = _specs.apply_view(self.info.kernel_view, vecs[0].astype(dtype))
    k = k.transpose(self._kernel_perm).reshape(self.in_dim, self.groups, self.out_dim)
    m = k.transpose(1, 0, 2)
    if self.spec.has_bias:
      b = vecs[1].astype(dtype).reshape(self.groups, 1, self.out_dim)
      m = jnp.concatenate([m, b], axis=1)
    return m

  def from_matrix(self, m: Array) -> list[Array]:
    info = self.info
    op_shape = _operand_shape(info.kernel_view, self.spec.param_shapes[0])
    permuted = tuple(op_shape[d] for d in self._kernel_perm)
    k = m[:, : self.in_dim].transpose(1, 0, 2).reshape(permuted)
    k = k.transpose(np.argsort(self._kernel_perm))
    out = [_specs.undo_view(info.kernel_view, k).reshape(self.spec.param_shapes[0])]
    if self.spec.has_bias:
      out.append(m[:, self.in_dim].reshape(self.spec.param_shapes[1]))
    return out


class EmbeddingLayout:
  """`s = onehot(id) T` with the table T: [vocab, dim]; x holds the ids, not one-hot rows."""

  kind: ClassVar[Kind] = "embedding"
  info_type: ClassVar[type] = _specs.EmbeddingInfo
  # The input side is always diagonal (one-hot rows): "kron" and "kron_in_diag" are one block.
  kronecker: ClassVar[tuple[Approximation, ...]] = ("kron", "kron_out_diag", "kron_indep")
  per_example: ClassVar[bool] = False  # Its rows are ids, not input rows.

  def __init__(self, spec):
    self.spec = spec
    self.info: _specs.EmbeddingInfo = spec.info
    self.groups = 1
    self.in_dim, self.out_dim = self.info.vocab_size, self.info.dim

  def rows(self, data, dtype):
    (ids,), g = data
    g = g.astype(dtype)
    return ids.reshape(-1), g.reshape(g.shape[0], -1, 1, self.out_dim)

  def id_counts(self, ids: Array, dtype) -> Array:
    """`[vocab]`: how many rows hold each id (the diagonal of Σ_r onehot_r onehot_rᵀ).

    Ids outside `[0, vocab)` select no row of the table (a one-hot row of zeros; the gather
    primitive does not wrap negative indices), so they are not counted.
    """
    ids = jnp.where(ids < 0, self.in_dim, ids)
    return jnp.zeros((self.in_dim,), dtype).at[ids].add(1.0, mode="drop")

  def to_matrix(self, vecs, dtype) -> Array:
    t = _specs.apply_view(self.info.table_view, vecs[0].astype(dtype))
    return t.reshape(1, self.in_dim, self.out_dim)

  def from_matrix(self, m: Array) -> list[Array]:
    return [m[0].reshape(self.spec.param_shapes[0])]


@dataclasses.dataclass(frozen=True)
class ConvLocalInfo:
  """An unshared (locally connected) convolution, `out[n, p, :] = patch[n, p, :] @ K[p] (+ b[p])`
  at every output location p of a grid, as one `dot_general` whose batch dimensions are the grid
  (Flax's `nn.ConvLocal`, `lax.conv_general_dilated_local`).

  The kernel leaf is `[*grid, in, out]` (`kernel_view`: casts only), the bias `[*grid, out]` (or
  any shape of that size, in that order). The input operand (the patches) is transposed by
  `x_perm` to `[rows..., *grid, in]`, the tapped output by `out_perm` to `[rows..., *grid, out]`.
  """

  kernel_view: tuple[_specs.ViewStep, ...]
  grid: tuple[int, ...]
  in_dim: int
  out_dim: int
  x_perm: tuple[int, ...]
  out_perm: tuple[int, ...]
  kernel_and_bias: ClassVar[bool] = True

  @property
  def locations(self) -> int:
    return math.prod(self.grid)


class ConvLocalLayout:
  """A locally connected layer as one dense layer per output location: the locations are the
  groups, `x: [N, P, in]`, `g: [S, N, P, out]`, `M: [P, in(+1), out]`. The Kronecker factors
  are per location, `A_p = (1/N) Σ_n x̄_{n,p} x̄_{n,p}ᵀ`, `G_p = (1/N) Σ_n g_{n,p} g_{n,p}ᵀ`:
  the curvature is block-diagonal over locations, each block the K-FAC block of a dense layer."""

  kind: ClassVar[Kind] = "conv_local"
  info_type: ClassVar[type] = ConvLocalInfo
  kronecker: ClassVar[tuple[Approximation, ...]] = _KRON
  per_example: ClassVar[bool] = True

  def __init__(self, spec):
    self.spec = spec
    self.info: ConvLocalInfo = spec.info
    self.groups = self.info.locations
    self.in_dim, self.out_dim = self.info.in_dim, self.info.out_dim

  def rows(self, data, dtype):
    (x,), g = data
    info = self.info
    x = x.astype(dtype).transpose(info.x_perm).reshape(-1, self.groups, self.in_dim)
    g = g.astype(dtype).transpose((0,) + tuple(d + 1 for d in info.out_perm))
    return x, g.reshape(g.shape[0], x.shape[0], self.groups, self.out_dim)

  def to_matrix(self, vecs, dtype) -> Array:
    k = _specs.apply_view(self.info.kernel_view, vecs[0].astype(dtype))
    m = k.reshape(self.groups, self.in_dim, self.out_dim)
    if self.spec.has_bias:
      b = vecs[1].astype(dtype).reshape(self.groups, 1, self.out_dim)
      m = jnp.concatenate([m, b], axis=1)
    return m

  def from_matrix(self, m: Array) -> list[Array]:
    op_shape = _operand_shape(self.info.kernel_view, self.spec.param_shapes[0])
    k = _specs.undo_view(self.info.kernel_view, m[:, : self.in_dim].reshape(op_shape))
    out = [k.reshape(self.spec.param_shapes[0])]
    if self.spec.has_bias:
      out.append(m[:, self.in_dim].reshape(self.spec.param_shapes[1]))
    return out


Layout = DenseLayout | ConvLayout | EmbeddingLayout | ConvLocalLayout
LAYOUTS: tuple[type[Layout], ...] = (DenseLayout, ConvLayout, EmbeddingLayout, ConvLocalLayout)
_BY_INFO: dict[type, type[Layout]] = {lay.info_type: lay for lay in LAYOUTS}


def layout_for(spec) -> Layout:
  """The layout of a layer, from the type of its matching details (`spec.info`)."""
  return _BY_INFO[type(spec.info)](spec)


def per_example(spec) -> bool:
  """Whether a layer's per-example gradients are rebuilt from its inputs and output gradients
  (`per_example_grads`): layers with such a layout, and scales and shifts."""
  lay = _BY_INFO.get(type(spec.info))
  return (lay is not None and lay.per_example) or isinstance(spec.info, _specs.ScaleShiftInfo)


# The kinds whose "diagonal" and "full" blocks are exact per-example Fisher blocks: those of
# the layouts with per-example gradients, scales and shifts, and generic parameters (whose
# statistics come from the batch-summed gradient).
PER_EXAMPLE_KINDS: tuple[Kind, ...] = tuple(lay.kind for lay in LAYOUTS if lay.per_example) + (
  "scale_and_shift",
  "generic",
)


def per_example_grads(spec, data, batch_size: int, dtype) -> Array:
  """`[S·N, n]`: the gradient of each example's loss for each sampled target, leaves raveled.

  Computed from the recorded inputs and output gradients, without a per-example backward pass:
  for dense and conv layers J_n = Σ_{r ∈ n} x̄_r g_rᵀ (rows grouped by example, the leading
  axis of the rows being the batch); for scale-and-shift layers Σ_positions x̂ ⊙ g (scale) and
  Σ_positions g (shift), positions being all axes but the batch and the parameter's own (a
  gathered shift table: summed, per table entry, over the features that read it). For a
  layer used several times (`spec.num_uses > 1`, `data` one entry per use) the per-example
  gradient is the sum of the uses' (each use's output gradient is that of the whole loss).
  """
  if spec.num_uses > 1:
    return sum(  # type: ignore[return-value]  # an Array: num_uses > 1 terms
      per_example_grads(
        dataclasses.replace(spec, info=info, num_uses=1, use_infos=()), d, batch_size, dtype
      )
      for info, d in zip(spec.use_infos, data)
    )
  if isinstance(spec.info, _specs.ScaleShiftInfo):
    return _scale_shift_grads(spec, data, batch_size, dtype)
  layout = layout_for(spec)
  x, g = layout.rows(data, dtype)
  rows = x.shape[0]
  if rows % batch_size:
    raise ValueError(
      f"layer `{spec.name}`: {rows} rows do not split into {batch_size} examples; the "
      f"{spec.approx!r} approximation needs the batch as the leading axis of the input."
    )
  if spec.has_bias:
    x = jnp.concatenate([x, jnp.ones(x.shape[:-1] + (1,), dtype)], axis=-1)
  x = x.reshape(batch_size, rows // batch_size, *x.shape[1:])
  g = g.reshape(g.shape[0], batch_size, rows // batch_size, *g.shape[2:])
  j = jnp.einsum("nlgi,snlgo->sngio", x, g, precision=lax.Precision.HIGHEST)
  j = j.reshape(-1, *j.shape[2:])
  leaves = jax.vmap(layout.from_matrix)(j)
  return jnp.concatenate([v.reshape(v.shape[0], -1) for v in leaves], axis=1)


def _scale_shift_grads(spec, data, batch_size: int, dtype) -> Array:
  info: _specs.ScaleShiftInfo = spec.info
  inputs, g = data
  g = g.astype(dtype)
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
  # Sum over the output's axes other than the batch and the features (g's axis 0 is samples),
  # then put the batch first (after the samples).
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
  # `[S, rows, F]` -> `[S·N, F]`, each example's rows summed (rows that are not examples stay
  # rows: `[S·rows, F]`).
  per = rows // batch_size if info.example_rows else 1
  out = [o.reshape(o.shape[0], rows // per, per, size).sum(2).reshape(-1, size) for o in out]
  entries = info.feature_entries()
  if entries is not None:  # A gathered table: each entry's gradient sums the features it feeds.
    n = math.prod(spec.param_shapes[0])
    out = [jnp.zeros((o.shape[0], n), dtype).at[:, entries].add(o) for o in out]
  return jnp.concatenate(out, axis=1)


def gradient_rows(spec, data, batch_size: int, dtype) -> tuple[Array, int]:
  """`(h, c)`: the rows of a layer's "diagonal" / "full" statistics, F = Σ hᵀh / c.

  `h` holds the per-example gradients (`per_example_grads`), c = S·N; for a scale-and-shift
  layer whose rows are not examples (`ScaleShiftInfo.example_rows` False) one gradient per row,
  still divided by S·N (the loss is a mean over the N examples, not over the rows).
  """
  h = per_example_grads(spec, data, batch_size, dtype)
  info = spec.info
  if spec.num_uses == 1 and isinstance(info, _specs.ScaleShiftInfo) and not info.example_rows:
    return h, data[1].shape[0] * batch_size
  return h, h.shape[0]
