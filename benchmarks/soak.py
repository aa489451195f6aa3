"""Soak test: the autoencoder for many K-FAC steps, checking that nothing ever goes non-finite.

Not part of the test suite (it runs for minutes). Every `--check-every` steps it pulls the loss
and checks every array of the parameters and the optimizer state (factors, inverses, counters,
momentum) for NaN/Inf, and stops with an error at the first one. At the end it prints the loss
curve's milestones, the skipped-batch and failed-factorisation counters, and the wall time.

    python benchmarks/soak.py                        # 10,000 steps, inverses every 10
    python benchmarks/soak.py --steps 500 --batch-size 1000
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
  sys.path.insert(0, _ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from examples import autoencoder as ae  # noqa: E402
from examples import data as data_lib  # noqa: E402


@jax.jit
def _finite_leaves(leaves):
  return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]))


def _all_finite(tree) -> bool:
  leaves = [x for x in jax.tree_util.tree_leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]
  return bool(_finite_leaves(leaves))


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--steps", type=int, default=10_000)
  p.add_argument("--batch-size", type=int, default=256)
  p.add_argument("--inverse-every", type=int, default=10)
  p.add_argument("--check-every", type=int, default=100)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--json", default=None, help="write the results here")
  args = p.parse_args(argv)
  from tqdm.auto import tqdm

  ds = data_lib.load_dataset("fashion_mnist", None)
  images = ds.train_images
  model = ae.make_model(ds.num_features)
  loss_fn = ae.make_loss_fn(model)
  params = ae.init_params(model, args.seed)
  idx = ae.batch_indices(images.shape[0], args.batch_size, args.steps, args.seed)
  tx = ae.make_kfac(loss_fn, jnp.asarray(images[idx[0]]), inverse_every=args.inverse_every)
  state = tx.init(params)
  step = jax.jit(ae.make_kfac_step(loss_fn, tx), donate_argnums=(0, 1))
  rng = jax.random.key(args.seed + 1)
  losses, t0 = [], time.perf_counter()
  for t in tqdm(range(args.steps), desc="soak", mininterval=2.0, file=sys.stderr):
    rng, sub = jax.random.split(rng)
    params, state, loss = step(params, state, jnp.asarray(images[idx[t]]), sub)
    if t % args.check_every == 0 or t == args.steps - 1:
      losses.append((t, float(loss)))
      if not np.isfinite(losses[-1][1]) or not _all_finite((params, state)):
        print(f"FAILED: non-finite loss or state at step {t} (loss {losses[-1][1]})")
        return 1
      if args.json:  # Progress so far, in case the run is cut short.
        with open(args.json, "w") as f:
          json.dump(
            {"completed_steps": t + 1, "losses": losses, "elapsed_s": time.perf_counter() - t0}, f
          )
  wall = time.perf_counter() - t0
  curv = state[0].curvature
  result = {
    "command": "python "
    + " ".join([os.path.relpath(__file__, os.getcwd()), *(sys.argv[1:] if argv is None else argv)]),
    "steps": args.steps,
    "batch_size": args.batch_size,
    "inverse_every": args.inverse_every,
    "dataset": ds.source,
    "wall_s": wall,
    "all_finite": True,
    "skipped_batches": int(curv.skipped_batches),
    "failed_inverses": int(curv.failed_inverses),
    "loss_first": losses[0][1],
    "loss_last": losses[-1][1],
    "loss_min": min(v for _, v in losses),
    "checks": len(losses),
  }
  print(json.dumps(result, indent=2))
  if args.json:
    with open(args.json, "w") as f:
      json.dump({**result, "losses": losses}, f)
  return 0


if __name__ == "__main__":
  sys.exit(main())
