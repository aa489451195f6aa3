"""summary: the coverage report (share, bytes, why each fallback leaf matched no layer),
axis_name for models with collectives, distinguishable row names, the short warning."""

# `check_loss=False` where the test is about the layers found: the loss audit is tested in
# tests/test_audit.py and the zoo; here it would only compile another program.

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import kfac_jax
from tests import _models

N, D, C = 8, 4, 3


def _batch():
  return _models.classification_batch(jax.random.key(1), n=N, din=D, classes=C)


def _ce(logits, y):
  kfac_jax.register_softmax_cross_entropy_loss(logits, y)
  return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def _report(table):
  """The lines after the table's blank line."""
  return table.split("\n\n", 1)[1].splitlines()


def _reasons(table):
  lines = _report(table)
  start = next(i for i, l in enumerate(lines) if l.startswith("fallback"))
  return dict(l.strip().split(": ", 1) for l in lines[start + 1 :])


# -- one tiny model per reason ----------------------------------------------------------------


def _two_minus_scale(p, b):
  # `1 + scale` (Gemma) is a scale-and-shift layer; a constant minus the parameter is not.
  return _ce((b["x"] * (2 - p["s"])) @ p["w"], b["y"])


def _concatenated(p, b):
  # Concatenated kernels are one dense layer, unless a piece is also used on its own.
  w = jnp.concatenate([p["w_top"], p["w_bottom"]], axis=0)
  return _ce(b["x"] @ w + b["x"][:, :2] @ p["w_top"], b["y"])


def _two_ways(p, b):
  return _ce((b["x"] @ p["w"]) * jnp.exp(p["w"]).mean(), b["y"])


def _no_matcher(p, b):
  return _ce((b["x"] @ p["w"]) * jnp.exp(p["s3"]), b["y"])


def _weight_standardised(p, b):
  # Weight standardisation: the kernel centred and scaled per output before the product.
  k = p["k"]
  k = (k - k.mean(0)) / (k.std(0) + 1e-5)
  return _ce(b["x"] @ k, b["y"])


def _gram_rows(p, b):
  # A scale over the rows of a Gram matrix of the batch: neither axis holds examples.
  return _ce(b["x"] @ ((b["x"].T @ b["x"]) * p["s"]) @ p["w"], b["y"])


def _unused(p, b):
  return _ce(b["x"] @ p["w"], b["y"])


def _regulariser(p, b):
  return _ce(b["x"] @ p["w"], b["y"]) + 1e-3 * jnp.sum(p["u"] ** 2)


def _scanned(p, b):
  def body(h, w_t):
    return jnp.sin(w_t) * h, None

  h, _ = jax.lax.scan(body, b["x"], p["stack"])
  return _ce(h @ p["w"], b["y"])


def _product_of_params(p, b):
  return _ce(b["x"] @ (p["a"] * p["w"]), b["y"])


def _weight_norm(p, b):
  # A kernel computed from the parameters, as flax's `WeightNorm` writes it: v's three uses
  # (v * v for its norm, v / |v|), then the gain g times the unit-norm kernel.
  v = p["v"]
  w = (v / jnp.sqrt(jnp.sum(v * v, axis=0))) * p["g"]
  return _ce(b["x"] @ w, b["y"])


def _projected_latents(p, b):
  # Learned latents projected by a dense kernel before any batch input meets them: the
  # projection's rows are the 3 latents, not examples (a Perceiver-style query written so).
  q = jnp.tanh(p["lat"]) @ p["w"]
  att = jax.nn.softmax(b["x"] @ q.T)
  return _ce((att @ q) @ p["head"], b["y"])


def _relative_positions(p, b):
  # A table looked up at constant offsets and summed over its columns before it is added to
  # every example's scores (T5's bias added directly is a layer: tests/blocks/test_kronecker.py).
  offsets = jnp.abs(jnp.arange(D)[:, None] - jnp.arange(D)[None, :])
  bias = p["rel"][offsets].sum(-1)
  scores = jax.nn.softmax(b["x"][:, :, None] * b["x"][:, None, :] + bias)
  return _ce(scores.sum(1) @ p["head"], b["y"])


def _codebook(p, b):
  # A VQ-VAE codebook: the decoder reads the quantised code through a straight-through
  # `stop_gradient`, so the loss tag gives the codebook no curvature; the untagged codebook
  # term trains it.
  z = b["x"] @ p["enc"]
  code = p["book"][jnp.argmin(((z[:, None] - p["book"][None]) ** 2).sum(-1), axis=1)]
  quantised = z + jax.lax.stop_gradient(code - z)
  return _ce(quantised @ p["w"], b["y"]) + jnp.mean((jax.lax.stop_gradient(z) - code) ** 2)


