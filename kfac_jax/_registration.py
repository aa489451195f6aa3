"""One registration of a loss function, shared by every entry point (`Registration`).

The traced graphs of `loss_fn` are kept per `(params, batch)` signature and bound collective
axes, so a jitted step traced again reuses them; never a graph whose constants are tracers, nor
a scan made with stand-in collective axes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections.abc import Callable, Collection
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kfac_jax import _audit, _checks, _compat, _curvature, _fit, _losses
from kfac_jax import blocks as _blocks
from kfac_jax import scan as _scan

AxisName = str | tuple[str, ...] | None


def axis_names(axis_name: AxisName) -> tuple[str, ...]:
  """`collective_axes` (a name or a tuple of names) as a tuple; TypeError otherwise."""
  if axis_name is None:
    return ()
  names = (axis_name,) if isinstance(axis_name, str) else axis_name
  if not isinstance(names, tuple) or not names or not all(isinstance(n, str) for n in names):
    raise TypeError(
      f'`collective_axes` must be a string or a tuple of strings (e.g. "batch" for linen\'s '
      f'BatchNorm(axis_name="batch")), got {axis_name!r}.'
    )
  return names


class LossPart:
  """`loss_fn` as the scanner traces it, its output checked against `has_aux` (a mismatch is an
  error naming `has_aux`, not a shape error)."""

  def __init__(self, loss_fn: Callable | None, has_aux: bool):
    if not callable(loss_fn):
      raise TypeError(f"`loss_fn` must be callable, got {type(loss_fn).__name__}: {loss_fn!r}.")
    if not isinstance(has_aux, bool):
      raise TypeError(f"`has_aux` must be a bool, got {has_aux!r}.")
    self.loss_fn = loss_fn
    self.has_aux = has_aux

  def __call__(self, params, batch):
    out = self.loss_fn(params, batch)
    if not self.has_aux:
      if isinstance(out, (tuple, list)):
        raise _scan.RegistrationError(
          f"loss_fn(params, batch) returned a {type(out).__name__} of {len(out)} values, "
          "not one scalar loss. If it returns `(loss, aux)`, build the registration with "
          "has_aux=True: `kfac_jax.Registration(loss_fn, params, batch, has_aux=True)`."
        )
      return out
    if not isinstance(out, (tuple, list)) or len(out) != 2:
      what = (
        f"a {type(out).__name__} of {len(out)} values"
        if isinstance(out, (tuple, list))
        else f"a single {type(out).__name__} of shape {getattr(out, 'shape', '?')}"
      )
      raise _scan.RegistrationError(
        f"has_aux=True, so loss_fn(params, batch) must return a pair `(loss, aux)`; it "
        f"returned {what}. Return `(loss, aux)`, or build the registration without has_aux=True."
      )
    loss, aux = out
    if getattr(loss, "shape", None) != ():
      raise _scan.RegistrationError(
        "has_aux=True: the first element of loss_fn's `(loss, aux)` must be the scalar loss, "
        f"got shape {getattr(loss, 'shape', type(loss).__name__)}."
      )
    return loss, aux


@dataclasses.dataclass(frozen=True)
class StatsKey:
  """What a `CurvatureStats` was computed for: equal keys mean interchangeable statistics.

  `layers`: per layer, `(name, kind, param_paths, num_uses, stack_size)`; `num_samples`: 1 for
  the modes that take no samples.
  """

  estimation_mode: str
  num_samples: int
  layers: tuple[tuple[str, str, tuple[str, ...], int, int], ...]

  @property
  def digest(self) -> str:
    """A short hex digest, for display."""
    return hashlib.sha1(repr(self).encode()).hexdigest()[:8]

  def mode_text(self) -> str:
    return f"estimation_mode={self.estimation_mode!r}, num_samples={self.num_samples}"


def _layer_text(entry) -> str:
  name, kind, paths, uses, stack = entry
  extra = f", {uses} uses" if uses > 1 else ""
  extra += f", stack of {stack}" if stack else ""
  return f"{name} ({kind}: {', '.join(paths)}{extra})"


def avals(tree) -> tuple:
  leaves, treedef = jax.tree_util.tree_flatten(tree)
  return treedef, tuple(jax.typeof(x) for x in leaves)


@dataclasses.dataclass(frozen=True, init=False, eq=False, repr=False)
class Registration:
  """`loss_fn` scanned once: its layers, parameter signature and statistics fingerprint.

  Args:
    loss_fn: `loss_fn(params, batch) -> scalar` with a loss tag on the model output.
    params: the parameters (arrays or ShapeDtypeStructs: only their signature is kept).
    example_batch: a batch of the training shapes (arrays or ShapeDtypeStructs).
    has_aux: `loss_fn` returns `(loss, aux)`; only the loss part is scanned.
    estimation_mode: "gradients" (sampled targets: the Fisher, default), "empirical" (the
      data's targets), "curvature_prop" / "curvature_prop_GGN" (Rademacher vectors), or
      "exact" / "exact_GGN" (every output coordinate); docs/approximations.rst. The random
      modes need an `rng`.
    num_samples: random vectors per example in the random modes (the exact modes require 1).
    layers: a `kfac_jax.LayerConfig` (None: the defaults).
    strict: raise instead of the warnings below.
    collective_axes: a name or a tuple of names of collective axes `loss_fn` itself uses (linen
      `BatchNorm(axis_name="batch")`), bound with size 1 for the scan outside pmap / shard_map.
    check_loss: audit the loss tags against the returned loss on `example_batch`
      (`kfac_jax._audit`): True every check, False none, or a collection of check names.
    warn: emit the warnings below (False for a registration built on the user's behalf).
    curvature_fn: `curvature_fn(params, batch)`, whose loss tags define the curvature when that
      is not the loss's own (docs/vmc.rst); the loss and gradient stay `loss_fn`'s.

  Attributes:
    layers: the registered layers (`LayerSpec` objects) in parameter order; `block_names` their
      names made unique (`name#2`), the keys of the curvature state.
    param_paths, param_shapes, param_dtypes, params_shape: the parameters' signature.
    fingerprint: the `StatsKey` every `CurvatureStats` of this registration carries.
    example_batch_size: the loss tags' leading size in `example_batch`.
    outputs_per_example: D, the predictive distributions per example the loss tags describe.
    loss_factor: `c` with the returned loss `L ≈ c T` (T the tagged loss) as the loss audit
      fitted it, else None; `separate_loss`: the loss is not the tags'.
    The other arguments are kept as attributes (`layers` as `layer_config`).

  Raises:
    TypeError / ValueError: a bad argument, named with its value.
    RegistrationError: no loss tag, a malformed tag, a `layers` entry that does not fit, a
      failed structural audit check, or (with `strict`) what the warnings report.

  Warns:
    UncoveredParametersWarning (parameters outside every layer), LossMismatchWarning: once.

  Example:
    >>> reg = kfac_jax.Registration(loss_fn, params, batch,
    ...                             layers=kfac_jax.LayerConfig(linked={("*",): "full"}))
    >>> tx = kfac_jax.kfac(registration=reg, learning_rate=0.1)
    >>> opt_state = tx.init(params)
    >>> loss, grads, stats = kfac_jax.value_and_grad(registration=reg)(params, batch, rng)
    >>> updates, opt_state = tx.update(grads, opt_state, params, curvature_stats=stats)
  """

  loss_fn: Callable
  has_aux: bool
  estimation_mode: Any
  num_samples: int
  layer_config: Any
  strict: bool
  collective_axes: Any
  check_loss: bool | Collection[str]
  curvature_fn: Callable | None
  loss_part: LossPart
  separate_loss: bool
  example_batch: Any
  params_shape: Any
  param_paths: tuple[str, ...]
  param_shapes: tuple[tuple[int, ...], ...]
  param_dtypes: tuple[str, ...]
  layers: tuple[_scan.LayerSpec, ...]
  block_names: tuple[str, ...]
  example_batch_size: int
  outputs_per_example: int
  loss_factor: float | None
  fingerprint: StatsKey
  _curvature_part: Any
  _scans: _fit.Memo  # Per batch shapes and axis environment.
  _block_sets: _fit.Memo

  def __init__(
    self,
    loss_fn: Callable,
    params: Any,
    example_batch: Any,
    *,
    has_aux: bool = False,
    estimation_mode: _curvature.EstimationMode = "gradients",
    num_samples: int = 1,
    layers: _scan.LayerConfig | None = None,
    strict: bool = False,
    collective_axes: AxisName = None,
    check_loss: bool | Collection[str] = True,
    warn: bool = True,
    curvature_fn: Callable | None = None,
  ):
    part = LossPart(loss_fn, has_aux)  # Checks `loss_fn` and `has_aux`.
    curvature_part = None if curvature_fn is None else _curvature.curvature_part(curvature_fn)
    _curvature.check_mode(estimation_mode, num_samples)
    _checks.boolean(strict, "strict")
    checks = _audit.checks_from(check_loss)
    config = _scan.check_layer_config(layers)
    names = axis_names(collective_axes)
    self._set(loss_fn=loss_fn, loss_part=part, has_aux=has_aux, curvature_fn=curvature_fn)
    self._set(estimation_mode=estimation_mode, num_samples=num_samples, strict=strict)
    self._set(layer_config=config, collective_axes=collective_axes, check_loss=check_loss)
    self._set(_curvature_part=curvature_part, _scans=_fit.Memo(8), _block_sets=_fit.Memo(4))
    env = _compat.axis_env_key()
    stand_in = env is None or any(n not in {e[1] for e in env} for n in names)
    with _compat.axis_env([(n, 1) for n in names]):
      scan = self._trace(params, example_batch, warn)
      if checks and curvature_part is not None:
        _audit.check_overridden_tags(scan, part, params, example_batch, strict=strict, warn=warn)
    # With a separate loss the audit compares nothing with it; two tags on one prediction still
    # count its curvature twice.
    separate = curvature_part is not None or scan.separate_loss
    factor = None
    if separate:
      _audit.check_structure(scan, checks & {"shared_prediction"})
    elif checks:  # Once per registration, not per later scan.
      kw: dict[str, Any] = {"axis_names": names, "strict": strict, "warn": warn, "checks": checks}
      factor = _audit.audit(scan, params, example_batch, estimation_mode=estimation_mode, **kw)
    leaves = jax.tree_util.tree_leaves(params)
    self._set(separate_loss=separate, loss_factor=factor, layers=scan.layers)
    self._set(example_batch=jax.eval_shape(lambda b: b, example_batch))
    self._set(params_shape=jax.eval_shape(lambda p: p, params))
    self._set(param_paths=_scan.param_paths(params), example_batch_size=scan.batch_size)
    self._set(param_shapes=tuple(tuple(np.shape(x)) for x in leaves))
    self._set(param_dtypes=tuple(str(jnp.result_type(x)) for x in leaves))
    own = [s.name for s in scan.layers]  # The k-th layer of a name is `name#k` (k > 1).
    unique = [n if own.index(n) == i else f"{n}#{own[: i + 1].count(n)}" for i, n in enumerate(own)]
    self._set(block_names=tuple(unique))
    # Per loss tag, its prediction's axes after the example one (a categorical's class axis out).
    shapes = [s.prediction_shape[1 : -1 if s.kind == "categorical" else None] for s in scan.losses]
    self._set(outputs_per_example=sum(math.prod(shape) for shape in shapes))
    key_samples = num_samples if estimation_mode in _losses.RANDOM_MODES else 1
    key_layers = tuple(
      (s.name, s.kind, tuple(s.param_paths), s.num_uses, s.stack_size) for s in scan.layers
    )
    self._set(fingerprint=StatsKey(estimation_mode, key_samples, key_layers))
    if not stand_in and not _audit.has_tracer_consts(scan):
      self._scans.put((env, avals(params), avals(example_batch)), scan)

  def _set(self, **fields) -> None:
    """Sets fields once, in `__init__` (the instance is frozen)."""
    for name, value in fields.items():
      object.__setattr__(self, name, value)

  def __repr__(self) -> str:
    return (
      f"Registration({self.fingerprint.mode_text()}, {len(self.layers)} layers "
      f"{list(self.block_names)}, fingerprint {self.fingerprint.digest})"
    )

  def _trace(self, params, batch, warn: bool) -> _scan.ScanResult:
    part = self._curvature_part
    return _scan.scan(
      self.loss_part if part is None else part,
      params,
      batch,
      strict=self.strict,
      warn=warn,
      layers=self.layer_config,
      has_aux=self.has_aux and part is None,
    )

  def linearise(self, params, batch) -> _curvature.Linearisation:
    """One forward pass of this batch's graph, linearised (`_curvature.Linearisation`); its
    loss and gradient are `loss_fn`'s own when the curvature is another function's."""
    return _curvature.Linearisation(
      self.scan_batch(params, batch), params, batch, self.loss_part if self.separate_loss else None
    )

  @property
  def param_signature(self) -> tuple[tuple[str, ...], tuple[tuple[tuple[int, ...], str], ...]]:
    """`(paths, ((shape, dtype), ...))`, the form the estimator compares vectors with."""
    return self.param_paths, tuple(zip(self.param_shapes, self.param_dtypes))

  def check_params(self, params, what: str = "params") -> None:
    """ValueError naming the first leaf where `params` differs from the registration's."""
    paths, want = _scan.param_paths(params), self.param_paths
    problem = None
    for i, (path, x) in enumerate(zip(paths, jax.tree_util.tree_leaves(params))):
      now = (tuple(np.shape(x)), str(jnp.result_type(x)))
      if i >= len(want):
        problem = f"leaf `{path}` is not in the registered params"
      elif path != want[i]:
        problem = f"leaf `{path}` where `{want[i]}` was expected"
      elif now != (self.param_shapes[i], self.param_dtypes[i]):
        problem = (
          f"leaf `{path}` has shape {now[0]} and dtype {now[1]}, expected shape "
          f"{self.param_shapes[i]} and dtype {self.param_dtypes[i]}"
        )
      if problem:
        break
    if problem is None and len(paths) < len(want):
      problem = f"leaf `{want[len(paths)]}` is missing"
    if problem is not None:
      raise ValueError(
        f"the {what} pytree differs from the one the registration was built for: {problem}. "
        "Build a new registration (or front) for a new model, or pass params as registered."
      )

  def blocks(self, config: _blocks.BlockConfig | None = None) -> tuple[_blocks.Block, ...]:
    """One curvature block per layer for the block options `config` (built once per config)."""
    config = _blocks.BlockConfig() if config is None else config
    make = lambda: tuple(_blocks.make_block(s, config) for s in self.layers)
    return self._block_sets(config, make)

  def scan_batch(self, params, batch, *, check_layers: bool = True) -> _scan.ScanResult:
    """The traced graph of `loss_fn(params, batch)`, checked to have the registration's layers
    (`check_layers=False`, for the kernel, which reads only the loss tags: unchecked)."""
    env = _compat.axis_env_key()
    key = None if env is None else (env, avals(params), avals(batch))
    kept = self._scans.get(key)  # A key of None is never stored.
    if kept is None and not check_layers and key is not None:
      kept = self._scans.get((key, "unchecked"))
    if kept is not None:
      return kept
    scan = self._trace(params, batch, False)
    if check_layers:
      shapes = tuple((s.kind, s.approx, s.factor_shapes) for s in scan.layers)
      self.check_layer_shapes(tuple(s.name for s in scan.layers), shapes, scan.batch_size)
    if key is not None and not _audit.has_tracer_consts(scan):
      self._scans.put(key if check_layers else (key, "unchecked"), scan)
    return scan

  def compute(self, params, batch, rng, *, with_grads: bool, with_params_stats: bool = False):
    """`_curvature.compute` on this batch's graph with this registration's settings (the
    callers have checked `rng`)."""
    return _curvature.compute(
      self.scan_batch(params, batch),
      params,
      batch,
      rng,
      estimation_mode=self.estimation_mode,
      num_samples=self.num_samples,
      with_grads=with_grads,
      with_params_stats=with_params_stats,
      fingerprint=self.fingerprint,
      loss_part=self.loss_part if self.separate_loss else None,
    )

  def check_layer_shapes(self, names, shapes, batch_size: int, *, kinds_only: bool = False) -> None:
    """ValueError unless the `names` and `(kind, approx, factor_shapes)` of the layers found for
    a batch of `batch_size` examples are `example_batch`'s (with `kinds_only`, their kinds)."""
    if tuple(names) != tuple(s.name for s in self.layers):
      raise ValueError(
        "loss_fn registers different layers for this batch than for `example_batch`: "
        f"{list(names)} vs {[s.name for s in self.layers]}."
      )
    for (kind, approx, factor_shapes), old in zip(shapes, self.layers):
      same = (kind, approx, factor_shapes) == (old.kind, old.approx, old.factor_shapes)
      if not same and not (kinds_only and kind == old.kind):
        raise ValueError(
          f"layer `{old.name}` changes with the batch size: for this batch of {batch_size} "
          f"examples it is a {kind} layer ({approx!r}) with factor shapes {list(factor_shapes)}, "
          f"for `example_batch` ({self.example_batch_size} examples) a {old.kind} layer "
          f"({old.approx!r}) with {list(old.factor_shapes)}. Feed batches of "
          f"{self.example_batch_size} examples, or tag the layer by hand with batch-free shapes."
        )

  def check_stats(self, stats: _curvature.CurvatureStats, who: str) -> None:
    """ValueError when `stats` were computed for another mode or layer set (both sides named)."""
    key = getattr(stats, "fingerprint", None)
    if key is None:  # Built by hand: only the layer names can be compared.
      if stats.layer_names != tuple(s.name for s in self.layers):
        raise ValueError(
          f"curvature_stats were computed for layers {list(stats.layer_names)}, but {who} has "
          f"{[s.name for s in self.layers]}: compute them with value_and_grad of its registration."
        )
      return
    if key == self.fingerprint:
      return
    got, want, parts = key, self.fingerprint, []
    if (got.estimation_mode, got.num_samples) != (want.estimation_mode, want.num_samples):
      parts.append(
        f"curvature_stats were computed for {got.mode_text()}, but {who} was built for "
        f"{want.mode_text()}."
      )
    if got.layers != want.layers:
      names_got, names_want = [e[0] for e in got.layers], [e[0] for e in want.layers]
      only_got = [_layer_text(e) for e in got.layers if e not in want.layers]
      only_want = [_layer_text(e) for e in want.layers if e not in got.layers]
      parts.append(
        f"curvature_stats were computed for layers {names_got}, but {who} has layers "
        f"{names_want}. Only in the statistics: {only_got or 'none'}; only in {who}: "
        f"{only_want or 'none'}."
      )
    raise ValueError(
      " ".join(parts)
      + f" (statistics fingerprint {got.digest}, expected {want.digest}.) Compute them with "
      f"`kfac_jax.value_and_grad(registration=reg)`, `reg` the registration {who} was built with."
    )


def shared(registration, loss_fn, who: str, *others: tuple[str, Any]) -> Registration | None:
  """The `registration=` argument of an entry point (or None), checked: a `Registration`, given
  without `loss_fn` and the `others` (`(name, value)` pairs its arguments hold instead)."""
  if isinstance(loss_fn, Registration):
    raise TypeError(f"{who}: pass the kfac_jax.Registration as `registration=`, not `loss_fn`.")
  if registration is None:
    if loss_fn is None:
      raise TypeError(f"{who}: pass `loss_fn`, or `registration=` (a kfac_jax.Registration).")
    if not callable(loss_fn):
      raise TypeError(f"{who}: `loss_fn` must be callable, got {_checks.describe(loss_fn)}.")
    return None
  if not isinstance(registration, Registration):
    raise TypeError(
      f"{who}: `registration` must be a kfac_jax.Registration or None, got "
      f"{_checks.describe(registration)}."
    )
  given = [n for n, v in (("loss_fn", loss_fn), *others) if v is not None]
  if given:
    raise ValueError(
      f"{who}: pass either `loss_fn` or `registration=`, not both (got {' and '.join(given)} too)."
    )
  return registration


def value_and_grad(
  loss_fn: Callable | None = None,
  *,
  registration: Registration | None = None,
  compute_params_stats: bool = False,
) -> Callable:
  """Returns `fn(params, batch, rng) -> (loss, grads, curvature_stats)` from one forward pass.

  Args:
    loss_fn: `loss_fn(params, batch) -> scalar`, with a loss tag on the model output: `fn`
      registers it with the default settings, once per params / batch signature.
    registration: a `kfac_jax.Registration` instead of `loss_fn`, shared with the consumer of
      the statistics; its settings apply.
    compute_params_stats: also return `curvature_stats.params_stats`, the first-order
      statistics (see `CurvatureStats`).

  Returns:
    `fn(params, batch, rng=None)`, returning `(loss, grads, curvature_stats)`, or
    `((loss, aux), grads, curvature_stats)` with the registration's `has_aux`.

  Raises:
    TypeError / ValueError: a bad argument (named, with its value); when `fn` is traced, params
      of another structure than the registration's.
    RegistrationError: (when `fn` is traced) no loss tag, or an output not fitting `has_aux`.

  Example:
    >>> @jax.jit
    ... def train_step(params, opt_state, batch, rng):
    ...   loss, grads, stats = kfac_jax.value_and_grad(loss_fn)(params, batch, rng)
    ...   updates, opt_state = tx.update(grads, opt_state, params, curvature_stats=stats)
    ...   return optax.apply_updates(params, updates), opt_state, loss
    >>> params, opt_state, loss = train_step(params, opt_state, batch, rng)

    With `has_aux` (e.g. BatchNorm statistics), see docs/recipes.rst.
  """
  _checks.boolean(compute_params_stats, "compute_params_stats")
  reg = shared(registration, loss_fn, "value_and_grad")
  own = _fit.Memo(8)  # Without `registration`: one per (params, batch) signature.

  def fn(params, batch, rng=None):
    if reg is not None:
      reg.check_params(params)
    r = reg or own(
      (avals(params), avals(batch)),
      lambda: Registration(loss_fn, params, batch, warn=False),  # type: ignore[arg-type]
    )
    _curvature.check_rng(r.estimation_mode, rng)  # Before the loss is traced.
    out = r.compute(params, batch, rng, with_grads=True, with_params_stats=compute_params_stats)
    if r.has_aux:
      loss, aux, grads, stats = out
      return (loss, aux), grads, stats
    return out

  return fn
