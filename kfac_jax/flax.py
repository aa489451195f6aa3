"""Optional Flax helpers (`import kfac_jax` never imports Flax; this module does).

`flax.training.train_state.TrainState.apply_gradients(*, grads, **kwargs)` takes every other
keyword as a field to replace, so the statistics never reach K-FAC; `kfac_jax.flax.TrainState`'s
forwards `curvature_stats=`, `batch=` and `rng=` to `tx.update`.

Example:
  >>> state = kfac_jax.flax.TrainState.create(apply_fn=model.apply, params=params, tx=tx)
  >>> loss, grads, stats = kfac_jax.value_and_grad(loss_fn)(state.params, batch, rng)
  >>> state = state.apply_gradients(grads=grads, curvature_stats=stats)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

try:
  import optax
  from flax.training import train_state as _train_state
except ImportError as e:  # pragma: no cover - depends on the environment.
  raise ImportError(
    "kfac_jax.flax needs Flax: `pip install flax` (or `pip install kfac_jax[examples]`)."
  ) from e

__all__ = ["TrainState"]


class TrainState(_train_state.TrainState):
  """`flax.training.train_state.TrainState` whose `apply_gradients` feeds K-FAC; `tx` is any
  optax transformation (the extra arguments are passed only when given)."""

  def apply_gradients(
    self, *, grads, curvature_stats: Any = None, batch: Any = None, rng: Any = None, **kwargs
  ):
    """One optimizer step: `tx.update(grads, opt_state, params, curvature_stats=, batch=, rng=)`.

    Args:
      grads: gradients with the structure of `params`.
      curvature_stats: the statistics from `kfac_jax.value_and_grad`, or None to let the
        transform compute them from `batch` and `rng`.
      batch, rng: the batch and a key, when `curvature_stats` is None.
      **kwargs: other fields of the state to replace, as in Flax (e.g. `batch_stats=`).

    Returns:
      The state with `step + 1`, updated `params` and `opt_state`, and `kwargs` replaced.

    Raises:
      ValueError: `grads` holds Flax's `overwrite_with_gradient` collection.
    """
    if isinstance(grads, Mapping) and _train_state.OVERWRITE_WITH_GRADIENT in grads:
      raise ValueError(
        f"TrainState.apply_gradients: `grads` has the {_train_state.OVERWRITE_WITH_GRADIENT!r} "
        "collection, which K-FAC does not handle; keep those variables outside `params`."
      )
    extra = dict(curvature_stats=curvature_stats, batch=batch, rng=rng)
    extra = {k: v for k, v in extra.items() if v is not None}
    updates, opt_state = self.tx.update(grads, self.opt_state, self.params, **extra)
    params = optax.apply_updates(self.params, updates)
    return self.replace(step=self.step + 1, params=params, opt_state=opt_state, **kwargs)
