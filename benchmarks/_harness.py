"""The shared harness of the three issue-6 benchmarks (autoencoder, CNN, Transformer LM).

A benchmark script builds a `Workload` (initial parameters, the per-step batches, an evaluation
function) and hands it to `run_benchmark` with its parsed arguments. The harness then trains every
contestant from the same initial parameters on the same batches and measures, in one process and
one run:

* setup: wall time of the contestant's `init(params)` (for K-FAC this scans the loss for layers);
* compile: wall time of `jax.jit(step, donate_argnums=(0, 1)).lower(...).compile()`, minimum over
  `--compile-repeats` compilations, `jax.clear_caches()` before each, after one warm-up
  compilation of a trivial function (so nobody pays the process's one-off JIT start-up);
* median and mean step time over the timed steps (after `--warmup` untimed ones), each step
  followed by `jax.block_until_ready`; the mean includes the amortised inverse updates;
* peak memory: with a device that reports `memory_stats()` (GPU, TPU) the allocator's
  `peak_bytes_in_use`, see `DevicePeak`; always, the compiled step's own footprint from
  `compiled.memory_analysis()`: `argument + output + temp − alias` bytes, i.e. the parameters,
  optimizer state and batch it reads, the new parameters and state it writes (minus the donated
  buffers it writes in place) and XLA's scratch buffers. On CPU this is the only number: it is
  what XLA's buffer assignment plans for one step, not a measured resident-set peak;
* optimizer-state bytes: the sum of `nbytes` over the leaves of the state `init` returns;
* loss curves against steps and against seconds of training (first step's one-off costs
  replaced by a typical step, `compare.curve_times`), the final evaluation loss, and the steps and
  seconds each contestant needs to reach the best Adam's final (smoothed) training loss.

Adam runs once per learning rate of `--adam-lrs`; the run with the lowest final evaluation loss
is "Adam (tuned)", the reference of the ratio rows; the grid is listed in the output. Upstream
kfac-jax 0.0.8 (`--with-upstream`) runs in its own virtualenv through `benchmarks/upstream/`;
when it fails on a model, the table says so with its error instead of a number.
"""

from __future__ import annotations

import argparse
import bisect
import dataclasses
import json
import math
import os
import platform
import shlex
import sys
import textwrap
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import kfac_jax
from benchmarks.upstream import compare
from examples import autoencoder as ae

_MIB = 2.0**20


# -- what a benchmark provides -----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Contestant:
  """One optimizer: `init(params) -> state`, `step(params, state, batch, rng) -> (params,
  state, loss)` with `loss` measured at the incoming params. `period` is the inverse period
  (1 for first-order methods): the phase of the steps the curve time axis compares with."""

  name: str
  family: str  # "adam" | "sgd" | "kfac" | "kfac_optimizer"
  init: Callable[[Any], Any]
  step: Callable[[Any, Any, Any, jax.Array], tuple[Any, Any, jax.Array]]
  hyperparameters: Mapping[str, Any]
  period: int = 1


@dataclasses.dataclass(frozen=True)
class Workload:
  """A model and its data. `batch_at(t)` returns step t's batch (numpy or device arrays);
  `eval_fn(params)` the evaluation loss; `upstream` the worker's model config (None: the
  workload has no upstream version); `extra_evals` further evaluations of the final
  parameters, `(label, params -> float)`, reported beside the loss (the autoencoder's squared
  reconstruction error, the unit of issue 14's targets)."""

  name: str
  description: str
  loss_fn: Callable
  params0: Any
  batch_at: Callable[[int], Any]
  eval_fn: Callable[[Any], float]
  eval_description: str
  upstream: Mapping[str, Any] | None = None
  upstream_data: Callable[[int], tuple[dict[str, np.ndarray], np.ndarray]] | None = None
  extra_evals: tuple[tuple[str, Callable[[Any], float]], ...] = ()


def median_ms(f, *args, repeats: int) -> float:
  """Median wall time of `f(*args)` in ms over `repeats` calls after one warm-up call (which
  compiles a jitted `f`), each waited for with `block_until_ready`."""
  jax.block_until_ready(f(*args))
  times = []
  for _ in range(repeats):
    t = time.perf_counter()
    jax.block_until_ready(f(*args))
    times.append(time.perf_counter() - t)
  return 1e3 * float(np.median(times))


def extra_eval(workload: Workload, params) -> dict[str, float]:
  """`{label: value}` of the workload's `extra_evals` on `params`."""
  return {label: float(fn(params)) for label, fn in workload.extra_evals}


# -- command line shared by the benchmarks ----------------------------------------------------


def add_common_args(
  p: argparse.ArgumentParser,
  *,
  steps: int,
  warmup: int,
  adam_lrs: str,
  sgd_lr: float,
  kfac_lr: float,
  kfac_momentum: float,
  damping: float,
  optimizer_damping: float,
  inverse_every: int,
  plot: str,
) -> None:
  """Flags every benchmark has; the defaults are the workload's (see its `--help`)."""
  p.add_argument("--steps", type=int, default=steps, help="timed steps per contestant")
  p.add_argument("--warmup", type=int, default=warmup, help="untimed steps before the timed ones")
  p.add_argument(
    "--quick",
    action="store_true",
    help="a tiny model and a few steps (smoke test; overrides the sizes)",
  )
  p.add_argument(
    "--adam-lrs",
    default=adam_lrs,
    help="comma-separated Adam learning-rate grid; the best final loss is 'Adam (tuned)'",
  )
  p.add_argument(
    "--sgd",
    action=argparse.BooleanOptionalAction,
    default=True,
    help="include SGD with (heavy-ball) momentum",
  )
  p.add_argument("--sgd-lr", type=float, default=sgd_lr)
  p.add_argument("--sgd-momentum", type=float, default=0.9)
  p.add_argument("--kfac-lr", type=float, default=kfac_lr, help="kfac_jax transform")
  p.add_argument(
    "--kfac-momentum", type=float, default=kfac_momentum, help="kfac_jax transform (0 disables it)"
  )
  p.add_argument("--damping", type=float, default=damping, help="kfac_jax transform, upstream")
  p.add_argument("--ema-decay", type=float, default=0.95)
  p.add_argument("--inverse-every", type=int, default=inverse_every)
  p.add_argument(
    "--curvature-every",
    type=int,
    default=1,
    help="curvature statistics every this many steps (kfac_jax transform: "
    "`curvature_every`, computed only when due; upstream: "
    "`curvature_update_period`); at most --inverse-every",
  )
  p.add_argument(
    "--optimizer",
    action=argparse.BooleanOptionalAction,
    default=True,
    help="include the full kfac_jax.Optimizer (adaptive lr, momentum, damping)",
  )
  p.add_argument(
    "--optimizer-damping",
    type=float,
    default=optimizer_damping,
    help="the Optimizer's initial damping (then adapted)",
  )
  p.add_argument("--seed", type=int, default=0)
  p.add_argument(
    "--compile-repeats", type=int, default=3, help="compilations per contestant (minimum reported)"
  )
  p.add_argument(
    "--reach-window",
    type=int,
    default=5,
    help="trailing-mean window of the minibatch losses for the time to reach the "
    "best Adam loss (at most a tenth of the run)",
  )
  p.add_argument("--json", metavar="OUT", default=None, help="also write the results as JSON")
  p.add_argument("--plot", metavar="PNG", default=plot, help="loss curves ('' to skip)")
  p.add_argument(
    "--with-upstream",
    action="store_true",
    help="add DeepMind kfac-jax 0.0.8 (own venv, subprocess)",
  )
  p.add_argument(
    "--upstream-adaptive",
    action="store_true",
    help="configure upstream like the Optimizer contestant (adaptive learning rate, momentum "
    "and damping from --optimizer-damping), as its own examples do, instead of like the "
    "transform",
  )
  p.add_argument(
    "--upstream-python",
    default=None,
    help="python of a venv with kfac-jax 0.0.8 (default: .venv-upstream/bin/python, "
    "created by benchmarks/upstream/setup_venv.sh if missing)",
  )


