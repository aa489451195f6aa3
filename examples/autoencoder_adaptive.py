"""Full-batch deep autoencoder: adaptive K-FAC (`kfac_jax.Optimizer`) beside Adam.

The model and loss are those of examples/autoencoder.py (the K-FAC paper's autoencoder, sigmoid
cross-entropy summed over pixels). Here every step sees the same full batch (the first
`--num-images` training images), and K-FAC chooses its learning rate α and momentum μ each step
from the exact quadratic model and adapts its damping λ by the Levenberg–Marquardt rule: no
learning rate to tune, only an initial damping. Adam uses a fixed learning rate.

Both start from the same parameters; each train step is jit-compiled ahead of time. The script
writes a PNG with the loss against steps and against wall-clock seconds, and prints a table of
final losses and step times, plus the last α, μ, λ and ρ of K-FAC.

    python examples/autoencoder_adaptive.py      # about 5 minutes on 2 busy CPU cores
    python examples/autoencoder_adaptive.py --fast --out /tmp/ae_adaptive.png
"""

from __future__ import annotations

import argparse
import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
  sys.path.insert(0, _ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import kfac_jax  # noqa: E402
from examples import autoencoder as ae  # noqa: E402
from examples import data as data_lib  # noqa: E402

DEFAULT_STEPS = 100
DEFAULT_NUM_IMAGES = 1000
DEFAULT_INITIAL_DAMPING = 10.0
DEFAULT_ADAM_LR = 1e-3
DEFAULT_INVERSE_EVERY = 5
DEFAULT_ADAPTATION_INTERVAL = 5
NAME = "K-FAC (adaptive)"


def make_optimizer(
  loss_fn,
  example_batch,
  *,
  damping=DEFAULT_INITIAL_DAMPING,
  inverse_every=DEFAULT_INVERSE_EVERY,
  adaptation_interval=DEFAULT_ADAPTATION_INTERVAL,
) -> kfac_jax.Optimizer:
  """K-FAC with α, μ from the quadratic model and Levenberg–Marquardt damping."""
  return kfac_jax.Optimizer(
    loss_fn,
    example_batch,
    learning_rate=None,
    momentum=None,
    damping=damping,
    use_adaptive_damping=True,
    inverse_every=inverse_every,
    config=kfac_jax.Config(damping_adaptation_interval=adaptation_interval, min_damping=1e-4),
  )


def train_kfac(
  opt: kfac_jax.Optimizer,
  params,
  images: np.ndarray,
  steps: int,
  seed: int,
  eval_fn,
  progress: bool = True,
) -> tuple[ae.RunResult, dict[str, np.ndarray]]:
  """`steps` jitted full-batch steps, timed; also returns the per-step info (α, μ, λ, ρ, ...)."""
  import time

  from tqdm.auto import tqdm

  rng = jax.random.key(seed + 1)
  batch = jax.device_put(images)
  state = opt.init(params)
  t0 = time.perf_counter()
  compiled = jax.jit(opt.step, donate_argnums=(0, 1)).lower(params, state, batch, rng).compile()
  compile_time = time.perf_counter() - t0
  times, infos = [], []
  bar = tqdm(
    range(steps),
    desc=NAME,
    disable=not progress,
    dynamic_ncols=True,
    mininterval=0.5,
    file=sys.stderr,
  )
  for t in bar:
    rng, sub = jax.random.split(rng)
    jax.block_until_ready(sub)
    start = time.perf_counter()
    params, state, info = compiled(params, state, batch, sub)
    jax.block_until_ready((params, state, info))
    times.append(time.perf_counter() - start)
    infos.append({k: float(v) for k, v in info.items()})
    if t % 5 == 0 or t == steps - 1:
      bar.set_postfix(
        loss=f"{infos[-1]['loss']:.2f}", damping=f"{infos[-1]['damping']:.3g}", refresh=False
      )
  bar.close()
  history = {k: np.asarray([i[k] for i in infos]) for k in infos[0]}
  result = ae.RunResult(
    name=NAME,
    losses=history["loss"],
    step_times=np.asarray(times),
    compile_time=compile_time,
    final_loss=eval_fn(params),
    params=params,
  )
  return result, history


def parse_args(argv=None):
  p = argparse.ArgumentParser(
    description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
  )
  p.add_argument(
    "--steps",
    type=int,
    default=None,
    help=f"train steps per optimizer (default {DEFAULT_STEPS}, 8 with --fast)",
  )
  p.add_argument(
    "--num-images",
    type=int,
    default=None,
    help=f"full-batch size (default {DEFAULT_NUM_IMAGES}, 256 with --fast)",
  )
  p.add_argument(
    "--data-dir",
    default=None,
    help=f"directory with MNIST-format idx files (default: ${data_lib.DATA_DIR_ENV} "
    f"or {data_lib.DEFAULT_DATA_DIR}); falls back to sklearn digits",
  )
  p.add_argument("--dataset", choices=["fashion_mnist", "digits"], default="fashion_mnist")
  p.add_argument("--out", default="autoencoder_adaptive.png", help="PNG path for the curves")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--fast", action="store_true", help="a few steps on a small model (for tests)")
  p.add_argument(
    "--damping",
    type=float,
    default=DEFAULT_INITIAL_DAMPING,
    help="K-FAC initial damping (then adapted)",
  )
  p.add_argument("--inverse-every", type=int, default=DEFAULT_INVERSE_EVERY)
  p.add_argument(
    "--adaptation-interval",
    type=int,
    default=DEFAULT_ADAPTATION_INTERVAL,
    help="K-FAC: adapt the damping every this many steps",
  )
  p.add_argument("--adam-lr", type=float, default=DEFAULT_ADAM_LR)
  p.add_argument("--no-progress", action="store_true", help="hide the tqdm progress bars")
  args = p.parse_args(argv)
  if args.steps is None:
    args.steps = 8 if args.fast else DEFAULT_STEPS
  if args.num_images is None:
    args.num_images = 256 if args.fast else DEFAULT_NUM_IMAGES
  return args


def main(argv=None) -> int:
  args = parse_args(argv)
  ds = data_lib.load_dataset(args.dataset, args.data_dir)
  images = ds.train_images[: args.num_images]
  encoder = ae.SMALL_ENCODER if args.fast else ae.encoder_sizes_for(ds.num_features)
  model = ae.make_model(ds.num_features, encoder)
  loss_fn = ae.make_loss_fn(model)
  params0 = ae.init_params(model, args.seed)
  n_params = sum(int(np.prod(p.shape)) for p in jax.tree.leaves(params0))
  # Full batch: every step uses all `num_images` images.
  idx = np.tile(np.arange(images.shape[0]), (args.steps, 1))
  eval_fn = ae.make_eval_fn(loss_fn, images)
  arch = "-".join(
    str(w) for w in (ds.num_features, *encoder, *reversed(encoder[:-1]), ds.num_features)
  )
  print(f"data: {ds.source}", flush=True)
  print(
    f"model: {arch} autoencoder, {n_params:,} parameters; {args.steps} full-batch steps on "
    f"{images.shape[0]} images; jax {jax.__version__} on {jax.default_backend()}",
    flush=True,
  )
  print(
    f"{NAME}: initial damping={args.damping} inverse_every={args.inverse_every} "
    f"adaptation_interval={args.adaptation_interval}; Adam: lr={args.adam_lr}",
    flush=True,
  )

  example = jnp.asarray(images)
  opt = make_optimizer(
    loss_fn,
    example,
    damping=args.damping,
    inverse_every=args.inverse_every,
    adaptation_interval=args.adaptation_interval,
  )
  adam_tx = optax.adam(args.adam_lr)
  initial_loss = eval_fn(params0)

  kfac_r, history = train_kfac(
    opt,
    jax.tree.map(jnp.copy, params0),
    images,
    args.steps,
    args.seed,
    eval_fn,
    progress=not args.no_progress,
  )
  params = jax.tree.map(jnp.copy, params0)
  adam_r = ae.train(
    "Adam",
    ae.make_adam_step(loss_fn, adam_tx),
    params,
    adam_tx.init(params),
    images,
    idx,
    args.seed,
    eval_fn,
    progress=not args.no_progress,
  )
  results = [kfac_r, adam_r]

  title = (
    f"{arch} autoencoder, full batch of {images.shape[0]} {ds.name} images; "
    f"{NAME} (initial damping {args.damping}) vs Adam lr={args.adam_lr}"
  )
  ae.plot(results, args.out, title)

  print(f"\ninitial loss: {initial_loss:.3f}")
  print("| optimizer | final loss | median step (ms) | compile (s) | total train time (s) |")
  print("|---|---|---|---|---|")
  for r in results:
    print(
      f"| {r.name} | {r.final_loss:.3f} | {1e3 * r.median_step_time:.1f} | "
      f"{r.compile_time:.2f} | {r.step_times.sum():.1f} |"
    )
  print(
    f"{NAME} at the last step: learning rate {history['learning_rate'][-1]:.3g}, "
    f"momentum {history['momentum'][-1]:.3g}, damping {history['damping'][-1]:.3g}, "
    f"rho {history['rho'][-1]:.3g}; skipped steps: {int(history['skipped'].sum())}"
  )
  for r in results:
    if not np.all(np.isfinite(r.losses)):
      print(f"WARNING: {r.name} produced non-finite losses", flush=True)
  print(f"wrote {os.path.abspath(args.out)}", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
