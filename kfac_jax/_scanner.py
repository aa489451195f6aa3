"""The scanner: trace `loss_fn(params, batch)`, find loss tags and layers, describe them statically.

How layers are found. Every parameter leaf is followed forward through layout-only operations
(`convert_element_type`, `reshape`, `transpose`, `broadcast_in_dim`, `copy`, `squeeze`) to the
operations that really use it. Only uses on the backward slice of the loss tags count, so an L2
term written into the loss does not make a kernel "used twice". A leaf whose single real use is a
`dot_general` against an activation (no batch dimensions) is a dense kernel; a leaf whose single
real use is an `add` to that product, aligned with its output features, is the bias. Convolution,
embedding and scale-and-shift layers are matched the same way (`_matchers`), in three passes:
kernels (dense, conv, with their biases), then gathers, then elementwise scales and shifts, so a
bias is never mistaken for a shift. A `dot_general` whose activation operand is a one-hot
encoding of integer ids (`jax.nn.one_hot`) is an embedding lookup, not a dense layer. Manual layer
tags take precedence over matching. Leaves left over get a diagonal generic block and a warning.

Shared parameters. Before those passes, a leaf with several real uses becomes ONE layer with
`num_uses` uses when every use is a dense product of the same `[in, out]` kernel matrix (with
one shared bias or none), an embedding lookup of the same table (by gather or one-hot product),
possibly mixed with products by the table or its transpose (tied input/output embeddings), a
convolution reading the kernel as the same matrix (same kernel layout and groups; strides,
padding and input sizes may differ; one shared bias or none), or a scale (with one shared shift
or none) or shift of activations over the same trailing axes. Kernels, tables and scales are
matched before shifts, so that a scale claims its shift. A `lax.scan` over parameters is
unrolled by `_graph.FlatGraph`, so a recurrent cell's kernels have one use per time step. Each
use keeps its own output key and inputs (`Registration.extra_uses`). Shared layers take the
approximations of `SHARED_BY_KIND`, chosen by a manual tag's `approx=` or a
`LayerConfig.overrides` pattern. `register_dense` called at every use of one kernel registers
one multi-use layer; a manual tag count that differs from the graph's use count is an error
naming the parameter (collected with the other problems by `check_registration`).

Transformations. `_graph.FlatGraph` inlines nested `jit`, remat (`jax.checkpoint`, `nn.remat`,
`nnx.remat`) and custom-derivative calls that read a parameter, and unrolls scans over
parameters, so matching sees the layers inside them. Stacked layers (a leaf with a leading layer
axis sliced per scan step, or read as L kernels by one batched `dot_general`: vmapped ensembles,
expert-stacked einsums) are registered by `_stacked` as one layer with `stack_size = L`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from kfac_jax import _compat, _graph, _layer_config, _matchers, _stacked, _tags

# Operations that only move, reshape or cast a parameter.
_VIEW_OPS = frozenset(
  {"convert_element_type", "copy", "copy_p", "reshape", "transpose", "broadcast_in_dim", "squeeze"}
)

APPROXIMATIONS = {
  "dense": (
    "kron",
    "kron_in_diag",
    "kron_out_diag",
    "kron_both_diag",
    "diagonal",
    "full",
    "expand",
    "reduce",
    "kron_indep",
    "ekfac",
  ),
  "conv": (
    "kron",
    "kron_sua",
    "kron_in_diag",
    "kron_out_diag",
    "kron_both_diag",
    "diagonal",
    "full",
    "ekfac",
  ),
  "scale_and_shift": ("full", "diagonal"),
  "embedding": ("kron", "kron_indep", "kron_out_diag"),
  "generic": ("diagonal", "full"),
}
DEFAULT_APPROX = {
  "dense": "kron",
  "conv": "kron",
  "scale_and_shift": "full",
  "embedding": "kron",
  "generic": "diagonal",
}


# Approximations of a layer whose parameters are used several times (see `kfac_jax.blocks._shared`).
SHARED_APPROXIMATIONS = ("kron_indep", "kron_series_1", "kron_series_2")
# Per kind, the approximations of a shared layer (default first; "kron" is read as "kron_indep").
# "diagonal" and "full" are exact per-example Fisher blocks, the per-example gradient being the
# sum over uses (`blocks._layouts.per_example_grads`).
SHARED_BY_KIND = {
  "dense": ("kron_indep", "kron_series_1", "kron_series_2", "diagonal", "full"),
  "conv": ("kron_indep", "diagonal", "full"),
  "embedding": ("kron_indep",),
  "scale_and_shift": ("full", "diagonal"),
}


class RegistrationError(ValueError):
  """A loss or layer registration problem, found while scanning `loss_fn`."""


class UncoveredParametersWarning(UserWarning):
  """Parameters not in any recognised layer; they get a diagonal generic block."""


# --------------------------------------------------------------------------------------------
# Parameter paths and views.


def path_to_str(path) -> str:
  parts = []
  for k in path:
    if isinstance(k, jax.tree_util.DictKey):
      parts.append(str(k.key))
    elif isinstance(k, jax.tree_util.GetAttrKey):
      parts.append(str(k.name))
    elif isinstance(k, jax.tree_util.SequenceKey):
      parts.append(str(k.idx))
    elif isinstance(k, jax.tree_util.FlattenedIndexKey):
      parts.append(str(k.key))
    else:
      parts.append(str(k))
  # nnx.State leaves end in a `value` attribute: drop it from the human-readable name.
  if len(parts) > 1 and parts[-1] == "value":
    parts = parts[:-1]
  return "/".join(parts) if parts else "<root>"


def param_paths(params) -> tuple[str, ...]:
  leaves_with_paths, _ = jax.tree_util.tree_flatten_with_path(params)
  return tuple(path_to_str(p) for p, _ in leaves_with_paths)


@dataclasses.dataclass(frozen=True)
class ViewStep:
  """One layout operation applied to a parameter on its way to the consuming operation."""

  op: str  # "reshape" | "transpose" | "cast" | "broadcast" | "shift" (a constant added)
  in_shape: tuple[int, ...]
  out_shape: tuple[int, ...]
  perm: tuple[int, ...] = ()  # transpose: the permutation; broadcast: broadcast_dimensions.


def _view_step(fe: _graph.FlatEqn) -> ViewStep:
  in_shape = tuple(_graph.aval_of(fe.ins[0]).shape)
  out_shape = tuple(fe.outs[0][1].aval.shape)
  if fe.name == "transpose":
    return ViewStep("transpose", in_shape, out_shape, tuple(fe.params["permutation"]))
  if fe.name in ("reshape", "squeeze"):
    return ViewStep("reshape", in_shape, out_shape)
  if fe.name == "broadcast_in_dim":
    if math.prod(in_shape) == math.prod(out_shape):
      return ViewStep("reshape", in_shape, out_shape)  # Only inserts unit dimensions.
    return ViewStep("broadcast", in_shape, out_shape, tuple(fe.params["broadcast_dimensions"]))
  return ViewStep("cast", in_shape, out_shape)


def apply_view(chain: Sequence[ViewStep], x):
  """Maps a parameter-shaped array to the operand layout (casts are skipped)."""
  for s in chain:
    if s.op == "transpose":
      x = x.transpose(s.perm)
    elif s.op == "reshape":
      x = x.reshape(s.out_shape)
    elif s.op == "broadcast":
      raise ValueError("a broadcast view cannot be applied to a parameter vector")
  return x


def undo_view(chain: Sequence[ViewStep], x):
  """Inverse of `apply_view`."""
  for s in reversed(chain):
    if s.op == "transpose":
      x = x.transpose(np.argsort(s.perm))
    elif s.op == "reshape":
      x = x.reshape(s.in_shape)
  return x


@dataclasses.dataclass(frozen=True)
class ConcatView:
  """Several parameter leaves, each viewed (`chains`), concatenated along `axis` into one operand.

  Flax's `OptimizedLSTMCell` concatenates its four gate kernels (and biases) before one product;
  a `stack` is read as a concatenation of the operands with a unit axis inserted. The scanner
  treats the concatenation as one virtual leaf of shape `shape`, matches layers on it, then
  lists the real leaves in the layer (`LayerSpec.concat`); the block works on the
  concatenation and splits its results back.
  """

  leaves: tuple[int, ...]
  chains: tuple[tuple[ViewStep, ...], ...]
  axis: int
  piece_shapes: tuple[tuple[int, ...], ...]  # The concatenated operands' shapes.
  shape: tuple[int, ...]


def join_pieces(view: ConcatView, pieces):
  """The concatenation of parameter-shaped `pieces` (casts skipped)."""
  return jax.numpy.concatenate(
    [apply_view(c, x) for c, x in zip(view.chains, pieces)], axis=view.axis
  )


def split_pieces(view: ConcatView, x, leaf_shapes):
  """Inverse of `join_pieces`: the parameter-shaped pieces of a concatenation-shaped `x`."""
  sizes = np.cumsum([s[view.axis] for s in view.piece_shapes])[:-1]
  parts = jax.numpy.split(x, [int(k) for k in sizes], axis=view.axis)
  return [undo_view(c, p).reshape(shape) for c, p, shape in zip(view.chains, parts, leaf_shapes)]


# --------------------------------------------------------------------------------------------
# Static descriptions.


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
  `[in, out]`; the input operand by `x_perm` to `[rows, in]`; the output by `out_perm` to
  `[rows, out]`.
  """

  kernel_view: tuple[ViewStep, ...]
  kernel_perm: tuple[int, ...]
  x_perm: tuple[int, ...]
  out_perm: tuple[int, ...]
  in_dim: int
  out_dim: int
  rows: int


