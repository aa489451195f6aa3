"""Matching convolution, embedding and scale-and-shift layers (automatic and manual tags).

Each matcher looks at one equation that really uses a parameter leaf (see `_scanner`) and, when
the pattern fits, returns `(LayerSpec, output key, input atoms)`: the curvature pass adds its
zero perturbation at the output key and records the input atoms; the block turns both into
statistics. Patterns:

  conv              `conv_general_dilated(x, kernel)` with the kernel a (viewed) parameter leaf, any
                    spatial rank, strides, padding, dilations, dimension numbers and feature groups
                    (`batch_group_count` must be 1), and an optional bias `add` aligned with the
                    output feature axis.
  embedding         `gather(table, ids)` taking whole rows of a 2-d parameter `[vocab, dim]`
                    (`jnp.take(table, ids, axis=0)`, `table[ids]`, Flax `Embed`), and the same
                    lookup written as a product `one_hot(ids, vocab) @ table` (`jax.nn.one_hot`,
                    `(ids[..., None] == jnp.arange(vocab)).astype(...)`, through `jnp.dot`,
                    `jnp.einsum` or `@`, with casts of either operand): the one-hot operand is
                    traced back through casts to `eq(ids, iota)` along the contracted axis. Only
                    the ids are recorded, so the block never forms a vocab × vocab factor. The
                    table must be read as itself (`[vocab, dim]`, casts only) and stand on the
                    right of the product; other one-hot products stay dense layers.
  scale_and_shift   `x * scale (+ shift)` and `x + shift` with the parameters broadcast over the
                    leading axes of the output; a second multiplication by an activation right
                    after the scale is folded in, which covers Flax's normalisation layers
                    (`y = (x - mean) * (rsqrt(var + eps) * scale) + bias`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import numpy as np

from kfac_jax import _compat, _graph

# --------------------------------------------------------------------------------------------
# Static descriptions.


@dataclasses.dataclass(frozen=True)
class ConvInfo:
  """A convolution `out = conv_general_dilated(x, kernel, ...)`, as the primitive describes it.

  `lhs_spec`, `rhs_spec`, `out_spec` are `ConvDimensionNumbers` fields: for the input, the
  positions of (batch, feature, spatial...); for the kernel, (out feature, in feature,
  spatial...); for the output, (batch, feature, spatial...). `padding` is explicit `(lo, hi)`
  pairs. The kernel operand is the parameter leaf after `kernel_view`.
  """

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

  @property
  def groups(self) -> int:
    return self.feature_group_count

  @property
  def depthwise(self) -> bool:
    return self.groups > 1 and self.groups == self.in_channels

  @property
  def patch_dim(self) -> int:
    """Inputs of one group's patch: (C / groups) · prod(kernel_spatial)."""
    return self.in_channels // self.groups * math.prod(self.kernel_spatial)

  @property
  def out_per_group(self) -> int:
    return self.out_channels // self.groups


@dataclasses.dataclass(frozen=True)
class ScaleShiftInfo:
  """`out = x̂ * scale + shift`, the parameters spanning the axes `feature_shape` of `out`.

  x̂ is the product of the layer's input operands (one, or two when a following multiplication
  was folded in), broadcast to `output_shape`; its leading axis is the batch. The parameters
  span the consecutive axes of `out` from `feature_axis` on (None: the trailing axes; an int for
  a channel-first layout, e.g. 1 for a per-channel scale over `[N, C, H, W]`).
  """

  has_scale: bool
  has_shift: bool
  feature_shape: tuple[int, ...]
  output_shape: tuple[int, ...]
  feature_axis: int | None = None


@dataclasses.dataclass(frozen=True)
class EmbeddingInfo:
  """`out[..., :] = table[ids[...], :]` with `table` (after `table_view`) of shape [vocab, dim]."""

  table_view: tuple[Any, ...]
  vocab_size: int
  dim: int