def check_common_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
  """Validates the common flags (`p.error` names the flag and the value)."""
  if args.steps < 1 or args.warmup < 0:
    p.error(f"--steps must be >= 1 and --warmup >= 0, got {args.steps} and {args.warmup}")
  if args.with_upstream and args.warmup < 1:
    p.error("--with-upstream needs --warmup >= 1: upstream's first step includes its compilation")
  if (
    args.compile_repeats < 1
    or args.reach_window < 1
    or args.inverse_every < 1
    or args.curvature_every < 1
  ):
    p.error("--compile-repeats, --reach-window, --inverse-every and --curvature-every must be >= 1")
  if args.curvature_every > args.inverse_every:
    p.error(
      f"--curvature-every ({args.curvature_every}) must be at most --inverse-every "
      f"({args.inverse_every}) (upstream kfac-jax rejects it otherwise)"
    )
  try:
    args.adam_lr_grid = [float(x) for x in args.adam_lrs.split(",") if x.strip()]
  except ValueError:
    p.error(f"--adam-lrs must be comma-separated numbers, got {args.adam_lrs!r}")
  if not args.adam_lr_grid or any(not lr > 0 for lr in args.adam_lr_grid):
    p.error(f"--adam-lrs needs at least one learning rate > 0, got {args.adam_lrs!r}")


# -- contestants --------------------------------------------------------------------------------


def first_order(name: str, family: str, loss_fn, tx, **hyperparameters) -> Contestant:
  return Contestant(name, family, tx.init, ae.make_adam_step(loss_fn, tx), hyperparameters)


def kfac_step(loss_fn, tx, *, from_batch: bool, stats_batch: int | None = None):
  """A `kfac` training step `(params, state, batch, rng) -> (params, state, loss)`. Without
  `from_batch`, loss, gradients and statistics come from one `kfac_jax.value_and_grad` pass
  (`examples.autoencoder.make_kfac_step`); with it, the step is `jax.value_and_grad` and the
  transform computes the statistics from `batch=` on its due updates only, from the
  minibatch's first `stats_batch` examples if given (the transform normalises statistics by
  their own batch size)."""
  if not from_batch:
    return ae.make_kfac_step(loss_fn, tx)

  def step(params, state, batch, rng):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    rows = batch if stats_batch is None else jax.tree.map(lambda x: x[:stats_batch], batch)
    updates, state = tx.update(grads, state, params, batch=rows, rng=rng)
    return optax.apply_updates(params, updates), state, loss

  return step


def with_config(kwargs: dict) -> dict:
  """`kwargs` for a front, with the keywords that are `kfac_jax.Config` fields moved into
  `config=`."""
  fields = set(kfac_jax.Config.__dataclass_fields__)
  moved = {k: v for k, v in kwargs.items() if k in fields}
  rest = {k: v for k, v in kwargs.items() if k not in fields}
  return rest if not moved else {**rest, "config": kfac_jax.Config(**moved)}


def needs_batch(kfac_kwargs: dict, stats_batch: int | None) -> bool:
  """Whether a `kfac` configuration needs its statistics from `batch=`: a harness slice
  (`stats_batch`) or `statistics_fraction`, which slices `batch=` only."""
  return stats_batch is not None or kfac_kwargs.get("statistics_fraction") not in (None, 1)


def kfac_transform(
  loss_fn,
  example_batch,
  *,
  learning_rate: float,
  momentum: float,
  damping: float,
  ema_decay: float,
  inverse_every: int,
  curvature_every: int = 1,
  stats_batch: int | None = None,
  decay_steps: int | None = None,
  name: str | None = None,
  **kfac_kwargs,
) -> Contestant:
  """`kfac_jax.kfac` (the optax transform) with a fixed learning rate, momentum and damping.

  With statistics every step, loss, gradients and statistics come from one
  `kfac_jax.value_and_grad` pass. With `curvature_every` > 1 the step is `jax.value_and_grad`
  and the transform computes the statistics from `batch=` on due steps only. `kfac_kwargs`
  (e.g. `layers=`) go to `kfac_jax.kfac` and are listed in the hyperparameters; `name`
  replaces the default name. `stats_batch=n`: the statistics come from `batch=` with the
  minibatch's first n examples (the transform normalises them by their own batch size), on
  due steps only: cheaper statistics from fewer rows, as a user can pass a slice of the batch
  (or `kfac`'s `statistics_fraction`, which also makes the step take them from `batch=`).
  `decay_steps=n`: the learning rate follows `optax.cosine_decay_schedule(learning_rate, n)`.
  """
  momentum_ = momentum if momentum > 0 else None
  if stats_batch is not None:  # Exactly those rows: not cut again by `kfac`'s "auto" default.
    kfac_kwargs.setdefault("statistics_fraction", None)
  tx = kfac_jax.kfac(
    loss_fn,
    example_batch,
    learning_rate=(
      learning_rate
      if decay_steps is None
      else optax.cosine_decay_schedule(learning_rate, decay_steps)
    ),
    momentum=momentum_,
    damping=damping,
    ema_decay=ema_decay,
    inverse_every=inverse_every,
    curvature_every=curvature_every,
    **with_config({"estimation_mode": "gradients", "num_samples": 1, **kfac_kwargs}),
  )

  from_batch = curvature_every > 1 or needs_batch(kfac_kwargs, stats_batch)
  step = kfac_step(loss_fn, tx, from_batch=from_batch, stats_batch=stats_batch)
  if name is None:
    name = "kfac_jax (optax)" + (
      f", statistics every {curvature_every}" if curvature_every > 1 else ""
    )
  return Contestant(
    name,
    "kfac",
    tx.init,
    step,
    {
      "learning_rate": learning_rate,
      "momentum": momentum,
      "damping": damping,
      "ema_decay": ema_decay,
      "inverse_every": inverse_every,
      "curvature_every": curvature_every,
      **({} if stats_batch is None else {"stats_batch": stats_batch}),
      **({} if decay_steps is None else {"decay_steps": decay_steps}),
      **{k: repr(v) for k, v in kfac_kwargs.items()},
    },
    period=inverse_every,
  )


