"""K-FAC as optax gradient transformations.

`scale_by_kfac` is the bare preconditioner (updates ← F̂_λ⁻¹ · updates); `kfac` is the chain of
`scale_by_kfac`, K-FAC norm clipping, heavy-ball momentum (`optax.trace`) and the learning rate,
under a guard. All curvature state (factors, inverses, counters) is in the optax state, and the
step is `kfac_jax._engine.step` inside the caller's `jit`/`pmap`: the program compiles once and
never syncs with the host.

Both skip a non-finite update by default (`Config.skip_nonfinite`): when the incoming gradient,
this batch's curvature statistics or the preconditioned update has a NaN or ±Inf, the returned
updates are zeros and the state is left as it was, apart from the `skipped` counter (and the
estimator's `skipped_batches` when the statistics alone were non-finite). For `kfac` the guard
spans the whole chain, so the momentum trace is kept too, and it also requires finite
hyperparameters (an injected or scheduled learning rate, momentum or `max_norm`). The curvature
moves only on a finite gradient, finite hyperparameters and finite statistics; a preconditioned
update that overflows from finite inputs is skipped, but the curvature keeps that batch's
(finite) statistics, so the guard never holds on to the old factors.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from kfac_jax import (
  _checks,
  _config,
  _engine,
  _estimator,
  _fronts,
  _registration,
  _storage,
)

Array = jax.Array
ScalarOrSchedule = float | Array | Callable[[Array], Array]


class ScaleByKfacState(NamedTuple):
  """State of `scale_by_kfac`.

  Attributes:
    count: `[]` int32, updates applied so far (skipped ones not counted): the statistics' and
      inverses' periods count it. Schedules are called with `count + skipped`, every update
      seen, so a schedule that returns a non-finite value at one step moves past it instead of
      stalling training.
    curvature: the estimator's factors, caches and EMA weight.
    skipped: `[]` int32, updates skipped because the gradient, the statistics or the update
      were not finite (`Config.skip_nonfinite`).
  """

  count: Array  # type: ignore[assignment]  # optax's field name; shadows tuple.count
  curvature: _estimator.EstimatorState
  skipped: Array


class KfacState(NamedTuple):
  """State of `kfac`: the states of its chain (clipping and the learning rate keep none).

  Attributes:
    preconditioner: the `scale_by_kfac` state (first, so `state[0]` is it, as in a chain): the
      learning-rate and damping schedules are called with its `count + skipped`, and its
      `skipped` counts skipped updates.
    momentum: `optax.TraceState` (the heavy-ball trace, params-shaped and -typed) with
      `momentum`, else `optax.EmptyState`.
  """

  preconditioner: ScaleByKfacState
  momentum: optax.TraceState | optax.EmptyState


def auto_stride(n: int) -> int:
  """The row stride of `statistics_fraction="auto"` for a batch of n rows: every fourth row from
  256 rows, every second from 128, else every row, so the statistics keep at least 64 examples.

  A quarter of the rows reached Adam's loss sooner on the CNN and autoencoder races at a
  cheaper step, while a small batch's statistics get too noisy; strides that are powers of two
  keep the rows on their devices for a batch sharded over a power-of-two number of devices.
  """
  return 4 if n >= 256 else 2 if n >= 128 else 1


def _row_plan(fraction, batch, who: str, *, strict: bool) -> tuple[int, int] | None:
  """`(rows, stride)` of the statistics' rows of `batch` (`x[: rows * stride : stride]` along
  every leaf's leading axis), or None for every row. `strict`: a batch whose leaves do not
  share one leading axis raises (an explicit fraction); otherwise it keeps every row."""
  if fraction == 1:
    return None
  flat = jax.tree_util.tree_flatten_with_path(batch)[0]
  sized = [(path, x) for path, x in flat if jnp.ndim(x) >= 1]
  if not sized:
    if not strict:
      return None
    raise ValueError(
      f"{who}: statistics_fraction={fraction!r} takes rows of every `batch=` leaf, "
      "but no leaf has a leading axis."
    )
  n = jnp.shape(sized[0][1])[0]
  for path, x in sized[1:]:
    if jnp.shape(x)[0] != n:
      if not strict:
        return None
      raise ValueError(
        f"{who}: statistics_fraction={fraction!r} takes the same rows of every `batch=` "
        f"leaf, so their leading axes must agree: `batch{jax.tree_util.keystr(sized[0][0])}` "
        f"has {n} rows, `batch{jax.tree_util.keystr(path)}` has {jnp.shape(x)[0]}. Pass "
        "statistics_fraction=None and slice the batch yourself."
      )
  if fraction == "auto":
    stride = auto_stride(n)
    return None if stride == 1 else (-(-n // stride), stride)
  rows = max(1, math.ceil(fraction * n))
  return rows, n // rows


def _cut(batch, plan: tuple[int, int] | None):
  """`batch` at the rows of `plan` (from `_row_plan`; None: the whole batch). A strided slice,
  not the first rows: a batch sharded over devices keeps its rows on every device, and an
  ordered batch contributes from every block."""
  if plan is None:
    return batch
  rows, stride = plan
  return jax.tree_util.tree_map(
    lambda x: x[: rows * stride : stride] if jnp.ndim(x) >= 1 else x, batch
  )


def _batch_statistics(est: _estimator.Estimator, fraction, params, batch, rng, who: str):
  """This batch's statistics from the rows `fraction` picks (see `Config.statistics_fraction`).

  "auto" tries the cut batch at trace time only: a batch with a leaf that is not per-example,
  a model whose shapes follow the batch size, or a loss whose examples are not the leaves'
  leading axis falls back to the whole batch (the abandoned trace leaves nothing in the
  compiled step). An explicit fraction raises instead, with a note on the cause.
  """
  if fraction == 1:
    return est.curvature_stats(params, batch, rng)
  if fraction == "auto":
    plan = _row_plan(fraction, batch, who, strict=False)
    if plan is not None:
      try:
        stats = est.curvature_stats(params, _cut(batch, plan), rng)
      except Exception:  # noqa: BLE001
        # Any error on the cut batch (Flax's parameter-shape errors are not ValueErrors); a
        # real one comes back from the whole batch's trace below.
        stats = None
      if stats is not None and stats.batch_size == plan[0]:
        return stats
    return est.curvature_stats(params, batch, rng)
  rows = _cut(batch, _row_plan(fraction, batch, who, strict=True))
  try:
    return est.curvature_stats(params, rows, rng)
  except (TypeError, ValueError) as e:
    # A note, not a new exception: JAX's own TypeErrors take a tracer, not a message.
    e.add_note(
      "(The statistics came from a subset of the rows of every `batch=` leaf: "
      f"statistics_fraction={fraction!r}. Every leaf with a leading axis must be per-example; "
      "otherwise pass statistics_fraction=None and slice the batch yourself.)"
    )
    raise


def _check_state(state, est: _estimator.Estimator, who: str) -> None:
  if not isinstance(state, ScaleByKfacState):
    raise TypeError(
      f"{who}: `state` must be the ScaleByKfacState from this transform's init, got "
      f"{type(state).__name__}."
    )
  factors = getattr(state.curvature, "factors", {})
  # A sharded state's buffers are checked against the layout by the storage.
  got = tuple(factors) if isinstance(factors, dict) else tuple(est.names)
  if sorted(got) != sorted(est.names):
    raise ValueError(
      f"{who}: `state` holds the curvature of the layers {list(got)}, but this transform has "
      f"the layers {list(est.names)}: it is another model's state (or another share's). Pass "
      "the state this transform's init returned."
    )


def _preconditioner(
  loss_fn,
  example_batch,
  *,
  damping,
  ema_decay,
  inverse_every,
  curvature_every,
  registration,
  axis_name,
  config,
  who: str,
) -> tuple[optax.GradientTransformationExtraArgs, _fronts.Source]:
  """`scale_by_kfac` named `who` in its errors, and where its estimator comes from."""
  config = _config.get(config, who)
  _checks.number(damping, "damping", low=0.0, schedule=True)
  _checks.number(ema_decay, "ema_decay", low=0.0, high=1.0, high_open=True)
  _checks.positive_int(inverse_every, "inverse_every")
  _checks.positive_int(curvature_every, "curvature_every")
  _config.check_parallel(axis_name, config)
  config.refuse(
    who,
    ("min_damping", "max_damping", "damping_adaptation_interval", "damping_adaptation_decay"),
    "only the Optimizer adapts the damping",
  )
  config.refuse(who, ("weight_decay",), "chain optax.add_decayed_weights for weight decay")
  source = _fronts.for_front(loss_fn, example_batch, registration, config, who)
  mesh, guard, fraction = config.mesh, config.skip_nonfinite, config.fraction

  def init_fn(params) -> ScaleByKfacState:
    est, _ = _fronts.estimator_for(source, params, who, axis_name)
    # Distinct arrays: a state whose leaves share one buffer cannot be donated.
    return ScaleByKfacState(
      count=jnp.zeros([], jnp.int32),
      curvature=est.init(axis_name=axis_name, mesh=mesh),
      skipped=jnp.zeros([], jnp.int32),
    )

  def update_fn(
    updates,
    state: ScaleByKfacState,
    params=None,
    *,
    curvature_stats=None,
    batch=None,
    rng=None,
    kfac_gate=None,
    **extra_args,
  ):
    del extra_args  # Other transforms' extra arguments (optax.chain forwards them all).
    if params is None:
      raise ValueError(f"{who}: `params` is required: tx.update(grads, state, params, ...).")
    est, kept = _fronts.estimator_for(source, params, who)
    _check_state(state, est, who)
    if kept is not None:
      if _fronts.masked_share(updates) != kept:
        raise ValueError(
          f"{who}: `updates` and `params` must be the same share of the parameters "
          "(the same optax.MaskedNode leaves)."
        )
      if curvature_stats is None:
        raise ValueError(
          f"{who}: `params` has optax.MaskedNode leaves (optax.multi_transform or "
          "optax.masked hands this transform only its share of the parameters), so it cannot "
          "trace the model on `batch=`: pass `curvature_stats=` from "
          "kfac_jax.value_and_grad(registration=reg)(params, batch, rng) on the whole params."
        )
    if curvature_stats is None and batch is None:
      raise ValueError(
        f"{who}: pass `curvature_stats=` (from kfac_jax.value_and_grad) or "
        "`batch=` (and `rng=`) to tx.update, so the curvature can be estimated."
      )
    count = state.count
    clock = count + state.skipped  # Every update seen: what the schedules are called with.
    ok = None
    if guard:
      ok = _storage.all_finite(updates)
      if kfac_gate is not None:
        ok = ok & kfac_gate

    def statistics():
      if curvature_stats is not None:
        return curvature_stats
      return _batch_statistics(est, fraction, params, batch, rng, who)

    vector = updates if kept is None else _fronts.fill(est, updates)
    pre, curv, ok = _engine.step(
      est,
      state.curvature,
      vector,
      statistics,
      count,
      damping=damping(clock) if callable(damping) else damping,
      ema_decay=ema_decay,
      inverse_every=inverse_every,
      curvature_every=curvature_every,
      burn_in_steps=config.burn_in_steps,
      ok=ok,
      axis_name=axis_name,
      mesh=mesh,
    )
    if kept is not None:  # The masked leaves' zeros pass through no block; XLA drops them.
      pre = _fronts.unfill(pre, updates)
    if ok is None:
      return pre, ScaleByKfacState(optax.safe_increment(count), curv, state.skipped)
    out = jax.tree_util.tree_map(lambda u: jnp.where(ok, u, jnp.zeros_like(u)), pre)
    return out, ScaleByKfacState(
      count=count + ok.astype(count.dtype),
      curvature=curv,
      skipped=state.skipped + (~ok).astype(state.skipped.dtype),
    )

  return optax.GradientTransformationExtraArgs(init_fn, update_fn), source


@_config.moved_keywords
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
  `CurvatureEstimator`), averaged with a bias-corrected EMA of the statistics of every
  `curvature_every`-th update; its inverse is refreshed every `inverse_every` updates (both
  first at update 0) with the current damping λ.

  Args:
    loss_fn: `loss_fn(params, batch) -> scalar` with a loss tag on the model output.
    example_batch: a batch of the training shapes; `init` scans `loss_fn` with it.
    damping: λ ≥ 0, a number or a schedule `count -> λ` (0.1; see `kfac_jax.Config` for why the
      `Optimizer`'s default differs).
    ema_decay: decay of the statistics' moving average, in [0, 1) (0 keeps the newest batch).
    inverse_every: refresh the inverses every this many updates.
    curvature_every: fold the curvature statistics into the EMA every this many updates (1
      here: without `kfac`'s clipping, stale statistics let some models diverge at a fixed
      learning rate). Above 1 the factors' products (the bulk of the statistics' cost) are
      formed on due updates only, and with `batch=` the statistics' passes too.
    registration: a `kfac_jax.Registration` instead of `loss_fn` and `example_batch`, shared
      with `kfac_jax.value_and_grad(registration=...)`: both then use its layers, mode and
      samples (the config's registration fields must then agree with it).
    axis_name: inside `pmap` / `shard_map`: average the statistics over this axis, and split
      the inverse work over it (each device factorises its share of the blocks, balanced by
      cost; with sharded storage each keeps only its share).
    config: a `kfac_jax.Config` with the rare knobs (estimation mode, dtypes, inverse storage,
      `mesh`, `statistics_fraction`, burn-in, the non-finite guard, ...).

  With `optax.inject_hyperparams`, declare the non-numeric arguments static (optax treats any
  callable as a schedule): `optax.inject_hyperparams(kfac_jax.scale_by_kfac,
  static_args=("loss_fn", "example_batch"))(loss_fn=..., example_batch=..., damping=1e-3)`;
  `damping`, `ema_decay` and `inverse_every` can then change between steps without a recompile.

  Inside `optax.multi_transform` / `optax.masked` (params with `optax.MaskedNode` leaves), pass
  `registration=` built from the whole params and `curvature_stats=`: the state then holds only
  the blocks of the share, and every layer must lie wholly inside or outside it.

  Returns:
    An `optax.GradientTransformationExtraArgs` with state `ScaleByKfacState`. Its
    `update(updates, state, params, *, curvature_stats=None, batch=None, rng=None,
    kfac_gate=None)` needs `params`, and either `curvature_stats` from
    `kfac_jax.value_and_grad` (one forward pass for everything) or `batch` and `rng` (an extra
    forward and backward pass). `kfac_gate`, a scalar bool, skips the update when False (as a
    non-finite gradient would).

  Raises:
    TypeError / ValueError: a bad argument, named with the value received, before any state
      is created (e.g. `damping="1e-3"`: "`damping` must be a finite number >= 0 or a
      schedule `count -> value`, got '1e-3' (str)"); a keyword that moved into `Config`,
      naming its place. In `update` (when traced, before any state changes): params of another
      structure than at `init` (the first differing leaf named), a state of another model, or
      `curvature_stats` of another estimation mode, sample count or layer set (both named).

  Example:
    >>> tx = optax.chain(kfac_jax.scale_by_kfac(loss_fn, batch, damping=1e-3),
    ...                  optax.scale_by_learning_rate(0.1))
    >>> opt_state = tx.init(params)
    >>> loss, grads, stats = kfac_jax.value_and_grad(loss_fn)(params, batch, rng)
    >>> updates, opt_state = tx.update(grads, opt_state, params, curvature_stats=stats)
  """
  return _preconditioner(
    loss_fn,
    example_batch,
    damping=damping,
    ema_decay=ema_decay,
    inverse_every=inverse_every,
    curvature_every=curvature_every,
    registration=registration,
    axis_name=axis_name,
    config=config,
    who="scale_by_kfac",
  )[0]


