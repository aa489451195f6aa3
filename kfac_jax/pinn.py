"""Physics-informed networks (docs/pinn.rst): forward-mode differential operators whose dense
layers K-FAC registers as one layer shared by the value and derivative channels (the "expand"
factors of Dangel, Müller & Zeinhofer 2024), a grid line search, and two optimizer presets.
"""

from __future__ import annotations

import functools
import inspect
import operator
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from kfac_jax import _checks, _compat, _config, _optimizer, _registration, _transform
from kfac_jax._curvature import read_atom

__all__ = [
  "GridLinesearchState",
  "differential_operator",
  "grid_linesearch",
  "kfac",
  "laplacian",
  "optimizer",
]

Array = jax.Array


class _Jet(NamedTuple):
  """A quantity that depends on the point, with its derivatives (one point; S its shape)."""

  value: Array  # [*S]
  tangents: Array | None  # [r, *S], its derivatives along the r directions (None: r = 0)
  second: Array  # [*S], Σ_k σ_k ∂²/∂v_k² plus the derivative along the first-order seed


# Primitives linear in their point-dependent operands, applied to the tangents directly (not
# through `jax.jvp`) so that a layer's product stays the one product per channel K-FAC registers.
_LINEAR = frozenset({
  "neg", "reshape", "broadcast_in_dim", "transpose", "squeeze", "expand_dims", "slice",
  "reduce_sum", "convert_element_type", "copy", "copy_p", "rev", "real", "imag", "conj", "cumsum",
})  # fmt: skip
# Linear in one operand when the others are constants (a product, not a sum).
_BILINEAR = {"mul": (0, 1), "dot_general": (0, 1), "conv_general_dilated": (0, 1), "div": (0,)}
# Sums: a constant operand shifts the value only.
_SUMS = frozenset({"add", "sub", "add_any"})
# Elementwise primitives: first and second derivatives from one nested `jax.jvp`.
_ELEMENTWISE = frozenset({
  "tanh", "logistic", "sin", "cos", "tan", "asin", "acos", "atan", "sinh", "cosh", "asinh",
  "acosh", "atanh", "exp", "exp2", "expm1", "log", "log1p", "sqrt", "rsqrt", "cbrt", "square",
  "integer_pow", "pow", "abs", "sign", "floor", "ceil", "round", "erf", "erfc", "erf_inv",
  "lgamma", "digamma", "max", "min", "atan2", "rem", "div", "mul",
})  # fmt: skip


def _is_float(x) -> bool:
  return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


def _contract(signs: np.ndarray, q: Array) -> Array:
  """`Σ_k σ_k q[k]` for the directions' second derivatives `q: [r, *S]`."""
  if np.all(signs == 1):
    return jnp.sum(q, axis=0)
  if np.all(signs == -1):
    return -jnp.sum(q, axis=0)
  return jnp.tensordot(jnp.asarray(signs, q.dtype), q, axes=1)


def _push_eqn(eqn, ins: list, signs: np.ndarray) -> list:
  """One equation of `u` on its inputs (arrays, or `_Jet`s for what depends on the point)."""
  jets = [i for i, x in enumerate(ins) if isinstance(x, _Jet)]
  if not jets:
    return _compat.bind_eqn(eqn, ins)
  sub = _compat.call_jaxpr_of(eqn)
  if sub is not None:  # A nested `jax.jit`: its operations one by one.
    return _push_jaxpr(sub, ins, signs)
  values = [x.value if isinstance(x, _Jet) else x for x in ins]
  outs = _compat.bind_eqn(eqn, values)

  def f(*point_inputs):  # The equation as a function of its point-dependent inputs.
    vals = list(values)
    for i, v in zip(jets, point_inputs):
      vals[i] = v
    return _compat.bind_eqn(eqn, vals)

  name, jet_ins = eqn.primitive.name, [ins[i] for i in jets]
  same_shape = all(jnp.shape(values[i]) == jnp.shape(outs[0]) for i in jets)
  if (name in _LINEAR and jets == [0]) or (
    name in _BILINEAR and len(jets) == 1 and jets[0] in _BILINEAR[name]
  ):
    jet = jet_ins[0]  # The primitive on each channel (the tangents through a vmap over r).
    tangents = jax.vmap(f)(jet.tangents) if jet.tangents is not None else [None] * len(outs)
    second = f(jet.second)
  elif name in _ELEMENTWISE and len(jets) == 1 and same_shape:
    tangents, second = _elementwise_rule(f, jet_ins[0], signs)
  elif name in _SUMS and same_shape:
    sign = -1 if name == "sub" else 1
    tangents, second = _sum_rule(jet_ins, [sign if i == 1 else 1 for i in jets])
  else:
    tangents, second = _jvp_rule(f, jet_ins, outs, signs)
  return [
    _Jet(o, t, s) if _is_float(o) else o for o, t, s in zip(outs, tangents, second, strict=True)
  ]


