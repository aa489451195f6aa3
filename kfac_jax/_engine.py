"""The contract of a front's step, in one place: `scale_by_kfac`, `kfac`, the `Optimizer`,
`scale_by_kernel_ngd` and `kernel_ngd` only configure an `Engine` and add what is their own.

An `Engine` is built once from a front's arguments, each checked then: where its registration
comes from (`Source`), its `Config`, its curvature (`Kfac` here; the sample-space kernel in
`kfac_jax.kernel`) and its `Placement` on a data-parallel axis or mesh. Each update then runs,
in this order:

- `Engine.bind(params)`: the registration for these params (a front given only `loss_fn`
  builds it from the first params it sees) and the curvature's part for them (K-FAC's
  estimator, restricted to the share of an `optax.multi_transform` / `optax.masked`);
- `Engine.check(...)`: one check sequence, cheapest first: the state's type, where the
  statistics come from, the rng, the axis, and last the state's fit to the front's init (once
  per update; the estimator's own methods, called directly, check it again);
- `Engine.step(...)`: the hyperparameters' values at this step (schedules are called with
  `count + skipped`, every update seen) and their verdict, the inputs' verdict (a non-finite
  gradient, params or loss), then the curvature's step and the verdict on what it gives.

K-FAC's step (`Kfac`): each schedule decision is a `lax.cond` that carries only what it can
change (the fold: the factors, the EMA weight and the skipped-batch counter; the refresh: the
caches and the failure counter): XLA copies an operand that passes through a cond unchanged,
and an elementwise `where(ok, new, old)` over the state writes a third copy. Both are gated on
the verdict on the inputs, so no guard ever has to restore the factors or the caches.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from kfac_jax import (
  _checks,
  _config,
  _curvature,
  _errors,
  _estimator,
  _fit,
  _parallel,
  _registration,
  _specs,
  _storage,
)

Array = jax.Array

# Each input of a step: how a warning names it and where a non-finite one comes from.
_INPUTS = {
  "gradient": ("the gradient is", "A non-finite batch or a loss that overflows gives one."),
  "loss": ("the loss is", "A non-finite batch or a loss that overflows gives one."),
  "params": ("the params are", "The update applied before this step was not finite."),
}
_CHAINED = (
  " A transform chained after this one (a schedule, a scale) or the code applying the updates "
  "can make it so: `kfac_jax.kfac(learning_rate=schedule)` checks a schedule's values and skips "
  "the steps they are not usable for."
)


class Reporter:
  """Warns, from the host, the first time each hyperparameter, input or inverse of one front is
  bad (one warning per name, whichever device or step reports it). `chained`: the front is an
  optax transform, whose updates the rest of a user's chain can make non-finite. `in_step`
  (`Config.step_warnings`): a compiled step warns too, through a host callback, which keeps JAX
  from storing the step in its persistent compilation cache; without it only eager calls warn
  and the state's counters (`skipped`, `curvature.failed_inverses`) tell."""

  def __init__(self, who: str, *, chained: bool = False, in_step: bool = False):
    self.who = who
    self.chained = chained
    self.in_step = in_step
    self._seen: set[str] = set()

  def when_bad(self, ok: Array, report: Callable, *args) -> None:
    """`report(*args)` from the host when `ok` is False; an arg may be a function of no
    arguments that computes it (on a bad step only). Concrete (an eager step): at once;
    traced, with `in_step`: a host callback inside a `lax.cond` that runs nothing on a good
    step; traced without it: nothing."""

    def values():
      return [a() if callable(a) else a for a in args]

    if not _checks.is_traced(ok):
      if not bool(ok):
        report(*values())
    elif self.in_step:
      jax.lax.cond(ok, lambda: None, lambda: jax.debug.callback(report, *values()))

  def hyperparameters(self, names: tuple[str, ...], lows: tuple, step, values, goods, skipped):
    step = np.asarray(step).ravel()
    for name, low, value, good in zip(names, lows, values, goods):
      bad = ~np.asarray(good, bool).ravel()
      if name in self._seen or not bad.any():
        continue
      self._seen.add(name)
      value = np.asarray(value).ravel()[np.argmax(bad)]
      at = int(step[np.argmax(bad) % step.size])
      rule = "finite" if low is None else f"finite and >= {low}"
      warnings.warn(
        f"{self.who}: the schedule of `{name}` gave {value} at step {at} (it must be {rule}); "
        + ("the step is skipped. " if skipped else "`Config.skip_nonfinite` is off: it is used. ")
        + "This warning is given once per hyperparameter.",
        _errors.HyperparameterWarning,
        stacklevel=2,
      )

  def inputs(self, names: tuple[str, ...], paths: tuple, step, flags, skipped: bool):
    """Warns the first time each input (`names`; `paths` names each one's leaves) has a leaf
    that is not finite (`flags`: per input, per device and leaf, whether it is finite)."""
    step = int(np.asarray(step).ravel()[0])
    goods: dict[str, list[bool]] = {}
    for n, p, f in zip(names, paths, flags):
      per_device = np.asarray(f, bool).reshape(-1, len(p))
      goods[n] = [bool(per_device[:, i].all()) for i in range(len(p))]
    # The first bad input in this order is the one named: bad params make the rest so, and a
    # bad loss comes with a bad gradient.
    bad_ones = [n for n in ("params", "gradient", "loss") if n in goods and not all(goods[n])]
    if not bad_ones or f"input:{bad_ones[0]}" in self._seen:
      return
    name = bad_ones[0]
    self._seen.add(f"input:{name}")
    bad = [f"`{p}`" for p, g in zip(paths[names.index(name)], goods[name]) if not g and p]
    where = ", ".join(bad[:4]) + (f" and {len(bad) - 4} more" if len(bad) > 4 else "")
    subject, cause = _INPUTS[name]
    warnings.warn(
      f"{self.who}: {subject} not finite at step {step}"
      + (f" (in {where}). " if where else ". ")
      + cause
      + (_CHAINED if name == "params" and self.chained else "")
      + (
        " The step is skipped and the curvature is left as it was."
        if skipped
        else " `Config.skip_nonfinite` is off: the update is used (the curvature keeps no "
        "non-finite statistics)."
      )
      + " This warning is given once per input.",
      _errors.NonFiniteWarning,
      stacklevel=2,
    )

  def once(self, key: str, message: str, category: type[Warning]) -> None:
    """Warns `message` unless a warning of `key` was given before."""
    if key in self._seen:
      return
    self._seen.add(key)
    warnings.warn(message, category, stacklevel=3)

  def inverses(self, blocks: tuple[str, ...], step, failed, damping) -> None:
    """Warns the first time each block (`blocks`: its layer's name and block class) has a
    refreshed cache (`failed`: per block, per device) that is not finite."""
    per_device = np.asarray(failed, bool).reshape(-1, len(blocks))
    step = int(np.asarray(step).ravel()[0])
    lam = float(np.asarray(damping).ravel()[0])
    for i, block in enumerate(blocks):
      if not per_device[:, i].any():
        continue
      self.once(
        f"inverse:{block}",
        f"{self.who}: the refreshed inverse of {block} was not finite at step {step} (damping "
        f"{lam:g}): the layer keeps its previous inverse (the identity before its first good "
        "refresh, so its update is then its plain gradient's), and "
        "`curvature.failed_inverses` in the state counts the failures. Raise the damping, or "
        "for a block of your own (LayerConfig.blocks) make its compute_cache finite on these "
        "statistics. This warning is given once per layer.",
        _errors.FailedInverseWarning,
      )


