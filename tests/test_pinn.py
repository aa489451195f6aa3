"""kfac_jax.pinn: the forward-mode operators against `jax.hessian` (float64), the layers K-FAC
finds through them, the grid line search alone and inside `kfac(linesearch=...)`, and the
Optimizer preset on a tiny PINN."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import kfac_jax
from kfac_jax import pinn
from tests import _models


def _params(key, sizes=(3, 6, 1)):
  return _models.pinn_mlp_init(key, sizes)


@jax.jit  # A nested jit: the operators follow it inside.
def _mixed(h):
  """Elementwise functions, custom derivatives (softplus, gelu), products of two point-dependent
  operands, a clipped branch."""
  return (
    jnp.sin(h) * jnp.exp(-(h**2))
    + jax.nn.softplus(h)
    + jax.nn.gelu(h)
    + h * h / (1 + h**2)
    + jnp.maximum(h, 0.1) ** 3
  )


def _u(params):
  """One point [3] -> a scalar: a dense layer, `_mixed`, a concatenation with the point, sums,
  products and a norm of the point."""

  def u(y):
    h = _mixed(y @ params[0]["w"] + params[0]["b"])
    h = jnp.concatenate([h, y])
    return (
      jnp.tanh(h[:6]) @ params[1]["w"][:, 0] + jnp.sum(h[6:] ** 2) * y[0] + jnp.prod(y)
    ) + jnp.linalg.norm(y)

  return u


@jax.jit
def _exact(params, x, a, b, c):
  """`Σ a_ij ∂_ij u + b·∇u + c u` per point, from `jax.hessian` and `jax.grad`."""
  u = _u(params)
  return jax.vmap(lambda y: jnp.sum(a * jax.hessian(u)(y)) + b @ jax.grad(u)(y) + c * u(y))(x)


def _problem():
  params = _params(jax.random.key(0))
  x = jax.random.uniform(jax.random.key(1), (5, 3), jnp.float64)
  return params, x


def _linesearch_step(reg, tx, loss_fn, batch):
  """A jitted step of a K-FAC chain with a line search: `(params, state) -> (params, state,
  loss)`."""

  @jax.jit
  def step(params, state):
    value, grads, stats = kfac_jax.value_and_grad(registration=reg)(params, batch, None)
    value_fn = lambda p: loss_fn(p, batch)  # noqa: E731
    updates, state = tx.update(
      grads, state, params, curvature_stats=stats, value=value, grad=grads, value_fn=value_fn
    )
    return optax.apply_updates(params, updates), state, value

  return step


def test_laplacian_equals_the_trace_of_the_hessian(x64):
  params, x = _problem()
  lap = jax.jit(lambda p, x: pinn.laplacian(_u(p), x))(params, x)
  expected = _exact(params, x, jnp.eye(3), jnp.zeros(3), 0.0)
  assert lap.shape == (5,) and lap.dtype == jnp.float64
  np.testing.assert_allclose(lap, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
  "a, b, c",
  [
    ("general", True, 0.3),  # not symmetric, indefinite: its symmetric part's eigenvectors
    ("diagonal", True, None),  # the heat equation's kind: the axes, one of them dropped
    ("low_rank", False, None),  # rank 1: one tangent channel
    (None, True, -1.5),  # no second-order term: no tangent channel
  ],
)
def test_differential_operator_equals_hessian_and_gradient(x64, a, b, c):
  params, x = _problem()
  rng = np.random.default_rng(0)
  coef_a = {
    "general": rng.normal(size=(3, 3)),
    "diagonal": np.diag([0.0, -0.25, 2.0]),
    "low_rank": np.outer([1.0, -2.0, 0.5], [1.0, -2.0, 0.5]),
    None: None,
  }[a]
  coef_b = rng.normal(size=3) if b else None
  out = jax.jit(lambda p, x: pinn.differential_operator(_u(p), x, coef_a, coef_b, c))(params, x)
  expected = _exact(
    params,
    x,
    np.zeros((3, 3)) if coef_a is None else coef_a,
    np.zeros(3) if coef_b is None else coef_b,
    0.0 if c is None else c,
  )
  np.testing.assert_allclose(out, expected, rtol=1e-12, atol=1e-12)


def _poisson_loss(operator):
  """A residual on interior points and the values on boundary points, each tagged."""

  def loss_fn(params, batch):
    x = batch["x"]
    r = (operator(lambda y: _models.pinn_mlp(params, y), x) + jnp.sin(x[:, 0]))[:, None]
    kfac_jax.register_normal_predictive_distribution(r, var=1.0)
    ub = _models.pinn_mlp(params, batch["xb"])[:, None]
    kfac_jax.register_normal_predictive_distribution(ub, var=1.0)
    return 0.5 * jnp.mean(r**2) + 0.5 * jnp.mean(ub**2)

  return loss_fn


def _batch(d, n=8, nb=4):
  return {
    "x": jax.random.uniform(jax.random.key(5), (n, d), jnp.float64),
    "xb": jax.random.uniform(jax.random.key(6), (nb, d), jnp.float64),
  }


@pytest.mark.parametrize(
  "name, operator, tangents",
  [
    ("laplacian", pinn.laplacian, 2),
    (  # u_t − u_xx / 4 on (t, x): one tangent channel.
      "heat",
      lambda u, x: pinn.differential_operator(u, x, np.diag([0.0, -0.25]), np.array([1.0, 0.0])),
      1,
    ),
  ],
)
def test_every_layer_is_one_dense_layer_shared_by_the_channels(x64, name, operator, tangents):
  """Each layer is applied to the points (with its bias), to the tangents and to the
  second-order channel (without it), batched over the points: one dense layer per kernel, the
  two loss terms one Kronecker product each; nothing left to a diagonal block."""
  del name
  params, batch = _params(jax.random.key(2), (2, 5, 1)), _batch(2)
  loss_fn = _poisson_loss(operator)
  reg = kfac_jax.Registration(loss_fn, params, batch, estimation_mode="exact_GGN")
  (first, last) = reg.layers
  assert (first.kind, first.approx, first.param_paths) == ("dense", "kron_terms", ("0/w", "0/b"))
  assert (last.kind, last.approx, last.param_paths) == ("dense", "kron_terms", ("1/w", "1/b"))
  # The interior value, each tangent channel, the second-order channel; the boundary value.
  assert [u.adds_bias for u in first.use_infos] == [True, False, False, True]
  assert first.factor_shapes[0] == (2, 3, 3)
  # Only the second-order channel of the output layer reaches the residual.
  assert [u.adds_bias for u in last.use_infos] == [False, True]
  report = kfac_jax.summary(registration=reg)
  assert "hold 21 of 21 parameters (100.0%)" in report
  # Each tangent channel is a row per point: the tangents' A rows are `[v_k, 0]`.
  est = kfac_jax.CurvatureEstimator(registration=reg)
  state = jax.jit(lambda p: est.update_curvature(est.init(p), p, batch, None, ema_decay=0.0))(
    params
  )
  a_interior = np.asarray(state.factors["0"].a[0])  # [x, 1] rows, tangents, second channel.
  n = batch["x"].shape[0]
  assert a_interior[2, 2] == pytest.approx(n / (n * (tangents + 2)))


@pytest.mark.parametrize(
  "call, error, says",
  [
    (lambda u, x: pinn.laplacian(u, x[0]), ValueError, "must be the points, a float array"),
    (lambda u, x: pinn.laplacian(lambda y: jnp.stack([u(y), u(y)]), x), ValueError, "got [((2,)"),
    (lambda u, x: pinn.laplacian(u, x.astype(jnp.int32)), ValueError, "dtype int32"),
    (lambda u, x: pinn.differential_operator(u, x, np.eye(2)), ValueError, "shape (3, 3)"),
    (lambda u, x: pinn.differential_operator(u, x, None, [1.0]), ValueError, "`b` must have"),
    (lambda u, x: pinn.differential_operator(u, x, None, None, [1.0]), ValueError, "`c` must"),
    (lambda u, x: pinn.laplacian(3.0, x), TypeError, "must be a function of one point"),
  ],
)
def test_bad_arguments_are_named(x64, call, error, says):
  params, x = _problem()
  with pytest.raises(error, match=None) as info:
    call(_u(params), x)
  assert says in str(info.value)


def test_a_traced_coefficient_says_how_to_make_it_constant(x64):
  params, x = _problem()

  @jax.jit
  def residual(x):
    return pinn.differential_operator(_u(params), x, jnp.diag(jnp.array([1.0, 0.0, 2.0])))

  with pytest.raises(TypeError, match=r"`a` must be a constant known while tracing.*np\.diag"):
    residual(x)


# ==============================================================================================
# The grid line search.


def test_grid_linesearch_takes_the_grid_point_of_lowest_loss(x64):
  """Against the losses on the grid computed one by one; no step when every point is worse;
  a non-finite loss never wins; `value_fn`'s keyword arguments are passed on (`grad=` not)."""
  ls = pinn.grid_linesearch(max_halvings=12)
  target = jnp.array([0.3, -0.1])

  def value_fn(p, *, scale):
    loss = scale * jnp.sum((p["x"] - target) ** 2)
    return jnp.where(jnp.abs(p["x"][0] - 0.3) < 1e-9, jnp.nan, loss)  # NaN at the target.

  params, direction = {"x": jnp.zeros(2)}, {"x": jnp.array([0.9, -0.2])}
  kw = dict(value_fn=value_fn, grad=direction, scale=2.0)

  @jax.jit
  def update(direction, params):
    value = value_fn(params, scale=2.0)
    return ls.update(direction, ls.init(params), params, value=value, **kw)

  step, state = update(direction, params)
  grid = 2.0 ** -np.arange(13)
  losses = [
    2.0 * np.sum((eta * np.array([0.9, -0.2]) - np.array([0.3, -0.1])) ** 2) for eta in grid
  ]
  best = grid[int(np.argmin(losses))]
  assert best == 0.25 and float(state.learning_rate) == best
  np.testing.assert_array_equal(step["x"], best * direction["x"])
  # Pointing away: every grid point raises the loss, so no step.
  step, state = update(jax.tree_util.tree_map(jnp.negative, direction), params)
  assert float(state.learning_rate) == 0.0 and not np.any(np.asarray(step["x"]))
  # Straight to the target: the step 1 would be best, but its loss is NaN.
  step, state = update({"x": target}, params)
  assert float(state.learning_rate) == 0.5


