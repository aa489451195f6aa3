"""The race over several seeds: is a win reliable, or one run's luck?

One race (`benchmarks/race.py`) is one initialisation and one minibatch order. On the CNN the
held-out loss of the final iterate moves by about ±0.015 from step to step, so a single run
can put K-FAC ahead or behind. This runs the same race once per `--seeds` entry (the seed sets
the initial parameters and the minibatch order, as `--seed` does for `race.py`; the evaluation
set is the same) and prints, per contestant, each seed's time to the tuned Adam's training loss
over Adam's own ("vs Adam") and each seed's evaluation loss over the tuned Adam's in that
same seed, then their means and how many seeds the contestant was ahead in. Every other flag
is `race.py`'s, e.g.

    python benchmarks/race_seeds.py --seeds 0,1,2 --workload cnn --budget 30 --no-sgd \
        --no-ekfac --no-optimizer --adam-lrs 2e-3 --muon-lrs ""

Each seed's full race goes to `--json-prefix`_<seed>.json (default `out/race_seeds_<workload>`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
  sys.path.insert(0, _ROOT)

from benchmarks import _harness, race  # noqa: E402


def _seeds(p, text: str) -> list[int]:
  try:
    out = [int(s) for s in text.split(",") if s.strip()]
  except ValueError:
    p.error(f"--seeds must be comma-separated integers, got {text!r}")
  if len(out) < 2 or len(set(out)) != len(out):
    p.error(f"--seeds needs at least two distinct seeds, got {text!r}")
  return out


def summarise(per_seed: dict[int, list[dict]]) -> list[dict]:
  """Per contestant (in the first seed's order): each seed's `vs_adam` and evaluation-loss ratio
  to that seed's tuned Adam (None where the seed has no such contestant or no value), their
  means over the seeds that have one, and `ahead`, the seeds where the loss ratio is below 1.

  `per_seed[s]` is that race's `results` rows (`race.py --json`), which hold one row per grid
  family (`_harness.GRID_FAMILIES`: its best learning rate, which may differ between seeds), so
  those rows are matched across seeds by family and the others by name.
  """
  seeds = list(per_seed)

  def key(r):
    fam = r.get("family")
    return (
      f"{_harness.GRID_FAMILIES[fam]} (tuned)" if fam in _harness.GRID_FAMILIES else r["optimizer"]
    )

  names = list(dict.fromkeys(key(r) for s in seeds for r in per_seed[s] if "error" not in r))
  adam_loss = {}
  for s in seeds:
    tuned = [r for r in per_seed[s] if r.get("family") == "adam"]
    adam_loss[s] = tuned[0]["final_eval_loss"] if tuned else None
  out = []
  for name in names:
    vs, loss = [], []
    for s in seeds:
      row = next((r for r in per_seed[s] if "error" not in r and key(r) == name), None)
      v = None if row is None else row.get("vs_adam")
      ref = adam_loss[s]
      lr = None
      if row is not None and ref and math.isfinite(row.get("final_eval_loss", math.nan)):
        lr = row["final_eval_loss"] / ref
      vs.append(v)
      loss.append(lr)
    known_vs = [v for v in vs if v is not None]
    known_loss = [v for v in loss if v is not None]
    out.append(
      {
        "optimizer": name,
        "vs_adam": vs,
        "loss_ratio": loss,
        "mean_vs_adam": sum(known_vs) / len(known_vs) if known_vs else None,
        "mean_loss_ratio": sum(known_loss) / len(known_loss) if known_loss else None,
        "ahead": sum(1 for v in known_loss if v < 1.0),
        "seeds_with_loss": len(known_loss),
      }
    )
  return out


def table(rows: list[dict], seeds: list[int]) -> str:
  """Markdown: one line per contestant, `vs Adam` and the loss ratio per seed, then the means."""
  head = (
    "| contestant | "
    + " | ".join(f"seed {s}: vs Adam, loss / Adam's" for s in seeds)
    + " | mean vs Adam | mean loss / Adam's | ahead in |"
  )
  lines = [head, "|---|" + "---:|" * (len(seeds) + 3)]
  for r in rows:
    cells = [
      ("not reached" if v is None else f"{v:.2f}x") + f", {_harness._fmt(lr, '.3f', '-')}"
      for v, lr in zip(r["vs_adam"], r["loss_ratio"])
    ]
    lines.append(
      f"| {r['optimizer']} | "
      + " | ".join(cells)
      + f" | {_harness._fmt(r['mean_vs_adam'], '.2f', '-')}"
      + f" | {_harness._fmt(r['mean_loss_ratio'], '.3f', '-')}"
      + f" | {r['ahead']} of {r['seeds_with_loss']} |"
    )
  return "\n".join(lines)


def main(argv=None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  # No abbreviations: `--seed` and `--json` (race.py's) must not be read as `--seeds` and
  # `--json-prefix`.
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
  p.add_argument("--seeds", default="0,1,2", help="comma-separated seeds, at least two")
  p.add_argument("--json-prefix", default=None, help="per-seed JSON: <prefix>_<seed>.json")
  args, rest = p.parse_known_args(argv)
  seeds = _seeds(p, args.seeds)
  if any(a == "--seed" or a.startswith("--seed=") for a in rest):
    p.error("use --seeds (one race per seed), not --seed")
  if any(a in ("--json", "--sweep") or a.startswith("--json=") for a in rest):
    p.error("--json and --sweep are race.py's alone; this writes --json-prefix_<seed>.json")
  race_args, wl, _ = race.parse_args(rest)  # Fails early, before any seed runs.
  del wl
  prefix = args.json_prefix or os.path.join("out", f"race_seeds_{race_args.workload}")
  per_seed = {}
  for s in seeds:
    path = f"{prefix}_{s}.json"
    print(f"\n=== seed {s} ===", flush=True)
    race.main(rest + ["--seed", str(s), "--json", path, "--plot", ""])
    with open(path) as f:
      per_seed[s] = json.load(f)["results"]
  rows = summarise(per_seed)
  print(f"\ncommand: `{_harness.command_line(__file__, argv)}`\n")
  print(table(rows, seeds))
  print(
    "\nvs Adam: charged seconds to the tuned Adam's final training loss over Adam's own, in "
    "that seed's race; loss / Adam's: the evaluation loss at the budget over that seed's tuned "
    "Adam's; ahead in: seeds where that ratio is below 1."
  )
  return 0


if __name__ == "__main__":
  sys.exit(main())