def _leaf_names(tree) -> list[str]:
  return [
    "/".join(_specs.key_name(k) for k in path)
    for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]
  ]


def _up(x) -> Array:
  x = jnp.asarray(x)
  return x.astype(jnp.promote_types(x.dtype, jnp.float32))


def inputs_ok(reporter: Reporter, inputs: Mapping[str, Any], clock, skipped: bool) -> Array:
  """Whether every leaf of `inputs` (name → pytree: "gradient", "params", "loss") is finite.

  Trees of one structure and shapes (the gradient and the params) are added leaf by leaf before
  `_storage.all_finite`'s sums, so the verdict costs one pass over them (a sum of finite values
  is finite; an overflow errs on the side of a skip). A non-finite input is reported once per
  name by `reporter` (`Reporter.when_bad`), naming the step and the leaves.
  """
  trees = {n: t for n, t in inputs.items() if jax.tree_util.tree_leaves(t)}
  groups: list[list[Any]] = []  # Trees whose leaves can be added position by position.
  for t in trees.values():
    shapes = [jnp.shape(x) for x in jax.tree_util.tree_leaves(t)]
    for g in groups:
      if [jnp.shape(x) for x in jax.tree_util.tree_leaves(g[0])] == shapes:
        g.append(t)
        break
    else:
      groups.append([t])
  sums = [
    [sum(_up(x) for x in xs) for xs in zip(*(jax.tree_util.tree_leaves(t) for t in g))]
    for g in groups
  ]
  ok = _storage.all_finite(sums)
  names = tuple(trees)
  paths = tuple(_leaf_names(t) for t in trees.values())

  def flags():  # Per leaf, through its sum (as `_storage.all_finite`): one reduction each.
    return [
      jnp.isfinite(jnp.stack([jnp.sum(_up(x)) for x in jax.tree_util.tree_leaves(t)]))
      for t in trees.values()
    ]

  reporter.when_bad(
    ok, lambda step, f: reporter.inputs(names, paths, step, f, skipped), clock, flags
  )
  return ok


