"""Where a `kfac` step's time goes, by phase of its schedule, against Adam's step.

With statistics every `c` and inverses every `i` updates, a `kfac_jax.kfac` step is one of:
a plain step (preconditioning, clipping, momentum on top of Adam's forward and backward
pass), a statistics step (also the sampled pull-back from `batch=` and the factors' Grams),
an inverse step (also the factorisations), or both. This trains a race workload for `--steps`
jitted steps with `kfac`'s defaults (learning rate `--lr`, statistics from `batch=`, as the
race does) and with Adam, times every step (`block_until_ready`), and prints the median step
of each phase, its share of a schedule cycle and its ratio to Adam's median step. Needs a
quiet machine (it measures time).

    python benchmarks/profile/phase_times.py --workload cnn --lr 0.3
"""

from __future__ import annotations

import argparse
import os
import sys
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if _ROOT not in sys.path:
  sys.path.insert(0, _ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from benchmarks import _harness, race  # noqa: E402


def _times(contestant, workload, steps: int, warmup: int) -> np.ndarray:
  params = jax.tree.map(lambda x: jnp.array(x, copy=True), workload.params0)  # Donated below.
  state = contestant.init(params)
  step = jax.jit(contestant.step, donate_argnums=(0, 1))
  rng = jax.random.key(0)
  out = []
  for t in range(warmup + steps):
    batch = jax.tree.map(jax.device_put, workload.batch_at(t))
    rng, sub = jax.random.split(rng)
    jax.block_until_ready((batch, sub))
    start = time.perf_counter()
    params, state, loss = jax.block_until_ready(step(params, state, batch, sub))
    if t >= warmup:
      out.append(time.perf_counter() - start)
  return np.asarray(out)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--workload", required=True, choices=sorted(race.WORKLOADS))
  p.add_argument("--lr", type=float, default=0.3, help="kfac's learning rate")
  p.add_argument("--adam-lr", type=float, default=1e-3)
  p.add_argument("--curvature-every", type=int, default=5)
  p.add_argument("--inverse-every", type=int, default=5)
  p.add_argument("--timed-steps", type=int, default=60)
  p.add_argument(
    "--factor-solve",
    default="auto",
    choices=("auto", "always", "never"),
    help="kfac's factor_solve (how the inverses are kept; compare 'auto' with 'never')",
  )
  p.add_argument(
    "--preconditioner-dtype",
    default=None,
    choices=("bfloat16", "float32"),
    help="kfac's preconditioner_dtype (the dtype of the stored inverses and their products' "
    "inputs; default: float32)",
  )
  args, rest = p.parse_known_args(argv)
  wl = race.WORKLOADS[args.workload].parse_args(list(rest) + ["--plot", ""])
  workload = race.cyclic(race.WORKLOADS[args.workload].make_workload(wl), wl.warmup + wl.steps)
  example = jax.tree.map(jnp.asarray, workload.batch_at(0))
  kfac = _harness.kfac_transform(
    workload.loss_fn,
    example,
    learning_rate=args.lr,
    momentum=0.7,
    damping=0.1,
    ema_decay=0.95,
    inverse_every=args.inverse_every,
    curvature_every=args.curvature_every,
    factor_solve=args.factor_solve,
    preconditioner_dtype=args.preconditioner_dtype,
  )
  adam = _harness.first_order("Adam", "adam", workload.loss_fn, optax.adam(args.adam_lr))
  c, i = args.curvature_every, args.inverse_every
  cycle = int(np.lcm(c, i))
  warmup = cycle  # Updates 0 .. cycle-1 compile and settle; timed steps start at a cycle.
  t_kfac = _times(kfac, workload, args.timed_steps, warmup)
  t_adam = _times(adam, workload, args.timed_steps, warmup)
  adam_ms = 1e3 * float(np.median(t_adam))
  print(f"{workload.name}: {workload.description}")
  print(
    f"kfac lr {args.lr}, momentum 0.7, damping 0.1, max_norm default, factor_solve "
    f"{args.factor_solve!r}, preconditioner_dtype {args.preconditioner_dtype or 'float32'}; "
    f"statistics every {c}, inverses every {i}; {args.timed_steps} timed steps each after {warmup}; jax "
    f"{jax.__version__} on {jax.devices()[0].platform} ({os.cpu_count()} CPUs)\n"
  )
  print(
    "| step kind | updates per cycle | median ms | vs Adam's step | share of the cycle's time |"
  )
  print("|---|---:|---:|---:|---:|")
  counts = np.arange(warmup, warmup + args.timed_steps)
  kinds = {}
  for n, t in zip(counts, t_kfac):
    kinds.setdefault(update_kind(int(n), c, i), []).append(t)
  per_cycle = {k: sum(1 for n in range(cycle) if update_kind(n, c, i) == k) for k in kinds}
  total = sum(per_cycle[k] * np.median(v) for k, v in kinds.items())
  for k, v in sorted(kinds.items(), key=lambda kv: np.median(kv[1])):
    med = 1e3 * float(np.median(v))
    share = per_cycle[k] * float(np.median(v)) / total
    print(f"| {k} | {per_cycle[k]} | {med:.1f} | {med / adam_ms:.2f}x | {share:.0%} |")
  mean_cycle = 1e3 * total / cycle
  print(f"| Adam | | {adam_ms:.1f} | 1.00x | |")
  print(
    f"\nK-FAC's mean step over a cycle: {mean_cycle:.1f} ms = {mean_cycle / adam_ms:.2f}x Adam's"
  )
  return 0


def update_kind(n: int, c: int, i: int) -> str:
  """The work of update `n` (the transform folds statistics when `n % c == 0` and refreshes
  the inverses when `n % i == 0`)."""
  parts = [name for name, every in (("statistics", c), ("inverses", i)) if n % every == 0]
  return " + ".join(parts) or "plain"


if __name__ == "__main__":
  sys.exit(main())
