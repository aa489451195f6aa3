"""Static layer and loss specs shared by the scanner and the blocks (a leaf module, so the blocks
read them without importing the tracer): parameter paths and views, kind-specific details."""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Sequence
from typing import Any, ClassVar, Literal

import jax
import jax.numpy as jnp
import numpy as np

Kind = Literal["dense", "conv", "embedding", "scale_and_shift", "grouped_dense", "generic"]
Approximation = Literal[
  "kron", "kron_in_diag", "kron_out_diag", "kron_both_diag", "kron_sua", "expand", "reduce",
  "ekfac", "diagonal", "full", "kron_indep", "kron_series_1", "kron_series_2", "kron_terms",
]  # fmt: skip


def key_name(key) -> str:
  """One pytree path entry as text: a dict key, an attribute name or an index."""
  for attr in ("key", "name", "idx"):
    if hasattr(key, attr):
      return str(getattr(key, attr))
  return str(key)


def param_paths(params) -> tuple[str, ...]:
  out = []
  for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]:
    parts = [key_name(k) for k in path]
    if len(parts) > 1 and parts[-1] == "value":
      parts = parts[:-1]  # An nnx.State leaf's trailing `value` attribute.
    out.append("/".join(parts) if parts else "<root>")
  return tuple(out)


def common_prefix(paths: Sequence[str]) -> str:
  """The layer name of `paths`: their common `/`-separated prefix (a lone path's parent)."""
  split = [p.split("/") for p in paths]
  prefix = split[0][:-1] if len(paths) == 1 else os.path.commonprefix(split)
  return "/".join(prefix) or paths[0]


@dataclasses.dataclass(frozen=True)
class ViewStep:
  """One layout operation applied to a parameter on its way to the consuming operation."""

  op: str  # reshape, transpose, cast, broadcast, shift (a constant added) or gather (rows)
  in_shape: tuple[int, ...]
  out_shape: tuple[int, ...]
  perm: tuple[int, ...] = ()  # transpose: the permutation; broadcast: broadcast_dimensions.
  rows: bytes = b""  # gather: the row each output row takes (int32 bytes: compact, hashable).

  def gathered_rows(self) -> np.ndarray:
    """A "gather" step's row indices, shaped `out_shape[:-1]`."""
    return np.frombuffer(self.rows, np.int32).reshape(self.out_shape[:-1])


def apply_view(chain: Sequence[ViewStep], x):
  """Maps a parameter-shaped array to the operand layout (casts are skipped)."""
  for s in chain:
    if s.op == "transpose":
      x = x.transpose(s.perm)
    elif s.op == "reshape":
      x = x.reshape(s.out_shape)
    elif s.op == "broadcast":
      raise ValueError("a broadcast view cannot be applied to a parameter vector")
    elif s.op == "gather":
      x = x[s.gathered_rows()]
  return x


def undo_view(chain: Sequence[ViewStep], x):
  """Inverse of `apply_view` (of a view without a gather, which has none)."""
  for s in reversed(chain):
    if s.op == "gather":
      raise ValueError("a gather view of a parameter has no inverse")
    if s.op == "transpose":
      x = x.transpose(np.argsort(s.perm))
    elif s.op == "reshape":
      x = x.reshape(s.in_shape)
  return x


@dataclasses.dataclass(frozen=True)
class ConcatView:
  """Several parameter leaves, each viewed (`chains`), concatenated along `axis` into one operand
  (Flax's `OptimizedLSTMCell` gate kernels), matched as one virtual leaf of shape `shape`."""

  leaves: tuple[int, ...]
  chains: tuple[tuple[ViewStep, ...], ...]
  axis: int
  piece_shapes: tuple[tuple[int, ...], ...]  # The concatenated operands' shapes.
  shape: tuple[int, ...]


def join_pieces(view: ConcatView, pieces):
  """The concatenation of parameter-shaped `pieces` (casts skipped)."""
  return jnp.concatenate([apply_view(c, x) for c, x in zip(view.chains, pieces)], axis=view.axis)


