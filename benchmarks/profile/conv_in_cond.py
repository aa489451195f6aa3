"""Convolutions inside `lax.cond` on CPU: the kernel order of a pull-back, timed.

The transforms compute the curvature statistics inside a `lax.cond` on due updates. XLA's CPU
backend runs a convolution whose kernel is read with its output feature axis before its input
feature axis (what JAX's transpose of a convolution in its input produces) through a generic
loop inside a cond or loop body, where it cannot re-lay the kernel out. Part 1 times one 3×3
convolution of the CNN benchmark's shape (256 × 14 × 14 × 16 → 32 channels): forward, its
pull-back to the input (JAX's transpose), the kernel gradient, and the pull-back written against
the swapped kernel, each inside and outside a cond. Part 2 times the CNN's
`CurvatureEstimator.update_curvature` (which pulls back with canonically ordered kernels, see
`kfac_jax._compat.pull_back_convs_canonically`) inside and outside a cond, and the same pass
with JAX's own transposes. Medians of `--repeats` jitted calls; needs a quiet machine.

    python benchmarks/profile/conv_in_cond.py
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
from jax import lax  # noqa: E402

import kfac_jax  # noqa: E402
from benchmarks import _harness  # noqa: E402
from kfac_jax import _curvature  # noqa: E402


def _jit_ms(f, *args, repeats: int) -> float:
  return _harness.median_ms(jax.jit(f), *args, repeats=repeats)


def _row(name, fn, like, args, repeats):
  """`fn(*args)` outside and inside a taken `lax.cond` (the other branch returns zeros)."""
  out = _jit_ms(fn, *args, repeats=repeats)
  inside = _jit_ms(
    lambda flag, *a: lax.cond(flag, lambda: fn(*a), lambda: jnp.zeros(like.shape, like.dtype)),
    jnp.bool_(True),
    *args,
    repeats=repeats,
  )
  print(f"| {name} | {out:.1f} | {inside:.1f} |", flush=True)


def conv_table(repeats: int, batch: int = 256) -> None:
  rng = np.random.RandomState(0)
  x = jnp.asarray(rng.randn(batch, 14, 14, 16).astype(np.float32))
  w = jnp.asarray(rng.randn(3, 3, 16, 32).astype(np.float32))
  ct = jnp.asarray(rng.randn(batch, 14, 14, 32).astype(np.float32))
  dn = ("NHWC", "HWIO", "NHWC")

  def conv(x, w):
    return lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=dn)

  def conv_swapped(x, w):  # The same convolution, the kernel stored (H, W, O, I).
    return lax.conv_general_dilated(
      x, jnp.swapaxes(w, 2, 3), (1, 1), "SAME", dimension_numbers=("NHWC", "HWOI", "NHWC")
    )

  def pull_back(f):
    return lambda x, w, ct: jax.vjp(lambda x: f(x, w), x)[1](ct)[0]

  def kernel_grad(x, w, ct):
    return jax.vjp(lambda w: conv(x, w), w)[1](ct)[0]

  print(f"| one 3×3 convolution, {batch} × 14 × 14 × 16 → 32 | outside a cond (ms) | inside (ms) |")
  print("|---|---:|---:|")
  _row("forward", conv, ct, (x, w), repeats)
  _row("forward, kernel stored (H, W, O, I)", conv_swapped, ct, (x, w), repeats)
  _row("pull-back to the input (JAX's transpose)", pull_back(conv), x, (x, w, ct), repeats)
  _row("pull-back through the swapped kernel", pull_back(conv_swapped), x, (x, w, ct), repeats)
  _row("kernel gradient", kernel_grad, w, (x, w, ct), repeats)


def statistics_table(repeats: int) -> None:
  from benchmarks import cnn

  wl = cnn.make_workload(cnn.parse_args(["--plot", ""]))
  batch = jax.tree.map(jnp.asarray, wl.batch_at(0))
  params = wl.params0
  est = kfac_jax.CurvatureEstimator(kfac_jax.Registration(wl.loss_fn, params, batch))
  state = est.init(params)
  scan = est.scan_batch(params, batch)
  key = jax.random.key(0)

  def canonical(s, p, b, k):
    return est.update_curvature(s, p, b, k, 0.95)

  def jax_transposes(s, p, b, k):
    stats = _curvature.compute(
      scan, p, b, k, estimation_mode="gradients", num_samples=1, with_grads=False
    )[2]
    return est.update_curvature_from_stats(s, stats, 0.95)

  print(f"\n{wl.description}\n")
  print("| `update_curvature` (statistics and fold) | outside a cond (ms) | inside (ms) |")
  print("|---|---:|---:|")
  for name, fn in (
    ("canonical pull-back (the library)", canonical),
    ("JAX's transposes", jax_transposes),
  ):
    out = _jit_ms(fn, state, params, batch, key, repeats=repeats)
    inside = _jit_ms(
      lambda flag, s, p, b, k, fn=fn: lax.cond(flag, lambda: fn(s, p, b, k), lambda: s),
      jnp.bool_(True),
      state,
      params,
      batch,
      key,
      repeats=repeats,
    )
    print(f"| {name} | {out:.1f} | {inside:.1f} |", flush=True)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--repeats", type=int, default=9)
  p.add_argument("--no-workload", action="store_true", help="part 1 only")
  p.add_argument("--batch", type=int, default=256, help="part 1's batch size (the CNN's: 256)")
  args = p.parse_args(argv)
  print(f"jax {jax.__version__} on {jax.devices()[0].platform} ({os.cpu_count()} CPUs)\n")
  conv_table(args.repeats, args.batch)
  if not args.no_workload:
    statistics_table(args.repeats)
  return 0


if __name__ == "__main__":
  sys.exit(main())
