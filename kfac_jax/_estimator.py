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

import functools
from collections.abc import Callable, Sequence
from typing import Any, Literal, NamedTuple, ParamSpec, TypeVar, cast

import jax
import jax.numpy as jnp
import numpy as np

from kfac_jax import (
  _checks,
  _compat,
  _curvature,
  _layer_config,
  _parallel,
  _registration,
  _scanner,
  _sharded,
)
from kfac_jax import blocks as _blocks

Array = jax.Array
InverseStorage = Literal["replicated", "sharded"]

# Replicated storage's caches: per block name, per entry ("inv_a", "damping", ...).
BlockCaches = dict[str, Any]


# The `EstimatorState` fields that hold one entry per block (named in checkpoint errors).
PER_BLOCK_FIELDS = ("factors", "cache")


class EstimatorState(NamedTuple):
  """All numbers of the estimator; static structure lives on the estimator object.

  Attributes:
    factors: per block name, the EMA statistics as the block kind's factors type (e.g.
      `blocks.KroneckerFactors(a: [in+1, in+1], g: [out, out])`; every type is documented, with
      shapes, in `kfac_jax.blocks._state`).
    cache: per block name, the block kind's cache type: powers / decompositions and the
      damping `[]` they were built with; with `inverse_storage="sharded"`, a `ShardedCache`
      holding only this device's blocks.
    ema_weight: `[]` float, Σ decay^k over updates so far (0 before the first update).
    skipped_batches: `[]` int32, statistics updates skipped because the batch's statistics
      were not finite (the factors were left as they were).
    failed_inverses: `[]` int32, block factorisations that were not finite (the block kept its
      previous cache).
  """

  factors: dict[str, Any]
  cache: dict[str, Any] | _parallel.ShardedCache
  ema_weight: Array
  skipped_batches: Array
  failed_inverses: Array

  # The fields that map block names to a block's typed state (checkpoints name blocks by them).


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


def all_finite(tree) -> Array:
  """True when every entry of every leaf is finite.

  Tested through each leaf's sum, which is finite exactly when no entry is NaN or ±Inf (barring
  a sum that overflows: ~1e38 in float32, then the leaf counts as non-finite, which errs on the
  safe side). A sum compiles to one reduction that XLA fuses with the producer; an elementwise
  `isfinite` followed by `all` over every factor and inverse cost ~0.5 s more XLA compile time
  on the autoencoder (benchmarks/profile/compile_breakdown.py).
  """
  leaves = jax.tree_util.tree_leaves(tree)
  if not leaves:
    return jnp.asarray(True)
  return jnp.all(
    jnp.stack(
      [jnp.isfinite(jnp.sum(x, dtype=jnp.promote_types(x.dtype, jnp.float32))) for x in leaves]
    )
  )


_STATS_DTYPES = ("bfloat16", "float16", "float32", "float64")
_INVERSE_DTYPES = ("float32", "float64")
_PRECONDITIONER_DTYPES = ("bfloat16", "float32", "float64")


def resolve_dtype(value, name: str) -> Any:
  """`stats_dtype` / `inverse_dtype` / `preconditioner_dtype` as a numpy dtype: None → float32
  (float64 under x64)."""
  allowed: tuple[str, ...]
  if name.endswith("stats_dtype"):
    allowed = _STATS_DTYPES
  elif name.endswith("preconditioner_dtype"):
    allowed = _PRECONDITIONER_DTYPES
  else:
    allowed = _INVERSE_DTYPES
  if value is None:
    # jax.config's flags are properties added at run time.
    return np.dtype(np.float64 if jax.config.jax_enable_x64 else np.float32)  # type: ignore[attr-defined]
  try:
    dtype = jnp.dtype(value)
  except TypeError:
    dtype = None
  if dtype is None or dtype.name not in allowed:
    raise ValueError(
      f"`{name}` must be one of {', '.join(allowed)} (or None for the default), got {value!r}."
    )
  if dtype == np.float64 and not jax.config.jax_enable_x64:  # type: ignore[attr-defined]
    raise ValueError(
      f"`{name}`=float64 needs 64-bit JAX: set "
      "`jax.config.update('jax_enable_x64', True)` before creating arrays, or "
      "use float32."
    )
  return dtype


