"""Where the examples are: each value's batch axis, followed from the batch inputs.

Sizes alone cannot always say (a time-major `[T, N, D]` activation with T = N). A value's entry
is `(axis, inner)`: axis `axis` holds the examples, each example's entries `inner` consecutive
positions along it (`inner` > 1: rows grouped example-major, as `(b h) t d`). Values without
one (summed over, mixed, after a loop or a scatter) leave the matchers to sizes.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from kfac_jax.scan import _graph

BatchAxis = tuple[int, int]  # (axis, inner)

# Elementwise equations of several operands, which broadcast their operands' unit axes.
ELEMENTWISE = frozenset(
  {"add", "add_any", "sub", "mul", "div", "max", "min", "pow", "atan2", "rem", "select_n"}
  | {"nextafter", "and", "or", "xor", "eq", "ne", "lt", "le", "gt", "ge"}
)

# Equations whose outputs are not followed even when a shape matches an input's (and scatters).
_OPAQUE = frozenset(
  {"while", "cond", "scan", "fft", "all_gather", "all_to_all", "psum", "pmean", "ppermute"}
)


def batch_axes(
  graph: _graph.FlatGraph, n_params: int, batch_size: int, loss_roots: Sequence[Any] = ()
) -> Mapping[Any, BatchAxis]:
  """`{key: (axis, inner)}` followed from the batch leaves (the inputs after `n_params`); a leaf
  with several batch-sized axes takes the first under which every loss prediction's batch leads."""
  leaves = graph.invars[n_params:]
  shapes = [_graph.shape_of(key) for key in leaves]
  candidates = [[a for a, s in enumerate(shape) if s == batch_size] for shape in shapes]
  roots = [a for a in loss_roots if _graph.is_key(a)]
  first = [batch_position(shape, batch_size) for shape in shapes]
  tags = _follow(graph, leaves, first, batch_size)
  ambiguous = sorted({a for c in candidates if len(c) > 1 for a in c[1:]})
  for axis in ambiguous:
    if all(tags.get(r, (0, 1))[0] == 0 for r in roots):
      break
    # The ambiguous leaves (several sized axes) read at `axis` instead, where they have it.
    choice = [a if len(c) < 2 else (axis if axis in c else a) for a, c in zip(first, candidates)]
    tried = _follow(graph, leaves, choice, batch_size)
    if all(tried.get(r, (0, 1))[0] == 0 for r in roots):
      tags = tried
  return tags


def _follow(graph, leaves, axes, batch_size: int) -> dict[Any, BatchAxis]:
  """The tags from the batch leaves `leaves`, each with its batch at `axes[i]` (None: none)."""
  tags: dict[Any, BatchAxis] = {key: (a, 1) for key, a in zip(leaves, axes) if a is not None}
  for fe in graph.eqns:
    ins = [tags.get(a) if _graph.is_key(a) else None for a in fe.ins]
    if not any(t is not None for t in ins):
      continue  # Nothing from the batch.
    rule = _RULES.get(fe.name)
    outs = rule(fe, ins) if rule is not None else _same_shape(fe, ins)
    for key, tag in zip(fe.outs, outs):
      shape = _graph.shape_of(key)
      if tag is not None and 0 <= tag[0] < len(shape) and shape[tag[0]] == batch_size * tag[1]:
        tags[key] = tag
  return tags


def batch_position(sizes, batch_size) -> int | None:
  """The batch among axes of `sizes`: the leading one if batch-sized, else the only batch-sized."""
  if batch_size is None or not sizes:
    return None
  if sizes[0] == batch_size:
    return 0
  sized = [t for t, n in enumerate(sizes) if n == batch_size]
  return sized[0] if len(sized) == 1 else None


def _one(ins) -> BatchAxis | None:
  """The single tag among the inputs, or None when none or several differ."""
  found = {t for t in ins if t is not None}
  return found.pop() if len(found) == 1 else None


def _same_shape(fe, ins) -> list[BatchAxis | None]:
  """An output's tag: that of its inputs of its shape (elementwise: of its rank, not broadcast)."""
  if fe.name in _OPAQUE or fe.name.startswith("scatter"):
    return [None] * len(fe.outs)
  out = []
  for key in fe.outs:
    shape = _graph.shape_of(key)
    tagged = [(_graph.shape_of(a), t) for a, t in zip(fe.ins, ins) if t is not None]
    found = [t for a, t in tagged if a == shape]
    if not found and fe.name in ELEMENTWISE:
      found = [t for a, t in tagged if len(a) == len(shape) and a[t[0]] == shape[t[0]]]
    out.append(_one(found))
  return out


def _broadcast(fe, ins):
  axis, inner = ins[0]
  dims = tuple(fe.params["broadcast_dimensions"])
  if _graph.shape_of(fe.ins[0])[axis] != _graph.shape_of(fe.outs[0])[dims[axis]]:
    return [None]
  return [(dims[axis], inner)]