def kfac_optimizer(
  loss_fn,
  example_batch,
  *,
  damping: float,
  ema_decay: float,
  inverse_every: int,
  curvature_every: int = 1,
) -> Contestant:
  """The full `kfac_jax.Optimizer`: α and μ from the quadratic model each step, damping adapted
  by Levenberg–Marquardt from `damping`; statistics every `curvature_every` steps (as the
  upstream worker's `curvature_update_period`, from the same flag)."""
  opt = kfac_jax.Optimizer(
    loss_fn,
    example_batch,
    learning_rate=None,
    momentum=None,
    damping=damping,
    use_adaptive_damping=True,
    inverse_every=inverse_every,
    curvature_every=curvature_every,
    ema_decay=ema_decay,
    config=kfac_jax.Config(min_damping=min(1e-4, damping)),
  )

  def step(params, state, batch, rng):
    params, state, info = opt.step(params, state, batch, rng)
    return params, state, info["loss"]

  return Contestant(
    "kfac_jax Optimizer",
    "kfac_optimizer",
    opt.init,
    step,
    {
      "learning_rate": "adaptive",
      "momentum": "adaptive",
      "initial_damping": damping,
      "ema_decay": ema_decay,
      "inverse_every": inverse_every,
      "curvature_every": curvature_every,
    },
    period=inverse_every,
  )


def standard_contestants(workload: Workload, args: argparse.Namespace) -> list[Contestant]:
  """Adam over the grid, SGD+momentum, the kfac_jax transform and Optimizer (per the flags)."""
  loss_fn = workload.loss_fn
  example = jax.tree.map(jnp.asarray, workload.batch_at(0))
  out = [
    first_order(f"Adam lr={lr:g}", "adam", loss_fn, optax.adam(lr), learning_rate=lr)
    for lr in args.adam_lr_grid
  ]
  if args.sgd:
    out.append(
      first_order(
        "SGD+momentum",
        "sgd",
        loss_fn,
        optax.sgd(args.sgd_lr, momentum=args.sgd_momentum or None),
        learning_rate=args.sgd_lr,
        momentum=args.sgd_momentum,
      )
    )
  out.append(
    kfac_transform(
      loss_fn,
      example,
      learning_rate=args.kfac_lr,
      momentum=args.kfac_momentum,
      damping=args.damping,
      ema_decay=args.ema_decay,
      inverse_every=args.inverse_every,
      curvature_every=args.curvature_every,
    )
  )
  if args.optimizer:
    out.append(
      kfac_optimizer(
        loss_fn,
        example,
        damping=args.optimizer_damping,
        ema_decay=args.ema_decay,
        inverse_every=args.inverse_every,
        curvature_every=args.curvature_every,
      )
    )
  return out


# -- measuring one contestant --------------------------------------------------------------------


def tree_bytes(tree) -> int:
  """Sum of `nbytes` over the array leaves of `tree` (PRNG keys by their key data)."""
  total = 0
  for leaf in jax.tree.leaves(tree):
    if isinstance(leaf, jax.Array) and jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
      leaf = jax.random.key_data(leaf)
    total += int(getattr(leaf, "nbytes", np.asarray(leaf).nbytes))
  return total


def compiled_footprint(compiled) -> dict[str, int] | None:
  """`argument + output + temp − alias` bytes of a compiled step (None if not reported)."""
  try:
    m = compiled.memory_analysis()
  except Exception:  # noqa: BLE001  (backends without the analysis raise various errors)
    return None
  if m is None:
    return None
  parts = {
    k: int(getattr(m, f"{k}_size_in_bytes", 0) or 0)
    for k in ("argument", "output", "temp", "alias")
  }
  parts["total"] = parts["argument"] + parts["output"] + parts["temp"] - parts["alias"]
  return parts


class DevicePeak:
  """The allocator's `peak_bytes_in_use` of the first local device, where it is reported.

  JAX cannot reset the peak, so a contestant's own peak is known exactly only when the process's
  peak rises during its run (the maximum then lies in that run); otherwise it is at most the
  earlier peak and is reported as such ("<="). Contestants run one after the other and drop their
  buffers in between; the dataset and the initial parameters stay resident throughout and are
  included.
  """

  def __init__(self):
    self.device = jax.local_devices()[0]

  def read(self) -> int | None:
    try:
      stats = self.device.memory_stats()
    except Exception:  # noqa: BLE001
      return None
    if not stats or "peak_bytes_in_use" not in stats:
      return None
    return int(stats["peak_bytes_in_use"])


@dataclasses.dataclass
class Run:
  """One contestant's measurements (`summary` is its JSON row)."""

  name: str
  losses: np.ndarray
  step_times: np.ndarray
  period: int
  summary: dict


