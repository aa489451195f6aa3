"""Physics-informed networks: K-FAC through forward-mode derivatives, against the GGN (float64).

A dense layer applied to the points and to their tangents (nested `jax.jvp`, a hand-written
forward Laplacian) is one shared layer whose tangent channels add no bias (homogeneous
coordinate 0), with the "expand" factors over every channel's rows.
"""

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kfac_jax
from tests import _models


def _laplacian_jvp(params, x):
  """Σ_i ∂²u/∂x_i² by nested `jax.jvp` on the batched points, one direction per axis."""
  out = 0.0
  for i in range(x.shape[1]):
    e = jnp.broadcast_to(jnp.eye(x.shape[1], dtype=x.dtype)[i], x.shape)
    du = lambda y, e=e: jax.jvp(lambda z: _models.pinn_mlp(params, z), (y,), (e,))[1]
    out = out + jax.jvp(du, (x,), (e,))[1]
  return out


def _forward_channels(params, x, upto=None):
  """The forward Laplacian: value `[N, h]`, gradient `[N, d, h]` and Laplacian `[N, h]`
  channels through each layer; with `upto`, the channels after that layer's product."""
  n, d = x.shape
  z, dz, lz = x, jnp.broadcast_to(jnp.eye(d, dtype=x.dtype), (n, d, d)), jnp.zeros_like(x)
  for i, p in enumerate(params):
    z, dz, lz = z @ p["w"] + p["b"], dz @ p["w"], lz @ p["w"]
    if i == upto:
      return z, dz, lz
    if i < len(params) - 1:
      z, dz, lz = _tanh_channels(z, dz, lz)
  return z, dz, lz


def _tanh_channels(z, dz, lz):
  t = jnp.tanh(z)
  s = 1 - t**2
  return t, s[:, None, :] * dz, s * lz - 2 * t * s * jnp.sum(dz**2, axis=1)


def _laplacian_forward(params, x):
  """`kfac_jax.pinn.laplacian`: the channels of `_forward_channels` through each layer."""
  return kfac_jax.pinn.laplacian(lambda y: _models.pinn_mlp(params, y), x)


LAPLACIANS = {"jvp": _laplacian_jvp, "forward": _laplacian_forward}


def _interior_loss(laplacian):
  def loss_fn(params, batch):
    x = batch["x"]
    f = 2 * jnp.pi**2 * jnp.sin(jnp.pi * x[:, 0]) * jnp.sin(jnp.pi * x[:, 1])
    r = (laplacian(params, x) + f)[:, None]
    kfac_jax.register_squared_error_loss(r)
    return jnp.mean(r**2)

  return loss_fn


@functools.partial(
  jax.jit, static_argnums=(0, 1)
)  # One program: eagerly, each op compiles its own.
def _problem(sizes=(2, 5, 1), n=7):
  params = _models.pinn_mlp_init(jax.random.key(3), sizes)
  batch = {"x": jax.random.uniform(jax.random.key(4), (n, 2), jnp.float64)}
  return params, batch


def _estimate(loss_fn, params, batch, approx):
  layers = kfac_jax.LayerConfig(overrides={"0/*": approx, "1/w": approx})
  reg = kfac_jax.Registration(
    loss_fn, params, batch, estimation_mode="exact_GGN", layers=layers, warn=False
  )
  est = kfac_jax.CurvatureEstimator(registration=reg)
  update = jax.jit(lambda p: est.update_curvature(est.init(p), p, batch, None, ema_decay=0.0))
  return est, update(params)


def _ggn(laplacian, params, batch):
  """The GGN of mean(r²): 2 Jᵀ J / N, J the residuals' Jacobian (jax.jacobian)."""
  jac = _models.flat_jacobian(lambda p: laplacian(p, batch["x"]), params)
  return 2 * jac.T @ jac / jac.shape[0]


@pytest.mark.parametrize("how", ["jvp", "forward"])
def test_layer_shared_by_point_and_tangents_is_one_dense_layer(x64, how):
  """The 2-64-1 network under a forward-mode Laplacian: every layer one shared dense layer,
  the tangent uses marked as adding no bias; only the output bias (absent from Δu) is left."""
  params, batch = _problem((2, 64, 1), 16)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", kfac_jax.UncoveredParametersWarning)
    specs = kfac_jax.Registration(_interior_loss(LAPLACIANS[how]), params, batch).layers
  by_name = {s.name: s for s in specs}
  first = by_name["0"]
  assert (first.kind, first.approx, first.param_paths) == ("dense", "kron_indep", ("0/w", "0/b"))
  uses = {"jvp": 6, "forward": 3}[how]
  assert first.num_uses == uses
  with_bias = [inf.adds_bias for inf in first.use_infos]
  assert sum(with_bias) == {"jvp": 2, "forward": 1}[how]  # The value channel(s) only.
  assert next(s for s in specs if s.param_paths == ("1/w",)).kind == "dense"
  report = kfac_jax.summary(_interior_loss(LAPLACIANS[how]), params, batch)
  assert "hold 256 of 257 parameters" in report
  assert "1/b: not used by the loss" in report


