"""A cost model of one K-FAC step and one AdamW step of a decoder Transformer, per component.

Pure arithmetic on the layer shapes, the schedule and the tokens per step (no JAX), so that it
predicts configurations no machine at hand can run. Each component gets its floating-point
operations and the bytes it moves; its time is `flops / rate + bytes / bandwidth`, with three
machine constants fitted from measurements (`fit`): the matrix-multiply rate of the passes
(forward and backward, statistics), the factorisation rate (the inverse refresh, counted as n³
operations per n × n factor) and the memory bandwidth (elementwise optimizer updates, the
memory-bound parts of every pass); and two timed by calibration on their own (`Calibration`):
the rate of the preconditioning products, small-by-large matrix products (d × d inverses
against d × V and V × d tables) whose achieved rate is not the passes' mix of shapes, and the
categorical draws of the sampled targets.

The model (`ModelShape`): a pre-norm decoder with RMSNorm, multi-head attention (q, k, v, o of
d × d), a SwiGLU MLP (gate and up d × ff, down ff × d), an untied vocabulary head; an embedding
table that the step gathers from. The curvature (`Schedule`): Kronecker factors A (input side)
and G (output side) per dense layer, stacked over the layers; a side wider than
`max_factor_dim` is kept as its diagonal (the vocabulary head's output side, the embedding's
input side), a side wider than `block_size` (when set) as diagonal blocks of that size
(`Side`); RMSNorm scales are full d × d blocks. Statistics every `curvature_every` steps from
`statistics_fraction` of the tokens, inverses every `inverse_every` steps.

Components, with T tokens per step, f the statistics fraction, and P the matmul parameters:

  forward+backward   6 P T + 12 L b s² d (causal attention scores and values, computed in full)
  statistics         f (4 P T + 12 L b s² d) (one forward and one sampled backward pass: only
                     activation gradients, no weight gradients) + 2 f T Σ n·w over the factor
                     sides (the A = aᵀa and G = gᵀg products; w = n, or the block size, or 1),
                     and f T V categorical draws (the sampled targets: a pass over each
                     token's V probabilities, timed on its own)
  refresh            Σ n·w² over the factor sides (n³ for a whole factor, n B² in blocks)
  preconditioning    2 Σ (n_in w_in n_out + n_in n_out w_out) per dense layer (A⁻¹ V G⁻¹), at
                     the calibrated product rate, whose timing includes the products' operands
                     and results; bytes only for the tables scaled by a diagonal side
  AdamW update       7 parameter-sized arrays read or written (params, grads, m, v; new ones)
  K-FAC update       8 (the guard's finiteness tests, clipping's inner product, momentum, the
                     learning rate)

with bytes for the activations of the passes, the factors and inverses that the statistics
and refresh read and write, and the optimizer updates (float32 throughout).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

F32 = 4


def swiglu_width(d: int, multiple: int = 256) -> int:
  """The SwiGLU hidden width: 8d/3 rounded up to a multiple of 256 (11,008 at d = 4,096)."""
  return multiple * math.ceil(8 * d / 3 / multiple)


@dataclasses.dataclass(frozen=True)
class ModelShape:
  """A decoder Transformer and its step: width d, layers L, vocabulary V, sequence length s,
  b sequences per step, SwiGLU width ff (None: `swiglu_width(d)`)."""

  d: int
  layers: int
  vocab: int
  seq: int
  batch: int
  ff: int | None = None

  @property
  def hidden(self) -> int:
    return swiglu_width(self.d) if self.ff is None else self.ff

  @property
  def tokens(self) -> int:
    return self.batch * self.seq

  def dense(self) -> list[tuple[str, int, int, int]]:
    """`(name, d_in, d_out, count)` of every dense layer (count: how many, stacked)."""
    d, ff, n = self.d, self.hidden, self.layers
    return [
      ("q", d, d, n),
      ("k", d, d, n),
      ("v", d, d, n),
      ("o", d, d, n),
      ("gate", d, ff, n),
      ("up", d, ff, n),
      ("down", ff, d, n),
      ("head", d, self.vocab, 1),
    ]

  @property
  def matmul_params(self) -> int:
    return sum(i * o * c for _, i, o, c in self.dense())

  @property
  def params(self) -> int:
    """Every parameter: dense kernels, the embedding table, the RMSNorm scales."""
    return self.matmul_params + self.vocab * self.d + (2 * self.layers + 1) * self.d


@dataclasses.dataclass(frozen=True)
class Schedule:
  """The K-FAC schedule and factor layout."""

  curvature_every: int = 10
  inverse_every: int = 10
  statistics_fraction: float = 0.125
  block_size: int | None = None
  max_factor_dim: int | None = 16384


@dataclasses.dataclass(frozen=True)
class Side:
  """One factor side of n rows kept as blocks of width w (w = n: a whole matrix; w = 1: its
  diagonal), `count` times (stacked layers). `per_sequence`: its statistics are outer products
  of per-sequence vectors (a parameter shared by the positions, the RMSNorm scales), not of
  per-token ones."""

  n: int
  w: int
  count: int
  per_sequence: bool = False

  @property
  def stored(self) -> int:
    """Entries kept: n·w (n/w blocks of w²)."""
    return self.n * self.w


def side(n: int, sched: Schedule) -> int:
  """The width w a factor side of n rows is kept with."""
  if sched.max_factor_dim is not None and n > sched.max_factor_dim:
    return 1
  if sched.block_size is not None and n > sched.block_size:
    return sched.block_size
  return n


def factor_sides(shape: ModelShape, sched: Schedule) -> list[Side]:
  """Every factor side of the curvature state (dense A and G, embedding G, RMSNorm blocks)."""
  out = []
  for _, i, o, c in shape.dense():
    out += [Side(i, side(i, sched), c), Side(o, side(o, sched), c)]
  # Embedding: A is the diagonal of token counts, G is d x d.
  out += [Side(shape.vocab, 1, 1), Side(shape.d, side(shape.d, sched), 1)]
  # RMSNorm scales (two per layer, one final): a full block of d parameters.
  out += [Side(shape.d, side(shape.d, sched), 2 * shape.layers + 1, per_sequence=True)]
  return out


def statistics_rows(shape: ModelShape, sched: Schedule) -> int:
  """Sequences the statistics use: ⌈f·b⌉ (at least one), as the transform takes them."""
  return max(1, math.ceil(sched.statistics_fraction * shape.batch))


@dataclasses.dataclass(frozen=True)
class Cost:
  """FLOPs, bytes moved, and categorical draws (one per logit of each sampled token)."""

  flops: float
  bytes: float
  draws: float = 0.0


def activation_bytes(shape: ModelShape, tokens: float, batch: float) -> float:
  """Bytes the elementwise parts of one forward and backward pass move (written and read back):
  per layer and token about 24 d- and 8 ff-wide float32 vectors (norms, residuals, RoPE, SwiGLU),
  the attention probabilities 6 times, the logits 6 times (softmax, loss, its gradient)."""
  L, d, ff, s, V = shape.layers, shape.d, shape.hidden, shape.seq, shape.vocab
  heads = max(1, d // 64)
  return F32 * (tokens * (L * (24 * d + 8 * ff) + 6 * V) + 6 * L * batch * heads * s * s)


def components(shape: ModelShape, sched: Schedule) -> dict[str, Cost]:
  """FLOPs and bytes of each component where it runs (not amortised)."""
  T, b, s, L, d = shape.tokens, shape.batch, shape.seq, shape.layers, shape.d
  P, Pm = shape.params, shape.matmul_params
  attention = 12 * L * b * s * s * d
  f = statistics_rows(shape, sched) / b  # Whole sequences: ⌈f·b⌉ of the b.
  sides = factor_sides(shape, sched)
  stored = sum(x.stored * x.count for x in sides)
  out = {
    "forward_backward": Cost(
      6 * Pm * T + attention, activation_bytes(shape, T, b) + 3 * F32 * Pm + 2 * F32 * T * d
    ),
    "adamw_update": Cost(0.0, 7 * F32 * P),
    "kfac_update": Cost(0.0, 8 * F32 * P),
  }
  products = sum(2 * f * (b if x.per_sequence else T) * x.stored * x.count for x in sides)
  out["statistics"] = Cost(
    f * (4 * Pm * T + attention) + products,
    f * activation_bytes(shape, T, b) + 2 * F32 * Pm + 3 * F32 * stored,
    f * T * shape.vocab,  # The sampled targets: a categorical draw over V per token.
  )
  out["refresh"] = Cost(sum(float(x.n) * x.w * x.w * x.count for x in sides), 4 * F32 * stored)
  pre, scaled = 0.0, 0.0
  for _, i, o, c in shape.dense():
    pre += 2 * c * (i * side(i, sched) * o + i * o * side(o, sched))
    scaled += c * i * o * (side(i, sched) == 1 or side(o, sched) == 1)
  # The embedding table: its G side, times the vocabulary-diagonal A (elementwise).
  pre += 2 * shape.vocab * d * side(d, sched) + shape.vocab * d
  scaled += shape.vocab * d
  pre += 2 * (2 * L + 1) * d * side(d, sched)
  # Read and written once: the rest of the products' traffic is in the calibrated rate.
  out["preconditioning"] = Cost(pre, 2 * F32 * scaled)
  return out


@dataclasses.dataclass(frozen=True)
class Machine:
  """Rates: matmul FLOP/s of the passes, factorisation "FLOP/s" (n³ per factor), bytes/s,
  categorical draws per second (per logit of each sampled token), and the FLOP/s of the
  preconditioning products."""

  matmul: float
  factor: float
  bandwidth: float
  draw: float
  product: float


@dataclasses.dataclass(frozen=True)
class Calibration:
  """The rates timed on their own rather than fitted: categorical draws per second, and the
  FLOP/s of the preconditioning's matrix products (`product_shapes`)."""

  draw: float
  product: float


