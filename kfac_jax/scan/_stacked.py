"""Stacked layers: a parameter leaf with a leading layer axis is L layers, one block each.

An unrolled scan reads `leaf[t]` through a `scan_slice` (`slice_leaves`: one virtual leaf per
slice; `merge`: the L per-slice layers become one `LayerSpec` with `stack_size = L`); a vmapped
layer reads the whole stack in one operation (`match_batched_dense`, the stacked scale).
"""

from __future__ import annotations

import dataclasses
import math
import operator
from typing import Any

from kfac_jax import blocks as _blocks
from kfac_jax._specs import ScaleShiftInfo
from kfac_jax.scan import _graph, _matchers


def slice_leaves(graph, shapes, in_slice) -> dict[Any, tuple[int, int]]:
  """`{slice key: (leaf, t)}` of each leaf the loss slice reads only by `scan_slice`s, 0..L-1."""
  real = {k: j for j, k in enumerate(graph.invars[: len(shapes)])}
  slices: dict[int, dict[int, Any]] = {}
  other: set[int] = set()
  for i, fe in enumerate(graph.eqns):
    for j in [real[a] for a in fe.ins if _graph.is_key(a) and a in real]:
      if fe.name == "scan_slice":
        t = int(fe.params["index"])
        if t in slices.setdefault(j, {}):
          other.add(j)  # Sliced twice at one index: two scans read it.
        slices[j][t] = fe.outs[0]
      elif i in in_slice:
        other.add(j)
  return {
    key: (j, t)
    for j, by_t in slices.items()
    if j not in other and shapes[j] and sorted(by_t) == list(range(shapes[j][0]))
    for t, key in by_t.items()
  }


# What the per-slice layers of one stack must agree on.
_LAYER_KEY = operator.attrgetter("kind", "approx", "factor_shapes", "info", "source", "num_uses")


def stack_spec(ix, inner, leaves, size: int, axes: tuple[int, ...] = ()):
  """The spec of a stack of `size` layers like `inner`, over the stacked leaves `leaves`."""
  spec = dataclasses.replace(
    inner,
    param_paths=tuple(ix.paths[j] for j in leaves),
    leaf_indices=tuple(leaves),
    param_shapes=tuple(ix.shapes[j] for j in leaves),
    stack_size=size,
    stack_inner=inner,
    stack_axes=tuple(axes),
  )
  return dataclasses.replace(spec, factor_shapes=_blocks.factor_shapes_for(spec))


def merge(ix, specs, claimed, claim):
  """The per-slice layers of each stacked leaf group as one stacked layer, claimed by `claim`."""
  if not ix.stack_of:
    return specs
  kept: list[Any] = []
  failed: list[Any] = []
  groups: dict[tuple[Any, ...], dict[int, Any]] = {}  # real leaves -> {step: entry}
  for entry in specs:
    spec = entry[0]
    virtual = [j for j in spec.leaf_indices if j in ix.stack_of]
    if not virtual:
      kept.append(entry)
      continue
    reals = tuple(ix.stack_of[j][0] if j in ix.stack_of else None for j in spec.leaf_indices)
    steps = {ix.stack_of[j][1] for j in virtual}
    if None in reals or len(steps) != 1 or spec.num_uses != 1:
      failed.append(entry)
      continue
    groups.setdefault(reals, {})[steps.pop()] = entry
  for reals, by_t in groups.items():
    size = ix.shapes[reals[0]][0]
    entries: list[Any] = [by_t.get(t) for t in range(size)]  # None: a missing step
    if (
      any(e is None for e in entries)
      or any(ix.shapes[j][0] != size for j in reals)
      or any(_LAYER_KEY(e[0]) != _LAYER_KEY(entries[0][0]) for e in entries)
    ):
      failed.extend(e for e in entries if e is not None)
      continue
    spec = stack_spec(ix, entries[0][0], reals, size)
    claim(claimed, list(reals), spec.name)
    kept.append((spec, tuple(e[1] for e in entries), tuple(e[2] for e in entries)))
  for entry in failed:  # Its real leaves stay unclaimed: the generic fallback (with a warning).
    for j in entry[0].leaf_indices:
      claimed.pop(j, None)
  for j in [j for j in claimed if j >= ix.n_params]:  # The slices' claims.
    del claimed[j]
  return kept


