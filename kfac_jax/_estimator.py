"""The curvature estimator: the block-diagonal curvature of a registration, as pure functions.

The estimate is the Fisher of the mean per-example negative log-likelihood of the tagged
predictive distribution(s),

    F = (1/N) Σₙ E_y[∇ log p(y|xₙ) ∇ log p(y|xₙ)ᵀ] = (1/N) Σₙ Jₙᵀ F_z Jₙ,

N the loss tags' leading axis, approximated block-diagonally (one block per layer) and
averaged over batches with a bias-corrected EMA; the estimation mode chooses how F_z is
represented (the "_GGN" modes use the loss Hessian H_z). `Estimator` is the engine every front
shares; `kfac_jax.CurvatureEstimator` is its public face.
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
      `blocks.KroneckerFactors(a: [in+1, in+1], g: [out, out])`; shapes in
      `kfac_jax.blocks._state`).
    cache: per block name, the block kind's cache type: powers / decompositions and the
      damping `[]` they were built with. With sharded storage, both are `ShardedCache`
      objects holding only this device's blocks.
    ema_weight: `[]` float, Σ decay^k over updates so far (0 before the first update).
    skipped_batches: `[]` int32, statistics updates skipped because the batch's statistics
      were not finite (the factors were left as they were).
    failed_inverses: `[]` int32, block factorisations that were not finite (the block kept its
      previous cache).
  """

  factors: dict[str, Any] | _parallel.ShardedCache
  cache: dict[str, Any] | _parallel.ShardedCache
  ema_weight: Array
  skipped_batches: Array
  failed_inverses: Array


