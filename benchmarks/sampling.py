"""Benchmark: the sampled Fisher's target draws, per output coordinate, against a softmax.

The "gradients" estimation mode draws one target per example (and position) from the model's
predictive distribution. For the categorical, it times in one process, each the minimum over
`--repeats` calls of the compiled function on `[rows, V]` logits:

  softmax       the softmax alone (the pass the loss gradient needs anyway; the reference);
  gumbel        `jax.random.categorical`: the Gumbel-max trick, one random variate per class;
  cdf_count     one-level inverse CDF: softmax, cumulative sum, `sum(cdf <= u)`;
  cdf_search    one-level inverse CDF with a vmapped `jnp.searchsorted`;
  library       the library's sampler: softmax, `_losses.categorical_inverse_cdf` (two levels);

each returning class indices (the softmax its probabilities), and the multi-Bernoulli and normal
samplers (one uniform / normal variate per coordinate, as their independent coordinates need)
against a sigmoid of the same size.

    python benchmarks/sampling.py                       # V = 32,768, rows 512, 2,048, 8,192
    python benchmarks/sampling.py --rows 512 --vocab 4096
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
  sys.path.insert(0, _ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from benchmarks import _harness  # noqa: E402
from kfac_jax import _losses  # noqa: E402
from kfac_jax._specs import LossSpec  # noqa: E402


def _one_level(p, u, search: bool):
  cdf = jnp.cumsum(p, axis=-1)
  x = u * cdf[..., -1]
  if search:
    i = jax.vmap(lambda c, t: jnp.searchsorted(c, t, side="right"))(cdf, x)
  else:
    i = jnp.sum(cdf <= x[..., None], axis=-1)
  return jnp.minimum(i, p.shape[-1] - 1)


def categorical_variants(rows: int, vocab: int) -> dict:
  """`{name: (function of (rng, logits), label)}` of the categorical samplers compared."""

  def uniform(rng, z):
    return jax.random.uniform(rng, z.shape[:-1], z.dtype)

  def library(rng, z):
    u = jax.random.uniform(rng, (1,) + z.shape[:-1] + (2,), z.dtype)
    return _losses.categorical_inverse_cdf(jax.nn.softmax(z, axis=-1), u)[0]

  return {
    "softmax": lambda rng, z: jax.nn.softmax(z, axis=-1),
    "gumbel": lambda rng, z: jax.random.categorical(rng, z, axis=-1),
    "cdf_count": lambda rng, z: _one_level(jax.nn.softmax(z, axis=-1), uniform(rng, z), False),
    "cdf_search": lambda rng, z: _one_level(jax.nn.softmax(z, axis=-1), uniform(rng, z), True),
    "library": library,
  }


CATEGORICAL = ("gumbel", "cdf_count", "cdf_search", "library")


def elementwise_variants(rows: int, vocab: int) -> dict:
  shape = (rows, vocab)
  bern = LossSpec("bernoulli", 0.5, False, False, rows, shape)
  normal = LossSpec("normal", 0.5, False, False, rows, shape)
  return {
    "sigmoid": lambda rng, z: jax.nn.sigmoid(z),
    "bernoulli": lambda rng, z: _losses._sample(bern, z, rng, 1),
    "normal": lambda rng, z: _losses._sample(normal, z, rng, 1),
  }


def best_seconds(fn, rng, z, repeats: int) -> float:
  compiled = jax.jit(fn).lower(rng, z).compile()
  jax.block_until_ready(compiled(rng, z))
  best = math.inf
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(compiled(rng, z))
    best = min(best, time.perf_counter() - t0)
  return best


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--vocab", type=int, default=32768)
  p.add_argument("--rows", type=lambda s: [int(x) for x in s.split(",")], default=[512, 2048, 8192])
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument("--json", default=None)
  return p.parse_args(argv)


def main(argv=None) -> int:
  args = parse_args(argv)
  print(f"{_harness.command_line(__file__, argv)}\njax {jax.__version__}, {os.cpu_count()} CPUs")
  print("| rows | sampler | ms | ns per logit | / softmax (sigmoid) | / gumbel |")
  print("|---:|---|---:|---:|---:|---:|")
  out = []
  rng = jax.random.key(0)
  for rows in args.rows:
    z = 3.0 * jax.random.normal(jax.random.key(1), (rows, args.vocab), jnp.float32)
    t = {}
    for group in (categorical_variants, elementwise_variants):
      ref = None
      for name, fn in group(rows, args.vocab).items():
        t[name] = best_seconds(fn, rng, z, args.repeats)
        ref = ref or t[name]
        gumbel = f"{t[name] / t['gumbel']:.2f}" if "gumbel" in t and name in CATEGORICAL else ""
        print(
          f"| {rows:,} | {name} | {1e3 * t[name]:.1f} | {1e9 * t[name] / z.size:.1f} | "
          f"{t[name] / ref:.2f} | {gumbel} |",
          flush=True,
        )
    out.append({"rows": rows, "vocab": args.vocab, "seconds": t})
  if args.json:
    with open(args.json, "w") as f:
      json.dump(out, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
