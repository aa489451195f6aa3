"""Shared (multi-use) parameters: tied embeddings, repeated dense layers, RNNs through lax.scan."""

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.flatten_util import ravel_pytree

import kfac_jax
from kfac_jax import _curvature
from kfac_jax.blocks import _shared, _uses
from kfac_jax.scan import _scanner
from tests import _models

V, D, N, L = 7, 4, 3, 3


def _f64_config(**kwargs):
  return kfac_jax.blocks.BlockConfig(stats_dtype=jnp.float64, inverse_dtype=jnp.float64, **kwargs)


def _ce(logits, y):
  kfac_jax.register_softmax_cross_entropy_loss(logits, y)
  return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def _seq_batch(key=0):
  return {
    "ids": _models.integers(2 * key, 0, V, (N, L)),
    "y": _models.integers(2 * key + 1, 0, V, (N, L)),
  }


def _by_name(layers):
  return {l.name: l for l in layers}


def _descent_step(loss_fn, params, batch, registration):
  """One kfac step (statistics from the strict `registration`), init to new loss as one
  program; returns <grad, update> and the losses before and after."""
  tx = kfac_jax.kfac(loss_fn, batch, learning_rate=0.05, damping=1e-1, inverse_every=1)

  @jax.jit
  def step(params, rng):
    loss, grads, stats = kfac_jax.value_and_grad(registration=registration)(params, batch, rng)
    updates, _ = tx.update(grads, tx.init(params), params, curvature_stats=stats)
    inner = sum(
      jnp.vdot(g, u)
      for g, u in zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(updates))
    )
    return inner, loss, loss_fn(optax.apply_updates(params, updates), batch)

  return tuple(float(v) for v in step(params, jax.random.key(3)))


def _stats(loss_fn, params, batch):
  """The scan and the tagged statistics of one empirical pass, as one program."""
  scan = _scanner.scan(loss_fn, params, batch)

  @jax.jit
  def run(p, b):
    return _curvature.compute(
      scan, p, b, None, estimation_mode="empirical", num_samples=1, with_grads=False
    )[2]

  return scan, run(params, batch)


# -- models ----------------------------------------------------------------------------------


class _LinenTiedLM(nn.Module):
  @nn.compact
  def __call__(self, ids):
    emb = nn.Embed(V, D)
    h = nn.LayerNorm()(emb(ids))
    h = nn.Dense(D)(h)
    return emb.attend(h)


class _LinenLSTM(nn.Module):
  @nn.compact
  def __call__(self, ids):
    h = nn.Embed(V, D)(ids)
    h = nn.RNN(nn.LSTMCell(3))(h)
    return nn.Dense(V)(h)


class _NnxTiedLM(nnx.Module):
  def __init__(self, rngs):
    self.emb = nnx.Embed(V, D, rngs=rngs)
    self.ln = nnx.LayerNorm(D, rngs=rngs)
    self.dense = nnx.Linear(D, D, rngs=rngs)

  def __call__(self, ids):
    return self.emb.attend(self.dense(self.ln(self.emb(ids))))


class _NnxGRU(nnx.Module):
  def __init__(self, rngs):
    self.emb = nnx.Embed(V, D, rngs=rngs)
    self.rnn = nnx.RNN(nnx.GRUCell(D, 3, rngs=rngs))
    self.out = nnx.Linear(3, V, rngs=rngs)

  def __call__(self, ids):
    return self.out(self.rnn(self.emb(ids)))


def _linen(model_cls):
  model = model_cls()
  batch = _seq_batch()
  params = jax.jit(model.init)(jax.random.key(1), batch["ids"])  # Eager ops compile one by one.
  return (lambda p, b: _ce(model.apply(p, b["ids"]), b["y"])), params, batch


def _nnx(model_cls):
  graphdef, params, rest = nnx.split(model_cls(nnx.Rngs(0)), nnx.Param, ...)
  params = nnx.to_pure_dict(params)

  def loss_fn(p, b):
    return _ce(nnx.merge(graphdef, p, rest, copy=True)(b["ids"]), b["y"])

  return loss_fn, params, _seq_batch()


TIED = {
  "linen": (lambda: _linen(_LinenTiedLM), "params/Embed_0"),
  "nnx": (lambda: _nnx(_NnxTiedLM), "emb"),
}
RNNS = {
  "linen_lstm": (lambda: _linen(_LinenLSTM), "params/LSTMCell_0/hi", 8),
  "nnx_gru": (lambda: _nnx(_NnxGRU), "rnn/cell/dense_h", 2),
}


@pytest.mark.parametrize("flavour", sorted(TIED))
def test_tied_embedding_lm_is_one_two_use_layer_and_a_step_descends(flavour):
  make, emb_name = TIED[flavour]
  loss_fn, params, batch = make()
  # check_loss=False: the audit is tested in tests/test_audit.py; here it only compiles a program.
  registration = kfac_jax.Registration(loss_fn, params, batch, strict=True, check_loss=False)
  layers = _by_name(registration.layers)
  emb = layers[emb_name]
  assert (emb.kind, emb.num_uses, emb.approx) == ("embedding", 2, "kron_indep")
  assert emb.factor_shapes == ((V,), (D, D))  # The vocabulary side stays diagonal.
  assert all(l.num_uses == 1 for n, l in layers.items() if n != emb_name)
  table = kfac_jax.summary(registration=registration)
  line = next(r for r in table.splitlines() if r.startswith(emb_name + " "))
  assert line.split()[1:4] == ["embedding", "2", "kron_indep"]
  inner, loss, new_loss = _descent_step(loss_fn, params, batch, registration)
  assert inner < 0 and new_loss < loss