def test_grid_linesearch_rejects_a_bad_grid():
  for bad in (-1, 2.5, True):
    with pytest.raises(ValueError, match="max_halvings must be an integer >= 0"):
      pinn.grid_linesearch(bad)


def test_grid_linesearch_inside_kfac_in_a_jitted_step(x64):
  """`kfac(linesearch=grid_linesearch())`: each jitted step lowers the loss by a step size from
  the grid; the second step runs the same program."""
  params, batch = _params(jax.random.key(2), (2, 5, 1)), _batch(2)
  loss_fn = _poisson_loss(pinn.laplacian)
  reg = kfac_jax.Registration(loss_fn, params, batch, estimation_mode="exact_GGN")
  tx = kfac_jax.kfac(
    registration=reg,
    linesearch=pinn.grid_linesearch(),
    momentum=None,
    max_norm=None,
    damping=1e-3,
    ema_decay=0.0,
    inverse_every=1,
    curvature_every=1,
  )

  step = _linesearch_step(reg, tx, loss_fn, batch)

  state = tx.init(params)
  losses, sizes = [], []
  for _ in range(3):
    params, state, value = step(params, state)
    losses.append(float(value))
    (ls_state,) = [s for s in jax.tree_util.tree_leaves(state, is_leaf=_is_grid) if _is_grid(s)]
    sizes.append(float(ls_state.learning_rate))
  losses.append(float(jax.jit(loss_fn)(params, batch)))
  assert step._cache_size() == 1
  assert all(s in 2.0 ** -np.arange(31) for s in sizes), sizes
  assert np.all(np.diff(losses) < 0), losses


