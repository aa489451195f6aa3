"""Variational Monte Carlo: energy after N steps and step time, K-FAC fronts against Adam.

Trains examples/vmc.py's FermiNet-class wave function from the same initial parameters and
walkers with `kfac_jax.Optimizer`, the optax chain `kfac_jax.kfac` and Adam, and prints a
markdown table: the energy as the mean ± standard error of the per-step energies over the last
20% of the steps, its distance to the exact energy, and the median step time (sampling
included) with its ratio to the Optimizer's.

    python benchmarks/vmc.py --system He --steps 400 --walkers 128
    python benchmarks/vmc.py --system Li --steps 400 --walkers 128 --optimizers optimizer adam
"""

from __future__ import annotations

import argparse
import os
import platform
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
  sys.path.insert(0, _ROOT)

import numpy as np  # noqa: E402

from examples import vmc  # noqa: E402

NAMES = {"optimizer": "kfac_jax.Optimizer", "kfac": "kfac_jax.kfac", "adam": "Adam 3e-3"}


def main(argv=None) -> list[dict]:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--system", choices=sorted(vmc.SYSTEMS), default="He")
  parser.add_argument("--steps", type=int, default=400)
  parser.add_argument("--walkers", type=int, default=128)
  parser.add_argument("--width", type=int, default=16)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument(
    "--optimizers", nargs="+", choices=sorted(NAMES), default=["optimizer", "kfac", "adam"]
  )
  args = parser.parse_args(argv)
  system, net = vmc.SYSTEMS[args.system], vmc.Net(one=args.width)
  rows = []
  for name in args.optimizers:
    out = vmc.train(system, net, name, steps=args.steps, walkers=args.walkers, seed=args.seed)
    mean, err = vmc.estimate(out["energies"])
    # The first steps compile; the median is of the steps after them.
    step_ms = float(np.median(out["times"][5:])) * 1e3
    rows.append({"name": name, "energy": mean, "err": err, "step_ms": step_ms})
    print(f"{NAMES[name]}: {mean:.4f} ± {err:.4f} Ha, {step_ms:.0f} ms/step", flush=True)
  base = next((r["step_ms"] for r in rows if r["name"] == "optimizer"), rows[0]["step_ms"])
  print(
    f"\n{args.system}, {args.steps} steps, {args.walkers} walkers, one-electron width "
    f"{net.one}, {net.layers} layers, {net.determinants} determinants; exact {system.exact} Ha; "
    f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs\n"
  )
  print("| optimizer | energy (Ha) | − exact (mHa) | step (ms) | step / Optimizer's |")
  print("|---|---:|---:|---:|---:|")
  for r in rows:
    print(
      f"| {NAMES[r['name']]} | {r['energy']:.4f} ± {r['err']:.4f} | "
      f"{(r['energy'] - system.exact) * 1e3:+.1f} | {r['step_ms']:.0f} | "
      f"{r['step_ms'] / base:.2f} |"
    )
  return rows


if __name__ == "__main__":
  main()