@pytest.mark.parametrize("flavour", sorted(RNNS))
def test_rnn_through_scan_is_found_with_uses_per_step_and_a_step_descends(flavour):
  make, cell_name, expected_layers = RNNS[flavour]
  loss_fn, params, batch = make()
  registration = kfac_jax.Registration(loss_fn, params, batch, strict=True, check_loss=False)
  layers = _by_name(registration.layers)
  cell = [l for n, l in layers.items() if "Cell" in n or "cell" in n]
  assert len(cell) == expected_layers
  assert all(l.kind == "dense" and l.num_uses == L and l.approx == "kron_indep" for l in cell)
  assert cell_name in layers
  table = kfac_jax.summary(registration=registration)
  line = next(r for r in table.splitlines() if r.startswith(cell_name + " "))
  assert line.split()[1:4] == ["dense", str(L), "kron_indep"]
  inner, loss, new_loss = _descent_step(loss_fn, params, batch, registration)
  assert inner < 0 and new_loss < loss


def test_same_dense_applied_twice_is_one_layer_and_matches_the_definition(x64):
  """kron_indep: A = mean over uses and rows of x̄x̄ᵀ, G = Σ_uses (1/N) Σ_rows g gᵀ."""
  x = _models.normal(0, (N, D), jnp.float64)
  params = {"w": _models.normal(1, (D, D), jnp.float64, scale=0.5), "b": jnp.zeros(D)}
  batch = {"x": x, "y": _models.integers(2, 0, D, (N,))}

  def model(p, x, eps=(0.0, 0.0)):
    h1 = jnp.tanh(x @ p["w"] + p["b"] + eps[0])
    return h1, h1 @ p["w"] + p["b"] + eps[1]

  loss_fn = lambda p, b: _ce(model(p, b["x"])[1], b["y"])
  (layer,) = kfac_jax.Registration(loss_fn, params, batch, strict=True, check_loss=False).layers
  assert (layer.kind, layer.num_uses, layer.param_paths) == ("dense", 2, ("w", "b"))
  scan, stats = _stats(loss_fn, params, batch)
  block = kfac_jax.blocks.make_block(layer, _f64_config())
  got = jax.jit(block.batch_factors, static_argnums=1)(stats.data[0], N)
  # Reference: inputs and per-example output gradients from jax.grad of the summed loss.
  h1 = jax.jit(model)(params, x)[0]
  per_ex = lambda e0, e1: (
    N
    * optax.softmax_cross_entropy_with_integer_labels(
      model(params, x, (e0, e1))[1], batch["y"]
    ).mean()
  )
  g0, g1 = jax.jit(jax.grad(per_ex, argnums=(0, 1)))(np.zeros((N, D)), np.zeros((N, D)))
  xb = [np.concatenate([v, np.ones((N, 1))], 1) for v in (np.asarray(x), np.asarray(h1))]
  a = sum(v.T @ v for v in xb) / (2 * N)
  g = sum(v.T @ v for v in (g0, g1)) / N
  np.testing.assert_allclose(got.a, a, rtol=1e-10, atol=1e-12)
  np.testing.assert_allclose(got.g, g, rtol=1e-10, atol=1e-12)


def _tied_autoencoder(p, x, eps=(0.0, 0.0)):
  """`y = tanh(x W + b) Wᵀ + c`; `eps` perturbs the encoder's output and the decoder product."""
  h = jnp.tanh(x @ p["w"] + p["b"] + eps[0])
  return h, h @ p["w"].T + eps[1] + p["c"]


def test_tied_autoencoder_decoder_is_a_transposed_use(x64):
  """A tied autoencoder: W is one dense layer of two uses, the decoder reading it transposed
  (its bias c a layer of its own). The decoder's gradient is `(∂ℓ/∂y) hᵀ`: its output
  gradients take the input side, its inputs the output side, A_t = (1/N) Σ [g_y, 0][g_y, 0]ᵀ
  and G_t = Σ h hᵀ / N, beside the encoder's A_n = Σ [x, 1][x, 1]ᵀ / N and G_n = (1/N) Σ g_z
  g_zᵀ; the two products are scaled to equal mean diagonals, A averaged and G summed. "full"
  blocks from the same uses are the exact empirical Fisher."""
  x = _models.normal(20, (N, D), jnp.float64)
  params = {"w": _models.normal(21, (D, 3), jnp.float64, 0.5), "b": jnp.zeros(3)}
  params["c"] = 0.1 * jnp.ones(D)
  batch = {"x": x}

  def loss_fn(p, b):
    y = _tied_autoencoder(p, b["x"])[1]
    kfac_jax.register_squared_error_loss(y, b["x"])
    return jnp.mean(jnp.sum((y - b["x"]) ** 2, -1))

  layers = kfac_jax.Registration(loss_fn, params, batch, strict=True).layers
  assert [(s.kind, s.num_uses, s.param_paths) for s in layers] == [
    ("dense", 2, ("w", "b")),
    ("scale_and_shift", 1, ("c",)),
  ]
  assert [inf.transposed for inf in layers[0].use_infos] == [False, True]
  _, stats = _stats(loss_fn, params, batch)
  got = jax.jit(
    kfac_jax.blocks.make_block(layers[0], _f64_config()).batch_factors, static_argnums=1
  )(stats.data[0], N)

  @jax.jit  # One program: run eagerly, each op compiles its own.
  def expected(params, x):
    def total(e0, e1):  # Σ_n ℓ_n: its gradient in a perturbation is each example's own.
      return jnp.sum((_tied_autoencoder(params, x, (e0, e1))[1] - x) ** 2)

    gz, gy = jax.grad(total, argnums=(0, 1))(jnp.zeros((N, 3)), jnp.zeros((N, D)))
    h = _tied_autoencoder(params, x)[0]
    xb = jnp.concatenate([x, jnp.ones((N, 1))], 1)
    yb = jnp.concatenate([gy, jnp.zeros((N, 1))], 1)
    pairs = [(xb.T @ xb / N, gz.T @ gz / N), (yb.T @ yb / N, h.T @ h / N)]
    cs = [jnp.sqrt(jnp.mean(jnp.diag(g)) / jnp.mean(jnp.diag(a))) for a, g in pairs]
    return sum(a * c for (a, _), c in zip(pairs, cs)) / 2, sum(
      g / c for (_, g), c in zip(pairs, cs)
    )

  a, g = expected(params, x)
  np.testing.assert_allclose(got.a, a, rtol=1e-12, atol=1e-15)
  np.testing.assert_allclose(got.g, g, rtol=1e-12, atol=1e-15)
  full = kfac_jax.blocks.make_block(dataclasses.replace(layers[0], approx="full"), _f64_config())
  h_rows, count = jax.jit(full.gradient_rows, static_argnums=1)(stats.data[0], N)
  per_example = jax.jit(jax.vmap(jax.grad(lambda p, xn: loss_fn(p, {"x": xn[None]}))))
  grads = per_example(
    jax.tree_util.tree_map(lambda v: jnp.broadcast_to(v, (N, *v.shape)), params), x
  )
  rows = np.concatenate([np.asarray(grads["w"]).reshape(N, -1), np.asarray(grads["b"])], 1)
  np.testing.assert_allclose(np.asarray(h_rows).T @ h_rows / count, rows.T @ rows / N, atol=1e-13)


