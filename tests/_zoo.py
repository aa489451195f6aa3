"""The model zoo: small linen and nnx models with their loss functions, batches and the layers
the scanner must find (shared by tests/test_zoo.py and benchmarks/zoo.py).

Each builder returns a `Zoo`: `loss_fn(params, batch)`, `params`, `batch` and `expected`, the
`(kind, approx, param_paths)` of every layer `kfac_jax.scan_layers` must return, in order.
Non-parameter state (BatchNorm statistics) stays outside `params`: linen's `batch_stats`
collection is passed through the batch and updated with `mutable=`, nnx's `BatchStat` variables
are split off by `nnx.split` and merged back inside `loss_fn`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax import nnx

import kfac_jax

N = 4  # batch size
CLASSES = 5


@dataclasses.dataclass
class Zoo:
  loss_fn: Callable
  params: Any
  batch: Any
  expected: list[tuple[str, str, tuple[str, ...]]]


def _ce(logits, y):
  kfac_jax.register_softmax_cross_entropy_loss(logits, y)
  return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def _images(key, hw=8, c=3):
  kx, ky = jax.random.split(key)
  return {"x": jax.random.normal(kx, (N, hw, hw, c)), "y": jax.random.randint(ky, (N,), 0, CLASSES)}


def _dense(prefix, bias=True):
  paths = (f"{prefix}/kernel",) + ((f"{prefix}/bias",) if bias else ())
  return ("dense", "kron", paths)


def _conv(prefix, approx="kron"):
  return ("conv", approx, (f"{prefix}/kernel", f"{prefix}/bias"))


def _norm(prefix):
  return ("scale_and_shift", "full", (f"{prefix}/scale", f"{prefix}/bias"))


def _linen(module, batch, extra_vars=(), mutable=False):
  """loss_fn over linen `params`; other collections come in `batch["state"]`."""
  variables = module.init(jax.random.key(1), batch["x"])
  params = variables["params"]
  state = {k: v for k, v in variables.items() if k in extra_vars}
  if state:
    batch = dict(batch, state=state)

  def loss_fn(p, b):
    v = {"params": p, **b.get("state", {})}
    if mutable:
      out, _ = module.apply(v, b["x"], mutable=list(extra_vars))
    else:
      out = module.apply(v, b["x"])
    return _ce(out, b["y"])

  return loss_fn, params, batch


def _nnx(model, batch):
  """loss_fn over the model's `nnx.Param` state; other variables are merged back inside."""
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  def loss_fn(p, b):
    # Fresh copies: train-mode BatchNorm writes its statistics into the merged module, which
    # must not touch the Variables created outside this trace.
    m = nnx.merge(graphdef, p, jax.tree_util.tree_map(jnp.asarray, rest))
    return _ce(m(b["x"]), b["y"])

  return loss_fn, params, batch


# -- MLP ---------------------------------------------------------------------------------------


class LinenMLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = x.reshape(x.shape[0], -1)
    return nn.Dense(CLASSES)(jnp.tanh(nn.Dense(16)(x)))


class NnxMLP(nnx.Module):
  def __init__(self, rngs):
    self.l1 = nnx.Linear(8 * 8 * 3, 16, rngs=rngs)
    self.l2 = nnx.Linear(16, CLASSES, rngs=rngs)

  def __call__(self, x):
    return self.l2(jnp.tanh(self.l1(x.reshape(x.shape[0], -1))))


def mlp(flavour: str) -> Zoo:
  batch = _images(jax.random.key(0))
  if flavour == "linen":
    f, p, b = _linen(LinenMLP(), batch)
    return Zoo(f, p, b, [_dense("Dense_0"), _dense("Dense_1")])
  f, p, b = _nnx(NnxMLP(nnx.Rngs(0)), batch)
  return Zoo(f, p, b, [_dense("l1"), _dense("l2")])


# -- CNN with pooling ----------------------------------------------------------------------------


class LinenCNN(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Conv(4, (3, 3))(x))
    x = nn.avg_pool(x, (2, 2), (2, 2))
    x = nn.relu(nn.Conv(6, (3, 3), padding="VALID")(x))
    x = nn.max_pool(x, (2, 2), (2, 2))
    return nn.Dense(CLASSES)(x.reshape(x.shape[0], -1))