def hyperparameters_ok(
  reporter: Reporter, values: Mapping[str, tuple[Any, float | None]], clock, skipped: bool
) -> Array | None:
  """Whether this step's hyperparameter values are usable: `values` maps a name to `(value,
  low)`, the value finite and, with `low`, at least `low`. Python numbers (checked on
  construction) are not looked at; None when nothing is. A bad value is reported by `reporter`
  (`Reporter.when_bad`)."""
  checked = {
    n: (jnp.asarray(x), low)
    for n, (x, low) in values.items()
    if x is not None and not isinstance(x, (int, float))
  }
  if not checked:
    return None
  names, lows = tuple(checked), tuple(low for _, low in checked.values())
  xs = [x for x, _ in checked.values()]
  goods = [
    jnp.isfinite(x) if low is None else jnp.isfinite(x) & (x >= low) for x, low in checked.values()
  ]
  ok = jnp.all(jnp.stack([jnp.all(g) for g in goods]))
  reporter.when_bad(
    ok,
    lambda step, xs, goods: reporter.hyperparameters(names, lows, step, xs, goods, skipped),
    clock,
    xs,
    goods,
  )
  return ok


def tree_vdot(a, b) -> Array:
  """Σ over leaves of ⟨a, b⟩, accumulated in at least float32 (bfloat16 params), also for
  leaves sharded over explicit mesh axes."""
  return sum(  # type: ignore[return-value]  # an Array: params have leaves
    _parallel.vdot(_up(x), _up(y))
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b))
  )


# -- the records a front is built from -----------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Schedule:
  """When the curvature moves: the EMA's decay, and the periods (in updates) of the statistics'
  fold and of the inverses' refresh, both after `burn_in_steps` updates that only fold. Numbers,
  or (with `optax.inject_hyperparams`) arrays."""

  ema_decay: Any
  inverse_every: Any
  curvature_every: Any
  burn_in_steps: int = 0

  @classmethod
  def checked(cls, ema_decay, inverse_every, curvature_every, burn_in_steps: int = 0) -> Schedule:
    _checks.number(ema_decay, "ema_decay", low=0.0, high=1.0, high_open=True)
    _checks.positive_int(inverse_every, "inverse_every")
    _checks.positive_int(curvature_every, "curvature_every")
    return cls(ema_decay, inverse_every, curvature_every, burn_in_steps)


