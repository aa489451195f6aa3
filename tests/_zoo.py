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
from typing import Any, Callable

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
  return {"x": jax.random.normal(kx, (N, hw, hw, c)),
          "y": jax.random.randint(ky, (N,), 0, CLASSES)}


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
    return Zoo(f, p, b, [_norm("BatchNorm_0"), _norm("BatchNorm_1"), _norm("BatchNorm_2"),
                         conv("Conv_0"), conv("Conv_1"), conv("Conv_2"), _dense("Dense_0")])
  model = NnxResNet(nnx.Rngs(0))
  model.train()
  f, p, b = _nnx(model, batch)
  return Zoo(f, p, b, [_norm("b0"), _norm("b1"), _norm("b2"), conv("c0"), conv("c1"),
                       conv("c2"), _dense("head")])


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
  batch = {"x": jax.random.randint(k1, (N, SEQ), 0, VOCAB),
           "y": jax.random.randint(k2, (N, SEQ), 0, VOCAB)}
  emb = lambda name: ("embedding", "kron", (f"{name}/embedding",))  # noqa: E731
  if flavour == "linen":
    f, p, b = _linen(LinenLM(), batch)
    blk = "LinenBlock_0"
    att = f"{blk}/MultiHeadDotProductAttention_0"
    return Zoo(f, p, b, [
        _dense("Dense_0"), emb("Embed_0"), _norm("LayerNorm_0"), _dense(f"{blk}/Dense_0"),
        _dense(f"{blk}/Dense_1"), _norm(f"{blk}/LayerNorm_0"), _norm(f"{blk}/LayerNorm_1"),
        _dense(f"{att}/key"), _dense(f"{att}/out"), _dense(f"{att}/query"),
        _dense(f"{att}/value")])
  f, p, b = _nnx(NnxLM(nnx.Rngs(0)), batch)
  return Zoo(f, p, b, [
      _dense("attn/key"), _dense("attn/out"), _dense("attn/query"), _dense("attn/value"),
      _dense("down"), emb("embed"), _dense("head"), _norm("ln1"), _norm("ln2"), _norm("ln_f"),
      _dense("up")])


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
    return Zoo(f, p, b, [_conv("Conv_0"), _conv("Conv_1", "diagonal"), _conv("Conv_2"),
                         _dense("Dense_0")])
  f, p, b = _nnx(NnxSeparable(nnx.Rngs(0)), batch)
  return Zoo(f, p, b, [_conv("depthwise", "diagonal"), _dense("head"), _conv("pointwise"),
                       _conv("stem")])


MODELS = {"mlp": mlp, "cnn": cnn, "resnet": resnet, "transformer": transformer,
          "separable": separable}


# ================================================================================================
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

  return _hk_zoo(net, _images(jax.random.key(0)), [
      ("conv", "kron", ("conv2_d/w", "conv2_d/b")),
      ("conv", "kron", ("conv2_d_1/w", "conv2_d_1/b")),
      ("dense", "kron", ("linear/w", "linear/b"))])


def _eqx_zoo(model, batch, apply, expected):
  import equinox as eqx  # pylint: disable=g-import-not-at-top (optional test extra)
  params, static = eqx.partition(model, eqx.is_array)

  def loss_fn(p, b):
    return _ce(apply(eqx.combine(p, static), b["x"]), b["y"])

  return Zoo(loss_fn, params, batch, expected)


def equinox_mlp() -> Zoo:
  import equinox as eqx  # pylint: disable=g-import-not-at-top
  k = jax.random.split(jax.random.key(2))
  model = {"l1": eqx.nn.Linear(8 * 8 * 3, 16, key=k[0]),
           "l2": eqx.nn.Linear(16, CLASSES, key=k[1])}

  def apply(m, x):
    def one(x):  # One example: the equinox idiom, batched with vmap.
      return m["l2"](jnp.tanh(m["l1"](x.reshape(-1))))
    return jax.vmap(one)(x)

  paths = lambda m: ("dense", "kron", (f"{m}/weight", f"{m}/bias"))  # noqa: E731
  return _eqx_zoo(model, _images(jax.random.key(0)), apply, [paths("l1"), paths("l2")])