class NnxCNN(nnx.Module):
  def __init__(self, rngs):
    self.c1 = nnx.Conv(3, 4, (3, 3), rngs=rngs)
    self.c2 = nnx.Conv(4, 6, (3, 3), padding="VALID", rngs=rngs)
    self.head = nnx.Linear(6, CLASSES, rngs=rngs)

  def __call__(self, x):
    x = nnx.avg_pool(nnx.relu(self.c1(x)), (2, 2), (2, 2))
    x = nnx.max_pool(nnx.relu(self.c2(x)), (2, 2), (2, 2))
    return self.head(x.reshape(x.shape[0], -1))


def cnn(flavour: str) -> Zoo:
  batch = _images(jax.random.key(0))
  if flavour == "linen":
    f, p, b = _linen(LinenCNN(), batch)
    return Zoo(f, p, b, [_conv("Conv_0"), _conv("Conv_1"), _dense("Dense_0")])
  f, p, b = _nnx(NnxCNN(nnx.Rngs(0)), batch)
  return Zoo(f, p, b, [_conv("c1"), _conv("c2"), _dense("head")])


# -- ResNet-style with BatchNorm (training mode) -------------------------------------------------


class LinenResNet(nn.Module):
  @nn.compact
  def __call__(self, x):
    bn = lambda: nn.BatchNorm(use_running_average=False)  # noqa: E731
    x = nn.relu(bn()(nn.Conv(4, (3, 3), use_bias=False)(x)))
    y = nn.relu(bn()(nn.Conv(4, (3, 3), use_bias=False)(x)))
    y = bn()(nn.Conv(4, (3, 3), use_bias=False)(y))
    x = nn.relu(x + y)
    return nn.Dense(CLASSES)(jnp.mean(x, axis=(1, 2)))


class NnxResNet(nnx.Module):
  def __init__(self, rngs):
    self.c0 = nnx.Conv(3, 4, (3, 3), use_bias=False, rngs=rngs)
    self.b0 = nnx.BatchNorm(4, rngs=rngs)
    self.c1 = nnx.Conv(4, 4, (3, 3), use_bias=False, rngs=rngs)
    self.b1 = nnx.BatchNorm(4, rngs=rngs)
    self.c2 = nnx.Conv(4, 4, (3, 3), use_bias=False, rngs=rngs)
    self.b2 = nnx.BatchNorm(4, rngs=rngs)
    self.head = nnx.Linear(4, CLASSES, rngs=rngs)

  def __call__(self, x):
    x = nnx.relu(self.b0(self.c0(x)))
    y = nnx.relu(self.b1(self.c1(x)))
    y = self.b2(self.c2(y))
    return self.head(jnp.mean(nnx.relu(x + y), axis=(1, 2)))


def resnet(flavour: str) -> Zoo:
  batch = _images(jax.random.key(0))
  conv = lambda name: ("conv", "kron", (f"{name}/kernel",))  # noqa: E731
  if flavour == "linen":
    f, p, b = _linen(LinenResNet(), batch, extra_vars=("batch_stats",), mutable=True)
    return Zoo(
      f,
      p,
      b,
      [
        _norm("BatchNorm_0"),
        _norm("BatchNorm_1"),
        _norm("BatchNorm_2"),
        conv("Conv_0"),
        conv("Conv_1"),
        conv("Conv_2"),
        _dense("Dense_0"),
      ],
    )
  model = NnxResNet(nnx.Rngs(0))
  model.train()
  f, p, b = _nnx(model, batch)
  return Zoo(
    f,
    p,
    b,
    [_norm("b0"), _norm("b1"), _norm("b2"), conv("c0"), conv("c1"), conv("c2"), _dense("head")],
  )


# -- Transformer LM (untied embeddings) ----------------------------------------------------------

VOCAB, SEQ, DIM, HEADS = 11, 6, 8, 2


class LinenBlock(nn.Module):
  @nn.compact
  def __call__(self, x):
    mask = nn.make_causal_mask(jnp.ones(x.shape[:2]))
    x = x + nn.MultiHeadDotProductAttention(HEADS)(nn.LayerNorm()(x), mask=mask)
    h = nn.Dense(2 * DIM)(nn.LayerNorm()(x))
    return x + nn.Dense(DIM)(nn.gelu(h))


