"""Matchers: pure functions that find one layer kind in the graph index.

A matcher reads the graph index (`_index.GraphIndex`) and the leaves claimed so far, looks at
one equation that really uses a parameter leaf (or, for `_matchers_shared.match_shared`, at every
use of one leaf), and returns a `Match` or None: the layer's leaves and, per use, its matching
details (`DenseInfo`, `ConvInfo`, ...), the output key where the curvature pass adds its zero
perturbation and the input atoms it records; the block turns both into statistics. A matcher
changes nothing: the scanner (`_scanner._Scanner`) runs them in a fixed order, builds the
`LayerSpec` and claims the leaves. The `read_*_tag` functions read a kind's manual layer tag the
same way. Which matcher belongs to which kind, and in which pass it runs, is declared once, in
the kind's record (`_kinds.KINDS`).

The matchers live in four modules, each importing only the ones before it:

  `_matchers`         (this one) `Match`, the helpers on the index every matcher uses, the
                      dense, conv and scale-and-shift matchers with their biases and shifts,
                      the manual tag readers;
  `_stacked`          `match_batched_dense` (L dense layers in one batched product),
                      `match_stacked_scale_and_shift` (L scales and shifts in one product) and
                      the merge of per-slice layers of a stacked leaf;
  `_matchers_embed`   tables: embedding lookups (gather or one-hot product) and learned tokens;
  `_matchers_shared`  `match_shared`: one layer for a leaf with several uses of any kind above.

Patterns matched here:

  dense             `dot_general(x, kernel)` without batch dimensions, the kernel a (reshaped,
                    transposed, cast) parameter leaf; its `[in, out]` matrix is the contracted
                    then the free kernel axes (`dense_product`, shared with the stacked
                    matcher); an optional bias added along the output features. A one-hot
                    product `one_hot(ids) @ table` is an embedding: the scanner tries
                    `_matchers_embed.match_one_hot_embedding` before `match_dense`.
  conv              `conv_general_dilated(x, kernel)` with the kernel a (viewed) parameter leaf, any
                    spatial rank, strides, padding, dilations, dimension numbers and feature groups
                    (`batch_group_count` must be 1), and an optional bias `add` aligned with the
                    output feature axis.
  scale_and_shift   `x * scale (+ shift)` and `x + shift` with the parameters spanning
                    consecutive axes of the output, broadcast along the others (trailing
                    features, or channel-first as equinox's BatchNorm and GroupNorm); a second
                    multiplication by an activation right after the scale is folded in, which
                    covers Flax's normalisation layers
                    (`y = (x - mean) * (rsqrt(var + eps) * scale) + bias`). Without an axis of
                    examples, rows as long as a batch input's (graph nodes, `node_rows`) are
                    the statistics' rows. Under `jax.vmap` over stacked parameters, the stack
                    is matched by `_stacked.match_stacked_scale_and_shift`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any

import numpy as np

from kfac_jax._specs import (
  ConvInfo,
  DenseInfo,
  EmbeddingInfo,
  RegistrationError,
  ScaleShiftInfo,
  ViewStep,
)
from kfac_jax.scan import _batch_axes, _graph

if TYPE_CHECKING:
  from kfac_jax._specs import Kind

# --------------------------------------------------------------------------------------------
# What a matcher returns.


@dataclasses.dataclass(frozen=True)
class Match:
  """A layer a matcher found in the graph: its parameter leaves and, per use, how it is applied.

  Attributes:
    kind: the layer kind (`_kinds.Kind`; "generic" only for a manual tag).
    leaves: the layer's leaves in the index (kernel / table / scale first, then bias / shift);
      virtual leaves (stack slices, concatenations) are mapped back by the scanner.
    infos: per use, the kind's matching details (`DenseInfo`, `ConvInfo`, ...).
    outputs: per use, the key where the curvature pass adds its zero perturbation.
    inputs: per use, the input atoms the block's statistics need.
    stack_size: L > 0 for a stack of L layers applied by one batched operation
      (`_stacked.match_batched_dense`); `infos` then describe one layer of it.
    stack_axes: with `stack_size`, the layer axis of the input and of the output.
  """

  kind: Kind
  leaves: tuple[int, ...]
  infos: tuple[Any, ...]
  outputs: tuple[Any, ...]
  inputs: tuple[Any, ...]
  stack_size: int = 0
  stack_axes: tuple[int, ...] = ()

  @classmethod
  def single(cls, kind, leaves, info, output, inputs, **stack) -> Match:
    """A layer with one use."""
    return cls(kind, tuple(leaves), (info,), (output,), (inputs,), **stack)

  @property
  def num_uses(self) -> int:
    return len(self.infos)


# --------------------------------------------------------------------------------------------
# Matching details (the info types themselves live in `_specs`).


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


# --------------------------------------------------------------------------------------------
# Helpers on the scanner's tables.


def without_batch_rows(ix, match: Match) -> bool:
  """Whether a match reads, in some use, a first input computed from parameters and constants
  alone (`GraphIndex.param_only`): learned latents projected, then multiplied with the batch's
  activations; ids computed from positions that are not a view of the table. For a kind whose
  statistics come from rows of examples (`LayerKind.batch_rows`) its rows are not examples and
  its output gradient is summed over the batch, so the scanner leaves such a match out; unless
  its tap is where its output is broadcast over the batch (`DenseInfo.shared_tap`)."""
  return any(
    ins and _graph.is_key(ins[0]) and ins[0] in ix.param_only and not getattr(inf, "shared_tap", 0)
    for ins, inf in zip(match.inputs, match.infos)
  )


def single_use_leaf(ix, atom, claimed, shared: bool = False):
  """(leaf, chain) if `atom` is a view of an unclaimed leaf used once on the loss slice (or,
  with `shared`, any number of times: one use of a shared layer)."""
  if not _graph.is_key(atom) or atom not in ix.origin:
    return None
  leaf, chain = ix.origin[atom]
  if leaf in claimed or (not shared and len(ix.uses.get(leaf, [])) != 1):
    return None
  return leaf, chain


def sole_param_operand(ix, i, prim: str):
  """`(leaf, operand position)` if equation i is a `prim` with exactly one parameter operand,
  a leaf used once on the loss slice; else None. The preamble of the kernel matchers."""
  if ix.g.eqns[i].name != prim:
    return None
  ops = ix.uses_by_eqn.get(i, [])
  if len(ops) != 1:
    return None  # No parameter, or a product of two parameters.
  leaf, pos = ops[0]
  return (leaf, pos) if len(ix.uses.get(leaf, [])) == 1 else None


def only_consumer(ix, key):
  cons = ix.slice_consumers.get(key, [])
  return cons[0] if len(cons) == 1 else None


def _trailing_feature_shape(leaf_shape, chain, view_shape, out_shape):
  """The trailing axes of `out_shape` a parameter spans when broadcast over the leading ones.

  Returns None when the parameter is transposed or broadcast along a trailing axis.
  """
  n = math.prod(leaf_shape)
  nd = len(out_shape)
  if len(view_shape) > nd or any(s.op in ("transpose", "gather") for s in chain):
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


def feature_block(leaf_shape, chain, view_shape, out_shape):
  """`(feature_axis, feature_shape)`: the consecutive axes of `out_shape` a parameter spans,
  broadcast along all others. `feature_axis` is None for trailing axes (`_trailing_feature_shape`,
  tried first); else the parameter, in its own row-major order, fills an inner block: a
  per-channel scale `[C]` viewed as `[1, C, 1, 1]` over `[N, C, H, W]` (equinox's BatchNorm) or
  broadcast to `[C, H, W]` first (equinox's GroupNorm, `left_broadcast_to`).
  """
  feat = _trailing_feature_shape(leaf_shape, chain, view_shape, out_shape)
  if feat is not None:
    return None, feat
  idx = _operand_index(leaf_shape, chain, view_shape, out_shape)
  if idx is None:
    return None
  block = _block_of(idx, out_shape, math.prod(leaf_shape))
  if block is None or block[0] == 0:
    return None
  a, b = block
  return (None if b == len(out_shape) else a), tuple(out_shape[a:b])


def stacked_feature_block(leaf_shape, chain, view_shape, out_shape):
  """`(stack_axis, feature_axis, feature_shape)` of a parameter `[L, ...]` read as L layers'
  parameters (`jax.vmap` / `nn.vmap` of a normalisation over stacked parameters): its leading
  axis lies along one axis of `out_shape` (the layer axis) and, per layer, the rest fills a
  block of consecutive axes as in `feature_block`; `feature_axis` is that block's start among
  the axes without the layer axis (None: trailing). None if the parameter is read otherwise."""
  if len(leaf_shape) < 2 or leaf_shape[0] < 2:
    return None
  idx = _operand_index(leaf_shape, chain, view_shape, out_shape)
  if idx is None:
    return None
  size, per = leaf_shape[0], math.prod(leaf_shape[1:])
  layer, feat = _collapse(idx // per), _collapse(idx % per)
  axes = [d for d in range(layer.ndim) if layer.shape[d] > 1]
  if len(axes) != 1 or out_shape[axes[0]] != size or feat.shape[axes[0]] != 1:
    return None
  s = axes[0]
  if not np.array_equal(layer.reshape(-1), np.arange(size)):
    return None
  per_out = tuple(out_shape[:s]) + tuple(out_shape[s + 1 :])
  block = _block_of(np.squeeze(feat, s), per_out, per)
  if block is None:
    return None
  a, b = block
  if b - a == len(per_out):
    return None
  return s, (None if b == len(per_out) else a), tuple(per_out[a:b])


def _operand_index(leaf_shape, chain, view_shape, out_shape) -> np.ndarray | None:
  """Which entry of the leaf (flat, row-major) each entry of the operand `view_shape` reads,
  with leading unit axes up to `out_shape`'s rank and every axis along which it is constant
  (broadcast) cut to length 1 (`_collapse`): about as many entries as the leaf, whatever the
  activation's size. None if the operand does not broadcast to `out_shape`."""
  idx = _index_of_view(leaf_shape, chain)
  nd = len(out_shape)
  if tuple(idx.shape) != tuple(view_shape) or idx.ndim > nd:
    return None
  idx = _collapse(idx.reshape((1,) * (nd - idx.ndim) + idx.shape))
  if any(v not in (1, o) for v, o in zip(idx.shape, out_shape)):
    return None
  return idx


def _collapse(idx: np.ndarray) -> np.ndarray:
  """`idx` cut to length 1 along every axis it is constant along; a broadcast's axes (stride
  0) are cut before anything is read."""
  idx = idx[tuple(slice(0, 1) if st == 0 else slice(None) for st in idx.strides)]
  for d in range(idx.ndim):
    if idx.shape[d] > 1 and not np.ptp(idx, axis=d).any():
      idx = idx[(slice(None),) * d + (slice(0, 1),)]
  return idx


def _block_of(idx: np.ndarray, out_shape, n: int) -> tuple[int, int] | None:
  """`(a, b)` if `idx` (collapsed, `_collapse`, over `out_shape`) is `arange(n)` laid over the
  axes `a..b-1` in row-major order and constant along every other axis; else None."""
  axes = [d for d in range(idx.ndim) if idx.shape[d] > 1]
  if not axes:
    return None
  a, b = axes[0], axes[-1] + 1
  if math.prod(out_shape[a:b]) != n:
    return None
  want = np.arange(n).reshape([out_shape[d] if a <= d < b else 1 for d in range(len(out_shape))])
  return (a, b) if np.array_equal(np.broadcast_to(idx, want.shape), want) else None


def _match_bias_add(ix, key, out_shape, feature_axis, size, claimed, shared: bool = False):
  """A single-use (or, with `shared`, any) parameter added to `key` along `feature_axis` (size
  `size`) only."""
  use = only_consumer(ix, key)
  if use is None or ix.g.eqns[use[0]].name != "add":
    return None
  fe = ix.g.eqns[use[0]]
  found = single_use_leaf(ix, fe.ins[1 - use[1]], claimed, shared)
  if found is None:
    return None
  leaf, chain = found
  if math.prod(ix.shapes[leaf]) != size or any(s.op in ("transpose", "gather") for s in chain):
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


def _index_view(fe, idx: np.ndarray) -> np.ndarray:
  """`idx` (an integer array of the operand's shape) moved by the layout op `fe` (the caller
  rejects a broadcast that is not a pure relayout)."""
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


def leaf_index_view(ix, leaf, chain) -> np.ndarray:
  """Which entry of `leaf` (flat index) each entry of the viewed operand reads."""
  return _index_of_view(ix.shapes[leaf], chain)


def _index_of_view(shape, chain) -> np.ndarray:
  """Which entry of a parameter of `shape` (flat index) each entry of its view by `chain`
  reads."""
  idx = np.arange(math.prod(shape)).reshape(shape)
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
    elif st.op == "gather":
      idx = idx[st.gathered_rows()]
  return idx


def follow_bias(ix, key, feature_of: np.ndarray, claimed, shared: bool = False):
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
    use = only_consumer(ix, key)
    if use is None:
      return None
    fe = ix.g.eqns[use[0]]
    if fe.name in _OUTPUT_VIEW_OPS and use[1] == 0:
      out_shape = tuple(fe.outs[0][1].aval.shape)
      if fe.name == "broadcast_in_dim" and math.prod(out_shape) != idx.size:
        return None
      idx, key = _index_view(fe, idx), fe.outs[0]
      continue
    if fe.name != "add" or len(fe.ins) != 2:
      return None
    found = single_use_leaf(ix, fe.ins[1 - use[1]], claimed, shared)
    if found is None:
      return None
    leaf, chain = found
    out_shape = tuple(fe.outs[0][1].aval.shape)
    n = math.prod(ix.shapes[leaf])
    b = leaf_index_view(ix, leaf, chain)
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
# Dense layers.


def dot_dims(dimension_numbers, k_pos: int):
  """`(k_contract, x_contract, k_batch, x_batch)` of a `dot_general` whose kernel is operand
  `k_pos` (0: lhs, 1: rhs) and whose activation is the other operand."""
  (lhs_c, rhs_c), (lhs_b, rhs_b) = dimension_numbers
  k_c, x_c, k_b, x_b = (rhs_c, lhs_c, rhs_b, lhs_b) if k_pos == 1 else (lhs_c, rhs_c, lhs_b, rhs_b)
  return tuple(map(int, k_c)), tuple(map(int, x_c)), tuple(map(int, k_b)), tuple(map(int, x_b))


def dense_product(
  k_shape,
  x_shape,
  k_contract,
  x_contract,
  k_pos: int,
  kernel_view=(),
  batch_size=None,
  x_batch_axis: int | None = None,
):
  """`(DenseInfo, k_free, x_free)` of a `dot_general` without batch dimensions, else None.

  The kernel operand (shape `k_shape`, operand `k_pos`) is read as the `[in, out]` matrix of its
  contracted then free axes, the activation as `[rows, in]`. `dot_general` lays its output out
  as (lhs free..., rhs free...). Shared by the dense matcher and the stacked one
  (`_stacked.batched_dense_use`, which drops the layer axis first). None when the kernel has no
  free or no contracted axis.

  The rows keep the activation's axis order, except that the batch axis is moved first in both
  the input's and the output's rows (a time-major `[T, N, D]` activation), so that the
  per-example approximations ("full", "diagonal", "ekfac"), which group the rows by example,
  find each example's rows together. ("kron" sums over the rows, so their order does not change
  it.) The batch axis is `x_batch_axis` (the activation's, followed from the batch inputs by
  `_batch_axes`) when it is a free axis; without it, with `batch_size`, the leading free axis
  when it has the batch's size, else the only other one that has it.
  """
  k_free = tuple(d for d in range(len(k_shape)) if d not in k_contract)
  x_free = tuple(d for d in range(len(x_shape)) if d not in x_contract)
  if not k_free or not k_contract:
    return None
  in_dim = math.prod(k_shape[d] for d in k_contract)
  out_dim = math.prod(k_shape[d] for d in k_free)
  rows = math.prod(x_shape[d] for d in x_free)
  n_xf, n_kf = len(x_free), len(k_free)
  order = list(range(n_xf))  # The row axes' order, as positions in x_free.
  if x_batch_axis is not None and x_batch_axis in x_free:
    first: int | None = x_free.index(x_batch_axis)
  else:
    first = _batch_axes.batch_position([x_shape[d] for d in x_free], batch_size)
  if first:  # Neither None nor already leading.
    order = [first] + [t for t in order if t != first]
  if k_pos == 1:  # out = (x_free..., k_free...)
    out_perm = tuple(order) + tuple(range(n_xf, n_xf + n_kf))
  else:  # out = (k_free..., x_free...)
    out_perm = tuple(n_kf + t for t in order) + tuple(range(n_kf))
  info = DenseInfo(
    kernel_view=tuple(kernel_view),
    kernel_perm=tuple(k_contract) + k_free,
    x_perm=tuple(x_free[t] for t in order) + tuple(x_contract),
    out_perm=out_perm,
    in_dim=int(in_dim),
    out_dim=int(out_dim),
    rows=int(rows),
  )
  return info, k_free, x_free


def dense_use(ix, i, k_pos):
  """`(info, x_atom, k_shape, k_free)` if equation i is a dense product, kernel at k_pos."""
  fe = ix.g.eqns[i]
  k_atom, x_atom = fe.ins[k_pos], fe.ins[1 - k_pos]
  _, k_chain = ix.origin[k_atom]
  if any(s.op not in ("reshape", "transpose", "cast") for s in k_chain):
    return None
  k_contract, x_contract, k_batch, x_batch = dot_dims(fe.params["dimension_numbers"], k_pos)
  if k_batch or x_batch:
    return None  # Batched products (e.g. per-head weights) are not dense layers.
  k_shape = tuple(_graph.aval_of(k_atom).shape)
  x_shape = tuple(_graph.aval_of(x_atom).shape)
  found = dense_product(
    k_shape,
    x_shape,
    k_contract,
    x_contract,
    k_pos,
    k_chain,
    ix.batch_size,
    followed_batch_axis(ix, x_atom),
  )
  if found is None:
    return None
  info, k_free, _ = found
  return info, x_atom, k_shape, k_free


def match_dense(ix, i, claimed):
  """A single-use kernel in a `dot_general` with an activation (and its bias). The scanner tries
  `_matchers_embed.match_one_hot_embedding` first, so `one_hot(ids) @ table` is an embedding."""
  fe = ix.g.eqns[i]
  kernel = (
    sole_param_operand(ix, i, "dot_general")
    or _beside_batch_view(ix, i)
    or _after_param_input(ix, i)
  )
  if kernel is None or kernel[0] in claimed:
    return None
  k_leaf, k_pos = kernel
  found = dense_use(ix, i, k_pos)
  if found is None:
    return None
  info, x_atom, k_shape, k_free = found
  leaves = [k_leaf]
  out_key = fe.outs[0]
  bias = match_dense_bias(ix, out_key, k_pos, k_shape, k_free, claimed)
  if bias is not None:
    b_leaf, out_key = bias
    leaves.append(b_leaf)
  if _graph.is_key(x_atom) and x_atom in ix.param_only:
    found = _batch_broadcast_tap(ix, out_key, info)
    if found is not None:
      out_key, info = found
  return Match.single("dense", leaves, info, out_key, (x_atom,))


def _batch_broadcast_tap(ix, key, info: DenseInfo):
  """`(tap key, info with its shared_tap)` for a dense layer whose input rows are computed from
  parameters and constants alone and whose output `key` (`[rows..., out...]`, or the product's
  layout) reaches the batch only through layout ops and a broadcast over a leading batch axis:
  `jnp.broadcast_to(probe @ w, (N, 1, D))`, or an add with an activation that broadcasts it
  (`x + table @ w`). Every example reads the same output there, so the gradient at that key is
  the per-example output gradient; else None."""
  s_shape = tuple(key[1].aval.shape)
  n = math.prod(s_shape)
  idx = np.arange(n).reshape(s_shape)
  for _ in range(16):
    shape = tuple(idx.shape)
    if key not in ix.param_only and len(shape) >= 2 and shape[0] == ix.batch_size > 1:
      if not (idx == idx[:1]).all():
        return None
      # Position of each product-output entry in the `[rows, out]` matrix (`out_perm`).
      where = np.empty(n, np.int64)
      where[np.arange(n).reshape(s_shape).transpose(info.out_perm).reshape(-1)] = np.arange(n)
      tap = where[idx[0].reshape(-1)].astype(np.int32).tobytes()
      return key, dataclasses.replace(info, shared_tap=tap)
    use = only_consumer(ix, key)
    if use is None:
      return None
    fe = ix.g.eqns[use[0]]
    out_shape = tuple(fe.outs[0][1].aval.shape)
    if fe.name in _OUTPUT_VIEW_OPS and use[1] == 0:
      idx = _index_view(fe, idx)
    elif fe.name == "add" and len(fe.ins) == 2 and len(out_shape) == idx.ndim:
      if any(a not in (1, b) for a, b in zip(idx.shape, out_shape)):
        return None
      idx = np.broadcast_to(idx, out_shape)  # Broadcast by the add over its size-1 axes.
    else:
      return None
    key = fe.outs[0]
  return None


def _beside_batch_view(ix, i):
  """`(kernel leaf, operand position)` if equation i is a `dot_general` of a single-use kernel
  leaf with a view of another leaf broadcast over the batch and the same for every example
  (big_vision's MAP head: a learned probe `[1, 1, D]` tiled over the batch, then the query
  projection). The probe's rows are shared by every example, so the kernel is a dense layer
  whose input rows are the same for each example; the probe is a layer of its own (learned
  tokens, `_matchers_embed.match_batch_tokens`)."""
  fe = ix.g.eqns[i]
  ops = ix.uses_by_eqn.get(i, [])
  if fe.name != "dot_general" or len(ops) != 2 or ops[0][0] == ops[1][0]:
    return None
  for (k_leaf, k_pos), (_, x_pos) in (ops, ops[::-1]):
    x_atom = fe.ins[x_pos]
    if len(ix.uses.get(k_leaf, [])) != 1 or x_atom in ix.param_only:
      continue
    x_shape = tuple(_graph.aval_of(x_atom).shape)
    if len(x_shape) < 2 or x_shape[0] != ix.batch_size or ix.batch_size < 2:
      continue
    idx = leaf_index_view(ix, ix.origin[x_atom][0], ix.origin[x_atom][1])
    if tuple(idx.shape) == x_shape and (idx == idx[:1]).all():
      return k_leaf, k_pos
  return None


def _after_param_input(ix, i):
  """`(kernel leaf, 1)` if equation i is `view(p) @ kernel` of two distinct leaves, the kernel
  used once: a learned probe projected before it is broadcast over the batch. The kernel is a
  layer only if its output reaches a broadcast over the batch (`_batch_broadcast_tap`); the
  probe itself has no per-example output there and is left to the fallback."""
  fe = ix.g.eqns[i]
  ops = ix.uses_by_eqn.get(i, [])
  if fe.name != "dot_general" or len(ops) != 2 or ops[0][0] == ops[1][0]:
    return None
  found = [(leaf, pos) for leaf, pos in ops if pos == 1]
  if not found or len(ix.uses.get(found[0][0], [])) != 1 or fe.ins[0] not in ix.param_only:
    return None
  return found[0]


def match_dense_bias(ix, s_key, k_pos, k_shape, k_free, claimed, shared: bool = False):
  """`(bias leaf, output key)` of a parameter added to a dense product's output `s_key` along
  its output features, else None."""
  found = _match_direct_bias(ix, s_key, k_pos, k_shape, k_free, claimed, shared)
  if found is not None:
    return found
  # A bias behind layout ops (vmap's unit axes, a transposed product) or broadcast to the full
  # output: matched by where each bias entry lands; the tap stays at the product.
  free_shape = tuple(k_shape[d] for d in k_free)
  out_shape = tuple(s_key[1].aval.shape)
  n_kf = len(free_shape)
  feat = np.arange(math.prod(free_shape)).reshape(free_shape)
  if k_pos == 1:  # out = (x_free..., k_free...)
    feat = np.broadcast_to(feat, out_shape)
  else:  # out = (k_free..., x_free...)
    feat = np.broadcast_to(feat.reshape(free_shape + (1,) * (len(out_shape) - n_kf)), out_shape)
  bias = follow_bias(ix, s_key, feat, claimed, shared)
  return None if bias is None else (bias[0], s_key)


def _match_direct_bias(ix, s_key, k_pos, k_shape, k_free, claimed, shared: bool = False):
  if k_pos != 1:
    return None
  cons = ix.slice_consumers.get(s_key, [])
  if len(cons) != 1:
    return None
  j, pos = cons[0]
  fe = ix.g.eqns[j]
  if fe.name != "add":
    return None
  other = fe.ins[1 - pos]
  if not _graph.is_key(other) or other not in ix.origin:
    return None
  b_leaf, b_chain = ix.origin[other]
  if b_leaf in claimed or (not shared and len(ix.uses.get(b_leaf, [])) != 1):
    return None
  if any(s.op in ("transpose", "gather") for s in b_chain):
    return None
  free_shape = tuple(k_shape[d] for d in k_free)
  if math.prod(ix.shapes[b_leaf]) != math.prod(free_shape):
    return None
  b_shape = tuple(_graph.aval_of(other).shape)
  out_shape = tuple(fe.outs[0][1].aval.shape)
  s_shape = tuple(s_key[1].aval.shape)
  if out_shape != s_shape or len(b_shape) < len(free_shape):
    return None
  if b_shape[len(b_shape) - len(free_shape) :] != free_shape:
    return None
  if math.prod(b_shape[: len(b_shape) - len(free_shape)]) not in (
    1,
    math.prod(s_shape[: len(s_shape) - len(free_shape)]),
  ):
    return None
  return b_leaf, fe.outs[0]


# --------------------------------------------------------------------------------------------
# Convolutions, scales and shifts.


def conv_use(ix, i, claimed, shared: bool = False):
  """`(ConvInfo, kernel leaf, x atom, output key, bias leaf or None)` if equation i convolves an
  activation with a (viewed) parameter kernel, else None. With `shared`, the kernel and the bias
  may have other uses (one use of a shared layer)."""
  fe = ix.g.eqns[i]
  if fe.name != "conv_general_dilated" or fe.params.get("batch_group_count", 1) != 1:
    return None
  ops = ix.uses_by_eqn.get(i, [])
  if len(ops) != 1 or ops[0][1] != 1:
    return None
  found = single_use_leaf(ix, fe.ins[1], claimed, shared)
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
    ix, out_key, out_shape, info.out_spec[1], info.out_channels, claimed, shared
  )
  if bias is None:  # A broadcast bias, or one behind layout ops; the tap stays at the conv.
    bias = follow_bias(ix, out_key, conv_feature_of(info), claimed, shared)
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


def match_conv(ix, i, claimed):
  found = conv_use(ix, i, claimed)
  if found is None:
    return None
  info, k_leaf, x_atom, out_key, b_leaf = found
  leaves = [k_leaf] + ([b_leaf] if b_leaf is not None else [])
  return Match.single("conv", leaves, info, out_key, (x_atom,))


def match_scale_and_shift(ix, i, claimed):
  found = scale_shift_use(ix, i, claimed)
  if found is None:
    return None
  info, leaf, inputs, out_key, shift_leaf = found
  leaves = [leaf] + ([shift_leaf] if shift_leaf is not None else [])
  return Match.single("scale_and_shift", leaves, info, out_key, inputs)


def scale_shift_operands(ix, i, claimed, shared: bool = False):
  """`(leaf, parameter atom, input atoms, output key)` if equation i multiplies an activation by
  a parameter (a second multiplication by an activation right after it folded in) or adds one
  to it; else None. The preamble of the scale-and-shift matchers."""
  fe = ix.g.eqns[i]
  if fe.name not in ("mul", "add") or len(fe.ins) != 2:
    return None
  ops = ix.uses_by_eqn.get(i, [])
  if len(ops) != 1:
    return None
  leaf, pos = ops[0]
  other = fe.ins[1 - pos]
  if single_use_leaf(ix, fe.ins[pos], claimed, shared) is None:
    return None
  if not _graph.is_key(other) or other in ix.origin:
    return None
  if other in ix.param_only:
    return None  # Not an activation: e.g. a weight-normalised kernel `v / |v|` times a gain.
  out_key = fe.outs[0]
  inputs: tuple = ()
  if fe.name == "mul":
    inputs = (other,)
    use = only_consumer(ix, out_key)
    if use is not None and ix.g.eqns[use[0]].name == "mul":
      nxt = ix.g.eqns[use[0]]
      y = nxt.ins[1 - use[1]]
      if _graph.is_key(y) and y not in ix.origin:
        inputs, out_key = (other, y), nxt.outs[0]
  elif tuple(_graph.aval_of(other).shape) != tuple(out_key[1].aval.shape):
    return None  # A shift must not broadcast the activation.
  if not tuple(out_key[1].aval.shape):
    return None
  return leaf, fe.ins[pos], inputs, out_key


def scale_shift_use(ix, i, claimed, shared: bool = False):
  """`(ScaleShiftInfo, leaf, input atoms, output key, shift leaf or None)` if equation i
  multiplies an activation by a parameter (then `leaf` is the scale, and a following shift is
  matched too) or adds one to it (`leaf` is the shift); else None. With `shared`, the
  parameters may have other uses (one use of a shared layer).

  Without an axis of examples outside the parameter's axes, a single-use layer whose leading
  axis holds rows of the batch's inputs (`node_rows`: the nodes or edges of a batch of graphs)
  takes those rows as its statistics' rows (`ScaleShiftInfo.example_rows` False)."""
  found = scale_shift_operands(ix, i, claimed, shared)
  if found is None:
    return None
  leaf, atom, inputs, out_key = found
  chain = ix.origin[atom][1]
  out_shape = tuple(out_key[1].aval.shape)
  block = feature_block(ix.shapes[leaf], chain, tuple(_graph.aval_of(atom).shape), out_shape)
  index = b""
  if block is None and ix.g.eqns[i].name == "add":
    rows = indexed_features(ix.shapes[leaf], leaf_index_view(ix, leaf, chain), out_shape)
    if rows is not None:
      block, index = (None, rows[0]), rows[1]
  if block is None or len(block[1]) == len(out_shape):
    return None
  axis, feat = block
  batch_axis = batch_axis_of(
    out_shape, axis, len(feat), ix.batch_size, followed_batch_axis(ix, out_key)
  )
  example_rows = True
  if batch_axis is None:
    if shared or not node_rows(ix, out_shape, axis):
      return None
    batch_axis, example_rows = 0, False
  shift_leaf = None
  is_mul = ix.g.eqns[i].name == "mul"
  has_shift = not is_mul
  if is_mul:
    shift = match_shift(ix, out_key, out_shape, block, claimed, shared)
    if shift is not None:
      shift_leaf, out_key = shift
      has_shift = True
  info = ScaleShiftInfo(
    has_scale=is_mul,
    has_shift=has_shift,
    feature_shape=feat,
    output_shape=out_shape,
    feature_axis=axis,
    batch_axis=batch_axis,
    example_rows=example_rows,
    feature_index=index,
  )
  return info, leaf, inputs, out_key, shift_leaf


def node_rows(ix, out_shape, feature_axis) -> bool:
  """Whether the leading axis of a scale-and-shift output `out_shape` (outside its features,
  which start at `feature_axis`, None: trailing) has the length of the leading axis of a batch
  input whose batch axis was not found: rows of the batch's data that are not its examples, as
  the nodes of a batch of graphs concatenated into one `[num_nodes, features]` array (their
  graph is known only to the segment sums that pool them)."""
  if len(out_shape) < 2 or feature_axis == 0:
    return False
  rows = out_shape[0]
  for key in ix.g.invars[ix.n_params :]:
    shape = tuple(key[1].aval.shape)
    if shape and shape[0] == rows and ix.batch_axes.get(key) is None:
      return True
  return False


def indexed_features(leaf_shape, idx: np.ndarray, out_shape):
  """`(feature_shape, feature_index)` of a parameter view added to an output of `out_shape`:
  `idx` (the leaf entry each view entry reads, `leaf_index_view`) has only unit axes before
  its first wider one, and from there on the output's trailing axes (the add broadcasts it
  over the leading ones). `feature_index` is empty when the features are the leaf in order
  (`ScaleShiftInfo.feature_index`). None when the view does not fit."""
  nd = len(out_shape)
  if idx.ndim > nd:
    return None
  view = (1,) * (nd - idx.ndim) + tuple(idx.shape)
  wide = [a for a in range(nd) if view[a] != 1]
  if not wide or view[wide[0] :] != tuple(out_shape[wide[0] :]):
    return None
  feat = idx.reshape(out_shape[wide[0] :])
  n = math.prod(leaf_shape)
  own = feat.size == n and np.array_equal(feat.reshape(-1), np.arange(n))
  return tuple(feat.shape), b"" if own else feat.reshape(-1).astype(np.int32).tobytes()


def followed_batch_axis(ix, atom) -> int | None:
  """The batch axis of an activation followed from the batch inputs (`ix.batch_axes`), or None
  where the pass did not follow it (then the matchers go by the axes' sizes)."""
  if not _graph.is_key(atom):
    return None
  tag = ix.batch_axes.get(atom)
  return None if tag is None else tag[0]


def batch_axis_of(
  out_shape, feature_axis, n_feat: int, batch_size: int, followed: int | None = None
) -> int | None:
  """The batch axis of a scale-and-shift output, or None: `followed` (from the batch inputs;
  rows merged example-major into it, as `(b h) t d`, are grouped by example) when it lies
  outside the features, else `batch_position` over the axes outside the features."""
  start = len(out_shape) - n_feat if feature_axis is None else feature_axis
  outside = [a for a in range(len(out_shape)) if not start <= a < start + n_feat]
  if followed is not None and followed in outside:
    return followed
  found = _batch_axes.batch_position([out_shape[a] for a in outside], batch_size)
  return None if found is None else outside[found]


def match_shift(ix, key, out_shape, block, claimed, shared: bool = False, how=None):
  """`(shift leaf, key of the sum)` of a parameter added to `key` over the same axes as the
  scale (`block`, as `how` reads it: `feature_block` unless given); else None."""
  use = only_consumer(ix, key)
  if use is None or ix.g.eqns[use[0]].name != "add":
    return None
  fe = ix.g.eqns[use[0]]
  atom = fe.ins[1 - use[1]]
  found = single_use_leaf(ix, atom, claimed, shared)
  if found is None or tuple(fe.outs[0][1].aval.shape) != tuple(out_shape):
    return None
  leaf, chain = found
  how = feature_block if how is None else how
  if how(ix.shapes[leaf], chain, tuple(_graph.aval_of(atom).shape), out_shape) != block:
    return None  # The shift must span the scale's axes.
  return leaf, fe.outs[0]


# --------------------------------------------------------------------------------------------
# Manual tags.


def leaf_for_operand(ix, atom, what: str, tag: str) -> tuple[int, tuple[ViewStep, ...]]:
  """`(leaf, view chain)` of a manual tag's parameter operand; an error if it is no view of one."""
  if not _graph.is_key(atom) or atom not in ix.origin:
    raise RegistrationError(
      f"{tag}: `{what}` is not a parameter leaf of `params` (nor a cast/reshape of one). "
      "Pass the parameter array itself, as read from the params pytree inside loss_fn."
    )
  return ix.origin[atom]


def read_generic_tag(ix, fe) -> Match:
  """A `register_generic` tag: its operands are the parameters; no info, output or inputs."""
  generic = tuple(
    leaf_for_operand(ix, a, f"params[{p}]", "register_generic")[0] for p, a in enumerate(fe.ins)
  )
  if len(set(generic)) != len(generic):
    raise RegistrationError(
      f"register_generic: the same parameter appears twice: {[ix.paths[j] for j in generic]}."
    )
  return Match.single("generic", generic, None, None, None)


def tag_output(ix, fe, fn: str) -> tuple[Any, tuple[int, ...]]:
  """A manual tag's layer output `y` (operand 0) and its shape; an error if it is a constant."""
  y = fe.ins[0]
  if not _graph.is_key(y):
    raise RegistrationError(
      f"{fn}: the layer output `y` is a constant, not computed from the input."
    )
  return y, tuple(_graph.aval_of(y).shape)


def tag_leaf(ix, atom, what: str, fn: str, broadcast: bool = False):
  """`(leaf, view chain)` of a manual tag's parameter operand, not broadcast unless allowed."""
  j, chain = leaf_for_operand(ix, atom, what, fn)
  if any(s.op == "gather" for s in chain):
    raise RegistrationError(
      f"{fn}: `{what}` (`{ix.paths[j]}`) is gathered at constant indices before the tag; pass "
      "the parameter itself."
    )
  if not broadcast and any(s.op == "broadcast" for s in chain):
    raise RegistrationError(
      f"{fn}: `{what}` (`{ix.paths[j]}`) is broadcast before the tag; pass the parameter itself."
    )
  return j, chain


def read_conv_tag(ix, fe) -> Match:
  """A `register_conv` tag: operands (y, x, kernel, bias?), the convolution in its params."""
  y, y_shape = tag_output(ix, fe, "register_conv")
  x, kernel = fe.ins[1], fe.ins[2]
  k_leaf, chain = tag_leaf(ix, kernel, "kernel", "register_conv")
  leaves = [k_leaf]
  if len(fe.ins) > 3:
    leaves.append(tag_leaf(ix, fe.ins[3], "bias", "register_conv")[0])
  info = _conv_info(
    chain, fe.params, _graph.aval_of(x).shape, _graph.aval_of(kernel).shape, y_shape
  )
  return Match.single("conv", leaves, info, y, (x,))


def read_embedding_tag(ix, fe) -> Match:
  """A `register_embedding` tag: operands (y, ids, table)."""
  fn = "register_embedding"
  y, _ = tag_output(ix, fe, fn)
  ids, table = fe.ins[1], fe.ins[2]
  t_leaf, chain = tag_leaf(ix, table, "table", fn)
  if any(s.op != "cast" for s in chain):
    raise RegistrationError(
      f"{fn}: `table` (`{ix.paths[t_leaf]}`) is reshaped or transposed before "
      "the tag; pass the [vocab, dim] parameter itself."
    )
  t_shape = _graph.aval_of(table).shape
  info = EmbeddingInfo(tuple(chain), int(t_shape[0]), int(t_shape[1]))
  return Match.single("embedding", [t_leaf], info, y, (ids,))


def read_scale_and_shift_tag(ix, fe) -> Match:
  """A `register_scale_and_shift` tag: operands (y, x, scale?, shift?)."""
  fn = "register_scale_and_shift"
  y, y_shape = tag_output(ix, fe, fn)
  if y_shape[0] != ix.batch_size:
    raise RegistrationError(
      f"{fn}: `y` has shape {y_shape}, but its leading axis must be the batch of the loss "
      f"tags ({ix.batch_size})."
    )
  leaves, feats = [], []
  for atom, what in zip(
    fe.ins[2:],
    [n for n, h in (("scale", fe.params["has_scale"]), ("shift", fe.params["has_shift"])) if h],
  ):
    j, chain = tag_leaf(ix, atom, what, fn, broadcast=True)
    f = _trailing_feature_shape(ix.shapes[j], chain, tuple(_graph.aval_of(atom).shape), y_shape)
    if f is None or len(f) == len(y_shape):
      raise RegistrationError(
        f"{fn}: `{what}` (`{ix.paths[j]}`, shape {ix.shapes[j]}) does not span "
        f"trailing axes of y {y_shape}."
      )
    leaves.append(j)
    feats.append(f)
  if len(set(feats)) > 1:
    raise RegistrationError(f"{fn}: `scale` and `shift` span different axes of y: {feats}.")
  info = ScaleShiftInfo(
    has_scale=fe.params["has_scale"],
    has_shift=fe.params["has_shift"],
    feature_shape=feats[0],
    output_shape=y_shape,
  )
  return Match.single("scale_and_shift", leaves, info, y, (fe.ins[1],) if info.has_scale else ())


def read_dense_tag(ix, fe) -> Match:
  """A `register_dense` tag: operands (y, x, kernel, bias?)."""
  y, x, kernel = fe.ins[:3]
  k_leaf, k_chain = leaf_for_operand(ix, kernel, "kernel", "register_dense")
  path = ix.paths[k_leaf]
  if any(s.op in ("broadcast", "gather") for s in k_chain):
    raise RegistrationError(
      f"register_dense: kernel `{path}` is broadcast or gathered before the tag; pass the "
      "parameter itself."
    )
  leaves = [k_leaf]
  if len(fe.ins) > 3:
    b_leaf, _ = leaf_for_operand(ix, fe.ins[3], "bias", "register_dense")
    if math.prod(ix.shapes[b_leaf]) != _graph.aval_of(kernel).shape[1]:
      raise RegistrationError(
        f"register_dense: bias `{ix.paths[b_leaf]}` has shape {ix.shapes[b_leaf]}, "
        f"which does not match the {_graph.aval_of(kernel).shape[1]} outputs of kernel "
        f"`{path}`."
      )
    leaves.append(b_leaf)
  if not _graph.is_key(y):
    raise RegistrationError(f"register_dense: the output of layer `{path}` is a constant.")
  x_aval, k_shape = _graph.aval_of(x), _graph.aval_of(kernel).shape
  rows = math.prod(x_aval.shape[:-1])
  info = DenseInfo(
    kernel_view=k_chain,
    kernel_perm=(0, 1),
    x_perm=tuple(range(x_aval.ndim)),
    out_perm=tuple(range(x_aval.ndim)),
    in_dim=int(k_shape[0]),
    out_dim=int(k_shape[1]),
    rows=int(rows),
  )
  return Match.single("dense", leaves, info, y, (x,))
