"""The natural gradient in sample space (`kfac_jax.kernel`): rows and direction against dense
float64 references built from `jax.jacobian` of the tagged predictions and `np.linalg.solve`."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.flatten_util import ravel_pytree
from jax.sharding import PartitionSpec as P

import kfac_jax
from kfac_jax import _losses
from kfac_jax import kernel as kn
from kfac_jax.kernel import _solve
from tests import _models

pytestmark = [
  pytest.mark.numerics,
  pytest.mark.filterwarnings("ignore::kfac_jax.UncoveredParametersWarning"),
]
MODES = ("exact", "exact_GGN", "empirical", "gradients", "curvature_prop", "curvature_prop_GGN")


def _init(seed, sizes, dtype=jnp.float64):
  rng = _models.np_rng(seed)
  return [
    {
      "w": jnp.asarray(rng.standard_normal((a, b)) / np.sqrt(a), dtype),
      "b": jnp.asarray(0.3 * rng.standard_normal(b), dtype),
    }
    for a, b in zip(sizes[:-1], sizes[1:])
  ]


def _mlp(params, x):
  for i, p in enumerate(params):
    x = x @ p["w"] + p["b"]
    if i < len(params) - 1:
      x = jnp.tanh(x)
  return x


def _flat(params):
  return np.asarray(ravel_pytree(params)[0])


def _jac(pred, params):
  """`[N, pred(params)[n].size, P]`: the dense Jacobian, per example (complex for a complex
  prediction: its real and imaginary parts' Jacobians)."""
  flat, unravel = ravel_pytree(params)
  parts = lambda f: (jnp.real(pred(unravel(f))), jnp.imag(pred(unravel(f))))  # noqa: E731
  re, im = jax.jit(jax.jacobian(parts))(flat)
  out = np.asarray(re) + 1j * np.asarray(im) if np.iscomplexobj(pred(params)) else np.asarray(re)
  return out.reshape(out.shape[0], -1, flat.size)


def _solve_dense(f, g, damping, prev=None, momentum=0.0):
  rhs = g if prev is None else g + damping * momentum * prev
  return np.linalg.solve(f + damping * np.eye(f.shape[0]), rhs)


def _close(got, want, rtol):
  got = _flat(got) if not isinstance(got, np.ndarray) else got
  err = np.linalg.norm(got - want) / np.linalg.norm(want)
  assert err < rtol, (err, rtol)


@functools.partial(jax.jit, static_argnames=("reg", "chunk_size", "damping", "momentum"))
def _run(
  reg, params, batch, grads, rng=None, prev=None, chunk_size=None, damping=1e-3, momentum=0.0
):
  rows = kn.rows(reg, params, batch, rng, chunk_size=chunk_size)
  d, info = kn.direction(rows, grads, prev, damping=damping, momentum=momentum)
  return rows, d, info


# -- a PINN-like loss: interior Laplacian residual and boundary values, two point sets ---------


def _laplacian(params, x):
  u = lambda y: _mlp(params, y)[..., 0]  # noqa: E731
  out = 0.0
  for i in range(x.shape[1]):
    e = jnp.broadcast_to(jnp.eye(x.shape[1], dtype=x.dtype)[i], x.shape)
    du = lambda y, e=e: jax.jvp(u, (y,), (e,))[1]
    out = out + jax.jvp(du, (x,), (e,))[1]
  return out


def _pinn_preds(params, batch):
  interior = (_laplacian(params, batch["x"]) + jnp.sin(batch["x"][:, 0]))[:, None]
  boundary = _mlp(params, batch["xb"]) - batch["gb"]
  return interior, boundary


def _pinn_loss(params, batch):
  interior, boundary = _pinn_preds(params, batch)
  kfac_jax.register_squared_error_loss(interior)
  kfac_jax.register_squared_error_loss(boundary)
  return jnp.mean(interior**2) + jnp.mean(boundary**2) + 1e-2 * _flat_sq(params)


def _flat_sq(params):
  return sum(jnp.sum(x**2) for x in jax.tree_util.tree_leaves(params))


def _pinn_problem(n1=7, n2=4):
  params = _init(0, (2, 6, 1))
  batch = {
    "x": _models.normal(1, (n1, 2), jnp.float64),
    "xb": _models.normal(2, (n2, 2), jnp.float64),
    "gb": _models.normal(3, (n2, 1), jnp.float64),
  }
  return params, batch


def _pinn_fisher(params, batch):
  ji, jb = (_jac(lambda p, k=k: _pinn_preds(p, batch)[k], params) for k in range(2))
  n1, n2 = ji.shape[0], jb.shape[0]
  return sum(2.0 / n * np.einsum("nkp,nkq->pq", j, j) for j, n in ((ji, n1), (jb, n2)))


def test_two_point_sets_with_an_l2_term_equal_the_dense_solve(x64):
  """Interior [7, 2] and boundary [4, 2] tags, each a mean over its own points; the L2 term is
  outside the row space and goes through Woodbury's identity."""
  params, batch = _pinn_problem()
  reg = kfac_jax.Registration(_pinn_loss, params, batch, estimation_mode="exact_GGN", warn=False)
  grads = jax.jit(jax.grad(_pinn_loss))(params, batch)
  rows, d, info = _run(reg, params, batch, grads, damping=1e-2)
  f = _pinn_fisher(params, batch)
  u = np.asarray(rows.matrix)
  assert u.shape == (11, f.shape[0]) and u.shape[0] < u.shape[1]
  np.testing.assert_allclose(u.T @ u, f, atol=1e-12)
  assert [(t.examples, t.vectors, t.offset) for t in rows.layout] == [(7, 1, 0), (4, 1, 7)]
  _close(d, _solve_dense(f, _flat(grads), 1e-2), 1e-10)
  # Tags without targets give no residuals: the row-space part is the least-squares fit.
  assert rows.residuals is None and bool(info["remainder_kept"])
  assert float(info["example_mismatch"]) < 1e-12


# -- variational Monte Carlo: complex log ψ via curvature_fn; tags in a custom_jvp rule ----------


def _vmc_params():
  return _init(10, (3, 5, 2))


def _log_psi(params, r):
  out = _mlp(params, r)
  return out[:, 0] + 1j * jnp.tanh(out[:, 1])


def _energy(params, batch):
  return jnp.mean(
    jnp.real(_log_psi(params, batch["r"])) ** 2 + jnp.sin(_mlp(params, batch["r"])[:, 1])
  )


def _complex_curvature(params, batch):
  kfac_jax.register_normal_predictive_distribution(_log_psi(params, batch["r"])[:, None])


@pytest.mark.parametrize("mode", ["exact", "gradients"])
def test_complex_log_psi_via_curvature_fn(x64, mode):
  """The rows of the real and imaginary parts: F = Re E[J^H J] / var (var = 0.5)."""
  params, batch = _vmc_params(), {"r": _models.normal(11, (9, 3), jnp.float64)}
  reg = kfac_jax.Registration(
    _energy, params, batch, curvature_fn=_complex_curvature, estimation_mode=mode
  )
  assert reg.separate_loss
  grads = jax.jit(jax.grad(_energy))(params, batch)
  rng = jax.random.key(5)
  rows, d, info = _run(reg, params, batch, grads, rng)
  j = _jac(lambda p: _log_psi(p, batch["r"]), params)[:, 0]  # complex [N, P]
  parts = np.stack([j.real, j.imag], axis=1)  # [N, 2, P]
  if mode == "exact":
    f = np.real(j.conj().T @ j) / 0.5 / 9
  else:  # The same draws: the normal's sampled targets, from the same key.
    spec = reg.scan_batch(params, batch).losses[0]
    lp = _log_psi(params, batch["r"])[:, None]
    z = jnp.stack([lp.real, lp.imag], -1)
    v = np.asarray(_losses.output_cotangents(spec, (z,), mode, jax.random.split(rng, 1)[0], 1))
    g_n = np.einsum("nc,ncp->np", v[0, :, 0, :], parts)  # J_nᵀ v_n over the two parts.
    f = g_n.T @ g_n / 9
  u = np.asarray(rows.matrix)
  np.testing.assert_allclose(u.T @ u, f, atol=1e-12)
  assert rows.residuals is None  # The loss is not the tags'.
  _close(d, _solve_dense(f, _flat(grads), 1e-3), 1e-9)


@jax.custom_jvp
def _rule_energy(p, r):
  return jnp.mean(jnp.real(_log_psi(p, r)) ** 2)


@_rule_energy.defjvp
def _rule_energy_jvp(primals, tangents):
  p, r = primals
  lp, dlp = jax.jvp(lambda q: jnp.real(_log_psi(q, r)), (p,), (tangents[0],))
  kfac_jax.register_normal_predictive_distribution(lp[:, None])
  e_l = lp**2
  return jnp.mean(e_l), 2.0 * jnp.mean((e_l - jnp.mean(e_l)) * dlp)


def _vmc_rule_loss(params, batch):
  return _rule_energy(params, batch["r"])


def test_tags_in_a_custom_jvp_rule(x64):
  """FermiNet's form: the rule's gradient (centred, in the row space) and the rule's tag."""
  params, batch = _vmc_params(), {"r": _models.normal(12, (8, 3), jnp.float64)}
  reg = kfac_jax.Registration(_vmc_rule_loss, params, batch, estimation_mode="exact")
  assert reg.separate_loss
  grads = jax.jit(jax.grad(_vmc_rule_loss))(params, batch)
  _, d, info = _run(reg, params, batch, grads, damping=1e-4)
  j = _jac(lambda p: jnp.real(_log_psi(p, batch["r"])), params)[:, 0]
  f = j.T @ j / 0.5 / 8
  _close(d, _solve_dense(f, _flat(grads), 1e-4), 1e-8)
  assert not bool(info["remainder_kept"])  # The rule's gradient is in the row space.


# -- every estimation mode on a classifier: categorical with per-example weights ---------------


def _cls_preds(params, batch):
  return _mlp(params, batch["x"])


def _cls_loss(params, batch):
  logits = _cls_preds(params, batch)
  kfac_jax.register_softmax_cross_entropy_loss(logits, batch["y"], weight=batch["w"])
  logp = jax.nn.log_softmax(logits)
  nll = -jnp.take_along_axis(logp, batch["y"][:, None], axis=1)[:, 0]
  return jnp.mean(batch["w"] * nll)


def _cls_problem(n=6):
  params = _init(20, (3, 5, 4))
  batch = {
    "x": _models.normal(21, (n, 3), jnp.float64),
    "y": _models.integers(22, 0, 4, (n,)),
    "w": jnp.asarray(_models.np_rng(23).uniform(0.5, 2.0, n)),
  }
  return params, batch


@pytest.mark.parametrize("mode", MODES)
def test_estimation_modes_equal_the_dense_fisher_and_solve(x64, mode):
  params, batch = _cls_problem()
  num_samples = 1 if mode in ("exact", "exact_GGN", "empirical") else 3
  reg = kfac_jax.Registration(
    _cls_loss, params, batch, estimation_mode=mode, num_samples=num_samples, warn=False
  )
  grads = jax.jit(jax.grad(_cls_loss))(params, batch)
  rng = jax.random.key(7)
  rows, d, info = _run(reg, params, batch, grads, rng)
  j = _jac(lambda p: _cls_preds(p, batch), params)  # [N, C, P]
  logits = _cls_preds(params, batch)
  w = np.asarray(batch["w"])
  if mode in ("exact", "exact_GGN"):  # Independent of the library: diag(p) - p pᵀ.
    p = np.asarray(jax.nn.softmax(logits))
    fz = np.stack([np.diag(q) - np.outer(q, q) for q in p])
    f = np.einsum("n,nap,nab,nbq->pq", w, j, fz, j) / 6
  else:  # The same draws as the K-FAC statistics for the same key.
    spec = reg.scan_batch(params, batch).losses[0]
    key = jax.random.split(rng, 1)[0]
    v = np.asarray(
      _losses.output_cotangents(spec, (logits, batch["y"], batch["w"]), mode, key, num_samples)
    )
    jv = np.einsum("snc,ncp->snp", v, j)
    f = np.einsum("snp,snq->pq", jv, jv) / (6 * v.shape[0])
  u = np.asarray(rows.matrix)
  np.testing.assert_allclose(u.T @ u, f, atol=1e-12)
  _close(d, _solve_dense(f, _flat(grads), 1e-3), 1e-9)
  if mode in ("exact", "exact_GGN", "empirical"):  # ε spans the gradient: nothing remains.
    np.testing.assert_allclose(u.T @ np.asarray(rows.residuals), _flat(grads), atol=1e-13)
    assert not bool(info["remainder_kept"])
  else:
    assert rows.residuals is None and bool(info["remainder_kept"])


def test_residuals_of_bernoulli_and_normal_tags_give_the_gradient(x64):
  """Three tags on one example set; the loss is twice the tags' (c = 2 fitted)."""
  params, batch = _cls_problem(n=4)  # R = 4 (4 + 2 + 2) = 32 rows < P = 44.
  batch = dict(batch, t=_models.normal(24, (4, 4), jnp.float64))
  batch["yb"] = (batch["t"] > 0).astype(jnp.float64)

  def loss(params, b):
    z, yb = _cls_preds(params, b), b["yb"]
    kfac_jax.register_softmax_cross_entropy_loss(z, b["y"])
    kfac_jax.register_sigmoid_cross_entropy_loss(z[:, :2] * 1.5, yb[:, :2])
    kfac_jax.register_normal_predictive_distribution(z[:, 2:], b["t"][:, 2:], var=2.0)
    ce = -jnp.take_along_axis(jax.nn.log_softmax(z), b["y"][:, None], axis=1).mean()
    bce = jnp.sum(jnp.logaddexp(0, z[:, :2] * 1.5) - yb[:, :2] * z[:, :2] * 1.5, 1).mean()
    sq = jnp.sum((z[:, 2:] - b["t"][:, 2:]) ** 2, 1).mean() / 4.0
    return 2.0 * (ce + bce + sq)

  reg = kfac_jax.Registration(loss, params, batch, estimation_mode="exact", warn=False)
  grads = jax.jit(jax.grad(loss))(params, batch)
  rows, _, info = _run(reg, params, batch, grads)
  np.testing.assert_allclose(
    2.0 * np.asarray(rows.matrix).T @ np.asarray(rows.residuals), _flat(grads), atol=1e-13
  )
  assert float(info["loss_factor"]) == pytest.approx(2.0, rel=1e-12)
  assert not bool(info["remainder_kept"])


# -- SPRING, parameter space, chunks -----------------------------------------------------------


def test_spring_follows_its_recursion_over_three_steps(x64):
  """φ_k = (F_k + λ)⁻¹(g_k + λ μ φ_{k-1}) on three batches, from φ_0 = 0."""
  params, _ = _pinn_problem()
  damping, momentum = 1e-2, 0.9
  prev, prev_ref = None, np.zeros(_flat(params).size)
  _, batch0 = _pinn_problem()
  reg = kfac_jax.Registration(_pinn_loss, params, batch0, estimation_mode="exact", warn=False)
  for step in range(3):
    batch = {k: v + 0.1 * step for k, v in batch0.items()}
    grads = jax.jit(jax.grad(_pinn_loss))(params, batch)
    _, prev, _ = _run(reg, params, batch, grads, prev=prev, damping=damping, momentum=momentum)
    f = _pinn_fisher(params, batch)
    prev_ref = _solve_dense(f, _flat(grads), damping, prev_ref, momentum)
    _close(prev, prev_ref, 1e-10)
  assert np.linalg.norm(prev_ref) > 0


def test_more_rows_than_parameters_solves_in_parameter_space(x64):
  """R = 2 N = 60 > P = 17: the parameter-space solve, equal to the dense one and to the
  sample-space solve of the same rows."""
  loss, params, batch = _regression(30, (2, 3, 2), 30, l2=1e-3)
  reg = kfac_jax.Registration(loss, params, batch, estimation_mode="exact", warn=False)
  grads = jax.jit(jax.grad(loss))(params, batch)
  prev = jax.tree_util.tree_map(jnp.ones_like, params)
  rows, d, info = _run(reg, params, batch, grads, prev=prev, momentum=0.5)
  j = _jac(lambda p: _mlp(p, batch["x"]), params)
  f = 2.0 / 30 * np.einsum("nkp,nkq->pq", j, j)
  assert rows.matrix.shape == (60, 17)
  want = _solve_dense(f, _flat(grads), 1e-3, _flat(prev), 0.5)
  _close(d, want, 1e-10)

  @jax.jit
  def both(rows, g, prev):
    op = _solve._Sharded(rows.matrix, None, jnp.float64)
    args = (g, prev, jnp.float64(1e-3), jnp.float64(0.5), 1e-12)
    return _solve._sample_space(op, rows.residuals, *args)[0], _solve._parameter_space(op, *args)[0]

  sample, param = both(rows, jnp.asarray(_flat(grads)), jnp.asarray(_flat(prev)))
  _close(np.asarray(sample), want, 1e-8)
  _close(np.asarray(param), want, 1e-10)


def test_chunks_equal_one_pass(x64):
  """Chunks of 3 over 7 and 4 examples (the last chunk overlapping its predecessor), with a
  loss returning an aux: the same rows and direction."""
  params, batch = _pinn_problem()
  reg = kfac_jax.Registration(_pinn_loss, params, batch, estimation_mode="exact", warn=False)
  aux_loss = lambda p, b: (_pinn_loss(p, b), {"p": _pinn_preds(p, b)[0]})  # noqa: E731
  reg_aux = kfac_jax.Registration(
    aux_loss, params, batch, estimation_mode="exact", has_aux=True, warn=False
  )
  grads = jax.jit(jax.grad(_pinn_loss))(params, batch)
  whole = _run(reg, params, batch, grads)
  chunked = _run(reg_aux, params, batch, grads, chunk_size=3)
  np.testing.assert_allclose(chunked[0].matrix, whole[0].matrix, rtol=1e-14, atol=1e-14)
  _close(chunked[1], _flat(whole[1]), 1e-12)


# -- stability: the gradient in the row space, λ near the precision ---------------------------


def _regression(seed, sizes, n, l2=0.0, dtype=jnp.float64):
  """`(loss, params, batch)`: the MLP `sizes` fitted to n normal targets by squared error, plus
  `l2 · |params|²`; the inputs and targets are drawn with seeds `seed + 1`, `seed + 2`."""
  params = _init(seed, sizes, dtype)
  batch = {
    "x": _models.normal(seed + 1, (n, sizes[0]), dtype),
    "y": _models.normal(seed + 2, (n, sizes[-1]), dtype),
  }

  def loss(p, b):
    z = _mlp(p, b["x"])
    kfac_jax.register_squared_error_loss(z, b["y"])
    return jnp.mean(jnp.sum((z - b["y"]) ** 2, 1)) + l2 * _flat_sq(p)

  return loss, params, batch


def _ls_problem(dtype):
  """A least-squares fit, R = 2 N = 16 rows < P = 3·24 + 24 + 24·2 + 2 = 146, K well
  conditioned (κ ≈ 320); its residual ε = √(2/N) (z − y)."""
  return _regression(40, (3, 24, 2), 8, dtype=dtype)


def _ls_reference(damping):
  """Float64 `Jᵀ(K + λ)⁻¹ε` with the rows U = √(2/N) J, and the naive Woodbury solve."""
  loss, params, batch = _ls_problem(jnp.float64)
  u = np.sqrt(2 / 8) * _jac(lambda p: _mlp(p, batch["x"]), params).reshape(16, -1)
  eps = np.sqrt(2 / 8) * np.asarray(_mlp(params, batch["x"]) - batch["y"]).reshape(-1)
  k = u @ u.T
  g = u.T @ eps
  naive = (g - u.T @ np.linalg.solve(k + damping * np.eye(16), u @ g)) / damping
  return u.T @ np.linalg.solve(k + damping * np.eye(16), eps), naive, np.linalg.cond(k)


@pytest.mark.parametrize("separate", [False, True], ids=["tags_residual", "least_squares"])
def test_row_space_gradient_is_stable_in_float64_at_damping_1e_12(x64, separate):
  """The tags' residuals, and (a curvature function, so the loss is not the tags') the
  least-squares coefficients: both equal Jᵀ(K + λ)⁻¹ε, which the naive Woodbury solve misses."""
  loss, params, batch = _ls_problem(jnp.float64)
  want, naive, cond = _ls_reference(1e-12)
  assert cond < 1e3
  if separate:

    def tags(p, b):
      kfac_jax.register_squared_error_loss(_mlp(p, b["x"]), b["y"])

    def untagged(p, b):  # The same loss; its tags would not be read beside `curvature_fn`.
      return jnp.mean(jnp.sum((_mlp(p, b["x"]) - b["y"]) ** 2, 1))

    reg = kfac_jax.Registration(untagged, params, batch, curvature_fn=tags, estimation_mode="exact")
  else:
    reg = kfac_jax.Registration(loss, params, batch, estimation_mode="exact")
  grads = jax.jit(jax.grad(loss))(params, batch)
  rows, d, info = _run(reg, params, batch, grads, damping=1e-12)
  assert (rows.residuals is None) == separate
  _close(d, want, 1e-11)
  assert not bool(info["remainder_kept"])
  assert np.linalg.norm(naive - want) / np.linalg.norm(want) > 1e-5  # The test has teeth.


def test_row_space_gradient_is_stable_in_float32_at_damping_1e_3():
  assert not jax.config.jax_enable_x64
  loss, params, batch = _ls_problem(jnp.float32)
  reg = kfac_jax.Registration(loss, params, batch, estimation_mode="exact")
  grads = jax.jit(jax.grad(loss))(params, batch)
  rows, d, info = _run(reg, params, batch, grads, damping=1e-3)
  assert rows.matrix.dtype == jnp.float32 and jax.tree_util.tree_leaves(d)[0].dtype == jnp.float32
  with jax.enable_x64(True):
    want, _, _ = _ls_reference(1e-3)
  err = np.linalg.norm(_flat(d) - want) / np.linalg.norm(want)
  # Woodbury's form on the float32 gradient, in float32: g's rounding error amplified by 1/λ.
  u, g = np.asarray(rows.matrix), _flat(grads)
  k = (u @ u.T).astype(np.float32)
  naive = (
    g - u.T @ np.linalg.solve(k + np.float32(1e-3) * np.eye(16, dtype=np.float32), u @ g)
  ) / np.float32(1e-3)
  naive_err = np.linalg.norm(naive - want) / np.linalg.norm(want)
  assert err < 3e-5 and naive_err > 10 * err
  assert not bool(info["remainder_kept"])


# -- data parallel: 8 devices ------------------------------------------------------------------


def _parallel_problem():
  return _regression(50, (3, 6, 2), 16, l2=1e-2)


@pytest.mark.parametrize("how", ["shard_map", "pmap", "jit"])
def test_sharded_rows_equal_one_device(x64, how):
  """16 examples over 8 devices (4 rows each): the ring-assembled K and the direction equal
  the single-device ones; every device returns the same direction. Under plain jit with the
  batch sharded, no axis."""
  loss, params, batch = _parallel_problem()
  reg = kfac_jax.Registration(loss, params, batch, estimation_mode="exact", warn=False)
  grads = jax.jit(jax.grad(loss))(params, batch)
  prev = jax.tree_util.tree_map(lambda x: 0.1 * jnp.ones_like(x), params)
  _, want, want_info = _run(reg, params, batch, grads, prev=prev, momentum=0.5)

  def step(params, b, grads, prev):
    rows = kn.rows(reg, params, b, axis_name="data")
    k = _solve._Sharded(rows.matrix, "data", jnp.float64).kernel()
    d, info = kn.direction(rows, grads, prev, damping=1e-3, momentum=0.5, axis_name="data")
    return d, info["kernel_trace"], k, rows.matrix

  if how == "jit":
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    data = jax.device_put(batch, jax.sharding.NamedSharding(mesh, P("data")))
    _, d, _ = _run(reg, params, data, grads, prev=prev, momentum=0.5)
    _close(d, _flat(want), 1e-10)
    return
  if how == "pmap":
    local = jax.tree_util.tree_map(lambda x: x.reshape((8, 2) + x.shape[1:]), batch)
    rep = lambda t: jax.tree_util.tree_map(lambda x: jnp.broadcast_to(x, (8,) + x.shape), t)  # noqa: E731
    d, trace, k, u = jax.pmap(step, axis_name="data")(rep(params), local, rep(grads), rep(prev))
    for i in range(8):
      _close(jax.tree_util.tree_map(lambda x, i=i: x[i], d), _flat(want), 1e-10)
    k, u = k[0], u.reshape(-1, u.shape[-1])
  else:
    mesh = jax.make_mesh((8,), ("data",))
    fn = jax.shard_map(
      step,
      mesh=mesh,
      in_specs=(P(), P("data"), P(), P()),
      out_specs=(P(), P(), P(), P("data")),
      check_vma=False,
    )
    data = jax.device_put(batch, jax.sharding.NamedSharding(mesh, P("data")))
    d, trace, k, u = jax.jit(fn)(params, data, grads, prev)
    _close(d, _flat(want), 1e-10)
  u = np.asarray(u)
  np.testing.assert_allclose(np.asarray(k), u @ u.T, rtol=1e-13, atol=1e-14)
  np.testing.assert_allclose(np.ravel(trace)[0], want_info["kernel_trace"], rtol=1e-13)


# -- diagnostics and bad input -----------------------------------------------------------------


def test_example_mismatch_flags_outputs_that_mix_examples(x64):
  """Batch-centred outputs (BatchNorm's training mode) differ when an example is alone."""
  params, batch = _cls_problem()

  def loss(p, b):
    z = _mlp(p, b["x"])
    z = z - jnp.mean(z, axis=0)
    kfac_jax.register_squared_error_loss(z)
    return jnp.mean(jnp.sum(z**2, 1))

  reg = kfac_jax.Registration(loss, params, batch, estimation_mode="exact", warn=False)
  grads = jax.jit(jax.grad(loss))(params, batch)
  _, _, info = _run(reg, params, batch, grads)
  assert float(info["example_mismatch"]) > 0.1


def test_bad_arguments_are_named(x64):
  params, batch = _cls_problem()
  reg = kfac_jax.Registration(_cls_loss, params, batch, estimation_mode="exact", warn=False)
  with pytest.raises(ValueError, match="chunk_size"):
    kn.rows(reg, params, batch, chunk_size=0)
  reg_random = kfac_jax.Registration(_cls_loss, params, batch, warn=False)
  with pytest.raises(ValueError, match="rng"):
    kn.rows(reg_random, params, batch)
  rows = jax.eval_shape(lambda p, b: kn.rows(reg, p, b), params, batch)
  with pytest.raises(ValueError, match="grads"):
    kn.direction(rows, params[:1], damping=1e-3)
  with pytest.raises(ValueError, match="axis_name"):
    jax.eval_shape(
      lambda r: jax.vmap(
        lambda x: kn.direction(r, params, damping=1e-3, axis_name="i"), axis_name="i"
      )(jnp.zeros(2)),
      rows,
    )