class LinenLM(nn.Module):
  @nn.compact
  def __call__(self, ids):
    x = nn.Embed(VOCAB, DIM)(ids)
    x = LinenBlock()(x)
    return nn.Dense(VOCAB)(nn.LayerNorm()(x))


class NnxLM(nnx.Module):
  def __init__(self, rngs):
    self.embed = nnx.Embed(VOCAB, DIM, rngs=rngs)
    self.ln1 = nnx.LayerNorm(DIM, rngs=rngs)
    self.attn = nnx.MultiHeadAttention(HEADS, DIM, decode=False, rngs=rngs)
    self.ln2 = nnx.LayerNorm(DIM, rngs=rngs)
    self.up = nnx.Linear(DIM, 2 * DIM, rngs=rngs)
    self.down = nnx.Linear(2 * DIM, DIM, rngs=rngs)
    self.ln_f = nnx.LayerNorm(DIM, rngs=rngs)
    self.head = nnx.Linear(DIM, VOCAB, rngs=rngs)

  def __call__(self, ids):
    x = self.embed(ids)
    mask = nnx.make_causal_mask(jnp.ones(ids.shape))
    x = x + self.attn(self.ln1(x), mask=mask)
    x = x + self.down(nnx.gelu(self.up(self.ln2(x))))
    return self.head(self.ln_f(x))


def transformer(flavour: str) -> Zoo:
  k1, k2 = jax.random.split(jax.random.key(0))
  batch = {
    "x": jax.random.randint(k1, (N, SEQ), 0, VOCAB),
    "y": jax.random.randint(k2, (N, SEQ), 0, VOCAB),
  }
  emb = lambda name: ("embedding", "kron", (f"{name}/embedding",))  # noqa: E731
  if flavour == "linen":
    f, p, b = _linen(LinenLM(), batch)
    blk = "LinenBlock_0"
    att = f"{blk}/MultiHeadDotProductAttention_0"
    return Zoo(
      f,
      p,
      b,
      [
        _dense("Dense_0"),
        emb("Embed_0"),
        _norm("LayerNorm_0"),
        _dense(f"{blk}/Dense_0"),
        _dense(f"{blk}/Dense_1"),
        _norm(f"{blk}/LayerNorm_0"),
        _norm(f"{blk}/LayerNorm_1"),
        _dense(f"{att}/key"),
        _dense(f"{att}/out"),
        _dense(f"{att}/query"),
        _dense(f"{att}/value"),
      ],
    )
  f, p, b = _nnx(NnxLM(nnx.Rngs(0)), batch)
  return Zoo(
    f,
    p,
    b,
    [
      _dense("attn/key"),
      _dense("attn/out"),
      _dense("attn/query"),
      _dense("attn/value"),
      _dense("down"),
      emb("embed"),
      _dense("head"),
      _norm("ln1"),
      _norm("ln2"),
      _norm("ln_f"),
      _dense("up"),
    ],
  )


# -- depthwise-separable conv net ----------------------------------------------------------------


class LinenSeparable(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Conv(6, (3, 3))(x))
    x = nn.Conv(6, (3, 3), feature_group_count=6)(x)  # depthwise
    x = nn.relu(nn.Conv(8, (1, 1))(x))  # pointwise
    return nn.Dense(CLASSES)(jnp.mean(x, axis=(1, 2)))


class NnxSeparable(nnx.Module):
  def __init__(self, rngs):
    self.stem = nnx.Conv(3, 6, (3, 3), rngs=rngs)
    self.depthwise = nnx.Conv(6, 6, (3, 3), feature_group_count=6, rngs=rngs)
    self.pointwise = nnx.Conv(6, 8, (1, 1), rngs=rngs)
    self.head = nnx.Linear(8, CLASSES, rngs=rngs)

  def __call__(self, x):
    x = self.depthwise(nnx.relu(self.stem(x)))
    return self.head(jnp.mean(nnx.relu(self.pointwise(x)), axis=(1, 2)))


