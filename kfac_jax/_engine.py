"""The one K-FAC step, shared by `scale_by_kfac` / `kfac` and `Optimizer`: fold the statistics,
refresh the inverses, precondition, and the guard's verdict.

Each schedule decision is a `lax.cond` that carries only what it can change (the fold: the
factors, the EMA weight and the skipped-batch counter; the refresh: the caches and the failure
counter): XLA copies an operand that passes through a cond unchanged, and an elementwise
`where(ok, new, old)` over the state writes a third copy. Both are gated on the verdict on the
inputs, so no guard ever has to restore the factors or the caches.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kfac_jax import _checks, _curvature, _estimator, _parallel, _specs, _storage

Array = jax.Array


class HyperparameterWarning(UserWarning):
  """A schedule gave a hyperparameter that is not finite, or a negative learning rate or
  damping: the step it gave it for is skipped (with `Config.skip_nonfinite`)."""


class NonFiniteWarning(UserWarning):
  """A front was given a gradient, params or (the `Optimizer`) a loss that is not finite: the
  step is skipped (with `Config.skip_nonfinite`) and the curvature is left as it was."""


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
  """Warns, from the host, the first time each hyperparameter or input of one front is bad (one
  warning per name, whichever device or step reports it). `chained`: the front is an optax
  transform, whose updates the rest of a user's chain can make non-finite."""

  def __init__(self, who: str, *, chained: bool = False):
    self.who = who
    self.chained = chained
    self._seen: set[str] = set()

  def __call__(self, names: tuple[str, ...], lows: tuple, step, values, goods, skipped: bool):
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
        HyperparameterWarning,
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
      NonFiniteWarning,
      stacklevel=2,
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
  name by `reporter` from the host, naming the step and the leaves, inside a `lax.cond` that
  runs nothing on a good step.
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

  def flags():
    return [
      jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree_util.tree_leaves(t)])
      for t in trees.values()
    ]

  _when_bad(ok, lambda step, f: reporter.inputs(names, paths, step, f, skipped), clock, flags)
  return ok


def _when_bad(ok: Array, report: Callable, *args) -> None:
  """`report(*args)` from the host when `ok` is False; an arg may be a function of no arguments
  that computes it (on a bad step only). Traced: in a `lax.cond`, so that a good step runs no
  callback; concrete (an eager step): at once, with no cond to compile on every call."""

  def values():
    return [a() if callable(a) else a for a in args]

  if not _checks.is_traced(ok):
    if not bool(ok):
      report(*values())
    return
  jax.lax.cond(ok, lambda: None, lambda: jax.debug.callback(report, *values()))


def hyperparameters_ok(
  reporter: Reporter, values: Mapping[str, tuple[Any, float | None]], clock, skipped: bool
) -> Array | None:
  """Whether this step's schedule values are usable: `values` maps a name to `(value, low)`,
  the value finite and, with `low`, at least `low`. Python numbers (checked on construction)
  are not looked at; None when nothing is. A bad value is reported by `reporter` from the host,
  inside a `lax.cond` (no callback on a good step)."""
  names, lows, xs, goods = [], [], [], []
  for name, (x, low) in values.items():
    if x is None or isinstance(x, (int, float)):
      continue
    x = jnp.asarray(x)
    good = jnp.isfinite(x) if low is None else jnp.isfinite(x) & (x >= low)
    names.append(name)
    lows.append(low)
    xs.append(x)
    goods.append(good)
  if not names:
    return None
  ok = jnp.all(jnp.stack([jnp.all(g) for g in goods]))

  _when_bad(
    ok,
    lambda step, xs, goods: reporter(tuple(names), tuple(lows), step, xs, goods, skipped),
    clock,
    xs,
    goods,
  )
  return ok


def tree_vdot(a, b) -> Array:
  """Σ over leaves of ⟨a, b⟩, accumulated in at least float32 (bfloat16 params)."""

  def up(x):
    return x.astype(jnp.promote_types(x.dtype, jnp.float32))

  return sum(  # type: ignore[return-value]  # an Array: params have leaves
    _parallel.vdot(up(x), up(y))
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b))
  )


