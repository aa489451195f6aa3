"""Layers read the same way by every example, against their definitions and the exact Fisher
(float64): a dense layer whose input rows are shared by the batch (a MAP head's learned probe),
tables gathered at constant positions (T5's relative-position bias, GPT-2's `wpe`), and the
`summary` notes of shift-only tables."""

# `check_loss=False`: the loss audit is tested in tests/test_audit.py and the zoo; here it would
# only compile another program.

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import kfac_jax
from tests import _models

N, L, D, C = 5, 4, 3, 4


def _ce(logits, y):
  kfac_jax.register_softmax_cross_entropy_loss(logits, y)
  return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def _per_example(logits_fn):
  return lambda p, b: optax.softmax_cross_entropy_with_integer_labels(logits_fn(p, b), b["y"])


def _estimate(loss_fn, params, batch, layers=None):
  est = kfac_jax.CurvatureEstimator(
    kfac_jax.Registration(
      loss_fn, params, batch, estimation_mode="empirical", layers=layers, check_loss=False
    )
  )
  # One program: run eagerly, the ops of `init` and `to_dense` would each compile their own.
  update = jax.jit(
    lambda p, b: est.to_dense(est.update_curvature(est.init(p), p, b, None, ema_decay=0.0))
  )
  return est, np.asarray(update(params, batch))


def _exact_empirical(per_example_fn, params, batch):
  """(1/N) Σ_n ∇ℓ_n ∇ℓ_nᵀ from per-example gradients (jax.jacobian), in raveled order."""
  jac = _models.flat_jacobian(lambda p: per_example_fn(p, batch), params)
  return jac.T @ jac / jac.shape[0]


def _indices(params, *paths):
  """The raveled positions of the leaves at `paths` ("a/b"), in the order given."""
  marks = jax.tree_util.tree_map_with_path(
    lambda path, v: np.full(v.shape, "/".join(k.key for k in path), object), params
  )
  flat = np.concatenate([m.reshape(-1) for m in jax.tree_util.tree_leaves(marks)])
  return np.concatenate([np.flatnonzero(flat == p) for p in paths])


def _seeds(n):
  """`n` seeds for `_models.normal` (inputs drawn on the host)."""
  return [70 + i for i in range(n)]


def _normal(seed, shape, dtype=jnp.float64):
  return _models.normal(seed, shape, dtype)


def _batch():
  return {"x": _normal(90, (N, L, D)), "y": _models.integers(91, 0, C, (N,))}


def _spec(specs, leaf):
  return next(s for s in specs if leaf in s.param_paths)


# -- a dense layer whose input rows every example shares ----------------------------------------


def _attend(q, x, p):
  """Each query row attends over the example's positions; the outputs, flattened, to logits."""
  k = x @ p["wk"]
  att = jax.nn.softmax(jnp.einsum("nqd,nkd->nqk", q, k), axis=-1)
  return jnp.einsum("nqk,nkd->nqd", att, x).reshape(x.shape[0], -1) @ p["head"]


def _tiled_probe_model():
  """big_vision's MAP head: a learned probe `[1, 1, D]` tiled over the batch, then the query
  projection (a dense layer with a bias) of the tiled probe."""
  k = _seeds(6)
  params = {
    "probe": _normal(k[0], (1, 1, D)),
    "q": {
      "kernel": _normal(k[1], (D, D)),
      "bias": _normal(k[2], (D,)),
    },
    "wk": _normal(k[3], (D, D)),
    "head": _normal(k[4], (D, C)),
  }

  def logits(p, b):
    probe = jnp.tile(p["probe"], (b["x"].shape[0], 1, 1))
    return _attend(probe @ p["q"]["kernel"] + p["q"]["bias"], b["x"], p)

  return logits, params, _batch()