@pytest.mark.parametrize("how", ["jvp", "forward"])
def test_full_blocks_equal_the_exact_ggn(x64, how):
  """With "full" blocks built from the per-channel rows, each layer's block is the exact GGN
  block: the channels' terms x̄ gᵀ sum to the residual's Jacobian, tangents with coordinate 0."""
  params, batch = _problem()
  laplacian = LAPLACIANS[how]
  est, state = _estimate(_interior_loss(laplacian), params, batch, "full")
  dense = np.asarray(jax.jit(est.to_dense)(state))
  mask = _models.block_mask(est, params)
  ggn = _ggn(laplacian, params, batch)
  assert [b.spec.approx for b in est.blocks][:1] == ["full"]
  np.testing.assert_allclose(dense[mask], ggn[mask], rtol=1e-10, atol=1e-13)


def test_expand_factors_are_the_channel_sums(x64):
  """The forward Laplacian's first layer: A = Σ over the rows of every channel of x̄ x̄ᵀ / rows
  (x̄ = [x, 1] for the value, [e_i, 0] for the gradient, [0, 0] for the Laplacian channel), and
  G = (1/N) Σ_n Σ_channels g gᵀ with g the exact GGN's output gradient √2 ∂r_n/∂s."""
  params, batch = _problem()
  _, state = _estimate(_interior_loss(_laplacian_forward), params, batch, "kron")

  @jax.jit  # One program: run eagerly, each op compiles its own.
  def expected(params, x):
    n = x.shape[0]
    rows = [
      jnp.concatenate([x, jnp.ones((n, 1))], 1),
      jnp.concatenate([jnp.tile(jnp.eye(2), (n, 1)), jnp.zeros((2 * n, 1))], 1),
      jnp.zeros((n, 3)),
    ]
    a = sum(r.T @ r for r in rows) / (4 * n)

    def residuals(channels):  # r as a function of the first layer's output channels.
      z, dz, lz = _tanh_channels(*channels)
      p = params[1]
      return (lz @ p["w"])[:, 0] + 2 * jnp.pi**2 * jnp.sin(jnp.pi * x[:, 0]) * jnp.sin(
        jnp.pi * x[:, 1]
      )

    # Row n of r depends only on point n: the gradient of Σ r is each point's own.
    grads = jax.grad(lambda c: jnp.sum(residuals(c)))(_forward_channels(params, x, upto=0))
    g_rows = [grads[0], grads[1].reshape(-1, grads[1].shape[-1]), grads[2]]
    return a, 2 * sum(r.T @ r for r in g_rows) / n

  a, g = expected(params, batch["x"])
  np.testing.assert_allclose(state.factors["0"].a, a, rtol=1e-12, atol=1e-15)
  np.testing.assert_allclose(state.factors["0"].g, g, rtol=1e-10, atol=1e-15)


def test_output_layer_of_a_forward_laplacian_is_exactly_kronecker(x64):
  """The output layer sees only the Laplacian channel, and its output gradient is the same at
  every point (Δu = W Δh), so its K-FAC block A ⊗ G is the exact GGN block."""
  params, batch = _problem()
  est, state = _estimate(_interior_loss(_laplacian_forward), params, batch, "kron")
  dense = np.asarray(jax.jit(est.to_dense)(state))
  ggn = _ggn(_laplacian_forward, params, batch)
  w = slice(15, 20)  # 0/b, 0/w, 1/b, 1/w in ravel order: 5 + 10 + 1, then 1/w.
  np.testing.assert_allclose(dense[w, w], ggn[w, w], rtol=1e-10, atol=1e-14)
  assert np.linalg.norm(dense[:15, :15] - ggn[:15, :15]) > 1e-3  # The hidden layer is not.


def _two_terms(laplacian):
  """A residual on 7 interior points and the values on 3 boundary points, each a mean."""

  def loss_fn(params, batch):
    r = (laplacian(params, batch["x"]) + jnp.sin(batch["x"][:, 0]))[:, None]
    kfac_jax.register_squared_error_loss(r)
    u = _models.pinn_mlp(params, batch["xb"])[:, None]
    kfac_jax.register_squared_error_loss(u)
    return jnp.mean(r**2) + jnp.mean(u**2)

  params, batch = _problem()
  batch["xb"] = jax.random.uniform(jax.random.key(9), (3, 2), jnp.float64)
  return loss_fn, params, batch


