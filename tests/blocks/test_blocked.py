"""Blocked Kronecker factors (`kfac_jax/blocks/_blocked.py`) against their definition (float64):
the diagonal blocks of the full factors, and the damped block-diagonal Kronecker matrix."""

import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.flatten_util import ravel_pytree

import kfac_jax
from kfac_jax.blocks import _blocked, _linalg
from tests import _models


def _ce(logits, y):
  kfac_jax.register_softmax_cross_entropy_loss(logits, y)
  return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def _normal(seed, shape, scale=1.0):
  return _models.normal(seed, shape, jnp.float64, scale=scale)


@functools.cache  # Built once per kind for the module (float64: every caller runs under x64).
def _model(kind):
  """(loss_fn, params, batch, layer name, LayerConfig kwargs) with one `kind` layer whose sides
  are wider than a block size of 4, feeding a dense head."""
  y = _models.integers(115, 0, 3, (5,))
  if kind in ("dense", "reduce"):
    seq = kind == "reduce"
    params = {"l": {"w": _normal(110, (6, 7), 0.4), "b": _normal(111, (7,), 0.1)}}
    params["head"] = {"w": _normal(112, (7, 3), 0.4)}
    x = _normal(113, (5, 3, 6) if seq else (5, 6))

    def loss_fn(p, b):
      h = jnp.tanh(b["x"] @ p["l"]["w"] + p["l"]["b"])
      return _ce((h.mean(1) if seq else h) @ p["head"]["w"], b["y"])

    extra = {"defaults": {"dense": "reduce"}} if seq else {}
    return loss_fn, params, {"x": x, "y": y}, "l", extra
  if kind in ("conv", "kron_sua"):
    params = {"c": {"w": _normal(110, (3, 3, 2, 5), 0.4), "b": _normal(111, (5,), 0.1)}}
    params["head"] = {"w": _normal(112, (4 * 4 * 5, 3), 0.1)}
    x = _normal(113, (5, 4, 4, 2))

    def loss_fn(p, b):
      h = lax.conv_general_dilated(
        b["x"], p["c"]["w"], (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
      )
      h = jnp.tanh(h + p["c"]["b"])
      return _ce(h.reshape(h.shape[0], -1) @ p["head"]["w"], b["y"])

    extra = {"defaults": {"conv": "kron_sua"}} if kind == "kron_sua" else {}
    return loss_fn, params, {"x": x, "y": y}, "c", extra
  if kind == "embedding":
    params = {"e": {"t": _normal(110, (10, 9))}, "head": {"w": _normal(112, (9, 3), 0.3)}}
    ids = _models.integers(113, 0, 10, (5,))

    def loss_fn(p, b):
      return _ce(jnp.tanh(p["e"]["t"][b["ids"]]) @ p["head"]["w"], b["y"])

    return loss_fn, params, {"ids": ids, "y": y}, "e", {}
  if kind == "stacked":  # Two layers' kernels stacked, applied by a scan.
    params = {"s": {"w": _normal(110, (2, 6, 6), 0.4), "b": _normal(111, (2, 6), 0.1)}}
    params["head"] = {"w": _normal(112, (6, 3), 0.4)}
    x = _normal(113, (5, 6))

    def loss_fn(p, b):
      def body(h, wb):
        return jnp.tanh(h @ wb[0] + wb[1]), None

      h, _ = lax.scan(body, b["x"], (p["s"]["w"], p["s"]["b"]))
      return _ce(h @ p["head"]["w"], b["y"])

    return loss_fn, params, {"x": x, "y": y}, "s", {}
  assert kind == "shared"  # One kernel used twice: "kron_indep".
  params = {"cell": {"w": _normal(110, (6, 6), 0.4), "b": _normal(111, (6,), 0.1)}}
  params["head"] = {"w": _normal(112, (6, 3), 0.4)}
  x = _normal(113, (5, 6))

  def loss_fn(p, b):
    h = b["x"]
    for _ in range(2):
      h = jnp.tanh(h @ p["cell"]["w"] + p["cell"]["b"])
    return _ce(h @ p["head"]["w"], b["y"])

  return loss_fn, params, {"x": x, "y": y}, "cell", {}


def _estimator(loss_fn, params, batch, block_size, damping_mode="factored", **layers):
  cfg = kfac_jax.LayerConfig(block_size=block_size, **layers)
  # check_loss=False: the audit is tested in tests/test_audit.py; here it only compiles a program.
  est = kfac_jax.CurvatureEstimator(
    kfac_jax.Registration(
      loss_fn, params, batch, estimation_mode="exact", layers=cfg, check_loss=False
    ),
    compute_cholesky=damping_mode == "factored",
    compute_cholesky_inverse=damping_mode == "factored",
    config=kfac_jax.Config(damping_mode=damping_mode),
  )
  update = jax.jit(lambda p, b: est.update_curvature(est.init(p), p, b, jax.random.key(0), 0.0))
  return est, update(params, batch)


def _diag_blocks(f, k, b):
  """The k diagonal b×b blocks of the [n, n] matrix f, zero padded to k·b (by slicing)."""
  f = np.asarray(f)
  n = f.shape[0]
  out = np.zeros((k, b, b))
  for i in range(k):
    lo, hi = i * b, min((i + 1) * b, n)
    out[i, : hi - lo, : hi - lo] = f[lo:hi, lo:hi]
  return out


def _block_diag(f, k, b):
  """The block-diagonal part of f at blocks of b (the last one cut at n)."""
  f = np.asarray(f)
  mask = np.arange(f.shape[0]) // b
  return np.where(mask[:, None] == mask[None, :], f, 0.0)


@pytest.mark.parametrize(
  "n, bias, size, want",
  [
    (2048, False, 1024, (2, 1024)),
    (2049, True, 1024, (2, 1025)),  # A bias row adds no block.
    (1025, True, 1024, None),  # Nor tips a side over the size.
    (1025, False, 1024, (2, 513)),  # Equal blocks, not 1024 + 1.
    (4097, True, 1000, (5, 820)),
    (3, False, 4, None),
    (10_000, False, None, None),
  ],
)
def test_partition(n, bias, size, want):
  part = _blocked.partition(n, bias, size)
  assert part == want
  if part is not None:
    k, b = part
    assert k * b >= n and (k - 1) * b < n and k * b - n < k


@pytest.mark.parametrize(
  "kind", ["dense", "reduce", "conv", "kron_sua", "embedding", "shared", "stacked"]
)
def test_blocked_factors_are_the_diagonal_blocks_of_the_full_factors(x64, kind):
  loss_fn, params, batch, name, extra = _model(kind)
  full, fs = _estimator(loss_fn, params, batch, None, **extra)
  blocked, bs = _estimator(loss_fn, params, batch, 4, **extra)
  spec = next(s for s in blocked.layers if s.name == name)
  assert spec.block_size == 4 and "blocks of" in spec.note
  for side in ("a", "g"):
    f, fb = getattr(fs.factors[name], side), getattr(bs.factors[name], side)
    if f.ndim == 1:  # The embedding's A: a vector, never blocked.
      np.testing.assert_array_equal(fb, f)
      continue
    if kind == "stacked":  # A leading layer axis: each layer's factor blocked alike.
      assert spec.stack_size == 2 and fb.ndim == 4
      want = np.stack([_diag_blocks(x, fb.shape[1], fb.shape[-1]) for x in f])
      np.testing.assert_allclose(fb, want, rtol=1e-12, atol=1e-14)
      continue
    k, b = fb.shape[0], fb.shape[-1]
    assert fb.shape == (k, b, b) and (k - 1) * b < f.shape[0] <= k * b
    np.testing.assert_allclose(fb, _diag_blocks(f, k, b), rtol=1e-12, atol=1e-14)


@functools.cache
def _dense_factors(kind="dense"):
  """The full A, G (float64) of the dense layer `l` and its estimators with block size 4."""
  loss_fn, params, batch, name, extra = _model(kind)
  _, fs = _estimator(loss_fn, params, batch, None, **extra)
  a, g = (np.asarray(x) for x in fs.factors[name])
  return loss_fn, params, batch, name, extra, a, g


@pytest.mark.parametrize("damping_mode", ["factored", "eigen"])
def test_preconditioned_gradient_equals_the_dense_solve(x64, damping_mode):
  """(A_bd ⊗ G_bd, damped)⁻¹ g by `jnp.linalg.solve` on the dense Kronecker matrix, with π from
  the traces of the whole sides ("factored") or λ added to the product ("eigen")."""
  loss_fn, params, batch, name, extra, a, g = _dense_factors()
  est, state = _estimator(loss_fn, params, batch, 4, damping_mode, **extra)
  lam = 0.03

  @jax.jit
  def products(p, b, state):
    state = est.update_inverses(state, lam)
    grads = jax.grad(loss_fn)(p, b)
    return (
      grads,
      est.multiply_inverse(state, grads),
      est.multiply(state, grads),
      est.to_dense(state),
    )

  grads, got, back, dense_est = products(params, batch, state)
  got = got[name]
  a_bd, g_bd = _block_diag(a, 4, 4), _block_diag(g, 4, 4)  # A: 7 = 4 + 3; G: 7 = 4 + 3.
  if damping_mode == "factored":
    pi = math.sqrt((np.trace(a) / a.shape[0]) / (np.trace(g) / g.shape[0]))
    a_bd = a_bd + pi * math.sqrt(lam) * np.eye(a.shape[0])
    g_bd = g_bd + math.sqrt(lam) / pi * np.eye(g.shape[0])
    dense = np.kron(a_bd, g_bd)
  else:
    dense = np.kron(a_bd, g_bd) + lam * np.eye(a.shape[0] * g.shape[0])
  m = np.concatenate([grads[name]["w"], grads[name]["b"][None]], axis=0)  # [in + 1, out]
  want = np.asarray(jnp.linalg.solve(dense, m.reshape(-1))).reshape(m.shape)
  np.testing.assert_allclose(got["w"], want[:-1], rtol=1e-9, atol=1e-12)
  np.testing.assert_allclose(got["b"], want[-1], rtol=1e-9, atol=1e-12)
  # The damped block itself, and `to_dense`: the undamped A_bd ⊗ G_bd.
  back = back[name]
  np.testing.assert_allclose(
    np.concatenate([back["w"], back["b"][None]]).reshape(-1), dense @ m.reshape(-1), rtol=1e-10
  )
  flat, unravel = ravel_pytree(grads)
  undamped = unravel(np.asarray(dense_est) @ np.asarray(flat))[name]
  want = np.kron(_block_diag(a, 4, 4), _block_diag(g, 4, 4)) @ m.reshape(-1)
  np.testing.assert_allclose(
    np.concatenate([undamped["w"], undamped["b"][None]]).reshape(-1), want, rtol=1e-10
  )


def test_products_invert_each_other(x64):
  loss_fn, params, batch, name, extra, _, _ = _dense_factors()
  est, state = _estimator(loss_fn, params, batch, 4, **extra)

  @jax.jit
  def products(state, v):
    state = est.update_inverses(state, 0.05)
    return (
      est.multiply(state, est.multiply_inverse(state, v)),
      est.multiply_cholesky_inverse(state, est.multiply_cholesky(state, v)),
      est.multiply_cholesky_inverse(
        state, est.multiply_cholesky(state, v, transpose=True), transpose=True
      ),
    )

  rng = np.random.default_rng(7)
  v = jax.tree_util.tree_map(lambda p: rng.standard_normal(p.shape), params)
  for back in products(state, v):
    for x, y in zip(jax.tree_util.tree_leaves(back), jax.tree_util.tree_leaves(v)):
      np.testing.assert_allclose(x, y, rtol=1e-8, atol=1e-10)


def test_bias_row_adds_no_block_and_does_not_tip_the_size_policy():
  params = {"l": {"w": jnp.zeros((8, 8)), "b": jnp.zeros((8,))}}

  def loss_fn(p, b):
    return _ce(b["x"] @ p["l"]["w"] + p["l"]["b"], b["y"])

  batch = {"x": jnp.zeros((2, 8)), "y": jnp.zeros((2,), jnp.int32)}
  for cfg, want in (
    (kfac_jax.LayerConfig(block_size=4), ((2, 5, 5), (2, 4, 4))),
    (kfac_jax.LayerConfig(block_size=8), ((9, 9), (8, 8))),
    (kfac_jax.LayerConfig(block_size=None, max_factor_dim=8), ((9, 9), (8, 8))),
    (kfac_jax.LayerConfig(block_size=None, max_factor_dim=7), ((9,), (8,))),
  ):
    (spec,) = kfac_jax.Registration(loss_fn, params, batch, layers=cfg, check_loss=False).layers
    assert spec.factor_shapes == want, (cfg, spec.factor_shapes)


def test_block_size_per_layer_and_in_summary(x64):
  loss_fn, params, batch, _, _ = _model("dense")
  cfg = kfac_jax.LayerConfig(block_size=4, block_sizes={"head/*": None})
  specs = {
    s.name: s
    for s in kfac_jax.Registration(loss_fn, params, batch, layers=cfg, check_loss=False).layers
  }
  assert specs["l"].factor_shapes == ((2, 4, 4), (2, 4, 4))
  assert specs["l"].note == "input side 7 in 2 blocks of 4; output side 7 in 2 blocks of 4"
  assert specs["head"].factor_shapes == ((7, 7), (3, 3)) and specs["head"].note == ""
  table = kfac_jax.summary(
    registration=kfac_jax.Registration(loss_fn, params, batch, layers=cfg, check_loss=False)
  )
  assert specs["l"].note in table
  # The default block size leaves these narrow layers whole.
  specs = {
    s.name: s for s in kfac_jax.Registration(loss_fn, params, batch, check_loss=False).layers
  }
  assert {s.block_size for s in specs.values()} == {kfac_jax.LayerConfig().block_size}
  assert specs["l"].factor_shapes == ((7, 7), (7, 7)) and specs["l"].note == ""


@pytest.mark.parametrize(
  "kwargs, field",
  [
    ({"block_size": 0}, "block_size"),
    ({"block_size": 2.5}, "block_size"),
    ({"block_size": True}, "block_size"),
    ({"block_sizes": {"head/*": -3}}, "block_sizes['head/*']"),
  ],
)
def test_bad_block_size_is_named(kwargs, field):
  with pytest.raises(ValueError, match=re.escape(f"LayerConfig.{field} must be a positive int")):
    kfac_jax.LayerConfig(**kwargs)


def test_block_size_pattern_that_matches_nothing_is_an_error(x64):
  loss_fn, params, batch, _, _ = _model("dense")
  with pytest.raises(kfac_jax.RegistrationError, match="block_sizes: pattern 'nope/\\*'"):
    kfac_jax.Registration(
      loss_fn, params, batch, layers=kfac_jax.LayerConfig(block_sizes={"nope/*": 4})
    )


def _mlp_state_ratio(d, block_size):
  """K-FAC state bytes / parameter bytes of `kfac` on a d → 4d → d MLP with biases
  (shapes only: `jax.eval_shape`, nothing allocated)."""
  params = {
    "w1": jax.ShapeDtypeStruct((d, 4 * d), jnp.float32),
    "b1": jax.ShapeDtypeStruct((4 * d,), jnp.float32),
    "w2": jax.ShapeDtypeStruct((4 * d, d), jnp.float32),
    "b2": jax.ShapeDtypeStruct((d,), jnp.float32),
  }
  batch = {
    "x": jax.ShapeDtypeStruct((256, d), jnp.float32),
    "y": jax.ShapeDtypeStruct((256, d), jnp.float32),
  }

  def loss_fn(p, b):
    out = jax.nn.gelu(b["x"] @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]
    kfac_jax.register_squared_error_loss(out, b["y"])
    return 0.5 * jnp.mean(jnp.sum((out - b["y"]) ** 2, -1))

  tx = kfac_jax.kfac(
    registration=kfac_jax.Registration(  # No loss audit: it would run the 4096-wide MLP.
      loss_fn,
      params,
      batch,
      layers=kfac_jax.LayerConfig(block_size=block_size),
      check_loss=False,
    ),
    learning_rate=0.1,
  )
  state = jax.eval_shape(tx.init, params)

  def nbytes(t):
    return sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree_util.tree_leaves(t))

  return nbytes(state) / nbytes(params)


