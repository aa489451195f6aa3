"""`Config`: the rare knobs of every front, in one frozen object validated once
(docs/entry_points.rst, docs/hyperparameters.rst)."""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import jax

from kfac_jax import _checks, _parallel, _storage
from kfac_jax import blocks as _blocks

# The fronts a field is read by (`Config.check_front` refuses the others a value).
_ALL = ("scale_by_kfac", "kfac", "Optimizer", "CurvatureEstimator")
_TRAINING = ("scale_by_kfac", "kfac", "Optimizer")
_TRANSFORMS = ("scale_by_kfac", "kfac")
_KERNEL = ("scale_by_kernel_ngd", "kernel_ngd")


def _field(default, read_by: tuple[str, ...]) -> Any:
  return dataclasses.field(default=default, metadata={"read_by": read_by})


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
  """The rare knobs of the fronts, validated on construction (docs/hyperparameters.rst).

  Each field declares the fronts that read it (in brackets); a front given a non-default value
  for a field it does not read raises a ValueError naming the field. The scan's settings are
  `kfac_jax.Registration`'s.

  Attributes:
    damping_mode: "factored" (π-adjusted, default), "factored_equal" (√λ on each of a layer's
      two factors) or "eigen" (exact, slower); see `blocks.BlockConfig`. [all]
    factor_solve: "auto", "always" or "never": keep a Kronecker factor's damped inverse as a
      blocked Cholesky factor ("auto": size n ≥ 256 with at most n/8 columns). [all]
    stats_dtype: dtype of the stored statistics: None (float32, float64 under x64), "float32",
      "float64", "bfloat16" or "float16"; accumulated in at least float32. [all]
    inverse_dtype: dtype of the inverses, their products and the Optimizer's quadratic model:
      None (float32, float64 under x64), "float32" or "float64". [all]
    preconditioner_dtype: None (`inverse_dtype`) or "bfloat16": the dtype the Kronecker
      factors' inverses are stored in, the products accumulating in `inverse_dtype`. [all]
    inverse_storage: "replicated" (default; every device keeps every inverse, the work split
      over the devices) or "sharded" (each device keeps, refreshes and applies only its share;
      needs `axis_name` or `mesh`); or a `ReplicatedStorage()` / `ShardedStorage()`. [all]
    statistics_fraction: when a transform computes the statistics from `batch=`, the fraction f
      in (0, 1] of the batch's N rows they come from (⌈f·N⌉ evenly spaced rows); "auto"
      (default) or None (every row): docs/hyperparameters.rst. [scale_by_kfac, kfac]
    burn_in_steps: the first this many steps only fold statistics (zero updates, no inverse
      refresh); schedules still count them. [scale_by_kfac, kfac, Optimizer]
    mesh: under plain `jit` with data sharded over a mesh: `(mesh, axis)` splits the inverse
      work (and, sharded, the state) over that axis. [scale_by_kfac, kfac, Optimizer]
    skip_nonfinite: a non-finite gradient, params, statistics or update gives zero updates and
      the state unchanged but for its `skipped` counter; False: the update goes through
      (non-finite statistics still kept out). [scale_by_kfac, kfac, Optimizer, kernel fronts]
    step_warnings: a compiled step warns too, through a host callback that keeps JAX from
      caching the step's compilation. [scale_by_kfac, kfac, Optimizer, kernel fronts]
    nesterov: `kfac`'s momentum is Nesterov's (`optax.trace(nesterov=True)`). [kfac]
    min_damping, max_damping: the clip of the adapted damping λ. [Optimizer]
    damping_adaptation_interval: T, adapt λ every T steps. [Optimizer]
    damping_adaptation_decay: ω₁ in (0, 1); λ is multiplied or divided by ω₁^T. [Optimizer]
    weight_decay: decoupled weight decay d, `θ ← θ + δ − d θ`. [Optimizer]
    chunk_size: the kernel fronts' per-example passes take this many examples at a time (None:
      all), bounding their memory. [scale_by_kernel_ngd, kernel_ngd]

  Raises:
    TypeError / ValueError: a bad field, named (`config.<field>`) with the value received.

  Example:
    >>> tx = kfac_jax.kfac(loss_fn, batch, learning_rate=0.3,
    ...                    config=kfac_jax.Config(damping_mode="eigen"))
  """

  damping_mode: _blocks.DampingMode = _field("factored", _ALL)
  factor_solve: _blocks.FactorSolve = _field("auto", _ALL)
  stats_dtype: Any = _field(None, _ALL)
  inverse_dtype: Any = _field(None, _ALL)
  preconditioner_dtype: Any = _field(None, _ALL)
  inverse_storage: Any = _field("replicated", _ALL)
  statistics_fraction: float | Literal["auto"] | None = _field("auto", _TRANSFORMS)
  burn_in_steps: int = _field(0, _TRAINING)
  mesh: tuple[jax.sharding.Mesh, str] | None = _field(None, _TRAINING)
  skip_nonfinite: bool = _field(True, _TRAINING + _KERNEL)
  step_warnings: bool = _field(False, _TRAINING + _KERNEL)
  nesterov: bool = _field(False, ("kfac",))
  min_damping: float = _field(1e-8, ("Optimizer",))
  max_damping: float = _field(1e8, ("Optimizer",))
  damping_adaptation_interval: int = _field(5, ("Optimizer",))
  damping_adaptation_decay: float = _field(0.95, ("Optimizer",))
  weight_decay: float = _field(0.0, ("Optimizer",))
  chunk_size: int | None = _field(None, _KERNEL)

  def __post_init__(self):
    self.block_config()  # The numerics: modes and dtypes.
    f = self.statistics_fraction
    if f is not None and f != "auto":
      _checks.static_fraction(f, "config.statistics_fraction")
    _checks.static_int(self.burn_in_steps, "config.burn_in_steps", low=0)
    _storage.strategy(self.inverse_storage, "config.inverse_storage")
    mesh = self.mesh
    if mesh is not None:
      pair = isinstance(mesh, tuple) and len(mesh) == 2 and isinstance(mesh[0], jax.sharding.Mesh)
      if not pair or mesh[1] not in mesh[0].axis_names:
        raise ValueError(
          "`config.mesh` must be a (jax.sharding.Mesh, axis_name) pair naming one of the mesh's "
          f"axes, got {mesh!r}."
        )
      _parallel.check_auto_axis(*mesh)
    for flag in ("skip_nonfinite", "step_warnings", "nesterov"):
      _checks.boolean(getattr(self, flag), f"config.{flag}")
    _concrete(self.min_damping, "config.min_damping")
    _concrete(self.max_damping, "config.max_damping", low=self.min_damping)
    _checks.static_int(self.damping_adaptation_interval, "config.damping_adaptation_interval")
    decay = self.damping_adaptation_decay
    _concrete(decay, "config.damping_adaptation_decay", low_open=True, high=1.0, high_open=True)
    _concrete(self.weight_decay, "config.weight_decay", high=1.0, high_open=True)
    if self.chunk_size is not None:
      _checks.static_int(self.chunk_size, "config.chunk_size")

  @property
  def storage(self) -> _storage.Storage:
    """The inverse storage strategy object."""
    return _storage.strategy(self.inverse_storage, "config.inverse_storage")

  def block_config(self, exps=(-1.0,), cholesky=False, cholesky_inverse=False):
    """The blocks' numerics (`blocks.BlockConfig`)."""
    return _blocks.BlockConfig.of(
      damping_mode=self.damping_mode,
      factor_solve=self.factor_solve,
      stats_dtype=self.stats_dtype,
      inverse_dtype=self.inverse_dtype,
      preconditioner_dtype=self.preconditioner_dtype,
      exps=exps,
      cholesky=cholesky,
      cholesky_inverse=cholesky_inverse,
    )

  def check_front(self, who: str) -> None:
    """ValueError naming the first field `who` does not read that differs from its default."""
    for f in dataclasses.fields(self):
      if who not in f.metadata["read_by"] and getattr(self, f.name) != f.default:
        raise ValueError(
          f"{who}: `config.{f.name}`={getattr(self, f.name)!r} is not read by {who} (only by "
          f"{', '.join(f.metadata['read_by'])}); leave it at its default {f.default!r}."
        )

  def read_by(self, who: str) -> Config:
    """This config with the fields `who` does not read at their defaults."""
    fields = dataclasses.fields(self)
    return Config(**{f.name: getattr(self, f.name) for f in fields if who in f.metadata["read_by"]})


def _concrete(value, name: str, **bounds) -> None:
  _checks.concrete_number(value, name, "build the Config", **bounds)


def get(config, who: str) -> Config:
  """`config` (None: the defaults), checked to be a `Config` whose fields `who` reads."""
  if config is None:
    return Config()
  if not isinstance(config, Config):
    raise TypeError(
      f"{who}: `config` must be a kfac_jax.Config, got {type(config).__name__}: {config!r}."
    )
  config.check_front(who)
  return config
