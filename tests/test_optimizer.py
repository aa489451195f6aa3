"""Tests for kfac_jax.Optimizer: the quadratic model against jax.hessian, damping adaptation,
one compilation across every period, bit-identical skipping, convergence, the optax form."""

# `check_loss=False` on the registrations the tests build (the Optimizer does not read the loss
# factor): the loss audit is tested in tests/test_audit.py and the zoo; here it would only
# compile another program.

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.flatten_util import ravel_pytree

import kfac_jax
from kfac_jax import _optimizer
from tests import _models


def _mlp_problem(dtype=jnp.float32, sizes=(4, 6, 3), n=32):
  params = _models.jnp_mlp_init(jax.random.key(0), sizes, dtype)
  batch = _models.classification_batch(
    jax.random.key(1), n=n, din=sizes[0], classes=sizes[-1], dtype=dtype
  )
  return params, batch, _models.softmax_loss(_models.jnp_mlp_apply)


def _run(opt, params, batch, steps, seed=2):
  state = jax.jit(opt.init)(params)  # Jitted: eager ops compile one by one.
  step = jax.jit(opt.step)
  rng = jax.random.key(seed)
  history = []
  for _ in range(steps):
    rng, sub = jax.random.split(rng)
    new_params, new_state, info = step(params, state, batch, sub)
    history.append((params, state, new_params, new_state, info))
    params, state = new_params, new_state
  return history


# --------------------------------------------------------------------------------------------
# The quadratic model.


def _ggn(loss_fn, apply_fn, params, batch):
  """Jᵀ H_z J from jax.jacobian / jax.hessian, on raveled params."""
  flat, unravel = ravel_pytree(params)
  logits = jax.jit(apply_fn)(params, batch["x"])
  jac = _models.jit_jacobian(lambda f: apply_fn(unravel(f), batch["x"]).ravel())(flat)

  def loss_of_logits(z):
    return optax.softmax_cross_entropy_with_integer_labels(
      z.reshape(logits.shape), batch["y"]
    ).mean()

  hz = _models.jit_hessian(loss_of_logits)(logits.ravel())
  jac = np.asarray(jac)  # The products on the host: eager ones would compile one by one.
  return jac.T @ np.asarray(hz) @ jac


@pytest.mark.parametrize(
  "sizes, momentum",
  [((4, 3), None), ((4, 5, 3), None), ((4, 3), 0.5)],
  ids=["linear", "mlp", "linear-fixed-momentum"],
)
def test_alpha_mu_match_closed_form_2x2(x64, sizes, momentum):
  """A loss with an L2 term `(η/2)‖θ‖²` and `l2_reg=η` (kfac-jax's meaning): the gradient is the
  loss's, the model's curvature `G + (λ + η) I`."""
  params, batch, loss_fn = _mlp_problem(jnp.float64, sizes)
  eta, lam = 0.01, 0.3
  tagged_loss = loss_fn

  def loss_fn(p, b):
    return tagged_loss(p, b) + 0.5 * eta * sum(jnp.sum(x**2) for x in jax.tree_util.tree_leaves(p))

  opt = kfac_jax.Optimizer(
    loss_fn,
    batch,
    damping=lam,
    use_adaptive_damping=False,
    l2_reg=eta,
    momentum=momentum,
    inverse_every=1,
  )
  (p0, _, p1, s1, i0), (_, _, p2, s2, i1) = _run(opt, params, batch, 2)

  # First step: δ_prev = 0, so the 1-D solve: α = −∇hᵀΔ / ΔᵀĜΔ (and μ = 0 unless fixed).
  assert float(i0["momentum"]) == (momentum or 0.0)
  flat0, unravel = ravel_pytree(p0)
  flat0, flat1 = np.asarray(flat0), np.asarray(ravel_pytree(p1)[0])  # Host arithmetic below.
  grad_h = jax.grad(lambda f: loss_fn(unravel(f), batch))

  curv = _ggn(tagged_loss, _models.jnp_mlp_apply, p1, batch)
  if len(sizes) == 2:
    # A linear model: the loss Hessian is the Gauss-Newton matrix plus the L2 term's η I.
    hess = _models.jit_hessian(lambda f: loss_fn(unravel(f), batch))(flat1)
    np.testing.assert_allclose(hess, curv + eta * np.eye(flat1.size), atol=1e-12)
  g_hat = np.asarray(curv) + (lam + eta) * np.eye(flat1.size)

  # Second step: Δ from the inverses in the returned state, δ_prev from the first step.
  g1 = np.asarray(jax.jit(grad_h)(flat1))  # One program each: eager ops compile one by one.
  precondition = jax.jit(
    lambda s, g: ravel_pytree(opt.estimator.multiply_matpower(s, unravel(g), -1))[0]
  )
  delta = -np.asarray(precondition(s2.curvature, g1))
  prev = ravel_pytree(s1.velocity)[0]
  np.testing.assert_allclose(prev, flat1 - flat0, rtol=1e-10, atol=1e-14)
  v = np.stack([delta, prev])
  c = v @ g_hat @ v.T
  b = v @ g1
  if momentum is None:
    x = np.linalg.solve(c, -b)
  else:  # α minimises the model with μ held: −(b_1 + μ C_12) / C_11.
    x = np.array([-(b[0] + momentum * c[0, 1]) / c[0, 0], momentum])
  np.testing.assert_allclose([i1["learning_rate"], i1["momentum"]], x, rtol=1e-7)
  np.testing.assert_allclose(i1["quad_model_change"], b @ x + 0.5 * x @ c @ x, rtol=1e-7)
  np.testing.assert_allclose(ravel_pytree(p2)[0], flat1 + x @ v, rtol=1e-9, atol=1e-12)
  assert abs(x[1]) > 1e-4  # The momentum term really is used.