def clip_coefficient(preconditioned, grads, max_norm) -> Array:
  """`min(1, r / √|vᵀg|)`: the scale that keeps `v`'s norm in the damped K-FAC metric ≤ `r`.

  With `v = F̂_λ⁻¹ g` the preconditioned gradient, `vᵀ F̂_λ v = vᵀ g`, so `√|vᵀg|` is `v`'s
  length in the metric that preconditioned it (half its squared length approximates the KL
  divergence of the step `v`). 1 when `vᵀg = 0`; the inner product is accumulated in at least
  float32. `r = max_norm`.
  """
  vg = jnp.abs(jnp.asarray(_engine.tree_vdot(preconditioned, grads)))
  r2 = jnp.square(jnp.asarray(max_norm, vg.dtype))
  big = vg > r2
  return jnp.where(big, jnp.sqrt(r2 / jnp.where(big, vg, 1)), jnp.ones_like(vg))


def default_learning_rate(registration: _registration.Registration) -> float:
  """`kfac`'s learning rate when none is given: `0.3 · D^(1/4)`, D the registration's
  `outputs_per_example`.

  The clipped step's length in the K-FAC metric, `α · max_norm`, is a budget per example; a loss
  that sums D outputs per example spreads it over D terms, and D^(1/4), between a budget per
  example (D^0) and one per output (D^(1/2), which overshot), fitted the step sweeps of both
  kinds of loss.
  """
  return 0.3 * registration.outputs_per_example**0.25


