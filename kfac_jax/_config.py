"""`Config`: the rare knobs of every front (`scale_by_kfac`, `kfac`, `Optimizer`,
`CurvatureEstimator`), in one frozen object validated once.

The fronts keep as parameters only what a user tunes and the data-parallel `axis_name`; every
other knob has one name, one default and one check here. Defaults that differ between fronts:
`damping` is 0.1 for the transforms (a fixed λ) and 1e-3 for `Optimizer` (only the start of its
adaptation); `curvature_every` is 5 for `kfac`, whose clipping bounds a step preconditioned by
statistics a few updates old, and 1 for `scale_by_kfac` and `Optimizer`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np

from kfac_jax import _checks, _curvature, _parallel, _storage
from kfac_jax import blocks as _blocks
from kfac_jax import scan as _scan

_DTYPES = {
  "stats_dtype": ("bfloat16", "float16", "float32", "float64"),
  "inverse_dtype": ("float32", "float64"),
  "preconditioner_dtype": ("bfloat16", "float32", "float64"),
}


def _dtype(value, field: str) -> Any:
  """The dtype field `config.<field>` as a numpy dtype: None → float32 (float64 under x64)."""
  x64 = jax.config.jax_enable_x64  # type: ignore[attr-defined]  # A flag added at run time.
  if value is None:
    return np.dtype(np.float64 if x64 else np.float32)
  try:
    dtype = jnp.dtype(value)
  except TypeError:
    dtype = None
  if dtype is None or dtype.name not in _DTYPES[field]:
    raise ValueError(
      f"`config.{field}` must be one of {', '.join(_DTYPES[field])} (or None for the default), "
      f"got {value!r}."
    )
  if dtype == np.float64 and not x64:
    raise ValueError(
      f"`config.{field}`=float64 needs 64-bit JAX: set "
      "`jax.config.update('jax_enable_x64', True)` before creating arrays, or use float32."
    )
  return dtype


def _preconditioner_dtype(value, inverse_dtype):
  """`config.preconditioner_dtype` as a numpy dtype, or None where it is `inverse_dtype`; a
  dtype wider than `inverse_dtype` is refused."""
  if value is None:
    return None
  dtype = _dtype(value, "preconditioner_dtype")
  if dtype.itemsize > inverse_dtype.itemsize:
    raise ValueError(
      f"`config.preconditioner_dtype`={dtype.name} is wider than `inverse_dtype`="
      f"{inverse_dtype.name}: the inverses are computed in `inverse_dtype` and can only be "
      "stored narrower (e.g. bfloat16)."
    )
  return None if dtype == inverse_dtype else dtype


def _check_mesh(mesh) -> None:
  if mesh is None:
    return
  if (
    not isinstance(mesh, tuple)
    or len(mesh) != 2
    or not isinstance(mesh[0], jax.sharding.Mesh)
    or mesh[1] not in mesh[0].axis_names
  ):
    raise ValueError(
      "`config.mesh` must be a (jax.sharding.Mesh, axis_name) pair naming one of the mesh's axes, "
      f"got {mesh!r}."
    )
  _parallel.check_auto_axis(*mesh)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
  """The rare knobs of `scale_by_kfac`, `kfac`, `Optimizer` and `CurvatureEstimator` (validated
  on construction).

  The fields come in groups: the registration (`has_aux` to `check_loss`; with a
  `registration=` they must agree with it or stay at their defaults), the numerics, the
  schedule, parallel work, the guard, and fields one front reads (`nesterov` for `kfac`; the
  damping adaptation's and `weight_decay` for `Optimizer`): a front that does not read a field
  refuses a value other than its default.

  Attributes:
    has_aux: `loss_fn` returns `(loss, aux)`; only the loss part is scanned (compute the
      statistics with `value_and_grad(loss_fn, has_aux=True)`). `Optimizer.step` returns the
      aux in `info["aux"]`.
    estimation_mode: "gradients" (sampled targets: the Fisher, default), "empirical",
      "curvature_prop", "curvature_prop_GGN", "exact" or "exact_GGN" (see `CurvatureEstimator`).
    num_samples: random vectors per example in the random modes (1 for the others); a Python
      int.
    strict: raise, instead of warning, for parameters outside every recognised layer.
    layers: a `kfac_jax.LayerConfig`: approximations per layer kind and per parameter-path
      pattern, and linked parameter groups (None: the defaults).
    check_loss: audit the loss tags against the returned loss when the layers are found (see
      `kfac_jax.Registration`); False for a loss that differs from its tags on purpose.
    damping_mode: "factored" (π-adjusted Tikhonov, default) or "eigen" (exact, slower).
    factor_solve: "auto", "always" or "never": keep a Kronecker factor's damped inverse as its
      Cholesky factor in blocks for block substitution instead of an explicit matrix ("auto":
      for a factor of size n ≥ 256 whose products have at most n/8 columns).
    stats_dtype: dtype of the stored statistics: None (float32, float64 under x64), "float32",
      "float64", "bfloat16" or "float16"; they are accumulated in at least float32.
    inverse_dtype: dtype of the inverses, the products with them and the Optimizer's
      quadratic model: None (float32, float64 under x64), "float32" or "float64".
    preconditioner_dtype: None (`inverse_dtype`) or "bfloat16": store the Kronecker factors'
      inverses in it, the products accumulating in `inverse_dtype` (half the memory).
    statistics_fraction: when a transform computes the statistics from `batch=`, the fraction f
      in (0, 1] of the batch's N rows they come from: r = ⌈f·N⌉ rows, evenly spaced
      (`x[:r*s:s]` along every leaf's leading axis, s = ⌊N/r⌋), normalised by their own count
      (unbiased, only noisier). "auto" (default): every fourth row of a batch of 256 or more
      rows, every second of 128 or more, else (or when the cut batch cannot be used) every
      row; None or 1: every row; an explicit f raises where "auto" falls back. A Python
      number. `curvature_stats=` are used as they come; the `Optimizer` refuses f < 1 (its
      statistics come from its one forward pass over the whole batch).
    burn_in_steps: the first this many steps only fold statistics (zero updates, no inverse
      refresh); schedules still count them.
    inverse_storage: "replicated" (default; every device keeps every inverse, the work is
      split over the devices of `axis_name` or `mesh` and the results summed) or "sharded"
      (KAISA's memory-optimised strategy: each device keeps, refreshes and applies only its
      share of the factors and inverses, balanced by refresh cost; needs `axis_name` or
      `mesh`); or a `kfac_jax.ReplicatedStorage()` / `kfac_jax.ShardedStorage()` object.
    mesh: under plain `jit` with data sharded over a mesh (no `axis_name`): `(mesh, axis)`
      splits the inverse work over that mesh axis (and, sharded, stores the state there).
    skip_nonfinite: when the gradient, the statistics or the update is not finite, return zero
      updates and leave the state as it was but for the `skipped` counter. False: the update
      goes through as computed (non-finite statistics are still kept out of the factors).
    nesterov: `kfac`'s momentum is Nesterov's (`optax.trace(nesterov=True)`).
    min_damping, max_damping: `Optimizer`: the clip of the adapted damping λ.
    damping_adaptation_interval: `Optimizer`: T, adapt λ every T steps.
    damping_adaptation_decay: `Optimizer`: ω₁ in (0, 1); λ is multiplied or divided by ω₁^T.
    weight_decay: `Optimizer`: decoupled weight decay d, `θ ← θ + δ − d θ` (for the transforms,
      chain `optax.add_decayed_weights`).

  Raises:
    TypeError / ValueError: a bad field, named (`config.<field>`) with the value received.

  Example:
    >>> tx = kfac_jax.kfac(loss_fn, batch, learning_rate=0.3,
    ...                    config=kfac_jax.Config(estimation_mode="exact"))
  """

  has_aux: bool = False
  estimation_mode: _curvature.EstimationMode = "gradients"
  num_samples: int = 1
  strict: bool = False
  layers: _scan.LayerConfig | None = None
  check_loss: bool = True
  damping_mode: _blocks.DampingMode = "factored"
  factor_solve: _blocks.FactorSolve = "auto"
  stats_dtype: Any = None
  inverse_dtype: Any = None
  preconditioner_dtype: Any = None
  statistics_fraction: float | Literal["auto"] | None = "auto"
  burn_in_steps: int = 0
  inverse_storage: Any = "replicated"
  mesh: tuple[jax.sharding.Mesh, str] | None = None
  skip_nonfinite: bool = True
  nesterov: bool = False
  min_damping: float = 1e-8
  max_damping: float = 1e8
  damping_adaptation_interval: int = 5
  damping_adaptation_decay: float = 0.95
  weight_decay: float = 0.0

  def __post_init__(self):
    _checks.boolean(self.has_aux, "config.has_aux")
    _checks.choice(self.estimation_mode, "config.estimation_mode", _curvature.ESTIMATION_MODES)
    _checks.static_int(self.num_samples, "config.num_samples")
    _curvature.check_mode(self.estimation_mode, self.num_samples)
    _checks.boolean(self.strict, "config.strict")
    _scan.check_layer_config(self.layers)
    _checks.boolean(self.check_loss, "config.check_loss")
    _checks.choice(self.damping_mode, "config.damping_mode", ("factored", "eigen"))
    _checks.choice(self.factor_solve, "config.factor_solve", ("auto", "always", "never"))
    self.block_config()  # The dtype fields.
    f = self.statistics_fraction
    if f is not None and f != "auto":
      _checks.static_fraction(f, "config.statistics_fraction")
    _checks.static_int(self.burn_in_steps, "config.burn_in_steps", low=0)
    _storage.strategy(self.inverse_storage, "config.inverse_storage")
    _check_mesh(self.mesh)
    _checks.boolean(self.skip_nonfinite, "config.skip_nonfinite")
    _checks.boolean(self.nesterov, "config.nesterov")
    _concrete(self.min_damping, "config.min_damping")
    _concrete(self.max_damping, "config.max_damping", low=self.min_damping)
    _checks.static_int(self.damping_adaptation_interval, "config.damping_adaptation_interval")
    _concrete(
      self.damping_adaptation_decay,
      "config.damping_adaptation_decay",
      low_open=True,
      high=1.0,
      high_open=True,
    )
    _concrete(self.weight_decay, "config.weight_decay", high=1.0, high_open=True)

  # -- derived, read by the fronts ---------------------------------------------------------

  @property
  def fraction(self) -> float | str:
    """`statistics_fraction` with None as 1."""
    return 1 if self.statistics_fraction is None else self.statistics_fraction

  @property
  def storage(self) -> _storage.Storage:
    """The inverse storage strategy object."""
    return _storage.strategy(self.inverse_storage, "config.inverse_storage")

  def block_config(self, exps=(-1.0,), cholesky=False, cholesky_inverse=False):
    """The blocks' numerics (`blocks.BlockConfig`)."""
    inverse_dtype = _dtype(self.inverse_dtype, "inverse_dtype")
    return _blocks.BlockConfig(
      exps=tuple(exps),
      damping_mode=self.damping_mode,
      cholesky=cholesky,
      cholesky_inverse=cholesky_inverse,
      stats_dtype=_dtype(self.stats_dtype, "stats_dtype"),
      inverse_dtype=inverse_dtype,
      factor_solve=self.factor_solve,
      preconditioner_dtype=_preconditioner_dtype(self.preconditioner_dtype, inverse_dtype),
    )

  def registration_settings(self) -> dict[str, Any]:
    """The `Registration` keyword arguments this config holds."""
    fields = ("has_aux", "estimation_mode", "num_samples", "strict", "layers", "check_loss")
    return {f: getattr(self, f) for f in fields}

  def refuse(self, who: str, fields: tuple[str, ...], why: str) -> None:
    """ValueError when one of `fields`, which `who` does not read, differs from its default."""
    for f in fields:
      default = Config.__dataclass_fields__[f].default
      if getattr(self, f) != default:
        raise ValueError(
          f"{who}: `config.{f}`={getattr(self, f)!r} is not read here ({why}); leave it at "
          f"its default {default!r}."
        )


def check_parallel(axis_name, config: Config) -> None:
  _checks.optional_str(axis_name, "axis_name")
  if config.mesh is not None and axis_name is not None:
    raise ValueError(
      "pass `axis_name` (inside pmap/shard_map) or `config.mesh` (under jit with sharded "
      "data), not both: with `axis_name` the inverse work is already split over that axis."
    )
  sharded = isinstance(config.storage, _storage.ShardedStorage)
  if sharded and axis_name is None and config.mesh is None:
    raise ValueError(
      "inverse_storage='sharded' splits the inverses over the devices of a data-parallel "
      "axis: pass `axis_name=` (inside pmap/shard_map) or `config.mesh=(mesh, axis)` (under "
      "jit with sharded data), or keep inverse_storage='replicated' on one device."
    )


def _concrete(value, name: str, **bounds) -> None:
  _checks.concrete_number(value, name, "build the Config", **bounds)


def get(config, who: str) -> Config:
  """`config` (None: the defaults), checked to be a `Config`."""
  if config is None:
    return Config()
  if not isinstance(config, Config):
    raise TypeError(
      f"{who}: `config` must be a kfac_jax.Config, got {type(config).__name__}: {config!r}."
    )
  return config


# Keywords that used to be parameters of the fronts, and where they live now.
_MOVED = {f: f for f in Config.__dataclass_fields__} | {"inverse_mesh": "mesh"}


def moved_keywords(fn=None, *, refused: dict[str, str] | None = None):
  """Wraps a front so that a keyword now in `Config` raises a TypeError naming its place (and a
  keyword in `refused` raises its message)."""
  if fn is None:
    return functools.partial(moved_keywords, refused=refused)

  @functools.wraps(fn)
  def wrapper(*args, **kwargs):
    for k in kwargs:
      if refused and k in refused:
        raise TypeError(refused[k].format(kwargs[k]))
      if k in _MOVED:
        name = getattr(fn, "__qualname__", "").removesuffix(".__init__")
        raise TypeError(
          f"{name}: `{k}` is no longer an argument; it is a field of the config: pass "
          f"`config=kfac_jax.Config({_MOVED[k]}=...)`."
        )
    return fn(*args, **kwargs)

  return wrapper