def conv_kron_shapes(info: ConvInfo, has_bias: bool):
  a = info.patch_dim + (1 if has_bias else 0)
  o = info.out_per_group
  if info.groups == 1:
    return ((a, a), (o, o))
  return ((info.groups, a, a), (info.groups, o, o))


def _conv_info(chain, params, x_shape, k_shape, out_shape) -> ConvInfo:
  dn = params["dimension_numbers"]
  lhs, rhs, out = tuple(dn.lhs_spec), tuple(dn.rhs_spec), tuple(dn.out_spec)
  return ConvInfo(
    kernel_view=tuple(chain),
    lhs_spec=lhs,
    rhs_spec=rhs,
    out_spec=out,
    window_strides=tuple(int(s) for s in params["window_strides"]),
    padding=tuple((int(a), int(b)) for a, b in params["padding"]),
    lhs_dilation=tuple(int(s) for s in params["lhs_dilation"]),
    rhs_dilation=tuple(int(s) for s in params["rhs_dilation"]),
    feature_group_count=int(params["feature_group_count"]),
    in_channels=int(x_shape[lhs[1]]),
    out_channels=int(k_shape[rhs[0]]),
    kernel_spatial=tuple(int(k_shape[d]) for d in rhs[2:]),
    input_shape=tuple(x_shape),
    output_shape=tuple(out_shape),
  )


def default_conv_approx(info: ConvInfo) -> str:
  return "diagonal" if info.depthwise else "kron"


def default_approx(kind: str, info) -> str | None:
  """The library default for a layer of `kind` that depends on its shape (None: the kind's).

  Depthwise convolutions are "diagonal"; a shift-only table added over the batch, spanning more
  than one trailing axis (a learned positional embedding `x + pos`, `pos: [1, L, D]`), is
  "diagonal": its "full" block would be quadratic in L·D (10.6 GiB for ViT-Ti/16).
  """
  if kind == "conv" and info is not None:
    return default_conv_approx(info)
  if (
    kind == "scale_and_shift"
    and isinstance(info, ScaleShiftInfo)
    and not info.has_scale
    and len(info.feature_shape) > 1
  ):
    return "diagonal"
  return None


def default_approx_note(kind: str, info) -> str:
  if kind == "scale_and_shift":
    return (
      f"shift-only table {'x'.join(map(str, info.feature_shape))} (positional embedding): diagonal"
    )
  return ""


# --------------------------------------------------------------------------------------------
# Helpers on the scanner's tables.


def _single_use_leaf(sc, atom, claimed, shared: bool = False):
  """(leaf, chain) if `atom` is a view of an unclaimed leaf used once on the loss slice (or,
  with `shared`, any number of times: one use of a shared layer)."""
  if not _graph.is_key(atom) or atom not in sc.origin:
    return None
  leaf, chain = sc.origin[atom]
  if leaf in claimed or (not shared and len(sc.uses.get(leaf, [])) != 1):
    return None
  return leaf, chain


def _only_consumer(sc, key):
  cons = sc.slice_consumers.get(key, [])
  return cons[0] if len(cons) == 1 else None


def _trailing_feature_shape(leaf_shape, chain, view_shape, out_shape):
  """The trailing axes of `out_shape` a parameter spans when broadcast over the leading ones.

  Returns None when the parameter is transposed or broadcast along a trailing axis.
  """
  n = math.prod(leaf_shape)
  nd = len(out_shape)
  if len(view_shape) > nd or any(s.op == "transpose" for s in chain):
    return None
  for s in chain:
    if s.op == "broadcast":  # Must broadcast along leading axes only (numpy-style).
      k = len(s.in_shape)
      if s.perm != tuple(range(len(s.out_shape) - k, len(s.out_shape))):
        return None
      if any(a not in (1, b) for a, b in zip(s.in_shape, s.out_shape[-k:] if k else ())):
        return None
  view = (1,) * (nd - len(view_shape)) + tuple(view_shape)
  for k in range(nd + 1):
    size = math.prod(out_shape[nd - k :])
    if size > n:
      return None
    if (
      size == n
      and view[nd - k :] == tuple(out_shape[nd - k :])
      and all(v in (1, o) for v, o in zip(view[: nd - k], out_shape[: nd - k]))
    ):
      return tuple(out_shape[nd - k :])
  return None