W = jnp.ones((D, C)) * 0.1
GENERIC_FIX = (
  'tag it in loss_fn with `kfac_jax.register_generic(param, approx="full")` for a full block '
  "(the fallback is its diagonal)"
)
EXP = (
  "passed through exp before use (a reparameterised parameter, e.g. `x * exp(log_scale)`): "
  f"the layer blocks read the parameter itself; {GENERIC_FIX}"
)


def _computed_kernel(ops):
  return (
    f"transformed by {ops} into a matmul operand computed from parameters and constants alone "
    "(e.g. a standardised, weight-normalised or masked kernel, or latents before they are "
    f"broadcast over the batch): no layer block fits; {GENERIC_FIX}"
  )


NO_ROWS = (
  "an input computed from parameters and constants alone (no rows per example, e.g. latents "
  "projected, then multiplied with the batch's activations rather than broadcast over the batch)"
)
# (name, loss_fn, params, leaf, the primitive that reads the leaf) for the no-rows models.
NO_ROWS_CASES = [
  (
    "projected latents",
    _projected_latents,
    {"head": W, "lat": jnp.ones((3, D)), "w": jnp.eye(D)},
    "w",
    "dot_general",
  ),
]

REASON_CASES = [
  ("2 - scale", _two_minus_scale, {"s": jnp.ones(D), "w": W}, "s", "used as 2 - scale"),
  (
    "concatenated",
    _concatenated,
    {"w_top": W[:2], "w_bottom": W[2:]},
    "w_bottom",
    "concatenated before a matmul",
  ),
  ("two ways", _two_ways, {"w": W}, "w", "used 2 times in different ways (dot_general, exp)"),
  ("exp", _no_matcher, {"s3": jnp.ones(C), "w": W}, "s3", EXP),
  (
    "weight norm",
    _weight_norm,
    {"g": jnp.ones(C), "v": W},
    "v",
    _computed_kernel("mul, div, reduce_sum, sqrt"),
  ),
  (
    "weight standardisation",
    _weight_standardised,
    {"k": W + jnp.arange(C) / 10},
    "k",
    _computed_kernel("reduce_sum, sub, div, square, ..."),
  ),
  (
    "rows not examples",
    _gram_rows,
    {"s": jnp.ones(D), "w": W},
    "s",
    "consumed by mul on rows that are not examples: no axis of the output (4, 4) outside the "
    f"parameter's (4,) has the batch's size {N} or was followed from the batch inputs, and no "
    f"batch input has its leading axis; {GENERIC_FIX}",
  ),
  ("unused", _unused, {"u": jnp.ones(2), "w": W}, "u", "not used by the loss"),
  (
    "regulariser",
    _regulariser,
    {"u": jnp.ones(2), "w": W},
    "u",
    "not used by the loss (only outside the loss tags' inputs, e.g. a regulariser)",
  ),
  (
    "codebook",
    _codebook,
    {"book": jnp.arange(3.0 * D).reshape(3, D) / 10, "enc": jnp.eye(D), "w": W},
    "book",
    "reaches the loss tags only through stop_gradient (no curvature from them; e.g. a VQ-VAE "
    "codebook trained by an untagged term)",
  ),
  (
    "scan",
    _scanned,
    {"stack": jnp.ones((3, N, D)), "w": W},
    "stack",
    "sliced by a scan (a stacked layer axis)",
  ),
  *[
    (name, fn, params, leaf, f"consumed by {prim} with {NO_ROWS}")
    for name, fn, params, leaf, prim in NO_ROWS_CASES
  ],
  (
    "relative positions",
    _relative_positions,
    {"head": W, "rel": jnp.ones((D, 2))},
    "rel",
    "gathered at constant positions, then consumed by reduce_sum (no matcher)",
  ),
  (
    "product of parameters",
    _product_of_params,
    {"a": jnp.ones((D, C)), "w": W},
    "a",
    ("combined by mul with parameter `w` (a product or sum of two parameters has no layer block)"),
  ),
]


def test_a_gain_on_a_computed_kernel_is_no_layer_even_when_its_rows_equal_the_batch():
  """Weight normalisation's gain `g` multiplies `v / |v|`, a kernel computed from parameters. A
  kernel with as many rows as the batch has examples looks like an activation by its shape;
  it must not become a scale-and-shift layer (its "examples" would be the kernel's rows).
  Learned latents broadcast over the batch and normalised stay a layer (test_zoo's Perceiver)."""
  batch = _models.classification_batch(jax.random.key(1), n=N, din=N, classes=C)
  params = {"g": jnp.ones(C), "v": jnp.ones((N, C)) * 0.1}
  with pytest.warns(kfac_jax.UncoveredParametersWarning):
    layers = kfac_jax.Registration(_weight_norm, params, batch).layers
  assert [(l.kind, l.param_paths) for l in layers] == [("generic", ("g",)), ("generic", ("v",))]
  reasons = _reasons(kfac_jax.summary(_weight_norm, params, batch))
  assert reasons["g"].startswith("transformed by mul"), reasons