def test_state_of_a_wide_mlp_stays_near_the_parameters():
  default = kfac_jax.LayerConfig().block_size
  assert _mlp_state_ratio(1024, default) <= 5.0
  assert _mlp_state_ratio(4096, default) <= 2.0
  assert _mlp_state_ratio(1024, None) > 9.0  # Whole factors and their inverses.


def test_blocked_kfac_trains_under_jit(x64):
  loss_fn, params, batch, _, _ = _model("dense")
  layers = kfac_jax.LayerConfig(block_size=4)
  tx = kfac_jax.kfac(
    registration=kfac_jax.Registration(loss_fn, params, batch, layers=layers),
    learning_rate=0.3,
    inverse_every=1,
  )
  state = jax.jit(tx.init)(params)

  @jax.jit
  def step(params, state, rng):
    loss, grads, stats = kfac_jax.value_and_grad(
      registration=kfac_jax.Registration(loss_fn, params, batch, layers=layers, check_loss=False)
    )(params, batch, rng)
    updates, state = tx.update(grads, state, params, curvature_stats=stats)
    return optax.apply_updates(params, updates), state, loss

  losses = []
  for i in range(8):
    params, state, loss = step(params, state, jax.random.key(i))
    losses.append(float(loss))
  assert np.all(np.isfinite(losses)) and losses[-1] < 0.7 * losses[0], losses


@pytest.mark.parametrize("n", [128, 129])
def test_blocks_are_factorised_without_size_buckets(x64, n):
  """Blocks skip `_linalg`'s size buckets (a power of two is still moved 8 up): the same
  inverse and Cholesky factor."""
  x = _models.np_rng(n).standard_normal((2 * n, n))
  m = jax.device_put(x.T @ x / (2 * n) + 0.1 * np.eye(n))
  np.testing.assert_allclose(
    _linalg.spd_power(m, -1.0, buckets=False) @ m, np.eye(n), rtol=0, atol=1e-10
  )
  np.testing.assert_allclose(
    _linalg.cholesky(m, buckets=False), np.linalg.cholesky(np.asarray(m)), rtol=1e-10, atol=1e-12
  )