def _feature_block(leaf_shape, chain, view_shape, out_shape):
  """`(feature_axis, feature_shape)`: the consecutive axes of `out_shape` a parameter spans,
  broadcast along all others. `feature_axis` is None for trailing axes (`_trailing_feature_shape`,
  tried first); else the parameter reaches an inner block only through reshapes and unit axes
  (a per-channel scale `[C]` viewed as `[1, C, 1, 1]` over `[N, C, H, W]`, as equinox's
  BatchNorm does), never through a transpose or a broadcast that copies it.
  """
  feat = _trailing_feature_shape(leaf_shape, chain, view_shape, out_shape)
  if feat is not None:
    return None, feat
  nd = len(out_shape)
  if len(view_shape) > nd or any(s.op in ("transpose", "broadcast") for s in chain):
    return None
  view = (1,) * (nd - len(view_shape)) + tuple(view_shape)
  wide = [a for a in range(nd) if view[a] != 1]
  if not wide or wide[0] == 0 or math.prod(view) != math.prod(leaf_shape):
    return None
  a, b = wide[0], wide[-1] + 1
  if view[a:b] != tuple(out_shape[a:b]):
    return None
  return a, tuple(out_shape[a:b])


def _match_bias_add(sc, key, out_shape, feature_axis, size, claimed, shared: bool = False):
  """A single-use (or, with `shared`, any) parameter added to `key` along `feature_axis` (size
  `size`) only."""
  use = _only_consumer(sc, key)
  if use is None or sc.g.eqns[use[0]].name != "add":
    return None
  fe = sc.g.eqns[use[0]]
  found = _single_use_leaf(sc, fe.ins[1 - use[1]], claimed, shared)
  if found is None:
    return None
  leaf, chain = found
  if math.prod(sc.shapes[leaf]) != size or any(s.op == "transpose" for s in chain):
    return None
  if tuple(fe.outs[0][1].aval.shape) != tuple(out_shape):
    return None
  b_shape = tuple(_graph.aval_of(fe.ins[1 - use[1]]).shape)
  b_shape = (1,) * (len(out_shape) - len(b_shape)) + b_shape
  if len(b_shape) != len(out_shape) or b_shape[feature_axis] != size:
    return None
  if any(s.op == "broadcast" for s in chain):
    return None
  return leaf, fe.outs[0]


# Layout-only operations an output may pass through between its product and its bias: the
# unit axes `jax.vmap` leaves around a per-example layer (equinox), transposes, casts.
_OUTPUT_VIEW_OPS = frozenset(
  {"reshape", "squeeze", "transpose", "convert_element_type", "copy", "copy_p", "broadcast_in_dim"}
)


def _index_view(fe, idx: np.ndarray) -> np.ndarray | None:
  """`idx` (an integer array of the operand's shape) moved by the layout op `fe`, or None for an
  op that is not a pure relayout (a real broadcast)."""
  out_shape = tuple(fe.outs[0][1].aval.shape)
  if fe.name == "transpose":
    return idx.transpose(tuple(fe.params["permutation"]))
  if fe.name == "broadcast_in_dim":
    dims = tuple(fe.params["broadcast_dimensions"])
    expanded = idx.reshape(
      [idx.shape[dims.index(d)] if d in dims else 1 for d in range(len(out_shape))]
    )
    return np.broadcast_to(expanded, out_shape)
  if fe.name in ("reshape", "squeeze"):
    return idx.reshape(out_shape)
  return idx  # Casts and copies.


