"""The contract of a front's step, in one place: `scale_by_kfac`, `kfac`, the `Optimizer`,
`scale_by_kernel_ngd` and `kernel_ngd` configure an `Engine` and add only what is their own.

Each update runs `bind` (the registration and the curvature's part for these params or their
`optax.multi_transform` share), `check` (cheapest first) and `step` (the verdicts, then the
curvature's step). K-FAC's fold and refresh are each a `lax.cond` that carries only what it can
change (XLA copies what a cond passes through unchanged), gated on the verdict: no guard restores.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import optax

from kfac_jax import (
  _checks,
  _config,
  _curvature,
  _estimator,
  _fit,
  _parallel,
  _registration,
  _specs,
  _storage,
)
from kfac_jax._verdict import Reporter, hyperparameters_ok, inputs_ok

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class Schedule:
  """The EMA's decay and the periods (in updates) of the fold and of the refresh: numbers, or
  arrays under `optax.inject_hyperparams`."""

  ema_decay: Any
  inverse_every: Any
  curvature_every: Any

  @classmethod
  def checked(cls, ema_decay, inverse_every, curvature_every) -> Schedule:
    _checks.number(ema_decay, "ema_decay", low=0.0, high=1.0, high_open=True)
    _checks.positive_int(inverse_every, "inverse_every")
    _checks.positive_int(curvature_every, "curvature_every")
    return cls(ema_decay, inverse_every, curvature_every)


@dataclasses.dataclass(frozen=True)
class Placement:
  """Where a step runs: in `pmap` / `shard_map` over `axis_name`, or under `jit` over `mesh`."""

  axis_name: str | None = None
  mesh: tuple[jax.sharding.Mesh, str] | None = None

  @classmethod
  def checked(cls, axis_name, config: _config.Config) -> Placement:
    _checks.optional_str(axis_name, "axis_name")
    if config.mesh is not None and axis_name is not None:
      raise ValueError(
        f"pass `axis_name` (inside pmap/shard_map) or `config.mesh` (under jit), not both; got "
        f"axis_name={axis_name!r} and config.mesh={config.mesh!r}."
      )
    sharded = isinstance(config.storage, _storage.ShardedStorage)
    if sharded and config.mesh is None and axis_name is None:
      raise ValueError(
        "inverse_storage='sharded' splits the inverses over a device axis: pass `axis_name=` "
        "(inside pmap/shard_map) or `config.mesh=(mesh, axis)` (under jit), or keep 'replicated'."
      )
    return cls(axis_name, config.mesh)

  def mean(self, tree):
    """`tree` averaged over `axis_name` (as is without one)."""
    return tree if self.axis_name is None else jax.lax.pmean(tree, self.axis_name)


class Source:
  """A front's registration: the one given, or one built with the front's `defaults` from
  `loss_fn`, `example_batch` and the first params it sees, then kept."""

  def __init__(self, loss_fn, example_batch, registration, who: str, defaults=None):
    given = _registration.shared(registration, loss_fn, who, ("example_batch", example_batch))
    self.loss_fn, self.example_batch = loss_fn, example_batch
    self.defaults = dict(defaults or {})
    self.known: _registration.Registration | None = given  # Once given or built.

  def for_params(self, params, collective_axes=None) -> _registration.Registration:
    """The registration for `params` (built on first use), checked against them; a tree without
    leaves (`optax.tree_map_params`' placeholder) gets the known one unchecked."""
    if self.known is not None and not jax.tree_util.tree_leaves(params):
      return self.known
    if self.known is None:
      self.known = _registration.Registration(
        self.loss_fn, params, self.example_batch, collective_axes=collective_axes, **self.defaults
      )
    self.known.check_params(params)
    return self.known


def _is_masked(x) -> bool:
  return isinstance(x, optax.MaskedNode)


def masked_share(tree) -> tuple[bool, ...] | None:
  """Per leaf (masked ones included) whether it is not an `optax.MaskedNode`; None if none is."""
  kept = tuple(not _is_masked(x) for x in jax.tree_util.tree_leaves(tree, is_leaf=_is_masked))
  return None if all(kept) else kept


class Bound(NamedTuple):
  """A front bound to one params signature: its registration, the curvature's part (K-FAC's
  estimator) and, for a share, per registered leaf whether it is in it."""

  registration: _registration.Registration
  estimator: Any
  kept: tuple[bool, ...] | None

  def fill(self, share, abstract: bool = False):
    """`share` with its masked leaves replaced by zeros (`jax.ShapeDtypeStruct`s with
    `abstract`) of the registered shapes and dtypes."""
    if self.kept is None:
      return share
    flat, treedef = jax.tree_util.tree_flatten(share, is_leaf=_is_masked)
    sig = self.registration.param_signature[1]
    if len(flat) != len(sig):  # Wrong structure: `check_params` names the leaf.
      return share
    make = jax.ShapeDtypeStruct if abstract else jnp.zeros
    leaves = [
      make(shape, jnp.dtype(dt)) if _is_masked(x) else x for x, (shape, dt) in zip(flat, sig)
    ]
    return jax.tree_util.tree_unflatten(treedef, leaves)

  def unfill(self, full, share):
    """`full` (the whole params' structure) at `share`'s unmasked leaves, in its structure."""
    if self.kept is None:
      return full
    flat, treedef = jax.tree_util.tree_flatten(share, is_leaf=_is_masked)
    merged = [x if _is_masked(x) else y for x, y in zip(flat, jax.tree_util.tree_leaves(full))]
    return jax.tree_util.tree_unflatten(treedef, merged)


class Inputs(NamedTuple):
  """An update's vector, a thunk computing the curvature's data, the inputs whose non-finite
  leaves skip the step and the hyperparameters (name → `(value or schedule, low or None)`)."""

  vector: Any
  statistics: Callable[[], Any]
  finite: Mapping[str, Any]
  hyperparameters: Mapping[str, tuple[Any, float | None]]


class Work(NamedTuple):
  """A curvature step's `Inputs` vector and thunk, update counter, hyperparameters' values,
  verdict so far (None with the guard off), clock and reporter."""

  vector: Any
  statistics: Callable[[], Any]
  counter: Array
  values: dict[str, Any]
  ok: Array | None
  clock: Array | None = None
  reporter: Reporter | None = None


class Step(NamedTuple):
  """The preconditioned vector, the curvature's new state (moved only on a good verdict), the
  verdict (None with the guard off), `count + skipped`, the values and the inputs' verdict."""

  vector: Any
  curvature: Any
  ok: Array | None
  clock: Array
  values: dict[str, Any]
  inputs_ok: Array | None = None


@dataclasses.dataclass(frozen=True, eq=False)
class Kfac:
  """K-FAC's curvature in an engine: the estimator's statistics and inverses on `schedule` after
  `config.burn_in_steps`; the refresh's damping is the step's plus `damping_shift` (`l2_reg`)."""

  schedule: Schedule
  config: _config.Config
  damping_shift: float = 0.0
  _estimators: _fit.Memo = dataclasses.field(default_factory=lambda: _fit.Memo(4), repr=False)
  takes_stats: ClassVar[bool] = True

  def bind(self, registration, kept, who: str) -> _estimator.CurvatureEstimator:
    """The estimator of `registration` (of the share `kept`'s layers), built once."""
    only = None if kept is None else _share_layers(registration, kept, who)
    config = self.config.read_by("CurvatureEstimator")
    make = lambda: _estimator.CurvatureEstimator(registration, config=config, only=only)
    return self._estimators((registration, only), make)

  def init(self, bound: Bound, placement: Placement, params) -> _estimator.EstimatorState:
    del params
    return bound.estimator.init(axis_name=placement.axis_name, mesh=placement.mesh)

  def check(self, bound: Bound, state, stats, who: str) -> None:
    if stats is not None:  # Another mode or layer set, named by the estimator.
      bound.estimator.check_stats(stats, f"this {who} transform")

  def fits_by_shape(self, bound: Bound) -> bool:
    """Whether the engine fit-checks the state (a sharded one's storage checks its buffers)."""
    return isinstance(bound.estimator.storage, _storage.ReplicatedStorage)

  def step(self, bound: Bound, placement: Placement, curv, work: Work):
    """`(F̂_λ⁻¹ vector, the new estimator state, the verdict)`. With `k = count −
    burn_in_steps`: the statistics fold into the EMA when `k < 0` or `k % curvature_every ==
    0`, the inverses are refreshed when `k >= 0` and `k % inverse_every == 0`, and the vector
    is preconditioned with the refreshed inverses (zeros during burn-in)."""
    est, schedule, ok = bound.estimator, self.schedule, work.ok
    burn = self.config.burn_in_steps
    k = work.counter - burn if burn else work.counter
    in_burn = (k < 0) if burn else None
    curv, ok = self._fold(est, placement, curv, work, k, in_burn)
    due = k % jnp.asarray(schedule.inverse_every, k.dtype) == 0
    for gate in (None if in_burn is None else ~in_burn, ok):
      due = due if gate is None else due & gate
    curv = self._refresh(est, placement, curv, work, due)
    vector = bound.fill(work.vector)

    def precondition():
      pre = est._power(curv, vector, -1.0, placement.axis_name, placement.mesh)
      return jax.tree_util.tree_map(lambda n, u: n.astype(u.dtype), pre, vector)

    zeros = lambda: optax.tree_utils.tree_zeros_like(vector)  # noqa: E731
    pre = precondition() if in_burn is None else jax.lax.cond(in_burn, zeros, precondition)
    if ok is not None:
      ok = ok & _storage.all_finite(pre)
    mesh = placement.mesh
    if mesh is not None and isinstance(est.storage, _storage.ReplicatedStorage):
      # Replicated as `init` made it: XLA's propagation would split some inverses the sharded
      # gradient meets, and a state of other shardings compiles the next step again.
      every = jax.sharding.NamedSharding(_parallel.mesh_axis(mesh)[0], jax.sharding.PartitionSpec())
      constrain = lambda t: jax.lax.with_sharding_constraint(t, every)  # noqa: E731
      curv = curv._replace(factors=constrain(curv.factors), cache=constrain(curv.cache))
    return bound.unfill(pre, work.vector), curv, ok

  def _fold(self, est, placement: Placement, old, work: Work, k, in_burn):
    """The state after this step's fold (when due and the verdict holds), and the verdict
    with the statistics' own."""
    every_step = type(self.schedule.curvature_every) is int and self.schedule.curvature_every == 1
    due = None if every_step else k % jnp.asarray(self.schedule.curvature_every, k.dtype) == 0
    if in_burn is not None and due is not None:
      due = due | in_burn
    if work.ok is not None:
      due = work.ok if due is None else due & work.ok
    # Statistics due on every step are formed outside any cond (a skipped step forms them for
    # nothing): inside a cond branch XLA:CPU runs some pull-backs (convolutions) far slower.
    now = work.statistics() if every_step else None

    def fold():
      stats = now if now is not None else work.statistics()
      new = est._fold(old, stats, self.schedule.ema_decay, placement.axis_name, placement.mesh)
      return new.factors, new.ema_weight, new.skipped_batches

    keep = lambda: (old.factors, old.ema_weight, old.skipped_batches)  # noqa: E731
    factors, weight, skipped = fold() if due is None else jax.lax.cond(due, fold, keep)
    curv = old._replace(factors=factors, ema_weight=weight, skipped_batches=skipped)
    ok = None if work.ok is None else work.ok & (skipped == old.skipped_batches)
    return curv, ok

  def _refresh(self, est, placement: Placement, before, work: Work, due):
    """The state after this step's refresh (when `due`); a block whose new cache is not finite
    keeps its old one, reported once by name."""
    damping = work.values["damping"]
    damping = damping + self.damping_shift if self.damping_shift else damping

    def refresh():
      new, flags = est._refresh_flagged(before, damping, placement.axis_name, placement.mesh)
      return new.cache, new.failed_inverses, flags

    def keep():
      return before.cache, before.failed_inverses, jnp.zeros((len(est.names),), bool)

    cache, count, failed = jax.lax.cond(due, refresh, keep)
    if (reporter := work.reporter) is not None:
      blocks = tuple(
        f"`{n}` ({(b.spec.block or type(b)).__name__})" for n, b in zip(est.names, est.blocks)
      )
      report = lambda step, f, lam: reporter.inverses(blocks, step, f, lam)  # noqa: E731
      reporter.when_bad(~jnp.any(failed), report, work.clock, failed, damping)
    return before._replace(cache=cache, failed_inverses=count)


@dataclasses.dataclass(frozen=True, eq=False)
class Engine:
  """A front's step contract. `who` names the front in messages; `curvature` has `bind`,
  `init`, `check`, `fits_by_shape` and `step`; `transform`: an optax transform (takes a share)."""

  who: str
  source: Source
  config: _config.Config
  placement: Placement
  curvature: Any
  state_type: type
  transform: bool
  reporter: Reporter

  @classmethod
  def build(
    cls,
    who: str,
    source: tuple[Any, Any, Any],
    curvature,
    *,
    axis_name,
    config,
    state_type: type,
    transform: bool = False,
    defaults=None,
  ) -> Engine:
    """A front's engine, every argument checked; `source`: `(loss_fn, example_batch,
    registration)`; `curvature`: `config -> curvature`; `defaults`: a built registration's."""
    config = _config.get(config, who)
    placement = Placement.checked(axis_name, config)
    reporter = Reporter(who, chained=transform, in_step=config.step_warnings)
    made = Source(*source, who, defaults)
    return cls(who, made, config, placement, curvature(config), state_type, transform, reporter)

  @classmethod
  def kfac(cls, who: str, source, schedule: Schedule, *, damping_shift: float = 0.0, **kw):
    """A K-FAC front's engine (`build` with `Kfac`)."""
    return cls.build(who, source, lambda config: Kfac(schedule, config, damping_shift), **kw)

  def bind(self, params) -> Bound:
    """The front bound to `params` (see `Bound`); `params` are checked against the
    registration's signature."""
    kept = masked_share(params) if self.transform else None
    if kept is None:
      reg = self.source.for_params(params, self.placement.axis_name)
      return Bound(reg, self.curvature.bind(reg, None, self.who), None)
    known = self.source.known
    if known is None:
      raise ValueError(
        f"{self.who}: `params` has optax.MaskedNode leaves (a share from optax.multi_transform "
        "or optax.masked), without which the model cannot be traced: pass `registration=reg`, "
        "reg = kfac_jax.Registration(loss_fn, whole_params, batch), to it and to value_and_grad."
      )
    known.check_params(Bound(known, None, kept).fill(params, abstract=True))
    return Bound(known, self.curvature.bind(known, kept, self.who), kept)

  def check(self, bound: Bound, state, expected, *, vector=None, stats=None, batch=None, rng=None):
    """The checks, cheapest first: the state's type; the statistics' source (`stats`, else
    `batch` and `rng`) and a share's `vector`; the axis; the state's fit to `expected`."""
    who, takes_stats = self.who, self.curvature.takes_stats
    if not isinstance(state, self.state_type):
      kind = "optimizer" if who == "Optimizer" else "transform"
      raise TypeError(
        f"{who}: `state` must be the {self.state_type.__name__} from this {kind}'s init, got "
        f"{type(state).__name__} (kfac_jax.restore_state rebuilds one saved as an object array)."
      )
    if stats is not None and not takes_stats:
      raise ValueError(
        f"{who}: `curvature_stats` are K-FAC's per-layer statistics, and this front needs the "
        "batch's per-example rows: pass `batch=` (and `rng=`)."
      )
    if stats is None and batch is None:
      stats_or = "`curvature_stats=` (from kfac_jax.value_and_grad) or " if takes_stats else ""
      raise ValueError(f"{who}: pass {stats_or}`batch=` (and `rng=`) to tx.update.")
    if bound.kept is not None:
      if masked_share(vector) != bound.kept:
        raise ValueError(f"{who}: `updates` and `params` must share their MaskedNode leaves.")
      if stats is None and takes_stats:
        raise ValueError(
          f"{who}: `params` is a share (optax.MaskedNode leaves), so it cannot trace the model on "
          "`batch=`: pass `curvature_stats=` from value_and_grad(registration=reg) of all params."
        )
    if vector is not None:
      _check_vector(bound, vector, who)
    if stats is None:
      _curvature.check_rng(bound.registration.estimation_mode, rng, batch, who)
    self.curvature.check(bound, state, stats, who)
    if self.placement.mesh is None:
      _checks.axis_bound(self.placement.axis_name, who)
    else:
      _parallel.mesh_axis(self.placement.mesh)
    if self.curvature.fits_by_shape(bound):
      _fit.check(expected, state, who)

  def step(self, bound: Bound, count, skipped, curvature, inputs: Inputs) -> Step:
    """One step: the hyperparameters' values at `count + skipped`, their and the inputs'
    verdict, then the curvature's step and its verdict."""
    clock = count + skipped
    values = {n: v(clock) if callable(v) else v for n, (v, _) in inputs.hyperparameters.items()}
    guard = self.config.skip_nonfinite
    lows = {n: (values[n], low) for n, (_, low) in inputs.hyperparameters.items()}
    usable = hyperparameters_ok(self.reporter, lows, clock, guard)
    finite = inputs_ok(self.reporter, inputs.finite, clock, guard)
    ok = (finite if usable is None else finite & usable) if guard else None
    work = Work(inputs.vector, inputs.statistics, count, values, ok, clock, self.reporter)
    pre, curvature, ok = self.curvature.step(bound, self.placement, curvature, work)
    return Step(pre, curvature, ok, clock, values, work.ok)


def _check_vector(bound: Bound, vector, who: str) -> None:
  """ValueError naming the first leaf of the updates whose shape or dtype is not its params
  leaf's (the rest of a chain keeps the params' dtypes)."""
  reg = bound.registration
  filled = bound.fill(vector, abstract=True)
  paths = _specs.param_paths(filled)
  if paths != reg.param_paths:
    return  # Another structure: the estimator's products name the leaves that differ.
  leaves = jax.tree_util.tree_leaves(filled)
  for path, x, shape, dtype in zip(paths, leaves, reg.param_shapes, reg.param_dtypes):
    got = (tuple(jnp.shape(x)), str(jnp.result_type(x)))
    if got != (shape, dtype):
      raise ValueError(
        f"{who}: `updates` leaf `{path}` has shape {got[0]} and dtype {got[1]}, but the params "
        f"leaf has shape {shape} and dtype {dtype}: cast the updates "
        "(`optax.tree_utils.tree_cast_like(updates, params)`) or differentiate at the params."
      )


def _share_layers(reg: _registration.Registration, kept, who: str) -> tuple[str, ...]:
  """The block names of the layers wholly inside the share `kept` (per registered leaf); a
  layer with leaves on both sides raises ValueError naming it and both sets of leaves."""
  paths, names = reg.param_paths, []
  for name, spec in zip(reg.block_names, reg.layers):
    inside = [f"`{paths[j]}`" for j in spec.leaf_indices if kept[j]]
    outside = [f"`{paths[j]}`" for j in spec.leaf_indices if not kept[j]]
    if inside and outside:
      raise ValueError(
        f"{who}: layer `{name}` has {', '.join(inside)} in this transform's share of the "
        f"parameters and {', '.join(outside)} outside it, but one curvature block spans them: "
        "give the whole layer one optax.multi_transform / optax.masked label."
      )
    if inside:
      names.append(name)
  return tuple(names)
