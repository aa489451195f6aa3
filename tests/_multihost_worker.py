"""One process of a multi-process K-FAC run on localhost (tests/suites/test_multihost.py starts
two).

    python tests/_multihost_worker.py PORT PROCESS_ID NUM_PROCESSES OUT_DIR

The caller sets `XLA_FLAGS=--xla_force_host_platform_device_count=2` (each process's CPU
devices), `JAX_PLATFORMS=cpu` and `PYTHONPATH` (the repository root) in the environment. The
process joins the others through `jax.distributed` (CPU collectives: gloo, JAX's default),
builds one mesh over every process's devices, loads only its own rows of the batch, trains
`STEPS` steps of `kfac_jax.kfac` under `jit` with the data split over the mesh and the inverses
split over it too (each process keeps its devices' share), and writes to OUT_DIR:

  * `params_<PROCESS_ID>.npz`: the trained (replicated) parameters;
  * `checkpoint_<PROCESS_ID>.json`: what `kfac_jax.state_to_bytes` said about the state, and
    whether an orbax-checkpoint round trip of it restored every shard this process holds.

`train` is also what the test runs in one process, on a mesh of as many devices.
"""

import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import kfac_jax

SIZES = (6, 10, 10, 3)
BATCH = 32
STEPS = 4  # Inverse updates at steps 0 and 2.


def problem():
  """An MLP's params and a classification batch, the same in every process (seeded numpy)."""
  rng = np.random.default_rng(0)
  params = {
    f"layer{i}": {"w": rng.normal(size=(a, b)) / np.sqrt(a), "b": np.zeros(b)}
    for i, (a, b) in enumerate(zip(SIZES[:-1], SIZES[1:]))
  }
  batch = {"x": rng.normal(size=(BATCH, SIZES[0])), "y": rng.integers(0, SIZES[-1], BATCH)}
  return params, batch


def loss_fn(params, batch):
  x = batch["x"]
  for i in range(len(SIZES) - 1):
    p = params[f"layer{i}"]
    x = x @ p["w"] + p["b"]
    if i < len(SIZES) - 2:
      x = jnp.tanh(x)
  kfac_jax.register_softmax_cross_entropy_loss(x, batch["y"])
  return optax.softmax_cross_entropy_with_integer_labels(x, batch["y"]).mean()


def process_rows(sharding, n):
  """`slice` of the `n` batch rows that this process's devices hold under `sharding` (what its
  data loader reads)."""
  index = sharding.addressable_devices_indices_map((n,)).values()
  return slice(min(i[0].indices(n)[0] for i in index), max(i[0].indices(n)[1] for i in index))


def train(mesh):
  """`STEPS` jitted K-FAC steps with the batch split over the mesh's "data" axis; returns the
  params and the optimizer state (global arrays)."""
  params, batch = problem()
  replicated, split = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
  rows = process_rows(split, BATCH)
  # Each process passes only its own rows; every process passes the whole (replicated) params.
  data = jax.tree_util.tree_map(
    lambda x: jax.make_array_from_process_local_data(split, x[rows], x.shape), batch
  )
  params = jax.tree_util.tree_map(
    lambda x: jax.make_array_from_process_local_data(replicated, x), params
  )
  example = jax.tree_util.tree_map(lambda x: x[:8], batch)  # Shapes only: any rows do.
  tx = kfac_jax.kfac(
    loss_fn,
    example,
    learning_rate=0.3,
    damping=1e-2,
    inverse_every=2,
    curvature_every=1,
    config=kfac_jax.Config(mesh=(mesh, "data"), inverse_storage="sharded"),
  )

  @jax.jit
  def step(params, state, batch, rng):
    _, grads, stats = kfac_jax.value_and_grad(loss_fn)(params, batch, rng)
    updates, state = tx.update(grads, state, params, curvature_stats=stats)
    return optax.apply_updates(params, updates), state

  state = jax.jit(tx.init)(params)
  rng = jax.random.key(0)
  for i in range(STEPS):
    params, state = step(params, state, data, jax.random.fold_in(rng, i))
  return params, state


def _local_copy(x):
  return np.asarray(x.addressable_data(0))


def _orbax_round_trip(state, path) -> bool:
  """Saves `state` with orbax-checkpoint (every process writes its shards), restores it into
  the same shardings, and compares every shard this process holds."""
  import orbax.checkpoint as ocp

  ckpt = ocp.StandardCheckpointer()
  ckpt.save(path, state)
  ckpt.wait_until_finished()
  template = jax.tree_util.tree_map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state
  )
  restored = ckpt.restore(path, template)
  ok = True
  for a, b in zip(jax.tree_util.tree_leaves(restored), jax.tree_util.tree_leaves(state)):
    ok &= a.sharding == b.sharding
    for sa, sb in zip(a.addressable_shards, b.addressable_shards):
      ok &= sa.index == sb.index and bool(np.array_equal(sa.data, sb.data))
  return ok


def main(port: int, process_id: int, num_processes: int, out_dir: str) -> None:
  jax.config.update("jax_enable_x64", True)
  jax.distributed.initialize(
    coordinator_address=f"127.0.0.1:{port}",
    num_processes=num_processes,
    process_id=process_id,
    initialization_timeout=60,
  )
  try:
    mesh = jax.make_mesh((jax.device_count(),), ("data",), axis_types=(AxisType.Auto,))
    params, state = train(mesh)
    flat = {
      jax.tree_util.keystr(k): _local_copy(v)
      for k, v in jax.tree_util.tree_leaves_with_path(params)
    }
    np.savez(os.path.join(out_dir, f"params_{process_id}.npz"), **flat)
    try:
      kfac_jax.state_to_bytes(state)
      to_bytes = "no error"
    except Exception as e:  # Reported to the test, which checks the message.
      to_bytes = f"{type(e).__name__}: {e}"
    orbax_ok = _orbax_round_trip(state, os.path.join(out_dir, "orbax"))
    with open(os.path.join(out_dir, f"checkpoint_{process_id}.json"), "w") as f:
      json.dump({"state_to_bytes": to_bytes, "orbax_round_trip": orbax_ok}, f)
  finally:
    jax.distributed.shutdown()


if __name__ == "__main__":
  main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