def _leaf_index_view(sc, leaf, chain) -> np.ndarray:
  """Which entry of `leaf` (flat index) each entry of the viewed operand reads."""
  idx = np.arange(math.prod(sc.shapes[leaf])).reshape(sc.shapes[leaf])
  for st in chain:
    if st.op == "transpose":
      idx = idx.transpose(st.perm)
    elif st.op == "broadcast":
      expanded = idx.reshape(
        [idx.shape[st.perm.index(d)] if d in st.perm else 1 for d in range(len(st.out_shape))]
      )
      idx = np.broadcast_to(expanded, st.out_shape)
    elif st.op == "reshape":
      idx = idx.reshape(st.out_shape)
  return idx


def follow_bias(sc, key, feature_of: np.ndarray, claimed, shared: bool = False):
  """`(bias leaf, key of the sum)` if `key`, through layout-only ops, gets a parameter added whose
  entry f lands exactly on the entries with `feature_of == f`; else None.

  `feature_of` has `key`'s shape and holds the output feature (column of the layer's matrix)
  of each entry. This covers a bias broadcast to the full output shape (Haiku's
  `jnp.broadcast_to(b, out.shape)`), a per-example layer under `jax.vmap` (equinox: unit axes
  reshaped away, the output transposed before the add), and plain `out + b`. Each op on the way
  must be the only use of its input on the loss slice, so that the bias's gradient is the sum of
  the layer output's gradient over the positions.
  """
  idx = feature_of
  for _ in range(16):
    use = _only_consumer(sc, key)
    if use is None:
      return None
    fe = sc.g.eqns[use[0]]
    if fe.name in _OUTPUT_VIEW_OPS and use[1] == 0:
      out_shape = tuple(fe.outs[0][1].aval.shape)
      if fe.name == "broadcast_in_dim" and math.prod(out_shape) != idx.size:
        return None
      idx, key = _index_view(fe, idx), fe.outs[0]
      continue
    if fe.name != "add" or len(fe.ins) != 2:
      return None
    found = _single_use_leaf(sc, fe.ins[1 - use[1]], claimed, shared)
    if found is None:
      return None
    leaf, chain = found
    out_shape = tuple(fe.outs[0][1].aval.shape)
    n = math.prod(sc.shapes[leaf])
    b = _leaf_index_view(sc, leaf, chain)
    if b.ndim == len(out_shape) and all(d in (1, o) for d, o in zip(b.shape, out_shape)):
      b = np.broadcast_to(b, out_shape)  # Unit axes broadcast by the add (vmap's batching).
    if b.shape != out_shape or idx.shape != out_shape or n != int(idx.max()) + 1:
      return None
    if not np.array_equal(b, idx):
      return None
    return leaf, fe.outs[0]
  return None


def conv_feature_of(info: ConvInfo) -> np.ndarray:
  """The output channel of each entry of a convolution's output."""
  shape = [1] * len(info.output_shape)
  shape[info.out_spec[1]] = info.out_channels
  return np.broadcast_to(np.arange(info.out_channels).reshape(shape), info.output_shape)


# --------------------------------------------------------------------------------------------
# Automatic matching.


def conv_use(sc, i, claimed, shared: bool = False):
  """`(ConvInfo, kernel leaf, x atom, output key, bias leaf or None)` if equation i convolves an
  activation with a (viewed) parameter kernel, else None. With `shared`, the kernel and the bias
  may have other uses (one use of a shared layer)."""
  fe = sc.g.eqns[i]
  if fe.name != "conv_general_dilated" or fe.params.get("batch_group_count", 1) != 1:
    return None
  ops = sc.uses_by_eqn.get(i, [])
  if len(ops) != 1 or ops[0][1] != 1:
    return None
  found = _single_use_leaf(sc, fe.ins[1], claimed, shared)
  if found is None:
    return None
  k_leaf, chain = found
  if any(s.op not in ("reshape", "transpose", "cast") for s in chain):
    return None
  x_atom, k_atom = fe.ins[0], fe.ins[1]
  out_key = fe.outs[0]
  out_shape = tuple(out_key[1].aval.shape)
  info = _conv_info(
    chain, fe.params, _graph.aval_of(x_atom).shape, _graph.aval_of(k_atom).shape, out_shape
  )
  bias = _match_bias_add(
    sc, out_key, out_shape, info.out_spec[1], info.out_channels, claimed, shared
  )
  if bias is None:  # A broadcast bias, or one behind layout ops; the tap stays at the conv.
    bias = follow_bias(sc, out_key, conv_feature_of(info), claimed, shared)
    bias = None if bias is None else (bias[0], out_key)
  b_leaf, out_key = bias if bias is not None else (None, out_key)
  return info, k_leaf, x_atom, out_key, b_leaf


