"""Data-parallel K-FAC on 8 fake CPU devices: pmap, shard_map, jit + NamedSharding, split
inverses."""

# `check_loss=False`: the loss audit is tested in tests/test_audit.py and the zoo; here it would
# only compile another program (`kfac` below is given its learning rate and no norm constraint,
# so nothing reads the audit's loss factor).

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import kfac_jax
from kfac_jax import _parallel
from tests import _models

SIZES = (6, 10, 10, 10, 3)  # Blocks (in+1, out): (7, 10), (11, 10), (11, 10), (11, 3).


def _problem(n=32):
  """A 4-layer MLP; float64 when x64 is on (the step tests compare to 1e-6 relative error)."""
  return _built_problem(n, bool(jax.config.jax_enable_x64))


@functools.cache  # One loss, params and batch per shape and dtype: the tests share compiles.
def _built_problem(n, x64):
  dtype = jnp.float64 if x64 else jnp.float32
  params = _models.jnp_mlp_init(jax.random.key(0), SIZES, dtype)
  batch = _models.classification_batch(
    jax.random.key(1), n=n, din=SIZES[0], classes=SIZES[-1], dtype=dtype
  )
  return _models.softmax_loss(_models.jnp_mlp_apply), params, batch


def _split(tree, n):
  return jax.tree_util.tree_map(lambda x: x.reshape((n, -1) + x.shape[1:]), tree)


# -- the assignment ------------------------------------------------------------------------------


@pytest.mark.parametrize("num_devices", [1, 2, 3, 8, 16])
def test_assignment_is_balanced_and_covers_every_block_once(num_devices):
  costs = [1000.0] * 5 + [8.0] * 7 + [27.0] * 3  # Three cost classes, 15 blocks.
  shares = _parallel.assign(costs, num_devices)
  assert len(shares) == num_devices
  assert sorted(i for s in shares for i in s) == list(range(len(costs)))
  loads = [sum(costs[i] for i in s) for s in shares]
  assert max(loads) - min(loads) <= max(costs)
  # The most expensive class spreads round-robin: its counts differ by at most one.
  big = [sum(costs[i] == 1000.0 for i in s) for s in shares]
  assert max(big) - min(big) <= 1
  assert shares == _parallel.assign(costs, num_devices)  # Deterministic.


def test_assignment_of_equal_blocks_differs_by_at_most_one():
  for n_blocks in range(1, 20):
    shares = _parallel.assign([5.0] * n_blocks, 8)
    counts = [len(s) for s in shares]
    assert max(counts) - min(counts) <= 1, (n_blocks, counts)


def test_factorisation_cost():
  assert _parallel.factorisation_cost(((3, 3), (4, 4))) == 27 + 64
  assert _parallel.factorisation_cost(((10,),)) == 10


# -- split == replicated -------------------------------------------------------------------------


@pytest.mark.parametrize("num_devices", [3, 8])
def test_split_inverses_equal_replicated_ones_exactly(num_devices):
  """4 blocks over 3 devices (not a multiple) and over 8 (more devices than blocks)."""
  est, state, replicated = _split_inverses_reference()
  devices = jax.devices()[:num_devices]
  stacked = jax.tree_util.tree_map(lambda x: jnp.broadcast_to(x, (num_devices,) + x.shape), state)
  split = jax.pmap(
    lambda s: est.update_inverses(s, 1e-2, axis_name="i"), axis_name="i", devices=devices
  )(stacked)
  leaves_r = jax.tree_util.tree_leaves_with_path(replicated.cache)
  leaves_s = jax.tree_util.tree_leaves(split.cache)
  assert len(leaves_r) == len(leaves_s)
  for (path, r), s in zip(leaves_r, leaves_s):
    for d in range(num_devices):
      np.testing.assert_array_equal(np.asarray(s)[d], np.asarray(r), err_msg=str(path))


@functools.cache  # Shared by both device counts.
def _split_inverses_reference():
  """An estimator, a state with statistics, and its inverses computed on one device."""
  loss_fn, params, batch = _problem()
  est = kfac_jax.CurvatureEstimator(
    kfac_jax.Registration(loss_fn, params, batch, check_loss=False),
    exps=(-1, -0.5),
    compute_cholesky=True,
    compute_cholesky_inverse=True,
  )
  state = jax.jit(  # One program: eager operations would compile one by one.
    lambda p, b, k: est.update_curvature(est.init(p), p, b, k, 0.0)
  )(params, batch, jax.random.key(2))
  replicated = jax.jit(lambda s: est.update_inverses(s, 1e-2))(state)
  return est, state, replicated