def _projected_model(how):
  """R = 2 learned rows (or a constant table of L positions) projected by a dense layer, and
  only then broadcast over the batch: `jnp.broadcast_to(lat @ w + b, (N, 2, D))`, or added to
  the activations `x + (table @ w + b)`."""
  k = _seeds(6)
  params = {
    "q": {
      "kernel": _normal(k[1], (D, D)),
      "bias": _normal(k[2], (D,)),
    },
  }
  if how == "broadcast":
    params["wk"] = _normal(k[3], (D, D))
    params["lat"] = _normal(k[0], (2, D))
    params["head"] = _normal(k[4], (2 * D, C))
  else:
    params["head"] = _normal(k[4], (L * D, C))

  def logits(p, b):
    n = b["x"].shape[0]
    if how == "broadcast":
      q = p["lat"] @ p["q"]["kernel"] + p["q"]["bias"]
      return _attend(jnp.broadcast_to(q, (n, 2, D)), b["x"], p)
    table = jnp.sin(jnp.arange(L * 1.0)[:, None] * jnp.arange(1.0, D + 1)[None, :])
    h = b["x"] + (table @ p["q"]["kernel"] + p["q"]["bias"])
    return jnp.tanh(h).reshape(n, -1) @ p["head"]

  return logits, params, _batch()


def test_a_tiled_probe_and_its_projection_are_layers_and_kron_is_exact(x64):
  """The probe tiled over the batch is a shift-only layer (learned tokens) and the query
  kernel reading it a dense layer, not a fallback. With one shared row ā = [probe, 1], each
  example's gradient is ā ⊗ g_n, so the exact Fisher block is (ā āᵀ) ⊗ (1/N) Σ_n g_n g_nᵀ:
  the K-FAC block A ⊗ G is exact, A the shared row's outer product, G the per-example
  output-gradient statistics."""
  logits, params, batch = _tiled_probe_model()
  loss_fn = lambda p, b: _ce(logits(p, b), b["y"])
  specs = kfac_jax.Registration(loss_fn, params, batch, strict=True, check_loss=False).layers
  assert sorted((s.kind, s.approx, s.param_paths) for s in specs) == [
    ("dense", "kron", ("head",)),
    ("dense", "kron", ("q/kernel", "q/bias")),
    ("dense", "kron", ("wk",)),
    ("scale_and_shift", "full", ("probe",)),
  ]
  _, dense = _estimate(loss_fn, params, batch)
  exact = _exact_empirical(_per_example(logits), params, batch)
  q = _indices(params, "q/kernel", "q/bias")  # [kernel (in, out) row-major; bias] = A ⊗ G.
  # By definition: ā = [probe, 1]; g_n = ∂ℓ_n/∂q_n, the gradient at the projection's output.
  abar = np.append(np.asarray(params["probe"]).reshape(-1), 1.0)

  def per_example_of_q(qv):  # qv: [N, 1, D], the projection's output per example.
    return optax.softmax_cross_entropy_with_integer_labels(
      _attend(qv, batch["x"], params), batch["y"]
    )

  @jax.jit  # One program: run eagerly, each op compiles its own.
  def output_grads(params):
    q_out = jnp.tile(params["probe"], (N, 1, 1)) @ params["q"]["kernel"] + params["q"]["bias"]
    return jax.grad(lambda qv: per_example_of_q(qv).sum())(q_out)

  g = np.asarray(output_grads(params)).reshape(N, D)
  want = np.kron(np.outer(abar, abar), g.T @ g / N)
  np.testing.assert_allclose(dense[np.ix_(q, q)], want, rtol=1e-10, atol=1e-13)
  np.testing.assert_allclose(dense[np.ix_(q, q)], exact[np.ix_(q, q)], rtol=1e-10, atol=1e-13)
  # The probe's "full" block is its exact Fisher block too.
  pr = _indices(params, "probe")
  np.testing.assert_allclose(dense[np.ix_(pr, pr)], exact[np.ix_(pr, pr)], rtol=1e-10, atol=1e-13)
  assert np.abs(exact[np.ix_(q, q)]).max() > 1e-4


