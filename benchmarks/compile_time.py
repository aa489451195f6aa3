"""Compile time of the first training step: K-FAC's three fronts against Adam.

For each workload and front, two launches, each a fresh process: the first with an empty
persistent compilation cache (cold), the second with the cache the first filled (any later run
of the same script). Each times `jax.jit(step, donate_argnums=(0, 1))` ahead of time:
`.trace(...)` (Python and the library's tracing), `.lower()` (StableHLO) and `.compile()`
(XLA), and reports whether the compile was a persistent-cache hit. The table gives each
front's seconds and their ratio to Adam's in the same launch kind.

Fronts: `scale_by_kfac` (chained with a learning rate, statistics from `value_and_grad`),
`kfac` (the race's contestant: lr 1, momentum 0.7, statistics from `batch=` every 5 updates),
`Optimizer` (adaptive learning rate, momentum and damping) and Adam. Workloads: the race's
autoencoder, CNN and Transformer (`--quick`: their small models), zoo models
(`zoo:NAME`, tests/_zoo.py's linen builders) and a physics-informed network
(`examples/pinn_poisson.py`, `--pinn-sizes`, forward Laplacian, exact Gauss-Newton).

    python benchmarks/compile_time.py                   # the race workloads and the PINN
    python benchmarks/compile_time.py --workloads cnn,zoo:resnet,zoo:transformer --clock cpu
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FRONTS = ("adam", "scale_by_kfac", "kfac", "optimizer")
RACE = ("autoencoder", "cnn", "transformer")
DEFAULT_WORKLOADS = ("autoencoder", "cnn", "transformer", "pinn")


def build(
  workload: str,
  front: str,
  quick: bool = False,
  pinn_sizes: tuple[int, ...] = (2, 64, 64, 64, 64, 1),
  config: dict | None = None,
):
  """`(step, args)`: the workload's training step `step(params, state, batch, rng) ->
  (params, state, loss)` for `front`, and its first call's arguments (state from `init`).
  `config`: `kfac_jax.Config` fields for the K-FAC fronts (the PINN's example fronts keep
  theirs)."""
  sys.path.insert(0, _ROOT)
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top

  import kfac_jax  # pylint: disable=g-import-not-at-top
  from benchmarks import _harness  # pylint: disable=g-import-not-at-top

  rng = jax.random.key(0)
  reg = None
  config = config or {}
  if workload in RACE:
    import importlib  # pylint: disable=g-import-not-at-top

    module = importlib.import_module(f"benchmarks.{workload}")
    w = module.make_workload(
      module.parse_args(["--steps", "1", "--warmup", "0"] + (["--quick"] if quick else []))
    )
    loss_fn, params = w.loss_fn, w.params0
    batch = jax.tree.map(jnp.asarray, w.batch_at(0))
  elif workload.startswith("zoo:"):
    from tests import _zoo  # pylint: disable=g-import-not-at-top

    z = _zoo.MODELS[workload[4:]]("linen")
    if z.has_aux:
      raise ValueError(f"{workload}: a model with state (has_aux) is not supported here")
    loss_fn, params, batch = z.loss_fn, z.params, z.batch
  elif workload == "pinn":
    from examples import pinn_poisson as pinn  # pylint: disable=g-import-not-at-top

    jax.config.update("jax_enable_x64", True)
    problem = pinn.make_problem()
    loss_fn, params, batch = pinn.loss_fn, pinn.init_params(sizes=pinn_sizes), problem.batch
    reg = kfac_jax.Registration(loss_fn, params, batch, estimation_mode="exact_GGN")
  else:
    raise ValueError(f"unknown workload {workload!r}")

  if front == "adam":
    c = _harness.first_order("adam", "adam", loss_fn, optax.adam(1e-3))
    return c.step, (params, c.init(params), batch, rng)
  if front == "scale_by_kfac":
    kw = {"registration": reg} if reg is not None else {"loss_fn": loss_fn, "example_batch": batch}
    kw |= {"config": kfac_jax.Config(**config)} if config else {}
    tx = optax.chain(kfac_jax.scale_by_kfac(**kw), optax.scale_by_learning_rate(0.1))
    step = _harness.kfac_step(loss_fn, tx, from_batch=False, registration=reg)
    return step, (params, tx.init(params), batch, rng)
  if front == "kfac":
    if workload == "pinn":  # The example's K-FAC: exact GGN, grid line search.
      tx, reg = pinn.make_kfac(params, batch)
      ls = pinn.linesearch_step(tx, reg, batch)
      return (lambda p, s, b, r: ls(p, s)), (params, tx.init(params), batch, rng)
    c = _harness.kfac_transform(
      loss_fn,
      batch,
      learning_rate=1.0,
      momentum=0.7,
      damping=0.1,
      ema_decay=0.95,
      inverse_every=5,
      curvature_every=5,
      **config,
    )
    return c.step, (params, c.init(params), batch, rng)
  if front == "optimizer":
    if workload == "pinn":
      opt = kfac_jax.pinn.optimizer(pinn.loss_fn, params, batch)
    else:
      opt = kfac_jax.Optimizer(
        loss_fn,
        batch,
        damping=1.0,
        inverse_every=5,
        config=kfac_jax.Config(**({"min_damping": 1e-4} | config)),
      )

    def step(p, s, b, r):
      p, s, info = opt.step(p, s, b, r)
      return p, s, info["loss"]

    return step, (params, opt.init(params), batch, rng)
  raise ValueError(f"unknown front {front!r}")


def worker(workload: str, front: str, cache: str, quick: bool, pinn_sizes) -> dict:
  """One launch: seconds to trace, lower and compile the step's first call, the persistent
  cache's hits and entries written for it, the lowered program's size and how many host
  callbacks it holds (JAX neither reads nor writes the cache for a program with one)."""
  import jax  # pylint: disable=g-import-not-at-top

  events: list[str] = []
  jax.monitoring.register_event_listener(lambda name, **kw: events.append(name))
  if cache:
    jax.config.update("jax_compilation_cache_dir", cache)
    # Cache every program: the defaults skip those that compile in under a second.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  jax.jit(lambda x: x + 1).lower(1.0).compile()  # The process's one-off JIT start-up.
  step, args = build(workload, front, quick, pinn_sizes)
  jax.block_until_ready(args)
  events.clear()
  fn = jax.jit(step, donate_argnums=(0, 1))
  t0, c0 = time.perf_counter(), time.process_time()
  traced = fn.trace(*args)
  t1 = time.perf_counter()
  lowered = traced.lower()
  t2, c2 = time.perf_counter(), time.process_time()
  lowered.compile()
  t3, c3 = time.perf_counter(), time.process_time()
  text = lowered.as_text()
  return {
    "trace": t1 - t0,
    "lower": t2 - t1,
    "compile": t3 - t2,
    "trace_lower_cpu": c2 - c0,
    "compile_cpu": c3 - c2,
    "hits": events.count("/jax/compilation_cache/cache_hits"),
    # JAX records this event when it writes an entry.
    "written": events.count("/jax/compilation_cache/cache_misses"),
    "lines": text.count("\n"),
    "callbacks": text.count("callback"),
  }


def launch(workload, front, cache, args) -> dict:
  cmd = [sys.executable, os.path.abspath(__file__), "--worker", workload, front, cache]
  cmd += ["--pinn-sizes", ",".join(map(str, args.pinn_sizes))] + (["--quick"] if args.quick else [])
  res = subprocess.run(cmd, capture_output=True, text=True, cwd=_ROOT)
  if res.returncode:
    sys.stderr.write(res.stderr[-3000:])
    raise RuntimeError(f"{workload} / {front}: the worker failed (exit {res.returncode})")
  return json.loads(res.stdout.strip().splitlines()[-1])


def _min(runs: list[dict]) -> dict:
  """Per field, the smallest of repeated launches (the least disturbed by other load)."""
  return {k: min(r[k] for r in runs) for k in runs[0]}


def _seconds(r: dict, part: str, clock: str) -> float:
  if clock == "cpu":
    return r["trace_lower_cpu"] if part == "trace_lower" else r["compile_cpu"]
  return r["trace"] + r["lower"] if part == "trace_lower" else r["compile"]


def table(results: dict, clock: str = "wall") -> str:
  """Markdown: per workload and front, the seconds (`clock`: "wall" or "cpu", the process's
  CPU time over all its threads) and their ratios to Adam's in the same kind of launch."""
  unit = "s" if clock == "wall" else "CPU s"
  lines = [
    f"| workload | front | trace + lower, {unit} | compile cold, {unit} | compile, cache "
    f"filled, {unit} | cache hit | trace + lower / Adam | cold / Adam | filled / Adam "
    "| StableHLO lines |",
    "|---|---|---:|---:|---:|:---:|---:|---:|---:|---:|",
  ]
  for workload, fronts in results.items():
    adam = fronts.get("adam")
    for front, (cold, warm) in fronts.items():
      got = [
        _seconds(cold, "trace_lower", clock),
        _seconds(cold, "compile", clock),
        _seconds(warm, "compile", clock),
      ]
      if adam is None:
        ratios = ["n/a"] * 3
      else:
        ref = [
          _seconds(adam[0], "trace_lower", clock),
          _seconds(adam[0], "compile", clock),
          _seconds(adam[1], "compile", clock),
        ]
        ratios = [f"{x / max(y, 1e-9):.1f}x" for x, y in zip(got, ref)]
      lines.append(
        f"| {workload} | {front} | {got[0]:.2f} | {got[1]:.2f} | {got[2]:.2f} | "
        f"{'yes' if warm['hits'] else 'no'} | {' | '.join(ratios)} | {cold['lines']:,} |"
      )
  return "\n".join(lines)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(
    description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
  )
  p.add_argument("--workloads", default=",".join(DEFAULT_WORKLOADS), help="comma-separated")
  p.add_argument("--fronts", default=",".join(FRONTS), help="comma-separated")
  p.add_argument("--quick", action="store_true", help="the race workloads' small models")
  p.add_argument(
    "--pinn-sizes", default="2,64,64,64,64,1", help="the PINN's widths (5 dense layers)"
  )
  p.add_argument("--repeats", type=int, default=1, help="launch pairs per row (minimum kept)")
  p.add_argument(
    "--clock",
    choices=("wall", "cpu"),
    default="wall",
    help="the table's seconds: wall time, or the process's CPU time (steadier on a shared "
    "machine; XLA compiles on several threads)",
  )
  p.add_argument("--json", default=None, help="also write the results here")
  p.add_argument("--from-json", default=None, help="print the table of an earlier --json")
  p.add_argument("--worker", nargs=3, default=None, help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  args.pinn_sizes = tuple(int(s) for s in args.pinn_sizes.split(","))
  if args.worker:
    workload, front, cache = args.worker
    print(json.dumps(worker(workload, front, cache, args.quick, args.pinn_sizes)))
    return 0
  if args.from_json:
    with open(args.from_json) as f:
      print(table(json.load(f), args.clock))
    return 0
  fronts = [f for f in args.fronts.split(",") if f]
  for f in fronts:
    if f not in FRONTS:
      p.error(f"unknown front {f!r}; choose from {', '.join(FRONTS)}")
  results: dict = {}
  for workload in (w for w in args.workloads.split(",") if w):
    results[workload] = {}
    for front in fronts:
      colds, warms = [], []
      for _ in range(args.repeats):
        with tempfile.TemporaryDirectory() as cache:
          colds.append(launch(workload, front, cache, args))
          warms.append(launch(workload, front, cache, args))
      results[workload][front] = (_min(colds), _min(warms))
      print(f"{workload} / {front}: {results[workload][front]}", file=sys.stderr, flush=True)
  print(table(results, args.clock))
  if args.json:
    with open(args.json, "w") as f:
      json.dump(results, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
