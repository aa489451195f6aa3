"""Matchers: pure functions `(index, equation, claimed) -> Match | None`, one per layer kind,
and the `read_*_tag` readers of the manual layer tags.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any

import numpy as np

from kfac_jax._errors import RegistrationError
from kfac_jax._specs import ConvInfo, DenseInfo, EmbeddingInfo, ScaleShiftInfo, ViewStep, apply_view
from kfac_jax.scan import _batch_axes, _graph

if TYPE_CHECKING:
  from kfac_jax._specs import Kind


@dataclasses.dataclass(frozen=True)
class Match:
  """A layer found: its leaves (kernel / table / scale first); per use, its info, tap key and
  inputs. `stack_size` L > 0: L layers in one operation, `stack_axes` their axis per operand."""

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


def single_use_leaf(ix, atom, claimed, shared: bool = False):
  """(leaf, chain) if `atom` views an unclaimed leaf used once (any number of times if `shared`)."""
  if not _graph.is_key(atom) or atom not in ix.origin:
    return None
  leaf, chain = ix.origin[atom]
  if leaf in claimed or (not shared and len(ix.uses.get(leaf, [])) != 1):
    return None
  return leaf, chain


def sole_param_operand(ix, i, prim: str):
  """`(leaf, operand position)` if equation i is a `prim` whose one parameter is used once."""
  ops = ix.uses_by_eqn.get(i, [])
  if ix.g.eqns[i].name != prim or len(ops) != 1:  # No parameter, or a product of two.
    return None
  leaf, pos = ops[0]
  return (leaf, pos) if len(ix.uses.get(leaf, [])) == 1 else None


def only_consumer(ix, key):
  cons = ix.slice_consumers.get(key, [])
  return cons[0] if len(cons) == 1 else None


def added_leaf(ix, key, claimed, shared: bool = False):
  """`(leaf, chain, atom, add)` if `key`'s only use adds a `single_use_leaf` view, not broadcast."""
  use = only_consumer(ix, key)
  if use is None or ix.g.eqns[use[0]].name != "add":
    return None
  fe = ix.g.eqns[use[0]]
  atom = fe.ins[1 - use[1]]
  found = single_use_leaf(ix, atom, claimed, shared)
  if found is None or _graph.shape_of(fe.outs[0]) != _graph.shape_of(key):
    return None
  return *found, atom, fe


def _trailing_feature_shape(leaf_shape, chain, view_shape, out_shape):
  """The trailing axes of `out_shape` a parameter spans, broadcast over the leading ones."""
  n, nd = math.prod(leaf_shape), len(out_shape)
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
  """`(feature_axis, feature_shape)`: the consecutive axes of `out_shape` a parameter spans in
  row-major order, broadcast along all others (`feature_axis` None for trailing axes)."""
  feat = _trailing_feature_shape(leaf_shape, chain, view_shape, out_shape)
  if feat is not None:
    return None, feat
  idx = _operand_index(leaf_shape, chain, view_shape, out_shape)
  block = None if idx is None else _block_of(idx, out_shape, math.prod(leaf_shape))
  if block is None or block[0] == 0:
    return None
  a, b = block
  return (None if b == len(out_shape) else a), tuple(out_shape[a:b])


def stacked_feature_block(leaf_shape, chain, view_shape, out_shape):
  """`(stack_axis, feature_axis, feature_shape)` of a parameter `[L, ...]` read as L layers':
  its leading axis along one axis of `out_shape`, per layer a `feature_block`; else None."""
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
  if block is None or block[1] - block[0] == len(per_out):
    return None
  a, b = block
  return s, (None if b == len(per_out) else a), tuple(per_out[a:b])


def _operand_index(leaf_shape, chain, view_shape, out_shape) -> np.ndarray | None:
  """The leaf entry each operand entry reads, padded to `out_shape`'s rank and `_collapse`d."""
  idx = index_of_view(leaf_shape, chain)
  nd = len(out_shape)
  if tuple(idx.shape) != tuple(view_shape) or idx.ndim > nd:
    return None
  idx = _collapse(idx.reshape((1,) * (nd - idx.ndim) + idx.shape))
  if any(v not in (1, o) for v, o in zip(idx.shape, out_shape)):
    return None
  return idx


