"""A dense kernel read with an input that has no rows per example: its block against the exact
Fisher (float64).

The model projects learned latents `tanh(lat) [M, D]` by a kernel `a [D, D]` before any batch
input meets them, then attends from each example's `x [L, D]` to the projected latents (a
Perceiver-style query written so). The kernel's input rows are the M latents, not examples, and
the projection's output gradient is the batch's sum. For each treatment of `a` the script
averages the block over `--draws` curvature estimates ("gradients" mode, `--samples` sampled
targets each) and compares it with the exact Fisher block `(1/N) Σ_n J_nᵀ F_n J_n` of the
softmax cross-entropy, from `jax.jacobian`:

- automatic: what the scanner now does (a generic fallback, "diagonal" by default);
- generic, full: `register_generic(a, "full")`;
- dense, kron / dense, full: `register_dense` on the latents, the layer block the scanner used to
  build for such a kernel (M = N rows here, so "full" can group the rows into "examples").

    python benchmarks/profile/batchless_layers.py [--batch 4] [--draws 40] [--samples 64]
"""

import argparse
import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import jax
import jax.numpy as jnp
import optax

import kfac_jax


def main():
  jax.config.update("jax_enable_x64", True)
  warnings.simplefilter("ignore", kfac_jax.UncoveredParametersWarning)  # `a` and `lat` are generic.
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--batch", type=int, default=4)
  ap.add_argument("--draws", type=int, default=40)
  ap.add_argument("--samples", type=int, default=64)
  args = ap.parse_args()
  n, seq, d, classes = args.batch, 6, 3, 3
  m = n  # As many latents as examples, so that every treatment can run.
  k = jax.random.split(jax.random.key(0), 5)
  params = {
    "a": jax.random.normal(k[0], (d, d), jnp.float64) * 0.5,
    "head": jax.random.normal(k[1], (d, classes), jnp.float64),
    "lat": jax.random.normal(k[2], (m, d), jnp.float64),
  }
  batch = {
    "x": jax.random.normal(k[3], (n, seq, d), jnp.float64),
    "y": jax.random.randint(k[4], (n,), 0, classes),
  }

  def logits_fn(p, b, treatment="automatic"):
    lat = jnp.tanh(kfac_jax.register_generic(p["lat"]) if treatment != "automatic" else p["lat"])
    q = lat @ p["a"]
    if treatment.startswith("dense"):
      q = kfac_jax.register_dense(q, lat, p["a"], approx=treatment.split(", ")[1])
    elif treatment == "generic, full":
      q = lat @ kfac_jax.register_generic(p["a"], approx="full")
    att = jax.nn.softmax(jnp.einsum("md,nld->nml", q, b["x"]), -1)
    o = jnp.einsum("nml,nld->nd", att, b["x"])
    return o @ p["head"]

  flat, unravel = jax.flatten_util.ravel_pytree(params["a"])
  jac = jax.jacobian(lambda f: logits_fn(dict(params, a=unravel(f)), batch))(flat)
  prob = jax.nn.softmax(logits_fn(params, batch))
  fz = jax.vmap(jnp.diag)(prob) - prob[:, :, None] * prob[:, None, :]
  exact = jnp.einsum("nci,ncd,ndj->ij", jac, fz, jac) / n
  size = flat.size
  print(f"batch {n}, {m} latents, {args.draws} draws x {args.samples} samples")
  print(f"{'treatment of a':16s} {'block':>10s}  trace / exact's  |mean - exact| / |exact|")
  print(f"{'exact Fisher':16s} {'':>10s}  {1.0:15.3f}")
  for treatment in ("automatic", "generic, full", "dense, kron", "dense, full"):

    def loss_fn(p, b, treatment=treatment):
      logits = logits_fn(p, b, treatment)
      kfac_jax.register_softmax_cross_entropy_loss(logits, b["y"])
      return optax.softmax_cross_entropy_with_integer_labels(logits, b["y"]).mean()

    est = kfac_jax.CurvatureEstimator(
      kfac_jax.Registration(loss_fn, params, batch, num_samples=args.samples)
    )
    layers = kfac_jax.Registration(loss_fn, params, batch).layers
    kind = next(f"{s.kind}/{s.approx}" for s in layers if s.param_paths == ("a",))
    state0 = est.init(params)
    order = [s.param_paths for s in est.layers]
    start = sum(params[q].size for paths in order[: order.index(("a",))] for q in paths)

    @jax.jit
    def block(key, est=est, state0=state0, start=start):
      state = est.update_curvature(state0, params, batch, key, ema_decay=0.0)
      return est.to_dense(state)[start : start + size, start : start + size]

    mean = sum(block(jax.random.key(r)) for r in range(args.draws)) / args.draws
    ratio = float(jnp.trace(mean) / jnp.trace(exact))
    err = float(jnp.linalg.norm(mean - exact) / jnp.linalg.norm(exact))
    print(f"{treatment:16s} {kind:>10s}  {ratio:15.3f}  {err:8.3f}")


if __name__ == "__main__":
  main()