def split_pieces(view: ConcatView, x, leaf_shapes):
  """Inverse of `join_pieces`: the parameter-shaped pieces of a concatenation-shaped `x`."""
  sizes = np.cumsum([s[view.axis] for s in view.piece_shapes])[:-1]
  parts = jnp.split(x, [int(k) for k in sizes], axis=view.axis)
  return [undo_view(c, p).reshape(shape) for c, p, shape in zip(view.chains, parts, leaf_shapes)]


@dataclasses.dataclass(frozen=True)
class LossSpec:
  """One loss tag: which distribution, and where its operands live in the graph."""

  kind: str
  var: float
  has_targets: bool
  has_weight: bool
  batch_size: int
  prediction_shape: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class DenseInfo:
  """How a dense layer's kernel, input and output map to matrices.

  The kernel operand (after `kernel_view`) is transposed by `kernel_perm` and reshaped to
  `[in, out]`, the input by `x_perm` to `[rows, in]`, the output by `out_perm` to `[rows, out]`.
  `shared_tap`: for an input computed from parameters and constants alone, one example's tap
  entries as positions of the `[rows, out]` output (int32 bytes). For a use of a shared layer:
  `adds_bias` False for a forward-mode tangent channel, `term` the one loss tag it feeds,
  `transposed` where it reads the kernel transposed (`δa = δz Wᵀ`, `blocks._uses`).
  """

  kernel_view: tuple[ViewStep, ...]
  kernel_perm: tuple[int, ...]
  x_perm: tuple[int, ...]
  out_perm: tuple[int, ...]
  in_dim: int
  out_dim: int
  rows: int
  shared_tap: bytes = b""
  adds_bias: bool = True
  term: int = -1  # -1: one tag, or several.
  transposed: bool = False
  kernel_and_bias: ClassVar[bool] = True  # A kernel, then optionally a bias.


def kernel_index_matrix(info: DenseInfo, param_shape) -> np.ndarray:
  """Which parameter entry (flat index) each entry of the `[in, out]` kernel matrix reads."""
  idx = np.arange(math.prod(param_shape)).reshape(param_shape)
  k = apply_view(info.kernel_view, idx)
  return k.transpose(info.kernel_perm).reshape(info.in_dim, info.out_dim)


@dataclasses.dataclass(frozen=True)
class LayerSpec:
  """A layer the scanner found (or a manual tag registered), as static facts.

  Attributes:
    name: the common prefix of its parameter paths (e.g. `params/Dense_0`).
    kind: the layer kind (`Kind`).
    param_paths: the paths of its parameter leaves, e.g. `("params/Dense_0/kernel", ...)`.
    leaf_indices: positions of those leaves in `jax.tree_util.tree_leaves(params)`.
    approx: the curvature approximation (chosen by `LayerConfig`).
    factor_shapes: shapes of the curvature factors the block keeps.
    source: "auto", "manual", "fallback" or "linked" (a `LayerConfig.linked` group).
    info: kind-specific matching details (`DenseInfo`, `ConvInfo`, ...); None for generic.
    param_shapes: shapes of the parameter leaves.
    num_uses: how many times the layer is applied (tied weights, an unrolled scan's steps).
    use_infos: for `num_uses > 1`, the matching details of every use.
    note: why the approximation differs from the one asked for or the kind's default, or "".
    concat, logical: for a layer over concatenated leaves, one `ConcatView` (or None) per
      logical parameter, and the layer as matched on the concatenations.
    stack_size: L > 0 for a stack of L layers whose leaves carry a leading layer axis
      (`factor_shapes` then lead with L); 0 otherwise. `stack_inner`: one layer's spec.
    stack_axes: for a stack applied by one vmap, the layer axis of each input operand and then
      of the output; empty when each layer has its own tap (a scan).
    block_size: the largest factor side a Kronecker block keeps whole (None: every side).
    block: the user's block class for this layer (`LayerConfig.blocks`), or None.
  """

  name: str
  kind: Kind
  param_paths: tuple[str, ...]
  leaf_indices: tuple[int, ...]
  approx: Approximation
  factor_shapes: tuple[tuple[int, ...], ...]
  source: str = "auto"
  info: Any = None
  param_shapes: tuple[tuple[int, ...], ...] = ()
  num_uses: int = 1
  use_infos: tuple[Any, ...] = ()
  note: str = ""
  concat: tuple[Any, ...] = ()
  logical: Any = None
  stack_size: int = 0
  stack_inner: LayerSpec | None = None
  stack_axes: tuple[int, ...] = ()
  block_size: int | None = None
  block: Any = None

  @property
  def multi_tap(self) -> bool:
    """Whether the layer has several taps (uses, or the layers of a scanned stack)."""
    return self.num_uses > 1 or (self.stack_size > 0 and not self.stack_axes)

  @property
  def dense(self) -> DenseInfo | None:
    return self.info if isinstance(self.info, DenseInfo) else None

  @property
  def has_bias(self) -> bool:
    """Whether a bias leaf follows the kernel (layers whose info says `kernel_and_bias`)."""
    if self.logical is not None:
      return self.logical.has_bias
    return getattr(self.info, "kernel_and_bias", False) and len(self.leaf_indices) == 2

  @property
  def num_params(self) -> int:
    return sum(math.prod(s) for s in self.param_shapes)


