"""kron_*_diag approximations, LayerConfig (defaults, patterns, links), check_registration."""

# `check_loss=False` where the test is about the layers and blocks: the loss audit is tested in
# tests/test_audit.py and the zoo; here it would only compile another program. `kfac(...)`
# keeps it (its defaults read the audit's loss factor).

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import scipy.linalg
from jax.flatten_util import ravel_pytree

import kfac_jax
from tests import _models

_VARIANTS = ("kron_in_diag", "kron_out_diag", "kron_both_diag")


def _setup(n=6):
  dtype = jnp.float64 if jax.config.jax_enable_x64 else jnp.float32
  params = _models.jnp_mlp_init(0, (3, 4, 3), dtype)
  batch = _models.classification_batch(1, n=n, din=3, classes=3, dtype=dtype)
  return params, batch, _models.softmax_loss(_models.jnp_mlp_apply)


def _estimator(loss_fn, batch, params, layers, damping_mode="factored", **kw):
  reg = kfac_jax.Registration(
    loss_fn, params, batch, estimation_mode="empirical", layers=layers, check_loss=False
  )
  est = kfac_jax.CurvatureEstimator(reg, config=kfac_jax.Config(damping_mode=damping_mode), **kw)
  state = jax.jit(lambda p, b: est.update_curvature(est.init(p), p, b, None, 0.0))(params, batch)
  return est, state


def _basis_matrix(fn, params):
  """The matrix of the linear map `fn` on params-shaped trees, `fn` compiled once."""
  flat, unravel = ravel_pytree(params)
  column = jax.jit(lambda e: ravel_pytree(fn(unravel(e)))[0])
  return np.stack([column(e) for e in np.eye(flat.size)], axis=1)


def _param_order(m, n_in, n_out):
  """A block over M = [W; b] (row-major vec) reordered to the params' leaf order (b, then w)."""
  perm = np.concatenate([n_in * n_out + np.arange(n_out), np.arange(n_in * n_out)])
  return m[np.ix_(perm, perm)]


def _diag_variant(approx, a, g):
  a = np.diag(np.diag(a)) if approx in ("kron_in_diag", "kron_both_diag") else a
  g = np.diag(np.diag(g)) if approx in ("kron_out_diag", "kron_both_diag") else g
  return a, g