def separable(flavour: str) -> Zoo:
  batch = _images(jax.random.key(0))
  if flavour == "linen":
    f, p, b = _linen(LinenSeparable(), batch)
    return Zoo(
      f, p, b, [_conv("Conv_0"), _conv("Conv_1", "diagonal"), _conv("Conv_2"), _dense("Dense_0")]
    )
  f, p, b = _nnx(NnxSeparable(nnx.Rngs(0)), batch)
  return Zoo(
    f, p, b, [_conv("depthwise", "diagonal"), _dense("head"), _conv("pointwise"), _conv("stem")]
  )


MODELS = {
  "mlp": mlp,
  "cnn": cnn,
  "resnet": resnet,
  "transformer": transformer,
  "separable": separable,
}


# ==============================================================================================
# Structure zoo (issue 13, items 3, 4, 7): Haiku and equinox models, a Gemma-style RMSNorm, a
# ViT-ish model with a learned positional table, a Flax OptimizedLSTMCell, a 32k-vocabulary head.
# Builders take no flavour; tests/test_zoo.py runs them through `STRUCTURE_MODELS`.
# ================================================================================================


def _hk_zoo(net, batch, expected):
  import haiku as hk  # pylint: disable=g-import-not-at-top (optional test extra)

  f = hk.without_apply_rng(hk.transform(net))
  params = f.init(jax.random.key(1), batch["x"])

  def loss_fn(p, b):
    return _ce(f.apply(p, b["x"]), b["y"])

  return Zoo(loss_fn, params, batch, expected)


def haiku_mlp() -> Zoo:
  import haiku as hk  # pylint: disable=g-import-not-at-top

  def net(x):
    x = x.reshape(x.shape[0], -1)
    return hk.Linear(CLASSES)(jnp.tanh(hk.Linear(16)(x)))

  paths = lambda m: ("dense", "kron", (f"{m}/w", f"{m}/b"))  # noqa: E731
  return _hk_zoo(net, _images(jax.random.key(0)), [paths("linear"), paths("linear_1")])


def haiku_cnn() -> Zoo:
  import haiku as hk  # pylint: disable=g-import-not-at-top

  def net(x):  # hk.Conv2D adds its bias with `jnp.broadcast_to(b, out.shape)`.
    x = jax.nn.relu(hk.Conv2D(4, 3)(x))
    x = jax.nn.relu(hk.Conv2D(6, 3, stride=2, padding="VALID")(x))
    return hk.Linear(CLASSES)(x.reshape(x.shape[0], -1))

  return _hk_zoo(
    net,
    _images(jax.random.key(0)),
    [
      ("conv", "kron", ("conv2_d/w", "conv2_d/b")),
      ("conv", "kron", ("conv2_d_1/w", "conv2_d_1/b")),
      ("dense", "kron", ("linear/w", "linear/b")),
    ],
  )


def _eqx_zoo(model, batch, apply, expected):
  import equinox as eqx  # pylint: disable=g-import-not-at-top (optional test extra)

  params, static = eqx.partition(model, eqx.is_array)

  def loss_fn(p, b):
    return _ce(apply(eqx.combine(p, static), b["x"]), b["y"])

  return Zoo(loss_fn, params, batch, expected)


def equinox_mlp() -> Zoo:
  import equinox as eqx  # pylint: disable=g-import-not-at-top

  k = jax.random.split(jax.random.key(2))
  model = {"l1": eqx.nn.Linear(8 * 8 * 3, 16, key=k[0]), "l2": eqx.nn.Linear(16, CLASSES, key=k[1])}

  def apply(m, x):
    def one(x):  # One example: the equinox idiom, batched with vmap.
      return m["l2"](jnp.tanh(m["l1"](x.reshape(-1))))

    return jax.vmap(one)(x)

  paths = lambda m: ("dense", "kron", (f"{m}/weight", f"{m}/bias"))  # noqa: E731
  return _eqx_zoo(model, _images(jax.random.key(0)), apply, [paths("l1"), paths("l2")])