def _scale(updates, step):
  """`−step · u`, multiplied in at least float32 and cast back (bfloat16 params keep bfloat16
  updates)."""
  return jax.tree_util.tree_map(
    lambda x: (x.astype(jnp.promote_types(x.dtype, jnp.float32)) * -step).astype(x.dtype),
    updates,
  )


def _guard(
  preconditioner: optax.GradientTransformationExtraArgs,
  max_norm,
  mu,
  momentum: optax.GradientTransformation,
  learning_rate,
  skip_nonfinite: bool,
  source: _fronts.Source,
) -> optax.GradientTransformationExtraArgs:
  """The K-FAC-aware guard over the chain `preconditioner → clip by max_norm → momentum →
  learning rate` (optax's `apply_if_finite` is the pattern).

  It gates the preconditioner on finite hyperparameters (`kfac_gate`: the learning rate at
  this step, the momentum and `max_norm` when they are not Python numbers), reads the
  preconditioner's verdict from its `skipped` counter, and runs the rest of the chain in a
  `lax.cond` on it: a skipped update returns zeros and keeps the momentum trace. It never
  selects over the preconditioner's state, whose curvature moved only on a finite verdict (see
  `kfac_jax._engine`), so no copy of the factors is kept for it.

  Without a learning rate (None) it is `default_learning_rate` of the registration,
  and the clipping and the step are those of the tagged loss: `v` and `g` are divided by the
  registration's `loss_factor` c (the returned loss over the tagged one) before the clip.
  """

  def init_fn(params) -> KfacState:
    return KfacState(preconditioner.init(params), momentum.init(params))

  def update_fn(
    updates,
    state: KfacState,
    params=None,
    *,
    curvature_stats=None,
    batch=None,
    rng=None,
    **extra_args,
  ):
    if not isinstance(state, KfacState):
      raise TypeError(
        f"kfac: `state` must be the KfacState from this transform's init, got "
        f"{type(state).__name__}."
      )
    old = state.preconditioner
    clock = old.count + old.skipped
    lr = learning_rate(clock) if callable(learning_rate) else learning_rate
    scalars = [x for x in (lr, mu, max_norm) if x is not None]
    scalars = [x for x in scalars if not isinstance(x, (int, float))]
    gate = None
    if skip_nonfinite and scalars:
      gate = jnp.all(jnp.stack([jnp.isfinite(jnp.asarray(x, jnp.float32)) for x in scalars]))
    v, pre = preconditioner.update(
      updates,
      old,
      params,
      curvature_stats=curvature_stats,
      batch=batch,
      rng=rng,
      kfac_gate=gate,
      **extra_args,
    )
    unit = 1.0  # 1/c: the returned loss's gradient on the tagged loss's scale.
    if learning_rate is None:  # A Python number: the gate above needs no check of it.
      reg = _fronts.estimator_for(source, params, "kfac")[0].registration
      lr = default_learning_rate(reg)
      unit = 1.0 / (reg.loss_factor or 1.0)

    def run():
      u, g = v, updates
      if unit != 1.0:
        u, g = (jax.tree_util.tree_map(lambda x: x * jnp.asarray(unit, x.dtype), t) for t in (u, g))
      if max_norm is not None:
        coeff = clip_coefficient(u, g, max_norm)
        u = jax.tree_util.tree_map(lambda x: x * coeff.astype(x.dtype), u)
      u, trace = momentum.update(u, state.momentum, params)
      return _scale(u, lr), trace

    if not skip_nonfinite:
      out, trace = run()
    else:
      out, trace = jax.lax.cond(
        pre.skipped == old.skipped,
        run,
        lambda: (jax.tree_util.tree_map(jnp.zeros_like, v), state.momentum),
      )
    return out, KfacState(pre, trace)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