def _single_use_dense():
  params = {"w": _models.normal(10, (D, 3), jnp.float64), "b": jnp.zeros(3)}
  batch = {"x": _models.normal(11, (N, L, D), jnp.float64), "y": _models.integers(12, 0, 3, (N, L))}
  loss_fn = lambda p, b: _ce(b["x"] @ p["w"] + p["b"], b["y"])
  (spec,) = kfac_jax.Registration(loss_fn, params, batch, strict=True, check_loss=False).layers
  scan, stats = _stats(loss_fn, params, batch)
  return spec, stats.data[0], params, batch, loss_fn


def test_kron_indep_on_a_single_use_equals_the_single_use_block(x64):
  spec, data, *_ = _single_use_dense()
  config = _f64_config()
  single = kfac_jax.blocks.make_block(spec, config).batch_factors(data, N)
  one_use = dataclasses.replace(spec, approx="kron_indep", num_uses=1, use_infos=(spec.info,))
  indep = _uses.indep_factors(one_use, (data,), N, jnp.float64)
  np.testing.assert_allclose(indep.a, single.a, rtol=1e-12)
  np.testing.assert_allclose(indep.g, single.g, rtol=1e-12)
  # A two-use layer whose uses see the same data: A unchanged, G doubled.
  two = dataclasses.replace(one_use, num_uses=2, use_infos=(spec.info, spec.info))
  indep2 = _uses.indep_factors(two, (data, data), N, jnp.float64)
  np.testing.assert_allclose(indep2.a, single.a, rtol=1e-12)
  np.testing.assert_allclose(indep2.g, 2 * single.g, rtol=1e-12)


def test_expand_and_reduce_match_their_definitions(x64):
  spec, data, params, batch, _ = _single_use_dense()
  config = _f64_config()
  expand = kfac_jax.blocks.make_block(dataclasses.replace(spec, approx="expand"), config)
  reduce = kfac_jax.blocks.make_block(dataclasses.replace(spec, approx="reduce"), config)

  @jax.jit  # One program for the factors and their definitions: eager ops compile one by one.
  def factors_and_definitions(data, params, batch):
    x = batch["x"]
    logits = x @ params["w"] + params["b"]
    # g[n, l] = ∂(per-example loss of n)/∂s[n, l], per-example loss = Σ_l CE (the tag convention).
    g = jax.grad(lambda s: optax.softmax_cross_entropy_with_integer_labels(s, batch["y"]).sum())(
      logits
    )
    xb = jnp.concatenate([x, jnp.ones((N, L, 1))], -1)
    # Expand: the N·L positions are rows; A averaged over them, G summed per example.
    expand_def = (jnp.einsum("nli,nlj->ij", xb, xb) / (N * L), jnp.einsum("nli,nlj->ij", g, g) / N)
    # Reduce: x̄ averaged over positions, g summed, then one row per example.
    xm, gs = xb.mean(1), g.sum(1)
    reduce_def = (xm.T @ xm / N, gs.T @ gs / N)
    fe, fr = expand.batch_factors(data, N), reduce.batch_factors(data, N)
    return fe, fr, expand_def, reduce_def

  fe, fr, expand_def, reduce_def = factors_and_definitions(data, params, batch)
  np.testing.assert_allclose(fe.a, expand_def[0], rtol=1e-10)
  np.testing.assert_allclose(fe.g, expand_def[1], rtol=1e-10)
  np.testing.assert_allclose(fr.a, reduce_def[0], rtol=1e-10)
  np.testing.assert_allclose(fr.g, reduce_def[1], rtol=1e-10)
  assert not np.allclose(fe.g, fr.g)


# -- series approximations -----------------------------------------------------------------


