"""`Config`: the rare knobs of every front (`scale_by_kfac`, `kfac`, `Optimizer`,
`CurvatureEstimator`), in one frozen object validated once.

The fronts keep as parameters only what a user tunes (damping, decays, schedules, learning rate,
momentum, clipping) and the data-parallel `axis_name` (`CurvatureEstimator`: the powers and
caches it computes); everything else is a field here, so each knob has one name, one default and
one check for every front.

Defaults that differ between fronts, and why:

  * `damping`: 0.1 for the transforms, 1e-3 for `Optimizer`. A transform's λ is fixed; the
    Optimizer's is only the starting point of its Levenberg–Marquardt adaptation.
  * `curvature_every`: 5 for `kfac`, 1 for `scale_by_kfac` and `Optimizer`. `kfac` clips the
    step in the damped K-FAC metric, which bounds a step preconditioned by statistics a few
    updates old; the bare preconditioner has no such bound, and the Optimizer's statistics
    come from the forward pass it makes anyway.
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


def check_mesh(mesh, name: str = "config.mesh") -> None:
  if mesh is None:
    return
  if (
    not isinstance(mesh, tuple)
    or len(mesh) != 2
    or not isinstance(mesh[0], jax.sharding.Mesh)
    or mesh[1] not in mesh[0].axis_names
  ):
    raise ValueError(
      f"`{name}` must be a (jax.sharding.Mesh, axis_name) pair naming one of the mesh's axes, "
      f"got {mesh!r}."
    )
  _parallel.check_auto_axis(*mesh)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
  """The rare knobs of `scale_by_kfac`, `kfac`, `Optimizer` and `CurvatureEstimator` (validated
  on construction).

  The fields come in groups: the registration (`has_aux` to `layers`; with a `registration=`
  they must agree with it or stay at their defaults), the numerics (`damping_mode` to
  `preconditioner_dtype`), the schedule (`statistics_fraction`, `burn_in_steps`), parallel work
  (`inverse_storage`, `mesh`), the guard (`skip_nonfinite`), and fields one front reads
  (`nesterov` for `kfac`; the damping adaptation's and `weight_decay` for `Optimizer`): a front
  that does not read one refuses a value other than its default (`CurvatureEstimator` reads the
  registration, the numerics and `inverse_storage` only).

  Attributes:
    has_aux: `loss_fn` returns `(loss, aux)`; only the loss part is scanned (compute the
      statistics with `value_and_grad(loss_fn, has_aux=True)`). `Optimizer.step` returns the
      aux in `info["aux"]`.
    estimation_mode: "gradients" (sampled targets: the Fisher, default), "empirical" (data
      targets), "curvature_prop" / "curvature_prop_GGN" (Rademacher vectors times a
      square-root factor of the output Fisher / loss Hessian) or "exact" / "exact_GGN" (every
      output coordinate). See `CurvatureEstimator`.
    num_samples: random vectors per example in the random modes (1 for the others). It fixes
      array shapes, so it is a Python int.
    strict: raise, instead of warning, for parameters outside every recognised layer.
    layers: a `kfac_jax.LayerConfig`: approximations per layer kind and per parameter-path
      pattern, and linked parameter groups (None: the defaults).
    check_loss: audit the loss tags against the returned loss when the layers are found (see
      `kfac_jax.Registration`); False for a loss that differs from its tags on purpose.
    damping_mode: "factored" (π-adjusted Tikhonov, default) or "eigen" (exact, slower).
    factor_solve: "auto", "always" or "never": whether a Kronecker factor's damped inverse is
      kept as an explicit matrix or as its Cholesky factor in blocks for block substitution
      ("auto": the substitution form for a factor of size n ≥ 256 whose products have at most
      n/8 columns, a classifier head's input). The updates are the same up to rounding.
    stats_dtype: dtype of the stored statistics: None (float32, float64 under x64), "float32",
      "float64", "bfloat16" or "float16"; they are accumulated in at least float32.
    inverse_dtype: dtype of the inverses, the products with them (and the Optimizer's
      quadratic model): None (float32, float64 under x64), "float32" or "float64". The
      updates come back in the parameters' dtype.
    preconditioner_dtype: None (`inverse_dtype`) or "bfloat16": the Kronecker factors'
      inverses are stored in it once computed, and the preconditioning products take their
      inputs in it with `inverse_dtype` accumulation (half the inverses' memory).
    statistics_fraction: when a transform computes the statistics from `batch=`, the fraction f
      in (0, 1] of the batch's N rows they come from: r = ⌈f·N⌉ rows, evenly spaced
      (`x[:r*s:s]` along every leaf's leading axis, s = ⌊N/r⌋); statistics are normalised by
      their own row count, so the estimate stays unbiased and only noisier. "auto" (default):
      every fourth row of a batch of 256 or more rows, every second of 128 or more, else every
      row, and every row whenever the cut batch cannot be used; None or 1: every row. An
      explicit f raises where "auto" falls back. Statistics passed as `curvature_stats=` are
      used as they come, and the `Optimizer`'s come from its one forward pass over the whole
      batch (a fraction would need a second forward pass), so there a fraction below 1 is an
      error. A Python number: it fixes array shapes.
    burn_in_steps: the first this many steps only fold curvature statistics (every step), with
      no inverse refresh and zero updates; schedules still count them.
    inverse_storage: "replicated" (default; every device keeps every inverse, the work is
      split over the devices of `axis_name` or `mesh` and the results summed) or "sharded"
      (KAISA's memory-optimised strategy, FSDP's for the K-FAC state: each device keeps,
      refreshes and applies only its share of the factors and inverses, balanced by refresh
      cost; the preconditioned gradient is summed over the axis; needs `axis_name` or `mesh`).
      Also a `kfac_jax.ReplicatedStorage()` / `kfac_jax.ShardedStorage()` object.
    mesh: under plain `jit` with data sharded over a mesh (no `axis_name`): `(mesh, axis)`
      splits the inverse work over that mesh axis (and, sharded, stores the state there).
    skip_nonfinite: when the gradient, the statistics or the update is not finite, return zero
      updates and leave the state as it was but for the `skipped` counter. False: non-finite
      statistics are still kept out of the factors (counted in `skipped_batches`), but the
      update goes through as computed. The curvature moves only from a finite gradient.
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
    resolve_dtype(self.stats_dtype, "config.stats_dtype")
    resolve_preconditioner_dtype(
      self.preconditioner_dtype,
      resolve_dtype(self.inverse_dtype, "config.inverse_dtype"),
      "config.preconditioner_dtype",
    )
    f = self.statistics_fraction
    if f is not None and f != "auto":
      _checks.static_fraction(f, "config.statistics_fraction", also='or "auto"')
    _checks.static_int(self.burn_in_steps, "config.burn_in_steps", low=0)
    _storage.strategy(self.inverse_storage, "config.inverse_storage")
    check_mesh(self.mesh)
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
    inverse_dtype = resolve_dtype(self.inverse_dtype, "config.inverse_dtype")
    return _blocks.BlockConfig(
      exps=tuple(exps),
      damping_mode=self.damping_mode,
      cholesky=cholesky,
      cholesky_inverse=cholesky_inverse,
      stats_dtype=resolve_dtype(self.stats_dtype, "config.stats_dtype"),
      inverse_dtype=inverse_dtype,
      factor_solve=self.factor_solve,
      preconditioner_dtype=resolve_preconditioner_dtype(self.preconditioner_dtype, inverse_dtype),
    )

  def registration_settings(self) -> dict[str, Any]:
    """The `Registration` keyword arguments this config holds."""
    return dict(
      has_aux=self.has_aux,
      estimation_mode=self.estimation_mode,
      num_samples=self.num_samples,
      strict=self.strict,
      layers=self.layers,
      check_loss=self.check_loss,
    )

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
  if isinstance(config.storage, _storage.ShardedStorage):
    if axis_name is None and config.mesh is None:
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
    moved = [k for k in kwargs if k in _MOVED]
    if moved:
      k = moved[0]
      name = getattr(fn, "__qualname__", "").removesuffix(".__init__")
      raise TypeError(
        f"{name}: `{k}` is no longer an argument; it is a field of the config: pass "
        f"`config=kfac_jax.Config({_MOVED[k]}=...)`."
      )
    return fn(*args, **kwargs)

  return wrapper
