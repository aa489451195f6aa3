"""Benchmark: K-FAC vs Adam on the deep autoencoder (784-1000-500-250-30-250-500-1000-784).

For each optimizer, on the same init and the same minibatch sequence, measures:

* setup time: building the transform and `tx.init(params)` (for K-FAC this includes scanning
  `loss_fn` for layers);
* compile time: wall time of `jax.jit(step).lower(...).compile()` (tracing + lowering + XLA
  compilation), measured separately from training: after one warm-up compilation of a trivial
  function (so neither optimizer pays the process's one-off JIT start-up), each optimizer's step
  is compiled `--compile-repeats` times, alternating between the optimizers and clearing JAX's
  caches before each, and the minimum is reported (compile wall time is noisy on a shared CPU);
* step time: median and mean over `--steps` timed steps after `--warmup` untimed ones, each
  step followed by `jax.block_until_ready`. With `--inverse-every 5`, one K-FAC step in five also
  recomputes the factor inverses: the median is a typical step without it, the mean includes
  its amortised cost;
* loss: of the final parameters after `warmup + steps` steps, on a fixed set of 10,000 training
  images.

The curvature statistics are updated every step. Prints a Markdown table with absolute numbers
and the K-FAC / Adam ratios, plus the jax version, CPU count and the exact command.

With `--with-upstream`, DeepMind's kfac-jax 0.0.8 is a third contestant: it runs in its own
virtualenv (`.venv-upstream/`, created by `benchmarks/upstream/setup_venv.sh` if missing) as a
subprocess (`benchmarks/upstream/worker.py`), from the same initial parameters on the same
minibatches, with its adaptive features off and our learning rate, momentum, damping, EMA decay and
inverse period. Its compile time is its first step's wall time minus a typical inverse-update step
(its `step` compiles on first call; there is no public lower/compile); its final parameters are
evaluated here, by the same code as ours. The table then gains a kfac_jax / upstream ratio row,
the output says how long each optimizer needs to reach upstream's final training loss, and
`--plot` (default `out/autoencoder_upstream.png`) gets the three loss curves against steps and
against seconds. See `benchmarks/upstream/README.md` for what could not be matched exactly.

    python benchmarks/autoencoder.py                       # defaults: about 1-2 minutes on 2 CPUs
    python benchmarks/autoencoder.py --steps 50 --json out/ae_bench.json
    python benchmarks/autoencoder.py --with-upstream --steps 5 --warmup 1 --compile-repeats 1
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
  sys.path.insert(0, _ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from benchmarks.upstream import compare  # noqa: E402
from examples import autoencoder as ae  # noqa: E402
from examples import data as data_lib  # noqa: E402

DEFAULT_UPSTREAM_PLOT = os.path.join("out", "autoencoder_upstream.png")


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  p.add_argument("--steps", type=int, default=100, help="timed steps per optimizer")
  p.add_argument("--warmup", type=int, default=5, help="untimed steps before the timed ones")
  p.add_argument("--batch-size", type=int, default=1000)
  p.add_argument("--inverse-every", type=int, default=5, help="K-FAC inverse period")
  p.add_argument("--kfac-lr", type=float, default=ae.DEFAULT_KFAC_LR)
  p.add_argument("--kfac-momentum", type=float, default=ae.DEFAULT_KFAC_MOMENTUM,
                 help="0 disables momentum")
  p.add_argument("--damping", type=float, default=ae.DEFAULT_DAMPING)
  p.add_argument("--ema-decay", type=float, default=ae.DEFAULT_EMA_DECAY)
  p.add_argument("--adam-lr", type=float, default=ae.DEFAULT_ADAM_LR)
  p.add_argument("--data-dir", default=None, help="MNIST-format idx files (see examples/data.py)")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--compile-repeats", type=int, default=3,
                 help="compilations per optimizer for the compile time (minimum reported)")
  p.add_argument("--json", metavar="OUT", default=None, help="also write the results as JSON")
  p.add_argument("--with-upstream", action="store_true",
                 help="add DeepMind kfac-jax 0.0.8 (own venv, subprocess) as a third contestant")
  p.add_argument("--upstream-python", default=None,
                 help="python of a venv with kfac-jax 0.0.8 (default: .venv-upstream/bin/python, "
                      "created by benchmarks/upstream/setup_venv.sh if missing)")
  p.add_argument("--plot", metavar="PNG", default=None,
                 help="write loss-vs-steps and loss-vs-seconds curves (default with "
                      f"--with-upstream: {DEFAULT_UPSTREAM_PLOT})")
  p.add_argument("--reach-window", type=int, default=5,
                 help="with --with-upstream: trailing-mean window of the minibatch losses used "
                      "for the time to reach upstream's final loss (at most a tenth of the run)")
  args = p.parse_args(argv)
  if args.steps < 1 or args.warmup < 0:
    p.error("--steps must be >= 1 and --warmup >= 0")
  if args.with_upstream and args.warmup < 1:
    p.error("--with-upstream needs --warmup >= 1: upstream's first step includes its compilation")
  if args.reach_window < 1:
    p.error("--reach-window must be >= 1")
  if args.with_upstream and args.plot is None:
    args.plot = DEFAULT_UPSTREAM_PLOT
  return args


def run_one(name, make_tx, make_step, loss_fn, params0, images, idx, warmup, seed, eval_fn):
  t0 = time.perf_counter()
  tx = make_tx()
  params = jax.tree.map(jnp.copy, params0)
  opt_state = jax.block_until_ready(tx.init(params))
  setup = time.perf_counter() - t0
  r = ae.train(name, make_step(loss_fn, tx), params, opt_state, images, idx, seed, eval_fn,
               progress=False)
  summary = compare.summarize(name, r.step_times, r.losses, warmup, setup_s=setup,
                              compile_first_s=r.compile_time, final_eval_loss=r.final_loss)
  return summary, r


def compile_times(optimizers, loss_fn, params, example, repeats):
  """Per optimizer, `repeats` wall times of jit(step).lower(...).compile(), interleaved."""
  jax.jit(lambda x: x + 1).lower(1.0).compile()  # One-off JIT start-up, paid by nobody below.
  states = [tx.init(params) for tx, _ in optimizers]
  rng = jax.random.key(0)
  out = [[] for _ in optimizers]
  for _ in range(repeats):
    for k, ((tx, make_step), state) in enumerate(zip(optimizers, states)):
      jax.clear_caches()
      t0 = time.perf_counter()
      jax.jit(make_step(loss_fn, tx), donate_argnums=(0, 1)).lower(
          params, state, example, rng).compile()
      out[k].append(time.perf_counter() - t0)
  return out


def main(argv=None) -> int:
  args = parse_args(argv)
  command = shlex.join(["python",
                        os.path.relpath(os.path.abspath(__file__), os.getcwd()),
                        *(sys.argv[1:] if argv is None else argv)])
  ds = data_lib.load_dataset("fashion_mnist", args.data_dir)
  images = ds.train_images
  model = ae.make_model(ds.num_features)
  loss_fn = ae.make_loss_fn(model)
  params0 = ae.init_params(model, args.seed)
  n_params = sum(int(np.prod(p.shape)) for p in jax.tree.leaves(params0))
  total = args.warmup + args.steps
  idx = ae.batch_indices(images.shape[0], args.batch_size, total, args.seed)
  eval_fn = ae.make_eval_fn(loss_fn, images[:10000])
  example = jnp.asarray(images[idx[0]])

  def make_kfac():
    return ae.make_kfac(loss_fn, example, learning_rate=args.kfac_lr,
                        momentum=args.kfac_momentum, damping=args.damping,
                        ema_decay=args.ema_decay, inverse_every=args.inverse_every)

  print(f"data: {ds.source}", flush=True)
  print(f"model: {n_params:,} parameters; {args.warmup} warm-up + {args.steps} timed steps of "
        f"batch {idx.shape[1]}", flush=True)
  results, runs = [], []
  for name, make_tx, make_step in (("kfac_jax", make_kfac, ae.make_kfac_step),
                                   ("Adam", lambda: optax.adam(args.adam_lr), ae.make_adam_step)):
    print(f"running {name} ...", flush=True)
    summary, run = run_one(name, make_tx, make_step, loss_fn, params0, images, idx, args.warmup,
                           args.seed, eval_fn)
    results.append(summary)
    runs.append(run)
  compile_s = compile_times(
      [(make_kfac(), ae.make_kfac_step), (optax.adam(args.adam_lr), ae.make_adam_step)],
      loss_fn, params0, example, args.compile_repeats)
  for r, c in zip(results, compile_s):
    r["compile_s"] = min(c)
    r["compile_all_s"] = c
  kfac, adam = results
  ratios = {
      "median_step": kfac["median_step_ms"] / adam["median_step_ms"],
      "mean_step": kfac["mean_step_ms"] / adam["mean_step_ms"],
      "compile": kfac["compile_s"] / adam["compile_s"],
  }
  upstream = None
  if args.with_upstream:
    upstream, upstream_run = run_upstream(args, model, params0, images, idx, eval_fn)
    results.append(upstream)
    runs.append(upstream_run)
    ratios_upstream = compare.ratios(kfac, upstream)
  env = {
      "jax": jax.__version__,
      "backend": jax.default_backend(),
      "devices": [str(d) for d in jax.devices()],
      "cpu_count": os.cpu_count(),
      "python": platform.python_version(),
      "machine": platform.machine(),
      "command": command,
      "dataset": ds.source,
      "batch_size": int(idx.shape[1]),
      "inverse_every": args.inverse_every,
      "hyperparameters": {"kfac_lr": args.kfac_lr, "kfac_momentum": args.kfac_momentum,
                          "damping": args.damping, "ema_decay": args.ema_decay,
                          "adam_lr": args.adam_lr},
  }

  print()
  print(f"jax {env['jax']} ({env['backend']}), {env['cpu_count']} CPUs, Python {env['python']}; "
        f"batch {env['batch_size']}, inverses every {args.inverse_every} steps, curvature "
        f"statistics every step")
  print(f"command: `{command}`")
  print()
  # Loss curves against training seconds: every run's first step (one-off costs; upstream's
  # compilation) is replaced by its median same-phase step, see compare.curve_times.
  curves = {r.name: (r.losses, compare.curve_times(r.step_times, args.inverse_every))
            for r in runs}
  ratio_rows = [("kfac/adam", ratios)]
  if upstream is not None:
    ratio_rows.append(("kfac_jax/upstream", ratios_upstream))
  print(compare.markdown_table(results, ratio_rows, total))
  print()
  print(f"compile = minimum over {args.compile_repeats} interleaved runs of "
        "jax.jit(step).lower(...).compile() after a warm-up compilation; steps exclude "
        "compilation; loss = mean over 10,000 training images.")
  out = {"env": env, "results": results, "ratios": ratios}
  if upstream is not None:
    print(f"{upstream['optimizer']} (jax {upstream['upstream_env']['jax']}, own venv): compile = "
          f"min over {len(upstream['first_step_all_s'])} first step(s) on a fresh optimizer "
          f"minus the {upstream['compile_baseline']} ({1e3 * upstream['compile_baseline_s']:.0f}"
          " ms; its step compiles on first call); setup = its init (graph matching + "
          "compiled init). kfac_jax/upstream loss column = ratio of the final losses after "
          "the same steps.")
    print()
    reach = reach_to_upstream(curves, upstream["optimizer"], args.reach_window)
    print("\n".join(compare.reach_lines(upstream["optimizer"], reach["target"], reach["reached"],
                                        reach["window"])))
    hit_ours, hit_up = reach["reached"]["kfac_jax"], reach["reached"][upstream["optimizer"]]
    if hit_ours is not None and hit_up is not None and hit_up[1] > 0:
      print(f"- kfac_jax / upstream time to that loss: {hit_ours[1] / hit_up[1]:.2f}x")
    out["ratios_upstream"] = ratios_upstream
    out["time_to_upstream_final_loss"] = reach
  if args.plot:
    title = (f"{n_params:,}-parameter autoencoder on {ds.name}, batch {idx.shape[1]}; K-FAC lr="
             f"{args.kfac_lr} momentum={args.kfac_momentum} damping={args.damping}, Adam lr="
             f"{args.adam_lr}")
    compare.plot_curves(curves, args.plot, title)
    print(f"wrote {args.plot}")
  if args.json:
    out["curves"] = {r.name: {"losses": [float(x) for x in r.losses],
                              "step_times_s": [float(x) for x in r.step_times]} for r in runs}
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
      json.dump(out, f, indent=2)
    print(f"wrote {args.json}")
  return 0


def run_upstream(args, model, params0, images, idx, eval_fn):
  """DeepMind kfac-jax 0.0.8 in its own venv: (summary row, RunResult for the plot)."""
  python = compare.ensure_venv(args.upstream_python)
  n_layers = len(params0["params"])
  code_layer = len(model.encoder) - 1
  config = {
      "activations": ["linear" if i in (code_layer, n_layers - 1) else "tanh"
                      for i in range(n_layers)],
      "learning_rate": args.kfac_lr, "momentum": args.kfac_momentum, "damping": args.damping,
      "ema_decay": args.ema_decay, "inverse_every": args.inverse_every, "seed": args.seed,
      "compile_repeats": args.compile_repeats,
  }
  print(f"running upstream kfac-jax ({python}) ...", flush=True)
  report, final = compare.run_worker(python, jax.device_get(params0), images, idx, config)
  name = report["optimizer"]
  final_loss = eval_fn(jax.tree.map(jnp.asarray, final))
  summary = compare.summarize(
      name, report["step_times_s"], report["losses"], args.warmup, setup_s=report["init_s"],
      compile_s=report["compile_s"], first_step_all_s=report["first_step_s"],
      compile_baseline=report["compile_baseline"],
      compile_baseline_s=report["compile_baseline_s"], final_eval_loss=final_loss,
      registrations=report["registrations"],
      upstream_env={k: report[k] for k in ("upstream_version", "jax", "python", "backend")})
  run = ae.RunResult(name=name, losses=np.asarray(report["losses"], dtype=float),
                     step_times=np.asarray(report["step_times_s"], dtype=float),
                     compile_time=report["compile_s"], final_loss=final_loss)
  return summary, run


def reach_to_upstream(curves, upstream_name, window):
  """Per run, the first (step, seconds) where its smoothed loss reaches upstream's final one.

  The window shrinks to a tenth of the run for short runs (at least 1 step).
  """
  losses = curves[upstream_name][0]
  w = max(1, min(window, len(losses) // 10))
  target = float(compare.smoothed(losses, w)[-1])
  reached = {name: compare.time_to_reach(losses_, times, target, w)
             for name, (losses_, times) in curves.items()}
  return {"target": target, "window": w, "reached": reached}


if __name__ == "__main__":
  sys.exit(main())
