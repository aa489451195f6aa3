"""K-FAC as optax gradient transformations.

`scale_by_kfac` is the bare preconditioner (updates ← F̂_λ⁻¹ · updates), `kfac` chains it with an
optional momentum and a learning rate. All curvature state (factors, inverses, counters) is in the
optax state; everything happens inside the caller's `jit`/`pmap`: the periodic inverse update is a
`lax.cond` on the step counter, so the program compiles once and never syncs with the host.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from kfac_jax import _curvature, _estimator, _layer_config
from kfac_jax import blocks as _blocks

Array = jax.Array
ScalarOrSchedule = float | Array | Callable[[Array], Array]


class ScaleByKfacState(NamedTuple):
  """State of `scale_by_kfac`.

  Attributes:
    count: `[]` int32, number of updates so far.
    curvature: the estimator's factors, caches and EMA weight.
  """
  count: Array
  curvature: _estimator.EstimatorState


def _check_positive_int(value, name: str) -> None:
  if isinstance(value, (jax.Array, np.ndarray)) and not _estimator._is_concrete(value):
    return  # A traced hyperparameter (e.g. under optax.inject_hyperparams).
  v = np.asarray(value)
  if v.shape != () or not np.issubdtype(v.dtype, np.number) or v != int(v) or v < 1:
    raise ValueError(f"`{name}` must be a positive integer, got {value!r}.")


def scale_by_kfac(
    loss_fn: Callable,
    example_batch: Any,
    *,
    has_aux: bool = False,
    damping: ScalarOrSchedule = 1e-3,
    ema_decay: float = 0.95,
    inverse_every: int = 5,
    curvature_every: int = 1,
    estimation_mode: _curvature.EstimationMode = "gradients",
    num_samples: int | None = None,
    damping_mode: _blocks.DampingMode = "factored",
    axis_name: str | None = None,
    inverse_mesh: tuple[jax.sharding.Mesh, str] | None = None,
    inverse_storage: _estimator.InverseStorage = "replicated",
    strict: bool = False,
    layers: _layer_config.LayerConfig | None = None,
    stats_dtype: Any = None,
    inverse_dtype: Any = None,
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
    has_aux: `loss_fn` returns `(loss, aux)` (see `kfac_jax.value_and_grad`); only the loss
      part is scanned. Compute the statistics with `value_and_grad(loss_fn, has_aux=True)`.
    damping: λ ≥ 0, a number or a schedule `count -> λ`.
    ema_decay: decay of the statistics' moving average, in [0, 1) (0 keeps the newest batch).
    inverse_every: refresh the inverses every this many updates.
    curvature_every: fold the curvature statistics into the EMA every this many updates (1:
      every update). Larger values save the statistics' cost on the other updates only when
      the transform computes them itself: pass `batch=` and `rng=` to `update` (they are then
      computed inside a `lax.cond`, on due updates only). Statistics passed as
      `curvature_stats=` were already paid for and are ignored on the other updates. Same
      meaning as `Optimizer(curvature_every=)`; a value above `inverse_every` refreshes some
      inverses from unchanged statistics (useful only when the damping changes).
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
    strict: error instead of warning for parameters outside every recognised layer.
    layers: a `kfac_jax.LayerConfig`: approximations per layer kind and per parameter-path
      pattern, and linked parameter groups (None: the defaults).
    stats_dtype: dtype of the stored statistics: None (float32, float64 under x64), "float32",
      "float64", "bfloat16" or "float16". Statistics are accumulated in at least float32.
    inverse_dtype: dtype of the inverses and of the preconditioning products: None (float32,
      float64 under x64), "float32" or "float64". The updates come back in the parameters'
      dtype, so a bfloat16 model gets bfloat16 updates from float32 curvature.

  With `optax.inject_hyperparams`, declare the non-numeric arguments static (optax treats any
  callable as a schedule): `optax.inject_hyperparams(kfac_jax.scale_by_kfac,
  static_args=("loss_fn", "example_batch"))(loss_fn=..., example_batch=..., damping=1e-3)`;
  `damping`, `ema_decay` and `inverse_every` can then change between steps without a recompile.

  Returns:
    An `optax.GradientTransformationExtraArgs`. Its `update(updates, state, params, *,
    curvature_stats=None, batch=None, rng=None)` needs `params`, and either `curvature_stats`
    from `kfac_jax.value_and_grad` (one forward pass for everything) or `batch` and `rng`
    (an extra forward and backward pass).

  Example:
    >>> tx = optax.chain(kfac_jax.scale_by_kfac(loss_fn, batch, damping=1e-3),
    ...                  optax.scale_by_learning_rate(0.1))
    >>> loss, grads, stats = kfac_jax.value_and_grad(loss_fn)(params, batch, rng)
    >>> updates, opt_state = tx.update(grads, opt_state, params, curvature_stats=stats)
  """
  _estimator.check_damping(damping)
  _estimator.check_unit_interval(ema_decay, "ema_decay")
  _check_positive_int(inverse_every, "inverse_every")
  _check_positive_int(curvature_every, "curvature_every")
  if num_samples is None:
    num_samples = 1
  elif isinstance(num_samples, jax.Array):
    raise TypeError(
        "`num_samples` fixes array shapes and must be a Python int, got a JAX array. With "
        "optax.inject_hyperparams, pass static_args=('loss_fn', 'example_batch', 'num_samples').")
  if axis_name is not None and not isinstance(axis_name, str):
    raise TypeError(f"`axis_name` must be a string or None, got {axis_name!r}.")
  if inverse_mesh is not None:
    if axis_name is not None:
      raise ValueError(
          "pass `axis_name` (inside pmap/shard_map) or `inverse_mesh` (under jit with sharded "
          "data), not both: with `axis_name` the inverse work is already split over that axis.")
    if (not isinstance(inverse_mesh, tuple) or len(inverse_mesh) != 2
        or not isinstance(inverse_mesh[0], jax.sharding.Mesh)
        or inverse_mesh[1] not in inverse_mesh[0].axis_names):
      raise ValueError(
          "`inverse_mesh` must be a (jax.sharding.Mesh, axis_name) pair naming one of the "
          f"mesh's axes, got {inverse_mesh!r}.")
  if inverse_storage not in ("replicated", "sharded"):
    raise ValueError(
        f"unknown inverse_storage {inverse_storage!r}; choose 'replicated' or 'sharded'.")
  if inverse_storage == "sharded" and axis_name is None and inverse_mesh is None:
    raise ValueError(
        "inverse_storage='sharded' splits the inverses over the devices of a data-parallel "
        "axis: pass `axis_name=` (inside pmap/shard_map) or `inverse_mesh=(mesh, axis)` (under "
        "jit with sharded data), or keep inverse_storage='replicated' on one device.")
  est = _estimator.CurvatureEstimator(
      loss_fn, example_batch, has_aux=has_aux, estimation_mode=estimation_mode, exps=(-1,),
      num_samples=num_samples, damping_mode=damping_mode, strict=strict, layers=layers,
      stats_dtype=stats_dtype, inverse_dtype=inverse_dtype, inverse_storage=inverse_storage)

  def init_fn(params) -> ScaleByKfacState:
    return ScaleByKfacState(count=jnp.zeros([], jnp.int32),
                            curvature=est.init(params, axis_name=axis_name, mesh=inverse_mesh))

  def update_fn(updates, state: ScaleByKfacState, params=None, *, curvature_stats=None,
                batch=None, rng=None, **extra_args):
    del extra_args  # Other transforms' extra arguments (optax.chain forwards them all).
    if params is None:
      raise ValueError("scale_by_kfac: `params` is required: tx.update(grads, state, params, ...).")
    est._ensure_layers(params)
    if curvature_stats is None and batch is None:
      raise ValueError(
          "scale_by_kfac: pass `curvature_stats=` (from kfac_jax.value_and_grad) or "
          "`batch=` (and `rng=`) to tx.update, so the curvature can be estimated.")

    def fold():
      stats = (est.curvature_stats(params, batch, rng) if curvature_stats is None
               else curvature_stats)
      return est.update_curvature_from_stats(state.curvature, stats, ema_decay,
                                             axis_name=axis_name)

    if isinstance(curvature_every, int) and curvature_every == 1:
      curv = fold()
    else:
      # Statistics only on due updates; the other branch leaves the state untouched. The
      # caches, which the fold never changes, stay out of the branch (no copy of them).
      def statistics(c):
        return c.factors, c.ema_weight, c.skipped_batches

      factors, weight, skipped = jax.lax.cond(
          state.count % jnp.asarray(curvature_every, state.count.dtype) == 0,
          lambda: statistics(fold()), lambda: statistics(state.curvature))
      curv = state.curvature._replace(factors=factors, ema_weight=weight,
                                      skipped_batches=skipped)
    lam = damping(state.count) if callable(damping) else damping
    # Only the cache goes through the branch: passing the whole state would make XLA copy
    # every factor matrix in and out of the conditional.
    def refresh():
      new = est.update_inverses(curv, lam, axis_name=axis_name, mesh=inverse_mesh)
      return new.cache, new.failed_inverses

    cache, failed = jax.lax.cond(
        state.count % jnp.asarray(inverse_every, state.count.dtype) == 0,
        refresh, lambda: (curv.cache, curv.failed_inverses))
    curv = curv._replace(cache=cache, failed_inverses=failed)
    new_updates = est.multiply_matpower(curv, updates, -1, axis_name=axis_name,
                                        mesh=inverse_mesh)
    new_updates = jax.tree_util.tree_map(lambda n, u: n.astype(u.dtype), new_updates, updates)
    return new_updates, ScaleByKfacState(count=optax.safe_increment(state.count), curvature=curv)

  tx = optax.GradientTransformationExtraArgs(init_fn, update_fn)
  return tx


def kfac(
    loss_fn: Callable,
    example_batch: Any,
    learning_rate: ScalarOrSchedule,
    *,
    momentum: float | None = None,
    nesterov: bool = False,
    **kwargs,
) -> optax.GradientTransformationExtraArgs:
  """K-FAC with a fixed (or scheduled) learning rate and optional heavy-ball momentum.

  `optax.chain(scale_by_kfac(loss_fn, example_batch, **kwargs), trace(momentum),
  scale_by_learning_rate(learning_rate))`. See `scale_by_kfac` for the other arguments.
  """
  parts = [scale_by_kfac(loss_fn, example_batch, **kwargs)]
  if momentum is not None:
    parts.append(optax.trace(decay=momentum, nesterov=nesterov))
  parts.append(optax.scale_by_learning_rate(learning_rate))
  return optax.chain(*parts)
