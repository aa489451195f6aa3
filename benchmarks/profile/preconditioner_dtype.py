"""The preconditioning product with float32 and with bfloat16 inverses (`preconditioner_dtype`).

For a race workload's estimator (statistics of one batch, inverses at λ = 0.1): the median time
of `multiply_inverse` on the gradient with the inverses stored in float32 (the default) and in
bfloat16 (`preconditioner_dtype="bfloat16"`: bfloat16 inputs, float32 accumulation), in
alternating rounds; the bytes of the caches; and how far the bfloat16 product is from the
float32 one (relative Frobenius error per layer, the largest, and the cosine between the two
whole updates). Needs a quiet machine (it measures time). Whether bfloat16 is faster depends
on the hardware's bfloat16 matmuls (the development CPU has AVX512-BF16).

    python benchmarks/profile/preconditioner_dtype.py --workload autoencoder
    python benchmarks/profile/preconditioner_dtype.py --workload cnn --quick --repeats 2  # smoke
"""

from __future__ import annotations

import argparse
import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if _ROOT not in sys.path:
  sys.path.insert(0, _ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import kfac_jax  # noqa: E402
from benchmarks import _harness, race  # noqa: E402

DTYPES = ("float32", "bfloat16")


def _bytes(tree) -> int:
  return sum(x.nbytes for x in jax.tree_util.tree_leaves(tree))


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--workload", default="autoencoder", choices=sorted(race.WORKLOADS))
  p.add_argument("--quick", action="store_true", help="the workload's small model (a smoke test)")
  p.add_argument("--repeats", type=int, default=15)
  p.add_argument("--rounds", type=int, default=2)
  args = p.parse_args(argv)
  mod = race.WORKLOADS[args.workload]
  wl = mod.make_workload(mod.parse_args(["--plot", ""] + (["--quick"] if args.quick else [])))
  batch = jax.tree.map(jnp.asarray, wl.batch_at(0))
  params = wl.params0
  grads = jax.jit(jax.grad(wl.loss_fn))(params, batch)
  print(f"{wl.name}: {wl.description}")
  print(f"jax {jax.__version__} on {jax.devices()[0].platform} ({os.cpu_count()} CPUs)\n")

  runs = {}
  for dtype in DTYPES:
    est = kfac_jax.CurvatureEstimator(
      kfac_jax.Registration(wl.loss_fn, params, batch),
      config=kfac_jax.Config(preconditioner_dtype=None if dtype == "float32" else dtype),
    )
    state = est.init(params)
    fold = jax.jit(lambda s, p, b, k, est=est: est.update_curvature(s, p, b, k, 0.0))
    state = fold(state, params, batch, jax.random.key(0))
    state = jax.jit(lambda s, est=est: est.update_inverses(s, 0.1))(state)
    runs[dtype] = (jax.jit(est.multiply_inverse), state)

  print("| preconditioner_dtype | round | multiply_inverse ms | cache bytes |")
  print("|---|---:|---:|---:|")
  times: dict[str, list[float]] = {d: [] for d in DTYPES}
  for r in range(args.rounds):
    for dtype in DTYPES:
      apply, state = runs[dtype]
      t = _harness.median_ms(apply, state, grads, repeats=args.repeats)
      times[dtype].append(t)
      print(f"| {dtype} | {r + 1} | {t:.2f} | {_bytes(state.cache):,} |")
  ratio = np.median(times["bfloat16"]) / np.median(times["float32"])
  print(f"\nbfloat16 / float32 product time: {ratio:.2f}x")

  ref = runs["float32"][0](runs["float32"][1], grads)
  low = runs["bfloat16"][0](runs["bfloat16"][1], grads)
  errs = [
    float(jnp.linalg.norm(a - b) / jnp.maximum(jnp.linalg.norm(b), 1e-30))
    for a, b in zip(jax.tree_util.tree_leaves(low), jax.tree_util.tree_leaves(ref))
  ]
  flat = lambda t: jnp.concatenate([x.ravel() for x in jax.tree_util.tree_leaves(t)])  # noqa: E731
  cos = float(flat(low) @ flat(ref) / (jnp.linalg.norm(flat(low)) * jnp.linalg.norm(flat(ref))))
  print(
    f"relative error of the bfloat16 product per leaf: median {np.median(errs):.1e}, "
    f"largest {max(errs):.1e}; cosine between the two updates {cos:.6f}"
  )
  return 0


if __name__ == "__main__":
  sys.exit(main())
