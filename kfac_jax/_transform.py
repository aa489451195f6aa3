"""K-FAC as optax gradient transformations: `scale_by_kfac`, the bare preconditioner
(updates ← F̂_λ⁻¹ · updates), and `kfac`, which chains it with K-FAC norm clipping, `optax.trace`
momentum and the learning rate under the step's verdict (`Config.skip_nonfinite`); both
configure one `kfac_jax._engine.Engine`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from kfac_jax import (
  _checks,
  _config,
  _engine,
  _errors,
  _estimator,
  _fit,
  _migrate,
  _parallel,
  _registration,
  _verdict,
)

Array = jax.Array
ScalarOrSchedule = float | Array | Callable[[Array], Array]


class ScaleByKfacState(NamedTuple):
  """State of `scale_by_kfac`: `count` (`[]` int32, updates applied), `curvature` (the
  estimator's state), `skipped` (`[]` int32, updates skipped; schedules see `count + skipped`)."""

  count: Array  # type: ignore[assignment]  # optax's field name; shadows tuple.count
  curvature: _estimator.EstimatorState
  skipped: Array


class KfacState(NamedTuple):
  """State of `kfac`: `preconditioner` (a `ScaleByKfacState`, `state[0]` as in a chain) and
  `rest`, the states of `(clipping, momentum, learning rate or line search)`."""

  preconditioner: ScaleByKfacState
  rest: tuple[Any, ...]

  @property
  def momentum(self) -> optax.TraceState | optax.EmptyState:
    """`optax.TraceState` (the heavy-ball trace, params-shaped) with momentum, else empty."""
    return self.rest[1]


def auto_stride(n: int) -> int:
  """`statistics_fraction="auto"`'s row stride for n rows, keeping at least 64 (powers of two
  keep rows on their devices, sharded over 2^k)."""
  return 4 if n >= 256 else 2 if n >= 128 else 1


def _rows(fraction, batch, who: str) -> tuple[Any, int]:
  """`(rows of batch, their number)`: the strided slice `x[: rows * stride : stride]` of every
  leaf's leading axis, so a sharded batch keeps rows on every device."""
  sized = [(p, x) for p, x in jax.tree_util.tree_flatten_with_path(batch)[0] if jnp.ndim(x) >= 1]
  if not sized:
    raise ValueError(
      f"{who}: statistics_fraction={fraction!r} takes rows of every `batch=` leaf, "
      "but no leaf has a leading axis."
    )
  n = jnp.shape(sized[0][1])[0]
  for path, x in sized[1:]:
    if jnp.shape(x)[0] != n:
      raise ValueError(
        f"{who}: statistics_fraction={fraction!r} takes the same rows of every `batch=` leaf, "
        f"but `batch{jax.tree_util.keystr(sized[0][0])}` has {n} rows and "
        f"`batch{jax.tree_util.keystr(path)}` {jnp.shape(x)[0]}: pass statistics_fraction=None "
        "and slice the batch yourself."
      )
  if fraction == "auto":
    stride = auto_stride(n)
    rows = -(-n // stride)
  else:
    rows = max(1, math.ceil(fraction * n))
    stride = n // rows
  if rows == n:
    return batch, rows
  take = lambda x: x[: rows * stride : stride] if jnp.ndim(x) >= 1 else x
  return jax.tree_util.tree_map(take, batch), rows


def kfac_statistics(engine: _engine.Engine, bound, params, batch, rng, curvature_stats):
  """`curvature_stats`, else those of `Config.statistics_fraction`'s rows of `batch`: "auto" falls
  back to the whole batch where the cut one fails to trace; a number raises, noted."""
  if curvature_stats is not None:
    return curvature_stats
  est, fraction, who = bound.estimator, engine.config.statistics_fraction or 1, engine.who
  if fraction == 1:
    return est._curvature_stats(params, batch, rng)
  if fraction == "auto":
    try:
      cut, rows = _rows(fraction, batch, who)
      stats = est._curvature_stats(params, cut, rng)
      if stats.batch_size == rows:
        return stats
    except Exception:  # noqa: BLE001  # Flax's shape errors are not ValueErrors.
      pass
    return est._curvature_stats(params, batch, rng)
  cut = _rows(fraction, batch, who)[0]
  try:
    return est._curvature_stats(params, cut, rng)
  except (TypeError, ValueError) as e:
    # A note, not a new exception: JAX's own TypeErrors take a tracer, not a message.
    e.add_note(
      "(The statistics came from a subset of the rows of every `batch=` leaf: "
      f"statistics_fraction={fraction!r}. Every leaf with a leading axis must be per-example; "
      "otherwise pass statistics_fraction=None and slice the batch yourself.)"
    )
    raise


def transformation(engine: _engine.Engine, hyperparameters: dict, statistics, rest=None, own=None):
  """The optax transformation of `engine`, or with `rest` (taking `kfac_grads=`, `kfac_count=`)
  its chain `engine.state_type(own, rest's)`: a skipped step runs no `rest` and gives zeros;
  `statistics(engine, bound, params, batch, rng, curvature_stats)` gives the curvature's data."""
  own_type = engine.state_type if rest is None else own

  def init_fn(params):
    bound = engine.bind(params)
    # Distinct arrays: a state whose leaves share one buffer cannot be donated.
    zero = lambda: jnp.zeros([], jnp.int32)  # noqa: E731
    pre = own_type(zero(), engine.curvature.init(bound, engine.placement, params), zero())
    state = pre if rest is None else engine.state_type(pre, rest.init(params))
    return _parallel.replicate_on_mesh(state, params, engine.placement.mesh)

  shapes = _fit.state_shapes(init_fn)

  def update_fn(
    updates, state, params=None, *, curvature_stats=None, batch=None, rng=None, **extra
  ):
    if params is None:
      raise ValueError(f"{engine.who}: `params` is required: tx.update(grads, state, params, ...).")
    bound = engine.bind(params)
    engine.check(
      bound, state, shapes(params), vector=updates, stats=curvature_stats, batch=batch, rng=rng
    )
    own = state if rest is None else state.preconditioner
    data = lambda: statistics(engine, bound, params, batch, rng, curvature_stats)  # noqa: E731
    finite = {"gradient": updates, "params": params}
    inputs = _engine.Inputs(updates, data, finite, hyperparameters)
    step = engine.step(bound, own.count, own.skipped, own.curvature, inputs)
    ok, out = step.ok, step.vector
    if rest is not None:
      chained = {"kfac_grads": updates, "kfac_count": step.clock, **extra}
      run = functools.partial(rest.update, out, state.rest, params, **chained)
      skip = lambda: (optax.tree_utils.tree_zeros_like(out), state.rest)  # noqa: E731
      out, rest_state = run() if ok is None else jax.lax.cond(ok, run, skip)
    if ok is None:
      new = own_type(optax.safe_increment(own.count), step.curvature, own.skipped)
    else:
      if rest is None:
        out = optax.tree_utils.tree_where(ok, out, optax.tree_utils.tree_zeros_like(out))
      count = own.count + ok.astype(own.count.dtype)
      new = own_type(count, step.curvature, own.skipped + (~ok).astype(own.skipped.dtype))
    return out, (new if rest is None else engine.state_type(new, rest_state))

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


@_migrate.translated("scale_by_kfac")
def scale_by_kfac(
  loss_fn: Callable | None = None,
  example_batch: Any = None,
  *,
  damping: ScalarOrSchedule = 0.1,
  ema_decay: float = 0.95,
  inverse_every: int = 5,
  curvature_every: int = 1,
  registration: _registration.Registration | None = None,
  axis_name: str | None = None,
  config: _config.Config | None = None,
) -> optax.GradientTransformationExtraArgs:
  """Preconditions updates with the damped K-FAC curvature: `u ← (F̂ + λ)⁻¹ u`.

  `F̂` is the block-diagonal Kronecker-factored Fisher of the tagged loss (`CurvatureEstimator`),
  a bias-corrected EMA of the statistics of every `curvature_every`-th update; its inverse is
  refreshed every `inverse_every` updates (both first at update 0).

  Args:
    loss_fn: `loss_fn(params, batch) -> scalar` with a loss tag on the model output; `init`
      registers it with the default settings (see `kfac_jax.Registration`).
    example_batch: a batch of the training shapes; `init` scans `loss_fn` with it.
    damping: λ ≥ 0, a number or a schedule `count -> λ`.
    ema_decay: decay of the statistics' moving average, in [0, 1) (0 keeps the newest batch).
    inverse_every: refresh the inverses every this many updates.
    curvature_every: fold the statistics into the EMA every this many updates (1 here: without
      `kfac`'s clipping, stale statistics let some models diverge).
    registration: a `kfac_jax.Registration` instead of `loss_fn` and `example_batch`, shared
      with `kfac_jax.value_and_grad(registration=...)`; inside `optax.multi_transform`, built
      from the whole params, with `curvature_stats=` (docs/recipes.rst).
    axis_name: inside `pmap` / `shard_map`: average the statistics over this axis and split
      the inverse work over it.
    config: a `kfac_jax.Config` with the rare knobs (those `scale_by_kfac` reads).

  Returns:
    An `optax.GradientTransformationExtraArgs` with state `ScaleByKfacState`. Its
    `update(updates, state, params, *, curvature_stats=None, batch=None, rng=None)` needs
    `params`, and either `curvature_stats` from `kfac_jax.value_and_grad` (one forward pass for
    everything) or `batch` and `rng` (an extra forward and backward pass).

  Raises:
    TypeError / ValueError: a bad argument (or a `Config` field it does not read), named with
      the value received, before any state is created; in `update`, before any state changes:
      params, a state or `curvature_stats` of another model, mode or layer set.

  Example:
    >>> tx = optax.chain(kfac_jax.scale_by_kfac(loss_fn, batch, damping=1e-3),
    ...                  optax.scale_by_learning_rate(0.1))
    >>> opt_state = tx.init(params)
    >>> loss, grads, stats = kfac_jax.value_and_grad(loss_fn)(params, batch, rng)
    >>> updates, opt_state = tx.update(grads, opt_state, params, curvature_stats=stats)
  """
  schedule = (ema_decay, inverse_every, curvature_every)
  source = (loss_fn, example_batch, registration)
  engine = _kfac_engine(
    "scale_by_kfac", ScaleByKfacState, source, schedule, axis_name, config, damping
  )
  return transformation(engine, {"damping": (damping, 0.0)}, kfac_statistics)


def _kfac_engine(who, state_type, source, schedule, axis_name, config, damping) -> _engine.Engine:
  """A K-FAC transform's engine, `damping` and the `schedule` checked first."""
  _checks.number(damping, "damping", low=0.0, schedule=True)
  front = {"axis_name": axis_name, "config": config, "state_type": state_type, "transform": True}
  return _engine.Engine.kfac(who, source, _engine.Schedule.checked(*schedule), **front)


def clip_coefficient(preconditioned, grads, max_norm) -> Array:
  """`min(1, r / √|vᵀg|)`, r = `max_norm`: with `v = F̂_λ⁻¹ g`, `vᵀ F̂_λ v = vᵀ g`, so `√|vᵀg|`
  is v's length in its own metric. 1 when `vᵀg = 0`; accumulated in at least float32."""
  vg = jnp.abs(jnp.asarray(_verdict.tree_vdot(preconditioned, grads)))
  r2 = jnp.square(jnp.asarray(max_norm, vg.dtype))
  big = vg > r2
  return jnp.where(big, jnp.sqrt(r2 / jnp.where(big, vg, 1)), jnp.ones_like(vg))


def default_learning_rate(registration: _registration.Registration) -> float:
  """`kfac`'s learning rate when none is given: `0.3 · D^(1/4)`, D the registration's
  `outputs_per_example` (docs/hyperparameters.rst gives the reason)."""
  return 0.3 * registration.outputs_per_example**0.25


def _clip_by_kfac_norm(max_norm, tagged: _engine.Engine | None):
  """Scales `v` by `clip_coefficient(v, g, max_norm)`, g the raw gradient (`kfac_grads=`); with
  the engine `tagged`, in the tagged loss's metric (`max_norm · c`, c the loss factor)."""

  def update_fn(updates, state, params=None, *, kfac_grads, **extra_args):
    del extra_args
    c = 1.0 if tagged is None else (tagged.bind(params).registration.loss_factor or 1.0)
    coeff = clip_coefficient(updates, kfac_grads, max_norm * c)
    return jax.tree_util.tree_map(lambda x: x * coeff.astype(x.dtype), updates), state

  return optax.GradientTransformationExtraArgs(lambda _: optax.EmptyState(), update_fn)


def _tagged_default(reg: _registration.Registration) -> float:
  """`kfac`'s default learning rate on the tagged loss's scale: over the loss factor c."""
  return default_learning_rate(reg) / (reg.loss_factor or 1.0)


# Far from `kfac`'s default: the benchmark models train between 1/6 and 3 times it.
_FAR_BELOW, _FAR_ABOVE = 1e-3, 30.0


def _report_far_learning_rate(reporter: _verdict.Reporter, reg, value, step=None) -> None:
  """A `HyperparameterWarning` (once per front) when the learning rate `value` (at schedule
  count `step`) over `_tagged_default(reg)` is outside [_FAR_BELOW, _FAR_ABOVE]."""
  c = reg.loss_factor or 1.0
  default = _tagged_default(reg)
  value = float(np.asarray(value).ravel()[0])
  ratio = value / default
  if _FAR_BELOW <= ratio <= _FAR_ABOVE:
    return
  at = "" if step is None else f" (its value at step {int(np.asarray(step).ravel()[0])})"
  reporter.once(
    "range:learning_rate",
    f"{reporter.who}: learning_rate={value:g}{at} is {ratio:.3g} times the default for this "
    f"loss, 0.3 · D^(1/4) / c = {default:.3g} (D = {reg.outputs_per_example} outputs per "
    f"example, c = {c:g} the returned loss over the tagged one), outside [{_FAR_BELOW:g}, "
    f"{_FAR_ABOVE:g}] times it, where a step overshoots or barely moves. Pass "
    "learning_rate=None for the default. This warning is given once.",
    _errors.HyperparameterWarning,
  )


def _kfac_learning_rate(learning_rate, engine: _engine.Engine, registration):
  """`scale_by_learning_rate` with `_tagged_default`, warning of a learning rate far from it: a
  number at once (with `registration`) or at `init`, a traced one from the step that gives it."""
  reporter = engine.reporter
  if registration is not None and isinstance(learning_rate, (int, float)):
    _report_far_learning_rate(reporter, registration, learning_rate)

  def check(params, value, count) -> None:
    reg = engine.bind(params).registration
    if isinstance(value, (int, float)):
      _report_far_learning_rate(reporter, reg, value)
      return
    ratio = jnp.asarray(value) / _tagged_default(reg)
    report = lambda v, n: _report_far_learning_rate(reporter, reg, v, n)
    reporter.when_bad((ratio >= _FAR_BELOW) & (ratio <= _FAR_ABOVE), report, value, count)

  default = lambda params: _tagged_default(engine.bind(params).registration)  # noqa: E731
  return scale_by_learning_rate(learning_rate, default, check)


def scale_by_learning_rate(learning_rate, default: Callable, check: Callable | None = None):
  """`u ← −α u` in at least float32, α at the count `kfac_count=` (None: `default(params)`);
  `check(params, α, count)` sees a number at `init`, a schedule's or injected α each update."""

  def init_fn(params):
    if check is not None and isinstance(learning_rate, (int, float)):
      check(params, learning_rate, None)
    return optax.EmptyState()

  def update_fn(updates, state, params=None, *, kfac_count, **extra_args):
    del extra_args
    if learning_rate is None:
      step = default(params)
    else:
      step = learning_rate(kfac_count) if callable(learning_rate) else learning_rate
      if check is not None and not isinstance(learning_rate, (int, float)):
        check(params, step, kfac_count)
    scale = lambda x: (x.astype(jnp.promote_types(x.dtype, jnp.float32)) * -step).astype(x.dtype)
    return jax.tree_util.tree_map(scale, updates), state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


_LINESEARCHES = (
  "optax.scale_by_backtracking_linesearch(...), optax.scale_by_zoom_linesearch(...) or "
  "kfac_jax.pinn.grid_linesearch()"
)


def _check_linesearch(linesearch, who: str) -> None:
  """TypeError unless `linesearch`'s state (from its init on stand-in shapes: nothing runs)
  keeps its chosen step in a `learning_rate` field, as optax's line searches do."""
  if not isinstance(linesearch, optax.GradientTransformation):
    raise TypeError(
      f"{who}: `linesearch` must be an optax line search such as {_LINESEARCHES}, got "
      f"{type(linesearch).__name__}: {linesearch!r}."
    )
  state = jax.eval_shape(linesearch.init, {"w": jax.ShapeDtypeStruct((2,), jnp.float32)})
  fields = optax.tree_utils.tree_get_all_with_path(state, "learning_rate")
  if not any(not isinstance(path[-1], jax.tree_util.DictKey) for path, _ in fields):
    raise TypeError(
      f"{who}: `linesearch` must be a line search, which keeps its step in its state's "
      f"`learning_rate` field: {_LINESEARCHES}; got one whose state ({type(state).__name__}) "
      "has none. Pass `learning_rate=` instead, or chain another optimizer after the bare "
      "preconditioner (`kfac_jax.scale_by_kfac`, `kfac_jax.scale_by_kernel_ngd`)."
    )


def _check_scalar_loss(out, what: str) -> None:
  """TypeError unless `out` is one scalar; `what` says what it is, e.g. "`value=` must be"."""
  if isinstance(out, (tuple, list)):
    got = f"a {type(out).__name__} of {len(out)} values"
  elif jnp.shape(out) != ():
    got = f"an array of shape {jnp.shape(out)}"
  else:
    return
  raise TypeError(
    f"the line search's {what} the scalar loss, got {got}. For a `loss_fn` returning "
    "`(loss, aux)`, pass `value_fn=lambda params: loss_fn(params, batch)[0]` and `value=loss`."
  )


def _scalar_value_fn(value_fn: Callable) -> Callable:
  """`value_fn` checked to return one scalar where a line search traces it (its signature is
  kept: optax's line searches read it to pick `value_fn`'s keyword arguments)."""

  @functools.wraps(value_fn)
  def checked(*args, **kwargs):
    out = value_fn(*args, **kwargs)
    _check_scalar_loss(out, "`value_fn` must return")
    return out

  return checked


def check_step_size(learning_rate, linesearch, who: str) -> None:
  """A learning rate (a number > 0 or a schedule) or a line search, not both."""
  if linesearch is not None:
    _check_linesearch(linesearch, who)
    if learning_rate is not None:
      raise ValueError(
        f"{who}: got both learning_rate={learning_rate!r} and a `linesearch`; the line search "
        "picks the step along the preconditioned direction, so pass learning_rate=None."
      )
  if learning_rate is not None:
    _checks.number(learning_rate, "learning_rate", low=0.0, low_open=True, schedule=True)


def along_linesearch(linesearch):
  """`u ← η (−m)`, η picked by the optax line search along −m from the update's extra
  arguments (`value=`, `grad=`, `value_fn=`), not the chain's `kfac_grads=` / `kfac_count=`."""

  def update_fn(updates, state, params=None, *, kfac_grads, kfac_count, **extra_args):
    del kfac_grads, kfac_count
    if extra_args.get("value") is not None:
      _check_scalar_loss(extra_args["value"], "`value=` must be")
    if callable(extra_args.get("value_fn")):
      extra_args["value_fn"] = _scalar_value_fn(extra_args["value_fn"])
    descent = jax.tree_util.tree_map(jnp.negative, updates)
    return linesearch.update(descent, state, params, **extra_args)

  linesearch = optax.with_extra_args_support(linesearch)
  return optax.GradientTransformationExtraArgs(linesearch.init, update_fn)


@_migrate.translated("kfac")
def kfac(
  loss_fn: Callable | None = None,
  example_batch: Any = None,
  learning_rate: ScalarOrSchedule | None = None,
  *,
  momentum: float | None = 0.7,
  max_norm: float | None = 0.3,
  damping: ScalarOrSchedule = 0.1,
  ema_decay: float = 0.95,
  inverse_every: int = 5,
  curvature_every: int = 5,
  registration: _registration.Registration | None = None,
  axis_name: str | None = None,
  config: _config.Config | None = None,
  linesearch: optax.GradientTransformationExtraArgs | None = None,
) -> optax.GradientTransformationExtraArgs:
  """K-FAC with a learning rate (or a line search), norm clipping and momentum.

  `scale_by_kfac`, then clip → `optax.trace` → learning rate, under the step's verdict:
  `u = −α m`, `m ← v + μ m` (Nesterov's with `Config.nesterov`), v the preconditioned gradient
  clipped to length `max_norm` in the damped K-FAC metric (`clip_coefficient`), so a step's
  length there is at most `α · max_norm`. Schedules see every update (`count + skipped`); a
  value that is not finite skips its update. Defaults: docs/hyperparameters.rst.

  Args:
    loss_fn, example_batch, damping, ema_decay, inverse_every, registration, axis_name, config:
      as in `scale_by_kfac`.
    learning_rate: α > 0, a number or a schedule `count -> α`; None takes
      `default_learning_rate` over the loss factor c (the tagged loss's scale). An α over 30
      times that or below 1/1000 of it gives one `HyperparameterWarning`.
    momentum: μ in [0, 1) for heavy-ball momentum on the preconditioned update, or None.
    max_norm: r > 0, the largest length `√|vᵀg|` of v in the damped metric before α, or None
      (no clipping; `norm_constraint`'s equivalent: docs/hyperparameters.rst).
    curvature_every: as in `scale_by_kfac`, but 5 by default: the clipping bounds a step that
      statistics up to 4 updates old precondition (without clipping, prefer 1).
    linesearch: an optax line search (`optax.scale_by_backtracking_linesearch(...)`, ...) in
      place of α: the step is `η (−m)`, η its choice; `update` then also takes its `value=`,
      `grad=` and `value_fn=`, as in `optax.lbfgs`.

  Returns:
    An `optax.GradientTransformationExtraArgs` with state `KfacState`; `update` takes
    `scale_by_kfac`'s extra arguments and those of `linesearch`.

  Raises:
    TypeError / ValueError: as `scale_by_kfac`.

  Example:
    >>> tx = kfac_jax.kfac(loss_fn, batch)
    >>> opt_state = tx.init(params)
    >>> loss, grads, stats = kfac_jax.value_and_grad(loss_fn)(params, batch, rng)
    >>> updates, opt_state = tx.update(grads, opt_state, params, curvature_stats=stats)
    >>> params = optax.apply_updates(params, updates)
  """
  check_step_size(learning_rate, linesearch, "kfac")
  schedule = (ema_decay, inverse_every, curvature_every)
  source = (loss_fn, example_batch, registration)
  if momentum is not None:
    _checks.number(momentum, "momentum", low=0.0, high=1.0, high_open=True)
  if max_norm is not None:
    _checks.number(max_norm, "max_norm", low=0.0, low_open=True)
  engine = _kfac_engine("kfac", KfacState, source, schedule, axis_name, config, damping)
  tagged, nesterov = (engine if learning_rate is None else None), engine.config.nesterov
  rest = optax.chain(
    optax.identity() if max_norm is None else _clip_by_kfac_norm(max_norm, tagged),
    optax.identity() if momentum is None else optax.trace(momentum, nesterov=nesterov),
    _kfac_learning_rate(learning_rate, engine, registration)
    if linesearch is None
    else along_linesearch(linesearch),
  )
  hyperparameters: dict[str, tuple[Any, float | None]] = {"damping": (damping, 0.0)}
  hyperparameters["learning_rate"] = (learning_rate, 0.0)
  hyperparameters |= {"momentum": (momentum, None), "max_norm": (max_norm, None)}
  return transformation(engine, hyperparameters, kfac_statistics, rest, ScaleByKfacState)
