"""A front's verdict on a step's inputs and hyperparameters, and its warnings.

A verdict is a scalar bool computed inside the step. A bad one is reported once per name by a
`Reporter`: at once in an eager call; from a compiled step only with `Config.step_warnings`, as
a host callback, which keeps JAX from storing the step in its persistent compilation cache.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kfac_jax import _checks, _errors, _parallel, _specs, _storage

Array = jax.Array

# Each input of a step: how a warning names it and where a non-finite one comes from.
_INPUTS = {
  "gradient": ("the gradient is", "A non-finite batch or a loss that overflows gives one."),
  "loss": ("the loss is", "A non-finite batch or a loss that overflows gives one."),
  "params": ("the params are", "The update applied before this step was not finite."),
}
_CHAINED = (
  " A transform chained after this one (a schedule, a scale) or the code applying the updates "
  "can make it so: `kfac_jax.kfac(learning_rate=schedule)` skips a schedule's unusable steps."
)


class Reporter:
  """One front's warnings, each given once per name whichever device or step reports it;
  `chained`: an optax transform (the rest of a chain can make its updates non-finite);
  `in_step`: a compiled step warns too (`Config.step_warnings`)."""

  def __init__(self, who: str, *, chained: bool = False, in_step: bool = False):
    self.who, self.chained, self.in_step = who, chained, in_step
    self._seen: set[str] = set()

  def when_bad(self, ok: Array, report: Callable, *args) -> None:
    """`report(*args)` (a thunk arg is called) when `ok` is False: at once when concrete, from
    a `lax.cond`'s host callback when traced and `in_step`, else not at all."""

    def values():
      return [a() if callable(a) else a for a in args]

    if not _checks.is_traced(ok):
      if not bool(ok):
        report(*values())
    elif self.in_step:
      jax.lax.cond(ok, lambda: None, lambda: jax.debug.callback(report, *values()))

  def once(self, key: str, message: str, category: type[Warning]) -> None:
    """Warns `message` unless a warning of `key` was given before."""
    if key not in self._seen:
      self._seen.add(key)
      warnings.warn(message, category, stacklevel=3)

  def hyperparameters(self, names: tuple[str, ...], lows: tuple, step, values, goods, skipped):
    step = np.asarray(step).ravel()
    for name, low, value, good in zip(names, lows, values, goods):
      bad = ~np.asarray(good, bool).ravel()
      if not bad.any():
        continue
      value = np.asarray(value).ravel()[np.argmax(bad)]
      at = int(step[np.argmax(bad) % step.size])
      rule = "finite" if low is None else f"finite and >= {low}"
      self.once(
        name,
        f"{self.who}: the schedule of `{name}` gave {value} at step {at} (it must be {rule}); "
        + ("the step is skipped. " if skipped else "`Config.skip_nonfinite` is off: it is used. ")
        + "This warning is given once per hyperparameter.",
        _errors.HyperparameterWarning,
      )

  def inputs(self, names: tuple[str, ...], paths: tuple, step, flags, skipped: bool):
    """Warns about the first bad input of params, gradient, loss (the later follow from it),
    naming its bad leaves (`flags`: per input, device and leaf, whether it is finite)."""
    step = int(np.asarray(step).ravel()[0])
    goods: dict[str, list[bool]] = {
      n: [bool(np.all(np.asarray(f, bool).reshape(-1, len(p))[:, i])) for i in range(len(p))]
      for n, p, f in zip(names, paths, flags)
    }
    bad_ones = [n for n in ("params", "gradient", "loss") if n in goods and not all(goods[n])]
    if not bad_ones:
      return
    name = bad_ones[0]
    leaf_paths = paths[names.index(name)]
    bad = [f"`{p}`" for p, g in zip(leaf_paths, goods[name]) if not g and p != "<root>"]
    where = ", ".join(bad[:4]) + (f" and {len(bad) - 4} more" if len(bad) > 4 else "")
    subject, cause = _INPUTS[name]
    self.once(
      f"input:{name}",
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
    )

  def inverses(self, blocks: tuple[str, ...], step, failed, damping) -> None:
    """Warns about each block (`blocks`: its layer's name and class) whose refreshed cache
    (`failed`: per device and block) was not finite."""
    per_device = np.asarray(failed, bool).reshape(-1, len(blocks))
    step, lam = int(np.asarray(step).ravel()[0]), float(np.asarray(damping).ravel()[0])
    for block in (b for i, b in enumerate(blocks) if per_device[:, i].any()):
      self.once(
        f"inverse:{block}",
        f"{self.who}: the refreshed inverse of {block} was not finite at step {step} (damping "
        f"{lam:g}): the layer keeps its previous one (`curvature.failed_inverses` counts). Raise "
        "the damping, or make your block's compute_cache finite on these statistics. This "
        "warning is given once per layer.",
        _errors.FailedInverseWarning,
      )


def _up(x) -> Array:
  x = jnp.asarray(x)
  return x.astype(jnp.promote_types(x.dtype, jnp.float32))


def inputs_ok(reporter: Reporter, inputs: Mapping[str, Any], clock, skipped: bool) -> Array:
  """Whether every leaf of `inputs` (name → pytree) is finite; trees of one shape are added
  first, for one pass over them (an overflow errs on the side of a skip)."""
  trees = {n: t for n, t in inputs.items() if jax.tree_util.tree_leaves(t)}
  groups: dict[tuple, list[Any]] = {}  # Trees whose leaves can be added position by position.
  for t in trees.values():
    groups.setdefault(tuple(jnp.shape(x) for x in jax.tree_util.tree_leaves(t)), []).append(t)
  leaves = [[jax.tree_util.tree_leaves(t) for t in g] for g in groups.values()]
  ok = _storage.all_finite([[sum(_up(x) for x in xs) for xs in zip(*g)] for g in leaves])
  names = tuple(trees)
  paths = tuple(_specs.param_paths(t) for t in trees.values())

  def flags():  # Per leaf, through its sum: one reduction each.
    return [
      jnp.isfinite(jnp.stack([jnp.sum(_up(x)) for x in jax.tree_util.tree_leaves(t)]))
      for t in trees.values()
    ]

  report = functools.partial(reporter.inputs, names, paths, skipped=skipped)
  reporter.when_bad(ok, report, clock, flags)
  return ok


def hyperparameters_ok(
  reporter: Reporter, values: Mapping[str, tuple[Any, float | None]], clock, skipped: bool
) -> Array | None:
  """Whether this step's hyperparameters (name → `(value, low)`) are finite and at least their
  `low`; Python numbers (checked on construction) are not looked at; None when none is left."""
  checked = {
    n: (jnp.asarray(x), low)
    for n, (x, low) in values.items()
    if x is not None and not isinstance(x, (int, float))
  }
  if not checked:
    return None
  names, lows = tuple(checked), tuple(low for _, low in checked.values())
  xs = [x for x, _ in checked.values()]
  goods = [jnp.isfinite(x) & (True if low is None else x >= low) for x, low in checked.values()]
  ok = jnp.all(jnp.stack([jnp.all(g) for g in goods]))
  report = functools.partial(reporter.hyperparameters, names, lows, skipped=skipped)
  reporter.when_bad(ok, report, clock, xs, goods)
  return ok


def tree_vdot(a, b) -> Array:
  """Σ over leaves of ⟨a, b⟩ in at least float32, also for leaves sharded over explicit axes."""
  return sum(  # type: ignore[return-value]  # an Array: params have leaves
    _parallel.vdot(_up(x), _up(y))
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b))
  )