def _elementwise_rule(f, jet: _Jet, signs: np.ndarray) -> tuple[list, list]:
  """`y = f(z)`: `∂y = f'(z) ∂z`, `second(y) = f'(z) second(z) + f''(z) Σ_k σ_k (∂_k z)²`."""
  ones = jnp.ones_like(jet.value)
  d1, d2 = jax.jvp(lambda z: jax.jvp(lambda w: f(w)[0], (z,), (ones,))[1], (jet.value,), (ones,))
  if jet.tangents is None:
    return [None], [d1 * jet.second]
  second = d1 * jet.second + d2 * _contract(signs, jet.tangents * jet.tangents)
  return [d1 * jet.tangents], [second]


def _sum_rule(jets: list[_Jet], signs: list[int]) -> tuple[list, list]:
  """`d(a ± b) = da ± db`; a constant operand adds nothing."""

  def combine(channel):
    terms = [getattr(j, channel) if s == 1 else -getattr(j, channel) for j, s in zip(jets, signs)]
    return functools.reduce(operator.add, terms)

  return [None if jets[0].tangents is None else combine("tangents")], [combine("second")]


def _jvp_rule(f, jets: list[_Jet], outs: list, signs: np.ndarray) -> tuple[list, list]:
  """Any other primitive: its first and second derivatives along the channels by `jax.jvp`."""
  primals = tuple(jet.value for jet in jets)

  def push(ts):
    return jax.jvp(f, primals, ts)[1]

  second = push(tuple(jet.second for jet in jets))
  if jets[0].tangents is None:
    return [None] * len(outs), second
  ts = tuple(jet.tangents for jet in jets)

  def curvature(ts):
    return jax.jvp(lambda *p: jax.jvp(f, p, ts)[1], primals, ts)[1]

  q = jax.vmap(curvature)(ts)
  second = [s + _contract(signs, qo) if _is_float(o) else s for s, o, qo in zip(second, outs, q)]
  return jax.vmap(push)(ts), second


def _push_jaxpr(closed, ins: list, signs: np.ndarray) -> list:
  """`closed`'s outputs, its operations evaluated by `_push_eqn`."""
  jaxpr = closed.jaxpr
  env: dict[Any, Any] = dict(zip([*jaxpr.constvars, *jaxpr.invars], [*closed.consts, *ins]))
  for eqn in jaxpr.eqns:
    env.update(zip(eqn.outvars, _push_eqn(eqn, [read_atom(v, env) for v in eqn.invars], signs)))
  return [read_atom(v, env) for v in jaxpr.outvars]


def _directions(a, d: int) -> tuple[np.ndarray, np.ndarray]:
  """`(V [r, d], σ [r])` with `Σ_k σ_k v_k v_kᵀ` the symmetric part of `a`: its nonzero
  eigenpairs, `v_k = √|λ_k| e_k`; a diagonal `a` keeps the axes, in order."""
  a = (a + a.T) / 2
  if np.array_equal(a, np.diag(np.diag(a))):
    lam, vecs = np.diag(a), np.eye(d, dtype=a.dtype)
  else:
    lam, vecs = np.linalg.eigh(a)
    vecs = vecs.T
  keep = np.abs(lam) > d * np.finfo(a.dtype).eps * np.max(np.abs(lam), initial=0.0)
  lam, vecs = lam[keep], vecs[keep]
  return np.sqrt(np.abs(lam))[:, None] * vecs, np.sign(lam)