# -- whole training steps ------------------------------------------------------------------------


def _kfac(loss_fn, params, batch, **kw):
  # No KL clipping and no momentum (kfac's defaults have both): the sharded-storage tests compare
  # parameters to round-off, and fewer fused terms keep the sharded and replicated programs'
  # rounding apart by the least.
  kw = {
    "momentum": None,
    "max_norm": None,
    "estimation_mode": "empirical",
    "check_loss": False,
    **kw,
  }
  args, kwargs = _models.front_args(loss_fn, params, batch, kw)
  return kfac_jax.kfac(
    *args, learning_rate=0.3, damping=1e-2, ema_decay=0.8, inverse_every=3, **kwargs
  )


def _assert_close(got, want):
  got_leaves = jax.tree_util.tree_leaves_with_path(got)
  for (path, a), b in zip(got_leaves, jax.tree_util.tree_leaves(want)):
    np.testing.assert_allclose(
      np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-9, err_msg=jax.tree_util.keystr(path)
    )


STEPS = 7  # Inverse updates at steps 0, 3 and 6.


def _one_device_run():
  """The float64 one-device run on the whole batch that the data-parallel runs must equal
  (computed once per module)."""
  assert jax.config.jax_enable_x64
  return _built_one_device_run()


@functools.cache
def _built_one_device_run():
  loss_fn, params, batch = _problem()
  return _models.empirical_run(_kfac(loss_fn, params, batch), loss_fn, params, batch, STEPS)


def test_pmap_equals_one_device_on_the_whole_batch_over_several_steps(x64):
  loss_fn, params, batch = _problem()
  n = jax.local_device_count()
  sharded = _split(batch, n)
  tx = _kfac(loss_fn, params, jax.tree_util.tree_map(lambda x: x[0], sharded), axis_name="data")

  def step(params, state, b):
    _, grads, stats = kfac_jax.value_and_grad(
      registration=kfac_jax.Registration(
        loss_fn, params, batch, estimation_mode="empirical", check_loss=False
      )
    )(params, b)
    grads = jax.lax.pmean(grads, "data")
    updates, state = tx.update(grads, state, params, curvature_stats=stats)
    return optax.apply_updates(params, updates), state

  pstep = jax.pmap(step, axis_name="data")
  p, s = jax.tree_util.tree_map(
    lambda x: jnp.broadcast_to(x, (n,) + x.shape), (params, tx.init(params))
  )
  for _ in range(STEPS):
    p, s = pstep(p, s, sharded)
  want_p, want_s = _one_device_run()
  _assert_close(jax.tree_util.tree_map(lambda x: x[0], (p, s)), (want_p, want_s))
  for leaf in jax.tree_util.tree_leaves((p, s)):  # Every replica holds the same numbers.
    np.testing.assert_array_equal(np.asarray(leaf)[0], np.asarray(leaf)[-1])


def _mesh():
  # Auto axes: XLA propagates the batch sharding and inserts the reductions (explicit axes and
  # tensor-parallel kernels: tests/suites/test_meshes.py).
  return jax.make_mesh((jax.device_count(),), ("data",), axis_types=(AxisType.Auto,))


