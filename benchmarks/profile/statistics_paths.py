"""Where the statistics of `curvature_every > 1` cost: the ways of feeding `kfac`.

    python benchmarks/profile/statistics_paths.py cnn          # or transformer, autoencoder

Part 1 times one call of `jax.value_and_grad` and of `kfac_jax.value_and_grad` (loss,
gradient and statistics). Part 2 times whole jitted, donating K-FAC steps (`kfac`, learning
rate 0.3, inverses every 10) over 50 steps after 10 of warm-up: statistics every step; every 5
steps with the statistics from `value_and_grad` on every call ("ungated"), or computed by the
update from `batch=` on due steps only. Needs a quiet machine; results in RESULTS.md,
"Statistics every 5 steps by default". (The "gated" rows there, `value_and_grad(...,
opt_state=)`, were measured with this script at commit 15b9ba4, which had that option.)
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import kfac_jax  # noqa: E402
from benchmarks import race  # noqa: E402


def _per_call(f, *args, n: int = 10) -> float:
  jax.block_until_ready(f(*args))
  t = time.perf_counter()
  for _ in range(n):
    out = f(*args)
  jax.block_until_ready(out)
  return (time.perf_counter() - t) / n * 1e3


def _steps(loss_fn, params0, batch, every: int, path: str) -> np.ndarray:
  tx = kfac_jax.kfac(loss_fn, batch, learning_rate=0.3, curvature_every=every, inverse_every=10)
  vg = kfac_jax.value_and_grad(loss_fn)

  def step(p, s, b, r):
    if path == "batch":
      loss, g = jax.value_and_grad(loss_fn)(p, b)
      u, s = tx.update(g, s, p, batch=b, rng=r)
    else:
      loss, g, stats = vg(p, b, r)
      u, s = tx.update(g, s, p, curvature_stats=stats)
    return optax.apply_updates(p, u), s, loss

  step = jax.jit(step, donate_argnums=(0, 1))
  p, s, r = jax.tree.map(jnp.copy, params0), tx.init(params0), jax.random.key(0)
  for _ in range(10):
    p, s, loss = step(p, s, batch, r)
  jax.block_until_ready(loss)
  times = []
  for _ in range(50):
    t = time.perf_counter()
    p, s, loss = step(p, s, batch, r)
    jax.block_until_ready(loss)
    times.append(time.perf_counter() - t)
  return np.array(times) * 1e3


def main(argv=None) -> int:
  name = (argv or sys.argv[1:] or ["cnn"])[0]
  wl = race.WORKLOADS[name]
  w = wl.make_workload(wl.parse_args(["--steps", "50", "--warmup", "0", "--plot", ""]))
  loss_fn, params = w.loss_fn, w.params0
  batch = jax.tree.map(jnp.asarray, w.batch_at(0))
  rng = jax.random.key(0)
  vg = kfac_jax.value_and_grad(loss_fn)
  print(f"{name}: one call (ms)")
  plain = _per_call(jax.jit(jax.value_and_grad(loss_fn)), params, batch)
  print(f"  jax.value_and_grad                 {plain:7.1f}")
  print(f"  kfac_jax.value_and_grad            {_per_call(jax.jit(vg), params, batch, rng):7.1f}")
  print(f"{name}: whole K-FAC step over 50 steps (ms)")
  for every, path in [(1, "ungated"), (5, "ungated"), (5, "batch")]:
    t = _steps(loss_fn, params, batch, every, path)
    print(
      f"  every {every}, {path:8s} mean {t.mean():7.1f}  median {np.median(t):7.1f}  "
      f"min {t.min():7.1f}",
      flush=True,
    )
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