def _collapse(idx: np.ndarray) -> np.ndarray:
  """`idx` cut to length 1 along every axis it is constant along (a broadcast's first)."""
  idx = idx[tuple(slice(0, 1) if st == 0 else slice(None) for st in idx.strides)]
  for d in range(idx.ndim):
    if idx.shape[d] > 1 and not np.ptp(idx, axis=d).any():
      idx = idx[(slice(None),) * d + (slice(0, 1),)]
  return idx


def _block_of(idx: np.ndarray, out_shape, n: int) -> tuple[int, int] | None:
  """`(a, b)` if `idx` (collapsed) is `arange(n)` laid over the axes `a..b-1` of `out_shape`."""
  axes = [d for d in range(idx.ndim) if idx.shape[d] > 1]
  if not axes:
    return None
  a, b = axes[0], axes[-1] + 1
  if math.prod(out_shape[a:b]) != n:
    return None
  want = np.arange(n).reshape([out_shape[d] if a <= d < b else 1 for d in range(len(out_shape))])
  return (a, b) if np.array_equal(np.broadcast_to(idx, want.shape), want) else None


def index_of_view(shape, chain) -> np.ndarray:
  """Which entry (flat index) of a parameter of `shape` each entry of its view by `chain` reads."""
  return _view(np.arange(math.prod(shape)).reshape(shape), chain)


def _view(idx: np.ndarray, chain) -> np.ndarray:
  """`apply_view`, broadcasts included."""
  for st in chain:
    if st.op != "broadcast":
      idx = apply_view((st,), idx)
      continue
    shape = [idx.shape[st.perm.index(d)] if d in st.perm else 1 for d in range(len(st.out_shape))]
    idx = np.broadcast_to(idx.reshape(shape), st.out_shape)
  return idx


def follow_bias(ix, key, feature_of: np.ndarray, claimed, shared: bool = False):
  """`(bias leaf, key of the sum)` if `key`, through layout-only ops, gets a parameter added whose
  entry f lands exactly where `feature_of` (each entry's output feature) is f; else None."""
  idx = feature_of
  for _ in range(16):
    use = only_consumer(ix, key)
    if use is None:
      return None
    fe = ix.g.eqns[use[0]]
    out_shape = _graph.shape_of(fe.outs[0])
    if fe.name in _graph.VIEW_OPS and use[1] == 0:
      if fe.name == "broadcast_in_dim" and math.prod(out_shape) != idx.size:
        return None
      idx, key = _view(idx, (_graph.view_step(fe),)), fe.outs[0]
      continue
    found = single_use_leaf(ix, fe.ins[1 - use[1]], claimed, shared) if fe.name == "add" else None
    if found is None or len(fe.ins) != 2:
      return None
    leaf, chain = found
    b = index_of_view(ix.shapes[leaf], chain)
    if b.ndim == len(out_shape) and all(d in (1, o) for d, o in zip(b.shape, out_shape)):
      b = np.broadcast_to(b, out_shape)  # Unit axes broadcast by the add (vmap's batching).
    n = math.prod(ix.shapes[leaf])
    if b.shape != out_shape or idx.shape != out_shape or n != int(idx.max()) + 1:
      return None
    return (leaf, fe.outs[0]) if np.array_equal(b, idx) else None
  return None


# Dense layers: `dot_general(x, kernel)` without batch dimensions, the kernel a (viewed) leaf
# read as the `[in, out]` matrix of its contracted then free axes, and an optional bias.


def dot_dims(dimension_numbers, k_pos: int):
  """`(k_contract, x_contract, k_batch, x_batch)` of a `dot_general`, the kernel operand `k_pos`."""
  (lhs_c, rhs_c), (lhs_b, rhs_b) = dimension_numbers
  k_c, x_c, k_b, x_b = (rhs_c, lhs_c, rhs_b, lhs_b) if k_pos == 1 else (lhs_c, rhs_c, lhs_b, rhs_b)
  return tuple(map(int, k_c)), tuple(map(int, x_c)), tuple(map(int, k_b)), tuple(map(int, x_b))


