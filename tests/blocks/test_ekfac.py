"""EKFAC (approx="ekfac") against its definition on tiny models, in float64.

George et al. (2018): with K-FAC's factors A = U_A Λ_A U_Aᵀ, G = U_G Λ_G U_Gᵀ and the
per-example gradients J_n (as `[in+1, out]` matrices, bias last), the scalings are
s = (1/N) Σ_n (U_Aᵀ J_n U_G)² and the preconditioned gradient U_A ((U_Aᵀ ∇ U_G) / (s + λ)) U_Gᵀ.
The references are computed with numpy from per-example gradients (jax.jacobian).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from jax.flatten_util import ravel_pytree

import kfac_jax
from tests import _models

EKFAC = kfac_jax.LayerConfig(defaults={"dense": "ekfac"})
SIZES = (4, 5, 3)
LAMBDA = 0.3


def _loss_fn(params, batch):
  return _models.softmax_loss(_models.jnp_mlp_apply)(params, batch)


def _per_example(params, batch):
  logits = _models.jnp_mlp_apply(params, batch["x"])
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])


# Jitted once at module level: compiled once per shape for every test.
_per_example_jacobian = jax.jit(jax.jacobian(_per_example))


def _setup(n=32, same_x=False, seed=0, dtype=jnp.float64):
  # On the host: an eager op compiles a program for each new shape.
  params = jax.tree.map(
    lambda p: jax.device_put(
      np.asarray(p) + (0.1 * np.arange(p.size) / p.size).astype(p.dtype).reshape(p.shape)
    ),
    _models.jnp_mlp_init(2 * seed, SIZES, dtype),
  )  # non-zero biases
  batch = _models.classification_batch(
    2 * seed + 1, n=n, din=SIZES[0], classes=SIZES[-1], dtype=dtype
  )
  if same_x:
    x = np.asarray(batch["x"])
    batch["x"] = jax.device_put(np.broadcast_to(x[:1], x.shape))
  return params, batch


def _run(params, batch, layers=None, damping_mode="factored"):
  """Statistics, an inverse update at LAMBDA, statistics again (EKFAC's s in that basis)."""
  # check_loss=False: the audit is tested in tests/test_audit.py; here it only compiles a program.
  est = kfac_jax.CurvatureEstimator(
    kfac_jax.Registration(
      _loss_fn, params, batch, estimation_mode="empirical", layers=layers, check_loss=False
    ),
    config=kfac_jax.Config(damping_mode=damping_mode),
  )
  return est, _jit_statistics_inverse_statistics(est, params, batch)


def _jit_statistics_inverse_statistics(est, params, batch):
  """`est`'s statistics, an inverse update at LAMBDA, statistics again, as one jitted program
  (op by op, each primitive would compile on its own)."""

  @jax.jit
  def run(params, batch):
    state = est.init(params)
    state = est.update_curvature(state, params, batch, None, ema_decay=0.0)
    state = est.update_inverses(state, LAMBDA)
    return est.update_curvature(state, params, batch, None, ema_decay=0.0)

  return run(params, batch)


def _per_example_matrices(params, batch):
  """{layer: J [N, in+1, out]}: per-example gradients of each layer as [W; b]."""
  jac = _per_example_jacobian(params, batch)
  return {
    name: np.concatenate([np.asarray(j["w"]), np.asarray(j["b"])[:, None, :]], axis=1)
    for name, j in jac.items()
  }


def _reference(params, batch, grads):
  """numpy EKFAC from the definition: per layer (U_A, U_G, s) and the preconditioned grads."""
  out, bases = {}, {}
  for name, j in _per_example_matrices(params, batch).items():
    n = j.shape[0]
    # With one row per example, the inputs x̄_n are J_n's rows divided by g_n = J_n's bias row:
    # A = (1/N) Σ x̄ x̄ᵀ from the activations directly.
    x = (
      np.asarray(batch["x"])
      if name == "layer0"
      else np.tanh(
        np.asarray(batch["x"]) @ np.asarray(params["layer0"]["w"])
        + np.asarray(params["layer0"]["b"])
      )
    )
    xb = np.concatenate([x, np.ones((n, 1))], axis=1)
    a = xb.T @ xb / n
    g_rows = j[:, -1, :]  # the bias gradient is the output gradient g_n
    g = g_rows.T @ g_rows / n
    ua, ug = np.linalg.eigh(a)[1], np.linalg.eigh(g)[1]
    s = np.mean(np.einsum("ai,naj,jb->nib", ua, j, ug) ** 2, axis=0)
    m = np.concatenate([np.asarray(grads[name]["w"]), np.asarray(grads[name]["b"])[None]])
    p = ua @ ((ua.T @ m @ ug) / (s + LAMBDA)) @ ug.T
    out[name] = {"w": p[:-1], "b": p[-1]}
    bases[name] = (ua, ug, s, a, g)
  return out, bases


def test_ekfac_is_registered_and_factors_are_kfacs(x64):
  params, batch = _setup()
  est, state = _run(params, batch, EKFAC)
  assert [(l.kind, l.approx) for l in est.layers] == [("dense", "ekfac")] * 2
  assert type(est.blocks[0]).__name__ == "EKFACBlock"
  _, bases = _reference(params, batch, jax.tree.map(jnp.zeros_like, params))
  for name, (_, _, s, a, g) in zip(("layer0", "layer1"), bases.values()):
    f = state.factors[name]
    np.testing.assert_allclose(f.a, a, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(f.g, g, rtol=1e-10, atol=1e-12)
    assert f.s.shape == s.shape == (a.shape[0], g.shape[0])


def test_preconditioned_gradient_equals_the_definition(x64):
  params, batch = _setup()
  est, state = _run(params, batch, EKFAC)
  kron_est, kron_state = _run(params, batch, None, damping_mode="eigen")

  @jax.jit
  def products(p, b, state, kron_state):
    grads = jax.grad(_loss_fn)(p, b)
    got = est.multiply_inverse(state, grads)
    return grads, got, kron_est.multiply_inverse(kron_state, grads), est.multiply(state, got)

  grads, got, kron, back = products(params, batch, state, kron_state)
  want, bases = _reference(params, batch, grads)
  for name in want:
    np.testing.assert_allclose(state.factors[name].s, bases[name][2], rtol=1e-8, atol=1e-12)
    for leaf in ("w", "b"):
      np.testing.assert_allclose(got[name][leaf], want[name][leaf], rtol=1e-8, atol=1e-12)
  # Differs from K-FAC here (many examples): the test can tell the two apart.
  assert not np.allclose(ravel_pytree(kron)[0], ravel_pytree(got)[0], rtol=1e-3)
  # exp = 1 is the inverse's inverse.
  np.testing.assert_allclose(ravel_pytree(back)[0], ravel_pytree(grads)[0], rtol=1e-8, atol=1e-12)


def test_to_dense_is_the_eigenbasis_with_the_scalings(x64):
  params, batch = _setup()
  est, state = _run(params, batch, EKFAC)
  _, bases = _reference(params, batch, jax.tree.map(jnp.zeros_like, params))
  flat, unravel = ravel_pytree(params)
  zero = jax.tree.map(jnp.zeros_like, params)
  want = np.zeros((flat.size, flat.size))
  for name, (ua, ug, s, _, _) in bases.items():
    for i in range(ua.shape[0]):
      for j in range(ug.shape[0]):
        m = np.outer(ua[:, i], ug[:, j])
        tree = dict(zero, **{name: {"w": jnp.asarray(m[:-1]), "b": jnp.asarray(m[-1])}})
        q = np.asarray(ravel_pytree(tree)[0])
        want += s[i, j] * np.outer(q, q)
  np.testing.assert_allclose(est.to_dense(state), want, rtol=1e-8, atol=1e-12)
  del unravel


@pytest.mark.parametrize("same_x", [False, True], ids=["one_example", "rank_one_inputs"])
def test_equals_kfac_with_eigen_damping_when_gradients_are_kronecker(x64, same_x):
  # One example: J = x̄ gᵀ; or every example with the same input (A of rank one, and so the
  # hidden layer's input too): J_n = x̄ g_nᵀ. Then s = eig(A) ⊗ eig(G) and EKFAC is K-FAC.
  params, batch = _setup(n=1 if not same_x else 8, same_x=same_x)
  est, state = _run(params, batch, EKFAC)
  kron_est, kron_state = _run(params, batch, None, damping_mode="eigen")

  @jax.jit
  def products(p, b, state, kron_state):
    grads = jax.grad(_loss_fn)(p, b)
    got = est.multiply_inverse(state, grads)
    want = kron_est.multiply_inverse(kron_state, grads)
    return got, want, est.to_dense(state), kron_est.to_dense(kron_state)

  got, want, dense, kron_dense = products(params, batch, state, kron_state)
  np.testing.assert_allclose(ravel_pytree(got)[0], ravel_pytree(want)[0], rtol=1e-8, atol=1e-10)
  np.testing.assert_allclose(dense, kron_dense, rtol=1e-8, atol=1e-10)


def test_before_the_first_inverse_update_the_scalings_are_the_diagonal_fisher(x64):
  params, batch = _setup()
  est = kfac_jax.CurvatureEstimator(
    kfac_jax.Registration(
      _loss_fn, params, batch, estimation_mode="empirical", layers=EKFAC, check_loss=False
    )
  )
  state = jax.jit(lambda p, b: est.update_curvature(est.init(p), p, b, None, ema_decay=0.0))(
    params, batch
  )
  for name, j in _per_example_matrices(params, batch).items():
    np.testing.assert_allclose(state.factors[name].s, np.mean(j**2, axis=0), rtol=1e-10)


def test_sequence_inputs_sum_positions_into_the_per_example_gradient(x64):
  params = {"w": _models.normal(30, (3, 4), jnp.float64), "b": jnp.ones(4, jnp.float64)}
  batch = {
    "x": _models.normal(31, (5, 2, 3), jnp.float64),
    "y": _models.integers(32, 0, 4, (5,)),
  }

  def logits(p, x):
    return (x @ p["w"] + p["b"]).sum(axis=1)

  def loss_fn(p, b):
    out = logits(p, b["x"])
    kfac_jax.register_softmax_cross_entropy_loss(out, b["y"])
    return optax.softmax_cross_entropy_with_integer_labels(out, b["y"]).mean()

  est = kfac_jax.CurvatureEstimator(
    kfac_jax.Registration(
      loss_fn, params, batch, estimation_mode="empirical", layers=EKFAC, check_loss=False
    )
  )
  state = _jit_statistics_inverse_statistics(est, params, batch)
  jac = _models.jit_jacobian(
    lambda p: optax.softmax_cross_entropy_with_integer_labels(logits(p, batch["x"]), batch["y"])
  )(params)
  j = np.concatenate([np.asarray(jac["w"]), np.asarray(jac["b"])[:, None]], axis=1)
  (name,) = state.factors
  cache = state.cache[name]
  ua, ug = np.asarray(cache.a_evecs), np.asarray(cache.g_evecs)
  s = np.mean(np.einsum("ai,naj,jb->nib", ua, j, ug) ** 2, axis=0)
  np.testing.assert_allclose(state.factors[name].s, s, rtol=1e-8, atol=1e-12)


class _CNN(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.tanh(nn.Conv(3, (2, 2))(x))
    return nn.Dense(2)(x.reshape(x.shape[0], -1))


def test_conv_scalings_are_the_per_example_fisher_in_the_eigenbasis(x64):
  batch = {
    "x": _models.normal(10, (6, 3, 3, 2), jnp.float64),
    "y": _models.integers(11, 0, 2, (6,)),
  }
  model = _CNN()
  params = jax.jit(  # Jitted: eager ops compile one by one.
    lambda k, x: jax.tree.map(lambda p: p.astype(jnp.float64), model.init(k, x))
  )(jax.random.key(12), batch["x"])

  def loss_fn(p, b):
    return _models.softmax_loss(model.apply)(p, b)

  layers = kfac_jax.LayerConfig(defaults={"dense": "ekfac", "conv": "ekfac"})
  est = kfac_jax.CurvatureEstimator(
    kfac_jax.Registration(
      loss_fn, params, batch, estimation_mode="empirical", layers=layers, check_loss=False
    )
  )
  state = _jit_statistics_inverse_statistics(est, params, batch)
  assert {(l.kind, l.approx) for l in est.layers} == {("conv", "ekfac"), ("dense", "ekfac")}
  # F_EKFAC = Σ s_ij q_ij q_ijᵀ with orthonormal q_ij (the Kronecker eigenbasis in parameter
  # space), so s_ij = q_ijᵀ F_EKFAC q_ij must equal q_ijᵀ F_exact q_ij, F_exact the empirical
  # Fisher (1/N) Σ_n ∇ℓ_n ∇ℓ_nᵀ: the definition of the scalings.
  flat, unravel = ravel_pytree(params)
  jac = jax.jit(
    _models.jit_jacobian(
      lambda f: optax.softmax_cross_entropy_with_integer_labels(
        model.apply(unravel(f), batch["x"]), batch["y"]
      )
    )
  )(flat)
  exact = np.asarray(jac).T @ np.asarray(jac) / jac.shape[0]
  dense = np.asarray(jax.jit(est.to_dense)(state))
  mask = _models.block_mask(est, params)
  q_f = np.linalg.eigh(dense)[1]
  np.testing.assert_allclose(
    np.diag(q_f.T @ dense @ q_f), np.diag(q_f.T @ (exact * mask) @ q_f), rtol=1e-6, atol=1e-10
  )
  # ... and it is not the plain K-FAC block (which differs from the exact one on a conv).
  kron = kfac_jax.CurvatureEstimator(
    kfac_jax.Registration(loss_fn, params, batch, estimation_mode="empirical", check_loss=False)
  )
  kron_dense = np.asarray(
    jax.jit(
      lambda p, b: kron.to_dense(kron.update_curvature(kron.init(p), p, b, None, ema_decay=0.0))
    )(params, batch)
  )
  assert not np.allclose(np.diag(q_f.T @ kron_dense @ q_f), np.diag(q_f.T @ dense @ q_f), rtol=1e-3)


def test_transform_and_optimizer_train_with_ekfac_layers():
  params, batch = _setup(n=64, dtype=jnp.float32)
  tx = kfac_jax.kfac(
    registration=kfac_jax.Registration(_loss_fn, params, batch, layers=EKFAC),
    learning_rate=0.1,
    momentum=0.9,
    damping=1e-2,
    inverse_every=3,
  )
  state = jax.jit(tx.init)(params)

  @jax.jit
  def step(params, state, rng):
    loss, grads, stats = kfac_jax.value_and_grad(_loss_fn)(params, batch, rng)
    updates, state = tx.update(grads, state, params, curvature_stats=stats)
    return optax.apply_updates(params, updates), state, loss

  losses = []
  rng = jax.random.key(0)
  p = params
  for _ in range(10):
    rng, sub = jax.random.split(rng)
    p, state, loss = step(p, state, sub)
    losses.append(float(loss))
  assert np.all(np.isfinite(losses)) and losses[-1] < 0.9 * losses[0], losses
  assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(state))

  opt = kfac_jax.Optimizer(
    registration=kfac_jax.Registration(_loss_fn, params, batch, layers=EKFAC, check_loss=False),
    learning_rate=None,
    momentum=None,
    damping=1e-2,
    use_adaptive_damping=True,
    inverse_every=3,
  )
  o_state = jax.jit(opt.init)(params)
  step_fn = jax.jit(opt.step)
  p, first = params, None
  for t in range(10):
    p, o_state, info = step_fn(p, o_state, batch, jax.random.key(t))
    first = float(info["loss"]) if first is None else first
  assert np.isfinite(float(info["loss"])) and float(info["loss"]) < first
  assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(p))


def test_sampled_targets_average_over_samples_as_the_diagonal_fisher(x64):
  # Before any inverse update (identity basis) s is the diagonal Fisher of the same vectors:
  # two sampled targets per example, averaged over samples and examples as "diagonal" does.
  params, batch = _setup(n=8)
  rng = jax.random.key(5)
  states = {}
  for approx in ("ekfac", "diagonal"):
    est = kfac_jax.CurvatureEstimator(
      kfac_jax.Registration(
        _loss_fn,
        params,
        batch,
        estimation_mode="gradients",
        num_samples=2,
        layers=kfac_jax.LayerConfig(defaults={"dense": approx}),
        check_loss=False,
      )
    )
    update = jax.jit(lambda p, b, r, est=est: est.update_curvature(est.init(p), p, b, r, 0.0))
    states[approx] = (est, update(params, batch, rng))
  est, state = states["ekfac"]
  for block in est.blocks:
    assert [p.rsplit("/", 1)[-1] for p in block.spec.param_paths] == ["w", "b"]
    s = np.asarray(state.factors[block.name].s)
    diag = np.asarray(states["diagonal"][1].factors[block.name].diag)
    np.testing.assert_allclose(s.ravel(), diag, rtol=1e-10, atol=1e-14)
  with pytest.raises(ValueError, match=r"block `layer0` \(approx='ekfac'\).*pass `cache=`"):
    est.blocks[0].multiply_undamped(
      state.factors["layer0"], [params["layer0"]["w"], params["layer0"]["b"]]
    )


# -- where EKFAC does not apply: clear errors, the size policy ---------------------------------


def test_size_policy_turns_a_huge_ekfac_side_diagonal():
  params = _models.jnp_mlp_init(0, (4, 40), jnp.float32)
  batch = _models.classification_batch(1, n=8, din=4, classes=40)
  cfg = kfac_jax.LayerConfig(defaults={"dense": "ekfac"}, max_factor_dim=16)
  (spec,) = kfac_jax.Registration(_loss_fn, params, batch, layers=cfg, check_loss=False).layers
  assert spec.approx == "kron_out_diag", spec
  assert "output side 40 > max_factor_dim 16" in spec.note
  (small,) = kfac_jax.Registration(
    _loss_fn,
    params,
    batch,
    layers=kfac_jax.LayerConfig(defaults={"dense": "ekfac"}),
    check_loss=False,
  ).layers
  assert small.approx == "ekfac" and small.note == ""


def test_ekfac_on_stacked_layers_equals_the_unrolled_layers(x64):
  """A scan over stacked [W; b] (one StackedBlock of EKFAC blocks, each layer's scalings in its
  own cache's eigenbasis) against the same three layers written out (three EKFAC blocks)."""
  depth, d = 3, 4

  def stacked(params, x):
    def body(h, wb):
      return jnp.tanh(h @ wb[0] + wb[1]), None

    return jax.lax.scan(body, x, (params["w"], params["b"]))[0]

  def unrolled(params, x):
    for i in range(depth):
      x = jnp.tanh(x @ params[f"w{i}"] + params[f"b{i}"])
    return x

  p_st = {
    "w": _models.normal(0, (depth, d, d), jnp.float64, scale=0.5),
    "b": _models.normal(1, (depth, d), jnp.float64, scale=0.1),
  }
  # Sorted keys b0 b1 b2 w0 w1 w2 ravel in the stacked leaves' order: one to_dense ordering.
  p_un = {f"{n}{i}": p_st[n][i] for n in ("w", "b") for i in range(depth)}
  batch = _models.classification_batch(2, n=8, din=d, classes=d, dtype=jnp.float64)
  results = []
  for apply, params in ((stacked, p_st), (unrolled, p_un)):
    loss_fn = _models.softmax_loss(apply)
    est = kfac_jax.CurvatureEstimator(
      kfac_jax.Registration(
        loss_fn, params, batch, estimation_mode="empirical", layers=EKFAC, check_loss=False
      )
    )
    state = est.init(params)

    @jax.jit
    def run(state, params):  # The second statistics use the inverse update's eigenbases.
      state = est.update_curvature(state, params, batch, None, ema_decay=0.5)
      state = est.update_inverses(state, LAMBDA)
      state = est.update_curvature(state, params, batch, None, ema_decay=0.5)
      nat = est.multiply_inverse(state, jax.grad(loss_fn)(params, batch))
      return state, ravel_pytree(nat)[0], est.to_dense(state)

    results.append((est, *run(state, params)))
  (est_st, s_st, nat_st, dense_st), (est_un, s_un, nat_un, dense_un) = results
  assert [b.spec.stack_size for b in est_st.blocks] == [depth]
  assert [b.spec.approx for b in est_un.blocks] == ["ekfac"] * depth
  (f_st,) = s_st.factors.values()
  assert isinstance(f_st, kfac_jax.blocks.EKFACFactors) and f_st.s.shape == (depth, d + 1, d)
  order = np.argsort([b.spec.leaf_indices[0] for b in est_un.blocks])  # Layer order by leaf.
  s_layers = [s_un.factors[n].s for n in np.asarray(list(s_un.factors))[order]]
  np.testing.assert_allclose(f_st.s, np.stack(s_layers), rtol=1e-10, atol=1e-14)
  (c_st,) = s_st.cache.values()  # A rotated basis: the statistics really read the cache.
  assert c_st.a_evecs.shape == (depth, d + 1, d + 1)
  assert not np.allclose(np.abs(c_st.a_evecs[0]), np.eye(d + 1), atol=1e-3)
  np.testing.assert_allclose(dense_st, dense_un, rtol=1e-10, atol=1e-14)
  np.testing.assert_allclose(nat_st, nat_un, rtol=1e-9, atol=1e-12)


def test_ekfac_on_concatenated_kernels_equals_ekfac_on_the_concatenation(x64):
  """Two gate kernels concatenated before one product (an LSTM cell's layout: a ConcatBlock
  around an EKFAC block) against the concatenated kernel as one leaf."""
  gates = {g: _models.normal(30 + i, (3, 2), jnp.float64) for i, g in enumerate(("ga", "gb"))}
  head = _models.normal(32, (4, 3), jnp.float64)

  def apply(p, x):
    kernel = p["kernel"] if "kernel" in p else jnp.concatenate([p["ga"], p["gb"]], axis=-1)
    return jnp.tanh(x @ kernel) @ p["head"]

  batch = _models.classification_batch(33, n=6, din=3, classes=3, dtype=jnp.float64)
  results = []
  for params in (
    dict(gates, head=head),
    {"kernel": jnp.concatenate(list(gates.values()), -1), "head": head},
  ):
    loss_fn = _models.softmax_loss(apply)
    est = kfac_jax.CurvatureEstimator(
      kfac_jax.Registration(
        loss_fn, params, batch, estimation_mode="empirical", layers=EKFAC, check_loss=False
      )
    )

    @jax.jit
    def run(state, params):
      state = est.update_curvature(state, params, batch, None, ema_decay=0.0)
      state = est.update_inverses(state, LAMBDA)
      state = est.update_curvature(state, params, batch, None, ema_decay=0.0)
      return est.multiply_inverse(state, jax.grad(loss_fn)(params, batch))

    results.append((est, run(est.init(params), params)))
  (est_c, u_c), (est_p, u_p) = results
  assert [len(s.param_paths) for s in est_c.layers] == [2, 1]
  assert [s.approx for s in est_c.layers] == [s.approx for s in est_p.layers] == ["ekfac"] * 2
  joined = jnp.concatenate([u_c["ga"], u_c["gb"]], axis=-1)
  np.testing.assert_allclose(joined, u_p["kernel"], rtol=1e-9, atol=1e-12)
  np.testing.assert_allclose(u_c["head"], u_p["head"], rtol=1e-9, atol=1e-12)


def test_ekfac_with_sharded_inverses_is_an_error_when_the_estimator_is_built():
  params, batch = _setup(dtype=jnp.float32)
  reg = kfac_jax.Registration(_loss_fn, params, batch, layers=EKFAC, check_loss=False)
  with pytest.raises(ValueError, match=r"layer `layer0`: approx='ekfac' needs its cache"):
    kfac_jax.CurvatureEstimator(reg, config=kfac_jax.Config(inverse_storage="sharded"))