def _scan_spec(bias: bool):
  """A dense kernel used at every step of a plain lax.scan (no recurrence through W)."""
  params = {"w": jnp.ones((4, 3))} | ({"b": jnp.zeros(3)} if bias else {})
  batch = {"x": jnp.ones((L, N, 4)), "y": jnp.zeros((L, N), jnp.int32)}

  def loss_fn(p, b):
    def step(c, x):
      y = x @ p["w"] + (p["b"] if bias else 0.0)
      return c, y

    _, ys = jax.lax.scan(step, 0.0, b["x"])
    return _ce(ys.transpose(1, 0, 2), b["y"].T)

  (spec,) = kfac_jax.Registration(loss_fn, params, batch, strict=True, check_loss=False).layers
  assert spec.num_uses == L and spec.approx == "kron_indep"
  return spec


@functools.partial(jax.jit, static_argnums=(0, 1))
def _series_data(key, correlated: bool):
  kx, kg = jax.random.split(jax.random.key(key))
  x = jax.random.normal(kx, (L, N * 2, 4))
  if not correlated:
    # Rows come in pairs (x_t, s_t x_t) with s_t = (-1)^t, so Σ_r x_{t,r} x_{t+1,r}ᵀ = 0.
    sign = jnp.where(jnp.arange(L) % 2 == 0, 1.0, -1.0)[:, None, None]
    x = jnp.concatenate([x, sign * x], axis=1)
  else:
    x = jnp.concatenate([x, x], axis=1)
    x = x.at[1:].set(0.7 * x[:-1] + 0.3 * x[1:])
  g = jax.random.normal(kg, (L, 2, N * 4, 3))
  return tuple(((x[t],), g[t]) for t in range(L))


@pytest.mark.parametrize("approx", ["kron_series_1", "kron_series_2"])
def test_series_reduce_to_kron_indep_for_uncorrelated_uses(x64, approx):
  base = dataclasses.replace(
    _scan_spec(bias=False),
    use_infos=(
      dataclasses.replace(_scan_spec(False).info, rows=N * 4, x_perm=(0, 1), out_perm=(0, 1)),
    )
    * L,
  )
  config = _f64_config(cholesky=True, cholesky_inverse=True)
  indep = kfac_jax.blocks.make_block(base, config)
  series = kfac_jax.blocks.make_block(dataclasses.replace(base, approx=approx), config)
  assert isinstance(series, kfac_jax.blocks.SeriesKroneckerBlock)
  v = [np.random.default_rng(9).standard_normal((4, 3))]

  @jax.jit
  def products(data, v):  # Everything the checks read, as one program.
    fi, fs = indep.batch_factors(data, N), series.batch_factors(data, N)
    ci, cs = indep.compute_cache(fi, 1e-2), series.compute_cache(fs, 1e-2)
    inv_i = indep.multiply_matpower(fi, ci, v, -1)[0]
    inv_s = series.multiply_matpower(fs, cs, v, -1)[0]
    fwd_s = series.multiply_matpower(fs, cs, series.multiply_matpower(fs, cs, v, -1), 1)[0]
    c = series.multiply_cholesky(
      fs,
      cs,
      series.multiply_cholesky(fs, cs, v, transpose=True, inverse=False),
      transpose=False,
      inverse=False,
    )[0]
    ci_ = series.multiply_cholesky(
      fs,
      cs,
      series.multiply_cholesky(fs, cs, v, transpose=False, inverse=True),
      transpose=True,
      inverse=True,
    )[0]
    fwd = series.multiply_matpower(fs, cs, v, 1)[0]
    return fi, fs, inv_i, inv_s, fwd_s, c, fwd, ci_

  for correlated in (False, True):
    fi, fs, inv_i, inv_s, fwd_s, c, fwd, ci_ = products(_series_data(0, correlated), v)
    np.testing.assert_allclose(fs.a, fi.a, rtol=1e-12)
    np.testing.assert_allclose(fs.g, fi.g, rtol=1e-12)
    np.testing.assert_allclose(fwd_s, v[0], rtol=1e-8, atol=1e-10)  # F_λ F_λ⁻¹ = I.
    # C Cᵀ = F_λ and C⁻ᵀ C⁻¹ = F_λ⁻¹.
    np.testing.assert_allclose(c, fwd, rtol=1e-8)
    np.testing.assert_allclose(ci_, inv_s, rtol=1e-8)
    if correlated:
      assert float(jnp.max(jnp.abs(fs.a1))) > 0.1
      assert not np.allclose(inv_s, inv_i, rtol=1e-3)
    else:
      np.testing.assert_allclose(fs.a1, 0.0, atol=1e-12)
      np.testing.assert_allclose(inv_s, inv_i, rtol=1e-8, atol=1e-10)


def test_series_zeta_is_the_lag_sum():
  for t in (1, 2, 5):
    for psi in (-0.5, 0.0, 0.3, 0.9):
      lag_sum = sum((t - abs(d)) * psi ** abs(d) for d in range(-t + 1, t)) / t
      np.testing.assert_allclose(
        _shared._zeta(jnp.float32(psi), "kron_series_2", t), lag_sum, rtol=1e-5
      )
  np.testing.assert_allclose(_shared._zeta(jnp.float32(0.5), "kron_series_1", 3), 3.0, rtol=1e-6)


# -- manual tags and bad input --------------------------------------------------------------


def _two_use_loss(tags: int, approx=None):
  def loss_fn(p, b):
    h = b["x"] @ p["w"]
    if tags >= 1:
      h = kfac_jax.register_dense(h, b["x"], p["w"], approx=approx)
    y = jnp.tanh(h) @ p["w"]
    if tags >= 2:
      y = kfac_jax.register_dense(y, jnp.tanh(h), p["w"], approx=approx)
    return _ce(y, b["y"])

  params = {"w": jnp.eye(D)}
  batch = {"x": jnp.ones((N, D)), "y": jnp.zeros((N,), jnp.int32)}
  return loss_fn, params, batch