def run_contestant(
  c: Contestant,
  workload: Workload,
  steps: int,
  warmup: int,
  seed: int,
  compile_repeats: int,
  peak: DevicePeak,
) -> Run:
  total = warmup + steps
  params = jax.tree.map(jnp.copy, workload.params0)
  before = peak.read()
  t0 = time.perf_counter()
  state = jax.block_until_ready(c.init(params))
  setup_s = time.perf_counter() - t0
  state_bytes = tree_bytes(state)
  rng = jax.random.key(seed + 1)
  example = jax.tree.map(jnp.asarray, workload.batch_at(0))
  compile_all = []
  for _ in range(compile_repeats):
    jax.clear_caches()
    t0 = time.perf_counter()
    compiled = jax.jit(c.step, donate_argnums=(0, 1)).lower(params, state, example, rng).compile()
    compile_all.append(time.perf_counter() - t0)
  footprint = compiled_footprint(compiled)
  losses, times = [], []
  for t in range(total):
    batch = jax.tree.map(jax.device_put, workload.batch_at(t))
    rng, sub = jax.random.split(rng)
    jax.block_until_ready((batch, sub))
    start = time.perf_counter()
    params, state, loss = compiled(params, state, batch, sub)
    jax.block_until_ready((params, state, loss))
    times.append(time.perf_counter() - start)
    losses.append(float(loss))
  final = workload.eval_fn(params)
  after = peak.read()
  del params, state, compiled
  summary = compare.summarize(
    c.name,
    times,
    losses,
    warmup,
    family=c.family,
    hyperparameters=dict(c.hyperparameters),
    setup_s=setup_s,
    compile_s=min(compile_all),
    compile_all_s=compile_all,
    final_eval_loss=final,
    opt_state_bytes=state_bytes,
    compiled_footprint=footprint,
    **_peak_fields(before, after, footprint),
  )
  return Run(c.name, np.asarray(losses), np.asarray(times), c.period, summary)


def _peak_fields(before: int | None, after: int | None, footprint) -> dict:
  if after is not None:
    exact = before is None or after > before
    return {
      "peak_bytes": after,
      "peak_exact": exact,
      "peak_source": "device memory_stats()['peak_bytes_in_use']"
      + ("" if exact else " (process peak did not rise in this run: an upper bound)"),
    }
  return {
    "peak_bytes": None if footprint is None else footprint["total"],
    "peak_exact": True,
    "peak_source": "compiled.memory_analysis(): argument + output + temp - alias",
  }


# -- upstream ------------------------------------------------------------------------------------

UPSTREAM_NAME = "kfac-jax 0.0.8 (upstream)"


def _upstream_config(workload: Workload, args, **extra) -> dict:
  """The upstream worker's config: the workload's model settings and the transform's flags, or
  with `--upstream-adaptive` the Optimizer contestant's (adaptive everything from
  `--optimizer-damping`)."""
  adaptive = bool(getattr(args, "upstream_adaptive", False))
  return dict(
    workload.upstream,
    learning_rate=args.kfac_lr,
    momentum=args.kfac_momentum,
    damping=args.optimizer_damping if adaptive else args.damping,
    adaptive=adaptive,
    ema_decay=args.ema_decay,
    inverse_every=args.inverse_every,
    curvature_every=args.curvature_every,
    seed=args.seed,
    **extra,
  )


def _upstream_hyperparameters(args) -> dict:
  if getattr(args, "upstream_adaptive", False):
    return {
      "adaptive": "learning rate, momentum and damping",
      "initial_damping": args.optimizer_damping,
      "ema_decay": args.ema_decay,
      "inverse_every": args.inverse_every,
    }
  return {
    "learning_rate": args.kfac_lr,
    "momentum": args.kfac_momentum,
    "damping": args.damping,
    "ema_decay": args.ema_decay,
    "inverse_every": args.inverse_every,
  }


def run_upstream(workload: Workload, args, steps_total: int) -> Run | dict:
  """Upstream kfac-jax in its venv: a `Run`, or a row `{"optimizer", "error"}` if it failed."""
  try:
    python = compare.ensure_venv(args.upstream_python)
    pools, idx = workload.upstream_data(steps_total)
    config = _upstream_config(workload, args, compile_repeats=args.compile_repeats)
    print(f"running upstream kfac-jax ({python}) ...", flush=True)
    report, final = compare.run_worker(python, jax.device_get(workload.params0), pools, idx, config)
  except compare.UpstreamFailed as e:
    print(f"upstream failed:\n{e}", flush=True)
    return {
      "optimizer": UPSTREAM_NAME,
      "family": "upstream",
      "error": e.exception or "the worker failed (see the log above)",
      "registrations": e.registrations,
    }
  except (RuntimeError, OSError) as e:  # No venv, or it could not be created.
    print(f"upstream failed:\n{e}", flush=True)
    return {"optimizer": UPSTREAM_NAME, "family": "upstream", "error": str(e).splitlines()[0]}
  final_loss = workload.eval_fn(jax.tree.map(jnp.asarray, final))
  summary = compare.summarize(
    report["optimizer"],
    report["step_times_s"],
    report["losses"],
    args.warmup,
    family="upstream",
    setup_s=report["init_s"],
    compile_s=report["compile_s"],
    first_step_all_s=report["first_step_s"],
    compile_baseline=report["compile_baseline"],
    compile_baseline_s=report["compile_baseline_s"],
    final_eval_loss=final_loss,
    opt_state_bytes=report.get("opt_state_bytes"),
    registrations=report["registrations"],
    peak_bytes=report.get("peak_bytes"),
    peak_exact=report.get("peak_bytes") is not None,
    peak_source=(
      "device memory_stats()['peak_bytes_in_use'] in the worker process"
      if report.get("peak_bytes") is not None
      else "not available (its step has no public lower/compile; no device stats)"
    ),
    upstream_env={k: report[k] for k in ("upstream_version", "jax", "python", "backend")},
  )
  return Run(
    report["optimizer"],
    np.asarray(report["losses"], float),
    np.asarray(report["step_times_s"], float),
    args.inverse_every,
    summary,
  )


# -- reporting -----------------------------------------------------------------------------------


def _fmt(x, spec: str, missing: str = "n/a") -> str:
  if x is None or (isinstance(x, float) and math.isnan(x)):
    return missing
  return format(x, spec)


def _ratio(a, b):
  if a is None or b is None or b == 0 or (isinstance(a, float) and math.isnan(a)):
    return None
  return float(a) / float(b)


RATIO_KEYS = {
  "compile": "compile_s",
  "median_step": "median_step_ms",
  "mean_step": "mean_step_ms",
  "peak_memory": "peak_bytes",
  "opt_state": "opt_state_bytes",
  "loss": "final_eval_loss",
  "time_to_target": "time_to_target_s",
}


def ratios(num: Mapping[str, Any], den: Mapping[str, Any]) -> dict[str, float | None]:
  """`num / den` per metric of `RATIO_KEYS` (None where either side is missing)."""
  return {k: _ratio(num.get(v), den.get(v)) for k, v in RATIO_KEYS.items()}


