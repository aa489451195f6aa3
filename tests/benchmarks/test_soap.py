"""The race's SOAP contestant (`benchmarks/soap.py`) against its definition, in float64."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from benchmarks import soap


def _reference(grads_seq, *, b1, b2, bs, eps, every, max_dim):
  """SOAP's updates for a sequence of gradient trees (lists of numpy arrays), written directly
  from the algorithm in `benchmarks/soap.py`'s docstring, one leaf at a time."""
  n_leaves = len(grads_seq[0])
  state = [None] * n_leaves
  out = []
  for t, grads in enumerate(grads_seq, start=1):
    k = t - 1  # the moments' steps: the first gradient only builds the factors and bases
    step = []
    for i, g in enumerate(grads):
      if g.ndim < 2:
        mu, nu = state[i] or (np.zeros_like(g), np.zeros_like(g))
        if t == 1:
          step.append(np.zeros_like(g))
          continue
        mu = b1 * mu + (1 - b1) * g
        nu = b2 * nu + (1 - b2) * g * g
        state[i] = (mu, nu)
        step.append((mu / (1 - b1**k)) / (np.sqrt(nu / (1 - b2**k)) + eps))
        continue
      gm = g.reshape(-1, g.shape[-1])
      m, n = gm.shape
      if state[i] is None:
        state[i] = dict(
          mu=np.zeros((m, n)),
          nu=np.zeros((m, n)),
          L=np.zeros((m, m)),
          R=np.zeros((n, n)),
          QL=np.eye(m),
          QR=np.eye(n),
        )
      s = state[i]
      s["L"] = bs * s["L"] + (1 - bs) * gm @ gm.T
      s["R"] = bs * s["R"] + (1 - bs) * gm.T @ gm
      if (t - 1) % every == 0:
        s["QL"] = np.linalg.eigh(s["L"])[1] if m <= max_dim else np.eye(m)
        s["QR"] = np.linalg.eigh(s["R"])[1] if n <= max_dim else np.eye(n)
      ql, qr = s["QL"], s["QR"]
      if t == 1:
        step.append(np.zeros_like(g))
        continue
      s["mu"] = b1 * s["mu"] + (1 - b1) * gm
      s["nu"] = b2 * s["nu"] + (1 - b2) * (ql.T @ gm @ qr) ** 2
      rot = (ql.T @ s["mu"] @ qr / (1 - b1**k)) / (np.sqrt(s["nu"] / (1 - b2**k)) + eps)
      step.append((ql @ rot @ qr.T).reshape(g.shape))
    out.append(step)
  return out


def test_soap_matches_its_definition(x64):
  """Five steps with bases refreshed every 2 (steps 1, 3, 5): a matrix, a conv-shaped kernel
  (leading dimensions flattened against the last), a matrix whose left side is longer than
  `max_precond_dim` (identity basis there) and a bias (plain Adam). The eigenvectors' signs do
  not matter: each enters the update twice. The matrices are square, so that the first
  gradient's factors have full rank: the basis of a null space is arbitrary."""
  shapes = [(4, 4), (2, 2, 1, 4), (6, 6), (4,)]
  rng = np.random.default_rng(0)
  grads_seq = [[rng.normal(size=s) for s in shapes] for _ in range(5)]
  kw = dict(b1=0.9, b2=0.8, eps=1e-8)
  tx = soap.scale_by_soap(**kw, shampoo_b=0.7, precondition_every=2, max_precond_dim=5)
  params = [jnp.zeros(s, jnp.float64) for s in shapes]
  state = tx.init(params)
  update = jax.jit(tx.update)
  ours = []
  for grads in grads_seq:
    u, state = update([jnp.asarray(g) for g in grads], state)
    ours.append([np.asarray(x) for x in u])
  ref = _reference(grads_seq, **kw, bs=0.7, every=2, max_dim=5)
  for t, (a, b) in enumerate(zip(ours, ref)):
    for i, (x, y) in enumerate(zip(a, b)):
      np.testing.assert_allclose(x, y, rtol=1e-9, atol=1e-12, err_msg=f"step {t + 1}, leaf {i}")
  assert state.leaves[2].left.shape == (0, 0)  # 6 > max_precond_dim: no factors
  assert state.leaves[1].left.shape == (4, 4)