def test_manual_tag_at_each_use_gives_one_multi_use_layer():
  loss_fn, params, batch = _two_use_loss(2, approx="kron_series_1")
  (layer,) = kfac_jax.Registration(loss_fn, params, batch, strict=True, check_loss=False).layers
  assert (layer.num_uses, layer.approx, layer.source) == (2, "kron_series_1", "manual")
  # Without tags the scanner finds the same two uses by itself.
  (auto,) = kfac_jax.Registration(*_two_use_loss(0), strict=True, check_loss=False).layers
  assert (auto.num_uses, auto.approx, auto.source) == (2, "kron_indep", "auto")


def test_use_count_mismatch_names_the_parameter():
  loss_fn, params, batch = _two_use_loss(1)
  with pytest.raises(
    kfac_jax.RegistrationError, match=r"`w` is used 2 times .* registered with 1 register_dense"
  ):
    kfac_jax.Registration(loss_fn, params, batch)


def test_series_approx_on_a_single_use_layer_is_refused():
  def loss_fn(p, b):
    y = kfac_jax.register_dense(b["x"] @ p["w"], b["x"], p["w"], approx="kron_series_2")
    return _ce(y, b["y"])

  _, params, batch = _two_use_loss(0)
  with pytest.raises(kfac_jax.RegistrationError, match=r"'kron_series_2'.*\['w'\] is used once"):
    kfac_jax.Registration(loss_fn, params, batch)


def test_series_block_refuses_other_powers_and_eigen_damping():
  spec = dataclasses.replace(_scan_spec(bias=True), approx="kron_series_1")
  with pytest.raises(ValueError, match=r"only the powers -1 and 1.*exps=\(-0.5,\)"):
    kfac_jax.blocks.make_block(spec, kfac_jax.blocks.BlockConfig(exps=(-0.5,)))
  with pytest.raises(ValueError, match="needs a factored damping_mode"):
    kfac_jax.blocks.make_block(spec, kfac_jax.blocks.BlockConfig(damping_mode="eigen"))


@pytest.mark.parametrize("approx", ["kron_series_1", "kron_series_2"])
def test_rnn_with_series_tags_inside_the_scan_body_takes_a_descent_step(approx):
  """register_dense inside a plain lax.scan body: one tag per unrolled step, one layer."""
  params = {
    "w_in": _models.normal(40, (D, 3), scale=0.5),
    "w_h": _models.normal(41, (3, 3), scale=0.5),
    "b": jnp.zeros(3),
    "w_out": _models.normal(42, (3, V)),
  }
  batch = {"x": _models.normal(43, (N, L, D)), "y": _models.integers(44, 0, V, (N, L))}

  def loss_fn(p, b):
    def step(h, x):
      pre_h = kfac_jax.register_dense(h @ p["w_h"] + p["b"], h, p["w_h"], p["b"], approx=approx)
      h = jnp.tanh(x @ p["w_in"] + pre_h)
      return h, h

    _, hs = jax.lax.scan(step, jnp.zeros((N, 3)), b["x"].transpose(1, 0, 2))
    return _ce(hs.transpose(1, 0, 2) @ p["w_out"], b["y"])

  registration = kfac_jax.Registration(loss_fn, params, batch, strict=True, check_loss=False)
  layers = {l.param_paths: l for l in registration.layers}
  rec = layers[("w_h", "b")]
  assert (rec.num_uses, rec.approx, rec.source) == (L, approx, "manual")
  assert layers[("w_in",)].num_uses == L and layers[("w_in",)].approx == "kron_indep"
  inner, loss, new_loss = _descent_step(loss_fn, params, batch, registration)
  assert inner < 0 and new_loss < loss


def test_series_approx_on_uses_with_different_rows_is_refused():
  def loss_fn(p, b):
    h = kfac_jax.register_dense(b["x"] @ p["w"], b["x"], p["w"], approx="kron_series_1")
    h2 = jnp.concatenate([h, h]).reshape(N, 2, D)  # The second use sees 2N rows.
    y = kfac_jax.register_dense(h2 @ p["w"], h2, p["w"], approx="kron_series_1")
    return _ce(y.sum(1), b["y"])

  _, params, batch = _two_use_loss(0)
  with pytest.raises(kfac_jax.RegistrationError, match=r"equal row counts.*rows \[3, 6\]"):
    kfac_jax.Registration(loss_fn, params, batch)