def equinox_cnn() -> Zoo:
  import equinox as eqx  # pylint: disable=g-import-not-at-top

  k = jax.random.split(jax.random.key(3), 3)
  model = {
    "c1": eqx.nn.Conv2d(3, 4, 3, padding=1, key=k[0]),
    "c2": eqx.nn.Conv2d(4, 6, 3, stride=2, key=k[1]),
    "head": eqx.nn.Linear(6 * 3 * 3, CLASSES, key=k[2]),
  }

  def apply(m, x):
    def one(x):  # [H, W, C] -> equinox's channel-first layout.
      x = jax.nn.relu(m["c1"](x.transpose(2, 0, 1)))
      x = jax.nn.relu(m["c2"](x))
      return m["head"](x.reshape(-1))

    return jax.vmap(one)(x)

  return _eqx_zoo(
    model,
    _images(jax.random.key(0)),
    apply,
    [
      ("conv", "kron", ("c1/weight", "c1/bias")),
      ("conv", "kron", ("c2/weight", "c2/bias")),
      ("dense", "kron", ("head/weight", "head/bias")),
    ],
  )


def gemma_rmsnorm() -> Zoo:
  """A pre-norm residual MLP block with Gemma's RMSNorm, `x̂ * (1 + scale)`, scale init 0."""

  class RMSNorm(nn.Module):
    @nn.compact
    def __call__(self, x):
      scale = self.param("scale", nn.initializers.zeros, (x.shape[-1],))
      x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)
      return x * (1 + scale)

  class Model(nn.Module):
    @nn.compact
    def __call__(self, ids):
      x = nn.Embed(VOCAB, DIM)(ids)
      h = nn.Dense(2 * DIM, use_bias=False)(RMSNorm()(x))
      x = x + nn.Dense(DIM, use_bias=False)(nn.gelu(h))
      return nn.Dense(VOCAB, use_bias=False)(RMSNorm()(x))

  k1, k2 = jax.random.split(jax.random.key(4))
  batch = {
    "x": jax.random.randint(k1, (N, SEQ), 0, VOCAB),
    "y": jax.random.randint(k2, (N, SEQ), 0, VOCAB),
  }
  f, p, b = _linen(Model(), batch)
  dense = lambda m: ("dense", "kron", (f"{m}/kernel",))  # noqa: E731
  norm = lambda m: ("scale_and_shift", "full", (f"{m}/scale",))  # noqa: E731
  return Zoo(
    f,
    p,
    b,
    [
      dense("Dense_0"),
      dense("Dense_1"),
      dense("Dense_2"),
      ("embedding", "kron", ("Embed_0/embedding",)),
      norm("RMSNorm_0"),
      norm("RMSNorm_1"),
    ],
  )


def vit_positional() -> Zoo:
  """Patch embedding (strided conv), a learned positional table `x + pos`, pos: [1, L, D]."""

  class ViT(nn.Module):
    @nn.compact
    def __call__(self, x):
      x = nn.Conv(DIM, (2, 2), strides=(2, 2))(x)  # [N, 4, 4, D]
      x = x.reshape(x.shape[0], -1, DIM)
      pos = self.param("pos_embedding", nn.initializers.normal(0.02), (1, x.shape[1], DIM))
      x = x + pos
      h = nn.Dense(2 * DIM)(nn.LayerNorm()(x))
      x = x + nn.Dense(DIM)(nn.gelu(h))
      return nn.Dense(CLASSES)(jnp.mean(nn.LayerNorm()(x), axis=1))

  f, p, b = _linen(ViT(), _images(jax.random.key(0)))
  return Zoo(
    f,
    p,
    b,
    [
      _conv("Conv_0"),
      _dense("Dense_0"),
      _dense("Dense_1"),
      _dense("Dense_2"),
      _norm("LayerNorm_0"),
      _norm("LayerNorm_1"),
      ("scale_and_shift", "diagonal", ("pos_embedding",)),
    ],
  )


def lstm() -> Zoo:
  """Flax `nn.OptimizedLSTMCell` (gate kernels concatenated before one product) over T steps."""
  hidden, steps = 6, 3

  class Model(nn.Module):
    @nn.compact
    def __call__(self, x):
      cell = nn.OptimizedLSTMCell(hidden)
      carry = cell.initialize_carry(jax.random.key(0), x[:, 0].shape)
      for t in range(x.shape[1]):
        carry, y = cell(carry, x[:, t])
      return nn.Dense(CLASSES)(y)

  k1, k2 = jax.random.split(jax.random.key(5))
  batch = {"x": jax.random.normal(k1, (N, steps, 4)), "y": jax.random.randint(k2, (N,), 0, CLASSES)}
  f, p, b = _linen(Model(), batch)
  c = "OptimizedLSTMCell_0"
  gates = ("i", "f", "g", "o")  # The cell's concatenation order.
  return Zoo(
    f,
    p,
    b,
    [
      _dense("Dense_0"),
      (
        "dense",
        "kron_indep",
        tuple(f"{c}/h{g}/kernel" for g in gates) + tuple(f"{c}/h{g}/bias" for g in gates),
      ),
      ("dense", "kron_indep", tuple(f"{c}/i{g}/kernel" for g in gates)),
    ],
  )