def dense_product(
  k_shape, x_shape, k_contract, x_contract, k_pos, kernel_view=(), batch_size=None, x_batch=None
):
  """`(DenseInfo, k_free, x_free)` of a `dot_general` without batch dimensions: the kernel as
  `[contracted, free]`, the activation as `[rows, in]`, its batch axis (`x_batch`, else by size)
  first."""
  k_free = tuple(d for d in range(len(k_shape)) if d not in k_contract)
  x_free = tuple(d for d in range(len(x_shape)) if d not in x_contract)
  if not k_free or not k_contract:
    return None
  n_xf, n_kf = len(x_free), len(k_free)
  order = list(range(n_xf))  # The row axes' order, as positions in x_free.
  if x_batch is not None and x_batch in x_free:
    first: int | None = x_free.index(x_batch)
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
    in_dim=int(math.prod(k_shape[d] for d in k_contract)),
    out_dim=int(math.prod(k_shape[d] for d in k_free)),
    rows=int(math.prod(x_shape[d] for d in x_free)),
  )
  return info, k_free, x_free


def dense_use(ix, i, k_pos):
  """`(info, x_atom, k_shape, k_free)` if equation i is a dense product, kernel at k_pos."""
  fe = ix.g.eqns[i]
  k_atom, x_atom = fe.ins[k_pos], fe.ins[1 - k_pos]
  _, k_chain = ix.origin[k_atom]
  if any(s.op not in ("reshape", "transpose", "cast") for s in k_chain):
    return None
  k_c, x_c, k_b, x_b = dot_dims(fe.params["dimension_numbers"], k_pos)
  if k_b or x_b:
    return None  # Batched products (e.g. per-head weights) are not dense layers.
  k_shape, x_shape = _graph.shape_of(k_atom), _graph.shape_of(x_atom)
  x_axis = followed_batch_axis(ix, x_atom)
  found = dense_product(k_shape, x_shape, k_c, x_c, k_pos, k_chain, ix.batch_size, x_axis)
  return None if found is None else (found[0], x_atom, k_shape, found[1])


def match_dense(ix, i, claimed):
  """A single-use kernel in a `dot_general` with an activation (and its bias)."""
  fe = ix.g.eqns[i]
  kernel = sole_param_operand(ix, i, "dot_general") or _kernel_beside_param(ix, i)
  if kernel is None or kernel[0] in claimed:
    return None
  k_leaf, k_pos = kernel
  found = dense_use(ix, i, k_pos)
  if found is None:
    return None
  info, x_atom, k_shape, k_free = found
  leaves, out_key = [k_leaf], fe.outs[0]
  bias = match_dense_bias(ix, out_key, k_pos, k_shape, k_free, claimed)
  if bias is not None:
    leaves.append(bias[0])
    out_key = bias[1]
  if _graph.is_key(x_atom) and x_atom in ix.param_only:
    out_key, info = constant_input_tap(ix, out_key, info) or (out_key, info)
  return Match.single("dense", leaves, info, out_key, (x_atom,))


def constant_input_tap(ix, key, info: DenseInfo):
  """`(tap, info with its shared_tap)` of a dense use whose input is made of parameters alone."""
  return _batch_broadcast_tap(ix, key, info) or hoisted_tap(ix, key, info)


def _with_shared_tap(info: DenseInfo, s_shape, entries: np.ndarray) -> DenseInfo:
  """`info` with its `shared_tap`: the positions in `[rows, out]` of product-output `entries`."""
  n = math.prod(s_shape)
  where = np.empty(n, np.int64)
  where[np.arange(n).reshape(s_shape).transpose(info.out_perm).reshape(-1)] = np.arange(n)
  tap = where[entries.reshape(-1)].astype(np.int32).tobytes()
  return dataclasses.replace(info, shared_tap=tap)


