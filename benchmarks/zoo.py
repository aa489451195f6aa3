"""Scan and compile time of one K-FAC step for each model of the zoo (tests/_zoo.py).

For each model, in Flax linen and nnx: "scan" is `Registration(..., check_loss=False)` (tracing
`loss_fn` and matching the layers); "init" is `scale_by_kfac(...).init(params)` (a second scan, the
loss audit's program, and the state's zero factors and identity caches, made by one compiled
program); "compile" is lowering and compiling the jitted step (value_and_grad with
curvature statistics, then the transform's update, inverses included), timed once, cold. The
recurrent and tied-weight models of tests/blocks/test_uses.py follow (a linen LSTM through
`nn.RNN`, an nnx GRU through `nnx.RNN`, linen and nnx LMs whose embedding is also the output
projection): their shared layers are listed with the number of uses. Prints a Markdown table.

    python benchmarks/zoo.py          # from the repository root
"""

from __future__ import annotations

import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402

import kfac_jax  # noqa: E402
from tests import _zoo  # noqa: E402
from tests.blocks import test_uses  # noqa: E402  (the tied-embedding and RNN models)


def _models():
  """(name, flavour, () -> (loss_fn, params, batch)) for every model measured."""
  for name in _zoo.MODELS:
    for flavour in ("linen", "nnx"):
      yield name, flavour, lambda name=name, flavour=flavour: _unpack(_zoo.MODELS[name](flavour))
  for flavour, (make, _) in sorted(test_uses.TIED.items()):
    yield "tied-embedding LM", flavour, make
  for key, (make, _, _) in sorted(test_uses.RNNS.items()):
    flavour, cell = key.split("_")
    yield cell.upper() + " (scan)", flavour, make


def _unpack(z):
  return z.loss_fn, z.params, z.batch


def measure(make) -> dict:
  loss_fn, params, batch = make()
  t0 = time.perf_counter()
  layers = kfac_jax.Registration(loss_fn, params, batch, strict=True, check_loss=False).layers
  scan_s = time.perf_counter() - t0
  t0 = time.perf_counter()
  tx = kfac_jax.scale_by_kfac(
    registration=kfac_jax.Registration(loss_fn, params, batch, strict=True), damping=1e-3
  )
  state = tx.init(params)
  jax.block_until_ready(state)
  init_s = time.perf_counter() - t0

  def step(params, state, batch, rng):
    loss, grads, stats = kfac_jax.value_and_grad(loss_fn)(params, batch, rng)
    updates, state = tx.update(grads, state, params, curvature_stats=stats)
    return loss, updates, state

  t0 = time.perf_counter()
  jax.jit(step).lower(params, state, batch, jax.random.key(0)).compile()
  compile_s = time.perf_counter() - t0
  n_params = sum(math.prod(x.shape) for x in jax.tree_util.tree_leaves(params))
  kinds = sorted({l.kind + (f" x{l.num_uses}" if l.num_uses > 1 else "") for l in layers})
  return {
    "layers": len(layers),
    "params": n_params,
    "kinds": ", ".join(kinds),
    "scan": scan_s,
    "init": init_s,
    "compile": compile_s,
  }


def main() -> None:
  print("| model | flavour | layers | params | kinds | scan (s) | init (s) | compile step (s) |")
  print("|---|---|---:|---:|---|---:|---:|---:|")
  for name, flavour, make in _models():
    r = measure(make)
    print(
      f"| {name} | {flavour} | {r['layers']} | {r['params']} | {r['kinds']} | "
      f"{r['scan']:.2f} | {r['init']:.2f} | {r['compile']:.2f} |",
      flush=True,
    )
  print(f"\njax {jax.__version__}, backend {jax.default_backend()}")


if __name__ == "__main__":
  main()