def _concrete(value, name: str, shape: tuple[int, ...], dtype) -> np.ndarray:
  try:
    out = np.asarray(value, dtype)
  except (TypeError, jax.errors.ConcretizationTypeError) as e:
    raise TypeError(
      f"differential_operator: `{name}` must be a constant known while tracing, got "
      f"{type(value).__name__}: build it with NumPy (`np.diag([0.0, -0.25])`) or outside jit."
    ) from e
  if out.shape != shape:
    raise ValueError(f"differential_operator: `{name}` must have shape {shape}, got {out.shape}.")
  return out


def _check_points(u, x, who: str) -> int:
  if not callable(u):
    raise TypeError(f"{who}: `u` must be a function of one point, got {type(u).__name__}.")
  if jnp.ndim(x) != 2 or not _is_float(x):
    raise ValueError(
      f"{who}: `x` must be the points, a float array [N, d], got shape {jnp.shape(x)} and dtype "
      f"{jnp.result_type(x)}; for a single point pass `x[None]`."
    )
  return x.shape[1]


def _forward(u, x, directions: np.ndarray, signs: np.ndarray, seed: np.ndarray, who: str):
  """`(u, second)` at each point of `x` ([N] each): `second = Σ_k σ_k ∂²u/∂v_k² + ∂u/∂seed`."""
  n, d = x.shape
  point = jax.ShapeDtypeStruct((d,), x.dtype)
  closed = jax.make_jaxpr(u)(point)
  (out,) = closed.out_avals if len(closed.out_avals) == 1 else (None,)
  if out is None or out.shape != () or not jnp.issubdtype(out.dtype, jnp.inexact):
    got = [(a.shape, str(a.dtype)) for a in closed.out_avals]
    raise ValueError(
      f"{who}: `u` must map one point of shape ({d},) to a float scalar, got {got}; for a "
      "network with one output, index it (e.g. `lambda y: net(params, y)[0]`)."
    )
  r = directions.shape[0]
  # Broadcast over the points: a constant direction would meet each kernel once for all points.
  tangents = jnp.broadcast_to(jnp.asarray(directions, x.dtype), (n, r, d)) if r else None
  second = jnp.broadcast_to(jnp.asarray(seed, x.dtype), (n, d))

  def one(xn, tn, sn):
    (res,) = _push_jaxpr(closed, [_Jet(xn, tn, sn)], signs)
    if isinstance(res, _Jet):
      return res.value, res.second
    return res, jnp.zeros_like(res)

  return jax.vmap(one)(x, tangents, second)


def laplacian(u: Callable[[Array], Array], x: Array) -> Array:
  """Δu = Σ_i ∂²u/∂x_i² at each point, in one forward pass (the forward Laplacian).

  Every operation of `u` carries the value, the d first derivatives and the Laplacian: a dense
  layer is one layer shared by those channels (docs/pinn.rst).

  Args:
    u: `u(y) -> scalar` for one point `y` of shape [d] (e.g. `lambda y: mlp(params, y)`).
    x: the points, [N, d] (float).

  Returns:
    Δu at each point, [N].

  Raises:
    TypeError / ValueError: `u` is not a function of one point to a float scalar, or `x` not a
      float array [N, d].

  Example:
    >>> def u(params, y):
    ...   return jnp.tanh(y @ params["w"] + params["b"]) @ params["v"]
    >>> params = {"w": jnp.ones((2, 4)), "b": jnp.zeros(4), "v": jnp.ones(4)}
    >>> x = jnp.full((3, 2), 0.5)
    >>> lap = kfac_jax.pinn.laplacian(lambda y: u(params, y), x)  # [3]
  """
  d = _check_points(u, x, "laplacian")
  return _forward(u, x, np.eye(d), np.ones(d), np.zeros(d), "laplacian")[1]