@dataclasses.dataclass(frozen=True)
class Placement:
  """Where a front's step runs: inside `pmap` / `shard_map` over `axis_name` (means over it, the
  inverse work split over it), or under plain `jit` with data sharded over `mesh`'s axis."""

  axis_name: str | None = None
  mesh: tuple[jax.sharding.Mesh, str] | None = None

  @classmethod
  def checked(cls, axis_name, config: _config.Config) -> Placement:
    _checks.optional_str(axis_name, "axis_name")
    if config.mesh is not None and axis_name is not None:
      raise ValueError(
        "pass `axis_name` (inside pmap/shard_map) or `config.mesh` (under jit with sharded "
        "data), not both: with `axis_name` the inverse work is already split over that axis."
      )
    if isinstance(config.storage, _storage.ShardedStorage) and config.mesh is None:
      if axis_name is None:
        raise ValueError(
          "inverse_storage='sharded' splits the inverses over the devices of a data-parallel "
          "axis: pass `axis_name=` (inside pmap/shard_map) or `config.mesh=(mesh, axis)` (under "
          "jit with sharded data), or keep inverse_storage='replicated' on one device."
        )
    return cls(axis_name, config.mesh)

  def mean(self, tree):
    """`tree` averaged over `axis_name` (as is without one)."""
    return tree if self.axis_name is None else jax.lax.pmean(tree, self.axis_name)


class Source:
  """Where a front's registration comes from: the one given (`registration=`), or one built with
  the front's default settings (`defaults`, e.g. the kernel's exact estimation mode) from
  `loss_fn`, `example_batch` and the first params its `init` sees.

  The built one is kept (the front's state is tied to its layers): later params must have its
  signature, and an error names the first leaf that differs.
  """

  def __init__(self, loss_fn, example_batch, registration, who: str, defaults=None):
    self.given = _registration.shared(registration, loss_fn, who, ("example_batch", example_batch))
    self.loss_fn, self.example_batch = loss_fn, example_batch
    self.defaults = dict(defaults or {})
    self._built: _registration.Registration | None = self.given

  @property
  def known(self) -> _registration.Registration | None:
    """The registration, once given or built (else None)."""
    return self._built

  def for_params(self, params, collective_axes=None) -> _registration.Registration:
    """The registration for `params`, built from them on first use (`collective_axes`: the
    front's data-parallel axis, which the model's own collectives may use too), checked against
    them. A tree without leaves is `optax.tree_map_params`' placeholder, which asks only for the
    state's structure: the known registration, unchecked."""
    if self._built is not None and not jax.tree_util.tree_leaves(params):
      return self._built
    if self._built is None:
      self._built = _registration.Registration(
        self.loss_fn, params, self.example_batch, collective_axes=collective_axes, **self.defaults
      )
    self._built.check_params(params)
    return self._built


# -- a front, bound to its params ------------------------------------------------------------------


def _is_masked(x) -> bool:
  return isinstance(x, optax.MaskedNode)


def masked_share(tree) -> tuple[bool, ...] | None:
  """Per leaf of `tree`, masked ones included, whether it is not an `optax.MaskedNode` (the share
  `optax.multi_transform` / `optax.masked` hand a transform); None when none is masked."""
  kept = tuple(not _is_masked(x) for x in jax.tree_util.tree_leaves(tree, is_leaf=_is_masked))
  return None if all(kept) else kept


