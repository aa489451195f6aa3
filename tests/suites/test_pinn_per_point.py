"""PINN operators written per point, as most PINN code writes them: a function of one point,
differentiated with `jax.jvp`, `jax.jacfwd`, `jax.grad` or `jax.hessian`, vmapped over the
points. K-FAC against the batched form, the GGN and hand-derived statistics (float64).

`jax.vmap` computes a product by a tangent direction or a reverse-mode seed, one constant for
every point, once for all of them: the product is tapped where each point reads it, so its
statistics are those of the batched form (the direction broadcast over the points). A
reverse-mode derivative's backward pass reads each kernel transposed, `δa = δz Wᵀ`: one more
use of W whose input δz and output gradient ∂ℓ/∂δa enter with their roles exchanged.
"""

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kfac_jax
from tests import _models


def _per_point(op):
  """`op(u, y)` of the network `u` at one point `y`, vmapped over the points `x`."""
  return lambda params, x: jax.vmap(lambda y: op(lambda z: _models.pinn_mlp(params, z), y))(x)


def _nested_jvp(u, y):
  eye = jnp.eye(y.shape[0], dtype=y.dtype)
  du = lambda z, e: jax.jvp(u, (z,), (e,))[1]  # noqa: E731
  return sum(jax.jvp(lambda z, e=e: du(z, e), (y,), (e,))[1] for e in eye)


def _grad_grad(params, t):
  return jax.vmap(jax.grad(jax.grad(lambda s: _models.pinn_mlp(params, s[None]))))(t)


OPERATORS = {
  "vmap_jvp": _per_point(_nested_jvp),
  "jacfwd": _per_point(lambda u, y: jnp.trace(jax.jacfwd(jax.jacfwd(u))(y))),
  "hessian": _per_point(lambda u, y: jnp.trace(jax.hessian(u)(y))),
  "jacrev_jacrev": _per_point(lambda u, y: jnp.trace(jax.jacrev(jax.jacrev(u))(y))),
  # u_t − u_xx at (t, x): reverse mode for u_t, forward over reverse for u_xx.
  "heat": _per_point(lambda u, y: jax.grad(u)(y)[0] - jax.hessian(u)(y)[1, 1]),
  # 1-d: u'' by reverse over reverse.
  "grad_grad": lambda params, x: _grad_grad(params, x[:, 0]),
}


def _batched_jvp(params, batch):
  """The Laplacian by nested `jax.jvp` on the batched points, each direction broadcast."""
  x = batch["x"]
  out = 0.0
  for e in batch["dirs"].transpose(1, 0, 2):  # [N, d] per direction
    du = lambda y, e=e: jax.jvp(lambda z: _models.pinn_mlp(params, z), (y,), (e,))[1]
    out = out + jax.jvp(du, (x,), (e,))[1]
  return out


def _batched_jacfwd(params, batch):
  """jacfwd's channels on the batched points: the basis broadcast over them (`dirs`,
  `[N, d, d]`), vmapped over as `jax.jacfwd` vmaps over the basis."""
  dirs = batch["dirs"]
  u = lambda z: _models.pinn_mlp(params, z)  # noqa: E731

  def grad(y):
    return jax.vmap(lambda e: jax.jvp(u, (y,), (e,))[1], in_axes=1, out_axes=1)(dirs)

  hess = jax.vmap(lambda e: jax.jvp(grad, (batch["x"],), (e,))[1], in_axes=1, out_axes=2)(dirs)
  return jnp.trace(hess, axis1=1, axis2=2)


def _loss(operator, batched=False):
  """mean(r²) of the residual r = operator + f on the points `batch["x"]`."""

  def loss_fn(params, batch):
    x = batch["x"]
    op = operator(params, batch) if batched else operator(params, x)
    r = (op + jnp.sin(jnp.pi * x[:, 0]))[:, None]
    kfac_jax.register_squared_error_loss(r)
    return jnp.mean(r**2)

  return loss_fn


# One program: eagerly, each op compiles its own.
@functools.partial(jax.jit, static_argnums=(0, 1))
def _problem(sizes=(2, 5, 1), n=7):
  params = _models.pinn_mlp_init(jax.random.key(3), sizes)
  x = jax.random.uniform(jax.random.key(4), (n, sizes[0]), jnp.float64)
  dirs = jnp.broadcast_to(jnp.eye(sizes[0], dtype=jnp.float64), (n, sizes[0], sizes[0]))
  return params, {"x": x, "dirs": dirs}