def test_one_linearisation_two_heads_aux_and_rho(x64):
  """The step's single linearisation serves the gradient, the model's J v products and the aux,
  with two loss tags: α, μ, M(δ) and ρ equal the exact float64 values (jax.jacobian/hessian
  of the two heads, the loss re-evaluated at θ + δ)."""
  normal = functools.partial(_models.normal, dtype=jnp.float64, scale=0.5)
  params = {
    "h": {"w": normal(31, (4, 5)), "b": jax.device_put(np.zeros(5, np.float64))},
    "c": {"w": normal(32, (5, 3))},
    "r": {"w": normal(33, (5, 2))},
  }
  batch = _models.classification_batch(34, n=12, din=4, classes=3, dtype=jnp.float64)
  batch["t"] = jax.device_put(np.sin(np.asarray(batch["x"])[:, :2]))

  def heads(p, x):
    h = jnp.tanh(x @ p["h"]["w"] + p["h"]["b"])
    return h @ p["c"]["w"], h @ p["r"]["w"]

  def loss_of(z1, z2, b):
    ce = optax.softmax_cross_entropy_with_integer_labels(z1, b["y"]).mean()
    return ce + ((z2 - b["t"]) ** 2).sum(-1).mean()

  def loss_fn(p, b):
    z1, z2 = heads(p, b["x"])
    kfac_jax.register_softmax_cross_entropy_loss(z1, b["y"])
    kfac_jax.register_squared_error_loss(z2, b["t"])
    return loss_of(z1, z2, b), {"z2_mean": z2.mean()}

  lam = 0.2
  cfg = kfac_jax.Config(damping_adaptation_interval=1)
  reg = kfac_jax.Registration(loss_fn, params, batch, has_aux=True, check_loss=False)
  opt = kfac_jax.Optimizer(registration=reg, damping=lam, inverse_every=1, config=cfg)
  (p0, _, p1, s1, i0), (_, _, p2, s2, i1) = _run(opt, params, batch, 2)
  # The references jitted (op by op, each primitive would compile on its own).
  z1, z2 = jax.jit(heads)(p1, batch["x"])
  np.testing.assert_allclose(i1["aux"]["z2_mean"], np.asarray(z2).mean(), rtol=1e-12)

  flat1, unravel = ravel_pytree(p1)
  flat1 = np.asarray(flat1)  # Host arithmetic below.
  jac = jax.jit(
    jax.jacobian(lambda f: jnp.concatenate([z.ravel() for z in heads(unravel(f), batch["x"])]))
  )
  j = jac(flat1)
  split = z1.size
  hz = jax.jit(
    jax.hessian(lambda z: loss_of(z[:split].reshape(z1.shape), z[split:].reshape(z2.shape), batch))
  )(np.concatenate([np.ravel(z1), np.ravel(z2)]))
  j = np.asarray(j)  # The products on the host: eager ones would compile one by one.
  g_hat = j.T @ np.asarray(hz) @ j + float(s1.damping) * np.eye(flat1.size)
  g1 = np.asarray(jax.jit(jax.grad(lambda f: loss_fn(unravel(f), batch)[0]))(flat1))
  precondition = jax.jit(
    lambda s, g: ravel_pytree(opt.estimator.multiply_matpower(s, unravel(g), -1))[0]
  )
  delta = -np.asarray(precondition(s2.curvature, g1))
  v = np.stack([delta, ravel_pytree(s1.velocity)[0]])
  c, b = v @ g_hat @ v.T, v @ g1
  x = np.linalg.solve(c, -b)
  model = b @ x + 0.5 * x @ c @ x
  np.testing.assert_allclose([i1["learning_rate"], i1["momentum"]], x, rtol=1e-7)
  np.testing.assert_allclose(i1["quad_model_change"], model, rtol=1e-7)
  np.testing.assert_allclose(ravel_pytree(p2)[0], flat1 + x @ v, rtol=1e-9, atol=1e-12)
  loss_at = jax.jit(lambda q: loss_fn(q, batch)[0])
  h = lambda q: float(loss_at(q))  # noqa: E731
  np.testing.assert_allclose(i1["rho"], (h(p2) - h(p1)) / model, rtol=1e-6)
  assert abs(x[1]) > 1e-3 and int(s2.skipped) == 0