def differential_operator(
  u: Callable[[Array], Array], x: Array, a: Any = None, b: Any = None, c: float | None = None
) -> Array:
  """`Σ_ij a_ij ∂²u/∂x_i∂x_j + Σ_i b_i ∂u/∂x_i + c u` at each point, in one forward pass.

  Carried as in `laplacian`, along the eigenvectors of `a`'s symmetric part (docs/pinn.rst).

  Args:
    u: `u(y) -> scalar` for one point `y` of shape [d], as in `laplacian`.
    x: the points, [N, d] (float).
    a: the second-order coefficients, [d, d], constant (None: no second-order term).
    b: the first-order coefficients, [d], constant (None: none).
    c: the coefficient of u, a constant number (None: none).

  Returns:
    The operator applied to u at each point, [N].

  Raises:
    TypeError / ValueError: as `laplacian`; a coefficient of the wrong shape or not a constant.

  Example:
    >>> def u(params, y):  # y = (t, x)
    ...   return jnp.tanh(y @ params["w"] + params["b"]) @ params["v"]
    >>> params = {"w": jnp.ones((2, 4)), "b": jnp.zeros(4), "v": jnp.ones(4)}
    >>> tx = jnp.full((3, 2), 0.5)
    >>> residual = kfac_jax.pinn.differential_operator(  # u_t − u_xx / 4
    ...   lambda y: u(params, y), tx, a=jnp.diag(jnp.array([0.0, -0.25])), b=jnp.array([1.0, 0.0]))
  """
  d = _check_points(u, x, "differential_operator")
  dtype = np.dtype(jnp.result_type(x))
  if a is None:
    directions, signs = np.zeros((0, d), dtype), np.zeros(0, dtype)
  else:
    directions, signs = _directions(_concrete(a, "a", (d, d), dtype), d)
  seed = np.zeros(d, dtype) if b is None else _concrete(b, "b", (d,), dtype)
  coef_c = None if c is None else _concrete(c, "c", (), dtype)
  value, out = _forward(u, x, directions, signs, seed, "differential_operator")
  return out if coef_c is None else out + coef_c * value


class GridLinesearchState(NamedTuple):
  """State of `grid_linesearch`."""

  learning_rate: Array  # [], the step size taken at the last update (0: none)


def grid_linesearch(max_halvings: int = 30) -> optax.GradientTransformationExtraArgs:
  """The step size of lowest loss among `1, 1/2, …, 2^-max_halvings` along the update.

  The update `u` becomes `η u` with `η = argmin_η L(θ + η u)` over the grid, or 0 when every
  grid point's loss is above `value` (a non-finite loss counts as +∞). A halving grid suits a
  full-batch residual loss, where a damped Gauss-Newton step of length 1 is often right.

  Args:
    max_halvings: K ≥ 0: the grid is `2^-k`, k = 0..K.

  Returns:
    An optax line search for `kfac_jax.kfac(linesearch=...)` (state `GridLinesearchState`)
    whose `update` takes `value=` (the loss at `params`) and `value_fn=`, called with the other
    keyword arguments it names (`grad=` is accepted and not read).

  Raises:
    ValueError: `max_halvings` is not an integer ≥ 0.

  Example:
    >>> ls = kfac_jax.pinn.grid_linesearch(max_halvings=10)
    >>> value_fn = lambda p: jnp.sum((p - 0.3) ** 2)
    >>> p = jnp.zeros(2)
    >>> step, state = ls.update(jnp.ones(2), ls.init(p), p, value=value_fn(p), value_fn=value_fn)
    >>> float(state.learning_rate)  # 0.25, the grid point nearest 0.3
    0.25
  """
  if isinstance(max_halvings, bool) or not isinstance(max_halvings, int) or max_halvings < 0:
    raise ValueError(
      f"grid_linesearch: max_halvings must be an integer >= 0, got {max_halvings!r}."
    )
  sizes = 2.0 ** -np.arange(max_halvings + 1)

  def update_fn(updates, state, params, *, value, value_fn, **extra):
    del state
    kwargs = _accepted(value_fn, extra)

    def loss_at(eta):
      moved = jax.tree_util.tree_map(lambda p, u: p + (eta * u).astype(p.dtype), params, updates)
      return value_fn(moved, **kwargs)

    etas = jnp.asarray(sizes, jnp.result_type(*jax.tree_util.tree_leaves(updates)))
    losses = jax.lax.map(loss_at, etas)
    losses = jnp.where(jnp.isfinite(losses), losses, jnp.inf)
    best = jnp.argmin(losses)
    eta = jnp.where(losses[best] <= value, etas[best], jnp.zeros_like(etas[best]))
    scaled = jax.tree_util.tree_map(lambda u: (eta * u).astype(u.dtype), updates)
    return scaled, GridLinesearchState(eta.astype(jnp.zeros(()).dtype))

  return optax.GradientTransformationExtraArgs(
    lambda params: GridLinesearchState(jnp.zeros(())), update_fn
  )


