"""K-FAC as optax gradient transformations.

`scale_by_kfac` is the bare preconditioner (updates ← F̂_λ⁻¹ · updates); `kfac` chains it with
K-FAC norm clipping, `optax.trace` momentum and the learning rate under the step's verdict.
Both are configurations of one `kfac_jax._engine.Engine`, whose step runs inside the caller's
`jit` / `pmap`, without host syncs.

With `Config.skip_nonfinite` (the default) a non-finite gradient, batch statistics or
preconditioned update gives zero updates and leaves the state as it was but for the `skipped`
counters; `kfac`'s guard also requires finite hyperparameters and keeps the momentum trace.
A schedule's value that is not finite (or a negative learning rate or damping) skips its step
and is reported once per hyperparameter (`HyperparameterWarning`, from the host); a gradient or
params that are not finite once per input (`NonFiniteWarning`), guard on or off.
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

from kfac_jax import _checks, _config, _engine, _errors, _estimator, _fit, _migrate, _registration

Array = jax.Array
ScalarOrSchedule = float | Array | Callable[[Array], Array]


class ScaleByKfacState(NamedTuple):
  """State of `scale_by_kfac`.

  Attributes:
    count: `[]` int32, updates applied so far (not the skipped ones): the statistics' and
      inverses' periods count it; schedules are called with `count + skipped`.
    curvature: the estimator's factors, caches and EMA weight.
    skipped: `[]` int32, updates skipped because the gradient, the statistics or the update
      were not finite (`Config.skip_nonfinite`).
  """

  count: Array  # type: ignore[assignment]  # optax's field name; shadows tuple.count
  curvature: _estimator.EstimatorState
  skipped: Array


class KfacState(NamedTuple):
  """State of `kfac`: its preconditioner's and the rest of its chain's.

  Attributes:
    preconditioner: the `scale_by_kfac` state (`state[0]`, as in a chain).
    rest: the states of the chain after it, `(clipping, momentum, learning rate)`; only the
      momentum's (also `state.momentum`) and a line search's (in place of the learning rate)
      are not empty.
  """

  preconditioner: ScaleByKfacState
  rest: tuple[Any, ...]

  @property
  def momentum(self) -> optax.TraceState | optax.EmptyState:
    """`optax.TraceState` (the heavy-ball trace, params-shaped) with momentum, else empty."""
    return self.rest[1]


def auto_stride(n: int) -> int:
  """The row stride of `statistics_fraction="auto"` for a batch of n rows: every fourth row from
  256 rows, every second from 128, else every row, so the statistics keep at least 64 examples.
  Powers of two keep the rows on their devices for a batch sharded over 2^k devices."""
  return 4 if n >= 256 else 2 if n >= 128 else 1


def _rows(fraction, batch, who: str) -> tuple[Any, int]:
  """`(rows of batch, their number)`: the strided slice `x[: rows * stride : stride]` of every
  leaf's leading axis that `fraction` picks, so a sharded batch keeps rows on every device.
  Leaves without one shared leading axis raise."""
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
        f"{who}: statistics_fraction={fraction!r} takes the same rows of every `batch=` "
        f"leaf, so their leading axes must agree: `batch{jax.tree_util.keystr(sized[0][0])}` "
        f"has {n} rows, `batch{jax.tree_util.keystr(path)}` has {jnp.shape(x)[0]}. Pass "
        "statistics_fraction=None and slice the batch yourself."
      )
  if fraction == "auto":
    stride = auto_stride(n)
    rows = -(-n // stride)
  else:
    rows = max(1, math.ceil(fraction * n))
    stride = n // rows
  if rows == n:
    return batch, rows
  cut = jax.tree_util.tree_map(
    lambda x: x[: rows * stride : stride] if jnp.ndim(x) >= 1 else x, batch
  )
  return cut, rows


def _batch_statistics(est: _estimator.CurvatureEstimator, fraction, params, batch, rng, who: str):
  """This batch's statistics from the rows `fraction` picks (see `Config.statistics_fraction`).

  "auto" tries the cut batch at trace time only and falls back to the whole batch when it
  fails (the abandoned trace leaves nothing in the compiled step); an explicit fraction raises,
  with a note on the cause.
  """
  if fraction == 1:
    return est._curvature_stats(params, batch, rng)
  if fraction == "auto":
    try:
      cut, rows = _rows(fraction, batch, who)
      stats = est._curvature_stats(params, cut, rng)
    except Exception:  # noqa: BLE001  # Flax's shape errors are not ValueErrors.
      stats = None
    if stats is not None and stats.batch_size == rows:
      return stats
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


def kfac_statistics(engine: _engine.Engine, bound, params, batch, rng, curvature_stats):
  """K-FAC's statistics for an update: `curvature_stats` as given, else from `batch`'s rows
  that `Config.statistics_fraction` picks."""
  if curvature_stats is not None:
    return curvature_stats
  fraction = engine.config.fraction
  return _batch_statistics(bound.estimator, fraction, params, batch, rng, engine.who)


def transformation(engine: _engine.Engine, hyperparameters: dict, statistics, rest=None, own=None):
  """The optax transformation of `engine` (`scale_by_kfac`, `scale_by_kernel_ngd`), or its
  chain with `rest` (`kfac`, `kernel_ngd`: clipping, momentum and the learning rate) run on the
  preconditioned vector under the step's verdict: on a skipped step `rest` is not run, the
  updates are zeros and every state but the `skipped` counter is kept (optax's
  `apply_if_finite` pattern, curvature-aware).

  `statistics(engine, bound, params, batch, rng, curvature_stats)` gives the curvature's data
  for an update. The preconditioner's state is `engine.state_type` alone, or (with `rest`) the
  type `own` beside `rest`'s in `engine.state_type`. `rest` is given the raw gradient
  `kfac_grads=`, the schedules' count `kfac_count=` and the caller's other extra arguments (a
  line search's `value=`, `grad=`, `value_fn=`)."""
  own_type = engine.state_type if rest is None else own

  def init_fn(params):
    bound = engine.bind(params)
    # Distinct arrays: a state whose leaves share one buffer cannot be donated.
    zero = lambda: jnp.zeros([], jnp.int32)  # noqa: E731
    pre = own_type(zero(), engine.init(bound, params), zero())
    state = pre if rest is None else engine.state_type(pre, rest.init(params))
    return engine.replicate(state, params)

  shapes = _fit.StateShapes(init_fn)

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
    step = engine.step(
      bound,
      own.count,
      own.skipped,
      own.curvature,
      _engine.Inputs(updates, data, finite, hyperparameters),
    )
    ok = step.ok
    out = step.vector
    if rest is not None:

      def run():
        return rest.update(
          out, state.rest, params, kfac_grads=updates, kfac_count=step.clock, **extra
        )

      if ok is None:
        out, rest_state = run()
      else:
        zeros = optax.tree_utils.tree_zeros_like(out)
        out, rest_state = jax.lax.cond(ok, run, lambda: (zeros, state.rest))
    if ok is None:
      new = own_type(optax.safe_increment(own.count), step.curvature, own.skipped)
    else:
      if rest is None:
        out = optax.tree_utils.tree_where(ok, out, optax.tree_utils.tree_zeros_like(out))
      new = own_type(
        own.count + ok.astype(own.count.dtype),
        step.curvature,
        own.skipped + (~ok).astype(own.skipped.dtype),
      )
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

  `F̂` is the block-diagonal Kronecker-factored Fisher of the tagged loss (see
  `CurvatureEstimator`), a bias-corrected EMA of the statistics of every `curvature_every`-th
  update; its inverse is refreshed every `inverse_every` updates (both first at update 0).

  Args:
    loss_fn: `loss_fn(params, batch) -> scalar` with a loss tag on the model output; `init`
      registers it with the default settings (see `kfac_jax.Registration`).
    example_batch: a batch of the training shapes; `init` scans `loss_fn` with it.
    damping: λ ≥ 0, a number or a schedule `count -> λ`.
    ema_decay: decay of the statistics' moving average, in [0, 1) (0 keeps the newest batch).
    inverse_every: refresh the inverses every this many updates.
    curvature_every: fold the statistics into the EMA every this many updates (1 here: without
      `kfac`'s clipping, stale statistics let some models diverge). Above 1 the statistics'
      products (and passes, with `batch=`) are formed on due updates only.
    registration: a `kfac_jax.Registration` instead of `loss_fn` and `example_batch`, shared
      with `kfac_jax.value_and_grad(registration=...)`: the settings of the scan (`has_aux`,
      `estimation_mode`, `layers`, ...) are its.
    axis_name: inside `pmap` / `shard_map`: average the statistics over this axis and split
      the inverse work over it.
    config: a `kfac_jax.Config` with the rare knobs (those `scale_by_kfac` reads).

  With `optax.inject_hyperparams`, declare the non-numeric arguments static:
  `static_args=("loss_fn", "example_batch")`. Inside `optax.multi_transform` / `optax.masked`,
  pass `registration=` built from the whole params and `curvature_stats=`: the state then
  holds only the share's blocks, and every layer must lie wholly inside or outside it.

  Returns:
    An `optax.GradientTransformationExtraArgs` with state `ScaleByKfacState`. Its
    `update(updates, state, params, *, curvature_stats=None, batch=None, rng=None)` needs
    `params`, and either `curvature_stats` from `kfac_jax.value_and_grad` (one forward pass for
    everything) or `batch` and `rng` (an extra forward and backward pass).

  Raises:
    TypeError / ValueError: a bad argument, named with the value received, before any state
      is created; a `Config` field it does not read. In `update` (when traced, before any
      state changes): params of another structure than at `init`, a state of another model,
      or `curvature_stats` of another mode, sample count or layer set.

  Example:
    >>> tx = optax.chain(kfac_jax.scale_by_kfac(loss_fn, batch, damping=1e-3),
    ...                  optax.scale_by_learning_rate(0.1))
    >>> opt_state = tx.init(params)
    >>> loss, grads, stats = kfac_jax.value_and_grad(loss_fn)(params, batch, rng)
    >>> updates, opt_state = tx.update(grads, opt_state, params, curvature_stats=stats)
  """
  _checks.number(damping, "damping", low=0.0, schedule=True)
  engine = _engine.Engine.kfac(
    "scale_by_kfac",
    (loss_fn, example_batch, registration),
    _engine.Schedule.checked(ema_decay, inverse_every, curvature_every),
    axis_name=axis_name,
    config=config,
    state_type=ScaleByKfacState,
    transform=True,
  )
  return transformation(engine, {"damping": (damping, 0.0)}, kfac_statistics)


def clip_coefficient(preconditioned, grads, max_norm) -> Array:
  """`min(1, r / √|vᵀg|)`: the scale that keeps `v`'s norm in the damped K-FAC metric ≤ `r`.

  With `v = F̂_λ⁻¹ g` the preconditioned gradient, `vᵀ F̂_λ v = vᵀ g`, so `√|vᵀg|` is `v`'s
  length in the metric that preconditioned it (half its square approximates the KL divergence
  of the step). 1 when `vᵀg = 0`; accumulated in at least float32. `r = max_norm`.
  """
  vg = jnp.abs(jnp.asarray(_engine.tree_vdot(preconditioned, grads)))
  r2 = jnp.square(jnp.asarray(max_norm, vg.dtype))
  big = vg > r2
  return jnp.where(big, jnp.sqrt(r2 / jnp.where(big, vg, 1)), jnp.ones_like(vg))


def default_learning_rate(registration: _registration.Registration) -> float:
  """`kfac`'s learning rate when none is given: `0.3 · D^(1/4)`, D the registration's
  `outputs_per_example`: the clipped step's length `α · max_norm` is spread over D outputs, and
  D^(1/4) lies between a budget per example (D^0) and one per output (D^(1/2), which overshot).
  """
  return 0.3 * registration.outputs_per_example**0.25


def _clip_by_kfac_norm(max_norm, tagged: Callable | None):
  """Scales `v` by `clip_coefficient(v, g, max_norm)`, g the raw gradient (`kfac_grads=`); with
  `tagged` (`params -> registration`), in the tagged loss's metric (v and g over the loss factor
  c: `max_norm · c`)."""

  def update_fn(updates, state, params=None, *, kfac_grads, **extra_args):
    del extra_args
    r = max_norm if tagged is None else max_norm * (tagged(params).loss_factor or 1.0)
    coeff = clip_coefficient(updates, kfac_grads, r)
    return jax.tree_util.tree_map(lambda x: x * coeff.astype(x.dtype), updates), state

  return optax.GradientTransformationExtraArgs(lambda _: optax.EmptyState(), update_fn)


# A learning rate over `kfac`'s default for the loss outside [_FAR_BELOW, _FAR_ABOVE] is far
# from those measured: the benchmark models train between 1/6 and 3 times the default.
_FAR_BELOW, _FAR_ABOVE = 1e-3, 30.0


def _report_far_learning_rate(reporter: _engine.Reporter, reg, value, step=None) -> None:
  """A `HyperparameterWarning` (once per front, by `reporter`) when the learning rate `value`
  (its value at schedule count `step`; None for a number) over `kfac`'s default for the
  registration `reg` (`default_learning_rate / c`) is outside [_FAR_BELOW, _FAR_ABOVE]."""
  c = reg.loss_factor or 1.0
  default = default_learning_rate(reg) / c
  value = float(np.asarray(value).ravel()[0])
  ratio = value / default
  if _FAR_BELOW <= ratio <= _FAR_ABOVE:
    return
  at = "" if step is None else f" (its value at step {int(np.asarray(step).ravel()[0])})"
  reporter.once(
    "range:learning_rate",
    f"{reporter.who}: learning_rate={value:g}{at} is {ratio:.3g} times the default for this "
    f"loss, 0.3 · D^(1/4) / c = {default:.3g} (D = {reg.outputs_per_example} outputs per "
    f"example, c = {c:g} the returned loss over the tagged one). The benchmark models train "
    f"between 1/6 and 3 times the default; beyond {_FAR_ABOVE:g} times it a step overshoots, "
    f"below {_FAR_BELOW:g} times it barely moves. Pass learning_rate=None for the default. "
    "This warning is given once.",
    _errors.HyperparameterWarning,
  )


def _far_learning_rate(reporter: _engine.Reporter, registration_for: Callable) -> Callable:
  """`check(params, value, count)` for `scale_by_learning_rate`: reports a learning rate far
  from `kfac`'s default (`_report_far_learning_rate`): a number at once, a traced value from the
  host on the step that gives it (a `lax.cond` that runs nothing in range)."""

  def check(params, value, count) -> None:
    reg = registration_for(params)
    if isinstance(value, (int, float)):
      _report_far_learning_rate(reporter, reg, value)
      return
    ratio = jnp.asarray(value) / (default_learning_rate(reg) / (reg.loss_factor or 1.0))
    reporter.when_bad(
      (ratio >= _FAR_BELOW) & (ratio <= _FAR_ABOVE),
      lambda v, n: _report_far_learning_rate(reporter, reg, v, n),
      value,
      count,
    )

  return check


def scale_by_learning_rate(learning_rate, default: Callable, check: Callable | None = None):
  """`u ← −α u`, α at the schedule's count `kfac_count=`; α None: `default(params)`. Multiplied
  in at least float32, cast back to the update's dtype. `check(params, α, count)` (optional)
  looks at a given α: a number at `init`, a schedule's or an injected value in each update."""

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
    return jax.tree_util.tree_map(
      lambda x: (x.astype(jnp.promote_types(x.dtype, jnp.float32)) * -step).astype(x.dtype),
      updates,
    ), state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


_LINESEARCHES = (
  "optax.scale_by_backtracking_linesearch(...), optax.scale_by_zoom_linesearch(...) or "
  "kfac_jax.pinn.grid_linesearch()"
)


def _check_linesearch(linesearch, who: str) -> None:
  """TypeError unless `linesearch` is a line search: a transformation whose state keeps the
  step it chose as a `learning_rate` field (optax's line searches and the grid search do, and
  `optax.tree_utils.tree_get(state, "learning_rate")` reads it), read from its init on a
  stand-in params (shapes only: nothing runs). An optimizer such as `optax.adam` has none."""
  if not isinstance(linesearch, optax.GradientTransformation):
    raise TypeError(
      f"{who}: `linesearch` must be an optax line search such as {_LINESEARCHES}, got "
      f"{type(linesearch).__name__}: {linesearch!r}."
    )
  state = jax.eval_shape(linesearch.init, {"w": jax.ShapeDtypeStruct((2,), jnp.float32)})
  fields = optax.tree_utils.tree_get_all_with_path(state, "learning_rate")
  if not any(not isinstance(path[-1], jax.tree_util.DictKey) for path, _ in fields):
    raise TypeError(
      f"{who}: `linesearch` must be a line search, which picks the step along the "
      "preconditioned direction from `value_fn` and keeps it in its state's `learning_rate` "
      f"field: {_LINESEARCHES}. Got a transformation whose state ({type(state).__name__}) has "
      "no such field, so it would replace the learning rate with its own update rule. For a "
      "fixed or scheduled step pass `learning_rate=`; to run another optimizer on the "
      "preconditioned direction, chain it after the bare preconditioner "
      "(`kfac_jax.scale_by_kfac`, `kfac_jax.scale_by_kernel_ngd`)."
    )


def _scalar_value_fn(value_fn: Callable) -> Callable:
  """`value_fn` checked to return one scalar where a line search traces it (its signature is
  kept: optax's line searches read it to pick `value_fn`'s keyword arguments)."""

  @functools.wraps(value_fn)
  def checked(*args, **kwargs):
    out = value_fn(*args, **kwargs)
    if isinstance(out, (tuple, list)) or jnp.shape(out) != ():
      got = (
        f"a {type(out).__name__} of {len(out)} values"
        if isinstance(out, (tuple, list))
        else f"an array of shape {jnp.shape(out)}"
      )
      raise TypeError(
        f"the line search's `value_fn` must return the scalar loss, got {got}. A `loss_fn` "
        "returning `(loss, aux)` is passed as `value_fn=lambda params: loss_fn(params, "
        "batch)[0]`."
      )
    return out

  return checked


def check_step_size(learning_rate, linesearch, who: str) -> None:
  """A learning rate (a number > 0 or a schedule) or a line search (`_check_linesearch`), not
  both."""
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
  """`u ← η (−m)`, η picked by `linesearch` (an optax line search) along the descent direction
  −m; it reads `value=`, `grad=`, `value_fn=` (and `value_fn`'s keyword arguments) from the
  update's extra arguments, never the chain's own `kfac_grads=` / `kfac_count=`."""

  def update_fn(updates, state, params=None, *, kfac_grads, kfac_count, **extra_args):
    del kfac_grads, kfac_count
    value = extra_args.get("value")
    if isinstance(value, (tuple, list)) or (value is not None and jnp.shape(value) != ()):
      raise TypeError(
        "the line search's `value=` must be the scalar loss at `params`, got "
        f"{type(value).__name__} {jax.tree_util.tree_map(jnp.shape, value)}; with `has_aux`, "
        "pass the loss of `(loss, aux)`."
      )
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
  """K-FAC with a fixed (or scheduled) learning rate, norm clipping and momentum.

  `scale_by_kfac`, then clip → `optax.trace` → learning rate, under the step's verdict:
  `u = −α m`, `m ← v + μ m` (Nesterov's with `Config.nesterov`), v the preconditioned gradient
  clipped to length `max_norm` in the damped K-FAC metric (`clip_coefficient`) before α, as
  `optax.clip_by_global_norm` before `optax.scale`: a step's length there is at most
  `α · max_norm`. Schedules are called with every update seen (`count + skipped`): a value that
  is not finite skips its update. The defaults come from step sweeps on the benchmark models.

  Args:
    loss_fn, example_batch, damping, ema_decay, inverse_every, registration, axis_name, config:
      as in `scale_by_kfac`.
    learning_rate: α > 0, a number or a schedule `count -> α`; None takes
      `default_learning_rate` on the tagged loss's scale (divided by its `loss_factor`), so a
      loss averaged over its D outputs takes the summed one's steps. An α more than 30 times
      that or below 1/1000 of it gives one `HyperparameterWarning` (at construction with
      `registration=`, else at `init`; a schedule's value on its step): the benchmark models
      train between 1/6 and 3 times it, and the bounds sit a decade and more beyond.
    momentum: μ in [0, 1) for heavy-ball momentum on the preconditioned update, or None.
    max_norm: r > 0, the largest length `√|vᵀg|` of v in the damped metric before α, or None
      (no clipping); on a share of the parameters, of the share's. TF K-FAC's and the
      `Optimizer`'s `norm_constraint=C` bounds the step after α: `max_norm=√C / α`.
    curvature_every: as in `scale_by_kfac`, but 5 by default: the clipping bounds a step that
      statistics up to 4 updates old precondition (without clipping, prefer 1).
    linesearch: an optax line search (`optax.scale_by_backtracking_linesearch(...)`,
      `optax.scale_by_zoom_linesearch(...)`) in place of α (`learning_rate` None): the step is
      `η (−m)`, η its choice; `update` then also takes its `value=`, `grad=` and `value_fn=`
      (and `value_fn`'s keyword arguments), as in `optax.lbfgs`. A transformation whose state
      keeps no step `learning_rate` (an optimizer such as `optax.adam`) is refused.

  Returns:
    An `optax.GradientTransformationExtraArgs` with state `KfacState`; `update` takes
    `scale_by_kfac`'s extra arguments and those of `linesearch`.

  Raises:
    TypeError / ValueError: a bad argument, named with the value received, before any state
      is created; a `Config` field it does not read.

  Example:
    >>> tx = kfac_jax.kfac(loss_fn, batch)
    >>> opt_state = tx.init(params)
    >>> loss, grads, stats = kfac_jax.value_and_grad(loss_fn)(params, batch, rng)
    >>> updates, opt_state = tx.update(grads, opt_state, params, curvature_stats=stats)
    >>> params = optax.apply_updates(params, updates)
  """
  check_step_size(learning_rate, linesearch, "kfac")
  if momentum is not None:
    _checks.number(momentum, "momentum", low=0.0, high=1.0, high_open=True)
  if max_norm is not None:
    _checks.number(max_norm, "max_norm", low=0.0, low_open=True)
  _checks.number(damping, "damping", low=0.0, schedule=True)
  engine = _engine.Engine.kfac(
    "kfac",
    (loss_fn, example_batch, registration),
    _engine.Schedule.checked(ema_decay, inverse_every, curvature_every),
    axis_name=axis_name,
    config=config,
    state_type=KfacState,
    transform=True,
  )

  def registration_for(params) -> _registration.Registration:
    return engine.bind(params).registration

  def tagged_step(params) -> float:  # The tagged loss's step: the default over the factor c.
    reg = registration_for(params)
    return default_learning_rate(reg) / (reg.loss_factor or 1.0)

  if registration is not None and isinstance(learning_rate, (int, float)):
    _report_far_learning_rate(engine.reporter, registration, learning_rate)

  rest = optax.chain(
    optax.identity()
    if max_norm is None
    else _clip_by_kfac_norm(max_norm, registration_for if learning_rate is None else None),
    optax.identity()
    if momentum is None
    else optax.trace(momentum, nesterov=engine.config.nesterov),
    scale_by_learning_rate(
      learning_rate, tagged_step, _far_learning_rate(engine.reporter, registration_for)
    )
    if linesearch is None
    else along_linesearch(linesearch),
  )
  hyperparameters = {
    "damping": (damping, 0.0),
    "learning_rate": (learning_rate, 0.0),
    "momentum": (momentum, None),
    "max_norm": (max_norm, None),
  }
  return transformation(engine, hyperparameters, kfac_statistics, rest, ScaleByKfacState)