@pytest.mark.filterwarnings("ignore::kfac_jax.UncoveredParametersWarning")
@pytest.mark.parametrize("how", ["broadcast", "add"])
def test_a_projection_broadcast_afterwards_is_a_dense_layer_with_shared_rows(x64, how):
  """Rows computed from parameters and constants alone, projected, then broadcast over the
  batch (explicitly, or by an add with the activations): the kernel and bias are a dense layer
  tapped at the broadcast. Its factors are A = (1/R) Σ_r ā_r ā_rᵀ over the R shared rows and
  G = (1/N) Σ_n Σ_r g_{n,r} g_{n,r}ᵀ over the per-example output gradients, and its "full"
  block is the exact Fisher block (1/N) Σ_n j_n j_nᵀ, j_n = Σ_r ā_r ⊗ g_{n,r}."""
  logits, params, batch = _projected_model(how)
  loss_fn = lambda p, b: _ce(logits(p, b), b["y"])
  reg = kfac_jax.Registration(loss_fn, params, batch, strict=how == "add", check_loss=False)
  specs = reg.layers
  spec = _spec(specs, "q/kernel")
  assert (spec.kind, spec.approx, spec.param_paths) == ("dense", "kron", ("q/kernel", "q/bias"))
  if how == "broadcast":  # The learned rows are the projection's input: no per-example output.
    assert _spec(specs, "lat").kind == "generic"
    assert "the input of `q/kernel`" in kfac_jax.summary(registration=reg)

  _, dense = _estimate(loss_fn, params, batch)
  if how == "broadcast":
    rows = np.asarray(params["lat"])
  else:
    rows = np.sin(np.arange(L * 1.0)[:, None] * np.arange(1.0, D + 1)[None, :])
  xbar = np.concatenate([rows, np.ones((rows.shape[0], 1))], axis=1)
  a = xbar.T @ xbar / rows.shape[0]
  # g_{n,r}: the gradient of ℓ_n at example n's copy of the projection's output row r.

  def per_example_of_copies(copies):  # copies: [N, R, D], one copy of the output per example.
    p = params
    if how == "broadcast":
      out = _attend(copies, batch["x"], p)
    else:
      out = jnp.tanh(batch["x"] + copies).reshape(N, -1) @ p["head"]
    return optax.softmax_cross_entropy_with_integer_labels(out, batch["y"])

  @jax.jit  # One program: run eagerly, each op compiles its own.
  def output_grads(params):
    s = rows @ params["q"]["kernel"] + params["q"]["bias"]
    copies = jnp.broadcast_to(s, (N,) + s.shape)
    return jax.grad(lambda c: per_example_of_copies(c).sum())(copies)

  g = np.asarray(output_grads(params))
  gg = np.einsum("nri,nrj->ij", g, g) / N
  q = _indices(params, "q/kernel", "q/bias")
  np.testing.assert_allclose(dense[np.ix_(q, q)], np.kron(a, gg), rtol=1e-10, atol=1e-13)

  full = kfac_jax.LayerConfig(overrides={"q": "full"})
  _, dense_full = _estimate(loss_fn, params, batch, layers=full)
  exact = _exact_empirical(_per_example(logits), params, batch)
  j = np.einsum("ri,nro->nio", xbar, g).reshape(N, -1)  # [kernel rows; bias row] x outputs.
  np.testing.assert_allclose(exact[np.ix_(q, q)], j.T @ j / N, rtol=1e-10, atol=1e-13)
  np.testing.assert_allclose(dense_full[np.ix_(q, q)], exact[np.ix_(q, q)], rtol=1e-10, atol=1e-13)
  # With R > 1 rows the Kronecker block is an approximation: it differs from the exact one.
  assert not np.allclose(np.kron(a, gg), exact[np.ix_(q, q)], rtol=1e-3)


# -- tables gathered at constant positions -----------------------------------------------------

H, BUCKETS = 2, 6


