"""Does the program that runs keep the model's structure? Memory under remat, compile time of scans.

Two measurements, printed as Markdown tables (not a test; nothing here is timed in the suite):

  memory   temp bytes (`jax.jit(step).lower(...).compile().memory_analysis().temp_size_in_bytes`)
           of one K-FAC step (`kfac_jax.value_and_grad` with statistics + `scale_by_kfac` update)
           against one Adam step (`jax.value_and_grad` + `optax.adam`), on a residual MLP stack
           with and without `jax.checkpoint` around each block. The ratio K-FAC / Adam on the
           remat'd model is the target (issue 13: within 1.3x).
  compile  trace + lower + compile seconds of the same K-FAC step on a stack of L layers applied
           by `lax.scan` over stacked params (L = --layers, default 4 and 32), and on an RNN whose
           kernel is closed over by a scan of T steps (T = --steps, default 64 and 256). The
           tapped evaluation re-emits each scan over parameters as one `lax.scan`; what still
           grows with L and T is the scanner's Python-side matching on the unrolled copy and the
           per-step slicing / stacking of the taps' values.

    python benchmarks/structure.py                       # small sizes, CPU, ~1 minute
    python benchmarks/structure.py --width 512 --batch 256 --layers 4 32 --steps 64 1024
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
import optax

import kfac_jax


def _ce(logits, y):
  kfac_jax.register_softmax_cross_entropy_loss(logits, y)
  return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def _block(layer, h):
  u = jnp.tanh(h @ layer["w1"] + layer["b1"])
  return h + jnp.tanh(u @ layer["w2"] + layer["b2"])


def mlp_stack(depth, width, batch_size, classes=10, remat=False, seq=16):
  """A residual stack over [batch, seq, width] inputs (a Python loop of blocks)."""
  keys = jax.random.split(jax.random.key(0), 2 * depth + 3)
  params = {
    "layers": [
      {
        "w1": jax.random.normal(keys[2 * i], (width, 2 * width)) / width**0.5,
        "b1": jnp.zeros(2 * width),
        "w2": jax.random.normal(keys[2 * i + 1], (2 * width, width)) / (2 * width) ** 0.5,
        "b2": jnp.zeros(width),
      }
      for i in range(depth)
    ],
    "out": jax.random.normal(keys[-1], (width, classes)) / width**0.5,
  }
  batch = {
    "x": jax.random.normal(keys[-2], (batch_size, seq, width)),
    "y": jax.random.randint(keys[-3], (batch_size, seq), 0, classes),
  }
  block = jax.checkpoint(_block) if remat else _block

  def loss_fn(p, b):
    h = b["x"]
    for layer in p["layers"]:
      h = block(layer, h)
    return _ce(h @ p["out"], b["y"])

  return loss_fn, params, batch


def scanned_stack(depth, width, batch_size, classes=10):
  keys = jax.random.split(jax.random.key(0), 4)
  params = {
    "stack": {
      "w": jax.random.normal(keys[0], (depth, width, width)) / width**0.5,
      "b": jnp.zeros((depth, width)),
    },
    "out": jax.random.normal(keys[1], (width, classes)) / width**0.5,
  }
  batch = {
    "x": jax.random.normal(keys[2], (batch_size, width)),
    "y": jax.random.randint(keys[3], (batch_size,), 0, classes),
  }

  def loss_fn(p, b):
    h, _ = jax.lax.scan(lambda h, l: (h + jnp.tanh(h @ l["w"] + l["b"]), None), b["x"], p["stack"])
    return _ce(h @ p["out"], b["y"])

  return loss_fn, params, batch


def rnn(steps, width, batch_size, classes=10):
  keys = jax.random.split(jax.random.key(0), 5)
  params = {
    "w": jax.random.normal(keys[0], (width, width)) / width**0.5,
    "u": jax.random.normal(keys[1], (width, width)) / width**0.5,
    "out": jax.random.normal(keys[2], (width, classes)) / width**0.5,
  }
  batch = {
    "x": jax.random.normal(keys[3], (steps, batch_size, width)),
    "y": jax.random.randint(keys[4], (batch_size,), 0, classes),
  }

  def loss_fn(p, b):
    def cell(h, x):
      return jnp.tanh(h @ p["w"] + x @ p["u"]), None

    h, _ = jax.lax.scan(cell, jnp.zeros_like(b["x"][0]), b["x"])
    return _ce(h @ p["out"], b["y"])

  return loss_fn, params, batch


def kfac_step(loss_fn, params, batch):
  tx = kfac_jax.scale_by_kfac(loss_fn, batch, damping=1e-3, inverse_every=10)
  state = tx.init(params)

  def step(params, state, batch, rng):
    loss, grads, stats = kfac_jax.value_and_grad(loss_fn)(params, batch, rng)
    updates, state = tx.update(grads, state, params, curvature_stats=stats)
    return loss, optax.apply_updates(params, updates), state

  return step, (params, state, batch, jax.random.key(0))


def adam_step(loss_fn, params, batch):
  tx = optax.adam(1e-3)
  state = tx.init(params)

  def step(params, state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    updates, state = tx.update(grads, state, params)
    return loss, optax.apply_updates(params, updates), state

  return step, (params, state, batch)


def temp_bytes(step, args) -> int:
  return jax.jit(step).lower(*args).compile().memory_analysis().temp_size_in_bytes


def compile_seconds(step, args) -> float:
  start = time.perf_counter()
  jax.jit(step).lower(*args).compile()
  return time.perf_counter() - start


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--width", type=int, default=128)
  parser.add_argument("--batch", type=int, default=32)
  parser.add_argument("--depth", type=int, default=8, help="blocks of the memory model")
  parser.add_argument("--layers", type=int, nargs="+", default=[4, 32])
  parser.add_argument("--steps", type=int, nargs="+", default=[64, 256])
  parser.add_argument("--skip-compile", action="store_true")
  args = parser.parse_args(argv)
  print(f"backend: {jax.default_backend()}, width {args.width}, batch {args.batch}\n")

  print("| model | Adam temp | K-FAC temp | K-FAC / Adam |")
  print("|---|---|---|---|")
  for remat in (False, True):
    made = mlp_stack(args.depth, args.width, args.batch, remat=remat)
    adam = temp_bytes(*adam_step(*made))
    kfac = temp_bytes(*kfac_step(*made))
    name = f"{args.depth}-block residual MLP" + (", jax.checkpoint per block" if remat else "")
    print(f"| {name} | {adam / 2**20:.2f} MiB | {kfac / 2**20:.2f} MiB | {kfac / adam:.2f}x |")
  if args.skip_compile:
    return
  print("\n| model | size | trace + compile (s) | vs smallest |")
  print("|---|---|---|---|")
  for name, build, sizes in (
    ("lax.scan over stacked layers", scanned_stack, args.layers),
    ("RNN, kernel closed over by the scan", rnn, args.steps),
  ):
    base = None
    for size in sizes:
      secs = compile_seconds(*kfac_step(*build(size, args.width, args.batch)))
      base = base or secs
      print(f"| {name} | {size} | {secs:.2f} | {secs / base:.2f}x |")


if __name__ == "__main__":
  main()
