"""Sharded K-FAC state under FSDP (parameters sharded over a mesh axis) and the cost-balanced
assignment of the refresh, on 8 fake CPU devices."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import kfac_jax
from kfac_jax import _parallel
from kfac_jax.blocks import _blocked
from tests import _models

# -- the assignment of the refresh -------------------------------------------------------------


def _dense_shapes(n_in: int, n_out: int, bias: bool, block: int) -> tuple[tuple[int, ...], ...]:
  """A dense layer's Kronecker factor shapes, a side wider than `block` kept as its diagonal
  blocks `[k, b, b]` (`kfac_jax.blocks._blocked.partition`)."""

  def side(n, has_bias):
    part = _blocked.partition(n, has_bias, block)
    return (n, n) if part is None else (part[0], part[1], part[1])

  return side(n_in + (1 if bias else 0), bias), side(n_out, False)


def _transformer_shapes(layers=12, d=1024, vocab=32768, block=1024):
  """The K-FAC blocks of a decoder-only Transformer: per layer q, k, v, o (d → d) and the MLP
  (d → 4d → d), all with biases; a token embedding (a diagonal input factor) and an LM head."""
  shapes = [((vocab,), (d, d))]  # Embedding: A is a vector.
  for _ in range(layers):
    shapes += [_dense_shapes(d, d, True, block)] * 4
    shapes += [_dense_shapes(d, 4 * d, True, block), _dense_shapes(4 * d, d, True, block)]
  shapes.append(_dense_shapes(d, vocab, False, block))
  return shapes


def _bytes(shapes, itemsize=4):
  """Factors and one inverse per factor."""
  return [2.0 * itemsize * sum(math.prod(s) for s in f) for f in shapes]


def test_transformer_refresh_is_balanced_over_8_devices():
  shapes = _transformer_shapes()
  costs = [_parallel.factorisation_cost(f) for f in shapes]
  sizes = _bytes(shapes)
  shares = _parallel.refresh_assignment(shapes, 8, sizes)
  assert sorted(i for s in shares for i in s) == list(range(len(shapes)))
  loads = [sum(costs[i] for i in s) for s in shares]
  assert max(loads) <= 1.2 * sum(loads) / len(loads)  # The busiest device over the mean.
  # The LM head alone fills one device; the layers' blocks, one stack per shape on each device,
  # spread over the others.
  head = len(shapes) - 1
  assert [i for s in shares if head in s for i in s] == [head]
  held = [sum(sizes[i] for i in s) for s in shares]
  assert max(held) <= 1.25 * sum(sizes) / 8 + max(sizes)
  assert shares == _parallel.refresh_assignment(shapes, 8, sizes)  # Deterministic.


def test_blocked_sides_cost_per_sub_block():
  assert _parallel.factorisation_cost(((4, 1025, 1025), (1024, 1024))) == 4 * 1025**3 + 1024**3


def test_bytes_cap_holds_when_cost_and_bytes_disagree():
  """A vector factor is cheap and large: balancing cost alone would pile bytes on one device."""
  shapes = [((4096,),)] * 6 + [((64, 64),)] * 2
  sizes = [4096.0] * 6 + [4096.0 * 2] * 2
  shares = _parallel.refresh_assignment(shapes, 2, sizes)
  held = [sum(sizes[i] for i in s) for s in shares]
  assert max(held) <= 1.25 * sum(sizes) / 2 + max(sizes)


# -- FSDP: parameters, factors and inverses sharded over one mesh axis ---------------------------

SIZES = (8, 32, 48, 16, 8)
STEPS = 4  # Inverse updates at steps 0 and 3.
BLOCK = 16  # Sides of 32, 33, 48 and 49 entries kept as [k, b, b] blocks.


def _problem():
  params = _models.jnp_mlp_init(jax.random.key(0), SIZES, jnp.float64)
  batch = _models.classification_batch(
    jax.random.key(1), n=64, din=SIZES[0], classes=SIZES[-1], dtype=jnp.float64
  )
  return _models.softmax_loss(_models.jnp_mlp_apply), params, batch


def _tx(loss_fn, params, batch, **config):
  layers = kfac_jax.LayerConfig(block_size=BLOCK)
  return kfac_jax.kfac(
    registration=kfac_jax.Registration(
      loss_fn, params, batch, estimation_mode="empirical", layers=layers
    ),
    learning_rate=0.3,
    damping=1e-2,
    ema_decay=0.8,
    inverse_every=3,
    momentum=None,
    max_norm=None,
    config=kfac_jax.Config(**config),
  )


def test_fsdp_state_is_sharded_and_training_equals_one_device(x64):
  loss_fn, params, batch = _problem()
  mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
  # FSDP: every kernel and bias split on its output axis, the batch on the same axis.
  specs = {k: {"w": P(None, "data"), "b": P("data")} for k in params}
  sharded_params = jax.tree_util.tree_map(
    lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), params, specs
  )
  data = jax.device_put(batch, NamedSharding(mesh, P("data")))

  want, one = _models.empirical_run(_tx(loss_fn, params, batch), loss_fn, params, batch, STEPS)
  tx = _tx(loss_fn, params, batch, mesh=(mesh, "data"), inverse_storage="sharded")
  got, state = _models.empirical_run(tx, loss_fn, sharded_params, data, STEPS)
  for (path, a), b in zip(
    jax.tree_util.tree_leaves_with_path(got), jax.tree_util.tree_leaves(want)
  ):
    np.testing.assert_allclose(
      np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-9, err_msg=jax.tree_util.keystr(path)
    )

  curv = state[0].curvature
  assert int(curv.failed_inverses) == 0
  est = kfac_jax.CurvatureEstimator(
    kfac_jax.Registration(loss_fn, params, batch, layers=kfac_jax.LayerConfig(block_size=BLOCK)),
    config=kfac_jax.Config(inverse_storage="sharded"),
  )
  jax.eval_shape(lambda p: est.init(p, mesh=(mesh, "data")), params)  # Finds the blocks.
  blocks = est.blocks
  assert any(len(s) == 3 for b in blocks for s in b.factor_shapes)  # Blocked sides exist.
  per_block = [b.state_bytes() for b in blocks]
  total = sum(per_block)
  held = _models.device_bytes((curv.factors, curv.cache), mesh)
  assert max(held) <= 1.25 * total / 8 + max(per_block), (held, total, per_block)
  assert max(held) < total / 2
  # The shares are the cost-balanced refresh assignment.
  factors_layout, cache_layout = est.storage.layouts(8)
  want_shares = _parallel.refresh_assignment([b.factor_shapes for b in blocks], 8, per_block)
  assert factors_layout.shares == cache_layout.shares == want_shares
  # Replicated storage on the same mesh: every device holds every block's factors and nearly
  # every cache (XLA's propagation splits a few of the inverses the sharded gradient meets).
  _, rep = _models.empirical_run(
    _tx(loss_fn, params, batch, mesh=(mesh, "data")), loss_fn, sharded_params, data, STEPS
  )
  rep_curv = rep[0].curvature
  assert min(_models.device_bytes((rep_curv.factors, rep_curv.cache), mesh)) > 0.9 * total
  # The factors gathered from the sharded state are the one-device run's.
  gathered = jax.jit(  # One program: eager operations would compile one by one.
    lambda f: est.storage.block_factors(f)
  )(curv.factors)
  for n in est.names:
    for a, b in zip(
      jax.tree_util.tree_leaves(gathered[n]),
      jax.tree_util.tree_leaves(one[0].curvature.factors[n]),
    ):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-9, err_msg=n)


def test_a_mesh_axis_that_does_not_exist_is_named_before_any_state_changes(x64):
  loss_fn, params, batch = _problem()
  mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
  with pytest.raises(ValueError, match=r"`config.mesh`.*'fsdp'"):
    kfac_jax.Config(mesh=(mesh, "fsdp"), inverse_storage="sharded")
  est = kfac_jax.CurvatureEstimator(
    kfac_jax.Registration(loss_fn, params, batch), config=kfac_jax.Config(inverse_storage="sharded")
  )
  with pytest.raises(ValueError, match=r"mesh axis 'fsdp' is not in the mesh"):
    est.init(params, mesh=(mesh, "fsdp"))
  state = jax.jit(lambda p: est.init(p, mesh=(mesh, "data")))(params)  # Eager: op by op.
  before = jax.tree_util.tree_map(np.asarray, state)
  rng = jax.random.key(0)
  for call in (
    # No batch: the mesh is checked before any statistics are computed.
    lambda: est.update_curvature(state, params, None, rng, 0.0, mesh=(mesh, "fsdp")),
    lambda: est.update_inverses(state, 1e-2, mesh=(mesh, "fsdp")),
  ):
    with pytest.raises(ValueError, match=r"mesh axis 'fsdp' is not in the mesh"):
      call()
  for a, b in zip(jax.tree_util.tree_leaves(state), jax.tree_util.tree_leaves(before)):
    np.testing.assert_array_equal(np.asarray(a), b)


@pytest.mark.parametrize("storage", ["sharded", "replicated"])
def test_an_eager_init_under_fsdp_compiles_the_step_once(x64, storage):
  """The state `tx.init` makes eagerly for FSDP params has the shardings the jitted step returns
  (its counters replicated over the mesh, a replicated storage's inverses kept replicated), so
  steps 2 to 4, an inverse refresh among them, run the first step's program."""
  loss_fn, params, batch = _problem()
  mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
  specs = {k: {"w": P(None, "data"), "b": P("data")} for k in params}
  params = jax.tree_util.tree_map(
    lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), params, specs
  )
  data = jax.device_put(batch, NamedSharding(mesh, P("data")))
  tx = _tx(loss_fn, params, batch, mesh=(mesh, "data"), inverse_storage=storage)
  reg = kfac_jax.Registration(loss_fn, params, batch, estimation_mode="empirical")

  @jax.jit
  def step(params, state, b):
    _, grads, stats = kfac_jax.value_and_grad(registration=reg)(params, b)
    updates, state = tx.update(grads, state, params, curvature_stats=stats)
    return optax.apply_updates(params, updates), state

  state = tx.init(params)
  first = state
  for _ in range(STEPS):
    params, state = step(params, state, data)
  # The jit cache's size can read 0 after other tests in the process, so the program's reuse is
  # checked through its cause: every state leaf keeps init's sharding through the steps.
  for (path, a), b in zip(
    jax.tree_util.tree_leaves_with_path(first), jax.tree_util.tree_leaves(state)
  ):
    assert a.sharding.is_equivalent_to(b.sharding, a.ndim), jax.tree_util.keystr(path)
