"""The step of a ViT whose blocks are stacked by `nn.scan` (params with a leading layer axis):
`kfac_jax.kfac` (defaults, `curvature_stats` from `kfac_jax.value_and_grad`) against Adam.

The 28x28 image is cut into 7x7 patches (16 tokens), embedded by a dense layer with a learned
positional table, then `--layers` pre-LayerNorm blocks (Flax `MultiHeadDotProductAttention`, a
GELU MLP of width 2d) run by one `nn.scan`, mean pooling and a dense classifier; random images
and labels (the step's cost does not depend on the data). Both steps are compiled ahead of time;
then `--rounds` rounds each time `--steps` steps of Adam and of K-FAC, one after the other, and
the median over rounds of the mean step is printed (K-FAC's mean covers its statistics and
inverse refreshes when `--steps` is a multiple of 5). `KFAC_JAX_ROOT=DIR` imports kfac_jax from
another checkout, to time two versions in alternating processes.

    python benchmarks/vit_scan.py
    KFAC_JAX_ROOT=/path/to/other/checkout python benchmarks/vit_scan.py
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

_ROOT = os.environ.get("KFAC_JAX_ROOT") or os.path.dirname(
  os.path.dirname(os.path.abspath(__file__))
)
if _ROOT not in sys.path:
  sys.path.insert(0, _ROOT)

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import optax  # noqa: E402

import kfac_jax  # noqa: E402
from benchmarks.families import patch_tokens  # noqa: E402


class Block(nn.Module):
  heads: int

  @nn.compact
  def __call__(self, x, _):
    x = x + nn.MultiHeadDotProductAttention(self.heads)(nn.LayerNorm()(x))
    y = nn.gelu(nn.Dense(2 * x.shape[-1])(nn.LayerNorm()(x)))
    return x + nn.Dense(x.shape[-1])(y), None


class ScannedViT(nn.Module):
  width: int
  layers: int
  heads: int
  classes: int = 10

  @nn.compact
  def __call__(self, x):
    tokens = patch_tokens(self, x, self.width)
    blocks = nn.scan(
      Block, variable_axes={"params": 0}, split_rngs={"params": True}, length=self.layers
    )
    tokens, _ = blocks(self.heads, name="blocks")(tokens, None)
    return nn.Dense(self.classes)(nn.LayerNorm()(tokens).mean(axis=1))


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--width", type=int, default=64)
  p.add_argument("--layers", type=int, default=4)
  p.add_argument("--heads", type=int, default=4)
  p.add_argument("--batch-size", type=int, default=256)
  p.add_argument("--steps", type=int, default=10, help="steps per round and optimizer")
  p.add_argument("--rounds", type=int, default=5)
  args = p.parse_args(argv)

  model = ScannedViT(args.width, args.layers, args.heads)
  kx, ky, kp = jax.random.split(jax.random.key(0), 3)
  batch = {
    "x": jax.random.uniform(kx, (args.batch_size, 28, 28)),
    "y": jax.random.randint(ky, (args.batch_size,), 0, 10),
  }
  params = model.init(kp, batch["x"][:1])

  def loss_fn(params, batch):
    logits = model.apply(params, batch["x"])
    kfac_jax.register_softmax_cross_entropy_loss(logits, batch["y"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

  adam, kfac = optax.adam(1e-3), kfac_jax.kfac(loss_fn, batch)

  def adam_step(params, state, rng):
    del rng
    grads = jax.grad(loss_fn)(params, batch)
    updates, state = adam.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  def kfac_step(params, state, rng):
    _, grads, stats = kfac_jax.value_and_grad(loss_fn)(params, batch, rng)
    updates, state = kfac.update(grads, state, params, curvature_stats=stats)
    return optax.apply_updates(params, updates), state

  runs = {}
  for name, tx, step in (("adam", adam, adam_step), ("kfac", kfac, kfac_step)):
    state = tx.init(params)
    t = time.perf_counter()
    compiled = jax.jit(step).lower(params, state, jax.random.key(0)).compile()
    runs[name] = [compiled, params, state, time.perf_counter() - t, []]
  for r in range(args.rounds + 1):  # The first round warms up and is not counted.
    for run in runs.values():
      step, p, s = run[:3]
      jax.block_until_ready((p, s))
      t = time.perf_counter()
      for i in range(args.steps):
        p, s = step(p, s, jax.random.key(r * args.steps + i))
      jax.block_until_ready((p, s))
      if r:
        run[4].append((time.perf_counter() - t) / args.steps)
      run[1], run[2] = p, s
  n = sum(x.size for x in jax.tree_util.tree_leaves(params))
  print(
    f"ViT, {args.layers} scanned blocks of width {args.width} ({n:,} parameters), batch "
    f"{args.batch_size}; kfac_jax from {os.path.dirname(kfac_jax.__file__)}"
  )
  ms = {k: 1e3 * statistics.median(v[4]) for k, v in runs.items()}
  for name, run in runs.items():
    each = ", ".join(f"{1e3 * x:.1f}" for x in run[4])
    print(f"{name}: {ms[name]:.1f} ms/step (rounds: {each}); compile {run[3]:.1f} s")
  print(f"kfac / adam: {ms['kfac'] / ms['adam']:.2f}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