@dataclasses.dataclass(frozen=True)
class ConvInfo:
  """A convolution `out = conv_general_dilated(x, kernel, ...)` as the primitive describes it
  (`*_spec`: `ConvDimensionNumbers` fields), the kernel operand the leaf after `kernel_view`."""

  kernel_view: tuple[Any, ...]
  lhs_spec: tuple[int, ...]
  rhs_spec: tuple[int, ...]
  out_spec: tuple[int, ...]
  window_strides: tuple[int, ...]
  padding: tuple[tuple[int, int], ...]
  lhs_dilation: tuple[int, ...]
  rhs_dilation: tuple[int, ...]
  feature_group_count: int
  in_channels: int  # C, all groups
  out_channels: int  # O, all groups
  kernel_spatial: tuple[int, ...]
  input_shape: tuple[int, ...]
  output_shape: tuple[int, ...]
  kernel_and_bias: ClassVar[bool] = True

  @property
  def depthwise(self) -> bool:
    return 1 < self.feature_group_count == self.in_channels


@dataclasses.dataclass(frozen=True)
class ScaleShiftInfo:
  """`out = x̂ * scale + shift`, the parameters spanning the axes `feature_shape` of `out`.

  x̂ (the input operands' product, of `output_shape`) has the batch on `batch_axis`; the
  parameters span `out`'s axes from `feature_axis` on (None: the trailing ones). `example_rows`
  False: rows not grouped by example. `feature_index`: for a shift-only table read through a
  constant gather, the parameter entry each feature reads (int32 bytes; empty: in order).
  """

  has_scale: bool
  has_shift: bool
  feature_shape: tuple[int, ...]
  output_shape: tuple[int, ...]
  feature_axis: int | None = None
  batch_axis: int = 0
  example_rows: bool = True
  feature_index: bytes = b""

  def feature_entries(self) -> np.ndarray | None:
    """`feature_index` as a flat int array, or None when the features are the parameter."""
    return np.frombuffer(self.feature_index, np.int32) if self.feature_index else None


@dataclasses.dataclass(frozen=True)
class EmbeddingInfo:
  """`out[..., :] = table[ids[...], :]` with `table` (after `table_view`) of shape [vocab, dim]."""

  table_view: tuple[Any, ...]
  vocab_size: int
  dim: int


@dataclasses.dataclass(frozen=True)
class FallbackInfo:
  """`LayerSpec.info` of a fallback (generic) layer: why the scanner matched no layer."""

  reason: str
