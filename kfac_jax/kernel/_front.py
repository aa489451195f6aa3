"""The natural gradient in sample space as optax transformations: `scale_by_kernel_ngd` (the
bare direction) and `kernel_ngd` (with a learning rate or a line search and the norm
constraint), each a configuration of the fronts' `kfac_jax._engine.Engine` with the curvature
`Kernel`: the same registration, checks, schedules and guard as K-FAC's fronts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import optax

from kfac_jax import _checks, _config, _engine, _registration, _storage, _transform, _verdict
from kfac_jax.kernel._rows import rows
from kfac_jax.kernel._solve import direction

Array = jax.Array
ScalarOrSchedule = float | Array | Callable[[Array], Array]

# The solve's diagnostics kept in the state, as the direction's float dtype.
INFO_KEYS = (
  "kernel_trace",
  "kernel_max_eigenvalue",
  "kernel_min_eigenvalue",
  "kernel_rank",
  "loss_factor",
  "remainder_norm",
  "example_mismatch",
)


class KernelState(NamedTuple):
  """The kernel curvature's state.

  Attributes:
    previous: φ_{k−1}, the last direction (params-shaped): SPRING's momentum carries it.
    info: the last solve's diagnostics (scalars, `INFO_KEYS`; see `kfac_jax.kernel.direction`).
  """

  previous: Any
  info: dict[str, Array]


class ScaleByKernelNgdState(NamedTuple):
  """State of `scale_by_kernel_ngd`: `count` (updates applied), `curvature` (a `KernelState`)
  and `skipped` (updates skipped because an input or the direction was not finite)."""

  count: Array  # type: ignore[assignment]  # optax's field name; shadows tuple.count
  curvature: KernelState
  skipped: Array


class KernelNgdState(NamedTuple):
  """State of `kernel_ngd`: its preconditioner's (`ScaleByKernelNgdState`) and the rest of its
  chain's (the norm constraint's and the learning rate's or line search's)."""

  preconditioner: ScaleByKernelNgdState
  rest: tuple[Any, ...]


@dataclasses.dataclass(frozen=True)
class Kernel:
  """The sample-space natural gradient `(F + λI)⁻¹(g + λμ φ_{k−1})` as an engine's curvature
  (`kfac_jax.kernel`), SPRING's φ kept in the state (moved only on a good verdict)."""

  chunk_size: int | None
  center: bool
  takes_stats: ClassVar[bool] = False

  def bind(self, registration, kept, who: str) -> None:
    if kept is not None:
      raise ValueError(
        f"{who}: `params` has optax.MaskedNode leaves, but the rows need every parameter: apply "
        "it to the whole params and chain `optax.masked(optax.set_to_zero(), frozen)` after it."
      )

  def init(self, bound, placement, params) -> KernelState:
    del bound, placement
    leaves = jax.tree_util.tree_leaves(params)  # None: optax.tree_map_params' placeholder.
    dtype = jnp.promote_types(jnp.result_type(*leaves) if leaves else jnp.float32, jnp.float32)
    info = {k: jnp.zeros([], dtype) for k in INFO_KEYS}
    return KernelState(optax.tree_utils.tree_zeros_like(params), info)

  def check(self, bound, state, stats, who: str) -> None:
    del bound, state, stats, who

  def fits_by_shape(self, bound) -> bool:
    del bound
    return True

  def step(self, bound, placement, state: KernelState, work: _engine.Work):
    phi, info = direction(
      work.statistics(),
      work.vector,
      state.previous,
      damping=work.values["damping"],
      momentum=work.values["momentum"],
      axis_name=placement.axis_name,
    )
    phi = jax.tree_util.tree_map(lambda d, g: d.astype(g.dtype), phi, work.vector)
    dtype = next(iter(state.info.values())).dtype
    info = {k: jnp.asarray(info[k]).astype(dtype) for k in INFO_KEYS}
    ok = work.ok
    if ok is None:
      return phi, KernelState(phi, info), None
    ok = ok & _storage.all_finite(phi)
    keep = optax.tree_utils.tree_where
    return phi, KernelState(keep(ok, phi, state.previous), keep(ok, info, state.info)), ok


