"""The curvature estimator: the block-diagonal curvature of a registration, as pure functions.

The estimate is the Fisher of the mean per-example negative log-likelihood of the tagged
predictive distribution(s),

    F = (1/N) Σₙ E_y[∇ log p(y|xₙ) ∇ log p(y|xₙ)ᵀ] = (1/N) Σₙ Jₙᵀ F_z Jₙ,

N the loss tags' leading axis (the "_GGN" estimation modes use the loss Hessian H_z for F_z),
approximated block-diagonally (one block per layer) and averaged over batches with a
bias-corrected EMA. Every front steps a `CurvatureEstimator`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from kfac_jax import (
  _checks,
  _compat,
  _config,
  _curvature,
  _fit,
  _parallel,
  _registration,
  _storage,
  _summary,
)
from kfac_jax import blocks as _blocks
from kfac_jax import scan as _scan

Array = jax.Array


class EstimatorState(NamedTuple):
  """All numbers of the estimator; static structure lives on the estimator object.

  Attributes:
    factors: per block name, the EMA statistics as the block kind's factors type (e.g.
      `blocks.KroneckerFactors(a: [in+1, in+1], g: [out, out])`).
    cache: per block name, the block kind's powers / decompositions and the damping `[]` they
      were built with. With sharded storage, both are `ShardedCache` objects (this device's blocks).
    ema_weight: `[]` float, Σ decay^k over updates so far (0 before the first update).
    skipped_batches: `[]` int32, statistics updates skipped as not finite (factors kept).
    failed_inverses: `[]` int32, block factorisations that were not finite (cache kept).
  """

  factors: dict[str, Any] | _parallel.ShardedCache
  cache: dict[str, Any] | _parallel.ShardedCache
  ema_weight: Array
  skipped_batches: Array
  failed_inverses: Array


@dataclasses.dataclass(frozen=True, eq=False)
class CurvatureEstimator:
  """Block-diagonal K-FAC curvature estimate of a registration, with pure state updates.

  Args:
    registration: a `kfac_jax.Registration`: the layers, the parameters' signature and the
      estimation mode.
    exps: matrix powers `multiply_matpower` must support (1 always is).
    compute_cholesky, compute_cholesky_inverse: cache Cholesky factors of the damped blocks,
      their inverses.
    compute_params_stats: `curvature_stats` also returns the first-order statistics
      (`CurvatureStats.params_stats`).
    config: a `kfac_jax.Config`; the estimator reads its numerics and `inverse_storage` (the
      caller chooses the batches, the schedule and the damping, and passes `mesh=` per call).
    only: the names of the blocks to keep (None: all): the estimator of a share of the
      parameters, whose products leave the other parameters' entries as they come.

  Raises:
    TypeError / ValueError: a bad argument, named with the value received, or a `Config` field
      the estimator does not read set away from its default.

  Example:
    One jitted program (called eagerly, every operation would compile on its own):

    >>> est = kfac_jax.CurvatureEstimator(kfac_jax.Registration(loss_fn, params, batch))
    >>> @jax.jit
    ... def natural_gradient(state, params, batch, rng, grads):
    ...   state = est.update_curvature(state, params, batch, rng, ema_decay=0.95)
    ...   state = est.update_inverses(state, damping=1e-3)
    ...   return state, est.multiply_matpower(state, grads, -1)
    >>> state, nat_grads = natural_gradient(est.init(params), params, batch, rng, grads)
  """

  registration: _registration.Registration
  _: dataclasses.KW_ONLY
  exps: Sequence[float] = (-1,)
  compute_cholesky: bool = False
  compute_cholesky_inverse: bool = False
  compute_params_stats: bool = False
  config: _config.Config | None = None
  only: tuple[str, ...] | None = None

  def __post_init__(self):
    if not isinstance(self.registration, _registration.Registration):
      raise TypeError(
        "CurvatureEstimator: the first argument must be a kfac_jax.Registration, got "
        f"{self.registration!r} ({type(self.registration).__name__}): pass "
        "`kfac_jax.CurvatureEstimator(kfac_jax.Registration(loss_fn, params, batch))`."
      )
    _config.get(self.config, "CurvatureEstimator")
    for flag in ("compute_cholesky", "compute_cholesky_inverse", "compute_params_stats"):
      _checks.boolean(getattr(self, flag), flag)
    exps = self.exps
    if isinstance(exps, (str, bytes)) or not isinstance(exps, (tuple, list)):
      raise TypeError(
        f"`exps` must be a tuple of non-zero numbers (matrix powers, e.g. (-1,)), got {exps!r}."
      )
    for e in exps:
      _checks.number(e, "exps", low=-np.inf)
      if e == 0:
        raise ValueError(f"`exps` must be non-zero finite numbers, got {exps!r}.")
    if self.only is not None:
      unknown = [n for n in self.only if n not in self.registration.block_names]
      if not isinstance(self.only, tuple) or unknown:
        raise ValueError(
          "`only` must be a tuple of the registration's block names "
          f"{list(self.registration.block_names)}, got {self.only!r}."
        )
    _ = self.storage  # Binding it raises where the storage cannot keep a block.
    _compat.one_lapack_thread()

  @functools.cached_property
  def numerics(self) -> _blocks.BlockConfig:
    """The blocks' numerics, from `config`, `exps` and the Cholesky flags."""
    exps = tuple(float(e) for e in self.exps)
    config = _config.get(self.config, "CurvatureEstimator")
    return config.block_config(exps, self.compute_cholesky, self.compute_cholesky_inverse)

  @functools.cached_property
  def storage(self) -> _storage.Storage:
    """`ReplicatedStorage` or `ShardedStorage`, bound to the blocks: where the caches live."""
    return _config.get(self.config, "CurvatureEstimator").storage.bind(self.names, self.blocks)

  @functools.cached_property
  def _active(self) -> tuple[int, ...]:
    names = self.registration.block_names
    return tuple(i for i, n in enumerate(names) if self.only is None or n in self.only)

  @property
  def layers(self) -> tuple[_scan.LayerSpec, ...]:
    """The registration's layers (every one, kept or not)."""
    return self.registration.layers

  @property
  def names(self) -> tuple[str, ...]:
    """The kept blocks' names (the keys of the state's `factors` and `cache`)."""
    return tuple(self.registration.block_names[i] for i in self._active)

  @property
  def blocks(self) -> tuple[_blocks.Block, ...]:
    """One curvature block per kept layer."""
    every = self.registration.blocks(self.numerics)
    return tuple(every[i] for i in self._active)

  @functools.cached_property
  def _state_shapes(self):
    return jax.eval_shape(self.init)

  def check_state(
    self, state, axis_name=None, mesh=None, who: str = "this estimator", what: str = "state"
  ):
    """ValueError naming what differs when `state` is not one this estimator's `init` makes (a
    sharded one's storage checks its buffers), when `axis_name` is not bound and when `mesh`
    names an axis its mesh lacks."""
    if mesh is None:
      _checks.axis_bound(axis_name, who)
    else:
      _parallel.mesh_axis(mesh)
    if isinstance(self.storage, _storage.ReplicatedStorage):
      _fit.check(self._state_shapes, state, who, what)

  def init(
    self, params=None, *, axis_name: str | None = None, mesh: tuple[Any, str] | None = None
  ) -> EstimatorState:
    """Zero statistics and identity caches (`params`, when given, are checked). With sharded
    storage, call it inside pmap / shard_map with `axis_name`, or pass `mesh=(mesh, axis)`."""
    if params is not None:
      self.registration.check_params(params)
    factors, cache = self.storage.init_state(axis_name, mesh)
    count = lambda: jnp.zeros((), jnp.int32)  # Distinct arrays: a state can be donated.
    weight = jnp.zeros((), self.numerics.accum_dtype)
    return EstimatorState(factors, cache, weight, count(), count())

  def curvature_stats(self, params, batch, rng) -> _curvature.CurvatureStats:
    """This batch's raw curvature data (one forward pass, one sampled backward pass)."""
    self.registration.check_params(params)
    _curvature.check_rng(self.registration.estimation_mode, rng)
    return self._curvature_stats(params, batch, rng)

  @jax.named_scope("kfac_statistics")
  def _curvature_stats(self, params, batch, rng) -> _curvature.CurvatureStats:
    """`curvature_stats`, unchecked (the fronts' engine checked its arguments)."""
    reg = self.registration
    # Only pulled back: convolutions transpose with canonically ordered kernels (fast inside
    # the transforms' `lax.cond` on CPU; `_compat.pull_back_convs_canonically`).
    with _compat.pull_back_convs_canonically():
      out = reg.compute(
        params, batch, rng, with_grads=False, with_params_stats=self.compute_params_stats
      )
    return out[-1]

  def check_stats(self, stats: _curvature.CurvatureStats, who: str = "this estimator") -> None:
    """ValueError when `stats` were computed for another mode or layer set, or (statistics of
    `value_and_grad`, which scans each batch) for layers that change with the batch size."""
    reg, names = self.registration, stats.layer_names
    if stats.layer_shapes and names == tuple(s.name for s in self.layers):
      reg.check_layer_shapes(names, stats.layer_shapes, stats.batch_size, kinds_only=True)
    reg.check_stats(stats, who)

  def batch_factors(
    self, stats: _curvature.CurvatureStats, axis_name: str | None = None, cache=None
  ) -> dict[str, Any]:
    """Per-block statistics of one batch (the block kinds' factors types), averaged over
    `axis_name`; blocks with `needs_cache_for_statistics` (EKFAC) read their entry of `cache`."""
    self.check_stats(stats)
    return self._batch_factors(stats, axis_name, cache)

  def _batch_factors(self, stats, axis_name, cache) -> dict[str, Any]:
    def one(n, b, d, cache):
      if isinstance(d, _blocks.StackedUses) and not b.accepts_stacked_uses():
        d = d.unstack()
      if b.needs_cache_for_statistics and cache is not None:
        out = b.batch_factors(d, stats.batch_size, cache=self.storage.block_cache(cache, n))
      else:
        out = b.batch_factors(d, stats.batch_size)
      if b.spec.block is not None:  # A user's block: its statistics fit its factors.
        got, want = (_blocks.tree_shapes(t) for t in (out, jax.eval_shape(b.init_factors)))
        if (got[0], [s for s, _ in got[1]]) != (want[0], [s for s, _ in want[1]]):
          raise ValueError(
            f"layer `{n}`: batch_factors of the block {type(b).__name__} (LayerConfig.blocks) "
            f"returns {got}, but init_factors {want}: make their structures and shapes agree."
          )
      return out

    data = [stats.data[i] for i in self._active]

    # The factors contract over the (possibly sharded) batch axis: on a mesh with explicit axes
    # that contraction runs with them made automatic.
    def every(data, cache):
      return {n: one(n, b, d, cache) for n, b, d in zip(self.names, self.blocks, data)}

    out = _parallel.explicit_axes_as_auto(every, data, cache)
    if axis_name is not None:
      out = jax.lax.pmean(out, axis_name)
    return out

  def update_curvature_from_stats(
    self,
    state: EstimatorState,
    stats: _curvature.CurvatureStats,
    ema_decay,
    axis_name: str | None = None,
    mesh: tuple[Any, str] | None = None,
  ) -> EstimatorState:
    """EMA update of the statistics with this batch's; a non-finite batch is skipped entirely.
    With decay ρ and w ← ρ w + 1, F ← F + (F_batch − F) / w: bias-corrected, exactly F_batch
    after the first update."""
    _checks.number(ema_decay, "ema_decay", low=0.0, high=1.0, high_open=True)
    self.check_state(state, axis_name, mesh)
    self.check_stats(stats)
    return self._fold(state, stats, ema_decay, axis_name, mesh)

  @jax.named_scope("kfac_statistics")
  def _fold(self, state, stats, ema_decay, axis_name, mesh) -> EstimatorState:
    """`update_curvature_from_stats`, unchecked (the fronts' engine checked its arguments)."""
    new = self._batch_factors(stats, axis_name, state.cache)
    acc = self.numerics.accum_dtype
    decay = jnp.asarray(ema_decay, acc)
    weight = decay * state.ema_weight + 1

    def average(old, b, weight):  # In at least float32, stored in stats_dtype.
      old_acc = old.astype(acc)
      return (old_acc + (b.astype(acc) - old_acc) / weight).astype(old.dtype)

    # Tested in `stats_dtype`, so a statistic that overflows it (float16) skips the batch too.
    stored = self.numerics.stats_dtype
    ok = _storage.all_finite(jax.tree_util.tree_map(lambda x: x.astype(stored), new))
    # A cond on the scalar flag, not a `where` over every factor: the average is computed in
    # the taken branch, straight into the new state's buffers.
    fold = lambda: (self.storage.fold(state.factors, new, weight, average, axis_name, mesh), weight)
    factors, weight = jax.lax.cond(ok, fold, lambda: (state.factors, state.ema_weight))
    skipped = state.skipped_batches + (~ok).astype(jnp.int32)
    return state._replace(factors=factors, ema_weight=weight, skipped_batches=skipped)

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
    """`update_curvature_from_stats` with statistics computed from `batch`; the other arguments
    are checked first, so a bad one costs no forward and backward pass."""
    _checks.number(ema_decay, "ema_decay", low=0.0, high=1.0, high_open=True)
    self.check_state(state, axis_name, mesh)
    stats = self.curvature_stats(params, batch, rng)
    return self.update_curvature_from_stats(state, stats, ema_decay, axis_name, mesh)

  def update_inverses(
    self,
    state: EstimatorState,
    damping,
    *,
    axis_name: str | None = None,
    mesh: tuple[Any, str] | None = None,
  ) -> EstimatorState:
    """Recomputes every block's cache for damping λ ≥ 0; a block whose new cache is not finite
    keeps its previous one. `axis_name` (pmap / shard_map) or `mesh=(mesh, axis)` (jit) split
    the work over the devices, blocks balanced by cost, with the unsplit result exactly."""
    _checks.number(damping, "damping", low=0.0, schedule=True)
    self.check_state(state, axis_name, mesh)
    if axis_name is not None and mesh is not None:
      raise ValueError("pass `axis_name` (inside pmap/shard_map) or `mesh` (under jit), not both.")
    return self._refresh_flagged(state, damping, axis_name, mesh)[0]

  @jax.named_scope("kfac_inverses")
  def _refresh_flagged(self, state, damping, axis_name, mesh) -> tuple[EstimatorState, Array]:
    """`update_inverses`, unchecked, and `[len(names)]` bool: the blocks whose new cache was not
    finite (each kept its previous one)."""
    damping = jnp.asarray(damping, self.numerics.inverse_dtype)
    cache, failed = self.storage.refresh(state.factors, state.cache, damping, axis_name, mesh)
    count = jnp.sum(failed, dtype=state.failed_inverses.dtype)
    return state._replace(cache=cache, failed_inverses=state.failed_inverses + count), failed

  def apply(self, state: EstimatorState, vector, fn, axis_name=None, mesh=None, method=""):
    """`fn(block, factors, cache, vecs)` for every block; the leaves outside every block pass
    through."""
    with jax.named_scope(f"kfac_{method}"):
      leaves, treedef = jax.tree_util.tree_flatten(vector)
      paths = _scan.param_paths(vector)
      if paths != self.registration.param_paths:
        raise ValueError(
          "the vector's pytree structure differs from the params this estimator was built "
          f"for: got leaves {list(paths)}, expected {list(self.registration.param_paths)}."
        )
      for shape, x, path in zip(self.registration.param_shapes, leaves, paths):
        if tuple(np.shape(x)) != shape:
          raise ValueError(f"vector leaf `{path}` has shape {np.shape(x)}, expected {shape}.")

      def run(factors, cache, leaves):
        return self.storage.apply(factors, cache, leaves, fn, axis_name, mesh, method)

      out = _parallel.explicit_axes_as_auto(run, state.factors, state.cache, leaves, like=leaves)
      return jax.tree_util.tree_unflatten(treedef, out)

  def multiply_matpower(self, state, vector, exp: float, *, axis_name=None, mesh=None):
    """(damped curvature)^exp · vector, block by block. `exp` must be 1 or in `exps`. With
    sharded storage each device multiplies its own blocks, summed over the axis (one `psum`)."""
    self.check_state(state, axis_name, mesh)
    exp = float(exp)
    if exp != 1 and exp not in self.numerics.exps:
      raise ValueError(
        f"matrix power {exp:g} was not prepared: this estimator has exps="
        f"{self.numerics.exps} (1 is always available)."
      )
    return self._power(state, vector, exp, axis_name, mesh)

  def _power(self, state, vector, exp: float, axis_name, mesh):
    """`multiply_matpower`, unchecked (the fronts' engine checked its arguments)."""
    power = lambda b, f, c, v: b.multiply_matpower(f, c, v, exp)
    return self.apply(state, vector, power, axis_name, mesh, "multiply_matpower")

  def multiply(self, state: EstimatorState, vector, *, axis_name=None, mesh=None):
    """The damped curvature times `vector` (power 1)."""
    return self.multiply_matpower(state, vector, 1, axis_name=axis_name, mesh=mesh)

  def multiply_inverse(self, state: EstimatorState, vector, *, axis_name=None, mesh=None):
    """The inverse damped curvature times `vector` (needs -1 in `exps`, the default)."""
    return self.multiply_matpower(state, vector, -1, axis_name=axis_name, mesh=mesh)

  def multiply_cholesky(
    self, state, vector, *, transpose=False, inverse=False, axis_name=None, mesh=None
  ):
    """C·v (C⁻¹·v with `inverse`; Cᵀ with `transpose`), C Cᵀ = damped curvature."""
    self.check_state(state, axis_name, mesh)
    cholesky = lambda b, f, c, v: b.multiply_cholesky(f, c, v, transpose=transpose, inverse=inverse)
    method = "multiply_cholesky_inverse" if inverse else "multiply_cholesky"
    return self.apply(state, vector, cholesky, axis_name, mesh, method)

  def multiply_cholesky_inverse(
    self, state: EstimatorState, vector, *, transpose=False, axis_name=None, mesh=None
  ):
    """C⁻¹·v (or C⁻ᵀ·v)."""
    return self.multiply_cholesky(
      state, vector, transpose=transpose, inverse=True, axis_name=axis_name, mesh=mesh
    )

  def to_dense(self, state: EstimatorState) -> Array:
    """The undamped block-diagonal estimate as one matrix, ordered like `ravel_pytree(params)`
    (outside a trace one compiled program: op by op, each small scatter would compile)."""
    self.check_state(state)
    traced = any(isinstance(x, jax.core.Tracer) for x in jax.tree_util.tree_leaves(state))
    if traced or not isinstance(self.storage, _storage.ReplicatedStorage):
      return self._dense(state)
    return self._compiled_dense(state)

  @functools.cached_property
  def _compiled_dense(self):
    return jax.jit(self._dense)

  def _dense(self, state: EstimatorState) -> Array:
    sizes = [int(np.prod(s)) for s in self.registration.param_shapes]
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    total = int(offsets[-1])
    out = jnp.zeros((total, total), self.numerics.inverse_dtype)
    factors = self.storage.block_factors(state.factors)
    for n, b in zip(self.names, self.blocks):
      idx = np.concatenate([np.arange(offsets[j], offsets[j + 1]) for j in b.spec.leaf_indices])
      cache = self.storage.block_cache(state.cache, n) if b.needs_cache_for_statistics else None
      out = out.at[np.ix_(idx, idx)].set(b.to_dense(factors[n], cache))
    return out

  def summary(self) -> str:
    """The kept layers as a table (see `kfac_jax.summary`)."""
    param_bytes = sum(
      int(np.prod(shape)) * np.dtype(dtype).itemsize
      for shape, dtype in self.registration.param_signature[1]
    )
    return _summary.format_table([self.layers[i] for i in self._active], self.blocks, param_bytes)