def hoisted_tap(ix, key, info: DenseInfo):
  """`(HoistedTap, info with its shared_tap)` of a dense output `key` computed once for every
  example (hoisted by `jax.vmap`), then broadcast along the batch by elementwise equations."""
  if key in ix.from_batch:
    return None
  s_shape, outputs = _graph.shape_of(key), {a for a in ix.g.outvars if _graph.is_key(a)}
  todo = [(key, np.arange(math.prod(s_shape)).reshape(s_shape))]
  taps, size = [], None  # Per key the batch reads: (key, batch axis, shape, entries).
  while todo:
    k, idx = todo.pop()
    readers = ix.readers.get(k, ())
    if not any(ix.g.eqns[i].outs[0] in ix.from_batch for i, _ in readers):
      for i, pos in readers:  # Still computed once for all examples: only layout operations.
        fe = ix.g.eqns[i]
        if fe.name not in _graph.VIEW_OPS or pos != 0:
          return None
        todo.append((fe.outs[0], _view(idx, (_graph.view_step(fe),))))
      continue
    if k in outputs or k in ix.g.scan_positions:
      return None  # A perturbation of another shape would change an output or a scan's step.
    k_shape, found = _graph.shape_of(k), set()
    for i, _ in readers:
      fe = ix.g.eqns[i]
      out = fe.outs[0]
      tag, out_shape = ix.batch_axes.get(out), _graph.shape_of(out)
      if (
        fe.name not in _batch_axes.ELEMENTWISE
        or out not in ix.from_batch
        or tag is None
        or tag[1] != 1
        or len(out_shape) != len(k_shape)
        or k_shape[tag[0]] not in (1, out_shape[tag[0]])
      ):
        return None
      found.add((tag[0], out_shape[tag[0]]))
    if len(found) != 1:
      return None
    ((b, n),) = found
    if size not in (None, n) or not (idx == idx.take([0], axis=b)).all():
      return None
    size = n
    taps.append((k, b, k_shape[:b] + (n,) + k_shape[b + 1 :], idx.take(0, axis=b).reshape(-1)))
  if not taps:
    return None
  keys, axes, shapes, entries = zip(*taps)
  tap = _graph.HoistedTap(keys, axes, shapes)
  return tap, _with_shared_tap(info, s_shape, np.concatenate(entries))


def _batch_broadcast_tap(ix, key, info: DenseInfo):
  """`(tap key, info with its shared_tap)` of a dense output broadcast over the batch."""
  s_shape = _graph.shape_of(key)
  idx = np.arange(math.prod(s_shape)).reshape(s_shape)
  for _ in range(16):
    shape = tuple(idx.shape)
    if key not in ix.param_only and len(shape) >= 2 and shape[0] == ix.batch_size > 1:
      if not (idx == idx[:1]).all():
        return None
      return key, _with_shared_tap(info, s_shape, idx[0])
    use = only_consumer(ix, key)
    if use is None:
      return None
    fe = ix.g.eqns[use[0]]
    out_shape = _graph.shape_of(fe.outs[0])
    if fe.name in _graph.VIEW_OPS and use[1] == 0:
      idx = _view(idx, (_graph.view_step(fe),))
    elif fe.name == "add" and len(fe.ins) == 2 and len(out_shape) == idx.ndim:
      if any(a not in (1, b) for a, b in zip(idx.shape, out_shape)):
        return None
      idx = np.broadcast_to(idx, out_shape)  # Broadcast by the add over its size-1 axes.
    else:
      return None
    key = fe.outs[0]
  return None