@pytest.mark.parametrize("how", ["jvp", "forward"])
def test_loss_terms_on_point_sets_of_different_sizes(x64, how):
  """Two tags with 7 and 3 examples: the curvature is the sum of the terms' GGNs, each with
  its own 1/N; "full" blocks equal it exactly."""
  laplacian = LAPLACIANS[how]
  loss_fn, params, batch = _two_terms(laplacian)
  layers = kfac_jax.LayerConfig(overrides={"*": "full"})
  reg = kfac_jax.Registration(loss_fn, params, batch, estimation_mode="exact_GGN", layers=layers)
  assert [s.batch_size for s in reg.scan_batch(params, batch).losses] == [7, 3]
  est = kfac_jax.CurvatureEstimator(registration=reg)
  # One program: run eagerly, each op compiles its own.
  dense = np.asarray(
    jax.jit(
      lambda p: est.to_dense(est.update_curvature(est.init(p), p, batch, None, ema_decay=0.0))
    )(params)
  )
  ji = _models.flat_jacobian(lambda p: laplacian(p, batch["x"]), params)
  jb = _models.flat_jacobian(lambda p: _models.pinn_mlp(p, batch["xb"]), params)
  ggn = 2 * ji.T @ ji / 7 + 2 * jb.T @ jb / 3
  mask = _models.block_mask(est, params)
  assert len(est.blocks) == 2
  np.testing.assert_allclose(dense[mask], ggn[mask], rtol=1e-10, atol=1e-13)


def _output_layer_rows(params, batch):
  """The output layer's rows: [Δh, 0] at the 7 interior points, [h, 1] at the 3 boundary ones."""
  lap_h = _tanh_channels(*_forward_channels(params, batch["x"], upto=0))[2]
  h = jnp.tanh(batch["xb"] @ params[0]["w"] + params[0]["b"])
  return (
    jnp.concatenate([lap_h, jnp.zeros((7, 1))], 1),
    jnp.concatenate([h, jnp.ones((3, 1))], 1),
  )


