"""Meshes as users build them: explicit axes (`AxisType.Explicit`) and tensor-parallel kernels
(sharded on their output axis), under `jit` with the mesh set, equal to one device."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import kfac_jax
from tests import _models

SIZES = (6, 10, 10, 10, 3)
STEPS = 4  # Inverse updates at steps 0 and 2.

# Megatron's pairing: layers 0 and 2 split on their output axis (column-parallel), layers 1 and
# 3 on their input axis (row-parallel, their outputs summed over "model").
TENSOR_PARALLEL = {
  "layer0": {"w": P(None, "model"), "b": P("model")},
  "layer1": {"w": P("model", None), "b": P()},
  "layer2": {"w": P(None, "model"), "b": P("model")},
  "layer3": {"w": P("model", None), "b": P()},
}


def _apply(row_out):
  """The MLP; under an explicit mesh a row-parallel matmul names its output's sharding
  (`row_out`), as JAX asks of a contraction over a sharded axis."""

  def apply(params, x):
    for i in range(4):
      p = params[f"layer{i}"]
      x = jnp.matmul(x, p["w"], out_sharding=row_out if i % 2 else None) + p["b"]
      if i < 3:
        x = jnp.tanh(x)
    return x

  return apply


def _problem():
  params = _models.jnp_mlp_init(jax.random.key(0), SIZES, jnp.float64)
  batch = _models.classification_batch(
    jax.random.key(1), n=32, din=SIZES[0], classes=SIZES[-1], dtype=jnp.float64
  )
  return params, batch


def _kfac(loss_fn, batch):
  # kfac's momentum and norm clipping stay on: the clipping's inner product contracts over the
  # (sharded) parameter axes.
  return kfac_jax.kfac(
    loss_fn, batch, learning_rate=0.3, damping=1e-2, inverse_every=2, curvature_every=1
  )


def _optimizer(loss_fn, batch):
  return kfac_jax.Optimizer(
    loss_fn,
    batch,
    learning_rate=0.1,
    momentum=0.5,
    damping=0.1,
    inverse_every=2,
    config=kfac_jax.Config(damping_adaptation_interval=1),
  ).as_optax()


def _train(make, row_out, params, batch, mesh=None, specs=None):
  """STEPS jitted steps; with `mesh`, under `jax.set_mesh` with the batch split over "data"
  and the parameters laid out by `specs`."""
  loss_fn = _models.softmax_loss(_apply(row_out))
  tx = make(loss_fn, batch)
  optimizer = make is _optimizer

  @jax.jit
  def step(params, state, b, rng):
    if optimizer:
      updates, state = tx.update(None, state, params, batch=b, rng=rng)
    else:
      _, grads, stats = kfac_jax.value_and_grad(loss_fn)(params, b, rng)
      updates, state = tx.update(grads, state, params, curvature_stats=stats)
    return optax.apply_updates(params, updates), state

  def run(p, b):
    state = jax.jit(tx.init)(p)  # Eagerly, each op compiles its own.
    for i in range(STEPS):
      p, state = step(p, state, b, jax.random.key(i))
    return p

  if mesh is None:
    return run(params, batch)
  with jax.set_mesh(mesh):
    b = jax.device_put(batch, NamedSharding(mesh, P("data")))
    p = jax.tree_util.tree_map(
      lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), params, specs
    )
    return run(p, b)


@functools.cache
def _one_device(make):
  """The single-device run each mesh run is compared with (computed once per front)."""
  params, batch = _problem()
  return _train(make, None, params, batch)


def _assert_close(got, want):
  for (path, a), b in zip(
    jax.tree_util.tree_leaves_with_path(got), jax.tree_util.tree_leaves(want)
  ):
    np.testing.assert_allclose(
      np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-9, err_msg=jax.tree_util.keystr(path)
    )


@pytest.mark.parametrize("make", [_kfac, _optimizer], ids=["kfac", "optimizer"])
def test_explicit_data_axis_equals_one_device(x64, make):
  """The batch split over an explicit axis: the factors contract over it."""
  params, batch = _problem()
  mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
  specs = jax.tree_util.tree_map(lambda _: P(), params)
  got = _train(make, None, params, batch, mesh, specs)
  _assert_close(got, _one_device(make))
  for leaf in jax.tree_util.tree_leaves(got):
    assert leaf.sharding.mesh.axis_types == (AxisType.Explicit,)
    assert leaf.sharding.is_fully_replicated


@pytest.mark.parametrize(
  "axis_type,make",
  [(AxisType.Auto, _kfac), (AxisType.Explicit, _kfac), (AxisType.Explicit, _optimizer)],
  ids=["auto-kfac", "explicit-kfac", "explicit-optimizer"],
)
def test_tensor_parallel_kernels_equal_one_device_and_keep_their_sharding(x64, axis_type, make):
  """A 4 x 2 ("data", "model") mesh: kernels split on their output or input axis, the batch on
  "data". The updates keep each parameter's layout."""
  params, batch = _problem()
  mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(axis_type,) * 2)
  row_out = P("data", None) if axis_type == AxisType.Explicit else None
  got = _train(make, row_out, params, batch, mesh, TENSOR_PARALLEL)
  _assert_close(got, _one_device(make))
  for name, layer in got.items():
    for key, leaf in layer.items():
      want = NamedSharding(mesh, TENSOR_PARALLEL[name][key])
      assert leaf.sharding.is_equivalent_to(want, leaf.ndim), (name, key, leaf.sharding)


def test_config_mesh_on_an_explicit_axis_is_refused_naming_the_fix(x64):
  params, batch = _problem()
  loss_fn = _models.softmax_loss(_apply(None))
  mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
  with pytest.raises(
    ValueError, match="axis 'data' of the mesh is AxisType.Explicit.*AxisType.Auto"
  ):
    kfac_jax.Config(mesh=(mesh, "data"))
  est = kfac_jax.CurvatureEstimator(kfac_jax.Registration(loss_fn, params, batch))
  state = jax.jit(est.init)(params)  # Eagerly, each op compiles its own.
  with pytest.raises(ValueError, match="AxisType.Explicit"):
    est.update_inverses(state, 1e-2, mesh=(mesh, "data"))
