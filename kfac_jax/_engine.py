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

from kfac_jax import _curvature, _estimator, _parallel, _storage

Array = jax.Array


class HyperparameterWarning(UserWarning):
  """A schedule gave a hyperparameter that is not finite, or a negative learning rate or
  damping: the step it gave it for is skipped (with `Config.skip_nonfinite`)."""


class Reporter:
  """Warns, from the host, the first time each hyperparameter of one front is bad (one warning
  per name, whichever device or step reports it)."""

  def __init__(self, who: str):
    self.who = who
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

  def report():
    jax.debug.callback(
      lambda step, xs, goods: reporter(tuple(names), tuple(lows), step, xs, goods, skipped),
      clock,
      xs,
      goods,
    )

  jax.lax.cond(ok, lambda: None, report)
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
