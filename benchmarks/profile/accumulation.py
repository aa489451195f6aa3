"""Gradient accumulation with K-FAC: `optax.MultiSteps(kfac)` against accumulating in the step.

`optax.MultiSteps(tx, k)` calls `tx.update` on every micro-batch (with the gradients
accumulated so far) and keeps the new state only on the k-th, through an elementwise
`jnp.where` over the whole inner state. For `kfac` that means a K-FAC update, and on due
updates its statistics and inverse refresh, on every micro-batch, k - 1 of them thrown away,
and a select over every factor and inverse. The alternative is to accumulate in the step: a
`lax.scan` over the k micro-batches sums the gradients, and one `kfac` update follows, with its
statistics (when due) from the last micro-batch, which is what `MultiSteps(kfac)` folds too
(`tests/suites/test_contract.py` checks that the two agree). This script times both on a race
workload, with Adam in `MultiSteps` as the baseline, and prints the time per micro-batch
(median over `--periods` accumulation periods, each charged in full). Needs a quiet machine.

    OPENBLAS_NUM_THREADS=1 python benchmarks/profile/accumulation.py --workload autoencoder --lr 1 --micro 4
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

import kfac_jax  # noqa: E402
from benchmarks import race  # noqa: E402


def _micro(batch, k: int):
  """`batch` split along every leaf's leading axis into k micro-batches: `[k, N/k, ...]`."""
  return jax.tree.map(lambda x: x.reshape((k, x.shape[0] // k) + x.shape[1:]), batch)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--workload", required=True, choices=sorted(race.WORKLOADS))
  p.add_argument("--lr", type=float, default=1.0, help="kfac's learning rate")
  p.add_argument("--adam-lr", type=float, default=1e-3)
  p.add_argument("--micro", type=int, default=4, help="micro-batches per update (k)")
  p.add_argument("--periods", type=int, default=20, help="timed accumulation periods")
  args, rest = p.parse_known_args(argv)
  wl = race.WORKLOADS[args.workload].parse_args(["--plot", ""] + rest)
  workload = race.cyclic(race.WORKLOADS[args.workload].make_workload(wl), 10)
  loss_fn, k = workload.loss_fn, args.micro
  full = jax.tree.map(jnp.asarray, workload.batch_at(0))
  example = jax.tree.map(lambda x: x[0], _micro(full, k))
  kfac = kfac_jax.kfac(loss_fn, example, learning_rate=args.lr)
  grad = jax.value_and_grad(loss_fn)

  def multisteps(tx):
    ms = optax.MultiSteps(tx, every_k_schedule=k)

    def period(params, state, micro, rng):  # k calls, each its own jitted micro-step
      for m in range(k):
        b = jax.tree.map(lambda x, m=m: x[m], micro)
        params, state = one(params, state, b, jax.random.fold_in(rng, m))
      return params, state

    @jax.jit
    def one(params, state, b, rng):
      _, g = grad(params, b)
      u, state = ms.update(g, state, params, batch=b, rng=rng)
      return optax.apply_updates(params, u), state

    return ms.init, period

  def in_step(tx):
    tx = optax.with_extra_args_support(tx)

    @jax.jit
    def period(params, state, micro, rng):
      def body(acc, b):
        return jax.tree.map(jnp.add, acc, grad(params, b)[1]), None

      zeros = jax.tree.map(jnp.zeros_like, params)
      acc, _ = jax.lax.scan(body, zeros, micro)
      g = jax.tree.map(lambda a: a / k, acc)
      last = jax.tree.map(lambda x: x[-1], micro)
      # The last micro-batch's key, as MultiSteps' update that counts passes it.
      u, state = tx.update(g, state, params, batch=last, rng=jax.random.fold_in(rng, k - 1))
      return optax.apply_updates(params, u), state

    return tx.init, period

  rows = [
    ("Adam in MultiSteps", *multisteps(optax.adam(args.adam_lr))),
    ("Adam, accumulated in the step", *in_step(optax.adam(args.adam_lr))),
    ("kfac in MultiSteps", *multisteps(kfac)),
    ("kfac, accumulated in the step", *in_step(kfac)),
  ]
  print(f"{args.workload}: {k} micro-batches of {jax.tree.leaves(example)[0].shape[0]} rows")
  for name, init, period in rows:
    params = workload.params0
    state = init(params)
    times = []
    for t in range(args.periods + 2):
      micro = _micro(jax.tree.map(jnp.asarray, workload.batch_at(t)), k)
      jax.block_until_ready(micro)
      start = time.perf_counter()
      params, state = jax.block_until_ready(period(params, state, micro, jax.random.key(t)))
      if t >= 2:
        times.append(time.perf_counter() - start)
    loss = float(loss_fn(params, full))
    print(
      f"{name:32s} {1e3 * np.median(times) / k:7.1f} ms per micro-batch   "
      f"loss after {args.periods + 2} updates {loss:.3f}",
      flush=True,
    )
  return 0


if __name__ == "__main__":
  sys.exit(main())
