"""Balance of the refresh and per-device K-FAC state against the number of devices.

Two tables. The first, exact and without running anything, takes the blocks of a 12-layer
decoder Transformer (d = 1024, MLP 4d, biases, wide sides blocked at 1024, a 32,768-token
embedding and LM head) on 8 devices and compares two placements of the refresh work: by bytes
(how `inverse_storage="sharded"` placed the caches before) and by cost
(`kfac_jax._parallel.refresh_assignment`: longest processing time over blocks, same-shape
blocks together, bytes capped), with the busiest device's cost over the mean, and the K-FAC
state bytes per device (float32 factors and one inverse each) when only the caches are sharded
(factors replicated) against factors and caches sharded together.

The second runs the autoencoder's 8 Kronecker blocks: `CurvatureEstimator.update_inverses`
under `pmap` with `axis_name` on 1, 2, 4 and 8 devices, and reports per device count the median
wall time of an inverse update, the busiest device's cost over the mean, and the K-FAC state
bytes per device: replicated storage (every device keeps everything), the caches alone sharded
(factors replicated, shares by bytes), and `inverse_storage="sharded"` now (factors and caches
sharded, shares by cost; read from the arrays a sharded state holds).

On a CPU host the devices are fake (`--xla_force_host_platform_device_count`) and share the
host's cores, so the times are functional only; the shares and bytes are exact.

    python benchmarks/parallel_inverses.py            # sets 8 fake CPU devices if on CPU
    python benchmarks/parallel_inverses.py --memory-only   # the balance and memory, no timing
"""

from __future__ import annotations

import math
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
from kfac_jax.blocks import _blocked  # noqa: E402


def busiest_share(costs, shares) -> float:
  """The busiest device's cost over the mean device's: 1 is perfect balance."""
  loads = [sum(costs[i] for i in s) for s in shares]
  mean = sum(loads) / len(loads)
  return max(loads) / mean if mean else 1.0


def _dense(n_in: int, n_out: int, bias: bool, block: int):
  def side(n, has_bias):
    part = _blocked.partition(n, has_bias, block)
    return (n, n) if part is None else (part[0], part[1], part[1])

  return side(n_in + (1 if bias else 0), bias), side(n_out, False)


def transformer_shapes(layers=12, d=1024, vocab=32768, block=1024):
  """Factor shapes of the Transformer's blocks (embedding first, LM head last)."""
  shapes = [((vocab,), (d, d))]
  for _ in range(layers):
    shapes += [_dense(d, d, True, block)] * 4 + [_dense(d, 4 * d, True, block)]
    shapes += [_dense(4 * d, d, True, block)]
  return shapes + [_dense(d, vocab, False, block)]


def transformer_table(num_devices: int = 8) -> None:
  shapes = transformer_shapes()
  costs = [_parallel.factorisation_cost(f) for f in shapes]
  factor = [4.0 * sum(math.prod(s) for s in f) for f in shapes]  # float32; the inverse alike.
  sizes = [2 * b for b in factor]
  by_bytes = _parallel.assign(factor, num_devices)
  by_cost = _parallel.refresh_assignment(shapes, num_devices, sizes)

  def held(shares, replicated_factors):
    per = [sum(factor[i] for i in s) for s in shares]
    return max(per) + (sum(factor) if replicated_factors else max(per))

  gib = 2.0**30
  print(
    f"12-layer Transformer, d=1024, {len(shapes)} blocks on {num_devices} devices; K-FAC state "
    f"{sum(sizes) / gib:.2f} GiB in all, largest block {max(sizes) / gib:.3f} GiB\n"
  )
  print("| placement | busiest / mean refresh cost | state per device (GiB) |")
  print("|---|---:|---:|")
  rows = (
    ("caches by bytes, factors replicated (before)", by_bytes, True),
    ("factors and caches by cost, bytes capped (now)", by_cost, False),
  )
  for label, shares, rep in rows:
    print(f"| {label} | {busiest_share(costs, shares):.3f} | {held(shares, rep) / gib:.3f} |")
  print()


def main() -> int:
  model = ae.make_model()
  params = ae.init_params(model)
  loss_fn = ae.make_loss_fn(model)
  rng = np.random.default_rng(0)
  batch = jnp.asarray(rng.uniform(size=(1000, 784)).astype(np.float32))
  est = kfac_jax.CurvatureEstimator(kfac_jax.Registration(loss_fn, params, batch))
  state = est.update_curvature(est.init(params), params, batch, jax.random.key(0), 0.0)
  shapes = [b.spec.factor_shapes for b in est.blocks]
  costs = [_parallel.factorisation_cost(f) for f in shapes]
  nbytes = [x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(state)]
  state_bytes = sum(nbytes)
  factor_bytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(state.factors))
  cache_shapes = [b.cache_shapes() for b in est.blocks]
  cache_bytes = [
    sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(c)) for c in cache_shapes
  ]
  sharded = kfac_jax.CurvatureEstimator(
    kfac_jax.Registration(loss_fn, params, batch), config=kfac_jax.Config(inverse_storage="sharded")
  )
  memory_only = "--memory-only" in sys.argv
  print(
    f"jax {jax.__version__}, backend {jax.default_backend()}, {jax.device_count()} devices "
    f"({jax.devices()[0].device_kind})"
  )
  flags = "".join(f" {a}" for a in sys.argv[1:])
  print(f"command: `python {os.path.relpath(__file__, os.getcwd())}{flags}`\n")
  transformer_table(min(8, jax.device_count()))
  print(f"autoencoder, {len(costs)} blocks\n")
  print(
    "| devices | inverse update (ms, median of 5) | busiest / mean cost, by bytes (before) | "
    "busiest / mean cost, by cost (now) | state per device, replicated (MiB) | "
    "caches sharded, factors replicated (MiB) | factors and caches sharded (MiB) |"
  )
  print("|---:|---:|---:|---:|---:|---:|---:|")
  counts = [d for d in (1, 2, 4, 8, 16, 32) if d <= jax.device_count()]
  for d in counts:
    devices = jax.devices()[:d]
    # The sharded state, initialised inside the pmap; the bytes of each device's buffers.
    local = jax.pmap(lambda p: sharded.init(p, axis_name="i"), axis_name="i", devices=devices)(
      jax.tree_util.tree_map(lambda x, d=d: jnp.broadcast_to(x, (d,) + x.shape), params)
    )
    sharded_bytes = max(
      sum(
        b.addressable_shards[k].data.nbytes
        for b in (*local.factors.buffers.values(), *local.cache.buffers.values())
      )
      for k in range(d)
    )
    before = _parallel.packed_layout(cache_shapes, _parallel.assign(cache_bytes, d))  # By bytes.
    old_bytes = factor_bytes + sum(n * np.dtype(t).itemsize for t, n in before.lengths)
    now = sharded.storage.layouts(d)[1].shares
    balance = f"{busiest_share(costs, before.shares):.3f} | {busiest_share(costs, now):.3f}"
    mib = f"{state_bytes / 2**20:.1f} | {old_bytes / 2**20:.1f} | {sharded_bytes / 2**20:.1f}"
    if memory_only:
      print(f"| {d} | - | {balance} | {mib} |")
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
    print(f"| {d} | {1e3 * np.median(times):.1f} | {balance} | {mib} |")
  return 0


if __name__ == "__main__":
  sys.exit(main())
