"""The full K-FAC optimizer (Martens & Grosse 2015, §6–7): learning rate, momentum and damping
from an exact quadratic model of `h(θ)`, the loss `loss_fn` returns (L2 term included).

`l2_reg` = η is the coefficient of an L2 term `(η/2)‖θ‖²` the loss already holds: its curvature
η I, which the tagged loss's Gauss-Newton matrix does not see, adds to the damping of the
preconditioner and of the quadratic model, never to the gradient or the loss.

Each step runs the engine (statistics and inverses with damping `λ + η` on due steps, the
guard), takes the proposal `Δ = −(F̂ + (λ + η) I)⁻¹ ∇h` and the step `δ = α Δ + μ δ_prev`, with
α, μ minimising

    M(δ) = ∇hᵀ δ + ½ δᵀ (G + (λ + η) I) δ,      G = Σ_losses Jᵀ H_z J

(the tagged losses' Gauss-Newton matrix). With `C_ij = v_iᵀ (G + (λ + η) I) v_j` and
`b_i = ∇hᵀ v_i` for `(v_1, v_2) = (Δ, δ_prev)`, the minimiser is `x = −C⁻¹ b` in `x = (α, μ)`
(the 1-D solve `α = −b_1 / C_11, μ = 0` when δ_prev = 0 or C is singular); a fixed α or μ is
kept and the other minimises M along its vector; `J v_i` are push-forwards through the step's
own linearisation. Every `damping_adaptation_interval` steps, Levenberg–Marquardt with
`ρ = (h(θ + δ) − h(θ)) / M(δ)` (one extra forward pass) adapts λ (`adapt_damping`). A step so
measured to raise h (ρ < 0, or h(θ + δ) not finite) is rejected: not applied, δ_prev kept, λ
raised; a non-finite update from a finite loss and gradient raises λ the same way. With a fixed
learning rate, `norm_constraint=c` rescales α so that `α² Δᵀ F̂_λ Δ ≤ c` (Ba et al. 2017).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.typing import ArrayLike

from kfac_jax import (
  _checks,
  _config,
  _curvature,
  _engine,
  _estimator,
  _fit,
  _losses,
  _migrate,
  _parallel,
  _registration,
  _storage,
  _verdict,
)

Array = jax.Array
ScalarOrSchedule = float | Callable[[Array], Array]

_INFO_KEYS = "loss learning_rate momentum damping rho quad_model_change update_norm skipped".split()


def _check_number(value, name: str, **bounds) -> None:
  _checks.concrete_number(value, name, "construct the Optimizer", **bounds)


class OptimizerState(NamedTuple):
  """State of `Optimizer`.

  Attributes:
    step: `[]` int32, steps taken (burn-in included, skipped steps not).
    skipped: `[]` int32, steps skipped because the loss, gradient or update was not finite.
    curvature: the estimator's factors, inverses and EMA weight.
    damping: `[]` float, λ: the adapted value with adaptive damping, else the last one used.
    rho: `[]` float, the latest reduction ratio ρ, kept finite: 0 before the first adaptation,
      the previous value where ρ is undefined, the dtype's lowest finite number for ρ = −∞.
    velocity: the previous step δ_prev (params-shaped, params dtypes).
  """

  step: Array
  skipped: Array
  curvature: _estimator.EstimatorState
  damping: Array
  rho: Array
  velocity: Any


class KfacOptaxState(NamedTuple):
  """State of `Optimizer.as_optax`: the optimizer's state and the latest `info`."""

  optimizer: OptimizerState
  info: dict[str, Array]


def adapt_damping(
  damping: Array, rho: Array, *, omega: float, min_damping: float, max_damping: float
) -> Array:
  """One Levenberg–Marquardt update: `λω` if ρ > 3/4, `λ/ω` if ρ < 1/4, clipped; a NaN ρ (no
  model decrease to compare with) leaves λ unchanged but for the clip."""
  new = jnp.where(rho > 0.75, damping * omega, jnp.where(rho < 0.25, damping / omega, damping))
  return jnp.clip(new, min_damping, max_damping)