def _t5_buckets(length, num_buckets=BUCKETS, max_distance=8):
  """T5's bidirectional relative-position buckets, computed from positions alone (log-spaced
  beyond an exact range): a `[length, length]` index array with repeats."""
  rel = jnp.arange(length)[None, :] - jnp.arange(length)[:, None]
  half = num_buckets // 2
  ret = (rel > 0).astype(jnp.int32) * half
  n = jnp.abs(rel)
  exact = half // 2
  large = exact + (
    jnp.log(n.astype(jnp.float32) / exact + 1e-6) / np.log(max_distance / exact) * (half - exact)
  ).astype(jnp.int32)
  return ret + jnp.where(n < exact, n, jnp.minimum(large, half - 1))


def _t5_model(seq=L):
  """Two-head self-attention whose logits get T5's relative-position bias: a `[buckets,
  heads]` table gathered at the buckets, transposed to `[1, heads, q, k]` and added."""
  k = _seeds(5)
  params = {
    "rel": _normal(k[0], (BUCKETS, H)),
    "wq": _normal(k[1], (D, 2 * H)),
    "wk": _normal(k[2], (D, 2 * H)),
    "head": _normal(k[3], (seq * H * D, C)),
  }

  def logits(p, b):
    n, s, _ = b["x"].shape
    q = (b["x"] @ p["wq"]).reshape(n, s, H, 2)
    kk = (b["x"] @ p["wk"]).reshape(n, s, H, 2)
    bias = jnp.take(p["rel"], _t5_buckets(s), axis=0)  # [q, k, heads]
    scores = jnp.einsum("nqhd,nkhd->nhqk", q, kk) + jnp.transpose(bias, (2, 0, 1))[None]
    out = jnp.einsum("nhqk,nkd->nqhd", jax.nn.softmax(scores, axis=-1), b["x"])
    return out.reshape(n, -1) @ p["head"]

  batch = {"x": _normal(k[4], (N, seq, D)), "y": jnp.arange(N) % C}
  return logits, params, batch


@pytest.mark.parametrize("approx", ["diagonal", "full"])
def test_t5_relative_bias_is_a_shift_table_exact_in_float64(x64, approx):
  """The bias table read at buckets computed from positions alone is a shift-only layer
  whose per-example gradient for a bucket sums the logits' gradient over every (q, k) in that
  bucket: "diagonal" (the default, with its note) is the exact diagonal and "full" the exact
  Fisher block."""
  logits, params, batch = _t5_model()
  buckets = np.asarray(jax.jit(_t5_buckets, static_argnums=0)(L))  # Eagerly, an op a program.
  assert len(np.unique(buckets)) < buckets.size  # Repeats: positions share buckets.
  loss_fn = lambda p, b: _ce(logits(p, b), b["y"])
  layers = kfac_jax.LayerConfig(overrides={"rel": "full"}) if approx == "full" else None
  reg = kfac_jax.Registration(loss_fn, params, batch, strict=True, layers=layers, check_loss=False)
  spec = _spec(reg.layers, "rel")
  assert (spec.kind, spec.approx, spec.param_paths) == ("scale_and_shift", approx, ("rel",))
  assert spec.info.feature_shape == (H, L, L)
  if approx == "diagonal":
    assert "gathered at constant positions with repeats" in spec.note
    assert spec.note in kfac_jax.summary(registration=reg)
  _, dense = _estimate(loss_fn, params, batch, layers=layers)
  exact = _exact_empirical(_per_example(logits), params, batch)
  r = _indices(params, "rel")
  want = exact[np.ix_(r, r)]
  want = want if approx == "full" else np.diag(np.diag(want))
  np.testing.assert_allclose(dense[np.ix_(r, r)], want, rtol=1e-10, atol=1e-13)
  assert np.abs(want).max() > 1e-4


