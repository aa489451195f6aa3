"""`CurvatureEstimator`: the public face of the curvature estimator, mirroring TF K-FAC's
FisherEstimator (the mathematics is in `kfac_jax._estimator`)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from kfac_jax import (
  _checks,
  _config,
  _curvature,
  _fronts,
  _registration,
)
from kfac_jax import blocks as _blocks
from kfac_jax import scan as _scan
from kfac_jax._estimator import Estimator, EstimatorState

Array = jax.Array


class CurvatureEstimator:
  """Block-diagonal K-FAC curvature estimate of `loss_fn`, with pure state updates.

  Args:
    loss_fn: `loss_fn(params, batch) -> scalar`, calling a loss tag on the model output; with
      `config.has_aux`, `loss_fn(params, batch) -> (scalar, aux)` (the aux is never read).
    example_batch: a batch with the shapes used for training (arrays or ShapeDtypeStructs).
    registration: a `kfac_jax.Registration` instead of `loss_fn` and `example_batch`: its
      layers and registration settings apply (the config's registration fields must agree or
      stay at their defaults), `layers` and `blocks` are known at once, and `init` checks
      params against its signature. Without it, the first `init` builds one.
    exps: matrix powers `multiply_matpower` must support (1 always is).
    compute_cholesky: cache Cholesky factors of the damped blocks.
    compute_cholesky_inverse: cache their inverses.
    compute_params_stats: `curvature_stats` also returns the first-order statistics
      (`CurvatureStats.params_stats`, TF K-FAC's `params_stats`).
    config: a `kfac_jax.Config`; the estimator reads its registration fields, numerics and
      `inverse_storage`. The fields only a training front reads (`statistics_fraction`,
      `burn_in_steps`, `mesh`, `skip_nonfinite`, `nesterov`, the damping adaptation's,
      `weight_decay`) must stay at their defaults: the caller chooses the batches, the
      schedule and the damping, and passes `mesh=` per call.

  The estimation modes (`config.estimation_mode`; formulas in `kfac_jax._losses`):
  "gradients" (sampled targets: the Fisher), "empirical" (the data's targets), "curvature_prop"
  / "curvature_prop_GGN" (Rademacher vectors times a square-root factor of the output Fisher /
  loss Hessian), or "exact" / "exact_GGN" (every output coordinate: K backward passes, K the
  prediction's non-batch size). The GGN variants estimate Jᵀ (∂²ℓ/∂z²) J, which equals the
  Fisher for the tags' canonical-link losses. The random modes need an `rng`.

  Statistics are accumulated in at least float32 and stored in `config.stats_dtype`;
  preconditioned vectors come back in their own dtype. With `config.inverse_storage="sharded"`
  each device stores, updates and applies only its share of the blocks: every state method
  then needs `axis_name=` (inside pmap / shard_map, `init` too) or `mesh=(mesh, axis)`.

  Raises:
    TypeError: an argument of the wrong kind (e.g. `exps=-1`), named with the value received;
      a keyword that moved into `Config` (e.g. `estimation_mode=`), naming its place.
    ValueError: an argument out of range, or a config field the estimator does not read set
      away from its default.
    RegistrationError: (at `init`) no loss tag in `loss_fn`, or a return value that does not
      match `config.has_aux`.

  Example:
    >>> est = kfac_jax.CurvatureEstimator(loss_fn, batch)
    >>> state = est.init(params)
    >>> state = est.update_curvature(state, params, batch, rng, ema_decay=0.95)
    >>> state = est.update_inverses(state, damping=1e-3)
    >>> nat_grads = est.multiply_matpower(state, grads, -1)
  """

  @_config.moved_keywords
  def __init__(
    self,
    loss_fn: Callable | None = None,
    example_batch: Any = None,
    *,
    registration: _registration.Registration | None = None,
    exps: Sequence[float] = (-1,),
    compute_cholesky: bool = False,
    compute_cholesky_inverse: bool = False,
    compute_params_stats: bool = False,
    config: _config.Config | None = None,
  ):
    who = "CurvatureEstimator"
    config = _config.get(config, who)
    config.refuse(
      who,
      ("statistics_fraction", "burn_in_steps", "skip_nonfinite"),
      "the caller chooses the batches and the schedule",
    )
    config.refuse(who, ("mesh",), "pass `mesh=` to the methods")
    config.refuse(
      who,
      (
        "nesterov",
        "min_damping",
        "max_damping",
        "damping_adaptation_interval",
        "damping_adaptation_decay",
        "weight_decay",
      ),
      "the caller chooses the damping and the update",
    )
    reg = _fronts.resolve(registration, loss_fn, example_batch, config, who)
    if reg is None:
      _curvature.LossPart(loss_fn, config.has_aux)  # Checks `loss_fn` now.
    for flag in ("compute_cholesky", "compute_cholesky_inverse", "compute_params_stats"):
      _checks.boolean(locals()[flag], flag)
    if isinstance(exps, (str, bytes)) or not isinstance(exps, (tuple, list)):
      raise TypeError(
        f"`exps` must be a tuple of non-zero numbers (matrix powers, e.g. (-1,)), got {exps!r}."
      )
    for e in exps:
      _checks.number(e, "exps", low=-np.inf)
      if e == 0:
        raise ValueError(f"`exps` must be non-zero finite numbers, got {exps!r}.")
    block_config = config.block_config(
      tuple(float(e) for e in exps), compute_cholesky, compute_cholesky_inverse
    )
    storage = config.storage
    make = functools.partial(
      Estimator,
      config=block_config,
      storage=storage,
      compute_params_stats=compute_params_stats,
    )
    self._source = _fronts.Source(make, loss_fn, example_batch, config.registration_settings(), reg)
    self.config = block_config
    self.storage = storage

  # -- structure -------------------------------------------------------------------------------

  @property
  def estimator(self) -> Estimator:
    """The complete estimator (after `init`, or at once with a registration)."""
    return self._source.only()

  @property
  def registration(self) -> _registration.Registration:
    """The `kfac_jax.Registration` (given, or built by the first `init`)."""
    return self.estimator.registration

  @property
  def layers(self) -> tuple[_scan.LayerSpec, ...]:
    """The registered layers (after `init`)."""
    return self.estimator.layers

  @property
  def blocks(self) -> tuple[_blocks.Block, ...]:
    """One curvature block per layer (after `init`)."""
    return self.estimator.blocks

  def scan_batch(self, params, batch) -> _scan.ScanResult:
    """The evaluation graph of `loss_fn(params, batch)` (kept per batch signature)."""
    return self._source.for_params(params).registration.scan_batch(params, batch)

  # -- state -----------------------------------------------------------------------------------

  def init(
    self, params, *, axis_name: str | None = None, mesh: tuple[Any, str] | None = None
  ) -> EstimatorState:
    """Zero statistics and identity caches for `params` (scans `loss_fn` on first use).

    With sharded storage, call it inside pmap / shard_map with `axis_name`, or pass
    `mesh=(mesh, axis)` for a cache sharded over that mesh axis. Replicated storage uses
    `axis_name` only to trace a model whose collectives name it (e.g. BatchNorm's).
    """
    est = self._source.for_params(params, axis_name)
    return est.init(axis_name=axis_name, mesh=mesh)

  def curvature_stats(self, params, batch, rng) -> _curvature.CurvatureStats:
    """This batch's raw curvature data (one forward pass, one sampled backward pass)."""
    return self._source.for_params(params).curvature_stats(params, batch, rng)

  def batch_factors(self, stats, axis_name: str | None = None, cache=None) -> dict[str, Any]:
    """Per-block statistics of one batch (see `Estimator.batch_factors`)."""
    return self.estimator.batch_factors(stats, axis_name, cache)

  def update_curvature_from_stats(
    self,
    state: EstimatorState,
    stats,
    ema_decay,
    axis_name: str | None = None,
    mesh: tuple[Any, str] | None = None,
  ) -> EstimatorState:
    """EMA update of the statistics with this batch's; a non-finite batch is skipped entirely.

    With decay ρ and w ← ρ w + 1, the factors become F ← F + (F_batch − F) / w: a bias-corrected
    average, exactly F_batch after the first update (and always with ρ = 0).
    """
    return self.estimator.update_curvature_from_stats(state, stats, ema_decay, axis_name, mesh)

  def update_curvature(
    self,
    state: EstimatorState,
    params,
    batch,
    rng,
    ema_decay,
    axis_name: str | None = None,
    mesh: tuple[Any, str] | None = None,
  ) -> EstimatorState:
    """`update_curvature_from_stats` with statistics computed from `batch`."""
    est = self._source.for_params(params)
    stats = est.curvature_stats(params, batch, rng)
    return est.update_curvature_from_stats(state, stats, ema_decay, axis_name, mesh)

  def update_inverses(
    self,
    state: EstimatorState,
    damping,
    *,
    axis_name: str | None = None,
    mesh: tuple[Any, str] | None = None,
  ) -> EstimatorState:
    """Recomputes every block's cache for damping λ; a block whose new cache is not finite
    keeps its previous one.

    Args:
      state: the estimator state.
      damping: λ ≥ 0.
      axis_name: inside `pmap` / `shard_map`, split the work over this axis: each device
        factorises its share of the blocks (balanced by cost) and the caches are summed over
        the axis; the result equals the unsplit one exactly. With sharded storage each device
        keeps only its own blocks' caches.
      mesh: under plain `jit` with sharded data, `(mesh, axis)` splits the work over that mesh
        axis the same way.
    """
    return self.estimator.update_inverses(state, damping, axis_name=axis_name, mesh=mesh)

  # -- products --------------------------------------------------------------------------------

  def multiply_matpower(
    self,
    state: EstimatorState,
    vector,
    exp: float,
    *,
    axis_name: str | None = None,
    mesh: tuple[Any, str] | None = None,
  ):
    """(damped curvature)^exp · vector, block by block. `exp` must be 1 or in `exps`.

    With sharded storage each device multiplies its own blocks and the results are summed over
    `axis_name` or `mesh` (one vector-sized `psum`), as in the other products below.
    """
    return self.estimator.multiply_matpower(state, vector, exp, axis_name=axis_name, mesh=mesh)

  def multiply(self, state: EstimatorState, vector, *, axis_name=None, mesh=None):
    """The damped curvature times `vector` (power 1)."""
    return self.multiply_matpower(state, vector, 1, axis_name=axis_name, mesh=mesh)

  def multiply_inverse(self, state: EstimatorState, vector, *, axis_name=None, mesh=None):
    """The inverse damped curvature times `vector` (needs -1 in `exps`, the default)."""
    return self.multiply_matpower(state, vector, -1, axis_name=axis_name, mesh=mesh)

  def multiply_cholesky(
    self, state: EstimatorState, vector, *, transpose=False, axis_name=None, mesh=None
  ):
    """C·v (or Cᵀ·v) for the block-diagonal factor C with C Cᵀ = damped curvature."""
    return self.estimator.multiply_cholesky(
      state, vector, transpose=transpose, axis_name=axis_name, mesh=mesh
    )

  def multiply_cholesky_inverse(
    self, state: EstimatorState, vector, *, transpose=False, axis_name=None, mesh=None
  ):
    """C⁻¹·v (or C⁻ᵀ·v)."""
    return self.estimator.multiply_cholesky(
      state, vector, transpose=transpose, inverse=True, axis_name=axis_name, mesh=mesh
    )

  def to_dense(self, state: EstimatorState) -> Array:
    """The undamped block-diagonal estimate as one matrix, ordered like `ravel_pytree(params)`."""
    return self.estimator.to_dense(state)

  def summary(self) -> str:
    """The registered layers as a table (see `kfac_jax.summary`)."""
    return self.estimator.summary()
