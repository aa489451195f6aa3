"""The scanner finds dense layers in linen, nnx and plain-jnp models, and reports problems."""

# `check_loss=False` where the test is about the layers found: the loss audit is tested in
# tests/test_audit.py and the zoo; here it would only compile another program.

import warnings

import flax.linen as nn
import jax
import jax.flatten_util
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import kfac_jax
from tests import _models


def _kinds(layers):
  return [(l.name, l.kind, l.param_paths) for l in layers]


def test_linen_mlp():
  model = _models.LinenMLP((5, 3))
  batch = _models.classification_batch(jax.random.key(0))
  params = jax.jit(model.init)(jax.random.key(1), batch["x"])
  layers = kfac_jax.Registration(
    _models.softmax_loss(model.apply), params, batch, check_loss=False
  ).layers
  assert _kinds(layers) == [
    ("params/Dense_0", "dense", ("params/Dense_0/kernel", "params/Dense_0/bias")),
    ("params/Dense_1", "dense", ("params/Dense_1/kernel", "params/Dense_1/bias")),
  ]
  assert layers[0].factor_shapes == ((5, 5), (5, 5))  # 4 inputs + homogeneous coordinate.
  assert layers[1].factor_shapes == ((6, 6), (3, 3))
  assert all(l.approx == "kron" and l.source == "auto" for l in layers)


def test_nnx_mlp():
  model = _models.NnxMLP(4, 6, 3, nnx.Rngs(0))
  graphdef, params = nnx.split(model, nnx.Param)
  params = nnx.to_pure_dict(params)

  def apply(p, x):
    m = nnx.merge(graphdef, p)
    return m(x)

  batch = _models.classification_batch(jax.random.key(0))
  layers = kfac_jax.Registration(
    _models.softmax_loss(apply), params, batch, check_loss=False
  ).layers
  assert _kinds(layers) == [
    ("linear1", "dense", ("linear1/kernel", "linear1/bias")),
    ("linear2", "dense", ("linear2/kernel", "linear2/bias")),
  ]


def test_plain_jnp_mlp_with_l2_term():
  params = _models.jnp_mlp_init(jax.random.key(0), (4, 7, 3))
  batch = _models.classification_batch(jax.random.key(1))
  base = _models.softmax_loss(_models.jnp_mlp_apply)

  def loss_fn(p, b):  # The L2 term uses every parameter a second time, outside the loss slice.
    return base(p, b) + 1e-4 * optax.tree.norm(p, squared=True)

  layers = kfac_jax.Registration(loss_fn, params, batch, check_loss=False).layers
  assert _kinds(layers) == [
    ("layer0", "dense", ("layer0/w", "layer0/b")),
    ("layer1", "dense", ("layer1/w", "layer1/b")),
  ]


def test_leading_batch_dims_and_nested_jit():
  params = _models.jnp_mlp_init(jax.random.key(0), (4, 7, 3))

  @jax.jit
  def apply(p, x):  # x: [batch, time, features]
    return _models.jnp_mlp_apply(p, x)

  def loss_fn(p, b):
    logits = apply(p, b["x"])
    kfac_jax.register_softmax_cross_entropy_loss(logits, b["y"], weight=1 / 5)
    return optax.softmax_cross_entropy_with_integer_labels(logits, b["y"]).mean()

  batch = {"x": jnp.ones((2, 5, 4)), "y": jnp.zeros((2, 5), jnp.int32)}
  layers = kfac_jax.Registration(loss_fn, params, batch, check_loss=False).layers
  assert [l.kind for l in layers] == ["dense", "dense"]
  assert layers[0].dense.rows == 10


def test_dense_general_multi_axis_kernels():
  class Attn(nn.Module):
    @nn.compact
    def __call__(self, x):
      q = nn.DenseGeneral((2, 3), name="q")(x)  # kernel [4, 2, 3]
      return nn.DenseGeneral(5, axis=(-2, -1), name="out")(q)  # kernel [2, 3, 5]

  model = Attn()
  batch = _models.classification_batch(jax.random.key(0), n=6)
  batch["y"] = jnp.zeros((6,), jnp.int32)
  params = jax.jit(model.init)(jax.random.key(1), batch["x"])
  layers = kfac_jax.Registration(
    _models.softmax_loss(model.apply), params, batch, check_loss=False
  ).layers
  assert _kinds(layers) == [
    ("params/out", "dense", ("params/out/kernel", "params/out/bias")),
    ("params/q", "dense", ("params/q/kernel", "params/q/bias")),
  ]
  by_name = {l.name: l for l in layers}
  assert by_name["params/q"].factor_shapes == ((5, 5), (6, 6))
  assert by_name["params/out"].factor_shapes == ((7, 7), (5, 5))


