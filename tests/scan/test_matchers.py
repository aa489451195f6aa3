"""Normalisation layers the scanner turns into scale-and-shift blocks, each block exact in float64.

Group norms (equinox's channel-first `eqx.nn.GroupNorm` under `jax.vmap`, Flax's channel-last
`nn.GroupNorm`), a LayerNorm over the node rows of a batch of graphs (rows that are not examples),
and a BatchNorm stacked by `nn.vmap` (an ensemble). Each block is compared, in the exact mode,
with its definition built from `jax.jacobian` of the logits:
F = (1/N) Σ_n J_nᵀ (diag p_n − p_n p_nᵀ) J_n for the (scale, shift) of a layer.
"""

import functools

import equinox as eqx
import flax.linen as nn
import jax
import jax.flatten_util
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import kfac_jax
from tests import _models

N, C = 4, 3


def _ce(logits, y):
  kfac_jax.register_softmax_cross_entropy_loss(logits, y)
  return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def _fz(logits):
  """`[N, C, C]`: the Fisher of the categorical distribution at each example's logits."""
  p = jax.nn.softmax(logits)
  return jax.vmap(jnp.diag)(p) - p[:, :, None] * p[:, None, :]


def _estimate(loss_fn, params, batch, layers=None):
  """The estimator and its dense matrix after one exact-mode update (`ravel_pytree` order)."""
  # `check_loss=False`: the loss audit is tested in tests/test_audit.py and the zoo; here it
  # would only compile another program.
  est = kfac_jax.CurvatureEstimator(
    kfac_jax.Registration(
      loss_fn, params, batch, estimation_mode="exact", layers=layers, check_loss=False
    )
  )

  @jax.jit  # One program: eager ops would each compile on their own.
  def dense(params, batch):
    state = est.update_curvature(est.init(params), params, batch, None, ema_decay=0.0)
    return est.to_dense(state)

  return est, np.asarray(dense(params, batch))


def _leaf_slices(params, paths):
  """The `ravel_pytree` positions of the leaves at `paths` (as `LayerSpec.param_paths`)."""
  flat = jax.tree_util.tree_flatten_with_path(params)[0]
  off, out = 0, {}
  for path, v in flat:
    name = "/".join(str(getattr(k, "key", getattr(k, "name", k))) for k in path)
    out[name] = np.arange(off, off + v.size)
    off += v.size
  return np.concatenate([out[p] for p in paths])


def _exact_fisher(logits_fn, params, batch):
  """(1/N) Σ_n J_nᵀ F_z J_n over every parameter (flattened by `ravel_pytree`)."""
  flat, unravel = jax.flatten_util.ravel_pytree(params)

  @jax.jit  # One program: eager ops would each compile on their own.
  def fisher(flat, batch):
    jac = jax.jacobian(lambda f: logits_fn(unravel(f), batch))(flat)
    logits = logits_fn(unravel(flat), batch)
    return jnp.einsum("nci,ncd,ndj->ij", jac, _fz(logits), jac) / logits.shape[0]

  return np.asarray(fisher(flat, batch))


def _f64(tree):
  return jax.tree_util.tree_map(
    lambda v: v.astype(jnp.float64) if jnp.issubdtype(v.dtype, jnp.floating) else v, tree
  )


# -- group norm ----------------------------------------------------------------------------------


class _EqxGroupNormNet(eqx.Module):
  conv: eqx.nn.Conv2d
  gn: eqx.nn.GroupNorm
  head: eqx.nn.Linear

  def __init__(self, key):
    k1, k2 = jax.random.split(key)
    self.conv = eqx.nn.Conv2d(2, 4, 3, padding=1, key=k1)
    self.gn = eqx.nn.GroupNorm(2, 4)
    self.head = eqx.nn.Linear(4, C, key=k2)

  def __call__(self, x):  # One example [C, H, W], equinox's channel-first layout.
    return self.head(jnp.tanh(self.gn(self.conv(x))).mean((1, 2)))