def conv_kernel_layout(info: ConvInfo) -> tuple[Any, ...]:
  """What fixes how a convolution reads its kernel as the `[window · in, out]` matrix: uses of
  a shared kernel must agree on it (strides, padding and input shapes may differ)."""
  return (
    info.kernel_view,
    info.rhs_spec,
    info.feature_group_count,
    info.kernel_spatial,
    info.in_channels,
    info.out_channels,
  )


def match_conv(sc, i, claimed):
  found = conv_use(sc, i, claimed)
  if found is None:
    return None
  info, k_leaf, x_atom, out_key, b_leaf = found
  leaves = [k_leaf] + ([b_leaf] if b_leaf is not None else [])
  spec = sc.layer_spec(
    "conv", leaves, info, None, "auto", conv_kron_shapes(info, b_leaf is not None)
  )
  sc._claim(claimed, leaves, spec.name)
  return spec, out_key, (x_atom,)


def match_embedding(sc, i, claimed):
  fe = sc.g.eqns[i]
  if fe.name != "gather":
    return None
  ops = sc.uses_by_eqn.get(i, [])
  if len(ops) != 1 or ops[0][1] != 0:
    return None
  found = _single_use_leaf(sc, fe.ins[0], claimed)
  if found is None:
    return None
  use = embedding_use(sc, i)
  if use is None:
    return None
  info, ids, out_key = use
  spec = sc.layer_spec(
    "embedding", [found[0]], info, None, "auto", ((info.vocab_size,), (info.dim, info.dim))
  )
  sc._claim(claimed, [found[0]], spec.name)
  return spec, out_key, (ids,)


def embedding_use(sc, i):
  """`(EmbeddingInfo, ids atom, output key)` if equation i takes whole rows of a [vocab, dim]
  parameter table (its operand 0), else None."""
  fe = sc.g.eqns[i]
  if fe.name != "gather" or not _graph.is_key(fe.ins[0]) or fe.ins[0] not in sc.origin:
    return None
  chain = sc.origin[fe.ins[0]][1]
  t_shape = tuple(_graph.aval_of(fe.ins[0]).shape)
  if any(s.op != "cast" for s in chain) or len(t_shape) != 2:
    return None
  idx_shape = tuple(_graph.aval_of(fe.ins[1]).shape)
  out_shape = tuple(fe.outs[0][1].aval.shape)
  dn = fe.params["dimension_numbers"]
  if (
    tuple(dn.offset_dims) != (len(out_shape) - 1,)
    or tuple(dn.collapsed_slice_dims) != (0,)
    or tuple(dn.start_index_map) != (0,)
    or tuple(dn.operand_batching_dims)
    or tuple(fe.params["slice_sizes"]) != (1, t_shape[1])
    or not idx_shape
    or idx_shape[-1] != 1
    or out_shape != idx_shape[:-1] + (t_shape[1],)
  ):
    return None
  return EmbeddingInfo(tuple(chain), int(t_shape[0]), int(t_shape[1])), fe.ins[1], fe.outs[0]


def _producer(sc, atom):
  """The equation computing `atom`, or None for inputs, constants and literals."""
  if not _graph.is_key(atom):
    return None
  i = sc.producer.get(atom)
  return None if i is None else sc.g.eqns[i]


def _constant_value(sc, atom):
  """The value of a literal or closed-over constant as a numpy array; None otherwise (also for a
  constant that is a tracer, e.g. closed over inside an outer `jit`)."""
  if isinstance(atom, _compat.Literal):
    value = atom.val
  elif _graph.is_key(atom) and atom in sc.const_values:
    value = sc.const_values[atom]
  else:
    return None
  try:
    return np.asarray(value)
  except jax.errors.JAXTypeError:  # A tracer.
    return None