@pytest.mark.parametrize("approx", ["kron_terms", "kron_indep"])
def test_a_layer_serving_two_terms(x64, approx):
  """The output layer under a forward Laplacian and the boundary values, g = √2 in both terms
  (Δu = W Δh, u = W h + b). "kron_terms" (the default for uses that feed two tags) keeps each
  term's A_ℓ = Σ x̄ x̄ᵀ / R_ℓ and G_ℓ = (1/N_ℓ) Σ g gᵀ, so its block is the exact GGN block and
  its damped inverse the exact inverse of A₁' ⊗ G₁' + A₂' ⊗ G₂'; "kron_indep" pools A over the
  rows of both terms and sums G."""
  loss_fn, params, batch = _two_terms(_laplacian_forward)
  layers = None if approx == "kron_terms" else kfac_jax.LayerConfig(overrides={"*": approx})
  reg = kfac_jax.Registration(loss_fn, params, batch, estimation_mode="exact_GGN", layers=layers)
  assert [s.approx for s in reg.layers] == [approx] * 2
  est = kfac_jax.CurvatureEstimator(registration=reg)
  update = jax.jit(lambda p: est.update_curvature(est.init(p), p, batch, None, ema_decay=0.0))
  state = update(params)
  factors = state.factors["1"]

  @jax.jit  # One program: run eagerly, each op compiles its own.
  def expected_a(params, batch):
    inner, bound = _output_layer_rows(params, batch)
    rows = jnp.concatenate([inner, bound])
    return rows.T @ rows / 10, inner.T @ inner / 7, bound.T @ bound / 3

  pooled, a_inner, a_bound = expected_a(params, batch)
  if approx == "kron_indep":
    np.testing.assert_allclose(factors.a, pooled, rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(factors.g, [[4.0]], rtol=1e-12)
    return
  a = np.stack([a_inner, a_bound])
  np.testing.assert_allclose(factors.a, a, rtol=1e-12, atol=1e-15)
  np.testing.assert_allclose(factors.g, [[[2.0]], [[2.0]]], rtol=1e-12)
  ji = _models.flat_jacobian(lambda p: _laplacian_forward(p, batch["x"]), params)
  jb = _models.flat_jacobian(lambda p: _models.pinn_mlp(p, batch["xb"]), params)
  ggn = 2 * ji.T @ ji / 7 + 2 * jb.T @ jb / 3
  w = slice(15, 21)  # 1/b, 1/w in ravel order.
  dense = np.asarray(jax.jit(est.to_dense)(state))
  np.testing.assert_allclose(dense[w, w], ggn[w, w], rtol=1e-10, atol=1e-14)
  # The damped inverse: each term damped by λ/2 in the factored way.
  lam = 1e-3
  block = est.blocks[1]

  @jax.jit  # One program: run eagerly, each op compiles its own.
  def inverse_product(factors):
    cache = block.compute_cache(factors, lam)
    damped = [
      kfac_jax.blocks._kronecker.damped_factors(factors.a[t], factors.g[t], lam / 2) for t in (0, 1)
    ]
    v = [jnp.linspace(-1.0, 2.0, 5).reshape(5, 1), jnp.array([0.5])]
    return (
      damped,
      block.to_matrix(block.multiply_matpower(factors, cache, v, -1)),
      block.to_matrix(v),
    )

  ((a1, g1), (a2, g2)), out, v = inverse_product(factors)
  f = np.kron(a1, g1) + np.kron(a2, g2)
  out = np.asarray(out).reshape(-1)
  expected = np.linalg.solve(f, np.asarray(v).reshape(-1))
  np.testing.assert_allclose(out, expected, rtol=1e-9)


def test_factored_equal_damping_adds_the_same_root_to_both_factors(x64):
  """`damping_mode="factored_equal"` damps each term's factors by √(λ/2) I both (no π): the damped
  inverse is the exact inverse of (A₁ + √(λ/2) I) ⊗ (G₁ + √(λ/2) I) + (A₂ + ...) ⊗ (G₂ + ...),
  and differs from the π-split one, as the factors' traces differ."""
  loss_fn, params, batch = _two_terms(_laplacian_forward)
  reg = kfac_jax.Registration(loss_fn, params, batch, estimation_mode="exact_GGN")
  config = kfac_jax.Config(damping_mode="factored_equal")
  est = kfac_jax.CurvatureEstimator(registration=reg, config=config)
  block, lam = est.blocks[1], 1e-2
  pi_block = kfac_jax.CurvatureEstimator(registration=reg).blocks[1]

  @jax.jit  # One program: run eagerly, each op compiles its own.
  def run(params):
    factors = est.update_curvature(est.init(params), params, batch, None, ema_decay=0.0)
    factors = factors.factors["1"]
    v = [jnp.linspace(-1.0, 2.0, 5).reshape(5, 1), jnp.array([0.5])]
    out = block.multiply_matpower(factors, block.compute_cache(factors, lam), v, -1)
    pi_out = pi_block.multiply_matpower(factors, pi_block.compute_cache(factors, lam), v, -1)
    return factors, block.to_matrix(v), block.to_matrix(out), pi_block.to_matrix(pi_out)

  factors, rhs, out, pi_out = run(params)
  a, g = np.asarray(factors.a), np.asarray(factors.g)
  r = np.sqrt(lam / 2)
  eye_a, eye_g = np.eye(a.shape[-1]), np.eye(g.shape[-1])
  f = sum(np.kron(a[t] + r * eye_a, g[t] + r * eye_g) for t in (0, 1))
  rhs = np.asarray(rhs).reshape(-1)
  np.testing.assert_allclose(np.asarray(out).reshape(-1), np.linalg.solve(f, rhs), rtol=1e-9)
  assert not np.allclose(np.asarray(pi_out), np.asarray(out), rtol=1e-3)
  with pytest.raises(ValueError, match="damping_mode"):
    kfac_jax.Config(damping_mode="trace")


@pytest.mark.parametrize("model", ["pinn_poisson", "mlp"])
def test_optimizer_rejects_steps_that_raise_the_loss(x64, model):
  """Adaptive damping measuring every step (interval 1) from a tiny damping: a step that
  raises the loss, or makes it non-finite, is not applied (the params stay bit-identical) and
  raises λ; so the loss never goes up."""
  from tests import _zoo

  z = _zoo.MODELS[model]("linen") if model == "mlp" else _zoo.STRUCTURE_MODELS[model]()
  # One program: run eagerly, each cast compiles its own.
  params, batch = jax.jit(
    lambda params, batch: (
      jax.tree_util.tree_map(lambda p: p.astype(jnp.float64), params),
      jax.tree_util.tree_map(
        lambda x: x.astype(jnp.float64) if jnp.issubdtype(x.dtype, jnp.floating) else x, batch
      ),
    )
  )(z.params, z.batch)
  opt = kfac_jax.Optimizer(
    z.loss_fn,
    batch,
    damping=1e-10,
    inverse_every=1,
    config=kfac_jax.Config(damping_adaptation_interval=1, min_damping=1e-12),
  )
  step = jax.jit(opt.step)
  state = jax.jit(opt.init)(params)
  loss_of = jax.jit(z.loss_fn)
  losses, rejected = [float(loss_of(params, batch))], 0
  for i in range(12):
    new, state, info = step(params, state, batch, _zoo._key(i))
    if float(info["rho"]) < 0:
      rejected += 1
      assert all(
        np.array_equal(a, b) for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(params))
      )
      assert float(state.damping) > float(info["damping"])
    params = new
    losses.append(float(loss_of(params, batch)))
  assert np.all(np.isfinite(losses)), losses
  assert np.all(np.diff(losses) <= 1e-12 * np.abs(losses[:-1])), losses