def _kernel_beside_param(ix, i):
  """`(kernel leaf, position)` of a single-use kernel times a learned probe (tiled or projected)."""
  fe = ix.g.eqns[i]
  ops = ix.uses_by_eqn.get(i, [])
  if fe.name != "dot_general" or len(ops) != 2 or ops[0][0] == ops[1][0]:
    return None
  for (k_leaf, k_pos), (_, x_pos) in (ops, ops[::-1]):
    x_atom = fe.ins[x_pos]
    if len(ix.uses.get(k_leaf, [])) != 1 or x_atom in ix.param_only:
      continue
    x_shape = _graph.shape_of(x_atom)
    if len(x_shape) < 2 or x_shape[0] != ix.batch_size or ix.batch_size < 2:
      continue
    idx = index_of_view(ix.shapes[ix.origin[x_atom][0]], ix.origin[x_atom][1])
    if tuple(idx.shape) == x_shape and (idx == idx[:1]).all():
      return k_leaf, k_pos
  k_leaf = next((leaf for leaf, pos in ops if pos == 1), None)
  if k_leaf is None or len(ix.uses.get(k_leaf, [])) != 1 or fe.ins[0] not in ix.param_only:
    return None
  return k_leaf, 1


def match_dense_bias(ix, s_key, k_pos, k_shape, k_free, claimed, shared: bool = False):
  """`(bias leaf, output key)` of a parameter added to the product `s_key` along its features."""
  free_shape, out_shape = tuple(k_shape[d] for d in k_free), _graph.shape_of(s_key)
  found = added_leaf(ix, s_key, claimed, shared) if k_pos == 1 else None
  if found is not None:  # `out + b`, b `[..., *free_shape]` over the leading axes.
    b_leaf, b_chain, other, fe = found
    b_shape = _graph.shape_of(other)
    lead = len(b_shape) - len(free_shape)
    if (
      not any(s.op in ("transpose", "gather") for s in b_chain)
      and math.prod(ix.shapes[b_leaf]) == math.prod(free_shape)
      and lead >= 0
      and b_shape[lead:] == free_shape
      and math.prod(b_shape[:lead]) in (1, math.prod(out_shape[: len(out_shape) - len(free_shape)]))
    ):
      return b_leaf, fe.outs[0]
  # A bias behind layout ops or broadcast to the full output: the tap stays at the product.
  feat = np.arange(math.prod(free_shape)).reshape(free_shape)
  if k_pos != 1:  # out = (k_free..., x_free...)
    feat = feat.reshape(free_shape + (1,) * (len(out_shape) - len(free_shape)))
  bias = follow_bias(ix, s_key, np.broadcast_to(feat, out_shape), claimed, shared)
  return None if bias is None else (bias[0], s_key)


# Convolutions: `conv_general_dilated(x, kernel)`, the kernel a (viewed) leaf, any dimension
# numbers, feature groups (`batch_group_count` 1), and an optional bias along the out channels.


def _conv_info(chain, params, x_atom, k_atom, out_shape) -> ConvInfo:
  x_shape, k_shape = _graph.shape_of(x_atom), _graph.shape_of(k_atom)
  dn = params["dimension_numbers"]
  lhs, rhs, out = tuple(dn.lhs_spec), tuple(dn.rhs_spec), tuple(dn.out_spec)
  ints = lambda name: tuple(int(s) for s in params[name])
  return ConvInfo(
    kernel_view=tuple(chain),
    lhs_spec=lhs,
    rhs_spec=rhs,
    out_spec=out,
    window_strides=ints("window_strides"),
    padding=tuple((int(a), int(b)) for a, b in params["padding"]),
    lhs_dilation=ints("lhs_dilation"),
    rhs_dilation=ints("rhs_dilation"),
    feature_group_count=int(params["feature_group_count"]),
    in_channels=int(x_shape[lhs[1]]),
    out_channels=int(k_shape[rhs[0]]),
    kernel_spatial=tuple(int(k_shape[d]) for d in rhs[2:]),
    input_shape=tuple(x_shape),
    output_shape=tuple(out_shape),
  )