def _iota_axis(sc, atom) -> tuple[int, int] | None:
  """`(axis, n)` if `atom` holds 0, 1, ..., n-1 along `axis` and is constant along the others.

  Follows casts and `broadcast_in_dim` back to an `iota` (or a constant such as `np.arange`).
  """
  value = _constant_value(sc, atom)
  if value is not None:
    if not np.issubdtype(value.dtype, np.number):
      return None
    for axis, n in enumerate(value.shape):
      if n > 1:
        ramp = np.arange(n).reshape([n if d == axis else 1 for d in range(value.ndim)])
        return (axis, n) if np.array_equal(value, np.broadcast_to(ramp, value.shape)) else None
    return None
  fe = _producer(sc, atom)
  if fe is None:
    return None
  if fe.name == "iota":
    shape, axis = tuple(fe.params["shape"]), int(fe.params["dimension"])
    return axis, int(shape[axis])
  if fe.name in ("convert_element_type", "copy", "copy_p"):
    return _iota_axis(sc, fe.ins[0])
  if fe.name == "broadcast_in_dim":
    inner = _iota_axis(sc, fe.ins[0])
    if inner is None:
      return None
    axis, n = inner
    return int(fe.params["broadcast_dimensions"][axis]), n
  return None


def one_hot_ids(sc, atom, axis: int, vocab: int):
  """The integer ids atom if `atom` is `cast(ids == iota)` with the iota along `axis` (size
  `vocab`), i.e. a one-hot encoding with the vocabulary on `axis`; else None.

  The ids atom returned has the one-hot's shape with `axis` dropped or of size 1, so its
  row-major order is that of the one-hot's other axes.
  """
  fe = _producer(sc, atom)
  while fe is not None and fe.name in ("convert_element_type", "copy", "copy_p"):
    fe = _producer(sc, fe.ins[0])
  if fe is None or fe.name != "eq":
    return None
  shape = tuple(fe.outs[0][1].aval.shape)
  if axis >= len(shape) or shape[axis] != vocab:
    return None
  squeezed = shape[:axis] + (1,) + shape[axis + 1 :]
  for pos in (0, 1):
    if _iota_axis(sc, fe.ins[pos]) != (axis, vocab):
      continue
    ids = fe.ins[1 - pos]
    ids_shape = tuple(_graph.aval_of(ids).shape)
    if ids_shape != squeezed:  # Broadcast along the vocabulary: look through the broadcast.
      b = _producer(sc, ids)
      if (
        ids_shape != shape
        or b is None
        or b.name != "broadcast_in_dim"
        or tuple(b.params["broadcast_dimensions"])
        != tuple(d for d in range(len(shape)) if d != axis)
      ):
        return None
      ids = b.ins[0]
    if not np.issubdtype(_graph.aval_of(ids).dtype, np.integer):
      return None
    return ids
  return None


def one_hot_embedding_use(sc, i):
  """`(EmbeddingInfo, ids atom, output key)` if equation i is `one_hot(ids, vocab) @ table` with
  `table` a (cast) `[vocab, dim]` parameter on the right; else None."""
  fe = sc.g.eqns[i]
  if fe.name != "dot_general" or not _graph.is_key(fe.ins[1]) or fe.ins[1] not in sc.origin:
    return None
  (lhs_c, rhs_c), (lhs_b, rhs_b) = fe.params["dimension_numbers"]
  chain = sc.origin[fe.ins[1]][1]
  t_shape = tuple(_graph.aval_of(fe.ins[1]).shape)
  if (
    lhs_b
    or rhs_b
    or len(t_shape) != 2
    or tuple(rhs_c) != (0,)
    or len(lhs_c) != 1
    or any(s.op != "cast" for s in chain)
  ):
    return None
  ids = one_hot_ids(sc, fe.ins[0], int(lhs_c[0]), t_shape[0])
  if ids is None:
    return None
  return EmbeddingInfo(tuple(chain), int(t_shape[0]), int(t_shape[1])), ids, fe.outs[0]


