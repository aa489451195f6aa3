"""K-FAC vs Adam on the deep autoencoder of the K-FAC paper (Martens & Grosse, 2015).

Architecture (Fashion-MNIST, 784 inputs): 784-1000-500-250-30-250-500-1000-784 with tanh
hidden units, a linear 30-unit code layer and sigmoid (logit) outputs, trained with the
sigmoid cross-entropy summed over pixels and averaged over the batch. For any other input
size (the 8x8 scikit-learn digits fallback has 64) the hidden widths are scaled down to
64-256-128-64-16-64-128-256-64 so the fallback stays quick.

Both optimizers start from the same initial parameters and see the same minibatch sequence.
Each has its own jit-compiled train step (compiled ahead of time, so compilation is timed
separately from the steps). The script writes a PNG with the training loss against steps and
against wall-clock seconds, and prints the final losses and median step times.

    python examples/autoencoder.py                    # full demo: 60 s of training each
    python examples/autoencoder.py --steps 200        # a fixed number of steps each instead
    python examples/autoencoder.py --fast --out /tmp/ae.png

By default each optimizer trains for the same budget of wall-clock seconds (`--seconds`, the
race protocol of benchmarks/race.py: only the timed steps count, compilation and evaluation do
not), so the plot against seconds compares them at equal cost.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
  # Lets `python examples/autoencoder.py` work from a checkout without `pip install -e .`.
  sys.path.insert(0, _ROOT)

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import kfac_jax  # noqa: E402
from examples import data as data_lib  # noqa: E402
from examples import plotting  # noqa: E402

# Encoder widths; the decoder mirrors them (the last one is the linear code layer).
PAPER_ENCODER = (1000, 500, 250, 30)
SMALL_ENCODER = (256, 128, 64, 16)

# K-FAC settings: `kfac_jax.kfac`'s defaults (momentum 0.7, max_norm 0.3, damping 0.1) with the
# learning rate 1 of the races in benchmarks/RESULTS.md (`kfac`'s own default for this loss,
# 0.3 · 784^(1/4) ≈ 1.6, did as well in step sweeps). Adam's learning rate is the best of the
# race's grid (3e-4, 1e-3, 3e-3) on this model.
DEFAULT_SECONDS = 60.0
DEFAULT_BATCH_SIZE = 1000
DEFAULT_KFAC_LR = 1.0
DEFAULT_KFAC_MOMENTUM = 0.7
DEFAULT_DAMPING = 0.1
DEFAULT_MAX_NORM = 0.3
DEFAULT_ADAM_LR = 1e-3
DEFAULT_INVERSE_EVERY = 5
DEFAULT_EMA_DECAY = 0.95


def encoder_sizes_for(num_features: int) -> tuple[int, ...]:
  """The paper's widths for 784 inputs, a scaled-down stack for anything else."""
  return PAPER_ENCODER if num_features == 784 else SMALL_ENCODER


class Autoencoder(nn.Module):
  """Deep autoencoder: tanh Dense layers, linear code layer, logits out."""

  num_features: int
  encoder: Sequence[int] = PAPER_ENCODER

  @nn.compact
  def __call__(self, x):
    init = nn.initializers.xavier_uniform()
    widths = tuple(self.encoder) + tuple(reversed(self.encoder[:-1]))
    code_layer = len(self.encoder) - 1
    for i, width in enumerate(widths):
      x = nn.Dense(width, kernel_init=init, name=f"dense_{i}")(x)
      if i != code_layer:
        x = jnp.tanh(x)
    return nn.Dense(self.num_features, kernel_init=init, name=f"dense_{len(widths)}")(x)


def make_model(num_features: int = 784, encoder: Sequence[int] | None = None) -> Autoencoder:
  return Autoencoder(
    num_features=num_features,
    encoder=tuple(encoder) if encoder else encoder_sizes_for(num_features),
  )


def init_params(model: Autoencoder, seed: int = 0):
  # Jitted: one compilation instead of one per initializer op (1.2 against 2.8 s for the
  # paper's model on the development CPU), and bit-identical parameters.
  return jax.jit(model.init)(jax.random.key(seed), jnp.zeros((1, model.num_features), jnp.float32))


