"""The race (issue 14): every optimizer gets the same budget of training seconds.

On one of the benchmark workloads (`--workload autoencoder|cnn|transformer|vit|rnn`, built by
`benchmarks/autoencoder.py`, `cnn.py`, `transformer.py`, `families.py`), every contestant
trains from the same initial parameters on the same minibatch sequence until its steps have used
`--budget` seconds:

* every step is charged its measured time (`jax.block_until_ready` after each); the first step's
  one-off costs are replaced by a typical step of its phase, as in the other benchmarks;
  compilation (one AOT `lower(...).compile()`, reported) and evaluation are not charged. A step
  starts only while the charged seconds are below the budget (`_harness.run_for_budget`);
* the loss at the budget is the evaluation loss of the final parameters on a fixed subset: the
  autoencoder's first 5,000 training images, the CNN's 5,000 held-out images, the Transformer's
  256 held-out windows (all it has);
* the minibatch sequence has `--data-steps` steps (shuffled epochs) and repeats after that;
* "seconds to X": X is the tuned Adam's final training loss (trailing mean of `--reach-window`
  minibatch losses, at most a tenth of its steps); the charged seconds until a contestant's
  smoothed loss first reaches X, and that time over the tuned Adam's own ("vs Adam").

Contestants: Adam over `--adam-lrs` and Muon (`optax.contrib.muon`, its non-matrix parameters on
Adam at the middle of the Adam grid) over `--muon-lrs` and SOAP (`benchmarks/soap.py`, written
from its paper; off unless `--soap-lrs` names a grid), each reported by its best final loss
("tuned", the whole grid printed); SGD+momentum; `kfac_jax.kfac` (the transform, on its
defaults with the README's learning rate for the workload unless `--kfac-lr`, `--kfac-momentum`,
`--damping`, `--inverse-every`, `--curvature-every` say otherwise: `KFAC_DEFAULTS`); the same
with another `max_norm` (`--max-norm`); the same with dense and conv layers on EKFAC
(`--ekfac`); the full `kfac_jax.Optimizer`; with `--with-upstream`, kfac-jax 0.0.8 in its own
venv, configured like the transform (fixed learning rate, momentum, damping); with
`--adam-decay-steps N`, Adam over its grid on `optax.cosine_decay_schedule(lr, N)` (family
"adam_decay": the constant-rate tuned Adam stays the reference). Output: a markdown table for
RESULTS.md, `--json` (default `out/race_<workload>.json`) and `--plot` (default
`out/race_<workload>.png`, loss against steps and against charged seconds).

`--sweep` runs only the kfac transform over `--sweep-lrs` x `--sweep-dampings` (and the Adam
grid as the reference), each for `--budget` seconds, and prints one table: for picking defaults.

    python benchmarks/race.py --workload autoencoder --budget 120 --with-upstream
    python benchmarks/race.py --workload cnn --budget 120
    python benchmarks/race.py --workload transformer --budget 120
    python benchmarks/race.py --workload autoencoder --budget 20 --sweep
    python benchmarks/race.py --workload cnn --quick --budget 5        # smoke test
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import textwrap

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
  sys.path.insert(0, _ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import kfac_jax  # noqa: E402
from benchmarks import _harness, autoencoder, cnn, families, soap, transformer  # noqa: E402
from benchmarks.upstream import compare  # noqa: E402

WORKLOADS = {
  "autoencoder": autoencoder,
  "cnn": cnn,
  "transformer": transformer,
  "vit": families.VIT,
  "rnn": families.RNN,
}
KFAC_DEFAULTS = {
  workload: {
    "kfac_lr": lr,
    "kfac_momentum": 0.7,
    "damping": 0.01 if workload == "rnn" else 0.1,
    "inverse_every": 5,
    "curvature_every": 1 if workload == "rnn" else 5,
  }
  for workload, lr in {
    "autoencoder": 1.0,
    "cnn": 0.3,
    "transformer": 1.0,
    "vit": 0.3,
    "rnn": 0.3,
  }.items()
}
"""The race's own `kfac` row: `kfac_jax.kfac` on its defaults (momentum 0.7, damping 0.1,
statistics and inverses every 5 steps) with the learning rate of the recorded races, 1 for the
losses summed over many outputs and 0.3 for the classifiers (`kfac`'s own, 0.3·D^(1/4), is
1.6 and 0.85 on the first two); the LSTM's damping 0.01 and statistics every step.
The workload scripts' own defaults are older settings kept for their upstream comparisons; any
flag given on the command line wins."""
MUON_LRS = {
  "autoencoder": "0.02,0.05",
  "cnn": "0.02,0.05",
  "transformer": "0.01,0.03",
  "vit": "0.01,0.03",
  "rnn": "0.01,0.03",
}


def _floats(p, flag: str, text: str) -> list[float]:
  try:
    out = [float(x) for x in text.split(",") if x.strip()]
  except ValueError:
    p.error(f"{flag} must be comma-separated numbers, got {text!r}")
  if not out or any(not x > 0 for x in out):
    p.error(f"{flag} needs at least one value > 0, got {text!r}")
  return out


CONFIG_KEYS = (
  "curvature_every",
  "inverse_every",
  "stats_batch",
  "decay_steps",
  "statistics_fraction",
  "factor_solve",
  "preconditioner_dtype",
  "conv",
  "dense",
  "ema_decay",
  "estimation_mode",
  "num_samples",
)


def _unit_number(key: str, value: str, text: str, *, one: bool) -> float:
  """`value` as a number in (0, 1] (`one`) or (0, 1); a ValueError naming the entry."""
  try:
    x = float(value)
  except ValueError:
    raise ValueError(f"{key} must be a number, got {value!r} in {text!r}") from None
  if not (0 < x <= 1 if one else 0 < x < 1):
    raise ValueError(f"{key} must be in (0, 1{']' if one else ')'}, got {value!r} in {text!r}")
  return x


def parse_kfac_config(text: str) -> dict:
  """`lr:momentum:damping:clip[:key=value...]` as keyword arguments of `kfac_jax.kfac`.

  `lr` is a number or `default` (`kfac`'s own, `kfac_jax._transform.default_learning_rate`),
  `clip` is `max_norm` (0: none), momentum 0 is none; the optional settings are
  `curvature_every=`, `inverse_every=`, `stats_batch=`, `decay_steps=` (ints; `stats_batch=n`:
  the statistics come from `batch=` with the minibatch's first n examples, a harness setting,
  the same as `kfac`'s `statistics_fraction=n/N`; `decay_steps=n`: the learning rate follows
  `optax.cosine_decay_schedule(lr, n)`, to 0 at step n), `statistics_fraction=` (a number in
  (0, 1], or auto, `kfac`'s default), `factor_solve=` ("auto", "always" or "never"),
  `preconditioner_dtype=` (bfloat16 or float32), `ema_decay=` (in (0, 1)),
  `estimation_mode=` (one of `kfac_jax`'s modes) with `num_samples=` (an int; the harness's
  own are "gradients" and 1) and
  `conv=` / `dense=` (the approximation of those layer kinds, a `LayerConfig` default). A
  setting left out is the caller's: the race's workload flags (`--curvature-every`,
  `--inverse-every`), the step sweep's `kfac` defaults. Raises ValueError naming the entry.
  """
  parts = text.split(":")
  try:
    lr = None if parts[0] == "default" else float(parts[0])
    momentum, damping, clip = (float(v) for v in parts[1:4])
  except (ValueError, IndexError):
    raise ValueError(
      f"each entry is lr:momentum:damping:clip[:key=value...], got {text!r}"
    ) from None
  if not ((lr is None or lr > 0) and damping > 0 and 0 <= momentum < 1 and clip >= 0):
    raise ValueError(f"need lr > 0, damping > 0, 0 <= momentum < 1, clip >= 0; got {text!r}")
  out: dict = {"learning_rate": lr, "momentum": momentum, "damping": damping}
  out["max_norm"] = clip if clip > 0 else None  # 0 is none, not kfac's default.
  approx = {}
  for item in parts[4:]:
    key, sep, value = item.partition("=")
    if not sep or key not in CONFIG_KEYS:
      raise ValueError(f"unknown setting {item!r} in {text!r}; keys: {', '.join(CONFIG_KEYS)}")
    if key in ("conv", "dense"):
      approx[key] = value
    elif key == "factor_solve":
      if value not in ("auto", "always", "never"):
        raise ValueError(f"{key} must be auto, always or never, got {value!r} in {text!r}")
      out[key] = value
    elif key == "preconditioner_dtype":
      if value not in ("bfloat16", "float32"):
        raise ValueError(f"{key} must be bfloat16 or float32, got {value!r} in {text!r}")
      out[key] = value
    elif key == "estimation_mode":
      from kfac_jax import _curvature  # pylint: disable=g-import-not-at-top

      if value not in _curvature.ESTIMATION_MODES:
        modes = ", ".join(_curvature.ESTIMATION_MODES)
        raise ValueError(f"{key} must be one of {modes}, got {value!r} in {text!r}")
      out[key] = value
    elif key == "ema_decay":
      out[key] = _unit_number(key, value, text, one=False)
    elif key == "statistics_fraction" and value == "auto":
      out[key] = value
    elif key == "statistics_fraction":
      out[key] = _unit_number(key, value, text, one=True)
    else:
      try:
        out[key] = int(value)
      except ValueError:
        raise ValueError(f"{key} must be an int, got {value!r} in {text!r}") from None
      if out[key] < 1:
        raise ValueError(f"{key} must be >= 1, got {value!r} in {text!r}")
  if lr is None and "decay_steps" in out:
    raise ValueError(f"decay_steps needs a numeric lr (a cosine schedule from it), got {text!r}")
  if approx:
    out["layers"] = kfac_jax.LayerConfig(defaults=approx)
  return out


def parse_args(argv=None):
  """The race's own flags; every other flag goes to the workload's parser (see its --help)."""
  p = argparse.ArgumentParser(
    description=__doc__.split("\n\n")[0],
    formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    epilog="Any other flag is the workload's (python benchmarks/<workload>.py --help), e.g. "
    "--adam-lrs, --kfac-lr, --damping, --inverse-every, --with-upstream, --quick, "
    "--json, --plot.",
  )
  p.add_argument("--workload", required=True, choices=sorted(WORKLOADS))
  p.add_argument("--budget", type=float, default=120.0, help="charged training seconds each")
  p.add_argument(
    "--muon-lrs",
    default=None,
    help="Muon learning-rate grid ('' drops Muon); default per workload: "
    + ", ".join(f"{k} {v}" for k, v in MUON_LRS.items()),
  )
  p.add_argument(
    "--soap-lrs",
    default="",
    help="SOAP learning-rate grid (benchmarks/soap.py, the paper's other settings; '' for "
    "none, the default: its eigendecompositions make it the slowest contestant on a CPU), "
    "e.g. 3e-3,1e-2",
  )
  p.add_argument(
    "--soap-every",
    type=int,
    default=10,
    help="SOAP's steps between refreshes of its bases (the paper's 10)",
  )
  p.add_argument(
    "--ekfac",
    action=argparse.BooleanOptionalAction,
    default=True,
    help="add the kfac transform with dense and conv layers on EKFAC",
  )
  p.add_argument(
    "--ekfac-damping",
    type=float,
    default=None,
    help="the EKFAC contestant's damping, added to its scalings (default: --damping; "
    "K-FAC's factored damping splits √λ between the factors, so equal values "
    "are not equal strengths)",
  )
  p.add_argument(
    "--max-norm",
    type=float,
    default=0.0,
    help="add the kfac transform with this max_norm (0, the default, adds none; the "
    "workload's own kfac row clips at kfac's default)",
  )
  p.add_argument(
    "--kfac-configs",
    default="",
    help="more kfac transform contestants, comma-separated lr:momentum:damping:clip, each "
    "optionally followed by :key=value settings (clip: max_norm, 0 for none; momentum 0 "
    "for none; keys: " + ", ".join(CONFIG_KEYS) + "), e.g. 1:0.7:0.1:0.01:curvature_every=5:"
    "conv=kron_sua",
  )
  p.add_argument(
    "--data-steps",
    type=int,
    default=2000,
    help="length of the minibatch sequence (it repeats after that)",
  )
  p.add_argument("--max-steps", type=int, default=None, help="cap on each contestant's steps")
  p.add_argument(
    "--adam-decay-steps",
    type=int,
    default=None,
    help="also run Adam over its grid with optax.cosine_decay_schedule(lr, N) (family "
    "'adam_decay', reported beside the constant-rate tuned Adam, which stays the reference)",
  )
  p.add_argument(
    "--sweep",
    action="store_true",
    help="only the kfac transform over --sweep-lrs x --sweep-dampings (+ Adam)",
  )
  p.add_argument("--sweep-lrs", default="0.05,0.1,0.2,0.5")
  p.add_argument("--sweep-dampings", default="1,10,30,100")
  p.add_argument(
    "--sweep-max-norm",
    type=float,
    default=0.0,
    help="max_norm for every sweep run (0: kfac's default)",
  )
  p.add_argument(
    "--sweep-ekfac",
    action="store_true",
    help="sweep the transform with dense layers on EKFAC instead of K-FAC",
  )
  args, rest = p.parse_known_args(argv)
  if args.max_norm < 0:
    p.error(f"--max-norm must be >= 0 (0 adds no contestant), got {args.max_norm}")
  if (
    not args.budget > 0
    or args.data_steps < 2
    or (args.max_steps is not None and args.max_steps < 1)
    or (args.adam_decay_steps is not None and args.adam_decay_steps < 1)
  ):
    p.error(
      "--budget must be > 0, --data-steps >= 2, --max-steps >= 1 and --adam-decay-steps >= 1, "
      f"got {args.budget}, {args.data_steps}, {args.max_steps} and {args.adam_decay_steps}"
    )
  args.kfac_config_list = []
  for text in (c.strip() for c in args.kfac_configs.split(",") if c.strip()):
    try:
      args.kfac_config_list.append((text, parse_kfac_config(text)))
    except ValueError as e:
      p.error(f"--kfac-configs: {e}")
  muon = MUON_LRS[args.workload] if args.muon_lrs is None else args.muon_lrs
  args.muon_lr_grid = _floats(p, "--muon-lrs", muon) if muon.strip() else []
  args.soap_lr_grid = _floats(p, "--soap-lrs", args.soap_lrs) if args.soap_lrs.strip() else []
  if args.soap_every < 1:
    p.error(f"--soap-every must be >= 1, got {args.soap_every}")
  args.sweep_lr_grid = _floats(p, "--sweep-lrs", args.sweep_lrs)
  args.sweep_damping_grid = _floats(p, "--sweep-dampings", args.sweep_dampings)
  kind = "sweep" if args.sweep else "race"
  defaults = [
    "--json",
    os.path.join("out", f"{kind}_{args.workload}.json"),
    "--plot",
    os.path.join("out", f"{kind}_{args.workload}.png"),
  ]
  if args.workload == "autoencoder":
    defaults += ["--num-images", "5000"]
  if not args.sweep:
    defaults += [f"--{k.replace('_', '-')}={v}" for k, v in KFAC_DEFAULTS[args.workload].items()]
  wl = WORKLOADS[args.workload].parse_args(
    defaults + list(rest) + ["--steps", str(args.data_steps - 1), "--warmup", "1"]
  )
  return args, wl, rest


def cyclic(workload: _harness.Workload, length: int) -> _harness.Workload:
  """The workload with its `length`-step minibatch sequence repeated forever."""
  upstream_data = None
  if workload.upstream_data is not None:

    def upstream_data(steps):
      pool, idx = workload.upstream_data(min(steps, length))
      return pool, np.resize(idx, (steps, idx.shape[1]))

  return dataclasses.replace(
    workload, batch_at=lambda t: workload.batch_at(t % length), upstream_data=upstream_data
  )


def _ekfac_available() -> bool:
  from kfac_jax.scan import _kinds  # pylint: disable=g-import-not-at-top

  return "ekfac" in _kinds.KINDS["dense"].approximations


def race_contestants(workload: _harness.Workload, args, wl) -> list[_harness.Contestant]:
  loss_fn = workload.loss_fn
  example = jax.tree.map(jnp.asarray, workload.batch_at(0))
  out = [
    _harness.first_order(f"Adam lr={lr:g}", "adam", loss_fn, optax.adam(lr), learning_rate=lr)
    for lr in wl.adam_lr_grid
  ]
  if args.adam_decay_steps is not None:
    out += [
      _harness.first_order(
        f"Adam lr={lr:g}, cosine to 0 over {args.adam_decay_steps} steps",
        "adam_decay",
        loss_fn,
        optax.adam(optax.cosine_decay_schedule(lr, args.adam_decay_steps)),
        learning_rate=lr,
        decay_steps=args.adam_decay_steps,
      )
      for lr in wl.adam_lr_grid
    ]
  adam_mid = sorted(wl.adam_lr_grid)[len(wl.adam_lr_grid) // 2]
  out += [
    _harness.first_order(
      f"Muon lr={lr:g}",
      "muon",
      loss_fn,
      optax.contrib.muon(lr, adam_learning_rate=adam_mid),
      learning_rate=lr,
      adam_learning_rate=adam_mid,
    )
    for lr in args.muon_lr_grid
  ]
  out += [
    _harness.first_order(
      f"SOAP lr={lr:g}",
      "soap",
      loss_fn,
      soap.soap(lr, precondition_every=args.soap_every),
      learning_rate=lr,
      precondition_every=args.soap_every,
    )
    for lr in args.soap_lr_grid
  ]
  if wl.sgd:
    out.append(
      _harness.first_order(
        "SGD+momentum",
        "sgd",
        loss_fn,
        optax.sgd(wl.sgd_lr, momentum=wl.sgd_momentum or None),
        learning_rate=wl.sgd_lr,
        momentum=wl.sgd_momentum,
      )
    )
  common = {
    "params": workload.params0,
    "learning_rate": wl.kfac_lr,
    "momentum": wl.kfac_momentum,
    "damping": wl.damping,
    "ema_decay": wl.ema_decay,
    "inverse_every": wl.inverse_every,
    "curvature_every": wl.curvature_every,
  }
  out.append(_harness.kfac_transform(loss_fn, example, **common))
  if args.max_norm > 0:
    out.append(
      _harness.kfac_transform(
        loss_fn,
        example,
        name=f"kfac_jax (optax), max_norm={args.max_norm:g}",
        **common,
        max_norm=args.max_norm,
      )
    )
  for text, config in args.kfac_config_list:
    out.append(
      _harness.kfac_transform(
        loss_fn, example, name=f"kfac_jax (optax) {text}", **dict(common, **config)
      )
    )
  if args.ekfac:
    if _ekfac_available():
      ekfac = dict(common, damping=wl.damping if args.ekfac_damping is None else args.ekfac_damping)
      out.append(
        _harness.kfac_transform(
          loss_fn,
          example,
          name="kfac_jax (optax), EKFAC",
          **ekfac,
          layers=kfac_jax.LayerConfig(defaults={"dense": "ekfac", "conv": "ekfac"}),
        )
      )
    else:
      print(
        "no 'ekfac' approximation in this kfac_jax: the EKFAC contestant is skipped", flush=True
      )
  if wl.optimizer:
    out.append(
      _harness.kfac_optimizer(
        loss_fn,
        example,
        damping=wl.optimizer_damping,
        ema_decay=wl.ema_decay,
        inverse_every=wl.inverse_every,
        curvature_every=wl.curvature_every,
      )
    )
  return out


def sweep_contestants(workload: _harness.Workload, args, wl) -> list[_harness.Contestant]:
  loss_fn = workload.loss_fn
  example = jax.tree.map(jnp.asarray, workload.batch_at(0))
  out = [
    _harness.first_order(f"Adam lr={lr:g}", "adam", loss_fn, optax.adam(lr), learning_rate=lr)
    for lr in wl.adam_lr_grid
  ]
  extra = {"max_norm": args.sweep_max_norm} if args.sweep_max_norm > 0 else {}
  if args.sweep_ekfac:
    extra["layers"] = kfac_jax.LayerConfig(defaults={"dense": "ekfac", "conv": "ekfac"})
  for lr in args.sweep_lr_grid:
    for damping in args.sweep_damping_grid:
      out.append(
        _harness.kfac_transform(
          loss_fn,
          example,
          name=f"{'ekfac' if args.sweep_ekfac else 'kfac'} lr={lr:g} damping={damping:g}",
          params=workload.params0,
          learning_rate=lr,
          momentum=wl.kfac_momentum,
          damping=damping,
          ema_decay=wl.ema_decay,
          inverse_every=wl.inverse_every,
          curvature_every=wl.curvature_every,
          **extra,
        )
      )
  return out


def _upstream_cap(runs, budget: float, data_steps: int, max_steps: int | None) -> int:
  """Steps to hand the upstream worker: 4x what our transform's mean step allows in the budget
  (the worker stops at the budget itself)."""
  ours = [r for r in runs if r.summary["family"] == "kfac" and r.summary["steps"]]
  cap = (
    4 * math.ceil(budget / (1e-3 * ours[0].summary["mean_step_ms"])) + 10
    if ours
    else 4 * data_steps
  )
  return cap if max_steps is None else min(cap, max_steps)


def main(argv=None) -> int:
  args, wl, _ = parse_args(argv)
  workload = cyclic(WORKLOADS[args.workload].make_workload(wl), wl.warmup + wl.steps)
  command = _harness.command_line(__file__, argv)
  contestants = (sweep_contestants if args.sweep else race_contestants)(workload, args, wl)
  print(f"{workload.name}: {workload.description}", flush=True)
  print(
    f"budget {args.budget:g} s of training per contestant; {len(contestants)} contestants",
    flush=True,
  )
  jax.jit(lambda x: x + 1).lower(1.0).compile()  # One-off JIT start-up, paid by nobody below.
  runs = []
  for c in contestants:
    print(f"running {c.name} ...", flush=True)
    runs.append(
      _harness.run_contestant_for_budget(c, workload, args.budget, wl.seed, args.max_steps)
    )
    s = runs[-1].summary
    print(
      f"  {s['steps']} steps, {s['charged_s']:.1f} s charged, loss {s['final_eval_loss']:.4g}",
      flush=True,
    )
  upstream = None
  if wl.with_upstream and not args.sweep:
    if workload.upstream is None:
      upstream = {
        "optimizer": _harness.UPSTREAM_NAME,
        "family": "upstream",
        "error": f"no upstream version of the {workload.name} workload",
      }
    else:
      upstream = _harness.run_upstream_for_budget(
        workload, wl, args.budget, _upstream_cap(runs, args.budget, args.data_steps, args.max_steps)
      )
  all_runs = runs + ([upstream] if isinstance(upstream, _harness.Run) else [])
  rep = _harness.race_compare(all_runs, wl.reach_window)
  rows = rep["rows"] + ([upstream] if isinstance(upstream, dict) else [])
  env = _harness.environment(command, workload)
  print()
  print(
    f"jax {env['jax']} on {env['device']} ({env['cpu_count']} CPUs), Python "
    f"{env['python']}; budget {args.budget:g} s of charged training per contestant"
  )
  print(f"command: `{command}`")
  print()
  if args.sweep:
    print(sweep_table(rep["rows"], args.budget, rep["target"]))
  else:
    print(_harness.race_table(rows, args.budget, rep["target"]))
  print()
  for fam, grid in rep["grids"].items():
    print(
      f"{fam} grid (loss at the budget per learning rate): "
      + ", ".join(f"lr={lr:g}: {_harness._fmt(loss, '.4g')}" for lr, loss in grid)
    )
  print(
    f"loss = {workload.eval_description}; target = the tuned Adam's final training loss "
    f"(minibatch, trailing mean of {rep['window']}); seconds = charged training seconds "
    "(compilation, evaluation and the first step's one-off costs excluded); vs Adam = "
    "seconds to the target / the tuned Adam's own."
  )
  out = {
    "env": env,
    "budget_s": args.budget,
    "data_steps": args.data_steps,
    "hyperparameters": {c.name: dict(c.hyperparameters) for c in contestants},
    "grids": rep["grids"],
    "target_loss": rep["target"],
    "target_window": rep["window"],
    "adam_seconds_to_target": rep["adam_seconds"],
    "results": rows,
    "all_runs": [r.summary for r in runs],
    "curves": {
      r.name: {
        "losses": [float(x) for x in r.losses],
        "step_times_s": [float(x) for x in r.step_times],
      }
      for r in all_runs
    },
  }
  if wl.plot:
    best = {id(b): row["optimizer"] for b, row in zip(rep["best"].values(), rep["rows"])}
    curves = {
      best.get(id(r), r.name): rep["curves"][r.name]
      for r in all_runs
      if r.summary["family"] not in _harness.GRID_FAMILIES or id(r) in best
    }
    title = f"race, {args.budget:g} s: {workload.name}: {workload.description.split('; ')[0]}"
    compare.plot_curves(curves, wl.plot, textwrap.fill(title, 150))
    print(f"wrote {wl.plot}")
  if wl.json:
    os.makedirs(os.path.dirname(os.path.abspath(wl.json)), exist_ok=True)
    with open(wl.json, "w") as f:
      json.dump(out, f, indent=2, default=_harness._json_default)
    print(f"wrote {wl.json}")
  return 0


def sweep_table(rows, budget: float, target: float) -> str:
  """The sweep: one row per (learning rate, damping), sorted by the loss at the budget."""
  lines = [
    f"| run | loss at {budget:g} s | seconds to {target:.4g} | vs Adam | steps | finite |",
    "|---|---:|---:|---:|---:|---|",
  ]
  for r in sorted(
    rows, key=lambda r: (not math.isfinite(r["final_eval_loss"]), r["final_eval_loss"])
  ):
    hit = r.get("time_to_target")
    lines.append(
      f"| {r['optimizer']} | {_harness._fmt(r['final_eval_loss'], '.4g')} | "
      f"{'not reached' if hit is None else format(hit[1], '.1f')} | "
      f"{_harness._fmt(r.get('vs_adam'), '.2f', '')} | {r['steps']:,} | "
      f"{'yes' if r['finite'] else 'NO'} |"
    )
  return "\n".join(lines)


if __name__ == "__main__":
  sys.exit(main())