def lstm_rnn() -> Zoo:
  """The same cell run by `nn.RNN` (a `lax.scan` over time, the cell's params closed over):
  the gate kernels are concatenated inside the scan body, once a step."""
  hidden, steps = 6, 5

  class Model(nn.Module):
    @nn.compact
    def __call__(self, x):
      y = nn.RNN(nn.OptimizedLSTMCell(hidden))(x)
      return nn.Dense(CLASSES)(y[:, -1])

  k1, k2 = jax.random.split(jax.random.key(7))
  batch = {"x": jax.random.normal(k1, (N, steps, 4)), "y": jax.random.randint(k2, (N,), 0, CLASSES)}
  f, p, b = _linen(Model(), batch)
  c = "OptimizedLSTMCell_0"  # nn.RNN adds no scope of its own to the cell params.
  gates = ("i", "f", "g", "o")
  return Zoo(
    f,
    p,
    b,
    [
      _dense("Dense_0"),
      (
        "dense",
        "kron_indep",
        tuple(f"{c}/h{g}/kernel" for g in gates) + tuple(f"{c}/h{g}/bias" for g in gates),
      ),
      ("dense", "kron_indep", tuple(f"{c}/i{g}/kernel" for g in gates)),
    ],
  )


LM_VOCAB = 32_768


def vocab_lm() -> Zoo:
  """A 16-wide LM with a 32k-vocabulary head: the size policy keeps the head's output factor as
  its diagonal, so the state stays within a few times the parameters."""

  class LM(nn.Module):
    @nn.compact
    def __call__(self, ids):
      x = nn.Embed(LM_VOCAB, 16)(ids)
      x = x + nn.Dense(16)(nn.gelu(nn.Dense(16)(x)))
      return nn.Dense(LM_VOCAB)(x)

  k1, k2 = jax.random.split(jax.random.key(6))
  batch = {
    "x": jax.random.randint(k1, (N, 4), 0, LM_VOCAB),
    "y": jax.random.randint(k2, (N, 4), 0, LM_VOCAB),
  }
  f, p, b = _linen(LM(), batch)
  return Zoo(
    f,
    p,
    b,
    [
      _dense("Dense_0"),
      _dense("Dense_1"),
      ("dense", "kron_out_diag", ("Dense_2/kernel", "Dense_2/bias")),
      ("embedding", "kron", ("Embed_0/embedding",)),
    ],
  )


STRUCTURE_MODELS = {
  "haiku_mlp": haiku_mlp,
  "haiku_cnn": haiku_cnn,
  "equinox_mlp": equinox_mlp,
  "equinox_cnn": equinox_cnn,
  "gemma_rmsnorm": gemma_rmsnorm,
  "vit_positional": vit_positional,
  "lstm": lstm,
  "lstm_rnn": lstm_rnn,
  "vocab_lm": vocab_lm,
}


# ==============================================================================================
# Transformations (issue 13): scan over stacked layers, remat, vmap-created layers.
# ==============================================================================================

LM_LAYERS, LM_HEADS, LM_KV_HEADS, LM_HEAD_DIM, LM_FF = 3, 4, 2, 4, 24
LM_DIM = LM_HEADS * LM_HEAD_DIM


def _rope(x):
  """Rotary position embedding over [batch, seq, heads, head_dim] (half-split convention)."""
  seq, dim = x.shape[1], x.shape[-1]
  freq = 1.0 / (10000.0 ** (jnp.arange(0, dim // 2) / (dim // 2)))
  angle = jnp.arange(seq)[:, None] * freq[None, :]  # [seq, dim/2]
  cos, sin = jnp.cos(angle)[None, :, None, :], jnp.sin(angle)[None, :, None, :]
  x1, x2 = x[..., : dim // 2], x[..., dim // 2 :]
  return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)


def _gqa(q, k, v):
  """Causal grouped-query attention: q [b, s, H, d], k / v [b, s, KV, d]."""
  rep = q.shape[2] // k.shape[2]
  k, v = jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2)
  logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(q.shape[-1])
  mask = jnp.tril(jnp.ones((q.shape[1], q.shape[1]), bool))
  logits = jnp.where(mask, logits, -1e9)
  return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits, axis=-1), v)