def make_loss_fn(model: Autoencoder) -> Callable[[Any, jax.Array], jax.Array]:
  """Sigmoid cross-entropy summed over pixels, mean over the batch, with its K-FAC loss tag."""

  def loss_fn(params, batch):
    logits = model.apply(params, batch)  # batch: float32 [B, num_features] in [0, 1]
    kfac_jax.register_sigmoid_cross_entropy_loss(logits, batch)
    return optax.sigmoid_binary_cross_entropy(logits, batch).sum(-1).mean()

  return loss_fn


def make_kfac(
  loss_fn,
  example_batch,
  *,
  learning_rate=DEFAULT_KFAC_LR,
  momentum=DEFAULT_KFAC_MOMENTUM,
  damping=DEFAULT_DAMPING,
  ema_decay=DEFAULT_EMA_DECAY,
  inverse_every=DEFAULT_INVERSE_EVERY,
  max_norm=DEFAULT_MAX_NORM,
):
  momentum = momentum if momentum is not None and momentum > 0 else None
  max_norm = max_norm if max_norm else None
  return kfac_jax.kfac(
    loss_fn,
    example_batch,
    learning_rate=learning_rate,
    momentum=momentum,
    damping=damping,
    ema_decay=ema_decay,
    inverse_every=inverse_every,
    max_norm=max_norm,
  )


def make_kfac_step(loss_fn, tx):
  """Train step for K-FAC: one forward pass gives loss, gradients and curvature statistics."""

  def step(params, opt_state, batch, rng):
    loss, grads, stats = kfac_jax.value_and_grad(loss_fn)(params, batch, rng)
    updates, opt_state = tx.update(grads, opt_state, params, curvature_stats=stats)
    return optax.apply_updates(params, updates), opt_state, loss

  return step


def make_adam_step(loss_fn, tx):
  """Train step for Adam or any first-order optax transformation (the K-FAC step's signature;
  `rng` is unused)."""

  def step(params, opt_state, batch, rng):
    del rng
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  return step


def batch_indices(num_examples: int, batch_size: int, steps: int, seed: int) -> np.ndarray:
  """[steps, batch_size] indices: shuffled epochs without replacement, shared by both runs."""
  batch_size = min(batch_size, num_examples)
  per_epoch = num_examples // batch_size
  rng = np.random.default_rng(seed)
  out = []
  while len(out) < steps:
    perm = rng.permutation(num_examples)
    out.extend(perm[i * batch_size : (i + 1) * batch_size] for i in range(per_epoch))
  return np.stack(out[:steps])


class BatchSequence:
  """The minibatch index sequence of `batch_indices`, grown an epoch at a time on demand (a
  time budget does not say in advance how many steps there will be)."""

  def __init__(self, num_examples: int, batch_size: int, seed: int):
    self.num_examples, self.batch_size = num_examples, min(batch_size, num_examples)
    self.per_epoch = num_examples // self.batch_size
    self._rng = np.random.default_rng(seed)
    self._rows: list[np.ndarray] = []

  def __getitem__(self, t: int) -> np.ndarray:
    while t >= len(self._rows):
      perm = self._rng.permutation(self.num_examples)
      self._rows.extend(
        perm[i * self.batch_size : (i + 1) * self.batch_size] for i in range(self.per_epoch)
      )
    return self._rows[t]


@dataclasses.dataclass
class RunResult:
  name: str
  losses: np.ndarray  # minibatch loss at each step (before that step's update)
  step_times: np.ndarray  # seconds per step, block_until_ready'd
  compile_time: float  # seconds for jit(...).lower(...).compile()
  final_loss: float  # loss of the final parameters on the evaluation set
  params: Any = None

  @property
  def median_step_time(self) -> float:
    # The first step is excluded even though compilation happened ahead of time: it can still
    # pay one-off costs (buffer allocation, thread-pool warm-up).
    times = self.step_times[1:] if len(self.step_times) > 1 else self.step_times
    return float(np.median(times))