def product_shapes(shape: ModelShape, sched: Schedule) -> list[tuple[int, int, int, int, int]]:
  """`(count, k, m, w, n)` of every matrix product of the preconditioning, each `count` times
  `[k, m, w] @ [k, w, n]` (k blocks of width w): a dense layer's `[i, o]` gradient against its
  A side (`m = w_i, n = o`) and its G side (`m = i, n = w_o`), the embedding's `[V, d]` gradient
  and the RMSNorm scales against their G side. Diagonal sides are elementwise and left out. The
  calibration times these, so its rate is that of the products' own mix of shapes."""
  out: dict[tuple[int, int, int, int], int] = {}

  def add(count, k, m, w, n):
    out[(k, m, w, n)] = out.get((k, m, w, n), 0) + count

  for _, i, o, c in shape.dense():
    wi, wo = side(i, sched), side(o, sched)
    if wi > 1:
      add(c, -(-i // wi), wi, wi, o)
    if wo > 1:
      add(c, -(-o // wo), i, wo, wo)
  wd = side(shape.d, sched)
  if wd > 1:
    add(1, -(-shape.d // wd), shape.vocab, wd, wd)
    add(2 * shape.layers + 1, -(-shape.d // wd), 1, wd, wd)
  return [(c, *key) for key, c in out.items()]


RATE_OF = {
  "forward_backward": "matmul",
  "statistics": "matmul",
  "preconditioning": "product",
  "refresh": "factor",
  "adamw_update": "matmul",
  "kfac_update": "matmul",
}


def seconds(cost: Cost, rate: float, m: Machine) -> float:
  return cost.flops / rate + cost.bytes / m.bandwidth + cost.draws / m.draw


def predict(shape: ModelShape, sched: Schedule, m: Machine) -> dict[str, float]:
  """Seconds per component where it runs, and the amortised steps and their ratios."""
  c = components(shape, sched)
  t = {k: seconds(v, getattr(m, RATE_OF[k]), m) for k, v in c.items()}
  adamw = t["forward_backward"] + t["adamw_update"]
  plain = t["forward_backward"] + t["preconditioning"] + t["kfac_update"]
  amortised = plain + t["statistics"] / sched.curvature_every + t["refresh"] / sched.inverse_every
  t.update(
    adamw_step=adamw,
    kfac_plain_step=plain,
    kfac_amortised_step=amortised,
    ratio_plain=plain / adamw,
    ratio_amortised=amortised / adamw,
  )
  return t


def state_ratio(shape: ModelShape, sched: Schedule) -> dict[str, float]:
  """Optimizer state / parameter bytes: K-FAC (factors, inverses, momentum) and AdamW (2)."""
  stored = sum(x.stored * x.count for x in factor_sides(shape, sched))
  return {"kfac": (2 * stored + shape.params) / shape.params, "adamw": 2.0}


def fit(measured: Sequence[Mapping], calibration: Calibration) -> Machine:
  """The machine constants from measurements: rows `{"shape", "schedule", "seconds": {component:
  s}}`. The bandwidth from the AdamW updates (bytes only), then the matmul rate from the
  forward+backward passes, then the factorisation rate from the refreshes (each the geometric
  mean over the rows of what makes the row's time exact given the constants before it, with the
  bytes' share of a row's time capped at half). The draw and product rates are the
  calibration's (timed by `scale.py`), not fitted."""

  def gmean(xs):
    xs = list(xs)
    return math.exp(sum(math.log(x) for x in xs) / len(xs))

  comps = [(components(r["shape"], r["schedule"]), r["seconds"]) for r in measured]
  if not comps:
    raise ValueError("fit: no measurements.")
  bandwidth = gmean(c["adamw_update"].bytes / t["adamw_update"] for c, t in comps)

  def rate(name):
    return gmean(
      c[name].flops / max(t[name] - c[name].bytes / bandwidth, 0.5 * t[name]) for c, t in comps
    )

  return Machine(
    rate("forward_backward"), rate("refresh"), bandwidth, calibration.draw, calibration.product
  )


def totals(sides: Sequence[Side]) -> dict[str, float]:
  """Entries stored and refresh work (Σ n·w²) of some factor sides: compared with what a
  registration keeps (`scale.py` reads its blocks' factor shapes)."""
  return {
    "stored": float(sum(x.stored * x.count for x in sides)),
    "refresh": float(sum(float(x.n) * x.w * x.w * x.count for x in sides)),
  }


def growth_exponent(ds: Sequence[float], values: Sequence[float]) -> float:
  """The least-squares slope of log(value) against log(d)."""
  xs = [math.log(x) for x in ds]
  ys = [math.log(y) for y in values]
  mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
  den = sum((x - mx) ** 2 for x in xs)
  return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / den if den else float("nan")
