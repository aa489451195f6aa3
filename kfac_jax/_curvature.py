"""One forward pass for the loss, its gradient and the curvature statistics: the loss with a
zero perturbation ε_l on each structured layer's output, linearised in (params, ε) and pulled
back with cotangent 1 (the gradient) and with the estimation mode's output vectors (∂/∂ε_l: the
per-layer output gradients g_l)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Literal, get_args

import jax
import jax.numpy as jnp

from kfac_jax import _checks, _compat, _losses, _migrate
from kfac_jax import blocks as _blocks
from kfac_jax import scan as _scan

Array = jax.Array
EstimationMode = Literal[
  "gradients", "empirical", "curvature_prop", "curvature_prop_GGN", "exact", "exact_GGN"
]
ESTIMATION_MODES: tuple[str, ...] = get_args(EstimationMode)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class CurvatureStats:
  """Raw per-layer data for one batch, as `value_and_grad` returns it.

  Attributes:
    data: per layer, in registration order: `(inputs, g)` for a structured layer (a tuple of
      such pairs for several uses or a scanned stack), `inputs` its recorded input operands and
      `g: [S, *output.shape]` the output gradients, the curvature `(1/S) Σ_s` of their outer
      products; for a generic layer, the per-leaf sampled gradients `[S, *leaf.shape]`.
    layer_names: static; the layers the entries belong to.
    batch_size: static; N, the loss tags' leading axis.
    layer_shapes: static; `(kind, approx, factor_shapes)` of each layer for this batch.
    params_stats: with `compute_params_stats=True`, `(1/(S N)) Σ_s Σ_n J_nᵀ v_sn`,
      params-shaped, `v_sn` the mode's output vectors; None otherwise.
    fingerprint: static; the registration's `StatsKey` (None for statistics built by hand).
  """

  data: tuple[Any, ...]
  layer_names: tuple[str, ...] = dataclasses.field(metadata={"static": True})
  batch_size: int = dataclasses.field(metadata={"static": True})
  params_stats: Any = None
  layer_shapes: tuple = dataclasses.field(default=(), metadata={"static": True})
  fingerprint: Any = dataclasses.field(default=None, metadata={"static": True})


def check_mode(estimation_mode: str, num_samples: int) -> None:
  """Validates the mode and `num_samples` (which the exact modes do not take)."""
  if estimation_mode in _migrate.ESTIMATION_MODES:
    raise ValueError(
      f"estimation_mode={estimation_mode!r} is kfac-jax's name; here it is "
      f"{_migrate.ESTIMATION_MODES[estimation_mode]!r} (see {_migrate.PAGE})."
    )
  _checks.choice(estimation_mode, "estimation_mode", ESTIMATION_MODES)
  _checks.static_int(num_samples, "num_samples")
  if estimation_mode in _losses.EXACT_MODES and num_samples != 1:
    raise ValueError(
      f"estimation_mode={estimation_mode!r} uses every output coordinate, not samples, so "
      f"num_samples does not apply; got num_samples={num_samples}: leave it at 1."
    )


def is_key(x) -> bool:
  """Whether `x` is a jax.random key: typed, or raw key data (uint32 with a last axis of 2, or 4
  for the "rbg" implementations)."""
  dtype = getattr(x, "dtype", None)
  if dtype is None:
    return False
  if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
    return True
  return dtype == jnp.uint32 and jnp.ndim(x) >= 1 and jnp.shape(x)[-1] in (2, 4)


def _describe(x) -> str:
  if hasattr(x, "shape") and hasattr(x, "dtype"):
    return f"an array of shape {tuple(x.shape)} and dtype {x.dtype}"
  if isinstance(x, dict):
    return f"a dict with keys {sorted(map(str, x))}"
  return f"{x!r} ({type(x).__name__})"


def check_rng(estimation_mode: str, rng, batch=None, who: str = "") -> None:
  """`rng`, when given, must be a key (a TypeError; when `batch` is one, naming the order of
  `Optimizer.step`'s arguments); a sampled `estimation_mode` needs one."""
  if rng is not None and not is_key(rng):
    text = f"{who}: `rng` must be a jax.random key, got {_describe(rng)}"
    if is_key(batch):
      spelling = _migrate.MOVED["Optimizer.step"].spelling
      fix = (
        f"the arguments are swapped. The order is `{spelling}` (see {_migrate.PAGE})"
        if who == "Optimizer"
        else "pass the data as `batch=`, the key as `rng=`"
      )
      raise TypeError(f"{text}, and `batch` is a key: {fix}.")
    raise TypeError(f"{text} (jax.random.key(seed) or jax.random.PRNGKey(seed)).")
  if estimation_mode in _losses.RANDOM_MODES and rng is None:
    raise ValueError(f"estimation_mode={estimation_mode!r} draws random vectors: pass `rng`.")


def curvature_part(curvature_fn: Callable) -> Callable:
  """`curvature_fn(params, batch)` as the scanner traces it: its return value is ignored (the
  traced loss is zero)."""
  _checks.function(curvature_fn, "curvature_fn")

  def part(params, batch):
    out = curvature_fn(params, batch)
    dtype = next((x.dtype for x in jax.tree_util.tree_leaves(out) if hasattr(x, "dtype")), None)
    dtype = dtype if dtype is not None and jnp.issubdtype(dtype, jnp.floating) else jnp.float32
    return jnp.zeros((), dtype)

  return part


def _join_exact(cts: list[Array]) -> list[Array]:
  """One stack for several loss tags in an exact mode: tag ℓ's K_ℓ vectors in their own rows of
  the K = Σ K_ℓ joint rows, rescaled by √(K / K_ℓ), so `(1/K) Σ` is `Σ_ℓ Jᵀ F_ℓ J` exactly."""
  sizes = [c.shape[0] for c in cts]
  total = sum(sizes)
  out, before = [], 0
  for c, k in zip(cts, sizes):
    c = c * jnp.sqrt(jnp.asarray(total / k, c.dtype))
    pad = [(before, total - before - k)] + [(0, 0)] * (c.ndim - 1)
    out.append(jnp.pad(c, pad))
    before += k
  return out


def read_atom(atom, seen):
  """An equation operand's value: a literal's, or the one `seen` holds."""
  return atom.val if isinstance(atom, _compat.Literal) else seen[atom]


def _stacked_tap(graph: _scan.FlatGraph, uses):
  """`(output keys, input key tuples)` when a layer's uses are the steps of one scan (each input
  too), so they are tapped once, stacked; else None."""
  outs = tuple(k for k, _ in uses)
  if not graph.scan_stacked(outs) or len({len(ins) for _, ins in uses}) != 1:
    return None
  ins = tuple(tuple(ins[j] for _, ins in uses) for j in range(len(uses[0][1])))
  if not all(graph.scan_stacked(col) for col in ins):
    return None
  return outs, ins


class Linearisation:
  """One forward pass of `scan`'s graph, linearised in (params, layer-output perturbations);
  with `loss_part` (the graph is a curvature function's) `loss`, `aux` and the gradient are
  `jax.value_and_grad(loss_part)`'s. `preds`, `others`: per loss tag, its prediction and its
  further operands (targets, weights); `aux`: None without `has_aux`."""

  def __init__(self, scan: _scan.ScanResult, params, batch, loss_part: Any = None):
    leaves = jax.tree_util.tree_leaves(params)
    batch_leaves = jax.tree_util.tree_leaves(batch)
    tapped = [i for i, k in enumerate(scan.layer_outputs) if k is not None]
    # One tap per use: a multi-use layer (tied weights, unrolled scan) has one per application.
    extra = scan.extra_uses or ((),) * len(scan.layers)
    taps, stacked = [], set()
    for i in tapped:
      uses = [(scan.layer_outputs[i], scan.layer_inputs[i])] + list(extra[i])
      tap = _stacked_tap(scan.graph, uses) if len(uses) > 1 else None
      if tap is not None:  # The uses are the steps of one scan: one stacked tap.
        stacked.add(i)
        taps.append((i,) + tap)
      else:
        taps += [(i, k, ins) for k, ins in uses]
    out_keys = {k: n for n, (_, k, _) in enumerate(taps)}
    in_atoms = [ins for _, _, ins in taps]
    # A hoisted tap (a value computed once for every example) is perturbed at each key where
    # the examples read it, with their batch axis inserted (`_scan.HoistedTap`).
    hoisted = {k: n for k, n in out_keys.items() if isinstance(k, _scan.HoistedTap)}
    watched = {k for k in out_keys if k not in hoisted}
    watched.update(key for tap in hoisted for key in tap.keys)
    watched.update(
      a for atoms in in_atoms for a in atoms if _scan.is_key(a) or isinstance(a, tuple)
    )
    for ops in scan.loss_operands:
      watched.update(a for a in ops if _scan.is_key(a))
    watch = frozenset(watched)

    def f(p_leaves, eps):
      perturb = {k: eps[n] for k, n in out_keys.items() if k not in hoisted}
      for tap, n in hoisted.items():
        perturb.update(zip(tap.keys, eps[n]))
      outs, seen = scan.graph.evaluate(list(p_leaves) + batch_leaves, perturb, watch)
      preds = [read_atom(ops[0], seen) for ops in scan.loss_operands]
      xs = [tuple(read_atom(a, seen) for a in atoms) for atoms in in_atoms]
      others = [[read_atom(a, seen) for a in ops[1:]] for ops in scan.loss_operands]
      return (outs[0], preds), (xs, others, outs[1:])

    eps0 = [
      k.zeros()
      if isinstance(k, _scan.HoistedTap)
      else jnp.zeros((len(k),) + k[0][1].aval.shape, k[0][1].aval.dtype)
      if isinstance(k[0], tuple)
      else jnp.zeros(k[1].aval.shape, k[1].aval.dtype)
      for k in out_keys
    ]
    (loss, preds), jvp_fn, (xs, others, aux_leaves) = jax.linearize(f, leaves, eps0, has_aux=True)
    self.scan = scan
    self.params_treedef = jax.tree_util.tree_structure(params)
    self._batch_def = jax.tree_util.tree_structure(batch)
    self.preds, self.others = preds, others
    self._graph_loss, self._grads = loss, None
    self.loss = loss
    self.aux = (
      None if scan.aux_tree is None else jax.tree_util.tree_unflatten(scan.aux_tree, aux_leaves)
    )
    self._loss_part = loss_part
    if loss_part is not None:
      value, self._grads = jax.value_and_grad(loss_part, has_aux=loss_part.has_aux)(params, batch)
      self.loss, self.aux = value if loss_part.has_aux else (value, None)
    self._xs, self._taps, self._stacked, self._eps0 = xs, taps, stacked, eps0
    self._jvp = jvp_fn
    self._vjp = jax.linear_transpose(jvp_fn, leaves, eps0)

  def grads(self):
    """The loss's gradient, params-shaped (loss cotangent 1)."""
    if self._grads is not None:
      return self._grads
    g_leaves, _ = self._vjp((jnp.ones_like(self.loss), [jnp.zeros_like(p) for p in self.preds]))
    return jax.tree_util.tree_unflatten(self.params_treedef, g_leaves)

  def loss_at(self, p_leaves, batch_leaves):
    """The loss at other param leaves (`loss_fn`'s own with a separate loss)."""
    if self._loss_part is None:
      return self.scan.graph.evaluate(list(p_leaves) + list(batch_leaves))[0][0]
    params = jax.tree_util.tree_unflatten(self.params_treedef, list(p_leaves))
    batch = jax.tree_util.tree_unflatten(self._batch_def, list(batch_leaves))
    out = self._loss_part(params, batch)
    return out[0] if self._loss_part.has_aux else out

  def prediction_jvp(self, p_leaves):
    """Per loss tag, `J v`: the predictions' derivative along the param-leaf tangent `v`."""
    return self._jvp(list(p_leaves), jax.tree_util.tree_map(jnp.zeros_like, self._eps0))[1]

  def statistics(
    self, rng, *, estimation_mode: str, num_samples: int, with_params_stats=False, fingerprint=None
  ) -> CurvatureStats:
    """The estimation mode's output vectors, pulled back (vmapped over the stack)."""
    scan, preds, others = self.scan, self.preds, self.others
    keys = jax.random.split(rng, len(scan.losses)) if rng is not None else [None] * len(scan.losses)
    cts = [
      _losses.output_cotangents(spec, (p, *o), estimation_mode, key, num_samples)
      for spec, p, o, key in zip(scan.losses, preds, others, keys)
    ]
    if estimation_mode in _losses.EXACT_MODES and len(cts) > 1:
      cts = _join_exact(cts)
    # Each tag's vectors times √(N / N_ℓ): a tag on N_ℓ points is a mean over its own points,
    # and the blocks divide by N.
    size = scan.batch_size
    cts = [
      c if spec.batch_size == size else c * jnp.sqrt(jnp.asarray(size / spec.batch_size, c.dtype))
      for c, spec in zip(cts, scan.losses)
    ]
    zero = jnp.zeros_like(self._graph_loss)
    p_ct, eps_ct = jax.vmap(lambda ct: self._vjp((zero, ct)))(cts)

    data: list[Any] = []  # per layer: one use's (inputs, g), a tuple of uses, or StackedUses
    for i, spec in enumerate(scan.layers):
      if scan.layer_outputs[i] is not None:
        uses = [
          (self._xs[n], tap[1].per_example(eps_ct[n]))
          if isinstance(tap[1], _scan.HoistedTap)
          else (self._xs[n], eps_ct[n])
          for n, tap in enumerate(self._taps)
          if tap[0] == i
        ]
        if i in self._stacked:
          data.append(_blocks.StackedUses(*uses[0]))
        else:
          data.append(tuple(uses) if spec.multi_tap else uses[0])
      else:
        data.append(tuple(p_ct[j] for j in spec.leaf_indices))
    params_stats = None
    if with_params_stats:
      params_stats = jax.tree_util.tree_unflatten(
        self.params_treedef, [jnp.mean(x, axis=0) / size for x in p_ct]
      )
    names = tuple(s.name for s in scan.layers)
    shapes = tuple((s.kind, s.approx, s.factor_shapes) for s in scan.layers)
    return CurvatureStats(tuple(data), names, size, params_stats, shapes, fingerprint)


def compute(
  scan: _scan.ScanResult, params, batch, rng, *, with_grads: bool, loss_part: Any = None, **settings
):
  """`(loss, grads or None, CurvatureStats)` from one forward pass; `(loss, aux, grads, stats)`
  when the loss has an aux. `loss_part`: the loss when `scan` is a curvature function's;
  `settings`: `Linearisation.statistics`' (`estimation_mode`, `num_samples`, ...)."""
  lin = Linearisation(scan, params, batch, loss_part if with_grads else None)
  grads = lin.grads() if with_grads else None
  stats = lin.statistics(rng, **settings)
  if scan.aux_tree is not None or (loss_part is not None and loss_part.has_aux):
    return lin.loss, lin.aux, grads, stats
  return lin.loss, grads, stats