def train(
  name: str,
  step_fn,
  params,
  opt_state,
  images: np.ndarray,
  idx,
  seed: int,
  eval_fn,
  progress: bool = True,
  steps: int | None = None,
  budget_s: float | None = None,
) -> RunResult:
  """Jitted steps on `images[idx[t]]`, timing each one: `steps` of them, or (with `budget_s`)
  as many as start while the timed seconds are below `budget_s`."""
  from tqdm.auto import tqdm

  if steps is None and budget_s is None:
    steps = len(idx)
  rng = jax.random.key(seed + 1)
  example = jnp.asarray(images[idx[0]])
  t0 = time.perf_counter()
  log = (
    (lambda line: print(f"{name:>5}: {line}", file=sys.stderr, flush=True)) if progress else None
  )
  compiled = kfac_jax.compile_step(
    step_fn,
    params,
    opt_state,
    example,
    rng,
    name="the step",
    donate_argnums=(0, 1),
    log=log if progress else None,
  )
  compile_time = time.perf_counter() - t0

  losses, times = [], []
  if budget_s is None:
    bar = tqdm(
      total=steps,
      desc=f"{name:>5}",
      disable=not progress,
      dynamic_ncols=True,
      mininterval=0.5,
      file=sys.stderr,
    )
  else:
    bar = tqdm(
      total=round(budget_s, 1),
      desc=f"{name:>5}",
      unit="s",
      disable=not progress,
      dynamic_ncols=True,
      mininterval=0.5,
      file=sys.stderr,
      bar_format="{l_bar}{bar}| {n:.1f}/{total:.1f} s{postfix}",
    )
  t, spent = 0, 0.0
  while (t < steps) if budget_s is None else (spent < budget_s):
    batch = jax.device_put(images[idx[t]])
    rng, sub = jax.random.split(rng)
    jax.block_until_ready((batch, sub))
    start = time.perf_counter()
    params, opt_state, loss = compiled(params, opt_state, batch, sub)
    jax.block_until_ready((params, opt_state, loss))
    times.append(time.perf_counter() - start)
    losses.append(float(loss))
    spent += times[-1]
    bar.update(1 if budget_s is None else min(times[-1], max(0.0, budget_s - bar.n)))
    if t % 5 == 0:
      bar.set_postfix(loss=f"{losses[-1]:.2f}", step=t + 1, refresh=False)
    t += 1
  bar.close()
  return RunResult(
    name=name,
    losses=np.asarray(losses),
    step_times=np.asarray(times),
    compile_time=compile_time,
    final_loss=eval_fn(params),
    params=params,
  )


def make_eval_fn(loss_fn, images: np.ndarray, chunk: int = 2000):
  """Average loss over `images` (evaluated in chunks)."""
  jitted = jax.jit(loss_fn)

  def eval_fn(params) -> float:
    total = 0.0
    for start in range(0, images.shape[0], chunk):
      xb = jnp.asarray(images[start : start + chunk])
      total += float(jitted(params, xb)) * xb.shape[0]
    return total / images.shape[0]

  return eval_fn


def make_squared_error_fn(model: Autoencoder, images: np.ndarray, chunk: int = 2000):
  """Squared reconstruction error `Σ_pixels (sigmoid(logits) − x)²`, mean over `images`: the
  K-FAC paper's reported autoencoder error (Martens & Grosse 2015). Unlike the cross-entropy
  with grey-level targets it has no entropy floor: a perfect reconstruction scores 0, so
  ratios between optimizers mean something."""

  @jax.jit
  def chunk_error(params, xb):
    return jnp.sum((jax.nn.sigmoid(model.apply(params, xb)) - xb) ** 2)

  def error_fn(params) -> float:
    total = 0.0
    for start in range(0, images.shape[0], chunk):
      total += float(chunk_error(params, jnp.asarray(images[start : start + chunk])))
    return total / images.shape[0]

  return error_fn


