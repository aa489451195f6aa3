"""CurvatureEstimator: the block-diagonal curvature of a tagged loss, as pure functions.

Mirrors TF K-FAC's FisherEstimator. The estimate is the Fisher of the mean per-example negative
log-likelihood of the tagged predictive distribution(s),

    F = (1/N) Σₙ E_y[∇ log p(y|xₙ) ∇ log p(y|xₙ)ᵀ] = (1/N) Σₙ Jₙᵀ F_z Jₙ,

N being the loss tags' leading axis, approximated block-diagonally (one block per layer) and
averaged over batches with a bias-corrected exponential moving average. The estimation mode
chooses how the output factor F_z is represented (sampled, Rademacher or exact square-root
vectors; or, for "empirical", the data's gradient); the "_GGN" modes use the loss Hessian in z,
giving the generalised Gauss-Newton Jᵀ H_z J (the same matrix for the tags' canonical losses).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, ParamSpec, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
import optax

from kfac_jax import (
  _checks,
  _compat,
  _config,
  _curvature,
  _parallel,
  _registration,
  _storage,
)
from kfac_jax import blocks as _blocks
from kfac_jax import scan as _scan

Array = jax.Array
all_finite = _storage.all_finite


# The `EstimatorState` fields that hold one entry per block (named in checkpoint errors).
PER_BLOCK_FIELDS = ("factors", "cache")


class EstimatorState(NamedTuple):
  """All numbers of the estimator; static structure lives on the estimator object.

  Attributes:
    factors: per block name, the EMA statistics as the block kind's factors type (e.g.
      `blocks.KroneckerFactors(a: [in+1, in+1], g: [out, out])`; every type is documented, with
      shapes, in `kfac_jax.blocks._state`); with sharded storage, a `ShardedCache` holding
      only this device's blocks.
    cache: per block name, the block kind's cache type: powers / decompositions and the
      damping `[]` they were built with; with sharded storage, a `ShardedCache` holding only
      this device's blocks.
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


_P = ParamSpec("_P")
_R = TypeVar("_R")


def _scoped(name: str) -> Callable[[Callable[_P, _R]], Callable[_P, _R]]:
  """Runs the method under `jax.named_scope(name)`: its operations carry `name` in their
  op_name metadata, so a profile of a training step (Perfetto, TensorBoard) attributes them
  to K-FAC's statistics, inverses or products. Metadata only: the program is unchanged."""

  def wrap(method: Callable[_P, _R]) -> Callable[_P, _R]:
    @functools.wraps(method)
    def scoped(*args: _P.args, **kwargs: _P.kwargs) -> _R:
      with jax.named_scope(name):
        return method(*args, **kwargs)

    return scoped

  return wrap


def check_unit_interval(value, name: str) -> None:
  """ema_decay-style check: 0 <= value < 1 (a traced value passes unchecked)."""
  _checks.number(value, name, low=0.0, high=1.0, high_open=True)


def check_damping(value, name: str = "damping") -> None:
  """A number >= 0 or a schedule (a traced value passes unchecked)."""
  _checks.number(value, name, low=0.0, schedule=True)