def test_solve_quadratic_model_variants(x64):
  c = jnp.array([[2.0, 0.5], [0.5, 1.0]])
  b = jnp.array([-1.0, 0.3])
  alpha, mu, change = _optimizer.solve_quadratic_model(c, b)
  x = np.linalg.solve(c, -b)
  np.testing.assert_allclose([alpha, mu], x, rtol=1e-12)
  np.testing.assert_allclose(change, -0.5 * b @ np.linalg.solve(c, b), rtol=1e-12)
  assert float(mu) < 0  # The model's μ is not clipped to [0, 1) (the `momentum` docstring).
  # Fixed momentum: α minimises M with μ held.
  alpha, mu, _ = _optimizer.solve_quadratic_model(c, b, momentum=0.9)
  np.testing.assert_allclose(alpha, -(b[0] + 0.9 * c[0, 1]) / c[0, 0], rtol=1e-12)
  assert float(mu) == 0.9
  # Fixed learning rate: μ minimises M with α held.
  alpha, mu, _ = _optimizer.solve_quadratic_model(c, b, learning_rate=0.5)
  np.testing.assert_allclose(mu, -(b[1] + 0.5 * c[0, 1]) / c[1, 1], rtol=1e-12)
  # Both fixed: the model value of that step.
  _, _, change = _optimizer.solve_quadratic_model(c, b, 0.5, 0.2)
  xx = np.array([0.5, 0.2])
  np.testing.assert_allclose(change, b @ xx + 0.5 * xx @ c @ xx, rtol=1e-12)
  # δ_prev = 0 (first step) and δ_prev ∥ Δ (singular): the 1-D solve along Δ.
  for c2, b2 in (
    (jnp.array([[2.0, 0.0], [0.0, 0.0]]), jnp.array([-1.0, 0.0])),
    (jnp.array([[2.0, 4.0], [4.0, 8.0]]), jnp.array([-1.0, -2.0])),
  ):
    alpha, mu, change = _optimizer.solve_quadratic_model(c2, b2)
    assert float(alpha) == 0.5 and float(mu) == 0.0
    np.testing.assert_allclose(change, -0.25, rtol=1e-12)
  # Zero gradient and zero curvature: no step, not NaN.
  alpha, mu, change = _optimizer.solve_quadratic_model(jnp.zeros((2, 2)), jnp.zeros(2))
  assert float(alpha) == 0.0 and float(mu) == 0.0 and float(change) == 0.0


def test_linear_least_squares_lands_on_minimiser(x64):
  """Exact curvature of a dense layer with a normal loss is Kronecker: K-FAC = Newton."""
  rng = _models.np_rng(3)  # On the host: each eager op would compile a program of its own.
  x = rng.standard_normal((40, 5))
  y = x @ rng.standard_normal((5, 2)) + 0.3 * rng.standard_normal((40, 2)) + 1.0
  batch = jax.device_put({"x": x, "y": y})

  def loss_fn(params, batch):
    pred = batch["x"] @ params["w"] + params["b"]
    kfac_jax.register_squared_error_loss(pred, batch["y"])
    return jnp.mean(jnp.sum((pred - batch["y"]) ** 2, axis=-1))

  params = jax.device_put({"w": np.zeros((5, 2)), "b": np.zeros(2)})
  opt = kfac_jax.Optimizer(
    registration=kfac_jax.Registration(
      loss_fn, params, batch, estimation_mode="exact", check_loss=False
    ),
    damping=0.0,
    use_adaptive_damping=False,
  )
  state = jax.jit(opt.init)(params)  # Jitted: eager ops compile one by one.
  new_params, _, info = jax.jit(opt.step)(params, state, batch, None)
  xb = np.concatenate([x, np.ones((40, 1))], axis=1)
  sol = np.linalg.lstsq(xb, y, rcond=None)[0]
  np.testing.assert_allclose(new_params["w"], sol[:5], rtol=1e-9, atol=1e-10)
  np.testing.assert_allclose(new_params["b"], sol[5], rtol=1e-9, atol=1e-10)
  np.testing.assert_allclose(info["learning_rate"], 1.0, rtol=1e-9)
  assert float(info["momentum"]) == 0.0