def plot(results: Sequence[RunResult], out: str, title: str) -> None:
  curves = []
  for r in results:
    # The loss at step t is measured on the parameters available after t-1 steps.
    elapsed = np.concatenate([[0.0], np.cumsum(r.step_times)[:-1]])
    curves.append((r.name, np.arange(1, len(r.losses) + 1), elapsed, r.losses))
  plotting.steps_and_seconds(
    curves,
    out,
    title=title,
    ylabel="training loss (minibatch)",
    seconds="wall-clock seconds (train steps only, compilation excluded)",
    colors={"K-FAC": "tab:red", "K-FAC (adaptive)": "tab:red", "Adam": "tab:blue"},
  )


def parse_args(argv=None):
  p = argparse.ArgumentParser(
    description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
  )
  p.add_argument(
    "--seconds",
    type=float,
    default=None,
    help=f"timed training seconds per optimizer (default {DEFAULT_SECONDS:g} unless "
    "--steps or --fast is given)",
  )
  p.add_argument(
    "--steps",
    type=int,
    default=None,
    help="train steps per optimizer instead of a time budget (8 with --fast)",
  )
  p.add_argument(
    "--batch-size",
    type=int,
    default=None,
    help=f"minibatch size (default {DEFAULT_BATCH_SIZE}, 128 with --fast)",
  )
  p.add_argument(
    "--data-dir",
    default=None,
    help=f"directory with MNIST-format idx files (default: ${data_lib.DATA_DIR_ENV} "
    f"or {data_lib.DEFAULT_DATA_DIR}); falls back to sklearn digits",
  )
  p.add_argument("--dataset", choices=["fashion_mnist", "digits"], default="fashion_mnist")
  p.add_argument("--out", default="autoencoder.png", help="PNG path for the loss curves")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument(
    "--fast",
    action="store_true",
    help="a few steps on a small subset with a small model (for tests)",
  )
  p.add_argument(
    "--kfac-lr",
    type=float,
    default=DEFAULT_KFAC_LR,
    help="K-FAC's learning rate; 1.0 is the races' rate in benchmarks/RESULTS.md, so the demo "
    "reproduces them (kfac's own default for 784 outputs, 0.3 * 784**0.25 = 1.6, did as well "
    "in step sweeps)",
  )
  p.add_argument(
    "--kfac-momentum",
    type=float,
    default=DEFAULT_KFAC_MOMENTUM,
    help="heavy-ball momentum for K-FAC (0 disables it)",
  )
  p.add_argument("--damping", type=float, default=DEFAULT_DAMPING, help="K-FAC damping")
  p.add_argument(
    "--inverse-every",
    type=int,
    default=DEFAULT_INVERSE_EVERY,
    help="K-FAC: recompute the factor inverses every this many steps",
  )
  p.add_argument(
    "--ema-decay",
    type=float,
    default=DEFAULT_EMA_DECAY,
    help="K-FAC: decay of the curvature-factor moving averages",
  )
  p.add_argument("--adam-lr", type=float, default=DEFAULT_ADAM_LR)
  p.add_argument("--no-progress", action="store_true", help="hide the tqdm progress bars")
  p.add_argument(
    "--max-norm",
    type=float,
    default=DEFAULT_MAX_NORM,
    help="K-FAC: clip the preconditioned gradient to this length in the K-FAC metric, "
    "before the learning rate (0 disables it)",
  )
  args = p.parse_args(argv)
  if args.seconds is not None and args.steps is not None:
    p.error("give --seconds or --steps, not both")
  if args.seconds is not None and not args.seconds > 0:
    p.error(f"--seconds must be > 0, got {args.seconds}")
  if args.steps is None and args.seconds is None:
    if args.fast:
      args.steps = 8
    else:
      args.seconds = DEFAULT_SECONDS
  if args.batch_size is None:
    args.batch_size = 128 if args.fast else DEFAULT_BATCH_SIZE
  return args