class LinenDecoderBlock(nn.Module):
  """Pre-norm decoder block: RMSNorm, GQA attention with RoPE, RMSNorm, SwiGLU MLP."""

  @nn.compact
  def __call__(self, x, _):
    b, s, _ = x.shape
    h = nn.RMSNorm(name="attn_norm")(x)
    q = nn.Dense(LM_HEADS * LM_HEAD_DIM, use_bias=False, name="q")(h)
    k = nn.Dense(LM_KV_HEADS * LM_HEAD_DIM, use_bias=False, name="k")(h)
    v = nn.Dense(LM_KV_HEADS * LM_HEAD_DIM, use_bias=False, name="v")(h)
    q = _rope(q.reshape(b, s, LM_HEADS, LM_HEAD_DIM))
    k = _rope(k.reshape(b, s, LM_KV_HEADS, LM_HEAD_DIM))
    att = _gqa(q, k, v.reshape(b, s, LM_KV_HEADS, LM_HEAD_DIM)).reshape(b, s, LM_DIM)
    x = x + nn.Dense(LM_DIM, use_bias=False, name="o")(att)
    h = nn.RMSNorm(name="mlp_norm")(x)
    gate = nn.Dense(LM_FF, use_bias=False, name="gate")(h)
    up = nn.Dense(LM_FF, use_bias=False, name="up")(h)
    return x + nn.Dense(LM_DIM, use_bias=False, name="down")(nn.silu(gate) * up), None


class LinenScannedLM(nn.Module):
  """Decoder LM: the blocks stacked by `nn.scan` over `nn.remat(block)`, params axis 0."""

  @nn.compact
  def __call__(self, ids):
    x = nn.Embed(VOCAB, LM_DIM, name="embed")(ids)
    blocks = nn.scan(
      nn.remat(LinenDecoderBlock),
      variable_axes={"params": 0},
      split_rngs={"params": True},
      length=LM_LAYERS,
    )
    x, _ = blocks(name="blocks")(x, None)
    return nn.Dense(VOCAB, use_bias=False, name="head")(nn.RMSNorm(name="final_norm")(x))


class NnxDecoderBlock(nnx.Module):
  def __init__(self, rngs):
    lin = lambda i, o: nnx.Linear(i, o, use_bias=False, rngs=rngs)  # noqa: E731
    self.attn_norm = nnx.RMSNorm(LM_DIM, rngs=rngs)
    self.q, self.o = lin(LM_DIM, LM_DIM), lin(LM_DIM, LM_DIM)
    self.k, self.v = lin(LM_DIM, LM_KV_HEADS * LM_HEAD_DIM), lin(LM_DIM, LM_KV_HEADS * LM_HEAD_DIM)
    self.mlp_norm = nnx.RMSNorm(LM_DIM, rngs=rngs)
    self.gate, self.up, self.down = lin(LM_DIM, LM_FF), lin(LM_DIM, LM_FF), lin(LM_FF, LM_DIM)

  def __call__(self, x):
    b, s, _ = x.shape
    h = self.attn_norm(x)
    q = _rope(self.q(h).reshape(b, s, LM_HEADS, LM_HEAD_DIM))
    k = _rope(self.k(h).reshape(b, s, LM_KV_HEADS, LM_HEAD_DIM))
    v = self.v(h).reshape(b, s, LM_KV_HEADS, LM_HEAD_DIM)
    x = x + self.o(_gqa(q, k, v).reshape(b, s, LM_DIM))
    h = self.mlp_norm(x)
    return x + self.down(nnx.silu(self.gate(h)) * self.up(h))