def _is_grid(x):
  return isinstance(x, pinn.GridLinesearchState)


# ==============================================================================================
# The Optimizer preset.


def test_optimizer_preset_trains_a_tiny_pinn(x64):
  """The preset's settings, and five jitted steps that lower the loss without a rejected step."""
  params, batch = _params(jax.random.key(2), (2, 5, 1)), _batch(2)
  loss_fn = _poisson_loss(pinn.laplacian)
  opt = pinn.optimizer(loss_fn, params, batch)
  assert isinstance(opt, kfac_jax.Optimizer)
  state = opt.init(params)
  assert float(state.damping) == 0.5
  step = jax.jit(opt.step)
  loss0 = float(jax.jit(loss_fn)(params, batch))
  losses = []
  for i in range(5):
    params, state, info = step(params, state, batch, jax.random.key(i))
    losses.append(float(info["loss"]))
  final = float(jax.jit(loss_fn)(params, batch))
  assert losses[0] == pytest.approx(loss0)
  assert final < 0.5 * loss0, (loss0, losses, final)
  assert float(state.damping) < 0.5  # Adapted at every step, down while the model predicts.


def test_kfac_preset_fades_the_damping_and_weights_the_momentum(x64):
  """The damping `2 ((ρ^(k+1) + δ)/(1 − ρ^(k+1)))²` and the momentum `m ← v / (1 − ρ^(k+1))² + μ m`
  of identity-started factors (ρ = μ = 1/2, δ = 1e-12)."""
  schedule = pinn._fading_damping(0.5, 1e-12)
  np.testing.assert_allclose(
    [schedule(jnp.asarray(k)) for k in range(3)], [2 * (1 + 2e-12) ** 2, 2 / 9, 2 / 49]
  )
  start = pinn._identity_start(0.5, 0.5)
  params, direction = {"x": jnp.zeros(2)}, {"x": jnp.ones(2)}
  state, ms = start.init(params), []
  for _ in range(3):
    out, state = start.update(direction, state)
    ms.append(float(out["x"][0]))
  np.testing.assert_allclose(ms, [4.0, 4 + 16 / 9 - 2, 64 / 49 + 0.5 * (2 + 16 / 9)], rtol=1e-12)


