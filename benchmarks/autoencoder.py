"""Benchmark: the K-FAC paper's deep autoencoder on Fashion-MNIST, every optimizer in one run.

The model of `examples/autoencoder.py` (784-1000-500-250-30-250-500-1000-784, tanh, linear code
layer, sigmoid cross-entropy summed over pixels and averaged over the batch). Contestants, all
from the same initial parameters on the same batches (see `benchmarks/_harness.py` for what is
measured and how):

* Adam over a learning-rate grid (`--adam-lrs`), the best final loss reported as "Adam (tuned)";
* SGD with heavy-ball momentum (`--sgd-lr`, `--sgd-momentum`; `--no-sgd` drops it);
* `kfac_jax.kfac` (the optax transform; fixed learning rate, momentum and damping);
* `kfac_jax.Optimizer` (learning rate and momentum from the quadratic model, adaptive damping;
  `--no-optimizer` drops it);
* with `--with-upstream`, DeepMind's kfac-jax 0.0.8 in its own virtualenv, configured like our
  transform (`benchmarks/upstream/README.md`).

Minibatches of `--batch-size` (default 1000, shuffled epochs; loss on the first 10,000 training
images) or, with `--full-batch`, the same `--num-images` images every step (loss on those
images: the training objective itself).

    python benchmarks/autoencoder.py                       # batch 1000
    python benchmarks/autoencoder.py --full-batch          # full batch of 10,000 images
    python benchmarks/autoencoder.py --with-upstream --json out/ae.json
    python benchmarks/autoencoder.py --quick               # a few steps of a small model
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

from benchmarks import _harness  # noqa: E402
from examples import autoencoder as ae  # noqa: E402
from examples import data as data_lib  # noqa: E402


def parse_args(argv=None):
  p = argparse.ArgumentParser(
    description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
  )
  _harness.add_common_args(
    p,
    steps=100,
    warmup=5,
    adam_lrs="3e-4,1e-3,3e-3",
    sgd_lr=1e-3,
    kfac_lr=ae.DEFAULT_KFAC_LR,
    kfac_momentum=ae.DEFAULT_KFAC_MOMENTUM,
    damping=ae.DEFAULT_DAMPING,
    optimizer_damping=10.0,
    inverse_every=ae.DEFAULT_INVERSE_EVERY,
    plot=os.path.join("out", "bench_autoencoder.png"),
  )
  p.add_argument(
    "--batch-size",
    type=int,
    default=ae.DEFAULT_BATCH_SIZE,
    help="minibatch size (ignored with --full-batch)",
  )
  p.add_argument(
    "--full-batch", action="store_true", help="every step on the same --num-images images"
  )
  p.add_argument(
    "--num-images",
    type=int,
    default=10000,
    help="with --full-batch: the batch; otherwise: the evaluation set",
  )
  p.add_argument(
    "--encoder",
    default=None,
    help="comma-separated encoder widths, the last one the linear code layer; the decoder "
    "mirrors them (default: the paper's 1000,500,250,30 on 784 inputs, else "
    f"{','.join(map(str, ae.SMALL_ENCODER))}; a small one makes a quicker smoke test)",
  )
  p.add_argument("--data-dir", default=None, help="MNIST-format idx files (see examples/data.py)")
  args = p.parse_args(argv)
  if args.quick:
    args.steps, args.warmup, args.compile_repeats = min(args.steps, 6), min(args.warmup, 1), 1
    args.batch_size, args.num_images = min(args.batch_size, 128), min(args.num_images, 256)
  _harness.check_common_args(p, args)
  args.encoder_widths = None
  if args.encoder is not None:
    try:
      args.encoder_widths = tuple(int(w) for w in args.encoder.split(","))
    except ValueError:
      p.error(f"--encoder must be comma-separated integers, got {args.encoder!r}")
    if any(w < 1 for w in args.encoder_widths):
      p.error(f"--encoder widths must be >= 1, got {args.encoder!r}")
  if args.batch_size < 1 or args.num_images < 1:
    p.error(
      f"--batch-size and --num-images must be >= 1, got {args.batch_size} and {args.num_images}"
    )
  return args


def make_workload(args) -> _harness.Workload:
  ds = data_lib.load_dataset("fashion_mnist", args.data_dir)
  images = ds.train_images[:1024] if args.quick else ds.train_images
  encoder = args.encoder_widths or (
    ae.SMALL_ENCODER if args.quick else ae.encoder_sizes_for(ds.num_features)
  )
  model = ae.make_model(ds.num_features, encoder)
  loss_fn = ae.make_loss_fn(model)
  params0 = ae.init_params(model, args.seed)
  n_params = sum(int(np.prod(p.shape)) for p in jax.tree.leaves(params0))
  total = args.warmup + args.steps
  arch = "-".join(
    str(w) for w in (ds.num_features, *encoder, *reversed(encoder[:-1]), ds.num_features)
  )
  if args.full_batch:
    images = images[: args.num_images]
    full = jnp.asarray(images)  # Placed once; every step reuses it.
    idx = np.tile(np.arange(images.shape[0]), (total, 1))
    batch_at = lambda t: full  # noqa: E731
    eval_images, how = images, f"full batch of {images.shape[0]} images"
  else:
    idx = ae.batch_indices(images.shape[0], args.batch_size, total, args.seed)
    batch_at = lambda t: images[idx[t]]  # noqa: E731
    eval_images, how = images[: args.num_images], f"batch {idx.shape[1]}"
  n_layers = len(params0["params"])
  code_layer = len(encoder) - 1
  upstream = {
    "model": "autoencoder",
    "activations": [
      "linear" if i in (code_layer, n_layers - 1) else "tanh" for i in range(n_layers)
    ],
  }
  return _harness.Workload(
    name="autoencoder" + (" (full batch)" if args.full_batch else ""),
    description=f"{arch} autoencoder ({n_params:,} parameters) on {ds.name}, {how}; "
    f"data: {ds.source}",
    loss_fn=loss_fn,
    params0=params0,
    batch_at=batch_at,
    eval_fn=ae.make_eval_fn(loss_fn, eval_images),
    eval_description=(
      f"sigmoid cross-entropy summed over pixels, mean over {eval_images.shape[0]} training images"
    ),
    upstream=upstream,
    upstream_data=lambda steps: (images, idx[:steps]),
    extra_evals=(("squared error", ae.make_squared_error_fn(model, eval_images)),),
  )


def main(argv=None) -> int:
  return _harness.main(parse_args, make_workload, __file__, argv)


if __name__ == "__main__":
  sys.exit(main())
