"""The graph index: what the matchers read about a traced loss, built once, then read-only.

For each key computed from one parameter leaf by layout-only operations, its leaf and chain of
`ViewStep`s (`origin`); the real uses of each leaf on the loss tags' backward slice. *Virtual
leaves* follow the `n_params` real ones: the slices `leaf[t]` of a stacked leaf read by an
unrolled scan (`stack_of`), then concatenations of several leaves read as one operand
(`virtual`, path `prefix/a+b`; `blocked_virtual` when the pieces have other uses). The scanner
maps layers found on virtual leaves back to the real leaves.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import types
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

from kfac_jax import _compat, _tags
from kfac_jax._specs import ConcatView, ViewStep, common_prefix
from kfac_jax.scan import _batch_axes, _graph, _stacked

# Operations `fold` evaluates on constants (index arithmetic such as T5's position buckets).
_FOLDABLE = (
  _graph.VIEW_OPS
  | {"iota", "expand_dims", "concatenate", "slice", "select_n", "clamp"}
  | {"add", "sub", "mul", "div", "rem", "neg", "abs", "sign", "max", "min", "integer_pow"}
  | {"log", "exp", "sqrt", "floor", "ceil", "round"}
  | {"lt", "le", "gt", "ge", "eq", "ne", "and", "or", "not"}
)
_FOLD_SIZE = 1 << 20


def is_view(fe: _graph.FlatEqn) -> bool:
  """Whether `fe` only moves, reshapes, casts or broadcasts its first operand (unit `tile`s too)."""
  if fe.name in _graph.VIEW_OPS:
    return True
  if fe.name != "tile" or not fe.ins:
    return False
  in_shape = _graph.shape_of(fe.ins[0])
  reps = tuple(fe.params["reps"])
  return len(reps) == len(in_shape) and all(r == 1 or s == 1 for r, s in zip(reps, in_shape))


@dataclasses.dataclass(frozen=True, eq=False)
class GraphIndex:
  """The tables the matchers read (module docstring); leaves are indices into `paths`."""

  g: _graph.FlatGraph
  n_params: int  # Real parameter leaves: 0 .. n_params - 1; virtual leaves follow.
  paths: tuple[str, ...]  # Per leaf.
  shapes: tuple[tuple[int, ...], ...]  # Per leaf.
  batch_size: int  # The loss tags' leading axis.
  const_values: Mapping[Any, Any]  # Closed-over constants by key.
  grad_slice: frozenset[int]  # The equations the tags reach without crossing a stop_gradient.
  origin: Mapping[Any, tuple[int, tuple[ViewStep, ...]]]  # Key -> (leaf, view chain).
  virtual: Mapping[int, ConcatView]  # Concatenation leaf -> its view.
  blocked_virtual: frozenset[int]  # Concatenation leaves whose pieces have other uses.
  stack_of: Mapping[int, tuple[int, int]]  # Stack-slice leaf -> (real leaf, t).
  producer: Mapping[Any, int]  # Key -> the equation computing it.
  uses: Mapping[int, tuple[tuple[int, int], ...]]  # Leaf -> real uses (equation, operand).
  uses_by_eqn: Mapping[int, tuple[tuple[int, int], ...]]  # Equation -> (leaf, operand).
  slice_consumers: Mapping[Any, tuple[tuple[int, int], ...]]  # Key -> (equation, operand).
  param_only: frozenset[Any]  # Keys computed from parameters and constants alone (`_param_only`).
  from_batch: frozenset[Any]  # Keys computed from a batch input.
  readers: Mapping[Any, tuple[tuple[int, int], ...]]  # Key -> every (equation, operand) reading it.
  batch_axes: Mapping[Any, tuple[int, int]]  # Key -> (axis, inner), as `_batch_axes` follows it.
  loss_roots: tuple[Any, ...] = ()  # Per loss tag, its prediction operand.


def build(graph, n_params: int, paths, shapes, loss_roots: Sequence[Any], batch_size: int):
  """The index of `graph`, whose first `n_params` inputs are the parameter leaves; the loss
  slice is what the tags' predictions `loss_roots` depend on."""
  paths, shapes = list(paths), [tuple(s) for s in shapes]
  consts, producer = dict(graph.consts), {k: i for i, fe in enumerate(graph.eqns) for k in fe.outs}
  in_slice, grad_slice = _loss_slice(graph, loss_roots)
  leaf_of_key = {k: i for i, k in enumerate(graph.invars[:n_params])}
  stack_of: dict[int, tuple[int, int]] = {}
  slices = _stacked.slice_leaves(graph, shapes, in_slice)
  for key, (j, t) in sorted(slices.items(), key=lambda item: item[1]):
    leaf_of_key[key] = len(paths)
    stack_of[len(paths)] = (j, t)
    paths.append(paths[j])
    shapes.append(shapes[j][1:])
  origin, view_eqns, virtual, concat_eqns = _views(
    graph, leaf_of_key, consts, n_params, len(paths), _folder(graph, consts, producer)
  )
  for view in virtual.values():
    paths.append(_concat_path([paths[j] for j in view.leaves]))
    shapes.append(view.shape)
  uses, uses_by_eqn, blocked = _uses(graph, in_slice, origin, view_eqns, virtual, concat_eqns)
  consumers: dict[Any, list[tuple[int, int]]] = {}
  readers: dict[Any, list[tuple[int, int]]] = {}
  from_batch = set(graph.invars[n_params:])
  for i, fe in enumerate(graph.eqns):
    for pos, a in enumerate(fe.ins):
      if _graph.is_key(a):
        readers.setdefault(a, []).append((i, pos))
        if i in in_slice:
          consumers.setdefault(a, []).append((i, pos))
    if any(_graph.is_key(a) and a in from_batch for a in fe.ins):
      from_batch.update(fe.outs)
  proxy = types.MappingProxyType
  frozen_lists = lambda d: proxy({k: tuple(v) for k, v in d.items()})
  return GraphIndex(
    g=graph,
    n_params=n_params,
    paths=tuple(paths),
    shapes=tuple(shapes),
    batch_size=batch_size,
    const_values=proxy(consts),
    grad_slice=frozenset(grad_slice),
    origin=proxy(origin),
    virtual=proxy(virtual),
    blocked_virtual=blocked,
    stack_of=proxy(stack_of),
    producer=proxy(producer),
    uses=frozen_lists(uses),
    uses_by_eqn=frozen_lists(uses_by_eqn),
    slice_consumers=frozen_lists(consumers),
    param_only=_param_only(graph, leaf_of_key, consts, batch_size),
    from_batch=frozenset(from_batch),
    readers=frozen_lists(readers),
    batch_axes=proxy(_batch_axes.batch_axes(graph, n_params, batch_size, loss_roots)),
    loss_roots=tuple(loss_roots),
  )