def _engine_of(who, state_type, source, damping, momentum, center, axis_name, config):
  """`(engine, hyperparameters)` of a kernel front, its arguments checked first."""
  _checks.number(damping, "damping", low=0.0, low_open=True, schedule=True)
  _checks.number(momentum, "momentum", low=0.0, high=1.0, high_open=True, schedule=True)
  _checks.boolean(center, "center")
  engine = _engine.Engine.build(
    who,
    source,
    lambda config: Kernel(config.chunk_size, center),
    axis_name=axis_name,
    config=config,
    state_type=state_type,
    transform=True,
    defaults={"estimation_mode": "exact"},
  )
  return engine, {"damping": (damping, 0.0), "momentum": (momentum, 0.0)}


def _statistics(engine: _engine.Engine, bound, params, batch, rng, curvature_stats):
  del curvature_stats  # Refused by the engine's check.
  kernel, axis, reg = engine.curvature, engine.placement.axis_name, bound.registration
  return rows(
    reg, params, batch, rng, chunk_size=kernel.chunk_size, axis_name=axis, center=kernel.center
  )


def scale_by_kernel_ngd(
  loss_fn: Callable | None = None,
  example_batch: Any = None,
  *,
  damping: ScalarOrSchedule = 1e-3,
  momentum: ScalarOrSchedule = 0.0,
  center: bool = False,
  registration: _registration.Registration | None = None,
  axis_name: str | None = None,
  config: _config.Config | None = None,
) -> optax.GradientTransformationExtraArgs:
  """The damped natural gradient, solved in sample space: `u ← (F + λI)⁻¹(g + λμ φ_{k−1})`.

  F = UᵀU is the registration's Fisher / GGN of the tagged outputs on the batch, exactly (the
  numerics: `kfac_jax.kernel`; when to choose it: docs/curvatures.rst). μ = 0 is MinSR /
  ENGD-Woodbury; μ > 0 is SPRING (Goldshlager, Abrahamsen & Lin 2024).

  Args:
    loss_fn: `loss_fn(params, batch) -> scalar` with a loss tag on the model output (each
      tagged output depending on its own example only); `init` registers it in "exact" mode.
    example_batch: a batch of the training shapes; `init` scans `loss_fn` with it.
    damping: λ > 0, a number or a schedule `count -> λ`.
    momentum: μ in [0, 1), a number or a schedule: SPRING's decay of the previous direction
      (the paper's 0.99 for variational Monte Carlo).
    center: subtract each tag's mean row over the batch (the scores' covariance, the metric of
      stochastic reconfiguration and of SPRING as published) instead of the tag's Fisher.
    registration: a `kfac_jax.Registration` instead of `loss_fn` and `example_batch` (a
      variational Monte Carlo energy with `curvature_fn` tagging log ψ, say).
    axis_name: the `pmap` / `shard_map` axis the batch is sharded over (None under plain jit).
    config: a `kfac_jax.Config` with the rare knobs it reads (`skip_nonfinite`, `chunk_size`).

  Returns:
    An `optax.GradientTransformationExtraArgs` with state `ScaleByKernelNgdState`. Its
    `update` takes the gradient as `updates`, the `params`, and the batch it was computed on
    as `batch=` (with `rng=` for a sampled estimation mode).

  Raises:
    TypeError / ValueError: a bad argument, named with the value received, before any state
      is created; in `update`: a state of another front or model, `curvature_stats=`, a
      missing `batch` or `rng`, params with `optax.MaskedNode` leaves.

  Example:
    >>> tx = optax.chain(kfac_jax.scale_by_kernel_ngd(loss_fn, batch, damping=1e-3),
    ...                  optax.scale_by_learning_rate(0.1))
    >>> opt_state = tx.init(params)
    >>> grads = jax.grad(loss_fn)(params, batch)
    >>> updates, opt_state = tx.update(grads, opt_state, params, batch=batch)
  """
  source = (loss_fn, example_batch, registration)
  engine, hyperparameters = _engine_of(
    "scale_by_kernel_ngd",
    ScaleByKernelNgdState,
    source,
    damping,
    momentum,
    center,
    axis_name,
    config,
  )
  return _transform.transformation(engine, hyperparameters, _statistics)


