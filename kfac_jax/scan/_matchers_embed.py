"""Matchers for tables: embedding lookups and learned tokens.

An embedding reads whole rows of a `[vocab, dim]` parameter by a `gather` or as
`one_hot(ids, vocab) @ table`; only the ids are recorded. Learned tokens (a parameter broadcast
over the batch, or gathered at constant positions) are a shift-only scale_and_shift layer.
"""

from __future__ import annotations

import jax
import numpy as np

from kfac_jax._specs import EmbeddingInfo, ScaleShiftInfo
from kfac_jax.scan import _graph, _matchers


def _table(ix, atom) -> EmbeddingInfo | None:
  """The `EmbeddingInfo` of `atom` when it is a 2-d parameter view (casts only), else None."""
  if not _graph.is_key(atom) or atom not in ix.origin:
    return None
  chain, shape = ix.origin[atom][1], _graph.shape_of(atom)
  if any(s.op != "cast" for s in chain) or len(shape) != 2:
    return None
  return EmbeddingInfo(tuple(chain), int(shape[0]), int(shape[1]))


def _lookup(ix, table, info, ids, out_key) -> _matchers.Match:
  """The embedding layer of the table view `table` looked up at `ids`."""
  return _matchers.Match.single("embedding", [ix.origin[table][0]], info, out_key, (ids,))


def match_embedding(ix, i, claimed):
  """A single-use `[vocab, dim]` table whose rows a gather takes (`embedding_use`)."""
  ops = ix.uses_by_eqn.get(i, [])
  if ix.g.eqns[i].name != "gather" or len(ops) != 1 or ops[0][1] != 0:
    return None
  found = _matchers.single_use_leaf(ix, ix.g.eqns[i].ins[0], claimed)
  return None if found is None else embedding_use(ix, i)


def embedding_use(ix, i) -> _matchers.Match | None:
  """The lookup if equation i takes whole rows of a [vocab, dim] parameter table (operand 0)."""
  fe = ix.g.eqns[i]
  info = _table(ix, fe.ins[0]) if fe.name == "gather" else None
  if info is None:
    return None
  idx_shape, out_shape = _graph.shape_of(fe.ins[1]), _graph.shape_of(fe.outs[0])
  dn = fe.params["dimension_numbers"]
  if tuple(dn.operand_batching_dims) or tuple(fe.params["slice_sizes"]) != (1, info.dim):
    return None
  if tuple(dn.start_index_map) == (0, 1):
    return _vmapped_row_use(ix, fe, info)
  if (
    tuple(dn.offset_dims) != (len(out_shape) - 1,)
    or tuple(dn.collapsed_slice_dims) != (0,)
    or tuple(dn.start_index_map) != (0,)
    or not idx_shape
    or idx_shape[-1] != 1
    or out_shape != idx_shape[:-1] + (info.dim,)
  ):
    return None
  return _lookup(ix, fe.ins[0], info, fe.ins[1], fe.outs[0])


def _vmapped_row_use(ix, fe, info):
  """`embedding_use` for `vmap` of `table[i]`: rows at `concatenate([ids, 0], -1)`, squeezed."""
  dn = fe.params["dimension_numbers"]
  out_shape = _graph.shape_of(fe.outs[0])
  nd = len(out_shape)
  mode = fe.params.get("mode")
  cat = _producer(ix, fe.ins[1])
  if (
    tuple(dn.offset_dims) != (nd - 2, nd - 1)
    or tuple(dn.collapsed_slice_dims)
    or out_shape[-2:] != (1, info.dim)
    or mode not in (jax.lax.GatherScatterMode.CLIP, jax.lax.GatherScatterMode.PROMISE_IN_BOUNDS)
    or cat is None
    or cat.name != "concatenate"
    or not _graph.is_key(cat.ins[0])
    or cat.params["dimension"] != nd - 2
    or len(cat.ins) != 2
    or _graph.shape_of(cat.ins[0]) != out_shape[:-2] + (1,)
  ):
    return None
  use = _matchers.only_consumer(ix, fe.outs[0])
  sq = None if use is None else ix.g.eqns[use[0]]
  if sq is None or sq.name != "squeeze" or tuple(sq.params["dimensions"]) != (nd - 2,):
    return None
  return _lookup(ix, fe.ins[0], info, cat.ins[0], sq.outs[0])


def match_one_hot_embedding(ix, i, claimed):
  """`one_hot(ids) @ table` with a single-use table: an embedding lookup written as a product."""
  table = _matchers.sole_param_operand(ix, i, "dot_general")
  if table is None or table[1] != 1 or table[0] in claimed:
    return None
  return one_hot_embedding_use(ix, i)