def _uses(graph, in_slice, origin, view_eqns, virtual, concat_eqns):
  """`(uses, uses_by_eqn, blocked_virtual)` on the loss slice; a blocked concat uses each piece."""
  found = [
    (i, pos, origin[a][0])
    for i in sorted(in_slice - view_eqns - set(concat_eqns))
    if not is_view(graph.eqns[i]) and graph.eqns[i].eqn.primitive is not _tags.layer_tag_p
    for pos, a in enumerate(graph.eqns[i].ins)
    if _graph.is_key(a) and a in origin
  ]
  used = {leaf for _, _, leaf in found}
  owners = collections.Counter(j for view in virtual.values() for j in view.leaves)
  blocked = frozenset(
    v for v, view in virtual.items() if any(j in used or owners[j] > 1 for j in view.leaves)
  )
  for i, v in concat_eqns.items():
    if v in blocked and i in in_slice:
      found.extend((i, pos, j) for pos, j in enumerate(virtual[v].leaves))
  uses: dict[int, list[tuple[int, int]]] = {}
  uses_by_eqn: dict[int, list[tuple[int, int]]] = {}
  for i, pos, leaf in found:
    uses.setdefault(leaf, []).append((i, pos))
    uses_by_eqn.setdefault(i, []).append((leaf, pos))
  return uses, uses_by_eqn, blocked


def tags_reached(ix: GraphIndex, key) -> frozenset[int]:
  """The loss tags (by position) whose predictions `key` (or a `HoistedTap`'s keys) reaches."""
  roots = {a: t for t, a in enumerate(ix.loss_roots) if _graph.is_key(a)}
  start = list(key.keys) if isinstance(key, _graph.HoistedTap) else [key]
  seen, frontier = set(start), list(start)
  while frontier:
    consumers = ix.slice_consumers.get(frontier.pop(), ())
    new = [o for i, _ in consumers for o in ix.g.eqns[i].outs if o not in seen]
    seen.update(new)
    frontier.extend(new)
  return frozenset(roots[k] for k in seen if k in roots)


