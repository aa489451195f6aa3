"""A character-level RNN language model: K-FAC with the "kron_series_1" recurrent approximation.

A tanh RNN, `h_t = tanh(E[c_t] W_x + h_{t-1} W_h + b)`, written with `lax.scan`, reads text
available offline (see `examples/transformer_lm.py`). The recurrent kernel `W_h` is used once
per time step; the scanner unrolls the scan and finds its T uses, and the manual tag in the
scan body selects the approximation of Martens, Ba & Johnson (2018) that models the
correlation between successive steps ("kron_series_1"), instead of treating them as
independent ("kron_indep", the default). Trains K-FAC with each of the two and Adam from the
same initialisation on the same batches; prints held-out nats per character and writes a PNG.

    python examples/rnn.py            # ~1-2 minutes on 2 CPU cores
    python examples/rnn.py --fast     # a few steps of a tiny model (used by the tests)
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
from examples import common  # noqa: E402
from examples import transformer_lm as tlm  # noqa: E402


def init(key, vocab, hidden):
  ks = jax.random.split(key, 4)
  return {
    "embed": jax.random.normal(ks[0], (vocab, hidden)) * 0.1,
    "W_x": jax.random.normal(ks[1], (hidden, hidden)) / np.sqrt(hidden),
    "W_h": jax.random.orthogonal(ks[2], hidden) * 0.9,
    "b": jnp.zeros(hidden),
    "W_o": jax.random.normal(ks[3], (hidden, vocab)) / np.sqrt(hidden),
    "b_o": jnp.zeros(vocab),
  }


def make_loss_fn(recurrent_approx):
  def loss_fn(params, batch):
    x = params["embed"][batch["x"]] @ params["W_x"] + params["b"]  # [N, T, H], one dense use

    def step(h, x_t):
      pre = h @ params["W_h"]
      if recurrent_approx is not None:  # One tag per use: the layer has T uses.
        pre = kfac_jax.register_dense(pre, h, params["W_h"], approx=recurrent_approx)
      h = jnp.tanh(x_t + pre)
      return h, h

    h0 = jnp.zeros((x.shape[0], x.shape[2]), x.dtype)
    _, hs = jax.lax.scan(step, h0, jnp.swapaxes(x, 0, 1))
    logits = jnp.swapaxes(hs, 0, 1) @ params["W_o"] + params["b_o"]
    kfac_jax.register_softmax_cross_entropy_loss(logits, batch["y"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).sum(-1).mean()

  return loss_fn


def main(argv=None) -> int:
  p = argparse.ArgumentParser(
    description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
  )
  p.add_argument("--steps", type=int, default=None, help="default 150 (6 with --fast)")
  p.add_argument("--batch-size", type=int, default=32)
  p.add_argument("--length", type=int, default=24)
  p.add_argument("--hidden", type=int, default=128)
  p.add_argument("--kfac-lr", type=float, default=1.0)
  p.add_argument("--damping", type=float, default=0.1)
  p.add_argument("--adam-lr", type=float, default=3e-3)
  p.add_argument("--out", default="rnn.png")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--fast", action="store_true")
  p.add_argument("--no-progress", action="store_true")
  args = p.parse_args(argv)
  steps = args.steps or (6 if args.fast else 150)
  length = 8 if args.fast else args.length
  hidden = 16 if args.fast else args.hidden
  ids, chars, starts, held, about = tlm.char_data(
    args.fast, length, steps, args.batch_size, args.seed
  )
  params = init(jax.random.key(args.seed), len(chars), hidden)
  example = jax.tree_util.tree_map(jnp.asarray, tlm.windows(ids, starts[0], length))
  print(about)
  series_loss = make_loss_fn("kron_series_1")
  print(kfac_jax.summary(series_loss, params, example))
  runs = [
    ("K-FAC (series)", series_loss, "kfac"),
    ("K-FAC (indep)", make_loss_fn(None), "kfac"),
    ("Adam", make_loss_fn(None), "adam"),
  ]
  results = []
  print("| optimizer | held-out loss (nats/char) | median step (ms) | compile (s) |")
  print("|---|---:|---:|---:|")
  for name, loss_fn, kind in runs:
    tx = (
      kfac_jax.kfac(
        loss_fn,
        example,
        learning_rate=args.kfac_lr,
        damping=args.damping,
        inverse_every=10,
      )
      if kind == "kfac"
      else optax.adam(args.adam_lr)
    )
    r, final = common.train(
      name,
      tx,
      loss_fn,
      params,
      lambda i: tlm.windows(ids, starts[i], length),
      steps,
      args.seed,
      not args.no_progress,
      loss_scale=1 / length,
    )
    r.final_loss = float(jax.jit(loss_fn)(final, jax.tree_util.tree_map(jnp.asarray, held)))
    r.final_loss /= length
    results.append(r)
    print(
      f"| {name} | {r.final_loss:.4f} | {1e3 * r.median_step_time:.1f} | {r.compile_time:.2f} |"
    )
  ae.plot(results, args.out, f"character RNN, batch {args.batch_size}x{length}, hidden {hidden}")
  print(f"wrote {args.out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
