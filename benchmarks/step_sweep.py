"""Loss after a fixed number of steps for `kfac_jax.kfac` settings (no timing): picks defaults.

The race (`benchmarks/race.py`) compares optimizers at equal wall-clock time, which needs a quiet
machine. This sweep measures only what a step achieves, so it is valid on a busy one: on one of
the race's workloads, every configuration trains `--steps` steps from the same initial
parameters on the same minibatches, and the table lists its evaluation loss (NaN: diverged),
beside Adam over its grid as the reference. A configuration is `lr:momentum:damping:clip`
(`lr` a number or `default`, `kfac`'s own; `clip` is `max_norm`, 0 for none; momentum 0 for
none), optionally followed by `:curvature_every=k`, `:inverse_every=k`, `:conv=<approx>`,
`:dense=<approx>`; the literal `defaults` is `kfac_jax.kfac` with nothing set but
`--default-lr`, if given.

    python benchmarks/step_sweep.py --workload autoencoder --steps 300 \
        --configs 0.2:0.9:30:0,0.3:0.7:0.1:0.01,defaults
"""

from __future__ import annotations

import argparse
import math
import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
  sys.path.insert(0, _ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import kfac_jax  # noqa: E402
from benchmarks import _harness, race  # noqa: E402
from examples import autoencoder as ae  # noqa: E402

WORKLOADS = race.WORKLOADS


def _train(
  loss_fn, tx, params, batch_at, steps: int, kfac: bool, stats_batch=None, from_batch=False
):
  """`steps` jitted steps; the final parameters, or None once the loss is not finite. K-FAC
  steps take their statistics from `kfac_jax.value_and_grad` (the update folds them on due
  steps only), or from `batch=` with `from_batch` (needed by `statistics_fraction`), or with
  `stats_batch=n` from `batch=` with the minibatch's first n examples."""
  if kfac:
    step = jax.jit(
      _harness.kfac_step(
        loss_fn, tx, from_batch=from_batch or stats_batch is not None, stats_batch=stats_batch
      )
    )
  else:
    step = jax.jit(ae.make_adam_step(loss_fn, tx))
  state = tx.init(params)
  rng = jax.random.key(0)
  for t in range(steps):
    rng, key = jax.random.split(rng)
    params, state, loss = step(params, state, jax.tree.map(jnp.asarray, batch_at(t)), key)
    if t % 50 == 49 and not np.isfinite(float(loss)):
      return None
  return params


def _kfac(loss_fn, example, config: str, default_lr: float | None):
  """`(transform, stats_batch, from_batch)` of a configuration (see `race.parse_kfac_config`;
  settings it leaves out are `kfac`'s defaults)."""
  if config == "defaults":
    return kfac_jax.kfac(loss_fn, example, learning_rate=default_lr), None, False
  kwargs = race.parse_kfac_config(config)
  kwargs["momentum"] = kwargs["momentum"] or None
  stats_batch = kwargs.pop("stats_batch", None)
  from_batch = _harness.needs_batch(kwargs, stats_batch)
  tx = kfac_jax.kfac(loss_fn, example, **_harness.with_config(kwargs))
  return tx, stats_batch, from_batch


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--workload", required=True, choices=sorted(WORKLOADS))
  p.add_argument("--steps", type=int, default=300)
  p.add_argument(
    "--configs",
    required=True,
    help="comma-separated lr:momentum:damping:clip[:key=value...] (see race.py "
    "--kfac-configs), or 'defaults'",
  )
  p.add_argument(
    "--default-lr",
    type=float,
    default=None,
    help="the learning rate of the 'defaults' configuration (default: kfac's own)",
  )
  p.add_argument("--adam-lrs", default=None, help="Adam grid (default: the workload's)")
  args, rest = p.parse_known_args(argv)
  wl_args = WORKLOADS[args.workload].parse_args(
    (["--num-images", "5000"] if args.workload == "autoencoder" else [])
    + list(rest)
    + ["--steps", str(args.steps), "--warmup", "0", "--plot", ""]
  )
  workload = WORKLOADS[args.workload].make_workload(wl_args)
  print(f"{workload.name}: {workload.description}", flush=True)
  loss_fn, params0 = workload.loss_fn, workload.params0
  example = jax.tree.map(jnp.asarray, workload.batch_at(0))
  adam_lrs = (
    [float(v) for v in args.adam_lrs.split(",")] if args.adam_lrs else list(wl_args.adam_lr_grid)
  )

  labels = [label for label, _ in workload.extra_evals]

  def evaluate(name, final):
    if final is None:
      row = (name, math.nan, *(math.nan for _ in labels))
    else:
      row = (name, workload.eval_fn(final), *_harness.extra_eval(workload, final).values())
    print(row, flush=True)
    return row

  rows = []
  for lr in adam_lrs:
    final = _train(loss_fn, optax.adam(lr), params0, workload.batch_at, args.steps, kfac=False)
    rows.append(evaluate(f"Adam lr={lr:g}", final))
  for config in args.configs.split(","):
    tx, stats_batch, from_batch = _kfac(loss_fn, example, config.strip(), args.default_lr)
    final = _train(
      loss_fn, tx, params0, workload.batch_at, args.steps, True, stats_batch, from_batch
    )
    rows.append(evaluate(f"kfac {config.strip()}", final))

  print(f"\n{workload.name}, {args.steps} steps; {workload.eval_description}\n")
  print(
    "| optimizer (lr:momentum:damping:max_norm) | eval loss |"
    + "".join(f" {label} |" for label in labels)
    + "\n|---|---:|"
    + "---:|" * len(labels)
  )
  for name, *values in rows:
    print(f"| {name} |" + "".join(f" {v:.4g} |" for v in values))
  return 0


if __name__ == "__main__":
  sys.exit(main())