def _loss_slice(graph, roots) -> tuple[set[int], set[int]]:
  """The equations the loss tags' operands depend on, and those not behind a `stop_gradient`."""
  needed = {a for a in roots if _graph.is_key(a)}
  reached = set(needed)
  in_slice, grad_slice = set(), set()
  for i in range(len(graph.eqns) - 1, -1, -1):
    fe = graph.eqns[i]
    if any(k in needed for k in fe.outs):
      in_slice.add(i)
      needed.update(a for a in fe.ins if _graph.is_key(a))
    if fe.name != "stop_gradient" and any(k in reached for k in fe.outs):
      grad_slice.add(i)
      reached.update(a for a in fe.ins if _graph.is_key(a))
  return in_slice, grad_slice


def _param_only(graph, leaf_of_key, consts, batch_size: int) -> frozenset:
  """The keys computed from parameter leaves and constants alone, less those whose leading axis
  has the batch's size and comes from no same-rank operand (a zero initial state)."""
  found = set(leaf_of_key)
  found.update(k for k, v in consts.items() if np.ndim(v) == 0 or np.shape(v)[0] != batch_size)
  for fe in graph.eqns:
    keys = [a for a in fe.ins if _graph.is_key(a)]
    if any(a not in found for a in keys):
      continue
    for o in fe.outs:
      shape = _graph.shape_of(o)
      if shape and shape[0] == batch_size:
        same = [_graph.shape_of(a) for a in keys]
        if not any(len(t) == len(shape) and t[0] == shape[0] for t in same):
          continue  # A leading axis of the batch's size, made here: may be the batch.
      found.add(o)
  return frozenset(found)


def _views(graph, leaf_of_key, consts, n_params: int, first_virtual: int, fold):
  """`(origin, view_eqns, virtual, concat_eqns)`: each key's (leaf, chain), the non-`is_view`
  equations viewing a parameter, the concatenation leaves (from `first_virtual`), their eqns."""
  origin: dict[Any, tuple[int, tuple[ViewStep, ...]]] = {k: (j, ()) for k, j in leaf_of_key.items()}
  view_eqns: set[int] = set()
  virtual: dict[int, ConcatView] = {}
  concat_eqns: dict[int, int] = {}
  for i, fe in enumerate(graph.eqns):
    if fe.name in ("concatenate", "stack"):
      view = _concat_view(fe, origin, n_params)
      if view is not None:
        v = next((k for k, w in virtual.items() if w == view), first_virtual + len(virtual))
        virtual[v] = view
        concat_eqns[i] = v
        origin[fe.outs[0]] = (v, ())
      continue
    found = _view_of(fe, origin, consts, fold)
    if found is not None:
      if not is_view(fe):
        view_eqns.add(i)
      leaf, chain = origin[found[0]]
      origin[fe.outs[0]] = (leaf, chain + (found[1],))
  return origin, view_eqns, virtual, concat_eqns


def _view_of(fe, origin, consts, fold) -> tuple[Any, ViewStep] | None:
  """`(parameter view read, step)` when `fe` is a layout operation, a gather at constant rows or
  a shift by a scalar constant (an identity Jacobian) of a parameter view."""
  src = fe.ins[0] if fe.ins and _graph.is_key(fe.ins[0]) and fe.ins[0] in origin else None
  if src is not None and is_view(fe):
    return src, _graph.view_step(fe)
  if src is not None and fe.name == "gather" and len(fe.ins) == 2:
    step = _gather_view(fe, fold)
    return None if step is None else (src, step)
  if fe.name not in ("add", "sub"):
    return None
  out_shape = _graph.shape_of(fe.outs[0])
  for pos in (0, 1) if fe.name == "add" else (0,):  # `view + c`, `c + view`, `view - c`.
    a, c = fe.ins[pos], fe.ins[1 - pos]
    if not _graph.is_key(a) or a not in origin or _graph.shape_of(a) != out_shape:
      continue
    if (isinstance(c, _compat.Literal) and np.ndim(c.val) == 0) or (
      _graph.is_key(c) and c in consts and np.size(consts[c]) == 1
    ):
      return a, ViewStep("shift", out_shape, out_shape)
  return None


