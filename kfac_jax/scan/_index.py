"""The graph index: what the scanner knows about a traced loss, built once and then only read.

`build` walks the flattened graph (`_graph.FlatGraph`) once and records, for the matchers:

  * the backward slice of the loss tags (`in_slice`): only uses there count;
  * each key computed from one parameter leaf by layout-only operations (`origin`: the leaf and
    its chain of `ViewStep`s);
  * the real uses of each leaf (`uses`, by leaf; `uses_by_eqn`, by equation) and the consumers of
    each key on the loss slice (`slice_consumers`), the producer of each key (`producer`);
  * *virtual leaves*, appended after the `n_params` real ones, in this order:
      1. the slices `leaf[t]` of a stacked leaf read by an unrolled scan (`stack_of`, `stacks`;
         see `_stacked.add_virtual_leaves`), with the leaf's own path;
      2. concatenations of several leaves read as one operand (`virtual`: the `ConcatView`;
         `concat_eqns`), with a path joining the pieces' names (`prefix/a+b`). A concatenation
         whose pieces have other uses is `blocked_virtual`: its pieces count as used by it.
    The matchers treat virtual leaves like real ones; the scanner maps the layers found on them
    back to the real leaves (concatenations first, then stacks: `_scanner._Scanner.run`).

The index is a frozen dataclass; its tables are read-only mappings, so a matcher cannot change
what the next one sees. Matchers (`_matchers`, `_matchers_embed`, `_matchers_shared`,
`_stacked`) are pure functions of the index.
"""

from __future__ import annotations

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

# Operations that only move, reshape or cast a parameter.
VIEW_OPS = frozenset(
  {"convert_element_type", "copy", "copy_p", "reshape", "transpose", "broadcast_in_dim", "squeeze"}
)


# Operations `_Builder.fold` evaluates on constants (index arithmetic, e.g. T5's log-spaced
# relative-position buckets), up to `_FOLD_SIZE` values.
_FOLDABLE = frozenset(
  {
    "iota",
    "add",
    "div",
    "log",
    "exp",
    "sqrt",
    "floor",
    "ceil",
    "round",
    "sign",
    "integer_pow",
    "sub",
    "mul",
    "neg",
    "abs",
    "max",
    "min",
    "clamp",
    "rem",
    "lt",
    "le",
    "gt",
    "ge",
    "eq",
    "ne",
    "and",
    "or",
    "not",
    "select_n",
    "convert_element_type",
    "broadcast_in_dim",
    "reshape",
    "squeeze",
    "expand_dims",
    "transpose",
    "concatenate",
    "slice",
  }
)
_FOLD_SIZE = 1 << 20


def is_view(fe: _graph.FlatEqn) -> bool:
  """Whether `fe` only moves, reshapes, casts or broadcasts its first operand: a `VIEW_OPS`
  equation, or a `tile` that only repeats unit axes (`jnp.tile(cls, (n, 1, 1))` of a `[1, 1, D]`
  token is a broadcast)."""
  if fe.name in VIEW_OPS:
    return True
  if fe.name != "tile" or not fe.ins:
    return False
  in_shape = tuple(_graph.aval_of(fe.ins[0]).shape)
  reps = tuple(fe.params["reps"])
  return len(reps) == len(in_shape) and all(r == 1 or s == 1 for r, s in zip(reps, in_shape))


def _view_step(fe: _graph.FlatEqn) -> ViewStep:
  in_shape = tuple(_graph.aval_of(fe.ins[0]).shape)
  out_shape = tuple(fe.outs[0][1].aval.shape)
  if fe.name == "tile":  # A broadcast of unit axes (`is_view`).
    return ViewStep("broadcast", in_shape, out_shape, tuple(range(len(in_shape))))
  if fe.name == "transpose":
    return ViewStep("transpose", in_shape, out_shape, tuple(fe.params["permutation"]))
  if fe.name in ("reshape", "squeeze"):
    return ViewStep("reshape", in_shape, out_shape)
  if fe.name == "broadcast_in_dim":
    if math.prod(in_shape) == math.prod(out_shape):
      return ViewStep("reshape", in_shape, out_shape)  # Only inserts unit dimensions.
    return ViewStep("broadcast", in_shape, out_shape, tuple(fe.params["broadcast_dimensions"]))
  return ViewStep("cast", in_shape, out_shape)


