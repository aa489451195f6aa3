"""Benchmark: K-FAC against AdamW on a decoder Transformer at widths 512 to 2,048, per component.

The model: token embedding, L pre-norm blocks stacked by `nn.scan` (RMSNorm, multi-head causal
attention with rotary position embeddings, RMSNorm, SwiGLU MLP), a final RMSNorm and an untied
vocabulary head (32,768 by default); no biases. The data: a synthetic language
(`MarkovSource`), each token drawn from a few candidates chosen by a hash of the two tokens
before it, so the loss falls from ln V towards the source's entropy. Loss: cross-entropy per
token (the loss tag's weight 1/s makes K-FAC's Fisher that of the per-token mean).

For each width in `--d` (one model per width, same layers, tokens and schedule), it compiles
and times separately, each the minimum over `--repeats` calls:

* forward+backward: `jax.value_and_grad` of the loss (what AdamW and K-FAC both pay);
* the AdamW update alone and the whole AdamW step;
* statistics: `CurvatureEstimator.curvature_stats` on the statistics rows (one forward and one
  sampled backward pass) folded into the factors (`update_curvature_from_stats`);
* refresh: `update_inverses`; preconditioning: `multiply_matpower(grads, -1)`;
* the whole `kfac_jax.kfac` step in each phase of its schedule (nothing due, statistics due,
  both due), by setting the step counter; the amortised K-FAC step is their average over one
  period of the schedule;

and the optimizer state's bytes against the parameters'. The cost model
(`benchmarks/cost_model.py`) is fitted to these measurements (three machine constants) and
calibrated by two timings of its own (the categorical sampler; the preconditioning's matrix
products at each width); its error on every measured component is
printed, and it predicts `--predict` (default d = 4,096, 32 layers, 1M tokens per step). With
`--race`, AdamW (over `--adamw-lrs`) trains `--steps` steps at the first width, and K-FAC
trains until it reaches the tuned AdamW's final loss (the time ratio is reported).

    python benchmarks/scale.py --d 512 --layers 8 --batch 32 --seq 256        # 8k tokens
    python benchmarks/scale.py --d 512,1024,2048 --layers 8 --batch 8 --seq 256
    python benchmarks/scale.py --d 512 --layers 8 --batch 32 --seq 256 --race
    python benchmarks/scale.py --quick                                         # smoke test
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
  sys.path.insert(0, _ROOT)

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import kfac_jax  # noqa: E402
from benchmarks import _harness  # noqa: E402
from benchmarks import cost_model as cm  # noqa: E402
from benchmarks.upstream import compare  # noqa: E402
from kfac_jax import _losses  # noqa: E402

# -- the model -----------------------------------------------------------------------------------


def rope(x):
  """Rotary position embedding of `[batch, seq, heads, head_dim]` (halves rotated together)."""
  seq, dim = x.shape[1], x.shape[-1]
  half = dim // 2
  inv = 1.0 / (10000.0 ** (jnp.arange(half, dtype=jnp.float32) / half))
  angle = jnp.arange(seq, dtype=jnp.float32)[:, None] * inv[None, :]
  cos, sin = jnp.cos(angle)[None, :, None, :], jnp.sin(angle)[None, :, None, :]
  x1, x2 = x[..., :half], x[..., half:]
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def causal_attention(q, k, v):
  """Softmax attention of `[batch, seq, heads, head_dim]` queries over the earlier positions."""
  scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) * (q.shape[-1] ** -0.5)
  s = q.shape[1]
  scores = jnp.where(jnp.tril(jnp.ones((s, s), bool)), scores, jnp.finfo(scores.dtype).min)
  return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v)


class Block(nn.Module):
  """Pre-norm decoder block: RMSNorm, attention with RoPE, RMSNorm, SwiGLU MLP (no biases)."""

  d: int
  ff: int
  heads: int

  @nn.compact
  def __call__(self, x, _):
    b, s, _ = x.shape
    dense = lambda n, name: nn.Dense(n, use_bias=False, name=name)  # noqa: E731
    h = nn.RMSNorm(name="attn_norm")(x)
    q, k, v = (dense(self.d, n)(h).reshape(b, s, self.heads, -1) for n in ("q", "k", "v"))
    att = causal_attention(rope(q), rope(k), v).reshape(b, s, self.d)
    x = x + dense(self.d, "o")(att)
    h = nn.RMSNorm(name="mlp_norm")(x)
    return x + dense(self.d, "down")(
      nn.silu(dense(self.ff, "gate")(h)) * dense(self.ff, "up")(h)
    ), None


class Decoder(nn.Module):
  vocab: int
  d: int
  layers: int
  ff: int
  heads: int

  @nn.compact
  def __call__(self, ids):
    x = nn.Embed(self.vocab, self.d, name="embed")(ids)
    blocks = nn.scan(
      Block, variable_axes={"params": 0}, split_rngs={"params": True}, length=self.layers
    )
    x, _ = blocks(self.d, self.ff, self.heads, name="blocks")(x, None)
    x = nn.RMSNorm(name="final_norm")(x)
    return nn.Dense(self.vocab, use_bias=False, name="head")(x)


def make_loss_fn(model: Decoder, seq: int):
  """Cross-entropy per token; the tag's weight 1/seq gives the Fisher of that mean."""

  def loss_fn(params, batch):
    logits = model.apply(params, batch["x"])
    kfac_jax.register_softmax_cross_entropy_loss(
      logits, batch["y"], weight=jnp.full(batch["y"].shape, 1.0 / seq, logits.dtype)
    )
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

  return loss_fn