def _accepted(fn: Callable, kwargs: dict) -> dict:
  """The keyword arguments `fn` takes (all of them when it takes `**kwargs`); `grad` never."""
  kwargs = {k: v for k, v in kwargs.items() if k != "grad"}
  try:
    params = inspect.signature(fn).parameters.values()
  except (TypeError, ValueError):  # No signature (a builtin): pass none.
    return {}
  if any(p.kind is p.VAR_KEYWORD for p in params):
    return kwargs
  names = {p.name for p in params if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)}
  return {k: v for k, v in kwargs.items() if k in names}


def _exact_registration(who, loss_fn, params, example_batch, registration):
  reg = _registration.shared(
    registration, loss_fn, who, ("params", params), ("example_batch", example_batch)
  )
  if reg is not None:
    return reg
  missing = [n for n, v in (("params", params), ("example_batch", example_batch)) if v is None]
  if missing:
    raise TypeError(
      f"{who}: pass {' and '.join(f'`{m}`' for m in missing)} with `loss_fn` (the registration "
      "is built from them), or `registration=`."
    )
  return _registration.Registration(loss_fn, params, example_batch, estimation_mode="exact_GGN")


def optimizer(
  loss_fn: Callable | None = None,
  params: Any = None,
  example_batch: Any = None,
  *,
  registration: _registration.Registration | None = None,
  damping: float = 0.5,
  axis_name: str | None = None,
) -> _optimizer.Optimizer:
  """`kfac_jax.Optimizer` with the settings of a full-batch PINN loss.

  The settings, each for a reason:

  - `estimation_mode="exact_GGN"`: one output per point, so exact costs what a sample costs.
  - `ema_decay=0.0`, `inverse_every=1`, `curvature_every=1`: the batch is the whole problem.
  - learning rate and momentum from the quadratic model: no step size to tune.
  - damping adapted at every step from `damping`: a step that raises the loss is not applied.
  - `Config(min_damping=1e-12)`: the error keeps dropping long after 1e-8 would bind.

  Args:
    loss_fn: `loss_fn(params, batch) -> scalar`, one loss tag per residual term (e.g.
      `register_normal_predictive_distribution(residual[:, None], var=1.0)` with the loss
      `0.5 * mean(residual**2)`).
    params, example_batch: the parameters and the points, for the registration.
    registration: a `kfac_jax.Registration` instead of the three above (its settings kept).
    damping: the initial damping λ > 0.
    axis_name: the pmap / shard_map axis, as for `kfac_jax.Optimizer`.

  Returns:
    The `kfac_jax.Optimizer` (the exact mode draws nothing: `step`'s key is not read).

  Raises:
    TypeError / ValueError / RegistrationError: as `kfac_jax.Registration` and
      `kfac_jax.Optimizer`, naming the argument.

  Example:
    >>> def loss_fn(params, batch):
    ...   x = batch["interior"]
    ...   f = lambda y: (jnp.tanh(y @ params["w"] + params["b"]) @ params["v"])[0]
    ...   r = (kfac_jax.pinn.laplacian(f, x) + 1.0)[:, None]
    ...   kfac_jax.register_normal_predictive_distribution(r, var=1.0)
    ...   return 0.5 * jnp.mean(r**2)
    >>> params = {"w": jnp.ones((2, 4)) / 2, "b": jnp.arange(4.0) / 4, "v": jnp.ones((4, 1)) / 4}
    >>> batch = {"interior": jnp.linspace(0.0, 1.0, 16).reshape(8, 2)}
    >>> opt = kfac_jax.pinn.optimizer(loss_fn, params, batch)
    >>> state = opt.init(params)
    >>> params, state, info = jax.jit(opt.step)(params, state, batch, jax.random.key(0))
  """
  reg = _exact_registration("pinn.optimizer", loss_fn, params, example_batch, registration)
  return _optimizer.Optimizer(
    registration=reg,
    damping=damping,
    ema_decay=0.0,
    inverse_every=1,
    axis_name=axis_name,
    config=_config.Config(damping_adaptation_interval=1, min_damping=1e-12),
  )


