"""`kfac_jax.kfac` on its defaults over every model of the zoo: does it ever diverge?

The target: the transform on its defaults, its learning rate included, never diverges to NaN on the
zoo models. For every model of `tests/_zoo.py` (MODELS in linen and nnx, and STRUCTURE_MODELS:
Haiku, equinox, the LSTM, MoE, VAE, BatchNorm ResNets, ...) and every entry of `--lrs` (default:
`default`, `kfac`'s own learning rate; numbers are fixed learning rates), this trains `--steps`
jitted steps on the model's fixed batch from its initial parameters, with `kfac_jax.kfac(loss_fn,
batch, learning_rate=lr)` and nothing else set, and reports the loss after the steps over the
initial loss, and how many updates the transform's guard skipped as non-finite (`skipped`; skipped
updates leave the parameters as they were, so a row can be finite and still have stalled). A row is
"diverged" when the final loss or any parameter is not finite, or the loss ended above where it
started.
Timing-free: valid on a busy machine. Prints a Markdown table; exit status 1 if any row
diverged.

    python benchmarks/zoo_defaults.py                      # 200 steps, kfac's own learning rate
    python benchmarks/zoo_defaults.py --lrs default,0.3,1,3
    python benchmarks/zoo_defaults.py --steps 50 --lrs 0.3 --models mlp,vae
    python benchmarks/zoo_defaults.py --preconditioner-dtype bfloat16   # bfloat16 inverses
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
import numpy as np  # noqa: E402
import optax  # noqa: E402

import kfac_jax  # noqa: E402
from tests import _zoo  # noqa: E402


def _models(names: set[str] | None):
  """(label, () -> Zoo) for every zoo model in `names` (None: all), both flavours of the
  two-flavour ones, or one with `name:flavour` (e.g. `mlp:linen`)."""
  for name, make in sorted(_zoo.MODELS.items()):
    for flavour in ("linen", "nnx"):
      if names is None or name in names or f"{name}:{flavour}" in names:
        yield f"{name} ({flavour})", lambda make=make, flavour=flavour: make(flavour)
  for name, make in sorted(_zoo.STRUCTURE_MODELS.items()):
    if names is None or name in names:
      yield name, make


def model_names(p: argparse.ArgumentParser, models: str | None) -> set[str] | None:
  """`--models` as a set (None: all), each entry a zoo name or `name:flavour` for one flavour
  of a two-flavour model; an unknown one is a usage error."""
  if not models:
    return None
  names = set(models.split(","))
  known = set(_zoo.MODELS) | set(_zoo.STRUCTURE_MODELS)
  known |= {f"{n}:{f}" for n in _zoo.MODELS for f in ("linen", "nnx")}
  if names - known:
    p.error(f"--models: unknown {sorted(names - known)}; known: {sorted(known)}")
  return names


def train(
  z: _zoo.Zoo, lr: float | None, steps: int, preconditioner_dtype: str | None = None
) -> dict:
  """`steps` steps of `kfac(loss_fn, batch, learning_rate=lr)` on the model's own batch (with
  `preconditioner_dtype` if given; `lr=None`: `kfac`'s own)."""
  tx = kfac_jax.kfac(
    registration=kfac_jax.Registration(z.loss_fn, z.params, z.batch, has_aux=z.has_aux),
    learning_rate=lr,
    config=kfac_jax.Config(preconditioner_dtype=preconditioner_dtype),
  )

  step = _zoo.train_step(z, tx)
  params, batch, state = z.params, z.batch, tx.init(z.params)  # Eager: the audit measures c.
  losses = []
  for i in range(steps + 1):  # The last step's loss is the loss after `steps` updates.
    params, state, batch, loss = step(params, state, batch, _zoo._key(i))
    losses.append(float(loss))
  finite = all(bool(np.all(np.isfinite(p))) for p in jax.tree_util.tree_leaves(params))
  return {
    "first": losses[0],
    "last": losses[-1],
    "skipped": int(optax.tree_utils.tree_get(state, "skipped")),
    "diverged": not (finite and math.isfinite(losses[-1]) and losses[-1] <= losses[0]),
  }


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--steps", type=int, default=200)
  p.add_argument(
    "--lrs", default="default", help="comma-separated learning rates, or `default` (kfac's own)"
  )
  p.add_argument("--models", default=None, help="comma-separated zoo names (default: all)")
  p.add_argument(
    "--preconditioner-dtype",
    default=None,
    choices=("bfloat16", "float32"),
    help="kfac's preconditioner_dtype (default: the inverses' float32)",
  )
  args = p.parse_args(argv)
  try:
    lrs = [None if v == "default" else float(v) for v in args.lrs.split(",")]
  except ValueError:
    p.error(f"--lrs must be comma-separated numbers or `default`, got {args.lrs!r}")
  if args.steps < 1 or not lrs or any(lr is not None and lr <= 0 for lr in lrs):
    p.error(f"--steps must be >= 1 and every --lrs entry > 0, got {args.steps}, {args.lrs!r}")
  models = model_names(p, args.models)

  extra = f", preconditioner_dtype={args.preconditioner_dtype}" if args.preconditioner_dtype else ""
  print(f"`kfac_jax.kfac` defaults{extra}, {args.steps} steps on each model's fixed batch")
  print("final loss / initial loss per learning rate (skipped updates in brackets; ✗ diverged)\n")
  names = ["default lr" if lr is None else f"lr {lr:g}" for lr in lrs]
  print("| model | " + " | ".join(names) + " |")
  print("|---|" + "---:|" * len(lrs))
  diverged = []
  for label, make in _models(models):
    cells = []
    for lr, name in zip(lrs, names):
      r = train(make(), lr, args.steps, args.preconditioner_dtype)
      ratio = r["last"] / r["first"] if r["first"] else math.nan
      cell = f"{ratio:.3g}" + (f" [{r['skipped']}]" if r["skipped"] else "")
      if r["diverged"]:
        cell += " ✗"
        diverged.append(f"{label} {name}")
      cells.append(cell)
    print(f"| {label} | " + " | ".join(cells) + " |", flush=True)
  print(f"\njax {jax.__version__}, backend {jax.default_backend()}")
  print(f"diverged: {', '.join(diverged) if diverged else 'none'}")
  return 1 if diverged else 0


if __name__ == "__main__":
  sys.exit(main())