def test_tied_embedding_factors_match_the_definition(x64):
  """Lookup term X_e ⊗ Y_e plus logits term X_d ⊗ Y_d, balanced, then mean(X) and sum(Y)."""
  params = {"t": _models.normal(50, (V, D), jnp.float64)}
  batch = {"ids": _models.integers(51, 0, V, (N,)), "y": _models.integers(52, 0, V, (N,))}

  def model(p, ids, e_emb=0.0, e_out=0.0):
    h = jnp.tanh(p["t"][ids] + e_emb)
    return h, h @ p["t"].T + e_out

  loss_fn = lambda p, b: _ce(model(p, b["ids"])[1], b["y"])
  (spec,) = kfac_jax.Registration(loss_fn, params, batch, strict=True, check_loss=False).layers
  assert (spec.kind, spec.num_uses, spec.factor_shapes) == ("embedding", 2, ((V,), (D, D)))
  scan, stats = _stats(loss_fn, params, batch)
  config = _f64_config()
  got = jax.jit(kfac_jax.blocks.make_block(spec, config).batch_factors, static_argnums=1)(
    stats.data[0], N
  )

  ce = lambda e1, e2: (
    N
    * optax.softmax_cross_entropy_with_integer_labels(
      model(params, batch["ids"], e1, e2)[1], batch["y"]
    ).mean()
  )
  g_emb, g_out = jax.jit(jax.grad(ce, argnums=(0, 1)))(np.zeros((N, D)), np.zeros((N, V)))
  h = jax.jit(model)(params, batch["ids"])[0]
  terms = [
    (jnp.zeros(V).at[batch["ids"]].add(1.0) / N, g_emb.T @ g_emb / N),
    (jnp.sum(g_out**2, 0) / N, h.T @ h / N),
  ]
  xs, ys = [], []
  for x, y in terms:
    c = jnp.sqrt(jnp.trace(y) / D / jnp.mean(x))
    xs.append(c * x)
    ys.append(y / c)
  np.testing.assert_allclose(got.a, (xs[0] + xs[1]) / 2, rtol=1e-10)
  np.testing.assert_allclose(got.g, ys[0] + ys[1], rtol=1e-10)


@pytest.mark.parametrize("reverse", [False, True])
def test_unrolled_scan_computes_the_same_loss_and_gradient(x64, reverse):
  """The flat graph unrolls scans over parameters exactly, also reversed ones and scans whose
  `xs` are stacked parameters (those are a stack of L layers, one per slice)."""
  params = {
    "w": _models.normal(60, (D, D), jnp.float64, scale=0.5),
    "stack": _models.normal(61, (L, D), jnp.float64),
  }
  batch = {"x": _models.normal(62, (L, N, D), jnp.float64), "y": _models.integers(63, 0, D, (N,))}

  def loss_fn(p, b):
    def step(h, xs):
      x, s = xs
      h = jnp.tanh((h + x) @ p["w"]) * s
      return h, h.sum()

    h, ys = jax.lax.scan(step, jnp.zeros((N, D)), (b["x"], p["stack"]), reverse=reverse)
    return _ce(h + ys.sum(), b["y"])

  layers = {
    l.param_paths: l for l in kfac_jax.Registration(loss_fn, params, batch, check_loss=False).layers
  }
  assert layers[("w",)].num_uses == L
  assert layers[("stack",)].kind == "scale_and_shift" and layers[("stack",)].stack_size == L
  vg = kfac_jax.value_and_grad(
    registration=kfac_jax.Registration(
      loss_fn, params, batch, estimation_mode="empirical", check_loss=False
    )
  )
  # One program for both: eager operations would compile one by one.
  (loss, grads, _), (ref_loss, ref_grads) = jax.jit(
    lambda p, b: (vg(p, b), jax.value_and_grad(loss_fn)(p, b))
  )(params, batch)
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-12)
  for k in params:
    np.testing.assert_allclose(grads[k], ref_grads[k], rtol=1e-10, atol=1e-12)


# -- shared convolutions and scale-and-shift layers -------------------------------------------


def _conv(p, x, stride=1, padding="VALID"):
  y = jax.lax.conv_general_dilated(
    x, p["k"], (stride, stride), padding, dimension_numbers=("NHWC", "HWIO", "NHWC")
  )
  return y + p["b"]


def _shared_conv_norm_model(params, x, eps=(0.0, 0.0, 0.0, 0.0)):
  """One conv kernel (with its bias) applied twice, one norm scale and shift applied twice."""
  h1 = _conv(params, x) + eps[0]
  h2 = _conv(params, jnp.tanh(h1), padding="SAME") + eps[1]
  z = h2.mean((1, 2))
  z = z * params["s"] + params["sh"] + eps[2]
  z = jnp.tanh(z) * params["s"] + params["sh"] + eps[3]
  return (x, jnp.tanh(h1)), z @ params["w"]


def _shared_conv_setup(n):
  f = jax.dtypes.canonicalize_dtype(float)  # float64 under x64.
  params = {
    "k": _models.normal(110, (2, 2, 2, 2), f, scale=0.5),
    "b": jnp.array([0.1, -0.2]),
    "s": jax.device_put((1.0 + 0.3 * _models.np_rng(111).standard_normal(2)).astype(f)),
    "sh": jnp.array([0.2, 0.1]),
    "w": _models.normal(112, (2, 3), f),
  }
  batch = {"x": _models.normal(113, (n, 4, 4, 2), f), "y": _models.integers(114, 0, 3, (n,))}
  loss_fn = lambda p, b: _ce(_shared_conv_norm_model(p, b["x"])[1], b["y"])
  return params, batch, loss_fn


def test_shared_conv_and_norm_are_found_as_multi_use_layers():
  params, batch, loss_fn = _shared_conv_setup(2)
  registration = kfac_jax.Registration(loss_fn, params, batch, strict=True, check_loss=False)
  layers = {l.name: l for l in registration.layers}
  assert [(n, l.kind, l.num_uses, l.approx, l.param_paths) for n, l in layers.items()] == [
    ("k", "conv", 2, "kron_indep", ("k", "b")),
    ("s", "scale_and_shift", 2, "full", ("s", "sh")),
    ("w", "dense", 1, "kron", ("w",)),
  ]
  assert layers["k"].factor_shapes == ((2 * 2 * 2 + 1,) * 2, (2, 2))
  inner, loss, new_loss = _descent_step(loss_fn, params, batch, registration)
  assert inner < 0 and new_loss < loss