def _estimate(loss_fn, params, batch, approx):
  """The estimator and its statistics of one batch (exact GGN, no moving average); the output
  bias, absent from the operator, keeps its fallback."""
  layers = kfac_jax.LayerConfig(overrides={"0/*": approx, "1/w": approx})
  reg = kfac_jax.Registration(
    loss_fn, params, batch, estimation_mode="exact_GGN", layers=layers, warn=False
  )
  est = kfac_jax.CurvatureEstimator(registration=reg)

  @jax.jit
  def run(p):
    state = est.update_curvature(est.init(p), p, batch, None, ema_decay=0.0)
    return state, est.to_dense(state)

  state, dense = run(params)
  return reg, est, state, np.asarray(dense)


def _ggn(operator, params, x):
  """The GGN of mean(r²): 2 Jᵀ J / N, J the residuals' Jacobian."""
  jac = _models.flat_jacobian(lambda p: operator(p, x), params)
  return 2 * jac.T @ jac / jac.shape[0]


@pytest.mark.parametrize(
  "per_point, batched", [("vmap_jvp", _batched_jvp), ("jacfwd", _batched_jacfwd)]
)
@pytest.mark.parametrize("approx", ["kron", "full"])
def test_per_point_forward_mode_has_the_batched_forms_statistics(x64, per_point, batched, approx):
  """Nested `jax.jvp` and `jax.jacfwd` per point under `jax.vmap`: the first layer's tangent
  products are computed once for all points, yet every layer's statistics, and the estimator's
  matrix, are those of the same operator on the batched points with the directions broadcast."""
  params, batch = _problem()
  ours = _estimate(_loss(OPERATORS[per_point]), params, batch, approx)
  ref = _estimate(_loss(batched, batched=True), params, batch, approx)
  layers = [(s.name, s.kind, s.num_uses) for s in ours[0].layers]
  assert layers == [(s.name, s.kind, s.num_uses) for s in ref[0].layers]
  assert layers[0] == ("0", "dense", {"vmap_jvp": 6, "jacfwd": 3}[per_point])
  for name, f in ours[2].factors.items():
    for a, b in zip(jax.tree_util.tree_leaves(f), jax.tree_util.tree_leaves(ref[2].factors[name])):
      np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-15)
  np.testing.assert_allclose(ours[3], ref[3], rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("how", sorted(OPERATORS))
def test_full_blocks_equal_the_exact_ggn(x64, how):
  """With "full" blocks built from every use's rows (a transposed use's gradient `(∂ℓ/∂δa)
  δzᵀ`, a hoisted product's per-point output gradients), each layer's block is the exact GGN
  block, whatever mode of differentiation the operator uses."""
  params, batch = _problem((1, 5, 1) if how == "grad_grad" else (2, 5, 1))
  operator = OPERATORS[how]
  reg, est, _, dense = _estimate(_loss(operator), params, batch, "full")
  kinds = {s.param_paths: s.kind for s in reg.layers}
  assert kinds == {("0/w", "0/b"): "dense", ("1/w",): "dense", ("1/b",): "generic"}
  mask = _models.block_mask(est, params)
  np.testing.assert_allclose(dense[mask], _ggn(operator, params, batch["x"])[mask], atol=1e-13)


@pytest.mark.parametrize("how", ["hessian", "jacrev_jacrev", "grad_grad"])
def test_output_layer_read_by_its_backward_seed_is_exactly_kronecker(x64, how):
  """The output layer's only use on the Laplacian's path is the backward pass's first step,
  `δh = 1 · W₂ᵀ`: one transposed use whose input, the seed, is the same at every point. Its
  K-FAC block A ⊗ G (A = 1, G the per-point output gradients' second moment) is the exact
  GGN block."""
  params, batch = _problem((1, 5, 1) if how == "grad_grad" else (2, 5, 1))
  reg, est, state, dense = _estimate(_loss(OPERATORS[how]), params, batch, "kron")
  head = next(s for s in reg.layers if s.param_paths == ("1/w",))
  assert (head.kind, head.num_uses, head.factor_shapes) == ("dense", 1, ((1, 1), (5, 5)))
  np.testing.assert_allclose(state.factors[head.name].a, [[1.0]], rtol=1e-14)
  w = slice(-5, None)  # 1/w, last in ravel order.
  ggn = _ggn(OPERATORS[how], params, batch["x"])
  np.testing.assert_allclose(dense[w, w], ggn[w, w], rtol=1e-10, atol=1e-14)


def test_output_layer_serving_a_residual_and_boundary_values_is_exact(x64):
  """With boundary values (3 points) beside the residual (7 points), the output layer has two
  uses, one per loss term: the backward seed's, transposed (A_t over its output gradients,
  G_t = 1), and the boundary's value, `u = h W₂ + b₂` (g = √2 at every point). Each term's
  product is exact, so the "kron_terms" block, their sum, is the exact GGN block."""
  params, batch = _problem()
  batch["xb"] = jax.random.uniform(jax.random.key(9), (3, 2), jnp.float64)
  operator = OPERATORS["hessian"]

  def loss_fn(params, batch):
    r = (operator(params, batch["x"]) + jnp.sin(batch["x"][:, 0]))[:, None]
    kfac_jax.register_squared_error_loss(r)
    u = _models.pinn_mlp(params, batch["xb"])[:, None]
    kfac_jax.register_squared_error_loss(u)
    return jnp.mean(r**2) + jnp.mean(u**2)

  reg = kfac_jax.Registration(loss_fn, params, batch, estimation_mode="exact_GGN")
  head = reg.layers[1]
  assert (head.param_paths, head.approx) == (("1/w", "1/b"), "kron_terms")
  assert [(inf.transposed, inf.term) for inf in head.use_infos] == [(True, 0), (False, 1)]
  est = kfac_jax.CurvatureEstimator(registration=reg)
  dense = jax.jit(
    lambda p: est.to_dense(est.update_curvature(est.init(p), p, batch, None, ema_decay=0.0))
  )(params)
  ji = _models.flat_jacobian(lambda p: operator(p, batch["x"]), params)
  jb = _models.flat_jacobian(lambda p: _models.pinn_mlp(p, batch["xb"]), params)
  ggn = 2 * ji.T @ ji / 7 + 2 * jb.T @ jb / 3
  w = slice(15, 21)  # 1/b, 1/w in ravel order.
  np.testing.assert_allclose(np.asarray(dense)[w, w], ggn[w, w], rtol=1e-10, atol=1e-14)


def test_transposed_uses_statistics_are_the_hand_derived_channels(x64):
  """The first layer of `jax.hessian`'s Laplacian (jacfwd of jacrev) has three uses: the value
  z = x W + b (rows [x, 1]), the tangents ż_i = e_i W (rows [e_i, 0], hoisted) and the
  backward pass's tangents δẋ_i = δż_i Wᵀ, with δż_i = w₂ ⊙ tanh''(z) ⊙ ż_i, whose input δż_i
  and output gradient ∂r/∂δẋ_i enter with their roles exchanged:

      A_n = Σ x̄ x̄ᵀ / (N + N d),  G_n = (2/N) Σ g gᵀ  over the value and tangent rows;
      A_t = (2/N) Σ [∂r/∂δẋ_i, 0] [∂r/∂δẋ_i, 0]ᵀ,  G_t = Σ δż_i δż_iᵀ / (N d);

  each pair scaled to equal mean diagonals (A c, G / c), then A averaged and G summed."""
  params, batch = _problem()
  _, _, state, _ = _estimate(_loss(OPERATORS["hessian"]), params, batch, "kron")

  @jax.jit  # One program: run eagerly, each op compiles its own.
  def expected(params, x):
    n, d = x.shape
    w1, w2 = params[0]["w"], params[1]["w"][:, 0]
    z = x @ w1 + params[0]["b"]
    zdot = jnp.broadcast_to(w1, (n, d, w1.shape[1]))  # e_i W at every point
    eps = jnp.zeros((n, d, d))

    def channels(z, zdot):
      t = jnp.tanh(z)
      return w2 * (-2 * t * (1 - t**2))[:, None, :] * zdot  # δż_i

    def residuals(z, zdot, eps):
      dxdot = channels(z, zdot) @ w1.T + eps  # δẋ_i, the Hessian's columns
      return jnp.trace(dxdot, axis1=1, axis2=2) + jnp.sin(jnp.pi * x[:, 0])

    # Row n of r depends only on point n: the gradient of Σ r is each point's own.
    gz, gzdot, geps = jax.grad(lambda *c: jnp.sum(residuals(*c)), argnums=(0, 1, 2))(z, zdot, eps)
    rows_n = jnp.concatenate(
      [
        jnp.concatenate([x, jnp.ones((n, 1))], 1),
        jnp.concatenate([jnp.tile(jnp.eye(d), (n, 1)), jnp.zeros((n * d, 1))], 1),
      ]
    )
    a_n = rows_n.T @ rows_n / (n + n * d)
    g_rows = jnp.concatenate([gz, gzdot.reshape(-1, gz.shape[1])])
    g_n = 2 * g_rows.T @ g_rows / n
    a_rows = jnp.concatenate([geps.reshape(-1, d), jnp.zeros((n * d, 1))], 1)
    a_t = 2 * a_rows.T @ a_rows / n
    dz = channels(z, zdot).reshape(-1, w1.shape[1])
    g_t = dz.T @ dz / (n * d)
    c_n = jnp.sqrt(jnp.mean(jnp.diag(g_n)) / jnp.mean(jnp.diag(a_n)))
    c_t = jnp.sqrt(jnp.mean(jnp.diag(g_t)) / jnp.mean(jnp.diag(a_t)))
    return (c_n * a_n + c_t * a_t) / 2, g_n / c_n + g_t / c_t

  a, g = expected(params, batch["x"])
  np.testing.assert_allclose(state.factors["0"].a, a, rtol=1e-12, atol=1e-15)
  np.testing.assert_allclose(state.factors["0"].g, g, rtol=1e-12, atol=1e-15)


def test_a_recurrence_model_refuses_transposed_uses(x64):
  """The series approximations model successive uses that read the kernel alike; a layer read
  transposed by a backward pass is refused with the choice that fits."""
  params, batch = _problem()
  layers = kfac_jax.LayerConfig(overrides={"0/*": "kron_series_1"})
  with pytest.raises(kfac_jax.RegistrationError, match="read it transposed.*kron_indep"):
    kfac_jax.Registration(_loss(OPERATORS["hessian"]), params, batch, layers=layers, warn=False)


def _linear_input(params, x):
  """A per-point Laplacian (nested `jax.jvp`, vmapped) of a network whose first layer is a
  linear map with no nonlinearity after it: its tangent product reaches the points only
  through the next layer's product."""

  def u(y):
    y = y @ params[0]["w"]
    return _models.pinn_mlp(params[1:], y)

  return jax.vmap(lambda y: _nested_jvp(u, y))(x)


def _conv_gradient(params, x):
  """|∇u|² of a convolutional u (`jax.grad` per point): its backward pass convolves with the
  flipped kernel."""

  def u(y):
    h = jax.lax.conv_general_dilated(
      y[None, :, None], params[0]["w"], (1,), "SAME", dimension_numbers=("NWC", "WIO", "NWC")
    )
    return jnp.sum(jnp.tanh(h) @ params[1]["w"])

  return jax.vmap(lambda y: jnp.sum(jax.grad(u)(y) ** 2))(x)


@pytest.mark.parametrize(
  "operator, says",
  [
    (_linear_input, "through more than layout changes and elementwise broadcasting"),
    (_conv_gradient, "read flipped (`rev`)"),
  ],
)
def test_operators_k_fac_cannot_follow_say_why_and_name_the_kernel_front(x64, operator, says):
  """Where no Kronecker block fits, the warning and `summary` say why and name the sample-space
  front, `kfac_jax.kernel_ngd`."""
  params, batch = _problem((2, 3, 5, 1))
  if operator is _conv_gradient:
    params = [{"w": params[0]["w"].reshape(2, 1, 3)}, {"w": params[1]["w"][:, :1]}]
  else:
    params[0] = {"w": params[0]["w"]}
  with pytest.warns(kfac_jax.UncoveredParametersWarning) as caught:
    kfac_jax.Registration(_loss(operator), params, batch)
  message = str(caught[0].message)
  assert "`0/w` (" in message and says in message and "`kfac_jax.kernel_ngd`" in message
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", kfac_jax.UncoveredParametersWarning)
    report = kfac_jax.summary(_loss(operator), params, batch)
  line = next(ln for ln in report.splitlines() if ln.strip().startswith("0/w:"))
  assert says in line and "SR, ENGD-Woodbury or SPRING" in line