def markdown_table(
  rows: Sequence[Mapping[str, Any]],
  ratio_rows: Sequence[tuple[str, Mapping[str, float | None]]],
  total_steps: int,
  target: float | None,
) -> str:
  """One row per contestant (a failed one shows its error), then the ratio rows."""
  tgt = "n/a" if target is None else f"{target:.4g}"
  lines = [
    (
      "| optimizer | setup (s) | compile (s) | median step (ms) | mean step (ms) | peak "
      f"memory (MiB) | opt state (MiB) | loss after {total_steps} steps | steps to "
      f"{tgt} | seconds to {tgt} |"
    ),
    "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
  ]
  for r in rows:
    if "error" in r:
      lines.append(f"| {r['optimizer']} | failed: {r['error'].replace('|', '/')} | | | | | | | | |")
      continue
    peak = _fmt(None if r.get("peak_bytes") is None else r["peak_bytes"] / _MIB, ".1f")
    if r.get("peak_bytes") is not None and not r.get("peak_exact", True):
      peak = "<=" + peak
    state = _fmt(None if r.get("opt_state_bytes") is None else r["opt_state_bytes"] / _MIB, ".2f")
    loss = _fmt(r["final_eval_loss"], ".4g") + ("" if r["finite"] else " (non-finite)")
    hit = r.get("time_to_target")
    lines.append(
      f"| {r['optimizer']} | {r['setup_s']:.2f} | {r['compile_s']:.2f} | "
      f"{r['median_step_ms']:.1f} | {r['mean_step_ms']:.1f} | {peak} | {state} | {loss} | "
      f"{'not reached' if hit is None else hit[0]} | "
      f"{'not reached' if hit is None else format(hit[1], '.2f')} |"
    )
  for label, q in ratio_rows:
    cells = [
      _fmt(q.get(k), ".2f", "") + ("x" if q.get(k) is not None else "")
      for k in ("compile", "median_step", "mean_step", "peak_memory", "opt_state")
    ]
    loss = _fmt(q.get("loss"), ".3f", "") + ("x" if q.get("loss") is not None else "")
    tt = _fmt(q.get("time_to_target"), ".2f", "") + (
      "x" if q.get("time_to_target") is not None else ""
    )
    lines.append(f"| **{label}** | | {' | '.join(cells)} | {loss} | | {tt} |")
  return "\n".join(lines)


def environment(command: str, workload: Workload) -> dict:
  dev = jax.local_devices()[0]
  return {
    "jax": jax.__version__,
    "backend": jax.default_backend(),
    "device": f"{dev.platform}:{getattr(dev, 'device_kind', '?')}",
    "devices": [str(d) for d in jax.devices()],
    "cpu_count": os.cpu_count(),
    "timing_env": {k: os.environ[k] for k in TIMING_ENV if k in os.environ},
    "python": platform.python_version(),
    "machine": platform.machine(),
    "command": command,
    "workload": workload.name,
    "description": workload.description,
    "eval": workload.eval_description,
  }


# Environment variables that change step times on CPU (RESULTS.md, "OpenBLAS threads on CPU",
# "XLA's step buffer and glibc's malloc"): a recorded command starts with the ones that were
# set, so it reproduces the run.
TIMING_ENV = (
  "OPENBLAS_NUM_THREADS",
  "OMP_NUM_THREADS",
  "OPENBLAS_THREAD_TIMEOUT",
  "MALLOC_ARENA_MAX",
  "MALLOC_MMAP_MAX_",
  "MALLOC_TRIM_THRESHOLD_",
  "LD_PRELOAD",
  "XLA_FLAGS",
)


def command_line(script: str, argv: Sequence[str] | None) -> str:
  """The command that reproduces this run, prefixed with the `TIMING_ENV` variables set."""
  env = [f"{k}={shlex.quote(os.environ[k])}" for k in TIMING_ENV if k in os.environ]
  cmd = shlex.join(
    [
      "python",
      os.path.relpath(os.path.abspath(script), os.getcwd()),
      *(sys.argv[1:] if argv is None else argv),
    ]
  )
  return " ".join([*env, cmd])