class _LinenSharedModules(nn.Module):
  @nn.compact
  def __call__(self, x):
    conv, ln = nn.Conv(3, (3, 3), name="conv"), nn.LayerNorm(name="ln")
    h = ln(jnp.tanh(conv(x)))
    h = ln(jnp.tanh(conv(h)))
    return nn.Dense(4, name="out")(h.mean((1, 2)))


def test_linen_conv_and_layer_norm_called_twice_are_shared_layers():
  model = _LinenSharedModules()
  batch = {"x": jnp.ones((2, 5, 5, 3)), "y": jnp.array([0, 1])}
  params = jax.jit(model.init)(jax.random.key(0), batch["x"])
  loss_fn = lambda p, b: _ce(model.apply(p, b["x"]), b["y"])
  table = kfac_jax.summary(
    registration=kfac_jax.Registration(loss_fn, params, batch, strict=True, check_loss=False)
  )
  rows = {r.split()[0]: r.split()[1:] for r in table.splitlines()[2:5]}
  assert rows["params/conv"][:4] == ["conv", "2", "kron_indep", "kernel,"]
  assert rows["params/conv"][5:7] == ["28x28", "3x3"]
  assert rows["params/ln"][:4] == ["scale_and_shift", "2", "full", "scale,"]
  assert rows["params/out"][:3] == ["dense", "1", "kron"]


def _patches(x, k, pads):
  """[N·L, C·k·k] patches of an NHWC input, (channel, window) row-major, stride 1, by loops."""
  xp = np.pad(np.asarray(x), ((0, 0), pads, pads, (0, 0)))
  rows = [
    xp[i, a : a + k, b : b + k, :].transpose(2, 0, 1).reshape(-1)
    for i in range(xp.shape[0])
    for a in range(xp.shape[1] - k + 1)
    for b in range(xp.shape[2] - k + 1)
  ]
  return np.stack(rows)