def resolve_preconditioner_dtype(value, inverse_dtype, name: str = "preconditioner_dtype"):
  """`preconditioner_dtype` as a numpy dtype, or None where it is `inverse_dtype` (None, or the
  same dtype); a dtype wider than `inverse_dtype` is refused."""
  if value is None:
    return None
  dtype = resolve_dtype(value, name)
  if dtype.itemsize > np.dtype(inverse_dtype).itemsize:
    raise ValueError(
      f"`{name}`={dtype.name} is wider than `inverse_dtype`={np.dtype(inverse_dtype).name}: the "
      "inverses are computed in `inverse_dtype` and can only be stored narrower (e.g. "
      "bfloat16)."
    )
  return None if dtype == inverse_dtype else dtype


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
      it, `init` builds one from the arguments.
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
      bfloat16 natively (a CPU with AVX512-BF16: the autoencoder benchmark's in 0.58x the
      time; benchmarks/RESULTS.md, "bfloat16 inverses").
      Diagonal factors, the substitution forms of `factor_solve`, eigen-decompositions
      ("eigen" damping, EKFAC), the series approximations of shared layers and Cholesky
      factors stay in `inverse_dtype`.
    inverse_storage: where the caches live on a data-parallel axis. "replicated" (default):
      every device holds every block's cache. "sharded" (KAISA's memory-optimised strategy,
      see `kfac_jax._sharded`): each device stores and refreshes only its share of the blocks
      (balanced by cache bytes: at most total/D + one block per device) and preconditions
      their leaves; the products are summed over the axis. `init`, `update_inverses` and the
      `multiply*` methods then need `axis_name=` (inside pmap / shard_map; call `init` there
      too) or `mesh=(mesh, axis)` (under jit). Factors stay replicated either way.
    factor_solve: how a Kronecker factor's damped inverse is kept (`BlockConfig.factor_solve`):
      "auto" (default) keeps a factor of size n ≥ 256 whose products have at most n/8
      columns (a wide input into a narrow layer: a classifier head) in substitution form, its
      Cholesky factor in blocks applied by block substitution (a refresh ~3x faster, products
      a few times slower), and the explicit inverse elsewhere; "never" always the inverse;
      "always" the substitution form for every Kronecker factor that can have it (not diagonal
      factors, stacks, grouped convolutions or "eigen" damping). The products are the same up
      to rounding; the cache's fields differ (`cache/<block>/a/subst/...` instead of
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
    layers: _layer_config.LayerConfig | None = None,
    stats_dtype: Any = None,
    inverse_dtype: Any = None,
    inverse_storage: InverseStorage = "replicated",
    factor_solve: _blocks.FactorSolve = "auto",
    preconditioner_dtype: Any = None,
  ):
    reg = _registration.resolve(
      registration,
      loss_fn,
      example_batch,
      "CurvatureEstimator",
      _registration.estimator_settings(has_aux, estimation_mode, num_samples, strict, layers),
    )
    if reg is not None:
      loss_fn, example_batch, has_aux = reg.loss_fn, reg.example_batch, reg.has_aux
      estimation_mode, num_samples, strict = reg.estimation_mode, reg.num_samples, reg.strict
      layers = reg.layer_config
    # Checks `loss_fn` and `has_aux`; the scanner traces this wrapper (loss first, aux after).
    self.loss_part = _curvature.LossPart(loss_fn, has_aux) if reg is None else reg.loss_part
    self.has_aux = has_aux
    _curvature.check_mode(estimation_mode, num_samples)
    _checks.choice(damping_mode, "damping_mode", ("factored", "eigen"))
    _checks.choice(inverse_storage, "inverse_storage", ("replicated", "sharded"))
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
    exps = tuple(float(e) for e in exps)
    self.loss_fn = loss_fn
    self.example_batch = example_batch
    self.estimation_mode = estimation_mode
    self.num_samples = num_samples
    self.strict = strict
    self.compute_params_stats = compute_params_stats
    self.layer_config = _layer_config.check(layers)
    self.inverse_storage = inverse_storage
    inverse_dtype = resolve_dtype(inverse_dtype, "inverse_dtype")
    self.config = _blocks.BlockConfig(
      exps=exps,
      damping_mode=damping_mode,
      cholesky=compute_cholesky,
      cholesky_inverse=compute_cholesky_inverse,
      stats_dtype=resolve_dtype(stats_dtype, "stats_dtype"),
      inverse_dtype=inverse_dtype,
      factor_solve=factor_solve,
      preconditioner_dtype=resolve_preconditioner_dtype(preconditioner_dtype, inverse_dtype),
    )
    self._registration: _registration.Registration | None = None
    self.who = "this estimator"  # How errors name the consumer of the statistics.
    self._layers: tuple[_scanner.LayerSpec, ...] | None = None
    self._blocks: tuple[_blocks.Block, ...] = ()
    self._names: tuple[str, ...] = ()
    self._active: tuple[int, ...] = ()  # Indices of the registration's layers kept.
    self._storage: _sharded.ShardedStorage | None = None
    # (parameter paths, ((shape, dtype name) per leaf)), set with the layers.
    self._param_sig: tuple[tuple[str, ...], tuple[tuple[tuple[int, ...], str], ...]] | None = None
    if reg is not None:
      self._use_registration(reg)

  # -- structure -------------------------------------------------------------------------------

  @property
  def registered(self) -> bool:
    """Whether the layers are known (a registration given, or built by `init`)."""
    return self._registration is not None

  @property
  def registration(self) -> _registration.Registration:
    """The `kfac_jax.Registration` (given, or built by the first `init`)."""
    if self._registration is None:
      raise RuntimeError("call `init(params)` first: the layers are found when params are known.")
    return self._registration

  def _use_registration(self, reg: _registration.Registration) -> None:
    """Takes the layers, blocks and params signature of `reg` (every block active)."""
    self._registration = reg
    self.loss_part = reg.loss_part  # The one the registration traces (its aux tree).
    self._layers = reg.layers
    self._param_sig = reg.param_signature
    self._select(tuple(range(len(reg.layers))))

  def _select(self, active: tuple[int, ...]) -> None:
    """Keeps the blocks `active` (indices into the registration's layers): the state, the
    statistics folded, the inverses and the products cover only these."""
    reg = self.registration
    all_names, all_blocks = reg.block_names, reg.blocks(self.config)
    names = tuple(all_names[i] for i in active)
    blocks = tuple(all_blocks[i] for i in active)
    if self.inverse_storage == "sharded":
      for n, b in zip(names, blocks):
        if b.needs_cache_for_statistics:
          raise ValueError(
            f"layer `{n}`: approx={b.spec.approx!r} needs its cache for the statistics, "
            "which inverse_storage='sharded' keeps on one device; use "
            "inverse_storage='replicated' or another approximation for it."
          )
      self._storage = _sharded.ShardedStorage(
        blocks, functools.partial(_blocks.compute_caches, blocks)
      )
    self._active = active
    self._names = names
    self._blocks = blocks

  def keep_leaves(self, kept: Sequence[bool], who: str) -> None:
    """Keeps only the blocks of the parameter leaves `kept` (one flag per registered leaf, in
    the registration's order): for a transform handed a share of the parameters by
    `optax.multi_transform` / `optax.masked`. A block with leaves on both sides raises
    ValueError naming its layer and both sets of leaves (`who` names the transform). Call it
    before `init`; calling it again with the same flags changes nothing."""
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
    if tuple(active) != self._active:
      self._select(tuple(active))

  def scan_batch(self, params, batch, warn: bool = False, axis_name=None) -> _scanner.ScanResult:
    """The evaluation graph of `loss_fn(params, batch)`, scanned once per batch signature by
    the registration (`warn` and `axis_name` are kept for callers; the registration decides)."""
    del warn, axis_name
    return self.registration.scan_batch(params, batch)

  def ensure_layers(self, params, axis_name=None) -> None:
    """Registers `loss_fn` with `example_batch` the first time; checks `params` later."""
    if self._registration is None:
      assert self.loss_fn is not None  # checked in __init__ (a registration or a loss_fn)
      self._use_registration(
        _registration.Registration(
          self.loss_fn,
          params,
          self.example_batch,
          has_aux=self.has_aux,
          estimation_mode=self.estimation_mode,
          num_samples=self.num_samples,
          layers=self.layer_config,
          strict=self.strict,
          axis_name=axis_name,
        )
      )
      return
    self._registration.check_params(params)

  @property
  def layers(self) -> tuple[_scanner.LayerSpec, ...]:
    """The registered layers (after `init`)."""
    if self._layers is None:
      raise RuntimeError("call `init(params)` first: the layers are found when params are known.")
    return self._layers

  @property
  def blocks(self) -> tuple[_blocks.Block, ...]:
    """One curvature block per layer (after `init`)."""
    if self._layers is None:
      raise RuntimeError("call `init(params)` first: the layers are found when params are known.")
    return self._blocks

  @property
  def _sig(self) -> tuple[tuple[str, ...], tuple[tuple[tuple[int, ...], str], ...]]:
    """`_param_sig` (after `init`)."""
    if self._param_sig is None:
      raise RuntimeError("call `init(params)` first: the layers are found when params are known.")
    return self._param_sig

  @property
  def sharded_storage(self) -> _sharded.ShardedStorage:
    """With `inverse_storage="sharded"` (after `init`): the blocks' cache layout per device
    count (`.layout(D)`, `.device_bytes(D)`)."""
    if self._storage is None:
      raise RuntimeError(
        "`sharded_storage` exists after `init` of an estimator with inverse_storage='sharded'."
      )
    return self._storage

  def _by_block(self, by_name: dict[str, Any]) -> list[Any]:
    """A per-name state dict as a list in block order."""
    return [by_name[n] for n in self._names]

  # -- state -----------------------------------------------------------------------------------

  def init(
    self, params, *, axis_name: str | None = None, mesh: tuple[Any, str] | None = None
  ) -> EstimatorState:
    """Zero statistics and identity caches for `params` (scans `loss_fn` on first use).

    With `inverse_storage="sharded"`, pass `axis_name` and call `init` inside pmap / shard_map
    (each device's cache differs), or pass `mesh=(mesh, axis)` to get the cache as a global
    array sharded over that mesh axis. Replicated storage uses `axis_name` only to trace a
    model whose collectives name it (e.g. `BatchNorm(axis_name=...)`) when `init` runs
    outside pmap / shard_map.
    """
    self.ensure_layers(params, axis_name)
    return self.init_state(axis_name=axis_name, mesh=mesh)

  def init_state(
    self, *, axis_name: str | None = None, mesh: tuple[Any, str] | None = None
  ) -> EstimatorState:
    """`init`'s state for the layers already registered (no params needed)."""
    if self._registration is None:
      raise RuntimeError("call `init(params)` first: the layers are found when params are known.")
    cache: BlockCaches | _parallel.ShardedCache
    if self.inverse_storage == "sharded":
      cache = self.sharded_storage.init_cache(axis_name, mesh)
    else:
      cache = {n: b.init_cache() for n, b in zip(self._names, self._blocks)}
    return EstimatorState(
      factors={n: b.init_factors() for n, b in zip(self._names, self._blocks)},
      cache=cache,
      ema_weight=jnp.zeros((), self.config.accum_dtype),
      skipped_batches=jnp.zeros((), jnp.int32),
      failed_inverses=jnp.zeros((), jnp.int32),
    )

  @_scoped("kfac_statistics")
  def curvature_stats(self, params, batch, rng) -> _curvature.CurvatureStats:
    """This batch's raw curvature data (one forward pass, one sampled backward pass)."""
    self.ensure_layers(params)
    # Only pulled back: convolutions transpose with canonically ordered kernels (fast inside
    # the transforms' `lax.cond` on CPU; `_compat.pull_back_convs_canonically`).
    with _compat.pull_back_convs_canonically():
      _, _, stats = _curvature.compute(
        self.scan_batch(params, batch),
        params,
        batch,
        rng,
        estimation_mode=self.estimation_mode,
        num_samples=self.num_samples,
        with_grads=False,
        with_params_stats=self.compute_params_stats,
        fingerprint=self.registration.fingerprint,
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
    if self._registration is None:
      raise RuntimeError("call `init(params)` first: the layers are found when params are known.")
    if stats.layer_shapes and stats.layer_names == tuple(s.name for s in self.layers):
      # value_and_grad scanned this batch: a layer that changed with the batch size is named.
      self._registration.check_layer_shapes(
        stats.layer_names, stats.layer_shapes, stats.batch_size, kinds_only=True
      )
    self._registration.check_stats(stats, self.who)

    def one(n, b, d, cache):
      if isinstance(d, _blocks.StackedUses) and not b.accepts_stacked_uses():
        d = d.unstack()
      if b.needs_cache_for_statistics and cache is not None:
        if self.inverse_storage == "sharded":
          raise ValueError(
            f"layer `{n}`: approx={b.spec.approx!r} needs its cache for the "
            "statistics; use inverse_storage='replicated'."
          )
        return b.batch_factors(d, stats.batch_size, cache=cache[n])
      return b.batch_factors(d, stats.batch_size)

    data = [stats.data[i] for i in self._active]
    out = _parallel.explicit_axes_as_auto(
      lambda data, cache: {
        n: one(n, b, d, cache) for n, b, d in zip(self._names, self._blocks, data)
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

    def average(old, b):  # In at least float32, stored in stats_dtype.
      old_acc = old.astype(acc)
      return (old_acc + (b.astype(acc) - old_acc) / weight).astype(old.dtype)

    # Tested in `stats_dtype`, so a statistic that overflows it (float16) skips the batch too.
    stored = self.config.stats_dtype
    ok = all_finite(jax.tree_util.tree_map(lambda x: x.astype(stored), new))
    # A select on the scalar flag (`lax.cond`) rather than an elementwise `where` over every
    # factor: same result, half the XLA compile time of this function. The average is computed
    # inside the taken branch, so it writes straight into the new state's buffers (computed
    # before the `cond`, XLA copied all factors, 26 MB a step on the autoencoder).
    factors, weight = jax.lax.cond(
      ok,
      lambda: (jax.tree_util.tree_map(average, state.factors, new), weight),
      lambda: (state.factors, state.ema_weight),
    )
    return state._replace(
      factors=factors,
      ema_weight=weight,
      skipped_batches=state.skipped_batches + (~ok).astype(jnp.int32),
    )

  def update_curvature(
    self, state: EstimatorState, params, batch, rng, ema_decay, axis_name: str | None = None
  ) -> EstimatorState:
    """`update_curvature_from_stats` with statistics computed from `batch`."""
    stats = self.curvature_stats(params, batch, rng)
    return self.update_curvature_from_stats(state, stats, ema_decay, axis_name)

  @_scoped("kfac_inverses")
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

    With `inverse_storage="sharded"` one of the two is required, and each device refreshes and
    keeps only its own blocks' caches (no caches are communicated; the failure count is summed
    over the axis).
    """
    check_damping(damping)
    if axis_name is not None and mesh is not None:
      raise ValueError("pass `axis_name` (inside pmap/shard_map) or `mesh` (under jit), not both.")
    damping = jnp.asarray(damping, self.config.inverse_dtype)
    if self.inverse_storage == "sharded":
      cache, failed = self.sharded_storage.update_inverses(
        state.cache, self._by_block(state.factors), damping, axis_name, mesh, all_finite
      )
      return state._replace(cache=cache, failed_inverses=state.failed_inverses + failed)
    if axis_name is None and mesh is None:
      new = self._compute_caches(range(len(self.blocks)), state.factors, damping)
    else:
      costs = [_parallel.factorisation_cost(b.factor_shapes) for b in self._blocks]
      zeros = jax.tree_util.tree_map(jnp.zeros_like, state.cache)

      def split(factors, lam, axis):
        return _parallel.split_over_axis(
          lambda idx: self._compute_caches(idx, factors, lam), zeros, costs, axis
        )

      if axis_name is not None:
        new = split(state.factors, damping, axis_name)
      else:
        assert mesh is not None  # Both None is handled above.
        new = _parallel.over_mesh_axis(split, mesh, state.factors, damping)
    cache, failed = {}, state.failed_inverses
    for n in self._names:
      # A select on the scalar flag: an elementwise `where` fused with the factorisations
      # costs several times more XLA compile time.
      ok = all_finite(new[n])
      cache[n] = jax.lax.cond(ok, lambda n=n: new[n], lambda n=n: state.cache[n])
      failed = failed + (~ok).astype(jnp.int32)
    return state._replace(cache=cache, failed_inverses=failed)

  def _compute_caches(self, indices, factors: dict[str, Any], damping) -> dict[str, Any]:
    """`{name: fresh cache}` of the blocks `indices` (see `blocks.compute_caches`)."""
    new = _blocks.compute_caches(self._blocks, indices, self._by_block(factors), damping)
    return {self._names[i]: c for i, c in new.items()}

  # -- products --------------------------------------------------------------------------------

  def _in_inverse_dtype(self, factors):
    """Factors cast to `inverse_dtype` (no-op when the two dtypes agree)."""
    dtype = self.config.inverse_dtype
    return jax.tree_util.tree_map(lambda x: x if x.dtype == dtype else x.astype(dtype), factors)

  def _apply(
    self,
    state: EstimatorState,
    vector,
    fn,
    axis_name=None,
    mesh=None,
    method: str = "multiply_matpower",
  ) -> Any:
    with jax.named_scope(f"kfac_{method}"):
      return _parallel.explicit_axes_as_auto(
        lambda s, v: self._apply_unscoped(s, v, fn, axis_name, mesh, method),
        state,
        vector,
        like=vector,
      )

  def _apply_unscoped(self, state, vector, fn, axis_name, mesh, method) -> Any:
    leaves, treedef = jax.tree_util.tree_flatten(vector)
    paths = _scanner.param_paths(vector)
    if paths != self._sig[0]:
      raise ValueError(
        "the vector's pytree structure differs from the params this estimator was built for: "
        f"got leaves {list(paths)}, expected {list(self._sig[0])}."
      )
    for (shape, _), x, path in zip(self._sig[1], leaves, paths):
      if tuple(np.shape(x)) != shape:
        raise ValueError(f"vector leaf `{path}` has shape {np.shape(x)}, expected {shape}.")
    if self.inverse_storage == "sharded":
      out = self.sharded_storage.apply(
        self._by_block(self._in_inverse_dtype(state.factors)),
        state.cache,
        leaves,
        fn,
        axis_name,
        mesh,
        method,
      )
      return jax.tree_util.tree_unflatten(treedef, out)
    out = list(leaves)
    cache = cast(BlockCaches, state.cache)  # replicated storage
    for n, b in zip(self._names, self._blocks):
      vecs = [leaves[j] for j in b.spec.leaf_indices]
      res = fn(b, self._in_inverse_dtype(state.factors[n]), cache[n], vecs)
      for j, r in zip(b.spec.leaf_indices, res):
        out[j] = r
    return jax.tree_util.tree_unflatten(treedef, out)

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

    With `inverse_storage="sharded"`, `axis_name` (inside pmap / shard_map) or `mesh` (under
    jit) is required: each device multiplies its own blocks, and the results are summed over
    the axis (one vector-sized `psum`). The other methods below take them the same way.
    """
    exp = float(exp)
    if exp != 1 and exp not in self.config.exps:
      raise ValueError(
        f"matrix power {exp:g} was not prepared: this estimator has exps="
        f"{self.config.exps} (1 is always available)."
      )
    return self._apply(
      state,
      vector,
      lambda b, f, c, v: b.multiply_matpower(f, c, v, exp),
      axis_name,
      mesh,
      "multiply_matpower",
    )

  def multiply(
    self,
    state: EstimatorState,
    vector,
    *,
    axis_name: str | None = None,
    mesh: tuple[Any, str] | None = None,
  ):
    """The damped curvature times `vector` (power 1)."""
    return self.multiply_matpower(state, vector, 1, axis_name=axis_name, mesh=mesh)

  def multiply_inverse(
    self,
    state: EstimatorState,
    vector,
    *,
    axis_name: str | None = None,
    mesh: tuple[Any, str] | None = None,
  ):
    """The inverse damped curvature times `vector` (needs -1 in `exps`, the default)."""
    return self.multiply_matpower(state, vector, -1, axis_name=axis_name, mesh=mesh)

  def multiply_cholesky(
    self,
    state: EstimatorState,
    vector,
    *,
    transpose: bool = False,
    axis_name: str | None = None,
    mesh: tuple[Any, str] | None = None,
  ):
    """C·v (or Cᵀ·v) for the block-diagonal factor C with C Cᵀ = damped curvature."""
    return self._apply(
      state,
      vector,
      lambda b, f, c, v: b.multiply_cholesky(f, c, v, transpose=transpose, inverse=False),
      axis_name,
      mesh,
      "multiply_cholesky",
    )

  def multiply_cholesky_inverse(
    self,
    state: EstimatorState,
    vector,
    *,
    transpose: bool = False,
    axis_name: str | None = None,
    mesh: tuple[Any, str] | None = None,
  ):
    """C⁻¹·v (or C⁻ᵀ·v)."""
    return self._apply(
      state,
      vector,
      lambda b, f, c, v: b.multiply_cholesky(f, c, v, transpose=transpose, inverse=True),
      axis_name,
      mesh,
      "multiply_cholesky_inverse",
    )

  def to_dense(self, state: EstimatorState) -> Array:
    """The undamped block-diagonal estimate as one matrix, ordered like `ravel_pytree(params)`."""
    sizes = [int(np.prod(s)) for s, _ in self._sig[1]]
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    total = int(offsets[-1])
    out = jnp.zeros((total, total), self.config.inverse_dtype)
    for n, b in zip(self._names, self._blocks):
      idx = np.concatenate([np.arange(offsets[j], offsets[j + 1]) for j in b.spec.leaf_indices])
      cache = cast(dict, state.cache)[n] if b.needs_cache_for_statistics else None
      out = out.at[np.ix_(idx, idx)].set(b.to_dense(state.factors[n], cache))
    return out

  def summary(self) -> str:
    """The registered layers as a table (see `kfac_jax.summary`)."""
    param_bytes = sum(
      int(np.prod(shape)) * np.dtype(dtype).itemsize for shape, dtype in self._sig[1]
    )
    return format_table([self.layers[i] for i in self._active], self._blocks, param_bytes)


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
  layers: Sequence[_scanner.LayerSpec],
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