def _gpt2_model(positions, n_positions=L):
  """GPT-2's embeddings as Hugging Face's Flax model writes them: `wte(ids) + wpe(pos)` with
  `pos = broadcast_to(arange(seq)[None], ids.shape)` built inside the model, or passed in
  with the batch; `wpe` may have more rows than the sequence has positions."""
  k = _seeds(4)
  vocab = 7
  params = {
    "wte": _normal(k[0], (vocab, D)),
    "wpe": _normal(k[1], (n_positions, D)),
    "head": _normal(k[2], (D, C)),
  }
  ids = _models.integers(k[3], 0, vocab, (N, L))
  batch = {"ids": ids, "y": jnp.arange(N) % C}
  if positions == "batch":
    batch["pos"] = jnp.broadcast_to(jnp.arange(L)[None], ids.shape)

  def logits(p, b):
    pos = b["pos"] if positions == "batch" else jnp.broadcast_to(jnp.arange(L)[None], (N, L))
    h = jnp.take(p["wte"], b["ids"], axis=0) + jnp.take(p["wpe"], pos, axis=0)
    return jnp.tanh(h).mean(1) @ p["head"]

  return logits, params, batch


@pytest.mark.parametrize("n_positions", [L, L + 3])
def test_gpt2_positions_built_inside_are_a_positional_table(x64, n_positions):
  """`wpe` read at `arange(seq)` positions built inside the model is the positional table of
  a linen `x + pos`: a shift-only layer, "diagonal" by default, the exact diagonal (a table
  longer than the sequence: its unread rows have zero curvature)."""
  logits, params, batch = _gpt2_model("inside", n_positions)
  loss_fn = lambda p, b: _ce(logits(p, b), b["y"])
  spec = _spec(
    kfac_jax.Registration(loss_fn, params, batch, strict=True, check_loss=False).layers, "wpe"
  )
  assert (spec.kind, spec.approx) == ("scale_and_shift", "diagonal")
  assert "positional embedding" in spec.note
  _, dense = _estimate(loss_fn, params, batch)
  exact = _exact_empirical(_per_example(logits), params, batch)
  w = _indices(params, "wpe")
  np.testing.assert_allclose(
    dense[np.ix_(w, w)], np.diag(np.diag(exact[np.ix_(w, w)])), rtol=1e-10, atol=1e-13
  )
  assert np.diag(exact[np.ix_(w, w)])[: L * D].min() > 0


def test_gpt2_positions_passed_with_the_batch_are_an_embedding(x64):
  """Position ids that come in with the batch could be any ids: `wpe` is an embedding layer,
  read at each example's ids (docs/layers.rst)."""
  logits, params, batch = _gpt2_model("batch")
  loss_fn = lambda p, b: _ce(logits(p, b), b["y"])
  spec = _spec(
    kfac_jax.Registration(loss_fn, params, batch, strict=True, check_loss=False).layers, "wpe"
  )
  assert (spec.kind, spec.approx) == ("embedding", "kron")


# -- notes of shift-only tables ------------------------------------------------------------------


@pytest.mark.parametrize(
  "case,label",
  [
    ("positional", "positional embedding or learned tokens"),
    ("bias", "a bias over several axes"),
  ],
)
def test_summary_names_what_a_shift_table_is(case, label):
  """A table with an entry per position and feature (`x + pos`, pos `[L, H, 2]`) is labelled
  a positional table; a bias of several axes added at every position (`[H, 2]` over
  `[N, L, H, 2]`, e.g. a `DenseGeneral` bias after a nonlinearity) is labelled a bias."""
  k = _seeds(3)
  shape = (L, H, 2) if case == "positional" else (H, 2)
  params = {"t": _normal(k[0], shape, jnp.float32), "head": _normal(k[1], (2 * H, C), jnp.float32)}
  batch = {"x": _normal(k[2], (N, L, H, 2), jnp.float32), "y": jnp.arange(N) % C}

  def loss_fn(p, b):
    h = jnp.tanh(b["x"]) + p["t"]
    return _ce(jnp.tanh(h).mean(1).reshape(N, -1) @ p["head"], b["y"])

  reg = kfac_jax.Registration(loss_fn, params, batch, strict=True, check_loss=False)
  spec = _spec(reg.layers, "t")
  assert (spec.kind, spec.approx) == ("scale_and_shift", "diagonal")
  assert label in spec.note
  other = "a bias over several axes" if case == "positional" else "positional"
  assert other not in spec.note
  assert spec.note in kfac_jax.summary(registration=reg)