def one_hot_embedding_use(ix, i) -> _matchers.Match | None:
  """The lookup if equation i is `one_hot(ids, vocab) @ table` (a cast `[vocab, dim]` table)."""
  fe = ix.g.eqns[i]
  info = _table(ix, fe.ins[1]) if fe.name == "dot_general" else None
  if info is None:
    return None
  (lhs_c, rhs_c), (lhs_b, rhs_b) = fe.params["dimension_numbers"]
  if lhs_b or rhs_b or tuple(rhs_c) != (0,) or len(lhs_c) != 1:
    return None
  ids = one_hot_ids(ix, fe.ins[0], int(lhs_c[0]), info.vocab_size)
  return None if ids is None else _lookup(ix, fe.ins[1], info, ids, fe.outs[0])


def one_hot_ids(ix, atom, axis: int, vocab: int):
  """The integer ids if `atom` is `cast(ids == iota)`, a one-hot of `vocab` entries on `axis`."""
  fe = _producer(ix, atom)
  while fe is not None and fe.name in ("convert_element_type", "copy", "copy_p"):
    fe = _producer(ix, fe.ins[0])
  if fe is None or fe.name != "eq":
    return None
  shape = _graph.shape_of(fe.outs[0])
  if axis >= len(shape) or shape[axis] != vocab:
    return None
  squeezed = shape[:axis] + (1,) + shape[axis + 1 :]
  for pos in (0, 1):
    if _iota_axis(ix, fe.ins[pos]) != (axis, vocab):
      continue
    ids = fe.ins[1 - pos]
    ids_shape = _graph.shape_of(ids)
    if ids_shape != squeezed:  # Broadcast along the vocabulary: look through the broadcast.
      b = _producer(ix, ids)
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


def _iota_axis(ix, atom) -> tuple[int, int] | None:
  """`(axis, n)` if `atom` is 0, ..., n-1 along `axis` (an `iota`, `np.arange`, cast, broadcast)."""
  value = _graph.constant_value(ix.const_values, atom)
  if value is not None:
    if not np.issubdtype(value.dtype, np.number):
      return None
    for axis, n in enumerate(value.shape):
      if n > 1:
        ramp = np.arange(n).reshape([n if d == axis else 1 for d in range(value.ndim)])
        return (axis, n) if np.array_equal(value, np.broadcast_to(ramp, value.shape)) else None
    return None
  fe = _producer(ix, atom)
  if fe is None:
    return None
  if fe.name == "iota":
    shape, axis = tuple(fe.params["shape"]), int(fe.params["dimension"])
    return axis, int(shape[axis])
  if fe.name in ("convert_element_type", "copy", "copy_p"):
    return _iota_axis(ix, fe.ins[0])
  if fe.name == "broadcast_in_dim":
    inner = _iota_axis(ix, fe.ins[0])
    if inner is None:
      return None
    axis, n = inner
    return int(fe.params["broadcast_dimensions"][axis]), n
  return None


def _producer(ix, atom):
  """The equation computing `atom`, or None for inputs, constants and literals."""
  if not _graph.is_key(atom):
    return None
  i = ix.producer.get(atom)
  return None if i is None else ix.g.eqns[i]


def match_batch_tokens(ix, i, claimed):
  """Learned tokens: an unclaimed leaf read only as one view broadcast over the batch (`0 + t`)."""
  fe = ix.g.eqns[i]
  for leaf, pos in ix.uses_by_eqn.get(i, []):
    atom = fe.ins[pos]
    if leaf in claimed or not _graph.is_key(atom):
      continue
    if any(ix.g.eqns[j].ins[q] != atom for j, q in ix.uses.get(leaf, [])):
      continue  # Read through two different views (or one leaf in two places of a concat).
    info = batch_view_info(ix, leaf, atom)
    if info is not None:
      return _matchers.Match.single("scale_and_shift", [leaf], info, atom, ())
  return None


def batch_view_info(ix, leaf, atom) -> ScaleShiftInfo | None:
  """The shift-only `ScaleShiftInfo` of `atom`, a view of `leaf` the same for every example."""
  view_shape = _graph.shape_of(atom)
  if not view_shape or view_shape[0] != ix.batch_size:
    return None
  chain = ix.origin[atom][1]
  found = _matchers.feature_block(ix.shapes[leaf], chain, view_shape, view_shape)
  if found is not None and found[0] is None and len(found[1]) < len(view_shape):
    found = found[1], b""
  elif len(view_shape) < 2 or ix.batch_size < 2:  # A batch of one shows nothing constant on it.
    return None
  else:
    idx = _matchers.index_of_view(ix.shapes[leaf], chain)
    if tuple(idx.shape) != view_shape or not (idx == idx[:1]).all():
      return None
    found = _matchers.indexed_features(ix.shapes[leaf], idx[:1], view_shape)
    if found is None or len(found[0]) != len(view_shape) - 1:
      return None
  return ScaleShiftInfo(
    has_scale=False,
    has_shift=True,
    feature_shape=found[0],
    output_shape=view_shape,
    feature_index=found[1],
  )