def test_l2_reg_is_the_curvature_of_the_losss_l2_term(x64):
  """A script migrated from kfac-jax: the loss adds `(η/2)‖θ‖²` and `l2_reg=η` tells the
  optimizer its curvature η I, nothing more. On ridge regression (exact statistics and damping:
  K-FAC is Newton's method) one step from any θ lands on the ridge minimiser with α = 1 and
  ρ = 1; η counted twice (in the gradient, or in h for ρ) lands elsewhere."""
  rng = _models.np_rng(4)  # On the host: each eager op would compile a program of its own.
  x = rng.standard_normal((40, 5))
  y = x @ rng.standard_normal((5, 2)) + 0.3 * rng.standard_normal((40, 2)) + 1.0
  batch = jax.device_put({"x": x, "y": y})
  eta = 0.3

  def loss_fn(params, batch):
    pred = batch["x"] @ params["w"] + params["b"]
    kfac_jax.register_squared_error_loss(pred, batch["y"])
    l2 = sum(jnp.sum(p**2) for p in jax.tree_util.tree_leaves(params))
    return jnp.mean(jnp.sum((pred - batch["y"]) ** 2, axis=-1)) + 0.5 * eta * l2

  params = jax.device_put({"w": rng.standard_normal((5, 2)), "b": rng.standard_normal(2)})
  reg = kfac_jax.Registration(loss_fn, params, batch, estimation_mode="exact")
  cfg = kfac_jax.Config(damping_mode="eigen", damping_adaptation_interval=1)
  opt = kfac_jax.Optimizer(registration=reg, damping=1e-8, l2_reg=eta, config=cfg)
  state = jax.jit(opt.init)(params)  # Jitted: eager ops compile one by one.
  new_params, new_state, info = jax.jit(opt.step)(params, state, batch, None)

  # argmin (1/n) Σ ‖[x 1] θ − y‖² + (η/2)‖θ‖²  =  (2/n XᵀX + η I)⁻¹ (2/n) Xᵀy.
  xb = np.concatenate([x, np.ones((40, 1))], axis=1)
  ridge = np.linalg.solve(2 / 40 * xb.T @ xb + eta * np.eye(6), 2 / 40 * xb.T @ y)
  np.testing.assert_allclose(new_params["w"], ridge[:5], rtol=1e-6, atol=1e-8)
  np.testing.assert_allclose(new_params["b"], ridge[5], rtol=1e-6, atol=1e-8)
  np.testing.assert_allclose(info["learning_rate"], 1.0, rtol=1e-6)
  np.testing.assert_allclose(info["rho"], 1.0, rtol=1e-6)
  np.testing.assert_allclose(info["loss"], float(jax.jit(loss_fn)(params, batch)), rtol=1e-12)
  assert int(new_state.skipped) == 0
  (cache,) = new_state.curvature.cache.values()
  np.testing.assert_allclose(cache.damping, 1e-8 + eta)


# --------------------------------------------------------------------------------------------
# Damping, norm constraint, weight decay, schedules.


def test_adapt_damping_rule():
  adapt = functools.partial(_optimizer.adapt_damping, omega=0.5, min_damping=1e-3, max_damping=10.0)
  lam = jnp.asarray(1.0)
  assert float(adapt(lam, jnp.asarray(0.1))) == 2.0  # poor model: more damping
  assert float(adapt(lam, jnp.asarray(-jnp.inf))) == 2.0  # h(θ+δ) not finite
  assert float(adapt(lam, jnp.asarray(0.9))) == 0.5  # good model: less damping
  assert float(adapt(lam, jnp.asarray(0.5))) == 1.0
  assert float(adapt(lam, jnp.asarray(jnp.nan))) == 1.0
  assert float(adapt(jnp.asarray(8.0), jnp.asarray(0.0))) == 10.0  # clipped above
  assert float(adapt(jnp.asarray(1.5e-3), jnp.asarray(1.0))) == np.float32(1e-3)  # clipped below


def test_adaptive_damping_end_to_end():
  params, batch, loss_fn = _mlp_problem()
  cfg = kfac_jax.Config(damping_adaptation_interval=1, damping_adaptation_decay=0.5)

  # A term the model does not see (no loss tag on it): the model's step overshoots badly, the
  # reduction ratio is small (negative) and the damping doubles.
  def quartic_loss(p, b):
    return loss_fn(p, b) + sum(jnp.sum(x**4) for x in jax.tree_util.tree_leaves(p))

  opt = kfac_jax.Optimizer(quartic_loss, batch, damping=1e-2, config=cfg)
  ((_, _, _, s1, info),) = _run(opt, params, batch, 1)
  assert float(info["quad_model_change"]) < 0 and float(info["rho"]) < 0.25
  np.testing.assert_allclose(s1.damping, 2e-2, rtol=1e-6)
  # A fixed step so large that even the model goes up (M(δ) > 0): ρ = -inf (stored as the
  # lowest finite number, so the state stays finite), damping doubles.
  opt = kfac_jax.Optimizer(
    loss_fn, batch, learning_rate=50.0, momentum=0.0, damping=1e-2, config=cfg
  )
  ((_, _, _, s1, info),) = _run(opt, params, batch, 1)
  low = float(np.finfo(np.asarray(s1.rho).dtype).min)
  assert float(info["quad_model_change"]) > 0 and float(info["rho"]) == low == float(s1.rho)
  np.testing.assert_allclose(s1.damping, 2e-2, rtol=1e-6)
  # The model's own α on the tagged loss alone: ρ near 1 > 3/4, damping halves.
  opt = kfac_jax.Optimizer(loss_fn, batch, damping=1e-2, config=cfg)
  ((_, _, _, s1, info),) = _run(opt, params, batch, 1)
  assert 0.75 < float(info["rho"]) < 1.5
  np.testing.assert_allclose(s1.damping, 5e-3, rtol=1e-6)