class Bound(NamedTuple):
  """A front bound to one params signature: its registration, the curvature's part for it
  (K-FAC's estimator; None for the kernel) and, for a share of the params, per registered leaf
  whether it is in the share."""

  registration: _registration.Registration
  estimator: Any
  kept: tuple[bool, ...] | None

  def fill(self, share, abstract: bool = False):
    """`share` with its masked leaves replaced by zeros of the registered shapes and dtypes
    (`jax.ShapeDtypeStruct`s with `abstract`): the whole params' structure."""
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
    leaves = jax.tree_util.tree_leaves(full)
    return jax.tree_util.tree_unflatten(
      treedef, [x if _is_masked(x) else y for x, y in zip(flat, leaves)]
    )


class Inputs(NamedTuple):
  """What one update hands the engine's step.

  Attributes:
    vector: the params-shaped (or share-shaped) vector to precondition: the gradient.
    statistics: a function of no arguments computing this batch's curvature data (K-FAC's
      `CurvatureStats`, the kernel's rows), called where the curvature needs them.
    finite: name → pytree, the inputs whose non-finite leaves skip the step ("gradient",
      "params", "loss").
    hyperparameters: name → `(value or schedule count -> value, low or None)`: "damping" and
      the front's others; a schedule is called with the step's clock.
  """

  vector: Any
  statistics: Callable[[], Any]
  finite: Mapping[str, Any]
  hyperparameters: Mapping[str, tuple[Any, float | None]]


class Work(NamedTuple):
  """What a curvature's step is given: the vector, the statistics' thunk, the update counter,
  this step's hyperparameter values, the verdict so far (None with the guard off), and the
  step's clock and the front's reporter (for the curvature's own warnings)."""

  vector: Any
  statistics: Callable[[], Any]
  counter: Array
  values: dict[str, Any]
  ok: Array | None
  clock: Array | None = None
  reporter: Reporter | None = None


class Step(NamedTuple):
  """What the engine's step gives back.

  Attributes:
    vector: the preconditioned vector in the input's structure and dtypes (as computed on a
      skipped step: the front zeroes what it returns).
    curvature: the curvature's new state (moved only with a good verdict).
    ok: `[]` bool, the verdict: usable hyperparameters, finite inputs, statistics and vector;
      None with `Config.skip_nonfinite` off.
    clock: `[]` int, `count + skipped`: what the schedules were called with.
    values: the hyperparameters' values at this step.
    inputs_ok: the verdict on the hyperparameters and inputs alone (None with the guard off):
      with `ok` False, whether the curvature's own step failed.
  """

  vector: Any
  curvature: Any
  ok: Array | None
  clock: Array
  values: dict[str, Any]
  inputs_ok: Array | None = None