def match_scale_and_shift(sc, i, claimed):
  found = scale_shift_use(sc, i, claimed)
  if found is None:
    return None
  info, leaf, inputs, out_key, shift_leaf = found
  leaves = [leaf] + ([shift_leaf] if shift_leaf is not None else [])
  spec = sc.layer_spec("scale_and_shift", leaves, info, None, "auto", ())
  sc._claim(claimed, leaves, spec.name)
  return spec, out_key, inputs


def scale_shift_use(sc, i, claimed, shared: bool = False):
  """`(ScaleShiftInfo, leaf, input atoms, output key, shift leaf or None)` if equation i
  multiplies an activation by a parameter (then `leaf` is the scale, and a following shift is
  matched too) or adds one to it (`leaf` is the shift); else None. With `shared`, the
  parameters may have other uses (one use of a shared layer)."""
  fe = sc.g.eqns[i]
  if fe.name not in ("mul", "add") or len(fe.ins) != 2:
    return None
  ops = sc.uses_by_eqn.get(i, [])
  if len(ops) != 1:
    return None
  leaf, pos = ops[0]
  found = _single_use_leaf(sc, fe.ins[pos], claimed, shared)
  other = fe.ins[1 - pos]
  if found is None or not _graph.is_key(other) or other in sc.origin:
    return None
  chain = found[1]
  view_shape = tuple(_graph.aval_of(fe.ins[pos]).shape)
  out_key = fe.outs[0]
  inputs: tuple = ()
  if fe.name == "mul":
    inputs = (other,)
    use = _only_consumer(sc, out_key)
    if use is not None and sc.g.eqns[use[0]].name == "mul":
      nxt = sc.g.eqns[use[0]]
      y = nxt.ins[1 - use[1]]
      if _graph.is_key(y) and y not in sc.origin:
        inputs, out_key = (other, y), nxt.outs[0]
  elif tuple(_graph.aval_of(other).shape) != tuple(out_key[1].aval.shape):
    return None  # A shift must not broadcast the activation.
  out_shape = tuple(out_key[1].aval.shape)
  if not out_shape or out_shape[0] != sc.batch_size:
    return None
  block = _feature_block(sc.shapes[leaf], chain, view_shape, out_shape)
  if block is None or len(block[1]) == len(out_shape):
    return None
  axis, feat = block
  shift_leaf = None
  has_shift = fe.name == "add"
  if not has_shift:
    shift = _match_shift(sc, out_key, out_shape, block, claimed, shared)
    if shift is not None:
      shift_leaf, out_key = shift
      has_shift = True
  info = ScaleShiftInfo(
    has_scale=fe.name == "mul",
    has_shift=has_shift,
    feature_shape=feat,
    output_shape=out_shape,
    feature_axis=axis,
  )
  return info, leaf, inputs, out_key, shift_leaf


def _match_shift(sc, key, out_shape, block, claimed, shared: bool = False):
  use = _only_consumer(sc, key)
  if use is None or sc.g.eqns[use[0]].name != "add":
    return None
  fe = sc.g.eqns[use[0]]
  atom = fe.ins[1 - use[1]]
  found = _single_use_leaf(sc, atom, claimed, shared)
  if found is None or tuple(fe.outs[0][1].aval.shape) != tuple(out_shape):
    return None
  leaf, chain = found
  if _feature_block(sc.shapes[leaf], chain, tuple(_graph.aval_of(atom).shape), out_shape) != block:
    return None  # The shift must span the scale's axes.
  return leaf, fe.outs[0]


# --------------------------------------------------------------------------------------------
# Manual tags.