class NnxScannedLM(nnx.Module):
  """The same LM in nnx: blocks created by `nnx.vmap`, applied by `nnx.scan` of `nnx.remat`."""

  def __init__(self, rngs):
    self.embed = nnx.Embed(VOCAB, LM_DIM, rngs=rngs)

    @nnx.split_rngs(splits=LM_LAYERS)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(rngs):
      return NnxDecoderBlock(rngs)

    self.blocks = make(rngs)
    self.final_norm = nnx.RMSNorm(LM_DIM, rngs=rngs)
    self.head = nnx.Linear(LM_DIM, VOCAB, use_bias=False, rngs=rngs)

  def __call__(self, ids):
    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    @nnx.remat
    def run(x, block):
      return block(x)

    return self.head(self.final_norm(run(self.embed(ids), self.blocks)))


def scanned_lm(flavour: str) -> Zoo:
  k1, k2 = jax.random.split(jax.random.key(0))
  batch = {
    "x": jax.random.randint(k1, (N, SEQ), 0, VOCAB),
    "y": jax.random.randint(k2, (N, SEQ), 0, VOCAB),
  }
  kernel = lambda name: ("dense", "kron", (f"{name}/kernel",))  # noqa: E731
  rms = lambda name: ("scale_and_shift", "full", (f"{name}/scale",))  # noqa: E731
  if flavour == "linen":
    f, p, b = _linen(LinenScannedLM(), batch)
    blk = "blocks"
  else:
    f, p, b = _nnx(NnxScannedLM(nnx.Rngs(0)), batch)
    blk = "blocks"
  per_block = sorted(
    [rms(f"{blk}/attn_norm"), rms(f"{blk}/mlp_norm")]
    + [kernel(f"{blk}/{n}") for n in ("down", "gate", "k", "o", "q", "up", "v")],
    key=lambda e: e[2],
  )
  expected = sorted(
    [("embedding", "kron", ("embed/embedding",)), rms("final_norm"), kernel("head")] + per_block,
    key=lambda e: e[2],
  )
  return Zoo(f, p, b, expected)


class LinenStackedMLP(nn.Module):
  """A residual MLP whose layers are stacked by `nn.scan` (params axis 0)."""

  @nn.compact
  def __call__(self, x):
    x = nn.Dense(16, name="stem")(x.reshape(x.shape[0], -1))

    class Layer(nn.Module):
      @nn.compact
      def __call__(self, h, _):
        return h + jnp.tanh(nn.Dense(16, name="dense")(nn.LayerNorm(name="norm")(h))), None

    layers = nn.scan(
      Layer, variable_axes={"params": 0}, split_rngs={"params": True}, length=LM_LAYERS
    )
    x, _ = layers(name="layers")(x, None)
    return nn.Dense(CLASSES, name="head")(x)


class NnxStackedMLP(nnx.Module):
  """The same MLP in nnx: layers created by `nnx.vmap`, applied by `nnx.scan`."""

  def __init__(self, rngs):
    self.stem = nnx.Linear(8 * 8 * 3, 16, rngs=rngs)

    class Layer(nnx.Module):
      def __init__(self, rngs):
        self.norm = nnx.LayerNorm(16, rngs=rngs)
        self.dense = nnx.Linear(16, 16, rngs=rngs)

      def __call__(self, h):
        return h + jnp.tanh(self.dense(self.norm(h)))

    @nnx.split_rngs(splits=LM_LAYERS)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(rngs):
      return Layer(rngs)

    self.layers = make(rngs)
    self.head = nnx.Linear(16, CLASSES, rngs=rngs)

  def __call__(self, x):
    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    def run(h, layer):
      return layer(h)

    return self.head(run(self.stem(x.reshape(x.shape[0], -1)), self.layers))


def stacked_mlp(flavour: str) -> Zoo:
  batch = _images(jax.random.key(0))
  if flavour == "linen":
    f, p, b = _linen(LinenStackedMLP(), batch)
  else:
    f, p, b = _nnx(NnxStackedMLP(nnx.Rngs(0)), batch)
  expected = sorted(
    [_dense("head"), _dense("layers/dense"), _norm("layers/norm"), _dense("stem")],
    key=lambda e: e[2],
  )
  return Zoo(f, p, b, expected)


# The zoo models whose layers are stacked (`LayerSpec.stack_size == LM_LAYERS`).
STACKED_MODELS = {"scanned_lm": scanned_lm, "stacked_mlp": stacked_mlp}
MODELS.update(STACKED_MODELS)