@dataclasses.dataclass(frozen=True, eq=False)
class GraphIndex:
  """The tables the matchers read (module docstring). Leaves are indices into `paths`."""

  g: _graph.FlatGraph
  n_params: int  # Real parameter leaves: 0 .. n_params - 1; virtual leaves follow.
  paths: tuple[str, ...]  # Per leaf, real and virtual.
  shapes: tuple[tuple[int, ...], ...]  # Per leaf, real and virtual.
  batch_size: int  # The loss tags' leading axis.
  const_values: Mapping[Any, Any]  # Closed-over constants by key.
  in_slice: frozenset[int]  # Equations on the backward slice of the loss tags.
  # The part of `in_slice` reached without crossing a `stop_gradient` (`_Builder._loss_slice`).
  grad_slice: frozenset[int]
  leaf_of_key: Mapping[Any, int]  # The key holding each (real or stack-slice) leaf.
  origin: Mapping[Any, tuple[int, tuple[ViewStep, ...]]]  # Key -> (leaf, view chain).
  view_eqns: frozenset[int]  # Equations that add a constant to a parameter view (a view too).
  virtual: Mapping[int, ConcatView]  # Concatenation leaf -> its view.
  concat_eqns: Mapping[int, int]  # Equation -> the concatenation leaf it computes.
  blocked_virtual: frozenset[int]  # Concatenation leaves whose pieces have other uses.
  stack_of: Mapping[int, tuple[int, int]]  # Stack-slice leaf -> (real leaf, t).
  stacks: Mapping[int, tuple[int, ...]]  # Real stacked leaf -> its slice leaves by t.
  producer: Mapping[Any, int]  # Key -> the equation computing it.
  uses: Mapping[int, tuple[tuple[int, int], ...]]  # Leaf -> real uses (equation, operand).
  uses_by_eqn: Mapping[int, tuple[tuple[int, int], ...]]  # Equation -> (leaf, operand).
  slice_consumers: Mapping[Any, tuple[tuple[int, int], ...]]  # Key -> (equation, operand).
  # Keys computed from parameters and constants alone, never with a leading axis that may be the
  # batch's (`_Builder.param_only`): not activations, no rows per example.
  param_only: frozenset[Any]
  # Key -> (axis, inner): the batch axis followed from the batch leaves (`_batch_axes`).
  batch_axes: Mapping[Any, tuple[int, int]] = dataclasses.field(
    default_factory=lambda: types.MappingProxyType({})
  )


def build(
  graph: _graph.FlatGraph,
  n_params: int,
  paths: Sequence[str],
  shapes: Sequence[tuple[int, ...]],
  loss_roots: Sequence[Any],
  batch_size: int,
) -> GraphIndex:
  """The index of `graph`, whose first `n_params` inputs are the parameter leaves.

  `loss_roots` are the loss tags' prediction operands: the loss slice is what they depend on.
  """
  b = _Builder(graph, n_params, paths, shapes)
  b.const_values = dict(graph.consts)
  b._loss_slice(loss_roots)
  _stacked.add_virtual_leaves(b)  # Slices of stacked leaves (indices from n_params on).
  b.producer = {k: i for i, fe in enumerate(graph.eqns) for k in fe.outs}
  b._origins()
  b._uses(b.in_slice)
  b._check_virtual()
  proxy = types.MappingProxyType

  def frozen_lists(d):
    return proxy({k: tuple(v) for k, v in d.items()})

  return GraphIndex(
    g=graph,
    n_params=n_params,
    paths=tuple(b.paths),
    shapes=tuple(tuple(s) for s in b.shapes),
    batch_size=batch_size,
    const_values=proxy(b.const_values),
    in_slice=frozenset(b.in_slice),
    grad_slice=frozenset(b.grad_slice),
    leaf_of_key=proxy(b.leaf_of_key),
    origin=proxy(b.origin),
    view_eqns=frozenset(b.view_eqns),
    virtual=proxy(b.virtual),
    concat_eqns=proxy(b.concat_eqns),
    blocked_virtual=frozenset(b.blocked_virtual),
    stack_of=proxy(b.stack_of),
    stacks=proxy({k: tuple(v) for k, v in b.stacks.items()}),
    producer=proxy(b.producer),
    uses=frozen_lists(b.uses),
    uses_by_eqn=frozen_lists(b.uses_by_eqn),
    slice_consumers=frozen_lists(b.slice_consumers),
    param_only=frozenset(b.param_only(batch_size)),
    batch_axes=proxy(_batch_axes.batch_axes(graph, n_params, batch_size, loss_roots)),
  )