def test_shared_conv_kron_indep_matches_the_definition(x64):
  """Batch 1, empirical: A = Σ_uses Σ_rows x̄x̄ᵀ / Σ_uses rows over both uses' patches (the uses
  see different input sizes and paddings), G = Σ_uses (1/N) Σ_rows g gᵀ."""
  params, batch, loss_fn = _shared_conv_setup(1)
  spec = next(
    l
    for l in kfac_jax.Registration(loss_fn, params, batch, check_loss=False).layers
    if l.name == "k"
  )
  scan, stats = _stats(loss_fn, params, batch)
  block = kfac_jax.blocks.make_block(spec, _f64_config())
  got = jax.jit(block.batch_factors, static_argnums=1)(stats.data[scan.layers.index(spec)], 1)

  x0, x1 = jax.jit(_shared_conv_norm_model)(params, batch["x"])[0]
  patches = [_patches(x0, 2, (0, 0)), _patches(x1, 2, (0, 1))]  # VALID; SAME for an even kernel.
  xb = [np.concatenate([p, np.ones((p.shape[0], 1))], 1) for p in patches]
  a = sum(v.T @ v for v in xb) / sum(v.shape[0] for v in xb)
  zeros = [np.zeros((1, 3, 3, 2)), np.zeros((1, 3, 3, 2)), np.zeros((1, 2)), np.zeros((1, 2))]
  ce = lambda *e: optax.softmax_cross_entropy_with_integer_labels(
    _shared_conv_norm_model(params, batch["x"], e)[1], batch["y"]
  ).sum()
  gs = jax.jit(jax.grad(ce, argnums=(0, 1)))(*zeros)
  g = sum(np.asarray(v).reshape(-1, 2).T @ np.asarray(v).reshape(-1, 2) for v in gs)
  assert xb[0].shape[0] == 9 and xb[1].shape[0] == 9
  np.testing.assert_allclose(got.a, a, rtol=1e-10, atol=1e-12)
  np.testing.assert_allclose(got.g, g, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("approx", ["full", "diagonal"])
def test_shared_conv_and_norm_full_blocks_equal_the_exact_empirical_fisher(x64, approx):
  """ "full" / "diagonal" of a shared layer: the per-example gradient summed over uses, so the
  block is the exact per-example (empirical) Fisher block for any batch size."""
  params, batch, loss_fn = _shared_conv_setup(3)
  layers = kfac_jax.LayerConfig(overrides={"k": approx, "s": approx})
  est = kfac_jax.CurvatureEstimator(
    kfac_jax.Registration(
      loss_fn, params, batch, estimation_mode="empirical", layers=layers, check_loss=False
    )
  )
  assert [(l.name, l.num_uses, l.approx) for l in est.layers] == [
    ("k", 2, approx),
    ("s", 2, approx),
    ("w", 1, "kron"),
  ]
  dense = np.asarray(
    jax.jit(
      lambda p, b: est.to_dense(est.update_curvature(est.init(p), p, b, None, ema_decay=0.0))
    )(params, batch)
  )
  flat, unravel = ravel_pytree(params)
  per_example = lambda f: optax.softmax_cross_entropy_with_integer_labels(
    _shared_conv_norm_model(unravel(f), batch["x"])[1], batch["y"]
  )
  jac = np.asarray(_models.jit_jacobian(per_example)(flat))
  exact = jac.T @ jac / 3
  sizes = [v.size for v in jax.tree_util.tree_leaves(params)]  # b, k, s, sh, w
  off = np.concatenate([[0], np.cumsum(sizes)])
  for leaves in ((0, 1), (2, 3)):
    idx = np.concatenate([np.arange(off[j], off[j + 1]) for j in leaves])
    want = exact[np.ix_(idx, idx)]
    if approx == "diagonal":
      want = np.diag(np.diag(want))
    np.testing.assert_allclose(dense[np.ix_(idx, idx)], want, rtol=1e-10, atol=1e-13)
    assert np.abs(want).max() > 1e-3


def test_grouped_conv_kron_indep_keeps_one_factor_pair_per_group(x64):
  """Two uses seeing the same data: A per group unchanged, G per group doubled."""
  params = {"k": _models.normal(12, (3, 3, 2, 4), jnp.float64)}
  batch = {"x": _models.normal(13, (2, 5, 5, 4), jnp.float64), "y": jnp.array([0, 3])}

  def loss_fn(p, b):
    h = jax.lax.conv_general_dilated(
      b["x"],
      p["k"],
      (1, 1),
      "SAME",
      feature_group_count=2,
      dimension_numbers=("NHWC", "HWIO", "NHWC"),
    )
    return _ce(h.mean((1, 2)), b["y"])

  (spec,) = kfac_jax.Registration(loss_fn, params, batch, strict=True, check_loss=False).layers
  scan, stats = _stats(loss_fn, params, batch)
  config = _f64_config()
  two = dataclasses.replace(spec, approx="kron_indep", num_uses=2, use_infos=(spec.info,) * 2)
  single, got = jax.jit(
    lambda d: (
      kfac_jax.blocks.make_block(spec, config).batch_factors(d, 2),
      kfac_jax.blocks.make_block(two, config).batch_factors((d,) * 2, 2),
    )
  )(stats.data[0])
  assert got.a.shape == (2, 18, 18) and got.g.shape == (2, 2, 2)
  np.testing.assert_allclose(got.a, single.a, rtol=1e-12)
  np.testing.assert_allclose(got.g, 2 * single.g, rtol=1e-12)


def test_shared_shift_alone_and_shared_dense_bias_are_told_apart():
  """A shift added twice is a two-use scale_and_shift layer; a bias shared by one kernel's two
  uses stays with the kernel (kernels are matched before shifts)."""
  params = {"w": jnp.eye(D), "b": jnp.zeros(D), "t": jnp.ones(D)}
  batch = {"x": jnp.ones((N, D)), "y": jnp.zeros((N,), jnp.int32)}

  def loss_fn(p, b):
    h = jnp.tanh(b["x"] + p["t"])
    h = jnp.tanh(h @ p["w"] + p["b"]) + p["t"]
    return _ce(h @ p["w"] + p["b"], b["y"])

  layers = _by_name(
    kfac_jax.Registration(loss_fn, params, batch, strict=True, check_loss=False).layers
  )
  assert [(n, l.kind, l.num_uses, l.param_paths) for n, l in layers.items()] == [
    ("w", "dense", 2, ("w", "b")),
    ("t", "scale_and_shift", 2, ("t",)),
  ]


def test_shared_conv_with_different_kernel_layouts_is_not_one_layer():
  """The same leaf read as an HWIO kernel by one conv and as an OIHW kernel by the other is not
  one matrix: it stays uncovered (a diagonal fallback with a warning)."""
  params = {"k": jnp.ones((2, 2, 2, 2))}
  batch = {"x": jnp.ones((1, 3, 3, 2)), "y": jnp.zeros((1,), jnp.int32)}

  def loss_fn(p, b):
    h = jax.lax.conv_general_dilated(
      b["x"], p["k"], (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
    )
    h = jax.lax.conv_general_dilated(
      h, p["k"], (1, 1), "SAME", dimension_numbers=("NHWC", "OIHW", "NHWC")
    )
    return _ce(h.mean((1, 2)), b["y"])

  with pytest.warns(_scanner.UncoveredParametersWarning, match="`k`"):
    (layer,) = kfac_jax.Registration(loss_fn, params, batch).layers
  assert layer.source == "fallback"


# -- LayerConfig overrides on shared layers ----------------------------------------------------


def test_override_chooses_a_series_approximation_for_a_detected_recurrence():
  loss_fn, params, batch = _linen(_LinenLSTM)
  cell = "params/LSTMCell_0/hi"
  layers = kfac_jax.LayerConfig(
    defaults={"dense": "kron_in_diag"}, overrides={"params/LSTMCell_0/h*": "kron_series_2"}
  )
  specs = _by_name(
    kfac_jax.Registration(
      loss_fn, params, batch, strict=True, layers=layers, check_loss=False
    ).layers
  )
  assert (specs[cell].num_uses, specs[cell].approx, specs[cell].source) == (
    L,
    "kron_series_2",
    "auto",
  )
  # Defaults name single-use approximations: shared layers keep theirs, single-use ones follow.
  assert specs["params/LSTMCell_0/ii"].approx == "kron_indep"
  assert specs["params/Dense_0"].approx == "kron_in_diag"
  est = kfac_jax.CurvatureEstimator(
    kfac_jax.Registration(loss_fn, params, batch, layers=layers, check_loss=False)
  )
  est.init(params)
  assert isinstance(
    est.blocks[[l.name for l in est.layers].index(cell)], kfac_jax.blocks.SeriesKroneckerBlock
  )


def test_override_that_does_not_fit_a_shared_layer_names_pattern_and_layer():
  loss_fn, params, batch = _linen(_LinenLSTM)
  layers = kfac_jax.LayerConfig(overrides={"params/LSTMCell_0/hi*": "kron_in_diag"})
  with pytest.raises(
    kfac_jax.RegistrationError,
    match=r"overrides\['params/LSTMCell_0/hi\*'\] = 'kron_in_diag' does not fit "
    r"the dense layer `params/LSTMCell_0/hi` .* used 3 times",
  ):
    kfac_jax.Registration(loss_fn, params, batch, layers=layers)