def test_transposed_kernel_and_kernel_as_lhs():
  def loss_fn(p, b):
    h = jnp.tanh(b["x"] @ p["w_t"].T)  # PyTorch layout [out, in].
    logits = (p["v"] @ h.T).T  # Kernel on the left.
    kfac_jax.register_softmax_cross_entropy_loss(logits, b["y"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, b["y"]).mean()

  params = {"w_t": jnp.ones((6, 4)), "v": jnp.ones((3, 6))}
  batch = _models.classification_batch(jax.random.key(0))
  layers = kfac_jax.Registration(loss_fn, params, batch, check_loss=False).layers
  assert [(l.param_paths, l.factor_shapes) for l in layers] == [
    (("v",), ((6, 6), (3, 3))),
    (("w_t",), ((4, 4), (6, 6))),
  ]


def test_uncovered_parameters_warn_once_or_raise_when_strict():
  params = _models.jnp_mlp_init(jax.random.key(0), (4, 7, 3))
  params["scale"] = jnp.ones((7,))
  params["unused"] = jnp.ones((2,))

  def loss_fn(p, b):
    h = jnp.tanh(b["x"] @ p["layer0"]["w"] + p["layer0"]["b"]) * p["scale"] ** 2
    logits = h @ p["layer1"]["w"] + p["layer1"]["b"]
    kfac_jax.register_softmax_cross_entropy_loss(logits, b["y"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, b["y"]).mean()

  batch = _models.classification_batch(jax.random.key(1))
  with pytest.warns(kfac_jax.UncoveredParametersWarning) as record:
    layers = kfac_jax.Registration(loss_fn, params, batch).layers
  assert len(record) == 1
  assert "`scale`" in str(record[0].message) and "`unused`" in str(record[0].message)
  generic = [l for l in layers if l.kind == "generic"]
  assert [(l.param_paths, l.approx, l.source) for l in generic] == [
    (("scale",), "diagonal", "fallback"),
    (("unused",), "diagonal", "fallback"),
  ]
  with pytest.raises(kfac_jax.RegistrationError, match="`scale`.*`unused`"):
    kfac_jax.Registration(loss_fn, params, batch, strict=True)


def test_manual_tags_take_precedence():
  params = {"w": jnp.ones((4, 3)), "b": jnp.zeros((3,)), "s": jnp.ones((3,))}

  def loss_fn(p, b):
    y = b["x"] @ p["w"] + p["b"]
    y = kfac_jax.register_dense(y, b["x"], p["w"], p["b"])
    logits = y * kfac_jax.register_generic(p["s"], approx="full")
    kfac_jax.register_softmax_cross_entropy_loss(logits, b["y"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, b["y"]).mean()

  batch = _models.classification_batch(jax.random.key(1))
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    layers = kfac_jax.Registration(loss_fn, params, batch).layers
  assert [(l.kind, l.param_paths, l.approx, l.source) for l in layers] == [
    ("dense", ("w", "b"), "kron", "manual"),
    ("generic", ("s",), "full", "manual"),
  ]


def test_summary_table():
  model = _models.LinenMLP((5, 3))
  batch = _models.classification_batch(jax.random.key(0))
  params = jax.jit(model.init)(jax.random.key(1), batch["x"])
  table = kfac_jax.summary(_models.softmax_loss(model.apply), params, batch)
  lines = table.splitlines()
  assert lines[0].split() == [
    "layer",
    "kind",
    "uses",
    "approx",
    "parameters",
    "factor",
    "shapes",
    "memory",
  ]
  assert "params/Dense_0  dense  1     kron    kernel, bias  5x5 5x5" in table
  # Factors plus cached inverses plus the damping scalar, float32: 4 * (2 * (25 + 25) + 1).
  assert "404 B" in lines[2]
  assert "43 values" in next(line for line in lines if line.startswith("total"))


def test_no_loss_tag_error_says_how_to_add_one():
  params = _models.jnp_mlp_init(jax.random.key(0), (4, 3))

  def loss_fn(p, b):
    return jnp.mean(_models.jnp_mlp_apply(p, b["x"]) ** 2)

  with pytest.raises(kfac_jax.RegistrationError, match="register_softmax_cross_entropy_loss"):
    kfac_jax.Registration(loss_fn, params, _models.classification_batch(jax.random.key(1)))


@pytest.mark.parametrize(
  "case", ["twice", "not_param", "bad_approx", "int_param", "non_scalar", "bias_mismatch"]
)
def test_registration_errors_name_the_parameter(case):
  params = {"w": jnp.ones((4, 3)), "b": jnp.zeros((3,)), "c": jnp.zeros((5,))}
  batch = _models.classification_batch(jax.random.key(1))

  def loss_fn(p, b):
    y = b["x"] @ p["w"] + p["b"]
    if case == "twice":
      kfac_jax.register_generic(p["w"])
      kfac_jax.register_dense(y, b["x"], p["w"], p["b"])
    elif case == "not_param":
      kfac_jax.register_dense(y, b["x"], jnp.ones((4, 3)))
    elif case == "bad_approx":
      kfac_jax.register_generic(p["b"], approx="kron")
    elif case == "bias_mismatch":
      y2 = kfac_jax.register_dense(y, b["x"], p["w"], p["b"])
      return y2.sum() + kfac_jax.register_generic(p["c"]).sum()
    kfac_jax.register_softmax_cross_entropy_loss(y, b["y"])
    out = optax.softmax_cross_entropy_with_integer_labels(y, b["y"])
    return out if case == "non_scalar" else out.mean()

  if case == "int_param":
    params["n"] = jnp.ones((2,), jnp.int32)
  expected = {
    "twice": "`w` is registered twice",
    "not_param": "not a parameter leaf",
    "bad_approx": r"approximation 'kron' does not fit the generic layer.*\['b'\]",
    "int_param": "parameter `n` has dtype int32",
    "non_scalar": "one scalar loss",
    "bias_mismatch": "no loss tag",
  }[case]
  with pytest.raises(kfac_jax.RegistrationError, match=expected):
    kfac_jax.Registration(loss_fn, params, batch)


def test_channel_first_scale_and_shift_is_exact(x64):
  """A per-channel scale and shift over [N, C, H, W] (equinox's BatchNorm: `w[:, None, None]`,
  an inner feature axis) is a scale-and-shift layer, and its "full" block in the exact mode is
  the exact Fisher block (1/N) Σ_n J_nᵀ (diag p_n − p_n p_nᵀ) J_n of (w, b)."""
  rng = _models.np_rng(0)
  params = jax.device_put({"w": rng.standard_normal(3), "b": rng.standard_normal(3)})
  batch = jax.device_put(
    {"x": rng.standard_normal((5, 3, 2, 2)), "y": rng.integers(0, 3, 5).astype(np.int32)}
  )

  def logits_fn(p, b):
    y = b["x"] * p["w"][:, None, None] + p["b"][:, None, None]
    return jnp.tanh(y).mean(axis=(2, 3))  # [N, C]: the channels are the classes.

  def loss_fn(p, b):
    logits = logits_fn(p, b)
    kfac_jax.register_softmax_cross_entropy_loss(logits, b["y"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, b["y"]).mean()

  (layer,) = kfac_jax.Registration(loss_fn, params, batch, strict=True, check_loss=False).layers
  assert (layer.kind, layer.approx, layer.param_paths) == ("scale_and_shift", "full", ("w", "b"))
  assert (layer.info.feature_axis, layer.info.feature_shape) == (1, (3,))

  est = kfac_jax.CurvatureEstimator(
    kfac_jax.Registration(loss_fn, params, batch, estimation_mode="exact", check_loss=False)
  )

  @jax.jit  # One program: eager ops would each compile on their own.
  def both(params, batch):
    state = est.update_curvature(est.init(params), params, batch, None, ema_decay=0.0)
    flat, unravel = jax.flatten_util.ravel_pytree(params)
    jac = _models.jit_jacobian(lambda f: logits_fn(unravel(f), batch))(flat)  # [N, C, P]
    p = jax.nn.softmax(logits_fn(params, batch))
    fz = jax.vmap(jnp.diag)(p) - p[:, :, None] * p[:, None, :]
    return est.to_dense(state), jnp.einsum("nci,ncd,ndj->ij", jac, fz, jac) / 5

  dense, exact = both(params, batch)
  np.testing.assert_allclose(dense, exact, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("spread", ["broadcast_to", "tile", "two_tokens"])
def test_class_token_is_exact_shift(x64, spread):
  """A learned token broadcast over the batch and concatenated with the patch tokens (a ViT's
  class token; DeiT's class and distillation tokens, two in one concatenation) is a shift-only
  scale_and_shift layer, not a generic fallback; its "full" block in the exact mode is the
  exact Fisher block of the token."""
  rng = _models.np_rng(0)
  params = {"cls": rng.standard_normal((1, 1, 3)), "w": rng.standard_normal((3, 3))}
  batch = {"x": rng.standard_normal((5, 2, 3)), "y": rng.integers(0, 3, 5).astype(np.int32)}
  tokens = ("cls",)
  if spread == "two_tokens":
    params["dist"] = rng.standard_normal((1, 1, 3))
    tokens = ("cls", "dist")
  params, batch = jax.device_put((params, batch))

  def logits_fn(p, b):
    n = b["x"].shape[0]
    if spread == "tile":
      toks = [jnp.tile(p["cls"], (n, 1, 1))]
    else:
      toks = [jnp.broadcast_to(p[t], (n, 1, 3)) for t in tokens]
    h = jnp.concatenate([*toks, b["x"]], axis=1)  # [N, T + L, D]
    mixed = jax.nn.softmax(jnp.einsum("nld,nmd->nlm", h, h))  # Token mixing.
    return jnp.tanh(jnp.einsum("nlm,nmd->nld", mixed, h)[:, 0] @ p["w"])

  def loss_fn(p, b):
    logits = logits_fn(p, b)
    kfac_jax.register_softmax_cross_entropy_loss(logits, b["y"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, b["y"]).mean()

  layers = kfac_jax.Registration(loss_fn, params, batch, strict=True, check_loss=False).layers
  assert [(l.kind, l.approx, l.param_paths) for l in layers] == [
    ("scale_and_shift", "full", (t,)) for t in tokens
  ] + [("dense", "kron", ("w",))]
  assert all(l.info.feature_shape == (3,) for l in layers[:-1])

  est = kfac_jax.CurvatureEstimator(
    kfac_jax.Registration(loss_fn, params, batch, estimation_mode="exact", check_loss=False)
  )
  t = 3 * len(tokens)

  @jax.jit  # One program: eager ops would each compile on their own.
  def both(params, batch):
    state = est.update_curvature(est.init(params), params, batch, None, ema_decay=0.0)
    tok = {n: params[n] for n in tokens}
    flat, unravel = jax.flatten_util.ravel_pytree(tok)
    jac = _models.jit_jacobian(lambda f: logits_fn(dict(params, **unravel(f)), batch))(
      flat
    )  # [N, C, t]
    p = jax.nn.softmax(logits_fn(params, batch))
    fz = jax.vmap(jnp.diag)(p) - p[:, :, None] * p[:, None, :]
    exact = jnp.einsum("nci,ncd,ndj->ij", jac, fz, jac) / 5
    # The tokens are the first leaves: their blocks lie on the top left of the block-diagonal
    # matrix, one 3 x 3 block each (no cross-token terms: separate layers).
    mask = jnp.kron(jnp.eye(len(tokens)), jnp.ones((3, 3)))
    return est.to_dense(state)[:t, :t], exact * mask

  dense, exact = both(params, batch)
  np.testing.assert_allclose(dense, exact, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize(
  "use", ["norm_and_residual", "mask_token", "scanned", "embed_arange", "vmapped_arange"]
)
def test_tokens_broadcast_over_the_batch_are_an_exact_shift(x64, use):
  """Learned tokens broadcast over the batch and read as activations by several operations
  (Perceiver latents: a normalisation's input and a residual add; a masked model's mask token in
  a `where`) are a shift-only scale_and_shift layer, not a generic fallback (whose estimate
  comes from batch-summed gradients): the "full" block of a `[D]` token in the exact mode is
  the exact Fisher block, and a `[L, D]` table gets the "diagonal" default, the exact diagonal.
  A token per layer of a `lax.scan` over stacked layers is a stacked layer, exact per layer. A
  positional table read at every position as an embedding, `jnp.take(table, jnp.arange(T))`
  (GPT-2's `wpe`), or one row per index under `jax.vmap` (equinox), is the table itself: the
  same shift-only layer."""
  rng = _models.np_rng(0)
  tok_shape = {"norm_and_residual": (3,), "mask_token": (2, 3), "scanned": (4, 3)}.get(use, (2, 3))
  params = jax.device_put({"tok": rng.standard_normal(tok_shape), "w": rng.standard_normal((3, 3))})
  batch = jax.device_put(
    {
      "x": rng.standard_normal((5, 2, 3)),
      "y": rng.integers(0, 3, 5).astype(np.int32),
      "mask": rng.random((5, 2, 1)) < 0.5,
    }
  )

  def logits_fn(p, b):
    n = b["x"].shape[0]
    if use == "norm_and_residual":
      q = jnp.broadcast_to(p["tok"], (n, 3))  # One learned query per example.
      h = q / jnp.sqrt(jnp.mean(q * q, -1, keepdims=True) + 1.0)  # An RMS norm's input...
      att = jax.nn.softmax(jnp.einsum("nd,nld->nl", h, b["x"]))
      out = q + jnp.einsum("nl,nld->nd", att, b["x"])  # ...and the residual.
    elif use == "mask_token":
      t = jnp.broadcast_to(p["tok"], (n, 2, 3))
      out = jnp.where(b["mask"], t, b["x"]).sum(1)  # Masked positions read the mask token.
    elif use in ("embed_arange", "vmapped_arange"):
      if use == "embed_arange":
        pos = jnp.take(p["tok"], jnp.arange(2), axis=0)  # `nn.Embed(2, 3)(jnp.arange(2))`.
      else:  # Equinox: `jax.vmap(eqx.nn.Embedding(...))(jnp.arange(2))`, one row per index.
        pos = jax.vmap(lambda i: p["tok"][i])(jnp.arange(2))
      out = jnp.tanh(b["x"] + pos).sum(1)
    else:

      def layer(h, tok):
        q = jnp.broadcast_to(tok, h.shape)  # Read twice: an add and a product.
        return jnp.tanh(h + q) * (1 + 0.1 * q), None

      out, _ = jax.lax.scan(layer, b["x"].sum(1), p["tok"])
    return jnp.tanh(out @ p["w"])

  def loss_fn(p, b):
    logits = logits_fn(p, b)
    kfac_jax.register_softmax_cross_entropy_loss(logits, b["y"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, b["y"]).mean()

  approx = "diagonal" if use in ("mask_token", "embed_arange", "vmapped_arange") else "full"
  layers = kfac_jax.Registration(loss_fn, params, batch, strict=True, check_loss=False).layers
  assert [(l.kind, l.approx, l.param_paths) for l in layers] == [
    ("scale_and_shift", approx, ("tok",)),
    ("dense", "kron", ("w",)),
  ]
  assert layers[0].info.feature_shape == (tok_shape[1:] if use == "scanned" else tok_shape)
  assert layers[0].stack_size == (tok_shape[0] if use == "scanned" else 0)

  est = kfac_jax.CurvatureEstimator(
    kfac_jax.Registration(loss_fn, params, batch, estimation_mode="exact", check_loss=False)
  )
  t = int(np.prod(tok_shape))

  @jax.jit
  def both(params, batch):
    state = est.update_curvature(est.init(params), params, batch, None, ema_decay=0.0)
    flat, unravel = jax.flatten_util.ravel_pytree(params["tok"])
    jac = _models.jit_jacobian(lambda f: logits_fn(dict(params, tok=unravel(f)), batch))(flat)
    p = jax.nn.softmax(logits_fn(params, batch))
    fz = jax.vmap(jnp.diag)(p) - p[:, :, None] * p[:, None, :]
    exact = jnp.einsum("nci,ncd,ndj->ij", jac, fz, jac) / 5
    if approx == "diagonal":
      exact = jnp.diag(jnp.diag(exact))
    if use == "scanned":  # One block per layer: no cross-layer terms.
      exact = exact * jnp.kron(jnp.eye(tok_shape[0]), jnp.ones((3, 3)))
    return est.to_dense(state)[:t, :t], exact

  dense, exact = both(params, batch)
  assert float(jnp.abs(exact).max()) > 1e-3  # The tokens matter to the loss.
  np.testing.assert_allclose(dense, exact, rtol=1e-10, atol=1e-12)


def _assert_full_blocks_exact(predict, loss_of, params, batch, kinds):
  """Every layer in its "full" approximation (exact mode) against the exact Gauss-Newton block
  `Jᵀ H J`, H the Hessian of the loss in the predictions; `kinds`: the layers' sorted kinds.
  `loss_of(pred, batch, tag)` registers the loss tag when `tag`."""
  layers = kfac_jax.LayerConfig(overrides={"*": "full"})
  est = kfac_jax.CurvatureEstimator(
    kfac_jax.Registration(
      lambda q, b: loss_of(predict(q, b), b, True),
      params,
      batch,
      estimation_mode="exact",
      layers=layers,
      check_loss=False,
    )
  )
  assert sorted(s.kind for s in est.layers) == kinds
  assert {s.approx for s in est.layers} == {"full"}

  @jax.jit
  def both(params, batch):
    state = est.update_curvature(est.init(params), params, batch, None, ema_decay=0.0)
    flat, unravel = jax.flatten_util.ravel_pytree(params)
    pred = predict(params, batch)
    jac = _models.jit_jacobian(lambda f: predict(unravel(f), batch))(flat).reshape(pred.size, -1)
    hess = _models.jit_hessian(lambda z: loss_of(z, batch, False))(pred).reshape(
      pred.size, pred.size
    )
    return est.to_dense(state), jac.T @ hess @ jac

  dense, ggn = map(np.asarray, both(params, batch))
  sizes = [x.size for x in jax.tree.leaves(params)]
  offsets = np.concatenate([[0], np.cumsum(sizes)])
  for spec in est.layers:
    idx = np.concatenate([np.arange(offsets[j], offsets[j + 1]) for j in spec.leaf_indices])
    block = ggn[np.ix_(idx, idx)]
    assert np.abs(block).max() > 1e-3, spec.name  # The layer matters to the loss.
    np.testing.assert_allclose(dense[np.ix_(idx, idx)], block, rtol=1e-10, atol=1e-12)


def test_per_example_shuffles_and_mask_tokens_keep_every_layer_exact(x64):
  """A masked autoencoder's row plumbing: patches embedded, shuffled per example
  (`argsort` of noise, `take_along_axis`), a visible subset encoded, learned mask tokens
  appended, the order restored by a second per-example gather, and a decoder. Every layer's
  "full" block is exact (`_assert_full_blocks_exact`): the gathers keep each row with its
  example."""
  n, p, d, h, keep = 3, 5, 2, 3, 2
  rng = _models.np_rng(0)
  params = jax.device_put(
    {
      "embed": {"w": rng.standard_normal((d, h)), "b": 0.1 * rng.standard_normal(h)},
      "pos": 0.3 * rng.standard_normal((p, h)),
      "enc": {"w": rng.standard_normal((h, h)) / 2},
      "mask_token": 0.3 * rng.standard_normal((1, 1, h)),
      "dec": {"w": rng.standard_normal((h, d)) / 2, "b": np.zeros(d)},
    }
  )
  batch = jax.device_put({"x": rng.standard_normal((n, p, d)), "noise": rng.random((n, p))})

  def predict(q, b):
    ids = jnp.argsort(b["noise"], axis=1)
    restore = jnp.argsort(ids, axis=1)
    e = b["x"] @ q["embed"]["w"] + q["embed"]["b"] + q["pos"]
    seen = jnp.take_along_axis(e, ids[:, :keep, None], axis=1)
    seen = seen + jnp.tanh(seen @ q["enc"]["w"])
    tokens = jnp.broadcast_to(q["mask_token"], (n, p - keep, h))
    full = jnp.take_along_axis(jnp.concatenate([seen, tokens], 1), restore[..., None], axis=1)
    return jnp.tanh(full) @ q["dec"]["w"] + q["dec"]["b"]

  kinds = ["dense"] * 3 + ["scale_and_shift"] * 2
  _assert_full_blocks_exact(predict, _squared_error_of, params, batch, kinds)


def _squared_error_of(pred, b, tag):
  if tag:
    kfac_jax.register_squared_error_loss(pred, b["x"])
  return jnp.mean(jnp.sum((pred - b["x"]) ** 2, axis=tuple(range(1, pred.ndim))))


def _layer_norm(x, scale, bias):
  mu = x.mean(-1, keepdims=True)
  return (x - mu) / jnp.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + 1e-5) * scale + bias


@pytest.mark.parametrize("layout", ["time_major", "scanned", "time_major_input", "frames"])
def test_rows_are_grouped_by_the_batch_axis_followed_from_the_inputs(x64, layout):
  """Activations whose axes' sizes cannot tell the batch apart, N = 3 examples:
  `time_major` `[T, N, D]` with T = N; `scanned`, the same made by a recurrence over time
  (`lax.scan`, as `hk.dynamic_unroll` runs one; the graph unrolls it); `time_major_input`, the
  batch itself passed time-major (`[T, N, D]`, T = N: only the predictions, batch-major for the
  loss tag, tell which axis is the batch); and `frames`, `(b f) p d` rows (attention over each
  frame, TimeSformer-style) with p = N. A dense layer and a LayerNorm on them, each "full", are
  exact: their rows are grouped by the batch axis `_batch_axes` follows from the inputs (by
  size, the time-major layers took axis 0, and the frames' layers axis 1)."""
  n, d = 3, 2
  rng = _models.np_rng(1)
  params = jax.device_put(
    {
      "w": rng.standard_normal((d, d)),
      "ln": {"scale": 1 + 0.3 * rng.standard_normal(d), "bias": 0.1 * rng.standard_normal(d)},
      "out": rng.standard_normal((d, d)) / 2,
    }
  )
  x_shape = (n, n, d) if layout != "frames" else (n, 2, n, d)  # frames: [B, F, P, D], P = N
  batch = jax.device_put({"x": rng.standard_normal(x_shape)})

  def predict(q, b):
    x = b["x"]
    if layout == "time_major":
      h = jnp.tanh(jnp.swapaxes(x, 0, 1) @ q["w"])  # [T, N, D]
    elif layout == "time_major_input":
      h = jnp.tanh(x @ q["w"])  # x is [T, N, D] already
    elif layout == "scanned":

      def step(carry, x_t):  # x_t: [N, D]
        carry = jnp.tanh(x_t @ q["w"] + 0.5 * carry)
        return carry, carry

      _, h = jax.lax.scan(step, jnp.zeros((n, d), x.dtype), jnp.swapaxes(x, 0, 1))
    else:
      h = jnp.tanh(x.reshape(n * 2, n, d) @ q["w"])  # (b f) p d
    h = _layer_norm(h, q["ln"]["scale"], q["ln"]["bias"])
    if layout == "frames":
      h = jax.nn.softmax(h @ jnp.swapaxes(h, 1, 2)) @ h  # attention within each frame
    h = h @ q["out"]
    return h.reshape(x.shape) if layout == "frames" else jnp.swapaxes(h, 0, 1)

  kinds = ["dense", "dense", "scale_and_shift"]
  _assert_full_blocks_exact(predict, _squared_error_of, params, batch, kinds)


@pytest.mark.parametrize(
  "kind,approx", [("dense", "full"), ("dense", "diagonal"), ("scale_and_shift", "full")]
)
def test_a_time_major_layer_groups_its_rows_by_example(x64, kind, approx):
  """A dense or scale-and-shift layer applied to time-major activations (`[T, N, D]`, the batch
  moved to axis 1 as `hk.dynamic_unroll` and `nn.RNN(time_major=True)` want it): the
  per-example approximations group the rows by example, so they find the batch axis (by its
  size) and take the rows batch-major. The block is the exact Fisher block of the per-example
  losses (summed over the T positions, averaged over the batch)."""
  n, t, d, c = 3, 4, 2, 3
  rng = _models.np_rng(0)
  w = jax.device_put(rng.standard_normal((d, c)))
  if kind == "dense":
    params = {"w": w}
  else:
    params = jax.device_put(
      {"s": 1 + 0.3 * rng.standard_normal(d), "t": 0.1 * rng.standard_normal(d)}
    )
  batch = jax.device_put(
    {"x": rng.standard_normal((n, t, d)), "y": rng.integers(0, c, (n, t)).astype(np.int32)}
  )

  def logits_fn(p, b):
    h = jnp.tanh(jnp.swapaxes(b["x"], 0, 1))  # [T, N, D]
    if kind == "dense":
      return jnp.swapaxes(h @ p["w"], 0, 1)  # [N, T, C]
    return jnp.swapaxes((h * p["s"] + p["t"]) @ w, 0, 1)

  def loss_fn(p, b):
    logits = logits_fn(p, b)
    kfac_jax.register_softmax_cross_entropy_loss(logits, b["y"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, b["y"]).sum(1).mean()

  layers = kfac_jax.LayerConfig(overrides={"*": approx})
  est = kfac_jax.CurvatureEstimator(
    kfac_jax.Registration(
      loss_fn, params, batch, estimation_mode="exact", layers=layers, check_loss=False
    )
  )
  (spec,) = est.layers
  assert (spec.kind, spec.approx) == (kind, approx)
  names = ["w"] if kind == "dense" else ["s", "t"]  # The block's order: scale, then shift.
  flat = jnp.concatenate([params[m].reshape(-1) for m in names])
  sizes = [params[m].size for m in names]

  def unflat(f):
    parts = jnp.split(f, np.cumsum(sizes)[:-1])
    return {m: v.reshape(params[m].shape) for m, v in zip(names, parts)}

  @jax.jit  # One program: eager ops would each compile on their own.
  def both(params, batch, flat):
    state = est.update_curvature(est.init(params), params, batch, None, ema_decay=0.0)
    jac = jax.jacobian(lambda f: logits_fn(unflat(f), batch))(flat)
    prob = jax.nn.softmax(logits_fn(params, batch))
    fz = jax.vmap(jax.vmap(jnp.diag))(prob) - prob[..., :, None] * prob[..., None, :]
    exact = jnp.einsum("ntci,ntcd,ntdj->ij", jac, fz, jac) / n
    if approx == "diagonal":
      exact = jnp.diag(jnp.diag(exact))
    return est.to_dense(state), exact

  dense, exact = both(params, batch, flat)
  np.testing.assert_allclose(dense, exact, rtol=1e-10, atol=1e-12)


def test_a_product_hoisted_out_of_vmap_is_tapped_where_each_example_reads_it():
  """`jax.vmap` of a `jax.jvp` computes the tangent product `e W` once for all examples and
  broadcasts it where the derivative at each example multiplies it: the use's tap is at those
  broadcasts with the batch axis inserted (`HoistedTap`), its input the direction, one row per
  example; a kernel read transposed by `jax.grad` is a use marked `transposed`."""
  params = {"w": _models.normal(0, (3, 4)), "b": jnp.zeros(4)}
  batch = {"x": _models.normal(1, (5, 3))}
  e = jnp.array([1.0, 0.0, 0.0])

  def loss_fn(p, b, grad=False):
    u = lambda y: jnp.sum(jnp.tanh(y @ p["w"] + p["b"]) ** 2)  # noqa: E731
    op = (lambda y: jax.grad(u)(y)[0]) if grad else (lambda y: jax.jvp(u, (y,), (e,))[1])
    r = jax.vmap(op)(b["x"])[:, None]
    kfac_jax.register_squared_error_loss(r)
    return jnp.mean(r**2)

  scan = kfac_jax.scan.scan(loss_fn, params, batch)
  (layer,) = scan.layers
  assert (layer.kind, layer.num_uses, layer.param_paths) == ("dense", 2, ("w", "b"))
  tap = scan.extra_uses[0][0][0]
  assert isinstance(tap, kfac_jax.scan.HoistedTap)
  assert set(tap.axes) == {0} and all(s == (5, 4) for s in tap.shapes)
  assert [(i.adds_bias, i.rows, bool(i.shared_tap)) for i in layer.use_infos] == [
    (True, 5, False),
    (False, 1, True),
  ]
  grad_layer = kfac_jax.scan.scan(lambda p, b: loss_fn(p, b, True), params, batch).layers[0]
  assert [i.transposed for i in grad_layer.use_infos] == [False, True]