def constrain_norm(norm_constraint):
  """`u ← u · min(1, √(C / ‖u‖²))`: the step's squared Euclidean length capped at C
  (`norm_constraint`), as variational Monte Carlo codes constrain SR and SPRING steps."""

  def update_fn(updates, state, params=None, **extra_args):
    del params, extra_args
    sq = jnp.asarray(_verdict.tree_vdot(updates, updates))
    c = jnp.asarray(norm_constraint, sq.dtype)
    big = sq > c
    coeff = jnp.where(big, jnp.sqrt(c / jnp.where(big, sq, 1)), 1)
    return jax.tree_util.tree_map(lambda x: x * coeff.astype(x.dtype), updates), state

  return optax.GradientTransformationExtraArgs(lambda _: optax.EmptyState(), update_fn)


def kernel_ngd(
  loss_fn: Callable | None = None,
  example_batch: Any = None,
  learning_rate: ScalarOrSchedule | None = None,
  *,
  damping: ScalarOrSchedule = 1e-3,
  momentum: ScalarOrSchedule = 0.0,
  norm_constraint: float | None = None,
  center: bool = False,
  registration: _registration.Registration | None = None,
  axis_name: str | None = None,
  config: _config.Config | None = None,
  linesearch: optax.GradientTransformationExtraArgs | None = None,
) -> optax.GradientTransformationExtraArgs:
  """The natural gradient in sample space with a learning rate or a line search: `u = −α φ`,
  φ from `scale_by_kernel_ngd`, the step then capped in length (`norm_constraint`), all under
  the step's verdict (a non-finite input, direction or schedule value skips the update).

  Args:
    loss_fn, example_batch, damping, momentum, center, registration, axis_name, config: as in
      `scale_by_kernel_ngd` (SPRING: `momentum=0.99, damping=1e-3, norm_constraint=1e-3`
      with a learning rate near 0.02 is its paper's variational Monte Carlo setting).
    learning_rate: α > 0, a number or a schedule `count -> α`; None takes the damped
      Gauss-Newton step on the tagged loss's scale, `1 / c` (c the registration's `loss_factor`).
    norm_constraint: C > 0 caps the step's squared Euclidean length `‖α φ‖²`; None for none.
    linesearch: an optax line search (`optax.scale_by_backtracking_linesearch(...)`,
      `kfac_jax.pinn.grid_linesearch(...)`, ...) in place of α (`learning_rate` None):
      `update` also takes its `value=`, `grad=` and `value_fn=`, as in `optax.lbfgs`.

  Returns:
    An `optax.GradientTransformationExtraArgs` with state `KernelNgdState`; `update` takes
    `scale_by_kernel_ngd`'s extra arguments and those of `linesearch`.

  Raises:
    TypeError / ValueError: as `scale_by_kernel_ngd`.

  Example:
    >>> tx = kfac_jax.kernel_ngd(loss_fn, batch, learning_rate=0.5)
    >>> opt_state = tx.init(params)
    >>> grads = jax.grad(loss_fn)(params, batch)
    >>> updates, opt_state = tx.update(grads, opt_state, params, batch=batch)
    >>> params = optax.apply_updates(params, updates)
  """
  _transform.check_step_size(learning_rate, linesearch, "kernel_ngd")
  if norm_constraint is not None:
    _checks.number(norm_constraint, "norm_constraint", low=0.0, low_open=True)
  source = (loss_fn, example_batch, registration)
  engine, hyperparameters = _engine_of(
    "kernel_ngd", KernelNgdState, source, damping, momentum, center, axis_name, config
  )

  def gauss_newton_step(params) -> float:
    return 1.0 / (engine.bind(params).registration.loss_factor or 1.0)

  rest = optax.chain(
    _transform.scale_by_learning_rate(learning_rate, gauss_newton_step)
    if linesearch is None
    else _transform.along_linesearch(linesearch),
    optax.identity() if norm_constraint is None else constrain_norm(norm_constraint),
  )
  hyperparameters["learning_rate"] = (learning_rate, 0.0)
  hyperparameters["norm_constraint"] = (norm_constraint, 0.0)
  return _transform.transformation(
    engine, hyperparameters, _statistics, rest, ScaleByKernelNgdState
  )