@pytest.mark.parametrize(
  "loss_fn,params,leaf",
  [c[1:4] for c in NO_ROWS_CASES],
  ids=[c[0] for c in NO_ROWS_CASES],
)
def test_a_layer_whose_input_has_no_rows_per_example_is_no_layer(loss_fn, params, leaf):
  """A dense kernel read with an input computed from parameters and constants alone whose
  output meets the batch in a product, not through a broadcast (latents projected before a
  batch input multiplies them) has no rows per example: its rows would be taken for examples
  and its output gradient is the batch's sum, so a layer block would be estimated from the wrong
  rows (the "full" dense block, exact when the rows are examples, underestimates the exact
  Fisher's trace there). It gets the generic
  fallback, whose batch-summed estimate is unbiased for sampled targets; the layer that reads
  the batch stays a layer."""
  with pytest.warns(kfac_jax.UncoveredParametersWarning):
    layers = kfac_jax.Registration(loss_fn, params, _batch()).layers
  kinds = {l.param_paths: l.kind for l in layers}
  assert kinds[(leaf,)] == "generic", kinds
  assert kinds[("head",)] == "dense", kinds


def test_a_closed_over_constant_with_a_row_per_example_is_a_layer_input(x64):
  """An initial state built outside the loss function (`h0` of shape `[N, H]`, closed over) is a
  dense layer's input with one row per example. Its curvature is the same as with `h0` passed in
  the batch (it used to fail with a KeyError when the statistics read the constant)."""
  rng = _models.np_rng(0)
  h0 = jax.device_put(rng.standard_normal((N, D)))
  params = jax.device_put(
    {
      "head": rng.standard_normal((D, C)),
      "wh": rng.standard_normal((D, D)),
      "wx": rng.standard_normal((D, D)),
    }
  )
  batch = _models.classification_batch(jax.random.key(1), n=N, din=D, classes=C, dtype=jnp.float64)

  def logits(p, x, h):
    return jnp.tanh(x @ p["wx"] + h @ p["wh"]) @ p["head"]

  def closed(p, b):
    return _ce(logits(p, b["x"], h0), b["y"])

  def passed(p, b):
    return _ce(logits(p, b["x"], b["h0"]), b["y"])

  dense = []
  for loss_fn, b in ((closed, batch), (passed, dict(batch, h0=h0))):
    reg = kfac_jax.Registration(
      loss_fn, params, b, strict=True, estimation_mode="exact", check_loss=False
    )
    assert [(l.kind, l.param_paths) for l in reg.layers] == [
      ("dense", ("head",)),
      ("dense", ("wh",)),
      ("dense", ("wx",)),
    ]
    est = kfac_jax.CurvatureEstimator(reg)
    state = jax.jit(  # One program: eager operations would compile one by one.
      lambda p, b, est=est: est.update_curvature(est.init(p), p, b, None, ema_decay=0.0)
    )(params, b)
    dense.append(est.to_dense(state))
  assert float(jnp.abs(dense[0]).max()) > 1e-3
  np.testing.assert_allclose(dense[0], dense[1], rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize(
  "name,loss_fn,params,leaf,reason", REASON_CASES, ids=[c[0] for c in REASON_CASES]
)
def test_each_fallback_reason(name, loss_fn, params, leaf, reason):
  table = kfac_jax.summary(loss_fn, params, _batch())
  assert _reasons(table)[leaf] == reason, table
  # The warning and check_registration say the same for that leaf.
  with pytest.warns(kfac_jax.UncoveredParametersWarning) as record:
    kfac_jax.Registration(loss_fn, params, _batch())
  assert f"`{leaf}` ({reason})" in str(record[0].message)
  with pytest.raises(kfac_jax.RegistrationCheckError) as err:
    kfac_jax.check_registration(loss_fn, params, _batch())
  assert any(p.startswith(f"`{leaf}` is not in any layer ({reason};") for p in err.value.problems)


# -- share and bytes --------------------------------------------------------------------------


def test_share_and_bytes_against_hand_computed_values():
  """Dense w [4, 3] + b [3] (15 values) and a diagonal fallback for s [3]: 15 of 18.

  Bytes, float32: the dense block keeps A [5, 5] and G [3, 3] (bias folded into A), their
  inverses and one damping scalar: 4 · (2 · (25 + 9) + 1) = 276; the diagonal block 3 values
  and one scalar: 4 · 4 = 16. Parameters: 18 · 4 = 72 bytes.
  """

  def loss_fn(p, b):
    return _ce((b["x"] @ p["w"] + p["b"]) * jnp.exp(p["s"]), b["y"])

  params = {"b": jnp.zeros(C), "s": jnp.zeros(C), "w": W}
  table = kfac_jax.summary(loss_fn, params, _batch())
  report = _report(table)
  assert report[0] == (
    "layer blocks (dense, conv, embedding, scale-and-shift, grouped-dense) hold 15 of 18 "
    "parameters (83.3%)"
  )
  assert report[1] == "curvature state: 292 B (4.06x the parameters' 72 B)"
  assert report[2:] == [
    "fallback (diagonal) blocks, 1: why no layer matched",
    f"  s: {EXP}",
  ]
  # The reported state bytes are those of the optimizer state's curvature, leaf for leaf.
  with pytest.warns(kfac_jax.UncoveredParametersWarning):
    state = kfac_jax.scale_by_kfac(loss_fn, _batch()).init(params)
  curv = (state.curvature.factors, state.curvature.cache)
  assert sum(x.nbytes for x in jax.tree_util.tree_leaves(curv)) == 292
  assert "276 B" in next(l for l in table.splitlines() if l.startswith("w "))


def test_full_coverage_has_no_fallback_section():
  params = _models.jnp_mlp_init(jax.random.key(0), (D, 5, C))
  table = kfac_jax.summary(_models.softmax_loss(_models.jnp_mlp_apply), params, _batch())
  report = _report(table)
  n = D * 5 + 5 + 5 * C + C
  assert report[0].endswith(f"hold {n} of {n} parameters (100.0%)")
  assert len(report) == 2 and "fallback" not in table


# -- names, warning -----------------------------------------------------------------------------


def test_layers_in_one_flat_dict_get_distinct_row_names():
  def loss_fn(p, b):
    q = p["params"]
    return _ce(jnp.tanh(b["x"] @ q["w1"] + q["b1"]) @ q["w2"] + q["b2"], b["y"])

  params = {
    "params": {
      "w1": jnp.ones((D, 5)),
      "b1": jnp.zeros(5),
      "w2": jnp.ones((5, C)),
      "b2": jnp.zeros(C),
    }
  }
  assert [
    l.name for l in kfac_jax.Registration(loss_fn, params, _batch(), check_loss=False).layers
  ] == ["params"] * 2
  rows = kfac_jax.summary(loss_fn, params, _batch()).splitlines()[2:4]
  assert [r.split()[0] for r in rows] == ["params/w1", "params/w2"]


def test_a_table_beside_modules_is_named_by_its_path_and_parameters_are_relative():
  class Net(nn.Module):
    @nn.compact
    def __call__(self, x):  # x: [N, 3, D]
      x = x + self.param("pos", nn.initializers.zeros, (1, 3, D))
      return nn.Dense(C)(nn.Dense(5)(x).mean(axis=1))

  x = _models.normal(2, (N, 3, D))
  batch = {"x": x, "y": _batch()["y"]}
  params = jax.jit(Net().init)(jax.random.key(0), x)  # One program: eager init compiles each op.
  loss_fn = lambda p, b: _ce(Net().apply(p, b["x"]), b["y"])
  rows = {r.split()[0]: r for r in kfac_jax.summary(loss_fn, params, batch).splitlines()[2:5]}
  assert sorted(rows) == ["params/Dense_0", "params/Dense_1", "params/pos"], rows
  assert rows["params/Dense_0"].split()[4:6] == ["kernel,", "bias"], rows
  assert rows["params/pos"].split()[4] == "pos", rows


def test_warning_is_short_and_points_to_summary():
  params = {f"s{i}": jnp.ones(2) for i in range(5)} | {"w": W}
  with pytest.warns(kfac_jax.UncoveredParametersWarning) as record:
    kfac_jax.Registration(_unused, params, _batch())
  msg = str(record[0].message)
  assert msg.startswith("5 parameter(s) are not in any recognised layer")
  assert (
    "`s0` (not used by the loss); `s1` (not used by the loss); `s2` (not used by the loss)"
  ) in msg
  assert "; and 2 more." in msg and "`s3`" not in msg
  assert "kfac_jax.summary(loss_fn, params, batch)" in msg
  with pytest.raises(kfac_jax.RegistrationError, match="`s4` \\(not used by the loss\\).*strict"):
    kfac_jax.Registration(_unused, params, _batch(), strict=True)  # strict lists every one


# -- axis_name ----------------------------------------------------------------------------------


class _BatchNormMLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.Dense(8)(x)
    x = nn.BatchNorm(use_running_average=False, axis_name="batch")(x)
    return nn.Dense(C)(nn.relu(x))


def _batchnorm_problem():
  model = _BatchNormMLP()
  batch = _batch()

  @jax.jit  # One program: eager init compiles each op.
  def init(x):
    init_one = lambda x: model.init(jax.random.key(0), x)  # noqa: E731
    variables = jax.vmap(init_one, in_axes=None, axis_size=1, axis_name="batch")(x)
    return jax.tree_util.tree_map(lambda a: a[0], variables)

  variables = init(batch["x"])

  def loss_fn(params, batch):
    logits, _ = model.apply(
      {"params": params, "batch_stats": variables["batch_stats"]},
      batch["x"],
      mutable=["batch_stats"],
    )
    return _ce(logits, batch["y"])

  return loss_fn, variables["params"], batch


def test_axis_name_scans_a_model_with_batchnorm_collectives():
  loss_fn, params, batch = _batchnorm_problem()
  with pytest.raises(NameError, match="unbound axis name: batch"):
    kfac_jax.Registration(loss_fn, params, batch)
  want = [("BatchNorm_0", "scale_and_shift"), ("Dense_0", "dense"), ("Dense_1", "dense")]
  regs = {}
  for axis_name in ("batch", ("batch", "model")):
    regs[axis_name] = kfac_jax.Registration(
      loss_fn, params, batch, collective_axes=axis_name, check_loss=False
    )
    layers = regs[axis_name].layers
    assert [(l.name, l.kind) for l in layers] == want
  assert kfac_jax.check_registration(registration=regs["batch"]) == layers
  table = kfac_jax.summary(registration=regs["batch"])
  assert "BatchNorm_0  scale_and_shift" in table and "(100.0%)" in table


def test_axis_name_layers_equal_those_found_inside_pmap():
  """Inside pmap the estimator scans under the real axis; the inspection agrees with it."""
  loss_fn, params, batch = _batchnorm_problem()
  tx = kfac_jax.scale_by_kfac(loss_fn, batch, axis_name="batch")
  names = [
    l.name
    for l in kfac_jax.Registration(
      loss_fn, params, batch, collective_axes="batch", check_loss=False
    ).layers
  ]
  state = jax.pmap(tx.init, axis_name="batch")(jax.tree_util.tree_map(lambda a: a[None], params))
  assert sorted(state.curvature.factors) == sorted(names)


@pytest.mark.parametrize("bad", [3, ("batch", 3), (), ["batch"]])
def test_axis_name_of_the_wrong_type_is_named(bad):
  loss_fn, params, batch = _batchnorm_problem()
  with pytest.raises(TypeError, match="`collective_axes` must be a string or a tuple of strings"):
    kfac_jax.summary(
      registration=kfac_jax.Registration(loss_fn, params, batch, collective_axes=bad)
    )


def test_has_aux_scans_the_loss_part_only():
  def with_aux(p, b):
    logits = jnp.tanh(b["x"] @ p["w1"]) @ p["w2"]
    return _ce(logits, b["y"]), {"logits": logits, "extra": p["w1"].sum()}

  params = {"w1": jnp.ones((D, 5)), "w2": jnp.ones((5, C))}
  layers = kfac_jax.Registration(with_aux, params, _batch(), has_aux=True, check_loss=False).layers
  assert [(l.name, l.kind) for l in layers] == [("w1", "dense"), ("w2", "dense")]
  assert "(100.0%)" in kfac_jax.summary(
    registration=kfac_jax.Registration(with_aux, params, _batch(), has_aux=True, check_loss=False)
  )
  assert (
    kfac_jax.check_registration(
      registration=kfac_jax.Registration(with_aux, params, _batch(), has_aux=True, check_loss=False)
    )
    == layers
  )
  with pytest.raises(kfac_jax.RegistrationError, match="has_aux=True"):
    kfac_jax.summary(with_aux, params, _batch())


def test_a_kernel_read_in_two_layouts_is_named_as_such():
  """The same leaf as an HWIO kernel, then as an OIHW kernel: no one shared conv layer."""
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

  assert _reasons(kfac_jax.summary(loss_fn, params, batch))["k"] == (
    "used 2 times by conv_general_dilated in ways no one shared layer fits (e.g. different "
    "kernel layouts, or biases that differ between uses)"
  )
