"""What XLA:CPU's compile time counts: distinct fused kernels, not fusion instructions.

Two chains of `--layers` elementwise blocks, each followed by a matmul (so XLA cannot fuse
across them), compiled from the same lowered program shape: one where every block has the same
shape (its fused kernels are identical computations), one where every block has its own width.
The fusion-instruction count is the same; the compile time follows the distinct kernels. This is
why `kfac`'s compile is bounded by its per-shape work (one EMA, damping, factorisation and
product kernel per distinct factor size), not by the number of layers.

    python benchmarks/profile/compile_distinct.py [--layers 50,150]
"""

import argparse
import time

import jax
import jax.numpy as jnp


def chain(x, ws):
  for w in ws:
    x = jnp.tanh(x * 1.3 + 0.2) * jnp.exp(-x) + jnp.sin(x)
    x = x @ w
  return x


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--layers", default="50,150")
  args = ap.parse_args()
  jax.jit(lambda x: x + 1).lower(1.0).compile()  # Backend start-up out of the way.
  print(f"{'layers':>6s} {'widths':>9s} {'fusions':>8s} {'compile':>9s}")
  for n in [int(v) for v in args.layers.split(",")]:
    for kind in ("same", "distinct"):
      dims = [64 + (i if kind == "distinct" else 0) for i in range(n + 1)]
      x = jnp.ones((32, dims[0]))
      ws = [jnp.ones((dims[i], dims[i + 1])) for i in range(n)]
      jax.clear_caches()
      lowered = jax.jit(chain).lower(x, ws)
      t0 = time.perf_counter()
      compiled = lowered.compile()
      dt = time.perf_counter() - t0
      fusions = compiled.as_text().count(" fusion(")
      print(f"{n:6d} {kind:>9s} {fusions:8d} {dt:8.3f}s", flush=True)


if __name__ == "__main__":
  main()