@dataclasses.dataclass(frozen=True, eq=False)
class Kfac:
  """K-FAC's curvature in an engine: the estimator's averaged statistics and damped inverses,
  folded and refreshed on `schedule` (the module docstring), the refresh's damping the step's
  "damping" value plus `damping_shift` (the `Optimizer`'s `l2_reg` η: the curvature η I of an
  L2 term `(η/2)‖θ‖²` in the user's loss)."""

  schedule: Schedule
  config: _config.Config
  damping_shift: float = 0.0
  _estimators: _fit.Memo = dataclasses.field(default_factory=lambda: _fit.Memo(4), repr=False)
  takes_stats: ClassVar[bool] = True

  def bind(self, registration, kept, who: str) -> _estimator.CurvatureEstimator:
    """The estimator of `registration` (of the share `kept`'s layers), built once."""
    only = None if kept is None else _share_layers(registration, kept, who)
    return self._estimators(
      (registration, only),
      lambda: _estimator.CurvatureEstimator(
        registration, config=self.config.read_by("CurvatureEstimator"), only=only
      ),
    )

  def init(self, bound: Bound, placement: Placement, params) -> _estimator.EstimatorState:
    del params
    return bound.estimator.init(axis_name=placement.axis_name, mesh=placement.mesh)

  def step(self, bound: Bound, placement: Placement, curv, work: Work):
    """`(F̂_λ⁻¹ vector, the new estimator state, the verdict)`: with `k = count -
    burn_in_steps`, the statistics fold into the EMA when `k < 0` (burn-in) or `k %
    curvature_every == 0`; the inverses are refreshed when `k >= 0` and `k % inverse_every ==
    0`; the vector is preconditioned with the refreshed inverses (zeros during burn-in)."""
    est, schedule, axis, mesh = bound.estimator, self.schedule, placement.axis_name, placement.mesh
    vector, ok, old = bound.fill(work.vector), work.ok, curv
    damping = work.values["damping"]
    damping = damping + self.damping_shift if self.damping_shift else damping
    burn = schedule.burn_in_steps
    k = work.counter - burn if burn else work.counter
    in_burn = (k < 0) if burn else None

    # Statistics due on every step are formed outside any cond (a skipped step forms them for
    # nothing): inside a cond branch XLA:CPU runs some pull-backs (convolutions) far slower.
    every_step = type(schedule.curvature_every) is int and schedule.curvature_every == 1
    fold_due = None if every_step else k % jnp.asarray(schedule.curvature_every, k.dtype) == 0
    if in_burn is not None and fold_due is not None:
      fold_due = fold_due | in_burn
    if ok is not None:
      fold_due = ok if fold_due is None else fold_due & ok
    now = work.statistics() if every_step else None

    def fold():
      s = now if now is not None else work.statistics()
      return est._fold(old, s, schedule.ema_decay, axis, mesh)

    if fold_due is None:
      curv = fold()
    else:

      def parts(c):
        return c.factors, c.ema_weight, c.skipped_batches

      factors, weight, skipped = jax.lax.cond(fold_due, lambda: parts(fold()), lambda: parts(old))
      curv = old._replace(factors=factors, ema_weight=weight, skipped_batches=skipped)
    if ok is not None:  # The estimator skipped (and counted) non-finite statistics.
      ok = ok & (curv.skipped_batches == old.skipped_batches)

    refresh_due = k % jnp.asarray(schedule.inverse_every, k.dtype) == 0
    if in_burn is not None:
      refresh_due = refresh_due & ~in_burn
    if ok is not None:
      refresh_due = refresh_due & ok
    before = curv

    def refresh():
      new, flags = est._refresh_flagged(before, damping, axis, mesh)
      return new.cache, new.failed_inverses, flags

    def keep():
      return before.cache, before.failed_inverses, jnp.zeros((len(est.names),), bool)

    cache, count, failed = jax.lax.cond(refresh_due, refresh, keep)
    curv = curv._replace(cache=cache, failed_inverses=count)
    if work.reporter is not None:  # A block that kept its cache: once per layer, by name.
      reporter = work.reporter
      blocks = tuple(
        f"`{n}` ({(b.spec.block or type(b)).__name__})" for n, b in zip(est.names, est.blocks)
      )
      reporter.when_bad(
        ~jnp.any(failed),
        lambda step, f, lam: reporter.inverses(blocks, step, f, lam),
        work.clock,
        failed,
        damping,
      )

    def precondition():
      pre = est._power(curv, vector, -1.0, axis, mesh)
      return jax.tree_util.tree_map(lambda n, u: n.astype(u.dtype), pre, vector)

    if in_burn is None:
      pre = precondition()
    else:
      pre = jax.lax.cond(in_burn, lambda: optax.tree_utils.tree_zeros_like(vector), precondition)
    if ok is not None:
      ok = ok & _storage.all_finite(pre)
    if mesh is not None and isinstance(est.storage, _storage.ReplicatedStorage):
      # Replicated as `init` made it: XLA's propagation would split some inverses the sharded
      # gradient meets, and a state of other shardings compiles the next step again.
      every = jax.sharding.NamedSharding(_parallel.mesh_axis(mesh)[0], jax.sharding.PartitionSpec())
      curv = curv._replace(
        factors=jax.lax.with_sharding_constraint(curv.factors, every),
        cache=jax.lax.with_sharding_constraint(curv.cache, every),
      )
    return bound.unfill(pre, work.vector), curv, ok

  def check(self, bound: Bound, state, stats, who: str) -> None:
    """Statistics of another registration, and (sharded storage checks its own buffers) the
    rest of the state's fit are the engine's; the estimator names another mode or layer set."""
    if stats is not None:
      bound.estimator.check_stats(stats, f"this {who} transform")

  def fits_by_shape(self, bound: Bound) -> bool:
    return isinstance(bound.estimator.storage, _storage.ReplicatedStorage)


