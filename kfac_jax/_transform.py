"""K-FAC as optax gradient transformations.

`scale_by_kfac` is the bare preconditioner (updates ← F̂_λ⁻¹ · updates), `kfac` adds norm
clipping, heavy-ball momentum and a learning rate. All curvature state (factors, inverses,
counters) is in the optax state; everything happens inside the caller's `jit`/`pmap`: the
periodic inverse update is a `lax.cond` on the step counter, so the program compiles once and
never syncs with the host.

Both skip a non-finite update by default (`skip_nonfinite=True`): when the incoming gradient,
this batch's curvature statistics or the outgoing update has a NaN or ±Inf, the returned
updates are zeros and the state is left as it was, apart from the `skipped` counter (and the
estimator's `skipped_batches` when the statistics alone were non-finite). For `kfac` the
guard spans the whole chain, so the momentum trace is kept too. The curvature moves only on
a finite gradient, finite hyperparameters and finite statistics; an update that overflows to
non-finite from finite inputs and curvature is skipped, but the curvature keeps that batch's
statistics (they are finite, and the guard need not keep the old factors alive, which cost a
copy of them on every step).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import optax

from kfac_jax import (
  _checks,
  _curvature,
  _engine,
  _estimator,
  _layer_config,
  _parallel,
  _registration,
)
from kfac_jax import blocks as _blocks

Array = jax.Array
ScalarOrSchedule = float | Array | Callable[[Array], Array]


class ScaleByKfacState(NamedTuple):
  """State of `scale_by_kfac`.

  Attributes:
    count: `[]` int32, updates applied so far (skipped ones not counted); schedules are called
      with it.
    curvature: the estimator's factors, caches and EMA weight.
    skipped: `[]` int32, updates skipped because the gradient, the statistics or the update
      were not finite (`skip_nonfinite=True`).
  """

  count: Array  # type: ignore[assignment]  # optax's field name; shadows tuple.count
  curvature: _estimator.EstimatorState
  skipped: Array


class KfacState(NamedTuple):
  """State of `kfac`.

  Attributes:
    preconditioner: the `scale_by_kfac` state (first, so `state[0]` is it, as in a chain): its
      `count` drives the learning-rate and damping schedules, its `skipped` counts skipped
      updates.
    momentum: `optax.TraceState` (the heavy-ball trace, params-shaped and -typed) with
      `momentum`, else `optax.EmptyState`.
  """

  preconditioner: ScaleByKfacState
  momentum: optax.TraceState | optax.EmptyState


def _check_args(
  *,
  loss_fn,
  has_aux,
  damping,
  ema_decay,
  inverse_every,
  curvature_every,
  statistics_fraction,
  estimation_mode,
  num_samples,
  damping_mode,
  axis_name,
  inverse_mesh,
  inverse_storage,
  factor_solve,
  strict,
  skip_nonfinite,
) -> None:
  """Every `scale_by_kfac` argument, named in the error, before any state exists (`loss_fn`
  is None when a registration is given)."""
  if loss_fn is not None:
    _checks.function(loss_fn, "loss_fn")
  _checks.boolean(has_aux, "has_aux")
  _checks.number(damping, "damping", low=0.0, schedule=True)
  _checks.number(ema_decay, "ema_decay", low=0.0, high=1.0, high_open=True)
  _checks.positive_int(inverse_every, "inverse_every")
  _checks.positive_int(curvature_every, "curvature_every")
  if statistics_fraction is not None and statistics_fraction != "auto":
    _checks.static_fraction(
      statistics_fraction,
      "statistics_fraction",
      fix=" With optax.inject_hyperparams, list it in static_args.",
      also='or "auto"',
    )
  _checks.choice(estimation_mode, "estimation_mode", _curvature.ESTIMATION_MODES)
  if num_samples is not None:
    _checks.static_int(
      num_samples,
      "num_samples",
      fix=(
        " With optax.inject_hyperparams, pass static_args=('loss_fn', 'example_batch', "
        "'num_samples')."
      ),
    )
  _checks.choice(damping_mode, "damping_mode", ("factored", "eigen"))
  _checks.optional_str(axis_name, "axis_name")
  _checks.choice(inverse_storage, "inverse_storage", ("replicated", "sharded"))
  _checks.choice(factor_solve, "factor_solve", ("auto", "always", "never"))
  _checks.boolean(strict, "strict")
  _checks.boolean(skip_nonfinite, "skip_nonfinite")
  if inverse_mesh is not None:
    if axis_name is not None:
      raise ValueError(
        "pass `axis_name` (inside pmap/shard_map) or `inverse_mesh` (under jit with sharded "
        "data), not both: with `axis_name` the inverse work is already split over that axis."
      )
    if (
      not isinstance(inverse_mesh, tuple)
      or len(inverse_mesh) != 2
      or not isinstance(inverse_mesh[0], jax.sharding.Mesh)
      or inverse_mesh[1] not in inverse_mesh[0].axis_names
    ):
      raise ValueError(
        "`inverse_mesh` must be a (jax.sharding.Mesh, axis_name) pair naming one of the "
        f"mesh's axes, got {inverse_mesh!r}."
      )
    _parallel.check_auto_axis(*inverse_mesh)
  if inverse_storage == "sharded" and axis_name is None and inverse_mesh is None:
    raise ValueError(
      "inverse_storage='sharded' splits the inverses over the devices of a data-parallel "
      "axis: pass `axis_name=` (inside pmap/shard_map) or `inverse_mesh=(mesh, axis)` (under "
      "jit with sharded data), or keep inverse_storage='replicated' on one device."
    )


def auto_stride(n: int) -> int:
  """The row stride of `statistics_fraction="auto"` for a batch of n rows: every fourth row from
  256 rows, every second from 128, else every row, so the statistics keep at least 64 examples.

  From the races (benchmarks/RESULTS.md, "A quarter of the rows by default"): a quarter of
  the rows made K-FAC reach Adam's loss sooner on the CNN (batch 256: 0.55x Adam's time
  against every row's 0.60x, four seeds) and the autoencoder (batch 1000: 0.19x against
  0.23x), with a cheaper mean step; on the Transformer (8 of 32 sequences) it left the time
  level and the held-out loss slightly worse, so batches under 128 keep every row, and no
  statistics step uses fewer than 64 examples. Strides that are powers of two keep the rows
  on their devices for a batch sharded over a power-of-two number of devices.
  """
  return 4 if n >= 256 else 2 if n >= 128 else 1


class _Preconditioner:
  """The shared step engine of `scale_by_kfac` and `kfac`: statistics, inverses, guard."""

  def __init__(
    self,
    loss_fn,
    example_batch,
    *,
    registration,
    has_aux,
    damping,
    ema_decay,
    inverse_every,
    curvature_every,
    statistics_fraction,
    estimation_mode,
    num_samples,
    damping_mode,
    axis_name,
    inverse_mesh,
    inverse_storage,
    factor_solve,
    strict,
    layers,
    stats_dtype,
    inverse_dtype,
    preconditioner_dtype,
    skip_nonfinite,
    name,
  ):
    reg = _registration.resolve(
      registration,
      loss_fn,
      example_batch,
      name,
      _registration.estimator_settings(
        has_aux, estimation_mode, num_samples, strict, layers, num_samples_default=None
      ),
    )
    if reg is None and loss_fn is None:
      raise TypeError(
        f"{name}: pass `loss_fn` and `example_batch`, or `registration=` (a kfac_jax.Registration)."
      )
    _check_args(
      loss_fn=loss_fn,
      has_aux=has_aux,
      damping=damping,
      ema_decay=ema_decay,
      inverse_every=inverse_every,
      curvature_every=curvature_every,
      statistics_fraction=statistics_fraction,
      estimation_mode=estimation_mode,
      num_samples=num_samples,
      damping_mode=damping_mode,
      axis_name=axis_name,
      inverse_mesh=inverse_mesh,
      inverse_storage=inverse_storage,
      factor_solve=factor_solve,
      strict=strict,
      skip_nonfinite=skip_nonfinite,
    )
    settings = dict(
      has_aux=has_aux,
      estimation_mode=estimation_mode,
      num_samples=1 if num_samples is None else num_samples,
      strict=strict,
      layers=layers,
    )
    if reg is not None:  # Checked against the registration above; it supplies them.
      settings = {}
    self.est = _estimator.CurvatureEstimator(
      loss_fn,
      example_batch,
      registration=reg,
      exps=(-1,),
      damping_mode=damping_mode,
      stats_dtype=stats_dtype,
      inverse_dtype=inverse_dtype,
      preconditioner_dtype=preconditioner_dtype,
      inverse_storage=inverse_storage,
      factor_solve=factor_solve,
      **settings,
    )
    self.est.who = f"this {name} transform"
    self.damping = damping
    self.ema_decay = ema_decay
    self.inverse_every = inverse_every
    self.curvature_every = curvature_every
    # None (the default, so that optax.inject_hyperparams leaves it static) is every row.
    self.statistics_fraction = 1 if statistics_fraction is None else statistics_fraction
    self.axis_name = axis_name
    self.inverse_mesh = inverse_mesh
    self.skip_nonfinite = skip_nonfinite
    self.name = name
    self._kept: tuple[bool, ...] | None = None  # The share `init` / `update` last saw.

  def init(self, params) -> ScaleByKfacState:
    if not jax.tree_util.tree_leaves(params, is_leaf=_engine.is_masked) and self.est.registered:
      # A tree without leaves: `optax.tree_map_params`' placeholder, which asks only for the
      # state's structure (the layers are known from an earlier `init`).
      curvature = self.est.init_state(axis_name=self.axis_name, mesh=self.inverse_mesh)
    else:
      kept = self._share(params)
      full = params if kept is None else self._fill(params, abstract=True)
      curvature = self.est.init(full, axis_name=self.axis_name, mesh=self.inverse_mesh)
    # Distinct arrays: a state whose leaves share one buffer cannot be donated (jit's
    # donate_argnums refuses to donate a buffer twice).
    return ScaleByKfacState(
      count=jnp.zeros([], jnp.int32), skipped=jnp.zeros([], jnp.int32), curvature=curvature
    )

  def _share(self, params) -> tuple[bool, ...] | None:
    """Per registered leaf, whether it is in this transform's share, when `params` has
    `optax.MaskedNode` leaves (`optax.multi_transform` / `optax.masked` hand the transform its
    share of the parameters); the estimator then keeps only the blocks of that share. None for
    whole params."""
    kept = _engine.masked_share(params)
    if kept is None:
      if self._kept is not None:  # Whole params again after a share: every block.
        self.est.keep_leaves((True,) * len(self._kept), self.name)
        self._kept = None
      return None
    if not self.est.registered:
      raise ValueError(
        f"{self.name}: `params` has optax.MaskedNode leaves: optax.multi_transform or "
        "optax.masked hands this transform only its share of the parameters, and the model "
        "cannot be traced without the rest. Build the layers from the whole params, "
        "`reg = kfac_jax.Registration(loss_fn, params, batch)`, and pass `registration=reg` "
        f"to {self.name} and to kfac_jax.value_and_grad."
      )
    self.est.registration.check_params(self._fill(params, abstract=True))
    self.est.keep_leaves(kept, self.name)
    self._kept = kept
    return kept

  def _fill(self, share, abstract: bool = False):
    """`share` with its `optax.MaskedNode` leaves replaced by zeros of the registered shapes
    and dtypes (`jax.ShapeDtypeStruct`s with `abstract`): the whole params' structure."""
    flat, treedef = jax.tree_util.tree_flatten(share, is_leaf=_engine.is_masked)
    sig = self.est.registration.param_signature[1]
    if len(flat) != len(sig):  # Wrong structure: `check_params` names the leaf.
      return jax.tree_util.tree_unflatten(treedef, flat)
    make = jax.ShapeDtypeStruct if abstract else jnp.zeros
    leaves = [
      make(shape, jnp.dtype(dtype)) if _engine.is_masked(x) else x
      for x, (shape, dtype) in zip(flat, sig)
    ]
    return jax.tree_util.tree_unflatten(treedef, leaves)

  @staticmethod
  def _unfill(full, share):
    """The leaves of `full` (whole params' structure) at `share`'s unmasked leaves, in
    `share`'s structure."""
    flat, treedef = jax.tree_util.tree_flatten(share, is_leaf=_engine.is_masked)
    leaves = jax.tree_util.tree_leaves(full)
    return jax.tree_util.tree_unflatten(
      treedef, [x if _engine.is_masked(x) else y for x, y in zip(flat, leaves)]
    )

  def _row_plan(self, batch, *, strict: bool) -> tuple[int, int] | None:
    """`(rows, stride)` of the statistics' rows of `batch` (`x[: rows * stride : stride]` along
    every leaf's leading axis), or None for every row. `strict`: a batch whose leaves do not
    share one leading axis raises (an explicit fraction); otherwise it keeps every row."""
    f = self.statistics_fraction
    if f == 1:
      return None
    flat = jax.tree_util.tree_flatten_with_path(batch)[0]
    sized = [(path, x) for path, x in flat if jnp.ndim(x) >= 1]
    if not sized:
      if not strict:
        return None
      raise ValueError(
        f"{self.name}: statistics_fraction={f!r} takes rows of every `batch=` leaf, "
        "but no leaf has a leading axis."
      )
    n = jnp.shape(sized[0][1])[0]
    for path, x in sized[1:]:
      if jnp.shape(x)[0] != n:
        if not strict:
          return None
        raise ValueError(
          f"{self.name}: statistics_fraction={f!r} takes the same rows of every `batch=` "
          f"leaf, so their leading axes must agree: `batch{jax.tree_util.keystr(sized[0][0])}` "
          f"has {n} rows, `batch{jax.tree_util.keystr(path)}` has {jnp.shape(x)[0]}. Pass "
          "statistics_fraction=None and slice the batch yourself."
        )
    if f == "auto":
      stride = auto_stride(n)
      if stride == 1:
        return None
      return -(-n // stride), stride
    rows = max(1, math.ceil(f * n))
    return rows, n // rows

  def statistics_rows(self, batch):
    """`batch` cut to the rows the statistics come from: r = ⌈f·N⌉ of the N along every
    leaf's leading axis (f = `statistics_fraction`; the whole batch for f = 1), evenly spaced:
    rows 0, s, 2s, ... with stride s = ⌊N / r⌋ (`x[:r*s:s]`, every s-th row when r divides N).
    A strided slice, not the first r rows: a batch sharded over devices keeps its statistics
    rows on every device (no rows move when s divides the shards' row count), and an ordered
    batch (sources or classes in blocks) contributes from every block. Scalar leaves pass
    whole. Raises ValueError, naming the leaves, when the leading axes differ (for "auto":
    every row, see `auto_stride`)."""
    return self._cut(batch, self._row_plan(batch, strict=self.statistics_fraction != "auto"))

  @staticmethod
  def _cut(batch, plan: tuple[int, int] | None):
    """`batch` at the rows of `plan` (from `_row_plan`; None: the whole batch)."""
    if plan is None:
      return batch
    rows, stride = plan
    return jax.tree_util.tree_map(
      lambda x: x[: rows * stride : stride] if jnp.ndim(x) >= 1 else x, batch
    )

  def _auto_stats(self, params, batch, rng):
    """The statistics for `statistics_fraction="auto"`: from `statistics_rows(batch)` when the
    loss is traced on those rows and its tags see exactly that many examples, else from every
    row. The cut batch is tried at trace time only: a batch with a leaf that is not
    per-example (model state, a table), a model whose shapes follow the batch size, or a loss
    whose examples are not the leaves' leading axis falls back to the whole batch (the
    abandoned trace leaves nothing in the compiled step)."""
    plan = self._row_plan(batch, strict=False)
    if plan is not None:
      try:
        stats = self.est.curvature_stats(params, self._cut(batch, plan), rng)
      except Exception:  # noqa: BLE001
        # Any error on the cut batch (Flax's parameter-shape errors are not ValueErrors); a
        # real one comes back from the whole batch's trace below.
        stats = None
      if stats is not None and stats.batch_size == plan[0]:
        return stats
    return self.est.curvature_stats(params, batch, rng)

  def _due(self, count):
    """Whether the update at `count` folds statistics (a constant with `curvature_every=1`)."""
    every = self.curvature_every
    if isinstance(every, int) and every == 1:
      return None
    return count % jnp.asarray(every, count.dtype) == 0

  def update(
    self,
    updates,
    state: ScaleByKfacState,
    params,
    curvature_stats,
    batch,
    rng,
    finish=None,
    finish_state=None,
    finish_ok=None,
  ):
    """`(new_updates, new_state, new_finish_state)`.

    `finish(preconditioned, finish_state, ok) -> (updates, finish_state)` maps the
    preconditioned update to the outgoing one (`kfac`'s clipping, momentum and learning rate);
    `ok` is the guard's verdict (None with the guard off): `finish` must return zero updates
    when it is False, and the guard restores `finish_state`. `finish_ok`: a scalar bool the
    guard also requires (e.g. a finite learning rate).
    """
    est = self.est
    if params is None:
      raise ValueError(f"{self.name}: `params` is required: tx.update(grads, state, params, ...).")
    if not isinstance(state, ScaleByKfacState):
      raise TypeError(
        f"{self.name}: `state` must be the ScaleByKfacState from this "
        f"transform's init, got {type(state).__name__}."
      )
    kept = self._share(params)
    if kept is None:
      est.ensure_layers(params)
    else:
      share = _engine.masked_share(updates)
      if share != kept:
        raise ValueError(
          f"{self.name}: `updates` and `params` must be the same share of the parameters "
          "(the same optax.MaskedNode leaves)."
        )
      if curvature_stats is None:
        raise ValueError(
          f"{self.name}: `params` has optax.MaskedNode leaves (optax.multi_transform or "
          "optax.masked hands this transform only its share of the parameters), so it cannot "
          "trace the model on `batch=`: pass `curvature_stats=` from "
          "kfac_jax.value_and_grad(registration=reg)(params, batch, rng) on the whole params."
        )
    if curvature_stats is None and batch is None:
      raise ValueError(
        f"{self.name}: pass `curvature_stats=` (from kfac_jax.value_and_grad) or "
        "`batch=` (and `rng=`) to tx.update, so the curvature can be estimated."
      )
    count, old = state.count, state.curvature
    # What the guard can tell before the curvature moves: a finite gradient and finite
    # scalars for `finish`. The statistics fold and the inverses refresh only when both hold,
    # so the guard never has to restore the factors or the caches (see below).
    ok = _estimator.all_finite(updates) if self.skip_nonfinite else None
    if ok is not None and finish_ok is not None:
      ok = ok & finish_ok

    def statistics():
      if curvature_stats is not None:
        return curvature_stats
      if self.statistics_fraction == 1:
        stats = est.curvature_stats(params, batch, rng)
      elif self.statistics_fraction == "auto":
        stats = self._auto_stats(params, batch, rng)
      else:
        rows = self.statistics_rows(batch)
        try:
          stats = est.curvature_stats(params, rows, rng)
        except (TypeError, ValueError) as e:
          # Tracing `loss_fn` on the cut batch failed: a leaf that is not per-example (model
          # state carried in the batch) or a layer whose shapes follow the batch size. A note,
          # not a new exception: JAX's own TypeErrors (concretization, tracer conversion) take
          # a tracer, not a message, so `type(e)(message)` would fail while reporting.
          e.add_note(
            "(The statistics came from a subset of the rows of every `batch=` leaf: "
            f"statistics_fraction={self.statistics_fraction!r}. Every leaf with a leading "
            "axis must be per-example; otherwise pass statistics_fraction=None and slice the "
            "batch yourself.)"
          )
          raise
      return stats

    # Statistics only on due updates (computed inside the branch when the transform computes
    # them itself); the caches, which the fold never changes, stay out of the branch. With
    # statistics on every update (`curvature_every=1`) the only condition is the guard's: they
    # are formed outside its cond (a non-finite update forms them for nothing; its fold is
    # skipped), since inside a cond branch XLA:CPU runs some pull-backs far slower (RESULTS.md,
    # "The `Optimizer`'s statistics outside the guard's cond").
    fold_due = self._due(count)
    every_update = statistics() if fold_due is None else None

    def fold():
      stats = statistics() if every_update is None else every_update
      return est.update_curvature_from_stats(old, stats, self.ema_decay, axis_name=self.axis_name)

    if ok is not None:
      fold_due = ok if fold_due is None else fold_due & ok
    curv = _engine.fold_statistics(old, fold, fold_due)
    if ok is not None:  # The estimator skipped (and counted) non-finite statistics.
      ok = ok & (curv.skipped_batches == old.skipped_batches)

    lam = self.damping(count) if callable(self.damping) else self.damping

    # Only the cache goes through the branch. A skipped update does no refresh.
    due = count % jnp.asarray(self.inverse_every, count.dtype) == 0
    curv = _engine.refresh_inverses(
      est,
      curv,
      lam,
      due if ok is None else due & ok,
      axis_name=self.axis_name,
      mesh=self.inverse_mesh,
    )
    vector = updates if kept is None else self._fill(updates)
    pre = est.multiply_matpower(curv, vector, -1, axis_name=self.axis_name, mesh=self.inverse_mesh)
    if kept is not None:  # The masked leaves' zeros pass through no block; XLA drops them.
      pre = self._unfill(pre, updates)
    pre = jax.tree_util.tree_map(lambda n, u: n.astype(u.dtype), pre, updates)
    if ok is None:
      out, new_finish = (pre, finish_state) if finish is None else finish(pre, finish_state, None)
      return (
        out,
        ScaleByKfacState(count=optax.safe_increment(count), curvature=curv, skipped=state.skipped),
        new_finish,
      )

    # The guard. `ok` covers the gradient, the statistics, `finish_ok` (the scalars `finish`
    # uses) and the preconditioned update; with those finite the outgoing update is finite
    # but for overflow. `finish` zeroes its result on a skip itself, before its last
    # multiplication: a select between that multiplication and the caller's
    # `params + updates` (or a reduction over the outgoing update) changed how XLA contracts
    # the two into a fused multiply-add, and the sharded and replicated inverse storages
    # stopped agreeing to the last bit.
    #
    # The curvature is already safe here: the statistics folded, and the inverses refreshed,
    # only from a finite gradient, finite scalars and finite statistics. So the guard's one
    # `lax.cond` restores only the caller's state (the momentum trace). Restoring the factors
    # and caches too kept the old ones alive to the end of the step, and XLA then copied all
    # of them through the fold's and the refresh's pass-through branches on every update
    # (autoencoder, 26 MB of factors and 26 MB of inverses: an update without statistics or
    # refresh 100.6 -> 80.7 ms, `benchmarks/RESULTS.md`, "The guard without copies"). The one
    # case this leaves: `pre` overflowing from finite inputs skips the update but keeps the
    # (finite) statistics and inverses it was computed from.
    ok = ok & _estimator.all_finite(pre)
    if finish is None:
      out, new_finish = (
        jax.tree_util.tree_map(lambda u: jnp.where(ok, u, jnp.zeros_like(u)), pre),
        finish_state,
      )
    else:
      out, new_finish = finish(pre, finish_state, ok)
    new_finish = _engine.keep_if(ok, new_finish, finish_state)
    new_state = ScaleByKfacState(
      count=count + ok.astype(count.dtype),
      curvature=curv,
      skipped=state.skipped + (~ok).astype(state.skipped.dtype),
    )
    return out, new_state, new_finish


def scale_by_kfac(
  loss_fn: Callable | None = None,
  example_batch: Any = None,
  *,
  registration: _registration.Registration | None = None,
  has_aux: bool = False,
  damping: ScalarOrSchedule = 0.1,
  ema_decay: float = 0.95,
  inverse_every: int = 5,
  curvature_every: int = 1,
  statistics_fraction: float | Literal["auto"] | None = None,
  estimation_mode: _curvature.EstimationMode = "gradients",
  num_samples: int | None = None,
  damping_mode: _blocks.DampingMode = "factored",
  axis_name: str | None = None,
  inverse_mesh: tuple[jax.sharding.Mesh, str] | None = None,
  inverse_storage: _estimator.InverseStorage = "replicated",
  factor_solve: _blocks.FactorSolve = "auto",
  strict: bool = False,
  layers: _layer_config.LayerConfig | None = None,
  stats_dtype: Any = None,
  inverse_dtype: Any = None,
  preconditioner_dtype: Any = None,
  skip_nonfinite: bool = True,
) -> optax.GradientTransformationExtraArgs:
  """Preconditions updates with the damped K-FAC curvature: `u ← (F̂ + λ)⁻¹ u`.

  `F̂` is the block-diagonal Kronecker-factored Fisher of the tagged loss (see
  `CurvatureEstimator`), averaged with a bias-corrected EMA of the statistics of every
  `curvature_every`-th update; its inverse is refreshed every `inverse_every` updates (both
  first at update 0) with the current damping λ.

  Args:
    loss_fn: `loss_fn(params, batch) -> scalar` with a loss tag on the model output; with
      `has_aux=True`, `loss_fn(params, batch) -> (scalar, aux)`.
    example_batch: a batch of the training shapes; `init` scans `loss_fn` with it.
    registration: a `kfac_jax.Registration` instead of `loss_fn` and `example_batch`, shared
      with `kfac_jax.value_and_grad(registration=...)`: both then use its layers (e.g. a
      `LayerConfig(linked=...)`), mode and samples. `has_aux`, `estimation_mode`,
      `num_samples`, `strict` and `layers` take its values (set to others: an error).
    has_aux: `loss_fn` returns `(loss, aux)` (see `kfac_jax.value_and_grad`); only the loss
      part is scanned. Compute the statistics with `value_and_grad(loss_fn, has_aux=True)`.
    damping: λ ≥ 0, a number or a schedule `count -> λ`.
    ema_decay: decay of the statistics' moving average, in [0, 1) (0 keeps the newest batch).
    inverse_every: refresh the inverses every this many updates.
    curvature_every: fold the curvature statistics into the EMA every this many updates (1:
      every update, the default here; `kfac`, whose clipping bounds the step, defaults to
      5, which cost nothing per step on our benchmarks: benchmarks/RESULTS.md, "Statistics
      every 5 steps by default"; without clipping, stale statistics let some zoo models
      diverge at a fixed learning rate). Values above 1 save the statistics' passes on the
      other updates: the factors' products (the bulk of the statistics' cost) are formed on
      due updates only, whichever way the statistics come. `batch=` and `rng=` to `update`
      also skip the forward and backward passes of the statistics on the other updates (the
      fastest path on CPU: benchmarks/RESULTS.md, "Statistics every 5 steps by default");
      statistics from `kfac_jax.value_and_grad` are computed on every call. Same meaning
      as `Optimizer(curvature_every=)`; a value above `inverse_every` refreshes some inverses
      from unchanged statistics (useful only when the damping changes).
    statistics_fraction: f in (0, 1]: when `update` computes the statistics from `batch=`,
      it uses r = ⌈f·N⌉ of the batch's N rows, evenly spaced (every ⌊N/r⌋-th row from the
      first: `x[:r*s:s]` along the leading axis of every leaf; scalar leaves pass whole),
      while the gradient is the caller's, from the whole batch. Statistics are normalised by
      their own row count, so the estimate stays unbiased and only noisier; spaced rows
      also sample a batch assembled in blocks (two sources, sorted labels). None (the
      default here) or 1 uses every row. "auto" (`kfac`'s default) takes every fourth row of
      a batch of 256 or more rows, every second of 128 or more, else every row (see
      `auto_stride`), and uses every row instead, silently, when the cut batch cannot be
      used: leaves without one shared leading axis, a loss that fails to trace on the cut
      batch or whose loss tags then see other than that many examples. An explicit f raises
      in those cases. Statistics passed as `curvature_stats=` are used as they come
      (`kfac_jax.value_and_grad` forms them from the batch it is given). It fixes array
      shapes, so a number must be a Python number (with `optax.inject_hyperparams`, list it
      in `static_args`). Under `pmap` / `shard_map` each device takes its own rows; under
      `jit` with a batch sharded along its rows, the global batch's, which stay on their
      devices when the stride divides each device's row count (no rows are moved). When it
      does, both pick the same rows of the global batch.
    estimation_mode: "gradients" (sampled targets, default), "empirical" (data targets),
      "curvature_prop" / "curvature_prop_GGN" (Rademacher vectors times a square-root factor of
      the output Fisher / loss Hessian) or "exact" / "exact_GGN" (every output coordinate; K
      backward passes for K non-batch output coordinates). See `CurvatureEstimator`. The
      random modes need `rng` when `update` computes the statistics from `batch`.
    num_samples: random vectors per example ("gradients" and "curvature_prop(_GGN)" modes);
      None means 1; the exact modes accept only None or 1. It fixes array shapes, so it must
      be a Python int (with `optax.inject_hyperparams`, list it in `static_args`).
    damping_mode: "factored" (π-adjusted Tikhonov, default) or "eigen" (exact, slower).
    axis_name: inside `pmap` / `shard_map`: average the statistics over this axis, and split
      the inverse work over it (each device factorises its share of the blocks, balanced by
      cost; the caches are then summed over the axis, an exact operation).
    inverse_mesh: under plain `jit` with data sharded over a mesh (statistics are then reduced
      by XLA, no `axis_name`): `(mesh, axis)` splits the inverse work over that mesh axis.
    inverse_storage: "replicated" (default): every device keeps every block's inverse and
      preconditions the whole gradient itself. "sharded" (KAISA's memory-optimised strategy):
      each device keeps only its share of the inverses (about 1/D of the total, balanced by
      bytes) and preconditions only their gradient leaves; the preconditioned gradient is
      summed over the axis, one gradient-sized `psum` more per step. Needs `axis_name` or
      `inverse_mesh`; with `axis_name`, call `init` inside the pmap / shard_map (each device's
      state differs): `jax.pmap(tx.init, axis_name="data")(replicated_params)`. With
      `inverse_mesh`, `init` returns the inverses as a global array sharded over the mesh
      axis. The factors stay replicated. The updates equal the replicated strategy's.
    factor_solve: how a Kronecker factor's damped inverse is kept: "auto" (default) keeps a factor
      of size n ≥ 256 whose products have at most n/8 columns (a wide input into a narrow layer: a
      classifier head) as its Cholesky factor in blocks for block substitution, which refreshes ~3x
      faster than an explicit inverse, and the explicit inverse elsewhere; "never" / "always" force
      one form. The updates are the same up to rounding. See `kfac_jax.CurvatureEstimator`.
    strict: error instead of warning for parameters outside every recognised layer.
    layers: a `kfac_jax.LayerConfig`: approximations per layer kind and per parameter-path
      pattern, and linked parameter groups (None: the defaults).
    stats_dtype: dtype of the stored statistics: None (float32, float64 under x64), "float32",
      "float64", "bfloat16" or "float16". Statistics are accumulated in at least float32.
    inverse_dtype: dtype of the inverses and of the preconditioning products: None (float32,
      float64 under x64), "float32" or "float64". The updates come back in the parameters'
      dtype, so a bfloat16 model gets bfloat16 updates from float32 curvature.
    preconditioner_dtype: None (`inverse_dtype`) or "bfloat16": the inverses of the Kronecker
      factors are stored in bfloat16 once computed, and the preconditioning products take
      bfloat16 inputs with `inverse_dtype` accumulation: half the inverses' memory, and
      faster products where the hardware multiplies bfloat16 natively (measured on a CPU with
      AVX512-BF16). See `kfac_jax.CurvatureEstimator`.
    skip_nonfinite: when the incoming updates, this batch's statistics or the preconditioned
      updates are not finite, return zero updates and leave the state as it was but for the
      `skipped` counter (and `curvature.skipped_batches` when the gradient was finite and
      the statistics were not); only a preconditioned update that overflows from finite
      inputs keeps the batch's (finite) statistics and inverses (see the module docstring).
      False: non-finite statistics are still kept out of the factors (and counted in
      `curvature.skipped_batches`), but the update goes through as computed.

  With `optax.inject_hyperparams`, declare the non-numeric arguments static (optax treats any
  callable as a schedule): `optax.inject_hyperparams(kfac_jax.scale_by_kfac,
  static_args=("loss_fn", "example_batch"))(loss_fn=..., example_batch=..., damping=1e-3)`;
  `damping`, `ema_decay` and `inverse_every` can then change between steps without a recompile.

  Inside `optax.multi_transform` / `optax.masked` (params with `optax.MaskedNode` leaves), pass
  `registration=` built from the whole params and `curvature_stats=`: the state then holds only
  the blocks of the share, and every layer must lie wholly inside or outside it (README,
  "K-FAC on a share of the parameters").

  Returns:
    An `optax.GradientTransformationExtraArgs` with state `ScaleByKfacState`. Its
    `update(updates, state, params, *, curvature_stats=None, batch=None, rng=None)` needs
    `params`, and either `curvature_stats` from `kfac_jax.value_and_grad` (one forward pass for
    everything) or `batch` and `rng` (an extra forward and backward pass).

  Raises:
    TypeError / ValueError: a bad argument, named with the value received, before any state
      is created (e.g. `damping="1e-3"`: "`damping` must be a finite number >= 0 or a
      schedule `count -> value`, got '1e-3' (str)"). In `update` (when traced, before any
      state changes): params of another structure than at `init` (the first differing leaf
      named), or `curvature_stats` of another estimation mode, sample count or layer set
      (both named).

  Example:
    >>> tx = optax.chain(kfac_jax.scale_by_kfac(loss_fn, batch, damping=1e-3),
    ...                  optax.scale_by_learning_rate(0.1))
    >>> opt_state = tx.init(params)
    >>> loss, grads, stats = kfac_jax.value_and_grad(loss_fn)(params, batch, rng)
    >>> updates, opt_state = tx.update(grads, opt_state, params, curvature_stats=stats)
  """
  engine = _Preconditioner(
    loss_fn,
    example_batch,
    registration=registration,
    has_aux=has_aux,
    damping=damping,
    ema_decay=ema_decay,
    inverse_every=inverse_every,
    curvature_every=curvature_every,
    statistics_fraction=statistics_fraction,
    estimation_mode=estimation_mode,
    num_samples=num_samples,
    damping_mode=damping_mode,
    axis_name=axis_name,
    inverse_mesh=inverse_mesh,
    inverse_storage=inverse_storage,
    factor_solve=factor_solve,
    strict=strict,
    layers=layers,
    stats_dtype=stats_dtype,
    inverse_dtype=inverse_dtype,
    preconditioner_dtype=preconditioner_dtype,
    skip_nonfinite=skip_nonfinite,
    name="scale_by_kfac",
  )

  def update_fn(
    updates,
    state: ScaleByKfacState,
    params=None,
    *,
    curvature_stats=None,
    batch=None,
    rng=None,
    **extra_args,
  ):
    del extra_args  # Other transforms' extra arguments (optax.chain forwards them all).
    out, new_state, _ = engine.update(updates, state, params, curvature_stats, batch, rng)
    return out, new_state

  return optax.GradientTransformationExtraArgs(engine.init, update_fn)


def clip_coefficient(preconditioned, grads, max_norm) -> Array:
  """`min(1, r / √|vᵀg|)`: the scale that keeps `v`'s norm in the damped K-FAC metric ≤ `r`.

  With `v = F̂_λ⁻¹ g` the preconditioned gradient, `vᵀ F̂_λ v = vᵀ g`, so `√|vᵀg|` is `v`'s
  length in the metric that preconditioned it (half its squared length approximates the KL
  divergence of the step `v`). 1 when `vᵀg = 0`; the inner product is accumulated in at least
  float32. `r = max_norm`.
  """

  def up(x):
    return x.astype(jnp.promote_types(x.dtype, jnp.float32))

  vg = sum(
    _parallel.vdot(up(v), up(g))
    for v, g in zip(jax.tree_util.tree_leaves(preconditioned), jax.tree_util.tree_leaves(grads))
  )
  vg = jnp.abs(jnp.asarray(vg))
  r2 = jnp.square(jnp.asarray(max_norm, vg.dtype))
  big = vg > r2
  return jnp.where(big, jnp.sqrt(r2 / jnp.where(big, vg, 1)), jnp.ones_like(vg))


def kfac(
  loss_fn: Callable | None = None,
  example_batch: Any = None,
  learning_rate: ScalarOrSchedule | None = None,
  *,
  momentum: float | None = 0.7,
  nesterov: bool = False,
  max_norm: float | None = 0.3,
  norm_constraint: None = None,
  registration: _registration.Registration | None = None,
  has_aux: bool = False,
  damping: ScalarOrSchedule = 0.1,
  ema_decay: float = 0.95,
  inverse_every: int = 5,
  curvature_every: int = 5,
  statistics_fraction: float | Literal["auto"] | None = "auto",
  estimation_mode: _curvature.EstimationMode = "gradients",
  num_samples: int | None = None,
  damping_mode: _blocks.DampingMode = "factored",
  axis_name: str | None = None,
  inverse_mesh: tuple[jax.sharding.Mesh, str] | None = None,
  inverse_storage: _estimator.InverseStorage = "replicated",
  factor_solve: _blocks.FactorSolve = "auto",
  strict: bool = False,
  layers: _layer_config.LayerConfig | None = None,
  stats_dtype: Any = None,
  inverse_dtype: Any = None,
  preconditioner_dtype: Any = None,
  skip_nonfinite: bool = True,
) -> optax.GradientTransformationExtraArgs:
  """K-FAC with a fixed (or scheduled) learning rate, norm clipping and momentum.

  The update is `u = −α · m`, with `v = (F̂ + λ)⁻¹ g` from `scale_by_kfac`, clipped to length
  `r = max_norm` in the damped K-FAC metric, `v ← v · min(1, r / √|vᵀg|)` (see
  `clip_coefficient`), and `m` the heavy-ball trace `m ← v + μ m` with `momentum=μ`
  (`optax.trace`; `m = v` without momentum). As with `optax.clip_by_global_norm` before
  `optax.scale`, the clipping comes before the learning rate, so α scales every step: a
  schedule or an injected α acts whether or not the clipping binds, and the step's length
  in the metric is at most `α r` (before momentum). α and λ schedules are called with the number of
  applied (not skipped) updates. Every keyword is an explicit parameter, so
  `optax.inject_hyperparams(kfac_jax.kfac, static_args=("loss_fn", "example_batch"))` can
  inject any numeric one (`learning_rate`, `momentum`, `damping`, `ema_decay`,
  `inverse_every`, `max_norm`) and change it between steps without a recompile.

  Args:
    loss_fn: `loss_fn(params, batch) -> scalar` with a loss tag on the model output; with
      `has_aux=True`, `loss_fn(params, batch) -> (scalar, aux)`.
    example_batch: a batch of the training shapes; `init` scans `loss_fn` with it.
    learning_rate: α > 0, a number or a schedule `count -> α` (required).
    momentum: μ in [0, 1) for heavy-ball momentum on the preconditioned update, or None.
    nesterov: Nesterov momentum (`optax.trace(nesterov=True)`).
    max_norm: r > 0, the largest length `√(vᵀ F̂_λ v) = √|vᵀg|` of the preconditioned
      gradient before α and momentum, or None (no clipping).
    norm_constraint: not accepted. TF K-FAC's and `Optimizer`'s `norm_constraint=C` bounds
      the step after the learning rate (`α² |vᵀg| ≤ C`), so that while it binds α does
      nothing; here the bound comes first. For a fixed α the same clipping is
      `max_norm=√C / α`.
    damping: λ, as in `scale_by_kfac`.
    curvature_every: as in `scale_by_kfac`, but 5 by default (the clipping bounds the step
      that statistics up to 4 updates old precondition). With
      `max_norm=None` and small damping prefer 1: unclipped λ = 1e-3 steps from stale
      statistics diverged on a small MLP in our tests.
    skip_nonfinite: skip a non-finite update (zero updates, state unchanged but the
      `skipped` counter), the momentum trace included. See `scale_by_kfac`.
    statistics_fraction: as in `scale_by_kfac`, but "auto" by default: when the statistics
      come from `batch=`, a quarter of the rows of a batch of 256 or more, half of 128 or
      more, all of a smaller one (benchmarks/RESULTS.md, "A quarter of the rows by default").
      Pass None (or 1) for every row.

  The other arguments, `registration`, `has_aux`, `ema_decay`, `inverse_every`,
  `estimation_mode`, `num_samples`, `damping_mode`, `axis_name`, `inverse_mesh`,
  `inverse_storage`, `factor_solve`, `strict`, `layers`, `stats_dtype`, `inverse_dtype` and
  `preconditioner_dtype`, are those of `scale_by_kfac`.

  The defaults (`momentum=0.7`, `max_norm=0.3`, `damping=0.1`) come from step sweeps on the
  autoencoder, CNN, Transformer, ViT and LSTM benchmarks (benchmarks/RESULTS.md, "Clipping
  before the learning rate"): with a learning rate of 0.3 (the CNN, ViT and LSTM) or 1 (the
  autoencoder and the Transformer, whose losses sum over many outputs per example) they beat
  the tuned Adam's loss after 300 steps on each; without clipping, fixed-learning-rate K-FAC
  diverged on three of them at the old defaults (no momentum, λ = 1e-3). `curvature_every=5`
  lost nothing per step against statistics every step on four ("Statistics every 5 steps by
  default"); the LSTM wanted `curvature_every=1` and `damping=0.01`.

  On a share of the parameters (`optax.multi_transform`, see `scale_by_kfac`), `max_norm`
  clips by the norm of the share's update alone.

  Returns:
    An `optax.GradientTransformationExtraArgs` with state `KfacState`; `update` takes the
    same extra arguments as `scale_by_kfac`'s.

  Raises:
    TypeError / ValueError: a bad argument, named with the value received, before any state
      is created.

  Example:
    >>> tx = kfac_jax.kfac(loss_fn, batch, learning_rate=0.3)
    >>> opt_state = tx.init(params)
    >>> loss, grads, stats = kfac_jax.value_and_grad(loss_fn)(params, batch, rng)
    >>> updates, opt_state = tx.update(grads, opt_state, params, curvature_stats=stats)
    >>> params = optax.apply_updates(params, updates)
  """
  if learning_rate is None:
    raise TypeError(
      "kfac: `learning_rate` must be a number > 0 or a schedule `count -> α`, got None (it is "
      "required): e.g. kfac_jax.kfac(loss_fn, batch, 0.1) or "
      "kfac_jax.kfac(registration=reg, learning_rate=0.1)."
    )
  _checks.number(learning_rate, "learning_rate", low=0.0, low_open=True, schedule=True)
  if momentum is not None:
    _checks.number(momentum, "momentum", low=0.0, high=1.0, high_open=True)
  _checks.boolean(nesterov, "nesterov")
  if norm_constraint is not None:
    raise TypeError(
      f"kfac: `norm_constraint` is not an argument of kfac (got {norm_constraint!r}); use "
      "`max_norm`, which clips the preconditioned gradient before the learning rate, so "
      "that α always scales the step. For a fixed learning rate α, TF K-FAC's "
      "norm_constraint=C is max_norm=√C / α."
    )
  if max_norm is not None:
    _checks.number(max_norm, "max_norm", low=0.0, low_open=True)
  engine = _Preconditioner(
    loss_fn,
    example_batch,
    registration=registration,
    has_aux=has_aux,
    damping=damping,
    ema_decay=ema_decay,
    inverse_every=inverse_every,
    curvature_every=curvature_every,
    statistics_fraction=statistics_fraction,
    estimation_mode=estimation_mode,
    num_samples=num_samples,
    damping_mode=damping_mode,
    axis_name=axis_name,
    inverse_mesh=inverse_mesh,
    inverse_storage=inverse_storage,
    factor_solve=factor_solve,
    strict=strict,
    layers=layers,
    stats_dtype=stats_dtype,
    inverse_dtype=inverse_dtype,
    preconditioner_dtype=preconditioner_dtype,
    skip_nonfinite=skip_nonfinite,
    name="kfac",
  )
  trace = None if momentum is None else optax.trace(decay=momentum, nesterov=nesterov)

  def init_fn(params) -> KfacState:
    return KfacState(
      preconditioner=engine.init(params),
      momentum=optax.EmptyState() if trace is None else trace.init(params),
    )

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
    del extra_args
    if not isinstance(state, KfacState):
      raise TypeError(
        f"kfac: `state` must be the KfacState from this transform's init, got "
        f"{type(state).__name__}."
      )
    count = state.preconditioner.count
    lr = learning_rate(count) if callable(learning_rate) else learning_rate

    def finish(v, trace_state, ok):
      if max_norm is not None:
        coeff = clip_coefficient(v, updates, max_norm)
        v = jax.tree_util.tree_map(lambda x: x * coeff.astype(x.dtype), v)
      if trace is not None:
        v, trace_state = trace.update(v, trace_state)
      step = lr
      if ok is not None:  # Zeroed before the last multiplication (see the guard's comment);
        # α too, which may be the non-finite part (0 · ∞ is NaN).
        v = jax.tree_util.tree_map(lambda x: jnp.where(ok, x, jnp.zeros_like(x)), v)
        step = jnp.where(ok, lr, 0)
      v = jax.tree_util.tree_map(
        lambda x: (x.astype(jnp.promote_types(x.dtype, jnp.float32)) * -step).astype(x.dtype), v
      )
      return v, trace_state

    # The scalars `finish` uses must be finite too: a schedule's or an injected value
    # (`optax.inject_hyperparams`) was not checked at construction.
    scalars = [
      x for x in (lr, momentum, max_norm) if x is not None and not isinstance(x, (int, float))
    ]
    finish_ok = None
    if scalars:
      finish_ok = jnp.all(jnp.stack([jnp.isfinite(jnp.asarray(x, jnp.float32)) for x in scalars]))
    out, pre, mom = engine.update(
      updates,
      state.preconditioner,
      params,
      curvature_stats,
      batch,
      rng,
      finish,
      state.momentum,
      finish_ok,
    )
    return out, KfacState(preconditioner=pre, momentum=mom)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