def solve_quadratic_model(
  c: Array, b: Array, learning_rate: Array | None = None, momentum: Array | None = None
) -> tuple[Array, Array, Array]:
  """`(α, μ, M(α, μ))` minimising `M(x) = bᵀx + ½ xᵀ C x` over `x = (α, μ)` (C `[2, 2]`, b `[2]`),
  keeping a fixed α or μ. The joint solve falls back to the 1-D one (`μ = 0`) when C is singular
  to working precision; a non-positive curvature along a vector gives it a zero coefficient."""
  c00, c01, c11 = c[0, 0], c[0, 1], c[1, 1]
  b0, b1 = b[0], b[1]
  zero = jnp.zeros_like(c00)

  def safe_div(num, den):
    ok = den > 0
    return jnp.where(ok, num / jnp.where(ok, den, 1), zero)

  if learning_rate is None and momentum is None:
    det = c00 * c11 - c01 * c01
    tol = 100 * jnp.finfo(c.dtype).eps
    joint = (c00 > 0) & (c11 > 0) & (det > tol * c00 * c11)
    safe_det = jnp.where(joint, det, 1)
    alpha2 = (c01 * b1 - c11 * b0) / safe_det
    mu2 = (c01 * b0 - c00 * b1) / safe_det
    joint = joint & jnp.isfinite(alpha2) & jnp.isfinite(mu2)
    alpha = jnp.where(joint, alpha2, safe_div(-b0, c00))
    mu = jnp.where(joint, mu2, zero)
  elif learning_rate is None:
    mu = jnp.asarray(momentum, c.dtype)
    alpha = safe_div(-(b0 + mu * c01), c00)
  elif momentum is None:
    alpha = jnp.asarray(learning_rate, c.dtype)
    mu = safe_div(-(b1 + alpha * c01), c11)
  else:
    alpha = jnp.asarray(learning_rate, c.dtype)
    mu = jnp.asarray(momentum, c.dtype)
  x = jnp.stack([alpha, mu])
  return alpha, mu, b @ x + 0.5 * x @ (c @ x)


class _Pass(NamedTuple):
  """The step's one forward pass and what it gave (read by the quadratic model and by ρ)."""

  lin: _curvature.Linearisation
  params: Any
  batch_leaves: list[Any]
  loss: Array  # h(θ), averaged over `axis_name`.
  grad_h: Any  # ∇h, averaged over `axis_name`.


class _Move(NamedTuple):
  """What a step decides beyond the curvature."""

  update: Any  # δ
  velocity: Any  # the next δ_prev
  damping: Array  # λ for the next step
  rho: Array
  learning_rate: Array  # α
  momentum: Array  # μ
  change: Array  # M(δ), NaN when not computed


def quadratic_model(fp: _Pass, delta, velocity, shift, alpha, mu, dtype, place: _engine.Placement):
  """`(α, μ, M(α Δ + μ δ_prev))`, the coefficients left None minimising M, `shift = λ + η`; `J v`
  are push-forwards through the step's linearisation, `H_z u` each loss tag's products."""

  dot = lambda a, b: _parallel.vdot(a.astype(dtype), b.astype(dtype))
  vecs = [jax.tree_util.tree_leaves(delta), jax.tree_util.tree_leaves(velocity)]
  pairs = [(0, 0), (0, 1), (1, 1)]
  jv = [fp.lin.prediction_jvp(v) for v in vecs]  # per vector, per loss tag: [*prediction.shape]
  g = [jnp.zeros([], dtype)] * len(pairs)
  for t, (spec, z, o) in enumerate(zip(fp.lin.scan.losses, fp.lin.preds, fp.lin.others)):
    hu = [_losses.output_curvature_product(spec, (z, *o), u[t]) for u in jv]
    g = [x + dot(jv[i][t], hu[j]) for x, (i, j) in zip(g, pairs)]
  g = place.mean(jnp.stack(g))
  # The shift term from inner products of the (replicated) vectors: no concatenated copies.
  c00, c01, c11 = (
    g[n] + shift * sum(dot(a, b) for a, b in zip(vecs[i], vecs[j]))
    for n, (i, j) in enumerate(pairs)
  )
  c = jnp.stack([jnp.stack([c00, c01]), jnp.stack([c01, c11])]).astype(dtype)
  b = jnp.stack([_verdict.tree_vdot(fp.grad_h, v) for v in (delta, velocity)]).astype(dtype)
  return solve_quadratic_model(c, b, alpha, mu)