def kernel_index_matrix(info: DenseInfo, param_shape) -> np.ndarray:
  """Which parameter entry (flat index) each entry of the `[in, out]` kernel matrix reads."""
  idx = np.arange(math.prod(param_shape)).reshape(param_shape)
  k = apply_view(info.kernel_view, idx)
  return k.transpose(info.kernel_perm).reshape(info.in_dim, info.out_dim)


@dataclasses.dataclass(frozen=True)
class LayerSpec:
  """A layer the scanner found (or a manual tag registered), as static facts.

  Attributes:
    name: the layer's name, the common prefix of its parameter paths (e.g. `params/Dense_0`).
    kind: "dense", "conv", "scale_and_shift", "embedding" or "generic".
    param_paths: the paths of its parameter leaves, e.g. `("params/Dense_0/kernel", ...)`.
    leaf_indices: positions of those leaves in `jax.tree_util.tree_leaves(params)`.
    approx: the curvature approximation (see `APPROXIMATIONS`; chosen by `LayerConfig`).
    factor_shapes: shapes of the curvature factors the block keeps.
    source: "auto", "manual", "fallback" or "linked" (a `LayerConfig.linked` group).
    info: kind-specific matching details (`DenseInfo`, `ConvInfo`, `ScaleShiftInfo`,
      `EmbeddingInfo`); None for generic layers.
    param_shapes: shapes of the parameter leaves.
    num_uses: how many times the layer is applied (a shared / tied / recurrent layer: one leaf
      used by several matching equations, e.g. the T steps of an unrolled scan). Each use has its
      own output key and inputs in the registration.
    use_infos: for `num_uses > 1`, the matching details of every use (`info` is the first one,
      or the embedding use of a tied embedding).
    note: why the approximation differs from the one asked for or the kind's default (the size
      policy of `LayerConfig.max_factor_dim`, a positional table), "" otherwise; `summary`
      prints it.
    concat: for a layer over concatenated leaves, one entry per logical parameter (kernel,
      bias): its `ConcatView`, or None for a plain leaf; () otherwise.
    logical: with `concat`, the layer as matched on the concatenations (one leaf each, with
      their shapes): the spec its block computes with.
    stack_size: L > 0 for a stack of L layers of one kind whose parameter leaves carry a
      leading layer axis (a scan over stacked layers, a vmapped ensemble, an expert-stacked
      kernel; see `kfac_jax._stacked`); 0 otherwise. `factor_shapes` then have a leading L.
    stack_inner: for a stack, the spec of one layer of it (leaf shapes without the layer axis).
    stack_axes: for a stack applied by one batched operation (a vmap), the layer axis of each
      input operand and then of the output; empty when each layer has its own tap (a scan).
  """

  name: str
  kind: str
  param_paths: tuple[str, ...]
  leaf_indices: tuple[int, ...]
  approx: str
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

  @property
  def multi_tap(self) -> bool:
    """Whether the layer has several taps (uses, or the layers of a scanned stack)."""
    return self.num_uses > 1 or (self.stack_size > 0 and not self.stack_axes)

  @property
  def dense(self) -> DenseInfo | None:
    return self.info if isinstance(self.info, DenseInfo) else None

  @property
  def has_bias(self) -> bool:
    """Dense and conv layers: whether a bias leaf follows the kernel."""
    if self.logical is not None:
      return self.logical.has_bias
    return self.kind in ("dense", "conv") and len(self.leaf_indices) == 2

  @property
  def num_params(self) -> int:
    return sum(math.prod(s) for s in self.param_shapes)


@dataclasses.dataclass(frozen=True, eq=False)
class Registration:
  """The result of one scan: static specs plus the graph keys the curvature pass taps."""

  graph: _graph.FlatGraph
  layers: tuple[LayerSpec, ...]
  losses: tuple[LossSpec, ...]
  loss_operands: tuple[tuple[_graph.Atom, ...], ...]  # per loss: (prediction, targets?, weight?)
  layer_outputs: tuple[_graph.Key | None, ...]  # per layer: where the perturbation is added
  # Per layer: the input operands the block's statistics need (None for generic layers).
  layer_inputs: tuple[tuple[_graph.Atom, ...] | None, ...]
  # Per layer: the further uses `((output key, inputs), ...)` of a multi-use layer, else ().
  extra_uses: tuple[tuple[tuple[_graph.Key, tuple[_graph.Atom, ...]], ...], ...] = ()


# --------------------------------------------------------------------------------------------
# Scanning.


def _common_prefix(paths: Sequence[str]) -> str:
  split = [p.split("/") for p in paths]
  prefix = []
  for parts in zip(*split):
    if all(x == parts[0] for x in parts):
      prefix.append(parts[0])
    else:
      break
  if len(paths) == 1 and len(split[0]) > 1:
    prefix = split[0][:-1]
  return "/".join(prefix) if prefix else paths[0]