@_config.moved_keywords(
  refused={
    "norm_constraint": (
      "kfac: `norm_constraint` is not an argument of kfac (got {!r}); use `max_norm`, which "
      "clips the preconditioned gradient before the learning rate, so that α always scales the "
      "step. For a fixed learning rate α, TF K-FAC's norm_constraint=C is max_norm=√C / α."
    )
  }
)
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
) -> optax.GradientTransformationExtraArgs:
  """K-FAC with a fixed (or scheduled) learning rate, norm clipping and momentum.

  The chain `scale_by_kfac → clip → optax.trace → learning rate` under a guard: the update is
  `u = −α · m`, with `v = (F̂ + λ)⁻¹ g` from `scale_by_kfac`, clipped to length `r = max_norm` in
  the damped K-FAC metric, `v ← v · min(1, r / √|vᵀg|)` (see `clip_coefficient`), and `m` the
  heavy-ball trace `m ← v + μ m` with `momentum=μ` (`m = v` without momentum; Nesterov's with
  `Config.nesterov`). As with `optax.clip_by_global_norm` before `optax.scale`, the clipping
  comes before the learning rate, so α scales every step and the step's length in the metric is
  at most `α r` (before momentum). α and λ schedules are called with the number of applied (not
  skipped) updates. `optax.inject_hyperparams(kfac_jax.kfac, static_args=("loss_fn",
  "example_batch"))` can inject any numeric argument and change it between steps without a
  recompile. A schedule is called with every update seen (`count + skipped`), so one that
  returns a non-finite value at one step skips that update and moves on.

  Args:
    loss_fn: `loss_fn(params, batch) -> scalar` with a loss tag on the model output.
    example_batch: a batch of the training shapes; `init` scans `loss_fn` with it.
    learning_rate: α > 0, a number or a schedule `count -> α`; None (the default) takes
      `0.3 · D^(1/4)` for a loss with D outputs per example (`default_learning_rate`) and
      steps on the tagged loss's scale (the gradient divided by the registration's
      `loss_factor`), so a loss averaged over its D outputs takes the summed one's steps.
    momentum: μ in [0, 1) for heavy-ball momentum on the preconditioned update, or None.
    max_norm: r > 0, the largest length `√(vᵀ F̂_λ v) = √|vᵀg|` of the preconditioned
      gradient before α and momentum, or None (no clipping). TF K-FAC's and `Optimizer`'s
      `norm_constraint=C` bounds the step after the learning rate; for a fixed α it is
      `max_norm=√C / α`.
    damping: λ, as in `scale_by_kfac`.
    ema_decay, inverse_every: as in `scale_by_kfac`.
    curvature_every: as in `scale_by_kfac`, but 5 by default: the clipping bounds a step that
      statistics up to 4 updates old precondition. With `max_norm=None` and small damping
      prefer 1.
    registration, axis_name, config: as in `scale_by_kfac`.

  The defaults (`momentum=0.7`, `max_norm=0.3`, `damping=0.1`, `curvature_every=5` and the
  learning rate) come from step sweeps on the autoencoder, CNN, Transformer, ViT and LSTM
  benchmarks; without clipping, fixed-learning-rate K-FAC diverged on three of them at
  λ = 1e-3.

  On a share of the parameters (`optax.multi_transform`, see `scale_by_kfac`), `max_norm`
  clips by the norm of the share's update alone.

  Returns:
    An `optax.GradientTransformationExtraArgs` with state `KfacState`; `update` takes the
    same extra arguments as `scale_by_kfac`'s.

  Raises:
    TypeError / ValueError: a bad argument, named with the value received, before any state
      is created; a keyword that moved into `Config`, naming its place.

  Example:
    >>> tx = kfac_jax.kfac(loss_fn, batch)
    >>> opt_state = tx.init(params)
    >>> loss, grads, stats = kfac_jax.value_and_grad(loss_fn)(params, batch, rng)
    >>> updates, opt_state = tx.update(grads, opt_state, params, curvature_stats=stats)
    >>> params = optax.apply_updates(params, updates)
  """
  if learning_rate is not None:
    _checks.number(learning_rate, "learning_rate", low=0.0, low_open=True, schedule=True)
  if momentum is not None:
    _checks.number(momentum, "momentum", low=0.0, high=1.0, high_open=True)
  if max_norm is not None:
    _checks.number(max_norm, "max_norm", low=0.0, low_open=True)
  cfg = _config.get(config, "kfac")
  preconditioner, source = _preconditioner(
    loss_fn,
    example_batch,
    damping=damping,
    ema_decay=ema_decay,
    inverse_every=inverse_every,
    curvature_every=curvature_every,
    registration=registration,
    axis_name=axis_name,
    config=cfg,
    who="kfac",
  )
  trace = (
    optax.identity() if momentum is None else optax.trace(decay=momentum, nesterov=cfg.nesterov)
  )

  return _guard(
    preconditioner, max_norm, momentum, trace, learning_rate, cfg.skip_nonfinite, source
  )