def kl_clip(alpha: Array, quad: Array, limit: Array) -> Array:
  """α scaled down so that `α² Δᵀ F̂_λ Δ ≤ c` (`quad = Δᵀ F̂_λ Δ`, `limit = c`)."""
  over = (quad > 0) & (alpha * alpha * quad > limit)
  return alpha * jnp.where(over, jnp.sqrt(limit / jnp.where(over, alpha * alpha * quad, 1)), 1)


def reduction_ratio(h_old: Array, h_new: Array, change: Array) -> Array:
  """`ρ = (h(θ + δ) − h(θ)) / M(δ)`: −∞ when `h_new` is not finite or when M(δ) > 0 (a fixed α
  or μ overshoots even the model: as bad as it gets), NaN (no change to λ) when M(δ) = 0."""
  ratio = (h_new - h_old).astype(change.dtype) / jnp.where(change < 0, change, -1)
  rho = jnp.where(jnp.isfinite(h_new), ratio, -jnp.inf)
  return jnp.where(change < 0, rho, jnp.where(change > 0, -jnp.inf, jnp.nan))


def _finish(state: OptimizerState, step, update, m: _Move, loss, lam, dtype, aux, raised):
  """`(update, new_state, info)` under the engine's verdict (a skip changes only the counter);
  `raised`: the damping after a preconditioned gradient that overflowed from finite inputs."""
  if step.ok is None:
    inputs_ok, ok = jnp.asarray(True), _storage.all_finite(update)
  else:
    inputs_ok, ok = step.inputs_ok, step.ok
  velocity, new_lam, rho = jax.lax.cond(
    ok,
    lambda: (m.velocity, jnp.asarray(m.damping, dtype), m.rho),
    lambda: (state.velocity, state.damping, state.rho),
  )
  if raised is not None:  # The preconditioner overflowed at this damping: raise it.
    new_lam = jnp.where(inputs_ok & ~ok, raised, new_lam)
  steps = state.step + ok.astype(state.step.dtype)
  skipped = state.skipped + (~ok).astype(state.skipped.dtype)
  new_state = OptimizerState(steps, skipped, step.curvature, new_lam, rho, velocity)
  update = optax.tree_utils.tree_where(ok, update, optax.tree_utils.tree_zeros_like(update))
  info = {
    "loss": loss,
    "learning_rate": m.learning_rate,
    "momentum": m.momentum,
    "damping": jnp.asarray(lam, dtype),
    "rho": rho,
    "quad_model_change": m.change,
    "update_norm": jnp.sqrt(_verdict.tree_vdot(update, update)),
    "skipped": ~ok,
  }
  if aux is not None:
    info["aux"] = aux
  return update, new_state, info