def equinox_cnn() -> Zoo:
  import equinox as eqx  # pylint: disable=g-import-not-at-top
  k = jax.random.split(jax.random.key(3), 3)
  model = {"c1": eqx.nn.Conv2d(3, 4, 3, padding=1, key=k[0]),
           "c2": eqx.nn.Conv2d(4, 6, 3, stride=2, key=k[1]),
           "head": eqx.nn.Linear(6 * 3 * 3, CLASSES, key=k[2])}

  def apply(m, x):
    def one(x):  # [H, W, C] -> equinox's channel-first layout.
      x = jax.nn.relu(m["c1"](x.transpose(2, 0, 1)))
      x = jax.nn.relu(m["c2"](x))
      return m["head"](x.reshape(-1))
    return jax.vmap(one)(x)

  return _eqx_zoo(model, _images(jax.random.key(0)), apply, [
      ("conv", "kron", ("c1/weight", "c1/bias")), ("conv", "kron", ("c2/weight", "c2/bias")),
      ("dense", "kron", ("head/weight", "head/bias"))])


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
  batch = {"x": jax.random.randint(k1, (N, SEQ), 0, VOCAB),
           "y": jax.random.randint(k2, (N, SEQ), 0, VOCAB)}
  f, p, b = _linen(Model(), batch)
  dense = lambda m: ("dense", "kron", (f"{m}/kernel",))  # noqa: E731
  norm = lambda m: ("scale_and_shift", "full", (f"{m}/scale",))  # noqa: E731
  return Zoo(f, p, b, [dense("Dense_0"), dense("Dense_1"), dense("Dense_2"),
                       ("embedding", "kron", ("Embed_0/embedding",)), norm("RMSNorm_0"),
                       norm("RMSNorm_1")])


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
  return Zoo(f, p, b, [
      _conv("Conv_0"), _dense("Dense_0"), _dense("Dense_1"), _dense("Dense_2"),
      _norm("LayerNorm_0"), _norm("LayerNorm_1"),
      ("scale_and_shift", "diagonal", ("pos_embedding",))])


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
  batch = {"x": jax.random.normal(k1, (N, steps, 4)),
           "y": jax.random.randint(k2, (N,), 0, CLASSES)}
  f, p, b = _linen(Model(), batch)
  c = "OptimizedLSTMCell_0"
  gates = ("i", "f", "g", "o")  # The cell's concatenation order.
  return Zoo(f, p, b, [
      _dense("Dense_0"),
      ("dense", "kron_indep", tuple(f"{c}/h{g}/kernel" for g in gates)
       + tuple(f"{c}/h{g}/bias" for g in gates)),
      ("dense", "kron_indep", tuple(f"{c}/i{g}/kernel" for g in gates))])


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
  batch = {"x": jax.random.randint(k1, (N, 4), 0, LM_VOCAB),
           "y": jax.random.randint(k2, (N, 4), 0, LM_VOCAB)}
  f, p, b = _linen(LM(), batch)
  return Zoo(f, p, b, [_dense("Dense_0"), _dense("Dense_1"),
                       ("dense", "kron_out_diag", ("Dense_2/kernel", "Dense_2/bias")),
                       ("embedding", "kron", ("Embed_0/embedding",))])


STRUCTURE_MODELS = {"haiku_mlp": haiku_mlp, "haiku_cnn": haiku_cnn, "equinox_mlp": equinox_mlp,
                    "equinox_cnn": equinox_cnn, "gemma_rmsnorm": gemma_rmsnorm,
                    "vit_positional": vit_positional, "lstm": lstm, "vocab_lm": vocab_lm}