def _reshape(fe, ins):
  """By strides: the examples' stride must fall inside one output axis, as its outermost part."""
  axis, inner = ins[0]
  in_shape, out_shape = _graph.shape_of(fe.ins[0]), _graph.shape_of(fe.outs[0])
  n = in_shape[axis] // inner
  stride = inner * math.prod(in_shape[axis + 1 :])  # Flat distance between two examples.
  for j in range(len(out_shape)):
    step = math.prod(out_shape[j + 1 :])
    if stride % step == 0 and out_shape[j] == n * (stride // step):
      return [(j, stride // step)]
  return [None]


def _drops(param: str, fe, ins):
  """An equation that removes the axes `fe.params[param]` (squeeze, reductions)."""
  axis, inner = ins[0]
  dims = tuple(fe.params[param])
  return [None if axis in dims else (axis - sum(d < axis for d in dims), inner)] * len(fe.outs)


def _transpose(fe, ins):
  axis, inner = ins[0]
  return [(tuple(fe.params["permutation"]).index(axis), inner)]


def _along(param: str, fe, ins):
  """An equation along the axis `fe.params[param]`: the batch passes unless it is there."""
  tag = _one(ins)
  return [None if tag is None or tag[0] == fe.params[param] else tag] * len(fe.outs)


def _pad(fe, ins):
  return [ins[0] if tuple(fe.params["padding_config"][ins[0][0]]) == (0, 0, 0) else None]


def _slice(fe, ins):
  """Slices (static or dynamic) that keep the whole batch axis keep it."""
  (axis, _), out_shape = ins[0], _graph.shape_of(fe.outs[0])
  return [ins[0] if _graph.shape_of(fe.ins[0])[axis] == out_shape[axis] else None] * len(fe.outs)


def _reduce_window(fe, ins):
  """Pooling: the batch axis passes when the window neither spans, strides nor pads it."""
  tag, p = _one(ins), fe.params
  if tag is None:
    return [None] * len(fe.outs)
  a = tag[0]
  window = (p["window_dimensions"][a], p["window_strides"][a], tuple(p["padding"][a]))
  return [tag if window == (1, 1, (0, 0)) else None] * len(fe.outs)


def _dot_general(fe, ins):
  (lc, rc), (lb, rb) = fe.params["dimension_numbers"]
  nl, nr = len(_graph.shape_of(fe.ins[0])), len(_graph.shape_of(fe.ins[1]))
  l_free = [d for d in range(nl) if d not in lc and d not in lb]
  r_free = [d for d in range(nr) if d not in rc and d not in rb]
  found = []
  for side, tag in enumerate(ins):
    if tag is None:
      continue
    axis, inner = tag
    contract, batch, free = (lc, lb, l_free) if side == 0 else (rc, rb, r_free)
    if axis in contract:
      return [None]  # The examples are summed over.
    if axis in batch:
      found.append((list(batch).index(axis), inner))
    else:
      offset = len(lb) + (0 if side == 0 else len(l_free))
      found.append((offset + free.index(axis), inner))
  return [_one(found)]


def _conv(fe, ins):
  if ins[1] is not None or ins[0] is None or fe.params.get("batch_group_count", 1) != 1:
    return [None]
  lhs_spec, _, out_spec = fe.params["dimension_numbers"]
  axis, inner = ins[0]
  return [(out_spec[0], inner)] if axis == lhs_spec[0] else [None]


def _gather(fe, ins):
  """A lookup at per-example indices (or batching dimensions), or constant ones off the batch."""
  dn = fe.params["dimension_numbers"]
  operand, indices = ins[0], ins[1]
  out_rank = len(_graph.shape_of(fe.outs[0]))
  batch_dims = [d for d in range(out_rank) if d not in dn.offset_dims]  # Indices' dims, in order.
  op_batching = tuple(getattr(dn, "operand_batching_dims", ()))
  idx_batching = tuple(getattr(dn, "start_indices_batching_dims", ()))
  n_idx = len(_graph.shape_of(fe.ins[1]))
  if indices is not None:
    axis, inner = indices
    if axis == n_idx - 1:  # The index vector's axis.
      return [None]
    if operand is not None:
      a = operand[0]
      if a not in op_batching or idx_batching[op_batching.index(a)] != axis:
        return [None]
    return [(batch_dims[axis], inner)]
  assert operand is not None
  axis, inner = operand
  if axis in dn.collapsed_slice_dims or axis in op_batching:
    return [None]
  if fe.params["slice_sizes"][axis] != _graph.shape_of(fe.ins[0])[axis]:
    return [None]
  kept = [d for d in range(len(_graph.shape_of(fe.ins[0]))) if d not in dn.collapsed_slice_dims]
  kept = [d for d in kept if d not in op_batching]
  return [(dn.offset_dims[kept.index(axis)], inner)]


def _scan_slice(fe, ins):
  """One step's slice of a scanned input (its leading axis dropped)."""
  axis, inner = ins[0]
  return [None if axis == 0 else (axis - 1, inner)]


def _scan_stack(fe, ins):
  """The steps' outputs stacked along a new leading axis."""
  tag = ins[0] if all(t == ins[0] for t in ins) else None
  return [None if tag is None else (tag[0] + 1, tag[1])]


_RULES: dict[str, Callable[[Any, list], list]] = {
  # An unrolled scan's synthetic equations (its carry, an identity, takes the default).
  "scan_slice": _scan_slice,
  "scan_stack": _scan_stack,
  "broadcast_in_dim": _broadcast,
  "reshape": _reshape,
  "squeeze": functools.partial(_drops, "dimensions"),
  "transpose": _transpose,
  **dict.fromkeys(("concatenate", "sort"), functools.partial(_along, "dimension")),
  "split": functools.partial(_along, "axis"),
  "pad": _pad,
  "slice": _slice,
  "dynamic_slice": _slice,
  "dot_general": _dot_general,
  "conv_general_dilated": _conv,
  "gather": _gather,
  **dict.fromkeys([f"reduce_window{op}" for op in ("", "_sum", "_max", "_min")], _reduce_window),
  **dict.fromkeys(
    [f"reduce_{op}" for op in ("sum", "max", "min", "prod", "and", "or", "xor")]
    + ["argmax", "argmin"],
    functools.partial(_drops, "axes"),
  ),
  **dict.fromkeys(
    ("cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp"), functools.partial(_along, "axis")
  ),
}
