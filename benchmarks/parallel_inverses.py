"""Inverse-update time and per-device memory against the number of devices (split inverses).

For the autoencoder's 8 Kronecker blocks, runs `CurvatureEstimator.update_inverses` under `pmap`
with `axis_name` (each device factorises its share of the blocks, balanced by cost) on 1, 2, 4
and 8 devices, and reports per device count: the median wall time of an inverse update, the
balance of the split (the largest device share of the total factorisation cost: 1/D is
perfect), the optimizer-state bytes each device holds with the default, replicated inverse
storage (every device keeps every inverse: the "communication-optimised" strategy), and the
inverse-cache bytes per device of both storages: "replicated" and "sharded" (each device keeps
only its own blocks' inverses, KAISA's "memory-optimised" strategy; read from the arrays a
sharded state actually holds on one device).

On a CPU host the devices are fake (`--xla_force_host_platform_device_count`) and share the
host's cores, so the times are functional only; on a multi-GPU/TPU host they are real.

    python benchmarks/parallel_inverses.py            # sets 8 fake CPU devices if on CPU
    python benchmarks/parallel_inverses.py --memory-only   # the memory columns, no timing
"""

from __future__ import annotations

import os
import sys
import time

if "--no-fake-devices" not in sys.argv:
  os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
  sys.path.insert(0, _ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import kfac_jax  # noqa: E402
from examples import autoencoder as ae  # noqa: E402
from kfac_jax import _parallel  # noqa: E402


def main() -> int:
  model = ae.make_model()
  params = ae.init_params(model)
  loss_fn = ae.make_loss_fn(model)
  rng = np.random.default_rng(0)
  batch = jnp.asarray(rng.uniform(size=(1000, 784)).astype(np.float32))
  est = kfac_jax.CurvatureEstimator(loss_fn, batch)
  state = est.update_curvature(est.init(params), params, batch, jax.random.key(0), 0.0)
  costs = [_parallel.factorisation_cost(b.spec.factor_shapes) for b in est.blocks]
  state_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(state))
  cache_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(state.cache))
  sharded = kfac_jax.CurvatureEstimator(loss_fn, batch, inverse_storage="sharded")
  memory_only = "--memory-only" in sys.argv
  print(
    f"jax {jax.__version__}, backend {jax.default_backend()}, {jax.device_count()} devices "
    f"({jax.devices()[0].device_kind}); {len(costs)} blocks"
  )
  flags = "".join(f" {a}" for a in sys.argv[1:])
  print(f"command: `python {os.path.relpath(__file__, os.getcwd())}{flags}`\n")
  print(
    "| devices | inverse update (ms, median of 5) | largest share of the cost | "
    "state per device, replicated (MiB) | inverses per device, replicated (MiB) | "
    "inverses per device, sharded (MiB) |"
  )
  print("|---:|---:|---:|---:|---:|---:|")
  counts = [d for d in (1, 2, 4, 8, 16, 32) if d <= jax.device_count()]
  for d in counts:
    devices = jax.devices()[:d]
    # The sharded state's cache, initialised inside the pmap; bytes of device 0's buffers.
    local = jax.pmap(
      lambda p: sharded.init(p, axis_name="i").cache, axis_name="i", devices=devices
    )(jax.tree_util.tree_map(lambda x, d=d: jnp.broadcast_to(x, (d,) + x.shape), params))
    sharded_bytes = sum(b[0].nbytes for b in local.buffers.values())
    shares = _parallel.assign(costs, d)
    largest = max(sum(costs[i] for i in s) for s in shares) / sum(costs)
    mib = f"{state_bytes / 2**20:.1f} | {cache_bytes / 2**20:.1f} | {sharded_bytes / 2**20:.1f}"
    if memory_only:
      print(f"| {d} | - | {largest:.3f} | {mib} |")
      continue
    stacked = jax.tree_util.tree_map(lambda x: jnp.broadcast_to(x, (d,) + x.shape), state)
    if d == 1:
      fn = jax.pmap(lambda s: est.update_inverses(s, 1.0), devices=devices)
    else:
      fn = jax.pmap(
        lambda s: est.update_inverses(s, 1.0, axis_name="i"), axis_name="i", devices=devices
      )
    jax.block_until_ready(fn(stacked))
    times = []
    for _ in range(5):
      t0 = time.perf_counter()
      jax.block_until_ready(fn(stacked))
      times.append(time.perf_counter() - t0)
    print(f"| {d} | {1e3 * np.median(times):.1f} | {largest:.3f} | {mib} |")
  return 0


if __name__ == "__main__":
  sys.exit(main())
