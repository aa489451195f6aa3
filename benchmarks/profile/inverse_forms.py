"""Three ways to invert a symmetric positive-definite factor, timed on the CPU's bucket sizes.

`cho_solve` against the identity (what `blocks/_linalg.spd_inverse` does), `L⁻ᵀ L⁻¹` (one
triangular solve, then a matmul) and `jnp.linalg.inv` (LU), on random well-conditioned
matrices of the autoencoder's factor buckets. Prints the median of `--repeats` jitted calls and
the residual `max |X M − I|`. Needs a quiet machine (it measures time).

    python benchmarks/profile/inverse_forms.py --sizes 1032,832,520
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.scipy import linalg as jsl


def cho_solve_inverse(m):
  chol = jnp.linalg.cholesky(m)
  return jsl.cho_solve((chol, True), jnp.eye(m.shape[0], dtype=m.dtype))


def triangular_inverse(m):
  chol = jnp.linalg.cholesky(m)
  inv_l = jsl.solve_triangular(chol, jnp.eye(m.shape[0], dtype=m.dtype), lower=True)
  return inv_l.T @ inv_l


FORMS = {"cho_solve": cho_solve_inverse, "L^-T L^-1": triangular_inverse, "lu": jnp.linalg.inv}


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--sizes", default="1032,832,520")
  p.add_argument("--repeats", type=int, default=7)
  args = p.parse_args(argv)
  print("| n | form | median ms | max residual |\n|---:|---|---:|---:|")
  for n in (int(s) for s in args.sizes.split(",")):
    r = np.random.RandomState(0).randn(n, 2 * n).astype(np.float32)
    m = jnp.asarray(r @ r.T / n + 0.1 * np.eye(n, dtype=np.float32))
    for name, form in FORMS.items():
      f = jax.jit(form)
      out = f(m).block_until_ready()
      times = []
      for _ in range(args.repeats):
        t = time.perf_counter()
        f(m).block_until_ready()
        times.append(time.perf_counter() - t)
      err = float(jnp.max(jnp.abs(out @ m - jnp.eye(n))))
      print(f"| {n} | {name} | {np.median(times) * 1e3:.1f} | {err:.1e} |")


if __name__ == "__main__":
  main()
