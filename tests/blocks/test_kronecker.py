"""Convolution, scale-and-shift and embedding layers against exact Fisher blocks (float64)."""

import math
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax import lax
from jax.flatten_util import ravel_pytree

import kfac_jax
from kfac_jax import _curvature
from tests import _models

pytestmark = pytest.mark.numerics  # Run again with XLA's optimizations on.


def _ce(logits, y):
  kfac_jax.register_softmax_cross_entropy_loss(logits, y)
  return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def _per_example_ce(logits, y):
  return optax.softmax_cross_entropy_with_integer_labels(logits, y)


def _estimate(loss_fn, params, batch, rng=None, mode="empirical"):
  # check_loss=False: the audit is tested in tests/test_audit.py; here it only compiles a program.
  est = kfac_jax.CurvatureEstimator(
    kfac_jax.Registration(loss_fn, params, batch, estimation_mode=mode, check_loss=False)
  )
  state, dense = _fit(est, params, batch, rng, dense=True)
  return est, state, np.asarray(dense)


def _fit(est, params, batch, rng=None, damping=None, dense=False):
  """`est`'s state after one `update_curvature` (then `update_inverses(damping)`), and with
  `dense` its `to_dense`, as one program: called eagerly each small operation compiles alone."""

  def run(p, b, r):
    state = est.update_curvature(est.init(p), p, b, r, ema_decay=0.0)
    if damping is not None:
      state = est.update_inverses(state, damping)
    return (state, est.to_dense(state)) if dense else state

  return jax.jit(run)(params, batch, rng)


def _exact_empirical(per_example_fn, params, batch):
  """(1/N) Σ_n ∇ℓ_n ∇ℓ_nᵀ from per-example gradients (jax.jacobian)."""
  flat, unravel = ravel_pytree(params)
  jac = _models.jit_jacobian(lambda f: per_example_fn(unravel(f), batch))(flat)
  jac = np.asarray(jac)
  return jac.T @ jac / jac.shape[0]


def _group_mask(sizes_and_groups):
  groups = np.concatenate([g for g in sizes_and_groups])
  return groups[:, None] == groups[None, :]


# -- convolutions --------------------------------------------------------------------------------


def test_one_by_one_conv_equals_dense(x64):
  x = _models.normal(0, (3, 4, 5, 2), jnp.float64)
  y = _models.integers(1, 0, 3, (3, 4, 5))
  w = _models.normal(2, (2, 3), jnp.float64)
  b = _models.normal(3, (3,), jnp.float64)

  def conv_loss(p, batch):
    out = (
      lax.conv_general_dilated(
        batch["x"], p["w"], (1, 1), "VALID", dimension_numbers=("NHWC", "HWIO", "NHWC")
      )
      + p["b"]
    )
    return _ce(out, batch["y"])

  def dense_loss(p, batch):
    return _ce(batch["x"] @ p["w"] + p["b"], batch["y"])

  batch = {"x": x, "y": y}
  conv_p, dense_p = {"w": w.reshape(1, 1, 2, 3), "b": b}, {"w": w, "b": b}
  assert [
    l.kind
    for l in kfac_jax.Registration(conv_loss, conv_p, batch, strict=True, check_loss=False).layers
  ] == ["conv"]
  _, _, conv_f = _estimate(conv_loss, conv_p, batch)
  _, _, dense_f = _estimate(dense_loss, dense_p, batch)
  np.testing.assert_allclose(conv_f, dense_f, rtol=1e-12, atol=1e-14)
  _, _, conv_g = _estimate(conv_loss, conv_p, batch, jax.random.key(3), "gradients")
  _, _, dense_g = _estimate(dense_loss, dense_p, batch, jax.random.key(3), "gradients")
  np.testing.assert_allclose(conv_g, dense_g, rtol=1e-12, atol=1e-14)


# Each case has one output location, so K-FAC for one example is the exact outer product.
_CONV_CASES = {
  "1d_dilated": dict(
    x=(1, 5, 2),
    k=(3, 2, 4),
    strides=(1,),
    padding="VALID",
    rhs_dilation=(2,),
    dn=("NWC", "WIO", "NWC"),
  ),
  "1d_lhs_dilated": dict(
    x=(1, 2, 3),
    k=(3, 3, 2),
    strides=(1,),
    padding=((0, 0),),
    lhs_dilation=(2,),
    dn=("NWC", "WIO", "NWC"),
  ),
  "2d_strided_same": dict(
    x=(1, 2, 2, 3), k=(3, 3, 3, 2), strides=(2, 2), padding="SAME", dn=("NHWC", "HWIO", "NHWC")
  ),
  "2d_dilated_nchw": dict(
    x=(1, 2, 3, 3),
    k=(3, 2, 2, 2),
    strides=(1, 1),
    padding="VALID",
    rhs_dilation=(2, 2),
    dn=("NCHW", "OIHW", "NCHW"),
  ),
  "2d_explicit_pad": dict(
    x=(1, 3, 2, 2),
    k=(2, 2, 3, 3),
    strides=(2, 1),
    padding=((1, 0), (0, 0)),
    dn=("NCHW", "HWIO", "NHWC"),
  ),
  "3d": dict(
    x=(1, 2, 2, 2, 2),
    k=(2, 2, 2, 2, 3),
    strides=(1, 1, 1),
    padding="VALID",
    dn=("NDHWC", "DHWIO", "NDHWC"),
  ),
}


@pytest.mark.parametrize("case", sorted(_CONV_CASES))
def test_conv_single_location_equals_gradient_outer_product(x64, case):
  c = _CONV_CASES[case]
  x = _models.normal(10, c["x"], jnp.float64)
  params = {
    "w": _models.normal(11, c["k"], jnp.float64),
    "b": _models.normal(12, (c["k"][c["dn"][1].index("O")],), jnp.float64),
  }

  def loss_fn(p, batch):
    out = lax.conv_general_dilated(
      batch["x"],
      p["w"],
      c["strides"],
      c["padding"],
      lhs_dilation=c.get("lhs_dilation"),
      rhs_dilation=c.get("rhs_dilation"),
      dimension_numbers=c["dn"],
    )
    feat = c["dn"][2].index("C")
    assert np.prod(out.shape) == out.shape[feat], out.shape  # One output location.
    bias_shape = [1] * out.ndim
    bias_shape[feat] = -1
    logits = (out + p["b"].reshape(bias_shape)).reshape(1, -1)
    return _ce(logits, batch["y"])

  batch = {"x": x, "y": jnp.array([1])}
  layers = kfac_jax.Registration(loss_fn, params, batch, strict=True, check_loss=False).layers
  assert [(l.kind, l.param_paths) for l in layers] == [("conv", ("w", "b"))]
  _, _, dense = _estimate(loss_fn, params, batch)
  g = np.asarray(ravel_pytree(jax.grad(loss_fn)(params, batch))[0])
  np.testing.assert_allclose(dense, np.outer(g, g), rtol=1e-10, atol=1e-12)