def trace(loss_fn: Callable, params, batch) -> tuple[_compat.ClosedJaxpr, int]:
  leaves, treedef = jax.tree_util.tree_flatten(params)
  batch_leaves, batch_def = jax.tree_util.tree_flatten(batch)

  def flat_fn(*flat):
    p = jax.tree_util.tree_unflatten(treedef, flat[: len(leaves)])
    b = jax.tree_util.tree_unflatten(batch_def, flat[len(leaves) :])
    return loss_fn(p, b)

  closed = _compat.make_jaxpr(flat_fn, *leaves, *batch_leaves)
  return closed, len(leaves)


def scan(
  loss_fn: Callable,
  params,
  batch,
  *,
  strict: bool = False,
  warn: bool = True,
  layers: _layer_config.LayerConfig | None = None,
  collect: bool = False,
  has_aux: bool = False,
) -> Registration:
  """Traces `loss_fn(params, batch)` and registers its loss tags and layers.

  With `has_aux`, `loss_fn` returns the scalar loss first and further outputs after it (the
  flattened aux, see `kfac_jax._curvature.LossPart`): they stay outputs of the graph, so one
  evaluation gives loss and aux, and play no part in the registration (the layers are found on
  the loss's slice of the graph).

  `layers` chooses approximations and linked groups (see `LayerConfig`). With `collect`, every
  coverage problem (a parameter uncovered or registered twice, a manual tag whose use count
  differs from the graph's, a pattern matching nothing) is gathered and raised as one
  `RegistrationCheckError` at the end.

  Raises:
    RegistrationError: no loss tag, a malformed manual tag, an approximation that does not fit
      its layer, a bad linked group, a pattern that matches no parameter, or (with `strict`)
      parameters outside any recognised layer.
  """
  layers = _layer_config.check(layers)
  for i, leaf in enumerate(jax.tree_util.tree_leaves(params)):
    dtype = getattr(leaf, "dtype", None)
    if dtype is None or not jax.numpy.issubdtype(dtype, jax.numpy.inexact):
      raise RegistrationError(
        f"parameter `{param_paths(params)[i]}` has dtype {dtype}; K-FAC needs floating-point "
        "parameters. Keep integer state out of `params` (pass it in the batch instead)."
      )
  closed, n_params = trace(loss_fn, params, batch)
  out_avals = [a.aval for a in closed.jaxpr.outvars]
  if (len(out_avals) != 1 and not has_aux) or not out_avals or out_avals[0].shape != ():
    raise RegistrationError(
      "loss_fn(params, batch) must return one scalar loss, got outputs of shapes "
      f"{[tuple(a.shape) for a in out_avals]}. A loss_fn returning `(loss, aux)` needs "
      "has_aux=True."
    )
  graph = _graph.FlatGraph.from_closed_jaxpr(closed, n_params)
  paths = param_paths(params)
  shapes = tuple(tuple(np.shape(x)) for x in jax.tree_util.tree_leaves(params))
  return _Scanner(graph, n_params, paths, shapes, strict, warn, layers, collect).run()


class RegistrationCheckError(RegistrationError):
  """Every coverage problem of one registration, listed together (`check_registration`).

  Attributes:
    problems: one line per problem, each naming the parameter path(s).
  """

  def __init__(self, problems: Sequence[str]):
    self.problems = tuple(problems)
    lines = "\n".join(f"  - {p}" for p in self.problems)
    super().__init__(f"{len(self.problems)} registration problem(s):\n{lines}")