@pytest.mark.parametrize("approx", _VARIANTS)
def test_diag_variants_match_their_definition(x64, approx):
  params, batch, loss_fn = _setup()
  _, ref = _estimator(loss_fn, batch, params, None)
  lam = 0.2
  layers = kfac_jax.LayerConfig(defaults={"dense": approx})
  for mode in ("factored", "eigen"):
    est, state = _estimator(
      loss_fn,
      batch,
      params,
      layers,
      damping_mode=mode,
      exps=(-1, -0.5),
      compute_cholesky=mode == "factored",
      compute_cholesky_inverse=mode == "factored",
    )
    assert [b.spec.approx for b in est.blocks] == [approx, approx]
    assert type(est.blocks[0]) is kfac_jax.blocks.KroneckerBlock
    state, dense = jax.jit(lambda s: (est.update_inverses(s, lam), est.to_dense(s)))(state)
    blocks, damped_blocks = [], []
    for name in ("layer0", "layer1"):
      a, g = _diag_variant(approx, *(np.asarray(f) for f in ref.factors[name]))
      # The stored factors are the diagonals (vectors) or the full matrices of the "kron" block.
      for key, full in (("a", a), ("g", g)):
        got = np.asarray(getattr(state.factors[name], key))
        np.testing.assert_allclose(got, np.diag(full) if got.ndim == 1 else full, rtol=1e-12)
      order = lambda m: _param_order(m, len(a) - 1, len(g))  # noqa: E731
      blocks.append(order(np.kron(a, g)))
      if mode == "factored":
        pi = np.sqrt((np.trace(a) / len(a)) / (np.trace(g) / len(g)))
        damped_blocks.append(
          order(
            np.kron(a + pi * np.sqrt(lam) * np.eye(len(a)), g + np.sqrt(lam) / pi * np.eye(len(g)))
          )
        )
      else:
        damped_blocks.append(order(np.kron(a, g) + lam * np.eye(len(a) * len(g))))
    undamped = scipy.linalg.block_diag(*blocks)
    damped = scipy.linalg.block_diag(*damped_blocks)
    np.testing.assert_allclose(np.asarray(dense), undamped, rtol=1e-10, atol=1e-12)
    mult = lambda fn: _basis_matrix(lambda v: fn(state, v), params)  # noqa: E731
    np.testing.assert_allclose(mult(est.multiply), damped, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(
      mult(est.multiply_inverse), np.linalg.inv(damped), rtol=1e-8, atol=1e-10
    )
    half = mult(lambda s, v: est.multiply_matpower(s, v, -0.5))
    np.testing.assert_allclose(half @ half, np.linalg.inv(damped), rtol=1e-8, atol=1e-10)
    if mode == "factored":
      chol = mult(est.multiply_cholesky)
      np.testing.assert_allclose(chol @ chol.T, damped, rtol=1e-10, atol=1e-12)
      np.testing.assert_allclose(
        mult(lambda s, v: est.multiply_cholesky(s, v, transpose=True)), chol.T, atol=1e-12
      )
      np.testing.assert_allclose(
        mult(est.multiply_cholesky_inverse) @ chol, np.eye(len(damped)), atol=1e-8
      )


def test_diag_variant_state_is_smaller():
  params, batch, loss_fn = _setup()
  sizes = {}
  for approx in ("kron",) + _VARIANTS:
    specs = kfac_jax.Registration(
      loss_fn,
      params,
      batch,
      layers=kfac_jax.LayerConfig(defaults={"dense": approx}),
      check_loss=False,
    ).layers
    sizes[approx] = specs[0].factor_shapes
  assert sizes["kron"] == ((4, 4), (4, 4))
  assert sizes["kron_in_diag"] == ((4,), (4, 4))
  assert sizes["kron_out_diag"] == ((4, 4), (4,))
  assert sizes["kron_both_diag"] == ((4,), (4,))


def test_precedence_manual_tag_then_pattern_then_default():
  params, batch, _ = _setup()

  def loss_fn(p, b):
    h = jnp.tanh(b["x"] @ p["layer0"]["w"] + p["layer0"]["b"])
    z = kfac_jax.register_dense(
      h @ p["layer1"]["w"] + p["layer1"]["b"], h, p["layer1"]["w"], p["layer1"]["b"], approx="full"
    )
    kfac_jax.register_softmax_cross_entropy_loss(z, b["y"])
    return optax.softmax_cross_entropy_with_integer_labels(z, b["y"]).mean()

  def approxes(layers):
    return [
      s.approx
      for s in kfac_jax.Registration(loss_fn, params, batch, layers=layers, check_loss=False).layers
    ]

  assert approxes(None) == ["kron", "full"]
  assert approxes(kfac_jax.LayerConfig(defaults={"dense": "diagonal"})) == ["diagonal", "full"]
  # The first matching pattern wins; the manual tag's explicit approx wins over every pattern.
  layers = kfac_jax.LayerConfig(
    defaults={"dense": "diagonal"}, overrides={"layer0/*": "kron_out_diag", "layer*": "kron"}
  )
  assert approxes(layers) == ["kron_out_diag", "full"]
  # A pattern may name the layer itself rather than one of its parameter paths.
  assert approxes(kfac_jax.LayerConfig(overrides={"layer0": "diagonal"})) == ["diagonal", "full"]


def test_layers_accepted_by_transform_optimizer_and_summary():
  params, batch, loss_fn = _setup()
  layers = kfac_jax.LayerConfig(overrides={"layer1/*": "kron_both_diag"})
  tx = kfac_jax.kfac(
    registration=kfac_jax.Registration(loss_fn, params, batch, layers=layers), learning_rate=0.1
  )
  state = jax.jit(tx.init)(params)
  est_state = state[0].curvature
  assert est_state.factors["layer1"].a.shape == (5,)
  assert est_state.factors["layer0"].a.shape == (4, 4)
  opt = kfac_jax.Optimizer(
    registration=kfac_jax.Registration(loss_fn, params, batch, layers=layers, check_loss=False)
  )
  jax.jit(opt.init)(params)
  assert [s.approx for s in opt.estimator.layers] == ["kron", "kron_both_diag"]
  table = kfac_jax.summary(
    registration=kfac_jax.Registration(loss_fn, params, batch, layers=layers, check_loss=False)
  )
  assert "kron_both_diag" in table
  with pytest.raises(TypeError, match="kfac_jax.LayerConfig"):
    kfac_jax.scale_by_kfac(
      registration=kfac_jax.Registration(loss_fn, params, batch, layers={"dense": "kron"})
    )


def test_linked_group_is_one_generic_block(x64):
  # Generic blocks estimate F from the batch gradient (h hᵀ / N, see blocks/_generic.py): exact
  # for the empirical Fisher at batch size 1.
  params, batch, loss_fn = _setup(n=1)
  layers = kfac_jax.LayerConfig(linked={("layer0/*", "layer1/*"): "full"})
  est, state = _estimator(loss_fn, batch, params, layers)
  (spec,) = est.layers
  assert (spec.kind, spec.approx, spec.source) == ("generic", "full", "linked")
  assert spec.param_paths == ("layer0/b", "layer0/w", "layer1/b", "layer1/w")
  # One full block over every parameter: the exact empirical Fisher (1/N) Σ_n ∇ℓ_n ∇ℓ_nᵀ.
  flat, unravel = ravel_pytree(params)
  per_example = lambda f: optax.softmax_cross_entropy_with_integer_labels(  # noqa: E731
    _models.jnp_mlp_apply(unravel(f), batch["x"]), batch["y"]
  )
  jac = np.asarray(_models.jit_jacobian(per_example)(flat))
  np.testing.assert_allclose(
    np.asarray(est.to_dense(state)), jac.T @ jac / len(jac), rtol=1e-10, atol=1e-12
  )
  # A "diagonal" group over one whole layer leaves the other layer's Kronecker block alone.
  layers = kfac_jax.LayerConfig(linked={("layer1/*",): "diagonal"})
  specs = kfac_jax.Registration(loss_fn, params, batch, layers=layers, check_loss=False).layers
  assert [(s.kind, s.approx, s.factor_shapes) for s in specs] == [
    ("dense", "kron", ((4, 4), (4, 4))),
    ("generic", "diagonal", ((15,),)),
  ]


def test_bad_layer_config_errors():
  params, batch, loss_fn = _setup()
  with pytest.raises(ValueError, match=r"defaults\['embedding'\] = 'diagonal'"):
    kfac_jax.LayerConfig(defaults={"embedding": "diagonal"})
  with pytest.raises(ValueError, match="unknown layer kind 'dens'"):
    kfac_jax.LayerConfig(defaults={"dens": "kron"})
  with pytest.raises(ValueError, match="not an approximation"):
    kfac_jax.LayerConfig(overrides={"layer0/*": "kronn"})
  # A valid approximation of another kind: the error names the layer and its parameters.
  with pytest.raises(
    kfac_jax.RegistrationError, match=r"'kron_sua' does not fit the dense layer `layer0`.*layer0/w"
  ):
    kfac_jax.Registration(
      loss_fn, params, batch, layers=kfac_jax.LayerConfig(overrides={"layer0/*": "kron_sua"})
    )
  with pytest.raises(kfac_jax.RegistrationError, match="'encoder/\\*' matches no layer"):
    kfac_jax.Registration(
      loss_fn, params, batch, layers=kfac_jax.LayerConfig(overrides={"encoder/*": "kron"})
    )
  with pytest.raises(
    kfac_jax.RegistrationError,
    match=r"splits the dense layer `layer1`.*'layer1/w'.*not \['layer1/b'\]",
  ):
    kfac_jax.Registration(
      loss_fn, params, batch, layers=kfac_jax.LayerConfig(linked={("layer1/w",): "full"})
    )
  with pytest.raises(kfac_jax.RegistrationError, match="`layer0/b` is in two linked groups"):
    kfac_jax.Registration(
      loss_fn,
      params,
      batch,
      layers=kfac_jax.LayerConfig(linked={("layer0/*",): "full", ("layer0/b",): "full"}),
    )
  with pytest.raises(kfac_jax.RegistrationError, match="'nothing/\\*' of group"):
    kfac_jax.Registration(
      loss_fn, params, batch, layers=kfac_jax.LayerConfig(linked={("nothing/*",): "full"})
    )


def test_check_registration_lists_every_problem():
  params, batch, _ = _setup()
  params["extra"] = jnp.ones((3,))
  params["extra2"] = jnp.ones((3,))

  def loss_fn(p, b):
    h = jnp.tanh(b["x"] @ p["layer0"]["w"] + p["layer0"]["b"])
    z = h @ p["layer1"]["w"] + p["layer1"]["b"]
    z = kfac_jax.register_generic(p["layer1"]["b"]) + z + jnp.sin(p["extra"]) + p["extra2"] ** 2
    kfac_jax.register_generic(p["layer1"]["b"])
    kfac_jax.register_softmax_cross_entropy_loss(z, b["y"])
    return optax.softmax_cross_entropy_with_integer_labels(z, b["y"]).mean()

  with pytest.raises(kfac_jax.RegistrationCheckError) as info:
    kfac_jax.check_registration(loss_fn, params, batch)
  problems = info.value.problems
  assert len(problems) == 3, problems
  assert "`layer1/b` is registered twice" in problems[0]
  assert "`extra` is not in any layer" in problems[1]
  assert "`extra2` is not in any layer" in problems[2]
  # A `layers` pattern that matches nothing stops the registration that carries it.
  layers = kfac_jax.LayerConfig(overrides={"decoder/*": "kron"})
  p2 = {k: v for k, v in params.items() if k.startswith("layer")}
  mlp = _models.softmax_loss(_models.jnp_mlp_apply)
  with pytest.raises(kfac_jax.RegistrationError, match="'decoder/\\*' matches no layer"):
    kfac_jax.Registration(mlp, p2, batch, layers=layers)
  assert isinstance(info.value, kfac_jax.RegistrationError)
  # A clean registration returns the layers.
  specs = kfac_jax.check_registration(mlp, p2, batch)
  assert [s.name for s in specs] == ["layer0", "layer1"]


def _miscounted_tags():
  """A dense kernel applied twice but tagged once, a conv kernel applied twice but tagged once,
  and a norm scale used in two places but tagged once."""
  params = {"w": jnp.eye(3), "k": jnp.ones((2, 1, 3)), "s": jnp.ones(3), "extra": jnp.ones(3)}
  batch = {"x": jnp.ones((2, 4, 1)), "y": jnp.zeros((2,), jnp.int32)}

  def loss_fn(p, b):
    conv = lambda x: jax.lax.conv_general_dilated(
      x, p["k"], (1,), "SAME", dimension_numbers=("NWC", "WIO", "NWC")
    )
    h = kfac_jax.register_conv(
      conv(b["x"]),
      b["x"],
      p["k"],
      window_strides=(1,),
      padding=((0, 1),),
      dimension_numbers=("NWC", "WIO", "NWC"),
    )
    h = conv(h[..., :1]).mean(1)
    h = kfac_jax.register_scale_and_shift(h * p["s"], h, p["s"])
    h = kfac_jax.register_dense(h @ p["w"], h, p["w"])
    z = (jnp.tanh(h) * p["s"]) @ p["w"] + jnp.sin(p["extra"])
    kfac_jax.register_softmax_cross_entropy_loss(z, b["y"])
    return optax.softmax_cross_entropy_with_integer_labels(z, b["y"]).mean()

  return loss_fn, params, batch


def test_check_registration_lists_wrong_use_counts_with_the_other_problems():
  loss_fn, params, batch = _miscounted_tags()
  with pytest.raises(kfac_jax.RegistrationCheckError) as info:
    kfac_jax.check_registration(loss_fn, params, batch)
  problems = info.value.problems
  assert len(problems) == 4, problems
  assert "`k` is used 2 times in loss_fn but registered with 1 register_conv tag" in problems[0]
  assert (
    "`s` is used 2 times in loss_fn but registered with 1 register_scale_and_shift" in (problems[1])
  )
  assert "`w` is used 2 times in loss_fn but registered with 1 register_dense tag" in problems[2]
  assert "`extra` is not in any layer" in problems[3]
  # Without collect, the scan stops at the first one.
  with pytest.raises(kfac_jax.RegistrationError, match=r"`k` is used 2 times .* 1 register_conv"):
    kfac_jax.Registration(loss_fn, params, batch)


# -- size policy (LayerConfig.max_factor_dim) ----------------------------------------------------


def _head_model(vocab, width=16, dtype=jnp.float32):
  rng = _models.np_rng(3)
  params = {
    "emb": {"table": rng.standard_normal((50, width))},
    "body": {"kernel": 0.3 * rng.standard_normal((width, width))},
    "head": {"kernel": 0.3 * rng.standard_normal((width, vocab)), "bias": np.zeros(vocab)},
  }
  params = jax.device_put(jax.tree.map(lambda x: x.astype(dtype), params))

  def loss_fn(p, b):
    h = jnp.tanh(p["emb"]["table"][b["ids"]] @ p["body"]["kernel"])
    logits = h @ p["head"]["kernel"] + p["head"]["bias"]
    kfac_jax.register_softmax_cross_entropy_loss(logits, b["y"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, b["y"]).mean()

  batch = {"ids": _models.integers(4, 0, 50, 6), "y": _models.integers(5, 0, vocab, 6)}
  return loss_fn, params, batch


def _nbytes(tree):
  return sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(tree))


def test_vocabulary_head_state_fits_next_to_the_model():
  loss_fn, params, batch = _head_model(65_536)
  tx = kfac_jax.scale_by_kfac(loss_fn, batch, damping=1e-3)
  state = jax.eval_shape(tx.init, params)  # Shapes only: no 16 GiB allocation if it fails.
  assert _nbytes(state) < 3 * _nbytes(params), (_nbytes(state), _nbytes(params))
  specs = kfac_jax.Registration(loss_fn, params, batch, check_loss=False).layers
  head = next(s for s in specs if s.name == "head")
  assert head.approx == "kron_out_diag" and head.factor_shapes == ((17, 17), (65_536,))
  assert "65536 > max_factor_dim 16384" in head.note
  table = kfac_jax.summary(loss_fn, params, batch)
  assert head.note in table and "x the parameters'" in table
  # Without the policy the output factor is kept in 64 blocks of 1024 (the default block
  # size), and without blocks it alone is 65,536² floats.
  for block_size, want in ((1024, (64, 1024, 1024)), (None, (65_536, 65_536))):
    big = kfac_jax.Registration(
      loss_fn,
      params,
      batch,
      layers=kfac_jax.LayerConfig(max_factor_dim=None, block_size=block_size),
      check_loss=False,
    ).layers
    assert next(s for s in big if s.name == "head").factor_shapes[1] == want


def test_size_policy_equals_the_explicit_approximation(x64):
  loss_fn, params, batch = _head_model(7, width=4, dtype=jnp.float64)
  grads = jax.jit(jax.grad(loss_fn))(params, batch)
  out = {}
  for name, layers in [
    ("policy", kfac_jax.LayerConfig(max_factor_dim=6)),
    ("explicit", kfac_jax.LayerConfig(overrides={"head/*": "kron_out_diag"}, max_factor_dim=None)),
  ]:
    est = kfac_jax.CurvatureEstimator(
      kfac_jax.Registration(
        loss_fn, params, batch, estimation_mode="exact", layers=layers, check_loss=False
      )
    )

    def precondition(p, b, g, est=est):
      state = est.update_curvature(est.init(p), p, b, None, ema_decay=0.0)
      return est.multiply_inverse(est.update_inverses(state, damping=1e-2), g)

    out[name] = (est.layers, jax.jit(precondition)(params, batch, grads))
  approx = {s.name: (s.approx, s.note) for s in out["policy"][0]}
  assert approx["head"][0] == "kron_out_diag" and "output side 7" in approx["head"][1]
  assert approx["body"] == ("kron", "")  # 4 + 0 and 4: under the limit.
  for a, b in zip(
    jax.tree_util.tree_leaves(out["policy"][1]), jax.tree_util.tree_leaves(out["explicit"][1])
  ):
    np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)