def _conv_model(approx=None, groups=1, cin=4, cout=4, bias=True, use_tag=True):
  """A strided 2-d conv (NHWC, SAME) then a dense readout, the conv optionally tagged by hand."""

  def apply(p, x):
    kw = dict(
      window_strides=(2, 1),
      padding="SAME",
      dimension_numbers=("NHWC", "HWIO", "NHWC"),
      feature_group_count=groups,
    )
    y = lax.conv_general_dilated(x, p["conv"]["w"], **kw)
    if bias:
      y = y + p["conv"]["b"]
    if use_tag:
      y = kfac_jax.register_conv(
        y, x, p["conv"]["w"], p["conv"]["b"] if bias else None, approx=approx, **kw
      )
    return jnp.tanh(y).reshape(x.shape[0], -1) @ p["out"]["w"]

  rng = np.random.default_rng(2)  # numpy: a jax.random draw compiles a program per shape.
  params = {
    "conv": {"w": 0.5 * rng.standard_normal((2, 3, cin // groups, cout))},
    "out": {"w": rng.standard_normal((2 * 3 * cout, 3)) / 5},
  }
  if bias:
    params["conv"]["b"] = 0.1 * rng.standard_normal(cout)
  batch = {"x": rng.standard_normal((3, 4, 3, cin)), "y": rng.integers(0, 3, 3, dtype=np.int32)}
  return apply, params, batch


def _conv_block(params, dense):
  n = sum(v.size for v in jax.tree_util.tree_leaves(params["conv"]))
  return dense[:n, :n]


@pytest.mark.parametrize("approx", ["diagonal", "full"])
def test_conv_diagonal_and_full_equal_exact_empirical_fisher(x64, approx):
  apply, params, batch = _conv_model(approx)
  loss_fn = lambda p, b: _ce(apply(p, b["x"]), b["y"])
  est, _, dense = _estimate(loss_fn, params, batch)
  assert est.layers[0].approx == approx
  exact = _exact_empirical(lambda p, b: _per_example_ce(apply(p, b["x"]), b["y"]), params, batch)
  n = _conv_block(params, dense).shape[0]
  want = exact[:n, :n] if approx == "full" else np.diag(np.diag(exact[:n, :n]))
  np.testing.assert_allclose(_conv_block(params, dense), want, rtol=1e-10, atol=1e-13)


def _patches_brute_force(x, kh, kw, stride, pads):
  """[N·L, kh·kw·C] patches, (channel, window) row-major, by explicit loops."""
  n = x.shape[0]
  xp = np.pad(np.asarray(x), ((0, 0), pads[0], pads[1], (0, 0)))
  rows = []
  for i in range(n):
    for oh in range(0, xp.shape[1] - kh + 1, stride[0]):
      for ow in range(0, xp.shape[2] - kw + 1, stride[1]):
        win = xp[i, oh : oh + kh, ow : ow + kw, :]  # [kh, kw, C]
        rows.append(win.transpose(2, 0, 1).reshape(-1))
  return np.stack(rows)


def test_conv_kron_factors_by_brute_force(x64):
  apply, params, batch = _conv_model("kron")
  loss_fn = lambda p, b: _ce(apply(p, b["x"]), b["y"])
  est, state, _ = _estimate(loss_fn, params, batch)
  f = state.factors[est.layers[0].name]
  # SAME padding, strides (2, 1), window (2, 3) on a 4x3 input: pads ((0, 0), (1, 1)).
  p = _patches_brute_force(batch["x"], 2, 3, (2, 1), ((0, 0), (1, 1)))
  p = np.concatenate([p, np.ones((p.shape[0], 1))], axis=1)
  np.testing.assert_allclose(f.a, p.T @ p / p.shape[0], rtol=1e-12)


def test_conv_kron_sua_factor_by_definition(x64):
  apply, params, batch = _conv_model("kron_sua")
  loss_fn = lambda p, b: _ce(apply(p, b["x"]), b["y"])
  est, state, _ = _estimate(loss_fn, params, batch)
  est_k, state_k, _ = _estimate(
    lambda p, b: _ce(_conv_model("kron")[0](p, b["x"]), b["y"]), params, batch
  )
  f, fk = state.factors[est.layers[0].name], state_k.factors[est_k.layers[0].name]
  np.testing.assert_allclose(f.g, fk.g, rtol=1e-12)  # Same output factor as "kron".
  a = np.asarray(batch["x"]).reshape(-1, 4)  # All input locations of all examples.
  m2, mu = a.T @ a / a.shape[0], a.mean(0)
  w = 2 * 3
  d = 4 * w
  want = np.ones((d + 1, d + 1))
  for i in range(d):
    for j in range(d):
      (ci, di), (cj, dj) = divmod(i, w), divmod(j, w)
      want[i, j] = m2[ci, cj] if di == dj else mu[ci] * mu[cj]
    want[i, d] = want[d, i] = mu[i // w]
  np.testing.assert_allclose(f.a, want, rtol=1e-12, atol=1e-14)


def test_depthwise_conv_defaults_to_exact_diagonal(x64):
  apply, params, batch = _conv_model(groups=4, cin=4, cout=8, use_tag=False)
  loss_fn = lambda p, b: _ce(apply(p, b["x"]), b["y"])
  layers = kfac_jax.Registration(loss_fn, params, batch, strict=True, check_loss=False).layers
  assert [(l.kind, l.approx) for l in layers] == [("conv", "diagonal"), ("dense", "kron")]
  _, _, dense = _estimate(loss_fn, params, batch)
  exact = _exact_empirical(lambda p, b: _per_example_ce(apply(p, b["x"]), b["y"]), params, batch)
  n = _conv_block(params, dense).shape[0]
  np.testing.assert_allclose(
    _conv_block(params, dense), np.diag(np.diag(exact[:n, :n])), rtol=1e-10, atol=1e-13
  )


def test_grouped_conv_per_group_kronecker_single_example(x64):
  """Batch 1, one output location: each group's block is that group's exact outer product."""
  groups, cin, cout = 2, 4, 6
  params = {
    "w": _models.normal(50, (2, 2, cin // groups, cout), jnp.float64),
    "b": _models.normal(51, (cout,), jnp.float64),
  }
  batch = {"x": _models.normal(52, (1, 2, 2, cin), jnp.float64), "y": jnp.array([2])}

  def loss_fn(p, b):
    y = (
      lax.conv_general_dilated(
        b["x"],
        p["w"],
        (1, 1),
        "VALID",
        feature_group_count=groups,
        dimension_numbers=("NHWC", "HWIO", "NHWC"),
      )
      + p["b"]
    )
    return _ce(y.reshape(1, -1), b["y"])

  est, _, dense = _estimate(loss_fn, params, batch)
  assert est.layers[0].factor_shapes == ((2, 9, 9), (2, 3, 3))
  g = np.asarray(ravel_pytree(jax.grad(loss_fn)(params, batch))[0])
  out_group = np.arange(cout) // (cout // groups)
  mask = _group_mask([np.broadcast_to(out_group, (2, 2, 2, cout)).ravel(), out_group])
  np.testing.assert_allclose(dense, np.outer(g, g) * mask, rtol=1e-10, atol=1e-12)


# -- scale and shift -----------------------------------------------------------------------------


class _NormMLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.Dense(5)(x)
    h = nn.LayerNorm()(h)
    return nn.Dense(3)(jnp.tanh(h))


@pytest.mark.parametrize("approx", ["full", "diagonal"])
def test_scale_and_shift_equals_exact_fisher_block(x64, approx):
  batch = {
    "x": _models.normal(0, (4, 2, 3), jnp.float64),  # A time axis, too.
    "y": _models.integers(1, 0, 3, (4, 2)),
  }
  model = _NormMLP()
  params = jax.jit(  # Jitted: eager ops compile one by one.
    lambda k, x: jax.tree_util.tree_map(
      lambda v: v.astype(jnp.float64) + 0.3,
      model.init(k, x),  # Non-trivial scale and bias.
    )
  )(jax.random.key(1), batch["x"])

  def per_example(p, b):
    return _per_example_ce(model.apply(p, b["x"]), b["y"]).sum(-1)

  def loss_fn(p, b):
    logits = model.apply(p, b["x"])
    kfac_jax.register_softmax_cross_entropy_loss(logits, b["y"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, b["y"]).sum(-1).mean()

  if approx == "diagonal":  # The same layer, tagged by hand.

    def apply(p, x):
      h = x @ p["params"]["Dense_0"]["kernel"] + p["params"]["Dense_0"]["bias"]
      mean = h.mean(-1, keepdims=True)
      xhat = (h - mean) * lax.rsqrt(((h - mean) ** 2).mean(-1, keepdims=True) + 1e-6)
      ln = p["params"]["LayerNorm_0"]
      h = kfac_jax.register_scale_and_shift(
        xhat * ln["scale"] + ln["bias"], xhat, ln["scale"], ln["bias"], approx="diagonal"
      )
      d = p["params"]["Dense_1"]
      return jnp.tanh(h) @ d["kernel"] + d["bias"]

    np.testing.assert_allclose(
      apply(params, batch["x"]), model.apply(params, batch["x"]), rtol=1e-6
    )
    per_example = lambda p, b: _per_example_ce(apply(p, b["x"]), b["y"]).sum(-1)
    loss_fn = lambda p, b: _ce_seq(apply(p, b["x"]), b["y"])

  est, _, dense = _estimate(loss_fn, params, batch)
  ln = [l for l in est.layers if l.kind == "scale_and_shift"]
  assert [(l.name, l.approx) for l in ln] == [("params/LayerNorm_0", approx)]
  exact = _exact_empirical(per_example, params, batch)
  sizes = [v.size for v in jax.tree_util.tree_leaves(params)]
  off = np.concatenate([[0], np.cumsum(sizes)])
  idx = np.concatenate([np.arange(off[j], off[j + 1]) for j in ln[0].leaf_indices])
  want = exact[np.ix_(idx, idx)]
  if approx == "diagonal":
    want = np.diag(np.diag(want))
  np.testing.assert_allclose(dense[np.ix_(idx, idx)], want, rtol=1e-10, atol=1e-13)


def _ce_seq(logits, y):
  kfac_jax.register_softmax_cross_entropy_loss(logits, y)
  return optax.softmax_cross_entropy_with_integer_labels(logits, y).sum(-1).mean()


# -- embeddings ----------------------------------------------------------------------------------


def test_embedding_one_id_equals_gradient_outer_product(x64):
  params = {
    "table": _models.normal(0, (6, 3), jnp.float64),
    "w": _models.normal(1, (3, 4), jnp.float64),
  }

  def loss_fn(p, b):
    return _ce(jnp.take(p["table"], b["ids"], axis=0) @ p["w"], b["y"])

  batch = {"ids": jnp.array([4]), "y": jnp.array([1])}
  est, _, dense = _estimate(loss_fn, params, batch)
  assert [l.kind for l in est.layers] == ["embedding", "dense"]
  g = np.asarray(ravel_pytree(jax.grad(loss_fn)(params, batch))[0])
  n = 18
  np.testing.assert_allclose(dense[:n, :n], np.outer(g[:n], g[:n]), rtol=1e-10, atol=1e-13)


def test_embedding_equals_dense_block_on_one_hot_inputs(x64):
  """Diagonal input factor = the dense block's (diagonal) E[one-hot one-hotᵀ], with sequences."""
  vocab = 7
  table = _models.normal(10, (vocab, 3), jnp.float64)
  w = _models.normal(11, (3, 4), jnp.float64)
  batch = {"ids": _models.integers(12, 0, vocab, (5, 3)), "y": jnp.zeros((5, 3), jnp.int32)}

  def gather_loss(p, b):
    return _ce_seq(p["table"][b["ids"]] @ p["w"], b["y"])

  def one_hot_loss(p, b):
    # Tagged by hand: found automatically, a one-hot product is an embedding (test_embeddings).
    oh = jax.nn.one_hot(b["ids"], vocab, dtype=jnp.float64)
    return _ce_seq(kfac_jax.register_dense(oh @ p["table"], oh, p["table"]) @ p["w"], b["y"])

  params = {"table": table, "w": w}
  kinds = [
    l.kind for l in kfac_jax.Registration(one_hot_loss, params, batch, check_loss=False).layers
  ]
  assert kinds == ["dense", "dense"]
  est, state, emb = _estimate(gather_loss, params, batch, jax.random.key(0), "gradients")
  assert est.layers[0].kind == "embedding" and est.layers[0].factor_shapes == ((7,), (3, 3))
  _, _, dense = _estimate(one_hot_loss, params, batch, jax.random.key(0), "gradients")
  np.testing.assert_allclose(emb, dense, rtol=1e-10, atol=1e-13)
  counts = np.bincount(np.asarray(batch["ids"]).ravel(), minlength=vocab) / 15
  np.testing.assert_allclose(state.factors[est.layers[0].name].a, counts, rtol=1e-12)


@pytest.mark.parametrize("damping_mode", ["factored", "eigen"])
def test_embedding_inverse_is_inverse_of_damped_block(x64, damping_mode):
  params = {"table": _models.normal(0, (5, 3), jnp.float64)}
  batch = {"ids": jnp.array([[0, 1], [1, 3], [4, 4]]), "y": jnp.array([[0, 1], [2, 1], [0, 0]])}

  def loss_fn(p, b):
    return _ce_seq(kfac_jax.register_embedding(p["table"][b["ids"]], b["ids"], p["table"]), b["y"])

  est = kfac_jax.CurvatureEstimator(
    kfac_jax.Registration(loss_fn, params, batch, check_loss=False),
    compute_cholesky=True,
    compute_cholesky_inverse=True,
    config=kfac_jax.Config(damping_mode=damping_mode),
  )

  @jax.jit
  def run(p, b, v):
    state = est.update_curvature(est.init(p), p, b, jax.random.key(1), 0.0)
    state = est.update_inverses(state, 0.1)
    back = est.multiply(state, est.multiply_inverse(state, v))
    return back, est.multiply_cholesky_inverse(state, est.multiply_cholesky(state, v))

  v = {"table": np.random.default_rng(2).standard_normal((5, 3))}
  back, c = run(params, batch, v)
  np.testing.assert_allclose(back["table"], v["table"], rtol=1e-8)
  np.testing.assert_allclose(c["table"], v["table"], rtol=1e-8)


# -- scanner on Flax layers ----------------------------------------------------------------------


class _LinenAll(nn.Module):
  @nn.compact
  def __call__(self, x, ids, train: bool = True):
    h = nn.Conv(4, (3, 3), strides=2, padding="SAME", name="conv")(x)
    h = nn.LayerNorm(name="ln")(h)
    h = nn.GroupNorm(num_groups=2, name="gn")(h)
    h = nn.RMSNorm(name="rms")(h)
    h = nn.BatchNorm(use_running_average=not train, name="bn")(h)
    h = nn.Conv(8, (1, 3), feature_group_count=4, name="dw")(h)
    e = nn.Embed(10, 8, name="emb")(ids)
    return nn.Dense(3, name="out")(h.mean((1, 2)) + e)


_EXPECTED = [
  ("bn", "scale_and_shift", ("scale", "bias")),
  ("conv", "conv", ("kernel", "bias")),
  ("dw", "conv", ("kernel", "bias")),
  ("emb", "embedding", ("embedding",)),
  ("gn", "scale_and_shift", ("scale", "bias")),
  ("ln", "scale_and_shift", ("scale", "bias")),
  ("out", "dense", ("kernel", "bias")),
  ("rms", "scale_and_shift", ("scale",)),
]


def _flax_batch():
  return {
    "x": _models.normal(0, (2, 5, 5, 3)),
    "ids": jnp.array([3, 7]),
    "y": _models.integers(1, 0, 3, (2,)),
  }


def test_scanner_finds_linen_layers():
  model, batch = _LinenAll(), _flax_batch()
  variables = jax.jit(model.init)(jax.random.key(1), batch["x"], batch["ids"])

  def loss_fn(params, b):
    logits, _ = model.apply(
      {"params": params, "batch_stats": variables["batch_stats"]},
      b["x"],
      b["ids"],
      mutable=["batch_stats"],
    )
    return _ce(logits, b["y"])

  layers = kfac_jax.Registration(
    loss_fn, variables["params"], batch, strict=True, check_loss=False
  ).layers
  got = [(l.name, l.kind, tuple(p.rsplit("/", 1)[1] for p in l.param_paths)) for l in layers]
  assert sorted(got) == _EXPECTED
  assert {l.name: l.approx for l in layers}["dw"] == "diagonal"  # Depthwise.


class _NnxAll(nnx.Module):
  def __init__(self, rngs):
    self.conv = nnx.Conv(3, 4, (3, 3), strides=2, padding="SAME", rngs=rngs)
    self.ln = nnx.LayerNorm(4, rngs=rngs)
    self.gn = nnx.GroupNorm(4, num_groups=2, rngs=rngs)
    self.rms = nnx.RMSNorm(4, rngs=rngs)
    self.bn = nnx.BatchNorm(4, rngs=rngs)
    self.dw = nnx.Conv(4, 8, (1, 3), feature_group_count=4, rngs=rngs)
    self.emb = nnx.Embed(10, 8, rngs=rngs)
    self.out = nnx.Linear(8, 3, rngs=rngs)

  def __call__(self, x, ids):
    h = self.dw(self.bn(self.rms(self.gn(self.ln(self.conv(x))))))
    return self.out(h.mean((1, 2)) + self.emb(ids))


def test_scanner_finds_nnx_layers():
  graphdef, params, rest = nnx.split(_NnxAll(nnx.Rngs(0)), nnx.Param, ...)
  params = nnx.to_pure_dict(params)

  def loss_fn(p, b):
    model = nnx.merge(graphdef, p, rest, copy=True)
    return _ce(model(b["x"], b["ids"]), b["y"])

  layers = kfac_jax.Registration(
    loss_fn, params, _flax_batch(), strict=True, check_loss=False
  ).layers
  got = [(l.name, l.kind, tuple(p.rsplit("/", 1)[1] for p in l.param_paths)) for l in layers]
  assert sorted(got) == [
    (n, k, tuple("embedding" if p == "embedding" else p for p in ps)) for n, k, ps in _EXPECTED
  ]


# -- a full step -----------------------------------------------------------------------------------


class _SmallCNN(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.Conv(4, (3, 3), padding="SAME")(x)
    h = jax.nn.relu(nn.LayerNorm()(h))
    h = nn.Conv(4, (3, 3), strides=2)(h)
    return nn.Dense(3)(h.reshape(h.shape[0], -1))


def test_jitted_kfac_step_on_small_cnn_is_a_descent_direction():
  model = _SmallCNN()
  batch = {"x": _models.normal(0, (8, 6, 6, 2)), "y": _models.integers(1, 0, 3, (8,))}
  params = jax.jit(model.init)(jax.random.key(1), batch["x"])
  loss_fn = lambda p, b: _ce(model.apply(p, b["x"]), b["y"])
  tx = kfac_jax.kfac(loss_fn, batch, learning_rate=0.1, damping=1e-2, inverse_every=1)

  @jax.jit
  def step(params, rng):
    loss, grads, stats = kfac_jax.value_and_grad(loss_fn)(params, batch, rng)
    updates, _ = tx.update(grads, tx.init(params), params, curvature_stats=stats)
    inner = sum(
      jnp.vdot(g, u)
      for g, u in zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(updates))
    )
    return loss, inner, loss_fn(optax.apply_updates(params, updates), batch)

  with jax.numpy_rank_promotion("raise"):  # The library's own code never relies on it.
    loss, inner, new_loss = step(params, jax.random.key(2))
  kinds = sorted(
    l.kind
    for l in kfac_jax.Registration(loss_fn, params, batch, strict=True, check_loss=False).layers
  )
  assert kinds == ["conv", "conv", "dense", "scale_and_shift"]
  assert np.isfinite(float(loss)) and float(inner) < 0
  assert float(new_loss) < float(loss)


# -- bad input -----------------------------------------------------------------------------------


def test_approx_that_does_not_fit_the_kind_names_the_parameter():
  params = {"table": jnp.ones((5, 3))}

  def loss_fn(p, b):
    y = kfac_jax.register_embedding(p["table"][b["ids"]], b["ids"], p["table"], approx="full")
    return _ce(y, b["y"])

  batch = {"ids": jnp.array([0, 1]), "y": jnp.array([0, 1])}
  with pytest.raises(kfac_jax.RegistrationError, match=r"'full'.*embedding.*table.*'kron'"):
    kfac_jax.Registration(loss_fn, params, batch)

  conv_p = {"w": jnp.ones((1, 1, 2, 2))}

  def conv_loss(p, b):
    y = lax.conv_general_dilated(
      b["x"], p["w"], (1, 1), "VALID", dimension_numbers=("NHWC", "HWIO", "NHWC")
    )
    y = kfac_jax.register_conv(
      y,
      b["x"],
      p["w"],
      window_strides=(1, 1),
      padding="VALID",
      dimension_numbers=("NHWC", "HWIO", "NHWC"),
      approx="eigen",
    )
    return _ce(y.reshape(2, -1), b["y"])

  with pytest.raises(kfac_jax.RegistrationError, match=r"'eigen'.*conv.*`?w"):
    kfac_jax.Registration(conv_loss, conv_p, {"x": jnp.ones((2, 1, 1, 2)), "y": jnp.array([0, 1])})


def test_malformed_manual_tags():
  x, w = jnp.ones((2, 5, 5, 3)), jnp.ones((3, 3, 3, 4))
  dn = ("NHWC", "HWIO", "NHWC")
  y = lax.conv_general_dilated(x, w, (1, 1), "VALID", dimension_numbers=dn)
  with pytest.raises(
    ValueError, match=r"register_conv: `y` has shape \(2, 3, 3, 4\).*\(2, 5, 5, 4\)"
  ):
    kfac_jax.register_conv(y, x, w, window_strides=(1, 1), padding="SAME", dimension_numbers=dn)
  with pytest.raises(ValueError, match="register_conv: `window_strides` must be 2 positive"):
    kfac_jax.register_conv(y, x, w, window_strides=(1,), padding="VALID", dimension_numbers=dn)
  with pytest.raises(ValueError, match=r"register_conv: `bias` has shape \(3,\), expected \(4,\)"):
    kfac_jax.register_conv(
      y, x, w, jnp.ones(3), window_strides=(1, 1), padding="VALID", dimension_numbers=dn
    )
  with pytest.raises(ValueError, match="register_scale_and_shift: give `scale`, `shift`"):
    kfac_jax.register_scale_and_shift(y, y)
  with pytest.raises(ValueError, match=r"register_scale_and_shift: `scale` has shape \(3,\)"):
    kfac_jax.register_scale_and_shift(y, y, jnp.ones(3))
  with pytest.raises(TypeError, match="register_embedding: `ids` must be integers"):
    kfac_jax.register_embedding(jnp.ones((2, 3)), jnp.ones((2,)), jnp.ones((5, 3)))
  with pytest.raises(ValueError, match=r"register_embedding: `y` has shape \(2, 4\)"):
    kfac_jax.register_embedding(jnp.ones((2, 4)), jnp.ones((2,), jnp.int32), jnp.ones((5, 3)))

  def loss_fn(p, b):  # The kernel is not a parameter.
    out = lax.conv_general_dilated(b["x"], b["w"], (1, 1), "VALID", dimension_numbers=dn)
    out = kfac_jax.register_conv(
      out, b["x"], b["w"], window_strides=(1, 1), padding="VALID", dimension_numbers=dn
    )
    return _ce(out.reshape(2, -1) @ p["v"], b["y"])

  with pytest.raises(kfac_jax.RegistrationError, match="register_conv: `kernel` is not a param"):
    kfac_jax.Registration(
      loss_fn, {"v": jnp.ones((36, 2))}, {"x": x, "w": w, "y": jnp.array([0, 1])}
    )


def test_plain_jnp_scale_and_shift_and_conv_bias_are_not_confused():
  params = {
    "w": _models.normal(0, (3, 4)),
    "b": jnp.zeros(4),
    "s": jnp.ones(4),
    "t": jnp.zeros(4),
    "u": jnp.zeros((5, 4)),
    "alpha": jnp.ones(()),
  }

  def loss_fn(p, b):
    h = b["x"] @ p["w"] + p["b"]  # A dense layer with its bias.
    h = jnp.tanh(h) * p["s"] + p["t"]  # Scale and shift over the feature axis.
    h = jnp.tanh(h) + p["u"]  # A shift spanning the (time, feature) axes.
    h = h * p["alpha"]  # A scalar scale.
    return _ce_seq(h, b["y"])

  batch = {"x": _models.normal(1, (2, 5, 3)), "y": jnp.zeros((2, 5), jnp.int32)}
  layers = kfac_jax.Registration(loss_fn, params, batch, strict=True, check_loss=False).layers
  got = sorted((l.kind, l.param_paths, getattr(l.info, "feature_shape", None)) for l in layers)
  assert got == [
    ("dense", ("w", "b"), None),
    ("scale_and_shift", ("alpha",), ()),
    ("scale_and_shift", ("s", "t"), (4,)),
    ("scale_and_shift", ("u",), (5, 4)),
  ]


@pytest.mark.parametrize("approx", ["diagonal", "full"])
def test_dense_diagonal_and_full_equal_exact_empirical_fisher(x64, approx):
  params = {
    "w": _models.normal(40, (3, 4), jnp.float64),
    "b": _models.normal(41, (4,), jnp.float64),
  }
  batch = {
    "x": _models.normal(42, (3, 2, 3), jnp.float64),
    "y": _models.integers(43, 0, 4, (3, 2)),
  }

  def apply(p, x):
    return kfac_jax.register_dense(x @ p["w"] + p["b"], x, p["w"], p["b"], approx=approx)

  est, _, dense = _estimate(lambda p, b: _ce_seq(apply(p, b["x"]), b["y"]), params, batch)
  assert est.layers[0].approx == approx
  exact = _exact_empirical(
    lambda p, b: _per_example_ce(apply(p, b["x"]), b["y"]).sum(-1), params, batch
  )
  want = exact if approx == "full" else np.diag(np.diag(exact))
  np.testing.assert_allclose(dense, want, rtol=1e-10, atol=1e-13)


@pytest.mark.parametrize("damping_mode", ["factored", "eigen"])
@pytest.mark.parametrize("approx", ["kron", "kron_sua"])
def test_grouped_conv_powers_and_cholesky_invert(x64, damping_mode, approx):
  apply, params, batch = _conv_model(approx, groups=2, cin=4, cout=6)
  loss_fn = lambda p, b: _ce(apply(p, b["x"]), b["y"])
  est = kfac_jax.CurvatureEstimator(
    kfac_jax.Registration(loss_fn, params, batch, check_loss=False),
    compute_cholesky=True,
    compute_cholesky_inverse=True,
    config=kfac_jax.Config(damping_mode=damping_mode),
  )
  assert est.layers[0].factor_shapes[1] == (2, 3, 3)

  @jax.jit
  def run(p, b):
    state = est.update_curvature(est.init(p), p, b, jax.random.key(1), 0.0)
    state = est.update_inverses(state, 0.05)
    v = jax.tree_util.tree_map(lambda x: jax.random.normal(jax.random.key(7), x.shape, x.dtype), p)
    backs = (
      est.multiply(state, est.multiply_inverse(state, v)),
      est.multiply_cholesky_inverse(state, est.multiply_cholesky(state, v)),
      est.multiply_cholesky_inverse(
        state, est.multiply_cholesky(state, v, transpose=True), transpose=True
      ),
    )
    return v, backs, est.multiply(state, v), est.to_dense(state)

  v, backs, damped, dense = run(params, batch)
  for back in backs:
    for a, b in zip(jax.tree_util.tree_leaves(back), jax.tree_util.tree_leaves(v)):
      np.testing.assert_allclose(a, b, rtol=1e-7, atol=1e-9)
  if damping_mode == "eigen":  # The damped block is exactly to_dense + λ I.
    flat_v = np.asarray(ravel_pytree(v)[0])
    got = np.asarray(ravel_pytree(damped)[0])
    np.testing.assert_allclose(got, np.asarray(dense) @ flat_v + 0.05 * flat_v, rtol=1e-9)


# -- any batch size ------------------------------------------------------------------------------
#
# Statistics of a batch of another leading size than `example_batch` (a partial last batch, an
# eval batch) are normalised by that batch: an estimator built with 8 examples and fed 17 holds
# exactly what one built with those 17 holds, and its "full" blocks are the exact Fisher of the
# 17 examples.


def _exact_fisher(logits_fn, params, batch):
  """(1/N) Σ_n J_nᵀ (diag(p_n) − p_n p_nᵀ) J_n, the exact Fisher of the categorical loss."""
  flat, unravel = ravel_pytree(params)
  logits = np.asarray(jax.jit(logits_fn)(params, batch))
  jac = np.asarray(_models.jit_jacobian(lambda f, b: logits_fn(unravel(f), b))(flat, batch))
  c = logits.shape[-1]
  logits, jac = logits.reshape(-1, c), jac.reshape(-1, c, flat.size)
  p = np.exp(logits - logits.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  fz = np.einsum("ni,ij->nij", p, np.eye(c)) - p[:, :, None] * p[:, None, :]
  return np.einsum("nci,ncd,ndj->ij", jac, fz, jac) / batch["y"].shape[0]


def _any_batch_model(kind):
  """(logits_fn, params, make_batch(n, seed)) with one `kind` layer feeding a dense head."""
  rng = np.random.default_rng(7)
  if kind == "dense":
    params = {
      "w": rng.standard_normal((3, 4)),
      "b": rng.standard_normal((4,)),
      "h": rng.standard_normal((4, 3)),
    }

    def logits_fn(p, b):
      return jnp.tanh(b["x"] @ p["w"] + p["b"]) @ p["h"]

    def make(n, rng):
      return {"x": rng.standard_normal((n, 3))}
  elif kind == "conv":
    params = {
      "k": 0.5 * rng.standard_normal((2, 2, 2, 2)),
      "b": rng.standard_normal((2,)),
      "h": rng.standard_normal((2, 3)),
    }

    def logits_fn(p, b):
      y = (
        lax.conv_general_dilated(
          b["x"], p["k"], (1, 1), "VALID", dimension_numbers=("NHWC", "HWIO", "NHWC")
        )
        + p["b"]
      )
      return jnp.tanh(y).mean(axis=(1, 2)) @ p["h"]

    def make(n, rng):
      return {"x": rng.standard_normal((n, 3, 3, 2))}
  elif kind == "embedding":
    params = {
      "t": rng.standard_normal((6, 3)),
      "h": rng.standard_normal((3, 3)),
    }

    def logits_fn(p, b):
      return jnp.tanh(p["t"][b["ids"]]).mean(axis=1) @ p["h"]

    def make(n, rng):
      return {"ids": rng.integers(0, 6, (n, 2), dtype=np.int32)}
  else:  # scale_and_shift
    params = {
      "s": rng.standard_normal((3,)),
      "o": rng.standard_normal((3,)),
      "h": rng.standard_normal((3, 3)),
    }

    def logits_fn(p, b):
      return jnp.tanh(b["x"] * p["s"] + p["o"]).mean(axis=1) @ p["h"]

    def make(n, rng):
      return {"x": rng.standard_normal((n, 2, 3))}

  def make_batch(n, seed):  # numpy: a jax.random draw compiles a program per shape.
    rng = np.random.default_rng(seed)
    b = make(n, rng)
    b["y"] = rng.integers(0, 3, n, dtype=np.int32)
    return b

  return logits_fn, params, make_batch


@pytest.mark.parametrize("kind", ["dense", "conv", "embedding", "scale_and_shift"])
def test_statistics_of_another_batch_size(x64, kind):
  logits_fn, params, make_batch = _any_batch_model(kind)

  def loss_fn(p, b):
    return _ce(logits_fn(p, b), b["y"])

  big, small = make_batch(8, 1), make_batch(17, 2)
  exact = _exact_fisher(logits_fn, params, small)
  for layers in (None, kfac_jax.LayerConfig(defaults={"dense": "full", "conv": "full"})):
    dense = []
    for example in (big, small):
      est = kfac_jax.CurvatureEstimator(
        kfac_jax.Registration(
          loss_fn, params, example, estimation_mode="exact", layers=layers, check_loss=False
        )
      )
      dense.append(np.asarray(_fit(est, params, small, dense=True)[1]))
    np.testing.assert_allclose(dense[0], dense[1], rtol=1e-12, atol=1e-14)
    assert kind in [s.kind for s in est.layers]
    if layers is not None:  # Every "full" block is the exact Fisher's block.
      leaves = jax.tree_util.tree_leaves(params)
      block = np.zeros(len(leaves), int)
      for i, spec in enumerate(est.layers):
        block[list(spec.leaf_indices)] = i if spec.approx == "full" else -1
      ids = np.concatenate([np.full(x.size, b) for x, b in zip(leaves, block)])
      mask = (ids[:, None] == ids[None, :]) & (ids[:, None] >= 0)
      assert mask.any()
      np.testing.assert_allclose(
        np.where(mask, dense[0], 0), np.where(mask, exact, 0), rtol=1e-10, atol=1e-12
      )


def test_entry_points_take_a_partial_batch(x64):
  logits_fn, params, make_batch = _any_batch_model("dense")

  def loss_fn(p, b):
    return _ce(logits_fn(p, b), b["y"])

  full, last = make_batch(8, 1), make_batch(5, 2)
  rng = jax.random.key(3)
  results = []
  for example in (full, last):  # Built for 8 examples vs for the 5 of the last batch.
    tx = kfac_jax.scale_by_kfac(
      registration=kfac_jax.Registration(
        loss_fn, params, example, estimation_mode="exact", check_loss=False
      ),
      damping=1e-3,
    )
    vg = kfac_jax.value_and_grad(
      registration=kfac_jax.Registration(
        loss_fn, params, last, estimation_mode="exact", check_loss=False
      )
    )
    opt = kfac_jax.Optimizer(
      registration=kfac_jax.Registration(
        loss_fn, params, example, estimation_mode="exact", check_loss=False
      ),
      learning_rate=0.1,
      momentum=0.0,
      use_adaptive_damping=False,
    )

    @jax.jit
    def entry_points(params, b, rng, tx=tx, vg=vg, opt=opt):
      state = tx.init(params)
      _, grads, stats = vg(params, b, rng)
      u1, s1 = tx.update(grads, state, params, curvature_stats=stats)
      u2, _ = tx.update(grads, state, params, batch=b)
      p3, _, _ = opt.step(params, opt.init(params), b, rng)
      return state, u1, s1, u2, p3

    state, u1, s1, u2, p3 = entry_points(params, last, rng)
    results.append((u1, u2, p3))
    for a, b in zip(jax.tree_util.tree_leaves(s1), jax.tree_util.tree_leaves(state)):
      assert a.shape == b.shape  # The state keeps its shapes.
  for a, b in zip(jax.tree_util.tree_leaves(results[0]), jax.tree_util.tree_leaves(results[1])):
    np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)
  for a, b in zip(
    jax.tree_util.tree_leaves(results[0][0]), jax.tree_util.tree_leaves(results[0][1])
  ):
    np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)


def test_a_layer_that_depends_on_the_batch_size_is_named_in_the_error():
  """`mix[:n, :n] @ x` mixes the n examples of the batch with a slice of a parameter: with the
  4 examples of `example_batch` the slice is a generic block, with 8 (the whole parameter) a
  dense one. Every entry point fed 8 examples raises before touching the state, naming the
  layer, this batch's size and `example_batch`'s; 4 examples still work afterwards."""
  params = {"mix": jnp.eye(8) + 0.1, "w": jnp.full((3, 3), 0.1)}

  def loss_fn(p, b):
    n = b["x"].shape[0]
    return _ce((p["mix"][:n, :n] @ b["x"]) @ p["w"], b["y"])

  def make(n):
    return {"x": _models.normal(10 * n, (n, 3)), "y": _models.integers(10 * n + 1, 0, 3, (n,))}

  small, big, rng = make(4), make(8), jax.random.key(0)
  with pytest.warns(kfac_jax.UncoveredParametersWarning):  # `mix` at 4 examples: generic.
    tx = kfac_jax.scale_by_kfac(loss_fn, small, damping=1e-2)
    state = jax.jit(tx.init)(params)  # Jitted: eager ops compile one by one.
    opt = kfac_jax.Optimizer(loss_fn, small, learning_rate=0.1, momentum=0.0)
    opt_state = jax.jit(opt.init)(params)
  grads = params  # Any params-shaped tree: the checks fail before using it.
  _, _, stats = jax.jit(kfac_jax.value_and_grad(loss_fn))(params, big, rng)
  msg = r"layer `mix` changes with the batch size: for this batch of 8 examples .* "
  msg += r"`example_batch` \(4 examples\)"
  with pytest.raises(ValueError, match=msg):
    tx.update(grads, state, params, batch=big, rng=rng)
  with pytest.raises(ValueError, match=msg):  # value_and_grad scanned the batch on its own.
    jax.jit(lambda s: tx.update(grads, s, params, curvature_stats=stats))(state)
  with pytest.raises(ValueError, match=msg):
    opt.step(params, opt_state, big, rng)
  _, new = jax.jit(lambda s: tx.update(grads, s, params, batch=small, rng=rng))(state)
  assert int(new.count) == 1 and int(state.count) == 0
  # Statistics from half of `example_batch`'s 8 rows meet the same layer: the error says so
  # (the mention of the fraction is a note on the error, on its own line).
  half = kfac_jax.scale_by_kfac(
    loss_fn, big, damping=1e-2, config=kfac_jax.Config(statistics_fraction=0.5)
  )
  half_state = jax.jit(half.init)(params)
  with pytest.raises(
    ValueError, match=r"(?s)for this batch of 4 examples .*statistics_fraction=0.5"
  ):
    half.update(grads, half_state, params, batch=big, rng=rng)


# -- small matchers: the model in library style against the same model written plainly ----------


def _preconditioned(loss_fn, params, batch, layers=None):
  """(layers, (F̂ + λ)⁻¹ ∇L): exact mode, one batch, float64."""
  est = kfac_jax.CurvatureEstimator(
    kfac_jax.Registration(
      loss_fn, params, batch, estimation_mode="exact", layers=layers, check_loss=False
    )
  )

  @jax.jit
  def run(p, b):
    state = est.update_curvature(est.init(p), p, b, None, ema_decay=0.0)
    state = est.update_inverses(state, damping=1e-2)
    return est.multiply_inverse(state, jax.grad(loss_fn)(p, b))

  return est.layers, run(params, batch)


def _plain_cnn_loss(p, b):
  """conv (HWIO kernel, NHWC) + bias, relu, dense + bias: the reference for Haiku / equinox."""
  y = (
    lax.conv_general_dilated(
      b["x"], p["ck"], (1, 1), "VALID", dimension_numbers=("NHWC", "HWIO", "NHWC")
    )
    + p["cb"]
  )
  h = jax.nn.relu(y).reshape(y.shape[0], -1)
  return _ce(h @ p["dk"] + p["db"], b["y"])


def _cnn_batch():
  return {
    "x": _models.normal(110, (3, 5, 5, 2), jnp.float64),
    "y": _models.integers(111, 0, 4, (3,)),
  }


def _assert_same(plain_layers, plain_u, layers, u):
  assert [(s.kind, s.approx) for s in layers] == [(s.kind, s.approx) for s in plain_layers]
  for a, b in zip(plain_u, u):
    np.testing.assert_allclose(a, b, rtol=1e-8, atol=1e-10)


def test_haiku_conv_and_linear_keep_their_bias(x64):
  hk = pytest.importorskip("haiku")

  def net(x):
    y = hk.Conv2D(3, 2, padding="VALID")(x)
    return hk.Linear(4)(jax.nn.relu(y).reshape(y.shape[0], -1))

  f = hk.without_apply_rng(hk.transform(net))
  batch = _cnn_batch()
  params = jax.jit(  # Jitted: eager ops compile one by one.
    lambda k, x: jax.tree_util.tree_map(lambda v: v + 0.1, f.init(k, x))  # Non-zero biases.
  )(jax.random.key(0), batch["x"])

  def loss_fn(p, b):
    return _ce(f.apply(p, b["x"]), b["y"])

  layers, u = _preconditioned(loss_fn, params, batch)
  assert [s.param_paths for s in layers] == [("conv2_d/w", "conv2_d/b"), ("linear/w", "linear/b")]
  plain = {
    "ck": params["conv2_d"]["w"],
    "cb": params["conv2_d"]["b"],
    "dk": params["linear"]["w"],
    "db": params["linear"]["b"],
  }
  plain_layers, pu = _preconditioned(_plain_cnn_loss, plain, batch)
  _assert_same(
    plain_layers,
    [pu["cb"], pu["ck"], pu["db"], pu["dk"]],
    layers,
    [u["conv2_d"]["b"], u["conv2_d"]["w"], u["linear"]["b"], u["linear"]["w"]],
  )


def test_equinox_layers_under_vmap_keep_their_bias(x64):
  eqx = pytest.importorskip("equinox")
  k = jax.random.split(jax.random.key(12), 2)
  model = (
    eqx.nn.Conv2d(2, 3, 2, key=k[0], dtype=jnp.float64),
    eqx.nn.Linear(48, 4, key=k[1], dtype=jnp.float64),
  )
  params, static = eqx.partition(model, eqx.is_array)

  def loss_fn(p, b):
    conv, lin = eqx.combine(p, static)
    y = jax.vmap(conv)(b["x"].transpose(0, 3, 1, 2))  # Per example: [C, H, W].
    h = jax.nn.relu(y).transpose(0, 2, 3, 1).reshape(y.shape[0], -1)
    return _ce(jax.vmap(lin)(h), b["y"])

  batch = _cnn_batch()
  layers, u = _preconditioned(loss_fn, params, batch)
  assert [s.param_paths for s in layers] == [("0/weight", "0/bias"), ("1/weight", "1/bias")]
  conv, lin = params
  plain = {
    "ck": conv.weight.transpose(2, 3, 1, 0),
    "cb": conv.bias.reshape(-1),
    "dk": lin.weight.T,
    "db": lin.bias,
  }
  plain_layers, pu = _preconditioned(_plain_cnn_loss, plain, batch)
  _assert_same(
    plain_layers,
    [pu["ck"], pu["cb"], pu["dk"], pu["db"]],
    layers,
    [u[0].weight.transpose(2, 3, 1, 0), u[0].bias.reshape(-1), u[1].weight.T, u[1].bias],
  )


def test_one_plus_scale_is_a_scale_and_shift_layer(x64):

  def rms(x):
    return x * lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)

  def gemma_loss(p, b):  # Gemma's RMSNorm: the parameter is the offset from 1.
    return _ce((rms(b["x"]) * (1 + p["scale"])).mean(1) @ p["head"], b["y"])

  def plain_loss(p, b):
    return _ce((rms(b["x"]) * p["scale"]).mean(1) @ p["head"], b["y"])

  params = {
    "scale": _models.normal(130, (4,), jnp.float64, scale=0.3),
    "head": _models.normal(131, (4, 3), jnp.float64),
  }
  batch = {"x": _models.normal(132, (3, 2, 4), jnp.float64), "y": jnp.array([0, 2, 1])}
  layers, u = _preconditioned(gemma_loss, params, batch)
  plain_layers, pu = _preconditioned(plain_loss, dict(params, scale=1 + params["scale"]), batch)
  assert [s.kind for s in layers] == ["dense", "scale_and_shift"]
  _assert_same(plain_layers, [pu["head"], pu["scale"]], layers, [u["head"], u["scale"]])


@pytest.mark.parametrize("how", ["concatenate", "stack"])
def test_concatenated_kernels_are_one_dense_layer(x64, how):
  params = {
    "gate_a": {
      "kernel": _models.normal(140, (3, 2), jnp.float64),
      "bias": _models.normal(141, (2,), jnp.float64),
    },
    "gate_b": {
      "kernel": _models.normal(142, (3, 2), jnp.float64),
      "bias": _models.normal(143, (2,), jnp.float64),
    },
    "head": _models.normal(144, (4, 3), jnp.float64),
  }

  def join(a, b):
    if how == "concatenate":
      return jnp.concatenate([a, b], axis=-1)
    return jnp.stack([a, b], axis=-1).reshape(*a.shape[:-1], -1)  # Interleaved columns.

  def logits(kernel, bias, head, x):
    return jnp.tanh(x @ kernel + bias) @ head

  def loss_fn(p, b):
    kernel = join(p["gate_a"]["kernel"], p["gate_b"]["kernel"])
    bias = join(p["gate_a"]["bias"], p["gate_b"]["bias"])
    return _ce(logits(kernel, bias, p["head"], b["x"]), b["y"])

  def plain_loss(p, b):
    return _ce(logits(p["kernel"], p["bias"], p["head"], b["x"]), b["y"])

  batch = {
    "x": _models.normal(145, (5, 3), jnp.float64),
    "y": _models.integers(146, 0, 3, (5,)),
  }
  layers, u = _preconditioned(loss_fn, params, batch)
  assert [(s.kind, s.approx, s.param_paths) for s in layers] == [
    ("dense", "kron", ("gate_a/kernel", "gate_b/kernel", "gate_a/bias", "gate_b/bias")),
    ("dense", "kron", ("head",)),
  ]
  plain = {
    "kernel": join(params["gate_a"]["kernel"], params["gate_b"]["kernel"]),
    "bias": join(params["gate_a"]["bias"], params["gate_b"]["bias"]),
    "head": params["head"],
  }
  plain_layers, pu = _preconditioned(plain_loss, plain, batch)
  assert [(s.kind, s.approx) for s in plain_layers] == [("dense", "kron"), ("dense", "kron")]
  _assert_same(
    plain_layers,
    [pu["kernel"], pu["bias"], pu["head"]],
    layers,
    [
      join(u["gate_a"]["kernel"], u["gate_b"]["kernel"]),
      join(u["gate_a"]["bias"], u["gate_b"]["bias"]),
      u["head"],
    ],
  )
  # A piece used elsewhere too is not part of a concatenation layer: a generic fallback.

  def also_used(p, b):
    return loss_fn(p, b) + _ce(b["x"] @ p["gate_a"]["kernel"] @ p["head"][:2], b["y"])

  with pytest.warns(kfac_jax.UncoveredParametersWarning, match="gate_a/kernel"):
    specs = kfac_jax.Registration(also_used, params, batch).layers
  assert not any(len(s.param_paths) == 4 for s in specs)


@pytest.mark.parametrize(
  "strides, padding, lhs_d, rhs_d, groups",
  [
    ((1, 1), "SAME", None, None, 1),
    ((2, 1), "SAME", None, (1, 2), 2),
    ((1, 2), ((1, 0), (2, 1)), (2, 1), None, 1),
  ],
)
def test_statistics_pull_convs_back_with_canonically_ordered_kernels(
  x64, strides, padding, lhs_d, rhs_d, groups
):
  """`curvature_stats` traces convolutions whose transpose reads the kernel as
  (spatial..., in, out) (XLA:CPU ran the other order ~15x slower inside the transforms'
  `lax.cond`); the statistics equal those of the plain convolutions."""
  dn = ("NHWC", "HWIO", "NHWC")

  def features(p, x):
    kw = dict(
      lhs_dilation=lhs_d, rhs_dilation=rhs_d, dimension_numbers=dn, feature_group_count=groups
    )
    h = jnp.tanh(lax.conv_general_dilated(x, p["c1"], (1, 1), "SAME", dimension_numbers=dn))
    return lax.conv_general_dilated(h, p["c2"], strides, padding, **kw)

  def apply(p, x):
    h = features(p, x)
    return h.reshape(h.shape[0], -1) @ p["out"]

  x = _models.normal(0, (3, 6, 5, 4), jnp.float64)
  params = {
    "c1": _models.normal(1, (3, 2, 4, 4), jnp.float64, scale=0.5),
    "c2": _models.normal(2, (3, 3, 4 // groups, 4), jnp.float64, scale=0.5),
  }
  feat = jax.eval_shape(features, params, x).shape
  params["out"] = _models.normal(3, (math.prod(feat[1:]), 3), jnp.float64, scale=0.2)
  batch = {"x": x, "y": _models.integers(4, 0, 3, (3,))}
  est = kfac_jax.CurvatureEstimator(
    kfac_jax.Registration(
      lambda p, b: _ce(apply(p, b["x"]), b["y"]), params, batch, check_loss=False
    )
  )
  jax.eval_shape(est.init, params)
  key = jax.random.key(7)
  scan = est.registration.scan_batch(params, batch)

  def plain_stats(p, b, k):  # The same pass without the canonical pull-back.
    return _curvature.compute(
      scan, p, b, k, estimation_mode="gradients", num_samples=1, with_grads=False
    )[2]

  got, plain = jax.jit(lambda p, b, k: (est.curvature_stats(p, b, k), plain_stats(p, b, k)))(
    params, batch, key
  )
  for a, b in zip(jax.tree_util.tree_leaves(got.data), jax.tree_util.tree_leaves(plain.data)):
    np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-14)

  def kernels(fn):  # The kernel dimension orders of the lowered program's convolutions.
    text = jax.jit(fn).lower(params, batch, key).as_text()
    return re.findall(r"dim_numbers = \[[^\]]*\]x\[([^\]]*)\]->", text)

  # Two forward convolutions and the pull-back through c2, the strided / dilated / grouped one
  # (c1's input needs none).
  assert kernels(est.curvature_stats) == ["0, 1, i, o"] * 3
  assert "0, 1, o, i" in kernels(plain_stats)  # JAX's own transpose reads (out, in).


# -- locally connected (unshared) convolutions ----------------------------------------------------


def _conv_local_proj(dtype):
  return _models.normal(12, (4 * 4 * 3, 4), dtype)


def _conv_local_model(n, approx=None, bias=True):
  """A Flax `nn.ConvLocal` (3x3 window, 4x4 output grid, 2 -> 3 channels) read by a fixed
  projection, so that its kernel and bias are the only parameters."""
  layer = nn.ConvLocal(3, (3, 3), padding="VALID", use_bias=bias, param_dtype=jnp.float64)
  x = _models.normal(110, (n, 6, 6, 2), jnp.float64)
  params = jax.jit(layer.init)(jax.random.key(11), x)["params"]
  proj = _conv_local_proj(jnp.float64)
  batch = {"x": x, "y": _models.integers(111, 0, 4, (n,))}

  def logits(p, b):
    return layer.apply({"params": p}, b["x"]).reshape(b["x"].shape[0], -1) @ proj

  layers = kfac_jax.LayerConfig(defaults={"grouped_dense": approx}) if approx else None
  return logits, params, batch, layers


def _location_of_each_parameter(params):
  """The output location (row-major over the 4x4 grid) each raveled parameter belongs to."""
  loc = jax.tree_util.tree_map(
    lambda p: np.broadcast_to(np.arange(16).reshape(4, 4, *(1,) * (p.ndim - 2)), p.shape), params
  )
  return ravel_pytree(loc)[0].astype(int)


def test_conv_local_is_found_as_one_layer_with_per_location_factors(x64):
  logits, params, batch, _ = _conv_local_model(2)
  specs = kfac_jax.Registration(
    lambda p, b: _ce(logits(p, b), b["y"]), params, batch, strict=True, check_loss=False
  ).layers
  ((spec,),) = [specs]
  assert (spec.kind, spec.approx, spec.param_paths) == ("grouped_dense", "kron", ("kernel", "bias"))
  # 16 locations, each a dense layer with 3·3·2 patch inputs (+ bias) and 3 outputs.
  assert spec.factor_shapes == ((16, 19, 19), (16, 3, 3))


@pytest.mark.parametrize("bias", [True, False])
def test_conv_local_kron_equals_per_location_fisher_for_one_example(x64, bias):
  # One example: each location's block is exactly (x̄ x̄ᵀ) ⊗ (g gᵀ) = j_p j_pᵀ, and the blocks
  # between locations are left out.
  logits, params, batch, _ = _conv_local_model(1, bias=bias)
  est, _, dense = _estimate(lambda p, b: _ce(logits(p, b), b["y"]), params, batch)
  assert est.layers[0].kind == "grouped_dense" and est.layers[0].approx == "kron"
  exact = _exact_empirical(lambda p, b: _per_example_ce(logits(p, b), b["y"]), params, batch)
  loc = _location_of_each_parameter(params)
  same = loc[:, None] == loc[None, :]
  assert np.abs(exact[~same]).max() > 1e-6  # The dropped cross-location blocks are not zero.
  np.testing.assert_allclose(dense, np.where(same, exact, 0.0), rtol=1e-10, atol=1e-13)


@pytest.mark.parametrize("approx", ["full", "diagonal"])
def test_conv_local_full_and_diagonal_equal_exact_fisher(x64, approx):
  logits, params, batch, layers = _conv_local_model(3, approx)
  loss_fn = lambda p, b: _ce(logits(p, b), b["y"])
  est = kfac_jax.CurvatureEstimator(
    kfac_jax.Registration(
      loss_fn, params, batch, estimation_mode="empirical", layers=layers, check_loss=False
    )
  )
  _, dense = _fit(est, params, batch, dense=True)
  assert est.layers[0].approx == approx
  exact = _exact_empirical(lambda p, b: _per_example_ce(logits(p, b), b["y"]), params, batch)
  want = exact if approx == "full" else np.diag(np.diag(exact))
  np.testing.assert_allclose(np.asarray(dense), want, rtol=1e-10, atol=1e-13)


def test_conv_local_kron_factors_by_definition(x64):
  # A_p = (1/N) Σ_n x̄_{n,p} x̄_{n,p}ᵀ over the patches, G_p = (1/N) Σ_n g_{n,p} g_{n,p}ᵀ with
  # g_{n,p} = ∂ℓ_n/∂y_{n,p} (empirical Fisher); location p's block is A_p ⊗ G_p over its
  # (kernel row, output) entries with the bias as the last row, the blocks in location order.
  logits, params, batch, _ = _conv_local_model(3)
  est, _, dense = _estimate(lambda p, b: _ce(logits(p, b), b["y"]), params, batch)
  x, n = batch["x"], batch["x"].shape[0]
  patches = lax.conv_general_dilated_patches(
    x.transpose(0, 3, 1, 2), (3, 3), (1, 1), "VALID", precision=lax.Precision.HIGHEST
  )  # [N, 2·9, 4, 4], (channel, window) row-major: the rows of Flax's ConvLocal kernel.
  rows = patches.transpose(0, 2, 3, 1).reshape(n, 16, 18)
  xbar = np.concatenate([rows, np.ones((n, 16, 1))], axis=-1)
  layer = nn.ConvLocal(3, (3, 3), padding="VALID", param_dtype=jnp.float64)
  y = layer.apply({"params": params}, x)
  proj_logits = lambda yy: yy.reshape(n, -1) @ _conv_local_proj(yy.dtype)
  np.testing.assert_allclose(proj_logits(y), logits(params, batch), rtol=1e-12)
  g = jax.grad(lambda yy: _per_example_ce(proj_logits(yy), batch["y"]).sum())(y)
  g = np.asarray(g).reshape(n, 16, 3)
  a_p = np.einsum("npi,npj->pij", xbar, xbar) / n
  g_p = np.einsum("npi,npj->pij", g, g) / n
  # Reorder the estimate from the raveled (bias, kernel) leaves to per-location [kernel; bias]
  # rows times outputs.
  loc = _location_of_each_parameter(params)
  n_bias = params["bias"].size
  idx = np.arange(loc.size)
  for p in range(16):
    kernel = idx[n_bias:][loc[n_bias:] == p]  # (row, out) row-major.
    bias = idx[:n_bias][loc[:n_bias] == p]
    order = np.concatenate([kernel, bias])
    np.testing.assert_allclose(
      dense[np.ix_(order, order)], np.kron(a_p[p], g_p[p]), rtol=1e-10, atol=1e-13
    )
  assert est.layers[0].factor_shapes == ((16, 19, 19), (16, 3, 3))


# -- per-atom envelopes: a dense layer per atom (grouped dense) ----------------------------------

_ATOMS, _ORBITALS, _ELECTRONS = 2, 2, 3


def _envelope_model(n):
  """FermiNet's anisotropic envelope: `sigma: [3, 3, atoms, orbitals]` applied to each
  electron's vector to each atom, `einsum("bnai,ijak->bnajk", r - R, sigma)`, then
  `exp(-|·|)` summed over electrons and atoms into the logits (sigma the only parameter)."""

  rng = np.random.default_rng(21)  # numpy: a jax.random draw compiles a program per shape.
  eye = np.broadcast_to(np.eye(3)[:, :, None, None], (3, 3, _ATOMS, _ORBITALS))
  params = {"sigma": eye + 0.3 * rng.standard_normal(eye.shape)}
  ae = rng.standard_normal((n, _ELECTRONS, _ATOMS, 3))
  batch = {"ae": ae, "y": rng.integers(0, _ORBITALS, n, dtype=np.int32)}

  def scaled(sigma, ae):
    return jnp.einsum("bnai,ijak->bnajk", ae, sigma)  # [N, n, A, 3, K]

  def logits_of(y):
    return jnp.sum(jnp.exp(-jnp.linalg.norm(y, axis=3)), axis=(1, 2))  # [N, K]

  def loss_fn(p, b):
    return _ce(logits_of(scaled(p["sigma"], b["ae"])), b["y"])

  return loss_fn, params, batch, scaled, logits_of


def _envelope_by_hand(params, batch, scaled, logits_of):
  """Per atom m: A_m = (1/R) Σ_r x_r x_rᵀ over the R = N·n (walker, electron) rows, x_r the
  electron's vector to atom m; G_m = (1/N) Σ_r g_r g_rᵀ, g_r = ∂ℓ_n/∂y[n, i, m, :, :] (the
  (j, k) outputs row-major); and the flat indices of atom m's kernel entries, (i, j, k)
  row-major, the order of A_m ⊗ G_m."""
  n = batch["ae"].shape[0]

  @jax.jit
  def outputs_and_grads(sigma, b):
    y = scaled(sigma, b["ae"])
    return jax.grad(lambda yy: _per_example_ce(logits_of(yy), b["y"]).sum())(y)

  g = outputs_and_grads(params["sigma"], batch)
  x = np.asarray(batch["ae"]).reshape(-1, _ATOMS, 3)
  g = np.asarray(g).reshape(-1, _ATOMS, 3 * _ORBITALS)
  a = np.einsum("rmi,rmj->mij", x, x) / x.shape[0]
  gg = np.einsum("rmi,rmj->mij", g, g) / n
  flat = np.arange(params["sigma"].size).reshape(params["sigma"].shape)
  order = [flat[:, :, m, :].reshape(-1) for m in range(_ATOMS)]
  return a, gg, order


def test_envelope_is_one_kronecker_pair_per_atom_by_definition(x64):
  loss_fn, params, batch, scaled, logits_of = _envelope_model(4)
  est, _, dense = _estimate(loss_fn, params, batch)
  ((spec,),) = [est.layers]
  assert (spec.kind, spec.approx) == ("grouped_dense", "kron")
  assert spec.factor_shapes == ((_ATOMS, 3, 3), (_ATOMS, 3 * _ORBITALS, 3 * _ORBITALS))
  a, g, order = _envelope_by_hand(params, batch, scaled, logits_of)
  want = np.zeros_like(dense)
  for m in range(_ATOMS):
    want[np.ix_(order[m], order[m])] = np.kron(a[m], g[m])
  assert np.abs(a[0] - a[1]).max() > 1e-3  # Each atom's factors are its own.
  np.testing.assert_allclose(dense, want, rtol=1e-10, atol=1e-13)


def test_envelope_preconditioned_gradient_by_definition(x64):
  # Per atom, (A_m + π_m√λ I)⁻¹ ⊗ (G_m + √λ/π_m I)⁻¹ on atom m's kernel entries, with
  # π_m = sqrt((tr A_m / 3) / (tr G_m / 3K)) (factored damping, per atom).
  loss_fn, params, batch, scaled, logits_of = _envelope_model(4)
  est = kfac_jax.CurvatureEstimator(
    kfac_jax.Registration(loss_fn, params, batch, estimation_mode="empirical", check_loss=False)
  )
  lam = 1e-2

  @jax.jit
  def run(p, b):
    state = est.update_curvature(est.init(p), p, b, None, ema_decay=0.0)
    state = est.update_inverses(state, lam)
    grads = jax.grad(loss_fn)(p, b)
    return grads, est.multiply_matpower(state, grads, exp=-1)

  grads, got = run(params, batch)
  got = np.asarray(got["sigma"]).reshape(-1)
  a, g, order = _envelope_by_hand(params, batch, scaled, logits_of)
  flat_grad, want = np.asarray(grads["sigma"]).reshape(-1), np.zeros(params["sigma"].size)
  for m in range(_ATOMS):
    pi = np.sqrt((np.trace(a[m]) / 3) / (np.trace(g[m]) / (3 * _ORBITALS)))
    a_l = a[m] + pi * np.sqrt(lam) * np.eye(3)
    g_l = g[m] + np.sqrt(lam) / pi * np.eye(3 * _ORBITALS)
    want[order[m]] = np.linalg.solve(np.kron(a_l, g_l), flat_grad[order[m]])
  np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-12)


def test_envelope_full_block_equals_exact_fisher(x64):
  # The per-example gradients rebuilt from the per-atom rows (`approx="full"`) are jax's.
  loss_fn, params, batch, scaled, logits_of = _envelope_model(3)
  layers = kfac_jax.LayerConfig(defaults={"grouped_dense": "full"})
  est = kfac_jax.CurvatureEstimator(
    kfac_jax.Registration(
      loss_fn, params, batch, estimation_mode="empirical", layers=layers, check_loss=False
    )
  )
  _, dense = _fit(est, params, batch, dense=True)
  assert est.layers[0].approx == "full"
  per_example = lambda p, b: _per_example_ce(logits_of(scaled(p["sigma"], b["ae"])), b["y"])  # noqa: E731
  exact = _exact_empirical(per_example, params, batch)
  np.testing.assert_allclose(np.asarray(dense), exact, rtol=1e-10, atol=1e-13)
