"""Variational Monte Carlo: energy at equal steps and at equal seconds, K-FAC, SPRING and Adam.

Trains examples/vmc.py's FermiNet-class wave function from the same initial parameters and
walkers with `kfac_jax.Optimizer`, the optax chain `kfac_jax.kfac`, SPRING (`kfac_jax.kernel_ngd`
with `examples.vmc.Spring`'s settings on the scores' covariance, "spring", or on the uncentred
Fisher of |ψ|², "spring-raw", or with its paper's settings, "spring-paper"), Adam and, with
`--with-upstream`, DeepMind's kfac-jax 0.0.8 configured as FermiNet configures it
(`benchmarks/upstream/vmc_worker.py`, in the upstream virtualenv, on the example's own code), and
prints a markdown table: the energy as the mean ± standard error of the per-step energies over
the last 20% of the steps, after `--steps` steps and after the Optimizer's charged seconds
(`examples.vmc.charged_seconds`: compiling steps at the median; the others run on until they
have spent it), its distance to the exact energy, the median time of an iteration (sampling
included) and of the optimizer's update alone, and the update's time over kfac-jax 0.0.8's (or,
without it, over the Optimizer's).

    python benchmarks/vmc.py --system He --steps 1000 --walkers 512
    python benchmarks/vmc.py --system Li --steps 400 --walkers 256 --optimizers optimizer spring
"""

from __future__ import annotations

import argparse
import dataclasses
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
  "spring": "SPRING (kernel_ngd)",
  "spring-raw": "SPRING, uncentred",
  "spring-paper": "SPRING, paper's settings",
  "adam": "Adam 3e-3",
  "upstream": "kfac-jax 0.0.8",
}
WARMUP = vmc.WARMUP  # The first steps compile; medians are over the steps after them.


def row(name: str, energies, times, update_times, steps=None, budget=None) -> dict:
  """One contestant's summary: the energy estimate after `steps` steps (all by default) and
  after a quarter of them, after `budget` charged seconds (`vmc.charged_seconds`; None where it
  ran out first), and median iteration / update times (ms)."""
  energies = np.asarray(energies)
  steps = len(energies) if steps is None else min(steps, len(energies))
  mean, err = vmc.estimate(energies[:steps])
  early, early_err = vmc.estimate(energies[: max(2, steps // 4)])
  out = {
    "name": name,
    "steps": steps,
    "energy": mean,
    "err": err,
    "early": early,
    "early_err": early_err,
    "step_ms": float(np.median(np.asarray(times)[WARMUP:])) * 1e3,
    "update_ms": float(np.median(np.asarray(update_times)[WARMUP:])) * 1e3,
  }
  if budget is not None:
    charged = vmc.charged_seconds(times)
    reached = int(np.searchsorted(charged, budget)) + 1  # steps until the budget is spent
    if reached <= len(energies):
      out["budget_steps"] = reached
      out["budget_energy"], out["budget_err"] = vmc.estimate(energies[:reached])
  return out


def table(rows: list[dict], exact: float) -> str:
  """The markdown table: ΔE in mHa (mean of the last 20% of steps ± standard error) after a
  quarter of the steps, at equal steps and at equal seconds (steps taken there); the ratio
  column is over kfac-jax 0.0.8's update if it ran, else over the Optimizer's (else the first
  row's)."""
  ran = [r for r in rows if "error" not in r]
  base = next((r for n in ("upstream", "optimizer") for r in ran if r["name"] == n), ran[0])
  base_name = base["name"]
  mha = lambda e, s: f"{(e - exact) * 1e3:+.1f} ± {s * 1e3:.1f}"  # noqa: E731
  lines = [
    f"| optimizer | energy (Ha) | ΔE, ¼ steps (mHa) | ΔE (mHa) | ΔE, equal seconds (steps) | "
    f"step (ms) | update (ms) | update / {NAMES[base_name]} |",
    "|---|---:|---:|---:|---:|---:|---:|---:|",
  ]
  for r in rows:
    if "error" in r:
      lines.append(f"| {NAMES[r['name']]} | failed: {r['error']} | | | | | | |")
      continue
    equal = "–"
    if "budget_energy" in r:
      equal = f"{mha(r['budget_energy'], r['budget_err'])} ({r['budget_steps']})"
    early = mha(r["early"], r["early_err"]) if "early" in r else "–"
    lines.append(
      f"| {NAMES[r['name']]} | {r['energy']:.4f} ± {r['err']:.4f} | {early} | "
      f"{mha(r['energy'], r['err'])} | {equal} | {r['step_ms']:.0f} | {r['update_ms']:.0f} | "
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
    choices=("optimizer", "kfac", "spring", "spring-raw", "spring-paper", "adam"),
    default=["optimizer", "spring", "spring-raw", "adam"],
    help="the Optimizer runs first: its charged seconds are the others' equal-seconds budget",
  )
  defaults = vmc.Spring()
  parser.add_argument("--spring-lr", type=float, default=defaults.learning_rate)
  parser.add_argument("--spring-momentum", type=float, default=defaults.momentum)
  parser.add_argument("--spring-damping", type=float, default=defaults.damping)
  parser.add_argument("--spring-norm", type=float, default=defaults.norm_constraint)
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
      # Its budget row needs the Optimizer's seconds: filled in once the Optimizer has run.
      upstream["report"] = report
      print(f"kfac-jax 0.0.8's blocks: {', '.join(report['registrations'])}")
    print(f"{NAMES['upstream']}: {upstream}", flush=True)
  budget = None
  order = sorted(args.optimizers, key=lambda n: n != "optimizer")
  tuned = vmc.Spring(
    args.spring_lr, args.spring_momentum, args.spring_damping, args.spring_norm, center=True
  )
  springs = {
    "spring": tuned,
    "spring-raw": dataclasses.replace(tuned, center=False),
    "spring-paper": vmc.PAPER_SPRING,
  }
  for name in order:
    out = vmc.train(
      system,
      net,
      "spring" if name in springs else name,
      spring=springs.get(name),
      steps=args.steps,
      walkers=args.walkers,
      seed=args.seed,
      seconds=budget,
    )
    if name == "optimizer":
      budget = float(vmc.charged_seconds(out["times"])[-1])
    rows.append(row(name, out["energies"], out["times"], out["update_times"], args.steps, budget))
    print(f"{NAMES[name]}: {rows[-1]}", flush=True)
  if upstream and "report" in upstream:
    report = upstream.pop("report")
    upstream = row(
      "upstream", report["energies"], report["times"], report["update_times"], None, budget
    )
  rows += [upstream] if upstream else []
  print(
    f"\n{args.system}, {args.steps} steps, {args.walkers} walkers, one-electron width "
    f"{net.one}, {net.layers} layers, {net.determinants} determinants; exact {system.exact} Ha; "
    f"equal seconds: {f'{budget:.1f} s' if budget else 'none'} (the Optimizer's); "
    f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, load "
    f"{os.getloadavg()[0]:.1f}\n"
  )
  print(table(rows, system.exact))
  return rows


if __name__ == "__main__":
  main()