def match_conv(ix, i, claimed, shared: bool = False):
  """A convolution of an activation by a kernel leaf used once (any times if `shared`), its bias."""
  fe = ix.g.eqns[i]
  if fe.name != "conv_general_dilated" or fe.params.get("batch_group_count", 1) != 1:
    return None
  ops = ix.uses_by_eqn.get(i, [])
  found = single_use_leaf(ix, fe.ins[1], claimed, shared)
  if len(ops) != 1 or ops[0][1] != 1 or found is None:
    return None
  k_leaf, chain = found
  if any(s.op not in ("reshape", "transpose", "cast") for s in chain):
    return None
  x_atom, out_key = fe.ins[0], fe.outs[0]
  out_shape = _graph.shape_of(out_key)
  info = _conv_info(chain, fe.params, x_atom, fe.ins[1], out_shape)
  c = info.out_channels
  bias = added_leaf(ix, out_key, claimed, shared)
  if bias is not None:  # `out + b`, b `[C]` along the output channels.
    b_leaf, b_chain, atom, add = bias
    b_shape = _graph.shape_of(atom)
    b_shape = (1,) * (len(out_shape) - len(b_shape)) + b_shape
    if (
      math.prod(ix.shapes[b_leaf]) == c
      and not any(s.op in ("transpose", "gather", "broadcast") for s in b_chain)
      and len(b_shape) == len(out_shape)
      and b_shape[info.out_spec[1]] == c
    ):
      return Match.single("conv", [k_leaf, b_leaf], info, add.outs[0], (x_atom,))
  # A broadcast bias, or one behind layout ops; the tap stays at the conv.
  shape = [1] * len(out_shape)
  shape[info.out_spec[1]] = c
  channel = np.broadcast_to(np.arange(c).reshape(shape), out_shape)
  bias = follow_bias(ix, out_key, channel, claimed, shared)
  leaves = [k_leaf] if bias is None else [k_leaf, bias[0]]
  return Match.single("conv", leaves, info, out_key, (x_atom,))


# Scales and shifts: `x * scale (+ shift)` and `x + shift`, the parameters spanning consecutive
# axes of the output broadcast along the others; a second multiplication by an activation
# right after the scale is folded in (Flax's norms: `(x - mean) * (rsqrt(var + eps) * scale)`).


def scale_shift_operands(ix, i, claimed, shared: bool = False):
  """`(leaf, parameter atom, inputs, output key)` of `x * p` (a next `* y` folded in) or `x + p`."""
  fe = ix.g.eqns[i]
  ops = ix.uses_by_eqn.get(i, [])
  if fe.name not in ("mul", "add") or len(fe.ins) != 2 or len(ops) != 1:
    return None
  leaf, pos = ops[0]
  other = fe.ins[1 - pos]
  if single_use_leaf(ix, fe.ins[pos], claimed, shared) is None or not _graph.is_key(other):
    return None
  if other in ix.origin or other in ix.param_only:
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
  elif _graph.shape_of(other) != _graph.shape_of(out_key):
    return None  # A shift must not broadcast the activation.
  if not _graph.shape_of(out_key):
    return None
  return leaf, fe.ins[pos], inputs, out_key


def match_scale_and_shift(ix, i, claimed, shared: bool = False):
  """A scale (and its shift) or a shift at equation i, its rows examples or `node_rows`."""
  found = scale_shift_operands(ix, i, claimed, shared)
  if found is None:
    return None
  leaf, atom, inputs, out_key = found
  chain, out_shape = ix.origin[atom][1], _graph.shape_of(out_key)
  block = feature_block(ix.shapes[leaf], chain, _graph.shape_of(atom), out_shape)
  index = b""
  if block is None and ix.g.eqns[i].name == "add":
    rows = indexed_features(ix.shapes[leaf], index_of_view(ix.shapes[leaf], chain), out_shape)
    if rows is not None:
      block, index = (None, rows[0]), rows[1]
  if block is None or len(block[1]) == len(out_shape):
    return None
  axis, feat = block
  followed = followed_batch_axis(ix, out_key)
  batch_axis = batch_axis_of(out_shape, axis, len(feat), ix.batch_size, followed)
  if batch_axis is None and (shared or not node_rows(ix, out_shape, axis)):
    return None
  is_mul = ix.g.eqns[i].name == "mul"
  shift = match_shift(ix, out_key, out_shape, block, claimed, shared) if is_mul else None
  shift_leaf, out_key = shift if shift is not None else (None, out_key)
  info = ScaleShiftInfo(
    has_scale=is_mul,
    has_shift=not is_mul or shift_leaf is not None,
    feature_shape=feat,
    output_shape=out_shape,
    feature_axis=axis,
    batch_axis=0 if batch_axis is None else batch_axis,
    example_rows=batch_axis is not None,
    feature_index=index,
  )
  leaves = [leaf] if shift_leaf is None else [leaf, shift_leaf]
  return Match.single("scale_and_shift", leaves, info, out_key, inputs)