@dataclasses.dataclass(frozen=True, eq=False)
class Engine:
  """A front's step contract, bound to its arguments (see the module docstring).

  Attributes:
    who: the front's name in messages ("scale_by_kfac", "kfac", "Optimizer", ...).
    source: where its registration comes from.
    config: its `Config` (fields it does not read refused at construction).
    placement: its axis or mesh.
    curvature: what preconditions (`Kfac`, or the kernel's), with its `bind`, `init`,
      `check`, `step`.
    state_type: the type of the front's state, checked first on every update.
    transform: whether it is an optax transform: it takes a share of the params
      (`optax.multi_transform`), and the rest of a user's chain acts on its updates.
    reporter: its warnings (one per hyperparameter or input).
  """

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
    """A front's engine; `source` is its `(loss_fn, example_batch, registration)` arguments,
    `curvature` a function `config -> curvature` (the config checked first), `defaults` the
    settings of a registration it builds itself. Every argument is checked here, before any
    state exists."""
    config = _config.get(config, who)
    placement = Placement.checked(axis_name, config)
    reporter = Reporter(who, chained=transform, in_step=config.step_warnings)
    made = Source(*source, who, defaults)
    return cls(who, made, config, placement, curvature(config), state_type, transform, reporter)

  @classmethod
  def kfac(cls, who: str, source, schedule: Schedule, *, damping_shift: float = 0.0, **kw):
    """A K-FAC front's engine (`build` with `Kfac`; `config.burn_in_steps` joins `schedule`)."""

    def curvature(config):
      burn = dataclasses.replace(schedule, burn_in_steps=config.burn_in_steps)
      return Kfac(burn, config, damping_shift)

    return cls.build(who, source, curvature, **kw)

  # -- binding and checks ----------------------------------------------------------------------

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
        f"{self.who}: `params` has optax.MaskedNode leaves: optax.multi_transform or "
        "optax.masked hands this transform only its share of the parameters, and the model "
        "cannot be traced without the rest. Build the layers from the whole params, "
        "`reg = kfac_jax.Registration(loss_fn, params, batch)`, and pass `registration=reg` "
        f"to {self.who} and to kfac_jax.value_and_grad."
      )
    known.check_params(Bound(known, None, kept).fill(params, abstract=True))
    return Bound(known, self.curvature.bind(known, kept, self.who), kept)

  def check(self, bound: Bound, state, expected, *, vector=None, stats=None, batch=None, rng=None):
    """The check sequence, cheapest first: the state's type; where the statistics come from
    (`stats`, else `batch` and, in a sampled estimation mode, `rng`), and for a share that
    `vector` is the same share; the axis; the state's fit to `expected` (the front's init, as
    shapes). A sharded state's buffers are checked by its storage."""
    who, takes_stats = self.who, self.curvature.takes_stats
    if not isinstance(state, self.state_type):
      raise TypeError(
        f"{who}: `state` must be the {self.state_type.__name__} from this "
        f"{'optimizer' if who == 'Optimizer' else 'transform'}'s init, got "
        f"{type(state).__name__} (a state saved as a NumPy object array is rebuilt by "
        "kfac_jax.restore_state)."
      )
    if stats is not None and not takes_stats:
      raise ValueError(
        f"{who}: `curvature_stats` are K-FAC's per-layer statistics; this front solves in "
        "sample space from the batch's per-example rows: pass `batch=` (and `rng=`) instead."
      )
    if stats is None and batch is None:
      raise ValueError(
        f"{who}: pass "
        + ("`curvature_stats=` (from kfac_jax.value_and_grad) or " if takes_stats else "")
        + "`batch=` (and `rng=`) to tx.update, so the curvature can be estimated."
      )
    if bound.kept is not None:
      if masked_share(vector) != bound.kept:
        raise ValueError(
          f"{who}: `updates` and `params` must be the same share of the parameters (the same "
          "optax.MaskedNode leaves)."
        )
      if stats is None and takes_stats:
        raise ValueError(
          f"{who}: `params` has optax.MaskedNode leaves (optax.multi_transform or "
          "optax.masked hands this transform only its share of the parameters), so it cannot "
          "trace the model on `batch=`: pass `curvature_stats=` from "
          "kfac_jax.value_and_grad(registration=reg)(params, batch, rng) on the whole params."
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

  def init(self, bound: Bound, params):
    """The curvature's initial state on this front's placement."""
    return self.curvature.init(bound, self.placement, params)

  def replicate(self, state, params):
    """A front's initial state replicated over the mesh its params (or `config.mesh`) use."""
    return _parallel.replicate_on_mesh(state, params, self.placement.mesh)

  # -- the step ----------------------------------------------------------------------------------

  def step(self, bound: Bound, count, skipped, curvature, inputs: Inputs) -> Step:
    """One step: the hyperparameters' values at `count + skipped` and their verdict, the
    inputs' verdict, then the curvature's step (which moves its state only on a good verdict)
    and its verdict."""
    clock = count + skipped
    values = {n: v(clock) if callable(v) else v for n, (v, _) in inputs.hyperparameters.items()}
    guard = self.config.skip_nonfinite
    lows = {n: (values[n], low) for n, (_, low) in inputs.hyperparameters.items()}
    usable = hyperparameters_ok(self.reporter, lows, clock, guard)
    finite = inputs_ok(self.reporter, inputs.finite, clock, guard)
    ok = None
    if guard:
      ok = finite if usable is None else finite & usable
    work = Work(inputs.vector, inputs.statistics, count, values, ok, clock, self.reporter)
    pre, curvature, ok = self.curvature.step(bound, self.placement, curvature, work)
    return Step(pre, curvature, ok, clock, values, work.ok)


def _check_vector(bound: Bound, vector, who: str) -> None:
  """ValueError naming the first leaf of `vector` (the updates) whose shape or dtype is not its
  params leaf's: the preconditioned vector comes back in the updates' dtypes, which the rest of
  a chain (its momentum, kept in the params' dtypes) must match."""
  reg = bound.registration
  filled = bound.fill(vector, abstract=True)
  paths = _specs.param_paths(filled)
  if paths != reg.param_paths:
    return  # Another structure: the estimator's products name the leaves that differ.
  for path, x, shape, dtype in zip(
    paths, jax.tree_util.tree_leaves(filled), reg.param_shapes, reg.param_dtypes
  ):
    got = (tuple(jnp.shape(x)), str(jnp.result_type(x)))
    if got != (shape, dtype):
      raise ValueError(
        f"{who}: `updates` leaf `{path}` has shape {got[0]} and dtype {got[1]}, but the params "
        f"leaf has shape {shape} and dtype {dtype}: tx.update(updates, state, params) needs "
        "updates of the params' shapes and dtypes (a gradient of these params has them). Cast "
        "them, e.g. `optax.tree_utils.tree_cast_like(updates, params)`, or compute the gradient "
        "at the params as they are."
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
        f"parameters and {', '.join(outside)} outside it (optax.multi_transform / "
        "optax.masked gave them other labels). Its curvature block spans all of them: give "
        "the whole layer one label."
      )
    if inside:
      names.append(name)
  return tuple(names)