def _concat_view(fe, origin, n_params: int) -> ConcatView | None:
  """The view of a concatenation (or stack) of reshaped or cast views of distinct real leaves."""
  if len(fe.ins) < 2 or not all(_graph.is_key(a) and a in origin for a in fe.ins):
    return None
  leaves, chains = tuple(origin[a][0] for a in fe.ins), [origin[a][1] for a in fe.ins]
  if (
    len(set(leaves)) != len(leaves)
    or any(j >= n_params for j in leaves)
    or any(st.op not in ("reshape", "transpose", "cast") for c in chains for st in c)
  ):
    return None
  shapes = [_graph.shape_of(a) for a in fe.ins]
  if fe.name == "stack":  # A concatenation of the operands with a unit axis inserted.
    axis = int(fe.params["axis"])
    unit = [sh[:axis] + (1,) + sh[axis:] for sh in shapes]
    chains = [c + (ViewStep("reshape", sh, u),) for c, sh, u in zip(chains, shapes, unit)]
    shapes = unit
  else:
    axis = int(fe.params["dimension"])
  return ConcatView(
    leaves=leaves,
    chains=tuple(chains),
    axis=axis,
    piece_shapes=tuple(shapes),
    shape=_graph.shape_of(fe.outs[0]),
  )


def _concat_path(paths: Sequence[str]) -> str:
  """`prefix/a+b` for the concatenation of `prefix/a` and `prefix/b`."""
  prefix = common_prefix(paths)
  rest = [p[len(prefix) + 1 :] if prefix and p.startswith(prefix + "/") else p for p in paths]
  return (prefix + "/" if prefix and prefix not in paths else "") + "+".join(rest)


def _gather_view(fe, fold) -> ViewStep | None:
  """The step of a gather of whole rows of a `[T, D]` view at constant ids: every row in order is
  the view itself (a unit axis under `jax.vmap`), other rows a "gather" (`table[buckets]`)."""
  t_shape, out_shape = _graph.shape_of(fe.ins[0]), _graph.shape_of(fe.outs[0])
  dn = fe.params["dimension_numbers"]
  whole_rows = len(t_shape) == 2 and tuple(fe.params["slice_sizes"]) == (1, t_shape[1])
  ids = fold(fe.ins[1]) if whole_rows and not tuple(dn.operand_batching_dims) else None
  if ids is None:
    return None
  rows = np.arange(t_shape[0])
  dims = (tuple(dn.offset_dims), tuple(dn.collapsed_slice_dims), tuple(dn.start_index_map))
  if out_shape == t_shape and dims == ((1,), (0,), (0,)) and np.array_equal(ids.reshape(-1), rows):
    return ViewStep("cast", t_shape, t_shape)
  if (
    len(out_shape) >= 2
    and out_shape[-1] == t_shape[1]
    and dims == ((len(out_shape) - 1,), (0,), (0,))
    and np.issubdtype(ids.dtype, np.integer)
    and ids.shape == out_shape[:-1] + (1,)
    and ids.size
    and 0 <= ids.min()
    and ids.max() < t_shape[0]
  ):
    return ViewStep("gather", t_shape, out_shape, rows=ids.reshape(-1).astype(np.int32).tobytes())
  unit = (t_shape[0], 1, t_shape[1])
  if (
    out_shape == unit
    and dims == ((1, 2), (), (0, 1))
    and ids.shape == (t_shape[0], 2)
    and np.array_equal(ids[:, 0], rows)
    and not ids[:, 1].any()
  ):
    return ViewStep("reshape", t_shape, unit)
  return None


def _folder(graph, consts, producer):
  """`fold(atom)`: `atom`'s value when `_FOLDABLE` operations compute it from constants, or None."""
  folded: dict[Any, Any] = {}

  def fold(atom, depth: int = 64):
    if isinstance(atom, _compat.Literal) or atom in consts:
      return _graph.constant_value(consts, atom)
    if not _graph.is_key(atom) or depth == 0:
      return None
    if atom not in folded:
      folded[atom] = evaluate(atom, depth)
    return folded[atom]

  def evaluate(atom, depth: int):
    fe = graph.eqns[producer[atom]] if atom in producer else None
    if fe is None or fe.fn is not None or fe.name not in _FOLDABLE or len(fe.outs) != 1:
      return None
    if math.prod(_graph.shape_of(fe.outs[0])) > _FOLD_SIZE:
      return None
    vals = [fold(a, depth - 1) for a in fe.ins]
    if any(v is None for v in vals):
      return None
    try:
      with jax.ensure_compile_time_eval():
        return np.asarray(fe.eqn.primitive.bind(*vals, **fe.params))
    except (TypeError, ValueError, jax.errors.JAXTypeError):  # Not foldable here: no view.
      return None

  return fold