def test_shard_map_equals_one_device_on_the_whole_batch(x64):
  loss_fn, params, batch = _problem()
  mesh = _mesh()
  n = mesh.size
  local = jax.tree_util.tree_map(lambda x: x[: x.shape[0] // n], batch)
  tx = _kfac(loss_fn, params, local, axis_name="data")

  def step(params, state, b):
    _, grads, stats = kfac_jax.value_and_grad(
      registration=kfac_jax.Registration(
        loss_fn, params, batch, estimation_mode="empirical", check_loss=False
      )
    )(params, b)
    grads = jax.lax.pmean(grads, "data")
    updates, state = tx.update(grads, state, params, curvature_stats=stats)
    return optax.apply_updates(params, updates), state

  state = tx.init(params)
  sstep = jax.jit(
    jax.shard_map(
      step, mesh=mesh, in_specs=(P(), P(), P("data")), out_specs=(P(), P()), check_vma=False
    )
  )
  data = jax.device_put(batch, NamedSharding(mesh, P("data")))
  p = params
  for _ in range(STEPS):
    p, state = sstep(p, state, data)
  _assert_close((p, state), _one_device_run())


def _named_sharding_run(storage):
  assert jax.config.jax_enable_x64
  return _built_named_sharding_run(storage)


@functools.cache  # The replicated run is shared by two tests.
def _built_named_sharding_run(storage):
  """`STEPS` jitted steps on the batch sharded over the mesh, the inverses split over it (with
  `inverse_storage=storage`). Returns the step, its last params and state, and the data."""
  loss_fn, params, batch = _problem()
  mesh = _mesh()
  tx = _kfac(loss_fn, params, batch, inverse_mesh=(mesh, "data"), inverse_storage=storage)

  @jax.jit
  def step(params, state, b):
    _, grads, stats = kfac_jax.value_and_grad(
      registration=kfac_jax.Registration(
        loss_fn, params, batch, estimation_mode="empirical", check_loss=False
      )
    )(params, b)
    updates, state = tx.update(grads, state, params, curvature_stats=stats)
    return optax.apply_updates(params, updates), state

  data = jax.device_put(batch, NamedSharding(mesh, P("data")))
  p, state = jax.device_put(params, NamedSharding(mesh, P())), tx.init(params)
  for _ in range(STEPS):
    p, state = step(p, state, data)
  return step, p, state, data


def test_jit_with_named_sharding_equals_one_device_and_splits_inverses(x64):
  loss_fn, params, batch = _problem()
  step, p, state, data = _named_sharding_run("replicated")
  _assert_close((p, state), _one_device_run())
  # The factorisations are split: each device computes its share, an all-reduce shares them
  # (without `inverse_mesh` the lowered program has no collective: XLA adds only the
  # statistics' reductions later, when it partitions the program).
  assert "all_reduce" in step.lower(p, state, data).as_text()
  plain = _kfac(loss_fn, params, batch)

  @jax.jit
  def plain_step(params, state, b):
    _, grads, stats = kfac_jax.value_and_grad(
      registration=kfac_jax.Registration(
        loss_fn, params, batch, estimation_mode="empirical", check_loss=False
      )
    )(params, b)
    return plain.update(grads, state, params, curvature_stats=stats)

  assert "all_reduce" not in plain_step.lower(p, plain.init(params), data).as_text()


def test_jit_with_named_sharding_and_statistics_fraction_equals_one_device(x64):
  """`statistics_fraction` slices the global batch under jit: every fourth row, exactly as on
  one device (and as one device fed those rows), and without moving rows between devices:
  each device's four rows include one of them, so the compiled step has no more
  cross-device copies than the whole batch's (none; the first quarter of the rows instead,
  which lives on two of the eight devices, compiled to 33 collective-permutes and
  all-gathers)."""
  loss_fn, params, batch = _problem()
  mesh = _mesh()
  frac = _kfac(loss_fn, params, batch, statistics_fraction=0.25)
  whole = _kfac(loss_fn, params, batch)
  quarter = jax.tree_util.tree_map(lambda x: x[::4], batch)

  def make_step(tx):
    @jax.jit
    def step(params, state, b, sb):
      grads = jax.grad(loss_fn)(params, b)
      updates, state = tx.update(grads, state, params, batch=sb)
      return optax.apply_updates(params, updates), state

    return step

  def run(tx, data, stats_batch, p):
    step = make_step(tx)
    state = tx.init(params)
    for _ in range(STEPS):
      p, state = step(p, state, data, stats_batch)
    return p, state

  data = jax.device_put(batch, NamedSharding(mesh, P("data")))
  p0 = jax.device_put(params, NamedSharding(mesh, P()))
  got = run(frac, data, data, p0)
  _assert_close(got, run(frac, batch, batch, params))
  _assert_close(got, run(whole, batch, quarter, params))

  def moves(tx):
    text = make_step(tx).lower(p0, tx.init(params), data, data).compile().as_text()
    return len(re.findall(r"collective-permute|all-gather|all-to-all", text))

  assert moves(frac) <= moves(whole), (moves(frac), moves(whole))


def test_statistics_fraction_picks_the_same_rows_under_shard_map_as_under_jit(x64):
  """Under `shard_map` each device takes its own spaced rows (of its four rows, the first and
  third for f = 0.5); under `jit` the global batch's (every second row). Those are the same
  rows, so both equal one device fed `x[::2]` as its statistics (the jit side is checked
  above; taking the first rows, the shard_map program would use rows 0, 1, 4, 5, ...)."""
  loss_fn, params, batch = _problem()
  mesh = _mesh()
  n = mesh.size
  local = jax.tree_util.tree_map(lambda x: x[: x.shape[0] // n], batch)
  tx = _kfac(loss_fn, params, local, axis_name="data", statistics_fraction=0.5)

  def step(params, state, b):
    grads = jax.lax.pmean(jax.grad(loss_fn)(params, b), "data")
    updates, state = tx.update(grads, state, params, batch=b)
    return optax.apply_updates(params, updates), state

  sstep = jax.jit(
    jax.shard_map(
      step, mesh=mesh, in_specs=(P(), P(), P("data")), out_specs=(P(), P()), check_vma=False
    )
  )
  data = jax.device_put(batch, NamedSharding(mesh, P("data")))
  p, state = params, tx.init(params)
  for _ in range(STEPS):
    p, state = sstep(p, state, data)

  one = _kfac(loss_fn, params, batch)

  @jax.jit
  def ref_step(params, state):
    grads = jax.grad(loss_fn)(params, batch)
    rows = jax.tree_util.tree_map(lambda x: x[::2], batch)
    updates, state = one.update(grads, state, params, batch=rows)
    return optax.apply_updates(params, updates), state

  want_p, want_s = params, one.init(params)
  for _ in range(STEPS):
    want_p, want_s = ref_step(want_p, want_s)
  _assert_close((p, state), (want_p, want_s))


def test_parallel_arguments_are_checked():
  loss_fn, _, batch = _problem()
  mesh = _mesh()
  with pytest.raises(ValueError, match="not both"):
    kfac_jax.scale_by_kfac(
      loss_fn, batch, axis_name="data", config=kfac_jax.Config(mesh=(mesh, "data"))
    )
  with pytest.raises(ValueError, match=r"`config\.mesh` must be a \(jax.sharding.Mesh"):
    kfac_jax.Config(mesh=(mesh, "model"))
  with pytest.raises(ValueError, match=r"`config\.mesh` must be a \(jax.sharding.Mesh"):
    kfac_jax.Config(mesh=mesh)


# -- sharded inverse storage (KAISA's memory-optimised strategy) ---------------------------------


def _pmap_run(loss_fn, params, batch, num_devices, steps, **kw):
  """`steps` pmapped steps on `num_devices` devices; `tx.init` runs inside the pmap too."""
  devices = jax.devices()[:num_devices]
  sharded = _split(batch, num_devices)
  tx = _kfac(
    loss_fn, params, jax.tree_util.tree_map(lambda x: x[0], sharded), axis_name="data", **kw
  )

  def step(params, state, b):
    _, grads, stats = kfac_jax.value_and_grad(
      registration=kfac_jax.Registration(
        loss_fn, params, batch, estimation_mode="empirical", check_loss=False
      )
    )(params, b)
    grads = jax.lax.pmean(grads, "data")
    updates, state = tx.update(grads, state, params, curvature_stats=stats)
    return optax.apply_updates(params, updates), state

  p = jax.tree_util.tree_map(lambda x: jnp.broadcast_to(x, (num_devices,) + x.shape), params)
  s = jax.pmap(tx.init, axis_name="data", devices=devices)(p)
  pstep = jax.pmap(step, axis_name="data", devices=devices)
  for _ in range(steps):
    p, s = pstep(p, s, sharded)
  return tx, p, s


def _storage_run(num_devices, storage):
  assert jax.config.jax_enable_x64
  return _built_storage_run(num_devices, storage)


@functools.cache  # The sharded run on 8 devices is also the checkpoint test's.
def _built_storage_run(num_devices, storage):
  """Params and state after `STEPS` pmapped steps on the 48-row batch with `inverse_storage`."""
  loss_fn, params, batch = _problem(n=48)
  _, p, s = _pmap_run(loss_fn, params, batch, num_devices, STEPS, inverse_storage=storage)
  return p, s


def _kfac_state(opt_state) -> kfac_jax.ScaleByKfacState:
  return opt_state[0]


def _block_state_bytes(est):
  """Each block's factors and cache, in bytes."""
  return [b.state_bytes() for b in est.blocks]


@pytest.mark.parametrize("num_devices", [3, 8])
def test_sharded_storage_equals_replicated_under_pmap(x64, num_devices):
  """4 blocks on 3 devices (not a multiple) and on 8 (idle devices), 7 steps, 3 inverse updates.

  The parameters are the replicated strategy's to round-off (each entry of the summed update
  has one non-zero term; the two programs may fuse and so round differently), every other state
  field equal, and each device's buffer holds the replicated caches of its own blocks.
  """
  loss_fn, params, batch = _problem(n=48)
  p_rep, s_rep = _storage_run(num_devices, "replicated")
  p_sh, s_sh = _storage_run(num_devices, "sharded")
  got = jax.tree_util.tree_leaves_with_path(p_sh)
  for (path, a), b in zip(got, jax.tree_util.tree_leaves(p_rep)):
    np.testing.assert_allclose(
      np.asarray(a), np.asarray(b), rtol=1e-11, atol=1e-14, err_msg=jax.tree_util.keystr(path)
    )
  rep, sh = _kfac_state(s_rep), _kfac_state(s_sh)
  assert isinstance(sh.curvature.cache, kfac_jax.ShardedCache)
  assert isinstance(sh.curvature.factors, kfac_jax.ShardedCache)
  _assert_close(
    (sh.count, sh.curvature.ema_weight, sh.curvature.failed_inverses),
    (rep.count, rep.curvature.ema_weight, rep.curvature.failed_inverses),
  )
  est = kfac_jax.CurvatureEstimator(
    kfac_jax.Registration(loss_fn, params, batch, check_loss=False),
    config=kfac_jax.Config(inverse_storage="sharded"),
  )
  est.init(params, mesh=(_mesh(), "data"))  # Finds the blocks; the mesh only lays them out.
  layouts = est.storage.layouts(num_devices)
  names = [s.name for s in est.layers]
  for field, lay in zip(("factors", "cache"), layouts):
    seen = []
    for d in range(num_devices):
      local = {k: np.asarray(v)[d] for k, v in getattr(sh.curvature, field).buffers.items()}
      for i, got in _parallel.unpack(lay, d, local).items():
        seen.append(i)
        want = getattr(rep.curvature, field)[names[i]]
        assert type(got) is type(want)
        for (path, value), ref in zip(
          jax.tree_util.tree_leaves_with_path(got), jax.tree_util.tree_leaves(want)
        ):
          np.testing.assert_allclose(
            value,
            np.asarray(ref)[d],
            rtol=1e-6,
            atol=1e-9,
            err_msg=f"{field} {names[i]}{jax.tree_util.keystr(path)}",
          )
    assert sorted(seen) == list(range(len(names)))
  per_block = _block_state_bytes(est)
  for dev in range(num_devices):  # The bytes each device actually holds.
    held = sum(
      b.addressable_shards[dev].data.nbytes
      for b in (*sh.curvature.cache.buffers.values(), *sh.curvature.factors.buffers.values())
    )
    assert held <= 1.25 * sum(per_block) / num_devices + max(per_block), (held, per_block)


def test_sharded_storage_under_jit_with_named_sharding_stores_a_share_per_device(x64):
  loss_fn, params, batch = _problem()
  mesh = _mesh()
  _, p_rep, s_rep, _ = _named_sharding_run("replicated")
  _, p_sh, s_sh, _ = _named_sharding_run("sharded")
  _assert_close(p_sh, p_rep)  # (p_rep equals the one-device run: the test above.)
  assert int(_kfac_state(s_sh).curvature.failed_inverses) == 0
  # Memory: each device's share of the factors and caches is at most 1.25 total/D + the
  # largest block's, while with replicated storage every device holds the total.
  est = kfac_jax.CurvatureEstimator(kfac_jax.Registration(loss_fn, params, batch, check_loss=False))
  est.init(params)
  per_block = _block_state_bytes(est)
  total, d = sum(per_block), mesh.size
  sh = _kfac_state(s_sh).curvature
  sh_bytes = _models.device_bytes((sh.factors, sh.cache), mesh)
  rep = _kfac_state(s_rep).curvature
  assert _models.device_bytes((rep.factors, rep.cache), mesh) == [total] * d
  assert max(sh_bytes) <= 1.25 * total / d + max(per_block), (sh_bytes, total, per_block)
  assert max(sh_bytes) < total


def test_sharded_storage_under_shard_map(x64):
  """`init` inside shard_map; the cache's out_spec splits it over the axis."""
  loss_fn, params, batch = _problem()
  mesh = _mesh()
  n = mesh.size
  tx = _kfac(
    loss_fn,
    params,
    jax.tree_util.tree_map(lambda x: x[: x.shape[0] // n], batch),
    axis_name="data",
    inverse_storage="sharded",
  )

  def specs(state):
    return jax.tree_util.tree_map(
      lambda x: P("data") if isinstance(x, kfac_jax.ShardedCache) else P(),
      state,
      is_leaf=lambda x: isinstance(x, kfac_jax.ShardedCache),
    )

  shapes = jax.eval_shape(
    jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False), params
  )
  state = jax.jit(
    jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs(shapes), check_vma=False)
  )(params)

  def step(params, state, b):
    _, grads, stats = kfac_jax.value_and_grad(
      registration=kfac_jax.Registration(
        loss_fn, params, batch, estimation_mode="empirical", check_loss=False
      )
    )(params, b)
    grads = jax.lax.pmean(grads, "data")
    updates, state = tx.update(grads, state, params, curvature_stats=stats)
    return optax.apply_updates(params, updates), state

  sstep = jax.jit(
    jax.shard_map(
      step,
      mesh=mesh,
      in_specs=(P(), specs(shapes), P("data")),
      out_specs=(P(), specs(shapes)),
      check_vma=False,
    )
  )
  data = jax.device_put(batch, NamedSharding(mesh, P("data")))
  p = params
  for _ in range(STEPS):
    p, state = sstep(p, state, data)
  _assert_close(p, _one_device_run()[0])


def test_sharded_storage_keeps_a_non_finite_blocks_previous_cache(x64):
  """A block whose factors are not finite keeps its cache and counts once, on every device."""
  loss_fn, params, batch = _problem()
  est = kfac_jax.CurvatureEstimator(
    kfac_jax.Registration(loss_fn, params, batch, estimation_mode="empirical", check_loss=False)
  )
  sest = kfac_jax.CurvatureEstimator(
    kfac_jax.Registration(loss_fn, params, batch, estimation_mode="empirical", check_loss=False),
    config=kfac_jax.Config(inverse_storage="sharded"),
  )
  grads = jax.grad(loss_fn)(params, batch)
  n = 3

  def poison(e, factors):
    """`layer1`'s A[0, 0] set to NaN (on the device that holds it, with sharded storage)."""
    if isinstance(factors, dict):
      bad = dict(factors)
      bad["layer1"] = jax.tree_util.tree_map(lambda x: x.at[0, 0].set(jnp.nan), bad["layer1"])
      return bad
    lay = e.storage.layouts(n)[0]
    ((d, slot),) = [(d, t) for d in range(n) for t in lay.slots[d] if (t.block, t.leaf) == (1, 0)]
    buf = factors.buffers[slot.dtype]
    mine = jax.lax.axis_index("i") == d
    buf = buf.at[slot.offset].set(jnp.where(mine, jnp.nan, buf[slot.offset]))
    return kfac_jax.ShardedCache({**factors.buffers, slot.dtype: buf})

  def run(e, axis):
    s = e.init(params, **axis)
    s = e.update_curvature(s, params, batch, None, 0.0, **axis)
    s = e.update_inverses(s, 1e-2, **axis)
    bad = poison(e, s.factors)
    s = e.update_inverses(s._replace(factors=bad), 1.0, **axis)
    return s.failed_inverses, e.multiply_matpower(s._replace(factors=bad), grads, -1, **axis)

  failed_r, want = jax.jit(lambda: run(est, {}))()
  failed_s, got = jax.pmap(
    lambda _: run(sest, {"axis_name": "i"}), axis_name="i", devices=jax.devices()[:n]
  )(jnp.zeros(n))
  assert int(failed_r) == 1
  np.testing.assert_array_equal(np.asarray(failed_s), [1] * n)
  _assert_close(jax.tree_util.tree_map(lambda x: x[0], got), want)


def test_sharded_storage_checkpoint_round_trip(x64):
  loss_fn, params, batch = _problem(n=48)
  _, state = _storage_run(8, "sharded")
  restored = kfac_jax.state_from_bytes(state, kfac_jax.state_to_bytes(state))
  for a, b in zip(jax.tree_util.tree_leaves(restored), jax.tree_util.tree_leaves(state)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # The same transform's state on 3 devices (shapes only): a checkpoint from 8 does not fit.
  tx = _kfac(
    loss_fn,
    params,
    jax.tree_util.tree_map(lambda x: x[:16], batch),
    axis_name="data",
    inverse_storage="sharded",
  )
  p3 = jax.tree_util.tree_map(lambda x: jnp.broadcast_to(x, (3,) + x.shape), params)
  other = jax.eval_shape(jax.pmap(tx.init, axis_name="data", devices=jax.devices()[:3]), p3)
  with pytest.raises(ValueError, match="buffers"):
    kfac_jax.check_restored_state(other, state)


def test_sharded_storage_arguments_are_checked():
  loss_fn, params, batch = _problem()
  with pytest.raises(ValueError, match="inverse_storage='sharded'.*axis_name"):
    kfac_jax.scale_by_kfac(loss_fn, batch, config=kfac_jax.Config(inverse_storage="sharded"))
  with pytest.raises(ValueError, match="unknown config.inverse_storage 'kaisa'"):
    kfac_jax.Config(inverse_storage="kaisa")
  tx = kfac_jax.scale_by_kfac(
    loss_fn, batch, axis_name="data", config=kfac_jax.Config(inverse_storage="sharded")
  )
  with pytest.raises(ValueError, match="inside pmap/shard_map over 'data'"):
    tx.init(params)  # Outside the pmap: the axis is not bound.
  est = kfac_jax.CurvatureEstimator(
    kfac_jax.Registration(loss_fn, params, batch, check_loss=False),
    config=kfac_jax.Config(inverse_storage="sharded"),
  )
  with pytest.raises(ValueError, match="`init`: .*pass `axis_name=`"):
    est.init(params)
  state = est.init(params, mesh=(_mesh(), "data"))
  with pytest.raises(ValueError, match="`update_inverses`: .*pass `axis_name=`"):
    est.update_inverses(state, 1e-2)
  with pytest.raises(ValueError, match="`multiply_matpower`: .*pass `axis_name=`"):
    est.multiply_matpower(state, params, -1)
  with pytest.raises(ValueError, match="not both"):
    est.multiply_matpower(state, params, -1, axis_name="data", mesh=(_mesh(), "data"))
  # A state laid out for 8 devices, used on a mesh of 3, or a replicated cache.
  mesh3 = jax.make_mesh((3,), ("data",), axis_types=(AxisType.Auto,), devices=jax.devices()[:3])
  with pytest.raises(ValueError, match="initialised for another number of devices"):
    est.update_inverses(state, 1e-2, mesh=(mesh3, "data"))
  replicated = kfac_jax.CurvatureEstimator(
    kfac_jax.Registration(loss_fn, params, batch, check_loss=False)
  ).init(params)
  with pytest.raises(TypeError, match="not the ShardedCache"):
    est.multiply_matpower(replicated, params, -1, mesh=(_mesh(), "data"))


def test_sharded_storage_orbax_round_trip_keeps_the_sharding(tmp_path, x64):
  ocp = pytest.importorskip("orbax.checkpoint")
  loss_fn, params, batch = _problem()
  mesh = (_mesh(), "data")
  est = kfac_jax.CurvatureEstimator(
    kfac_jax.Registration(loss_fn, params, batch, estimation_mode="empirical", check_loss=False),
    config=kfac_jax.Config(inverse_storage="sharded"),
  )
  # Jitted: eager ops compile one by one.
  state = jax.jit(
    lambda: est.update_inverses(
      est.update_curvature(est.init(params, mesh=mesh), params, batch, None, 0.0, mesh=mesh),
      1e-2,
      mesh=mesh,
    )
  )()
  ckpt = ocp.StandardCheckpointer()
  ckpt.save(tmp_path / "state", state)
  ckpt.wait_until_finished()
  template = jax.eval_shape(lambda: est.init(params, mesh=mesh))
  restored = ckpt.restore(tmp_path / "state", template)
  kfac_jax.check_restored_state(template, restored)
  for a, b in zip(jax.tree_util.tree_leaves(restored), jax.tree_util.tree_leaves(state)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  for buf in (*restored.cache.buffers.values(), *restored.factors.buffers.values()):
    assert buf.sharding.spec == P("data"), buf.sharding
  grads = jax.jit(jax.grad(loss_fn))(params, batch)
  precondition = jax.jit(lambda s: est.multiply_matpower(s, grads, -1, mesh=mesh))
  _assert_close(precondition(restored), precondition(state))


def test_optimizer_with_sharded_storage_equals_replicated_under_pmap(x64):
  """The full optimizer (adaptive damping, model momentum, KL clipping through `multiply`).

  A 3-layer MLP (3 blocks) on 2 devices, to keep the two compilations short.
  """
  loss_fn, _, batch = _problem()
  params = _models.jnp_mlp_init(jax.random.key(0), (6, 5, 4, 3), jnp.float64)
  n = 2
  devices = jax.devices()[:n]
  sharded = _split(batch, n)
  local = jax.tree_util.tree_map(lambda x: x[0], sharded)
  p0 = jax.tree_util.tree_map(lambda x: jnp.broadcast_to(x, (n,) + x.shape), params)

  def run(storage):
    opt = kfac_jax.Optimizer(
      registration=kfac_jax.Registration(
        loss_fn, params, local, estimation_mode="empirical", check_loss=False
      ),
      learning_rate=0.1,
      norm_constraint=1e-3,
      damping=0.1,
      inverse_every=2,
      axis_name="data",
      config=kfac_jax.Config(damping_adaptation_interval=1, inverse_storage=storage),
    )
    state = jax.pmap(opt.init, axis_name="data", devices=devices)(p0)
    step = jax.pmap(lambda p, s, b: opt.step(p, s, b)[:2], axis_name="data", devices=devices)
    p = p0
    for _ in range(4):
      p, state = step(p, state, sharded)
    return p, state

  p_rep, s_rep = run("replicated")
  p_sh, s_sh = run("sharded")
  assert isinstance(s_sh.curvature.cache, kfac_jax.ShardedCache)
  _assert_close((p_sh, s_sh.damping, s_sh.velocity), (p_rep, s_rep.damping, s_rep.velocity))
  assert int(s_sh.skipped[0]) == 0 and float(s_sh.damping[0]) != 0.1  # Steps taken, λ adapted.
  with pytest.raises(ValueError, match="inverse_storage='sharded'.*axis_name"):
    kfac_jax.Optimizer(loss_fn, batch, config=kfac_jax.Config(inverse_storage="sharded"))
  with pytest.raises(ValueError, match="config.inverse_storage"):
    kfac_jax.Config(inverse_storage="kaisa")


# -- models with collectives: init outside pmap ----------------------------------------------


@pytest.mark.parametrize("kind", ["kfac", "optimizer"])
def test_init_outside_pmap_for_a_model_with_cross_device_batch_norm(kind):
  """`BatchNorm(axis_name="data")` calls `pmean` over the data axis. `init` (which traces the
  model to find its layers) runs outside pmap, as a user writes it; the pmapped steps then
  train, and every replica agrees."""
  import flax.linen as nn

  class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
      x = nn.Dense(8)(x)
      x = nn.BatchNorm(use_running_average=False, axis_name="data")(x)
      return nn.Dense(3)(jnp.tanh(x))

  net = Net()
  x = jax.random.normal(jax.random.key(0), (64, 5))
  y = jax.random.randint(jax.random.key(1), (64,), 0, 3)
  with_stats = net.init(jax.random.key(2), x[:8])  # (linen's init skips the pmean.)
  params, stats0 = with_stats["params"], with_stats["batch_stats"]

  def loss_fn(params, batch):
    logits, _ = net.apply(
      {"params": params, "batch_stats": stats0}, batch["x"], mutable=["batch_stats"]
    )
    kfac_jax.register_softmax_cross_entropy_loss(logits, batch["y"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

  n = jax.local_device_count()
  sharded = _split({"x": x, "y": y}, n)
  example = jax.tree_util.tree_map(lambda a: a[0], sharded)
  if kind == "kfac":
    tx = kfac_jax.kfac(loss_fn, example, learning_rate=0.1, damping=1e-2, axis_name="data")
  else:
    tx = kfac_jax.Optimizer(loss_fn, example, axis_name="data").as_optax()
  state = tx.init(params)  # Traces the train-mode apply: the axis is bound for that trace.

  def step(params, state, b, rng):
    loss, grads = jax.value_and_grad(loss_fn)(params, b)
    grads = jax.lax.pmean(grads, "data")
    if kind == "kfac":
      _, _, stats = kfac_jax.value_and_grad(loss_fn)(params, b, rng)
      updates, state = tx.update(grads, state, params, curvature_stats=stats)
    else:
      updates, state = tx.update(grads, state, params, batch=b, rng=rng)
    return optax.apply_updates(params, updates), state, jax.lax.pmean(loss, "data")

  pstep = jax.pmap(step, axis_name="data")
  p, s = jax.tree_util.tree_map(lambda a: jnp.broadcast_to(a, (n,) + a.shape), (params, state))
  rngs = jax.random.split(jax.random.key(3), n)
  losses = []
  for _ in range(6):
    p, s, loss = pstep(p, s, sharded, rngs)
    losses.append(float(loss[0]))
  assert np.all(np.isfinite(losses)) and losses[-1] < losses[0], losses
  for leaf in jax.tree_util.tree_leaves(p):
    np.testing.assert_array_equal(np.asarray(leaf)[0], np.asarray(leaf)[-1])