class Optimizer:
  """K-FAC with learning rate, momentum and damping adapted from the quadratic model.

  Args:
    loss_fn, example_batch, ema_decay: as in `kfac_jax.scale_by_kfac`.
    learning_rate: α: None (from the quadratic model), a number > 0 or a schedule `step -> α`.
    momentum: μ: None (from the quadratic model, over any real μ), a number in [0, 1) or a
      schedule.
    damping: λ ≥ 0: the initial value with adaptive damping, otherwise a number or a schedule.
    use_adaptive_damping: adapt λ by the Levenberg–Marquardt rule (module docstring).
    l2_reg: η ≥ 0, the coefficient of an L2 term `(η/2)‖θ‖²` that `loss_fn` already adds (as
      kfac-jax's `l2_reg`; module docstring). For decoupled weight decay use
      `Config(weight_decay=)`.
    norm_constraint: c > 0 for KL clipping `α² Δᵀ F̂_λ Δ ≤ c`; needs a fixed learning rate.
    inverse_every: rebuild the inverses every this many (post burn-in) steps, first at step 0.
    curvature_every: update the statistics every this many steps (and every burn-in step).
    registration: a `kfac_jax.Registration` instead of `loss_fn` and `example_batch`.
    axis_name: pmap / shard_map axis to average loss, gradients, statistics and the model over,
      and to split the inverse work over.
    config: a `kfac_jax.Config` with the rarer knobs (those the Optimizer reads).

  Schedules are called with `state.step + state.skipped` (every step seen, burn-in included):
  a non-finite value skips its step.

  Raises:
    TypeError / ValueError: a bad hyperparameter, named with the value received, before any
      state is created; a kfac-jax keyword, naming its spelling here; a `Config` field the
      Optimizer does not read.
    RegistrationError: (at `init`) no loss tag in `loss_fn`, or an output not fitting `has_aux`.

  Example:
    >>> opt = kfac_jax.Optimizer(loss_fn, batch)
    >>> state = opt.init(params)
    >>> step = jax.jit(opt.step)
    >>> params, state, info = step(params, state, batch, jax.random.key(0))
  """

  @_migrate.translated("Optimizer")
  def __init__(
    self,
    loss_fn: Callable | None = None,
    example_batch: Any = None,
    *,
    learning_rate: ScalarOrSchedule | None = None,
    momentum: ScalarOrSchedule | None = None,
    damping: ScalarOrSchedule = 1e-3,
    use_adaptive_damping: bool = True,
    l2_reg: float = 0.0,
    norm_constraint: float | None = None,
    ema_decay: float = 0.95,
    inverse_every: int = 5,
    curvature_every: int = 1,
    registration: _registration.Registration | None = None,
    axis_name: str | None = None,
    config: _config.Config | None = None,
  ):
    if learning_rate is not None and not callable(learning_rate):
      _check_number(learning_rate, "learning_rate", low_open=True)
    if momentum is not None and not callable(momentum):
      _check_number(momentum, "momentum", high=1.0, high_open=True)
    _checks.boolean(use_adaptive_damping, "use_adaptive_damping")
    if callable(damping):
      if use_adaptive_damping:
        raise ValueError(
          "`damping` is a schedule, but use_adaptive_damping=True adapts λ from a number: pass "
          "one, or use_adaptive_damping=False."
        )
    else:
      _check_number(damping, "damping")
    _check_number(l2_reg, "l2_reg")
    if norm_constraint is not None:
      _check_number(norm_constraint, "norm_constraint", low_open=True)
      if learning_rate is None:
        raise ValueError(
          "`norm_constraint` rescales a fixed learning rate, got learning_rate=None (from the "
          "quadratic model): pass a learning_rate, or norm_constraint=None."
        )
    _check_number(ema_decay, "ema_decay", high=1.0, high_open=True)
    _checks.static_int(inverse_every, "inverse_every")
    _checks.static_int(curvature_every, "curvature_every")
    self._engine = _engine.Engine.kfac(
      "Optimizer",
      (loss_fn, example_batch, registration),
      _engine.Schedule.checked(ema_decay, inverse_every, curvature_every),
      axis_name=axis_name,
      config=config,
      state_type=OptimizerState,
      damping_shift=float(l2_reg),
    )
    config = self._engine.config
    if use_adaptive_damping and not callable(damping) and config.min_damping > float(damping):
      raise ValueError(
        f"`damping`={damping!r} is below config.min_damping={config.min_damping!r}: the adapted "
        "damping would be clipped up at once; lower min_damping or raise damping."
      )
    self._shapes = _fit.state_shapes(self.init)
    omega = config.damping_adaptation_decay**config.damping_adaptation_interval  # ω₁^T
    self._adapt_damping = functools.partial(
      adapt_damping, omega=omega, min_damping=config.min_damping, max_damping=config.max_damping
    )
    self.example_batch, self.axis_name, self.config = example_batch, axis_name, config
    self.learning_rate, self.momentum, self.damping = learning_rate, momentum, damping
    self.use_adaptive_damping, self.l2_reg = use_adaptive_damping, float(l2_reg)
    self.norm_constraint, self.ema_decay = norm_constraint, ema_decay
    self.inverse_every, self.curvature_every = int(inverse_every), int(curvature_every)

  @property
  def estimator(self) -> _estimator.CurvatureEstimator:
    """The complete estimator (after `init`, or at once with a registration)."""
    reg = self._engine.source.known
    if reg is None:
      raise RuntimeError("call `init(params)` first: the layers are found when params are known.")
    return self._engine.curvature.bind(reg, None, "Optimizer")

  @_migrate.translated("Optimizer.init")
  def init(self, params) -> OptimizerState:
    """The initial state: zero statistics, identity inverses, λ = `damping`, δ_prev = 0. With
    sharded storage, call it inside pmap / shard_map (or pass `config.mesh`)."""
    bound = self._engine.bind(params)
    dtype = bound.estimator.numerics.inverse_dtype
    lam = self.damping(jnp.zeros([], jnp.int32)) if callable(self.damping) else self.damping
    state = OptimizerState(
      step=jnp.zeros([], jnp.int32),
      skipped=jnp.zeros([], jnp.int32),
      curvature=self._engine.curvature.init(bound, self._engine.placement, params),
      damping=jnp.asarray(lam, dtype),
      rho=jnp.zeros([], dtype),
      velocity=optax.tree_utils.tree_zeros_like(params),
    )
    return _parallel.replicate_on_mesh(state, params, self._engine.placement.mesh)

  @_migrate.translated("Optimizer.step")
  def step(
    self,
    params,
    state: OptimizerState,
    batch,
    rng: Array | None = None,
    *,
    learning_rate: ArrayLike | None = None,
    momentum: ArrayLike | None = None,
    damping: ArrayLike | None = None,
  ):
    """One K-FAC step. Returns `(new_params, new_state, info)`.

    `learning_rate`, `momentum` and `damping` given here (numbers or traced scalars) are this
    step's α, μ and λ in place of the constructor's; `damping` needs
    `use_adaptive_damping=False`.

    `info` holds scalars: loss (at the old params), learning_rate (α), momentum (μ), damping
    (the λ used), rho (the latest ρ), quad_model_change (M(δ); NaN when not computed),
    update_norm (‖θ_new − θ‖), skipped (bool: `params` and `state` kept but `state.skipped`),
    and with `has_aux` the aux at the old params, `info["aux"]`.
    """
    given = {"learning_rate": learning_rate, "momentum": momentum, "damping": damping}
    updates, new_state, info = self._update(params, state, batch, rng, given)
    ok = ~info["skipped"]
    apply = lambda p, u: jnp.where(ok, jnp.asarray(p + u).astype(jnp.asarray(p).dtype), p)
    return jax.tree_util.tree_map(apply, params, updates), new_state, info

  def _hyperparameters(self, state: OptimizerState, given) -> dict[str, tuple[Any, float | None]]:
    """This step's α, μ and λ sources (see `_engine.Inputs`): given for this step, else the
    constructor's (None: from the quadratic model); λ the adapted one with adaptive damping."""
    given = {k: v for k, v in (given or {}).items() if v is not None}
    if "damping" in given and self.use_adaptive_damping:
      raise ValueError(
        "Optimizer.step: `damping` was given, but use_adaptive_damping=True adapts λ itself: "
        "build the Optimizer with use_adaptive_damping=False."
      )
    for name, value in given.items():
      if jnp.ndim(value) != 0:
        raise ValueError(
          f"Optimizer.step: `{name}` must be a scalar, got shape {jnp.shape(value)}."
        )
    damping = state.damping if self.use_adaptive_damping else self.damping
    own = {"learning_rate": self.learning_rate, "momentum": self.momentum, "damping": damping}
    lows = {"learning_rate": 0.0, "momentum": None, "damping": 0.0}
    return {n: (given.get(n, own[n]), lows[n]) for n in own}

  def _update(self, params, state: OptimizerState, batch, rng, given=None):
    """The shared core: `(updates, new_state, info)`; `params + updates` are the new params.
    `given`: per-step `learning_rate`, `momentum` and `damping` (None: the constructor's)."""
    engine = self._engine
    bound = engine.bind(params)
    engine.check(bound, state, self._shapes(params), batch=batch, rng=rng)
    hyperparameters = self._hyperparameters(state, given)
    reg, cfg = bound.registration, self.config
    dtype = bound.estimator.numerics.inverse_dtype

    # One forward pass, linearised: the loss, gradient, statistics and quadratic model reuse it.
    lin = reg.linearise(params, batch)
    loss, grads = engine.placement.mean((lin.loss, lin.grads()))
    fp = _Pass(lin, params, jax.tree_util.tree_leaves(batch), loss, grads)

    def statistics():
      return lin.statistics(rng, estimation_mode=reg.estimation_mode, num_samples=reg.num_samples)

    finite = {"gradient": grads, "params": params, "loss": loss}
    inputs = _engine.Inputs(grads, statistics, finite, hyperparameters)
    step = engine.step(bound, state.step, state.skipped, state.curvature, inputs)
    lam = jnp.asarray(step.values["damping"], dtype)

    in_burn = state.step < cfg.burn_in_steps
    move = functools.partial(self._move, fp, bound.estimator, step, state, lam)

    def burn_in():  # The statistics only, no move.
      zero, zeros = jnp.zeros([], dtype), optax.tree_utils.tree_zeros_like(params)
      return _Move(zeros, state.velocity, lam, state.rho, zero, zero, jnp.full([], jnp.nan, dtype))

    m = jax.lax.cond(in_burn, burn_in, move) if cfg.burn_in_steps else move()
    update = m.update
    if cfg.weight_decay:  # Decoupled: `δ − d θ`.
      d = jnp.where(in_burn, 0, cfg.weight_decay)
      decay = lambda u, p: (u - d.astype(p.dtype) * p).astype(p.dtype)
      update = jax.tree_util.tree_map(decay, update, params)
    raised = None
    if self.use_adaptive_damping:
      raised = self._adapt_damping(lam, jnp.asarray(-jnp.inf, dtype)).astype(dtype)
    return _finish(state, step, update, m, loss, lam, dtype, lin.aux, raised)

  def _move(self, fp: _Pass, est, step: _engine.Step, state: OptimizerState, lam) -> _Move:
    """δ = α Δ + μ δ_prev with α, μ given, fixed or from the quadratic model; the adapted λ."""
    dtype = est.numerics.inverse_dtype
    delta = jax.tree_util.tree_map(lambda d, p: (-d).astype(p.dtype), step.vector, fp.params)
    velocity = state.velocity
    alpha, mu = (
      None if step.values[n] is None else jnp.asarray(step.values[n], dtype)
      for n in ("learning_rate", "momentum")
    )
    place = self._engine.placement
    if self.norm_constraint is not None:
      assert alpha is not None  # __init__ rejects norm_constraint with learning_rate=None.
      f_delta = est._power(step.curvature, delta, 1.0, place.axis_name, place.mesh)
      quad = _verdict.tree_vdot(delta, f_delta).astype(dtype)
      alpha = kl_clip(alpha, quad, jnp.asarray(self.norm_constraint, dtype))
    change, fixed = jnp.full([], jnp.nan, dtype), alpha is not None and mu is not None
    if alpha is None or mu is None:
      shift = lam + self.l2_reg
      alpha, mu, change = quadratic_model(fp, delta, velocity, shift, alpha, mu, dtype, place)
    combine = lambda d, v: (alpha * d + mu * v).astype(d.dtype)
    update = jax.tree_util.tree_map(combine, delta, velocity)
    if self.use_adaptive_damping:
      cfg = self.config
      adapt = functools.partial(
        self._adapt, fp, delta, velocity, update, alpha, mu, change if not fixed else None, lam
      )
      due = (state.step - cfg.burn_in_steps) % cfg.damping_adaptation_interval == 0
      new_lam, rho, change = jax.lax.cond(due, adapt, lambda: (lam, state.rho, change))
      # A step the adaptation measured as raising h (ρ < 0, or h(θ + δ) not finite) is not
      # taken: λ went up and the next step tries again from θ, with the same δ_prev.
      rejected = due & ~(rho >= 0)
      low = jnp.finfo(rho.dtype).min
      rho = jnp.where(jnp.isnan(rho), state.rho, jnp.clip(rho, low, -low))
      zeros = optax.tree_utils.tree_zeros_like(update)
      update = optax.tree_utils.tree_where(rejected, zeros, update)
      velocity = optax.tree_utils.tree_where(rejected, state.velocity, update)
      return _Move(update, velocity, new_lam, rho, alpha, mu, change)
    return _Move(update, update, lam, state.rho, alpha, mu, change)

  def _adapt(self, fp: _Pass, delta, velocity, update, alpha, mu, change, lam):
    """`(λ, ρ, M(δ))` after one Levenberg–Marquardt update (one forward pass for h(θ + δ));
    `change` None: M(δ) is computed here (α and μ both fixed)."""
    dtype = lam.dtype
    if change is None:
      shift = lam + self.l2_reg
      place = self._engine.placement
      change = quadratic_model(fp, delta, velocity, shift, alpha, mu, dtype, place)[2]
    new = [
      p + u for p, u in zip(jax.tree_util.tree_leaves(fp.params), jax.tree_util.tree_leaves(update))
    ]
    h_new = self._engine.placement.mean(fp.lin.loss_at(new, fp.batch_leaves))
    rho = reduction_ratio(fp.loss, h_new, change)
    return self._adapt_damping(lam, rho).astype(dtype), rho.astype(dtype), change.astype(dtype)

  def as_optax(self) -> optax.GradientTransformationExtraArgs:
    """This optimizer as an optax transformation.

    `update(updates, state, params, *, batch, rng=None)` runs `step` and returns its
    `new_params − params` exactly (zeros on a skipped step); `updates` are not read (pass the
    gradients or None). The state is a `KfacOptaxState` (`info["aux"]`, with `has_aux`, zeros
    after `init`). Transforms chained after it change the step the model chose.
    """

    def whole(params):
      if _engine.masked_share(params) is not None:
        raise ValueError(
          "Optimizer.as_optax(): `params` has optax.MaskedNode leaves (a share), but the "
          "optimizer steps the whole model. For K-FAC on a share, use "
          "kfac_jax.kfac(registration=reg, ...) with kfac_jax.value_and_grad(registration=reg)."
        )

    def init_fn(params):
      whole(params)
      opt_state = self.init(params)
      dtype = self.estimator.numerics.inverse_dtype
      info = {k: jnp.zeros([], dtype) for k in _INFO_KEYS}
      info["loss"] = jnp.zeros([], jnp.result_type(float))
      info["skipped"] = jnp.zeros([], bool)
      reg = self.estimator.registration
      if reg.has_aux:  # Its shapes at the registered params (`params` may be a placeholder).
        _, aux = jax.eval_shape(reg.loss_part, reg.params_shape, reg.example_batch)
        info["aux"] = jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), aux)
      return KfacOptaxState(opt_state, info)

    def update_fn(
      updates, state: KfacOptaxState, params=None, *, batch=None, rng=None, **extra_args
    ):
      del updates, extra_args
      whole(params)
      if params is None or batch is None:
        raise ValueError(
          "the K-FAC optimizer's optax update needs `params` and `batch=`: "
          "tx.update(grads, state, params, batch=batch, rng=rng)."
        )
      new_updates, opt_state, info = self._update(params, state.optimizer, batch, rng)
      new_info = {k: jnp.asarray(info[k]).astype(state.info[k].dtype) for k in _INFO_KEYS}
      if "aux" in info:
        new_info["aux"] = info["aux"]
      return new_updates, KfacOptaxState(opt_state, new_info)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
