"""Benchmark: a small character-level Transformer LM with tied embeddings, every optimizer.

The model of `examples/transformer_lm.py`: token embedding plus a learned positional table, two
pre-LayerNorm blocks of causal 4-head self-attention and a gelu MLP, a final LayerNorm and the
transposed embedding as output projection (tied weights: one parameter used twice, which the
scanner registers as one embedding layer with two uses). Text available offline (the license
texts of /usr/share/common-licenses, else the Python standard library's sources; see the
example). Loss: softmax cross-entropy summed over the `--length` positions, averaged over the
batch; evaluated on 256 windows of the held-out last 10% of the text. Contestants as in
`benchmarks/autoencoder.py`; what is measured: `benchmarks/_harness.py`.

    python benchmarks/transformer.py
    python benchmarks/transformer.py --with-upstream --json out/transformer.json
    python benchmarks/transformer.py --quick      # a few steps of a one-block model
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
from examples import transformer_lm as lm  # noqa: E402


def parse_args(argv=None):
  p = argparse.ArgumentParser(
    description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
  )
  _harness.add_common_args(
    p,
    steps=100,
    warmup=5,
    adam_lrs="1e-3,3e-3,1e-2",
    sgd_lr=2e-3,
    kfac_lr=0.02,
    kfac_momentum=0.9,
    damping=3.0,
    optimizer_damping=1.0,
    inverse_every=10,
    plot=os.path.join("out", "bench_transformer.png"),
  )
  p.add_argument("--batch-size", type=int, default=32)
  p.add_argument("--length", type=int, default=64, help="context length (characters)")
  p.add_argument("--width", type=int, default=64, help="model width d")
  p.add_argument("--layers", type=int, default=2, help="Transformer blocks")
  p.add_argument("--heads", type=int, default=4)
  args = p.parse_args(argv)
  if args.quick:
    args.steps, args.warmup, args.compile_repeats = min(args.steps, 6), min(args.warmup, 1), 1
    args.length, args.width, args.layers = min(args.length, 16), min(args.width, 32), 1
  _harness.check_common_args(p, args)
  for flag in ("batch_size", "length", "width", "layers", "heads"):
    if getattr(args, flag) < 1:
      p.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
  if args.width % args.heads:
    p.error(f"--width {args.width} must be a multiple of --heads {args.heads}")
  return args


def make_workload(args) -> _harness.Workload:
  total = args.warmup + args.steps
  ids, chars, starts, held, about = lm.char_data(
    args.quick, args.length, total, args.batch_size, args.seed
  )
  model = lm.LM(
    vocab=len(chars), d=args.width, layers=args.layers, heads=args.heads, length=args.length
  )
  params0 = model.init(jax.random.key(args.seed), jnp.zeros((1, args.length), jnp.int32))
  loss_fn = lm.make_loss_fn(model)
  n_params = sum(int(np.prod(p.shape)) for p in jax.tree.leaves(params0))
  held = jax.tree.map(jnp.asarray, held)
  eval_loss = jax.jit(loss_fn)

  def upstream_data(steps):
    # Every window the run uses, in order: step t's batch is rows t*B ... (t+1)*B - 1.
    w = lm.windows(ids, starts[:steps].reshape(-1), args.length)
    return w, np.arange(steps * args.batch_size).reshape(steps, args.batch_size)

  return _harness.Workload(
    name="transformer",
    description=f"char-level Transformer LM, {args.layers} block(s), d={args.width}, "
    f"{args.heads} heads, tied embeddings ({n_params:,} parameters), batch "
    f"{args.batch_size}x{args.length}; {about.removeprefix('data: ')}",
    loss_fn=loss_fn,
    params0=params0,
    batch_at=lambda t: lm.windows(ids, starts[t], args.length),
    eval_fn=lambda params: float(eval_loss(params, held)),
    eval_description=(
      f"softmax cross-entropy summed over {args.length} positions (divide by "
      f"{args.length} for nats per character), mean over 256 held-out "
      "windows"
    ),
    upstream={"model": "transformer", "num_layers": args.layers, "heads": args.heads},
    upstream_data=upstream_data,
  )


def main(argv=None) -> int:
  return _harness.main(parse_args, make_workload, __file__, argv)


if __name__ == "__main__":
  sys.exit(main())