class _LinenGroupNormNet(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.GroupNorm(num_groups=2, name="gn")(nn.Conv(4, (3, 3), name="conv")(x))
    return nn.Dense(C, name="head")(jnp.tanh(h).mean((1, 2)))


@functools.cache  # Shared by both approximations (float64: every caller runs under x64).
def _group_norm_case(flavour):
  """(params, batch, logits_fn, paths, feature axis, exact Fisher) of the group-norm net."""
  key = jax.random.key(0)  # The model's initialisation.
  if flavour == "equinox":
    model = _EqxGroupNormNet(key)
    params, static = eqx.partition(model, eqx.is_inexact_array)
    params = _f64(params)
    params = eqx.tree_at(lambda m: (m.gn.weight, m.gn.bias), params, replace_fn=lambda v: v + 0.3)
    x = _models.normal(1, (N, 2, 5, 5), jnp.float64)
    logits_fn = lambda p, b: jax.vmap(eqx.combine(p, static))(b["x"])
    paths, axis = ("gn/weight", "gn/bias"), 1
  else:
    model = _LinenGroupNormNet()
    x = _models.normal(1, (N, 5, 5, 2), jnp.float64)
    params = _f64(jax.jit(model.init)(key, x))
    params = jax.tree_util.tree_map(lambda v: v + 0.3, params)
    logits_fn = lambda p, b: model.apply(p, b["x"])
    paths, axis = ("params/gn/scale", "params/gn/bias"), None
  batch = {"x": x, "y": _models.integers(2, 0, C, N)}
  return params, batch, logits_fn, paths, axis, _exact_fisher(logits_fn, params, batch)


@pytest.mark.parametrize("flavour", ["equinox", "linen"])
@pytest.mark.parametrize("approx", ["full", "diagonal"])
def test_group_norm_is_an_exact_scale_and_shift_block(x64, flavour, approx):
  """A group norm's per-channel scale and shift (applied after normalising over groups) is a
  scale-and-shift layer over the channel axis (axis 1 of equinox's vmapped `[N, C, H, W]`,
  the last of Flax's `[N, H, W, C]`); its block is the exact Fisher block of (scale, shift)."""
  params, batch, logits_fn, paths, axis, exact = _group_norm_case(flavour)

  def loss_fn(p, b):
    return _ce(logits_fn(p, b), b["y"])

  config = kfac_jax.LayerConfig(overrides={paths[0].rsplit("/", 1)[0]: approx})
  layers = kfac_jax.Registration(
    loss_fn, params, batch, strict=True, layers=config, check_loss=False
  ).layers
  (gn,) = [l for l in layers if l.kind == "scale_and_shift"]
  assert (gn.param_paths, gn.approx) == (paths, approx)
  assert (gn.info.feature_axis, gn.info.feature_shape) == (axis, (4,))
  assert all(l.kind != "generic" for l in layers)

  _, dense = _estimate(loss_fn, params, batch, config)
  idx = _leaf_slices(params, paths)
  want = exact[np.ix_(idx, idx)]
  if approx == "diagonal":
    want = np.diag(np.diag(want))
  np.testing.assert_allclose(dense[np.ix_(idx, idx)], want, rtol=1e-9, atol=1e-12)


# -- normalisation over rows that are not examples (graph nodes) ---------------------------------


def _graph_batch(rng, nodes_per_graph):
  """A batch of `len(nodes_per_graph)` graphs, their nodes concatenated into one array; `rng` a
  NumPy generator."""
  graph = np.repeat(np.arange(len(nodes_per_graph), dtype=np.int32), nodes_per_graph)
  return jax.device_put(
    {
      "x": rng.standard_normal((sum(nodes_per_graph), 3)),
      "graph": graph,
      "y": rng.integers(0, C, len(nodes_per_graph)).astype(np.int32),
    }
  )


def _graph_logits(p, b):
  """Dense on the node rows, a LayerNorm over each node's features, a per-graph sum, a head.
  `p["ln"]` may hold one (scale, bias) per node (the reference's per-row parameters)."""
  h = b["x"] @ p["enc"]["kernel"] + p["enc"]["bias"]
  mean = h.mean(-1, keepdims=True)
  xhat = (h - mean) * jax.lax.rsqrt(((h - mean) ** 2).mean(-1, keepdims=True) + 1e-6)
  h = jnp.tanh(xhat * p["ln"]["scale"] + p["ln"]["bias"])
  pooled = jax.ops.segment_sum(h, b["graph"], num_segments=b["y"].shape[0])
  return pooled @ p["head"]["kernel"]


@pytest.mark.parametrize("nodes", [(3, 3, 3, 3), (2, 4, 1, 6)], ids=["even", "uneven"])
@pytest.mark.parametrize("approx", ["full", "diagonal"])
def test_layer_norm_over_graph_nodes_takes_the_nodes_as_rows(x64, nodes, approx):
  """A LayerNorm over the nodes of a batch of graphs (`[num_nodes, features]`, the loss per
  graph) has no axis of examples: the nodes are its statistics' rows, each node's gradient
  one row, F = (1/N) Σ_nodes J_rᵀ J_r over the sampled vectors. In the exact mode that is
  (1/N) Σ_n Σ_{r ∈ n} J_{n,r}ᵀ (diag p_n − p_n p_nᵀ) J_{n,r}, J_{n,r} the Jacobian of graph n's
  logits by node r's own copy of (bias, scale)."""
  rng = _models.np_rng(0)
  batch = _graph_batch(rng, nodes)
  params = jax.device_put(
    {
      "enc": {"bias": rng.standard_normal(5), "kernel": rng.standard_normal((3, 5))},
      "head": {"kernel": rng.standard_normal((5, C))},
      "ln": {"bias": np.full(5, 0.2), "scale": np.linspace(0.5, 1.5, 5)},
    }
  )

  def loss_fn(p, b):
    return _ce(_graph_logits(p, b), b["y"])

  config = kfac_jax.LayerConfig(overrides={"ln": approx})
  layers = kfac_jax.Registration(
    loss_fn, params, batch, strict=True, layers=config, check_loss=False
  ).layers
  (ln,) = [l for l in layers if l.kind == "scale_and_shift"]
  assert (ln.param_paths, ln.approx) == (("ln/scale", "ln/bias"), approx)
  assert not ln.info.example_rows and ln.info.output_shape == (sum(nodes), 5)
  assert all(l.kind != "generic" for l in layers)
  _, dense = _estimate(loss_fn, params, batch, config)

  rows = sum(nodes)
  per_row = {
    "bias": jnp.broadcast_to(params["ln"]["bias"], (rows, 5)),
    "scale": jnp.broadcast_to(params["ln"]["scale"], (rows, 5)),
  }

  @jax.jit  # One program: eager ops would each compile on their own.
  def reference(params, batch, per_row):
    logits_of = lambda ln_rows: _graph_logits(dict(params, ln=ln_rows), batch)  # noqa: E731
    jac = jax.jacobian(logits_of)(per_row)  # leaves [N, C, rows, 5]
    # Node r's parameters as the layer's leaves are ordered (scale, bias).
    j = jnp.concatenate([jac["scale"], jac["bias"]], axis=-1)  # [N, C, rows, 10]
    return jnp.einsum("ncri,ncd,ndrj->ij", j, _fz(logits_of(per_row)), j) / len(nodes)

  want = np.asarray(reference(params, batch, per_row))
  if approx == "diagonal":
    want = np.diag(np.diag(want))
  idx = _leaf_slices(params, ln.param_paths)
  np.testing.assert_allclose(dense[np.ix_(idx, idx)], want, rtol=1e-9, atol=1e-12)


# -- BatchNorm stacked by nn.vmap (an ensemble) --------------------------------------------------

MEMBERS = 3


class _Member(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.BatchNorm(use_running_average=False, name="bn")(nn.Dense(5, name="fc")(x))
    return nn.Dense(C, name="out")(jnp.tanh(h))


_Ensemble = nn.vmap(
  _Member,
  in_axes=None,
  out_axes=0,
  variable_axes={"params": 0, "batch_stats": 0},
  split_rngs={"params": True},
  axis_size=MEMBERS,
)


@pytest.mark.parametrize("approx", ["full", "diagonal"])
def test_batch_norm_in_nn_vmap_is_a_stack_of_exact_blocks(x64, approx):
  """An ensemble's BatchNorm under `nn.vmap` (scale and bias `[L, D]`, one row per member) is a
  stack of L scale-and-shift layers, one block per member, not a fallback: the curvature is
  block-diagonal over members, member l's block the exact Fisher block of (scale[l], bias[l])."""
  model = _Ensemble()
  batch = {"x": _models.normal(0, (N, 3), jnp.float64), "y": _models.integers(1, 0, C, N)}
  variables = _f64(jax.jit(model.init)(jax.random.key(2), batch["x"]))
  params = jax.tree_util.tree_map(lambda v: v + 0.3, variables["params"])
  stats = variables["batch_stats"]

  def logits_fn(p, b):
    out, _ = model.apply({"params": p, "batch_stats": stats}, b["x"], mutable=["batch_stats"])
    return out.mean(0)

  def loss_fn(p, b):
    return _ce(logits_fn(p, b), b["y"])

  config = kfac_jax.LayerConfig(defaults={"scale_and_shift": approx})
  layers = kfac_jax.Registration(
    loss_fn, params, batch, strict=True, layers=config, check_loss=False
  ).layers
  assert [(l.kind, l.param_paths, l.stack_size) for l in layers] == [
    ("scale_and_shift", ("bn/scale", "bn/bias"), MEMBERS),
    ("dense", ("fc/kernel", "fc/bias"), MEMBERS),
    ("dense", ("out/kernel", "out/bias"), MEMBERS),
  ]
  bn = layers[0]
  assert bn.approx == approx and bn.info.feature_shape == (5,)
  _, dense = _estimate(loss_fn, params, batch, config)

  idx = _leaf_slices(params, bn.param_paths)
  want = _exact_fisher(logits_fn, params, batch)[np.ix_(idx, idx)]
  member = np.concatenate([np.repeat(np.arange(MEMBERS), 5)] * 2)  # (scale, bias) entries
  want = want * (member[:, None] == member[None, :])
  if approx == "diagonal":
    want = np.diag(np.diag(want))
  np.testing.assert_allclose(dense[np.ix_(idx, idx)], want, rtol=1e-9, atol=1e-12)
