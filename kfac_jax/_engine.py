"""The step engine shared by `scale_by_kfac` / `kfac` and `Optimizer`.

Three pieces of a K-FAC step that both entry points run inside the caller's `jit`, each a
`lax.cond` that carries only what it can change:

  * `fold_statistics`: the curvature statistics' EMA update on due steps (the factors, the EMA
    weight and the skipped-batch counter; the caches stay out of the branch);
  * `refresh_inverses`: the damped inverses / decompositions on due steps (the caches and the
    failure counter; the factors, read-only here, stay out);
  * `keep_if`: the skip-on-non-finite guard, one select on a scalar between the new and the old
    value of exactly the parts a step changed. Both entry points gate `fold_statistics` and
    `refresh_inverses` on a finite gradient instead of restoring the factors and caches here:
    a value the guard may restore stays alive to the end of the step, and XLA then copies it
    through every cond's pass-through branch on the way (benchmarks/RESULTS.md, "The guard
    without copies").

`masked_share` tells both entry points when they are handed a share of the parameters
(`optax.multi_transform`, `optax.masked`): the transforms then keep only that share's blocks,
and the `Optimizer`'s optax form, which steps the whole model, refuses.

Why conds that carry only what they change: an operand that passes through a `lax.cond`
unchanged is still copied in and out of the conditional by XLA (the branch's result is its own
buffer), and an elementwise `jnp.where(ok, new, old)` over the whole state reads both and writes
a third copy. On the autoencoder (26 MB of factors, 26 MB of inverses) the `Optimizer`'s former
full-state `where` and whole-estimator-state cond moved several hundred MB a step
(benchmarks/RESULTS.md, "Optimizer step cost").
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import optax

from kfac_jax import _estimator

Array = jax.Array


def fold_statistics(
  old: _estimator.EstimatorState,
  fold: Callable[[], _estimator.EstimatorState],
  due: Array | None,
) -> _estimator.EstimatorState:
  """`fold()` (the estimator state after the statistics' EMA update) when `due`, else `old`.

  `due=None` folds unconditionally (no cond at all). `fold` runs inside the taken branch, so
  the statistics (the sampled backward pass included) are only computed on due steps.
  """
  if due is None:
    return fold()

  def parts(c):
    return c.factors, c.ema_weight, c.skipped_batches

  factors, weight, skipped = jax.lax.cond(due, lambda: parts(fold()), lambda: parts(old))
  return old._replace(factors=factors, ema_weight=weight, skipped_batches=skipped)


def refresh_inverses(
  est: _estimator.CurvatureEstimator,
  curv: _estimator.EstimatorState,
  damping,
  due: Array,
  *,
  axis_name: str | None = None,
  mesh: Any = None,
) -> _estimator.EstimatorState:
  """`est.update_inverses(curv, damping)` when `due`, else `curv`; only the caches (and the
  failure counter) go through the branch."""

  def refresh():
    new = est.update_inverses(curv, damping, axis_name=axis_name, mesh=mesh)
    return new.cache, new.failed_inverses

  cache, failed = jax.lax.cond(due, refresh, lambda: (curv.cache, curv.failed_inverses))
  return curv._replace(cache=cache, failed_inverses=failed)


def keep_if(ok: Array, new, old):
  """`new` when the scalar `ok` holds, else `old` (equal pytree structures): one `lax.cond`,
  no elementwise test or select over the arrays."""
  return jax.lax.cond(ok, lambda: new, lambda: old)


def is_masked(x) -> bool:
  return isinstance(x, optax.MaskedNode)


def masked_share(tree) -> tuple[bool, ...] | None:
  """For a pytree with `optax.MaskedNode` leaves (the share of the parameters that
  `optax.multi_transform` / `optax.masked` hand an inner transform): per leaf, masked ones
  included, whether it is in the share. None when no leaf is masked."""
  kept = tuple(not is_masked(x) for x in jax.tree_util.tree_leaves(tree, is_leaf=is_masked))
  return None if all(kept) else kept