def main(argv=None) -> int:
  args = parse_args(argv)
  ds = data_lib.load_dataset(args.dataset, args.data_dir)
  images = ds.train_images
  encoder = encoder_sizes_for(ds.num_features)
  if args.fast:
    images = images[:1024]
    encoder = SMALL_ENCODER
  eval_images = images[:10000]

  model = make_model(ds.num_features, encoder)
  loss_fn = make_loss_fn(model)
  params0 = init_params(model, args.seed)
  n_params = sum(int(np.prod(p.shape)) for p in jax.tree.leaves(params0))
  if args.seconds is None:
    idx = batch_indices(images.shape[0], args.batch_size, args.steps, args.seed)
  else:
    idx = BatchSequence(images.shape[0], args.batch_size, args.seed)
  batch_size = min(args.batch_size, images.shape[0])
  budget = f"{args.steps} steps" if args.seconds is None else f"{args.seconds:g} s of timed steps"
  eval_fn = make_eval_fn(loss_fn, eval_images)
  arch = "-".join(
    str(w) for w in (ds.num_features, *encoder, *reversed(encoder[:-1]), ds.num_features)
  )

  print(f"data: {ds.source}", flush=True)
  print(
    f"model: {arch} autoencoder, {n_params:,} parameters; {budget} each, batch "
    f"{batch_size} on {images.shape[0]} images; jax {jax.__version__} on "
    f"{jax.default_backend()} ({os.cpu_count()} CPUs)",
    flush=True,
  )
  print(
    f"K-FAC: lr={args.kfac_lr} momentum={args.kfac_momentum} damping={args.damping} "
    f"max_norm={args.max_norm} inverse_every={args.inverse_every} "
    f"ema_decay={args.ema_decay}; "
    f"Adam: lr={args.adam_lr}",
    flush=True,
  )

  example = jnp.asarray(images[idx[0]])
  kfac_tx = make_kfac(
    loss_fn,
    example,
    learning_rate=args.kfac_lr,
    momentum=args.kfac_momentum,
    damping=args.damping,
    ema_decay=args.ema_decay,
    inverse_every=args.inverse_every,
    max_norm=args.max_norm,
  )
  adam_tx = optax.adam(args.adam_lr)
  initial_loss = eval_fn(params0)

  results = []
  for name, tx, make_step in (
    ("K-FAC", kfac_tx, make_kfac_step),
    ("Adam", adam_tx, make_adam_step),
  ):
    params = jax.tree.map(jnp.copy, params0)  # both start from the same init (params0 kept)
    opt_state = tx.init(params)
    results.append(
      train(
        name,
        make_step(loss_fn, tx),
        params,
        opt_state,
        images,
        idx,
        args.seed,
        eval_fn,
        progress=not args.no_progress,
        steps=args.steps,
        budget_s=args.seconds,
      )
    )

  title = (
    f"{arch} autoencoder on {ds.name} ({images.shape[0]} images), batch {batch_size}, "
    f"{budget} each\nK-FAC lr={args.kfac_lr} momentum={args.kfac_momentum} "
    f"damping={args.damping} max_norm={args.max_norm}; "
    f"Adam lr={args.adam_lr}"
  )
  plot(results, args.out, title)

  kfac_r, adam_r = results
  print(f"\ninitial loss (eval set of {eval_images.shape[0]} images): {initial_loss:.3f}")
  print(
    "| optimizer | final eval loss | last minibatch loss | steps | median step (ms) "
    "| compile (s) | total train time (s) |"
  )
  print("|---|---|---|---|---|---|---|")
  for r in results:
    print(
      f"| {r.name} | {r.final_loss:.3f} | {r.losses[-1]:.3f} | {len(r.losses)} | "
      f"{1e3 * r.median_step_time:.1f} | {r.compile_time:.2f} | {r.step_times.sum():.1f} |"
    )
  ratio = kfac_r.median_step_time / adam_r.median_step_time
  print(f"median step time ratio K-FAC / Adam: {ratio:.2f}x")
  for r in results:
    if not np.all(np.isfinite(r.losses)):
      print(f"WARNING: {r.name} produced non-finite losses", flush=True)
  print(f"wrote {os.path.abspath(args.out)}", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