def test_norm_constraint_caps_the_step():
  params, batch, loss_fn = _mlp_problem()
  c = 1e-4
  opt = kfac_jax.Optimizer(
    loss_fn,
    batch,
    learning_rate=10.0,
    momentum=0.0,
    damping=1e-2,
    use_adaptive_damping=False,
    norm_constraint=c,
  )
  ((p0, _, p1, s1, info),) = _run(opt, params, batch, 1)
  alpha = float(info["learning_rate"])
  assert alpha < 10.0

  @jax.jit  # One program: eager operations would compile one by one.
  def model_curvature(p1, p0, curvature, alpha):
    step = jax.tree_util.tree_map(lambda a, b: (a - b) / alpha, p1, p0)  # Δ
    return sum(
      jnp.vdot(a, b)
      for a, b in zip(
        jax.tree_util.tree_leaves(step),
        jax.tree_util.tree_leaves(opt.estimator.multiply_matpower(curvature, step, 1)),
      )
    )

  quad = model_curvature(p1, p0, s1.curvature, alpha)
  np.testing.assert_allclose(alpha**2 * quad, c, rtol=1e-3)


def test_weight_decay_l2_and_schedules(x64):
  params, batch, tagged_loss = _mlp_problem(jnp.float64)
  lr = lambda count: 0.1 / (1.0 + count)
  wd, eta, lam = 0.01, 0.05, 0.2

  def loss_fn(p, b):  # The L2 term `l2_reg` describes, in the loss (as with kfac-jax).
    return tagged_loss(p, b) + 0.5 * eta * sum(jnp.sum(x**2) for x in jax.tree_util.tree_leaves(p))

  opt = kfac_jax.Optimizer(
    registration=kfac_jax.Registration(
      loss_fn, params, batch, estimation_mode="exact", check_loss=False
    ),
    learning_rate=lr,
    momentum=0.0,
    damping=lambda count: lam + 0 * count,
    use_adaptive_damping=False,
    l2_reg=eta,
    inverse_every=1,
    config=kfac_jax.Config(weight_decay=wd),
  )
  history = _run(opt, params, batch, 2)

  @jax.jit  # One program for the expected step: eager operations would compile one by one.
  def expected(p0, curvature, lr):
    delta = opt.estimator.multiply_matpower(curvature, jax.grad(loss_fn)(p0, batch), -1)
    return jax.tree_util.tree_map(lambda p, d: p - lr * d - wd * p, p0, delta)

  for t, (p0, _, p1, s1, info) in enumerate(history):
    np.testing.assert_allclose(info["learning_rate"], 0.1 / (1 + t))
    np.testing.assert_allclose(info["damping"], lam)
    expect = expected(p0, s1.curvature, 0.1 / (1 + t))
    for a, b in zip(jax.tree_util.tree_leaves(p1), jax.tree_util.tree_leaves(expect)):
      np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-14)
    np.testing.assert_allclose(s1.curvature.cache["layer0"].damping, lam + eta)


# --------------------------------------------------------------------------------------------
# One program, skipping, convergence, optax form, pmap.