def test_kfac_preset_trains_a_tiny_pinn(x64):
  """Three jitted steps of `pinn.kfac` lower the loss, each by a grid step; its arguments are
  checked before anything is built."""
  params, batch = _params(jax.random.key(2), (2, 5, 1)), _batch(2)
  loss_fn = _poisson_loss(pinn.laplacian)
  reg = kfac_jax.Registration(loss_fn, params, batch, estimation_mode="exact_GGN")
  tx = pinn.kfac(registration=reg)

  step = _linesearch_step(reg, tx, loss_fn, batch)

  state, losses = tx.init(params), []
  for _ in range(3):
    params, state, value = step(params, state)
    losses.append(float(value))
  losses.append(float(jax.jit(loss_fn)(params, batch)))
  assert np.all(np.diff(losses) < 0), losses
  for bad, says in ((dict(momentum=1.0), "`momentum` must be"), (dict(damping=-1.0), "`damping`")):
    with pytest.raises(ValueError, match=says):
      pinn.kfac(registration=reg, **bad)
  with pytest.raises(TypeError, match="pass `params` and `example_batch` with `loss_fn`"):
    pinn.optimizer(loss_fn)
  with pytest.raises(ValueError, match="not both"):
    pinn.kfac(loss_fn, params, batch, registration=reg)