@dataclasses.dataclass(frozen=True, eq=False)
class Estimator:
  """The curvature blocks of one registration, complete and immutable: pure state updates.

  Built from a `Registration` (the layers and the parameters' signature), the blocks' numerics
  (`blocks.BlockConfig`) and a storage strategy; `active` keeps a share of the registration's
  blocks (`restrict`). Every method is a pure function of its arguments.

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

  def restrict(self, kept: Sequence[bool], who: str | None = None) -> Estimator:
    """This estimator keeping only the blocks of the parameter leaves `kept` (one flag per
    registered leaf, in the registration's order): for a transform handed a share of the
    parameters by `optax.multi_transform` / `optax.masked`. A block with leaves on both sides
    raises ValueError naming its layer and both sets of leaves."""
    who = self.who if who is None else who
    paths = self._sig[0]
    kept = tuple(bool(k) for k in kept)
    if len(kept) != len(paths):
      raise ValueError(f"{who}: {len(kept)} leaf flags for {len(paths)} registered leaves.")
    active = []
    for i, (n, spec) in enumerate(zip(self.registration.block_names, self.layers)):
      inside = [paths[j] for j in spec.leaf_indices if kept[j]]
      outside = [paths[j] for j in spec.leaf_indices if not kept[j]]
      if inside and outside:
        raise ValueError(
          f"{who}: layer `{n}` has {_quoted(inside)} in this transform's share of the "
          f"parameters and {_quoted(outside)} outside it (optax.multi_transform / optax.masked "
          "gave them other labels). Its curvature block spans all of them: give the whole "
          "layer one label."
        )
      if inside:
        active.append(i)
    return dataclasses.replace(self, active=tuple(active), who=who)

  def _by_block(self, by_name: dict[str, Any]) -> list[Any]:
    """A per-name state dict as a list in block order."""
    return [by_name[n] for n in self.names]

  # -- state -----------------------------------------------------------------------------------

  def init(self, *, axis_name: str | None = None, mesh: tuple[Any, str] | None = None):
    """Zero statistics and identity caches (see `CurvatureEstimator.init`)."""
    factors, cache = self.storage.init_state(self.names, self.blocks, axis_name, mesh)
    return EstimatorState(
      factors=factors,
      cache=cache,
      ema_weight=jnp.zeros((), self.config.accum_dtype),
      skipped_batches=jnp.zeros((), jnp.int32),
      failed_inverses=jnp.zeros((), jnp.int32),
    )

  @_scoped("kfac_statistics")
  def curvature_stats(self, params, batch, rng) -> _curvature.CurvatureStats:
    """This batch's raw curvature data (one forward pass, one sampled backward pass)."""
    reg = self.registration
    reg.check_params(params)
    # Only pulled back: convolutions transpose with canonically ordered kernels (fast inside
    # the transforms' `lax.cond` on CPU; `_compat.pull_back_convs_canonically`).
    with _compat.pull_back_convs_canonically():
      _, _, stats = _curvature.compute(
        reg.scan_batch(params, batch),
        params,
        batch,
        rng,
        estimation_mode=reg.estimation_mode,
        num_samples=reg.num_samples,
        with_grads=False,
        with_params_stats=self.compute_params_stats,
        fingerprint=reg.fingerprint,
      )
    return stats

  def batch_factors(
    self, stats: _curvature.CurvatureStats, axis_name: str | None = None, cache=None
  ) -> dict[str, Any]:
    """Per-block statistics of one batch, averaged over `axis_name` devices if given.

    Blocks with `needs_cache_for_statistics` (EKFAC: its scalings live in the eigenbasis of
    the last inverse update) get their entry of `cache` (the state's, replicated storage).
    Returns one entry per block name, of the block kind's factors type.
    """
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

  @_scoped("kfac_statistics")
  def update_curvature_from_stats(
    self,
    state: EstimatorState,
    stats: _curvature.CurvatureStats,
    ema_decay,
    axis_name: str | None = None,
    mesh: tuple[Any, str] | None = None,
  ) -> EstimatorState:
    """EMA update of the statistics with this batch's; a non-finite batch is skipped entirely.

    With decay ρ and w ← ρ w + 1, the factors become F ← F + (F_batch − F) / w: a bias-corrected
    average, exactly F_batch after the first update (and always with ρ = 0).
    """
    check_unit_interval(ema_decay, "ema_decay")
    new = self.batch_factors(stats, axis_name, cache=state.cache)
    acc = self.config.accum_dtype
    decay = jnp.asarray(ema_decay, acc)
    weight = decay * state.ema_weight + 1

    def average(old, b, weight):  # In at least float32, stored in stats_dtype.
      old_acc = old.astype(acc)
      return (old_acc + (b.astype(acc) - old_acc) / weight).astype(old.dtype)

    # Tested in `stats_dtype`, so a statistic that overflows it (float16) skips the batch too.
    stored = self.config.stats_dtype
    ok = all_finite(jax.tree_util.tree_map(lambda x: x.astype(stored), new))
    # A select on the scalar flag (`lax.cond`) rather than an elementwise `where` over every
    # factor: the same result at half the compile time. The average is computed inside the
    # taken branch, so it writes straight into the new state's buffers.
    factors, weight = jax.lax.cond(
      ok,
      lambda: (
        self.storage.fold(
          self.names,
          self.blocks,
          state.factors,
          self._by_block(new),
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

  @_scoped("kfac_inverses")
  def update_inverses(
    self,
    state: EstimatorState,
    damping,
    *,
    axis_name: str | None = None,
    mesh: tuple[Any, str] | None = None,
  ) -> EstimatorState:
    """Recomputes every block's cache for damping λ (see `CurvatureEstimator.update_inverses`)."""
    check_damping(damping)
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

  def multiply(self, state, vector, *, axis_name=None, mesh=None):
    """The damped curvature times `vector` (power 1)."""
    return self.multiply_matpower(state, vector, 1, axis_name=axis_name, mesh=mesh)

  def multiply_inverse(self, state, vector, *, axis_name=None, mesh=None):
    """The inverse damped curvature times `vector` (needs -1 in `exps`)."""
    return self.multiply_matpower(state, vector, -1, axis_name=axis_name, mesh=mesh)

  def multiply_cholesky(
    self, state, vector, *, transpose=False, inverse=False, axis_name=None, mesh=None
  ):
    """C·v (C⁻¹·v with `inverse`; Cᵀ with `transpose`), C Cᵀ = damped curvature."""
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
    return format_table([self.layers[i] for i in self._active], self.blocks, param_bytes)


class Estimators:
  """The complete `Estimator` of a front, built from the first params it sees.

  A transform or an estimator is built from `loss_fn` and an example batch before any params
  are known; the layers come from the first params it sees, and later params must have their
  structure, shapes and dtypes. So this holds at most one value, the result of a pure function
  of the first params' signature, computed on first use (as `functools.cache` would); with a
  `registration=` it is built here.

  Args:
    loss_fn, example_batch: scanned on first use (None with `registration`).
    registration: a `Registration` to use instead.
    settings: the `Registration` keyword arguments for `loss_fn`.
    block_config: the blocks' numerics.
    storage: the storage strategy.
    who: how errors name the owner (e.g. "this kfac transform").
    compute_params_stats: see `CurvatureEstimator`.
  """

  def __init__(
    self,
    loss_fn,
    example_batch,
    registration: _registration.Registration | None,
    settings: dict[str, Any],
    block_config: _blocks.BlockConfig,
    storage: _storage.Storage,
    who: str,
    compute_params_stats: bool = False,
  ):
    self._loss_fn = loss_fn
    self._example_batch = example_batch
    self._settings = settings
    self._make = functools.partial(
      Estimator,
      config=block_config,
      storage=storage,
      who=who,
      compute_params_stats=compute_params_stats,
    )
    self._memo: list[Estimator] = [] if registration is None else [self._make(registration)]

  @property
  def registered(self) -> bool:
    """Whether the estimator exists (a registration given, or params seen)."""
    return bool(self._memo)

  def for_params(self, params, axis_name=None) -> Estimator:
    """The estimator, checked against `params` (the first params build it)."""
    if self._memo:
      self._memo[0].registration.check_params(params)
      return self._memo[0]
    reg = _registration.Registration(
      self._loss_fn, params, self._example_batch, axis_name=axis_name, **self._settings
    )
    self._memo.append(self._make(reg))
    return self._memo[0]

  def only(self) -> Estimator:
    """The estimator (a registration given, or params seen)."""
    if not self._memo:
      raise RuntimeError("call `init(params)` first: the layers are found when params are known.")
    return self._memo[0]


def is_masked(x) -> bool:
  return isinstance(x, optax.MaskedNode)


def masked_share(tree) -> tuple[bool, ...] | None:
  """For a pytree with `optax.MaskedNode` leaves (the share of the parameters that
  `optax.multi_transform` / `optax.masked` hand an inner transform): per leaf, masked ones
  included, whether it is in the share. None when no leaf is masked."""
  kept = tuple(not is_masked(x) for x in jax.tree_util.tree_leaves(tree, is_leaf=is_masked))
  return None if all(kept) else kept


def fill(est: Estimator, share, abstract: bool = False):
  """`share` with its `optax.MaskedNode` leaves replaced by zeros of the registered shapes and
  dtypes (`jax.ShapeDtypeStruct`s with `abstract`): the whole params' structure."""
  flat, treedef = jax.tree_util.tree_flatten(share, is_leaf=is_masked)
  sig = est.registration.param_signature[1]
  if len(flat) != len(sig):  # Wrong structure: `check_params` names the leaf.
    return jax.tree_util.tree_unflatten(treedef, flat)
  make = jax.ShapeDtypeStruct if abstract else jnp.zeros
  leaves = [
    make(shape, jnp.dtype(dtype)) if is_masked(x) else x for x, (shape, dtype) in zip(flat, sig)
  ]
  return jax.tree_util.tree_unflatten(treedef, leaves)


def unfill(full, share):
  """The leaves of `full` (whole params' structure) at `share`'s unmasked leaves, in `share`'s
  structure."""
  flat, treedef = jax.tree_util.tree_flatten(share, is_leaf=is_masked)
  leaves = jax.tree_util.tree_leaves(full)
  return jax.tree_util.tree_unflatten(
    treedef, [x if is_masked(x) else y for x, y in zip(flat, leaves)]
  )


def for_front(loss_fn, example_batch, registration, config, who: str):
  """The `Estimators` memo of a front (checks `registration` against `config`)."""
  settings = _registration.estimator_settings(
    config.has_aux,
    config.estimation_mode,
    config.num_samples,
    config.strict,
    config.layers,
    prefix="config.",
  )
  reg = _registration.resolve(registration, loss_fn, example_batch, who, settings)
  if reg is None:
    if loss_fn is None:
      raise TypeError(
        f"{who}: pass `loss_fn` and `example_batch`, or `registration=` (a kfac_jax.Registration)."
      )
    _checks.function(loss_fn, "loss_fn")
  return Estimators(
    loss_fn,
    example_batch,
    reg,
    config.registration_settings(),
    config.block_config(),
    config.storage,
    f"this {who}" + ("" if who == "Optimizer" else " transform"),
  )


def estimator_for(ests: Estimators, params, who: str, axis_name=None):
  """`(estimator, kept)`: the complete estimator for `params`, restricted to the share when
  `params` has `optax.MaskedNode` leaves (`kept`: per registered leaf, whether it is in it)."""
  if not jax.tree_util.tree_leaves(params, is_leaf=is_masked) and ests.registered:
    # A tree without leaves: `optax.tree_map_params`' placeholder, which asks only for the
    # state's structure (the layers are known from an earlier `init`).
    return ests.only(), None
  kept = masked_share(params)
  if kept is None:
    return ests.for_params(params, axis_name), None
  if not ests.registered:
    raise ValueError(
      f"{who}: `params` has optax.MaskedNode leaves: optax.multi_transform or "
      "optax.masked hands this transform only its share of the parameters, and the model "
      "cannot be traced without the rest. Build the layers from the whole params, "
      "`reg = kfac_jax.Registration(loss_fn, params, batch)`, and pass `registration=reg` "
      f"to {who} and to kfac_jax.value_and_grad."
    )
  est = ests.only()
  est.registration.check_params(fill(est, params, abstract=True))
  return est.restrict(kept), kept


class CurvatureEstimator:
  """Block-diagonal K-FAC curvature estimate of `loss_fn`, with pure state updates.

  Args:
    loss_fn: `loss_fn(params, batch) -> scalar`, calling a loss tag on the model output; with
      `has_aux=True`, `loss_fn(params, batch) -> (scalar, aux)`.
    example_batch: a batch with the shapes used for training (arrays or ShapeDtypeStructs).
    registration: a `kfac_jax.Registration` instead of `loss_fn` and `example_batch`: its
      layers, `has_aux`, `estimation_mode`, `num_samples`, `strict` and `layers` apply (those
      arguments, left out, take its values; set to others, they are an error), `layers` and
      `blocks` are known at once, and `init` checks params against its signature. Without
      it, the first `init` builds one from the arguments.
    has_aux: `loss_fn` returns `(loss, aux)`; only the loss part is scanned for layers and the
      estimator never reads the aux.
    estimation_mode: how the output-space curvature is estimated (formulas in
      `kfac_jax._losses`): "gradients" (targets sampled from the model: the Fisher),
      "empirical" (the data's targets: the empirical Fisher), "curvature_prop" /
      "curvature_prop_GGN" (Rademacher vectors times a square-root factor of the output Fisher /
      loss Hessian), or "exact" / "exact_GGN" (every output coordinate, no sampling noise; K
      backward passes, K = the prediction's non-batch size). The GGN variants estimate
      Jᵀ (∂²ℓ/∂z²) J, which equals the Fisher for the canonical-link losses of the loss tags.
      The random modes need an `rng` in `update_curvature`; the exact modes and "empirical"
      take `rng=None`.
    exps: matrix powers `multiply_matpower` must support (1 always is).
    num_samples: random vectors per example in "gradients" and "curvature_prop(_GGN)" modes;
      ignored by "empirical"; must be 1 with the exact modes.
    damping_mode: "factored" (π-adjusted factored Tikhonov) or "eigen" (exact damping).
    compute_cholesky: cache Cholesky factors of the damped blocks.
    compute_cholesky_inverse: cache their inverses.
    strict: raise, instead of warning, when parameters are outside every recognised layer.
    compute_params_stats: `curvature_stats` also returns the first-order statistics
      (`CurvatureStats.params_stats`, TF K-FAC's `params_stats`).
    layers: a `kfac_jax.LayerConfig` choosing approximations per layer kind, per parameter-path
      pattern, and linked parameter groups (None: the defaults).
    stats_dtype: dtype the factors (moving averages of the statistics) are stored in: None
      (float32; float64 under x64), "float32", "float64", or "bfloat16" / "float16" to halve
      their memory. Batch statistics are always accumulated in at least float32, whatever the
      model's dtype, and cast to `stats_dtype` when they enter the moving average.
    inverse_dtype: dtype of the inverses / decompositions and of the products with them: None
      (float32; float64 under x64), "float32" or "float64". Preconditioned vectors come back in
      the dtype they came in (a bfloat16 model gets bfloat16 updates).
    preconditioner_dtype: None (`inverse_dtype`) or "bfloat16": the dtype the cached inverses
      of Kronecker factors (and of full blocks) are stored in once computed in
      `inverse_dtype`. The products with them (`multiply_matpower`, `multiply_inverse`) round
      the vector to it and accumulate in `inverse_dtype`: half the cache's memory, each input
      rounded to 8 significant bits, and faster products where the hardware multiplies
      bfloat16 natively. Diagonal factors, the substitution forms of `factor_solve`,
      eigen-decompositions ("eigen" damping, EKFAC), the series approximations of shared
      layers and Cholesky factors stay in `inverse_dtype`.
    inverse_storage: where the caches live on a data-parallel axis: "replicated" (default) or
      `kfac_jax.ReplicatedStorage()`: every device holds every block's cache; "sharded" or
      `kfac_jax.ShardedStorage()` (KAISA's memory-optimised strategy): each device stores,
      updates and refreshes only its share of the blocks' factors and caches (balanced by
      refresh cost, at most 1.25 total/D + one block per device) and preconditions their
      leaves; the products are summed over the axis. `init`, `update_curvature*`,
      `update_inverses` and the `multiply*` methods then need `axis_name=` (inside pmap /
      shard_map; call `init` there too) or `mesh=(mesh, axis)` (under jit).
    factor_solve: how a Kronecker factor's damped inverse is kept (`BlockConfig.factor_solve`):
      "auto" (default) keeps a factor of size n ≥ 256 whose products have at most n/8
      columns (a wide input into a narrow layer: a classifier head) in substitution form, its
      Cholesky factor in blocks applied by block substitution (a faster refresh, slower
      products), and the explicit inverse elsewhere; "never" always the inverse; "always" the
      substitution form for every Kronecker factor that can have it (not diagonal factors,
      stacks, grouped convolutions or "eigen" damping). The products are the same up to
      rounding; the cache's fields differ (`cache/<block>/a/subst/...` instead of
      `cache/<block>/a/powers/0`).

  Raises:
    TypeError: an argument of the wrong kind (e.g. `exps=-1`, `strict="yes"`), named with the
      value received.
    ValueError: an argument out of range or an unknown mode, named with the value and the
      choices.
    RegistrationError: (at `init`) no loss tag in `loss_fn`, or a return value that does not
      match `has_aux`.

  Example:
    >>> est = kfac_jax.CurvatureEstimator(loss_fn, batch)
    >>> state = est.init(params)
    >>> state = est.update_curvature(state, params, batch, rng, ema_decay=0.95)
    >>> state = est.update_inverses(state, damping=1e-3)
    >>> nat_grads = est.multiply_matpower(state, grads, -1)
  """

  def __init__(
    self,
    loss_fn: Callable | None = None,
    example_batch: Any = None,
    *,
    registration: _registration.Registration | None = None,
    has_aux: bool = False,
    estimation_mode: _curvature.EstimationMode = "gradients",
    exps: Sequence[float] = (-1,),
    num_samples: int = 1,
    damping_mode: _blocks.DampingMode = "factored",
    compute_cholesky: bool = False,
    compute_cholesky_inverse: bool = False,
    strict: bool = False,
    compute_params_stats: bool = False,
    layers: Any = None,
    stats_dtype: Any = None,
    inverse_dtype: Any = None,
    inverse_storage: Any = "replicated",
    factor_solve: _blocks.FactorSolve = "auto",
    preconditioner_dtype: Any = None,
  ):
    settings = _registration.estimator_settings(
      has_aux, estimation_mode, num_samples, strict, layers
    )
    reg = _registration.resolve(
      registration, loss_fn, example_batch, "CurvatureEstimator", settings
    )
    if reg is None:
      _curvature.LossPart(loss_fn, has_aux)  # Checks `loss_fn` and `has_aux` now.
    _curvature.check_mode(estimation_mode, num_samples)
    _checks.choice(damping_mode, "damping_mode", ("factored", "eigen"))
    storage = _storage.strategy(inverse_storage)
    _checks.choice(factor_solve, "factor_solve", ("auto", "always", "never"))
    for flag in ("compute_cholesky", "compute_cholesky_inverse", "strict", "compute_params_stats"):
      _checks.boolean(locals()[flag], flag)
    if isinstance(exps, (str, bytes)) or not isinstance(exps, (tuple, list)):
      raise TypeError(
        f"`exps` must be a tuple of non-zero numbers (matrix powers, e.g. (-1,)), got {exps!r}."
      )
    for e in exps:
      _checks.number(e, "exps", low=-np.inf)
      if e == 0:
        raise ValueError(f"`exps` must be non-zero finite numbers, got {exps!r}.")
    inverse_dtype = _config.resolve_dtype(inverse_dtype, "inverse_dtype")
    block_config = _blocks.BlockConfig(
      exps=tuple(float(e) for e in exps),
      damping_mode=damping_mode,
      cholesky=compute_cholesky,
      cholesky_inverse=compute_cholesky_inverse,
      stats_dtype=_config.resolve_dtype(stats_dtype, "stats_dtype"),
      inverse_dtype=inverse_dtype,
      factor_solve=factor_solve,
      preconditioner_dtype=_config.resolve_preconditioner_dtype(
        preconditioner_dtype, inverse_dtype
      ),
    )
    self._estimators = Estimators(
      loss_fn,
      example_batch,
      reg,
      {k[k.rfind(".") + 1 :]: v[1] for k, v in settings.items()},
      block_config,
      storage,
      "this estimator",
      compute_params_stats,
    )
    self.config = block_config
    self.storage = storage

  # -- structure -------------------------------------------------------------------------------

  @property
  def registered(self) -> bool:
    """Whether the layers are known (a registration given, or built by `init`)."""
    return self._estimators.registered

  @property
  def estimator(self) -> Estimator:
    """The complete estimator (after `init`, or at once with a registration)."""
    return self._estimators.only()

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
    """The evaluation graph of `loss_fn(params, batch)` (the registration's, kept per batch
    signature)."""
    return self._estimators.for_params(params).registration.scan_batch(params, batch)

  # -- state -----------------------------------------------------------------------------------

  def init(
    self, params, *, axis_name: str | None = None, mesh: tuple[Any, str] | None = None
  ) -> EstimatorState:
    """Zero statistics and identity caches for `params` (scans `loss_fn` on first use).

    With sharded storage, pass `axis_name` and call `init` inside pmap / shard_map (each
    device's cache differs), or pass `mesh=(mesh, axis)` to get the cache as a global array
    sharded over that mesh axis. Replicated storage uses `axis_name` only to trace a model
    whose collectives name it (e.g. `BatchNorm(axis_name=...)`) when `init` runs outside pmap
    / shard_map.
    """
    est = self._estimators.for_params(params, axis_name)
    return est.init(axis_name=axis_name, mesh=mesh)

  def curvature_stats(self, params, batch, rng) -> _curvature.CurvatureStats:
    """This batch's raw curvature data (one forward pass, one sampled backward pass)."""
    return self._estimators.for_params(params).curvature_stats(params, batch, rng)

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
    est = self._estimators.for_params(params)
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
    """Recomputes every block's cache for damping λ (equal-shape blocks vmapped, except on CPU).

    A block whose new cache is not finite keeps its previous cache.

    Args:
      state: the estimator state.
      damping: λ ≥ 0.
      axis_name: inside `pmap` / `shard_map`, split the work over this axis: each device
        factorises its share of the blocks (balanced by cost) and the caches are summed over
        the axis (see `kfac_jax._parallel`). The result equals the unsplit one exactly.
      mesh: under plain `jit` with sharded data, `(mesh, axis)` splits the work over that mesh
        axis the same way (through `shard_map`).

    With sharded storage one of the two is required, and each device refreshes and keeps only
    its own blocks' caches (no caches are communicated; the failure count is summed over the
    axis).
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

    With sharded storage, `axis_name` (inside pmap / shard_map) or `mesh` (under jit) is
    required: each device multiplies its own blocks, and the results are summed over the axis
    (one vector-sized `psum`). The other methods below take them the same way.
    """
    return self.estimator.multiply_matpower(state, vector, exp, axis_name=axis_name, mesh=mesh)

  def multiply(self, state: EstimatorState, vector, *, axis_name=None, mesh=None):
    """The damped curvature times `vector` (power 1)."""
    return self.estimator.multiply(state, vector, axis_name=axis_name, mesh=mesh)

  def multiply_inverse(self, state: EstimatorState, vector, *, axis_name=None, mesh=None):
    """The inverse damped curvature times `vector` (needs -1 in `exps`, the default)."""
    return self.estimator.multiply_inverse(state, vector, axis_name=axis_name, mesh=mesh)

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


def _quoted(paths: Sequence[str]) -> str:
  return ", ".join(f"`{p}`" for p in paths)


def _relative_paths(paths: Sequence[str]) -> str:
  """The parameter paths without the directory they all share (`kernel, bias` for a dense
  layer; `hi/kernel, hf/kernel, ...` for kernels concatenated from one module's leaves)."""
  dirs = [p.split("/")[:-1] for p in paths]
  common = 0
  while all(len(d) > common and d[common] == dirs[0][common] for d in dirs):
    common += 1
  return ", ".join("/".join(p.split("/")[common:]) for p in paths)


def format_table(
  layers: Sequence[_scan.LayerSpec],
  blocks: Sequence[_blocks.Block],
  param_bytes: int | None = None,
) -> str:
  """The layer table; with `param_bytes`, the total row compares the state with the parameters."""
  rows = [("layer", "kind", "uses", "approx", "parameters", "factor shapes", "memory", "note")]
  total = 0
  for s, b in zip(layers, blocks):
    nbytes = b.state_bytes()
    total += nbytes
    shapes = " ".join("x".join(map(str, f)) for f in b.factor_shapes)
    kind = s.kind + (f" (stack of {s.stack_size})" if s.stack_size else "")
    rows.append(
      (
        s.name,
        kind + ("" if s.source == "auto" else f" ({s.source})"),
        str(s.num_uses),
        s.approx,
        _relative_paths(s.param_paths),
        shapes,
        format_bytes(nbytes),
        s.note,
      )
    )
  ratio = (
    f"{total / param_bytes:.2f}x the parameters' {format_bytes(param_bytes)}" if param_bytes else ""
  )
  rows.append(
    (
      "total",
      "",
      "",
      "",
      f"{sum(s.num_params for s in layers)} values",
      "",
      format_bytes(total),
      ratio,
    )
  )
  if not any(s.note for s in layers):  # The last column holds the ratio only: no header.
    rows[0] = rows[0][:-1] + ("",)
  widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
  lines = []
  for k, r in enumerate(rows):
    lines.append("  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip())
    if k == 0 or k == len(rows) - 2:
      lines.append("  ".join("-" * w for w in widths))
  return "\n".join(lines)


def format_bytes(n: float) -> str:
  """`n` bytes for people: "512 B", "1.5 KiB", ..., "2.0 GiB"."""
  for unit in ("B", "KiB", "MiB", "GiB"):
    if n < 1024 or unit == "GiB":
      return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
    n /= 1024
  return f"{n} B"
