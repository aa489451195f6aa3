"""Loss after a fixed number of K-FAC steps for several `LayerConfig.block_size` values.

Two workloads, every block size from the same initial parameters and batches:

  mlp          a Transformer MLP block d → 4d → d (GELU, biases) at d = `--width` (1024), a
               student fitting a random teacher block of the same shape on Gaussian inputs
               (batch `--batch` rows, squared error);
  autoencoder  the race's autoencoder (`benchmarks/autoencoder.py`, Fashion-MNIST, batch 1000),
               whose 1000- and 785-wide sides are blocked below 1000;
  cnn          the race's CNN (`benchmarks/cnn.py`, batch 256), whose classifier's 1569-wide
               input side is blocked below 1568.

`kfac` runs with its defaults and the race's learning rate (1.0 autoencoder, 0.3 CNN); "full"
is `block_size=None`. Output: one markdown row per (workload, block size) with the first and
the final training loss, the final loss relative to the full factors', the state's bytes
against the parameters' and the median ms per step.

    python benchmarks/block_size.py --steps 30 --sizes 256,512,1024,full
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import kfac_jax  # noqa: E402


def _mlp(width: int, batch: int, seed: int = 0):
  d, h = width, 4 * width
  k = jax.random.split(jax.random.key(seed), 8)

  def init(k1, k2):
    return {
      "w1": jax.random.normal(k1, (d, h)) / math.sqrt(d),
      "b1": jnp.zeros((h,)),
      "w2": jax.random.normal(k2, (h, d)) / math.sqrt(h),
      "b2": jnp.zeros((d,)),
    }

  def apply(p, x):
    return jax.nn.gelu(x @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]

  teacher, params0 = init(k[0], k[1]), init(k[2], k[3])

  def loss_fn(p, b):
    out = apply(p, b["x"])
    kfac_jax.register_squared_error_loss(out, b["y"])
    return 0.5 * jnp.mean(jnp.sum((out - b["y"]) ** 2, -1))

  def batch_at(t):
    x = jax.random.normal(jax.random.fold_in(k[4], t), (batch, d))
    return {"x": x, "y": apply(teacher, x)}

  return loss_fn, params0, batch_at, 1.0


def _race(name: str, steps: int):
  """The race's workload `name` (its module in `benchmarks/`) and learning rate."""
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  module = __import__(name)
  wl = module.make_workload(module.parse_args(["--steps", str(steps), "--warmup", "0"]))
  return wl.loss_fn, wl.params0, wl.batch_at, {"autoencoder": 1.0, "cnn": 0.3}[name]


def _nbytes(tree) -> int:
  return sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree_util.tree_leaves(tree))


def run(loss_fn, params0, batch_at, lr, block_size, steps):
  layers = kfac_jax.LayerConfig(block_size=block_size)
  tx = kfac_jax.kfac(
    registration=kfac_jax.Registration(loss_fn, params0, batch_at(0), layers=layers),
    learning_rate=lr,
  )
  state = tx.init(params0)
  ratio = _nbytes(state) / _nbytes(params0)

  @jax.jit
  def step(params, state, batch, rng):
    loss, grads, stats = kfac_jax.value_and_grad(loss_fn)(params, batch, rng)
    updates, state = tx.update(grads, state, params, curvature_stats=stats)
    return optax.apply_updates(params, updates), state, loss

  params, losses, times = params0, [], []
  for t in range(steps):
    batch = batch_at(t)
    start = time.perf_counter()
    params, state, loss = step(params, state, batch, jax.random.key(t))
    losses.append(float(loss))
    times.append(time.perf_counter() - start)
  # The mean of the last 5 steps' losses: less noisy than the last one.
  return losses[0], float(np.mean(losses[-5:])), ratio, 1e3 * float(np.median(times[1:]))


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--workloads", default="mlp,autoencoder,cnn")
  p.add_argument("--sizes", default="256,512,1024,full")
  p.add_argument("--steps", type=int, default=30)
  p.add_argument("--width", type=int, default=1024)
  p.add_argument("--batch", type=int, default=256)
  args = p.parse_args(argv)
  sizes = [None if s == "full" else int(s) for s in args.sizes.split(",")]
  print(
    "| workload | block size | first loss | loss (mean of last 5) | / full | state / params "
    "| ms/step |"
  )
  print("|---|---|---|---|---|---|---|")
  for name in args.workloads.split(","):
    wl = _mlp(args.width, args.batch) if name == "mlp" else _race(name, args.steps)
    rows = [(b, *run(*wl, b, args.steps)) for b in sizes]
    ref = next((r[2] for r in rows if r[0] is None), float("nan"))
    label = f"mlp d={args.width}" if name == "mlp" else name
    for b, first, loss, ratio, ms in rows:
      print(
        f"| {label} | {b or 'full'} | {first:.4f} | {loss:.4f} | {loss / ref:.3f} | "
        f"{ratio:.2f}x | {ms:.0f} |",
        flush=True,
      )


if __name__ == "__main__":
  main()
