"""`scale_by_kernel_ngd` and `kernel_ngd`: the fronts against the explicit damped natural
gradient `(JᵀJ/N + λI)⁻¹ g` in float64, SPRING's recursion, the guard, and their errors. The
numerics of the rows and the solve are in test_kernel.py."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.flatten_util import ravel_pytree

import kfac_jax
from tests import _models


def _problem(n_in=6, n_bd=3, dtype=jnp.float64):
  """Two squared-error terms of different sizes (a PINN-like interior and boundary) on a
  2-8-1 tanh MLP (33 params > 9 rows: sample space)."""
  rng = _models.np_rng(0)
  params = {
    "w1": jnp.asarray(rng.standard_normal((2, 8)) / np.sqrt(2), dtype),
    "b1": jnp.asarray(0.1 * rng.standard_normal(8), dtype),
    "w2": jnp.asarray(rng.standard_normal((8, 1)) / np.sqrt(8), dtype),
    "b2": jnp.zeros(1, dtype),
  }
  batch = {
    "interior": jnp.asarray(rng.uniform(-1, 1, (n_in, 2)), dtype),
    "boundary": jnp.asarray(rng.uniform(-1, 1, (n_bd, 2)), dtype),
  }

  def net(p, x):
    return jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]

  def loss_fn(p, b):
    u_in, u_bd = net(p, b["interior"]), net(p, b["boundary"])
    t_in = jnp.sin(b["interior"].sum(-1, keepdims=True))
    kfac_jax.register_squared_error_loss(u_in, t_in)
    kfac_jax.register_squared_error_loss(u_bd, jnp.zeros_like(u_bd))
    return jnp.mean((u_in - t_in) ** 2) + jnp.mean(u_bd**2)

  return loss_fn, params, batch, net


def _reference(loss_fn, net, params, batch, damping, prev=None, momentum=0.0):
  """(F + λI)⁻¹(g + λμ φ), F = Σ_ℓ J_ℓᵀ J_ℓ / N_ℓ (each term's Fisher: unit variance
  for `register_squared_error_loss`'s normal with variance 1/2, doubled)."""
  flat, unravel = ravel_pytree(params)
  f = 0
  for key in ("interior", "boundary"):
    j = np.asarray(jax.jacobian(lambda v, k=key: net(unravel(v), batch[k])[:, 0])(flat))
    f = f + 2 * j.T @ j / j.shape[0]
  g = np.asarray(ravel_pytree(jax.grad(loss_fn)(params, batch))[0])
  rhs = g if prev is None else g + damping * momentum * np.asarray(ravel_pytree(prev)[0])
  return np.linalg.solve(f + damping * np.eye(f.shape[0]), rhs)


def _steps(tx, loss_fn, params, batch, n, apply=False):
  @jax.jit
  def step(p, s):
    g = jax.grad(loss_fn)(p, batch)
    u, s = tx.update(g, s, p, batch=batch)
    return (optax.apply_updates(p, u) if apply else p), s, u

  state = jax.jit(tx.init)(params)
  out = []
  for _ in range(n):
    params, state, u = step(params, state)
    out.append((params, state, u))
  return out


def test_scale_by_kernel_ngd_is_the_damped_natural_gradient(x64):
  loss_fn, params, batch, net = _problem()
  tx = kfac_jax.scale_by_kernel_ngd(loss_fn, batch, damping=1e-3)
  ((_, state, u),) = _steps(tx, loss_fn, params, batch, 1)
  want = _reference(loss_fn, net, params, batch, 1e-3)
  np.testing.assert_allclose(ravel_pytree(u)[0], want, rtol=1e-9)
  assert int(state.count) == 1 and int(state.skipped) == 0
  assert float(state.curvature.info["kernel_rank"]) == 9  # One row per point, N < P.


def test_spring_momentum_follows_its_recursion(x64):
  """Three updates at fixed params: φ_k = (F + λI)⁻¹(g + λμ φ_{k−1})."""
  loss_fn, params, batch, net = _problem()
  tx = kfac_jax.scale_by_kernel_ngd(loss_fn, batch, damping=1e-2, momentum=0.9)
  prev = None
  for _, _, u in _steps(tx, loss_fn, params, batch, 3):
    want = _reference(loss_fn, net, params, batch, 1e-2, prev, 0.9)
    np.testing.assert_allclose(ravel_pytree(u)[0], want, rtol=1e-9)
    prev = u


def test_kernel_ngd_steps_minus_alpha_phi_and_caps_the_norm(x64):
  loss_fn, params, batch, net = _problem()
  want = _reference(loss_fn, net, params, batch, 1e-3)
  tx = kfac_jax.kernel_ngd(loss_fn, batch, learning_rate=0.25, damping=1e-3)
  ((_, _, u),) = _steps(tx, loss_fn, params, batch, 1)
  np.testing.assert_allclose(ravel_pytree(u)[0], -0.25 * want, rtol=1e-9)
  c = 0.01 * float(np.sum((0.25 * want) ** 2))
  tx = kfac_jax.kernel_ngd(loss_fn, batch, learning_rate=0.25, damping=1e-3, norm_constraint=c)
  ((_, _, u),) = _steps(tx, loss_fn, params, batch, 1)
  np.testing.assert_allclose(ravel_pytree(u)[0], -0.25 * want * 0.1, rtol=1e-9)


def test_the_default_step_is_gauss_newton_on_the_tagged_loss(x64):
  """No learning rate: α = 1/c, c the registration's loss factor (the returned loss over the
  tags' negative log-likelihood): the damped Gauss-Newton step, which solves this
  interpolation problem (9 points, 33 params) to rounding in a dozen steps."""
  loss_fn, params, batch, _ = _problem()
  tx = kfac_jax.kernel_ngd(loss_fn, batch, damping=1e-4)
  runs = _steps(tx, loss_fn, params, batch, 12, apply=True)
  loss = jax.jit(loss_fn)
  assert float(loss(runs[-1][0], batch)) < 1e-8 * float(loss(params, batch))


def test_a_non_finite_gradient_skips_the_update_and_keeps_the_state(x64):
  loss_fn, params, batch, _ = _problem()
  config = kfac_jax.Config(step_warnings=True)
  tx = kfac_jax.kernel_ngd(loss_fn, batch, learning_rate=0.5, momentum=0.5, config=config)
  state = jax.jit(tx.init)(params)
  grads = jax.grad(loss_fn)(params, batch)
  bad = jax.tree.map(lambda g: g.at[(0,) * g.ndim].set(jnp.nan), grads)
  update = jax.jit(lambda g, s: tx.update(g, s, params, batch=batch))
  _, state = update(grads, state)
  with pytest.warns(kfac_jax.NonFiniteWarning, match="the gradient is not finite"):
    u, new = update(bad, state)
    jax.effects_barrier()
  assert all(not np.any(x) for x in jax.tree.leaves(u))
  assert int(new.preconditioner.skipped) == 1 and int(new.preconditioner.count) == 1
  for a, b in zip(
    jax.tree.leaves(new.preconditioner.curvature), jax.tree.leaves(state.preconditioner.curvature)
  ):
    np.testing.assert_array_equal(a, b)


@pytest.mark.filterwarnings("ignore::kfac_jax.UncoveredParametersWarning")  # No layers needed.
def test_a_variational_monte_carlo_energy_with_curvature_fn(x64):
  """The energy's gradient lies in the rows' span (log ψ's scores): the direction equals
  Uᵀ(K + λI)⁻¹ε with ε the least-squares coefficients, i.e. (F + λI)⁻¹ g."""
  rng = _models.np_rng(3)
  params = {
    "w": jnp.asarray(0.3 * rng.standard_normal((3, 5))),
    "v": jnp.asarray(rng.standard_normal(5)),
  }
  batch = {"r": jnp.asarray(rng.standard_normal((7, 3)))}

  def log_psi(p, r):
    return jnp.tanh(r @ p["w"]) @ p["v"] - 0.5 * jnp.sum(r**2, -1)

  def curvature_fn(p, b):
    kfac_jax.register_normal_predictive_distribution(log_psi(p, b["r"])[:, None])

  def energy(p, b):  # A stand-in local energy; its gradient is the VMC form.
    e_loc = jax.lax.stop_gradient(jnp.sum(b["r"] ** 2, -1) * (1 + log_psi(p, b["r"]) ** 2))
    lp = log_psi(p, b["r"])
    return jnp.mean(e_loc) + 2 * jnp.mean(
      (e_loc - jnp.mean(e_loc)) * (lp - jax.lax.stop_gradient(lp))
    )

  reg = kfac_jax.Registration(
    energy, params, batch, curvature_fn=curvature_fn, estimation_mode="exact"
  )
  tx = kfac_jax.scale_by_kernel_ngd(registration=reg, damping=1e-4)
  ((_, _, u),) = _steps(tx, energy, params, batch, 1)
  flat, unravel = ravel_pytree(params)
  j = np.asarray(jax.jacobian(lambda v: log_psi(unravel(v), batch["r"]))(flat))
  f = 2 * j.T @ j / j.shape[0]  # The normal tag's variance 1/2.
  g = np.asarray(ravel_pytree(jax.grad(energy)(params, batch))[0])
  np.testing.assert_allclose(
    ravel_pytree(u)[0], np.linalg.solve(f + 1e-4 * np.eye(f.shape[0]), g), rtol=1e-8
  )


def test_errors_are_named_before_any_state():
  loss_fn, params, batch, _ = _problem(dtype=jnp.float32)
  with pytest.raises(ValueError, match="`damping`"):
    kfac_jax.scale_by_kernel_ngd(loss_fn, batch, damping=0.0)
  with pytest.raises(ValueError, match="`momentum`"):
    kfac_jax.kernel_ngd(loss_fn, batch, momentum=1.0)
  with pytest.raises(ValueError, match="`norm_constraint`"):
    kfac_jax.kernel_ngd(loss_fn, batch, norm_constraint=-1.0)
  with pytest.raises(ValueError, match="both learning_rate=0.1 and a `linesearch`"):
    kfac_jax.kernel_ngd(
      loss_fn, batch, learning_rate=0.1, linesearch=optax.scale_by_backtracking_linesearch(5)
    )
  with pytest.raises(ValueError, match="`config.burn_in_steps`=2 is not read by kernel_ngd"):
    kfac_jax.kernel_ngd(loss_fn, batch, config=kfac_jax.Config(burn_in_steps=2))
  tx = kfac_jax.kernel_ngd(loss_fn, batch, learning_rate=0.1)
  state = jax.jit(tx.init)(params)
  grads = jax.grad(loss_fn)(params, batch)
  with pytest.raises(ValueError, match="pass `batch=`"):
    tx.update(grads, state, params)
  stats = kfac_jax.value_and_grad(loss_fn)(params, batch, jax.random.key(0))[2]
  with pytest.raises(ValueError, match="`curvature_stats` are K-FAC's"):
    tx.update(grads, state, params, curvature_stats=stats)
  masked = {k: (optax.MaskedNode() if k == "b2" else v) for k, v in params.items()}
  reg = kfac_jax.Registration(loss_fn, params, batch)
  with pytest.raises(ValueError, match="need every parameter"):
    kfac_jax.kernel_ngd(registration=reg, learning_rate=0.1).init(masked)