class _Builder:
  """The mutable tables while `build` fills them (the attributes of `GraphIndex`)."""

  def __init__(self, graph, n_params, paths, shapes):
    self.g = graph
    self.n_params = n_params
    self.paths = list(paths)  # Virtual leaves are appended after the params.
    self.shapes = list(shapes)
    self.leaf_of_key = {k: i for i, k in enumerate(graph.invars[:n_params])}
    # Filled by `build` (and `_stacked.add_virtual_leaves`: stack_of, stacks).
    self.const_values: dict[Any, Any] = {}
    self.producer: dict[Any, int] = {}
    self.stack_of: dict[int, Any] = {}
    self.stacks: dict[Any, Any] = {}
    self._folded: dict[Any, Any] = {}  # `fold`'s values by key.

  def param_only(self, batch_size: int) -> set:
    """The keys computed from parameter leaves (real or stack slices) and constants alone,
    leaving out any whose leading axis may be the batch's: a closed-over constant whose leading
    axis has the batch's size (an initial state built outside the loss function), and a leading
    axis of the batch's size that no same-rank operand passes on (created by a broadcast, as
    `broadcast_to(latents, (N, L, D))` or a zero initial state `zeros((N, H))`). Those are
    activations with one row per example even though no batch input reaches them."""
    found = set(self.leaf_of_key)
    found.update(
      k for k, v in self.const_values.items() if np.ndim(v) == 0 or np.shape(v)[0] != batch_size
    )
    for fe in self.g.eqns:
      keys = [a for a in fe.ins if _graph.is_key(a)]
      if any(a not in found for a in keys):
        continue
      for o in fe.outs:
        shape = tuple(o[1].aval.shape)
        if shape and shape[0] == batch_size:
          same = [tuple(_graph.aval_of(a).shape) for a in keys]
          if not any(len(t) == len(shape) and t[0] == shape[0] for t in same):
            continue  # A leading axis of the batch's size, made here: may be the batch.
        found.add(o)
    return found

  def _loss_slice(self, roots) -> set[int]:
    """The equations the loss tags' operands depend on (`in_slice`), and those they depend on
    without a `stop_gradient` in between (`grad_slice`: what the tags' curvature can reach)."""
    needed = {a for a in roots if _graph.is_key(a)}
    reached = set(needed)
    in_slice, grad_slice = set(), set()
    for i in range(len(self.g.eqns) - 1, -1, -1):
      fe = self.g.eqns[i]
      if any(k in needed for k in fe.outs):
        in_slice.add(i)
        needed.update(a for a in fe.ins if _graph.is_key(a))
      if fe.name != "stop_gradient" and any(k in reached for k in fe.outs):
        grad_slice.add(i)
        reached.update(a for a in fe.ins if _graph.is_key(a))
    self.in_slice = in_slice
    self.grad_slice = grad_slice
    return in_slice

  def _origins(self):
    """For each key computed from one parameter leaf by view ops only: (leaf, chain).

    Adding a constant (`1 + scale`, Gemma's RMSNorm) is a view too: the shifted parameter has
    the parameter's gradient and Fisher (the Jacobian is the identity), so the layer's block is
    the same as for the shifted parameter itself ("shift" steps are skipped like casts).
    """
    self.origin: dict[Any, tuple[int, tuple[ViewStep, ...]]] = {
      k: (j, ()) for k, j in self.leaf_of_key.items()
    }
    self.view_eqns: set[int] = set()  # Equations that only view a parameter (not real uses).
    self.virtual: dict[int, ConcatView] = {}  # Virtual leaf -> the concatenation it stands for.
    self.concat_eqns: dict[int, int] = {}  # Equation -> the virtual leaf it computes.
    for i, fe in enumerate(self.g.eqns):
      if is_view(fe) and fe.ins and _graph.is_key(fe.ins[0]) and fe.ins[0] in self.origin:
        leaf, chain = self.origin[fe.ins[0]]
        self.origin[fe.outs[0]] = (leaf, chain + (_view_step(fe),))
      elif fe.name in ("concatenate", "stack"):
        self._concat_origin(i, fe)
      elif fe.name == "gather" and (step := self._gather_view(fe)) is not None:
        # `table[jnp.arange(T)]` (a learned positional table read as `nn.Embed(T, D)` at every
        # position) is the table itself; `table[buckets]` with buckets computed from positions
        # alone (T5's relative-position bias) is a gathered view of it: views, so that their
        # broadcast over the batch is matched like a positional table added directly.
        self.view_eqns.add(i)
        leaf, chain = self.origin[fe.ins[0]]
        self.origin[fe.outs[0]] = (leaf, chain + (step,))
      elif fe.name in ("add", "sub") and len(fe.ins) == 2:
        pos = self._constant_shift(fe)
        if pos is not None:
          self.view_eqns.add(i)
          leaf, chain = self.origin[fe.ins[pos]]
          shape = tuple(fe.outs[0][1].aval.shape)
          self.origin[fe.outs[0]] = (leaf, chain + (ViewStep("shift", shape, shape),))

  def _concat_origin(self, i, fe) -> None:
    """A concatenation of views of distinct leaves becomes a virtual leaf (one per distinct
    concatenation: the same one computed at every step of an unrolled scan is one leaf)."""
    if len(fe.ins) < 2 or not all(_graph.is_key(a) and a in self.origin for a in fe.ins):
      return
    origins = [self.origin[a] for a in fe.ins]
    leaves = tuple(o[0] for o in origins)
    if (
      len(set(leaves)) != len(leaves)
      or any(j >= self.n_params for j in leaves)
      or any(st.op not in ("reshape", "transpose", "cast") for o in origins for st in o[1])
    ):
      return
    shapes = [tuple(_graph.aval_of(a).shape) for a in fe.ins]
    chains = [o[1] for o in origins]
    if fe.name == "stack":  # A concatenation of the operands with a unit axis inserted.
      axis = int(fe.params["axis"])
      unit = [sh[:axis] + (1,) + sh[axis:] for sh in shapes]
      chains = [c + (ViewStep("reshape", sh, u),) for c, sh, u in zip(chains, shapes, unit)]
      shapes = unit
    else:
      axis = int(fe.params["dimension"])
    view = ConcatView(
      leaves=leaves,
      chains=tuple(chains),
      axis=axis,
      piece_shapes=tuple(shapes),
      shape=tuple(fe.outs[0][1].aval.shape),
    )
    v = next((k for k, w in self.virtual.items() if w == view), None)
    if v is None:
      v = len(self.paths)
      self.virtual[v] = view
      paths = [self.paths[j] for j in leaves]
      prefix = common_prefix(paths) if len(paths) > 1 else ""
      rest = [p[len(prefix) + 1 :] if prefix and p.startswith(prefix + "/") else p for p in paths]
      self.paths.append((prefix + "/" if prefix and prefix not in paths else "") + "+".join(rest))
      self.shapes.append(view.shape)
    self.concat_eqns[i] = v
    self.origin[fe.outs[0]] = (v, ())

  def _gather_view(self, fe) -> ViewStep | None:
    """The view step when the gather `fe` reads whole rows of a `[T, D]` parameter view at
    indices computed from constants alone: every row in order is the operand itself
    (`table[jnp.arange(T)]`), or the operand with a unit axis (`jax.vmap(lambda i: table[i])`
    over `jnp.arange(T)`, equinox's `Embedding`); any other in-range rows, in any order and
    shape, with repeats, are a "gather" step (`table[buckets]`); else None."""
    if len(fe.ins) != 2 or not _graph.is_key(fe.ins[0]) or fe.ins[0] not in self.origin:
      return None
    t_shape = tuple(_graph.aval_of(fe.ins[0]).shape)
    out_shape = tuple(fe.outs[0][1].aval.shape)
    dn = fe.params["dimension_numbers"]
    if (
      len(t_shape) != 2
      or tuple(dn.operand_batching_dims)
      or tuple(fe.params["slice_sizes"]) != (1, t_shape[1])
    ):
      return None
    rows = np.arange(t_shape[0])
    if (
      out_shape == t_shape
      and tuple(dn.offset_dims) == (1,)
      and tuple(dn.collapsed_slice_dims) == (0,)
      and tuple(dn.start_index_map) == (0,)
    ):
      ids = self.fold(fe.ins[1])
      if ids is not None and np.array_equal(ids.reshape(-1), rows):
        return ViewStep("cast", t_shape, t_shape)
    if (
      len(out_shape) >= 2
      and out_shape[-1] == t_shape[1]
      and tuple(dn.offset_dims) == (len(out_shape) - 1,)
      and tuple(dn.collapsed_slice_dims) == (0,)
      and tuple(dn.start_index_map) == (0,)
    ):
      ids = self.fold(fe.ins[1])
      if (
        ids is not None
        and np.issubdtype(ids.dtype, np.integer)
        and ids.shape == out_shape[:-1] + (1,)
        and ids.size
        and 0 <= ids.min()
        and ids.max() < t_shape[0]
      ):
        flat = ids.reshape(-1).astype(np.int32)
        return ViewStep("gather", t_shape, out_shape, rows=flat.tobytes())
    unit = (t_shape[0], 1, t_shape[1])
    if (
      out_shape == unit
      and tuple(dn.offset_dims) == (1, 2)
      and not tuple(dn.collapsed_slice_dims)
      and tuple(dn.start_index_map) == (0, 1)
    ):
      ids = self.fold(fe.ins[1])
      if ids is not None and ids.shape == (t_shape[0], 2):
        if np.array_equal(ids[:, 0], rows) and not ids[:, 1].any():
          return ViewStep("reshape", t_shape, unit)
    return None

  def fold(self, atom, depth: int = 64):
    """The value of `atom` when it is computed from constants alone by small elementwise,
    comparison, layout or `iota` operations (e.g. `jnp.take`'s index arithmetic on an
    `arange`, T5's relative-position buckets); None otherwise. Each key is folded once."""
    if isinstance(atom, _compat.Literal) or atom in self.const_values:
      return _graph.constant_value(self.const_values, atom)
    if not _graph.is_key(atom) or depth == 0:
      return None
    if atom not in self._folded:
      self._folded[atom] = self._fold_eqn(atom, depth)
    return self._folded[atom]

  def _fold_eqn(self, atom, depth: int):
    i = self.producer.get(atom)
    fe = None if i is None else self.g.eqns[i]
    if fe is None or fe.fn is not None or fe.name not in _FOLDABLE or len(fe.outs) != 1:
      return None
    if math.prod(fe.outs[0][1].aval.shape) > _FOLD_SIZE:
      return None
    vals = [self.fold(a, depth - 1) for a in fe.ins]
    if any(v is None for v in vals):
      return None
    try:
      with jax.ensure_compile_time_eval():
        return np.asarray(fe.eqn.primitive.bind(*vals, **fe.params))
    except (TypeError, ValueError, jax.errors.JAXTypeError):  # Not foldable here: no view.
      return None

  def _constant_shift(self, fe) -> int | None:
    """The operand position of the parameter view in `view + c`, `c + view` or `view - c` with
    `c` a scalar constant (the output has the view's shape); else None."""
    for pos in (0, 1) if fe.name == "add" else (0,):
      a, c = fe.ins[pos], fe.ins[1 - pos]
      if not _graph.is_key(a) or a not in self.origin:
        continue
      if tuple(_graph.aval_of(a).shape) != tuple(fe.outs[0][1].aval.shape):
        continue
      if isinstance(c, _compat.Literal) and np.ndim(c.val) == 0:
        return pos
      if _graph.is_key(c) and c in self.const_values and np.size(self.const_values[c]) == 1:
        return pos
    return None

  def _uses(self, in_slice):
    """Real (non-view, non-tag) uses of each leaf on the loss slice."""
    self.uses: dict[int, list[tuple[int, int]]] = {}
    self.uses_by_eqn: dict[int, list[tuple[int, int]]] = {}
    for i in sorted(in_slice):
      fe = self.g.eqns[i]
      if (
        is_view(fe)
        or i in self.view_eqns
        or i in self.concat_eqns
        or fe.eqn.primitive in (_tags.layer_tag_p,)
      ):
        continue
      for pos, a in enumerate(fe.ins):
        if _graph.is_key(a) and a in self.origin:
          leaf = self.origin[a][0]
          self.uses.setdefault(leaf, []).append((i, pos))
          self.uses_by_eqn.setdefault(i, []).append((leaf, pos))
    consumers: dict[Any, list[tuple[int, int]]] = {}
    for i in sorted(in_slice):
      for pos, a in enumerate(self.g.eqns[i].ins):
        if _graph.is_key(a):
          consumers.setdefault(a, []).append((i, pos))
    self.slice_consumers = consumers

  def _check_virtual(self) -> None:
    """A concatenation is one leaf only if its pieces have no other real use; otherwise its
    pieces are used by the concatenation (a generic fallback) and the virtual leaf is blocked."""
    owner: dict[int, set[int]] = {}
    for v, view in self.virtual.items():
      for j in view.leaves:
        owner.setdefault(j, set()).add(v)
    self.blocked_virtual = {
      v
      for v, view in self.virtual.items()
      if any(j in self.uses or len(owner[j]) > 1 for j in view.leaves)
    }
    for i, v in self.concat_eqns.items():
      if v in self.blocked_virtual and i in self.in_slice:
        for pos, j in enumerate(self.virtual[v].leaves):
          self.uses.setdefault(j, []).append((i, pos))
          self.uses_by_eqn.setdefault(i, []).append((j, pos))