def kfac(
  loss_fn: Callable | None = None,
  params: Any = None,
  example_batch: Any = None,
  *,
  registration: _registration.Registration | None = None,
  momentum: float = 0.51,
  ema_decay: float = 0.45,
  damping: float = 1.5e-12,
  max_halvings: int = 30,
  axis_name: str | None = None,
) -> optax.GradientTransformationExtraArgs:
  """`kfac_jax.kfac` with the grid line search, as the K-FAC for PINNs paper's code runs it.

  The code starts each Kronecker factor at the identity and averages it without bias
  correction, so after k + 1 updates a factor is `(1 − ρ^(k+1)) (F̄ + ε_k I)`, F̄ the
  bias-corrected average. Reproduced by: exact Gauss-Newton statistics refreshed and inverted at
  every step; the damping `ε_k = (ρ^(k+1) + damping) / (1 − ρ^(k+1))` on both factors of each
  loss term (`damping_mode="factored_equal"`); heavy-ball momentum on the direction weighted by
  `(1 − ρ^(k+1))⁻²`; `grid_linesearch` for the step. The defaults are the paper's best on the
  2-d Poisson equation.

  Args:
    loss_fn, params, example_batch, registration: as for `optimizer`.
    momentum: μ in [0, 1).
    ema_decay: ρ in [0, 1), the statistics' moving average.
    damping: δ ≥ 0, each factor's damping once the moving average has filled.
    max_halvings: the grid line search's K: step sizes `2^-k`, k = 0..K.
    axis_name: as for `kfac_jax.kfac`.

  Returns:
    The `optax.GradientTransformationExtraArgs` (state `kfac_jax.KfacState`); `update` takes
    `curvature_stats=` (or `batch=` and `rng=`) and the line search's `value=`, `grad=` and
    `value_fn=` (docs/pinn.rst runs it).

  Raises:
    TypeError / ValueError: a bad argument, named with the value received.
  """
  reg = _exact_registration("pinn.kfac", loss_fn, params, example_batch, registration)
  for name, value in (("momentum", momentum), ("ema_decay", ema_decay)):
    _checks.number(value, name, low=0.0, high=1.0, high_open=True)
  _checks.number(damping, "damping", low=0.0)
  search = optax.chain(
    _identity_start(ema_decay, momentum), grid_linesearch(max_halvings=max_halvings)
  )
  return _transform.kfac(
    registration=reg,
    linesearch=search,
    momentum=None,
    max_norm=None,
    damping=_fading_damping(ema_decay, damping),
    ema_decay=ema_decay,
    inverse_every=1,
    curvature_every=1,
    axis_name=axis_name,
    config=_config.Config(damping_mode="factored_equal"),
  )


def _fading_damping(decay: float, floor: float) -> Callable[[Array], Array]:
  """λ at update k (from 0): `2 ((ρ^(k+1) + floor) / (1 − ρ^(k+1)))²`, ρ = `decay`."""

  def schedule(count):
    r = jnp.asarray(decay, jnp.result_type(float)) ** (count + 1)
    return 2 * ((r + floor) / (1 - r)) ** 2

  return schedule


def _identity_start(decay: float, momentum: float) -> optax.GradientTransformation:
  """`m ← v / (1 − ρ^(k+1))² + μ m` at update k (from 0)."""

  def weight(count):
    return 1 / (1 - jnp.asarray(decay, jnp.result_type(float)) ** (count + 1)) ** 2

  return optax.chain(optax.scale_by_schedule(weight), optax.trace(decay=momentum))