def test_explicit_choices_win_over_the_size_policy():
  loss_fn, params, batch = _head_model(7, width=4)
  specs = kfac_jax.Registration(
    loss_fn,
    params,
    batch,
    layers=kfac_jax.LayerConfig(overrides={"head/*": "kron"}, max_factor_dim=6),
    check_loss=False,
  ).layers
  assert next(s for s in specs if s.name == "head").approx == "kron"
  # defaults are not per-layer choices: the policy still applies to them.
  specs = kfac_jax.Registration(
    loss_fn,
    params,
    batch,
    layers=kfac_jax.LayerConfig(defaults={"dense": "kron_in_diag"}, max_factor_dim=6),
    check_loss=False,
  ).layers
  assert next(s for s in specs if s.name == "head").approx == "kron_both_diag"

  def tagged(p, b):
    h = jnp.tanh(p["emb"]["table"][b["ids"]] @ p["body"]["kernel"])
    logits = kfac_jax.register_dense(
      h @ p["head"]["kernel"] + p["head"]["bias"],
      h,
      p["head"]["kernel"],
      p["head"]["bias"],
      approx="kron",
    )
    kfac_jax.register_softmax_cross_entropy_loss(logits, b["y"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, b["y"]).mean()

  specs = kfac_jax.Registration(
    tagged, params, batch, layers=kfac_jax.LayerConfig(max_factor_dim=6), check_loss=False
  ).layers
  assert next(s for s in specs if s.name == "head").approx == "kron"
  with pytest.raises(ValueError, match="max_factor_dim"):
    kfac_jax.LayerConfig(max_factor_dim=0)


def test_size_policy_for_conv_embedding_and_full_blocks():
  rng = _models.np_rng(5)
  params = {
    "emb": rng.standard_normal((5, 9)),
    "conv": {"kernel": rng.standard_normal((1, 1, 9, 12)), "bias": np.zeros(12)},
    "norm": {"scale": np.ones((3, 12)), "bias": np.zeros((3, 12))},
  }
  params = jax.device_put(jax.tree.map(lambda x: x.astype(np.float32), params))

  def loss_fn(p, b):
    x = p["emb"][b["ids"]][:, :, None, :]  # [N, 3, 1, 9]
    y = (
      jax.lax.conv_general_dilated(
        x, p["conv"]["kernel"], (1, 1), "VALID", dimension_numbers=("NHWC", "HWIO", "NHWC")
      )
      + p["conv"]["bias"]
    )
    y = y[:, :, 0, :]
    y = y * p["norm"]["scale"] + p["norm"]["bias"]
    logits = y.mean(axis=1)
    kfac_jax.register_softmax_cross_entropy_loss(logits, b["y"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, b["y"]).mean()

  batch = {"ids": _models.integers(6, 0, 5, (4, 3)), "y": _models.integers(7, 0, 12, 4)}
  specs = kfac_jax.Registration(
    loss_fn,
    params,
    batch,
    strict=True,
    layers=kfac_jax.LayerConfig(max_factor_dim=8),
    check_loss=False,
  ).layers
  got = {s.name: (s.kind, s.approx, s.factor_shapes) for s in specs}
  assert got["emb"] == ("embedding", "kron_out_diag", ((5,), (9,)))
  assert got["conv"] == ("conv", "kron_both_diag", ((10,), (12,)))
  assert got["norm"] == ("scale_and_shift", "diagonal", ((72,),))
  assert all("max_factor_dim 8" in s.note for s in specs)
  tx = kfac_jax.scale_by_kfac(
    registration=kfac_jax.Registration(
      loss_fn, params, batch, layers=kfac_jax.LayerConfig(max_factor_dim=8), check_loss=False
    ),
    damping=1e-3,
  )

  @jax.jit
  def step(params, rng):
    _, grads, stats = kfac_jax.value_and_grad(loss_fn)(params, batch, rng)
    return tx.update(grads, tx.init(params), params, curvature_stats=stats)[0]

  updates = step(params, jax.random.key(0))
  assert all(bool(jnp.all(jnp.isfinite(u))) for u in jax.tree_util.tree_leaves(updates))


def test_positional_table_gets_a_diagonal_block():
  params = {
    "pos": _models.normal(6, (1, 5, 4), scale=0.1),
    "head": {"kernel": _models.normal(7, (4, 3))},
  }

  def loss_fn(p, b):
    h = b["x"] + p["pos"]  # A learned positional embedding (ViT, lm1b).
    logits = jnp.tanh(h).mean(axis=1) @ p["head"]["kernel"]
    kfac_jax.register_softmax_cross_entropy_loss(logits, b["y"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, b["y"]).mean()

  batch = {"x": _models.normal(8, (2, 5, 4)), "y": jax.device_put(np.array([0, 2], np.int32))}
  specs = kfac_jax.Registration(loss_fn, params, batch, strict=True, check_loss=False).layers
  pos = next(s for s in specs if s.param_paths == ("pos",))
  assert (pos.kind, pos.approx, pos.factor_shapes) == ("scale_and_shift", "diagonal", ((20,),))
  assert "positional" in pos.note
  assert pos.note in kfac_jax.summary(loss_fn, params, batch)
  # Asked for by name, the full block is kept.
  specs = kfac_jax.Registration(
    loss_fn, params, batch, layers=kfac_jax.LayerConfig(overrides={"pos": "full"}), check_loss=False
  ).layers
  pos = next(s for s in specs if s.param_paths == ("pos",))
  assert (pos.approx, pos.factor_shapes, pos.note) == ("full", ((20, 20),), "")


def test_size_policy_for_a_shared_layer():
  """A kernel used at every step of an unrolled recurrence keeps no factor side over the limit."""
  params = {"cell": _models.normal(7, (4, 4)), "out": _models.normal(8, (4, 9))}

  def loss_fn(p, b):
    h, logits = b["x"], []
    for _ in range(3):
      h = jnp.tanh(h @ p["cell"])
      logits.append(h @ p["out"])
    logits = jnp.stack(logits, axis=1)
    kfac_jax.register_softmax_cross_entropy_loss(logits, b["y"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, b["y"]).mean()

  batch = {"x": _models.normal(9, (2, 4)), "y": jax.device_put(np.zeros((2, 3), np.int32))}
  specs = kfac_jax.Registration(
    loss_fn,
    params,
    batch,
    strict=True,
    layers=kfac_jax.LayerConfig(max_factor_dim=8),
    check_loss=False,
  ).layers
  got = {s.param_paths: (s.num_uses, s.approx, s.factor_shapes) for s in specs}
  assert got[("cell",)] == (3, "kron_indep", ((4, 4), (4, 4)))
  assert got[("out",)] == (3, "diagonal", ((36,),))
  assert "max_factor_dim 8" in next(s.note for s in specs if s.param_paths == ("out",))
  specs = kfac_jax.Registration(
    loss_fn,
    params,
    batch,
    layers=kfac_jax.LayerConfig(overrides={"out": "kron_indep"}, max_factor_dim=8),
    check_loss=False,
  ).layers
  assert next(s.approx for s in specs if s.param_paths == ("out",)) == "kron_indep"


def test_size_policy_from_a_diagonal_side_variant_with_both_sides_over_the_limit():
  """A grouped conv defaulting to "kron_out_diag" with both sides over the limit becomes
  "kron_both_diag" (it used to raise KeyError: ('kron_both_diag', 'out')): its factor shapes
  keep the group axis, so its diagonal output side is a `[groups, out]` array, not a vector."""
  params = {"conv": {"kernel": _models.normal(8, (3, 3, 2, 8))}}  # 2 groups of 2 -> 4.

  def loss_fn(p, b):
    y = jax.lax.conv_general_dilated(
      b["x"],
      p["conv"]["kernel"],
      (1, 1),
      "VALID",
      dimension_numbers=("NHWC", "HWIO", "NHWC"),
      feature_group_count=2,
    )
    logits = y.mean(axis=(1, 2))
    kfac_jax.register_softmax_cross_entropy_loss(logits, b["y"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, b["y"]).mean()

  batch = {"x": _models.normal(9, (2, 4, 4, 4)), "y": jax.device_put(np.array([0, 7], np.int32))}
  config = kfac_jax.LayerConfig(defaults={"conv": "kron_out_diag"}, max_factor_dim=3)
  (spec,) = kfac_jax.Registration(
    loss_fn, params, batch, strict=True, layers=config, check_loss=False
  ).layers
  assert (spec.approx, spec.factor_shapes) == ("kron_both_diag", ((2, 18), (2, 4)))
  assert "input side 18" in spec.note


def test_shared_size_policy_counts_the_bias_row():
  """A shared dense layer's input side is `in + 1` with a bias, as for a single-use layer: at
  `in == max_factor_dim` the block's A is over the limit and the layer becomes diagonal."""
  params = {
    "cell": {"kernel": _models.normal(9, (4, 4)), "bias": jax.device_put(np.zeros(4, np.float32))}
  }

  def loss_fn(p, b):
    h = b["x"]
    for _ in range(2):
      h = jnp.tanh(h @ p["cell"]["kernel"] + p["cell"]["bias"])
    kfac_jax.register_softmax_cross_entropy_loss(h, b["y"])
    return optax.softmax_cross_entropy_with_integer_labels(h, b["y"]).mean()

  batch = {"x": _models.normal(10, (2, 4)), "y": jax.device_put(np.array([0, 3], np.int32))}
  for max_dim, want in ((5, ("kron_indep", ((5, 5), (4, 4)))), (4, ("diagonal", ((20,),)))):
    config = kfac_jax.LayerConfig(max_factor_dim=max_dim)
    (spec,) = kfac_jax.Registration(
      loss_fn, params, batch, strict=True, layers=config, check_loss=False
    ).layers
    assert (spec.num_uses, spec.approx, spec.factor_shapes) == (2,) + want
  assert "factor side 5 > max_factor_dim 4 on a layer used 2 times" in spec.note


@pytest.mark.parametrize("approx", _VARIANTS)
def test_diag_variants_on_a_grouped_conv(x64, approx):
  """A grouped convolution keeps one factor per group; a diagonal side is a vector per group."""
  key = jax.random.PRNGKey(0)
  params = {"w": 0.3 * jax.random.normal(key, (3, 3, 2, 4)), "d": jax.random.normal(key, (4, 3))}
  batch = (jax.random.normal(key, (8, 5, 5, 4)), jnp.arange(8) % 3)

  def loss_fn(p, b):
    y = jax.lax.conv_general_dilated(
      b[0],
      p["w"],
      (1, 1),
      "SAME",
      dimension_numbers=("NHWC", "HWIO", "NHWC"),
      feature_group_count=2,
    )
    logits = y.mean((1, 2)) @ p["d"]
    kfac_jax.register_softmax_cross_entropy_loss(logits, b[1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, b[1]).mean()

  layers = kfac_jax.LayerConfig(defaults={"conv": approx})
  for mode in ("factored", "eigen"):
    est, state = _estimator(loss_fn, batch, params, layers, damping_mode=mode)
    assert approx in [b.spec.approx for b in est.blocks]
    state = jax.jit(lambda s: est.update_inverses(s, 0.1))(state)
    v = jax.tree_util.tree_map(jnp.ones_like, params)
    back = jax.jit(lambda s, v: est.multiply_inverse(s, est.multiply(s, v)))(state, v)
    for got in jax.tree_util.tree_leaves(back):
      np.testing.assert_allclose(np.asarray(got), 1.0, rtol=1e-9)
