"""Variational Monte Carlo: energy after N steps and step time, K-FAC against kfac-jax and Adam.

Trains examples/vmc.py's FermiNet-class wave function from the same initial parameters and
walkers with `kfac_jax.Optimizer`, the optax chain `kfac_jax.kfac`, Adam and, with
`--with-upstream`, DeepMind's kfac-jax 0.0.8 configured as FermiNet configures it
(`benchmarks/upstream/vmc_worker.py`, in the upstream virtualenv, on the example's own code),
and prints a markdown table: the energy as the mean ± standard error of the per-step energies
over the last 20% of the steps, its distance to the exact energy, the median time of an
iteration (sampling included) and of the optimizer's update alone, and the update's time over
kfac-jax 0.0.8's (or, without it, over the Optimizer's).

    python benchmarks/vmc.py --system He --steps 1000 --walkers 512 --with-upstream
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

from benchmarks.upstream import compare  # noqa: E402
from examples import vmc  # noqa: E402

NAMES = {
  "optimizer": "kfac_jax.Optimizer",
  "kfac": "kfac_jax.kfac",
  "adam": "Adam 3e-3",
  "upstream": "kfac-jax 0.0.8",
}
WARMUP = 5  # The first steps compile; medians are over the steps after them.


def row(name: str, energies, times, update_times) -> dict:
  """One contestant's summary: energy estimate and median iteration / update times (ms)."""
  mean, err = vmc.estimate(np.asarray(energies))
  return {
    "name": name,
    "energy": mean,
    "err": err,
    "step_ms": float(np.median(np.asarray(times)[WARMUP:])) * 1e3,
    "update_ms": float(np.median(np.asarray(update_times)[WARMUP:])) * 1e3,
  }


def table(rows: list[dict], exact: float) -> str:
  """The markdown table; the ratio column is over kfac-jax 0.0.8's update if it ran, else
  over the Optimizer's (else the first row's)."""
  ran = [r for r in rows if "error" not in r]
  base = next((r for n in ("upstream", "optimizer") for r in ran if r["name"] == n), ran[0])
  base_name = base["name"]
  lines = [
    f"| optimizer | energy (Ha) | − exact (mHa) | step (ms) | update (ms) | update / "
    f"{NAMES[base_name]} |",
    "|---|---:|---:|---:|---:|---:|",
  ]
  for r in rows:
    if "error" in r:
      lines.append(f"| {NAMES[r['name']]} | failed: {r['error']} | | | | |")
      continue
    lines.append(
      f"| {NAMES[r['name']]} | {r['energy']:.4f} ± {r['err']:.4f} | "
      f"{(r['energy'] - exact) * 1e3:+.1f} | {r['step_ms']:.0f} | {r['update_ms']:.0f} | "
      f"{r['update_ms'] / base['update_ms']:.2f} |"
    )
  return "\n".join(lines)


def main(argv=None) -> list[dict]:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--system", choices=sorted(vmc.SYSTEMS), default="He")
  parser.add_argument("--steps", type=int, default=400)
  parser.add_argument("--walkers", type=int, default=128)
  parser.add_argument("--width", type=int, default=16)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument(
    "--optimizers",
    nargs="+",
    choices=("optimizer", "kfac", "adam"),
    default=["optimizer", "kfac", "adam"],
  )
  parser.add_argument(
    "--with-upstream", action="store_true", help="add kfac-jax 0.0.8 (benchmarks/upstream)"
  )
  parser.add_argument("--upstream-python", help="an interpreter with kfac-jax 0.0.8")
  args = parser.parse_args(argv)
  system, net = vmc.SYSTEMS[args.system], vmc.Net(one=args.width)
  rows: list[dict] = []
  upstream: dict | None = None
  if args.with_upstream:
    config = {
      "system": args.system,
      "width": args.width,
      "steps": args.steps,
      "walkers": args.walkers,
      "seed": args.seed,
    }
    try:
      report = compare.run_vmc_worker(compare.ensure_venv(args.upstream_python), config)
    except (compare.UpstreamFailed, FileNotFoundError, RuntimeError) as e:
      reason = getattr(e, "exception", None) or str(e).splitlines()[0]
      upstream = {"name": "upstream", "error": reason.replace("|", "/")}
    else:
      upstream = row("upstream", report["energies"], report["times"], report["update_times"])
      print(f"kfac-jax 0.0.8's blocks: {', '.join(report['registrations'])}")
    print(f"{NAMES['upstream']}: {upstream}", flush=True)
  for name in args.optimizers:
    out = vmc.train(system, net, name, steps=args.steps, walkers=args.walkers, seed=args.seed)
    rows.append(row(name, out["energies"], out["times"], out["update_times"]))
    print(f"{NAMES[name]}: {rows[-1]}", flush=True)
  rows += [upstream] if upstream else []
  print(
    f"\n{args.system}, {args.steps} steps, {args.walkers} walkers, one-electron width "
    f"{net.one}, {net.layers} layers, {net.determinants} determinants; exact {system.exact} Ha; "
    f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs\n"
  )
  print(table(rows, system.exact))
  return rows


if __name__ == "__main__":
  main()
