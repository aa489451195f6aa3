"""Micro-benchmark: the sample-space natural gradient's rows and direction against N and P.

The model: an MLP `d → h → h → 1` (tanh) with h chosen so the parameter count is near each
`--p`, a squared-error tag on its scalar output ("exact" mode: one row per example, R = N, the
variational Monte Carlo shape of a log ψ). For each (N, P) it reports the bytes of U (R P) and
of K (R², or F = P² where R > P and the solve moves to parameter space), the compiled
program's `memory_analysis()` (argument, output, temporary bytes) where the backend reports
it, and the median time of `kernel.rows` alone and of `rows` + `direction`, each jitted.

    python benchmarks/kernel_scale.py                          # N = 64, 256, 1024; P = 1e3, 1e4
    python benchmarks/kernel_scale.py --n 64,256 --p 1000 --chunk-size 64
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
  sys.path.insert(0, _ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import kfac_jax  # noqa: E402
from benchmarks import _harness  # noqa: E402
from kfac_jax import _compat, kernel  # noqa: E402

D_IN = 8


def width_for(p: int) -> int:
  """h with `h² + (D_IN + 3) h + 1` parameters nearest `p`."""
  b = D_IN + 3
  return max(1, round((-b + math.sqrt(b * b + 4 * (p - 1))) / 2))


def problem(n: int, p: int, dtype):
  h = width_for(p)
  rng = np.random.default_rng(0)
  sizes = (D_IN, h, h, 1)
  params = [
    {
      "w": jnp.asarray(rng.standard_normal((a, b)) / np.sqrt(a), dtype),
      "b": jnp.zeros((b,), dtype),
    }
    for a, b in zip(sizes[:-1], sizes[1:])
  ]
  batch = {
    "x": jnp.asarray(rng.standard_normal((n, D_IN)), dtype),
    "y": jnp.asarray(rng.standard_normal((n, 1)), dtype),
  }

  def loss_fn(params, batch):
    x = batch["x"]
    for i, layer in enumerate(params):
      x = x @ layer["w"] + layer["b"]
      if i < len(params) - 1:
        x = jnp.tanh(x)
    kfac_jax.register_squared_error_loss(x, batch["y"])
    return jnp.mean(jnp.sum((x - batch["y"]) ** 2, axis=1))

  return loss_fn, params, batch


def measure(n: int, p_target: int, chunk_size, repeats: int, dtype) -> dict:
  loss_fn, params, batch = problem(n, p_target, dtype)
  reg = kfac_jax.Registration(loss_fn, params, batch, estimation_mode="exact", warn=False)
  p = sum(x.size for x in jax.tree_util.tree_leaves(params))
  grads = jax.jit(jax.grad(loss_fn))(params, batch)

  rows_fn = jax.jit(lambda params, batch: kernel.rows(reg, params, batch, chunk_size=chunk_size))

  def step(params, batch, grads):
    rows = kernel.rows(reg, params, batch, chunk_size=chunk_size)
    return kernel.direction(rows, grads, None, damping=1e-3)

  step_fn = jax.jit(step)
  compiled = step_fn.lower(params, batch, grads).compile()
  itemsize = jnp.dtype(dtype).itemsize
  r = n
  solve = "sample" if r <= p else "parameter"
  return {
    "N": n,
    "P": p,
    "R": r,
    "space": solve,
    "U_bytes": r * p * itemsize,
    "gram_bytes": (r * r if solve == "sample" else p * p) * max(itemsize, 4),
    "compiled": _harness.compiled_footprint(compiled),
    "rows_ms": _harness.median_ms(rows_fn, params, batch, repeats=repeats),
    "step_ms": _harness.median_ms(compiled, params, batch, grads, repeats=repeats),
  }


def _mib(x) -> str:
  return "n/a" if x is None else f"{x / 2**20:.2f}"


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--n", default="64,256,1024", help="examples per batch (comma-separated)")
  ap.add_argument("--p", default="1000,10000", help="target parameter counts (comma-separated)")
  ap.add_argument("--chunk-size", type=int, default=None, help="examples per chunk of rows")
  ap.add_argument("--repeats", type=int, default=5)
  ap.add_argument("--x64", action="store_true", help="float64 (default float32)")
  ap.add_argument("--json", default=None, help="write the measurements here")
  args = ap.parse_args(argv)
  if args.x64:
    jax.config.update("jax_enable_x64", True)
  dtype = jnp.float64 if args.x64 else jnp.float32
  _compat.one_lapack_thread()  # As the estimator does: scipy's OpenBLAS threads would spin.
  ns = [int(v) for v in args.n.split(",")]
  ps = [int(float(v)) for v in args.p.split(",")]
  out = []
  header = (
    f"{'N':>6} {'P':>7} {'space':>9} {'U MiB':>9} {'K/F MiB':>9} {'arg MiB':>9} "
    f"{'out MiB':>9} {'temp MiB':>9} {'rows ms':>9} {'step ms':>9}"
  )
  print(
    f"jax {jax.__version__}, {jax.devices()[0].platform}, {os.cpu_count()} CPUs, {dtype.__name__}"
  )
  print(header)
  for p in ps:
    for n in ns:
      m = measure(n, p, args.chunk_size, args.repeats, dtype)
      c = m["compiled"] or {}
      print(
        f"{m['N']:>6} {m['P']:>7} {m['space']:>9} {_mib(m['U_bytes']):>9} "
        f"{_mib(m['gram_bytes']):>9} {_mib(c.get('argument')):>9} {_mib(c.get('output')):>9} "
        f"{_mib(c.get('temp')):>9} {m['rows_ms']:>9.2f} {m['step_ms']:>9.2f}",
        flush=True,
      )
      out.append(m)
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"command": " ".join(sys.argv), "measurements": out}, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