def test_soap_on_vectors_is_adam(x64):
  """Leaves with fewer than two dimensions are plain Adam with SOAP's β₁, β₂ and ε, from the
  second gradient on (the first one's update is zero)."""
  rng = np.random.default_rng(1)
  params = {"b": jnp.zeros(7), "s": jnp.zeros(())}
  ours, adam = soap.soap(1e-2, b1=0.9, b2=0.99), optax.adam(1e-2, b1=0.9, b2=0.99, eps=1e-8)
  s1, s2 = jax.jit(ours.init)(params), jax.jit(adam.init)(params)
  update1, update2 = jax.jit(ours.update), jax.jit(adam.update)  # Eager, each op compiles.
  for t in range(5):
    g = {"b": jnp.asarray(rng.normal(size=7)), "s": jnp.asarray(rng.normal())}
    u1, s1 = update1(g, s1)
    if t == 0:
      assert all(not np.any(x) for x in jax.tree.leaves(u1))
      continue
    u2, s2 = update2(g, s2)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-12), u1, u2)


def test_soap_beats_adam_where_the_curvature_is_a_rotated_kronecker_product():
  """Minibatch least squares `‖x W B − y‖²`: its Hessian is `(B Bᵀ) ⊗ (xᵀx)`, both factors
  ill-conditioned and rotated away from the coordinate axes. SOAP, whose basis is that of the
  two factors, ends at under 0.7x Adam's loss, each at its best rate of a small grid."""
  rng = np.random.default_rng(2)
  r1, r2 = (np.linalg.qr(rng.normal(size=(n, n)))[0] for n in (12, 10))
  x = jnp.asarray(rng.normal(size=(1024, 12)) * np.logspace(0, 1, 12) @ r1, jnp.float32)
  b = jnp.asarray(r2 * np.logspace(0, 1, 10) @ r2.T, jnp.float32)
  y = x @ jnp.asarray(rng.normal(size=(12, 10)), jnp.float32) @ b

  def loss(w, rows):
    return 0.5 * jnp.mean((x[rows] @ w @ b - y[rows]) ** 2)

  def losses(make, grid):
    """The final loss at each rate of `grid`: one compiled step, the rate a hyperparameter."""
    tx = optax.inject_hyperparams(make)(learning_rate=grid[0])

    @jax.jit
    def step(w, s, rows):
      u, s = tx.update(jax.grad(loss)(w, rows), s)
      return optax.apply_updates(w, u), s

    out = []
    for lr in grid:
      w, order = jnp.zeros((12, 10)), np.random.default_rng(3).permutation(1024)
      state = jax.jit(tx.init)(w)
      state.hyperparams["learning_rate"] = jnp.asarray(lr, jnp.float32)
      for t in range(200):
        w, state = step(w, state, order[(t % 16) * 64 : (t % 16 + 1) * 64])
      out.append(float(loss(w, np.arange(1024))))
    return out

  start = float(loss(jnp.zeros((12, 10)), np.arange(1024)))
  grid = (1e-2, 3e-2, 1e-1)
  soap_loss = min(losses(lambda learning_rate: soap.soap(learning_rate), grid))
  adam_loss = min(losses(lambda learning_rate: optax.adam(learning_rate, b1=0.95, b2=0.95), grid))
  assert soap_loss < 0.7 * adam_loss < 1e-2 * start, (soap_loss, adam_loss, start)


def test_soap_rejects_a_zero_refresh_period():
  with pytest.raises(ValueError, match="precondition_every must be >= 1, got 0"):
    soap.scale_by_soap(precondition_every=0)