def node_rows(ix, out_shape, feature_axis) -> bool:
  """Whether `out_shape` leads with a batch input's unfollowed leading axis (a graph's nodes)."""
  if len(out_shape) < 2 or feature_axis == 0:
    return False
  return any(
    _graph.shape_of(key)[:1] == out_shape[:1] and ix.batch_axes.get(key) is None
    for key in ix.g.invars[ix.n_params :]
  )


def indexed_features(leaf_shape, idx: np.ndarray, out_shape):
  """`(feature_shape, feature_index)` of a parameter view `idx` (unit axes, then the output's
  trailing axes) added to `out_shape`; the index empty for the leaf in order. Else None."""
  nd = len(out_shape)
  if idx.ndim > nd:
    return None
  view = (1,) * (nd - idx.ndim) + tuple(idx.shape)
  wide = [a for a in range(nd) if view[a] != 1]
  if not wide or view[wide[0] :] != tuple(out_shape[wide[0] :]):
    return None
  feat, n = idx.reshape(out_shape[wide[0] :]), math.prod(leaf_shape)
  own = feat.size == n and np.array_equal(feat.reshape(-1), np.arange(n))
  return tuple(feat.shape), b"" if own else feat.reshape(-1).astype(np.int32).tobytes()


def followed_batch_axis(ix, atom) -> int | None:
  """The batch axis of an activation followed from the batch inputs, or None."""
  tag = ix.batch_axes.get(atom) if _graph.is_key(atom) else None
  return None if tag is None else tag[0]


def batch_axis_of(out_shape, feature_axis, n_feat: int, batch_size: int, followed) -> int | None:
  """The batch axis outside a scale's features: `followed` if there, else by `batch_position`."""
  start = len(out_shape) - n_feat if feature_axis is None else feature_axis
  outside = [a for a in range(len(out_shape)) if not start <= a < start + n_feat]
  if followed is not None and followed in outside:
    return followed
  found = _batch_axes.batch_position([out_shape[a] for a in outside], batch_size)
  return None if found is None else outside[found]


def match_shift(ix, key, out_shape, block, claimed, shared: bool = False, how=feature_block):
  """`(shift leaf, key of the sum)` of a parameter added to `key` over the scale's `block`."""
  found = added_leaf(ix, key, claimed, shared)
  if found is None:
    return None
  leaf, chain, atom, fe = found
  if how(ix.shapes[leaf], chain, _graph.shape_of(atom), out_shape) != block:
    return None  # The shift must span the scale's axes.
  return leaf, fe.outs[0]


# Manual tags.