class _Scanner:
  def __init__(
    self, graph, n_params, paths, shapes, strict, warn, layer_config=None, collect=False
  ):
    self.g = graph
    self.n_params = n_params
    self.paths = list(paths)  # Virtual leaves (concatenations) are appended after the params.
    self.shapes = list(shapes)
    self.strict = strict
    self.warn = warn
    self.layer_config = _layer_config.check(layer_config)
    self.problems: list[str] | None = [] if collect else None

  def run(self) -> Registration:
    g = self.g
    self.leaf_of_key = {k: i for i, k in enumerate(g.invars[: self.n_params])}
    loss_eqns = [i for i, fe in enumerate(g.eqns) if fe.eqn.primitive is _tags.loss_tag_p]
    if not loss_eqns:
      raise RegistrationError(
        "no loss tag found in loss_fn: K-FAC needs to know the model's predictive "
        "distribution. Call one of kfac_jax.register_softmax_cross_entropy_loss(logits, "
        "labels), register_sigmoid_cross_entropy_loss(logits, targets) or "
        "register_squared_error_loss(prediction, targets) on the model output inside "
        "loss_fn(params, batch)."
      )
    losses, loss_operands = self._losses(loss_eqns)
    self.batch_size = losses[0].batch_size
    self.const_values = dict(g.consts)
    self._loss_slice([ops[0] for ops in loss_operands])
    _stacked.add_virtual_leaves(self)  # Slices of stacked leaves (indices from n_params on).
    self._origins()
    self.producer = {k: i for i, fe in enumerate(g.eqns) for k in fe.outs}
    in_slice = self._loss_slice([ops[0] for ops in loss_operands])
    self._uses(in_slice)
    self._check_virtual()

    specs: list[tuple[LayerSpec, Any, Any]] = []
    claimed: dict[int, str] = {v: "<a concatenation with other uses>" for v in self.blocked_virtual}
    self.manual_dense: dict[int, list[Any]] = {}
    for i, fe in enumerate(g.eqns):
      if fe.eqn.primitive is _tags.layer_tag_p:
        found = self._manual(i, fe, claimed)
        if found is not None:
          specs.append(found)
    for k_leaf, tags in self.manual_dense.items():
      specs.append(self._manual_dense_layer(k_leaf, tags, claimed))
    # Leaves used several times (tied weights, unrolled scans) first: one layer with k uses.
    # Kernels, tables and scales before shifts, so that a scale claims its shift.
    for shifts in (False, True):
      for leaf in sorted(self.uses):
        if leaf not in claimed and len(self.uses[leaf]) > 1:
          found = self._match_shared(leaf, claimed, shifts)
          if found is not None:
            specs.append(found)
    # Kernels first (they claim their biases), then gathers, then elementwise scale/shift.
    passes = (
      (
        functools.partial(_stacked.match_batched_dense, self),
        self._match_dense,
        functools.partial(_matchers.match_conv, self),
      ),
      (functools.partial(_matchers.match_embedding, self),),
      (functools.partial(_matchers.match_scale_and_shift, self),),
    )
    for matchers in passes:
      for i in sorted(self.uses_by_eqn):
        for match in matchers:
          found = match(i, claimed)
          if found is not None:
            specs.append(found)
            break

    specs = self._expand_virtual(specs, claimed)  # Concatenations first: they index paths.
    specs = _stacked.merge(self, specs, claimed)  # Truncates paths to the real leaves.
    specs = self._link(specs, claimed)
    self._check_patterns(specs)
    uncovered = [j for j in range(self.n_params) if j not in claimed]
    if self.problems is not None:
      self.problems.extend(
        f"`{self.paths[j]}` is not in any layer ({fallback_reason(self, j)}; it would get a "
        "diagonal fallback block)"
        for j in uncovered
      )
      if self.problems:
        raise RegistrationCheckError(self.problems)
    if uncovered:
      reasons = [fallback_reason(self, j) for j in uncovered]
      if self.strict:
        raise RegistrationError(
          uncovered_message([self.paths[j] for j in uncovered], reasons, len(uncovered))
          + " (strict=True turns this into an error.)"
        )
      if self.warn:
        warnings.warn(
          uncovered_message([self.paths[j] for j in uncovered], reasons),
          UncoveredParametersWarning,
          stacklevel=4,
        )
      for j, reason in zip(uncovered, reasons):
        spec = self._generic_spec((j,), "diagonal", "fallback")
        specs.append((dataclasses.replace(spec, info=FallbackInfo(reason)), None, None))

    specs.sort(key=lambda s: min(s[0].leaf_indices))
    multi = [s[0].multi_tap for s in specs]
    return Registration(
      graph=g,
      layers=tuple(s[0] for s in specs),
      losses=tuple(losses),
      loss_operands=tuple(loss_operands),
      layer_outputs=tuple(s[1][0] if m else s[1] for s, m in zip(specs, multi)),
      layer_inputs=tuple(s[2][0] if m else s[2] for s, m in zip(specs, multi)),
      extra_uses=tuple(tuple(zip(s[1][1:], s[2][1:])) if m else () for s, m in zip(specs, multi)),
    )

  # -- losses ----------------------------------------------------------------------------------

  def _losses(self, loss_eqns):
    losses, operands = [], []
    for i in loss_eqns:
      fe = self.g.eqns[i]
      p = fe.params
      pred_aval = _graph.aval_of(fe.ins[0])
      if p.get("under_vmap"):
        raise RegistrationError(
          f"a {p['kind']} loss tag was called inside jax.vmap: the tag must see the whole "
          f"batch (the tagged loss is the mean over its leading axis), but it saw one vmapped "
          f"slice. Call the register_*_loss function outside the vmap, on the batched "
          "prediction, e.g. `logits = jax.vmap(model)(x); register_softmax_cross_entropy_loss("
          "logits, y)`."
        )
      losses.append(
        LossSpec(
          p["kind"],
          p["var"],
          p["has_targets"],
          p["has_weight"],
          int(pred_aval.shape[0]),
          tuple(pred_aval.shape),
        )
      )
      operands.append(fe.ins)
    sizes = {l.batch_size for l in losses}
    if len(sizes) > 1:
      raise RegistrationError(
        f"loss tags disagree on the batch size (leading axis): {sorted(sizes)}. All tagged "
        "predictions must share the leading batch axis."
      )
    return losses, operands

  # -- parameter views -------------------------------------------------------------------------

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
      if fe.name in _VIEW_OPS and fe.ins and _graph.is_key(fe.ins[0]) and fe.ins[0] in self.origin:
        leaf, chain = self.origin[fe.ins[0]]
        self.origin[fe.outs[0]] = (leaf, chain + (_view_step(fe),))
      elif fe.name in ("concatenate", "stack"):
        self._concat_origin(i, fe)
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
      prefix = _common_prefix(paths) if len(paths) > 1 else ""
      rest = [p[len(prefix) + 1 :] if prefix and p.startswith(prefix + "/") else p for p in paths]
      self.paths.append((prefix + "/" if prefix and prefix not in paths else "") + "+".join(rest))
      self.shapes.append(view.shape)
    self.concat_eqns[i] = v
    self.origin[fe.outs[0]] = (v, ())

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

  def _expand_virtual(self, specs, claimed):
    """Layers matched on virtual leaves list the concatenated real leaves instead."""
    out = []
    for spec, outs, ins in specs:
      if not any(j in self.virtual for j in spec.leaf_indices):
        out.append((spec, outs, ins))
        continue
      leaves, views = [], []
      for j in spec.leaf_indices:
        view = self.virtual.get(j)
        views.append(view)
        leaves.extend(view.leaves if view is not None else (j,))
      paths = tuple(self.paths[j] for j in leaves)
      name = _common_prefix(paths)
      self._claim(claimed, [j for j in leaves if j not in spec.leaf_indices], name)
      out.append(
        (
          dataclasses.replace(
            spec,
            name=name,
            param_paths=paths,
            leaf_indices=tuple(leaves),
            param_shapes=tuple(self.shapes[j] for j in leaves),
            concat=tuple(views),
            logical=spec,
          ),
          outs,
          ins,
        )
      )
    return out

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

  def _loss_slice(self, roots) -> set[int]:
    needed = {a for a in roots if _graph.is_key(a)}
    in_slice = set()
    for i in range(len(self.g.eqns) - 1, -1, -1):
      fe = self.g.eqns[i]
      if any(k in needed for k in fe.outs):
        in_slice.add(i)
        needed.update(a for a in fe.ins if _graph.is_key(a))
    self.in_slice = in_slice
    return in_slice

  def _uses(self, in_slice):
    """Real (non-view, non-tag) uses of each leaf on the loss slice."""
    self.uses: dict[int, list[tuple[int, int]]] = {}
    self.uses_by_eqn: dict[int, list[tuple[int, int]]] = {}
    for i in sorted(in_slice):
      fe = self.g.eqns[i]
      if (
        fe.name in _VIEW_OPS
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

  # -- manual tags -----------------------------------------------------------------------------

  def _leaf_for_operand(self, atom, what: str, tag: str) -> tuple[int, tuple[ViewStep, ...]]:
    if not _graph.is_key(atom) or atom not in self.origin:
      raise RegistrationError(
        f"{tag}: `{what}` is not a parameter leaf of `params` (nor a cast/reshape of one). "
        "Pass the parameter array itself, as read from the params pytree inside loss_fn."
      )
    return self.origin[atom]

  def _claim(self, claimed, leaves, name):
    for j in leaves:
      if j in claimed:
        msg = (
          f"parameter `{self.paths[j]}` is registered twice: in `{claimed[j]}` and in "
          f"`{name}`. Each parameter belongs to exactly one curvature block."
        )
        if self.problems is None:
          raise RegistrationError(msg)
        self.problems.append(msg)
        continue
      claimed[j] = name

  # -- layer configuration ---------------------------------------------------------------------

  def _approx(self, kind, paths, name, approx, source, builtin):
    """The approximation of a layer: an explicit manual `approx=`, else the `LayerConfig`."""
    if source == "manual" and approx is not None:
      return approx
    chosen, pattern = _layer_config.resolve(
      self.layer_config, kind, (name,) + tuple(paths), builtin if approx is None else approx
    )
    if chosen not in APPROXIMATIONS[kind]:
      raise RegistrationError(
        f"LayerConfig.overrides[{pattern!r}] = {chosen!r} does not fit the {kind} layer "
        f"`{name}` (parameters {list(paths)}); choose one of {APPROXIMATIONS[kind]}, or "
        "narrow the pattern so that it does not match this layer."
      )
    return chosen

  def _link(self, specs, claimed):
    """Replaces the layers inside each `LayerConfig.linked` group by one generic block."""
    owner: dict[int, tuple[str, ...]] = {}
    for group, approx in self.layer_config.linked.items():
      leaves = []
      for pattern in group:
        found = [
          j
          for j, p in enumerate(self.paths[: self.n_params])
          if _layer_config.matches(pattern, (p,))
        ]
        if not found:
          self._pattern_problem(
            f"LayerConfig.linked: pattern {pattern!r} of group {group} matches no parameter path"
          )
        leaves.extend(j for j in found if j not in leaves)
      if not leaves:
        continue
      for j in leaves:
        if j in owner:
          raise RegistrationError(
            f"LayerConfig.linked: parameter `{self.paths[j]}` is in two linked groups, "
            f"{owner[j]} and {group}; each parameter belongs to exactly one block."
          )
        owner[j] = group
      inside = set(leaves)
      kept = []
      for s in specs:
        overlap = inside.intersection(s[0].leaf_indices)
        if not overlap:
          kept.append(s)
          continue
        missing = [self.paths[j] for j in s[0].leaf_indices if j not in inside]
        if missing:
          raise RegistrationError(
            f"LayerConfig.linked group {group} splits the {s[0].kind} layer `{s[0].name}`: it "
            f"holds {[self.paths[j] for j in sorted(overlap)]} but not {missing}. A linked "
            "group must hold whole layers; add the missing parameters to the group."
          )
        for j in s[0].leaf_indices:
          claimed.pop(j, None)
      leaves = sorted(leaves)
      spec = self._generic_spec(tuple(leaves), approx, "linked")
      self._claim(claimed, leaves, spec.name)
      specs = kept + [(spec, None, None)]
    return specs

  def _pattern_problem(self, msg):
    msg += "; fix the pattern (globs: `*` matches any characters, slashes included)."
    if self.problems is None:
      raise RegistrationError(msg)
    self.problems.append(msg)

  def _check_patterns(self, specs):
    names = set(self.paths) | {s[0].name for s in specs}
    for pattern in self.layer_config.overrides:
      if not _layer_config.matches(pattern, tuple(names)):
        self._pattern_problem(
          f"LayerConfig.overrides: pattern {pattern!r} matches no layer name or parameter "
          f"path (paths: {self.paths[: min(8, self.n_params)]}"
          f"{' ...' if self.n_params > 8 else ''})"
        )

  def _manual(self, i, fe, claimed):
    kind, approx = fe.params["kind"], fe.params["approx"]
    if kind == "generic":
      leaves = tuple(
        self._leaf_for_operand(a, f"params[{p}]", "register_generic")[0]
        for p, a in enumerate(fe.ins)
      )
      if len(set(leaves)) != len(leaves):
        raise RegistrationError(
          f"register_generic: the same parameter appears twice: {[self.paths[j] for j in leaves]}."
        )
      approx = self._check_approx("generic", approx, [self.paths[j] for j in leaves])
      spec = self._generic_spec(leaves, approx, "manual")
      self._claim(claimed, leaves, spec.name)
      return spec, None, None
    if kind != "dense":
      return _matchers.manual(self, fe, claimed)
    # Dense: operands (y, x, kernel, bias?).
    y, x, kernel = fe.ins[:3]
    k_leaf, k_chain = self._leaf_for_operand(kernel, "kernel", "register_dense")
    path = self.paths[k_leaf]
    if any(s.op == "broadcast" for s in k_chain):
      raise RegistrationError(f"register_dense: kernel `{path}` is broadcast before the tag.")
    leaves = [k_leaf]
    if len(fe.ins) > 3:
      b_leaf, b_chain = self._leaf_for_operand(fe.ins[3], "bias", "register_dense")
      if math.prod(self.shapes[b_leaf]) != _graph.aval_of(kernel).shape[1]:
        raise RegistrationError(
          f"register_dense: bias `{self.paths[b_leaf]}` has shape {self.shapes[b_leaf]}, "
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
    # Tags of one kernel are collected and become one layer (one use per tag) after the loop.
    self.manual_dense.setdefault(k_leaf, []).append((tuple(leaves), info, approx, y, (x,)))
    return None

  def _manual_dense_layer(self, k_leaf, tags, claimed):
    """One dense layer from the `register_dense` tags of kernel `k_leaf` (one use per tag)."""
    path = self.paths[k_leaf]
    leaves = tags[0][0]
    approxes = {t[2] for t in tags}
    if any(t[0] != leaves for t in tags) or len(approxes) > 1:
      raise RegistrationError(
        f"register_dense: kernel `{path}` is registered {len(tags)} times with different "
        f"biases or approximations ({[[self.paths[j] for j in t[0]] for t in tags]}, "
        f"{sorted(map(str, approxes))}); register every use with the same bias and `approx`."
      )
    self.check_use_count(
      k_leaf,
      len(tags),
      "register_dense",
      "call register_dense at every use of the kernel (each with the same `approx`, e.g. "
      'approx="kron_indep"), or let the scanner detect the shared use by removing the tags',
    )
    approx = tags[0][2]
    paths = [self.paths[j] for j in leaves]
    if len(tags) == 1:
      approx = self._check_approx("dense", approx, paths)
      spec = self._dense_spec(leaves, tags[0][1], approx, "manual")
      self._claim(claimed, leaves, spec.name)
      return spec, tags[0][3], tags[0][4]
    infos = tuple(t[1] for t in tags)
    spec = self._shared_spec("dense", leaves, infos, approx, "manual")
    self._claim(claimed, leaves, spec.name)
    return spec, tuple(t[3] for t in tags), tuple(t[4] for t in tags)

  def error(self, msg: str) -> RegistrationError:
    return RegistrationError(msg)

  def check_use_count(self, leaf: int, registered: int, tag: str, fix: str) -> None:
    """A manual tag's use count against the graph's: raised, or collected with `collect`.

    A leaf the loss does not reach (no use on the loss slice) is not counted as a mismatch.
    """
    graph_uses = len(self.uses.get(leaf, []))
    if not graph_uses or graph_uses == registered:
      return
    msg = (
      f"layer `{self.paths[leaf]}` is used {graph_uses} times in loss_fn but registered "
      f"with {registered} {tag} tag(s); {fix}."
    )
    if self.problems is None:
      raise RegistrationError(msg)
    self.problems.append(msg)

  def _single_use_series(self, approx, paths):
    return RegistrationError(
      f"approximation {approx!r} models correlations between successive uses of a shared "
      f'layer, but the layer with parameters {paths} is used once; use "kron" (or '
      '"kron_indep", which equals it for one use).'
    )

  def _check_approx(self, kind, approx, paths, *, shared: bool = False):
    if shared:  # None: the kind's shared default (kron_indep; "full" for scale-and-shift).
      choices = SHARED_BY_KIND.get(kind, ())
      if approx is None:
        return choices[0]
      if approx == "kron" and "kron_indep" in choices:
        return "kron_indep"
      if approx not in choices:
        raise RegistrationError(
          f"approximation {approx!r} does not fit the shared {kind} layer with parameters "
          f"{paths}; a {kind} layer used several times takes one of {choices}."
        )
      return approx
    if approx is None:
      # Single-use layers are resolved by `layer_spec` (the LayerConfig, then the kind's default).
      return None
    if approx in SHARED_APPROXIMATIONS[1:]:
      raise self._single_use_series(approx, paths)
    if approx not in APPROXIMATIONS[kind]:
      raise RegistrationError(
        f"approximation {approx!r} does not fit the {kind} layer with parameters {paths}; "
        f"choose one of {APPROXIMATIONS[kind]}."
      )
    return approx

  # -- automatic dense matching ----------------------------------------------------------------

  def _dense_use(self, i, k_pos):
    """`(info, x_atom, k_shape, k_free)` if equation i is a dense product, kernel at k_pos."""
    fe = self.g.eqns[i]
    k_atom, x_atom = fe.ins[k_pos], fe.ins[1 - k_pos]
    _, k_chain = self.origin[k_atom]
    if any(s.op not in ("reshape", "transpose", "cast") for s in k_chain):
      return None
    (lhs_c, rhs_c), (lhs_b, rhs_b) = fe.params["dimension_numbers"]
    if lhs_b or rhs_b:
      return None  # Batched products (e.g. per-head weights) are not dense layers.
    k_contract, x_contract = (
      (tuple(rhs_c), tuple(lhs_c)) if k_pos == 1 else (tuple(lhs_c), tuple(rhs_c))
    )
    k_shape = tuple(_graph.aval_of(k_atom).shape)
    x_shape = tuple(_graph.aval_of(x_atom).shape)
    k_free = tuple(d for d in range(len(k_shape)) if d not in k_contract)
    x_free = tuple(d for d in range(len(x_shape)) if d not in x_contract)
    if not k_free or not k_contract:
      return None
    in_dim = math.prod(k_shape[d] for d in k_contract)
    out_dim = math.prod(k_shape[d] for d in k_free)
    rows = math.prod(x_shape[d] for d in x_free)
    n_xf, n_kf = len(x_free), len(k_free)
    if k_pos == 1:  # out = (x_free..., k_free...)
      out_perm = tuple(range(n_xf + n_kf))
    else:  # out = (k_free..., x_free...)
      out_perm = tuple(range(n_kf, n_kf + n_xf)) + tuple(range(n_kf))
    info = DenseInfo(
      kernel_view=k_chain,
      kernel_perm=k_contract + k_free,
      x_perm=x_free + x_contract,
      out_perm=out_perm,
      in_dim=int(in_dim),
      out_dim=int(out_dim),
      rows=int(rows),
    )
    return info, x_atom, k_shape, k_free

  def _match_dense(self, i, claimed):
    fe = self.g.eqns[i]
    if fe.name != "dot_general":
      return None
    param_ops = self.uses_by_eqn.get(i, [])
    if len(param_ops) != 1:
      return None  # No parameter, or a product of two parameters.
    k_leaf, k_pos = param_ops[0]
    if k_leaf in claimed or len(self.uses.get(k_leaf, [])) != 1:
      return None
    emb = _matchers.one_hot_embedding_use(self, i) if k_pos == 1 else None
    if emb is not None:  # `one_hot(ids) @ table`: an embedding lookup written as a product.
      info, ids, out_key = emb
      spec = self.layer_spec(
        "embedding", [k_leaf], info, None, "auto", ((info.vocab_size,), (info.dim, info.dim))
      )
      self._claim(claimed, [k_leaf], spec.name)
      return spec, out_key, (ids,)
    found = self._dense_use(i, k_pos)
    if found is None:
      return None
    info, x_atom, k_shape, k_free = found
    leaves = [k_leaf]
    out_key = fe.outs[0]
    bias = self._match_bias(out_key, k_pos, k_shape, k_free, claimed)
    if bias is not None:
      b_leaf, out_key = bias
      leaves.append(b_leaf)
    spec = self._dense_spec(leaves, info, None, "auto")
    self._claim(claimed, leaves, spec.name)
    return spec, out_key, (x_atom,)

  # -- shared (multi-use) layers ---------------------------------------------------------------

  def _match_shared(self, leaf, claimed, shifts: bool = False):
    """One layer for a leaf whose uses are all dense products (with one shared bias), embedding
    lookups, convolutions (with one shared bias) or scales / shifts of activations; a tied
    embedding mixes lookups with products by the transposed table. Leaves added to activations
    (shifts) are matched only with `shifts`, after the scales have claimed theirs.

    Returns `(spec, out_keys, inputs)` with one entry per use, or None.
    """
    uses = self.uses[leaf]
    found = []  # (kind, info, inputs, out_key, bias / shift leaf or None)
    for i, pos in uses:
      fe = self.g.eqns[i]
      if len(self.uses_by_eqn.get(i, [])) != 1:
        return None
      emb = _matchers.one_hot_embedding_use(self, i) if pos == 1 else None
      if emb is not None:
        found.append(("embedding", emb[0], (emb[1],), emb[2], None))
      elif fe.name == "dot_general":
        d = self._dense_use(i, pos)
        if d is None:
          return None
        info, x_atom, k_shape, k_free = d
        bias = self._match_bias(fe.outs[0], pos, k_shape, k_free, claimed, shared=True)
        b_leaf, out_key = bias if bias is not None else (None, fe.outs[0])
        found.append(("dense", info, (x_atom,), out_key, b_leaf))
      elif fe.name == "gather" and pos == 0:
        e = _matchers.embedding_use(self, i)
        if e is None:
          return None
        info, ids, out_key = e
        found.append(("embedding", info, (ids,), out_key, None))
      elif fe.name == "conv_general_dilated":
        c = _matchers.conv_use(self, i, claimed, shared=True)
        if c is None:
          return None
        info, _, x_atom, out_key, b_leaf = c
        found.append(("conv", info, (x_atom,), out_key, b_leaf))
      elif fe.name == "mul" or (fe.name == "add" and shifts):
        m = _matchers.scale_shift_use(self, i, claimed, shared=True)
        if m is None:
          return None
        info, _, inputs, out_key, shift_leaf = m
        found.append(("scale_and_shift", info, inputs, out_key, shift_leaf))
      else:
        return None
    kinds = {f[0] for f in found}
    biases = {f[4] for f in found}
    if len(biases) != 1:
      return None
    (b_leaf,) = biases
    if b_leaf is not None and (b_leaf in claimed or len(self.uses[b_leaf]) != len(uses)):
      return None
    infos = tuple(f[1] for f in found)
    shape = self.shapes[leaf]
    if kinds == {"dense"}:  # Every use must read the kernel as the same [in, out] matrix.
      first = kernel_index_matrix(infos[0], shape)
      if any(not np.array_equal(kernel_index_matrix(inf, shape), first) for inf in infos[1:]):
        return None
      kind = "dense"
    elif kinds == {"conv"}:  # ... and as the same [window · in, out] matrix.
      if len({_matchers.conv_kernel_layout(inf) for inf in infos}) != 1:
        return None
      kind = "conv"
    elif kinds == {"scale_and_shift"}:  # The same parameters over the same trailing axes.
      keys = {(inf.has_scale, inf.has_shift, inf.feature_shape, inf.feature_axis) for inf in infos}
      if len(keys) != 1:
        return None
      kind = "scale_and_shift"
    elif kinds <= {"dense", "embedding"}:
      # A table [vocab, dim]: products read it as itself or as its transpose.
      emb = next(inf for inf in infos if isinstance(inf, _matchers.EmbeddingInfo))
      idx = np.arange(math.prod(shape)).reshape(shape)
      for inf in infos:
        if isinstance(inf, _matchers.EmbeddingInfo):
          if inf != emb:
            return None
          continue
        m = kernel_index_matrix(inf, shape)
        if not (np.array_equal(m, idx) or np.array_equal(m, idx.T)):
          return None
      kind = "embedding"
    else:
      return None
    leaves = [leaf] + ([b_leaf] if b_leaf is not None else [])
    spec = self._shared_spec(kind, leaves, infos, None, "auto")
    self._claim(claimed, leaves, spec.name)
    return spec, tuple(f[3] for f in found), tuple(f[2] for f in found)

  def _shared_override(self, kind, name, paths, num_uses):
    """The approximation a `LayerConfig.overrides` pattern chooses for a shared layer, or None.

    `defaults` do not apply: they name single-use approximations of a kind.
    """
    for pattern, chosen in self.layer_config.overrides.items():
      if not _layer_config.matches(pattern, (name,) + tuple(paths)):
        continue
      choices = SHARED_BY_KIND.get(kind, ())
      if chosen not in choices and not (chosen == "kron" and "kron_indep" in choices):
        raise RegistrationError(
          f"LayerConfig.overrides[{pattern!r}] = {chosen!r} does not fit the {kind} layer "
          f"`{name}` (parameters {list(paths)}), which is used {num_uses} times; a shared "
          f"{kind} layer takes one of {choices}. Choose one of those, or narrow the pattern "
          "so that it does not match this layer."
        )
      return chosen
    return None

  def _shared_spec(self, kind, leaves, infos, approx, source) -> LayerSpec:
    paths = tuple(self.paths[j] for j in leaves)
    name = _common_prefix(paths)
    if approx is None:
      approx = self._shared_override(kind, name, paths, len(infos))
    explicit = approx is not None
    approx = self._check_approx(kind, approx, list(paths), shared=True)
    note = ""
    max_dim = self.layer_config.max_factor_dim
    if not explicit and max_dim is not None and kind in ("dense", "conv"):
      # The size policy for shared layers: "kron_indep" has no diagonal-side variant, so a
      # side above the limit makes the block diagonal (exact per-example diagonal, O(n)).
      first = infos[0]
      sides = (
        (first.in_dim, first.out_dim) if kind == "dense" else (first.patch_dim, first.out_per_group)
      )
      if max(sides) > max_dim:
        approx = "diagonal"
        note = (
          f"factor side {max(sides)} > max_factor_dim {max_dim} on a layer used "
          f"{len(infos)} times: diagonal"
        )
    if approx in SHARED_APPROXIMATIONS[1:] and (
      kind != "dense" or len({inf.rows for inf in infos}) != 1
    ):
      raise RegistrationError(
        f"approximation {approx!r} needs the uses of layer {list(paths)} to be dense products "
        f"with equal row counts (the steps of a recurrence); got {kind} uses with rows "
        f'{[getattr(inf, "rows", None) for inf in infos]}. Use "kron_indep".'
      )
    info = next((inf for inf in infos if isinstance(inf, _matchers.EmbeddingInfo)), infos[0])
    n = sum(math.prod(self.shapes[j]) for j in leaves)
    if approx == "diagonal":
      shapes = ((n,),)
    elif approx == "full":
      shapes = ((n, n),)
    elif kind == "dense":
      a = info.in_dim + (1 if len(leaves) == 2 else 0)
      shapes = ((a, a), (info.out_dim, info.out_dim))
    elif kind == "conv":
      shapes = _matchers.conv_kron_shapes(info, len(leaves) == 2)
    else:
      shapes = ((info.vocab_size,), (info.dim, info.dim))
    return LayerSpec(
      name=name,
      kind=kind,
      param_paths=paths,
      leaf_indices=tuple(leaves),
      approx=approx,
      factor_shapes=shapes,
      source=source,
      info=info,
      param_shapes=tuple(self.shapes[j] for j in leaves),
      num_uses=len(infos),
      use_infos=infos,
      note=note,
    )

  def _match_bias(self, s_key, k_pos, k_shape, k_free, claimed, shared: bool = False):
    found = self._match_direct_bias(s_key, k_pos, k_shape, k_free, claimed, shared)
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
    bias = _matchers.follow_bias(self, s_key, feat, claimed, shared)
    return None if bias is None else (bias[0], s_key)

  def _match_direct_bias(self, s_key, k_pos, k_shape, k_free, claimed, shared: bool = False):
    if k_pos != 1:
      return None
    cons = self.slice_consumers.get(s_key, [])
    if len(cons) != 1:
      return None
    j, pos = cons[0]
    fe = self.g.eqns[j]
    if fe.name != "add":
      return None
    other = fe.ins[1 - pos]
    if not _graph.is_key(other) or other not in self.origin:
      return None
    b_leaf, b_chain = self.origin[other]
    if b_leaf in claimed or (not shared and len(self.uses.get(b_leaf, [])) != 1):
      return None
    if any(s.op == "transpose" for s in b_chain):
      return None
    free_shape = tuple(k_shape[d] for d in k_free)
    if math.prod(self.shapes[b_leaf]) != math.prod(free_shape):
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

  # -- specs -----------------------------------------------------------------------------------

  def _dense_spec(self, leaves, info: DenseInfo, approx, source) -> LayerSpec:
    a_dim = info.in_dim + (1 if len(leaves) == 2 else 0)
    return self.layer_spec(
      "dense", leaves, info, approx, source, ((a_dim, a_dim), (info.out_dim, info.out_dim))
    )

  def layer_spec(self, kind, leaves, info, approx, source, kron_shapes) -> LayerSpec:
    """A LayerSpec; `kron_shapes` are the factor shapes of the "kron"-family approximations."""
    paths = tuple(self.paths[j] for j in leaves)
    name = _common_prefix(paths)
    builtin, note = _matchers.default_approx(kind, info), ""
    if builtin is None:
      builtin = DEFAULT_APPROX[kind]
    elif builtin != DEFAULT_APPROX[kind]:
      note = _matchers.default_approx_note(kind, info)
    explicit = self._explicit(paths, name, approx, source)
    approx = self._approx(kind, paths, name, approx, source, builtin)
    if approx != builtin:
      note = ""
    n = sum(math.prod(self.shapes[j]) for j in leaves)
    if not explicit:
      approx, why = _layer_config.size_policy(
        self.layer_config.max_factor_dim, kind, approx, kron_shapes, n, APPROXIMATIONS[kind]
      )
      note = why or note
    if approx == "diagonal":
      shapes = ((n,),)
    elif approx == "full":
      shapes = ((n, n),)
    elif approx in ("kron_in_diag", "kron_out_diag", "kron_both_diag"):
      (sa, sg), both = kron_shapes, approx == "kron_both_diag"
      shapes = (
        sa[:-1] if approx == "kron_in_diag" or both else sa,
        sg[:-1] if approx == "kron_out_diag" or both else sg,
      )
    else:
      shapes = kron_shapes
    return LayerSpec(
      name=name,
      kind=kind,
      param_paths=paths,
      leaf_indices=tuple(leaves),
      approx=approx,
      factor_shapes=shapes,
      source=source,
      info=info,
      param_shapes=tuple(self.shapes[j] for j in leaves),
      note=note,
    )

  def _explicit(self, paths, name, approx, source) -> bool:
    """Whether the layer's approximation is chosen for it by name: a manual tag's `approx=` or
    a matching `LayerConfig.overrides` pattern (then the size policy does not apply)."""
    if source == "manual" and approx is not None:
      return True
    return any(
      _layer_config.matches(p, (name,) + tuple(paths)) for p in self.layer_config.overrides
    )

  def _generic_spec(self, leaves, approx, source) -> LayerSpec:
    paths = tuple(self.paths[j] for j in leaves)
    n = sum(math.prod(self.shapes[j]) for j in leaves)
    name = paths[0] if len(paths) == 1 else _common_prefix(paths)
    note = ""
    if source != "linked":
      explicit = self._explicit(paths, name, approx, source)
      approx = self._approx("generic", paths, name, approx, source, DEFAULT_APPROX["generic"])
      if not explicit:
        approx, note = _layer_config.size_policy(
          self.layer_config.max_factor_dim, "generic", approx, (), n, APPROXIMATIONS["generic"]
        )
    factor = ((n,),) if approx == "diagonal" else ((n, n),)
    return LayerSpec(
      name=name,
      kind="generic",
      param_paths=paths,
      leaf_indices=tuple(leaves),
      approx=approx,
      factor_shapes=factor,
      source=source,
      param_shapes=tuple(self.shapes[j] for j in leaves),
      note=note,
    )


# --------------------------------------------------------------------------------------------
# Why a parameter got a fallback block (the warning, `summary`, `check_registration`).


@dataclasses.dataclass(frozen=True)
class FallbackInfo:
  """`LayerSpec.info` of a fallback (generic) layer: why the scanner matched no layer."""

  reason: str


def _constant_operand(sc: _Scanner, atom) -> float | None:
  """The scalar value of `atom` if it is a constant (a literal, possibly broadcast), else None."""
  while True:
    if isinstance(atom, _compat.Literal):
      val = np.asarray(atom.val)
    elif atom in sc.const_values:
      val = np.asarray(sc.const_values[atom])
    elif atom in sc.producer and sc.g.eqns[sc.producer[atom]].name in _VIEW_OPS:
      atom = sc.g.eqns[sc.producer[atom]].ins[0]
      continue
    else:
      return None
    return float(val.reshape(-1)[0]) if val.size and np.all(val == val.reshape(-1)[0]) else None


def _feeds(sc: _Scanner, key, names: frozenset[str], depth: int = 4) -> str | None:
  """The first primitive in `names` that `key` reaches through a few operations, else None."""
  frontier = [key]
  for _ in range(depth):
    nxt = []
    for k in frontier:
      for j, _ in sc.slice_consumers.get(k, []):
        fe = sc.g.eqns[j]
        if fe.name in names:
          return fe.name
        nxt.extend(fe.outs)
    frontier = nxt
  return None


def _use_reason(sc: _Scanner, leaf: int, i: int, pos: int) -> str:
  """Why one use (equation `i`, operand `pos`) of `leaf` matched no layer."""
  fe = sc.g.eqns[i]
  name = fe.name
  if name == "scan_slice":
    return "sliced by a scan (a stacked layer axis)"
  if name in ("slice", "dynamic_slice", "gather", "dynamic_update_slice"):
    return f"indexed by {name} before use (e.g. one slice of a stacked array)"
  if name == "concatenate":
    if _feeds(sc, fe.outs[0], frozenset({"dot_general", "conv_general_dilated"})):
      return "concatenated before a matmul"
    return "concatenated with other arrays before use"
  if name in ("add", "sub") and len(fe.ins) == 2:
    c = _constant_operand(sc, fe.ins[1 - pos])
    if c is not None:
      shown = f"{c:g}"
      return (
        f"used as {shown} + scale"
        if name == "add"
        else (f"used as {shown} - scale" if pos == 1 else f"used as scale - {shown}")
      )
  others = [leaf_ for leaf_, _ in sc.uses_by_eqn.get(i, []) if leaf_ != leaf]
  if others:
    return (
      f"combined by {name} with parameter `{sc.paths[others[0]]}` (a product or sum of "
      "two parameters has no layer block)"
    )
  if name == "dot_general":
    (_, _), (lhs_b, rhs_b) = fe.params["dimension_numbers"]
    if lhs_b or rhs_b:
      return "consumed by a batched dot_general (batch dimensions, e.g. per-head weights)"
    if any(s.op == "broadcast" for s in sc.origin[fe.ins[pos]][1]):
      return "broadcast before a matmul"
    return "consumed by dot_general in a layout no dense matcher fits"
  if name in ("mul", "add"):
    return f"consumed by {name} in a layout no scale-and-shift matcher fits"
  if name == "conv_general_dilated":
    return "consumed by conv_general_dilated in a form no conv matcher fits"
  return f"consumed by {name} (no matcher)"


def fallback_reason(sc: _Scanner, leaf: int) -> str:
  """Why the scanner matched no layer for `leaf`, from its uses in the traced graph.

  One short phrase: "not used by the loss", "sliced by a scan (a stacked layer axis)", "used as 1
  + scale", "concatenated before a matmul", "used 3 times in different ways (dot_general, mul)",
  "consumed by <primitive> (no matcher)", ...
  """
  uses = sc.uses.get(leaf, [])
  if not uses:
    keys = {k for k, (j, _) in sc.origin.items() if j == leaf}
    read = any(_graph.is_key(a) and a in keys for fe in sc.g.eqns for a in fe.ins)
    return (
      "not used by the loss (only outside the loss tags' inputs, e.g. a regulariser)"
      if read
      else "not used by the loss"
    )
  reasons = [_use_reason(sc, leaf, i, pos) for i, pos in uses]
  for r in reasons:
    if r.startswith(("sliced by a scan", "indexed by")):
      return r
  if len(uses) == 1:
    return reasons[0]
  names = tuple(dict.fromkeys(sc.g.eqns[i].name for i, _ in uses))
  if len(set(reasons)) == 1 and not reasons[0].startswith("consumed by"):
    return f"{reasons[0]} (all {len(uses)} uses)"
  if len(names) == 1 and names[0] in ("dot_general", "conv_general_dilated", "mul", "add"):
    return (
      f"used {len(uses)} times by {names[0]} in ways no one shared layer fits (e.g. "
      "different kernel layouts, or biases that differ between uses)"
    )
  return f"used {len(uses)} times in different ways ({', '.join(names)})"


def uncovered_message(paths: Sequence[str], reasons: Sequence[str], limit: int = 3) -> str:
  """The short `UncoveredParametersWarning` text: the count, a few paths with reasons, a pointer."""
  shown = "; ".join(f"`{p}` ({r})" for p, r in list(zip(paths, reasons))[:limit])
  more = f"; and {len(paths) - limit} more" if len(paths) > limit else ""
  return (
    f"{len(paths)} parameter(s) are not in any recognised layer and get a diagonal "
    f"curvature block: {shown}{more}. `kfac_jax.summary(loss_fn, params, batch)` lists "
    "each with its reason; a manual layer tag (kfac_jax.register_dense / register_conv / "
    "register_scale_and_shift / register_embedding / register_generic) chooses its block."
  )