@dataclasses.dataclass(frozen=True, eq=False)
class Estimator:
  """The curvature blocks of one registration, complete and immutable; every method is a pure
  function of its arguments.

  Attributes:
    registration: the layers and the parameters' signature.
    config: the blocks' numerics.
    storage: `ReplicatedStorage()` or `ShardedStorage()`: where the caches live.
    active: indices of the registration's layers whose blocks this estimator keeps (None:
      every one).
    who: how errors name the consumer of the statistics (e.g. "this kfac transform").
    compute_params_stats: `curvature_stats` also returns the first-order statistics.
  """

  registration: _registration.Registration
  config: _blocks.BlockConfig
  storage: _storage.Storage = _storage.ReplicatedStorage()
  active: tuple[int, ...] | None = None
  who: str = "this estimator"
  compute_params_stats: bool = False

  def __post_init__(self):
    self.storage.check_blocks(self.names, self.blocks)
    _compat.one_lapack_thread()

  # -- structure -------------------------------------------------------------------------------

  @property
  def _active(self) -> tuple[int, ...]:
    return tuple(range(len(self.registration.layers))) if self.active is None else self.active

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
    every = self.registration.blocks(self.config)
    return tuple(every[i] for i in self._active)

  @property
  def _sig(self) -> tuple[tuple[str, ...], tuple[tuple[tuple[int, ...], str], ...]]:
    return self.registration.param_signature

  def restrict(self, kept: Sequence[bool]) -> Estimator:
    """This estimator keeping only the blocks of the parameter leaves `kept` (one flag per
    registered leaf): for a transform handed a share of the parameters by
    `optax.multi_transform` / `optax.masked`. A block with leaves on both sides raises
    ValueError naming its layer and both sets of leaves."""
    paths = self._sig[0]
    active = []
    for i, (n, spec) in enumerate(zip(self.registration.block_names, self.layers)):
      inside = [f"`{paths[j]}`" for j in spec.leaf_indices if kept[j]]
      outside = [f"`{paths[j]}`" for j in spec.leaf_indices if not kept[j]]
      if inside and outside:
        raise ValueError(
          f"{self.who}: layer `{n}` has {', '.join(inside)} in this transform's share of the "
          f"parameters and {', '.join(outside)} outside it (optax.multi_transform / "
          "optax.masked gave them other labels). Its curvature block spans all of them: give "
          "the whole layer one label."
        )
      if inside:
        active.append(i)
    return dataclasses.replace(self, active=tuple(active))

  # -- state -----------------------------------------------------------------------------------

  @functools.cached_property
  def _state_shapes(self):
    return jax.eval_shape(self.init)

  def check_state(
    self, state, axis_name=None, mesh=None, who: str | None = None, what: str = "state"
  ):
    """ValueError naming what differs when `state` is not one this estimator's `init` makes
    (another model, layer configuration or storage), and when `axis_name` is not bound (with
    a `mesh` too, the storage names the conflict). A sharded state's buffers are checked by
    its storage."""
    who = who or self.who
    if mesh is None:
      _checks.axis_bound(axis_name, who)
    if isinstance(self.storage, _storage.ReplicatedStorage):
      _fit.check(self._state_shapes, state, who, what)

  def init(self, *, axis_name: str | None = None, mesh: tuple[Any, str] | None = None):
    """Zero statistics and identity caches (see `kfac_jax.CurvatureEstimator.init`)."""
    factors, cache = self.storage.init_state(self.names, self.blocks, axis_name, mesh)
    return EstimatorState(
      factors=factors,
      cache=cache,
      ema_weight=jnp.zeros((), self.config.accum_dtype),
      skipped_batches=jnp.zeros((), jnp.int32),
      failed_inverses=jnp.zeros((), jnp.int32),
    )

  @jax.named_scope("kfac_statistics")
  def curvature_stats(self, params, batch, rng) -> _curvature.CurvatureStats:
    """This batch's raw curvature data (one forward pass, one sampled backward pass)."""
    reg = self.registration
    reg.check_params(params)
    # Only pulled back: convolutions transpose with canonically ordered kernels (fast inside
    # the transforms' `lax.cond` on CPU; `_compat.pull_back_convs_canonically`).
    with _compat.pull_back_convs_canonically():
      out = reg.compute(
        params, batch, rng, with_grads=False, with_params_stats=self.compute_params_stats
      )
    return out[-1]

  def batch_factors(
    self, stats: _curvature.CurvatureStats, axis_name: str | None = None, cache=None
  ) -> dict[str, Any]:
    """Per-block statistics of one batch (the block kinds' factors types), averaged over
    `axis_name`; blocks with `needs_cache_for_statistics` (EKFAC) read their entry of `cache`."""
    reg = self.registration
    if stats.layer_shapes and stats.layer_names == tuple(s.name for s in self.layers):
      # value_and_grad scanned this batch: a layer that changed with the batch size is named.
      reg.check_layer_shapes(
        stats.layer_names, stats.layer_shapes, stats.batch_size, kinds_only=True
      )
    reg.check_stats(stats, self.who)

    def one(n, b, d, cache):
      if isinstance(d, _blocks.StackedUses) and not b.accepts_stacked_uses():
        d = d.unstack()
      if b.needs_cache_for_statistics and cache is not None:
        return b.batch_factors(d, stats.batch_size, cache=self.storage.block_cache(cache, n))
      return b.batch_factors(d, stats.batch_size)

    data = [stats.data[i] for i in self._active]
    # The factors contract over the (possibly sharded) batch axis: on a mesh with explicit axes
    # that contraction runs with them made automatic.
    out = _parallel.explicit_axes_as_auto(
      lambda data, cache: {
        n: one(n, b, d, cache) for n, b, d in zip(self.names, self.blocks, data)
      },
      data,
      cache,
    )
    if axis_name is not None:
      out = jax.lax.pmean(out, axis_name)
    return out

  @jax.named_scope("kfac_statistics")
  def update_curvature_from_stats(
    self,
    state: EstimatorState,
    stats: _curvature.CurvatureStats,
    ema_decay,
    axis_name: str | None = None,
    mesh: tuple[Any, str] | None = None,
  ) -> EstimatorState:
    """The EMA update (see `kfac_jax.CurvatureEstimator.update_curvature_from_stats`)."""
    _checks.number(ema_decay, "ema_decay", low=0.0, high=1.0, high_open=True)
    self.check_state(state, axis_name, mesh)
    new = self.batch_factors(stats, axis_name, cache=state.cache)
    acc = self.config.accum_dtype
    decay = jnp.asarray(ema_decay, acc)
    weight = decay * state.ema_weight + 1

    def average(old, b, weight):  # In at least float32, stored in stats_dtype.
      old_acc = old.astype(acc)
      return (old_acc + (b.astype(acc) - old_acc) / weight).astype(old.dtype)

    # Tested in `stats_dtype`, so a statistic that overflows it (float16) skips the batch too.
    stored = self.config.stats_dtype
    ok = _storage.all_finite(jax.tree_util.tree_map(lambda x: x.astype(stored), new))
    # A cond on the scalar flag, not a `where` over every factor: the average is computed in
    # the taken branch, straight into the new state's buffers.
    factors, weight = jax.lax.cond(
      ok,
      lambda: (
        self.storage.fold(
          self.names,
          self.blocks,
          state.factors,
          [new[n] for n in self.names],
          weight,
          average,
          axis_name,
          mesh,
        ),
        weight,
      ),
      lambda: (state.factors, state.ema_weight),
    )
    return state._replace(
      factors=factors,
      ema_weight=weight,
      skipped_batches=state.skipped_batches + (~ok).astype(jnp.int32),
    )

  @jax.named_scope("kfac_inverses")
  def update_inverses(
    self,
    state: EstimatorState,
    damping,
    *,
    axis_name: str | None = None,
    mesh: tuple[Any, str] | None = None,
  ) -> EstimatorState:
    """Recomputes every block's cache for damping λ (see `CurvatureEstimator.update_inverses`)."""
    _checks.number(damping, "damping", low=0.0, schedule=True)
    self.check_state(state, axis_name, mesh)
    if axis_name is not None and mesh is not None:
      raise ValueError("pass `axis_name` (inside pmap/shard_map) or `mesh` (under jit), not both.")
    damping = jnp.asarray(damping, self.config.inverse_dtype)
    cache, failed = self.storage.refresh(
      self.names,
      self.blocks,
      state.factors,
      state.cache,
      damping,
      axis_name,
      mesh,
    )
    return state._replace(cache=cache, failed_inverses=state.failed_inverses + failed)

  # -- products --------------------------------------------------------------------------------

  def apply(self, state: EstimatorState, vector, fn, axis_name=None, mesh=None, method=""):
    """`fn(block, factors, cache, vecs)` for every block; the leaves outside every block pass
    through."""
    with jax.named_scope(f"kfac_{method}"):
      leaves, treedef = jax.tree_util.tree_flatten(vector)
      paths = _scan.param_paths(vector)
      if paths != self._sig[0]:
        raise ValueError(
          "the vector's pytree structure differs from the params this estimator was built "
          f"for: got leaves {list(paths)}, expected {list(self._sig[0])}."
        )
      for (shape, _), x, path in zip(self._sig[1], leaves, paths):
        if tuple(np.shape(x)) != shape:
          raise ValueError(f"vector leaf `{path}` has shape {np.shape(x)}, expected {shape}.")
      out = _parallel.explicit_axes_as_auto(
        lambda factors, cache, leaves: self.storage.apply(
          self.names,
          self.blocks,
          factors,
          cache,
          leaves,
          fn,
          axis_name,
          mesh,
          method,
        ),
        state.factors,
        state.cache,
        leaves,
        like=leaves,
      )
      return jax.tree_util.tree_unflatten(treedef, out)

  def multiply_matpower(self, state, vector, exp: float, *, axis_name=None, mesh=None):
    """(damped curvature)^exp · vector, block by block. `exp` must be 1 or in `exps`."""
    self.check_state(state, axis_name, mesh)
    exp = float(exp)
    if exp != 1 and exp not in self.config.exps:
      raise ValueError(
        f"matrix power {exp:g} was not prepared: this estimator has exps="
        f"{self.config.exps} (1 is always available)."
      )
    return self.apply(
      state,
      vector,
      lambda b, f, c, v: b.multiply_matpower(f, c, v, exp),
      axis_name,
      mesh,
      "multiply_matpower",
    )

  def multiply_cholesky(
    self, state, vector, *, transpose=False, inverse=False, axis_name=None, mesh=None
  ):
    """C·v (C⁻¹·v with `inverse`; Cᵀ with `transpose`), C Cᵀ = damped curvature."""
    self.check_state(state, axis_name, mesh)
    return self.apply(
      state,
      vector,
      lambda b, f, c, v: b.multiply_cholesky(f, c, v, transpose=transpose, inverse=inverse),
      axis_name,
      mesh,
      "multiply_cholesky_inverse" if inverse else "multiply_cholesky",
    )

  def to_dense(self, state: EstimatorState) -> Array:
    """The undamped block-diagonal estimate as one matrix, ordered like `ravel_pytree(params)`."""
    self.check_state(state)
    sizes = [int(np.prod(s)) for s, _ in self._sig[1]]
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    total = int(offsets[-1])
    out = jnp.zeros((total, total), self.config.inverse_dtype)
    factors = self.storage.block_factors(self.names, self.blocks, state.factors)
    for n, b in zip(self.names, self.blocks):
      idx = np.concatenate([np.arange(offsets[j], offsets[j + 1]) for j in b.spec.leaf_indices])
      cache = self.storage.block_cache(state.cache, n) if b.needs_cache_for_statistics else None
      out = out.at[np.ix_(idx, idx)].set(b.to_dense(factors[n], cache))
    return out

  def summary(self) -> str:
    """The kept layers as a table (see `kfac_jax.summary`)."""
    param_bytes = sum(
      int(np.prod(shape)) * np.dtype(dtype).itemsize for shape, dtype in self._sig[1]
    )
    return _summary.format_table([self.layers[i] for i in self._active], self.blocks, param_bytes)