def leaf_for_operand(ix, atom, what: str, tag: str) -> tuple[int, tuple[ViewStep, ...]]:
  """`(leaf, view chain)` of a manual tag's parameter operand; an error if it is no view of one."""
  if not _graph.is_key(atom) or atom not in ix.origin:
    raise RegistrationError(
      f"{tag}: `{what}` is not a parameter leaf of `params` (nor a cast/reshape of one); pass "
      "the parameter itself."
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
    raise RegistrationError(f"{fn}: the layer output `y` is a constant, not computed from x.")
  return y, _graph.shape_of(y)


def tag_leaf(ix, atom, what: str, fn: str, broadcast: bool = False):
  """`(leaf, view chain)` of a manual tag's parameter operand, not broadcast unless allowed."""
  j, chain = leaf_for_operand(ix, atom, what, fn)
  done = {"gather": "gathered at constant indices", "broadcast": "broadcast"}
  for op in ("gather",) if broadcast else ("gather", "broadcast"):
    if any(s.op == op for s in chain):
      raise RegistrationError(
        f"{fn}: `{what}` (`{ix.paths[j]}`) is {done[op]} before the tag; pass the parameter itself."
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
  info = _conv_info(chain, fe.params, x, kernel, y_shape)
  return Match.single("conv", leaves, info, y, (x,))


def read_embedding_tag(ix, fe) -> Match:
  """A `register_embedding` tag: operands (y, ids, table)."""
  fn = "register_embedding"
  y, _ = tag_output(ix, fe, fn)
  ids, table = fe.ins[1], fe.ins[2]
  t_leaf, chain = tag_leaf(ix, table, "table", fn)
  if any(s.op != "cast" for s in chain):
    raise RegistrationError(
      f"{fn}: `table` (`{ix.paths[t_leaf]}`) is reshaped or transposed; pass it as [vocab, dim]."
    )
  t_shape = _graph.shape_of(table)
  info = EmbeddingInfo(tuple(chain), int(t_shape[0]), int(t_shape[1]))
  return Match.single("embedding", [t_leaf], info, y, (ids,))


def read_scale_and_shift_tag(ix, fe) -> Match:
  """A `register_scale_and_shift` tag: operands (y, x, scale?, shift?)."""
  fn = "register_scale_and_shift"
  y, y_shape = tag_output(ix, fe, fn)
  if y_shape[0] != ix.batch_size:
    raise RegistrationError(
      f"{fn}: `y` has shape {y_shape}; its leading axis must be the batch ({ix.batch_size})."
    )
  leaves, feats = [], []
  has = [fe.params["has_scale"], fe.params["has_shift"]]
  for atom, what in zip(fe.ins[2:], [n for n, h in zip(("scale", "shift"), has) if h]):
    j, chain = tag_leaf(ix, atom, what, fn, broadcast=True)
    f = _trailing_feature_shape(ix.shapes[j], chain, _graph.shape_of(atom), y_shape)
    if f is None or len(f) == len(y_shape):
      raise RegistrationError(
        f"{fn}: `{what}` (`{ix.paths[j]}`, {ix.shapes[j]}) spans no trailing axes of y {y_shape}."
      )
    leaves.append(j)
    feats.append(f)
  if len(set(feats)) > 1:
    raise RegistrationError(f"{fn}: `scale` and `shift` span different axes of y: {feats}.")
  info = ScaleShiftInfo(
    has_scale=has[0], has_shift=has[1], feature_shape=feats[0], output_shape=y_shape
  )
  return Match.single("scale_and_shift", leaves, info, y, (fe.ins[1],) if info.has_scale else ())


def read_dense_tag(ix, fe) -> Match:
  """A `register_dense` tag: operands (y, x, kernel, bias?)."""
  y, _ = tag_output(ix, fe, "register_dense")
  x, kernel = fe.ins[1], fe.ins[2]
  k_leaf, k_chain = tag_leaf(ix, kernel, "kernel", "register_dense")
  leaves = [k_leaf]
  k_shape = _graph.shape_of(kernel)
  if len(fe.ins) > 3:
    b_leaf, _ = leaf_for_operand(ix, fe.ins[3], "bias", "register_dense")
    if math.prod(ix.shapes[b_leaf]) != k_shape[1]:
      raise RegistrationError(
        f"register_dense: bias `{ix.paths[b_leaf]}` has shape {ix.shapes[b_leaf]}, which does "
        f"not match the {k_shape[1]} outputs of kernel `{ix.paths[k_leaf]}`."
      )
    leaves.append(b_leaf)
  x_shape = _graph.shape_of(x)  # `[rows..., in]` times the `[in, out]` kernel.
  info = dense_product(k_shape, x_shape, (0,), (len(x_shape) - 1,), 1, k_chain)
  return Match.single("dense", leaves, info[0], y, (x,))