# -- the data ------------------------------------------------------------------------------------


class MarkovSource:
  """A synthetic language: token t is one of `branching` candidates of the context
  `hash(token t-2, token t-1) mod contexts`, the k-th with probability ∝ 1/k; candidates and
  first tokens follow a Zipf law over the vocabulary. Batches are a function of the step."""

  def __init__(self, vocab: int, contexts: int = 4096, branching: int = 8, seed: int = 0):
    rng = np.random.default_rng(seed)
    zipf = 1.0 / np.arange(1, vocab + 1) ** 1.1
    self.zipf = zipf / zipf.sum()
    self.vocab, self.contexts, self.seed = vocab, contexts, seed
    self.candidates = rng.choice(vocab, size=(contexts, branching), p=self.zipf)
    w = 1.0 / np.arange(1, branching + 1)
    self.p = w / w.sum()
    self.cum = np.cumsum(self.p)
    self.mult = rng.integers(1, 2**20, size=2)

  @property
  def entropy(self) -> float:
    """Nats per token of the source given its context (the loss floor, ignoring collisions)."""
    return float(-(self.p * np.log(self.p)).sum())

  def batch(self, step: int, batch: int, seq: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng((self.seed, step))
    x = np.empty((batch, seq + 1), np.int64)
    x[:, :2] = rng.choice(self.vocab, size=(batch, 2), p=self.zipf)
    u = rng.random((batch, seq + 1))
    for t in range(2, seq + 1):
      ctx = (x[:, t - 2] * self.mult[0] + x[:, t - 1] * self.mult[1]) % self.contexts
      k = np.minimum(np.searchsorted(self.cum, u[:, t]), len(self.p) - 1)
      x[:, t] = self.candidates[ctx, k]
    return {"x": x[:, :-1].astype(np.int32), "y": x[:, 1:].astype(np.int32)}


# -- the optimizers ------------------------------------------------------------------------------


def layer_config(args) -> kfac_jax.LayerConfig | None:
  """`--block-size`: the block size of wide factor sides (None: the library's default)."""
  return None if args.block_size is None else kfac_jax.LayerConfig(block_size=args.block_size)


def make_kfac(registration, args) -> optax.GradientTransformationExtraArgs:
  """The K-FAC transform under test: the one place that builds it."""
  return kfac_jax.kfac(
    registration=registration,
    learning_rate=args.kfac_lr,
    momentum=args.kfac_momentum or None,
    max_norm=args.max_norm or None,
    damping=args.damping,
    ema_decay=args.ema_decay,
    inverse_every=args.inverse_every,
    curvature_every=args.curvature_every,
    config=kfac_jax.Config(statistics_fraction=args.statistics_fraction),
  )


def make_estimator(registration, args) -> kfac_jax.CurvatureEstimator:
  """A curvature estimator with the transform's settings, to time its pieces one by one."""
  del args
  return kfac_jax.CurvatureEstimator(registration=registration)


def with_count(state, count: int):
  """The `kfac` state with its step counter set, which picks the phase of the schedule."""
  pre = state.preconditioner
  return state._replace(preconditioner=pre._replace(count=jnp.asarray(count, pre.count.dtype)))


def statistics_rows(batch, fraction: float):
  """The rows the transform's statistics use: r = ⌈f·N⌉, every ⌊N/r⌋-th from the first."""
  n = batch["x"].shape[0]
  r = max(1, math.ceil(fraction * n))
  s = n // r
  return jax.tree.map(lambda x: x[: r * s : s], batch)


def adamw(lr: float, weight_decay: float) -> optax.GradientTransformation:
  return optax.adamw(lr, b1=0.9, b2=0.95, weight_decay=weight_decay)


# -- measurements ---------------------------------------------------------------------------------


def timed(fn, *args, repeats: int) -> tuple[float, float, object, object]:
  """`(compile seconds, minimum seconds of `repeats` calls, last output, compiled)` of
  `jax.jit(fn)` on `args`."""
  t0 = time.perf_counter()
  compiled = jax.jit(fn).lower(*args).compile()
  compile_s = time.perf_counter() - t0
  best, out = math.inf, None
  for _ in range(repeats):
    t0 = time.perf_counter()
    out = jax.block_until_ready(compiled(*args))
    best = min(best, time.perf_counter() - t0)
  return compile_s, best, out, compiled


def phases(curvature_every: int, inverse_every: int) -> dict[str, tuple[int, int]]:
  """`{phase: (a counter value in it, its steps per period)}` over one period of the schedule
  (lcm of the two periods): "plain", "statistics" (due alone), "refresh" (due alone), "both"."""
  period = math.lcm(curvature_every, inverse_every)
  out: dict[str, list[int]] = {}
  for c in range(period):
    key = {(False, False): "plain", (True, False): "statistics", (False, True): "refresh"}.get(
      (c % curvature_every == 0, c % inverse_every == 0), "both"
    )
    out.setdefault(key, []).append(c)
  return {k: (v[0], len(v)) for k, v in out.items()}


class Setup:
  """One width: the model, its loss, initial parameters, an example batch, the registration
  shared by the estimator and the transform, and the compiled steps (the race reuses them)."""

  def __init__(self, args, d: int, source: MarkovSource):
    ff = cm.swiglu_width(d) if args.ff is None else args.ff
    self.model = Decoder(args.vocab, d, args.layers, ff, max(1, d // args.head_dim))
    self.batch = jax.tree.map(jnp.asarray, source.batch(0, args.batch, args.seq))
    self.params = self.model.init(jax.random.key(args.seed), self.batch["x"])
    self.shape = cm.ModelShape(d, args.layers, args.vocab, args.seq, args.batch, ff)
    self.loss_fn = make_loss_fn(self.model, args.seq)
    self.registration = kfac_jax.Registration(
      self.loss_fn, self.params, self.batch, layers=layer_config(args)
    )
    self.kfac = make_kfac(self.registration, args)
    self.compiled: dict[str, object] = {}  # "adamw_step <lr>", "kfac_step"


def measure(args, setup: Setup) -> dict:
  """Every component's time at one width, the phases of the K-FAC step, the state's bytes."""
  loss_fn, params, batch, shape = setup.loss_fn, setup.params, setup.batch, setup.shape
  d = shape.d
  rng = jax.random.key(args.seed + 1)
  r = args.repeats
  sched = schedule(args)
  out: dict = {"d": d, "ff": shape.hidden, "params": shape.params, "tokens": shape.tokens}
  print(f"d={d}: {shape.params / 1e6:.1f}M parameters, ff={shape.hidden}", flush=True)
  secs, compile_s = {}, {}

  def record(name, fn, *a, repeats=r, keep=None):
    compile_s[name], secs[name], res, compiled = timed(fn, *a, repeats=repeats)
    print(
      f"  {name:18s} {1e3 * secs[name]:10.1f} ms  (compile {compile_s[name]:.1f} s)", flush=True
    )
    if keep:
      setup.compiled[keep] = compiled
    return res

  _, grads = record("forward_backward", jax.value_and_grad(loss_fn), params, batch)
  lr = args.adamw_lrs[0]
  tx = adamw(lr, args.weight_decay)
  opt = tx.init(params)

  def adamw_update(grads, opt, params):
    u, opt = tx.update(grads, opt, params)
    return optax.apply_updates(params, u), opt

  record("adamw_update", adamw_update, grads, opt, params)
  record("adamw_step", make_adamw_step(loss_fn, tx), params, opt, batch, keep=f"adamw_step {lr}")

  est = make_estimator(setup.registration, args)
  es = est.init(params)
  out["factors"] = {
    "registered": registered_totals(est),
    "cost_model": cm.totals(cm.factor_sides(shape, sched)),
  }
  rows = statistics_rows(batch, args.statistics_fraction)

  def statistics(es, params, rows, rng):
    stats = est.curvature_stats(params, rows, rng)
    return est.update_curvature_from_stats(es, stats, args.ema_decay)

  es = record("statistics", statistics, es, params, rows, rng)
  es = record(
    "refresh", lambda es: est.update_inverses(es, args.damping), es, repeats=max(1, r - 1)
  )
  record("preconditioning", lambda es, g: est.multiply_matpower(es, g, -1), es, grads)

  kstate = setup.kfac.init(params)
  out["state_bytes"] = {
    "params": _harness.tree_bytes(params),
    "kfac": _harness.tree_bytes(kstate),
    "adamw": _harness.tree_bytes(opt),
  }
  t0 = time.perf_counter()
  compiled = (
    jax.jit(make_kfac_step(loss_fn, setup.kfac)).lower(params, kstate, batch, rng).compile()
  )
  compile_s["kfac_step"] = time.perf_counter() - t0
  setup.compiled["kfac_step"] = compiled
  print(f"  kfac step compile {compile_s['kfac_step']:.1f} s", flush=True)
  counts = phases(sched.curvature_every, sched.inverse_every)
  # The cheapest phase there is (no "plain" one with statistics every step).
  base = next(k for k in ("plain", "statistics", "refresh", "both") if k in counts)
  # One untimed call first: the first call of an executable carries one-off costs.
  jax.block_until_ready(compiled(params, with_count(kstate, counts[base][0]), batch, rng))
  phase_s = {}
  for name, (count, _) in counts.items():
    state = with_count(kstate, count)
    best = math.inf
    for _ in range(r if name == base else max(1, r - 1)):
      t0 = time.perf_counter()
      jax.block_until_ready(compiled(params, state, batch, rng))
      best = min(best, time.perf_counter() - t0)
    phase_s[name] = best
    print(f"  kfac step, {name:10s} {1e3 * best:8.1f} ms", flush=True)
  period = math.lcm(sched.curvature_every, sched.inverse_every)
  secs["kfac_plain_step"] = phase_s[base]
  secs["kfac_amortised_step"] = sum(phase_s[k] * n for k, (_, n) in counts.items()) / period
  out.update(seconds=secs, compile_s=compile_s, kfac_phases_s=phase_s)
  return out


def registered_totals(est: kfac_jax.CurvatureEstimator) -> dict[str, float]:
  """`cost_model.totals` of the factor shapes the estimator's blocks keep: `[..., n, n]` a
  matrix (leading axes: a stack), `[n]` a diagonal."""
  sides = []
  for b in est.blocks:
    for s in b.factor_shapes:
      if len(s) >= 2 and s[-1] == s[-2]:
        sides.append(cm.Side(s[-1], s[-1], math.prod(s[:-2])))
      else:
        sides.append(cm.Side(math.prod(s), 1, 1))
  return cm.totals(sides)


def make_adamw_step(loss_fn, tx):
  def step(params, state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss

  return step


def make_kfac_step(loss_fn, tx):
  """`jax.value_and_grad`, then the transform, which computes the statistics from `batch=` on
  due steps only."""

  def step(params, state, batch, rng):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    updates, state = tx.update(grads, state, params, batch=batch, rng=rng)
    return optax.apply_updates(params, updates), state, loss

  return step


def schedule(args) -> cm.Schedule:
  return cm.Schedule(
    curvature_every=args.curvature_every,
    inverse_every=args.inverse_every,
    statistics_fraction=args.statistics_fraction,
    block_size=kfac_jax.LayerConfig().block_size if args.block_size is None else args.block_size,
  )


# -- the cost model against the measurements ----------------------------------------------------

COMPONENTS = ("forward_backward", "statistics", "refresh", "preconditioning", "adamw_update")
STEPS = ("adamw_step", "kfac_plain_step", "kfac_amortised_step")


RECORDED = (
  "layers",
  "vocab",
  "seq",
  "batch",
  "ff",
  "head_dim",
  "curvature_every",
  "inverse_every",
  "statistics_fraction",
  "block_size",
)
"""The flags of a recorded run that `--from-json` takes over (its widths come with its rows)."""


def calibrate(args, widths: list[int]) -> dict:
  """The cost model's calibrated rates: categorical draws per second (the library's sampler of
  the Fisher's targets over the vocabulary, for the statistics' tokens; the minimum of three
  calls), and the FLOP/s of the preconditioning's matrix products at each width
  (`cost_model.product_shapes`, each the minimum of five; the geometric mean over widths is the
  model's product rate)."""
  rows = max(1, math.ceil(args.statistics_fraction * args.batch)) * args.seq
  logits = 3.0 * jax.random.normal(jax.random.key(0), (rows, args.vocab), jnp.float32)

  def draw(rng, z):
    u = jax.random.uniform(rng, (1, rows, 2), z.dtype)
    return _losses.categorical_inverse_cdf(jax.nn.softmax(z, axis=-1), u)

  _, t, _, _ = timed(draw, jax.random.key(1), logits, repeats=3)
  sched = schedule(args)
  product = {}
  for d in widths:
    shape = cm.ModelShape(d, args.layers, args.vocab, args.seq, 1, ff=args.ff)
    flops = secs = 0.0
    for count, k, m, w, n in cm.product_shapes(shape, sched):
      keys = jax.random.split(jax.random.key(2))
      a = jax.random.normal(keys[0], (k, m, w), jnp.float32)
      b = jax.random.normal(keys[1], (k, w, n), jnp.float32)
      _, tp, _, _ = timed(jnp.matmul, a, b, repeats=5)
      flops += count * 2 * k * m * w * n
      secs += count * tp
    product[d] = flops / secs
  gmean = math.exp(sum(math.log(x) for x in product.values()) / len(product))
  return {"draw": rows * args.vocab / t, "product": gmean, "product_by_d": product}


def model_report(args, rows: list[dict], calibration: dict) -> dict:
  """The cost model fitted to `rows`, its errors on each measurement, its predictions."""
  sched = schedule(args)
  shapes = {
    row["d"]: cm.ModelShape(row["d"], args.layers, args.vocab, args.seq, args.batch, row["ff"])
    for row in rows
  }
  machine = cm.fit(
    [{"shape": shapes[row["d"]], "schedule": sched, "seconds": row["seconds"]} for row in rows],
    cm.Calibration(calibration["draw"], calibration["product"]),
  )
  errors = {}
  for row in rows:
    pred = cm.predict(shapes[row["d"]], sched, machine)
    errors[row["d"]] = {
      k: pred[k] / row["seconds"][k] - 1 for k in COMPONENTS + STEPS if k in row["seconds"]
    }
  big = cm.ModelShape(
    args.predict_d, args.predict_layers, args.vocab, args.predict_seq, args.predict_batch
  )
  big_sched = cm.Schedule(
    curvature_every=args.predict_curvature_every,
    inverse_every=args.predict_inverse_every,
    statistics_fraction=args.predict_statistics_fraction,
    block_size=args.predict_block_size,
  )
  predictions = {
    "measured": {row["d"]: cm.predict(shapes[row["d"]], sched, machine) for row in rows},
    "large": {
      "shape": vars(big) | {"ff": big.hidden, "tokens": big.tokens, "params": big.params},
      "schedule": vars(big_sched),
      "seconds": cm.predict(big, big_sched, machine),
      "state_over_params": cm.state_ratio(big, big_sched),
    },
  }
  flops = {
    row["d"]: {k: vars(v) for k, v in cm.components(shapes[row["d"]], sched).items()}
    for row in rows
  }
  return {
    "machine": vars(machine),
    "errors": errors,
    "predictions": predictions,
    "costs": flops,
  }


def exponents(rows: list[dict]) -> dict[str, float]:
  ds = [row["d"] for row in rows]
  if len(set(ds)) < 2:
    return {}
  keys = [k for k in COMPONENTS + STEPS if all(k in row["seconds"] for row in rows)]
  return {k: cm.growth_exponent(ds, [row["seconds"][k] for row in rows]) for k in keys}


def print_tables(args, rows: list[dict], model: dict, growth: dict) -> None:
  tok = args.batch * args.seq
  print(
    f"\n{args.layers} layers, vocabulary {args.vocab:,}, {args.batch} x {args.seq} = {tok:,} "
    f"tokens per step; statistics every {args.curvature_every} steps from "
    f"{args.statistics_fraction:g} of the sequences, inverses every {args.inverse_every}."
  )
  head = (
    "| d | params | fwd+bwd | statistics | refresh | precond. | AdamW step | K-FAC plain "
    "| K-FAC amortised | plain / AdamW | amortised / AdamW | state / params (K-FAC, AdamW) |"
  )
  print(head)
  print("|---|" + "---:|" * (head.count("|") - 2))
  for row in rows:
    s = row["seconds"]
    b = row["state_bytes"]
    print(
      f"| {row['d']:,} | {row['params'] / 1e6:.1f}M | {1e3 * s['forward_backward']:.0f} | "
      f"{1e3 * s['statistics']:.0f} | {1e3 * s['refresh']:.0f} | "
      f"{1e3 * s['preconditioning']:.0f} | "
      f"{1e3 * s['adamw_step']:.0f} | {1e3 * s['kfac_plain_step']:.0f} | "
      f"{1e3 * s['kfac_amortised_step']:.0f} | {s['kfac_plain_step'] / s['adamw_step']:.2f}x | "
      f"{s['kfac_amortised_step'] / s['adamw_step']:.2f}x | "
      f"{b['kfac'] / b['params']:.2f}x, {b['adamw'] / b['params']:.2f}x |"
    )
  print("(milliseconds; each the minimum over the repeats)")
  if growth:
    print("growth exponents in d: " + ", ".join(f"{k} {v:.2f}" for k, v in growth.items()))
  m = model["machine"]
  print(
    f"\ncost model constants: matmul {m['matmul'] / 1e9:.1f} GFLOP/s, factorisation "
    f"{m['factor'] / 1e9:.1f} G(n³)/s, bandwidth {m['bandwidth'] / 1e9:.2f} GB/s; "
    f"calibrated: products {m['product'] / 1e9:.1f} GFLOP/s, categorical draws "
    f"{m['draw'] / 1e6:.1f} M/s"
  )
  print("model / measured - 1:")
  for d, e in model["errors"].items():
    print(f"  d={d}: " + ", ".join(f"{k} {100 * v:+.0f}%" for k, v in e.items()))
  big = model["predictions"]["large"]
  sh, sc, t = big["shape"], big["schedule"], big["seconds"]
  print(
    f"\nprediction, d={sh['d']:,}, {sh['layers']} layers, {sh['tokens']:,} tokens per step "
    f"({sh['params'] / 1e9:.2f}B parameters), statistics every {sc['curvature_every']} from "
    f"{sc['statistics_fraction']:g}, inverses every {sc['inverse_every']}, blocks "
    f"{sc['block_size']}: K-FAC plain / AdamW {t['ratio_plain']:.3f}x, amortised / AdamW "
    f"{t['ratio_amortised']:.3f}x; state / params {big['state_over_params']['kfac']:.2f}x "
    f"(AdamW 2x)"
  )
  print(
    "  per step, seconds on the fitted machine: "
    + ", ".join(
      f"{k} {t[k]:.3g}"
      for k in ("forward_backward", "statistics", "refresh", "preconditioning", "adamw_step")
    )
  )


# -- the race -------------------------------------------------------------------------------------


def race(args, setup: Setup, source: MarkovSource) -> dict:
  """AdamW for `--steps` steps per learning rate; K-FAC until it reaches the tuned AdamW's
  final (smoothed) training loss or spends `--race-budget` times AdamW's seconds. Every step's
  time is charged (the first one replaced by a typical step, `compare.curve_times`); batches
  are made and moved to the device before the clock starts."""
  params0, rng = setup.params, jax.random.key(args.seed + 2)
  batches: dict[int, dict] = {}

  def batch_at(t):
    if t not in batches:
      batches[t] = jax.tree.map(jnp.asarray, source.batch(1000 + t, args.batch, args.seq))
    return batches[t]

  def compiled(key, fn, *a):
    if key not in setup.compiled:
      setup.compiled[key] = jax.jit(fn).lower(*a).compile()
    return setup.compiled[key]

  window = max(1, min(args.reach_window, args.steps // 10))
  runs = {}
  for lr in args.adamw_lrs:
    tx = adamw(lr, args.weight_decay)
    p, s = params0, tx.init(params0)
    step = compiled(f"adamw_step {lr}", make_adamw_step(setup.loss_fn, tx), p, s, batch_at(0))
    losses, times = [], []
    for t in range(args.steps):
      b = batch_at(t)
      t0 = time.perf_counter()
      p, s, loss = jax.block_until_ready(step(p, s, b))
      times.append(time.perf_counter() - t0)
      losses.append(float(loss))
    times = compare.curve_times(times, 1)
    final = float(compare.smoothed(losses, window)[-1])
    runs[f"AdamW lr={lr:g}"] = {"losses": losses, "times": times.tolist(), "final": final}
    print(
      f"AdamW lr={lr:g}: loss {final:.4f} after {args.steps} steps, {times.sum():.2f} s", flush=True
    )
  best = min(runs, key=lambda k: runs[k]["final"])
  target = runs[best]["final"]
  adam_hit = compare.time_to_reach(runs[best]["losses"], runs[best]["times"], target, window)
  adam_s = adam_hit[1] if adam_hit else float(np.sum(runs[best]["times"]))

  p, s = params0, setup.kfac.init(params0)
  step = compiled("kfac_step", make_kfac_step(setup.loss_fn, setup.kfac), p, s, batch_at(0), rng)
  losses, times = [], []
  budget, t = args.race_budget * adam_s, 0
  while True:
    rng, sub = jax.random.split(rng)
    b = batch_at(t)
    t0 = time.perf_counter()
    p, s, loss = jax.block_until_ready(step(p, s, b, sub))
    times.append(time.perf_counter() - t0)
    losses.append(float(loss))
    t += 1
    if compare.smoothed(losses, window)[-1] <= target:
      break
    if _harness.charged_seconds(times, args.inverse_every) >= budget or t >= 100 * args.steps:
      break
  ktimes = compare.curve_times(times, args.inverse_every)
  hit = compare.time_to_reach(losses, ktimes, target, window)
  runs["K-FAC"] = {"losses": losses, "times": ktimes.tolist()}
  ratio = None if hit is None else hit[1] / adam_s
  print(
    f"K-FAC: {'not reached' if hit is None else f'{hit[1]:.2f} s, step {hit[0]}'} to the tuned "
    f"{best}'s loss {target:.4f} ({adam_s:.2f} s): "
    f"{'n/a' if ratio is None else f'{ratio:.2f}x'} AdamW's time",
    flush=True,
  )
  return {
    "d": setup.shape.d,
    "target": target,
    "window": window,
    "adamw_tuned": best,
    "adamw_seconds": adam_s,
    "kfac_hit": hit,
    "kfac_vs_adamw": ratio,
    "runs": runs,
  }


# -- command line ------------------------------------------------------------------------------


def _floats(s: str) -> list[float]:
  return [float(x) for x in s.split(",") if x]


def _ints(s: str) -> list[int]:
  return [int(x) for x in s.split(",") if x]


def parse_args(argv=None):
  p = argparse.ArgumentParser(
    description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
  )
  p.add_argument("--d", type=_ints, default=[512], help="widths, comma-separated")
  p.add_argument("--layers", type=int, default=8)
  p.add_argument("--vocab", type=int, default=32768)
  p.add_argument("--seq", type=int, default=256, help="sequence length")
  p.add_argument("--batch", type=int, default=32, help="sequences per step")
  p.add_argument("--ff", type=int, default=None, help="SwiGLU width (default 8d/3, to 256)")
  p.add_argument("--head-dim", type=int, default=64)
  p.add_argument("--curvature-every", type=int, default=10)
  p.add_argument("--inverse-every", type=int, default=10)
  p.add_argument("--statistics-fraction", type=float, default=0.125)
  p.add_argument(
    "--block-size", type=int, default=None, help="LayerConfig.block_size (default: the library's)"
  )
  p.add_argument("--kfac-lr", type=float, default=1.0)
  p.add_argument("--kfac-momentum", type=float, default=0.7)
  p.add_argument("--max-norm", type=float, default=0.3)
  p.add_argument("--damping", type=float, default=0.1)
  p.add_argument("--ema-decay", type=float, default=0.95)
  p.add_argument("--adamw-lrs", type=_floats, default=[1e-3, 3e-3])
  p.add_argument("--weight-decay", type=float, default=0.0)
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument("--race", action="store_true", help="also race AdamW and K-FAC at --d[0]")
  p.add_argument(
    "--components",
    action=argparse.BooleanOptionalAction,
    default=True,
    help="time the components and fit the cost model (--no-components: the race alone)",
  )
  p.add_argument("--steps", type=int, default=300, help="AdamW steps in the race")
  p.add_argument("--race-budget", type=float, default=1.0, help="K-FAC's cap, x AdamW's time")
  p.add_argument("--reach-window", type=int, default=20)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--predict-d", type=int, default=4096)
  p.add_argument("--predict-layers", type=int, default=32)
  p.add_argument("--predict-seq", type=int, default=2048)
  p.add_argument("--predict-batch", type=int, default=512, help="sequences (512 x 2048 = 1M)")
  p.add_argument("--predict-curvature-every", type=int, default=10)
  p.add_argument("--predict-inverse-every", type=int, default=100)
  p.add_argument("--predict-statistics-fraction", type=float, default=1 / 16)
  p.add_argument("--predict-block-size", type=int, default=2048)
  p.add_argument("--from-json", default=None, help="refit the cost model to a recorded run")
  p.add_argument("--json", default=os.path.join("out", "scale.json"))
  p.add_argument("--quick", action="store_true", help="a tiny model (smoke test)")
  args = p.parse_args(argv)
  if args.quick:
    args.d, args.layers, args.vocab, args.seq, args.batch = [32], 1, 256, 8, 4
    args.curvature_every, args.inverse_every, args.statistics_fraction = 2, 4, 0.5
    args.repeats, args.steps, args.adamw_lrs, args.head_dim = 1, 4, [3e-3], 16
  return args


def main(argv=None) -> int:
  args = parse_args(argv)
  source = MarkovSource(args.vocab, seed=args.seed)
  dev = jax.local_devices()[0]
  env = {
    "jax": jax.__version__,
    "device": f"{dev.platform}:{getattr(dev, 'device_kind', '?')}",
    "cpu_count": os.cpu_count(),
    "command": _harness.command_line(__file__, argv),
  }
  print(f"{env['command']}\njax {env['jax']}, {env['device']}, {env['cpu_count']} CPUs", flush=True)
  setups: list[Setup] = []
  calibration = None
  if args.from_json:
    with open(args.from_json) as f:
      recorded = json.load(f)
    rows = recorded["measurements"]
    for row in rows:
      row["d"] = int(row["d"])
    for k in RECORDED:  # The measured configuration; the --predict-* flags stay this run's.
      setattr(args, k, recorded["config"][k])
    calibration = recorded.get("calibration")
  elif args.components:
    setups.append(Setup(args, args.d[0], source))
    rows = [measure(args, setups[0])]
    for d in args.d[1:]:  # One width at a time in memory (the first is kept for the race).
      rows.append(measure(args, Setup(args, d, source)))
  else:
    rows = []
  out = {
    "env": env,
    "config": {k: v for k, v in vars(args).items()},
    "source_entropy": source.entropy,
    "measurements": rows,
  }
  if rows:
    if calibration is None:  # A recording without one: calibrated on this machine now.
      calibration = calibrate(args, [row["d"] for row in rows])
    out["calibration"] = calibration
    model = model_report(args, rows, calibration)
    growth = exponents(rows)
    print_tables(args, rows, model, growth)
    out.update(growth_exponents=growth, cost_model=model)
  if args.race:
    out["race"] = race(args, setups[0] if setups else Setup(args, args.d[0], source), source)
  if args.json:
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
      json.dump(out, f, indent=1, default=str)
    print(f"wrote {args.json}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
