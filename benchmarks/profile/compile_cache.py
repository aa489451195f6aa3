"""Compile time of a race workload's `kfac` and Adam steps with JAX's persistent compilation cache.

Three fresh processes, one after the other: the cache off, the cache on and empty (a first
launch), the cache on and filled by the second (any later launch, e.g. the next run of a
notebook or of a sweep). Each prints the seconds of `jax.jit(step).lower(...).compile()` for
the race's contestants: Adam and `kfac` on its defaults (lr 1, statistics and inverses every 5,
statistics from `batch=`), as `benchmarks/race.py` builds them.

    python benchmarks/profile/compile_cache.py --workload autoencoder
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKLOADS = ("autoencoder", "cnn", "transformer")


def worker(workload: str, cache: str, quick: bool = False) -> dict[str, float]:
  """Seconds to lower and compile each contestant's step in this process, and the number of
  files in the cache directory afterwards (`entries`; 0 with the cache off)."""
  sys.path.insert(0, _ROOT)
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top

  if cache:
    jax.config.update("jax_compilation_cache_dir", cache)
    # Cache every program: the defaults skip those that compile in under a second.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  from benchmarks import _harness, autoencoder, cnn, transformer  # pylint: disable=g-import-not-at-top

  module = {"autoencoder": autoencoder, "cnn": cnn, "transformer": transformer}[workload]
  wl = module.parse_args(["--steps", "3", "--warmup", "1"] + (["--quick"] if quick else []))
  w = module.make_workload(wl)
  example = jax.tree.map(jnp.asarray, w.batch_at(0))
  contestants = [
    _harness.first_order("adam", "adam", w.loss_fn, optax.adam(1e-3)),
    _harness.kfac_transform(
      w.loss_fn,
      example,
      learning_rate=1.0,
      momentum=0.7,
      damping=0.1,
      ema_decay=0.95,
      inverse_every=5,
      curvature_every=5,
    ),
  ]
  out = {}
  for name, c in zip(("adam", "kfac"), contestants):
    state = c.init(w.params0)
    t0 = time.perf_counter()
    step = jax.jit(c.step, donate_argnums=(0, 1))
    step.lower(w.params0, state, example, jax.random.key(0)).compile()
    out[name] = time.perf_counter() - t0
  out["entries"] = len(os.listdir(cache)) if cache else 0
  return out


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--workload", choices=WORKLOADS, default="autoencoder")
  p.add_argument(
    "--quick",
    action="store_true",
    help="the workload's small model, and no cache-off process (a smoke test)",
  )
  p.add_argument("--worker-cache", default=None, help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  if args.worker_cache is not None:
    print(json.dumps(worker(args.workload, args.worker_cache, args.quick)))
    return 0
  rows = []
  with tempfile.TemporaryDirectory() as cache:
    rows_wanted = (("off", ""), ("on, empty", cache), ("on, filled", cache))
    # --quick (the smoke test) checks only the cache: one process fills it, the next reuses it.
    for label, where in rows_wanted[1:] if args.quick else rows_wanted:
      cmd = [sys.executable, os.path.abspath(__file__), "--workload", args.workload]
      cmd += ["--quick"] if args.quick else []
      res = subprocess.run(
        cmd + ["--worker-cache", where], capture_output=True, text=True, check=True
      )
      rows.append((label, json.loads(res.stdout.strip().splitlines()[-1])))
  print(f"{args.workload}: seconds to lower and compile one step")
  print("| persistent cache | Adam | kfac | kfac / Adam (uncached) | cache files after |")
  print("|---|---:|---:|---:|---:|")
  adam_off = rows[0][1]["adam"]  # The uncached Adam (the empty cache's row with --quick).
  for label, r in rows:
    print(
      f"| {label} | {r['adam']:.2f} | {r['kfac']:.2f} | {r['kfac'] / adam_off:.1f}x | "
      f"{r['entries']} |"
    )
  return 0


if __name__ == "__main__":
  sys.exit(main())