def test_thirty_steps_compile_once():
  params, batch, loss_fn = _mlp_problem()
  traces = []

  def counted_loss(p, b):
    traces.append(1)
    return loss_fn(p, b)

  cfg = kfac_jax.Config(burn_in_steps=3, damping_adaptation_interval=5)
  opt = kfac_jax.Optimizer(
    counted_loss, batch, damping=0.1, inverse_every=4, curvature_every=2, config=cfg
  )
  state = jax.jit(opt.init)(params)  # Jitted: eager ops compile one by one.
  n_init = len(traces)
  step_traces = []

  def counted_step(*args):
    step_traces.append(1)
    return opt.step(*args)

  step = jax.jit(counted_step)
  rng = jax.random.key(0)
  dampings, changed = [], []
  for _ in range(30):
    rng, sub = jax.random.split(rng)
    new_params, state, _ = step(params, state, batch, sub)
    changed.append(
      not all(
        np.array_equal(a, b)
        for a, b in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(new_params))
      )
    )
    params = new_params
    dampings.append(float(state.damping))
  assert len(step_traces) == 1  # Traced, hence compiled, once.
  n_traces = len(traces) - n_init
  # `step` does not trace loss_fn: it reuses the graph `init` scanned (kfac_jax.Registration).
  assert n_traces == 0, n_traces
  assert changed == [False] * 3 + [True] * 27  # burn-in, then real steps
  assert len(set(dampings)) > 3  # adapted several times
  assert int(state.step) == 30 and int(state.skipped) == 0
  # Statistics on the 3 burn-in steps and on every 2nd step after (k_run = 0, 2, ..., 26).
  np.testing.assert_allclose(state.curvature.ema_weight, sum(0.95**j for j in range(17)), rtol=1e-6)
  # The last inverse update was at k_run = 24 (step 27), with the damping of that step.
  cache_damping = float(state.curvature.cache["layer0"].damping)
  np.testing.assert_allclose(cache_damping, dampings[26], rtol=1e-6)
  assert cache_damping != dampings[-1]  # adapted at step 28 (k_run = 25), after it


def test_nan_batch_leaves_everything_bit_identical():
  params, batch, loss_fn = _mlp_problem()
  opt = kfac_jax.Optimizer(
    loss_fn,
    batch,
    damping=0.1,
    inverse_every=2,
    config=kfac_jax.Config(damping_adaptation_interval=1, step_warnings=True),
  )
  history = _run(opt, params, batch, 3)
  params, state = history[-1][2], history[-1][3]
  bad_x = np.array(batch["x"])  # On the host: an eager `.at[].set` compiles programs of its own.
  bad_x[3, 1] = np.nan
  bad = dict(batch, x=jax.device_put(bad_x))
  with pytest.warns(kfac_jax.NonFiniteWarning, match="Optimizer: the gradient is not finite at"):
    new_params, new_state, info = jax.jit(opt.step)(params, state, bad, jax.random.key(9))
    jax.effects_barrier()
  assert bool(info["skipped"])
  for a, b in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(new_params)):
    assert np.array_equal(a, b)
  # Every leaf of the state, counters included; only `skipped` (not compared here) moves.
  old = state._replace(skipped=None)
  new = new_state._replace(skipped=None)
  old_leaves, old_def = jax.tree_util.tree_flatten(old)
  new_leaves, new_def = jax.tree_util.tree_flatten(new)
  assert old_def == new_def
  for a, b in zip(old_leaves, new_leaves):
    assert np.array_equal(a, b, equal_nan=True)
  assert int(new_state.skipped) == int(state.skipped) + 1 == 1
  # Training continues from there.
  _, s2, info2 = jax.jit(opt.step)(new_params, new_state, batch, jax.random.key(9))
  assert not bool(info2["skipped"]) and int(s2.step) == int(state.step) + 1


@pytest.mark.parametrize("every", [1, 2])
def test_statistics_on_every_step_are_pulled_back_outside_the_guard(every):
  """With `curvature_every=1` the statistics (their sampled targets and pull-back) are formed
  outside the guard's cond, only folded inside it (XLA:CPU runs the pull-back through
  convolutions far slower inside a cond branch); with a period they stay in the branch, so
  that other steps skip them."""
  params, batch, loss_fn = _mlp_problem()
  opt = kfac_jax.Optimizer(loss_fn, batch, damping=0.1, curvature_every=every)
  state = jax.eval_shape(opt.init, params)  # Traced, not compiled: the jaxpr needs its layout.
  jaxpr = jax.make_jaxpr(opt.step)(params, state, batch, jax.random.key(0)).jaxpr
  assert _models.sampling_inside_conds(jaxpr) == (every != 1)


def test_converges_with_adaptive_everything():
  params, batch, loss_fn = _mlp_problem(sizes=(4, 16, 3), n=64)
  opt = kfac_jax.Optimizer(
    loss_fn,
    batch,
    damping=1.0,
    inverse_every=3,
    config=kfac_jax.Config(damping_adaptation_interval=3),
  )
  history = _run(opt, params, batch, 40)
  losses = [float(h[4]["loss"]) for h in history]
  assert losses[-1] < 0.5 * losses[0], losses
  assert not any(bool(h[4]["skipped"]) for h in history)
  assert float(history[-1][3].damping) < 1.0  # the damping came down