def compare_runs(
  runs: Sequence[Run], upstream: Run | dict | None, reach_window: int, total_steps: int
) -> dict:
  """Picks the tuned Adam, the target loss and each run's time to it; builds rows and ratios.

  The tuned Adam is the grid run with the lowest finite final evaluation loss. The target is
  its final training loss, smoothed by a trailing mean of `reach_window` steps (at most a
  tenth of the run). Mutates each run's summary (`time_to_target`, `time_to_target_s`) and
  returns `best` (the Run), `grid`, `tuned` (its row), `rows` (tuned Adam, the other
  contestants, upstream or its error row), `ratio_rows`, `curves`, `target`, `window`.
  """
  adam = [r for r in runs if r.summary["family"] == "adam"]
  if not adam:
    raise ValueError(
      "compare_runs needs at least one Adam run (family 'adam'), got the "
      f"families {[r.summary['family'] for r in runs]}."
    )
  finite = [r for r in adam if math.isfinite(r.summary["final_eval_loss"])]
  best = min(finite or adam, key=lambda r: r.summary["final_eval_loss"])
  grid = [
    {
      "learning_rate": r.summary["hyperparameters"]["learning_rate"],
      "final_eval_loss": r.summary["final_eval_loss"],
    }
    for r in adam
  ]
  all_runs = list(runs) + ([upstream] if isinstance(upstream, Run) else [])
  curves = {r.name: (r.losses, compare.curve_times(r.step_times, r.period)) for r in all_runs}
  window = max(1, min(reach_window, total_steps // 10))
  target = float(compare.smoothed(best.losses, window)[-1])
  for r in all_runs:
    hit = compare.time_to_reach(*curves[r.name], target, window)
    r.summary["time_to_target"] = hit
    r.summary["time_to_target_s"] = None if hit is None else hit[1]
  best_lr = best.summary["hyperparameters"]["learning_rate"]
  tuned = dict(best.summary, optimizer=f"Adam (tuned, lr={best_lr:g})")
  others = [r.summary for r in runs if r.summary["family"] != "adam"]
  rows = [tuned, *others] + (
    [upstream.summary if isinstance(upstream, Run) else upstream] if upstream is not None else []
  )
  ratio_rows = [
    (f"{r['optimizer']} / Adam (tuned)", ratios(r, tuned)) for r in rows[1:] if "error" not in r
  ]
  vs_upstream = None
  if isinstance(upstream, Run):
    ratio_rows += [
      (f"{r['optimizer']} / upstream", ratios(r, upstream.summary))
      for r in others
      if r["family"] in ("kfac", "kfac_optimizer")
    ]
    vs_upstream = upstream_budget(
      upstream,
      [r for r in runs if r.summary["family"] in ("kfac", "kfac_optimizer")],
      curves,
      window,
    )
  return {
    "best": best,
    "grid": grid,
    "tuned": tuned,
    "rows": rows,
    "ratio_rows": ratio_rows,
    "curves": curves,
    "target": target,
    "window": window,
    "vs_upstream": vs_upstream,
  }


def upstream_budget(upstream: Run, ours: Sequence[Run], curves, window: int) -> dict:
  """Issue 6's third target: the time each of our K-FAC runs needs to reach upstream's final
  (smoothed) training loss, as a fraction of upstream's whole training time (target <= 0.5).

  Returns `{"loss": upstream's final smoothed loss, "budget_s": its training seconds,
  "runs": {name: {"time_to_loss": (step, seconds) or None, "fraction": seconds / budget or
  None}}}`.
  """
  losses, times = curves[upstream.name]
  loss = float(compare.smoothed(losses, window)[-1])
  budget = float(np.sum(times))
  out = {}
  for r in ours:
    hit = compare.time_to_reach(*curves[r.name], loss, window)
    out[r.name] = {
      "time_to_loss": hit,
      "fraction": None if hit is None or budget <= 0 else hit[1] / budget,
    }
  return {"loss": loss, "budget_s": budget, "runs": out}


def upstream_budget_line(vs: Mapping[str, Any]) -> str:
  parts = []
  for name, v in vs["runs"].items():
    hit = v["time_to_loss"]
    parts.append(
      f"{name} not within its run"
      if hit is None
      else f"{name} at step {hit[0]} after {hit[1]:.2f} s ({v['fraction']:.2f}x)"
    )
  return (
    f"upstream's final loss {vs['loss']:.4g} after its {vs['budget_s']:.2f} s of "
    f"training (target: reach it in <= 0.5x that): " + "; ".join(parts) + "."
  )


def run_benchmark(
  workload: Workload, contestants: Sequence[Contestant], args, command: str
) -> dict:
  """Runs everything, prints the report, writes JSON / PNG; returns the JSON object."""
  total = args.warmup + args.steps
  print(f"{workload.name}: {workload.description}", flush=True)
  jax.jit(lambda x: x + 1).lower(1.0).compile()  # One-off JIT start-up, paid by nobody below.
  peak = DevicePeak()
  runs: list[Run] = []
  for c in contestants:
    print(f"running {c.name} ...", flush=True)
    runs.append(
      run_contestant(c, workload, args.steps, args.warmup, args.seed, args.compile_repeats, peak)
    )
  upstream: Run | dict | None = None
  if args.with_upstream:
    if workload.upstream is None:
      upstream = {
        "optimizer": UPSTREAM_NAME,
        "family": "upstream",
        "error": f"no upstream version of the {workload.name} workload",
      }
    else:
      upstream = run_upstream(workload, args, total)

  rep = compare_runs(runs, upstream, args.reach_window, total)
  best, grid, tuned, rows = rep["best"], rep["grid"], rep["tuned"], rep["rows"]
  ratio_rows, curves, target, window = (
    rep["ratio_rows"],
    rep["curves"],
    rep["target"],
    rep["window"],
  )
  best_lr = best.summary["hyperparameters"]["learning_rate"]
  adam = [r for r in runs if r.summary["family"] == "adam"]
  all_runs = runs + ([upstream] if isinstance(upstream, Run) else [])
  env = environment(command, workload)
  print()
  print(
    f"jax {env['jax']} on {env['device']} ({env['cpu_count']} CPUs), Python "
    f"{env['python']}; {args.warmup} warm-up + {args.steps} timed steps"
  )
  print(f"command: `{command}`")
  print()
  print(markdown_table(rows, ratio_rows, total, target))
  print()
  if rep["vs_upstream"] is not None:
    print(upstream_budget_line(rep["vs_upstream"]))
  print(
    "Adam grid (final loss per learning rate): "
    + ", ".join(f"lr={g['learning_rate']:g}: {_fmt(g['final_eval_loss'], '.4g')}" for g in grid)
    + f"; tuned = lr={best_lr:g}"
  )
  print(
    f"loss = {workload.eval_description}; compile = min over {args.compile_repeats} of "
    "jax.jit(step).lower(...).compile(); steps exclude compilation; peak memory = "
    f"{rows[0].get('peak_source')}; target = the tuned Adam's final training loss "
    f"(minibatch, trailing mean of {window}); seconds exclude compilation and the first "
    "step's one-off costs."
  )
  ours = registrations(workload)
  print(f"kfac_jax layer registrations: {_count(ours)}{_odd(ours)}.")
  if isinstance(upstream, Run):
    u = upstream.summary
    print(
      f"{u['optimizer']} (jax {u['upstream_env']['jax']}, own venv): compile = min first "
      f"step minus the {u['compile_baseline']}; its layer registrations: "
      f"{_count(u['registrations'])}{_odd(u['registrations'])}."
    )
  out = {
    "env": env,
    "kfac_jax_registrations": ours,
    "hyperparameters": {c.name: dict(c.hyperparameters) for c in contestants},
    "adam_grid": grid,
    "adam_tuned": tuned["optimizer"],
    "adam_tuned_run": best.name,
    "target_loss": target,
    "target_window": window,
    "vs_upstream": rep["vs_upstream"],
    "results": rows,
    "adam_grid_results": [r.summary for r in adam],
    "ratios": dict(ratio_rows),
    "curves": {
      r.name: {
        "losses": [float(x) for x in r.losses],
        "step_times_s": [float(x) for x in r.step_times],
      }
      for r in all_runs
    },
  }
  if args.plot:
    plot_curves = {
      (tuned["optimizer"] if r is best else r.name): curves[r.name]
      for r in all_runs
      if r.summary["family"] != "adam" or r is best
    }
    title = f"{workload.name}: {workload.description.split('; data:')[0]}"
    compare.plot_curves(plot_curves, args.plot, textwrap.fill(title, 150))
    print(f"wrote {args.plot}")
  if args.json:
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
      json.dump(out, f, indent=2, default=_json_default)
    print(f"wrote {args.json}")
  return out


def registrations(workload: Workload) -> list[dict]:
  """kfac_jax's layers for the workload, in the worker's format (`{"kind", "params"}`)."""
  example = jax.tree.map(jnp.asarray, workload.batch_at(0))
  specs = kfac_jax.Registration(workload.loss_fn, workload.params0, example).layers
  return [
    {
      "kind": s.kind + ("" if s.num_uses == 1 else f" ({s.num_uses} uses)"),
      "params": list(s.param_paths),
    }
    for s in specs
  ]


def _count(regs: Sequence[Mapping[str, Any]]) -> str:
  counts: dict[str, int] = {}
  for r in regs:
    counts[r["kind"]] = counts.get(r["kind"], 0) + 1
  return ", ".join(f"{n} {k}" for k, n in counts.items()) or "none"


def _odd(regs: Sequence[Mapping[str, Any]]) -> str:
  """The parameters of generic / embedding / multi-use registrations (the interesting ones)."""
  odd = [
    f"{'+'.join(r['params'])} as {r['kind']}"
    for r in regs
    if r["kind"].split(" ")[0]
    not in ("dense", "conv", "conv2d", "scale_and_shift", "repeated_dense")
  ]
  return "" if not odd else " (" + "; ".join(odd) + ")"


def _json_default(x):
  if isinstance(x, (np.floating, np.integer)):
    return x.item()
  if isinstance(x, np.ndarray):
    return x.tolist()
  raise TypeError(f"not JSON-serialisable: {type(x).__name__}")


def main(parse_args: Callable, make_workload: Callable, script: str, argv=None) -> int:
  """A benchmark script's entry point: parse, build the workload, run the standard contestants."""
  args = parse_args(argv)
  workload = make_workload(args)
  run_benchmark(workload, standard_contestants(workload, args), args, command_line(script, argv))
  return 0


# -- the race (issue 14): a fixed budget of training seconds per contestant ---------------------


def charged_seconds(step_times: Sequence[float], period: int) -> float:
  """The training seconds the race charges for these steps: each step its measured time, the
  first one (which carries one-off costs) counted as a typical step of its phase
  (`compare.curve_times`, the same axis the curves and the time to target use). A lone first
  step is charged nothing: its typical cost is known only once a second step has run."""
  if len(step_times) < 2:
    return 0.0
  return float(np.sum(compare.curve_times(step_times, period)))


def run_for_budget(
  prepare: Callable[[int], Any],
  step: Callable[[int, Any], Any],
  budget_s: float,
  *,
  period: int = 1,
  max_steps: int | None = None,
  clock: Callable[[], float] = time.perf_counter,
) -> list[float]:
  """Runs `step(t, prepare(t))` for t = 0, 1, ... while the charged seconds are below the budget.

  Only `step` is timed (it must block until its results are ready); `prepare` (the batch, the
  rng) is not charged. A step starts only while `charged_seconds` of the steps so far is below
  `budget_s`, so a run overshoots the budget by less than one step; `max_steps` caps the steps.
  Returns the measured time of every step.
  """
  if not budget_s > 0:
    raise ValueError(f"the budget must be > 0 seconds, got {budget_s}.")
  times: list[float] = []
  charged = _Charger(period)
  while (max_steps is None or len(times) < max_steps) and charged.seconds() < budget_s:
    t = len(times)
    prepared = prepare(t)
    start = clock()
    step(t, prepared)
    times.append(clock() - start)
    charged.add(times[-1])
  return times


class _Charger:
  """`charged_seconds` of a growing list of step times in O(log n) per step (a run on a fast
  device has 10^5 steps): the sum of steps 1... plus the median of the later steps in step 0's
  phase (of all later steps while there is none), kept sorted."""

  def __init__(self, period: int):
    self.period, self.n, self.rest = period, 0, 0.0
    self.phase: list[float] = []
    self.later: list[float] = []

  def add(self, dt: float) -> None:
    if self.n:
      self.rest += dt
      bisect.insort(self.later, dt)
      if self.period >= 1 and self.n % self.period == 0:
        bisect.insort(self.phase, dt)
    self.n += 1

  def seconds(self) -> float:
    if self.n < 2:
      return 0.0
    xs = self.phase or self.later
    k = len(xs)
    median = xs[k // 2] if k % 2 else 0.5 * (xs[k // 2 - 1] + xs[k // 2])
    return self.rest + median


def run_contestant_for_budget(
  c: Contestant, workload: Workload, budget_s: float, seed: int, max_steps: int | None = None
) -> Run:
  """One contestant of the race: init, one AOT compilation (timed, not charged), then steps
  until `budget_s` charged seconds (`run_for_budget`), then the evaluation loss (not charged)."""
  params = jax.tree.map(jnp.copy, workload.params0)
  t0 = time.perf_counter()
  state = jax.block_until_ready(c.init(params))
  setup_s = time.perf_counter() - t0
  rng = jax.random.key(seed + 1)
  example = jax.tree.map(jnp.asarray, workload.batch_at(0))
  t0 = time.perf_counter()
  compiled = jax.jit(c.step, donate_argnums=(0, 1)).lower(params, state, example, rng).compile()
  compile_s = time.perf_counter() - t0
  carry = {"params": params, "state": state, "rng": rng}
  losses: list[jax.Array] = []

  def prepare(t):
    batch = jax.tree.map(jax.device_put, workload.batch_at(t))
    carry["rng"], sub = jax.random.split(carry["rng"])
    return jax.block_until_ready((batch, sub))

  def step(t, prepared):
    del t
    out = compiled(carry["params"], carry["state"], *prepared)
    carry["params"], carry["state"], loss = jax.block_until_ready(out)
    losses.append(loss)

  times = run_for_budget(prepare, step, budget_s, period=c.period, max_steps=max_steps)
  losses_np = np.asarray([float(x) for x in losses])
  final = workload.eval_fn(carry["params"])
  extra = extra_eval(workload, carry["params"])
  summary = race_summary(
    c.name,
    c.family,
    losses_np,
    times,
    c.period,
    budget_s,
    hyperparameters=dict(c.hyperparameters),
    setup_s=setup_s,
    compile_s=compile_s,
    final_eval_loss=final,
    extra_eval=extra,
  )
  return Run(c.name, losses_np, np.asarray(times), c.period, summary)


def race_summary(
  name: str, family: str, losses, times, period: int, budget_s: float, **extra
) -> dict:
  """A race row: steps, charged seconds, mean and median step of the charged times."""
  charged = compare.curve_times(times, period)
  out = {
    "optimizer": name,
    "family": family,
    "steps": len(times),
    "charged_s": float(np.sum(charged)),
    "budget_s": budget_s,
    "mean_step_ms": 1e3 * float(np.mean(charged)) if len(times) else None,
    "median_step_ms": 1e3 * float(np.median(charged)) if len(times) else None,
    "finite": bool(np.all(np.isfinite(losses))),
    "last_minibatch_loss": float(losses[-1]) if len(losses) else None,
  }
  out.update(extra)
  return out


def run_upstream_for_budget(
  workload: Workload, args, budget_s: float, max_steps: int
) -> Run | dict:
  """Upstream kfac-jax in its venv for `budget_s` charged seconds (the worker's `budget_s`)."""
  try:
    python = compare.ensure_venv(args.upstream_python)
    pools, idx = workload.upstream_data(max_steps)
    config = _upstream_config(workload, args, compile_repeats=1, budget_s=budget_s)
    print(f"running upstream kfac-jax ({python}) ...", flush=True)
    report, final = compare.run_worker(python, jax.device_get(workload.params0), pools, idx, config)
  except compare.UpstreamFailed as e:
    print(f"upstream failed:\n{e}", flush=True)
    return {
      "optimizer": UPSTREAM_NAME,
      "family": "upstream",
      "error": e.exception or "the worker failed (see the log above)",
    }
  except (RuntimeError, OSError) as e:  # No venv, or it could not be created.
    print(f"upstream failed:\n{e}", flush=True)
    return {"optimizer": UPSTREAM_NAME, "family": "upstream", "error": str(e).splitlines()[0]}
  final_params = jax.tree.map(jnp.asarray, final)
  final_loss = workload.eval_fn(final_params)
  extra = extra_eval(workload, final_params)
  losses = np.asarray(report["losses"], float)
  times = np.asarray(report["step_times_s"], float)
  summary = race_summary(
    report["optimizer"],
    "upstream",
    losses,
    times,
    args.inverse_every,
    budget_s,
    hyperparameters=_upstream_hyperparameters(args),
    setup_s=report["init_s"],
    compile_s=report["compile_s"],
    final_eval_loss=final_loss,
    extra_eval=extra,
    upstream_env={k: report[k] for k in ("upstream_version", "jax", "python", "backend")},
  )
  return Run(report["optimizer"], losses, times, args.inverse_every, summary)


def best_of(runs: Sequence[Run], family: str) -> Run | None:
  """The run of `family` with the lowest finite final evaluation loss (None if none ran)."""
  fam = [r for r in runs if r.summary["family"] == family]
  finite = [r for r in fam if math.isfinite(r.summary["final_eval_loss"])]
  return min(finite or fam, key=lambda r: r.summary["final_eval_loss"]) if fam else None


GRID_FAMILIES = {"adam": "Adam", "muon": "Muon", "soap": "SOAP"}
"""The race's families run over a learning-rate grid, each reported by its best run."""


def race_compare(runs: Sequence[Run], reach_window: int) -> dict:
  """The race's reference and each run's time to it.

  The tuned Adam is the Adam run ("adam" family) with the lowest final evaluation loss; the
  target is its final training loss, smoothed by a trailing mean of `reach_window` steps (at most
  a tenth of its steps). Each run gets `time_to_target` ((step, charged seconds) or None) and
  `vs_adam` (its seconds / the tuned Adam's own seconds to the target). Grids (`GRID_FAMILIES`)
  are reported by their best run, renamed "<Family> (tuned, lr=...)". Returns `rows` (tuned Adam
  first), `target`, `window`, `adam_seconds`, `grids` {family: [(lr, loss)]}, `best` (family →
  Run) and `curves` (name → (losses, charged step times)).
  """
  adam = best_of(runs, "adam")
  if adam is None:
    raise ValueError(
      "race_compare needs at least one Adam run (family 'adam'), got the "
      f"families {[r.summary['family'] for r in runs]}."
    )
  window = max(1, min(reach_window, len(adam.losses) // 10))
  target = float(compare.smoothed(adam.losses, window)[-1])
  curves = {r.name: (r.losses, compare.curve_times(r.step_times, r.period)) for r in runs}
  for r in runs:
    hit = compare.time_to_reach(*curves[r.name], target, window) if len(r.losses) else None
    r.summary["time_to_target"] = hit
    r.summary["time_to_target_s"] = None if hit is None else hit[1]
  adam_s = adam.summary["time_to_target_s"]
  for r in runs:
    r.summary["vs_adam"] = _ratio(r.summary["time_to_target_s"], adam_s)
  grids, best, rows = {}, {}, []
  for fam, label in GRID_FAMILIES.items():
    b = best_of(runs, fam)
    if b is None:
      continue
    best[fam] = b
    grids[fam] = [
      (r.summary["hyperparameters"]["learning_rate"], r.summary["final_eval_loss"])
      for r in runs
      if r.summary["family"] == fam
    ]
    rows.append(
      dict(
        b.summary,
        optimizer=f"{label} (tuned, lr={b.summary['hyperparameters']['learning_rate']:g})",
      )
    )
  rows += [r.summary for r in runs if r.summary["family"] not in GRID_FAMILIES]
  return {
    "rows": rows,
    "target": target,
    "window": window,
    "adam_seconds": adam_s,
    "grids": grids,
    "best": best,
    "curves": curves,
  }


def race_table(rows: Sequence[Mapping[str, Any]], budget_s: float, target: float) -> str:
  """The markdown table of the race (a failed contestant shows its error). A workload's extra
  evaluations get a column each: the value at the budget and its ratio to the tuned Adam's
  (the first "adam" row)."""
  labels = list(dict.fromkeys(k for r in rows for k in r.get("extra_eval", {})))
  adam = next((r for r in rows if r.get("family") == "adam" and "error" not in r), None)
  lines = [
    (
      f"| contestant | loss at {budget_s:g} s | seconds to {target:.4g} | vs Adam | steps "
      "| mean step (ms) | compile (s) |"
      + "".join(f" {label} at {budget_s:g} s (vs Adam) |" for label in labels)
    ),
    "|---|---:|---:|---:|---:|---:|---:|" + "---:|" * len(labels),
  ]
  for r in rows:
    if "error" in r:
      lines.append(
        f"| {r['optimizer']} | failed: {r['error'].replace('|', '/')} | | | | | |"
        + " |" * len(labels)
      )
      continue
    loss = _fmt(r["final_eval_loss"], ".4g") + ("" if r["finite"] else " (non-finite)")
    hit = r.get("time_to_target")
    vs = r.get("vs_adam")
    cells = []
    for label in labels:
      value = r.get("extra_eval", {}).get(label)
      ref = None if adam is None else adam.get("extra_eval", {}).get(label)
      ratio = _ratio(value, ref)
      cells.append(_fmt(value, ".4g", "") + ("" if ratio is None else f" ({ratio:.2f}x)"))
    lines.append(
      f"| {r['optimizer']} | {loss} | "
      f"{'not reached' if hit is None else format(hit[1], '.1f')} | "
      f"{'' if vs is None else format(vs, '.2f') + 'x'} | {r['steps']:,} | "
      f"{_fmt(r['mean_step_ms'], '.1f')} | {_fmt(r['compile_s'], '.2f')} |"
      + "".join(f" {c} |" for c in cells)
    )
  return "\n".join(lines)
