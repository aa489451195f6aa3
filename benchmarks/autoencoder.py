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

    python benchmarks/autoencoder.py                       # defaults: about 1-2 minutes on 2 CPUs
    python benchmarks/autoencoder.py --steps 50 --json out/ae_bench.json
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

from examples import autoencoder as ae  # noqa: E402
from examples import data as data_lib  # noqa: E402


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
  args = p.parse_args(argv)
  if args.steps < 1 or args.warmup < 0:
    p.error("--steps must be >= 1 and --warmup >= 0")
  return args


def run_one(name, make_tx, make_step, loss_fn, params0, images, idx, warmup, seed, eval_fn):
  t0 = time.perf_counter()
  tx = make_tx()
  params = jax.tree.map(jnp.copy, params0)
  opt_state = jax.block_until_ready(tx.init(params))
  setup = time.perf_counter() - t0
  r = ae.train(name, make_step(loss_fn, tx), params, opt_state, images, idx, seed, eval_fn,
               progress=False)
  timed = r.step_times[warmup:]
  return {
      "optimizer": name,
      "setup_s": setup,
      "compile_first_s": r.compile_time,
      "median_step_ms": 1e3 * float(np.median(timed)),
      "mean_step_ms": 1e3 * float(np.mean(timed)),
      "min_step_ms": 1e3 * float(np.min(timed)),
      "timed_steps": int(len(timed)),
      "loss_steps": int(len(r.step_times)),
      "final_eval_loss": r.final_loss,
      "last_minibatch_loss": float(r.losses[-1]),
      "finite": bool(np.all(np.isfinite(r.losses))),
  }


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
  results = []
  for name, make_tx, make_step in (("kfac_jax", make_kfac, ae.make_kfac_step),
                                   ("Adam", lambda: optax.adam(args.adam_lr), ae.make_adam_step)):
    print(f"running {name} ...", flush=True)
    results.append(run_one(name, make_tx, make_step, loss_fn, params0, images, idx, args.warmup,
                           args.seed, eval_fn))
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
  print(f"| optimizer | setup (s) | compile (s) | median step (ms) | mean step (ms) | "
        f"loss after {total} steps |")
  print("|---|---:|---:|---:|---:|---:|")
  for r in results:
    loss = f"{r['final_eval_loss']:.2f}" + ("" if r["finite"] else " (non-finite)")
    print(f"| {r['optimizer']} | {r['setup_s']:.2f} | {r['compile_s']:.2f} | "
          f"{r['median_step_ms']:.1f} | {r['mean_step_ms']:.1f} | {loss} |")
  print(f"| **kfac/adam** | | {ratios['compile']:.2f}x | {ratios['median_step']:.2f}x | "
        f"{ratios['mean_step']:.2f}x | |")
  print()
  print(f"compile = minimum over {args.compile_repeats} interleaved runs of "
        "jax.jit(step).lower(...).compile() after a warm-up compilation; steps exclude "
        "compilation; loss = mean over 10,000 training images.")

  if args.json:
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
      json.dump({"env": env, "results": results, "ratios": ratios}, f, indent=2)
    print(f"wrote {args.json}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