def test_optax_form_matches_class_form():
  params, batch, loss_fn = _mlp_problem()
  opt = kfac_jax.Optimizer(
    loss_fn,
    batch,
    damping=0.1,
    inverse_every=2,
    config=kfac_jax.Config(damping_adaptation_interval=2),
  )
  history = _run(opt, params, batch, 4)
  tx = opt.as_optax()
  state = tx.init(params)

  @jax.jit
  def optax_step(p, s, b, rng):
    updates, s = tx.update(None, s, p, batch=b, rng=rng)
    return optax.apply_updates(p, updates), s

  rng = jax.random.key(2)
  p = params
  for _, _, p_ref, s_ref, info in history:
    rng, sub = jax.random.split(rng)
    p, state = optax_step(p, state, batch, sub)
    for a, b in zip(jax.tree_util.tree_leaves(p), jax.tree_util.tree_leaves(p_ref)):
      assert np.array_equal(a, b)
    np.testing.assert_array_equal(state.optimizer.damping, s_ref.damping)
    np.testing.assert_array_equal(state.info["learning_rate"], info["learning_rate"])


def test_pmap_matches_single_device(x64):
  if jax.device_count() < 2:
    pytest.skip("needs 2 devices")
  params, batch, loss_fn = _mlp_problem(jnp.float64, n=16)
  kw = dict(
    damping=0.1,
    inverse_every=1,
    config=kfac_jax.Config(damping_adaptation_interval=1),
  )
  reg = kfac_jax.Registration(loss_fn, params, batch, estimation_mode="exact", check_loss=False)
  single = kfac_jax.Optimizer(registration=reg, **kw)
  ((_, _, p_ref, s_ref, i_ref),) = _run(single, params, batch, 1)

  shards = jax.tree_util.tree_map(  # On the host: eager reshapes compile one by one.
    lambda x: jax.device_put(np.asarray(x).reshape((2, -1) + x.shape[1:])), batch
  )
  half = jax.tree_util.tree_map(lambda x: jax.device_put(np.asarray(x)[0]), shards)
  reg_half = kfac_jax.Registration(loss_fn, params, half, estimation_mode="exact", check_loss=False)
  multi = kfac_jax.Optimizer(registration=reg_half, axis_name="d", **kw)
  state = jax.jit(multi.init)(params)  # Jitted: eager ops compile one by one.
  rep = jax.jit(lambda t: jax.tree_util.tree_map(lambda x: jnp.stack([x, x]), t))
  p, s, info = jax.pmap(lambda p, s, b: multi.step(p, s, b, None), axis_name="d")(
    rep(params), rep(state), shards
  )
  # Indexed on the host: eager slices of the pmapped results would compile one by one.
  for a, b in zip(jax.tree_util.tree_leaves(p), jax.tree_util.tree_leaves(p_ref)):
    np.testing.assert_allclose(np.asarray(a)[0], b, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(np.asarray(a)[1], b, rtol=1e-9, atol=1e-12)
  for k in ("loss", "learning_rate", "rho", "quad_model_change"):
    np.testing.assert_allclose(np.asarray(info[k])[0], i_ref[k], rtol=1e-8)
  np.testing.assert_allclose(np.asarray(s.damping)[0], s_ref.damping)


# --------------------------------------------------------------------------------------------
# Argument validation.


@pytest.mark.parametrize(
  "kwargs, match",
  [
    (dict(learning_rate=-0.1), "`learning_rate`"),
    (dict(learning_rate=float("nan")), "`learning_rate`"),
    (dict(momentum=1.5), "`momentum`"),
    (dict(damping=float("nan")), "`damping`"),
    (dict(damping=-1.0, use_adaptive_damping=False), "`damping`"),
    (dict(damping=lambda c: 1.0), "`damping` is a schedule"),
    (dict(l2_reg=-1e-3), "`l2_reg`"),
    (dict(norm_constraint=1e-3), "`norm_constraint`"),
    (dict(learning_rate=0.1, norm_constraint=0.0), "`norm_constraint`"),
    (dict(inverse_every=0), "`inverse_every`"),
    (dict(curvature_every=2.5), "`curvature_every`"),
    (dict(damping=1e-9), "config.min_damping"),
    (dict(ema_decay=1.0), "`ema_decay`"),
  ],
)
def test_invalid_arguments_are_named(kwargs, match):
  _, batch, loss_fn = _mlp_problem()
  with pytest.raises(ValueError, match=match):
    kfac_jax.Optimizer(loss_fn, batch, **_models.with_config(kwargs))


@pytest.mark.parametrize(
  "kwargs, match",
  [
    (dict(damping_adaptation_interval=0), "config.damping_adaptation_interval"),
    (dict(damping_adaptation_decay=1.0), "config.damping_adaptation_decay"),
    (dict(min_damping=1.0, max_damping=0.5), "config.max_damping"),
    (dict(burn_in_steps=-1), "config.burn_in_steps"),
    (dict(weight_decay=float("inf")), "config.weight_decay"),
  ],
)
def test_invalid_config_is_named(kwargs, match):
  with pytest.raises(ValueError, match=match):
    kfac_jax.Config(**kwargs)


def test_unknown_keyword_and_bad_types():
  params, batch, loss_fn = _mlp_problem()
  with pytest.raises(TypeError, match="learning_rte"):
    kfac_jax.Optimizer(loss_fn, batch, learning_rte=0.1)
  with pytest.raises(TypeError, match="positional"):
    kfac_jax.Optimizer(loss_fn, batch, 0.1)
  with pytest.raises(TypeError, match="`config`"):
    kfac_jax.Optimizer(loss_fn, batch, config={"ema_decay": 0.9})
  with pytest.raises(TypeError, match="`axis_name`"):
    kfac_jax.Optimizer(loss_fn, batch, axis_name=3)
  tx = kfac_jax.Optimizer(loss_fn, batch).as_optax()
  with pytest.raises(ValueError, match="batch="):
    tx.update(None, jax.jit(tx.init)(params), params)


# --------------------------------------------------------------------------------------------
# Training loops that pass their own hyperparameters and check or save the whole state.


@pytest.mark.parametrize("adaptive", [True, False])
def test_state_is_finite_from_init(adaptive):
  """Every leaf of the state is finite from `init` on (a loop may assert it every step)."""
  params, batch, loss_fn = _mlp_problem()
  opt = kfac_jax.Optimizer(
    loss_fn, batch, learning_rate=0.1, momentum=0.0, use_adaptive_damping=adaptive
  )
  init = jax.jit(opt.init)(params)  # Jitted: eager ops compile one by one.
  for state in [init] + [h[3] for h in _run(opt, params, batch, 2)]:
    assert all(bool(np.isfinite(x).all()) for x in jax.tree_util.tree_leaves(state))


def test_per_step_hyperparameters_match_fixed_ones(x64):
  """`step(..., learning_rate=, momentum=, damping=)` (traced values, as a loop computing them
  passes them) equals an optimizer built with those values."""
  params, batch, loss_fn = _mlp_problem(jnp.float64)
  fixed = kfac_jax.Optimizer(
    loss_fn, batch, learning_rate=0.2, momentum=0.3, damping=1e-2, use_adaptive_damping=False
  )
  loose = kfac_jax.Optimizer(loss_fn, batch, use_adaptive_damping=False)
  step = jax.jit(
    lambda p, s, b, r, lr, mu, lam: loose.step(
      p, s, b, r, learning_rate=lr, momentum=mu, damping=lam
    )
  )
  want = _run(fixed, params, batch, 2)
  p, s = params, jax.jit(loose.init)(params)
  rng = jax.random.key(2)
  for old in want:
    rng, sub = jax.random.split(rng)
    p, s, info = step(p, s, batch, sub, 0.2, 0.3, 1e-2)
    np.testing.assert_allclose(ravel_pytree(p)[0], ravel_pytree(old[2])[0], rtol=1e-10)
    assert float(info["damping"]) == 1e-2 and float(info["momentum"]) == pytest.approx(0.3)


def test_per_step_damping_needs_fixed_damping():
  params, batch, loss_fn = _mlp_problem()
  opt = kfac_jax.Optimizer(loss_fn, batch)
  with pytest.raises(ValueError, match="use_adaptive_damping=False"):
    opt.step(params, jax.jit(opt.init)(params), batch, jax.random.key(0), damping=1e-3)
  opt = kfac_jax.Optimizer(loss_fn, batch, use_adaptive_damping=False)
  with pytest.raises(ValueError, match="`momentum` must be a scalar"):
    opt.step(params, jax.jit(opt.init)(params), batch, jax.random.key(0), momentum=jnp.ones(2))


def test_state_saved_as_numpy_object_array_restores(tmp_path):
  """FermiNet's checkpoint: `np.savez(opt_state=np.asarray(opt_state, dtype=object))`, read
  back and rebuilt with `restore_state`; the run continues bit-for-bit."""
  params, batch, loss_fn = _mlp_problem()
  opt = kfac_jax.Optimizer(loss_fn, batch, learning_rate=0.1, momentum=0.5)
  (h,) = _run(opt, params, batch, 1)
  path = tmp_path / "ckpt.npz"
  np.savez(path, opt_state=np.asarray(h[3], dtype=object))
  saved = np.load(path, allow_pickle=True)["opt_state"]
  template = jax.jit(opt.init)(params)  # Jitted: eager ops compile one by one.
  restored = kfac_jax.restore_state(template, saved)
  assert type(restored) is kfac_jax.OptimizerState
  step = jax.jit(opt.step)
  a = step(h[2], h[3], batch, jax.random.key(5))
  b = step(h[2], restored, batch, jax.random.key(5))
  for x, y in zip(jax.tree_util.tree_leaves(a[:2]), jax.tree_util.tree_leaves(b[:2])):
    assert np.array_equal(x, y)
  with pytest.raises(ValueError, match="holds 2 arrays"):
    kfac_jax.restore_state(template, [np.zeros(1), np.zeros(2)])