def step(
  est: _estimator.CurvatureEstimator,
  curv: _estimator.EstimatorState,
  vector,
  statistics: Callable[[], _curvature.CurvatureStats],
  count: Array,
  *,
  damping,
  ema_decay,
  inverse_every,
  curvature_every,
  burn_in_steps: int = 0,
  ok: Array | None = None,
  axis_name: str | None = None,
  mesh: Any = None,
) -> tuple[Any, _estimator.EstimatorState, Array | None]:
  """One K-FAC step: `(F̂_λ⁻¹ vector, new estimator state, verdict)`.

  With `k = count - burn_in_steps`: the statistics fold into the EMA when `k < 0` (burn-in)
  or `k % curvature_every == 0`; the inverses are refreshed with `damping` when `k >= 0` and
  `k % inverse_every == 0`; the vector is preconditioned with the refreshed inverses (zeros
  during burn-in).

  Args:
    est, curv: the estimator and its state.
    vector: a params-shaped pytree (the gradient).
    statistics: a function computing this batch's `CurvatureStats`, called inside the fold's
      branch unless statistics are due on every step (`curvature_every` a Python 1).
    count: `[]` int, the step counter.
    damping, ema_decay, inverse_every, curvature_every: the schedule's values at this step.
    burn_in_steps: a Python int.
    ok: the guard's verdict on the inputs, or None with the guard off; the curvature moves
      only when it holds.
    axis_name, mesh: the data-parallel axis (see `CurvatureEstimator.update_inverses`).

  Returns:
    The preconditioned vector (in `vector`'s dtypes), the new estimator state and the verdict
    (`ok`, finite statistics and a finite preconditioned vector; None with the guard off).
  """
  old = curv
  k = count - burn_in_steps if burn_in_steps else count
  in_burn = (k < 0) if burn_in_steps else None

  # Statistics due on every step are formed outside any cond (a skipped step forms them for
  # nothing): inside a cond branch XLA:CPU runs some pull-backs (convolutions) far slower.
  every_step = type(curvature_every) is int and curvature_every == 1
  fold_due = None if every_step else k % jnp.asarray(curvature_every, k.dtype) == 0
  if in_burn is not None and fold_due is not None:
    fold_due = fold_due | in_burn
  if ok is not None:
    fold_due = ok if fold_due is None else fold_due & ok
  now = statistics() if every_step else None

  def fold():
    s = now if now is not None else statistics()
    return est.update_curvature_from_stats(old, s, ema_decay, axis_name=axis_name, mesh=mesh)

  if fold_due is None:
    curv = fold()
  else:

    def parts(c):
      return c.factors, c.ema_weight, c.skipped_batches

    factors, weight, skipped = jax.lax.cond(fold_due, lambda: parts(fold()), lambda: parts(old))
    curv = old._replace(factors=factors, ema_weight=weight, skipped_batches=skipped)
  if ok is not None:  # The estimator skipped (and counted) non-finite statistics.
    ok = ok & (curv.skipped_batches == old.skipped_batches)

  refresh_due = k % jnp.asarray(inverse_every, k.dtype) == 0
  if in_burn is not None:
    refresh_due = refresh_due & ~in_burn
  if ok is not None:
    refresh_due = refresh_due & ok
  before = curv

  def refresh():
    new = est.update_inverses(before, damping, axis_name=axis_name, mesh=mesh)
    return new.cache, new.failed_inverses

  cache, failed = jax.lax.cond(refresh_due, refresh, lambda: (before.cache, before.failed_inverses))
  curv = curv._replace(cache=cache, failed_inverses=failed)

  def precondition():
    pre = est.multiply_matpower(curv, vector, -1, axis_name=axis_name, mesh=mesh)
    return jax.tree_util.tree_map(lambda n, u: n.astype(u.dtype), pre, vector)

  if in_burn is None:
    pre = precondition()
  else:
    pre = jax.lax.cond(
      in_burn, lambda: jax.tree_util.tree_map(jnp.zeros_like, vector), precondition
    )
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
  return pre, curv, ok
