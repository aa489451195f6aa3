"""The `Optimizer` step with scipy's OpenBLAS (jaxlib's CPU LAPACK) on one thread or on two.

A 64-512-512-64 tanh MLP on scikit-learn's digits (batch 256, sigmoid cross-entropy),
`kfac_jax.Optimizer` on its defaults (inverses every 5 steps). Four settings, each in its own
process, interleaved over `--rounds` rounds: `library` (no thread variable: the library sets
scipy's OpenBLAS to one thread with threadpoolctl), `env1` (`OPENBLAS_NUM_THREADS=1`), `env2`
(`OPENBLAS_NUM_THREADS=2`: the spinning threads the library avoids) and `none` (no variable
and the library's setting skipped: OpenBLAS's own default, one thread per core). Each process
reports the mean wall and CPU time (`time.process_time`, all threads) of `--steps` steps after
10 warm-up steps; CPU time is the steadier number on a shared machine.

    python benchmarks/profile/lapack_threads.py --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_SETTINGS = {"library": None, "env1": "1", "env2": "2", "none": None}
_THREAD_VARIABLES = ("OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS", "OMP_NUM_THREADS")


def worker(steps: int, setting: str = "library") -> dict:
  import flax.linen as nn
  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax
  from sklearn.datasets import load_digits

  import kfac_jax
  from kfac_jax import _compat

  if setting == "none":
    _compat._lapack_threads_set.append(True)  # noqa: SLF001  # The library's setting skipped.

  images = jnp.asarray(load_digits().data / 16.0, jnp.float32)
  model = nn.Sequential([nn.Dense(512), nn.tanh, nn.Dense(512), nn.tanh, nn.Dense(64)])
  batch = images[:256]

  def loss_fn(params, batch):
    logits = model.apply(params, batch)
    kfac_jax.register_sigmoid_cross_entropy_loss(logits, batch)
    return optax.sigmoid_binary_cross_entropy(logits, batch).sum(-1).mean()

  params = model.init(jax.random.key(0), batch)
  opt = kfac_jax.Optimizer(loss_fn, batch)
  state = opt.init(params)
  step = jax.jit(opt.step)
  rng = jax.random.key(1)
  wall, cpu = [], []
  for i in range(10 + steps):
    b = images[(i % 7) * 256 : (i % 7 + 1) * 256]
    t, c = time.perf_counter(), time.process_time()
    params, state, _ = step(params, state, b, jax.random.fold_in(rng, i))
    jax.block_until_ready(params)
    if i >= 10:
      wall.append(time.perf_counter() - t)
      cpu.append(time.process_time() - c)
  return {"wall_ms": 1e3 * float(np.mean(wall)), "cpu_ms": 1e3 * float(np.mean(cpu))}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--steps", type=int, default=50)
  parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.worker:
    print(json.dumps(worker(args.steps, args.worker)))
    return
  results: dict[str, list[dict]] = {name: [] for name in _SETTINGS}
  for r in range(args.rounds):
    for name, threads in _SETTINGS.items():
      env = {k: v for k, v in os.environ.items() if k not in _THREAD_VARIABLES}
      env["PYTHONPATH"] = _ROOT + os.pathsep + env.get("PYTHONPATH", "")
      if threads is not None:
        env["OPENBLAS_NUM_THREADS"] = threads
      cmd = [sys.executable, os.path.abspath(__file__), "--worker", name]
      cmd += ["--steps", str(args.steps)]
      out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
      got = json.loads(out.stdout.strip().splitlines()[-1])
      results[name].append(got)
      print(f"round {r}: {name:8s} wall {got['wall_ms']:7.1f} ms  cpu {got['cpu_ms']:7.1f} ms")
  for name, rows in results.items():
    wall = sorted(x["wall_ms"] for x in rows)[len(rows) // 2]
    cpu = sorted(x["cpu_ms"] for x in rows)[len(rows) // 2]
    print(f"median {name:8s} wall {wall:7.1f} ms  cpu {cpu:7.1f} ms")


if __name__ == "__main__":
  main()