def manual(sc, fe, claimed):
  """The LayerSpec of a `register_conv` / `register_scale_and_shift` / `register_embedding` tag."""
  kind, approx = fe.params["kind"], fe.params["approx"]
  fn = f"register_{kind}"
  y = fe.ins[0]
  if not _graph.is_key(y):
    raise sc.error(f"{fn}: the layer output `y` is a constant, not computed from the input.")
  y_shape = tuple(_graph.aval_of(y).shape)

  def leaf(atom, what):
    j, chain = sc._leaf_for_operand(atom, what, fn)
    if any(s.op == "broadcast" for s in chain) and kind != "scale_and_shift":
      raise sc.error(
        f"{fn}: `{what}` (`{sc.paths[j]}`) is broadcast before the tag; pass the parameter itself."
      )
    return j, chain

  if kind == "conv":
    x, kernel = fe.ins[1], fe.ins[2]
    k_leaf, chain = leaf(kernel, "kernel")
    leaves = [k_leaf]
    if len(fe.ins) > 3:
      leaves.append(leaf(fe.ins[3], "bias")[0])
    info = _conv_info(
      chain, fe.params, _graph.aval_of(x).shape, _graph.aval_of(kernel).shape, y_shape
    )
    approx = sc._check_approx("conv", approx, [sc.paths[j] for j in leaves])
    spec = sc.layer_spec(
      "conv", leaves, info, approx, "manual", conv_kron_shapes(info, len(leaves) == 2)
    )
    inputs = (x,)
  elif kind == "embedding":
    ids, table = fe.ins[1], fe.ins[2]
    t_leaf, chain = leaf(table, "table")
    if any(s.op != "cast" for s in chain):
      raise sc.error(
        f"{fn}: `table` (`{sc.paths[t_leaf]}`) is reshaped or transposed before "
        "the tag; pass the [vocab, dim] parameter itself."
      )
    t_shape = _graph.aval_of(table).shape
    info = EmbeddingInfo(tuple(chain), int(t_shape[0]), int(t_shape[1]))
    approx = sc._check_approx("embedding", approx, [sc.paths[t_leaf]])
    spec = sc.layer_spec(
      "embedding", [t_leaf], info, approx, "manual", ((info.vocab_size,), (info.dim, info.dim))
    )
    leaves, inputs = [t_leaf], (ids,)
  else:  # scale_and_shift: (y, x, scale?, shift?)
    if y_shape[0] != sc.batch_size:
      raise sc.error(
        f"{fn}: `y` has shape {y_shape}, but its leading axis must be the batch of the loss "
        f"tags ({sc.batch_size})."
      )
    leaves, feats = [], []
    for atom, what in zip(
      fe.ins[2:],
      [n for n, h in (("scale", fe.params["has_scale"]), ("shift", fe.params["has_shift"])) if h],
    ):
      j, chain = leaf(atom, what)
      f = _trailing_feature_shape(sc.shapes[j], chain, tuple(_graph.aval_of(atom).shape), y_shape)
      if f is None or len(f) == len(y_shape):
        raise sc.error(
          f"{fn}: `{what}` (`{sc.paths[j]}`, shape {sc.shapes[j]}) does not span "
          f"trailing axes of y {y_shape}."
        )
      leaves.append(j)
      feats.append(f)
    if len(set(feats)) > 1:
      raise sc.error(f"{fn}: `scale` and `shift` span different axes of y: {feats}.")
    info = ScaleShiftInfo(
      has_scale=fe.params["has_scale"],
      has_shift=fe.params["has_shift"],
      feature_shape=feats[0],
      output_shape=y_shape,
    )
    approx = sc._check_approx("scale_and_shift", approx, [sc.paths[j] for j in leaves])
    spec = sc.layer_spec("scale_and_shift", leaves, info, approx, "manual", ())
    inputs = (fe.ins[1],) if info.has_scale else ()
  for j in leaves:  # One tag registers one use: a parameter used again elsewhere is miscounted.
    sc.check_use_count(
      j,
      1,
      fn,
      "remove the tag so that the scanner registers the uses together as one "
      "shared layer, or cover the parameter with register_generic",
    )
  sc._claim(claimed, leaves, spec.name)
  return spec, y, inputs