def match_batched_dense(ix, i, claimed):
  """L dense layers in one `dot_general` of a kernel `[L, ...]` (cast only), its leading axis the
  only batch dimension or a free axis of a 3-d kernel on a shared input; info of one layer."""
  fe = ix.g.eqns[i]
  kernel = _matchers.sole_param_operand(ix, i, "dot_general")
  if kernel is None or kernel[0] >= ix.n_params or kernel[0] in claimed:
    return None
  k_leaf, k_pos = kernel
  k_atom, x_atom = fe.ins[k_pos], fe.ins[1 - k_pos]
  if any(s.op != "cast" for s in ix.origin[k_atom][1]):
    return None
  k_c, x_c, k_b, x_b = _matchers.dot_dims(fe.params["dimension_numbers"], k_pos)
  k_shape, x_shape = _graph.shape_of(k_atom), _graph.shape_of(x_atom)
  if tuple(k_b) == (0,) and len(x_b) == 1:
    x_axis = int(x_b[0])
    x_c1 = tuple(int(d) - (d > x_axis) for d in x_c)
    x_shape1 = x_shape[:x_axis] + x_shape[x_axis + 1 :]
  elif not k_b and not x_b and len(k_shape) == 3 and 0 not in k_c:
    x_axis = None
    x_c1, x_shape1 = tuple(int(d) for d in x_c), x_shape
  else:
    return None
  # The per-layer product: drop the stack axis from the operands.
  k_c1 = tuple(int(d) - 1 for d in k_c)
  found = _matchers.dense_product(k_shape[1:], x_shape1, k_c1, x_c1, k_pos)
  if found is None:
    return None
  info, _, x_free = found
  # dot_general's output: its batch dimensions, then the lhs's free axes, then the rhs's.
  out_axis = len(x_free) if x_axis is None and k_pos == 1 else 0
  leaves, out_key = [k_leaf], fe.outs[0]
  use = _matchers.only_consumer(ix, out_key)
  if use is not None and ix.g.eqns[use[0]].name == "transpose":
    # `jax.vmap` moves the layer axis of the output to the front: tap after the transpose.
    t = ix.g.eqns[use[0]]
    perm = tuple(int(d) for d in t.params["permutation"])
    kept = [d for d in perm if d != out_axis]
    per_layer = [d - (d > out_axis) for d in kept]  # The per-layer axes, as laid out now.
    info = dataclasses.replace(
      info, out_perm=tuple(per_layer.index(info.out_perm[d]) for d in range(len(per_layer)))
    )
    out_axis, out_key = perm.index(out_axis), t.outs[0]
  fits = k_pos == 1 and len(k_shape) == 3 and info.out_dim == k_shape[-1]
  bias = _stacked_bias(ix, out_key, out_axis, k_shape, claimed) if fits else None
  if bias is not None:
    leaves.append(bias[0])
    out_key = bias[1]
  elif x_axis is None:
    return None  # A shared input and no stacked bias: one dense layer over all outputs.
  axes = (-1 if x_axis is None else x_axis, out_axis)
  return _matchers.Match.single(
    "dense", leaves, info, out_key, (x_atom,), stack_size=k_shape[0], stack_axes=axes
  )


def _stacked_bias(ix, out_key, out_axis, k_shape, claimed):
  """A single-use leaf `[L, out]` added along the output's layer axis and last axis."""
  found = _matchers.added_leaf(ix, out_key, claimed)
  if found is None:
    return None
  b_leaf, chain, atom, fe = found
  size, out_shape, b_shape = k_shape[0], _graph.shape_of(out_key), _graph.shape_of(atom)
  if (
    b_leaf >= ix.n_params
    or any(s.op not in ("cast", "reshape") for s in chain)
    or ix.shapes[b_leaf] != (size, k_shape[-1])
    or len(b_shape) != len(out_shape)
    or out_axis == len(out_shape) - 1
    or b_shape[out_axis] != size
    or b_shape[-1] != out_shape[-1]
    or math.prod(b_shape) != size * out_shape[-1]
  ):
    return None
  return b_leaf, fe.outs[0]


def match_stacked_scale_and_shift(ix, i, claimed):
  """L scale-and-shift layers in one operation (a vmapped norm), the scale `[L, ...]` leading."""
  found = _matchers.scale_shift_operands(ix, i, claimed)
  if found is None:
    return None
  leaf, atom, inputs, out_key = found
  if leaf >= ix.n_params:
    return None
  out_shape = _graph.shape_of(out_key)
  block = _matchers.stacked_feature_block(
    ix.shapes[leaf], ix.origin[atom][1], _graph.shape_of(atom), out_shape
  )
  # `jax.vmap` puts the layer axis first (`[T, D]` over `[N, T, D]` is one layer).
  if block is None or block[0] != 0:
    return None
  _, axis, feat = block
  size, per_out = out_shape[0], out_shape[1:]
  if any(len(s) != len(out_shape) or s[0] != size for s in map(_graph.shape_of, inputs)):
    return None
  followed = _matchers.followed_batch_axis(ix, out_key)
  followed = None if followed in (None, 0) else followed - 1
  batch_axis = _matchers.batch_axis_of(per_out, axis, len(feat), ix.batch_size, followed)
  if batch_axis is None:
    return None
  leaves, is_mul = [leaf], ix.g.eqns[i].name == "mul"
  how = _matchers.stacked_feature_block
  shift = _matchers.match_shift(ix, out_key, out_shape, block, claimed, how=how) if is_mul else None
  if shift is not None and ix.shapes[shift[0]][0] == size:
    leaves.append(shift[0])
    out_key = shift[1]
  info = ScaleShiftInfo(
    has_scale=is_mul,
    has_shift=len(leaves) > 1 or not is_mul,
    feature_shape=feat,
    output_shape=per_out,
    feature_axis=axis,
    batch_axis=batch_axis,
  )
  axes = (0,) * (len(inputs) + 1)
  return _matchers.Match.single(
    "scale_and_shift", leaves, info, out_key, inputs, stack_size=size, stack_axes=axes
  )
